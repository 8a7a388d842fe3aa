"""A policy defined outside spade: registering it is the only step.

The toy below lives in this test module and is registered at test time; no file
of spade is edited, yet it is listed by ``spade policies``, validates as a config
section (errors name its fields) and decodes in ``spade run``.
"""

import json
from typing import Literal

import pytest
import torch
from pydantic import Field

from spade.cli import main
from spade.config import ConfigSection, load_config
from spade.errors import ConfigError
from spade.policies import POLICIES, Policy, Selection
from spade.policies.common import empty_indices, is_dense


class ToyWindowPolicyConfig(ConfigSection):
    name: Literal["toy_window"] = "toy_window"
    budget: int = Field(24, gt=0)
    """The most recent tokens attended (no sinks)."""


class ToyWindowPolicy(Policy):
    """toy: the ``budget`` most recent tokens, nothing else."""

    name = "toy_window"
    needs_current_query = False

    def select(self, state, layer, q, k_cache, kv_lens):
        if is_dense(state, self.cfg.budget, self.name):
            return None
        idx = empty_indices(k_cache.shape[0], k_cache.shape[1], k_cache.device)
        return Selection(indices=idx, n_sink=0, n_recent=self.cfg.budget, kv_start=state.kv_start)


@pytest.fixture
def toy():
    POLICIES.register("toy_window", ToyWindowPolicy, config=ToyWindowPolicyConfig)
    try:
        yield
    finally:
        POLICIES.unregister("toy_window")


def test_toy_policy_is_listed(toy, capsys):
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert "toy_window" in out and "toy: the ``budget`` most recent tokens" in out


def test_toy_policy_validates(toy):
    cfg = load_config(None, overrides=["policy.name=toy_window", "policy.budget=32"])
    assert isinstance(cfg.policy, ToyWindowPolicyConfig) and cfg.policy.budget == 32
    with pytest.raises(ConfigError, match=r"policy\.budget: .*greater than 0"):
        load_config(None, overrides=["policy.name=toy_window", "policy.budget=0"])
    with pytest.raises(ConfigError, match=r"policy\.window: unknown key .*allowed: name, budget"):
        load_config(None, overrides=["policy.name=toy_window", "policy.window=3"])


def test_toy_policy_gone_after_unregister(toy):
    POLICIES.unregister("toy_window")
    try:
        with pytest.raises(ConfigError, match="unknown policy 'toy_window'"):
            load_config(None, overrides=["policy.name=toy_window"])
    finally:
        POLICIES.register("toy_window", ToyWindowPolicy, config=ToyWindowPolicyConfig)


def test_toy_policy_runs(toy, tmp_path, capsys):
    out = tmp_path / "run.json"
    rc = main(["run", "--quiet", "--out", str(out),
               "--set", "model.name=tiny", "--set", "model.max_seq_len=128",
               "--set", "policy.name=toy_window", "--set", "policy.budget=24",
               "--set", "generation.prompts=[{essay_tokens: 40, text: 'hi'}]",
               "--set", "generation.max_new_tokens=4", "--set", "generation.stream=false"])
    assert rc == 0, capsys.readouterr().err
    s = json.loads(out.read_text())
    assert s["policy"] == "toy_window" and s["budget"] == 24
    assert s["generated_tokens"] == [4]
    assert 0 < s["tokens_attended_per_step"] <= 24
    assert torch.is_tensor(torch.zeros(1))  # torch stays importable alongside the plugin

"""Shared fixtures of the runtime tests: a tiny random FastModel on CPU (fp32),
left-padded prompts, and reference runs through the inline path."""

from __future__ import annotations

import pytest
import torch

from spade.attention import AttentionContext, InlineSelector
from spade.config import load_config
from spade.models.fast import FastModel
from spade.models.presets import preset_config
from spade.policies import build_policy
from spade.runtime.base import timed_loop

#: prompt rows (left padded), prompt length, generated tokens
B, T, NEW = 3, 12, 18
#: asyncspade settings: the budget is crossed at decode step 3 (cache length 15) and
#: later steps attend about half the context, so sparse tokens differ from dense ones
BUDGET = 14
POLICY = ["policy.name=asyncspade", f"policy.budget={BUDGET}", "policy.sink_tokens=2", "policy.recent_tokens=3",
          "policy.window=4", "policy.predictor=assembled"]


@pytest.fixture(scope="session", autouse=True)
def _one_cpu_thread():
    """Small CPU GEMMs crawl with 2 OpenMP threads on a busy 2-core box; the cache
    process spawned by the runtime inherits the same count (same numerics)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    monkeypatch.setenv("SPADE_KERNELS", "torch")


@pytest.fixture(scope="session")
def model() -> FastModel:
    torch.manual_seed(1234)
    return FastModel.from_config(preset_config("tiny"), device="cpu", dtype=torch.float32, max_batch=B,
                                 max_seq_len=48)


@pytest.fixture(scope="session")
def prompt() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 500, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :3] = 0  # left padding on two rows
    mask[2, :6] = 0
    ids[mask == 0] = 0
    return ids, mask


def config(*overrides: str):
    return load_config(None, overrides=[*POLICY, *overrides])


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def run_with_selector(model, policy, make_selector, ids, mask, new: int = NEW):
    """The inline loop (InlineRuntime's) with a custom selector: the reference for
    runtime behaviours InlineRuntime has no switch for (threshold, stale, dense)."""
    state = policy.new_state(ids.shape[0], model.device)
    ctx = AttentionContext(model.spec, make_selector(policy, state), device=model.device)
    logits = model.prefill(ids, mask, ctx)
    rows, _ = timed_loop(model, logits, max_new_tokens=new, sample_fn=greedy, on_token=None,
                         step=lambda tok: model.decode(tok, ctx))
    return rows


def free_port() -> int:
    """A free TCP port p with p + 1 free too (the nccl transport uses both)."""
    from spade.transports._framing import free_port as free_ports

    return free_ports(span=2)


@pytest.fixture(scope="session")
def inline_tokens(model, prompt):
    """InlineRuntime's tokens with the asyncspade policy (the exactness target)."""
    from spade.runtime.inline import InlineRuntime

    cfg = config()
    pol = build_policy(cfg.policy, model.spec)
    return InlineRuntime(cfg, model, pol).generate(*prompt, max_new_tokens=NEW, sample_fn=greedy).tokens


class Selectors:
    """Reference selectors (inline, on the current step)."""

    @staticmethod
    def threshold(theta: int):
        def make(policy, state):
            from spade.runtime.asyncrt import ThresholdSelector

            return ThresholdSelector(policy, state, theta)
        return make

    @staticmethod
    def dense_from(seq: int):
        """Policy selections until the cache reaches ``seq``, dense from there."""
        class Sel(InlineSelector):
            def selection(self, layer, q, k, kv_lens):
                if self.state.seq_len >= seq:
                    return None
                return super().selection(layer, q, k, kv_lens)
        return Sel

    @staticmethod
    def frozen_from(seq: int):
        """Policy selections until the cache reaches ``seq``; from there, the last
        selection made before (one step earlier) forever."""
        from spade.policies.base import Selection

        class Sel(InlineSelector):
            frozen: dict = {}

            def selection(self, layer, q, k, kv_lens):
                if self.state.seq_len >= seq:
                    return self.frozen[layer]
                sel = super().selection(layer, q, k, kv_lens)
                if self.state.seq_len == seq - 1:
                    self.frozen[layer] = Selection(sel.indices.clone(), sel.n_sink, sel.n_recent, sel.kv_start)
                return sel
        Sel.frozen = {}
        return Sel


def generate_cfg(cfg, model, prompt, new: int = NEW, **kw):
    """One generation of ``prompt`` through an ``AsyncRuntime`` built from ``cfg`` (closed
    after); ``kw`` goes to ``generate`` (e.g. ``on_token``)."""
    from spade.runtime.asyncrt import AsyncRuntime

    rt = AsyncRuntime(cfg, model, build_policy(cfg.policy, model.spec))
    try:
        return rt.generate(*prompt, max_new_tokens=new, sample_fn=greedy, **kw)
    finally:
        rt.close()

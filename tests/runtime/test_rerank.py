"""Two-stage selection (``policy.rerank`` m > 1) through every topology: the cache rank
ships ``m * K_mid`` candidates, the inference rank re-ranks them with the true query;
greedy tokens are InlineRuntime's with the same setting (fp32, CPU)."""

from __future__ import annotations

import pytest

from spade.policies import build_policy
from spade.runtime.inline import InlineRuntime
from spade.runtime.protocol import packs_of
from tests.runtime.conftest import BUDGET, NEW, T, config, free_port, generate_cfg, greedy


def _inline(model, prompt, cfg):
    return InlineRuntime(cfg, model, build_policy(cfg.policy, model.spec)).generate(
        *prompt, max_new_tokens=NEW, sample_fn=greedy).tokens


def _async(model, prompt, cfg):
    return generate_cfg(cfg, model, prompt)


@pytest.fixture(scope="module")
def rerank_tokens(model, prompt):
    return _inline(model, prompt, config("policy.rerank=2"))


def test_rerank_changes_the_tokens(model, prompt, inline_tokens, rerank_tokens):
    """On this model the re-rank matters (so the equivalence tests below cannot pass by
    ignoring it): its tokens differ from one-stage selection's."""
    assert rerank_tokens != inline_tokens


@pytest.mark.parametrize("topology,pack,mode", [
    ("colocated", 2, "indices"),
    ("colocated", 1, "kv"),   # the candidates' K/V travel; re-ranked on the gathered copy
    ("local", 1, "delta"),    # slot-aligned deltas of the candidate set
    ("local", 3, "kv"),
])
def test_rerank_matches_inline_tokens(model, prompt, rerank_tokens, topology, pack, mode):
    tr = _async(model, prompt, config("policy.rerank=2", f"runtime.topology={topology}",
                                      f"runtime.pack_layers={pack}", f"runtime.return_mode={mode}"))
    assert tr.tokens == rerank_tokens
    sparse_steps = sum(1 for s in range(1, NEW) if T + s > BUDGET)
    assert tr.stats["sparse_steps"] == sparse_steps > 0 and tr.late_packs == 0
    assert tr.stats["sel_messages"] >= sparse_steps * len(packs_of(model.spec.n_layers, pack))


@pytest.mark.parametrize("topology,pack,mode", [("colocated", 2, "kv"), ("local", 1, "delta")])
def test_rerank_with_refresh_every_matches_inline(model, prompt, rerank_tokens, topology, pack, mode):
    """``refresh_every=3``: the candidate set is reused between refreshes and re-ranked by
    each step's true query, the same on both paths."""
    cfg = config("policy.rerank=3", "policy.refresh_every=3", f"runtime.topology={topology}",
                 f"runtime.pack_layers={pack}", f"runtime.return_mode={mode}")
    want = _inline(model, prompt, cfg)
    assert _async(model, prompt, cfg).tokens == want


def test_rerank_multiprocess_matches_inline(model, prompt, rerank_tokens):
    """The cache rank in its own process (gloo): its policy, built from the config, selects
    the candidates; the tokens are the inline ones."""
    cfg = config("policy.rerank=2", "runtime.topology=multiprocess", "runtime.transport.name=nccl",
                 f"runtime.transport.master_port={free_port()}", "runtime.transport.timeout_s=60",
                 "runtime.pack_layers=2", "runtime.return_mode=indices")
    assert _async(model, prompt, cfg).tokens == rerank_tokens

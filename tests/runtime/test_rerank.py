"""Two-stage selection (``policy.rerank`` m > 1) through every topology: the cache rank
ships ``m * K_mid`` candidates, the inference rank re-ranks them with the true query;
greedy tokens are InlineRuntime's with the same setting (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from spade.policies import build_policy
from spade.runtime.inline import InlineRuntime
from spade.runtime.protocol import packs_of
from tests.runtime.conftest import B, BUDGET, NEW, T, config, free_port, generate_cfg, greedy


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


# ---------------------------------------------------------------------------------------------
# policy.rerank_keys: int8 — the re-rank scores the candidates on the context's int8 key copy

INT8 = ("policy.rerank=2", "policy.rerank_keys=int8")


@pytest.fixture
def int8_reranks(monkeypatch):
    """Counts the re-ranks that scored int8 keys with their scales (and fails on any
    other while the list is armed)."""
    from spade import kernels

    seen, real = [], kernels.rerank_select

    def spy(q, k, cand, keep, **kw):
        seen.append((k.dtype, kw.get("k_scale") is not None))
        return real(q, k, cand, keep, **kw)

    monkeypatch.setattr(kernels, "rerank_select", spy)
    return seen


@pytest.fixture(scope="module")
def int8_tokens(model, prompt):
    return _inline(model, prompt, config(*INT8))


def _inline_ctx(model, prompt, cfg, new=NEW):
    """The inline loop, returning (tokens, the attention context)."""
    from spade.attention import AttentionContext, InlineSelector
    from spade.runtime.base import timed_loop

    ids, mask = prompt
    pol = build_policy(cfg.policy, model.spec)
    ctx = AttentionContext(model.spec, InlineSelector(pol, pol.new_state(ids.shape[0], model.device)),
                           device=model.device)
    logits = model.prefill(ids, mask, ctx)
    rows, _ = timed_loop(model, logits, max_new_tokens=new, sample_fn=greedy, on_token=None,
                         step=lambda tok: model.decode(tok, ctx))
    return rows, ctx


def test_int8_key_copy_follows_the_cache(model, prompt, int8_reranks):
    """After a prefill and every decode step the context's copy is ``quantize_keys`` of the
    cache at every written position (prompt, padding, each step's key), and every re-rank
    scored it; ``rerank_keys: exact`` keeps no copy."""
    from spade import kernels

    tokens, ctx = _inline_ctx(model, prompt, config(*INT8))
    S = T + NEW - 1  # the cache length after the last decode step
    assert ctx.key_copy is not None and len(ctx.key_copy.kq) == model.spec.n_layers
    for layer in range(model.spec.n_layers):
        kq, ks = ctx.key_copy.keys(layer)
        want_q, want_s = kernels.quantize_keys(model.k_cache[layer][:B, :, :S])
        assert torch.equal(kq[:, :, :S], want_q) and torch.equal(ks[:, :, :S], want_s)
        assert not kq[:, :, S:].any()  # nothing written past the cache
    assert int8_reranks and all(k == (torch.int8, True) for k in int8_reranks)
    _, ctx = _inline_ctx(model, prompt, config("policy.rerank=2"), new=2)
    assert ctx.key_copy is None


def test_int8_keys_change_the_rerank(model, prompt, rerank_tokens, int8_tokens):
    """The copy is what the re-rank reads: with the prompt's keys quantised coarsely (every
    scale x 64, so the rounding dominates) the kept sets, and so the tokens, change; at the
    real scales the int8 run's tokens are the exact-key run's or differ only by the copy's
    rounding (not asserted: either is right)."""
    from spade import kernels

    real = kernels.quantize_keys

    def coarse(k):
        q8, s8 = real(k)
        return (q8.float() / 64).round().to(q8.dtype), s8 * 64

    try:
        kernels.quantize_keys = coarse
        coarse_tokens = _inline(model, prompt, config(*INT8))
    finally:
        kernels.quantize_keys = real
    assert coarse_tokens != int8_tokens


@pytest.mark.parametrize("topology,pack,mode", [
    ("colocated", 2, "indices"),
    ("local", 1, "delta"),
    ("local", 3, "indices"),
])
def test_int8_rerank_matches_inline_tokens(model, prompt, int8_tokens, int8_reranks, topology, pack, mode):
    """Every topology's inference rank keeps its own copy from the same keys: the inline
    run's tokens, every re-rank on int8 keys."""
    tr = _async(model, prompt, config(*INT8, f"runtime.topology={topology}", f"runtime.pack_layers={pack}",
                                      f"runtime.return_mode={mode}"))
    assert tr.tokens == int8_tokens and tr.stats["sparse_steps"] > 0
    assert int8_reranks and all(k == (torch.int8, True) for k in int8_reranks)


def test_int8_rerank_with_refresh_every_matches_inline(model, prompt):
    cfg = config("policy.rerank=3", "policy.rerank_keys=int8", "policy.refresh_every=3",
                 "runtime.topology=colocated", "runtime.pack_layers=2")
    assert _async(model, prompt, cfg).tokens == _inline(model, prompt, cfg)


def test_int8_rerank_refuses_the_kv_return_mode(model, prompt):
    from spade.errors import ConfigError

    with pytest.raises(ConfigError, match="rerank_keys=int8 .* kv return mode"):
        _async(model, prompt, config(*INT8, "runtime.topology=local", "runtime.return_mode=kv"))


def test_int8_rerank_multiprocess_matches_inline(model, prompt, int8_tokens):
    cfg = config(*INT8, "runtime.topology=multiprocess", "runtime.transport.name=nccl",
                 f"runtime.transport.master_port={free_port()}", "runtime.transport.timeout_s=60",
                 "runtime.pack_layers=2", "runtime.return_mode=indices")
    assert _async(model, prompt, cfg).tokens == int8_tokens


def test_int8_key_copy_of_a_paged_cache(model, prompt, int8_tokens):
    """A paged cache (blocks of 4 under the model's table): the copy is a pool of the
    cache's layout, ``quantize_keys`` of the logical cache through the same table, and
    the tokens are the contiguous cache's."""
    from spade import kernels
    from spade.kernels.paged import paged_to_contiguous
    from spade.models.fast import FastModel
    from spade.models.presets import preset_config

    paged = FastModel.from_config(preset_config("tiny"), device="cpu", dtype=torch.float32, max_batch=B,
                                  max_seq_len=48, block_size=4)
    tokens, ctx = _inline_ctx(paged, prompt, config(*INT8))
    assert tokens == int8_tokens
    S = T + NEW - 1
    table = paged.block_table
    for layer in range(paged.spec.n_layers):
        kq, ks = ctx.key_copy.keys(layer)
        assert kq.shape == paged.k_cache[layer].shape
        want_q, want_s = kernels.quantize_keys(paged_to_contiguous(paged.k_cache[layer], table)[:, :, :S])
        assert torch.equal(paged_to_contiguous(kq, table)[:, :, :S], want_q)
        assert torch.equal(paged_to_contiguous(ks[..., None], table)[:, :, :S, 0], want_s)

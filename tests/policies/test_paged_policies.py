"""Every policy on a paged KV cache: the same selections and outputs as on the contiguous one.

Each case builds one random logical cache two ways: contiguous [B, Hkv, L, D], and a
pool of shuffled blocks under a random table (``scatter_to_pool``) in which every slot
a row must never read holds NaN (blocks no row owns, blocks wholly before a row's
``kv_start``, the slots before ``kv_start`` and past the prompt), so a policy that reads
one through the table shows it. The contiguous side's unused slots hold large finite
garbage instead. ``prefill`` gets the whole contiguous cache on one side, and on the
paged side only the prompt's view with ``state.cache_len`` set to the capacity. Each
decode step appends one key/value to both (an index assign; ``paged_write``), runs
``select`` (the pool and ``state.block_table`` on the paged side), attention, then
``observe``: the selections must be identical and the outputs agree (fp32, 1e-5).
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from spade import kernels
from spade.kernels.paged import paged_write, scatter_to_pool
from spade.policies import POLICIES, build_policy
from spade.policies.base import AttentionSpec, PolicyState, RopeSpec, Selection
from spade.policies.common import layer_carry

GARBAGE = 6.0
SINK, RECENT = 2, 3

POLICY_CASES = {  # id -> (policy name, config)
    "full": ("full", {}),
    "streaming": ("streaming", dict(budget=12, sink_tokens=SINK, recent_tokens=RECENT)),
    "oracle": ("oracle", dict(budget=12, sink_tokens=SINK, recent_tokens=RECENT)),
    "oracle-K1": ("oracle", dict(budget=RECENT + 1, sink_tokens=0, recent_tokens=RECENT)),  # one middle token
    "oracle-sum_logits": ("oracle", dict(budget=12, sink_tokens=SINK, recent_tokens=RECENT,
                                         group_reduce="sum_logits")),
    "quest": ("quest", dict(budget=16, page_size=4)),
    "tova": ("tova", dict(budget=8)),
    "tova-K2": ("tova", dict(budget=2)),
    "asyncspade-exact": ("asyncspade", dict(budget=12, sink_tokens=SINK, recent_tokens=RECENT, window=4)),
    "asyncspade-int8": ("asyncspade", dict(budget=12, sink_tokens=SINK, recent_tokens=RECENT, window=4,
                                           score_keys="int8")),
    "asyncspade-int4": ("asyncspade", dict(budget=12, sink_tokens=SINK, recent_tokens=RECENT, window=4,
                                           score_keys="int4")),
    "asyncspade-refresh4": ("asyncspade", dict(budget=12, sink_tokens=SINK, recent_tokens=RECENT, window=4,
                                               refresh_every=4)),
    "asyncspade-int8-refresh4": ("asyncspade", dict(budget=12, sink_tokens=SINK, recent_tokens=RECENT, window=4,
                                                    score_keys="int8", refresh_every=4)),
    "asyncspade-channels": ("asyncspade", dict(budget=12, sink_tokens=SINK, recent_tokens=RECENT, window=4,
                                               score_channels=8, channel_refresh=1.1)),  # re-chosen mid-decode
    "asyncspade-int4-channels": ("asyncspade", dict(budget=12, sink_tokens=SINK, recent_tokens=RECENT, window=4,
                                                    score_keys="int4", score_channels=8)),
    "asyncspade-int8-channels": ("asyncspade", dict(budget=12, sink_tokens=SINK, recent_tokens=RECENT, window=4,
                                                    score_keys="int8", score_channels=8, channel_refresh=1.1)),
    "asyncspade-int4-channels-kept": ("asyncspade", dict(budget=12, sink_tokens=SINK, recent_tokens=RECENT, window=4,
                                                         score_keys="int4", score_channels=8,
                                                         channel_refresh=None)),  # served: each row's own choice
    "asyncspade-rerank": ("asyncspade", dict(budget=12, sink_tokens=SINK, recent_tokens=RECENT, window=4,
                                             rerank=2)),
    "asyncspade-K-ge-context": ("asyncspade", dict(budget=256, sink_tokens=SINK, recent_tokens=RECENT)),
}

SHAPES = {  # id -> (B, Hq, Hkv, prompt, steps, kv_start)
    "B1-MHA": (1, 2, 2, 37, 8, None),
    "B3-GQA-padded": (3, 4, 2, 29, 7, [0, 5, 2]),
}


def _setup(B, Hq, Hkv, T, steps, kv_start, bs, *, D=16, seed=0, extra=5):
    """The contiguous cache (prompt real, garbage elsewhere), the paged pools and table
    (NaN wherever a row must not read), and the true keys / values / queries."""
    L = T + steps + extra
    g = torch.Generator().manual_seed(seed)
    k_all, v_all = torch.randn(B, Hkv, L, D, generator=g), torch.randn(B, Hkv, L, D, generator=g)
    q_all = torch.randn(B, Hq, L, D, generator=g)
    starts = [0] * B if kv_start is None else kv_start
    pos = torch.arange(L)
    real = (pos[None, :] >= torch.tensor(starts)[:, None]) & (pos[None, :] < T)  # [B, L]
    m = real[:, None, :, None]
    kc = torch.where(m, k_all, torch.randn(B, Hkv, L, D, generator=g) * GARBAGE + GARBAGE)
    vc = torch.where(m, v_all, torch.randn(B, Hkv, L, D, generator=g) * GARBAGE + GARBAGE)
    nan = torch.tensor(float("nan"))
    src = torch.cat([torch.where(m, k_all, nan), torch.where(m, v_all, nan)], dim=-1)
    pool, table = scatter_to_pool(src, bs, g, lens=torch.full((B,), L))  # room for the decoded tokens
    unowned = sorted(set(range(pool.shape[0])) - set(table.flatten().tolist()))
    for b in range(B):  # blocks wholly before kv_start: unowned (the poisoned block)
        for j in range(starts[b] // bs):
            table[b, j] = unowned[0]
    assert torch.isnan(pool[unowned[0]]).all()
    kp, vp = pool[..., :D].contiguous(), pool[..., D:].contiguous()
    return k_all, v_all, q_all, kc, vc, kp, vp, table, L


def _policy(name, cfg, B, Hq, Hkv, D=16, rope=None, n_layers=2):
    spec = AttentionSpec(n_layers=n_layers, n_q_heads=Hq, n_kv_heads=Hkv, head_dim=D, rope=rope)
    return build_policy(POLICIES.config(name)(**cfg), spec)


def _same_selection(a: Selection | None, b: Selection | None, what: str) -> None:
    assert (a is None) == (b is None), what
    if a is None:
        return
    assert a.indices.shape == b.indices.shape, what
    assert torch.equal(a.indices, b.indices), what
    assert (a.n_sink, a.n_recent, a.keep, a.keep_reduce) == (b.n_sink, b.n_recent, b.keep, b.keep_reduce), what
    assert (a.kv_start is None) == (b.kv_start is None), what
    if a.kv_start is not None:
        assert torch.equal(a.kv_start, b.kv_start), what


def _attend(pol, sel, q, k, v, kv_lens, kv_start, block_table=None):
    scale = pol.spec.softmax_scale
    if sel is None:
        return kernels.sparse_decode_attention(q, k, v, kv_lens, None, scale=scale, kv_start=kv_start,
                                               block_table=block_table)
    if sel.keep > 0:
        sel = sel.reranked(q, k, scale, block_table=block_table)
    return kernels.sparse_decode_attention(q, k, v, kv_lens, sel.indices, n_sink=sel.n_sink,
                                           n_recent=sel.n_recent, scale=scale,
                                           kv_start=sel.kv_start if sel.kv_start is not None else kv_start,
                                           block_table=block_table), sel


def run_both(name, cfg, shape, bs, *, prefill="prefill", table_at_prefill=False, rope=None, seed=0, keep=None):
    """Prefill (``prefill``, ``prefill_rows`` of every row, each with ``state.join_pool`` set:
    ``"prefill_pool"``, ``"pool"``, or none) then decode on both caches; returns the number of sparse
    selections compared (``keep``: a list the paged side's final state is appended to)."""
    B, Hq, Hkv, T, steps, kv_start = shape
    D = 16
    k_all, v_all, q_all, kc, vc, kp, vp, table, L = _setup(B, Hq, Hkv, T, steps, kv_start, bs, D=D, seed=seed)
    starts = None if kv_start is None else torch.tensor(kv_start, dtype=torch.int32)
    pol_c = _policy(name, cfg, B, Hq, Hkv, D, rope)
    pol_p = _policy(name, cfg, B, Hq, Hkv, D, rope)
    st_c, st_p = pol_c.new_state(B, "cpu"), pol_p.new_state(B, "cpu")
    for st in (st_c, st_p):
        st.kv_start = starts
        st.seq_len = T
    st_p.cache_len = L  # the prefill's view is the prompt alone
    if table_at_prefill:
        st_p.block_table = table  # allowed by the contract: a prefill's keys are contiguous all the same
    n_layers = pol_c.spec.n_layers
    kv_lens = torch.full((B,), T, dtype=torch.int32)
    for layer in range(n_layers):
        q = q_all[:, :, :T]
        if prefill in ("prefill", "prefill_pool"):  # prefill_pool: a static batch's prompt in a paged cache
            pol_c.prefill(st_c, layer, q, kc, vc, kv_lens)
            st_p.join_pool = (kp, table) if prefill == "prefill_pool" else None
            pol_p.prefill(st_p, layer, q, kc[:, :, :T], vc[:, :, :T], kv_lens)
            st_p.join_pool = None
        elif prefill in ("rows", "pool"):  # a serving join of every row, on the paged side
            pol_c.prefill(st_c, layer, q, kc, vc, kv_lens)
            st_p.join_pool = (kp, table) if prefill == "pool" else None  # state kept in the pool's layout
            pol_p.prefill_rows(st_p, layer, list(range(B)), q, kc[:, :, :T], vc[:, :, :T], kv_lens)
            st_p.join_pool = None
    st_p.block_table = table
    sparse = 0
    for step in range(steps):
        pos = T + step
        kc[:, :, pos], vc[:, :, pos] = k_all[:, :, pos], v_all[:, :, pos]
        paged_write(kp, table, k_all[:, :, pos:pos + 1], pos)
        paged_write(vp, table, v_all[:, :, pos:pos + 1], pos)
        kv_lens = kv_lens + 1
        st_c.seq_len = st_p.seq_len = pos + 1
        for layer in range(n_layers):
            what = f"step {step} layer {layer}"
            q = q_all[:, :, pos]
            sel_c = pol_c.select(st_c, layer, q, kc, kv_lens)
            sel_p = pol_p.select(st_p, layer, q, kp, kv_lens)
            _same_selection(sel_c, sel_p, what)
            res_c = _attend(pol_c, sel_c, q, kc, vc, kv_lens, starts)
            res_p = _attend(pol_p, sel_p, q, kp, vp, kv_lens, starts, table)
            if sel_c is not None:
                sparse += 1
                (out_c, kept_c), (out_p, kept_p) = res_c, res_p
                _same_selection(kept_c, kept_p, what + " (re-ranked)")
            else:
                out_c, out_p = res_c, res_p
            assert torch.isfinite(out_p).all(), what
            torch.testing.assert_close(out_p, out_c, rtol=1e-5, atol=1e-5, msg=what)
            pol_c.observe(st_c, layer, q, kc, kv_lens)
            pol_p.observe(st_p, layer, q, kp, kv_lens)
    if keep is not None:
        keep.append(st_p)
    return sparse


@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("case", list(POLICY_CASES))
def test_paged_policy_matches_contiguous(case, shape, bs):
    name, cfg = POLICY_CASES[case]
    sparse = run_both(name, cfg, SHAPES[shape], bs, seed=zlib.crc32(f"{case}/{shape}/{bs}".encode()) % 1000)
    dense = name == "full" or cfg.get("budget", 0) >= 64
    assert (sparse == 0) if dense else (sparse > 0)


@pytest.mark.parametrize("case", ["quest", "tova", "asyncspade-exact", "asyncspade-int8", "asyncspade-int4",
                                  "asyncspade-channels"])
def test_paged_policy_without_prefill(case):
    """No prefill reported: what a policy builds at its first decode call (Quest's page
    bounds read through the table into pool bounds, asyncspade's scoring copy and channels
    from the logical keys) matches the contiguous cache's."""
    name, cfg = POLICY_CASES[case]
    kept = []
    run_both(name, cfg, SHAPES["B3-GQA-padded"], 4, prefill="none", seed=3, keep=kept)
    if name == "quest":  # the pool's blocks, one page slot each (pages of 4 in blocks of 4)
        n_blocks = 3 * -(-(29 + 7 + 5) // 4) + 3
        assert all(st.paged and st.kmin.shape[0] == n_blocks and st.kmin.shape[2] == 1 for st in kept[0].layers)


@pytest.mark.parametrize("case", ["quest", "tova", "asyncspade-int8", "asyncspade-int4", "asyncspade-exact"])
def test_paged_policy_prefill_rows(case):
    """A serving join (``prefill_rows``) of the prompt alone sizes the state for the
    cache's capacity (``cache_len``) as ``prefill`` of the whole cache does."""
    name, cfg = POLICY_CASES[case]
    run_both(name, cfg, SHAPES["B3-GQA-padded"], 16, prefill="rows", seed=4)


@pytest.mark.parametrize("how", ["pool", "prefill_pool"])
@pytest.mark.parametrize("kernels_impl", ["torch", "triton"])
@pytest.mark.parametrize("case", ["quest", "asyncspade-int4", "asyncspade-int8", "asyncspade-int4-channels",
                                  "asyncspade-int8-channels", "asyncspade-int4-channels-kept"])
def test_paged_policy_join_into_the_pool(case, kernels_impl, how, monkeypatch):
    """A serving join (``prefill_rows``) or a static batch's prefill on a paged cache, with
    ``state.join_pool``: Quest's page bounds and asyncspade's int8 / int4 copy (of a channel
    subset too, re-chosen mid-decode and requantised into the pool: a static batch's
    ``score_channels``; or each joining row's own, kept: served ``channel_refresh: null``)
    are written into the pool's blocks (sized by the pool, not by the capacity) and every
    decode step selects what the contiguous cache does."""
    if "channels" in case and how == "pool" and POLICY_CASES[case][1].get("channel_refresh", 2.0) is not None:
        pytest.skip("(channels re-chosen for the whole batch: serving refuses channel_refresh)")
    if kernels_impl == "triton" and case != "quest" and (case, how) != ("asyncspade-int4", "prefill_pool"):
        pytest.skip("(the interpreter's ~25 s per asyncspade case: the pool-copy kernels are tested in "
                    "tests/kernels; one case here)")
    if kernels_impl == "triton" and torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("drives the kernels on CPU tensors (interpreter)")
    monkeypatch.setenv("SPADE_KERNELS", kernels_impl)
    name, cfg = POLICY_CASES[case]
    kept = []
    assert run_both(name, cfg, SHAPES["B3-GQA-padded"], 4, prefill=how, seed=8, keep=kept) > 0
    n_blocks = 3 * -(-(29 + 7 + 5) // 4) + 3  # scatter_to_pool's pool: the rows' blocks, 2 spare, 1 poisoned
    layers = kept[0].layers
    assert layers and all(st.paged for st in layers)
    held = [st.kmin if name == "quest" else st.kq for st in layers]
    assert all(t.shape[0] == n_blocks and t.shape[2] == (1 if name == "quest" else 4) for t in held)
    if "channels" in case:  # 8 of 16 channels: int8 bytes, or int4's packed half of them
        assert all(t.shape[3] == (4 if "int4" in case else 8) for t in held)


@pytest.mark.parametrize("case", ["quest", "tova", "asyncspade-int4", "asyncspade-int4-channels"])
def test_paged_prefill_ignores_the_table(case):
    """``state.block_table`` already set at prefill: the prefill's keys are contiguous all the same."""
    name, cfg = POLICY_CASES[case]
    run_both(name, cfg, SHAPES["B3-GQA-padded"], 4, table_at_prefill=True, seed=5)


def test_paged_asyncspade_rope_aware_padded():
    name, cfg = POLICY_CASES["asyncspade-int8"]
    run_both(name, {**cfg, "rope_aware": True, "predictor": "assembled"}, SHAPES["B3-GQA-padded"], 4,
             rope=RopeSpec(theta=10000.0), seed=6)


def test_asyncspade_copy_sized_for_capacity():
    """The int8 copy a prompt-only prefill makes has the cache's capacity: decoding never
    rebuilds it (the same buffer throughout)."""
    B, Hq, Hkv, T, steps, kv_start = SHAPES["B3-GQA-padded"]
    pol = _policy("asyncspade", POLICY_CASES["asyncspade-int8"][1], B, Hq, Hkv, n_layers=1)
    k_all, v_all, q_all, kc, vc, kp, vp, table, L = _setup(B, Hq, Hkv, T, steps, kv_start, 4)
    st = pol.new_state(B, "cpu")
    st.seq_len, st.cache_len, st.kv_start = T, L, torch.tensor(kv_start, dtype=torch.int32)
    pol.prefill(st, 0, q_all[:, :, :T], kc[:, :, :T], vc[:, :, :T], torch.full((B,), T))
    kq = st.layers[0].kq
    assert kq.shape[2] == L
    st.block_table = table
    kv_lens = torch.full((B,), T)
    for step in range(3):
        paged_write(kp, table, k_all[:, :, T + step:T + step + 1], T + step)
        kv_lens = kv_lens + 1
        st.seq_len = T + step + 1
        pol.select(st, 0, None, kp, kv_lens)
        pol.observe(st, 0, q_all[:, :, T + step], kp, kv_lens)
        assert st.layers[0].kq is kq


def test_rerank_on_a_pool_needs_the_table():
    """``Selection.reranked`` of a paged cache's pool without its table is refused."""
    B, Hq, Hkv, T, steps, kv_start = SHAPES["B3-GQA-padded"]
    _, _, q_all, kc, _, kp, _, table, _ = _setup(B, Hq, Hkv, T, steps, kv_start, 4)
    cand = torch.tensor([[[10, 12, -1, 14]] * Hkv] * B, dtype=torch.int32)
    sel = Selection(indices=cand, n_sink=2, n_recent=3, keep=2)
    with pytest.raises(ValueError, match="block_table"):
        sel.reranked(q_all[:, :, T - 1], kp, 0.25)
    a = sel.reranked(q_all[:, :, T - 1], kc, 0.25)
    b = sel.reranked(q_all[:, :, T - 1], kp, 0.25, block_table=table)
    assert torch.equal(a.indices, b.indices)
    out = torch.empty(B, Hkv, 2, dtype=torch.int32)
    c = sel.reranked(q_all[:, :, T - 1], kp, 0.25, out=out, block_table=table)
    assert c.indices is out and torch.equal(out, a.indices)


def test_carry_through_a_table_is_sized_by_its_rows(monkeypatch):
    """Keys read through a table (a pool of 9 blocks) carry a threshold per table row and
    KV head, not per block."""
    monkeypatch.setenv("SPADE_KERNELS", "triton")
    st = PolicyState(batch_size=2)
    pool, table = torch.zeros(9, 2, 4, 8), torch.zeros(2, 3, dtype=torch.int32)
    c = layer_carry(st, 0, "carry", pool, table)
    assert c is not None and c.shape[:2] == (2, 2) and st.carry[0] is c
    assert layer_carry(st, 0, "carry", torch.zeros(2, 2, 12, 8)) is c  # contiguous keys of the same rows


TRITON_CASES = ["oracle", "quest", "tova", "asyncspade-exact", "asyncspade-int8"]


@pytest.mark.parametrize("case", TRITON_CASES)
def test_paged_policy_with_triton_kernels(case, monkeypatch):
    """The same through the Triton kernels (the interpreter on CPU): the paged scoring, with
    asyncspade's default ``topk: carry`` through the table."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("drives the kernels on CPU tensors (interpreter)")
    monkeypatch.setenv("SPADE_KERNELS", "triton")
    name, cfg = POLICY_CASES[case]
    shape = (2, 4, 2, 21, 3, [0, 3])
    assert run_both(name, cfg, shape, 4, seed=7) > 0

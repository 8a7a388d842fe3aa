"""``Policy.prefill_rows``: a request joining a running batch (serving) gets the state a
prefill of it alone gives, and keeps selecting what it selects alone, while the rows
around it keep theirs. Rows sit right-aligned at a shared cursor (``spade.serving.slots``)."""

from __future__ import annotations

import pytest
import torch

from spade.policies import build_policy
from spade.policies.base import AttentionSpec, RopeSpec
from spade.policies.asyncspade import AsyncSpadePolicyConfig
from spade.policies.oracle import OraclePolicyConfig
from spade.policies.quest import QuestPolicyConfig
from spade.policies.streaming import StreamingPolicyConfig
from spade.policies.tova import TovaPolicyConfig

SPEC = AttentionSpec(n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=16, rope=RopeSpec(theta=10000.0, dim=16))
L = 64
#: (cursor at the join, prompt length, decode steps after it): rows join a batch at
#: different cursors; first positions 0, 9, 1 (Quest's pages of 4 are counted from each
#: row's own first position, so a join needs no page alignment)
JOINS = [(12, 12, 3), (15, 6, 4), (20, 19, 9)]

CONFIGS = {
    "asyncspade": AsyncSpadePolicyConfig(budget=10, sink_tokens=1, recent_tokens=2, window=16),
    "asyncspade_ridge_int8": AsyncSpadePolicyConfig(budget=10, sink_tokens=1, recent_tokens=2, window=16,
                                                    predictor="ridge", score_keys="int8"),
    "asyncspade_int4": AsyncSpadePolicyConfig(budget=10, sink_tokens=1, recent_tokens=2, window=16,
                                              predictor="last", score_keys="int4"),
    "oracle": OraclePolicyConfig(budget=10, sink_tokens=1, recent_tokens=2),
    "quest": QuestPolicyConfig(budget=8, page_size=4),
    "tova": TovaPolicyConfig(budget=7),
    "streaming": StreamingPolicyConfig(budget=8, sink_tokens=2, recent_tokens=2),
}


def _mask(sel, kv_lens: torch.Tensor) -> torch.Tensor:
    return sel.to_mask(kv_lens, L)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_joined_rows_select_as_alone(name):
    pol = build_policy(CONFIGS[name], SPEC)
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D = 3, SPEC.n_q_heads, SPEC.n_kv_heads, SPEC.head_dim
    total = max(S + n for S, _, n in JOINS)
    # per row: the keys / values / queries of its whole sequence (prompt then decoded tokens)
    seq_k = torch.randn(B, SPEC.n_layers, Hkv, total, D, generator=g)
    seq_v = torch.randn(B, SPEC.n_layers, Hkv, total, D, generator=g)
    seq_q = torch.randn(B, SPEC.n_layers, Hq, total, D, generator=g)
    kb = torch.zeros(SPEC.n_layers, B, Hkv, L, D)  # the batch's cache (garbage before kv_start)
    vb = torch.zeros_like(kb)
    batch = pol.new_state(B, "cpu")
    kv_start = torch.zeros(B, dtype=torch.int32)
    alone = [None] * B  # per row: (state, k [n_layers, 1, Hkv, L, D], v)
    done = [0] * B  # tokens of the row's sequence in the cache
    S = 0
    compared = 0
    events = sorted((S0, r) for r, (S0, _, _) in enumerate(JOINS))
    for S_join, r in events:
        while S < S_join:  # decode steps of the rows already in, until this join's cursor
            S += 1
            compared += _step(pol, batch, alone, kb, vb, seq_k, seq_v, seq_q, kv_start, done, S)
        T = JOINS[r][1]
        kb[:, r, :, S - T:S] = seq_k[r, :, :, :T]
        vb[:, r, :, S - T:S] = seq_v[r, :, :, :T]
        kv_start[r] = S - T
        batch.seq_len, batch.kv_start = S, kv_start
        st = pol.new_state(1, "cpu")
        st.seq_len = T
        ka = torch.zeros(SPEC.n_layers, 1, Hkv, L, D)
        va = torch.zeros_like(ka)
        ka[:, 0, :, :T] = seq_k[r, :, :, :T]
        va[:, 0, :, :T] = seq_v[r, :, :, :T]
        for layer in range(SPEC.n_layers):
            q = seq_q[r:r + 1, layer, :, :T]
            pol.prefill_rows(batch, layer, [r], q, kb[layer, r:r + 1], vb[layer, r:r + 1], torch.tensor([S]))
            pol.prefill(st, layer, q, ka[layer], va[layer], torch.tensor([T]))
        alone[r] = (st, ka, va)
        done[r] = T
    for _ in range(JOINS[-1][2]):
        S += 1
        compared += _step(pol, batch, alone, kb, vb, seq_k, seq_v, seq_q, kv_start, done, S)
    assert compared >= 6  # sparse selections were really compared


def _step(pol, batch, alone, kb, vb, seq_k, seq_v, seq_q, kv_start, done, S) -> int:
    """One decode step at cursor ``S`` (the cache length, this token included) for every
    joined row, in the batch and alone; returns how many sparse selections matched."""
    B = kb.shape[1]
    rows = [r for r in range(B) if alone[r] is not None]
    n = 0
    for r in rows:  # this step's key and value, at index S - 1 in the batch
        t = done[r]
        kb[:, r, :, S - 1] = seq_k[r, :, :, t]
        vb[:, r, :, S - 1] = seq_v[r, :, :, t]
        alone[r][1][:, 0, :, t] = seq_k[r, :, :, t]
        alone[r][2][:, 0, :, t] = seq_v[r, :, :, t]
    batch.seq_len, batch.kv_start = S, kv_start
    kv = torch.full((B,), S)
    for layer in range(SPEC.n_layers):
        q = torch.zeros(B, SPEC.n_q_heads, SPEC.head_dim)
        for r in rows:
            q[r] = seq_q[r, layer, :, done[r]]
        sel_b = pol.select(batch, layer, q, kb[layer], kv)
        for r in rows:
            st, ka, va = alone[r]
            st.seq_len = done[r] + 1
            own = torch.tensor([done[r] + 1])
            sel_a = pol.select(st, layer, q[r:r + 1], ka[layer], own)
            if sel_a is None:  # dense alone: the slot batch attends this row densely (its own threshold)
                continue
            assert sel_b is not None
            mb = _mask(sel_b, kv)[r, :, int(kv_start[r]):S]
            ma = _mask(sel_a, own)[0, :, :done[r] + 1]
            assert torch.equal(mb, ma), f"row {r} layer {layer} at cursor {S}"
            n += 1
        pol.observe(batch, layer, q, kb[layer], kv)
        for r in rows:
            st, ka, va = alone[r]
            pol.observe(st, layer, q[r:r + 1], ka[layer], torch.tensor([done[r] + 1]))
    for r in rows:
        done[r] += 1
    return n


def test_a_join_after_a_batch_prefill_keeps_the_other_rows_windows():
    """A cache rank restarted mid-serving boots the whole batch with ``prefill`` (one
    query per row); a request joining later resets its own row only: the other rows
    keep their window counts."""
    pol = build_policy(CONFIGS["asyncspade"], SPEC)
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, D, T = 3, SPEC.n_q_heads, SPEC.n_kv_heads, SPEC.head_dim, 10
    st = pol.new_state(B, "cpu")
    st.seq_len, st.kv_start = T, torch.zeros(B, dtype=torch.int32)
    k = torch.randn(B, Hkv, L, D, generator=g)
    for layer in range(SPEC.n_layers):
        pol.prefill(st, layer, torch.randn(B, Hq, 1, D, generator=g), k, k, torch.full((B,), T))
    st.seq_len = T + 3  # two decode steps later
    before = pol.n_valid(st, 0)
    assert before == 3
    st.kv_start[1] = st.seq_len - 5  # a 5-token prompt joins row 1
    for layer in range(SPEC.n_layers):
        pol.prefill_rows(st, layer, [1], torch.randn(1, Hq, 5, D, generator=g), k[1:2], k[1:2],
                         torch.full((1,), st.seq_len))
        assert pol.row_counts(st, layer) == [before, 5, before]

    # rows with different window fills predict per fill; the index of each fill's rows is
    # made once (a CUDA-graph capture of the step reuses it: no host-to-device copy inside)
    import spade.policies.asyncspade as A

    made = []
    real = A.device_index

    def counting(*a, **kw):
        made.append(a[0])
        return real(*a, **kw)

    A.device_index = counting
    try:
        first = pol.predict_query(st, 0, torch.full((B,), st.seq_len))
        n_made = len(made)
        again = pol.predict_query(st, 0, torch.full((B,), st.seq_len))
    finally:
        A.device_index = real
    assert n_made == 2 and len(made) == n_made  # one index per fill, none on the repeat
    torch.testing.assert_close(first, again)
    from spade.policies.predictors import predict, rotate

    win = st.layers[0].window
    kv = torch.full((B,), st.seq_len)
    pos = pol._positions(st, kv)
    for rows_, n in (([0, 2], before), ([1], 5)):  # each fill's rows: what they predict alone
        want = predict(win[rows_], n, pol.cfg.predictor, pol.cfg.ridge_eps)
        if pol.rope_aware:
            want = rotate(want, pos[rows_], SPEC.rope)
        torch.testing.assert_close(first[rows_], want)


def test_idle_rows_keep_the_batch_on_one_graph_key():
    """Rows that never joined (idle slots) count as full windows: a batch whose joined rows'
    windows are full has one graph key from its first step, not one per step while idle
    rows would fill (on a GPU each new key of the cache rank runs eagerly). A short prompt
    (fewer queries than the window) still gets its own count, as it has alone."""
    pol = build_policy(CONFIGS["asyncspade_int4"], SPEC)
    g = torch.Generator().manual_seed(5)
    B, Hq, Hkv, D = 4, SPEC.n_q_heads, SPEC.n_kv_heads, SPEC.head_dim
    W = pol.rows
    st = pol.new_state(B, "cpu")
    T = W + 3
    st.seq_len, st.kv_start = T, torch.full((B,), T, dtype=torch.int32)
    st.kv_start[1] = 0
    k = torch.randn(1, Hkv, L, D, generator=g)
    for layer in range(SPEC.n_layers):  # a long prompt joins row 1 of an idle batch
        pol.prefill_rows(st, layer, [1], torch.randn(1, Hq, T, D, generator=g), k, k, torch.full((1,), T))
    keys = set()
    for step in range(4):
        st.seq_len = T + 1 + step
        assert pol.row_counts(st, 0) == [W] * B
        keys.add(pol.graph_key(st))
    assert len(keys) == 1
    short = 3  # a 3-token prompt joins row 2: its count is its own until its window fills
    st.kv_start[2] = st.seq_len - short
    for layer in range(SPEC.n_layers):
        pol.prefill_rows(st, layer, [2], torch.randn(1, Hq, short, D, generator=g), k, k,
                         torch.full((1,), st.seq_len))
    assert pol.row_counts(st, 0) == [W, W, short, W]


@pytest.mark.parametrize("name", ["oracle", "asyncspade_int4"])
def test_a_join_restarts_only_the_joining_rows_carried_threshold(name):
    """The threshold-carry top-K's state (GPU kernels; made here by hand): a join resets the
    joining row's carried threshold and keeps the other rows' thresholds and every row's
    counters (a speed hint: the selection is the exact top-K either way)."""
    from spade.kernels.carry import carry_threshold, new_carry

    pol = build_policy(CONFIGS[name], SPEC)
    B, Hq, Hkv, D, T, S = 3, SPEC.n_q_heads, SPEC.n_kv_heads, SPEC.head_dim, 6, 10
    g = torch.Generator().manual_seed(1)
    state = pol.new_state(B, "cpu")
    state.seq_len, state.kv_start = S, torch.tensor([0, S - T, 0], dtype=torch.int32)
    k, v = torch.randn(SPEC.n_layers, B, Hkv, L, D, generator=g), torch.randn(SPEC.n_layers, B, Hkv, L, D, generator=g)
    for layer in range(SPEC.n_layers):  # rows 0 and 2 prefilled as a batch first
        pol.prefill(state, layer, torch.randn(B, Hq, S, D, generator=g), k[layer], v[layer], torch.full((B,), S))
    for layer in range(SPEC.n_layers):
        c = state.carry[layer] = new_carry(B, Hkv, "cpu")
        c[..., 4] = torch.tensor(1.5).view(torch.int32)  # a carried threshold (per unit of query norm)
        c[..., 3] = 7  # calls so far
    for layer in range(SPEC.n_layers):
        pol.prefill_rows(state, layer, [1], torch.randn(1, Hq, T, D, generator=g), k[layer, 1:2], v[layer, 1:2],
                         torch.tensor([S]))
        c = state.carry[layer]
        thr = carry_threshold(c)
        assert torch.isinf(thr[1]).all() and (thr[[0, 2]] == 1.5).all()
        assert (c[..., 3] == 7).all()

"""Decode attention over a selection (sinks ∪ indices ∪ recent) and state merging.

Every result is checked against ``_expected``: a float64 loop over (b, KV head)
that builds the attended position set straight from the rule documented in
``spade.policies.base.Selection`` — written independently of the module's own
reference (which is checked against it too).

Tolerances are relative errors ``||out - exp|| / ||exp||`` per output dtype: the
expected value is computed in float64 from the same (rounded) inputs, so what is
left is the output rounding (half an ulp: 2^-24, 2^-11, 2^-8 relative for fp32,
fp16, bf16) plus, on a GPU, the probabilities rounded to the value dtype before
the second matmul — a few ulps of that dtype at most.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spade import kernels
from spade.kernels import attention as A
from tests.kernels.aot import run_aot_script

TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
LSE_ATOL = 1e-3
LENGTHS = (1, 7, 37, 130)
HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA


# ----------------------------------------------------------------------------- helpers
def _attended_positions(kv_len: int, s: int, idx_row, n_sink: int, n_recent: int, dense: bool) -> list[int]:
    """The attended set for one (b, h), straight from the Selection docstring."""
    if dense:
        return list(range(s, kv_len))
    sink = set(range(s, min(s + n_sink, kv_len)))
    mid = {int(i) for i in idx_row if int(i) >= 0}
    recent = set(range(max(kv_len - n_recent, s + n_sink), kv_len))
    return sorted(sink | mid | recent)


def _expected(q, k, v, kv_lens, indices, *, n_sink=0, n_recent=0, kv_start=None, scale=None):
    """float64 attention; returns (out [B, Hq, D] float64, lse [B, Hq] float64)."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    lse = torch.full((B, Hq), float("-inf"), dtype=torch.float64)
    qd, kd, vd = q.double().cpu(), k.double().cpu(), v.double().cpu()
    for b in range(B):
        s = 0 if kv_start is None else int(kv_start[b])
        for h in range(Hkv):
            row = None if indices is None else indices[b, h].tolist()
            pos = _attended_positions(int(kv_lens[b]), s, row or [], n_sink, n_recent, indices is None)
            if not pos:
                continue
            p_idx = torch.tensor(pos)
            for g in range(G):
                hq = h * G + g
                sc = (kd[b, h, p_idx] @ qd[b, hq]) * scale  # [n]
                lse[b, hq] = torch.logsumexp(sc, 0)
                out[b, hq] = torch.softmax(sc, 0) @ vd[b, h, p_idx]
    return out, lse


def _rel(out: torch.Tensor, exp: torch.Tensor) -> float:
    exp = exp.double().cpu()
    return ((out.double().cpu() - exp).norm() / exp.norm().clamp_min(1e-12)).item()


def _check(out, lse, exp_out, exp_lse, dtype):
    assert out.dtype == dtype
    assert _rel(out, exp_out) < TOL[dtype], _rel(out, exp_out)
    lse = lse.double().cpu()
    fin = torch.isfinite(exp_lse)
    assert torch.equal(torch.isfinite(lse), fin)  # empty sets: exactly -inf
    if fin.any():
        assert (lse[fin] - exp_lse[fin]).abs().max().item() < LSE_ATOL


def _middle_indices(kv_lens, kv_start, Hkv, k_mid, n_sink, n_recent, *, holes=0.2, fill_all=False,
                    gen=None):
    """Random disjoint middle indices [B, Hkv, k_mid] int32 from [sink_end, recent_start)
    (what a policy guarantees), shuffled, with -1 holes; ``fill_all`` takes every
    middle position (then k_mid must be >= the middle size)."""
    B = kv_lens.shape[0]
    out = torch.full((B, Hkv, k_mid), -1, dtype=torch.int32)
    for b in range(B):
        n = int(kv_lens[b])
        s = 0 if kv_start is None else int(kv_start[b])
        sink_end = min(s + n_sink, n)
        recent_start = max(n - n_recent, sink_end)
        cand = torch.arange(sink_end, recent_start)
        for h in range(Hkv):
            perm = cand[torch.randperm(len(cand), generator=gen)]
            take = perm if fill_all else perm[: k_mid]
            row = torch.full((k_mid,), -1, dtype=torch.int32)
            slots = torch.randperm(k_mid, generator=gen)[: len(take)]
            row[slots] = take.int()
            if not fill_all and holes > 0:
                row[torch.rand(k_mid, generator=gen) < holes] = -1
            out[b, h] = row
    return out


def _inputs(B, Hq, Hkv, D, L, dtype, device):
    q = torch.randn(B, Hq, D, dtype=dtype, device=device)
    k = torch.randn(B, Hkv, L, D, dtype=dtype, device=device)
    v = torch.randn(B, Hkv, L, D, dtype=dtype, device=device)
    return q, k, v


def _lens(B: int, case: int):
    """Per-row lengths cycling through the odd lengths (B=1 rotates over cases)."""
    return torch.tensor([LENGTHS[(case + i) % len(LENGTHS)] for i in range(B)])


# ----------------------------------------------------------------------------- dense
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [16, 64])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("B", [1, 3])
def test_dense_matches_float64(B, heads, D, dtype, device):
    Hq, Hkv = heads
    case = HEADS.index(heads) + D
    L = 131  # capacity beyond every length: positions >= kv_len are garbage
    q, k, v = _inputs(B, Hq, Hkv, D, L, dtype, device)
    kv_lens = _lens(B, case)
    kv_start = None
    if B == 3:  # left padding on some rows
        kv_start = torch.tensor([0, min(3, int(kv_lens[1]) - 1), 2])
        kv_start = torch.minimum(kv_start, kv_lens - 1)
    exp_out, exp_lse = _expected(q, k, v, kv_lens, None, kv_start=kv_start)
    kl = kv_lens.to(device)
    ks = None if kv_start is None else kv_start.to(device)
    out, lse = A.sparse_decode_attention_triton(q, k, v, kl, None, kv_start=ks, return_lse=True)
    _check(out, lse, exp_out, exp_lse, dtype)
    ref, ref_lse = A.sparse_decode_attention_ref(q, k, v, kl, None, kv_start=ks, return_lse=True)
    _check(ref, ref_lse, exp_out, exp_lse, dtype)


# ----------------------------------------------------------------------------- sparse
SPARSE_CASES = [  # (n_sink, n_recent, k_mid)
    (4, 8, 24),
    (0, 1, 5),
    (1, 16, 1),  # K = 1
    (2, 0, 200),  # K >= context: mostly holes
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [16, 64])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("B", [1, 3])
def test_sparse_matches_float64(B, heads, D, dtype, device):
    Hq, Hkv = heads
    case = HEADS.index(heads) * 2 + (D == 64) + 3 * (dtype == torch.float16)
    n_sink, n_recent, k_mid = SPARSE_CASES[case % len(SPARSE_CASES)]
    L = 130
    q, k, v = _inputs(B, Hq, Hkv, D, L, dtype, device)
    kv_lens = _lens(B, case)
    kv_start = torch.tensor([0, 2, 5])[:B] if B == 3 else None
    if kv_start is not None:
        kv_start = torch.minimum(kv_start, kv_lens)
    idx = _middle_indices(kv_lens, kv_start, Hkv, k_mid, n_sink, n_recent)
    exp_out, exp_lse = _expected(q, k, v, kv_lens, idx, n_sink=n_sink, n_recent=n_recent, kv_start=kv_start)
    kw = dict(n_sink=n_sink, n_recent=n_recent, return_lse=True,
              kv_start=None if kv_start is None else kv_start.to(device))
    out, lse = A.sparse_decode_attention_triton(q, k, v, kv_lens.to(device), idx.to(device),
                                                **kw)
    _check(out, lse, exp_out, exp_lse, dtype)
    ref, ref_lse = A.sparse_decode_attention_ref(q, k, v, kv_lens.to(device), idx.to(device), **kw)
    _check(ref, ref_lse, exp_out, exp_lse, dtype)


def _messy_middle(kv_lens, kv_start, Hkv, k_mid, n_sink, n_recent, L, gen, frac=0.3):
    """Policy-style middle indices (disjoint, shuffled, -1 holes) with a share of the
    slots overwritten by positions the kernels must ignore: left padding, the sinks,
    the recent window, past kv_len, past the cache capacity L, and values below -1."""
    idx = _middle_indices(kv_lens, kv_start, Hkv, k_mid, n_sink, n_recent, gen=gen)
    for b in range(kv_lens.shape[0]):
        n = int(kv_lens[b])
        s = 0 if kv_start is None else int(kv_start[b])
        sink_end = min(s + n_sink, n)
        recent_start = max(n - n_recent, sink_end)
        bad = torch.cat([torch.arange(0, sink_end), torch.arange(recent_start, L + 8), torch.arange(-7, -1)])
        for h in range(Hkv):
            hit = torch.rand(k_mid, generator=gen) < frac
            pick = torch.randint(0, len(bad), (k_mid,), generator=gen)
            idx[b, h] = torch.where(hit, bad[pick].int(), idx[b, h])
    return idx


REF_CASES = [  # (B, (Hq, Hkv), D, L, lens, kv_start, k_mid, n_sink, n_recent, num_splits, dtype)
    (1, (4, 1), 16, 67, [67], None, 9, 4, 8, None, torch.float32),  # MQA, B=1, heuristic splits
    (3, (4, 2), 16, 130, [130, 37, 7], [0, 2, 5], 1, 1, 16, 1, torch.float32),  # GQA, K=1, one split
    (3, (4, 4), 24, 99, [99, 61, 13], [3, 0, 1], 120, 2, 0, 4, torch.float32),  # MHA, K >= context
    (2, (6, 2), 16, 131, [131, 50], [0, 7], 33, 3, 5, 7, torch.bfloat16),  # G=3, several splits, bf16
    (2, (4, 2), 16, 77, [77, 1], None, 40, 0, 3, 3, torch.float16),  # a length-1 row, no sinks
]


@pytest.mark.parametrize("case", range(len(REF_CASES)))
def test_messy_indices_match_reference(case, device):
    """Against ``sparse_decode_attention_ref`` on fresh random inputs with -1 holes
    and out-of-range middle indices (ignored by both), odd lengths, kv_start, forced
    and heuristic split counts, statistics on."""
    B, (Hq, Hkv), D, L, lens, start, k_mid, n_sink, n_recent, splits, dtype = REF_CASES[case]
    gen = torch.Generator().manual_seed(1000 + case)
    q = torch.randn(B, Hq, D, generator=gen).to(device, dtype)
    k = torch.randn(B, Hkv, L, D, generator=gen).to(device, dtype)
    v = torch.randn(B, Hkv, L, D, generator=gen).to(device, dtype)
    kv_lens = torch.tensor(lens)
    kv_start = None if start is None else torch.tensor(start)
    idx = _messy_middle(kv_lens, kv_start, Hkv, k_mid, n_sink, n_recent, L, gen)
    kw = dict(n_sink=n_sink, n_recent=n_recent, return_lse=True,
              kv_start=None if kv_start is None else kv_start.to(device))
    kl, ix = kv_lens.to(device), idx.to(device)
    st_t = torch.zeros(2, dtype=torch.int64, device=device)
    st_r = torch.zeros(2, dtype=torch.int64, device=device)
    out, lse = A.sparse_decode_attention_triton(q, k, v, kl, ix, num_splits=splits, stats=st_t,
                                                **kw)
    ref, ref_lse = A.sparse_decode_attention_ref(q, k, v, kl, ix, stats=st_r, **kw)
    assert out.dtype == dtype
    assert _rel(out, ref.float()) < TOL[dtype], _rel(out, ref.float())
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert (lse[fin] - ref_lse[fin]).abs().max().item() < LSE_ATOL
    assert st_t.tolist() == st_r.tolist() and st_t[0] > 0
    assert ((idx >= L) | (idx < -1)).any()  # the selection really held ignored slots


@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_windows_without_middle_skip_the_index_list(num_splits, device):
    """Rows whose window holds at most sinks + recent tokens (a served batch's idle rows:
    one token; short rows) have no middle: a full stale index list (positions anywhere,
    in the window or not) is skipped and they attend their sinks and recent tokens, as
    the reference; the long rows beside them attend their selections. Stats count the
    same tokens."""
    B, Hq, Hkv, D, L, k_mid, n_sink, n_recent = 4, 4, 2, 16, 157, 48, 3, 6
    gen = torch.Generator().manual_seed(7 + (num_splits or 0))
    q, k, v = _inputs(B, Hq, Hkv, D, L, torch.float32, device)
    kv_lens = torch.tensor([157, 120, 121, 90])
    kv_start = torch.tensor([0, 119, 112, 81])  # windows of 157, 1 (idle), 9 = 3 + 6, 9 tokens
    kv_start[3] = 83  # 7 tokens: 3 sinks and 4 of the recent window
    idx = torch.randint(0, L, (B, Hkv, k_mid), generator=gen, dtype=torch.int32)  # stale, some in-window
    idx[0] = _middle_indices(kv_lens[:1], kv_start[:1], Hkv, k_mid, n_sink, n_recent, gen=gen)[0]
    # expected: row 0 its selection; the short rows their whole window (all sinks or recent)
    exp_out, exp_lse = _expected(q, k, v, kv_lens, idx, n_sink=n_sink, n_recent=n_recent, kv_start=kv_start)
    short_out, short_lse = _expected(q, k, v, kv_lens, None, kv_start=kv_start)
    exp_out[1:], exp_lse[1:] = short_out[1:], short_lse[1:]
    st_t = torch.zeros(2, dtype=torch.int64, device=device)
    st_r = torch.zeros(2, dtype=torch.int64, device=device)
    kw = dict(n_sink=n_sink, n_recent=n_recent, kv_start=kv_start.to(device), return_lse=True)
    out, lse = A.sparse_decode_attention_triton(q, k.to(device), v.to(device), kv_lens.to(device), idx.to(device),
                                                num_splits=num_splits, stats=st_t, **kw)
    _check(out, lse, exp_out, exp_lse, torch.float32)
    A.sparse_decode_attention_ref(q, k, v, kv_lens, idx, stats=st_r, n_sink=n_sink, n_recent=n_recent,
                                  kv_start=kv_start)
    assert st_t.tolist() == st_r.tolist()
    win = (kv_lens - kv_start)[1:]
    assert bool((win <= n_sink + n_recent).all())  # the short rows really have no middle
    assert bool(((idx[1:] >= kv_start[1:, None, None]) & (idx[1:] < kv_lens[1:, None, None])).any())


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dense", [False, True])
def test_stats_count_attended_tokens_and_calls(dense, num_splits, device):
    """``stats`` counts, inside the attention launch, the tokens attended (summed over
    (b, KV head), as the mask of the reference attends them) and the calls."""
    B, Hq, Hkv, D, L = 3, 4, 2, 16, 130
    n_sink, n_recent, k_mid = 3, 5, 21
    q, k, v = _inputs(B, Hq, Hkv, D, L, torch.float32, device)
    kv_lens = torch.tensor([130, 47, 9])
    kv_start = torch.tensor([0, 2, 5])
    idx = None if dense else _middle_indices(kv_lens, kv_start, Hkv, k_mid, n_sink, n_recent).to(device)
    mask = A.attended_mask(L, kv_lens, None if idx is None else idx.cpu(), Hkv, n_sink=n_sink,
                           n_recent=n_recent, kv_start=kv_start)
    want = int(mask.sum())
    assert 0 < want < B * Hkv * L
    kw = dict(n_sink=n_sink, n_recent=n_recent, kv_start=kv_start.to(device))
    st_t = torch.zeros(2, dtype=torch.int64, device=device)
    st_r = torch.zeros(2, dtype=torch.int64, device=device)
    for count_call in (True, True, False):
        out = A.sparse_decode_attention_triton(q, k, v, kv_lens.to(device), idx, num_splits=num_splits,
                                               stats=st_t, count_call=count_call, **kw)
        ref = A.sparse_decode_attention_ref(q, k, v, kv_lens.to(device), idx, stats=st_r,
                                            count_call=count_call, **kw)
    assert st_t.tolist() == [3 * want, 2] and st_r.tolist() == [3 * want, 2]
    # the statistics change nothing else
    torch.testing.assert_close(out, A.sparse_decode_attention_triton(q, k, v, kv_lens.to(device), idx,
                                                                     **kw))
    torch.testing.assert_close(ref, A.sparse_decode_attention_ref(q, k, v, kv_lens.to(device), idx, **kw))
    with pytest.raises(ValueError, match="stats must be"):
        A.sparse_decode_attention_ref(q, k, v, kv_lens.to(device), idx, stats=st_r.float(), **kw)


@pytest.mark.parametrize("n_sink,n_recent", [(0, 0), (4, 8), (3, 40), (50, 50)])
def test_all_middle_indices_equal_dense(n_sink, n_recent, device):
    """Sinks + every middle position + recent is the whole context: dense attention.
    (Large n_sink/n_recent make the ranges overlap at short lengths.)"""
    B, Hq, Hkv, D, L = 3, 4, 2, 64, 130
    q, k, v = _inputs(B, Hq, Hkv, D, L, torch.float32, device)
    kv_lens = torch.tensor([130, 7, 37])
    kv_start = torch.tensor([0, 1, 4])
    idx = _middle_indices(kv_lens, kv_start, Hkv, 140, n_sink, n_recent, fill_all=True)
    kl, ks = kv_lens.to(device), kv_start.to(device)
    dense, dense_lse = A.sparse_decode_attention_triton(q, k, v, kl, None, kv_start=ks, return_lse=True)
    sparse, sparse_lse = A.sparse_decode_attention_triton(q, k, v, kl, idx.to(device), n_sink=n_sink,
                                                          n_recent=n_recent, kv_start=ks, return_lse=True)
    assert _rel(sparse, dense) < 1e-5
    assert (sparse_lse - dense_lse).abs().max().item() < 1e-4


@pytest.mark.parametrize("merge", ["fused", "launch"])
@pytest.mark.parametrize("num_splits", [1, 2, 5, 9])
def test_num_splits_agree(num_splits, merge, device, monkeypatch):
    """Any split count and either merge path (in-kernel last-split merge, or the
    separate merge launch taken where no arrival counters can be made: a first call
    inside a graph capture) gives the same answer (more splits than blocks: empty
    splits)."""
    if merge == "launch":
        monkeypatch.setattr(A, "_split_counters", lambda n, device: None)
    B, Hq, Hkv, D, L = 2, 4, 2, 16, 130
    q, k, v = _inputs(B, Hq, Hkv, D, L, torch.float32, device)
    kv_lens = torch.tensor([130, 37])
    idx = _middle_indices(kv_lens, None, Hkv, 30, 4, 8)
    exp_out, exp_lse = _expected(q, k, v, kv_lens, idx, n_sink=4, n_recent=8)
    out, lse = A.sparse_decode_attention_triton(q, k, v, kv_lens.to(device), idx.to(device), n_sink=4,
                                                n_recent=8, return_lse=True, num_splits=num_splits)
    _check(out, lse, exp_out, exp_lse, torch.float32)


@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_plan_rows_sizes_the_plan_not_the_answer(rows, dense, device, monkeypatch):
    """Inside ``kernels.plan_rows(rows, B)`` (a serving batch's rows in use): the split plan
    is sized for that many rows (more splits per row than for all B), the answer is the
    reference's, for the long rows and the one-token idle rows alike, dense and indexed,
    contiguous and paged."""
    B, Hq, Hkv, D, L = 4, 4, 2, 16, 301
    gen = torch.Generator().manual_seed(rows * 2 + dense)
    q, k, v = _inputs(B, Hq, Hkv, D, L, torch.float32, device)
    kv_lens = torch.tensor([301, 200, 201, 202])
    kv_start = torch.tensor([0, 199, 200, 3])  # rows 1-2 idle: a window of their newest token
    idx = None if dense else _middle_indices(kv_lens, kv_start, Hkv, 40, 2, 5, gen=gen)
    ns, nr = (0, 0) if dense else (2, 5)
    exp_out, exp_lse = _expected(q, k, v, kv_lens, idx, n_sink=ns, n_recent=nr, kv_start=kv_start)
    bn = A._launch_config(16, 4, dense=dense)[0]
    t_max = L if dense else ns + 40 + nr
    planned = []
    real = A.plan_splits
    monkeypatch.setattr(A, "plan_splits", lambda *a, **kw: planned.append(real(*a, **kw)) or planned[-1])
    for pool in (False, True):
        kk, vv, bt = k, v, None
        if pool:  # a shuffled pool of 8-token blocks, NaN outside each row's tokens
            from spade.kernels.paged import scatter_to_pool
            kk, bt = scatter_to_pool(k, 8, torch.Generator().manual_seed(rows), lens=kv_lens)
            vv, _ = scatter_to_pool(v, 8, torch.Generator().manual_seed(rows), lens=kv_lens)
        with kernels.plan_rows(rows, B):
            out, lse = A.sparse_decode_attention_triton(
                q, kk.to(device), vv.to(device), kv_lens.to(device), None if idx is None else idx.to(device),
                n_sink=ns, n_recent=nr, kv_start=kv_start.to(device), return_lse=True,
                block_table=None if bt is None else bt.to(device))
        _check(out, lse, exp_out, exp_lse, torch.float32)
    assert planned[0] == real(rows * Hkv, t_max, bn, torch.device(device), indexed=not dense)
    if rows < B:  # fewer busy rows: at least as many splits as the plan for all of them
        assert planned[0][0] >= real(B * Hkv, t_max, bn, torch.device(device), indexed=not dense)[0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS)
def test_fused_combine_repeats_and_resets_counters(heads, dtype, device):
    """The fused merge leaves its arrival counters at zero, so back-to-back calls
    (as in CUDA-graph replay) with other shapes and split counts stay exact; rows
    with empty sets (every slot -1, no sinks/recent) and K >= context included."""
    Hq, Hkv = heads
    D, L = 16, 97
    for B, lens, k_mid, splits in [(3, [97, 1, 40], 120, 3), (1, [61], 1, 4), (3, [5, 97, 33], 9, 7)]:
        q, k, v = _inputs(B, Hq, Hkv, D, L, dtype, device)
        kv_lens = torch.tensor(lens)
        idx = _middle_indices(kv_lens, None, Hkv, k_mid, 2, 3)
        exp_out, exp_lse = _expected(q, k, v, kv_lens, idx, n_sink=2, n_recent=3)
        out, lse = A.sparse_decode_attention_triton(q, k, v, kv_lens.to(device), idx.to(device), n_sink=2,
                                                    n_recent=3, return_lse=True, num_splits=splits)
        _check(out, lse, exp_out, exp_lse, dtype)
        assert int(A._split_counters(B * Hkv, q.device).abs().sum()) == 0
    # an empty middle and no sinks/recent: nothing attended, out 0 and lse -inf
    idx = torch.full((1, Hkv, 5), -1, dtype=torch.int32, device=device)
    out, lse = A.sparse_decode_attention_triton(q[:1], k[:1], v[:1], torch.tensor([50], device=device), idx,
                                                return_lse=True, num_splits=3)
    assert out.abs().max().item() == 0.0 and torch.isinf(lse).all()


def test_long_index_list(device):
    """More indices than one split preloads by default (_MAX_CHUNK_BLOCKS blocks),
    with an explicit num_splits=1: the index tile and the split count must still
    cover every slot (the launcher raises the split count)."""
    from spade.kernels.attention import _MAX_CHUNK_BLOCKS, _launch_config

    bn = _launch_config(16, 4)[0]
    L = bn * _MAX_CHUNK_BLOCKS + 90
    B, Hq, Hkv, D = 1, 2, 1, 16
    q, k, v = _inputs(B, Hq, Hkv, D, L, torch.float32, device)
    kv_lens = torch.tensor([L])
    idx = _middle_indices(kv_lens, None, Hkv, L - 10, 2, 8, holes=0.05)
    exp_out, exp_lse = _expected(q, k, v, kv_lens, idx, n_sink=2, n_recent=8)
    out, lse = A.sparse_decode_attention_triton(q, k, v, kv_lens.to(device), idx.to(device), n_sink=2,
                                                n_recent=8, return_lse=True, num_splits=1)
    _check(out, lse, exp_out, exp_lse, torch.float32)
    splits, max_blocks = A.plan_splits(1, 2 + L - 10 + 8, bn, q.device, num_splits=1)
    assert splits > 1 and max_blocks <= _MAX_CHUNK_BLOCKS


def test_empty_set_and_scale(device):
    """kv_start == kv_len leaves nothing to attend: out 0, lse -inf; a custom scale."""
    B, Hq, Hkv, D, L = 2, 4, 2, 16, 40
    q, k, v = _inputs(B, Hq, Hkv, D, L, torch.float32, device)
    kv_lens = torch.tensor([37, 5])
    kv_start = torch.tensor([3, 5])
    idx = torch.full((B, Hkv, 4), -1, dtype=torch.int32)
    for indices in (None, idx):
        exp_out, exp_lse = _expected(q, k, v, kv_lens, indices, n_sink=2, n_recent=3, kv_start=kv_start,
                                     scale=0.3)
        out, lse = A.sparse_decode_attention_triton(
            q, k, v, kv_lens.to(device), None if indices is None else indices.to(device), n_sink=2,
            n_recent=3, kv_start=kv_start.to(device), scale=0.3, return_lse=True)
        _check(out, lse, exp_out, exp_lse, torch.float32)
        assert out[1].abs().max().item() == 0.0 and torch.isinf(lse[1]).all()


def test_reference_reads_no_position_past_the_longest_row():
    """The torch reference (the CPU's serving kernel) stops at the longest row's length:
    positions past every ``kv_lens`` may hold anything (here NaN) and the answer is the one
    over a cache cut there; with a block table, blocks past it are not read either."""
    B, Hq, Hkv, D, L = 3, 4, 2, 16, 64
    q, k, v = _inputs(B, Hq, Hkv, D, L, torch.float32, "cpu")
    kv_lens, kv_start = torch.tensor([29, 17, 30]), torch.tensor([0, 4, 9])
    idx = _middle_indices(kv_lens, kv_start, Hkv, 6, 2, 3, holes=0.2)
    for indices in (None, idx):
        kw = dict(n_sink=2, n_recent=3, kv_start=kv_start, return_lse=True)
        want = A.sparse_decode_attention_ref(q, k[:, :, :30], v[:, :, :30], kv_lens, indices, **kw)
        k2, v2 = k.clone(), v.clone()
        k2[:, :, 30:], v2[:, :, 30:] = float("nan"), float("nan")
        got = A.sparse_decode_attention_ref(q, k2, v2, kv_lens, indices, **kw)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        # paged: 4-token blocks, the rows' blocks then NaN-filled ones the table also lists
        bs, nb = 4, L // 4
        pool = torch.full((B * nb + 1, Hkv, bs, D), float("nan"))
        vpool = pool.clone()
        table = torch.arange(1, B * nb + 1, dtype=torch.int32).view(B, nb)
        for b in range(B):
            for j in range(8):  # blocks 0..7 hold positions 0..31 (>= every row's length)
                pool[table[b, j]] = k[b, :, j * bs:(j + 1) * bs]
                vpool[table[b, j]] = v[b, :, j * bs:(j + 1) * bs]
        got = A.sparse_decode_attention_ref(q, pool, vpool, kv_lens, indices, block_table=table, **kw)
        torch.testing.assert_close(got, want)  # (32 positions read against 30: fp32 rounding)


def test_strided_inputs(device):
    """q and the cache as non-contiguous views (a [B, L, H, D] cache transposed)."""
    B, Hq, Hkv, D, L = 2, 4, 2, 64, 50
    q = torch.randn(B, D, Hq, device=device).transpose(1, 2)
    k = torch.randn(B, L, Hkv, D, device=device).transpose(1, 2)
    v = torch.randn(B, L, Hkv, D, device=device).transpose(1, 2)
    kv_lens = torch.tensor([50, 37])
    idx = _middle_indices(kv_lens, None, Hkv, 9, 2, 4)
    idx_view = torch.stack([idx, -idx], dim=-1)[..., 0]  # strided index list, same content
    assert idx_view.stride(2) == 2
    exp_out, exp_lse = _expected(q, k, v, kv_lens, idx, n_sink=2, n_recent=4)
    out, lse = A.sparse_decode_attention_triton(q, k, v, kv_lens.to(device), idx_view.to(device), n_sink=2,
                                                n_recent=4, return_lse=True)
    _check(out, lse, exp_out, exp_lse, torch.float32)


def test_public_dispatch(device, monkeypatch):
    """spade.kernels.sparse_decode_attention routes to the Triton kernel when forced."""
    from spade import kernels

    B, Hq, Hkv, D, L = 1, 4, 1, 16, 37
    q, k, v = _inputs(B, Hq, Hkv, D, L, torch.float32, device)
    kv_lens = torch.tensor([37], device=device)
    monkeypatch.setenv("SPADE_KERNELS", "triton")
    a = kernels.sparse_decode_attention(q, k, v, kv_lens)
    monkeypatch.setenv("SPADE_KERNELS", "torch")
    b = kernels.sparse_decode_attention(q, k, v, kv_lens)
    assert _rel(a, b) < 1e-5


def test_bad_shapes_raise():
    q = torch.randn(1, 3, 16)
    k = torch.randn(1, 2, 10, 16)
    with pytest.raises(ValueError, match="multiple"):
        A.sparse_decode_attention_ref(q, k, k, torch.tensor([10]))
    with pytest.raises(ValueError, match="indices"):
        A.sparse_decode_attention_triton(torch.randn(1, 4, 16), k, k, torch.tensor([10]),
                                         torch.zeros(1, 3, 2, dtype=torch.int32))


# ----------------------------------------------------------------------------- merge
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_merge_two_halves_equals_union(impl, dtype, device):
    """Part A = sinks + even middle slots; part B = odd slots + the recent window,
    passed as explicit indices (a part-B call with n_sink=0 would move the recent
    window's start at short lengths). Merging A and B equals attention over the union."""
    merge = A.merge_attention_states_ref if impl == "ref" else A.merge_attention_states_triton
    B, Hq, Hkv, D, L = 3, 4, 2, 64, 130
    q, k, v = _inputs(B, Hq, Hkv, D, L, dtype, device)
    kv_lens = torch.tensor([130, 7, 37])
    n_sink, n_recent = 4, 8
    idx = _middle_indices(kv_lens, None, Hkv, 40, n_sink, n_recent)
    idx_a = idx.clone()
    idx_a[..., 1::2] = -1
    recent = torch.full((B, Hkv, n_recent), -1, dtype=torch.int32)
    for b in range(B):
        n = int(kv_lens[b])
        r = torch.arange(max(n - n_recent, min(n_sink, n)), n, dtype=torch.int32)
        recent[b, :, : len(r)] = r
    odd = idx.clone()
    odd[..., 0::2] = -1
    idx_b = torch.cat([odd, recent], dim=2)
    kl = kv_lens.to(device)
    out_a, lse_a = A.sparse_decode_attention_triton(q, k, v, kl, idx_a.to(device), n_sink=n_sink,
                                                    return_lse=True)
    out_b, lse_b = A.sparse_decode_attention_triton(q, k, v, kl, idx_b.to(device), return_lse=True)
    exp_out, exp_lse = _expected(q, k, v, kv_lens, idx, n_sink=n_sink, n_recent=n_recent)
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    _check(out, lse, exp_out, exp_lse, dtype)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_merge_with_empty_parts(impl, device):
    merge = A.merge_attention_states_ref if impl == "ref" else A.merge_attention_states_triton
    B, Hq, D = 2, 3, 48
    out_a = torch.randn(B, Hq, D, device=device)
    lse_a = torch.randn(B, Hq, device=device)
    empty_o = torch.zeros(B, Hq, D, device=device)
    empty_l = torch.full((B, Hq), float("-inf"), device=device)
    out, lse = merge(out_a, lse_a, empty_o, empty_l)  # union with an empty set: unchanged
    assert torch.allclose(out, out_a, atol=1e-6) and torch.allclose(lse, lse_a, atol=1e-6)
    out, lse = merge(empty_o, empty_l, out_a, lse_a)
    assert torch.allclose(out, out_a, atol=1e-6) and torch.allclose(lse, lse_a, atol=1e-6)
    out, lse = merge(empty_o, empty_l, empty_o, empty_l)  # both empty: still empty, no NaN
    assert out.abs().max().item() == 0.0 and torch.isinf(lse).all() and (lse < 0).all()
    # equal lse: the plain average, lse + log 2
    out_b = torch.randn(B, Hq, D, device=device)
    out, lse = merge(out_a, lse_a, out_b, lse_a)
    assert torch.allclose(out, (out_a + out_b) / 2, atol=1e-5)
    assert torch.allclose(lse, lse_a + math.log(2), atol=1e-5)


# ----------------------------------------------------------------------------- fuzz
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    B=st.integers(1, 3), Hkv=st.integers(1, 3), G=st.sampled_from([1, 2, 3, 4]),
    D=st.sampled_from([16, 24, 48]), L=st.integers(1, 150), k_mid=st.integers(0, 40),
    n_sink=st.integers(0, 6), n_recent=st.integers(0, 20), dense=st.booleans(), seed=st.integers(0, 2**16),
)
def test_fuzz_shapes(B, Hkv, G, D, L, k_mid, n_sink, n_recent, dense, seed, device):
    gen = torch.Generator().manual_seed(seed)
    Hq = Hkv * G
    q = torch.randn(B, Hq, D, generator=gen).to(device)
    k = torch.randn(B, Hkv, L, D, generator=gen).to(device)
    v = torch.randn(B, Hkv, L, D, generator=gen).to(device)
    kv_lens = torch.randint(0, L + 1, (B,), generator=gen)
    kv_start = torch.minimum(torch.randint(0, 4, (B,), generator=gen), kv_lens)
    idx = None if dense else _middle_indices(kv_lens, kv_start, Hkv, k_mid, n_sink, n_recent, gen=gen)
    exp_out, exp_lse = _expected(q, k, v, kv_lens, idx, n_sink=n_sink, n_recent=n_recent, kv_start=kv_start)
    out, lse = A.sparse_decode_attention_triton(
        q, k, v, kv_lens.to(device), None if idx is None else idx.to(device), n_sink=n_sink,
        n_recent=n_recent, kv_start=kv_start.to(device), return_lse=True)
    _check(out, lse, exp_out, exp_lse, torch.float32)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("indices", [False, True])
def test_gpu_qwen_shape(indices):
    """The benchmark's layer shape (32 q / 8 KV heads, d=128, bf16) on a real GPU."""
    dev = torch.device("cuda")
    B, Hq, Hkv, D, L = 2, 32, 8, 128, 5000
    q, k, v = _inputs(B, Hq, Hkv, D, L, torch.bfloat16, dev)
    kv_lens = torch.tensor([5000, 3001])
    idx = _middle_indices(kv_lens, None, Hkv, 1000, 4, 64) if indices else None
    kw = dict(n_sink=4, n_recent=64, return_lse=True)
    out, lse = A.sparse_decode_attention_triton(q, k, v, kv_lens.to(dev), None if idx is None else idx.to(dev),
                                                **kw)
    ref, ref_lse = A.sparse_decode_attention_ref(q, k, v, kv_lens.to(dev),
                                                 None if idx is None else idx.to(dev), **kw)
    assert _rel(out, ref.float()) < TOL[torch.bfloat16]
    assert (lse - ref_lse).abs().max().item() < LSE_ATOL


@pytest.mark.gpu
def test_gpu_fused_merge_graph_replay():
    """The fused merge under CUDA-graph replay: captured after a warm-up (counters
    exist), replayed with new index lists and lengths, exact against the reference
    each time (a counter left non-zero would skip or double a merge). A first call
    inside a capture on a fresh stream falls back to the two-launch merge."""
    dev = torch.device("cuda")
    B, Hq, Hkv, D, L, KM = 3, 32, 8, 128, 4000, 700
    q, k, v = _inputs(B, Hq, Hkv, D, L, torch.bfloat16, dev)
    kv_lens = torch.tensor([4000, 1234, 3001], device=dev)
    idx = _middle_indices(kv_lens.cpu(), None, Hkv, KM, 4, 64).to(dev)
    kw = dict(n_sink=4, n_recent=64, return_lse=True, num_splits=6)
    A.sparse_decode_attention_triton(q, k, v, kv_lens, idx, **kw)  # warm-up: compile, counters
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = A.sparse_decode_attention_triton(q, k, v, kv_lens, idx, **kw)
    for step in range(3):
        q.copy_(torch.randn_like(q))
        idx.copy_(_middle_indices(kv_lens.cpu(), None, Hkv, KM, 4, 64).to(dev))
        g.replay()
        ref, ref_lse = A.sparse_decode_attention_ref(q, k, v, kv_lens, idx, n_sink=4, n_recent=64, return_lse=True)
        assert _rel(out, ref.float()) < TOL[torch.bfloat16], step
        assert (lse - ref_lse).abs().max().item() < LSE_ATOL, step
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        g2 = torch.cuda.CUDAGraph()
        n_before = len(A._COUNTERS)
        with torch.cuda.graph(g2, stream=side):
            out2 = A.sparse_decode_attention_triton(q, k, v, kv_lens, idx, **kw)[0]
        assert len(A._COUNTERS) == n_before  # nothing allocated inside the capture
    g2.replay()
    torch.cuda.synchronize()
    assert _rel(out2, ref.float()) < TOL[torch.bfloat16]


# ----------------------------------------------------------------------------- sm_90 build
_AOT_SCRIPT = r'''
import json, sys
from spade.kernels import attention as A, gather as Gm, ridge as Rg
from tests.kernels.aot import loop_body, sm90_compile, smem_buffers

def build(fn, args, cons, num_warps=4, num_stages=3):
    k = sm90_compile(fn, args, cons, num_warps, num_stages)
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    return dict(pipelined="async_copy_global_to_local" in ttgir, shared=k.metadata.shared,
                gdc=[ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents")],
                acq_rel_atomics=ttgir.count("atomic_rmw add, acq_rel, gpu"),
                loads_in_loop=loop_body(ttgir).count("tt.load "), kv_buffers=smem_buffers(ttgir))

out = {}
L, Hkv, G, D, KM = 32768, 8, 4, 128, 1980
for dt, has_idx, direct, fused, pdl in [
        ("bf16", True, False, True, False), ("bf16", False, True, False, False),
        ("fp16", True, True, False, False), ("fp32", True, False, True, False),
        ("bf16", True, False, False, False), ("bf16", True, False, True, True)]:
    p = ("ptr", dt)
    args = dict(Q=p, K=p, V=p, KV_LENS=("ptr", "i32"), KV_START=("ptr", "i32"), IDX=("ptr", "i32"),
                O_PART=("ptr", "fp32"), LSE_PART=("ptr", "fp32"), OUT=p, LSE=("ptr", "fp32"),
                stride_qb=Hkv * G * D, stride_qh=D, stride_qd=1, stride_kb=Hkv * L * D, stride_kh=L * D,
                stride_kl=D, stride_kd=1, stride_vb=Hkv * L * D, stride_vh=L * D, stride_vl=D, stride_vd=1,
                stride_ib=Hkv * KM, stride_ih=KM, stride_ik=1, Hkv=Hkv, Hq=Hkv * G, K_MID=KM, N_SINK=4,
                N_RECENT=64, NUM_SPLITS=6, qk_scale=("fp32", 0.1), COUNTER=("ptr", "i32"), STATS=("ptr", "i64"))
    bn, nw, ns = A._launch_config(D, 4 if dt == "fp32" else 2, dense=not has_idx)
    name = f"decode_{dt}_{has_idx}" + ("" if fused or direct else "_kernel") + ("_pdl" if pdl else "")
    out[name] = build(A._decode_split_kernel, args, dict(
        G=G, G_PAD=16, D=D, D_PAD=D, BLOCK_N=bn, MAX_BLOCKS=8, DIRECT=direct, HAS_INDICES=has_idx,
        HAS_START=True, UPCAST=dt == "fp32", DOT_PREC="ieee" if dt == "fp32" else "tf32",
        INTERPRET=False, FUSED_COMBINE=fused, HAS_STATS=fused, COUNT_CALL=True, PDL=pdl), nw, ns)
out["reduce"] = build(A._reduce_splits_kernel, dict(O_PART=("ptr", "fp32"), LSE_PART=("ptr", "fp32"),
                      OUT=("ptr", "bf16"), LSE=("ptr", "fp32"), NUM_SPLITS=6), dict(D=D, D_PAD=D, S_PAD=8), 2)
out["merge"] = build(A._merge_states_kernel, dict(OA=("ptr", "bf16"), LA=("ptr", "fp32"), OB=("ptr", "bf16"),
                     LB=("ptr", "fp32"), OUT=("ptr", "bf16"), LSE=("ptr", "fp32"), stride_oa_r=D, stride_oa_d=1,
                     stride_ob_r=D, stride_ob_d=1), dict(D=D, D_PAD=D), 1)
out["gather"] = build(Gm._gather_kv_kernel, dict(K=("ptr", "bf16"), V=("ptr", "bf16"), IDX=("ptr", "i32"),
                      KO=("ptr", "bf16"), VO=("ptr", "bf16"), stride_kb=Hkv * L * D, stride_kh=L * D, stride_kl=D,
                      stride_kd=1, stride_vb=Hkv * L * D, stride_vh=L * D, stride_vl=D, stride_vd=1,
                      stride_ib=Hkv * 2048, stride_ih=2048, stride_ik=1, Hkv=Hkv, L=L, K_SEL=2048),
                      dict(D=D, D_PAD=D, BLOCK_K=64, PDL=True))
for M, mode in [(16, 3), (64, 1)]:
    out[f"ridge_{M}_{mode}"] = build(Rg._ridge_kernel, dict(W=("ptr", "bf16"), OUT=("ptr", "fp32"),
                                     stride_n=17 * D, stride_r=D, stride_d=1, R=17, m=M - 1, eps=("fp32", 0.01)),
                                     dict(D=D, D_PAD=D, M=M, MODE=mode, PDL=mode == 1), max(1, min(16, M * D // (2048 if M <= 16 else 1024))))
out["window_push"] = build(Rg._window_push_kernel, dict(W=("ptr", "fp32"), Q=("ptr", "bf16"), stride_qb=40 * D,
                          stride_qh=D, stride_qd=1, H=32, R=17), dict(D=D, R_PAD=32, D_PAD=D, PDL=True), 4)
print(json.dumps(out))
'''


def test_kernels_build_for_hopper():
    """Every kernel compiles for sm_90 (the interpreter accepts code the compiler
    rejects), and the decode kernel's K/V loads are software-pipelined (cp.async):
    a build with the launcher's specialisations, no GPU needed (ptxas ships with
    triton)."""
    res = run_aot_script(_AOT_SCRIPT)
    # fused split combine: one acq_rel arrival counter; the two-launch fallback has none
    assert res["decode_bf16_True"]["acq_rel_atomics"] == 1 and res["decode_fp32_True"]["acq_rel_atomics"] == 1
    assert res["decode_bf16_True_kernel"]["acq_rel_atomics"] == 0
    for name in ("decode_bf16_True", "decode_bf16_False", "decode_fp16_True", "decode_bf16_True_kernel",
                 "decode_bf16_True_pdl"):
        r = res[name]
        # programmatic dependent launch: one wait and one release with PDL, none without
        assert r["gdc"] == ([1, 1] if name.endswith("_pdl") else [0, 0]), (name, r)
        # K/V rows arrive through async copies (double-buffered on the indexed path's
        # three stages, one buffer each on the dense path's two: _launch_config), and no
        # load waits inside the main loop (the indexed path preloads its chunk of indices)
        assert r["pipelined"] and r["loads_in_loop"] == 0, (name, r)
        assert all(int(n) >= (1 if name == "decode_bf16_False" else 2) for n in r["kv_buffers"]), (name, r)
        assert r["shared"] < 227 * 1024 // 3, (name, r)  # three programs per SM fit


def test_split_heuristic_per_path(monkeypatch):
    """One wave of resident programs: three per SM dense, two on the indexed path
    (``SPADE_ATTN_PROGRAMS_PER_SM`` overrides both); at least two blocks per split.
    (CPU: the heuristic pretends 16 SMs.)"""
    monkeypatch.delenv("SPADE_ATTN_PROGRAMS_PER_SM", raising=False)
    cpu = torch.device("cpu")
    assert A.choose_num_splits(8, 4096, 64, cpu) == 3 * 16 // 8
    assert A.choose_num_splits(8, 4096, 64, cpu, indexed=True) == 2 * 16 // 8
    assert A.choose_num_splits(8, 200, 64, cpu, indexed=True) == 2  # 200 tokens: two splits of >= 2 blocks
    assert A.plan_splits(8, 4096, 64, cpu)[0] == 4 and A.plan_splits(8, 4096, 64, cpu, indexed=False)[0] == 6
    monkeypatch.setenv("SPADE_ATTN_PROGRAMS_PER_SM", "5")
    assert A.choose_num_splits(8, 4096, 64, cpu, indexed=True) == A.choose_num_splits(8, 4096, 64, cpu) == 10
    monkeypatch.setenv("SPADE_ATTN_PROGRAMS_PER_SM", "0")
    with pytest.raises(ValueError, match="SPADE_ATTN_PROGRAMS_PER_SM must be an integer >= 1"):
        A.choose_num_splits(8, 4096, 64, cpu)

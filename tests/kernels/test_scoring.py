"""Group scoring and fused top-K: Triton vs the torch reference vs an independent float64 computation.

Selections are compared through the true (float64) scores, never raw indices, because
ties may order or even choose positions differently: a valid top-K set has every
selected score >= the K-th best score and every unselected candidate <= it (up to the
tolerance of the fp32 scores the kernels rank).

Under the interpreter each Triton program costs milliseconds, so the parameter grid
crosses the axes that change code paths (reduce x GQA shape x dtype) and cycles the
awkward sizes (B, L, D) through them instead of taking the full product.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spade import kernels
from spade.kernels import radix_topk, scoring

REDUCES = scoring.REDUCES
HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 37, 16), (3, 130, 64), (3, 1, 16), (1, 130, 64), (3, 37, 64), (1, 1, 64)]  # (B, L, D)

# Both paths see identical (dtype-rounded) inputs and compute fp32 products, so they differ
# only by fp32 accumulation order over D terms. fp32 inputs on a GPU use IEEE fp32 dots;
# 16-bit inputs go through tensor cores whose fp32 accumulation order is unspecified,
# hence the looser bound. (rtol, atol) on scores of magnitude ~1.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-4, 1e-4), torch.bfloat16: (1e-4, 1e-4)}


def _grid(*axes):
    """Product of ``axes`` with SHAPES cycled along it: (*combo, B, L, D)."""
    return [(*combo, *shape) for combo, shape in zip(itertools.product(*axes), itertools.cycle(SHAPES))]


def _inputs(B, Hq, Hkv, L, D, dtype, device, *, seed=0):
    """Random q/k with ragged rows: row b holds [kv_start[b], kv_lens[b]), kv_start > 0
    on some rows (left padding) and garbage (NaN) after kv_lens, which must never leak."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g).to(dtype).to(device)
    k = torch.randn(B, Hkv, L, D, generator=g).to(dtype)
    kv_lens = torch.tensor([max(1, L - 3 * b) for b in range(B)])
    kv_start = torch.tensor([min(2 * b, int(kv_lens[b]) - 1) for b in range(B)])
    for b in range(B):
        k[b, :, int(kv_lens[b]):] = float("nan")
    return q, k.to(device), kv_lens.to(device), kv_start.to(device)


def _scores64(q, k, reduce, norm_lo, norm_hi, scale=None):
    """Independent float64 group scores [B, Hkv, L] (loops over rows and heads; -inf
    outside [norm_lo, norm_hi) for every reduce)."""
    B, Hq, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    q64 = q.to(k.dtype).double().cpu()
    k64 = k.double().cpu()
    out = torch.full((B, Hkv, L), float("-inf"), dtype=torch.float64)
    for b in range(B):
        lo, hi = int(norm_lo[b]), int(norm_hi[b])
        if hi <= lo:
            continue
        for h in range(Hkv):
            logits = torch.stack([k64[b, h, lo:hi] @ q64[b, h * G + g] * scale for g in range(G)])  # [G, n]
            if reduce == "sum_logits":
                s = logits.sum(0)
            elif reduce == "max_logits":
                s = logits.max(0).values
            else:
                e = torch.exp(logits - logits.max(1, keepdim=True).values)
                s = (e / e.sum(1, keepdim=True)).sum(0)
            out[b, h, lo:hi] = s
    return out


def _check_topk(idx, true, lo, hi, k_top, *, atol):
    """``idx`` [B, H, k_top] is a valid top-K of ``true`` [B, H, L] (float64) over [lo, hi)."""
    B, H, _ = idx.shape
    assert idx.shape[-1] == k_top and idx.dtype == torch.int32
    idx = idx.cpu().long()
    for b in range(B):
        lo_b, hi_b = max(int(lo[b]), 0), int(hi[b])
        n_cand = max(hi_b - lo_b, 0)
        for h in range(H):
            row = idx[b, h]
            sel = row[row >= 0]
            assert (row[len(sel):] == -1).all() and (row >= -1).all(), "valid entries first, then -1 padding"
            assert len(sel) == min(k_top, n_cand), (len(sel), k_top, n_cand)
            assert len(torch.unique(sel)) == len(sel), "duplicate positions"
            if len(sel) == 0:
                continue
            assert ((sel >= lo_b) & (sel < hi_b)).all(), "position outside [lo, hi)"
            cand = true[b, h, lo_b:hi_b]
            kth = cand.topk(len(sel)).values[-1]
            assert true[b, h, sel].min() >= kth - atol, "a selected score is below the K-th best"
            rest = torch.ones(hi_b - lo_b, dtype=torch.bool)
            rest[sel - lo_b] = False
            if rest.any():
                assert cand[rest].max() <= kth + atol, "an unselected score is above the K-th best"


def _sel_sum(idx, true):
    """Sum of the true scores of each selection: [B, H] (ties make any choice equal)."""
    idx = idx.cpu().long()
    return torch.where(idx >= 0, true.gather(2, idx.clamp(min=0)), torch.zeros((), dtype=true.dtype)).sum(-1)


@pytest.fixture(autouse=True)
def _default_configs():
    """Tests that override the launch configs must not leak them."""
    yield
    scoring.SCORE_CONFIG.clear()
    radix_topk.SELECT_CONFIG.clear()


# ------------------------------------------------------------------------------------------------
# group_scores
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduce,heads,dtype,B,L,D", _grid(REDUCES, HEADS, DTYPES))
def test_group_scores_ref_matches_float64(reduce, heads, dtype, B, L, D):
    q, k, kv_lens, kv_start = _inputs(B, *heads, L, D, dtype, "cpu")
    ref = scoring.group_scores_ref(q, k, kv_lens, reduce=reduce, kv_start=kv_start)
    true = _scores64(q, k, reduce, kv_start, kv_lens)
    assert ref.dtype == torch.float32 and ref.shape == true.shape
    assert torch.equal(torch.isinf(ref), torch.isinf(true)), "-inf exactly outside [kv_start, kv_lens)"
    torch.testing.assert_close(ref.double(), true, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduce,heads,dtype,B,L,D", _grid(REDUCES, HEADS, DTYPES))
def test_group_scores_triton_matches_ref(reduce, heads, dtype, B, L, D, device):
    q, k, kv_lens, kv_start = _inputs(B, *heads, L, D, dtype, device, seed=1)
    ref = scoring.group_scores_ref(q, k, kv_lens, reduce=reduce, kv_start=kv_start)
    out = scoring.group_scores_triton(q, k, kv_lens, reduce=reduce, kv_start=kv_start)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    rtol, atol = TOL[dtype]
    fin = torch.isfinite(ref)
    torch.testing.assert_close(out[fin], ref[fin], rtol=rtol, atol=atol)


def test_group_scores_custom_scale_and_multichunk(device):
    """A non-default scale, and tiny tiles so rows split into several chunks (the
    sum_softmax statistics then merge across chunks)."""
    scoring.SCORE_CONFIG.update(BLOCK_L=16, MIN_CHUNK=16)
    q, k, kv_lens, kv_start = _inputs(3, 4, 2, 70, 16, torch.float32, device, seed=2)
    for reduce in REDUCES:
        ref = scoring.group_scores_ref(q, k, kv_lens, reduce=reduce, kv_start=kv_start, scale=0.3)
        out = scoring.group_scores_triton(q, k, kv_lens, reduce=reduce, kv_start=kv_start, scale=0.3)
        fin = torch.isfinite(ref)
        assert torch.equal(fin, torch.isfinite(out))
        torch.testing.assert_close(out[fin], ref[fin], rtol=1e-5, atol=1e-5)


def test_group_scores_strided_cache_and_fp32_query(device):
    """k as a transposed view of a [B, L, Hkv, D] buffer, and a float32 query against a
    bf16 cache (both paths score the query rounded to bf16)."""
    B, Hq, Hkv, L, D = 3, 4, 2, 37, 16
    q = torch.randn(B, Hq, D, device=device)
    k = torch.randn(B, L, Hkv, D, device=device).to(torch.bfloat16).transpose(1, 2)  # non-contiguous
    kv_lens = torch.tensor([37, 20, 5], device=device)
    ref = scoring.group_scores_ref(q, k, kv_lens)
    out = scoring.group_scores_triton(q, k, kv_lens)
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(out))
    torch.testing.assert_close(out[fin], ref[fin], rtol=1e-4, atol=1e-4)


def test_group_scores_rejects_bad_inputs():
    q = torch.randn(1, 3, 16)
    k = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="multiple"):
        scoring.group_scores_ref(q, k, torch.tensor([8]))
    with pytest.raises(ValueError, match="reduce"):
        scoring.group_scores_triton(torch.randn(1, 2, 16), k, torch.tensor([8]), reduce="mean")


# ------------------------------------------------------------------------------------------------
# score_topk
# ------------------------------------------------------------------------------------------------


def _quant_keys(q, k, keys, device, *, q_dtype=None):
    """(q, k, kw) for scoring over ``keys`` (exact, int8 or int4; int4 with its smoothing
    folded into q, cast to ``q_dtype`` when given), on ``device``; ``kw`` holds ``k_scale``."""
    from spade.kernels import quant

    k = torch.nan_to_num(k)
    kw = {}
    if keys == "int8":
        k, kw["k_scale"] = quant.quantize_keys_ref(k.cpu())
    elif keys == "int4":
        sm = quant.fit_smoothing(k.cpu())
        k, kw["k_scale"] = quant.quantize_keys_int4_ref(k.cpu(), sm)
        q = quant.fold_smoothing(q.cpu(), sm)
        q = q if q_dtype is None else q.to(q_dtype)
    return q.to(device), k.to(device), {n: t.to(device) for n, t in kw.items()}


def _bounds(kv_lens, kv_start, n_sink, n_recent):
    """Middle range [kv_start + n_sink, kv_lens - n_recent) (empty when they cross)."""
    lo = torch.minimum(kv_start + n_sink, kv_lens)
    hi = torch.maximum(kv_lens - n_recent, lo)
    return lo, hi


def _norm(reduce, lo, hi, kv_lens):
    """The documented sum_softmax normaliser range of score_topk."""
    if reduce == "sum_softmax" and kv_lens is not None:
        return torch.zeros_like(lo), torch.maximum(kv_lens, hi)
    return lo, hi


K_CASES = ["one", "some", "all"]  # K=1, K below the candidates, K >= the candidates


def _k_top(case, L):
    return {"one": 1, "some": max(1, L // 3), "all": L + 5}[case]


@pytest.mark.parametrize("reduce,heads,dtype,B,L,D", _grid(REDUCES, HEADS, DTYPES))
def test_score_topk_ref_is_exact_topk(reduce, heads, dtype, B, L, D):
    q, k, kv_lens, kv_start = _inputs(B, *heads, L, D, dtype, "cpu", seed=3)
    lo, hi = _bounds(kv_lens, kv_start, 1, 2)
    norm_lens = kv_lens if reduce == "sum_softmax" else None
    true = _scores64(q, k, reduce, *_norm(reduce, lo, hi, norm_lens))
    for case in K_CASES:
        k_top = _k_top(case, L)
        idx = scoring.score_topk_ref(q, k, lo, hi, k_top, reduce=reduce, kv_lens=norm_lens)
        _check_topk(idx, true, lo, hi, k_top, atol=1e-5)


@pytest.mark.parametrize("reduce,heads,dtype,B,L,D", _grid(REDUCES, HEADS, DTYPES))
def test_score_topk_triton_matches_ref(reduce, heads, dtype, B, L, D, device):
    q, k, kv_lens, kv_start = _inputs(B, *heads, L, D, dtype, device, seed=4)
    # sinks and the recent window excluded; with kv_lens the softmax normaliser spans [0, kv_lens)
    lo, hi = _bounds(kv_lens, kv_start, 2, 3)
    norm_lens = kv_lens if (reduce == "sum_softmax" and dtype != torch.float16) else None
    case = K_CASES[(REDUCES.index(reduce) + DTYPES.index(dtype)) % 3]
    k_top = _k_top(case, L)
    ref = scoring.score_topk_ref(q, k, lo, hi, k_top, reduce=reduce, kv_lens=norm_lens)
    out = scoring.score_topk_triton(q, k, lo, hi, k_top, reduce=reduce, kv_lens=norm_lens)
    true = _scores64(q, k, reduce, *_norm(reduce, lo.cpu(), hi.cpu(), None if norm_lens is None else kv_lens.cpu()))
    _check_topk(out, true, lo.cpu(), hi.cpu(), k_top, atol=1e-4)
    torch.testing.assert_close(_sel_sum(out, true), _sel_sum(ref, true), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fuse", [True, False])
def test_score_topk_stage2_chunks(fuse, device):
    """Stage 2 with and without the fused pass-0 histogram, over tiny tiles so each row
    spans several chunks (atomic histograms, slot counters and tie buffers)."""
    scoring.SCORE_CONFIG.update(BLOCK_L=16, MIN_CHUNK=16)
    radix_topk.SELECT_CONFIG.update(fuse_hist=fuse, BLOCK=32, MIN_CHUNK=32)
    q, k, kv_lens, kv_start = _inputs(2, 4, 2, 75, 16, torch.float32, device, seed=5)
    lo, hi = _bounds(kv_lens, kv_start, 1, 1)
    true = _scores64(q, k, "sum_logits", lo.cpu(), hi.cpu())
    for k_top in (23, 100):
        out = scoring.score_topk_triton(q, k, lo, hi, k_top)
        _check_topk(out, true, lo.cpu(), hi.cpu(), k_top, atol=1e-5)


def test_score_topk_ties(device):
    """Many exactly equal scores: the tie at the threshold must be cut to exactly K
    (and the 16-bit tie buffer then holds a large part of the row). Keys take values
    in {-1, 0, 1} along one axis, so scores are exact multiples of one number."""
    radix_topk.SELECT_CONFIG.update(BLOCK=32, MIN_CHUNK=32)
    B, Hq, Hkv, L, D = 2, 2, 1, 50, 16
    q = torch.zeros(B, Hq, D, device=device)
    q[..., 0] = 1.0
    k = torch.zeros(B, Hkv, L, D)
    k[..., 0] = torch.randint(-1, 2, (B, Hkv, L)).float()
    k = k.to(device)
    lo = torch.tensor([0, 5], device=device)
    hi = torch.tensor([50, 40], device=device)
    true = _scores64(q, k, "sum_logits", lo.cpu(), hi.cpu())
    for k_top in (7, 60):
        out = scoring.score_topk_triton(q, k, lo, hi, k_top)
        _check_topk(out, true, lo.cpu(), hi.cpu(), k_top, atol=0.0)
    # all scores equal (q = 0): any K positions, but exactly K of them
    out = scoring.score_topk_triton(torch.zeros_like(q), k, lo, hi, 13)
    _check_topk(out, torch.zeros_like(true), lo.cpu(), hi.cpu(), 13, atol=0.0)


def test_score_topk_empty_ranges_and_zero_k(device):
    q, k, kv_lens, _ = _inputs(3, 4, 2, 37, 16, torch.float32, device, seed=6)
    lo = torch.tensor([10, 20, 0], device=device)
    hi = torch.tensor([10, 5, 37], device=device)  # empty, crossed, full
    for fn in (scoring.score_topk_ref, scoring.score_topk_triton):
        out = fn(q, k, lo, hi, 4)
        assert (out[:2] == -1).all()
        assert (out[2] >= 0).all()
        assert fn(q, k, lo, hi, 0).shape == (3, 2, 0)


def test_score_topk_softmax_normaliser_changes_ranking(device):
    """sum_softmax normalises each head separately, so its top-K is not the sum_logits
    one; the normaliser range ([0, kv_lens) vs [lo, hi)) changes the scores, not the
    per-head ranking, and both paths agree on each."""
    B, Hq, Hkv, L, D = 1, 4, 1, 64, 16
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, Hq, D, generator=g)
    q[:, 0] *= 8.0  # one sharp head dominates the logit sum, not the softmax sum
    q = q.to(device)
    k = torch.randn(B, Hkv, L, D, generator=g).to(device)
    lo, hi = torch.tensor([4], device=device), torch.tensor([60], device=device)
    kv_lens = torch.tensor([L], device=device)
    a = scoring.score_topk_ref(q, k, lo, hi, 8, reduce="sum_logits")
    b = scoring.score_topk_ref(q, k, lo, hi, 8, reduce="sum_softmax", kv_lens=kv_lens)
    assert set(a.flatten().tolist()) != set(b.flatten().tolist())
    for norm_lens in (kv_lens, None):
        true = _scores64(q, k, "sum_softmax", *_norm("sum_softmax", lo.cpu(), hi.cpu(),
                                                     None if norm_lens is None else kv_lens.cpu()))
        out = scoring.score_topk_triton(q, k, lo, hi, 8, reduce="sum_softmax", kv_lens=norm_lens)
        _check_topk(out, true, lo.cpu(), hi.cpu(), 8, atol=1e-6)


@pytest.mark.parametrize("keys", ["float", "int8", "int4"])
@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_score_topk_out_writes_the_selection_in_place(keys, impl, device, monkeypatch):
    """``out=`` (a layer's row of a pack's [n, B, Hkv, K] output buffer, stale data in it)
    gets exactly the indices the call returns without it, -1 padding included, and is
    itself returned; a wrong buffer is refused; k_top = 0 and empty rows too."""
    fn = scoring.score_topk_ref if impl == "ref" else scoring.score_topk_triton
    q, k, kv_lens, kv_start = _inputs(3, 4, 2, 37, 16, torch.bfloat16, device, seed=12)
    q, k, kw = _quant_keys(q, k, keys, device)
    lo, hi = _bounds(kv_lens, kv_start, 1, 2)
    hi[1] = lo[1]  # an empty row: all -1
    for k_top in (5, 40, 0):
        want = fn(q, k, lo, hi, k_top, **kw)
        buf = torch.full((2, 3, 2, k_top), 7, dtype=torch.int32, device=device)
        got = fn(q, k, lo, hi, k_top, **kw, out=buf[1])
        assert got.data_ptr() == buf[1].data_ptr() and got.shape == (3, 2, k_top)
        assert torch.equal(buf[1], want) and (buf[0] == 7).all()
        if k_top == 5:
            assert (buf[1, 1] == -1).all() and (buf[1, 0] >= 0).all()
    monkeypatch.setenv("SPADE_KERNELS", "torch" if impl == "ref" else "triton")
    buf = torch.empty(3, 2, 5, dtype=torch.int32, device=device)
    assert kernels.score_topk(q, k, lo, hi, 5, **kw, out=buf) is buf  # the public op passes it on
    assert torch.equal(buf, fn(q, k, lo, hi, 5, **kw))
    for bad in (torch.empty(3, 2, 6, dtype=torch.int32, device=device),  # shape
                torch.empty(3, 2, 5, dtype=torch.int64, device=device),  # dtype
                torch.empty(3, 5, 2, dtype=torch.int32, device=device).transpose(1, 2)):  # not contiguous
        with pytest.raises(ValueError, match="out must be"):
            fn(q, k, lo, hi, 5, **kw, out=bad)


def test_score_topk_dispatch(monkeypatch, device):
    """The public entry point routes to Triton when forced (and on CUDA tensors)."""
    monkeypatch.setenv("SPADE_KERNELS", "triton")
    q, k, kv_lens, kv_start = _inputs(1, 4, 2, 37, 16, torch.float32, device, seed=8)
    lo, hi = _bounds(kv_lens, kv_start, 1, 1)
    out = kernels.score_topk(q, k, lo, hi, 5)
    _check_topk(out, _scores64(q, k, "sum_logits", lo.cpu(), hi.cpu()), lo.cpu(), hi.cpu(), 5, atol=1e-5)
    s = kernels.group_scores(q, k, kv_lens, kv_start=kv_start)
    torch.testing.assert_close(s.double().cpu(), _scores64(q, k, "sum_logits", kv_start.cpu(), kv_lens.cpu()),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("keys", ["exact", "int4", "paged"])
def test_score_topk_ref_reads_no_position_past_the_rows(reduce, keys, monkeypatch):
    """The torch reference (the CPU's selection kernel) scores the keys up to the rows'
    furthest bound only (the candidates' ``hi``, or ``kv_lens`` for the ``sum_softmax``
    normaliser; whole blocks through a table), not the cache's whole length, and selects
    exactly what the whole length gives (every K case, int4 copies with their scales)."""
    from spade.kernels import quant
    from spade.kernels.paged import scatter_to_pool

    B, Hq, Hkv, D, L = 3, 4, 2, 16, 96
    q, k, kv_lens, kv_start = _inputs(B, Hq, Hkv, L, D, torch.float32, "cpu", seed=21)
    kv_lens = torch.tensor([37, 29, 40])
    lo, hi = _bounds(kv_lens, kv_start, 1, 2)
    norm_lens = kv_lens if reduce == "sum_softmax" else None
    ks, table = None, None
    if keys == "int4":
        k, ks = quant.quantize_keys_int4_ref(torch.nan_to_num(k))
    elif keys == "paged":
        k, table = scatter_to_pool(torch.nan_to_num(k), 8, torch.Generator().manual_seed(3), lens=kv_lens)
    reads = []
    logits = scoring._group_logits_ref
    monkeypatch.setattr(scoring, "_group_logits_ref", lambda q, k, *a: reads.append(k.shape[2]) or logits(q, k, *a))
    cut = scoring.cut_logical
    for case in K_CASES:
        k_top = _k_top(case, int(hi.max()))
        kw = dict(reduce=reduce, kv_lens=norm_lens, kv_start=kv_start, k_scale=ks, block_table=table)
        reads.clear()
        got = scoring.score_topk_ref(q, k, lo, hi, k_top, **kw)
        end = int((kv_lens if norm_lens is not None else hi).max())
        assert reads == [end if table is None else -(-end // 8) * 8]
        monkeypatch.setattr(scoring, "cut_logical", lambda end, L, bt, bs, *xs: (L, bt, *xs))
        want = scoring.score_topk_ref(q, k, lo, hi, k_top, **kw)
        monkeypatch.setattr(scoring, "cut_logical", cut)
        assert reads[-1] == (L if table is None else table.shape[1] * 8)  # (the whole length, uncut)
        assert torch.equal(got, want)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(B=st.integers(1, 2), Hkv=st.sampled_from([1, 2]), G=st.sampled_from([1, 2, 3]), L=st.integers(1, 70),
       D=st.sampled_from([8, 16, 32]), reduce=st.sampled_from(REDUCES), sink=st.integers(0, 4),
       recent=st.integers(0, 4), k_top=st.integers(1, 80), seed=st.integers(0, 2**16))
def test_score_topk_fuzz(B, Hkv, G, L, D, reduce, sink, recent, k_top, seed, device):
    q, k, kv_lens, kv_start = _inputs(B, G * Hkv, Hkv, L, D, torch.float32, device, seed=seed)
    lo, hi = _bounds(kv_lens, kv_start, sink, recent)
    norm_lens = kv_lens if reduce == "sum_softmax" else None
    out = scoring.score_topk_triton(q, k, lo, hi, k_top, reduce=reduce, kv_lens=norm_lens)
    true = _scores64(q, k, reduce, *_norm(reduce, lo.cpu(), hi.cpu(), None if norm_lens is None else kv_lens.cpu()))
    _check_topk(out, true, lo.cpu(), hi.cpu(), k_top, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# int8 scoring keys (spade.kernels.quant): logits = scale * (q . kq) * ks
# ------------------------------------------------------------------------------------------------


def _int8_inputs(B, Hq, Hkv, L, D, dtype, device, *, seed):
    """``_inputs`` with the keys quantised; returns (q, kq, ks, kv_lens, kv_start, k_deq64)
    where k_deq64 = kq * ks in float64 on the CPU (the keys the int8 path really scores).
    The NaN garbage after kv_lens gives NaN scales there, which must never leak."""
    from spade.kernels import quant

    q, k, kv_lens, kv_start = _inputs(B, Hq, Hkv, L, D, torch.float32, "cpu", seed=seed)
    kq, ks = quant.quantize_keys_ref(k)
    k_deq = kq.double() * ks.double()[..., None]
    return q.to(dtype).to(device), kq.to(device), ks.to(device), kv_lens.to(device), kv_start.to(device), k_deq


# the int8 path scores in the query's dtype; a 16-bit query is exact in fp32 products
INT8_QDTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("reduce,heads,qdtype,B,L,D", _grid(REDUCES, HEADS, INT8_QDTYPES))
def test_group_scores_int8_matches_ref_and_float64(reduce, heads, qdtype, B, L, D, device):
    q, kq, ks, kv_lens, kv_start, k_deq = _int8_inputs(B, *heads, L, D, qdtype, device, seed=11)
    ref = scoring.group_scores_ref(q, kq, kv_lens, reduce=reduce, kv_start=kv_start, k_scale=ks)
    out = scoring.group_scores_triton(q, kq, kv_lens, reduce=reduce, kv_start=kv_start, k_scale=ks)
    true = _scores64(q.cpu(), k_deq, reduce, kv_start.cpu(), kv_lens.cpu())
    assert not out.isnan().any() and not ref.isnan().any()
    torch.testing.assert_close(ref.cpu().double(), true, rtol=1e-5, atol=1e-5)
    rtol, atol = TOL[qdtype]
    torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("reduce,heads,B,L,D", _grid(REDUCES, HEADS))
def test_score_topk_int8_matches_ref(reduce, heads, B, L, D, device):
    q, kq, ks, kv_lens, kv_start, k_deq = _int8_inputs(B, *heads, L, D, torch.bfloat16, device, seed=12)
    lo, hi = _bounds(kv_lens, kv_start, 1, 2)
    norm_lens = kv_lens if reduce == "sum_softmax" else None
    true = _scores64(q.cpu(), k_deq, reduce, *_norm(reduce, lo.cpu(), hi.cpu(),
                                                    None if norm_lens is None else kv_lens.cpu()))
    for case in K_CASES:
        k_top = _k_top(case, L)
        ref = scoring.score_topk_ref(q, kq, lo, hi, k_top, reduce=reduce, kv_lens=norm_lens, k_scale=ks)
        out = kernels.score_topk(q, kq, lo, hi, k_top, reduce=reduce, kv_lens=norm_lens, k_scale=ks) \
            if device.type == "cuda" else \
            scoring.score_topk_triton(q, kq, lo, hi, k_top, reduce=reduce, kv_lens=norm_lens, k_scale=ks)
        _check_topk(ref, true, lo.cpu(), hi.cpu(), k_top, atol=1e-5)
        _check_topk(out, true, lo.cpu(), hi.cpu(), k_top, atol=1e-4)
        torch.testing.assert_close(_sel_sum(out, true), _sel_sum(ref, true), rtol=1e-5, atol=1e-4)


def test_int8_keys_need_their_scales():
    from spade.kernels import quant

    q = torch.randn(1, 2, 16)
    kq, ks = quant.quantize_keys_ref(torch.randn(1, 1, 8, 16))
    lo, hi = torch.tensor([0]), torch.tensor([8])
    for fn in (scoring.score_topk_ref, scoring.score_topk_triton):
        with pytest.raises(ValueError, match="k_scale"):
            fn(q, kq, lo, hi, 2)
        with pytest.raises(ValueError, match="k_scale"):
            fn(q, kq, lo, hi, 2, k_scale=ks[..., :4])
        with pytest.raises(ValueError, match="k_scale"):
            fn(q, kq.float(), lo, hi, 2, k_scale=ks)
    for fn in (scoring.group_scores_ref, scoring.group_scores_triton):
        with pytest.raises(ValueError, match="k_scale"):
            fn(q, kq, torch.tensor([8]))


def _structured_keys(B, H, L, D, g):
    """Keys with structure real caches show: a shared mean direction, a few heavy
    channels (outliers) and per-token norms that vary by ~2x, plus isotropic noise."""
    mean = torch.randn(1, H, 1, D, generator=g)
    heavy = torch.zeros(D)
    heavy[torch.randperm(D, generator=g)[:4]] = 4.0
    norm = torch.exp(0.35 * torch.randn(B, H, L, 1, generator=g))
    return (mean + torch.randn(B, H, L, D, generator=g) * (1 + heavy)) * norm


@pytest.mark.parametrize("reduce", REDUCES)
def test_int8_selection_overlaps_exact_selection(reduce):
    """Selection quality: the int8-scored top-K shares >= 90 % of its positions with the
    exact-scored top-K (bf16 keys, queries correlated with some keys). Torch refs only:
    this is about the quantisation, the kernels are checked against the refs above."""
    from spade.kernels import quant

    g = torch.Generator().manual_seed(21)
    B, Hq, Hkv, L, D, K = 3, 8, 2, 2048, 64, 128
    k = _structured_keys(B, Hkv, L, D, g).bfloat16()
    q = (k[:, :, torch.randint(0, L, (Hq // Hkv,), generator=g)].float().reshape(B, Hq, D)
         + torch.randn(B, Hq, D, generator=g)).bfloat16()
    kq, ks = quant.quantize_keys_ref(k)
    lo, hi, kv = torch.zeros(B, dtype=torch.long), torch.full((B,), L), torch.full((B,), L)
    exact = scoring.score_topk_ref(q, k, lo, hi, K, reduce=reduce, kv_lens=kv)
    approx = scoring.score_topk_ref(q, kq, lo, hi, K, reduce=reduce, kv_lens=kv, k_scale=ks)
    overlap = sum(len(set(exact[b, h].tolist()) & set(approx[b, h].tolist()))
                  for b in range(B) for h in range(Hkv)) / (B * Hkv * K)
    print(f"int8 vs exact top-{K} overlap ({reduce}): {overlap:.4f}")
    assert overlap >= 0.9, overlap


# ------------------------------------------------------------------------------------------------
# benchmarks/bench_scoring.py on a CPU (--tiny): the script itself, not the numbers
# ------------------------------------------------------------------------------------------------


def test_bench_scoring_tiny_writes_rows_and_plot(tmp_path):
    import json

    from benchmarks import bench_scoring

    if not torch.cuda.is_available():
        assert __import__("os").environ.get("TRITON_INTERPRET") == "1"
    out = tmp_path / "b.json"
    assert bench_scoring.main(["--tiny", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["tiny"] and doc["skipped"] == []
    got = {(r["op"], r["impl"], r["B"], r.get("K")) for r in doc["rows"]}
    for B in (1, 3):
        for op, impl in [("score_topk", "triton"), ("score_topk", "triton_int8"), ("score_topk_softmax", "triton"),
                         ("score_topk_softmax", "triton_int8")]:
            assert (op, impl, B, 16) in got, (op, impl, B)
        assert ("group_scores", "triton_int8", B, None) in got
    assert ("score_topk_softmax", "lane_stats", 1, 16) in got and ("score_topk", "separate_hist0", 1, 16) in got
    int8 = [r for r in doc["rows"] if r["op"] == "score_topk" and r["impl"] == "triton_int8"]
    # floor = int8 keys + fp32 scales of the candidates, less than half the bf16 key bytes + 4 B/token
    bf16 = {r["B"]: r for r in doc["rows"] if r["op"] == "score_topk" and r["impl"] == "triton"}
    for r in int8:
        assert r["deficit"] <= 1e-6 and 0.0 <= r["overlap_exact"] <= 1.0 and r["ms"] > 0
        D = doc["model"]["d"]
        assert r["floor_ms"] == pytest.approx(bf16[r["B"]]["floor_ms"] * (D + 4) / (2 * D))
    assert (tmp_path / "b.png").stat().st_size > 0 and doc["plot"].endswith("b.png")


def test_bench_scoring_softmax_sweep_rows(tmp_path, monkeypatch):
    """--softmax-sweep alone (--no-grid): a row per config and key copy, the same
    selection under every config (overlap with the first = 1), the config's overrides
    left cleared."""
    import json

    from benchmarks import bench_scoring

    monkeypatch.setattr(bench_scoring, "SOFTMAX_SWEEP", bench_scoring.SOFTMAX_SWEEP[:2])
    out = tmp_path / "s.json"
    assert bench_scoring.main(["--tiny", "--no-grid", "--softmax-sweep", "2x150", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["keys"], r["config"]) for r in rows) == [("int4", 0), ("int4", 1), ("int8", 0), ("int8", 1)]
    assert all(r["op"] == "softmax_sweep" and r["ms"] > 0 and r["scores_ms"] > 0 for r in rows)
    assert [r["overlap_first"] for r in rows if r["config"] == 1] == [1.0, 1.0]
    assert scoring.SOFTMAX_CONFIG == {}


def test_bench_scoring_budget_skips_with_reason(tmp_path):
    import json

    from benchmarks import bench_scoring

    out = tmp_path / "b.json"
    assert bench_scoring.main(["--tiny", "--budget-s", "0", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["rows"] == [] and len(doc["skipped"]) == 2
    assert all("budget" in s["reason"] for s in doc["skipped"])


@pytest.mark.parametrize("heads,B,L,D", [((4, 4), 1, 37, 16), ((4, 2), 3, 161, 64), ((4, 1), 3, 130, 16)])
def test_sum_softmax_lane_stats_matches_ref(heads, B, L, D, device):
    """SCORE_CONFIG["LANE_STATS"]: per-element online statistics reduced once per chunk
    (several chunks and tiles per row here: L=161 is two chunks of 96, three tiles of 32
    each, the last one partial) give the reference scores and selection."""
    q, k, kv_lens, kv_start = _inputs(B, *heads, L, D, torch.bfloat16, device, seed=31)
    scoring.SCORE_CONFIG.update(LANE_STATS=True, MIN_CHUNK=128, BLOCK_L=32)
    out = scoring.group_scores_triton(q, k, kv_lens, reduce="sum_softmax", kv_start=kv_start)
    ref = scoring.group_scores_ref(q, k, kv_lens, reduce="sum_softmax", kv_start=kv_start)
    torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=1e-4, atol=1e-5)
    lo, hi = _bounds(kv_lens, kv_start, 1, 2)
    true = _scores64(q, k, "sum_softmax", *_norm("sum_softmax", lo.cpu(), hi.cpu(), kv_lens.cpu()))
    for case in K_CASES:
        k_top = _k_top(case, L)
        idx = scoring.score_topk_triton(q, k, lo, hi, k_top, reduce="sum_softmax", kv_lens=kv_lens)
        _check_topk(idx, true, lo.cpu(), hi.cpu(), k_top, atol=1e-4)


@pytest.mark.parametrize("heads,dtype,B,L,D", _grid(HEADS, DTYPES))
def test_gemv_sum_logits_path_for_every_key_dtype(heads, dtype, B, L, D, device, monkeypatch):
    """The GEMV scoring path (the group collapsed into one query) on float keys too
    (``GEMV_CONFIG["use"] = "all"``): the reference's scores and selections, NaN keys
    past kv_lens never read, -inf outside the range."""
    monkeypatch.setitem(scoring.GEMV_CONFIG, "use", "all")
    q, k, kv_lens, kv_start = _inputs(B, *heads, L, D, dtype, device, seed=21)
    ref = scoring.group_scores_ref(q, k, kv_lens, kv_start=kv_start)
    out = scoring.group_scores_triton(q, k, kv_lens, kv_start=kv_start)
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    fin = torch.isfinite(ref)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out[fin], ref[fin], rtol=max(rtol, 1e-4), atol=max(atol, 1e-4))
    lo, hi = _bounds(kv_lens, kv_start, 2, 3)
    true = _scores64(q, k, "sum_logits", lo.cpu(), hi.cpu())
    for case in K_CASES:
        k_top = _k_top(case, L)
        idx = scoring.score_topk_triton(q, k, lo, hi, k_top)
        _check_topk(idx, true, lo.cpu(), hi.cpu(), k_top, atol=1e-4)
        want = scoring.score_topk_ref(q, k, lo, hi, k_top)
        torch.testing.assert_close(_sel_sum(idx, true), _sel_sum(want, true), rtol=1e-5, atol=1e-4)

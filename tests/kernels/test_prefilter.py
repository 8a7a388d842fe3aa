"""The page prefilter (``spade.kernels.prefilter``): level 1 (page means or Quest bounds,
best pages) then level 2 (the pages' tokens scored on the selection's copy).

* Pages covering the whole middle give the token-level top-K of ``score_topk_ref`` (every
  reduction, exact / int8 / int4 copies, left padding, K = 1, K >= context).
* With fewer pages, both level-1 paths (Triton under the interpreter, torch references)
  match an independent loop over (row, head): summaries, page choice, token choice.
* The page means folded in token by token equal the means built from the whole cache.
Random continuous inputs: no ties, so the selected sets are compared exactly.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from spade import kernels
from spade.kernels import prefilter, quant
from spade.kernels.scoring import score_topk_ref

HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA
REDUCES = ["sum_logits", "max_logits", "sum_softmax"]


def _case(B, Hq, Hkv, L, D, *, seed, padded=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g)
    k = torch.randn(B, Hkv, L, D, generator=g) * (1 + torch.rand(D, generator=g) * 2)
    kv_lens = torch.randint(max(1, L // 2), L + 1, (B,), generator=g)
    kv_lens[0] = L
    kv_start = torch.zeros(B, dtype=torch.int64)
    if padded and B > 1:
        kv_start[1:] = torch.randint(0, 5, (B - 1,), generator=g).clamp(max=kv_lens[1:] - 1)
    return q, k, kv_lens, kv_start


def _copy(k, q, kv_lens, kv_start, mode):
    """The scored copy and query: (k, k_scale, q) for exact / int8 / int4."""
    if mode == "exact":
        return k, None, q
    if mode == "int8":
        kq, ks = quant.quantize_keys_ref(k)
        return kq, ks, q
    sm = quant.fit_smoothing(k, kv_lens, kv_start)
    kq, ks = quant.quantize_keys_int4_ref(k, sm)
    return kq, ks, quant.fold_smoothing(q, sm)


def _middle(kv_lens, kv_start, n_sink, n_recent):
    lo = torch.minimum(kv_start + n_sink, kv_lens)
    hi = torch.maximum(kv_lens - n_recent, lo)
    return lo, hi


def _norm(kv_lens, kv_start, lo, hi, n_sink, n_recent, reduce):
    if reduce != "sum_softmax":
        return None
    return prefilter.norm_positions(torch.minimum(kv_start, lo), lo, hi, torch.maximum(kv_lens, hi), n_sink, n_recent)


def _summary(kind, k, kv_lens, kv_start, ps):
    if kind == "mean":
        return (prefilter.page_sums(k, kv_lens, ps, kv_start=kv_start)[1],)
    return kernels.quest.quest_build_ref(k, kv_lens, ps, kv_start=kv_start)


def _sets(idx):
    return [[sorted(i for i in row if i >= 0) for row in head] for head in idx.tolist()]


@pytest.mark.parametrize("triton", [False, True])
@pytest.mark.parametrize("summary", ["mean", "bounds"])
@pytest.mark.parametrize("mode", ["exact", "int8", "int4"])
@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("heads,B,L,ps,k_top", [
    ((4, 2), 3, 53, 7, 9),      # GQA, odd length, a page size that divides nothing
    ((4, 4), 1, 37, 1, 5),      # MHA, B=1, one token per page
    ((4, 1), 2, 61, 16, 1),     # MQA, K=1
    ((4, 2), 2, 29, 32, 40),    # one page > the row, K >= context
])
def test_pages_covering_the_middle_give_the_token_level_topk(triton, summary, mode, reduce, heads, B, L, ps, k_top):
    Hq, Hkv = heads
    D, n_sink, n_recent = 16, 2, 3
    q, k, kv_lens, kv_start = _case(B, Hq, Hkv, L, D, seed=zlib.crc32(f"{mode}{reduce}{L}".encode()) % 1000)
    kc, ks, qs = _copy(k, q, kv_lens, kv_start, mode)
    lo, hi = _middle(kv_lens, kv_start, n_sink, n_recent)
    summ = _summary(summary, k, kv_lens, kv_start, ps)
    n_pages = math.ceil(L / ps) + 1  # more than the row holds
    fn = prefilter.prefilter_select if triton else prefilter.prefilter_select_ref
    extra = dict(triton=True) if triton else {}
    got = fn(q, summ, qs, kc, lo, hi, k_top, n_pages, ps, reduce=reduce, k_scale=ks,
             norm_pos=_norm(kv_lens, kv_start, lo, hi, n_sink, n_recent, reduce), **extra)
    want = score_topk_ref(qs, kc, lo, hi, k_top, reduce=reduce, kv_lens=kv_lens, kv_start=kv_start, k_scale=ks)
    assert got.shape == (B, Hkv, k_top) and got.dtype == torch.int32
    assert _sets(got) == _sets(want)


def _loop_reference(q, k, kv_lens, kv_start, lo, hi, k_top, n_pages, ps, page_reduce, summary):
    """Independent loops (sum_logits tokens): per (b, h), each page's mean or bounds over
    [kv_start, kv_len), the n best pages of [lo // ps, ceil(hi / ps)), their tokens in
    [lo, hi), the k_top best tokens."""
    B, Hq, D = q.shape
    Hkv, G = k.shape[1], Hq // k.shape[1]
    sc = D ** -0.5
    out = []
    for b in range(B):
        s0, n, l0, h0 = int(kv_start[b]), int(kv_lens[b]), int(lo[b]), int(hi[b])
        rows = []
        for h in range(Hkv):
            qg = q[b, h * G:(h + 1) * G].double()  # [G, D]
            pscore = {}
            if h0 > l0:
                for p in range(l0 // ps, math.ceil(h0 / ps)):
                    keys = k[b, h, max(p * ps, s0):min((p + 1) * ps, n)].double()
                    if summary == "mean":
                        per_head = (qg @ keys.mean(0)) * sc  # [G]
                    else:
                        mn, mx = keys.amin(0), keys.amax(0)
                        per_head = (torch.maximum(qg * mn, qg * mx)).sum(1) * sc  # [G]
                    pscore[p] = float(per_head.sum() if page_reduce == "sum_logits" else per_head.max())
            best = sorted(pscore, key=lambda p: -pscore[p])[:n_pages]
            toks = [t for p in best for t in range(p * ps, (p + 1) * ps) if l0 <= t < h0]
            ts = {t: float((qg @ k[b, h, t].double()).sum() * sc) for t in toks}
            rows.append(sorted(sorted(ts, key=lambda t: -ts[t])[:k_top]))
        out.append(rows)
    return out


@pytest.mark.parametrize("triton", [False, True])
@pytest.mark.parametrize("summary", ["mean", "bounds"])
@pytest.mark.parametrize("page_reduce", ["sum_logits", "max_logits"])
@pytest.mark.parametrize("heads,B,L,ps,n_pages,k_top", [
    ((4, 2), 3, 97, 8, 3, 7),
    ((4, 4), 1, 45, 5, 2, 1),
    ((4, 1), 2, 70, 16, 1, 16),  # one page: every token of it (the edge clipped)
])
def test_partial_pages_match_independent_loops(triton, summary, page_reduce, heads, B, L, ps, n_pages, k_top):
    Hq, Hkv = heads
    D = 16
    q, k, kv_lens, kv_start = _case(B, Hq, Hkv, L, D, seed=11 + L)
    lo, hi = _middle(kv_lens, kv_start, 2, 4)
    summ = _summary(summary, k, kv_lens, kv_start, ps)
    fn = prefilter.prefilter_select if triton else prefilter.prefilter_select_ref
    extra = dict(triton=True) if triton else {}
    got = fn(q, summ, q, k, lo, hi, k_top, n_pages, ps, reduce="sum_logits", page_reduce=page_reduce, **extra)
    assert _sets(got) == _loop_reference(q, k, kv_lens, kv_start, lo, hi, k_top, n_pages, ps, page_reduce, summary)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_means_folded_token_by_token_equal_the_built_ones(dtype):
    """``page_means_update`` from the prompt's sums, one key per step (left padding, pages
    that start mid-prompt, a page started by its first valid key) equals ``page_sums``
    of the whole cache: the fp32 sums to rounding, the means in the cache dtype."""
    B, H, L, D, ps, T = 3, 2, 45, 8, 8, 13
    g = torch.Generator().manual_seed(1)
    k = torch.randn(B, H, L, D, generator=g).to(dtype)
    kv_start = torch.tensor([0, 3, 12])
    psum, pmean = prefilter.page_sums(k, torch.full((B,), T), ps, kv_start=kv_start)
    for t in range(T, L):
        prefilter.page_means_update(psum, pmean, k[:, :, t], torch.full((B,), t), ps, kv_start)
    want_sum, want_mean = prefilter.page_sums(k, torch.full((B,), L), ps, kv_start=kv_start)
    torch.testing.assert_close(psum, want_sum, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(pmean.float(), want_mean.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                               atol=1e-6)
    assert prefilter.page_counts(6, ps, torch.full((B,), L), kv_start)[2].tolist() == [0, 4, 8, 8, 8, 5]


def test_empty_middle_and_out_buffer():
    """A row whose sinks and recent window cover it selects nothing (all -1, no NaN page
    from an edge page without keys); ``out`` is written in place and returned."""
    q, k, _, _ = _case(2, 4, 2, 20, 8, seed=3, padded=False)
    kv_lens = torch.tensor([20, 4])
    kv_start = torch.zeros(2, dtype=torch.int64)
    lo, hi = _middle(kv_lens, kv_start, 2, 3)
    summ = kernels.quest.quest_build_ref(k, kv_lens, 8, kv_start=kv_start)  # bounds: an empty page is +-inf
    out = torch.empty(2, 2, 4, dtype=torch.int32)
    got = prefilter.prefilter_select_ref(q, summ, q, k, lo, hi, 4, 2, 8, out=out)
    assert got is out
    assert (got[1] == -1).all() and (got[0] >= 0).all()


def test_candidates_and_ranges():
    lo, hi = torch.tensor([3, 10, 5]), torch.tensor([21, 10, 6])
    p_lo, p_hi = prefilter.page_range(lo, hi, 8)
    assert p_lo.tolist() == [0, 1, 0] and p_hi.tolist() == [3, 1, 1]
    pages = torch.tensor([[[0, 2]], [[-1, -1]], [[0, -1]]], dtype=torch.int32)
    cand = prefilter.pages_to_candidates(pages, lo, hi, 8)
    assert cand.shape == (3, 1, 16)
    assert sorted(i for i in cand[0, 0].tolist() if i >= 0) == [3, 4, 5, 6, 7, 16, 17, 18, 19, 20]
    assert (cand[1] == -1).all() and [i for i in cand[2, 0].tolist() if i >= 0] == [5]


def test_bytes():
    two, one = prefilter.prefilter_bytes(524288, 128, 256, 32, key_bytes_per_token=68, summary="bounds")
    assert one == 524288 * 68 and two == 16384 * 512 + 8192 * 68 and two < one / 3
    two, _ = prefilter.prefilter_bytes(524288, 128, 256, 32, key_bytes_per_token=68)
    assert two == 16384 * 256 + 8192 * 68


def test_bad_arguments():
    q, k, kv_lens, kv_start = _case(1, 2, 1, 16, 8, seed=0)
    kmin, kmax = kernels.quest.quest_build_ref(k, kv_lens, 4)
    lo, hi = _middle(kv_lens, kv_start, 1, 1)
    with pytest.raises(ValueError, match="n_pages"):
        prefilter.prefilter_select_ref(q, (kmin, kmax), q, k, lo, hi, 2, 0, 4)
    with pytest.raises(ValueError, match="do not cover"):
        prefilter.prefilter_select_ref(q, (kmin[:, :, :2], kmax[:, :, :2]), q, k, lo, hi, 2, 2, 4)
    with pytest.raises(ValueError, match="k_scale"):
        prefilter.prefilter_select_ref(q, (kmin, kmax), q, k, lo, hi, 2, 2, 4, k_scale=torch.ones(1, 1, 16))
    with pytest.raises(ValueError, match="summary"):
        prefilter.prefilter_select_ref(q, (kmin, kmax, kmin), q, k, lo, hi, 2, 2, 4)

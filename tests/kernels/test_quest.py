"""Quest page bounds, page scores and page selection: Triton vs reference vs independent loops.

Bounds are min/max of the same values, so Triton and the reference must agree exactly.
Page scores differ only by fp32 summation order. Selections are compared through the
page scores of the chosen pages (ties may choose different pages).

Pages are relative to each row's start: row b's page p holds the positions
``[kv_start[b] + p*S, kv_start[b] + (p+1)*S)``, so moving a row's window changes
nothing but the positions' offset (``test_select_shift_invariant``).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spade import kernels
from spade.kernels import quest
from tests.kernels.aot import run_aot_script

HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REDUCES = ["sum_logits", "max_logits"]
SHAPES = [(1, 37, 16, 8), (3, 130, 64, 16), (3, 1, 16, 4), (1, 130, 64, 5), (3, 37, 64, 1), (3, 61, 16, 7)]
# (B, L, D, page_size): odd lengths, page sizes that do not divide them, page_size 1

# page scores: identical rounded inputs on both sides, fp32 sums over D terms in another
# order (tensor-core accumulation order is unspecified for 16-bit inputs). (rtol, atol)
IMPLS = ("radix", "rowselect")  # quest_select_triton implementations
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-4, 1e-4), torch.bfloat16: (1e-4, 1e-4)}


def _grid(*axes):
    """Product of ``axes`` with SHAPES cycled along it: (*combo, B, L, D, page_size)."""
    return [(*combo, *shape) for combo, shape in zip(itertools.product(*axes), itertools.cycle(SHAPES))]


def _inputs(B, Hq, Hkv, L, D, dtype, device, *, seed=0):
    """Random q/k; row b valid on [kv_start[b], kv_lens[b]) with kv_start > 0 on some
    rows; NaN garbage after kv_lens (must never reach a bound)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g).to(dtype).to(device)
    k = torch.randn(B, Hkv, L, D, generator=g).to(dtype)
    kv_lens = torch.tensor([max(1, L - 5 * b) for b in range(B)])
    kv_start = torch.tensor([min(3 * b, int(kv_lens[b]) - 1) for b in range(B)])
    for b in range(B):
        k[b, :, int(kv_lens[b]):] = float("nan")
    return q, k.to(device), kv_lens.to(device), kv_start.to(device)


def _bounds_loop(k, kv_lens, kv_start, page_size):
    """Independent page bounds: a Python loop over rows and (relative) pages, in float64."""
    B, H, L, D = k.shape
    P = -(-L // page_size)
    kmin = torch.full((B, H, P, D), float("inf"), dtype=torch.float64)
    kmax = torch.full((B, H, P, D), float("-inf"), dtype=torch.float64)
    k64 = k.double().cpu()
    for b in range(B):
        s = int(kv_start[b])
        for p in range(P):
            lo = s + p * page_size
            hi = min(s + (p + 1) * page_size, int(kv_lens[b]))
            if hi > lo:
                kmin[b, :, p] = k64[b, :, lo:hi].amin(1)
                kmax[b, :, p] = k64[b, :, lo:hi].amax(1)
    return kmin, kmax


def _page_scores64(q, kmin, kmax, reduce, page_lo, n_pages, scale=None):
    """Independent float64 page bounds: max over the two corners, per head, then reduce."""
    B, Hq, D = q.shape
    Hkv, P = kmin.shape[1], kmin.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    q64 = q.to(kmin.dtype).double().cpu()
    out = torch.full((B, Hkv, P), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for h in range(Hkv):
            for p in range(int(page_lo[b]), int(n_pages[b])):
                mn, mx = kmin[b, h, p].double().cpu(), kmax[b, h, p].double().cpu()
                per_head = [float((torch.maximum(q64[b, h * G + g] * mn, q64[b, h * G + g] * mx)).sum()) * scale
                            for g in range(G)]
                out[b, h, p] = sum(per_head) if reduce == "sum_logits" else max(per_head)
    return out


def _plan(kv_lens, kv_start, page_size):
    """Per row: first page (0: pages are relative to kv_start) and number of pages."""
    kv = kv_lens.cpu().long()
    start = kv_start.cpu().long()
    n_pages = torch.where(kv > start, (kv - start + page_size - 1) // page_size, 0)
    return torch.zeros_like(kv), n_pages


def _check_selection(idx, scores64, kv_lens, kv_start, n_sel, page_size, *, atol):
    """``idx`` [B, H, n_sel * ps] is a valid Quest selection: the last page always, the
    best other pages (up to ``atol`` on the page scores), no duplicates, every valid
    token of a chosen page and nothing outside [kv_start, kv_lens); pages relative to
    kv_start. Returns the chosen pages' score sum [B, H] (for comparing two implementations)."""
    B, H, S = idx.shape
    assert S == n_sel * page_size and idx.dtype == torch.int32
    idx = idx.cpu().long()
    page_lo, n_pages = _plan(kv_lens, kv_start, page_size)
    sums = torch.zeros(B, H, dtype=torch.float64)
    for b in range(B):
        s_b, kv_b = int(kv_start[b]), int(kv_lens[b])
        for h in range(H):
            tok = idx[b, h][idx[b, h] >= 0]
            assert len(torch.unique(tok)) == len(tok), "duplicate tokens"
            assert ((tok >= s_b) & (tok < kv_b)).all(), "token outside [kv_start, kv_lens)"
            pages = torch.unique((tok - s_b) // page_size)
            last = int(n_pages[b]) - 1
            if kv_b <= s_b:
                assert len(tok) == 0
                continue
            assert last in pages.tolist(), "the last page is always kept"
            for p in pages.tolist():  # whole pages (their valid part)
                lo, hi = s_b + p * page_size, min(s_b + (p + 1) * page_size, kv_b)
                assert ((tok >= lo) & (tok < hi)).sum() == hi - lo, f"page {p} only partly selected"
            others = [p for p in pages.tolist() if p != last]
            cand = list(range(int(page_lo[b]), last))
            assert len(others) == min(n_sel - 1, len(cand))
            if others:
                cs = scores64[b, h, cand]
                kth = cs.topk(len(others)).values[-1]
                chosen = scores64[b, h, others]
                assert chosen.min() >= kth - atol, "a chosen page is below the K-th best"
                rest = [p for p in cand if p not in others]
                if rest:
                    assert scores64[b, h, rest].max() <= kth + atol, "a better page was left out"
                sums[b, h] = chosen.sum()
    return sums


# ------------------------------------------------------------------------------------------------
# quest_build / quest_update
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads,dtype,B,L,D,page_size", _grid(HEADS, DTYPES))
def test_build_matches_loop_and_triton(heads, dtype, B, L, D, page_size, device):
    _, k, kv_lens, kv_start = _inputs(B, *heads, L, D, dtype, device, seed=1)
    kmin, kmax = quest.quest_build_ref(k, kv_lens, page_size, kv_start=kv_start)
    lmin, lmax = _bounds_loop(k, kv_lens.cpu(), kv_start.cpu(), page_size)
    assert kmin.dtype == dtype and kmin.shape == lmin.shape
    assert torch.equal(kmin.double().cpu(), lmin) and torch.equal(kmax.double().cpu(), lmax)
    tmin, tmax = quest.quest_build_triton(k, kv_lens, page_size, kv_start=kv_start)
    assert torch.equal(tmin, kmin) and torch.equal(tmax, kmax)


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("starts", [None, [0, 5, 2]])
def test_update_token_by_token_equals_build(impl, dtype, starts, device):
    """Appending the keys one at a time (rows at different lengths and starts, a page's
    first token resetting stale bounds) ends where quest_build over the whole cache does."""
    update = quest.quest_update_ref if impl == "ref" else quest.quest_update_triton
    B, Hkv, L, D, ps = 3, 2, 23, 16, 4
    _, k, _, _ = _inputs(B, 4, Hkv, L, D, dtype, device, seed=2)
    k = torch.nan_to_num(k, nan=0.5)
    lens = torch.tensor([23, 17, 9], device=device)
    start = None if starts is None else torch.tensor(starts, device=device)
    lo = torch.zeros_like(lens) if start is None else start
    P = -(-L // ps)
    # stale garbage bounds: every page's first token must overwrite them
    kmin = torch.full((B, Hkv, P, D), -7.0, dtype=dtype, device=device)
    kmax = torch.full((B, Hkv, P, D), 7.0, dtype=dtype, device=device)
    for t in range(L):
        # finished rows re-fold their last key, rows not started yet their first
        pos = torch.maximum(torch.minimum(torch.full_like(lens, t), lens - 1), lo)
        update(kmin, kmax, k[torch.arange(B, device=device), :, pos], pos, ps, kv_start=start)
    bmin, bmax = quest.quest_build_ref(k, lens, ps, kv_start=start)
    n_pages = (lens - lo + ps - 1) // ps
    for b in range(B):
        n = int(n_pages[b])
        assert torch.equal(kmin[b, :, :n], bmin[b, :, :n]) and torch.equal(kmax[b, :, :n], bmax[b, :, :n])


def test_update_folds_into_partial_page(device):
    """A mid-page token folds by min / max; a page-start token resets (both impls)."""
    kmin = torch.zeros(1, 1, 2, 16, device=device)
    kmax = torch.ones(1, 1, 2, 16, device=device)
    new = torch.linspace(-2, 3, 16, device=device).view(1, 1, 16)
    for fn in (quest.quest_update_ref, quest.quest_update_triton):
        a, b = kmin.clone(), kmax.clone()
        fn(a, b, new, torch.tensor([5], device=device), 4)  # page 1, not its first token
        assert torch.equal(a[0, 0, 1], torch.minimum(kmin[0, 0, 1], new[0, 0]))
        assert torch.equal(b[0, 0, 1], torch.maximum(kmax[0, 0, 1], new[0, 0]))
        assert torch.equal(a[0, 0, 0], kmin[0, 0, 0])  # other pages untouched
        fn(a, b, new, torch.tensor([4], device=device), 4)  # page 1's first token
        assert torch.equal(a[0, 0, 1], new[0, 0]) and torch.equal(b[0, 0, 1], new[0, 0])
        # relative pages: position 7 of a row starting at 2 is page 1's 2nd token (8: its 3rd) ...
        start = torch.tensor([2], device=device)
        a, b = kmin.clone(), kmax.clone()
        fn(a, b, new, torch.tensor([7], device=device), 4, kv_start=start)
        assert torch.equal(a[0, 0, 1], torch.minimum(kmin[0, 0, 1], new[0, 0]))
        assert torch.equal(a[0, 0, 0], kmin[0, 0, 0])
        fn(a, b, new, torch.tensor([6], device=device), 4, kv_start=start)  # ... and 6 its first
        assert torch.equal(a[0, 0, 1], new[0, 0]) and torch.equal(b[0, 0, 1], new[0, 0])
        a, b = kmin.clone(), kmax.clone()
        fn(a, b, new, torch.tensor([1], device=device), 4, kv_start=start)  # before the start: ignored
        fn(a, b, new, torch.tensor([12], device=device), 4, kv_start=start)  # past the pages: ignored
        assert torch.equal(a, kmin) and torch.equal(b, kmax)


# ------------------------------------------------------------------------------------------------
# quest_page_scores
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduce,heads,dtype,B,L,D,page_size", _grid(REDUCES, HEADS, DTYPES))
def test_page_scores(reduce, heads, dtype, B, L, D, page_size, device):
    q, k, kv_lens, kv_start = _inputs(B, *heads, L, D, dtype, device, seed=3)
    kmin, kmax = quest.quest_build_ref(k, kv_lens, page_size, kv_start=kv_start)
    _, n_pages = _plan(kv_lens, kv_start, page_size)
    page_lo = torch.minimum(kv_start.cpu() // page_size, n_pages)  # any page range [page_start, n_pages)
    page_lo, n_pages = page_lo.to(device), n_pages.to(device)
    ref = quest.quest_page_scores_ref(q, kmin, kmax, n_pages, reduce=reduce, page_start=page_lo)
    true = _page_scores64(q, kmin, kmax, reduce, page_lo, n_pages)
    assert ref.dtype == torch.float32 and torch.equal(torch.isinf(ref).cpu(), torch.isinf(true))
    torch.testing.assert_close(ref.double().cpu(), true, rtol=1e-5, atol=1e-5)
    out = quest.quest_page_scores_triton(q, kmin, kmax, n_pages, reduce=reduce, page_start=page_lo)
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    fin = torch.isfinite(ref)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out[fin], ref[fin], rtol=rtol, atol=atol)


@pytest.mark.parametrize("block_p,tiles", [(16, 1), (16, 3), (32, 2)])
def test_page_scores_tiled_programs(block_p, tiles, monkeypatch, device):
    """Programs that loop over several page tiles (the GPU configuration) and rows
    whose page count is not a multiple of the tile: same scores as the reference."""
    monkeypatch.setitem(quest.QUEST_CONFIG, "BLOCK_P", block_p)
    monkeypatch.setitem(quest.QUEST_CONFIG, "TILES", tiles)
    page_size = 3
    q, k, kv_lens, kv_start = _inputs(3, 8, 2, 301, 16, torch.bfloat16, device, seed=11)
    kmin, kmax = quest.quest_build_ref(k, kv_lens, page_size, kv_start=kv_start)
    page_lo, n_pages = _plan(kv_lens, kv_start, page_size)
    page_lo, n_pages = page_lo.to(device), n_pages.to(device)
    P = kmin.shape[2]
    assert P > block_p * tiles  # several programs per row
    some_lo = torch.tensor([0, 5, 20], device=device)  # the scores API's page ranges need not start at 0
    ref = quest.quest_page_scores_ref(q, kmin, kmax, n_pages, page_start=some_lo)
    out = quest.quest_page_scores_triton(q, kmin, kmax, n_pages, page_start=some_lo)
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    fin = torch.isfinite(ref)
    rtol, atol = TOL[torch.bfloat16]
    torch.testing.assert_close(out[fin], ref[fin], rtol=rtol, atol=atol)
    # and the selection through the fused plan (ranges derived inside the score kernel)
    true = _page_scores64(q, kmin, kmax, "sum_logits", page_lo.cpu(), n_pages.cpu())
    for impl in IMPLS:
        sel = quest.quest_select_triton(q, kmin, kmax, kv_lens, 9, page_size, kv_start=kv_start, impl=impl)
        _check_selection(sel, true, kv_lens.cpu(), kv_start.cpu(), 9, page_size, atol=1e-2)


@pytest.mark.parametrize("n_sel", [1, 2, 7, 40])
@pytest.mark.parametrize("tied", [False, True])
def test_rowselect_multi_tile_and_ties(n_sel, tied, monkeypatch, device):
    """The one-program-per-row select with tiles much smaller than a row (several
    digit-pass and emission tiles), unaligned kv_start, an empty row, K >= the
    candidates, and heavily tied page scores (duplicated pages): the exact count,
    no duplicates, the best pages (ties broken either way)."""
    monkeypatch.setitem(quest.QUEST_CONFIG, "SEL_BLOCK", 16)
    monkeypatch.setitem(quest.QUEST_CONFIG, "SEL_BLOCK_E", 8)
    page_size = 4
    B, Hq, Hkv, L, D = 3, 4, 2, 150, 16
    q, k, _, _ = _inputs(B, Hq, Hkv, L, D, torch.float32, device, seed=21 + n_sel)
    if tied:  # only 3 distinct pages, repeated: most scores tie exactly
        k = k.view(B, Hkv, L // 2, 2, D)[:, :, :, :1].expand(-1, -1, -1, 2, -1).reshape(B, Hkv, L, D).clone()
        k = k[:, :, torch.arange(L) % 12]
    kv_lens = torch.tensor([150, 9, 101], device=device)
    kv_start = torch.tensor([6, 9, 3], device=device)  # row 1 empty
    kmin, kmax = quest.quest_build_ref(k, kv_lens, page_size, kv_start=kv_start)
    page_lo, n_pages = _plan(kv_lens, kv_start, page_size)
    true = _page_scores64(q, kmin, kmax, "sum_logits", page_lo, n_pages)
    out = quest.quest_select_triton(q, kmin, kmax, kv_lens, n_sel, page_size, kv_start=kv_start, impl="rowselect")
    _check_selection(out, true, kv_lens.cpu(), kv_start.cpu(), n_sel, page_size, atol=1e-4)
    assert (out[1] == -1).all()
    ref = quest.quest_select_triton(q, kmin, kmax, kv_lens, n_sel, page_size, kv_start=kv_start, impl="radix")
    s_out = _check_selection(out, true, kv_lens.cpu(), kv_start.cpu(), n_sel, page_size, atol=1e-4)
    s_ref = _check_selection(ref, true, kv_lens.cpu(), kv_start.cpu(), n_sel, page_size, atol=1e-4)
    torch.testing.assert_close(s_out, s_ref, rtol=1e-6, atol=1e-4)


def test_select_bad_impl_raises():
    q = torch.randn(1, 2, 16)
    kmin = torch.zeros(1, 1, 3, 16)
    with pytest.raises(ValueError, match="impl"):
        quest.quest_select_triton(q, kmin, kmin + 1, torch.tensor([3]), 2, 1, impl="host")


def test_page_scores_default_start_and_scale(device):
    q, k, kv_lens, _ = _inputs(3, 4, 2, 40, 16, torch.float32, device, seed=4)
    kmin, kmax = quest.quest_build_ref(k, kv_lens, 8)
    n_pages = (kv_lens + 7) // 8
    ref = quest.quest_page_scores_ref(q, kmin, kmax, n_pages, scale=0.7)
    out = quest.quest_page_scores_triton(q, kmin, kmax, n_pages, scale=0.7)
    true = _page_scores64(q, kmin, kmax, "sum_logits", torch.zeros(3, dtype=torch.long), n_pages.cpu(), scale=0.7)
    torch.testing.assert_close(ref.double().cpu(), true, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_sum_softmax_is_rejected():
    q = torch.randn(1, 2, 16)
    kmin = torch.zeros(1, 1, 3, 16)
    for fn in (quest.quest_page_scores_ref, quest.quest_page_scores_triton):
        with pytest.raises(ValueError, match="reduce"):
            fn(q, kmin, kmin + 1, torch.tensor([3]), reduce="sum_softmax")


# ------------------------------------------------------------------------------------------------
# quest_select
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduce,heads,dtype,B,L,D,page_size", _grid(REDUCES, HEADS, DTYPES))
def test_select(reduce, heads, dtype, B, L, D, page_size, device):
    q, k, kv_lens, kv_start = _inputs(B, *heads, L, D, dtype, device, seed=5)
    kmin, kmax = quest.quest_build_ref(k, kv_lens, page_size, kv_start=kv_start)
    page_lo, n_pages = _plan(kv_lens, kv_start, page_size)
    true = _page_scores64(q, kmin, kmax, reduce, page_lo, n_pages)
    n_sel = [1, 3, 1000][(REDUCES.index(reduce) + DTYPES.index(dtype)) % 3]  # last page only, some, all
    ref = quest.quest_select_ref(q, kmin, kmax, kv_lens, n_sel, page_size, reduce=reduce, kv_start=kv_start)
    impl = IMPLS[(B + L + DTYPES.index(dtype)) % len(IMPLS)]  # every implementation over the grid
    out = quest.quest_select_triton(q, kmin, kmax, kv_lens, n_sel, page_size, reduce=reduce, kv_start=kv_start,
                                    impl=impl)
    s_ref = _check_selection(ref, true, kv_lens.cpu(), kv_start.cpu(), n_sel, page_size, atol=1e-5)
    s_out = _check_selection(out, true, kv_lens.cpu(), kv_start.cpu(), n_sel, page_size, atol=1e-4)
    torch.testing.assert_close(s_out, s_ref, rtol=1e-5, atol=1e-4)
    if n_sel == 1000:  # more pages than exist: exactly the valid tokens
        for b in range(B):
            want = set(range(int(kv_start[b]), int(kv_lens[b])))
            for h in range(heads[1]):
                got = out[b, h].cpu()
                assert set(got[got >= 0].tolist()) == want


@pytest.mark.parametrize("paged", [False, True])
def test_select_ref_reads_no_page_past_the_rows(paged, monkeypatch):
    """The torch reference (the CPU's Quest select) scores the pages up to the rows' last
    only (bounds sized for the cache's whole length: here 3x the longest row), and selects
    exactly what scoring every page gives, for every number of pages selected."""
    B, Hq, Hkv, D, L, S = 3, 4, 2, 16, 90, 4
    q, k, _, kv_start = _inputs(B, Hq, Hkv, L, D, torch.float32, "cpu", seed=31)
    kv_lens = torch.tensor([29, 17, 30])
    k = torch.nan_to_num(k)
    if paged:
        kv_start = torch.zeros_like(kv_start)  # (pool pages start at the rows' block boundaries)
    kmin, kmax = quest.quest_build_ref(k, kv_lens, S, kv_start=kv_start)  # [B, Hkv, 23, D]
    kw = dict(reduce="sum_logits", kv_start=kv_start)
    if paged:  # pool bounds: one page per block (block_size = page_size), the rows' blocks shuffled
        nb = kmin.shape[2]
        perm = torch.randperm(B * nb, generator=torch.Generator().manual_seed(1))
        table = perm.view(B, nb).to(torch.int32)
        kmin, kmax = [torch.empty(B * nb, Hkv, 1, D).index_copy_(0, perm, x.transpose(1, 2).reshape(B * nb, Hkv, 1, D))
                      for x in (kmin, kmax)]
        kw.update(block_table=table, block_size=S)
    reads = []
    scores = quest.quest_page_scores_ref
    monkeypatch.setattr(quest, "quest_page_scores_ref", lambda q, lo, hi, *a, **k: reads.append(lo.shape[2])
                        or scores(q, lo, hi, *a, **k))
    cut = quest.cut_logical
    want_pages = int(((kv_lens - kv_start + S - 1) // S).max())
    for n_sel in (1, 3, 6, 100):
        reads.clear()
        got = quest.quest_select_ref(q, kmin, kmax, kv_lens, n_sel, S, **kw)
        assert reads == [want_pages]
        monkeypatch.setattr(quest, "cut_logical", lambda end, L, bt, bs, *xs: (L, bt, *xs))
        want = quest.quest_select_ref(q, kmin, kmax, kv_lens, n_sel, S, **kw)
        monkeypatch.setattr(quest, "cut_logical", cut)
        assert reads[-1] > want_pages
        assert torch.equal(got, want)


def test_select_dispatch_and_empty_row(monkeypatch, device):
    """Through the public entry point (forced Triton), with an empty row (kv_lens == kv_start)."""
    monkeypatch.setenv("SPADE_KERNELS", "triton")
    q, k, _, _ = _inputs(2, 4, 2, 40, 16, torch.float32, device, seed=6)
    kv_lens = torch.tensor([40, 6], device=device)
    kv_start = torch.tensor([0, 6], device=device)
    kmin, kmax = kernels.quest_build(k, kv_lens, 8, kv_start=kv_start)
    idx = kernels.quest_select(q, kmin, kmax, kv_lens, 2, 8, kv_start=kv_start)
    assert idx.shape == (2, 2, 16)
    assert (idx[1] == -1).all()
    page_lo, n_pages = _plan(kv_lens, kv_start, 8)
    true = _page_scores64(q, kmin, kmax, "sum_logits", page_lo, n_pages)
    _check_selection(idx, true, kv_lens.cpu(), kv_start.cpu(), 2, 8, atol=1e-4)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(B=st.integers(1, 2), Hkv=st.sampled_from([1, 2]), G=st.sampled_from([1, 2, 3]), L=st.integers(1, 60),
       D=st.sampled_from([8, 16, 32]), page_size=st.integers(1, 9), n_sel=st.integers(1, 12),
       reduce=st.sampled_from(REDUCES), seed=st.integers(0, 2**16))
def test_select_fuzz(B, Hkv, G, L, D, page_size, n_sel, reduce, seed, device):
    q, k, kv_lens, kv_start = _inputs(B, G * Hkv, Hkv, L, D, torch.float32, device, seed=seed)
    kmin, kmax = quest.quest_build_triton(k, kv_lens, page_size, kv_start=kv_start)
    page_lo, n_pages = _plan(kv_lens, kv_start, page_size)
    true = _page_scores64(q, kmin, kmax, reduce, page_lo, n_pages)
    out = quest.quest_select_triton(q, kmin, kmax, kv_lens, n_sel, page_size, reduce=reduce, kv_start=kv_start,
                                    impl=IMPLS[seed % len(IMPLS)])
    _check_selection(out, true, kv_lens.cpu(), kv_start.cpu(), n_sel, page_size, atol=1e-4)


def _shift(idx, start):
    """Token indices as positions relative to each row's start (``-1`` stays)."""
    return torch.where(idx >= 0, idx - start.view(-1, 1, 1).to(idx.dtype), torch.full_like(idx, -1))


def _as_sets(idx):
    return [[set(r[r >= 0].tolist()) for r in row] for row in idx.cpu()]


@pytest.mark.parametrize("heads,page_size,n_sel,dtype", [
    ((4, 1), 4, 3, torch.float32), ((4, 2), 5, 2, torch.float32), ((4, 4), 3, 40, torch.float32),
    ((6, 2), 4, 4, torch.bfloat16)])
def test_select_shift_invariant(heads, page_size, n_sel, dtype, device):
    """Random kv_start per row (an empty row and a 1-token row among them): the bounds and
    selections of every implementation, as positions minus kv_start, equal those of the
    same windows moved to start at 0 (pages are relative to kv_start); and the Triton
    selects equal the reference (fp32: the same token sets)."""
    Hq, Hkv = heads
    D, L = 16, 80
    g = torch.Generator().manual_seed(41 + page_size + n_sel)
    n = torch.tensor([0, 1, 23, 37, 45, 62])  # valid tokens per row
    B = len(n)
    start = torch.stack([torch.randint(0, L - int(x) + 1, (1,), generator=g)[0] for x in n])
    window = torch.randn(B, Hkv, int(n.max()), D, generator=g).to(dtype)
    k = torch.full((B, Hkv, L, D), float("nan"), dtype=dtype)  # NaN outside the windows: never read
    k0 = k.clone()
    for b in range(B):
        k[b, :, int(start[b]):int(start[b] + n[b])] = window[b, :, :int(n[b])]
        k0[b, :, :int(n[b])] = window[b, :, :int(n[b])]
    q = torch.randn(B, Hq, D, generator=g).to(dtype).to(device)
    k, k0, start, n = k.to(device), k0.to(device), start.to(device), n.to(device)
    kv_lens = start + n
    kmin, kmax = quest.quest_build_ref(k, kv_lens, page_size, kv_start=start)
    kmin0, kmax0 = quest.quest_build_ref(k0, n, page_size)
    assert torch.equal(kmin, kmin0) and torch.equal(kmax, kmax0)  # the same pages, wherever they start
    tmin, tmax = quest.quest_build_triton(k, kv_lens, page_size, kv_start=start)
    assert torch.equal(tmin, kmin) and torch.equal(tmax, kmax)
    ref = quest.quest_select_ref(q, kmin, kmax, kv_lens, n_sel, page_size, kv_start=start)
    ref0 = quest.quest_select_ref(q, kmin0, kmax0, n, n_sel, page_size)
    assert torch.equal(_shift(ref, start), ref0)
    assert (ref[0] == -1).all() and _as_sets(ref)[1] == [{int(start[1])}] * Hkv  # empty row; 1 token: itself
    page_lo, n_pages = _plan(kv_lens, start, page_size)
    true = _page_scores64(q, kmin, kmax, "sum_logits", page_lo, n_pages)
    _check_selection(ref, true, kv_lens.cpu(), start.cpu(), n_sel, page_size, atol=1e-5)
    for impl in IMPLS:
        out = quest.quest_select_triton(q, kmin, kmax, kv_lens, n_sel, page_size, kv_start=start, impl=impl)
        out0 = quest.quest_select_triton(q, kmin0, kmax0, n, n_sel, page_size, impl=impl)
        assert torch.equal(_shift(out, start), out0), impl
        if dtype == torch.float32:
            assert _as_sets(out) == _as_sets(ref), impl
        else:
            _check_selection(out, true, kv_lens.cpu(), start.cpu(), n_sel, page_size, atol=1e-2)


# ------------------------------------------------------------------------------------------------
# sm_90 build (no GPU needed: the interpreter accepts code the compiler rejects)
# ------------------------------------------------------------------------------------------------

_AOT_SCRIPT = r'''
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from spade.kernels import quest as Q

P, HKV, G, D = 2048, 8, 4, 128
out = {}
for from_lens, paged in ((True, False), (False, False), (True, True)):
    sig = dict(q_ptr="*bf16", kmin_ptr="*bf16", kmax_ptr="*bf16", out_ptr="*fp32", lo_ptr="*i32", hi_ptr="*i32",
               plan_ptr="*i32", stride_qb="i32", stride_qh="i32", stride_qd="constexpr", stride_mb="i32",
               stride_mh="i32", stride_mp="i32", stride_md="constexpr", P="i32", B="i32", CHUNK="i32",
               page_size="i32", scale="fp32", BT="*i32" if paged else "constexpr",
               stride_tb="i32" if paged else "constexpr")
    cons = dict(stride_qd=1, stride_md=1, HKV=HKV, G=G, G_PAD=16, D=D, BLOCK_D=D, BLOCK_P=64, REDUCE=0,
                HAS_LO=True, FROM_LENS=from_lens, UPCAST=False, IEEE=False, INTERPRET=False, PDL=from_lens,
                PAGED=paged, BLOCK_SIZE=16 if paged else 1)
    if not paged:
        cons.update(BT=None, stride_tb=0)
    for n in cons:
        sig[n] = "constexpr"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(Q._quest_scores_kernel.arg_names)
             if sig[n].startswith("*") or n in ("stride_qb", "stride_mb", "stride_mh", "stride_mp", "P", "CHUNK",
                                                "stride_tb")}
    k = triton.compile(ASTSource(Q._quest_scores_kernel, sig, cons, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, num_stages=3))
    ttgir = k.asm["ttgir"]
    out[str(from_lens) + ("_paged" if paged else "")] = dict(
        pipelined="async_copy_global_to_local" in ttgir, shared=k.metadata.shared)
for has_start in (True, False):
    sig = dict(scores_ptr="*fp32", out_ptr="*i32", pages_ptr="*i32", start_ptr="*i32", kv_ptr="*i32", P="i32",
               page_size="i32",
               n_sel="i32", n_out="i32")
    cons = dict(HKV=HKV, BLOCK=2048, BLOCK_E=128, PS_PAD=16, HAS_START=has_start, INTERPRET=False, PDL=has_start)
    for n in cons:
        sig[n] = "constexpr"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(Q._quest_row_select_kernel.arg_names)
             if sig[n].startswith("*") or n in ("P", "page_size", "n_out")}
    k = triton.compile(ASTSource(Q._quest_row_select_kernel, sig, cons, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=8, num_stages=3))
    out[f"rowselect_{has_start}"] = dict(pipelined=True, shared=k.metadata.shared)  # builds; nothing to pipeline
print(json.dumps(out))
'''


_AOT_RELATIVE = r'''
import json
from spade.kernels import quest as Q
from tests.kernels.aot import sm90_compile

P = ("ptr", "i32")
out = {}
for paged in (False, True):  # build: pages from each row's start (lo_ptr), contiguous or through the table
    args = dict(k_ptr=("ptr", "bf16"), kmin_ptr=("ptr", "bf16"), kmax_ptr=("ptr", "bf16"), lo_ptr=P, hi_ptr=P,
                stride_kb=1 << 20, stride_kh=1 << 16, stride_kl=128, stride_kd=1, L=4096, P=256, page_size=16)
    cons = dict(HKV=8, D=128, BLOCK_D=128, BLOCK_P=4, BLOCK_S=16, PAGED=paged)
    if paged:
        args.update(BT=P)
        cons.update(stride_tb=256, BLOCK_SIZE=16)
    sm90_compile(Q._quest_build_kernel, args, cons)
    out[f"build_{paged}"] = True
for has_start in (False, True):  # update: the page of pos - start; expand: start + page * S + j
    sm90_compile(Q._quest_update_kernel, dict(
        kmin_ptr=("ptr", "bf16"), kmax_ptr=("ptr", "bf16"), knew_ptr=("ptr", "bf16"), pos_ptr=("ptr", "i64"),
        start_ptr=P, stride_mb=1 << 18, stride_mh=1 << 15, stride_mp=128, stride_md=1, stride_nb=1024,
        stride_nh=128, stride_nd=1, P=256, page_size=16), dict(HKV=8, D=128, BLOCK_D=128, HAS_START=has_start),
        num_warps=1)
    sm90_compile(Q._quest_expand_kernel, dict(sel_ptr=P, out_ptr=P, start_ptr=P, kv_ptr=P, page_size=16, n_sel=64,
                                               n_out=1024), dict(HKV=8, BLOCK=1024, HAS_START=has_start))
    out[f"update_expand_{has_start}"] = True
print(json.dumps(out))
'''


def test_build_update_expand_kernels_build_for_hopper():
    """The relative-page build (contiguous and paged), update and expansion kernels
    compile for sm_90, with and without a per-row start."""
    res = run_aot_script(_AOT_RELATIVE)
    assert res == {"build_False": True, "build_True": True, "update_expand_False": True,
                   "update_expand_True": True}


def test_scores_kernel_builds_for_hopper():
    """The page-score kernel compiles for sm_90 and its metadata loads are
    software-pipelined across the tiles a program loops over (cp.async), also when
    it reads pool bounds through a block table (the table entries one more stage of
    the pipeline); the row-select kernel compiles with the GPU tile sizes."""
    res = run_aot_script(_AOT_SCRIPT)
    assert {"True", "False", "True_paged", "rowselect_True", "rowselect_False"} <= set(res)
    for name, r in res.items():
        assert r["pipelined"], (name, r)
        assert r["shared"] < 227 * 1024 // 2, (name, r)

"""Threshold-carry top-K (``score_topk(..., carry=)``): every call an exact top-K.

The carry changes only how the Triton path finds the top-K (candidates above the
previous call's threshold, selected in registers; the whole row when their count is
off), never what it finds. So each call of a sequence is checked against float64
scores as in test_scoring (``_check_topk``), and the carry's counters are checked to
show which path ran: the first call of a row falls back, calls that score alike take
the candidate path, a call whose scores jump (too many or too few candidates) falls
back again and still selects exactly.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from spade import kernels
from spade.kernels import overlap, quant, radix_topk, scoring
from spade.kernels.carry import carry_sizes, carry_stats, carry_threshold, new_carry, reset_carry
from spade.kernels.common import _interpret
from tests.kernels.test_scoring import REDUCES, _bounds, _check_topk, _inputs, _norm, _quant_keys, _scores64

HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA


@pytest.fixture(autouse=True)
def _default_configs():
    yield
    radix_topk.SELECT_CONFIG.clear()
    scoring.GEMV_CONFIG.clear()


@pytest.fixture(params=["mark", "compact"])
def store(request):
    """The scoring's store under the carry: whole rows, or only the candidates' scores
    (``SELECT_CONFIG["carry_compact"]``; ``scoring.carry_store``). Cleared by
    ``_default_configs``."""
    if request.param == "compact":
        radix_topk.SELECT_CONFIG["carry_compact"] = True
    return request.param


def _fallbacks(carry):
    return carry[..., 2].cpu()


def _run(q, k, lo, hi, k_top, reduce, kv_lens, carry, **kw):
    norm_lens = kv_lens if reduce == "sum_softmax" else None
    out = scoring.score_topk_triton(q, k, lo, hi, k_top, reduce=reduce, kv_lens=norm_lens, carry=carry, **kw)
    return out, norm_lens


@pytest.mark.parametrize("reduce,heads,shape", [
    (r, h, s) for (r, h), s in zip(itertools.product(REDUCES, HEADS),
                                    itertools.cycle([(2, 301, 16), (1, 257, 32), (3, 130, 16)]))])
def test_carry_sequence_is_exact_and_takes_the_candidate_path(reduce, heads, shape, device, store):
    """A drifting query over one cache: every call an exact top-K; only the first call
    of each row falls back; the counters count every call."""
    B, L, D = shape
    q0, k, kv_lens, kv_start = _inputs(B, *heads, L, D, torch.float32, device, seed=3)
    lo, hi = _bounds(kv_lens, kv_start, 2, 3)
    k_top = 17
    carry = new_carry(B, heads[1], device)
    g = torch.Generator().manual_seed(5)
    for step in range(5):
        q = q0 + 0.03 * step * torch.randn(q0.shape, generator=g).to(device)
        out, norm_lens = _run(q, k, lo, hi, k_top, reduce, kv_lens, carry)
        true = _scores64(q, k, reduce, *_norm(reduce, lo.cpu(), hi.cpu(),
                                              None if norm_lens is None else kv_lens.cpu()))
        _check_topk(out, true, lo.cpu(), hi.cpu(), k_top, atol=1e-5)
        assert (carry[..., 1] == 0).all(), "the candidate counter is reset for the next call"
        assert (carry[..., 3].cpu() == step + 1).all()
    assert (_fallbacks(carry) == 1).all(), _fallbacks(carry)  # the first call only
    stats = carry_stats(carry)
    assert stats["calls"] == 5 * B * heads[1] and stats["fallbacks"] == B * heads[1]


@pytest.mark.parametrize("jump", [8.0, 0.125])
def test_carry_follows_the_query_norm(jump, device, store):
    """Scaling the query by 8 or 1/8 scales every score and the K-th with it: the
    threshold is carried per unit of query norm, so the call stays on the candidate
    path (with a fixed threshold it would have had far too many or too few
    candidates) and is exact."""
    B, L, D = 2, 400, 16
    q, k, kv_lens, kv_start = _inputs(B, 4, 2, L, D, torch.float32, device, seed=9)
    lo, hi = _bounds(kv_lens, kv_start, 1, 1)
    k_top = 12
    carry = new_carry(B, 2, device)
    for qi in (q, q * 1.001, q * jump, q * jump * 1.001):
        out, _ = _run(qi, k, lo, hi, k_top, "sum_logits", None, carry)
        _check_topk(out, _scores64(qi, k, "sum_logits", lo.cpu(), hi.cpu()), lo.cpu(), hi.cpu(), k_top, atol=1e-5)
    assert (_fallbacks(carry) == 1).all(), _fallbacks(carry)


def _aniso_keys(B, L, D, device, seed):
    """Keys whose channel 0 varies 100x more than channel 1: a query along channel 0
    spreads the scores wide, one along channel 1 (same norm) packs them near zero."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, 2, L, D, generator=g) * 0.01
    k[..., 0] *= 300.0
    k[..., 1] *= 3.0
    return k.to(device)


@pytest.mark.parametrize("first,then,many", [(0, 1, False), (1, 0, True)])
def test_carry_falls_back_when_the_scores_jump(first, then, many, device, store):
    """A query turned from a wide-scoring direction to a narrow one (every score below
    the carried threshold: fewer candidates than K) or back (more candidates than the
    list holds): the row falls back to the gated radix passes, is exact, counts the
    kind of fallback, and the next call is back on the candidate path."""
    B, L, D, k_top = 2, 400, 16, 12
    k = _aniso_keys(B, L, D, device, seed=2)
    lo = torch.tensor([1, 0], device=device)
    hi = torch.tensor([L - 1, L - 7], device=device)
    q = torch.zeros(B, 4, D, device=device)
    carry = new_carry(B, 2, device)
    for step, ch in enumerate((first, first, then, then)):
        qi = q.clone()
        qi[..., ch] = 1.0 + 0.001 * step
        out = scoring.score_topk_triton(qi, k, lo, hi, k_top, carry=carry)
        _check_topk(out, _scores64(qi, k, "sum_logits", lo.cpu(), hi.cpu()), lo.cpu(), hi.cpu(), k_top, atol=1e-5)
        assert (_fallbacks(carry) == (1 if step < 2 else 2)).all(), (step, _fallbacks(carry))
    assert carry_stats(carry)["fallbacks_too_many"] == (2 * B if many else 0)


def test_carry_fallback_in_some_rows_only(device, store):
    """One row's query turns to a narrow-scoring direction (its carried threshold admits
    too few keys), the others' do not: the gated radix passes select that row alone,
    and every row is exact (the others' candidate-path output is left as it is)."""
    B, L, D, k_top = 3, 1500, 16, 40
    k = _aniso_keys(B, L, D, device, seed=21)
    lo = torch.tensor([0, 3, 10], device=device)
    hi = torch.tensor([L, L - 5, 1200], device=device)
    carry = new_carry(B, 2, device)
    for step in range(3):
        qi = torch.zeros(B, 4, D, device=device)
        qi[..., 0] = 1.0 + 0.001 * step
        if step == 2:
            qi[1] = 0.0
            qi[1, :, 1] = 1.0
        out = scoring.score_topk_triton(qi, k, lo, hi, k_top, carry=carry)
        _check_topk(out, _scores64(qi, k, "sum_logits", lo.cpu(), hi.cpu()), lo.cpu(), hi.cpu(), k_top, atol=1e-5)
    fb = _fallbacks(carry)
    assert (fb[1] == 2).all() and (fb[[0, 2]] == 1).all(), fb


def test_carry_on_long_rows_tracks_a_drifting_norm(device, store):
    """Long rows (K a small fraction of L: the K-th score deep in the tail, where a
    fixed threshold's candidate count swings fastest with the scores' scale): a
    query whose norm drifts by several percent per call, and turns a little, stays
    on the candidate path after the first call, and every call is exact. The
    fallback's threshold lets between K and the list's capacity through. K/L is
    0.27% (16 of 6000, as 64 of 24000 before, at a quarter of the interpreter time);
    with the threshold carried unscaled by the norm every call falls back here."""
    B, L, D, k_top = 1, 6000, 16, 16
    q0, k, kv_lens, kv_start = _inputs(B, 4, 2, L, D, torch.float32, device, seed=5)
    lo, hi = _bounds(kv_lens, kv_start, 4, 16)
    k_next, cap = carry_sizes(k_top)
    carry = new_carry(B, 2, device)
    g = torch.Generator().manual_seed(8)
    for step in range(6):
        q = (q0 + 0.01 * step * torch.randn(q0.shape, generator=g).to(device)) * (1.0 + 0.06 * (-1) ** step)
        out = scoring.score_topk_triton(q, k, lo, hi, k_top, carry=carry)
        true = _scores64(q, k, "sum_logits", lo.cpu(), hi.cpu())
        _check_topk(out, true, lo.cpu(), hi.cpu(), k_top, atol=1e-4)
        if step == 0:  # the fallback's next threshold, in this call's score units
            passed = (true >= carry_threshold(carry).cpu().double()[..., None]).sum(-1)
            assert ((passed >= k_next) & (passed <= cap)).all(), (passed, k_next, cap)
    assert (_fallbacks(carry) == 1).all(), _fallbacks(carry)


@pytest.mark.parametrize("case", ["one", "all", "equal", "empty"])
def test_carry_edge_cases(case, device, store):
    """K=1; K >= the candidates (all of them in position order, -1 padding, no select and
    no fallback); empty rows (all -1, no fallback); the range exactly K long (all of
    them, no fallback); into ``out``."""
    B, L, D = 3, 61, 16
    q, k, kv_lens, kv_start = _inputs(B, 4, 2, L, D, torch.float32, device, seed=4)
    lo, hi = _bounds(kv_lens, kv_start, 1, 1)
    if case == "empty":
        hi[1] = lo[1]
    n_valid = (hi - lo).cpu()
    k_top = {"one": 1, "all": L + 3, "equal": int(n_valid.min()), "empty": 7}[case]
    carry = new_carry(B, 2, device)
    true = _scores64(q, k, "sum_logits", lo.cpu(), hi.cpu())
    for step in range(3):
        buf = torch.full((B, 2, k_top), 99, dtype=torch.int32, device=device)
        out = scoring.score_topk_triton(q, k, lo, hi, k_top, carry=carry, out=buf)
        assert out is buf
        _check_topk(out, true, lo.cpu(), hi.cpu(), k_top, atol=1e-5)
        if case in ("all", "equal"):  # every valid key, in position order, then -1
            for b in range(B):
                n = int(n_valid[b])
                want = torch.cat([torch.arange(int(lo[b]), int(lo[b]) + min(n, k_top)),
                                  torch.full((max(0, k_top - n),), -1)]).to(torch.int32)
                if n <= k_top:
                    assert torch.equal(out[b].cpu(), want.expand(2, k_top)), (b, out[b])
    fb = _fallbacks(carry)
    assert (carry[..., 3].cpu() == 3).all()  # every call counted
    if case == "one":
        assert (fb == 1).all()
    if case == "all":
        assert (fb == 0).all()  # fewer valid keys than K: all of them, no fallback
    if case == "equal":  # the shortest row holds exactly K keys: no fallback
        assert (fb[n_valid <= k_top] == 0).all(), fb
    if case == "empty":
        assert (fb == torch.tensor([1, 0, 1])[:, None]).all(), fb  # row 1 has no key: -1s, no fallback


@pytest.mark.parametrize("keys,reduce", [("int8", "sum_logits"), ("int4", "sum_logits"), ("int8", "max_logits"),
                                         ("int4", "sum_softmax"), ("gemv", "sum_logits")])
def test_carry_on_every_scoring_kernel(keys, reduce, device, store):
    """The compaction lives in the store of every scoring kernel: the int8 / int4
    tensor-core GEMV (sum_logits), the float tile kernel (max_logits, int8 keys), the
    softmax finalize kernel and the float GEMV (``GEMV_CONFIG['use'] = 'all'``). Each
    call ranks exactly what the same kernel's scores rank (``group_scores``)."""
    B, L, D = 2, 333, 32
    q, k, kv_lens, kv_start = _inputs(B, 4, 2, L, D, torch.bfloat16, device, seed=11)
    if keys == "gemv":
        scoring.GEMV_CONFIG["use"] = "all"
    q, k, kw = _quant_keys(q, k, keys, device, q_dtype=torch.bfloat16)
    lo, hi = _bounds(kv_lens, kv_start, 2, 2)
    carry = new_carry(B, 2, device)
    k_top = 23
    for step in range(3):
        qs = (q.float() * (1 + 0.01 * step)).to(q.dtype)
        out, norm_lens = _run(qs, k, lo, hi, k_top, reduce, kv_lens, carry, **kw)
        n_lo, n_hi = _norm(reduce, lo, hi, norm_lens)
        true = scoring.group_scores_triton(qs, k, n_hi, reduce=reduce, kv_start=n_lo, **kw).double().cpu()
        _check_topk(out, true, lo.cpu(), hi.cpu(), k_top, atol=1e-6)
    assert (_fallbacks(carry) == 1).all()


@pytest.mark.parametrize("keys,reduce", [("int8", "sum_logits"), ("int4", "sum_logits"), ("exact", "max_logits")])
def test_compacted_store_and_gated_rescore(keys, reduce, device):
    """The scoring side of the threshold carry, store by store. ``CARRY_COMPACT``: each
    row's candidates (valid scores at or above its threshold) are marked in its bitmask,
    and their scores sit at the front of their ``CARRY_SEG``-position segment in position
    order, nothing else written. ``CARRY_RESCORE``: the whole ``[lo, hi)`` of only the rows
    whose fallback flag is set. (A launch whose tiles are not whole segments, the float tile
    on a GPU, stores whole rows: ``carry_store`` says which. The compacted store is off
    unless ``SELECT_CONFIG["carry_compact"]`` is set.)"""
    import triton

    from spade.kernels.carry import CARRY_COMPACT, CARRY_MARK, CARRY_RESCORE, CARRY_SEG

    B, Hkv, L, D = 3, 2, 700, 32
    q, k, kv_lens, kv_start = _inputs(B, 4, Hkv, L, D, torch.float32, device, seed=17)
    assert scoring.carry_store(q, k, reduce) == CARRY_MARK  # off by default
    radix_topk.SELECT_CONFIG["carry_compact"] = True
    q, k, kw = _quant_keys(q, k, keys, device)
    lo, hi = _bounds(kv_lens, kv_start, 3, 5)
    dense = scoring.group_scores_triton(q, k, hi, reduce=reduce, kv_start=lo, **kw).reshape(B * Hkv, L).cpu()
    thr = torch.stack([r[r > float("-inf")].quantile(0.85) for r in dense])  # ~15% candidates per row
    carry = new_carry(B, Hkv, device)
    carry.view(-1, 8)[:, 0] = thr.to(device).view(torch.int32)
    nw = triton.cdiv(L + 2048, 32)
    mode = scoring.carry_store(q, k, reduce)
    assert mode == (CARRY_COMPACT if _interpret() or keys != "exact" else CARRY_MARK)

    def launch(m):
        out = torch.full((B * Hkv, L), float("nan"), device=device)
        mask = torch.zeros(B * Hkv, nw, dtype=torch.int32, device=device)
        scoring._launch_scores(q, k, out.view(B, Hkv, L), lo, hi, lo, hi, scale=D ** -0.5, reduce=reduce,
                               full_row=False, hist=None, carry=(carry, mask, nw, m), **kw)
        return out.cpu(), mask.cpu()

    out, mask = launch(mode)
    bits = ((mask[:, :, None] >> torch.arange(32)) & 1).reshape(B * Hkv, -1)[:, :L].bool()
    for row in range(B * Hkv):
        b = row // Hkv
        pos = torch.arange(L)
        cand = (pos >= lo[b].item()) & (pos < hi[b].item()) & (dense[row] >= thr[row])
        assert torch.equal(bits[row], cand), row
        if mode == CARRY_MARK:
            assert torch.equal(out[row, cand], dense[row, cand])
            continue
        for s0 in range(0, L, CARRY_SEG):
            c = cand[s0:s0 + CARRY_SEG].nonzero().flatten() + s0
            seg = out[row, s0:s0 + CARRY_SEG]
            assert torch.equal(seg[:len(c)], dense[row, c]), (row, s0)
            assert seg[len(c):].isnan().all(), (row, s0)  # nothing else written
    carry.view(-1, 8)[:, 5] = torch.tensor([0, 1, 0, 0, 1, 0], dtype=torch.int32, device=device)  # fallback flags
    out, mask = launch(CARRY_RESCORE)
    for row in range(B * Hkv):
        b = row // Hkv
        if row in (1, 4):
            assert torch.equal(out[row, lo[b]:hi[b]], dense[row, lo[b]:hi[b]]), row
            assert out[row, :lo[b]].isnan().all() and out[row, hi[b]:].isnan().all()
        else:
            assert out[row].isnan().all(), row
    assert (mask == 0).all()  # the re-score marks nothing


def test_carry_ties(device, store):
    """All keys equal (every score tied): K of them, no duplicates, -1 nowhere."""
    B, L, D = 2, 90, 16
    q = torch.randn(B, 4, D, device=device)
    k = torch.ones(B, 2, L, D, device=device)
    lo = torch.tensor([3, 0], device=device)
    hi = torch.tensor([80, 90], device=device)
    carry = new_carry(B, 2, device)
    true = _scores64(q, k, "sum_logits", lo.cpu(), hi.cpu())
    for _ in range(3):
        _check_topk(scoring.score_topk_triton(q, k, lo, hi, 10, carry=carry), true, lo.cpu(), hi.cpu(), 10,
                    atol=1e-5)


def test_carry_state_is_checked_and_reset(device):
    q, k, kv_lens, kv_start = _inputs(2, 4, 2, 40, 16, torch.float32, device, seed=2)
    lo, hi = _bounds(kv_lens, kv_start, 1, 1)
    for bad in (torch.zeros(2, 2, 3, dtype=torch.int32, device=device),
                torch.zeros(2, 2, 8, dtype=torch.int64, device=device),
                torch.zeros(2, 8, 2, dtype=torch.int32, device=device).transpose(1, 2)):
        for fn in (scoring.score_topk_ref, scoring.score_topk_triton):
            with pytest.raises(ValueError, match=r"carry must be .*\[2, 2, 8\]"):
                fn(q, k, lo, hi, 5, carry=bad)
    carry = new_carry(2, 2, device)
    assert torch.isinf(carry_threshold(carry)).all()
    kernels.score_topk(q, k, lo, hi, 5, carry=carry)  # the public op passes it on (ref: left as it is)
    scoring.score_topk_triton(q, k, lo, hi, 5, carry=carry)
    assert torch.isfinite(carry_threshold(carry)).all()
    before = carry.clone()
    reset_carry(carry[1], stats=False)  # one row (a request joining a serving batch): the other keeps its threshold
    assert torch.equal(carry[0], before[0]) and torch.isinf(carry_threshold(carry)[1]).all()
    fresh = new_carry(2, 2, device)
    stats = [2, 3, 7]  # fallbacks, calls, too-many fallbacks: the epoch's account goes on
    keep = [i for i in range(fresh.shape[-1]) if i not in stats]
    assert torch.equal(carry[1][..., keep], fresh[1][..., keep]) and torch.equal(carry[..., stats], before[..., stats])
    assert carry_stats(carry)["calls"] >= 2 * 2  # (at least the Triton call's 2 x 2 rows) kept
    reset_carry(carry)  # a new generation: the counters restart too
    assert torch.equal(carry, fresh)
    with pytest.raises(ValueError, match="carry_margin"):
        radix_topk.SELECT_CONFIG["carry_margin"] = 1.0
        carry_sizes(10)


def test_carry_sizes():
    assert carry_sizes(1980) == (2970, 4096)
    assert carry_sizes(1) == (2, 4)
    k_next, cap = carry_sizes(100)
    assert k_next == 150 and cap == 256
    assert carry_sizes(2048, 2.0) == (4096, 8192)  # a caller's own margin
    for bad in (1.0, 0.5, float("nan")):
        with pytest.raises(ValueError, match="carry margin must be > 1"):
            carry_sizes(100, bad)


def test_carry_sizes_wide_margin_stays_in_registers():
    """A wider margin (selecting every few steps) is narrowed to a list of at most
    CARRY_CAP_MAX where the default margin's list fits in it, never below the default
    margin; where even the default does not fit, the margin asked for is kept."""
    from spade.kernels.carry import CARRY_CAP_MAX, CARRY_MARGIN

    assert carry_sizes(1980, 2.0) == (3960, 8192)  # fits as asked
    k_next, cap = carry_sizes(3960, 2.0)  # rerank 2 x 1980 candidates, refresh_every > 1
    assert cap == CARRY_CAP_MAX and math.ceil(CARRY_MARGIN * 3960) <= k_next < 2 * 3960
    assert math.ceil(1.25 * k_next) <= cap
    assert carry_sizes(3960) == (math.ceil(CARRY_MARGIN * 3960), 8192)  # the default margin: unchanged
    for k_top in (1, 100, 3000, 4368, 4369, 5000, 8738, 8739, 12000, 20000):
        for margin in (1.1, 1.5, 2.0, 3.0):
            k_next, cap = carry_sizes(k_top, margin)
            assert k_top < k_next and math.ceil(1.25 * k_next) <= cap and cap & (cap - 1) == 0
            want = max(k_top + 1, math.ceil(margin * k_top))
            if k_next != want:  # narrowed: only a margin above the default, into CARRY_CAP_MAX
                assert margin > CARRY_MARGIN and cap == CARRY_CAP_MAX
                assert k_next >= math.ceil(CARRY_MARGIN * k_top)


def test_carry_fits_marks_the_wide_lists():
    """``carry_fits``: the default margin's list stays within CARRY_CAP_MAX up to k_top = 4368
    (K_mid = 1980 alone or x rerank 2) and passes it from 4369 (rerank 4 or 8 x 1980, or a
    budget past ~4.3k), which take the radix passes."""
    from spade.kernels.carry import CARRY_CAP_MAX, carry_fits

    assert CARRY_CAP_MAX == 8192
    assert carry_fits(1980) and carry_fits(2 * 1980) and carry_fits(4368)
    assert not carry_fits(4369) and not carry_fits(4 * 1980) and not carry_fits(8 * 1980) and not carry_fits(16384)
    assert carry_fits(1980, 2.0) and carry_fits(3960, 2.0)  # a wider margin narrowed into the cap (test above)


def test_wide_selection_takes_the_radix_passes(device, monkeypatch):
    """A ``k_top`` whose carry list would spill (``carry_fits`` False; the cap lowered here
    so the interpreter's rows are short) takes the radix passes: the exact top-K, the carry
    untouched (no call counted, no threshold); a k_top that fits still takes the carry."""
    from spade.kernels import carry as C

    monkeypatch.setattr(C, "CARRY_CAP_MAX", 64)
    B, L, D = 2, 301, 16
    q, k, kv_lens, kv_start = _inputs(B, 4, 2, L, D, torch.float32, device, seed=21)
    lo, hi = _bounds(kv_lens, kv_start, 2, 3)
    true = _scores64(q, k, "sum_logits", lo.cpu(), hi.cpu())
    carry = new_carry(B, 2, device)
    fresh = carry.clone()
    for k_top in (60, 45):  # lists of 128 > 64 (radix), then 128 again: neither fits
        assert not C.carry_fits(k_top)
        out = scoring.score_topk_triton(q, k, lo, hi, k_top, carry=carry)
        _check_topk(out, true, lo.cpu(), hi.cpu(), k_top, atol=1e-5)
        assert torch.equal(carry, fresh)  # untouched
    out = scoring.score_topk_triton(q, k, lo, hi, 17, carry=carry)  # a list of 32: the carry
    _check_topk(out, true, lo.cpu(), hi.cpu(), 17, atol=1e-5)
    assert (carry[..., 3].cpu() == 1).all()


def test_carry_margin_stays_exact_and_aims_wider(device):
    """``carry_margin`` (a caller selecting every few steps): every call still the exact
    top-K, and the carried threshold lets about margin x K keys through — more
    candidates than the default margin's."""
    B, L, D, k_top = 2, 401, 16, 19
    q0, k, kv_lens, kv_start = _inputs(B, 4, 2, L, D, torch.float32, device, seed=13)
    lo, hi = _bounds(kv_lens, kv_start, 2, 3)
    passed = {}
    for margin in (None, 3.0):
        carry = new_carry(B, 2, device)
        g = torch.Generator().manual_seed(6)
        for step in range(4):
            q = q0 + 0.02 * step * torch.randn(q0.shape, generator=g).to(device)
            out = scoring.score_topk_triton(q, k, lo, hi, k_top, carry=carry, carry_margin=margin)
            true = _scores64(q, k, "sum_logits", lo.cpu(), hi.cpu())
            _check_topk(out, true, lo.cpu(), hi.cpu(), k_top, atol=1e-5)
        thr = carry_threshold(carry).cpu().double()  # [B, Hkv]
        passed[margin] = (true >= thr[..., None]).sum(-1).double().mean().item()  # keys the last threshold lets by
    assert passed[3.0] > passed[None] > k_top


@pytest.mark.parametrize("bits", [4, 8])
def test_carry_radix_digit_width(bits, device):
    """The in-register select with 4-bit digits (8 passes of 16 bins) or 8-bit (4 of 256)."""
    radix_topk.SELECT_CONFIG["carry_bits"] = bits
    B, L, D = 2, 500, 16
    q, k, kv_lens, kv_start = _inputs(B, 4, 2, L, D, torch.float32, device, seed=13)
    lo, hi = _bounds(kv_lens, kv_start, 1, 1)
    carry = new_carry(B, 2, device)
    for step in range(3):
        qi = q * (1 + 0.002 * step)
        out, _ = _run(qi, k, lo, hi, 31, "sum_logits", None, carry)
        _check_topk(out, _scores64(qi, k, "sum_logits", lo.cpu(), hi.cpu()), lo.cpu(), hi.cpu(), 31, atol=1e-5)
    assert (_fallbacks(carry) == 1).all()
    radix_topk.SELECT_CONFIG["carry_bits"] = 6
    with pytest.raises(ValueError, match="carry_bits"):
        scoring.score_topk_triton(q, k, lo, hi, 31, carry=carry)


@pytest.mark.parametrize("bits", [4, 8])
def test_carry_select_through_tie_groups(bits, device):
    """Integer scores (0/1 keys, a ones query): a handful of distinct values, so K cuts
    through a group of equal scores and the select's bins hold many keys: still exact."""
    radix_topk.SELECT_CONFIG["carry_bits"] = bits
    B, L, D = 2, 300, 16
    g = torch.Generator().manual_seed(3)
    k = torch.randint(0, 2, (B, 2, L, D), generator=g).float().to(device)
    q = torch.ones(B, 4, D, device=device)
    lo = torch.tensor([5, 0], device=device)
    hi = torch.tensor([290, 300], device=device)
    carry = new_carry(B, 2, device)
    true = _scores64(q, k, "sum_logits", lo.cpu(), hi.cpu())
    for k_top in (40, 40, 41, 90):
        out = scoring.score_topk_triton(q, k, lo, hi, k_top, carry=carry)
        _check_topk(out, true, lo.cpu(), hi.cpu(), k_top, atol=0.0)
    assert (_fallbacks(carry) < 4).all()  # the candidate path ran at least once per row


def test_select_overlap_results_match_plain_calls(device, monkeypatch):
    """After a ``select_overlap`` block (a no-op on a CPU and under the interpreter:
    every kernel runs in order) the results are those of plain calls; the environment
    switch is validated, naming itself."""
    B, L, k_top = 2, 301, 17
    q, k, kv_lens, kv_start = _inputs(B, 4, 2, L, 16, torch.float32, device, seed=11)
    lo, hi = _bounds(kv_lens, kv_start, 2, 3)
    plain = [scoring.score_topk_triton(q, k, lo, hi, k_top, carry=new_carry(B, 2, device))
             for _ in range(2)]
    monkeypatch.setenv("SPADE_SELECT_OVERLAP", "on")
    assert overlap.overlap_enabled(device) == (torch.device(device).type == "cuda" and not _interpret())
    carries = [new_carry(B, 2, device) for _ in range(2)]
    with kernels.select_overlap(device), overlap.select_overlap(device, enabled=True):
        got = [scoring.score_topk_triton(q, k, lo, hi, k_top, carry=c) for c in carries]
    for a, b in zip(plain, got):
        assert torch.equal(a.sort(-1).values, b.sort(-1).values)
    monkeypatch.setenv("SPADE_SELECT_OVERLAP", "sometimes")
    with pytest.raises(ValueError, match="SPADE_SELECT_OVERLAP"):
        overlap.overlap_enabled("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("B,L", [(1, 262147), (2, 524309)])
def test_carry_on_256k_plus_rows_on_gpu(B, L):
    """Rows of 256k-512k tokens on the GPU (bf16 keys, GQA 8:2, K=2k): a drifting query
    whose norm swings by 5% per call selects exactly what float64 scores rank, through
    a CUDA-graph replay too, and after the first call no row falls back."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(17)
    q0 = torch.randn(B, 8, 64, generator=g)
    k = torch.randn(B, 2, L, 64, generator=g).to(dev, torch.bfloat16)
    lo = torch.full((B,), 4, dtype=torch.int32, device=dev)
    hi = torch.tensor([L - 64, L - 1001][:B], dtype=torch.int32, device=dev)
    k_top, carry = 1980, new_carry(B, 2, dev)
    out = torch.empty(B, 2, k_top, dtype=torch.int32, device=dev)
    qbuf = torch.empty(B, 8, 64, dtype=torch.bfloat16, device=dev)

    def step(i):
        q = (q0 + 0.02 * i * torch.randn(q0.shape, generator=g)) * (1.0 + 0.05 * (-1) ** i)
        qbuf.copy_(q.to(torch.bfloat16))
        return scoring.score_topk_triton(qbuf, k, lo, hi, k_top, carry=carry, out=out)

    for i in range(3):
        step(i)
        _check_topk(out, _scores64(qbuf, k, "sum_logits", lo.cpu(), hi.cpu()), lo.cpu(), hi.cpu(), k_top, atol=1e-3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scoring.score_topk_triton(qbuf, k, lo, hi, k_top, carry=carry, out=out)
    for i in range(3, 5):
        qbuf.copy_(((q0 + 0.02 * i * torch.randn(q0.shape, generator=g)) * (1.0 + 0.05 * (-1) ** i)).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        _check_topk(out, _scores64(qbuf, k, "sum_logits", lo.cpu(), hi.cpu()), lo.cpu(), hi.cpu(), k_top, atol=1e-3)
    assert (_fallbacks(carry) == 1).all(), _fallbacks(carry)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [32, 128])
def test_compacted_store_on_gpu_selects_as_whole_rows(D):
    """The GPU's int4 scan (the packed tile at D = 32 channels, four tokens per MMA row; one
    token per row at D = 128), B = 8 x 32k, K = 2,048, GQA 4:1: a drifting query selects the
    same keys, with the same carried state, whether the scoring stores whole rows or only
    the candidates' scores, eagerly and replayed from a CUDA graph, and the compacted store
    matches the int4 scores' own ranking (``group_scores``)."""
    dev = torch.device("cuda")
    B, Hq, Hkv, L, k_top = 8, 32, 8, 32768, 2048
    g = torch.Generator().manual_seed(29)
    q0 = torch.randn(B, Hq, D, generator=g)
    kq, ks = quant.quantize_keys_int4_triton(torch.randn(B, Hkv, L, D, generator=g).to(dev, torch.bfloat16))
    lo = torch.full((B,), 4, dtype=torch.int32, device=dev)
    hi = torch.tensor([L - 16 - 997 * b for b in range(B)], dtype=torch.int32, device=dev)
    qbuf = torch.empty(B, Hq, D, dtype=torch.bfloat16, device=dev)
    runs = {}
    for store in ("mark", "compact"):
        radix_topk.SELECT_CONFIG["carry_compact"] = store == "compact"
        assert scoring.carry_store(qbuf, kq, "sum_logits") == (2 if store == "compact" else 1)
        carry = new_carry(B, Hkv, dev)
        out = torch.empty(B, Hkv, k_top, dtype=torch.int32, device=dev)
        got = []

        def step(i):
            qbuf.copy_(((q0 + 0.02 * i * torch.randn(q0.shape, generator=torch.Generator().manual_seed(i)))
                        * (1.0 + 0.05 * (-1) ** i)).to(torch.bfloat16))

        for i in range(3):
            step(i)
            scoring.score_topk_triton(qbuf, kq, lo, hi, k_top, carry=carry, out=out, k_scale=ks)
            got.append((out.sort(-1).values.cpu(), carry.cpu().clone()))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            scoring.score_topk_triton(qbuf, kq, lo, hi, k_top, carry=carry, out=out, k_scale=ks)
        for i in range(3, 5):
            step(i)
            graph.replay()
            torch.cuda.synchronize()
            got.append((out.sort(-1).values.cpu(), carry.cpu().clone()))
        runs[store] = got
        if store == "compact":
            true = scoring.group_scores_triton(qbuf, kq, hi, kv_start=lo, k_scale=ks).double().cpu()
            _check_topk(out, true, lo.cpu(), hi.cpu(), k_top, atol=1e-6)
    for i, ((a, ca), (b, cb)) in enumerate(zip(runs["mark"], runs["compact"])):
        assert torch.equal(a, b), i
        assert torch.equal(ca, cb), i
    assert (runs["compact"][-1][1][..., 2] <= 2).all()  # the candidate path ran after the first call


@pytest.mark.gpu
def test_select_overlap_block_without_selects_captures():
    """A block that forks nothing (every selection of the pack reused, or dense) joins
    nothing: inside a CUDA-graph capture a join of the idle side stream would wait on a
    stream outside the capture and invalidate it."""
    dev = torch.device("cuda")
    x = torch.zeros(4, device=dev)
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm), overlap.select_overlap(dev, enabled=True):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with overlap.select_overlap(dev, enabled=True):
            x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [2.0] * 4


@pytest.mark.gpu
@pytest.mark.parametrize("warps", [0, 4])
def test_select_overlap_on_gpu_matches_serial(warps):
    """A pack of layers with each select on the side stream (eagerly and replayed from a
    CUDA graph) selects what the serial calls select, carries included, and the results
    are ready on the caller's stream when the block exits."""
    dev = torch.device("cuda")
    B, Hq, Hkv, L, D, k_top, n_layers = 3, 8, 2, 4099, 64, 257, 4
    g = torch.Generator().manual_seed(7)
    qs = [torch.randn(B, Hq, D, generator=g).to(dev, torch.bfloat16) for _ in range(n_layers)]
    ks = [torch.randn(B, Hkv, L, D, generator=g).to(dev, torch.bfloat16) for _ in range(n_layers)]
    lo = torch.full((B,), 4, dtype=torch.int32, device=dev)
    hi = torch.tensor([L - 16, L - 700, 1000], dtype=torch.int32, device=dev)
    if warps:
        radix_topk.SELECT_CONFIG.update(carry_overlap_warps=warps)

    def pack(carries, outs, on):
        with overlap.select_overlap(dev, enabled=on):
            for j in range(n_layers):
                scoring.score_topk_triton(qs[j], ks[j], lo, hi, k_top, carry=carries[j], out=outs[j])

    ref_c = [new_carry(B, Hkv, dev) for _ in range(n_layers)]
    ref_o = [torch.empty(B, Hkv, k_top, dtype=torch.int32, device=dev) for _ in range(n_layers)]
    ov_c = [new_carry(B, Hkv, dev) for _ in range(n_layers)]
    ov_o = [torch.empty(B, Hkv, k_top, dtype=torch.int32, device=dev) for _ in range(n_layers)]
    for step in range(3):  # the first step falls back, the next take the candidates
        pack(ref_c, ref_o, False)
        pack(ov_c, ov_o, True)
        for a, b, ca, cb in zip(ref_o, ov_o, ref_c, ov_c):
            assert torch.equal(a.sort(-1).values, b.sort(-1).values), step
            assert torch.equal(ca, cb), step
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        pack(ov_c, ov_o, True)  # warm-up off the capturing stream
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        pack(ov_c, ov_o, True)
    pack(ref_c, ref_o, False)
    pack(ref_c, ref_o, False)
    graph.replay()
    for a, b, ca, cb in zip(ref_o, ov_o, ref_c, ov_c):
        assert torch.equal(a.sort(-1).values, b.sort(-1).values)
        assert torch.equal(ca, cb)  # 5 calls each (capturing launches nothing)


@pytest.mark.parametrize("reduce", ["sum_softmax", "sum_logits"])
def test_plan_rows_changes_the_grid_not_the_selection(reduce, device):
    """``kernels.plan_rows``: a batch whose rows 1..3 are idle (two-token windows) and row
    0 long, selected with its grids planned for the one row in use: more chunks per row,
    and every call (carry and radix) still an exact top-K, equal to the unplanned call."""
    from spade.kernels import common

    B, Hq, Hkv, L, D = 4, 4, 2, 1100, 16
    q, k, kv_lens, kv_start = _inputs(B, Hq, Hkv, L, D, torch.float32, device, seed=11)
    kv_lens = torch.tensor([L, 900, 700, 500], device=device)
    kv_start = torch.tensor([0, 898, 698, 498], device=device)  # idle rows: their newest two tokens
    lo, hi = _bounds(kv_lens, kv_start, 0, 0)
    cfg = dict(block=64, min_chunk=64, per_sm=4)
    n = 1 << 20  # long enough rows that the chunk floor never binds, on any GPU
    plain = common._split(n, B * Hkv, k.device, **cfg)
    with kernels.plan_rows(1, B):
        planned = common._split(n, B * Hkv, k.device, **cfg)
        with kernels.plan_rows(None, B):  # nested: every row again
            assert common._split(n, B * Hkv, k.device, **cfg) == plain
    assert planned[1] > plain[1], (planned, plain)
    assert common._split(n, B * Hkv, k.device, **cfg) == plain  # restored on exit
    k_top = 33
    true = _scores64(q, k, reduce, *_norm(reduce, lo.cpu(), hi.cpu(),
                                          kv_lens.cpu() if reduce == "sum_softmax" else None))
    for carry in (None, new_carry(B, Hkv, device)):
        base, _ = _run(q, k, lo, hi, k_top, reduce, kv_lens, None if carry is None else carry.clone())
        with kernels.plan_rows(1, B):
            out, _ = _run(q, k, lo, hi, k_top, reduce, kv_lens, carry)
        _check_topk(out, true, lo.cpu(), hi.cpu(), k_top, atol=1e-5)
        assert torch.equal(out.sort(-1).values, base.sort(-1).values)

"""Threshold-carry top-K (``score_topk(..., carry=)``; ``policy.topk: carry``): select
among the scores above a threshold carried from the previous call, falling back to the
radix passes of ``spade.kernels.radix_topk``.

A caller that selects the same rows step after step (a layer of a decode) keeps a
small state per row (``new_carry``): the threshold carried from the previous call,
per unit of the query's norm. A one-program-per-row kernel scales it by this call's
query norm (``_carry_prep_kernel``): scores move in proportion to the query's norm,
and the count of keys above a fixed threshold moves exponentially in it, the faster
the further in the tail the K-th score sits — on long rows a few percent of norm
drift would empty or flood the candidate window. Stage 1 then skips the pass-0
histogram and marks the positions scoring at or above the threshold in a bitmask
(``_carry_mask``: one bit per position, no atomics); with ``SELECT_CONFIG["carry_compact"]``
(off: not yet timed on a GPU), where one kernel scores and stores (``sum_logits``,
``max_logits``), it writes only those positions' scores, compacted to the
front of each ``CARRY_SEG``-position segment (``CARRY_COMPACT``: the candidates' share of the row,
about ``CARRY_MARGIN * k_top`` of L, where the whole row is a sixth of an int4 scan's
bytes at r = 32 channels).
The bitmask is expanded into the candidates' positions and scores
(``_carry_expand_kernel``), and one program per row (``_carry_select_kernel``),
when their count ``n`` lies in ``[k_top, CAP]``, finds the
K-th largest among them with an in-register radix select (16-bin digits: 8 passes of
a cheap histogram) — exact, since every key outside the list scores below the
threshold — writes the winners, and aims the next threshold at ``CARRY_MARGIN *
k_top`` candidates by the secant through (threshold, n) and (K-th score, k_top).
A row with at most K valid keys takes them all, in position order (no select: an idle
serving row's one-token window, a request shorter than K). Otherwise (the first call;
the scores jumped) it flags the row, and the radix passes, launched every call but gated on the flag (other
rows' programs exit at once: a static, capturable launch sequence), select that row
over its whole score row with many programs (a compacted row is first scored again in
full, gated the same way: ``CARRY_RESCORE``), and set its next threshold to the
lowest score of the 16-bit bucket holding its ``CARRY_MARGIN * k_top``-th largest
(a second pass-1 histogram, for that rank). Same result as the radix path; no
full-row passes while consecutive calls score alike, and a fallback costs about the
radix path's passes, at any row length.

The scoring side (``_carry_mask``, ``_carry_row``) runs inside the scoring kernels of
``spade.kernels.scoring``; ``select_overlap`` (``spade.kernels.overlap``) moves the
select beside the next call's scoring.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import triton
import triton.language as tl

from spade.kernels.common import _interpret, _load_group_q, _sm_count
from spade.kernels.overlap import _OVERLAP, _device_index
from spade.kernels.pdl import grid_dep_release, grid_dep_wait, pdl_kwargs
from spade.kernels.radix_topk import (_NBINS, _NHIST, SELECT_CONFIG, _f32_key, _key_f32, _pick_digit, _row_bounds,
                                      _select_from_scores)

__all__ = ["CARRY_CAP_MAX", "CARRY_MARGIN", "CARRY_SLOTS", "carry_fits", "carry_sizes", "carry_stats",
           "carry_threshold", "new_carry", "reset_carry"]


@triton.jit
def _carry_mask(r, offs_l, valid, thr, mask_row):
    """Threshold-carry top-K, scoring side: one bit per position of the tile (valid and
    ``>= thr``) into the row's candidate bitmask ``mask_row`` (int32 words, word
    ``p // 32`` bit ``p % 32``): no atomics, no scan; the select kernel expands it.
    Tiles start at multiples of 32 (BLOCK_L is), so each word belongs to one tile."""
    BL: tl.constexpr = r.shape[0]
    is_c = (valid & (r >= thr)).to(tl.int32)
    bits = tl.reshape(is_c, [BL // 32, 32]) << tl.arange(0, 32)[None, :]
    words = tl.sum(bits, axis=1)  # distinct bits: the sum is their OR (int32 wraps on bit 31, as OR does)
    w = tl.min(tl.reshape(offs_l, [BL // 32, 32]), axis=1) // 32
    tl.store(mask_row + w, words)


CARRY_SLOTS = 8
"""int32 slots per row of a threshold-carry state (``new_carry``): 0 the threshold the
scoring marks with (float32 bits, in score units: ``_carry_prep_kernel`` writes it as
slot 4 times slot 6), 1 unused, 2 fallbacks, 3 calls, 4 the carried threshold per unit
of query norm (float32 bits), 5 the row's fallback flag (set by the select, cleared by
the fallback), 6 this call's query norm (float32 bits), 7 fallbacks with too many
candidates (the rest had too few, or were first calls)."""


CARRY_SEG = 128
"""Threshold-carry top-K: positions per segment of a score row under the compacted store
(``CARRY`` mode 2 of the scoring kernels). A scoring tile keeps only its candidates' scores,
written in position order to the front of each CARRY_SEG-position segment (512 bytes
of the fp32 row): a steady call writes about the candidates' bytes, not the whole row. ``_carry_expand_kernel`` finds each candidate's
score from its rank in its segment (the bitmask's bits); a row that falls back is scored
again in full (mode 3) before the radix passes read it."""

_CARRY_SEG = tl.constexpr(CARRY_SEG)  # (what a kernel may read of a global)

CARRY_MARK, CARRY_COMPACT, CARRY_RESCORE = 1, 2, 3
"""The scoring kernels' ``CARRY`` modes (0: no threshold carry): mark the candidates in
the bitmask and store the whole row (the ``sum_softmax`` finalize); mark them and store
their scores compacted (``CARRY_SEG``); store the whole row of only the rows whose
carry select set the fallback flag, marking nothing (the other rows' programs walk no tile)."""


@triton.jit
def _carry_row(carry_ptr, cand_ptr, row64, NW, start, end, CARRY: tl.constexpr):
    """The carried threshold of row ``row64`` (slot 0 of ``CARRY_SLOTS``), its candidate
    bitmask row (cand [rows, NW] int32 words) and the end of the program's tiles: ``end``,
    or ``start`` (no tile) under CARRY 3 where the row's fallback flag (slot 5) is clear."""
    if CARRY == 1 or CARRY == 2:
        thr = tl.load(carry_ptr + row64 * 8).to(tl.float32, bitcast=True)
    else:
        thr = 0.0
    if CARRY == 3:
        end = tl.where(tl.load(carry_ptr + row64 * 8 + 5) != 0, end, start)
    return thr, cand_ptr + row64 * NW, end


@triton.jit
def _radix_regs(key, m, k_rem, BITS: tl.constexpr):
    """Exact radix select in registers: the order key ``T`` of the ``k_rem``-th largest
    of ``key`` [BLOCK] (uint32) where ``m``, and how many elements equal to ``T`` to take.
    BITS-wide digits (8 or 4; 32 / BITS passes): ``tl.histogram`` costs per element about
    one ballot per digit bit plus a few ops per bin a lane owns, so 16 bins take about a
    quarter of 256's work per pass, for twice the passes."""
    prefix = tl.full([], 0, tl.uint32)
    for p in tl.static_range(32 // BITS):
        if p == 0:
            mp = m
        else:
            mp = m & ((key >> (32 - BITS * p)) == (prefix >> (32 - BITS * p)))
        digit = ((key >> (32 - BITS * (p + 1))) & ((1 << BITS) - 1)).to(tl.int32)
        counts = tl.histogram(digit, 1 << BITS, mask=mp)
        d, k_rem = _pick_digit(counts, k_rem)
        prefix = prefix | (d.to(tl.uint32) << (32 - BITS * (p + 1)))
    return prefix, k_rem


@triton.jit
def _popc32(w):
    """Set bits of each int32 word (byte sums: no overflowing products in the interpreter)."""
    x = w.to(tl.uint32, bitcast=True)
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)).to(tl.int32)


@triton.jit
def _mask_words(mask_ptr, lo_ptr, hi_ptr, row, L, NW, WB: tl.constexpr, HKV: tl.constexpr):
    """Program ``tl.program_id(1)``'s tile of WB bitmask words of row ``row`` (those
    meeting ``[lo, hi)``; others 0) and their absolute word indices."""
    lo, hi, _k = _row_bounds(lo_ptr, hi_ptr, row // HKV, L, 1)
    wi = tl.program_id(1) * WB + tl.arange(0, WB)
    m = (wi >= lo // 32) & (wi < (hi + 31) // 32) & (hi > lo)
    word = tl.load(mask_ptr + row.to(tl.int64) * NW + wi, mask=m, other=0)
    return word, wi


@triton.jit
def _carry_count_kernel(mask_ptr, counts_ptr, lo_ptr, hi_ptr, L, NW, E, HKV: tl.constexpr, WB: tl.constexpr,
                        PDL: tl.constexpr = False):
    """Threshold-carry top-K, select side, step 1 of 3; grid (rows, E): the candidates
    marked in each tile of WB bitmask words, into counts [rows, E]."""
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    row = tl.program_id(0)
    word, wi = _mask_words(mask_ptr, lo_ptr, hi_ptr, row, L, NW, WB, HKV)
    tl.store(counts_ptr + row.to(tl.int64) * E + tl.program_id(1), tl.sum(_popc32(word), axis=0))


@triton.jit
def _carry_expand_kernel(mask_ptr, counts_ptr, pos_ptr, sc_ptr, scores_ptr, lo_ptr, hi_ptr, L, NW, E,
                         HKV: tl.constexpr, WB: tl.constexpr, CAP: tl.constexpr, BLOCK_E: tl.constexpr,
                         SEGW: tl.constexpr = 0, PDL: tl.constexpr = False):
    """Threshold-carry top-K, select side, step 2 of 3; grid (rows, E): each tile of WB
    bitmask words writes the positions of its set bits to the row's ``pos`` [rows, CAP]
    from the slot the tiles before it end at (the counts' prefix sum: the list is in
    position order, the same on every run), those past CAP dropped. SEGW > 0: the scoring
    stored the scores compacted (``CARRY_SEG`` = 32 SEGW positions per segment), so a
    candidate's score sits at its segment's start plus its rank among the segment's set
    bits: they go to ``sc`` [rows, CAP] beside the positions (SEGW 0: the select gathers
    them from the row). Many programs per row: one program expanding a 512k-token row's 16k
    words alone took ~90 us."""
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    row = tl.program_id(0)
    e = tl.program_id(1)
    row64 = row.to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    base = tl.sum(tl.load(counts_ptr + row64 * E + offs_e, mask=offs_e < e, other=0), axis=0)
    if base < CAP:
        word, wi = _mask_words(mask_ptr, lo_ptr, hi_ptr, row, L, NW, WB, HKV)
        pc = _popc32(word)
        slot = base + tl.cumsum(pc, axis=0) - pc
        pos_row = pos_ptr + row64 * CAP
        if SEGW > 0:  # each word's first candidate's slot in its segment (WB words hold whole segments)
            p2 = tl.reshape(pc, [WB // SEGW, SEGW])
            src = scores_ptr + row64 * L + tl.reshape(tl.cumsum(p2, axis=1) - p2, [WB]) + (wi // SEGW) * (32 * SEGW)
            sc_row = sc_ptr + row64 * CAP
        for j in tl.static_range(32):
            b = (word >> j) & 1
            keep = (b != 0) & (slot < CAP)
            tl.store(pos_row + slot, wi * 32 + j, mask=keep)
            if SEGW > 0:
                tl.store(sc_row + slot, tl.load(src, mask=keep, other=0.0), mask=keep)
                src += b
            slot += b


@triton.jit
def _carry_prep_kernel(q_ptr, carry_ptr, stride_qb, stride_qh, stride_qd, HKV: tl.constexpr, G: tl.constexpr,
                       G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Threshold-carry top-K, before the scoring; one program per row. The carried
    threshold is kept per unit of the query's norm (slot 4 of ``CARRY_SLOTS``): a
    predicted query that grows or shrinks moves every score, and the K-th, in
    proportion (exactly so for keys without a preferred direction), while the
    candidate count above a fixed threshold moves exponentially in it — the further in
    the tail the K-th score sits (long rows), the faster. So this call's threshold
    (slot 0, what the scoring marks with) is slot 4 times this call's query norm
    (slot 6). NORM 1 (``sum_logits``): the norm of the group's summed query, which is
    what scores; NORM 2 (``max_logits``): the root of the heads' summed squared norms;
    NORM 0 (``sum_softmax``, whose scores are normalised probabilities): 1."""
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    cbase = carry_ptr + row64 * 8
    if NORM == 0:
        qn = tl.full([], 1.0, tl.float32)
    else:
        q = _load_group_q(q_ptr, row // HKV, row % HKV, stride_qb, stride_qh, stride_qd, G, G_PAD, D,
                          BLOCK_D).to(tl.float32)  # [G_PAD, BLOCK_D]
        if NORM == 1:
            qs = tl.sum(q, axis=0)
            qn = tl.sqrt(tl.sum(qs * qs, axis=0))
        else:
            qn = tl.sqrt(tl.sum(tl.sum(q * q, axis=1), axis=0))
        qn = tl.maximum(qn, 1e-30)  # a zero query (padding): -inf * qn stays -inf, never NaN
    thr_n = tl.load(cbase + 4).to(tl.float32, bitcast=True)
    tl.store(cbase, (thr_n * qn).to(tl.int32, bitcast=True))
    tl.store(cbase + 6, qn.to(tl.int32, bitcast=True))


@triton.jit
def _carry_select_kernel(scores_ptr, carry_ptr, counts_ptr, out_ptr, lo_ptr, hi_ptr, ws_ptr, L, k_top, k_next,
                         pos_ptr, E, n_rows, HKV: tl.constexpr, CAP: tl.constexpr, BLOCK_E: tl.constexpr,
                         BITS: tl.constexpr = 8, SC: tl.constexpr = False, PDL: tl.constexpr = False):
    """Threshold-carry top-K, select side, step 3 of 3; one program per row.

    The scoring kernel marked the row's candidates (scores >= the carried threshold)
    in a bitmask, which ``_carry_count_kernel`` / ``_carry_expand_kernel`` turned into
    their count (``counts`` [rows, E] per tile of words) and positions (``pos``
    [rows, CAP], position order); their scores are read at those positions of the row
    ``scores`` [rows, L], or, SC (a compacted store), from the list [rows, CAP] the expand
    wrote there. When the count ``n`` lies in ``[k_top, CAP]`` the
    K-th largest among them is the row's K-th largest (everything outside is below the
    threshold): an exact radix select on the candidates' scores held in registers,
    then the winners are written, and the next threshold is set by the secant through
    (threshold, n) and (K-th score, k_top) to let about ``k_next`` keys through.
    A row with at most k_top valid keys selects them all (written in position order,
    then -1; no select, no fallback, its threshold kept). Otherwise (first call:
    threshold -inf; too few or too many candidates) the row's fallback flag is set and the radix passes,
    gated on it, select over the whole row in parallel (``_select_from_scores(gate=)``)
    and set the next threshold; this kernel zeroes the row's radix workspace (``ws``,
    ``_new_workspace``'s layout) for them, so no memset runs when no row falls back.
    carry [rows, CARRY_SLOTS] int32; fallbacks and calls are cumulative (statistics)."""
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    lo, hi, k_eff = _row_bounds(lo_ptr, hi_ptr, row // HKV, L, k_top)
    cbase = carry_ptr + row64 * 8
    thr = tl.load(cbase).to(tl.float32, bitcast=True)
    offs_e = tl.arange(0, BLOCK_E)
    n_c = tl.sum(tl.load(counts_ptr + row64 * E + offs_e, mask=offs_e < E, other=0), axis=0)
    pos_row = pos_ptr + row64 * CAP
    out_row = out_ptr + row64 * k_top
    short = hi - lo <= k_top  # every valid key is selected (an idle serving row's one-token window, a short row)
    ok = (k_eff == k_top) & (k_eff > 0) & (n_c >= k_eff) & (n_c <= CAP)
    if short:  # no select to do: the range in position order, -1 after it; the carried threshold stays
        offs = tl.arange(0, CAP)  # CAP > k_top (carry_sizes)
        tl.store(out_row + offs, tl.where(offs < k_eff, lo + offs, -1), mask=offs < k_top)
    elif ok:
        offs = tl.arange(0, CAP)
        m = offs < n_c
        pos = tl.load(pos_row + offs, mask=m, other=0)
        if SC:
            key = _f32_key(tl.load(scores_ptr + row64 * CAP + offs, mask=m, other=0.0))
        else:
            key = _f32_key(tl.load(scores_ptr + row64 * L + pos, mask=m, other=0.0))
        t_key, k_rem = _radix_regs(key, m, k_eff, BITS)
        is_gt = (m & (key > t_key)).to(tl.int32)
        is_eq = (m & (key == t_key)).to(tl.int32)
        s_gt = tl.cumsum(is_gt, axis=0) - 1
        s_eq = (k_eff - k_rem) + tl.cumsum(is_eq, axis=0) - 1
        tl.store(out_row + s_gt, pos, mask=is_gt != 0)
        tl.store(out_row + s_eq, pos, mask=(is_eq != 0) & (s_eq < k_eff))
        t_f = _key_f32(t_key)
        # secant: n(thr) ~ k_top + rho (T - thr); place the next threshold at k_next
        gap = tl.maximum(t_f - thr, 0.0)
        new_thr = t_f - gap * ((k_next - k_eff).to(tl.float32) / tl.maximum(n_c - k_eff, 1).to(tl.float32))
        qn = tl.load(cbase + 6).to(tl.float32, bitcast=True)
        tl.store(cbase + 4, (new_thr / qn).to(tl.int32, bitcast=True))
    else:
        offs_b = tl.arange(0, 256)
        for p in tl.static_range(3):  # _NHIST histograms of this row
            tl.store(ws_ptr + (p * n_rows + row64) * 256 + offs_b, tl.zeros([256], dtype=tl.int32))
        tl.store(ws_ptr + 3 * n_rows * 256 + row64 * 2 + tl.arange(0, 2), tl.zeros([2], dtype=tl.int32))
        tl.store(cbase + 5, 1)  # the gated radix passes select this row and set its threshold
        tl.store(cbase + 2, tl.load(cbase + 2) + 1)
        tl.store(cbase + 7, tl.load(cbase + 7) + ((n_c > CAP) & (thr > float("-inf"))).to(tl.int32))
    tl.store(cbase + 3, tl.load(cbase + 3) + 1)


CARRY_MARGIN = 1.5
"""Threshold-carry top-K: the next threshold aims at ``CARRY_MARGIN * k_top`` candidates
(``SELECT_CONFIG["carry_margin"]`` overrides); the candidate list holds 1.25x that."""


CARRY_CAP_MAX = 8192
"""The longest candidate list the threshold carry takes; a wider one takes the radix
passes (``carry_fits``), and a wider ``margin`` is narrowed to it where the default
margin's list fits. ``_carry_select_kernel`` holds the list in registers, and its time
grows with the list while the radix passes' barely moves with ``k_top``. Measured per
layer on one H100 (int4 keys, steady state, ``benchmarks.bench_select``; docs/perf.md), carry /
radix in us: a 4,096 list (K = 1,980) 104 / 114 at B=8 x 32k, 101 / 114 at 1 x 256k,
156 / 188 at 1 x 512k; an 8,192 list (K = 3,960, or 1,980 at margin 2.0) 122-136 / 114
at 32k-256k, 175-177 / 188 at 512k; a 16,384 list (K = 7,920: ``rerank: 4``) 174-230 / 114-115
at 32k-256k, 229 / 189 at 512k. So the 16,384 lists take the radix passes (``rerank: 4`` on
one H100, colocated, int4, P=9: 14.6 -> 12.8 ms at B=8 x 32k, 22.6 -> 15.8 at 16 x 16k) and
the 8,192 lists keep the carry (``rerank: 2`` at 1 x 256k: 9.84 ms, 10.11 through the radix
passes). Past 16,384 the list also spills its registers (1.71 ms per layer at 32,768 on an
H200; docs/perf.md, two-stage)."""


def carry_sizes(k_top: int, margin: float | None = None) -> tuple[int, int]:
    """(k_next, CAP) of the threshold-carry top-K for ``k_top``: the candidates the next
    threshold aims at (> k_top) and the capacity of the candidate list (a power of two:
    the select kernel holds it in registers). ``margin``: the caller's (a policy that
    selects every few steps wants more slack), else ``SELECT_CONFIG["carry_margin"]``,
    else ``CARRY_MARGIN``. A wider margin is narrowed to keep the list within
    ``CARRY_CAP_MAX`` where the default margin fits in it."""
    if margin is None:
        margin = float(SELECT_CONFIG.get("carry_margin", CARRY_MARGIN))
    margin = float(margin)
    if not margin > 1.0:
        raise ValueError(f"the carry margin must be > 1 (argument carry_margin or SELECT_CONFIG['carry_margin']), "
                         f"got {margin}")
    k_next = max(k_top + 1, math.ceil(margin * k_top))
    cap = triton.next_power_of_2(math.ceil(1.25 * k_next))
    if cap > CARRY_CAP_MAX:
        # a wider list than the select holds in registers without spilling: aim lower, as
        # long as the slack stays at least the default margin's
        k_fit = int(CARRY_CAP_MAX / 1.25)
        if k_fit >= max(k_top + 1, math.ceil(min(margin, CARRY_MARGIN) * k_top)):
            return max(k_top + 1, min(k_next, k_fit)), CARRY_CAP_MAX
    return k_next, cap


def carry_fits(k_top: int, margin: float | None = None) -> bool:
    """Whether the threshold carry's candidate list for ``k_top`` (``carry_sizes``) stays
    within ``CARRY_CAP_MAX``. A wider selection (``k_top`` above ~4.3k at the default
    margin: ``rerank`` m >= 3 x K_mid candidates at K = 2,048, or a budget past ~4.3k) takes
    the radix passes in ``score_topk`` (the same exact top-K; the carry untouched): they
    are faster there (``CARRY_CAP_MAX``), and a list past 16,384 would spill the select's
    registers (``rerank: 8`` at B=8 x 32k, one H100: the step 63.1 -> 18.4 ms)."""
    return carry_sizes(k_top, margin)[1] <= CARRY_CAP_MAX


def new_carry(batch: int, n_kv_heads: int, device: torch.device | str) -> torch.Tensor:
    """A fresh threshold-carry state for ``score_topk(..., carry=)``: int32
    [B, Hkv, CARRY_SLOTS] (the slots: ``CARRY_SLOTS``); the threshold starts at -inf, so
    the first call selects through the fallback and sets it."""
    c = torch.zeros(batch, n_kv_heads, CARRY_SLOTS, dtype=torch.int32, device=device)
    c[..., 0] = _NEG_INF_BITS
    c[..., 4] = _NEG_INF_BITS
    c[..., 6] = _ONE_BITS
    return c


def reset_carry(carry: torch.Tensor, *, stats: bool = True) -> torch.Tensor:
    """Reset a carry state's threshold in place (a new sequence: its scores say nothing of
    the last); ``carry`` may be a view of some rows. ``stats``: zero its statistics too
    (slots 2, 3 and 7: fallbacks, calls; a new generation). A request joining a serving
    batch resets its row with ``stats=False``: the epoch's account goes on."""
    if stats:
        carry.zero_()
    carry[..., 0] = _NEG_INF_BITS
    carry[..., 1] = 0
    carry[..., 4] = _NEG_INF_BITS
    carry[..., 5] = 0
    carry[..., 6] = _ONE_BITS
    return carry


def carry_threshold(carry: torch.Tensor) -> torch.Tensor:
    """The next call's threshold in the last call's score units, float32 [B, Hkv]:
    the carried threshold per unit of query norm times the last call's query norm."""
    return carry[..., 4].view(torch.float32) * carry[..., 6].view(torch.float32)


def carry_stats(carry: torch.Tensor) -> dict:
    """Host summary of a carry state (reads the device): calls and fallbacks summed
    over rows, the fallback fraction, and the fallbacks with too many candidates (the
    others had too few, or were a row's first call; a row of at most K keys is no
    fallback: it takes them all)."""
    c = carry.reshape(-1, CARRY_SLOTS).to("cpu", torch.int64)
    calls, fb, many = int(c[:, 3].sum()), int(c[:, 2].sum()), int(c[:, 7].sum())
    return {"calls": calls, "fallbacks": fb, "fallback_rate": fb / calls if calls else 0.0,
            "fallbacks_too_many": many}


_NEG_INF_BITS = int(torch.tensor(float("-inf"), dtype=torch.float32).view(torch.int32))
_ONE_BITS = int(torch.tensor(1.0, dtype=torch.float32).view(torch.int32))


def _check_carry(carry: torch.Tensor | None, B: int, Hkv: int, device: torch.device) -> None:
    if carry is None:
        return
    if carry.shape != (B, Hkv, CARRY_SLOTS) or carry.dtype != torch.int32 or not carry.is_contiguous() \
            or carry.device != device:
        raise ValueError(f"carry must be a contiguous int32 [B, Hkv, {CARRY_SLOTS}] = [{B}, {Hkv}, {CARRY_SLOTS}] "
                         f"tensor on {device} (carry.new_carry), got {carry.dtype} {tuple(carry.shape)} "
                         f"on {carry.device}")


def _carry_config(cap: int, device: torch.device, rows: int = 0) -> dict:
    """Launch config of the threshold-carry top-K; ``SELECT_CONFIG``'s ``carry_*`` keys override."""
    if _interpret() or device.type != "cuda":
        cfg = dict(carry_warps=1, carry_bits=8, carry_words=64, carry_expand_warps=1)
    else:
        # bench_select --carry on an H200: 16-bin digits select faster than 256-bin ones (15.6 vs
        # 18.6 us at B=8 L=32k); 16 warps while one wave of rows fills the GPU, 8 beyond (two
        # programs per SM: 136.3 vs 142.2 us per layer at B=32 L=16k)
        warps = 16 if rows <= _sm_count(device) else 8
        # under select_overlap (beside the next layer's scoring) 8 warps at every B (a pack of 4
        # layers 246 / 412 / 451 us at B=8 32k / B=16 32k / B=32 16k vs 252 / 419 / 452 with 16-16-8,
        # 355-562 with 4)
        cfg = dict(carry_warps=max(4, min(warps, cap // 256)), carry_bits=4, carry_words=512, carry_expand_warps=4,
                   carry_overlap_warps=max(4, min(8, cap // 256)))
    cfg.update({k: v for k, v in SELECT_CONFIG.items() if k.startswith("carry_")})
    if cfg["carry_bits"] not in (4, 8):
        raise ValueError(f"SELECT_CONFIG['carry_bits'] must be 4 or 8, got {cfg['carry_bits']}")
    return cfg


_CARRY_NORM = {"sum_softmax": 0, "sum_logits": 1, "max_logits": 2}  # _carry_prep_kernel's NORM


def _carry_topk(q, k, scores, lo, hi, n_lo, n_hi, k_top: int, carry, idx, *, scale: float, reduce: str, k_scale,
                hkv: int, score: bool = True, select: bool = True, margin: float | None = None,
                block_table=None) -> None:
    """The threshold-carry top-K into ``idx`` [rows, k_top]: this call's threshold from
    the carried one and the query's norm (``_carry_prep_kernel``), scoring that marks
    the candidates above it in a bitmask per row, ``_carry_select_kernel``, then the
    radix passes gated on the rows it could not select (``_select_from_scores(gate=)``).
    ``score`` / ``select``: run only one half (the benchmark times them apart).
    ``block_table``: ``k`` (and ``k_scale``) are pools read through it; the scores stay logical."""
    from spade.kernels.scoring import _launch_scores, carry_store  # scoring imports this module

    rows, L = scores.shape  # logical positions (a pool's dimension 2 is its block size)
    k_next, cap = carry_sizes(k_top, margin)
    cfg = _carry_config(cap, k.device, rows)
    dev = k.device
    nw = triton.cdiv(L + 2048, 32)  # tiles of up to 2048 positions may end past L
    mask = torch.empty(rows, nw, dtype=torch.int32, device=dev)  # the candidate bitmask words
    mode = carry_store(q, k, reduce, block_table)
    launch_scores = functools.partial(_launch_scores, q, k, scores.view(-1, hkv, L), lo, hi, n_lo, n_hi, scale=scale,
                                      reduce=reduce, full_row=False, hist=None, k_scale=k_scale,
                                      block_table=block_table)
    if score:
        B, Hq, D = q.shape
        G = Hq // hkv
        _carry_prep_kernel[(rows,)](q, carry, q.stride(0), q.stride(1), q.stride(2), HKV=hkv, G=G,
                                    G_PAD=triton.next_power_of_2(G), D=D, BLOCK_D=triton.next_power_of_2(D),
                                    NORM=_CARRY_NORM[reduce], num_warps=1, **pdl_kwargs(q, "select"))
        launch_scores(carry=(carry, mask, nw, mode))
    if select:
        side = getattr(_OVERLAP, "side", None) if dev.type == "cuda" else None
        if side is not None and _OVERLAP.index != _device_index(dev):
            side = None  # a block opened for another device: run in order here
        if side is None:
            warps, launch = cfg["carry_warps"], pdl_kwargs(scores, "select")
        else:
            # select_overlap: this layer's select on the side stream, after its scoring; the
            # caller's stream goes on to the next layer's scoring at once. No PDL across the
            # streams' event edge.
            warps = int(cfg.get("carry_overlap_warps", 0)) or cfg["carry_warps"]
            launch = dict(PDL=False, launch_pdl=False)
            side.wait_stream(torch.cuda.current_stream(dev))
            _OVERLAP.forked = True
        wb = cfg["carry_words"]
        rescore = mode == CARRY_COMPACT
        if rescore and (wb % (CARRY_SEG // 32) or wb & (wb - 1)):
            raise ValueError(f"SELECT_CONFIG['carry_words'] must be a power of two >= {CARRY_SEG // 32} under the "
                             f"compacted store (the expand's tiles hold whole {CARRY_SEG}-position segments), got {wb}")
        n_e = triton.cdiv(nw, wb)  # tiles of bitmask words per row
        block_e = triton.next_power_of_2(n_e)
        after = pdl_kwargs(scores, "select")  # a kernel after another of this stream may overlap its tail
        with contextlib.nullcontext() if side is None else torch.cuda.stream(side):
            counts = torch.empty(rows, n_e, dtype=torch.int32, device=dev)  # candidates per tile of words
            pos = torch.empty(rows, cap, dtype=torch.int32, device=dev)  # their positions
            # a compacted store: the candidates' scores, listed by the expand
            sc = torch.empty(rows, cap, dtype=torch.float32, device=dev) if rescore else scores
            ws = torch.empty(_NHIST * rows * _NBINS + 2 * rows, dtype=torch.int32, device=dev)  # zeroed per row
            wmeta = dict(HKV=hkv, WB=wb, num_warps=cfg["carry_expand_warps"])
            _carry_count_kernel[(rows, n_e)](mask, counts, lo, hi, L, nw, n_e, **wmeta, **launch)
            _carry_expand_kernel[(rows, n_e)](mask, counts, pos, sc, scores, lo, hi, L, nw, n_e, CAP=cap,
                                              BLOCK_E=block_e, SEGW=CARRY_SEG // 32 if rescore else 0,
                                              **wmeta, **after)
            _carry_select_kernel[(rows,)](sc, carry, counts, idx, lo, hi, ws, L, k_top, k_next, pos, n_e, rows,
                                          HKV=hkv, CAP=cap, BLOCK_E=block_e, BITS=cfg["carry_bits"], SC=rescore,
                                          num_warps=warps, **after)
            if rescore:  # the rows that fall back need their whole score row: scored again with pass 0
                launch_scores(carry=(carry, mask, nw, CARRY_RESCORE), hist=ws[:rows * _NBINS])
            _select_from_scores(scores, lo, hi, k_top, hkv, ws, hist0_done=rescore, out=idx, gate=carry,
                                k_next=k_next, launch=after)
        if side is not None:  # the allocator reuses none of these before the side stream is done
            rescored = (q, k, k_scale, block_table) if rescore else ()  # what the re-score reads there
            for t in (scores, mask, lo, hi, idx, carry, *rescored):
                if t is not None:
                    t.record_stream(side)

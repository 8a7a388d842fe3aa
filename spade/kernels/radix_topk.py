"""Exact top-K of fp32 scores by radix select on the score bits: stage 2 of
``score_topk`` (``spade.kernels.scoring``), and ``topk_from_scores_*`` over precomputed
scores.

Why the top-K is built this way
-------------------------------
The naive selection (``matmul`` + ``torch.topk``) is slower than the full
attention it replaces. The floor is reading the keys of ``[lo, hi)`` once
(256 bytes per token and KV head at d=128 in bf16). ``tl.topk`` gives values
only, and a chunk-local top-K keeps nothing useful when K is comparable to the
chunk, so the design is a *radix select on the score bits*:

1. Stage 1 (split-L, one program per (b, KV head, chunk of L)) scores its chunk
   and writes fp32 scores: 4 bytes per token and KV head, 1/64 of the key bytes
   at d=128 bf16. It also builds the histogram of the top 8 bits of each score's
   order-preserving uint32 key (``_f32_key``) in registers and adds it to a
   per-row global histogram with 256 atomics per program (pass 0 fused).
2. Stage 2 finds the exact K-th largest key of each row digit by digit (8-bit
   digits, most significant first): pass p histograms digit p of the keys tied
   with the prefix chosen so far, and the chosen digit is the largest whose
   suffix count reaches the rank still to fill. Passes 0 and 1 run over whole
   rows as (row, chunk) programs merging histograms with atomics (pass 0 fused
   into stage 1). A split pass then writes the sure winners (top 16 key bits
   above the K-th's) straight to the output and the 16-bit ties to a per-row
   buffer; 16 bits resolve the score to 2^-7 relative, so for real score
   distributions only a few dozen ties remain. A last one-program-per-row
   kernel runs passes 2-3 on the ties alone, gets the exact threshold ``T`` and
   the count ``r`` of elements equal to it to take, and writes the ties above
   ``T``, the first ``r`` equal to it (ties broken by arrival order), then
   ``-1`` padding.

The 8-bit histograms cost instructions (``tl.histogram`` works by warp ballots
per bin bit), so only one pass besides the fused one touches every score;
everything after stage 1 reads fp32 scores, 4 bytes per token and KV head, from
L2 mostly: two sweeps are 1/32 of the key bytes. Launches: a memset of the
workspace, stage 1, pass 1, split, ties (plus the softmax finalize kernel for
``sum_softmax``). Worst case (all scores equal) the tie buffer holds the whole
row and the last kernel sweeps it three times per row: slower, still exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spade.kernels.common import _check_rows, _interpret, _range_mask, _split, loop_bound
from spade.kernels.pdl import grid_dep_release, grid_dep_wait, pdl_kwargs

__all__ = ["SELECT_CONFIG", "topk_from_scores_ref", "topk_from_scores_triton"]

_NBINS = 256  # 8-bit radix digits, 4 passes over a 32-bit key


def _select_config(device: torch.device) -> dict:
    if _interpret() or device.type != "cuda":
        cfg = dict(BLOCK=256, num_warps=1, MIN_CHUNK=256)
    else:
        # best of bench_select's grid on an H200 (select 43 / 108 / 110 us at B=8 L=32k /
        # B=8 L=128k / B=32 L=32k, K=2048, vs 46 / 131 / 118 us for 1024 x 4 warps, 4 per SM)
        # (the tie kernel: 7 us with 512-element tiles, 13 us with 2048)
        cfg = dict(BLOCK=2048, num_warps=4, MIN_CHUNK=1024, PER_SM=8, TIE_BLOCK=512)
    cfg.update(SELECT_CONFIG)
    return cfg


SELECT_CONFIG: dict = {}
"""Overrides for the radix-select kernels (``BLOCK``, ``num_warps``, ``MIN_CHUNK``, ``PER_SM``,
``TIE_BLOCK``: the tile of the per-row tie kernel; ``GATED_PER_SM``: programs per SM of the
threshold-carry fallback's gated passes, default 1) and
``fuse_hist`` (False: pass 0 runs as its own kernel instead of inside stage 1); and of the
threshold-carry top-K (``_carry_config``'s ``carry_*`` keys, ``carry_margin``;
``carry_compact``: the scoring stores only the candidates' scores, ``scoring.carry_store``; under
``select_overlap``: ``carry_overlap_warps``, the select's warps on the side stream, and
``carry_overlap_priority``, the side stream's priority)."""


def topk_from_scores_ref(scores: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k_top: int) -> torch.Tensor:
    """Reference exact top-K over ``scores`` [B, H, N] restricted to ``[lo, hi)`` per row
    of the batch: int32 [B, H, k_top], ``-1`` padding."""
    B, H, N = scores.shape
    cand = _range_mask(lo.to(scores.device), hi.to(scores.device), N)  # [B, N]
    s = torch.where(cand[:, None, :], scores, torch.tensor(float("-inf"), device=scores.device))
    out = torch.full((B, H, k_top), -1, dtype=torch.int32, device=scores.device)
    kk = min(k_top, N)
    if kk == 0:
        return out
    _, idx = s.topk(kk, dim=-1)  # [B, H, kk]
    ok = cand[:, None, :].expand(B, H, N).gather(2, idx)  # a valid candidate is never -inf
    out[..., :kk] = torch.where(ok, idx, torch.full_like(idx, -1)).to(torch.int32)
    return out


@triton.jit
def _f32_key(x):
    """Order-preserving map of float32 to uint32 (larger float -> larger key):
    flip every bit of negatives, set the sign bit of non-negatives."""
    bits = x.to(tl.uint32, bitcast=True)
    neg = (bits >> 31) == 1
    # NOTE: ``bits ^ 0xFFFFFFFF`` rather than ``~bits``: the interpreter's uint32 invert overflows.
    return tl.where(neg, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _pick_digit(counts, k_rem):
    """Given the histogram ``counts`` [256] of the current digit among the elements
    still tied on the prefix, and the rank ``k_rem`` (>= 1) still to fill, return the
    digit holding the k_rem-th largest element and the rank left inside that digit."""
    ge = tl.cumsum(counts, axis=0, reverse=True)  # elements with digit >= i: non-increasing in i
    d = tl.sum((ge >= k_rem).to(tl.int32), axis=0) - 1  # the largest i with ge[i] >= k_rem
    gt = tl.sum(tl.where(ge < k_rem, counts, 0), axis=0)  # elements with digit > d
    return d, k_rem - gt


@triton.jit
def _radix_state(hist_ptr, row64, n_rows, k_eff, NPASS: tl.constexpr, run=True):
    """Replay passes ``0..NPASS-1`` from the global histograms [4, n_rows, 256]:
    the key prefix fixed so far and the rank left to fill (``run`` False: a gated-off
    row, whose histograms are not read)."""
    prefix = tl.full([], 0, tl.uint32)
    k_rem = k_eff
    for p in tl.static_range(NPASS):
        counts = tl.load(hist_ptr + (p * n_rows + row64) * 256 + tl.arange(0, 256),
                         mask=tl.full([256], 1, tl.int1) & run, other=0)
        d, k_rem = _pick_digit(counts, k_rem)
        prefix = prefix | (d.to(tl.uint32) << (24 - 8 * p))
    return prefix, k_rem


@triton.jit
def _row_bounds(lo_ptr, hi_ptr, b, L, k_top):
    """Clamped candidate range of batch row ``b`` and the number to select there."""
    lo = tl.maximum(tl.load(lo_ptr + b).to(tl.int32), 0)
    hi = tl.minimum(tl.load(hi_ptr + b).to(tl.int32), L)
    n_valid = tl.maximum(hi - lo, 0)
    return lo, hi, tl.minimum(n_valid, k_top)


@triton.jit
def _hist_tile(row_ptr, l0, lo, hi, prefix, PASS: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram [256] of digit PASS of the keys in one tile tied with ``prefix`` on
    the higher digits."""
    offs = l0 + tl.arange(0, BLOCK)
    valid = (offs >= lo) & (offs < hi)
    key = _f32_key(tl.load(row_ptr + offs, mask=valid, other=0.0))
    if PASS > 0:
        valid = valid & ((key >> (32 - 8 * PASS)) == (prefix >> (32 - 8 * PASS)))
    digit = ((key >> (24 - 8 * PASS)) & 0xFF).to(tl.int32)
    return tl.histogram(digit, 256, mask=valid)


@triton.jit
def _pad_tail(out_row_ptr, k_eff, k_top, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """Write -1 into slots [k_eff, k_top)."""
    s0 = (k_eff // BLOCK) * BLOCK
    for t0 in range(loop_bound(s0, INTERPRET), loop_bound(k_top, INTERPRET), BLOCK):
        offs = t0 + tl.arange(0, BLOCK)
        tl.store(out_row_ptr + offs, tl.full([BLOCK], -1, tl.int32), mask=(offs >= k_eff) & (offs < k_top))


@triton.jit
def _gate(gate_ptr, row64, GATED: tl.constexpr):
    """Whether the row runs: GATED (the threshold-carry top-K's fallback), only a row
    whose select set its fallback flag (slot 5 of its carry state); else every row."""
    if GATED:
        return tl.load(gate_ptr + row64 * 8 + 5) != 0
    return row64 >= 0


@triton.jit
def _row_state(lo_ptr, hi_ptr, hist_ptr, gate_ptr, row, L, n_rows, k_top, HKV: tl.constexpr, NPASS: tl.constexpr,
               GATED: tl.constexpr):
    """What every radix kernel's program first knows of its row ``row`` (of B * HKV):
    (row64, lo, hi, k_eff, run, prefix, k_rem): the candidate range and the number to
    select (``_row_bounds``), whether the row runs (``_gate``) and the state after
    passes ``0..NPASS-1`` (``_radix_state``)."""
    row64 = row.to(tl.int64)
    lo, hi, k_eff = _row_bounds(lo_ptr, hi_ptr, row // HKV, L, k_top)
    run = _gate(gate_ptr, row64, GATED)
    prefix, k_rem = _radix_state(hist_ptr, row64, n_rows, k_eff, NPASS, run)
    return row64, lo, hi, k_eff, run, prefix, k_rem


@triton.jit
def _chunk_tiles(chunk, CHUNK, lo, hi, work, BLOCK: tl.constexpr):
    """The tiles ``[start, end)`` program ``chunk`` of a (row, chunk) grid walks over the
    row's ``[lo, hi)``: none (``end == start``) where ``work`` is False."""
    c0 = chunk * CHUNK
    start = tl.maximum(c0, (lo // BLOCK) * BLOCK)
    end = tl.minimum(c0 + CHUNK, hi)
    return start, tl.where(work, end, start)


@triton.jit
def _radix_pass_kernel(scores_ptr, hist_ptr, lo_ptr, hi_ptr, gate_ptr, L, n_rows, k_top, k_next, CHUNK,
                       HKV: tl.constexpr, PASS: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
                       GATED: tl.constexpr = False, PDL: tl.constexpr = False):
    """Pass PASS (0 or 1) over one chunk of a row: histogram of digit PASS of the
    keys tied with the prefix so far, added into hist[PASS, row]. GATED (the
    threshold-carry fallback; only rows whose flag is set run): pass 1 also histograms
    the keys tied with the pass-0 digit of the ``k_next``-th largest into hist[2, row],
    from which ``_tie_select_kernel`` sets the row's next carried threshold."""
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row64, lo, hi, k_eff, run, prefix, k_rem = _row_state(lo_ptr, hi_ptr, hist_ptr, gate_ptr, row, L, n_rows,
                                                          k_top, HKV, PASS, GATED)
    start, end = _chunk_tiles(chunk, CHUNK, lo, hi, (k_eff > 0) & run, BLOCK)
    row_ptr = scores_ptr + row64 * L
    acc = tl.zeros([256], dtype=tl.int32)
    acc_b = tl.zeros([256], dtype=tl.int32)
    prefix_b = prefix
    if GATED and PASS == 1:
        k_b = tl.maximum(tl.minimum(k_next, hi - lo), 1)
        prefix_b, _kb = _radix_state(hist_ptr, row64, n_rows, k_b, 1, run)
    for l0 in range(loop_bound(start, INTERPRET), loop_bound(end, INTERPRET), BLOCK):
        acc += _hist_tile(row_ptr, l0, lo, hi, prefix, PASS, BLOCK)
        if GATED and PASS == 1:
            acc_b += _hist_tile(row_ptr, l0, lo, hi, prefix_b, PASS, BLOCK)
    tl.atomic_add(hist_ptr + (PASS * n_rows + row64) * 256 + tl.arange(0, 256), acc, mask=acc > 0)
    if GATED and PASS == 1:
        tl.atomic_add(hist_ptr + (2 * n_rows + row64) * 256 + tl.arange(0, 256), acc_b, mask=acc_b > 0)


@triton.jit
def _split_tile(row_ptr, out_row, tie_row, cnt_row, l0, lo, hi, top16, BLOCK: tl.constexpr):
    """One tile of ``_radix_split_kernel``: positions whose key's top 16 bits beat
    ``top16`` go to the output, those equal to it to the tie buffer; slots come from
    the row's two atomic counters plus the rank inside the tile."""
    offs = l0 + tl.arange(0, BLOCK)
    valid = (offs >= lo) & (offs < hi)
    key16 = _f32_key(tl.load(row_ptr + offs, mask=valid, other=0.0)) >> 16
    is_gt = (valid & (key16 > top16)).to(tl.int32)
    is_tie = (valid & (key16 == top16)).to(tl.int32)
    base_gt = tl.atomic_add(cnt_row, tl.sum(is_gt, axis=0))
    base_tie = tl.atomic_add(cnt_row + 1, tl.sum(is_tie, axis=0))
    tl.store(out_row + base_gt + tl.cumsum(is_gt, axis=0) - 1, offs, mask=is_gt != 0)
    tl.store(tie_row + base_tie + tl.cumsum(is_tie, axis=0) - 1, offs, mask=is_tie != 0)


@triton.jit
def _radix_split_kernel(scores_ptr, hist_ptr, cnt_ptr, out_ptr, tie_ptr, lo_ptr, hi_ptr, gate_ptr, L, n_rows, k_top,
                        CHUNK, HKV: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
                        GATED: tl.constexpr = False, PDL: tl.constexpr = False):
    """After passes 0-1 (the top 16 key bits of the K-th largest are known): write the
    sure winners (top 16 bits larger) to the output and the 16-bit ties to a per-row
    buffer, whose length the pass-1 histogram already gives (typically a few dozen)."""
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    row64, lo, hi, k_eff, run, prefix, k_rem = _row_state(lo_ptr, hi_ptr, hist_ptr, gate_ptr, row, L, n_rows,
                                                          k_top, HKV, 2, GATED)
    top16 = prefix >> 16
    start, end = _chunk_tiles(chunk, CHUNK, lo, hi, (k_eff > 0) & run, BLOCK)
    row_ptr = scores_ptr + row64 * L
    out_row = out_ptr + row64 * k_top
    tie_row = tie_ptr + row64 * L
    cnt_row = cnt_ptr + row64 * 2
    for l0 in range(loop_bound(start, INTERPRET), loop_bound(end, INTERPRET), BLOCK):
        _split_tile(row_ptr, out_row, tie_row, cnt_row, l0, lo, hi, top16, BLOCK)


@triton.jit
def _tie_hist_tile(row_ptr, tie_row, t0, n_tie, prefix, PASS: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram of digit PASS (2 or 3) over one tile of the tie buffer."""
    offs = t0 + tl.arange(0, BLOCK)
    m = offs < n_tie
    pos = tl.load(tie_row + offs, mask=m, other=0)
    key = _f32_key(tl.load(row_ptr + pos, mask=m, other=0.0))
    m = m & ((key >> (32 - 8 * PASS)) == (prefix >> (32 - 8 * PASS)))
    return tl.histogram(((key >> (24 - 8 * PASS)) & 0xFF).to(tl.int32), 256, mask=m)


@triton.jit
def _tie_emit_tile(row_ptr, out_row, tie_row, t0, n_tie, thr, slot_gt, slot_eq, k_eff, BLOCK: tl.constexpr):
    """Write the tie-buffer entries of one tile with key > thr at ``slot_gt + rank`` and
    those == thr at ``slot_eq + rank`` (while < k_eff); returns the two counts."""
    offs = t0 + tl.arange(0, BLOCK)
    m = offs < n_tie
    pos = tl.load(tie_row + offs, mask=m, other=0)
    key = _f32_key(tl.load(row_ptr + pos, mask=m, other=0.0))
    is_gt = (m & (key > thr)).to(tl.int32)
    is_eq = (m & (key == thr)).to(tl.int32)
    s_gt = slot_gt + tl.cumsum(is_gt, axis=0) - 1
    s_eq = slot_eq + tl.cumsum(is_eq, axis=0) - 1
    tl.store(out_row + s_gt, pos, mask=is_gt != 0)
    tl.store(out_row + s_eq, pos, mask=(is_eq != 0) & (s_eq < k_eff))
    return tl.sum(is_gt, axis=0), tl.sum(is_eq, axis=0)


@triton.jit
def _tie_select_kernel(scores_ptr, hist_ptr, out_ptr, tie_ptr, lo_ptr, hi_ptr, gate_ptr, L, n_rows, k_top, k_next,
                       HKV: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
                       GATED: tl.constexpr = False, PDL: tl.constexpr = False):
    """One program per row: passes 2-3 over the 16-bit ties only, then the exact
    threshold T: ties with key > T, then the first ones equal to T, fill the slots
    after the sure winners; -1 padding after k_eff. GATED (the threshold-carry
    fallback): only rows whose flag is set run; each sets its next carried threshold
    (per unit of query norm) to the lowest score of the 16-bit bucket holding its
    ``k_next``-th largest (hist[2]), so that about ``k_next`` keys pass it, and clears
    its flag."""
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    row64, lo, hi, k_eff, run, prefix, k_rem = _row_state(lo_ptr, hi_ptr, hist_ptr, gate_ptr, tl.program_id(0), L,
                                                          n_rows, k_top, HKV, 2, GATED)
    n_gt16 = k_eff - k_rem  # sure winners already written by _radix_split_kernel
    d1 = ((prefix >> 16) & 0xFF).to(tl.int32)
    n_tie = tl.load(hist_ptr + (n_rows + row64) * 256 + d1, mask=run, other=0)  # elements tied on 16 bits
    n_tie = tl.where((k_eff > 0) & run, n_tie, 0)
    row_ptr = scores_ptr + row64 * L
    tie_row = tie_ptr + row64 * L
    out_row = out_ptr + row64 * k_top
    for p in tl.static_range(2, 4):
        acc = tl.zeros([256], dtype=tl.int32)
        for t0 in range(0, loop_bound(n_tie, INTERPRET), BLOCK):
            acc += _tie_hist_tile(row_ptr, tie_row, t0, n_tie, prefix, p, BLOCK)
        d, k_rem = _pick_digit(acc, k_rem)
        prefix = prefix | (d.to(tl.uint32) << (24 - 8 * p))
    n_gt = n_gt16
    n_eq = k_eff - k_rem  # the first slot of the ties equal to T
    for t0 in range(0, loop_bound(n_tie, INTERPRET), BLOCK):
        c_gt, c_eq = _tie_emit_tile(row_ptr, out_row, tie_row, t0, n_tie, prefix, n_gt, n_eq, k_eff, BLOCK)
        n_gt += c_gt
        n_eq += c_eq
    _pad_tail(out_row, tl.where(run, k_eff, k_top), k_top, BLOCK, INTERPRET)
    if GATED:
        if run:
            n_valid = tl.maximum(hi - lo, 0)
            k_b = tl.maximum(tl.minimum(k_next, n_valid), 1)
            c0 = tl.load(hist_ptr + row64 * 256 + tl.arange(0, 256))
            d0b, rem_b = _pick_digit(c0, k_b)
            c1 = tl.load(hist_ptr + (2 * n_rows + row64) * 256 + tl.arange(0, 256))
            d1b, rem_b = _pick_digit(c1, rem_b)
            key_b = (d0b.to(tl.uint32) << 24) | (d1b.to(tl.uint32) << 16)
            thr = _key_f32(key_b)
            thr = tl.where(k_next < n_valid, thr, float("-inf"))
            cbase = gate_ptr + row64 * 8
            qn = tl.load(cbase + 6).to(tl.float32, bitcast=True)
            tl.store(cbase + 4, (thr / qn).to(tl.int32, bitcast=True))
            tl.store(cbase + 5, 0)


@triton.jit
def _key_f32(key):
    """Inverse of ``_f32_key``: the float32 whose order key is ``key`` (uint32)."""
    bits = tl.where((key >> 31) == 1, key & 0x7FFFFFFF, key ^ 0xFFFFFFFF)
    return bits.to(tl.float32, bitcast=True)


_NPASS_GLOBAL = 2  # passes histogrammed over whole rows; passes 2-3 only see the 16-bit ties
_NHIST = 3  # histograms per row: passes 0 and 1, and the carry fallback's pass 1 of its next-threshold rank


def _new_workspace(rows: int, device: torch.device) -> torch.Tensor:
    """Zeroed radix workspace: [_NHIST, rows, 256] histograms + [rows, 2] slot counters,
    in one allocation so one memset clears it."""
    return torch.zeros(_NHIST * rows * _NBINS + 2 * rows, dtype=torch.int32, device=device)


def _select_from_scores(scores: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k_top: int, hkv: int,
                        ws: torch.Tensor, *, hist0_done: bool, out: torch.Tensor | None = None,
                        gate: torch.Tensor | None = None, k_next: int = 0, launch: dict | None = None) -> torch.Tensor:
    """Stage 2 over ``scores`` [rows, N] fp32 (rows = B * hkv; ``lo``/``hi`` per batch
    row). ``ws`` is the zeroed workspace of ``_new_workspace``, with the pass-0
    histogram already accumulated when ``hist0_done``. Returns int32 [rows, k_top]:
    ``out`` (contiguous, every slot written) when given.

    ``gate``: a threshold-carry state (``new_carry``): only the rows whose fallback
    flag the carry select set are selected (the others' programs exit at once, so the
    launches are static and graph-capturable), and each sets its next threshold aimed
    at ``k_next`` keys; ``ws`` need be zeroed only in those rows (the carry select does). ``launch``: the kernels' launch options (default: PDL as the
    select family's)."""
    rows, N = scores.shape
    if out is None:
        out = torch.empty(rows, k_top, dtype=torch.int32, device=scores.device)
    ties = torch.empty(rows, N, dtype=torch.int32, device=scores.device)  # [rows, N] positions, prefix used
    cfg = _select_config(scores.device)
    BLOCK, nw = cfg["BLOCK"], cfg["num_warps"]
    gated = gate is not None
    meta = dict(HKV=hkv, BLOCK=BLOCK, INTERPRET=_interpret(), GATED=gated, num_warps=nw)
    # gated (a carry fallback, rare): one program per SM over the rows, so the launches cost
    # little when no row runs
    chunk, n_chunks = _split(N, rows, scores.device, block=BLOCK, min_chunk=cfg["MIN_CHUNK"],
                             per_sm=cfg.get("GATED_PER_SM", 1) if gated else cfg.get("PER_SM", 4))
    grid = (rows, n_chunks)
    pdl = pdl_kwargs(scores, "select") if launch is None else launch
    g = gate if gated else ws  # never read when not gated
    for p in range(1 if hist0_done else 0, _NPASS_GLOBAL):
        _radix_pass_kernel[grid](scores, ws, lo, hi, g, N, rows, k_top, k_next, chunk, PASS=p, **meta, **pdl)
    cnt = ws[_NHIST * rows * _NBINS:]
    _radix_split_kernel[grid](scores, ws, cnt, out, ties, lo, hi, g, N, rows, k_top, chunk, **meta, **pdl)
    tie_meta = dict(meta, BLOCK=cfg.get("TIE_BLOCK", BLOCK))  # one program per row walks the short tie list
    _tie_select_kernel[(rows,)](scores, ws, out, ties, lo, hi, g, N, rows, k_top, k_next, **tie_meta, **pdl)
    return out


def topk_from_scores_triton(scores: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k_top: int) -> torch.Tensor:
    """Exact top-K of precomputed scores [B, H, N] (fp32) restricted to ``[lo, hi)``
    per batch row: int32 [B, H, k_top], ``-1`` padding, order unspecified."""
    B, H, N = scores.shape
    lo = _check_rows(lo, B, "lo", scores.device)
    hi = _check_rows(hi, B, "hi", scores.device)
    if k_top < 0:
        raise ValueError(f"k_top must be >= 0, got {k_top}")
    if k_top == 0 or B * H == 0:
        return torch.full((B, H, k_top), -1, dtype=torch.int32, device=scores.device)
    s = scores.float().contiguous().view(B * H, N)
    ws = _new_workspace(B * H, scores.device)
    return _select_from_scores(s, lo, hi, k_top, H, ws, hist0_done=False).view(B, H, k_top)

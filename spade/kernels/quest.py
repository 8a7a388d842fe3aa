"""Quest page bounds, page scores and page selection.

Quest keeps, for every page of ``page_size`` consecutive cached tokens, the
element-wise min and max of its keys. For a query head ``q`` the largest logit
any key of the page can reach is bounded by ``Σ_d max(q_d·min_d, q_d·max_d)``;
pages are ranked by that bound (reduced over the query heads of a GQA group by
sum or max) and the best ones are attended in full.

Ops (each with a plain-torch ``*_ref`` and a ``*_triton``):

* ``quest_build``: (kmin, kmax) [B, Hkv, P, D] from a whole cache, P = ceil(L / page_size).
* ``quest_update``: fold one new key per row into its page, in place.
* ``quest_page_scores``: the bounds [B, Hkv, P] float32.
* ``quest_select``: token indices of the last page plus the best other pages.

The page score is two GEMMs: ``max(q_d·min_d, q_d·max_d) = q⁺_d·max_d + q⁻_d·min_d``
with ``q⁺ = max(q, 0)`` and ``q⁻ = min(q, 0)`` (exact, also in floating point:
one of the two products is a signed zero). So the Triton kernel runs the G query
heads of a group as the rows of two ``tl.dot`` against the page bounds, reading
the metadata (2·P·D elements per row) once. ``quest_select`` reuses the exact
radix top-K of ``spade.kernels.radix_topk`` on the page scores.

As in scoring, the query is rounded to the bounds' dtype first (both paths).

Pages are relative to each row's own start: page ``p`` of row ``b`` holds the cache
positions ``[kv_start[b] + p·S, kv_start[b] + (p+1)·S)`` (S = page_size; no
``kv_start``: 0), so a row has ``ceil((kv_lens - kv_start) / S)`` pages, the last one
partial, and its page grouping, bounds, scores and selection are the same wherever
its window starts (left padding, a serving join at any cursor). ``P = ceil(L / S)``
pages always suffice.

On a paged KV cache the bounds may live in the pool's blocks instead (*pool bounds*,
``block_table=`` / ``block_size=``): ``kmin`` / ``kmax`` [num_blocks, Hkv, ceil(bs / S), D]
(bs = the cache's block size), page ``p`` of row ``b`` stored in the block that holds
its first position ``s = kv_start[b] + p·S``, at sub-slot ``(s % bs) // S``. Two page
starts of one row are S apart, so they never share a (block, sub-slot); a row's
bounds take memory only in the blocks its KV holds (a serving batch sizes nothing by
its logical capacity), and a block handed to another request is overwritten by that
request's join (``quest_write_pool``) or reset by its page's first token
(``quest_update``). Token indices stay logical.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spade.kernels import radix_topk
from spade.kernels.common import _check_rows, _interpret, _sm_count, loop_bound
from spade.kernels.paged import check_block_table, cut_logical, paged_launch, paged_slots, paged_to_contiguous
from spade.kernels.pdl import grid_dep_release, grid_dep_wait, pdl_kwargs
from spade.kernels.scoring import _default_scale

__all__ = [
    "quest_build_ref",
    "quest_build_triton",
    "quest_update_ref",
    "quest_update_triton",
    "quest_page_scores_ref",
    "quest_page_scores_triton",
    "quest_select_ref",
    "quest_select_triton",
    "quest_write_pool",
    "quest_pool_to_logical",
]

_QUEST_REDUCES = ("sum_logits", "max_logits")


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def _check_reduce(reduce: str) -> None:
    if reduce not in _QUEST_REDUCES:
        raise ValueError(f"Quest page scores reduce the group by {_QUEST_REDUCES}, got {reduce!r}")


def _check_page_size(page_size: int) -> None:
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")


def _check_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Validate q [B, Hq, D] against the bounds [B, Hkv, P, D]; return (B, Hq, Hkv, P, D)."""
    if kmin.shape != kmax.shape or kmin.dim() != 4:
        raise ValueError(f"kmin {tuple(kmin.shape)} and kmax {tuple(kmax.shape)} must both be [B, Hkv, P, D]")
    if kmin.dtype != kmax.dtype:
        raise ValueError(f"kmin and kmax dtypes differ: {kmin.dtype} vs {kmax.dtype}")
    B, Hkv, P, D = kmin.shape
    if q.dim() != 3 or q.shape[0] != B or q.shape[2] != D:
        raise ValueError(f"q {tuple(q.shape)} does not match bounds {tuple(kmin.shape)}")
    Hq = q.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    return B, Hq, Hkv, P, D


def _check_pool_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block_table: torch.Tensor,
                       page_size: int, block_size: int | None) -> tuple[int, int, int, int, int]:
    """Validate pool bounds [num_blocks, Hkv, ceil(block_size / page_size), D] read through
    ``block_table`` [B, max_blocks]; return (B, Hq, Hkv, P, D) with P the pages of the
    table's logical capacity."""
    if block_size is None or block_size <= 0:
        raise ValueError(f"pool bounds need the KV cache's block_size (> 0); got {block_size}")
    if kmin.shape != kmax.shape or kmin.dim() != 4:
        raise ValueError(f"kmin {tuple(kmin.shape)} and kmax {tuple(kmax.shape)} must both be "
                         "[num_blocks, Hkv, ceil(block_size / page_size), D]")
    if kmin.dtype != kmax.dtype or kmin.stride() != kmax.stride():
        raise ValueError("kmin and kmax must have the same dtype and strides")
    spb = triton.cdiv(block_size, page_size)
    if kmin.shape[2] != spb:
        raise ValueError(f"pool bounds hold ceil(block_size / page_size) = {spb} pages per block "
                         f"(block_size={block_size}, page_size={page_size}); got {kmin.shape[2]}")
    B = q.shape[0] if q is not None else block_table.shape[0]
    check_block_table(block_table, B, kmin.device)
    _, Hkv, _, D = kmin.shape
    Hq = Hkv if q is None else q.shape[1]
    if q is not None and (q.dim() != 3 or q.shape[2] != D):
        raise ValueError(f"q {tuple(q.shape)} does not match bounds {tuple(kmin.shape)}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    return B, Hq, Hkv, triton.cdiv(block_table.shape[1] * block_size, page_size), D


def _pool_slots(block_table: torch.Tensor, kv_start: torch.Tensor | None, pages: torch.Tensor, page_size: int,
                block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, sub-slot) int64 of each row's relative pages ``pages`` [B, n] in pool bounds:
    page ``p`` lives in the block of its first position ``kv_start + p·S`` (pages past the
    table read its last entry)."""
    B, nb = block_table.shape
    start = torch.zeros(B, dtype=torch.int64, device=block_table.device) if kv_start is None else \
        kv_start.to(block_table.device).long()
    pos0 = start[:, None] + pages.long() * page_size  # [B, n]
    blk = torch.gather(block_table.long(), 1, (pos0 // block_size).clamp(0, max(nb - 1, 0)))
    return blk, (pos0 % block_size) // page_size


def quest_pool_to_logical(kmin: torch.Tensor, kmax: torch.Tensor, block_table: torch.Tensor, page_size: int,
                          block_size: int, *, kv_start: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool bounds read out as logical bounds [B, Hkv, P, D] (a copy; references and tests):
    page ``p`` of row ``b`` from its slot, whatever the slot holds (pages a row does not
    have yet read their slot's stale or null-block values, as the kernels would not)."""
    B, _, Hkv, P, D = _check_pool_bounds(None, kmin, kmax, block_table, page_size, block_size)
    pages = torch.arange(P, device=block_table.device).expand(B, P)
    blk, sub = _pool_slots(block_table, kv_start, pages, page_size, block_size)
    pick = lambda x: x[blk, :, sub].permute(0, 2, 1, 3)  # [B, P, Hkv, D] -> [B, Hkv, P, D]
    return pick(kmin), pick(kmax)


def quest_write_pool(kmin: torch.Tensor, kmax: torch.Tensor, new_min: torch.Tensor, new_max: torch.Tensor,
                     block_table: torch.Tensor, kv_lens: torch.Tensor, page_size: int, block_size: int, *,
                     kv_start: torch.Tensor | None = None) -> None:
    """Write rows' logical bounds ``new_min`` / ``new_max`` [n, Hkv, P', D] (``quest_build`` of
    their prompts) into pool bounds through their tables ``block_table`` [n, max_blocks]: each
    row's pages ``[0, ceil((kv_lens - kv_start) / S))``, nothing else (a serving join; the
    other rows' pages are untouched). One gather and one scatter, no host synchronisation."""
    _check_page_size(page_size)
    n, _, Hkv, P, D = _check_pool_bounds(None, kmin, kmax, block_table, page_size, block_size)
    if new_min.shape != new_max.shape or new_min.dim() != 4 or new_min.shape[0] != n \
            or new_min.shape[1] != Hkv or new_min.shape[3] != D:
        raise ValueError(f"new bounds {tuple(new_min.shape)} must be [{n}, {Hkv}, P, {D}]")
    Pn = min(P, new_min.shape[2])
    kv_lens = _check_rows(kv_lens, n, "kv_lens", kmin.device)
    start, n_pages, _ = _select_plan(kv_lens, kv_start, page_size)
    # a page the row does not have is sent to its page 0 with page 0's value (a duplicate
    # index writing the same value: deterministic); a row with no page rewrites page 0's slot as it is
    p = torch.arange(Pn, device=kmin.device)[None, :]
    p = torch.where(p < n_pages[:, None], p, 0)  # [n, Pn]
    blk, sub = _pool_slots(block_table, start, p, page_size, block_size)
    has = (n_pages > 0)[:, None, None, None]
    for pool, new in ((kmin, new_min), (kmax, new_max)):
        vals = torch.gather(new, 2, p[:, None, :, None].expand(n, Hkv, Pn, D)).permute(0, 2, 1, 3)  # [n, Pn, Hkv, D]
        pool[blk, :, sub] = torch.where(has, vals.to(pool.dtype), pool[blk, :, sub])


def _round_q(q: torch.Tensor, kmin: torch.Tensor) -> torch.Tensor:
    return q if q.dtype == kmin.dtype else q.to(kmin.dtype)


# ----------------------------------------------------------------------------------------------
# References (plain torch)
# ----------------------------------------------------------------------------------------------


def _check_paged_build(k: torch.Tensor, kv_lens: torch.Tensor, block_table: torch.Tensor | None) -> None:
    if block_table is not None:
        if k.dim() != 4:
            raise ValueError(f"k must be a pool [num_blocks, Hkv, block_size, D]; got {tuple(k.shape)}")
        check_block_table(block_table, kv_lens.shape[0], k.device)


def quest_build_ref(k: torch.Tensor, kv_lens: torch.Tensor, page_size: int, *,
                    kv_start: torch.Tensor | None = None,
                    block_table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference ``quest_build``: (kmin, kmax) [B, Hkv, P, D] in k's dtype, page ``p`` of
    row ``b`` bounding the positions ``[kv_start + p·S, kv_start + (p+1)·S)`` below
    ``kv_lens``; +inf / -inf for pages with no valid token. ``block_table``: ``k`` is a
    pool [num_blocks, Hkv, block_size, D] (``spade.kernels.paged``), read through its
    logical copy; positions stay logical (P = ceil(max_blocks * block_size / page_size))."""
    _check_page_size(page_size)
    _check_paged_build(k, kv_lens, block_table)
    if block_table is not None:
        k = paged_to_contiguous(k, block_table)  # positions outside [kv_start, kv_lens) are masked below
    B, H, L, D = k.shape
    P = triton.cdiv(L, page_size)
    start = torch.zeros_like(kv_lens) if kv_start is None else kv_start
    # row b's page p, slot j: position start[b] + p * page_size + j (relative pages)
    pos = start.to(k.device).long()[:, None] + torch.arange(P * page_size, device=k.device)[None, :]  # [B, P*S]
    valid = pos < torch.clamp(kv_lens.to(k.device).long(), max=L)[:, None]
    idx = pos.clamp(max=max(L - 1, 0))[:, None, :, None].expand(B, H, P * page_size, D)
    kp = k.float().gather(2, idx).view(B, H, P, page_size, D)
    valid = valid.view(B, 1, P, page_size, 1)
    inf = torch.tensor(float("inf"), device=k.device)
    kmin = torch.where(valid, kp, inf).amin(3)
    kmax = torch.where(valid, kp, -inf).amax(3)
    return kmin.to(k.dtype), kmax.to(k.dtype)


def quest_update_ref(kmin: torch.Tensor, kmax: torch.Tensor, k_new: torch.Tensor, pos: torch.Tensor,
                     page_size: int, *, kv_start: torch.Tensor | None = None,
                     block_table: torch.Tensor | None = None, block_size: int | None = None) -> None:
    """Reference ``quest_update`` (in place): the key written at cache position ``pos``
    [B] goes to the row's page ``(pos - kv_start) // page_size`` (relative pages); a
    page's first token resets its bounds, later ones fold in by element-wise min / max.
    ``block_table``: pool bounds (module doc), the page's slot read through the table."""
    _check_page_size(page_size)
    pos = pos.to(kmin.device).long()
    rel = pos - (0 if kv_start is None else kv_start.to(kmin.device).long())
    page = rel // page_size  # [B]
    first = (rel % page_size == 0)[:, None, None]  # [B, 1, 1]
    kn = k_new.to(kmin.dtype)  # [B, Hkv, D]
    if block_table is not None:
        B, _, _, _, _ = _check_pool_bounds(None, kmin, kmax, block_table, page_size, block_size)
        cap = block_table.shape[1] * block_size
        ok = ((rel >= 0) & (pos - rel % page_size < cap))[:, None, None]
        blk, sub = _pool_slots(block_table, kv_start, page.clamp(min=0)[:, None], page_size, block_size)
        at = (blk[:, 0], slice(None), sub[:, 0])
    else:
        B, P = kmin.shape[0], kmin.shape[2]
        ok = ((rel >= 0) & (page < P))[:, None, None]  # as the kernel: other positions are ignored
        at = (torch.arange(B, device=kmin.device), slice(None), page.clamp(0, max(P - 1, 0)))
    cur_min, cur_max = kmin[at], kmax[at]  # [B, Hkv, D]
    kmin[at] = torch.where(ok, torch.where(first, kn, torch.minimum(cur_min, kn)), cur_min)
    kmax[at] = torch.where(ok, torch.where(first, kn, torch.maximum(cur_max, kn)), cur_max)


def _page_range_mask(page_start: torch.Tensor | None, n_pages: torch.Tensor, P: int) -> torch.Tensor:
    """[B, P] bool: page_start[b] <= p < n_pages[b]."""
    pidx = torch.arange(P, device=n_pages.device)
    lo = torch.zeros_like(n_pages) if page_start is None else page_start.to(n_pages.device)
    return (pidx[None, :] >= lo.long()[:, None]) & (pidx[None, :] < n_pages.long()[:, None])


def quest_page_scores_ref(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, n_pages: torch.Tensor, *,
                          scale: float | None = None, reduce: str = "sum_logits",
                          page_start: torch.Tensor | None = None) -> torch.Tensor:
    """Reference ``quest_page_scores``: [B, Hkv, P] float32, the per-head bound
    ``scale · Σ_d max(q_d·min_d, q_d·max_d)`` reduced over the group; ``-inf``
    for pages outside ``[page_start, n_pages)``."""
    _check_reduce(reduce)
    B, Hq, Hkv, P, D = _check_bounds(q, kmin, kmax)
    G = Hq // Hkv
    qg = _round_q(q, kmin).float().view(B, Hkv, G, 1, D)
    lo, hi = kmin.float()[:, :, None], kmax.float()[:, :, None]  # [B, Hkv, 1, P, D]
    s = torch.maximum(qg * lo, qg * hi).sum(-1) * _default_scale(scale, D)  # [B, Hkv, G, P]
    s = s.sum(2) if reduce == "sum_logits" else s.amax(2)
    valid = _page_range_mask(page_start, n_pages.to(kmin.device), P)
    return torch.where(valid[:, None, :], s, torch.tensor(float("-inf"), device=s.device)).float()


def _select_plan(kv_lens: torch.Tensor, kv_start: torch.Tensor | None, page_size: int):
    """Per row (relative pages): its start, number of pages ``ceil((kv - start) / S)``
    and last page (the one holding kv_lens-1; -1 when the row is empty)."""
    kv = kv_lens.long()
    start = torch.zeros_like(kv) if kv_start is None else kv_start.to(kv.device).long()
    has = kv > start
    # an empty row gets an empty page range (its bounds are +-inf: no score, no NaN)
    n_pages = torch.where(has, (kv - start + page_size - 1) // page_size, torch.zeros_like(kv))
    last = n_pages - 1
    return start, n_pages, last


def _pages_to_tokens(pages: torch.Tensor, start: torch.Tensor, kv: torch.Tensor, page_size: int) -> torch.Tensor:
    """Expand relative pages [B, H, S] (-1 = none) to token indices [B, H, S * page_size]
    int32 (``start + p * page_size + j``), ``-1`` at or past ``kv``."""
    B, H, S = pages.shape
    tok = start.view(B, 1, 1, 1) + pages.long()[..., None] * page_size + torch.arange(page_size, device=pages.device)
    ok = (pages[..., None] >= 0) & (tok < kv.view(B, 1, 1, 1))
    return torch.where(ok, tok, torch.full_like(tok, -1)).view(B, H, S * page_size).to(torch.int32)


def quest_select_ref(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, kv_lens: torch.Tensor,
                     n_pages_sel: int, page_size: int, *, scale: float | None = None, reduce: str = "sum_logits",
                     kv_start: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                     block_size: int | None = None) -> torch.Tensor:
    """Reference ``quest_select``: int32 [B, Hkv, n_pages_sel * page_size], the last page
    first, then the best ``n_pages_sel - 1`` other pages by ``torch.topk``; page ``p``
    expands to the positions ``kv_start + p·S + j`` below ``kv_lens`` (-1 elsewhere).
    ``block_table``: pool bounds (module doc), read out as logical bounds first."""
    _check_reduce(reduce)
    _check_page_size(page_size)
    if n_pages_sel < 1:
        raise ValueError(f"n_pages_sel must be >= 1, got {n_pages_sel}")
    if block_table is not None:
        _check_pool_bounds(q, kmin, kmax, block_table, page_size, block_size)
        kmin, kmax = quest_pool_to_logical(kmin, kmax, block_table, page_size, block_size, kv_start=kv_start)
    B, Hq, Hkv, P, D = _check_bounds(q, kmin, kmax)
    start, n_pages, last = _select_plan(kv_lens.to(kmin.device), kv_start, page_size)
    if kmin.device.type == "cpu" and B > 0:  # (the CPU's select: no page past the rows' last)
        P, _, kmin, kmax = cut_logical(int(n_pages.max()), P, None, 1, kmin, kmax)
    scores = quest_page_scores_ref(q, kmin, kmax, n_pages, scale=scale, reduce=reduce)
    # candidates: [0, last) -- every valid page but the last (empty when last = -1)
    zero = torch.zeros_like(last)
    others = radix_topk.topk_from_scores_ref(scores, zero, torch.maximum(last, zero), n_pages_sel - 1)
    pages = torch.cat([last.view(B, 1, 1).expand(B, Hkv, 1).to(torch.int32), others], dim=-1)
    return _pages_to_tokens(pages, start, kv_lens.to(kmin.device).long(), page_size)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _row_pages(kv_ptr, start_ptr, b, page_size, HAS_START: tl.constexpr):
    """Row ``b``'s relative pages ``[0, end)`` from its token range ``[start, kv)``
    (start 0 without HAS_START): ``end = ceil((kv - start) / page_size)``; an empty row
    gets the empty range ``[0, 0)``. Returns (first = 0, end, kv, start)."""
    kv = tl.load(kv_ptr + b).to(tl.int32)
    if HAS_START:
        start = tl.load(start_ptr + b).to(tl.int32)
    else:
        start = kv * 0
    first = kv * 0
    end = tl.where(kv > start, (kv - start + page_size - 1) // page_size, first)
    return first, end, kv, start


@triton.jit
def _quest_build_kernel(
    k_ptr, kmin_ptr, kmax_ptr, lo_ptr, hi_ptr,
    stride_kb, stride_kh, stride_kl, stride_kd,
    L, P, page_size,
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False, BT=None, stride_tb: tl.constexpr = 0, PAGED: tl.constexpr = False,
    BLOCK_SIZE: tl.constexpr = 1,
):
    """Bounds of BLOCK_P pages of one (b, KV head) row: a [BLOCK_P, BLOCK_S, BLOCK_D]
    tile (BLOCK_S >= page_size) reduced over its token axis; page ``p`` holds the
    positions ``lo + p * page_size + s`` (relative pages), those below ``hi``. PAGED:
    ``k_ptr`` is a pool [num_blocks, HKV, BLOCK_SIZE, D] and each token is read
    through the block table ``BT`` (positions and L stay logical; a page may span
    blocks)."""
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    row = tl.program_id(0)
    pblk = tl.program_id(1)
    b = row // HKV
    h = row % HKV
    lo = tl.load(lo_ptr + b).to(tl.int32)
    hi = tl.minimum(tl.load(hi_ptr + b).to(tl.int32), L)
    offs_p = pblk * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    tok = lo + offs_p[:, None] * page_size + offs_s[None, :]  # [BLOCK_P, BLOCK_S] positions (>= lo)
    tmask = (offs_s[None, :] < page_size) & (tok < hi)
    mask = tmask[:, :, None] & (offs_d[None, None, :] < D)
    if PAGED:  # one load of the whole tile: no loop, so the table is read right here
        slot = paged_slots(tl.where(tmask, tok, -1), BT + b.to(tl.int64) * stride_tb, BLOCK_SIZE).to(tl.int64)
        rows = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kl  # [BLOCK_P, BLOCK_S]
        x = tl.load(k_ptr + h.to(tl.int64) * stride_kh + rows[:, :, None] + offs_d[None, None, :] * stride_kd,
                    mask=mask, other=0.0).to(tl.float32)
    else:
        base = k_ptr + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
        x = tl.load(base + tok[:, :, None].to(tl.int64) * stride_kl + offs_d[None, None, :] * stride_kd,
                    mask=mask, other=0.0).to(tl.float32)  # exact; the interpreter has no bf16 constants
    kmn = tl.min(tl.where(mask, x, float("inf")), axis=1)  # [BLOCK_P, BLOCK_D]
    kmx = tl.max(tl.where(mask, x, float("-inf")), axis=1)
    out = (row.to(tl.int64) * P + offs_p[:, None]) * D + offs_d[None, :]
    omask = (offs_p[:, None] < P) & (offs_d[None, :] < D)
    tl.store(kmin_ptr + out, kmn.to(kmin_ptr.dtype.element_ty), mask=omask)
    tl.store(kmax_ptr + out, kmx.to(kmax_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _quest_update_kernel(
    kmin_ptr, kmax_ptr, knew_ptr, pos_ptr, start_ptr,
    stride_mb, stride_mh, stride_mp, stride_md,
    stride_nb, stride_nh, stride_nd,
    P, page_size,
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_START: tl.constexpr = False,
    PDL: tl.constexpr = False, BT=None, stride_tb: tl.constexpr = 0, PAGED: tl.constexpr = False,
    BLOCK_SIZE: tl.constexpr = 1,
):
    """Fold ``k_new[b, h]`` into the bounds of the page holding ``pos[b]``, relative to
    ``start[b]`` with HAS_START. PAGED: pool bounds (module doc), the page's slot in the
    block of its first position, read from the table ``BT``; ``P`` is then the table's
    capacity in tokens."""
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    row = tl.program_id(0)
    b = row // HKV
    h = row % HKV
    pos = tl.load(pos_ptr + b).to(tl.int64)
    rel = pos
    if HAS_START:
        rel = pos - tl.load(start_ptr + b).to(tl.int64)
    page = rel // page_size
    first = (rel % page_size) == 0
    offs_d = tl.arange(0, BLOCK_D)
    if PAGED:
        pos0 = pos - rel % page_size  # the page's first position
        ok = (rel >= 0) & (pos0 < P)
        blk = tl.load(BT + b.to(tl.int64) * stride_tb + tl.where(ok, pos0, 0) // BLOCK_SIZE, mask=ok, other=0)
        off = blk.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh \
            + ((pos0 % BLOCK_SIZE) // page_size) * stride_mp + offs_d * stride_md
    else:
        ok = (rel >= 0) & (page < P)
        off = b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh + page * stride_mp + offs_d * stride_md
    dmask = (offs_d < D) & ok
    kn = tl.load(knew_ptr + b.to(tl.int64) * stride_nb + h.to(tl.int64) * stride_nh + offs_d * stride_nd,
                 mask=dmask, other=0.0).to(kmin_ptr.dtype.element_ty)
    cur_min = tl.load(kmin_ptr + off, mask=dmask, other=0.0)
    cur_max = tl.load(kmax_ptr + off, mask=dmask, other=0.0)
    tl.store(kmin_ptr + off, tl.where(first, kn, tl.minimum(cur_min, kn)), mask=dmask)
    tl.store(kmax_ptr + off, tl.where(first, kn, tl.maximum(cur_max, kn)), mask=dmask)


@triton.jit
def _quest_score_tile(q_pos, q_neg, kmin_ptr, kmax_ptr, out_ptr, mbase, orow, p0, lo, hi, P, scale, offs_d,
                      g_mask, d_mask, stride_mp, stride_md, BLOCK_P: tl.constexpr, REDUCE: tl.constexpr,
                      UPCAST: tl.constexpr, IEEE: tl.constexpr, bt_row=None, start=0, page_size=1,
                      stride_mb=0, PAGED: tl.constexpr = False, BLOCK_SIZE: tl.constexpr = 1):
    """Bounds of the BLOCK_P pages from ``p0``: ``q⁺·kmax + q⁻·kmin`` as two
    [G_PAD, D] x [D, BLOCK_P] dots, then the group reduction; stored at ``orow``.
    PAGED: each page's bounds at its slot of pool bounds (module doc), the block of
    its first position ``start + p·page_size`` read from ``bt_row``."""
    offs_p = p0 + tl.arange(0, BLOCK_P)
    valid = (offs_p >= lo) & (offs_p < hi) & (offs_p < P)
    if PAGED:
        pos0 = start + offs_p * page_size
        blk = tl.load(bt_row + tl.where(valid, pos0, 0) // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        prow = blk * stride_mb + ((pos0 % BLOCK_SIZE) // page_size).to(tl.int64) * stride_mp  # [BLOCK_P]
    else:
        prow = offs_p.to(tl.int64) * stride_mp
    moff = mbase + prow[:, None] + offs_d[None, :] * stride_md
    mmask = valid[:, None] & d_mask[None, :]
    # out-of-range pages may hold +-inf (empty pages): load zeros there instead (0 * inf = NaN)
    kmx = tl.load(kmax_ptr + moff, mask=mmask, other=0.0)  # [BLOCK_P, BLOCK_D]
    kmn = tl.load(kmin_ptr + moff, mask=mmask, other=0.0)
    if UPCAST:
        kmx = kmx.to(tl.float32)
        kmn = kmn.to(tl.float32)
    if IEEE:
        s = tl.dot(q_pos, tl.trans(kmx), input_precision="ieee")
        s = tl.dot(q_neg, tl.trans(kmn), acc=s, input_precision="ieee")
    else:
        s = tl.dot(q_pos, tl.trans(kmx))
        s = tl.dot(q_neg, tl.trans(kmn), acc=s)
    s = s * scale  # [G_PAD, BLOCK_P]
    if REDUCE == 0:
        r = tl.sum(tl.where(g_mask[:, None], s, 0.0), axis=0)
    else:
        r = tl.max(tl.where(g_mask[:, None], s, float("-inf")), axis=0)
    r = tl.where(valid, r, float("-inf"))
    tl.store(out_ptr + orow + offs_p, r, mask=offs_p < P)


@triton.jit
def _quest_scores_kernel(
    q_ptr, kmin_ptr, kmax_ptr, out_ptr, lo_ptr, hi_ptr, plan_ptr,
    stride_qb, stride_qh, stride_qd,
    stride_mb, stride_mh, stride_mp, stride_md,
    P, B, CHUNK, page_size, scale,
    HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr, REDUCE: tl.constexpr, HAS_LO: tl.constexpr, FROM_LENS: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False,
    BT=None, stride_tb: tl.constexpr = 0, PAGED: tl.constexpr = False, BLOCK_SIZE: tl.constexpr = 1,
):
    """Page bounds of CHUNK pages (whole BLOCK_P tiles) of one (b, KV head) row.

    A program loops over its tiles so the compiler can keep the next tiles'
    metadata loads in flight (software pipelining) while the current one is in
    the tensor cores; the query's positive / negative parts are loaded once per
    program. With FROM_LENS, ``hi_ptr`` / ``lo_ptr`` hold token lengths / starts
    and the page range is derived here (``quest_select``'s plan), and program
    (b, h=0, chunk 0) also writes the top-K candidate range of row ``b`` into
    ``plan_ptr`` ([2, B]: first page, end of the pages before the last one), so
    the selection needs no separate plan launch. PAGED (FROM_LENS only): pool bounds
    (module doc) read through the block table ``BT``."""
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    row = tl.program_id(0)
    pblk = tl.program_id(1)
    b = row // HKV
    h = row % HKV
    if FROM_LENS:
        # an empty row gets an empty page range (its bounds are +-inf: no score, no NaN)
        lo, hi, kv, start = _row_pages(hi_ptr, lo_ptr, b, page_size, HAS_LO)
        first = (h == 0) & (pblk == 0)
        tl.store(plan_ptr + b, lo, mask=first)
        tl.store(plan_ptr + B + b, tl.maximum(hi - 1, lo), mask=first)
    else:
        hi = tl.load(hi_ptr + b).to(tl.int32)
        if HAS_LO:
            lo = tl.load(lo_ptr + b).to(tl.int32)
        else:
            lo = 0
        start = 0
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < G
    d_mask = offs_d < D
    qb = q_ptr + b.to(tl.int64) * stride_qb + (h * G).to(tl.int64) * stride_qh
    q = tl.load(qb + offs_g[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [G_PAD, BLOCK_D]
    zero = tl.zeros_like(q)
    qf = q.to(tl.float32)  # NOTE: compare in fp32: the interpreter compares bf16 as raw bits
    q_pos = tl.where(qf > 0, q, zero)  # stays in q's dtype (tensor-core operands)
    q_neg = tl.where(qf < 0, q, zero)
    if UPCAST:
        q_pos = q_pos.to(tl.float32)
        q_neg = q_neg.to(tl.float32)
    if PAGED:
        mbase = h.to(tl.int64) * stride_mh
        bt_row = BT + b.to(tl.int64) * stride_tb
    else:
        mbase = b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
        bt_row = BT
    orow = row.to(tl.int64) * P
    p_start = pblk * CHUNK
    p_end = tl.minimum(p_start + CHUNK, P)
    for p0 in range(loop_bound(p_start, INTERPRET), loop_bound(p_end, INTERPRET), BLOCK_P):
        _quest_score_tile(q_pos, q_neg, kmin_ptr, kmax_ptr, out_ptr, mbase, orow, p0, lo, hi, P, scale,
                          offs_d, g_mask, d_mask, stride_mp, stride_md, BLOCK_P, REDUCE, UPCAST, IEEE,
                          bt_row, start, page_size, stride_mb, PAGED, BLOCK_SIZE)


@triton.jit
def _quest_expand_kernel(
    sel_ptr, out_ptr, start_ptr, kv_ptr, page_size, n_sel, n_out,
    HKV: tl.constexpr, BLOCK: tl.constexpr, HAS_START: tl.constexpr, PDL: tl.constexpr = False,
):
    """Token slots of one (b, KV head): slot ``i * page_size + j`` holds token ``j`` of
    page ``i`` (page 0 = the last page, then the selected ones), i.e. the position
    ``start + page * page_size + j`` (relative pages); ``-1`` at or past ``kv`` or for
    empty page slots. ``n_out`` = n_sel * page_size."""
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    row = tl.program_id(0)
    blk = tl.program_id(1)
    b = row // HKV
    if HAS_START:
        start = tl.load(start_ptr + b).to(tl.int32)
    else:
        start = 0
    kv = tl.load(kv_ptr + b).to(tl.int32)
    has = kv > start
    last = tl.where(has, (kv - start + page_size - 1) // page_size - 1, -1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    i = offs // page_size
    j = offs % page_size
    m = offs < n_out
    sel = tl.load(sel_ptr + row.to(tl.int64) * (n_sel - 1) + (i - 1), mask=m & (i > 0), other=-1)
    page = tl.where(i == 0, last, sel)
    tok = start + page * page_size + j
    ok = (page >= 0) & (tok < kv)
    tl.store(out_ptr + row.to(tl.int64) * n_out + offs, tl.where(ok, tok, -1), mask=m)


@triton.jit
def _row_tile_keys(srow, l0, lo, hi, BLOCK: tl.constexpr):
    """Order-preserving uint32 keys of the page scores [l0, l0 + BLOCK) and which of
    them are candidates ``[lo, hi)``."""
    offs = l0 + tl.arange(0, BLOCK)
    valid = (offs >= lo) & (offs < hi)
    key = radix_topk._f32_key(tl.load(srow + offs, mask=valid, other=0.0))
    return offs, key, valid


@triton.jit
def _quest_row_select_kernel(
    scores_ptr, out_ptr, pages_ptr, start_ptr, kv_ptr, P, page_size, n_sel, n_out,
    HKV: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, PS_PAD: tl.constexpr,
    HAS_START: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False,
):
    """Top pages and their token indices for one (b, KV head) row, in one program.

    A row has only P = L / page_size scores (2k at 32k tokens, page 16), so one
    program can run the exact radix select itself: four 8-bit digit passes of
    ``tl.histogram`` over the row (L2-resident after the score kernel wrote it),
    then one ordered pass that writes the winners' page numbers to a per-row
    scratch ``pages_ptr`` [rows, n_sel - 1] (pages above the threshold key first,
    then the first ties in position order, so ties are deterministic), then their
    expansion to tokens. No global histograms, workspace memset or atomics, and
    the expansion is fused: with the score kernel, Quest select is two launches
    instead of seven. Slot 0 holds the last page."""
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    row = tl.program_id(0)
    b = row // HKV
    row64 = row.to(tl.int64)
    page_lo, n_pages, kv, start = _row_pages(kv_ptr, start_ptr, b, page_size, HAS_START)
    has = kv > start
    last = tl.where(has, n_pages - 1, -1)
    cand_hi = tl.maximum(n_pages - 1, page_lo)  # candidates: [page_lo, last)
    k_eff = tl.minimum(tl.maximum(cand_hi - page_lo, 0), n_sel - 1)
    srow = scores_ptr + row64 * P
    orow = out_ptr + row64 * n_out
    offs_j = tl.arange(0, PS_PAD)
    j_mask = offs_j < page_size

    # slot 0: the last (partial) page
    tok = start + last * page_size + offs_j
    ok = (last >= 0) & (tok < kv)
    tl.store(orow + offs_j, tl.where(ok, tok, -1), mask=j_mask)

    t_start = (page_lo // BLOCK) * BLOCK
    t_end = tl.where(k_eff > 0, cand_hi, t_start)  # nothing to select: no pass reads the row
    prefix = tl.full([], 0, tl.uint32)
    k_rem = k_eff
    for p in tl.static_range(4):
        acc = tl.zeros([256], dtype=tl.int32)
        for l0 in range(loop_bound(t_start, INTERPRET), loop_bound(t_end, INTERPRET), BLOCK):
            offs, key, valid = _row_tile_keys(srow, l0, page_lo, cand_hi, BLOCK)
            if p > 0:
                valid = valid & ((key >> (32 - 8 * p)) == (prefix >> (32 - 8 * p)))
            acc += tl.histogram(((key >> (24 - 8 * p)) & 0xFF).to(tl.int32), 256, mask=valid)
        d, k_rem = radix_topk._pick_digit(acc, k_rem)
        prefix = prefix | (d.to(tl.uint32) << (24 - 8 * p))
    # prefix is now the key of the k_eff-th best page: k_eff - k_rem pages beat it,
    # and the first k_rem pages equal to it fill the remaining slots
    # Emission in two steps: the winners' page numbers go to this row's scratch in
    # one more BLOCK-wide pass (slots from running counts), then only those k_eff
    # pages are expanded to tokens ([BLOCK_E, PS_PAD] tiles), so the expansion's
    # cost follows the selection size, not the row length.
    n_gt = k_rem * 0
    n_eq = k_eff - k_rem
    prow = pages_ptr + row64 * (n_sel - 1)
    for l0 in range(loop_bound(t_start, INTERPRET), loop_bound(t_end, INTERPRET), BLOCK):
        n_gt, n_eq = _emit_pages(srow, prow, l0, page_lo, cand_hi, prefix, n_gt, n_eq, k_eff, BLOCK)
    tl.debug_barrier()  # the scratch was written by other threads of this program
    for e0 in range(0, loop_bound(k_eff, INTERPRET), BLOCK_E):
        _expand_pages(prow, orow, e0, k_eff, start, page_size, offs_j, j_mask, BLOCK_E)
    # slots of pages that do not exist (fewer candidates than n_sel - 1): -1
    s0 = (1 + k_eff) * page_size
    for t0 in range(loop_bound((s0 // BLOCK) * BLOCK, INTERPRET), loop_bound(n_out, INTERPRET), BLOCK):
        o = t0 + tl.arange(0, BLOCK)
        tl.store(orow + o, tl.full([BLOCK], -1, tl.int32), mask=(o >= s0) & (o < n_out))


@triton.jit
def _emit_pages(srow, prow, l0, lo, hi, thr, n_gt, n_eq, k_eff, BLOCK: tl.constexpr):
    """Write the winning page numbers of one tile to their slots of the row's scratch
    (pages above the threshold key at ``n_gt + rank``, the ties at ``n_eq + rank``
    while below k_eff); returns the updated running counts."""
    offs, key, valid = _row_tile_keys(srow, l0, lo, hi, BLOCK)
    is_gt = (valid & (key > thr)).to(tl.int32)
    is_eq = (valid & (key == thr)).to(tl.int32)
    s_gt = n_gt + tl.cumsum(is_gt, axis=0) - 1
    s_eq = n_eq + tl.cumsum(is_eq, axis=0) - 1
    slot = tl.where(is_gt != 0, s_gt, s_eq)
    take = ((is_gt != 0) | (is_eq != 0)) & (slot < k_eff)
    tl.store(prow + slot, offs, mask=take)
    return n_gt + tl.sum(is_gt, axis=0), n_eq + tl.sum(is_eq, axis=0)


@triton.jit
def _expand_pages(prow, orow, e0, k_eff, start, page_size, offs_j, j_mask, BLOCK_E: tl.constexpr):
    """Tokens of selected pages ``e0 .. e0 + BLOCK_E`` into output slots 1 + i: the
    positions ``start + page * page_size + j`` (relative pages; candidates end before
    the last page, so every one is below kv)."""
    sl = e0 + tl.arange(0, BLOCK_E)
    m = sl < k_eff
    page = tl.load(prow + sl, mask=m, other=0)
    tok = start + page[:, None] * page_size + offs_j[None, :]  # [BLOCK_E, PS_PAD]
    dst = orow + (1 + sl)[:, None].to(tl.int64) * page_size + offs_j[None, :]
    tl.store(dst, tok, mask=m[:, None] & j_mask[None, :])


# ----------------------------------------------------------------------------------------------
# Triton launchers
# ----------------------------------------------------------------------------------------------


def quest_build_triton(k: torch.Tensor, kv_lens: torch.Tensor, page_size: int, *,
                       kv_start: torch.Tensor | None = None,
                       block_table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``quest_build``: reads the valid keys once (through ``block_table`` when
    ``k`` is a pool, as in ``quest_build_ref``)."""
    _check_page_size(page_size)
    _check_paged_build(k, kv_lens, block_table)
    B, H, L, D = k.shape
    if block_table is not None:
        B, L = block_table.shape[0], block_table.shape[1] * k.shape[2]
    paged = paged_launch(block_table, k.shape[2])
    P = triton.cdiv(L, page_size)
    kv_lens = _check_rows(kv_lens, B, "kv_lens", k.device)
    kmin = torch.empty(B, H, P, D, dtype=k.dtype, device=k.device)
    kmax = torch.empty_like(kmin)
    if B * H * P == 0:
        return kmin, kmax
    start = torch.zeros_like(kv_lens) if kv_start is None else _check_rows(kv_start, B, "kv_start", k.device)
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_S = triton.next_power_of_2(page_size)
    budget = 1 << 15 if _interpret() else 1 << 13  # elements per tile
    BLOCK_P = max(1, min(triton.next_power_of_2(P), budget // (BLOCK_S * BLOCK_D)))
    grid = (B * H, triton.cdiv(P, BLOCK_P))
    _quest_build_kernel[grid](k, kmin, kmax, start, kv_lens, k.stride(0), k.stride(1), k.stride(2), k.stride(3),
                              L, P, page_size, HKV=H, D=D, BLOCK_D=BLOCK_D, BLOCK_P=BLOCK_P, BLOCK_S=BLOCK_S,
                              num_warps=4, **pdl_kwargs(k, "select"), **paged)
    return kmin, kmax


def quest_update_triton(kmin: torch.Tensor, kmax: torch.Tensor, k_new: torch.Tensor, pos: torch.Tensor,
                        page_size: int, *, kv_start: torch.Tensor | None = None,
                        block_table: torch.Tensor | None = None, block_size: int | None = None) -> None:
    """Triton ``quest_update`` (in place; as ``quest_update_ref``, pages relative to
    ``kv_start``; positions outside the bounds' pages are ignored). ``block_table``:
    pool bounds (module doc)."""
    _check_page_size(page_size)
    if block_table is not None:
        B, _, H, _, D = _check_pool_bounds(None, kmin, kmax, block_table, page_size, block_size)
        P = block_table.shape[1] * block_size  # the kernel's bound: the table's capacity in tokens
    else:
        B, H, P, D = kmin.shape
        if kmax.shape != kmin.shape or kmax.stride() != kmin.stride():
            raise ValueError("kmin and kmax must have the same shape and strides")
    paged = paged_launch(block_table, block_size)
    if k_new.shape != (B, H, D):
        raise ValueError(f"k_new must be [{B}, {H}, {D}], got {tuple(k_new.shape)}")
    pos = _check_rows(pos, B, "pos", kmin.device)
    if kv_start is not None:
        kv_start = _check_rows(kv_start, B, "kv_start", kmin.device)
    if B * H == 0:
        return
    _quest_update_kernel[(B * H,)](
        kmin, kmax, k_new, pos, kv_start if kv_start is not None else pos,
        kmin.stride(0), kmin.stride(1), kmin.stride(2), kmin.stride(3),
        k_new.stride(0), k_new.stride(1), k_new.stride(2), P, page_size,
        HKV=H, D=D, BLOCK_D=triton.next_power_of_2(D), HAS_START=kv_start is not None, num_warps=1,
        **pdl_kwargs(kmin, "select"), **paged)


QUEST_CONFIG: dict = {}
"""Overrides for the page-score kernel's launch config (``BLOCK_P`` pages per tile,
``TILES`` tiles per program, ``PER_SM`` target programs per SM when TILES is not
given, ``num_warps``, ``num_stages``); empty = the built-in heuristic. The
benchmark (``python -m benchmarks.kernels --sweep``) sweeps it."""


def _scores_config(P: int, rows: int, BLOCK_D: int, device: torch.device) -> dict:
    """Launch config of the page-score kernel: (BLOCK_P, CHUNK pages per program,
    num_warps, num_stages).

    Page scoring reads 2·P·D metadata elements per row and does little math, so it
    is bound by HBM bandwidth: the grid should keep every SM streaming with
    several tiles in flight. One tile per program (the earlier kernel) left no
    loop to pipeline, so each program waited for its loads; now a program loops
    over a few tiles (about PER_SM programs per SM) and the compiler overlaps the
    next tiles' loads with the current dots."""
    if _interpret() or device.type != "cuda":
        # the interpreter pays per op, not per element: few, large tiles
        cfg = dict(BLOCK_P=min(256, max(16, triton.next_power_of_2(P))), PER_SM=4, num_warps=4, num_stages=1)
    else:
        cfg = dict(BLOCK_P=64 if BLOCK_D <= 128 else 32, PER_SM=4, num_warps=4, num_stages=3)
    cfg.update(QUEST_CONFIG)
    bp = int(cfg["BLOCK_P"])
    tiles_row = triton.cdiv(P, bp)
    if "TILES" in cfg:
        tiles = max(1, int(cfg["TILES"]))
    else:
        target = int(cfg["PER_SM"]) * _sm_count(device)
        tiles = max(1, (rows * tiles_row) // max(target, 1))
    tiles = min(tiles, tiles_row)
    return dict(BLOCK_P=bp, CHUNK=tiles * bp, num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]))


def _launch_page_scores(q, kmin, kmax, out, hi, lo, *, scale, reduce, plan=None, page_size=1,
                        block_table=None, block_size=None) -> None:
    """Launch the page-score kernel. ``hi``/``lo`` are page bounds [B] (``lo`` may be
    None), or with ``plan`` given token lengths / starts from which the kernel
    derives the page range and writes the selection plan (see the kernel).
    ``block_table`` (with ``plan`` only): pool bounds (module doc)."""
    paged = paged_launch(block_table, block_size)
    if block_table is not None:
        B, Hq, Hkv, P, D = _check_pool_bounds(q, kmin, kmax, block_table, page_size, block_size)
        assert plan is not None, "pool bounds are scored from token lengths (plan=)"
    else:
        B, Hq, Hkv, P, D = _check_bounds(q, kmin, kmax)
    if kmax.stride() != kmin.stride():
        raise ValueError("kmin and kmax must have the same strides")
    G = Hq // Hkv
    qr = _round_q(q, kmin)
    upcast = _interpret()
    ieee = kmin.dtype == torch.float32 and not upcast
    BLOCK_D = max(16, triton.next_power_of_2(D))
    cfg = _scores_config(P, B * Hkv, BLOCK_D, kmin.device)
    grid = (B * Hkv, triton.cdiv(P, cfg["CHUNK"]))
    lo_t = lo if lo is not None else hi
    _quest_scores_kernel[grid](
        qr, kmin, kmax, out, lo_t, hi, plan if plan is not None else out, qr.stride(0), qr.stride(1), qr.stride(2),
        kmin.stride(0), kmin.stride(1), kmin.stride(2), kmin.stride(3), P, B, cfg["CHUNK"], page_size, scale,
        HKV=Hkv, G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, BLOCK_D=BLOCK_D, BLOCK_P=cfg["BLOCK_P"],
        REDUCE=0 if reduce == "sum_logits" else 1, HAS_LO=lo is not None, FROM_LENS=plan is not None,
        UPCAST=upcast, IEEE=ieee, INTERPRET=_interpret(), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **pdl_kwargs(qr, "select"), **paged)


def quest_page_scores_triton(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, n_pages: torch.Tensor, *,
                             scale: float | None = None, reduce: str = "sum_logits",
                             page_start: torch.Tensor | None = None) -> torch.Tensor:
    """Triton ``quest_page_scores``: [B, Hkv, P] float32."""
    _check_reduce(reduce)
    B, Hq, Hkv, P, D = _check_bounds(q, kmin, kmax)
    out = torch.empty(B, Hkv, P, dtype=torch.float32, device=kmin.device)
    if B * Hkv * P == 0:
        return out
    n_pages = _check_rows(n_pages, B, "n_pages", kmin.device)
    if page_start is not None:
        page_start = _check_rows(page_start, B, "page_start", kmin.device)
    _launch_page_scores(q, kmin, kmax, out, n_pages, page_start, scale=_default_scale(scale, D), reduce=reduce)
    return out


def quest_select_triton(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, kv_lens: torch.Tensor,
                        n_pages_sel: int, page_size: int, *, scale: float | None = None,
                        reduce: str = "sum_logits", kv_start: torch.Tensor | None = None,
                        impl: str = "rowselect", block_table: torch.Tensor | None = None,
                        block_size: int | None = None) -> torch.Tensor:
    """Triton ``quest_select``: page scores, exact top-(n_pages_sel - 1) of the pages
    before the last one, then expansion to token indices (last page first).

    ``impl`` (all exact, same contract; the benchmark compares them):

    * ``"radix"``: the page-score kernel also derives each row's page
      range and writes the top-K's candidate range, then the multi-program radix
      top-K of ``spade.kernels.radix_topk`` and an expansion kernel (6 launches);
    * ``"rowselect"``: the page-score kernel, then one program per (b, KV head)
      runs the whole radix select on its row and writes the tokens
      (``_quest_row_select_kernel``; 2 launches). The default: fewest launches,
      and the fastest of the three it was measured against at every shape of the kernels benchmark on an
      H200 (graph replay: 0.042 vs 0.061 ms at B=8 L=32k, 0.098 vs 0.115 ms
      at B=32 L=32k, 0.050 vs 0.060 ms at B=1 L=128k; equal at B=32 L=128k).

    No host synchronisation.

    Why the select once measured 2.6x slower than before (0.468 vs 0.179 ms) after
    the plan kernel came in (8abee53): its torch baseline, which that change does
    not touch, slowed down by about the same factor (0.317 -> 0.749 ms), and so
    did the page-score kernel (0.027 -> 0.046 ms) that it does not touch either.
    The op is a chain of ~7 short launches, so its time follows launch and
    scheduling latency, which differed between the two runs' machines; the plan
    kernel only added one launch (and removed a few tiny torch ops). The cure is
    fewer launches (``radix``: the plan inside the score kernel; ``rowselect``:
    two in all) and timing from a CUDA graph, which the benchmark reports next to
    the eager time. (The plan-launch path, ``radix_plan``, is removed: docs/tried.md.)

    ``block_table`` / ``block_size``: pool bounds (module doc); only the page-score
    kernel reads them, through the table, and P is the table's capacity in pages.
    """
    _check_reduce(reduce)
    _check_page_size(page_size)
    if n_pages_sel < 1:
        raise ValueError(f"n_pages_sel must be >= 1, got {n_pages_sel}")
    if impl not in ("radix", "rowselect"):
        raise ValueError(f"impl must be 'radix' or 'rowselect', got {impl!r}")
    paged = {}
    if block_table is not None:
        B, Hq, Hkv, P, D = _check_pool_bounds(q, kmin, kmax, block_table, page_size, block_size)
        paged = dict(block_table=block_table, block_size=block_size)
    else:
        B, Hq, Hkv, P, D = _check_bounds(q, kmin, kmax)
    n_out = n_pages_sel * page_size
    out = torch.empty(B, Hkv, n_out, dtype=torch.int32, device=kmin.device)
    if B * Hkv == 0:
        return out
    kv_lens = _check_rows(kv_lens, B, "kv_lens", kmin.device)
    if kv_start is not None:
        kv_start = _check_rows(kv_start, B, "kv_start", kmin.device)
    start_t = kv_start if kv_start is not None else kv_lens  # the kernels read it only with a start
    scale = _default_scale(scale, D)
    if impl == "rowselect":
        scores = torch.empty(B, Hkv, P, dtype=torch.float32, device=kmin.device)
        if n_pages_sel > 1:
            cand = torch.empty(2, B, dtype=torch.int32, device=kmin.device)  # written, not needed here
            _launch_page_scores(q, kmin, kmax, scores, kv_lens, kv_start, scale=scale, reduce=reduce, plan=cand,
                                page_size=page_size, **paged)
        cfg = _row_select_config(P, kmin.device)
        pages = torch.empty(B * Hkv, max(1, n_pages_sel - 1), dtype=torch.int32, device=kmin.device)  # scratch
        _quest_row_select_kernel[(B * Hkv,)](
            scores, out, pages, start_t, kv_lens, P, page_size, n_pages_sel, n_out, HKV=Hkv, BLOCK=cfg["BLOCK"],
            BLOCK_E=cfg["BLOCK_E"], PS_PAD=triton.next_power_of_2(page_size), HAS_START=kv_start is not None,
            INTERPRET=_interpret(), num_warps=cfg["num_warps"], **pdl_kwargs(scores, "select"))
        return out
    if n_pages_sel > 1:
        scores = torch.empty(B, Hkv, P, dtype=torch.float32, device=kmin.device)
        cand = torch.empty(2, B, dtype=torch.int32, device=kmin.device)  # page_lo, cand_hi
        _launch_page_scores(q, kmin, kmax, scores, kv_lens, kv_start, scale=scale, reduce=reduce, plan=cand,
                            page_size=page_size, **paged)
        page_lo, cand_hi = cand.unbind(0)
        sel = radix_topk.topk_from_scores_triton(scores, page_lo, cand_hi, n_pages_sel - 1)
    else:
        sel = out  # never read: n_sel - 1 == 0 slots
    BLOCK = min(1024, triton.next_power_of_2(n_out))
    _quest_expand_kernel[(B * Hkv, triton.cdiv(n_out, BLOCK))](
        sel, out, start_t, kv_lens, page_size, n_pages_sel, n_out, HKV=Hkv, BLOCK=BLOCK,
        HAS_START=kv_start is not None, num_warps=4, **pdl_kwargs(sel, "select"))
    return out


def _row_select_config(P: int, device: torch.device) -> dict:
    """Tiles of ``_quest_row_select_kernel``: digit and emission passes read BLOCK page
    scores at a time (a whole row of up to 4k pages in one tile on a GPU, so each
    pass is one load and one histogram), the expansion BLOCK_E selected pages
    (each a [BLOCK_E, page_size] token tile). Overridable through ``QUEST_CONFIG``
    (``SEL_BLOCK``, ``SEL_BLOCK_E``, ``SEL_WARPS``)."""
    if _interpret() or device.type != "cuda":
        cfg = dict(BLOCK=min(256, max(16, triton.next_power_of_2(P))), BLOCK_E=64, num_warps=4)
    else:
        cfg = dict(BLOCK=min(4096, max(256, triton.next_power_of_2(P))), BLOCK_E=128, num_warps=8)
    for k in ("BLOCK", "BLOCK_E"):
        cfg[k] = int(QUEST_CONFIG.get(f"SEL_{k}", cfg[k]))
    cfg["num_warps"] = int(QUEST_CONFIG.get("SEL_WARPS", cfg["num_warps"]))
    return cfg

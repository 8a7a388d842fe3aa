"""Hierarchical (page-prefiltered) top-K: page bounds first, then tokens inside the best pages.

At long contexts the budget K is a tiny fraction of the cache, yet a token-level scan
reads every cached key each step. The prefilter reads far fewer bytes:

1. *Level 1 (pages)*: a summary of every ``page_size`` tokens per (row, KV head) is
   scored with the query, and the ``n_pages`` best pages of the middle range ``[lo, hi)``
   are kept. Two summaries:

   * ``mean``: the mean of the page's valid keys ([B, Hkv, P, D], ``page_means``; kept
     up to date by ``page_means_update`` from exact fp32 sums). Scored as keys are,
     ``scale · q_g · mean``, reduced over the group: the fused scoring + radix top-K of
     ``spade.kernels.scoring`` with the pages as the "tokens".
   * ``bounds``: Quest's element-wise min / max of the page's keys
     (``spade.kernels.quest``), scored by the upper bound ``Σ_d max(q_d·min_d, q_d·max_d)``
     per head; then the radix top-K of ``spade.kernels.radix_topk``.

   On SmolLM2-135M (8k tokens) the bounds kept more attention mass, the means more of
   the token-level top-K's tokens, at half the bytes (docs/policies.md).
2. *Level 2 (tokens)*: the tokens of those pages that lie in ``[lo, hi)`` are the
   candidates (``n_pages * page_size`` per row and head, ``-1`` elsewhere); they are
   scored on the selection's key copy (exact, int8 or packed int4, with its per-token
   scales) with the same group reduction as the token-level scan, and the ``k_top``
   best are returned as int32 [B, Hkv, k_top] token positions, ``-1`` padding.

``sum_softmax`` normalises each head over the candidates plus the extra positions
``norm_pos`` (the caller passes the sinks and the recent window of the row's
normaliser range): when the pages cover the whole middle that is the token-level
normaliser exactly, so the selection is the token-level one; otherwise it is the
normaliser restricted to what was read.

Bytes per (row, KV head): level 1 reads ``D`` (mean) or ``2 · D`` (bounds) elements
per page (``2 · D / page_size`` bytes per token in bf16 for the mean: 8 B at D=128,
page 32, an eighth of an int4 copy's 64), level 2 ``n_pages · page_size`` keys of the
copy.

Level 1 dispatches like the rest of the suite (Triton kernels on CUDA, the torch
references elsewhere). Level 2 is plain torch ops on the device (an
index gather of the candidates' rows, one batched product, ``torch.topk``): fixed
shapes, no host sync, so it is captured in a CUDA graph; ``prefilter_select_ref`` is
the same computation written without the level-1 kernels, the reference the tests
hold both paths to. Every op is sized from tensor shapes only.
"""

from __future__ import annotations

import torch

from spade.kernels.common import _check_rows
from spade.kernels.quest import quest_page_scores_ref, quest_page_scores_triton
from spade.kernels.radix_topk import topk_from_scores_ref, topk_from_scores_triton
from spade.kernels.scoring import _default_scale, _group_logits_ref, score_topk_ref, score_topk_triton

__all__ = [
    "SUMMARIES",
    "page_counts",
    "page_sums",
    "page_means_update",
    "page_range",
    "pages_to_candidates",
    "norm_positions",
    "candidate_topk",
    "best_pages",
    "prefilter_select_ref",
    "prefilter_select",
    "prefilter_bytes",
]

SUMMARIES = ("mean", "bounds")
_REDUCES = ("sum_logits", "max_logits", "sum_softmax")
_PAGE_REDUCES = ("sum_logits", "max_logits")


def _check(page_size: int, n_pages: int, k_top: int, reduce: str, page_reduce: str) -> None:
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")
    if n_pages <= 0:
        raise ValueError(f"n_pages must be > 0, got {n_pages}")
    if k_top < 0:
        raise ValueError(f"k_top must be >= 0, got {k_top}")
    if reduce not in _REDUCES:
        raise ValueError(f"reduce must be one of {_REDUCES}, got {reduce!r}")
    if page_reduce not in _PAGE_REDUCES:
        raise ValueError(f"page_reduce must be one of {_PAGE_REDUCES}, got {page_reduce!r}")


def page_counts(n_pages: int, page_size: int, kv_lens: torch.Tensor, kv_start: torch.Tensor | None) -> torch.Tensor:
    """Valid keys of each page, ``[kv_start, kv_lens)`` ∩ the page: int64 [B, n_pages]."""
    dev = kv_lens.device
    p0 = torch.arange(n_pages, device=dev, dtype=torch.int64)[None, :] * page_size
    s = torch.zeros_like(kv_lens, dtype=torch.int64) if kv_start is None else kv_start.to(dev, torch.int64)
    a = torch.maximum(p0, s[:, None])
    b = torch.minimum(p0 + page_size, kv_lens.long()[:, None])
    return (b - a).clamp_min(0)


def page_sums(k: torch.Tensor, kv_lens: torch.Tensor, page_size: int, *,
              kv_start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-page sums of the valid keys of ``k`` [B, Hkv, L, D] (fp32 [B, Hkv, P, D], P =
    ceil(L / page_size)) and their means in k's dtype (0 for a page without keys)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")
    B, H, L, D = k.shape
    P = -(-L // page_size)
    kv = kv_lens.to(k.device)
    pos = torch.arange(P * page_size, device=k.device)
    s = torch.zeros_like(kv) if kv_start is None else kv_start.to(k.device)
    valid = ((pos[None, :] >= s.long()[:, None]) & (pos[None, :] < kv.long()[:, None])).view(B, 1, P, page_size, 1)
    kp = torch.nn.functional.pad(k, (0, 0, 0, P * page_size - L)).view(B, H, P, page_size, D)
    sums = torch.where(valid, kp, torch.zeros((), dtype=k.dtype, device=k.device)).sum(3, dtype=torch.float32)
    n = page_counts(P, page_size, kv, kv_start).clamp_min(1)  # [B, P]
    return sums, (sums / n[:, None, :, None]).to(k.dtype)


def page_means_update(psum: torch.Tensor, pmean: torch.Tensor, k_new: torch.Tensor, pos: torch.Tensor,
                      page_size: int, kv_start: torch.Tensor | None = None) -> None:
    """In place: fold ``k_new`` [B, Hkv, D] written at positions ``pos`` [B] into the page
    sums ``psum`` (fp32) and means ``pmean`` [B, Hkv, P, D]; a page's first valid position
    (its start, or ``kv_start``) resets it. Device-side (no host sync)."""
    B = psum.shape[0]
    pos = pos.to(psum.device).long()
    page = pos // page_size  # [B]
    s = torch.zeros_like(pos) if kv_start is None else kv_start.to(psum.device).long()
    first_valid = torch.maximum(page * page_size, s)
    n = (pos - first_valid + 1).clamp_min(1)  # keys in the page with this one
    rows = torch.arange(B, device=psum.device)
    kn = k_new.float()
    cur = torch.where((n == 1)[:, None, None], torch.zeros_like(kn), psum[rows, :, page])
    new = cur + kn
    psum[rows, :, page] = new
    pmean[rows, :, page] = (new / n[:, None, None].float()).to(pmean.dtype)


def page_range(lo: torch.Tensor, hi: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages ``[p_lo, p_hi)`` that hold the middle ``[lo, hi)`` ([B] int64 each); an
    empty middle gives an empty page range (its edge page may hold no valid key, whose
    +inf / -inf bounds would score NaN)."""
    lo, hi = lo.long(), hi.long()
    p_lo = lo // page_size
    p_hi = torch.where(hi > lo, (hi + page_size - 1) // page_size, p_lo)
    return p_lo, p_hi


def pages_to_candidates(pages: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token positions of ``pages`` [B, Hkv, n] int32 (``-1``: no page): int32
    [B, Hkv, n * page_size], ``-1`` where the page is missing or the token lies outside
    ``[lo[b], hi[b])`` (edge pages hold sinks, recent or padded positions)."""
    B, H, n = pages.shape
    offs = torch.arange(page_size, device=pages.device, dtype=torch.int64)
    tok = pages.long()[..., None] * page_size + offs  # [B, H, n, page]
    ok = (pages[..., None] >= 0) & (tok >= lo.long().view(B, 1, 1, 1)) & (tok < hi.long().view(B, 1, 1, 1))
    return torch.where(ok, tok, -1).to(torch.int32).view(B, H, n * page_size)


def norm_positions(n_lo: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, n_hi: torch.Tensor,
                   n_before: int, n_after: int) -> torch.Tensor:
    """The ``sum_softmax`` normaliser's positions outside the middle: ``[n_lo, lo)`` (at most
    ``n_before``: the sinks) and ``[hi, n_hi)`` (at most ``n_after``: the recent window),
    int32 [B, n_before + n_after], ``-1`` for unused slots."""
    dev = lo.device
    a = n_lo.long()[:, None] + torch.arange(n_before, device=dev)
    a = torch.where(a < lo.long()[:, None], a, -1)
    b = hi.long()[:, None] + torch.arange(n_after, device=dev)
    b = torch.where(b < n_hi.long()[:, None], b, -1)
    return torch.cat([a, b], 1).to(torch.int32)


def _rows(t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``t`` [B, H, L, ...] at positions ``pos`` [B, H or 1, M] (``-1`` read as 0):
    [B, H, M, ...], an index gather of only those rows (any strides)."""
    B, H = t.shape[:2]
    p = pos.long().clamp_min(0).expand(B, H, pos.shape[2])
    bi = torch.arange(B, device=t.device).view(B, 1, 1)
    hi = torch.arange(H, device=t.device).view(1, H, 1)
    return t[bi, hi, p]


def candidate_topk(q: torch.Tensor, k: torch.Tensor, cand: torch.Tensor, k_top: int, *, scale: float | None = None,
                   reduce: str = "sum_logits", k_scale: torch.Tensor | None = None,
                   norm_pos: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Level 2: the ``k_top`` best of the candidates ``cand`` [B, Hkv, M] int32 (``-1``:
    none) scored by ``q`` [B, Hq, D] against ``k`` [B, Hkv, L, D] (float, int8, or packed
    int4 uint8 [.., D/2]) with ``k_scale`` [B, Hkv, L] for int8 / int4, the group reduced
    by ``reduce`` (``sum_softmax``: each head normalised over the candidates and
    ``norm_pos`` [B, E]). int32 [B, Hkv, k_top] token positions, ``-1`` padding; written
    to ``out`` when given."""
    B, Hkv, M = cand.shape
    if k.dim() != 4 or k.shape[:2] != (B, Hkv):
        raise ValueError(f"k {tuple(k.shape)} must be [B={B}, Hkv={Hkv}, L, D] as cand {tuple(cand.shape)}")
    if (k.dtype in (torch.uint8, torch.int8)) != (k_scale is not None):
        raise ValueError(f"k_scale is needed exactly for an int8 / int4 copy (k is {k.dtype})")
    D = q.shape[-1]
    sc = _default_scale(scale, D)
    valid = cand >= 0  # [B, Hkv, M]
    kg = _rows(k, cand)  # [B, Hkv, M, Dk]
    ksg = None if k_scale is None else _rows(k_scale, cand)  # [B, Hkv, M]
    logits = _group_logits_ref(q, kg, sc, ksg)  # [B, Hkv, G, M] fp32
    neg = float("-inf")  # a Python scalar: no host-to-device copy (illegal while a CUDA graph captures)
    if reduce == "sum_logits":
        s = logits.sum(2)
    elif reduce == "max_logits":
        s = logits.amax(2)
    else:
        lg = torch.where(valid[:, :, None, :], logits, neg)
        if norm_pos is not None and norm_pos.shape[1] > 0:
            npos = norm_pos.view(B, 1, -1)
            ke = _rows(k, npos)  # [B, Hkv, E, Dk]
            kse = None if k_scale is None else _rows(k_scale, npos)
            le = _group_logits_ref(q, ke, sc, kse)
            le = torch.where((npos >= 0)[:, :, None, :], le, neg)
            lse = torch.logsumexp(torch.cat([lg, le], -1), -1, keepdim=True)  # [B, Hkv, G, 1]
        else:
            lse = torch.logsumexp(lg, -1, keepdim=True)
        s = torch.exp(lg - lse).nan_to_num(0.0).sum(2)  # heads with no support contribute 0
    s = torch.where(valid, s, neg)
    res = torch.full((B, Hkv, k_top), -1, dtype=torch.int32, device=cand.device) if out is None else out.fill_(-1)
    kk = min(k_top, M)
    if kk > 0:
        _, j = s.topk(kk, dim=-1)  # [B, Hkv, kk]
        picked = cand.gather(2, j)
        res[..., :kk] = torch.where(valid.gather(2, j), picked, torch.full_like(picked, -1))
    return res


def best_pages(q_page: torch.Tensor, summary: tuple[torch.Tensor, ...], lo: torch.Tensor, hi: torch.Tensor,
               n_pages: int, page_size: int, *, scale: float | None = None, page_reduce: str = "sum_logits",
               triton: bool = False) -> torch.Tensor:
    """Level 1: the ``n_pages`` best pages of the middle ``[lo, hi)`` by ``summary``
    (``(mean,)`` or ``(kmin, kmax)``, [B, Hkv, P, D] each) scored with ``q_page``
    [B, Hq, D]: int32 [B, Hkv, n_pages] page numbers, ``-1`` padding."""
    if page_reduce not in _PAGE_REDUCES:
        raise ValueError(f"page_reduce must be one of {_PAGE_REDUCES}, got {page_reduce!r}")
    if len(summary) not in (1, 2):
        raise ValueError(f"summary is (mean,) or (kmin, kmax), got {len(summary)} tensors")
    p_lo, p_hi = page_range(lo, hi, page_size)
    if len(summary) == 1:  # page means: scored as keys, the fused scoring + top-K
        fn = score_topk_triton if triton else score_topk_ref
        return fn(q_page, summary[0], p_lo, p_hi, n_pages, scale=scale, reduce=page_reduce)
    kmin, kmax = summary
    if triton:
        ps = quest_page_scores_triton(q_page, kmin, kmax, p_hi, scale=scale, reduce=page_reduce, page_start=p_lo)
        return topk_from_scores_triton(ps, p_lo, p_hi, n_pages)
    ps = quest_page_scores_ref(q_page, kmin, kmax, p_hi, scale=scale, reduce=page_reduce, page_start=p_lo)
    return topk_from_scores_ref(ps, p_lo, p_hi, n_pages)


def _prefilter(q_page, summary, q, k, lo, hi, k_top, n_pages, page_size, *, scale, reduce, page_reduce,
               k_scale, norm_pos, out, triton_level1: bool) -> torch.Tensor:
    _check(page_size, n_pages, k_top, reduce, page_reduce)
    B, Hkv = k.shape[:2]
    lo = _check_rows(lo, B, "lo", k.device)
    hi = _check_rows(hi, B, "hi", k.device)
    s0 = summary[0]
    if s0.shape[:2] != (B, Hkv) or any(t.shape != s0.shape for t in summary):
        raise ValueError(f"page summary {[tuple(t.shape) for t in summary]} must be [B={B}, Hkv={Hkv}, P, D]")
    if s0.shape[2] < -(-k.shape[2] // page_size):
        raise ValueError(f"{s0.shape[2]} pages of {page_size} do not cover the {k.shape[2]} cached positions")
    pages = best_pages(q_page, summary, lo, hi, n_pages, page_size, scale=scale, page_reduce=page_reduce,
                       triton=triton_level1)
    cand = pages_to_candidates(pages, lo, hi, page_size)
    return candidate_topk(q, k, cand, k_top, scale=scale, reduce=reduce, k_scale=k_scale, norm_pos=norm_pos, out=out)


def prefilter_select_ref(q_page: torch.Tensor, summary: tuple[torch.Tensor, ...], q: torch.Tensor,
                         k: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k_top: int, n_pages: int,
                         page_size: int, *, scale: float | None = None, reduce: str = "sum_logits",
                         page_reduce: str = "sum_logits", k_scale: torch.Tensor | None = None,
                         norm_pos: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of ``prefilter_select``: level 1 with the torch references of the page
    scores and the top-K."""
    return _prefilter(q_page, summary, q, k, lo, hi, k_top, n_pages, page_size, scale=scale, reduce=reduce,
                      page_reduce=page_reduce, k_scale=k_scale, norm_pos=norm_pos, out=out, triton_level1=False)


def prefilter_select(q_page: torch.Tensor, summary: tuple[torch.Tensor, ...], q: torch.Tensor, k: torch.Tensor,
                     lo: torch.Tensor, hi: torch.Tensor, k_top: int, n_pages: int, page_size: int, *,
                     scale: float | None = None, reduce: str = "sum_logits", page_reduce: str = "sum_logits",
                     k_scale: torch.Tensor | None = None, norm_pos: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, triton: bool = True) -> torch.Tensor:
    """The ``k_top`` best positions of ``[lo, hi)`` found by the two-level scan.

    ``q_page`` [B, Hq, D]: the query the page ``summary`` is scored with (``(mean,)`` or
    ``(kmin, kmax)``, [B, Hkv, P, D] each, pages of ``page_size`` over the exact keys);
    ``q`` [B, Hq, D]: the query as the copy ``k`` is scored (int4: with its smoothing
    folded in; may equal ``q_page``). ``n_pages`` best pages per (row, KV head) by the
    ``page_reduce`` of the heads' page scores (``best_pages``); their tokens scored with
    ``reduce`` (``candidate_topk``). int32 [B, Hkv, k_top], ``-1`` padding. ``triton``:
    level 1 with the Triton kernels."""
    return _prefilter(q_page, summary, q, k, lo, hi, k_top, n_pages, page_size, scale=scale, reduce=reduce,
                      page_reduce=page_reduce, k_scale=k_scale, norm_pos=norm_pos, out=out, triton_level1=triton)


def prefilter_bytes(L: int, D: int, n_pages: int, page_size: int, *, bound_bytes: int = 2,
                    key_bytes_per_token: float, summary: str = "mean") -> tuple[float, float]:
    """Bytes read per (row, KV head) for a cache of L tokens: (level 1 + level 2, the
    token-level scan), given the copy's bytes per token (int4 at D=128: 64 + 4 of scale)
    and the summary's element size ``bound_bytes``."""
    pages = -(-L // page_size)
    per_page = D * bound_bytes * (1 if summary == "mean" else 2)
    two_level = pages * per_page + min(L, n_pages * page_size) * key_bytes_per_token
    return float(two_level), float(L * key_bytes_per_token)

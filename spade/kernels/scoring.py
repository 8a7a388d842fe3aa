"""GQA group scoring and the fused exact top-K selection (the hot kernels of the cache side).

Two public ops, each with a plain-torch reference beside the Triton version:

* ``group_scores_*``: the score of every cached key for each KV head,
  [B, Hkv, L] float32, ``-inf`` outside ``[kv_start, kv_lens)``.
* ``score_topk_*``: the ``k_top`` positions of ``[lo, hi)`` with the highest group
  score, int32 [B, Hkv, k_top], ``-1`` padding when there are fewer candidates.

Scoring is GQA as a batched GEMM per KV head: the G query heads of a group are
the rows of a ``[G_PAD, D] x [D, BLOCK_L]`` ``tl.dot`` (G padded to 16, the
smallest MMA tile), so one program reads each key tile once for the whole group
and reduces the G rows in registers (``sum_logits`` / ``max_logits``).
``sum_softmax`` needs each head's normaliser over the whole valid range before
any group sum, so it runs in two kernels: per-head logits plus per-chunk online
(max, sum-exp) statistics, then a finalize kernel that merges the statistics and
sums the normalised heads (the logits are G x 4 bytes per token: small next to
the keys, so the keys are still read once).

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

Threshold-carry top-K (``score_topk(..., carry=)``; ``policy.topk: carry``)
---------------------------------------------------------------------------
A caller that selects the same rows step after step (a layer of a decode) keeps a
small state per row (``new_carry``): the threshold carried from the previous call,
per unit of the query's norm. A one-program-per-row kernel scales it by this call's
query norm (``_carry_prep_kernel``): scores move in proportion to the query's norm,
and the count of keys above a fixed threshold moves exponentially in it, the faster
the further in the tail the K-th score sits — on long rows a few percent of norm
drift would empty or flood the candidate window. Stage 1 then skips the pass-0
histogram and marks the positions scoring at or above the threshold in a bitmask
(``_carry_mask``: one bit per position, no atomics). One program per row
(``_carry_select_kernel``) expands the bitmask into the candidates' positions,
gathers their scores and, when their count ``n`` lies in ``[k_top, CAP]``, finds the
K-th largest among them with an in-register radix select (16-bin digits: 8 passes of
a cheap histogram) — exact, since every key outside the list scores below the
threshold — writes the winners, and aims the next threshold at ``CARRY_MARGIN *
k_top`` candidates by the secant through (threshold, n) and (K-th score, k_top).
Otherwise (the first call; the scores jumped; a row shorter than K) it flags the
row, and the radix passes above, launched every call but gated on the flag (other
rows' programs exit at once: a static, capturable launch sequence), select that row
over its whole score row with many programs, and set its next threshold to the
lowest score of the 16-bit bucket holding its ``CARRY_MARGIN * k_top``-th largest
(a second pass-1 histogram, for that rank). Same result as the radix path; no
full-row passes while consecutive calls score alike, and a fallback costs about the
radix path's passes, at any row length.

The select is one latency-bound program per row; the scoring is bandwidth-bound.
Inside ``select_overlap`` (the cache rank wraps each pack's layers in one) every
select goes to a side stream after its own scoring, so layer j's select runs
beside layer j+1's scoring; the block joins on exit (run47, H200: a pack of four
layers 0.88-0.93x of the serial time).

Everything is sized from tensor shapes only (no host sync), so the ops can be
captured in a CUDA graph.

Queries are rounded to the keys' dtype before scoring (the tensor-core path on
GPU; the reference does the same rounding), so a float32 predicted query
against a bf16 cache scores as the bf16 query.

Compressed keys: int8 ``k`` (symmetric per-token, ``spade.kernels.quant``) with
its scales ``k_scale`` [B, Hkv, L] float32 scores as ``scale * (q · kq) * ks``.
The kernels load int8 (half the bytes of bf16, plus 4 bytes of scale per token)
and convert in registers to the query's dtype, exact for |kq| <= 127; the query
keeps its own dtype (the caller rounds it, e.g. to the cache's bf16, to keep the
tensor-core path). Only selection reads this copy; attention uses exact keys.

Packed int4 ``k`` (uint8 [B, Hkv, L, D/2], ``quant.quantize_keys_int4``: byte ``i``
read as int8 is ``p = lo + 8 + 16 * hi`` for channels ``i`` and ``i + D/2``)
scores the same way, a quarter of bf16's key bytes: a float tile unpacks into
its two channel halves ``(p & 15) - 8`` and ``p >> 4`` (exact in any float
dtype), which dot with the two halves of the query and add; the int8
tensor-core tile dots the raw bytes and their shift (``_i8dot_score_kernel``). The per-channel
smoothing of the int4 copy lives in the query (``quant.fold_smoothing``, applied
by the caller): to these kernels an int4 copy is plain symmetric int4.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading

import torch
import triton
import triton.language as tl

from spade.envs import env, triton_interpret
from spade.kernels.pdl import grid_dep_release, grid_dep_wait, pdl_kwargs
from spade.kernels.quant import unpack_int4

__all__ = [
    "REDUCES",
    "group_scores_ref",
    "group_scores_triton",
    "score_topk_ref",
    "score_topk_triton",
    "topk_from_scores_ref",
    "topk_from_scores_triton",
]

REDUCES = ("sum_logits", "max_logits", "sum_softmax")
_REDUCE_CODE = {"sum_logits": 0, "max_logits": 1}
_LOGITS_MODE = 2  # stage-1 mode of sum_softmax: per-head logits + online stats
_NBINS = 256  # 8-bit radix digits, 4 passes over a 32-bit key


# ----------------------------------------------------------------------------------------------
# Shared host-side helpers
# ----------------------------------------------------------------------------------------------


def _interpret() -> bool:
    """True when Triton runs under its CPU interpreter (decided at launch time)."""
    return triton_interpret()


def _check_reduce(reduce: str) -> None:
    if reduce not in REDUCES:
        raise ValueError(f"reduce must be one of {REDUCES}, got {reduce!r}")


def _check_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Validate ``q`` [B, Hq, D] against ``k`` [B, Hkv, L, D]; return (B, Hq, Hkv, L, D)."""
    if q.dim() != 3 or k.dim() != 4:
        raise ValueError(f"expected q [B, Hq, D] and k [B, Hkv, L, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, Hq, D = q.shape
    Bk, Hkv, L, Dk = k.shape
    if k.dtype == torch.uint8:  # packed int4: two channels per byte
        Dk *= 2
    if B != Bk or D != Dk:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head_dim")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    if q.device != k.device:
        raise ValueError(f"q on {q.device} but k on {k.device}")
    return B, Hq, Hkv, L, D


def _check_rows(t: torch.Tensor, B: int, name: str, device: torch.device | None = None) -> torch.Tensor:
    """Validate a per-row [B] integer tensor; move it to ``device`` if given (the
    kernels read it on the device)."""
    if t.shape != (B,):
        raise ValueError(f"{name} must have shape [{B}], got {tuple(t.shape)}")
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    return t if device is None else t.to(device)


def _default_scale(scale: float | None, D: int) -> float:
    return float(D) ** -0.5 if scale is None else float(scale)


_QUANT_KEYS = (torch.int8, torch.uint8)
"""Key dtypes of the compressed scoring copies: int8, and packed int4 as uint8."""


def _score_dtype(q: torch.Tensor, k: torch.Tensor) -> torch.dtype:
    """The dtype of the scoring products: the keys' dtype, or the query's own for int8 /
    int4 keys (their values are exact in every float dtype, so they convert losslessly)."""
    return q.dtype if k.dtype in _QUANT_KEYS else k.dtype


def _round_q(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The query as scored: rounded to the keys' dtype (see the module docstring)."""
    dt = _score_dtype(q, k)
    return q if q.dtype == dt else q.to(dt)


def _check_k_scale(k: torch.Tensor, k_scale: torch.Tensor | None) -> torch.Tensor | None:
    """int8 and packed int4 (uint8) keys need their per-token scales [B, Hkv, L]
    (float32, on k's device); float keys take none."""
    if k.dtype in _QUANT_KEYS:
        if k_scale is None:
            raise ValueError(f"{'int8' if k.dtype == torch.int8 else 'int4 (uint8)'} keys need k_scale "
                             "[B, Hkv, L] (the scales from quantize_keys / quantize_keys_int4)")
        if k_scale.shape != k.shape[:3]:
            raise ValueError(f"k_scale must have shape {tuple(k.shape[:3])}, got {tuple(k_scale.shape)}")
        if k_scale.device != k.device:
            raise ValueError(f"k_scale on {k_scale.device} but k on {k.device}")
        return k_scale.float()
    if k_scale is not None:
        raise ValueError(f"k_scale is only for int8 / int4 keys, got {k.dtype} keys")
    if not k.dtype.is_floating_point:
        raise ValueError(f"keys must be a float dtype, int8 or packed int4 (uint8), got {k.dtype}")
    return None


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    """SMs of the device (a small stand-in under the interpreter, to keep grids tiny)."""
    if device.type != "cuda":
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def _split(n: int, rows: int, device: torch.device, *, block: int, min_chunk: int,
           per_sm: int = 4) -> tuple[int, int]:
    """Split rows of length ``n`` into chunks for a (row, chunk) grid.

    Aims at about ``per_sm`` programs per SM (several waves, so the last partial
    wave costs little), with chunks of at least ``min_chunk`` elements (rounded to
    ``block``) so per-program work amortises its fixed costs (q load, histogram
    atomics). Returns (chunk, n_chunks)."""
    n = max(n, 1)
    target = per_sm * _sm_count(device)
    n_chunks = max(1, min(triton.cdiv(target, max(rows, 1)), triton.cdiv(n, min_chunk)))
    chunk = triton.cdiv(triton.cdiv(n, n_chunks), block) * block
    return chunk, triton.cdiv(n, chunk)


def _score_config(D: int, device: torch.device) -> dict:
    """Tile sizes of the scoring kernels. Overridable through ``SCORE_CONFIG`` (the
    benchmark sweeps it)."""
    block_d = max(16, triton.next_power_of_2(D))
    if _interpret() or device.type != "cuda":
        # the interpreter pays per op, not per element: few, large tiles
        cfg = dict(BLOCK_L=128, num_warps=1, num_stages=1, MIN_CHUNK=256, PER_SM=4)
    else:
        cfg = dict(BLOCK_L=64 if block_d <= 128 else 32, num_warps=4, num_stages=3, MIN_CHUNK=256, PER_SM=16)
    cfg.update(SCORE_CONFIG)
    cfg["BLOCK_D"] = block_d
    return cfg


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


SCORE_CONFIG: dict = {}
"""Overrides for the scoring kernels' launch config (``BLOCK_L``, ``num_warps``,
``num_stages``, ``MIN_CHUNK``, ``PER_SM``, and ``LANE_STATS``: the ``sum_softmax``
online statistics per tile element, reduced once per chunk, an experiment against
the per-tile cross-lane reductions); empty = the built-in heuristic."""
SELECT_CONFIG: dict = {}
"""Overrides for the radix-select kernels (``BLOCK``, ``num_warps``, ``MIN_CHUNK``, ``PER_SM``,
``TIE_BLOCK``: the tile of the per-row tie kernel; ``GATED_PER_SM``: programs per SM of the
threshold-carry fallback's gated passes, default 1) and
``fuse_hist`` (False: pass 0 runs as its own kernel instead of inside stage 1); and of the
threshold-carry top-K (``_carry_config``'s ``carry_*`` keys, ``carry_margin``; under
``select_overlap``: ``carry_overlap_warps``, the select's warps on the side stream, and
``carry_overlap_priority``, the side stream's priority)."""


def _dot_flags(k: torch.Tensor) -> tuple[bool, bool]:
    """(UPCAST, IEEE): the interpreter's bf16 ``tl.dot`` is wrong, so it runs in fp32;
    fp32 keys on a GPU use IEEE fp32 products rather than TF32."""
    upcast = _interpret()
    ieee = k.dtype == torch.float32 and not upcast
    return upcast, ieee


def _dot_flags_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[bool, bool]:
    """``_dot_flags`` for the dtype the products run in (the query's for int8 keys)."""
    upcast = _interpret()
    return upcast, _score_dtype(q, k) == torch.float32 and not upcast


# ----------------------------------------------------------------------------------------------
# Reference (plain torch)
# ----------------------------------------------------------------------------------------------


def _group_logits_ref(q: torch.Tensor, k: torch.Tensor, scale: float,
                      k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head logits [B, Hkv, G, L] float32 (fp32 products, q rounded to k's dtype;
    int8 / packed int4 keys: ``scale * (q · kq) * k_scale``)."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    qg = _round_q(q, k).float().reshape(B, Hkv, Hq // Hkv, D)  # [B, Hkv, G, D]
    kf = unpack_int4(k).float() if k.dtype == torch.uint8 else k.float()  # [B, Hkv, L, D]
    logits = torch.einsum("bhgd,bhld->bhgl", qg, kf) * scale
    if k_scale is not None:
        logits = logits * k_scale.float()[:, :, None, :]  # [B, Hkv, 1, L]
    return logits


def _range_mask(lo: torch.Tensor, hi: torch.Tensor, L: int) -> torch.Tensor:
    """[B, L] bool: lo[b] <= p < hi[b]."""
    pos = torch.arange(L, device=lo.device)
    return (pos[None, :] >= lo.long()[:, None]) & (pos[None, :] < hi.long()[:, None])


def _reduce_ref(logits: torch.Tensor, norm: torch.Tensor, out: torch.Tensor, reduce: str) -> torch.Tensor:
    """Group-reduce ``logits`` [B, Hkv, G, L]; ``norm`` [B, L] is the softmax support,
    ``out`` [B, L] the positions kept (others ``-inf``). Returns [B, Hkv, L] float32."""
    neg = torch.tensor(float("-inf"), device=logits.device)
    if reduce == "sum_logits":
        s = logits.sum(2)
    elif reduce == "max_logits":
        s = logits.amax(2)
    else:
        masked = torch.where(norm[:, None, None, :], logits, neg)
        p = torch.softmax(masked, dim=-1).nan_to_num(0.0)  # rows with no support -> 0
        s = p.sum(2)
    return torch.where(out[:, None, :], s, neg).float()


def group_scores_ref(q: torch.Tensor, k: torch.Tensor, kv_lens: torch.Tensor, *, scale: float | None = None,
                     reduce: str = "sum_logits", kv_start: torch.Tensor | None = None,
                     k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of ``group_scores``: [B, Hkv, L] float32, ``-inf`` outside ``[kv_start, kv_lens)``."""
    _check_reduce(reduce)
    B, Hq, Hkv, L, D = _check_qk(q, k)
    k_scale = _check_k_scale(k, k_scale)
    _check_rows(kv_lens, B, "kv_lens")
    start = torch.zeros_like(kv_lens) if kv_start is None else _check_rows(kv_start, B, "kv_start")
    valid = _range_mask(start.to(k.device), kv_lens.to(k.device), L)
    logits = _group_logits_ref(q, k, _default_scale(scale, D), k_scale)
    return _reduce_ref(logits, valid, valid, reduce)


def _norm_range(lo: torch.Tensor, hi: torch.Tensor, kv_lens: torch.Tensor | None, reduce: str,
                kv_start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``sum_softmax`` normaliser range of ``score_topk``: the row's own valid range
    ``[kv_start, kv_lens)`` (``kv_start`` = 0 when None) with ``kv_lens``, widened to
    the hull with ``[lo, hi)`` so it always covers the candidates; else ``[lo, hi)``.

    Starting at ``kv_start`` rather than 0 keeps left padding (garbage keys before
    ``kv_start``) out of the normaliser, so a padded row scores exactly as the same
    row alone."""
    if reduce != "sum_softmax" or kv_lens is None:
        return lo, hi
    kv = kv_lens.to(device=hi.device, dtype=hi.dtype)
    start = torch.zeros_like(lo) if kv_start is None else kv_start.to(device=lo.device, dtype=lo.dtype)
    return torch.minimum(start, lo), torch.maximum(kv, hi)


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


def _check_out(out: torch.Tensor | None, B: int, Hkv: int, k_top: int, device: torch.device) -> None:
    """``score_topk``'s ``out``: int32 [B, Hkv, k_top], contiguous, on the keys' device."""
    if out is not None and (out.shape != (B, Hkv, k_top) or out.dtype != torch.int32 or not out.is_contiguous()
                            or out.device != device):
        raise ValueError(f"out must be a contiguous int32 [{B}, {Hkv}, {k_top}] tensor on {device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device} (contiguous: {out.is_contiguous()})")


def score_topk_ref(q: torch.Tensor, k: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k_top: int, *,
                   scale: float | None = None, reduce: str = "sum_logits",
                   kv_lens: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                   kv_start: torch.Tensor | None = None, out: torch.Tensor | None = None,
                   carry: torch.Tensor | None = None, carry_margin: float | None = None) -> torch.Tensor:
    """Reference of ``score_topk``: full scores, then ``torch.topk`` (the naive baseline);
    copied into ``out`` when given (and ``out`` returned). ``carry`` is checked and left
    as it is: the threshold carry only changes how the Triton path finds the same top-K."""
    _check_reduce(reduce)
    B, Hq, Hkv, L, D = _check_qk(q, k)
    k_scale = _check_k_scale(k, k_scale)
    _check_rows(lo, B, "lo")
    _check_rows(hi, B, "hi")
    if k_top < 0:
        raise ValueError(f"k_top must be >= 0, got {k_top}")
    _check_out(out, B, Hkv, k_top, k.device)
    _check_carry(carry, B, Hkv, k.device)
    lo, hi = lo.to(k.device), hi.to(k.device)
    if kv_start is not None:
        kv_start = _check_rows(kv_start, B, "kv_start", k.device)
    n_lo, n_hi = _norm_range(lo, hi, kv_lens, reduce, kv_start)
    logits = _group_logits_ref(q, k, _default_scale(scale, D), k_scale)
    all_pos = torch.ones(B, L, dtype=torch.bool, device=k.device)
    scores = _reduce_ref(logits, _range_mask(n_lo, n_hi, L), all_pos, reduce)
    idx = topk_from_scores_ref(scores, lo, hi, k_top)
    return idx if out is None else out.copy_(idx)


# ----------------------------------------------------------------------------------------------
# Triton: scoring kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _f32_key(x):
    """Order-preserving map of float32 to uint32 (larger float -> larger key):
    flip every bit of negatives, set the sign bit of non-negatives."""
    bits = x.to(tl.uint32, bitcast=True)
    neg = (bits >> 31) == 1
    # NOTE: ``bits ^ 0xFFFFFFFF`` rather than ``~bits``: the interpreter's uint32 invert overflows.
    return tl.where(neg, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _chunk_span(lo_ptr, hi_ptr, b, chunk, L, CHUNK, BLOCK_L: tl.constexpr, FULL_ROW: tl.constexpr):
    """The candidate range ``[lo, hi)`` of batch row ``b``, the end ``c1`` of chunk
    ``chunk`` and the tiles ``[start, end)`` a scoring program walks: the whole chunk
    with FULL_ROW, else only the tiles meeting ``[lo, hi)`` (keys outside are never read)."""
    lo = tl.maximum(tl.load(lo_ptr + b).to(tl.int32), 0)
    hi = tl.minimum(tl.load(hi_ptr + b).to(tl.int32), L)
    c0 = chunk * CHUNK
    c1 = tl.minimum(c0 + CHUNK, L)
    if FULL_ROW:
        start = c0
        end = c1
    else:
        start = tl.maximum(c0, (lo // BLOCK_L) * BLOCK_L)
        end = tl.minimum(c1, hi)
    return lo, hi, c1, start, end


@triton.jit
def _store_scores(out_ptr, row64, L, offs_l, r, valid, c1, hist, thr, mask_row,
                  FULL_ROW: tl.constexpr, HIST: tl.constexpr, CARRY: tl.constexpr):
    """Store a tile of reduced scores ``r`` (``-inf`` outside ``valid``) into row
    ``row64`` of ``out`` [rows, L] — the whole chunk ``< c1`` with FULL_ROW, else only
    the valid positions — and add their radix pass-0 digits to ``hist``. CARRY: also
    mark the tile's candidates (valid scores ``>= thr``) in the row's bitmask
    (``_carry_mask``)."""
    if FULL_ROW:
        tl.store(out_ptr + row64 * L + offs_l, r, mask=offs_l < c1)
    else:
        tl.store(out_ptr + row64 * L + offs_l, r, mask=valid)
    if HIST:
        digit = ((_f32_key(r) >> 24) & 0xFF).to(tl.int32)
        hist += tl.histogram(digit, 256, mask=valid)
    if CARRY:
        _carry_mask(r, offs_l, valid, thr, mask_row)
    return hist


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
candidates (the rest had too few, or were first calls / short rows)."""


@triton.jit
def _carry_row(carry_ptr, cand_ptr, row64, NW, CARRY: tl.constexpr):
    """The carried threshold of row ``row64`` (slot 0 of ``CARRY_SLOTS``) and its
    candidate bitmask row (cand [rows, NW] int32 words)."""
    if CARRY:
        thr = tl.load(carry_ptr + row64 * 8).to(tl.float32, bitcast=True)
    else:
        thr = 0.0
    return thr, cand_ptr + row64 * NW


@triton.jit
def _load_group_q(q_ptr, b, h, stride_qb, stride_qh, stride_qd,
                  G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The G query heads of KV head ``h`` as a zero-padded [G_PAD, BLOCK_D] tile."""
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    base = q_ptr + b.to(tl.int64) * stride_qb + (h * G).to(tl.int64) * stride_qh
    mask = (offs_g[:, None] < G) & (offs_d[None, :] < D)
    return tl.load(base + offs_g[:, None] * stride_qh + offs_d[None, :] * stride_qd, mask=mask, other=0.0)


@triton.jit
def _score_tile(q, q2, k_base, ks_base, out_ptr, row64, l0, lo, hi, c1, L, scale, stride_kl, stride_kd,
                stride_sl, hist, m_run, s_run, thr, cand_row,
                G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_L: tl.constexpr, REDUCE: tl.constexpr, FULL_ROW: tl.constexpr, HIST: tl.constexpr,
                UPCAST: tl.constexpr, IEEE: tl.constexpr, KINT8: tl.constexpr, LANE_STATS: tl.constexpr,
                KINT4: tl.constexpr, CARRY: tl.constexpr):
    """One [BLOCK_L] tile of ``_score_kernel`` (see there); returns the carried
    (hist, m_run, s_run). LANE_STATS (sum_softmax): the online (max, sum-exp) is kept
    per element of the tile ([G_PAD, BLOCK_L], element-wise updates only) and reduced
    over L once per chunk, instead of two reductions across the tile's lanes (and, on a
    GPU, its warps) per tile. KINT8: the keys are int8 (half the bytes of bf16),
    converted in registers to the query's dtype (exact) and the logits scaled per
    token by ``ks``. KINT4: packed int4 keys (D and BLOCK_D are then the *half* head
    dim: the bytes of a row); ``q`` / ``q2`` are the query's first / second channel
    halves, dotted with the low / high nibbles (unused ``q2`` otherwise)."""
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < G
    offs_l = l0 + tl.arange(0, BLOCK_L)
    valid = (offs_l >= lo) & (offs_l < hi)
    kt = tl.load(k_base + offs_l[:, None].to(tl.int64) * stride_kl + offs_d[None, :] * stride_kd,
                 mask=valid[:, None] & (offs_d[None, :] < D), other=0)  # [BLOCK_L, BLOCK_D]
    if KINT4:
        kb = kt.to(tl.int8, bitcast=True).to(tl.int32)  # lo + 8 + 16 * hi
        k_lo = ((kb & 15) - 8).to(q.dtype)  # channels [0, D) of the head; padding bytes 0 -> -8, q is 0 there
        k_hi = (kb >> 4).to(q.dtype)  # channels [D, 2D) (arithmetic shift: the signed high nibble)
        if IEEE:
            s = tl.dot(q, tl.trans(k_lo), input_precision="ieee") + tl.dot(q2, tl.trans(k_hi), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k_lo)) + tl.dot(q2, tl.trans(k_hi))
    else:
        if KINT8:
            kt = kt.to(q.dtype)  # q is already fp32 under UPCAST
        elif UPCAST:
            kt = kt.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(kt), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kt))
    s = s * scale  # [G_PAD, BLOCK_L] fp32 logits
    if KINT8 or KINT4:
        ksv = tl.load(ks_base + offs_l.to(tl.int64) * stride_sl, mask=valid, other=0.0)  # [BLOCK_L] fp32
        s = s * ksv[None, :]
    if REDUCE == 2:
        ptrs = out_ptr + (row64 * G + offs_g[:, None]) * L + offs_l[None, :]
        tl.store(ptrs, s, mask=g_mask[:, None] & valid[None, :])
        sm = tl.where(valid[None, :], s, float("-inf"))
        if LANE_STATS:
            m_new = tl.maximum(m_run, sm)  # [G_PAD, BLOCK_L]
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no NaN from (-inf) - (-inf)
            s_run = s_run * tl.exp(m_run - m_safe) + tl.exp(sm - m_safe)
        else:
            m_new = tl.maximum(m_run, tl.max(sm, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no NaN from (-inf) - (-inf)
            s_run = s_run * tl.exp(m_run - m_safe) + tl.sum(tl.exp(sm - m_safe[:, None]), axis=1)
        m_run = m_new
    else:
        if REDUCE == 0:
            r = tl.sum(s, axis=0)  # padded q rows are zero
        else:
            r = tl.max(tl.where(g_mask[:, None], s, float("-inf")), axis=0)
        r = tl.where(valid, r, float("-inf"))
        hist = _store_scores(out_ptr, row64, L, offs_l, r, valid, c1, hist, thr, cand_row,
                         FULL_ROW, HIST, CARRY)
    return hist, m_run, s_run


@triton.jit
def _score_kernel(
    q_ptr, k_ptr, ks_ptr, out_ptr, stats_ptr, hist_ptr, lo_ptr, hi_ptr, carry_ptr, cand_ptr, NW,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_sb, stride_sh, stride_sl,
    L, CHUNK, N_CHUNKS, scale,
    HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr, REDUCE: tl.constexpr, FULL_ROW: tl.constexpr, HIST: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, KINT8: tl.constexpr, LANE_STATS: tl.constexpr,
    INTERPRET: tl.constexpr, KINT4: tl.constexpr, CARRY: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    """Stage 1: score one chunk of one (b, KV head) row.

    REDUCE 0/1 (sum/max of logits): writes scores [B*HKV, L] for positions in
    ``[lo, hi)`` (FULL_ROW: every position of the chunk, ``-inf`` outside) and,
    with HIST, adds the row's pass-0 radix histogram into ``hist_ptr``.
    REDUCE 2 (sum_softmax stage 1): writes per-head logits [B*HKV, G, L] of
    ``[lo, hi)`` and this chunk's online (max, sum-exp) per head into
    ``stats_ptr`` [B*HKV, G, N_CHUNKS, 2].
    """
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    row = tl.program_id(0)  # b * HKV + h
    chunk = tl.program_id(1)
    b = row // HKV
    h = row % HKV
    lo, hi, c1, start, end = _chunk_span(lo_ptr, hi_ptr, b, chunk, L, CHUNK, BLOCK_L, FULL_ROW)

    offs_g = tl.arange(0, G_PAD)
    g_mask = offs_g < G
    if KINT4:  # the query's two channel halves (D = half the head dim), see _score_tile
        q = _load_group_q(q_ptr, b, h, stride_qb, stride_qh, stride_qd, G, G_PAD, D, BLOCK_D)  # [G_PAD, BLOCK_D]
        q2 = _load_group_q(q_ptr + D * stride_qd, b, h, stride_qb, stride_qh, stride_qd, G, G_PAD, D, BLOCK_D)
        if UPCAST:
            q2 = q2.to(tl.float32)
    else:
        q = _load_group_q(q_ptr, b, h, stride_qb, stride_qh, stride_qd, G, G_PAD, D, BLOCK_D)  # [G_PAD, BLOCK_D]
        q2 = q  # unused
    if UPCAST:
        q = q.to(tl.float32)
    k_base = k_ptr + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    ks_base = ks_ptr + b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh  # only read when KINT8
    row64 = row.to(tl.int64)
    thr, cand_row = _carry_row(carry_ptr, cand_ptr, row64, NW, CARRY)

    hist = tl.zeros([256], dtype=tl.int32)
    if LANE_STATS:
        m_run = tl.full([G_PAD, BLOCK_L], float("-inf"), tl.float32)
        s_run = tl.zeros([G_PAD, BLOCK_L], dtype=tl.float32)
    else:
        m_run = tl.full([G_PAD], float("-inf"), tl.float32)
        s_run = tl.zeros([G_PAD], dtype=tl.float32)
    if INTERPRET:
        # NOTE: the interpreter cannot take tensor bounds in range(); the compiled
        # kernel keeps the for loop so the software pipeliner can stage the key loads.
        l0 = start
        while l0 < end:
            hist, m_run, s_run = _score_tile(q, q2, k_base, ks_base, out_ptr, row64, l0, lo, hi, c1, L, scale,
                                             stride_kl, stride_kd, stride_sl, hist, m_run, s_run, thr, cand_row,
                                             G, G_PAD, D, BLOCK_D, BLOCK_L, REDUCE, FULL_ROW, HIST, UPCAST,
                                             IEEE, KINT8, LANE_STATS, KINT4, CARRY)
            l0 += BLOCK_L
    else:
        for l0 in range(start, end, BLOCK_L):
            hist, m_run, s_run = _score_tile(q, q2, k_base, ks_base, out_ptr, row64, l0, lo, hi, c1, L, scale,
                                             stride_kl, stride_kd, stride_sl, hist, m_run, s_run, thr, cand_row,
                                             G, G_PAD, D, BLOCK_D, BLOCK_L, REDUCE, FULL_ROW, HIST, UPCAST,
                                             IEEE, KINT8, LANE_STATS, KINT4, CARRY)
    if REDUCE == 2:
        if LANE_STATS:  # merge the per-element statistics of the chunk: one reduction over L
            m_lane = m_run
            m_run = tl.max(m_lane, axis=1)  # [G_PAD]
            m_safe = tl.where(m_run == float("-inf"), 0.0, m_run)
            s_run = tl.sum(tl.where(m_lane == float("-inf"), 0.0, s_run * tl.exp(m_lane - m_safe[:, None])), axis=1)
        st = stats_ptr + ((row64 * G + offs_g) * N_CHUNKS + chunk) * 2
        tl.store(st, m_run, mask=g_mask)
        tl.store(st + 1, s_run, mask=g_mask)
    if HIST:
        tl.atomic_add(hist_ptr + row64 * 256 + tl.arange(0, 256), hist, mask=hist > 0)  # scores fill few bins


@triton.jit
def _finalize_tile(logit_ptr, out_ptr, row64, l0, lo, hi, c1, L, m_safe, inv_z, hist, thr, cand_row,
                   G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_L: tl.constexpr, FULL_ROW: tl.constexpr,
                   HIST: tl.constexpr, CARRY: tl.constexpr):
    """One tile of ``_softmax_finalize_kernel``; returns the carried histogram."""
    offs_g = tl.arange(0, G_PAD)
    offs_l = l0 + tl.arange(0, BLOCK_L)
    valid = (offs_l >= lo) & (offs_l < hi)
    lg = tl.load(logit_ptr + (row64 * G + offs_g[:, None]) * L + offs_l[None, :],
                 mask=(offs_g[:, None] < G) & valid[None, :], other=float("-inf"))  # [G_PAD, BLOCK_L]
    p = tl.exp(lg - m_safe[:, None]) * inv_z[:, None]
    r = tl.where(valid, tl.sum(p, axis=0), float("-inf"))
    return _store_scores(out_ptr, row64, L, offs_l, r, valid, c1, hist, thr, cand_row,
                         FULL_ROW, HIST, CARRY)


@triton.jit
def _softmax_finalize_kernel(
    logit_ptr, stats_ptr, out_ptr, hist_ptr, lo_ptr, hi_ptr, carry_ptr, cand_ptr, NW,
    L, CHUNK, N_STATS,
    HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_L: tl.constexpr,
    FULL_ROW: tl.constexpr, HIST: tl.constexpr, INTERPRET: tl.constexpr, CARRY: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    """sum_softmax stage 2: merge the per-chunk (max, sum-exp) of each head into its
    normaliser, then score = Σ_g exp(logit_g - M_g) / Z_g over ``[lo, hi)``."""
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    b = row // HKV
    lo, hi, c1, start, end = _chunk_span(lo_ptr, hi_ptr, b, chunk, L, CHUNK, BLOCK_L, FULL_ROW)
    row64 = row.to(tl.int64)
    thr, cand_row = _carry_row(carry_ptr, cand_ptr, row64, NW, CARRY)
    offs_g = tl.arange(0, G_PAD)
    offs_c = tl.arange(0, BLOCK_C)
    smask = (offs_g[:, None] < G) & (offs_c[None, :] < N_STATS)
    st = stats_ptr + ((row64 * G + offs_g[:, None]) * N_STATS + offs_c[None, :]) * 2
    m = tl.load(st, mask=smask, other=float("-inf"))  # [G_PAD, BLOCK_C]
    z = tl.load(st + 1, mask=smask, other=0.0)
    m_all = tl.max(m, axis=1)  # [G_PAD]
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    z_all = tl.sum(tl.where(m == float("-inf"), 0.0, z * tl.exp(m - m_safe[:, None])), axis=1)
    inv_z = tl.where(z_all > 0, 1.0 / tl.where(z_all > 0, z_all, 1.0), 0.0)

    hist = tl.zeros([256], dtype=tl.int32)
    if INTERPRET:  # NOTE: no tensor bounds in the interpreter's range()
        l0 = start
        while l0 < end:
            hist = _finalize_tile(logit_ptr, out_ptr, row64, l0, lo, hi, c1, L, m_safe, inv_z, hist, thr,
                                  cand_row, G, G_PAD, BLOCK_L, FULL_ROW, HIST, CARRY)
            l0 += BLOCK_L
    else:
        for l0 in range(start, end, BLOCK_L):
            hist = _finalize_tile(logit_ptr, out_ptr, row64, l0, lo, hi, c1, L, m_safe, inv_z, hist, thr,
                                  cand_row, G, G_PAD, BLOCK_L, FULL_ROW, HIST, CARRY)
    if HIST:
        tl.atomic_add(hist_ptr + row64 * 256 + tl.arange(0, 256), hist, mask=hist > 0)  # scores fill few bins


@triton.jit
def _gemv_tile(qs, qs2, k_base, ks_base, out_ptr, row64, l0, lo, hi, c1, L, stride_kl, stride_kd, stride_sl,
               hist, thr, cand_row, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
               KINT8: tl.constexpr, FULL_ROW: tl.constexpr, HIST: tl.constexpr, KINT4: tl.constexpr,
               CARRY: tl.constexpr):
    """One tile of ``_gemv_score_kernel``. KINT4: D / BLOCK_D are the packed row's bytes
    (half the head dim); ``qs`` / ``qs2`` the summed query's channel halves."""
    offs_l = l0 + tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, BLOCK_D)
    valid = (offs_l >= lo) & (offs_l < hi)
    kt = tl.load(k_base + offs_l[:, None].to(tl.int64) * stride_kl + offs_d[None, :] * stride_kd,
                 mask=valid[:, None] & (offs_d[None, :] < D), other=0)  # [BLOCK_L, BLOCK_D]
    if KINT4:
        kb = kt.to(tl.int8, bitcast=True).to(tl.int32)  # lo + 8 + 16 * hi
        r = tl.sum(((kb & 15) - 8).to(tl.float32) * qs[None, :] + (kb >> 4).to(tl.float32) * qs2[None, :],
                   axis=1)  # [BLOCK_L]
    else:
        r = tl.sum(kt.to(tl.float32) * qs[None, :], axis=1)  # [BLOCK_L]
    if KINT8 or KINT4:
        r = r * tl.load(ks_base + offs_l.to(tl.int64) * stride_sl, mask=valid, other=0.0)
    r = tl.where(valid, r, float("-inf"))
    return _store_scores(out_ptr, row64, L, offs_l, r, valid, c1, hist, thr, cand_row,
                         FULL_ROW, HIST, CARRY)


@triton.jit
def _gemv_score_kernel(
    qs_ptr, k_ptr, ks_ptr, out_ptr, hist_ptr, lo_ptr, hi_ptr, carry_ptr, cand_ptr, NW,
    stride_kb, stride_kh, stride_kl, stride_kd, stride_sb, stride_sh, stride_sl, L, CHUNK,
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, KINT8: tl.constexpr,
    FULL_ROW: tl.constexpr, HIST: tl.constexpr, INTERPRET: tl.constexpr, KINT4: tl.constexpr,
    CARRY: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    """``sum_logits`` as one GEMV per (b, KV head): Σ_g scale·q_g·k = (scale·Σ_g q_g)·k, so
    the group collapses into one fp32 query ``qs`` [B*HKV, D] and each key is read once
    with D multiply-adds on the CUDA cores (no padded tensor-core tile of G rows): the
    int8 keys then stream at their own, halved, byte count (int4: a quarter; D is then
    half the head dim, the row's bytes, and ``qs`` holds 2D channels per row)."""
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    b = row // HKV
    h = row % HKV
    lo, hi, c1, start, end = _chunk_span(lo_ptr, hi_ptr, b, chunk, L, CHUNK, BLOCK_L, FULL_ROW)
    row64 = row.to(tl.int64)
    thr, cand_row = _carry_row(carry_ptr, cand_ptr, row64, NW, CARRY)
    offs_d = tl.arange(0, BLOCK_D)
    if KINT4:
        qs = tl.load(qs_ptr + row64 * (2 * D) + offs_d, mask=offs_d < D, other=0.0)  # [BLOCK_D] first half
        qs2 = tl.load(qs_ptr + row64 * (2 * D) + D + offs_d, mask=offs_d < D, other=0.0)  # second half
    else:
        qs = tl.load(qs_ptr + row64 * D + offs_d, mask=offs_d < D, other=0.0)  # [BLOCK_D] fp32
        qs2 = qs  # unused
    k_base = k_ptr + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    ks_base = ks_ptr + b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh
    hist = tl.zeros([256], dtype=tl.int32)
    if INTERPRET:  # NOTE: no tensor bounds in the interpreter's range()
        l0 = start
        while l0 < end:
            hist = _gemv_tile(qs, qs2, k_base, ks_base, out_ptr, row64, l0, lo, hi, c1, L, stride_kl, stride_kd,
                              stride_sl, hist, thr, cand_row, D, BLOCK_D, BLOCK_L, KINT8, FULL_ROW, HIST,
                              KINT4, CARRY)
            l0 += BLOCK_L
    else:
        for l0 in range(start, end, BLOCK_L):
            hist = _gemv_tile(qs, qs2, k_base, ks_base, out_ptr, row64, l0, lo, hi, c1, L, stride_kl, stride_kd,
                              stride_sl, hist, thr, cand_row, D, BLOCK_D, BLOCK_L, KINT8, FULL_ROW, HIST,
                              KINT4, CARRY)
    if HIST:
        tl.atomic_add(hist_ptr + row64 * 256 + tl.arange(0, 256), hist, mask=hist > 0)


@triton.jit
def _i8dot_score_kernel(
    q_ptr, k_ptr, ks_ptr, out_ptr, hist_ptr, lo_ptr, hi_ptr, carry_ptr, cand_ptr, NW,
    stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kl, stride_kd, stride_sb, stride_sh, stride_sl,
    L, CHUNK, scale,
    HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr, FULL_ROW: tl.constexpr, HIST: tl.constexpr, INTERPRET: tl.constexpr,
    KINT4: tl.constexpr, ASM4: tl.constexpr, CARRY: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    """``sum_logits`` over int8 keys on the int8 tensor cores, with no per-element
    conversion of the keys.

    Converting every int8 key element to float runs at a quarter of the FMA rate on
    Hopper, which caps the float GEMV tile near 2x its byte floor. Here the group's
    summed query ``qs = scale * Σ_g q_g`` (fp32, computed in the program) is written
    in fixed point, ``qs ≈ s * qi`` with ``s = max|qs| / 1e9`` (``qi`` int32 holds
    every bit fp32 has of ``qs``), and split into four balanced int8 digits
    ``qi = d0 + 256 d1 + 65536 d2 + 2^24 d3`` (``_q_digits``). One int8 ``tl.dot`` of
    the key tile [BLOCK_L, D] with the digit matrix [D, 16] (columns d0..d3, zeros
    after: 16 is the smallest MMA width) gives four int32 partial dots c0..c3, each
    exact (|c| <= 128 * 128 * D), and ``k·q ≈ s * (c0 + 256 c1 + 65536 c2 + 2^24 c3)``
    combined in fp32: the only rounding is fp32's own, on the query and on the sum.

    KINT4: packed int4 keys (D, BLOCK_D: the packed row's bytes, half the head dim),
    each byte read as int8 ``p = lo + 8 + 16 * hi`` (``quant.pack_int4``). With ``x``
    / ``y`` the two channel halves of ``qs``: ``x · p + (y - 16 x) · (p >> 4)
    = x · lo + y · hi + 8 Σx``, so the raw byte tile feeds one int8 dot (digits of
    ``x``) and its arithmetic shift — the only per-element op — the other (digits of
    ``z = y - 16 x̂``, ``x̂`` the fixed-point ``x`` already used, under the same scale),
    both into one int32 accumulator (one epilogue), and ``8 Σx̂`` is subtracted per
    tile. No nibble masks, no offsets."""
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    b = row // HKV
    h = row % HKV
    lo, hi, c1, start, end = _chunk_span(lo_ptr, hi_ptr, b, chunk, L, CHUNK, BLOCK_L, FULL_ROW)
    row64 = row.to(tl.int64)
    thr, cand_row = _carry_row(carry_ptr, cand_ptr, row64, NW, CARRY)
    offs_d = tl.arange(0, BLOCK_D)
    offs_g = tl.arange(0, G_PAD)
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q_mask = (offs_g[:, None] < G) & (offs_d[None, :] < D)
    qg = tl.load(q_rows, mask=q_mask, other=0.0).to(tl.float32)  # [G_PAD, BLOCK_D]
    qs = tl.sum(qg, axis=0) * scale  # [BLOCK_D] fp32 (KINT4: the first channel half)
    amax = tl.max(tl.abs(qs), axis=0)
    if KINT4:
        qs2 = tl.sum(tl.load(q_rows + D * stride_qd, mask=q_mask, other=0.0).to(tl.float32), axis=0) * scale
        # one scale for x and z = y - 16 x̂ (|z| <= max|y| + 17 max|x|), so both dots add
        # into one int32 accumulator; 30 bits leave x's step far below fp32's own rounding
        amax = tl.max(tl.abs(qs2), axis=0) + 17.0 * amax
    s = tl.where(amax > 0, amax / 1.0e9, 1.0)  # |qi| <= ~1e9 < 2^30 (fp32 division may round up a little)
    qi = tl.floor(qs / s + 0.5).to(tl.int32)  # [BLOCK_D]: qs in fixed point, as exact as fp32 holds it
    qm = _q_digits(qi)  # [BLOCK_D, 16] int8
    if KINT4:
        z = qs2 - 16.0 * (qi.to(tl.float32) * s)  # [BLOCK_D]: y - 16 x̂
        qm2 = _q_digits(tl.floor(z / s + 0.5).to(tl.int32))
        c_off = 8.0 * s * tl.sum(qi.to(tl.float32), axis=0)  # the low nibbles' offset, times x̂
    else:
        qm2 = qm  # unused
        c_off = 0.0
    col = tl.arange(0, 16)[None, :]
    w = tl.where(col == 0, 1.0, tl.where(col == 1, 256.0, tl.where(col == 2, 65536.0, tl.where(
        col == 3, 16777216.0, 0.0)))) * s  # [1, 16] fp32: the digits' weights
    k_base = k_ptr + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    ks_base = ks_ptr + b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh
    hist = tl.zeros([256], dtype=tl.int32)
    if INTERPRET:  # NOTE: no tensor bounds in the interpreter's range()
        l0 = start
        while l0 < end:
            hist = _i8dot_tile(qm, qm2, w, c_off, k_base, ks_base, out_ptr, row64, l0, lo, hi, c1, L,
                               stride_kl, stride_kd, stride_sl, hist, thr, cand_row, D, BLOCK_D, BLOCK_L,
                               FULL_ROW, HIST, KINT4, ASM4, CARRY)
            l0 += BLOCK_L
    else:
        for l0 in range(start, end, BLOCK_L):
            hist = _i8dot_tile(qm, qm2, w, c_off, k_base, ks_base, out_ptr, row64, l0, lo, hi, c1, L,
                               stride_kl, stride_kd, stride_sl, hist, thr, cand_row, D, BLOCK_D, BLOCK_L,
                               FULL_ROW, HIST, KINT4, ASM4, CARRY)
    if HIST:
        tl.atomic_add(hist_ptr + row64 * 256 + tl.arange(0, 256), hist, mask=hist > 0)


@triton.jit
def _q_digits(qi):
    """The digit matrix of ``_i8dot_score_kernel``: the fixed-point query ``qi``
    [BLOCK_D] int32 (|qi| <= ~1e9) as four balanced int8 digits, least significant
    first, ``qi = d0 + 256 d1 + 65536 d2 + 2^24 d3`` (d0..d2 in [-128, 127], |d3| <= 64),
    in columns 0..3 of a [BLOCK_D, 16] int8 matrix (zeros after)."""
    d0 = ((qi + 128) & 255) - 128
    r = (qi - d0) >> 8  # exact: qi - d0 is a multiple of 256
    d1 = ((r + 128) & 255) - 128
    r = (r - d1) >> 8
    d2 = ((r + 128) & 255) - 128
    d3 = (r - d2) >> 8
    col = tl.arange(0, 16)[None, :]
    return tl.where(col == 0, d0[:, None], tl.where(col == 1, d1[:, None], tl.where(
        col == 2, d2[:, None], tl.where(col == 3, d3[:, None], 0)))).to(tl.int8)  # [BLOCK_D, 16]


@triton.jit
def _high_nibbles(p, ASM: tl.constexpr):
    """``p >> 4`` (arithmetic) of an int8 tile: the signed high nibbles of packed int4.
    ASM (GPU only): on four bytes per 32-bit register at once — shift the word, mask
    the nibbles, sign-extend each through its bit 3 (``(t & 0x08..) * 30`` puts 0xF0
    in exactly the negative bytes: no carries cross a byte) — five instructions per
    four bytes instead of an unpack, 16-bit shift and repack per byte."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, m;
            shr.b32 t, $1, 4;
            and.b32 t, t, 0x0F0F0F0F;
            and.b32 m, t, 0x08080808;
            mul.lo.u32 m, m, 30;
            or.b32 $0, t, m;
            }""",
            constraints="=r,r", args=[p], dtype=tl.int8, is_pure=True, pack=4)
    else:
        return (p >> 4).to(tl.int8)


@triton.jit
def _i8dot_tile(qm, qm2, w, c_off, k_base, ks_base, out_ptr, row64, l0, lo, hi, c1, L, stride_kl, stride_kd,
                stride_sl, hist, thr, cand_row, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
                FULL_ROW: tl.constexpr, HIST: tl.constexpr, KINT4: tl.constexpr, ASM4: tl.constexpr,
                CARRY: tl.constexpr):
    offs_l = l0 + tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, BLOCK_D)
    valid = (offs_l >= lo) & (offs_l < hi)
    kt = tl.load(k_base + offs_l[:, None].to(tl.int64) * stride_kl + offs_d[None, :] * stride_kd,
                 mask=valid[:, None] & (offs_d[None, :] < D), other=0)  # [BLOCK_L, BLOCK_D] int8 / packed uint8
    if KINT4:
        p = kt.to(tl.int8, bitcast=True)  # lo + 8 + 16 * hi; padding bytes are 0 and add nothing
        acc = tl.dot(p, qm, out_dtype=tl.int32)  # [BLOCK_L, 16]: x̂ · p in digits
        acc = tl.dot(_high_nibbles(p, ASM4), qm2, acc, out_dtype=tl.int32)  # + (y - 16 x̂) · hi
        r = tl.sum(acc.to(tl.float32) * w, axis=1) - c_off  # [BLOCK_L]
    else:
        acc = tl.dot(kt, qm, out_dtype=tl.int32)  # [BLOCK_L, 16] int32: the four partial dots
        r = tl.sum(acc.to(tl.float32) * w, axis=1)  # [BLOCK_L] = s * k·q_int
    r = r * tl.load(ks_base + offs_l.to(tl.int64) * stride_sl, mask=valid, other=0.0)
    r = tl.where(valid, r, float("-inf"))
    return _store_scores(out_ptr, row64, L, offs_l, r, valid, c1, hist, thr, cand_row,
                         FULL_ROW, HIST, CARRY)


def _gemv_config(k: torch.Tensor) -> dict:
    if _interpret() or k.device.type != "cuda":
        cfg = dict(BLOCK_L=128, num_warps=1, num_stages=1, MIN_CHUNK=256, PER_SM=4)
    else:
        # best of the bench_scoring GEMV variants on an H200 (B=8, L=32k, int8 keys):
        # 256 x 128 int8 tiles, 8 warps, 3 stages — 0.116 ms scoring, 0.170 ms with the top-K
        cfg = dict(BLOCK_L=256, num_warps=8, num_stages=3, MIN_CHUNK=512, PER_SM=8)
    cfg.update(GEMV_CONFIG)
    return cfg


GEMV_CONFIG: dict = {}
"""Overrides for the ``sum_logits`` GEMV scoring kernel (``BLOCK_L``, ``num_warps``,
``num_stages``, ``MIN_CHUNK``, ``PER_SM``), plus ``use``: ``"int8"`` (default: int8
and int4 keys only), ``"all"`` (every key dtype), ``"off"``, and ``int8_dot`` (default True:
int8 and int4 keys go through ``_i8dot_score_kernel`` on the int8 tensor cores; False:
the float GEMV tile, which converts every key element), and ``int4_asm`` (default True on a
GPU: the int4 high nibbles by four bytes per register, ``_high_nibbles``; False: per byte)."""


def _use_gemv(k: torch.Tensor, reduce: str) -> bool:
    mode = GEMV_CONFIG.get("use", "int8")
    return reduce == "sum_logits" and (mode == "all" or (mode == "int8" and k.dtype in _QUANT_KEYS))


def _carry_args(carry: tuple | None, out: torch.Tensor) -> tuple:
    """(carry, mask, NW) kernel arguments and the CARRY flag; placeholders (never read)
    without."""
    if carry is None:
        return (out, out, 1), False
    return carry, True


def _launch_gemv(q: torch.Tensor, k: torch.Tensor, out: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, *,
                 scale: float, full_row: bool, hist: torch.Tensor | None, k_scale: torch.Tensor | None,
                 carry: tuple | None = None) -> None:
    B, Hq, D = q.shape
    cargs, do_carry = _carry_args(carry, out)
    _, Hkv, L, _ = k.shape
    rows = B * Hkv
    cfg = _gemv_config(k)
    BLOCK_L = cfg["BLOCK_L"]
    chunk, n_chunks = _split(L, rows, k.device, block=BLOCK_L, min_chunk=cfg["MIN_CHUNK"], per_sm=cfg["PER_SM"])
    kint4 = k.dtype == torch.uint8
    kint8 = k.dtype == torch.int8
    if (kint8 or kint4) and cfg.get("int8_dot", True):
        G = Hq // Hkv
        Dk = D // 2 if kint4 else D  # the key row's elements (bytes of a packed int4 row)
        _i8dot_score_kernel[(rows, n_chunks)](
            q, k, k_scale, out, hist if hist is not None else out, lo, hi, *cargs,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), k.stride(3),
            *k_scale.stride(), L, chunk, scale,
            HKV=Hkv, G=G, G_PAD=triton.next_power_of_2(G), D=Dk, BLOCK_D=max(32, triton.next_power_of_2(Dk)),
            BLOCK_L=BLOCK_L, FULL_ROW=full_row, HIST=hist is not None, INTERPRET=_interpret(), KINT4=kint4,
            ASM4=kint4 and not _interpret() and cfg.get("int4_asm", True), CARRY=do_carry,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_kwargs(q, "select"))
        return
    qs = (q.float().view(B, Hkv, Hq // Hkv, D).sum(2) * scale).reshape(rows, D).contiguous()  # [B*Hkv, D]
    ks_arg = k_scale if k_scale is not None else out
    ks_strides = k_scale.stride() if k_scale is not None else (0, 0, 0)
    Dk = D // 2 if kint4 else D  # the key row's elements (bytes of a packed int4 row)
    _gemv_score_kernel[(rows, n_chunks)](
        qs, k, ks_arg, out, hist if hist is not None else out, lo, hi, *cargs,
        k.stride(0), k.stride(1), k.stride(2), k.stride(3), *ks_strides, L, chunk,
        HKV=Hkv, D=Dk, BLOCK_D=max(16, triton.next_power_of_2(Dk)), BLOCK_L=BLOCK_L, KINT8=kint8,
        KINT4=kint4, FULL_ROW=full_row, HIST=hist is not None, INTERPRET=_interpret(), CARRY=do_carry,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_kwargs(qs, "select"))


def _launch_scores(q: torch.Tensor, k: torch.Tensor, out: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                   norm_lo: torch.Tensor, norm_hi: torch.Tensor, *, scale: float, reduce: str, full_row: bool,
                   hist: torch.Tensor | None, k_scale: torch.Tensor | None = None,
                   carry: tuple | None = None) -> None:
    """Fill ``out`` [B, Hkv, L] fp32 with group scores over ``[lo, hi)`` (softmax support
    ``[norm_lo, norm_hi)``); optionally accumulate the pass-0 histogram into ``hist``;
    ``carry`` = (carry, mask, NW): also mark each row's candidates above its carried
    threshold in its bitmask (``_carry_mask``)."""
    if _use_gemv(k, reduce):
        _launch_gemv(q, k, out, lo, hi, scale=scale, full_row=full_row, hist=hist, k_scale=k_scale, carry=carry)
        return
    cargs, do_carry = _carry_args(carry, out)
    B, Hq, D = q.shape
    _, Hkv, L, _ = k.shape
    G = Hq // Hkv
    G_PAD = max(16, triton.next_power_of_2(G))
    rows = B * Hkv
    kint4 = k.dtype == torch.uint8
    Dk = D // 2 if kint4 else D  # int4: the kernels see the packed row (half the head dim)
    cfg = _score_config(Dk, k.device)
    BLOCK_L, BLOCK_D = cfg["BLOCK_L"], cfg["BLOCK_D"]
    chunk, n_chunks = _split(L, rows, k.device, block=BLOCK_L, min_chunk=cfg["MIN_CHUNK"], per_sm=cfg["PER_SM"])
    upcast, ieee = _dot_flags_qk(q, k)
    qr = _round_q(q, k)
    kint8 = k.dtype == torch.int8
    ks_arg = k_scale if k_scale is not None else out  # never read for float keys
    ks_strides = k_scale.stride() if k_scale is not None else (0, 0, 0)
    do_hist = hist is not None
    hist_arg = hist if do_hist else out  # never touched when HIST is off
    common = dict(HKV=Hkv, G=G, G_PAD=G_PAD, D=Dk, BLOCK_D=BLOCK_D, BLOCK_L=BLOCK_L, UPCAST=upcast, IEEE=ieee,
                  KINT8=kint8, KINT4=kint4, LANE_STATS=bool(cfg.get("LANE_STATS", False)),
                  INTERPRET=_interpret(), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    grid = (rows, n_chunks)
    if reduce != "sum_softmax":
        _score_kernel[grid](
            qr, k, ks_arg, out, out, hist_arg, lo, hi, *cargs,
            qr.stride(0), qr.stride(1), qr.stride(2), k.stride(0), k.stride(1), k.stride(2), k.stride(3),
            *ks_strides, L, chunk, n_chunks, scale,
            REDUCE=_REDUCE_CODE[reduce], FULL_ROW=full_row, HIST=do_hist, CARRY=do_carry, **common,
            **pdl_kwargs(qr, "select"))
        return
    logits = torch.empty(rows, G, L, dtype=torch.float32, device=k.device)  # [B*Hkv, G, L]
    stats = torch.empty(rows, G, n_chunks, 2, dtype=torch.float32, device=k.device)
    _score_kernel[grid](
        qr, k, ks_arg, logits, stats, out, norm_lo, norm_hi, out, out, 1,
        qr.stride(0), qr.stride(1), qr.stride(2), k.stride(0), k.stride(1), k.stride(2), k.stride(3),
        *ks_strides, L, chunk, n_chunks, scale,
        REDUCE=_LOGITS_MODE, FULL_ROW=False, HIST=False, **common, **pdl_kwargs(qr, "select"))
    _softmax_finalize_kernel[grid](
        logits, stats, out, hist_arg, lo, hi, *cargs, L, chunk, n_chunks,
        HKV=Hkv, G=G, G_PAD=G_PAD, BLOCK_C=triton.next_power_of_2(n_chunks), BLOCK_L=BLOCK_L,
        FULL_ROW=full_row, HIST=do_hist, INTERPRET=_interpret(), CARRY=do_carry, num_warps=cfg["num_warps"],
        **pdl_kwargs(logits, "select"))


def group_scores_triton(q: torch.Tensor, k: torch.Tensor, kv_lens: torch.Tensor, *, scale: float | None = None,
                        reduce: str = "sum_logits", kv_start: torch.Tensor | None = None,
                        k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Triton ``group_scores``: [B, Hkv, L] float32, ``-inf`` outside ``[kv_start, kv_lens)``.

    >>> s = group_scores_triton(q, k, kv_lens, reduce="max_logits")  # doctest: +SKIP
    """
    _check_reduce(reduce)
    B, Hq, Hkv, L, D = _check_qk(q, k)
    k_scale = _check_k_scale(k, k_scale)
    kv_lens = _check_rows(kv_lens, B, "kv_lens", k.device)
    start = torch.zeros_like(kv_lens) if kv_start is None else _check_rows(kv_start, B, "kv_start", k.device)
    out = torch.empty(B, Hkv, L, dtype=torch.float32, device=k.device)
    if B * Hkv * L == 0:
        return out
    _launch_scores(q, k, out, start, kv_lens, start, kv_lens, scale=_default_scale(scale, D), reduce=reduce,
                   full_row=True, hist=None, k_scale=k_scale)
    return out


# ----------------------------------------------------------------------------------------------
# Triton: exact top-K by radix select on the score bits
# ----------------------------------------------------------------------------------------------


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
    if INTERPRET:  # NOTE: no tensor bounds in the interpreter's range()
        while s0 < k_top:
            offs = s0 + tl.arange(0, BLOCK)
            tl.store(out_row_ptr + offs, tl.full([BLOCK], -1, tl.int32), mask=(offs >= k_eff) & (offs < k_top))
            s0 += BLOCK
    else:
        for t0 in range(s0, k_top, BLOCK):
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
    row64 = row.to(tl.int64)
    lo, hi, k_eff = _row_bounds(lo_ptr, hi_ptr, row // HKV, L, k_top)
    run = _gate(gate_ptr, row64, GATED)
    prefix, k_rem = _radix_state(hist_ptr, row64, n_rows, k_eff, PASS, run)
    c0 = chunk * CHUNK
    start = tl.maximum(c0, (lo // BLOCK) * BLOCK)
    end = tl.minimum(c0 + CHUNK, hi)
    end = tl.where((k_eff > 0) & run, end, start)
    row_ptr = scores_ptr + row64 * L
    acc = tl.zeros([256], dtype=tl.int32)
    acc_b = tl.zeros([256], dtype=tl.int32)
    prefix_b = prefix
    if GATED and PASS == 1:
        k_b = tl.maximum(tl.minimum(k_next, hi - lo), 1)
        prefix_b, _kb = _radix_state(hist_ptr, row64, n_rows, k_b, 1, run)
    if INTERPRET:  # NOTE: no tensor bounds in the interpreter's range()
        l0 = start
        while l0 < end:
            acc += _hist_tile(row_ptr, l0, lo, hi, prefix, PASS, BLOCK)
            if GATED and PASS == 1:
                acc_b += _hist_tile(row_ptr, l0, lo, hi, prefix_b, PASS, BLOCK)
            l0 += BLOCK
    else:
        for l0 in range(start, end, BLOCK):
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
    row64 = row.to(tl.int64)
    lo, hi, k_eff = _row_bounds(lo_ptr, hi_ptr, row // HKV, L, k_top)
    run = _gate(gate_ptr, row64, GATED)
    prefix, k_rem = _radix_state(hist_ptr, row64, n_rows, k_eff, 2, run)
    top16 = prefix >> 16
    c0 = chunk * CHUNK
    start = tl.maximum(c0, (lo // BLOCK) * BLOCK)
    end = tl.minimum(c0 + CHUNK, hi)
    end = tl.where((k_eff > 0) & run, end, start)
    row_ptr = scores_ptr + row64 * L
    out_row = out_ptr + row64 * k_top
    tie_row = tie_ptr + row64 * L
    cnt_row = cnt_ptr + row64 * 2
    if INTERPRET:  # NOTE: no tensor bounds in the interpreter's range()
        l0 = start
        while l0 < end:
            _split_tile(row_ptr, out_row, tie_row, cnt_row, l0, lo, hi, top16, BLOCK)
            l0 += BLOCK
    else:
        for l0 in range(start, end, BLOCK):
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
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    lo, hi, k_eff = _row_bounds(lo_ptr, hi_ptr, row // HKV, L, k_top)
    run = _gate(gate_ptr, row64, GATED)
    prefix, k_rem = _radix_state(hist_ptr, row64, n_rows, k_eff, 2, run)
    n_gt16 = k_eff - k_rem  # sure winners already written by _radix_split_kernel
    d1 = ((prefix >> 16) & 0xFF).to(tl.int32)
    n_tie = tl.load(hist_ptr + (n_rows + row64) * 256 + d1, mask=run, other=0)  # elements tied on 16 bits
    n_tie = tl.where((k_eff > 0) & run, n_tie, 0)
    row_ptr = scores_ptr + row64 * L
    tie_row = tie_ptr + row64 * L
    out_row = out_ptr + row64 * k_top
    for p in tl.static_range(2, 4):
        acc = tl.zeros([256], dtype=tl.int32)
        if INTERPRET:  # NOTE: no tensor bounds in the interpreter's range()
            t0 = n_tie * 0
            while t0 < n_tie:
                acc += _tie_hist_tile(row_ptr, tie_row, t0, n_tie, prefix, p, BLOCK)
                t0 += BLOCK
        else:
            for t0 in range(0, n_tie, BLOCK):
                acc += _tie_hist_tile(row_ptr, tie_row, t0, n_tie, prefix, p, BLOCK)
        d, k_rem = _pick_digit(acc, k_rem)
        prefix = prefix | (d.to(tl.uint32) << (24 - 8 * p))
    n_gt = n_gt16
    n_eq = k_eff - k_rem  # the first slot of the ties equal to T
    if INTERPRET:
        t0 = n_tie * 0
        while t0 < n_tie:
            c_gt, c_eq = _tie_emit_tile(row_ptr, out_row, tie_row, t0, n_tie, prefix, n_gt, n_eq, k_eff, BLOCK)
            n_gt += c_gt
            n_eq += c_eq
            t0 += BLOCK
    else:
        for t0 in range(0, n_tie, BLOCK):
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
def _carry_expand_kernel(mask_ptr, counts_ptr, pos_ptr, lo_ptr, hi_ptr, L, NW, E, HKV: tl.constexpr,
                         WB: tl.constexpr, CAP: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr = False):
    """Threshold-carry top-K, select side, step 2 of 3; grid (rows, E): each tile of WB
    bitmask words writes the positions of its set bits to the row's ``pos`` [rows, CAP]
    from the slot the tiles before it end at (the counts' prefix sum: the list is in
    position order, the same on every run), those past CAP dropped. Many programs per
    row: one program expanding a 512k-token row's 16k words alone took ~90 us."""
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
        for j in tl.static_range(32):
            b = (word >> j) & 1
            tl.store(pos_row + slot, wi * 32 + j, mask=(b != 0) & (slot < CAP))
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
def _carry_select_kernel(scores_ptr, carry_ptr, counts_ptr, out_ptr, lo_ptr, hi_ptr, ws_ptr, L, k_top, k_next, pos_ptr,
                         E, n_rows, HKV: tl.constexpr, CAP: tl.constexpr, BLOCK_E: tl.constexpr,
                         BITS: tl.constexpr = 8, PDL: tl.constexpr = False):
    """Threshold-carry top-K, select side, step 3 of 3; one program per row.

    The scoring kernel marked the row's candidates (scores >= the carried threshold)
    in a bitmask, which ``_carry_count_kernel`` / ``_carry_expand_kernel`` turned into
    their count (``counts`` [rows, E] per tile of words) and positions (``pos``
    [rows, CAP], position order). When the count ``n`` lies in ``[k_top, CAP]`` the
    K-th largest among them is the row's K-th largest (everything outside is below the
    threshold): an exact radix select on the candidates' scores held in registers,
    then the winners are written, and the next threshold is set by the secant through
    (threshold, n) and (K-th score, k_top) to let about ``k_next`` keys through.
    Otherwise (first call: threshold -inf; too few or too many candidates; a row with
    at most k_top valid keys) the row's fallback flag is set and the radix passes,
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
    ok = (k_eff == k_top) & (k_eff > 0) & (n_c >= k_eff) & (n_c <= CAP)
    if ok:
        offs = tl.arange(0, CAP)
        m = offs < n_c
        pos = tl.load(pos_row + offs, mask=m, other=0)
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


CARRY_MARGIN = 1.5
"""Threshold-carry top-K: the next threshold aims at ``CARRY_MARGIN * k_top`` candidates
(``SELECT_CONFIG["carry_margin"]`` overrides); the candidate list holds 1.25x that."""


def carry_sizes(k_top: int, margin: float | None = None) -> tuple[int, int]:
    """(k_next, CAP) of the threshold-carry top-K for ``k_top``: the candidates the next
    threshold aims at (> k_top) and the capacity of the candidate list (a power of two:
    the select kernel holds it in registers). ``margin``: the caller's (a policy that
    selects every few steps wants more slack), else ``SELECT_CONFIG["carry_margin"]``,
    else ``CARRY_MARGIN``."""
    if margin is None:
        margin = float(SELECT_CONFIG.get("carry_margin", CARRY_MARGIN))
    margin = float(margin)
    if not margin > 1.0:
        raise ValueError(f"the carry margin must be > 1 (argument carry_margin or SELECT_CONFIG['carry_margin']), "
                         f"got {margin}")
    k_next = max(k_top + 1, math.ceil(margin * k_top))
    return k_next, triton.next_power_of_2(math.ceil(1.25 * k_next))


def new_carry(batch: int, n_kv_heads: int, device: torch.device | str) -> torch.Tensor:
    """A fresh threshold-carry state for ``score_topk(..., carry=)``: int32
    [B, Hkv, CARRY_SLOTS] (the slots: ``CARRY_SLOTS``); the threshold starts at -inf, so
    the first call selects through the fallback and sets it."""
    c = torch.zeros(batch, n_kv_heads, CARRY_SLOTS, dtype=torch.int32, device=device)
    c[..., 0] = _NEG_INF_BITS
    c[..., 4] = _NEG_INF_BITS
    c[..., 6] = _ONE_BITS
    return c


def reset_carry(carry: torch.Tensor) -> torch.Tensor:
    """Reset a carry state in place (a new sequence: its scores say nothing of the last)."""
    carry.zero_()
    carry[..., 0] = _NEG_INF_BITS
    carry[..., 4] = _NEG_INF_BITS
    carry[..., 6] = _ONE_BITS
    return carry


def carry_threshold(carry: torch.Tensor) -> torch.Tensor:
    """The next call's threshold in the last call's score units, float32 [B, Hkv]:
    the carried threshold per unit of query norm times the last call's query norm."""
    return carry[..., 4].view(torch.float32) * carry[..., 6].view(torch.float32)


def carry_stats(carry: torch.Tensor) -> dict:
    """Host summary of a carry state (reads the device): calls and fallbacks summed
    over rows, the fallback fraction, and the fallbacks with too many candidates (the
    others had too few, or were a row's first call or a row shorter than K)."""
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
                         f"tensor on {device} (scoring.new_carry), got {carry.dtype} {tuple(carry.shape)} "
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
                hkv: int, score: bool = True, select: bool = True, margin: float | None = None) -> None:
    """The threshold-carry top-K into ``idx`` [rows, k_top]: this call's threshold from
    the carried one and the query's norm (``_carry_prep_kernel``), scoring that marks
    the candidates above it in a bitmask per row, ``_carry_select_kernel``, then the
    radix passes gated on the rows it could not select (``_select_from_scores(gate=)``).
    ``score`` / ``select``: run only one half (the benchmark times them apart)."""
    rows, L = scores.shape[0], k.shape[2]
    k_next, cap = carry_sizes(k_top, margin)
    cfg = _carry_config(cap, k.device, rows)
    dev = k.device
    nw = triton.cdiv(L + 2048, 32)  # tiles of up to 2048 positions may end past L
    mask = torch.empty(rows, nw, dtype=torch.int32, device=dev)  # the candidate bitmask words
    if score:
        B, Hq, D = q.shape
        G = Hq // hkv
        _carry_prep_kernel[(rows,)](q, carry, q.stride(0), q.stride(1), q.stride(2), HKV=hkv, G=G,
                                    G_PAD=triton.next_power_of_2(G), D=D, BLOCK_D=triton.next_power_of_2(D),
                                    NORM=_CARRY_NORM[reduce], num_warps=1, **pdl_kwargs(q, "select"))
        _launch_scores(q, k, scores.view(-1, hkv, L), lo, hi, n_lo, n_hi, scale=scale, reduce=reduce,
                       full_row=False, hist=None, k_scale=k_scale, carry=(carry, mask, nw))
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
        n_e = triton.cdiv(nw, wb)  # tiles of bitmask words per row
        block_e = triton.next_power_of_2(n_e)
        after = pdl_kwargs(scores, "select")  # a kernel after another of this stream may overlap its tail
        with contextlib.nullcontext() if side is None else torch.cuda.stream(side):
            counts = torch.empty(rows, n_e, dtype=torch.int32, device=dev)  # candidates per tile of words
            pos = torch.empty(rows, cap, dtype=torch.int32, device=dev)  # their positions
            ws = torch.empty(_NHIST * rows * _NBINS + 2 * rows, dtype=torch.int32, device=dev)  # zeroed per row
            wmeta = dict(HKV=hkv, WB=wb, num_warps=cfg["carry_expand_warps"])
            _carry_count_kernel[(rows, n_e)](mask, counts, lo, hi, L, nw, n_e, **wmeta, **launch)
            _carry_expand_kernel[(rows, n_e)](mask, counts, pos, lo, hi, L, nw, n_e, CAP=cap, BLOCK_E=block_e,
                                              **wmeta, **after)
            _carry_select_kernel[(rows,)](scores, carry, counts, idx, lo, hi, ws, L, k_top, k_next, pos, n_e, rows,
                                          HKV=hkv, CAP=cap, BLOCK_E=block_e, BITS=cfg["carry_bits"], num_warps=warps,
                                          **after)
            _select_from_scores(scores, lo, hi, k_top, hkv, ws, hist0_done=False, out=idx, gate=carry,
                                k_next=k_next, launch=after)
        if side is not None:  # the allocator reuses none of these before the side stream is done
            for t in (scores, mask, lo, hi, idx, carry):
                t.record_stream(side)


_OVERLAP = threading.local()  # .side: the side stream of an active select_overlap block
_SIDE_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def overlap_enabled(device: torch.device | str) -> bool:
    """Whether ``select_overlap`` on ``device`` overlaps: ``SPADE_SELECT_OVERLAP``
    (``auto``/unset, ``on``, ``off``; ``auto`` means ``OVERLAP_DEFAULT``), and only on a
    CUDA device with compiled kernels (on a CPU and under the interpreter every kernel
    runs in order anyway)."""
    mode = env("SPADE_SELECT_OVERLAP")
    on = OVERLAP_DEFAULT if mode == "auto" else mode == "on"
    return on and torch.device(device).type == "cuda" and not _interpret()


OVERLAP_DEFAULT = True
"""``SPADE_SELECT_OVERLAP=auto``: whether ``select_overlap`` blocks overlap. On since run47
(1x H200, int4 keys, K=2048, P=4): a pack's selection 0.89x / 0.93x / 0.88x of the serial one
at B=8 32k / B=16 32k / B=32 16k, the cache rank's pack 0.52x / 0.75x / 0.75x of the inference
pack (Table 3) vs 0.56x / 0.79x / 0.84x."""


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = _device_index(device)
    prio = int(SELECT_CONFIG.get("carry_overlap_priority", 0))
    key = (index, prio)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=index, priority=prio)
    return _SIDE_STREAMS[key]


@contextlib.contextmanager
def select_overlap(device: torch.device | str, enabled: bool | None = None):
    """Within the block, each threshold-carry select kernel (``score_topk(..., carry=)``)
    runs on a side stream after its own scoring, so the caller's stream goes straight
    on to the next call's scoring: layer j's select (one program per row, latency-bound)
    runs beside layer j+1's scoring (bandwidth-bound). On exit the current stream waits
    for the side stream: the indices (and the carries) are ready there, not before —
    read no ``score_topk`` result inside the block. Each call's scores must be its own
    buffer (``score_topk_triton`` allocates one per call). Capturable in a CUDA graph
    (a fork and a join of the capturing stream). A no-op on a CPU, under the
    interpreter, when ``enabled`` is False or (``enabled=None``) ``overlap_enabled`` says
    no, and nested in another block (the outer one joins). Calls on another device, or
    launched from another stream than the one current at entry, are not covered: the
    join waits on the entry stream only (calls on another device run in order).

    >>> with select_overlap(k.device):  # doctest: +SKIP
    ...     idx = [score_topk_triton(q[j], k[j], lo, hi, K, carry=c[j]) for j in range(4)]
    """
    dev = torch.device(device)
    on = overlap_enabled(dev) if enabled is None else (
        bool(enabled) and dev.type == "cuda" and not _interpret())
    if not on or getattr(_OVERLAP, "side", None) is not None:
        yield
        return
    cur = torch.cuda.current_stream(dev)
    _OVERLAP.side, _OVERLAP.index, _OVERLAP.forked = _side_stream(dev), _device_index(dev), False
    try:
        yield
    finally:
        side, _OVERLAP.side = _OVERLAP.side, None
        # join only what was forked: a block that launched nothing on the side stream
        # (every selection reused or dense) must not make a capturing stream wait on a
        # stream outside its capture (that invalidates the capture)
        if _OVERLAP.forked:
            cur.wait_stream(side)


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


def score_topk_triton(q: torch.Tensor, k: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k_top: int, *,
                      scale: float | None = None, reduce: str = "sum_logits",
                      kv_lens: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                      kv_start: torch.Tensor | None = None, out: torch.Tensor | None = None,
                      carry: torch.Tensor | None = None, carry_margin: float | None = None) -> torch.Tensor:
    """Fused scoring + exact top-K (see the module docstring): int32 [B, Hkv, k_top],
    written straight into ``out`` (contiguous int32 [B, Hkv, k_top]) when given, which
    is then returned (no copy). int8 ``k`` (``spade.kernels.quant``) with its
    ``k_scale`` [B, Hkv, L] reads half the key bytes of bf16.

    Keys outside ``[lo, hi)`` are not read (except the ``sum_softmax`` normaliser
    range, see ``_norm_range``).

    ``carry`` (``new_carry``; kept by the caller across calls of the same rows, e.g.
    per layer): the threshold-carry top-K instead of the radix passes. The scoring
    kernel compacts each row's scores above the threshold carried from the previous
    call, and one kernel selects exactly among them (``_carry_select_kernel``), or
    over the whole row when their count is off (the first call included). Same exact
    top-K; fewer passes over the row when consecutive calls score alike.
    ``carry_margin``: the next threshold aims at ``carry_margin * k_top`` candidates
    (``carry_sizes``; wider for callers whose consecutive calls are several steps apart).

    >>> idx = score_topk_triton(q, k, lo, hi, 2048)  # doctest: +SKIP
    """
    _check_reduce(reduce)
    B, Hq, Hkv, L, D = _check_qk(q, k)
    k_scale = _check_k_scale(k, k_scale)
    lo = _check_rows(lo, B, "lo", k.device)
    hi = _check_rows(hi, B, "hi", k.device)
    if kv_lens is not None:
        kv_lens = _check_rows(kv_lens, B, "kv_lens", k.device)
    if kv_start is not None:
        kv_start = _check_rows(kv_start, B, "kv_start", k.device)
    if k_top < 0:
        raise ValueError(f"k_top must be >= 0, got {k_top}")
    _check_out(out, B, Hkv, k_top, k.device)
    _check_carry(carry, B, Hkv, k.device)
    if k_top == 0 or B * Hkv == 0:
        if out is not None:
            return out.fill_(-1)
        return torch.full((B, Hkv, k_top), -1, dtype=torch.int32, device=k.device)
    rows = B * Hkv
    n_lo, n_hi = _norm_range(lo, hi, kv_lens, reduce, kv_start)
    if carry is not None:
        scores = torch.empty(rows, L, dtype=torch.float32, device=k.device)
        idx = torch.empty(rows, k_top, dtype=torch.int32, device=k.device) if out is None else out.view(rows, k_top)
        _carry_topk(q, k, scores, lo, hi, n_lo, n_hi, k_top, carry, idx, scale=_default_scale(scale, D),
                    reduce=reduce, k_scale=k_scale, hkv=Hkv, margin=carry_margin)
        return idx.view(B, Hkv, k_top) if out is None else out
    fuse = SELECT_CONFIG.get("fuse_hist", True)
    ws = _new_workspace(rows, k.device)
    scores = torch.empty(rows, L, dtype=torch.float32, device=k.device)  # [B*Hkv, L]; only [lo, hi) written
    _launch_scores(q, k, scores, lo, hi, n_lo, n_hi, scale=_default_scale(scale, D), reduce=reduce,
                   full_row=False, hist=ws if fuse else None, k_scale=k_scale)
    idx = _select_from_scores(scores, lo, hi, k_top, Hkv, ws, hist0_done=fuse,
                              out=None if out is None else out.view(rows, k_top))
    return idx.view(B, Hkv, k_top) if out is None else out

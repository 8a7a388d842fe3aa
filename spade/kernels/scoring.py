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
the keys, so the keys are still read once). Over int8 / int4 keys the first
kernel is ``_i8dot_logits_kernel``: every head's logits from one int8 tensor-core
dot per key tile (each head's query in fixed-point digits), as ``sum_logits``'
GEMV does for the group's summed query.

The top-K over the scores: ``spade.kernels.radix_topk`` (exact radix select, the
default) and ``spade.kernels.carry`` (threshold carry, ``carry=``); ``select_overlap``
(``spade.kernels.overlap``) runs the carry's select beside the next call's scoring.

Everything is sized from tensor shapes only (no host sync), so the ops can be
captured in a CUDA graph.

Paged cache (``block_table`` [B, max_blocks] int32, ``spade.kernels.paged``): ``k`` is
then a pool [num_blocks, Hkv, block_size, D] (int8 / int4 copies: with ``k_scale`` a
pool [num_blocks, Hkv, block_size]), positions (``lo``/``hi``, ``kv_lens``, the scores'
L = max_blocks * block_size and the returned indices) stay logical and each key tile's
rows (and scales) are mapped through the table at their load. The float GEMV tile of
``sum_logits`` is not paged: paged int8 / int4 keys take the int8 tensor-core kernels,
or the float tile when those are switched off (``GEMV_CONFIG["int8_dot"]``).

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

import torch
import triton
import triton.language as tl

from spade.kernels.carry import (_CARRY_SEG, CARRY_COMPACT, CARRY_MARK, CARRY_SEG, _carry_mask, _carry_row,
                                 _carry_topk, _check_carry, carry_fits)
from spade.kernels.paged import check_block_table, cut_logical, paged_launch, paged_slots, paged_to_contiguous, tile_of
from spade.kernels.common import _check_rows, _interpret, _load_group_q, _range_mask, _split, dot_t, loop_bound, online_softmax_rows
from spade.kernels.pdl import grid_dep_release, grid_dep_wait, pdl_kwargs
from spade.kernels.quant import unpack_int4
from spade.kernels.radix_topk import (SELECT_CONFIG, _f32_key, _new_workspace, _select_from_scores,
                                      topk_from_scores_ref, topk_from_scores_triton)

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


# ----------------------------------------------------------------------------------------------
# Shared host-side helpers
# ----------------------------------------------------------------------------------------------


def _check_reduce(reduce: str) -> None:
    if reduce not in REDUCES:
        raise ValueError(f"reduce must be one of {REDUCES}, got {reduce!r}")


def _check_qk(q: torch.Tensor, k: torch.Tensor,
              block_table: torch.Tensor | None = None) -> tuple[int, int, int, int, int]:
    """Validate ``q`` [B, Hq, D] against ``k`` [B, Hkv, L, D] (paged: a pool
    [num_blocks, Hkv, block_size, D] and its table); return (B, Hq, Hkv, L, D), L logical."""
    if q.dim() != 3 or k.dim() != 4:
        raise ValueError(f"expected q [B, Hq, D] and k [B, Hkv, L, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, Hq, D = q.shape
    Bk, Hkv, L, Dk = k.shape
    if block_table is not None:
        check_block_table(block_table, B, k.device)
        Bk, L = B, block_table.shape[1] * k.shape[2]
    if k.dtype == torch.uint8:  # packed int4: two channels per byte
        Dk *= 2
    if B != Bk or D != Dk:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head_dim")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    if q.device != k.device:
        raise ValueError(f"q on {q.device} but k on {k.device}")
    return B, Hq, Hkv, L, D


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


def _softmax_config(device: torch.device, part: str, kint4: bool = False) -> dict:
    """Launch config of a ``sum_softmax`` pass: ``part`` "logits" (each head's logits over
    int8 / int4 keys on the int8 tensor cores, ``_i8dot_logits_kernel``) or "finalize"
    (``_softmax_finalize_kernel``, which streams those logits). ``SCORE_CONFIG`` overrides
    both (the tests' small tiles); ``SOFTMAX_CONFIG``'s ``logits_*`` / ``finalize_*`` keys
    override one."""
    if _interpret() or device.type != "cuda":
        cfg = dict(BLOCK_L=128, num_warps=1, num_stages=1, MIN_CHUNK=256, PER_SM=4)
    elif part == "logits":
        cfg = dict(SOFTMAX_GPU["logits_int4" if kint4 else "logits_int8"])
    else:
        cfg = dict(SOFTMAX_GPU["finalize"])
    cfg.update({key: v for key, v in SCORE_CONFIG.items() if key in cfg})
    cfg.update({key[len(part) + 1:]: v for key, v in SOFTMAX_CONFIG.items() if key.startswith(part + "_")})
    return cfg


SOFTMAX_GPU = {
    # bench_scoring --softmax-sweep 16x16384,8x32768 on an H200 (kernel device time per call, the
    # threshold-carry path): int4 logits 57 us at 256-key tiles of 4 warps against 67 at 64 / 4 warps;
    # int8 logits best at 64 / 4 (82 us; 84-97 at larger tiles); the finalize 12-17 us at 1024-position
    # tiles of 8 warps (four programs per SM) against 41-61 us at 64 and the group padded to 16 rows
    "logits_int4": dict(BLOCK_L=256, num_warps=4, num_stages=3, MIN_CHUNK=512, PER_SM=8),
    "logits_int8": dict(BLOCK_L=64, num_warps=4, num_stages=3, MIN_CHUNK=256, PER_SM=16),
    "finalize": dict(BLOCK_L=1024, num_warps=8, num_stages=1, MIN_CHUNK=1024, PER_SM=4),
}
"""``sum_softmax``'s two passes on a GPU (``_softmax_config``)."""

SOFTMAX_CONFIG: dict = {}
"""Overrides of ``sum_softmax``'s two passes, ``logits_<key>`` / ``finalize_<key>`` (``BLOCK_L``,
``num_warps``, ``num_stages``, ``MIN_CHUNK``, ``PER_SM``); the benchmark sweeps them."""


PAGED_TILES_MAX = 16
"""Paged scoring: key tiles whose slots a program maps through the block table at a
time (registers: PAGED_TILES_MAX x BLOCK_L int32 per program)."""

SCORE_CONFIG: dict = {}
"""Overrides for the scoring kernels' launch config (``BLOCK_L``, ``num_warps``,
``num_stages``, ``MIN_CHUNK``, ``PER_SM``, and ``LANE_STATS``: the ``sum_softmax``
online statistics per tile element, reduced once per chunk, an experiment against
the per-tile cross-lane reductions); empty = the built-in heuristic."""


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


def _logical_keys(k: torch.Tensor, block_table: torch.Tensor | None, lo: torch.Tensor,
                  hi: torch.Tensor, k_scale: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The keys (and int8 / int4 scales) as the reference reads them: ``k`` itself, or
    the pool's logical copy through ``block_table`` with every position outside
    ``[lo, hi)`` zeroed (keys a row does not own may be garbage, NaN included, and must
    not reach a score)."""
    if block_table is None:
        return k, k_scale
    kl = paged_to_contiguous(k, block_table)  # [B, Hkv, L, D]
    keep = _range_mask(lo.to(k.device), hi.to(k.device), kl.shape[2])[:, None, :, None]
    kl = torch.where(keep, kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
    if k_scale is not None:  # [num_blocks, Hkv, bs] -> [B, Hkv, L], zeroed like the keys
        sl = paged_to_contiguous(k_scale.unsqueeze(-1), block_table).squeeze(-1)
        k_scale = torch.where(keep[..., 0], sl, torch.zeros((), dtype=sl.dtype, device=sl.device))
    return kl, k_scale


def _reduce_ref(logits: torch.Tensor, norm: torch.Tensor, out: torch.Tensor, reduce: str) -> torch.Tensor:
    """Group-reduce ``logits`` [B, Hkv, G, L]; ``norm`` [B, L] or [B, Hkv, L] is the softmax
    support, ``out`` (same shapes) the positions kept (others ``-inf``). Returns [B, Hkv, L]
    float32."""
    norm = norm[:, None] if norm.dim() == 2 else norm
    out = out[:, None] if out.dim() == 2 else out
    neg = torch.tensor(float("-inf"), device=logits.device)
    if reduce == "sum_logits":
        s = logits.sum(2)
    elif reduce == "max_logits":
        s = logits.amax(2)
    else:
        masked = torch.where(norm[:, :, None, :], logits, neg)
        p = torch.softmax(masked, dim=-1).nan_to_num(0.0)  # rows with no support -> 0
        s = p.sum(2)
    return torch.where(out, s, neg).float()


def group_scores_ref(q: torch.Tensor, k: torch.Tensor, kv_lens: torch.Tensor, *, scale: float | None = None,
                     reduce: str = "sum_logits", kv_start: torch.Tensor | None = None,
                     k_scale: torch.Tensor | None = None, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of ``group_scores``: [B, Hkv, L] float32, ``-inf`` outside ``[kv_start, kv_lens)``."""
    _check_reduce(reduce)
    B, Hq, Hkv, L, D = _check_qk(q, k, block_table)
    k_scale = _check_k_scale(k, k_scale)
    _check_rows(kv_lens, B, "kv_lens")
    start = torch.zeros_like(kv_lens) if kv_start is None else _check_rows(kv_start, B, "kv_start")
    valid = _range_mask(start.to(k.device), kv_lens.to(k.device), L)
    k, k_scale = _logical_keys(k, block_table, start, kv_lens, k_scale)
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
                   carry: torch.Tensor | None = None, carry_margin: float | None = None,
                   block_table: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of ``score_topk``: full scores, then ``torch.topk`` (the naive baseline);
    copied into ``out`` when given (and ``out`` returned). ``carry`` is checked and left
    as it is: the threshold carry only changes how the Triton path finds the same top-K."""
    _check_reduce(reduce)
    B, Hq, Hkv, L, D = _check_qk(q, k, block_table)
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
    top = torch.maximum(hi, n_hi)
    if k.device.type == "cpu" and B > 0:  # (the CPU's select: read no position past the rows' ranges)
        L, block_table, k, k_scale = cut_logical(int(top.max()), L, block_table, k.shape[2], k, k_scale)
    k, k_scale = _logical_keys(k, block_table, torch.minimum(lo, n_lo), top, k_scale)
    logits = _group_logits_ref(q, k, _default_scale(scale, D), k_scale)
    all_pos = torch.ones(B, L, dtype=torch.bool, device=k.device)
    scores = _reduce_ref(logits, _range_mask(n_lo, n_hi, L), all_pos, reduce)
    idx = topk_from_scores_ref(scores, lo, hi, k_top)
    return idx if out is None else out.copy_(idx)


# ----------------------------------------------------------------------------------------------
# Triton: scoring kernels
# ----------------------------------------------------------------------------------------------


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
    the valid positions — and add their radix pass-0 digits to ``hist``. CARRY 1 / 2
    (``spade.kernels.carry``): also mark the tile's candidates (valid scores ``>= thr``)
    in the row's bitmask (``_carry_mask``); 2 stores only their scores, each
    ``CARRY_SEG``-position segment's at its front in position order (tiles hold whole
    segments)."""
    if CARRY == 2:
        BL: tl.constexpr = r.shape[0]
        is_c = (valid & (r >= thr)).to(tl.int32)
        c2 = tl.reshape(is_c, [BL // _CARRY_SEG, _CARRY_SEG])
        rank = tl.reshape(tl.cumsum(c2, axis=1) - c2, [BL])
        tl.store(out_ptr + row64 * L + (offs_l // _CARRY_SEG) * _CARRY_SEG + rank, r, mask=is_c != 0)
    elif FULL_ROW:
        tl.store(out_ptr + row64 * L + offs_l, r, mask=offs_l < c1)
    else:
        tl.store(out_ptr + row64 * L + offs_l, r, mask=valid)
    if HIST:
        digit = ((_f32_key(r) >> 24) & 0xFF).to(tl.int32)
        hist += tl.histogram(digit, 256, mask=valid)
    if CARRY == 1 or CARRY == 2:
        _carry_mask(r, offs_l, valid, thr, mask_row)
    return hist


@triton.jit
def _score_tile(q, q2, k_base, ks_base, out_ptr, row64, l0, lo, hi, c1, L, scale, stride_kl, stride_kd,
                stride_sl, hist, m_run, s_run, thr, cand_row,
                G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_L: tl.constexpr, REDUCE: tl.constexpr, FULL_ROW: tl.constexpr, HIST: tl.constexpr,
                UPCAST: tl.constexpr, IEEE: tl.constexpr, KINT8: tl.constexpr, LANE_STATS: tl.constexpr,
                KINT4: tl.constexpr, CARRY: tl.constexpr, k_rows=None, ks_rows=None, PAGED: tl.constexpr = False):
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
    if not PAGED:  # (PAGED: the tile's rows in the pools, mapped before the loop: _tile_rows)
        k_rows, ks_rows = _logical_rows(offs_l, stride_kl, stride_sl)
    kt = tl.load(k_base + k_rows[:, None] + offs_d[None, :] * stride_kd,
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
        s = dot_t(q, kt, IEEE)
    s = s * scale  # [G_PAD, BLOCK_L] fp32 logits
    if KINT8 or KINT4:
        ksv = tl.load(ks_base + ks_rows, mask=valid, other=0.0)  # [BLOCK_L] fp32
        s = s * ksv[None, :]
    if REDUCE == 2:
        ptrs = out_ptr + (row64 * G + offs_g[:, None]) * L + offs_l[None, :]
        tl.store(ptrs, s, mask=g_mask[:, None] & valid[None, :])
        sm = tl.where(valid[None, :], s, float("-inf"))
        if LANE_STATS:
            m_new = tl.maximum(m_run, sm)  # [G_PAD, BLOCK_L]
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no NaN from (-inf) - (-inf)
            s_run = s_run * tl.exp(m_run - m_safe) + tl.exp(sm - m_safe)
            m_run = m_new
        else:
            m_run, s_run = online_softmax_rows(m_run, s_run, sm)
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
    BT=None, stride_tb: tl.constexpr = 0, PAGED: tl.constexpr = False, BLOCK_SIZE: tl.constexpr = 1,
    PAGED_TILES: tl.constexpr = 1,
):
    """Stage 1: score one chunk of one (b, KV head) row.

    PAGED: ``k_ptr`` is a pool [num_blocks, HKV, BLOCK_SIZE, D] read through the block
    tables ``BT`` [B, max_blocks]; L and every position stay logical. PAGED_TILES tiles of
    positions are mapped to slots at a time, before an inner loop that loads only keys.

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
    if PAGED:
        k_base = k_ptr + h.to(tl.int64) * stride_kh
        ks_base = ks_ptr + h.to(tl.int64) * stride_sh  # only read for int8 / int4 keys
        bt_row = BT + b.to(tl.int64) * stride_tb
    else:
        k_base = k_ptr + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
        ks_base = ks_ptr + b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh  # only read for int8 / int4
    row64 = row.to(tl.int64)
    thr, cand_row, end = _carry_row(carry_ptr, cand_ptr, row64, NW, start, end, CARRY)

    hist = tl.zeros([256], dtype=tl.int32)
    if LANE_STATS:
        m_run = tl.full([G_PAD, BLOCK_L], float("-inf"), tl.float32)
        s_run = tl.zeros([G_PAD, BLOCK_L], dtype=tl.float32)
    else:
        m_run = tl.full([G_PAD], float("-inf"), tl.float32)
        s_run = tl.zeros([G_PAD], dtype=tl.float32)
    if PAGED:
        for r0 in range(loop_bound(start, INTERPRET), loop_bound(end, INTERPRET), PAGED_TILES * BLOCK_L):
            r0t = tl.minimum(r0, end)  # = r0, as a tensor (the interpreter's r0 is an int)
            tiles, r1 = _paged_tiles(r0t, end, lo, hi, bt_row, BLOCK_L, BLOCK_SIZE, PAGED_TILES)
            for l0 in range(loop_bound(r0t, INTERPRET), loop_bound(r1, INTERPRET), BLOCK_L):
                k_rows, ks_rows = _tile_rows(tiles, (l0 - r0t) // BLOCK_L, stride_kb, stride_kl, stride_sb,
                                             stride_sl, BLOCK_L, BLOCK_SIZE, PAGED_TILES)
                hist, m_run, s_run = _score_tile(q, q2, k_base, ks_base, out_ptr, row64, l0, lo, hi, c1, L, scale,
                                                 stride_kl, stride_kd, stride_sl, hist, m_run, s_run, thr,
                                                 cand_row, G, G_PAD, D, BLOCK_D, BLOCK_L, REDUCE, FULL_ROW, HIST,
                                                 UPCAST, IEEE, KINT8, LANE_STATS, KINT4, CARRY, k_rows, ks_rows,
                                                 PAGED)
    else:
        for l0 in range(loop_bound(start, INTERPRET), loop_bound(end, INTERPRET), BLOCK_L):
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
    thr, cand_row, end = _carry_row(carry_ptr, cand_ptr, row64, NW, start, end, CARRY)
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
    for l0 in range(loop_bound(start, INTERPRET), loop_bound(end, INTERPRET), BLOCK_L):
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
    thr, cand_row, end = _carry_row(carry_ptr, cand_ptr, row64, NW, start, end, CARRY)
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
    for l0 in range(loop_bound(start, INTERPRET), loop_bound(end, INTERPRET), BLOCK_L):
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
    BT=None, stride_tb: tl.constexpr = 0, PAGED: tl.constexpr = False, BLOCK_SIZE: tl.constexpr = 1,
    PAGED_TILES: tl.constexpr = 1, PACK: tl.constexpr = 1,
):
    """``sum_logits`` over int8 keys on the int8 tensor cores, with no per-element
    conversion of the keys. PAGED: ``k_ptr`` / ``ks_ptr`` are pools read through the
    block tables ``BT``, PAGED_TILES tiles mapped at a time (``_paged_tiles``), as in
    ``_score_kernel``.

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
    tile. No nibble masks, no offsets.

    PACK = 4 (KINT4, a power-of-two row of D bytes; BLOCK_D = 4 D): four consecutive
    tokens share one MMA row. The tile is [BLOCK_L / 4, 4 D] (the same bytes, read as
    whole rows of 4 D bytes) and the digit matrices are block-diagonal, token slot ``t``'s
    digits in columns ``4t .. 4t + 3``, so the 16 output columns all carry digits (one
    token's four otherwise, twelve zeros): the same multiply-adds, a quarter of the
    epilogue's rows, and no masked half tile at short rows (D = 16 bytes: r = 32
    channels). The int32 dots are PACK = 1's; the scores differ only in fp32's order of
    summing the four digits and the offset."""
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    b = row // HKV
    h = row % HKV
    lo, hi, c1, start, end = _chunk_span(lo_ptr, hi_ptr, b, chunk, L, CHUNK, BLOCK_L, FULL_ROW)
    row64 = row.to(tl.int64)
    thr, cand_row, end = _carry_row(carry_ptr, cand_ptr, row64, NW, start, end, CARRY)
    offs_d = tl.arange(0, BLOCK_D)
    ch = offs_d % D if PACK > 1 else offs_d  # PACK: column j holds channel j % D of token slot j // D
    offs_g = tl.arange(0, G_PAD)
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + (h * G + offs_g)[:, None] * stride_qh + ch[None, :] * stride_qd
    q_mask = (offs_g[:, None] < G) & (ch[None, :] < D)
    qg = tl.load(q_rows, mask=q_mask, other=0.0).to(tl.float32)  # [G_PAD, BLOCK_D]
    qs = tl.sum(qg, axis=0) * scale  # [BLOCK_D] fp32 (KINT4: the first channel half; PACK: PACK copies)
    amax = tl.max(tl.abs(qs), axis=0)
    if KINT4:
        qs2 = tl.sum(tl.load(q_rows + D * stride_qd, mask=q_mask, other=0.0).to(tl.float32), axis=0) * scale
        # one scale for x and z = y - 16 x̂ (|z| <= max|y| + 17 max|x|), so both dots add
        # into one int32 accumulator; 30 bits leave x's step far below fp32's own rounding
        amax = tl.max(tl.abs(qs2), axis=0) + 17.0 * amax
    s = tl.where(amax > 0, amax / 1.0e9, 1.0)  # |qi| <= ~1e9 < 2^30 (fp32 division may round up a little)
    qi = tl.floor(qs / s + 0.5).to(tl.int32)  # [BLOCK_D]: qs in fixed point, as exact as fp32 holds it
    slot = offs_d // D if PACK > 1 else offs_d * 0  # each column's token slot
    qm = _q_digits(qi, slot)  # [BLOCK_D, 16] int8
    if KINT4:
        z = qs2 - 16.0 * (qi.to(tl.float32) * s)  # [BLOCK_D]: y - 16 x̂
        qm2 = _q_digits(tl.floor(z / s + 0.5).to(tl.int32), slot)
        # the low nibbles' offset, times x̂ (PACK: over PACK copies of x̂, a power of two: exact)
        c_off = 8.0 * s * tl.sum(qi.to(tl.float32), axis=0) / PACK
    else:
        qm2 = qm  # unused
        c_off = 0.0
    col = tl.arange(0, 16)[None, :]
    w = tl.where(col < 4 * PACK, tl.where(col % 4 == 0, 1.0, tl.where(col % 4 == 1, 256.0, tl.where(
        col % 4 == 2, 65536.0, 16777216.0))), 0.0) * s  # [1, 16] fp32: the digits' weights
    k_base, ks_base, bt_row = _row_bases(k_ptr, ks_ptr, BT, b, h, stride_kb, stride_kh, stride_sb, stride_sh,
                                         stride_tb, PAGED)
    hist = tl.zeros([256], dtype=tl.int32)
    if PAGED:
        for r0 in range(loop_bound(start, INTERPRET), loop_bound(end, INTERPRET), PAGED_TILES * BLOCK_L):
            r0t = tl.minimum(r0, end)  # = r0, as a tensor (the interpreter's r0 is an int)
            tiles, r1 = _paged_tiles(r0t, end, lo, hi, bt_row, BLOCK_L, BLOCK_SIZE, PAGED_TILES)
            for l0 in range(loop_bound(r0t, INTERPRET), loop_bound(r1, INTERPRET), BLOCK_L):
                k_rows, s_rows = _tile_rows(tiles, (l0 - r0t) // BLOCK_L, stride_kb, stride_kl, stride_sb,
                                            stride_sl, BLOCK_L, BLOCK_SIZE, PAGED_TILES, PACK)
                hist = _i8dot_tile(qm, qm2, w, c_off, k_base, ks_base, out_ptr, row64, l0, lo, hi, c1, L,
                                   stride_kl, stride_kd, stride_sl, hist, thr, cand_row, D, BLOCK_D, BLOCK_L,
                                   FULL_ROW, HIST, KINT4, ASM4, CARRY, k_rows, s_rows, PAGED, PACK)
    else:
        for l0 in range(loop_bound(start, INTERPRET), loop_bound(end, INTERPRET), BLOCK_L):
            hist = _i8dot_tile(qm, qm2, w, c_off, k_base, ks_base, out_ptr, row64, l0, lo, hi, c1, L,
                               stride_kl, stride_kd, stride_sl, hist, thr, cand_row, D, BLOCK_D, BLOCK_L,
                               FULL_ROW, HIST, KINT4, ASM4, CARRY, PACK=PACK)
    if HIST:
        tl.atomic_add(hist_ptr + row64 * 256 + tl.arange(0, 256), hist, mask=hist > 0)


@triton.jit
def _i8dot_logits_kernel(
    q_ptr, k_ptr, ks_ptr, out_ptr, stats_ptr, lo_ptr, hi_ptr,
    stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kl, stride_kd, stride_sb, stride_sh, stride_sl,
    L, CHUNK, N_CHUNKS, scale,
    HKV: tl.constexpr, G: tl.constexpr, GH: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr, INTERPRET: tl.constexpr, KINT4: tl.constexpr, ASM4: tl.constexpr,
    PDL: tl.constexpr = False, BT=None, stride_tb: tl.constexpr = 0, PAGED: tl.constexpr = False,
    BLOCK_SIZE: tl.constexpr = 1, PAGED_TILES: tl.constexpr = 1,
):
    """``sum_softmax`` stage 1 over int8 / int4 keys on the int8 tensor cores (PAGED: pools
    read through the block tables ``BT``, ``_paged_tiles``): the G
    heads' logits of one chunk of one (b, KV head) row into ``out`` [B*HKV, G, L] (over
    ``[lo, hi)``) and the chunk's online (max, sum-exp) per head into ``stats``
    [B*HKV, G, N_CHUNKS, 2]: what ``_score_kernel`` writes in its stage-1 mode, for
    ``_softmax_finalize_kernel``.

    Each head's query goes in fixed point under its own scale and four int8 digits, as
    in ``_i8dot_score_kernel``; the digit matrix holds head ``g``'s digits in columns
    ``4g .. 4g + 3`` (GH head slots: 4 GH columns, 16 at least, the smallest MMA width),
    so one int8 ``tl.dot`` per key tile (two for int4: the raw bytes and their high
    nibbles) gives every head's four partial dots: the G heads cost what the summed
    query of ``sum_logits`` costs, where the float tile pads them to 16 MMA rows and
    converts every key element."""
    grid_dep_wait(PDL)
    grid_dep_release(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    b = row // HKV
    h = row % HKV
    lo, hi, c1, start, end = _chunk_span(lo_ptr, hi_ptr, b, chunk, L, CHUNK, BLOCK_L, False)
    row64 = row.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_g = tl.arange(0, GH)
    g_ok = offs_g < G
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q_mask = g_ok[:, None] & (offs_d[None, :] < D)
    x = tl.load(q_rows, mask=q_mask, other=0.0).to(tl.float32) * scale  # [GH, BLOCK_D] (int4: first half)
    amax = tl.max(tl.abs(x), axis=1)  # [GH]
    if KINT4:
        y = tl.load(q_rows + D * stride_qd, mask=q_mask, other=0.0).to(tl.float32) * scale
        amax = tl.max(tl.abs(y), axis=1) + 17.0 * amax  # one scale per head for x and z = y - 16 x̂
    sc = tl.where(amax > 0, amax / 1.0e9, 1.0)  # [GH]
    qi = tl.floor(x / sc[:, None] + 0.5).to(tl.int32)  # [GH, BLOCK_D]
    NCOL: tl.constexpr = 4 * GH
    col = tl.arange(0, NCOL)
    own = (col // 4)[None, :] == offs_g[:, None]  # [GH, NCOL]: head g owns columns 4g .. 4g + 3
    qm = _head_digits(qi, own, col)  # [BLOCK_D, NCOL] int8
    if KINT4:
        z = y - 16.0 * (qi.to(tl.float32) * sc[:, None])
        qm2 = _head_digits(tl.floor(z / sc[:, None] + 0.5).to(tl.int32), own, col)
        c_off = 8.0 * sc * tl.sum(qi.to(tl.float32), axis=1)  # [GH]: the low nibbles' offset, per head
    else:
        qm2 = qm  # unused
        c_off = tl.zeros([GH], dtype=tl.float32)
    digit_w = tl.where(col % 4 == 0, 1.0, tl.where(col % 4 == 1, 256.0, tl.where(col % 4 == 2, 65536.0,
                                                                                16777216.0)))
    w = digit_w * tl.sum(tl.where(own, sc[:, None], 0.0), axis=0)  # [NCOL]: digit weight x its head's scale
    k_base, ks_base, bt_row = _row_bases(k_ptr, ks_ptr, BT, b, h, stride_kb, stride_kh, stride_sb, stride_sh,
                                         stride_tb, PAGED)
    m_run = tl.full([GH], float("-inf"), tl.float32)
    s_run = tl.zeros([GH], dtype=tl.float32)
    if PAGED:
        for r0 in range(loop_bound(start, INTERPRET), loop_bound(end, INTERPRET), PAGED_TILES * BLOCK_L):
            r0t = tl.minimum(r0, end)  # = r0, as a tensor (the interpreter's r0 is an int)
            tiles, r1 = _paged_tiles(r0t, end, lo, hi, bt_row, BLOCK_L, BLOCK_SIZE, PAGED_TILES)
            for l0 in range(loop_bound(r0t, INTERPRET), loop_bound(r1, INTERPRET), BLOCK_L):
                k_rows, s_rows = _tile_rows(tiles, (l0 - r0t) // BLOCK_L, stride_kb, stride_kl, stride_sb,
                                            stride_sl, BLOCK_L, BLOCK_SIZE, PAGED_TILES)
                m_run, s_run = _i8dot_logits_tile(
                    qm, qm2, w, c_off, k_base, ks_base, out_ptr, row64, l0, lo, hi, L, m_run, s_run, stride_kl,
                    stride_kd, stride_sl, G, GH, D, BLOCK_D, BLOCK_L, KINT4, ASM4, k_rows, s_rows, PAGED)
    else:
        for l0 in range(loop_bound(start, INTERPRET), loop_bound(end, INTERPRET), BLOCK_L):
            m_run, s_run = _i8dot_logits_tile(qm, qm2, w, c_off, k_base, ks_base, out_ptr, row64, l0, lo, hi, L,
                                              m_run, s_run, stride_kl, stride_kd, stride_sl, G, GH, D, BLOCK_D,
                                              BLOCK_L, KINT4, ASM4)
    st = stats_ptr + ((row64 * G + offs_g) * N_CHUNKS + chunk) * 2
    tl.store(st, m_run, mask=g_ok)
    tl.store(st + 1, s_run, mask=g_ok)


@triton.jit
def _i8dot_logits_tile(qm, qm2, w, c_off, k_base, ks_base, out_ptr, row64, l0, lo, hi, L, m_run, s_run,
                       stride_kl, stride_kd, stride_sl, G: tl.constexpr, GH: tl.constexpr, D: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, KINT4: tl.constexpr, ASM4: tl.constexpr,
                       k_rows=None, s_rows=None, PAGED: tl.constexpr = False):
    """One [BLOCK_L] key tile of ``_i8dot_logits_kernel`` (PAGED: at ``k_rows`` / ``s_rows``,
    ``_tile_rows``): stores the G heads' logits and returns the carried online (max,
    sum-exp) per head."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_g = tl.arange(0, GH)
    g_ok = offs_g < G
    offs_l = l0 + tl.arange(0, BLOCK_L)
    valid = (offs_l >= lo) & (offs_l < hi)
    if not PAGED:
        k_rows, s_rows = _logical_rows(offs_l, stride_kl, stride_sl)
    kt = tl.load(k_base + k_rows[:, None] + offs_d[None, :] * stride_kd,
                 mask=valid[:, None] & (offs_d[None, :] < D), other=0)  # [BLOCK_L, BLOCK_D]
    if KINT4:
        p = kt.to(tl.int8, bitcast=True)
        acc = tl.dot(p, qm, out_dtype=tl.int32)  # [BLOCK_L, NCOL]
        acc = tl.dot(_high_nibbles(p, ASM4), qm2, acc, out_dtype=tl.int32)
    else:
        acc = tl.dot(kt, qm, out_dtype=tl.int32)
    lg = tl.sum(tl.reshape(acc.to(tl.float32) * w[None, :], (BLOCK_L, GH, 4)), axis=2) - c_off[None, :]
    lg = lg * tl.load(ks_base + s_rows, mask=valid, other=0.0)[:, None]
    ptrs = out_ptr + (row64 * G + offs_g[None, :]) * L + offs_l[:, None]  # [BLOCK_L, GH]
    tl.store(ptrs, lg, mask=valid[:, None] & g_ok[None, :])
    sm = tl.where(valid[:, None], lg, float("-inf"))
    m_new = tl.maximum(m_run, tl.max(sm, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no NaN from (-inf) - (-inf)
    s_run = s_run * tl.exp(m_run - m_safe) + tl.sum(tl.exp(sm - m_safe[None, :]), axis=0)
    m_run = m_new
    return m_run, s_run


@triton.jit
def _head_digits(qi, own, col):
    """The digit matrix of ``_i8dot_logits_kernel``: ``qi`` [GH, BLOCK_D] int32, one
    fixed-point query per head, as [BLOCK_D, 4 GH] int8 with head ``g``'s four balanced
    digits (least significant first, ``_q_digits``) in columns ``4g .. 4g + 3``."""
    q_col = tl.sum(tl.where(own[:, None, :], qi[:, :, None], 0), axis=0)  # [BLOCK_D, NCOL]: its head's qi
    d0, d1, d2, d3 = _balanced_digits(q_col)
    j = (col % 4)[None, :]
    return tl.where(j == 0, d0, tl.where(j == 1, d1, tl.where(j == 2, d2, d3))).to(tl.int8)


@triton.jit
def _balanced_digits(qi):
    """Fixed-point ``qi`` (int32, |qi| <= ~1e9) as four balanced digits, least significant
    first: ``qi = d0 + 256 d1 + 65536 d2 + 2^24 d3`` (d0..d2 in [-128, 127], |d3| <= 64)."""
    d0 = ((qi + 128) & 255) - 128
    r = (qi - d0) >> 8  # exact: qi - d0 is a multiple of 256
    d1 = ((r + 128) & 255) - 128
    r = (r - d1) >> 8
    d2 = ((r + 128) & 255) - 128
    d3 = (r - d2) >> 8
    return d0, d1, d2, d3


@triton.jit
def _q_digits(qi, slot):
    """The digit matrix of ``_i8dot_score_kernel``: the fixed-point query ``qi``
    [BLOCK_D] int32 as its four balanced digits (``_balanced_digits``) in a [BLOCK_D, 16]
    int8 matrix, row ``j``'s in columns ``4 slot[j] .. 4 slot[j] + 3`` (zeros elsewhere):
    columns 0..3 for one token per row (``slot`` 0), block-diagonal under PACK."""
    d0, d1, d2, d3 = _balanced_digits(qi)
    col = tl.arange(0, 16)[None, :]
    j = col % 4
    dig = tl.where(j == 0, d0[:, None], tl.where(j == 1, d1[:, None], tl.where(j == 2, d2[:, None], d3[:, None])))
    return tl.where(slot[:, None] == col // 4, dig, 0).to(tl.int8)  # [BLOCK_D, 16]


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
def _row_bases(k_ptr, ks_ptr, BT, b, h, stride_kb, stride_kh, stride_sb, stride_sh, stride_tb,
               PAGED: tl.constexpr):
    """The (b, h) row's key and scale bases and, under PAGED, its block table row (pools:
    the block enters per key at ``_tile_rows``, so the bases hold the head only)."""
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    if PAGED:
        k_base = k_ptr + h64 * stride_kh
        ks_base = ks_ptr + h64 * stride_sh
        bt_row = BT + b64 * stride_tb
    else:
        k_base = k_ptr + b64 * stride_kb + h64 * stride_kh
        ks_base = ks_ptr + b64 * stride_sb + h64 * stride_sh
        bt_row = k_base  # (unused)
    return k_base, ks_base, bt_row


@triton.jit
def _paged_tiles(r0t, end, lo, hi, bt_row, BLOCK_L: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 PAGED_TILES: tl.constexpr):
    """The block table read for the PAGED_TILES key tiles from logical position ``r0t``, and
    where the group ends. Read once per group, so that the loop over the group's tiles
    loads only keys and stays pipelined like the contiguous one (a table read per tile
    left a single key buffer). Where BLOCK_SIZE divides BLOCK_L (both powers of two) it
    holds each tile's block ids [PAGED_TILES, BLOCK_L // BLOCK_SIZE]; otherwise each
    position's slot [PAGED_TILES, BLOCK_L] (``paged_slots``, ``-1`` outside ``[lo, hi)``).
    ``_tile_rows`` reads one tile of it."""
    r1 = tl.minimum(r0t + PAGED_TILES * BLOCK_L, end)
    if BLOCK_L % BLOCK_SIZE == 0:
        NB: tl.constexpr = BLOCK_L // BLOCK_SIZE
        first = r0t + tl.arange(0, PAGED_TILES)[:, None] * BLOCK_L + tl.arange(0, NB)[None, :] * BLOCK_SIZE
        ok = (first + BLOCK_SIZE > lo) & (first < hi)  # blocks meeting [lo, hi): the rest are never loaded
        tiles = tl.load(bt_row + tl.where(ok, first, 0) // BLOCK_SIZE, mask=ok, other=0)
    else:
        offs = r0t + tl.arange(0, PAGED_TILES)[:, None] * BLOCK_L + tl.arange(0, BLOCK_L)[None, :]
        tiles = paged_slots(tl.where((offs >= lo) & (offs < hi), offs, -1), bt_row, BLOCK_SIZE)
    return tiles, r1


@triton.jit
def _logical_rows(offs_l, stride_kl, stride_sl):
    """Row offsets (int64) of a contiguous copy's keys and scales at logical positions ``offs_l``."""
    l64 = offs_l.to(tl.int64)
    return l64 * stride_kl, l64 * stride_sl


@triton.jit
def _tile_rows(tiles, i, stride_kb, stride_kl, stride_sb, stride_sl, BLOCK_L: tl.constexpr,
               BLOCK_SIZE: tl.constexpr, PAGED_TILES: tl.constexpr, PACK: tl.constexpr = 1):
    """Row offsets (int64 [BLOCK_L]) of the keys and of their scales in tile ``i`` of a
    ``_paged_tiles`` group (pools [num_blocks, HKV, BLOCK_SIZE, ...]; a tile starts on a
    block boundary when BLOCK_SIZE divides BLOCK_L). PACK (which needs that, and
    BLOCK_SIZE % PACK == 0): the keys' rows per group of PACK tokens, [BLOCK_L / PACK]."""
    if BLOCK_L % BLOCK_SIZE == 0:
        NB: tl.constexpr = BLOCK_L // BLOCK_SIZE
        ids = tile_of(tiles, i, PAGED_TILES).to(tl.int64)  # [NB]
        blk = tl.reshape(tl.broadcast_to(ids[:, None], (NB, BLOCK_SIZE)), (BLOCK_L,))
        off = tl.arange(0, BLOCK_L) % BLOCK_SIZE
        if PACK > 1:
            GB: tl.constexpr = BLOCK_SIZE // PACK
            blk_g = tl.reshape(tl.broadcast_to(ids[:, None], (NB, GB)), (BLOCK_L // PACK,))
            k_rows = blk_g * stride_kb + ((tl.arange(0, BLOCK_L // PACK) % GB) * PACK) * stride_kl
        else:
            k_rows = blk * stride_kb + off * stride_kl
    else:
        slots = tile_of(tiles, i, PAGED_TILES).to(tl.int64)
        blk = slots // BLOCK_SIZE
        off = slots % BLOCK_SIZE
        k_rows = blk * stride_kb + off * stride_kl
    return k_rows, blk * stride_sb + off * stride_sl


@triton.jit
def _i8dot_tile(qm, qm2, w, c_off, k_base, ks_base, out_ptr, row64, l0, lo, hi, c1, L, stride_kl, stride_kd,
                stride_sl, hist, thr, cand_row, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
                FULL_ROW: tl.constexpr, HIST: tl.constexpr, KINT4: tl.constexpr, ASM4: tl.constexpr,
                CARRY: tl.constexpr, k_rows=None, s_rows=None, PAGED: tl.constexpr = False,
                PACK: tl.constexpr = 1):
    """One key tile of ``_i8dot_score_kernel``; PAGED: at ``k_rows`` / ``s_rows``
    (``_tile_rows``), else at the logical rows. PACK: [BLOCK_L / PACK, BLOCK_D] rows of
    PACK tokens each (``_i8dot_score_kernel``)."""
    offs_l = l0 + tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, BLOCK_D)
    valid = (offs_l >= lo) & (offs_l < hi)
    if not PAGED:
        k_rows, s_rows = _logical_rows(offs_l, stride_kl, stride_sl)
    if PACK > 1:  # a row of the tile: PACK consecutive tokens' D bytes, contiguous (``_pack``)
        R: tl.constexpr = BLOCK_L // PACK
        offs_r = tl.arange(0, R)
        tok = l0 + offs_r[:, None] * PACK + (offs_d // D)[None, :]  # [R, BLOCK_D]: each byte's token
        if PAGED:  # each group's first row (``_tile_rows``: its PACK tokens share a block)
            base = k_rows
        else:
            base = (l0 + offs_r * PACK).to(tl.int64) * stride_kl
        p = tl.load(k_base + base[:, None] + offs_d[None, :] * stride_kd, mask=(tok >= lo) & (tok < hi),
                    other=0).to(tl.int8, bitcast=True)
        acc = tl.dot(p, qm, out_dtype=tl.int32)  # [R, 16]: token slot t's digits in columns 4t .. 4t + 3
        acc = tl.dot(_high_nibbles(p, ASM4), qm2, acc, out_dtype=tl.int32)
        r = tl.reshape(tl.sum(tl.reshape(acc.to(tl.float32) * w, [R, PACK, 4]), axis=2), [BLOCK_L]) - c_off
    else:
        kt = tl.load(k_base + k_rows[:, None] + offs_d[None, :] * stride_kd,
                     mask=valid[:, None] & (offs_d[None, :] < D), other=0)  # [BLOCK_L, BLOCK_D] int8 / packed uint8
        if KINT4:
            p = kt.to(tl.int8, bitcast=True)  # lo + 8 + 16 * hi; padding bytes are 0 and add nothing
            acc = tl.dot(p, qm, out_dtype=tl.int32)  # [BLOCK_L, 16]: x̂ · p in digits
            acc = tl.dot(_high_nibbles(p, ASM4), qm2, acc, out_dtype=tl.int32)  # + (y - 16 x̂) · hi
            r = tl.sum(acc.to(tl.float32) * w, axis=1) - c_off  # [BLOCK_L]
        else:
            acc = tl.dot(kt, qm, out_dtype=tl.int32)  # [BLOCK_L, 16] int32: the four partial dots
            r = tl.sum(acc.to(tl.float32) * w, axis=1)  # [BLOCK_L] = s * k·q_int
    r = r * tl.load(ks_base + s_rows, mask=valid, other=0.0)
    r = tl.where(valid, r, float("-inf"))
    return _store_scores(out_ptr, row64, L, offs_l, r, valid, c1, hist, thr, cand_row,
                         FULL_ROW, HIST, CARRY)


def _gemv_config(k: torch.Tensor, paged: dict | None = None) -> dict:
    """The GEMV scoring launch: the device's default tile (on a GPU, ``PACKED_TILE`` where
    int4 rows pack four tokens per MMA row), ``GEMV_CONFIG`` over it, and ``pack``
    resolved (``_pack``)."""
    if _interpret() or k.device.type != "cuda":
        cfg = dict(BLOCK_L=128, num_warps=1, num_stages=1, MIN_CHUNK=256, PER_SM=4)
    else:
        # best of the bench_scoring GEMV variants on an H200 (B=8, L=32k, int8 keys):
        # 256 x 128 int8 tiles, 8 warps, 3 stages — 0.116 ms scoring, 0.170 ms with the top-K
        cfg = dict(BLOCK_L=256, num_warps=8, num_stages=3, MIN_CHUNK=512, PER_SM=8)
        if _pack(k, PACKED_TILE["BLOCK_L"], dict(cfg, **GEMV_CONFIG), paged) > 1:
            cfg.update(PACKED_TILE)
    cfg.update(GEMV_CONFIG)
    cfg["pack"] = _pack(k, cfg["BLOCK_L"], cfg, paged)
    return cfg


PACKED_TILE = dict(BLOCK_L=512, num_warps=8)
"""The GPU's int4 scoring tile with four tokens per MMA row (``_pack``): at r = 32, 128
rows of 64 bytes. One H100, carry scoring + compaction at r = 32 channels, against one token per
row on the 256-key tile: 43.0 -> 34.8 us at 8 x 32k, 75.1 -> 52.6 at 32 x 16k, 70.0 ->
54.5 at 1 x 512k (``bench_select --carry-tiles ... --carry-packs 1,4``, docs/perf.md)."""


GEMV_CONFIG: dict = {}
"""Overrides for the ``sum_logits`` GEMV scoring kernel (``BLOCK_L``, ``num_warps``,
``num_stages``, ``MIN_CHUNK``, ``PER_SM``), plus ``use``: ``"int8"`` (default: int8
and int4 keys only), ``"all"`` (every key dtype), ``"off"``, and ``int8_dot`` (default True:
int8 and int4 keys go through ``_i8dot_score_kernel`` on the int8 tensor cores, and
``sum_softmax``'s per-head logits over them through ``_i8dot_logits_kernel``; False: the
float GEMV tile and the float tensor-core tile, which convert every key element), ``int4_asm`` (default True on a
GPU: the int4 high nibbles by four bytes per register, ``_high_nibbles``; False: per byte), and ``pack``
(default 4: four int4 tokens per MMA row where rows allow, ``_pack``, on ``PACKED_TILE``; 1: one)."""


def _pack(k: torch.Tensor, block_l: int, cfg: dict, paged: dict | None = None) -> int:
    """Tokens per MMA row of the int4 scoring tile (``_i8dot_score_kernel``'s PACK):
    ``cfg["pack"]`` (4 or 1) where four tokens' rows are one contiguous run of bytes —
    packed int4 rows of 8 or 16 bytes (r = 16 or 32 channels) stored back to back, in a
    pool whose blocks hold whole groups of four and map by block id (``_paged_tiles``) —
    and the tile holds 16 rows of four tokens; else 1. Rows of 32 and 64 bytes fill the
    one-token tile's 32-byte MMA depth already, and packing them measured no faster
    (docs/perf.md)."""
    want = int(cfg.get("pack", 4))
    if want not in (1, 4):
        raise ValueError(f"GEMV_CONFIG['pack'] must be 1 or 4 (tokens per MMA row of the int4 scoring tile), "
                         f"got {want}")
    d = k.shape[-1]
    ok = k.dtype == torch.uint8 and d in (8, 16) and block_l >= 64 and k.stride(3) == 1 and k.stride(2) == d
    if paged:
        bs = paged["BLOCK_SIZE"]
        ok = ok and block_l % bs == 0 and bs % want == 0
    return want if ok else 1


def _int8_dot(k: torch.Tensor) -> bool:
    """int8 / int4 keys scored on the int8 tensor cores (``GEMV_CONFIG["int8_dot"]``)."""
    return k.dtype in _QUANT_KEYS and GEMV_CONFIG.get("int8_dot", True)


def _use_gemv(k: torch.Tensor, reduce: str) -> bool:
    mode = GEMV_CONFIG.get("use", "int8")
    return reduce == "sum_logits" and (mode == "all" or (mode == "int8" and k.dtype in _QUANT_KEYS))


def _gemv_launch(k: torch.Tensor, reduce: str, paged: dict) -> bool:
    """Whether ``_launch_scores`` scores through ``_launch_gemv`` (which never takes paged float keys)."""
    return _use_gemv(k, reduce) and (not paged or _int8_dot(k))


def _with_tiles(paged: dict | None, chunk: int, block_l: int) -> dict:
    """A paged launch's kwargs plus ``PAGED_TILES``: the tiles of slots a program maps
    through the table at a time, its whole chunk, at most ``PAGED_TILES_MAX``."""
    if not paged:
        return {}
    return dict(paged, PAGED_TILES=min(PAGED_TILES_MAX, triton.next_power_of_2(triton.cdiv(chunk, block_l))))


def _carry_args(carry: tuple | None, out: torch.Tensor, block_l: int) -> tuple:
    """(carry, mask, NW) kernel arguments and the CARRY mode (``carry`` = (carry, mask, NW,
    mode)); placeholders (never read) and 0 without. A compacted store needs tiles of
    whole ``CARRY_SEG`` segments (``carry_store``)."""
    if carry is None:
        return (out, out, 1), 0
    mode = carry[3]
    if mode == CARRY_COMPACT and block_l % CARRY_SEG:
        raise ValueError(f"the threshold carry's compacted store needs scoring tiles of whole {CARRY_SEG}-position "
                         f"segments, got BLOCK_L {block_l} (carry_store chooses the mode for the launch)")
    return carry[:3], mode


def carry_store(q: torch.Tensor, k: torch.Tensor, reduce: str, block_table: torch.Tensor | None = None) -> int:
    """The ``CARRY`` mode a threshold-carry call's scoring stores with
    (``spade.kernels.carry``): ``CARRY_COMPACT`` where one kernel scores and stores
    (``sum_logits`` / ``max_logits``) on tiles of whole ``CARRY_SEG`` segments, else
    ``CARRY_MARK`` (the ``sum_softmax`` finalize stores the whole row). The compacted store
    is off unless ``SELECT_CONFIG["carry_compact"]`` is set: it has not yet been timed on a
    GPU (``bench_tpot --carry-store mark,compact`` sets it per row)."""
    if reduce == "sum_softmax" or not SELECT_CONFIG.get("carry_compact", False):
        return CARRY_MARK
    paged = paged_launch(block_table, k.shape[2])
    if _gemv_launch(k, reduce, paged):
        block_l = _gemv_config(k, paged)["BLOCK_L"]
    else:
        block_l = _score_config(q.shape[-1] // 2 if k.dtype == torch.uint8 else q.shape[-1], k.device)["BLOCK_L"]
    return CARRY_COMPACT if block_l % CARRY_SEG == 0 else CARRY_MARK


def _launch_gemv(q: torch.Tensor, k: torch.Tensor, out: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, *,
                 scale: float, full_row: bool, hist: torch.Tensor | None, k_scale: torch.Tensor | None,
                 carry: tuple | None = None, paged: dict | None = None) -> None:
    """``sum_logits`` by GEMV: int8 / int4 keys on the int8 tensor cores (``paged``: pools
    through a block table, ``_launch_scores``' kwargs), else the float GEMV tile, which
    ``_launch_scores`` never sends paged keys."""
    B, Hq, D = q.shape
    Hkv, L = k.shape[1], out.shape[-1]  # L logical (a pool's dimension 2 is its block size)
    rows = B * Hkv
    cfg = _gemv_config(k, paged)
    BLOCK_L = cfg["BLOCK_L"]
    cargs, do_carry = _carry_args(carry, out, BLOCK_L)
    chunk, n_chunks = _split(L, rows, k.device, block=BLOCK_L, min_chunk=cfg["MIN_CHUNK"], per_sm=cfg["PER_SM"])
    kint4 = k.dtype == torch.uint8
    kint8 = k.dtype == torch.int8
    if (kint8 or kint4) and cfg.get("int8_dot", True):
        G = Hq // Hkv
        Dk = D // 2 if kint4 else D  # the key row's elements (bytes of a packed int4 row)
        pack = cfg["pack"]
        _i8dot_score_kernel[(rows, n_chunks)](
            q, k, k_scale, out, hist if hist is not None else out, lo, hi, *cargs,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), k.stride(3),
            *k_scale.stride(), L, chunk, scale,
            HKV=Hkv, G=G, G_PAD=triton.next_power_of_2(G), D=Dk,
            BLOCK_D=Dk * pack if pack > 1 else max(32, triton.next_power_of_2(Dk)), BLOCK_L=BLOCK_L, PACK=pack, FULL_ROW=full_row, HIST=hist is not None, INTERPRET=_interpret(), KINT4=kint4,
            ASM4=kint4 and not _interpret() and cfg.get("int4_asm", True), CARRY=do_carry,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_kwargs(q, "select"),
            **_with_tiles(paged, chunk, BLOCK_L))
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
                   carry: tuple | None = None, block_table: torch.Tensor | None = None) -> None:
    """Fill ``out`` [B, Hkv, L] fp32 with group scores over ``[lo, hi)`` (softmax support
    ``[norm_lo, norm_hi)``); optionally accumulate the pass-0 histogram into ``hist``;
    ``carry`` = (carry, mask, NW, mode): the threshold carry's ``CARRY`` mode
    (``spade.kernels.carry``: mark each row's candidates above its carried threshold in its
    bitmask and store the row, or only the candidates' scores compacted, or re-score the
    rows that fell back; ``carry_store``). ``block_table``: ``k`` (and ``k_scale``) are
    pools read through it (the kernels' PAGED paths)."""
    paged = paged_launch(block_table, k.shape[2])
    if _gemv_launch(k, reduce, paged):
        _launch_gemv(q, k, out, lo, hi, scale=scale, full_row=full_row, hist=hist, k_scale=k_scale, carry=carry,
                     paged=paged)
        return
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    L = out.shape[-1]  # logical: max_blocks * block_size when paged
    G = Hq // Hkv
    G_PAD = max(16, triton.next_power_of_2(G))
    rows = B * Hkv
    kint4 = k.dtype == torch.uint8
    Dk = D // 2 if kint4 else D  # int4: the kernels see the packed row (half the head dim)
    cfg = _score_config(Dk, k.device)
    BLOCK_L, BLOCK_D = cfg["BLOCK_L"], cfg["BLOCK_D"]
    cargs, do_carry = _carry_args(carry, out, BLOCK_L)
    if reduce == "sum_softmax" and do_carry not in (0, CARRY_MARK):
        raise ValueError(f"sum_softmax under the threshold carry marks and stores whole rows (CARRY mode "
                         f"{CARRY_MARK}, carry_store), got mode {do_carry}")
    chunk, n_chunks = _split(L, rows, k.device, block=BLOCK_L, min_chunk=cfg["MIN_CHUNK"], per_sm=cfg["PER_SM"])
    tiles = _with_tiles(paged, chunk, BLOCK_L)
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
            **pdl_kwargs(qr, "select"), **tiles)
        return
    logits = torch.empty(rows, G, L, dtype=torch.float32, device=k.device)  # [B*Hkv, G, L]
    # the finalize streams the logits alone (no keys, no MMA): its own tiles and chunks, and
    # the group's G heads unpadded (the MMA's 16 rows would be 16 / G times the exp work)
    fcfg = _softmax_config(k.device, "finalize")
    fbl = fcfg["BLOCK_L"]
    if do_carry and not (32 <= fbl <= 2048 and fbl & (fbl - 1) == 0):
        # its tiles mark the threshold carry's bitmask in whole 32-bit words, and the bitmask
        # has 2048 positions of slack past L (spade.kernels.carry)
        raise ValueError(f"the sum_softmax finalize's BLOCK_L must be a power of two in [32, 2048] under the "
                         f"threshold carry, got {fbl} (SOFTMAX_CONFIG['finalize_BLOCK_L'] or SCORE_CONFIG['BLOCK_L'])")
    i8dot = _int8_dot(k)  # the int8 tensor cores
    if i8dot:  # the logits pass on its own tiles and chunks too
        lcfg = _softmax_config(k.device, "logits", kint4)
        chunk, n_chunks = _split(L, rows, k.device, block=lcfg["BLOCK_L"], min_chunk=lcfg["MIN_CHUNK"],
                                 per_sm=lcfg["PER_SM"])
    stats = torch.empty(rows, G, n_chunks, 2, dtype=torch.float32, device=k.device)  # per logits chunk
    if i8dot:
        _i8dot_logits_kernel[(rows, n_chunks)](
            qr, k, k_scale, logits, stats, norm_lo, norm_hi,
            qr.stride(0), qr.stride(1), qr.stride(2), k.stride(0), k.stride(1), k.stride(2), k.stride(3),
            *ks_strides, L, chunk, n_chunks, scale,
            HKV=Hkv, G=G, GH=max(4, triton.next_power_of_2(G)), D=Dk, BLOCK_D=max(32, triton.next_power_of_2(Dk)),
            BLOCK_L=lcfg["BLOCK_L"], INTERPRET=_interpret(), KINT4=kint4,
            ASM4=kint4 and not _interpret() and GEMV_CONFIG.get("int4_asm", True),
            num_warps=lcfg["num_warps"], num_stages=lcfg["num_stages"], **pdl_kwargs(qr, "select"),
            **_with_tiles(paged, chunk, lcfg["BLOCK_L"]))
    else:
        _score_kernel[grid](
            qr, k, ks_arg, logits, stats, out, norm_lo, norm_hi, out, out, 1,
            qr.stride(0), qr.stride(1), qr.stride(2), k.stride(0), k.stride(1), k.stride(2), k.stride(3),
            *ks_strides, L, chunk, n_chunks, scale,
            REDUCE=_LOGITS_MODE, FULL_ROW=False, HIST=False, **common, **pdl_kwargs(qr, "select"), **tiles)
    f_chunk, f_chunks = _split(L, rows, k.device, block=fbl, min_chunk=fcfg["MIN_CHUNK"], per_sm=fcfg["PER_SM"])
    _softmax_finalize_kernel[(rows, f_chunks)](
        logits, stats, out, hist_arg, lo, hi, *cargs, L, f_chunk, n_chunks,
        HKV=Hkv, G=G, G_PAD=triton.next_power_of_2(G), BLOCK_C=triton.next_power_of_2(n_chunks),
        BLOCK_L=fbl, FULL_ROW=full_row, HIST=do_hist, INTERPRET=_interpret(), CARRY=do_carry,
        num_warps=fcfg["num_warps"], **pdl_kwargs(logits, "select"))


def group_scores_triton(q: torch.Tensor, k: torch.Tensor, kv_lens: torch.Tensor, *, scale: float | None = None,
                        reduce: str = "sum_logits", kv_start: torch.Tensor | None = None,
                        k_scale: torch.Tensor | None = None, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """Triton ``group_scores``: [B, Hkv, L] float32, ``-inf`` outside ``[kv_start, kv_lens)``.

    >>> s = group_scores_triton(q, k, kv_lens, reduce="max_logits")  # doctest: +SKIP
    """
    _check_reduce(reduce)
    B, Hq, Hkv, L, D = _check_qk(q, k, block_table)
    k_scale = _check_k_scale(k, k_scale)
    kv_lens = _check_rows(kv_lens, B, "kv_lens", k.device)
    start = torch.zeros_like(kv_lens) if kv_start is None else _check_rows(kv_start, B, "kv_start", k.device)
    out = torch.empty(B, Hkv, L, dtype=torch.float32, device=k.device)
    if B * Hkv * L == 0:
        return out
    _launch_scores(q, k, out, start, kv_lens, start, kv_lens, scale=_default_scale(scale, D), reduce=reduce,
                   full_row=True, hist=None, k_scale=k_scale, block_table=block_table)
    return out


def score_topk_triton(q: torch.Tensor, k: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k_top: int, *,
                      scale: float | None = None, reduce: str = "sum_logits",
                      kv_lens: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                      kv_start: torch.Tensor | None = None, out: torch.Tensor | None = None,
                      carry: torch.Tensor | None = None, carry_margin: float | None = None,
                      block_table: torch.Tensor | None = None) -> torch.Tensor:
    """Fused scoring + exact top-K (the radix select: ``spade.kernels.radix_topk``): int32 [B, Hkv, k_top],
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
    A ``k_top`` whose candidate list would pass the carry's longest (``carry_fits``)
    takes the radix passes, ``carry`` untouched.

    >>> idx = score_topk_triton(q, k, lo, hi, 2048)  # doctest: +SKIP
    """
    _check_reduce(reduce)
    B, Hq, Hkv, L, D = _check_qk(q, k, block_table)
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
    if carry is not None and not carry_fits(k_top, carry_margin):
        carry = None  # a list longer than the carry's longest: the radix passes are faster
    if carry is not None:
        scores = torch.empty(rows, L, dtype=torch.float32, device=k.device)
        idx = torch.empty(rows, k_top, dtype=torch.int32, device=k.device) if out is None else out.view(rows, k_top)
        _carry_topk(q, k, scores, lo, hi, n_lo, n_hi, k_top, carry, idx, scale=_default_scale(scale, D),
                    reduce=reduce, k_scale=k_scale, hkv=Hkv, margin=carry_margin, block_table=block_table)
        return idx.view(B, Hkv, k_top) if out is None else out
    fuse = SELECT_CONFIG.get("fuse_hist", True)
    ws = _new_workspace(rows, k.device)
    scores = torch.empty(rows, L, dtype=torch.float32, device=k.device)  # [B*Hkv, L]; only [lo, hi) written
    _launch_scores(q, k, scores, lo, hi, n_lo, n_hi, scale=_default_scale(scale, D), reduce=reduce,
                   full_row=False, hist=ws if fuse else None, k_scale=k_scale, block_table=block_table)
    idx = _select_from_scores(scores, lo, hi, k_top, Hkv, ws, hist0_done=fuse,
                              out=None if out is None else out.view(rows, k_top))
    return idx.view(B, Hkv, k_top) if out is None else out

"""Decode attention over a subset of the KV cache, read in place; merging partial states.

One decode step attends, per (batch row ``b``, KV head ``h``), the union of three
disjoint token sets (``spade.policies.base.Selection`` documents the same rule):

* sinks ``[s, min(s + n_sink, len))`` with ``s = kv_start[b]`` (0 when None),
* the valid middle ``indices[b, h, :]`` (``-1`` = empty slot),
* the recent window ``[max(len - n_recent, s + n_sink), len)``.

``indices=None`` means dense attention over ``[s, len)`` (the ``full`` policy).
Middle indices outside ``[sink_end, recent_start)`` are ignored here (policies never
produce them, but ignoring them keeps a bad selection from reading garbage, out of
bounds memory, or counting a token twice). Duplicates *inside* ``indices`` are a
caller error the Triton kernel does not detect (the reference counts them once).

The Triton kernel is flash-decoding with split-K:

* grid ``(B * Hkv, num_splits)``; each program owns one (b, KV head) and one
  contiguous chunk of the *virtual* token sequence ``sinks ++ indices ++ recent``,
  so every split does the same amount of work whatever the selection looks like;
* the G query heads of the GQA group are the rows of one ``tl.dot`` (padded to 16
  rows, the smallest MMA tile), so each selected K/V row is read from HBM once
  per group, not once per query head;
* K/V rows are loaded through the index list (a gather inside the kernel: no
  materialised copy of the selected K/V), sinks and the recent window are plain
  position ranges of the same virtual sequence. A split first loads its whole
  chunk of indices as one [blocks, BLOCK_N] tile; each block's K/V addresses are
  then a function of the loop counter alone, so the software pipeliner keeps
  several blocks of K/V rows in flight exactly as on the dense path (an index
  load inside the loop would serialise index -> K/V latency on every block,
  unless the pipeliner stages it ahead: an in-loop index path measured slower,
  docs/tried.md);
* each split keeps an online softmax (base-2 exponentials, the scale folded with
  ``log2(e)``) and writes its normalised output and log-sum-exp; the splits are
  merged with the log-sum-exp trick (skipped when one split suffices, e.g. at
  large batch). By default the merge runs inside the same launch: each split
  bumps an atomic counter of its (b, KV head) after writing its partial, and the
  last one to arrive merges all of them ("last block reduces"). At small K the
  kernel is latency-bound (a few microseconds of work per program), so a
  second launch is a visible share of the step. A separate merge kernel remains
  only as the fallback where the arrival counters cannot be made (the first call
  of a stream inside a CUDA-graph capture, ``_split_counters``).

Paged cache: with ``block_table`` [B, max_blocks] int32, ``k``/``v`` are block pools
[num_blocks, Hkv, block_size, D] shared by the rows (``spade.kernels.paged``); every
position above stays logical and is mapped through the table only to form the K/V
address (``spade.kernels.paged.paged_slots``). ``block_table=None`` is the contiguous
cache, the special case of one block of L tokens per row, resolved at compile time
(``PAGED=False``: the table arguments are not even passed, so the compiled code is the
unpaged one).

The number of splits is chosen from ``B * Hkv`` and the SM count so that the grid
fills the GPU (decode attention is bound by HBM bandwidth: every SM must be
streaming K/V).

Example (CPU reference)::

    >>> import torch
    >>> q = torch.randn(1, 4, 16); k = torch.randn(1, 2, 10, 16); v = torch.randn(1, 2, 10, 16)
    >>> out = sparse_decode_attention_ref(q, k, v, torch.tensor([10]))
    >>> tuple(out.shape)
    (1, 4, 16)
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from spade.envs import env, triton_interpret
from spade.kernels.common import loop_bound, plan_share
from spade.kernels.paged import (check_block_table, check_pool, cut_logical, paged_launch, paged_slots,
                                 paged_to_contiguous)
from spade.kernels.pdl import grid_dep_release, grid_dep_wait, pdl_enabled

__all__ = [
    "sparse_decode_attention_ref",
    "sparse_decode_attention_triton",
    "merge_attention_states_ref",
    "merge_attention_states_triton",
    "attended_mask",
]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_MAX_SPLITS = 64
_MAX_CHUNK_BLOCKS = 32  # blocks of indices a split preloads (registers: 16 per thread at 64 x 32)


def _interpret() -> bool:
    return triton_interpret()


# ----------------------------------------------------------------------------- checks
def _check_inputs(q, k, v, kv_lens, indices, kv_start, block_table=None):
    """(B, Hq, Hkv, L, D); L is the logical capacity ``max_blocks * block_size`` when paged."""
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        want = "k/v pools [num_blocks,Hkv,block_size,D]" if block_table is not None else "k/v [B,Hkv,L,D]"
        raise ValueError(f"expected q [B,Hq,D] and {want}; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, Hq, D = q.shape
    if (block_table is None and k.shape[0] != B) or k.shape[3] != D:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} (batch or head_dim)")
    Hkv = k.shape[1]
    if block_table is not None:
        check_pool(k, "k")
        check_block_table(block_table, B, k.device)
    if Hq % Hkv != 0:
        raise ValueError(f"Hq ({Hq}) must be a multiple of Hkv ({Hkv})")
    if kv_lens.shape != (B,):
        raise ValueError(f"kv_lens must be [B]={B}; got {tuple(kv_lens.shape)}")
    if kv_start is not None and kv_start.shape != (B,):
        raise ValueError(f"kv_start must be [B]={B}; got {tuple(kv_start.shape)}")
    if indices is not None and (indices.dim() != 3 or indices.shape[:2] != (B, Hkv)):
        raise ValueError(f"indices must be [B, Hkv, K] = [{B}, {Hkv}, K]; got {tuple(indices.shape)}")
    L = k.shape[2] if block_table is None else block_table.shape[1] * k.shape[2]
    return B, Hq, Hkv, L, D


# ----------------------------------------------------------------------------- reference
def attended_mask(L: int, kv_lens: torch.Tensor, indices: torch.Tensor | None, Hkv: int, *,
                  n_sink: int = 0, n_recent: int = 0,
                  kv_start: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask [B, Hkv, L] of the attended positions (the rule in the module docstring)."""
    B = kv_lens.shape[0]
    dev = kv_lens.device
    pos = torch.arange(L, device=dev)  # [L]
    kv = kv_lens.long()[:, None, None]  # [B, 1, 1]
    s = (torch.zeros_like(kv) if kv_start is None else kv_start.to(dev).long()[:, None, None])
    if indices is None:
        return ((pos >= s) & (pos < kv)).expand(B, Hkv, L).clone()
    sink_end = torch.minimum(s + n_sink, kv)
    recent_start = torch.maximum(kv - n_recent, sink_end)
    mask = ((pos >= s) & (pos < sink_end)) | ((pos >= recent_start) & (pos < kv))
    mask = mask.expand(B, Hkv, L).clone()  # [B, Hkv, L]
    idx = indices.to(dev).long()  # [B, Hkv, K]
    ok = (idx >= sink_end) & (idx < recent_start)
    mid = torch.zeros(B, Hkv, L + 1, dtype=torch.bool, device=dev)
    mid.scatter_(2, torch.where(ok, idx, L), True)  # invalid slots land in the spare column L
    return mask | mid[..., :L]


def _check_stats(stats: torch.Tensor | None, device: torch.device) -> None:
    if stats is not None and (stats.dtype != torch.int64 or stats.shape != (2,) or stats.device != device
                              or not stats.is_contiguous()):
        raise ValueError(f"stats must be a contiguous int64 tensor of shape (2,) on {device} "
                         f"([tokens attended, calls]); got {stats.dtype} {tuple(stats.shape)} on {stats.device}")


def sparse_decode_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                kv_lens: torch.Tensor, indices: torch.Tensor | None = None, *,
                                n_sink: int = 0, n_recent: int = 0, scale: float | None = None,
                                kv_start: torch.Tensor | None = None, return_lse: bool = False,
                                stats: torch.Tensor | None = None, count_call: bool = True,
                                block_table: torch.Tensor | None = None):
    """Plain-torch decode attention over the attended set, in float32 (materialises
    [B, Hq, L] scores: for tests and small shapes). An empty set gives out = 0 and
    lse = -inf.

    ``stats`` (int64 [2], optional): ``stats[0] +=`` the tokens attended, summed over
    (b, KV head); ``stats[1] += 1`` when ``count_call`` (the Triton kernel does the
    same inside the attention launch).

    ``block_table`` (int32 [B, max_blocks], optional): k/v are pools
    [num_blocks, Hkv, block_size, D] and row b's logical position p lives in block
    ``block_table[b, p // block_size]`` at offset ``p % block_size``; the rows are
    copied out through the table (``paged_to_contiguous``) and every position that is
    not attended is zeroed first, so blocks the row does not own (garbage, NaN)
    never reach the result."""
    B, Hq, Hkv, L, D = _check_inputs(q, k, v, kv_lens, indices, kv_start, block_table)
    _check_stats(stats, q.device)
    if k.device.type == "cpu" and B > 0:  # (the CPU's serving path: read no position past the longest row)
        L, block_table, k, v = cut_logical(int(kv_lens.max()), L, block_table, k.shape[2], k, v)
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    mask = attended_mask(L, kv_lens.to(q.device), indices, Hkv, n_sink=n_sink, n_recent=n_recent,
                         kv_start=kv_start)  # [B, Hkv, L]
    if block_table is not None:
        keep = mask[..., None]  # where(), not a product: an unowned block may hold NaN
        k = torch.where(keep, paged_to_contiguous(k, block_table.to(k.device)), torch.zeros((), dtype=k.dtype))
        v = torch.where(keep, paged_to_contiguous(v, block_table.to(v.device)), torch.zeros((), dtype=v.dtype))
    if stats is not None:
        stats[0] += mask.sum()
        if count_call:
            stats[1] += 1
    qf = q.float().view(B, Hkv, G, D)
    s = torch.einsum("bhgd,bhld->bhgl", qf, k.float()) * scale  # [B, Hkv, G, L]
    s = s.masked_fill(~mask[:, :, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # all-masked rows: avoid inf - inf
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)  # [B, Hkv, G, 1]
    o = torch.einsum("bhgl,bhld->bhgd", p, v.float()) / torch.where(l > 0, l, torch.ones_like(l))
    out = o.reshape(B, Hq, D).to(q.dtype)
    if not return_lse:
        return out
    lse = (m + torch.log(l)).reshape(B, Hq)  # log(0) = -inf for an empty set
    return out, lse


def merge_attention_states_ref(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                               lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact union of two attentions over disjoint token sets. ``out_*`` [B, Hq, D],
    ``lse_*`` [B, Hq] (natural log; ``-inf`` for an empty part). Returns (out in
    out_a's dtype, lse float32)."""
    la, lb = lse_a.float(), lse_b.float()
    m = torch.maximum(la, lb)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)  # [B, Hq]
    tot = wa + wb
    safe = torch.where(tot > 0, tot, torch.ones_like(tot))
    out = (wa[..., None] * out_a.float() + wb[..., None] * out_b.float()) / safe[..., None]
    return out.to(out_a.dtype), m + torch.log(tot)


# ----------------------------------------------------------------------------- Triton kernels
@triton.jit
def _virtual_positions(offs, end, n_sink_b, s, sink_end, recent_start, K_MID, i_base, stride_ik):
    """Cache positions of the virtual slots ``offs`` (a tile of any shape) of this
    (b, KV head)'s sequence ``sinks ++ middle ++ recent``, int32, ``-1`` where nothing
    is attended: slots at or past ``end``, empty (-1) middle slots, and middle
    indices outside ``[sink_end, recent_start)``."""
    in_range = offs < end
    is_sink = offs < n_sink_b
    mid_j = offs - n_sink_b
    is_mid = (mid_j >= 0) & (mid_j < K_MID) & in_range
    idx = tl.load(i_base + mid_j.to(tl.int64) * stride_ik, mask=is_mid, other=-1).to(tl.int32)
    pos = tl.where(is_sink, s + offs, tl.where(is_mid, idx, recent_start + (mid_j - K_MID)))
    mid_ok = (idx >= sink_end) & (idx < recent_start)
    valid = in_range & (~is_mid | mid_ok)
    return tl.where(valid, pos, -1)


@triton.jit
def _chunk_positions(i_base, start, end, n_sink_b, s, sink_end, recent_start, K_MID, stride_ik,
                     MAX_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Cache positions of this split's whole chunk of the virtual sequence, as a
    [MAX_BLOCKS, BLOCK_N] int32 tile (row i = block i), ``-1`` where nothing is
    attended. Loading every index up front keeps index loads
    out of the main loop: each block's K/V addresses are then a pure function of
    the loop counter, so the software pipeliner can keep several blocks of K/V rows
    in flight."""
    offs = start + tl.arange(0, MAX_BLOCKS)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    return _virtual_positions(offs, end, n_sink_b, s, sink_end, recent_start, K_MID, i_base, stride_ik)


@triton.jit
def _block_rows(pos2d, blk, j0, end, s, MAX_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr, HAS_INDICES: tl.constexpr):
    """(positions int64 [BLOCK_N], valid [BLOCK_N]) of block ``blk`` (virtual start ``j0``):
    row ``blk`` of the preloaded tile, or a plain position range on the dense path."""
    if HAS_INDICES:
        rows = tl.arange(0, MAX_BLOCKS)[:, None]
        pos = tl.sum(tl.where(rows == blk, pos2d, 0), 0)  # row blk of the tile
        valid = pos >= 0
    else:
        offs = j0 + tl.arange(0, BLOCK_N)
        valid = offs < end
        pos = s + offs
    return pos.to(tl.int64), valid


@triton.jit
def _attend_rows(q, k_base, v_base, pos64, valid, stride_kl, stride_kd, stride_vl, stride_vd, qk_scale,
                 m_i, l_i, acc, offs_d, d_mask, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
                 stride_kb=0, stride_vb=0, PAGED: tl.constexpr = False, BLOCK_SIZE: tl.constexpr = 1):
    """Load the K/V rows at ``pos64`` in place and fold them into the online softmax state.
    ``PAGED``: ``pos64`` are physical slots ``block * BLOCK_SIZE + offset`` of the pool
    (``spade.kernels.paged.paged_slots``) and the bases hold no batch row."""
    kv_mask = valid[:, None] & d_mask[None, :]
    if PAGED:
        blk = pos64 // BLOCK_SIZE
        off = pos64 % BLOCK_SIZE
        k_rows = blk * stride_kb + off * stride_kl
        v_rows = blk * stride_vb + off * stride_vl
        kt = tl.load(k_base + k_rows[:, None] + offs_d[None, :] * stride_kd,
                     mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
    else:
        kt = tl.load(k_base + pos64[:, None] * stride_kl + offs_d[None, :] * stride_kd,
                     mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
    if UPCAST:
        kt = kt.to(tl.float32)
    qk = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC)  # [G_PAD, BLOCK_N] fp32
    qk = tl.where(valid[None, :], qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # NOTE: a block (or a whole split) can be fully masked: keep -inf - -inf out.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if PAGED:
        vt = tl.load(v_base + v_rows[:, None] + offs_d[None, :] * stride_vd,
                     mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
    else:
        vt = tl.load(v_base + pos64[:, None] * stride_vl + offs_d[None, :] * stride_vd,
                     mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
    if UPCAST:
        vt = vt.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _attend_slots(q, k_base, v_base, slots, stride_kl, stride_kd, stride_vl, stride_vd, qk_scale, m_i, l_i, acc,
                  n_att, offs_d, d_mask, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, stride_kb, stride_vb,
                  BLOCK_SIZE: tl.constexpr, HAS_STATS: tl.constexpr):
    """One tile over a paged cache: ``slots`` (int32, -1 = nothing) are physical slots of
    the pools (``paged_slots``); folds their K/V rows into the online softmax state and,
    with HAS_STATS, counts them."""
    valid = slots >= 0
    m_i, l_i, acc = _attend_rows(q, k_base, v_base, slots.to(tl.int64), valid, stride_kl, stride_kd, stride_vl,
                                 stride_vd, qk_scale, m_i, l_i, acc, offs_d, d_mask, UPCAST, DOT_PREC,
                                 stride_kb, stride_vb, True, BLOCK_SIZE)
    if HAS_STATS:
        n_att += tl.sum(valid.to(tl.int32), axis=0)
    return m_i, l_i, acc, n_att


@triton.jit
def _decode_split_kernel(
    Q, K, V, KV_LENS, KV_START, IDX,
    O_PART, LSE_PART, OUT, LSE,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    stride_ib, stride_ih, stride_ik,
    Hkv, Hq, K_MID, N_SINK, N_RECENT, qk_scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, MAX_BLOCKS: tl.constexpr, NUM_SPLITS, DIRECT: tl.constexpr,
    HAS_INDICES: tl.constexpr, HAS_START: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr, FUSED_COMBINE: tl.constexpr, COUNTER,
    STATS, HAS_STATS: tl.constexpr, COUNT_CALL: tl.constexpr, PDL: tl.constexpr = False,
    BT=None, stride_tb: tl.constexpr = 0, PAGED: tl.constexpr = False, BLOCK_SIZE: tl.constexpr = 1,
):
    # PAGED: K/V are pools [num_blocks, Hkv, BLOCK_SIZE, D] and BT the block tables
    # [B, max_blocks] int32; positions stay logical until the K/V address (``paged_slots``).
    # stride_tb is a constexpr: the table is one fixed [max_rows, max_blocks] buffer.
    # Not PAGED: the contiguous cache [B, Hkv, L, D], i.e. the table [b] with one block of L
    # tokens, resolved at compile time (the same code as before paging existed).
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // Hkv
    h = pid_bh % Hkv
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    grid_dep_wait(PDL)  # q and the newest K/V row come from the previous kernel (spade.kernels.pdl)

    kv_len = tl.load(KV_LENS + b).to(tl.int32)
    if HAS_START:
        s = tl.load(KV_START + b).to(tl.int32)
    else:
        s = 0
    # The virtual sequence this (b, h) attends: sinks ++ middle slots ++ recent window.
    if HAS_INDICES:
        sink_end = tl.minimum(s + N_SINK, kv_len)
        recent_start = tl.maximum(kv_len - N_RECENT, sink_end)
        n_sink_b = tl.maximum(sink_end - s, 0)
        n_rec_b = kv_len - recent_start
        # a window of at most sinks + recent tokens has no middle (every index would fall
        # outside [sink_end, recent_start)): its programs skip the K_MID slots, e.g. a served
        # batch's idle rows, whose one-token windows still carry a selection's index list
        k_mid_b = tl.where(recent_start > sink_end, K_MID, 0)
        T = n_sink_b + k_mid_b + n_rec_b
    else:
        sink_end = s
        recent_start = s
        n_sink_b = 0
        T = tl.maximum(kv_len - s, 0)
    # Balanced contiguous chunk of the virtual sequence, whole blocks each.
    chunk = tl.cdiv(tl.cdiv(T, NUM_SPLITS), BLOCK_N) * BLOCK_N
    if HAS_INDICES:
        # the launcher sizes MAX_BLOCKS to hold a chunk; the clamp only guards memory
        # against kv_lens beyond the cache capacity (a caller error)
        chunk = tl.minimum(chunk, MAX_BLOCKS * BLOCK_N)
    start = split * chunk
    end = tl.minimum(start + chunk, T)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_mask = offs_g < G
    d_mask = offs_d < D
    q_ptrs = (Q + b64 * stride_qb + (h64 * G + offs_g[:, None]) * stride_qh
              + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [G_PAD, D_PAD]
    if UPCAST:
        q = q.to(tl.float32)

    if PAGED:
        k_base = K + h64 * stride_kh
        v_base = V + h64 * stride_vh
        bt_row = BT + b64 * stride_tb
    else:
        k_base = K + b64 * stride_kb + h64 * stride_kh
        v_base = V + b64 * stride_vb + h64 * stride_vh
    i_base = IDX + b64 * stride_ib + h64 * stride_ih

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)

    if HAS_INDICES:
        pos2d = _chunk_positions(i_base, start, end, n_sink_b, s, sink_end, recent_start, k_mid_b, stride_ik,
                                 MAX_BLOCKS, BLOCK_N)
    else:
        pos2d = 0
    n_att = tl.zeros([], tl.int32)  # tokens this program attends (HAS_STATS)
    if PAGED and not HAS_INDICES:
        # Dense over a paged cache: each tile's slots mapped through the table in the loop
        # (BLOCK_N / BLOCK_SIZE entries, cached); the tiles are the contiguous path's, so the
        # arithmetic is too (the dense launch config, _launch_config). Mapping whole groups of
        # tiles before an inner loop cost 1.25-1.44x the contiguous kernel; this path ~1.02x
        # (docs/paged.md).
        for j0 in range(loop_bound(start, INTERPRET), loop_bound(end, INTERPRET), BLOCK_N):
            offs = j0 + tl.arange(0, BLOCK_N)
            slots = paged_slots(tl.where(offs < end, s + offs, -1), bt_row, BLOCK_SIZE)
            m_i, l_i, acc, n_att = _attend_slots(q, k_base, v_base, slots, stride_kl, stride_kd, stride_vl,
                                                 stride_vd, qk_scale, m_i, l_i, acc, n_att, offs_d, d_mask, UPCAST,
                                                 DOT_PREC, stride_kb, stride_vb, BLOCK_SIZE, HAS_STATS)
    elif PAGED:
        # Indexed over a paged cache: the preloaded tile holds logical positions; each tile's
        # slots are mapped through the table one iteration ahead of the tile that reads them,
        # so the table load is off the K/V loads' path (1.03-1.06x the contiguous kernel,
        # where mapping the whole chunk before the loop cost 1.07-1.11x; docs/paged.md).
        nxt, _ = _block_rows(pos2d, 0, start, end, s, MAX_BLOCKS, BLOCK_N, HAS_INDICES)
        nxt = paged_slots(nxt.to(tl.int32), bt_row, BLOCK_SIZE)
        for j0 in range(loop_bound(start, INTERPRET), loop_bound(end, INTERPRET), BLOCK_N):
            cur = nxt
            nn, _ = _block_rows(pos2d, (j0 - start) // BLOCK_N + 1, j0, end, s, MAX_BLOCKS, BLOCK_N, HAS_INDICES)
            nxt = paged_slots(nn.to(tl.int32), bt_row, BLOCK_SIZE)
            m_i, l_i, acc, n_att = _attend_slots(q, k_base, v_base, cur, stride_kl, stride_kd, stride_vl,
                                                 stride_vd, qk_scale, m_i, l_i, acc, n_att, offs_d, d_mask, UPCAST,
                                                 DOT_PREC, stride_kb, stride_vb, BLOCK_SIZE, HAS_STATS)
    else:
        for j0 in range(loop_bound(start, INTERPRET), loop_bound(end, INTERPRET), BLOCK_N):
            pos, valid = _block_rows(pos2d, (j0 - start) // BLOCK_N, j0, end, s, MAX_BLOCKS, BLOCK_N,
                                     HAS_INDICES)
            m_i, l_i, acc = _attend_rows(q, k_base, v_base, pos, valid, stride_kl, stride_kd, stride_vl,
                                         stride_vd, qk_scale, m_i, l_i, acc, offs_d, d_mask, UPCAST, DOT_PREC)
            if HAS_STATS:
                n_att += tl.sum(valid.to(tl.int32), axis=0)
    # Release after the loops, not at the top: the next kernel (the output projection's GEMV,
    # a large grid) launches as they end. Its programs, launched at the top, sat resident
    # through the split grid's waves: on an H200, B=32 L=16k optimal 7.01 -> 6.93 ms, full
    # 22.15 -> 21.85; B=8 unchanged (docs/tried.md).
    grid_dep_release(PDL)
    if HAS_STATS:  # attention statistics with no launch of their own: [tokens, calls] int64
        tl.atomic_add(STATS, n_att.to(tl.int64), sem="relaxed")  # a counter: no ordering needed
        if COUNT_CALL:
            if (pid_bh == 0) & (split == 0):
                tl.atomic_add(STATS + 1, tl.full([], 1, tl.int64), sem="relaxed")

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    qh64 = h64 * G + offs_g  # query heads of this group [G_PAD]
    st_mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT:  # one split: no merge pass
        o_ptrs = OUT + (b64 * Hq + qh64)[:, None] * D + offs_d[None, :]
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=st_mask)
        tl.store(LSE + b64 * Hq + qh64, lse, mask=g_mask)
    else:
        row = (b64 * Hq + qh64) * NUM_SPLITS + split  # [G_PAD] rows of [B, Hq, S]
        tl.store(O_PART + row[:, None] * D + offs_d[None, :], out, mask=st_mask)
        tl.store(LSE_PART + row, lse, mask=g_mask)
        if FUSED_COMBINE:
            # Last-block-reduces: the acq_rel bump publishes this split's partial
            # (release) and, in the split that sees count NUM_SPLITS - 1, makes every
            # other split's partial visible (acquire); that split merges them, so the
            # separate merge launch (and its launch latency) disappears.
            # NOTE: one thread performs the scalar atomic; the barrier first orders
            # every thread's partial stores before it (the release is cumulative).
            tl.debug_barrier()
            done = tl.atomic_add(COUNTER + pid_bh, 1, sem="acq_rel")
            if done == NUM_SPLITS - 1:
                _combine_group(O_PART, LSE_PART, OUT, LSE, b64, qh64, g_mask, offs_d, d_mask, Hq, NUM_SPLITS,
                               D, G_PAD, D_PAD)
                tl.store(COUNTER + pid_bh, 0)  # ready for the next call (and CUDA-graph replay)


@triton.jit
def _combine_group(O_PART, LSE_PART, OUT, LSE, b64, qh64, g_mask, offs_d, d_mask, Hq, NUM_SPLITS,
                   D: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr):
    """Merge the NUM_SPLITS partial states of one GQA group's query heads with a
    running log-sum-exp (one split at a time: no [S, G, D] tile in registers)."""
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    tot = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    row0 = (b64 * Hq + qh64) * NUM_SPLITS  # [G_PAD] first split's row of each head
    st_mask = g_mask[:, None] & d_mask[None, :]
    sp = NUM_SPLITS * 0
    while sp < NUM_SPLITS:  # NOTE: a while loop: the interpreter takes no tensor bounds in range()
        # .cg: read through L2, never a stale L1 line of another SM's partial
        l_s = tl.load(LSE_PART + row0 + sp, mask=g_mask, other=float("-inf"), cache_modifier=".cg")
        o_s = tl.load(O_PART + (row0 + sp)[:, None] * D + offs_d[None, :], mask=st_mask, other=0.0,
                      cache_modifier=".cg")  # [G_PAD, D_PAD]
        m_new = tl.maximum(m, l_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # keep -inf - -inf out
        alpha = tl.exp(m - m_safe)
        w = tl.exp(l_s - m_safe)  # 0 for an empty split
        acc = acc * alpha[:, None] + o_s * w[:, None]
        tot = tot * alpha + w
        m = m_new
        sp += 1
    has = tot > 0
    out = acc / tl.where(has, tot, 1.0)[:, None]
    m_fin = tl.where(m == float("-inf"), 0.0, m)
    lse = tl.where(has, m_fin + tl.log(tl.where(has, tot, 1.0)), float("-inf"))
    tl.store(OUT + (b64 * Hq + qh64)[:, None] * D + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=st_mask)
    tl.store(LSE + b64 * Hq + qh64, lse, mask=g_mask)


@triton.jit
def _reduce_splits_kernel(O_PART, LSE_PART, OUT, LSE, NUM_SPLITS, D: tl.constexpr, D_PAD: tl.constexpr,
                          S_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # flattened (b, query head)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < D
    lse = tl.load(LSE_PART + row * NUM_SPLITS + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # [S_PAD], 0 for empty splits
    tot = tl.sum(w, 0)
    o = tl.load(O_PART + (row * NUM_SPLITS + offs_s)[:, None] * D + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # [S_PAD, D_PAD]
    out = tl.sum(o * w[:, None], 0) / tl.where(tot > 0, tot, 1.0)
    tl.store(OUT + row * D + offs_d, out.to(OUT.dtype.element_ty), mask=d_mask)
    tl.store(LSE + row, tl.where(tot > 0, m_safe + tl.log(tl.where(tot > 0, tot, 1.0)), float("-inf")))


@triton.jit
def _merge_states_kernel(OA, LA, OB, LB, OUT, LSE,
                         stride_oa_r, stride_oa_d, stride_ob_r, stride_ob_d,
                         D: tl.constexpr, D_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < D
    la = tl.load(LA + row).to(tl.float32)
    lb = tl.load(LB + row).to(tl.float32)
    m = tl.maximum(la, lb)
    m = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m)
    wb = tl.exp(lb - m)
    tot = wa + wb
    oa = tl.load(OA + row * stride_oa_r + offs_d * stride_oa_d, mask=d_mask, other=0.0).to(tl.float32)
    ob = tl.load(OB + row * stride_ob_r + offs_d * stride_ob_d, mask=d_mask, other=0.0).to(tl.float32)
    safe = tl.where(tot > 0, tot, 1.0)
    out = (wa * oa + wb * ob) / safe
    tl.store(OUT + row * D + offs_d, out.to(OUT.dtype.element_ty), mask=d_mask)
    tl.store(LSE + row, tl.where(tot > 0, m + tl.log(safe), float("-inf")))


# ----------------------------------------------------------------------------- launchers
_SM_COUNT: dict[int, int] = {}


_COUNTERS: dict[tuple, torch.Tensor] = {}


def _split_counters(n: int, device: torch.device) -> torch.Tensor | None:
    """Zeroed int32 arrival counters, one per (b, KV head), kept per (device, stream):
    every fused launch leaves them at zero again, so they are allocated once (grown
    when a larger batch comes), and launches on one stream never overlap, so they
    never share a counter. Returns None where a new buffer would have to be made
    during a CUDA-graph capture (it would live in the graph's private pool and
    dangle once the graph is freed): the caller then takes the two-launch merge."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 16  # interpreter: pretend a small GPU so that tests exercise several splits
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]


# Programs of the decode kernel resident per SM on sm_90 (d=128, bf16, BLOCK_N=64,
# 4 warps, 3 stages), from the compiled kernel's resources: both paths keep two
# K+V stages in shared memory (70 KiB: 3 programs in 227 KiB) at <= 124 registers
# per thread (4 programs in 64K registers).
_PROGRAMS_PER_SM = 3
# The indexed path fills two of those three slots per SM: its gathers of scattered
# 256-byte K/V rows run at ~2 TB/s whatever the grid (a launch sweep on an H200 pair, B=8 L=32k K=2k,
# L2 flushed: 33.0-33.4 us at 2-4 splits x 64 (b, head) pairs, 34.8 at the 6 that
# filling three slots gives, 40.3 at 16), so fewer, longer splits only save merge
# work. ``SPADE_ATTN_PROGRAMS_PER_SM`` overrides it (read at launch: A/B runs).
_PROGRAMS_PER_SM_INDEXED = 2


def _launch_config(D_PAD: int, elem_size: int, dense: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). BLOCK_N rows of K and V are 32 KiB at
    d=128 bf16; three stages double-buffer them (the indexed path's addresses come
    from its preloaded index tile, so it pipelines like the dense one). Three
    programs per SM then keep ~100-200 KiB per SM in flight, more than HBM
    latency x bandwidth per SM. ``dense`` (no indices): tiles twice as long and two
    stages. The contiguous kernel times the same either way (one H100, B=8 x 32k,
    1 x 128k, 16 x 32k, 32 x 16k: within 0.3%), and over a paged cache, whose table
    load sits inside the loop, it holds 1.02x the contiguous kernel where the shorter
    tile gave up to 1.10x (docs/paged.md). One config for both keeps the paged dense
    path bit-identical to the contiguous one."""
    if _interpret():
        return 16, 4, 1
    block_n = max(16, min(128, (64 * 128 * 2) // (D_PAD * elem_size)))
    if dense:
        return min(128, 2 * block_n), 4, 2
    return block_n, 4, 3


def _programs_per_sm(indexed: bool) -> int:
    n = env("SPADE_ATTN_PROGRAMS_PER_SM")
    if n is None:
        return _PROGRAMS_PER_SM_INDEXED if indexed else _PROGRAMS_PER_SM
    return n


def choose_num_splits(n_pairs: int, t_max: int, block_n: int, device: torch.device, *,
                      indexed: bool = False) -> int:
    """Splits per (b, KV head). Decode attention is bound by HBM bandwidth, so every
    SM must stream K/V: fill one wave of resident programs (``SMs x programs per
    SM``: three dense, two on the indexed path, ``_PROGRAMS_PER_SM_INDEXED``) and no
    more — a partial second wave would leave SMs idle at the tail.
    Each split keeps at least two blocks of work (the merge is not free); at most
    ``_MAX_SPLITS``. With ``B * Hkv`` already filling a wave: one split, no merge."""
    slots = _programs_per_sm(indexed) * _sm_count(device)
    splits = max(1, slots // max(n_pairs, 1))
    max_useful = max(1, triton.cdiv(t_max, 2 * block_n))
    return int(min(splits, max_useful, _MAX_SPLITS))


def plan_splits(n_pairs: int, t_max: int, block_n: int, device: torch.device, *, num_splits: int | None = None,
                indexed: bool = True) -> tuple[int, int]:
    """(splits, MAX_BLOCKS) the launcher uses: ``num_splits`` or the heuristic's
    choice; on the indexed path (``indexed``) raised so that a split's chunk of
    indices fits the preloaded tile (at most ``_MAX_CHUNK_BLOCKS`` blocks), with
    MAX_BLOCKS the tile's rows (1 on the dense path); at most ``_MAX_SPLITS``."""
    splits = num_splits if num_splits is not None else choose_num_splits(n_pairs, t_max, block_n, device,
                                                                         indexed=indexed)
    if indexed:  # a split's index chunk is preloaded whole: at most _MAX_CHUNK_BLOCKS blocks
        splits = max(splits, triton.cdiv(triton.cdiv(t_max, block_n), _MAX_CHUNK_BLOCKS))
    splits = int(max(1, min(splits, _MAX_SPLITS)))
    max_blocks = 1
    if indexed:
        max_blocks = triton.next_power_of_2(max(1, triton.cdiv(triton.cdiv(t_max, splits), block_n)))
    return splits, max_blocks


def sparse_decode_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   kv_lens: torch.Tensor, indices: torch.Tensor | None = None, *,
                                   n_sink: int = 0, n_recent: int = 0, scale: float | None = None,
                                   kv_start: torch.Tensor | None = None, return_lse: bool = False,
                                   num_splits: int | None = None, block_n: int | None = None,
                                   num_warps: int | None = None, num_stages: int | None = None,
                                   stats: torch.Tensor | None = None, count_call: bool = True,
                                   block_table: torch.Tensor | None = None):
    """Triton split-K decode attention; same contract as ``sparse_decode_attention_ref``.

    Inside ``kernels.plan_rows(busy, B)`` (a serving batch: its rows in use, rounded up to
    a bucket; the others attend a token or two) the split plan fills a wave for ``busy``
    rows instead of ``B``: one long row among fifteen idle ones gets the splits it would
    get alone. The grid still covers every row.

    ``block_table`` (int32 [B, max_blocks] on the cache's device): k/v are block pools
    [num_blocks, Hkv, block_size, D] shared by the rows; indices, ``kv_lens`` and
    ``kv_start`` stay logical and the kernel maps them through the table (the indexed
    path maps a split's preloaded index chunk once, before its loop; the dense path
    looks one entry up per ``block_size`` tokens of a tile, so tiles may span blocks:
    any block size works). ``kv_lens[b]`` must not exceed ``max_blocks * block_size``
    and the table entries a row attends must name blocks of the pool (not checked on
    the host: that would synchronise). None: the contiguous cache, the same compiled
    code as without paging.

    ``num_splits``, ``block_n``, ``num_warps``, ``num_stages`` override the
    heuristics (tests, tuning; ``benchmarks.bench_attention`` sweeps them); on the
    indexed path ``num_splits`` is raised where a split's chunk of indices would
    exceed ``_MAX_CHUNK_BLOCKS`` blocks (the preloaded index tile; ``plan_splits``
    gives the count used). No host
    synchronisation: safe to capture in a CUDA graph (after a first warm-up call
    has compiled the kernels and made the split counters).

    Several splits are merged inside the one launch: the last split of each
    (b, KV head) to finish merges them (an atomic counter per pair, reset by that
    split). The counters are kept per (device, stream); a capture that is the first
    call of its stream (or batch size) falls back to a separate merge kernel.

    ``stats`` (int64 [2]): attention statistics kept inside the launch (one atomic
    per program, no kernel of their own): tokens attended summed over (b, KV head),
    and one call when ``count_call``.
    """
    B, Hq, Hkv, L, D = _check_inputs(q, k, v, kv_lens, indices, kv_start, block_table)
    _check_stats(stats, q.device)
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else float(scale)
    G_PAD = max(16, triton.next_power_of_2(G))
    D_PAD = max(16, triton.next_power_of_2(D))
    interp = _interpret()
    bn, nw, ns = _launch_config(D_PAD, k.element_size(), dense=indices is None)
    bn = block_n or bn
    num_warps = num_warps or nw
    num_stages = num_stages or ns
    dev = q.device
    kv_lens = kv_lens.to(dev)  # no-ops for device tensors (the documented contract)
    kv_start = None if kv_start is None else kv_start.to(dev)
    has_idx = indices is not None
    if has_idx:
        indices = indices.to(dev)
        k_mid = indices.shape[2]
        t_max = min(n_sink, L) + k_mid + min(n_recent, L)
        idx_t = indices
        si = indices.stride()
    else:
        k_mid = 0
        t_max = L
        idx_t = kv_lens  # never read
        si = (0, 0, 0)
    busy = min(B, plan_share(B))  # the rows that carry work (kernels.plan_rows), B outside a plan
    splits, max_blocks = plan_splits(busy * Hkv, t_max, bn, q.device, num_splits=num_splits, indexed=has_idx)

    out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, dtype=torch.float32, device=q.device)
    if splits > 1:
        o_part = torch.empty(B, Hq, splits, D, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(B, Hq, splits, dtype=torch.float32, device=q.device)
    else:
        o_part, lse_part = out, lse  # unused
    # fp32 operands take the exact (non-TF32) dot; mixed dtypes meet in fp32
    upcast = interp or torch.float32 in (q.dtype, k.dtype) or q.dtype != k.dtype or v.dtype != k.dtype
    dot_prec = "ieee" if upcast else "tf32"  # ignored for 16-bit operands
    kv_start_t = kv_start if kv_start is not None else kv_lens

    fused = splits > 1
    counter = _split_counters(B * Hkv, q.device) if fused else None
    if counter is None:  # one split, or first seen inside a graph capture (see _split_counters)
        fused, counter = False, kv_lens  # never read

    if B * Hkv == 0 and stats is not None and count_call:
        stats[1] += 1
    # contiguous: no table arguments at all, so its specialisation is the one it always was
    paged = paged_launch(block_table, k.shape[2])
    if B * Hkv > 0:
        pdl = pdl_enabled(dev)
        _decode_split_kernel[(B * Hkv, splits)](
            q, k, v, kv_lens, kv_start_t, idx_t,
            o_part, lse_part, out, lse,
            *q.stride(), *k.stride(), *v.stride(), *si,
            Hkv, Hq, k_mid, n_sink, n_recent, scale * _LOG2E,
            G=G, G_PAD=G_PAD, D=D, D_PAD=D_PAD, BLOCK_N=bn, MAX_BLOCKS=max_blocks, NUM_SPLITS=splits,
            DIRECT=splits == 1,
            HAS_INDICES=has_idx, HAS_START=kv_start is not None, UPCAST=upcast, DOT_PREC=dot_prec,
            INTERPRET=interp, FUSED_COMBINE=fused, COUNTER=counter,
            STATS=stats if stats is not None else kv_lens, HAS_STATS=stats is not None, COUNT_CALL=count_call,
            PDL=pdl, num_warps=num_warps, num_stages=num_stages,
            launch_pdl=pdl, **paged,
        )
        if splits > 1 and not fused:
            _reduce_splits_kernel[(B * Hq,)](
                o_part, lse_part, out, lse, splits, D=D, D_PAD=D_PAD,
                S_PAD=triton.next_power_of_2(splits), num_warps=2 if D_PAD <= 128 else 4,
            )
    return (out, lse) if return_lse else out


def merge_attention_states_triton(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                                  lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of ``merge_attention_states_ref`` (one program per (b, head))."""
    if out_a.shape != out_b.shape or lse_a.shape != out_a.shape[:-1] or lse_b.shape != lse_a.shape:
        raise ValueError(f"shape mismatch: out_a {tuple(out_a.shape)}, lse_a {tuple(lse_a.shape)}, "
                         f"out_b {tuple(out_b.shape)}, lse_b {tuple(lse_b.shape)}")
    D = out_a.shape[-1]
    rows = math.prod(out_a.shape[:-1])
    oa = out_a.reshape(rows, D)
    ob = out_b.reshape(rows, D)
    la = lse_a.reshape(rows).contiguous()
    lb = lse_b.reshape(rows).contiguous()
    out = torch.empty(out_a.shape, dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty(lse_a.shape, dtype=torch.float32, device=out_a.device)
    if rows > 0:
        D_PAD = triton.next_power_of_2(D)
        _merge_states_kernel[(rows,)](oa, la, ob, lb, out, lse, *oa.stride(), *ob.stride(),
                                      D=D, D_PAD=D_PAD, num_warps=1 if D_PAD <= 256 else 4)
    return out, lse

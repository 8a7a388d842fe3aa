"""Symmetric int8 copies of the keys, for scoring only (the cache side's compressed keys).

The cache rank reads every cached key each step to score it, which costs more
than the sparse attention it feeds (see DESIGN.md, "The cache side is the next
wall"). Scoring only needs the *ranking* of ``q · k``, so it can read a
compressed copy: int8 keys are half the bytes of bf16, while attention keeps
using the exact keys.

Quantisation is symmetric, one scale per (row, KV head, token)::

    ks[b, h, l] = max(amax_d |k[b, h, l, d]|, SCALE_FLOOR) / 127
    kq[b, h, l, d] = round(k[b, h, l, d] / ks[b, h, l])   (in [-127, 127])
    k ≈ kq * ks[..., None]

Per-token scales keep the error relative to each key's own size (outlier tokens
such as attention sinks do not crush everyone else's resolution), and one fp32
scale per token costs 4 / D of the int8 bytes (3 % at D = 128). The floor makes
an all-zero key quantise to zeros with a finite scale instead of 0 / 0.

Two ops, each with a torch reference and a Triton kernel:

* ``quantize_keys(k)`` -> ``(kq int8 [B, H, L, D], ks float32 [B, H, L])``.
* ``quantize_append(kq, ks, k_new, pos)``: in place, quantise ``k_new`` [B, H, D]
  into slot ``pos[b]`` of each row. ``pos`` is a device tensor read by the kernel
  (no host sync), so the op can be replayed in a CUDA graph; rows with ``pos``
  outside ``[0, L)`` are left untouched. With a ``block_table`` the copy is a pool
  ``[num_blocks, H, block_size, D]`` (scales ``[num_blocks, H, block_size]``) laid out
  like the paged KV cache (``spade.kernels.paged``): the slot is logical and maps to
  ``(table[b, p // block_size], p % block_size)``.

int4 keys (a quarter of bf16's bytes)
------------------------------------
Per-token symmetric int4 alone ranks badly: keys have a few outlier channels
whose magnitude sets every token's scale, leaving the other channels 1-2 levels
(on SmolLM2-135M the overlap with the exact top-K drops to 0.79, docs/policies.md).
So the int4 copy is *smoothed* first: a per-(row, KV head, channel) scale ``s_c``
(``fit_smoothing``: the channel's amax over the keys present when the copy is
built, e.g. the prompt) divides the keys before per-token quantisation and is
folded into the query instead (``fold_smoothing``), so the store stays plain
int4 plus one scale per token::

    x = k / s[..., None, :]                                   (s: [B, H, D])
    ks = max(amax_d |x|, SCALE_FLOOR) / 7;  kq = round(x / ks) in [-7, 7]
    q · k ≈ Σ_d (q_d s_d) · kq_d · ks = fold_smoothing(q, s) · kq · ks

Later tokens are not clamped: their own per-token scale absorbs a channel that
outgrew its fitted ``s_c`` (they only lose resolution in the other channels).

Packing: uint8 [B, H, L, D/2]; byte ``i`` holds channel ``i`` in its low nibble,
offset by 8 (``kq + 8``: 1..15), and channel ``i + D/2`` in its high nibble as a
signed two's-complement nibble, so the byte read as int8 is ``p = lo + 8 + 16 * hi``.
A kernel gets the two contiguous half-vectors back as ``(p & 15) - 8`` and
``p >> 4`` (arithmetic shift), no interleaving; the tensor-core scorer needs only
the shift: ``q_lo · (p - 8) + (q_hi - 16 q_lo) · (p >> 4) = q_lo · lo + q_hi · hi``,
so the raw bytes feed one int8 dot and one shift feeds the other
(``spade.kernels.scoring._i8dot_score_kernel``).

Example::

    >>> import torch
    >>> k = torch.tensor([[[[1.0, -2.0], [0.0, 0.0]]]])  # [1, 1, 2, 2]
    >>> kq, ks = quantize_keys_ref(k)
    >>> kq[0, 0].tolist(), (kq.float() * ks[..., None])[0, 0, 0].tolist()
    ([[64, -127], [0, 0]], [1.0078740119934082, -2.0])
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spade.kernels.paged import check_block_table, paged_launch
from spade.kernels.pdl import grid_dep_release, grid_dep_wait, pdl_kwargs

__all__ = ["SCALE_FLOOR", "INT4_MAX", "SMOOTH_FLOOR", "quantize_keys_ref", "quantize_keys_triton",
           "quantize_append_ref", "quantize_append_triton", "fit_smoothing", "fold_smoothing", "pack_int4",
           "unpack_int4", "quantize_keys_int4_ref", "quantize_keys_int4_triton", "quantize_append_int4_ref",
           "quantize_append_int4_triton"]

SCALE_FLOOR = 1e-8
"""Smallest ``amax`` used for a scale: an all-zero key gets a tiny finite scale (no NaN)."""
INT4_MAX = 7
"""Symmetric int4 range [-7, 7] (stored with an offset of 8: nibbles 1..15)."""
SMOOTH_FLOOR = 0.1
"""``fit_smoothing`` floors each channel's scale at this fraction of the head's
largest channel scale: a channel quiet in the prompt must not blow up (divide by
~0) a later key that uses it. On SmolLM2-135M keys, 0.1 rather than 0.01 ranks
the same with a 512-token fit and better with short ones (top-64 overlap with the
exact keys 0.79 vs 0.76 fitted on 16 tokens, 0.75 vs 0.55 on 4)."""


def _new_rows(k_new: torch.Tensor, pos: torch.Tensor, chans: torch.Tensor | None = None) -> torch.Tensor:
    """The keys an append writes: ``k_new`` [B, H, D] itself, or — ``k_new`` being the
    cache [B, H, L', D] — its rows at ``pos`` (clamped into ``[0, L')``; rows whose
    ``pos`` is outside the copy are not written anyway). [B, H, D]; with ``chans``
    [B, H, r] the channels it names, [B, H, r]."""
    if k_new.dim() == 4:
        B, H, Lc, D = k_new.shape
        p = pos.to(device=k_new.device, dtype=torch.int64).clamp(0, max(Lc - 1, 0))
        k_new = k_new.gather(2, p.view(B, 1, 1, 1).expand(B, H, 1, D)).squeeze(2)
    if chans is not None:
        k_new = k_new.gather(2, chans.to(device=k_new.device, dtype=torch.int64))
    return k_new


def _slots(pos: torch.Tensor, pos_offset: int, device: torch.device) -> torch.Tensor:
    """The append slots ``pos + pos_offset`` as int64 [B] on ``device`` (the references')."""
    p = pos.to(device=device, dtype=torch.int64)
    return p + pos_offset if pos_offset else p


def _new_strides(k_new: torch.Tensor) -> tuple[int, int, int, int]:
    """(b, h, l, d) strides of ``k_new`` for the append kernels (l = 0 for [B, H, D])."""
    if k_new.dim() == 3:
        sb, sh, sd = k_new.stride()
        return sb, sh, 0, sd
    return tuple(k_new.stride())


def _check_new(k_new: torch.Tensor, B: int, H: int, D: int | None) -> None:
    """``D`` None: any last dim (an append of ``chans``, checked by ``_check_chans``)."""
    d_ok = D is None or k_new.shape[-1] == D
    if not k_new.dtype.is_floating_point or not (k_new.dim() in (3, 4) and k_new.shape[:2] == (B, H) and d_ok):
        d = "D" if D is None else D
        raise ValueError(f"k_new must be float [{B}, {H}, {d}] (the new keys) or [{B}, {H}, L, {d}] (the cache, "
                         f"read at pos), got {tuple(k_new.shape)} {k_new.dtype}")


def _check_chans(chans: torch.Tensor, B: int, H: int, r: int, D: int, device: torch.device) -> None:
    """An append's channel subset: integer [B, H, r] on the copy's device, each in [0, D)
    (D: ``k_new``'s channels; the values are the caller's, never checked on the device)."""
    if chans.shape != (B, H, r) or chans.dtype.is_floating_point or chans.dtype == torch.bool \
            or chans.device != device:
        raise ValueError(f"chans must be an integer [{B}, {H}, {r}] tensor on {device} (the copy's channels of "
                         f"k_new's {D}), got {tuple(chans.shape)} {chans.dtype} on {chans.device}")


def _check_k(k: torch.Tensor) -> None:
    if k.dim() != 4 or not k.dtype.is_floating_point:
        raise ValueError(f"k must be a float [B, H, L, D] tensor, got {tuple(k.shape)} {k.dtype}")


def _append_dims(kq: torch.Tensor, ks: torch.Tensor, k_new: torch.Tensor, pos: torch.Tensor,
                 block_table: torch.Tensor | None, dtype: torch.dtype, kind: str, d_name: str,
                 d_mult: int, chans: torch.Tensor | None = None) -> tuple[int, int, int, int]:
    """Check an append's copy, keys, slots, table and channels; (B, H, L, Dq) with L the
    logical length (``max_blocks * block_size`` for a pool) and Dq the copy's last dim. A
    pool does not know B: it comes from ``k_new`` (else ``pos``) and every other argument
    must agree."""
    layout = f"[B, H, L, {d_name}]" if block_table is None else f"[num_blocks, H, block_size, {d_name}] (a pool)"
    if kq.dim() != 4 or kq.dtype != dtype:
        raise ValueError(f"kq must be {kind} {layout}, got {tuple(kq.shape)} {kq.dtype}")
    if block_table is None:
        B, H, L, Dq = kq.shape
    else:
        _, H, bs, Dq = kq.shape
        B = k_new.shape[0] if k_new.dim() in (3, 4) else (pos.shape[0] if pos.dim() == 1 else 0)
        L = block_table.shape[1] * bs if block_table.dim() == 2 else 0
    if ks.shape != kq.shape[:3] or ks.dtype != torch.float32:
        raise ValueError(f"ks must be float32 {list(kq.shape[:3])} (kq's shape less its last dim), "
                         f"got {tuple(ks.shape)} {ks.dtype}")
    _check_new(k_new, B, H, None if chans is not None else d_mult * Dq)
    if chans is not None:
        _check_chans(chans, B, H, d_mult * Dq, k_new.shape[-1], kq.device)
    if pos.shape != (B,) or pos.dtype.is_floating_point or pos.dtype == torch.bool:
        raise ValueError(f"pos must be an integer [{B}] tensor, got {tuple(pos.shape)} {pos.dtype}")
    if block_table is not None:
        check_block_table(block_table, B, kq.device)
    return B, H, L, Dq


def _check_append(kq: torch.Tensor, ks: torch.Tensor, k_new: torch.Tensor, pos: torch.Tensor,
                  block_table: torch.Tensor | None = None, chans: torch.Tensor | None = None
                  ) -> tuple[int, int, int, int]:
    """Check an int8 append: (B, H, L, D)."""
    return _append_dims(kq, ks, k_new, pos, block_table, torch.int8, "int8", "D", 1, chans)


def _write_rows_ref(kq: torch.Tensor, ks: torch.Tensor, q_new: torch.Tensor, s_new: torch.Tensor,
                    p: torch.Tensor, L: int, block_table: torch.Tensor | None) -> None:
    """Store row b's quantised keys ``q_new[b]`` [H, Dq] and scales ``s_new[b]`` [H] at
    logical slot ``p[b]`` of the copy (through ``block_table`` when given), as a device
    gather/where/scatter (no host sync): a row whose slot is outside ``[0, L)`` rewrites
    the place of its slot 0 with the value read there before any write. The places
    written must be distinct from those slot-0 places of skipped rows (each row owns its
    blocks; duplicates among skipped rows all rewrite the same old value)."""
    if L == 0:
        return
    ok = (p >= 0) & (p < L)  # [B]
    p_safe = torch.where(ok, p, torch.zeros_like(p))
    if block_table is None:
        blk, off = torch.arange(p.shape[0], device=p.device), p_safe
    else:
        bs = kq.shape[2]
        blk = block_table.gather(1, (p_safe // bs)[:, None]).squeeze(1).long()
        off = p_safe % bs
    ks[blk, :, off] = torch.where(ok[:, None], s_new, ks[blk, :, off])  # [B, H]
    kq[blk, :, off] = torch.where(ok[:, None, None], q_new, kq[blk, :, off])  # [B, H, Dq]


def _quantize_rows_ref(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise the last dim of ``k`` [..., D]: (int8 [..., D], float32 [...])."""
    kf = k.float()
    ks = kf.abs().amax(-1).clamp_min(SCALE_FLOOR) / 127.0  # [...]
    kq = torch.round(kf / ks[..., None]).clamp(-127, 127).to(torch.int8)
    return kq, ks


def quantize_keys_ref(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference ``quantize_keys``: ``k`` [B, H, L, D] -> (kq int8 [B, H, L, D], ks fp32 [B, H, L])."""
    _check_k(k)
    return _quantize_rows_ref(k)


def quantize_append_ref(kq: torch.Tensor, ks: torch.Tensor, k_new: torch.Tensor, pos: torch.Tensor, *,
                        pos_offset: int = 0, block_table: torch.Tensor | None = None,
                        chans: torch.Tensor | None = None) -> None:
    """Reference ``quantize_append`` (in place). A device-side scatter: rows whose
    ``pos + pos_offset`` is outside ``[0, L)`` rewrite their own slot 0 with its old value.
    ``block_table`` [B, max_blocks]: ``kq``/``ks`` are pools, the slot is logical.
    ``chans`` [B, H, r]: the copy holds those channels of ``k_new`` (r = its last dim)."""
    _, _, L, _ = _check_append(kq, ks, k_new, pos, block_table, chans)
    p = _slots(pos, pos_offset, kq.device)  # [B]
    q_new, s_new = _quantize_rows_ref(_new_rows(k_new, p, chans).to(kq.device))  # [B, H, D], [B, H]
    _write_rows_ref(kq, ks, q_new, s_new, p, L, block_table)


@triton.jit
def _quantize_tile(k_ptrs, q_ptrs, s_ptrs, mask_l, mask_d):
    """Quantise a [BLOCK_L, BLOCK_D] tile of keys (rows masked by ``mask_l``)."""
    m = mask_l[:, None] & mask_d[None, :]
    x = tl.load(k_ptrs, mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # [BLOCK_L]
    # SCALE_FLOOR; an IEEE division (a GPU turns ``/ 127.0`` into a multiply by the reciprocal)
    s = tl.math.div_rn(tl.maximum(amax, 1e-8), tl.full(amax.shape, 127.0, tl.float32))
    # IEEE division (the default fp32 ``/`` on a GPU is approximate), then round half to
    # even: bit-for-bit the torch reference. |y| <= 127 by construction; the clamp is a guard.
    y = tl.math.div_rn(x, tl.broadcast_to(s[:, None], x.shape))
    r = tl.floor(y + 0.5)
    tie = (r - y) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    r = tl.where(tie & odd, r - 1.0, r)
    r = tl.minimum(tl.maximum(r, -127.0), 127.0)
    tl.store(q_ptrs, r.to(tl.int8), mask=m)
    tl.store(s_ptrs, s, mask=mask_l)


@triton.jit
def _quantize_keys_kernel(K, KQ, KS, L,
                          stride_kb, stride_kh, stride_kl, stride_kd,
                          stride_qb, stride_qh, stride_ql, stride_qd,
                          stride_sb, stride_sh, stride_sl,
                          H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
                          PDL: tl.constexpr = False):
    """Grid (B * H, cdiv(L, BLOCK_L)): one tile of tokens of one (b, head) row."""
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    row = tl.program_id(0)
    b = (row // H).to(tl.int64)
    h = (row % H).to(tl.int64)
    offs_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, BLOCK_D)
    l64 = offs_l.to(tl.int64)
    k_ptrs = K + b * stride_kb + h * stride_kh + l64[:, None] * stride_kl + offs_d[None, :] * stride_kd
    q_ptrs = KQ + b * stride_qb + h * stride_qh + l64[:, None] * stride_ql + offs_d[None, :] * stride_qd
    s_ptrs = KS + b * stride_sb + h * stride_sh + l64 * stride_sl
    _quantize_tile(k_ptrs, q_ptrs, s_ptrs, offs_l < L, offs_d < D)


@triton.jit
def _append_slot(POS, b, L, OFFSET, H: tl.constexpr, BLOCK_H: tl.constexpr):
    """Slot ``POS[b] + OFFSET`` of an append (0 when outside [0, L), then no head row is
    written), the head rows (int64 [BLOCK_H]) and their write mask."""
    p = tl.load(POS + b).to(tl.int64) + OFFSET
    offs_h = tl.arange(0, BLOCK_H)
    ok = (p >= 0) & (p < L)
    return tl.where(ok, p, 0), offs_h.to(tl.int64), (offs_h < H) & ok


@triton.jit
def _append_chans(CH, b, h64, offs_d, stride_cb, stride_ch, H: tl.constexpr, D: tl.constexpr,
                  CHANS: tl.constexpr):
    """The new key's channels an append reads for the copy's channels ``offs_d``
    [BLOCK_D], per head row ``h64`` [BLOCK_H]: ``offs_d`` itself ([1, BLOCK_D]), or with
    CHANS the subset ``CH[b, h, offs_d]`` (int64 [BLOCK_H, BLOCK_D]; 0 where masked)."""
    if CHANS:  # (one return after the static branch: code after a taken branch's return is still compiled)
        m = (h64[:, None] < H) & (offs_d[None, :] < D)
        d = tl.load(CH + b * stride_cb + h64[:, None] * stride_ch + offs_d[None, :], mask=m, other=0).to(tl.int64)
    else:
        d = offs_d[None, :]
    return d


@triton.jit
def _append_place(BT, b, p, stride_tb: tl.constexpr, PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """(block, row in block) of the copy that slot ``p`` of row ``b`` is stored at: (b, p),
    or under PAGED ``(BT[b, p // BLOCK_SIZE], p % BLOCK_SIZE)`` (int64). ``p`` is 0 for a
    skipped row (``_append_slot``): its table entry 0 is read, never written through."""
    blk = b
    r = p
    if PAGED:
        blk = tl.load(BT + b * stride_tb + p // BLOCK_SIZE).to(tl.int64)
        r = p % BLOCK_SIZE
    return blk, r


@triton.jit
def _quantize_append_kernel(KN, KQ, KS, POS, L, OFFSET,
                            stride_nb, stride_nh, stride_nl, stride_nd,
                            stride_qb, stride_qh, stride_ql, stride_qd,
                            stride_sb, stride_sh, stride_sl,
                            H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                            PDL: tl.constexpr = False, BT=None, stride_tb: tl.constexpr = 0,
                            PAGED: tl.constexpr = False, BLOCK_SIZE: tl.constexpr = 1,
                            CH=None, stride_cb=0, stride_ch=0, CHANS: tl.constexpr = False):
    """Grid (B,): the H new keys of row b go to slot ``POS[b] + OFFSET`` (skipped outside [0, L)).
    PAGED: ``KQ``/``KS`` are pools [num_blocks, H, BLOCK_SIZE(, D)] addressed through the
    block tables ``BT`` [B, max_blocks]; L and the slot stay logical. CHANS: the copy's D
    channels of each head are ``CH[b, h, :]`` of the new key's (``_append_chans``)."""
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    b = tl.program_id(0).to(tl.int64)
    p, h64, mask_h = _append_slot(POS, b, L, OFFSET, H, BLOCK_H)
    blk, r = _append_place(BT, b, p, stride_tb, PAGED, BLOCK_SIZE)
    offs_d = tl.arange(0, BLOCK_D)
    src_d = _append_chans(CH, b, h64, offs_d, stride_cb, stride_ch, H, D, CHANS)
    # stride_nl = 0 for new keys [B, H, D]; the cache's row stride reads its row ``p``
    k_ptrs = KN + b * stride_nb + h64[:, None] * stride_nh + p * stride_nl + src_d * stride_nd
    q_ptrs = KQ + blk * stride_qb + h64[:, None] * stride_qh + r * stride_ql + offs_d[None, :] * stride_qd
    s_ptrs = KS + blk * stride_sb + h64 * stride_sh + r * stride_sl
    _quantize_tile(k_ptrs, q_ptrs, s_ptrs, mask_h, offs_d < D)


def _block_d(D: int) -> int:
    return max(16, triton.next_power_of_2(D))


def quantize_keys_triton(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``quantize_keys``: one pass over ``k``, int8 + fp32 scales out."""
    _check_k(k)
    B, H, L, D = k.shape
    kq = torch.empty(B, H, L, D, dtype=torch.int8, device=k.device)
    ks = torch.empty(B, H, L, dtype=torch.float32, device=k.device)
    if B * H * L * D == 0:
        return kq, ks
    BLOCK_D = _block_d(D)
    BLOCK_L = max(1, min(64, 8192 // BLOCK_D))  # ~8k elements per tile
    grid = (B * H, triton.cdiv(L, BLOCK_L))
    _quantize_keys_kernel[grid](k, kq, ks, L, *k.stride(), *kq.stride(), *ks.stride(),
                                H=H, D=D, BLOCK_D=BLOCK_D, BLOCK_L=BLOCK_L, num_warps=4, **pdl_kwargs(k, "select"))
    return kq, ks


def _chans_kwargs(chans: torch.Tensor | None) -> dict:
    """The append kernels' CHANS arguments (none without a channel subset; its last dim
    must be dense: made so here, a no-op for the policy's own [B, H, r] index)."""
    if chans is None:
        return {}
    chans = chans.contiguous()
    return dict(CH=chans, stride_cb=chans.stride(0), stride_ch=chans.stride(1), CHANS=True)


def _paged_kwargs(kq: torch.Tensor, block_table: torch.Tensor | None) -> dict:
    """The append kernels' PAGED arguments (none for a contiguous copy)."""
    return paged_launch(block_table, kq.shape[2])


def quantize_append_triton(kq: torch.Tensor, ks: torch.Tensor, k_new: torch.Tensor, pos: torch.Tensor, *,
                           pos_offset: int = 0, block_table: torch.Tensor | None = None,
                           chans: torch.Tensor | None = None) -> None:
    """Triton ``quantize_append`` (in place, one program per batch row, no host sync;
    ``pos_offset`` is added in the kernel: no launch for ``kv_lens - 1``). ``block_table``:
    ``kq``/``ks`` are pools, the slot is logical (mapped in the kernel). ``chans``: the
    kernel reads those channels of each new key (no gather launch first)."""
    B, H, L, D = _check_append(kq, ks, k_new, pos, block_table, chans)
    if B * H * D == 0 or (block_table is not None and L == 0):
        return
    pos = pos.to(kq.device)
    _quantize_append_kernel[(B,)](k_new, kq, ks, pos, L, int(pos_offset), *_new_strides(k_new), *kq.stride(),
                                  *ks.stride(), H=H, D=D, BLOCK_D=_block_d(D), BLOCK_H=triton.next_power_of_2(H),
                                  num_warps=4, **_paged_kwargs(kq, block_table), **_chans_kwargs(chans),
                                  **pdl_kwargs(k_new, "select"))


# ----------------------------------------------------------------------------------------------
# int4 (smoothed, packed)
# ----------------------------------------------------------------------------------------------


def fit_smoothing(k: torch.Tensor, kv_lens: torch.Tensor | None = None,
                  kv_start: torch.Tensor | None = None) -> torch.Tensor:
    """Per-(row, head, channel) smoothing scales of the int4 copy: ``k`` [B, H, L, D]
    -> float32 [B, H, D], the channel's amax over positions ``[kv_start, kv_lens)``
    (default: all of L), floored at ``SMOOTH_FLOOR`` x the head's largest (and at
    ``SCALE_FLOOR``). Plain torch: it runs once when the copy is built."""
    _check_k(k)
    B, H, L, D = k.shape
    a = k.float().abs()  # [B, H, L, D]
    if kv_lens is not None or kv_start is not None:
        pos = torch.arange(L, device=k.device)
        hi = torch.full((B,), L, device=k.device) if kv_lens is None else kv_lens.to(k.device)
        lo = torch.zeros(B, dtype=torch.int64, device=k.device) if kv_start is None else kv_start.to(k.device)
        ok = (pos[None, :] >= lo.long()[:, None]) & (pos[None, :] < hi.long()[:, None])  # [B, L]
        a = torch.where(ok[:, None, :, None], a, torch.zeros((), device=k.device))
    s = a.amax(2) if L > 0 else torch.zeros(B, H, D, device=k.device)  # [B, H, D]
    floor = (s.amax(-1, keepdim=True) * SMOOTH_FLOOR).clamp_min(SCALE_FLOOR)  # [B, H, 1]
    return torch.maximum(s, floor).contiguous()


def fold_smoothing(q: torch.Tensor, smooth: torch.Tensor | None) -> torch.Tensor:
    """The query an int4 copy is scored with: ``q`` [B, Hq, D] times its KV head's
    ``smooth`` [B, Hkv, D] (GQA: head ``h`` uses ``h // (Hq // Hkv)``), rounded back
    to q's dtype (the scoring kernels' product dtype). ``None``: ``q`` unchanged."""
    if smooth is None:
        return q
    B, Hq, D = q.shape
    Hkv = smooth.shape[1]
    if smooth.shape != (B, Hkv, D) or Hq % Hkv:
        raise ValueError(f"smooth must be [{B}, Hkv, {D}] with Hkv dividing {Hq}, got {tuple(smooth.shape)}")
    qf = q.float().view(B, Hkv, Hq // Hkv, D) * smooth.to(q.device).float()[:, :, None, :]
    return qf.view(B, Hq, D).to(q.dtype)


def pack_int4(v: torch.Tensor) -> torch.Tensor:
    """int values in [-8, 7] [..., D] (D even) -> uint8 [..., D/2]: channel ``i`` in
    the low nibble offset by 8, ``i + D/2`` in the high one as a signed nibble (the
    byte as int8 is ``v_i + 8 + 16 * v_{i+D/2}``)."""
    D = v.shape[-1]
    if D % 2:
        raise ValueError(f"int4 packing needs an even last dim, got {D}")
    w = v.to(torch.int16)
    return ((w[..., : D // 2] + 8) | ((w[..., D // 2:] & 15) << 4)).to(torch.uint8)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: uint8 [..., D/2] -> int8 [..., D]."""
    s = p.view(torch.int8)
    return torch.cat([(s & 15) - 8, s >> 4], dim=-1)


def _check_smooth(smooth: torch.Tensor | None, B: int, H: int, D: int, device: torch.device) -> None:
    if smooth is not None and (smooth.shape != (B, H, D) or smooth.dtype != torch.float32
                               or smooth.device != device):
        raise ValueError(f"smooth must be float32 [{B}, {H}, {D}] on {device}, got "
                         f"{tuple(smooth.shape)} {smooth.dtype} on {smooth.device}")


def _check_append4(kq: torch.Tensor, ks: torch.Tensor, k_new: torch.Tensor, pos: torch.Tensor,
                   smooth: torch.Tensor | None, block_table: torch.Tensor | None = None,
                   chans: torch.Tensor | None = None) -> tuple[int, int, int, int]:
    """Check an int4 append: (B, H, L, D/2)."""
    B, H, L, D2 = _append_dims(kq, ks, k_new, pos, block_table, torch.uint8, "packed int4 (uint8)", "D/2", 2,
                               chans)
    _check_smooth(smooth, B, H, 2 * D2, kq.device)
    return B, H, L, D2


def _quantize_rows4_ref(k: torch.Tensor, smooth: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Smooth and quantise the last dim of ``k`` [B, H, *, D] (``smooth`` [B, H, D]):
    (packed uint8 [B, H, *, D/2], float32 [B, H, *])."""
    x = k.float()
    if smooth is not None:
        x = x / smooth.float().view(*smooth.shape[:2], *([1] * (k.dim() - 3)), smooth.shape[-1])
    ks = x.abs().amax(-1).clamp_min(SCALE_FLOOR) / float(INT4_MAX)  # [...]
    v = torch.round(x / ks[..., None]).clamp(-INT4_MAX, INT4_MAX)
    return pack_int4(v), ks


def quantize_keys_int4_ref(k: torch.Tensor, smooth: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference int4 copy: ``k`` [B, H, L, D] (D even), optional ``smooth`` [B, H, D]
    -> (kq uint8 [B, H, L, D/2], ks float32 [B, H, L]) with
    ``k ≈ unpack_int4(kq) * ks[..., None] * smooth[:, :, None]``."""
    _check_k(k)
    B, H, L, D = k.shape
    if D % 2:
        raise ValueError(f"int4 keys need an even head_dim, got {D}")
    _check_smooth(smooth, B, H, D, k.device)
    return _quantize_rows4_ref(k, smooth)


def quantize_append_int4_ref(kq: torch.Tensor, ks: torch.Tensor, k_new: torch.Tensor, pos: torch.Tensor,
                             smooth: torch.Tensor | None = None, *, pos_offset: int = 0,
                             block_table: torch.Tensor | None = None, chans: torch.Tensor | None = None) -> None:
    """Reference ``quantize_append_int4`` (in place): ``k_new`` [B, H, D] into slot
    ``pos[b] + pos_offset``; rows whose slot is outside ``[0, L)`` untouched (a
    device-side scatter). ``block_table`` [B, max_blocks]: ``kq``/``ks`` are pools, the
    slot is logical. ``chans`` [B, H, r]: the copy holds those channels of ``k_new``
    (``smooth`` is then [B, H, r])."""
    _, _, L, _ = _check_append4(kq, ks, k_new, pos, smooth, block_table, chans)
    p = _slots(pos, pos_offset, kq.device)  # [B]
    q_new, s_new = _quantize_rows4_ref(_new_rows(k_new, p, chans).to(kq.device), smooth)  # [B, H, D/2], [B, H]
    _write_rows_ref(kq, ks, q_new, s_new, p, L, block_table)


@triton.jit
def _round_even(y):
    """Round half to even (torch.round), for |y| well inside the fp32 integers."""
    r = tl.floor(y + 0.5)
    tie = (r - y) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _quantize4_tile(k_lo_ptrs, k_hi_ptrs, sm_lo_ptrs, sm_hi_ptrs, sm_mask, q_ptrs, s_ptrs, mask_l, mask_d,
                    SMOOTH: tl.constexpr):
    """Quantise a tile of keys held as its two channel halves [BLOCK_L, BLOCK_DH] into
    packed bytes (low nibble: first half) and per-row scales; bit-for-bit the reference
    (IEEE divisions in the reference's order, round half to even). The smoothing
    pointers broadcast against the tile: [1, BLOCK_DH] (one head) or [BLOCK_L, BLOCK_DH]
    (the append kernel, whose rows are heads)."""
    m = mask_l[:, None] & mask_d[None, :]
    x_lo = tl.load(k_lo_ptrs, mask=m, other=0.0).to(tl.float32)
    x_hi = tl.load(k_hi_ptrs, mask=m, other=0.0).to(tl.float32)
    if SMOOTH:
        s_lo = tl.broadcast_to(tl.load(sm_lo_ptrs, mask=sm_mask, other=1.0), x_lo.shape)
        s_hi = tl.broadcast_to(tl.load(sm_hi_ptrs, mask=sm_mask, other=1.0), x_hi.shape)
        x_lo = tl.math.div_rn(x_lo, s_lo)
        x_hi = tl.math.div_rn(x_hi, s_hi)
    amax = tl.maximum(tl.max(tl.abs(x_lo), axis=1), tl.max(tl.abs(x_hi), axis=1))  # [BLOCK_L]
    s = tl.math.div_rn(tl.maximum(amax, 1e-8), tl.full(amax.shape, 7.0, tl.float32))  # SCALE_FLOOR / INT4_MAX
    sb = tl.broadcast_to(s[:, None], x_lo.shape)
    v_lo = tl.minimum(tl.maximum(_round_even(tl.math.div_rn(x_lo, sb)), -7.0), 7.0)
    v_hi = tl.minimum(tl.maximum(_round_even(tl.math.div_rn(x_hi, sb)), -7.0), 7.0)
    packed = (v_lo.to(tl.int32) + 8) | ((v_hi.to(tl.int32) & 15) << 4)  # [BLOCK_L, BLOCK_DH] in [0, 255]
    tl.store(q_ptrs, packed.to(tl.uint8), mask=m)
    tl.store(s_ptrs, s, mask=mask_l)


@triton.jit
def _quantize4_keys_kernel(K, SM, KQ, KS, L,
                           stride_kb, stride_kh, stride_kl, stride_kd,
                           stride_mb, stride_mh, stride_md,
                           stride_qb, stride_qh, stride_ql, stride_qd,
                           stride_sb, stride_sh, stride_sl,
                           H: tl.constexpr, DH: tl.constexpr, BLOCK_DH: tl.constexpr, BLOCK_L: tl.constexpr,
                           SMOOTH: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (B * H, cdiv(L, BLOCK_L)): one tile of tokens of one (b, head) row."""
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    row = tl.program_id(0)
    b = (row // H).to(tl.int64)
    h = (row % H).to(tl.int64)
    offs_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, BLOCK_DH)
    l64 = offs_l.to(tl.int64)
    k_lo = K + b * stride_kb + h * stride_kh + l64[:, None] * stride_kl + offs_d[None, :] * stride_kd
    sm_lo = SM + b * stride_mb + h * stride_mh + offs_d[None, :] * stride_md  # [1, BLOCK_DH]
    q_ptrs = KQ + b * stride_qb + h * stride_qh + l64[:, None] * stride_ql + offs_d[None, :] * stride_qd
    s_ptrs = KS + b * stride_sb + h * stride_sh + l64 * stride_sl
    _quantize4_tile(k_lo, k_lo + DH * stride_kd, sm_lo, sm_lo + DH * stride_md, offs_d[None, :] < DH,
                    q_ptrs, s_ptrs, offs_l < L, offs_d < DH, SMOOTH)


@triton.jit
def _quantize4_append_kernel(KN, SM, KQ, KS, POS, L, OFFSET,
                             stride_nb, stride_nh, stride_nl, stride_nd,
                             stride_mb, stride_mh, stride_md,
                             stride_qb, stride_qh, stride_ql, stride_qd,
                             stride_sb, stride_sh, stride_sl,
                             H: tl.constexpr, DH: tl.constexpr, BLOCK_DH: tl.constexpr, BLOCK_H: tl.constexpr,
                             SMOOTH: tl.constexpr, PDL: tl.constexpr = False, BT=None,
                             stride_tb: tl.constexpr = 0, PAGED: tl.constexpr = False,
                             BLOCK_SIZE: tl.constexpr = 1, CH=None, stride_cb=0, stride_ch=0,
                             CHANS: tl.constexpr = False):
    """Grid (B,): the H new keys of row b go to slot ``POS[b] + OFFSET`` (skipped outside
    [0, L)); the tile's rows are the H heads (each with its own smoothing vector).
    PAGED: ``KQ``/``KS`` are pools addressed through ``BT``, as in ``_quantize_append_kernel``.
    CHANS: the copy's 2 DH channels are ``CH[b, h, :]`` of the new key's (first half in
    the low nibbles)."""
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    b = tl.program_id(0).to(tl.int64)
    p, h64, mask_h = _append_slot(POS, b, L, OFFSET, H, BLOCK_H)
    blk, r = _append_place(BT, b, p, stride_tb, PAGED, BLOCK_SIZE)
    offs_d = tl.arange(0, BLOCK_DH)
    k_row = KN + b * stride_nb + h64[:, None] * stride_nh + p * stride_nl
    if CHANS:
        k_lo = k_row + _append_chans(CH, b, h64, offs_d, stride_cb, stride_ch, H, DH, True) * stride_nd
        k_hi = k_row + _append_chans(CH + DH, b, h64, offs_d, stride_cb, stride_ch, H, DH, True) * stride_nd
    else:
        k_lo = k_row + offs_d[None, :] * stride_nd
        k_hi = k_lo + DH * stride_nd
    sm_lo = SM + b * stride_mb + h64[:, None] * stride_mh + offs_d[None, :] * stride_md  # [BLOCK_H, BLOCK_DH]
    q_ptrs = KQ + blk * stride_qb + h64[:, None] * stride_qh + r * stride_ql + offs_d[None, :] * stride_qd
    s_ptrs = KS + blk * stride_sb + h64 * stride_sh + r * stride_sl
    sm_mask = (h64[:, None] < H) & (offs_d[None, :] < DH)
    _quantize4_tile(k_lo, k_hi, sm_lo, sm_lo + DH * stride_md, sm_mask, q_ptrs, s_ptrs, mask_h, offs_d < DH,
                    SMOOTH)


def quantize_keys_int4_triton(k: torch.Tensor,
                              smooth: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``quantize_keys_int4``: one pass over ``k``, packed int4 + fp32 scales out."""
    _check_k(k)
    B, H, L, D = k.shape
    if D % 2:
        raise ValueError(f"int4 keys need an even head_dim, got {D}")
    _check_smooth(smooth, B, H, D, k.device)
    kq = torch.empty(B, H, L, D // 2, dtype=torch.uint8, device=k.device)
    ks = torch.empty(B, H, L, dtype=torch.float32, device=k.device)
    if B * H * L * D == 0:
        return kq, ks
    BLOCK_DH = _block_d(D // 2)
    BLOCK_L = max(1, min(64, 4096 // BLOCK_DH))
    sm = smooth if smooth is not None else ks  # never read without SMOOTH
    sm_strides = smooth.stride() if smooth is not None else (0, 0, 0)
    grid = (B * H, triton.cdiv(L, BLOCK_L))
    _quantize4_keys_kernel[grid](k, sm, kq, ks, L, *k.stride(), *sm_strides, *kq.stride(), *ks.stride(),
                                 H=H, DH=D // 2, BLOCK_DH=BLOCK_DH, BLOCK_L=BLOCK_L, SMOOTH=smooth is not None,
                                 num_warps=4, **pdl_kwargs(k, "select"))
    return kq, ks


def quantize_append_int4_triton(kq: torch.Tensor, ks: torch.Tensor, k_new: torch.Tensor, pos: torch.Tensor,
                                smooth: torch.Tensor | None = None, *, pos_offset: int = 0,
                                block_table: torch.Tensor | None = None, chans: torch.Tensor | None = None) -> None:
    """Triton ``quantize_append_int4`` (in place, one program per batch row, no host sync;
    ``pos_offset`` is added in the kernel). ``block_table``: ``kq``/``ks`` are pools, the
    slot is logical (mapped in the kernel). ``chans``: the kernel reads those channels of
    each new key (no gather launch first)."""
    B, H, L, D2 = _check_append4(kq, ks, k_new, pos, smooth, block_table, chans)
    if B * H * D2 == 0 or (block_table is not None and L == 0):
        return
    pos = pos.to(kq.device)
    sm = smooth if smooth is not None else ks
    sm_strides = smooth.stride() if smooth is not None else (0, 0, 0)
    _quantize4_append_kernel[(B,)](k_new, sm, kq, ks, pos, L, int(pos_offset), *_new_strides(k_new), *sm_strides,
                                   *kq.stride(), *ks.stride(), H=H, DH=D2, BLOCK_DH=_block_d(D2),
                                   BLOCK_H=triton.next_power_of_2(H), SMOOTH=smooth is not None, num_warps=4,
                                   **_paged_kwargs(kq, block_table), **_chans_kwargs(chans),
                                   **pdl_kwargs(k_new, "select"))

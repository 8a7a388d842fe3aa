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
  outside ``[0, L)`` are left untouched.

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

__all__ = ["SCALE_FLOOR", "quantize_keys_ref", "quantize_keys_triton", "quantize_append_ref",
           "quantize_append_triton"]

SCALE_FLOOR = 1e-8
"""Smallest ``amax`` used for a scale: an all-zero key gets a tiny finite scale (no NaN)."""


def _check_k(k: torch.Tensor) -> None:
    if k.dim() != 4 or not k.dtype.is_floating_point:
        raise ValueError(f"k must be a float [B, H, L, D] tensor, got {tuple(k.shape)} {k.dtype}")


def _check_append(kq: torch.Tensor, ks: torch.Tensor, k_new: torch.Tensor, pos: torch.Tensor) -> None:
    if kq.dim() != 4 or kq.dtype != torch.int8:
        raise ValueError(f"kq must be int8 [B, H, L, D], got {tuple(kq.shape)} {kq.dtype}")
    B, H, L, D = kq.shape
    if ks.shape != (B, H, L) or ks.dtype != torch.float32:
        raise ValueError(f"ks must be float32 [{B}, {H}, {L}], got {tuple(ks.shape)} {ks.dtype}")
    if k_new.shape != (B, H, D) or not k_new.dtype.is_floating_point:
        raise ValueError(f"k_new must be float [{B}, {H}, {D}], got {tuple(k_new.shape)} {k_new.dtype}")
    if pos.shape != (B,) or pos.dtype.is_floating_point or pos.dtype == torch.bool:
        raise ValueError(f"pos must be an integer [{B}] tensor, got {tuple(pos.shape)} {pos.dtype}")


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


def quantize_append_ref(kq: torch.Tensor, ks: torch.Tensor, k_new: torch.Tensor, pos: torch.Tensor) -> None:
    """Reference ``quantize_append`` (in place). A device-side scatter: rows whose
    ``pos`` is outside ``[0, L)`` rewrite their own slot 0 with its old value."""
    _check_append(kq, ks, k_new, pos)
    B, H, L, D = kq.shape
    p = pos.to(device=kq.device, dtype=torch.int64)  # [B]
    ok = (p >= 0) & (p < L)  # [B]
    p_safe = torch.where(ok, p, torch.zeros_like(p))
    q_new, s_new = _quantize_rows_ref(k_new.to(kq.device))  # [B, H, D], [B, H]
    idx_s = p_safe.view(B, 1, 1).expand(B, H, 1)
    old_s = ks.gather(2, idx_s)  # [B, H, 1]
    ks.scatter_(2, idx_s, torch.where(ok.view(B, 1, 1), s_new[..., None], old_s))
    idx_q = p_safe.view(B, 1, 1, 1).expand(B, H, 1, D)
    old_q = kq.gather(2, idx_q)  # [B, H, 1, D]
    kq.scatter_(2, idx_q, torch.where(ok.view(B, 1, 1, 1), q_new[:, :, None], old_q))


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
                          H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    """Grid (B * H, cdiv(L, BLOCK_L)): one tile of tokens of one (b, head) row."""
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
def _quantize_append_kernel(KN, KQ, KS, POS, L,
                            stride_nb, stride_nh, stride_nd,
                            stride_qb, stride_qh, stride_ql, stride_qd,
                            stride_sb, stride_sh, stride_sl,
                            H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
    """Grid (B,): the H new keys of row b go to slot ``POS[b]`` (skipped outside [0, L))."""
    b = tl.program_id(0).to(tl.int64)
    p = tl.load(POS + b).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (p >= 0) & (p < L)
    mask_h = (offs_h < H) & ok
    p = tl.where(ok, p, 0)
    h64 = offs_h.to(tl.int64)
    k_ptrs = KN + b * stride_nb + h64[:, None] * stride_nh + offs_d[None, :] * stride_nd
    q_ptrs = KQ + b * stride_qb + h64[:, None] * stride_qh + p * stride_ql + offs_d[None, :] * stride_qd
    s_ptrs = KS + b * stride_sb + h64 * stride_sh + p * stride_sl
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
                                H=H, D=D, BLOCK_D=BLOCK_D, BLOCK_L=BLOCK_L, num_warps=4)
    return kq, ks


def quantize_append_triton(kq: torch.Tensor, ks: torch.Tensor, k_new: torch.Tensor, pos: torch.Tensor) -> None:
    """Triton ``quantize_append`` (in place, one program per batch row, no host sync)."""
    _check_append(kq, ks, k_new, pos)
    B, H, L, D = kq.shape
    if B * H * D == 0:
        return
    pos = pos.to(kq.device)
    _quantize_append_kernel[(B,)](k_new, kq, ks, pos, L, *k_new.stride(), *kq.stride(), *ks.stride(),
                                  H=H, D=D, BLOCK_D=_block_d(D), BLOCK_H=triton.next_power_of_2(H),
                                  num_warps=4)

"""Gather selected tokens of the KV cache into contiguous buffers.

Used by the ``kv`` return mode: the cache rank gathers the selected K/V rows and
ships them, so the inference rank needs no full cache. (The attention kernel
itself never needs this copy: it reads rows through the index list in place.)

``k``/``v``: [B, Hkv, L, D]; ``indices``: [B, Hkv, K] int32 with ``-1`` for empty
slots. Returns ``(k_sel, v_sel)`` [B, Hkv, K, D] in k's dtype; rows of empty slots
(and of indices outside ``[0, L)``, which no policy produces) are zeros.

Paged cache (``block_table`` [B, max_blocks] int32, ``spade.kernels.paged``): ``k``/``v``
are pools [num_blocks, Hkv, block_size, D], indices stay logical, ``L`` is
``max_blocks * block_size`` and each index is mapped through the table at its load.

The Triton kernel is a pure copy: grid ``(B * Hkv, cdiv(K, BLOCK_K))``, each program
loads ``BLOCK_K`` indices and moves the K and V rows they name (one contiguous row
of D elements each, so the loads coalesce per row).

Example::

    >>> import torch
    >>> k = torch.arange(12.).view(1, 1, 6, 2); v = -k
    >>> ks, vs = gather_kv_ref(k, v, torch.tensor([[[4, -1, 0]]], dtype=torch.int32))
    >>> ks[0, 0].tolist()
    [[8.0, 9.0], [0.0, 0.0], [0.0, 1.0]]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spade.kernels.paged import check_block_table, paged_launch, paged_to_contiguous
from spade.kernels.pdl import grid_dep_release, grid_dep_wait, pdl_kwargs

__all__ = ["gather_kv_ref", "gather_kv_triton"]


def _check(k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, block_table: torch.Tensor | None = None) -> int:
    """The batch B."""
    if k.dim() != 4 or v.shape != k.shape:
        want = "[num_blocks, Hkv, block_size, D]" if block_table is not None else "[B, Hkv, L, D]"
        raise ValueError(f"k/v must be {want} of one shape; got {tuple(k.shape)}, {tuple(v.shape)}")
    B = k.shape[0] if block_table is None else block_table.shape[0]
    if block_table is not None:
        check_block_table(block_table, block_table.shape[0], k.device)
    if indices.dim() != 3 or indices.shape[:2] != (B, k.shape[1]):
        raise ValueError(f"indices must be [B, Hkv, K] = [{B}, {k.shape[1]}, K]; "
                         f"got {tuple(indices.shape)}")
    return B


def gather_kv_ref(k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                  block_table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain ``torch.gather`` with the empty slots zeroed (paged: over the logical copy
    ``paged_to_contiguous`` makes of the pools)."""
    _check(k, v, indices, block_table)
    if block_table is not None:
        k, v = paged_to_contiguous(k, block_table), paged_to_contiguous(v, block_table)
    L, D = k.shape[2], k.shape[3]
    idx = indices.to(k.device).long()  # [B, Hkv, K]
    ok = (idx >= 0) & (idx < L)
    src = torch.where(ok, idx, torch.zeros_like(idx))[..., None].expand(-1, -1, -1, D)
    keep = ok[..., None]  # where(), not a product: a garbage row may hold NaN
    k_sel = torch.where(keep, torch.gather(k, 2, src), torch.zeros((), dtype=k.dtype, device=k.device))
    v_sel = torch.where(keep, torch.gather(v, 2, src), torch.zeros((), dtype=v.dtype, device=v.device))
    return k_sel, v_sel


@triton.jit
def _gather_kv_kernel(K, V, IDX, KO, VO,
                      stride_kb, stride_kh, stride_kl, stride_kd,
                      stride_vb, stride_vh, stride_vl, stride_vd,
                      stride_ib, stride_ih, stride_ik,
                      Hkv, L, K_SEL,
                      D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
                      BT=None, stride_tb: tl.constexpr = 0, PAGED: tl.constexpr = False,
                      BLOCK_SIZE: tl.constexpr = 1):
    # PAGED: K/V are pools [num_blocks, Hkv, BLOCK_SIZE, D], L = max_blocks * BLOCK_SIZE, and
    # index p reads block BT[b, p // BLOCK_SIZE] at offset p % BLOCK_SIZE.
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    pid_bh = tl.program_id(0)
    pid_k = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    h = (pid_bh % Hkv).to(tl.int64)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)  # slots [BLOCK_K]
    offs_d = tl.arange(0, D_PAD)
    k_mask = offs_k < K_SEL
    d_mask = offs_d < D
    idx = tl.load(IDX + b * stride_ib + h * stride_ih + offs_k.to(tl.int64) * stride_ik,
                  mask=k_mask, other=-1).to(tl.int64)
    ok = (idx >= 0) & (idx < L)
    ld_mask = ok[:, None] & d_mask[None, :]
    if PAGED:
        blk = tl.load(BT + b * stride_tb + tl.where(ok, idx, 0) // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        off = idx % BLOCK_SIZE
        kr = tl.load(K + h * stride_kh + (blk * stride_kb + off * stride_kl)[:, None] + offs_d[None, :] * stride_kd,
                     mask=ld_mask, other=0.0)  # [BLOCK_K, D_PAD]
        vr = tl.load(V + h * stride_vh + (blk * stride_vb + off * stride_vl)[:, None] + offs_d[None, :] * stride_vd,
                     mask=ld_mask, other=0.0)
    else:
        kr = tl.load(K + b * stride_kb + h * stride_kh + idx[:, None] * stride_kl + offs_d[None, :] * stride_kd,
                     mask=ld_mask, other=0.0)  # [BLOCK_K, D_PAD]
        vr = tl.load(V + b * stride_vb + h * stride_vh + idx[:, None] * stride_vl + offs_d[None, :] * stride_vd,
                     mask=ld_mask, other=0.0)
    # outputs are contiguous [B, Hkv, K, D]
    out_off = ((b * Hkv + h) * K_SEL + offs_k.to(tl.int64))[:, None] * D + offs_d[None, :]
    st_mask = k_mask[:, None] & d_mask[None, :]
    tl.store(KO + out_off, kr, mask=st_mask)
    tl.store(VO + out_off, vr, mask=st_mask)


def gather_kv_triton(k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                     block_table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton gather; same contract as ``gather_kv_ref``."""
    B = _check(k, v, indices, block_table)
    _, Hkv, L, D = k.shape
    if block_table is not None:
        L = block_table.shape[1] * k.shape[2]
    paged = paged_launch(block_table, k.shape[2])
    K_sel = indices.shape[2]
    k_sel = torch.empty(B, Hkv, K_sel, D, dtype=k.dtype, device=k.device)
    v_sel = torch.empty(B, Hkv, K_sel, D, dtype=v.dtype, device=v.device)
    if k_sel.numel() == 0:
        return k_sel, v_sel
    D_PAD = triton.next_power_of_2(D)
    # ~16 KiB of K (and as much of V) per program: enough bytes in flight per SM.
    block_k = max(1, min(triton.next_power_of_2(K_sel), (16384 // k.element_size()) // D_PAD))
    grid = (B * Hkv, triton.cdiv(K_sel, block_k))
    _gather_kv_kernel[grid](k, v, indices, k_sel, v_sel, *k.stride(), *v.stride(), *indices.stride(),
                            Hkv, L, K_sel, D=D, D_PAD=D_PAD, BLOCK_K=block_k, num_warps=4, **pdl_kwargs(k, "select"),
                            **paged)
    return k_sel, v_sel

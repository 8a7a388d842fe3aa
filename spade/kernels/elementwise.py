"""The fast model's fused elementwise decode ops, as Triton kernels.

* ``add_rms_norm_triton(x, delta, w, eps)``: the residual add ``x += delta`` (in
  place, optional) then RMSNorm, one program per row;
* ``qkv_rope_store_triton(qkv, q_norm, k_norm, eps, cos_tab, sin_tab, pos, widx,
  k_cache, v_cache, n_q, n_kv)``: split the fused QKV projection, QK-norm, RoPE,
  and write k/v into the caches at ``widx``; returns q [B, Hq, D]. The prompt pass
  runs it with one token per "row": ``k_cache`` a [T, Hkv, 1, D] view of a row's
  positions, ``widx`` 0, ``pos`` the tokens' positions, ``q_out`` a view of the
  prompt's queries;
* ``silu_mul_triton(gu)``: ``silu(gate) * up`` of ``gu`` [B, 2I].

Their torch references are ``add_rms_norm_torch``, ``qkv_rope_store_torch`` and
``silu_mul_torch`` in ``spade.models.fast``: the model's torch path uses them (and
prefill their parts), and that module imports without triton, so they stay there.

Paged cache: ``qkv_rope_store_triton(..., block_table=)`` takes k/v pools
[num_blocks, Hkv, block_size, D] and per-row logical write positions ``widx`` [B]
(rows of a continuous batch sit at different positions); row b's k/v go to block
``block_table[b, widx[b] // block_size]`` at offset ``widx[b] % block_size``, and a
row with ``widx[b] < 0`` (a padded row of a CUDA-graph bucket) writes nothing. Its
torch reference is ``qkv_rope_store_paged_torch`` below (the model's reference
for the math, ``spade.kernels.paged.paged_write`` for the write).
The kernels compute the same formulas with one rounding per stored value.
``spade.models.fast.triton_ops()`` imports this module on first use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spade.kernels.paged import check_block_table, paged_launch, paged_write
from spade.kernels.pdl import grid_dep_release, grid_dep_wait, pdl_enabled

__all__ = ["add_rms_norm_triton", "qkv_rope_store_triton", "qkv_rope_store_paged_torch", "silu_mul_triton"]


@triton.jit
def _add_rms_norm_kernel(X, DELTA, W, OUT, stride_x, stride_d, stride_o, N, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # One program per row: x (+= delta), then y = w * (x * rsqrt(mean(x^2) + eps)).
    grid_dep_wait(PDL)  # programmatic dependent launch: see spade.kernels.pdl
    grid_dep_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(X + row * stride_x + offs, mask=m, other=0.0)
    if HAS_DELTA:
        d = tl.load(DELTA + row * stride_d + offs, mask=m, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(X + row * stride_x + offs, x, mask=m)
    xf = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
    # Round the normalised value to the model dtype before the weight multiply,
    # as the reference does.
    y = (xf * r).to(OUT.dtype.element_ty).to(tl.float32) * w
    tl.store(OUT + row * stride_o + offs, y.to(OUT.dtype.element_ty), mask=m)


@triton.jit
def _qkv_rope_store_kernel(QKV, QN, KN, COS, SIN, POS, WIDX, QOUT, KC, VC,
                           stride_qkv, stride_qo_b, stride_qo_h,
                           stride_kc_b, stride_kc_h, stride_kc_l,
                           stride_vc_b, stride_vc_h, stride_vc_l,
                           stride_cs, HQ, HKV, eps,
                           D: tl.constexpr, ROT: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr,
                           BLOCK_D: tl.constexpr, PDL: tl.constexpr,
                           BT=None, stride_tb: tl.constexpr = 0, PAGED: tl.constexpr = False,
                           BLOCK_SIZE: tl.constexpr = 1):
    # Grid (B, Hq + 2 Hkv): one head vector per program. q heads: norm, rotate,
    # store to QOUT; k heads: norm, rotate, store to the cache at WIDX; v heads:
    # copy to the cache at WIDX. PAGED: KC/VC are pools [num_blocks, Hkv, BLOCK_SIZE, D],
    # WIDX [B] per-row logical positions (< 0: no write), mapped through BT [B, max_blocks].
    grid_dep_wait(PDL)
    grid_dep_release(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    base = QKV + b * stride_qkv + h.to(tl.int64) * D
    x = tl.load(base + offs, mask=m, other=0.0)
    if PAGED:
        w_log = tl.load(WIDX + b).to(tl.int64)
        w_ok = w_log >= 0
        w_blk = tl.load(BT + b * stride_tb + tl.where(w_ok, w_log, 0) // BLOCK_SIZE, mask=w_ok, other=0).to(tl.int64)
        kc_row = KC + w_blk * stride_kc_b + (w_log % BLOCK_SIZE) * stride_kc_l
        vc_row = VC + w_blk * stride_vc_b + (w_log % BLOCK_SIZE) * stride_vc_l
        m_w = m & w_ok
    else:
        w_idx = tl.load(WIDX).to(tl.int64)
        kc_row = KC + b * stride_kc_b + w_idx * stride_kc_l
        vc_row = VC + b * stride_vc_b + w_idx * stride_vc_l
        m_w = m
    if h < HQ + HKV:
        in_rot = offs < ROT
        partner = tl.where(in_rot, tl.where(offs < HALF, offs + HALF, offs - HALF), offs)
        xp = tl.load(base + partner, mask=m, other=0.0)
        xf = x.to(tl.float32)
        xpf = xp.to(tl.float32)
        if HAS_NORM:
            is_q = h < HQ
            r = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
            w = tl.where(is_q, tl.load(QN + offs, mask=m, other=0.0), tl.load(KN + offs, mask=m, other=0.0))
            wp = tl.where(is_q, tl.load(QN + partner, mask=m, other=0.0),
                          tl.load(KN + partner, mask=m, other=0.0))
            xf = ((xf * r).to(QKV.dtype.element_ty).to(tl.float32) * w.to(tl.float32))
            xf = xf.to(QKV.dtype.element_ty).to(tl.float32)
            xpf = ((xpf * r).to(QKV.dtype.element_ty).to(tl.float32) * wp.to(tl.float32))
            xpf = xpf.to(QKV.dtype.element_ty).to(tl.float32)
        p = tl.load(POS + b).to(tl.int64)
        c = tl.load(COS + p * stride_cs + offs, mask=m & in_rot, other=1.0)
        s = tl.load(SIN + p * stride_cs + offs, mask=m & in_rot, other=0.0)
        sign = tl.where(offs < HALF, -1.0, 1.0)
        y = xf * c + sign * xpf * s
        if h < HQ:
            tl.store(QOUT + b * stride_qo_b + h.to(tl.int64) * stride_qo_h + offs,
                     y.to(QOUT.dtype.element_ty), mask=m)
        else:
            hk = (h - HQ).to(tl.int64)
            tl.store(kc_row + hk * stride_kc_h + offs, y.to(KC.dtype.element_ty), mask=m_w)
    else:
        hv = (h - HQ - HKV).to(tl.int64)
        tl.store(vc_row + hv * stride_vc_h + offs, x.to(VC.dtype.element_ty), mask=m_w)


@triton.jit
def _silu_mul_kernel(GU, OUT, stride_gu, stride_o, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
    grid_dep_wait(PDL)
    grid_dep_release(PDL)
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < I
    g = tl.load(GU + b * stride_gu + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(GU + b * stride_gu + I + offs, mask=m, other=0.0).to(tl.float32)
    sg = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + b * stride_o + offs, (sg * u).to(OUT.dtype.element_ty), mask=m)


def _warps(block: int) -> int:
    return int(min(16, max(1, block // 512)))


def add_rms_norm_triton(x, delta, w, eps):
    B, N = x.shape
    assert x.stride(1) == 1 and (delta is None or delta.stride(1) == 1)
    out = torch.empty_like(x)
    block = triton.next_power_of_2(N)
    pdl = pdl_enabled(x.device)
    _add_rms_norm_kernel[(B,)](
        x, delta if delta is not None else x, w, out, x.stride(0),
        delta.stride(0) if delta is not None else 0, out.stride(0), N, float(eps),
        HAS_DELTA=delta is not None, BLOCK=block, PDL=pdl, num_warps=_warps(block), launch_pdl=pdl)
    return out


def _check_paged_write(k_cache, v_cache, widx, block_table, B):
    check_block_table(block_table, B, k_cache.device)
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged k/v caches must be pools [num_blocks, Hkv, block_size, D] of one shape; "
                         f"got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if widx.shape != (B,) or widx.dtype.is_floating_point:
        raise ValueError(f"with block_table, widx must be the rows' integer write positions [B={B}] "
                         f"(-1: no write); got {widx.dtype} {tuple(widx.shape)}")


def qkv_rope_store_triton(qkv, q_norm, k_norm, eps, cos_tab, sin_tab, pos, widx, k_cache, v_cache, n_q, n_kv,
                          block_table=None, q_out=None):
    """``q_out`` (optional): a [B, Hq, D] view to write q into (any row and head strides,
    the last dim contiguous), e.g. a prompt's queries [Hq, T, D] seen as [T, Hq, D]."""
    B = qkv.shape[0]
    D = k_cache.shape[-1]
    rot = cos_tab.shape[-1]
    assert qkv.stride(1) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert cos_tab.stride(1) == 1 and cos_tab.stride() == sin_tab.stride()
    if block_table is not None:
        _check_paged_write(k_cache, v_cache, widx, block_table, B)
    paged = paged_launch(block_table, k_cache.shape[2])
    if q_out is None:
        q_out = torch.empty(B, n_q, D, dtype=qkv.dtype, device=qkv.device)
    elif q_out.shape != (B, n_q, D) or q_out.stride(2) != 1:
        raise ValueError(f"q_out must be a [B={B}, Hq={n_q}, D={D}] view with a contiguous last dim; "
                         f"got {tuple(q_out.shape)} strides {q_out.stride()}")
    has_norm = q_norm is not None
    pdl = pdl_enabled(qkv.device)
    _qkv_rope_store_kernel[(B, n_q + 2 * n_kv)](
        qkv, q_norm if has_norm else qkv, k_norm if has_norm else qkv, cos_tab, sin_tab, pos, widx,
        q_out, k_cache, v_cache, qkv.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        cos_tab.stride(0), n_q, n_kv, float(eps),
        D=D, ROT=rot, HALF=rot // 2, HAS_NORM=has_norm, BLOCK_D=triton.next_power_of_2(D), PDL=pdl,
        num_warps=1, launch_pdl=pdl, **paged)
    return q_out


def qkv_rope_store_paged_torch(qkv, q_norm, k_norm, eps, cos_tab, sin_tab, pos, widx, k_pool, v_pool, n_q, n_kv,
                               block_table, q_out=None):
    """Torch reference of ``qkv_rope_store_triton(..., block_table=)``: the model's
    ``qkv_rope_store_torch`` into a one-token cache, then ``paged_write`` of each row's
    k/v at its logical position ``widx[b]`` through the table (rows with ``widx < 0``
    write nothing); returns q [B, Hq, D]."""
    from spade.models.fast import qkv_rope_store_torch  # the model's reference (imports no triton)

    B = qkv.shape[0]
    _check_paged_write(k_pool, v_pool, widx, block_table, B)
    Hkv, D = k_pool.shape[1], k_pool.shape[3]
    k1 = torch.empty(B, Hkv, 1, D, dtype=k_pool.dtype, device=k_pool.device)
    v1 = torch.empty_like(k1)
    q = qkv_rope_store_torch(qkv, q_norm, k_norm, eps, cos_tab, sin_tab, pos,
                             torch.zeros(1, dtype=torch.long, device=qkv.device), k1, v1, n_q, n_kv, q_out=q_out)
    ok = (widx >= 0).long()
    paged_write(k_pool, block_table, k1, widx.clamp(min=0), ok)
    paged_write(v_pool, block_table, v1, widx.clamp(min=0), ok)
    return q


def silu_mul_triton(gu):
    B, two_i = gu.shape
    n = two_i // 2
    assert gu.stride(1) == 1
    out = torch.empty(B, n, dtype=gu.dtype, device=gu.device)
    block = min(2048, triton.next_power_of_2(n))
    pdl = pdl_enabled(gu.device)
    _silu_mul_kernel[(B, triton.cdiv(n, block))](gu, out, gu.stride(0), out.stride(0), n, BLOCK=block,
                                                 PDL=pdl, num_warps=_warps(block), launch_pdl=pdl)
    return out

"""Stage one decode layer's (q, k_new, v_new) into a pack message buffer.

The asynchronous runtime ships, per layer and step, the query and the newest
key/value row of every batch row to the cache rank. Done with torch ops that is
a copy of q plus two gathers at ``kv_lens - 1`` (each with its own index
arithmetic): about ten tiny kernels per layer, captured in the inference
rank's CUDA graph — 0.2-0.5 ms of launch gaps per step of a 36-layer model,
several percent of a sparse step. This kernel does it in one launch.

Shapes: ``q`` [B, Hq, D]; ``k_cache``/``v_cache`` [B, Hkv, L, D] (any strides
with a unit last dimension); ``kv_lens`` [B] int; ``out`` [B, Hq + 2 Hkv, D]
(unit last stride): heads ``[0, Hq)`` get q, ``[Hq, Hq + Hkv)`` get
``k_cache[b, :, kv_lens[b] - 1]``, the rest ``v_cache[b, :, kv_lens[b] - 1]``.
Rows with ``kv_lens[b] == 0`` read position 0 (a decode step always has one token).

    >>> import torch
    >>> q = torch.ones(1, 2, 4); k = torch.arange(24.).view(1, 1, 6, 4); v = -k
    >>> out = torch.empty(1, 4, 4)
    >>> stage_qkv_ref(q, k, v, torch.tensor([3]), out)[0, 2].tolist()
    [8.0, 9.0, 10.0, 11.0]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spade.kernels.pdl import grid_dep_release, grid_dep_wait, pdl_kwargs

__all__ = ["stage_qkv", "stage_qkv_ref", "stage_qkv_triton"]


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_lens: torch.Tensor,
           out: torch.Tensor) -> tuple[int, int, int, int]:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q must be [B, Hq, D] and k/v caches [B, Hkv, L, D] of one shape; got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    if k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} does not match q {tuple(q.shape)} (B, D)")
    if out.shape != (B, Hq + 2 * Hkv, D):
        raise ValueError(f"out must be [B, Hq + 2 Hkv, D] = [{B}, {Hq + 2 * Hkv}, {D}]; got {tuple(out.shape)}")
    if kv_lens.shape != (B,):
        raise ValueError(f"kv_lens must be [B] = [{B}]; got {tuple(kv_lens.shape)}")
    return B, Hq, Hkv, D


def stage_qkv_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_lens: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
    """The torch ops the kernel replaces (device-side gathers: no host sync)."""
    B, Hq, Hkv, D = _check(q, k_cache, v_cache, kv_lens, out)
    pos = (kv_lens.to(device=k_cache.device, dtype=torch.int64) - 1).clamp(min=0).view(B, 1, 1, 1)
    idx = pos.expand(B, Hkv, 1, D)
    out[:, :Hq].copy_(q)
    out[:, Hq:Hq + Hkv].copy_(k_cache.gather(2, idx).squeeze(2))
    out[:, Hq + Hkv:].copy_(v_cache.gather(2, idx).squeeze(2))
    return out


@triton.jit
def _stage_kernel(q_ptr, k_ptr, v_ptr, lens_ptr, out_ptr, Hq, Hkv,
                  sqb, sqh, skb, skh, skl, svb, svh, svl, sob, soh,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)  # output head in [0, Hq + 2 Hkv)
    d = tl.arange(0, BLOCK_D)
    m = d < D
    pos = tl.maximum(tl.load(lens_ptr + b).to(tl.int64) - 1, 0)
    b64 = b.to(tl.int64)
    if h < Hq:
        x = tl.load(q_ptr + b64 * sqb + h * sqh + d, mask=m)
    elif h < Hq + Hkv:
        x = tl.load(k_ptr + b64 * skb + (h - Hq) * skh + pos * skl + d, mask=m)
    else:
        x = tl.load(v_ptr + b64 * svb + (h - Hq - Hkv) * svh + pos * svl + d, mask=m)
    tl.store(out_ptr + b64 * sob + h * soh + d, x.to(out_ptr.dtype.element_ty), mask=m)


def stage_qkv_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_lens: torch.Tensor,
                     out: torch.Tensor) -> torch.Tensor:
    """One launch, grid (B, Hq + 2 Hkv), one head row of D elements per program."""
    B, Hq, Hkv, D = _check(q, k_cache, v_cache, kv_lens, out)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a unit last stride; got strides {t.stride()}")
    if B == 0:
        return out
    _stage_kernel[(B, Hq + 2 * Hkv)](
        q, k_cache, v_cache, kv_lens, out, Hq, Hkv,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        D=D, BLOCK_D=triton.next_power_of_2(D), num_warps=1, **pdl_kwargs(q))
    return out


def stage_qkv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_lens: torch.Tensor,
              out: torch.Tensor) -> torch.Tensor:
    """Triton on CUDA (unless ``SPADE_KERNELS=torch``), the torch reference elsewhere."""
    from spade.kernels import use_triton

    fn = stage_qkv_triton if use_triton(q) else stage_qkv_ref
    return fn(q, k_cache, v_cache, kv_lens, out)

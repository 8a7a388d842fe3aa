"""Skinny GEMM ("GEMV") for the decode step's weight projections: ``y = x @ w.T + b``.

Decode multiplies a handful of token rows (``M`` = batch, 1 to 32) by every weight
matrix of the model, so each projection is bound by reading ``w`` [N, K] once from
HBM; the floor is ``N * K * elt`` bytes over the read bandwidth. cuBLAS reaches
2.6-4.2 TB/s on the Qwen3-8B shapes at M=8 on an H200 (4.8 TB/s peak), and adds a
split-K reduce launch on the narrow ones (o_proj, down_proj). This kernel aims at
the read bandwidth on every shape.

Design
------
* One program per ``(BLOCK_N rows of w, one of SPLIT_K slices of K)``. It streams
  its ``[BLOCK_N, BLOCK_K]`` tiles of ``w`` along K (rows contiguous: 16-byte
  vector loads) and keeps the matching ``[BLOCK_M, BLOCK_K]`` slice of ``x``
  (``M`` padded to ``BLOCK_M``, rows ``>= M`` masked to zero, read from L2 —
  ``x`` is tiny next to ``w``). ``K`` and the per-split trip count are
  constexprs, so the loop has a static trip count the software pipeliner stages
  ``num_stages`` deep.
* Three inner products (``variant``, a constexpr choice the sweep compares):

  - ``"dot"``: ``tl.dot(w_tile, x_tile.T)`` -> ``[BLOCK_N, BLOCK_M]``, the weights
    as the MMA's A operand ("swap AB": the long N dimension fills the MMA rows and
    the padded batch is its narrow column dimension, ``BLOCK_M`` = 16 or 32);
  - ``"sum"``: broadcast multiply and ``tl.sum`` over K per tile, on the CUDA
    cores (``BLOCK_M`` = next power of two of ``M``: no padding waste, for M <= 4);
  - ``"fma"``: like ``"sum"`` but the K reduction is deferred to the end (an fp32
    ``[BLOCK_N, BLOCK_M, BLOCK_K]`` accumulator, one cross-lane reduction per
    program): the classic M=1 GEMV.

  All accumulate in fp32 (fp32 inputs: IEEE products, no TF32).
* Split-K without a second launch: with ``SPLIT_K > 1`` each program writes its
  fp32 partial tile to a workspace ``[SPLIT_K, n_blocks, BLOCK_N, BLOCK_M]``, then
  takes a ticket on its N block's counter (``atomic_add``, acq_rel, gpu scope);
  the program that draws the last ticket sums the ``SPLIT_K`` partials *in split
  order* (so the result is deterministic, whichever program came last), adds the
  bias, writes ``out`` in its dtype and resets the counter to zero. The counters
  are a per-device int32 buffer allocated zeroed once and left zeroed by every
  launch; the partials come from torch's caching allocator. So the op is one
  launch, allocates nothing that varies per call outside the caching allocator,
  never syncs with the host and can be captured in a CUDA graph (warm up once
  before capturing, as for any Triton kernel: that compiles it and allocates the
  counters). Two launches of this op must not run concurrently on different
  streams of one device (they would share counters); decode runs one stream.
* Launch config: ``gemv_config(M, N, K, dtype)`` returns a ``GemvConfig``
  (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, variant). ``GEMV_OVERRIDES``
  maps ``(N, K, M)`` (a tuned batch; other batches take the nearest tuned one at or
  above them) or ``(N, K)`` to a config and wins over the heuristic; a GPU sweep
  (``benchmarks/bench_gemv.py --grid``) prints the table to paste.

Interpreter (CPU) notes: bf16 ``tl.dot`` is wrong there, so operands are upcast
to fp32 behind ``UPCAST``; everything else is the compiled code path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from spade.envs import triton_interpret
from spade.kernels.pdl import grid_dep_release, grid_dep_wait, pdl_enabled

__all__ = [
    "GEMV_OVERRIDES",
    "GemvConfig",
    "MAX_M",
    "SMEM_BYTES",
    "VARIANTS",
    "CUBLAS_WINS",
    "LINEAR_MODES",
    "gemv_config",
    "linear",
    "make_linear",
    "prefers_triton",
    "linear_glu_ref",
    "linear_glu_triton",
    "linear_ref",
    "linear_triton",
]

MAX_M = 32
"""Largest batch ``M`` the kernel takes (the ``x`` slice lives in registers)."""
VARIANTS = ("dot", "sum", "fma")
_VARIANT_CODE = {v: i for i, v in enumerate(VARIANTS)}
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
H200_SMS = 132


@dataclass(frozen=True)
class GemvConfig:
    """Launch config of ``linear_triton``. ``BLOCK_K`` is clamped to K's next power of two
    (at least 16) at launch; ``SPLIT_K`` is reduced so every split has work."""

    BLOCK_N: int = 64
    BLOCK_K: int = 256
    SPLIT_K: int = 1
    num_warps: int = 4
    num_stages: int = 4
    variant: str = "dot"

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        for name in ("BLOCK_N", "BLOCK_K", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if self.SPLIT_K < 1 or self.num_stages < 1:
            raise ValueError(f"SPLIT_K and num_stages must be >= 1, got {self.SPLIT_K}, {self.num_stages}")
        if self.variant == "dot" and (self.BLOCK_N < 16 or self.BLOCK_K < 16):
            raise ValueError(f"variant 'dot' needs BLOCK_N, BLOCK_K >= 16 (tl.dot), got {self.BLOCK_N}, {self.BLOCK_K}")

    def as_tuple(self) -> tuple:
        return (self.BLOCK_N, self.BLOCK_K, self.SPLIT_K, self.num_warps, self.num_stages, self.variant)


GEMV_OVERRIDES: dict = {
    # Best configs of ``python -m benchmarks.bench_gemv --grid`` on one H200 (triton 3.6.0,
    # torch 2.11.0+cu130, bf16, CUDA-graph replay, L2-cold weights); comment: kernel us vs F.linear us.
    (6144, 4096, 1): (32, 256, 1, 2, 4, "dot"),  # qkv   15.0 vs 16.4
    (6144, 4096, 16): (64, 128, 1, 4, 5, "dot"),  # qkv   14.9 vs 15.6 (M=8), 15.1 vs 15.8 (M=16)
    (6144, 4096, 32): (64, 64, 4, 2, 4, "dot"),  # qkv   18.2 vs 16.2: cuBLAS wins at M=32
    (4096, 4096, 16): (64, 128, 4, 4, 3, "dot"),  # o     11.9 vs 13.1-13.5 (M=1..16)
    (4096, 4096, 32): (32, 128, 4, 2, 3, "dot"),  # o     12.9 vs 13.6
    (24576, 4096, 32): (64, 128, 1, 4, 3, "dot"),  # gate_up 48.7-50.1 vs 50.3-55.0 (M=1..32)
    (4096, 12288, 1): (128, 256, 4, 4, 3, "dot"),  # down  28.3 vs 30.8
    (4096, 12288, 16): (32, 64, 8, 2, 3, "dot"),  # down  29.1 vs 30.8 (M=8), 29.2 vs 29.3 (M=16)
    (4096, 12288, 32): (64, 64, 8, 2, 3, "dot"),  # down  31.2 vs 30.3: cuBLAS wins at M=32
    (151936, 4096, 16): (128, 256, 1, 4, 3, "dot"),  # lm_head 279-286 vs 299-304 (M=1..16)
    (151936, 4096, 32): (64, 128, 1, 4, 3, "dot"),  # lm_head 290.3 vs 307.7
}
"""Launch configs that win over ``gemv_config``'s heuristic, keyed by ``(N, K, M)`` (a tuned
batch: batches without an entry take the nearest tuned batch at or above them, else the
largest) or ``(N, K)`` (any batch); values are ``GemvConfig``, a dict of its fields, or the
tuple ``(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, variant)``.
``python -m benchmarks.bench_gemv --grid`` prints a table to paste here. The entries above
are Qwen3-8B's projections (qkv, o, gate_up, down, lm_head) measured on an H200."""

CUBLAS_WINS = frozenset({
    (6144, 4096, 32),  # qkv  M=17..32: 18.2 us vs cuBLAS 16.2
    (4096, 12288, 32),  # down M=17..32: 31.2 us vs cuBLAS 30.3
})
"""Tuned ``(N, K, M)`` buckets of ``GEMV_OVERRIDES`` where cuBLAS measured faster than the
best config of the sweep: ``prefers_triton`` sends them to ``F.linear``."""


def _tuned_bucket(M: int, N: int, K: int):
    """The key ``_override`` resolves for the shape (``(N, K, m)``, ``(N, K)``) or None."""
    if (N, K, M) in GEMV_OVERRIDES:
        return (N, K, M)
    tuned = sorted(k[2] for k in GEMV_OVERRIDES if len(k) == 3 and k[0] == N and k[1] == K)
    if tuned:
        return (N, K, next((m for m in tuned if m >= M), tuned[-1]))
    return (N, K) if (N, K) in GEMV_OVERRIDES else None


def prefers_triton(M: int, N: int, K: int) -> bool:
    """True where a GPU sweep measured ``linear_triton`` faster than cuBLAS for the shape:
    a tuned ``GEMV_OVERRIDES`` bucket not in ``CUBLAS_WINS``, ``M <= MAX_M``. Shapes
    nobody has timed stay on cuBLAS (``mode="triton"`` forces the kernel)."""
    if not 1 <= M <= MAX_M:
        return False
    key = _tuned_bucket(M, N, K)
    return key is not None and key not in CUBLAS_WINS


LINEAR_MODES = ("auto", "cublas", "triton")


def make_linear(mode: str, M: int, w: torch.Tensor):
    """The projection function ``f(x, w, bias)`` a decode step should use for weight ``w``
    [N, K] at batch ``M``: ``"cublas"`` -> ``F.linear``; ``"triton"`` -> ``linear_triton``
    (``F.linear`` past ``MAX_M`` rows); ``"auto"`` -> ``linear_triton`` on CUDA where
    ``prefers_triton``, ``F.linear`` elsewhere. Chosen once per shape, outside the hot
    path (a captured graph records whichever kernel it launched)."""
    if mode not in LINEAR_MODES:
        raise ValueError(f"linear mode must be one of {LINEAR_MODES}, got {mode!r}")
    N, K = w.shape
    if mode == "triton" and 1 <= M <= MAX_M:
        return linear_triton
    if mode == "auto" and w.is_cuda and prefers_triton(M, N, K):
        return linear_triton
    return F.linear


SMEM_BYTES = 232448
"""Shared memory a block may use on sm_90 (227 KiB): the heuristic keeps
``num_stages * (BLOCK_N + BLOCK_M) * BLOCK_K * elt`` under it."""


def _interpret() -> bool:
    """True when Triton runs under its CPU interpreter (decided at launch time)."""
    return triton_interpret()


def _as_config(c) -> GemvConfig:
    if isinstance(c, GemvConfig):
        return c
    if isinstance(c, dict):
        return GemvConfig(**c)
    return GemvConfig(*c)


def _override(M: int, N: int, K: int):
    """``GEMV_OVERRIDES`` entry for the shape: exact ``(N, K, M)``, else the tuned batch of
    ``(N, K)`` nearest at or above ``M`` (the largest tuned one past them), else ``(N, K)``."""
    key = _tuned_bucket(M, N, K)
    return None if key is None else GEMV_OVERRIDES[key]


def gemv_config(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16, *, sms: int = H200_SMS) -> GemvConfig:
    """Launch config for ``x`` [M, K] @ ``w`` [N, K].T: ``GEMV_OVERRIDES`` if it has the
    shape (``_override``), else the heuristic (a pure function of the shape: no device
    query, no sync).

    Heuristic, from the H200 sweep of the Qwen3-8B shapes (``"dot"`` won every shape and
    batch, M=1 included): 64 x 128 weight tiles (128 x 256 when the grid is many waves
    deep, as for lm_head), 4 warps, 3 stages; split K only when the N blocks fill under
    half the SMs, into slices of about 1536 elements (o_proj 4096x4096: 4 splits; down
    4096x12288: 8; qkv 6144x4096 with 96 blocks ran fastest unsplit). Either way
    ``BLOCK_K`` is halved while the pipeline stages would overflow shared memory."""
    elt = torch.empty((), dtype=dtype).element_size()
    found = _override(M, N, K)
    if found is not None:
        return _fit_smem(_as_config(found), M, elt)
    block_n, block_k = 64, 128 * 2 // max(elt, 2)
    if M <= 16 and triton.cdiv(N, block_n) >= 8 * sms:
        block_n, block_k = 128, 256 * 2 // max(elt, 2)
    n_blocks = triton.cdiv(N, block_n)
    split = 1
    if 2 * n_blocks < sms:
        split = min(8, triton.next_power_of_2(triton.cdiv(K, 1536)))
    variant, warps, stages = "dot", 4, 3
    return _fit_smem(GemvConfig(block_n, block_k, split, warps, stages, variant), M, elt)


def _fit_smem(cfg: GemvConfig, M: int, elt: int) -> GemvConfig:
    """Halve ``BLOCK_K`` until the ``"dot"`` pipeline's stages fit in shared memory (a table
    tuned in bf16 applied to fp32 weights, a 32-row x tile)."""
    if cfg.variant != "dot":
        return cfg
    block_k = cfg.BLOCK_K
    while cfg.num_stages * (cfg.BLOCK_N + _block_m(M, "dot")) * block_k * elt > SMEM_BYTES and block_k > 16:
        block_k //= 2
    return cfg if block_k == cfg.BLOCK_K else replace(cfg, BLOCK_K=block_k)


# ----------------------------------------------------------------------------------------------
# Reference (plain torch)
# ----------------------------------------------------------------------------------------------


def linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with fp32 accumulation, cast to ``x.dtype``."""
    y = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------


@triton.jit
def _store_out(out_ptr, acc, pid_n, offs_m, m_mask, N, stride_om,
               BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, GLU: tl.constexpr):
    """Write one program's ``[BLOCK_N, BLOCK_M]`` fp32 result tile. ``GLU``: the tile's
    first half holds gate rows, its second half the same up rows; the stored value is
    ``silu(gate) * up`` with the roundings of the two-launch path (the projection's output
    rounded to ``out``'s dtype, then the SiLU rounded, then the product), so the fused
    op equals ``silu_mul(linear(x, w))`` whatever the launch."""
    if GLU:
        HALF: tl.constexpr = BLOCK_N // 2
        gu = tl.permute(tl.reshape(acc, [2, HALF, BLOCK_M]), [1, 2, 0])  # [HALF, BLOCK_M, 2]
        g, u = tl.split(gu)
        g = g.to(out_ptr.dtype.element_ty).to(tl.float32)
        u = u.to(out_ptr.dtype.element_ty).to(tl.float32)
        sg = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
        offs_j = pid_n * HALF + tl.arange(0, HALF)
        ptrs = out_ptr + offs_m[None, :] * stride_om + offs_j[:, None]  # [HALF, BLOCK_M]
        tl.store(ptrs, (sg * u).to(out_ptr.dtype.element_ty), mask=(offs_j < N)[:, None] & m_mask[None, :])
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]  # [BLOCK_N, BLOCK_M]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_n < N)[:, None] & m_mask[None, :])


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, stride_xm, stride_wn, stride_om,
    K: tl.constexpr, K_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    VARIANT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
    PDL: tl.constexpr = False, GLU: tl.constexpr = False,
):
    """``out[m, n] = sum_k x[m, k] * w[n, k] (+ b[n])`` for one ``BLOCK_N`` block of
    ``n`` and one K slice ``[pid_k * K_PER_SPLIT, (pid_k + 1) * K_PER_SPLIT)``
    (``SPLIT_K > 1``: partials in ``ws_ptr``, the last program of the block reduces).

    ``GLU``: ``w`` is [2N, K] (gate rows, then up rows) and ``out[m, n] =
    silu(x @ gate[n]) * (x @ up[n])``: a program's tile holds ``BLOCK_N // 2`` gate rows
    and the same up rows, so the epilogue forms the product and only ``[M, N]`` is written."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if GLU:  # tile rows [0, HALF): gate rows j; [HALF, BLOCK_N): up rows j (at N + j)
        HALF: tl.constexpr = BLOCK_N // 2
        r = tl.arange(0, BLOCK_N)
        offs_n = pid_n * HALF + (r % HALF)
        up_off = tl.where(r >= HALF, N, 0)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        up_off = 0
    offs_m = tl.arange(0, BLOCK_M)
    offs_kb = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    if EVEN_N:
        w_rows = w_ptr + (offs_n + up_off).to(tl.int64)[:, None] * stride_wn
    else:  # clamp the tail rows (their results are masked at the store): loads stay unmasked along N
        w_rows = w_ptr + (tl.minimum(offs_n, N - 1) + up_off).to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    k_base = pid_k * K_PER_SPLIT
    grid_dep_wait(PDL)  # x is the previous kernel's output; out/ws may still be read by it
    if not GLU:
        grid_dep_release(PDL)

    if VARIANT == 2:
        acc3 = tl.zeros([BLOCK_N, BLOCK_M, BLOCK_K], dtype=tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for i in range(0, K_PER_SPLIT, BLOCK_K):
        offs_k = k_base + i + offs_kb
        if EVEN_K:
            w = tl.load(w_rows + offs_k[None, :])  # [BLOCK_N, BLOCK_K]
            xk = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
        else:
            k_mask = offs_k < K
            w = tl.load(w_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0)
            xk = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if VARIANT == 0:
            if UPCAST:
                w = w.to(tl.float32)
                xk = xk.to(tl.float32)
            if IEEE:
                acc = tl.dot(w, tl.trans(xk), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(xk), acc)
        elif VARIANT == 1:
            prod = w.to(tl.float32)[:, None, :] * xk.to(tl.float32)[None, :, :]  # [BLOCK_N, BLOCK_M, BLOCK_K]
            acc += tl.sum(prod, axis=2)
        else:
            acc3 += w.to(tl.float32)[:, None, :] * xk.to(tl.float32)[None, :, :]
    if VARIANT == 2:
        acc = tl.sum(acc3, axis=2)
    if GLU:  # the next kernel is a GEMV (down_proj) whose programs, launched early, would sit
        grid_dep_release(PDL)  # resident through this grid's later waves: release after the loop

    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        _store_out(out_ptr, acc, pid_n, offs_m, m_mask, N, stride_om, BLOCK_N, BLOCK_M, GLU)
    else:
        n_blocks = tl.num_programs(0)
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]
        tl.store(ws_ptr + (pid_k * n_blocks + pid_n).to(tl.int64) * (BLOCK_N * BLOCK_M) + tile, acc)
        tl.debug_barrier()  # every thread's partial is written before the ticket releases them
        ticket = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:  # the last split of this N block: reduce in split order
            tot = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                tot += tl.load(ws_ptr + (s * n_blocks + pid_n).to(tl.int64) * (BLOCK_N * BLOCK_M) + tile,
                               cache_modifier=".cg")
            if HAS_BIAS:
                tot += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            _store_out(out_ptr, tot, pid_n, offs_m, m_mask, N, stride_om, BLOCK_N, BLOCK_M, GLU)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # leave the counter zeroed for the next launch


_COUNTERS: dict = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """The per-device split-K ticket counters (int32, zero between launches)."""
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def _check(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None,
           glu: bool = False) -> None:
    """Shapes, dtypes, devices and layouts of a launch (``glu``: ``w`` stacks gate over up
    rows and ``out`` is [M, N / 2])."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}; flatten leading dims "
                         f"(x.reshape(-1, x.shape[-1])) first")
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [N, K] (nn.Linear layout), got shape {tuple(w.shape)}")
    M, K = x.shape
    N, Kw = w.shape
    if Kw != K:
        raise ValueError(f"w has K={Kw} columns but x has K={K}: x {tuple(x.shape)} @ w {tuple(w.shape)}.T "
                         f"needs w [N, {K}] (pass the nn.Linear weight, not its transpose)")
    if not 1 <= M <= MAX_M:
        raise ValueError(f"x has M={M} rows (shape {tuple(x.shape)}); linear_triton takes 1 <= M <= {MAX_M}: "
                         f"use F.linear for larger batches or split x into chunks of {MAX_M} rows")
    if N < 1 or K < 1:
        raise ValueError(f"empty projection: x {tuple(x.shape)}, w {tuple(w.shape)}")
    if x.dtype not in _DTYPES or w.dtype != x.dtype:
        raise ValueError(f"x and w must share a float dtype in {_DTYPES}, got x {x.dtype} and w {w.dtype}; "
                         f"cast one of them")
    if x.device != w.device:
        raise ValueError(f"x on {x.device} but w on {w.device}")
    if w.stride(1) != 1 or w.stride(0) < K:
        raise ValueError(f"w must be row-major with contiguous rows, got shape {tuple(w.shape)} strides "
                         f"{w.stride()}; pass w.contiguous() (once, at load time)")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N or bias.device != w.device):
        raise ValueError(f"bias must be [N]=[{N}] on {w.device}, got shape {tuple(bias.shape)} on {bias.device}")
    if glu and N % 2:
        raise ValueError(f"w must stack gate over up rows ([2I, K]); got an odd row count: shape {tuple(w.shape)}")
    n_out, name = (N // 2, "I") if glu else (N, "N")
    if out is not None and (tuple(out.shape) != (M, n_out) or out.dtype != x.dtype or out.device != x.device
                            or out.stride(1) != 1):
        raise ValueError(f"out must be [M, {name}]=[{M}, {n_out}] {x.dtype} on {x.device} with contiguous rows, got "
                         f"shape {tuple(out.shape)} {out.dtype} strides {out.stride()} on {out.device}")


def _block_m(M: int, variant: str) -> int:
    if variant == "dot":
        return 16 if M <= 16 else 32
    return triton.next_power_of_2(M)


def linear_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                  out: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """``y = x @ w.T (+ bias)`` for decode: ``x`` [M, K] with 1 <= M <= 32, ``w`` [N, K]
    row-major (nn.Linear layout), ``bias`` [N] or None; returns ``out`` [M, N] in
    ``x.dtype`` (written in place when given), fp32 accumulation. ``config``: a
    ``GemvConfig`` / tuple / dict overriding ``gemv_config``. One launch, no host sync."""
    _check(x, w, bias, out)
    return _launch(x, w, bias, out, config, glu=False)


def linear_glu_triton(x: torch.Tensor, w: torch.Tensor, *, out: torch.Tensor | None = None,
                      config=None) -> torch.Tensor:
    """The gated MLP's first half in one launch: ``silu(x @ gate.T) * (x @ up.T)`` where
    ``w`` [2I, K] stacks the gate rows over the up rows (the fused ``gate_up`` weight);
    returns ``out`` [M, I]. Equal to ``silu_mul(linear_triton(x, w))`` of the same config
    (same roundings: ``linear_glu_ref``) with one launch and no [M, 2I] intermediate.
    ``config`` is the one of the unfused ``[2I, K]`` projection (``gemv_config(M, 2I, K)``):
    a program covers ``BLOCK_N // 2`` gate rows and the matching up rows, so the grid and
    the bytes read are those of the unfused GEMV."""
    _check(x, w, None, out, glu=True)
    cfg = gemv_config(x.shape[0], w.shape[0], x.shape[1], x.dtype) if config is None else _as_config(config)
    if cfg.BLOCK_N < 2:
        raise ValueError(f"linear_glu_triton needs BLOCK_N >= 2 (a gate half and an up half), got {cfg}")
    return _launch(x, w, None, out, cfg, glu=True)


def _launch(x, w, bias, out, config, *, glu: bool) -> torch.Tensor:
    if x.stride(1) != 1:
        x = x.contiguous()
    M, K = x.shape
    N = w.shape[0] // 2 if glu else w.shape[0]  # output columns
    cfg = gemv_config(M, w.shape[0], K, x.dtype) if config is None else _as_config(config)
    block_k = min(cfg.BLOCK_K, max(16, triton.next_power_of_2(K)))
    n_kb = triton.cdiv(K, block_k)
    split = max(1, min(cfg.SPLIT_K, n_kb))
    k_per_split = triton.cdiv(n_kb, split) * block_k
    split = triton.cdiv(K, k_per_split)  # no empty splits
    block_m = _block_m(M, cfg.variant)
    rows = cfg.BLOCK_N // 2 if glu else cfg.BLOCK_N  # output columns per program
    n_blocks = triton.cdiv(N, rows)
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if split > 1:
        ws = torch.empty(split * n_blocks * cfg.BLOCK_N * block_m, dtype=torch.float32, device=x.device)
        cnt = _counters(x.device, n_blocks)
    else:
        ws = cnt = out  # unused
    upcast = _interpret()
    pdl = pdl_enabled(x.device)
    _gemv_kernel[(n_blocks, split)](
        x, w, bias if bias is not None else out, out, ws, cnt,
        M, N, x.stride(0), w.stride(0), out.stride(0),
        K=K, K_PER_SPLIT=k_per_split, SPLIT_K=split,
        BLOCK_M=block_m, BLOCK_N=cfg.BLOCK_N, BLOCK_K=block_k,
        VARIANT=_VARIANT_CODE[cfg.variant], HAS_BIAS=bias is not None,
        EVEN_K=k_per_split * split == K, EVEN_N=N % rows == 0,
        UPCAST=upcast, IEEE=x.dtype == torch.float32 and not upcast,
        PDL=pdl, GLU=glu,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )
    return out


def linear_glu_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` for ``w`` [2I, K] (gate rows over up rows), with the
    roundings of the two-launch decode path: the projection accumulated in fp32 and
    rounded to ``x.dtype``, the SiLU computed in fp32 and rounded, then the product."""
    g, u = linear_ref(x, w).chunk(2, dim=-1)
    sg = F.silu(g.float()).to(x.dtype)
    return (sg.float() * u.float()).to(x.dtype)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch: ``linear_triton`` for CUDA tensors (``SPADE_KERNELS`` as in
    ``spade.kernels.use_triton``), ``linear_ref`` elsewhere (``out`` filled if given)."""
    from spade.kernels import use_triton

    if use_triton(x):
        return linear_triton(x, w, bias, out=out)
    y = linear_ref(x, w, bias)
    if out is not None:
        out.copy_(y)
        return out
    return y

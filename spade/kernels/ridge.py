"""Next-query prediction by ridge regression over a window of past queries.

AsyncSpade (arXiv 2510.07486, §4.2) selects tokens for step t+1 before q_t exists,
from a prediction q̂ of the next query made out of the recent queries. This module
implements the predictors; it follows the *equations* of §4.2, not the looser
appendix pseudo-code (which applies the softmax twice and does not zero the masked
entries of the shorter windows).

Notation: ``window`` [N, R, D] (N = batch × heads flattened), oldest first; its last
``n = n_valid`` rows are valid and right-aligned (rows before them are garbage and
are never read). Call the valid rows x_1 .. x_n, x_n the newest query. For a
regression window of size w (1 <= w <= n-1):

* X = [x_{n-w}, ..., x_{n-1}] (w × D, the w predecessors of x_n), y = x_n;
* ridge weights a = (X Xᵀ + λ I_w)^{-1} X y (the closed form, a w × w system),
  with λ = eps · mean_{i=1..n} ||x_i||² — eps is relative to the squared query
  norm of the window, so one setting serves every layer and head (the mean runs
  over all n valid rows, the same λ for every w);
* the prediction applies the weights to the window shifted by one step:
  q̂ = Σ_j a_j X'_j with X' = [x_{n-w+1}, ..., x_n].

Modes:

* ``last``: q̂ = x_n (the one-step-stale query);
* ``ridge``: w = n-1, raw weights a;
* ``softmax_ridge``: w = n-1, weights softmax(a);
* ``assembled`` (the paper's predictor): the mean over w = 1 .. n-1 of the
  ``softmax_ridge`` predictions of size w; each softmax runs once over the w
  weights of its own window (entries a shorter window does not have contribute
  nothing).

With n < 2 there is nothing to regress: every mode returns x_n.

Triton kernel (fully in-kernel solve, no torch linear algebra): one program per row
n of N. It loads X (the m = n-1 regressor rows) right-aligned into an M × D tile
(M = max(16, next_pow2(m)); padded rows are zero and get a unit diagonal), forms
the Gram matrix G = X Xᵀ with one ``tl.dot`` and b = X y, then:

1. factors A = G + λI = U Uᵀ with U *upper* triangular (a "UL" Cholesky that
   eliminates from the last row up). The window-w system is the trailing w × w
   block of A, and U's trailing block is its Cholesky factor, so one
   factorisation serves every w;
2. solves U z = b once (back substitution): because U is upper triangular, the
   trailing part of z is the same for every trailing block;
3. solves Uᵀ_trail a_w = z_trail for all w at once by forward substitution,
   building S[k, i] = weight of X row i in the window that starts at row k;
4. turns S into one coefficient vector C over the rows of X' (raw, softmax, or
   the mean of per-row softmaxes) and writes q̂ = Cᵀ X'.

Everything is O(M³) register work in fp32 (M <= 64); eps > 0 keeps A well
conditioned (cond(A) <= 1 + n/eps).

Example::

    >>> import torch
    >>> w = torch.randn(2, 8, 16)
    >>> torch.equal(ridge_predict_ref(w, 8, mode="last"), w[:, -1])
    True
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from spade.kernels.pdl import grid_dep_release, grid_dep_wait, pdl_kwargs

__all__ = ["ridge_predict_ref", "ridge_predict_torch", "ridge_predict_triton", "MODES"]

MODES = ("last", "ridge", "softmax_ridge", "assembled")
_MODE_ID = {"ridge": 1, "softmax_ridge": 2, "assembled": 3}
_LAMBDA_FLOOR = 1e-20  # keeps an all-zero window solvable (weights 0, not NaN)


def _check(window: torch.Tensor, n_valid: int, mode: str, eps: float) -> None:
    if window.dim() != 3:
        raise ValueError(f"window must be [N, R, D]; got {tuple(window.shape)}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    if not 1 <= int(n_valid) <= window.shape[1]:
        raise ValueError(f"n_valid must be in [1, {window.shape[1]}] (the window length); got {n_valid}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0; got {eps}")


def ridge_predict_ref(window: torch.Tensor, n_valid: int, *, mode: str = "assembled",
                      eps: float = 1e-2) -> torch.Tensor:
    """Plain-torch predictor in float64 (one ``torch.linalg.solve`` per window size).
    Returns [N, D] float32."""
    _check(window, n_valid, mode, eps)
    n = int(n_valid)
    R = window.shape[1]
    x = window[:, R - n:, :].double()  # [N, n, D] valid rows x_1 .. x_n
    if mode == "last" or n < 2:
        return x[:, -1].float()
    y = x[:, -1]  # [N, D]
    lam = (eps * (x * x).sum(-1).mean(-1)).clamp_min(_LAMBDA_FLOOR)  # [N]

    def weights(w: int) -> torch.Tensor:
        X = x[:, n - 1 - w:n - 1]  # [N, w, D] = x_{n-w} .. x_{n-1}
        A = X @ X.transpose(1, 2) + lam[:, None, None] * torch.eye(w, dtype=x.dtype, device=x.device)
        return torch.linalg.solve(A, (X @ y[:, :, None])[..., 0])  # [N, w]

    def shifted(w: int) -> torch.Tensor:
        return x[:, n - w:n]  # [N, w, D] = x_{n-w+1} .. x_n

    if mode == "ridge":
        a = weights(n - 1)
        out = (a[..., None] * shifted(n - 1)).sum(1)
    elif mode == "softmax_ridge":
        a = torch.softmax(weights(n - 1), dim=-1)
        out = (a[..., None] * shifted(n - 1)).sum(1)
    else:  # assembled
        out = torch.zeros_like(y)
        for w in range(1, n):
            a = torch.softmax(weights(w), dim=-1)
            out += (a[..., None] * shifted(w)).sum(1)
        out /= n - 1
    return out.float()


def ridge_predict_torch(window: torch.Tensor, n_valid: int, *, mode: str = "assembled",
                        eps: float = 1e-2) -> torch.Tensor:
    """The same function as ``ridge_predict_ref`` in a few batched torch ops (the
    CPU path), with the kernel's one factorisation for every window size: the Gram
    matrix ``A = X Xᵀ + λI`` of the regressors is built once; every window size's
    system is a trailing principal block of it, which the reversed matrix ``J A J``
    turns into a leading one, and the leading blocks of its Cholesky factor ``L``
    (``J A J = L Lᵀ``) are the factors of its leading blocks. So one Cholesky, one
    triangular inverse and ``u = L⁻¹ J b`` (whose first ``w`` entries serve size
    ``w``) leave size ``w``'s weights as ``L_w^{-T} u[:w]``, the leading block of
    ``L^{-T}`` applied to them: one running sum over the columns of ``L^{-T} diag(u)``
    gives every size at once. float32 with float64 factorisation and solves."""
    _check(window, n_valid, mode, eps)
    n = int(n_valid)
    R = window.shape[1]
    x = window[:, R - n:, :].float()  # [N, n, D]
    if mode == "last" or n < 2:
        return x[:, -1].clone()
    m = n - 1
    X, y, xs = x[:, :m], x[:, -1], x[:, 1:]  # regressors, target, shifted window: [N, m, D], [N, D], [N, m, D]
    lam = (eps * (x * x).sum(-1).mean(-1)).clamp_min(_LAMBDA_FLOOR).double()  # [N]
    eye = torch.eye(m, dtype=torch.float64, device=x.device)
    A = (X @ X.transpose(1, 2)).double() + lam[:, None, None] * eye  # [N, m, m]
    bv = (X @ y[:, :, None])[..., 0].double()  # [N, m]
    # J A J = L Lᵀ ([N, m, m]); _ex: no raise on a row of garbage (a skipped serving row), whose
    # NaN stays in its own prediction, which ``skip`` replaces
    low = torch.linalg.cholesky_ex(A.flip(-1, -2)).L
    # the leading block of L^{-T} is L_w^{-T}, so size w's weights are z_w = (L^{-T} u)_w summed over
    # the first w columns only: a running sum over the columns gives every size at once
    linv = torch.linalg.solve_triangular(low, eye.expand_as(low), upper=False)  # [N, m, m]: L^{-1}
    u = (linv @ bv.flip(-1)[..., None])[..., 0]  # [N, m]: L u = J b
    part = (linv.transpose(1, 2) * u[:, None, :]).cumsum(-1).transpose(1, 2)  # [N, w - 1, i]: Σ_{j < w}
    sizes = torch.arange(1, m + 1, device=x.device) if mode == "assembled" else torch.tensor([m], device=x.device)
    lead = torch.arange(m, device=x.device)[None, :] < sizes[:, None]  # [S, m]: leading block of each size
    z = part[:, sizes - 1].masked_fill(~lead[None], 0.0)  # [N, S, m], zero outside each block
    a = z.flip(-1).float()  # back to the window's order: each size's weights on its trailing block
    inside = lead.flip(-1)  # [S, m]: trailing block of each size
    if mode == "ridge":
        w = a
    else:  # softmax over each size's own entries only
        w = torch.softmax(a.masked_fill(~inside[None], float("-inf")), dim=-1)
    pred = w @ xs  # [N, S, D]
    return pred.mean(1) if mode == "assembled" else pred[:, 0]


@triton.jit
def _ridge_kernel(W, OUT, SKIP, stride_n, stride_r, stride_d, R, m, eps, PER, N_SKIP,
                  D: tl.constexpr, D_PAD: tl.constexpr, M: tl.constexpr, MODE: tl.constexpr,
                  HAS_SKIP: tl.constexpr = False, PDL: tl.constexpr = False):
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    pid = tl.program_id(0).to(tl.int64)
    offs_p = tl.arange(0, M)  # tile rows: X row p <-> window row R-1-M+p (valid for p >= off)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < D
    if HAS_SKIP:  # a row nobody reads (``skip``): the newest query, no solve
        if tl.load(SKIP + (pid // PER) % N_SKIP) != 0:
            newest = tl.load(W + pid * stride_n + (R - 1) * stride_r + offs_d * stride_d, mask=d_mask, other=0.0)
            tl.store(OUT + pid * D + offs_d, newest.to(tl.float32), mask=d_mask)
            return
    off = M - m  # first valid tile row
    valid_p = offs_p >= off
    rows = offs_p[:, None]  # [M, 1]
    cols = offs_p[None, :]  # [1, M]
    base = W + pid * stride_n
    ld_mask = valid_p[:, None] & d_mask[None, :]
    X = tl.load(base + (R - 1 - M + offs_p)[:, None] * stride_r + offs_d[None, :] * stride_d,
                mask=ld_mask, other=0.0).to(tl.float32)  # [M, D_PAD]
    y = tl.load(base + (R - 1) * stride_r + offs_d * stride_d, mask=d_mask, other=0.0).to(tl.float32)

    G = tl.dot(X, tl.trans(X), input_precision="ieee")  # [M, M] Gram of the regressors
    bvec = tl.sum(X * y[None, :], 1)  # [M] X y
    sq = tl.sum(tl.sum(X * X, 1), 0) + tl.sum(y * y, 0)
    lam = tl.maximum(eps * sq / (m + 1), 1e-20)
    eye = rows == cols
    A = G + tl.where(eye, tl.where(valid_p, lam, 1.0)[:, None], 0.0)

    # 1. UL Cholesky: A = U Uᵀ, U upper triangular, eliminating from the last column.
    U = tl.zeros([M, M], tl.float32)
    for jj in range(0, M):
        j = M - 1 - jj
        col = tl.sum(tl.where(cols == j, A, 0.0), 1)  # A[:, j]
        piv = tl.sum(tl.where(offs_p == j, col, 0.0), 0)
        u = tl.where(offs_p <= j, col / tl.sqrt(piv), 0.0)  # U[:, j]
        U = tl.where(cols == j, u[:, None], U)
        A = A - u[:, None] * u[None, :]

    # 2. U z = b (back substitution); z's trailing part serves every trailing block.
    z = tl.zeros([M], tl.float32)
    for jj in range(0, M):
        j = M - 1 - jj
        urow = tl.sum(tl.where(rows == j, U, 0.0), 0)  # U[j, :]
        ujj = tl.sum(tl.where(offs_p == j, urow, 0.0), 0)
        bj = tl.sum(tl.where(offs_p == j, bvec, 0.0), 0)
        zj = (bj - tl.sum(urow * z, 0)) / ujj
        z = tl.where(offs_p == j, zj, z)

    # 3. Uᵀ[k:, k:] a = z[k:] for every k at once: S[k, i] (i >= k) = weight of X row i
    #    in the window starting at row k.
    S = tl.zeros([M, M], tl.float32)
    for i in range(0, M):
        ucol = tl.sum(tl.where(cols == i, U, 0.0), 1)  # U[:, i] = row i of Uᵀ
        uii = tl.sum(tl.where(offs_p == i, ucol, 0.0), 0)
        zi = tl.sum(tl.where(offs_p == i, z, 0.0), 0)
        t = tl.sum(S * ucol[None, :], 1)  # [M] Σ_j S[k, j] U[j, i]
        S = tl.where((cols == i) & (rows <= i), ((zi - t) / uii)[:, None], S)

    # 4. Coefficients over the shifted rows X' (X' row p = window row R-M+p).
    if MODE == 3:
        logits = tl.where((cols >= rows) & (rows >= off), S, float("-inf"))
        mx = tl.max(logits, 1)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        e = tl.exp(logits - mx[:, None])
        den = tl.sum(e, 1)
        P = e / tl.where(den > 0, den, 1.0)[:, None]
        C = tl.sum(P, 0) / m
    else:
        a = tl.sum(tl.where(rows == off, S, 0.0), 0)  # the largest window's weights
        if MODE == 2:
            logit = tl.where(valid_p, a, float("-inf"))
            e = tl.exp(logit - tl.max(logit, 0))
            C = e / tl.sum(e, 0)
        else:
            C = tl.where(valid_p, a, 0.0)
    Xs = tl.load(base + (R - M + offs_p)[:, None] * stride_r + offs_d[None, :] * stride_d,
                 mask=ld_mask, other=0.0).to(tl.float32)  # [M, D_PAD]
    q_hat = tl.sum(C[:, None] * Xs, 0)
    tl.store(OUT + pid * D + offs_d, q_hat, mask=d_mask)


def ridge_predict_triton(window: torch.Tensor, n_valid: int, *, mode: str = "assembled",
                         eps: float = 1e-2, skip: torch.Tensor | None = None, per: int = 1) -> torch.Tensor:
    """Triton predictor (whole solve in-kernel); same contract as ``ridge_predict_ref``.
    ``last`` (and n < 2) is a plain copy of the newest row, no kernel. ``skip``
    (``ridge_predict_skip``): window rows whose entry is True skip the solve."""
    _check(window, n_valid, mode, eps)
    _check_skip(window, skip, per)
    N, R, D = window.shape
    n = int(n_valid)
    if mode == "last" or n < 2:
        return window[:, R - 1].float().clone()
    m = n - 1
    M = max(16, triton.next_power_of_2(m))
    D_PAD = max(16, triton.next_power_of_2(D))
    out = torch.empty(N, D, dtype=torch.float32, device=window.device)
    if N == 0:
        return out
    # The solve is a chain of small reductions over [M, M] tiles: one warp keeps
    # them in shuffles (no shared-memory round trips) where the tiles fit its
    # registers (M=16, D=128: 86 regs, no spills on sm_90); bigger tiles get a warp
    # per ~1024 elements of X (M=64, D=128: 8 warps, 128 regs).
    num_warps = max(1, min(16, (M * D_PAD) // (2048 if M <= 16 else 1024)))
    sk = {} if skip is None else dict(HAS_SKIP=True)
    _ridge_kernel[(N,)](window, out, out if skip is None else skip, *window.stride(), R, m, float(eps),
                        int(per), 1 if skip is None else int(skip.numel()),
                        D=D, D_PAD=D_PAD, M=M, MODE=_MODE_ID[mode], num_warps=num_warps, **sk,
                        **pdl_kwargs(window, "select"))
    return out


def _check_skip(window: torch.Tensor, skip: torch.Tensor | None, per: int) -> None:
    if skip is None:
        return
    N = window.shape[0]
    if skip.dtype != torch.bool or skip.dim() != 1 or skip.device != window.device:
        raise ValueError(f"skip must be a 1-d bool tensor on {window.device}, got {skip.dtype} "
                         f"{tuple(skip.shape)} on {skip.device}")
    if per < 1 or N % (per * max(1, skip.numel())):
        raise ValueError(f"the window's {N} rows must be whole groups of per={per} rows for each of the "
                         f"{skip.numel()} entries of skip (N = repeats x {skip.numel()} x {per})")


def ridge_predict_skip(window: torch.Tensor, n_valid: int, *, mode: str = "assembled", eps: float = 1e-2,
                       skip: torch.Tensor, per: int = 1, fn=None) -> torch.Tensor:
    """Reference of ``ridge_predict_triton(..., skip=, per=)``: window row ``n`` belongs
    to entry ``(n // per) % len(skip)`` (e.g. ``[P, B, H]`` flattened with ``per = H``
    and ``skip`` [B]); rows of a True entry predict their newest query (no solve, as
    ``last``), the others ``fn`` (default ``ridge_predict_ref``)."""
    _check(window, n_valid, mode, eps)
    _check_skip(window, skip, per)
    full = (fn or ridge_predict_ref)(window, n_valid, mode=mode, eps=eps)
    rows = (torch.arange(window.shape[0], device=window.device) // per) % skip.numel()
    return torch.where(skip[rows][:, None], window[:, -1].float(), full)


# ----------------------------------------------------------------------------- window push
def _check_push(window: torch.Tensor, q: torch.Tensor) -> None:
    if window.dim() != 4 or window.dtype != torch.float32 or not window.is_contiguous():
        raise ValueError(f"window must be a contiguous float32 [B, H, R, D] tensor, got {window.dtype} "
                         f"{tuple(window.shape)} (contiguous={window.is_contiguous()})")
    B, H, R, D = window.shape
    if q.shape != (B, H, D) or q.device != window.device or not q.is_floating_point():
        raise ValueError(f"q must be a float [B, H, D] = {(B, H, D)} tensor on {window.device} to push into "
                         f"window {tuple(window.shape)}, got {q.dtype} {tuple(q.shape)} on {q.device}")


def window_push_ref(window: torch.Tensor, q: torch.Tensor) -> None:
    """Shift the query window one row towards the oldest and write ``q`` as the
    newest row, in place: ``window`` [B, H, R, D] float32 (oldest first), ``q``
    [B, H, D] any float dtype (converted to float32)."""
    _check_push(window, q)
    window[:, :, :-1] = window[:, :, 1:].clone()
    window[:, :, -1] = q.float()


@triton.jit
def _window_push_kernel(W, Q, stride_qb, stride_qh, stride_qd, H, R,
                        D: tl.constexpr, R_PAD: tl.constexpr, D_PAD: tl.constexpr, PDL: tl.constexpr = False):
    """One program per (b, head): its R rows are loaded whole, then stored one row up
    with q in the last row — in place, since no other program touches these rows."""
    grid_dep_wait(PDL)  # programmatic dependent launch: spade.kernels.pdl
    grid_dep_release(PDL)
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    offs_r = tl.arange(0, R_PAD)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < D
    base = W + pid.to(tl.int64) * R * D
    src = tl.load(base + (offs_r[:, None] + 1) * D + offs_d[None, :],
                  mask=(offs_r[:, None] + 1 < R) & d_mask[None, :], other=0.0)  # rows 1..R-1 -> 0..R-2
    qv = tl.load(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + offs_d * stride_qd,
                 mask=d_mask, other=0.0).to(tl.float32)
    new = tl.where((offs_r == R - 1)[:, None], qv[None, :], src)
    tl.debug_barrier()  # every thread's loads land before any store overwrites them
    tl.store(base + offs_r[:, None] * D + offs_d[None, :], new, mask=(offs_r[:, None] < R) & d_mask[None, :])


def window_push_triton(window: torch.Tensor, q: torch.Tensor) -> None:
    """Triton ``window_push`` (one launch in place of a float copy, a clone and two
    strided copies): same contract as ``window_push_ref``."""
    _check_push(window, q)
    B, H, R, D = window.shape
    if B * H == 0:
        return
    _window_push_kernel[(B * H,)](window, q, *q.stride(), H, R, D=D, R_PAD=triton.next_power_of_2(R),
                                  D_PAD=max(16, triton.next_power_of_2(D)), num_warps=4, **pdl_kwargs(window, "select"))


# ----------------------------------------------------------------------------- RoPE rotation
# The predictor works on pre-RoPE queries (``policy.rope_aware``): each step un-rotates the
# observed query by its position and rotates the prediction by the next one. In torch that
# is ~25 small kernels per rotation (frequencies, angles, cos/sin, rotate_half); here it is
# one launch. The angle is formed in float64 (exact at 500k+ positions) and reduced modulo
# 2*pi there, so cos/sin run in float32 on an argument in (-2*pi, 2*pi).

def rope_table(theta: float, dim: int, device) -> torch.Tensor:
    """The float64 constants of ``rope_rotate``: ``dim / 2`` inverse frequencies
    ``theta ** (-2j / dim)`` (as ``spade.policies.base.RopeSpec.cos_sin`` forms them),
    then 2*pi and 1 / (2*pi). Make it outside CUDA-graph capture (a host-to-device copy)."""
    if dim < 2 or dim % 2:
        raise ValueError(f"rotary dim must be even and >= 2, got {dim}")
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    return torch.cat([inv, torch.tensor([2 * math.pi, 1 / (2 * math.pi)], dtype=torch.float64)]).to(device)


def _check_rope(x: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, start: torch.Tensor | None) -> int:
    if x.dim() != 3 or not x.is_floating_point() or lens.dim() != 1 or lens.numel() == 0 \
            or x.shape[0] % lens.numel():
        raise ValueError(f"x must be a float [N, H, D] tensor with N a multiple of B = len(lens) = "
                         f"{lens.numel()}, got {x.dtype} {tuple(x.shape)}")
    half = table.numel() - 2
    if table.dtype != torch.float64 or table.dim() != 1 or half < 1 or 2 * half > x.shape[-1]:
        raise ValueError(f"table must be rope_table(...) for at most D={x.shape[-1]} rotary dims, "
                         f"got {table.dtype} {tuple(table.shape)}")
    for name, t in (("lens", lens), ("start", start)):
        if t is not None and (t.shape != lens.shape or t.is_floating_point() or t.device != x.device):
            raise ValueError(f"{name} must be an integer [B={lens.numel()}] tensor on {x.device}, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    return half


def rope_rotate_ref(x: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, start: torch.Tensor | None = None,
                    offset: int = 0, inverse: bool = False) -> torch.Tensor:
    """Rotate ``x`` [B, H, D] by RoPE position ``lens[b] - start[b] - offset`` of its row
    (``inverse``: by minus it): float32 [B, H, D]. ``x`` may also stack several such
    batches, [P * B, H, D] (e.g. a pack of layers): row ``n`` takes the position of
    ``n % B``. The first ``2 * (table.numel() - 2)``
    dims rotate (HF ``rotate_half`` layout), the rest pass through; ``table`` from
    ``rope_table``. A pure rotation (no attention scaling)."""
    half = _check_rope(x, table, lens, start)
    pos = lens.to(torch.int64) - offset
    if start is not None:
        pos = pos - start.to(torch.int64)
    pos = pos.repeat(x.shape[0] // pos.numel())  # [N]: row n at n % B
    ang = pos.to(torch.float64)[:, None] * table[:half][None, :]  # [N, half]
    c, s = ang.cos().float()[:, None], ang.sin().float()[:, None]
    if inverse:
        s = -s
    x = x.float()
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * half:]], dim=-1)


@triton.jit
def _rope_rotate_kernel(X, OUT, LENS, START, TAB, stride_xb, stride_xh, stride_xd, H, NB, offset,
                        D: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr,
                        HAS_START: tl.constexpr, INVERSE: tl.constexpr, PDL: tl.constexpr = False):
    """One program per (b, head): the row's position, its angles in float64 reduced
    modulo 2*pi, then the rotate_half rotation in float32."""
    grid_dep_wait(PDL)
    grid_dep_release(PDL)
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    p = tl.load(LENS + b % NB).to(tl.int64) - offset
    if HAS_START:
        p -= tl.load(START + b % NB).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    m = j < HALF
    inv = tl.load(TAB + j, mask=m, other=0.0)  # float64
    two_pi = tl.load(TAB + HALF)  # float64 constants from the table (a literal would be float32)
    inv_two_pi = tl.load(TAB + HALF + 1)
    ang = p.to(tl.float64) * inv
    turns = (ang * inv_two_pi).to(tl.int64)  # whole turns (truncated): exact in float64
    r = (ang - turns.to(tl.float64) * two_pi).to(tl.float32)
    c = tl.cos(r)
    s = tl.sin(r)
    if INVERSE:
        s = -s
    src = X + b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh
    x1 = tl.load(src + j * stride_xd, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + (j + HALF) * stride_xd, mask=m, other=0.0).to(tl.float32)
    dst = OUT + pid.to(tl.int64) * D
    tl.store(dst + j, x1 * c - x2 * s, mask=m)
    tl.store(dst + HALF + j, x2 * c + x1 * s, mask=m)
    if REST_PAD > 0:  # partial rotary: the dims past the rotary ones pass through
        t = 2 * HALF + tl.arange(0, REST_PAD)
        mt = t < D
        tl.store(dst + t, tl.load(src + t * stride_xd, mask=mt, other=0.0).to(tl.float32), mask=mt)


def rope_rotate_triton(x: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, start: torch.Tensor | None = None,
                       offset: int = 0, inverse: bool = False) -> torch.Tensor:
    """Triton ``rope_rotate`` (one launch, graph-safe, no host sync): same contract as
    ``rope_rotate_ref``."""
    half = _check_rope(x, table, lens, start)
    B, H, D = x.shape
    out = torch.empty(B, H, D, dtype=torch.float32, device=x.device)
    if B * H == 0:
        return out
    rest = D - 2 * half
    _rope_rotate_kernel[(B * H,)](x, out, lens, lens if start is None else start, table, *x.stride(), H, lens.numel(),
                                  int(offset),
                                  D=D, HALF=half, HALF_PAD=triton.next_power_of_2(half),
                                  REST_PAD=triton.next_power_of_2(rest) if rest else 0,
                                  HAS_START=start is not None, INVERSE=bool(inverse), num_warps=1,
                                  **pdl_kwargs(x, "select"))
    return out

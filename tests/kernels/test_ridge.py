"""Next-query ridge predictor.

* the reference against an independent float64 implementation (numpy ``lstsq`` on
  the augmented ridge system [Xᵀ; √λ I] a ≈ [y; 0], not the normal equations);
* Triton against the reference, with NaN garbage in the rows before the valid ones
  (they must never be read);
* a sequence that really is a linear recurrence: ``ridge`` must predict the next
  query far better than ``last``;
* the degenerate windows (n = 1, 2) and argument checks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from spade.kernels import ridge as Rg

MODES = ["ridge", "softmax_ridge", "assembled"]


def _numpy_predict(window: np.ndarray, n: int, mode: str, eps: float) -> np.ndarray:
    """float64 predictor written from the equations, one row at a time."""
    N, R, D = window.shape
    out = np.zeros((N, D))
    for r in range(N):
        x = window[r, R - n:].astype(np.float64)  # x_1 .. x_n
        if mode == "last" or n < 2:
            out[r] = x[-1]
            continue
        lam = eps * np.mean(np.sum(x * x, axis=1))
        preds = []
        sizes = [n - 1] if mode in ("ridge", "softmax_ridge") else list(range(1, n))
        for w in sizes:
            X = x[n - 1 - w:n - 1]  # [w, D] predecessors of x_n
            design = np.vstack([X.T, math.sqrt(lam) * np.eye(w)])  # [D + w, w]
            target = np.concatenate([x[-1], np.zeros(w)])
            a = np.linalg.lstsq(design, target, rcond=None)[0]
            if mode != "ridge":
                a = np.exp(a - a.max())
                a /= a.sum()
            preds.append(a @ x[n - w:n])  # weights on the window shifted by one step
        out[r] = np.mean(preds, axis=0)
    return out


def _rel(a: torch.Tensor, b) -> float:
    b = torch.as_tensor(b, dtype=torch.float64).cpu()
    return ((a.double().cpu() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n,eps", [(2, 1e-2), (3, 0.3), (9, 1e-2), (12, 1e-3)])
def test_reference_matches_numpy_lstsq(mode, n, eps):
    torch.manual_seed(n)
    window = torch.randn(4, 12, 16, dtype=torch.float64)
    window[1] *= 5.0  # eps is relative: scaling a row must not matter
    ref = Rg.ridge_predict_ref(window, n, mode=mode, eps=eps)
    exp = _numpy_predict(window.numpy(), n, mode, eps)
    assert ref.dtype == torch.float32 and ref.shape == (4, 16)
    assert _rel(ref, exp) < 1e-6


# fp32 solves of systems with cond(A) <= 1 + n/eps; inputs rounded to 16 bits are
# the same inputs for both sides (the reference upcasts them too)
TOL = {torch.float32: 2e-4, torch.float16: 2e-4, torch.bfloat16: 2e-4}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("D,n,R", [(16, 13, 16), (64, 5, 9), (64, 17, 17), (48, 30, 33)])
def test_triton_matches_reference(D, n, R, mode, dtype, device):
    window = torch.randn(3, R, D, device=device).to(dtype)
    window[:, : R - n] = float("nan")  # garbage before the valid rows: never read
    out = Rg.ridge_predict_triton(window, n, mode=mode)
    ref = Rg.ridge_predict_ref(window, n, mode=mode)
    assert out.dtype == torch.float32 and out.shape == (3, D)
    assert torch.isfinite(ref).all()
    assert _rel(out, ref) < TOL[dtype], _rel(out, ref)


def test_triton_largest_window(device):
    """n = 65 (W = 64 plus the newest row): the 64 x 64 tile, rank-deficient D < n.
    One row: each row is its own program (more rows are covered at smaller W above)."""
    window = torch.randn(1, 65, 16, device=device)
    for mode in ("ridge", "assembled"):
        out = Rg.ridge_predict_triton(window, 65, mode=mode)
        ref = Rg.ridge_predict_ref(window, 65, mode=mode)
        assert _rel(out, ref) < 1e-3, (mode, _rel(out, ref))


def _rotation_sequence(n_steps: int, D: int, sub: int, gen: torch.Generator) -> torch.Tensor:
    """x_t = A x_{t-1}, A a random rotation acting on a random ``sub``-dim subspace
    of R^D (identity elsewhere) — a linear recurrence of small order."""
    basis, _ = torch.linalg.qr(torch.randn(D, sub, generator=gen, dtype=torch.float64))
    blocks = []
    for i in range(sub // 2):
        th = 0.3 + 0.5 * i
        blocks.append(torch.tensor([[math.cos(th), -math.sin(th)], [math.sin(th), math.cos(th)]],
                                   dtype=torch.float64))
    rot = torch.block_diag(*blocks)
    A = torch.eye(D, dtype=torch.float64) + basis @ (rot - torch.eye(sub, dtype=torch.float64)) @ basis.T
    x = [torch.randn(D, generator=gen, dtype=torch.float64)]
    for _ in range(n_steps - 1):
        x.append(A @ x[-1])
    return torch.stack(x)  # [n_steps, D]


def _second_order_sequence(n_steps: int, D: int, gen: torch.Generator) -> torch.Tensor:
    """x_t = 1.6 x_{t-1} - 0.9 x_{t-2} (a damped oscillation along random directions)."""
    x = [torch.randn(D, generator=gen, dtype=torch.float64) for _ in range(2)]
    for _ in range(n_steps - 2):
        x.append(1.6 * x[-1] - 0.9 * x[-2])
    return torch.stack(x)


@pytest.mark.parametrize("eps,factor", [(1e-3, 0.05), (1e-2, 0.2)])  # shrinkage grows with eps
@pytest.mark.parametrize("kind", ["rotation", "second_order"])
@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_ridge_beats_last_on_linear_recurrence(kind, impl, eps, factor, device):
    """The stated purpose of the predictor: when queries follow a linear recurrence,
    ridge extrapolates it, the stale query does not."""
    gen = torch.Generator().manual_seed(1)
    n, D, N = 16, 32, 3
    seqs = []
    for _ in range(N):
        seq = _rotation_sequence(n + 1, D, 4, gen) if kind == "rotation" else _second_order_sequence(n + 1, D, gen)
        seqs.append(seq)
    seqs = torch.stack(seqs)  # [N, n + 1, D]
    window, target = seqs[:, :n].float().to(device), seqs[:, n]
    fn = Rg.ridge_predict_ref if impl == "ref" else Rg.ridge_predict_triton
    err_last = _rel(fn(window, n, mode="last", eps=eps), target)
    err_ridge = _rel(fn(window, n, mode="ridge", eps=eps), target)
    assert err_last > 0.1  # the sequence really moves
    assert err_ridge < factor * err_last, (err_ridge, err_last)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_small_windows(impl, device):
    fn = Rg.ridge_predict_ref if impl == "ref" else Rg.ridge_predict_triton
    window = torch.randn(3, 6, 16, device=device)
    last = window[:, -1].float()
    for mode in Rg.MODES:  # n = 1: nothing to regress on
        assert torch.equal(fn(window, 1, mode=mode), last)
    # n = 2: one window of size 1, softmax of a single weight = 1 -> the last query
    for mode in ("softmax_ridge", "assembled"):
        assert torch.allclose(fn(window, 2, mode=mode), last, atol=1e-6)
    # ... while raw ridge scales it by a = <x1, x2> / (|x1|^2 + lam)
    x1, x2 = window[:, -2].double(), window[:, -1].double()
    lam = 1e-2 * (x1.pow(2).sum(-1) + x2.pow(2).sum(-1)) / 2
    a = (x1 * x2).sum(-1) / (x1.pow(2).sum(-1) + lam)
    assert _rel(fn(window, 2, mode="ridge"), a[:, None] * x2) < 1e-5


def test_zero_window_and_dispatch(device, monkeypatch):
    """An all-zero window stays finite (the lambda floor); the public entry point routes."""
    from spade import kernels

    zeros = torch.zeros(2, 5, 16, device=device)
    for fn in (Rg.ridge_predict_ref, Rg.ridge_predict_triton, Rg.ridge_predict_torch):
        for mode in MODES:
            assert torch.equal(fn(zeros, 5, mode=mode), torch.zeros(2, 16, device=device))
    window = torch.randn(2, 7, 16, device=device)
    monkeypatch.setenv("SPADE_KERNELS", "triton")
    a = kernels.ridge_predict(window, 6)
    monkeypatch.setenv("SPADE_KERNELS", "torch")
    b = kernels.ridge_predict(window, 6)
    assert _rel(a, b) < 1e-4


def test_bad_arguments():
    w = torch.randn(2, 4, 16)
    with pytest.raises(ValueError, match="n_valid"):
        Rg.ridge_predict_ref(w, 5)
    with pytest.raises(ValueError, match="n_valid"):
        Rg.ridge_predict_triton(w, 0)
    with pytest.raises(ValueError, match="mode"):
        Rg.ridge_predict_ref(w, 3, mode="average")
    with pytest.raises(ValueError, match="eps"):
        Rg.ridge_predict_triton(w, 3, eps=0.0)
    with pytest.raises(ValueError, match=r"\[N, R, D\]"):
        Rg.ridge_predict_ref(w[0], 3)


@pytest.mark.parametrize("mode", ["last", "ridge", "softmax_ridge", "assembled"])
@pytest.mark.parametrize("n,R", [(1, 4), (2, 5), (9, 9), (17, 20)])
def test_batched_torch_path_matches_reference(mode, n, R):
    window = torch.randn(5, R, 24) * torch.rand(5, R, 1) * 3
    window[:, : R - n] = float("nan")  # garbage before the valid rows: never read
    out = Rg.ridge_predict_torch(window, n, mode=mode, eps=1e-2)
    ref = Rg.ridge_predict_ref(window, n, mode=mode, eps=1e-2)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-5, _rel(out, ref)


@pytest.mark.parametrize("P,B,H", [(1, 1, 2), (3, 4, 2), (2, 3, 5)])
def test_skip_rows_keep_their_newest_query(P, B, H, device):
    """``skip`` [B] over a [P, B, H]-flattened window (``per = H``): skipped rows return
    their newest query, the others the solve, in Triton as in the reference; a skipped
    row's garbage (NaN) never reaches a row in use."""
    g = torch.Generator().manual_seed(P * 100 + B * 10 + H)
    R, D, n = 9, 32, 7
    window = torch.randn(P * B * H, R, D, generator=g).to(device)
    skip = torch.rand(B, generator=g) < 0.5
    skip[0] = True
    if B > 1:
        skip[-1] = False
    skip = skip.to(device)
    rows = (torch.arange(P * B * H, device=device) // H) % B
    window[skip[rows], : R - 1] = float("nan")  # a skipped row's history is never read
    out = Rg.ridge_predict_triton(window, n, mode="assembled", skip=skip, per=H)
    ref = Rg.ridge_predict_skip(window, n, mode="assembled", skip=skip, per=H)
    assert torch.equal(out[skip[rows]], window[skip[rows], -1].float())
    used = ~skip[rows]
    if used.any():
        assert torch.isfinite(out[used]).all()
        assert _rel(out[used], Rg.ridge_predict_ref(window[used], n, mode="assembled")) < 1e-4
        assert _rel(out[used], ref[used]) < 1e-4
    from spade import kernels

    torch_out = kernels.ridge_predict(window.cpu(), n, skip=skip.cpu(), per=H)  # the CPU dispatch
    assert torch.equal(torch_out[skip.cpu()[rows.cpu()]], window.cpu()[skip.cpu()[rows.cpu()], -1].float())


def test_skip_argument_checks():
    w = torch.randn(6, 4, 8)
    with pytest.raises(ValueError, match="whole groups"):
        Rg.ridge_predict_skip(w, 3, skip=torch.zeros(4, dtype=torch.bool), per=1)
    with pytest.raises(ValueError, match="bool"):
        Rg.ridge_predict_skip(w, 3, skip=torch.zeros(6, dtype=torch.int32), per=1)

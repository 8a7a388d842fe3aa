"""Gather of selected K/V rows into contiguous buffers (the ``kv`` return mode).

A gather is a copy: Triton and reference must agree bit for bit, and both must
equal an explicit per-slot loop."""

from __future__ import annotations

import pytest
import torch

from spade.kernels import gather as Gm


def _loop_gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Slot-by-slot copy: row idx[b, h, j] of x[b, h], zeros for -1."""
    B, H, K = idx.shape
    out = torch.zeros(B, H, K, x.shape[-1], dtype=x.dtype)
    xc = x.cpu()
    for b in range(B):
        for h in range(H):
            for j in range(K):
                i = int(idx[b, h, j])
                if i >= 0:
                    out[b, h, j] = xc[b, h, i]
    return out


def _indices(B, H, L, K, gen=None):
    """Disjoint random positions per (b, h), -1 holes, K may exceed L."""
    idx = torch.full((B, H, K), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            take = torch.randperm(L, generator=gen)[: K]
            slots = torch.randperm(K, generator=gen)[: len(take)]
            idx[b, h, slots] = take.int()
    idx[torch.rand(B, H, K, generator=gen) < 0.15] = -1
    return idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [16, 64])
@pytest.mark.parametrize("H", [1, 2, 4])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("L,K", [(37, 1), (130, 20), (7, 11)])  # K=1, K<L, K>=context
def test_gather_matches_loop(B, H, D, dtype, L, K, device):
    k = torch.randn(B, H, L, D, device=device).to(dtype)
    v = torch.randn(B, H, L, D, device=device).to(dtype)
    idx = _indices(B, H, L, K)
    ks, vs = Gm.gather_kv_triton(k, v, idx.to(device))
    kr, vr = Gm.gather_kv_ref(k, v, idx.to(device))
    assert ks.shape == (B, H, K, D) and ks.dtype == dtype and ks.is_contiguous()
    assert torch.equal(ks, kr) and torch.equal(vs, vr)
    assert torch.equal(kr.cpu(), _loop_gather(k, idx)) and torch.equal(vr.cpu(), _loop_gather(v, idx))


def test_gather_strided_and_garbage(device):
    """A transposed [B, L, H, D] cache, NaN garbage where -1 slots would point if they
    were clamped to 0, and out-of-range indices (treated as empty)."""
    B, H, L, D = 2, 3, 40, 24
    k = torch.randn(B, L, H, D, device=device).transpose(1, 2)
    v = torch.randn(B, L, H, D, device=device).transpose(1, 2)
    k[:, :, 0] = float("nan")
    v[:, :, 0] = float("nan")
    idx = _indices(B, H, L, 12)
    idx[idx == 0] = -1  # the NaN row is never named: only clamping could reach it
    idx[0, 0, 0] = L + 3  # outside the cache: zeros, never read
    for fn in (Gm.gather_kv_triton, Gm.gather_kv_ref):
        ks, vs = fn(k, v, idx.to(device))
        assert not torch.isnan(ks).any() and not torch.isnan(vs).any()
        exp_idx = idx.clone()
        exp_idx[0, 0, 0] = -1
        assert torch.equal(ks.cpu(), _loop_gather(k, exp_idx)) and torch.equal(vs.cpu(), _loop_gather(v, exp_idx))


def test_gather_empty_and_dispatch(device, monkeypatch):
    from spade import kernels

    k = torch.randn(1, 2, 9, 16, device=device)
    ks, vs = Gm.gather_kv_triton(k, k, torch.zeros(1, 2, 0, dtype=torch.int32, device=device))
    assert ks.shape == (1, 2, 0, 16)
    idx = _indices(1, 2, 9, 4).to(device)
    monkeypatch.setenv("SPADE_KERNELS", "triton")
    a = kernels.gather_kv(k, k, idx)
    monkeypatch.setenv("SPADE_KERNELS", "torch")
    b = kernels.gather_kv(k, k, idx)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="indices"):
        Gm.gather_kv_ref(k, k, idx[:, :1, None])

"""``rope_rotate``: the predictor's RoPE (un)rotation of a query by its row's position,
one Triton launch vs the torch reference and vs ``spade.policies.predictors.rotate``
(partial rotary, far positions, strided and 16-bit inputs, B=1)."""

from __future__ import annotations

import pytest
import torch

from spade import kernels
from spade.kernels import ridge
from spade.policies.base import RopeSpec
from spade.policies.predictors import rotate


@pytest.mark.parametrize("B,H,D,dim", [(1, 1, 16, 16), (3, 5, 64, 64), (2, 3, 48, 32), (4, 2, 128, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_rotate_matches_ref_and_rotate(B, H, D, dim, dtype, inverse, device):
    g = torch.Generator().manual_seed(B * 1000 + D + dim)
    theta = 1e6 if D >= 64 else 1e4
    xs = torch.randn(B, H + 2, D, generator=g).to(dtype)
    x = xs[:, 1:H + 1]  # a strided view
    lens = torch.randint(1, 600_000, (B,), generator=g)
    lens[0] = 1  # position 0 (with start 0): cos 1, sin 0
    start = torch.cat([torch.zeros(1, dtype=torch.long), torch.randint(0, 1000, (B - 1,), generator=g)])
    tab = ridge.rope_table(theta, dim, "cpu")
    ref = ridge.rope_rotate_ref(x, tab, lens, start, 1, inverse)
    # the reference is the policy's former torch path, bit for bit
    want = rotate(x.float(), lens - start - 1, RopeSpec(theta=theta, dim=dim), inverse=inverse)
    torch.testing.assert_close(ref, want, rtol=0, atol=0)
    torch.testing.assert_close(ref[0], x[0].float(), rtol=0, atol=0)
    got = ridge.rope_rotate_triton(x.to(device), tab.to(device), lens.to(device), start.to(device), 1, inverse)
    assert got.dtype == torch.float32 and got.shape == (B, H, D)
    # float32 cos/sin of the angle reduced modulo 2*pi in float64: a few ulps at 600k positions
    torch.testing.assert_close(got.cpu(), ref, rtol=0, atol=2e-6 * x.float().abs().max().item() + 1e-7)
    if dim < D:  # partial rotary: the rest passes through
        torch.testing.assert_close(got.cpu()[..., dim:], x.float()[..., dim:], rtol=0, atol=0)


def test_rope_rotate_round_trip_and_no_start(device):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 32, generator=g)
    lens = torch.tensor([5, 123_457])
    tab = ridge.rope_table(1e4, 32, device)
    fwd = kernels.rope_rotate(x.to(device), tab, lens.to(device), None, 0)
    back = kernels.rope_rotate(fwd, tab, lens.to(device), None, 0, inverse=True)
    torch.testing.assert_close(back.cpu(), x, rtol=0, atol=1e-5)
    ref = ridge.rope_rotate_ref(x, tab.cpu(), lens, None, 0)
    torch.testing.assert_close(fwd.cpu(), ref, rtol=0, atol=1e-5)
    norms = fwd.cpu().reshape(2, 4, 2, 16).pow(2).sum(2)  # rotation keeps each pair's norm
    torch.testing.assert_close(norms, x.reshape(2, 4, 2, 16).pow(2).sum(2), rtol=1e-5, atol=1e-5)


def test_rope_rotate_errors():
    tab = ridge.rope_table(1e4, 16, "cpu")
    x = torch.randn(2, 3, 16)
    with pytest.raises(ValueError, match="x must be"):
        ridge.rope_rotate_ref(x[0], tab, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="table must be"):
        ridge.rope_rotate_ref(x, tab.float(), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="table must be"):
        ridge.rope_rotate_ref(x[..., :8], tab, torch.tensor([1, 2]))  # 16 rotary dims > D = 8
    with pytest.raises(ValueError, match="lens must be"):
        ridge.rope_rotate_ref(x, tab, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="start must be"):
        ridge.rope_rotate_ref(x, tab, torch.tensor([1, 2]), torch.tensor([0]))
    with pytest.raises(ValueError, match="rotary dim"):
        ridge.rope_table(1e4, 15, "cpu")


def test_rope_rotate_stacked_batches(device):
    """[P * B, H, D] (a pack of layers): row n at the position of n % B, as P separate calls."""
    g = torch.Generator().manual_seed(5)
    P, B, H, D = 3, 2, 4, 32
    x = torch.randn(P * B, H, D, generator=g)
    lens, start = torch.tensor([40, 70_001]), torch.tensor([3, 0])
    tab = ridge.rope_table(1e4, D, "cpu")
    want = torch.cat([ridge.rope_rotate_ref(x[p * B:(p + 1) * B], tab, lens, start, 1) for p in range(P)])
    torch.testing.assert_close(ridge.rope_rotate_ref(x, tab, lens, start, 1), want, rtol=0, atol=0)
    got = ridge.rope_rotate_triton(x.to(device), tab.to(device), lens.to(device), start.to(device), 1)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of B"):
        ridge.rope_rotate_ref(x[:5], tab, lens)

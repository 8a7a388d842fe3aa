"""``window_push``: the query window's shift + newest row, one Triton launch vs the
torch reference (in place, strided and 16-bit queries, odd window lengths)."""

from __future__ import annotations

import pytest
import torch

from spade import kernels
from spade.kernels import ridge


@pytest.mark.parametrize("B,H,R,D", [(1, 1, 1, 16), (3, 4, 17, 64), (2, 3, 5, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_push_matches_ref(B, H, R, D, dtype, device):
    g = torch.Generator().manual_seed(B * 100 + R)
    w0 = torch.randn(B, H, R, D, generator=g)
    qs = torch.randn(3, B, H + 2, D, generator=g).to(dtype)  # q views with a head stride of H + 2 rows
    w_t, w_r = w0.clone().to(device), w0.clone()
    for i in range(3):  # three pushes: the oldest rows leave, order is kept
        q = qs[i][:, 1:H + 1]  # [B, H, D], not contiguous
        ridge.window_push_triton(w_t, q.to(device))
        ridge.window_push_ref(w_r, q)
    torch.testing.assert_close(w_t.cpu(), w_r, rtol=0, atol=0)
    n = min(3, R)
    want_new = torch.stack([qs[i][:, 1:H + 1].float() for i in range(3 - n, 3)], 2)  # [B, H, n, D]
    torch.testing.assert_close(w_r[:, :, R - n:], want_new)
    if R > 3:
        torch.testing.assert_close(w_r[:, :, :R - 3], w0[:, :, 3:])


def test_window_push_dispatch_and_errors(device):
    w = torch.zeros(2, 2, 4, 8, device=device)
    kernels.window_push(w, torch.ones(2, 2, 8, device=device))
    assert (w[:, :, -1] == 1).all() and (w[:, :, :-1] == 0).all()
    with pytest.raises(ValueError, match="q must be"):
        ridge.window_push_ref(w, torch.ones(2, 3, 8, device=device))
    with pytest.raises(ValueError, match="window must be"):
        ridge.window_push_ref(w.double(), torch.ones(2, 2, 8, device=device))

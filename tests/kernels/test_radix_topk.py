"""The radix top-K over precomputed scores (``spade.kernels.radix_topk``), with tiles small
enough that every row spans many tiles and chunks (the default interpreter config fits a
test row in one tile): pass-1 histogram, split and tie kernels across chunk boundaries.
Heavy ties (scores rounded to quarters) exercise the 16-bit tie lists and the exact
threshold; scores sharing their top 16 bits, passes 2-3. The fused path through
``score_topk`` is tested in test_scoring.py."""

from __future__ import annotations

import pytest
import torch

from spade.kernels import radix_topk
from tests.kernels.test_scoring import _check_topk, _sel_sum

CASES = [  # (B, H, N, K, ties)
    (3, 2, 200, 17, False),
    (3, 2, 200, 17, True),
    (1, 1, 97, 1, True),  # K=1, B=1
    (2, 3, 150, 200, False),  # K >= every row's range
    (2, 2, 300, 64, True),
]


@pytest.fixture
def small_tiles(monkeypatch):
    def use(tie_block: int) -> None:
        monkeypatch.setattr(radix_topk, "SELECT_CONFIG", dict(BLOCK=16, MIN_CHUNK=16, PER_SM=4, TIE_BLOCK=tie_block))
    return use


@pytest.mark.parametrize("tie_block", [16, 64])
@pytest.mark.parametrize("B,H,N,K,ties", CASES)
def test_topk_from_scores_many_tiles(small_tiles, tie_block, B, H, N, K, ties, device):
    g = torch.Generator().manual_seed(B * 1000 + N + K)
    s = torch.randn(B, H, N, generator=g)
    if ties:
        s = (s * 4).round() / 4
    s[0, 0, 5] = float("-inf")  # a masked score inside the range still ranks last
    lo = torch.tensor([3 + b for b in range(B)])
    hi = torch.tensor([N - 2 * b for b in range(B)])
    small_tiles(tie_block)
    out = radix_topk.topk_from_scores_triton(s.to(device), lo.to(device), hi.to(device), K).cpu()  # [B, H, K]
    ref = radix_topk.topk_from_scores_ref(s, lo, hi, K)
    assert out.shape == (B, H, K) and out.dtype == torch.int32
    for b in range(B):
        n_valid = min(K, int(hi[b] - lo[b]))
        for h in range(H):
            got, want = out[b, h], ref[b, h]
            assert (got[n_valid:] == -1).all() and (got[:n_valid] >= 0).all()
            sel = got[:n_valid].long()
            assert sel.unique().numel() == n_valid, "a position selected twice"
            assert ((sel >= lo[b]) & (sel < hi[b])).all()
            # ties reorder indices: compare the selected scores as multisets
            torch.testing.assert_close(s[b, h, sel].sort().values, s[b, h, want[want >= 0].long()].sort().values)


def test_topk_from_scores_close_values(device):
    """Scores that share their top 16 bits (many 16-bit ties) but differ below:
    passes 2-3 must order them exactly."""
    B, H, N = 2, 3, 200
    base = torch.full((B, H, N), 1.5)
    scores = base + torch.randint(0, 5000, (B, H, N)) * 2.0 ** -22  # same exponent, low mantissa bits differ
    scores[0, 0, :7] = 1.5 + 2.0 ** -10  # a few clearly above the pack
    scores = scores.to(device)
    lo = torch.tensor([3, 0], device=device)
    hi = torch.tensor([200, 150], device=device)
    for k_top in (1, 10, 64):
        out = radix_topk.topk_from_scores_triton(scores, lo, hi, k_top)
        ref = radix_topk.topk_from_scores_ref(scores, lo, hi, k_top)
        true = scores.double().cpu()
        _check_topk(out, true, lo.cpu(), hi.cpu(), k_top, atol=0.0)
        torch.testing.assert_close(_sel_sum(out, true), _sel_sum(ref, true), rtol=0, atol=0)

"""``sum_softmax`` under left padding: each head's softmax normaliser must span the
row's own valid range ``[kv_start, kv_len)``, so a padded row of a batch selects
exactly what the same row selects alone (neither the garbage before ``kv_start``
nor the batch's other rows may change its scores)."""

from __future__ import annotations

import os

import pytest
import torch

from spade import kernels
from spade.policies.common import topk_selection
from tests.policies.sim import middle_sets

LENS = [37, 52, 29]  # valid tokens per row (odd, different)
PADS = [0, 11, 24]  # left padding per row: none, some, more than a third of the cache


def _batch(Hq: int, Hkv: int, D: int, seed: int):
    """Rows of random keys, left-padded into one cache [3, Hkv, L, D] whose padding holds
    large garbage keys (they would dominate any normaliser that reads them)."""
    g = torch.Generator().manual_seed(seed)
    L = max(p + n for p, n in zip(PADS, LENS)) + 3  # spare slots past the longest row
    k = 4.0 * torch.randn(3, Hkv, L, D, generator=g)  # garbage everywhere ...
    alone = []
    for b, (p, n) in enumerate(zip(PADS, LENS)):
        kb = torch.randn(1, Hkv, n, D, generator=g)
        k[b, :, p:p + n] = kb[0]  # ... but the row's own tokens
        alone.append(kb)
    q = torch.randn(3, Hq, D, generator=g)
    return q, k, alone


@pytest.mark.parametrize("mode", ["torch", "triton"])
@pytest.mark.parametrize("keys", ["exact", "int8"])
@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (4, 1), (2, 2)])
def test_left_padded_row_selects_as_alone(mode, keys, Hq, Hkv, monkeypatch):
    if mode == "triton" and torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("drives the kernels on CPU tensors (interpreter)")
    monkeypatch.setenv("SPADE_KERNELS", mode)
    q, k, alone = _batch(Hq, Hkv, D=16, seed=5 + Hq + Hkv)
    kv_lens = torch.tensor([p + n for p, n in zip(PADS, LENS)], dtype=torch.int32)
    kv_start = torch.tensor(PADS, dtype=torch.int32)
    common = dict(budget=16, n_sink=2, n_recent=3, scale=16 ** -0.5, reduce="sum_softmax")
    k_scale = None
    if keys == "int8":  # per-token quantisation: a token's int8 copy does not depend on its row
        k, k_scale = kernels.quantize_keys(k)
        alone = [kernels.quantize_keys(kb) for kb in alone]
    sel = topk_selection(q, k, kv_lens, kv_start, k_scale=k_scale, **common)
    padded = middle_sets(sel)  # [B][Hkv] sets of cache positions
    for b, (p, n) in enumerate(zip(PADS, LENS)):
        kb, sb = alone[b] if keys == "int8" else (alone[b], None)
        one = topk_selection(q[b:b + 1], kb, torch.tensor([n], dtype=torch.int32), None, k_scale=sb, **common)
        want = [{i + p for i in s} for s in middle_sets(one)[0]]
        assert all(len(s) == common["budget"] - 5 for s in want)  # every row has more candidates than K
        assert padded[b] == want, f"row {b} (padding {p}) selected differently from the row alone"

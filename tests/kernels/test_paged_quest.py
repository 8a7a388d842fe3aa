"""Quest page metadata built from a paged cache (``quest_build(block_table=)``): keys in
one shared pool under a shuffled table, NaN outside every row's tokens. The bounds
must equal those built from the contiguous logical cache, exactly (min / max are exact)."""

from __future__ import annotations

import pytest
import torch

from spade import kernels
from spade.kernels import quest as Q
from spade.kernels.paged import paged_to_contiguous, scatter_to_pool

CASES = [  # (lens, kv_start, Hkv, D, block_size, page_size, dtype)
    ([37], [0], 1, 16, 16, 16, torch.float32),  # B=1, pages = blocks
    ([130, 7, 61], [0, 2, 17], 2, 16, 8, 16, torch.bfloat16),  # a page spans two blocks, left padding
    ([50, 33], [3, 0], 4, 24, 16, 5, torch.float32),  # pages smaller than blocks, odd page size
    ([99, 1], [0, 0], 2, 16, 7, 4, torch.float16),  # pages straddle odd blocks, a length-1 row
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_paged_quest_build_equals_contiguous(case, device):
    lens, start, Hkv, D, bs, page, dtype = CASES[case]
    gen = torch.Generator().manual_seed(700 + case)
    B, L = len(lens), max(lens)
    k = torch.randn(B, Hkv, L, D, generator=gen).to(dtype)
    kv_lens, kv_start = torch.tensor(lens).to(device), torch.tensor(start).to(device)
    pool, table = scatter_to_pool(k, bs, torch.Generator().manual_seed(case), lens=torch.tensor(lens))
    pool, table = pool.to(device), table.to(device)
    k_log = paged_to_contiguous(pool, table)
    for impl in (Q.quest_build_triton, Q.quest_build_ref):
        kmin, kmax = impl(pool, kv_lens, page, kv_start=kv_start, block_table=table)
        wmin, wmax = Q.quest_build_ref(k_log, kv_lens, page, kv_start=kv_start)
        assert torch.equal(kmin, wmin) and torch.equal(kmax, wmax), impl.__name__
        assert not torch.isnan(kmin).any() and not torch.isnan(kmax).any()
    # and the bounds are those of the original tokens
    P0 = -(-L // page)
    wmin, wmax = Q.quest_build_ref(k.to(device), kv_lens, page, kv_start=kv_start)
    assert torch.equal(kmin[:, :, :P0], wmin) and torch.equal(kmax[:, :, :P0], wmax)


def test_dispatch_and_bad_table(device, monkeypatch):
    pool = torch.randn(4, 1, 8, 16, device=device)
    table = torch.tensor([[2, 1]], dtype=torch.int32, device=device)
    kl = torch.tensor([13], device=device)
    outs = []
    for impl in ("torch", "triton"):
        monkeypatch.setenv("SPADE_KERNELS", impl)
        outs.append(kernels.quest_build(pool, kl, 4, block_table=table))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    with pytest.raises(ValueError, match="int32"):
        kernels.quest_build(pool, kl, 4, block_table=table.long())

"""``gather_kv`` over a paged cache: shuffled, non-monotone tables over a shared pool
whose unowned blocks (and slots past each row's length) are NaN. A pure copy, so the
paged kernel must equal the contiguous gather of the logical cache exactly."""

from __future__ import annotations

import pytest
import torch

from spade import kernels
from spade.kernels import gather as Gm
from spade.kernels.paged import paged_to_contiguous, scatter_to_pool

CASES = [  # (B, Hkv, D, lens, block_size, K)
    (1, 1, 16, [37], 16, 5),  # B=1, MQA-like single KV head
    (3, 2, 16, [130, 7, 61], 8, 33),
    (2, 4, 24, [50, 1], 4, 1),  # K=1, a length-1 row, D not a power of two
    (2, 2, 16, [20, 9], 7, 64),  # K >= context (mostly -1), odd block size
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_paged_gather_equals_contiguous(case, device):
    B, Hkv, D, lens, bs, K = CASES[case]
    gen = torch.Generator().manual_seed(300 + case)
    L = max(lens)
    kv = torch.randn(B, Hkv, L, 2 * D, generator=gen)
    pool, table = scatter_to_pool(kv, bs, torch.Generator().manual_seed(case), lens=torch.tensor(lens))
    k_pool, v_pool = pool[..., :D].contiguous().to(device), pool[..., D:].contiguous().to(device)
    table = table.to(device)
    Lcap = table.shape[1] * bs
    idx = torch.full((B, Hkv, K), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(Hkv):
            take = torch.randperm(lens[b], generator=gen)[:K]
            slots = torch.randperm(K, generator=gen)[: len(take)]
            idx[b, h, slots] = take.int()
    # indices no policy produces (past the table, below -1) must read nothing
    bad = torch.rand(B, Hkv, K, generator=gen) < 0.15
    idx = torch.where(bad, torch.tensor([Lcap, Lcap + 9, -5], dtype=torch.int32)[torch.randint(0, 3, (B, Hkv, K),
                                                                                               generator=gen)], idx)
    idx = idx.to(device)
    ks, vs = Gm.gather_kv_triton(k_pool, v_pool, idx, block_table=table)
    kc, vc = Gm.gather_kv_triton(paged_to_contiguous(k_pool, table), paged_to_contiguous(v_pool, table), idx)
    assert torch.equal(ks, kc) and torch.equal(vs, vc)
    assert torch.isfinite(ks).all() and torch.isfinite(vs).all()
    kr, vr = Gm.gather_kv_ref(k_pool, v_pool, idx, block_table=table)
    assert torch.equal(ks, kr) and torch.equal(vs, vr)
    # and the values are the logical cache's rows
    b, h, j = torch.nonzero(idx.cpu() >= 0, as_tuple=False)[0].tolist()
    assert torch.equal(ks[b, h, j].cpu(), kv[b, h, int(idx[b, h, j]), :D])


def test_public_dispatch(device, monkeypatch):
    k = torch.randn(2, 1, 3, 8, device=device)  # a pool of 2 blocks of 3 tokens
    table = torch.tensor([[1], [0]], dtype=torch.int32, device=device)
    idx = torch.tensor([[[2, -1]], [[0, 1]]], dtype=torch.int32, device=device)
    for impl in ("torch", "triton"):
        monkeypatch.setenv("SPADE_KERNELS", impl)
        ks, _ = kernels.gather_kv(k, -k, idx, block_table=table)
        assert torch.equal(ks[0, 0, 0], k[1, 0, 2]) and torch.equal(ks[1, 0], k[0, 0, :2])
        assert not ks[0, 0, 1].any()
    with pytest.raises(ValueError, match="int32"):
        kernels.gather_kv(k, k, idx, block_table=table.long())

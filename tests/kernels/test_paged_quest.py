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


# ----------------------------------------------------------------------------- pool bounds
# The bounds themselves in the pool's blocks (``quest_write_pool`` / ``quest_update`` /
# ``quest_select`` with ``block_table=``): page p of a row in the block of its first position.

POOL_CASES = [  # (lens, kv_start, Hq, Hkv, D, block_size, page_size, n_sel, dtype)
    ([37], [0], 2, 2, 16, 16, 16, 2, torch.float32),  # B=1, MHA, pages = blocks
    ([130, 7, 61], [0, 2, 17], 4, 2, 16, 8, 16, 3, torch.float32),  # GQA, a page spans two blocks
    ([50, 33], [3, 0], 6, 1, 24, 16, 5, 4, torch.float32),  # MQA (G=6), pages smaller than blocks, S odd
    ([99, 1], [0, 0], 2, 1, 16, 7, 4, 30, torch.float32),  # blocks of 7, K >= every row's pages, a 1-token row
    ([45, 70], [9, 1], 4, 4, 16, 4, 4, 1, torch.bfloat16),  # K = the last page alone; bf16
]


def _pool_case(case, device, extra=0):
    lens, start, Hq, Hkv, D, bs, page, n_sel, dtype = POOL_CASES[case]
    gen = torch.Generator().manual_seed(900 + case)
    B, L = len(lens), max(lens) + extra
    k = torch.randn(B, Hkv, L, D, generator=gen).to(dtype)
    q = torch.randn(B, Hq, D, generator=gen).to(dtype).to(device)
    kv_lens = torch.tensor(lens).to(device)
    kv_start = torch.tensor(start, dtype=torch.int32).to(device)
    pool, table = scatter_to_pool(k, bs, torch.Generator().manual_seed(case), lens=torch.tensor(lens) + extra)
    pool, table = pool.to(device), table.to(device)
    spb = -(-bs // page)
    # every slot no page was written to holds NaN: a kernel reading one shows it
    bmin = torch.full((pool.shape[0], Hkv, spb, D), float("nan"), dtype=dtype, device=device)
    bmax = bmin.clone()
    wmin, wmax = Q.quest_build_ref(k.to(device), kv_lens, page, kv_start=kv_start)
    kernels.quest_write_pool(bmin, bmax, wmin, wmax, table, kv_lens, page, bs, kv_start=kv_start)
    return dict(k=k.to(device), q=q, kv_lens=kv_lens, kv_start=kv_start, pool=pool, table=table, bs=bs,
                page=page, n_sel=n_sel, bmin=bmin, bmax=bmax, wmin=wmin, wmax=wmax)


def _valid_pages(c):
    n_pages = (c["kv_lens"].long() - c["kv_start"].long() + c["page"] - 1) // c["page"]
    return [int(n) for n in n_pages.cpu()]


@pytest.mark.parametrize("case", range(len(POOL_CASES)))
def test_pool_bounds_select_equals_logical(case, device):
    """Pool bounds written from the rows' logical bounds read back equal on every page a row
    has; selections through the table (Triton and reference) equal the logical reference's."""
    c = _pool_case(case, device)
    lmin, lmax = Q.quest_pool_to_logical(c["bmin"], c["bmax"], c["table"], c["page"], c["bs"], kv_start=c["kv_start"])
    for b, n in enumerate(_valid_pages(c)):
        assert torch.equal(lmin[b, :, :n], c["wmin"][b, :, :n]) and torch.equal(lmax[b, :, :n], c["wmax"][b, :, :n])
    args = (c["kv_lens"], c["n_sel"], c["page"])
    paged = dict(kv_start=c["kv_start"], block_table=c["table"], block_size=c["bs"])
    for impl in (Q.quest_select_ref, Q.quest_select_triton):  # each equals itself on the logical bounds
        want = impl(c["q"], c["wmin"], c["wmax"], *args, kv_start=c["kv_start"])
        got = impl(c["q"], c["bmin"], c["bmax"], *args, **paged)
        assert torch.equal(got, want), impl.__name__
    if c["k"].dtype == torch.float32:  # and the two keep the same tokens (the kernel emits pages in position order)
        ref = Q.quest_select_ref(c["q"], c["bmin"], c["bmax"], *args, **paged)
        assert torch.equal(ref.sort(-1).values, got.sort(-1).values)


@pytest.mark.parametrize("case", [1, 2, 3])
def test_pool_bounds_update_equals_logical(case, device):
    """Decode steps: each new key folded into its page through the table (a page's first
    token resets a slot that held NaN) equals the logical bounds' update, for both
    implementations, and the selections after each step agree."""
    steps = 9
    c = _pool_case(case, device, extra=steps)
    gen = torch.Generator().manual_seed(50 + case)
    wmin, wmax = c["wmin"], c["wmax"]
    P = Q.quest_pool_to_logical(c["bmin"], c["bmax"], c["table"], c["page"], c["bs"])[0].shape[2]
    wmin = torch.cat([wmin, wmin.new_full((*wmin.shape[:2], P - wmin.shape[2], wmin.shape[3]), float("inf"))], 2)
    wmax = torch.cat([wmax, wmax.new_full(wmin.shape[:2] + (P - wmax.shape[2], wmax.shape[3]), float("-inf"))], 2)
    pools = {impl: (c["bmin"].clone(), c["bmax"].clone()) for impl in (Q.quest_update_ref, Q.quest_update_triton)}
    kv_lens, paged = c["kv_lens"].clone(), dict(block_table=c["table"], block_size=c["bs"])
    for step in range(steps):
        k_new = torch.randn(*c["k"].shape[:2], c["k"].shape[3], generator=gen).to(c["k"].dtype).to(device)
        pos = kv_lens.clone()
        kv_lens = kv_lens + 1
        Q.quest_update_ref(wmin, wmax, k_new, pos, c["page"], kv_start=c["kv_start"])
        for impl, (bmin, bmax) in pools.items():
            impl(bmin, bmax, k_new, pos, c["page"], kv_start=c["kv_start"], **paged)
            lmin, lmax = Q.quest_pool_to_logical(bmin, bmax, c["table"], c["page"], c["bs"], kv_start=c["kv_start"])
            ns = (kv_lens.long() - c["kv_start"].long() + c["page"] - 1) // c["page"]
            for b, n in enumerate(ns.tolist()):
                assert torch.equal(lmin[b, :, :n], wmin[b, :, :n]), (impl.__name__, step, b)
                assert torch.equal(lmax[b, :, :n], wmax[b, :, :n]), (impl.__name__, step, b)
        want = Q.quest_select_triton(c["q"], wmin, wmax, kv_lens, c["n_sel"], c["page"], kv_start=c["kv_start"])
        bmin, bmax = pools[Q.quest_update_triton]
        got = Q.quest_select_triton(c["q"], bmin, bmax, kv_lens, c["n_sel"], c["page"], kv_start=c["kv_start"],
                                    **paged)
        assert torch.equal(got, want), step


def test_pool_bounds_follow_the_table(device):
    """The kernel reads the table it is given: with two of a row's blocks swapped in the
    table after the bounds were written, Triton and the reference agree with each other
    and no longer with the original selection."""
    c = _pool_case(1, device)  # row 0: 130 tokens, blocks of 8, pages of 16
    args = (c["kv_lens"], 4, c["page"])
    orig = Q.quest_select_ref(c["q"], c["bmin"], c["bmax"], *args, kv_start=c["kv_start"], block_table=c["table"],
                              block_size=c["bs"])
    sw = c["table"].clone()
    sw[0, [0, 10]] = sw[0, [10, 0]]
    paged = dict(kv_start=c["kv_start"], block_table=sw, block_size=c["bs"])
    a = Q.quest_select_ref(c["q"], c["bmin"], c["bmax"], *args, **paged)
    b = Q.quest_select_triton(c["q"], c["bmin"], c["bmax"], *args, **paged)
    assert torch.equal(a.sort(-1).values, b.sort(-1).values) and not torch.equal(a, orig)


def test_pool_bounds_checks(device):
    c = _pool_case(0, device)
    args = (c["kv_lens"], 2, c["page"])
    with pytest.raises(ValueError, match="block_size"):
        kernels.quest_select(c["q"], c["bmin"], c["bmax"], *args, block_table=c["table"])
    with pytest.raises(ValueError, match="pages per block"):
        kernels.quest_select(c["q"], c["bmin"], c["bmax"], *args, block_table=c["table"], block_size=32)
    with pytest.raises(ValueError, match="int32"):
        kernels.quest_select(c["q"], c["bmin"], c["bmax"], *args, block_table=c["table"].long(), block_size=c["bs"])

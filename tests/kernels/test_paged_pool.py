"""The paged cache's host side (``spade.kvcache``) and its write helper (``paged_write``):
block bookkeeping under a randomized soak, typed out-of-blocks errors, the device
table updated in place, prefill and chunked writes read back through the table."""

from __future__ import annotations

import random

import pytest
import torch

from spade.errors import SpadeError
from spade.kernels.paged import paged_to_contiguous, paged_write
from spade.kvcache import NULL_BLOCK, BlockPool, BlockTable, OutOfBlocks, PagedKVCache, RowBlocks, blocks_for


def test_randomized_alloc_free_soak_never_hands_a_block_out_twice():
    rng = random.Random(1234)
    pool = BlockPool(num_blocks=97, block_size=16)
    held: dict[int, list[int]] = {}
    owner: dict[int, int] = {}
    n_out_of_blocks = 0
    for step in range(3000):
        if held and (rng.random() < 0.45 or pool.num_free == 0):
            rid = rng.choice(list(held))
            blocks = held.pop(rid)
            if blocks and rng.random() < 0.3:  # partial frees too
                part = blocks[: rng.randint(1, len(blocks))]
                held[rid] = blocks[len(part):]
                blocks = part
            for b in blocks:
                del owner[b]
            pool.free(blocks)
        else:
            n = rng.randint(0, 12)
            try:
                got = pool.allocate(n)
            except OutOfBlocks as e:
                n_out_of_blocks += 1
                assert e.requested == n and e.free == pool.num_free < n
                continue
            assert len(got) == len(set(got)) == n and NULL_BLOCK not in got
            for b in got:
                assert b not in owner, f"block {b} handed out twice"
                owner[b] = step
            held.setdefault(step, []).extend(got)
        assert pool.num_used == len(owner)
        if step % 250 == 0:
            pool.check()
    assert n_out_of_blocks > 0  # the soak reached exhaustion
    for blocks in held.values():
        pool.free(blocks)
    pool.check()
    assert pool.num_free == pool.capacity == 96 and pool.num_used == 0  # no leak


def test_out_of_blocks_is_typed_and_takes_nothing():
    pool = BlockPool(5, 4)
    a = pool.allocate(3)
    with pytest.raises(OutOfBlocks, match="2 requested, 1 free of 5") as ei:
        pool.allocate(2)
    assert isinstance(ei.value, SpadeError) and pool.num_free == 1
    pool.free(a)
    assert pool.num_free == 4


def test_bad_frees_and_arguments_raise_and_change_nothing():
    pool = BlockPool(6, 8)
    a = pool.allocate(2)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([a[0], a[0]])
    with pytest.raises(ValueError, match="null block"):
        pool.free([NULL_BLOCK])
    with pytest.raises(ValueError, match="not a block of this pool"):
        pool.free([6])
    assert pool.num_used == 2  # nothing freed by the failed calls
    pool.free(a)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([a[0]])
    for bad in (dict(num_blocks=1, block_size=4), dict(num_blocks=4, block_size=0),
                dict(num_blocks=4.0, block_size=4)):
        with pytest.raises(ValueError, match="num_blocks|block_size"):
            BlockPool(**bad)
    with pytest.raises(ValueError, match="n must be an integer >= 0"):
        pool.allocate(-1)


def test_row_blocks_map_grow_free():
    """Rows get blocks for the positions they own only (the rest read the null block), a
    decode step's position grows every row holding blocks (all or none), and a free takes
    every block back at once; the device table follows at ``sync``."""
    rb = RowBlocks(num_blocks=8, block_size=4, max_rows=3, max_blocks=6)
    rb.map(0, 5, 10)  # positions 5..9: blocks 1 and 2 of row 0
    rb.map(2, 0, 3)
    assert sorted(rb.rows[0]) == [1, 2] and rb.held(2) == 1 and rb.held(1) == 0
    t = rb.sync()
    assert t[0, 0] == NULL_BLOCK and t[0, 1] != NULL_BLOCK and t[0, 3] == NULL_BLOCK and (t[1] == NULL_BLOCK).all()
    owned = {*rb.rows[0].values(), *rb.rows[2].values()}
    assert len(owned) == 3 and NULL_BLOCK not in owned and rb.pool.num_free == 4
    rb.grow(10)  # mid-block for neither: row 0 enters block 2 (held), row 2 enters block 2 (new); row 1 holds none
    assert sorted(rb.rows[2]) == [0, 2] and sorted(rb.rows[0]) == [1, 2] and rb.held(1) == 0
    rb.grow(11)  # inside held blocks: nothing
    assert rb.pool.num_free == 3
    rb.map(1, 0, 12)  # 3 blocks: the last free ones
    with pytest.raises(OutOfBlocks):
        rb.grow(12)  # rows 0, 1 and 2 all need block 3: none free, none taken
    assert rb.pool.num_free == 0 and all(3 not in own for own in rb.rows)
    with pytest.raises(ValueError, match="past the table"):
        rb.map(0, 20, 25)
    rb.free(1)
    assert rb.held(1) == 0 and rb.pool.num_free == 3 and (rb.sync()[1] == NULL_BLOCK).all()
    rb.free_all()
    assert rb.pool.num_free == 7 and (rb.sync() == NULL_BLOCK).all()


def test_block_table_updates_one_buffer_in_place():
    t = BlockTable(max_rows=3, max_blocks=4)
    ptr = t.tensor.data_ptr()
    t.set_row(1, [5, 2, 9])
    t.sync()
    assert t.tensor.data_ptr() == ptr and t.tensor.dtype == torch.int32
    assert t.tensor.tolist() == [[0, 0, 0, 0], [5, 2, 9, 0], [0, 0, 0, 0]]
    t.set_row(1, [7])
    t.clear_row(0)
    assert t.sync().tolist()[1] == [7, 0, 0, 0] and t.view(2).data_ptr() == ptr
    with pytest.raises(ValueError, match="max_blocks=4"):
        t.set_row(0, [1, 2, 3, 4, 5])


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_paged_write_matches_a_loop(bs):
    """``paged_write`` puts token t of row b at block table[b, p // bs], offset p % bs
    (p = start[b] + t), leaves every other slot alone and skips padding past n[b]."""
    gen = torch.Generator().manual_seed(bs)
    B, Hkv, T, D, nb = 3, 2, 9, 8, 6
    num_blocks = B * nb + 1
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    table = perm[: B * nb].view(B, nb).int()
    pool = torch.randn(num_blocks, Hkv, bs, D, generator=gen)
    x = torch.randn(B, Hkv, T, D, generator=gen)
    start = torch.tensor([0, 3, min(11, nb * bs - T)]).clamp(min=0)
    n = torch.tensor([T, 4, 0])
    T_eff = min(T, nb * bs - int(start.max()))
    x, expect = x[:, :, :T_eff], pool.clone()
    n = n.clamp(max=T_eff)
    for b in range(B):
        for t in range(int(n[b])):
            p = int(start[b]) + t
            expect[table[b, p // bs], :, p % bs] = x[b, :, t]
    paged_write(pool, table, x, start, n)
    assert torch.equal(pool, expect)


def test_paged_cache_prefill_chunks_view_and_release():
    gen = torch.Generator().manual_seed(3)
    c = PagedKVCache(n_layers=2, num_blocks=11, n_kv_heads=2, head_dim=8, block_size=4, max_rows=3, max_seq_len=20)
    ptr = c.table.tensor.data_ptr()
    k0, v0 = torch.randn(2, 2, 13, 8, generator=gen), torch.randn(2, 2, 13, 8, generator=gen)
    k1, v1 = torch.randn(2, 2, 6, 8, generator=gen), torch.randn(2, 2, 6, 8, generator=gen)
    c.write_prefill(2, k0[:, :, :5], v0[:, :, :5])
    c.write_prefill(0, k1, v1)
    c.write_prefill(2, k0[:, :, 5:], v0[:, :, 5:])  # a second chunk appends
    assert c.lengths[:3] == [6, 0, 13] and len(c.blocks[2]) == blocks_for(13, 4) == 4
    kr, vr = c.view_row(2)
    assert torch.equal(kr, k0) and torch.equal(vr, v0)
    kr, vr = c.view_row(0, layer=1)
    assert torch.equal(kr, k1[1]) and torch.equal(vr, v1[1])
    # the device table is what the kernels read: it sees the same tokens
    tab = c.table.tensor
    assert torch.equal(paged_to_contiguous(c.k_pools[0], tab[2:3])[0, :, :13], k0[0])
    assert set(c.blocks[0]).isdisjoint(c.blocks[2])
    with pytest.raises(OutOfBlocks):
        c.write_prefill(1, torch.zeros(2, 2, 20, 8), torch.zeros(2, 2, 20, 8))  # 5 blocks, 4 free
    assert c.blocks[1] == [] and c.pool.num_free == 4  # all or nothing
    with pytest.raises(ValueError, match="max_seq_len=20"):
        c.reserve(1, 21)
    c.release(2)
    c.release(0)
    assert c.pool.num_free == c.pool.capacity and c.table.tensor.data_ptr() == ptr
    assert c.sync_table().eq(NULL_BLOCK).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging and events: GPU only")
def test_block_table_sync_on_gpu_snapshots_the_host_copy():
    """An edit right after ``sync()`` never reaches the transfer already queued."""
    t = BlockTable(max_rows=2, max_blocks=3, device="cuda")
    torch.cuda._sleep(50_000_000)  # keep the stream busy so the copies run late
    t.set_row(0, [4, 5])
    first = t.sync().clone()
    t.set_row(0, [7])
    t.set_row(1, [1, 2, 3])
    second = t.sync().clone()
    t.set_row(1, [])
    third = t.sync().clone()
    torch.cuda.synchronize()
    assert first.tolist() == [[4, 5, 0], [0, 0, 0]]
    assert second.tolist() == [[7, 0, 0], [1, 2, 3]]
    assert third.tolist() == [[7, 0, 0], [0, 0, 0]]

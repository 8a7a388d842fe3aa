"""The paged KV cache's layout, shared by the kernels: checks, the logical view, writes.

A layer's K (and V) cache is a pool ``[num_blocks, Hkv, block_size, D]`` shared by
every request, and a block table ``[B, max_blocks]`` int32 per batch: row ``b``'s
logical token position ``p`` lives in block ``table[b, p // block_size]`` at offset
``p % block_size``. Token indices stay logical everywhere (selections, ``kv_lens``,
``kv_start``); the kernels map them through the table at the K/V address. The
contiguous cache ``[B, Hkv, L, D]`` is the special case ``num_blocks = B``,
``block_size = L``, ``table[b] = [b]``: the kernels take ``block_table=None`` for it
and compile the same code as before paging existed.

* ``check_block_table``: the table's dtype, shape, device and strides;
* ``paged_to_contiguous``: the logical cache of a row set (a copy: references, tests);
* ``paged_write``: write T new tokens of each row at logical positions (prefill,
  chunked prefill; decode writes one token in ``qkv_rope_store_triton``);
* ``scatter_to_pool``: a contiguous cache moved into a pool under a random,
  non-monotone table with a poisoned (NaN) block where no row owns one (tests and
  ``benchmarks.bench_paged``).

Example::

    >>> import torch
    >>> k = torch.arange(8.).view(1, 1, 8, 1)
    >>> pool, table = scatter_to_pool(k, 4, torch.Generator().manual_seed(0))
    >>> torch.equal(paged_to_contiguous(pool, table)[..., :8, :], k)
    True
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["check_block_table", "paged_to_contiguous", "paged_gather", "paged_range", "paged_write", "scatter_to_pool",
           "paged_slots", "tile_of"]


@triton.jit
def paged_slots(pos, bt_row, BLOCK_SIZE: tl.constexpr):
    """Physical slots ``table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE`` of the
    logical positions ``pos`` (a tile of any shape, int32; ``-1`` = nothing, kept, and
    its table entry never loaded). ``bt_row``: this batch row's block table. A slot
    ``x`` is then read at ``(x // BLOCK_SIZE) * stride_block + (x % BLOCK_SIZE) * stride_token``.

    Where to map is measured per kernel (one H100, docs/paged.md): the scoring kernel maps
    a group of tiles before the loop that loads keys (one tile per iteration cost it
    1.19-1.25x); the attention kernel maps each tile inside its loop (dense) or one tile
    ahead of the tile that reads it (indexed), which beat mapping groups up front there."""
    ok = pos >= 0
    blk = tl.load(bt_row + tl.where(ok, pos, 0) // BLOCK_SIZE, mask=ok, other=0)
    return tl.where(ok, blk * BLOCK_SIZE + pos % BLOCK_SIZE, -1)


@triton.jit
def tile_of(tiles, i, N_TILES: tl.constexpr):
    """Row ``i`` of a [N_TILES, N] register tile, as [N] (a masked reduction: register
    tiles cannot be indexed by a runtime value)."""
    return tl.sum(tl.where(tl.arange(0, N_TILES)[:, None] == i, tiles, 0), 0)


def paged_launch(block_table: torch.Tensor | None, block_size: int) -> dict:
    """A paged kernel launch's table arguments (``BT``, its row stride, ``PAGED``,
    ``BLOCK_SIZE``); none for a contiguous cache, so its specialisation is the one it always was."""
    if block_table is None:
        return {}
    return dict(BT=block_table, stride_tb=block_table.stride(0), PAGED=True, BLOCK_SIZE=block_size)


def check_block_table(block_table: torch.Tensor, B: int, device: torch.device) -> None:
    """A block table must be int32 [B, max_blocks] on the cache's device, its last
    dimension contiguous (the kernels read it there)."""
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table must be an int32 tensor [B={B}, max_blocks]; got {block_table.dtype} "
                         f"{tuple(block_table.shape)} (spade.kvcache.BlockTable builds one)")
    if block_table.device != device:
        raise ValueError(f"block_table is on {block_table.device} but the cache is on {device}: "
                         f"keep the table on the cache's device")
    if block_table.shape[1] > 0 and block_table.stride(1) != 1:
        raise ValueError("block_table's last dimension must be contiguous (stride 1); pass .contiguous()")


def check_pool(pool: torch.Tensor, name: str = "pool") -> None:
    if pool.dim() != 4:
        raise ValueError(f"{name} must be [num_blocks, Hkv, block_size, D]; got {tuple(pool.shape)}")


def cut_logical(end: int, L: int, block_table: torch.Tensor | None, block_size: int,
                *xs: torch.Tensor | None) -> tuple:
    """A reference's view of a cache of ``L`` logical positions cut to its first ``end``
    (at least one), for when no position past them can reach its result: contiguous
    tensors ``xs`` [B, H, L, ...] sliced along dim 2 (None stays None), or, through a
    ``block_table``, the table cut to the blocks of ``block_size`` that hold them (``xs``,
    pools, untouched). Returns ``(L', block_table', *xs')``."""
    bs = 1 if block_table is None else int(block_size)
    n = -(-max(1, int(end)) // bs)  # positions (contiguous) or blocks (paged)
    if n * bs >= L:
        return (L, block_table, *xs)
    if block_table is not None:
        return (n * bs, block_table[:, :n], *xs)
    return (n, None, *(None if x is None else x[:, :, :n] for x in xs))


def paged_to_contiguous(pool: torch.Tensor, block_table: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """The logical cache [B, Hkv, max_blocks * block_size, D] of ``pool``
    [num_blocks, Hkv, block_size, D] seen through ``block_table`` [B, max_blocks]
    (a copy; unused table entries copy whatever their block holds). ``n``: only the first
    ``n`` positions, [B, Hkv, n, D], gathered from the blocks that hold them."""
    check_pool(pool)
    _, Hkv, bs, D = pool.shape
    if n is not None:
        block_table = block_table[:, :-(-int(n) // bs)]
    B, nb = block_table.shape
    x = pool[block_table.to(pool.device).long().reshape(-1)]  # [B * nb, Hkv, bs, D]
    x = x.view(B, nb, Hkv, bs, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, nb * bs, D)
    return x if n is None else x[:, :, :n]


def paged_gather(pool: torch.Tensor, block_table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Tokens at logical positions ``pos`` [B, n] (int, every entry in the table's range)
    of each row: [B, Hkv, n, D] (a copy). One device gather, no host synchronisation."""
    check_pool(pool)
    bs = pool.shape[2]
    pos = pos.to(device=pool.device, dtype=torch.int64)
    blk = torch.gather(block_table.to(pool.device), 1, pos // bs).long()  # [B, n] (the table is not converted whole)
    return pool[blk, :, pos % bs].permute(0, 2, 1, 3)  # [B, n, Hkv, D] -> [B, Hkv, n, D]


def paged_range(pool: torch.Tensor, table_row: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """One row's logical positions ``[lo, hi)`` (host ints) as a contiguous [1, Hkv, hi - lo, D]
    copy: the row's blocks gathered whole along the pool's block dimension (one
    ``index_select``), then sliced. ``table_row``: the row's table [max_blocks] (or [1, max_blocks])."""
    check_pool(pool)
    _, Hkv, bs, D = pool.shape
    if hi <= lo:
        return pool.new_empty(1, Hkv, 0, D)
    j0, j1 = lo // bs, -(-hi // bs)
    blocks = table_row.reshape(-1)[j0:j1].to(device=pool.device, dtype=torch.long)
    x = pool.index_select(0, blocks).transpose(0, 1).reshape(Hkv, (j1 - j0) * bs, D)
    return x[None, :, lo - j0 * bs:hi - j0 * bs]


def paged_write(pool: torch.Tensor, block_table: torch.Tensor, x: torch.Tensor, start: torch.Tensor | int,
                n: torch.Tensor | None = None) -> None:
    """Write ``x`` [B, Hkv, T, D] into ``pool`` at row b's logical positions
    ``start[b] .. start[b] + T`` (``n[b]``: only the first n[b] tokens of row b, the rest
    of ``x`` is padding and is not written). One scatter through the table; without ``n``
    and with a host-int or device ``start`` no host synchronisation (``n``'s boolean
    index waits for the GPU); the rows' blocks must be distinct (they are: a pool never hands a
    block out twice). Positions past the table (``>= max_blocks * block_size``) are an
    error of the caller, not checked on the device."""
    check_pool(pool)
    if x.dim() != 4 or x.shape[1] != pool.shape[1] or x.shape[3] != pool.shape[3]:
        raise ValueError(f"x must be [B, Hkv={pool.shape[1]}, T, D={pool.shape[3]}]; got {tuple(x.shape)}")
    B, Hkv, T, D = x.shape
    check_block_table(block_table, B, pool.device)
    bs = pool.shape[2]
    if n is None and isinstance(start, int) and T >= 2 * bs:
        # one start for every row (prefill): the whole blocks in one index_copy_ along the
        # pool's block dimension, the partial blocks at either end through the scatter
        head = min((-start) % bs, T)
        nfull = (T - head) // bs
        j0 = (start + head) // bs
        blocks = block_table[:, j0:j0 + nfull].reshape(-1).to(device=pool.device, dtype=torch.long)
        src = x[:, :, head:head + nfull * bs].reshape(B, Hkv, nfull, bs, D).transpose(1, 2)
        pool.index_copy_(0, blocks, src.reshape(B * nfull, Hkv, bs, D).to(pool.dtype))
        if head:
            paged_write(pool, block_table, x[:, :, :head], start)
        tail = T - head - nfull * bs
        if tail:
            paged_write(pool, block_table, x[:, :, T - tail:], start + T - tail)
        return
    dev = pool.device
    if isinstance(start, int):  # (a host int made a device tensor would wait for the GPU)
        pos = torch.arange(start, start + T, device=dev).expand(B, T)  # [B, T] logical positions
    else:
        pos = (start.to(dev).long().reshape(-1, 1) + torch.arange(T, device=dev)).expand(B, T)
    blk = torch.gather(block_table.long(), 1, (pos // bs).clamp(0, block_table.shape[1] - 1))  # [B, T]
    slot, src = blk * bs + pos % bs, x.permute(0, 2, 1, 3)  # [B, T] physical slots of the pool, [B, T, Hkv, D]
    if n is None:  # every token: no boolean index (its nonzero would wait for the GPU)
        slot, src = slot.reshape(-1), src.reshape(B * T, Hkv, D)
    else:
        keep = torch.arange(T, device=dev)[None, :] < torch.as_tensor(n, device=dev).long().reshape(-1, 1)
        slot, src = slot[keep], src[keep]  # [N], [N, Hkv, D]
    pool[slot // bs, :, slot % bs, :] = src.to(pool.dtype)  # one advanced-index scatter


def scatter_to_pool(cache: torch.Tensor, block_size: int, gen: torch.Generator, *, extra_blocks: int = 2,
                    lens: torch.Tensor | None = None, poison: float = float("nan")
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool, table): ``cache`` [B, Hkv, L, D] moved into a pool of shuffled blocks.

    Row b owns ``ceil(lens[b] / block_size)`` blocks (``lens`` defaults to L) drawn in a
    random order from one shared pool, so tables are non-monotone and rows interleave;
    ``extra_blocks`` more blocks are never owned. Every table entry a row does not own
    points at one poisoned block, and every unowned block is filled with ``poison``
    (NaN by default): a kernel that reads outside a row's tokens shows it."""
    B, Hkv, L, D = cache.shape
    dev = cache.device
    nb = max(1, -(-L // block_size))
    lens_t = torch.full((B,), L) if lens is None else torch.as_tensor(lens).cpu().long()
    own = -(-lens_t // block_size)  # [B] blocks each row owns
    num_blocks = int(own.sum()) + extra_blocks + 1
    perm = torch.randperm(num_blocks, generator=gen)
    poisoned = int(perm[0])
    owned = torch.arange(nb)[None, :] < own[:, None]  # [B, nb]
    table = torch.full((B, nb), poisoned, dtype=torch.int32)
    table[owned] = perm[1:1 + int(own.sum())].int()  # row-major: row b's blocks, in a random order
    pos = torch.arange(nb * block_size, device=dev)
    padded = torch.nn.functional.pad(cache, (0, 0, 0, nb * block_size - L))
    live = pos[None, :] < lens_t.to(dev)[:, None]  # [B, nb * bs]: slots past a row's length are poisoned
    padded = torch.where(live[:, None, :, None], padded, torch.full((), poison, dtype=cache.dtype, device=dev))
    blocks = padded.view(B, Hkv, nb, block_size, D).permute(0, 2, 1, 3, 4)  # [B, nb, Hkv, bs, D]
    pool = torch.full((num_blocks, Hkv, block_size, D), poison, dtype=cache.dtype, device=dev)
    pool[table[owned].long().to(dev)] = blocks[owned.to(dev)]
    return pool, table.to(dev)

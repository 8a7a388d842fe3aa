"""The paged KV cache's host side: a block pool, the device block table, a per-layer holder.

Layout (``spade.kernels.paged``): each layer's K and V live in pools
``[num_blocks, Hkv, block_size, D]`` shared by every request; a batch's block table
``[max_rows, max_blocks]`` int32 maps row b's logical position p to block
``table[b, p // block_size]``, offset ``p % block_size``.

* ``BlockPool(num_blocks, block_size)``: which blocks are free. ``allocate(n)``
  hands out n distinct blocks or raises ``OutOfBlocks`` (nothing taken: the
  scheduler catches it to queue or preempt), ``free(blocks)`` takes them back and
  rejects a block that is not out (a double free would hand a block out twice).
  Block 0 is the pool's *null block*, never handed out: table entries no request
  owns, and padded batch rows, point at it, so a stray read or a padded row's
  decode write touches memory no request uses.
* ``BlockTable(max_rows, max_blocks, device)``: the device table, one fixed buffer
  updated in place (``set_row``, ``clear_row``), so a CUDA graph captured with it
  keeps its pointer; ``sync()`` copies the host copy to the device in one transfer
  (call it between steps, before replay).
* ``RowBlocks(num_blocks, block_size, max_rows, max_blocks, device)``: a pool and a
  table with each row's logical block -> pool block map, blocks given on demand for
  the positions a row owns (``map``, ``grow`` at a decode step's write position) and
  taken back at once (``free``); every other position reads the null block. The fast
  backend's paged cache and the cache rank's pool of scoring copies hold one each.
* ``PagedKVCache``: per-layer pools, one pool of blocks and one table for all of
  them (the layers share block ids), with per-row block lists and lengths:
  ``reserve(row, n_tokens)``, ``release(row)``, ``write_prefill(row, k, v)``,
  ``view_row(row)`` (a contiguous copy, for references and tests).

Default block size: ``DEFAULT_BLOCK_SIZE = 16`` tokens (provisional, see
docs/paged.md): the attention kernel maps every token of a tile through the table,
so a block need not hold a whole tile (BLOCK_N = 64 at d=128 bf16) and tiles may
span blocks; each token's K row (256 bytes at d=128 bf16) is one contiguous load
whatever the block size, so the size trades table lookups (one per
``block_size`` tokens on the dense path) against memory lost to partly filled last
blocks (half a block per request on average), and 16 is also Quest's page size.

Example::

    >>> pool = BlockPool(num_blocks=8, block_size=16)
    >>> a = pool.allocate(3); pool.num_free
    4
    >>> pool.free(a); pool.num_free
    7
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spade.errors import SpadeError
from spade.kernels.paged import paged_to_contiguous, paged_write

__all__ = ["DEFAULT_BLOCK_SIZE", "NULL_BLOCK", "OutOfBlocks", "BlockPool", "BlockTable", "RowBlocks",
           "PagedKVCache", "blocks_for"]

DEFAULT_BLOCK_SIZE = 16
NULL_BLOCK = 0


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks that hold ``n_tokens`` tokens."""
    return -(-int(n_tokens) // int(block_size))


class OutOfBlocks(SpadeError):
    """The pool has fewer free blocks than a request needs. Nothing was allocated;
    the scheduler queues the request or preempts another one."""

    def __init__(self, requested: int, free: int, num_blocks: int):
        super().__init__(f"out of KV blocks: {requested} requested, {free} free of {num_blocks} "
                         f"(free finished requests, wait, or give the pool more blocks)")
        self.requested, self.free, self.num_blocks = requested, free, num_blocks


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
    return value


class BlockPool:
    """Free-block bookkeeping of one pool of ``num_blocks`` blocks of ``block_size``
    tokens (host only: the tensors live in ``PagedKVCache``). Block ``NULL_BLOCK``
    (0) is never handed out, so ``num_blocks - 1`` blocks are usable."""

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE):
        _positive_int("num_blocks", num_blocks)
        _positive_int("block_size", block_size)
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block {NULL_BLOCK} is the null block); got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # a stack: the most recently freed block is reused first (warm in L2)
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self._out = bytearray(num_blocks)  # 1 = handed out
        self._out[NULL_BLOCK] = 1  # never free, never handed out

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    @property
    def capacity(self) -> int:
        """Blocks a request can ever hold (all but the null block)."""
        return self.num_blocks - 1

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` distinct free blocks, or ``OutOfBlocks`` with nothing taken."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"allocate(n): n must be an integer >= 0; got {n!r}")
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free), self.num_blocks)
        out = [self._free.pop() for _ in range(n)]
        for blk in out:
            self._out[blk] = 1
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Give ``blocks`` back. Each must be out and named once: a block that is free
        already (or the null block, or one out of range) raises, and nothing is freed."""
        seen = set()
        for blk in blocks:
            if isinstance(blk, bool) or not isinstance(blk, int) or not 0 <= blk < self.num_blocks:
                raise ValueError(f"free(): block {blk!r} is not a block of this pool (0..{self.num_blocks - 1})")
            if blk == NULL_BLOCK:
                raise ValueError(f"free(): block {NULL_BLOCK} is the null block, never handed out")
            if not self._out[blk] or blk in seen:
                raise ValueError(f"free(): block {blk} is not allocated (freed twice?)")
            seen.add(blk)
        for blk in blocks:
            self._out[blk] = 0
            self._free.append(blk)

    def check(self) -> None:
        """Internal consistency (tests, soaks): the free list and the ownership map agree."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert NULL_BLOCK not in free
        assert all(self._out[b] == (b not in free) for b in range(1, self.num_blocks)), "free list != map"


class BlockTable:
    """The device block table ``[max_rows, max_blocks]`` int32, one buffer for the
    cache's lifetime (CUDA graphs keep its pointer). Rows are edited on a host copy
    and ``sync()`` copies it over in one non-blocking transfer; unused entries hold
    ``NULL_BLOCK``.

    On a GPU the transfer reads a pinned snapshot, never the host copy itself: a
    non-blocking copy runs later than ``sync()`` returns, and the scheduler edits rows
    right away. Two snapshots alternate; before one is rewritten, ``sync()`` waits for
    the event of the transfer that last read it (two syncs ago, long done in steady
    state), so the host never waits on the current step."""

    def __init__(self, max_rows: int, max_blocks: int, device: torch.device | str = "cpu"):
        _positive_int("max_rows", max_rows)
        _positive_int("max_blocks", max_blocks)
        self.device = torch.device(device)
        shape = (max_rows, max_blocks)
        self._host = torch.full(shape, NULL_BLOCK, dtype=torch.int32)
        self.tensor = torch.full(shape, NULL_BLOCK, dtype=torch.int32, device=self.device)
        cuda = self.device.type == "cuda"
        self._stage = [torch.empty(shape, dtype=torch.int32, pin_memory=True) for _ in range(2)] if cuda else []
        self._events: list = [None, None]
        self._turn = 0

    @property
    def max_rows(self) -> int:
        return self._host.shape[0]

    @property
    def max_blocks(self) -> int:
        return self._host.shape[1]

    def set_row(self, row: int, blocks: Sequence[int]) -> None:
        if not 0 <= row < self.max_rows:
            raise IndexError(f"row {row} out of range [0, {self.max_rows})")
        if len(blocks) > self.max_blocks:
            raise ValueError(f"row {row}: {len(blocks)} blocks exceed the table's max_blocks={self.max_blocks} "
                             f"(raise max_blocks, i.e. the cache's max_seq_len)")
        self._host[row, :len(blocks)] = torch.as_tensor(list(blocks), dtype=torch.int32)
        self._host[row, len(blocks):] = NULL_BLOCK

    def set_entries(self, row: int, entries: dict[int, int]) -> None:
        """Point entries ``j`` of row ``row`` at blocks ``entries[j]`` (the others unchanged)."""
        if not 0 <= row < self.max_rows:
            raise IndexError(f"row {row} out of range [0, {self.max_rows})")
        for j, blk in entries.items():
            self._host[row, j] = blk

    def clear_row(self, row: int) -> None:
        self.set_row(row, [])

    def host_row(self, row: int) -> list[int]:
        return self._host[row].tolist()

    def sync(self) -> torch.Tensor:
        """Copy the host table into the device buffer (in place, ordered on the current
        stream after the kernels already queued there); returns the buffer."""
        if not self._stage:
            self.tensor.copy_(self._host)
            return self.tensor
        i, self._turn = self._turn, self._turn ^ 1
        if self._events[i] is not None:
            self._events[i].synchronize()  # the transfer that last read this snapshot is done
        self._stage[i].copy_(self._host)
        self.tensor.copy_(self._stage[i], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._events[i] = ev
        return self.tensor

    def view(self, rows: int) -> torch.Tensor:
        """The first ``rows`` rows of the device buffer (a view: same storage)."""
        return self.tensor[:rows]


class RowBlocks:
    """Per-row block maps over one ``BlockPool`` and one ``BlockTable``: row ``b``'s logical
    block ``j`` (positions ``[j * block_size, (j + 1) * block_size)``) is pool block
    ``rows[b][j]`` when the row holds it, else the null block. Edits go to the host
    table; ``sync()`` copies it to the device when one changed (between steps)."""

    def __init__(self, num_blocks: int, block_size: int, max_rows: int, max_blocks: int,
                 device: torch.device | str = "cpu"):
        self.pool = BlockPool(num_blocks, block_size)
        self.table = BlockTable(max_rows, max_blocks, device)
        self.block_size = self.pool.block_size
        self.rows: list[dict[int, int]] = [{} for _ in range(max_rows)]
        self.dirty = False

    @property
    def capacity_tokens(self) -> int:
        """Logical positions a row can address (the table's width in tokens)."""
        return self.table.max_blocks * self.block_size

    def held(self, row: int) -> int:
        """Blocks row ``row`` holds."""
        return len(self.rows[row])

    def map(self, row: int, lo: int, hi: int) -> None:
        """Give row ``row`` blocks for its logical positions ``[lo, hi)`` (those it lacks; all
        or none: ``OutOfBlocks`` takes nothing)."""
        if hi <= lo:
            return
        if hi > self.capacity_tokens:
            raise ValueError(f"row {row}: position {hi - 1} is past the table's {self.capacity_tokens} tokens")
        bs, own = self.block_size, self.rows[row]
        need = [j for j in range(lo // bs, blocks_for(hi, bs)) if j not in own]
        if not need:
            return
        new = dict(zip(need, self.pool.allocate(len(need))))
        own.update(new)
        self.table.set_entries(row, new)
        self.dirty = True

    def grow(self, pos: int) -> None:
        """A decode step writes position ``pos`` in every row: each row holding blocks gets
        the block of ``pos`` when it enters a new one (all or none: ``OutOfBlocks``)."""
        j = pos // self.block_size
        if pos % self.block_size and all(not own or j in own for own in self.rows):
            return
        lack = [b for b, own in enumerate(self.rows) if own and j not in own]
        if len(lack) > self.pool.num_free:
            raise OutOfBlocks(len(lack), self.pool.num_free, self.pool.capacity)
        for b in lack:
            self.map(b, pos, pos + 1)

    def free(self, row: int) -> None:
        """Free every block of row ``row`` at once; its table row points at the null block."""
        if not self.rows[row]:
            return
        blocks, self.rows[row] = list(self.rows[row].values()), {}
        self.table.clear_row(row)
        self.pool.free(blocks)
        self.dirty = True

    def free_all(self) -> None:
        for row in range(len(self.rows)):
            self.free(row)

    def sync(self) -> torch.Tensor:
        """The device table, copied from the host one first if a row changed."""
        if self.dirty:
            self.table.sync()
            self.dirty = False
        return self.table.tensor


class PagedKVCache:
    """Per-layer K/V pools with one ``RowBlocks`` (pool and table) for all layers.

    Rows are batch slots ``0 .. max_rows - 1``; each holds the blocks of a prefix of
    positions and a length (tokens written). ``k_pools[l]``/``v_pools[l]``: [num_blocks,
    Hkv, block_size, D]. The table on the device changes only in ``sync_table()``."""

    def __init__(self, n_layers: int, num_blocks: int, n_kv_heads: int, head_dim: int, *,
                 block_size: int = DEFAULT_BLOCK_SIZE, max_rows: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        _positive_int("n_layers", n_layers)
        _positive_int("n_kv_heads", n_kv_heads)
        _positive_int("head_dim", head_dim)
        _positive_int("max_seq_len", max_seq_len)
        self.rows = RowBlocks(num_blocks, block_size, max_rows, blocks_for(max_seq_len, block_size), device)
        self.pool, self.table = self.rows.pool, self.rows.table
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        shape = (num_blocks, n_kv_heads, block_size, head_dim)
        self.k_pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v_pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.lengths = [0] * max_rows

    @property
    def blocks(self) -> list[list[int]]:
        """Each row's blocks in logical order."""
        return [[own[j] for j in sorted(own)] for own in self.rows.rows]

    @property
    def n_layers(self) -> int:
        return len(self.k_pools)

    def reserve(self, row: int, n_tokens: int) -> list[int]:
        """Make row ``row`` hold at least ``n_tokens`` tokens (allocating the missing
        blocks, all or none: ``OutOfBlocks`` leaves the row as it was); returns the
        new blocks. Call ``sync_table()`` before the kernels read the table."""
        if n_tokens > self.max_seq_len:
            raise ValueError(f"row {row}: {n_tokens} tokens exceed max_seq_len={self.max_seq_len}")
        own = self.rows.rows[row]
        before = set(own)
        self.rows.map(row, 0, n_tokens)
        return [own[j] for j in sorted(own) if j not in before]

    def release(self, row: int) -> None:
        """Free every block of the row at once and point its table row at the null block."""
        self.lengths[row] = 0
        self.rows.free(row)

    def sync_table(self) -> torch.Tensor:
        return self.rows.sync()

    def write_prefill(self, row: int, k: torch.Tensor, v: torch.Tensor, *, start: int | None = None,
                      layer: int | None = None) -> None:
        """Write ``T`` tokens of row ``row`` at logical positions ``start .. start + T``
        (``start`` defaults to the row's length: appending, e.g. chunked prefill).
        ``k``/``v``: [n_layers, Hkv, T, D], or [Hkv, T, D] with ``layer``. Reserves the
        blocks it needs and syncs the table. Layer by layer, the row's length advances
        with the last layer's write (so every layer's call appends at the same place)."""
        start = self.lengths[row] if start is None else start
        layers = range(self.n_layers) if layer is None else [layer]
        if layer is not None:
            k, v = k[None], v[None]
        if k.dim() != 4 or k.shape != v.shape or k.shape[0] != len(layers):
            raise ValueError(f"k/v must be [{len(layers)}, Hkv, T, D] of one shape"
                             f"{'' if layer is None else ' (or [Hkv, T, D] with layer=)'}; "
                             f"got {tuple(k.shape)}, {tuple(v.shape)}")
        T = k.shape[2]
        self.reserve(row, start + T)
        table = self.sync_table()[row:row + 1]
        for i, l in enumerate(layers):
            paged_write(self.k_pools[l], table, k[i][None], start)
            paged_write(self.v_pools[l], table, v[i][None], start)
        if layer is None or layer == self.n_layers - 1:
            self.lengths[row] = max(self.lengths[row], start + T)

    def view_row(self, row: int, layer: int | None = None, n_tokens: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The row's first ``n_tokens`` (default: its length) tokens as contiguous copies
        [n_layers, Hkv, n, D] (or [Hkv, n, D] for one ``layer``)."""
        n = self.lengths[row] if n_tokens is None else n_tokens
        table = torch.as_tensor([self.blocks[row]], dtype=torch.int32).to(self.table.device)
        if table.shape[1] == 0:
            table = torch.full((1, 1), NULL_BLOCK, dtype=torch.int32, device=self.table.device)
        layers = range(self.n_layers) if layer is None else [layer]
        ks = torch.stack([paged_to_contiguous(self.k_pools[l], table)[0, :, :n] for l in layers])
        vs = torch.stack([paged_to_contiguous(self.v_pools[l], table)[0, :, :n] for l in layers])
        return (ks, vs) if layer is None else (ks[0], vs[0])

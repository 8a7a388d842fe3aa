"""Helpers shared by the policies: host-side dense decisions, per-row ranges, the
token-level "sinks + top-K middle + recent" selection.

Everything here is free of host syncs: host decisions use ``state.seq_len`` (a
host int the caller keeps through ``begin_step``) and static config only, and
per-row work stays on the device.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from spade import kernels
from spade.policies.base import PolicyState, Selection


def require_seq_len(state: PolicyState, policy: str) -> int:
    """The host cache length of this step; a decode step always has one token.

    ``seq_len == 0`` means the caller never called ``begin_step``: every host
    decision would silently be wrong (dense forever), so fail loudly instead.
    """
    if state.seq_len <= 0:
        raise RuntimeError(
            f"policy '{policy}': state.seq_len is {state.seq_len}; the caller must set it to the "
            "cache length (including the current token) before select, e.g. through "
            "AttentionContext.begin_step(seq_len)"
        )
    return state.seq_len


def is_dense(state: PolicyState, budget: int, policy: str) -> bool:
    """True when every row's context fits the budget, decided on the host.

    The context of row ``b`` is ``kv_len - kv_start[b] <= seq_len``, so
    ``seq_len <= budget`` guarantees full attention is within budget for every
    row without reading ``kv_start`` from the device. Rows whose own context is
    <= budget while ``seq_len`` is larger (left padding) take the sparse path,
    whose token-level selections then cover their whole context anyway.
    """
    return require_seq_len(state, policy) <= budget


@contextlib.contextmanager
def shared_derived(state: PolicyState) -> Iterator[None]:
    """A block of calls (a cache rank's pack: ``select`` of each of its layers) that
    share the tensors derived from the same inputs: each is computed at its first use
    in the block (``derived``), e.g. one launch per pack for the middle bounds of
    ``kv_lens`` instead of one per layer. The block must see those inputs unchanged
    (they are keyed by identity) and run as one unit: a CUDA graph capturing it
    captures the computation at its first use, a later block computes afresh."""
    keep = state.memo
    state.memo = {}
    try:
        yield
    finally:
        state.memo = keep


def derived(memo: dict | None, key: tuple, inputs: tuple, fn: Callable[[], Any]) -> Any:
    """``fn()``, computed once per ``shared_derived`` block for ``key`` and the same
    ``inputs`` objects (tensors or None, compared by identity); every call without a
    block (``memo`` None)."""
    if memo is None:
        return fn()
    hit = memo.get(key)
    if hit is not None and len(hit[0]) == len(inputs) and all(a is b for a, b in zip(hit[0], inputs)):
        return hit[1]
    val = fn()
    memo[key] = (inputs, val)  # holding the inputs keeps their ids from being reused
    return val


def row_start(kv_start: torch.Tensor | None, kv_lens: torch.Tensor) -> torch.Tensor:
    """First valid cache position per row: [B] int64 on ``kv_lens``'s device."""
    if kv_start is None:
        return torch.zeros_like(kv_lens, dtype=torch.int64)
    return kv_start.to(device=kv_lens.device, dtype=torch.int64)


def middle_bounds(kv_lens: torch.Tensor, kv_start: torch.Tensor | None, n_sink: int,
                  n_recent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The range ``[lo, hi)`` between the sinks and the recent window, per row.

    ``lo = kv_start + n_sink`` and ``hi = max(kv_len - n_recent, lo)``: an empty
    range when the sinks and the recent window already cover the row (this
    mirrors ``Selection``'s own clipping, so the middle never overlaps them).
    Returns two [B] int64 tensors.
    """
    kv = kv_lens.to(torch.int64)
    if kv_start is None:  # the common case in one launch fewer (this runs per layer per step)
        lo = kv.clamp(max=n_sink)
    else:
        lo = torch.minimum(row_start(kv_start, kv_lens) + n_sink, kv)
    hi = torch.maximum(kv - n_recent, lo)
    return lo, hi


def empty_indices(batch: int, n_kv_heads: int, device: torch.device | str) -> torch.Tensor:
    """A zero-width middle selection: int32 [B, Hkv, 0]."""
    return torch.empty(batch, n_kv_heads, 0, dtype=torch.int32, device=device)


def layer_carry(state: PolicyState, layer: int, topk: str, k_cache: torch.Tensor,
                block_table: torch.Tensor | None = None) -> torch.Tensor | None:
    """The threshold-carry state of ``layer`` for ``topk_selection`` (``topk == "carry"``
    and the Triton kernels in use), made on first use for the cache's [B, Hkv]; None
    otherwise, and while a CUDA graph is being captured without one (its initial fill
    would be captured too and reset the threshold at every replay: that capture keeps
    the radix path). A state of another batch shape is replaced.

    ``block_table``: the table the scored keys ``k_cache`` are read through (a pool: a paged
    cache's, or asyncspade's scoring copy in its layout), or None for contiguous keys; the
    batch rows are then the table's."""
    if topk != "carry" or not kernels.use_triton(k_cache):
        return None
    B, H = (k_cache.shape[0] if block_table is None else block_table.shape[0]), k_cache.shape[1]
    c = state.carry.get(layer)
    if c is not None and c.shape[:2] == (B, H) and c.device == k_cache.device:
        return c
    if k_cache.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    from spade.kernels.carry import new_carry

    c = state.carry[layer] = new_carry(B, H, k_cache.device)
    return c


def reset_carry(state: PolicyState, layer: int, rows: list[int] | None = None) -> None:
    """A new prompt: the layer's carried threshold says nothing of it (reset in place,
    so a captured graph holding the tensor stays valid), and its calls / fallbacks
    counters restart. ``rows``: only those batch rows' thresholds (requests joining a
    serving batch); the other rows keep theirs, and the counters go on."""
    c = state.carry.get(layer)
    if c is not None:
        from spade.kernels.carry import reset_carry as _reset

        if rows is None:
            _reset(c)
        else:
            for r in rows:
                _reset(c[r], stats=False)


def topk_selection(q: torch.Tensor, k_cache: torch.Tensor, kv_lens: torch.Tensor,
                   kv_start: torch.Tensor | None, *, budget: int, n_sink: int, n_recent: int,
                   scale: float, reduce: str, k_scale: torch.Tensor | None = None,
                   norm_lens: torch.Tensor | None = None, out: torch.Tensor | None = None,
                   memo: dict | None = None, carry: torch.Tensor | None = None,
                   carry_margin: float | None = None, block_table: torch.Tensor | None = None) -> Selection:
    """Sinks + recent window + the top ``budget - n_sink - n_recent`` middle tokens
    scored by ``q`` (exact token-level top-K, one selection per KV head).

    ``q``: [B, Hq, D] (the true query for ``oracle``, a predicted one for
    ``asyncspade``); ``k_cache``: [B, Hkv, L, D]. The middle is
    ``[kv_start + n_sink, kv_len - n_recent)``: disjoint from the sinks and the
    recent window by construction, so no position is counted twice.
    ``k_cache`` may be an int8 scoring copy with its ``k_scale`` [B, Hkv, L]
    (``spade.kernels.quantize_keys``).

    ``sum_softmax`` normalises each head over the row's own ``[kv_start, norm_lens)``
    (``norm_lens`` defaults to ``kv_lens``): a selection made one step ahead passes
    ``kv_lens - 1``, since the newest key does not exist yet where it is computed.

    ``out``: a buffer the middle indices may go to (a cache rank's output row): used
    when it is a contiguous int32 [B, Hkv, budget - n_sink - n_recent] tensor on the
    keys' device — the kernel writes it, no copy, and ``Selection.indices is out`` —
    else ignored.

    ``memo``: ``state.memo`` of a ``shared_derived`` block: the middle bounds of the same
    ``kv_lens`` / ``kv_start`` are computed once per block (one launch per pack).

    ``carry``: the layer's threshold-carry state (``layer_carry``): the same selection,
    found by the threshold-carry top-K (``kernels.score_topk``), whose next threshold
    aims at ``carry_margin`` times the budget's middle (None: the kernels' default).

    ``block_table`` ([B, max_blocks] int32, ``state.block_table``): ``k_cache`` is a paged
    cache's pool [num_blocks, Hkv, block_size, D] of exact (float) keys, scored through the
    table (the radix top-K: no ``carry`` with a table); positions stay logical.
    """
    B, Hkv = q.shape[0], k_cache.shape[1]
    k_top = budget - n_sink - n_recent
    if k_top <= 0:
        idx = empty_indices(B, Hkv, k_cache.device)
    else:
        if out is not None and (out.shape != (B, Hkv, k_top) or out.dtype != torch.int32
                                or not out.is_contiguous() or out.device != k_cache.device):
            out = None
        lo, hi = derived(memo, ("middle_bounds", n_sink, n_recent), (kv_lens, kv_start),
                         lambda: middle_bounds(kv_lens, kv_start, n_sink, n_recent))
        # The sum_softmax normaliser runs over the row's own [kv_start, kv_len): a
        # left-padded row selects exactly what it selects alone.
        idx = kernels.score_topk(q, k_cache, lo, hi, k_top, scale=scale, reduce=reduce,
                                 kv_lens=kv_lens if norm_lens is None else norm_lens,
                                 kv_start=kv_start if reduce == "sum_softmax" else None, k_scale=k_scale,
                                 out=out, carry=carry, carry_margin=carry_margin, block_table=block_table)
    return Selection(indices=idx, n_sink=n_sink, n_recent=n_recent, kv_start=kv_start)


def cache_dims(k_cache: torch.Tensor, state: PolicyState | None = None) -> tuple[int, int, int, int]:
    """The logical (B, Hkv, L, D) of the cache a policy call got: ``k_cache``'s shape,
    or, on a paged cache (``state.block_table``), the table's rows and its capacity in
    tokens; ``state.cache_len`` (when set) overrides L."""
    bt = None if state is None else state.block_table
    if bt is not None:
        B, L = bt.shape[0], bt.shape[1] * k_cache.shape[2]
    else:
        B, L = k_cache.shape[0], k_cache.shape[2]
    if state is not None and state.cache_len is not None:
        L = int(state.cache_len)
    return B, k_cache.shape[1], L, k_cache.shape[3]


def logical_keys(k_cache: torch.Tensor, state: PolicyState | None, n: int | None = None) -> torch.Tensor:
    """The cache's first ``n`` positions (default: its capacity) as [B, Hkv, n, D]:
    ``k_cache`` itself (a view) when contiguous; on a paged cache (``state.block_table``)
    a gathered copy, for the rare whole-cache reads (a copy rebuilt, channels chosen)."""
    bt = None if state is None else state.block_table
    if bt is None:
        return k_cache if n is None else k_cache[:, :, :n]
    from spade.kernels.paged import paged_to_contiguous

    return paged_to_contiguous(k_cache, bt, n)


def last_token_keys(k_cache: torch.Tensor, kv_lens: torch.Tensor,
                    block_table: torch.Tensor | None = None) -> torch.Tensor:
    """The newest cached key of every row, ``k_cache[b, :, kv_lens[b] - 1]``: [B, Hkv, D].
    With ``block_table`` [B, max_blocks], ``k_cache`` is a pool [num_blocks, Hkv,
    block_size, D] read through the table.

    A device-side gather (no host read of ``kv_lens``).
    """
    if block_table is not None:
        from spade.kernels.paged import paged_gather

        pos = (kv_lens.to(device=k_cache.device, dtype=torch.int64) - 1).clamp(min=0)  # [B]
        return paged_gather(k_cache, block_table, pos[:, None])[:, :, 0]
    B, H, _, D = k_cache.shape
    pos = (kv_lens.to(device=k_cache.device, dtype=torch.int64) - 1).clamp(min=0)  # [B]
    idx = pos.view(B, 1, 1, 1).expand(B, H, 1, D)
    return k_cache.gather(2, idx).squeeze(2)

"""The one attention entry point both model paths call during decoding.

A model computes q/k/v for a layer, writes k/v into its KV cache, then calls
``ctx.attend(layer, q, k_cache, v_cache, kv_lens)``. Where the selection comes
from is the ``Selector``'s business:

* ``InlineSelector``: the policy selects on the critical path (synchronous);
* the asynchronous runtime's selector returns what the cache rank prepared one
  step ahead (``spade.runtime``).

Models know policies only through this module.
"""

from __future__ import annotations

from typing import Protocol

import torch

from spade import kernels
from spade.policies.base import AttentionSpec, Policy, PolicyState, Selection


class Selector(Protocol):
    def begin_step(self, seq_len: int, kv_start: torch.Tensor | None) -> None: ...

    def selection(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor,
                  kv_lens: torch.Tensor) -> Selection | None: ...

    def after(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              kv_lens: torch.Tensor) -> None: ...

    def prefill(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                kv_lens: torch.Tensor, pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                ) -> None: ...


class InlineSelector:
    """Selection computed synchronously by the policy, on the current query."""

    def __init__(self, policy: Policy, state: PolicyState):
        self.policy = policy
        self.state = state

    def begin_step(self, seq_len, kv_start):
        self.state.seq_len = seq_len
        self.state.kv_start = kv_start

    def selection(self, layer, q, k_cache, kv_lens):
        return self.policy.select(self.state, layer, q, k_cache, kv_lens)

    def after(self, layer, q, k_cache, v_cache, kv_lens):
        self.policy.observe(self.state, layer, q, k_cache, kv_lens)

    def prefill(self, layer, q, k_cache, v_cache, kv_lens, pool=None):
        self.state.join_pool = None if pool is None else (pool[0], pool[2])
        try:
            self.policy.prefill(self.state, layer, q, k_cache, v_cache, kv_lens)
        finally:
            self.state.join_pool = None


class ThresholdSelector(InlineSelector):
    """Inline selection with the sparse threshold: dense while the cache length is
    ``<= theta`` (``select`` is not called then), the policy's selection after.
    With ``theta = 0`` it is exactly ``InlineSelector``."""

    def __init__(self, policy: Policy, state: PolicyState, theta: int = 0):
        super().__init__(policy, state)
        self.theta = int(theta)

    def selection(self, layer, q, k_cache, kv_lens):
        if self.state.seq_len <= self.theta:
            return None
        return super().selection(layer, q, k_cache, kv_lens)


class FixedSelector:
    """A selector that returns one precomputed ``Selection`` every step: the
    "optimal" decode (selection indices given for free) of the benchmarks."""

    def __init__(self, selection: Selection | None):
        self.sel = selection

    def begin_step(self, seq_len, kv_start):
        pass

    def selection(self, layer, q, k_cache, kv_lens):
        return self.sel

    def after(self, layer, q, k_cache, v_cache, kv_lens):
        pass

    def prefill(self, layer, q, k_cache, v_cache, kv_lens, pool=None):
        pass


class KeyCopy:
    """The inference side's int8 copy of the keys that the two-stage re-rank scores
    (``policy.rerank_keys: int8``): per layer ``kq`` int8 and ``ks`` float32 in the key
    cache's own layout ([B, Hkv, L, D] and [B, Hkv, L]; a paged cache's pool
    [num_blocks, Hkv, block_size, D] and [num_blocks, Hkv, block_size], read through the
    cache's block table), ``k ≈ kq * ks`` (``kernels.quantize_keys``).

    It follows every write of the keys the attention context sees: a batch's prompt
    (``AttentionContext.prefill``), a serving row's prompt (``write_row_keys``) and each decode
    step's key (``append``, device-side at slot ``kv_lens - 1``: graph-safe). The re-rank
    reads only candidates, which are middle tokens written before the step, so the copy
    is never read where it is stale."""

    def __init__(self):
        self.kq: dict[int, torch.Tensor] = {}  # per layer, [B, Hkv, capacity >= L, D] (a pool: its shape)
        self.ks: dict[int, torch.Tensor] = {}
        self.len: dict[int, int] = {}  # per layer, the cache's L at the last write

    def _ensure(self, layer: int, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's copy for the key cache (or pool) ``cache`` [B, Hkv, L, D], as views of
        its first L positions: allocated on first use (zeros), anew for another batch
        (B, Hkv, D or device changed), and grown, its content kept, for a cache that grew
        along L (a cache that is concatenated each step: capacity doubled, so the copies
        amortise). A static cache or a pool keeps one allocation."""
        B, H, L, D = cache.shape
        kq, ks = self.kq.get(layer), self.ks.get(layer)
        if kq is None or (kq.shape[0], kq.shape[1], kq.shape[3]) != (B, H, D) or kq.device != cache.device:
            kq = torch.zeros(cache.shape, dtype=torch.int8, device=cache.device)
            ks = torch.zeros(cache.shape[:3], dtype=torch.float32, device=cache.device)
        elif kq.shape[2] < L:
            cap = max(L, 2 * kq.shape[2])
            kq2 = torch.zeros(B, H, cap, D, dtype=torch.int8, device=cache.device)
            ks2 = torch.zeros(B, H, cap, dtype=torch.float32, device=cache.device)
            kq2[:, :, :kq.shape[2]] = kq
            ks2[:, :, :ks.shape[2]] = ks
            kq, ks = kq2, ks2
        self.kq[layer], self.ks[layer] = kq, ks
        self.len[layer] = L
        return kq[:, :, :L], ks[:, :, :L]

    def write(self, layer: int, cache: torch.Tensor, k: torch.Tensor, start: int,
              rows: slice | None = None, table: torch.Tensor | None = None) -> None:
        """Quantise ``k`` [n, Hkv, T, D] into logical positions ``[start, start + T)``:
        of the batch rows ``rows`` of a contiguous cache, or through ``table`` [n,
        max_blocks] into a paged one (``cache``: the layer's key cache or pool)."""
        kq, ks = self._ensure(layer, cache)
        q8, s8 = kernels.quantize_keys(k.contiguous())
        T = k.shape[2]
        if table is not None:
            from spade.kernels.paged import paged_write

            paged_write(kq, table, q8, start)
            paged_write(ks[..., None], table, s8[..., None], start)
        else:
            rows = slice(0, k.shape[0]) if rows is None else rows
            kq[rows, :, start:start + T] = q8
            ks[rows, :, start:start + T] = s8

    def append(self, layer: int, k_cache: torch.Tensor, kv_lens: torch.Tensor,
               block_table: torch.Tensor | None) -> None:
        """Each row's newest key (slot ``kv_lens - 1`` of the cache or, paged, of the table)
        into the copy: one device-side launch."""
        from spade.policies.common import last_token_keys

        kq, ks = self._ensure(layer, k_cache)
        kv = kv_lens.to(k_cache.device)
        src = k_cache if block_table is None else last_token_keys(k_cache, kv, block_table)
        kernels.quantize_append(kq, ks, src, kv, pos_offset=-1, block_table=block_table)

    def keys(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's (kq, ks) as of the cache's L at the last write."""
        L = self.len[layer]
        return self.kq[layer][:, :, :L], self.ks[layer][:, :, :L]


def key_copy_for(selector) -> KeyCopy | None:
    """A ``KeyCopy`` when the selector's policy re-ranks on int8 keys
    (``Policy.rerank_keys``), else None."""
    keys = getattr(selector, "rerank_keys", None)
    if keys is None:
        pol = getattr(selector, "policy", None)
        keys = pol.rerank_keys() if pol is not None else "exact"
    return KeyCopy() if keys == "int8" else None


class AttentionContext:
    """Per-generation attention context: the selector, the step's bookkeeping and
    device-side statistics (no host sync inside a step).

    ``stats``: [n_layers, 2] int64 device tensor, per layer the tokens attended
    summed over decode steps and (row, KV head), and the decode calls; counted
    inside the attention kernel's launch (no kernels of their own on the decode
    path). ``mean_attended`` reads them after decoding.
    """

    def __init__(self, spec: AttentionSpec, selector: Selector, *, kv_start: torch.Tensor | None = None,
                 device: torch.device | str = "cpu", track_stats: bool = True):
        self.spec = spec
        self.selector = selector
        self.kv_start = kv_start
        self.seq_len = 0
        self.track_stats = track_stats
        self.stats = torch.zeros(spec.n_layers, 2, dtype=torch.int64, device=device)
        self.stat_rows = 0  # B * Hkv of the decode calls counted (one batch per context)
        #: paged KV cache (``spade.kvcache``): the rows' block table [B, max_blocks] int32 for
        #: decode steps (``k_cache``/``v_cache`` are then the layer's pools), set by the model;
        #: None for a contiguous cache and while prefilling
        self.block_table: torch.Tensor | None = None
        #: the cache's logical capacity per row when ``k_cache`` does not show it (paged), else None
        self.cache_len: int | None = None
        #: the int8 key copy the re-rank scores (``policy.rerank_keys: int8``), else None
        self.key_copy: KeyCopy | None = key_copy_for(selector)

    def begin_step(self, seq_len: int) -> None:
        """Called by the backend before each prefill/decode step with the cache
        length (host int, including the token(s) of this step)."""
        self.seq_len = seq_len
        st = getattr(self.selector, "state", None)
        if st is not None:  # the policy reads the cache's layout from its state
            st.block_table, st.cache_len = self.block_table, self.cache_len
        if hasattr(self.selector, "block_table"):  # a cache rank's selector stages keys through it
            self.selector.block_table = self.block_table
        self.selector.begin_step(seq_len, self.kv_start)

    def prefill(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                kv_lens: torch.Tensor, pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                ) -> None:
        """``q``: [B, Hq, T, D] prompt queries (post-RoPE); cache holds the prompt. ``pool``: a
        paged cache's (key pool, value pool, block table) the prompt was written into: an
        inline selector hands (key pool, table) to the policy's ``prefill`` as
        ``state.join_pool`` (state the policy keeps in the pool's layout is written there); a
        cache rank's selector keeps the pools, not the prompt's contiguous copies, for the
        boot (``spade.runtime.selector``)."""
        if self.key_copy is not None:  # the prompt's keys [0, T) (before kv_start: unread)
            T = self.seq_len
            if pool is not None:
                self.key_copy.write(layer, pool[0], k_cache[:, :, :T], 0, table=pool[2])
            else:
                self.key_copy.write(layer, k_cache, k_cache[:, :, :T], 0)
        self.selector.prefill(layer, q, k_cache, v_cache, kv_lens, pool=pool)

    def write_row_keys(self, layer: int, row: int, k_row: torch.Tensor, lo: int, hi: int, backend) -> None:
        """Serving: a joining row's prompt keys, positions ``[lo, hi)`` of ``k_row`` [1, Hkv,
        >= hi, D] (the row's cache view), into the re-rank's int8 copy, if any, in the layout
        of ``backend``'s cache (its pool and block table when paged)."""
        if self.key_copy is None:
            return
        k = k_row[:, :, lo:hi]
        if getattr(backend, "paged", False):
            table = backend.block_table[row:row + 1]
            self.key_copy.write(layer, backend.k_cache[layer], k, lo, table=table)
        else:
            self.key_copy.write(layer, backend.k_cache[layer], k, lo, rows=slice(row, row + 1))

    def append_keys(self, layer: int, k_cache: torch.Tensor, kv_lens: torch.Tensor) -> None:
        """The step's key into the re-rank's int8 copy, if any (every decode step, dense or
        sparse: a later sparse step may re-rank it)."""
        if self.key_copy is not None:
            self.key_copy.append(layer, k_cache, kv_lens, self.block_table)

    def rerank(self, layer: int, sel: Selection, q: torch.Tensor, k_cache: torch.Tensor) -> Selection:
        """``sel`` re-ranked by the true query ``q`` (two-stage: ``sel.keep`` > 0) on the
        cache's keys, or on the int8 copy (``key_copy``)."""
        if self.key_copy is None:
            return sel.reranked(q, k_cache, self.spec.softmax_scale, block_table=self.block_table)
        kq, ks = self.key_copy.keys(layer)
        return sel.reranked(q, kq, self.spec.softmax_scale, block_table=self.block_table, k_scale=ks)

    def attend(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               kv_lens: torch.Tensor) -> torch.Tensor:
        """One decode step of one layer. ``q`` [B, Hq, D]; returns [B, Hq, D]."""
        sel = self.selector.selection(layer, q, k_cache, kv_lens)
        self.append_keys(layer, k_cache, kv_lens)
        if sel is not None and sel.keep > 0:  # two-stage: the true query keeps the best candidates
            sel = self.rerank(layer, sel, q, k_cache)
        stats = self.layer_stats(layer, q, k_cache)
        bt = self.block_table
        if sel is None:
            out = kernels.sparse_decode_attention(q, k_cache, v_cache, kv_lens, None,
                                                  scale=self.spec.softmax_scale, kv_start=self.kv_start,
                                                  stats=stats, block_table=bt)
        else:
            out = kernels.sparse_decode_attention(
                q, k_cache, v_cache, kv_lens, sel.indices, n_sink=sel.n_sink, n_recent=sel.n_recent,
                scale=self.spec.softmax_scale,
                kv_start=sel.kv_start if sel.kv_start is not None else self.kv_start, stats=stats,
                block_table=bt,
            )
        self.selector.after(layer, q, k_cache, v_cache, kv_lens)
        return out

    def layer_stats(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor | None:
        """The [2] int64 statistics row the attention kernel adds layer ``layer``'s
        counts into (None with ``track_stats`` off)."""
        if not self.track_stats:
            return None
        if self.stats.device != q.device:  # the context was built before the model moved
            self.stats = self.stats.to(q.device)
        self.stat_rows = q.shape[0] * k_cache.shape[1]  # B * Hkv (a pool has the cache's Hkv too)
        return self.stats[layer]

    def graph_key(self) -> tuple:
        """See ``Policy.graph_key``; selectors without a policy return ()."""
        pol = getattr(self.selector, "policy", None)
        st = getattr(self.selector, "state", None)
        return pol.graph_key(st) if pol is not None and st is not None else ()

    def mean_attended(self) -> float:
        """Mean tokens attended per (row, KV head, layer, step). Syncs: call after decoding."""
        tokens, calls = (int(x) for x in self.stats.sum(0).tolist())
        return tokens / (calls * self.stat_rows) if calls and self.stat_rows else 0.0

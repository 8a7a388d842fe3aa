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
        self.selector.prefill(layer, q, k_cache, v_cache, kv_lens, pool=pool)

    def q_out(self, layer: int, B: int) -> torch.Tensor | None:
        """Where a decode step may write layer ``layer``'s query [B, Hq, D] as it makes it
        (the selector's staging slot, which ``after`` then need not fill), or None. Asked
        once per layer when a step is built (eagerly, or at a graph's capture)."""
        fn = getattr(self.selector, "q_out", None)
        return fn(layer, B) if fn is not None else None

    def attend(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               kv_lens: torch.Tensor) -> torch.Tensor:
        """One decode step of one layer. ``q`` [B, Hq, D]; returns [B, Hq, D]."""
        sel = self.selector.selection(layer, q, k_cache, kv_lens)
        if sel is not None and sel.keep > 0:  # two-stage: the true query keeps the best candidates
            sel = sel.reranked(q, k_cache, self.spec.softmax_scale, block_table=self.block_table)
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

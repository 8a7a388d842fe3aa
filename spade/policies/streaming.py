"""``streaming``: attention sinks + a sliding window of recent tokens.

The query-agnostic baseline: no scoring at all, so it costs nothing and can run
ahead (``needs_current_query = False``). The whole budget beyond the sinks goes
to the recent window: ``n_recent = budget - sink_tokens`` (``recent_tokens`` is
only the lower bound the config checks).
"""

from __future__ import annotations

from typing import Literal

import torch

from spade.policies.base import Policy, PolicyState, Selection, SparseCommonConfig
from spade.policies.common import cache_dims, empty_indices, is_dense


class StreamingPolicyConfig(SparseCommonConfig):
    name: Literal["streaming"] = "streaming"


class StreamingPolicy(Policy):
    """Sinks ``[s, s + sink)`` and the ``budget - sink`` most recent tokens.

    >>> from spade.policies.streaming import StreamingPolicyConfig
    >>> from spade.policies.base import AttentionSpec
    >>> pol = StreamingPolicy(StreamingPolicyConfig(budget=8, sink_tokens=2, recent_tokens=1),
    ...                       AttentionSpec(n_layers=1, n_q_heads=2, n_kv_heads=2, head_dim=4))
    >>> st = pol.new_state(1, "cpu"); st.seq_len = 30
    >>> sel = pol.select(st, 0, None, torch.zeros(1, 2, 30, 4), torch.tensor([30]))
    >>> sel.indices.shape, sel.n_sink, sel.n_recent
    (torch.Size([1, 2, 0]), 2, 6)
    """

    name = "streaming"
    needs_current_query = False

    @property
    def rows(self) -> int:
        return 0  # its prefill reads no prompt query

    def selection_layout(self) -> tuple[int, int, int]:
        c = self.cfg  # no middle: the window takes every slot but the sinks
        return 0, c.sink_tokens, c.budget - c.sink_tokens

    def new_state(self, batch_size: int, device: torch.device | str) -> PolicyState:
        state = super().new_state(batch_size, device)
        # one zero-width index tensor shared by every layer and step (no per-step alloc)
        state.layers = [empty_indices(batch_size, self.spec.n_kv_heads, device)] * self.spec.n_layers
        return state

    def select(self, state: PolicyState, layer: int, q: torch.Tensor | None, k_cache: torch.Tensor,
               kv_lens: torch.Tensor) -> Selection | None:
        cfg = self.cfg
        if is_dense(state, cfg.budget, self.name):
            return None
        B, Hkv = cache_dims(k_cache, state)[:2]  # (a paged cache: the table's rows)
        idx = state.layers[layer]
        if idx is None or idx.device != k_cache.device or idx.shape[:2] != (B, Hkv):
            idx = empty_indices(B, Hkv, k_cache.device)
            state.layers[layer] = idx
        return Selection(indices=idx, n_sink=cfg.sink_tokens, n_recent=cfg.budget - cfg.sink_tokens,
                         kv_start=state.kv_start)

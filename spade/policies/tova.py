"""``tova``: token eviction by the current query's attention (TOVA).

A fixed cache of ``budget`` tokens per (row, layer), shared by all KV heads of
the layer. At every step the current token enters; once more than ``budget``
tokens would be held, the one with the lowest attention weight of the current
query (softmax over the held set, averaged over all query heads) is dropped
*for good*. Unlike the query-aware policies (oracle, quest, asyncspade), which
re-select from the whole cache at every step, an evicted token can never come
back (``evicts = True``): a token that matters only later is lost.

Budget accounting (the common rule: K counts everything attended): the
current token is always attended, so at most ``budget - 1`` earlier tokens are
held. ``observe`` of step t computes q_t's attention over exactly the set step
t attended (held ∪ {t}, ``budget`` tokens once full) and drops its minimum, so
step t+1 attends ``budget - 1`` held tokens plus token t+1. This is TOVA with a
cache of ``budget - 1`` tokens plus the incoming one.

``select`` ignores the query (the eviction already happened in ``observe``),
so the policy can run one step ahead (``needs_current_query = False``).

State per layer: ``slots`` int32 [B, budget]: slots ``0 .. budget-2`` hold
positions (``-1`` = empty), the last slot is scratch for the incoming token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field

from spade import kernels
from spade.config import ConfigSection
from spade.policies.base import Policy, PolicyState, Selection
from spade.policies.common import cache_dims, is_dense, row_start
from spade.streams import device_index


class TovaPolicyConfig(ConfigSection):
    name: Literal["tova"] = "tova"
    budget: int = Field(256, gt=1)
    """Fixed cache size: tokens beyond it are evicted for good."""


@dataclass
class TovaLayerState:
    slots: torch.Tensor  # [B, budget] int32: held positions in [:-1], scratch in [-1]


class TovaPolicy(Policy):
    """TOVA eviction with a fixed budget of tokens per (row, layer).

    >>> from spade.policies.tova import TovaPolicyConfig
    >>> from spade.policies.base import AttentionSpec
    >>> pol = TovaPolicy(TovaPolicyConfig(budget=4),
    ...                  AttentionSpec(n_layers=1, n_q_heads=2, n_kv_heads=1, head_dim=8))
    >>> st = pol.new_state(1, "cpu"); st.seq_len = 10
    >>> k = torch.randn(1, 1, 16, 8); q = torch.randn(1, 2, 10, 8)
    >>> pol.prefill(st, 0, q, k, k, torch.tensor([10]))
    >>> pol.held(st, 0).shape   # budget - 1 held prompt tokens
    torch.Size([1, 3])
    """

    name = "tova"
    needs_current_query = False
    evicts = True

    @property
    def rows(self) -> int:
        return 1  # its prefill reads the last prompt query only

    def new_state(self, batch_size: int, device: torch.device | str) -> PolicyState:
        state = super().new_state(batch_size, device)
        state.layers = [
            TovaLayerState(slots=torch.full((batch_size, self.cfg.budget), -1, dtype=torch.int32, device=device))
            for _ in range(self.spec.n_layers)
        ]
        return state

    def held(self, state: PolicyState, layer: int) -> torch.Tensor:
        """Positions held for later steps: int32 [B, budget - 1], ``-1`` = empty slot."""
        return state.layers[layer].slots[:, :-1]

    def prefill(self, state: PolicyState, layer: int, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, kv_lens: torch.Tensor) -> None:
        """Keep the ``budget - 1`` prompt tokens the last prompt query attends most
        (all of them when the prompt is shorter)."""
        slots = self._slots(state, layer, k_cache.shape[0], k_cache.device)
        L = k_cache.shape[2]
        keep = self.cfg.budget - 1
        # Σ over every query head of its softmax over [kv_start, kv_len): [B, Hkv, L] -> [B, L]
        w = kernels.group_scores(q[:, :, -1], k_cache, kv_lens, scale=self.spec.softmax_scale,
                                 reduce="sum_softmax", kv_start=state.kv_start).sum(1)
        pos = torch.arange(L, device=k_cache.device)
        valid = (pos >= row_start(state.kv_start, kv_lens)[:, None]) & (pos < kv_lens.to(torch.int64)[:, None])
        w = torch.where(valid, w, float("-inf"))
        n = min(keep, L)
        top_w, top_i = torch.topk(w, n, dim=1)  # [B, n]
        slots.fill_(-1)
        slots[:, :n] = torch.where(top_w > float("-inf"), top_i, -1).to(torch.int32)

    def prefill_rows(self, state: PolicyState, layer: int, rows: list[int], q: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, kv_lens: torch.Tensor) -> None:
        """The joining rows' held sets chosen from their prompts, copied into the batch's."""
        sub = self.row_state(state, rows, k_cache.device)
        self.prefill(sub, layer, q, k_cache, v_cache, kv_lens)
        slots = state.layers[layer].slots
        slots.index_copy_(0, device_index(rows, slots.device), sub.layers[layer].slots.to(slots.device))

    def select(self, state: PolicyState, layer: int, q: torch.Tensor | None, k_cache: torch.Tensor,
               kv_lens: torch.Tensor) -> Selection | None:
        if is_dense(state, self.cfg.budget, self.name):
            return None
        B, Hkv = cache_dims(k_cache, state)[:2]  # (a paged cache: the table's rows)
        slots = self._slots(state, layer, B, k_cache.device)
        held = slots[:, None, :-1].expand(B, Hkv, self.cfg.budget - 1).contiguous()  # [B, Hkv, budget-1]
        # the current token (not yet observed) is the one-token recent window
        return Selection(indices=held, n_sink=0, n_recent=1, kv_start=state.kv_start)

    def observe(self, state: PolicyState, layer: int, q: torch.Tensor, k_cache: torch.Tensor,
                kv_lens: torch.Tensor) -> None:
        """Let the current token in; evict the held set's least attended token if full."""
        B, Hkv, _, D = cache_dims(k_cache, state)
        slots = self._slots(state, layer, B, k_cache.device)
        Hq = q.shape[1]
        slots[:, -1] = (kv_lens.to(slots.device) - 1).to(torch.int32)
        cand = slots.long()  # [B, budget]: held ∪ {current}, exactly what this step attended
        valid = cand >= 0
        if state.block_table is not None:  # a paged cache: the held keys through the table
            from spade.kernels.paged import paged_gather

            keys = paged_gather(k_cache, state.block_table, cand.clamp(min=0))
        else:
            idx = cand.clamp(min=0)[:, None, :, None].expand(B, Hkv, cand.shape[1], D)
            keys = k_cache.gather(2, idx)
        keys = keys.float()  # [B, Hkv, budget, D]
        qg = q.float().view(B, Hkv, Hq // Hkv, D)  # [B, Hkv, G, D]
        logits = torch.einsum("bhgd,bhnd->bhgn", qg, keys) * self.spec.softmax_scale
        logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
        w = torch.softmax(logits, dim=-1).mean(dim=(1, 2))  # [B, budget] mean over all q heads
        # empty slots (-1 < any weight) are filled first; otherwise the minimum goes
        drop = torch.where(valid, w, -1.0).argmin(dim=1, keepdim=True)  # [B, 1]
        # the current token takes the dropped slot (a no-op when it is itself dropped)
        slots.scatter_(1, drop, slots[:, -1:].clone())

    def _slots(self, state: PolicyState, layer: int, B: int, device: torch.device) -> torch.Tensor:
        """The layer's slots for a batch of ``B`` rows on ``device`` (new, empty ones when
        the layer's are for another batch or device)."""
        st = state.layers[layer]
        if st is None or st.slots.shape[0] != B or st.slots.device != device:
            st = TovaLayerState(slots=torch.full((B, self.cfg.budget), -1, dtype=torch.int32, device=device))
            state.layers[layer] = st
        return st.slots

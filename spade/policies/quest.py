"""``quest``: page-level query-aware selection (Quest page bounds).

Each page of ``page_size`` consecutive cache positions, counted from the row's own
start ``kv_start``, keeps the element-wise min and max of its keys; a page's score
is an upper bound of ``q · k`` over its tokens, ``Σ_d max(q_d·min_d, q_d·max_d)``.
The ``budget // page_size`` pages with the best bounds are attended, the last
(partial) page always among them.
Cheap to score (``L / page_size`` bounds instead of ``L`` keys) but coarse: a
page is kept whole or not at all.

State per layer: ``kmin``/``kmax`` [B, Hkv, P, D] (``P = ceil(L / page_size)`` for
the cache's logical capacity L, ``state.cache_len`` when set; the key dtype), built from the prompt at ``prefill`` and folded with the newest
key at every ``observe``. ``select`` at step t therefore sees the bounds of
tokens up to t-1; token t lies in the last page, which is always kept.

Paged KV cache (``state.block_table``): the newest key is read through the table
(``last_token_keys``), and a cache never prefilled is bounded through it
(``quest_build(block_table=)``). Rows that join a serving batch on a paged cache
(``prefill_rows`` with ``state.join_pool``) keep their bounds in the pool's blocks
(``QuestLayerState.paged``, *pool bounds* in ``spade.kernels.quest``): page ``p`` in the
block of its first position, so the bounds take memory only where the rows' KV
does, and the batch's logical capacity sizes none of them. A static batch's prefill on
a paged cache (``prefill`` with ``state.join_pool``) writes pool bounds too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field, model_validator

from spade import kernels
from spade.config import ConfigSection
from spade.policies.base import Policy, PolicyState, Selection
from spade.policies.common import cache_dims, is_dense, last_token_keys
from spade.streams import device_index


class QuestPolicyConfig(ConfigSection):
    name: Literal["quest"] = "quest"
    budget: int = Field(256, gt=0)
    page_size: int = Field(16, gt=0)
    group_reduce: Literal["sum_logits", "max_logits"] = "sum_logits"

    @model_validator(mode="after")
    def _fits(self):
        if self.budget < 2 * self.page_size:
            raise ValueError(
                f"budget ({self.budget}) must hold at least two pages of page_size ({self.page_size})"
            )
        return self


@dataclass
class QuestLayerState:
    kmin: torch.Tensor  # [B, Hkv, P, D] element-wise min of each page's keys (+inf: empty)
    kmax: torch.Tensor  # [B, Hkv, P, D] element-wise max of each page's keys (-inf: empty)
    paged: bool = False
    """The bounds are pool bounds [num_blocks, Hkv, ceil(block_size / page_size), D] in the
    paged cache's blocks, read and written through ``state.block_table``."""


class QuestPolicy(Policy):
    """Quest: the best ``budget // page_size`` pages by their upper-bound score.

    Pages are relative to each row's start (page ``p`` of row ``b`` holds positions
    ``[kv_start[b] + p·S, kv_start[b] + (p+1)·S)``), so a request pages alike wherever
    its window starts (left padding, a serving join at any cursor); positions before
    ``kv_start`` are never selected. The selection has no sinks and no recent window
    (``n_sink = n_recent = 0``): the current token comes with the last page.

    >>> from spade.policies.quest import QuestPolicyConfig
    >>> from spade.policies.base import AttentionSpec
    >>> pol = QuestPolicy(QuestPolicyConfig(budget=8, page_size=4),
    ...                   AttentionSpec(n_layers=1, n_q_heads=2, n_kv_heads=1, head_dim=8))
    >>> st = pol.new_state(1, "cpu"); st.seq_len = 30
    >>> k = torch.randn(1, 1, 32, 8); q = torch.randn(1, 2, 8)
    >>> pol.prefill(st, 0, q[:, :, None], k, k, torch.tensor([30]))
    >>> sel = pol.select(st, 0, q, k, torch.tensor([30]))
    >>> sorted(set((sel.indices[sel.indices >= 0] // 4).tolist()))[-1]  # the last page
    7
    """

    name = "quest"
    needs_current_query = True

    @property
    def rows(self) -> int:
        return 0  # its prefill reads no prompt query

    @property
    def n_pages_sel(self) -> int:
        return self.cfg.budget // self.cfg.page_size

    def _build(self, state: PolicyState, layer: int, k_cache: torch.Tensor, kv_lens: torch.Tensor,
               block_table: torch.Tensor | None = None) -> QuestLayerState:
        """The page bounds of the cache's tokens ``[kv_start, kv_lens)``, sized for its
        logical capacity (``state.cache_len`` when set: a prefill may get only the prompt).
        ``block_table``: ``k_cache`` is a paged cache's pool, read through the table."""
        kmin, kmax = kernels.quest_build(k_cache, kv_lens, self.cfg.page_size, kv_start=state.kv_start,
                                         block_table=block_table)
        st = QuestLayerState(kmin=kmin, kmax=kmax)
        state.layers[layer] = st
        L = state.cache_len if state.cache_len is not None else \
            (k_cache.shape[2] if block_table is None else block_table.shape[1] * k_cache.shape[2])
        return self._fit(st, L, exact=True)

    def _fit(self, st: QuestLayerState, L: int, exact: bool = False) -> QuestLayerState:
        """Grow the page bounds to cover ``L`` logical positions when the cache itself grew
        (a dynamic cache, e.g. the HF path): new pages start empty (+inf / -inf), and the
        capacity doubles (``exact``: exactly ``L``'s pages, as built for a capacity).
        Host-side shapes only."""
        if st.paged:  # pool bounds follow the cache's blocks
            return st
        need = -(-L // self.cfg.page_size)
        have = st.kmin.shape[2]
        if need > have:
            B, H, _, D = st.kmin.shape
            pad = (B, H, (need if exact else max(need, 2 * have)) - have, D)
            st.kmin = torch.cat([st.kmin, st.kmin.new_full(pad, float("inf"))], dim=2)
            st.kmax = torch.cat([st.kmax, st.kmax.new_full(pad, float("-inf"))], dim=2)
        return st

    def prefill(self, state: PolicyState, layer: int, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, kv_lens: torch.Tensor) -> None:
        """The prompt's page bounds: pool bounds with ``state.join_pool`` (a paged cache),
        else per-row bounds sized for the cache's capacity."""
        if state.join_pool is not None:
            self._into_pool(state, layer, list(range(k_cache.shape[0])), k_cache, kv_lens, state.join_pool)
            return
        self._build(state, layer, k_cache, kv_lens)

    def prefill_rows(self, state: PolicyState, layer: int, rows: list[int], q: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, kv_lens: torch.Tensor) -> None:
        """The joining rows' page bounds built from their prompts (pages counted from each
        row's own ``kv_start``, as alone from 0), copied into the batch's bounds: with
        ``state.join_pool`` (a paged cache) into pool bounds through the rows' tables,
        else into the rows of the per-row array."""
        st = state.layers[layer]
        if state.join_pool is not None and (st is None or st.paged):
            self._into_pool(state, layer, rows, k_cache, kv_lens, state.join_pool)
            return
        sub = self.row_state(state, rows, k_cache.device)
        new = self._build(sub, layer, k_cache, kv_lens)
        B = state.batch_size
        if st is None or st.kmin.shape[0] != B or st.kmin.shape[2:] != new.kmin.shape[2:] \
                or st.kmin.device != new.kmin.device:
            shape = (B, *new.kmin.shape[1:])
            st = QuestLayerState(kmin=new.kmin.new_full(shape, float("inf")),
                                 kmax=new.kmax.new_full(shape, float("-inf")))
            state.layers[layer] = st
        idx = device_index(rows, st.kmin.device)
        st.kmin.index_copy_(0, idx, new.kmin)
        st.kmax.index_copy_(0, idx, new.kmax)

    def _into_pool(self, state: PolicyState, layer: int, rows: list[int], k_cache: torch.Tensor,
                   kv_lens: torch.Tensor, pool: tuple[torch.Tensor, torch.Tensor]) -> QuestLayerState:
        """The rows' page bounds built from their keys (contiguous, or ``k_cache`` is
        ``pool``'s key pool itself: every row, read through its table), written into pool
        bounds [num_blocks, Hkv, ceil(block_size / page_size), D] through the rows of
        ``pool`` = (key pool, table) (made on first use; a row's pages in blocks it does not
        hold are never read, so nothing is cleared)."""
        k_pool, table = pool
        sub = self.row_state(state, rows, k_cache.device)
        sub.cache_len = None  # the rows' own pages only: nothing at the logical capacity
        new = self._build(sub, layer, k_cache, kv_lens, table if k_cache is k_pool else None)
        bs = k_pool.shape[2]
        shape = (k_pool.shape[0], new.kmin.shape[1], -(-bs // self.cfg.page_size), new.kmin.shape[3])
        st = state.layers[layer]
        if st is None or not st.paged or tuple(st.kmin.shape) != shape \
                or st.kmin.dtype != new.kmin.dtype or st.kmin.device != new.kmin.device:
            st = QuestLayerState(kmin=new.kmin.new_full(shape, float("inf")),
                                 kmax=new.kmax.new_full(shape, float("-inf")), paged=True)
            state.layers[layer] = st
        idx = device_index(rows, table.device)
        kernels.quest_write_pool(st.kmin, st.kmax, new.kmin, new.kmax, table.index_select(0, idx), kv_lens,
                                 self.cfg.page_size, bs, kv_start=sub.kv_start)
        return st

    def _first(self, state: PolicyState, layer: int, k_cache: torch.Tensor, kv_lens: torch.Tensor) -> QuestLayerState:
        """No prefill was reported: bound the cache as it is now (once); on a paged cache
        (``state.block_table``) into pool bounds, as a prefill with the pool would."""
        bt = state.block_table
        if bt is None:
            return self._build(state, layer, k_cache, kv_lens)
        return self._into_pool(state, layer, list(range(bt.shape[0])), k_cache, kv_lens, (k_cache, bt))

    def select(self, state: PolicyState, layer: int, q: torch.Tensor | None, k_cache: torch.Tensor,
               kv_lens: torch.Tensor) -> Selection | None:
        cfg = self.cfg
        if is_dense(state, cfg.budget, self.name):
            return None
        if q is None:
            raise ValueError("quest needs the current query (needs_current_query=True)")
        st = state.layers[layer]
        if st is None:  # no prefill was reported: bound the cache as it is now (once)
            st = self._first(state, layer, k_cache, kv_lens)
        st = self._fit(st, cache_dims(k_cache, state)[2])
        idx = kernels.quest_select(q, st.kmin, st.kmax, kv_lens, self.n_pages_sel, cfg.page_size,
                                   scale=self.spec.softmax_scale, reduce=cfg.group_reduce,
                                   kv_start=state.kv_start, **self._pool_args(st, state, k_cache))
        return Selection(indices=idx, n_sink=0, n_recent=0, kv_start=state.kv_start)

    def observe(self, state: PolicyState, layer: int, q: torch.Tensor, k_cache: torch.Tensor,
                kv_lens: torch.Tensor) -> None:
        st = state.layers[layer]
        if st is None:  # the bounds are built from the whole cache at first use
            self._first(state, layer, k_cache, kv_lens)
            return
        self._fit(st, cache_dims(k_cache, state)[2])
        pos = kv_lens.to(device=k_cache.device, dtype=torch.int64) - 1  # [B]; its page: (pos - kv_start) // S
        kernels.quest_update(st.kmin, st.kmax, last_token_keys(k_cache, kv_lens, state.block_table), pos,
                             self.cfg.page_size, kv_start=state.kv_start, **self._pool_args(st, state, k_cache))

    @staticmethod
    def _pool_args(st: QuestLayerState, state: PolicyState, k_cache: torch.Tensor) -> dict:
        """The table pool bounds are read through (the cache's own), or nothing."""
        if not st.paged:
            return {}
        if state.block_table is None or k_cache.dim() != 4:
            raise ValueError("quest's bounds live in a paged cache's blocks: select / observe need the cache's pool "
                             "and state.block_table")
        return {"block_table": state.block_table, "block_size": k_cache.shape[2]}

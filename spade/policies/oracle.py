"""``oracle``: exact token-level top-K with the current query.

The upper bound of every query-aware policy at a given budget (it scores every
cached key with the true query), and the baseline the paper's asynchronous
selection tries to match: it needs the current query, so it runs on the
critical path (``needs_current_query = True``).
"""

from __future__ import annotations

from typing import Literal

import torch

from spade.policies.base import Policy, PolicyState, Selection, SparseCommonConfig
from spade.policies.common import is_dense, layer_carry, reset_carry, topk_selection


class OraclePolicyConfig(SparseCommonConfig):
    name: Literal["oracle"] = "oracle"
    topk: Literal["carry", "radix"] = "radix"
    """How the GPU kernels find the exact top-K (the same selection either way): see
    ``AsyncSpadePolicyConfig.topk``. ``radix`` by default here: the oracle scores with
    each step's own query, which on the random-weight benchmark model moves the K-th
    score too far for a carried threshold (the carry made the inline oracle 18.4 ms per
    step vs 12.0 at B=8 L=32k, docs/perf.md)."""


class OraclePolicy(Policy):
    """Sinks + recent window + the top ``budget - sink - recent`` middle tokens of
    the current query's (group-reduced) scores.

    >>> from spade.policies.oracle import OraclePolicyConfig
    >>> from spade.policies.base import AttentionSpec
    >>> pol = OraclePolicy(OraclePolicyConfig(budget=8, sink_tokens=1, recent_tokens=2),
    ...                    AttentionSpec(n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=8))
    >>> st = pol.new_state(1, "cpu"); st.seq_len = 20
    >>> q, k = torch.randn(1, 4, 8), torch.randn(1, 2, 20, 8)
    >>> sel = pol.select(st, 0, q, k, torch.tensor([20]))
    >>> sel.indices.shape, int(sel.attended(torch.tensor([20])).max())
    (torch.Size([1, 2, 5]), 8)
    """

    name = "oracle"
    needs_current_query = True

    @property
    def rows(self) -> int:
        return 0  # its prefill reads no prompt query

    def select(self, state: PolicyState, layer: int, q: torch.Tensor | None, k_cache: torch.Tensor,
               kv_lens: torch.Tensor) -> Selection | None:
        cfg = self.cfg
        if is_dense(state, cfg.budget, self.name):
            return None
        if q is None:
            raise ValueError("oracle needs the current query (needs_current_query=True)")
        bt = state.block_table  # a paged cache: the pool's exact keys scored through the table
        return topk_selection(q, k_cache, kv_lens, state.kv_start, budget=cfg.budget,
                              n_sink=cfg.sink_tokens, n_recent=cfg.recent_tokens,
                              scale=self.spec.softmax_scale, reduce=cfg.group_reduce,
                              carry=layer_carry(state, layer, cfg.topk, k_cache, bt), block_table=bt)

    def prefill(self, state: PolicyState, layer: int, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, kv_lens: torch.Tensor) -> None:
        reset_carry(state, layer)  # a new prompt: the carried threshold says nothing of it

    def prefill_rows(self, state: PolicyState, layer: int, rows: list[int], q: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, kv_lens: torch.Tensor) -> None:
        # the joining rows' carried thresholds (GPU kernels) restart; the other rows keep
        # theirs: a speed hint only, the selection is the exact top-K either way
        reset_carry(state, layer, rows)

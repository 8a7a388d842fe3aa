"""``full``: dense attention over the whole cache (the reference)."""

from __future__ import annotations

from spade.policies.base import Policy


class FullPolicy(Policy):
    name = "full"
    needs_current_query = False

    def select(self, state, layer, q, k_cache, kv_lens):
        return None

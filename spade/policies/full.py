"""``full``: dense attention over the whole cache (the reference)."""

from __future__ import annotations

from typing import Literal

from spade.config import ConfigSection
from spade.policies.base import Policy


class FullPolicyConfig(ConfigSection):
    name: Literal["full"] = "full"


class FullPolicy(Policy):
    name = "full"
    needs_current_query = False

    @property
    def rows(self) -> int:
        return 0  # its prefill reads no prompt query

    def select(self, state, layer, q, k_cache, kv_lens):
        return None

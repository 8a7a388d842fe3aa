"""Policy registry (lazy, string-keyed). One file per policy.

>>> from spade.policies import POLICIES
>>> POLICIES.names()
['asyncspade', 'full', 'oracle', 'quest', 'streaming', 'tova']
"""

from __future__ import annotations

from spade.policies.base import AttentionSpec, Policy, PolicyState, RopeSpec, Selection
from spade.registry import LazyRegistry

POLICIES: LazyRegistry = LazyRegistry("policy")
POLICIES.register("full", "spade.policies.full:FullPolicy")
POLICIES.register("oracle", "spade.policies.oracle:OraclePolicy")
POLICIES.register("streaming", "spade.policies.streaming:StreamingPolicy")
POLICIES.register("quest", "spade.policies.quest:QuestPolicy")
POLICIES.register("tova", "spade.policies.tova:TovaPolicy")
POLICIES.register("asyncspade", "spade.policies.asyncspade:AsyncSpadePolicy")


def build_policy(cfg, spec: AttentionSpec) -> Policy:
    """Instantiate the policy named by ``cfg.name`` (a ``*PolicyConfig``)."""
    return POLICIES.get(cfg.name)(cfg, spec)


__all__ = ["POLICIES", "build_policy", "Policy", "PolicyState", "Selection", "AttentionSpec", "RopeSpec"]

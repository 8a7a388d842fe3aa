"""Policy registry (lazy, string-keyed). One file per policy, which owns its
config class; ``spade.config`` builds the ``policy`` section's union from here.

>>> from spade.policies import POLICIES
>>> POLICIES.names()
['asyncspade', 'full', 'oracle', 'quest', 'streaming', 'tova']

A plugin adds a policy without editing spade (a ``Policy`` subclass and a config
class whose ``name`` is ``Literal["mine"]``)::

    POLICIES.register("mine", "my_pkg.mine:MinePolicy", config="my_pkg.mine:MinePolicyConfig")

Importing this package loads no torch: the base classes below load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spade.registry import LazyRegistry

if TYPE_CHECKING:  # pragma: no cover
    from spade.policies.base import AttentionSpec, Policy, PolicyState, RopeSpec, Selection

POLICIES: LazyRegistry = LazyRegistry("policy")
POLICIES.register("full", "spade.policies.full:FullPolicy", config="spade.policies.full:FullPolicyConfig")
POLICIES.register("oracle", "spade.policies.oracle:OraclePolicy", config="spade.policies.oracle:OraclePolicyConfig")
POLICIES.register("streaming", "spade.policies.streaming:StreamingPolicy",
                  config="spade.policies.streaming:StreamingPolicyConfig")
POLICIES.register("quest", "spade.policies.quest:QuestPolicy", config="spade.policies.quest:QuestPolicyConfig")
POLICIES.register("tova", "spade.policies.tova:TovaPolicy", config="spade.policies.tova:TovaPolicyConfig")
POLICIES.register("asyncspade", "spade.policies.asyncspade:AsyncSpadePolicy",
                  config="spade.policies.asyncspade:AsyncSpadePolicyConfig")


def build_policy(cfg, spec: AttentionSpec) -> Policy:
    """Instantiate the policy named by ``cfg.name`` (its registered config class)."""
    return POLICIES.get(cfg.name)(cfg, spec)


_BASE = ("AttentionSpec", "Policy", "PolicyState", "RopeSpec", "Selection")


def __getattr__(name: str):
    if name in _BASE:
        from spade.policies import base

        return getattr(base, name)
    raise AttributeError(f"module 'spade.policies' has no attribute {name!r}")


__all__ = ["POLICIES", "build_policy", "Policy", "PolicyState", "Selection", "AttentionSpec", "RopeSpec"]

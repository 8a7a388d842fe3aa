"""Runtimes: ``inline`` (synchronous selection) and the asynchronous
inference-rank / cache-rank runtime (``colocated``, ``local``, ``multiprocess``)."""

from __future__ import annotations

from spade.registry import LazyRegistry
from spade.runtime.base import GenerationTrace, Runtime

RUNTIMES: LazyRegistry = LazyRegistry("runtime topology")
RUNTIMES.register("inline", "spade.runtime.inline:InlineRuntime")
RUNTIMES.register("colocated", "spade.runtime.asyncrt:AsyncRuntime")
RUNTIMES.register("local", "spade.runtime.asyncrt:AsyncRuntime")
RUNTIMES.register("multiprocess", "spade.runtime.asyncrt:AsyncRuntime")


def build_runtime(cfg, backend, policy) -> Runtime:
    return RUNTIMES.get(cfg.runtime.topology)(cfg, backend, policy)


__all__ = ["RUNTIMES", "Runtime", "GenerationTrace", "build_runtime"]

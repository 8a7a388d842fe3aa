"""Serving: many requests of their own lengths over one batch (continuous batching),
streamed through an asyncio API that follows vLLM's conventions.

>>> import spade                                             # doctest: +SKIP
>>> engine = spade.AsyncEngine(spade.load_config("configs/cpu_tiny.yaml"))
>>> async for out in engine.generate("Hello", spade.SamplingParams(max_tokens=8), "r1"):
...     print(out.delta_text, end="")

Modules load on first use (``spade.serving.params`` has no torch import).
"""

from __future__ import annotations

from spade.serving.params import RequestOutput, RequestOutputKind, SamplingParams

_LAZY = {"AsyncEngine": "spade.serving.engine"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'spade.serving' has no attribute {name!r}")


__all__ = ["AsyncEngine", "RequestOutput", "RequestOutputKind", "SamplingParams"]

"""spade: asynchronous query-aware sparse decoding (AsyncSpade) for long-reasoning LLMs.

>>> import spade
>>> cfg = spade.load_config(None, overrides=["policy.budget=128"])
>>> cfg.policy.name, cfg.policy.budget
('asyncspade', 128)

Heavy modules (torch models, transports) load lazily on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

from spade.config import SpadeConfig, load_config  # noqa: E402  (light: pydantic + yaml)
from spade.errors import ConfigError, SpadeError  # noqa: E402

if TYPE_CHECKING:  # pragma: no cover
    from spade.engine import Engine, GenerationResult, run

_LAZY = {"Engine": "spade.engine", "GenerationResult": "spade.engine", "run": "spade.engine"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'spade' has no attribute {name!r}")


__all__ = ["SpadeConfig", "load_config", "Engine", "GenerationResult", "run", "SpadeError", "ConfigError",
           "__version__"]

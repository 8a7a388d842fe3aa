"""spade: asynchronous query-aware sparse decoding (AsyncSpade) for long-reasoning LLMs.

>>> import spade
>>> cfg = spade.load_config(None, overrides=["policy.budget=128"])
>>> cfg.policy.name, cfg.policy.budget
('asyncspade', 128)

Every module loads on first use (``spade.load_config`` brings pydantic; ``spade.Engine``
torch, the models and the transports).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

from spade.errors import ConfigError, SpadeError  # noqa: E402  (no imports of its own)

if TYPE_CHECKING:  # pragma: no cover
    from spade.config import SpadeConfig, load_config
    from spade.engine import Engine, GenerationResult
    from spade.static import run

# Loaded on first use, so that ``import spade.envs`` (read by the kernels) stays light:
# ``spade.config`` brings pydantic, ``spade.engine`` torch and the models.
_LAZY = {"SpadeConfig": "spade.config", "load_config": "spade.config",
         "Engine": "spade.engine", "GenerationResult": "spade.engine", "run": "spade.static",
         "AsyncEngine": "spade.serving", "SamplingParams": "spade.serving", "RequestOutput": "spade.serving",
         "RequestOutputKind": "spade.serving"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'spade' has no attribute {name!r}")


__all__ = ["SpadeConfig", "load_config", "Engine", "GenerationResult", "run", "AsyncEngine", "SamplingParams",
           "RequestOutput", "RequestOutputKind", "SpadeError", "ConfigError", "__version__"]

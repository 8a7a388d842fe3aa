"""Lazy, string-keyed registries.

An entry is a dotted path ``"package.module:Class"`` resolved on first use, so
registering the ``nccl``/``ucx``/``nixl`` transports costs nothing until one is
chosen, and ``import spade`` works without their packages.

>>> reg = LazyRegistry("thing")
>>> reg.register("od", "collections:OrderedDict")
>>> reg.get("od").__name__
'OrderedDict'
"""

from __future__ import annotations

import importlib
from typing import Any, Generic, TypeVar

from spade.errors import ConfigError

T = TypeVar("T")


class LazyRegistry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._paths: dict[str, str] = {}
        self._loaded: dict[str, Any] = {}

    def register(self, name: str, target: str | Any, *, override: bool = False) -> None:
        """Register ``name`` -> ``"module:Attr"`` (lazy) or an object (eager)."""
        if not override and (name in self._paths or name in self._loaded):
            raise ValueError(f"{self.kind} '{name}' is already registered (pass override=True)")
        self._loaded.pop(name, None)
        if isinstance(target, str):
            self._paths[name] = target
        else:
            self._paths.pop(name, None)
            self._loaded[name] = target

    def names(self) -> list[str]:
        return sorted(set(self._paths) | set(self._loaded))

    def path(self, name: str) -> str | None:
        return self._paths.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._paths or name in self._loaded

    def get(self, name: str) -> Any:
        if name in self._loaded:
            return self._loaded[name]
        if name not in self._paths:
            raise ConfigError(
                f"unknown {self.kind} '{name}'; registered: {', '.join(self.names()) or '(none)'}"
            )
        module, _, attr = self._paths[name].partition(":")
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        self._loaded[name] = obj
        return obj

"""Lazy, string-keyed registries.

An entry is a dotted path ``"package.module:Class"`` resolved on first use, so
registering the ``nccl``/``ucx``/``nixl`` transports costs nothing until one is
chosen, and ``import spade`` works without their packages. An entry may also
name its pydantic config class (``config=``), which ``spade.config`` gathers
into the discriminated union of that section.

>>> reg = LazyRegistry("thing")
>>> reg.register("od", "collections:OrderedDict", config="collections:Counter")
>>> reg.get("od").__name__, reg.config("od").__name__
('OrderedDict', 'Counter')
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Generic, TypeVar

from spade.errors import ConfigError

T = TypeVar("T")


class LazyRegistry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._paths: dict[str, str] = {}
        self._loaded: dict[str, Any] = {}
        self._configs: dict[str, str | Any] = {}
        self._listeners: list[Callable[[], None]] = []

    def register(self, name: str, target: str | Any, *, config: str | Any | None = None,
                 override: bool = False) -> None:
        """Register ``name`` -> ``"module:Attr"`` (lazy) or an object (eager), and its
        config class the same way (``config=``: ``"module:Attr"`` or the class)."""
        if not override and (name in self._paths or name in self._loaded):
            raise ValueError(f"{self.kind} '{name}' is already registered (pass override=True)")
        self._loaded.pop(name, None)
        if isinstance(target, str):
            self._paths[name] = target
        else:
            self._paths.pop(name, None)
            self._loaded[name] = target
        if config is None:
            self._configs.pop(name, None)
        else:
            self._configs[name] = config
        self._changed()

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a plugin or a test that registered it)."""
        if name not in self:
            raise ValueError(f"{self.kind} '{name}' is not registered")
        for d in (self._paths, self._loaded, self._configs):
            d.pop(name, None)
        self._changed()

    def on_change(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` after every later ``register``/``unregister``."""
        self._listeners.append(fn)

    def _changed(self) -> None:
        for fn in self._listeners:
            fn()

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
        obj = _resolve(self._paths[name])
        self._loaded[name] = obj
        return obj

    def config(self, name: str) -> Any:
        """The config class registered with ``name`` (imports its module)."""
        if name not in self._configs:
            raise ConfigError(f"{self.kind} '{name}' has no config class; register it with config=")
        target = self._configs[name]
        if isinstance(target, str):
            target = self._configs[name] = _resolve(target)
        return target


def _resolve(path: str) -> Any:
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj

"""Transports: a lazy registry, so ``import spade`` needs none of NCCL, UCX, NIXL.
Each transport module owns its config class; ``spade.config`` builds the
``runtime.transport`` union from here.

>>> from spade.transports import TRANSPORTS
>>> TRANSPORTS.names()
['local', 'nccl', 'nixl', 'ucx']

Importing this package loads no torch: the base classes below load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spade.registry import LazyRegistry

if TYPE_CHECKING:  # pragma: no cover
    from spade.transports.base import WIRE_VERSION, Handshake, Transport

TRANSPORTS: LazyRegistry = LazyRegistry("transport")
TRANSPORTS.register("local", "spade.transports.local:LocalTransport",
                    config="spade.transports.local:LocalTransportConfig")
TRANSPORTS.register("nccl", "spade.transports.nccl:NcclTransport", config="spade.transports.nccl:NcclTransportConfig")
TRANSPORTS.register("ucx", "spade.transports.ucx:UcxTransport", config="spade.transports.ucx:UcxTransportConfig")
TRANSPORTS.register("nixl", "spade.transports.nixl:NixlTransport", config="spade.transports.nixl:NixlTransportConfig")


def availability() -> dict[str, tuple[bool, str]]:
    """name -> (usable here, reason). Never raises."""
    out = {}
    for name in TRANSPORTS.names():
        try:
            cls = TRANSPORTS.get(name)
            out[name] = cls.available()
        except Exception as e:  # a backend module that cannot even import
            out[name] = (False, f"{type(e).__name__}: {e}")
    return out


_BASE = ("Transport", "Handshake", "WIRE_VERSION")


def __getattr__(name: str):
    if name in _BASE:
        from spade.transports import base

        return getattr(base, name)
    raise AttributeError(f"module 'spade.transports' has no attribute {name!r}")


__all__ = ["TRANSPORTS", "Transport", "Handshake", "WIRE_VERSION", "availability"]

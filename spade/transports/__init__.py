"""Transports: a lazy registry, so ``import spade`` needs none of NCCL, UCX, NIXL.

>>> from spade.transports import TRANSPORTS
>>> TRANSPORTS.names()
['local', 'nccl', 'nixl', 'ucx']
"""

from __future__ import annotations

from spade.registry import LazyRegistry
from spade.transports.base import WIRE_VERSION, Handshake, Transport

TRANSPORTS: LazyRegistry = LazyRegistry("transport")
TRANSPORTS.register("local", "spade.transports.local:LocalTransport")
TRANSPORTS.register("nccl", "spade.transports.nccl:NcclTransport")
TRANSPORTS.register("ucx", "spade.transports.ucx:UcxTransport")
TRANSPORTS.register("nixl", "spade.transports.nixl:NixlTransport")


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


__all__ = ["TRANSPORTS", "Transport", "Handshake", "WIRE_VERSION", "availability"]

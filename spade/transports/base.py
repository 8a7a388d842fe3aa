"""The transport contract: tagged tensors between two ranks, into preallocated buffers.

A transport never knows what the tensors mean (the runtime does). One transport
object is one endpoint of a point-to-point link between this rank and one peer.

Life cycle::

    t = TRANSPORTS.get(cfg.name)(cfg, rank=0, world=2, device="cuda:0")
    await t.connect(Handshake(...))        # versioned: both sides must agree
    t.register("sel", [buf0, buf1])        # receive slots, registered once
    await t.send("qkv", [q, k, v])         # returns when the tensors may be reused
    got = await t.recv("sel", into=[buf0, buf1], timeout=5.0)
    await t.close()                        # no leaked threads, ports, registrations

Ordering: messages with the same tag arrive in the order they were sent. With
different tags there is no ordering promise. ``recv`` with ``into`` fills those
tensors (shapes and dtypes must match what was sent) and returns them; without
``into`` it returns new tensors. A ``recv`` that waits longer than ``timeout``
raises ``PeerTimeout``; a peer that closed or died raises ``PeerGone``.

GPU ordering is expressed with CUDA events/streams, never by blocking the host
inside a step: a send of CUDA tensors records the order on the current stream;
a ``recv`` that completes on the device (local peer copies, NCCL) makes the
current stream wait for the data, or ``recv_stream`` when one is set. A runtime
sets ``recv_stream`` to a side stream when a message may arrive long before it
is needed (a selection for the next step): waiting on the compute stream at
arrival would order the current step's remaining work after the peer's.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Sequence

import torch

from spade.errors import TransportError
from spade.streams import indexed_device, stream_scope

#: Wire-format version. Bump when the framing or handshake changes.
#: 1: initial (tagged tensor lists, JSON handshake).
WIRE_VERSION = 1


@dataclass(frozen=True)
class Handshake:
    """What both ends must agree on before any data moves."""

    role: str  # "inference" | "cache"
    version: int = WIRE_VERSION
    layout: dict[str, Any] = field(default_factory=dict)
    """Shapes/dtypes of the messages (e.g. {"qkv": [[8, 32, 128], "bfloat16"], ...})."""

    def digest(self) -> str:
        body = json.dumps({"version": self.version, "layout": self.layout}, sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(s: str) -> "Handshake":
        d = json.loads(s)
        return Handshake(role=d["role"], version=d["version"], layout=d.get("layout", {}))

    def check_peer(self, peer: "Handshake") -> None:
        """Raise ``TransportError`` naming the first mismatch."""
        if peer.version != self.version:
            raise TransportError(
                f"wire version mismatch: this rank speaks v{self.version}, peer v{peer.version}; "
                "run the same spade version on both ranks"
            )
        if peer.role == self.role:
            raise TransportError(f"both ranks claim role {self.role!r}; one must be 'inference', one 'cache'")
        for key in sorted(set(self.layout) | set(peer.layout)):
            a, b = self.layout.get(key), peer.layout.get(key)
            if a != b:
                raise TransportError(f"handshake mismatch for {key!r}: this rank {a}, peer {b}")


def tensor_layout(tensors: Sequence[torch.Tensor]) -> list:
    return [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in tensors]


class Transport(ABC):
    """One endpoint of a point-to-point link. Subclasses: one per file."""

    name: ClassVar[str]
    port_field: ClassVar[str | None] = None
    """The config field of the TCP port the two ranks meet on (None: no port)."""
    port_span: ClassVar[int] = 1
    """Consecutive ports from ``port_field`` a link listens on."""

    def __init__(self, cfg: Any, *, rank: int, world: int = 2, device: str | torch.device = "cpu"):
        self.cfg = cfg
        self.rank = rank
        self.world = world
        self.device = indexed_device(device)
        self.peer_handshake: Handshake | None = None
        self._registered: dict[str, list[torch.Tensor]] = {}
        self.recv_stream: Any = None
        """A ``torch.cuda.Stream`` on this endpoint's device that ``recv`` orders after
        the arriving data (and lands ``into`` copies on) instead of the current stream."""

    def recv_context(self):
        """The stream context ``recv`` lands device-side work in (``recv_stream`` or none)."""
        import contextlib

        if self.recv_stream is not None and self.device.type == "cuda":
            return stream_scope(self.recv_stream)
        return contextlib.nullcontext()

    # -- capability -------------------------------------------------------
    @classmethod
    def available(cls) -> tuple[bool, str]:
        """(usable on this machine, why not / what it will use)."""
        return True, "ok"

    @classmethod
    def on_free_port(cls, cfg: Any) -> tuple[Any, str | None]:
        """``(cfg, None)`` when the link's ports are free here, else ``(a copy of cfg on
        free ports, why the old ones are not)``: a cache rank started again after a loss
        meets on fresh ports when the lost link still holds its own (a process group's
        store that a dead peer's communicator keeps open, a socket in a library's keeping)."""
        from spade.transports._framing import free_port, port_in_use

        if cls.port_field is None:
            return cfg, None
        port = int(getattr(cfg, cls.port_field))
        why = next((f"port {port + i}: {w}" for i in range(cls.port_span) if (w := port_in_use(port + i))), None)
        if why is None:
            return cfg, None
        try:
            p = free_port(span=cls.port_span)  # every port of the span probed as `port_in_use` does
        except OSError as e:
            raise TransportError(f"{cls.name}: no {cls.port_span} free consecutive ports found for a new cache "
                                 f"rank ({e})") from None
        return cfg.model_copy(update={cls.port_field: p}), why

    @classmethod
    def preflight(cls, cfg: Any) -> None:
        """Checks made before a run loads anything (a bound port, ...): raise a
        ``TransportError`` naming the setting to change. Nothing is connected."""

    # -- life cycle -------------------------------------------------------
    @abstractmethod
    async def connect(self, handshake: Handshake) -> Handshake:
        """Connect to the peer, exchange and check handshakes; returns the peer's."""

    def register(self, tag: str, buffers: Sequence[torch.Tensor]) -> None:
        """Pre-register receive slots for ``tag`` (transports that need registration
        pin/register them here, once)."""
        self._registered[tag] = list(buffers)

    @abstractmethod
    async def send(self, tag: str, tensors: Sequence[torch.Tensor]) -> None:
        """Send ``tensors`` under ``tag``; returns when they may be overwritten."""

    @abstractmethod
    async def recv(self, tag: str, into: Sequence[torch.Tensor] | None = None,
                   timeout: float | None = None) -> list[torch.Tensor]:
        """Receive the next message of ``tag`` (into ``into`` or the registered slots)."""

    @abstractmethod
    async def close(self) -> None:
        """Release everything; idempotent."""

    async def abort(self) -> None:
        """Release everything at once, the peer being gone (killed, hung): no goodbye
        to it, no waiting for sends to drain. Idempotent; by default ``close``."""
        await self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

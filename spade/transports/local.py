"""``local``: both endpoints in one process (in-process queues, CUDA streams/events).

Used by the ``colocated`` topology (cache rank on a side stream of the inference
GPU, or the same CPU) and the ``local`` topology (cache rank on another GPU of
this process: peer-to-peer copies over NVLink/PCIe).

Pairing: two endpoints with the same ``channel`` and opposite ranks meet in a
process-wide rendezvous when both ``connect``; each checks the other's
``Handshake`` (``Handshake.check_peer``), so a mismatch fails on both sides.

Data path of ``send`` for a CUDA tensor (never blocks the host):

1. a defensive clone on the sender's stream (so the caller may overwrite its
   tensor right away: later writes on that stream are ordered after the clone);
2. if the receiver lives on another GPU, the clone is copied to it on this
   endpoint's communication stream (after an event recorded on the sender's
   stream), with a dedicated receive stream current on the destination device so
   the copy is not ordered behind the receiver's compute;
3. a CUDA event recorded after the copy travels with the message; ``recv``
   makes the receiving stream wait on it (device-side) before handing out or
   copying the tensors.

CPU tensors stay on the CPU (cloned at ``send``); CUDA tensors arrive on the
receiver's device when it is a GPU, else on the CPU.

``stream``: the stream ``send`` orders after and ``recv`` makes wait, for this
endpoint (default: the current stream of its device at call time). A runtime
that runs the cache rank on a side stream of a shared GPU sets it, because an
``await`` cannot carry a ``torch.cuda.stream`` context safely.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch

from spade.config import ConfigSection
from spade.errors import PeerGone, PeerTimeout, TransportError
from spade.streams import current_stream, stream_scope
from spade.transports.base import Handshake, Transport


@dataclass
class _Msg:
    tensors: list[torch.Tensor]
    events: list[Any]  # torch.cuda.Event to wait on (one per source device involved)


class _Rendezvous:
    """Process-wide meeting point: channel -> {rank: (endpoint, future)}."""

    lock = threading.Lock()
    waiting: dict[str, dict[int, tuple["LocalTransport", asyncio.Future, asyncio.AbstractEventLoop]]] = {}


class LocalTransportConfig(ConfigSection):
    name: Literal["local"] = "local"


class LocalTransport(Transport):
    name = "local"

    def __init__(self, cfg: Any = None, *, rank: int, world: int = 2, device: str | torch.device = "cpu",
                 channel: str = "default", connect_timeout_s: float = 60.0):
        super().__init__(cfg, rank=rank, world=world, device=device)
        if world != 2:
            raise TransportError(f"local transport links exactly two ranks (world=2); got world={world}")
        self.channel = channel
        self.connect_timeout_s = connect_timeout_s
        self.stream: Any = None  # torch.cuda.Stream override (see module docstring)
        self.peer: LocalTransport | None = None
        self.handshake: Handshake | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: dict[str, collections.deque[_Msg]] = collections.defaultdict(collections.deque)
        self._waiters: dict[str, collections.deque[asyncio.Future]] = collections.defaultdict(collections.deque)
        self._closed = False
        self._peer_gone = False
        self._comm_streams: dict[int, Any] = {}  # device index -> send-side copy stream
        self._recv_streams: dict[int, Any] = {}  # device index -> stream current on the destination

    # ------------------------------------------------------------------ capability
    @classmethod
    def available(cls) -> tuple[bool, str]:
        return True, "in-process queues (CUDA streams/events when tensors are on GPUs)"

    # ------------------------------------------------------------------ life cycle
    def _withdraw(self) -> None:
        """Leave the rendezvous of our channel if no peer took us (timeout, cancel)."""
        with _Rendezvous.lock:
            slot = _Rendezvous.waiting.get(self.channel, {})
            if slot.get(self.rank, (None,))[0] is self:
                del slot[self.rank]
                if not slot:
                    _Rendezvous.waiting.pop(self.channel, None)

    async def connect(self, handshake: Handshake) -> Handshake:
        if self._closed:
            raise TransportError("local transport: connect after close")
        if self.peer is not None:
            raise TransportError("local transport: already connected")
        loop = asyncio.get_running_loop()
        self._loop = loop
        self.handshake = handshake
        fut: asyncio.Future = loop.create_future()
        with _Rendezvous.lock:
            slot = _Rendezvous.waiting.setdefault(self.channel, {})
            other = slot.get(1 - self.rank)
            if self.rank in slot:
                raise TransportError(
                    f"local transport: rank {self.rank} is already waiting on channel {self.channel!r}; "
                    "use a distinct channel per link")
            if other is None:
                slot[self.rank] = (self, fut, loop)
            else:
                del slot[1 - self.rank]
                if not slot:
                    del _Rendezvous.waiting[self.channel]
                peer, peer_fut, peer_loop = other
                self._pair(peer)
                peer._pair(self)
                peer_loop.call_soon_threadsafe(_set_result, peer_fut, self)
                fut.set_result(peer)
        try:
            peer = await asyncio.wait_for(fut, self.connect_timeout_s)
        except asyncio.TimeoutError:
            self._withdraw()
            raise PeerTimeout(f"local transport: no peer joined channel {self.channel!r} within "
                              f"{self.connect_timeout_s:.1f}s") from None
        except asyncio.CancelledError:
            self._withdraw()
            raise
        assert peer.handshake is not None
        handshake.check_peer(peer.handshake)
        self.peer_handshake = peer.handshake
        return peer.handshake

    def _pair(self, peer: "LocalTransport") -> None:
        self.peer = peer

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        peer = self.peer
        if peer is not None:
            peer._notify(peer._on_peer_gone)
        self._fail_waiters(TransportError("local transport: closed"))

    # ------------------------------------------------------------------ data
    def _stream_for(self, device: torch.device):
        if self.stream is not None and device.type == "cuda" and self.stream.device_index == device.index:
            return self.stream
        return current_stream(device)

    def _land_stream(self):
        """Where ``recv`` waits for arriving CUDA data: ``recv_stream``, else ``stream``/current."""
        if self.recv_stream is not None and self.device.type == "cuda":
            return self.recv_stream
        return self._stream_for(self.device)

    def _comm_stream(self, device: torch.device):
        idx = device.index if device.index is not None else torch.cuda.current_device()
        s = self._comm_streams.get(idx)
        if s is None:
            s = self._comm_streams[idx] = torch.cuda.Stream(device=torch.device("cuda", idx))
        return s

    def _recv_stream(self, device: torch.device):
        idx = device.index if device.index is not None else torch.cuda.current_device()
        s = self._recv_streams.get(idx)
        if s is None:
            s = self._recv_streams[idx] = torch.cuda.Stream(device=torch.device("cuda", idx))
        return s

    def _stage(self, t: torch.Tensor, dst: torch.device, events: list) -> torch.Tensor:
        """A private copy of ``t`` on the receiver's side (see the module docstring)."""
        if not t.is_cuda:
            return t.detach().clone()
        src_stream = self._stream_for(t.device)  # (its device becomes current with it)
        with stream_scope(src_stream):
            local = t.detach().clone()
            if dst == t.device:
                ev = torch.cuda.Event()
                ev.record(src_stream)
                events.append(ev)
                return local
            ready = torch.cuda.Event()
            ready.record(src_stream)
        comm = self._comm_stream(t.device)
        comm.wait_event(ready)
        local.record_stream(comm)
        if dst.type == "cuda":
            with stream_scope(comm), stream_scope(self._recv_stream(dst)):
                out = local.to(dst, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(comm)
        else:  # a CPU receiver: the copy must be complete before the host reads it
            with stream_scope(comm):
                out = local.to("cpu")
            ev = None
        if ev is not None:
            events.append(ev)
        return out

    async def send(self, tag: str, tensors: Sequence[torch.Tensor]) -> None:
        self._check_open()
        peer = self.peer
        if self._peer_gone:
            raise PeerGone(f"local transport: peer (rank {1 - self.rank}) closed; cannot send {tag!r}")
        dst = peer.device
        events: list = []
        staged = []
        for t in tensors:
            d = dst if (t.is_cuda and dst.type == "cuda") else (torch.device("cpu") if t.is_cuda else t.device)
            staged.append(self._stage(t, d, events))
        peer._notify(peer._deliver, tag, _Msg(staged, events))

    def _notify(self, fn, *args) -> None:
        """Run ``fn`` on this endpoint's loop (directly when already on it)."""
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or running is loop:
            fn(*args)
        else:
            loop.call_soon_threadsafe(fn, *args)

    def _deliver(self, tag: str, msg: _Msg) -> None:
        if self._closed:
            return
        waiters = self._waiters[tag]
        while waiters:
            w = waiters.popleft()
            if not w.done():
                w.set_result(msg)
                return
        self._inbox[tag].append(msg)

    def _on_peer_gone(self) -> None:
        self._peer_gone = True
        self._fail_waiters(PeerGone(f"local transport: peer (rank {1 - self.rank}) closed the link"))

    def _fail_waiters(self, exc: Exception) -> None:
        for dq in self._waiters.values():
            while dq:
                w = dq.popleft()
                if not w.done():
                    w.set_exception(exc)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("local transport: used after close")
        if self.peer is None:
            raise TransportError("local transport: not connected (call connect first)")

    async def recv(self, tag: str, into: Sequence[torch.Tensor] | None = None,
                   timeout: float | None = None) -> list[torch.Tensor]:
        self._check_open()
        box = self._inbox[tag]
        if box:
            msg = box.popleft()
        else:
            if self._peer_gone:
                raise PeerGone(f"local transport: peer (rank {1 - self.rank}) closed; nothing left under {tag!r}")
            fut = self._loop.create_future()
            self._waiters[tag].append(fut)
            try:
                msg = await asyncio.wait_for(fut, timeout) if timeout is not None else await fut
            except asyncio.TimeoutError:
                raise PeerTimeout(f"local transport: no message under {tag!r} within {timeout:.3g}s") from None
            finally:  # a timed-out or cancelled waiter leaves the queue (by identity: no repr, no compare)
                dq = self._waiters[tag]
                for i, w in enumerate(dq):
                    if w is fut:
                        del dq[i]
                        break
        return self._land(tag, msg, into)

    def _land(self, tag: str, msg: _Msg, into: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        dest = list(into) if into is not None else self._registered.get(tag)
        got = msg.tensors
        if dest is not None and len(dest) != len(got):
            raise TransportError(f"local transport: {tag!r} carries {len(got)} tensors, receive slots hold {len(dest)}")
        if msg.events:  # CUDA tensors land on this endpoint's GPU: order its stream after the copies
            stream = self._land_stream()
            for ev in msg.events:
                stream.wait_event(ev)
            for t in got:
                if t.is_cuda:
                    t.record_stream(stream)
        if dest is None:
            return got
        for d, t in zip(dest, got):
            if d.shape != t.shape or d.dtype != t.dtype:
                raise TransportError(f"local transport: {tag!r} slot is {tuple(d.shape)} {d.dtype}, "
                                     f"message is {tuple(t.shape)} {t.dtype}")
            if d.is_cuda:
                land = self._land_stream() if d.device == self.device else self._stream_for(d.device)
                with torch.cuda.device(d.device), stream_scope(land):
                    d.copy_(t, non_blocking=True)
            else:
                d.copy_(t)
        return dest


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def pair(cfg: Any = None, devices: tuple[str | torch.device, str | torch.device] = ("cpu", "cpu"),
         channel: str | None = None) -> tuple[LocalTransport, LocalTransport]:
    """Two unconnected endpoints on a fresh private channel (rank 0, rank 1)."""
    import uuid

    ch = channel or f"pair-{uuid.uuid4().hex}"
    return (LocalTransport(cfg, rank=0, device=devices[0], channel=ch),
            LocalTransport(cfg, rank=1, device=devices[1], channel=ch))

"""UCX transport (``runtime.transport.name: ucx``): tagged messages over ucxx.

One ``UcxTransport`` is one end of a point-to-point UCX link. The cache side
(rank != 0) listens on ``cfg.port``; the inference side (rank 0) connects to
``cfg.host:cfg.port``. UCX picks the fastest path it finds (shared memory or
CMA on one host, RDMA verbs/RoCE across nodes, CUDA IPC between GPUs of one
node, TCP as the fallback); ``UCX_TLS`` / ``UCX_NET_DEVICES`` steer it (see
docs/transports.md).

Wire format (``WIRE_VERSION`` 1). Every message of tag ``T`` with sequence
number ``s`` is sent as UCX tag messages keyed ``(tag_id(T), s, piece)``:
piece 0 is a header (tag id, sequence number, layout of the tensors), pieces
1..n the raw tensor bytes. Keys are unique per message, so UCX matches each
piece to exactly one posted receive: ordering within a tag follows the sequence
numbers, tags never block each other, and any number of messages may be in
flight. Small host messages (<= ``INLINE_MAX`` bytes of payload) travel inside
the header message: one UCX message, one eager send.

Memory: host tensors are sent from and received into their own storage; CUDA
tensors likewise (ucxx built with CUDA moves device memory with cuda_copy,
cuda_ipc or GPUDirect RDMA). Before UCX touches a CUDA tensor the transport
waits, without blocking the event loop, for the work already queued on the
current stream (the producer of a send, the last reader of a receive buffer).

A send returns when its tensors may be reused; large messages use UCX's
rendezvous protocol, so a large send completes only once the peer has posted
the matching ``recv``. Run sends and receives of one rank as concurrent tasks
(as the asynchronous runtime does), not ``await send`` then ``await recv`` on
both ranks at once.

Progress: ucxx's progress thread plus its Python-future notifier thread (no
busy polling). All ``UcxTransport`` objects of a process share ucxx's one
context, bound to the event loop of the first ``connect``; when the last one
closes, ucxx is reset and its threads stop.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import logging
import os
import struct
import traceback
from typing import Any, Awaitable, Literal, Sequence

import torch
from pydantic import Field

from spade.config import ConfigSection
from spade.errors import MissingDependencyError, PeerGone, PeerTimeout, TransportError
from spade.transports._framing import (
    FLAG_INLINE,
    HEADER_CAP,
    alloc,
    byte_view,
    call_quietly,
    check_port_free,
    check_sendable,
    deadline_after,
    layout_of,
    layout_str,
    pack_header,
    remaining,
    stream_ready,
    tag_id,
    unpack_header,
    wait_port_open,
)
from spade.transports.base import WIRE_VERSION, Handshake, Transport

log = logging.getLogger("spade.transports.ucx")

#: Host messages with at most this many payload bytes travel inside the header
#: message (UCX sends them eagerly: one message, no rendezvous round trip).
INLINE_MAX = 4096
#: Reserved tag id of the control messages (handshake, verdict).
_CTL = 0xFFFFFFFF
_CTL_CAP = 1 << 16
#: After the peer is gone, how long a request may still complete (data in flight).
_GONE_GRACE_S = 1.0
_INSTALL = "pip install 'spade[ucx]'  (ucxx-cu12>=0.52; ucxx-cu13 for CUDA 13)"


def _import_ucxx():
    """Import ucxx lazily (``import spade`` must not need it)."""
    # ucxx sets UCX_MEMTYPE_CACHE itself; this UCX build warns that it is unused.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    # SO_REUSEADDR on the listening socket: the cache rank can listen on its port
    # again right after a link closed (the old connection lingers in TIME_WAIT).
    os.environ.setdefault("UCX_TCP_CM_REUSEADDR", "y")
    import ucxx  # noqa: PLC0415 - optional dependency, imported on use

    return ucxx


# --------------------------------------------------------------------------- shared ucxx context
class _Ctx:
    """Reference count of the transports using ucxx's process-wide context."""

    users = 0
    loop: asyncio.AbstractEventLoop | None = None
    owned = False  # we called ucxx.init, so we reset it


def _ctx_acquire(loop: asyncio.AbstractEventLoop):
    ucxx = _import_ucxx()
    if _Ctx.users > 0 and _Ctx.loop is not loop:
        raise TransportError(
            "ucx: all UcxTransport objects of one process must run on one event loop "
            "(ucxx binds its progress to the loop of the first connect)"
        )
    if _Ctx.users == 0:
        try:
            # Python-future completion: requests complete through a notifier thread
            # instead of a busy poll of the event loop (an idle recv costs no CPU).
            ucxx.init(progress_mode=os.environ.get("UCXPY_PROGRESS_MODE", "thread"), enable_python_future=True)
            _Ctx.owned = True
        except RuntimeError:
            # Someone else initialised ucxx in this process: use it as it is.
            _Ctx.owned = False
        _Ctx.loop = loop
    _Ctx.users += 1
    return ucxx


def _ctx_release() -> None:
    _Ctx.users -= 1
    if _Ctx.users > 0:
        return
    loop, _Ctx.loop = _Ctx.loop, None
    if not _Ctx.owned:
        return
    _Ctx.owned = False
    ucxx = _import_ucxx()
    _drop_progress_task(loop)
    _wake_notifier()
    gc.collect()
    try:
        ucxx.reset()  # stops the progress and notifier threads
    except Exception as e:  # noqa: BLE001 - a leak is reported, not fatal
        log.warning("ucx: could not reset ucxx (its threads stay): %s", e)


def _wake_notifier() -> None:
    """Make ucxx's notifier thread see its shutdown now: it otherwise checks only
    every second, and ``ucxx.reset()`` waits for it (1 s per close)."""
    try:
        ctx = _import_ucxx().core._ctx
        if ctx is not None and ctx.notifier_thread is not None:
            ctx.notifier_thread_q.put("shutdown")
            ctx.worker.stop_request_notifier_thread()
    except Exception as e:  # noqa: BLE001 - reset() still stops it, only slower
        log.debug("ucx: could not wake the notifier thread: %s", e)


def _drop_progress_task(loop: asyncio.AbstractEventLoop | None) -> None:
    """Detach ucxx's progress task from ``loop``.

    NOTE: ucxx wraps ``loop.close`` with a closure that holds its progress task,
    and the task holds the UCX worker; while the loop lives, ``ucxx.reset()`` alone
    leaves the worker and its progress thread running (one more thread per
    connect/close cycle on a long-lived loop). Undo the wrap and drop the task so
    the worker is freed. Best effort: these are ucxx internals."""
    if loop is None:
        return
    try:
        from ucxx._lib_async import application_context as _ac  # noqa: PLC0415

        task = _ac.ProgressTasks.pop(loop, None)
        wrapped = loop.__dict__.get("close")
        if isinstance(wrapped, functools.partial) and wrapped.args:
            loop.close = wrapped.args[0]  # type: ignore[method-assign]
        del task
    except Exception as e:  # noqa: BLE001
        log.debug("ucx: could not detach the progress task: %s", e)


def _req(aw: Awaitable) -> asyncio.Task:
    """A ucxx request (``Endpoint.send`` / ``recv``) as a task whose failure keeps no
    frame alive (``_forget_frames``)."""
    task = asyncio.ensure_future(aw)
    task.add_done_callback(_forget_frames)
    return task


def _forget_frames(task: asyncio.Task) -> None:
    """Clear the frames of a failed ucxx request's traceback.

    NOTE: ucxx's C++ request holds its Python future, the future holds the exception
    (``UCXXCanceledError`` when the peer died), the exception's traceback holds the frame
    of ``Endpoint.recv``/``send``, and that frame holds the request: a cycle through
    native code that the garbage collector cannot see. It kept the endpoint and the UCX
    worker (epoll, eventfds, sockets, shm: ~11-16 descriptors) alive after every link
    lost to a dead peer, although ``ucxx.reset()`` had run. Clearing the frames' locals
    breaks it; the exception's type and message stay."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        traceback.clear_frames(exc.__traceback__)


def _buf(t: torch.Tensor) -> Any:
    """What ucxx can send from / receive into: numpy for host, the CUDA tensor itself
    (``__cuda_array_interface__``) for device memory; both as flat bytes."""
    b = byte_view(t)
    return b if b.is_cuda else b.numpy()


class UcxTransportConfig(ConfigSection):
    name: Literal["ucx"] = "ucx"
    host: str = "127.0.0.1"
    port: int = Field(13517, gt=0, lt=65536)
    timeout_s: float = Field(60.0, gt=0)


class UcxTransport(Transport):
    """Tagged tensor messages over UCX (ucxx asyncio API). See the module docstring.

    >>> from spade.transports.ucx import UcxTransportConfig
    >>> t = UcxTransport(UcxTransportConfig(port=13517), rank=1, device="cpu")  # cache side
    >>> t.name
    'ucx'
    """

    port_field = "port"

    name = "ucx"

    def __init__(self, cfg: Any, *, rank: int, world: int = 2, device: str | torch.device = "cpu"):
        super().__init__(cfg, rank=rank, world=world, device=device)
        self._state = "new"  # new -> connected -> closed
        self._ep = None
        self._listener = None
        self._acquired = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._gone: asyncio.Future | None = None  # result: why the peer is gone
        self._broken: str | None = None  # a failure that leaves the link unusable
        self._tx_seq: dict[str, int] = {}
        self._rx_seq: dict[str, int] = {}
        self._rx_locks: dict[str, asyncio.Lock] = {}
        # A header receive that outlived a timed-out recv(): the next recv of the tag
        # picks it up, so a timeout never loses or reorders a message.
        self._rx_pending: dict[str, tuple[asyncio.Task, Any]] = {}

    # -- capability -------------------------------------------------------
    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            ucxx = _import_ucxx()
        except Exception as e:  # noqa: BLE001 - any import failure means unusable
            return False, f"ucxx is not importable ({type(e).__name__}: {e}); {_INSTALL}"
        return True, f"ucxx {ucxx.__version__} (UCX {ucxx.__ucx_version__})"

    @classmethod
    def preflight(cls, cfg: Any) -> None:
        """The listening side's port must be free before the run starts (else the
        inference side would connect to whatever holds it)."""
        check_port_free(str(cfg.host), int(cfg.port), "ucx")

    @property
    def _timeout(self) -> float:
        return float(getattr(self.cfg, "timeout_s", 60.0))

    # -- life cycle -------------------------------------------------------
    async def connect(self, handshake: Handshake) -> Handshake:
        if self._state != "new":
            raise TransportError(f"ucx: connect() on a transport that is {self._state}")
        try:
            _import_ucxx()
        except ImportError as e:
            raise MissingDependencyError("ucxx-cu12", "the ucx transport", _INSTALL) from e
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._gone = loop.create_future()
        deadline = deadline_after(self._timeout)
        try:
            ucxx = _ctx_acquire(loop)
            self._acquired = True
            await self._open(ucxx, deadline)
            peer = await self._exchange_handshake(handshake, deadline)
        except BaseException as e:
            self._state = "closed"
            await self._teardown()
            # Frames of the failed attempt hold ucxx endpoints; clear them so ucxx
            # can be reset and the port is free again.
            traceback.clear_frames(e.__traceback__)
            raise
        self._state = "connected"
        self.peer_handshake = peer
        return peer

    async def _open(self, ucxx, deadline: float | None) -> None:
        """Connect (rank 0) or accept one connection (rank != 0); sets ``self._ep``."""
        loop = asyncio.get_running_loop()
        host, port = str(self.cfg.host), int(self.cfg.port)
        if self.rank == 0:
            await wait_port_open(host, port, deadline, "ucx")
            try:
                self._ep = await asyncio.wait_for(
                    ucxx.create_endpoint(host, port, connect_timeout=max(1.0, remaining(deadline) or 1.0)),
                    remaining(deadline),
                )
            except asyncio.TimeoutError:
                raise PeerTimeout(f"ucx: connecting to {host}:{port} timed out") from None
            except ucxx.exceptions.UCXError as e:
                raise PeerGone(f"ucx: connecting to {host}:{port} failed: {e}") from None
        else:
            got: asyncio.Future = loop.create_future()

            def on_endpoint(ep):
                if got.done():  # one peer per transport: refuse extra connections
                    asyncio.ensure_future(ep.close())
                else:
                    got.set_result(ep)

            check_port_free(host, port, "ucx")  # a clear error, not resets on the peer's side
            try:
                self._listener = ucxx.create_listener(on_endpoint, port=port)
            except ucxx.exceptions.UCXError as e:
                raise TransportError(
                    f"ucx: cannot listen on port {port} ({e}); is it in use? set runtime.transport.port"
                ) from None
            try:
                self._ep = await asyncio.wait_for(got, remaining(deadline))
            except asyncio.TimeoutError:
                raise PeerTimeout(f"ucx: no peer connected to port {port} within {self._timeout:.0f} s") from None
            # Let the listener's handler task retire before the listener goes. (The
            # socket itself lives until the accepted endpoint is closed.)
            for _ in range(3):
                await asyncio.sleep(0)
            self._listener.close()
            self._listener = None
        self._ep.set_close_callback(self._on_close_callback)

    def _on_close_callback(self) -> None:
        """Called by ucxx (progress thread) when the endpoint errors or closes."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._mark_gone, "the peer closed the connection or died")
        except RuntimeError:  # loop closing
            pass

    def _mark_gone(self, why: str) -> None:
        if self._gone is not None and not self._gone.done():
            self._gone.set_result(why)

    async def _ctl_send(self, n: int, obj: dict, deadline: float | None) -> None:
        import numpy as np

        body = json.dumps(obj).encode()
        if len(body) + 4 > _CTL_CAP:
            raise TransportError(f"ucx: control message too large ({len(body)} bytes)")
        buf = np.frombuffer(struct.pack("<I", len(body)) + body, dtype=np.uint8).copy()
        await self._guard(_req(self._ep.send(buf, tag=(_CTL, n, 0))), deadline, "handshake")

    async def _ctl_recv(self, n: int, deadline: float | None) -> dict:
        import numpy as np

        buf = np.zeros(_CTL_CAP, dtype=np.uint8)
        await self._guard(_req(self._ep.recv(buf, tag=(_CTL, n, 0))), deadline, "handshake")
        (length,) = struct.unpack_from("<I", buf, 0)
        return json.loads(bytes(buf[4 : 4 + length]))

    async def _exchange_handshake(self, mine: Handshake, deadline: float | None) -> Handshake:
        """hello both ways, then a verdict both ways: each side learns why the other
        refused, so both raise the same clear error."""
        await self._ctl_send(0, {"transport": "ucx", "handshake": mine.to_json()}, deadline)
        hello = await self._ctl_recv(0, deadline)
        verdict = ""
        peer = None
        try:
            if hello.get("transport") != "ucx":
                raise TransportError(f"peer speaks transport {hello.get('transport')!r}, not 'ucx'")
            peer = Handshake.from_json(hello["handshake"])
            mine.check_peer(peer)
        except TransportError as e:
            verdict = str(e)
        except Exception as e:  # noqa: BLE001 - malformed hello
            verdict = f"malformed handshake from peer: {e}"
        await self._ctl_send(1, {"ok": not verdict, "msg": verdict}, deadline)
        theirs = await self._ctl_recv(1, deadline)
        if verdict:
            raise TransportError(f"ucx handshake refused: {verdict}")
        if not theirs.get("ok"):
            raise TransportError(f"ucx handshake refused by the peer: {theirs.get('msg')}")
        assert peer is not None
        return peer

    # -- helpers ----------------------------------------------------------
    def _check_usable(self, *, peer: bool = True) -> None:
        if self._state != "connected":
            raise TransportError(f"ucx: transport is {self._state}; connect() first" if self._state == "new"
                                 else "ucx: transport is closed")
        if self._broken:
            raise TransportError(f"ucx: link unusable after an earlier failure: {self._broken}")
        why = self._gone_reason() if peer else None
        if why is not None:
            raise PeerGone(f"ucx: {why}")

    def _gone_reason(self) -> str | None:
        g = self._gone
        if g is None or not g.done() or g.cancelled():
            return None
        return g.result()

    def _peer_error(self, e: BaseException, what: str) -> TransportError:
        why = self._gone_reason()
        if why is None and self._ep is not None and not self._ep.alive:
            why = "the peer closed the connection or died"
        if why is not None:
            return PeerGone(f"ucx {what}: {why}")
        return TransportError(f"ucx {what} failed: {type(e).__name__}: {e}")

    async def _guard(self, aw: Awaitable, deadline: float | None, what: str, *,
                     cancel_on_timeout: bool = True):
        """Await ``aw`` (a coroutine or task) racing the deadline and the peer's death."""
        task = asyncio.ensure_future(aw)
        assert self._gone is not None
        done, _ = await asyncio.wait({task, self._gone}, timeout=remaining(deadline),
                                     return_when=asyncio.FIRST_COMPLETED)
        if task not in done and self._gone_reason() is not None:
            # The close callback and request completions reach the loop by different
            # threads: data the peer sent just before closing may still be landing.
            # A request that can no longer complete is cancelled by ucxx at once.
            done, _ = await asyncio.wait({task}, timeout=_GONE_GRACE_S)
        if task in done:
            exc = task.exception()
            if exc is None:
                return task.result()
            await asyncio.sleep(0)  # let a pending close callback land first
            raise self._peer_error(exc, what) from None
        why = self._gone_reason()
        if cancel_on_timeout or why is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if why is not None:
            raise PeerGone(f"ucx {what}: {why}")
        raise PeerTimeout(f"ucx {what}: no answer from the peer in time")

    # -- data -------------------------------------------------------------
    async def send(self, tag: str, tensors: Sequence[torch.Tensor]) -> None:
        import numpy as np

        self._check_usable()
        check_sendable(tag, tensors)
        tensors = list(tensors)
        tid = tag_id(tag)
        # The sequence number is taken before the first await: sends of one tag are
        # numbered in call order even when many run as concurrent tasks.
        seq = self._tx_seq.get(tag, 0)
        self._tx_seq[tag] = seq + 1
        deadline = deadline_after(self._timeout)
        sizes = [t.numel() * t.element_size() for t in tensors]
        total = sum(sizes)
        try:
            if total <= INLINE_MAX and not any(t.is_cuda for t in tensors):
                hdr = pack_header(WIRE_VERSION, tid, seq, tensors, FLAG_INLINE, total)
                msg = np.empty(len(hdr) + total, dtype=np.uint8)
                msg[: len(hdr)] = np.frombuffer(hdr, dtype=np.uint8)
                off = len(hdr)
                for t, n in zip(tensors, sizes):
                    if n:
                        msg[off : off + n] = byte_view(t).numpy()
                    off += n
                await self._guard(_req(self._ep.send(msg, tag=(tid, seq, 0))), deadline, f"send {tag!r}")
                return
            hdr = np.frombuffer(pack_header(WIRE_VERSION, tid, seq, tensors, 0, total), dtype=np.uint8).copy()
            bufs = [_buf(t) for t in tensors]  # validates contiguity before anything is posted
            await stream_ready(tensors, deadline)
            sends = [_req(self._ep.send(hdr, tag=(tid, seq, 0)))]
            sends += [_req(self._ep.send(b, tag=(tid, seq, i + 1))) for i, (b, n) in enumerate(zip(bufs, sizes)) if n]
            await self._guard(asyncio.gather(*sends), deadline, f"send {tag!r}")
        except PeerTimeout as e:
            # The receiver cannot skip a sequence number: a half-sent message
            # leaves this tag unusable.
            self._broken = str(e)
            raise
        except TransportError:
            raise
        except Exception as e:
            self._broken = f"send {tag!r}: {e}"
            raise TransportError(f"ucx send {tag!r} failed: {e}") from e

    def register(self, tag: str, buffers: Sequence[torch.Tensor]) -> None:
        """Receive slots for ``tag``: ``recv(tag)`` without ``into`` fills these.

        UCX registers (pins) memory on first use and caches the registration, so
        receiving into the same buffers every step costs no re-registration."""
        for b in buffers:
            byte_view(b)  # contiguous or a clear error now rather than mid-step
        super().register(tag, buffers)

    async def recv(self, tag: str, into: Sequence[torch.Tensor] | None = None,
                   timeout: float | None = None) -> list[torch.Tensor]:
        # a peer that sent and then closed: what it sent is still delivered (the
        # receive is posted, and _guard reports PeerGone only if nothing lands)
        self._check_usable(peer=False)
        deadline = deadline_after(timeout)
        lock = self._rx_locks.setdefault(tag, asyncio.Lock())
        try:
            await asyncio.wait_for(lock.acquire(), remaining(deadline))
        except asyncio.TimeoutError:
            raise PeerTimeout(f"ucx recv {tag!r}: nothing arrived within {timeout} s") from None
        try:
            return await self._recv_locked(tag, into, deadline, timeout)
        finally:
            lock.release()

    async def _recv_locked(self, tag: str, into, deadline: float | None, timeout) -> list[torch.Tensor]:
        import numpy as np

        tid = tag_id(tag)
        seq = self._rx_seq.get(tag, 0)
        pend = self._rx_pending.get(tag)
        if pend is None:
            hbuf = np.empty(HEADER_CAP + INLINE_MAX, dtype=np.uint8)
            pend = (_req(self._ep.recv(hbuf, tag=(tid, seq, 0))), hbuf)
            self._rx_pending[tag] = pend
        task, hbuf = pend
        try:
            await self._guard(task, deadline, f"recv {tag!r}", cancel_on_timeout=False)
        except PeerTimeout:
            raise PeerTimeout(f"ucx recv {tag!r}: nothing arrived within {timeout} s") from None
        finally:
            if task.done():
                self._rx_pending.pop(tag, None)
        _, flags, htid, hseq, payload, layout, hlen = unpack_header(memoryview(hbuf))
        if htid != tid or hseq != seq:
            self._broken = f"tag {tag!r}: expected message {seq}, got {hseq} of tag id {htid}"
            raise TransportError(f"ucx recv: {self._broken}")
        dest = list(into) if into is not None else self._registered.get(tag)
        mismatch = None
        if dest is not None and layout_of(dest) != layout:
            what = "into" if into is not None else "registered buffers"
            mismatch = (f"ucx recv {tag!r}: {what} {layout_str(layout_of(dest))} do not match the message "
                        f"{layout_str(layout)}")
            dest = None  # drain into scratch so the tag stays in step, then raise
        if dest is None:
            dest = alloc(layout, self.device)
        sizes = [d.numel() * d.element_size() for d in dest]
        if flags & FLAG_INLINE:
            off = hlen
            for d, n in zip(dest, sizes):
                if n:
                    byte_view(d).copy_(torch.from_numpy(hbuf[off : off + n]))
                off += n
        else:
            bufs = [_buf(d) for d in dest]
            await stream_ready(dest, deadline)  # earlier readers of the buffers are done
            recvs = [_req(self._ep.recv(b, tag=(tid, seq, i + 1))) for i, (b, n) in enumerate(zip(bufs, sizes)) if n]
            try:
                await self._guard(asyncio.gather(*recvs), deadline, f"recv {tag!r}")
            except PeerTimeout as e:
                self._broken = f"recv {tag!r}: header arrived but the payload did not ({e})"
                raise
        self._rx_seq[tag] = seq + 1
        if mismatch:
            raise TransportError(mismatch)
        return dest

    # -- teardown ---------------------------------------------------------
    async def close(self) -> None:
        if self._state == "closed":
            return
        self._state = "closed"
        await self._teardown()

    async def _teardown(self) -> None:
        pending = [t for t, _ in self._rx_pending.values()]
        self._rx_pending.clear()
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        ep, self._ep = self._ep, None
        if ep is not None:
            if self._gone is not None and self._gone.done():  # a dead peer cannot answer a close
                call_quietly(ep.abort)
            else:
                try:
                    await asyncio.wait_for(ep.close(), timeout=5.0)
                except Exception:  # noqa: BLE001 - fall back to an abrupt close
                    call_quietly(ep.abort)
            del ep
        lst, self._listener = self._listener, None
        if lst is not None:
            lst.close()
            del lst
        if self._gone is not None and not self._gone.done():
            self._gone.cancel()
        if self._acquired:
            self._acquired = False
            _ctx_release()


__all__ = ["UcxTransport", "INLINE_MAX"]

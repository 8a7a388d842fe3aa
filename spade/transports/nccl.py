"""``nccl``: two processes over ``torch.distributed`` (NCCL between GPUs, gloo for CPU tensors).

One ``NcclTransport`` is one end of a rank-0 / rank-1 link. Three channels:

* **control** (a TCP socket, asyncio streams): every message starts with a
  fixed-size int64 header (magic, kind, tag id, sequence number, and per tensor
  its wire, dtype and shape). Rank 0 listens on ``master_port + 1``
  (``master_port`` itself serves the process group's store). Why not gloo for headers: a gloo point-to-point
  ``Work`` cannot be polled (``is_completed`` stays False until ``wait``), a
  timed-out ``wait`` closes the pair for good, and a thread blocked in ``wait``
  survives ``destroy_process_group`` and aborts the interpreter at exit
  (measured with torch 2.13). A socket gives asyncio-native waits with timeouts,
  and a dead peer shows up at once as end-of-stream (``PeerGone``).
* **cpu** (gloo process group): CPU tensors of a message, ``send``/``recv``
  under gloo tags. The sender posts them before it writes the header, so the
  receiver's wait (in a worker thread, never on the event loop) is bounded.
* **data** (NCCL, only when both ranks are on CUDA): CUDA tensors, on one NCCL
  process group *per direction*. NCCL serialises the point-to-point operations
  of one communicator on one stream, so a send and a receive posted in opposite
  orders on the two ranks of a single communicator can deadlock each other;
  with one group per direction each group only carries one side's sends,
  posted and received in message order. Completion is device-side: ``recv``
  makes the current stream wait on the NCCL receive (``Work.wait``); the host
  never waits for a GPU.

Tags: a tag is hashed to an id in the header and each tag has its own ordered
queue on the receiver (an ordered per-tag sequence): messages of one tag
arrive in send order, different tags are independent.

``send`` clones its tensors (CUDA ones on the current stream, so later writes by
the caller are ordered after the clone), posts non-blocking sends and returns
(small host tensors, up to ``_INLINE_MAX`` bytes, go inline after the header on
the socket instead of through gloo);
at most ``max_inflight`` messages stay unfinished. The receiving pump (an
asyncio task reading the socket) posts payload receives as soon as a header
arrives — into the buffers of a ``recv`` already waiting for that tag, else
into fresh ones — so a sender never waits on the receiver's application logic.

Process groups are standalone (``ProcessGroupGloo`` / ``ProcessGroupNCCL`` on a
``PrefixStore`` of this link's ``TCPStore`` at ``master_addr:master_port``, keys
named by a per-link nonce), never the global default group: several links can
live in one process, and a link never touches a group the application owns
(under torchrun with an initialised default group, its store is reused).

``import spade`` never imports ``torch.distributed``; this module imports it
lazily inside the methods that need it.
"""

from __future__ import annotations

import array
import asyncio
import collections
import gc
import math
import socket
import time
import zlib
import queue
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, Sequence

import logging

import torch
from pydantic import Field

from spade.config import ConfigSection
from spade.errors import PeerGone, PeerTimeout, TransportError
from spade.transports.base import Handshake, Transport

log = logging.getLogger(__name__)

#: header length (int64 words) and its layout
_HDR = 128
_HDR_BYTES = _HDR * 8
_MAGIC = 0x5350_4144  # "SPAD"
_KIND_DATA, _KIND_CLOSE, _KIND_HANDSHAKE = 1, 2, 3
_FIXED = 6  # magic, kind, tag id, seq, n tensors, extra bytes (handshake body length)
_PER_TENSOR = 10  # wire, dtype, ndim, came-from-cuda flag, 6 dims
_MAX_DIMS = 6
_MAX_TENSORS = (_HDR - _FIXED) // _PER_TENSOR
_WIRE_CPU, _WIRE_NCCL, _WIRE_INLINE = 0, 1, 2
_GLOO_TAG = 12
_INLINE_MAX = 64 << 10
"""Host tensors up to this many bytes travel inline: their bytes follow the header on
the socket (the runtime's per-step control and per-pack metadata messages), with no
gloo send / receive and no thread hand-off on either side."""

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}

class _Worker:
    """One daemon thread running blocking calls in order; results come back as
    asyncio futures. Daemon (not a ``ThreadPoolExecutor``), so a call that never
    returns (a gloo wait on a vanished peer) cannot block interpreter exit."""

    def __init__(self, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._t = threading.Thread(target=self._run, name=name, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut, loop = item
            try:
                res, exc = fn(), None
            except BaseException as e:  # handed to the awaiting coroutine
                res, exc = None, e
            try:
                loop.call_soon_threadsafe(_settle, fut, res, exc)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass
            # drop the call (it holds a Work, which holds its process group) before blocking again
            del item, fn, fut, loop, res, exc

    def submit(self, fn) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._q.put((fn, fut, loop))
        return fut

    def stop(self, join_s: float = 5.0) -> None:
        """Stop after the calls already queued; wait up to ``join_s`` for the thread."""
        self._q.put(None)
        if threading.current_thread() is not self._t:
            self._t.join(join_s)


def _settle(fut: asyncio.Future, res, exc) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(res)


def _new_header() -> array.array:
    """A zeroed header: _HDR native int64 words (the receiver reads them back with
    ``torch.frombuffer(..., dtype=torch.int64)`` on the same kind of host)."""
    return array.array("q", bytes(_HDR_BYTES))


def _tag_id(tag: str) -> int:
    return zlib.crc32(tag.encode())


@dataclass
class _Incoming:
    tensors: list[torch.Tensor]
    nccl_works: list[Any]
    cuda_origin: list[bool]
    landed_in: list[torch.Tensor] | None = None  # the waiting recv's `into`, when received in place


@dataclass
class _Waiter:
    future: asyncio.Future
    into: list[torch.Tensor] | None


@dataclass
class _TagQueue:
    inbox: collections.deque = field(default_factory=collections.deque)
    waiters: collections.deque = field(default_factory=collections.deque)


class NcclTransportConfig(ConfigSection):
    name: Literal["nccl"] = "nccl"
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """``auto``: nccl when both ranks are on CUDA, gloo otherwise."""
    master_addr: str = "127.0.0.1"
    master_port: int = Field(29517, gt=0, lt=65536)
    timeout_s: float = Field(60.0, gt=0)


class NcclTransport(Transport):
    """See the module docstring. Extra keyword arguments: ``init_method`` (default
    ``tcp://master_addr:master_port``; ``env://`` under torchrun), ``max_inflight`` and
    ``max_inflight_bytes`` (unfinished sends: messages, and bytes of staged clones)."""

    port_field = "master_port"
    port_span = 2  # the store at master_port, the header socket at master_port + 1

    name = "nccl"

    def __init__(self, cfg: Any = None, *, rank: int, world: int = 2, device: str | torch.device = "cpu",
                 init_method: str | None = None, max_inflight: int = 256, max_inflight_bytes: int = 4 << 30):
        if cfg is None:
            from spade.transports.nccl import NcclTransportConfig

            cfg = NcclTransportConfig()
        super().__init__(cfg, rank=rank, world=world, device=device)
        if world != 2:
            raise TransportError(f"nccl transport links exactly two ranks (world=2); got world={world}")
        if rank not in (0, 1):
            raise TransportError(f"nccl transport: rank must be 0 or 1; got {rank}")
        self.peer_rank = 1 - rank
        self.init_method = init_method or f"tcp://{cfg.master_addr}:{cfg.master_port}"
        self.timeout_s = float(cfg.timeout_s)
        self.max_inflight = max_inflight
        self.max_inflight_bytes = max_inflight_bytes  # staged clones kept until their sends complete
        self.backend_used: str | None = None  # "nccl" | "gloo" once connected
        self._store = None
        self._nonce = ""
        self._cpu_group = None
        self._send_group = None
        self._recv_group = None
        self._groups: list = []
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._server: asyncio.AbstractServer | None = None
        self._queues: dict[int, _TagQueue] = collections.defaultdict(_TagQueue)
        self._pump_task: asyncio.Task | None = None
        self._send_lock: asyncio.Lock | None = None
        self._inflight: collections.deque = collections.deque()  # (gloo futures, nccl works, keep-alive)
        self._recv_worker: _Worker | None = None  # waits of gloo receives (the pump's)
        self._send_worker: _Worker | None = None  # waits of gloo sends
        self._seq_out = 0
        self._seq_in = 0
        self._connected = False
        self._closed = False
        self._gone: TransportError | None = None

    # ------------------------------------------------------------------ capability
    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            import torch.distributed as dist
        except Exception as e:  # pragma: no cover - broken torch build
            return False, f"torch.distributed cannot be imported: {e}"
        if not dist.is_available():
            return False, "this torch build has no torch.distributed"
        if not dist.is_gloo_available():
            return False, "torch.distributed has no gloo backend (needed for CPU tensors and the rendezvous)"
        return True, "torch.distributed: gloo" + (" + nccl" if dist.is_nccl_available() else " (no nccl: CPU only)")

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _dist():
        import torch.distributed as dist

        return dist

    async def _in_thread(self, fn, *args):
        return await self._recv_worker.submit(lambda: fn(*args))

    # ------------------------------------------------------------------ life cycle
    async def connect(self, handshake: Handshake) -> Handshake:
        """Control socket first, then the versioned handshake over it, and only when
        both ranks agree the process groups (so a refused handshake leaves no
        half-made group behind, and a retry cannot meet a stale store)."""
        ok, why = self.available()
        if not ok:
            raise TransportError(f"nccl transport unavailable: {why}")
        if self._connected or self._closed:
            raise TransportError("nccl transport: connect called twice")
        dist = self._dist()
        self._recv_worker = _Worker(f"spade-nccl{self.rank}-recv")
        self._send_worker = _Worker(f"spade-nccl{self.rank}-send")
        to = timedelta(seconds=self.timeout_s)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            await asyncio.wait_for(self._open_socket(), self.timeout_s)
            peer, use_nccl = await asyncio.wait_for(self._handshake(handshake, dist), self.timeout_s)
            self._store = await self._in_thread(self._make_store, dist, to)
            self._cpu_group = await self._in_thread(
                lambda: dist.ProcessGroupGloo(dist.PrefixStore(f"spade/{self._nonce}/cpu", self._store),
                                              self.rank, 2, to))
            if use_nccl:
                up = await self._in_thread(self._make_nccl, dist, "up", to)
                down = await self._in_thread(self._make_nccl, dist, "down", to)
                self._groups += [up, down]
                self._send_group, self._recv_group = (up, down) if self.rank == 0 else (down, up)
                await self._warm_up(dist)
            self.backend_used = "nccl" if use_nccl else "gloo"
        except TransportError:
            await self._abort()
            raise
        except asyncio.TimeoutError:
            await self._abort()
            raise PeerTimeout(f"nccl transport: no peer at {self._ctrl_addr()} within {self.timeout_s:.0f}s "
                              f"(rank {self.rank})") from None
        except BaseException as e:
            await self._abort()
            if isinstance(e, asyncio.CancelledError):
                raise
            raise PeerTimeout(f"nccl transport: could not form the link at {self.init_method} "
                              f"(rank {self.rank}): {type(e).__name__}: {e}") from e
        self.peer_handshake = peer
        self._connected = True
        self._send_lock = asyncio.Lock()
        self._pump_task = asyncio.get_running_loop().create_task(self._pump())
        return peer

    def _ctrl_addr(self) -> tuple[str, int]:
        """Control socket address: the process group's host and ``master_port + 1``
        (``env://``: ``MASTER_ADDR`` / ``MASTER_PORT`` + 1)."""
        import os

        if self.init_method.startswith("tcp://"):
            host, port = self.init_method.removeprefix("tcp://").rsplit(":", 1)
        else:
            host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "29500")
        return ("127.0.0.1" if host == "localhost" else host), int(port) + 1

    def _make_store(self, dist, to):
        """This link's store: a fresh ``TCPStore`` at ``master_addr:master_port`` (rank 0
        hosts it), or, under an initialised default group (torchrun), that group's
        store; keys are namespaced by a per-link nonce from rank 0 either way, and the
        process groups are standalone, so several links can live in one process."""
        import os

        if self.init_method.startswith("tcp://"):
            host, port = self.init_method.removeprefix("tcp://").rsplit(":", 1)
        else:
            if dist.is_initialized():
                return dist.distributed_c10d._get_default_store()
            host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "29500")
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent hosts the store
                return dist.TCPStore(host, int(port), None, False, to)
        return dist.TCPStore(host, int(port), 2, self.rank == 0, to)

    def _make_nccl(self, dist, name: str, to):
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = to
        return dist.ProcessGroupNCCL(dist.PrefixStore(f"spade/{self._nonce}/{name}", self._store), self.rank, 2, opts)

    async def _open_socket(self) -> None:
        host, port = self._ctrl_addr()
        if self.rank == 0:
            accepted: asyncio.Future = asyncio.get_running_loop().create_future()

            def on_conn(reader, writer):
                if not accepted.done():
                    accepted.set_result((reader, writer))
                else:
                    writer.close()

            self._server = await asyncio.start_server(on_conn, host=host, port=port, reuse_address=True)
            try:
                self._reader, self._writer = await accepted
            finally:
                self._server.close()  # one peer per link: stop listening at once
        else:
            while True:  # the listener may not be up yet
                try:
                    self._reader, self._writer = await asyncio.open_connection(host, port)
                    break
                except (ConnectionRefusedError, OSError):
                    await asyncio.sleep(0.05)
        sock = self._writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def _handshake(self, handshake: Handshake, dist) -> tuple[Handshake, bool]:
        """Exchange capabilities and the versioned handshake over the socket; returns
        (peer handshake, whether CUDA tensors go over NCCL)."""
        import json

        want = self.cfg.backend
        import uuid

        mine = {"cuda": self.device.type == "cuda", "nccl": bool(dist.is_nccl_available()), "want": want,
                "handshake": handshake.to_json(), "nonce": uuid.uuid4().hex[:16]}
        body = json.dumps(mine).encode()
        hdr = _new_header()
        hdr[0], hdr[1], hdr[5] = _MAGIC, _KIND_HANDSHAKE, len(body)
        self._writer.write(hdr.tobytes() + body)
        await self._writer.drain()
        raw = await self._read_exact(_HDR_BYTES)
        h = torch.frombuffer(bytearray(raw), dtype=torch.int64).tolist()
        if h[0] != _MAGIC or h[1] != _KIND_HANDSHAKE:
            raise TransportError("nccl transport: the peer did not start with a spade handshake")
        theirs = json.loads((await self._read_exact(h[5])).decode())
        peer = Handshake.from_json(theirs["handshake"])
        handshake.check_peer(peer)  # version, roles, layout
        self._nonce = (mine if self.rank == 0 else theirs)["nonce"]  # names this link's keys in the store
        wants = {want, theirs["want"]}
        both = mine["cuda"] and theirs["cuda"] and mine["nccl"] and theirs["nccl"]
        if "nccl" in wants and "gloo" in wants:
            raise TransportError("nccl transport: one rank asks for backend 'nccl', the other for 'gloo'")
        if "nccl" in wants and not both:
            raise TransportError("nccl transport: backend 'nccl' needs both ranks on CUDA with NCCL "
                                 f"(this rank: {self.device}, peer on CUDA: {theirs['cuda']}); "
                                 "use backend 'auto' or 'gloo'")
        return peer, both and "gloo" not in wants

    async def _warm_up(self, dist) -> None:
        """Create both NCCL communicators now (their first use is collective and slow)."""
        a = torch.ones(1, device=self.device)
        b = torch.empty(1, device=self.device)
        # The first operation on each group creates its communicator, a blocking
        # collective of both ranks: touch the groups in the same order on both
        # ranks ("up" first), or rank 0 blocks in "up" while rank 1 blocks in "down".
        if self.rank == 0:
            ws = self._send_group.send([a], self.peer_rank, 0)  # up
            wr = self._recv_group.recv([b], self.peer_rank, 0)  # down
        else:
            wr = self._recv_group.recv([b], self.peer_rank, 0)  # up
            ws = self._send_group.send([a], self.peer_rank, 0)  # down
        deadline = time.monotonic() + self.timeout_s
        while not (ws.is_completed() and wr.is_completed()):
            if time.monotonic() > deadline:
                raise PeerTimeout("nccl transport: NCCL warm-up exchange timed out")
            await asyncio.sleep(0.001)

    async def _read_exact(self, n: int) -> bytes:
        try:
            return await self._reader.readexactly(n)
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            raise PeerGone(f"nccl transport: peer (rank {self.peer_rank}) is gone "
                           f"(control socket closed: {type(e).__name__})") from None

    async def _abort(self) -> None:
        """Undo a half-made connection."""
        self._closed = True
        await self._teardown(abort=True)

    def _abort_groups(self) -> None:
        """Abort the NCCL communicators: kernels of sends or receives to a peer that is
        gone never finish; an abort ends them (a device sync before it would hang until
        the process group's watchdog kills this process)."""
        for g in self._groups:
            fn = getattr(g, "abort", None)
            if fn is not None:
                try:
                    fn()
                except Exception as e:  # pragma: no cover - best effort at teardown
                    log.debug("process group abort: %s", e)

    async def _teardown(self, abort: bool = False) -> None:
        """``abort``: the peer is gone or a send did not finish: communicators are aborted
        (no graceful shutdown, which waits for the peer)."""
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception:
                pass
        if self._server is not None:
            self._server.close()
        if abort and self.backend_used == "nccl":
            self._abort_groups()
        if self.device.type == "cuda" and self.backend_used == "nccl":
            try:
                torch.cuda.synchronize(self.device)
            except Exception:
                pass
        # The worker threads and every Work must be gone before the groups are
        # destroyed: a ProcessGroupGloo only stops its threads when its last
        # reference goes, and one left for interpreter exit aborts the process.
        for w in (self._recv_worker, self._send_worker):
            if w is not None:
                w.stop()
        for futs, _, _ in self._inflight:  # failed sends to a dead peer: already reported, do not log
            for f in futs:
                if f.done() and not f.cancelled():
                    f.exception()
        self._inflight.clear()
        self._queues.clear()
        groups, self._groups = self._groups, []
        self._cpu_group = self._send_group = self._recv_group = None
        for g in groups:  # standalone groups: NCCL ones are shut down, gloo ones go with their references
            for name in (("abort",) if abort else ("shutdown", "_shutdown", "abort")):
                fn = getattr(g, name, None)
                if fn is not None:
                    try:
                        fn()
                    except Exception as e:  # pragma: no cover - best effort at teardown
                        log.debug("process group %s: %s", name, e)
                    break
        self._store = None
        del groups
        gc.collect()

    async def abort(self) -> None:
        if self._gone is None:
            self._gone = PeerGone(f"nccl transport: the link to rank {self.peer_rank} was dropped")
        await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        if self._connected and self._gone is None:
            try:  # tell the peer, then let our last sends finish (bounded)
                async with self._send_lock:
                    hdr = _new_header()
                    hdr[0], hdr[1] = _MAGIC, _KIND_CLOSE
                    self._writer.write(hdr.tobytes())
                    await asyncio.wait_for(self._writer.drain(), 5.0)
                    await asyncio.wait_for(self._drain_inflight(), min(10.0, self.timeout_s))
            except Exception:
                pass
        self._closed = True
        if self._pump_task is not None:
            self._pump_task.cancel()
            try:
                await self._pump_task
            except BaseException:
                pass
        # a peer that is gone, or sends that did not drain: its communicators are aborted
        dirty = self._gone is not None or bool(self._inflight)
        self._fail_all(TransportError("nccl transport: closed"))
        self._inflight.clear()
        await self._teardown(abort=dirty)

    # ------------------------------------------------------------------ send
    def _prune(self) -> None:
        while self._inflight:
            futs, works, _ = self._inflight[0]
            if not (all(f.done() for f in futs) and all(w.is_completed() for w in works)):
                return
            self._inflight.popleft()
            for f in futs:
                if f.exception() is not None:  # surface errors of finished gloo sends
                    raise PeerGone(f"nccl transport: a send to rank {self.peer_rank} failed: {f.exception()}")

    def _inflight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, _, keep in self._inflight for t in keep)

    async def _drain_inflight(self, keep_msgs: int = 0, keep_bytes: int | None = None) -> None:
        """Wait for the oldest sends until at most ``keep_msgs`` messages (and
        ``keep_bytes`` staged bytes) are unfinished."""
        while self._inflight and (len(self._inflight) > keep_msgs
                                  or (keep_bytes is not None and self._inflight_bytes() > keep_bytes)):
            futs, works, _ = self._inflight[0]
            for f in futs:
                try:
                    await f
                except Exception as e:
                    raise PeerGone(f"nccl transport: a send to rank {self.peer_rank} failed: {e}") from None
            while not all(w.is_completed() for w in works):
                await asyncio.sleep(0.001)
            self._prune()

    def _post_sends(self, tag: str, tensors: list[torch.Tensor], hdr: array.array):
        """Stage and post the payload sends of one message; fill its header. Returns the
        works, the staged tensors to keep until they complete, and the inline bytes."""
        gloo_works, nccl_works, keep, inline = [], [], [], []
        for i, t in enumerate(tensors):
            if t.dim() > _MAX_DIMS:
                raise TransportError(f"nccl transport: tensors of at most {_MAX_DIMS} dims; {tag!r}[{i}] "
                                     f"has {t.dim()}")
            if t.dtype not in _DTYPE_CODE:
                raise TransportError(f"nccl transport: dtype {t.dtype} is not supported ({tag!r}[{i}])")
            wire = _WIRE_NCCL if (t.is_cuda and self._send_group is not None) else _WIRE_CPU
            if wire == _WIRE_CPU and not t.is_cuda and t.numel() * t.element_size() <= _INLINE_MAX:
                wire = _WIRE_INLINE
                inline.append(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            elif wire == _WIRE_NCCL:
                s = t.detach().contiguous().clone()  # on the current stream: the caller may reuse t
                nccl_works.append(self._send_group.send([s], self.peer_rank, 0))
                keep.append(s)
            else:
                s = t.detach().to("cpu", copy=True).contiguous()
                gloo_works.append(self._cpu_group.send([s], self.peer_rank, _GLOO_TAG))
                keep.append(s)
            o = _FIXED + i * _PER_TENSOR
            hdr[o], hdr[o + 1], hdr[o + 2], hdr[o + 3] = wire, _DTYPE_CODE[t.dtype], t.dim(), int(t.is_cuda)
            for j, d in enumerate(t.shape):
                hdr[o + 4 + j] = d
        hdr[5] = sum(len(b) for b in inline)
        return gloo_works, nccl_works, keep, b"".join(inline)

    async def send(self, tag: str, tensors: Sequence[torch.Tensor]) -> None:
        self._check_usable()
        tensors = list(tensors)
        if len(tensors) > _MAX_TENSORS:
            raise TransportError(f"nccl transport: at most {_MAX_TENSORS} tensors per message; got {len(tensors)}")
        async with self._send_lock:
            self._check_usable()
            # a host array, not a tensor: ~50 item writes per message at tensor-indexing cost
            # were ~0.15 ms of host time per message (measured: bench_tpot --host-profile)
            hdr = _new_header()
            hdr[0], hdr[1], hdr[2], hdr[3], hdr[4] = _MAGIC, _KIND_DATA, _tag_id(tag), self._seq_out, len(tensors)
            try:
                gloo_works, nccl_works, keep, inline = self._post_sends(tag, tensors, hdr)
            except TransportError:
                raise
            except Exception as e:  # the backend refuses to send: the peer is gone
                raise PeerGone(f"nccl transport: cannot send {tag!r} to rank {self.peer_rank}: {e}") from None
            self._writer.write(hdr.tobytes() + inline)
            try:
                await asyncio.wait_for(self._writer.drain(), self.timeout_s)
            except asyncio.TimeoutError:
                raise PeerTimeout(f"nccl transport: peer not reading (send of {tag!r})") from None
            except (ConnectionError, OSError) as e:
                raise PeerGone(f"nccl transport: peer (rank {self.peer_rank}) is gone: {e}") from None
            self._seq_out += 1
            futs = [self._send_worker.submit(w.wait) for w in gloo_works]
            self._inflight.append((futs, nccl_works, keep))
            self._prune()
            if len(self._inflight) > self.max_inflight or self._inflight_bytes() > self.max_inflight_bytes:
                try:
                    await asyncio.wait_for(self._drain_inflight(self.max_inflight, self.max_inflight_bytes // 2),
                                           self.timeout_s)
                except asyncio.TimeoutError:
                    raise PeerTimeout(f"nccl transport: rank {self.peer_rank} stopped receiving") from None

    # ------------------------------------------------------------------ receive
    async def _pump(self) -> None:
        try:
            while not self._closed:
                raw = await self._read_exact(_HDR_BYTES)
                h = torch.frombuffer(bytearray(raw), dtype=torch.int64).tolist()
                if h[0] != _MAGIC:
                    raise TransportError(f"nccl transport: corrupt header (magic {h[0]:#x})")
                if h[1] == _KIND_CLOSE:
                    raise PeerGone(f"nccl transport: peer (rank {self.peer_rank}) closed the link")
                if h[1] != _KIND_DATA:
                    raise TransportError(f"nccl transport: unexpected message kind {h[1]}")
                tag_id, seq, n = h[2], h[3], h[4]
                if seq != self._seq_in:
                    raise TransportError(f"nccl transport: message {seq} arrived, expected {self._seq_in}")
                self._seq_in += 1
                await self._land_payload(tag_id, h, n)
        except asyncio.CancelledError:
            return
        except TransportError as e:
            self._gone = e
            self._fail_all(e)
        except Exception as e:  # a failed gloo receive: the peer died mid-message
            self._gone = PeerGone(f"nccl transport: peer (rank {self.peer_rank}) failed: {type(e).__name__}: {e}")
            self._fail_all(self._gone)

    async def _land_payload(self, tag_id: int, h: list[int], n: int) -> None:
        q = self._queues[tag_id]
        waiter = None
        if not q.inbox:
            while q.waiters and q.waiters[0].future.done():
                q.waiters.popleft()
            if q.waiters:
                waiter = q.waiters[0]
        specs = []
        for i in range(n):
            o = _FIXED + i * _PER_TENSOR
            wire, code, ndim, cuda = h[o], h[o + 1], h[o + 2], h[o + 3]
            specs.append((wire, _DTYPES[code], tuple(h[o + 4:o + 4 + ndim]), bool(cuda)))
        into = waiter.into if waiter is not None else None
        direct = into is not None and len(into) == n and all(
            t.shape == shape and t.dtype == dt and t.is_contiguous()
            and ((wire == _WIRE_NCCL and t.is_cuda and t.device == self.device)
                 or (wire != _WIRE_NCCL and not t.is_cuda))
            for t, (wire, dt, shape, _) in zip(into, specs))
        raw = await self._read_exact(h[5]) if h[5] > 0 else b""  # the inline tensors' bytes, in order
        at = 0
        tensors, gloo_works, nccl_works = [], [], []
        for i, (wire, dt, shape, _) in enumerate(specs):
            if wire == _WIRE_INLINE:
                nbytes = math.prod(shape) * dt.itemsize
                t = (torch.frombuffer(bytearray(raw[at:at + nbytes]), dtype=torch.uint8).view(dt).view(shape)
                     if nbytes else torch.empty(shape, dtype=dt))
                at += nbytes
                if direct:
                    into[i].copy_(t)
                    t = into[i]
                tensors.append(t)
                continue
            if direct:
                buf = into[i]
            elif wire == _WIRE_NCCL:
                buf = torch.empty(shape, dtype=dt, device=self.device)
            else:
                buf = torch.empty(shape, dtype=dt)
            if wire == _WIRE_NCCL:
                nccl_works.append(self._recv_group.recv([buf], self.peer_rank, 0))
            else:
                gloo_works.append(self._cpu_group.recv([buf], self.peer_rank, _GLOO_TAG))
            tensors.append(buf)
        for w in gloo_works:  # bounded: the sender posted these before writing the header
            await self._in_thread(w.wait)
        msg = _Incoming(tensors, nccl_works, [s[3] for s in specs], landed_in=into if direct else None)
        while q.waiters and q.waiters[0].future.done():  # the waiter may have timed out meanwhile
            q.waiters.popleft()
            if msg.landed_in is not None:
                msg.landed_in = None  # its buffers are no longer the caller's to fill: keep a copy
                for w in nccl_works:
                    w.wait()
                msg.nccl_works = []
                msg.tensors = [t.clone() for t in tensors]
        if q.waiters and not q.inbox:
            q.waiters.popleft().future.set_result(msg)
        else:
            q.inbox.append(msg)

    def _fail_all(self, exc: Exception) -> None:
        for q in self._queues.values():
            while q.waiters:
                w = q.waiters.popleft()
                if not w.future.done():
                    w.future.set_exception(exc)

    def _check_usable(self) -> None:
        if self._closed:
            raise TransportError("nccl transport: used after close")
        if not self._connected:
            raise TransportError("nccl transport: not connected (call connect first)")
        if self._gone is not None:
            raise self._gone

    async def recv(self, tag: str, into: Sequence[torch.Tensor] | None = None,
                   timeout: float | None = None) -> list[torch.Tensor]:
        if self._closed:
            raise TransportError("nccl transport: used after close")
        if not self._connected:
            raise TransportError("nccl transport: not connected (call connect first)")
        q = self._queues[_tag_id(tag)]
        into = list(into) if into is not None else None
        if q.inbox:
            msg = q.inbox.popleft()
        else:
            if self._gone is not None:
                raise self._gone
            fut = asyncio.get_running_loop().create_future()
            q.waiters.append(_Waiter(fut, into))
            try:
                msg = await asyncio.wait_for(fut, timeout) if timeout is not None else await fut
            except asyncio.TimeoutError:
                raise PeerTimeout(f"nccl transport: no message under {tag!r} within {timeout:.3g}s") from None
        with self.recv_context():
            return self._land(tag, msg, into)

    def _land(self, tag: str, msg, into) -> list[torch.Tensor]:
        for w in msg.nccl_works:
            w.wait()  # the current stream waits for the NCCL receive; the host does not
        if msg.landed_in is not None:
            return msg.landed_in
        got = []
        for t, was_cuda in zip(msg.tensors, msg.cuda_origin):
            if was_cuda and not t.is_cuda and self.device.type == "cuda":
                t = t.to(self.device, non_blocking=True)
            got.append(t)
        dest = into if into is not None else self._registered.get(tag)
        if dest is None:
            return got
        if len(dest) != len(got):
            raise TransportError(f"nccl transport: {tag!r} carries {len(got)} tensors, receive slots hold {len(dest)}")
        for d, t in zip(dest, got):
            if d.shape != t.shape or d.dtype != t.dtype:
                raise TransportError(f"nccl transport: {tag!r} slot is {tuple(d.shape)} {d.dtype}, "
                                     f"message is {tuple(t.shape)} {t.dtype}")
            d.copy_(t, non_blocking=d.is_cuda and t.is_cuda)
        return dest


__all__ = ["NcclTransport"]

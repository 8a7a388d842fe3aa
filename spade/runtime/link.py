"""The runtime link: the inference rank's end of a connection to its cache rank.

``CacheLink`` opens the configured transport and starts the cache rank behind it
(a coroutine of this process for ``colocated``/``local``, ``python -m
spade.runtime.worker`` or torchrun's rank 1 for ``multiprocess``); ``LoopThread``
runs the runtime's event loop when it is driven from inside a running one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import torch

from spade.errors import ConfigError, PeerGone, PeerTimeout, TransportError
from spade.policies.base import Policy
from spade.runtime import protocol as P
from spade.runtime.cache_rank import CacheRank, SharedKV
from spade.streams import indexed_device
from spade.transports.base import Handshake

PROTOCOL = P.PROTOCOL
log = logging.getLogger(__name__)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed, else the default loop."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


# ============================================================================ the link
class LoopThread:
    """A thread running its own event loop (uvloop when installed): where the runtime is
    driven from inside a running event loop, its own loop runs here. Coroutines are
    handed over with ``submit``."""

    def __init__(self, name: str = "spade-runtime") -> None:
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def submit(self, coro) -> asyncio.Future:
        """Run ``coro`` on the thread's loop; an awaitable future of the caller's loop
        (cancelling it cancels the coroutine)."""
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout_s)


class CacheLink:
    """The inference rank's end of a runtime link, and the cache rank behind it
    (a coroutine of this process, or a process). Opened once, reused by every
    generation until ``close``."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.topology = ""
        self.cache_device = torch.device("cpu")
        self.shared: SharedKV | None = None
        self.cache: CacheRank | None = None
        self.cache_task: asyncio.Task | None = None
        self.cache_transport: Any = None
        self.proc: subprocess.Popen | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closed = False
        self.lost = False  # dropped as a lost peer (``abandon``), not closed on purpose

    @classmethod
    async def open(cls, cfg, *, inference_device: torch.device, cache_device: torch.device,
                   policy: Policy | None, topology: str, connect_timeout_s: float = 120.0,
                   restart: bool = False, spare: bool = False) -> "CacheLink":
        """``colocated``/``local``: an in-process cache rank over the local transport;
        ``multiprocess``: spawn (or, under torchrun, meet) the cache process. ``restart``:
        it replaces a lost one, whose link may still hold the configured port; a spawned
        process then meets on free ports (``Transport.on_free_port``). ``spare``: a standby
        beside the live link (``runtime.standby``), on free ports likewise."""
        link = cls()
        link.topology = topology
        link.cache_device = cache_device
        link.loop = asyncio.get_running_loop()
        hs = Handshake(role="inference", layout={"protocol": PROTOCOL})
        if topology in ("colocated", "local"):
            from spade.transports.local import LocalTransport

            ch = f"spade-link-{uuid.uuid4().hex}"
            t0 = LocalTransport(None, rank=0, device=inference_device, channel=ch)
            t1 = LocalTransport(None, rank=1, device=cache_device, channel=ch)
            if topology == "colocated":
                link.shared = SharedKV()
            link.cache = CacheRank(t1, cache_device, policy=policy, shared=link.shared, in_process=True,
                                   shares_gpu=indexed_device(cache_device) == indexed_device(inference_device))
            hs1 = Handshake(role="cache", layout={"protocol": PROTOCOL})
            # the cache rank is a coroutine on this loop (a thread of its own lost to it:
            # docs/tried.md); it runs while the token loop polls the device (wait_device)
            await asyncio.gather(t0.connect(hs), t1.connect(hs1))
            link.cache_task = asyncio.get_running_loop().create_task(link.cache.serve())
            link.transport, link.cache_transport = t0, t1
            return link
        if topology != "multiprocess":
            raise ConfigError(f"runtime.topology: {topology!r} has no cache rank")
        tcfg = cfg.runtime.transport
        if tcfg.name == "local":
            raise ConfigError("runtime.topology=multiprocess needs a cross-process transport: set "
                              "runtime.transport.name to nccl (or ucx, nixl)")
        from spade.transports import TRANSPORTS

        cls_t = TRANSPORTS.get(tcfg.name)
        ok, why = cls_t.available()
        if not ok:
            raise TransportError(f"transport {tcfg.name!r} is not usable here: {why}")
        kw: dict = {}
        if torchrun_world():
            if tcfg.name == "nccl":
                kw["init_method"] = "env://"
        else:
            if spare:
                tcfg, _ = cls_t.on_free_port(tcfg)  # (the live link holds the configured port)
            elif restart:
                tcfg, why = cls_t.on_free_port(tcfg)
                if why is not None:
                    log.warning("the new cache rank meets on %s port %d (%s, still held by the lost link)",
                                tcfg.name, getattr(tcfg, cls_t.port_field), why)
            link.proc = spawn_worker(tcfg, cache_device)
        t = cls_t(tcfg, rank=0, world=2, device=inference_device, **kw)
        try:
            await asyncio.wait_for(link._connect_watching(t, hs), connect_timeout_s)
        except asyncio.TimeoutError:
            link.kill()
            await _close_quietly(t)
            raise PeerTimeout(f"cache process did not connect within {connect_timeout_s:.0f}s") from None
        except BaseException:  # cancelled included (a restart stopped at the end of a generation)
            link.kill()
            await _close_quietly(t)  # its sockets and port
            raise
        link.transport = t
        return link

    async def _connect_watching(self, t, hs) -> None:
        """Connect, but fail fast if the spawned process dies first."""
        task = asyncio.ensure_future(t.connect(hs))
        try:
            while not task.done():
                if self.proc is not None and self.proc.poll() is not None:
                    raise PeerGone(f"the cache process exited (code {self.proc.returncode}) before connecting; "
                                   "see its output above")
                await asyncio.wait([task], timeout=0.2)
            task.result()
        finally:
            if not task.done():  # failed, or cancelled from outside: stop the connect too
                task.cancel()
                try:
                    await task
                except BaseException:
                    pass

    def check(self) -> None:
        """Raise the cache rank's own failure, if it has one: ``TransportError`` with its
        error, or ``PeerGone`` when it stopped (its process exited, its task ended)."""
        if self.cache_task is not None and self.cache_task.done() and not self.closed:
            exc = None if self.cache_task.cancelled() else self.cache_task.exception()
            if exc is not None and not isinstance(exc, PeerGone):
                raise TransportError(f"the cache rank failed: {type(exc).__name__}: {exc}") from exc
            raise PeerGone("the cache rank stopped" + (f" ({exc})" if exc is not None else ""))
        if self.proc is not None and self.proc.poll() is not None:
            raise PeerGone(f"the cache process exited with code {self.proc.returncode}")

    async def abandon(self, timeout_s: float = 15.0) -> None:
        """Drop a lost cache rank at once: kill its process (SIGKILL: it may be hung or
        stopped), cancel its task, close both transport ends (bounded; longer than a
        transport's own close timeouts, so that a close is never cut half-way and its
        resources leak). Nothing is sent."""
        self.closed = True
        self.lost = True
        self.kill()
        if self.cache_task is not None and not self.cache_task.done():
            self.cache_task.cancel()
            try:
                await asyncio.wait_for(self.cache_task, timeout_s)
            except BaseException:
                pass
        for tr in (self.transport, self.cache_transport):
            if tr is not None:
                try:
                    await asyncio.wait_for(tr.abort(), timeout_s)
                except BaseException:
                    pass

    async def close(self, timeout_s: float = 10.0) -> None:
        if self.closed:
            return
        self.closed = True
        t = self.transport
        if t is not None:
            try:
                await asyncio.wait_for(t.send("ctl", [P.cmd(P.SHUTDOWN)]), 2.0)
            except Exception:
                pass
        if self.cache_task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self.cache_task), 2.0)
            except BaseException:
                self.cache_task.cancel()
                try:
                    await self.cache_task
                except BaseException:
                    pass
        if self.proc is not None:
            end = time.monotonic() + timeout_s
            while self.proc.poll() is None and time.monotonic() < end:
                await asyncio.sleep(0.05)
        for tr in (t, self.cache_transport):
            if tr is not None:
                try:
                    await asyncio.wait_for(tr.close(), timeout_s)
                except Exception:
                    pass
        self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(5)
            except Exception:
                pass


async def _close_quietly(t, timeout_s: float = 5.0) -> None:
    try:
        await asyncio.wait_for(t.close(), timeout_s)
    except BaseException:
        pass


def torchrun_world() -> bool:
    """True under torchrun-style env with a world of two (this process is rank 0)."""
    return os.environ.get("WORLD_SIZE") == "2" and "RANK" in os.environ and "MASTER_ADDR" in os.environ


def spawn_worker(tcfg, cache_device: torch.device) -> subprocess.Popen:
    """Start ``python -m spade.runtime.worker`` for rank 1 (the cache rank)."""
    import spade

    root = os.path.dirname(os.path.dirname(os.path.abspath(spade.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmdline = [sys.executable, "-m", "spade.runtime.worker", "--transport", tcfg.model_dump_json(),
               "--device", str(cache_device), "--threads", str(torch.get_num_threads()),
               "--parent-pid", str(os.getpid())]
    return subprocess.Popen(cmdline, env=env)

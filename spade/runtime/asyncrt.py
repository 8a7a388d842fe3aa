"""The asynchronous runtime: selection leaves the critical path (AsyncSpade).

Two coroutines on one asyncio control plane (uvloop when installed):

* the **inference rank** drives ``backend.prefill`` and then, per step,
  ``backend.decode_stages(tokens, ctx, P)``; its selector's ``after`` hook
  copies each layer's (q, k_new, v_new) into a pack buffer (device ops, so CUDA
  graphs capture them), and between packs the coroutine posts the finished pack
  to the cache rank and makes sure the next pack's selection is in place;
  ``selection(layer)`` returns what the cache rank prepared during the previous
  step (plus sinks and the recent window, which covers the tokens the cache rank
  has not seen yet, the current one included);
* the **cache rank** (``spade.runtime.cache_rank``) appends K/V to its full
  store, runs ``policy.observe`` and then ``policy.select`` for step t+1, and
  sends the selection back at once: one whole step of slack.

Topologies, one code path:

* ``colocated``: the cache rank is a coroutine of this process on the inference
  device; on CUDA its work runs on a side stream (ordered with CUDA events by the
  local transport) and, with a static-cache backend, it reads the inference
  rank's own KV cache (no second copy); on CPU both run in one loop;
* ``local``: the cache rank on another device of this process (peer copies on
  the local transport's communication stream); on CPU it degenerates to
  colocated with its own KV store;
* ``multiprocess``: the cache rank in its own process (``python -m
  spade.runtime.worker``, spawned here, or rank 1 under torchrun), over the
  configured transport (``nccl``: NCCL between GPUs, gloo on CPU). It receives
  the policy config, the ``AttentionSpec`` and the shapes, never the weights.

Policies that need the current query (``needs_current_query=True``: quest,
oracle, tova) cannot run ahead: they run synchronously on the inference rank
through this same runtime (no cache rank; the sparse threshold still applies).

Sparse threshold θ: steps whose cache length is ``<= θ_eff = max(θ, budget)``
decode densely. Bootstrap choice: the cache rank gets the prompt's KV and last
W queries right after prefill and every step's q/k/v from then on (dense steps
included), so its policy state equals the inline run's at every step; only the
*use* of selections starts past θ (the cache rank computes them only there).
With a deterministic policy the tokens equal ``InlineRuntime``'s (the tests
check this bit for bit on CPU).

Return modes: ``indices`` (the inference rank attends its own cache through the
index lists), ``kv`` (the cache rank gathers the selected K/V and sends them;
the inference rank attends over that buffer plus sinks and the recent window
of its own cache and merges the two exactly with their log-sum-exps — it keeps
the backend's cache for the dense phase, the recent window and the ``full``
fallback), ``delta`` (only the slots whose index changed since the previous
step travel; both ranks keep slot-aligned index lists).

Late selections (``on_late``): ``wait`` (up to ``late_timeout_s`` per pack, then
that pack attends densely), ``stale`` (the newest selection that did arrive for
that pack; dense when there is none yet), ``full`` (dense attention for that
pack). With CUDA graphs a pack's kind of attention cannot change inside a
captured step, so there ``full`` uses the stale selection when one exists and
waits otherwise (as does ``stale`` without one); the counts say what happened.

A lost cache rank (dead, silent for ``peer_deadline_s`` while a selection is owed,
or its transport broken) is survived in every mode: the inference rank decodes
densely, drops the link (killing its process), opens a new one in the background
and boots it from its own cache (``InferenceSession._supervise``); sparse
selection resumes at the step after the boot. At most ``max_restarts_per_min``
restarts per minute; none under torchrun or with a shared link. The session's
``events`` record each loss and restore with its step and time.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import weakref

import torch

from spade.attention import InlineSelector, ThresholdSelector
from spade.errors import ConfigError, TransportError
from spade.policies.base import Policy
from spade.runtime import protocol as P
from spade.runtime.base import GenerationTrace, Runtime
from spade.runtime.link import CacheLink, LoopThread, new_event_loop, spawn_worker, torchrun_world
from spade.runtime.selector import AsyncAttentionContext, AsyncSelector, is_async_policy, theta_eff
from spade.runtime.session import BOOT_AHEAD, InferenceSession

# The runtime's parts live in link / selector / session; their public names stay importable from here.
__all__ = [
    "AsyncAttentionContext", "AsyncRuntime", "AsyncSelector", "BOOT_AHEAD", "CacheLink", "InferenceSession",
    "InlineSelector", "LoopThread", "PROTOCOL", "ThresholdSelector", "is_async_policy", "new_event_loop",
    "spawn_worker", "theta_eff", "torchrun_world",
]

log = logging.getLogger(__name__)

PROTOCOL = P.PROTOCOL


# ============================================================================ the runtime
class AsyncRuntime(Runtime):
    """``colocated`` / ``local`` / ``multiprocess`` topologies (see the module docstring).

    ``hooks``: ``spade.runtime.protocol.CacheHooks`` for tests (a slow or dying
    cache rank). ``link``: share one opened ``CacheLink`` between runtimes.

    >>> rt = AsyncRuntime(cfg, backend, policy)                 # doctest: +SKIP
    >>> trace = rt.generate(ids, mask, max_new_tokens=64, sample_fn=greedy)
    >>> trace.late_packs, trace.stats["sparse_steps"]
    """

    def __init__(self, cfg, backend, policy: Policy, *, hooks: P.CacheHooks | None = None,
                 link: CacheLink | None = None, loop: asyncio.AbstractEventLoop | None = None):
        super().__init__(cfg, backend, policy)
        rt = cfg.runtime
        self.topology = rt.topology
        if self.topology not in ("colocated", "local", "multiprocess"):
            raise ConfigError(f"AsyncRuntime serves colocated/local/multiprocess, not {self.topology!r}")
        self.pack_layers = P.resolve_pack_layers(rt.pack_layers, backend.spec.n_layers)
        self.return_mode = rt.return_mode
        self.on_late = rt.on_late
        self.late_timeout_s = float(rt.late_timeout_s)
        self.peer_deadline_s = float(rt.peer_deadline_s)
        self.max_restarts_per_min = int(rt.max_restarts_per_min)
        self._restart_times: collections.deque[float] = collections.deque()  # monotonic, the last minute's
        self._restart: asyncio.Task | None = None  # a lost cache rank's successor, handed over by a session
        self.standby = bool(getattr(rt, "standby", False))
        self._standby: asyncio.Task | None = None  # opening (or opened) the spare link (runtime.standby)
        self.hooks = hooks or P.CacheHooks()
        self.sync_policy = not is_async_policy(policy)
        self.theta = theta_eff(rt.sparse_threshold, policy) if not self.sync_policy else int(rt.sparse_threshold)
        self._link = link
        self._owns_link = link is None
        # a shared link lives on the loop that opened it
        self._loop: asyncio.AbstractEventLoop | None = link.loop if link is not None else loop
        self._owns_loop = link is None and loop is None
        self._loop_thread: LoopThread | None = None  # the loop's thread, when run from inside a running loop
        dev = backend.device
        if rt.inference_device not in ("auto", "") and torch.device(rt.inference_device) != torch.device(dev):
            raise ConfigError(f"runtime.inference_device={rt.inference_device!r} but the model is on {dev}; "
                              "set runtime.inference_device to auto or the model's device")
        self.cache_device = self._cache_device(rt.cache_device, dev)
        if self.topology == "local" and self.cache_device == torch.device(dev) and dev.type == "cuda":
            log.warning("runtime.topology=local with the cache rank on the inference GPU: this is colocated "
                        "without a shared cache; give runtime.cache_device another GPU")
        # safety net: a runtime dropped without close() takes its cache process with it
        self._link_box: list = [None]
        self._finalizer = weakref.finalize(self, _kill_box, self._link_box)

    def restart_refusal(self) -> str | None:
        """Why a lost cache rank may not be restarted now (None: it may)."""
        if not self._owns_link:
            return "its link is shared with another runtime, which owns it"
        if self.topology == "multiprocess" and torchrun_world():
            return "under torchrun the launcher owns the cache rank's process"
        if self.max_restarts_per_min == 0:
            return "runtime.max_restarts_per_min=0"
        now = time.monotonic()
        while self._restart_times and now - self._restart_times[0] > 60.0:
            self._restart_times.popleft()
        if len(self._restart_times) >= self.max_restarts_per_min:
            return (f"{len(self._restart_times)} restarts in the last minute, the cap "
                    f"(runtime.max_restarts_per_min={self.max_restarts_per_min})")
        return None

    def note_restart(self) -> None:
        self._restart_times.append(time.monotonic())

    def _cache_device(self, name: str, inf: torch.device) -> torch.device:
        if name not in ("auto", ""):
            d = torch.device(name)
            if self.topology == "colocated" and d != torch.device(inf):
                raise ConfigError(f"runtime.cache_device={name!r}: colocated puts the cache rank on the "
                                  f"inference device ({inf}); use topology local for another device")
            return d
        if self.topology == "colocated" or inf.type != "cuda":
            return torch.device(inf)
        if torch.cuda.device_count() >= 2:
            other = 1 if (inf.index or 0) == 0 else 0
            return torch.device("cuda", other)
        return torch.device(inf)

    # ------------------------------------------------------------------ public API
    def generate(self, input_ids, attention_mask, *, max_new_tokens, sample_fn, on_token=None) -> GenerationTrace:
        """The synchronous API: runs ``agenerate`` to completion on the runtime's own event
        loop — in this thread, or, when called from inside a running event loop (a
        notebook, an async application's synchronous helper), on a loop thread of the
        runtime's (``await runtime.agenerate(...)`` avoids blocking that loop)."""
        return self.run(self.agenerate(input_ids, attention_mask, max_new_tokens=max_new_tokens,
                                       sample_fn=sample_fn, on_token=on_token))

    async def agenerate(self, input_ids, attention_mask, *, max_new_tokens, sample_fn,
                        on_token=None) -> GenerationTrace:
        be = self.backend
        ids = input_ids.to(be.device)
        mask = attention_mask.to(be.device) if attention_mask is not None else None
        sess = await self.session()
        try:
            logits = await sess.begin(lambda ctx: be.prefill(ids, mask, ctx), batch=ids.shape[0],
                                      max_new_tokens=max_new_tokens)
            rows, times = await sess.token_loop(logits, max_new_tokens=max_new_tokens, sample_fn=sample_fn,
                                                on_token=on_token)
        except BaseException:
            await sess.abort()
            raise
        await sess.end()
        return sess.trace(rows, times)

    async def session(self, selector: AsyncSelector | None = None) -> "InferenceSession":
        """A generation session (``begin`` / ``step`` / ``end``): the benchmark drives
        one directly to time steady-state steps. ``selector``: the session's
        ``AsyncSelector`` (serving keeps one, and its attention context, for every
        epoch: CUDA graphs key on them); None: a new one."""
        if self.sync_policy:
            return InferenceSession(self, None, selector)
        pending, self._restart = self._restart, None
        if pending is not None and not pending.done():
            # a cache rank lost in an earlier generation whose successor is still coming up
            # (a process spawns for seconds; serving epochs and short generations end sooner):
            # this generation starts dense and adopts the restart instead of starting another
            sess = InferenceSession(self, self._link, selector)
            sess.adopt_restart(pending)
            return sess
        restored = False
        if pending is not None:  # it came up (or failed) between generations
            exc = None if pending.cancelled() else pending.exception()
            restored = not pending.cancelled() and exc is None
            if exc is not None:
                log.warning("restarting the cache rank failed (%s: %s)", type(exc).__name__, exc)
        if self._link is not None and self._owns_link and self._link.closed and self._link.lost:
            # lost in an earlier generation and not replaced (restart refused by the cap, or it
            # failed): this generation starts dense, its supervisor restarts (within the cap).
            # (A link closed on purpose, e.g. by a generation that failed on this side, is
            # reopened below, as on first use.)
            sess = InferenceSession(self, self._link, selector)
            sess.start_lost("the cache rank was lost in an earlier generation and not replaced yet", new_loss=False)
            return sess
        link = await self.link()
        if self._owns_link:
            try:
                link.check()
            except TransportError as e:  # it died between generations: a new one
                log.warning("the cache rank was lost between generations (%s); starting a new one", e)
                await link.abandon()
                try:
                    link = await self.link(restart=True)
                except TransportError as e2:  # not back: this generation starts dense, its supervisor retries
                    log.warning("starting a new cache rank failed (%s); decoding densely until one is up", e2)
                    sess = InferenceSession(self, link, selector)
                    sess.start_lost(f"{type(e2).__name__}: {e2}")
                    return sess
        sess = InferenceSession(self, link, selector)
        if restored:
            sess.restored_before_start()
        return sess

    def hand_over_restart(self, task: asyncio.Task) -> None:
        """A session ended while its lost cache rank's successor was still coming up: the
        next session adopts ``task`` (``close`` cancels it, killing a half-open process)."""
        self._restart = task

    async def _drop_restart(self) -> None:
        task, self._restart = self._restart, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except BaseException:
            pass

    async def link(self, *, restart: bool = False) -> CacheLink:
        """The open link (opened on first need). ``restart``: opened to replace a lost
        cache rank (see ``CacheLink.open``); with ``runtime.standby`` it takes the spare
        link when that one is alive. Either way a new spare is then started."""
        if self._link is None or self._link.closed:
            spare = await self._take_standby() if restart else None
            self._link = spare or await self._open(restart=restart)
            self._owns_link = True
            self._link_box[0] = self._link
            self._start_standby()
        return self._link

    async def _open(self, *, restart: bool = False, spare: bool = False) -> CacheLink:
        return await CacheLink.open(self.cfg, inference_device=self.backend.device, cache_device=self.cache_device,
                                    policy=self.policy if self.topology != "multiprocess" else None,
                                    topology=self.topology, connect_timeout_s=max(120.0, self.peer_deadline_s),
                                    restart=restart, spare=spare)

    # ------------------------------------------------------------------ the spare cache process
    def _start_standby(self) -> None:
        """``runtime.standby``: spawn and connect a spare cache process in the background
        (multiprocess, an owned link, not under torchrun), unless one is there."""
        if not (self.standby and self.topology == "multiprocess" and self._owns_link) or torchrun_world():
            return
        if self._standby is None:
            self._standby = asyncio.get_running_loop().create_task(self._open_spare())

    async def _open_spare(self) -> CacheLink:
        link = await self._open(spare=True)
        self._link_box.append(link)  # (the finalizer's safety net kills it too)
        return link

    async def _take_standby(self) -> CacheLink | None:
        """The spare link, alive (waited for if it is still coming up: it started before
        the loss, so it is never later than a new spawn), or None."""
        task, self._standby = self._standby, None
        if task is None:
            return None
        try:
            link = await task
        except Exception as e:
            log.warning("the spare cache process did not come up (%s: %s); spawning a new one", type(e).__name__, e)
            return None
        try:
            link.check()
        except TransportError as e:
            log.warning("the spare cache process is gone (%s); spawning a new one", e)
            await link.abandon()
            return None
        log.info("a lost cache rank is replaced by the spare cache process (pid %s)",
                 link.proc.pid if link.proc is not None else "?")
        return link

    async def _drop_standby(self) -> None:
        """Close the spare link (SHUTDOWN to its process), or stop it coming up."""
        task, self._standby = self._standby, None
        if task is None:
            return
        if not task.done():
            task.cancel()  # (a half-open link kills its process)
        try:
            link = await task
        except BaseException:
            return
        await link.close()

    def standby_pid(self) -> int | None:
        """The spare cache process's pid once it is connected (None: none, or not yet)."""
        t = self._standby
        if t is None or not t.done() or t.cancelled() or t.exception() is not None:
            return None
        proc = t.result().proc
        return proc.pid if proc is not None else None

    def run(self, coro):
        """Run a coroutine on this runtime's loop (for synchronous callers). Inside a
        running event loop the runtime's loop lives on a thread of its own (made on
        first need, kept for the runtime's life: the cache link is bound to it) and the
        caller blocks on the result. So it does with ``runtime.standby`` (multiprocess):
        a spare cache process (and a restart handed over between generations) connects
        in the background, which needs the loop running between generations too (a gloo
        link's store, for one, is served by this side's coroutine)."""
        if self._loop_thread is not None:
            return asyncio.run_coroutine_threadsafe(coro, self._loop_thread.loop).result()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            if self._loop is None and self._owns_loop and self.standby and self.topology == "multiprocess":
                self._loop_thread = LoopThread(name="spade-runtime")
                self._loop = self._loop_thread.loop
                return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
            if self._loop is None:
                self._loop = new_event_loop()
            return self._loop.run_until_complete(coro)
        if self._loop is not None:  # a loop of this thread already holds the link (or was given)
            coro.close()
            raise RuntimeError("AsyncRuntime: called synchronously inside a running event loop, but the runtime's "
                               "link lives on another loop of this thread; use `await runtime.agenerate(...)`")
        self._loop_thread = LoopThread(name="spade-runtime")
        self._loop = self._loop_thread.loop
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        if ((self._restart is not None or self._standby is not None) and self._loop is not None
                and not self._loop.is_closed()):
            try:
                self.run(self._drop_restart())
            except Exception:
                pass
            try:
                self.run(self._drop_standby())
            except Exception:
                pass
        if self._link is not None and self._owns_link and not self._link.closed:
            if self._loop is not None and not self._loop.is_closed():
                try:
                    self.run(self._link.close())
                except Exception:
                    self._link.kill()
            else:
                self._link.kill()
        for spare in self._link_box[1:]:  # spares, the live one among them: killed if their close did not end them
            spare.kill()
        del self._link_box[1:]
        if self._loop_thread is not None:
            self._loop_thread.stop()  # the thread closes its loop
            self._loop_thread = None
        elif self._loop is not None and self._owns_loop and not self._loop.is_closed():
            self._loop.close()
        self._loop = None

    async def aclose(self) -> None:
        await self._drop_restart()
        await self._drop_standby()
        if self._link is not None and self._owns_link:
            await self._link.close()


def _kill_box(box: list) -> None:  # pragma: no cover - garbage-collection safety net
    for link in box:
        if link is not None:
            link.kill()

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

Late selections (``on_late``): ``wait`` (up to ``late_timeout_s``, then
``PeerTimeout``), ``stale`` (the newest selection that did arrive for that pack;
dense when there is none yet), ``full`` (dense attention for that pack). With
CUDA graphs a pack's kind of attention cannot change inside a captured step, so
there ``full`` uses the stale selection when one exists and waits otherwise (as
does ``stale`` without one); the counts say what happened. A dead cache rank
raises ``PeerGone`` with ``wait``; with ``stale``/``full`` the generation goes on
densely (``stats["peer_gone"]``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from spade import kernels
from spade.attention import AttentionContext, InlineSelector, ThresholdSelector  # noqa: F401
from spade.errors import ConfigError, PeerGone, PeerTimeout, TransportError
from spade.kernels.stage import stage_qkv
from spade.policies.base import Policy, Selection
from spade.policies.common import last_token_keys
from spade.runtime import protocol as P
from spade.runtime.base import GenerationTrace, Runtime, _sync
from spade.runtime.cache_rank import CacheRank, SharedKV, delta_apply
from spade.streams import stream_scope
from spade.transports.base import Handshake

log = logging.getLogger(__name__)

PROTOCOL = P.PROTOCOL
#: prompt layers in flight before the cache rank acknowledges (bounds staging memory)
BOOT_AHEAD = 2


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed, else the default loop."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def theta_eff(theta: int, policy: Policy) -> int:
    """Steps with cache length ``<= theta_eff`` decode densely (0 means the budget)."""
    b = policy.budget
    return max(int(theta), int(b)) if b is not None else int(theta)


def is_async_policy(policy: Policy) -> bool:
    """Whether the policy can select one step ahead on a cache rank."""
    return not policy.needs_current_query and policy.budget is not None


# ============================================================================ synchronous path
# ============================================================================ inference rank
class AsyncSelector:
    """The inference rank's ``Selector``: hands out the cache rank's selections and
    stages each layer's (q, k_new, v_new) for the pack message."""

    def __init__(self, spec, packs: list[tuple[int, int]], *, stage_kv: bool, shared: SharedKV | None,
                 return_mode: str):
        self.spec = spec
        self.packs = packs
        self.where = {}  # layer -> (pack, slot in pack)
        for p, (l0, l1) in enumerate(packs):
            for j, layer in enumerate(range(l0, l1)):
                self.where[layer] = (p, j)
        self.stage_kv = stage_kv
        self.shared = shared
        self.return_mode = return_mode
        n = spec.n_layers
        self.cur: list[Selection | None] = [None] * n  # what selection() returns this step
        self.sel: list[Selection | None] = [None] * n  # fixed-buffer selection per layer
        self.idx: list[torch.Tensor | None] = [None] * n  # [B, Hkv, K] int32
        self.k_sel: list[torch.Tensor | None] = [None] * n  # kv mode: [B, Hkv, K, D]
        self.v_sel: list[torch.Tensor | None] = [None] * n
        self.dense_flag = [False] * n  # the cache rank said "no selection" (policy returned None)
        self.key: tuple = ()
        self.seq_len = 0
        self.kv_start: torch.Tensor | None = None
        self.boot: dict[int, tuple] = {}
        self.q_buf: list[torch.Tensor] = []  # per pack [n, B, Hq, D] (views of pack_buf when fused)
        self.k_buf: list[torch.Tensor] = []  # per pack [n, B, Hkv, D]
        self.v_buf: list[torch.Tensor] = []
        self.pack_buf: list[torch.Tensor] = []  # per pack [n, B, Hq + 2 Hkv, D]: one message tensor
        self.kv_lens0: torch.Tensor | None = None
        self.g_lens: torch.Tensor | None = None  # kv mode: [B] = K
        self.slot_ar: torch.Tensor | None = None  # kv mode: [K]
        self.no_idx: torch.Tensor | None = None  # kv mode: [B, Hkv, 1] of -1

    # ------------------------------------------------------------------ Selector protocol
    def begin_step(self, seq_len, kv_start):
        self.seq_len = seq_len
        self.kv_start = kv_start

    def selection(self, layer, q, k_cache, kv_lens):
        return self.cur[layer]

    def after(self, layer, q, k_cache, v_cache, kv_lens):
        p, j = self.where[layer]
        if self.pack_buf and q.dim() == 3 and k_cache.shape[0] == q.shape[0]:
            # one launch: q and the newest k/v row (device-side position) into the pack slot
            stage_qkv(q, k_cache, v_cache, kv_lens, self.pack_buf[p][j])
        else:
            self.q_buf[p][j].copy_(q)
            if self.stage_kv:  # device-side gather at kv_lens - 1: graph-safe
                self.k_buf[p][j].copy_(last_token_keys(k_cache, kv_lens))
                self.v_buf[p][j].copy_(last_token_keys(v_cache, kv_lens))
        if self.shared is not None:
            self.shared.refs[layer] = (k_cache, v_cache)

    def prefill(self, layer, q, k_cache, v_cache, kv_lens):
        if not self.q_buf:
            self.allocate(q.shape[0], q.shape[1], k_cache.shape[1], q.shape[3], q.dtype, k_cache.dtype, q.device)
            self.kv_lens0 = kv_lens.clone()
        self.boot[layer] = (q, k_cache, v_cache)
        if self.shared is not None:
            self.shared.refs[layer] = (k_cache, v_cache)

    # ------------------------------------------------------------------ runtime side
    def graph_key(self) -> tuple:
        return self.key

    def allocate(self, B: int, Hq: int, Hkv: int, D: int, q_dtype, kv_dtype, device) -> None:
        """Per-pack staging buffers. With K/V to ship and one dtype, q, k and v are
        head ranges of one [n, B, Hq + 2 Hkv, D] tensor: one message tensor per pack
        (one NCCL send instead of three)."""
        self.q_buf, self.k_buf, self.v_buf, self.pack_buf = [], [], [], []
        for l0, l1 in self.packs:
            n = l1 - l0
            if self.stage_kv and q_dtype == kv_dtype:
                buf = torch.zeros(n, B, Hq + 2 * Hkv, D, dtype=q_dtype, device=device)
                self.pack_buf.append(buf)
                self.q_buf.append(buf[:, :, :Hq])
                self.k_buf.append(buf[:, :, Hq:Hq + Hkv])
                self.v_buf.append(buf[:, :, Hq + Hkv:])
                continue
            self.q_buf.append(torch.zeros(n, B, Hq, D, dtype=q_dtype, device=device))
            if self.stage_kv:
                self.k_buf.append(torch.zeros(n, B, Hkv, D, dtype=kv_dtype, device=device))
                self.v_buf.append(torch.zeros(n, B, Hkv, D, dtype=kv_dtype, device=device))

    def pack_tensors(self, p: int) -> list[torch.Tensor]:
        """The "qkv" message of pack ``p``: [qkv] fused, [q, k, v], or [q] (shared cache)."""
        if self.pack_buf:
            return [self.pack_buf[p]]
        if self.stage_kv:
            return [self.q_buf[p], self.k_buf[p], self.v_buf[p]]
        return [self.q_buf[p]]

    def ensure_buffers(self, layer: int, B: int, H: int, K: int, n_sink: int, n_recent: int, device,
                       kv_dtype=None, D: int = 0, kv_start=None) -> None:
        idx = self.idx[layer]
        if idx is not None and idx.shape == (B, H, K) and self.sel[layer].n_sink == n_sink \
                and self.sel[layer].n_recent == n_recent:
            return
        self.idx[layer] = torch.full((B, H, K), -1, dtype=torch.int32, device=device)
        self.sel[layer] = Selection(indices=self.idx[layer], n_sink=n_sink, n_recent=n_recent, kv_start=kv_start)
        if self.return_mode == "kv":
            self.k_sel[layer] = torch.zeros(B, H, K, D, dtype=kv_dtype, device=device)
            self.v_sel[layer] = torch.zeros(B, H, K, D, dtype=kv_dtype, device=device)
            if self.g_lens is None or self.g_lens.numel() != B or int(self.slot_ar.numel()) != K:
                self.g_lens = torch.full((B,), K, dtype=torch.int64, device=device)
                self.slot_ar = torch.arange(K, dtype=torch.int32, device=device)
                self.no_idx = torch.full((B, H, 1), -1, dtype=torch.int32, device=device)


class AsyncAttentionContext(AttentionContext):
    """``AttentionContext`` whose graph key is the runtime's, and which attends the
    ``kv`` return mode: the gathered middle tokens (sent by the cache rank) and
    the sinks + recent window of the local cache, merged exactly."""

    def graph_key(self) -> tuple:
        return self.selector.graph_key()

    def attend(self, layer, q, k_cache, v_cache, kv_lens):
        s = self.selector
        if s.return_mode != "kv":
            return super().attend(layer, q, k_cache, v_cache, kv_lens)
        sel = s.selection(layer, q, k_cache, kv_lens)
        if sel is None or s.idx[layer].shape[-1] == 0:  # dense, or no middle (streaming): all local
            return super().attend(layer, q, k_cache, v_cache, kv_lens)
        idx = s.idx[layer]  # [B, Hkv, K]
        slots = torch.where(idx >= 0, s.slot_ar, torch.full_like(idx, -1))  # gathered buffer positions
        scale = self.spec.softmax_scale
        stats = self.layer_stats(layer, q, k_cache)  # the two launches add their tokens; one counts the call
        out_a, lse_a = kernels.sparse_decode_attention(q, s.k_sel[layer], s.v_sel[layer], s.g_lens, slots,
                                                       scale=scale, return_lse=True, stats=stats, count_call=False)
        kv_start = sel.kv_start if sel.kv_start is not None else self.kv_start
        out_b, lse_b = kernels.sparse_decode_attention(q, k_cache, v_cache, kv_lens, s.no_idx, n_sink=sel.n_sink,
                                                       n_recent=sel.n_recent, scale=scale, kv_start=kv_start,
                                                       return_lse=True, stats=stats)
        out, _ = kernels.merge_attention_states(out_a, lse_a, out_b, lse_b)
        s.after(layer, q, k_cache, v_cache, kv_lens)
        return out


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

    @classmethod
    async def open(cls, cfg, *, inference_device: torch.device, cache_device: torch.device,
                   policy: Policy | None, topology: str, connect_timeout_s: float = 120.0) -> "CacheLink":
        """``colocated``/``local``: an in-process cache rank over the local transport;
        ``multiprocess``: spawn (or, under torchrun, meet) the cache process."""
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
            link.cache = CacheRank(t1, cache_device, policy=policy, shared=link.shared, in_process=True)
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
            link.proc = spawn_worker(tcfg, cache_device)
        t = cls_t(tcfg, rank=0, world=2, device=inference_device, **kw)
        try:
            await asyncio.wait_for(link._connect_watching(t, hs), connect_timeout_s)
        except asyncio.TimeoutError:
            link.kill()
            raise PeerTimeout(f"cache process did not connect within {connect_timeout_s:.0f}s") from None
        except BaseException:
            link.kill()
            raise
        link.transport = t
        return link

    async def _connect_watching(self, t, hs) -> None:
        """Connect, but fail fast if the spawned process dies first."""
        task = asyncio.ensure_future(t.connect(hs))
        while not task.done():
            if self.proc is not None and self.proc.poll() is not None:
                task.cancel()
                raise PeerGone(f"the cache process exited (code {self.proc.returncode}) before connecting; "
                               "see its output above")
            await asyncio.wait([task], timeout=0.2)
        task.result()

    def check(self) -> None:
        """Raise the cache rank's own failure, if it has one."""
        if self.cache_task is not None and self.cache_task.done() and not self.cache_task.cancelled():
            exc = self.cache_task.exception()
            if exc is not None and not isinstance(exc, PeerGone):
                raise TransportError(f"the cache rank failed: {type(exc).__name__}: {exc}") from exc
        if self.proc is not None and self.proc.poll() is not None:
            raise PeerGone(f"the cache process exited with code {self.proc.returncode}")

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


# ============================================================================ the runtime
@dataclass
class _StepState:
    index: int = 0  # decode steps done
    sparse: bool = False


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
        self.pack_layers = int(rt.pack_layers)
        self.return_mode = rt.return_mode
        self.on_late = rt.on_late
        self.late_timeout_s = float(rt.late_timeout_s)
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

    async def session(self) -> "InferenceSession":
        """A generation session (``begin`` / ``step`` / ``end``): the benchmark drives
        one directly to time steady-state steps."""
        link = None if self.sync_policy else await self.link()
        return InferenceSession(self, link)

    async def link(self) -> CacheLink:
        if self._link is None or self._link.closed:
            self._link = await CacheLink.open(self.cfg, inference_device=self.backend.device,
                                              cache_device=self.cache_device,
                                              policy=self.policy if self.topology != "multiprocess" else None,
                                              topology=self.topology,
                                              connect_timeout_s=max(120.0, self.late_timeout_s))
            self._owns_link = True
            self._link_box[0] = self._link
        return self._link

    def run(self, coro):
        """Run a coroutine on this runtime's loop (for synchronous callers). Inside a
        running event loop the runtime's loop lives on a thread of its own (made on
        first need, kept for the runtime's life: the cache link is bound to it) and the
        caller blocks on the result."""
        if self._loop_thread is not None:
            return asyncio.run_coroutine_threadsafe(coro, self._loop_thread.loop).result()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
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
        if self._link is not None and self._owns_link and not self._link.closed:
            if self._loop is not None and not self._loop.is_closed():
                try:
                    self.run(self._link.close())
                except Exception:
                    self._link.kill()
            else:
                self._link.kill()
        if self._loop_thread is not None:
            self._loop_thread.stop()  # the thread closes its loop
            self._loop_thread = None
        elif self._loop is not None and self._owns_loop and not self._loop.is_closed():
            self._loop.close()
        self._loop = None

    async def aclose(self) -> None:
        if self._link is not None and self._owns_link:
            await self._link.close()


def _kill_box(box: list) -> None:  # pragma: no cover - garbage-collection safety net
    if box[0] is not None:
        box[0].kill()


# ============================================================================ one generation
class InferenceSession:
    """The inference rank's side of one generation."""

    def __init__(self, rt: AsyncRuntime, link: CacheLink | None):
        self.rt = rt
        self.link = link
        self.be = rt.backend
        self.policy = rt.policy
        spec = self.be.spec
        self.spec = spec
        self.P = rt.pack_layers
        self.packs = P.packs_of(spec.n_layers, self.P)
        self.graphs = self.be.device.type == "cuda" and bool(getattr(self.be, "use_cuda_graphs", False))
        self.step_state = _StepState()
        self.late_packs = 0
        self.stats: dict[str, Any] = {
            "topology": rt.topology, "return_mode": rt.return_mode, "on_late": rt.on_late,
            "pack_layers": self.P, "theta": rt.theta, "sync_policy": rt.sync_policy,
            "cache_device": str(rt.cache_device), "sparse_steps": 0, "stale_packs": 0, "full_packs": 0,
            "waited_packs": 0, "wait_s": 0.0, "sel_messages": 0,
        }
        self.host_step_ms: collections.deque[float] = collections.deque(maxlen=4096)
        """Host time inside each ``step()`` (launches, transport, waits for late packs; the
        device runs behind it), newest last: near the TPOT means the host sets the pace."""
        self.arrived = [0] * len(self.packs)  # newest step whose selection reached this host, per pack
        self.ever = [False] * len(self.packs)
        # Selections that arrived but are not applied yet, per pack, in arrival order:
        # (meta rows, message tensors, CUDA event on the landing stream or None). They
        # are applied right before the pack that uses them (``_ensure``), so the
        # compute stream waits for the cache rank's work of step t only at the pack of
        # step t+1 that needs it, never in the middle of step t.
        self.pending: list[list[tuple]] = [[] for _ in self.packs]
        self._land_stream = None  # CUDA: the stream selections land on (``Transport.recv_stream``)
        self._qkv_sent = 0
        self._cache_base = 0
        self._recv_task: asyncio.Task | None = None
        self._recv_error: BaseException | None = None
        self._end_seen: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self.peer_gone: str | None = None
        self.ctx: AttentionContext | None = None
        self.prefill_time_s = 0.0
        self.sel = None if rt.sync_policy else AsyncSelector(spec, self.packs, stage_kv=True, shared=None,
                                                             return_mode=rt.return_mode)

    # ------------------------------------------------------------------ begin
    async def begin(self, prefill_fn: Callable[[AttentionContext], torch.Tensor], *, batch: int,
                    max_new_tokens: int = 0) -> torch.Tensor:
        """Run ``prefill_fn(ctx)`` (dense, reports each layer to ``ctx.prefill``) and
        boot the cache rank. Returns the prefill logits."""
        be = self.be
        if self.rt.sync_policy:
            state = self.policy.new_state(batch, be.device)
            self.ctx = AttentionContext(be.spec, ThresholdSelector(self.policy, state, self.rt.theta),
                                        device=be.device)
            _sync(be.device)
            t0 = time.perf_counter()
            logits = prefill_fn(self.ctx)
            _sync(be.device)
            self.prefill_time_s = time.perf_counter() - t0
            return logits
        link = self.link
        link.check()
        if be.device.type == "cuda":
            self._land_stream = torch.cuda.Stream(device=be.device)
            link.transport.recv_stream = self._land_stream
        if link.cache is not None:
            self._cache_base = link.cache.consumed
        shared = link.shared
        self.sel.shared = shared
        self.ctx = AsyncAttentionContext(be.spec, self.sel, device=be.device)
        _sync(be.device)
        t0 = time.perf_counter()
        logits = prefill_fn(self.ctx)
        _sync(be.device)
        self.prefill_time_s = time.perf_counter() - t0
        if len(self.sel.boot) != self.spec.n_layers:
            raise RuntimeError("the backend's prefill did not report every layer to ctx.prefill; the cache rank "
                               "needs the prompt's KV and queries")
        await self._boot(max_new_tokens)
        self._wake = asyncio.Event()
        self._end_seen = asyncio.Event()
        self._recv_task = asyncio.get_running_loop().create_task(self._receiver())
        return logits

    async def _boot(self, max_new_tokens: int) -> None:
        be, s = self.be, self.sel
        T = be.seq_len
        q0, k0, _ = s.boot[0]
        B, Hq, _, D = q0.shape
        static_len = k0.shape[2] if k0.shape[2] > T else 0  # a growing cache (HF) has exactly T
        # colocated + static cache: the cache rank reads our cache, only queries travel;
        # otherwise (growing caches included) it keeps its own store
        shared_kv = self.link.shared is not None and static_len > 0
        if shared_kv:  # queries only
            s.stage_kv = False
            s.allocate(B, Hq, k0.shape[1], D, q0.dtype, k0.dtype, q0.device)
        else:
            s.shared = None
        rows = self.policy.rows
        W = min(T, rows) if rows else T
        capacity = static_len if static_len else T + max(1, max_new_tokens) + 1
        kv_start = self.ctx.kv_start
        setup = P.Setup(policy=self.policy.describe(), spec=P.spec_to_dict(be.spec), batch=B, prompt_len=T,
                        capacity=capacity, static_len=static_len, dtype=P.dtype_name(k0.dtype),
                        q_dtype=P.dtype_name(q0.dtype), pack_layers=self.P, return_mode=self.rt.return_mode,
                        theta=self.rt.theta, q_tail=W, shared_kv=shared_kv, has_kv_start=kv_start is not None,
                        hooks=self.rt.hooks.to_dict())
        msg = [P.cmd(P.BOOT, B, T), setup.to_tensor(), s.kv_lens0]
        if kv_start is not None:
            msg.append(kv_start)
        await self._send("ctl", msg)
        # The prompt's KV can be most of a GPU: at most BOOT_AHEAD layers travel
        # unacknowledged, so neither side stages the whole cache at once.
        acks = 0
        for layer in range(self.spec.n_layers):
            q, k, v = s.boot[layer]
            q_tail = q[:, :, q.shape[2] - W:].contiguous()
            if shared_kv:
                await self._send("boot", [q_tail])
            else:
                kv = [k[:, :, :T].contiguous()]
                if self.rt.return_mode == "kv":  # values only where the cache rank gathers them
                    kv.append(v[:, :, :T].contiguous())
                await self._send("boot", [q_tail, *kv])
            while layer + 1 - acks > BOOT_AHEAD:
                await self._boot_ack()
                acks += 1
        while acks < self.spec.n_layers:
            await self._boot_ack()
            acks += 1
        s.boot.clear()
        # selection buffers up front (CUDA graphs capture their addresses)
        layout = self.policy.selection_layout()
        if layout is not None:
            K, n_sink, n_recent = layout
            for layer in range(self.spec.n_layers):
                s.ensure_buffers(layer, B, self.spec.n_kv_heads, K, n_sink, n_recent,
                                 be.device, kv_dtype=k0.dtype, D=D, kv_start=kv_start)
        self._kv_dtype, self._B, self._D = k0.dtype, B, D

    async def _boot_ack(self) -> None:
        if self.peer_gone is not None:
            return
        try:
            await self.link.transport.recv("boot_ack", timeout=max(120.0, self.rt.late_timeout_s))
        except TransportError as e:
            await self._on_peer_failure(e)

    # ------------------------------------------------------------------ transport helpers
    async def _send(self, tag: str, tensors: list[torch.Tensor]) -> None:
        if self.peer_gone is not None:
            return
        try:
            await self.link.transport.send(tag, tensors)
        except TransportError as e:
            await self._on_peer_failure(e)

    async def _on_peer_failure(self, e: BaseException) -> None:
        """A dead or failed cache rank: raise with its reason, or (stale/full) go dense."""
        reason = await self._cache_error()
        if self.rt.on_late == "wait" or not isinstance(e, (PeerGone, PeerTimeout, TransportError)):
            if reason:
                raise TransportError(f"the cache rank failed: {reason}") from e
            raise e
        if self.peer_gone is None:
            self.peer_gone = reason or f"{type(e).__name__}: {e}"
            self.stats["peer_gone"] = self.peer_gone
            log.warning("cache rank lost (%s); decoding densely from here (on_late=%s)", self.peer_gone,
                        self.rt.on_late)

    async def _cache_error(self) -> str | None:
        try:
            self.link.check()
        except TransportError as e:
            return str(e)
        try:
            got = await self.link.transport.recv("err", timeout=0.2)
            return P.tensor_text(got[0]).strip().splitlines()[0]
        except Exception:
            return None

    async def _receiver(self) -> None:
        """Apply every arriving selection at once (device copies on the inference
        stream, ordered after the packs already launched), newest wins."""
        t = self.link.transport
        try:
            while True:
                msg = await t.recv("sel")
                meta = msg[0].tolist()
                if meta[0][P.META_PACK] < 0:  # END acknowledged: nothing more this generation
                    if len(msg) > 1:  # the cache rank's host account of the generation
                        self.stats["cache_host"] = P.stats_from_tensor(msg[1])
                    self._end_seen.set()
                    return
                p = meta[0][P.META_PACK]
                if self._land_stream is not None and self.rt.return_mode != "delta":
                    # Copy into the fixed buffers right away, on the landing stream: the
                    # buffers' last readers (pack p of the step before) finished before the
                    # cache rank could produce this message (it waited on that pack's q/k/v),
                    # so only the pack that uses it waits, on the event (no copy on the
                    # compute stream).
                    with torch.cuda.device(self.be.device), stream_scope(self._land_stream):
                        self._apply(meta, msg)
                        ev = torch.cuda.Event()
                        ev.record(self._land_stream)
                    self.pending[p] = [(None, None, ev)]
                else:
                    ev = None
                    if self._land_stream is not None:
                        ev = torch.cuda.Event()
                        ev.record(self._land_stream)
                    if self.rt.return_mode != "delta":  # newest wins; delta messages build on each other
                        self.pending[p].clear()
                    self.pending[p].append((meta, msg, ev))
                self.arrived[p] = max(self.arrived[p], meta[0][P.META_STEP])
                self.ever[p] = True
                self.stats["sel_messages"] += 1
                self._wake.set()
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self._recv_error = e
            self._wake.set()

    def _apply_pending(self, p: int) -> None:
        """Apply pack ``p``'s arrived selections on the compute stream (device-side
        wait on their landing events; no host wait)."""
        q = self.pending[p]
        if not q:
            return
        cur = torch.cuda.current_stream(self.be.device) if self._land_stream is not None else None
        for meta, msg, ev in q:
            if cur is not None:
                cur.wait_event(ev)
            if msg is None:  # already copied into the fixed buffers on the landing stream
                continue
            if cur is not None:
                for t in msg:
                    if t.is_cuda:
                        t.record_stream(cur)
            self._apply(meta, msg)
        q.clear()

    def _apply(self, meta: list[list[int]], msg: list[torch.Tensor]) -> None:
        s = self.sel
        p = meta[0][P.META_PACK]
        l0, _ = self.packs[p]
        mode = self.rt.return_mode
        dev = self.be.device
        with torch.no_grad():
            for j, row in enumerate(meta):
                layer = l0 + j
                if row[P.META_DENSE]:
                    s.dense_flag[layer] = True
                    if s.idx[layer] is not None and mode == "delta":
                        s.idx[layer].fill_(-1)
                    continue
                s.dense_flag[layer] = False
                K = row[P.META_K]
                if K == 0:  # sinks and recent window only (streaming): no indices travelled
                    s.ensure_buffers(layer, self._B, self.spec.n_kv_heads, 0, row[P.META_SINK], row[P.META_RECENT],
                                     dev, kv_dtype=self._kv_dtype, D=self._D, kv_start=self.ctx.kv_start)
                    continue
                if mode == "delta":
                    s.ensure_buffers(layer, self._B, self.spec.n_kv_heads, K, row[P.META_SINK], row[P.META_RECENT],
                                     dev, kv_start=self.ctx.kv_start)
                    delta_apply(s.idx[layer], msg[1][j], msg[2][j])
                    continue
                s.ensure_buffers(layer, self._B, self.spec.n_kv_heads, K, row[P.META_SINK], row[P.META_RECENT],
                                 dev, kv_dtype=self._kv_dtype, D=self._D, kv_start=self.ctx.kv_start)
                s.idx[layer].copy_(msg[1][j], non_blocking=True)
                if mode == "kv":
                    s.k_sel[layer].copy_(msg[2][j], non_blocking=True)
                    s.v_sel[layer].copy_(msg[3][j], non_blocking=True)

    # ------------------------------------------------------------------ one step
    def _use(self, p: int, fresh: bool) -> None:
        """Make pack ``p``'s layers hand out their fixed-buffer selections."""
        self._apply_pending(p)
        s = self.sel
        l0, l1 = self.packs[p]
        for layer in range(l0, l1):
            if s.dense_flag[layer] or s.sel[layer] is None:
                if self.graphs:
                    raise TransportError(
                        f"the cache rank sent no selection for layer {layer} on a sparse step; with CUDA graphs "
                        "every layer of a sparse step needs one (is runtime.sparse_threshold below the budget?)")
                s.cur[layer] = None
            else:
                s.cur[layer] = s.sel[layer]

    def _dense(self, p: int) -> None:
        l0, l1 = self.packs[p]
        for layer in range(l0, l1):
            self.sel.cur[layer] = None

    async def _ensure(self, p: int, step: int) -> None:
        """Put pack ``p``'s selection for ``step`` in place, or apply ``on_late``."""
        if self.peer_gone is not None:
            self._dense(p)
            return
        for _ in range(4):  # let already-delivered messages (and an in-process cache rank) run
            if self.arrived[p] >= step or self._recv_error is not None:
                break
            await asyncio.sleep(0)
        if self._recv_error is not None:
            await self._on_peer_failure(self._recv_error)
            self._dense(p)
            return
        if self.arrived[p] >= step:
            self._use(p, True)
            return
        self.late_packs += 1
        mode = self.rt.on_late
        if mode == "stale" or (mode == "full" and self.graphs):
            if self.ever[p]:
                self.stats["stale_packs"] += 1
                self._use(p, False)
                return
            if not self.graphs:
                self.stats["full_packs"] += 1
                self._dense(p)
                return
        elif mode == "full":
            self.stats["full_packs"] += 1
            self._dense(p)
            return
        # wait (bounded)
        self.stats["waited_packs"] += 1
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.rt.late_timeout_s
        while self.arrived[p] < step:
            if self._recv_error is not None:
                await self._on_peer_failure(self._recv_error)
                self._dense(p)
                return
            try:
                self.link.check()
            except TransportError as e:
                await self._on_peer_failure(e)
                self._dense(p)
                return
            left = deadline - time.monotonic()
            if left <= 0:
                await self._on_peer_failure(PeerTimeout(
                    f"the cache rank did not deliver the selection of step {step} pack {p} within "
                    f"runtime.late_timeout_s={self.rt.late_timeout_s:g}s"))
                self._dense(p)
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), min(left, 0.5))
            except asyncio.TimeoutError:
                pass
        self.stats["wait_s"] += time.perf_counter() - t0
        self._use(p, True)

    async def _yield_to_cache(self) -> None:
        """Let an in-process cache rank launch its work for the pack just posted
        (its coroutine shares this thread: without a yield it would only run when
        this step next waits, i.e. after the step, serialising the two ranks).
        Launching is host work only (asynchronous on the device)."""
        self._qkv_sent += 1
        cache = self.link.cache if self.link is not None else None
        if cache is None:
            return
        for _ in range(32):
            if cache.consumed - self._cache_base >= self._qkv_sent or self.peer_gone is not None:
                return
            if self.link.cache_task is not None and self.link.cache_task.done():
                return
            await asyncio.sleep(0)

    async def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step; returns the logits [B, V]."""
        be, ctx = self.be, self.ctx
        if self.rt.sync_policy:
            return be.decode(tokens, ctx)
        t_host = time.perf_counter()  # host time of the step (it does not wait for the device)
        seq = be.seq_len + 1
        st = self.step_state
        st.index += 1
        step = st.index
        st.sparse = seq > self.rt.theta and self.peer_gone is None
        if st.sparse:
            self.stats["sparse_steps"] += 1
        s = self.sel
        s.key = ("sparse", self.rt.return_mode) if st.sparse else ("dense",)
        if not st.sparse:
            for layer in range(self.spec.n_layers):
                s.cur[layer] = None
        gen = be.decode_stages(tokens, ctx, self.P)
        for p in range(len(self.packs)):
            if st.sparse:  # (a cache rank lost mid-step under graphs: the step's packs keep their buffers)
                await self._ensure(p, step)
            got = next(gen)
            if got != p:
                raise RuntimeError(f"backend yielded pack {got}, expected {p} (pack_layers={self.P})")
            if p == 0:  # after the first pack's launch: the device starts the step while the host sends
                await self._send("ctl", [P.cmd(P.STEP, seq, step)])
            await self._send("qkv", s.pack_tensors(p))
            await self._yield_to_cache()
        for _ in gen:  # exhaust (graph capture happens here on a new key)
            raise RuntimeError("backend yielded more packs than expected")
        self.host_step_ms.append(1e3 * (time.perf_counter() - t_host))
        return be.last_logits

    async def wait_device(self) -> None:
        """Wait until the inference device has run everything launched so far on its
        current stream (the step's logits included) *without blocking the event loop*:
        an event polled between yields, so the receiver (and an in-process cache
        coroutine) keep running while the device finishes the step. With a cache
        thread the wait blocks instead (``Event.synchronize`` releases the GIL to it)."""
        dev = self.be.device
        if dev.type != "cuda":
            return
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(dev))
        while not ev.query():
            await asyncio.sleep(0)

    async def token_loop(self, first_logits: torch.Tensor, *, max_new_tokens: int, sample_fn,
                         on_token=None) -> tuple[list[list[int]], list[float]]:
        """``spade.runtime.base.timed_loop`` with an asynchronous step."""
        B = first_logits.shape[0]
        rows: list[list[int]] = [[] for _ in range(B)]
        times: list[float] = []
        logits = first_logits
        for i in range(max_new_tokens):
            nxt = sample_fn(logits)
            host = nxt.to("cpu")
            for b in range(B):
                rows[b].append(int(host[b]))
            stop = on_token(i, host) if on_token is not None else False
            if stop or i == max_new_tokens - 1:
                break
            await self.wait_device()
            t0 = time.perf_counter()
            logits = await self.step(nxt)
            await self.wait_device()
            times.append(time.perf_counter() - t0)
        return rows, times

    async def end(self) -> None:
        """Tell the cache rank the generation is over and drain its last messages."""
        if self.rt.sync_policy or self.link is None:
            return
        if self.peer_gone is None and self._recv_task is not None and not self._recv_task.done():
            await self._send("ctl", [P.cmd(P.END)])
            if self.peer_gone is None:
                try:
                    await asyncio.wait_for(self._end_seen.wait(), max(10.0, self.rt.late_timeout_s))
                except asyncio.TimeoutError:
                    log.warning("the cache rank did not acknowledge the end of the generation")
        if self._recv_task is not None and not self._recv_task.done():
            self._recv_task.cancel()
            try:
                await self._recv_task
            except BaseException:
                pass
        if self.peer_gone is not None and self.rt._owns_link:
            await self.link.close()

    async def abort(self) -> None:
        """After a failure mid-generation: stop receiving; the cache rank may be
        mid-step, so an owned link is closed (the next generation opens a new one)."""
        if self._recv_task is not None and not self._recv_task.done():
            self._recv_task.cancel()
            try:
                await self._recv_task
            except BaseException:
                pass
        if self.link is not None and self.rt._owns_link:
            try:
                await asyncio.wait_for(self.link.close(timeout_s=5.0), 15.0)
            except BaseException:
                self.link.kill()

    def trace(self, rows: list[list[int]], times: list[float]) -> GenerationTrace:
        self.stats["late_packs"] = self.late_packs
        if self.link is not None and self.link.cache is not None:
            self.stats["cache_rank"] = dict(self.link.cache.stats)
        return GenerationTrace(tokens=rows, step_times_s=times, prefill_time_s=self.prefill_time_s,
                               mean_attended=self.ctx.mean_attended() if self.ctx is not None else 0.0,
                               late_packs=self.late_packs, stats=dict(self.stats))



"""One generation on the inference rank: ``InferenceSession`` (begin / step / end).

Prefill and bootstrap of the cache rank, the per-step pack loop, the receiver of
selections and what happens when one is late or the cache rank is gone (see
``spade.runtime.asyncrt``'s docstring for the modes).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from spade.attention import AttentionContext, ThresholdSelector
from spade.errors import PeerTimeout, TransportError
from spade.runtime import protocol as P
from spade.runtime.base import GenerationTrace, _sync, sample_and_report
from spade.runtime.cache_rank import delta_apply
from spade.runtime.link import CacheLink
from spade.runtime.selector import AsyncAttentionContext, AsyncSelector
from spade.streams import current_stream, stream_scope

if TYPE_CHECKING:
    from spade.runtime.asyncrt import AsyncRuntime

log = logging.getLogger(__name__)

#: prompt layers in flight before the cache rank acknowledges (bounds staging memory)
BOOT_AHEAD = 2


@dataclass
class _StepState:
    index: int = 0  # decode steps done
    sparse: bool = False


class InferenceSession:
    """The inference rank's side of one generation."""

    def __init__(self, rt: AsyncRuntime, link: CacheLink | None, selector: AsyncSelector | None = None):
        self.rt = rt
        self.link = link
        self.be = rt.backend
        self.policy = rt.policy
        self.paged = bool(getattr(self.be, "paged", False))  # a paged KV cache (FastModel, model.block_size)
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
            "waited_packs": 0, "timed_out_packs": 0, "wait_s": 0.0, "sel_messages": 0, "peers_lost": 0,
            "restarts": 0, "dense_fallback_steps": 0, "joins": 0, "leaves": 0, "join_resyncs": 0, "join_wait_s": 0.0,
            "dropped_selections": 0, "packs_landed_whole": 0,
        }
        self.t_start = time.monotonic()
        self.events: list[dict] = []
        """Peer loss and recovery, in order: ``peer_lost``, ``restart_failed``,
        ``peer_restored``, ``no_restart`` (each with the decode step and ``t_s``, seconds
        since the session began)."""
        self.fallback: list[list[int]] = []  # [first, last] decode steps meant sparse that ran dense
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
        # liveness: since when the cache rank has owed an answer with nothing heard from it
        # (set by the first post after its last message, or a boot; cleared by any message)
        self._owed_since: float | None = None
        self._abandon_task: asyncio.Task | None = None  # dropping a lost link
        self._restart_task: asyncio.Task | None = None  # opening its successor
        # serving on a paged cache with a cache rank of its own: the pool size its copies take (a
        # restarted one re-joins the busy rows); and the rows a request decodes in, as last told
        self._pool: tuple[int, int] = (0, 0)  # (num_blocks, block_size) the BOOT carries, or (0, 0)
        self._serving = False  # the cache rank follows a slot batch (a restarted one re-joins its busy rows)
        self._busy: list[bool] = []
        self._no_restart: str | None = None  # why a lost cache rank is not restarted
        self.ctx: AttentionContext | None = None
        self.prefill_time_s = 0.0
        if selector is not None and not rt.sync_policy:  # serving: one selector (and context) for every epoch
            self.sel = selector
        else:
            self.sel = None if rt.sync_policy else AsyncSelector(spec, self.packs, stage_kv=True, shared=None,
                                                                 return_mode=rt.return_mode,
                                                                 rerank=self.policy.rerank_keep(),
                                                                 q_rows=self.policy.rows or 0)
        self.gen = 0
        """Serving: joins sent this session (``join_rows``); selections tagged with an older
        one were made from rows' previous content and are dropped."""

    # ------------------------------------------------------------------ begin
    def _attach(self) -> bool:
        """Before a boot: check the link, give it this session's landing stream (CUDA) and
        note where the cache rank's consumed count starts. Returns whether the cache rank is
        alive (else the generation starts dense: ``start_lost``)."""
        link, dev = self.link, self.be.device
        alive = self.peer_gone is None
        if alive:
            link.check()
        if dev.type == "cuda":
            self._land_stream = torch.cuda.Stream(device=dev)
            if alive:
                link.transport.recv_stream = self._land_stream
        if alive and link.cache is not None:
            self._cache_base = link.cache.consumed
        return alive

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
        alive = self._attach()
        self.sel.shared = link.shared if alive else None
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
        if self.peer_gone is None:  # (lost during the boot: _supervise starts another)
            if be.seq_len + 1 > self.rt.theta:  # the selections of step 1 are owed
                self._owed_since = time.monotonic()
            self._recv_task = asyncio.get_running_loop().create_task(self._receiver())
        return logits

    async def _boot(self, max_new_tokens: int) -> None:
        be, s = self.be, self.sel
        T = be.seq_len
        q0, k0, _ = s.boot[0]
        B, Hq, _, D = q0.shape
        # a growing cache (HF) has exactly T; a paged one reports its pools (read through s.boot_table)
        static_len = int(be.max_seq_len) if self.paged else (k0.shape[2] if k0.shape[2] > T else 0)
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
        # what a restarted cache rank's boot needs (``_reboot``)
        self._T0, self._capacity, self._static_len, self._shared_kv = T, capacity, static_len, shared_kv
        self._dtypes = (P.dtype_name(k0.dtype), P.dtype_name(q0.dtype))

        boot_table = s.boot_table

        def layer_msg(layer: int) -> list[torch.Tensor]:
            q, k, v = s.boot[layer]
            if boot_table is not None and not shared_kv:  # the pools' rows as [B, Hkv, T, D], one layer at a time
                from spade.kernels.paged import paged_to_contiguous

                k, v = paged_to_contiguous(k, boot_table, T), paged_to_contiguous(v, boot_table, T)
            return [q[:, :, q.shape[2] - W:].contiguous(), k, v]

        self._pool = self._pool_size(shared_kv)
        self._serving = False  # (a restarted cache rank boots from this rank's cache)
        await self._send_boot(T, W, s.kv_lens0, layer_msg, first_step=1, hooks=self.rt.hooks.to_dict(),
                              pool=self._pool)
        s.boot.clear()
        s.boot_table = None
        # selection buffers up front (CUDA graphs capture their addresses)
        layout = self.policy.selection_layout()
        if layout is not None:
            K, n_sink, n_recent = layout
            for p in range(len(self.packs)):
                s.ensure_pack_buffers(p, B, self.spec.n_kv_heads, K, n_sink, n_recent,
                                      be.device, kv_dtype=k0.dtype, D=D, kv_start=self.ctx.kv_start)
        self._kv_dtype, self._B, self._D = k0.dtype, B, D

    def _pool_size(self, shared_kv: bool) -> tuple[int, int]:
        """(num_blocks, block_size) of a paged cache when the cache rank keeps a store or copies
        of its own (they take as many blocks, under its own table), else (0, 0)."""
        be = self.be
        return (be.kv_pool.num_blocks, be.block_size) if self.paged and not shared_kv else (0, 0)

    def _clear_delta(self) -> None:
        """The delta return mode: every layer's held indices back to empty slots (what a new
        cache rank's deltas are encoded against)."""
        if self.rt.return_mode == "delta":
            for idx in self.sel.idx:
                if idx is not None:
                    idx.fill_(-1)

    # ------------------------------------------------------------------ serving (spade.serving)
    async def begin_serving(self, ctx: AttentionContext, cursor: int) -> None:
        """Serving: boot the cache rank for a slot batch (every one of the backend's
        ``max_batch`` rows, all idle) at the shared cursor ``cursor``; requests come by
        ``join_rows``. ``ctx`` (whose selector is this session's) attends every step."""
        be, s, spec = self.be, self.sel, self.spec
        link = self.link
        alive = self._attach()
        self.ctx = ctx
        self._clear_delta()  # a new epoch's cache rank encodes against empty slots
        B = int(be.max_batch)
        k0 = be.k_cache[0]
        Hkv, L, D = k0.shape[1], (int(be.max_seq_len) if self.paged else k0.shape[2]), k0.shape[3]
        q_dtype = getattr(be, "dtype", k0.dtype)
        shared_kv = alive and link.shared is not None
        s.shared = link.shared if shared_kv else None
        s.stage_kv = not shared_kv
        if not s.q_buf or s.q_buf[0].shape[1] != B or bool(s.pack_buf) != (s.stage_kv and q_dtype == k0.dtype):
            s.allocate(B, spec.n_q_heads, Hkv, D, q_dtype, k0.dtype, be.device)
            graphs = getattr(be, "_graphs", None)
            if graphs:  # captured steps stage into the buffers they saw (a lost cache rank's epoch had others)
                graphs.clear()
        for layer in range(spec.n_layers):  # (a paged cache: the pools, read through the table)
            s.kv_refs[layer] = (be.k_cache[layer], be.v_cache[layer]) if self.paged else \
                (be.k_cache[layer][:B], be.v_cache[layer][:B])
            if shared_kv:
                link.shared.refs[layer] = s.kv_refs[layer]
                link.shared.tables[layer] = be.table.tensor if self.paged else None
        s.kv_lens0 = torch.full((B,), cursor, dtype=torch.int64, device=be.device)
        self._T0, self._capacity, self._static_len, self._shared_kv = cursor, L, L, shared_kv
        self._dtypes = (P.dtype_name(k0.dtype), P.dtype_name(q_dtype))
        self._kv_dtype, self._B, self._D = k0.dtype, B, D
        self._pool = self._pool_size(shared_kv)
        self._serving = True
        self._busy = [False] * B
        await self._send_boot(cursor, 0, s.kv_lens0, None, first_step=1, hooks=self.rt.hooks.to_dict(),
                              serving=True, pool=self._pool)
        layout = self.policy.selection_layout()
        if layout is not None:
            K, n_sink, n_recent = layout
            for p in range(len(self.packs)):
                s.ensure_pack_buffers(p, B, spec.n_kv_heads, K, n_sink, n_recent, be.device, kv_dtype=k0.dtype,
                                      D=D, kv_start=ctx.kv_start)
        self._wake = asyncio.Event()
        self._end_seen = asyncio.Event()
        if self.peer_gone is None:
            self._recv_task = asyncio.get_running_loop().create_task(self._receiver())

    async def leave_rows(self, cursor: int, busy: list[bool]) -> None:
        """Serving: rows left since the last message (their ``kv_start`` moved to the cursor
        of their leave): LEAVE with the whole vector and the idle mask (``busy``: the rows
        a request decodes in), before the next step. Nothing is sent
        while the cache rank is lost (its successor boots with the vector)."""
        self._busy = list(busy)
        if self.peer_gone is not None:
            return
        step = self.step_state.index + 1
        await self._send("ctl", [P.cmd(P.LEAVE, cursor, step, 0), self.ctx.kv_start, self._idle_mask(busy)])
        self.stats["leaves"] += 1

    def _idle_mask(self, busy: list[bool]) -> torch.Tensor:
        """JOIN / LEAVE's ``idle`` [B] uint8 (cpu): 1 where no request decodes (``busy`` False)."""
        if len(busy) != self._B:
            raise ValueError(f"busy names {len(busy)} rows, the batch has {self._B}")
        return torch.tensor([not b for b in busy], dtype=torch.uint8)

    async def join_rows(self, cursor: int, joins: dict[int, tuple[int, list[tuple]]],
                        busy: list[bool]) -> None:
        """Serving: the requests prefilled into rows ``joins`` (row -> (prompt length T,
        per layer (q_tail [1, Hq, W, D], k [1, Hkv, T, D] or None, v or None))) at
        ``cursor`` join before the next decode step (``busy``: the rows a request decodes
        in from then, the joining ones included): JOIN (``spade.runtime.protocol``),
        then wait for that step's selections made after it (a sync point at joins only;
        with the cache rank lost nothing is sent: its successor boots from this rank's
        cache)."""
        self._busy = list(busy)
        if self.peer_gone is not None or not joins:
            return
        step = self.step_state.index + 1
        self.gen += 1
        rows = sorted(joins)
        resync = cursor + 1 > self.rt.theta  # the cache rank makes step ``step``'s selections again
        if resync:  # (before the JOIN: the re-selection may arrive while the rows' data travels)
            for p in range(len(self.packs)):
                self.arrived[p] = min(self.arrived[p], step - 1)
        info = torch.tensor([[r, joins[r][0]] for r in rows], dtype=torch.int64)
        await self._send("ctl", [P.cmd(P.JOIN, cursor, step, self.gen), info, self.ctx.kv_start,
                                 self._idle_mask(busy)])
        def layer_msgs(layer: int) -> list[list[torch.Tensor]]:
            out = []
            for r in rows:
                q_tail, k, v = joins[r][1][layer]
                out.append([q_tail] if self._shared_kv else [q_tail, k] + ([v] if v is not None else []))
            return out

        await self._send_layers(layer_msgs)
        self.stats["joins"] += len(rows)
        if self.peer_gone is not None or not resync:
            return
        self.stats["join_resyncs"] += 1
        t0 = time.perf_counter()
        for p in range(len(self.packs)):
            while self.arrived[p] < step:
                if self._owed_since is None:  # (any arrival clears it; these selections are still owed)
                    self._owed_since = time.monotonic()
                if not await self._alive(step, p):
                    break
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass
        self.stats["join_wait_s"] += time.perf_counter() - t0

    async def _send_boot(self, T: int, W: int, kv_lens: torch.Tensor, layer_msg, *, first_step: int,
                         hooks: dict, serving: bool = False, pool: tuple[int, int] = (0, 0)) -> None:
        """BOOT at cache length ``T`` and, per layer, ``W`` queries and (unless the cache
        rank reads this rank's cache) the K/V of positions ``[0, T)``; ``layer_msg(layer)``
        gives (q_tail, k cache, v cache)."""
        B = int(kv_lens.shape[0])
        kv_start = self.ctx.kv_start
        setup = P.Setup(policy=self.policy.describe(), spec=P.spec_to_dict(self.be.spec), batch=B, prompt_len=T,
                        capacity=self._capacity, static_len=self._static_len, dtype=self._dtypes[0],
                        q_dtype=self._dtypes[1], pack_layers=self.P, return_mode=self.rt.return_mode,
                        theta=self.rt.theta, q_tail=W, shared_kv=self._shared_kv,
                        has_kv_start=kv_start is not None, hooks=hooks, first_step=first_step, serving=serving,
                        kv_blocks=pool[0], block_size=pool[1])
        msg = [P.cmd(P.BOOT, B, T), setup.to_tensor(), kv_lens]
        if kv_start is not None:
            msg.append(kv_start)
        await self._send("ctl", msg)
        if serving:  # every row idle: no prompt travels
            return
        def layer_msgs(layer: int) -> list[list[torch.Tensor]]:
            q_tail, k, v = layer_msg(layer)
            if self._shared_kv:
                return [[q_tail]]
            kv = [k[:, :, :T].contiguous()]
            if self.rt.return_mode == "kv":  # values only where the cache rank gathers them
                kv.append(v[:, :, :T].contiguous())
            return [[q_tail, *kv]]

        await self._send_layers(layer_msgs)

    async def _send_layers(self, layer_msgs) -> None:
        """Per layer, the "boot" messages ``layer_msgs(layer)`` and one acknowledgement.
        The prompt's KV can be most of a GPU: at most BOOT_AHEAD layers travel
        unacknowledged, so neither side stages the whole cache at once."""
        acks = 0
        for layer in range(self.spec.n_layers):
            for msg in layer_msgs(layer):
                await self._send("boot", msg)
            while layer + 1 - acks > BOOT_AHEAD:
                await self._boot_ack()
                acks += 1
        while acks < self.spec.n_layers:
            await self._boot_ack()
            acks += 1

    async def _boot_ack(self) -> None:
        """One layer's boot acknowledgement, or the cache rank declared lost: when the wait
        reaches ``peer_deadline_s``, or at once when an in-process cache rank's task ends
        first (a boot that raised sends no acknowledgement, and its transport stays open)."""
        if self.peer_gone is not None:
            return
        try:
            task = self.link.cache_task
            recv = self.link.transport.recv("boot_ack", timeout=self.rt.peer_deadline_s)
            if task is None:
                await recv
                return
            got = asyncio.ensure_future(recv)
            await asyncio.wait([got, task], return_when=asyncio.FIRST_COMPLETED)
            if got.done():
                got.result()
                return
            got.cancel()
            await asyncio.gather(got, return_exceptions=True)
            self.link.check()  # the task's own failure
            raise TransportError("the cache rank stopped during its boot")
        except TransportError as e:
            await self._on_peer_failure(e)

    # ------------------------------------------------------------------ transport helpers
    async def _send(self, tag: str, tensors: list[torch.Tensor]) -> None:
        if self.peer_gone is not None:
            return
        try:
            # a send blocked by a hung cache rank (full buffers, a stopped process) is
            # bounded by the liveness deadline, not by the transport's own timeout
            async with asyncio.timeout(self.rt.peer_deadline_s):
                await self.link.transport.send(tag, tensors)
        except TimeoutError:
            await self._on_peer_failure(PeerTimeout(
                f"a {tag!r} send to the cache rank did not finish within "
                f"runtime.peer_deadline_s={self.rt.peer_deadline_s:g}"))
        except TransportError as e:
            await self._on_peer_failure(e)

    # ------------------------------------------------------------------ peer loss and restart
    def _event(self, kind: str, **fields) -> dict:
        ev = {"event": kind, "step": self.step_state.index,
              "t_s": round(time.monotonic() - self.t_start, 6), **fields}
        self.events.append(ev)
        return ev

    async def _on_peer_failure(self, e: BaseException) -> None:
        """A lost cache rank (dead, silent past ``peer_deadline_s``, or its transport
        broke), in every ``on_late`` mode: decode densely from here, drop the link, and
        let ``_supervise`` start another. Anything else (a bug) is raised."""
        if not isinstance(e, TransportError):  # PeerGone and PeerTimeout are TransportErrors
            raise e
        if self.peer_gone is not None:
            return
        reason = await self._cache_error()
        if reason and reason.startswith("the cache rank failed: "):
            reason = reason[len("the cache rank failed: "):]
        self.peer_gone = reason or f"{type(e).__name__}: {e}"
        self.stats["peer_gone"] = self.peer_gone
        self.stats["peers_lost"] += 1
        self._event("peer_lost", reason=self.peer_gone, on_late=self.rt.on_late)
        if self.step_state.sparse and self.step_state.index > 0:  # lost mid-step: its later packs run dense
            self._note_fallback(self.step_state.index)
        log.warning("cache rank lost at decode step %d (%s); decoding densely until it is back",
                    self.step_state.index, self.peer_gone)
        await self._stop_recv()
        if self.rt._owns_link:
            self._abandon_task = asyncio.get_running_loop().create_task(self.link.abandon())

    def start_lost(self, reason: str, *, new_loss: bool = True) -> None:
        """Before ``begin``: the cache rank is lost and a new one did not come up. The
        generation starts dense (nothing is sent; the boot's bookkeeping is kept for the
        successor) and ``_supervise`` tries again from its first step. ``new_loss``: the
        loss was found now (counted, a ``restart_failed`` event); False: an earlier
        generation counted it."""
        self.peer_gone = reason
        self.stats["peer_gone"] = reason
        if new_loss:
            self.stats["peers_lost"] += 1
            self._event("restart_failed", reason=reason)

    def adopt_restart(self, task: asyncio.Task) -> None:
        """Before ``begin``: an earlier generation lost its cache rank and ended while the
        successor (``task``, opening a link) was coming up. This one starts dense and
        ``_supervise`` boots the successor once it is connected (``peer_restored``)."""
        self.start_lost("the cache rank lost in an earlier generation is restarting", new_loss=False)
        self._restart_task = task

    def restored_before_start(self) -> None:
        """The successor of a cache rank lost in an earlier generation came up between
        generations: counted as a restart (``peer_restored`` at step 0)."""
        self.stats["restarts"] += 1
        self._event("peer_restored", restart=self.stats["restarts"], degraded_steps=None)

    def _note_fallback(self, step: int) -> None:
        """Decode step ``step`` was meant to be sparse but (some of) its packs ran dense."""
        if self.fallback and self.fallback[-1][1] >= step - 1:
            self.fallback[-1][1] = max(self.fallback[-1][1], step)
        else:
            self.fallback.append([step, step])
        self.stats["dense_fallback_steps"] = sum(b - a + 1 for a, b in self.fallback)

    async def _supervise(self, step: int) -> None:
        """Between steps, with the cache rank lost: start a new one (in the background:
        decoding goes on densely), and once it is connected, boot it from this rank's
        cache (``_reboot``); sparse selection resumes at the next step."""
        if self.peer_gone is None or self.link is None:
            return
        if self._restart_task is None:
            if self._no_restart is None:
                self._no_restart = self.rt.restart_refusal()
                if self._no_restart is None:
                    self.rt.note_restart()
                    self._restart_task = asyncio.get_running_loop().create_task(self._open_again())
                    if self.rt.topology != "multiprocess":  # an in-process cache rank starts at once
                        await asyncio.wait([self._restart_task], timeout=self.rt.peer_deadline_s)
                    else:
                        return
                else:
                    log.warning("the cache rank is not restarted (%s): decoding densely to the end of this "
                                "generation", self._no_restart)
                    self._event("no_restart", reason=self._no_restart)
                    return
            else:
                return
        if not self._restart_task.done() or step < 2:  # (the boot needs one decode step's queries)
            for _ in range(8):  # dense steps on a CPU never wait: let the restart (process, connect) run
                await asyncio.sleep(0)
            return
        task, self._restart_task = self._restart_task, None
        try:
            link = task.result()
        except Exception as e:
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            self._event("restart_failed", reason=why)
            log.warning("restarting the cache rank failed (%s); still dense", why)
            return
        await self._reboot(link, step)

    async def _open_again(self) -> CacheLink:
        """The lost link closed (its port free again), a new one opened the same way."""
        if self._abandon_task is not None:
            await self._abandon_task
        return await self.rt.link(restart=True)

    async def _reboot(self, link: CacheLink, step: int) -> None:
        """Boot a new cache rank at this rank's cache length, before decode step ``step``:
        the KV so far as its "prompt", the last step's query as its query window (the
        window refills as steps come), its first selections for ``step``."""
        s, be = self.sel, self.be
        await self._stop_recv()
        self.link = link
        self.peer_gone = None
        self._recv_error = None
        n = len(self.packs)
        self.arrived, self.ever, self.pending = [0] * n, [False] * n, [[] for _ in range(n)]
        self.gen = 0  # the new cache rank counts joins from its boot
        self._qkv_sent = 0
        self._cache_base = link.cache.consumed if link.cache is not None else 0
        if self._land_stream is not None:
            link.transport.recv_stream = self._land_stream
        if self._shared_kv:
            link.shared.refs.update(s.kv_refs)
            if self.paged:
                link.shared.tables.update(dict.fromkeys(s.kv_refs, be.block_table))
            s.shared = link.shared
        self._clear_delta()  # the new cache rank's deltas build on empty slots
        T = be.seq_len
        kv_lens = s.kv_lens0 + (T - self._T0)
        # a test hook's fault happens once: the new cache rank keeps only faults still ahead
        hooks = self.rt.hooks.to_dict()
        for key in ("die_at_step", "stall_from_step"):
            if hooks.get(key) is not None and hooks[key] <= step:
                hooks[key] = None
        hooks["die_at_boot_layer"] = None

        def layer_msg(layer: int) -> list[torch.Tensor]:
            p, j = s.where[layer]
            k, v = s.kv_refs[layer]
            if self.paged and not self._shared_kv:  # the pools' rows as [B, Hkv, T, D]
                from spade.kernels.paged import paged_to_contiguous

                bt = be.block_table
                k, v = paged_to_contiguous(k, bt, T), paged_to_contiguous(v, bt, T)
            return [s.q_buf[p][j].unsqueeze(2).contiguous(), k, v]

        rejoin = self._serving and self._pool[0] > 0  # serving on a paged cache, a cache rank of its own
        if rejoin:  # an epoch of idle rows, then the busy rows join again (their copies in pools)
            await self._send_boot(T, 0, kv_lens, None, first_step=step, hooks=hooks, serving=True, pool=self._pool)
        else:
            await self._send_boot(T, 1, kv_lens, layer_msg, first_step=step, hooks=hooks, pool=self._pool)
        if self.peer_gone is not None:  # lost again while booting (recorded by _on_peer_failure)
            return
        if T + 1 > self.rt.theta and not rejoin:  # its first selections are owed
            self._owed_since = time.monotonic()
        self._end_seen = asyncio.Event()
        self._recv_task = asyncio.get_running_loop().create_task(self._receiver())
        if rejoin:
            await self.join_rows(T, self._rejoins(T), self._busy)
            if self.peer_gone is not None:
                return
        self.stats["restarts"] += 1
        lost = next((e for e in reversed(self.events) if e["event"] == "peer_lost"), None)
        ev = self._event("peer_restored", restart=self.stats["restarts"],
                         degraded_steps=step - lost["step"] if lost else None)
        if lost is not None:
            ev["degraded_s"] = round(ev["t_s"] - lost["t_s"], 6)
        log.warning("cache rank restarted and booted at decode step %d (cache length %d); sparse from here",
                    step, T)

    def _rejoins(self, T: int) -> dict[int, tuple[int, list[tuple]]]:
        """``join_rows``' joins for a restarted cache rank: every busy row with its window
        ``[kv_start, T)`` as the prompt (keys read through the table; values too in the kv
        return mode, where the cache rank gathers them) and the
        last step's query as its query window (which refills as steps come)."""
        from spade.kernels.paged import paged_range

        s, be = self.sel, self.be
        starts = self.ctx.kv_start.tolist() if self.ctx.kv_start is not None else [0] * self._B
        table = be.block_table
        joins = {}
        for r, busy in enumerate(self._busy):
            if not busy:
                continue
            lo = int(starts[r])
            layers = []
            for layer in range(self.spec.n_layers):
                p, j = s.where[layer]
                k = paged_range(s.kv_refs[layer][0], table[r], lo, T)
                v = paged_range(s.kv_refs[layer][1], table[r], lo, T) if self.rt.return_mode == "kv" else None
                layers.append((s.q_buf[p][j][r:r + 1].unsqueeze(2).contiguous(), k, v))
            joins[r] = (T - lo, layers)
        return joins

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
                self._owed_since = None
                meta = msg[0].tolist()
                if meta[0][P.META_PACK] < 0:  # END acknowledged: nothing more this generation
                    if len(msg) > 1:  # the cache rank's host account of the generation
                        self.stats["cache_host"] = P.stats_from_tensor(msg[1])
                    self._end_seen.set()
                    return
                p = meta[0][P.META_PACK]
                stale = meta[0][P.META_GEN] < self.gen  # made before a join from the rows' old content
                if stale and self.rt.return_mode != "delta":
                    self.stats["dropped_selections"] += 1
                    continue
                # (delta: every message is applied in order, a stale one too: the cache rank encodes the
                # next against it; it does not count as the re-selection a join waits for)
                if self._land_stream is not None and self.rt.return_mode != "delta":
                    # Copy into the fixed buffers right away, on the landing stream: the
                    # buffers' last readers (pack p of the step before) finished before the
                    # cache rank could produce this message (it waited on that pack's q/k/v),
                    # so only the pack that uses it waits, on the event (no copy on the
                    # compute stream).
                    with stream_scope(self._land_stream):  # (its device current with it)
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
                if not stale:
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
        cur = current_stream(self.be.device) if self._land_stream is not None else None
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
            if mode != "delta" and self._land_whole(p, meta, msg):
                return
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

    def _land_whole(self, p: int, meta: list[list[int]], msg: list[torch.Tensor]) -> bool:
        """A pack whose every layer has a selection of one layout lands in one copy (per
        tensor) into the pack's buffers (``AsyncSelector.land_pack``); False: the caller
        lands it layer by layer."""
        row = meta[0]
        K, n_sink, n_recent = row[P.META_K], row[P.META_SINK], row[P.META_RECENT]
        if K == 0 or len(msg) < 2 or any(r[P.META_DENSE] or r[P.META_K] != K or r[P.META_SINK] != n_sink
                                         or r[P.META_RECENT] != n_recent for r in meta):
            return False
        if not self.sel.land_pack(p, msg[1:], n_sink, n_recent, self.be.device, kv_dtype=self._kv_dtype, D=self._D,
                                  kv_start=self.ctx.kv_start):
            return False
        l0, l1 = self.packs[p]
        for layer in range(l0, l1):
            self.sel.dense_flag[layer] = False
        self.stats["packs_landed_whole"] += 1
        return True

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
        if not await self._alive(step, p):
            self._dense(p)
            return
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
        # wait (bounded by late_timeout_s for this pack, and by the peer deadline)
        self.stats["waited_packs"] += 1
        t0 = time.perf_counter()
        late_end = time.monotonic() + self.rt.late_timeout_s
        while self.arrived[p] < step:
            if not await self._alive(step, p):
                self.stats["wait_s"] += time.perf_counter() - t0
                self._dense(p)
                return
            left = late_end - time.monotonic()
            if left <= 0:  # late, not lost: this pack attends densely, the next one waits again
                self.stats["timed_out_packs"] += 1
                self.stats["wait_s"] += time.perf_counter() - t0
                self._dense(p)
                return
            if self._owed_since is not None:
                left = min(left, self._owed_since + self.rt.peer_deadline_s - time.monotonic())
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.0, min(left, 0.5)))
            except asyncio.TimeoutError:
                pass
        self.stats["wait_s"] += time.perf_counter() - t0
        self._use(p, True)

    async def _alive(self, step: int, p: int) -> bool:
        """With pack ``p``'s selection for ``step`` owed: False (and the cache rank declared
        lost) when it failed, stopped, or has sent nothing for ``peer_deadline_s``."""
        if self._recv_error is not None:
            await self._on_peer_failure(self._recv_error)
            return False
        try:
            self.link.check()
        except TransportError as e:
            await self._on_peer_failure(e)
            return False
        silent = time.monotonic() - self._owed_since if self._owed_since is not None else 0.0
        if silent > self.rt.peer_deadline_s:
            await self._on_peer_failure(PeerTimeout(
                f"the cache rank sent nothing for {silent:.1f}s with the selection of step {step} pack {p} owed "
                f"(runtime.peer_deadline_s={self.rt.peer_deadline_s:g})"))
            return False
        return True

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

    async def step(self, tokens: torch.Tensor, sparse: bool | None = None) -> torch.Tensor:
        """One decode step; returns the logits [B, V]. ``sparse``: whether any row attends
        a selection this step (serving decides per row; default: past θ)."""
        be, ctx = self.be, self.ctx
        if self.rt.sync_policy:
            return be.decode(tokens, ctx)
        t_host = time.perf_counter()  # host time of the step (it does not wait for the device)
        seq = be.seq_len + 1
        st = self.step_state
        st.index += 1
        step = st.index
        if self.peer_gone is not None:
            await self._supervise(step)
        want = seq > self.rt.theta if sparse is None else bool(sparse)
        st.sparse = want and self.peer_gone is None
        if st.sparse:
            self.stats["sparse_steps"] += 1
        elif want:  # meant to be sparse: the cache rank is lost
            self._note_fallback(step)
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
            if seq + 1 > self.rt.theta and self._owed_since is None:  # a selection for step + 1 is owed
                self._owed_since = time.monotonic()
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
        ev.record(current_stream(dev))
        while not ev.query():
            await asyncio.sleep(0)

    async def token_loop(self, first_logits: torch.Tensor, *, max_new_tokens: int, sample_fn,
                         on_token=None) -> tuple[list[list[int]], list[float]]:
        """``spade.runtime.base.timed_loop`` with an asynchronous step."""
        rows: list[list[int]] = [[] for _ in range(first_logits.shape[0])]
        times: list[float] = []
        logits = first_logits
        for i in range(max_new_tokens):
            nxt, stop = sample_and_report(logits, sample_fn, rows, i, on_token)
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
                    await asyncio.wait_for(self._end_seen.wait(), max(10.0, self.rt.peer_deadline_s))
                except asyncio.TimeoutError:
                    await self._on_peer_failure(PeerTimeout(
                        "the cache rank did not acknowledge the end of the generation within "
                        f"runtime.peer_deadline_s={self.rt.peer_deadline_s:g}"))
        await self._stop_recv()
        await self._stop_restart(hand_over=True)

    async def _stop_restart(self, hand_over: bool = False) -> None:
        """A restart in flight: ``hand_over``, the runtime keeps it for the next
        generation (``AsyncRuntime.session`` adopts it, ``close`` cancels it); else it is
        stopped (its half-open link kills its process). Then wait, bounded, for a lost
        link to be dropped: nothing of the lost cache rank outlives the generation."""
        if self._restart_task is not None:
            task, self._restart_task = self._restart_task, None
            if hand_over and self.rt._owns_link:
                self.rt.hand_over_restart(task)
            else:
                if not task.done():
                    task.cancel()
                try:
                    await task
                except BaseException:
                    pass
        if self._abandon_task is not None:
            try:
                await asyncio.wait_for(self._abandon_task, 15.0)
            except BaseException:
                self.link.kill()

    async def _stop_recv(self) -> None:
        """Cancel the task receiving the cache rank's messages, if it runs, and wait for it."""
        if self._recv_task is not None and not self._recv_task.done():
            self._recv_task.cancel()
            try:
                await self._recv_task
            except BaseException:
                pass

    async def abort(self) -> None:
        """After a failure mid-generation: stop receiving; the cache rank may be
        mid-step, so an owned link is closed (the next generation opens a new one)."""
        await self._stop_recv()
        await self._stop_restart()
        if self.link is not None and self.rt._owns_link:
            try:
                await asyncio.wait_for(self.link.close(timeout_s=5.0), 15.0)
            except BaseException:
                self.link.kill()

    def trace(self, rows: list[list[int]], times: list[float]) -> GenerationTrace:
        self.stats["late_packs"] = self.late_packs
        self.stats["events"] = [dict(e) for e in self.events]
        self.stats["dense_fallback"] = [list(r) for r in self.fallback]
        if self.link is not None and self.link.cache is not None:
            self.stats["cache_rank"] = dict(self.link.cache.stats)
        return GenerationTrace(tokens=rows, step_times_s=times, prefill_time_s=self.prefill_time_s,
                               mean_attended=self.ctx.mean_attended() if self.ctx is not None else 0.0,
                               late_packs=self.late_packs, stats=dict(self.stats))

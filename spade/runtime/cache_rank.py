"""The cache rank: full KV store, the policy's state, and selection one step ahead.

Per generation (see ``spade.runtime.protocol`` for the messages):

1. BOOT: build the policy from its config (or use the in-process object), load
   the prompt's KV and last W queries into the store and call
   ``policy.prefill`` per layer; then compute the selection of decode step 1.
2. Per decode step ``t`` and pack ``p``: receive the pack's q/k/v, append k/v
   to the store (not k when the policy never reads the stored keys back:
   ``Policy.takes_new_keys`` with a fixed-length view, e.g. asyncspade's int4/int8
   scoring copies, which then quantise the received k directly), ``policy.observe``
   each layer (pushes q into the query window),
   and — when step ``t+1`` is past the sparse threshold — ``policy.select`` for
   step ``t+1`` (``q=None``: only policies with ``needs_current_query=False``
   come here) and send the pack's selection back at once. The inference rank
   needs it one whole step later, at the same pack: that is the slack.

Devices and streams: on CUDA the cache rank's work runs under
``torch.cuda.device(dev)`` and, when it shares a GPU with the inference rank
(``colocated``), on a side stream; the local transport orders that stream after
the inference rank's work with CUDA events (``LocalTransport.stream``). No
``await`` happens inside a stream context (the context is thread state, and the
inference coroutine shares the thread).

Store: ``[B, Hkv, capacity, D]`` per layer in the KV dtype, or — ``colocated``
with a static-cache backend — the inference rank's own cache tensors (read
only; positions the cache rank reads were written before the events it waits
on, and the inference rank only writes positions the cache rank does not read
for the step it works on), or none where the policy never reads keys back once
prefilled (``takes_new_keys``, a fixed-length view, no values: ``lean``): its
copies are then all the cache rank keeps of the keys (serving on a paged cache:
pools of the inference rank's block count under a table of this rank's own,
``copy_blocks``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import statistics
import time
import traceback
from typing import Any

import torch

from spade import kernels
from spade.envs import env
from spade.errors import PeerGone, TransportError
from spade.kernels.paged import paged_range, paged_write
from spade.kernels.pdl import shared_gpu
from spade.policies.base import Policy
from spade.policies.common import logical_keys, shared_derived
from spade.runtime import protocol as P
from spade.streams import current_stream, indexed_device, no_grad_on

log = logging.getLogger(__name__)


class _Shutdown(Exception):
    pass


class SharedKV:
    """In-process view of the inference rank's KV cache (layer -> (k, v)), updated
    by the inference selector's hooks; read by a colocated cache rank."""

    def __init__(self) -> None:
        self.refs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        #: layer -> the block table the refs are read through (a paged cache: the refs are
        #: the layer's pools), or None (contiguous refs: the prompt's keys at boot, or a
        #: contiguous cache)
        self.tables: dict[int, torch.Tensor | None] = {}


# ----------------------------------------------------------------------------- delta encoding
def align_selection(prev: torch.Tensor, new: torch.Tensor, length: int) -> torch.Tensor:
    """Reorder ``new`` [B, H, K] (int32, -1 = empty) so that every position still
    selected keeps the slot it had in ``prev``; entrants fill the freed slots.
    Device-side, no host sync. Returns the aligned [B, H, K] int32."""
    B, H, K = new.shape
    dev = new.device
    pv = torch.where(prev >= 0, prev, length).long()
    nv = torch.where(new >= 0, new, length).long()
    in_new = torch.zeros(B, H, length + 1, dtype=torch.bool, device=dev).scatter_(2, nv, True)
    in_prev = torch.zeros(B, H, length + 1, dtype=torch.bool, device=dev).scatter_(2, pv, True)
    in_new[..., length] = False
    in_prev[..., length] = False
    keep = in_new.gather(2, pv)  # prev slot whose position is still selected
    entrant = (~in_prev.gather(2, nv)) & (new >= 0)  # newly selected position
    freed = ~keep
    f_rank = torch.cumsum(freed.int(), 2) - 1
    e_rank = torch.cumsum(entrant.int(), 2) - 1
    slots = torch.arange(K, device=dev).expand(B, H, K)
    freed_pos = torch.full((B, H, K + 1), K, dtype=torch.long, device=dev)
    freed_pos.scatter_(2, torch.where(freed, f_rank.long(), K), slots)
    tgt = freed_pos.gather(2, torch.where(entrant, e_rank.long(), K))  # [B, H, K]
    out = torch.cat([torch.where(keep, prev, -1), torch.full((B, H, 1), -1, dtype=prev.dtype, device=dev)], 2)
    out.scatter_(2, torch.where(entrant, tgt, K), torch.where(entrant, new, -1).to(out.dtype))
    return out[..., :K].contiguous()


def delta_encode(prev: torch.Tensor, aligned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Changed slots of ``aligned`` vs ``prev``: (slots, values) [B, H, C] int32,
    ``-1`` padded, ``C`` = the most changes of any (row, head), at least 1. One
    host sync (``C``): the cache rank's, off the critical path."""
    B, H, K = prev.shape
    changed = aligned != prev
    C = max(1, int(changed.sum(2).max().item()))
    rank = torch.cumsum(changed.int(), 2) - 1
    dest = torch.where(changed, rank.long(), C)
    slots = torch.full((B, H, C + 1), -1, dtype=torch.int32, device=prev.device)
    vals = torch.full((B, H, C + 1), -1, dtype=torch.int32, device=prev.device)
    slots.scatter_(2, dest, torch.arange(K, device=prev.device, dtype=torch.int32).expand(B, H, K).contiguous())
    vals.scatter_(2, dest, aligned.to(torch.int32))
    return slots[..., :C].contiguous(), vals[..., :C].contiguous()


def delta_apply(active: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """In place: ``active[b, h, slots[b, h, c]] = values[b, h, c]`` for ``slots >= 0``."""
    B, H, K = active.shape
    ext = torch.cat([active, torch.full((B, H, 1), -1, dtype=active.dtype, device=active.device)], 2)
    ext.scatter_(2, torch.where(slots >= 0, slots.long(), K), values.to(active.dtype))
    active.copy_(ext[..., :K])


@contextlib.contextmanager
def _with_shared_gpu(on):
    with on, shared_gpu():
        yield


# ----------------------------------------------------------------------------- the rank
class CacheRank:
    """Serve generations for one inference rank over ``transport`` (already
    connected). ``policy``: an in-process policy object (else rebuilt from each
    BOOT's config); ``shared``: the inference rank's cache, in-process only."""

    def __init__(self, transport: Any, device: torch.device | str, *, policy: Policy | None = None,
                 shared: SharedKV | None = None, in_process: bool = True, shares_gpu: bool = False):
        self.t = transport
        self.device = indexed_device(device)
        self.policy = policy
        self.shared = shared
        self.in_process = in_process
        # on the inference rank's GPU: launches under pdl.shared_gpu (SPADE_PDL=auto: no PDL for
        # the selection kernels, whose early-launched programs would hold SMs from the decode's)
        self.shares_gpu = bool(shares_gpu) and self.device.type == "cuda"
        self.stream = None
        if self.device.type == "cuda" and hasattr(transport, "stream"):
            # a side stream, ordered against the inference rank by the transport's events
            self.stream = torch.cuda.Stream(device=self.device)
            transport.stream = self.stream
        self.stats: dict[str, float] = {"packs": 0, "selections": 0, "select_host_s": 0.0, "generations": 0}
        self.generation_stats: dict[str, float] = {}  # protocol.CACHE_STATS of the last generation
        self.consumed = 0  # "qkv" packs fully handled (observed, selection launched and sent), cumulative
        self.use_graphs = True
        self._graphs: dict = {}
        self._seen: set = set()  # graph keys run once (eagerly); the second call captures
        self._kept: _Generation | None = None  # the last serving epoch's generation (renewed by the next one)
        self._pool = None
        self._capture_stream = None
        if self.device.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
            self._capture_stream = torch.cuda.Stream(device=self.device)

    def _on(self):
        """Device, side stream and no_grad for a block of cache-rank work (never across an
        await); on a GPU shared with the inference rank, ``pdl.shared_gpu`` too."""
        if self.stream is not None:  # the stream's device becomes current with it
            on = no_grad_on(self.stream)
        elif self.device.type == "cuda":
            on = _device_no_grad(self.device)
        else:
            return torch.no_grad()
        return _with_shared_gpu(on) if self.shares_gpu else on

    async def serve(self) -> None:
        """Loop over generations until SHUTDOWN or the peer goes away."""
        try:
            while True:
                msg = await self.t.recv("ctl")
                c = msg[0].tolist()
                if c[0] == P.SHUTDOWN:
                    return
                if c[0] == P.END:
                    continue
                if c[0] != P.BOOT:
                    raise TransportError(f"cache rank: expected BOOT, got command {c[0]}")
                setup = P.Setup.from_tensor(msg[1])
                kv_lens = msg[2].to(self.device)
                kv_start = msg[3].to(self.device) if setup.has_kv_start else None
                await self._generation(setup, kv_lens, kv_start)
        except (_Shutdown, asyncio.CancelledError):
            return
        except PeerGone:
            return
        except Exception as e:
            text = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            log.error("cache rank failed: %s", text)
            try:
                await asyncio.wait_for(self.t.send("err", [P.text_tensor(text)]), 5.0)
            except Exception:
                pass
            raise

    # ------------------------------------------------------------------ one generation
    async def _generation(self, s: P.Setup, kv_lens: torch.Tensor, kv_start: torch.Tensor | None) -> None:
        """One generation. A serving BOOT whose setup matches the last serving epoch's
        (everything but the cursor) renews that epoch's generation: its policy state, fixed
        buffers and CUDA graphs carry over, as the inference rank's slot batch keeps its own
        (an idle row's state is never read, a joining row's is reset by its JOIN), so an
        epoch captures nothing its predecessor captured."""
        kept, self._kept = self._kept, None
        if kept is not None and s.serving and _epoch_key(s) == _epoch_key(kept.s):
            kept.renew(s, kv_lens, kv_start)
            gen = kept
        else:
            gen = _Generation(self, s, kv_lens, kv_start)
        await gen.run()
        if s.serving:  # ended by END (a failure raised past here)
            self._kept = gen

    # ------------------------------------------------------------------ CUDA graphs
    def _graphs_enabled(self, s: P.Setup) -> bool:
        """Replay each pack's work as a CUDA graph: on CUDA, with a cache of fixed
        shape (a static inference cache or a shared one), for ``indices`` and ``kv``
        (``delta`` encoding syncs the host). ``SPADE_CACHE_GRAPHS=0`` turns it off."""
        return (self.device.type == "cuda" and self.use_graphs and env("SPADE_CACHE_GRAPHS") == "1"
                and s.return_mode in ("indices", "kv") and (s.shared_kv or s.static_len > 0))

    def _run(self, key: tuple, fn, graphs_on: bool):
        """``fn()`` eagerly, or as a CUDA graph: the first call of a key runs eagerly; the
        second runs eagerly on the capture stream (warm-up: Triton compiles, outputs are
        allocated), then is captured; later calls replay. A key seen once costs no capture:
        while the rows of a serving batch fill their query windows at different steps,
        each step has a key of its own (``AsyncSpade.graph_key``). ``fn`` returns host
        facts, which a key fixes (the policy's ``graph_key`` is part of it, as on the
        inference rank)."""
        if not graphs_on:
            return fn()
        hit = self._graphs.get(key)
        if hit is not None:
            if hit[0] is None:  # this key could not be captured: eager
                return fn()
            hit[0].replay()
            return hit[1]
        if key not in self._seen:  # first sight: eager
            self._seen.add(key)
            return fn()
        cur = current_stream(self.device)
        cap = self._capture_stream
        cap.wait_stream(cur)
        with torch.cuda.stream(cap):
            info = fn()
        cur.wait_stream(cap)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, pool=self._pool, stream=cap, capture_error_mode="thread_local"):
                fn()
        except Exception as e:  # a policy that cannot be captured still works, eagerly
            log.warning("cache rank: CUDA graph capture of %s failed (%s: %s); running it eagerly",
                        key[:2], type(e).__name__, e)
            self._graphs[key] = (None, info)
            return info
        cur.wait_stream(cap)
        self._graphs[key] = (g, info)
        self.stats["graphs"] = self.stats.get("graphs", 0) + 1
        return info

    def _encode(self, info: tuple, o: dict | None, p: int, step: int, seq: int, s: P.Setup, view, prev: dict,
                l0: int, gen: int = 0) -> list[torch.Tensor]:
        """The pack's "sel" message (see ``spade.runtime.protocol``) from the host
        facts ``info`` and the output buffers ``o`` of ``select_pack``; ``gen``: the
        inference rank's join counter this selection follows (serving)."""
        flags, K = info[:-1], info[-1]
        n = len(flags)
        meta = torch.tensor([[p, step, seq, int(dense), sink, recent, K, 0, gen] for dense, sink, recent in flags],
                            dtype=torch.int64)
        if K == 0:
            if s.return_mode == "delta":
                for j in range(n):
                    prev.pop(l0 + j, None)
            return [meta]
        idx = o["idx"]
        if s.return_mode == "indices":
            return [meta, idx]
        if s.return_mode == "kv":
            return [meta, idx, o["k"], o["v"]]
        # delta: align each layer's selection to the slots the inference rank holds
        B, H = idx.shape[1:3]
        slots_l, vals_l = [], []
        for j, (dense, _, _) in enumerate(flags):
            layer = l0 + j
            if dense:
                prev.pop(layer, None)
                cur = torch.full((B, H, K), -1, dtype=torch.int32, device=self.device)
                sl, va = delta_encode(cur, cur)
            else:
                old = prev.get(layer)
                if old is None or old.shape != idx[j].shape:
                    old = torch.full_like(idx[j], -1)
                length = view(layer, seq)[0].shape[2]
                aligned = align_selection(old, idx[j], max(length, seq))
                sl, va = delta_encode(old, aligned)
                prev[layer] = aligned
            slots_l.append(sl)
            vals_l.append(va)
        C = max(x.shape[2] for x in slots_l)
        slots = torch.full((n, B, H, C), -1, dtype=torch.int32, device=self.device)
        vals = torch.full((n, B, H, C), -1, dtype=torch.int32, device=self.device)
        for j in range(n):
            c = slots_l[j].shape[2]
            slots[j, :, :, :c] = slots_l[j]
            vals[j, :, :, :c] = vals_l[j]
        meta[:, P.META_C] = C
        return [meta, slots, vals]


class _Generation:
    """One generation on the cache rank (``CacheRank._generation``): the boot (the
    prompt's KV and last queries), the first selections, then per step each pack's
    observe and the next step's select and send, until END. Host state of the
    generation lives here; the cache rank's stats, graphs and counters on ``rank``."""

    def __init__(self, rank: CacheRank, s: P.Setup, kv_lens: torch.Tensor, kv_start: torch.Tensor | None):
        self.rank = rank
        self.t = rank.t
        self.s = s
        self.kv_lens = kv_lens
        spec = P.spec_from_dict(s.spec)
        self.spec = spec
        policy = self.policy = rank.policy if rank.policy is not None else P.policy_from_dict(s.policy, spec)
        self.hooks = P.CacheHooks(**s.hooks)
        B, T = self.B, self.T = s.batch, s.prompt_len
        dev = self.dev = rank.device
        dt = self.dt = P.dtype_of(s.dtype)
        Hkv, D = self.Hkv, self.D = spec.n_kv_heads, spec.head_dim
        n_layers = self.n_layers = spec.n_layers
        self.packs = P.packs_of(n_layers, s.pack_layers)
        rank.stats["generations"] += 1
        self.kstore = self.vstore = self.no_v = self.kview = self.join_buf = None
        self.lean = False  # no key store (below)
        self.copy_blocks = None  # a paged cache, a rank of its own: the blocks of its store or scoring copies
        self._renewed = False  # renew() ran: the next run() keeps the buffers
        self._carry0: dict[str, float] = {}  # the carry's counters at the epoch's start (renew)
        with rank._on():
            state = self.state = policy.new_state(B, dev)
            state.kv_start = kv_start
            state.seq_len = T
            # serving: every row idle until a JOIN (``protocol``: the idle mask of JOIN / LEAVE)
            state.idle = torch.ones(B, dtype=torch.bool, device=dev) if s.serving else None
            # the selection grids' plan: the bucket of rows in use (``kernels.plan_rows``; a graph key)
            self.plan = 1 if s.serving else B
            state.cache_len = s.static_len or None  # the cache's capacity (a paged or a boot view is shorter)
            if s.shared_kv:
                if rank.shared is None:
                    raise TransportError("cache rank: shared KV requested but this cache rank is not in-process")
            else:
                # Values only for the kv return mode (the cache rank gathers them): no policy
                # that selects ahead reads values, so the other modes neither store nor ship
                # them (half the store, half the boot traffic). Those policies get an empty
                # [B, Hkv, 0, D] value tensor: reading it would fail loudly.
                # A paged inference cache: the store (keys, and values for kv) is pools of its block
                # count under a table of this rank's own (``RowBlocks``, below), not rows at the capacity.
                paged = s.kv_blocks > 0 and s.static_len > 0
                store = (s.kv_blocks, Hkv, s.block_size, D) if paged else (B, Hkv, s.capacity, D)
                self.vstore = ([torch.zeros(store, dtype=dt, device=dev) for _ in range(n_layers)]
                               if s.return_mode == "kv" else None)
                self.no_v = torch.empty(B, Hkv, 0, D, dtype=dt, device=dev)
                # Keys the policy never reads back once prefilled (``Policy.takes_new_keys``:
                # compressed scoring keys, e.g. asyncspade's int4 / int8 copies) with a
                # fixed-length view and no values: no key store. Prompts go from their BOOT
                # message into the prefill (a join's through one row-sized buffer,
                # ``_join_keys``), each step's keys from its pack into ``observe``, and
                # the policy sees a fixed-shape view of no memory (NaN if it were read).
                self.lean = s.static_len > 0 and self.vstore is None and policy.takes_new_keys(state)
                if paged:
                    # A paged cache: the store, or the policy's copies without one, are pools of the
                    # inference rank's block count under a table of this rank's own (``RowBlocks``: a
                    # static batch's rows get blocks for their prompts at the boot, a joining row for
                    # its prompt, every row one more as the cursor enters a block, a leaving row frees
                    # them), so they take the KV pool's memory, not max_batch x max_seq_len.
                    from spade.kvcache import RowBlocks, blocks_for

                    self.copy_blocks = RowBlocks(s.kv_blocks, s.block_size, B, blocks_for(s.static_len, s.block_size),
                                                 dev)
                    state.block_table = self.copy_blocks.table.tensor
                if self.lean:
                    view = store if paged else (B, Hkv, s.static_len, D)
                    self.kview = torch.full((1, 1, 1, 1), float("nan"), dtype=dt, device=dev).expand(view)
                else:
                    self.kstore = [torch.zeros(store, dtype=dt, device=dev) for _ in range(n_layers)]

    def view(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What the inline policy would see as the cache at length ``seq``."""
        s = self.s
        if s.shared_kv:  # a paged cache's pools are read through its table (``PolicyState.block_table``)
            self.state.block_table = self.rank.shared.tables.get(layer)
            return self.rank.shared.refs[layer]
        if self.copy_blocks is not None:  # pools (a store, or a lean view) read through this rank's table
            self.state.block_table = self.copy_blocks.table.tensor
        if self.lean:
            return self.kview, self.no_v
        if self.copy_blocks is not None:
            return self.kstore[layer], (self.vstore[layer] if self.vstore is not None else self.no_v)
        n = s.static_len or seq
        return (self.kstore[layer][:, :, :n],
                (self.vstore[layer][:, :, :n] if self.vstore is not None else self.no_v))

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor | None, start: int | torch.Tensor,
               rows: slice = slice(None)) -> None:
        """Keys ``k`` [n, Hkv, T, D] (and values ``v``) of rows ``rows`` into the store at
        positions ``start .. start + T`` (``start`` a host int, or a device tensor [1]: one
        position, graph-safe): through this rank's table on a paged cache, else in place."""
        for store, x in ((self.kstore, k), (self.vstore, v)):
            if x is None:
                continue
            dst = store[layer]
            if self.copy_blocks is not None:
                paged_write(dst, self.copy_blocks.table.tensor[rows], x.to(self.dev), start)
            elif isinstance(start, torch.Tensor):
                dst[rows].index_copy_(2, start, x)
            else:
                dst[rows, :, start:start + x.shape[2]].copy_(x)

    def _join_keys(self, row_keys: torch.Tensor, S: int) -> torch.Tensor:
        """Without a key store: a joining row's view [1, Hkv, static_len, D] holding its
        prompt's keys ``row_keys`` [Hkv, T, D] at ``[S - T, S)`` (one buffer, reused; the
        policy reads no position outside the row's ``[kv_start, S)``)."""
        if self.join_buf is None:
            self.join_buf = torch.zeros(1, self.Hkv, self.s.static_len, self.D, dtype=self.dt, device=self.dev)
        self.join_buf[0, :, S - row_keys.shape[1]:S].copy_(row_keys)
        return self.join_buf

    def renew(self, s: P.Setup, kv_lens: torch.Tensor, kv_start: torch.Tensor | None) -> None:
        """A new serving epoch on this generation's state and buffers (``CacheRank._generation``):
        every row idle at the new cursor ``s.prompt_len``; the policy state, the buffers and
        the rank's graphs stay."""
        rank, state = self.rank, self.state
        self.s, self.T = s, s.prompt_len
        self.hooks = P.CacheHooks(**s.hooks)
        rank.stats["generations"] += 1
        rank.stats["renewed"] = rank.stats.get("renewed", 0) + 1
        self.kv_lens = kv_lens  # (read eagerly per step: kv_obs / kv_sel, which graphs read, derive from it)
        with rank._on():
            if kv_start is not None:
                if state.kv_start is None:
                    state.kv_start = kv_start.to(self.dev).clone()
                else:
                    state.kv_start.copy_(kv_start)
            state.seq_len = self.T
            if state.idle is None:
                state.idle = torch.ones(self.B, dtype=torch.bool, device=self.dev)
            state.idle.fill_(True)
            if self.copy_blocks is not None:  # every row idle: every copy block free
                self.copy_blocks.free_all()
                self.copy_blocks.sync()
        self.plan = 1
        self._renewed = True
        # the threshold carry's counters run on: this epoch's account is what it adds (one read per epoch)
        self._carry0 = _carry_account(state)

    async def run(self) -> None:
        T, s = self.T, self.s
        if not s.serving:  # (serving: every row idle until a JOIN)
            await self._boot()
        if self._renewed:
            self._renewed = False
            self._epoch()
        else:
            self._buffers()
        if T + 1 > s.theta and not s.serving:
            for p in range(len(self.packs)):
                await self._select_and_send(p, s.first_step, T + 1)
        while True:
            tw = time.perf_counter()
            msg = await self.t.recv("ctl")
            waited = time.perf_counter() - tw
            c = msg[0].tolist()
            if c[0] == P.END:  # acknowledge: the inference rank drains "sel" up to this marker
                await self._end()
                return
            if c[0] == P.SHUTDOWN:
                raise _Shutdown()
            if c[0] == P.JOIN:
                await self._join(c[1], c[2], c[3], msg[1].tolist(), msg[2], msg[3])
                continue
            if c[0] == P.LEAVE:
                self._leave(msg[1], msg[2])
                continue
            if c[0] != P.STEP:
                raise TransportError(f"cache rank: expected STEP/END, got command {c[0]}")
            await self._step(c[1], c[2], waited)

    async def _boot(self) -> None:
        """The prompt's K/V (unless shared) and last queries, layer by layer, into ``policy.prefill``."""
        t, s, T, rank = self.t, self.s, self.T, self.rank
        blocks = self.copy_blocks
        if blocks is not None:  # a static batch on a paged cache: every row's prompt positions [0, T)
            with rank._on():
                blocks.free_all()
                for row in range(self.B):
                    blocks.map(row, 0, T)
                blocks.sync()
        for layer in range(self.n_layers):
            msg = await t.recv("boot")
            if self.hooks.die_at_boot_layer == layer:
                await self._die()
            with rank._on():
                q_tail = msg[0]
                if self.lean:  # no store: the prompt's keys as they came
                    k, v = msg[1].to(self.dev), self.no_v
                    if blocks is not None:  # the copies into pools through this rank's table
                        self.state.join_pool, self.state.block_table = (self.kview, blocks.table.tensor), None
                else:
                    if not s.shared_kv:
                        self._store(layer, msg[1], msg[2] if self.vstore is not None else None, 0)
                    k, v = self.view(layer, T)
                bt = self.state.block_table
                if bt is not None:  # shared pools: the rows' first T positions, contiguous (a prefill's keys)
                    pool = k
                    k = logical_keys(k, self.state, T)
                    v = k.new_empty(k.shape[0], k.shape[1], 0, k.shape[3])  # (policies that select ahead read none)
                    self.state.block_table = None
                    self.state.join_pool = (pool, bt)  # state kept in the pools' layout goes there
                try:
                    self.policy.prefill(self.state, layer, q_tail, k, v, self.kv_lens)
                finally:
                    self.state.join_pool = None
                    if blocks is not None:
                        self.state.block_table = blocks.table.tensor
            del msg, q_tail
            await t.send("boot_ack", [torch.tensor([layer], dtype=torch.int64)])

    def _set_idle(self, idle: torch.Tensor) -> None:
        """The rows no request decodes in (JOIN / LEAVE's mask, cpu; in place: captured work
        reads the same tensor) and the plan of the others. A cache rank restarted mid-serving
        booted as a static batch (every row in use) and gets its first mask here."""
        if self.state.idle is None:
            self.state.idle = idle.to(self.dev, torch.bool).clone()
        else:
            # a fresh host copy, sent without waiting for the queued work
            self.state.idle.copy_(idle.to(torch.bool, copy=True), non_blocking=True)
        self.plan = kernels.row_bucket(self.B - int(idle.sum()), self.B)

    async def _join(self, S: int, step: int, gen: int, rows: list[list[int]], kv_start: torch.Tensor,
                    idle: torch.Tensor) -> None:
        """Serving: requests join rows ``rows`` ([row, prompt length]) at cursor ``S``
        before decode step ``step``: each row's state becomes its request's alone
        (``policy.prefill_rows`` on its prompt's keys and last queries), then step
        ``step``'s selections are made again and sent tagged ``gen``."""
        t, s, rank, policy, state = self.t, self.s, self.rank, self.policy, self.state
        with rank._on():
            if state.kv_start is None:
                state.kv_start = kv_start.to(self.dev).clone()
            else:
                state.kv_start.copy_(kv_start.to(self.dev))
            self._set_idle(idle)
            kv_lens = torch.full((1,), S, dtype=torch.int64, device=self.dev)
        state.seq_len = S
        pool = self.copy_blocks
        if pool is not None:  # the joining rows' blocks for their prompts' positions [S - T, S)
            with rank._on():
                self._free_idle_copies(idle)
                for row, T in rows:
                    pool.free(row)
                    pool.map(row, S - T, S)
                pool.sync()
        for layer in range(self.n_layers):
            for row, T in rows:
                msg = await t.recv("boot")
                with rank._on():
                    if self.lean:  # no store: the row's prompt keys alone, its [0, S)
                        k, v = self._join_keys(msg[1][0], S)[:, :, :S], self.no_v[:1]
                        if pool is not None:  # into the pool copies through this rank's table
                            state.join_pool, state.block_table = (self.kview, pool.table.tensor), None
                    else:
                        if not s.shared_kv:  # the row's prompt keys (and values) into the store
                            self._store(layer, msg[1][:1], msg[2][:1] if self.vstore is not None else None, S - T,
                                        slice(row, row + 1))
                        k, v = self.view(layer, S)
                        if state.block_table is None:
                            k, v = k[row:row + 1], v[row:row + 1]
                    if state.block_table is not None:  # pools (shared, or this rank's): the row's [0, S), contiguous
                        k_pool = k
                        k = paged_range(k_pool, state.block_table[row], 0, S)
                        v = k.new_empty(1, k.shape[1], 0, k.shape[3])  # (policies that select ahead read no values)
                        state.join_pool, state.block_table = (k_pool, state.block_table), None
                    try:
                        policy.prefill_rows(state, layer, [row], msg[0], k, v, kv_lens)
                    finally:
                        state.join_pool = None
                        if pool is not None:
                            state.block_table = pool.table.tensor
                del msg
            await t.send("boot_ack", [torch.tensor([layer], dtype=torch.int64)])
        self.gen = gen
        rank.stats["joins"] = rank.stats.get("joins", 0) + len(rows)
        if S + 1 > s.theta:  # the selections already sent for ``step`` used the rows' old content
            for p in range(len(self.packs)):
                await self._select_and_send(p, step, S + 1)

    def _leave(self, kv_start: torch.Tensor, idle: torch.Tensor) -> None:
        """Serving: rows left; their windows start at the cursor of their leave (in place:
        captured selections read the same tensor), so their old tokens are not scanned."""
        state = self.state
        with self.rank._on():
            if state.kv_start is None:
                state.kv_start = kv_start.to(self.dev).clone()
            else:
                state.kv_start.copy_(kv_start.to(self.dev))
            self._set_idle(idle)
            self._free_idle_copies(idle)
        self.rank.stats["leaves"] = self.rank.stats.get("leaves", 0) + 1

    def _free_idle_copies(self, idle: torch.Tensor) -> None:
        """The rows no request decodes in (JOIN / LEAVE's mask: a JOIN carries the leaves
        since the last message too) give their scoring copies' blocks back."""
        if self.copy_blocks is not None:
            for row in torch.nonzero(idle.to(torch.bool)).flatten().tolist():
                self.copy_blocks.free(row)
            self.copy_blocks.sync()

    def _epoch(self) -> None:
        """The host state of one generation (a serving epoch: of each epoch on the same buffers)."""
        self.prev: dict[int, torch.Tensor] = {}  # delta mode: the last indices the inference rank holds per layer
        self.stalled = False
        self.acct: dict[str, list[float]] = {"host": [], "send": [], "wait": []}  # this generation's host time (s)
        self.rank.generation_stats = {}
        self.sel_seq = -1  # the cache length kv_sel holds (one update per step, not per pack)
        self.gen = 0  # serving: the inference rank's join counter of the last JOIN

    def _buffers(self) -> None:
        """The generation's host state and the fixed device buffers: inputs copied in per
        pack, outputs read out per pack, so that a pack's work can be replayed as a CUDA graph."""
        s, rank = self.s, self.rank
        self._epoch()
        self.graphs_on = rank._graphs_enabled(s)
        rank._graphs = {}
        rank._seen = set()
        self.q_in: dict[int, list[torch.Tensor]] = {}
        self.parts: dict[int, tuple] = {}
        self.out: dict[int, dict] = {}
        self.Hq = self.spec.n_q_heads
        with rank._on():
            self.kv_obs = self.kv_lens.clone()
            self.kv_sel = self.kv_lens.clone()
            self.pos_buf = torch.zeros(1, dtype=torch.int64, device=self.dev)
        # Keys the policy never reads back (compressed scoring keys, no kv gathers) go
        # straight from the received pack into observe: no store (``lean``). Only with a
        # fixed-length view (static_len), so the policy's copy never needs a rebuild from
        # stored keys (it raises if it would).
        self.new_keys = self.lean
        self.append_k = not s.shared_kv and not self.new_keys

    def _observe_pack(self, p: int, seq: int) -> None:
        l0, l1 = self.packs[p]
        policy, state = self.policy, self.state
        state.seq_len = seq
        qb = self.parts[p]  # (q, k, v) views of the pack's input buffers
        for j, layer in enumerate(range(l0, l1)):
            if self.append_k:  # append the step's k, v at the device-side position
                self._store(layer, qb[1][j].unsqueeze(2), qb[2][j].unsqueeze(2) if self.vstore is not None else None,
                            self.pos_buf)
            k, _ = self.view(layer, seq)
            if self.new_keys:
                policy.observe(state, layer, qb[0][j], k, self.kv_obs, k_new=qb[1][j])
            else:
                policy.observe(state, layer, qb[0][j], k, self.kv_obs)

    def _select_pack(self, p: int, seq: int) -> tuple:
        """Selections of pack ``p`` at cache length ``seq`` into the pack's output
        buffers; returns the host facts of the message (dense flags, sinks, K)."""
        l0, l1 = self.packs[p]
        policy, state, out = self.policy, self.state, self.out
        state.seq_len = seq
        sels = []
        policy.predict_layers(state, range(l0, l1), self.kv_sel)  # e.g. asyncspade: the pack's predictions in one launch
        # the output rows of the last call of this pack: a policy that takes them writes
        # its indices there directly (select_takes_out); a fresh buffer below gets copies
        rows = out[p]["rows"] if p in out and policy.select_takes_out else None
        # layer j's top-K select beside layer j+1's scoring (kernels.select_overlap; joined
        # on exit, before anything below reads the indices); grids sized for the rows in use
        with shared_derived(state), kernels.select_overlap(self.dev), kernels.plan_rows(self.plan, self.B):
            for j, layer in enumerate(range(l0, l1)):
                k, _ = self.view(layer, seq)
                if rows is None:
                    sels.append(policy.select(state, layer, None, k, self.kv_sel))
                else:
                    sels.append(policy.select(state, layer, None, k, self.kv_sel, out=rows[j]))
        K = max((sel.indices.shape[2] for sel in sels if sel is not None), default=0)
        info = tuple((sel is None, 0 if sel is None else sel.n_sink, 0 if sel is None else sel.n_recent)
                     for sel in sels) + (K,)
        if K == 0:
            return info
        self._fill_out(p, seq, sels, K)
        return info

    def _fill_out(self, p: int, seq: int, sels: list, K: int) -> None:
        """Pack ``p``'s output buffers (made or remade for width ``K``): the indices, -1 padded,
        and in the kv return mode the gathered K/V."""
        l0, l1 = self.packs[p]
        s, dev, dt, B, Hkv, D = self.s, self.dev, self.dt, self.B, self.Hkv, self.D
        o = self.out.get(p)
        n = l1 - l0
        if o is None or o["idx"].shape[-1] != K:
            o = self.out[p] = {"idx": torch.empty(n, B, Hkv, K, dtype=torch.int32, device=dev)}
            o["rows"] = list(o["idx"].unbind(0))  # fixed view objects: `sel.indices is rows[j]`
            if s.return_mode == "kv":
                o["k"] = torch.empty(n, B, Hkv, K, D, dtype=dt, device=dev)
                o["v"] = torch.empty(n, B, Hkv, K, D, dtype=dt, device=dev)
        idx = o["idx"]
        for j, sel in enumerate(sels):
            if sel is None:
                idx[j].fill_(-1)  # no selection: all -1
            elif sel.indices is not o["rows"][j]:  # (written in place otherwise)
                w = sel.indices.shape[2]
                if w < K:
                    idx[j, :, :, w:].fill_(-1)  # a narrower selection leaves -1 padding
                idx[j, :, :, :w].copy_(sel.indices)
            if sel is not None:
                if s.return_mode == "kv":
                    k, v = self.view(l0 + j, seq)  # (a shared paged cache's pools: its table is the state's)
                    kk, vv = kernels.gather_kv(k, v, idx[j], block_table=self.state.block_table)
                    o["k"][j].copy_(kk)
                    o["v"][j].copy_(vv)

    async def _select_and_send(self, p: int, step: int, seq: int) -> None:
        hooks, rank = self.hooks, self.rank
        if hooks.stall_from_step is not None and step >= hooks.stall_from_step:
            self.stalled = True
            return
        if hooks.delay_s > 0 and step >= hooks.delay_from_step:
            await asyncio.sleep(hooks.delay_s)
        t0 = time.perf_counter()
        with rank._on():
            if seq != self.sel_seq:  # the step's first pack (later packs select at the same length)
                torch.add(self.kv_lens, seq - self.T, out=self.kv_sel)
                self.sel_seq = seq
            key = ("select", p, self.plan, _key(self.policy, self.state, seq))
            info = rank._run(key, lambda: self._select_pack(p, seq), self.graphs_on)
            tensors = rank._encode(info, self.out.get(p), p, step, seq, self.s, self.view, self.prev,
                                   self.packs[p][0], self.gen)
        t1 = time.perf_counter()
        rank.stats["select_host_s"] += t1 - t0
        rank.stats["selections"] += 1
        await self.t.send("sel", tensors)
        self.acct["send"].append(time.perf_counter() - t1)
        return t1 - t0

    async def _step(self, seq: int, step: int, waited: float) -> None:
        """One decode step: each pack's q/k/v in, observed, and the next step's selection out."""
        t, s, rank, hooks = self.t, self.s, self.rank, self.hooks
        if hooks.die_at_step is not None and step >= hooks.die_at_step:
            await self._die()
        with rank._on():
            if self.append_k:
                self.pos_buf.fill_(seq - 1)
            torch.add(self.kv_lens, seq - self.T, out=self.kv_obs)
            if self.copy_blocks is not None:  # the step's key (position seq - 1) lands in each row's copy
                self.copy_blocks.grow(seq - 1)
                self.copy_blocks.sync()
        q_in, parts, Hq, Hkv = self.q_in, self.parts, self.Hq, self.Hkv
        for p in range(len(self.packs)):
            tw = time.perf_counter()
            msg = await t.recv("qkv")
            t0 = time.perf_counter()
            waited += t0 - tw
            with rank._on():
                if p not in q_in:
                    q_in[p] = [torch.empty_like(x) for x in msg]
                    if len(msg) == 1 and msg[0].shape[2] == Hq + 2 * Hkv:  # fused [n, B, Hq + 2 Hkv, D]
                        f = q_in[p][0]
                        parts[p] = (f[:, :, :Hq], f[:, :, Hq:Hq + Hkv], f[:, :, Hq + Hkv:])
                    else:  # [q, k, v] or [q] (shared cache)
                        parts[p] = tuple(q_in[p])
                for dst, src in zip(q_in[p], msg):
                    dst.copy_(src, non_blocking=True)
                del msg
                rank._run(("observe", p, _key(self.policy, self.state, seq)), lambda: self._observe_pack(p, seq),
                          self.graphs_on)
            host = time.perf_counter() - t0
            rank.stats["packs"] += 1
            if seq + 1 > s.theta and not self.stalled:
                host += await self._select_and_send(p, step + 1, seq + 1) or 0.0
            self.acct["host"].append(host)
            rank.consumed += 1
        self.acct["wait"].append(waited)

    async def _die(self) -> None:
        """A test hook's crash: the process exits at once, or (in-process) the transport
        end closes without a word."""
        if not self.rank.in_process:
            os._exit(17)  # a crashed cache process, no goodbye
        await self.t.close()
        raise PeerGone("cache rank: died on purpose (test hook)")

    async def _end(self) -> None:
        """END: the generation's stats after the end marker; free the generation's graphs."""
        rank, dev = self.rank, self.dev
        end = torch.full((1, P.META), -1, dtype=torch.int64)
        carry = {k: v - self._carry0.get(k, 0.0) for k, v in _carry_account(self.state).items()}
        rank.generation_stats = {**_account(self.acct), **carry}
        await self.t.send("sel", [end, P.stats_tensor(rank.generation_stats)])
        if dev.type == "cuda":  # buffers of this generation were used on several streams
            torch.cuda.synchronize(dev)
        if not self.s.serving:  # (a serving epoch's graphs serve the next epoch: CacheRank._generation)
            rank._graphs = {}
            rank._seen = set()


@contextlib.contextmanager
def _device_no_grad(device: torch.device):
    with torch.no_grad(), torch.cuda.device(device):
        yield


def _account(acct: dict[str, list[float]]) -> dict[str, float]:
    """``protocol.CACHE_STATS`` of one generation from its per-pack / per-step host times."""
    def med_ms(xs: list[float]) -> float:
        return 1e3 * statistics.median(xs) if xs else float("nan")

    return {"packs": float(len(acct["host"])), "selections": float(len(acct["send"])),
            "host_ms_per_pack": med_ms(acct["host"]), "send_ms_per_pack": med_ms(acct["send"]),
            "recv_wait_ms_per_step": med_ms(acct["wait"])}


def _carry_account(state) -> dict[str, float]:
    """The threshold-carry top-K's calls and fallbacks of this generation, over every
    layer's state (one device read, at END); empty when no layer carries one."""
    carries = list(state.carry.values())
    if not carries:
        return {}
    from spade.kernels.carry import CARRY_SLOTS

    c = torch.stack([x.reshape(-1, CARRY_SLOTS).to(torch.int64) for x in carries]).sum((0, 1)).cpu()
    return {"topk_calls": float(c[3]), "topk_fallbacks": float(c[2]), "topk_fallbacks_too_many": float(c[7])}


def _epoch_key(s: P.Setup) -> str:
    """What two serving BOOTs must share for the second to renew the first's generation:
    the whole setup but the cursor."""
    d = dataclasses.asdict(s)
    d.pop("prompt_len")
    return json.dumps(d, sort_keys=True)


def _key(policy: Policy, state, seq: int) -> tuple:
    """The policy's host facts at cache length ``seq`` (``Policy.graph_key``)."""
    keep = state.seq_len
    state.seq_len = seq
    try:
        return tuple(policy.graph_key(state))
    finally:
        state.seq_len = keep

"""``spade.AsyncEngine``: continuous batching behind an asyncio API (vLLM's conventions).

>>> import asyncio, spade                                     # doctest: +SKIP
>>> engine = spade.AsyncEngine(spade.load_config("configs/cpu_tiny.yaml"))
>>> async def main():
...     async for out in engine.generate("Hello", spade.SamplingParams(max_tokens=8), "r1"):
...         print(out.delta_text, end="", flush=True)
...     await engine.close()
>>> asyncio.run(main())

One scheduler task on the caller's event loop drives a worker thread that owns the
model (prefills, decode steps, sampling): between two decode steps it retires
finished and aborted requests and admits waiting ones (FIFO, into free row slots;
``spade.serving.slots`` says when a request fits), prefilling their prompts in pieces
of at most ``serving.prefill_chunk`` tokens per iteration while rows decode (chunked
prefill: the running rows keep decoding), then runs one decode step for every row.
Each request samples with its own ``SamplingParams`` (a per-request
``torch.Generator`` when it samples, so its tokens do not depend on its batch mates)
and streams one ``RequestOutput`` per token (``SamplingParams.output_kind``: everything
so far, only what is new, or just the last one).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional, Sequence, Union

import torch

from spade.config import SpadeConfig
from spade.engine import check_prompt_text, check_prompts, load_model
from spade.errors import ArgumentError, ArgumentTypeError, ConfigError, EngineClosedError
from spade.runtime.protocol import TOPK_STATS
from spade.serving.detok import IncrementalDetokenizer
from spade.serving.params import RequestOutput, RequestOutputKind, SamplingParams, _output_kind
from spade.streams import device_index

log = logging.getLogger(__name__)

#: topologies a slot batch serves today (``check_served`` says which policies each runs)
SERVED_TOPOLOGIES = ("inline", "colocated", "local", "multiprocess")


def check_served(config: SpadeConfig) -> None:
    """Refuse, before the model loads, what ``AsyncEngine`` cannot serve, with a
    ``ConfigError`` naming the field, its value and the fix."""
    rt, pc = config.runtime, config.policy
    if rt.topology not in SERVED_TOPOLOGIES:
        raise ConfigError(
            f"runtime.topology {rt.topology!r} is not served by spade.AsyncEngine yet (its cache rank does not "
            f"follow requests joining and leaving the batch there); use runtime.topology: "
            f"{', '.join(SERVED_TOPOLOGIES)}")
    if pc.name == "asyncspade":
        from spade.policies.asyncspade import serving_refusal

        why = serving_refusal(pc)
        if why is not None:
            raise ConfigError(why)
    if config.model.backend == "hf":
        raise ConfigError("model.backend 'hf': spade.AsyncEngine needs the fast backend's row slots; set "
                          "model.backend: fast (or auto)")


@dataclass
class _Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    kind: RequestOutputKind
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float
    generator: Optional[torch.Generator] = None
    row: int = -1
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # the whole text so far (cut at a stop string)
    detok: Optional[IncrementalDetokenizer] = None  # the text of output_ids, a window per token
    sent: int = 0  # the characters of ``text`` already streamed (a prefix that no longer changes)
    sent_ids: int = 0  # the ids of ``output_ids`` already streamed
    pending: Optional[int] = None  # the sampled token the next decode step feeds
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[str, int]] = None
    admitted: Optional[float] = None
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    abort: bool = False
    done: bool = False  # the iterator got its last item
    held: bool = False  # it waited, with rows free, for the batch to drain (the shared cursor)

    def push(self, item) -> None:
        """Hand ``item`` (an output or an exception) to the request's iterator, from any thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            pass


def _deliver(items: list) -> None:
    """(On the requests' loop.) Hand each (queue, item) to its request's iterator, in order."""
    for queue, item in items:
        queue.put_nowait(item)


class AsyncEngine:
    """Continuous batching over ``serving.max_batch`` row slots of the static KV cache.

    ``generate(prompt, params, request_id)`` is an async iterator of ``RequestOutput``
    (one per generated token, the last with ``finish_reason`` set; ``params.output_kind``
    ``"final_only"``: the last one only); ``abort(request_id)``
    ends a request (its iterator ends with ``finish_reason="abort"``; an unknown id is
    a no-op, as in vLLM); ``close()`` aborts everything and frees the model.
    ``stats()`` (alias ``metrics()``) is a dict of counters for a server's /metrics.

    Supported: ``runtime.topology`` ``inline`` (every policy); ``colocated``, ``local`` and
    ``multiprocess`` with the policies that select a step ahead (``asyncspade``, ``tova``,
    ``streaming``) on a cache rank that follows the rows (every ``return_mode``;
    ``spade.serving.async_slots``; a policy's ``prefill_rows`` resets a joining row) and with
    the policies those topologies run on the inference rank (``full``, ``quest``,
    ``oracle``); the fast backend (``model.backend``
    ``fast`` or ``auto``; ``hf`` is refused). ``check_served`` refuses the rest. Prompts
    are used as given (no chat template). ``cache_hooks``: ``spade.runtime.protocol.CacheHooks``
    for tests (a slow or dying cache rank).
    """

    def __init__(self, config: SpadeConfig, *, progress: Callable[[str], None] | None = None,
                 cache_hooks=None):
        self.cfg = config
        rt = config.runtime
        check_served(config)
        # model.backend auto means fast here, on a CPU too (the static batch picks hf there for real weights)
        parts = load_model(config, max_batch=config.serving.max_batch, say=progress, backend="fast")
        self.device, self.dtype = parts.device, parts.dtype
        self.backend, self.policy = parts.backend, parts.policy
        from spade.runtime.selector import is_async_policy
        from spade.serving.slots import SlotBatch

        if rt.topology != "inline" and is_async_policy(self.policy):
            # the policy selects one step ahead on a cache rank that follows the rows
            from spade.runtime.asyncrt import AsyncRuntime
            from spade.serving.async_slots import AsyncSlotBatch

            runtime = AsyncRuntime(config, self.backend, self.policy, hooks=cache_hooks)
            self.batch = AsyncSlotBatch(self.backend, self.policy, rt.sparse_threshold, runtime)
        else:  # inline, and the policies every topology runs on the inference rank
            self.batch = SlotBatch(self.backend, self.policy, rt.sparse_threshold)
        self.tokenizer = getattr(self.backend, "tokenizer", None)
        self.eos = set(getattr(self.backend, "eos_token_ids", []) or [])
        self.vocab = int(self.backend.vocab_size)
        self.max_seq_len = int(self.backend.max_seq_len)
        self._lock = threading.Lock()  # the queues and flags shared with the worker thread
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: dict[int, _Request] = {}  # row -> request
        self._requests: dict[str, _Request] = {}  # id -> request (waiting or running)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spade-serve")
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._seeds = torch.Generator().manual_seed(config.generation.seed)  # seeds of unseeded sampled requests
        self._step_tokens = torch.zeros(self.batch.B, dtype=torch.long, device=self.device)
        #: the worker thread's outputs of the iteration in flight, handed to their loops at its end in
        #: one wake-up per loop (not one per request and token); None outside an iteration
        self._outbox = threading.local()
        self._counts = collections.Counter()
        self._times = {"prefill_s": 0.0, "decode_s": 0.0}  # worker wall time in joins and in decode steps
        # CUDA: the stream's time in each iteration's prompt pieces and decode step, from event pairs read
        # once complete (no sync); the host times above only say how long the launches took
        self._events: Optional[collections.deque] = collections.deque() if self.device.type == "cuda" else None
        self._device_times = {"prefill_device_s": None, "decode_device_s": None} if self._events is None else \
            {"prefill_device_s": 0.0, "decode_device_s": 0.0}

    # ------------------------------------------------------------------ public API
    async def generate(self, prompt: Union[str, Sequence[int], torch.Tensor], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the generation of ``prompt`` (text, or token ids used as given) with
        ``params`` (default ``SamplingParams()``): one ``RequestOutput`` per token, the
        last one with ``finish_reason`` set (``params.output_kind``: each holds everything
        so far, or only what is new; or only the last one comes). Leaving the loop early
        aborts the request. Bad input raises ``ArgumentError`` / ``ArgumentTypeError``
        before any work."""
        req = self._make_request(prompt, params, request_id)
        self._add(req)
        try:
            while True:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    req.done = True
                    raise item
                if item.finished:
                    req.done = True
                yield item
                if item.finished:
                    return
        finally:
            if not req.done:  # the caller stopped listening (break, cancel): free its slot
                await self.abort(req.id)

    async def abort(self, request_id: str) -> None:
        """End the request ``request_id``: its slot is freed before the next decode step and
        its iterator ends with ``finish_reason="abort"``. An unknown (or finished) id is a
        no-op, as in vLLM: a request may finish while its abort is on the way."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                return
            req.abort = True
            if req.row < 0 and req in self._waiting:  # not admitted: end it here
                self._waiting.remove(req)
                self._finish(req, "abort")
        self._poke()

    async def close(self) -> None:
        """Abort every request, stop the scheduler and free the model; idempotent. Later
        ``generate`` calls raise ``EngineClosedError``."""
        if self._closed:
            return
        self._closed = True
        self._poke()
        task = self._task
        if task is not None and not task.done() and self._loop is asyncio.get_running_loop():
            try:
                await task  # it sees the flag, aborts everything and shuts down
            except Exception:  # the scheduler's own failure was reported to its requests
                pass
            return
        # no scheduler on this loop (never started, or its loop ended): after any step in flight
        await asyncio.wrap_future(self._pool.submit(self._abort_all))
        self._shutdown()

    def stats(self) -> dict:
        """Counters for a server's /metrics (host values, no device sync)."""
        with self._lock:
            running, waiting = len(self._running), len(self._waiting)
        b = self.batch
        c = self._counts
        return {
            "requests_running": running, "requests_waiting": waiting, "requests_prefilling": len(b.prefilling),
            "slots_used": b.used(), "slots_free": b.B - b.used(), "slots": b.B,
            **({"kv_blocks_used": self.backend.kv_blocks_used(), "kv_blocks_free": self.backend.kv_blocks_free(),
                "kv_blocks_reserved": self.backend.kv_blocks_free() - b.blocks_available()} if b.paged else {}),
            "requests_finished": c["finished"], "requests_aborted": c["aborted"], "requests_failed": c["failed"],
            "prompt_tokens": c["prompt_tokens"], "tokens_generated": c["tokens"],
            "steps": b.steps, "sparse_steps": b.sparse_steps, "mixed_steps": b.mixed_steps,
            "cursor": b.cursor, "cursor_resets": b.resets, "joins_held_by_cursor": c["held_by_cursor"],
            "joins": b.joins, "joins_into_running": b.joins_running, "prefill_pieces": c["prefill_pieces"],
            "prefill_s": self._times["prefill_s"], "decode_s": self._times["decode_s"], **self._device_stats(),
            "late_packs": 0, **dict.fromkeys(TOPK_STATS),  # (no cache rank: inline selections)
            **self._cache_stats(),
            "closed": self._closed,
        }

    def _device_stats(self) -> dict:
        with self._lock:
            if self._events is not None:
                self._account_device()
            return dict(self._device_times)

    def _account_device(self) -> None:
        """(Under the lock.) Add the completed iterations' stream times (events that have
        not completed stay queued: no sync)."""
        q, t = self._events, self._device_times
        while q and q[0][2].query():
            e0, e1, e2 = q.popleft()
            t["prefill_device_s"] += e0.elapsed_time(e1) / 1e3
            t["decode_device_s"] += e1.elapsed_time(e2) / 1e3

    def _cache_stats(self) -> dict:
        live = getattr(self.batch, "live", None)
        if live is None:
            return {}
        t = live()
        return {"late_packs": t["late_packs"], **{k: t[k] for k in TOPK_STATS}, "cache_epochs": t["epochs"],
                "cache_restarts": t["restarts"], "cache_peers_lost": t["peers_lost"],
                "cache_dense_fallback_steps": t["dense_fallback_steps"],
                "dropped_selections": t["dropped_selections"],
                "join_resyncs": t["join_resyncs"], "join_wait_s": t["join_wait_s"], "cache_leaves": t["leaves"]}

    metrics = stats

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ input checks
    def validate(self, prompt: Union[str, Sequence[int], torch.Tensor],
                 params: SamplingParams | None = None) -> list[int]:
        """The token ids of ``prompt`` if ``generate(prompt, params)`` would take it, else
        the ``ArgumentError`` / ``ArgumentTypeError`` it would raise; starts no work. For
        callers that submit several requests only once all of them are known good."""
        return self._checked(prompt, params)[0]

    def _checked(self, prompt, params) -> tuple[list[int], SamplingParams, RequestOutputKind]:
        if self._closed:
            raise EngineClosedError("this AsyncEngine is closed (close() was called); build a new "
                                    "spade.AsyncEngine(cfg)")
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise ArgumentTypeError(f"params: expected a spade.SamplingParams, got {type(params).__name__}; "
                                    "e.g. SamplingParams(max_tokens=64)")
        kind = _output_kind(params.output_kind)  # (a field may have been set after construction)
        ids = self._encode(prompt)
        T = len(ids)
        if T + params.max_tokens > self.max_seq_len:
            raise ArgumentError(
                f"SamplingParams.max_tokens: the prompt has {T} tokens and max_tokens is {params.max_tokens}, "
                f"{T + params.max_tokens} in all, over model.max_seq_len ({self.max_seq_len}); lower max_tokens to "
                f"at most {self.max_seq_len - T}, shorten the prompt, or raise model.max_seq_len")
        b = self.batch
        if b.paged:  # the most blocks its window can span (its first position may sit anywhere in a block)
            need, cap = -(-(T + params.max_tokens - 1) // b.block_size) + 1, self.backend.kv_pool.capacity
            if need > cap:
                raise ArgumentError(
                    f"SamplingParams.max_tokens: the prompt ({T} tokens) and max_tokens ({params.max_tokens}) "
                    f"may need {need} KV blocks of {b.block_size} tokens, more than the pool's {cap} "
                    f"(model.kv_blocks); lower max_tokens, shorten the prompt, or raise model.kv_blocks")
        if params.stop and self.tokenizer is None:
            raise ArgumentError(f"SamplingParams.stop: model '{self.cfg.model.name}' has no tokenizer, so there is "
                                "no text to find stop strings in; use stop_token_ids")
        bad = [t for t in params.stop_token_ids if t >= self.vocab]
        if bad:
            raise ArgumentError(f"SamplingParams.stop_token_ids: {bad[0]} is outside the vocabulary "
                                f"[0, {self.vocab}) of model '{self.cfg.model.name}'")
        return ids, params, kind

    def _make_request(self, prompt, params, request_id) -> _Request:
        ids, params, kind = self._checked(prompt, params)
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str) or not request_id:
            raise ArgumentTypeError(f"request_id: expected a non-empty str (or None for a fresh one), got "
                                    f"{request_id!r}")
        gen = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2 ** 62, (1,),
                                                                                 generator=self._seeds))
            gen = torch.Generator(device=self.device).manual_seed(seed)
        loop = asyncio.get_running_loop()
        return _Request(id=request_id, prompt_ids=ids, params=params, kind=kind, queue=asyncio.Queue(), loop=loop,
                        arrival=time.perf_counter(), generator=gen)

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            check_prompt_text(prompt, "prompt")
            if not prompt.strip():
                raise ArgumentError("prompt: the prompt is empty; give it some text (or token ids)")
            if self.tokenizer is None:
                raise ArgumentError(f"prompt: model '{self.cfg.model.name}' has no tokenizer (a random-weight "
                                    "preset); pass token ids, e.g. generate([1, 2, 3])")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            if not ids:
                raise ArgumentError("prompt: the text encodes to no tokens; give it some text")
            return list(ids)
        if isinstance(prompt, (list, tuple, torch.Tensor)):
            if isinstance(prompt, (list, tuple)) and not prompt:
                raise ArgumentError("prompt: the token-id list is empty; give at least one token id")
            return check_prompts([prompt], "prompt", self.vocab, self.cfg.model.name)[0]
        raise ArgumentTypeError(f"prompt: expected a str or a list of token ids, got "
                                f"{'None' if prompt is None else type(prompt).__name__}")

    def _add(self, req: _Request) -> None:
        loop = req.loop
        with self._lock:
            if self._closed:
                raise EngineClosedError("this AsyncEngine is closed (close() was called); build a new "
                                        "spade.AsyncEngine(cfg)")
            if req.id in self._requests:
                raise ArgumentError(f"request_id: {req.id!r} is already running or waiting; give each request "
                                    "its own id (or None for a fresh one)")
            if self._loop is not None and self._loop is not loop and not self._loop.is_closed():
                raise RuntimeError("spade.AsyncEngine is bound to the event loop of its first generate(); "
                                   "call it from that loop")
            for old in list(self._requests.values()):  # requests of an event loop that ended: no one listens
                if old.loop.is_closed():
                    old.abort = True
                    if old.row < 0 and old in self._waiting:
                        self._waiting.remove(old)
                        self._finish(old, "abort")
            self._requests[req.id] = req
            self._waiting.append(req)
            self._counts["prompt_tokens"] += len(req.prompt_ids)
        if self._task is None or self._task.done() or self._loop is not loop:
            self._loop = loop
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._scheduler(), name="spade-scheduler")
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:
                pass

    # ------------------------------------------------------------------ the scheduler
    async def _scheduler(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if self._closed:
                    break
                with self._lock:
                    idle = not self._waiting and not self._running
                if idle:
                    await self._wake.wait()
                    self._wake.clear()
                    continue
                more = await loop.run_in_executor(self._pool, self._iteration)
                if not more:
                    await self._wake.wait()
                    self._wake.clear()
        except asyncio.CancelledError:  # its loop is ending: requests of that loop are dropped by _add
            raise
        except Exception as e:  # the scheduler itself failed (a bug): nobody may hang
            log.exception("the spade.AsyncEngine scheduler failed")
            self._fail_all(e)
            raise
        finally:
            if self._closed:
                await loop.run_in_executor(self._pool, self._abort_all)
                self._shutdown()

    def _iteration(self) -> bool:
        """Worker thread: retire aborted requests, admit waiting ones (prefill, first
        token), one decode step for the running rows. Returns whether work remains that
        needs no new event (running rows, or waiting requests that may fit later). The
        iteration's outputs reach their requests together: the joins' first tokens
        after the prompt pieces, the rest after the decode step (one wake-up of the
        requests' loop each, not one per request and token)."""
        self._outbox.items = []
        try:
            return self._iterate()
        finally:
            self._send(reopen=False)

    def _send(self, reopen: bool) -> None:
        """(Worker thread, in an iteration.) Hand the outputs gathered so far to their
        loops; ``reopen``: keep gathering for the rest of the iteration."""
        items, self._outbox.items = self._outbox.items, ([] if reopen else None)
        self._flush(items)

    def _push(self, req: _Request, item) -> None:
        """Stream ``item`` to ``req``: with the worker's iteration's outputs, else at once."""
        box = getattr(self._outbox, "items", None)
        if box is None:
            req.push(item)
        else:
            box.append((req, item))

    @staticmethod
    def _flush(items: list) -> None:
        by_loop: dict = {}
        for req, item in items:
            by_loop.setdefault(req.loop, []).append((req.queue, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that loop is closed: nobody is listening
                pass

    def _iterate(self) -> bool:
        b = self.batch
        with self._lock:
            for row, req in list(self._running.items()):
                if req.abort:
                    self._retire(req, "abort")
            admits = self._admissions()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if self._events is not None else None
        t0 = time.perf_counter()
        stream = torch.cuda.current_stream(self.device) if ev else None
        if ev:
            ev[0].record(stream)
        for req in admits:  # the next piece of each join this iteration (whole prompts: one piece)
            self._prefill(req)
        if self._outbox.items:  # joins' first tokens: streamed now, not after the decode step
            self._send(reopen=True)
        t1 = time.perf_counter()
        if ev:
            ev[1].record(stream)
        with self._lock:
            rows = {row: req for row, req in self._running.items() if req.pending is not None}
            joining = bool(b.prefilling)
        if rows or joining:  # a join in progress needs the cursor to move one step per piece
            self._decode(rows)
        t2 = time.perf_counter()
        if ev:
            ev[2].record(stream)
        with self._lock:
            self._times["prefill_s"] += t1 - t0
            self._times["decode_s"] += t2 - t1
            if ev:
                self._events.append(ev)
                self._account_device()
            # waiting requests that do not fit yet become admissible as the cursor moves
            return bool(self._running) or (bool(self._waiting) and b.empty)

    def _admissions(self) -> list[_Request]:
        """(Under the lock.) The requests whose next prompt piece runs this iteration: the
        joins in progress (chunked prefill), then the waiting requests that start joining
        now, FIFO: each takes a free row when it fits (``SlotBatch.fits``); the first that
        does not fit stops admission, so the queue's order holds. An empty batch first moves
        the cursor to fit the head.

        While rows decode (or a join is in progress), an iteration prefills at most
        ``serving.prefill_chunk`` prompt tokens: the next piece of the join in progress,
        then whole prompts that fit in what is left, then the first piece of the next
        prompt (one join in pieces at a time: its pieces must come one per step). With no
        row decoding, or ``prefill_chunk`` 0, every request that fits joins whole."""
        from spade.serving.slots import chunk_sizes

        b = self.batch
        C = self.cfg.serving.prefill_chunk
        out = [self._running[row] for row in sorted(b.prefilling)]
        free = b.free_rows()
        if not self._waiting or not free:
            return out
        if b.empty:
            b.reset(self._reset_cursor(min(len(free), len(self._waiting))))
        decoding = any(r.pending is not None for r in self._running.values())
        budget = None  # prompt tokens left this iteration (None: no limit)
        if C > 0 and (decoding or b.prefilling):
            budget = C - sum(job.next_size for job in b.prefilling.values())
        S = b.cursor
        while self._waiting and free:
            req = self._waiting[0]
            T = len(req.prompt_ids)
            if budget is None:
                sizes = [T]
            elif budget <= 0 or any(len(j.sizes) - j.piece > 1 for j in b.prefilling.values()):
                break  # the budget is spent, or a join has pieces left after this iteration
            else:
                sizes = chunk_sizes(T, budget, C)
            if b.fits(T, req.params.max_tokens, S, len(sizes)) is not None:
                if not req.held and b.used() and b.past_end(req.params.max_tokens, S, len(sizes)):
                    self._held_by_cursor(req, S, len(sizes))
                break
            self._waiting.popleft()
            req.row = free.pop(0)
            self._running[req.row] = req
            req.admitted = time.perf_counter()
            try:
                b.begin_join(req.row, torch.tensor(req.prompt_ids, dtype=torch.long), sizes, req.params.max_tokens)
            except Exception as e:  # (fits said yes: a bug) this request fails, the others go on
                log.warning("request %s cannot join: %s", req.id, e)
                self._fail(req, e)
                continue
            out.append(req)
            if budget is not None:
                budget -= sizes[0]
        return out

    def _held_by_cursor(self, req: _Request, S: int, pieces: int) -> None:
        """``req`` waits, with rows free, until the batch drains: its generation would pass
        the end of the cache from the shared cursor. Counted once per request
        (``joins_held_by_cursor``); the first one of an engine is logged with the fix."""
        req.held = True
        self._counts["held_by_cursor"] += 1
        if self._counts["held_by_cursor"] == 1:
            b = self.batch
            fix = ("raise model.max_seq_len: with a paged KV cache the logical length costs no KV memory "
                   "(the pool stays model.kv_blocks)" if b.paged else
                   "use a paged KV cache (model.block_size, model.kv_blocks) with a model.max_seq_len well above "
                   "prompt + max_tokens, or raise model.max_seq_len")
            log.warning("request %s waits for the batch to drain with %d of %d rows free: the shared write cursor "
                        "(%d) + its max_tokens (%d) passes model.max_seq_len (%d), so requests join in waves; %s "
                        "(docs/serving.md)", req.id, b.B - b.used(), b.B, S + pieces - 1, req.params.max_tokens,
                        b.L, fix)

    def _reset_cursor(self, n: int) -> int:
        """The cursor for an empty batch: the longest prompt among the next ``n`` waiting
        requests whose generations all still fit."""
        reqs = list(itertools.islice(self._waiting, n))
        S = len(reqs[0].prompt_ids)
        longest = reqs[0].params.max_tokens
        for r in reqs[1:]:
            S2 = max(S, len(r.prompt_ids))
            longest2 = max(longest, r.params.max_tokens)
            if S2 + longest2 - 1 > self.max_seq_len:
                break
            S, longest = S2, longest2
        return S

    def _prefill(self, req: _Request) -> None:
        """The next piece of ``req``'s join; after its last, the first token."""
        try:
            logits = self.batch.prefill_next(req.row)
            self._counts["prefill_pieces"] += 1
            if logits is None:  # pieces left: the request decodes after its last one
                return
            tok = self._sample(logits, [req])[0]
        except Exception as e:  # this request fails (its row is freed); the other rows are untouched
            log.warning("prefill of request %s failed: %s", req.id, e)
            with self._lock:
                self._fail(req, e)
            return
        self._counts["prefills"] += 1
        self._token(req, tok)

    def _decode(self, rows: dict[int, _Request]) -> None:
        """One decode step of every row; ``rows`` (maybe none: a join in progress moves the
        cursor) are the requests that sample from it."""
        toks = [0] * self.batch.B
        for row, req in rows.items():
            toks[row] = req.pending
        self._step_tokens.copy_(torch.tensor(toks, dtype=torch.long), non_blocking=True)
        try:
            logits = self.batch.step(self._step_tokens)
            order = sorted(rows)
            if order and len(order) < logits.shape[0]:  # (a host list as an index would wait for the step)
                logits = logits.index_select(0, device_index(order, logits.device))
            new = self._sample(logits, [rows[r] for r in order]) if order else []
        except Exception as e:  # every row of the step fails (its state is unknown); others go on
            log.warning("a decode step failed (%d requests): %s", len(rows), e)
            with self._lock:
                for req in list(self._running.values()):
                    self._fail(req, e)
            return
        for row, tok in zip(order, new):
            self._token(rows[row], tok)

    # ------------------------------------------------------------------ sampling and stopping
    def _sample(self, logits: torch.Tensor, reqs: list[_Request]) -> list[int]:
        """One token per row of ``logits`` [n, V] float32, each with its request's
        parameters: greedy rows by argmax, sampled rows from their own generator. One
        device-to-host copy for all of them."""
        out = logits.argmax(dim=-1)
        for i, req in enumerate(reqs):
            p = req.params
            if p.greedy:
                continue
            x = logits[i].float() / p.temperature
            if p.top_k > 0 and p.top_k < x.numel():
                kth = torch.topk(x, p.top_k).values[-1]
                x = x.masked_fill(x < kth, float("-inf"))
            probs = torch.softmax(x, dim=-1)
            if p.top_p < 1.0:
                sp, si = probs.sort(descending=True)
                keep = sp.cumsum(-1) - sp < p.top_p  # the smallest prefix whose mass reaches top_p
                probs = torch.zeros_like(probs).scatter_(-1, si, sp * keep)
            out[i] = torch.multinomial(probs, 1, generator=req.generator)[0]
        return out.tolist()

    def _token(self, req: _Request, tok: int) -> None:
        """Record ``tok`` for ``req``: stop tokens, EOS, stop strings, max_tokens; stream
        the update; retire the request when it finished."""
        now = time.perf_counter()
        if req.first_token is None:
            req.first_token = now
        req.last_token = now
        self._counts["tokens"] += 1
        p = req.params
        finish = None
        if tok in p.stop_token_ids:
            finish, req.stop_reason = "stop", tok
        elif not p.ignore_eos and tok in self.eos:
            finish = "stop"
        else:
            req.output_ids.append(tok)
            if self.tokenizer is None:  # ids as text: one more, without re-joining them all
                text = f"{req.text} {tok}" if len(req.output_ids) > 1 else str(tok)
            else:  # O(1) decode work per token, not the whole output again (O(n^2) per request)
                if req.detok is None:
                    req.detok = IncrementalDetokenizer(self.tokenizer)
                text = req.text + req.detok.step(req.output_ids)
            if p.stop:
                start = max(0, len(req.text) - max(len(s) for s in p.stop))
                hits = [(text.find(s, start), s) for s in p.stop]
                hits = [(i, s) for i, s in hits if i >= 0]
                if hits:
                    i, s = min(hits)
                    text, finish, req.stop_reason = text[:i], "stop", s
            if finish is None and len(req.output_ids) >= p.max_tokens:
                finish = "length"
            req.text = text
        if finish is None and self.batch.cursor + 1 > self.max_seq_len:
            finish = "length"  # the context limit (admission keeps the cursor short of it)
        if finish is not None and req.detok is not None and not isinstance(req.stop_reason, str):
            # not cut at a stop string: the text of a character still incomplete, as decode() ends it
            req.text += req.detok.flush(req.output_ids)
        with self._lock:
            if finish is not None:
                self._retire(req, finish)
            else:
                req.pending = tok
                if req.kind is not RequestOutputKind.FINAL_ONLY:
                    self._push(req, self._output(req))

    def _visible(self, req: _Request) -> int:
        """The length of the text a running request may stream: without a possibly
        incomplete character at its end, nor the last ``len(stop) - 1`` characters (a
        stop string may be forming there). An index, so that no copy of the text is made."""
        text = req.text
        end = len(text)
        if req.finish_reason is None:
            if req.params.stop:
                end = max(0, end - (max(len(s) for s in req.params.stop) - 1))
            while end and text[end - 1] == "\ufffd":
                end -= 1
        return end

    def _output(self, req: _Request) -> RequestOutput:
        """The update to stream. ``req.text[:req.sent]`` never changes once streamed (text
        only grows, and a stop string is cut past the held-back characters), so the new
        text is ``text[sent:end]``: O(new) work in ``"delta"`` mode, where ``token_ids`` is
        the slice of ids not streamed yet; ``"cumulative"`` copies both (an output must not
        alias a list that later grows)."""
        end = self._visible(req)
        text = req.text
        delta = text[req.sent:end] if end >= req.sent else text[:end]
        req.sent = end
        out_ids = req.output_ids
        n = len(out_ids)
        if req.kind is RequestOutputKind.DELTA:
            ids, whole = out_ids[req.sent_ids:], delta
        else:
            ids, whole = list(out_ids), text[:end]
        req.sent_ids = n
        ttft = req.first_token - req.arrival if req.first_token is not None else None
        tpot = ((req.last_token - req.first_token) / (n - 1)) if n > 1 and req.first_token is not None else None
        queue = req.admitted - req.arrival if req.admitted is not None else None
        return RequestOutput(request_id=req.id, prompt_token_ids=req.prompt_ids, token_ids=ids,
                             text=whole, delta_text=delta, finish_reason=req.finish_reason,
                             stop_reason=req.stop_reason, ttft_s=ttft, tpot_s=tpot, queue_s=queue)

    # ------------------------------------------------------------------ retirement (under the lock)
    def _retire(self, req: _Request, reason: str) -> None:
        """Free the request's row at once and stream its last output."""
        if req.row >= 0 and self._running.get(req.row) is req:
            del self._running[req.row]
            self.batch.leave(req.row)
        req.row = -1
        req.pending = None
        self._finish(req, reason)

    def _finish(self, req: _Request, reason: str) -> None:
        self._requests.pop(req.id, None)
        req.finish_reason = reason
        self._counts["aborted" if reason == "abort" else "finished"] += 1
        self._push(req, self._output(req))

    def _fail(self, req: _Request, exc: BaseException) -> None:
        if req.row >= 0 and self._running.get(req.row) is req:
            del self._running[req.row]
            self.batch.leave(req.row)
        req.row = -1
        req.pending = None
        self._requests.pop(req.id, None)
        self._counts["failed"] += 1
        self._push(req, exc)

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            for req in list(self._running.values()):
                self._fail(req, exc)
            while self._waiting:
                self._fail(self._waiting.popleft(), exc)

    def _abort_all(self) -> None:
        with self._lock:
            for req in list(self._running.values()):
                self._retire(req, "abort")
            while self._waiting:
                self._finish(self._waiting.popleft(), "abort")

    def _shutdown(self) -> None:
        # the batch's cache rank (its session, link and event loop) ends on the worker thread that drives it
        self._pool.submit(self._close_batch)
        self._pool.shutdown(wait=True)
        self._release()

    def _close_batch(self) -> None:
        try:
            self.batch.close()
        except Exception:
            log.exception("closing the serving batch's cache rank failed")

    def _release(self) -> None:
        close = getattr(getattr(self, "backend", None), "close", None)
        if close is not None:
            close()

"""Row slots whose selections come from a cache rank (``colocated``, ``local``,
``multiprocess``): ``AsyncSlotBatch``.

The slot batch of ``spade.serving.slots`` (shared cursor, per-row ``kv_start``,
per-row θ) driven through the asynchronous runtime's ``InferenceSession``, step by
step, on the runtime's own event loop (the engine's worker thread):

* an **epoch** is one cache-rank generation: when the batch is empty and the cursor
  resets, the session ends and a new one boots with every row idle
  (``InferenceSession.begin_serving``);
* a **join** prefills the row here (``FastModel.prefill_row``, whole or in pieces: the
  cache rank hears nothing of a chunked join until its last piece) and records, per
  layer, the prompt's last W queries and (unless the cache rank reads this rank's cache)
  the row's keys; before the next step the joins of the iteration travel as one JOIN and
  the step waits for its selections made after it (``InferenceSession.join_rows``): the
  cache rank's row state is then what the request alone would have, so its tokens
  equal its alone run's;
* a **leave** is told before the next step (a LEAVE, or the next JOIN): the free row's
  window is one token and its selections are ignored until a JOIN resets its state; JOIN
  and LEAVE carry which rows are idle, so the cache rank skips their predictor solves and
  sizes its selection grids for the rows in use;
* per-row θ as in ``SlotBatch``: the cache rank selects for every row once the cursor
  is past θ; rows under their own θ attend densely in a mixed step.
"""

from __future__ import annotations

import torch

from spade.policies.base import Policy
from spade.runtime import protocol as P
from spade.runtime.selector import AsyncSelector
from spade.serving.slots import SlotBatch, SlotContext


#: while some rows are idle, the cache rank hears the ``kv_start`` vector at least every this
#: many steps (a LEAVE carrying only that: the inference rank restarts an idle row's window at
#: its newest token every step), so the cache rank's windows of idle rows stay this short
IDLE_WINDOW_REFRESH = 64

#: the session counters an ``AsyncSlotBatch`` sums over its epochs
_SESSION_COUNTS = ("restarts", "peers_lost", "dropped_selections", "join_wait_s", "join_resyncs",
                   "dense_fallback_steps", "leaves")


class AsyncSlotContext(SlotContext):
    """``SlotContext`` over the session's ``AsyncSelector`` (its key says whether the
    step's selections are the cache rank's or none); in the ``kv`` return mode a sparse
    row's middle tokens come from the K/V the cache rank gathered
    (``AsyncSelector.attend_gathered``)."""

    def graph_key(self) -> tuple:
        return (self.mode, self.rows) + tuple(self.selector.graph_key())

    def _sparse(self, layer, q, k_cache, v_cache, kv_lens, sel, stats):
        s = self.selector  # the kv return mode: the middle tokens from the K/V the cache rank gathered
        if not s.gathered(layer, sel):
            return super()._sparse(layer, q, k_cache, v_cache, kv_lens, sel, stats)
        return s.attend_gathered(layer, q, k_cache, v_cache, kv_lens, sel, scale=self.spec.softmax_scale,
                                 kv_start=sel.kv_start if sel.kv_start is not None else self.kv_start, stats=stats,
                                 block_table=self.block_table)


class AsyncSlotBatch(SlotBatch):
    """A ``SlotBatch`` whose policy runs on a cache rank (``spade.runtime.AsyncRuntime``).

    >>> rt = AsyncRuntime(cfg, backend, policy)                 # doctest: +SKIP
    >>> batch = AsyncSlotBatch(backend, policy, theta=0, runtime=rt)
    >>> batch.reset(cursor=12); logits = batch.join(0, ids); logits = batch.step(tokens)
    >>> batch.close()                                           # ends the session, closes the runtime
    """

    def __init__(self, backend, policy: Policy, theta: int, runtime):
        super().__init__(backend, policy, theta)
        self.rt = runtime
        spec = backend.spec
        self.sel = AsyncSelector(spec, P.packs_of(spec.n_layers, runtime.pack_layers), stage_kv=True, shared=None,
                                 return_mode=runtime.return_mode, rerank=policy.rerank_keep())
        ctx = AsyncSlotContext(spec, self.sel, device=self.device)
        ctx.kv_start = self.kv_start
        ctx.dense_rows = self.ctx.dense_rows
        ctx.idle = self.idle
        self.ctx = ctx
        self.sess = None
        self._joins: dict[int, tuple[int, list[tuple]]] = {}  # row -> (T, per layer (q_tail, k, v)) not sent yet
        self._left = False  # a row left since the last JOIN / LEAVE
        self._told_at = 0  # the cursor at which the cache rank last heard the kv_start vector
        self._recording: list[tuple] | None = None
        self.totals = {"late_packs": 0, "restarts": 0, "peers_lost": 0, "dropped_selections": 0, "join_wait_s": 0.0,
                       "join_resyncs": 0, "dense_fallback_steps": 0, "leaves": 0, "epochs": 0,
                       **dict.fromkeys(P.TOPK_STATS)}

    # ------------------------------------------------------------------ epochs
    def reset(self, cursor: int) -> None:
        self._end_epoch()
        super().reset(cursor)
        self._joins.clear()
        self._left = False  # (a new epoch's BOOT carries every row idle)
        self._told_at = cursor
        self.sess = self.rt.run(self._begin(cursor))
        self.totals["epochs"] += 1

    async def _begin(self, cursor: int):
        sess = await self.rt.session(selector=self.sel)
        try:
            await sess.begin_serving(self.ctx, cursor)
        except BaseException:
            await sess.abort()
            raise
        return sess

    def _end_epoch(self) -> None:
        sess, self.sess = self.sess, None
        if sess is None:
            return
        try:
            self.rt.run(sess.end())
        finally:
            self._account(sess)

    def _account(self, sess) -> None:
        t = self.totals
        t["late_packs"] += sess.late_packs
        for k in _SESSION_COUNTS:
            t[k] += sess.stats.get(k, 0)
        # the cache rank's account of the epoch, sent with its END acknowledgement (NaN: no carried threshold)
        host = sess.stats.get("cache_host", {})
        for k in P.TOPK_STATS:
            v = host.get(k, float("nan"))
            if v == v:
                t[k] = (t[k] or 0) + int(v)

    def live(self) -> dict:
        """The totals including the running epoch (host counters)."""
        out = dict(self.totals)
        if self.sess is not None:
            out["late_packs"] += self.sess.late_packs
            for k in _SESSION_COUNTS:
                out[k] += self.sess.stats.get(k, 0)
        return out

    # ------------------------------------------------------------------ rows
    def _row_report(self, row: int, S: int, T: int):
        """Record what the cache rank needs of the joining row (sent with the next step):
        per layer the prompt's last W queries and, unless the cache rank reads this rank's
        cache, the row's keys at ``[S - T, S)`` (and values in the kv return mode, where the
        cache rank gathers them). Called after the join's last piece only,
        so a chunked join sends what an unchunked one does, once."""
        rows = self.policy.rows
        W = min(T, rows) if rows else T
        shared = self.sess is not None and self.sess._shared_kv
        values = self.rt.return_mode == "kv"
        rec = self._recording = []

        def report(layer, q, k_row, v_row):  # q: the prompt's newest queries [1, Hq, <= T, D]
            q_tail = q[:, :, max(0, q.shape[2] - W):].clone()
            if shared:
                rec.append((q_tail, None, None))
            else:
                rec.append((q_tail, k_row[:, :, S - T:S].clone(), v_row[:, :, S - T:S].clone() if values else None))

        return report

    def begin_join(self, row: int, ids: torch.Tensor, sizes: list[int], max_tokens: int = 1) -> None:
        if self.sess is None:
            raise RuntimeError("AsyncSlotBatch.begin_join before reset (no serving epoch)")
        super().begin_join(row, ids, sizes, max_tokens)

    def prefill_next(self, row: int) -> torch.Tensor | None:
        self._recording = None
        T = self.prefilling[row].T if row in self.prefilling else 0
        logits = super().prefill_next(row)
        if logits is not None:  # the last piece: the row's JOIN goes with the next step
            self._joins[row] = (T, self._recording)
        self._recording = None
        return logits

    def leave(self, row: int) -> None:
        super().leave(row)
        self._joins.pop(row, None)  # joined and left before a step: nothing to tell
        self._left = True  # the cache rank hears of it before the next step (LEAVE, or the next JOIN)

    # ------------------------------------------------------------------ decode
    def _decode(self, tokens: torch.Tensor, mode: str) -> torch.Tensor:
        try:
            return self.rt.run(self._astep(tokens, mode))
        except BaseException:  # the step's state is unknown: drop the epoch (the engine fails its rows)
            sess, self.sess = self.sess, None
            self._joins.clear()
            self._left = False
            if sess is not None:
                try:
                    self.rt.run(sess.abort())
                finally:
                    self._account(sess)
            raise

    async def _astep(self, tokens: torch.Tensor, mode: str) -> torch.Tensor:
        sess = self.sess
        if sess is None:
            raise RuntimeError("a decode step outside a serving epoch (a failed step ended the last one)")
        stale = not all(self.active) and self.cursor - self._told_at >= IDLE_WINDOW_REFRESH
        if self._joins:  # (a JOIN carries the whole kv_start: the leaves too)
            joins, self._joins, self._left = self._joins, {}, False
            await sess.join_rows(self.cursor, joins, busy=self.active)
            self._told_at = self.cursor
        elif self._left or stale:
            self._left = False
            await sess.leave_rows(self.cursor, busy=self.active)
            self._told_at = self.cursor
        logits = await sess.step(tokens, sparse=mode != "dense")
        await sess.wait_device()
        return logits

    def close(self) -> None:
        """End the epoch's session and close the runtime (its cache rank, link and loop)."""
        try:
            self._end_epoch()
        finally:
            self.rt.close()

"""Row slots over the static KV cache with a shared write cursor ("dynamic left padding").

The backend (``FastModel`` in slot mode) keeps ``max_batch`` rows; every row decodes
every step and all share the write cursor ``S`` (the cache holds ``S`` entries per
row; the next step writes index ``S``). Row ``b``'s request owns ``[kv_start[b], S)``:

* a request of ``T`` prompt tokens JOINS a free row between decode steps: its prompt
  is prefilled into ``[S - T, S)`` (RoPE positions ``0 .. T-1``), ``kv_start[b] = S - T``,
  and the policy resets that row's state (``Policy.prefill_rows``). It joins only
  when ``T <= S`` and when its whole generation fits before the end of the cache
  (``S + max_tokens - 1 <= max_seq_len``): the cursor never reaches the end, so
  nothing is ever shifted or compacted. A request that does not fit yet waits (the cursor grows one per step;
  when the batch is empty the cursor resets to the next prompts' length);
* a join may be CHUNKED (``begin_join`` / ``prefill_next``): the prompt is prefilled
  in ``n`` pieces, one per decode step of the other rows, and the request starts
  decoding after the last one, at the cursor ``S0 + n - 1`` (``S0``: the cursor at the
  first piece). The prompt occupies ``[S0 + n - 1 - T, S0 + n - 1)``, so every piece
  but the last ends below the cursor of its step as long as each holds a token (the
  ``n - 1 - k`` pieces after piece ``k`` keep at least that many tokens after it): the
  dummy tokens the row decodes meanwhile at the cursor land at positions a later piece
  overwrites, and no piece's position is written after it. The row's policy state is
  made once, after the last piece, from the prompt's last queries (``Policy.rows``)
  and the row's whole prompt cache: what an unchunked join gives;
* a request LEAVES by freeing its row: the row keeps decoding a dummy token over
  its own window ``[kv_start, S)``, which starts at its newest token at every step
  while the row is idle (``SlotContext.idle``: the device moves ``kv_start`` there at
  the step's first layer; the window starts at one token: no empty softmax, no NaN),
  and no kernel reads across rows; a row mid-join counts as idle until its last piece;
* the sparse threshold θ applies per request: row ``b`` attends densely while its
  own length ``S - kv_start[b]`` is ``<= max(θ, budget)``, exactly when the request
  alone would (``ThresholdSelector`` plus the policy's own dense rule). A step whose
  rows all agree runs one attention; a mixed step runs both and keeps each row's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spade.attention import AttentionContext
from spade import kernels
from spade.kernels.common import row_bucket
from spade.policies.base import Policy, PolicyState
from spade.runtime.selector import theta_eff


class SlotSelector:
    """The inline selector of a slot batch: the policy on the critical path, skipped on
    steps where every row is dense (``all_dense``, set per step by ``SlotBatch``)."""

    def __init__(self, policy: Policy, state: PolicyState):
        self.policy = policy
        self.state = state
        self.all_dense = True

    def begin_step(self, seq_len, kv_start):
        self.state.seq_len = seq_len
        self.state.kv_start = kv_start

    def selection(self, layer, q, k_cache, kv_lens):
        if self.all_dense:
            return None
        return self.policy.select(self.state, layer, q, k_cache, kv_lens)

    def after(self, layer, q, k_cache, v_cache, kv_lens):
        self.policy.observe(self.state, layer, q, k_cache, kv_lens)

    def prefill(self, layer, q, k_cache, v_cache, kv_lens, pool=None):
        raise RuntimeError("a slot batch prefills rows through SlotBatch.join, not a batch prefill")


class SlotContext(AttentionContext):
    """``AttentionContext`` with per-row dense rows: in a ``mixed`` step the rows of
    ``dense_rows`` [B] bool take dense attention, the others the policy's selection."""

    def __init__(self, spec, selector: SlotSelector, *, device):
        super().__init__(spec, selector, device=device)
        self.mode = "dense"  # "dense" | "sparse" | "mixed": a host fact per step (a graph key)
        self.dense_rows = torch.zeros(0, dtype=torch.bool, device=device)
        #: the bucket of rows in use (1, 2, 4, ..., B; a host fact per step, a graph key): the
        #: attention's split plan and the selection's grids are sized for that many rows
        #: (``kernels.plan_rows``)
        self.rows: int | None = None
        #: [B] bool on the device, True for a row with no request decoding (free, or mid-join):
        #: each step starts its window at its newest token (set by ``SlotBatch``; None: no such rows)
        self.idle: torch.Tensor | None = None

    def attend(self, layer, q, k_cache, v_cache, kv_lens):
        if layer == 0 and self.idle is not None:  # once per step, on the device (inside the step's graph)
            # an idle row attends (and is scored over) its newest token only, however long ago it left
            self.kv_start.copy_(torch.where(self.idle, (kv_lens - 1).to(self.kv_start.dtype), self.kv_start))
        # the selection's grids and the attention's split plan sized for the rows in use
        with kernels.plan_rows(self.rows, q.shape[0]):
            out = self._attend(layer, q, k_cache, v_cache, kv_lens)
        self.selector.after(layer, q, k_cache, v_cache, kv_lens)
        return out

    def _attend(self, layer, q, k_cache, v_cache, kv_lens):
        sel = self.selector.selection(layer, q, k_cache, kv_lens)
        stats = self.layer_stats(layer, q, k_cache)
        scale = self.spec.softmax_scale
        bt = self.block_table
        if sel is None:
            return kernels.sparse_decode_attention(q, k_cache, v_cache, kv_lens, None, scale=scale,
                                                   kv_start=self.kv_start, stats=stats, block_table=bt)
        out = self._sparse(layer, q, k_cache, v_cache, kv_lens, sel, stats)
        if self.mode == "mixed":  # rows still under their own threshold attend densely
            # the sparse rows' dense windows shrink to their newest token: the dense pass
            # reads only the dense rows' caches
            start = torch.where(self.dense_rows, self.kv_start, (kv_lens - 1).to(self.kv_start.dtype))
            dense = kernels.sparse_decode_attention(q, k_cache, v_cache, kv_lens, None, scale=scale,
                                                    kv_start=start, block_table=bt)
            out = torch.where(self.dense_rows[:, None, None], dense, out)
        return out

    def _sparse(self, layer, q, k_cache, v_cache, kv_lens, sel, stats):
        """The selection's attention over the local cache (re-ranked first by the true query
        when its indices are candidates)."""
        if sel.keep > 0:
            sel = sel.reranked(q, k_cache, self.spec.softmax_scale, block_table=self.block_table)
        return kernels.sparse_decode_attention(
            q, k_cache, v_cache, kv_lens, sel.indices, n_sink=sel.n_sink, n_recent=sel.n_recent,
            scale=self.spec.softmax_scale, kv_start=sel.kv_start if sel.kv_start is not None else self.kv_start,
            stats=stats, block_table=self.block_table)

    def graph_key(self) -> tuple:
        return super().graph_key() + (self.mode, self.rows)


@dataclass
class RowPrefill:
    """A join in progress (chunked prefill): the prompt ``ids`` [T], the sizes of its
    pieces, and ``end``, the cursor at which it starts decoding (its prompt occupies
    ``[end - T, end)``)."""

    ids: torch.Tensor
    sizes: list[int]
    end: int
    done: int = 0  # prompt tokens prefilled so far
    piece: int = 0  # pieces run so far
    tails: list = field(default_factory=list)  # per layer: the newest prompt queries so far (``Policy.rows``)

    @property
    def T(self) -> int:
        return int(self.ids.numel())

    @property
    def next_cursor(self) -> int:
        """The cursor the next piece must run at (one decode step per piece)."""
        return self.end - (len(self.sizes) - 1 - self.piece)

    @property
    def next_size(self) -> int:
        return self.sizes[self.piece]


def chunk_sizes(T: int, first: int, chunk: int) -> list[int]:
    """The pieces of a prompt of ``T`` tokens prefilled ``chunk`` tokens per step, the
    first one ``first`` tokens (what is left of the step's budget; ``0 < first <=
    chunk``): e.g. ``chunk_sizes(10, 3, 4) == [3, 4, 3]``."""
    if not 0 < first <= chunk:
        raise ValueError(f"chunk_sizes: first piece {first} must be in [1, {chunk}]")
    if T <= first:
        return [T]
    rest = T - first
    return [first] + [chunk] * (rest // chunk) + ([rest % chunk] if rest % chunk else [])


class SlotBatch:
    """The rows of a slot-mode backend, their owners' placement and the policy state.

    >>> batch = SlotBatch(backend, policy, theta=0)            # doctest: +SKIP
    >>> batch.fits(T=12, max_tokens=32)                        # None: it may join now
    >>> logits = batch.join(row=0, ids=torch.tensor(prompt))   # [1, V]
    >>> logits = batch.step(tokens)                            # [B, V], every row
    >>> batch.leave(0)
    >>> batch.begin_join(1, torch.tensor(prompt), [5, 5, 2])   # a chunked join: 3 pieces
    >>> batch.prefill_next(1); batch.step(tokens)              # None (piece 1), then a step
    """

    def __init__(self, backend, policy: Policy, theta: int):
        if not hasattr(backend, "prefill_row"):
            raise TypeError(f"{type(backend).__name__} has no slot mode (prefill_row); serve with the fast backend")
        self.backend = backend
        self.policy = policy
        self.B = int(backend.max_batch)
        self.L = int(backend.max_seq_len)
        dev = backend.device
        self.device = dev
        self.state = policy.new_state(self.B, dev)
        #: per-row dense threshold on the row's own length (None: always dense, e.g. ``full``)
        self.theta_row = theta_eff(theta, policy) if policy.budget is not None else None
        self.kv_start_host = [0] * self.B
        self.kv_start = torch.zeros(self.B, dtype=torch.int32, device=dev)
        self.active = [False] * self.B
        self.prefilling: dict[int, RowPrefill] = {}  # rows whose join is in progress (chunked prefill)
        #: queries of the prompt's end the policy's row state reads (``Policy.rows``; None: all)
        self.q_keep = None if policy.rows is None else max(1, int(policy.rows))
        self.selector = SlotSelector(policy, self.state)
        self.ctx = SlotContext(backend.spec, self.selector, device=dev)
        self.ctx.kv_start = self.kv_start
        self.ctx.dense_rows = torch.zeros(self.B, dtype=torch.bool, device=dev)
        #: rows with no request decoding (device; ``SlotContext.idle``): their windows stay one token
        self.idle = torch.ones(self.B, dtype=torch.bool, device=dev)
        self.ctx.idle = self.idle
        self.state.idle = self.idle  # (the policy skips idle rows' per-row work: the predictor's solve)
        #: paged KV cache (``model.block_size``): a row holds blocks for its own window only,
        #: and a join reserves those of its whole generation (``fits``), so a step never runs out
        self.paged = bool(getattr(backend, "paged", False))
        self.block_size = int(backend.block_size) if self.paged else 0
        self.reserved = [0] * self.B  # per row: blocks reserved for the request's whole generation
        if self.paged:
            self.state.cache_len = self.ctx.cache_len = self.L
        self.steps = 0
        self.sparse_steps = 0  # steps in which at least one row attended a sparse selection
        self.mixed_steps = 0  # steps in which some rows were dense (their own threshold) and others sparse
        self.resets = 0
        self.joins = 0
        self.joins_running = 0  # joins while other rows were decoding (not after a reset)

    # ------------------------------------------------------------------ placement
    @property
    def cursor(self) -> int:
        return self.backend.seq_len if self.backend.batch_size == self.B else 0

    @property
    def empty(self) -> bool:
        return not any(self.active) and not self.prefilling

    def free_rows(self) -> list[int]:
        return [b for b in range(self.B) if not self.active[b] and b not in self.prefilling]

    def used(self) -> int:
        return sum(self.active) + len(self.prefilling)

    def blocks_needed(self, T: int, max_tokens: int, S: int) -> int:
        """Paged: blocks of a request of ``T`` prompt tokens and up to ``max_tokens`` new ones
        that decodes from cursor ``S``: it writes positions ``[S - T, S + max_tokens - 1)``."""
        bs = self.block_size
        lo, hi = S - T, max(S - T + 1, S + max_tokens - 1)
        return (hi - 1) // bs - lo // bs + 1

    def blocks_available(self) -> int:
        """Paged: free blocks no running request has reserved (its generation's blocks not yet taken)."""
        held = sum(max(0, self.reserved[b] - self.backend.kv_row_blocks(b)) for b in range(self.B))
        return self.backend.kv_blocks_free() - held

    def fits(self, T: int, max_tokens: int, cursor: int | None = None, pieces: int = 1) -> str | None:
        """Why a request of ``T`` prompt tokens and up to ``max_tokens`` new ones cannot
        start joining at ``cursor`` (default: the current one) now, its prompt prefilled in
        ``pieces`` steps (it then decodes from the cursor ``cursor + pieces - 1``), or None
        when it can."""
        S = (self.cursor if cursor is None else cursor) + pieces - 1
        if pieces < 1 or pieces > T:
            return f"a prompt of {T} tokens cannot be prefilled in {pieces} pieces of at least one token"
        if T > S:
            return f"its prompt ({T} tokens) is longer than the cursor it would decode from ({S})"
        if self.past_end(max_tokens, S):
            return f"its generation would pass the end of the cache ({S} + {max_tokens} - 1 > {self.L})"
        if self.paged:
            need, free = self.blocks_needed(T, max_tokens, S), self.blocks_available()
            if need > free:
                return f"it needs {need} KV blocks and {free} are free (not reserved by running requests)"
        return None

    def past_end(self, max_tokens: int, cursor: int | None = None, pieces: int = 1) -> bool:
        """True when a generation of ``max_tokens`` joining at ``cursor`` in ``pieces`` pieces
        would pass the end of the cache: the shared cursor has moved too far, and only a
        drained batch (a cursor reset) lets the request in (``fits``' third reason)."""
        S = (self.cursor if cursor is None else cursor) + pieces - 1
        return S + max_tokens - 1 > self.L

    def reset(self, cursor: int) -> None:
        """An empty batch: move the cursor to ``cursor`` (every row idle)."""
        if not self.empty:
            raise RuntimeError("SlotBatch.reset with rows in use")
        self.backend.reset_slots(cursor)
        self.kv_start_host = [cursor] * self.B
        self.kv_start.fill_(cursor)
        self.idle.fill_(True)
        self.resets += 1

    def join(self, row: int, ids: torch.Tensor, max_tokens: int = 1) -> torch.Tensor:
        """Prefill the prompt ``ids`` [T] into the free row ``row`` at the cursor and reset the
        row's policy state. Returns the prompt's last logits [1, V] float32."""
        self.begin_join(row, ids, [int(ids.numel())], max_tokens)
        return self.prefill_next(row)

    def begin_join(self, row: int, ids: torch.Tensor, sizes: list[int], max_tokens: int = 1) -> None:
        """Reserve the free row ``row`` for the prompt ``ids`` [T], to be prefilled in pieces of
        ``sizes`` tokens (each >= 1, summing to T), one per ``prefill_next`` call, a decode
        step between two calls: it decodes from the cursor ``cursor + len(sizes) - 1``, and
        generates up to ``max_tokens`` tokens (paged: their blocks are reserved now).
        Nothing runs yet."""
        if self.active[row] or row in self.prefilling:
            raise RuntimeError(f"row {row} is in use")
        T = int(ids.numel())
        if sum(sizes) != T or min(sizes, default=0) < 1:
            raise ValueError(f"prompt pieces {sizes} must each hold a token and sum to the prompt's {T} tokens")
        why = self.fits(T, max_tokens, self.cursor, len(sizes))
        if why is not None:
            raise RuntimeError(f"a request cannot join now: {why}")
        end = self.cursor + len(sizes) - 1
        if self.paged:
            self.reserved[row] = self.blocks_needed(T, max_tokens, end)
        self.prefilling[row] = RowPrefill(ids=ids, sizes=list(sizes), end=end)

    def prefill_next(self, row: int) -> torch.Tensor | None:
        """The next piece of ``row``'s join (``begin_join``), at the cursor its plan expects.
        After the last piece the row's policy state is reset from its whole prompt, the row
        decodes from the next step on, and the prompt's last logits [1, V] float32 are
        returned; before it, None. A failure frees the row."""
        job = self.prefilling.get(row)
        if job is None:
            raise RuntimeError(f"row {row} has no join in progress")
        S = self.cursor
        if S != job.next_cursor:  # one decode step between two pieces, or the placement is wrong
            self.leave(row)
            raise RuntimeError(f"piece {job.piece} of row {row}'s prompt expected the cursor at {job.next_cursor}, "
                               f"found {S}: a decode step must run between two pieces")
        c, off, T = job.next_size, job.done, job.T
        last = off + c == T
        first = job.end - T
        if last:
            self.kv_start_host[row] = first
            self.kv_start[row:row + 1].fill_(first)  # (a scalar fill: item assignment copies and waits)
            self.state.seq_len = S
            self.state.kv_start = self.kv_start
        try:
            out = self.backend.prefill_row(row, job.ids[off:off + c], self._piece_report(row, job, last),
                                           first=first, offset=off, last=last)
        except BaseException:
            self.leave(row)
            raise
        job.done += c
        job.piece += 1
        if not last:
            return None
        del self.prefilling[row]
        self.joins += 1
        self.joins_running += any(self.active)
        self.active[row] = True
        self.idle[row:row + 1].fill_(False)
        return out

    def _piece_report(self, row: int, job: RowPrefill, last: bool):
        """The per-layer hook of a piece's pass: keep the prompt's newest queries (what the
        policy's row state reads, ``Policy.rows``); after the last piece, the row's state
        from them and the row's whole prompt (``_row_report``)."""
        keep, T = self.q_keep, job.T
        final = self._row_report(row, job.end, T) if last else None
        single = last and job.piece == 0  # an unchunked join: the piece's queries are the prompt's

        def report(layer, q, k_row, v_row):
            if single:
                tail = q if keep is None else q[:, :, max(0, T - keep):]
            else:
                prev = job.tails[layer] if layer < len(job.tails) else None
                if keep is not None:
                    q = q[:, :, max(0, q.shape[2] - keep):]
                tail = q if prev is None else torch.cat([prev, q], dim=2)
                if keep is not None:
                    tail = tail[:, :, max(0, tail.shape[2] - keep):]
                if not last:
                    tail = tail.clone() if keep is not None else tail  # not a view of the whole piece's q
                    if layer < len(job.tails):
                        job.tails[layer] = tail
                    else:
                        job.tails.append(tail)
                    return
            final(layer, tail, k_row, v_row)

        return report

    def _row_report(self, row: int, S: int, T: int):
        """The per-layer hook after the last piece of a request of ``T`` tokens that decodes
        from cursor ``S``: the joining row's policy state (``Policy.prefill_rows``) from
        the prompt's newest queries [1, Hq, <= T, D] and the row's cache views."""
        kv_lens = torch.full((1,), S, dtype=torch.int64, device=self.device)
        rows = [row]

        def report(layer, q, k_row, v_row):
            self.state.block_table = None  # a paged cache's row comes contiguous (its prompt's window)
            b = self.backend
            self.state.join_pool = (b.k_cache[layer], b.block_table) if b.paged else None
            try:
                self.policy.prefill_rows(self.state, layer, rows, q, k_row, v_row, kv_lens)
            finally:
                self.state.join_pool = None

        return report

    def leave(self, row: int) -> None:
        """Free ``row`` (a request that finished, or left mid-join): from the next step it
        decodes a dummy token over its own window, which starts at the cursor."""
        self.active[row] = False
        self.idle[row:row + 1].fill_(True)
        self.prefilling.pop(row, None)
        if self.paged:  # its blocks go back to the pool at once
            self.backend.kv_free(row)
            self.reserved[row] = 0
        S = self.cursor
        self.kv_start_host[row] = S
        self.kv_start[row:row + 1].fill_(S)

    # ------------------------------------------------------------------ decode
    def _decode(self, tokens: torch.Tensor, mode: str) -> torch.Tensor:
        """The step's model pass (``ctx.mode`` set): the policy inline, skipped when every
        row is dense."""
        self.selector.all_dense = mode == "dense"
        return self.backend.decode(tokens, self.ctx)

    def close(self) -> None:
        """Nothing beyond the backend (which the engine frees) here; a batch with a cache
        rank ends its session."""

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step of every row: ``tokens`` [B] (idle rows: any id). Returns
        logits [B, V] float32."""
        S = self.cursor + 1  # the cache length this step attends (its own token included)
        if S > self.L:
            raise RuntimeError(f"the cursor reached the end of the cache ({self.L})")
        act = [b for b in range(self.B) if self.active[b]]
        if self.theta_row is None:
            dense = [True] * self.B
        else:
            dense = [S - self.kv_start_host[b] <= self.theta_row for b in range(self.B)]
        n_dense = sum(dense[b] for b in act)
        mode = "dense" if n_dense == len(act) else ("sparse" if n_dense == 0 else "mixed")
        if mode == "mixed":
            self.ctx.dense_rows.copy_(torch.tensor(dense, dtype=torch.bool), non_blocking=True)
        self.ctx.mode = mode
        self.ctx.rows = row_bucket(len(act), self.B)  # (a row mid-join attends its one-token window)
        logits = self._decode(tokens, mode)
        self.steps += 1
        self.sparse_steps += mode != "dense"
        self.mixed_steps += mode == "mixed"
        return logits

"""``asyncspade``: token-level top-K with a *predicted* query (AsyncSpade).

Exact top-K needs the current query, which puts selection on the critical path.
AsyncSpade predicts q̂_t from a window of the queries already seen (up to
q_{t-1}) and selects with it, so the selection for step t can be computed while
step t-1 is still running, on another GPU or a side stream
(``needs_current_query = False``: ``select`` ignores ``q``).

Selection: sinks + recent window + the top ``budget - sink - recent`` middle
tokens scored by q̂ (one set per KV head, the group reduced by
``group_reduce``), the same shape as ``oracle``'s with the true query.

State per layer: ``window`` [B, Hq, W+1, D] float32, the last W+1 queries
(oldest first; pre-RoPE when ``rope_aware``). ``prefill`` pushes the prompt's
last W+1 queries, ``observe`` pushes the current one. How many are valid is
derived from the host ``state.seq_len`` (no host counter that a replayed CUDA
graph would not advance), which assumes ``observe`` runs once per decode step.

Compressed scoring keys (``score_keys="int8"``): scoring reads every cached key
each step, more bytes than the sparse attention it feeds, so the policy can keep
a symmetric per-token int8 copy of the keys (``kq`` [B, Hkv, C, D] int8 and
``ks`` [B, Hkv, C] float32, C >= the cache length) and score that: half the key
bytes of bf16. ``prefill`` quantises the whole cache; ``observe`` quantises the
step's newest key into slot ``kv_lens - 1`` of each row (a device-side write, no
host sync, so it replays in a CUDA graph). When the cache view grows past C the
copy is rebuilt from the exact keys with doubled capacity (a host decision on
shapes only; the cache rank's graphs run on a fixed-length view, so it never
happens there). Attention itself always reads the exact keys.

``score_keys="int4"`` keeps a packed int4 copy the same way (``kq`` uint8
[B, Hkv, C, D/2], a quarter of bf16's bytes), smoothed per channel:
``k_smooth`` [B, Hkv, D] is fitted on the prompt's keys at ``prefill`` (kept
through capacity rebuilds) and folded into q̂ before scoring
(``spade.kernels.quant``: plain per-token int4 ranks badly on real keys'
outlier channels).

Paged KV cache (``state.block_table`` set, ``spade.policies.base.PolicyState``):
``select`` / ``observe`` get the layer's pool. Exact keys are scored in the pool
through the table (with the threshold carry, as on a contiguous cache). Rows that
join a serving batch with ``state.join_pool`` (the pool and the table their copy
follows: the cache's own, or a cache rank's ``RowBlocks``) keep an int8 / int4 copy
as a pool too (``AsyncSpadeLayerState.paged``), written, appended and scored through
that table. Otherwise the int8 / int4 / channel copies are the policy's own contiguous
memory, sized at ``prefill`` for the cache's logical capacity (``state.cache_len``: the
prefill may see only the prompt), so decoding appends the newest key (read through the
table) and never rebuilds the copy for length; re-chosen channels rebuild it from the
logical keys, gathered through the table (the first ``seq_len`` positions). ``rerank``
works as on a contiguous cache when the attention passes the table to
``Selection.reranked``.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field, model_validator

from spade import kernels
from spade.errors import ConfigError
from spade.kernels.overlap import after_selects
from spade.kernels.paged import paged_write
from spade.policies.base import Policy, PolicyState, Selection, SparseCommonConfig
from spade.policies.common import (cache_dims, derived, is_dense, last_token_keys, layer_carry, logical_keys,
                                   reset_carry, row_start, topk_selection)
from spade.policies.predictors import predict, rotate
from spade.streams import device_index

log = logging.getLogger(__name__)


_AUTO_LOGGED: set[bool] = set()


def resolve_rope_aware(setting: bool | str, spec) -> bool:
    """``rope_aware`` as a bool for a model of ``spec``.

    ``auto`` is on exactly when ``spec.rope`` is set (plain, unscaled RoPE; model
    loaders leave it None for scaled variants they cannot rotate exactly), so the
    default never raises; each outcome is logged once per process at INFO. An
    explicit ``True`` on a model without ``spec.rope`` is a ConfigError: the user
    asked for something the model cannot give.
    """
    if setting == "auto":
        on = spec.rope is not None
        if on not in _AUTO_LOGGED:
            _AUTO_LOGGED.add(on)
            log.info("asyncspade: rope_aware=auto -> %s (%s)", on,
                     "the model has plain RoPE" if on else "spec.rope is None: no RoPE, or a scaled variant")
        return on
    if setting and spec.rope is None:
        raise ConfigError("policy.rope_aware=true needs a model with plain rotary embeddings (spec.rope is None: "
                          "no RoPE, or a scaled variant such as llama3/yarn); set policy.rope_aware=auto or false")
    return bool(setting)


def query_pair_mass(q: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """Σ over the queries ``q`` [B, Hq, n, D] of each rotary pair's norm
    ``sqrt(q_c² + q_{c+D/2}²)``, summed over each KV head's group: [B, Hkv, D/2] float32.
    A pair's norm is unchanged by RoPE, so pre- and post-RoPE windows give the same."""
    B, Hq, _, D = q.shape
    h = D // 2
    qf = q.float()
    m = (qf[..., :h].square() + qf[..., h:].square()).sqrt().sum(2)  # [B, Hq, h]
    return m.view(B, n_kv_heads, Hq // n_kv_heads, h).sum(2)


def key_pair_mass(k: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Σ over positions ``[lo[b], hi[b])`` of each rotary pair's norm of ``k`` [B, Hkv, L, D]:
    [B, Hkv, D/2] float32."""
    B, H, L, D = k.shape
    h = D // 2
    pos = torch.arange(L, device=k.device)
    ok = (pos[None, :] >= lo.to(k.device).long()[:, None]) & (pos[None, :] < hi.to(k.device).long()[:, None])
    kf = k.float()
    m = (kf[..., :h].square() + kf[..., h:].square()).sqrt()  # [B, H, L, h]
    return torch.einsum("bhlc,bl->bhc", m, ok.float())


def serving_refusal(cfg) -> str | None:
    """Why a batch that requests join (``AsyncEngine``, ``prefill_rows``) cannot take this
    asyncspade config, naming the fix; None when it can. ``score_channels`` is chosen per
    row from its own prompt and kept; ``channel_refresh`` re-chooses every row at once."""
    if cfg.score_channels and cfg.channel_refresh is not None:
        return (f"policy.score_channels ({cfg.score_channels}) with policy.channel_refresh ({cfg.channel_refresh}) "
                "re-chooses every row's scoring channels at once as the batch's cache grows, which requests joining "
                "a running batch cannot follow: set policy.channel_refresh: null to serve it (each request keeps "
                "the channels its prompt chose), or score_channels: null")
    return None


def pick_channels(q_mass: torch.Tensor, k_mass: torch.Tensor, r: int) -> torch.Tensor:
    """The r channels of the r/2 rotary pairs of largest ``q_mass * k_mass`` ([B, Hkv, D/2]
    each): int64 [B, Hkv, r], the pairs' first halves ascending, then their partners
    (``c + D/2``) in the same order, so the subset is itself in rotate_half layout."""
    h = q_mass.shape[-1]
    pairs = (q_mass * k_mass).topk(r // 2, dim=-1).indices.sort(-1).values  # [B, Hkv, r/2]
    return torch.cat([pairs, pairs + h], dim=-1)


def gather_channels(x: torch.Tensor, chans: torch.Tensor) -> torch.Tensor:
    """``x`` [B, H, D] or [B, H, L, D] restricted to ``chans`` [B, Hkv, r] (H a multiple of
    Hkv: a query head uses its KV head's channels): [B, H, r] / [B, H, L, r]."""
    B, Hkv, r = chans.shape
    if x.dim() == 4:
        return x.gather(3, chans[:, :, None, :].expand(B, Hkv, x.shape[2], r))
    H = x.shape[1]
    idx = chans[:, :, None, :].expand(B, Hkv, H // Hkv, r).reshape(B, H, r)
    return x.gather(2, idx)


TAIL_NEVER = 1 << 62
"""A ``tail_pos`` entry that never leaves the recent window (a sink or padding position)."""

REFRESH_CARRY_MARGIN = 2.0
"""With ``refresh_every > 1`` the threshold-carry top-K's next threshold aims at this many
times K candidates (the kernels' default is 1.5): the threshold is several steps old when
it is next used. Measured on an H200 (colocated, B=8 L=32k, int4): top-K fallbacks 14% -> 6% at
N=2 and 27% -> 14% at N=4, TPOT -5% / -4%, p90 11-12 -> 7.7 ms; at N=1 the wider list
(CAP 8192) costs more than it saves (+8%), so every-step selection keeps the default."""


class AsyncSpadePolicyConfig(SparseCommonConfig):
    name: Literal["asyncspade"] = "asyncspade"
    predictor: Literal["last", "ridge", "softmax_ridge", "assembled"] = "assembled"
    """How the next query is predicted from the window of recent queries."""
    window: int = Field(16, ge=1, le=64)
    """W: number of past queries the predictor regresses on."""
    ridge_eps: float = Field(1e-2, gt=0)
    """Ridge λ relative to the mean squared norm of the window's queries."""
    rope_aware: bool | Literal["auto"] = "auto"
    """Regress pre-RoPE queries and rotate the prediction to the next position.

    ``auto`` (default): on when the model has plain (unscaled) rotary embeddings
    (``spec.rope`` is set), off otherwise (no RoPE, or a scaled variant such as
    llama3 or yarn that ``RopeSpec`` does not model); the choice is logged once at
    INFO. ``true`` refuses such models with a ConfigError; ``false`` regresses the
    post-RoPE queries as they are. On real weights the paper's ``assembled``
    predictor beats ``last`` on overlap only with RoPE-aware prediction
    (docs/fidelity.md)."""
    topk: Literal["carry", "radix"] = "carry"
    """How the GPU kernels find the exact top-K (the same selection either way).
    ``carry`` (default): each layer carries the previous step's threshold; the scoring
    kernel lists the keys scoring above it and one kernel selects among them, or over
    the whole row when their count is off (the first sparse step included, ~3x the
    radix path's time there): the predicted query moves little from step to step, so
    the radix passes over every row are skipped (``spade.kernels.carry``; 16-bin
    digits in registers). A selection wider than the carry's longest list (``K_mid`` x ``rerank``
    past ~4.3k tokens: ``kernels.carry.carry_fits``) takes the radix passes either way.
    ``radix``: radix passes over every row each step. The CPU reference path ignores it."""
    score_keys: Literal["exact", "int8", "int4"] = "exact"
    """Keys the selection scores. ``int8``: a symmetric per-token int8 copy kept by the
    policy (half the bytes of bf16 to read each step, so the cache rank keeps up with
    the inference rank); attention still uses the exact keys. ``int4``: a packed
    4-bit copy (a quarter of bf16's bytes), smoothed per channel by scales fitted on
    the prompt's keys and folded into the query. Both cost a little selection
    fidelity, int4 more (see docs/policies.md)."""
    rerank: int = Field(1, ge=1, le=16)
    """m: two-stage selection. The predicted query picks ``m * K_mid`` candidate middle
    tokens per (row, KV head) (``K_mid = budget - sink_tokens - recent_tokens``), and the
    attention re-ranks them with the step's true query and keeps the best ``K_mid``
    (``group_reduce`` over the candidates only: each head's softmax normalised over them
    for ``sum_softmax``), then attends sinks + recent window + the kept tokens, so the
    budget attended stays ``budget``. 1 (default): off, the paper's one-stage selection.
    The re-rank corrects the predicted query's staleness (recall toward the exact top-K)
    at the cost of scoring ``m * K_mid`` exact keys on the inference side; with
    ``refresh_every > 1`` the reused candidate set is re-ranked by each step's query.
    The ``kv`` / ``delta`` return modes ship the ``m * K_mid`` candidates (see
    docs/policies.md)."""
    refresh_every: int = Field(1, ge=1, le=64)
    """Select at the first sparse step and every N steps after it; the steps between
    reuse the last selection, while the recent window keeps covering the newest tokens.
    1 (the paper): every step. N > 1 divides the cache rank's scoring work by N — for a
    cache rank that shares the inference GPU (``colocated``), whose reads compete with
    the decode's — at some selection fidelity (docs/policies.md)."""
    score_channels: int | None = Field(None, ge=0)
    """r: channels per KV head the selection scores (None or 0, or the head dim: all of
    them, today's behaviour). Chosen per (row, KV head) from the prompt's own keys and the
    query window: the r/2 rotary pairs (rotate_half: channel c with c + d/2) of largest
    (Σ |q pair|) x (Σ |k pair|), so RoPE pairs stay together (r even). The scoring copy
    (exact in the cache dtype, int8 or int4) then stores only those r channels and the
    predicted query is gathered to them: the scan reads r/d of the key bytes. Re-chosen
    when the cache length grows by ``channel_refresh`` (docs/policies.md)."""
    channel_refresh: float | None = Field(2.0, gt=1)
    """With ``score_channels``: re-choose the channels (and rebuild the scoring copy from the
    exact keys, in place) when the cache length reaches this factor times its length at the
    last choice; None: chosen once, at prefill (what serving takes: each request's own, at its
    join). A host decision on ``seq_len`` (every
    topology refreshes at the same step; a graph key); it needs the exact keys, so a cache
    rank keeps appending them (``takes_new_keys`` is False). Amortised cost: at most
    1/(factor - 1) extra quantisations of each key."""

    @model_validator(mode="after")
    def _refresh_modes(self):
        if self.score_channels and self.score_channels % 2:
            raise ValueError(f"policy.score_channels ({self.score_channels}) must be even: channels are chosen "
                             "in rotary pairs (c, c + head_dim/2); use an even r, or 0 for all channels")
        return self


@dataclass
class AsyncSpadeLayerState:
    window: torch.Tensor  # [B, Hq, R, D] float32 past queries, oldest first (R = W + 1)
    anchor_seq_len: int | None = None
    """Host ``seq_len`` at the call that last set ``anchor_count`` (prefill or first observe)."""
    anchor_count: int = 0
    """Valid queries in ``window`` right after that call."""
    row_anchors: list[tuple[int, int]] | None = None
    """Serving (rows joined at different steps, ``prefill_rows``): per row, the host
    ``(anchor_seq_len, anchor_count)`` of its own prefill; None: every row shares the
    two fields above."""
    kq: torch.Tensor | None = None
    """``score_keys="int8"``: int8 copy of the keys [B, Hkv, C, D] (C = capacity >= cache length)."""
    ks: torch.Tensor | None = None
    """Per-token scales of ``kq`` [B, Hkv, C] float32 (``k ≈ kq * ks``)."""
    k_smooth: torch.Tensor | None = None
    """``score_keys="int4"``: per-channel smoothing of the int4 copy [B, Hkv, D] float32
    (``k ≈ unpack(kq) * ks * k_smooth``), fitted on the prompt's keys."""
    all_windows: torch.Tensor | None = None
    """[n_layers, B, Hq, R, D]: the tensor ``window`` is a view of (``predict_layers``
    predicts a run of layers in one launch), or None for a window of its own."""
    q_pred: torch.Tensor | None = None
    """[B, Hq, D] float32 prediction made ahead by ``predict_layers`` (pre-RoPE when
    ``rope_aware``), for the ``select`` at host ``seq_len == q_pred_seq``."""
    q_pred_seq: int = -1
    q_pred_rotated: bool = False
    """``q_pred`` is post-RoPE (``predict_layers`` rotated it with the step's ``kv_lens``)."""
    q_scored: torch.Tensor | None = None
    """Compressed keys: ``q_pred`` as scored (int4 smoothing folded, rounded to the
    cache's half dtype), made with it by ``predict_layers`` for a whole run of layers
    in one launch; used by ``select`` when ``k_smooth`` and the dtype still match."""
    q_scored_smooth: torch.Tensor | None = None
    """The ``k_smooth`` object ``q_scored`` was folded with."""
    last_sel: Selection | None = None
    """``refresh_every > 1``: the selection of the last refresh, reused until the next.
    Its indices are ``keep``, which every refresh writes in place (eagerly or replayed
    from a CUDA graph), so a reuse step reads what the last refresh wrote whichever
    way it ran: a capture records without executing, and its own outputs would hold
    nothing until a replay."""
    keep: torch.Tensor | None = None
    """``refresh_every > 1``: int32 [B, Hkv, K] the refreshes select into: the scan's
    ``K - n_tail`` slots, then the tail slots (``_n_tail``)."""
    scan_buf: torch.Tensor | None = None
    """``refresh_every > 1``: int32 [B, Hkv, K - n_tail], the scan's output at a refresh."""
    tail_pos: torch.Tensor | None = None
    """``refresh_every > 1``: int64 [B, n_tail], the positions the tail slots take once they
    leave the recent window: ``base - R + j`` (``base``: the cache lengths of the layer's last
    refresh, R the recent window), or ``TAIL_NEVER`` for one among the sinks or left padding."""
    index: int = -1
    """This layer's index into ``all_windows`` / ``all_smooth`` (-1: a state of its own)."""
    all_smooth: torch.Tensor | None = None
    """int4: [n_layers, B, Hkv, D] float32 that ``k_smooth`` is a view of (row ``index``),
    so that ``predict_layers`` folds a run of layers in one launch."""
    all_chans: torch.Tensor | None = None
    """``score_channels``: [n_layers, B, Hkv, r] int64 that ``chans`` is a view of (row
    ``index``), so that ``predict_layers`` gathers a run of layers' channels in one launch."""

    def stacked_row(self, base: torch.Tensor | None, shape: tuple, device: torch.device) -> torch.Tensor | None:
        """This layer's row of a stacked per-layer tensor (``all_smooth``, ``all_chans``) when
        it has ``shape`` on ``device``; None for a state of its own or another shape."""
        if base is None or self.index < 0 or tuple(base.shape[1:]) != tuple(shape) or base.device != device:
            return None
        return base[self.index]
    score_dtype: torch.dtype | None = None
    """The dtype ``select`` rounds the compressed keys' query to (the cache's, when
    fp16 / bf16; else float32), recorded from the cache each call."""
    chans: torch.Tensor | None = None
    """``score_channels``: int64 [B, Hkv, r], the channels the scoring copy holds (None: all)."""
    chan_seq: int = 0
    """Host ``seq_len`` at the last channel choice (``channel_refresh`` counts from it)."""
    paged: bool = False
    """The scoring copy is a pool in the paged KV cache's layout: ``kq`` [num_blocks, Hkv,
    block_size, Dq], ``ks`` [num_blocks, Hkv, block_size], position p of row b at block
    ``table[b, p // block_size]`` of the cache's own table (so the copy's memory follows the
    KV pool, not max_batch x max_seq_len). Made when rows join a paged serving batch
    (``prefill_rows`` with ``PolicyState.join_pool``); read and appended through
    ``PolicyState.block_table``."""
    keys_elsewhere: bool = False
    """``observe`` got the step's keys as ``k_new``: the caller may leave decoded keys out
    of ``k_cache`` from then on, so the compressed copy must never be rebuilt from it
    (``scoring_keys`` raises instead). ``prefill`` (a whole cache) clears it."""


class AsyncSpadePolicy(Policy):
    """AsyncSpade with a configurable predictor (``last``, ``ridge``,
    ``softmax_ridge``, ``assembled``) and optional RoPE-aware prediction.

    >>> from spade.policies.asyncspade import AsyncSpadePolicyConfig
    >>> from spade.policies.base import AttentionSpec
    >>> pol = AsyncSpadePolicy(AsyncSpadePolicyConfig(budget=8, sink_tokens=1, recent_tokens=2,
    ...                        predictor="last", window=2),
    ...                        AttentionSpec(n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=8))
    >>> st = pol.new_state(1, "cpu"); st.seq_len = 20
    >>> k = torch.randn(1, 2, 24, 8); kv = torch.tensor([20])
    >>> pol.prefill(st, 0, torch.randn(1, 4, 20, 8), k, k, kv)
    >>> st.seq_len = 21; kv = kv + 1
    >>> sel = pol.select(st, 0, None, k, kv)      # no current query needed
    >>> int(sel.attended(kv).max())
    8
    """

    name = "asyncspade"
    needs_current_query = False
    select_takes_out = True

    def __init__(self, cfg, spec):
        super().__init__(cfg, spec)
        self.rope_aware = resolve_rope_aware(cfg.rope_aware, spec)
        """The resolved ``cfg.rope_aware`` (``auto`` -> whether ``spec.rope`` is set)."""
        self._rope_dim = (spec.rope.dim or spec.head_dim) if self.rope_aware else 0
        self._rope_tables: dict[torch.device, torch.Tensor] = {}  # device -> kernels.rope_table
        D, r = spec.head_dim, cfg.score_channels
        if r and r > D:
            raise ConfigError(f"policy.score_channels ({r}) exceeds the model's head_dim ({D}); "
                              f"use at most {D} (or 0 for all channels)")
        if r and r < D and spec.rope is not None and spec.rope.dim not in (0, D):
            raise ConfigError(f"policy.score_channels ({r}) keeps rotary pairs (c, c + head_dim/2); this model "
                              f"rotates {spec.rope.dim} of {D} channels (partial rotary): set score_channels: 0")
        self.channels: int | None = r if r and r < D else None
        """r channels per KV head the scoring copy holds, or None (all: ``score_channels``
        unset, 0 or the head dim, which is exactly the behaviour without channels)."""
        self._row_index: dict[tuple, torch.Tensor] = {}
        """(device, rows) -> the rows as a device index (``_predict_rows``): made by the eager
        call of a graph key, reused by its capture (no host-to-device copy inside a graph)."""

    @property
    def rows(self) -> int:
        """R = W + 1: the window holds W regressors plus the newest query (the target)."""
        return self.cfg.window + 1

    def new_state(self, batch_size: int, device: torch.device | str) -> PolicyState:
        state = super().new_state(batch_size, device)
        s = self.spec
        # one tensor for every layer's window: a run of layers is predicted in one launch
        windows = torch.zeros(s.n_layers, batch_size, s.n_q_heads, self.rows, s.head_dim, dtype=torch.float32,
                              device=device)
        # int4: every layer's smoothing in one tensor too (predict_layers folds a run of layers at once)
        smooths = (torch.ones(s.n_layers, batch_size, s.n_kv_heads, self.channels or s.head_dim,
                              dtype=torch.float32, device=device)
                   if self.cfg.score_keys == "int4" else None)
        # score_channels: every layer's channels in one tensor too (predict_layers gathers a run at once)
        chans = (torch.zeros(s.n_layers, batch_size, s.n_kv_heads, self.channels, dtype=torch.int64, device=device)
                 if self.channels is not None else None)
        state.layers = [AsyncSpadeLayerState(window=windows[i], all_windows=windows, index=i, all_smooth=smooths,
                                             all_chans=chans) for i in range(s.n_layers)]
        return state

    # ------------------------------------------------------------------ bookkeeping
    def n_valid(self, state: PolicyState, layer: int = 0) -> int:
        """Valid queries in the window when ``select`` runs at ``state.seq_len``
        (the observes since the anchor are those of steps ``anchor+1 .. seq_len-1``)."""
        st = state.layers[layer]
        if st is None or st.anchor_seq_len is None:
            return 0
        if st.row_anchors is not None:
            ns = self.row_counts(state, layer)
            return ns[0] if all(n == ns[0] for n in ns) else -1
        pushed = max(0, state.seq_len - 1 - st.anchor_seq_len)
        return min(self.rows, st.anchor_count + pushed)

    def row_counts(self, state: PolicyState, layer: int = 0) -> list[int]:
        """``n_valid`` per row of a batch whose rows joined at different steps (serving;
        ``n_valid`` is then -1 while they differ: short prompts fill their windows at
        different steps)."""
        st = state.layers[layer]
        return [min(self.rows, c + max(0, state.seq_len - 1 - a)) for a, c in st.row_anchors]

    @property
    def k_mid(self) -> int:
        """Middle tokens attended per (row, KV head): ``budget - sink_tokens - recent_tokens``."""
        c = self.cfg
        return max(0, c.budget - c.sink_tokens - c.recent_tokens)

    def selection_layout(self) -> tuple[int, int, int]:
        """``(m * K_mid, n_sink, n_recent)``: with ``rerank`` m > 1 the selections carry
        ``m * K_mid`` candidates (``rerank_keep``)."""
        c = self.cfg
        return c.rerank * self.k_mid, c.sink_tokens, c.recent_tokens

    def rerank_keep(self) -> tuple[int, str] | None:
        """``(K_mid, group_reduce)`` with ``rerank`` > 1, else None (``Policy.rerank_keep``)."""
        c = self.cfg
        return (self.k_mid, c.group_reduce) if c.rerank > 1 and self.k_mid > 0 else None

    def graph_key(self, state: PolicyState) -> tuple:
        # the number of valid window rows changes the predictor's work until it saturates;
        # with refresh_every > 1 a reuse step launches nothing
        n = self.n_valid(state)
        key = (state.seq_len <= self.cfg.budget, n if n >= 0 else tuple(self.row_counts(state)))
        if self.channels is not None and self.cfg.channel_refresh is not None:
            key += (self.rechooses(state),)  # that step's observe rebuilds the copy
        return key if self.cfg.refresh_every == 1 else key + (self.refresh_phase(state),)

    def refresh_phase(self, state: PolicyState) -> int:
        """``refresh_every`` N > 1: -1 at a step where every layer selects (the prompt's
        first selection, which sets ``state.refresh_anchor``, or the first after a join),
        else ``(seq_len - anchor) % N``: the layers ``l`` with ``l % N`` equal to it select
        at this step (layer 0 at anchor + N, 2N, ...; layer 1 at anchor + 1, N + 1, ...).
        So each layer selects every N steps and the layers take turns (about 1/N of them
        per step): the scan's work is spread evenly over the steps instead of landing
        whole on one step in N. A function of the cache length, so every
        layer, pack and call at one cache length decides alike — a warm-up run and the
        CUDA-graph capture after it, the graph key read before both — and every path that
        selects for a step (inline, a cache rank one step ahead) makes its first selection
        at the same step; a replayed graph (no Python runs) cannot drift from it."""
        n, anchor = self.cfg.refresh_every, state.refresh_anchor
        if n == 1 or anchor is None or state.seq_len <= anchor:
            return -1
        return (state.seq_len - anchor) % n

    def refreshes(self, state: PolicyState, layer: int) -> bool:
        """Whether ``select`` of ``layer`` at ``state.seq_len`` computes a new selection
        (``refresh_phase``): always with ``refresh_every == 1``. Between its refreshes a
        layer's ``select`` returns its last selection (with the tail slots brought up to
        date)."""
        phase = self.refresh_phase(state)
        return phase < 0 or layer % self.cfg.refresh_every == phase

    def _layer(self, state: PolicyState, layer: int, q: torch.Tensor) -> AsyncSpadeLayerState:
        st = state.layers[layer]
        B, Hq, D = q.shape[0], q.shape[1], q.shape[-1]
        if st is None or st.window.shape != (B, Hq, self.rows, D) or st.window.device != q.device:
            st = AsyncSpadeLayerState(window=torch.zeros(B, Hq, self.rows, D, dtype=torch.float32,
                                                         device=q.device))
            state.layers[layer] = st
        if self.rope_aware:
            self._rope_table(q.device)  # made here, with the state: eagerly, not under graph capture
        return st

    def _rope_table(self, device: torch.device) -> torch.Tensor:
        """``kernels.rope_table`` of the model's RoPE on ``device``, made once (a
        host-to-device copy: first made with a layer's state, before any capture)."""
        table = self._rope_tables.get(device)
        if table is None:
            table = self._rope_tables[device] = kernels.rope_table(self.spec.rope.theta, self._rope_dim, device)
        return table

    def _rotate(self, x: torch.Tensor, state: PolicyState, kv_lens: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """``x`` [B, Hq, D] rotated by each row's RoPE position of cache index
        ``kv_lens - 1`` (``inverse``: un-rotated): float32, one launch on a GPU."""
        start = None if state.kv_start is None else state.kv_start.to(x.device)
        return kernels.rope_rotate(x, self._rope_table(x.device), kv_lens.to(x.device), start, 1, inverse)

    @staticmethod
    def _positions(state: PolicyState, kv_lens: torch.Tensor, back: torch.Tensor | int = 1) -> torch.Tensor:
        """RoPE position of cache index ``kv_len - back`` (index minus ``kv_start``):
        [B] for an int ``back``, [B, n] for ``back`` [n]."""
        rel = kv_lens.to(torch.int64) - row_start(state.kv_start, kv_lens)  # [B]
        if isinstance(back, torch.Tensor):
            return rel[:, None] - back[None, :]
        return rel - back

    def scoring_keys(self, st: AsyncSpadeLayerState, k_cache: torch.Tensor,
                     kv_lens: torch.Tensor | None = None, *,
                     fit: tuple[torch.Tensor, torch.Tensor | None] | None = None,
                     k_new: torch.Tensor | None = None, rebuild: bool = False,
                     state: PolicyState | None = None, prefill: bool = False,
                     lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The scoring copy of ``k_cache`` [B, Hkv, L, D] as views, kept in ``st``: int8
        (kq [B, Hkv, L, r] int8, ks [B, Hkv, L]), packed int4 (kq [B, Hkv, L, r/2] uint8, ks),
        or — ``exact`` with ``score_channels`` — the cache dtype (kq [B, Hkv, L, r], ks None);
        r = D, or the r channels ``st.chans`` when ``score_channels`` is set.

        With ``kv_lens``, the newest key of each row (slot ``kv_lens - 1``) is
        quantised into the copy (device-side, graph-safe): read from the cache's row,
        or from ``k_new`` [B, Hkv, D] (the step's keys) when given. A missing copy,
        another layout, or a cache longer than the copy's capacity rebuilds it from the
        exact keys (capacity doubled, so a growing cache rebuilds O(log L) times) —
        a RuntimeError once ``k_new`` was used (``st.keys_elsewhere``: the cache may lack
        the decoded keys). int4: a missing ``st.k_smooth`` is fitted on the keys of
        ``fit`` = (kv_lens, kv_start) (prefill: the prompt), else of ``[0, kv_lens)``,
        else of the whole view; rebuilds keep it, so the copy's scale never shifts
        mid-sequence. ``rebuild`` (new channels): refit and requantise the whole view,
        into the existing buffers when they fit (a captured graph keeps its addresses).

        ``state``: the call's state, for the cache's logical shape (``cache_dims``): on a
        paged cache (``state.block_table``, unless ``prefill``: a prefill's keys are always
        contiguous) ``k_cache`` is the layer's pool, the newest key is read through the table
        and a rebuild reads the logical keys (``_whole_keys``; ``lens``, default ``kv_lens``:
        the rows' lengths, outside which the read is zeroed). The copy's capacity is the
        cache's logical capacity (``state.cache_len`` when set), so a prefill handed only
        the prompt sizes it for the whole cache and decoding never rebuilds it for length.
        """
        if st.paged and not prefill:
            return self._paged_keys(st, k_cache, kv_lens, k_new, state, rebuild, fit, lens)
        B, H, L, D, bt = self._dims(k_cache, state, prefill)
        mode = self.cfg.score_keys
        int4 = mode == "int4"
        chans = st.chans  # [B, H, r] or None (all channels)
        r = D if chans is None else chans.shape[-1]
        dt, Dq = {"int4": (torch.uint8, r // 2), "int8": (torch.int8, r)}.get(mode, (k_cache.dtype, r))
        kq = st.kq
        same = (kq is not None and kq.device == k_cache.device and kq.dtype == dt and kq.shape[:2] == (B, H)
                and kq.shape[3] == Dq)
        refit = int4 and (rebuild or st.k_smooth is None or st.k_smooth.shape != (B, H, r)
                          or st.k_smooth.device != k_cache.device)
        if k_new is not None:
            st.keys_elsewhere = True
        if st.keys_elsewhere and (refit or rebuild or not same or kq.shape[2] < L):
            raise RuntimeError(
                f"asyncspade: the {self.cfg.score_keys} scoring copy needs a rebuild from the exact keys (cache "
                f"{tuple(k_cache.shape)}, copy {None if kq is None else tuple(kq.shape)}), but observe took the "
                "step's keys as k_new, so the cache may lack the decoded ones: keep the cache's shape fixed "
                "(or append the keys to it and observe without k_new)")
        st.score_dtype = k_cache.dtype if k_cache.dtype in (torch.float16, torch.bfloat16) else torch.float32
        ksub = None  # the channels scored of the whole cache, gathered once per rebuild
        fit = fit if fit is not None else (kv_lens, None)
        if refit:
            ksub = self._sub_keys(k_cache, state, bt, chans, lens if lens is not None else fit[0])
            self._refit_smoothing(st, ksub, fit)
            same = same and rebuild  # a copy made under another smoothing is void
        if rebuild or not same or kq.shape[2] < L:
            if ksub is None:
                ksub = self._sub_keys(k_cache, state, bt, chans, lens if lens is not None else kv_lens)
            self._rebuild_copy(st, ksub, dt, Dq, same, L)
        elif kv_lens is not None:
            self._append_copy(st, k_cache, kv_lens, k_new, dt, bt)
        return st.kq[:, :, :L], None if st.ks is None else st.ks[:, :, :L]

    def _paged_keys(self, st: AsyncSpadeLayerState, k_cache: torch.Tensor, kv_lens: torch.Tensor | None,
                    k_new: torch.Tensor | None, state: PolicyState | None, rebuild: bool,
                    fit: tuple[torch.Tensor, torch.Tensor | None] | None = None,
                    lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``scoring_keys`` of a pool copy (``st.paged``): with ``kv_lens`` the newest key of
        each row (its channels ``st.chans`` when set) quantised into its slot through
        ``state.block_table`` (the cache's table), then the pools themselves, which the
        scoring kernels read through that table. A pool copy has no capacity to outgrow;
        ``rebuild`` (channels re-chosen: a static batch's ``score_channels``) requantises the
        rows' keys ``[kv_start, lens)`` (default: ``fit``'s lengths; int4 refits its smoothing
        on ``fit``) into the same pools through the table."""
        bt = None if state is None else state.block_table
        if bt is None:
            raise RuntimeError("asyncspade: the scoring copy is in the paged cache's layout but this call has no "
                               "block table (state.block_table)")
        int4 = self.cfg.score_keys == "int4"
        if rebuild:
            if st.keys_elsewhere:
                raise RuntimeError("asyncspade: the paged scoring copy needs a rebuild from the exact keys, but "
                                   "observe took the step's keys as k_new, so the cache may lack the decoded ones")
            fit = fit if fit is not None else (kv_lens, None)
            ksub = self._sub_keys(k_cache, state, bt, st.chans, lens if lens is not None else fit[0])
            if int4:
                self._refit_smoothing(st, ksub, fit)
            q8, s8 = self._quantize(st, ksub)
            paged_write(st.kq, bt, q8, 0)  # positions outside a row's window were zeroed; unowned: the null block
            paged_write(st.ks[..., None], bt, s8[..., None], 0)
        elif kv_lens is not None:
            kv = kv_lens.to(k_cache.device)
            src = k_new if k_new is not None else last_token_keys(k_cache, kv, bt)  # [B, H, D]
            if k_new is not None:
                st.keys_elsewhere = True
            # the copy's channels (st.chans [B, H, r], or all): read by the append itself
            if int4:
                kernels.quantize_append_int4(st.kq, st.ks, src, kv, st.k_smooth, pos_offset=-1, block_table=bt,
                                             chans=st.chans)
            else:
                kernels.quantize_append(st.kq, st.ks, src, kv, pos_offset=-1, block_table=bt, chans=st.chans)
        st.score_dtype = k_cache.dtype if k_cache.dtype in (torch.float16, torch.bfloat16) else torch.float32
        return st.kq, st.ks

    @staticmethod
    def _dims(k_cache: torch.Tensor, state: PolicyState | None, prefill: bool = False
              ) -> tuple[int, int, int, int, torch.Tensor | None]:
        """The logical (B, Hkv, L, D) of the keys a call got and the table they are read
        through: ``cache_dims`` on a paged cache (``state.block_table``, never at a prefill,
        whose keys are contiguous); else ``k_cache``'s shape with L at least
        ``state.cache_len`` (the capacity, when a prefill gets only the prompt)."""
        bt = None if prefill or state is None else state.block_table
        if bt is not None:
            return (*cache_dims(k_cache, state), bt)
        B, H, L, D = k_cache.shape
        if state is not None and state.cache_len is not None:
            L = max(L, int(state.cache_len))
        return B, H, L, D, None

    @staticmethod
    def _whole_keys(k_cache: torch.Tensor, state: PolicyState | None, bt: torch.Tensor | None,
                    lens: torch.Tensor | None = None) -> torch.Tensor:
        """The cache's keys as [B, Hkv, n, D] for a whole-cache read (a copy rebuilt, channels
        chosen): ``k_cache`` itself when contiguous; on a paged cache (``bt``) a gathered copy
        of the first ``n = min(capacity, state.seq_len)`` positions (no row is longer), with
        every position outside a row's ``[kv_start, lens)`` zeroed when ``lens`` is given
        (blocks the row does not own are never read into a result)."""
        if bt is None:
            return k_cache
        L = cache_dims(k_cache, state)[2]
        n = min(L, state.seq_len) if state.seq_len > 0 else L
        k = logical_keys(k_cache, state, n)
        if lens is not None:
            pos = torch.arange(n, device=k.device)
            lens = lens.to(device=k.device, dtype=torch.int64)
            ok = (pos >= row_start(state.kv_start, lens)[:, None]) & (pos < lens[:, None])  # [B, n]
            k = torch.where(ok[:, None, :, None], k, torch.zeros((), dtype=k.dtype, device=k.device))
        return k

    def _sub_keys(self, k_cache: torch.Tensor, state: PolicyState | None, bt: torch.Tensor | None,
                  chans: torch.Tensor | None, lens: torch.Tensor | None) -> torch.Tensor:
        """The scored channels of the whole cache (``_whole_keys``): [B, Hkv, n, r]."""
        k = self._whole_keys(k_cache, state, bt, lens)
        return k if chans is None else gather_channels(k, chans)

    @staticmethod
    def _refit_smoothing(st: AsyncSpadeLayerState, ksub: torch.Tensor, fit: tuple) -> None:
        """int4: fit the keys' per-channel smoothing on ``fit`` = (kv_lens, kv_start) of
        ``ksub`` (the scored channels), in place where ``st`` already holds a tensor of that
        shape (a captured fold keeps reading it)."""
        sm = kernels.fit_smoothing(ksub, *fit)  # [B, H, r] fp32
        if st.k_smooth is not None and st.k_smooth.shape == sm.shape and st.k_smooth.device == sm.device:
            sm = st.k_smooth.copy_(sm)
        else:
            row = st.stacked_row(st.all_smooth, sm.shape, sm.device)
            if row is not None:
                sm = row.copy_(sm)  # the layer's row of the stacked smoothing
        st.k_smooth = sm

    def _quantize(self, st: AsyncSpadeLayerState, ksub: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The scoring copy's values of keys ``ksub`` [B, H, L, r]: int4 ([B, H, L, r/2] uint8
        under ``st.k_smooth``) or int8 ([B, H, L, r]) with their scales [B, H, L] fp32, or
        (exact channels) the subset itself in the cache dtype, no scales."""
        mode = self.cfg.score_keys
        if mode == "int4":
            return kernels.quantize_keys_int4(ksub, st.k_smooth)
        if mode == "int8":
            return kernels.quantize_keys(ksub)
        return ksub, None

    def _rebuild_copy(self, st: AsyncSpadeLayerState, ksub: torch.Tensor, dt: torch.dtype, Dq: int,
                      same: bool, cap: int | None = None) -> None:
        """The scoring copy of the whole view ``ksub`` [B, H, L, r], for a cache of ``cap``
        (>= L; default L) logical positions: in place when ``same`` (the copy's layout) and
        it holds ``cap`` rows, else in new buffers of ``cap`` rows (capacity doubled when the
        cache outgrew a copy of the same layout). Rows past L are left as they are (zeros in
        new buffers): no row is that long yet, each is appended before it is scored."""
        B, H, L, _ = ksub.shape
        cap = L if cap is None else max(int(cap), L)
        q8, s8 = self._quantize(st, ksub)
        kq = st.kq
        if same and kq.shape[2] >= cap:  # rebuild in place (new channels, same shapes)
            st.kq[:, :, :L].copy_(q8)
            if s8 is not None:
                st.ks[:, :, :L].copy_(s8)
            return
        cap = max(cap, 2 * kq.shape[2]) if same else cap
        if cap == L:
            st.kq, st.ks = q8.contiguous(), s8
            return
        st.kq = torch.zeros(B, H, cap, Dq, dtype=dt, device=ksub.device)
        st.kq[:, :, :L] = q8
        st.ks = None
        if s8 is not None:
            st.ks = torch.zeros(B, H, cap, dtype=torch.float32, device=ksub.device)
            st.ks[:, :, :L] = s8

    def _append_copy(self, st: AsyncSpadeLayerState, k_cache: torch.Tensor, kv_lens: torch.Tensor,
                     k_new: torch.Tensor | None, dt: torch.dtype, block_table: torch.Tensor | None = None) -> None:
        """The newest key of each row (slot ``kv_lens - 1``: the cache's row, or ``k_new``)
        into the copy, device-side (graph-safe). ``block_table``: ``k_cache`` is a paged
        cache's pool, its newest keys read through the table (``last_token_keys``)."""
        B, H = st.kq.shape[:2]
        chans, mode = st.chans, self.cfg.score_keys
        kv = kv_lens.to(k_cache.device)  # slot kv - 1: the kernels add the offset (no launch for it)
        src = k_cache if k_new is None else k_new  # the cache is read at row kv - 1
        if k_new is None and block_table is not None:
            src = last_token_keys(k_cache, kv, block_table)  # [B, H, D]
        # int8 / int4: the append reads the copy's channels (chans, or all) of the newest keys itself
        if mode == "int4":
            kernels.quantize_append_int4(st.kq, st.ks, src, kv, st.k_smooth, pos_offset=-1, chans=chans)
        elif mode == "int8":
            kernels.quantize_append(st.kq, st.ks, src, kv, pos_offset=-1, chans=chans)
        else:  # exact channels: write the row at slot kv - 1 (rows past the copy are skipped)
            if src.dim() == 4:  # the cache's newest rows
                src = last_token_keys(k_cache, kv, None)
            src = gather_channels(src, chans)  # [B, H, r]
            r = st.kq.shape[3]
            slot = (kv.to(torch.int64) - 1).clamp(0, st.kq.shape[2] - 1).view(B, 1, 1, 1).expand(B, H, 1, r)
            st.kq.scatter_(2, slot, src.to(dt)[:, :, None, :])

    @property
    def keeps_copy(self) -> bool:
        """Whether the selection scores a copy of the keys the policy keeps (int8, int4, or
        a channel subset) rather than the cache itself."""
        return self.cfg.score_keys != "exact" or self.channels is not None

    def rechooses(self, state: PolicyState, layer: int = 0) -> bool:
        """Whether ``observe`` at ``state.seq_len`` re-chooses ``layer``'s channels
        (``channel_refresh``: the cache length reached that factor times its length at the
        last choice). A host decision, the same on every path that observes this step."""
        f = self.cfg.channel_refresh
        st = state.layers[layer] if state.layers else None
        return (self.channels is not None and f is not None and st is not None and st.chans is not None
                and state.seq_len >= f * st.chan_seq)

    def choose_channels(self, state: PolicyState, st: AsyncSpadeLayerState, k_cache: torch.Tensor,
                        kv_lens: torch.Tensor, prefill: bool = False) -> None:
        """Choose ``st.chans`` from the query window and the keys ``[kv_start, kv_lens)``
        (``pick_channels``), in place when the shape allows (graph-safe). On a paged cache
        (``state.block_table``, unless ``prefill``) the keys are read through the table."""
        lo = row_start(state.kv_start, kv_lens)
        k = self._whole_keys(k_cache, state, None if prefill else state.block_table, kv_lens)
        chans = pick_channels(query_pair_mass(st.window, self.spec.n_kv_heads),
                              key_pair_mass(k, lo, kv_lens), self.channels)
        if st.chans is not None and st.chans.shape == chans.shape and st.chans.device == chans.device:
            st.chans.copy_(chans)
        else:
            row = st.stacked_row(st.all_chans, chans.shape, chans.device)
            if row is not None:
                chans = row.copy_(chans)  # the layer's row of the stacked channels
            st.chans = chans
        st.chan_seq = state.seq_len

    # ------------------------------------------------------------------ policy API
    def prefill(self, state: PolicyState, layer: int, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, kv_lens: torch.Tensor) -> None:
        """Push the prompt's last W+1 queries (``q`` [B, Hq, T, D], right-aligned at
        ``kv_lens``); queries of left padding are zeroed."""
        st = self._layer(state, layer, q[:, :, 0])
        T = q.shape[2]
        n = min(T, self.rows)
        qs = q[:, :, T - n:].float()  # [B, Hq, n, D]
        offset = torch.arange(n, 0, -1, device=q.device)  # column j sits at kv_len - (n - j)
        pos = self._positions(state, kv_lens.to(q.device), offset)  # [B, n]
        if self.rope_aware:
            qs = rotate(qs, pos, self.spec.rope, inverse=True)
        qs = qs * (pos >= 0)[:, None, :, None]  # padding queries carry no signal
        st.window.zero_()
        st.window[:, :, self.rows - n:] = qs
        st.anchor_seq_len, st.anchor_count = state.seq_len, n
        st.last_sel = state.refresh_anchor = None  # a new prompt: nothing to reuse
        reset_carry(state, layer)
        if self.keeps_copy:
            st.kq = st.ks = st.k_smooth = st.chans = None  # a new prompt: fit and quantise the whole cache afresh
            st.keys_elsewhere = st.paged = False
            if self.channels is not None:
                self.choose_channels(state, st, k_cache, kv_lens.to(k_cache.device), prefill=True)
            pool = state.join_pool
            if pool is None:
                # sized for the cache's capacity (state.cache_len), not the view: k_cache may be the prompt alone
                self.scoring_keys(st, k_cache, fit=(kv_lens, state.kv_start), state=state, prefill=True)
                return
            # a paged cache (a static batch's prompt in its pool): the prompt's copy, then into the pool
            cap, state.cache_len = state.cache_len, None
            try:
                self.scoring_keys(st, k_cache, fit=(kv_lens, state.kv_start), state=state, prefill=True)
            finally:
                state.cache_len = cap
            if st.ks is not None:  # (int8 / int4 copies carry scales: a pool in the cache's layout)
                new = copy.copy(st)
                new.k_smooth = None  # (int4's smoothing stays the layer's own, as the prompt fitted it)
                st.kq = st.ks = None
                B = k_cache.shape[0]
                self._copy_rows(st, new, torch.arange(B, device=new.kq.device), B, pool, state.seq_len)

    def takes_new_keys(self, state: PolicyState) -> bool:
        # compressed scoring keys: observe quantises the step's key, select scores the copy;
        # channels re-chosen as the cache grows need the exact keys kept
        return self.keeps_copy and not (self.channels is not None and self.cfg.channel_refresh is not None)

    def observe(self, state: PolicyState, layer: int, q: torch.Tensor, k_cache: torch.Tensor,
                kv_lens: torch.Tensor, k_new: torch.Tensor | None = None) -> None:
        """Push ``q`` into the window; compressed keys: quantise the newest key into the
        copy, from ``k_new`` [B, Hkv, D] when given (``takes_new_keys``), else from the
        cache's row ``kv_lens - 1``."""
        st = self._layer(state, layer, q)
        qn = q  # [B, Hq, D]
        if self.rope_aware:
            qn = self._rotate(q, state, kv_lens, inverse=True)
        kernels.window_push(st.window, qn)  # shift out the oldest, qn (as fp32) the newest: one launch
        if st.anchor_seq_len is None:  # no prefill: start counting here
            st.anchor_seq_len, st.anchor_count = state.seq_len, 1
        if self.channels is not None and (st.chans is None or self.rechooses(state, layer)):
            # first or re-chosen channels: the whole copy from the exact keys (in place)
            kv = kv_lens.to(k_cache.device)
            first = st.chans is None
            self.choose_channels(state, st, k_cache, kv)
            self.scoring_keys(st, k_cache, fit=(kv, state.kv_start), rebuild=not first, state=state)
        elif self.keeps_copy:
            self.scoring_keys(st, k_cache, kv_lens, k_new=k_new, fit=(kv_lens, state.kv_start), state=state)

    def predict_layers(self, state: PolicyState, layers: range, kv_lens: torch.Tensor | None = None) -> None:
        """Predict the next query of every layer in ``layers`` (consecutive) that selects at
        this step (with ``refresh_every`` N > 1, those of this step's turn: N apart) with one
        predictor launch instead of one per layer — what a cache rank does for a pack
        before selecting its layers (the solves are tiny and latency-bound, so a
        launch per layer costs its whole latency each time). ``select`` then uses
        the prediction made here at this ``seq_len``; without this call it predicts
        per layer, with the same result. ``kv_lens``: the cache lengths ``select`` will
        get; with ``rope_aware`` the run's predictions are then rotated here, in one
        launch (and folded for compressed keys), instead of per layer."""
        if len(layers) < 2 or self.cfg.predictor == "last" or is_dense(state, self.cfg.budget, self.name):
            return
        if not any(self.refreshes(state, i) for i in layers):
            return  # a reuse step of every layer of the run: nothing to predict
        phase = self.refresh_phase(state)
        if phase >= 0:  # refresh_every N > 1, the layers taking turns: only this step's, N apart
            n_every = self.cfg.refresh_every
            layers = range(layers[0] + (phase - layers[0]) % n_every, layers[-1] + 1, n_every)
            if len(layers) < 2:
                return  # one layer of the run selects: its select predicts it alone
        if not kernels.use_triton(state.layers[layers[0]].window):
            return  # the torch solve may round differently in a bigger batch; the kernel's programs cannot
        sts = [state.layers[i] for i in layers]
        base = sts[0].all_windows if sts[0] is not None else None
        n = self.n_valid(state, layers[0])
        if base is None or n < 2 or any(
                st is None or st.all_windows is not base or self.n_valid(state, i) != n for i, st in zip(layers, sts)):
            return  # windows of their own (rebuilt for another batch) or uneven history: per layer
        w = base[layers[0]:layers[-1] + 1:layers.step]  # [P, B, Hq, R, D] (contiguous at step 1)
        P, B, H, R, D = w.shape
        q = kernels.ridge_predict(w.reshape(P * B * H, R, D), n, mode=self.cfg.predictor,
                                  eps=self.cfg.ridge_eps, skip=state.idle, per=H).view(P, B, H, D)
        rotated = self.rope_aware and kv_lens is not None
        if rotated:  # every layer of the run at the rows' positions: one launch
            q = self._rotate(q.view(P * B, H, D), state, kv_lens).view(P, B, H, D)
        q_sc = self._scoring_queries(sts, layers, q, rotated)
        for j, st in enumerate(sts):
            st.q_pred, st.q_pred_seq, st.q_pred_rotated = q[j], state.seq_len, rotated
            st.q_scored, st.q_scored_smooth = (None, None) if q_sc is None else (q_sc[j], st.k_smooth)

    def _scoring_queries(self, sts: list, layers: range, q: torch.Tensor, rotated: bool) -> torch.Tensor | None:
        """Scoring a copy of the keys: the run's predictions ``q`` [P, B, Hq, D] fp32 as
        ``select`` scores them — restricted to each layer's channels (``score_channels``:
        one gather for the run), int4: times each layer's smoothing (``fold_smoothing``),
        and rounded to the cache's half dtype — in one or two launches for the run instead of
        up to four per layer (the fp32 products rounded once, as ``fold_smoothing`` + ``.to``
        do); None when that does not apply (the cache's own keys, pre-RoPE predictions,
        channels or smoothing not stacked)."""
        cfg = self.cfg
        if not self.keeps_copy or (self.rope_aware and not rotated):
            return None
        dts = {st.score_dtype for st in sts}
        if len(dts) != 1 or None in dts:
            return None
        dt = dts.pop()
        P, B, H, D = q.shape
        sl = slice(layers[0], layers[-1] + 1, layers.step)
        if self.channels is not None:  # each layer's r channels: [P, B, Hq, r]
            cb = sts[0].all_chans
            if cb is None or any(st.all_chans is not cb or st.chans is None or st.index != i
                                 or st.chans.data_ptr() != cb[i].data_ptr() for i, st in zip(layers, sts)):
                return None
            Hkv, r = cb.shape[2], cb.shape[3]
            if cb.shape[1] != B or H % Hkv:
                return None
            q = q.view(P, B, Hkv, H // Hkv, D).gather(4, cb[sl, :, :, None, :].expand(P, B, Hkv, H // Hkv, r))
            q, D = q.view(P, B, H, r), r
        if cfg.score_keys != "int4":  # int8 / exact channels: the rounding alone
            return q.to(dt) if dt != q.dtype or self.channels is not None else None
        base = sts[0].all_smooth
        if base is None or any(st.all_smooth is not base or st.k_smooth is None or st.index != i
                               or st.k_smooth.data_ptr() != base[i].data_ptr() for i, st in zip(layers, sts)):
            return None
        Hkv = base.shape[2]
        if base.shape[1:] != (B, Hkv, D) or H % Hkv:
            return None
        out = torch.empty(P, B, H, D, dtype=dt, device=q.device)
        torch.mul(q.view(P, B, Hkv, H // Hkv, D), base[sl, :, :, None, :], out=out.view(P, B, Hkv, H // Hkv, D))
        return out

    def predict_query(self, state: PolicyState, layer: int, kv_lens: torch.Tensor) -> torch.Tensor | None:
        """q̂ for the step whose cache length is ``kv_lens`` (post-RoPE when
        ``rope_aware``): [B, Hq, D] float32, or None before any query was seen."""
        n = self.n_valid(state, layer)
        if n == 0:
            return None
        st = state.layers[layer]
        if st.q_pred is not None and st.q_pred_seq == state.seq_len:  # made ahead by predict_layers
            q_hat, st.q_pred, st.q_pred_seq = st.q_pred, None, -1
            if st.q_pred_rotated:  # rotated there too
                return q_hat
        elif n < 0:  # rows with windows of different fill (serving): one prediction per fill
            q_hat = self._predict_rows(state, layer)
        else:
            q_hat = predict(st.window, n, self.cfg.predictor, self.cfg.ridge_eps, skip=state.idle)  # [B, Hq, D]
        if self.rope_aware:
            q_hat = self._rotate(q_hat, state, kv_lens)
        return q_hat

    def _predict_rows(self, state: PolicyState, layer: int) -> torch.Tensor:
        """q̂ [B, Hq, D] float32 when the rows' windows hold different numbers of queries:
        the rows of each count predicted together (zeros for a row with none)."""
        st = state.layers[layer]
        counts = self.row_counts(state, layer)
        B, Hq, _, D = st.window.shape
        out = torch.zeros(B, Hq, D, dtype=torch.float32, device=st.window.device)
        for n in sorted(set(counts)):
            if n == 0:
                continue
            idx = self._rows_index(tuple(b for b, c in enumerate(counts) if c == n), out.device)
            out.index_copy_(0, idx, predict(st.window.index_select(0, idx), n, self.cfg.predictor,
                                            self.cfg.ridge_eps))
        return out

    def _rows_index(self, rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """``rows`` as an int64 index on ``device``, made once per row set: a graph key's
        eager call makes it, its CUDA-graph capture reuses it (a host-to-device copy cannot
        be captured)."""
        key = (str(device), rows)
        idx = self._row_index.get(key)
        if idx is None:
            idx = self._row_index[key] = device_index(rows, device)
        return idx

    def prefill_rows(self, state: PolicyState, layer: int, rows: list[int], q: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, kv_lens: torch.Tensor) -> None:
        """The joining rows' query windows (and compressed scoring keys) from their
        prompts, their window counts anchored at the batch's cursor (``row_anchors``):
        each row predicts as it would alone. With ``refresh_every`` N > 1 the batch's
        schedule restarts: the next selection is a refresh of every row (the joining rows
        have nothing to reuse), so a request's selections depend on when others joined
        (one schedule for the batch). ``score_channels``: each joining row's channels are
        chosen from its own prompt, as alone, and kept (refuses ``channel_refresh``, whose
        re-choice is the batch's)."""
        cfg = self.cfg
        why = serving_refusal(cfg)
        if why is not None:
            raise ConfigError(why)
        state.refresh_anchor = None  # refresh_every > 1: every row selects afresh at the next step
        st = self._layer(state, layer, torch.empty(state.batch_size, q.shape[1], q.shape[-1], device=q.device))
        sub = self.row_state(state, rows, k_cache.device)
        if state.join_pool is not None and (st.kq is None or st.paged):
            sub.cache_len = None  # a pool copy takes the rows' [0, S) only: no copy of the whole capacity
        self.prefill(sub, layer, q, k_cache, v_cache, kv_lens)
        new = sub.layers[layer]
        B = state.batch_size
        idx = device_index(rows, st.window.device)
        st.window.index_copy_(0, idx, new.window)
        if st.row_anchors is None:
            if st.anchor_seq_len is not None:  # a batch prefill (a restarted cache rank's boot): its rows keep it
                st.row_anchors = [(st.anchor_seq_len, st.anchor_count)] * B
            else:  # rows never prefilled (idle): counted full. Their windows' zeros predict a zero query
                # and their selections are ignored until they join, so the batch keeps one graph key
                # (one CUDA graph) while the joined rows' windows are full, instead of a key per step
                # while idle rows would fill (seen once each: eager on the cache rank)
                st.row_anchors = [(state.seq_len, self.rows)] * B
                st.anchor_seq_len, st.anchor_count = state.seq_len, self.rows
        for r in rows:
            st.row_anchors[r] = (state.seq_len, new.anchor_count)
        st.last_sel = None
        reset_carry(state, layer, rows)  # a speed hint only: the selection is the exact top-K either way
        if self.keeps_copy:
            self._copy_rows(st, new, idx, B, state.join_pool, state.seq_len)

    @staticmethod
    def _copy_rows(st: AsyncSpadeLayerState, new: AsyncSpadeLayerState, idx: torch.Tensor, B: int,
                   join_pool: tuple[torch.Tensor, torch.Tensor] | None = None, S: int = 0) -> None:
        """The joining rows' scoring copy (``new``, made by a prefill of them alone) into the
        batch's, made on first use: with ``join_pool`` (a paged cache: its key pool and block
        table) and an int8 / int4 copy, a pool in the cache's layout (``st.paged``) that takes
        the rows' first ``S`` positions through the table; else rows of the rows' capacity."""
        pool = join_pool is not None and new.ks is not None and (st.kq is None or st.paged)
        if pool:
            k_pool, table = join_pool
            shape = (k_pool.shape[0], new.kq.shape[1], k_pool.shape[2], new.kq.shape[3])
            if st.kq is None or tuple(st.kq.shape) != shape or st.kq.dtype != new.kq.dtype \
                    or st.kq.device != new.kq.device:
                st.kq = torch.zeros(shape, dtype=new.kq.dtype, device=new.kq.device)
                st.ks = torch.zeros(shape[:3], dtype=torch.float32, device=new.kq.device)
            rows = table.index_select(0, idx)  # the joining rows' tables
            # positions before a row's window map to the null block, which nothing reads
            paged_write(st.kq, rows, new.kq[:, :, :S], 0)
            paged_write(st.ks[..., None], rows, new.ks[:, :, :S, None], 0)
            st.paged = True
        else:
            if st.kq is None or st.kq.shape[0] != B or st.kq.shape[1:] != new.kq.shape[1:] \
                    or st.kq.dtype != new.kq.dtype or st.kq.device != new.kq.device:
                st.kq = torch.zeros(B, *new.kq.shape[1:], dtype=new.kq.dtype, device=new.kq.device)
                st.ks = None if new.ks is None else torch.zeros(B, *new.ks.shape[1:], dtype=new.ks.dtype,
                                                                device=new.ks.device)
            st.kq.index_copy_(0, idx, new.kq)
            if new.ks is not None:
                st.ks.index_copy_(0, idx, new.ks)
        if new.chans is not None and new.chans is not st.chans:  # score_channels: the rows' own choice
            shape = (B, *new.chans.shape[1:])
            if st.chans is None or tuple(st.chans.shape) != shape:
                st.chans = st.stacked_row(st.all_chans, shape, new.chans.device)
                if st.chans is None:
                    st.chans = torch.zeros(shape, dtype=new.chans.dtype, device=new.chans.device)
            st.chans.index_copy_(0, idx, new.chans)
        if new.k_smooth is not None:
            if st.k_smooth is None or st.k_smooth.shape[1:] != new.k_smooth.shape[1:]:
                shape = (B, *new.k_smooth.shape[1:])
                st.k_smooth = st.stacked_row(st.all_smooth, shape, new.k_smooth.device)
                if st.k_smooth is None:
                    st.k_smooth = torch.ones(shape, dtype=torch.float32, device=new.k_smooth.device)
            st.k_smooth.index_copy_(0, idx, new.k_smooth)
        st.score_dtype = new.score_dtype
        st.keys_elsewhere = False

    def select(self, state: PolicyState, layer: int, q: torch.Tensor | None, k_cache: torch.Tensor,
               kv_lens: torch.Tensor, out: torch.Tensor | None = None) -> Selection | None:
        """``out``: see ``Policy.select_takes_out`` (``topk_selection``'s)."""
        cfg = self.cfg
        if is_dense(state, cfg.budget, self.name):
            return None
        st = state.layers[layer]
        if not self.refreshes(state, layer):  # refresh_every > 1, between this layer's refreshes
            if st is None:
                return None
            st.q_pred, st.q_scored, st.q_scored_smooth = None, None, None
            n_tail = self._n_tail()
            if n_tail and st.last_sel is not None and st.last_sel.indices is st.keep:
                self._write_tail(st, kv_lens, st.keep[:, :, st.keep.shape[2] - n_tail:])
            return st.last_sel
        pre = None  # the query as scored, made ahead with the run's prediction (predict_layers)
        if st is not None and st.q_scored is not None:
            if st.q_pred is not None and st.q_pred_seq == state.seq_len:
                pre, smooth = st.q_scored, st.q_scored_smooth
            st.q_scored = st.q_scored_smooth = None
        q_hat = self.predict_query(state, layer, kv_lens)
        if q_hat is None:  # nothing observed yet (no prefill queries): full attention
            return None
        B, Hkv = cache_dims(k_cache, state)[:2]
        k_score, k_scale = k_cache, None
        bt = state.block_table  # a paged cache: exact keys are scored in the pool through the table
        if self.keeps_copy:  # the policy's own copy: rows of its own, or a pool under the cache's table
            k_score, k_scale = self.scoring_keys(st, k_cache, fit=(kv_lens, state.kv_start), state=state,
                                                 lens=kv_lens)
            bt = bt if st.paged else None  # a pool copy is read through the cache's table
            if pre is not None and smooth is st.k_smooth and pre.dtype == st.score_dtype:
                q_hat = pre
            else:
                if st.chans is not None:
                    q_hat = gather_channels(q_hat, st.chans)  # [B, Hq, r]: the channels the copy holds
                q_hat = kernels.fold_smoothing(q_hat, st.k_smooth)  # int4: the copy's smoothing (fp32)
                if k_cache.dtype in (torch.float16, torch.bfloat16):
                    # as the exact path rounds q̂ to the cache dtype: same query, tensor-core products
                    q_hat = q_hat.to(k_cache.dtype)
        # sum_softmax normaliser without the newest token: a cache rank selecting ahead has
        # not received its key yet, so every path leaves it out and all give one selection
        norm_lens = None
        if cfg.group_reduce == "sum_softmax":
            norm_lens = derived(state.memo, ("kv_lens - 1",), (kv_lens,), lambda: kv_lens - 1)
        periodic = cfg.refresh_every > 1
        shape = (B, Hkv, cfg.rerank * self.k_mid)  # rerank m: m * K_mid candidates
        n_tail = self._n_tail()
        if periodic:  # select into the layer's own buffer (see AsyncSpadeLayerState.keep)
            if state.refresh_anchor is None:
                state.refresh_anchor = state.seq_len
            if st.keep is None or tuple(st.keep.shape) != shape or st.keep.device != k_cache.device:
                st.keep = torch.empty(shape, dtype=torch.int32, device=k_cache.device)
            out = st.keep
            if n_tail:  # the scan fills all but the tail slots (see _n_tail)
                if st.scan_buf is None or tuple(st.scan_buf.shape) != shape[:2] + (shape[2] - n_tail,) \
                        or st.scan_buf.device != k_cache.device:
                    st.scan_buf = torch.empty(shape[:2] + (shape[2] - n_tail,), dtype=torch.int32,
                                              device=k_cache.device)
                    st.tail_pos = torch.empty(shape[0], n_tail, dtype=torch.int64, device=k_cache.device)
                out = st.scan_buf
        # rerank m > 1: m * K_mid candidates in the middle (sinks and recent window as ever)
        n_cand = cfg.sink_tokens + cfg.recent_tokens + cfg.rerank * self.k_mid - n_tail
        sel = topk_selection(q_hat, k_score, kv_lens, state.kv_start, budget=n_cand,
                             n_sink=cfg.sink_tokens, n_recent=cfg.recent_tokens,
                             scale=self.spec.softmax_scale, reduce=cfg.group_reduce, k_scale=k_scale,
                             norm_lens=norm_lens, out=out, memo=state.memo,
                             carry=layer_carry(state, layer, cfg.topk, k_score, bt),
                             carry_margin=REFRESH_CARRY_MARGIN if periodic else None, block_table=bt)
        if n_tail and sel.indices is st.scan_buf:  # scan + tail slots, in the layer's buffer
            # (inside a cache rank's select_overlap block the select ran on its side stream)
            with after_selects(k_cache.device):
                st.keep[:, :, :shape[2] - n_tail].copy_(sel.indices)
                self._set_tail(state, st, kv_lens)
                self._write_tail(st, kv_lens, st.keep[:, :, shape[2] - n_tail:])
            sel = Selection(indices=st.keep, n_sink=sel.n_sink, n_recent=sel.n_recent, kv_start=sel.kv_start)
        rr = self.rerank_keep()
        if rr is not None:
            sel.keep, sel.keep_reduce = rr
        if periodic:
            st.last_sel = sel  # (its indices are st.keep unless the budget leaves no middle)
        return sel

    def _n_tail(self) -> int:
        """Tail slots of a selection reused between refreshes (``refresh_every`` N > 1): the
        N - 1 tokens that leave the recent window before the next refresh, which the scan
        could not select (they were in the window) and a reused selection would otherwise
        never attend. The scan fills the other slots, so the budget holds; a slot is ``-1``
        until its token has left the window (``_write_tail``). 0 without refreshes or
        middle. With ``rerank`` the tail slots are candidates like the scan's."""
        cfg = self.cfg
        if cfg.refresh_every == 1 or self.k_mid <= 0:
            return 0
        return min(cfg.refresh_every - 1, cfg.rerank * self.k_mid - 1)

    def _set_tail(self, state: PolicyState, st: AsyncSpadeLayerState, kv_lens: torch.Tensor) -> None:
        """At a refresh: ``st.tail_pos`` from its cache lengths (device-side, in place)."""
        t = st.tail_pos
        R, n = self.cfg.recent_tokens, t.shape[1]
        pos = (kv_lens.to(device=t.device, dtype=torch.int64) - R)[:, None] + torch.arange(n, device=t.device)
        first = self.cfg.sink_tokens if state.kv_start is None else \
            (state.kv_start.to(t.device).long() + self.cfg.sink_tokens)[:, None]
        t.copy_(pos.masked_fill_(pos < first, TAIL_NEVER))

    def _write_tail(self, st: AsyncSpadeLayerState, kv_lens: torch.Tensor, dst: torch.Tensor) -> None:
        """Into ``dst`` [B, Hkv, n_tail]: each of ``st.tail_pos`` once it has left the recent
        window (below ``kv_lens - R``), else ``-1``: a compare and a select per step."""
        B, H, n = dst.shape
        t = st.tail_pos
        gone = t < (kv_lens.to(device=t.device, dtype=torch.int64) - self.cfg.recent_tokens)[:, None]
        dst.copy_(torch.where(gone, t, -1)[:, None, :].expand(B, H, n))

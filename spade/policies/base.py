"""The policy interface: which cached tokens does each decode step attend?

Common rules (every policy follows them; tests check them):

* ``budget`` K counts everything attended per (batch row, KV head): sink tokens,
  the recent window (which holds the current token) and the selected tokens.
* When the context (``kv_len``) is <= K the selection is exactly full attention
  (``select`` returns ``None``).
* GQA: one selection per KV head, made from the group's query heads reduced by
  ``group_reduce`` (``sum_logits``, ``max_logits`` or ``sum_softmax``).
* A ``Selection`` never repeats a position and never names a position outside
  ``[0, kv_len)``; its middle ``indices`` are disjoint from the sink range
  ``[0, n_sink)`` and the recent range ``[kv_len - n_recent, kv_len)``.

Call order for one layer of one decode step (the token being decoded is already
appended to the KV cache, so ``kv_lens`` includes it)::

    sel = policy.select(state, layer, q, k_cache, kv_lens)   # before attention
    out = attend(q, k_cache, v_cache, kv_lens, sel)
    policy.observe(state, layer, q, k_cache, kv_lens)          # after attention

``prefill`` is called once per layer after the dense prompt pass. Policies that
do not need the current query (``needs_current_query = False``: asyncspade,
streaming) can run ``select`` for step t+1 right after ``observe`` of step t,
which is what the asynchronous runtime does on the cache rank.

Shapes: ``q`` [B, Hq, D] (post-RoPE), ``k_cache``/``v_cache`` [B, Hkv, Lmax, D]
(positions >= kv_lens[b] are garbage), ``kv_lens`` [B] int (device tensor).
On a paged cache (``PolicyState.block_table`` set) ``select`` / ``observe`` get the
layer's pool [num_blocks, Hkv, block_size, D] instead, read through the table; positions
stay logical (``spade.policies.common.cache_dims`` gives the logical shape).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, model_validator

from spade.config import ConfigSection
from spade.streams import device_index


GroupReduce = Literal["sum_logits", "max_logits", "sum_softmax"]


class SparseCommonConfig(ConfigSection):
    """The fields of the token-level policies (oracle, streaming, asyncspade): the budget
    and the always-attended sinks and recent window."""


    budget: int = Field(256, gt=0)
    """K: tokens attended per step per KV head, sinks and recent window included."""
    sink_tokens: int = Field(4, ge=0)
    recent_tokens: int = Field(16, ge=1)
    """Most recent tokens always attended (the current token included)."""
    group_reduce: GroupReduce = "sum_softmax"
    """How the query heads of a GQA group are reduced into one score per KV head.

    ``sum_softmax`` (default): each head's softmax over the row's own valid tokens,
    summed over the group, so the selection maximises the attention mass the group
    keeps; on real weights it kept more mass than ``sum_logits`` for every policy,
    model and context measured (docs/fidelity.md). ``sum_logits`` / ``max_logits``
    skip the per-head normaliser pass: the speed settings of the GPU configs."""

    @model_validator(mode="after")
    def _fits(self):
        if self.sink_tokens + self.recent_tokens > self.budget:
            raise ValueError(
                f"sink_tokens ({self.sink_tokens}) + recent_tokens ({self.recent_tokens}) exceed "
                f"budget ({self.budget}); raise budget or lower them"
            )
        return self


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters (HF ``rotate_half`` convention)."""

    theta: float = 10000.0
    dim: int = 0  # rotary dims (== head_dim unless partial rotary)
    attention_scaling: float = 1.0

    def cos_sin(self, positions: torch.Tensor, device=None, dtype=torch.float32):
        """cos, sin of shape [*positions.shape, dim] (rotate_half layout)."""
        dim = self.dim
        inv = 1.0 / (self.theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim))
        ang = positions.to(device=device, dtype=torch.float64)[..., None] * inv
        emb = torch.cat([ang, ang], dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


@dataclass(frozen=True)
class AttentionSpec:
    """What a policy needs to know about the model's attention."""

    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float | None = None  # softmax scale; None -> head_dim ** -0.5
    rope: RopeSpec | None = None

    @property
    def group(self) -> int:
        return self.n_q_heads // self.n_kv_heads

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_dim ** -0.5


@dataclass
class Selection:
    """Which tokens one layer attends for one step.

    With ``s = kv_start[b]`` (0 when None; left padding puts garbage before it),
    the attended set per (b, h) is ``[s, min(s + n_sink, kv_len))``
    ∪ ``{i in indices[b, h], i >= 0}`` ∪ ``[max(kv_len - n_recent, s + n_sink), kv_len)``.

    ``indices``: [B, Hkv, K_mid] int32, ``-1`` = empty slot.

    Two-stage selection (``keep > 0``): ``indices`` holds M >= ``keep`` *candidates*
    (made with a predicted query), and the attention keeps only the ``keep`` best of
    them by the step's true query (``reranked``; the group reduced by ``keep_reduce``
    over the candidates), with the sinks and the recent window as above.
    """

    indices: torch.Tensor
    n_sink: int = 0
    n_recent: int = 0
    kv_start: torch.Tensor | None = None  # [B] int32, first valid position
    keep: int = 0
    """> 0: re-rank ``indices`` (candidates) with the true query and attend the best ``keep``."""
    keep_reduce: GroupReduce = "sum_softmax"
    """The group reduction of the re-rank (``spade.kernels.rerank``)."""

    def reranked(self, q: torch.Tensor, k_cache: torch.Tensor, scale: float | None = None,
                 out: torch.Tensor | None = None, block_table: torch.Tensor | None = None) -> Selection:
        """This selection with its candidates re-ranked by ``q`` [B, Hq, D] against the exact
        keys ``k_cache`` [B, Hkv, L, D]: the ``keep`` best as a plain selection (``keep`` 0);
        itself when it is one already. ``out``: int32 [B, Hkv, keep] buffer for the indices.

        ``block_table`` [B, max_blocks] int32: ``k_cache`` is a paged cache's pool
        [num_blocks, Hkv, block_size, D] (``spade.kernels.paged``); the re-rank kernel maps
        the candidates' logical positions through it where it reads their keys."""
        if self.keep <= 0:
            return self
        from spade import kernels

        B = self.indices.shape[0]
        if block_table is None and (k_cache.dim() != 4 or k_cache.shape[0] != B):
            raise ValueError(
                f"Selection.reranked: k_cache {tuple(k_cache.shape)} is not the [B={B}, Hkv, L, D] cache of this "
                "selection; a paged cache's pool [num_blocks, Hkv, block_size, D] needs block_table=")
        kept = kernels.rerank_select(q, k_cache, self.indices, self.keep, scale=scale, reduce=self.keep_reduce,
                                     out=out, block_table=block_table)
        return Selection(indices=kept, n_sink=self.n_sink, n_recent=self.n_recent, kv_start=self.kv_start)

    def _bounds(self, kv_lens: torch.Tensor):
        dev = self.indices.device
        kv = kv_lens.to(dev).long()
        s = torch.zeros_like(kv) if self.kv_start is None else self.kv_start.to(dev).long()
        sink_end = torch.minimum(s + self.n_sink, kv)
        recent_start = torch.maximum(kv - self.n_recent, sink_end)
        return s, sink_end, recent_start, kv

    def attended(self, kv_lens: torch.Tensor) -> torch.Tensor:
        """Number of attended tokens per (b, h): [B, Hkv] (for stats and tests); with
        ``keep``, the candidates count up to ``keep``."""
        s, sink_end, recent_start, kv = self._bounds(kv_lens)
        fixed = (sink_end - s) + (kv - recent_start)
        mid = (self.indices >= 0).sum(-1)
        return fixed[:, None] + (mid.clamp(max=self.keep) if self.keep > 0 else mid)

    def to_mask(self, kv_lens: torch.Tensor, length: int) -> torch.Tensor:
        """Dense boolean mask [B, Hkv, length] of attended positions (reference use); with
        ``keep``, of every candidate (``reranked`` first for the attended ones)."""
        B, H, _ = self.indices.shape
        dev = self.indices.device
        pos = torch.arange(length, device=dev)
        s, sink_end, recent_start, kv = (t[:, None, None] for t in self._bounds(kv_lens))
        mask = ((pos >= s) & (pos < sink_end)) | ((pos >= recent_start) & (pos < kv))
        mask = mask.expand(B, H, length)
        # scatter the middle indices into a spare column for the -1 slots, so an
        # empty slot can never clobber a real index (scatter order is undefined)
        idx = self.indices.long()
        idx = torch.where(idx >= 0, idx, torch.full_like(idx, length))
        extra = torch.zeros(B, H, length + 1, dtype=torch.bool, device=dev)
        extra.scatter_(2, idx, True)
        mask = mask | extra[..., :length]
        return mask




@dataclass
class PolicyState:
    """Per-sequence-batch state of a policy: one entry per layer (policy-defined)."""

    batch_size: int
    layers: list[Any] = field(default_factory=list)
    seq_len: int = 0
    """Cache length on the host (same for every row; kept by the caller, no sync)."""
    kv_start: torch.Tensor | None = None
    """[B] int32 first valid cache position per row (left padding), or None."""
    stats: dict[str, float] = field(default_factory=dict)
    carry: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per layer: the threshold-carry top-K state (``spade.kernels.carry.new_carry``)
    of policies with ``topk: carry`` (``spade.policies.common.layer_carry``)."""
    memo: dict | None = None
    """Inside ``spade.policies.common.shared_derived`` (a cache rank's pack): tensors
    derived from the calls' inputs (middle bounds of ``kv_lens``, ...), computed once and
    reused by every layer's call; None elsewhere."""
    refresh_anchor: int | None = None
    """Cache length of this prompt's first selection, for a policy that selects every
    few steps (``asyncspade``'s ``refresh_every``); None until then."""
    block_table: torch.Tensor | None = None
    """Paged KV cache (``spade.kvcache``): [B, max_blocks] int32 on the cache's device
    while ``select`` / ``observe`` run on a paged cache, else None. With it, the
    ``k_cache`` they get is the layer's pool [num_blocks, Hkv, block_size, D], not a
    [B, Hkv, L, D] view: positions stay logical and are read through the table
    (``spade.policies.common.cache_dims``, ``last_token_keys``, ``logical_keys``). ``prefill``
    and ``prefill_rows`` always get contiguous [n, Hkv, L', D] keys holding at least
    the prompt (``L'`` may be shorter than the cache's capacity: ``cache_len``)."""
    cache_len: int | None = None
    """The cache's logical capacity in tokens (per row), when it is not ``k_cache``'s
    dimension 2 (a paged cache; a prefill handed only the prompt); None: that dimension."""
    join_pool: tuple[torch.Tensor, torch.Tensor] | None = None
    """While ``prefill_rows`` (a serving join) or ``prefill`` (a static batch's prompt,
    inline or at a colocated cache rank's boot) runs on a paged cache: (the layer's key
    pool [num_blocks, Hkv, block_size, D], the block table [B, max_blocks] with the rows'
    blocks mapped), for state a policy keeps in the pool's layout (asyncspade's int8 /
    int4 scoring copy, ``AsyncSpadeLayerState.paged``; Quest's page bounds,
    ``QuestLayerState.paged``). The keys the prefill gets still come contiguous and
    ``block_table`` is None then; None elsewhere."""
    idle: torch.Tensor | None = None
    """Serving: [B] bool on the device, True for a row no request decodes in (whose
    selections nobody reads): per-row work may skip it (the predictor's solve). Updated
    in place; None: every row is in use."""


class Policy(ABC):
    """Base class. Subclasses set ``name`` and implement ``select``.

    ``cfg`` is the policy's pydantic section (``spade.config.*PolicyConfig``).
    """

    name: ClassVar[str]
    needs_current_query: ClassVar[bool] = True
    """False when ``select`` ignores ``q`` (so it can run one step ahead)."""
    evicts: ClassVar[bool] = False
    """True when dropped tokens can never come back (TOVA)."""
    select_takes_out: ClassVar[bool] = False
    """True when ``select`` accepts ``out=``: an int32 [B, Hkv, K] buffer its middle
    indices may be written into (then ``Selection.indices is out``; a buffer of another
    shape is ignored). A cache rank passes its output rows: no copy per layer."""

    def __init__(self, cfg: Any, spec: AttentionSpec):
        self.cfg = cfg
        self.spec = spec

    @property
    def budget(self) -> int | None:
        return getattr(self.cfg, "budget", None)

    # ------------------------------------------------------------------ optional capabilities
    # The runtime calls these on every policy; the defaults do nothing extra.

    @property
    def rows(self) -> int | None:
        """Newest prompt queries ``prefill`` reads (a cache rank is sent only these at
        boot; a serving join prefilled in pieces keeps only these for ``prefill_rows``),
        or None for all of them. Default: None."""
        return None

    def selection_layout(self) -> tuple[int, int, int] | None:
        """``(K_mid, n_sink, n_recent)`` of every sparse ``Selection`` this policy
        returns, when its config fixes them up front (the runtime allocates the
        selection buffers before the first step: CUDA graphs capture their addresses);
        None when it does not. Default: from a ``SparseCommonConfig`` (middle = budget
        minus sinks and recent window), else None."""
        c = self.cfg
        if isinstance(c, SparseCommonConfig):
            return c.budget - c.sink_tokens - c.recent_tokens, c.sink_tokens, c.recent_tokens
        return None

    def rerank_keep(self) -> tuple[int, GroupReduce] | None:
        """``(keep, reduce)`` when this policy's sparse selections are candidates that the
        attention re-ranks with the true query, keeping ``keep`` of them (two-stage
        selection: ``Selection.keep``); None when they are attended as they are. The
        inference rank of the asynchronous runtime rebuilds the selections the cache rank
        ships with it. Default: None."""
        return None

    def predict_layers(self, state: PolicyState, layers: range, kv_lens: torch.Tensor | None = None) -> None:
        """Prepare this step's ``select`` of every layer in ``layers`` (consecutive) at
        once, e.g. one predictor launch for a cache rank's pack instead of one per layer.
        ``kv_lens``: the cache lengths those ``select`` calls will get (None: unknown).
        ``select`` must return the same with or without this call. Default: nothing."""

    def new_state(self, batch_size: int, device: torch.device | str) -> PolicyState:
        return PolicyState(batch_size=batch_size, layers=[None] * self.spec.n_layers)

    def prefill(self, state: PolicyState, layer: int, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, kv_lens: torch.Tensor) -> None:
        """After the dense prompt pass. ``q``: [B, Hq, T, D] for the prompt's T tokens
        (right-aligned at ``kv_lens``)."""

    def prefill_rows(self, state: PolicyState, layer: int, rows: list[int], q: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, kv_lens: torch.Tensor) -> None:
        """Serving: the batch rows ``rows`` start new requests between decode steps (a
        join), while the other rows keep their state. ``q`` [n, Hq, T, D] are the joining
        prompts' queries (one length T), ``k_cache`` / ``v_cache`` [n, Hkv, L, D] the
        joining rows' cache views (the prompt right-aligned at ``kv_lens`` [n]),
        ``state.seq_len`` the batch's cursor and ``state.kv_start`` [B] already updated
        for the joining rows. Afterwards row ``rows[i]``'s state must be what ``prefill``
        of that request alone gives. Default: nothing (right for stateless policies);
        policies with per-row state override it (``row_state`` builds the state of the
        joining rows alone, to run ``prefill`` on and copy from)."""

    def row_state(self, state: PolicyState, rows: list[int], device: torch.device | str) -> PolicyState:
        """A fresh state for the batch rows ``rows`` alone (``prefill_rows``' helper): the
        batch's cursor and cache capacity (``cache_len``), and the rows' own ``kv_start``."""
        sub = self.new_state(len(rows), device)
        sub.seq_len = state.seq_len
        sub.cache_len = state.cache_len  # the capacity a prefill sizes its state for
        if state.kv_start is not None:
            sub.kv_start = state.kv_start[device_index(rows, state.kv_start.device)]
        return sub

    @abstractmethod
    def select(self, state: PolicyState, layer: int, q: torch.Tensor | None, k_cache: torch.Tensor,
               kv_lens: torch.Tensor) -> Selection | None:
        """The tokens to attend this step, or ``None`` for full attention."""

    def observe(self, state: PolicyState, layer: int, q: torch.Tensor, k_cache: torch.Tensor,
                kv_lens: torch.Tensor) -> None:
        """After this step's attention (the current token's k/v are in the cache)."""

    def takes_new_keys(self, state: PolicyState) -> bool:
        """True when ``observe`` accepts ``k_new=`` [B, Hkv, D], the step's keys (those at
        ``kv_lens - 1``), and then never reads key values from ``k_cache`` again, in
        ``observe`` or ``select``, as long as ``k_cache`` keeps its shape: a caller whose
        cache view has a fixed shape may then stop writing decoded keys into it (the cache
        rank with compressed scoring keys). Default: False (the cache is read)."""
        return False

    def graph_key(self, state: PolicyState) -> tuple:
        """Host-side facts that change the work a step does (dense vs sparse, ...).

        A backend that captures the decode step as a CUDA graph re-captures when
        this changes; everything else a policy does per step must be device-side.
        """
        b = self.budget
        return (b is None or state.seq_len <= b,)

    def describe(self) -> dict:
        return self.cfg.model_dump(mode="json") if hasattr(self.cfg, "model_dump") else {"name": self.name}

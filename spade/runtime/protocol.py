"""The message protocol between the inference rank and the cache rank.

The runtime is the only place that knows both what tensors mean and how they
travel: the transport moves tagged tensor lists, this module says which lists.

Tags and contents (``n`` = layers in the pack, ``B`` rows, ``Hq``/``Hkv`` heads,
``D`` head dim, ``K`` the policy's middle budget)::

    inference -> cache
      "ctl"   [cmd int64 [4] (cpu)]                    STEP(seq_len, step) | END | SHUTDOWN
              [cmd, setup uint8 (cpu, JSON), kv_lens [B], kv_start [B]?]       BOOT(B, T)
              [cmd, rows int64 [n, 2] (cpu: row, prompt length T_i), kv_start [B], idle uint8 [B] (cpu)]
                                                       JOIN(S, step, gen) (serving, below)
              [cmd, kv_start [B], idle uint8 [B] (cpu)] LEAVE(S, step) (serving, below)
      "boot"  per layer: [q_tail [B, Hq, W, D], k [B, Hkv, T, D], v [B, Hkv, T, D]]
              (the prompt's KV and last W queries; only q_tail when the cache rank
              reads the inference rank's own cache: ``colocated`` with a static cache)
      "qkv"   per pack per step: [qkv [n, B, Hq + 2 Hkv, D]] (q, k, v head ranges of one
              tensor), or [q [n, B, Hq, D], k [n, B, Hkv, D], v] when their dtypes
              differ, or [q] alone with a shared cache
    cache -> inference
      "boot_ack" [layer int64 [1] (cpu)] after each "boot" (at most 2 unacknowledged)
      "sel"   per pack per *sparse* step (and per pack after a JOIN, below):
              [meta int64 [n, META] (cpu), payload...]
              indices: [idx int32 [n, B, Hkv, K]]
              kv:      [idx, k_sel [n, B, Hkv, K, D], v_sel [n, B, Hkv, K, D]]
              delta:   [slots int32 [n, B, Hkv, C], values int32 [n, B, Hkv, C]]
                       (C = most changed slots of any (row, head) in the pack; -1 pads)
              END acknowledged: [meta with pack = -1, stats float64 [len(CACHE_STATS)] (cpu)]
              (the last "sel" of a generation; stats: the cache rank's host time, below)
      "err"   [uint8 (cpu)]: the cache rank failed (message text), sent before it closes

A restarted cache rank (the first was lost mid-generation) gets the same BOOT at the
cache length it joins at: the KV so far as the "prompt", the last step's query as
``q_tail`` (W = 1: its query window refills as steps come), and ``first_step``, the
decode step its first selections are for.

Serving (``spade.serving``, a slot batch whose rows join and leave between steps):
BOOT has ``Setup.serving`` set and no "boot" messages: every row is idle at the
cursor ``T`` (no ``policy.prefill``, no first selections); when its setup matches the
last serving epoch's but for ``T``, the cache rank keeps that epoch's policy state,
buffers and CUDA graphs (``CacheRank._generation``). A request joining rows
``r_i`` (prompt lengths ``T_i``) before decode step ``step`` at cursor ``S`` is a JOIN:
the whole ``kv_start`` vector (leaves included), then per layer, per joining row, a
"boot" message [q_tail [1, Hq, W_i, D], k [1, Hkv, T_i, D], v (kv mode)] (k and v:
the row's cache at ``[S - T_i, S)``; only q_tail with a shared cache), one
"boot_ack" per layer. The cache rank applies ``policy.prefill_rows`` row by row and,
when step ``step`` is past θ, selects that step again for every pack (the selection
it already sent for ``step`` used the rows' old content) and sends it with the
meta column ``META_GEN`` = ``gen``, the inference rank's join counter; the inference
rank drops every selection of an older ``gen`` and waits for these before running
``step``. Rows that left since the last message and before a step with no JOIN are a
LEAVE(S, step): the whole ``kv_start`` vector, the left rows' windows starting at the
cursor of their leave, so the cache rank stops scanning their old requests' tokens (no
acknowledgement, no new selections: a left row's selections are ignored until a JOIN
resets its state). JOIN and LEAVE carry ``idle``, 1 for each row no request decodes in
(free or mid-join) as of the message: the cache rank skips those rows' predictor solves
and sizes its selection grids for the rows in use (``kernels.plan_rows``, by their
bucket). Every change of the rows in use reaches it before the next step (a leave by
LEAVE or the next JOIN, a join by JOIN), so a row is never idle there while it decodes
here. Until the first JOIN of a serving BOOT every row is idle; a non-serving BOOT (a
static batch, a restarted cache rank) has every row in use.

Bootstrap choice (the sparse threshold θ): the cache rank receives the prompt's
KV and last W queries right after prefill and then *every* step's q/k/v, dense
steps included, so its policy state is exactly the inline run's at every step;
only the inference rank's *use* of selections starts past θ (the cache rank
computes and sends selections only for steps whose cache length exceeds θ).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from spade.policies.base import AttentionSpec, RopeSpec

#: Handshake layout of a runtime link: bump when the messages below change.
#: 2: ``Setup.first_step`` (a cache rank restarted mid-generation).
#: 3: serving: ``Setup.serving``, JOIN, the ``META_GEN`` column of "sel".
#: 4: serving: LEAVE.
#: 5: serving: the ``idle`` row mask of JOIN and LEAVE.
PROTOCOL = "spade-async/5"

# ctl commands
BOOT, STEP, END, SHUTDOWN, JOIN, LEAVE = 1, 2, 3, 4, 5, 6

# meta columns of a "sel" message (one row per layer of the pack)
META_PACK, META_STEP, META_SEQ, META_DENSE, META_SINK, META_RECENT, META_K, META_C, META_GEN = range(9)
META = 9

# the cache rank's host-side account of one generation, sent with the END acknowledgement
# (medians over the generation's packs / steps; the first steps include graph capture)
CACHE_STATS = (
    "packs",  # q/k/v packs handled
    "selections",  # "sel" messages sent
    "host_ms_per_pack",  # median synchronous host work per pack (copy in, observe, select, encode)
    "send_ms_per_pack",  # median time in the "sel" send per pack (in-process: includes yielding)
    "recv_wait_ms_per_step",  # median time per step waiting for the inference rank's packs and STEP
    "topk_calls",  # threshold-carry top-K (policy topk: carry): selections made, summed over layers and rows
    "topk_fallbacks",  # ... of which took the whole-row fallback (NaN when no layer carries a threshold)
    "topk_fallbacks_too_many",  # ... of those, with more candidates than the list holds (the rest: too few)
)
TOPK_STATS = CACHE_STATS[-3:]
"""The threshold-carry top-K counters of ``CACHE_STATS`` (serving sums them over epochs)."""


def stats_tensor(stats: dict) -> torch.Tensor:
    return torch.tensor([float(stats.get(k, float("nan"))) for k in CACHE_STATS], dtype=torch.float64)


def stats_from_tensor(t: torch.Tensor) -> dict:
    vals = t.tolist()
    return {k: v for k, v in zip(CACHE_STATS, vals)}


_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16)}


def dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    return _DTYPES[name]


AUTO_PACKS = 4  # packs per step of ``runtime.pack_layers: auto``


def resolve_pack_layers(pack_layers: int | str, n_layers: int) -> int:
    """``runtime.pack_layers`` as a number of layers: ``auto`` is ``ceil(n_layers / 4)``
    (four packs per step, fewer when the model has fewer layers)."""
    if pack_layers == "auto":
        return max(1, -(-int(n_layers) // AUTO_PACKS))
    return max(1, int(pack_layers))


def packs_of(n_layers: int, pack_layers: int) -> list[tuple[int, int]]:
    """Layer ranges ``[l0, l1)`` of the packs (the last may be shorter), the same
    split as ``DecodeBackend.decode_stages``."""
    P = max(1, int(pack_layers))
    return [(l0, min(n_layers, l0 + P)) for l0 in range(0, n_layers, P)]


def spec_to_dict(spec: AttentionSpec) -> dict:
    return dataclasses.asdict(spec)


def spec_from_dict(d: dict) -> AttentionSpec:
    d = dict(d)
    rope = d.pop("rope", None)
    return AttentionSpec(**d, rope=RopeSpec(**rope) if rope is not None else None)


@dataclass
class CacheHooks:
    """Test hooks of the cache rank (deliberately slow or dying cache ranks).

    ``delay_s``: sleep this long before sending each selection for steps
    ``>= delay_from_step``; ``stall_from_step``: never send a selection for steps
    ``>= stall_from_step`` (the cache rank stops there); ``die_at_step``: the cache
    process exits abruptly (``os._exit``) when told about that step (in-process:
    it closes its transport end without a word); ``die_at_boot_layer``: the same, on
    receiving that layer of the first boot. A restarted cache rank keeps only the
    faults still ahead of the step it joins at (none of the boot).
    """

    delay_s: float = 0.0
    delay_from_step: int = 0
    stall_from_step: int | None = None
    die_at_step: int | None = None
    die_at_boot_layer: int | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Setup:
    """Everything the cache rank needs for one generation (sent in BOOT as JSON):
    shapes and the policy, never the weights."""

    policy: dict  # the policy config (pydantic dump), rebuilt on the cache rank
    spec: dict  # AttentionSpec
    batch: int
    prompt_len: int
    capacity: int  # cache rank's KV store length
    static_len: int  # >0: the inference cache is static of this length (views of it are what the policy sees)
    dtype: str  # KV dtype
    q_dtype: str
    pack_layers: int
    return_mode: str  # indices | kv | delta
    theta: int  # steps with seq_len > theta are sparse
    q_tail: int  # prompt queries shipped per layer
    shared_kv: bool  # the cache rank reads the inference rank's cache (in-process only)
    has_kv_start: bool
    hooks: dict = field(default_factory=dict)
    first_step: int = 1  # the decode step of the first selection: >1 for a cache rank restarted mid-generation
    serving: bool = False  # a slot batch: no prompt at BOOT (every row idle), rows come by JOIN
    kv_blocks: int = 0  # serving on a paged cache: the inference rank's pool of blocks (0: contiguous)
    block_size: int = 0  # its tokens per block

    def to_tensor(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(json.dumps(dataclasses.asdict(self)).encode()), dtype=torch.uint8)

    @staticmethod
    def from_tensor(t: torch.Tensor) -> "Setup":
        return Setup(**json.loads(bytes(t.cpu().tolist()).decode()))


def text_tensor(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(s.encode()), dtype=torch.uint8)


def tensor_text(t: torch.Tensor) -> str:
    return bytes(t.cpu().tolist()).decode(errors="replace")


def cmd(kind: int, a: int = 0, b: int = 0, c: int = 0) -> torch.Tensor:
    return torch.tensor([kind, a, b, c], dtype=torch.int64)


def policy_from_dict(d: dict, spec: AttentionSpec) -> Any:
    """Rebuild a policy from its config dump (the cache process has no config file)."""
    from spade.config import policy_config
    from spade.policies import build_policy

    return build_policy(policy_config(d), spec)

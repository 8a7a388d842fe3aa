"""A tiny decode simulator for policy tests: random KV caches that grow by one
token per step, driven through the real attention entry point.

Positions a row must never read (left padding before ``kv_start``, slots past
``kv_len``) hold large garbage, so a policy or kernel that touches them changes
the attention output visibly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spade import kernels
from spade.attention import AttentionContext, InlineSelector
from spade.policies import build_policy
from spade.policies.base import AttentionSpec, Policy, RopeSpec, Selection

GARBAGE = 6.0


@dataclass
class StepRecord:
    step: int
    layer: int
    seq_len: int
    kv_lens: torch.Tensor  # [B] (a copy)
    q: torch.Tensor  # [B, Hq, D] the true query of this step
    sel: Selection | None
    out: torch.Tensor  # [B, Hq, D] attention output through the policy
    full: torch.Tensor  # [B, Hq, D] dense attention output


class RecordingSelector(InlineSelector):
    """InlineSelector that remembers the last selection it handed out."""

    last: Selection | None = None

    def selection(self, layer, q, k_cache, kv_lens):
        self.last = super().selection(layer, q, k_cache, kv_lens)
        return self.last


@dataclass
class DecodeSim:
    """Random data for ``n_layers`` layers: a prompt of ``prompt_len`` cache slots
    (rows with ``kv_start[b] > 0`` are left-padded) and ``steps`` decode tokens.

    ``k_all``/``v_all`` [n_layers, B, Hkv, L, D] and ``q_all`` [n_layers, B, Hq, L, D]
    hold the true key/value/query of every cache position; the live caches
    ``k``/``v`` only receive a token when it is appended.
    """

    B: int = 2
    Hq: int = 4
    Hkv: int = 2
    D: int = 16
    prompt_len: int = 40
    steps: int = 6
    kv_start: list[int] | None = None
    n_layers: int = 1
    dtype: torch.dtype = torch.float32
    seed: int = 0
    q_all: torch.Tensor | None = None  # override the random queries
    k_all: torch.Tensor | None = None
    v_all: torch.Tensor | None = None
    extra: int = 3  # spare capacity past the last token (garbage)
    rope: RopeSpec | None = None
    spec: AttentionSpec = field(init=False)

    def __post_init__(self):
        g = torch.Generator().manual_seed(self.seed)
        L = self.capacity
        shape_kv = (self.n_layers, self.B, self.Hkv, L, self.D)
        if self.k_all is None:
            self.k_all = torch.randn(shape_kv, generator=g)
        if self.v_all is None:
            self.v_all = torch.randn(shape_kv, generator=g)
        if self.q_all is None:
            self.q_all = torch.randn(self.n_layers, self.B, self.Hq, L, self.D, generator=g)
        self.k_all, self.v_all, self.q_all = (t.to(self.dtype) for t in (self.k_all, self.v_all, self.q_all))
        self.spec = AttentionSpec(n_layers=self.n_layers, n_q_heads=self.Hq, n_kv_heads=self.Hkv,
                                  head_dim=self.D, rope=self.rope)
        self._g = g

    @property
    def capacity(self) -> int:
        return self.prompt_len + self.steps + self.extra

    @property
    def starts(self) -> torch.Tensor | None:
        return None if self.kv_start is None else torch.tensor(self.kv_start, dtype=torch.int32)

    def fresh_cache(self) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """Caches holding the prompt (garbage elsewhere) and ``kv_lens`` [B] int32."""
        T = self.prompt_len
        ks, vs = [], []
        for layer in range(self.n_layers):
            k = (torch.randn(self.k_all[layer].shape, generator=self._g) * GARBAGE + GARBAGE).to(self.dtype)
            v = (torch.randn(self.v_all[layer].shape, generator=self._g) * GARBAGE + GARBAGE).to(self.dtype)
            for b in range(self.B):
                s = 0 if self.kv_start is None else self.kv_start[b]
                k[b, :, s:T] = self.k_all[layer, b, :, s:T]
                v[b, :, s:T] = self.v_all[layer, b, :, s:T]
            ks.append(k)
            vs.append(v)
        return ks, vs, torch.full((self.B,), T, dtype=torch.int32)

    def run(self, policy: Policy, *, on_step=None) -> list[StepRecord]:
        """Prefill then decode ``steps`` tokens through ``AttentionContext``;
        returns one record per (step, layer). ``on_step(record, state)`` runs
        right after each layer's attend (after ``observe``)."""
        ks, vs, kv_lens = self.fresh_cache()
        state = policy.new_state(self.B, "cpu")
        sel = RecordingSelector(policy, state)
        ctx = AttentionContext(self.spec, sel, kv_start=self.starts)
        T = self.prompt_len
        ctx.begin_step(T)
        for layer in range(self.n_layers):
            ctx.prefill(layer, self.q_all[layer, :, :, :T], ks[layer], vs[layer], kv_lens)
        records = []
        for step in range(self.steps):
            pos = T + step
            for layer in range(self.n_layers):  # append the token of this step
                ks[layer][:, :, pos] = self.k_all[layer, :, :, pos]
                vs[layer][:, :, pos] = self.v_all[layer, :, :, pos]
            kv_lens = kv_lens + 1
            ctx.begin_step(pos + 1)
            for layer in range(self.n_layers):
                q = self.q_all[layer, :, :, pos]
                out = ctx.attend(layer, q, ks[layer], vs[layer], kv_lens)
                full = kernels.sparse_decode_attention(q, ks[layer], vs[layer], kv_lens, None,
                                                       scale=self.spec.softmax_scale, kv_start=self.starts)
                rec = StepRecord(step, layer, pos + 1, kv_lens.clone(), q, sel.last, out, full)
                records.append(rec)
                if on_step is not None:
                    on_step(rec, state)
        return records

    def probs(self, layer: int, q: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor:
        """True attention probabilities [B, Hq, L] (float64) of ``q`` over the valid cache."""
        L = self.capacity
        k = self.k_all[layer].double()  # [B, Hkv, L, D]
        G = self.Hq // self.Hkv
        s = torch.einsum("bhgd,bhld->bhgl", q.double().view(self.B, self.Hkv, G, self.D), k)
        s = s * self.spec.softmax_scale
        pos = torch.arange(L)
        start = torch.zeros(self.B, dtype=torch.int64) if self.kv_start is None else torch.tensor(self.kv_start)
        valid = (pos >= start[:, None]) & (pos < kv_lens.long()[:, None])  # [B, L]
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
        return torch.softmax(s, -1).reshape(self.B, self.Hq, L)


def make_policy(name: str, sim: DecodeSim, **cfg) -> Policy:
    from spade.policies import POLICIES

    return build_policy(POLICIES.config(name)(**cfg), sim.spec)


def attended_sets(sel: Selection, kv_lens: torch.Tensor) -> list[list[set[int]]]:
    """Per (b, KV head), the set of attended positions, straight from the
    ``Selection`` rule (sinks ∪ valid middle ∪ recent)."""
    B, H, _ = sel.indices.shape
    out = []
    for b in range(B):
        n = int(kv_lens[b])
        s = 0 if sel.kv_start is None else int(sel.kv_start[b])
        sink_end = min(s + sel.n_sink, n)
        recent_start = max(n - sel.n_recent, sink_end)
        fixed = set(range(s, sink_end)) | set(range(recent_start, n))
        out.append([fixed | {x for x in sel.indices[b, h].tolist() if x >= 0} for h in range(H)])
    return out


def middle_sets(sel: Selection) -> list[list[set[int]]]:
    idx = sel.indices
    return [[set(x for x in idx[b, h].tolist() if x >= 0) for h in range(idx.shape[1])]
            for b in range(idx.shape[0])]

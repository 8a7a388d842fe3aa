"""Teacher-forced sparse evaluation: the logits of token-by-token sparse decoding
of a known sequence, in one masked pass per layer.

Measuring perplexity under sparse decoding the direct way runs the model once
per token (a decode step per position). Here the whole sequence goes through
the model at once, and each layer's attention is made to attend, for every
position ``t >= prefill_len``, exactly what the policy would select at decode
step ``t``:

1. the layer's q/k/v of all positions are computed by the model's own
   attention module (through the ``"spade"`` attention hook of ``spade.models.hf``,
   keyword ``spade_forced``), from the *previous layer's sparse outputs*, so
   layer ``l`` sees what decoding would have fed it;
2. the policy runs over these small per-layer tensors as decoding would call
   it: ``prefill`` on the prompt's queries and keys, then for each
   ``t = prefill_len .. T-1`` ``begin_step(t + 1)``, ``select`` on the query of
   position ``t`` and a key cache holding positions ``< t + 1`` only (later
   positions are zeros, never the future), then ``observe``: the selection at
   ``t`` uses only keys up to ``t`` and the policy's state after steps ``< t``;
3. the selections become a boolean mask [Hkv, T, T] (rows ``< prefill_len``:
   causal, the dense prompt pass), expanded over the GQA group, and the layer's
   attention is one masked sdpa call.

Policy state is per layer and the layers are visited in order, so running all
steps of layer ``l`` before layer ``l + 1`` calls each layer's policy with the
same inputs in the same order as decoding does: the logits match token-by-token
decoding to float rounding (``tests/models/test_teacher.py`` checks every
policy against ``HFBackend``).

>>> from spade.policies.oracle import OraclePolicyConfig                  # doctest: +SKIP
>>> ppl = sparse_perplexity(model, ids, OraclePolicyConfig(budget=64), prefill_len=256)
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from spade.attention import InlineSelector
from spade.models.hf import _as_policy, attention_spec, use_spade_attention
from spade.policies.base import AttentionSpec, Policy

__all__ = ["teacher_forced_logits", "sparse_perplexity", "TeacherForcing"]

#: query rows per masked-attention chunk (bounds the [Hq, rows, T] score buffer)
_ROW_CHUNK = 512


class TeacherForcing:
    """The ``spade_forced`` object of one sequence: per-layer sparse masks from
    the policy, then one masked attention per layer.

    ``attended`` collects, per layer, the mean number of keys attended per
    (decode position, KV head), as ``AttentionContext.mean_attended`` counts.
    """

    def __init__(self, policy: Policy, spec: AttentionSpec, prefill_len: int, device: torch.device | str):
        self.policy = policy
        self.spec = spec
        self.prefill_len = prefill_len
        self.selector = InlineSelector(policy, policy.new_state(1, device))
        self.attended: list[float] = [0.0] * spec.n_layers

    def masks(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Which keys each position attends in ``layer``: bool [Hkv, T, T].

        ``q`` [1, Hq, T, D], ``k``/``v`` [1, Hkv, T, D] (post-RoPE, this layer's).
        """
        _, Hkv, T, D = k.shape
        P = self.prefill_len
        dev = k.device
        mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril_().expand(Hkv, T, T).clone()
        if P >= T:
            return mask
        # the cache as decoding holds it: positions >= the step's length are never read as data
        k_buf = torch.zeros_like(k)
        v_buf = torch.zeros_like(v)
        k_buf[:, :, :P] = k[:, :, :P]
        v_buf[:, :, :P] = v[:, :, :P]
        sel = self.selector
        sel.begin_step(P, None)
        sel.prefill(layer, q[:, :, :P], k_buf, v_buf, torch.tensor([P], dtype=torch.int32, device=dev))
        n_att = 0.0
        for t in range(P, T):
            k_buf[:, :, t] = k[:, :, t]
            v_buf[:, :, t] = v[:, :, t]
            kv_lens = torch.tensor([t + 1], dtype=torch.int32, device=dev)
            q_t = q[:, :, t].contiguous()  # [1, Hq, D]
            sel.begin_step(t + 1, None)
            s = sel.selection(layer, q_t, k_buf, kv_lens)
            if s is not None and s.keep > 0:  # two-stage: attended are the candidates the true query keeps
                s = s.reranked(q_t, k_buf, self.spec.softmax_scale)
            if s is not None:
                mask[:, t] = s.to_mask(kv_lens, T)[0]  # [Hkv, T]
                n_att += float(s.attended(kv_lens).double().mean())
            else:
                n_att += t + 1
            sel.after(layer, q_t, k_buf, v_buf, kv_lens)
        self.attended[layer] = n_att / (T - P)
        return mask

    def attention(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scale: float | None) -> torch.Tensor:
        """``query`` [1, Hq, T, D], ``key``/``value`` [1, Hkv, T, D] -> [1, Hq, T, D]."""
        if query.shape[0] != 1:
            raise ValueError("teacher forcing runs one sequence at a time (batch 1)")
        G = query.shape[1] // key.shape[1]
        mask = self.masks(layer, query, key, value)  # [Hkv, T, T]
        scale = self.spec.softmax_scale if scale is None else scale
        kx = key.repeat_interleave(G, dim=1)  # [1, Hq, T, D]: query head h reads KV head h // G
        vx = value.repeat_interleave(G, dim=1)
        T = query.shape[2]
        out = torch.empty_like(query)
        for a in range(0, T, _ROW_CHUNK):
            b = min(a + _ROW_CHUNK, T)
            m = mask[:, a:b].repeat_interleave(G, dim=0)[None]  # [1, Hq, b - a, T]
            out[:, :, a:b] = F.scaled_dot_product_attention(query[:, :, a:b], kx, vx, attn_mask=m, scale=scale)
        return out

    def mean_attended(self) -> float:
        """Mean keys attended per (decode position, KV head, layer)."""
        return sum(self.attended) / len(self.attended)


def _ids(input_ids: torch.Tensor) -> torch.Tensor:
    if input_ids.dim() == 2:
        if input_ids.shape[0] != 1:
            raise ValueError("teacher forcing runs one sequence at a time: input_ids [T] or [1, T]")
        input_ids = input_ids[0]
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be [T] or [1, T]; got {tuple(input_ids.shape)}")
    return input_ids


@torch.no_grad()
def teacher_forced_logits(model, input_ids: torch.Tensor, policy: Any, *, prefill_len: int,
                          return_forcing: bool = False):
    """Logits [T, V] (float32) of ``input_ids`` ([T] or [1, T]) as sparse decoding
    under ``policy`` (a ``Policy`` or a ``*PolicyConfig``) would produce them when
    the first ``prefill_len`` tokens are the prompt and every later token is fed
    one step at a time. Row ``t`` predicts token ``t + 1``; rows
    ``< prefill_len`` are those of the dense prompt pass.

    With ``return_forcing`` also returns the ``TeacherForcing`` (per-layer
    attended counts).
    """
    ids = _ids(input_ids)
    T = ids.shape[0]
    if not 1 <= prefill_len:
        raise ValueError(f"prefill_len must be >= 1; got {prefill_len}")
    spec = attention_spec(model)
    pol = _as_policy(policy, spec)
    dev = next(model.parameters()).device
    forcing = TeacherForcing(pol, spec, min(prefill_len, T), dev)
    with use_spade_attention(model):
        out = model(input_ids=ids.to(dev)[None], use_cache=False, spade_forced=forcing)
    logits = out.logits[0].float()  # [T, V]
    return (logits, forcing) if return_forcing else logits


def sparse_perplexity(model, input_ids: torch.Tensor, policy: Any, prefill_len: int) -> float:
    """Perplexity of the continuation ``input_ids[prefill_len:]`` given the prompt
    ``input_ids[:prefill_len]``, under sparse decoding with ``policy``.

    The first continuation token is predicted by the dense prompt pass (as in
    decoding, whose first token comes from the prefill logits); the later ones by
    sparse decode steps.
    """
    ids = _ids(input_ids)
    T = ids.shape[0]
    if not 1 <= prefill_len < T:
        raise ValueError(f"prefill_len must be in [1, {T}) for a {T}-token sequence; got {prefill_len}")
    logits = teacher_forced_logits(model, ids, policy, prefill_len=prefill_len)  # [T, V]
    target = ids[prefill_len:].to(logits.device)
    nll = F.cross_entropy(logits[prefill_len - 1:T - 1], target)
    return math.exp(float(nll))

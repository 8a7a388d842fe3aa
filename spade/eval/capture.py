"""Capture every layer's post-RoPE queries and keys of one dense teacher-forced pass.

The selection measurements replay decode steps from these tensors: at position
``t`` the cache is ``k[:, :t+1]`` and the true query is ``q[:, t]``, exactly what
a decode step at ``t`` would see with full attention before it (teacher forcing).

The capture is a transformers attention function registered under its own
name: it records ``query`` [B, Hq, T, D] and ``key`` [B, Hkv, T, D] (after
RoPE, before any GQA repeat) and then runs transformers' sdpa, so the forward
and its logits are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

IMPL = "spade_eval_capture"


@dataclass
class Captured:
    """Per-layer queries and keys of one sequence (float32, on the model's device)."""

    q: list[torch.Tensor]  # n_layers × [Hq, T, D] post-RoPE
    k: list[torch.Tensor]  # n_layers × [Hkv, T, D] post-RoPE
    logits: torch.Tensor  # [T, V] float32 of the dense pass

    @property
    def length(self) -> int:
        return self.q[0].shape[1]


def _capture_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    sink = getattr(module, "_spade_eval_sink", None)
    if sink is not None:
        sink[module.layer_idx] = (query[0].detach().float().clone(), key[0].detach().float().clone())
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                  **kwargs)


AttentionInterface.register(IMPL, _capture_attention)
AttentionMaskInterface.register(IMPL, sdpa_mask)


@torch.no_grad()
def capture_qk(model, input_ids: torch.Tensor) -> Captured:
    """One dense forward over ``input_ids`` [T] (a single sequence); returns the
    queries, keys and logits of every layer. The model's attention
    implementation is restored afterwards."""
    from spade.models.hf import _attention_modules

    if input_ids.dim() != 1:
        raise ValueError(f"capture_qk takes one sequence [T]; got shape {tuple(input_ids.shape)}")
    mods = _attention_modules(model)
    sink: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    prev = model.config._attn_implementation
    model.set_attn_implementation(IMPL)
    for m in mods:
        m._spade_eval_sink = sink
    try:
        dev = next(model.parameters()).device
        out = model(input_ids=input_ids[None].to(dev), use_cache=False)
    finally:
        for m in mods:
            m.__dict__.pop("_spade_eval_sink", None)
        model.set_attn_implementation(prev)
    n = len(mods)
    if sorted(sink) != list(range(n)):
        raise RuntimeError(f"capture saw layers {sorted(sink)}, expected 0..{n - 1}")
    return Captured(q=[sink[i][0] for i in range(n)], k=[sink[i][1] for i in range(n)],
                    logits=out.logits[0].float())

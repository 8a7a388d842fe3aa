"""The decode-backend interface the engine drives (HF path and fast path).

A backend owns the model weights and the KV cache of one batch of sequences.
The engine tokenizes, left-pads, and then calls::

    logits = backend.prefill(input_ids, attention_mask, ctx)   # [B, V] last position
    for step in ...:
        logits = backend.decode(next_tokens, ctx)              # [B, V]

``ctx`` is a ``spade.attention.AttentionContext``: during decode, every layer's
attention goes through ``ctx.attend`` (prefill is dense and then reported to
``ctx.prefill``). Backends keep the cache length on the host (no sync) and call
``ctx.begin_step(seq_len)`` before each step (after setting ``ctx.kv_start`` at
prefill), where ``seq_len`` counts the cache including this step's token(s).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterator

import torch

from spade.policies.base import AttentionSpec

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
"""transformers ``model_type``s both backends run (full-attention GQA decoders with the
``rotate_half`` RoPE; Mistral without a sliding window), each checked against
transformers' own forward in tests/models."""


class DecodeBackend(ABC):
    #: "hf" | "fast"
    kind: str
    spec: AttentionSpec
    device: torch.device
    dtype: torch.dtype
    tokenizer: Any  # None for random-weight presets
    eos_token_ids: list[int]
    vocab_size: int

    @abstractmethod
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, ctx) -> torch.Tensor:
        """Dense pass over a left-padded prompt batch ``input_ids`` [B, T]; resets the
        cache; sets ``ctx.kv_start`` to the first valid position per row (None if
        no row is padded). Returns the last position's logits [B, V] (float32)."""

    def decode(self, tokens: torch.Tensor, ctx) -> torch.Tensor:
        """One decode step for ``tokens`` [B]; returns logits [B, V] (float32)."""
        it = self.decode_stages(tokens, ctx, pack_layers=self.spec.n_layers)
        for _ in it:
            pass
        return self.last_logits

    @abstractmethod
    def decode_stages(self, tokens: torch.Tensor, ctx, pack_layers: int) -> Iterator[int]:
        """One decode step, run pack by pack: a generator that yields the index of
        each pack of ``pack_layers`` layers right after running it (the layers'
        ``ctx.attend`` calls done), so the asynchronous runtime can post/await
        transport work between packs. After exhaustion the step's logits [B, V]
        (float32) are in ``self.last_logits``."""

    last_logits: torch.Tensor

    @property
    @abstractmethod
    def seq_len(self) -> int:
        """Current cache length (host int, same for every row)."""

    def close(self) -> None:
        """Free the cache (optional)."""

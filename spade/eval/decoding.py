"""Greedy batch decoding of one prompt batch under many policies, prefilled once.

The prompt pass is dense for every policy (sparsity starts at the first decode
step), so GSM8K and needle-in-a-haystack prefill each batch once: the prefill
runs through ``HFBackend.prefill`` with a recording context, and every policy
then starts from the same cache (cropped back to the prompt after each run)
with its own ``prefill`` hook replayed from the recorded per-layer queries and
keys, exactly the calls ``HFBackend.prefill`` would have made. Decoding itself
is ``HFBackend.decode`` under an ``AttentionContext`` with the policy inline:
the path ``spade run`` takes on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from spade.attention import AttentionContext, InlineSelector


class _PrefillRecorder:
    """Stands in for an ``AttentionContext`` during the prompt pass: keeps the
    ``prefill`` calls (per-layer prompt queries and the cache at that moment)."""

    def __init__(self):
        self.kv_start: torch.Tensor | None = None
        self.seq_len = 0
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def begin_step(self, seq_len: int) -> None:
        self.seq_len = seq_len

    def prefill(self, layer, q, k_cache, v_cache, kv_lens, pool=None) -> None:
        self.calls.append((layer, q, k_cache, v_cache, kv_lens))


@dataclass
class Prefilled:
    """One dense prompt pass, reusable by every policy."""

    input_ids: torch.Tensor  # [B, T] left-padded
    attention_mask: torch.Tensor  # [B, T]
    logits: torch.Tensor  # [B, V] last prompt position
    recorder: _PrefillRecorder
    snapshot: Any  # spade.models.hf.HFSnapshot: the backend right after the prompt
    extra: dict = field(default_factory=dict)

    @property
    def seq_len(self) -> int:
        return self.snapshot.seq_len


def encode_batch(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``input_ids`` and ``attention_mask`` [B, T] (no special tokens added:
    the chat template already has them)."""
    seqs = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    T = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, T - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, T - len(s):] = 1
    return ids, mask


def chat_prompt(tokenizer, text: str) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return text


@torch.no_grad()
def prefill(backend, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Prefilled:
    rec = _PrefillRecorder()
    logits = backend.prefill(input_ids, attention_mask, rec)
    return Prefilled(input_ids=input_ids, attention_mask=attention_mask, logits=logits.clone(), recorder=rec,
                     snapshot=backend.snapshot())


@torch.no_grad()
def decode(backend, pre: Prefilled, policy, max_new_tokens: int, eos_ids: list[int]) -> tuple[list[list[int]], float]:
    """Greedy decoding under ``policy`` (a built ``Policy``) from the prefilled
    batch. Returns the generated ids of each row (cut before its first EOS) and
    the mean keys attended per (row, KV head, layer, step)."""
    B = pre.input_ids.shape[0]
    backend.restore(pre.snapshot)
    state = policy.new_state(B, backend.device)
    ctx = AttentionContext(backend.spec, InlineSelector(policy, state), device=backend.device)
    ctx.kv_start = pre.recorder.kv_start
    ctx.begin_step(pre.seq_len)
    for layer, q, k, v, kv_lens in pre.recorder.calls:
        ctx.prefill(layer, q, k, v, kv_lens)
    eos = set(eos_ids)
    rows: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    logits = pre.logits
    for step in range(max_new_tokens):
        nxt = logits.argmax(-1)  # [B]
        host = nxt.tolist()
        for b in range(B):
            if done[b]:
                continue
            if host[b] in eos:
                done[b] = True
            else:
                rows[b].append(host[b])
        if all(done) or step == max_new_tokens - 1:
            break
        logits = backend.decode(nxt, ctx)
    backend.restore(pre.snapshot)
    return rows, ctx.mean_attended()


def _crop_to(cache, length: int) -> None:
    """Drop the tokens a decode run appended (``DynamicCache.crop`` takes minus the
    number of tokens to remove)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)
    if cache.get_seq_length() != length:
        raise RuntimeError(f"cache holds {cache.get_seq_length()} tokens after the crop, expected {length}")


def agreement(ref: list[int], other: list[int]) -> tuple[float, float]:
    """(prefix, overall): the fraction of ``ref`` reproduced before the first
    differing token, and the fraction of positions with equal tokens over the
    longer of the two sequences."""
    n = max(len(ref), len(other))
    if n == 0:
        return 1.0, 1.0
    prefix = 0
    for a, b in zip(ref, other):
        if a != b:
            break
        prefix += 1
    same = sum(a == b for a, b in zip(ref, other))
    return prefix / max(1, len(ref)), same / n

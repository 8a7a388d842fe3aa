"""Runtimes drive a decode backend for one batch of sequences.

``InlineRuntime`` (``runtime.topology: inline``) runs the policy on the critical
path. The asynchronous runtime (``colocated``, ``local``, ``multiprocess``)
moves selection to a cache rank; both present this same interface to the engine.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import torch

from spade.models.base import DecodeBackend
from spade.policies.base import Policy

#: sample_fn(logits [B, V] float32) -> next tokens [B] (device, int64)
SampleFn = Callable[[torch.Tensor], torch.Tensor]
#: on_token(step, tokens [B] on the host) -> True to stop (e.g. every row hit EOS)
OnToken = Callable[[int, torch.Tensor], bool]


@dataclass
class GenerationTrace:
    """What one batch generation produced and measured."""

    tokens: list[list[int]]  # per row, generated ids (EOS included if hit)
    step_times_s: list[float] = field(default_factory=list)  # wall time of each decode step
    prefill_time_s: float = 0.0
    mean_attended: float = 0.0  # tokens attended per (row, KV head, layer, step)
    late_packs: int = 0
    stats: dict = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Runtime(ABC):
    def __init__(self, cfg, backend: DecodeBackend, policy: Policy):
        self.cfg = cfg  # SpadeConfig
        self.backend = backend
        self.policy = policy

    @abstractmethod
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 sample_fn: SampleFn, on_token: OnToken | None = None) -> GenerationTrace:
        """Prefill ``input_ids`` [B, T] (left-padded), then decode up to
        ``max_new_tokens``. Step times are wall-clock per step with the device
        synchronised before the clock is read."""

    def close(self) -> None:
        pass


def sample_and_report(logits: torch.Tensor, sample_fn: SampleFn, rows: list[list[int]], i: int,
                      on_token: OnToken | None) -> tuple[torch.Tensor, bool]:
    """Token ``i`` of every row: sampled from ``logits``, appended to ``rows``, reported to
    ``on_token``; returns (the tokens on the device, whether ``on_token`` asked to stop)."""
    nxt = sample_fn(logits)
    host = nxt.to("cpu")
    for b, row in enumerate(rows):
        row.append(int(host[b]))
    return nxt, (on_token(i, host) if on_token is not None else False)


def timed_loop(backend: DecodeBackend, first_logits: torch.Tensor, *, max_new_tokens: int,
               sample_fn: SampleFn, on_token: OnToken | None, step: Callable[[torch.Tensor], torch.Tensor]):
    """The shared token loop: sample, report, step; returns (tokens per row, step times)."""
    rows: list[list[int]] = [[] for _ in range(first_logits.shape[0])]
    times: list[float] = []
    logits = first_logits
    for i in range(max_new_tokens):
        nxt, stop = sample_and_report(logits, sample_fn, rows, i, on_token)
        if stop or i == max_new_tokens - 1:
            break
        _sync(backend.device)
        t0 = time.perf_counter()
        logits = step(nxt)
        _sync(backend.device)
        times.append(time.perf_counter() - t0)
    return rows, times

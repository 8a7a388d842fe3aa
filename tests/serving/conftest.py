"""Shared fixtures of the serving tests: AsyncEngines over the tiny random preset on
CPU in fp32 (fast), one CPU thread, torch kernels."""

from __future__ import annotations

import asyncio

import pytest
import torch

import spade
from spade.serving import SamplingParams

#: policy settings small enough for sparse steps to happen within a few tokens
POLICIES = {
    "full": ["policy.name=full"],
    "quest": ["policy.name=quest", "policy.budget=16", "policy.page_size=4"],
    "tova": ["policy.name=tova", "policy.budget=10"],
    "oracle": ["policy.name=oracle", "policy.budget=12", "policy.sink_tokens=2", "policy.recent_tokens=4"],
    # window 16 > most prompts here: rows fill their query windows at different steps
    "asyncspade": ["policy.name=asyncspade", "policy.budget=12", "policy.sink_tokens=2", "policy.recent_tokens=4",
                   "runtime.sparse_threshold=16"],
    "streaming": ["policy.name=streaming", "policy.budget=12", "policy.sink_tokens=2", "policy.recent_tokens=4"],
}
# compressed scoring keys: the joining rows' int8 / int4 copies (and int4 smoothing) are built alone and copied in
for _keys in ("int8", "int4"):
    POLICIES[f"asyncspade_{_keys}"] = POLICIES["asyncspade"] + [f"policy.score_keys={_keys}", "policy.window=4"]
# a channel subset: each joining row's channels chosen from its own prompt and kept (no re-choice)
POLICIES["asyncspade_int4_c8"] = POLICIES["asyncspade_int4"] + ["policy.score_channels=8", "policy.channel_refresh=null"]


def make_config(policy: str = "full", topology: str = "inline", *, max_batch: int = 3, max_seq_len: int = 96,
                extra: list[str] | None = None):
    return spade.load_config(None, overrides=[
        "model.name=tiny", "model.dtype=float32", "model.device=cpu", f"model.max_seq_len={max_seq_len}",
        f"runtime.topology={topology}", f"serving.max_batch={max_batch}", "generation.stop_at_eos=false",
        *POLICIES[policy], *(extra or [])])


@pytest.fixture(scope="session", autouse=True)
def _one_cpu_thread():
    """Small CPU GEMMs crawl with 2 OpenMP threads on a busy 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    monkeypatch.setenv("SPADE_KERNELS", "torch")


async def collect(engine, prompt, params=None, request_id=None) -> list:
    """Every output of one request."""
    return [o async for o in engine.generate(prompt, params, request_id)]


async def final(engine, prompt, params=None, request_id=None):
    return (await collect(engine, prompt, params, request_id))[-1]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def random_prompts(n: int, seed: int, lo: int = 3, hi: int = 20, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def run(coro):
    return asyncio.run(coro)


async def staggered(engine, jobs, prefix="r"):
    """``jobs``: (arrival step, prompt, max_tokens); each request starts once the engine
    has run that many decode steps (or at once when nothing is left running)."""

    async def one(i, step, prompt, n):
        while engine.stats()["steps"] < step and (engine.stats()["requests_running"]
                                                   or engine.stats()["requests_waiting"]):
            await asyncio.sleep(0.002)
        return await final(engine, prompt, greedy(n), f"{prefix}{i}")

    return await asyncio.gather(*(one(i, *j) for i, j in enumerate(jobs)))


def serve_staggered(engine, jobs):
    """Run ``jobs`` (as ``staggered``) through ``engine``, then close it: (the outputs,
    the engine's stats before the close)."""

    async def main():
        outs = await staggered(engine, jobs)
        stats = engine.stats()
        await engine.close()
        return outs, stats

    return run(main())

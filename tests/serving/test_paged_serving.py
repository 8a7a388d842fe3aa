"""Serving on a paged KV cache (``model.block_size``): a row holds blocks only for its own
window; a join reserves its generation's blocks, waits when they are not free, and a
leave (finish or abort) frees them at once. Tokens equal the contiguous cache's."""

from __future__ import annotations

import asyncio

import pytest
import torch

import spade
from spade.errors import ArgumentError

from .conftest import collect, final, greedy, make_config, random_prompts, run, serve_staggered

PAGED = ["model.block_size=4"]
CASES = [("full", "inline"), ("streaming", "inline"), ("quest", "inline"), ("tova", "inline"), ("oracle", "inline"),
         ("asyncspade", "inline"), ("asyncspade_int4", "inline"), ("asyncspade", "colocated"),
         ("asyncspade_int4", "colocated"), ("asyncspade_int8", "local")]


def jobs_for(seed: int, n: int = 6):
    g = torch.Generator().manual_seed(seed)
    prompts = random_prompts(n, seed=seed + 1)
    return [(int(torch.randint(0, 12, (1,), generator=g)) if i else 0, p, int(torch.randint(4, 24, (1,), generator=g)))
            for i, p in enumerate(prompts)]


def serve(cfg, jobs):
    return serve_staggered(spade.AsyncEngine(cfg), jobs)


@pytest.mark.parametrize("policy,topology", CASES)
def test_paged_tokens_equal_contiguous(policy, topology, monkeypatch):
    """asyncspade's int8 / int4 scoring copy is a pool in the cache's layout: read through
    the cache's own table where the selecting side reads the cache's pool (inline,
    colocated), through a table of the cache rank's own with as many blocks (`local`).
    Quest's page bounds are written into the pool's blocks at every join."""
    from spade import kernels
    from spade.policies.asyncspade import AsyncSpadePolicy

    pool_calls, bound_writes = [], []
    real = AsyncSpadePolicy._paged_keys
    monkeypatch.setattr(AsyncSpadePolicy, "_paged_keys", lambda self, st, *a: pool_calls.append(
        tuple(st.kq.shape)) or real(self, st, *a))
    write = kernels.quest_write_pool
    monkeypatch.setattr(kernels, "quest_write_pool", lambda kmin, *a, **k: bound_writes.append(
        tuple(kmin.shape)) or write(kmin, *a, **k))
    jobs = jobs_for(3)
    base, _ = serve(make_config(policy, topology), jobs)
    assert not pool_calls and not bound_writes  # a contiguous cache: a contiguous copy, per-row bounds
    paged, stats = serve(make_config(policy, topology, extra=PAGED), jobs)
    if policy.startswith("asyncspade_"):
        assert pool_calls and all(shape[2] == 4 for shape in pool_calls)  # [num_blocks, Hkv, block_size 4, Dq]
    else:
        assert not pool_calls
    if policy == "quest":  # every join's bounds into [num_blocks, Hkv, ceil(4 / page_size), D]
        assert len(bound_writes) >= len(jobs) and all(shape[2] == 1 for shape in bound_writes)
    else:
        assert not bound_writes
    assert stats["joins_into_running"] >= 2 and stats["requests_finished"] == len(jobs)
    if policy != "full":
        assert stats["sparse_steps"] > 0
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_reserved"] == 0  # every block back in the pool
    for (_, _, n), a, b in zip(jobs, base, paged):
        assert len(a.token_ids) == n and a.token_ids == b.token_ids


def test_few_blocks_queue_and_every_request_completes():
    """A pool of 25 usable blocks of 4 tokens (a third of what 3 rows at max_seq_len need):
    requests wait for blocks, all complete with the tokens they get alone, and the pool
    ends where it started."""
    cfg = make_config("full", extra=["model.block_size=4", "model.kv_blocks=26"])
    jobs = [(0, p, 24) for p in random_prompts(8, seed=5, lo=10, hi=20)]
    engine = spade.AsyncEngine(cfg)
    free0 = engine.backend.kv_blocks_free()
    peak = {"used": 0, "waiting": 0}

    async def main():
        async def watch():
            while True:
                s = engine.stats()
                peak["used"] = max(peak["used"], s["kv_blocks_used"] + s["kv_blocks_reserved"])
                peak["waiting"] = max(peak["waiting"], s["requests_waiting"])
                await asyncio.sleep(0.005)

        w = asyncio.create_task(watch())
        together = await asyncio.gather(*[final(engine, p, greedy(n), f"r{i}") for i, (_, p, n) in enumerate(jobs)])
        w.cancel()
        alone = [await final(engine, p, greedy(n), f"a{i}") for i, (_, p, n) in enumerate(jobs)]
        stats = engine.stats()
        await engine.close()
        return together, alone, stats

    together, alone, stats = run(main())
    assert peak["used"] <= 25 and peak["waiting"] > 0
    assert stats["kv_blocks_free"] == free0 and stats["kv_blocks_used"] == 0
    engine.backend.kv_pool.check()
    for t, a in zip(together, alone):
        assert t.finish_reason == "length" and t.token_ids == a.token_ids


def test_abort_frees_blocks_and_oversized_requests_are_refused():
    cfg = make_config("full", extra=["model.block_size=4", "model.kv_blocks=20"])  # 19 usable: 76 tokens
    engine = spade.AsyncEngine(cfg)
    free0 = engine.backend.kv_blocks_free()

    async def main():
        with pytest.raises(ArgumentError, match="KV blocks.*model.kv_blocks"):
            await collect(engine, list(range(3, 33)), greedy(60))  # 30 + 60 tokens: more than the pool
        seen = []
        async for out in engine.generate(list(range(3, 15)), greedy(60), "x"):
            seen.append(out)
            if len(out.token_ids) == 1:
                mid = engine.stats()
                await engine.abort("x")
        await asyncio.sleep(0.05)
        end = engine.stats()
        await engine.close()
        return seen, mid, end

    seen, mid, end = run(main())
    assert mid["kv_blocks_used"] > 0
    from spade.serving.metrics import ServerMetrics

    text = ServerMetrics({"model": "tiny"}).render(mid).splitlines()
    for key in ("used", "free", "reserved"):  # /metrics carries the pool's gauges
        assert f'spade_kv_blocks_{key}{{model="tiny"}} {mid[f"kv_blocks_{key}"]}' in text
    assert seen[-1].finish_reason == "abort"
    assert end["kv_blocks_used"] == 0 and end["kv_blocks_free"] == free0

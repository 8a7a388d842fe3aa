"""AsyncEngine on CUDA (FastModel with CUDA graphs, Triton kernels). Skipped without a
GPU; run by the lead on an H100/H200."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import spade

from .conftest import final, greedy, make_config, random_prompts, run, staggered

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _triton(_torch_kernels, monkeypatch):
    monkeypatch.delenv("SPADE_KERNELS", raising=False)


def _cfg(policy: str, topology: str = "inline", extra: tuple[str, ...] = ()):
    return make_config(policy, topology, max_batch=4, extra=["model.device=cuda:0", "model.dtype=float32", *extra])


async def _staggered(engine, prompts, ns):
    async def one(i, p, n):
        await asyncio.sleep(0.01 * i)
        return await final(engine, p, greedy(n), f"r{i}")

    return await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(zip(prompts, ns))))


def _overlapping(engine, prompts, ns, every=2):
    """Jobs for ``conftest.staggered`` that surely overlap: request 0 decodes until every
    other has arrived (request ``i`` ``every * i`` decode steps after the engine's count
    now), whatever the GPU's speed (arrivals by wall time let fast steps finish each
    request before the next arrives)."""
    s0 = engine.stats()["steps"]
    ns = [max(ns[0], every * len(prompts) + 4)] + list(ns[1:])
    return [(s0 + every * i, p, n) for i, (p, n) in enumerate(zip(prompts, ns))]


def _together_then_alone(engine, prompts, ns):
    """The requests joined at staggered times, then each alone through the same engine
    (closed afterwards); returns (together, alone, the engine's stats after the first)."""
    async def main():
        together = await _staggered(engine, prompts, ns)
        st = engine.stats()
        alone = [await final(engine, p, greedy(n)) for p, n in zip(prompts, ns)]
        await engine.close()
        return together, alone, st

    return run(main())


_PAGED = ("model.block_size=16",)
_KV = ("runtime.return_mode=kv",)


@pytest.mark.parametrize("policy,topology,extra", [
    ("full", "inline", ()), ("asyncspade", "inline", ()), ("quest", "inline", ()), ("asyncspade", "colocated", ()),
    ("asyncspade", "local", ()), ("tova", "colocated", ()),
    # the kv return mode (gathered K/V, CUDA graphs on both ranks); a cache rank's own store in pools
    ("asyncspade", "colocated", _KV + _PAGED), ("asyncspade", "local", _KV + _PAGED), ("tova", "local", _PAGED)])
def test_joined_requests_match_alone_on_gpu(policy, topology, extra):
    """(``local`` puts the cache rank on a second GPU when there is one.)"""
    engine = spade.AsyncEngine(_cfg(policy, topology, extra))
    prompts = random_prompts(6, seed=4)
    ns = [8 + 3 * i for i in range(6)]

    t0 = time.perf_counter()
    together, alone, st = _together_then_alone(engine, prompts, ns)
    wall = time.perf_counter() - t0
    assert st["joins_into_running"] >= 1
    if policy != "full":
        assert st["sparse_steps"] > 0
    assert [t.token_ids for t in together] == [a.token_ids for a in alone]
    # the stream's time in prompt pieces and in decode steps (CUDA events), within the run's wall time
    assert st["prefill_device_s"] > 0 and st["decode_device_s"] > 0
    assert st["prefill_device_s"] + st["decode_device_s"] < wall


@pytest.mark.parametrize("policy,topology", [("full", "inline"), ("asyncspade", "inline"),
                                             ("asyncspade", "colocated")])
def test_chunked_joins_match_alone_on_gpu(policy, topology):
    """Chunked prefill on CUDA (the pieces' lower-right causal SDPA, decode steps with CUDA
    graphs between pieces): joined in pieces of 5 == alone."""
    engine = spade.AsyncEngine(make_config(policy, topology, max_batch=4, extra=[
        "model.device=cuda:0", "model.dtype=float32", "serving.prefill_chunk=5"]))
    prompts = random_prompts(6, seed=4, lo=12, hi=24)
    ns = [30] + [8 + 3 * i for i in range(5)]

    together, alone, st = _together_then_alone(engine, prompts, ns)
    assert st["joins_into_running"] >= 1 and st["prefill_pieces"] > st["joins"]
    assert [t.token_ids for t in together] == [a.token_ids for a in alone]


def test_joins_and_leaves_do_not_recapture():
    """``full``: one graph key per bucket of rows in use (1, 2, 4 of the four slots),
    whatever rows join or leave."""
    engine = spade.AsyncEngine(_cfg("full"))

    async def main():
        await staggered(engine, _overlapping(engine, random_prompts(6, seed=5), [5 + 2 * i for i in range(6)]))
        keys = len(engine.backend._graphs)
        await staggered(engine, _overlapping(engine, random_prompts(8, seed=6), [3 + i for i in range(8)]))
        keys2 = len(engine.backend._graphs)
        await engine.close()
        return keys, keys2

    keys, keys2 = run(main())
    assert 2 <= keys <= keys2 <= 3


def test_cache_rank_joins_and_leaves_do_not_recapture():
    """asyncspade colocated: the inference rank's graphs are keyed by dense / sparse /
    mixed and the bucket of rows in use (1, 2, 4) only, so joins and leaves add no key
    beyond those."""
    engine = spade.AsyncEngine(_cfg("asyncspade", "colocated"))

    async def main():
        prompts = random_prompts(6, seed=5, lo=14, hi=20)
        await staggered(engine, _overlapping(engine, prompts, [12 + 2 * i for i in range(6)]))
        keys = set(engine.backend._graphs)
        prompts = random_prompts(8, seed=6, lo=14, hi=20)
        await staggered(engine, _overlapping(engine, prompts, [10 + i for i in range(8)]))
        keys2 = set(engine.backend._graphs)
        st = engine.stats()
        await engine.close()
        return keys, keys2, st

    keys, keys2, st = run(main())
    assert st["sparse_steps"] > 0 and st["joins_into_running"] >= 1
    assert keys <= keys2 and len(keys2) <= 9


@pytest.mark.parametrize("topology", ["colocated", "local"])
def test_cache_rank_epochs_keep_their_graphs(topology):
    """Requests one at a time (an epoch each): the cache rank renews its generation, so a
    second round of the same requests captures no new graph there; the tokens repeat,
    and the epochs' top-K accounts add up to the carry's counters."""
    from spade.runtime.cache_rank import _carry_account

    engine = spade.AsyncEngine(_cfg("asyncspade", topology))
    prompts = random_prompts(3, seed=12, lo=14, hi=24)
    ns = [14, 9, 12]

    async def main():
        first = [(await final(engine, p, greedy(n))).token_ids for p, n in zip(prompts, ns)]
        rank = engine.batch.rt._link.cache  # (the link opens with the first request)
        graphs = rank.stats.get("graphs", 0)
        second = [(await final(engine, p, greedy(n))).token_ids for p, n in zip(prompts, ns)]
        after = rank.stats.get("graphs", 0)
        await engine.close()
        return first, second, graphs, after, rank

    first, second, graphs, after, rank = run(main())
    st = engine.stats()
    assert first == second
    assert rank.stats["renewed"] == rank.stats["generations"] - 1 >= 5
    assert graphs > 0 and after == graphs, (graphs, after)
    assert st["topk_calls"] == _carry_account(rank._kept.state)["topk_calls"] > 0

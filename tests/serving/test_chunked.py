"""Chunked prefill (``serving.prefill_chunk``): a joining prompt is prefilled in pieces,
one per decode step of the running rows; every request's greedy tokens equal its alone
run and the unchunked engine's, the running rows keep decoding meanwhile, and an abort
mid-join frees the row."""

from __future__ import annotations

import asyncio

import pytest
import torch

import spade
from spade.serving.slots import chunk_sizes

from .conftest import final, greedy, make_config, random_prompts, run, staggered
from .test_cache_rank import _multiprocess


def _jobs(seed: int, n: int = 5):
    """(arrival step, prompt, max_tokens): a first request that decodes long, then prompts
    longer than the small pieces below joining it at random steps."""
    g = torch.Generator().manual_seed(seed)
    prompts = random_prompts(n, seed=seed + 1, lo=9, hi=30)
    return [(int(torch.randint(1, 20, (1,), generator=g)) if i else 0, p,
             int(torch.randint(4, 14, (1,), generator=g)) if i else 40) for i, p in enumerate(prompts)]


def _serve(cfg, jobs, *, alone: bool):
    engine = spade.AsyncEngine(cfg)

    async def main():
        together = await staggered(engine, jobs, "r")
        stats = engine.stats()
        solo = [await final(engine, p, greedy(n), f"a{i}") for i, (_, p, n) in enumerate(jobs)] if alone else None
        await engine.close()
        return together, stats, solo

    return run(main())


CASES = [("full", "inline", 7), ("quest", "inline", 1), ("quest", "inline", 7), ("tova", "inline", 7),
         ("tova", "inline", 64), ("asyncspade", "inline", 1), ("asyncspade", "inline", 64),
         ("asyncspade_int8", "inline", 7), ("asyncspade_int4", "inline", 7), ("asyncspade", "colocated", 7),
         ("asyncspade", "multiprocess/nccl", 7)]


_WHOLE: dict[str, tuple] = {}


def _unchunked(policy: str, jobs):
    """(outputs, stats) of ``jobs`` staggered through the unchunked inline engine
    (``prefill_chunk: 0``) of ``policy``: the reference of every case of that policy,
    run once per session (greedy tokens are the same on every topology: test_cache_rank)."""
    if policy not in _WHOLE:
        whole, wstats, _ = _serve(make_config(policy, "inline", extra=["serving.prefill_chunk=0"]), jobs, alone=False)
        _WHOLE[policy] = whole, wstats
    return _WHOLE[policy]


@pytest.mark.parametrize("policy,topology,chunk", CASES)
def test_chunked_joins_match_alone_and_unchunked(policy, topology, chunk):
    """Requests join a running batch in pieces of ``chunk`` tokens (1, 7, more than any
    prompt): each one's greedy tokens equal the same request alone and the unchunked
    inline engine's (``prefill_chunk: 0``)."""
    topology, _, transport = topology.partition("/")
    jobs = _jobs(seed=3)
    extra = _multiprocess(transport) if transport else []
    together, stats, alone = _serve(make_config(policy, topology, extra=extra + [f"serving.prefill_chunk={chunk}"]),
                                    jobs, alone=True)
    whole, wstats = _unchunked(policy, jobs)
    assert stats["slots_used"] == 0 and stats["requests_prefilling"] == 0
    assert stats["requests_finished"] == len(jobs) and stats["joins_into_running"] >= 2
    assert wstats["prefill_pieces"] == wstats["joins"] == len(jobs)
    if chunk < 9:  # every prompt is longer than its pieces: the joins into the running batch were chunked
        assert stats["prefill_pieces"] >= stats["joins"] + len(jobs) - 2
    if policy != "full":
        assert stats["sparse_steps"] > 0
    for (_, p, n), t, a, w in zip(jobs, together, alone, whole):
        assert len(t.token_ids) == n
        assert t.token_ids == a.token_ids == w.token_ids


def test_running_rows_keep_decoding_during_a_chunked_join():
    """A 60-token prompt joins in pieces of 4 (15 steps) while another request decodes: the
    running request gets a token per piece; unchunked, it waits out the whole prefill."""
    long = random_prompts(1, seed=9, lo=60, hi=60)[0]

    def during(chunk: int):
        engine = spade.AsyncEngine(make_config("asyncspade", max_seq_len=160,
                                               extra=[f"serving.prefill_chunk={chunk}"]))

        async def main():
            seen = []

            async def running():
                async for o in engine.generate([3, 1, 4, 1, 5], greedy(80), "run"):
                    seen.append(len(o.token_ids))

            task = asyncio.ensure_future(running())
            while len(seen) < 60:  # the cursor must pass the long prompt's length before it joins
                await asyncio.sleep(0.002)
            start, pieces = len(seen), engine.stats()["prefill_pieces"]
            async for o in engine.generate(long, greedy(2), "long"):
                if len(o.token_ids) == 1:  # its first token: the join is over
                    got = len(seen), engine.stats()["prefill_pieces"]
            await task
            st = engine.stats()
            await engine.close()
            return got[0] - start, got[1] - pieces, st  # the running request's tokens during the join

        return run(main())

    tokens, pieces, st = during(4)
    assert pieces == 15
    # a token per piece but the last (whose step decodes the new row too); 2 of slack for
    # the streams' event-loop hand-off
    assert tokens >= pieces - 3
    assert st["prefill_s"] > 0 and st["decode_s"] > 0
    assert st["prefill_device_s"] is None and st["decode_device_s"] is None  # CUDA event times only
    tokens0, pieces0, _ = during(0)
    assert pieces0 == 1 and tokens0 <= 2


def test_abort_mid_prefill_frees_the_row():
    """A request aborted while its prompt is prefilled in pieces ends with "abort" and no
    token; its row is free at once and serves the next request, whose tokens equal its
    alone run's."""
    long = random_prompts(1, seed=10, lo=40, hi=40)[0]
    nxt = random_prompts(1, seed=11, lo=12, hi=12)[0]
    engine = spade.AsyncEngine(make_config("asyncspade", max_batch=2, max_seq_len=160,
                                           extra=["serving.prefill_chunk=2"]))

    async def main():
        seen = []

        async def running():
            async for o in engine.generate([3, 1, 4, 1, 5], greedy(100), "run"):
                seen.append(o)

        task = asyncio.ensure_future(running())
        while len(seen) < 40:
            await asyncio.sleep(0.002)
        aborted = asyncio.ensure_future(final(engine, long, greedy(4), "long"))
        while engine.stats()["prefill_pieces"] < 3:  # a few pieces in (20 in all)
            await asyncio.sleep(0.001)
        mid = engine.stats()
        await engine.abort("long")
        out = await aborted
        after_abort = engine.stats()
        nxt_out = await final(engine, nxt, greedy(6), "next")  # takes the freed row, joining in pieces
        await task
        alone = await final(engine, nxt, greedy(6), "alone")
        end = engine.stats()
        await engine.close()
        return mid, out, after_abort, nxt_out, alone, end

    mid, out, after_abort, nxt_out, alone, end = run(main())
    assert mid["requests_prefilling"] == 1 and mid["slots_used"] == 2 and mid["slots_free"] == 0
    assert out.finish_reason == "abort" and out.token_ids == []
    assert after_abort["requests_prefilling"] == 0 and after_abort["slots_used"] == 1
    assert nxt_out.token_ids == alone.token_ids and len(alone.token_ids) == 6
    assert end["slots_used"] == 0 and end["requests_aborted"] == 1 and end["joins"] == 3


def test_chunk_sizes_and_fits():
    assert chunk_sizes(10, 3, 4) == [3, 4, 3]
    assert chunk_sizes(8, 4, 4) == [4, 4]
    assert chunk_sizes(3, 4, 4) == [3]
    assert chunk_sizes(5, 1, 1) == [1] * 5
    with pytest.raises(ValueError, match="first piece"):
        chunk_sizes(5, 0, 4)
    engine = spade.AsyncEngine(make_config("quest"))  # pages of 4, counted from each row's own first position
    b = engine.batch
    b.reset(20)
    assert b.fits(20, 4) is None
    assert "longer than the cursor" in b.fits(21, 4)
    assert b.fits(20, 4, pieces=5) is None  # decodes from the cursor 24: its prompt at [4, 24)
    assert b.fits(21, 4, pieces=5) is None  # [3, 24): no page alignment needed
    assert b.fits(19, 4) is None  # [1, 20)
    assert b.fits(20, 73, pieces=5) is None
    assert "pass the end of the cache (24 + 74 - 1 > 96)" in b.fits(20, 74, pieces=5)  # the longer horizon
    assert "pieces of at least one token" in b.fits(3, 4, pieces=4)
    run(engine.close())


def test_chunked_join_on_smollm2():
    """Real weights (SmolLM2-135M, fp32): a text prompt joining in pieces of 3 while another
    request decodes gets the tokens and text it gets alone."""
    try:
        cfg = spade.load_config(None, overrides=[
            "model.name=smollm2-135m", "model.backend=fast", "model.dtype=float32", "model.device=cpu",
            "model.max_seq_len=64", "model.chat_template=false", "runtime.topology=inline", "serving.max_batch=2",
            "serving.prefill_chunk=3", "policy.name=asyncspade", "policy.budget=16", "policy.sink_tokens=2",
            "policy.recent_tokens=4", "policy.window=4", "runtime.sparse_threshold=16",
            "generation.stop_at_eos=false"])
        engine = spade.AsyncEngine(cfg)
    except spade.SpadeError as e:  # the weights' package is not installed here
        pytest.skip(f"SmolLM2-135M is not available: {e}")
    first, joining = "def fibonacci(n):", "Once upon a time, in a small village, there lived an old"

    async def main():
        seen = []

        async def running():
            async for o in engine.generate(first, greedy(22), "first"):
                seen.append(o)

        task = asyncio.ensure_future(running())
        while len(seen) < 6:  # the cursor nears the joining prompt's length (13 tokens)
            await asyncio.sleep(0.002)
        together = await final(engine, joining, greedy(8), "joining")
        await task
        st = engine.stats()
        alone = await final(engine, joining, greedy(8), "alone")
        await engine.close()
        return together, alone, st

    together, alone, st = run(main())
    assert st["prefill_pieces"] >= st["joins"] + 3  # the join into the running row was chunked
    assert st["joins_into_running"] == 1 and st["sparse_steps"] > 0
    assert together.token_ids == alone.token_ids and together.text == alone.text


def test_soak_with_aborts_at_any_stage_leaks_nothing():
    """100 random requests joining in pieces of 3, a fifth aborted once admitted (at once,
    mostly mid-join, or a little later; fixed seed): every one ends, none fails, and the
    rows, the joins in progress and the queue are all back afterwards."""
    import collections
    import random

    rng = random.Random(4)
    n = 100
    jobs = [(rng.random() * 0.4, [rng.randrange(512) for _ in range(rng.randint(1, 20))], rng.randint(1, 10),
             rng.random() < 0.2, rng.choice([0.0, 0.0, rng.random() * 0.05])) for _ in range(n)]
    stages = collections.Counter()  # where the aborts landed (timing-dependent: not asserted)
    engine = spade.AsyncEngine(make_config("asyncspade", max_batch=3, max_seq_len=64,
                                           extra=["serving.prefill_chunk=3"]))

    async def one(i, arrival, prompt, m, abort, delay):
        await asyncio.sleep(arrival)
        rid = f"s{i}"
        gen = asyncio.ensure_future(final(engine, prompt, greedy(m), rid))
        if abort:
            while (req := engine._requests.get(rid)) is None or req.row < 0:  # until admitted (or ended)
                if req is None and gen.done():
                    break
                await asyncio.sleep(0.0005)
            await asyncio.sleep(delay)
            req = engine._requests.get(rid)
            stages["ended" if req is None else "mid-join" if req.row in engine.batch.prefilling
                   else "decoding"] += 1
            await engine.abort(rid)
        return await gen

    async def main():
        outs = await asyncio.gather(*(one(i, *j) for i, j in enumerate(jobs)))
        st = engine.stats()
        with engine._lock:
            left = (dict(engine._running), list(engine._waiting), dict(engine._requests))
        await engine.close()
        return outs, st, left

    outs, st, left = run(main())
    print("aborts by stage:", dict(stages))
    assert all(o.finished for o in outs)
    assert st["requests_finished"] + st["requests_aborted"] == n and st["requests_failed"] == 0
    assert st["requests_aborted"] > 0 and st["prefill_pieces"] > st["joins"] and st["joins_into_running"] > 0
    assert st["slots_used"] == 0 and st["requests_prefilling"] == 0 and left == ({}, [], {})


def test_join_goes_on_when_every_other_row_finishes():
    """The only running request finishes while a 40-token prompt joins in pieces of 4: the
    remaining pieces still come one per step (steps no row samples from move the cursor),
    and the request's tokens equal its alone run's."""
    long = random_prompts(1, seed=12, lo=40, hi=40)[0]
    engine = spade.AsyncEngine(make_config("asyncspade", max_seq_len=160, extra=["serving.prefill_chunk=4"]))

    async def main():
        seen = []

        async def running():
            async for o in engine.generate([3, 1, 4, 1, 5], greedy(46), "run"):
                seen.append(o)

        task = asyncio.ensure_future(running())
        while len(seen) < 42:  # 4 tokens left: it finishes after the join's 4th piece
            await asyncio.sleep(0.001)
        steps = engine.stats()["steps"]
        joined = await final(engine, long, greedy(6), "long")
        await task
        st = engine.stats()
        alone = await final(engine, long, greedy(6), "alone")
        await engine.close()
        return seen[-1], joined, alone, st, steps

    run_out, joined, alone, st, steps = run(main())
    assert run_out.finish_reason == "length" and len(run_out.token_ids) == 46
    assert st["prefill_pieces"] == 1 + 10 and st["joins_into_running"] == 0  # it ended alone
    assert st["steps"] - steps >= 10 - 1 + 6 - 1  # a step per piece but the last, then its own
    assert joined.token_ids == alone.token_ids and len(alone.token_ids) == 6

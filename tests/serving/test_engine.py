"""AsyncEngine: continuous batching gives each request the tokens it gets alone."""

from __future__ import annotations

import asyncio

import pytest
import torch

import spade
from spade.errors import ConfigError
from spade.serving import SamplingParams

from .conftest import final, greedy, make_config, random_prompts, run, staggered

CASES = [("full", "inline"), ("quest", "inline"), ("tova", "inline"), ("asyncspade", "inline"),
         ("oracle", "inline"), ("streaming", "inline"), ("asyncspade_int8", "inline"), ("asyncspade_int4", "inline"),
         ("asyncspade_int4_c8", "inline"), ("asyncspade_int4_c8", "colocated"),
         ("full", "colocated"), ("quest", "colocated"), ("full", "multiprocess/nccl"),
         ("quest", "multiprocess/nccl")]


async def _together_then_alone(engine, jobs):
    """``jobs`` (arrival step, prompt, max_tokens) served staggered, the engine's stats
    then, and each job again alone (greedy); the engine is closed at the end."""
    together = await staggered(engine, jobs)
    stats = engine.stats()
    alone = [await final(engine, p, greedy(n), f"a{i}") for i, (_, p, n) in enumerate(jobs)]
    await engine.close()
    return together, alone, stats


@pytest.mark.parametrize("policy,topology", CASES)
def test_joined_requests_match_alone(policy, topology):
    """Requests of different lengths joining at random steps: each one's greedy tokens
    equal the same request alone, through the AsyncEngine and through the static batch
    (``spade.static.StaticEngine``, what ``spade run`` decodes; ``multiprocess``: these
    policies select on the inference rank, so no cache process runs; nccl is gloo on a CPU)."""
    extra = []
    if "/" in topology:
        from .test_cache_rank import _multiprocess

        topology, transport = topology.split("/")
        extra = _multiprocess(transport)
    cfg = make_config(policy, topology, extra=extra)
    g = torch.Generator().manual_seed(1)
    prompts = random_prompts(6, seed=2)
    jobs = [(int(torch.randint(0, 12, (1,), generator=g)) if i else 0, p, int(torch.randint(4, 24, (1,), generator=g)))
            for i, p in enumerate(prompts)]
    together, alone, stats = run(_together_then_alone(spade.AsyncEngine(cfg), jobs))
    assert stats["slots_used"] == 0 and stats["requests_finished"] == len(jobs)
    assert stats["joins_into_running"] >= 2  # rows really joined a running batch
    if policy not in ("full",):
        assert stats["sparse_steps"] > 0  # the policies' selections were really used
        assert stats["mixed_steps"] > 0  # and some steps mixed dense rows (own threshold) with sparse ones
    for (_, p, n), t, a in zip(jobs, together, alone):
        assert t.finish_reason == a.finish_reason == "length"
        assert len(t.token_ids) == n
        assert t.token_ids == a.token_ids
    from spade.static import StaticEngine

    ref = StaticEngine(cfg)
    try:
        for (_, p, n), a in zip(jobs[:3], alone):
            assert ref.generate([p], max_new_tokens=n)[0].token_ids == a.token_ids
    finally:
        ref.close()


def test_sparse_rows_differ_from_dense():
    """The asyncspade case above is not vacuous: its tokens differ from full attention's."""
    prompts = random_prompts(4, seed=2, lo=14, hi=20)

    async def tokens(policy):
        engine = spade.AsyncEngine(make_config(policy))
        outs = await asyncio.gather(*(final(engine, p, greedy(40), f"r{i}") for i, p in enumerate(prompts)))
        await engine.close()
        return [o.token_ids for o in outs]

    assert run(tokens("asyncspade")) != run(tokens("full"))


def test_quest_joins_at_any_cursor():
    """Quest's pages are counted from each row's own start, so its requests join a running
    batch at any cursor, exactly when full's do (the same joins and decode steps for the
    same queue: no wait for a page-aligned first position), and each still gets its
    tokens alone."""
    prompts = random_prompts(7, seed=4, lo=5, hi=21)
    ns = [9, 5, 12, 7, 10, 6, 8]

    async def serve(policy):
        engine = spade.AsyncEngine(make_config(policy, max_batch=2))
        outs = await asyncio.gather(*(final(engine, p, greedy(n), f"r{i}")
                                      for i, (p, n) in enumerate(zip(prompts, ns))))
        st = engine.stats()
        alone = [await final(engine, p, greedy(n)) for p, n in zip(prompts, ns)] if policy == "quest" else None
        await engine.close()
        return outs, st, alone

    outs, st, alone = run(serve("quest"))
    _, full, _ = run(serve("full"))
    assert st["requests_finished"] == full["requests_finished"] == len(prompts)
    assert st["joins_into_running"] == full["joins_into_running"] >= 4
    assert st["steps"] == full["steps"] and st["cursor_resets"] == full["cursor_resets"]
    assert st["sparse_steps"] > 0
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]


def test_more_requests_than_slots_queue():
    cfg = make_config("asyncspade", max_batch=2)
    prompts = random_prompts(5, seed=3)
    engine = spade.AsyncEngine(cfg)

    async def main():
        outs = await asyncio.gather(*(final(engine, p, greedy(6 + i), f"r{i}") for i, p in enumerate(prompts)))
        alone = [await final(engine, p, greedy(6 + i)) for i, p in enumerate(prompts)]
        st = engine.stats()
        await engine.close()
        return outs, alone, st

    outs, alone, st = run(main())
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    assert all(o.queue_s is not None and o.ttft_s >= o.queue_s for o in outs)
    assert max(o.queue_s for o in outs) > 0
    assert st["slots_used"] == 0 and st["requests_running"] == st["requests_waiting"] == 0


def test_abort_mid_decode_frees_the_slot():
    engine = spade.AsyncEngine(make_config("asyncspade", max_batch=2))

    async def main():
        seen = []
        other = asyncio.ensure_future(final(engine, [5, 6, 7], greedy(30), "other"))
        async for o in engine.generate([1, 2, 3, 4], greedy(60), "long"):
            seen.append(o)
            if len(seen) == 3:
                assert engine.stats()["slots_used"] >= 1
                await engine.abort("long")
        await engine.abort("never-heard-of")  # unknown ids are a no-op (as in vLLM)
        o = await other
        st = engine.stats()
        await engine.close()
        return seen, o, st

    seen, other, st = run(main())
    assert seen[-1].finish_reason == "abort" and len(seen[-1].token_ids) < 60
    assert other.finish_reason == "length" and len(other.token_ids) == 30
    assert st["slots_used"] == 0 and st["slots_free"] == 2 and st["requests_aborted"] == 1


def test_leaving_the_loop_early_aborts():
    engine = spade.AsyncEngine(make_config("full", max_batch=1))

    async def main():
        async for o in engine.generate([1, 2, 3], greedy(50), "r"):
            break
        for _ in range(200):  # the abort is processed between two steps
            if engine.stats()["slots_used"] == 0:
                break
            await asyncio.sleep(0.005)
        st = engine.stats()
        after = await final(engine, [4, 5], greedy(3))  # the slot serves the next request
        await engine.close()
        return st, after

    st, after = run(main())
    assert st["slots_used"] == 0 and st["requests_aborted"] == 1
    assert len(after.token_ids) == 3


@pytest.mark.parametrize("params", [dict(temperature=0.8, seed=7), dict(temperature=1.0, top_k=5, seed=3),
                                    dict(temperature=0.7, top_p=0.8, seed=11)])
def test_seeded_sampling_ignores_batch_mates(params):
    engine = spade.AsyncEngine(make_config("asyncspade", max_batch=3))
    sp = SamplingParams(max_tokens=20, ignore_eos=True, **params)

    async def main():
        alone = await final(engine, [9, 8, 7, 6], sp)
        mates = [asyncio.ensure_future(final(engine, p, SamplingParams(max_tokens=25, temperature=1.0, seed=i,
                                                                       ignore_eos=True)))
                 for i, p in enumerate(random_prompts(2, seed=5))]
        await asyncio.sleep(0.02)
        together = await final(engine, [9, 8, 7, 6], sp)
        await asyncio.gather(*mates)
        await engine.close()
        return alone, together

    alone, together = run(main())
    assert alone.token_ids == together.token_ids
    assert len(set(alone.token_ids)) > 1  # really sampled


def test_unseeded_sampled_requests_differ_from_greedy():
    engine = spade.AsyncEngine(make_config("full", max_batch=2))

    async def main():
        g = await final(engine, [3, 4, 5], greedy(24))
        s = await final(engine, [3, 4, 5], SamplingParams(max_tokens=24, temperature=2.0, ignore_eos=True))
        await engine.close()
        return g, s

    g, s = run(main())
    assert g.token_ids != s.token_ids


def test_topology_refusals_name_the_field():
    # (every runtime.return_mode is served: test_cache_rank.py)
    with pytest.raises(ConfigError, match=r"policy.channel_refresh \(2.0\).*set policy.channel_refresh: null"):
        spade.AsyncEngine(make_config("asyncspade", extra=["policy.score_channels=8"]))  # (re-chosen: the batch's)
    with pytest.raises(ConfigError, match="model.backend"):
        spade.AsyncEngine(make_config("full", extra=["model.backend=hf"]))


def test_a_request_that_does_not_fit_waits_for_the_batch_to_drain():
    """B's generation does not fit before the end of the cache at the cursor where it
    arrives: it waits (and holds the queue) until A is done and the cursor resets, then
    gets the tokens it gets alone."""
    engine = spade.AsyncEngine(make_config("asyncspade", max_batch=2, max_seq_len=40))

    async def main():
        a = asyncio.ensure_future(final(engine, [1, 2, 3, 4, 5], greedy(20), "a"))
        while engine.stats()["steps"] < 4:
            await asyncio.sleep(0.002)
        b_out = await final(engine, [7, 8, 9], greedy(36), "b")  # cursor >= 9: 9 + 36 - 1 > 40
        a_out = await a
        st = engine.stats()
        alone = await final(engine, [7, 8, 9], greedy(36))
        await engine.close()
        return a_out, b_out, alone, st

    a_out, b_out, alone, st = run(main())
    assert b_out.queue_s > a_out.ttft_s  # it waited
    assert st["joins_into_running"] == 0 and st["cursor_resets"] == 2
    assert b_out.token_ids == alone.token_ids and len(b_out.token_ids) == 36


def test_a_join_held_by_the_shared_cursor_is_counted_and_named(caplog):
    """A request whose generation would pass the end of the cache from the shared write
    cursor waits, with a row free, until the batch drains: counted once per request in
    ``joins_held_by_cursor`` and named once in the log with the fix; its tokens are still
    its own. A request queued behind it (FIFO) that would fit by itself is not counted."""
    cfg = make_config("full", max_batch=2, max_seq_len=64)
    prompts = random_prompts(3, seed=6, lo=10, hi=11)
    # r0 alone from cursor 10; r1 (10 + 40 tokens) arrives after 20 steps: 30 + 40 - 1 > 64, held
    # until r0 ends; r2 (8 tokens, it would fit) arrives after 22 steps and queues behind r1
    jobs = [(0, prompts[0], 40), (20, prompts[1], 40), (22, prompts[2], 8)]
    with caplog.at_level("WARNING", logger="spade.serving.engine"):
        together, alone, stats = run(_together_then_alone(spade.AsyncEngine(cfg), jobs))
    assert stats["joins_held_by_cursor"] == 1 and stats["cursor_resets"] == 2 and stats["joins"] == 3
    held = [r for r in caplog.records if "waits for the batch to drain" in r.getMessage()]
    assert len(held) == 1 and "r1" in held[0].getMessage() and "model.block_size" in held[0].getMessage()
    assert [t.token_ids for t in together] == [a.token_ids for a in alone]

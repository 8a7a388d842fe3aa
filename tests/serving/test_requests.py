"""AsyncEngine's request lifecycle: finish reasons, bad input, failures, a soak."""

from __future__ import annotations

import asyncio
import random

import pytest

import spade
from spade.errors import ArgumentError, ArgumentTypeError, EngineClosedError
from spade.serving import SamplingParams

from .conftest import collect, final, greedy, make_config, run


@pytest.fixture(scope="module")
def engine():
    eng = spade.AsyncEngine(make_config("asyncspade", max_batch=2, max_seq_len=64))
    yield eng
    run(eng.close())


def test_stop_token_ids_eos_and_max_tokens(engine):
    async def main():
        ref = await final(engine, [11, 12, 13], greedy(12))
        toks = ref.token_ids
        k = next(i for i in range(2, len(toks)) if toks[i] not in toks[:i])
        stop_tok = await final(engine, [11, 12, 13], SamplingParams(max_tokens=12, stop_token_ids=[toks[k]]))
        saved = engine.eos
        engine.eos = {toks[k]}
        try:
            eos = await final(engine, [11, 12, 13], SamplingParams(max_tokens=12))
            ignored = await final(engine, [11, 12, 13], SamplingParams(max_tokens=12, ignore_eos=True))
        finally:
            engine.eos = saved
        return toks, k, stop_tok, eos, ignored

    toks, k, stop_tok, eos, ignored = run(main())
    assert stop_tok.finish_reason == "stop" and stop_tok.stop_reason == toks[k] and stop_tok.token_ids == toks[:k]
    assert eos.finish_reason == "stop" and eos.stop_reason is None and eos.token_ids == toks[:k]
    assert ignored.finish_reason == "length" and ignored.token_ids == toks


def test_outputs_stream_one_per_token(engine):
    outs = run(collect(engine, [1, 2, 3], greedy(5), "stream"))
    assert [len(o.token_ids) for o in outs] == [1, 2, 3, 4, 5]
    assert [o.finish_reason for o in outs] == [None] * 4 + ["length"]
    assert "".join(o.delta_text for o in outs) == outs[-1].text
    last = outs[-1]
    assert last.request_id == "stream" and last.prompt_token_ids == [1, 2, 3]
    assert last.ttft_s > 0 and last.tpot_s > 0 and last.queue_s >= 0


@pytest.mark.parametrize("prompt,params,rid,exc,field", [
    ("", None, None, ArgumentError, "prompt"),
    ("   ", None, None, ArgumentError, "prompt"),
    ([], None, None, ArgumentError, "prompt"),
    ("hello", None, None, ArgumentError, "tokenizer"),  # a preset has no tokenizer: token ids only
    ([1, 512], None, None, ArgumentError, r"prompt\[0\]\[1\]"),
    ([1, -1], None, None, ArgumentError, r"prompt\[0\]\[1\]"),
    ([1, 2.0], None, None, ArgumentTypeError, r"prompt\[0\]\[1\]"),
    (None, None, None, ArgumentTypeError, "prompt"),
    (list(range(60)), SamplingParams(max_tokens=5), None, ArgumentError, "max_tokens"),
    ([1], {"max_tokens": 3}, None, ArgumentTypeError, "params"),
    ([1], SamplingParams(stop=["x"]), None, ArgumentError, "SamplingParams.stop"),
    ([1], SamplingParams(stop_token_ids=[600]), None, ArgumentError, "stop_token_ids"),
    ([1], None, 5, ArgumentTypeError, "request_id"),
])
def test_bad_input_names_the_field(engine, prompt, params, rid, exc, field):
    with pytest.raises(exc, match=field):
        run(collect(engine, prompt, params, rid))
    assert engine.stats()["requests_waiting"] == 0 and engine.stats()["slots_used"] == 0
    if rid is None:  # validate() refuses the same input with the same error, outside any event loop
        with pytest.raises(exc, match=field):
            engine.validate(prompt, params)


def test_validate_returns_the_ids_and_starts_nothing(engine):
    before = engine.stats()
    assert engine.validate([3, 1, 4], SamplingParams(max_tokens=5)) == [3, 1, 4]
    after = engine.stats()
    assert after["requests_waiting"] == before["requests_waiting"] == 0
    assert after["prompt_tokens"] == before["prompt_tokens"] and after["slots_used"] == 0


@pytest.mark.parametrize("kw,field", [(dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
                                      (dict(top_p=0), "top_p"), (dict(top_k=-2), "top_k")])
def test_bad_sampling_values(kw, field):
    with pytest.raises(ArgumentError, match=f"SamplingParams.{field}"):
        SamplingParams(**kw)


def test_duplicate_request_id_is_refused_and_the_first_goes_on(engine):
    async def main():
        first = asyncio.ensure_future(final(engine, [4, 4, 4], greedy(20), "dup"))
        await asyncio.sleep(0.01)
        with pytest.raises(ArgumentError, match="request_id"):
            await collect(engine, [5], greedy(2), "dup")
        return await first

    out = run(main())
    assert out.finish_reason == "length" and len(out.token_ids) == 20


def test_failed_step_ends_its_requests_and_the_engine_goes_on():
    engine = spade.AsyncEngine(make_config("full", max_batch=2))
    real = engine.batch.step
    calls = {"n": 0}

    def flaky(tokens):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected step failure")
        return real(tokens)

    engine.batch.step = flaky

    async def main():
        a = asyncio.ensure_future(collect(engine, [1, 2], greedy(10), "a"))
        b = asyncio.ensure_future(collect(engine, [3, 4], greedy(10), "b"))
        res = await asyncio.gather(a, b, return_exceptions=True)
        after = await final(engine, [5, 6], greedy(4), "c")
        st = engine.stats()
        await engine.close()
        return res, after, st

    res, after, st = run(main())
    assert all(isinstance(r, RuntimeError) and "injected" in str(r) for r in res)
    assert after.finish_reason == "length" and len(after.token_ids) == 4
    assert st["requests_failed"] == 2 and st["slots_used"] == 0


def test_closed_engine_refuses_and_ends_running_requests():
    engine = spade.AsyncEngine(make_config("full", max_batch=1))

    async def main():
        outs = []

        async def consume():
            async for o in engine.generate([1, 2, 3], greedy(80), "r"):
                outs.append(o)
                if len(outs) == 2:
                    asyncio.ensure_future(engine.close())

        waiting = asyncio.ensure_future(collect(engine, [7], greedy(5), "w"))  # queued behind "r"
        await consume()
        w = await waiting
        with pytest.raises(EngineClosedError):
            await collect(engine, [1], greedy(2))
        await engine.close()  # idempotent
        return outs, w

    outs, w = run(main())
    assert outs[-1].finish_reason == "abort"
    assert w[-1].finish_reason == "abort"


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_soak_many_tiny_requests_leak_nothing(paged):
    """>= 200 requests with random lengths, arrivals, sampling and aborts (fixed seed):
    every one ends, and the slots, the queue and the tasks are all back afterwards; on a
    paged cache of fewer blocks than the rows could hold, every block too."""
    extra = ["model.block_size=4", "model.kv_blocks=14"] if paged else []  # 13 usable: 52 tokens for 4 rows
    engine = spade.AsyncEngine(make_config("asyncspade", max_batch=4, max_seq_len=48, extra=extra))
    free0 = engine.backend.kv_blocks_free()
    rng = random.Random(0)
    n = 200

    async def one(i):
        await asyncio.sleep(rng.random() * 0.5)
        T = rng.randint(1, 12)
        prompt = [rng.randrange(512) for _ in range(T)]
        params = SamplingParams(max_tokens=rng.randint(1, 8), temperature=rng.choice([0.0, 0.9]),
                                seed=rng.choice([None, i]), ignore_eos=rng.random() < 0.5)
        abort_after = rng.randint(1, 4) if rng.random() < 0.15 else None
        outs = []
        async for o in engine.generate(prompt, params, f"s{i}"):
            outs.append(o)
            if abort_after is not None and len(outs) == abort_after and not o.finished:
                await engine.abort(f"s{i}")
        return outs[-1]

    async def main():
        base = len(asyncio.all_tasks())
        res = await asyncio.gather(*(one(i) for i in range(n)))
        st = engine.stats()
        with engine._lock:
            left = (dict(engine._running), list(engine._waiting), dict(engine._requests))
        tasks = len(asyncio.all_tasks()) - base
        await engine.close()
        return res, st, left, tasks, engine._task.done()

    res, st, left, tasks, done = run(main())
    assert len(res) == n and all(r.finish_reason in ("stop", "length", "abort") for r in res)
    assert st["requests_finished"] + st["requests_aborted"] == n and st["requests_failed"] == 0
    assert st["slots_used"] == 0 and st["requests_running"] == 0 and st["requests_waiting"] == 0
    assert left == ({}, [], {})
    assert tasks <= 1 and done  # only the scheduler was alive, and close() ended it
    assert st["joins_into_running"] > 0 and st["cursor_resets"] >= 1
    if paged:
        assert st["kv_blocks_used"] == 0 and st["kv_blocks_reserved"] == 0 and st["kv_blocks_free"] == free0
        engine.backend.kv_pool.check()


def test_an_iterations_outputs_reach_the_loop_together(monkeypatch):
    """The worker hands each iteration's outputs to the requests' loop in one call (two
    with joins' first tokens), not one per request and token; every output arrives, in order."""
    import spade.serving.engine as se

    calls: list[int] = []
    real = se._deliver
    monkeypatch.setattr(se, "_deliver", lambda items: (calls.append(len(items)), real(items)))
    engine = spade.AsyncEngine(make_config("full", max_batch=4, max_seq_len=64))

    async def main():
        outs = await asyncio.gather(*(collect(engine, [1 + i, 2, 3], greedy(10), f"b{i}") for i in range(4)))
        st = engine.stats()
        await engine.close()
        return outs, st

    outs, st = run(main())
    assert [len(o) for o in outs] == [10] * 4 and sum(calls) == 40
    assert all([len(x.token_ids) for x in o] == list(range(1, 11)) for o in outs)  # in order
    assert len(calls) <= st["steps"] + st["joins"] < 40  # a call per step, one more per iteration that admits

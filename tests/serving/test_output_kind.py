"""``SamplingParams.output_kind``: cumulative outputs (the default), delta outputs that
concatenate to them, and final_only (one output, the last cumulative one), through
length, stop token ids, EOS, stop strings, sampling and aborts; bad values refused."""

from __future__ import annotations

import asyncio
import threading

import pytest

import spade
from spade.errors import ArgumentError, ArgumentTypeError
from spade.serving import RequestOutputKind, SamplingParams

from .conftest import collect, make_config, run

PROMPT = [11, 12, 13, 14]


class CharTokenizer:
    """A tokenizer for the tiny random preset, so that stop strings have text to cut:
    each id decodes to its own piece (a letter, some with a space, some with nothing
    like a special token, some with an incomplete character that the detokenizer holds
    back until the next id)."""

    @staticmethod
    def piece(i: int) -> str:
        if i % 13 == 0:
            return ""
        if i % 17 == 0:
            return "\ufffd"
        return chr(ord("a") + i % 26) + (" " if i % 5 == 0 else "")

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(self.piece(i) for i in ids)


@pytest.fixture(scope="module")
def engine():
    eng = spade.AsyncEngine(make_config("full", max_batch=2, max_seq_len=96))
    eng.tokenizer = CharTokenizer()
    yield eng
    run(eng.close())


def kinds(engine, params: SamplingParams, prompt=PROMPT) -> dict[str, list]:
    """Every output of the same request (greedy, or sampled with a seed) in each kind."""

    async def main():
        out = {}
        for kind in RequestOutputKind:
            p = SamplingParams(**{**params.__dict__, "output_kind": kind})
            out[kind.value] = await collect(engine, prompt, p)
        return out

    return run(main())


def check_kinds(outs: dict[str, list]) -> None:
    cum, delta, fin = outs["cumulative"], outs["delta"], outs["final_only"]
    # cumulative: one output per step, fresh lists that later outputs do not change
    assert len({id(o.token_ids) for o in cum}) == len(cum)
    for a, b in zip(cum, cum[1:]):
        assert b.token_ids[:len(a.token_ids)] == a.token_ids and len(b.token_ids) <= len(a.token_ids) + 1
        assert b.text.startswith(a.text) and b.text == a.text + b.delta_text
    # delta: as many outputs, each the new ids and text; their running sums are the cumulative outputs
    assert len(delta) == len(cum)
    ids, text = [], ""
    for d, c in zip(delta, cum):
        ids += d.token_ids
        text += d.text
        assert d.text == d.delta_text == c.delta_text
        assert ids == c.token_ids and text == c.text
        assert (d.finish_reason, d.stop_reason) == (c.finish_reason, c.stop_reason)
        assert d.prompt_token_ids == c.prompt_token_ids
    assert [d.finish_reason is None for d in delta[:-1]] == [True] * (len(delta) - 1)
    # final_only: exactly one output, the last cumulative one (its delta_text is everything)
    assert len(fin) == 1
    f, last = fin[0], cum[-1]
    assert f.finished and f.token_ids == last.token_ids and f.text == last.text == f.delta_text
    assert (f.finish_reason, f.stop_reason) == (last.finish_reason, last.stop_reason)
    assert f.ttft_s > 0 and f.queue_s >= 0 and (f.tpot_s is None) == (last.tpot_s is None)


def test_length(engine):
    outs = kinds(engine, SamplingParams(max_tokens=12, ignore_eos=True))
    check_kinds(outs)
    assert outs["cumulative"][-1].finish_reason == "length" and len(outs["cumulative"]) == 12
    assert all(len(d.token_ids) == 1 for d in outs["delta"])


def test_sampled_with_a_seed(engine):
    outs = kinds(engine, SamplingParams(max_tokens=10, temperature=1.0, top_k=50, seed=7, ignore_eos=True))
    check_kinds(outs)


def test_stop_token_ids_and_eos(engine):
    ref = kinds(engine, SamplingParams(max_tokens=16, ignore_eos=True))["cumulative"][-1].token_ids
    k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
    outs = kinds(engine, SamplingParams(max_tokens=16, stop_token_ids=[ref[k]]))
    check_kinds(outs)
    last = outs["delta"][-1]
    # the stop token is not an output id: the last delta adds none
    assert last.finish_reason == "stop" and last.stop_reason == ref[k] and last.token_ids == []
    assert outs["final_only"][0].token_ids == ref[:k]
    saved = engine.eos
    engine.eos = {ref[k]}
    try:
        outs = kinds(engine, SamplingParams(max_tokens=16))
    finally:
        engine.eos = saved
    check_kinds(outs)
    assert outs["delta"][-1].finish_reason == "stop" and outs["delta"][-1].stop_reason is None
    assert outs["delta"][-1].token_ids == [] and outs["final_only"][0].token_ids == ref[:k]


def test_stop_string(engine):
    ref = kinds(engine, SamplingParams(max_tokens=24, ignore_eos=True))["cumulative"][-1]
    text = ref.text
    # a 3-character stop string whose first occurrence is late in the text
    stop = next(text[i:i + 3] for i in range(len(text) // 2, len(text) - 3)
                if "\ufffd" not in text[i:i + 3] and text.find(text[i:i + 3]) >= len(text) // 3)
    outs = kinds(engine, SamplingParams(max_tokens=24, stop=[stop, "QQQQ"], ignore_eos=True))
    check_kinds(outs)
    cum, delta, fin = outs["cumulative"], outs["delta"], outs["final_only"]
    assert cum[-1].finish_reason == "stop" and cum[-1].stop_reason == stop
    assert cum[-1].text == text[:text.index(stop)]
    assert stop not in "".join(d.text for d in delta)
    # the id that completed the stop string stays an output id: the last delta holds it
    n = len(cum[-1].token_ids)
    assert cum[-1].token_ids == ref.token_ids[:n] and delta[-1].token_ids == ref.token_ids[n - 1:n]
    assert fin[0].text == cum[-1].text


def test_abort_running(engine):
    """An abort mid-decode: the delta outputs add up to everything generated (the last
    adds no id, and its text is what was held back for a stop string); final_only's one
    output is the cumulative abort output."""

    async def main():
        res = {}
        for kind in ("delta", "final_only", "cumulative"):
            outs = []
            p = SamplingParams(max_tokens=80, ignore_eos=True, stop=["QQQQ"], output_kind=kind)

            async def consume():
                async for o in engine.generate(PROMPT, p, f"abort-{kind}"):
                    outs.append(o)
                    if kind != "final_only" and len(outs) == 5:
                        await engine.abort(f"abort-{kind}")

            before = engine.stats()["tokens_generated"]
            task = asyncio.ensure_future(consume())
            if kind == "final_only":  # no output to count: abort after 5 tokens of the engine's
                while engine.stats()["tokens_generated"] < before + 5:
                    await asyncio.sleep(0.002)
                await engine.abort(f"abort-{kind}")
            await task
            res[kind] = outs
        return res

    res = run(main())
    tok = engine.tokenizer
    delta = res["delta"]
    assert delta[-1].finish_reason == "abort" and delta[-1].token_ids == []
    assert all(d.finish_reason is None for d in delta[:-1]) and 5 <= len(delta) < 80
    ids = [t for d in delta for t in d.token_ids]
    whole = tok.decode(ids)
    assert "".join(d.text for d in delta) == whole
    # held back while running (a 4-character stop string might be forming), streamed at the abort
    assert len(whole) >= 3 and whole.endswith(delta[-1].text) and len(delta[-1].text) >= 3
    fin = res["final_only"]
    assert len(fin) == 1 and fin[0].finish_reason == "abort" and 0 < len(fin[0].token_ids) < 80
    assert fin[0].text == tok.decode(fin[0].token_ids) == fin[0].delta_text
    cum = res["cumulative"]
    assert cum[-1].finish_reason == "abort" and cum[-1].token_ids == cum[-2].token_ids
    assert cum[-1].token_ids == ids[:len(cum[-1].token_ids)]  # the same greedy tokens
    assert engine.stats()["slots_used"] == 0


def test_abort_waiting():
    """A request aborted before it is admitted: one output, with no ids, in every kind."""
    engine = spade.AsyncEngine(make_config("full", max_batch=1, max_seq_len=96))
    go = threading.Event()  # the one row's request decodes no step until the others were aborted
    real = engine.batch.step

    def held(tokens):
        go.wait(60)
        return real(tokens)

    engine.batch.step = held

    async def main():
        busy = asyncio.ensure_future(collect(engine, PROMPT, SamplingParams(max_tokens=60, ignore_eos=True)))
        while engine.stats()["requests_running"] == 0:
            await asyncio.sleep(0.002)
        res = {}
        for kind in RequestOutputKind:
            waiting = asyncio.ensure_future(collect(engine, [5, 6], SamplingParams(max_tokens=4, output_kind=kind),
                                                    f"w-{kind}"))
            while engine.stats()["requests_waiting"] == 0:
                await asyncio.sleep(0.002)
            await engine.abort(f"w-{kind}")
            res[kind] = await waiting
        go.set()
        busy = await busy
        await engine.close()
        return res, busy

    res, busy = run(main())
    assert busy[-1].finish_reason == "length" and len(busy[-1].token_ids) == 60
    for kind, outs in res.items():
        assert len(outs) == 1, kind
        o = outs[0]
        assert o.finish_reason == "abort" and o.token_ids == [] and o.text == o.delta_text == "", kind


def test_output_kind_values():
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    assert SamplingParams(output_kind="delta").output_kind is RequestOutputKind.DELTA
    assert SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY).output_kind == "final_only"
    assert spade.RequestOutputKind is RequestOutputKind


@pytest.mark.parametrize("value,exc", [("deltas", ArgumentError), ("DELTA", ArgumentError), ("", ArgumentError),
                                       (None, ArgumentTypeError), (1, ArgumentTypeError)])
def test_bad_output_kind_is_refused(value, exc):
    with pytest.raises(exc, match="SamplingParams.output_kind") as e:
        SamplingParams(output_kind=value)
    msg = str(e.value)
    assert repr(value) in msg and "'cumulative', 'delta', 'final_only'" in msg


def test_bad_output_kind_set_later_is_refused_by_generate(engine):
    p = SamplingParams(max_tokens=2)
    p.output_kind = "streaming"
    with pytest.raises(ArgumentError, match="SamplingParams.output_kind: 'streaming'"):
        run(collect(engine, PROMPT, p))
    assert engine.stats()["requests_waiting"] == 0 and engine.stats()["slots_used"] == 0


def test_server_call_adds_up_delta_outputs(engine):
    """``spade serve`` asks for delta outputs; its ``_Call`` adds them up for the usage
    counts, the non-streamed response and /metrics."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from spade.serving import openai_protocol as oai
    from spade.serving.server import ServerState, _Call

    state = ServerState(engine, engine.cfg)
    req = oai.CompletionRequest.model_validate({"prompt": PROMPT, "max_tokens": 9, "ignore_eos": True})
    params = state.sampling(req, PROMPT, "prompt", default_max=16)
    assert params.output_kind is RequestOutputKind.DELTA and params.max_tokens == 9

    async def main():
        call = _Call(state, None, PROMPT, params)
        outs = []
        while (o := await call.next()) is not None:
            outs.append(o)
        whole = call.cumulative()
        await call.close()
        ref = await collect(engine, PROMPT, SamplingParams(max_tokens=9, ignore_eos=True))
        return outs, whole, ref

    outs, whole, ref = run(main())
    assert len(outs) == 9 and all(len(o.token_ids) == 1 for o in outs)
    assert whole.token_ids == ref[-1].token_ids and whole.text == ref[-1].text and whole.finish_reason == "length"
    assert oai.completion_response("c", "m", 0, whole)["usage"] == {"prompt_tokens": 4, "completion_tokens": 9,
                                                                   "total_tokens": 13}
    rendered = state.metrics.render({}).splitlines()
    assert next(ln for ln in rendered if ln.startswith("spade_completion_tokens_total{")).endswith(" 9")

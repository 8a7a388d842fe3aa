"""AsyncEngine on real weights (SmolLM2-135M, CPU fp32): text prompts, incremental
detokenisation, stop strings, and joined requests equal to the same requests alone."""

from __future__ import annotations

import asyncio

import pytest

import spade
from spade.serving import SamplingParams

from .conftest import collect, final, run

PROMPTS = ["def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def engine():
    try:
        cfg = spade.load_config(None, overrides=[
            "model.name=smollm2-135m", "model.backend=fast", "model.dtype=float32", "model.device=cpu",
            "model.max_seq_len=64", "model.chat_template=false", "runtime.topology=inline", "serving.max_batch=2",
            "policy.name=asyncspade", "policy.budget=16", "policy.sink_tokens=2", "policy.recent_tokens=4",
            "policy.window=4", "runtime.sparse_threshold=16", "generation.stop_at_eos=false"])
        eng = spade.AsyncEngine(cfg)
    except spade.SpadeError as e:  # the weights' package is not installed here
        pytest.skip(f"SmolLM2-135M is not available: {e}")
    yield eng
    run(eng.close())


@pytest.fixture(scope="module")
def runs(engine):
    """The prompts together (joining one another), then each alone."""

    async def main():
        together = await asyncio.gather(*(final(engine, p, SamplingParams(max_tokens=8 + 4 * i, ignore_eos=True))
                                          for i, p in enumerate(PROMPTS)))
        st = engine.stats()
        alone = [await final(engine, p, SamplingParams(max_tokens=8 + 4 * i, ignore_eos=True))
                 for i, p in enumerate(PROMPTS)]
        return together, alone, st

    return run(main())


def test_text_requests_together_match_alone(engine, runs):
    together, alone, st = runs
    assert st["sparse_steps"] > 0 and st["joins_into_running"] >= 1
    for t, a in zip(together, alone):
        assert t.token_ids == a.token_ids and t.text == a.text
        assert t.text == engine.tokenizer.decode(t.token_ids, skip_special_tokens=True)


def test_stop_string_cuts_the_text(engine, runs):
    ref = runs[1][1]  # PROMPTS[1] alone, 12 tokens
    words = ref.text.split()
    stop = " " + words[len(words) // 2]
    outs = run(collect(engine, PROMPTS[1], SamplingParams(max_tokens=12, stop=[stop], ignore_eos=True)))
    last = outs[-1]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert last.text == ref.text[:ref.text.index(stop)]
    assert stop not in "".join(o.delta_text for o in outs)
    assert "".join(o.delta_text for o in outs) == last.text

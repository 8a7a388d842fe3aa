"""The library API of ``spade.Engine`` (the synchronous front of ``spade.AsyncEngine``) on
a random-weight tiny preset (CPU, seconds): argument checks, closed engines, concurrent
callers, partial results on failure; and ``spade.run``'s events (the static batch)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import spade
from spade.errors import ArgumentError, ArgumentTypeError, EngineClosedError, SpadeError

#: asyncspade on the tiny preset, budget crossed during decoding (the cache rank's
#: selections are used, so interleaved generations would corrupt its state)
TINY = ["model.name=tiny", "model.max_seq_len=96", "policy.budget=12", "policy.sink_tokens=2",
        "policy.recent_tokens=3", "policy.window=4", "generation.max_new_tokens=6", "generation.stop_at_eos=false",
        "runtime.topology=colocated",
        "generation.prompts=[{text: 'a b c d e f g h i j k l m n o p'}, {text: 'x y z'}]"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    monkeypatch.setenv("SPADE_KERNELS", "torch")


def make_engine(*over: str) -> spade.Engine:
    return spade.Engine(spade.load_config(None, overrides=[*TINY, *over]))


@pytest.fixture(scope="module")
def engine():
    mp = pytest.MonkeyPatch()
    mp.setenv("SPADE_KERNELS", "torch")
    eng = make_engine()
    yield eng
    eng.close()
    mp.undo()


def tokens(results) -> list[list[int]]:
    return [r.token_ids for r in results]


# ----------------------------------------------------------------------------- arguments
def test_bare_string_is_one_prompt(engine):
    one = engine.generate("a b c d e f g h i j k l m n o p", max_new_tokens=3)
    assert len(one) == 1  # not one generation per character
    assert tokens(one) == tokens(engine.generate(["a b c d e f g h i j k l m n o p"], max_new_tokens=3))
    assert len(one[0].token_ids) == 3


def test_max_new_tokens_none_keeps_the_config_value(engine):
    res = engine.generate(max_new_tokens=None)
    assert [len(t) for t in tokens(res)] == [6, 6]
    assert [len(t) for t in tokens(engine.generate(max_new_tokens=2))] == [2, 2]


@pytest.mark.parametrize("bad", [0, -3, 2.5, "4", True])
def test_max_new_tokens_rejects_bad_values(engine, bad):
    with pytest.raises(ArgumentError) as ei:  # a ValueError
        engine.generate(["x y"], max_new_tokens=bad)
    assert isinstance(ei.value, ValueError)
    msg = str(ei.value)
    assert msg.startswith(f"max_new_tokens must be a positive int, got {bad!r}")
    assert "max_new_tokens=32" in msg and "None for the config's generation.max_new_tokens (6)" in msg


@pytest.mark.parametrize("prompts, where", [
    ([None], r"prompts\[0\]: a prompt is a str, a PromptConfig or a list of token ids, got None"),
    (["ok", 3.5], r"prompts\[1\]: .* got float"),
    (["ok", {"text": "hi"}], r"prompts\[1\]: .* got dict"),
    (object(), r"prompts: expected a prompt \(str\) or a list of prompts, got object"),
    (42, r"prompts: expected a prompt \(str\) or a list of prompts, got int"),
    ([5, 6, 7], r"a token-id prompt goes inside the list"),
    ([[5, "6"]], r"prompts\[0\]\[1\]: token ids are ints, got str"),
])
def test_bad_prompt_types_are_type_errors(engine, prompts, where):
    with pytest.raises(TypeError, match=where):
        engine.generate(prompts, max_new_tokens=2)


@pytest.mark.parametrize("prompts, where", [
    ([], r"prompts: got an empty list"),
    (["ok", "  "], r"prompts\[1\]: the prompt is empty"),
    ([[5, 6, 99999]], r"prompts\[0\]\[2\]: token id 99999 is outside the vocabulary \[0, 512\)"),
    (["ok", "a \ud800 b"], r"prompts\[1\]: the text has a lone surrogate .*U\+D800.* at character 2"),
])
def test_bad_prompt_values_are_value_errors(engine, prompts, where):
    with pytest.raises(ValueError, match=where):
        engine.generate(prompts, max_new_tokens=2)


def test_token_id_prompts(engine):
    ids = list(range(10, 26))
    a = engine.generate([ids], max_new_tokens=3)
    b = engine.generate([torch.tensor(ids)], max_new_tokens=3)
    assert tokens(a) == tokens(b) and len(a[0].token_ids) == 3
    assert a[0].prompt_tokens == 16


def test_library_errors_are_spade_errors(engine):
    """The CLI prints SpadeErrors as one line: argument errors must be among them."""
    with pytest.raises(SpadeError):
        engine.generate([None])
    with pytest.raises(SpadeError):
        engine.generate(max_new_tokens=0)


# ----------------------------------------------------------------------------- close
def test_generate_after_close_raises_and_opens_nothing():
    threads = threading.active_count()
    eng = make_engine()
    eng.generate(max_new_tokens=2)
    link = eng.core.batch.rt._link  # the colocated cache rank's link
    assert link is not None and not link.closed
    eng.close()
    assert link.closed and eng.core.closed
    assert threading.active_count() <= threads  # the loop thread, scheduler and cache rank are gone
    with pytest.raises(EngineClosedError, match="closed.*build a new spade.Engine"):
        eng.generate(max_new_tokens=2)
    with pytest.raises(RuntimeError):  # EngineClosedError is a RuntimeError too
        eng.generate(["x"])
    assert eng.core.batch.rt._link is link and link.closed  # no cache rank (task, link) was started again
    assert threading.active_count() <= threads
    eng.close()  # idempotent
    assert eng.closed


def test_context_manager_closes():
    with make_engine() as eng:
        eng.generate(max_new_tokens=2)
    assert eng.closed


# ----------------------------------------------------------------------------- concurrency
def test_concurrent_threads_share_the_batch_with_correct_results(engine):
    """Two threads at once (different prompts and lengths) share the core's batch: each gets
    what it gets alone."""
    p1 = (["a b c d e f g h i j k l m n o p q r"], 6)
    p2 = (["u v w x y z", "k l m n o p q r s t u v w"], 5)
    alone1 = tokens(engine.generate(*p1))
    alone2 = tokens(engine.generate(*p2))
    got: dict = {}
    errs: list = []
    go = threading.Barrier(2)

    def call(key, args):
        try:
            go.wait()
            got[key] = tokens(engine.generate(*args))
        except BaseException as e:  # noqa: BLE001 - reported below
            errs.append(e)

    ts = [threading.Thread(target=call, args=(1, p1)), threading.Thread(target=call, args=(2, p2))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in ts), "a concurrent generate hung"
    assert not errs, errs
    assert got == {1: alone1, 2: alone2}


def test_asyncio_gather_to_thread(engine):
    alone = tokens(engine.generate())
    alone_short = tokens(engine.generate(["x y z"], max_new_tokens=4))

    async def main():
        return await asyncio.wait_for(asyncio.gather(
            asyncio.to_thread(engine.generate),
            asyncio.to_thread(engine.generate, ["x y z"], 4),
            asyncio.to_thread(engine.generate),
        ), 120)

    a, b, c = asyncio.run(main())
    assert tokens(a) == alone == tokens(c)
    assert tokens(b) == alone_short


def test_reentrant_generate_from_callback_is_refused(engine):
    """A generate() or close() from inside generate's on_text callback (same thread) would
    deadlock: it raises, and the outer call completes."""
    inner: list = []

    def on_text(i, delta):
        if not inner:
            for call in (lambda: engine.generate(["x"], max_new_tokens=1), engine.close):
                try:
                    call()
                except RuntimeError as e:
                    inner.append(e)

    out = engine.generate(max_new_tokens=2, on_text=on_text)
    assert len(inner) == 2 and all("on_text callback" in str(e) for e in inner)
    assert [len(r.token_ids) for r in out] == [2, 2] and not engine.closed


def test_on_text_streams_each_prompts_text(engine):
    got: dict = {}
    out = engine.generate(max_new_tokens=5, on_text=lambda i, d: got.__setitem__(i, got.get(i, "") + d))
    assert got == {i: r.text for i, r in enumerate(out)}  # (token ids as text: the preset has no tokenizer)


# ----------------------------------------------------------------------------- partial results
def test_failure_mid_generation_carries_partial_results(engine, monkeypatch):
    """The core's 4th sampling call fails (the two prompts' first tokens, one decode step,
    then the failing one): both requests fail with it and keep their first two tokens."""
    real = engine.core._sample
    n = [0]

    def sample(logits, reqs):
        n[0] += 1
        if n[0] == 4:
            raise RuntimeError("injected sampler failure")
        return real(logits, reqs)

    full = tokens(engine.generate(max_new_tokens=6))
    monkeypatch.setattr(engine.core, "_sample", sample)
    with pytest.raises(RuntimeError, match="injected") as ei:
        engine.generate(max_new_tokens=6)
    part = ei.value.partial_results
    assert [r.token_ids for r in part] == [t[:2] for t in full]  # the tokens made before the failure
    assert all(r.finished == "error" for r in part)
    monkeypatch.undo()
    assert tokens(engine.generate(max_new_tokens=6)) == full  # the engine still works afterwards
    assert engine.stats()["slots_used"] == 0


def test_on_text_failure_aborts_the_call(engine):
    """An exception from on_text ends the call (its requests abort; their rows are freed
    at the core's next iteration)."""
    def on_text(i, delta):
        raise ValueError("callback failed")

    with pytest.raises(ValueError, match="callback failed") as ei:
        engine.generate(max_new_tokens=6, on_text=on_text)
    assert all(r.finished == "error" and len(r.token_ids) < 6 for r in ei.value.partial_results)
    assert [len(t) for t in tokens(engine.generate(max_new_tokens=6))] == [6, 6]
    st = engine.stats()
    assert st["slots_used"] == 0 and st["requests_waiting"] == 0 and st["requests_aborted"] >= 2


# ----------------------------------------------------------------------------- run JSON events
def _run_with_hooks(monkeypatch, hooks, *over):
    import spade.runtime as runtime
    from spade.runtime.asyncrt import AsyncRuntime
    from spade.static import run

    monkeypatch.setattr(runtime, "build_runtime", lambda cfg, be, pol: AsyncRuntime(cfg, be, pol, hooks=hooks))
    return run(spade.load_config(None, overrides=[*TINY, "generation.max_new_tokens=10", *over]))


def test_events_record_a_lost_cache_rank_and_dense_fallback(monkeypatch):
    from spade.runtime.protocol import CacheHooks

    s = _run_with_hooks(monkeypatch, CacheHooks(die_at_step=4), "runtime.on_late=full", "runtime.late_timeout_s=5",
                        "runtime.max_restarts_per_min=0")
    assert s["status"] == "ok" and s["generated_tokens"] == [10, 10]
    kinds = [e["event"] for e in s["events"]]
    assert kinds[:2] == ["peer_lost", "no_restart"]
    lost = s["events"][0]
    assert lost["on_late"] == "full" and lost["reason"] and lost["step"] in (4, 5) and lost["t_s"] > 0
    fb = next(e for e in s["events"] if e["event"] == "dense_fallback")
    # prompt 16 tokens > theta 12: all 9 decode steps were meant to be sparse; the cache rank
    # died when told about step 4, so steps from there on ran dense
    assert fb["of_sparse_steps"] == s["decode_steps"] == 9
    assert fb["ranges"][-1][1] == 9 and 0 < fb["steps"] < 9


def test_events_record_the_restart_of_a_lost_cache_rank(monkeypatch):
    from spade.runtime.protocol import CacheHooks

    s = _run_with_hooks(monkeypatch, CacheHooks(die_at_step=4), "runtime.on_late=wait")
    assert s["status"] == "ok" and s["generated_tokens"] == [10, 10]
    lost, back = s["events"][:2]
    assert lost["event"] == "peer_lost" and back["event"] == "peer_restored"
    assert back["step"] > lost["step"] and back["t_s"] >= lost["t_s"] and back["degraded_steps"] >= 1


def test_events_record_late_packs_by_kind(monkeypatch):
    from spade.runtime.protocol import CacheHooks

    s = _run_with_hooks(monkeypatch, CacheHooks(stall_from_step=5), "runtime.on_late=stale")
    late = next(e for e in s["events"] if e["event"] == "late_packs")
    assert late["total"] == s["late_packs"] > 0 and late["stale"] + late["full"] + late["waited"] == late["total"]
    assert late["stale"] > 0
    assert not any(e["event"] in ("peer_lost", "dense_fallback") for e in s["events"])

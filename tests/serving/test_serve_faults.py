"""A cache-rank fault behind the serving layer: ``spade.AsyncEngine`` (in this process) and a
live ``spade serve`` (a subprocess on 127.0.0.1), the tiny random-weight preset in fp32,
asyncspade on a cache process (``multiprocess`` over nccl, which is gloo on a CPU),
several requests decoding at once when the cache process is hit:

* SIGSTOP shorter than the deadlines under ``on_late: wait``: nothing is lost and every
  request's tokens are the inline run's (the math is unchanged, only time);
* SIGKILL mid-decode: every request completes with all its tokens (dense while the
  cache rank is gone), the loss and the restart are counted (``engine.stats()``,
  ``/metrics``), and the batch decodes sparsely again;
* SIGSTOP for good: the silence past ``runtime.peer_deadline_s`` is a loss, the stopped
  process is killed, a new one takes over.

And after close: no cache process, thread or file descriptor is left over. Each test
spawns cache processes (seconds each on a busy 2-core box)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

import spade
from tests.runtime.test_faults import Leaks, _gone

from .conftest import final, greedy, make_config, random_prompts, run
from .test_cache_rank import _inline_alone, _multiprocess

#: deadlines of the tests: a stop of STOP_S is below both; a stop for good is found in ~2 s
DEADLINES = ["runtime.peer_deadline_s=2.5", "runtime.late_timeout_s=2", "runtime.transport.timeout_s=30"]
STOP_S = 0.6
#: bound of every wait for the engine (a restart spawns a process: 6-16 s here)
BOUND_S = 120.0


def _engine(*extra: str, **kw) -> spade.AsyncEngine:
    return spade.AsyncEngine(make_config("asyncspade", "multiprocess", max_batch=4, max_seq_len=128,
                                         extra=_multiprocess("nccl") + DEADLINES + list(extra)), **kw)


def _cache_pid(engine) -> int:
    link = engine.batch.rt._link
    assert link is not None and link.proc is not None, "no cache process"
    return link.proc.pid


async def _at_step(engine, step: int) -> None:
    """Return once the engine has run ``step`` decode steps (bounded)."""
    end = time.monotonic() + BOUND_S
    while engine.stats()["steps"] < step:
        assert time.monotonic() < end, f"the engine did not reach decode step {step}"
        await asyncio.sleep(0.005)


async def _round(engine, jobs, prefix: str, fault=None, at: int = 5):
    """The requests ``jobs`` (prompt, max_tokens) at once; ``fault(pid)`` at the round's
    decode step ``at``. Bounded by BOUND_S."""
    start = engine.stats()["steps"]
    outs = asyncio.gather(*(final(engine, p, greedy(n), f"{prefix}{i}") for i, (p, n) in enumerate(jobs)))
    if fault is not None:
        await _at_step(engine, start + at)
        fault(_cache_pid(engine))
    return await asyncio.wait_for(outs, BOUND_S)


async def _until_restored(engine, prompts, prefix: str) -> dict:
    """Serve requests, a pair at a time, until the engine counts a restart (bounded);
    its stats then."""
    end, i = time.monotonic() + BOUND_S, 0
    while engine.stats()["cache_restarts"] < 1:
        assert time.monotonic() < end, f"the cache rank was not restarted within {BOUND_S:.0f}s: {engine.stats()}"
        await _round(engine, [(prompts[(i + j) % len(prompts)], 24) for j in range(2)], f"{prefix}{i}-")
        i += 1
    return engine.stats()


def _sparse_again(before: dict, after: dict) -> None:
    """Between two stats: steps meant sparse ran, and none of them ran dense (the cache
    rank answered every one)."""
    assert after["sparse_steps"] > before["sparse_steps"]
    assert after["cache_dense_fallback_steps"] == before["cache_dense_fallback_steps"]


def _stop_for(seconds: float):
    def fault(pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(seconds, os.kill, (pid, signal.SIGCONT)).start()

    return fault


def test_engine_sigstop_below_the_deadlines_then_sigkill():
    """One engine, two rounds of four requests at once. Round 1: the cache process is
    stopped for 0.6 s at decode step 5 (below late_timeout_s and peer_deadline_s) under
    ``wait``: every request's tokens equal its inline run's, and nothing is lost.
    Round 2: it is SIGKILLed at step 5: every request completes with all its tokens, the
    loss is counted, a new cache process comes up (more requests keep the batch decoding
    meanwhile) and the batch decodes sparsely again. After close nothing is left over."""
    prompts = random_prompts(4, seed=21, lo=18, hi=30)
    jobs = [(p, n) for p, n in zip(prompts, (40, 33, 27, 36))]
    t0 = time.monotonic()
    with Leaks():
        engine = _engine()

        async def main():
            stopped = await _round(engine, jobs, "s", _stop_for(STOP_S))
            after_stop = engine.stats()
            killed_pid = []
            killed = await _round(engine, jobs, "k", lambda pid: killed_pid.append(pid) or os.kill(pid, signal.SIGKILL))
            after_kill = engine.stats()
            restored = await _until_restored(engine, prompts, "r")
            again = await _round(engine, jobs, "a")
            end = engine.stats()
            link = engine.batch.rt._link
            await engine.close()
            return stopped, after_stop, killed, killed_pid, after_kill, restored, again, end, link

        stopped, after_stop, killed, killed_pid, after_kill, restored, again, end, link = run(main())
    assert time.monotonic() - t0 < 4 * BOUND_S
    inline = _inline_alone([(0, p, n) for p, n in jobs])
    # round 1: a short stop under wait changes nothing but time
    assert [o.token_ids for o in stopped] == inline
    assert after_stop["cache_peers_lost"] == 0 and after_stop["cache_dense_fallback_steps"] == 0
    assert after_stop["sparse_steps"] > 0 and after_stop["late_packs"] > 0  # (the stop was waited for)
    # round 2: survived, every token generated
    for (_, n), o in zip(jobs, killed):
        assert o.finish_reason == "length" and len(o.token_ids) == n
    assert after_kill["cache_peers_lost"] == 1 and after_kill["requests_failed"] == 0
    assert after_kill["cache_dense_fallback_steps"] > 0  # dense while the cache rank was gone
    assert _gone(killed_pid[0])
    # restored: counted, and sparse again (the rows' query windows restart: tokens may differ)
    assert end["cache_restarts"] >= 1 and end["cache_peers_lost"] == 1
    for (_, n), o in zip(jobs, again):
        assert o.finish_reason == "length" and len(o.token_ids) == n
    _sparse_again(restored, end)
    assert end["requests_failed"] == 0 and end["slots_used"] == 0
    assert link.closed and (link.proc is None or link.proc.poll() is not None)


def test_engine_sigstop_past_the_deadline_is_a_loss():
    """Four requests at once; the cache process is stopped for good at decode step 5:
    under ``wait`` each late pack waits late_timeout_s and runs dense, the silence past
    peer_deadline_s is a loss, the stopped process is killed (not left stopped), every
    request completes, and a new cache process takes over."""
    prompts = random_prompts(4, seed=31, lo=18, hi=30)
    jobs = [(p, n) for p, n in zip(prompts, (30, 26, 22, 28))]
    stopped: list[int] = []
    t0 = time.monotonic()
    with Leaks():
        engine = _engine()

        async def main():
            outs = await _round(engine, jobs, "s", lambda pid: stopped.append(pid) or os.kill(pid, signal.SIGSTOP))
            lost = engine.stats()
            restored = await _until_restored(engine, prompts, "r")
            await _round(engine, jobs, "a")
            end = engine.stats()
            await engine.close()
            return outs, lost, restored, end

        outs, lost, restored, end = run(main())
    assert time.monotonic() - t0 < 3 * BOUND_S
    for (_, n), o in zip(jobs, outs):
        assert o.finish_reason == "length" and len(o.token_ids) == n
    assert lost["cache_peers_lost"] == 1 and lost["requests_failed"] == 0
    assert _gone(stopped[0])
    assert lost["cache_dense_fallback_steps"] > 0
    assert end["cache_restarts"] >= 1 and end["cache_peers_lost"] == 1 and end["requests_failed"] == 0
    _sparse_again(restored, end)


def test_engine_standby_restores_within_the_round():
    """runtime.standby: once the spare cache process is connected, a SIGKILL of the live
    one mid-decode is restored within the same round of requests (a boot over the
    spare's link, no spawn): the restart is counted when the round ends, every request
    completes, and the next round decodes sparsely with no dense-fallback step."""
    prompts = random_prompts(4, seed=51, lo=18, hi=30)
    jobs = [(p, n) for p, n in zip(prompts, (60, 54, 48, 57))]
    killed: list[int] = []
    with Leaks():
        engine = _engine("runtime.standby=true")

        async def main():
            await _round(engine, jobs[:1], "w")  # the live link (and the spare behind it) open
            end = time.monotonic() + BOUND_S
            while engine.batch.rt.standby_pid() is None:
                assert time.monotonic() < end, "the spare cache process did not connect"
                await asyncio.sleep(0.1)
            spare = engine.batch.rt.standby_pid()
            outs = await _round(engine, jobs, "k", lambda pid: killed.append(pid) or os.kill(pid, signal.SIGKILL))
            after = engine.stats()
            live = _cache_pid(engine)
            again = await _round(engine, jobs, "a")
            end_stats = engine.stats()
            await engine.close()
            return spare, outs, after, live, again, end_stats

        spare, outs, after, live, again, end_stats = run(main())
    for (_, n), o in zip(jobs, outs + again):
        assert o.finish_reason == "length" and len(o.token_ids) == n
    assert after["cache_peers_lost"] == 1 and after["cache_restarts"] == 1, after
    assert live == spare and _gone(killed[0])
    _sparse_again(after, end_stats)
    assert end_stats["requests_failed"] == 0

# --------------------------------------------------------------------------- a live `spade serve`
SERVE = """
model: {{name: tiny, dtype: float32, device: cpu, max_seq_len: 160}}
policy: {{name: asyncspade, budget: 12, sink_tokens: 2, recent_tokens: 4}}
runtime:
  topology: multiprocess
  sparse_threshold: 16
  peer_deadline_s: 2.5
  late_timeout_s: 2
  transport: {{name: nccl, master_port: {port}, timeout_s: 30}}
serving: {{max_batch: 4}}
serve: {{max_waiting: 64, shutdown_grace_s: 5}}
"""


def _cache_process(server_pid: int) -> int:
    """The server's cache process (``python -m spade.runtime.worker``), bounded wait."""
    from tests.serving.live import children

    end = time.monotonic() + BOUND_S
    while time.monotonic() < end:
        for pid in children(server_pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"spade.runtime.worker" in f.read():
                        return pid
            except OSError:
                pass
        time.sleep(0.1)
    raise AssertionError("spade serve has no cache process")


def _stream(http, url: str, body: dict, out: dict) -> threading.Thread:
    """POST a streamed completion in a thread; ``out['events']``: the SSE payloads so far."""
    def go():
        try:
            with http.Client(timeout=BOUND_S) as c:
                with c.stream("POST", url + "/v1/completions", json=body) as r:
                    out["status"] = r.status_code
                    out["events"] = []
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            out["events"].append(line[6:])
        except Exception as e:
            out["error"] = repr(e)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _streamed(out: dict) -> tuple[str, str]:
    """(text, finish_reason) of a finished stream."""
    import json

    assert out.get("status") == 200 and out["events"][-1] == "[DONE]", out
    chunks = [json.loads(e) for e in out["events"][:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    return text, [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]


def _concurrent(http, url, bodies, fault=None, after_events: int = 4):
    """Stream ``bodies`` at once; ``fault()`` once each has streamed ``after_events``
    chunks; every stream ends within BOUND_S."""
    outs = [{} for _ in bodies]
    threads = [_stream(http, url, b, o) for b, o in zip(bodies, outs)]
    if fault is not None:
        end = time.monotonic() + BOUND_S
        while not all(len(o.get("events", [])) >= after_events or "error" in o for o in outs):
            assert time.monotonic() < end, outs
            time.sleep(0.01)
        fault()
    for t in threads:
        t.join(BOUND_S)
        assert not t.is_alive(), "a stream hung"
    return [_streamed(o) for o in outs]


def test_live_serve_survives_a_killed_cache_process(tmp_path, monkeypatch):
    """``spade serve`` on 127.0.0.1 with asyncspade on a cache process (gloo): four
    streamed requests at once. The cache process stopped for 0.6 s mid-decode (below
    the deadlines, ``wait``): each request's text equals its alone run's. SIGKILLed
    mid-decode: every request completes with all its tokens (``finish_reason``
    length), /metrics counts the loss, the server starts a new cache process (requests
    keep coming), counts the restart, and decodes sparsely again. SIGTERM: exit 0, no
    child process left."""
    from tests.runtime.conftest import free_port
    from tests.serving.live import LiveServer, alive, children, http_module, metric

    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    http = http_module()
    ok, why = __import__("spade.transports", fromlist=["availability"]).availability()["nccl"]
    if not ok:
        pytest.skip(f"transport 'nccl' is not usable here: {why}")
    prompts = random_prompts(4, seed=41, lo=18, hi=30)
    lengths = (40, 34, 28, 37)
    bodies = [{"model": "tiny", "prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
              for p, n in zip(prompts, lengths)]
    s = LiveServer(tmp_path, SERVE.format(port=free_port()))

    def metrics() -> str:
        r = http.get(s.url + "/metrics", timeout=30)
        assert r.status_code == 200
        return r.text

    try:
        first = _cache_process(s.proc.pid) if children(s.proc.pid) else None
        alone = [_concurrent(http, s.url, [b])[0] for b in bodies]
        first = first or _cache_process(s.proc.pid)
        # a short stop: nothing lost, the same tokens
        stopped = _concurrent(http, s.url, bodies, lambda: _stop_for(STOP_S)(first))
        assert stopped == alone
        assert metric(metrics(), "spade_cache_peers_lost_total") == 0
        # SIGKILL mid-decode
        killed = _concurrent(http, s.url, bodies, lambda: os.kill(first, signal.SIGKILL))
        for (text, reason), n in zip(killed, lengths):
            assert reason == "length" and len(text.split()) == n
        m = metrics()
        assert metric(m, "spade_cache_peers_lost_total") == 1
        assert metric(m, "spade_request_finished_total", finish_reason="length") == 3 * len(bodies)
        # more requests keep the batch decoding until the new cache process is up
        end = time.monotonic() + BOUND_S
        while metric(metrics(), "spade_cache_restarts_total") < 1:
            assert time.monotonic() < end, f"no restart within {BOUND_S:.0f}s:\n{s.log()}"
            _concurrent(http, s.url, bodies[:2])
        second = _cache_process(s.proc.pid)
        assert second != first and not alive(first)
        m = metrics()
        sparse, dense = (metric(m, "spade_sparse_decode_steps_total"),
                         metric(m, "spade_cache_dense_fallback_steps_total"))
        assert dense > 0
        again = _concurrent(http, s.url, bodies)
        for (text, reason), n in zip(again, lengths):
            assert reason == "length" and len(text.split()) == n
        m = metrics()
        # sparse again: steps meant sparse ran, none of them dense
        assert metric(m, "spade_sparse_decode_steps_total") > sparse
        assert metric(m, "spade_cache_dense_fallback_steps_total") == dense
        assert metric(m, "spade_cache_peers_lost_total") == 1 and metric(m, "spade_cache_restarts_total") >= 1
        kids = children(s.proc.pid)
        rc = s.stop()
    finally:
        s.stop(signal.SIGKILL)
    assert rc == 0, s.log()
    assert not [k for k in kids if alive(k)], "a child process outlived the server"

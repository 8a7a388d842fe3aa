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


def _engine(**kw) -> spade.AsyncEngine:
    return spade.AsyncEngine(make_config("asyncspade", "multiprocess", max_batch=4, max_seq_len=128,
                                         extra=_multiprocess("nccl") + DEADLINES), **kw)


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


async def _until_restored(engine, prompts, prefix: str) -> int:
    """Serve requests, a pair at a time, until the engine counts a restart; returns the
    sparse steps counted once it has (bounded)."""
    end, i = time.monotonic() + BOUND_S, 0
    while engine.stats()["cache_restarts"] < 1:
        assert time.monotonic() < end, f"the cache rank was not restarted within {BOUND_S:.0f}s: {engine.stats()}"
        await _round(engine, [(prompts[(i + j) % len(prompts)], 24) for j in range(2)], f"{prefix}{i}-")
        i += 1
    return engine.stats()["sparse_steps"]


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
            sparse = await _until_restored(engine, prompts, "r")
            again = await _round(engine, jobs, "a")
            end = engine.stats()
            link = engine.batch.rt._link
            await engine.close()
            return stopped, after_stop, killed, killed_pid, after_kill, sparse, again, end, link

        stopped, after_stop, killed, killed_pid, after_kill, sparse, again, end, link = run(main())
    assert time.monotonic() - t0 < 4 * BOUND_S
    inline = _inline_alone([(0, p, n) for p, n in jobs])
    # round 1: a short stop under wait changes nothing but time
    assert [o.token_ids for o in stopped] == inline
    assert after_stop["cache_peers_lost"] == 0 and after_stop["sparse_steps"] > 0
    # round 2: survived, every token generated
    for (_, n), o in zip(jobs, killed):
        assert o.finish_reason == "length" and len(o.token_ids) == n
    assert after_kill["cache_peers_lost"] == 1 and after_kill["requests_failed"] == 0
    assert _gone(killed_pid[0])
    # restored: counted, and sparse again (the rows' query windows restart: tokens may differ)
    assert end["cache_restarts"] >= 1 and end["cache_peers_lost"] == 1
    for (_, n), o in zip(jobs, again):
        assert o.finish_reason == "length" and len(o.token_ids) == n
    assert end["sparse_steps"] > sparse
    assert end["requests_failed"] == 0 and end["slots_used"] == 0
    assert link.closed and (link.proc is None or link.proc.poll() is not None)

"""AsyncRuntime with the cache rank in its own process (``python -m
spade.runtime.worker``) over the nccl transport (gloo on CPU).

Spawning a process that imports torch is slow on a small box, so one cache
process serves several runtimes here (``link=``): each generation's BOOT carries
its own pack size, return mode and threshold.
"""

from __future__ import annotations

import time

import pytest

from spade.policies import build_policy
from spade.runtime.asyncrt import AsyncRuntime
from tests.runtime.conftest import BUDGET, NEW, T, config, free_port, greedy


@pytest.fixture(scope="module")
def mp_runtime(model):
    cfg = config("runtime.topology=multiprocess", "runtime.transport.name=nccl",
                 f"runtime.transport.master_port={free_port()}", "runtime.transport.timeout_s=60",
                 "runtime.pack_layers=2", "runtime.return_mode=indices")
    rt = AsyncRuntime(cfg, model, build_policy(cfg.policy, model.spec))
    yield rt
    rt.close()


def test_multiprocess_matches_inline(mp_runtime, prompt, inline_tokens):
    tr = mp_runtime.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)
    assert tr.tokens == inline_tokens
    assert tr.stats["sparse_steps"] == sum(1 for s in range(1, NEW) if T + s > BUDGET)
    link = mp_runtime._link
    assert link.proc is not None and link.proc.poll() is None  # a real process, still serving
    assert link.transport.backend_used == "gloo"


def test_multiprocess_kv_pack1_on_the_same_process(mp_runtime, model, prompt, inline_tokens):
    link = mp_runtime.run(mp_runtime.link())
    cfg = config("runtime.topology=multiprocess", "runtime.transport.name=nccl", "runtime.pack_layers=1",
                 "runtime.return_mode=kv")
    rt = AsyncRuntime(cfg, model, build_policy(cfg.policy, model.spec), link=link)
    tr = rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)
    rt.close()  # does not close a link (or loop) it does not own
    assert tr.tokens == inline_tokens
    assert tr.stats["return_mode"] == "kv" and tr.stats["pack_layers"] == 1
    assert link.proc.poll() is None and not link.closed


def test_multiprocess_refresh_every_matches_inline(model, prompt):
    """``policy.refresh_every=3`` with the cache rank in its own process (its policy is built
    from the config it was spawned with): the inline run's tokens with the same setting."""
    from spade.runtime.inline import InlineRuntime

    cfg = config("runtime.topology=multiprocess", "runtime.transport.name=nccl",
                 f"runtime.transport.master_port={free_port()}", "runtime.transport.timeout_s=60",
                 "runtime.pack_layers=2", "runtime.return_mode=delta", "policy.refresh_every=3")
    want = InlineRuntime(cfg, model, build_policy(cfg.policy, model.spec)).generate(
        *prompt, max_new_tokens=NEW, sample_fn=greedy).tokens
    rt = AsyncRuntime(cfg, model, build_policy(cfg.policy, model.spec))
    try:
        tr = rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)
    finally:
        rt.close()
    assert tr.tokens == want  # (late packs here only mean waits: on_late=wait)


def test_dead_cache_process_is_survived_not_a_hang(model, prompt, inline_tokens):
    """The cache process is killed mid-generation under on_late=wait: the generation
    completes densely within seconds (a restart may not finish in so few steps: the
    next generation adopts it and starts dense), and a later generation runs on a new
    cache process."""
    cfg = config("runtime.topology=multiprocess", "runtime.transport.name=nccl",
                 f"runtime.transport.master_port={free_port()}", "runtime.transport.timeout_s=30",
                 "runtime.on_late=wait", "runtime.late_timeout_s=20", "runtime.pack_layers=3")
    rt = AsyncRuntime(cfg, model, build_policy(cfg.policy, model.spec))
    try:
        def kill_at_step_5(i, _):
            if i == 5:
                rt._link.proc.kill()
            return False

        t0 = time.monotonic()
        dead = rt._link
        tr = rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy, on_token=kill_at_step_5)
        assert time.monotonic() - t0 < 30
        assert all(len(r) == NEW for r in tr.tokens)
        lost = tr.stats["events"][0]
        assert lost["event"] == "peer_lost" and lost["step"] in (5, 6, 7)
        assert [r[:5] for r in tr.tokens] == [r[:5] for r in inline_tokens]
        t1 = time.monotonic()
        while rt._link is dead or rt._link.closed:  # the restart, handed from one generation to the next
            assert time.monotonic() - t1 < 60, "the lost cache process was not replaced within 60 s"
            tr = rt.generate(*prompt, max_new_tokens=4, sample_fn=greedy)
            assert all(len(r) == 4 for r in tr.tokens)
        assert rt._link.proc.poll() is None  # a fresh cache process
        tr = rt.generate(*prompt, max_new_tokens=4, sample_fn=greedy)
        assert not any(e["event"] == "peer_lost" for e in tr.stats["events"])
        assert [r[:4] for r in tr.tokens] == [r[:4] for r in inline_tokens]
    finally:
        rt.close()

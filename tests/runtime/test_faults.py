"""Fault injection: a lost cache rank is survived in every ``on_late`` mode, restarted,
booted from the inference rank's cache, and sparse selection resumes.

Faults: the cache rank dies (test hook, SIGKILL of its process) at seeded random
steps and during its boot; it stops (in-process: a long delay; a process: SIGSTOP)
for less and for more than the deadlines; its transport delays, drops or closes
mid-message (a wrapper around the inference rank's end). Assertions: bounded time,
every token generated, tokens equal to the unfaulted run's where the math says so,
tokens attended per step back to the budget right after the restore, nothing leaked
(processes, file descriptors, threads).

The tiny random-weight preset on CPU; each test takes seconds (the multiprocess ones
spawn a cache process, a few seconds each on a busy 2-core box).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from spade.errors import TransportError
from spade.policies import build_policy
from spade.runtime.asyncrt import AsyncRuntime
from spade.runtime.protocol import CacheHooks
from spade.runtime.session import InferenceSession
from tests.runtime.conftest import BUDGET, NEW, T, config, free_port, greedy

#: a short liveness deadline for the tests (the default, 60 s, covers GPU compile time)
DEADLINE = ["runtime.peer_deadline_s=1.5", "runtime.late_timeout_s=1"]


def _children() -> set[int]:
    """This process's live child processes (zombies excluded)."""
    me, out = os.getpid(), set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                parts = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(parts[1]) == me and parts[0] != "Z":
            out.add(int(d))
    return out


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Leaks:
    """Processes, file descriptors and threads before and after (closing the runtime)."""

    def __enter__(self):
        self.kids, self.fds, self.threads = _children(), _fds(), threading.active_count()
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            return
        end = time.monotonic() + 10
        while time.monotonic() < end and (_children() - self.kids or threading.active_count() > self.threads):
            time.sleep(0.1)
        assert _children() - self.kids == set(), "a cache process outlived its runtime"
        assert threading.active_count() <= self.threads, [t.name for t in threading.enumerate()]
        assert _fds() <= self.fds + 2, f"file descriptors: {self.fds} before, {_fds()} after"  # (lazy imports)


@pytest.fixture
def per_step_attended(monkeypatch):
    """Tokens attended by each decode step (summed over layers, rows and KV heads):
    the context's device counters read after every step (CPU: no sync cost)."""
    record: list[int] = []
    real = InferenceSession.step

    async def step(self, tokens):
        before = int(self.ctx.stats[:, 0].sum())
        out = await real(self, tokens)
        record.append(int(self.ctx.stats[:, 0].sum()) - before)
        return out

    monkeypatch.setattr(InferenceSession, "step", step)
    return record


def _run(model, prompt, *over, hooks=None, new=NEW, on_token=None, runtime=None):
    cfg = config(*over)
    rt = runtime or AsyncRuntime(cfg, model, build_policy(cfg.policy, model.spec), hooks=hooks)
    try:
        return rt.generate(*prompt, max_new_tokens=new, sample_fn=greedy, on_token=on_token)
    finally:
        if runtime is None:
            rt.close()


def _kinds(tr) -> list[str]:
    return [e["event"] for e in tr.stats["events"]]


@pytest.fixture(scope="module")
def unfaulted(model, prompt):
    """colocated, packs of 2, wait: tokens and per-step attended of a run without faults."""
    cfg = config("runtime.topology=colocated", "runtime.pack_layers=2")
    rt = AsyncRuntime(cfg, model, build_policy(cfg.policy, model.spec))
    rec: list[int] = []
    real = InferenceSession.step

    async def step(self, tokens):
        before = int(self.ctx.stats[:, 0].sum())
        out = await real(self, tokens)
        rec.append(int(self.ctx.stats[:, 0].sum()) - before)
        return out

    InferenceSession.step = step
    try:
        tr = rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)
    finally:
        InferenceSession.step = real
        rt.close()
    return tr.tokens, rec


# ----------------------------------------------------------------------------- in-process cache rank
@pytest.mark.parametrize("on_late", ["wait", "stale", "full"])
@pytest.mark.parametrize("seed", [0, 1])
def test_killed_at_a_random_step_is_restarted_and_sparse_again(model, prompt, unfaulted, per_step_attended,
                                                                 on_late, seed):
    """The cache rank dies at a seeded random step: the generation completes in every
    mode, the loss and the restore are events with their step, and from the step after
    the restore the tokens attended per step are the unfaulted run's (the budget)."""
    die = random.Random(seed).randint(3, NEW - 4)
    t0 = time.monotonic()
    with Leaks():
        tr = _run(model, prompt, "runtime.topology=colocated", "runtime.pack_layers=2", f"runtime.on_late={on_late}",
                  *DEADLINE, hooks=CacheHooks(die_at_step=die))
    assert time.monotonic() - t0 < 30
    assert all(len(r) == NEW for r in tr.tokens)
    ev = tr.stats["events"]
    assert _kinds(tr) == ["peer_lost", "peer_restored"], ev
    lost, back = ev
    assert lost["step"] in (die, die + 1) and lost["reason"]  # told about step `die` (or found out one step on)
    assert back["step"] == lost["step"] + 1 and back["t_s"] >= lost["t_s"] and back["restart"] == 1
    assert tr.stats["restarts"] == 1 and tr.stats["peers_lost"] == 1
    # from the restore on, every step is sparse with the budget's token count
    want = unfaulted[1]
    assert per_step_attended[back["step"]:] == want[back["step"]:]
    # until the loss, the tokens are the unfaulted ones (token 0 + steps 1..die-1)
    assert [r[:die] for r in tr.tokens] == [r[:die] for r in unfaulted[0]]


def test_killed_during_the_boot(model, prompt, per_step_attended):
    """The cache rank dies on the second layer of its first boot: decoding starts
    densely, a new cache rank boots after the first decode step, sparse from there."""
    with Leaks():
        tr = _run(model, prompt, "runtime.topology=local", "runtime.pack_layers=1", *DEADLINE,
                  hooks=CacheHooks(die_at_boot_layer=1))
    assert all(len(r) == NEW for r in tr.tokens)
    lost, back = tr.stats["events"]
    assert lost["event"] == "peer_lost" and lost["step"] == 0
    assert back["event"] == "peer_restored" and back["step"] == 2  # the boot needs one step's queries
    # steps 1-2 are dense anyway (cache length <= theta = the budget): no sparse step lost
    assert tr.stats["dense_fallback"] == [] and tr.stats["dense_fallback_steps"] == 0
    assert tr.stats["sparse_steps"] == sum(1 for s in range(1, NEW) if T + s > BUDGET)


def test_restart_cap_then_dense_with_a_warning(model, prompt, caplog):
    """runtime.max_restarts_per_min=0: the loss is survived, nothing restarts, one
    ``no_restart`` event and one warning; the rest of the generation is dense."""
    tr = _run(model, prompt, "runtime.topology=colocated", "runtime.max_restarts_per_min=0", *DEADLINE,
              hooks=CacheHooks(die_at_step=6))
    assert all(len(r) == NEW for r in tr.tokens)
    assert _kinds(tr) == ["peer_lost", "no_restart"]
    assert "max_restarts_per_min=0" in tr.stats["events"][1]["reason"]
    assert "not restarted" in caplog.text
    fb = tr.stats["dense_fallback"]
    assert len(fb) == 1 and fb[0][1] == NEW - 1


def test_restart_cap_counts_per_runtime(model, prompt):
    """A cap of 1 per minute: the first loss restarts, the second (next generation)
    does not."""
    cfg = config("runtime.topology=colocated", "runtime.max_restarts_per_min=1", *DEADLINE)
    rt = AsyncRuntime(cfg, model, build_policy(cfg.policy, model.spec), hooks=CacheHooks(die_at_step=5))
    try:
        a = rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)
        b = rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)
    finally:
        rt.close()
    assert _kinds(a) == ["peer_lost", "peer_restored"]
    assert _kinds(b) == ["peer_lost", "no_restart"] and "the cap" in b.stats["events"][1]["reason"]


def test_a_pause_shorter_than_the_deadline_changes_nothing_under_wait(model, prompt, unfaulted):
    """A cache rank that pauses (each selection 0.3 s late) but stays within
    late_timeout_s and peer_deadline_s: under wait the tokens are the unfaulted ones."""
    tr = _run(model, prompt, "runtime.topology=colocated", "runtime.pack_layers=2", *DEADLINE,
              hooks=CacheHooks(delay_s=0.3, delay_from_step=8), new=11)
    assert tr.tokens == [r[:11] for r in unfaulted[0]]
    assert tr.stats["waited_packs"] > 0 and tr.stats["events"] == []


def test_a_pause_longer_than_the_deadline_is_a_loss(model, prompt, per_step_attended, unfaulted):
    """A cache rank that stops sending (a hang) under stale: before, stale reused the
    last selection forever; now the silence past peer_deadline_s is a loss, restarted."""
    t0 = time.monotonic()
    tr = _run(model, prompt, "runtime.topology=colocated", "runtime.pack_layers=2", "runtime.on_late=stale",
              "runtime.peer_deadline_s=0.3", hooks=CacheHooks(stall_from_step=6), new=NEW,
              on_token=lambda i, _: time.sleep(0.05) or False)  # steps of >= 50 ms: the silence is seen
    assert time.monotonic() - t0 < 30
    assert all(len(r) == NEW for r in tr.tokens)
    lost, back = tr.stats["events"][:2]
    assert lost["event"] == "peer_lost" and "peer_deadline_s=0.3" in lost["reason"]
    assert back["event"] == "peer_restored"
    assert per_step_attended[back["step"]:] == unfaulted[1][back["step"]:]


# ----------------------------------------------------------------------------- a faulty transport
class FaultyTransport:
    """The inference rank's end of a link, with faults: ``delay_s`` before each
    arriving selection, ``drop_from_step``: selections for that step and later never
    arrive (the cache rank is alive: only silence tells), ``close_at_qkv``: the n-th
    q/k/v send closes the link half-way (the first tensors sent, then an error)."""

    def __init__(self, inner, *, delay_s=0.0, drop_from_step=None, close_at_qkv=None):
        self.inner, self.delay_s, self.drop_from_step, self.close_at_qkv = inner, delay_s, drop_from_step, close_at_qkv
        self.qkv = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        if name in ("inner", "delay_s", "drop_from_step", "close_at_qkv", "qkv"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    async def send(self, tag, tensors):
        if tag == "qkv":
            self.qkv += 1
            if self.close_at_qkv is not None and self.qkv == self.close_at_qkv:
                await self.inner.close()
                raise TransportError("faulty transport: closed in the middle of a message")
        return await self.inner.send(tag, tensors)

    async def recv(self, tag, *a, **kw):
        while True:
            msg = await self.inner.recv(tag, *a, **kw)
            if tag != "sel":
                return msg
            step = int(msg[0][0, 1])
            if self.drop_from_step is not None and step >= self.drop_from_step and int(msg[0][0, 0]) >= 0:
                continue
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            return msg


def _faulty_runtime(model, monkeypatch, *over, **faults):
    """A colocated runtime whose first link's inference end is a FaultyTransport
    (links opened later, by a restart, are plain)."""
    cfg = config("runtime.topology=colocated", "runtime.pack_layers=2", *over)
    rt = AsyncRuntime(cfg, model, build_policy(cfg.policy, model.spec))
    real, opened = AsyncRuntime.link, []

    async def link(self):
        fresh = self._link is None or self._link.closed
        ln = await real(self)
        if fresh and not opened:
            ln.transport = FaultyTransport(ln.transport, **faults)
        if fresh:
            opened.append(ln)
        return ln

    monkeypatch.setattr(AsyncRuntime, "link", link)
    return rt, opened


def test_transport_delay_under_wait_keeps_the_tokens(model, prompt, monkeypatch, unfaulted):
    rt, _ = _faulty_runtime(model, monkeypatch, *DEADLINE, delay_s=0.02)
    try:
        tr = rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)
    finally:
        rt.close()
    assert tr.tokens == unfaulted[0] and tr.stats["events"] == []


def test_transport_drops_selections(model, prompt, monkeypatch, per_step_attended, unfaulted):
    """Selections stop arriving (the cache rank lives): under wait each late pack waits
    late_timeout_s at most, the silence past peer_deadline_s is a loss, and the new
    link is sparse again."""
    rt, opened = _faulty_runtime(model, monkeypatch, "runtime.peer_deadline_s=0.6", "runtime.late_timeout_s=0.25",
                                 drop_from_step=7)
    t0 = time.monotonic()
    try:
        tr = rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)
    finally:
        rt.close()
    assert time.monotonic() - t0 < 30
    assert all(len(r) == NEW for r in tr.tokens) and len(opened) == 2
    lost, back = tr.stats["events"]
    # step 7's two packs each wait late_timeout_s (0.25 s) and run dense; the silence
    # passes peer_deadline_s (0.6 s) in step 8's first wait
    assert tr.stats["timed_out_packs"] == 2
    assert lost["event"] == "peer_lost" and lost["step"] == 8 and "peer_deadline_s=0.6" in lost["reason"]
    assert back["event"] == "peer_restored" and back["step"] == 9
    assert per_step_attended[9:] == unfaulted[1][9:]


def test_transport_closes_mid_message(model, prompt, monkeypatch, unfaulted):
    rt, opened = _faulty_runtime(model, monkeypatch, *DEADLINE, close_at_qkv=2 * 6 + 1)  # step 7's first pack
    try:
        tr = rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)
    finally:
        rt.close()
    assert all(len(r) == NEW for r in tr.tokens) and len(opened) == 2
    lost, back = tr.stats["events"]
    assert lost["event"] == "peer_lost" and lost["step"] == 7 and "closed in the middle" in lost["reason"]
    assert back["event"] == "peer_restored" and back["step"] == 8
    assert [r[:7] for r in tr.tokens] == [r[:7] for r in unfaulted[0]]

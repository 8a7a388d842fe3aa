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
from tests.runtime.conftest import B, BUDGET, NEW, T, config, free_port, greedy

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


def _fds() -> tuple[int, set[str]]:
    """(open file descriptors, the inodes of those that are sockets)."""
    n, sockets = 0, set()
    for f in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{f}")
        except OSError:
            continue
        n += 1
        if link.startswith("socket:"):
            sockets.add(link[len("socket:["):-1])
    return n, sockets


def _describe_sockets(inodes: set[str]) -> str:
    """Each socket inode's line in /proc/net/* (kind, addresses, unix path): for a leak's message."""
    found = {}
    for kind in ("unix", "tcp", "tcp6", "udp", "udp6", "netlink"):
        try:
            with open(f"/proc/net/{kind}") as f:
                for line in f.readlines()[1:]:
                    parts = line.split()
                    for i in inodes & set(parts):
                        found[i] = f"{kind}: {' '.join(parts)}"
        except OSError:
            pass
    return "; ".join(found.get(i, f"{i}: not in /proc/net") for i in sorted(inodes))


class Leaks:
    """Processes, file descriptors and threads before and after (closing the runtime).
    ``fds=False``: processes and threads only (see ``test_sigkill_of_the_cache_process_is_restarted``)."""

    def __init__(self, fds: bool = True):
        self.check_fds = fds

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
        if not self.check_fds:
            return
        n, sockets = _fds()
        extra = sockets - self.fds[1]
        assert len(sockets) <= len(self.fds[1]), f"sockets: {len(self.fds[1])} before, {len(sockets)} after: {_describe_sockets(extra)}"
        # (the first multiprocess link of a process opens a few pipes for good: lazy initialisation)
        assert n <= self.fds[0] + 4, f"file descriptors: {self.fds[0]} before, {n} after"


@pytest.fixture
def per_step_attended(monkeypatch):
    """Tokens attended by each decode step (summed over layers, rows and KV heads):
    the context's device counters read after every step (CPU: no sync cost)."""
    record: list[int] = []
    monkeypatch.setattr(InferenceSession, "step", _recording_step(record))
    return record


def _recording_step(record: list[int]):
    """``InferenceSession.step`` that appends each step's tokens attended to ``record``."""
    real = InferenceSession.step

    async def step(self, tokens):
        before = int(self.ctx.stats[:, 0].sum())
        out = await real(self, tokens)
        record.append(int(self.ctx.stats[:, 0].sum()) - before)
        return out

    return step


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
    InferenceSession.step = _recording_step(rec)
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

    async def link(self, **kw):
        fresh = self._link is None or self._link.closed
        ln = await real(self, **kw)
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
    # step 7's packs wait late_timeout_s (0.25 s) each and run dense, until the answer
    # owed since step 6's post is 0.6 s late (in step 7 or 8: host timing)
    assert tr.stats["timed_out_packs"] >= 1
    assert lost["event"] == "peer_lost" and lost["step"] in (7, 8) and "peer_deadline_s=0.6" in lost["reason"]
    assert back["event"] == "peer_restored" and back["step"] == lost["step"] + 1
    assert per_step_attended[back["step"]:] == unfaulted[1][back["step"]:]


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


# ----------------------------------------------------------------------------- a cache process
LONG = 400  # decode steps available to the multiprocess tests (a restart spawns a process: seconds)


@pytest.fixture(scope="module")
def long_model():
    from spade.models.fast import FastModel
    from spade.models.presets import preset_config

    torch.manual_seed(1234)
    return FastModel.from_config(preset_config("tiny"), device="cpu", dtype=torch.float32, max_batch=B,
                                 max_seq_len=T + LONG + 8)


class Paced:
    """Decode steps of at least ``dt`` seconds (an asyncio sleep: the restart keeps
    running beside them); ``on_token`` does ``action(i, session)`` and stops the
    generation ``after`` steps past the restore."""

    def __init__(self, monkeypatch, dt=0.05, after=4, action=None):
        self.sess, self.action, self.after, self.stop_at = None, action, after, None
        real = InferenceSession.step

        async def step(s, tokens):
            self.sess = s
            await asyncio.sleep(dt)
            return await real(s, tokens)

        monkeypatch.setattr(InferenceSession, "step", step)

    def on_token(self, i, _):
        if self.action is not None and self.sess is not None:
            self.action(i, self.sess)
        if self.stop_at is None and self.sess is not None:
            if any(e["event"] == "peer_restored" for e in self.sess.events):
                self.stop_at = i + self.after
        return self.stop_at is not None and i >= self.stop_at


def _port(name: str) -> str:
    return (f"runtime.transport.master_port={free_port()}" if name == "nccl"
            else f"runtime.transport.port={free_port()}")


def _mp(name: str, *over: str):
    from spade.transports import availability

    ok, why = availability()[name]
    if not ok:
        pytest.skip(f"transport {name!r} is not usable here: {why}")
    return ("runtime.topology=multiprocess", f"runtime.transport.name={name}", _port(name),
            "runtime.transport.timeout_s=30", "runtime.pack_layers=2", *over)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_sigkill_of_the_cache_process_is_restarted(long_model, prompt, monkeypatch):
    """ucx: SIGKILL at a seeded random step: the loss is survived densely, a new process
    connects over the same transport and port, boots from the inference rank's cache,
    and the generation is sparse again; no process, thread or file descriptor is left
    over (ucx kept its lost worker's descriptors before: docs/reliability.md)."""
    die = random.Random(25).randint(3, 8)
    killed = []

    def kill(i, sess):
        if i == die and not killed:
            killed.append(sess.link.proc.pid)
            os.kill(sess.link.proc.pid, signal.SIGKILL)

    paced = Paced(monkeypatch, action=kill)
    t0 = time.monotonic()
    with Leaks():
        tr = _run(long_model, prompt, *_mp("ucx", *DEADLINE), new=LONG, on_token=paced.on_token)
    assert time.monotonic() - t0 < 90
    lost, back = tr.stats["events"][:2]
    assert lost["event"] == "peer_lost" and lost["step"] >= die
    assert back["event"] == "peer_restored", tr.stats["events"]
    n = len(tr.tokens[0])
    assert all(len(r) == n for r in tr.tokens) and n < LONG  # stopped a few steps after the restore
    assert tr.stats["dense_fallback"][0][0] in (lost["step"], lost["step"] + 1)
    assert tr.stats["dense_fallback"][-1][1] == back["step"] - 1
    assert tr.stats["sparse_steps"] > 0 and _gone(killed[0])


def test_cache_process_dies_during_its_boot(long_model, prompt, monkeypatch):
    """nccl (gloo): the cache process exits on the first layer of its boot; decoding
    starts densely and a new process takes over."""
    paced = Paced(monkeypatch)
    with Leaks():
        tr = _run(long_model, prompt, *_mp("nccl", *DEADLINE), hooks=CacheHooks(die_at_boot_layer=0), new=LONG,
                  on_token=paced.on_token)
    lost, back = tr.stats["events"][:2]
    assert lost["event"] == "peer_lost" and lost["step"] == 0 and back["event"] == "peer_restored"


def test_sigstop_shorter_than_the_deadlines_changes_nothing(model, prompt, inline_tokens):
    """SIGSTOP for 0.8 s at step 5 under wait (late_timeout_s 20, peer_deadline_s 30):
    the tokens are the inline run's."""
    cfg = config(*_mp("nccl", "runtime.late_timeout_s=20", "runtime.peer_deadline_s=30"))
    rt = AsyncRuntime(cfg, model, build_policy(cfg.policy, model.spec))

    def pause(i, _):
        if i == 5:
            pid = rt._link.proc.pid
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(0.8, os.kill, (pid, signal.SIGCONT)).start()
        return False

    try:
        with Leaks():
            tr = rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy, on_token=pause)
            rt.close()
    finally:
        rt.close()
    assert tr.tokens == inline_tokens and tr.stats["events"] == []
    assert tr.stats["wait_s"] > 0.3


def test_sigstop_longer_than_the_deadline_is_a_loss(long_model, prompt, monkeypatch):
    """nixl: SIGSTOP for good at step 5: the silence past peer_deadline_s is a loss, the
    stopped process is killed (not left stopped), and a new one takes over."""
    stopped = []

    def stop(i, sess):
        if i == 5 and not stopped:
            stopped.append(sess.link.proc.pid)
            os.kill(sess.link.proc.pid, signal.SIGSTOP)

    paced = Paced(monkeypatch, action=stop)
    with Leaks():
        tr = _run(long_model, prompt, *_mp("nixl", *DEADLINE), new=LONG, on_token=paced.on_token)
    ev = tr.stats["events"]
    # (a selection owed past the deadline, or a send blocked past it)
    assert ev[0]["event"] == "peer_lost" and "peer_deadline_s=1.5" in ev[0]["reason"], ev
    # restored (on a busy box the new process's boot send once missed the 1.5 s deadline
    # too: one more loss, restarted again)
    assert ev[-1]["event"] == "peer_restored", ev
    assert _gone(stopped[0])


def test_killed_inference_process_leaves_no_orphan(tmp_path):
    """The inference process is SIGKILLed mid-generation: its cache process exits on
    its own (it watches its parent)."""
    script = tmp_path / "inf.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time, torch
        sys.path.insert(0, {os.getcwd()!r})
        torch.set_num_threads(1)
        from tests.runtime.conftest import config, greedy
        from spade.models.fast import FastModel
        from spade.models.presets import preset_config
        from spade.policies import build_policy
        from spade.runtime.asyncrt import AsyncRuntime
        m = FastModel.from_config(preset_config("tiny"), device="cpu", dtype=torch.float32, max_batch=1,
                                  max_seq_len=400)
        cfg = config("runtime.topology=multiprocess", "runtime.transport.name=nccl",
                     "runtime.transport.master_port={free_port()}")
        rt = AsyncRuntime(cfg, m, build_policy(cfg.policy, m.spec))
        ids = torch.randint(3, 500, (1, 12))
        def tick(i, _):
            if i == 3:
                print(rt._link.proc.pid, flush=True)
            time.sleep(0.05)
            return False
        rt.generate(ids, torch.ones_like(ids), max_new_tokens=300, sample_fn=greedy, on_token=tick)
    """))
    env = {**os.environ, "SPADE_KERNELS": "torch", "TRITON_INTERPRET": "1"}
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env)
    try:
        cache_pid = int(p.stdout.readline())
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        end = time.monotonic() + 15
        while time.monotonic() < end and not _gone(cache_pid):
            time.sleep(0.1)
        assert _gone(cache_pid), "the cache process outlived its inference process"
    finally:
        if p.poll() is None:
            p.kill()
        p.stdout.close()


def test_under_torchrun_a_lost_cache_rank_is_not_restarted(model, prompt, monkeypatch):
    """torchrun's environment (this process rank 0, rank 1 started the way torchrun
    would: ``python -m spade.runtime.worker`` with RANK=1): the launcher owns rank 1, so
    its loss is survived densely with one ``no_restart`` event and nothing is spawned."""
    port = free_port()
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for k, v in {**env, "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    worker = subprocess.Popen([sys.executable, "-m", "spade.runtime.worker", "--device", "cpu", "--threads", "1"],
                              env={**os.environ, **env, "RANK": "1", "LOCAL_RANK": "1"})
    cfg = config("runtime.topology=multiprocess", "runtime.transport.name=nccl",
                 f"runtime.transport.master_port={port}", "runtime.transport.timeout_s=30", *DEADLINE)
    rt = AsyncRuntime(cfg, model, build_policy(cfg.policy, model.spec))

    def kill(i, _):
        if i == 5:
            worker.kill()
        return False

    try:
        kids = _children()
        tr = rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy, on_token=kill)
        assert _children() <= kids  # nothing spawned
    finally:
        rt.close()
        worker.kill()
        worker.wait(10)
    assert all(len(r) == NEW for r in tr.tokens)
    assert [e["event"] for e in tr.stats["events"]] == ["peer_lost", "no_restart"]
    assert "torchrun" in tr.stats["events"][1]["reason"]
    assert tr.stats["dense_fallback"][-1][1] == NEW - 1


# ----------------------------------------------------------------------------- a cache process lost between generations
def _kill_between_generations(rt) -> None:
    pid = rt._link.proc.pid
    os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < end:
        time.sleep(0.05)


def test_a_restarted_cache_process_meets_on_a_free_port(long_model, prompt, monkeypatch):
    """nccl (gloo): the cache process dies between two generations and the lost link
    keeps its port (as a dead peer's NCCL communicator keeps the store's on a GPU: the
    restart failed with EADDRINUSE there): the new process meets on free ports, and the
    next generation is sparse."""
    import socket

    from spade.runtime.link import CacheLink

    cfg = config(*_mp("nccl", *DEADLINE))
    port = cfg.runtime.transport.master_port
    held: list[socket.socket] = []
    real_abandon = CacheLink.abandon

    async def abandon(self, *a, **kw):  # the lost link's port stays taken after it is dropped
        await real_abandon(self, *a, **kw)
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("", port))
        s.listen(1)
        held.append(s)

    monkeypatch.setattr(CacheLink, "abandon", abandon)
    rt = AsyncRuntime(cfg, long_model, build_policy(cfg.policy, long_model.spec))
    try:
        with Leaks():
            rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)
            _kill_between_generations(rt)
            paced = Paced(monkeypatch)  # (found at the start, or on the boot's first send: restored mid-generation)
            tr = rt.generate(*prompt, max_new_tokens=LONG, sample_fn=greedy, on_token=paced.on_token)
            new_port = rt._link.transport.cfg.master_port
            rt.close()
            for s in held:  # (the test's own socket: not a leak)
                s.close()
    finally:
        rt.close()
        for s in held:
            s.close()
    assert held and new_port != port
    assert "restart_failed" not in _kinds(tr), tr.stats["events"]
    assert tr.stats["sparse_steps"] > 0 and tr.stats["peers_lost"] == len(_kinds(tr)) // 2


def test_a_cache_rank_that_does_not_come_back_is_retried_not_lost(long_model, prompt, monkeypatch):
    """nccl (gloo): the cache process dies between two generations and its successor
    fails to come up: the next generation is not lost; it starts dense and its
    supervisor brings a cache rank up mid-generation; sparse from there."""
    from spade.errors import PeerTimeout
    from spade.runtime.link import CacheLink

    real_open = CacheLink.open.__func__
    failed: list[int] = []

    async def open_(cls, *a, restart=False, **kw):
        if restart and not failed:
            failed.append(1)
            raise PeerTimeout("injected: the new cache process did not connect")
        return await real_open(cls, *a, restart=restart, **kw)

    cfg = config(*_mp("nccl", *DEADLINE))
    rt = AsyncRuntime(cfg, long_model, build_policy(cfg.policy, long_model.spec))
    t0 = time.monotonic()
    try:
        with Leaks():
            rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)
            _kill_between_generations(rt)
            monkeypatch.setattr(CacheLink, "open", classmethod(open_))
            paced = Paced(monkeypatch)
            tr = rt.generate(*prompt, max_new_tokens=LONG, sample_fn=greedy, on_token=paced.on_token)
            rt.close()
    finally:
        rt.close()
    assert time.monotonic() - t0 < 90
    # found dead at the start (restart_failed first), or on the boot's first send (peer_lost first)
    kinds = _kinds(tr)
    assert failed and kinds in (["restart_failed", "peer_restored"], ["peer_lost", "restart_failed", "peer_restored"]), \
        tr.stats["events"]
    n = len(tr.tokens[0])
    assert all(len(r) == n for r in tr.tokens) and n < LONG  # stopped a few steps after the restore
    assert tr.stats["sparse_steps"] > 0 and tr.stats["restarts"] == 1


# ----------------------------------------------------------------------------- a spare cache process
@pytest.mark.parametrize("transport", ["nccl", "ucx", "nixl"])
def test_standby_takes_over_a_killed_cache_process(long_model, prompt, monkeypatch, transport):
    """runtime.standby (nccl: gloo): a spare cache process is spawned and connected
    beside the live one. The live one is SIGKILLed once the spare is up: the spare takes
    over (the link's process is the spare's; a boot, no spawn), a new spare is spawned
    behind it, sparse from the restore, and nothing is left after close."""
    cfg = config(*_mp(transport, *DEADLINE, "runtime.standby=true"))
    rt = AsyncRuntime(cfg, long_model, build_policy(cfg.policy, long_model.spec))
    seen: dict = {}

    def kill(i, sess):
        spare = rt.standby_pid()
        if i >= 3 and spare is not None and "killed" not in seen:
            seen["killed"], seen["spare"] = sess.link.proc.pid, spare
            os.kill(sess.link.proc.pid, signal.SIGKILL)

    paced = Paced(monkeypatch, dt=0.1, action=kill)
    try:
        with Leaks():
            tr = rt.generate(*prompt, max_new_tokens=LONG, sample_fn=greedy, on_token=paced.on_token)
            live = rt._link.proc.pid
            again = rt._standby is not None
            rt.close()
    finally:
        rt.close()
    assert "killed" in seen, "the spare cache process did not come up within the generation"
    lost, back = tr.stats["events"][:2]
    assert lost["event"] == "peer_lost" and back["event"] == "peer_restored", tr.stats["events"]
    assert live == seen["spare"] and live != seen["killed"] and _gone(seen["killed"])
    assert again  # a new spare behind the one taken
    assert back["degraded_s"] < 5.0, back  # a boot over a connected link (a spawn: 6-16 s here)
    assert tr.stats["sparse_steps"] > 0 and tr.stats["dense_fallback"][-1][1] == back["step"] - 1


def test_standby_needs_a_cache_process():
    from spade.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match="runtime.standby"):
        config("runtime.topology=colocated", "runtime.standby=true")

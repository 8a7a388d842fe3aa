"""The transport contract (spade/transports/base.py), one suite for every transport.

Every registered transport runs these tests unchanged: ``local`` (both endpoints
in one process: in-process by definition), ``nccl`` (gloo on CPU), ``ucx`` and
``nixl`` (one spawned process per rank: rank 0 "inference", rank 1 "cache", so a
rank can be killed for real). A transport is skipped only when
``Transport.available()`` says it cannot run here, and the skip names why.

The scenarios themselves live in ``_peer.py``; this file starts the helper
processes (once per transport), hands them scenarios, and turns their failures
and hangs into test failures. Every scenario has a wall-clock bound, so a
transport that hangs fails the test instead of blocking the run.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import wait as mp_wait

import pytest
import torch

from spade.transports._framing import free_port, port_in_use
from tests.transports import _peer

TRANSPORT_NAMES = ["local", "nccl", "ucx", "nixl"]
#: Transports whose two endpoints live in one process.
IN_PROCESS = {"local"}
#: The transports' own timeout (connect, send) in the scenarios.
TIMEOUT_S = 60.0  # generous: a 64 MiB message over UCX-TCP on a busy 2-core CI box
#: Wall-clock bound of one scenario, start to finish, both ranks.
SCENARIO_LIMIT_S = 120.0
#: Start-up bound of a helper process (imports torch: seconds on a slow CI box).
SPAWN_LIMIT_S = 120.0

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


class Pair:
    """The helper processes of one transport: one per rank, or one for both ranks."""

    def __init__(self, name: str):
        self.name = name
        self.ctx = mp.get_context("spawn")
        self.rank_sets = [(0, 1)] if name in IN_PROCESS else [(0,), (1,)]
        self.workers: list = [None] * len(self.rank_sets)
        self.ok, self.why = True, "ok"
        started = [self._start(i) for i in range(len(self.rank_sets))]  # in parallel
        for i, (proc, conn) in enumerate(started):
            self._ready(i, proc, conn)

    def _start(self, i: int):
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_peer.worker_main, args=(child, self.name, self.rank_sets[i]),
                                daemon=True, name=f"contract-{self.name}-{i}")
        proc.start()
        child.close()
        return proc, parent

    def _ready(self, i: int, proc, parent) -> None:
        if not parent.poll(SPAWN_LIMIT_S):
            proc.kill()
            raise RuntimeError(f"{self.name}: helper process did not start in {SPAWN_LIMIT_S:.0f} s")
        _, ok, why = parent.recv()
        self.ok, self.why = self.ok and ok, why if not ok else self.why
        self.workers[i] = (proc, parent)

    def _spawn(self, i: int) -> None:
        self._ready(i, *self._start(i))

    def _kill(self, i: int) -> None:
        proc, conn = self.workers[i]
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        conn.close()

    def run(self, scenario: str, device: str = "cpu", *, may_die: tuple[int, ...] = (), **params) -> dict:
        """Run ``scenario`` on both ranks; returns {rank: result}. A worker in
        ``may_die`` (by index) is expected to exit and is replaced. A port taken
        between ``free_port`` and the listener (another process on a busy CI box)
        gets one more try on a fresh port."""
        try:
            return self._run(scenario, device, may_die=may_die, **params)
        except pytest.fail.Exception as e:
            msg = str(e)
            if not any(m in msg for m in ("cannot listen on port", " in use on ", "EADDRINUSE", "Address already in use")):
                raise
        return self._run(scenario, device, may_die=may_die, **params)

    def _run(self, scenario: str, device: str, *, may_die: tuple[int, ...], **params) -> dict:
        port = free_port()
        for _ in range(64):  # nccl's links also listen on port + 1: both must be free
            if port + 1 < 65536 and port_in_use(port + 1) is None:
                break
            port = free_port()
        for _, conn in self.workers:
            conn.send((scenario, port, device, TIMEOUT_S, params))
        pending = {conn: i for i, (_, conn) in enumerate(self.workers)}
        results: dict = {}
        errors: list[str] = []
        deadline = time.monotonic() + SCENARIO_LIMIT_S
        while pending:
            ready = mp_wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                for i in list(pending.values()):
                    self._kill(i)
                    self._spawn(i)
                hung = [self.rank_sets[i] for i in pending.values()]
                pytest.fail(f"{self.name}/{scenario}: rank(s) {hung} hung for {SCENARIO_LIMIT_S:.0f} s"
                            + (f"; the others said: {errors}" if errors else ""))
            for conn in ready:
                i = pending.pop(conn)
                try:
                    msg = conn.recv()
                except EOFError:
                    self._kill(i)
                    self._spawn(i)
                    if i not in may_die:
                        errors.append(f"rank(s) {self.rank_sets[i]}: helper process died")
                    continue
                if msg[0] == "ok":
                    results.update(msg[1])
                else:
                    errors.append(f"rank(s) {self.rank_sets[i]}: {msg[1]}\n{msg[2]}")
        if errors:
            pytest.fail(f"{self.name}/{scenario}:\n" + "\n".join(errors), pytrace=False)
        return results

    def close(self) -> None:
        for i, w in enumerate(self.workers):
            if w is None:
                continue
            proc, conn = w
            try:
                conn.send(None)
            except OSError:
                pass
        for i, w in enumerate(self.workers):
            if w is not None:
                w[0].join(3)
                self._kill(i)


@pytest.fixture(scope="module", params=TRANSPORT_NAMES)
def pair(request):
    p = Pair(request.param)
    if not p.ok:
        p.close()
        pytest.skip(f"transport {request.param!r} is not usable here: {p.why}")
    yield p
    p.close()


def _need_devices(pair: Pair, device: str) -> None:
    if device == "cuda" and pair.name == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("nccl between two processes needs two GPUs")


@pytest.mark.parametrize("device", DEVICES)
def test_small_messages_into_registered_and_new(pair, device):
    _need_devices(pair, device)
    pair.run("basic", device)


def test_order_within_a_tag_and_tags_independent(pair):
    pair.run("order")


def test_many_messages_in_flight(pair):
    pair.run("inflight")


@pytest.mark.parametrize("device", DEVICES)
def test_large_messages(pair, device):
    _need_devices(pair, device)
    pair.run("large", device)


def test_handshake_refuses_mismatches(pair):
    res = pair.run("handshake")
    for rank in (0, 1):
        assert set(res[rank]["errors"]) == {"dtype", "shape", "version", "role"}


def test_recv_timeout_raises_and_loses_nothing(pair):
    pair.run("timeout")


def test_recv_into_wrong_shape_is_an_error(pair):
    res = pair.run("mismatch")
    assert "4" in res[0]["error"] and "5" in res[0]["error"], res[0]["error"]


def test_peer_closed_raises_peer_gone(pair):
    res = pair.run("peer_closed", recv_timeout=30.0)
    assert res[0]["kind"] == "PeerGone", res[0]
    assert res[0]["send_error"] is not None, "send to a closed peer must raise"


def test_peer_killed_is_noticed_not_a_hang(pair):
    if pair.name in IN_PROCESS:
        pytest.skip(f"{pair.name} is in-process: its peer cannot die separately")
    res = pair.run("peer_killed", may_die=(1,), recv_timeout=30.0)
    assert res[0]["seconds"] < 15.0, res[0]
    assert res[0]["send_error"] is not None, "send to a dead peer must raise"


def test_links_lost_to_dead_peers_leak_nothing(pair):
    """A peer killed again and again (a cache rank restarted N times), each lost link
    aborted and closed: the surviving rank's file descriptors and threads come back to
    what they were after the first loss (ucx kept ~11 descriptors of its worker per
    loss: docs/reliability.md)."""
    if pair.name in IN_PROCESS:
        pytest.skip(f"{pair.name} is in-process: its peer cannot die separately")
    runs = [pair.run("peer_lost_repeatedly", may_die=(1,), recv_timeout=30.0)[0] for _ in range(3)]
    fds, threads = [r["fds"] for r in runs], [r["threads"] for r in runs]
    assert max(fds[1:]) <= fds[0] + 2, f"open file descriptors after each lost link: {fds}"
    assert max(threads[1:]) <= threads[0], f"threads after each lost link: {threads}"


def test_close_releases_everything(pair):
    pair.run("close")


@pytest.mark.parametrize("device", DEVICES)
def test_one_tag_carries_alternating_layouts(pair, device):
    _need_devices(pair, device)
    pair.run("layouts", device)


@pytest.mark.parametrize("device", DEVICES)
def test_one_tag_grows_then_shrinks(pair, device):
    _need_devices(pair, device)
    pair.run("grow_shrink", device)


@pytest.mark.parametrize("device", DEVICES)
def test_many_in_flight_across_a_renegotiation(pair, device):
    _need_devices(pair, device)
    pair.run("reneg", device)

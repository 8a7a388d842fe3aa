"""Helper processes and scenarios of the transport contract suite.

A *scenario* is a pair of coroutines, one per rank (0 = "inference",
1 = "cache"), that drive a real transport through one clause of the contract and
assert on what they see. ``worker_main`` runs in a spawned process and executes
scenarios on command; for ``local`` (in-process by definition) one worker runs
both ranks in one event loop, for every other transport each rank has its own
process, so a rank can be killed for real.

Only ``spade`` public API is used: ``TRANSPORTS``, ``Handshake``, the config
classes and the error types. Nothing here knows a transport's internals.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

ROLES = {0: "inference", 1: "cache"}
#: The handshake layout both ranks agree on in the scenarios.
LAYOUT = {"qkv": [[8, 48, 128], "bfloat16"], "sel": [[8, 8, 64], "int32"]}


# --------------------------------------------------------------------------- helpers
def native_threads() -> int:
    """Threads of this process as the kernel sees them (C++ threads included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: Python threads only
        return threading.active_count()


def make_config(name: str, port: int, timeout_s: float):
    from spade.transports import TRANSPORTS

    if name == "local":
        return TRANSPORTS.config("local")()
    if name == "nccl":
        # gloo on CPU; nccl when both ranks are on CUDA ("auto").
        return TRANSPORTS.config("nccl")(backend="auto", master_port=port, timeout_s=timeout_s)
    if name == "ucx":
        return TRANSPORTS.config("ucx")(port=port, timeout_s=timeout_s)
    if name == "nixl":
        return TRANSPORTS.config("nixl")(port=port, timeout_s=timeout_s)
    raise ValueError(f"no contract config for transport {name!r}")


def pattern(shape, dtype, seed: int, device="cpu"):
    """Deterministic, cheap content that differs at every position (the receiver
    regenerates it to compare): an odd-multiplier hash of the index, in int32."""
    import torch

    n = 1
    for s in shape:
        n *= s
    x = torch.arange(n, dtype=torch.int32).mul_(-1640531535).add_(seed * 40503 + 1)
    x.bitwise_xor_(x >> 13)
    if dtype == torch.bool:
        x = x.bitwise_and_(1).bool()
    elif dtype.is_floating_point:
        x = x.bitwise_and_(4095).sub_(2048).to(dtype)  # the same rounding on both sides
    else:
        x = x.bitwise_and_((1 << (8 * dtype.itemsize - 2)) - 1).to(dtype)
    return x.reshape(shape).to(device)


def same(a, b) -> bool:
    """Bitwise equality of shape, dtype and bytes."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


#: Odd small messages: KB-sized, mixed dtypes and ranks.
def small_layout():
    import torch

    return [((8, 48, 16), torch.bfloat16), ((3, 5), torch.int32), ((1,), torch.float32),
            ((2, 3, 4), torch.int64), ((7,), torch.bool), ((5, 1, 3), torch.float16)]


def make_msg(layout, seed: int, device):
    return [pattern(s, d, seed + 17 * i, device) for i, (s, d) in enumerate(layout)]


def check_msg(got, layout, seed: int, device, what: str) -> None:
    want = make_msg(layout, seed, "cpu")
    assert len(got) == len(want), f"{what}: {len(got)} tensors, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.device.type == device.type, f"{what}: tensor {i} on {g.device}, expected {device}"
        assert same(g, w), f"{what}: tensor {i} differs ({tuple(g.shape)} {g.dtype})"


@dataclass
class Env:
    """What a scenario coroutine gets: its rank, the transport factory, parameters."""

    name: str
    rank: int
    port: int
    device: Any
    timeout_s: float
    multiprocess: bool
    params: dict = field(default_factory=dict)

    def new(self):
        from spade.transports import TRANSPORTS

        cls = TRANSPORTS.get(self.name)
        return cls(make_config(self.name, self.port, self.timeout_s), rank=self.rank, world=2,
                   device=self.device)

    def handshake(self, **kw):
        from spade.transports import Handshake

        kw.setdefault("role", ROLES[self.rank])
        kw.setdefault("layout", LAYOUT)
        return Handshake(**kw)

    async def open(self):
        t = self.new()
        peer = await t.connect(self.handshake())
        assert peer.role == ROLES[1 - self.rank], f"peer role {peer.role!r}"
        assert peer.layout == LAYOUT
        return t

    def die(self) -> None:
        """Kill this process without any cleanup (a crashed rank)."""
        assert self.multiprocess, "an in-process peer cannot die on its own"
        os.kill(os.getpid(), signal.SIGKILL)


# --------------------------------------------------------------------------- scenarios
# Each scenario: (rank 0 coroutine, rank 1 coroutine); each returns a small dict.

async def basic_0(env: Env) -> dict:
    """Small odd messages both ways; recv into given buffers, registered slots, new tensors."""
    import torch

    lay = small_layout()
    t = await env.open()
    try:
        # 1. into=
        into = [torch.empty(s, dtype=d, device=env.device) for s, d in lay]
        got = await t.recv("mixed", into=into, timeout=env.timeout_s)
        assert all(g is b or g.data_ptr() == b.data_ptr() for g, b in zip(got, into)), "recv did not fill `into`"
        check_msg(got, lay, 1, env.device, "recv into=")
        # 2. registered slots
        slots = [torch.empty(s, dtype=d, device=env.device) for s, d in lay]
        t.register("mixed", slots)
        await t.send("ready", [torch.ones(1, device=env.device)])
        got = await t.recv("mixed", timeout=env.timeout_s)
        assert all(g.data_ptr() == b.data_ptr() for g, b in zip(got, slots)), "recv did not fill the registered slots"
        check_msg(got, lay, 2, env.device, "recv into registered slots")
        # 3. the other direction, and new tensors on the receiver
        await t.send("back", make_msg(lay, 3, env.device))
        await t.send("back", make_msg(lay, 4, env.device))
        ack = await t.recv("ack", timeout=env.timeout_s)
        assert int(ack[0].item()) == 2
    finally:
        await t.close()
    return {"ok": True}


async def basic_1(env: Env) -> dict:
    lay = small_layout()
    t = await env.open()
    try:
        await t.send("mixed", make_msg(lay, 1, env.device))
        await t.recv("ready", timeout=env.timeout_s)
        await t.send("mixed", make_msg(lay, 2, env.device))
        got = await t.recv("back", timeout=env.timeout_s)  # no into, nothing registered: new tensors
        check_msg(got, lay, 3, env.device, "recv without into")
        got2 = await t.recv("back", timeout=env.timeout_s)
        check_msg(got2, lay, 4, env.device, "second recv without into")
        assert all(a.data_ptr() != b.data_ptr() for a, b in zip(got, got2)), "new tensors must not alias"
        import torch

        await t.send("ack", [torch.full((1,), 2, dtype=torch.int64, device=env.device)])
    finally:
        await t.close()
    return {"ok": True}


N_ORDER = 200
N_AB = 40


async def order_0(env: Env) -> dict:
    """Ordering within a tag: sequential sends; two tags sent from concurrent tasks."""
    import torch

    t = await env.open()
    try:
        for i in range(N_ORDER):
            await t.send("ord", [torch.tensor([i, i * i], dtype=torch.int64, device=env.device)])

        async def stream(tag: str, base: int):
            for i in range(N_AB):
                await t.send(tag, [torch.full((16,), base + i, dtype=torch.int32, device=env.device)])

        await asyncio.wait_for(asyncio.gather(stream("a", 1000), stream("b", 2000)), 4 * env.timeout_s)
        await t.recv("done", timeout=env.timeout_s)
    finally:
        await t.close()
    return {"ok": True}


async def order_1(env: Env) -> dict:
    import torch

    t = await env.open()
    try:
        buf = [torch.empty(2, dtype=torch.int64, device=env.device)]
        for i in range(N_ORDER):
            got = await t.recv("ord", into=buf, timeout=env.timeout_s)
            assert got[0].tolist() == [i, i * i], f"message {i} of 'ord' arrived as {got[0].tolist()}"
        # Every 'b' first, then every 'a': one tag must not wait behind another.
        for tag, base in (("b", 2000), ("a", 1000)):
            for i in range(N_AB):
                got = await t.recv(tag, timeout=env.timeout_s)
                assert int(got[0][0]) == base + i and bool((got[0] == base + i).all()), \
                    f"message {i} of {tag!r} arrived as {got[0].tolist()}"
        await t.send("done", [torch.zeros(1, device=env.device)])
    finally:
        await t.close()
    return {"ok": True}


N_FLIGHT = 64


async def inflight_0(env: Env) -> dict:
    """64 sends in flight before the first recv is posted; all arrive, in order."""
    import torch

    t = await env.open()
    try:
        msgs = [[pattern((256,), torch.float32, i, env.device)] for i in range(N_FLIGHT)]  # 1 KiB each
        mids = [[pattern((64, 256), torch.float32, 100 + i, env.device)] for i in range(8)]  # 64 KiB each
        tasks = [asyncio.ensure_future(t.send("flight", m)) for m in msgs]
        tasks += [asyncio.ensure_future(t.send("flight_mid", m)) for m in mids]
        await asyncio.sleep(0)
        await t.send("posted", [torch.ones(1, device=env.device)])
        await asyncio.wait_for(asyncio.gather(*tasks), 4 * env.timeout_s)
        await t.recv("done", timeout=env.timeout_s)
    finally:
        await t.close()
    return {"ok": True}


async def inflight_1(env: Env) -> dict:
    import torch

    t = await env.open()
    try:
        await t.recv("posted", timeout=env.timeout_s)
        await asyncio.sleep(0.3)  # the sender's 64 messages are all outstanding now
        buf = [torch.empty(256, dtype=torch.float32, device=env.device)]
        for i in range(N_FLIGHT):
            got = await t.recv("flight", into=buf, timeout=env.timeout_s)
            assert same(got[0], pattern((256,), torch.float32, i)), f"in-flight message {i} wrong or out of order"
        for i in range(8):
            got = await t.recv("flight_mid", timeout=env.timeout_s)
            assert same(got[0], pattern((64, 256), torch.float32, 100 + i)), f"64 KiB message {i} wrong"
        await t.send("done", [torch.zeros(1, device=env.device)])
    finally:
        await t.close()
    return {"ok": True}


LARGE_A = ((16, 1024, 1024), "float32")  # 64 MiB
LARGE_B = ((32, 1024, 1024), "bfloat16")  # 64 MiB


def _dt(name):
    import torch

    return getattr(torch, name)


async def large_0(env: Env) -> dict:
    """One 64 MiB message each way (plus a small tensor in the same message)."""
    import torch

    t = await env.open()
    try:
        (sa, da), (sb, db) = LARGE_A, LARGE_B
        await t.send("big", [pattern(sa, _dt(da), 7, env.device), pattern((3,), torch.int32, 8, env.device)])
        into = [torch.empty(sb, dtype=_dt(db), device=env.device)]
        got = await t.recv("big_back", into=into, timeout=env.timeout_s)
        assert same(got[0], pattern(sb, _dt(db), 9)), "64 MiB bf16 message differs"
        await t.send("big_ack", [torch.zeros(1, device=env.device)])
    finally:
        await t.close()
    return {"ok": True}


async def large_1(env: Env) -> dict:
    import torch

    t = await env.open()
    try:
        (sa, da), (sb, db) = LARGE_A, LARGE_B
        slots = [torch.empty(sa, dtype=_dt(da), device=env.device), torch.empty(3, dtype=torch.int32, device=env.device)]
        t.register("big", slots)
        got = await t.recv("big", timeout=env.timeout_s)
        assert same(got[0], pattern(sa, _dt(da), 7)), "64 MiB float32 message differs"
        assert same(got[1], pattern((3,), torch.int32, 8))
        await t.send("big_back", [pattern(sb, _dt(db), 9, env.device)])
        # close only once the peer has it: UCX's endpoint close aborts the connection, and
        # 64 MiB still in the TCP stack when a sender closes right after its send completed
        # was lost about one run in three (the runtime itself ends every generation with an
        # END / acknowledgement exchange before any close: docs/transports.md)
        await t.recv("big_ack", timeout=env.timeout_s)
    finally:
        await t.close()
    return {"ok": True}


def _bad_handshakes(env: Env):
    """The three refusals: (label, handshake kwargs of this rank, word the error names)."""
    from spade.transports import WIRE_VERSION

    other = {"qkv": [[8, 48, 128], "float16"], "sel": LAYOUT["sel"]}
    return [
        ("dtype", {"layout": other} if env.rank == 1 else {}, "qkv"),
        ("shape", {"layout": {**LAYOUT, "sel": [[8, 8, 32], "int32"]}} if env.rank == 1 else {}, "sel"),
        ("version", {"version": WIRE_VERSION + 1} if env.rank == 1 else {}, "version"),
        ("role", {"role": "cache"}, "role"),
    ]


async def handshake_both(env: Env) -> dict:
    """Mismatched layouts, versions and roles are refused on both ranks with a clear
    TransportError; afterwards the same port serves a good connection."""
    from spade.errors import PeerTimeout, TransportError

    seen = {}
    for label, kw, word in _bad_handshakes(env):
        t = env.new()
        try:
            await t.connect(env.handshake(**kw))
        except PeerTimeout as e:
            raise AssertionError(f"{label}: handshake mismatch surfaced as a timeout: {e}") from None
        except TransportError as e:
            seen[label] = str(e)
            assert word in str(e), f"{label}: the error should name {word!r}: {e}"
        else:
            raise AssertionError(f"{label}: a mismatched handshake was accepted")
        finally:
            await t.close()
            await t.close()  # idempotent, also after a failed connect
    t = await env.open()  # the same port, right after the refusals
    try:
        import torch

        if env.rank == 0:
            await t.send("hi", [torch.arange(4, device=env.device)])
        else:
            got = await t.recv("hi", timeout=env.timeout_s)
            assert got[0].tolist() == [0, 1, 2, 3]
    finally:
        await t.close()
    return {"errors": seen}


async def timeout_0(env: Env) -> dict:
    """recv past its timeout raises PeerTimeout, and loses nothing: the next recv of
    the tag gets the next message."""
    import torch

    from spade.errors import PeerTimeout

    t = await env.open()
    try:
        buf = [torch.full((4,), -1, dtype=torch.int32, device=env.device)]
        for timeout in (0.3, 0.2):
            t0 = time.monotonic()
            try:
                await t.recv("idle", into=buf, timeout=timeout)
            except PeerTimeout:
                pass
            else:
                raise AssertionError("recv returned with nothing sent")
            dt = time.monotonic() - t0
            assert timeout * 0.9 <= dt < timeout + 2.0, f"timeout {timeout} s raised after {dt:.3f} s"
        assert buf[0].tolist() == [-1, -1, -1, -1], "a timed-out recv wrote into its buffers"
        await t.send("go", [torch.ones(1, device=env.device)])
        got = await t.recv("idle", into=buf, timeout=env.timeout_s)
        assert got[0].tolist() == [10, 11, 12, 13], f"after timeouts got {got[0].tolist()}"
        got = await t.recv("idle", into=buf, timeout=env.timeout_s)
        assert got[0].tolist() == [20, 21, 22, 23]
        await t.send("done", [torch.ones(1, device=env.device)])
    finally:
        await t.close()
    return {"ok": True}


async def timeout_1(env: Env) -> dict:
    import torch

    t = await env.open()
    try:
        await t.recv("go", timeout=env.timeout_s)
        await t.send("idle", [torch.arange(10, 14, dtype=torch.int32, device=env.device)])
        await t.send("idle", [torch.arange(20, 24, dtype=torch.int32, device=env.device)])
        await t.recv("done", timeout=env.timeout_s)
    finally:
        await t.close()
    return {"ok": True}


async def mismatch_0(env: Env) -> dict:
    """recv into buffers of the wrong shape raises TransportError (not a timeout, not
    silent corruption) on the receiver."""
    import torch

    from spade.errors import PeerTimeout, TransportError

    t = await env.open()
    try:
        wrong = [torch.empty(4, 5, dtype=torch.float32, device=env.device)]
        t0 = time.monotonic()
        try:
            await t.recv("mm", into=wrong, timeout=env.timeout_s)
        except PeerTimeout as e:
            raise AssertionError(f"a shape mismatch surfaced as a timeout: {e}") from None
        except TransportError as e:
            msg = str(e)
        else:
            raise AssertionError("recv into a [4, 5] buffer accepted a [4, 4] message")
        assert time.monotonic() - t0 < env.timeout_s / 2
        await t.send("seen", [torch.ones(1, device=env.device)])
    finally:
        await t.close()
    return {"error": msg}


async def mismatch_1(env: Env) -> dict:
    import torch

    from spade.errors import TransportError

    t = await env.open()
    sender_error = None
    try:
        try:
            await t.send("mm", [torch.zeros(4, 4, dtype=torch.float32, device=env.device)])
        except TransportError as e:  # transports that know the receiver's layout refuse here
            sender_error = str(e)
        await t.recv("seen", timeout=env.timeout_s)
    finally:
        await t.close()
    return {"sender_error": sender_error}


async def _expect_gone(t, env: Env) -> dict:
    import torch

    from spade.errors import PeerGone, TransportError

    t0 = time.monotonic()
    try:
        await t.recv("never", timeout=env.params["recv_timeout"])
    except TransportError as e:
        kind, msg = type(e).__name__, str(e)
    else:
        raise AssertionError("recv returned from a peer that is gone")
    dt = time.monotonic() - t0
    # A transport must notice a dead peer, not just run into the recv timeout.
    assert dt < env.params["recv_timeout"] / 2, f"dead peer noticed only after {dt:.1f} s ({kind}: {msg})"
    try:
        await asyncio.wait_for(t.send("after", [torch.ones(1024, device=env.device)]),
                               env.params["recv_timeout"])
        send_error = None
    except TransportError as e:
        send_error = type(e).__name__
    except asyncio.TimeoutError:
        raise AssertionError("send to a dead peer hung") from None
    return {"kind": kind, "seconds": dt, "is_peer_gone": kind == PeerGone.__name__, "msg": msg,
            "send_error": send_error}


async def gone_0(env: Env) -> dict:
    """The peer closes (or dies): a waiting recv raises PeerGone/TransportError promptly."""
    import torch

    t = await env.open()
    try:
        await t.send("ping", [torch.ones(8, device=env.device)])
        out = await _expect_gone(t, env)
    finally:
        await t.close()
        await t.close()
    return out


async def closed_1(env: Env) -> dict:
    t = await env.open()
    try:
        await t.recv("ping", timeout=env.timeout_s)
        await asyncio.sleep(0.2)  # rank 0 is inside recv("never") now
    finally:
        await t.close()
    return {"ok": True}


async def killed_1(env: Env) -> dict:
    t = await env.open()
    await t.recv("ping", timeout=env.timeout_s)
    await asyncio.sleep(0.2)
    env.die()
    return {}  # never reached


async def _settle(baseline: int, limit_s: float = 5.0) -> int:
    """Wait for threads to wind down to ``baseline``; returns the last count."""
    end = time.monotonic() + limit_s
    n = native_threads()
    while n > baseline and time.monotonic() < end:
        await asyncio.sleep(0.05)
        n = native_threads()
    return n


async def close_both(env: Env) -> dict:
    """close() releases everything: idempotent, unusable afterwards, threads back to
    the baseline, the port reusable at once. Round 0 warms up (a library may start
    process-wide threads once); rounds 1 and 2 must each end at the baseline."""
    import torch

    from spade.errors import TransportError

    counts = []
    base = native_threads()
    for round_ in range(3):
        t = await env.open()  # the same port every round
        if env.rank == 0:
            await t.send("x", [torch.full((3,), round_, device=env.device)])
            got = await t.recv("y", timeout=env.timeout_s)
        else:
            got = await t.recv("x", timeout=env.timeout_s)
            await t.send("y", [got[0] + 1])
        want = round_ + (1 if env.rank == 0 else 0)  # rank 0 got y = x + 1, rank 1 got x
        assert got[0].tolist() == [want] * 3, f"round {round_}: got {got[0].tolist()}"
        await t.close()
        await t.close()
        try:
            await t.send("x", [torch.ones(1)])
        except TransportError:
            pass
        else:
            raise AssertionError("send after close() did not raise TransportError")
        try:
            await t.recv("x", timeout=0.1)
        except TransportError:
            pass
        else:
            raise AssertionError("recv after close() did not raise TransportError")
        del t, got
        if round_ == 0:
            await asyncio.sleep(0.2)
            base = native_threads()
        else:
            counts.append(await _settle(base))
    if env.multiprocess:  # in-process pairs share the count; checked on the whole process
        assert max(counts) <= base, f"threads: {base} after the first link, {counts} after the next (leak)"
    return {"base": base, "after": counts}



# --------------------------------------------------------------------------- variable layouts
# The runtime sends different layouts on one tag (BOOT vs STEP commands, prompt-length
# dependent shapes, a short last pack, deltas whose width varies per step): every
# transport must carry them in order, whatever it pre-registered.

def alternating_layouts():
    """Three layouts cycled on one tag: a command-like, a step-like and a mixed one."""
    import torch

    return [
        [((7,), torch.int64), ((3, 5), torch.float32)],
        [((3,), torch.int64)],
        [((2, 9, 4), torch.bfloat16), ((1,), torch.int32), ((4, 3), torch.float16)],
    ]


N_ALT = 24


async def layouts_0(env: Env) -> dict:
    """Alternating layouts on one tag, each way; the receiver uses new tensors, then `into`."""
    t = await env.open()
    lays = alternating_layouts()
    try:
        for i in range(N_ALT):
            await t.send("alt", make_msg(lays[i % 3], 300 + i, env.device))
        for i in range(N_ALT):
            lay = lays[(i * 2) % 3]  # another cycle order in the other direction
            got = await t.recv("alt_back", timeout=env.timeout_s)
            check_msg(got, lay, 400 + i, env.device, f"alt_back message {i} {lay}")
    finally:
        await t.close()
    return {"ok": True}


async def layouts_1(env: Env) -> dict:
    import torch

    t = await env.open()
    lays = alternating_layouts()
    try:
        for i in range(N_ALT):
            lay = lays[i % 3]
            if i % 2:
                into = [torch.empty(s, dtype=d, device=env.device) for s, d in lay]
                got = await t.recv("alt", into=into, timeout=env.timeout_s)
                assert all(g.data_ptr() == b.data_ptr() for g, b in zip(got, into)), "recv did not fill `into`"
            else:
                got = await t.recv("alt", timeout=env.timeout_s)
            check_msg(got, lay, 300 + i, env.device, f"alt message {i} {lay}")
        for i in range(N_ALT):
            await t.send("alt_back", make_msg(lays[(i * 2) % 3], 400 + i, env.device))
    finally:
        await t.close()
    return {"ok": True}


def grow_shrink_sizes() -> list[int]:
    """Elements per message: growing (odd sizes, up to 1 MiB of fp32), then shrinking
    back, then growing again below the peak (a transport must reuse, not regrow)."""
    up = [1, 3, 31, 257, 4099, 65537, 262147]
    return up + up[-2::-1] + [0, 5, 70001, 262147, 9]


async def grow_shrink_0(env: Env) -> dict:
    """Sizes grow then shrink on one tag (a short last pack, a delta's varying width)."""
    import torch

    t = await env.open()
    try:
        for i, n in enumerate(grow_shrink_sizes()):
            await t.send("gs", [pattern((n,), torch.float32, 500 + i, env.device),
                                pattern((2, n % 7 + 1), torch.int32, 600 + i, env.device)])
        await t.recv("done", timeout=env.timeout_s)
    finally:
        await t.close()
    return {"ok": True}


async def grow_shrink_1(env: Env) -> dict:
    import torch

    t = await env.open()
    try:
        for i, n in enumerate(grow_shrink_sizes()):
            if i % 3 == 1:
                into = [torch.full((n,), -1.0, device=env.device),
                        torch.empty(2, n % 7 + 1, dtype=torch.int32, device=env.device)]
                got = await t.recv("gs", into=into, timeout=env.timeout_s)
            else:
                got = await t.recv("gs", timeout=env.timeout_s)
            assert tuple(got[0].shape) == (n,), f"message {i}: shape {tuple(got[0].shape)}, expected ({n},)"
            assert same(got[0], pattern((n,), torch.float32, 500 + i)), f"message {i} ({n} floats) differs"
            assert same(got[1], pattern((2, n % 7 + 1), torch.int32, 600 + i)), f"message {i}: tensor 1 differs"
        await t.send("done", [torch.zeros(1, device=env.device)])
    finally:
        await t.close()
    return {"ok": True}


def reneg_sizes() -> list[int]:
    """Floats per message: small ones around three larger ones (each larger than all
    before it, so slot-based transports must renegotiate with messages in flight)."""
    out = []
    for big in (1000, 30000, 200001):
        out += [13 + i for i in range(6)] + [big]
    return out + [11 + i for i in range(6)]


async def reneg_0(env: Env) -> dict:
    """Many sends in flight across renegotiations (all posted before the receiver reads)."""
    import torch

    t = await env.open()
    try:
        sizes = reneg_sizes()
        tasks = [asyncio.ensure_future(t.send("rn", [pattern((n,), torch.float32, 700 + i, env.device),
                                                     torch.full((1,), i, dtype=torch.int64, device=env.device)]))
                 for i, n in enumerate(sizes)]
        await asyncio.sleep(0)
        await t.send("posted", [torch.ones(1, device=env.device)])
        await asyncio.wait_for(asyncio.gather(*tasks), 4 * env.timeout_s)
        await t.recv("done", timeout=env.timeout_s)
    finally:
        await t.close()
    return {"ok": True}


async def reneg_1(env: Env) -> dict:
    import torch

    t = await env.open()
    try:
        await t.recv("posted", timeout=env.timeout_s)
        await asyncio.sleep(0.3)  # the sender's messages are all outstanding now
        for i, n in enumerate(reneg_sizes()):
            got = await t.recv("rn", timeout=env.timeout_s)
            assert int(got[1].item()) == i, f"message {i} arrived as message {int(got[1].item())} (order lost)"
            assert same(got[0], pattern((n,), torch.float32, 700 + i)), f"message {i} ({n} floats) differs"
        await t.send("done", [torch.zeros(1, device=env.device)])
    finally:
        await t.close()
    return {"ok": True}


def open_fds() -> int:
    """File descriptors of this process (``/proc/self/fd``)."""
    return len(os.listdir("/proc/self/fd"))


async def lost_0(env: Env) -> dict:
    """A link to a peer that dies, dropped as the runtime drops a lost cache rank's
    (``abort``, then ``close``): what the process holds afterwards (file descriptors,
    threads), once it settles. The test runs it repeatedly against a fresh peer each
    time (a restarted cache rank) and compares the counts."""
    t = await env.open()
    try:
        await t.send("ping", [__import__("torch").ones(8, device=env.device)])
        out = await _expect_gone(t, env)
    finally:
        await t.abort()
        await t.close()
    del t
    end, last = time.monotonic() + 3.0, open_fds()
    while time.monotonic() < end:  # (a library may close descriptors from its own threads)
        await asyncio.sleep(0.1)
        n = open_fds()
        if n == last:
            break
        last = n
    return {**out, "fds": open_fds(), "threads": native_threads()}


SCENARIOS: dict[str, tuple[Callable[[Env], Awaitable[dict]], Callable[[Env], Awaitable[dict]]]] = {
    "peer_lost_repeatedly": (lost_0, killed_1),
    "basic": (basic_0, basic_1),
    "order": (order_0, order_1),
    "inflight": (inflight_0, inflight_1),
    "large": (large_0, large_1),
    "handshake": (handshake_both, handshake_both),
    "timeout": (timeout_0, timeout_1),
    "mismatch": (mismatch_0, mismatch_1),
    "peer_closed": (gone_0, closed_1),
    "peer_killed": (gone_0, killed_1),
    "close": (close_both, close_both),
    "layouts": (layouts_0, layouts_1),
    "grow_shrink": (grow_shrink_0, grow_shrink_1),
    "reneg": (reneg_0, reneg_1),
}


# --------------------------------------------------------------------------- worker process
def _device_for(rank: int, device: str):
    import torch

    if device == "cuda":
        n = torch.cuda.device_count()
        return torch.device(f"cuda:{rank % max(n, 1)}")
    return torch.device(device)


async def _run(name: str, ranks: tuple[int, ...], scenario: str, port: int, device: str,
               timeout_s: float, params: dict) -> dict:
    envs = [Env(name, r, port, _device_for(r, device), timeout_s, multiprocess=len(ranks) == 1,
                params=params) for r in ranks]
    fns = [SCENARIOS[scenario][e.rank](e) for e in envs]
    results = await asyncio.gather(*fns, return_exceptions=True)
    out = {}
    for r, res in zip(ranks, results):
        if isinstance(res, BaseException):
            raise res
        out[r] = res
    if len(ranks) == 2 and scenario == "close":
        base = min(out[r]["base"] for r in ranks)
        n = await _settle(base)
        assert n <= base, f"threads {base} before, {n} after close (leak)"
    return out


def worker_main(conn, name: str, ranks: tuple[int, ...]) -> None:
    """Entry of a spawned helper process: report availability, then run scenarios
    on command until told to stop (``None``)."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import torch

    torch.set_num_threads(1)
    torch.ones(4).sum()  # start torch's own threads now, before any baseline is taken
    try:
        from spade.transports import availability

        ok, why = availability().get(name, (False, f"no transport named {name!r}"))
    except Exception as e:  # noqa: BLE001 - reported to the parent as a skip reason
        ok, why = False, f"{type(e).__name__}: {e}"
    conn.send(("ready", ok, why))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        scenario, port, device, timeout_s, params = msg
        try:
            res = asyncio.run(_run(name, ranks, scenario, port, device, timeout_s, params))
            conn.send(("ok", res))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the test
            conn.send(("err", f"{type(e).__name__}: {e}", traceback.format_exc()))

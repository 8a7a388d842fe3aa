"""NIXL specifics beyond the contract: slot back-pressure, register-before-connect,
slot generations (growth, reuse, release) and the packing of a message into a slot.

Both endpoints run in this process (two NIXL agents talk over loopback), which is
enough for flow control and much faster than spawning helper processes.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from spade.transports.nixl import NixlTransportConfig
from spade.errors import TransportError
from spade.transports import Handshake, availability
from spade.transports._framing import free_port

ok, why = availability()["nixl"]
pytestmark = pytest.mark.skipif(not ok, reason=f"nixl not usable here: {why}")


async def _pair(register_first: bool = False):
    from spade.transports.nixl import NixlTransport

    port = free_port()
    a = NixlTransport(NixlTransportConfig(port=port, timeout_s=10), rank=0)
    b = NixlTransport(NixlTransportConfig(port=port, timeout_s=10), rank=1)
    if register_first:
        b.register("x", [torch.zeros(5, dtype=torch.int64)])  # before connect: announced on connect
    await asyncio.gather(a.connect(Handshake(role="inference")), b.connect(Handshake(role="cache")))
    return a, b


def test_sends_wait_for_slots_beyond_two_per_slot():
    async def main():
        a, b = await _pair(register_first=True)
        try:
            msgs = [[torch.full((5,), i, dtype=torch.int64)] for i in range(6)]
            # slots=2: two messages in the receiver's slots, two in the sender's staging.
            for m in msgs[:4]:
                await asyncio.wait_for(a.send("x", m), 5)
            fifth = asyncio.ensure_future(a.send("x", msgs[4]))
            await asyncio.sleep(0.3)
            assert not fifth.done(), "a fifth unconsumed message must wait for a free slot"
            got = await b.recv("x", timeout=5)
            assert got[0].tolist() == [0] * 5
            await asyncio.wait_for(fifth, 5)  # one message consumed: one slot came free
            sixth = asyncio.ensure_future(a.send("x", msgs[5]))
            await asyncio.sleep(0.3)
            assert not sixth.done(), "four unconsumed messages again: the sixth must wait"
            for i in range(1, 6):
                got = await b.recv("x", timeout=5)
                assert got[0].tolist() == [i] * 5, f"message {i}: {got[0].tolist()}"
            await asyncio.wait_for(sixth, 5)
        finally:
            await asyncio.gather(a.close(), b.close())

    asyncio.run(main())


def test_registering_a_larger_layout_grows_the_slots():
    async def main():
        a, b = await _pair(register_first=True)
        try:
            b.register("x", [torch.ones(5, dtype=torch.int64)])  # same layout: new destination only
            made = b.generations_made
            big = [torch.empty(600, dtype=torch.int64)]
            b.register("x", big)  # larger: a new generation, announced before any message needs it
            assert b.generations_made == made + 1
            await a.send("x", [torch.arange(600, dtype=torch.int64)])
            got = await b.recv("x", timeout=5)
            assert got[0].data_ptr() == big[0].data_ptr() and got[0].tolist() == list(range(600))
            await a.send("x", [torch.full((5,), 3, dtype=torch.int64)])  # fits: no new generation
            with pytest.raises(TransportError, match="600"):  # registered buffers: [600], message: [5]
                await b.recv("x", timeout=5)
            assert b.generations_made == made + 1
        finally:
            await asyncio.gather(a.close(), b.close())

    asyncio.run(main())


def test_steady_state_registers_nothing_and_old_generations_are_freed():
    """After the largest message was seen once, varying layouts that fit reuse the
    slots (no registration per step), and superseded generations are released."""

    async def main():
        a, b = await _pair()
        try:
            lays = [[(7,), (3, 5)], [(3,)], [(2, 9, 4), (1,)], [(40, 17)]]
            for rnd in range(2):
                if rnd == 1:
                    made = (a.generations_made, b.generations_made)
                for i in range(12):
                    shapes = lays[i % len(lays)]
                    msg = [torch.randn(s) for s in shapes]
                    await a.send("v", msg)
                    got = await b.recv("v", timeout=5)
                    assert [tuple(g.shape) for g in got] == [tuple(s) for s in shapes]
                    assert all(torch.equal(g, m) for g, m in zip(got, msg)), f"round {rnd}, message {i}"
            assert (a.generations_made, b.generations_made) == made, "the steady state registered memory"
            assert b.generations_made >= 2, "the growing layouts should have renegotiated at least once"
            assert len(b._rx["v"].gens) == 1, "superseded receive generations must be freed"
            await asyncio.sleep(0.1)  # the sender frees its side once its WRITEs completed
            assert len(a._tx["v"].gens) == 1, "superseded staging generations must be freed"
        finally:
            await asyncio.gather(a.close(), b.close())

    asyncio.run(main())


def test_packing_offsets_and_write_buckets():
    from spade.transports.nixl import packing, write_bucket

    lay = [((3,), torch.bool), ((5, 3), torch.float64), ((0,), torch.int32), ((7,), torch.bfloat16)]
    offs, need = packing(lay)
    assert all(o % 64 == 0 for o in offs) and offs == sorted(offs)
    assert need >= offs[-1] + 14 and need % 64 == 0
    for (shape, dt), o, o2 in zip(lay, offs, offs[1:] + [need]):
        n = 1
        for x in shape:
            n *= x
        assert o + n * dt.itemsize <= o2, "packed tensors overlap"
    cap = 3 << 20
    seen = set()
    for n in list(range(1, 5000, 7)) + [cap - 1, cap, 1 << 20, (1 << 20) + 1]:
        b = write_bucket(n, cap)
        assert n <= b <= cap
        if n > 256:
            assert b <= n * 1.125 + 1, f"bucket {b} wastes more than 12.5% of {n}"
        seen.add(b)
    assert write_bucket(cap + 5, cap) == cap
    # few distinct WRITE sizes for many message sizes (prepared lists stay few)
    assert len({write_bucket(n, cap) for n in range(1, cap, 997)}) <= 8 * 22 + 1


def test_a_receiver_that_cannot_grow_its_slots_fails_the_send_clearly():
    async def main():
        a, b = await _pair(register_first=True)  # "x": slots for 5 int64
        try:
            def no_memory(rx, need):
                raise RuntimeError(f"out of memory for {need} bytes")

            b._new_gen = no_memory
            await a.send("x", [torch.arange(5, dtype=torch.int64)])  # fits: fine
            assert (await b.recv("x", timeout=5))[0].tolist() == list(range(5))
            with pytest.raises(TransportError, match="cannot make .*out of memory"):
                await asyncio.wait_for(a.send("x", [torch.zeros(4096, dtype=torch.int64)]), 8)
        finally:
            await asyncio.gather(a.close(), b.close())

    asyncio.run(main())

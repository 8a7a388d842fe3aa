"""NIXL specifics beyond the contract: slot back-pressure and register-before-connect.

Both endpoints run in this process (two NIXL agents talk over loopback), which is
enough for flow control and much faster than spawning helper processes.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from spade.config import NixlTransportConfig
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


def test_reregistering_a_tag_with_another_layout_is_refused():
    from spade.errors import TransportError

    async def main():
        a, b = await _pair(register_first=True)
        try:
            b.register("x", [torch.ones(5, dtype=torch.int64)])  # same layout: new destination, fine
            with pytest.raises(TransportError, match="already has slots"):
                b.register("x", [torch.ones(6, dtype=torch.int64)])
            with pytest.raises(TransportError, match="receiver's slots"):
                await a.send("x", [torch.ones(6, dtype=torch.int64)])
        finally:
            await asyncio.gather(a.close(), b.close())

    asyncio.run(main())

"""``Transport.on_free_port``: a cache rank started again after a loss meets on free
ports when the lost link still holds its own."""

from __future__ import annotations

import socket

import pytest

from spade.transports._framing import free_port, port_in_use
from spade.transports.nccl import NcclTransport, NcclTransportConfig
from spade.transports.nixl import NixlTransport, NixlTransportConfig
from spade.transports.ucx import UcxTransport, UcxTransportConfig

CASES = [(NcclTransport, NcclTransportConfig, "master_port"), (UcxTransport, UcxTransportConfig, "port"),
         (NixlTransport, NixlTransportConfig, "port")]


@pytest.mark.parametrize("cls,cfg_cls,field", CASES, ids=[c[0].name for c in CASES])
def test_free_ports_are_kept(cls, cfg_cls, field):
    port = free_port()
    cfg = cfg_cls(**{field: port})
    got, why = cls.on_free_port(cfg)
    if why is None:  # (another program may take it between the probe and here)
        assert got is cfg


HELD = [(*c, i) for c in CASES for i in range(c[0].port_span)]


@pytest.mark.parametrize("cls,cfg_cls,field,held_offset", HELD, ids=[f"{c[0].name}+{c[3]}" for c in HELD])
def test_a_held_port_moves_the_link(cls, cfg_cls, field, held_offset):
    """Any port of the link's span held (nccl: the store's and the header socket's)."""
    for _ in range(50):  # a held port whose span's other ports are free (else the first busy one is named)
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("", 0))
        held = s.getsockname()[1]
        base = held - held_offset
        if all(port_in_use(base + i) is None for i in range(cls.port_span) if i != held_offset):
            break
        s.close()
    else:
        pytest.skip("no port span with only the held port busy in 50 tries")
    with s:
        s.listen(1)
        cfg = cfg_cls(**{field: base})
        got, why = cls.on_free_port(cfg)
        new = getattr(got, field)
        assert why is not None and str(held) in why
        assert new != getattr(cfg, field) and getattr(cfg, field) == held - held_offset  # a copy; cfg untouched
        assert all(port_in_use(new + i) is None for i in range(cls.port_span))
        assert got.model_dump(exclude={field}) == cfg.model_dump(exclude={field})


def test_free_port_draws_outside_the_ephemeral_range():
    """Ports come from outside the range the OS gives outgoing connections' source ports (a
    listener's port taken by such a connection, even the peer's own early connect to it, is the
    failure this avoids), bindable, with the span's later ports free too."""
    from spade.transports._framing import PORT_FLOOR, ephemeral_range

    lo, hi = ephemeral_range()
    if lo - PORT_FLOOR < 1000 and 65535 - hi < 1000:
        pytest.skip(f"the ephemeral range {lo}-{hi} leaves no room")
    for span in (1, 2, 3):
        for _ in range(20):
            p = free_port(span=span)
            assert PORT_FLOOR <= p and p + span - 1 <= 65535
            assert all(not lo <= p + i <= hi for i in range(span)), (p, span, lo, hi)
            assert all(port_in_use(p + i) is None for i in range(span))
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))


def test_free_port_ignores_the_seeded_random():
    """Tests seed ``random``; two draws after the same seed must not repeat (two processes
    seeded alike would otherwise draw the same ports)."""
    import random

    draws = []
    for _ in range(3):
        random.seed(1234)
        draws.append(free_port())
    assert len(set(draws)) > 1

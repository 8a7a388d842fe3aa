"""A ucx/nixl port that another program holds is named before anything connects
(issue 25: the peer used to see "Connection reset" or "corrupt side-channel frame")."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from spade.transports.nixl import NixlTransportConfig
from spade.transports.ucx import UcxTransportConfig
from spade.errors import TransportError
from spade.transports._framing import check_port_free, port_in_use
from spade.transports.base import Handshake

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def held_port():
    """A port held by a listening socket on 127.0.0.1 (as another program would)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_probe_sees_a_listening_socket(held_port):
    assert port_in_use(held_port)
    with pytest.raises(TransportError, match=rf"^ucx: port {held_port} in use on 127.0.0.1: pick another with "
                                             r"runtime.transport.port \(.*\)$"):
        check_port_free("127.0.0.1", held_port, "ucx")


def test_probe_sees_a_bound_socket():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening
        assert port_in_use(s.getsockname()[1])


def test_probe_free_port_and_time_wait():
    """A free port passes, and so does one whose last link just closed (TIME_WAIT):
    the ucx/nixl listeners bind with SO_REUSEADDR (so their TIME_WAIT remnants carry
    it, as here), and so does the probe."""
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        cli = socket.create_connection(("127.0.0.1", port))
        conn, _ = srv.accept()
        conn.close()  # the listening side closes first: its end lingers in TIME_WAIT
        cli.close()
    assert any(f":{port:04X} " in ln and ln.split()[3] == "06" for ln in open("/proc/net/tcp"))  # TIME_WAIT
    assert port_in_use(port) is None
    check_port_free("127.0.0.1", port, "nixl")


@pytest.mark.parametrize("name, cfg_cls", [("ucx", UcxTransportConfig), ("nixl", NixlTransportConfig)])
def test_preflight(held_port, name, cfg_cls):
    from spade.transports import TRANSPORTS

    cls = TRANSPORTS.get(name)
    with pytest.raises(TransportError, match=f"{name}: port {held_port} in use on 127.0.0.1: pick another"):
        cls.preflight(cfg_cls(host="127.0.0.1", port=held_port))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    cls.preflight(cfg_cls(host="127.0.0.1", port=free))  # no error


@pytest.mark.parametrize("name, cfg_cls", [("ucx", UcxTransportConfig), ("nixl", NixlTransportConfig)])
def test_listening_side_refuses_a_held_port(held_port, name, cfg_cls):
    """The cache side (rank 1) checks before it listens: under torchrun it is the only check."""
    from spade.transports import TRANSPORTS

    cls = TRANSPORTS.get(name)
    ok, why = cls.available()
    if not ok:
        pytest.skip(f"{name} is not usable here: {why}")
    t = cls(cfg_cls(host="127.0.0.1", port=held_port, timeout_s=20), rank=1, device="cpu")

    async def go():
        try:
            await asyncio.wait_for(t.connect(Handshake(role="cache", layout={})), 30)
        finally:
            await t.close()

    with pytest.raises(TransportError, match=f"{name}: port {held_port} in use on 127.0.0.1"):
        asyncio.run(go())


@pytest.mark.parametrize("name", ["ucx", "nixl"])
def test_spade_run_names_the_held_port(held_port, tmp_path, name):
    """multiprocess over ucx/nixl: the port is checked before the model loads or the
    cache process starts; one line, exit 2."""
    over = ["model.name=tiny", "generation.max_new_tokens=2", "runtime.topology=multiprocess",
            f"runtime.transport.name={name}", "runtime.transport.host=127.0.0.1",
            f"runtime.transport.port={held_port}"]
    cmd = [sys.executable, "-m", "spade.cli", "run", "--out", str(tmp_path / "r.json")]
    for o in over:
        cmd += ["--set", o]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    errs = [ln for ln in r.stderr.splitlines() if ln.startswith("spade: error:")]
    assert len(errs) == 1 and f"{name}: port {held_port} in use on 127.0.0.1: pick another with " \
                               "runtime.transport.port" in errs[0]
    assert "loaded tiny" not in r.stderr

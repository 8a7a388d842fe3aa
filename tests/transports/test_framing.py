"""Wire helpers shared by the ucx and nixl transports, and the lazy-import promise."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from spade.errors import TransportError
from spade.transports import _framing as F
from spade.transports.base import WIRE_VERSION


@pytest.mark.parametrize("dtype", sorted(F.DTYPE_CODES, key=str))
def test_header_round_trip_every_dtype(dtype):
    ts = [torch.empty(3, 1, 5, dtype=dtype), torch.empty(0, dtype=dtype), torch.empty((), dtype=dtype)]
    hdr = F.pack_header(WIRE_VERSION, 123456789, 2**40 + 3, ts, F.FLAG_INLINE, 77)
    version, flags, tid, seq, payload, layout, n = F.unpack_header(memoryview(bytes(hdr) + b"junk"))
    assert (version, flags, tid, seq, payload, n) == (WIRE_VERSION, F.FLAG_INLINE, 123456789, 2**40 + 3, 77, len(hdr))
    assert layout == [((3, 1, 5), dtype), ((0,), dtype), ((), dtype)]


def test_header_refuses_garbage_and_oversized_layouts():
    with pytest.raises(TransportError, match="magic"):
        F.unpack_header(b"XXXX" + bytes(64))
    many = [torch.empty([1] * 8) for _ in range(64)]  # 64 rank-8 tensors: > HEADER_CAP
    with pytest.raises(TransportError, match="header"):
        F.pack_header(WIRE_VERSION, 1, 0, many)


def test_tag_id_is_stable_across_processes():
    here = [F.tag_id(t) for t in ("qkv", "sel", "ctl", "")]
    code = "from spade.transports._framing import tag_id; print([tag_id(t) for t in ('qkv','sel','ctl','')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout
    assert out.strip() == str(here)
    assert len(set(here)) == 4


def test_layout_checks_name_both_layouts():
    exp = F.layout_of([torch.empty(4, 4)])
    with pytest.raises(TransportError, match=r"\[4, 5\] float32.*\[4, 4\] float32"):
        F.check_layout("t", exp, [torch.empty(4, 5)], "into")
    F.check_layout("t", exp, [torch.empty(4, 4)], "into")
    assert F.layout_from_json(F.layout_to_json(exp)) == exp
    with pytest.raises(TransportError, match="contiguous"):
        F.byte_view(torch.empty(4, 4).t())
    with pytest.raises(TransportError, match="list of tensors"):
        F.check_sendable("t", torch.empty(2))


def test_backoff_spins_only_while_hot_or_briefly_busy():
    bo = F.Backoff(spin_s=0.05, min_sleep_s=1e-3, max_sleep_s=8e-3)
    assert bo.next_delay(busy=False, hot=True) == 0.0
    bo.progressed()
    assert bo.next_delay(busy=True) == 0.0  # within the spin window
    idle = [bo.next_delay(busy=False) for _ in range(6)]
    assert idle == [1e-3, 2e-3, 4e-3, 8e-3, 8e-3, 8e-3]  # idle: doubling, capped


def test_import_spade_needs_no_optional_transport_package():
    code = ("import sys, spade, spade.transports, spade.transports.ucx, spade.transports.nixl; "
            "bad = [m for m in ('ucxx', 'nixl_cu13', 'nixl_cu12', 'nixl') if m in sys.modules]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("name", ["ucx", "nixl"])
def test_available_never_raises_and_says_how_to_install(name):
    from spade.transports import TRANSPORTS, availability

    ok, why = availability()[name]
    assert isinstance(ok, bool) and why
    if not ok:
        assert "pip install" in why
    assert TRANSPORTS.get(name).name == name

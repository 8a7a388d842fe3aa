"""``spade.streams.stream_scope``: ``torch.cuda.stream`` semantics without its lookups."""

from __future__ import annotations

import pytest
import torch

from spade.streams import current_stream, no_grad_on, stream_scope


def test_none_is_a_no_op():
    with stream_scope(None) as s:
        assert isinstance(s, stream_scope)


def test_no_grad_on_restores_the_grad_mode_it_found():
    x = torch.ones(2, requires_grad=True)
    with no_grad_on(None):
        assert not torch.is_grad_enabled() and not (x * 2).requires_grad
    assert torch.is_grad_enabled() and (x * 2).requires_grad
    with pytest.raises(ValueError):  # restored on an exception too
        with no_grad_on(None):
            raise ValueError("inside")
    assert torch.is_grad_enabled()
    with torch.no_grad():  # inside no_grad it stays off after exit
        with no_grad_on(None):
            pass
        assert not torch.is_grad_enabled()


@pytest.mark.gpu
def test_current_stream_is_torch_current_stream_and_reused():
    dev = torch.device("cuda", torch.cuda.current_device())
    assert current_stream(dev) == torch.cuda.current_stream(dev)
    assert current_stream(dev) is current_stream(dev)  # one object per stream
    assert current_stream(torch.device("cuda")) == torch.cuda.current_stream()  # index-less: the current device
    s = torch.cuda.Stream()
    with stream_scope(s):
        assert current_stream(dev) == s == torch.cuda.current_stream(dev)
    assert current_stream(dev) == torch.cuda.current_stream(dev) != s


@pytest.mark.gpu
def test_switches_and_restores_like_torch_stream():
    before = torch.cuda.current_stream()
    s = torch.cuda.Stream()
    with stream_scope(s):
        assert torch.cuda.current_stream() == s
        with stream_scope(None):  # no-op inside
            assert torch.cuda.current_stream() == s
        t = torch.ones(4, device="cuda") * 2  # work lands on s
        ev = torch.cuda.Event()
        ev.record()
    assert torch.cuda.current_stream() == before
    before.wait_event(ev)
    assert t.sum().item() == 8
    with pytest.raises(RuntimeError, match="inside"):  # restored on an exception too
        with stream_scope(s):
            raise RuntimeError("inside")
    assert torch.cuda.current_stream() == before


@pytest.mark.multigpu
def test_a_stream_of_another_device_is_made_current_there_and_restored():
    dev = torch.cuda.current_device()
    other = 1 - dev if dev in (0, 1) else 0
    prev_other = torch.cuda.current_stream(other)
    prev_here = torch.cuda.current_stream(dev)
    s = torch.cuda.Stream(device=other)
    with stream_scope(s):
        assert torch.cuda.current_stream(other) == s
    assert torch.cuda.current_stream(other) == prev_other
    assert torch.cuda.current_stream(dev) == prev_here and torch.cuda.current_device() == dev

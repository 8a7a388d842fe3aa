"""``torch.cuda.stream(s)`` for the control plane's hot paths, without its host cost.

The asynchronous runtime switches streams a few dozen times per decode step
(landing messages, staging copies, the cache rank's side stream). Each
``torch.cuda.stream(s)`` resolves "the current device" twice through
``torch.cuda.is_available()`` (an environment read and a device count per call):
~0.8 ms of host time per step under ``bench_tpot --host-profile`` on an H200 host,
where the device step is ~5.8 ms and the host is what paces the asynchronous rows.
``stream_scope`` does the same switch with the current device's index read once
and the streams saved and restored as raw (id, device, type) triples;
``indexed_device`` gives the devices the runtime keeps an explicit index.

Semantics are those of ``torch.cuda.stream``: ``None`` is a no-op; a stream on
another device becomes that device's current stream (and the current device, as
``torch.cuda.set_stream`` does) until exit, which restores both devices' streams.
"""

from __future__ import annotations

import torch

__all__ = ["current_stream", "device_index", "indexed_device", "no_grad_on", "stream_scope"]


def indexed_device(device) -> torch.device:
    """``device`` as a ``torch.device``, a CUDA one with its index made explicit (the
    current device's): an index-less CUDA device sends every ``torch.cuda.current_stream``
    / ``stream(...)`` / device-index lookup through an availability check (~20 us of
    host time each, dozens per asynchronous decode step)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class stream_scope:
    """Context manager: make ``stream`` (a ``torch.cuda.Stream`` or None) current."""

    __slots__ = ("_s", "_src", "_dst")

    def __init__(self, stream) -> None:
        self._s = stream
        self._src = self._dst = None

    def __enter__(self) -> "stream_scope":
        s = self._s
        if s is None:
            return self
        cur = torch.cuda.current_device()
        self._src = torch._C._cuda_getCurrentStream(cur)  # (stream_id, device_index, device_type)
        if s.device_index != cur:
            self._dst = torch._C._cuda_getCurrentStream(s.device_index)
        torch._C._cuda_setStream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)
        return self

    def __exit__(self, *exc) -> bool:
        if self._s is None:
            return False
        if self._dst is not None:
            sid, idx, typ = self._dst
            torch._C._cuda_setStream(stream_id=sid, device_index=idx, device_type=typ)
            self._dst = None
        sid, idx, typ = self._src
        torch._C._cuda_setStream(stream_id=sid, device_index=idx, device_type=typ)  # also the device back
        return False


_CURRENT: dict[tuple, "torch.cuda.Stream"] = {}


def current_stream(device: torch.device) -> "torch.cuda.Stream":
    """``torch.cuda.current_stream(device)`` for a device with an explicit index (see
    ``indexed_device``), without its device-index resolution and a new ``Stream`` object
    per call: one object per raw (id, device, type) triple, kept (a few dozen at most:
    PyTorch's stream pools are fixed; the table is cleared past 256 entries)."""
    raw = torch._C._cuda_getCurrentStream(device.index if device.index is not None else torch.cuda.current_device())
    s = _CURRENT.get(raw)
    if s is None:
        if len(_CURRENT) >= 256:
            _CURRENT.clear()
        s = _CURRENT[raw] = torch.cuda.Stream(stream_id=raw[0], device_index=raw[1], device_type=raw[2])
    return s


class no_grad_on:
    """``torch.no_grad()`` plus ``stream_scope(stream)`` (the stream's device current) in
    one light context manager, for a block of work the control plane launches per pack."""

    __slots__ = ("_scope", "_grad")

    def __init__(self, stream) -> None:
        self._scope = stream_scope(stream)
        self._grad = True

    def __enter__(self) -> "no_grad_on":
        self._grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        self._scope.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        self._scope.__exit__(*exc)
        torch._C._set_grad_enabled(self._grad)
        return False


def device_index(values, device) -> torch.Tensor:
    """A host list of ints as an int64 tensor on ``device``, without waiting for the GPU:
    ``torch.as_tensor(values, device=cuda)`` copies synchronously (the host waits for
    every kernel queued on the stream), which a per-layer join hook pays once per layer;
    an asynchronous copy from host memory returns once the values are staged."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

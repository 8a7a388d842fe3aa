"""``select_overlap``: stream scheduling of the threshold-carry select (``spade.kernels.carry``).

The select is one latency-bound program per row; the scoring is bandwidth-bound.
Inside ``select_overlap`` (the cache rank wraps each pack's layers in one) every
select goes to a side stream after its own scoring, so layer j's select runs
beside layer j+1's scoring; the block joins on exit (measured on an H200: a pack
of four layers 0.88-0.93x of the serial time).

(Not named ``select_overlap.py``: importing a submodule of that name would rebind
``spade.kernels.select_overlap``, the package's wrapper, to the module.)
"""

from __future__ import annotations

import contextlib
import threading

import torch

from spade.envs import env
from spade.kernels.common import _interpret
from spade.kernels.radix_topk import SELECT_CONFIG

__all__ = ["OVERLAP_DEFAULT", "after_selects", "overlap_enabled", "select_overlap"]


_OVERLAP = threading.local()  # .side: the side stream of an active select_overlap block
_SIDE_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def overlap_enabled(device: torch.device | str) -> bool:
    """Whether ``select_overlap`` on ``device`` overlaps: ``SPADE_SELECT_OVERLAP``
    (``auto``/unset, ``on``, ``off``; ``auto`` means ``OVERLAP_DEFAULT``), and only on a
    CUDA device with compiled kernels (on a CPU and under the interpreter every kernel
    runs in order anyway)."""
    mode = env("SPADE_SELECT_OVERLAP")
    on = OVERLAP_DEFAULT if mode == "auto" else mode == "on"
    return on and torch.device(device).type == "cuda" and not _interpret()


OVERLAP_DEFAULT = True
"""``SPADE_SELECT_OVERLAP=auto``: whether ``select_overlap`` blocks overlap. On, as measured
on 1x H200 (int4 keys, K=2048, P=4): a pack's selection 0.89x / 0.93x / 0.88x of the serial one
at B=8 32k / B=16 32k / B=32 16k, the cache rank's pack 0.52x / 0.75x / 0.75x of the inference
pack (Table 3) vs 0.56x / 0.79x / 0.84x."""


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = _device_index(device)
    prio = int(SELECT_CONFIG.get("carry_overlap_priority", 0))
    key = (index, prio)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=index, priority=prio)
    return _SIDE_STREAMS[key]


@contextlib.contextmanager
def select_overlap(device: torch.device | str, enabled: bool | None = None):
    """Within the block, each threshold-carry select kernel (``score_topk(..., carry=)``)
    runs on a side stream after its own scoring, so the caller's stream goes straight
    on to the next call's scoring: layer j's select (one program per row, latency-bound)
    runs beside layer j+1's scoring (bandwidth-bound). On exit the current stream waits
    for the side stream: the indices (and the carries) are ready there, not before —
    read no ``score_topk`` result inside the block. Each call's scores must be its own
    buffer (``score_topk_triton`` allocates one per call). Capturable in a CUDA graph
    (a fork and a join of the capturing stream). A no-op on a CPU, under the
    interpreter, when ``enabled`` is False or (``enabled=None``) ``overlap_enabled`` says
    no, and nested in another block (the outer one joins). Calls on another device, or
    launched from another stream than the one current at entry, are not covered: the
    join waits on the entry stream only (calls on another device run in order).

    >>> with select_overlap(k.device):  # doctest: +SKIP
    ...     idx = [score_topk_triton(q[j], k[j], lo, hi, K, carry=c[j]) for j in range(4)]
    """
    dev = torch.device(device)
    on = overlap_enabled(dev) if enabled is None else (
        bool(enabled) and dev.type == "cuda" and not _interpret())
    if not on or getattr(_OVERLAP, "side", None) is not None:
        yield
        return
    cur = torch.cuda.current_stream(dev)
    _OVERLAP.side, _OVERLAP.index, _OVERLAP.forked = _side_stream(dev), _device_index(dev), False
    try:
        yield
    finally:
        side, _OVERLAP.side = _OVERLAP.side, None
        # join only what was forked: a block that launched nothing on the side stream
        # (every selection reused or dense) must not make a capturing stream wait on a
        # stream outside its capture (that invalidates the capture)
        if _OVERLAP.forked:
            cur.wait_stream(side)


@contextlib.contextmanager
def after_selects(device: torch.device | str):
    """Inside a ``select_overlap`` block that has forked, run the caller's launches on
    the block's side stream, after everything launched so far on either stream: so they
    may read a ``score_topk`` result (e.g. copy the indices elsewhere) before the block
    joins. Elsewhere (no block, nothing forked, another device, a CPU) a no-op: the
    results are in order already. Capturable (an event wait between two streams of
    the capture)."""
    side = getattr(_OVERLAP, "side", None)
    dev = torch.device(device)
    if side is None or not _OVERLAP.forked or dev.type != "cuda" or _OVERLAP.index != _device_index(dev):
        yield
        return
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        yield

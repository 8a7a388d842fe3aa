"""Programmatic dependent launch (PDL) for the kernels of the decode step.

A decode step is a chain of ~9 short kernels per layer (norm, qkv projection, rope +
cache store, attention, o projection, norm, gate/up projection, SiLU, down
projection): ~330 kernel boundaries per step of a 36-layer model. At each boundary the
GPU drains the previous grid before it launches the next one. Measured (``DEFAULT_MODE``):
the plain decode step barely moves with PDL, but the asynchronous step, whose packs
also stage their q/k/v and wait on the cache rank's selections, loses its whole
overhead over the plain one.

On sm_90+ a kernel launched with PDL (``launch_pdl=True``: the programmatic stream
serialisation attribute) may begin while its predecessor in the stream is still
running: as soon as every program of the predecessor has executed
``griddepcontrol.launch_dependents`` (or exited). It must then execute
``griddepcontrol.wait`` before touching anything the predecessor writes (or reads:
the wait returns when the predecessor has completed and its writes are visible).
Every Triton kernel of this suite (the decode step's, the cache rank's, Quest's)
follows one protocol, behind a ``PDL`` constexpr (launch keywords: ``pdl_kwargs``):

* first ``grid_dep_wait`` (before any load of activations or store of results), then
  ``grid_dep_release`` (so the *next* kernel's programs are launched only once this one
  has all its programs resident and past their wait: they fill SMs as this kernel's
  programs exit, never starve it);
* since every PDL kernel waits for its predecessor, and that one waited for its own,
  the stream order of the whole chain is kept; kernels launched without PDL (torch
  ops, cuBLAS) serialise as usual.

A CUDA graph captured from such launches keeps the programmatic edges (CUDA 12.3+).
Kernels come in two families: ``decode`` (the decode step's own: projections,
attention, the fused norm / rope / SiLU ops, staging) and ``select`` (the selection
work: scoring, top-K, key quantisation, query prediction, Quest, gathers).
``SPADE_PDL`` picks where PDL is used: ``all``, ``decode`` (the decode family only) or
``off``; ``auto`` (default) is ``DEFAULT_MODE``, or ``SHARED_MODE`` for the work of a cache
rank that shares its GPU with the inference rank (``shared_gpu``). Only CUDA devices of
compute capability 9.0 and above launch with it (never on CPU or under the Triton
interpreter). The mode is read at launch time, so a captured graph keeps the mode it was
captured with (``FastModel`` keys its graphs by ``capture_key()``).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import triton
import triton.language as tl

from spade import envs

__all__ = ["PDL_MODES", "FAMILIES", "DEFAULT_MODE", "SHARED_MODE", "shared_gpu", "pdl_mode", "pdl_enabled",
           "pdl_kwargs", "capture_key", "grid_dep_wait", "grid_dep_release"]

PDL_MODES = envs.VARS["SPADE_PDL"].choices  # ("auto", "all", "decode", "off")
FAMILIES = ("decode", "select")
DEFAULT_MODE = "all"
"""What ``auto`` means. Measured on H200s (Qwen3-8B shape, int4 scoring keys,
P=4, all three modes side by side): at B=8 L=32k K=2k the asynchronous rows gain ~0.22 ms
per step from the decode family (local 5.31 ms with ``decode`` or ``all`` vs 5.53 ``off``),
and PDL on the selection kernels then slowed the cache rank's radix top-K (at B=16 L=32k
local 7.56 ``all`` vs 7.35 ``decode``): ``decode`` was the default. With the threshold-carry
top-K (two selection kernels per layer instead of five) the selection family gains too:
the cache rank's pack at B=16 L=32k 0.529 ms with ``all`` vs 0.538 ``decode`` (0.79x vs
0.81x of the inference pack), at B=32 L=16k 0.647 vs 0.660, and B=8 L=32k is
unchanged (optimal 5.32 / 5.26, local 5.37 / 5.36 ms): hence ``all``."""


SHARED_MODE = "decode"
"""What ``auto`` means for a cache rank on the inference rank's GPU (``colocated``;
``shared_gpu``): its selection kernels launch without PDL. An early-launched program waits
resident on an SM for its predecessor, and on a shared GPU it holds that SM's slots from
the decode step's kernels beside it. One H100, Qwen3-8B shape, K=2k, int4, P=9, ``colocated``,
``all`` against this (``bench_tpot --pdl all,auto`` and ``auto,all``, one process each):
B=8 L=32k 9.278 / 9.170 and 9.237 / 9.184 ms with every channel, 8.537 / 8.354 and 8.448 /
8.350 with ``score_channels: 32``; B=16 L=16k c=32 9.900 / 9.719 (docs/perf.md, PDL)."""

_LOCAL = threading.local()


@contextlib.contextmanager
def shared_gpu(on: bool = True):
    """Within it (this thread), ``auto`` resolves to ``SHARED_MODE``: a cache rank that
    shares its GPU with the inference rank wraps its launches in it (and its captures:
    a graph keeps the launches it recorded)."""
    prev = getattr(_LOCAL, "shared", False)
    _LOCAL.shared = bool(on)
    try:
        yield
    finally:
        _LOCAL.shared = prev


def pdl_mode() -> str:
    """``SPADE_PDL`` resolved (``auto`` or unset: ``DEFAULT_MODE``, or ``SHARED_MODE``
    inside ``shared_gpu``), validated."""
    mode = envs.env("SPADE_PDL")
    if mode == "auto":
        return SHARED_MODE if getattr(_LOCAL, "shared", False) else DEFAULT_MODE
    return mode


def capture_key() -> tuple[str, ...]:
    """The launch settings a CUDA graph records and the environment can change between
    captures: the variables of ``spade.envs.VARS`` marked ``capture`` (graph caches key
    on it)."""
    return envs.capture_key()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_enabled(device: torch.device, family: str = "decode") -> bool:
    """Whether a kernel of ``family`` launched on ``device`` now uses PDL: ``SPADE_PDL``
    covers the family, the device is CUDA with compute capability >= 9.0 and Triton is
    not interpreting."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    mode = pdl_mode()
    if mode == "off" or (mode == "decode" and family != "decode"):
        return False
    if device.type != "cuda" or envs.triton_interpret():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)[0] >= 9


def pdl_kwargs(t: torch.Tensor, family: str = "decode") -> dict:
    """Launch keywords of a ``family`` kernel following the protocol, for a launch on
    ``t``'s device: its ``PDL`` constexpr and Triton's ``launch_pdl`` option."""
    on = pdl_enabled(t.device, family)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def grid_dep_wait(PDL: tl.constexpr):
    """Wait until the previous kernel of the stream has completed and its writes are
    visible (a no-op without PDL)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def grid_dep_release(PDL: tl.constexpr):
    """Let the next kernel of the stream launch once every program of this one has
    called it or exited (a no-op without PDL)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()

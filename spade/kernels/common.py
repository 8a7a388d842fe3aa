"""Host helpers and Triton helpers shared by the selection kernels (``scoring``,
``radix_topk``, ``carry``, ``quest``): input checks, grid sizing, the candidate-range
mask of the references and the group-query tile load; and the loop bound every
kernel of the package uses for loops over a tensor range (``loop_bound``)."""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import triton
import triton.language as tl

from spade.envs import triton_interpret


def _interpret() -> bool:
    """True when Triton runs under its CPU interpreter (decided at launch time)."""
    return triton_interpret()


def _check_rows(t: torch.Tensor, B: int, name: str, device: torch.device | None = None) -> torch.Tensor:
    """Validate a per-row [B] integer tensor; move it to ``device`` if given (the
    kernels read it on the device)."""
    if t.shape != (B,):
        raise ValueError(f"{name} must have shape [{B}], got {tuple(t.shape)}")
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    return t if device is None else t.to(device)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    """SMs of the device (a small stand-in under the interpreter, to keep grids tiny)."""
    if device.type != "cuda":
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def row_bucket(n: int, B: int) -> int:
    """The batch-size bucket of ``n`` rows in use out of ``B`` slots: the next power of
    two, at most ``B`` (``row_bucket(3, 16) == 4``, ``row_bucket(9, 12) == 12``). A served
    decode step's graphs are keyed by it, so a join or leave inside a bucket captures
    nothing, and ``plan_rows`` sizes the work for it."""
    if n >= B:
        return B
    return min(B, 1 << max(0, int(n) - 1).bit_length())


class _Plan(threading.local):
    busy: int | None = None
    total: int = 1


_PLAN = _Plan()


@contextlib.contextmanager
def plan_rows(busy: int | None, total: int):
    """Inside: the (row, chunk) grids of the selection kernels and the decode attention's
    split plan are sized as if only ``busy`` of every ``total`` batch rows carried work (a serving batch's rows in use,
    rounded up to their bucket: the others' windows are a few tokens, and their programs
    end at once), so the rows in use get the chunks a batch of their own size would.
    The results do not change, only the grid. ``busy`` None (or >= ``total``): every
    row. A host fact: a CUDA graph captured inside must be keyed by it. Per thread."""
    prev = _PLAN.busy, _PLAN.total
    _PLAN.busy, _PLAN.total = (None, 1) if busy is None or busy >= total else (max(1, int(busy)), int(total))
    try:
        yield
    finally:
        _PLAN.busy, _PLAN.total = prev


def plan_share(rows: int) -> int:
    """``rows`` rows of a (row, ...) grid as the current ``plan_rows`` counts them: its
    share of them (at least one), or all of them outside a plan."""
    if _PLAN.busy is None:
        return rows
    return max(1, triton.cdiv(max(rows, 1) * _PLAN.busy, _PLAN.total))


def _split(n: int, rows: int, device: torch.device, *, block: int, min_chunk: int,
           per_sm: int = 4) -> tuple[int, int]:
    """Split rows of length ``n`` into chunks for a (row, chunk) grid.

    Aims at about ``per_sm`` programs per SM (several waves, so the last partial
    wave costs little), with chunks of at least ``min_chunk`` elements (rounded to
    ``block``) so per-program work amortises its fixed costs (q load, histogram
    atomics). Inside ``plan_rows`` only its share of ``rows`` counts. Returns
    (chunk, n_chunks)."""
    n = max(n, 1)
    rows = plan_share(rows)
    target = per_sm * _sm_count(device)
    n_chunks = max(1, min(triton.cdiv(target, max(rows, 1)), triton.cdiv(n, min_chunk)))
    chunk = triton.cdiv(triton.cdiv(n, n_chunks), block) * block
    return chunk, triton.cdiv(n, chunk)


def _range_mask(lo: torch.Tensor, hi: torch.Tensor, L: int) -> torch.Tensor:
    """[B, L] bool: lo[b] <= p < hi[b]."""
    pos = torch.arange(L, device=lo.device)
    return (pos[None, :] >= lo.long()[:, None]) & (pos[None, :] < hi.long()[:, None])


@triton.jit
def _load_group_q(q_ptr, b, h, stride_qb, stride_qh, stride_qd,
                  G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The G query heads of KV head ``h`` as a zero-padded [G_PAD, BLOCK_D] tile."""
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    base = q_ptr + b.to(tl.int64) * stride_qb + (h * G).to(tl.int64) * stride_qh
    mask = (offs_g[:, None] < G) & (offs_d[None, :] < D)
    return tl.load(base + offs_g[:, None] * stride_qh + offs_d[None, :] * stride_qd, mask=mask, other=0.0)


@triton.jit
def loop_bound(x, INTERPRET: tl.constexpr):
    """``x`` (a scalar) as a bound of a kernel's ``range()`` loop: ``x`` itself when
    compiled, so the loop and its software pipelining stay as written; a Python int
    under the interpreter, whose ``range()`` cannot take its scalars (one-element
    arrays, which numpy 2.4 refuses to convert with int()). Kernels write one loop,
    ``for l0 in range(loop_bound(lo, INTERPRET), loop_bound(hi, INTERPRET), BLOCK)``,
    not a compiled ``for`` and an interpreted ``while`` twin."""
    if INTERPRET:
        return x.handle.data.item()  # NOTE: interpreter tensors wrap numpy arrays
    return x


@triton.jit
def online_softmax_rows(m_run, s_run, sm):
    """One tile of a running softmax normaliser per row: ``sm`` [R, N] logits (-inf
    where masked), ``m_run`` / ``s_run`` [R] the running max and sum of exp; returns
    the updated pair (no NaN when a row has seen only -inf)."""
    m_new = tl.maximum(m_run, tl.max(sm, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, s_run * tl.exp(m_run - m_safe) + tl.sum(tl.exp(sm - m_safe[:, None]), axis=1)


@triton.jit
def dot_t(a, b, IEEE: tl.constexpr):
    """``a @ b.T`` on the tensor cores (fp32 accumulate); ``IEEE``: full fp32 precision
    (the fp32 reference path) instead of TF32."""
    if IEEE:
        r = tl.dot(a, tl.trans(b), input_precision="ieee")
    else:
        r = tl.dot(a, tl.trans(b))
    return r

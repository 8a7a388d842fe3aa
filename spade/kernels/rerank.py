"""Re-rank of candidate tokens with the true query (two-stage selection, stage 2).

A cache rank that selects one step ahead with a *predicted* query returns ``M = m * K``
candidate positions per (batch row, KV head) instead of K. The inference rank, which
has the step's *true* query, scores only those candidates and keeps the best K:

1. logits ``s_g[j] = scale * q_g · k[cand[j]]`` for the G query heads of the KV head
   (fp32 products, q rounded to the keys' dtype, as ``spade.kernels.scoring``);
2. the group reduction over the *valid candidates only* (``-1`` slots are not
   candidates): ``sum_logits`` Σ_g s_g, ``max_logits`` max_g s_g, ``sum_softmax``
   Σ_g softmax_j(s_g) — each head's softmax normalised over the candidates, the only
   keys the inference rank reads;
3. the ``keep`` highest scores, ties broken by candidate slot (the lower slot wins),
   written compacted in candidate-slot order, ``-1`` padding when fewer than ``keep``
   candidates are valid.

``rerank_select_ref`` is the plain-torch reference; ``rerank_select_triton`` runs two
launches. The scoring kernel, grid (b * KV head, split of the candidates), gathers the
candidates' key rows of its split in tiles of ``BLOCK_M`` (one ``tl.dot`` per tile with
the group's queries, padded to 16 rows) and writes the group-reduced scores, or for
``sum_softmax`` the logits and its per-head online (max, sum of exponentials); the split
spreads the key reads over the GPU (one program per (b, KV head) would leave most SMs
idle at small batch). The select kernel, one program per (b, KV head), merges the
splits' statistics into scores, finds the keep-th largest by a bisection on the scores'
order-preserving uint32 keys (32 counting sweeps over the row's 4-byte scores, L2
resident by then) and emits the winners. Everything is device-side with fixed shapes
(no host sync: CUDA-graph safe). The attention over sinks + the kept tokens + the recent
window is the suite's indexed attention (``spade.kernels.attention``): a third launch.
Fusing the attend into the select saves re-reading the kept keys (K of the M just read)
at the cost of the attention kernel's split-K parallelism; measure before doing it.

Example (CPU reference)::

    >>> import torch
    >>> q = torch.randn(1, 2, 8); k = torch.randn(1, 1, 12, 8)
    >>> cand = torch.tensor([[[3, 7, 5, -1, 9]]], dtype=torch.int32)
    >>> kept = rerank_select_ref(q, k, cand, 2)
    >>> tuple(kept.shape), bool(((kept == 3) | (kept == 5) | (kept == 7) | (kept == 9)).all())
    ((1, 1, 2), True)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spade.kernels.common import _interpret, _load_group_q, _split, dot_t, online_softmax_rows
from spade.kernels.pdl import grid_dep_release, grid_dep_wait, pdl_kwargs
from spade.kernels.radix_topk import _f32_key
from spade.kernels.scoring import _reduce_ref

__all__ = ["rerank_select_ref", "rerank_select_triton", "rerank_scores_ref", "RERANK_CONFIG"]

_REDUCES = {"sum_logits": 0, "max_logits": 1, "sum_softmax": 2}

RERANK_CONFIG: dict = {}
"""Overrides for ``rerank_select_triton``'s launch (``BLOCK_M``, ``num_warps``); empty = the
built-in heuristic (the micro-benchmark ``benchmarks.bench_rerank`` sweeps it)."""


def _check(q: torch.Tensor, k: torch.Tensor, cand: torch.Tensor, keep: int, reduce: str) -> tuple[int, ...]:
    if q.dim() != 3 or k.dim() != 4:
        raise ValueError(f"q must be [B, Hq, D] and k [B, Hkv, L, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, Hq, D = q.shape
    if k.shape[0] != B or k.shape[3] != D or Hq % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree (batch, head dim, or Hq % Hkv != 0)")
    Hkv = k.shape[1]
    if cand.dim() != 3 or cand.shape[:2] != (B, Hkv):
        raise ValueError(f"candidates must be [B, Hkv, M] = [{B}, {Hkv}, M], got {tuple(cand.shape)}")
    if cand.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"candidates must be int32 (or int64), got {cand.dtype}")
    if keep < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    if reduce not in _REDUCES:
        raise ValueError(f"reduce must be one of {sorted(_REDUCES)}, got {reduce!r}")
    if not k.dtype.is_floating_point:
        raise ValueError(f"the re-rank scores exact keys (a float dtype), got {k.dtype}")
    return B, Hq, Hkv, D, cand.shape[2]


def rerank_scores_ref(q: torch.Tensor, k: torch.Tensor, cand: torch.Tensor, *, scale: float | None = None,
                      reduce: str = "sum_softmax") -> torch.Tensor:
    """Group scores of the candidates: [B, Hkv, M] float32, ``-inf`` at ``-1`` slots.

    ``q`` [B, Hq, D], ``k`` [B, Hkv, L, D], ``cand`` [B, Hkv, M] int (positions into k's
    L, ``-1`` = empty). ``sum_softmax`` normalises each head over the valid candidates."""
    B, Hq, Hkv, D, M = _check(q, k, cand, 0, reduce)
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else float(scale)
    valid = cand >= 0  # [B, Hkv, M]
    pos = cand.long().clamp(min=0)
    kc = k.gather(2, pos[..., None].expand(B, Hkv, M, D)).float()  # [B, Hkv, M, D]
    qg = (q if q.dtype == k.dtype else q.to(k.dtype)).float().reshape(B, Hkv, G, D)
    logits = torch.einsum("bhgd,bhmd->bhgm", qg, kc) * scale  # [B, Hkv, G, M]
    return _reduce_ref(logits, valid, valid, reduce)  # sum_softmax: over the valid candidates


def rerank_select_ref(q: torch.Tensor, k: torch.Tensor, cand: torch.Tensor, keep: int, *,
                      scale: float | None = None, reduce: str = "sum_softmax") -> torch.Tensor:
    """The ``keep`` best candidates by the true query ``q``: int32 [B, Hkv, keep], in
    candidate-slot order, ``-1`` padding (fewer than ``keep`` valid candidates); ties
    broken by the lower slot. See the module docstring."""
    B, Hq, Hkv, D, M = _check(q, k, cand, keep, reduce)
    out = torch.full((B, Hkv, keep), -1, dtype=torch.int32, device=q.device)
    if keep == 0 or M == 0:
        return out
    s = rerank_scores_ref(q, k, cand, scale=scale, reduce=reduce)
    valid = cand >= 0
    order = torch.sort(-s, dim=-1, stable=True).indices  # best first, ties by slot ([B, Hkv, M])
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(M, device=q.device).expand(B, Hkv, M))
    take = valid & (rank < keep)  # [B, Hkv, M]
    slot = torch.cumsum(take.long(), -1) - 1  # compacted output slot, in candidate order
    n = min(keep, M)
    dst = torch.where(take, slot, torch.full_like(slot, keep))  # a spare column for the dropped
    buf = torch.full((B, Hkv, keep + 1), -1, dtype=torch.int32, device=q.device)
    buf.scatter_(-1, dst, torch.where(take, cand.to(torch.int32), torch.full_like(cand, -1, dtype=torch.int32)))
    out[..., :n] = buf[..., :n]
    return out


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------


@triton.jit
def _cand_keys(c_base, sc_base, offs_m, M, stride_cm):
    """A tile of candidates and their scores' order-preserving int64 keys (-1 for an
    empty slot or past the end; valid keys are > 0)."""
    cand = tl.load(c_base + offs_m * stride_cm, mask=offs_m < M, other=-1)
    sv = tl.load(sc_base + offs_m, mask=offs_m < M, other=0.0)
    return cand, tl.where(cand >= 0, _f32_key(sv).to(tl.int64), -1)


@triton.jit
def _rerank_score_kernel(Q, K, CAND, LOGITS, SCORES, PART, Hkv, M, CHUNK, NSPLIT, scale,
                         stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kl, stride_kd,
                         stride_cb, stride_ch, stride_cm,
                         G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_M: tl.constexpr, REDUCE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                         PDL: tl.constexpr):
    """Grid (B * Hkv, NSPLIT): the logits of candidates ``[split * CHUNK, +CHUNK)`` of one
    (b, KV head). sum_softmax: the logits to LOGITS [rows, G_PAD, M] and the split's
    per-head (max, sum of exponentials) to PART [rows, NSPLIT, 2, G_PAD]; otherwise the
    group-reduced scores straight to SCORES [rows, M]."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // Hkv
    h = pid % Hkv
    row64 = pid.to(tl.int64)
    grid_dep_wait(PDL)
    q = _load_group_q(Q, b, h, stride_qb, stride_qh, stride_qd, G, G_PAD, D, BLOCK_D)  # [G_PAD, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    else:
        q = q.to(K.dtype.element_ty)  # the query as scored: rounded to the keys' dtype
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < G
    c_base = CAND + b.to(tl.int64) * stride_cb + h.to(tl.int64) * stride_ch
    k_base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    lg_base = LOGITS + row64 * G_PAD * M
    m_run = tl.full([G_PAD], float("-inf"), tl.float32)
    s_run = tl.zeros([G_PAD], tl.float32)
    m0 = split * CHUNK
    end = tl.minimum(m0 + CHUNK, M)
    while m0 < end:  # NOTE: while loops: the interpreter takes no tensor bounds in range()
        offs_m = m0 + tl.arange(0, BLOCK_M)
        cand = tl.load(c_base + offs_m * stride_cm, mask=offs_m < end, other=-1)
        valid = cand >= 0
        pos = tl.where(valid, cand, 0).to(tl.int64)
        kt = tl.load(k_base + pos[:, None] * stride_kl + offs_d[None, :] * stride_kd,
                     mask=valid[:, None] & (offs_d[None, :] < D), other=0.0)  # [BLOCK_M, BLOCK_D]
        if UPCAST:
            kt = kt.to(tl.float32)
        s = dot_t(q, kt, IEEE) * scale  # [G_PAD, BLOCK_M] fp32
        if REDUCE == 2:
            tl.store(lg_base + offs_g[:, None] * M + offs_m[None, :], s, mask=offs_m[None, :] < end)
            m_run, s_run = online_softmax_rows(m_run, s_run, tl.where(valid[None, :], s, float("-inf")))
        else:
            if REDUCE == 0:
                r = tl.sum(s, axis=0)  # padded query rows are zero
            else:
                r = tl.max(tl.where(g_mask[:, None], s, float("-inf")), axis=0)
            tl.store(SCORES + row64 * M + offs_m, tl.where(valid, r, float("-inf")), mask=offs_m < end)
        m0 += BLOCK_M
    if REDUCE == 2:
        p_base = PART + (row64 * NSPLIT + split) * 2 * G_PAD
        tl.store(p_base + offs_g, m_run)
        tl.store(p_base + G_PAD + offs_g, s_run)
    grid_dep_release(PDL)


@triton.jit
def _rerank_select_kernel(CAND, OUT, LOGITS, SCORES, PART, M, KEEP, NSPLIT,
                          stride_cb, stride_ch, stride_cm, stride_ob, stride_oh, stride_ok, Hkv,
                          G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, REDUCE: tl.constexpr,
                          PDL: tl.constexpr):
    """One program per (b, KV head): the scores (sum_softmax: from the logits and the
    merged per-split statistics), then the KEEP best, compacted in slot order."""
    pid = tl.program_id(0)
    b = pid // Hkv
    h = pid % Hkv
    row64 = pid.to(tl.int64)
    grid_dep_wait(PDL)
    offs_g = tl.arange(0, G_PAD)
    g_mask = offs_g < G
    c_base = CAND + b.to(tl.int64) * stride_cb + h.to(tl.int64) * stride_ch
    sc_base = SCORES + row64 * M
    m_safe = tl.zeros([G_PAD], tl.float32)
    inv_z = tl.zeros([G_PAD], tl.float32)
    if REDUCE == 2:  # each head's softmax statistics over every split
        m_run = tl.full([G_PAD], float("-inf"), tl.float32)
        s_run = tl.zeros([G_PAD], tl.float32)
        sp = 0
        while sp < NSPLIT:
            p_base = PART + (row64 * NSPLIT + sp) * 2 * G_PAD
            pm = tl.load(p_base + offs_g)
            ps = tl.load(p_base + G_PAD + offs_g)
            m_new = tl.maximum(m_run, pm)
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s_run = s_run * tl.exp(m_run - m_new_safe) + ps * tl.exp(pm - m_new_safe)
            m_run = m_new
            sp += 1
        m_safe = tl.where(m_run == float("-inf"), 0.0, m_run)
        inv_z = tl.where(g_mask & (s_run > 0), 1.0 / tl.where(s_run > 0, s_run, 1.0), 0.0)
    lg_base = LOGITS + row64 * G_PAD * M
    n_valid = 0
    m0 = 0
    while m0 < M:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        cand = tl.load(c_base + offs_m * stride_cm, mask=offs_m < M, other=-1)
        valid = cand >= 0
        n_valid += tl.sum(valid.to(tl.int32), axis=0)
        if REDUCE == 2:  # each head's probability over the valid candidates, summed
            lg = tl.load(lg_base + offs_g[:, None] * M + offs_m[None, :], mask=offs_m[None, :] < M, other=0.0)
            p = tl.exp(lg - m_safe[:, None]) * inv_z[:, None]
            r = tl.sum(tl.where(g_mask[:, None] & valid[None, :], p, 0.0), axis=0)
            tl.store(sc_base + offs_m, tl.where(valid, r, float("-inf")), mask=offs_m < M)
        m0 += BLOCK_M
    # the keep-th largest key, bit by bit from the most significant (keys of valid
    # candidates are > 0: -inf maps to 0x007FFFFF, and invalid slots count as -1)
    k_eff = tl.minimum(n_valid, KEEP)
    thr = tl.full([], 0, tl.int64)  # every valid candidate is kept when there are <= KEEP
    if n_valid > KEEP:
        for i in range(32):
            t = thr | (tl.full([], 1, tl.int64) << (31 - i))
            cnt = 0
            m0 = 0
            while m0 < M:
                offs_m = m0 + tl.arange(0, BLOCK_M)
                cand, key = _cand_keys(c_base, sc_base, offs_m, M, stride_cm)
                cnt += tl.sum((key >= t).to(tl.int32), axis=0)
                m0 += BLOCK_M
            thr = tl.where(cnt >= k_eff, t, thr)
    # the winners (key > thr, then ties at thr by slot) compacted in slot order
    n_gt = 0
    m0 = 0
    while m0 < M:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        cand, key = _cand_keys(c_base, sc_base, offs_m, M, stride_cm)
        n_gt += tl.sum((key > thr).to(tl.int32), axis=0)
        m0 += BLOCK_M
    eq_left = k_eff - n_gt  # ties at the threshold still to take
    o_base = OUT + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    done = 0
    m0 = 0
    while m0 < M:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        cand, key = _cand_keys(c_base, sc_base, offs_m, M, stride_cm)
        eq = (key == thr) & (cand >= 0)
        eq_rank = tl.cumsum(eq.to(tl.int32), axis=0) - 1
        take = (key > thr) | (eq & (eq_rank < eq_left))
        eq_left -= tl.sum(eq.to(tl.int32), axis=0)
        slot = done + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(o_base + slot.to(tl.int64) * stride_ok, cand.to(tl.int32), mask=take & (slot < KEEP))
        done += tl.sum(take.to(tl.int32), axis=0)
        m0 += BLOCK_M
    k0 = 0
    while k0 < KEEP:
        offs_k = k0 + tl.arange(0, BLOCK_M)
        tl.store(o_base + offs_k.to(tl.int64) * stride_ok, tl.full([BLOCK_M], -1, tl.int32),
                 mask=(offs_k >= done) & (offs_k < KEEP))
        k0 += BLOCK_M
    grid_dep_release(PDL)


def _config(M: int, rows: int, device: torch.device) -> dict:
    """Tiles and the split of the candidates over programs (``RERANK_CONFIG`` overrides)."""
    if _interpret() or device.type != "cuda":
        cfg = dict(BLOCK_M=max(16, min(128, triton.next_power_of_2(max(M, 1)))), num_warps=1, MIN_CHUNK=256,
                   PER_SM=4)
    else:  # untuned: benchmarks.bench_rerank sweeps it
        cfg = dict(BLOCK_M=64, num_warps=4, MIN_CHUNK=512, PER_SM=4, SELECT_BLOCK=1024, select_warps=4)
    cfg.update(RERANK_CONFIG)
    cfg.setdefault("SELECT_BLOCK", cfg["BLOCK_M"])
    cfg.setdefault("select_warps", cfg["num_warps"])
    chunk, n = _split(M, rows, device, block=cfg["BLOCK_M"], min_chunk=cfg["MIN_CHUNK"], per_sm=cfg["PER_SM"])
    cfg["CHUNK"], cfg["NSPLIT"] = chunk, n
    return cfg


def rerank_select_triton(q: torch.Tensor, k: torch.Tensor, cand: torch.Tensor, keep: int, *,
                         scale: float | None = None, reduce: str = "sum_softmax",
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton ``rerank_select_ref`` (one launch; same result up to the products' rounding,
    which can only reorder near-ties). ``out``: a contiguous int32 [B, Hkv, keep] buffer
    to write (returned); else a new one."""
    B, Hq, Hkv, D, M = _check(q, k, cand, keep, reduce)
    dev = q.device
    if out is None:
        out = torch.empty(B, Hkv, keep, dtype=torch.int32, device=dev)
    elif out.shape != (B, Hkv, keep) or out.dtype != torch.int32 or out.device != dev:
        raise ValueError(f"out must be int32 [{B}, {Hkv}, {keep}] on {dev}, got {out.dtype} {tuple(out.shape)} "
                         f"on {out.device}")
    if keep == 0:
        return out
    if M == 0:
        return out.fill_(-1)
    cand = cand.to(dev)
    G = Hq // Hkv
    G_PAD = max(16, triton.next_power_of_2(G))
    BLOCK_D = max(16, triton.next_power_of_2(D))
    red = _REDUCES[reduce]
    rows = B * Hkv
    cfg = _config(M, rows, dev)
    nsplit = cfg["NSPLIT"]
    logits = torch.empty(rows * G_PAD * M if red == 2 else 1, dtype=torch.float32, device=dev)
    scores = torch.empty(rows * M, dtype=torch.float32, device=dev)
    part = torch.empty(rows * nsplit * 2 * G_PAD if red == 2 else 1, dtype=torch.float32, device=dev)
    upcast = _interpret()
    ieee = k.dtype == torch.float32 and not upcast
    scale = D ** -0.5 if scale is None else float(scale)
    _rerank_score_kernel[(rows, nsplit)](
        q, k, cand, logits, scores, part, Hkv, M, cfg["CHUNK"], nsplit, scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), k.stride(3),
        cand.stride(0), cand.stride(1), cand.stride(2),
        G=G, G_PAD=G_PAD, D=D, BLOCK_D=BLOCK_D, BLOCK_M=cfg["BLOCK_M"], REDUCE=red, UPCAST=upcast, IEEE=ieee,
        num_warps=cfg["num_warps"], **pdl_kwargs(q))
    _rerank_select_kernel[(rows,)](
        cand, out, logits, scores, part, M, keep, nsplit,
        cand.stride(0), cand.stride(1), cand.stride(2), out.stride(0), out.stride(1), out.stride(2), Hkv,
        G=G, G_PAD=G_PAD, BLOCK_M=cfg["SELECT_BLOCK"], REDUCE=red, num_warps=cfg["select_warps"],
        **pdl_kwargs(q))
    return out

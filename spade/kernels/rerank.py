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
launches, or one fused:

* **Scoring**, grid (b * KV head, chunk of the candidates): gathers the candidates' key
  rows in tiles of ``BLOCK_M`` (one ``tl.dot`` per tile with the group's queries, padded
  to 16 rows; a ``for`` loop, so the index load and the gather it feeds are pipelined)
  and writes the group-reduced scores, or for ``sum_softmax`` the G heads' logits and
  each head's online (max, sum of exponentials) per chunk. The chunks spread the key
  reads (M * D * 2 bytes per row: 1 MB at M=4096, d=128, bf16) over the GPU; one
  program per (b, KV head) would leave most SMs idle at small batch.
* **Select**, one program per (b, KV head): merges the chunks' statistics into scores
  and finds the keep-th largest score's order-preserving uint32 key by a radix select,
  four 8-bit digits most significant first (``tl.histogram`` of the keys still tied
  with the chosen prefix). The passes give the threshold and how many keys equal to it
  to take (the first ones by slot); the winners are emitted compacted in slot order by
  a ``tl.cumsum``, then ``-1`` padding. The row's M keys (``M`` rounded up to a power
  of two <= ``SELECT_MAX``, 8192 on GPU) are computed once into registers and every
  pass runs on them: four register passes, no chain of dependent sweeps over memory.
* **Wide rows** (``M`` past ``SELECT_MAX``: ``rerank: 8`` at K = 2048 has 15,840): the
  scores go to memory (``sum_softmax``: a finalize launch over (row, chunk) programs
  forms them from the logits), the multi-program radix passes of ``radix_topk`` find
  each row's keep best (any order, ties by arrival), and one program per row emits
  them as the registers path does: the threshold is the smallest selected key, every
  key above it is taken and the first ones equal to it by slot, in slot order. (One
  program per row sweeping the row in tiles, four histogram passes and the emission,
  took 0.3 ms per layer at B=8, M=15,840 on an H100.)
* **Fused** (``RERANK_CONFIG["FUSE"]``; by default wherever the split gives one chunk
  per row, i.e. the rows alone fill the GPU): one program scores its row, then selects
  after a barrier, saving the second launch.

Everything is device-side with fixed shapes (no host sync: CUDA-graph safe), PDL hooks
on every launch. The attention over sinks + the kept tokens + the recent window is the
suite's indexed attention (``spade.kernels.attention``): one more launch. Fusing the
attend into the select saves re-reading the kept keys (K of the M just read) at the
cost of the attention kernel's split-K parallelism; measure before doing it.

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

from spade.kernels.common import _interpret, _load_group_q, _split, dot_t, loop_bound, online_softmax_rows
from spade.kernels.paged import check_block_table, paged_slots, paged_to_contiguous
from spade.kernels.pdl import grid_dep_release, grid_dep_wait, pdl_kwargs
from spade.kernels.radix_topk import _f32_key, _new_workspace, _pick_digit, _select_from_scores
from spade.kernels.scoring import _reduce_ref

__all__ = ["rerank_select_ref", "rerank_select_triton", "rerank_scores_ref", "RERANK_CONFIG"]

_REDUCES = {"sum_logits": 0, "max_logits": 1, "sum_softmax": 2}

RERANK_CONFIG: dict = {}
"""Overrides for ``rerank_select_triton``'s launch; empty = the built-in heuristic
(``_config``; ``python -m benchmarks.bench_rerank --sweep`` times alternatives). Keys:
scoring ``BLOCK_M`` (candidates per tile), ``num_warps``, ``num_stages``, ``MIN_CHUNK``
and ``PER_SM`` (the split of a row's candidates over programs); select ``SELECT_MAX``
(the longest power-of-two row selected in registers; longer rows take the wide path),
``SELECT_BLOCK`` (the wide path's emission tile), ``select_warps`` (None: by the tile;
the fused launch runs with the larger of ``num_warps`` and ``select_warps``); ``FUSE``
(None: fuse scoring and select where the split gives one chunk per row; True: always,
one program per row; False: never; a wide row is never fused)."""


def _check(q: torch.Tensor, k: torch.Tensor, cand: torch.Tensor, keep: int, reduce: str,
           block_table: torch.Tensor | None = None) -> tuple[int, ...]:
    if q.dim() != 3 or k.dim() != 4:
        raise ValueError(f"q must be [B, Hq, D] and k [B, Hkv, L, D] (or a pool [num_blocks, Hkv, block_size, D] "
                         f"with block_table=), got {tuple(q.shape)} and {tuple(k.shape)}")
    B, Hq, D = q.shape
    if block_table is not None:
        check_block_table(block_table, B, k.device)
    if (block_table is None and k.shape[0] != B) or k.shape[3] != D or Hq % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree (batch, head dim, or Hq % Hkv != 0)"
                         + ("; a paged cache's pool [num_blocks, Hkv, block_size, D] needs block_table="
                            if block_table is None and k.shape[0] != B else ""))
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
                      reduce: str = "sum_softmax", block_table: torch.Tensor | None = None) -> torch.Tensor:
    """Group scores of the candidates: [B, Hkv, M] float32, ``-inf`` at ``-1`` slots.

    ``q`` [B, Hq, D], ``k`` [B, Hkv, L, D], ``cand`` [B, Hkv, M] int (positions into k's
    L, ``-1`` = empty). ``sum_softmax`` normalises each head over the valid candidates.
    ``block_table`` [B, max_blocks]: ``k`` is a paged pool (``spade.kernels.paged``) and
    ``cand`` holds logical positions."""
    B, Hq, Hkv, D, M = _check(q, k, cand, 0, reduce, block_table)
    if block_table is not None:
        k = paged_to_contiguous(k, block_table)
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else float(scale)
    valid = cand >= 0  # [B, Hkv, M]
    pos = cand.long().clamp(min=0)
    kc = k.gather(2, pos[..., None].expand(B, Hkv, M, D)).float()  # [B, Hkv, M, D]
    qg = (q if q.dtype == k.dtype else q.to(k.dtype)).float().reshape(B, Hkv, G, D)
    logits = torch.einsum("bhgd,bhmd->bhgm", qg, kc) * scale  # [B, Hkv, G, M]
    return _reduce_ref(logits, valid, valid, reduce)  # sum_softmax: over the valid candidates


def rerank_select_ref(q: torch.Tensor, k: torch.Tensor, cand: torch.Tensor, keep: int, *,
                      scale: float | None = None, reduce: str = "sum_softmax",
                      block_table: torch.Tensor | None = None) -> torch.Tensor:
    """The ``keep`` best candidates by the true query ``q``: int32 [B, Hkv, keep], in
    candidate-slot order, ``-1`` padding (fewer than ``keep`` valid candidates); ties
    broken by the lower slot. ``block_table``: ``k`` is a paged pool. See the module docstring."""
    B, Hq, Hkv, D, M = _check(q, k, cand, keep, reduce, block_table)
    out = torch.full((B, Hkv, keep), -1, dtype=torch.int32, device=q.device)
    if keep == 0 or M == 0:
        return out
    s = rerank_scores_ref(q, k, cand, scale=scale, reduce=reduce, block_table=block_table)
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
def _candidate_row(pid, Hkv, CAND, stride_cb, stride_ch):
    """Program ``pid``'s (b, KV head), its row index as int64 and its candidates' base."""
    b = pid // Hkv
    h = pid % Hkv
    return b, h, pid.to(tl.int64), CAND + b.to(tl.int64) * stride_cb + h.to(tl.int64) * stride_ch


@triton.jit
def _score_chunk(Q, K, CAND, LOGITS, SCORES, PART, BT, pid, split, Hkv, M, CHUNK, NSPLIT, scale,
                 stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kl, stride_kd,
                 stride_cb, stride_ch, stride_cm, stride_tb,
                 G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_M: tl.constexpr, REDUCE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                 PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr, INTERPRET: tl.constexpr):
    """The logits of candidates ``[split * CHUNK, +CHUNK)`` of row ``pid`` (b * Hkv + h).
    sum_softmax: the G heads' logits to LOGITS [rows, G, M] and the chunk's per-head
    (max, sum of exponentials) to PART [rows, NSPLIT, 2, G_PAD]; otherwise the
    group-reduced scores straight to SCORES [rows, M] (``-inf`` at empty slots).
    PAGED: K is a pool [num_blocks, Hkv, BLOCK_SIZE, D] (``stride_kb`` its block
    stride) and each candidate's logical position is mapped through row b's block
    table BT (``paged_slots``) in the tile that gathers its key."""
    b, h, row64, c_base = _candidate_row(pid, Hkv, CAND, stride_cb, stride_ch)
    q = _load_group_q(Q, b, h, stride_qb, stride_qh, stride_qd, G, G_PAD, D, BLOCK_D)  # [G_PAD, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    else:
        q = q.to(K.dtype.element_ty)  # the query as scored: rounded to the keys' dtype
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < G
    if PAGED:
        k_base = K + h.to(tl.int64) * stride_kh
        bt_row = BT + b.to(tl.int64) * stride_tb
    else:
        k_base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    lg_base = LOGITS + row64 * G * M
    m_run = tl.full([G_PAD], float("-inf"), tl.float32)
    s_run = tl.zeros([G_PAD], tl.float32)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, M)
    # a ``for`` over the tiles (not ``while``): the compiler pipelines the index load
    # and the key gather it feeds across iterations (``num_stages``)
    for m0 in range(loop_bound(start, INTERPRET), loop_bound(end, INTERPRET), BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        cand = tl.load(c_base + offs_m * stride_cm, mask=offs_m < end, other=-1)
        valid = cand >= 0
        if PAGED:
            slot = tl.where(valid, paged_slots(cand, bt_row, BLOCK_SIZE), 0).to(tl.int64)
            row_off = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kl
        else:
            row_off = tl.where(valid, cand, 0).to(tl.int64) * stride_kl
        kt = tl.load(k_base + row_off[:, None] + offs_d[None, :] * stride_kd,
                     mask=valid[:, None] & (offs_d[None, :] < D), other=0.0)  # [BLOCK_M, BLOCK_D]
        if UPCAST:
            kt = kt.to(tl.float32)
        s = dot_t(q, kt, IEEE) * scale  # [G_PAD, BLOCK_M] fp32
        if REDUCE == 2:  # only the G real heads' rows are written (not the dot's padding)
            tl.store(lg_base + offs_g[:, None] * M + offs_m[None, :], s,
                     mask=g_mask[:, None] & (offs_m[None, :] < end))
            m_run, s_run = online_softmax_rows(m_run, s_run, tl.where(valid[None, :], s, float("-inf")))
        else:
            if REDUCE == 0:
                r = tl.sum(s, axis=0)  # padded query rows are zero
            else:
                r = tl.max(tl.where(g_mask[:, None], s, float("-inf")), axis=0)
            tl.store(SCORES + row64 * M + offs_m, tl.where(valid, r, float("-inf")), mask=offs_m < end)
    if REDUCE == 2:
        p_base = PART + (row64 * NSPLIT + split) * 2 * G_PAD
        tl.store(p_base + offs_g, m_run)
        tl.store(p_base + G_PAD + offs_g, s_run)


@triton.jit
def _head_prob(lg_base, g, M, offs_m, valid, m_safe, inv_z, G_PAD: tl.constexpr):
    """Head g's softmax probabilities of a tile of candidates, exp(s_g - max_g) / Z_g
    (0 at empty slots)."""
    offs_g = tl.arange(0, G_PAD)
    m_g = tl.sum(tl.where(offs_g == g, m_safe, 0.0), axis=0)
    iz_g = tl.sum(tl.where(offs_g == g, inv_z, 0.0), axis=0)
    lg = tl.load(lg_base + g * M + offs_m, mask=valid, other=float("-inf"))
    return tl.exp(lg - m_g) * iz_g


@triton.jit
def _tile_keys(c_base, stride_cm, sc_base, lg_base, offs_m, M, m_safe, inv_z,
               G: tl.constexpr, G_PAD: tl.constexpr, BLOCK: tl.constexpr, REDUCE: tl.constexpr,
               FROM_LOGITS: tl.constexpr, UNROLL_G: tl.constexpr):
    """A tile of candidates: positions, validity, and the scores' order-preserving
    uint32 keys (``_f32_key``). FROM_LOGITS (sum_softmax): the score is computed from
    the G heads' logits, Σ_g exp(s_g - max_g) / Z_g, and returned as well; otherwise
    it is read from the row's scores."""
    cand = tl.load(c_base + offs_m * stride_cm, mask=offs_m < M, other=-1)
    valid = cand >= 0
    if FROM_LOGITS:  # one head's row of logits at a time: [BLOCK] registers, not [G, BLOCK]
        r = tl.zeros([BLOCK], tl.float32)
        if UNROLL_G:  # unrolled: the G loads in flight together
            for g in tl.static_range(G):
                r += _head_prob(lg_base, g, M, offs_m, valid, m_safe, inv_z, G_PAD)
        else:  # a loop: unrolled, G rows of loads in registers at once spill (``_unroll_g``)
            for g in range(G):
                r += _head_prob(lg_base, g, M, offs_m, valid, m_safe, inv_z, G_PAD)
    else:
        r = tl.load(sc_base + offs_m, mask=valid, other=float("-inf"))
    r = tl.where(valid, r, float("-inf"))
    return cand, valid, _f32_key(r), r


@triton.jit
def _radix_digit(key, sel, prefix, P: tl.constexpr):
    """Histogram [256] of digit P (8 bits, most significant first) of the selected keys
    tied with ``prefix`` on the higher digits."""
    if P > 0:
        sel = sel & ((key >> (32 - 8 * P)) == (prefix >> (32 - 8 * P)))
    return tl.histogram(((key >> (24 - 8 * P)) & 0xFF).to(tl.int32), 256, mask=sel)


@triton.jit
def _merge_parts(PART, row64, NSPLIT, G: tl.constexpr, G_PAD: tl.constexpr):
    """sum_softmax: each head's (max, 1 / sum of exponentials) over the row's candidates,
    merged from the NSPLIT chunks' statistics in PART (0 where a head saw none)."""
    offs_g = tl.arange(0, G_PAD)
    g_mask = offs_g < G
    m_run = tl.full([G_PAD], float("-inf"), tl.float32)
    s_run = tl.zeros([G_PAD], tl.float32)
    sp = 0
    while sp < NSPLIT:  # NOTE: while: the fused kernel passes NSPLIT as a literal 1
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
    return m_safe, inv_z


@triton.jit
def _emit_rest(o_base, stride_ok, done, KEEP, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """-1 in the slots past the ``done`` kept ones (fewer valid candidates than KEEP)."""
    for k0 in range(loop_bound((done // BLOCK) * BLOCK, INTERPRET), loop_bound(KEEP, INTERPRET), BLOCK):
        offs_k = k0 + tl.arange(0, BLOCK)
        tl.store(o_base + offs_k.to(tl.int64) * stride_ok, tl.full([BLOCK], -1, tl.int32),
                 mask=(offs_k >= done) & (offs_k < KEEP))


@triton.jit
def _select_row(CAND, OUT, LOGITS, SCORES, PART, pid, Hkv, M, KEEP, NSPLIT,
                stride_cb, stride_ch, stride_cm, stride_ob, stride_oh, stride_ok,
                G: tl.constexpr, G_PAD: tl.constexpr, BLOCK: tl.constexpr,
                UNROLL_G: tl.constexpr, REDUCE: tl.constexpr, INTERPRET: tl.constexpr):
    """The KEEP best candidates of row ``pid``, compacted in slot order, ``-1`` after.

    The row's M keys (BLOCK >= M) are computed once into registers; the keep-th largest
    score key is found by a radix select on them: four 8-bit digit passes
    (``tl.histogram`` of the keys still tied with the prefix chosen so far, then
    ``_pick_digit``), which also give how many keys equal to it are taken (the first
    ones by slot)."""
    b, h, row64, c_base = _candidate_row(pid, Hkv, CAND, stride_cb, stride_ch)
    sc_base = SCORES + row64 * M
    lg_base = LOGITS + row64 * G * M
    o_base = OUT + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    m_safe = tl.zeros([G_PAD], tl.float32)
    inv_z = tl.zeros([G_PAD], tl.float32)
    if REDUCE == 2:  # each head's softmax statistics, merged over the chunks
        m_safe, inv_z = _merge_parts(PART, row64, NSPLIT, G, G_PAD)
    offs = tl.arange(0, BLOCK)
    cand, valid, key, r = _tile_keys(c_base, stride_cm, sc_base, lg_base, offs, M, m_safe, inv_z,
                                     G, G_PAD, BLOCK, REDUCE, REDUCE == 2, UNROLL_G)
    k_rem = tl.minimum(tl.sum(valid.to(tl.int32), axis=0), KEEP)
    thr = tl.full([], 0, tl.uint32)
    for p in tl.static_range(4):
        d, k_rem = _pick_digit(_radix_digit(key, valid, thr, p), k_rem)
        thr = thr | (d.to(tl.uint32) << (24 - 8 * p))
    # thr is the key of the keep-th best (of every valid one when fewer): all keys
    # above it are taken, and the first k_rem equal to it
    eq = valid & (key == thr)
    take = (valid & (key > thr)) | (eq & (tl.cumsum(eq.to(tl.int32), axis=0) <= k_rem))
    slot = tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(o_base + slot.to(tl.int64) * stride_ok, cand.to(tl.int32), mask=take)
    done = tl.sum(take.to(tl.int32), axis=0)
    _emit_rest(o_base, stride_ok, done, KEEP, BLOCK, INTERPRET)


@triton.jit
def _rerank_finalize_kernel(CAND, LOGITS, SCORES, PART, Hkv, M, CHUNK, NSPLIT, stride_cb, stride_ch, stride_cm,
                            G: tl.constexpr, G_PAD: tl.constexpr, BLOCK: tl.constexpr, UNROLL_G: tl.constexpr,
                            INTERPRET: tl.constexpr, PDL: tl.constexpr):
    """Grid (B * Hkv, NSPLIT), wide rows with sum_softmax: the group's scores of one chunk
    of candidates, Σ_g exp(s_g - max_g) / Z_g from the heads' logits and the chunks'
    merged statistics, to SCORES [rows, M] (``-inf`` at empty slots)."""
    grid_dep_wait(PDL)
    pid = tl.program_id(0)
    b, h, row64, c_base = _candidate_row(pid, Hkv, CAND, stride_cb, stride_ch)
    sc_base = SCORES + row64 * M
    lg_base = LOGITS + row64 * G * M
    m_safe, inv_z = _merge_parts(PART, row64, NSPLIT, G, G_PAD)
    start = tl.program_id(1) * CHUNK
    end = tl.minimum(start + CHUNK, M)
    for m0 in range(loop_bound(start, INTERPRET), loop_bound(end, INTERPRET), BLOCK):
        offs = m0 + tl.arange(0, BLOCK)
        cand, valid, key, r = _tile_keys(c_base, stride_cm, sc_base, lg_base, offs, M, m_safe, inv_z,
                                         G, G_PAD, BLOCK, 2, True, UNROLL_G)
        tl.store(sc_base + offs, r, mask=offs < end)
    grid_dep_release(PDL)


@triton.jit
def _rerank_emit_kernel(CAND, OUT, SCORES, POS, Hkv, M, KEEP,
                        stride_cb, stride_ch, stride_cm, stride_ob, stride_oh, stride_ok,
                        BLOCK: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
    """Grid (B * Hkv,), wide rows: the radix passes' positions POS [rows, KEEP] (the keep
    best scores of SCORES [rows, M] in any order, ``-1`` past them) emitted as the
    registers path emits them. The threshold is the smallest selected key: every valid
    candidate above it is taken, and of those equal to it as many as were selected, the
    first ones by slot; the candidates in slot order, then ``-1``."""
    grid_dep_wait(PDL)
    pid = tl.program_id(0)
    b, h, row64, c_base = _candidate_row(pid, Hkv, CAND, stride_cb, stride_ch)
    sc_base = SCORES + row64 * M
    p_base = POS + row64 * KEEP
    o_base = OUT + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    # the smallest selected key and how many selected keys equal it (taken by slot below)
    top = tl.full([BLOCK], 0xFFFFFFFF, tl.uint32)
    thr = tl.max(top, axis=0)
    k_eq = 0
    for k0 in range(0, loop_bound(KEEP, INTERPRET), BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        pos = tl.load(p_base + offs, mask=offs < KEEP, other=-1)
        ok = pos >= 0
        key = tl.where(ok, _f32_key(tl.load(sc_base + pos, mask=ok, other=0.0)), top)
        t_min = tl.min(key, axis=0)
        t_cnt = tl.sum((ok & (key == t_min)).to(tl.int32), axis=0)
        k_eq = tl.where(t_min < thr, t_cnt, tl.where(t_min == thr, k_eq + t_cnt, k_eq))
        thr = tl.minimum(thr, t_min)
    done = 0
    n_eq = 0
    for m0 in range(0, loop_bound(M, INTERPRET), BLOCK):
        offs = m0 + tl.arange(0, BLOCK)
        cand = tl.load(c_base + offs * stride_cm, mask=offs < M, other=-1)
        valid = cand >= 0
        key = _f32_key(tl.load(sc_base + offs, mask=valid, other=float("-inf")))
        eq = valid & (key == thr)
        take = (valid & (key > thr)) | (eq & (n_eq + tl.cumsum(eq.to(tl.int32), axis=0) <= k_eq))
        slot = done + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(o_base + slot.to(tl.int64) * stride_ok, cand.to(tl.int32), mask=take)
        done += tl.sum(take.to(tl.int32), axis=0)
        n_eq += tl.sum(eq.to(tl.int32), axis=0)
    _emit_rest(o_base, stride_ok, done, KEEP, BLOCK, INTERPRET)
    grid_dep_release(PDL)


@triton.jit
def _rerank_score_kernel(Q, K, CAND, LOGITS, SCORES, PART, BT, Hkv, M, CHUNK, NSPLIT, scale,
                         stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kl, stride_kd,
                         stride_cb, stride_ch, stride_cm, stride_tb,
                         G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_M: tl.constexpr, REDUCE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                         PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr, INTERPRET: tl.constexpr,
                         PDL: tl.constexpr):
    """Grid (B * Hkv, NSPLIT): ``_score_chunk`` of one chunk of one (b, KV head)."""
    grid_dep_wait(PDL)
    _score_chunk(Q, K, CAND, LOGITS, SCORES, PART, BT, tl.program_id(0), tl.program_id(1), Hkv, M, CHUNK, NSPLIT,
                 scale, stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kl, stride_kd,
                 stride_cb, stride_ch, stride_cm, stride_tb, G, G_PAD, D, BLOCK_D, BLOCK_M, REDUCE, UPCAST, IEEE,
                 PAGED, BLOCK_SIZE, INTERPRET)
    grid_dep_release(PDL)


@triton.jit
def _rerank_select_kernel(CAND, OUT, LOGITS, SCORES, PART, Hkv, M, KEEP, NSPLIT,
                          stride_cb, stride_ch, stride_cm, stride_ob, stride_oh, stride_ok,
                          G: tl.constexpr, G_PAD: tl.constexpr, BLOCK: tl.constexpr,
                          UNROLL_G: tl.constexpr, REDUCE: tl.constexpr, INTERPRET: tl.constexpr,
                          PDL: tl.constexpr):
    """Grid (B * Hkv,): ``_select_row`` of one (b, KV head)."""
    grid_dep_wait(PDL)
    _select_row(CAND, OUT, LOGITS, SCORES, PART, tl.program_id(0), Hkv, M, KEEP, NSPLIT,
                stride_cb, stride_ch, stride_cm, stride_ob, stride_oh, stride_ok,
                G, G_PAD, BLOCK, UNROLL_G, REDUCE, INTERPRET)
    grid_dep_release(PDL)


@triton.jit
def _rerank_fused_kernel(Q, K, CAND, OUT, LOGITS, SCORES, PART, BT, Hkv, M, KEEP, scale,
                         stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kl, stride_kd,
                         stride_cb, stride_ch, stride_cm, stride_tb, stride_ob, stride_oh, stride_ok,
                         G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
                         UNROLL_G: tl.constexpr, REDUCE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                         PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr, INTERPRET: tl.constexpr,
                         PDL: tl.constexpr):
    """Grid (B * Hkv,): one program scores all M candidates of its (b, KV head), then
    selects (one launch; the logits go through its own L1/L2 between the two)."""
    pid = tl.program_id(0)
    grid_dep_wait(PDL)
    _score_chunk(Q, K, CAND, LOGITS, SCORES, PART, BT, pid, 0, Hkv, M, M, 1, scale,
                 stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kl, stride_kd,
                 stride_cb, stride_ch, stride_cm, stride_tb, G, G_PAD, D, BLOCK_D, BLOCK_M, REDUCE, UPCAST, IEEE,
                 PAGED, BLOCK_SIZE, INTERPRET)
    tl.debug_barrier()  # the logits / scores written above are read by other threads of this program
    _select_row(CAND, OUT, LOGITS, SCORES, PART, pid, Hkv, M, KEEP, 1,
                stride_cb, stride_ch, stride_cm, stride_ob, stride_oh, stride_ok,
                G, G_PAD, BLOCK, UNROLL_G, REDUCE, INTERPRET)
    grid_dep_release(PDL)


_CONFIG_KEYS = {"BLOCK_M", "num_warps", "num_stages", "MIN_CHUNK", "PER_SM", "SELECT_MAX", "SELECT_BLOCK",
                "select_warps", "FUSE"}


def _config(M: int, rows: int, device: torch.device) -> dict:
    """Tiles, warps, the split of the candidates over programs and the fusion
    (``RERANK_CONFIG`` overrides)."""
    bad = sorted(set(RERANK_CONFIG) - _CONFIG_KEYS)
    if bad:
        raise ValueError(f"RERANK_CONFIG has unknown keys {bad}: use only {sorted(_CONFIG_KEYS)}")
    if _interpret() or device.type != "cuda":
        cfg = dict(BLOCK_M=max(16, min(128, triton.next_power_of_2(max(M, 1)))), num_warps=1, num_stages=1,
                   MIN_CHUNK=256, PER_SM=4, SELECT_MAX=4096, SELECT_BLOCK=256, select_warps=1, FUSE=None)
    else:  # untuned: benchmarks.bench_rerank --sweep times the alternatives
        cfg = dict(BLOCK_M=64, num_warps=4, num_stages=3, MIN_CHUNK=512, PER_SM=4, SELECT_MAX=8192,
                   SELECT_BLOCK=1024, select_warps=None, FUSE=None)
    cfg.update(RERANK_CONFIG)
    m_pad = triton.next_power_of_2(max(M, 16))
    cfg["ONE_TILE"] = m_pad <= cfg["SELECT_MAX"]  # else the wide path: the radix passes, then the emission
    cfg["BLOCK"] = m_pad if cfg["ONE_TILE"] else cfg["SELECT_BLOCK"]
    if cfg["select_warps"] is None:  # <= 8 keys per thread (sm_90: 93 registers at 4096 x 16 warps, sum_softmax)
        cfg["select_warps"] = max(4, min(16, cfg["BLOCK"] // 256))
    if cfg["FUSE"] is True and cfg["ONE_TILE"]:
        cfg["CHUNK"], cfg["NSPLIT"] = M, 1
    else:
        chunk, n = _split(M, rows, device, block=cfg["BLOCK_M"], min_chunk=cfg["MIN_CHUNK"], per_sm=cfg["PER_SM"])
        cfg["CHUNK"], cfg["NSPLIT"] = chunk, n
    # auto (None): fused where the split leaves one program per row anyway (then the
    # second launch is pure overhead); a split row needs the merge of its chunks first;
    # a wide row is never fused (its select is the multi-program radix passes)
    cfg["FUSED"] = cfg["ONE_TILE"] and (cfg["NSPLIT"] == 1 if cfg["FUSE"] is None else bool(cfg["FUSE"]))
    # the fused program holds the select's row too: at least the select's warps (at 4
    # warps a 4096-key row spills on sm_90)
    cfg["fused_warps"] = max(cfg["num_warps"], cfg["select_warps"])
    return cfg


def _unroll_g(G: int, block: int, warps: int) -> bool:
    """Whether the select loads its G heads' logit rows all at once (unrolled): while
    they hold <= 64 registers per thread (sm_90: G=7 at 8192 keys x 16 warps spilled
    1.3 KB per thread unrolled, G=4 136 B)."""
    return G * block <= 64 * 32 * warps


def rerank_select_triton(q: torch.Tensor, k: torch.Tensor, cand: torch.Tensor, keep: int, *,
                         scale: float | None = None, reduce: str = "sum_softmax",
                         out: torch.Tensor | None = None, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """Triton ``rerank_select_ref`` (two launches, or one fused; same result up to the
    products' rounding, which can only reorder near-ties). ``out``: a contiguous int32
    [B, Hkv, keep] buffer to write (returned); else a new one. ``block_table``
    [B, max_blocks] int32: ``k`` is a paged pool [num_blocks, Hkv, block_size, D] and the
    scoring maps each candidate through the table where it gathers the key (no copy of
    the candidates' keys)."""
    B, Hq, Hkv, D, M = _check(q, k, cand, keep, reduce, block_table)
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
    logits = torch.empty(rows * G * M if red == 2 else 1, dtype=torch.float32, device=dev)
    wide = not cfg["ONE_TILE"]
    scores = torch.empty(rows * M if red != 2 or wide else 1, dtype=torch.float32, device=dev)
    part = torch.empty(rows * nsplit * 2 * G_PAD if red == 2 else 1, dtype=torch.float32, device=dev)
    interp = _interpret()
    ieee = k.dtype == torch.float32 and not interp
    scale = D ** -0.5 if scale is None else float(scale)
    paged = block_table is not None
    bt = block_table if paged else cand  # (unread when not paged)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), k.stride(3),
               cand.stride(0), cand.stride(1), cand.stride(2), bt.stride(0) if paged else 0)
    o_strides = (out.stride(0), out.stride(1), out.stride(2))
    page = dict(PAGED=paged, BLOCK_SIZE=k.shape[2] if paged else 1)
    if cfg["FUSED"]:
        _rerank_fused_kernel[(rows,)](
            q, k, cand, out, logits, scores, part, bt, Hkv, M, keep, scale, *strides, *o_strides,
            G=G, G_PAD=G_PAD, D=D, BLOCK_D=BLOCK_D, BLOCK_M=cfg["BLOCK_M"], BLOCK=cfg["BLOCK"],
            UNROLL_G=_unroll_g(G, cfg["BLOCK"], cfg["fused_warps"]), REDUCE=red,
            UPCAST=interp, IEEE=ieee, INTERPRET=interp, **page,
            num_warps=cfg["fused_warps"], num_stages=cfg["num_stages"], **pdl_kwargs(q))
        return out
    _rerank_score_kernel[(rows, nsplit)](
        q, k, cand, logits, scores, part, bt, Hkv, M, cfg["CHUNK"], nsplit, scale, *strides,
        G=G, G_PAD=G_PAD, D=D, BLOCK_D=BLOCK_D, BLOCK_M=cfg["BLOCK_M"], REDUCE=red, UPCAST=interp, IEEE=ieee,
        INTERPRET=interp, **page, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_kwargs(q))
    if wide:
        _wide_select(cand, out, logits, scores, part, B, Hkv, M, keep, red, G, G_PAD, cfg, interp, q)
        return out
    _rerank_select_kernel[(rows,)](
        cand, out, logits, scores, part, Hkv, M, keep, nsplit, *strides[7:10], *o_strides,
        G=G, G_PAD=G_PAD, BLOCK=cfg["BLOCK"],
        UNROLL_G=_unroll_g(G, cfg["BLOCK"], cfg["select_warps"]), REDUCE=red, INTERPRET=interp,
        num_warps=cfg["select_warps"], **pdl_kwargs(q))
    return out


def _wide_select(cand, out, logits, scores, part, B, Hkv, M, keep, red, G, G_PAD, cfg, interp, q) -> None:
    """A row past ``SELECT_MAX``: its scores in memory (``sum_softmax``: formed from the
    logits by (row, chunk) programs), the radix passes' keep best positions of each
    row, then the emission in slot order (``_rerank_emit_kernel``)."""
    rows = B * Hkv
    c_strides = (cand.stride(0), cand.stride(1), cand.stride(2))
    if red == 2:
        _rerank_finalize_kernel[(rows, cfg["NSPLIT"])](
            cand, logits, scores, part, Hkv, M, cfg["CHUNK"], cfg["NSPLIT"], *c_strides,
            G=G, G_PAD=G_PAD, BLOCK=cfg["BLOCK_M"], UNROLL_G=_unroll_g(G, cfg["BLOCK_M"], cfg["num_warps"]),
            INTERPRET=interp, num_warps=cfg["num_warps"], **pdl_kwargs(q))
    lo = torch.zeros(B, dtype=torch.int32, device=q.device)
    hi = torch.full((B,), M, dtype=torch.int32, device=q.device)
    pos = torch.empty(rows, keep, dtype=torch.int32, device=q.device)
    _select_from_scores(scores.view(rows, M), lo, hi, keep, Hkv, _new_workspace(rows, q.device), hist0_done=False,
                        out=pos, launch=pdl_kwargs(q))
    _rerank_emit_kernel[(rows,)](
        cand, out, scores, pos, Hkv, M, keep, *c_strides, out.stride(0), out.stride(1), out.stride(2),
        BLOCK=cfg["SELECT_BLOCK"], INTERPRET=interp, num_warps=cfg["select_warps"], **pdl_kwargs(q))

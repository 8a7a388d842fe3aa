"""spade's one kernel suite, shared by every policy.

Each op lives in its own module with a plain-torch reference (``*_ref``) and a
Triton implementation (``*_triton``) side by side. The public functions below
dispatch: Triton for CUDA tensors, the torch reference elsewhere. Set
``SPADE_KERNELS=triton`` to force Triton (on CPU that needs ``TRITON_INTERPRET=1``
set before any kernel module is imported) or ``SPADE_KERNELS=torch`` to force
the references.

Kernels are leaves: they import nothing else of spade but ``spade.envs`` (settings).

Every Triton kernel of the suite takes a ``PDL`` constexpr and, on sm_90+ GPUs, can be
launched with programmatic dependent launch (``spade.kernels.pdl``: it may start while
the previous kernel of the stream finishes, and waits for it before touching data);
by default every kernel of the suite is (``SPADE_PDL=auto``, which means ``all``);
``decode`` keeps it to the decode step's kernels, ``off`` turns it off.

Shapes and conventions (all ops):

* ``q``: [B, Hq, D] queries of one decode step; ``k``/``v``: [B, Hkv, L, D] KV
  cache (L = capacity; positions ``>= kv_lens[b]`` are ignored), any float dtype.
* ``kv_lens``: [B] int32/int64 valid length per row; optional ``kv_start``: [B]
  first valid position (left padding), default 0.
* GQA: query head ``h`` belongs to KV head ``h // (Hq // Hkv)``.
* Group reductions over the G query heads of a KV head: ``sum_logits``
  (Σ_g s_g), ``max_logits`` (max_g s_g), ``sum_softmax`` (Σ_g softmax(s_g) over
  the valid positions), with ``s_g = scale * q_g · k``.
* Indices are int32; ``-1`` marks an empty slot.
* Scoring may read an int8 copy of the keys (``quantize_keys``: symmetric, one
  float32 scale per token) with its ``k_scale`` [B, Hkv, L]; attention never does.
* ... or a packed int4 copy (``quantize_keys_int4``: uint8 [B, Hkv, L, D/2], low
  nibble channel ``i`` offset by 8, high nibble ``i + D/2`` signed) with its ``k_scale``;
  the keys are smoothed per channel (``fit_smoothing``) and the scoring query must
  carry that smoothing (``fold_smoothing(q, smooth)``), see ``spade.kernels.quant``.
"""

from __future__ import annotations

import contextlib

import torch

from spade.envs import env

__all__ = [
    "use_triton",
    "group_scores",
    "score_topk",
    "select_overlap",
    "plan_rows",
    "row_bucket",
    "quest_build",
    "quest_update",
    "quest_page_scores",
    "quest_select",
    "quest_write_pool",
    "gather_kv",
    "sparse_decode_attention",
    "rerank_select",
    "rerank_decode_attention",
    "merge_attention_states",
    "ridge_predict",
    "window_push",
    "rope_rotate",
    "rope_table",
    "quantize_keys",
    "quantize_append",
    "quantize_keys_int4",
    "quantize_append_int4",
    "fit_smoothing",
    "fold_smoothing",
]


def use_triton(t: torch.Tensor) -> bool:
    """Dispatch rule: Triton for CUDA tensors unless ``SPADE_KERNELS=torch``;
    everywhere when ``SPADE_KERNELS=triton``."""
    mode = env("SPADE_KERNELS")
    if mode == "torch":
        return False
    if mode == "triton":
        return True
    return t.is_cuda


def group_scores(q, k, kv_lens, *, scale=None, reduce="sum_logits", kv_start=None, k_scale=None, block_table=None):
    """Scores of every cached key for each KV head: [B, Hkv, L] float32, ``-inf``
    outside ``[kv_start, kv_lens)``. GQA as a batched GEMM with the group reduction.
    ``block_table``: the keys (and an int8 / int4 copy's scales) in a block pool, as in ``score_topk``.
    int8 ``k`` (from ``quantize_keys``) needs ``k_scale`` [B, Hkv, L]: logits are
    ``scale * (q · kq) * k_scale``; so does packed int4 ``k`` (uint8 [B, Hkv, L, D/2]
    from ``quantize_keys_int4``; q then carries the copy's smoothing: ``fold_smoothing``)."""
    from spade.kernels import scoring

    fn = scoring.group_scores_triton if use_triton(q) else scoring.group_scores_ref
    paged = {} if block_table is None else {"block_table": block_table}
    return fn(q, k, kv_lens, scale=scale, reduce=reduce, kv_start=kv_start, k_scale=k_scale, **paged)


def score_topk(q, k, lo, hi, k_top, *, scale=None, reduce="sum_logits", kv_lens=None, kv_start=None,
               k_scale=None, out=None, carry=None, carry_margin=None, block_table=None):
    """Fused scoring + top-K: the ``k_top`` positions ``p`` with ``lo[b] <= p < hi[b]``
    of highest group score, as int32 [B, Hkv, k_top] (``-1`` where fewer candidates;
    order unspecified). ``lo``/``hi``: [B] int tensors. ``kv_lens`` / ``kv_start``
    (optional) only matter for ``sum_softmax``: its per-head normaliser spans the
    row's own ``[kv_start, kv_lens)`` (``kv_start`` defaults to 0), widened to cover
    ``[lo, hi)``; without ``kv_lens`` it spans ``[lo, hi)``. int8 / packed int4 ``k``
    needs ``k_scale`` as in ``group_scores``. ``out`` (contiguous int32 [B, Hkv, k_top]):
    the result is written there (the Triton kernels write it directly) and ``out`` returned.
    ``carry`` (``carry.new_carry(B, Hkv, device)``, kept per layer across steps): the
    threshold-carry top-K (``scoring.score_topk_triton``): the same selection, found
    among the scores above the previous call's threshold instead of by radix passes
    over every row; ``carry_margin``: its next threshold aims at that many times
    ``k_top`` candidates (``carry.carry_sizes``; the reference ignores it).
    ``block_table`` (int32 [B, max_blocks]): the keys are a block pool
    [num_blocks, Hkv, block_size, D] (``spade.kernels.paged``; int8 / int4 copies with
    ``k_scale`` a pool [num_blocks, Hkv, block_size]); positions stay logical."""
    from spade.kernels import scoring

    fn = scoring.score_topk_triton if use_triton(q) else scoring.score_topk_ref
    paged = {} if block_table is None else {"block_table": block_table}
    return fn(q, k, lo, hi, k_top, scale=scale, reduce=reduce, kv_lens=kv_lens, kv_start=kv_start,
              k_scale=k_scale, out=out, carry=carry, carry_margin=carry_margin, **paged)


def plan_rows(busy, total):
    """A context in which the selection kernels' (row, chunk) grids and the decode
    attention's split plan are sized as if only ``busy`` of every ``total`` batch rows
    carried work (``common.plan_rows``): a serving batch's idle rows, whose windows are a
    few tokens, do not thin the work of the rows in use. Same results; a host fact that
    keys any CUDA graph captured inside."""
    from spade.kernels.common import plan_rows as _plan_rows

    return _plan_rows(busy, total)


def row_bucket(n, B):
    """The batch-size bucket of ``n`` rows in use out of ``B`` (``common.row_bucket``)."""
    from spade.kernels.common import row_bucket as _row_bucket

    return _row_bucket(n, B)


def select_overlap(device, enabled=None):
    """A context in which each threshold-carry ``score_topk(..., carry=)`` runs its
    top-K select on a side CUDA stream beside the next call's scoring; joined on exit
    (read no result inside). ``SPADE_SELECT_OVERLAP`` (auto / on / off) or ``enabled``
    turns it on; a no-op off CUDA (``overlap.select_overlap``)."""
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    from spade.kernels import overlap

    return overlap.select_overlap(device, enabled)


def quest_build(k, kv_lens, page_size, *, kv_start=None, block_table=None):
    """Quest page metadata from a whole cache: (kmin, kmax), each [B, Hkv, P, D] in
    k's dtype with ``P = ceil(L / page_size)``; element-wise min/max over the valid
    tokens of each page (pages with none: +inf / -inf). Pages are relative to each
    row's start: row b's page p holds positions ``[kv_start[b] + p*S, kv_start[b] + (p+1)*S)``
    (S = page_size). ``block_table``: ``k`` is a block pool (``spade.kernels.paged``);
    positions stay logical, L = max_blocks * block_size."""
    from spade.kernels import quest

    fn = quest.quest_build_triton if use_triton(k) else quest.quest_build_ref
    paged = {} if block_table is None else {"block_table": block_table}
    return fn(k, kv_lens, page_size, kv_start=kv_start, **paged)


def quest_update(kmin, kmax, k_new, pos, page_size, *, kv_start=None, block_table=None, block_size=None):
    """In place: fold ``k_new`` [B, Hkv, D] written at cache positions ``pos`` [B] into
    the page bounds, page ``(pos - kv_start) // page_size`` of each row (relative pages,
    as ``quest_build``; a page's first token resets them). ``block_table`` [B, max_blocks]
    and ``block_size``: the bounds live in a paged cache's blocks (pool bounds,
    ``spade.kernels.quest``): [num_blocks, Hkv, ceil(block_size / page_size), D]."""
    from spade.kernels import quest

    fn = quest.quest_update_triton if use_triton(k_new) else quest.quest_update_ref
    paged = {} if block_table is None else {"block_table": block_table, "block_size": block_size}
    return fn(kmin, kmax, k_new, pos, page_size, kv_start=kv_start, **paged)


def quest_write_pool(kmin, kmax, new_min, new_max, block_table, kv_lens, page_size, block_size, *, kv_start=None):
    """Write joining rows' page bounds [n, Hkv, P', D] (``quest_build`` of their prompts)
    into pool bounds through their tables [n, max_blocks]: each row's own pages only."""
    from spade.kernels import quest

    return quest.quest_write_pool(kmin, kmax, new_min, new_max, block_table, kv_lens, page_size, block_size,
                                  kv_start=kv_start)


def quest_page_scores(q, kmin, kmax, n_pages, *, scale=None, reduce="sum_logits", page_start=None):
    """Quest upper-bound page scores [B, Hkv, P] float32:
    ``Σ_d max(q_d·min_d, q_d·max_d)`` per query head, reduced over the group;
    ``-inf`` for pages outside ``[page_start, n_pages)``. ``n_pages``: [B]."""
    from spade.kernels import quest

    fn = quest.quest_page_scores_triton if use_triton(q) else quest.quest_page_scores_ref
    return fn(q, kmin, kmax, n_pages, scale=scale, reduce=reduce, page_start=page_start)


def quest_select(q, kmin, kmax, kv_lens, n_pages_sel, page_size, *, scale=None, reduce="sum_logits",
                 kv_start=None, block_table=None, block_size=None):
    """Quest selection as token indices [B, Hkv, n_pages_sel * page_size] int32:
    the last (partial) page always, plus the ``n_pages_sel - 1`` best other pages of
    the row's ``ceil((kv_lens - kv_start) / page_size)`` (pages relative to kv_start,
    as ``quest_build``); positions outside ``[kv_start, kv_lens)`` are ``-1``.
    ``block_table`` / ``block_size``: pool bounds (as ``quest_update``)."""
    from spade.kernels import quest

    fn = quest.quest_select_triton if use_triton(q) else quest.quest_select_ref
    paged = {} if block_table is None else {"block_table": block_table, "block_size": block_size}
    return fn(q, kmin, kmax, kv_lens, n_pages_sel, page_size, scale=scale, reduce=reduce,
              kv_start=kv_start, **paged)


def gather_kv(k, v, indices, block_table=None):
    """Gather selected tokens into contiguous buffers: (k_sel, v_sel) [B, Hkv, K, D];
    rows of ``-1`` slots are zero. ``block_table`` (int32 [B, max_blocks]): k/v are
    block pools [num_blocks, Hkv, block_size, D]; indices stay logical."""
    from spade.kernels import gather

    fn = gather.gather_kv_triton if use_triton(k) else gather.gather_kv_ref
    return fn(k, v, indices) if block_table is None else fn(k, v, indices, block_table)


def sparse_decode_attention(q, k, v, kv_lens, indices=None, *, n_sink=0, n_recent=0, scale=None,
                            kv_start=None, return_lse=False, stats=None, count_call=True, block_table=None):
    """Decode attention over a subset of the cache, read in place (no gathered copy).

    Attended set per (b, KV head) as in ``spade.policies.base.Selection``; with
    ``indices=None`` it is dense ``[kv_start, kv_lens)``. Returns ``out`` [B, Hq, D]
    in q's dtype (and ``lse`` [B, Hq] float32, natural log, if ``return_lse``).
    ``stats`` (int64 [2] on q's device): ``[0] +=`` tokens attended summed over
    (b, KV head), ``[1] += 1`` if ``count_call`` — counted inside the attention
    launch, so statistics cost no kernels on the decode path.
    ``block_table`` (int32 [B, max_blocks]): k/v are block pools
    [num_blocks, Hkv, block_size, D] (``spade.kernels.paged``); indices stay logical.
    Inside ``plan_rows`` the GPU kernel's split plan is sized for the rows that carry work
    (the result is the same up to the order of the split merge; the reference ignores it).
    """
    from spade.kernels import attention

    fn = attention.sparse_decode_attention_triton if use_triton(q) else attention.sparse_decode_attention_ref
    paged = {} if block_table is None else {"block_table": block_table}
    return fn(q, k, v, kv_lens, indices, n_sink=n_sink, n_recent=n_recent, scale=scale,
              kv_start=kv_start, return_lse=return_lse, stats=stats, count_call=count_call, **paged)


def rerank_select(q, k, cand, keep, *, scale=None, reduce="sum_softmax", out=None, block_table=None):
    """Re-rank candidates with the true query: the ``keep`` best of ``cand`` [B, Hkv, M]
    (positions into ``k`` [B, Hkv, L, D], ``-1`` = empty) by the group score of ``q``
    [B, Hq, D] over the candidates (``reduce``; ``sum_softmax`` normalises each head over
    the valid candidates), as int32 [B, Hkv, keep] in candidate order, ``-1`` padding;
    ties go to the lower candidate slot. Two launches on the GPU (one where fused), no host sync
    (``spade.kernels.rerank``). ``out``: an int32 [B, Hkv, keep] buffer to write.
    ``block_table`` [B, max_blocks]: ``k`` is a paged pool [num_blocks, Hkv, block_size, D]
    and ``cand`` holds logical positions, mapped through the table in the kernel."""
    from spade.kernels import rerank

    if use_triton(q):
        return rerank.rerank_select_triton(q, k, cand, keep, scale=scale, reduce=reduce, out=out,
                                           block_table=block_table)
    kept = rerank.rerank_select_ref(q, k, cand, keep, scale=scale, reduce=reduce, block_table=block_table)
    return kept if out is None else out.copy_(kept)


def rerank_decode_attention(q, k, v, kv_lens, cand, keep, *, n_sink=0, n_recent=0, scale=None,
                            reduce="sum_softmax", kv_start=None, return_lse=False, stats=None, count_call=True,
                            block_table=None):
    """Two-stage decode attention: ``rerank_select`` keeps the ``keep`` best of the
    candidates ``cand`` by the true query ``q``, then ``sparse_decode_attention`` attends
    the sinks, the kept tokens and the recent window (the same arguments as there). The
    candidates must be disjoint from the sinks and the recent window (a ``Selection``'s
    middle is). ``block_table``: ``k`` and ``v`` are paged pools."""
    kept = rerank_select(q, k, cand, keep, scale=scale, reduce=reduce, block_table=block_table)
    return sparse_decode_attention(q, k, v, kv_lens, kept, n_sink=n_sink, n_recent=n_recent, scale=scale,
                                   kv_start=kv_start, return_lse=return_lse, stats=stats, count_call=count_call,
                                   block_table=block_table)


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """Combine two partial attentions over disjoint token sets (exact)."""
    from spade.kernels import attention

    fn = attention.merge_attention_states_triton if use_triton(out_a) else attention.merge_attention_states_ref
    return fn(out_a, lse_a, out_b, lse_b)


def ridge_predict(window, n_valid, *, mode="assembled", eps=1e-2, skip=None, per=1):
    """Predict the next query from a window of past queries.

    ``window``: [N, W, D] (N = batch × heads flattened), oldest first, the last
    ``n_valid`` (int) rows valid and right-aligned. Returns [N, D] float32.
    Modes: ``last``, ``ridge``, ``softmax_ridge``, ``assembled`` (see
    ``spade.kernels.ridge``). ``skip`` (bool [A] on the window's device; window row
    ``n`` belongs to entry ``(n // per) % A``): the rows of a True entry skip the solve
    and return their newest query (a serving batch's idle rows, whose predictions
    nobody reads).
    """
    from spade.kernels import ridge

    if use_triton(window):
        return ridge.ridge_predict_triton(window, n_valid, mode=mode, eps=eps, skip=skip, per=per)
    if skip is None:
        return ridge.ridge_predict_torch(window, n_valid, mode=mode, eps=eps)
    return ridge.ridge_predict_skip(window, n_valid, mode=mode, eps=eps, skip=skip, per=per,
                                    fn=ridge.ridge_predict_torch)


def window_push(window, q):
    """Push ``q`` [B, H, D] (any float dtype) into the query window [B, H, R, D]
    float32 (oldest first), in place: rows move one towards the oldest, ``q``
    becomes the newest. One launch on the GPU (graph-safe, no host sync)."""
    from spade.kernels import ridge

    fn = ridge.window_push_triton if use_triton(window) else ridge.window_push_ref
    fn(window, q)


def rope_table(theta, dim, device):
    """The float64 table of ``rope_rotate`` for a RoPE of ``theta`` over ``dim`` rotary
    dims, on ``device`` (a host-to-device copy: make it outside CUDA-graph capture)."""
    from spade.kernels import ridge

    return ridge.rope_table(theta, dim, device)


def rope_rotate(x, table, lens, start=None, offset=0, inverse=False):
    """Rotate ``x`` [B, H, D] by each row's RoPE position ``lens[b] - start[b] - offset``
    (``inverse``: by minus it): float32 [B, H, D]. ``table`` from ``ridge.rope_table``
    (float64 frequencies). One launch on the GPU (graph-safe, no host sync)."""
    from spade.kernels import ridge

    fn = ridge.rope_rotate_triton if use_triton(x) else ridge.rope_rotate_ref
    return fn(x, table, lens, start, offset, inverse)


def quantize_keys(k):
    """Symmetric int8 copy of the keys for scoring: ``k`` [B, H, L, D] float ->
    (kq int8 [B, H, L, D], ks float32 [B, H, L]) with ``k ≈ kq * ks[..., None]``."""
    from spade.kernels import quant

    fn = quant.quantize_keys_triton if use_triton(k) else quant.quantize_keys_ref
    return fn(k)


def quantize_append(kq, ks, k_new, pos, *, pos_offset=0, block_table=None, chans=None):
    """In place: quantise ``k_new`` [B, H, D] into slot ``pos[b] + pos_offset`` (``pos``:
    [B] int device tensor, no host sync; the host int ``pos_offset`` is added in the
    kernel, e.g. ``kv_lens`` with -1) of ``kq``/``ks``; rows whose slot is outside
    ``[0, L)`` are skipped. ``k_new`` may be the cache itself [B, H, L', D]: its row at
    the slot is read in the same launch (no gather of the newest keys first).
    ``block_table`` [B, max_blocks] int32: ``kq`` [num_blocks, H, bs, D] / ``ks``
    [num_blocks, H, bs] are pools paged like the KV cache, the slot is logical
    (L = max_blocks * bs). ``chans`` [B, H, r] int: the copy (last dim r) holds those
    channels of each new key, read in the same launch (no gather first)."""
    from spade.kernels import quant

    fn = quant.quantize_append_triton if use_triton(k_new) else quant.quantize_append_ref
    return fn(kq, ks, k_new, pos, pos_offset=pos_offset, block_table=block_table, chans=chans)


def quantize_keys_int4(k, smooth=None):
    """Packed int4 copy of the keys for scoring: ``k`` [B, H, L, D] float (D even),
    optional per-channel ``smooth`` [B, H, D] float32 (``fit_smoothing``) ->
    (kq uint8 [B, H, L, D/2], ks float32 [B, H, L]) with
    ``k ≈ unpack_int4(kq) * ks[..., None] * smooth[:, :, None]``."""
    from spade.kernels import quant

    fn = quant.quantize_keys_int4_triton if use_triton(k) else quant.quantize_keys_int4_ref
    return fn(k, smooth)


def quantize_append_int4(kq, ks, k_new, pos, smooth=None, *, pos_offset=0, block_table=None, chans=None):
    """In place: quantise ``k_new`` [B, H, D] (smoothed by ``smooth``) into slot
    ``pos[b] + pos_offset`` of the packed ``kq``/``ks``; rows whose slot is outside
    ``[0, L)`` skipped. ``k_new`` may be the cache [B, H, L', D], read at the slot.
    ``block_table``: ``kq`` [num_blocks, H, bs, D/2] / ``ks`` [num_blocks, H, bs] are
    pools, as in ``quantize_append``; ``chans`` as there (``smooth`` then [B, H, r])."""
    from spade.kernels import quant

    fn = quant.quantize_append_int4_triton if use_triton(k_new) else quant.quantize_append_int4_ref
    return fn(kq, ks, k_new, pos, smooth, pos_offset=pos_offset, block_table=block_table, chans=chans)


def fit_smoothing(k, kv_lens=None, kv_start=None):
    """Per-channel smoothing scales of an int4 copy: [B, H, D] float32, the channel
    amax of ``k`` over ``[kv_start, kv_lens)`` (floored). Plain torch on any device."""
    from spade.kernels import quant

    return quant.fit_smoothing(k, kv_lens, kv_start)


def fold_smoothing(q, smooth):
    """The query an int4 copy is scored with: ``q`` [B, Hq, D] times its KV head's
    ``smooth`` [B, Hkv, D], in q's dtype (``None``: ``q``)."""
    from spade.kernels import quant

    return quant.fold_smoothing(q, smooth)

"""The inference rank's side of two-stage selection (``policy.rerank`` m): re-rank
``M = m * K_mid`` candidates with the true query, keep ``K_mid``, attend sinks + kept +
recent window — against the same done with torch ops, against attending all M
candidates, and against the bytes floor.

Rows per (B, L, m), one decode layer of the Qwen3-8B shape by default (32 q / 8 KV
heads, d = 128, bf16), every row timed as a CUDA graph replay with L2 flushed before
each (``benchmarks.kernels.Timer.graph``):

* ``rerank / select+attend``: ``kernels.rerank_select`` (a scoring launch gathering the
  candidates' keys, split over programs, and a radix select in registers, one program
  per (row, KV head); or the two fused) + the suite's indexed attention over sinks +
  kept + recent: what the inference rank runs per layer;
* ``rerank / select``: the select alone;
* ``rerank / torch+attend`` (timed eagerly, launches included): candidates' scores with torch ops (gather, einsum,
  softmax) + ``torch.topk`` + gather of the positions + the same attention: the
  reference;
* ``attend_K``: the attention alone over sinks + K_mid: one-stage selection's cost,
  the floor of any re-rank;
* ``attend_M``: the attention over sinks + all M candidates + recent (no re-rank: the
  other way to use m K_mid candidates, at m times the attention's bytes);
* with ``--block-size N`` (a paged cache of N-token blocks under a shuffled table, the
  same keys): ``rerank / select paged`` and ``select+attend paged`` (the kernels
  mapping each candidate through the table), and ``rerank / select gathered`` (the
  candidates' keys copied out through the table first, then the contiguous kernel: what
  paging costs without the table in the kernel);
* with ``--sweep``, rows ``rerank / select[KEY=value ...]``: the select under other
  ``kernels.rerank.RERANK_CONFIG`` settings (fused or split, tiles, warps, programs per
  SM), each checked like the default before it is timed;
* with ``--profile`` (GPU): the select's kernels by device time, printed and kept in the
  ``select`` row (``kernels_us``): where a wide row's time goes (scoring, finalize, the
  radix passes, the emission).

The ``select`` row records the launch the heuristic chose: ``fused`` (one launch),
``nsplit`` (scoring programs per row) and ``one_tile`` (the row selected in registers).

Floors (``floor_ms``) are bytes over the measured device-copy bandwidth: ``select``
reads the M candidates' keys and indices (and writes K_mid indices); ``select+attend``
adds the K_mid kept K/V and the sinks' and recent window's. Every kept set is checked
against ``kernels.rerank.rerank_select_ref`` (sum of true scores) before it is timed.

    python -m benchmarks.bench_rerank                       # B in {8, 16}, L=32k, K=2k, m in {2, 4}
    python -m benchmarks.bench_rerank --shapes 8x32768,32x16384 --budget 2048 --rerank 2,4,8
    python -m benchmarks.bench_rerank --shapes 1x32768,8x32768,32x16384 --rerank 2 --sweep
    python -m benchmarks.bench_rerank --shapes 8x32768,16x16384 --rerank 2,4 --block-size 16
    python -m benchmarks.bench_rerank --shapes 8x32768,16x16384 --rerank 4,8 --profile
    python -m benchmarks.bench_rerank --tiny                # CPU interpreter: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

HQ, HKV, D = 32, 8, 128
N_SINK, N_RECENT = 4, 64


def _inputs(B: int, L: int, M: int, hq: int, hkv: int, d: int, dtype, device, n_sink: int, n_recent: int):
    """Random q, K/V cache [B, Hkv, L, d] and M distinct candidate positions per (row, KV
    head) from the middle ``[n_sink, L - n_recent)`` (sorted, like a selection)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(B, hq, d, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(B, hkv, L, d, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(B, hkv, L, d, generator=g).to(device=device, dtype=dtype)
    mid = L - n_sink - n_recent
    scores = torch.rand(B, hkv, mid, generator=g)
    cand = (scores.topk(min(M, mid), dim=-1).indices + n_sink).sort(-1).values.to(torch.int32)
    if cand.shape[-1] < M:
        cand = torch.cat([cand, torch.full((B, hkv, M - cand.shape[-1]), -1, dtype=torch.int32)], -1)
    kv_lens = torch.full((B,), L, dtype=torch.int32)
    return q, k, v, cand.to(device), kv_lens.to(device)


def _deficit(q, k, cand, kept, keep: int) -> float:
    """Relative shortfall of ``kept``'s total true score against the reference's."""
    from spade.kernels import rerank

    s = rerank.rerank_scores_ref(q, k, cand).double()  # [B, H, M]
    want = rerank.rerank_select_ref(q, k, cand, keep)

    def total(sel):
        hit = (cand[..., :, None] == sel[..., None, :]) & (sel[..., None, :] >= 0)  # [B, H, M, keep]
        return float((s.clamp(min=0) * hit.any(-1)).sum())

    ref = total(want)
    return (ref - total(kept)) / max(ref, 1e-30)


def _sweep_grid(tiny: bool) -> list[dict]:
    """RERANK_CONFIG settings timed by ``--sweep`` (the default launch is its own row)."""
    if tiny:
        return [dict(FUSE=False, MIN_CHUNK=16, BLOCK_M=16), dict(FUSE=False, SELECT_MAX=16, SELECT_BLOCK=16)]
    grid = [dict(FUSE=False, BLOCK_M=bm, num_warps=nw) for bm in (32, 64, 128) for nw in (4, 8)]
    grid += [dict(FUSE=True, BLOCK_M=bm, select_warps=w) for bm in (32, 64, 128) for w in (8, 16)]
    grid += [dict(FUSE=False, select_warps=w) for w in (4, 8, 16)]
    grid += [dict(FUSE=False, PER_SM=p) for p in (2, 8)] + [dict(FUSE=False, MIN_CHUNK=c) for c in (128, 256)]
    grid += [dict(FUSE=False, num_stages=s) for s in (2, 4)]
    return grid


def _paged_rows(rec, run, q, k, v, cand, kv_lens, kept, k_mid, scale, shape, block_size, rr_bytes, att_k_bytes,
                bw, n_sink, n_recent) -> None:
    """The paged rows (``--block-size``): the same keys in a shuffled pool; each kept set
    must equal the contiguous kernel's before it is timed."""
    from spade.kernels import attention, rerank
    from spade.kernels.paged import scatter_to_pool

    gen = torch.Generator().manual_seed(1)
    kp, table = scatter_to_pool(k, block_size, gen)
    vp, _ = scatter_to_pool(v, block_size, torch.Generator().manual_seed(1))  # the same table
    shape = dict(shape, block_size=block_size)
    want = rerank.rerank_select_triton(q, k, cand, k_mid, scale=scale)
    got = torch.empty_like(kept)
    rerank.rerank_select_triton(q, kp, cand, k_mid, scale=scale, out=got, block_table=table)
    if not torch.equal(got, want):
        rec.skip("rerank", "select paged", shape, "kept set differs from the contiguous kernel's")
        return
    B, H, M = cand.shape
    bs = block_size
    pos = cand.long().clamp(min=0)
    slots = torch.where(cand >= 0, torch.arange(M, dtype=torch.int32, device=cand.device), -1)
    heads = torch.arange(H, device=k.device).view(1, H, 1)
    rows = torch.empty(B, H, M, k.shape[-1], dtype=k.dtype, device=k.device)
    slot_kept = torch.empty_like(kept)

    def gathered():  # the candidates' keys copied out through the table, then the contiguous kernel
        blk = torch.gather(table.long(), 1, (pos // bs).view(B, H * M)).view(B, H, M)
        rows.copy_(kp[blk, heads, pos % bs])
        rerank.rerank_select_triton(q, rows, slots, k_mid, scale=scale, out=slot_kept)
        return torch.where(slot_kept >= 0, torch.gather(cand, 2, slot_kept.clamp(min=0).long()), -1)

    if not torch.equal(gathered().to(torch.int32), want):
        rec.skip("rerank", "select gathered", shape, "kept set differs from the contiguous kernel's")
        return

    def attend_paged():
        rerank.rerank_select_triton(q, kp, cand, k_mid, scale=scale, out=got, block_table=table)
        return attention.sparse_decode_attention_triton(q, kp, vp, kv_lens, got, n_sink=n_sink, n_recent=n_recent,
                                                        scale=scale, block_table=table)

    rec.add("rerank", "select paged", shape, lambda: run(lambda: rerank.rerank_select_triton(
        q, kp, cand, k_mid, scale=scale, out=got, block_table=table)), rr_bytes, bw)
    rec.add("rerank", "select+attend paged", shape, lambda: run(attend_paged), rr_bytes + att_k_bytes, bw)
    rec.add("rerank", "select gathered", shape, lambda: run(gathered), rr_bytes, bw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8x32768,16x32768", help="BxL pairs, comma-separated")
    ap.add_argument("--budget", type=int, default=2048, help="K: tokens attended (sinks and recent included)")
    ap.add_argument("--rerank", default="2,4", help="m values (comma-separated)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--sweep", action="store_true", help="also time the select under other RERANK_CONFIG settings")
    ap.add_argument("--block-size", type=int, default=0,
                    help="also time the paged kernels over a pool of this block size (0: contiguous only)")
    ap.add_argument("--tiny", action="store_true", help="CPU interpreter, tiny shapes: checks the script")
    ap.add_argument("--profile", action="store_true",
                    help="GPU: each shape's re-rank kernels by device time (torch.profiler over 20 eager calls), "
                         "printed and kept as the select row's kernels_us")
    ap.add_argument("--out", default="results/bench_rerank.json")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from benchmarks.kernels import Recorder, Timer, hbm_bandwidth  # noqa: E402
    from spade import kernels  # noqa: E402 - after TRITON_INTERPRET
    from spade.kernels import attention, rerank  # noqa: E402

    dev = torch.device("cuda" if cuda else "cpu")
    if args.tiny:
        hq, hkv, d, dtype, n_sink, n_recent = 2, 1, 16, torch.float32, 2, 3
        shapes, budget, ms_ = [(1, 60)], 16, [2]
        iters, warmup = 1, 0
    else:
        hq, hkv, d, dtype, n_sink, n_recent = HQ, HKV, D, torch.bfloat16, N_SINK, N_RECENT
        shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",") if s.strip()]
        budget = args.budget
        ms_ = [int(x) for x in args.rerank.split(",") if x.strip()]
        iters, warmup = args.iters, args.warmup
    k_mid = budget - n_sink - n_recent
    timer = Timer(iters, warmup, device="cuda" if cuda else "cpu")
    bw = hbm_bandwidth(timer, (1 << 30) if cuda else (1 << 20), device=dev)
    elt = torch.finfo(dtype).bits // 8
    meta = dict(device=torch.cuda.get_device_name(0) if cuda else "cpu (interpreter)", hq=hq, hkv=hkv, d=d,
                dtype=str(dtype).replace("torch.", ""), budget=budget, n_sink=n_sink, n_recent=n_recent,
                copy_bw_gbs=bw / 1e9, date=time.strftime("%Y-%m-%d"), argv=sys.argv[1:] if argv is None else argv)
    rec = Recorder(Path(args.out), meta, budget_s=1e9)
    print(f"# {meta['device']}: copy {bw / 1e9:.0f} GB/s, Hq={hq} Hkv={hkv} d={d} {meta['dtype']} K={budget}",
          flush=True)
    scale = d ** -0.5
    run = timer.graph if cuda else timer
    for (B, L) in shapes:
        for m in ms_:
            M = m * k_mid
            q, k, v, cand, kv_lens = _inputs(B, L, M, hq, hkv, d, dtype, dev, n_sink, n_recent)
            shape = dict(B=B, L=L, m=m, M=M, K_mid=k_mid)
            kept = torch.empty(B, hkv, k_mid, dtype=torch.int32, device=dev)
            fixed = (n_sink + n_recent) * 2 * d * elt  # sinks + recent K/V per (row, KV head)
            rr_bytes = B * hkv * (M * (d * elt + 4) + k_mid * 4) + q.numel() * elt
            att_k_bytes = B * hkv * (k_mid * (2 * d * elt + 4) + fixed) + 2 * q.numel() * elt
            att_m_bytes = B * hkv * (M * (2 * d * elt + 4) + fixed) + 2 * q.numel() * elt

            def attend(idx):
                return attention.sparse_decode_attention_triton(q, k, v, kv_lens, idx, n_sink=n_sink,
                                                                n_recent=n_recent, scale=scale)

            def two_stage():
                rerank.rerank_select_triton(q, k, cand, k_mid, scale=scale, out=kept)
                return attend(kept)

            def torch_ref():
                s = rerank.rerank_scores_ref(q, k, cand, scale=scale)
                top = s.topk(k_mid, dim=-1).indices
                idx = torch.where(s.gather(-1, top) > float("-inf"), cand.gather(-1, top), -1)
                return attend(idx.to(torch.int32))

            rerank.rerank_select_triton(q, k, cand, k_mid, scale=scale, out=kept)
            deficit = _deficit(q, k, cand, kept, k_mid)
            if deficit > 1e-3:
                rec.skip("rerank", "triton", shape, f"wrong selection (deficit {deficit:.2e})")
                continue
            cfg = rerank._config(M, B * hkv, dev)
            prof = {}
            if args.profile and cuda:  # (under PDL a kernel's time includes its early-launched wait: a ranking)
                from benchmarks.bench_scoring import _profile_kernels

                prof["kernels_us"] = _profile_kernels(lambda: rerank.rerank_select_triton(
                    q, k, cand, k_mid, scale=scale, out=kept))
                for name, us in sorted(prof["kernels_us"].items(), key=lambda kv: -kv[1]):
                    print(f"#   {B}x{L} m={m} {us:8.1f} us  {name}", flush=True)
            rec.add("rerank", "select", shape, lambda: run(lambda: rerank.rerank_select_triton(
                q, k, cand, k_mid, scale=scale, out=kept)), rr_bytes, bw, deficit=deficit, fused=cfg["FUSED"],
                nsplit=cfg["NSPLIT"], one_tile=cfg["ONE_TILE"], **prof)
            rec.add("rerank", "select+attend", shape, lambda: run(two_stage), rr_bytes + att_k_bytes, bw)
            # (eager: the reference's ops copy a host scalar, which a graph capture refuses)
            rec.add("rerank", "torch+attend", shape, lambda: timer(torch_ref), rr_bytes + att_k_bytes, bw)
            rec.add("attend_K", "triton", shape, lambda: run(lambda: attend(kept)), att_k_bytes, bw)
            rec.add("attend_M", "triton", shape, lambda: run(lambda: attend(cand)), att_m_bytes, bw)
            if args.block_size > 0:
                _paged_rows(rec, run, q, k, v, cand, kv_lens, kept, k_mid, scale, shape, args.block_size,
                            rr_bytes, att_k_bytes, bw, n_sink, n_recent)
            for over in _sweep_grid(args.tiny) if args.sweep else []:
                name = "select[" + " ".join(f"{key}={int(v) if isinstance(v, bool) else v}"
                                            for key, v in over.items()) + "]"
                saved = dict(rerank.RERANK_CONFIG)
                rerank.RERANK_CONFIG.update(over)
                try:
                    cfg = rerank._config(M, B * hkv, dev)
                    kept.fill_(-1)
                    rerank.rerank_select_triton(q, k, cand, k_mid, scale=scale, out=kept)
                    deficit = _deficit(q, k, cand, kept, k_mid)
                    if deficit > 1e-3:
                        rec.skip("rerank", name, shape, f"wrong selection (deficit {deficit:.2e})")
                        continue
                    rec.add("rerank", name, shape, lambda: run(lambda: rerank.rerank_select_triton(
                        q, k, cand, k_mid, scale=scale, out=kept)), rr_bytes, bw, deficit=deficit,
                        fused=cfg["FUSED"], nsplit=cfg["NSPLIT"], one_tile=cfg["ONE_TILE"])
                finally:
                    rerank.RERANK_CONFIG.clear()
                    rerank.RERANK_CONFIG.update(saved)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""GPU microbenchmark of spade's selection kernels against torch and the byte floor.

Qwen3-8B attention layer (32 q / 8 KV heads, d=128), bf16, B in {1, 8, 32},
L in {8k, 32k, 128k} (shapes that do not fit are skipped), budget K in {1k, 2k};
candidates ``[4, L - 64)`` (4 sinks and a 64-token recent window excluded):

* ``group_scores``: the Triton GQA scoring kernel vs torch ``matmul`` + group sum;
* ``score_topk``: the fused scoring + exact radix top-K vs the naive torch
  selection (``matmul`` + ``torch.topk``), also replayed from a CUDA graph (no
  host launch gaps; shows the op is capturable);
* ``quest_build``, ``quest_page_scores``, ``quest_select`` (page size 16,
  K / 16 pages) vs torch (two ``matmul`` on the positive / negative query parts);
* ``variants``: the pass-0 histogram fused into stage 1 or not, stage-2 tile
  sizes, and ``sum_softmax``, at a few shapes;
* ``--sweep``: tile configs of the scoring kernel at B=8, L=32k.

Floors: bytes that must be read (keys of the candidate range once; Quest page
bounds once) over the HBM bandwidth measured in the same run by a large
device-to-device copy (read + write bytes). Times are medians of
``triton.testing.do_bench`` (L2 flushed before each call). Every shape also
checks the fused selection against the naive one through the fp32 scores.

    python -m benchmarks.bench_scoring [--quick] [--sweep] [--out results/bench_scoring.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

HQ, HKV, D = 32, 8, 128
G = HQ // HKV
N_SINK, N_RECENT = 4, 64
PAGE = 16
DTYPE = torch.bfloat16
ELT = 2  # bytes per bf16 element
DEVICE = "cuda"


# ------------------------------------------------------------------------------------- timing
def bench(fn: Callable[[], object], *, warmup: int = 10, rep: int = 40) -> float:
    """Median time of ``fn`` in ms (``triton.testing.do_bench``: L2 flushed per call)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def bench_graph(fn: Callable[[], object], **kw) -> float | None:
    """Median time of ``fn`` replayed from a CUDA graph (None if capture fails)."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()  # warm-up: compile and allocate outside the capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return bench(g.replay, **kw)
    except Exception as e:  # report, do not abort the whole run
        print(f"  (graph capture failed: {type(e).__name__}: {e})", file=sys.stderr)
        return None


def hbm_bandwidth(nbytes: int = 2**30) -> float:
    """Bytes/s of a device-to-device copy, counting read + write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), rep=100)
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


# --------------------------------------------------------------------------- torch baselines
def naive_scores(q: torch.Tensor, k: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scale: float) -> torch.Tensor:
    """sum_logits group scores the way one writes them in torch: one batched matmul per
    KV head (bf16 out), fp32 group sum, ``-inf`` outside ``[lo, hi)``. [B, Hkv, L] fp32."""
    B, L = k.shape[0], k.shape[2]
    s = torch.matmul(q.view(B, HKV, G, D), k.transpose(-1, -2)).float().sum(2) * scale  # [B, Hkv, L]
    pos = torch.arange(L, device=k.device)
    ok = (pos >= lo[:, None]) & (pos < hi[:, None])  # [B, L]
    return s.masked_fill(~ok[:, None, :], float("-inf"))


def naive_topk(q, k, lo, hi, k_top: int, scale: float) -> torch.Tensor:
    """The naive selection: full scores, then ``torch.topk``."""
    return naive_scores(q, k, lo, hi, scale).topk(k_top, dim=-1).indices.to(torch.int32)


def torch_page_scores(q, kmin, kmax, n_pages, scale: float) -> torch.Tensor:
    """Quest bounds in torch: ``q⁺·kmax + q⁻·kmin`` as two matmuls, fp32 group sum. [B, Hkv, P]."""
    B, P = kmin.shape[0], kmin.shape[2]
    qg = q.view(B, HKV, G, D)
    s = (torch.matmul(qg.clamp(min=0), kmax.transpose(-1, -2)).float()
         + torch.matmul(qg.clamp(max=0), kmin.transpose(-1, -2)).float()).sum(2) * scale
    ok = torch.arange(P, device=q.device) < n_pages[:, None]
    return s.masked_fill(~ok[:, None, :], float("-inf"))


def torch_quest_select(q, kmin, kmax, kv_lens, n_sel: int, scale: float) -> torch.Tensor:
    """Quest selection in torch: page scores, last page forced, ``topk``, expand to tokens."""
    B = q.shape[0]
    n_pages = (kv_lens + PAGE - 1) // PAGE
    last = n_pages - 1
    s = torch_page_scores(q, kmin, kmax, n_pages, scale)
    s.scatter_(2, last.view(B, 1, 1).expand(B, HKV, 1), float("-inf"))
    top = s.topk(n_sel - 1, dim=-1).indices  # [B, Hkv, n_sel - 1]
    pages = torch.cat([last.view(B, 1, 1).expand(B, HKV, 1), top], dim=-1)
    tok = pages[..., None] * PAGE + torch.arange(PAGE, device=q.device)
    tok = torch.where(tok < kv_lens.view(B, 1, 1, 1), tok, -1)
    return tok.view(B, HKV, -1).to(torch.int32)


# ------------------------------------------------------------------------------------ checks
def selection_deficit(idx: torch.Tensor, ref_idx: torch.Tensor, scores: torch.Tensor) -> float:
    """Relative shortfall of ``idx``'s summed scores vs ``ref_idx``'s (<= ~1e-6 when both
    are exact top-K of ``scores``; ties make the index sets differ, not the sums)."""
    def total(i):
        i = i.long()
        return torch.where(i >= 0, scores.gather(2, i.clamp(min=0)), 0.0).double().sum(-1)

    a, b = total(idx), total(ref_idx)
    return float(((b - a) / b.abs().clamp(min=1e-12)).max())


# ------------------------------------------------------------------------------------- runner
class Runner:
    def __init__(self, bw: float, rows: list):
        self.bw, self.rows = bw, rows

    def add(self, op: str, impl: str, shape: dict, ms: float | None, floor_bytes: int | None, **extra):
        floor_ms = floor_bytes / self.bw * 1e3 if floor_bytes else None
        row = dict(op=op, impl=impl, **shape, ms=ms, floor_ms=floor_ms,
                   x_floor=(ms / floor_ms if ms and floor_ms else None), **extra)
        self.rows.append(row)
        fl = f"{floor_ms:8.4f}" if floor_ms else "       -"
        xf = f"{row['x_floor']:6.2f}x" if row["x_floor"] else "      -"
        t = f"{ms:9.4f}" if ms is not None else "     fail"
        dims = " ".join(f"{k}={v}" for k, v in shape.items())
        more = " ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items())
        print(f"{op:18s} {impl:14s} {dims:28s} {t} ms  floor {fl} ms  {xf}  {more}", flush=True)


def fits(B: int, L: int) -> bool:
    """Keys + Quest bounds + the naive baseline's temporaries, with headroom."""
    keys = B * HKV * L * D * ELT
    bounds = 2 * keys // PAGE
    naive = B * HQ * L * (ELT + 4) + 3 * B * HKV * L * 4
    free, _ = torch.cuda.mem_get_info()
    return keys + bounds + naive + 2**30 < 0.85 * free


def run_shape(r: Runner, B: int, L: int, ks: list[int], *, variants: bool) -> None:
    from spade.kernels import quest, scoring

    dev = DEVICE
    scale = D ** -0.5
    g = torch.Generator(device=dev).manual_seed(B * 131 + L)
    q = torch.randn(B, HQ, D, device=dev, generator=g, dtype=DTYPE)
    k = torch.randn(B, HKV, L, D, device=dev, generator=g, dtype=DTYPE)
    kv_lens = torch.full((B,), L, device=dev, dtype=torch.int64)
    lo = torch.full((B,), N_SINK, device=dev, dtype=torch.int64)
    hi = kv_lens - N_RECENT
    shape = dict(B=B, L=L)
    key_bytes = B * HKV * L * D * ELT
    mid_bytes = B * HKV * (L - N_SINK - N_RECENT) * D * ELT

    r.add("group_scores", "triton", shape, bench(lambda: scoring.group_scores_triton(q, k, kv_lens)), key_bytes)
    r.add("group_scores", "torch", shape, bench(lambda: naive_scores(q, k, torch.zeros_like(lo), kv_lens, scale)),
          key_bytes)

    kmin, kmax = quest.quest_build_triton(k, kv_lens, PAGE)
    r.add("quest_build", "triton", shape, bench(lambda: quest.quest_build_triton(k, kv_lens, PAGE)), key_bytes)
    n_pages = (kv_lens + PAGE - 1) // PAGE
    meta_bytes = 2 * kmin.numel() * ELT
    r.add("quest_page_scores", "triton", shape,
          bench(lambda: quest.quest_page_scores_triton(q, kmin, kmax, n_pages)), meta_bytes)
    r.add("quest_page_scores", "torch", shape, bench(lambda: torch_page_scores(q, kmin, kmax, n_pages, scale)),
          meta_bytes)

    truth = scoring.group_scores_triton(q, k, kv_lens)  # fp32 scores for the checks
    pscores = quest.quest_page_scores_triton(q, kmin, kmax, n_pages)
    for K in ks:
        shp = dict(B=B, L=L, K=K)
        fused = scoring.score_topk_triton(q, k, lo, hi, K)
        naive = naive_topk(q, k, lo, hi, K, scale)
        ok = dict(deficit=selection_deficit(fused, naive, truth))
        r.add("score_topk", "triton", shp, bench(lambda: scoring.score_topk_triton(q, k, lo, hi, K)), mid_bytes, **ok)
        r.add("score_topk", "triton_graph", shp,
              bench_graph(lambda: scoring.score_topk_triton(q, k, lo, hi, K)), mid_bytes)
        r.add("score_topk", "torch_naive", shp, bench(lambda: naive_topk(q, k, lo, hi, K, scale)), mid_bytes)

        n_sel = K // PAGE
        t_sel = quest.quest_select_triton(q, kmin, kmax, kv_lens, n_sel, PAGE)
        r_sel = torch_quest_select(q, kmin, kmax, kv_lens, n_sel, scale)
        pages_t = torch.where(t_sel[..., ::PAGE] >= 0, t_sel[..., ::PAGE] // PAGE, -1)
        pages_r = torch.where(r_sel[..., ::PAGE] >= 0, r_sel[..., ::PAGE] // PAGE, -1)
        ok = dict(deficit=selection_deficit(pages_t, pages_r, pscores))
        r.add("quest_select", "triton", shp,
              bench(lambda: quest.quest_select_triton(q, kmin, kmax, kv_lens, n_sel, PAGE)), meta_bytes, **ok)
        r.add("quest_select", "torch", shp,
              bench(lambda: torch_quest_select(q, kmin, kmax, kv_lens, n_sel, scale)), meta_bytes)

    if variants:
        K = max(ks)
        shp = dict(B=B, L=L, K=K)
        for fuse in (True, False):
            scoring.SELECT_CONFIG.clear()
            scoring.SELECT_CONFIG.update(fuse_hist=fuse)
            try:
                out = scoring.score_topk_triton(q, k, lo, hi, K)
                ok = dict(deficit=selection_deficit(out, naive_topk(q, k, lo, hi, K, scale), truth))
                ms = bench(lambda: scoring.score_topk_triton(q, k, lo, hi, K))
            finally:
                scoring.SELECT_CONFIG.clear()
            r.add("score_topk", "fuse_hist" if fuse else "separate_hist0", shp, ms, mid_bytes, **ok)
        for block, warps in ((1024, 4), (2048, 8), (4096, 8)):
            scoring.SELECT_CONFIG.update(BLOCK=block, num_warps=warps)
            try:
                ms = bench(lambda: scoring.score_topk_triton(q, k, lo, hi, K))
            finally:
                scoring.SELECT_CONFIG.clear()
            r.add("score_topk", f"sel{block}w{warps}", shp, ms, mid_bytes)
        r.add("score_topk_softmax", "triton", shp,
              bench(lambda: scoring.score_topk_triton(q, k, lo, hi, K, reduce="sum_softmax", kv_lens=kv_lens)),
              mid_bytes)
    del q, k, kmin, kmax, truth, pscores
    torch.cuda.empty_cache()


def run_sweep(r: Runner) -> None:
    """Tile configs of the scoring kernel (group_scores and score_topk) at B=8, L=32k."""
    from spade.kernels import scoring

    B, L, K = 8, 32768, 2048
    q = torch.randn(B, HQ, D, device="cuda", dtype=DTYPE)
    k = torch.randn(B, HKV, L, D, device="cuda", dtype=DTYPE)
    kv_lens = torch.full((B,), L, device="cuda")
    lo, hi = torch.full_like(kv_lens, N_SINK), kv_lens - N_RECENT
    key_bytes = B * HKV * L * D * ELT
    configs = [dict(BLOCK_L=bl, num_warps=w, num_stages=st) for bl in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
    configs += [dict(PER_SM=n) for n in (4, 8, 32)]  # grid size at the default tiles (16 programs per SM)
    for over in configs:
        scoring.SCORE_CONFIG.clear()
        scoring.SCORE_CONFIG.update(over)
        cfg = dict(B=B, L=L, **over)
        try:
            ms = bench(lambda: scoring.group_scores_triton(q, k, kv_lens))
            ms_topk = bench(lambda: scoring.score_topk_triton(q, k, lo, hi, K))
        except Exception as e:  # e.g. out of shared memory
            print(f"  config {cfg} failed: {type(e).__name__}", file=sys.stderr)
            ms = ms_topk = None
        r.add("sweep_group_scores", "triton", cfg, ms, key_bytes, topk_ms=ms_topk if ms_topk else -1.0)
    scoring.SCORE_CONFIG.clear()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few shapes only (B in {1, 8}, L in {8k, 32k}, K=2k)")
    ap.add_argument("--sweep", action="store_true", help="also sweep the scoring kernel's tile configs")
    ap.add_argument("--out", default="results/bench_scoring.json", help="JSON output path")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_scoring needs a CUDA GPU; nothing to do.", file=sys.stderr)
        return 1
    import triton

    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = hbm_bandwidth()
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, {props.multi_processor_count} SMs, HBM copy bandwidth {bw / 1e9:.0f} GB/s "
          f"(read+write); torch {torch.__version__}, triton {triton.__version__}")
    print(f"# Qwen3-8B layer: {HQ} q / {HKV} KV heads, d={D}, {DTYPE}; candidates [{N_SINK}, L-{N_RECENT}); "
          f"Quest page {PAGE}")
    rows: list = []
    r = Runner(bw, rows)
    Bs, Ls, Ks = ([1, 8], [8192, 32768], [2048]) if args.quick else ([1, 8, 32], [8192, 32768, 131072], [1024, 2048])
    variant_shapes = {(8, 32768), (1, 131072), (32, 32768)} if not args.quick else {(8, 32768)}
    skipped = []
    for B in Bs:
        for L in Ls:
            if not fits(B, L):
                skipped.append(dict(B=B, L=L))
                print(f"skip B={B} L={L}: does not fit in memory", flush=True)
                continue
            run_shape(r, B, L, Ks, variants=(B, L) in variant_shapes)
    if args.sweep:
        run_sweep(r)
    out = dict(device=props.name, sms=props.multi_processor_count, hbm_bytes_per_s=bw, torch=torch.__version__,
               triton=triton.__version__, model=dict(hq=HQ, hkv=HKV, d=D, dtype=str(DTYPE)), n_sink=N_SINK,
               n_recent=N_RECENT, page_size=PAGE, skipped=skipped, rows=rows, seconds=time.time() - t0)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    worst = max((x["deficit"] for x in rows if "deficit" in x), default=0.0)
    print(f"# wrote {path} ({len(rows)} rows, {time.time() - t0:.0f} s); worst selection deficit {worst:.2e}")
    return 0 if worst <= 1e-3 else 2  # a NaN deficit fails too


if __name__ == "__main__":
    raise SystemExit(main())

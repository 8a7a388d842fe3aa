"""GPU microbenchmark of spade's attention-side kernels against torch and the byte floor.

Qwen3-8B attention layer (32 q / 8 KV heads, d=128), bf16, B in {1, 8, 32},
L in {8k, 32k, 128k} (shapes that do not fit are skipped), budget K in {1k, 2k}:

* ``sparse``: ``sparse_decode_attention`` with random (unsorted) middle indices plus
  4 sinks and a 64-token recent window, vs the reference ``torch.gather`` + SDPA
  over the same K tokens, vs the floor = selected K/V bytes / HBM bandwidth;
* ``dense``: the ``indices=None`` path vs SDPA over the whole cache, and its floor;
* ``gather``: ``gather_kv`` vs ``torch.gather`` (floor counts read + write);
* ``ridge``: ``ridge_predict`` (N = B*32 heads, W = 16, D = 128) vs the reference;
* ``splits_*`` / ``cfg_*``: the sparse and dense kernels at B=8, L=32k, K=2k for
  several split counts and launch configurations (BLOCK_N, warps, stages), next
  to the heuristic's choice (tuning data for ``spade.kernels.attention``).

Ridge rows print N (rows) in the L column and the window W in the K column.

HBM bandwidth is measured in the same run with a large device-to-device copy
(read + write bytes). Times are medians of CUDA-event timings with L2 flushed
before every call (a 512 MiB memset, which also hides the host's launch time).

    python -m benchmarks.bench_attention [--quick] [--out results/bench_attention.json]

``--sweep-sparse`` runs only a launch-configuration sweep of the sparse kernel at
B=8, L=32k, K=2k (Hkv=8, G=4, d=128, bf16, 4 sinks, 64 recent, random unsorted
middle indices as above): every num_splits x BLOCK_N x num_warps x num_stages
that compiles, each timed by CUDA-graph replay with L2 flushed before every
replay, checked against the default call's output, printed as a sorted table
(us, TB/s of selected K+V bytes, x the byte floor) with the best config and the
default's time, and written to ``--out`` (rewritten after every config). The
most informative configs come first (the default launch config over every split
count, then every launch config at the heuristic split count, then the rest), and ``--budget-s`` bounds the wall time: the sweep stops
starting configs when it runs out and writes what it has.

    python -m benchmarks.bench_attention --sweep-sparse --budget-s 150 --out results/gpu/attn_sweep.json

``python -m benchmarks.kernels`` runs these kernels over the same grid with their
variants side by side (single split, CUDA-graph replay, sorted / contiguous
indices) next to the Quest and scoring kernels.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

HQ, HKV, D = 32, 8, 128
N_SINK, N_RECENT = 4, 64
DTYPE = torch.bfloat16
SMOKE = dict(HQ=4, HKV=2, D=16, N_RECENT=8)  # --smoke: tiny shapes that run anywhere
# (BLOCK_N, num_warps, num_stages) tried at the headline shape (not with --smoke)
TUNE_CONFIGS = [(32, 4, 3), (32, 4, 4), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 2),
                (128, 8, 3)]
# --sweep-sparse: the shape and the grid
SWEEP_SHAPE = dict(B=8, L=32768, K=2048, HKV=8, G=4, D=128, N_SINK=4, N_RECENT=64)
SWEEP_SMOKE_SHAPE = dict(B=2, L=256, K=64, HKV=2, G=2, D=16, N_SINK=4, N_RECENT=8)
SWEEP_GRID = dict(splits="1,2,3,4,6,8,12,16", block_n="32,64,128", warps="2,4,8",
                  stages="2,3,4,5,7")
SWEEP_SMOKE_GRID = dict(splits="1", block_n="16", warps="4", stages="2")  # + heuristic splits
SWEEP_RESERVE_S = 10.0  # of --budget-s, kept for the statistics rows and the last write


# ----------------------------------------------------------------------------- timing
class Timer:
    """Median CUDA-event time (ms) of a callable, L2 flushed before each call (a
    512 MiB memset outside the timed region). On a CPU (``--smoke``) it falls back
    to wall-clock time. ``benchmarks.kernels`` times with it too."""

    def __init__(self, iters: int, warmup: int = 3, flush: bool = True, device: str = "cuda"):
        self.iters, self.warmup, self.cuda = iters, warmup, device == "cuda"
        self.flush_buf = (torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
                          if flush and self.cuda else None)

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        if not self.cuda:
            times = []
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        for s, e in zip(starts, ends):
            if self.flush_buf is not None:
                self.flush_buf.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))  # ms

    def graph(self, fn: Callable[[], object]) -> float:
        """Time of ``fn`` replayed from a CUDA graph (captured after a warm-up call
        that compiles the kernels and allocates their persistent buffers)."""
        fn()
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return self(g.replay)


def hbm_bandwidth(timer: Timer, nbytes: int = 2**30, device="cuda") -> float:
    """Bytes/s of a device-to-device copy, counting read + write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


# ----------------------------------------------------------------------------- inputs
def random_middle(B: int, Hkv: int, L: int, k_mid: int, n_sink: int, n_recent: int, device) -> torch.Tensor:
    """[B, Hkv, k_mid] int32: distinct random positions of [n_sink, L - n_recent), unsorted."""
    keys = torch.rand(B, Hkv, L - n_sink - n_recent, device=device)
    return (keys.topk(k_mid, dim=-1, sorted=False).indices + n_sink).int()


def full_index(mid: torch.Tensor, L: int, n_sink: int, n_recent: int) -> torch.Tensor:
    """sinks ++ middle ++ recent as one explicit index list (for the torch reference)."""
    B, Hkv, _ = mid.shape
    dev = mid.device
    sinks = torch.arange(n_sink, device=dev, dtype=torch.int32).expand(B, Hkv, n_sink)
    recent = torch.arange(L - n_recent, L, device=dev, dtype=torch.int32).expand(B, Hkv, n_recent)
    return torch.cat([sinks, mid, recent], dim=-1)


def torch_sparse(q, k, v, idx_full):
    """Reference: gather the selected K/V, then SDPA (GQA) over them."""
    import torch.nn.functional as F

    g = idx_full.long()[..., None].expand(-1, -1, -1, k.shape[-1])
    ks, vs = torch.gather(k, 2, g), torch.gather(v, 2, g)
    return F.scaled_dot_product_attention(q[:, :, None], ks, vs, enable_gqa=True)[:, :, 0]


def torch_dense(q, k, v):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _try(timer: Timer, fn) -> float | str:
    try:
        return timer(fn)
    except Exception as e:  # noqa: BLE001 - a failed provider is reported, not fatal
        _empty_cache()
        return f"error: {type(e).__name__}: {str(e)[:120]}"


def _err(a_fn, b_fn) -> float | str:
    """Relative error of a_fn() against b_fn() (or the failure, e.g. an OOM of torch)."""
    try:
        return _rel(a_fn(), b_fn())
    except Exception as e:  # noqa: BLE001
        _empty_cache()
        return f"error: {type(e).__name__}: {str(e)[:120]}"


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- --sweep-sparse
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def sweep_order(splits, block_ns, warps, stages, default: tuple, heuristic: int) -> list[tuple]:
    """Every (splits, block_n, warps, stages), most informative first: the default
    launch config (block_n, warps, stages) over every split count, then every launch
    config at the heuristic split count, then the rest (split counts nearest the
    heuristic's first), so a budget cut keeps the comparisons that matter."""
    def near(S):
        return (abs(math.log(S / max(heuristic, 1))), S)

    combos = [(S, bn, nw, ns) for S in sorted(splits, key=near) for bn in block_ns for nw in warps
              for ns in stages]
    first = [c for c in combos if c[1:] == tuple(default)]
    second = [c for c in combos if c[0] == heuristic and c not in first]
    taken = set(first) | set(second)
    return first + second + [c for c in combos if c not in taken]


def _graph_time(timer: Timer, fn, dev) -> tuple[float, object, str]:
    """(ms, output, how): CUDA-graph replay of one call (its own capture stream, warmed
    up on that stream first so the fused merge's counters exist there), or a plain
    timed call on a CPU or where the capture fails."""
    if dev.type != "cuda":
        return timer(fn), fn(), "wall"
    cs = torch.cuda.Stream(dev)
    cs.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(cs):
        fn()
    cs.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=cs):
            out = fn()
    except Exception:  # noqa: BLE001 - time it eagerly instead
        torch.cuda.synchronize()
        return timer(fn), fn(), "events"
    ms = timer(g.replay)
    torch.cuda.synchronize()
    out = out.clone()
    del g
    return ms, out, "graph"


_CFG_KEYS = ("num_splits", "block_n", "num_warps", "num_stages")  # a sweep row's launch config


def run_sparse_sweep(args, dev) -> int:
    """The --sweep-sparse run (see the module docstring); returns the exit status."""
    from spade.kernels import attention

    t0 = time.time()
    deadline = t0 + args.budget_s
    smoke = args.smoke
    shp = SWEEP_SMOKE_SHAPE if smoke else SWEEP_SHAPE
    grid = SWEEP_SMOKE_GRID if smoke else SWEEP_GRID
    B, L, K, hkv, G, d = (shp[x] for x in ("B", "L", "K", "HKV", "G", "D"))
    n_sink, n_recent = shp["N_SINK"], shp["N_RECENT"]
    hq = hkv * G
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    elem = torch.finfo(dtype).bits // 8
    splits = _ints(args.sweep_splits or grid["splits"])
    block_ns = _ints(args.sweep_block_n or grid["block_n"])
    warps = _ints(args.sweep_warps or grid["warps"])
    stages = _ints(args.sweep_stages or grid["stages"])
    iters = args.iters or (2 if smoke else 20)
    timer = Timer(iters, warmup=1 if smoke else 3, flush=not args.no_flush, device=dev.type)
    bw = hbm_bandwidth(timer, 2**24 if smoke else 2**30, device=dev)
    name = torch.cuda.get_device_properties(dev).name if dev.type == "cuda" else "cpu (Triton interpreter)"

    torch.manual_seed(0)
    q = torch.randn(B, hq, d, device=dev, dtype=dtype)
    k = torch.randn(B, hkv, L, d, device=dev, dtype=dtype)
    v = torch.randn(B, hkv, L, d, device=dev, dtype=dtype)
    kv_lens = torch.full((B,), L, device=dev, dtype=torch.int32)
    k_mid = K - n_sink - n_recent
    mid = random_middle(B, hkv, L, k_mid, n_sink, n_recent, dev)  # unsorted, as the runtime's top-k may give
    if args.sweep_sorted:
        mid = mid.sort(dim=-1).values
    sel_bytes = 2 * B * hkv * K * d * elem
    floor_us = sel_bytes / bw * 1e6
    stats = torch.zeros(2, dtype=torch.int64, device=dev) if args.sweep_stats else None
    t_max = n_sink + k_mid + n_recent
    d_pad = max(16, d)
    default = attention._launch_config(d_pad, elem)
    heuristic = attention.choose_num_splits(B * hkv, t_max, default[0], dev, indexed=True)
    if heuristic not in splits:
        splits.append(heuristic)

    def call(stats_t=stats, **cfg):
        return attention.sparse_decode_attention_triton(q, k, v, kv_lens, mid, n_sink=n_sink, n_recent=n_recent,
                                                        stats=stats_t, **cfg)

    ref = call().float()
    torch_err = _err(call, lambda: torch_sparse(q, k, v, full_index(mid, L, n_sink, n_recent)))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4

    def measure(tag: str, stats_t=stats, **cfg) -> dict:
        row = dict(tag=tag, **{k_: cfg.get(k_) for k_ in _CFG_KEYS}, stats=stats_t is not None)
        bn = cfg.get("block_n") or default[0]
        row["eff_splits"] = attention.plan_splits(B * hkv, t_max, bn, dev, num_splits=cfg.get("num_splits"))[0]
        t_call = time.time()
        try:
            ms, out, how = _graph_time(timer, lambda: call(stats_t, **cfg), dev)
        except Exception as e:  # noqa: BLE001 - resource errors etc.: recorded, skipped
            _empty_cache()
            row.update(error=f"{type(e).__name__}: {str(e)[:160]}", wall_s=time.time() - t_call)
            return row
        us = ms * 1e3
        err = float((out.float() - ref).abs().max())
        row.update(us=us, tb_s=sel_bytes / (us * 1e-6) / 1e12, x_floor=us / floor_us, max_abs_err=err,
                   ok=err <= tol, timing=how, wall_s=time.time() - t_call)
        return row

    meta = dict(device=name, hbm_bytes_per_s=bw, dtype=str(dtype), smoke=smoke, torch=torch.__version__,
                shape=dict(shp, HQ=hq, k_mid=k_mid, sorted=bool(args.sweep_sorted)), sel_bytes=sel_bytes,
                floor_us=floor_us, iters=iters, l2_flush=not args.no_flush, budget_s=args.budget_s,
                heuristic_splits=heuristic, launch_default=list(default),
                stats_on=stats is not None, default_rel_err_vs_torch=torch_err, tol_max_abs=tol)
    out_path = Path(args.out or "results/attn_sweep.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def write(complete: bool) -> None:
        timed = [r for r in rows if "us" in r and r["tag"] == "sweep" and r["ok"]]
        best = min(timed, key=lambda r: r["us"], default=None)
        out_path.write_text(json.dumps(dict(meta, rows=rows, best=best, complete=complete,
                                            wall_s=time.time() - t0), indent=1))

    print(f"device: {name}, copy bandwidth {bw / 1e9:.0f} GB/s; sparse sweep B={B} L={L} K={K} Hkv={hkv} G={G} "
          f"d={d} {dtype}, floor {floor_us:.2f} us ({sel_bytes / 1e6:.1f} MB), heuristic splits {heuristic}, "
          f"default rel err vs torch {_fmt(torch_err)}", flush=True)
    rows.append(measure("default"))
    write(False)
    order = sweep_order(splits, block_ns, warps, stages, default, heuristic)
    print(f"{len(order)} configs queued, budget {args.budget_s:.0f} s", flush=True)
    seen: set[tuple] = set()
    complete = True
    for i, (S, bn, nw, ns) in enumerate(order):
        if time.time() > deadline - SWEEP_RESERVE_S * (not smoke):
            complete = False
            print(f"budget: stopped after {i} of {len(order)} configs", flush=True)
            break
        eff = attention.plan_splits(B * hkv, t_max, bn, dev, num_splits=S)[0]
        if (eff, bn, nw, ns) in seen:  # the index tile's cap raised S to a count already timed
            continue
        seen.add((eff, bn, nw, ns))
        r = measure("sweep", num_splits=S, block_n=bn, num_warps=nw, num_stages=ns)
        rows.append(r)
        print(f"[{i + 1}/{len(order)} {time.time() - t0:.0f}s] S={S}({r['eff_splits']}) bn={bn} w={nw} s={ns}: "
              + (f"{r['us']:.2f} us err {r['max_abs_err']:.1e}" if "us" in r else r["error"][:100]), flush=True)
        write(False)
        if "error" in r and "CUDA error" in r["error"]:  # the context is gone: keep what we have
            complete = False
            break

    # the runtime's calls count statistics (track_stats): the default and the best
    # again with stats on (or off, where the sweep ran with them)
    timed = [r for r in rows if "us" in r and r["tag"] == "sweep" and r["ok"]]
    other_stats = None if stats is not None else torch.zeros(2, dtype=torch.int64, device=dev)
    extra = [("default", {})]
    b = min(timed, key=lambda r: r["us"], default=None)
    if b is not None:
        extra.append(("best", {k_: b[k_] for k_ in _CFG_KEYS}))
    for tag, cfg in extra:
        if time.time() > deadline and not smoke:
            break
        rows.append(measure(f"{tag}_stats_{'off' if other_stats is None else 'on'}", stats_t=other_stats, **cfg))
    write(complete)
    _print_sweep(rows, meta, complete, args.sweep_show)
    print(f"wrote {out_path} ({time.time() - t0:.0f} s)")
    return 0


def _print_sweep(rows: list[dict], meta: dict, complete: bool, show: int) -> None:
    timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    errs = [r for r in rows if "error" in r]
    head = ["tag", "splits", "eff", "bn", "warps", "stages", "us", "TB/s", "x_floor", "max_err", "ok"]
    widths = [20, 6, 4, 4, 5, 6, 9, 6, 7, 8, 5]
    print("\n" + " ".join(f"{h:>{w}}" for h, w in zip(head, widths)))

    def line(r):
        vals = [r["tag"], r.get("num_splits") or "auto", r["eff_splits"],
                r.get("block_n") or "auto", r.get("num_warps") or "auto", r.get("num_stages") or "auto",
                f"{r['us']:.2f}", f"{r['tb_s']:.2f}", f"{r['x_floor']:.2f}", f"{r['max_abs_err']:.1e}", r["ok"]]
        return " ".join(f"{str(v):>{w}}" for v, w in zip(vals, widths))

    for r in timed[:show]:
        print(line(r))
    if len(timed) > show:
        print(f"... {len(timed) - show} slower rows in the JSON")
    if errs:
        kinds = sorted({r["error"].split(":")[0] for r in errs})
        print(f"{len(errs)} configs failed ({', '.join(kinds)}), e.g. "
              + ", ".join(f"S{r['num_splits']} bn{r['block_n']} w{r['num_warps']} s{r['num_stages']}" for r in errs[:4]))
    bad = [r for r in timed if not r["ok"]]
    if bad:
        print(f"WARNING: {len(bad)} configs differ from the default's output by more than {meta['tol_max_abs']}")
    print(f"\nfloor {meta['floor_us']:.2f} us at {meta['hbm_bytes_per_s'] / 1e12:.2f} TB/s copy bandwidth; "
          f"{'all configs tried' if complete else 'budget or error cut the sweep short'}")
    for r in timed:
        if r["tag"] == "default":
            print(f"default (the runtime's call: launcher heuristics):\n{line(r)}")
    for r in rows:
        if "stats_" in r["tag"] and "us" in r:
            print(f"{r['tag']}: {r['us']:.2f} us")
    best = next((r for r in timed if r["tag"] == "sweep" and r["ok"]), None)
    print("best:\n" + (line(best) if best else "none"))


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (1 without a GPU unless --smoke)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_attention", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="B=8, L=32k, K=2k only, fewer iterations")
    ap.add_argument("--out", default=None,
                    help="JSON output path (results/bench_attention.json; results/attn_sweep.json with --sweep-sparse)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per measurement")
    ap.add_argument("--no-flush", action="store_true", help="do not flush L2 between calls")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on any device (CPU: Triton interpreter); checks the script, not speed")
    sw = ap.add_argument_group("sparse launch-configuration sweep (--sweep-sparse)")
    sw.add_argument("--sweep-sparse", action="store_true",
                    help="run only the sparse kernel's splits x BLOCK_N x warps x stages sweep at "
                         "B=8 L=32k K=2k (--smoke: tiny shapes, a few configs)")
    sw.add_argument("--budget-s", type=float, default=150.0,
                    help="wall-time bound of the sweep: no config starts after it (one compile may overrun)")
    sw.add_argument("--sweep-splits", default=None,
                    help=f"split counts (default {SWEEP_GRID['splits']}, plus the heuristic's)")
    sw.add_argument("--sweep-block-n", default=None, help=f"BLOCK_N values (default {SWEEP_GRID['block_n']})")
    sw.add_argument("--sweep-warps", default=None, help=f"num_warps values (default {SWEEP_GRID['warps']})")
    sw.add_argument("--sweep-stages", default=None, help=f"num_stages values (default {SWEEP_GRID['stages']})")
    sw.add_argument("--sweep-sorted", action="store_true", help="sorted middle indices (default: unsorted)")
    sw.add_argument("--sweep-stats", action="store_true",
                    help="time every config with the in-kernel statistics on (the runtime's track_stats)")
    sw.add_argument("--sweep-show", type=int, default=40, help="table rows printed (all are in the JSON)")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available() and not args.smoke:
        print("bench_attention needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 1

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.sweep_sparse:
        return run_sparse_sweep(args, dev)
    args.out = args.out or "results/bench_attention.json"

    from spade.kernels import attention, gather, ridge

    t_start = time.time()
    torch.manual_seed(0)
    if args.smoke:
        hq, hkv, d, n_sink, n_recent = SMOKE["HQ"], SMOKE["HKV"], SMOKE["D"], N_SINK, SMOKE["N_RECENT"]
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        batches, lengths, budgets, key = [2], [256], [64], (2, 256, 64)
        iters = args.iters or 2
    else:
        hq, hkv, d, n_sink, n_recent, dtype = HQ, HKV, D, N_SINK, N_RECENT, DTYPE
        batches = [8] if args.quick else [1, 8, 32]
        lengths = [32768] if args.quick else [8192, 32768, 131072]
        budgets = [2048] if args.quick else [1024, 2048]
        key = (8, 32768, 2048)
        iters = args.iters or (10 if args.quick else 30)
    timer = Timer(iters, warmup=1 if args.smoke else 3, flush=not args.no_flush, device=dev.type)
    bw = hbm_bandwidth(timer, 2**24 if args.smoke else 2**30, device=dev)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        name, sms = props.name, props.multi_processor_count
        free_bytes = torch.cuda.mem_get_info()[0]
    else:
        name, sms, free_bytes = "cpu (Triton interpreter)", 0, 2**34
    print(f"device: {name} ({sms} SMs), copy bandwidth {bw / 1e9:.0f} GB/s; "
          f"{hq} q / {hkv} KV heads, d={d}, {dtype}")
    elem = torch.finfo(dtype).bits // 8
    block_n = attention._launch_config(max(16, d), elem)[0]  # the indexed path's tile
    dense_bn = attention._launch_config(max(16, d), elem, dense=True)[0]  # the dense path's
    rows: list[dict] = []

    for B in batches:
        for L in lengths:
            kv_bytes = 2 * B * hkv * L * d * elem
            if 2.5 * kv_bytes > free_bytes:  # cache + SDPA/gather workspace
                rows.append(dict(op="dense", B=B, L=L, skipped="does not fit"))
                continue
            q = torch.randn(B, hq, d, device=dev, dtype=dtype)
            k = torch.randn(B, hkv, L, d, device=dev, dtype=dtype)
            v = torch.randn(B, hkv, L, d, device=dev, dtype=dtype)
            kv_lens = torch.full((B,), L, device=dev, dtype=torch.int32)

            # dense path (the `full` policy) vs SDPA over the whole cache
            def spade_dense(S=None, **cfg):
                return attention.sparse_decode_attention_triton(q, k, v, kv_lens, num_splits=S, **cfg)

            rows.append(dict(op="dense", B=B, L=L, K=L,
                             splits=attention.choose_num_splits(B * hkv, L, dense_bn, dev),
                             spade_ms=_try(timer, spade_dense), torch_ms=_try(timer, lambda: torch_dense(q, k, v)),
                             floor_ms=kv_bytes / bw * 1e3, rel_err=_err(spade_dense, lambda: torch_dense(q, k, v))))

            for K in budgets:
                mid = random_middle(B, hkv, L, K - n_sink - n_recent, n_sink, n_recent, dev)
                idx_full = full_index(mid, L, n_sink, n_recent)
                sel_bytes = 2 * B * hkv * K * d * elem

                def spade_sparse(S=None, **cfg):
                    return attention.sparse_decode_attention_triton(q, k, v, kv_lens, mid, n_sink=n_sink,
                                                                    n_recent=n_recent, num_splits=S, **cfg)

                def ref_sparse():
                    return torch_sparse(q, k, v, idx_full)

                rows.append(dict(op="sparse", B=B, L=L, K=K,
                                 splits=attention.choose_num_splits(B * hkv, K, block_n, dev, indexed=True),
                                 spade_ms=_try(timer, spade_sparse), torch_ms=_try(timer, ref_sparse),
                                 floor_ms=sel_bytes / bw * 1e3, rel_err=_err(spade_sparse, ref_sparse)))

                g = idx_full.long()[..., None].expand(-1, -1, -1, d)

                def torch_gather():
                    return torch.gather(k, 2, g), torch.gather(v, 2, g)

                ks, vs = gather.gather_kv_triton(k, v, idx_full)
                kr, vr = torch_gather()
                exact = bool(torch.equal(ks, kr) and torch.equal(vs, vr))
                del ks, vs, kr, vr
                rows.append(dict(op="gather", B=B, L=L, K=K,
                                 spade_ms=_try(timer, lambda: gather.gather_kv_triton(k, v, idx_full)),
                                 torch_ms=_try(timer, torch_gather),
                                 floor_ms=2 * sel_bytes / bw * 1e3, rel_err=0.0 if exact else "MISMATCH"))

                if (B, L, K) == key:  # split sweep at the headline shape
                    for S in (1, 2, 4, 8, 16, 32):
                        rows.append(dict(op="splits_sparse", B=B, L=L, K=K, splits=S, floor_ms=sel_bytes / bw * 1e3,
                                         spade_ms=_try(timer, lambda: spade_sparse(S))))
                    for S in (1, 2, 4, 8, 16, 32):
                        rows.append(dict(op="splits_dense", B=B, L=L, K=L, splits=S, floor_ms=kv_bytes / bw * 1e3,
                                         spade_ms=_try(timer, lambda: spade_dense(S))))
                    if not args.smoke:  # launch configurations at the heuristic split count
                        for bn, nw, ns in TUNE_CONFIGS:
                            cfg = dict(block_n=bn, num_warps=nw, num_stages=ns)
                            tag = f"bn{bn}_w{nw}_s{ns}"
                            rows.append(dict(op="cfg_sparse", B=B, L=L, K=K, splits=tag, floor_ms=sel_bytes / bw * 1e3,
                                             spade_ms=_try(timer, lambda: spade_sparse(**cfg))))
                            rows.append(dict(op="cfg_dense", B=B, L=L, K=L, splits=tag, floor_ms=kv_bytes / bw * 1e3,
                                             spade_ms=_try(timer, lambda: spade_dense(**cfg))))
                del mid, idx_full, g
            del q, k, v
            _empty_cache()

    for B in batches:
        N = B * hq
        window = torch.randn(N, 16, d, device=dev, dtype=dtype)
        for mode in ("assembled", "ridge"):
            def spade_ridge():
                return ridge.ridge_predict_triton(window, 16, mode=mode)

            def ref_ridge():
                return ridge.ridge_predict_ref(window, 16, mode=mode)

            rows.append(dict(op=f"ridge_{mode}", B=B, N=N, W=16, spade_ms=_try(timer, spade_ridge),
                             torch_ms=_try(timer, ref_ridge), rel_err=_err(spade_ridge, ref_ridge)))

    _print_table(rows)
    headline = [r for r in rows if r["op"] == "sparse" and (r.get("B"), r.get("L"), r.get("K")) == key
                and isinstance(r.get("spade_ms"), float)]
    if headline:
        ratio = headline[0]["spade_ms"] / headline[0]["floor_ms"]
        print(f"\nheadline B={key[0]} L={key[1]} K={key[2]} sparse: {ratio:.2f}x the byte floor (target <= 1.3x)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        device=name, sms=sms, hbm_bytes_per_s=bw, dtype=str(dtype), heads=dict(q=hq, kv=hkv, d=d),
        n_sink=n_sink, n_recent=n_recent, iters=iters, l2_flush=not args.no_flush, smoke=args.smoke,
        torch=torch.__version__, rows=rows, wall_s=time.time() - t_start), indent=1))
    print(f"wrote {out} ({time.time() - t_start:.0f} s)")
    return 0


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.4f}" if x < 100 else f"{x:.1f}"
    return "-" if x is None else str(x)[:28]


def _print_table(rows: list[dict]) -> None:
    head = ["op", "B", "L", "K", "splits", "spade_ms", "torch_ms", "floor_ms", "x_floor", "x_torch", "rel_err"]
    print("  ".join(f"{h:>13}" for h in head))
    for r in rows:
        if "skipped" in r:
            print(f"{r['op']:>13}  {r['B']:>13}  {r['L']:>13}  skipped: {r['skipped']}")
            continue
        sp, tm, fl = r.get("spade_ms"), r.get("torch_ms"), r.get("floor_ms")
        xf = sp / fl if isinstance(sp, float) and isinstance(fl, float) else None
        xt = tm / sp if isinstance(sp, float) and isinstance(tm, float) else None
        vals = [r["op"], r.get("B"), r.get("L", r.get("N")), r.get("K", r.get("W")), r.get("splits"), sp, tm, fl,
                xf, xt, r.get("rel_err")]
        print("  ".join(f"{_fmt(v):>13}" for v in vals))


if __name__ == "__main__":
    sys.exit(main())

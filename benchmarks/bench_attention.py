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

``python -m benchmarks.kernels`` runs these kernels over the same grid with their
variants side by side (fused vs two-launch split merge, single split, CUDA-graph
replay, sorted / contiguous indices) next to the Quest and scoring kernels.
"""

from __future__ import annotations

import argparse
import json
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


# ----------------------------------------------------------------------------- timing
class Timer:
    """Median CUDA-event time (ms) of a callable, L2 flushed before each call.
    On a CPU (``--smoke``) it falls back to wall-clock time."""

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


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (1 without a GPU unless --smoke)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_attention", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="B=8, L=32k, K=2k only, fewer iterations")
    ap.add_argument("--out", default="results/bench_attention.json", help="JSON output path")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per measurement")
    ap.add_argument("--no-flush", action="store_true", help="do not flush L2 between calls")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on any device (CPU: Triton interpreter); checks the script, not speed")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available() and not args.smoke:
        print("bench_attention needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 1

    from spade.kernels import attention, gather, ridge

    t_start = time.time()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
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
    block_n = attention._launch_config(max(16, d), elem)[0]
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
                             splits=attention.choose_num_splits(B * hkv, L, block_n, dev),
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
                                 splits=attention.choose_num_splits(B * hkv, K, block_n, dev),
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

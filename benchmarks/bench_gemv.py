"""GPU microbenchmark of the decode GEMV (``spade.kernels.gemv.linear_triton``) against
cuBLAS (``F.linear``) and the weight-read floor.

Qwen3-8B projections in bf16 (``w`` [N, K], nn.Linear layout): qkv 6144x4096,
o 4096x4096, gate_up 24576x4096, down 4096x12288, lm_head 151936x4096, at batch
M in {1, 8, 16, 32}.

Timing: each op is captured ``--calls`` (20) times in one CUDA graph (no launch
gaps, as in a graph-captured decode step) and the graph is replayed; a row's time
is the median over replays of (replay time / calls), from CUDA events. The calls
cycle through enough copies of ``w`` (>= 256 MiB in all) that no call finds its
weights in L2 (50 MiB on an H200), as in a real step where 36 layers of weights
stream past. Floor: weight bytes over the device-to-device copy bandwidth
measured in the same run (read + write bytes); ``tbs`` is weight bytes / time.
Every shape checks the kernel against ``F.linear`` in fp32.

``--glu`` adds the gated MLP's first half: the gate/up GEMV followed by the SiLU-product
launch (the decode step's two launches) against ``linear_glu_triton``, which forms the
product in the GEMV's epilogue (one launch, same values: checked bit for bit), on the
shapes with an even row count (gate_up), PDL as the step launches them.

``--grid`` then searches launch configs per (shape, M) by coordinate descent from
the heuristic's config (variant, BLOCK_N in {16..128}, BLOCK_K in {64..512},
SPLIT_K in {1..8}, warps {2, 4, 8}, stages {2..5}; configs that cannot fit shared
memory or registers are pruned), two passes or until ``--budget-s``, and prints
the best per shape as a dict literal to paste into ``gemv.GEMV_OVERRIDES``.
The JSON (``--out``) is rewritten after every row.

    python -m benchmarks.bench_gemv [--quick] [--glu] [--grid] [--grid-m 1,8,16,32] [--budget-s S] [--out results/bench_gemv.json]
    TRITON_INTERPRET=1 python -m benchmarks.bench_gemv --device cpu [--grid]   # tiny shapes: checks the script
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
TINY_SHAPES = {"tiny_a": (77, 200), "tiny_b": (64, 256)}
MS = [1, 8, 16, 32]
DTYPE = torch.bfloat16
ROTATE_BYTES = 256 << 20  # weight copies cycled per graph: more than L2 several times over
SMEM_MAX = 232448  # sm_90 shared memory per block
GRID_SPACE = dict(variant=["dot", "sum", "fma"], BLOCK_N=[16, 32, 64, 128], BLOCK_K=[64, 128, 256, 512],
                  SPLIT_K=[1, 2, 4, 8], num_warps=[2, 4, 8], num_stages=[2, 3, 4, 5])
TINY_GRID_SPACE = dict(variant=["dot", "fma"], BLOCK_N=[16, 32], BLOCK_K=[64], SPLIT_K=[1, 2], num_warps=[4],
                       num_stages=[2])


class Runner:
    def __init__(self, device: str, calls: int, path: Path, doc: dict):
        self.device, self.calls, self.path, self.doc = device, calls, path, doc

    def flush(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.doc, indent=1, default=str))

    # ------------------------------------------------------------------------------ timing
    def time_calls(self, call, n_copies: int) -> float:
        """Median seconds per ``call(i)`` (i cycles the weight copies): CUDA-graph replay
        of ``self.calls`` calls on a GPU; one eager call's wall clock on a CPU."""
        if self.device != "cuda":
            t0 = time.perf_counter()
            call(0)
            return time.perf_counter() - t0
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(min(n_copies, self.calls)):  # compile and allocate outside the capture
                call(i)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(self.calls):
                call(i)
        g.replay()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(15):
            e0.record()
            g.replay()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) * 1e-3 / self.calls)
        del g
        return statistics.median(times)


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a device-to-device copy (read + write bytes)."""
    n = (1 << 30) if device == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if device == "cuda":
        dst.copy_(src)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(20):
            e0.record()
            dst.copy_(src)
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) * 1e-3)
        t = statistics.median(ts)
    else:
        t0 = time.perf_counter()
        dst.copy_(src)
        t = time.perf_counter() - t0
    return 2 * n / t


def make_weights(N: int, K: int, device: str):
    nbytes = N * K * torch.empty((), dtype=DTYPE).element_size()
    n_copies = max(1, math.ceil(ROTATE_BYTES / nbytes)) if device == "cuda" else 1
    ws = [torch.randn(N, K, device=device, dtype=DTYPE) * K**-0.5 for _ in range(n_copies)]
    return ws, nbytes


def max_err(x, w, y) -> float:
    ref = F.linear(x.float(), w.float())
    return float(((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item())


def bench_config(r: Runner, x, ws, cfg) -> tuple[float, float]:
    """(seconds per call, relative max error vs fp32 F.linear) of linear_triton with ``cfg``."""
    from spade.kernels.gemv import linear_triton

    y = linear_triton(x, ws[0], config=cfg)
    err = max_err(x, ws[0], y)
    t = r.time_calls(lambda i: linear_triton(x, ws[i % len(ws)], config=cfg), len(ws))
    return t, err


def run_shape(r: Runner, name: str, N: int, K: int, Ms, bw: float, rows: list) -> None:
    from spade.kernels.gemv import gemv_config

    ws, nbytes = make_weights(N, K, r.device)
    floor = nbytes / bw if bw else float("nan")  # bw: read + write bytes of a copy
    for M in Ms:
        x = torch.randn(M, K, device=r.device, dtype=DTYPE)
        t_cublas = r.time_calls(lambda i: F.linear(x, ws[i % len(ws)]), len(ws))
        cfg = gemv_config(M, N, K, DTYPE)
        t_tri, err = bench_config(r, x, ws, cfg)
        row = dict(shape=name, N=N, K=K, M=M, weight_bytes=nbytes, floor_us=floor * 1e6,
                   cublas_us=t_cublas * 1e6, triton_us=t_tri * 1e6, speedup=t_cublas / t_tri,
                   cublas_tbs=nbytes / t_cublas / 1e12, triton_tbs=nbytes / t_tri / 1e12,
                   triton_x_floor=t_tri / floor, config=list(cfg.as_tuple()), rel_err=err)
        rows.append(row)
        r.flush()
        print(f"{name:>8} {N:>6}x{K:<5} M={M:<2}  floor {floor * 1e6:7.1f} us | cuBLAS {t_cublas * 1e6:7.1f} us "
              f"({row['cublas_tbs']:.2f} TB/s) | triton {t_tri * 1e6:7.1f} us ({row['triton_tbs']:.2f} TB/s, "
              f"x{row['triton_x_floor']:.2f} floor, {row['speedup']:.2f}x cuBLAS)  err {err:.1e}  {cfg.as_tuple()}")
    del ws
    if r.device == "cuda":
        torch.cuda.empty_cache()


def run_glu(r: Runner, name: str, N: int, K: int, Ms, bw: float, rows: list) -> None:
    """Two launches (GEMV + silu_mul) vs the fused GLU GEMV for ``w`` [N = 2I, K]."""
    from spade.kernels.gemv import gemv_config, linear_glu_triton, linear_triton
    from spade.models.fast import triton_ops

    silu_mul = triton_ops()["silu_mul"]
    ws, nbytes = make_weights(N, K, r.device)
    floor = nbytes / bw if bw else float("nan")
    for M in Ms:
        x = torch.randn(M, K, device=r.device, dtype=DTYPE) * K**-0.5
        two = silu_mul(linear_triton(x, ws[0]))
        same = bool(torch.equal(linear_glu_triton(x, ws[0]), two))
        t_two = r.time_calls(lambda i: silu_mul(linear_triton(x, ws[i % len(ws)])), len(ws))
        t_glu = r.time_calls(lambda i: linear_glu_triton(x, ws[i % len(ws)]), len(ws))
        cfg = gemv_config(M, N, K, DTYPE)
        row = dict(shape=name, N=N, K=K, M=M, weight_bytes=nbytes, floor_us=floor * 1e6, two_launch_us=t_two * 1e6,
                   glu_us=t_glu * 1e6, saved_us=(t_two - t_glu) * 1e6, glu_x_floor=t_glu / floor,
                   bit_identical=same, config=list(cfg.as_tuple()))
        rows.append(row)
        r.flush()
        print(f"{name:>8} GLU {N:>6}x{K:<5} M={M:<2}  floor {floor * 1e6:7.1f} us | GEMV + silu_mul "
              f"{t_two * 1e6:7.1f} us | fused {t_glu * 1e6:7.1f} us (x{row['glu_x_floor']:.2f} floor, "
              f"{row['saved_us']:+.1f} us)  bit-identical {same}")
        if not same:
            raise AssertionError(f"linear_glu_triton differs from GEMV + silu_mul at {name} M={M}")
    del ws
    if r.device == "cuda":
        torch.cuda.empty_cache()


def _valid(c: dict, M: int) -> bool:
    from spade.kernels.gemv import _block_m

    bm = _block_m(M, c["variant"])
    threads = 32 * c["num_warps"]
    if c["variant"] == "dot":
        if c["BLOCK_N"] < 16 or c["BLOCK_K"] < 16:
            return False
        smem = c["num_stages"] * (c["BLOCK_N"] + bm) * c["BLOCK_K"] * 2
        return smem <= SMEM_MAX and c["BLOCK_N"] * c["BLOCK_K"] // threads <= 256
    # CUDA cores: the [BLOCK_N, M_pad, BLOCK_K] products / accumulator live in registers
    per_thread = c["BLOCK_N"] * bm * c["BLOCK_K"] // threads
    return per_thread <= (128 if c["variant"] == "fma" else 256) and M <= 8


def grid_search(r: Runner, name: str, N: int, K: int, M: int, space: dict, deadline: float, rows: list):
    """Coordinate descent over ``space`` from the heuristic's config; returns the best (config, seconds)."""
    from spade.kernels.gemv import GemvConfig, gemv_config

    ws, _ = make_weights(N, K, r.device)
    x = torch.randn(M, K, device=r.device, dtype=DTYPE)
    seen: dict = {}

    def measure(c: dict):
        key = tuple(c[k] for k in ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages", "variant"))
        if key not in seen:
            try:
                t, err = bench_config(r, x, ws, GemvConfig(*key))
                ok = err < 2e-2
            except Exception as e:  # a config that fails to compile or launch is reported, not fatal
                print(f"    {key}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
                t, err, ok = float("inf"), float("nan"), False
            seen[key] = t if ok else float("inf")
            rows.append(dict(grid=name, N=N, K=K, M=M, config=list(key), us=t * 1e6, rel_err=err, ok=ok))
        return seen[key]

    best = dict(zip(("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages", "variant"),
                    gemv_config(M, N, K, DTYPE).as_tuple()))
    best_t = measure(best)
    for _ in range(2):
        improved = False
        for dim, values in space.items():
            for v in values:
                if time.time() > deadline:
                    break
                c = dict(best, **{dim: v})
                if c == best or not _valid(c, M):
                    continue
                t = measure(c)
                if t < best_t * 0.995:
                    best, best_t, improved = c, t, True
        if not improved or time.time() > deadline:
            break
    r.flush()
    del ws
    if r.device == "cuda":
        torch.cuda.empty_cache()
    return best, best_t, len(seen)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="M in {1, 8} only, fewer replays: about a minute")
    ap.add_argument("--glu", action="store_true", help="also the fused gate/up + SiLU-product GEMV vs two launches")
    ap.add_argument("--grid", action="store_true", help="search launch configs per (shape, M) and print overrides")
    ap.add_argument("--grid-m", default="1,8,16,32", help="batch sizes the grid searches")
    ap.add_argument("--shapes", default=None, help="comma-separated subset of " + ",".join(SHAPES))
    ap.add_argument("--calls", type=int, default=20, help="calls captured per CUDA graph")
    ap.add_argument("--budget-s", type=float, default=180.0, help="wall-clock budget of the --grid search")
    ap.add_argument("--device", default=None, help="cuda (default when present) or cpu (tiny shapes, interpreter)")
    ap.add_argument("--out", default="results/bench_gemv.json", help="JSON output path")
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--device cpu needs TRITON_INTERPRET=1 set before triton is imported", file=sys.stderr)
            return 1
        shapes, Ms, space, grid_ms = TINY_SHAPES, [1, 8], TINY_GRID_SPACE, [8]
    elif not torch.cuda.is_available():
        print("bench_gemv needs a CUDA GPU (--device cpu checks the script under the interpreter)", file=sys.stderr)
        return 1
    else:
        shapes, Ms, space = SHAPES, ([1, 8] if args.quick else MS), GRID_SPACE
        grid_ms = [int(m) for m in args.grid_m.split(",")]
    if args.shapes:
        shapes = {k: v for k, v in {**SHAPES, **TINY_SHAPES}.items() if k in args.shapes.split(",")}
    import triton

    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        props = torch.cuda.get_device_properties(0)
        dev_name, sms = props.name, props.multi_processor_count
    else:
        dev_name, sms = "cpu (Triton interpreter)", 0
    bw = copy_bandwidth(device)
    print(f"# {dev_name}, {sms} SMs, copy bandwidth {bw / 1e12:.2f} TB/s (read+write); torch {torch.__version__}, "
          f"triton {triton.__version__}; {DTYPE}, {args.calls} calls per graph")
    rows: list = []
    grid_rows: list = []
    doc = dict(device=dev_name, sms=sms, copy_bytes_per_s=bw, torch=torch.__version__, triton=triton.__version__,
               dtype=str(DTYPE), calls_per_graph=args.calls, rows=rows, grid=grid_rows, overrides={}, glu=[])
    r = Runner(device, args.calls if device == "cuda" else 1, Path(args.out), doc)
    t0 = time.time()
    for name, (N, K) in shapes.items():
        run_shape(r, name, N, K, Ms, bw, rows)
    if args.glu:
        for name, (N, K) in shapes.items():
            if N % 2 == 0 and (device != "cuda" or name == "gate_up"):
                run_glu(r, name, N, K, Ms, bw, doc["glu"])
    worst = max((row["rel_err"] for row in rows), default=0.0)
    if args.grid:
        deadline = time.time() + (args.budget_s if device == "cuda" else 1e9)
        overrides = {}
        for name, (N, K) in shapes.items():
            for M in grid_ms:
                best, best_t, n = grid_search(r, name, N, K, M, space, deadline, grid_rows)
                base = next((row for row in rows if row["N"] == N and row["K"] == K and row["M"] == M), None)
                key = (N, K, M)
                tup = tuple(best[k] for k in ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages", "variant"))
                overrides[key] = tup
                extra = f" (heuristic {base['triton_us']:.1f} us, cuBLAS {base['cublas_us']:.1f} us)" if base else ""
                print(f"  grid {name} M={M}: best {tup} {best_t * 1e6:.1f} us over {n} configs{extra}")
        doc["overrides"] = {repr(k): v for k, v in overrides.items()}
        r.flush()
        print("# paste into spade/kernels/gemv.py GEMV_OVERRIDES (key (N, K, M)):")
        print("GEMV_OVERRIDES.update({")
        for k, v in overrides.items():
            print(f"    {k!r}: {v!r},")
        print("})")
    r.flush()
    print(f"# wrote {args.out} ({len(rows)} rows, {len(grid_rows)} grid rows, {time.time() - t0:.0f} s); "
          f"worst relative error {worst:.1e}")
    return 0 if worst < 2e-2 else 2


if __name__ == "__main__":
    raise SystemExit(main())

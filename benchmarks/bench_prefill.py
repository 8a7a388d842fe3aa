"""The prompt pass that serving runs (``FastModel.prefill_row``), against its FLOP floor.

A served request's prompt is prefilled into a row slot, whole or in pieces of
``serving.prefill_chunk`` tokens (chunked prefill); while it runs no row decodes, so
its time is what a request's prompt costs every running request's TPOT. Per prompt
length and piece size this times one prompt's whole pass (every piece, no decode
steps between them), and reports:

* the median wall time over ``--iters`` passes (CUDA synchronised around each pass)
  and tokens per second;
* the FLOPs the pass must do: ``2 * T * P`` for the projections (``P``: the
  non-embedding parameters plus the last token's LM head) and ``2 * 2 * T^2 / 2 *
  Hq * D`` per layer for causal attention; TFLOP/s achieved and the fraction of
  ``--peak-tflops`` (default 989: an H100 SXM's dense bf16);
* with ``--fresh``: the median of ``--iters`` passes at prompt lengths never run before
  (``T - 1``, ``T - 18``, ...), whose first piece takes a random part of a chunk (the
  scheduler's budget left in an iteration): what a served trace's prompts cost, where
  every length is new (per-shape work such as cuDNN's plans shows here, not in the
  repeated passes);
* with ``--profile``: one pass under ``torch.profiler``, its CUDA time by kernel
  class (GEMM, attention, elementwise / norm / RoPE, copies, Triton, other) and the
  top kernels, so the gap to the floor has names.

The report callback is a no-op here: the policy's per-layer state (a cache rank's
query window and scoring copies) is not in these numbers.

    python -m benchmarks.bench_prefill --preset qwen3-8b --lengths 4096,16384,32768 --chunks 0,2048,512 \
        --profile --out results/gpu/bench_prefill.json
    python -m benchmarks.bench_prefill --smoke          # the tiny preset on a CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.args import int_list

CLASSES = ("gemm", "attention", "elementwise", "copy", "triton", "other")


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_prefill", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-8b", help="random-weight model preset (spade.models.presets)")
    ap.add_argument("--lengths", type=int_list(1), default=[4096, 16384, 32768], help="prompt tokens, comma-separated")
    ap.add_argument("--chunks", type=int_list(0), default=[0, 2048],
                    help="piece sizes (serving.prefill_chunk), comma-separated; 0: the whole prompt in one pass")
    ap.add_argument("--block-size", type=int, default=None, help="a paged KV cache of this block size")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--fresh", action="store_true",
                    help="also time passes at prompt lengths never run before (T + 1, T + 2, ...; a served trace's "
                         "prompts), whose first piece takes a random share of the chunk (the scheduler's budget)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak, for the fraction")
    ap.add_argument("--profile", action="store_true", help="profile one pass of the longest prompt per piece size")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per profile")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="the tiny preset, short prompts (CPU)")
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args(argv)
    if args.smoke:
        args.preset, args.lengths, args.chunks, args.iters = "tiny", [40, 96], [0, 32], 1
        if not torch.cuda.is_available():
            args.device = "cpu"
    if args.iters < 1:
        ap.error(f"--iters must be >= 1, got {args.iters}")
    return args


def flops(arch, T: int) -> dict:
    """The pass's FLOPs: projections over ``T`` tokens (and the LM head once), causal attention."""
    a = arch
    D, Hq, Hkv = a.head_dim, a.n_q_heads, a.n_kv_heads
    per_layer = a.hidden * (Hq + 2 * Hkv) * D + Hq * D * a.hidden + 3 * a.hidden * a.intermediate
    proj = 2 * T * per_layer * a.n_layers + 2 * a.hidden * a.vocab
    attn = 2 * 2 * (T * (T + 1) / 2) * Hq * D * a.n_layers  # QK^T and PV over the causal triangle
    return {"projections": proj, "attention": attn, "total": proj + attn}


def kernel_class(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("flash", "fmha", "cudnn", "attention", "sdpa")):
        return "attention"
    if any(s in n for s in ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul")):
        return "gemm"
    if any(s in n for s in ("copy", "memcpy", "memset", "cat", "index", "gather", "scatter")):
        return "copy"
    if "triton" in n:
        return "triton"
    if any(s in n for s in ("elementwise", "reduce", "vectorized", "unrolled", "norm", "softmax", "silu", "mul",
                            "pow", "rsqrt", "mean")):
        return "elementwise"
    return "other"


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def one_pass(model, T: int, chunk: int, ids: torch.Tensor, first: int = 0) -> torch.Tensor:
    """Prefill ``ids`` [T] into row 0 in pieces of ``chunk`` tokens (0: whole), the first
    piece ``first`` tokens when given; the last position's logits [1, V]."""
    if model.paged:
        model.kv_free(0)
    model.reset_slots(T)
    noop = lambda *a: None  # noqa: E731
    if chunk <= 0 or chunk >= T:
        return model.prefill_row(0, ids, noop)
    off = 0
    while off < T:
        c = min(first or chunk, T - off)
        first = 0
        out = model.prefill_row(0, ids[off:off + c], noop, first=0, offset=off, last=off + c == T)
        off += c
    return out


def profile_pass(model, T: int, chunk: int, ids: torch.Tensor, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        one_pass(model, T, chunk, ids)
        sync(model.device)
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0)
        if model.device.type != "cuda":
            t = e.self_cpu_time_total
        if t and (model.device.type != "cuda" or getattr(e, "device_type", None) is None
                  or str(getattr(e, "device_type", "")).endswith("CUDA")):
            rows.append((e.key, float(t) / 1e3, int(e.count)))
    by_class = {c: 0.0 for c in CLASSES}
    for name, ms, _ in rows:
        by_class[kernel_class(name)] += ms
    rows.sort(key=lambda r: -r[1])
    return {"by_class_ms": by_class, "total_ms": sum(by_class.values()),
            "top": [{"kernel": n[:120], "ms": ms, "calls": c, "class": kernel_class(n)} for n, ms, c in rows[:top]]}


def run(argv: list[str] | None = None) -> dict:
    args = parse_args(argv if argv is not None else sys.argv[1:])
    from spade.models.fast import FastModel
    from spade.models.presets import preset_config

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    Lmax = max(args.lengths)
    kw = {}
    if args.block_size:
        kw = {"block_size": args.block_size, "kv_blocks": -(-Lmax // args.block_size) + 1}
    t0 = time.time()
    model = FastModel.from_config(preset_config(args.preset), device=dev, dtype=dtype, max_batch=1,
                                  max_seq_len=Lmax, **kw)
    print(f"# {args.preset} on {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}), "
          f"{str(dtype).removeprefix('torch.')}, loaded in {time.time() - t0:.1f} s"
          + (f", paged (block {args.block_size})" if args.block_size else ""), flush=True)
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'T':>7} {'chunk':>6} {'ms':>10} {'tok/s':>9} {'TFLOP/s':>8} {'of peak':>8} {'logits err':>10}",
          flush=True)
    for T in args.lengths:
        ids = torch.randint(0, model.vocab_size, (T,), generator=g)
        fl = flops(model.arch, T)
        with torch.inference_mode():
            ref = one_pass(model, T, 0, ids).float()  # the whole prompt's logits: what pieces must give
        for chunk in args.chunks:
            with torch.inference_mode():
                got = one_pass(model, T, chunk, ids).float()  # also the warm-up (kernels, autotuning)
                sync(dev)
                times = []
                for _ in range(args.iters):
                    t = time.perf_counter()
                    one_pass(model, T, chunk, ids)
                    sync(dev)
                    times.append(time.perf_counter() - t)
            fresh = []
            if args.fresh:  # lengths never run before, a random first piece: every attention shape new
                with torch.inference_mode():
                    for j in range(args.iters):
                        Tj = T - 1 - 17 * j - 3 * len(rows)
                        first = int(torch.randint(64, max(65, chunk), (1,), generator=g)) if 0 < chunk < Tj else 0
                        t = time.perf_counter()
                        one_pass(model, Tj, chunk, ids[:Tj], first)
                        sync(dev)
                        fresh.append(time.perf_counter() - t)
            s = statistics.median(times)
            row = {"T": T, "chunk": chunk, "pieces": 1 if chunk <= 0 or chunk >= T else -(-T // chunk),
                   "ms": s * 1e3, "tokens_per_s": T / s, "flops": fl, "tflops": fl["total"] / s / 1e12,
                   "of_peak": fl["total"] / s / 1e12 / args.peak_tflops,
                   "floor_ms": fl["total"] / (args.peak_tflops * 1e12) * 1e3,
                   "logits_rel_err_vs_whole": float((got - ref).norm() / ref.norm().clamp_min(1e-30)),
                   "fresh_ms": statistics.median(fresh) * 1e3 if fresh else None,
                   "fresh_each_ms": [round(t * 1e3, 1) for t in fresh]}
            print(f"{T:>7} {chunk:>6} {row['ms']:>10.1f} {row['tokens_per_s']:>9.0f} {row['tflops']:>8.1f} "
                  f"{row['of_peak']:>8.2f} {row['logits_rel_err_vs_whole']:>10.1e}"
                  + (f"  fresh lengths {row['fresh_ms']:.1f} ms ({', '.join(map(str, row['fresh_each_ms']))})"
                     if fresh else ""), flush=True)
            rows.append(row)
    profiles = []
    if args.profile:
        T = Lmax
        ids = torch.randint(0, model.vocab_size, (T,), generator=g)
        for chunk in args.chunks:
            with torch.inference_mode():
                p = profile_pass(model, T, chunk, ids, args.top)
            p.update(T=T, chunk=chunk)
            profiles.append(p)
            print(f"\n# profile T={T} chunk={chunk}: {p['total_ms']:.1f} ms of kernels; by class: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in p["by_class_ms"].items()), flush=True)
            for r in p["top"]:
                print(f"  {r['ms']:9.2f} ms {r['calls']:6d}x  [{r['class']}] {r['kernel']}")
    out = {"preset": args.preset, "device": str(dev),
               "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
               "dtype": str(dtype), "block_size": args.block_size, "peak_tflops": args.peak_tflops,
           "torch": torch.__version__, "rows": rows, "profiles": profiles}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(f"# wrote {args.out}")
    return out


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())

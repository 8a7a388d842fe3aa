"""Does the KV cache layout bound the sparse decode attention? Gathered rows vs the byte floor.

The sparse attention (``spade.kernels.attention``) reads, per (batch row, KV head), the
K and V rows of the selected tokens: 256-byte rows (d=128, bf16) at scattered positions
of two separate [B, Hkv, L, d] caches. Its time sits at ~2x the byte floor of a
sequential copy (docs/perf.md, run29: 33 us vs 15.8 at B=8 L=32k K=2k, L2 flushed),
whatever its launch grid. This benchmark asks whether that is the scattered access
itself and whether a layout with each token's K and V side by side (one 512-byte
[2, d] row per token and KV head, the two caches as strided views of one
[B, Hkv, L, 2, d] buffer) moves it:

* ``gather``: ``gather_kv`` (a pure copy of the selected rows into contiguous
  buffers) over the separate layout, the interleaved layout, and separate caches of
  512-byte rows (d=256: the same row count, twice the bytes) — read bandwidth of
  scattered rows by row size;
* ``sparse``: the sparse attention over the separate vs interleaved layout (the same
  kernel: it takes strides), indices unsorted and sorted;
* ``dense``: the dense path (the ``full`` policy) over both layouts, so that a layout
  that helps the sparse step does not cost the baseline;
* ``copy``: the device-to-device copy floor (read + write bytes).

Every time is a median of CUDA-event timings with L2 flushed before each call
(``--no-flush``: warm L2, closer to the decode step, where the step's other kernels
leave part of the cache in L2). JSON to ``--out``.

    python -m benchmarks.bench_kv_layout [--B 8] [--L 32768] [--K 2048] [--out results/gpu/kv_layout.json]
    python -m benchmarks.bench_kv_layout --smoke      # tiny shapes, CPU / interpreter
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.bench_attention import Timer, hbm_bandwidth, random_middle


def caches(B: int, Hkv: int, L: int, D: int, layout: str, dtype, device, seed: int = 0):
    """(k, v) [B, Hkv, L, D]: two tensors (``separate``) or two strided views of one
    [B, Hkv, L, 2, D] buffer (``interleaved``), same values either way."""
    g = torch.Generator(device=device).manual_seed(seed)
    if layout == "separate":
        k = torch.randn(B, Hkv, L, D, generator=g, device=device).to(dtype)
        v = torch.randn(B, Hkv, L, D, generator=g, device=device).to(dtype)
        return k, v
    if layout == "interleaved":
        kv = torch.empty(B, Hkv, L, 2, D, dtype=dtype, device=device)
        k, v = kv[:, :, :, 0], kv[:, :, :, 1]
        k.copy_(torch.randn(B, Hkv, L, D, generator=g, device=device))
        v.copy_(torch.randn(B, Hkv, L, D, generator=g, device=device))
        return k, v
    raise ValueError(f"layout must be 'separate' or 'interleaved', got {layout!r}")


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_kv_layout", description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--L", type=int, default=32768)
    ap.add_argument("--K", type=int, default=2048, help="middle tokens selected per (row, KV head)")
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--g", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--recent", type=int, default=64)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--no-flush", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU / TRITON_INTERPRET=1)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.smoke:
        a.B, a.L, a.K, a.hkv, a.g, a.d, a.sink, a.recent, a.iters = 2, 96, 16, 2, 2, 16, 2, 4, 2
    for f in ("B", "L", "K", "hkv", "g", "d", "iters"):
        if getattr(a, f) < 1:
            ap.error(f"--{f} must be >= 1, got {getattr(a, f)}")
    if a.K + a.sink + a.recent > a.L:
        ap.error(f"--K + --sink + --recent ({a.K + a.sink + a.recent}) must be <= --L ({a.L})")
    return a


def run(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    from spade import kernels

    dev = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    timer = Timer(a.iters, warmup=3, flush=not a.no_flush, device=dev.type)
    B, Hkv, L, K, D = a.B, a.hkv, a.L, a.K, a.d
    esz = torch.empty((), dtype=dtype).element_size()
    res: dict = {"shape": dict(B=B, Hkv=Hkv, G=a.g, L=L, K=K, D=D, sink=a.sink, recent=a.recent,
                               dtype=str(dtype).replace("torch.", "")),
                 "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                 "flush_l2": not a.no_flush, "rows": []}
    copy_bw = hbm_bandwidth(timer, 2**30 if dev.type == "cuda" else 2**20, device=dev.type)
    res["copy_TBps"] = copy_bw / 1e12
    print(f"device {res['device']}; copy {copy_bw / 1e12:.2f} TB/s (read + write); shape {res['shape']}",
          flush=True)

    def row(kind: str, layout: str, order: str, ms: float, nbytes: int, err: float | None = None) -> None:
        r = dict(kind=kind, layout=layout, order=order, us=ms * 1e3, bytes=nbytes,
                 TBps=nbytes / (ms * 1e-3) / 1e12, x_floor=(ms * 1e-3) / (nbytes / copy_bw))
        if err is not None:
            r["rel_err_vs_separate"] = err
        res["rows"].append(r)
        print(f"{kind:7s} {layout:12s} {order:9s} {r['us']:9.1f} us  {r['TBps']:5.2f} TB/s  "
              f"{r['x_floor']:5.2f}x floor" + ("" if err is None else f"  err {err:.1e}"), flush=True)

    mid = random_middle(B, Hkv, L, K, a.sink, a.recent, dev)
    orders = {"unsorted": mid, "sorted": mid.sort(dim=-1).values.contiguous()}
    q = torch.randn(B, Hkv * a.g, D, device=dev).to(dtype)
    kv_lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    n_tok = a.sink + K + a.recent

    # gather: scattered rows copied out (read bytes = the rows; the write is contiguous)
    for layout, d_row in (("separate", D), ("interleaved", D), ("separate-2d", 2 * D)):
        k, v = caches(B, Hkv, L, d_row, "interleaved" if layout == "interleaved" else "separate", dtype, dev)
        for order, idx in orders.items():
            ms = timer(lambda k=k, v=v, idx=idx: kernels.gather_kv(k, v, idx))
            row("gather", layout, order, ms, 2 * B * Hkv * K * d_row * esz)
        del k, v

    outs: dict = {}
    for layout in ("separate", "interleaved"):
        k, v = caches(B, Hkv, L, D, layout, dtype, dev)
        for order, idx in orders.items():
            def sparse(k=k, v=v, idx=idx):
                return kernels.sparse_decode_attention(q, k, v, kv_lens, idx, n_sink=a.sink, n_recent=a.recent)
            ms = timer(sparse)
            o = sparse().float()
            ref = outs.setdefault(("sparse", order), o)
            row("sparse", layout, order, ms, 2 * B * Hkv * n_tok * D * esz,
                float((o - ref).norm() / ref.norm().clamp_min(1e-12)))

        def dense(k=k, v=v):
            return kernels.sparse_decode_attention(q, k, v, kv_lens)
        ms = timer(dense)
        o = dense().float()
        ref = outs.setdefault(("dense",), o)
        row("dense", layout, "-", ms, 2 * B * Hkv * L * D * esz, float((o - ref).norm() / ref.norm().clamp_min(1e-12)))
        del k, v

    by = {(r["kind"], r["layout"], r["order"]): r["us"] for r in res["rows"]}
    res["ratios_interleaved_vs_separate"] = {
        f"{kind}/{order}": by[(kind, "interleaved", order)] / by[(kind, "separate", order)]
        for kind, order in (("gather", "unsorted"), ("gather", "sorted"), ("sparse", "unsorted"),
                            ("sparse", "sorted"), ("dense", "-"))}
    print("interleaved / separate:", {k: round(v, 3) for k, v in res["ratios_interleaved_vs_separate"].items()})
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
        print(f"wrote {a.out}")
    return res


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())

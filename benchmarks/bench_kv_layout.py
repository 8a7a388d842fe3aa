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

Every time is a median of CUDA-event timings with L2 flushed before each call (the
flush's memset also hides the host's launch of the call: with ``--no-flush`` each time
includes it, so those are not kernel timings). ``--K`` takes several budgets: between
successive ones the sparse attention's *marginal* rate (added bytes over added time,
separate caches, unsorted indices) separates the scattered-read rate from the fixed
cost of a call (the intercept). JSON to ``--out`` and a bar chart of the rates beside
it (``.png``).

    python -m benchmarks.bench_kv_layout [--B 8] [--L 32768] [--K 1024,2048] [--out results/gpu/kv_layout.json]
    python -m benchmarks.bench_kv_layout --smoke      # tiny shapes, CPU / interpreter
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.args import int_list
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
    ap.add_argument("--K", type=int_list(), default=[1024, 2048],
                    help="middle tokens selected per (row, KV head), comma-separated (default 1024,2048)")
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--g", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--recent", type=int, default=64)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--no-flush", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU / TRITON_INTERPRET=1)")
    ap.add_argument("--out", default=None, help="JSON path (a .png of the rates is written beside it)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.B, a.L, a.K, a.hkv, a.g, a.d, a.sink, a.recent, a.iters = 2, 96, [8, 16], 2, 2, 16, 2, 4, 2
    for f in ("B", "L", "hkv", "g", "d", "iters"):
        if getattr(a, f) < 1:
            ap.error(f"--{f} must be >= 1, got {getattr(a, f)}")
    a.K = sorted(set(a.K))
    if a.K[0] < 1:
        ap.error(f"--K values must be >= 1, got {a.K[0]}")
    if a.K[-1] + a.sink + a.recent > a.L:
        ap.error(f"--K + --sink + --recent ({a.K[-1] + a.sink + a.recent}) must be <= --L ({a.L})")
    return a


def run(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    from spade import kernels

    dev = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    timer = Timer(a.iters, warmup=3, flush=not a.no_flush, device=dev.type)
    B, Hkv, L, D = a.B, a.hkv, a.L, a.d
    esz = torch.empty((), dtype=dtype).element_size()
    res: dict = {"shape": dict(B=B, Hkv=Hkv, G=a.g, L=L, K=a.K, D=D, sink=a.sink, recent=a.recent,
                               dtype=str(dtype).replace("torch.", "")),
                 "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                 "flush_l2": not a.no_flush, "rows": []}
    copy_bw = hbm_bandwidth(timer, 2**30 if dev.type == "cuda" else 2**20, device=dev.type)
    res["copy_TBps"] = copy_bw / 1e12
    print(f"device {res['device']}; copy {copy_bw / 1e12:.2f} TB/s (read + write); shape {res['shape']}",
          flush=True)

    def row(kind: str, layout: str, order: str, K: int, ms: float, nbytes: int, err: float | None = None) -> None:
        r = dict(kind=kind, layout=layout, order=order, K=K, us=ms * 1e3, bytes=nbytes,
                 TBps=nbytes / (ms * 1e-3) / 1e12, x_floor=(ms * 1e-3) / (nbytes / copy_bw))
        if err is not None:
            r["rel_err_vs_separate"] = err
        res["rows"].append(r)
        print(f"{kind:7s} {layout:12s} {order:9s} K={K:<6d} {r['us']:9.1f} us  {r['TBps']:5.2f} TB/s  "
              f"{r['x_floor']:5.2f}x floor" + ("" if err is None else f"  err {err:.1e}"), flush=True)

    q = torch.randn(B, Hkv * a.g, D, device=dev).to(dtype)
    kv_lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    outs: dict = {}
    for K in a.K:
        mid = random_middle(B, Hkv, L, K, a.sink, a.recent, dev)
        orders = {"unsorted": mid, "sorted": mid.sort(dim=-1).values.contiguous()}
        n_tok = a.sink + K + a.recent
        # gather: scattered rows copied out (the bytes counted are the rows read; the write is contiguous)
        for layout, d_row in (("separate", D), ("interleaved", D), ("separate-2d", 2 * D)):
            k, v = caches(B, Hkv, L, d_row, "interleaved" if layout == "interleaved" else "separate", dtype, dev)
            for order, idx in orders.items():
                ms = timer(lambda k=k, v=v, idx=idx: kernels.gather_kv(k, v, idx))
                row("gather", layout, order, K, ms, 2 * B * Hkv * K * d_row * esz)
            del k, v
        for layout in ("separate", "interleaved"):
            k, v = caches(B, Hkv, L, D, layout, dtype, dev)
            for order, idx in orders.items():
                def sparse(k=k, v=v, idx=idx):
                    return kernels.sparse_decode_attention(q, k, v, kv_lens, idx, n_sink=a.sink,
                                                           n_recent=a.recent)
                ms = timer(sparse)
                o = sparse().float()
                ref = outs.setdefault(("sparse", K, order), o)
                row("sparse", layout, order, K, ms, 2 * B * Hkv * n_tok * D * esz,
                    float((o - ref).norm() / ref.norm().clamp_min(1e-12)))
            if K == a.K[0]:  # the dense path does not depend on K
                def dense(k=k, v=v):
                    return kernels.sparse_decode_attention(q, k, v, kv_lens)
                ms = timer(dense)
                o = dense().float()
                ref = outs.setdefault(("dense",), o)
                row("dense", layout, "-", 0, ms, 2 * B * Hkv * L * D * esz,
                    float((o - ref).norm() / ref.norm().clamp_min(1e-12)))
            del k, v

    by = {(r["kind"], r["layout"], r["order"], r["K"]): r for r in res["rows"]}
    res["ratios_interleaved_vs_separate"] = {
        f"{kind}/{order}/K={K}": by[(kind, "interleaved", order, K)]["us"] / by[(kind, "separate", order, K)]["us"]
        for kind, order, Ks in (("gather", "unsorted", a.K), ("gather", "sorted", a.K), ("sparse", "unsorted", a.K),
                                ("sparse", "sorted", a.K), ("dense", "-", [0])) for K in Ks}
    print("interleaved / separate:", {k: round(v, 3) for k, v in res["ratios_interleaved_vs_separate"].items()})
    res["sparse_marginal"] = []
    for k0, k1 in zip(a.K, a.K[1:]):
        r0, r1 = by[("sparse", "separate", "unsorted", k0)], by[("sparse", "separate", "unsorted", k1)]
        dt_us, db = r1["us"] - r0["us"], r1["bytes"] - r0["bytes"]
        m = dict(K0=k0, K1=k1, added_us=dt_us, added_bytes=db,
                 TBps=db / (dt_us * 1e-6) / 1e12 if dt_us > 0 else float("inf"),
                 intercept_us=r0["us"] - dt_us * r0["bytes"] / db)
        res["sparse_marginal"].append(m)
        print(f"sparse attention K={k0}->{k1}: +{dt_us:.1f} us for +{db / 1e6:.1f} MB = {m['TBps']:.2f} TB/s "
              f"marginal; intercept {m['intercept_us']:.1f} us", flush=True)
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1))
        print(f"wrote {out}")
        png = plot(res, out.with_suffix(".png"))
        if png:
            print(f"wrote {png}")
    return res


def plot(res: dict, path: Path) -> str | None:
    """Bars of the read rate (TB/s) per row, the copy rate as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # pragma: no cover - matplotlib is a dependency
        print(f"plot skipped: {e}", file=sys.stderr)
        return None
    rows = res["rows"]
    names = [f"{r['kind']} {r['layout']} {r['order']}" + (f" K={r['K']}" if r["kind"] != "dense" else "")
             for r in rows]
    colors = {"gather": "#888", "sparse": "#3a7", "dense": "#37a"}
    fig, ax = plt.subplots(figsize=(max(7, 0.45 * len(rows)), 4.5))
    ax.bar(range(len(rows)), [r["TBps"] for r in rows], color=[colors[r["kind"]] for r in rows])
    ax.axhline(res["copy_TBps"], color="k", ls="--", lw=1, label=f"copy {res['copy_TBps']:.2f} TB/s (read + write)")
    ax.set_xticks(range(len(rows)), names, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("TB/s of the rows read")
    sh = res["shape"]
    ax.set_title(f"{res['device']}: B={sh['B']} L={sh['L']} Hkv={sh['Hkv']} d={sh['D']}"
                 + (", L2 flushed" if res["flush_l2"] else ""), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())

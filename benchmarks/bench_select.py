"""Where the fused score + top-K spends its time, stage by stage, and how the
radix-select launch config moves it.

Each stage is timed as the difference of cumulative CUDA graphs replayed on the
GPU (graph 1 = workspace memset + scoring with the pass-0 histogram, graph 2 =
graph 1 + radix pass 1, graph 3 = + split, graph 4 = + tie select), so launch
gaps inside a graph are counted where they occur in the runtime (the cache rank
replays its layer work as a graph too). Then graph 4 is re-timed for a grid of
``SELECT_CONFIG`` overrides (tile ``BLOCK``, ``num_warps``, ``MIN_CHUNK``, programs
``PER_SM``; per-row tie tile ``TIE_BLOCK``) so that the default can be chosen from measurements.

(A "compact" variant — one scan writing the 8-bit winners and listing the 8-bit
ties, then one program per row over that list — was built and measured here on an
H200 and removed: 62 vs 37 us at B=8 L=32k, 224 vs 103 us at B=8 L=128k, 152 vs
104 us at B=32 L=32k. Compacting the 8-bit ties (a sixth of the row or more)
costs more than the second full scan it saves, and the per-row program is
latency-bound on long lists.)

(A "hint" path — a per-row threshold carried from the previous call of the same
rows; stage 1 appends the positions scoring above it to a list, one program per
row finishes the exact top-K from that ~1.25 K list with four 8-bit radix passes
in registers and re-aims the threshold, the radix kernels run only for rows whose
list missed — was built here in session 4 and measured slower than the default on
an H200 (run19: 0.152 vs 0.106 ms, int4, B=8 L=32k). Session 7 rebuilt the idea as
``score_topk(..., carry=)`` and it is now the asyncspade default (``policy.topk``):
the scoring keeps no pass-0 histogram (15-22 us of the default's scoring), marks
candidates in a bitmask (no atomics), and one kernel per row expands it and
selects with 16-bin digits: 76-78 vs 106 us at B=8 L=32k, 120 vs 174 at B=16, 136
vs 178 at B=32 L=16k. Its rows that miss (too few or too many candidates) now go
to the radix passes, gated on a per-row flag, as the hint path did: a fallback inside
the one-program-per-row select swept the whole row alone, milliseconds at 512k
tokens. ``--carry`` times it stage by stage, and the forced fallback.)

Every timed configuration is checked against ``torch.topk`` first (sum of the
selected true scores, like the kernel tests): a wrong selection is reported,
never timed.

    python -m benchmarks.bench_select [--shapes 8x32768,32x32768] [--budget 2048] [--keys exact,int8]
                                      [--budget-s 120] [--no-grid] [--out results/bench_select.json]
    python -m benchmarks.bench_select --tiny   # CPU interpreter: checks the script in seconds
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

HQ, HKV, D = 32, 8, 128
N_SINK, N_RECENT = 4, 64


def _graph_ms(fn, *, rep: int) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph (wall clock of one call on a CPU)."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return float(triton.testing.do_bench(g.replay, warmup=10, rep=rep, return_mode="median"))


def _stage_fns(q, k, ks, lo, hi, K: int):
    """Closures running the first n stages of ``score_topk_triton`` on preallocated
    buffers (n = 1..4: scoring with the pass-0 histogram, radix pass 1, split, ties),
    the stage names, and the buffer holding the result."""
    from spade.kernels import common, radix_topk, scoring  # after main's TRITON_INTERPRET

    B, Hq, _ = q.shape
    _, Hkv, L, Dk = k.shape
    rows = B * Hkv
    dev = k.device
    ws = radix_topk._new_workspace(rows, dev)
    scores = torch.empty(rows, L, dtype=torch.float32, device=dev)
    out = torch.empty(rows, K, dtype=torch.int32, device=dev)
    ties = torch.empty(rows, L, dtype=torch.int32, device=dev)
    n_lo, n_hi = scoring._norm_range(lo, hi, None, "sum_logits")
    scale = scoring._default_scale(None, Dk)
    names = ["score", "pass1", "split", "tie"]

    def run(n: int) -> None:
        ws.zero_()
        scoring._launch_scores(q, k, scores.view(B, Hkv, L), lo, hi, n_lo, n_hi, scale=scale, reduce="sum_logits",
                               full_row=False, hist=ws, k_scale=ks)
        c = radix_topk._select_config(dev)
        meta = dict(HKV=Hkv, BLOCK=c["BLOCK"], INTERPRET=common._interpret(), num_warps=c["num_warps"])
        chunk, n_chunks = common._split(L, rows, dev, block=c["BLOCK"], min_chunk=c["MIN_CHUNK"],
                                         per_sm=c.get("PER_SM", 4))
        grid = (rows, n_chunks)
        cnt = ws[radix_topk._NHIST * rows * radix_topk._NBINS:]
        if n >= 2:
            radix_topk._radix_pass_kernel[grid](scores, ws, lo, hi, ws, L, rows, K, 0, chunk, PASS=1, **meta)
        if n >= 3:
            radix_topk._radix_split_kernel[grid](scores, ws, cnt, out, ties, lo, hi, ws, L, rows, K, chunk, **meta)
        if n >= 4:
            radix_topk._tie_select_kernel[(rows,)](scores, ws, out, ties, lo, hi, ws, L, rows, K, 0,
                                                **dict(meta, BLOCK=c.get("TIE_BLOCK", c["BLOCK"])))

    return run, names, out


def _carry_fns(q, k, ks, lo, hi, K: int):
    """Closures for the threshold-carry top-K (``score_topk(..., carry=)``) on preallocated
    buffers: ``run(n)`` runs scoring alone (n=1, no histogram), + the candidate compaction
    (n=2), + the carry select (n=3); ``run_fallback()`` resets the carry first, so every
    row takes the whole-row fallback. Returns (run, run_fallback, out, carry)."""
    from spade.kernels import carry as carry_mod, scoring  # after main's TRITON_INTERPRET

    B, Hq, _ = q.shape
    _, Hkv, L, Dk = k.shape
    rows = B * Hkv
    dev = k.device
    carry = carry_mod.new_carry(B, Hkv, dev)
    scores = torch.empty(rows, L, dtype=torch.float32, device=dev)
    out = torch.empty(rows, K, dtype=torch.int32, device=dev)
    n_lo, n_hi = scoring._norm_range(lo, hi, None, "sum_logits")
    scale = scoring._default_scale(None, Dk)
    neg_inf = carry_mod.new_carry(B, Hkv, dev)

    def run(n: int) -> None:
        if n == 1:
            scoring._launch_scores(q, k, scores.view(B, Hkv, L), lo, hi, n_lo, n_hi, scale=scale,
                                   reduce="sum_logits", full_row=False, hist=None, k_scale=ks)
            return
        carry_mod._carry_topk(q, k, scores, lo, hi, n_lo, n_hi, K, carry, out, scale=scale, reduce="sum_logits",
                            k_scale=ks, hkv=Hkv, select=n >= 3)

    def run_fallback() -> None:
        carry.copy_(neg_inf)
        run(3)

    return run, run_fallback, out, carry


def _overlap_fns(q, k, ks, lo, hi, K: int, layers: int):
    """``layers`` consecutive layers of the threshold-carry top-K as a cache rank's pack
    runs them (own carry, scores and output per layer; the same keys and query):
    ``run(on)`` with ``select_overlap`` on or off, ``reset()`` their carries. Returns
    (run, reset, outs)."""
    from spade.kernels import carry as carry_mod, overlap, scoring  # after main's TRITON_INTERPRET

    B = q.shape[0]
    _, Hkv, L, Dk = k.shape
    rows = B * Hkv
    dev = k.device
    carries = [carry_mod.new_carry(B, Hkv, dev) for _ in range(layers)]
    scores = [torch.empty(rows, L, dtype=torch.float32, device=dev) for _ in range(layers)]
    outs = [torch.empty(rows, K, dtype=torch.int32, device=dev) for _ in range(layers)]
    n_lo, n_hi = scoring._norm_range(lo, hi, None, "sum_logits")
    scale = scoring._default_scale(None, Dk)

    def run(on: bool) -> None:
        with overlap.select_overlap(dev, enabled=on):
            for j in range(layers):
                carry_mod._carry_topk(q, k, scores[j], lo, hi, n_lo, n_hi, K, carries[j], outs[j], scale=scale,
                                    reduce="sum_logits", k_scale=ks, hkv=Hkv)

    def reset() -> None:
        for c in carries:
            carry_mod.reset_carry(c)

    return run, reset, outs


def _carry_cfg(spec: str) -> dict:
    """``BITS:WARPS[:WORDS]`` as ``SELECT_CONFIG`` overrides (``default``: none)."""
    if spec == "default":
        return {}
    bits, warps, *rest = spec.split(":")
    cfg = dict(carry_bits=int(bits), carry_warps=int(warps))
    if rest:
        cfg["carry_words"] = int(rest[0])
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8x32768,32x32768,8x131072", help="BxL,... (Qwen3-8B layer: 32 q / 8 KV heads)")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--keys", default="exact,int8,int4,int8_float",
                    help="exact (bf16), int8 / int4 (int8 tensor-core tile), int8_float (int8 keys, float GEMV tile)")
    ap.add_argument("--budget-s", type=float, default=120.0)
    ap.add_argument("--tiny", action="store_true", help="CPU interpreter, tiny shapes: checks the script")
    ap.add_argument("--no-grid", action="store_true", help="the default config only (no config sweeps)")
    ap.add_argument("--carry", default="",
                    help="also time the threshold-carry top-K for these select configs, BITS:WARPS[:WORDS],... "
                         "(e.g. 8:16,4:16:1024; WORDS: bitmask words expanded per step): scoring alone, "
                         "+ compaction, + select, and the forced fallback")
    ap.add_argument("--carry-tiles", default="",
                    help="int4 / int8 keys: also time scoring + compaction of the first --carry config under "
                         "these scoring tiles, BLOCK_L:WARPS:STAGES[:PER_SM],... (GEMV_CONFIG)")
    ap.add_argument("--carry-packs", default="",
                    help="with --carry-tiles: time each tile under these int4 tokens per MMA row, 1,4 "
                         "(GEMV_CONFIG pack; empty: the library's default)")
    ap.add_argument("--overlap", default="",
                    help="with --carry: time a pack of --overlap-layers layers with the select on a side stream "
                         "(select_overlap) against the same serially; WARPS[:PRIORITY],... of the side-stream select "
                         "(0 = the serial select's warps; the default under overlap: SELECT_CONFIG carry_overlap_warps)")
    ap.add_argument("--overlap-layers", type=int, default=4)
    ap.add_argument("--profile", action="store_true",
                    help="with --carry: each carry row's kernels by device time (torch.profiler over 20 eager "
                         "calls of scoring + select; run with SPADE_PDL=off for times without early-launch waits)")
    ap.add_argument("--dims", default=str(D),
                    help="key dims scored, comma-separated: 128 is the full head; r < 128 is the scoring copy of "
                         "policy.score_channels r (rows carry d)")
    ap.add_argument("--out", default="results/bench_select.json")
    args = ap.parse_args(argv)
    packs = [x.strip() for x in args.carry_packs.split(",") if x.strip()]
    if any(x not in ("1", "4") for x in packs):
        ap.error(f"--carry-packs takes 1,4 (int4 tokens per MMA row, comma-separated); got {args.carry_packs!r}")
    args.carry_packs = [int(x) for x in packs] or [0]  # 0: the library's default
    t_end = time.monotonic() + args.budget_s
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda:
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
    from spade.kernels import carry as carry_mod, quant, radix_topk, scoring  # after TRITON_INTERPRET

    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    K = args.budget
    hq, hkv, d = HQ, HKV, D
    rep = 50
    grid_cfg = [dict(BLOCK=b, num_warps=w, MIN_CHUNK=m, PER_SM=p, TIE_BLOCK=512)
                for b, w, m, p in itertools.product((512, 1024, 2048), (4, 8), (1024, 4096), (4, 8))]
    if args.tiny:
        shapes, K, hq, hkv, d, rep = [(2, 300)], 17, 4, 2, 16, 1
        grid_cfg = [dict(BLOCK=64, num_warps=1, MIN_CHUNK=64, PER_SM=2, TIE_BLOCK=32),
                    dict(BLOCK=128, num_warps=1, MIN_CHUNK=128)]
    rows_out: list[dict] = []
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def record(row: dict) -> None:
        rows_out.append(row)
        print(json.dumps(row), flush=True)
        out_path.write_text(json.dumps({"rows": rows_out}, indent=1))

    print(f"# device {torch.cuda.get_device_name() if cuda else 'cpu (interpreter)'}; q {hq} / kv {hkv} heads, d={d}",
          flush=True)
    dims = [int(x) for x in args.dims.split(",")] if not args.tiny else [d]
    for (B, L), keys, d in itertools.product(shapes, args.keys.split(","), dims):
        if time.monotonic() > t_end:
            print(f"# budget spent: skip B={B} L={L} {keys}", flush=True)
            continue
        g = torch.Generator(device="cpu").manual_seed(B * 7 + L)
        q = torch.randn(B, hq, d, generator=g).to(dev, dtype)
        k = torch.randn(B, hkv, L, d, generator=g).to(dev, dtype)
        lo = torch.full((B,), N_SINK, dtype=torch.int32, device=dev)
        hi = torch.full((B,), L - N_RECENT, dtype=torch.int32, device=dev)
        ks = None
        kk = k
        scoring.GEMV_CONFIG.clear()
        if keys == "int8_float":  # int8 keys through the float GEMV tile (the int8 tensor-core tile off)
            scoring.GEMV_CONFIG.update(int8_dot=False)
        if keys.startswith("int8"):
            kk, ks = quant.quantize_keys_triton(k) if cuda else quant.quantize_keys_ref(k)
        elif keys == "int4":
            kk, ks = quant.quantize_keys_int4_triton(k) if cuda else quant.quantize_keys_int4_ref(k)
        truth = scoring.group_scores_ref(q, kk, torch.full((B,), L, device=dev), k_scale=ks)  # [B, Hkv, L]
        pos = torch.arange(L, device=dev)
        truth = truth.masked_fill(~((pos >= lo[:, None]) & (pos < hi[:, None]))[:, None, :], float("-inf"))
        best = truth.topk(K, dim=-1).values.sum(-1)  # [B, Hkv]

        def check(out: torch.Tensor) -> float:
            got = torch.gather(truth, -1, out.view(B, hkv, K).long().clamp(min=0)).sum(-1)
            return float(((best - got).abs() / best.abs().clamp(min=1e-6)).max())

        def timed_stages(cfg: dict) -> dict | None:
            radix_topk.SELECT_CONFIG.clear()
            radix_topk.SELECT_CONFIG.update(cfg)
            try:
                run, names, out = _stage_fns(q, kk, ks, lo, hi, K)
                run(len(names))
                err = check(out)
                if err > 1e-4:
                    return dict(error=f"selection deficit {err:.2e}")
                ms = [_graph_ms(lambda n=n: run(n), rep=rep) for n in range(1, len(names) + 1)]
            finally:
                radix_topk.SELECT_CONFIG.clear()
            stages = {f"{name}_ms": ms[0] if i == 0 else ms[i] - ms[i - 1] for i, name in enumerate(names)}
            return dict(stages, total_ms=ms[-1], select_ms=ms[-1] - ms[0], deficit=err)

        base = timed_stages({})
        record(dict(B=B, L=L, K=K, keys=keys, d=d, config="default", **(base or {})))
        for cc in [c for c in args.carry.split(",") if c]:
            radix_topk.SELECT_CONFIG.clear()
            radix_topk.SELECT_CONFIG.update(_carry_cfg(cc))
            try:
                run, run_fb, out, carry = _carry_fns(q, kk, ks, lo, hi, K)
                run_fb()  # sets the threshold; then the steady state (the same query again)
                run(3)
                err = check(out)
                run(3)
                err = max(err, check(out))
                if err > 1e-4:
                    res = dict(error=f"selection deficit {err:.2e}")
                else:
                    st0 = carry_mod.carry_stats(carry)
                    ms = [_graph_ms(lambda n=n: run(n), rep=rep) for n in (1, 2, 3)]
                    st = carry_mod.carry_stats(carry)
                    calls = st["calls"] - st0["calls"]
                    fb_ms = _graph_ms(run_fb, rep=rep)
                    res = dict(score_ms=ms[0], compact_ms=ms[1] - ms[0], carry_select_ms=ms[2] - ms[1],
                               total_ms=ms[2], fallback_total_ms=fb_ms, steady_fallback_rate=(st["fallbacks"] - st0["fallbacks"]) / max(calls, 1),
                               vs_default=ms[2] / base["total_ms"] if base and "total_ms" in base else None,
                               deficit=err)
                    if args.profile and cuda:
                        from benchmarks.bench_scoring import _profile_kernels

                        res["kernels_us"] = _profile_kernels(lambda: run(3))
                        for name, us in sorted(res["kernels_us"].items(), key=lambda kv: -kv[1]):
                            print(f"#   {B}x{L} {keys} d={d} carry {cc}: {us:8.1f} us  {name}", flush=True)
            except Exception as e:
                res = dict(error=f"{type(e).__name__}: {e}"[:200])
            finally:
                radix_topk.SELECT_CONFIG.clear()
            record(dict(B=B, L=L, K=K, keys=keys, d=d, config=dict(carry=cc), **res))
        ov_specs = [o for o in args.overlap.split(",") if o] if args.carry else []
        serial_ms = None
        for spec in ["off"] + ov_specs if ov_specs else []:
            # a pack of layers with the select beside the next layer's scoring (select_overlap):
            # off, then each WARPS[:PRIORITY] on the side stream
            radix_topk.SELECT_CONFIG.clear()
            radix_topk.SELECT_CONFIG.update(_carry_cfg(args.carry.split(",")[0]))
            on = spec != "off"
            if on:
                w, *pr = spec.split(":")
                radix_topk.SELECT_CONFIG.update(carry_overlap_warps=int(w), carry_overlap_priority=int(pr[0]) if pr else 0)
            try:
                run, reset, outs = _overlap_fns(q, kk, ks, lo, hi, K, args.overlap_layers)
                reset()
                run(on)  # every layer's first call falls back and sets its threshold
                run(on)
                err = max(check(o) for o in outs)
                if err > 1e-4:
                    res = dict(error=f"selection deficit {err:.2e}")
                else:
                    ms = _graph_ms(lambda: run(on), rep=rep)
                    err = max(check(o) for o in outs)  # the graph's own results too
                    res = dict(error=f"selection deficit {err:.2e}") if err > 1e-4 else dict(
                        total_ms=ms, per_layer_ms=ms / args.overlap_layers, deficit=err)
                    if not on:
                        serial_ms = ms
                    elif serial_ms:
                        res["vs_serial"] = ms / serial_ms
            except Exception as e:
                res = dict(error=f"{type(e).__name__}: {e}"[:200])
            finally:
                radix_topk.SELECT_CONFIG.clear()
            record(dict(B=B, L=L, K=K, keys=keys, d=d, config=dict(carry=args.carry.split(",")[0], overlap=spec,
                                                              layers=args.overlap_layers), **res))
        tiles = [t for t in args.carry_tiles.split(",") if t] if keys in ("int4", "int8") and args.carry else []
        for tc, pk in itertools.product(tiles, args.carry_packs):
            bl, nw, ns, *per_sm = (int(x) for x in tc.split(":"))
            radix_topk.SELECT_CONFIG.update(_carry_cfg(args.carry.split(",")[0]))
            scoring.GEMV_CONFIG.update(BLOCK_L=bl, num_warps=nw, num_stages=ns, **({"PER_SM": per_sm[0]} if per_sm
                                                                                   else {}), **({"pack": pk} if pk
                                                                                                else {}))
            try:
                run, run_fb, out, carry = _carry_fns(q, kk, ks, lo, hi, K)
                run_fb()
                run(3)
                err = check(out)
                res = dict(error=f"selection deficit {err:.2e}") if err > 1e-4 else dict(
                    score_compact_ms=_graph_ms(lambda: run(2), rep=rep), total_ms=_graph_ms(lambda: run(3), rep=rep),
                    deficit=err)
            except Exception as e:
                res = dict(error=f"{type(e).__name__}: {e}"[:200])
            finally:
                radix_topk.SELECT_CONFIG.clear()
                for key in ("BLOCK_L", "num_warps", "num_stages", "PER_SM", "pack"):
                    scoring.GEMV_CONFIG.pop(key, None)
            record(dict(B=B, L=L, K=K, keys=keys, d=d, config=dict(carry=args.carry.split(",")[0], score_tile=tc,
                                                              **({"pack": pk} if pk else {})), **res))
        if args.no_grid:
            scoring.GEMV_CONFIG.clear()
            continue
        if keys == "int8" and cuda:  # launch configs of the int8 scoring tile (scoring stage alone)
            for bl, nw, ns in itertools.product((128, 256, 512), (4, 8), (3, 4)):
                scoring.GEMV_CONFIG.update(BLOCK_L=bl, num_warps=nw, num_stages=ns)
                try:
                    run, names, out = _stage_fns(q, kk, ks, lo, hi, K)
                    run(len(names))
                    err = check(out)
                    res = dict(error=f"selection deficit {err:.2e}") if err > 1e-4 else \
                        dict(score_ms=_graph_ms(lambda: run(1), rep=rep), deficit=err)
                except Exception as e:
                    res = dict(error=f"{type(e).__name__}: {e}"[:200])
                record(dict(B=B, L=L, K=K, keys=keys, d=d, config=dict(score_tile=[bl, nw, ns]), **res))
            scoring.GEMV_CONFIG.clear()
        if keys == "int8_float":
            scoring.GEMV_CONFIG.clear()
            continue
        for cfg in grid_cfg:
            if time.monotonic() > t_end:
                break
            try:
                res = timed_stages(cfg)
            except Exception as e:  # a config the compiler refuses: report it
                res = dict(error=f"{type(e).__name__}: {e}"[:200])
            record(dict(B=B, L=L, K=K, keys=keys, d=d, config=cfg, **(res or {})))
    scoring.GEMV_CONFIG.clear()
    ok = [r for r in rows_out if "select_ms" in r]
    if ok:
        for (B, L, keys), grp in itertools.groupby(sorted(ok, key=lambda r: (r["B"], r["L"], r["keys"])),
                                                   key=lambda r: (r["B"], r["L"], r["keys"])):
            grp = list(grp)
            best_r = min(grp, key=lambda r: r["select_ms"])
            dflt = next((r for r in grp if r["config"] == "default"), None)
            print(f"# B={B} L={L} {keys}: default select {dflt['select_ms'] if dflt else float('nan'):.4f} ms, "
                  f"best {best_r['select_ms']:.4f} ms with {best_r['config']}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

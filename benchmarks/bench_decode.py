"""End-to-end decode benchmark of the fast path: TPOT against the HBM byte floor.

Qwen3-8B shape (``--preset``), random weights, bf16, batch B (8), context L
(32k), budget K (2k), on one GPU. The cache is filled with random K/V instead of
running an L-token prefill (``FastModel.fake_prefill``). Rows:

* ``full``: every layer attends the whole cache through ``ctx.attend`` (policy
  ``full``), one CUDA graph per step; ``full/P=4``: one graph per pack of 4
  layers (how the asynchronous runtime runs); ``full+stats``: with the
  AttentionContext's device statistics on; ``full/eager``: no CUDA graphs;
* ``optimal``: attention over K tokens per (row, KV head) whose indices are
  given for free (a selector returning one precomputed ``Selection``: 4 sinks,
  64 recent, K - 68 random middle tokens): the floor any selection method
  reaches at budget K;
* ``dense@K``: full attention over a context of only K tokens (contiguous
  reads: what a sparse step could reach with ideal memory access);
* breakdown: ``dense@64`` (the weights side of a step: attention over 64
  tokens) and ``attn-only`` / ``attn-only@K`` (every layer's attention call on
  the cache, nothing else; floor = K/V bytes only);
* ``hf/eager`` and ``hf/graph``: transformers' own model with its
  ``StaticCache`` (one ``forward`` per token, as ``generate`` does), eagerly and,
  when capture works, as a CUDA graph.

TPOT is the median over ``--iters`` steps after warm-up, each step timed with
CUDA events and followed by a synchronisation (as an engine that samples on the
host does). The floor is (bytes of weights + bytes of K/V read) / HBM bandwidth,
the bandwidth measured here with a 1 GiB device-to-device copy (read + write).

    python -m benchmarks.bench_decode [--batch 8] [--context 32768] [--budget 2048]
        [--preset qwen3-8b] [--quick] [--out results/bench_decode.json]

``--device cpu --preset tiny`` runs a smoke version anywhere (wall-clock times).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from spade.attention import FixedSelector

N_SINK, N_RECENT = 4, 64
TARGET_RATIO = 1.2  # full-attention TPOT must be within 1.2x of its byte floor


# ----------------------------------------------------------------------------- timing
def time_steps(step: Callable[[], object], *, iters: int, warmup: int, device: torch.device) -> list[float]:
    """Per-step times (ms) of ``step`` after ``warmup`` untimed calls; each timed
    step is bracketed by CUDA events and followed by a synchronisation."""
    for _ in range(warmup):
        step()
    out = []
    if device.type != "cuda":
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    torch.cuda.synchronize(device)
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        step()
        e.record()
        torch.cuda.synchronize(device)
        out.append(s.elapsed_time(e))
    return out


def hbm_bandwidth(device: torch.device, nbytes: int = 2**30, iters: int = 20) -> float:
    """Bytes/s of a large device-to-device copy, counting read + write bytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = statistics.median(time_steps(lambda: dst.copy_(src), iters=iters, warmup=3, device=device))
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- selectors
def random_selection(B: int, Hkv: int, L: int, K: int, device: torch.device, seed: int = 0):
    """``K - N_SINK - N_RECENT`` distinct random middle positions per (row, KV head)
    in ``[N_SINK, L - N_RECENT)`` (unsorted, as a top-k returns them)."""
    from spade.policies.base import Selection

    k_mid = K - N_SINK - N_RECENT
    if k_mid <= 0 or L - N_RECENT - N_SINK < k_mid:
        raise SystemExit(f"budget {K} does not fit context {L} with {N_SINK} sinks and {N_RECENT} recent tokens")
    g = torch.Generator(device=device).manual_seed(seed)
    r = torch.rand(B, Hkv, L - N_SINK - N_RECENT, device=device, generator=g)
    idx = (r.topk(k_mid, dim=-1).indices + N_SINK).to(torch.int32)  # [B, Hkv, k_mid]
    return Selection(indices=idx, n_sink=N_SINK, n_recent=N_RECENT)


# ----------------------------------------------------------------------------- runs
def run_fast(model, name: str, selector, *, context: int, batch: int, pack_layers: int, iters: int, warmup: int,
             track_stats: bool = False, graphs: bool = True, linear: str | None = None) -> list[float]:
    """TPOT samples of the fast path with ``selector`` at a cache of ``context`` tokens
    (``linear``: the projections' kernel for this row, ``FastModel.linear``)."""
    from spade.attention import AttentionContext

    if linear is not None:
        model.linear = linear
    ctx = AttentionContext(model.spec, selector, device=model.device, track_stats=track_stats)
    model.use_cuda_graphs = graphs
    model.fake_prefill(context, batch, ctx=ctx)
    tok = torch.randint(0, model.vocab_size, (batch,), device=model.device,
                        generator=torch.Generator(device=model.device).manual_seed(1))

    def step():
        for _ in model.decode_stages(tok, ctx, pack_layers):
            pass

    times = time_steps(step, iters=iters, warmup=warmup, device=model.device)
    if not torch.isfinite(model.last_logits).all():
        raise RuntimeError(f"{name}: non-finite logits")
    return times


def run_attention_only(model, *, context: int, batch: int, iters: int, warmup: int, sel=None) -> list[float]:
    """Breakdown: only the attention calls of one step (every layer's
    ``sparse_decode_attention`` on the cache, no projections), eagerly."""
    from spade import kernels

    model.fake_prefill(context, batch)
    a = model.arch
    g = torch.Generator(device=model.device).manual_seed(3)
    q = torch.randn(batch, a.n_q_heads, a.head_dim, device=model.device, generator=g).to(model.dtype)
    kv_lens = model.kv_lens
    scale = model.spec.softmax_scale

    def step():
        for kc, vc in zip(model.k_cache, model.v_cache):
            if sel is None:
                kernels.sparse_decode_attention(q, kc[:batch], vc[:batch], kv_lens, None, scale=scale)
            else:
                kernels.sparse_decode_attention(q, kc[:batch], vc[:batch], kv_lens, sel.indices,
                                                n_sink=sel.n_sink, n_recent=sel.n_recent, scale=scale)

    return time_steps(step, iters=iters, warmup=warmup, device=model.device)


def run_hf(cfg, *, dtype, device, batch: int, context: int, iters: int, warmup: int) -> dict[str, object]:
    """transformers' model + ``StaticCache`` (the cache ``generate`` uses for
    compiled decoding): one token per ``forward`` at position ``context``, eagerly
    and as a CUDA graph. Returns ``{row name: samples (list) or reason (str)}``."""
    from transformers import AutoModelForCausalLM, StaticCache

    res: dict[str, object] = {}
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    cache = StaticCache(config=cfg, max_cache_len=context + 1)
    tok = torch.randint(0, cfg.vocab_size, (batch, 1), device=device)
    pos = torch.full((batch, 1), context, dtype=torch.long, device=device)
    with torch.no_grad():
        hf(input_ids=tok, position_ids=torch.zeros_like(pos), past_key_values=cache, use_cache=True)  # allocates
        g = torch.Generator(device=device).manual_seed(2)
        for layer in cache.layers:
            layer.keys.normal_(generator=g)
            layer.values.normal_(generator=g)

        def reset():  # write the token at index `context` every time
            for layer in cache.layers:
                layer.cumulative_length.fill_(context)

        def step():
            reset()
            return hf(input_ids=tok, position_ids=pos, past_key_values=cache, use_cache=True).logits

        res["hf/eager"] = time_steps(step, iters=iters, warmup=warmup, device=device)
        if device.type == "cuda":
            try:
                s = torch.cuda.Stream(device)
                s.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(s):
                    for _ in range(2):
                        step()
                torch.cuda.current_stream(device).wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                reset()
                with torch.cuda.graph(graph):
                    hf(input_ids=tok, position_ids=pos, past_key_values=cache, use_cache=True)

                def replay():
                    reset()
                    graph.replay()

                res["hf/graph"] = time_steps(replay, iters=iters, warmup=warmup, device=device)
            except Exception as e:  # host syncs inside forward make capture fail
                res["hf/graph"] = f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    del hf, cache
    _free_memory()
    return res


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_decode", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-8b", help="model shape preset (spade.models.presets)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768, help="cache length L at the timed steps")
    ap.add_argument("--budget", type=int, default=2048, help="K for the optimal / dense@K rows")
    ap.add_argument("--pack", type=int, default=4, help="layers per graph for the packed rows")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true",
                    help="10 steps per row; full, optimal, dense@K, hf/eager only (no packed/breakdown rows)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--linear", default="auto",
                    help="projection kernels, comma-separated from auto,cublas,triton (FastModel.linear): the "
                         "first one times every row; each further one adds full/optimal/dense@64 rows "
                         "named <row>[<mode>], side by side")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    ap.add_argument("--out", default="results/bench_decode.json", help="JSON output path")
    args = ap.parse_args(argv)

    from spade.models.fast import LINEAR_MODES, FastModel
    from spade.models.presets import preset_config
    from spade.policies.full import FullPolicy
    from spade.attention import InlineSelector
    from spade.policies.full import FullPolicyConfig

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_decode: no CUDA device (use --device cpu --preset tiny for a smoke run)", file=sys.stderr)
        return 2
    if args.quick:
        args.iters, args.warmup = min(args.iters, 10), min(args.warmup, 3)
    linears = [m.strip() for m in args.linear.split(",") if m.strip()]
    bad = [m for m in linears if m not in LINEAR_MODES]
    if not linears or bad:
        print(f"bench_decode: --linear takes auto,cublas,triton (comma-separated); got {args.linear!r}",
              file=sys.stderr)
        return 2
    dtype = torch.bfloat16
    B, L, K = args.batch, args.context, args.budget
    cfg = preset_config(args.preset)
    t_start = time.perf_counter()

    bw = hbm_bandwidth(device)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {dev_name}: copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")

    # Room for warm-up, capture and timed steps of every row past the context.
    max_seq = max(L, K) + 2 * (args.warmup + args.iters) + 8
    model = FastModel.from_config(cfg, device=device, dtype=dtype, max_batch=B, max_seq_len=max_seq, seed=0,
                                  linear=linears[0])
    kernels_by_mode = {}
    for mode in linears:
        model.linear = mode
        kernels_by_mode[mode] = model.linear_kernels(B)
        print(f"# linear={mode}: " + ", ".join(f"{k} {v}" for k, v in kernels_by_mode[mode].items()))
    model.linear = linears[0]
    n_layers = model.spec.n_layers
    w_bytes = model.weight_bytes()
    print(f"# {args.preset}: {model.arch.n_params() / 1e9:.2f} B params, weights {w_bytes / 2**30:.1f} GiB, "
          f"KV cache {model.kv_bytes(max_seq, B) / 2**30:.1f} GiB, B={B} L={L} K={K}")

    def full_selector(batch: int):
        pol = FullPolicy(FullPolicyConfig(), model.spec)
        return InlineSelector(pol, pol.new_state(batch, device))

    sel = random_selection(B, model.spec.n_kv_heads, L, K, device)
    runs: list[tuple[str, Callable[[], list[float]], int]] = [  # (name, run, tokens attended per row)
        ("full", lambda: run_fast(model, "full", full_selector(B), context=L, batch=B, pack_layers=n_layers,
                                  iters=args.iters, warmup=args.warmup), L),
        ("optimal", lambda: run_fast(model, "optimal", FixedSelector(sel), context=L, batch=B,
                                     pack_layers=n_layers, iters=args.iters, warmup=args.warmup), K),
        ("dense@K", lambda: run_fast(model, "dense@K", full_selector(B), context=K, batch=B,
                                     pack_layers=n_layers, iters=args.iters, warmup=args.warmup), K),
    ]
    if not args.quick:
        P = args.pack
        runs += [
            (f"full/P={P}", lambda: run_fast(model, "full/P", full_selector(B), context=L, batch=B, pack_layers=P,
                                             iters=args.iters, warmup=args.warmup), L),
            (f"optimal/P={P}", lambda: run_fast(model, "optimal/P", FixedSelector(sel), context=L, batch=B,
                                                pack_layers=P, iters=args.iters, warmup=args.warmup), K),
            ("full+stats", lambda: run_fast(model, "full+stats", full_selector(B), context=L, batch=B,
                                            pack_layers=n_layers, iters=args.iters, warmup=args.warmup,
                                            track_stats=True), L),
            ("full/eager", lambda: run_fast(model, "full/eager", full_selector(B), context=L, batch=B,
                                            pack_layers=n_layers, iters=min(args.iters, 10), warmup=2,
                                            graphs=False), L),
            # Breakdown: the weights side (attention over 64 tokens) and the
            # attention side (no projections) of a step, each against its own floor.
            ("dense@64", lambda: run_fast(model, "dense@64", full_selector(B), context=64, batch=B,
                                          pack_layers=n_layers, iters=args.iters, warmup=args.warmup), 64),
            ("attn-only", lambda: run_attention_only(model, context=L, batch=B, iters=args.iters,
                                                     warmup=args.warmup), -L),
            ("attn-only@K", lambda: run_attention_only(model, context=L, batch=B, iters=args.iters,
                                                       warmup=args.warmup, sel=sel), -K),
        ]
    for mode in linears[1:]:
        runs += [
            (f"full[{mode}]", lambda m=mode: run_fast(model, f"full[{m}]", full_selector(B), context=L, batch=B,
                                                     pack_layers=n_layers, iters=args.iters, warmup=args.warmup,
                                                     linear=m), L),
            (f"optimal[{mode}]", lambda m=mode: run_fast(model, f"optimal[{m}]", FixedSelector(sel), context=L,
                                                        batch=B, pack_layers=n_layers, iters=args.iters,
                                                        warmup=args.warmup, linear=m), K),
            (f"dense@64[{mode}]", lambda m=mode: run_fast(model, f"dense@64[{m}]", full_selector(B), context=64,
                                                         batch=B, pack_layers=n_layers, iters=args.iters,
                                                         warmup=args.warmup, linear=m), 64),
        ]
    rows: list[dict] = []

    def add_row(name: str, samples: list[float] | str, tokens: int) -> None:
        # tokens < 0: attention only (no weight bytes in the floor)
        floor_ms = ((w_bytes if tokens >= 0 else 0) + model_kv_bytes(abs(tokens))) / bw * 1e3
        row = {"name": name, "attended_tokens": abs(tokens), "weights_in_floor": tokens >= 0, "floor_ms": floor_ms}
        if isinstance(samples, str):
            row["skipped"] = samples
        else:
            med = statistics.median(samples)
            row.update(tpot_ms=med, min_ms=min(samples), ratio_to_floor=med / floor_ms, n=len(samples))
        rows.append(row)

    kv_per_token = model.kv_bytes(1, B)

    def model_kv_bytes(tokens: int) -> int:
        return kv_per_token * tokens

    for name, fn, tokens in runs:
        if "[" not in name:
            model.linear = linears[0]
        try:
            add_row(name, fn(), tokens)
        except torch.cuda.OutOfMemoryError as e:
            add_row(name, f"out of memory: {str(e).splitlines()[0][:120]}", tokens)
        print(f"  {name}: done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    model.close()
    del model
    _free_memory()

    if args.no_hf:
        add_row("hf/eager", "skipped (--no-hf)", L)
    else:
        need = w_bytes + model_kv_bytes(L + 1)
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        if free is not None and need > 0.92 * free:
            add_row("hf/eager", f"does not fit: needs {need / 2**30:.1f} GiB of {free / 2**30:.1f} GiB free", L)
        else:
            try:
                hf_rows = run_hf(cfg, dtype=dtype, device=device, batch=B, context=L,
                                 iters=min(args.iters, 10) if args.quick else args.iters, warmup=2)
                for name, samples in hf_rows.items():
                    if args.quick and name == "hf/graph":
                        continue
                    add_row(name, samples, L)
            except torch.cuda.OutOfMemoryError as e:
                add_row("hf/eager", f"out of memory: {str(e).splitlines()[0][:120]}", L)
        print(f"  hf: done ({time.perf_counter() - t_start:.0f} s)", flush=True)

    full = next(r for r in rows if r["name"] == "full")
    verdict = None
    if "tpot_ms" in full:
        verdict = full["ratio_to_floor"] <= TARGET_RATIO
    _print_table(rows)
    if verdict is not None:
        print(f"full attention: {full['tpot_ms']:.2f} ms = {full['ratio_to_floor']:.2f}x its floor "
              f"(target <= {TARGET_RATIO}x): {'PASS' if verdict else 'FAIL'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        bench="decode", device=dev_name, preset=args.preset, dtype="bfloat16", batch=B, context=L, budget=K,
        n_sink=N_SINK, n_recent=N_RECENT, pack=args.pack, iters=args.iters, warmup=args.warmup,
        torch=torch.__version__, linear=linears, linear_kernels=kernels_by_mode,
        bandwidth_gbps=bw / 1e9, weight_bytes=w_bytes,
        kv_bytes_per_token=kv_per_token, target_ratio=TARGET_RATIO, full_within_target=verdict,
        wall_s=time.perf_counter() - t_start, rows=rows,
    ), indent=2))
    print(f"wrote {out}")
    return 0


def _fmt(x, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _print_table(rows: list[dict]) -> None:
    print(f"{'run':<18} {'tokens':>7} {'TPOT ms':>9} {'min ms':>8} {'floor ms':>9} {'x floor':>8}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['name']:<18} {r['attended_tokens']:>7} {'':>9} {'':>8} {_fmt(r['floor_ms']):>9} "
                  f"  {r['skipped']}")
            continue
        print(f"{r['name']:<18} {r['attended_tokens']:>7} {_fmt(r['tpot_ms']):>9} {_fmt(r['min_ms']):>8} "
              f"{_fmt(r['floor_ms']):>9} {_fmt(r['ratio_to_floor']):>8}")


if __name__ == "__main__":
    sys.exit(main())

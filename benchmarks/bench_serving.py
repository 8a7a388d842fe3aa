"""Offline request trace through ``spade.AsyncEngine`` (continuous batching).

``--requests`` requests with prompt lengths uniform in ``[--prompt-min, --prompt-max]``
(random token ids), output lengths uniform in ``[--out-min, --out-max]`` (greedy,
``ignore_eos``), arriving as a Poisson process of ``--rate`` requests per second
(``inf``: all at once), served by one engine with ``serving.max_batch`` slots. Each
request asks for its final output only (``SamplingParams.output_kind="final_only"``: an
offline trace, nothing streamed; ``spade serve``'s clients stream, ``benchmarks/bench_serve.py``).
Reported per policy: output tokens/s over the whole trace, TTFT / TPOT / queue time
p50 and p99, decode steps, sparse steps, the engine's counters. JSON to ``--out``.

    python -m benchmarks.bench_serving --preset tiny --device cpu --requests 16 \\
        --prompt-min 8 --prompt-max 64 --out-min 8 --out-max 32 --max-seq-len 128
    python -m benchmarks.bench_serving --preset qwen3-8b --device cuda:0 --max-batch 8 --requests 32 \\
        --prompt-min 2048 --prompt-max 8192 --out-min 256 --out-max 512 --max-seq-len 9216 \\
        --policies full,asyncspade --budget 1024 --rate 2
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import random
import statistics
import time
from pathlib import Path

from benchmarks.bench_serve import percentile, prompt_pieces
from benchmarks.trace_summary import kernel_us

#: new tokens of each warm-up request (run before the timed trace)
WARM_TOKENS = 8
#: engine.stats() counters reported for the timed trace alone (the warm-up's share taken off)
TRACE_COUNTERS = ("steps", "sparse_steps", "mixed_steps", "prefill_s", "decode_s", "prefill_device_s",
                  "decode_device_s", "tokens_generated", "joins", "joins_held_by_cursor",
                  "late_packs", "join_wait_s", "prompt_tokens", "cursor_resets", "prefill_pieces",
                  "topk_calls", "topk_fallbacks", "topk_fallbacks_too_many", "requests_finished",
                  "requests_aborted", "requests_failed")


Job = tuple[float, list[int], int]  # (arrival s, prompt ids, max_tokens)


def warm_jobs(jobs: list[Job], max_batch: int, chunk: int) -> list[Job]:
    """The warm-up before the timed trace: the trace's first ``min(max_batch, len(jobs))``
    prompts at once, each decoding long enough that the first is still running when the
    last has joined (one prompt piece per iteration), so the batch passes through every
    row bucket (1, 2, 4, ...) the trace can reach: each bucket's decode graphs and kernel
    specialisations are made here, not inside the timed trace."""
    first = jobs[:max(1, min(max_batch, len(jobs)))]
    pieces = sum(prompt_pieces(len(p), chunk) for _, p, _ in first)
    return [(0.0, p, WARM_TOKENS + pieces) for _, p, _ in first]


async def _trace(engine, jobs: list[tuple[float, list[int], int]]):
    from spade.serving import SamplingParams

    t0 = time.perf_counter()

    async def one(i: int, at: float, prompt: list[int], n: int):
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        last = None
        params = SamplingParams(max_tokens=n, ignore_eos=True, output_kind="final_only")  # offline: no stream
        async for out in engine.generate(prompt, params, f"q{i}"):
            last = out
        return last

    outs = await asyncio.gather(*(one(i, *j) for i, j in enumerate(jobs)))
    return outs, time.perf_counter() - t0


async def _profile(engine, n: int, done: asyncio.Event) -> dict | None:
    """Kernel times of ``n`` decode steps once every request of the trace has joined (no
    prompt piece in the window unless a row finished and the queue refilled it: the
    window's prefill pieces are reported). CUDA activity only, from every thread. None
    when the trace ends (``done``) before such a window opens."""
    import torch

    if not torch.cuda.is_available():
        return None

    async def until(cond, poll: float) -> bool:  # False: the trace ended first
        while not cond(engine.stats()):
            if done.is_set():
                return False
            await asyncio.sleep(poll)
        return True

    if not await until(lambda st: st["requests_waiting"] == 0 and st["requests_prefilling"] == 0
                       and st["requests_running"] > 0, 0.02):
        return None
    s0 = engine.stats()["steps"]
    if not await until(lambda st: st["steps"] >= s0 + 2, 0.005):  # one more step: no join in the window
        return None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        st = engine.stats()
        a0, p0, t0 = st["steps"], st["prefill_pieces"], time.perf_counter()
        await until(lambda st: st["steps"] >= a0 + n or st["requests_running"] == 0, 0.005)
        st = engine.stats()
        steps, wall = st["steps"] - a0, time.perf_counter() - t0
        t_stop = time.perf_counter()
    # the profiler's stop ran on the event loop: the scheduler waited for it (part of the
    # trace's wall time); the kernel table is built after the trace, so it costs the trace nothing
    stall = time.perf_counter() - t_stop
    await done.wait()
    kern = kernel_us(prof)
    steps = max(1, steps)
    top = sorted(kern.items(), key=lambda kv: -kv[1])[:25]
    out = {"steps": steps, "wall_ms_per_step": wall / steps * 1e3, "rows": st["requests_running"], "stall_s": stall,
           "prefill_pieces_in_window": st["prefill_pieces"] - p0,
           "device_ms_per_step": sum(kern.values()) / steps / 1e3,
           "top_kernels_ms_per_step": {k[:120]: v / steps / 1e3 for k, v in top}}
    print(f"  profile: {steps} steps, {out['wall_ms_per_step']:.2f} ms/step wall, "
          f"{out['device_ms_per_step']:.2f} ms/step of kernels (all streams); the profiler's stop held the "
          f"scheduler {stall:.2f} s (inside the trace's wall time)")
    for k, v in list(out["top_kernels_ms_per_step"].items())[:12]:
        print(f"    {v:8.3f} ms/step  {k}")
    return out


def run_policy(args, policy: str, jobs) -> dict:
    import torch

    import spade

    overrides = [f"model.name={args.preset}", f"model.device={args.device}", f"model.max_seq_len={args.max_seq_len}",
                 f"serving.max_batch={args.max_batch}", f"runtime.topology={args.topology}",
                 f"policy.name={policy}", "generation.stop_at_eos=false"]
    if policy != "full":
        overrides.append(f"policy.budget={args.budget}")
    if args.prefill_chunk is not None:
        overrides.append(f"serving.prefill_chunk={args.prefill_chunk}")
    if args.threshold:
        overrides.append(f"runtime.sparse_threshold={args.threshold}")
    engine = spade.AsyncEngine(spade.load_config(None, overrides=overrides + list(args.set)))

    async def main():
        # compile / capture outside the timed trace: requests of the trace's own prompt lengths
        # reach the same paths (prefill shapes, sparse steps, the cache rank's kernels and graphs)
        await _trace(engine, warm_jobs(jobs, args.max_batch, engine.cfg.serving.prefill_chunk))
        if engine.device.type == "cuda":  # the warm-up's device times complete before they are taken off
            torch.cuda.synchronize(engine.device)
        st0 = engine.stats()
        done = asyncio.Event()
        watch = asyncio.ensure_future(_profile(engine, args.profile_steps, done)) if args.profile_steps else None
        outs, wall = await _trace(engine, jobs)
        done.set()
        prof = await watch if watch is not None else None
        # after the close: the cache rank's account of the trace's epoch is in (topk_*: it comes at
        # an epoch's end; they include the warm-up's epoch, which ended inside the trace)
        await engine.close()
        st = engine.stats()
        for k in TRACE_COUNTERS:  # the timed trace's own share of the cumulative counters
            if isinstance(st.get(k), (int, float)) and isinstance(st0.get(k), (int, float)):
                st[k] -= st0[k]
        return outs, wall, st, prof

    outs, wall, st, prof = asyncio.run(main())
    # the process's peak of allocated GPU memory: weights, KV pool, policy state (asyncspade's scoring
    # copy), activations; a side-by-side figure of what a setting holds
    peak = torch.cuda.max_memory_allocated(engine.device) / 2**30 if engine.device.type == "cuda" else None
    ntok = sum(len(o.token_ids) for o in outs)
    ttft = [o.ttft_s for o in outs if o.ttft_s is not None]
    tpot = [o.tpot_s for o in outs if o.tpot_s is not None]
    queue = [o.queue_s for o in outs if o.queue_s is not None]
    gpus = 2 if args.topology in ("local", "multiprocess") else 1  # the cache rank's own GPU counts
    return {
        "policy": policy, "topology": args.topology, "gpus": gpus, "output_tokens": ntok, "wall_s": wall,
        "output_tok_per_s": ntok / wall, "output_tok_per_s_per_gpu": ntok / wall / gpus,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5), "tpot_p99_s": percentile(tpot, 0.99),
        "queue_p50_s": percentile(queue, 0.5), "queue_p99_s": percentile(queue, 0.99),
        "mean_tpot_s": statistics.mean(tpot) if tpot else None,
        # rows that decode per step on average (of max_batch): what a step's weight read is shared by
        # (a request's first token comes from its prompt pass, not from a step)
        "rows_per_step": (ntok - sum(1 for o in outs if o.token_ids)) / st["steps"] if st.get("steps") else None,
        "finish": {r: sum(o.finish_reason == r for o in outs) for r in ("length", "stop", "abort")},
        "engine": st,
        "gpu_peak_gib": peak,
        "profile": prof,
        "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--topology", default="inline")
    ap.add_argument("--policies", default="full,asyncspade")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--threshold", type=int, default=0)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="serving.prefill_chunk (prompt tokens per iteration while rows decode; 0: whole prompts); "
                         "default: the config's")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-min", type=int, default=32)
    ap.add_argument("--prompt-max", type=int, default=256)
    ap.add_argument("--out-min", type=int, default=16)
    ap.add_argument("--out-max", type=int, default=64)
    ap.add_argument("--rate", type=float, default=float("inf"), help="requests per second (Poisson); inf: all at once")
    ap.add_argument("--vocab", type=int, default=512, help="prompt token ids are drawn below this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], help="extra config overrides, e.g. policy.score_keys=int4")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="torch.profiler (CUDA kernels) over this many decode steps once every request has "
                         "joined; per-kernel ms per step in the row's 'profile'. The profiler's stop holds the "
                         "scheduler (seconds with a cache rank's kernels: 'stall_s'), so time a trace without it")
    ap.add_argument("--out", default="results/bench_serving.json")
    args = ap.parse_args(argv)
    if args.prompt_max + args.out_max > args.max_seq_len:
        ap.error(f"--prompt-max + --out-max ({args.prompt_max + args.out_max}) exceed --max-seq-len "
                 f"({args.max_seq_len})")
    rng = random.Random(args.seed)
    at, jobs = 0.0, []
    for _ in range(args.requests):
        T = rng.randint(args.prompt_min, args.prompt_max)
        jobs.append((at, [rng.randrange(args.vocab) for _ in range(T)], rng.randint(args.out_min, args.out_max)))
        if args.rate != float("inf"):
            at += rng.expovariate(args.rate)
    rows = [run_policy(args, p.strip(), jobs) for p in args.policies.split(",") if p.strip()]
    rec = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "args": vars(args), "rows": rows}
    for r in rows:
        print(f"{r['policy']:>12} ({r['topology']}): {r['output_tok_per_s']:.1f} tok/s ({r['output_tok_per_s_per_gpu']:.1f} per GPU)  TTFT p50 {r['ttft_p50_s']:.3f} s "
              f"p99 {r['ttft_p99_s']:.3f} s  TPOT p50 {r['tpot_p50_s'] * 1e3:.2f} ms p99 "
              f"{r['tpot_p99_s'] * 1e3:.2f} ms  steps {r['engine']['steps']} sparse {r['engine']['sparse_steps']}  "
              f"rows/step {r['rows_per_step'] or 0:.2f} of {args.max_batch} "
              f"(joins held by the cursor {r['engine'].get('joins_held_by_cursor', 0)})  "
              f"prefill {r['engine']['prefill_s']:.2f} s ({r['engine']['prefill_pieces']} pieces)  "
              f"decode {r['engine']['decode_s']:.2f} s "
              f"({r['engine']['decode_s'] / max(1, r['engine']['steps']) * 1e3:.2f} ms/step)"
              + (f"  on the GPU's stream: prefill {r['engine']['prefill_device_s']:.2f} s, decode "
                 f"{r['engine']['decode_device_s'] / max(1, r['engine']['steps']) * 1e3:.2f} ms/step"
                 if r['engine'].get('prefill_device_s') is not None else "")
              + (f"  GPU peak {r['gpu_peak_gib']:.2f} GiB" if r.get("gpu_peak_gib") is not None else ""))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=1, default=str))
    if rows:
        plot(rows, out.with_suffix(".png"), f"{args.preset}, {args.topology}, {args.requests} requests, "
             f"prompts {args.prompt_min}-{args.prompt_max}, outputs {args.out_min}-{args.out_max}")
        print(f"wrote {out} and {out.with_suffix('.png')}")
    return rec


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Output tokens/s and TPOT p50 / p99 per policy, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["policy"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    a.bar(names, [r["output_tok_per_s"] for r in rows], color="tab:blue")
    a.set_ylabel("output tokens / s")
    x = range(len(rows))
    b.bar([i - 0.2 for i in x], [(r["tpot_p50_s"] or 0) * 1e3 for r in rows], width=0.4, label="p50")
    b.bar([i + 0.2 for i in x], [(r["tpot_p99_s"] or 0) * 1e3 for r in rows], width=0.4, label="p99")
    b.set_xticks(list(x), names)
    b.set_ylabel("TPOT (ms)")
    b.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()

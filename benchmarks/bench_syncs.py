"""Where a served trace makes the host wait for the GPU, by Python line.

Each host synchronisation (a blocking host-to-device copy, ``.item()``, a boolean
index's ``nonzero``) drains the stream: the GPU idles while the host launches the next
kernels. One per decode step is the design (the step's tokens); a join's per-layer
hooks, a prompt piece's writes or a policy's row state should add none. This runs a
warm-up trace through ``spade.AsyncEngine``, then a measured one under
``torch.cuda.set_sync_debug_mode("warn")``, and counts the warnings by the Python line
that made them (the worker thread's and the cache rank's alike), beside the trace's
decode steps and prompt pieces. On a CPU there is nothing to count (the smoke test).

    python -m benchmarks.bench_syncs --policy asyncspade --topology colocated
    python -m benchmarks.bench_syncs --smoke            # the tiny preset on a CPU
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import sys
import warnings
from pathlib import Path

import torch

from benchmarks.args import int_list


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_syncs", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--policy", default="asyncspade")
    ap.add_argument("--topology", default="colocated")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--lengths", type=int_list(1), default=[6001, 7003, 4507, 5555],
                    help="the measured requests' prompt lengths (the warm-up's are near them)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--set", action="append", default=[], help="config overrides, key=value")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--smoke", action="store_true", help="the tiny preset, short prompts (CPU)")
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args(argv)
    if args.smoke:
        args.preset, args.device, args.lengths, args.max_tokens, args.budget = "tiny", "cpu", [41, 97, 60], 12, 32
    return args


@contextlib.contextmanager
def count_syncs(cuda: bool):
    """Count the warnings raised inside (with ``cuda``, torch's one per host
    synchronisation) by the line that raised them, from any thread: a Counter."""
    counts: collections.Counter = collections.Counter()
    root = str(Path(__file__).resolve().parents[1]) + "/"

    def record(message, category, filename, lineno, file=None, line=None):
        counts[f"{filename.removeprefix(root)}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)


def run(argv: list[str] | None = None) -> dict:
    args = parse_args(argv if argv is not None else sys.argv[1:])
    import spade
    from spade import SamplingParams

    L = max(args.lengths) + args.max_tokens + 64
    ov = [f"model.name={args.preset}", f"model.device={args.device}", f"model.max_seq_len={L}",
          f"serving.max_batch={len(args.lengths)}", f"runtime.topology={args.topology}",
          f"policy.name={args.policy}", "generation.stop_at_eos=false", "model.block_size=16",
          f"model.kv_blocks={len(args.lengths) * (-(-L // 16)) + 16}"]
    if args.policy != "full":
        ov.append(f"policy.budget={args.budget}")
    engine = spade.AsyncEngine(spade.load_config(None, overrides=ov + list(args.set)))
    cuda = engine.device.type == "cuda"
    g = torch.Generator().manual_seed(0)
    vocab = engine.vocab

    async def trace(lengths, tag):
        async def one(i, n):
            await asyncio.sleep(0.2 * i)  # staggered: joins into a decoding batch
            p = torch.randint(0, vocab, (n,), generator=g).tolist()
            async for _ in engine.generate(p, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True), f"{tag}{i}"):
                pass
        await asyncio.gather(*(one(i, n) for i, n in enumerate(lengths)))

    async def main():
        await trace([max(1, n - 7) for n in args.lengths], "w")
        if cuda:
            torch.cuda.synchronize(engine.device)
        s0 = engine.stats()
        with count_syncs(cuda) as counts:
            await trace(args.lengths, "m")
        s1 = engine.stats()
        await engine.close()
        return s0, s1, counts

    s0, s1, counts = asyncio.run(main())
    out = {"preset": args.preset, "policy": args.policy, "topology": args.topology, "device": str(engine.device),
           "gpu": torch.cuda.get_device_name(engine.device) if cuda else None,
           "steps": s1["steps"] - s0["steps"], "prefill_pieces": s1["prefill_pieces"] - s0["prefill_pieces"],
           "syncs": sum(counts.values()), "by_line": dict(counts.most_common())}
    print(f"# {args.policy} ({args.topology}) on {out['gpu'] or out['device']}: {out['syncs']} host syncs over "
          f"{out['steps']} decode steps and {out['prefill_pieces']} prompt pieces")
    for k, v in counts.most_common(args.top):
        print(f"  {v:7d}  {k}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())

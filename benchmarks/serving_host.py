"""The serving engine's host time per decode step, without the model.

    python -m benchmarks.serving_host [--rows 16] [--tokens 400] [--rounds 3] [--out results/serving_host.json]

``spade.AsyncEngine`` on the tiny preset (CPU) with the batch's model pass replaced by
a copy of ready logits: what is left per step is the host's own work (admission,
sampling, stop checks, the outputs and their delivery to the requests' iterators on
the event loop). On a GPU that work sits in series with the step (sampling reads the
tokens back before the next step is launched), so it adds to every step's time.
Reports per round the wall ms per step and the worker thread's share (``decode_s``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path


def measure(rows: int, tokens: int, rounds: int) -> dict:
    import os

    os.environ.setdefault("SPADE_KERNELS", "torch")
    import torch

    import spade
    from spade.serving import SamplingParams

    over = ["model.name=tiny", f"model.max_seq_len={tokens + 64}", f"serving.max_batch={rows}", "policy.name=full",
            "runtime.topology=inline", "model.dtype=float32", "model.device=cpu"]
    engine = spade.AsyncEngine(spade.load_config(None, overrides=over))
    ready = torch.zeros(rows, engine.vocab)
    engine.batch._decode = lambda toks, mode: ready.clone()  # the model's pass: logits already made
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, output_kind="delta")

    async def one(rid: str) -> None:
        async for _ in engine.generate([1, 2, 3, 4], params, rid):
            pass

    async def main() -> list[dict]:
        out = []
        for r in range(rounds + 1):  # the first round warms up
            s0, t0 = engine.stats(), time.perf_counter()
            await asyncio.gather(*(one(f"r{r}-{i}") for i in range(rows)))
            s1, wall = engine.stats(), time.perf_counter() - t0
            steps = s1["steps"] - s0["steps"]
            if r:
                out.append({"steps": steps, "wall_ms_per_step": wall / steps * 1e3,
                            "worker_decode_ms_per_step": (s1["decode_s"] - s0["decode_s"]) / steps * 1e3})
        await engine.close()
        return out

    runs = asyncio.run(main())
    return {"rows": rows, "tokens": tokens, "runs": runs,
            "wall_ms_per_step_median": statistics.median(r["wall_ms_per_step"] for r in runs),
            "worker_decode_ms_per_step_median": statistics.median(r["worker_decode_ms_per_step"] for r in runs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="results/serving_host.json")
    args = ap.parse_args(argv)
    for name in ("rows", "tokens", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    res = measure(args.rows, args.tokens, args.rounds)
    for r in res["runs"]:
        print(f"{args.rows} rows: {r['wall_ms_per_step']:.3f} ms per step, worker {r['worker_decode_ms_per_step']:.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

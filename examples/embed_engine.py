"""Embed spade in a serving process: one engine, several policies compared.

    python examples/embed_engine.py [--budget 128] [--tokens 32]

Runs the embedded default model (SmolLM2-135M, CPU) on an essay question with
`full` and with `asyncspade`, and reports tokens per second, tokens attended per
step and how many generated tokens agree with full attention.
"""

from __future__ import annotations

import argparse

import spade


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    runs = {}
    for policy in ("full", "asyncspade"):
        over = [f"policy.name={policy}", f"generation.max_new_tokens={args.tokens}"]
        if policy != "full":
            over.append(f"policy.budget={args.budget}")
        cfg = spade.load_config("configs/cpu_tiny.yaml", overrides=over)
        engine = spade.Engine(cfg)
        (r,) = engine.generate()
        engine.close()
        runs[policy] = r
        print(f"{policy:<11} {1e3 / r.tpot_median_ms:6.1f} tok/s  attended/step {r.mean_attended:7.1f}  {r.text!r}")
    a, b = runs["full"].token_ids, runs["asyncspade"].token_ids
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    print(f"asyncspade agrees with full attention on the first {same} of {len(a)} tokens")


if __name__ == "__main__":
    main()

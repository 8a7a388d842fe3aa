"""``benchmarks/bench_serving.py`` end to end on the CPU: a tiny offline trace through
``spade.AsyncEngine`` writes its JSON and plot with every request served."""

from __future__ import annotations

import json

from benchmarks import bench_serving


def test_tiny_trace(tmp_path, monkeypatch):
    monkeypatch.setenv("SPADE_KERNELS", "torch")
    out = tmp_path / "s.json"
    rec = bench_serving.main(["--preset", "tiny", "--device", "cpu", "--policies", "full,asyncspade", "--budget", "24",
                              "--max-batch", "4", "--requests", "6", "--prompt-min", "8", "--prompt-max", "44",
                              "--out-min", "4", "--out-max", "12", "--max-seq-len", "64", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] and out.with_suffix(".png").stat().st_size > 0
    for row in rec["rows"]:
        assert row["output_tok_per_s"] > 0 and row["finish"]["length"] == 6  # every request ran to max_tokens
        assert row["tpot_p99_s"] >= row["tpot_p50_s"] > 0
    assert next(r for r in rec["rows"] if r["policy"] == "asyncspade")["engine"]["sparse_steps"] > 0


def test_profile_window_gives_up_when_the_trace_ends_first(monkeypatch):
    """``--profile-steps``: a trace that ends before every request has joined (here: a
    request is always waiting) makes the profile None, not a hang."""
    import asyncio

    import torch

    class Engine:
        def stats(self):
            return {"requests_waiting": 1, "requests_prefilling": 0, "requests_running": 2, "steps": 5,
                    "prefill_pieces": 0}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    async def main():
        done = asyncio.Event()
        watch = asyncio.ensure_future(bench_serving._profile(Engine(), 20, done))
        await asyncio.sleep(0.05)
        assert not watch.done()  # still waiting for its window
        done.set()
        return await asyncio.wait_for(watch, 2.0)

    assert asyncio.run(main()) is None

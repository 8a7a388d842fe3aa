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
        # each step's rows: the trace's tokens but each request's first (its prompt pass) over its steps,
        # at most the slots
        assert 0 < row["rows_per_step"] <= 4
        assert row["rows_per_step"] == (row["output_tokens"] - 6) / row["engine"]["steps"]
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


def test_profile_table_waits_for_the_trace_and_reports_the_stall(monkeypatch):
    """The kernel table is built once the trace is over (``done``), not on the event
    loop mid-trace; the profiler's stop, which did hold the scheduler, is reported as
    ``stall_s``."""
    import asyncio
    import time

    import torch

    class Engine:
        steps = 0

        def stats(self):
            Engine.steps += 1  # each poll: one more decode step
            return {"requests_waiting": 0, "requests_prefilling": 0, "requests_running": 3, "steps": Engine.steps,
                    "prefill_pieces": 0}

    class Event:
        key, self_device_time_total = "_decode_split_kernel", 8000.0

    class Prof:  # torch.profiler.profile's part the watcher uses (CUDA activity needs a GPU)
        built = False

        def __init__(self, activities):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            time.sleep(0.02)  # the stop
            return False

        def key_averages(self):
            assert done.is_set(), "the kernel table is built after the trace"
            Prof.built = True
            return [Event()]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.profiler, "profile", Prof)
    done = None

    async def main():
        nonlocal done
        done = asyncio.Event()
        watch = asyncio.ensure_future(bench_serving._profile(Engine(), 4, done))
        while Engine.steps < 10:  # the window (4 steps, after 2 that may hold a join) has closed
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert not watch.done()  # the table waits for the trace's end
        done.set()
        return await asyncio.wait_for(watch, 10.0)

    out = asyncio.run(main())
    assert Prof.built and out["steps"] >= 4 and out["rows"] == 3 and out["stall_s"] >= 0.02
    assert out["top_kernels_ms_per_step"] == {"_decode_split_kernel": 8.0 / out["steps"]}  # 8 ms over the window


def test_warm_jobs_reach_every_row_bucket():
    """The warm-up runs the trace's first max_batch prompts at once, each long enough to
    outlast every prompt piece before the last join (so the batch reaches its largest
    bucket); with whole prompts (chunk 0) one iteration per prompt."""
    jobs = [(0.1 * i, [1] * n, 50) for i, n in enumerate([5000, 2048, 100, 7])]
    warm = bench_serving.warm_jobs(jobs, max_batch=3, chunk=2048)
    assert [len(p) for _, p, _ in warm] == [5000, 2048, 100]
    assert {at for at, _, _ in warm} == {0.0} and {n for _, _, n in warm} == {bench_serving.WARM_TOKENS + 3 + 1 + 1}
    assert [n for *_, n in bench_serving.warm_jobs(jobs, max_batch=8, chunk=0)] == [bench_serving.WARM_TOKENS + 4] * 4
    assert len(bench_serving.warm_jobs(jobs[:1], max_batch=0, chunk=512)) == 1

"""benchmarks/bench_serve.py end to end on CPU: it starts ``spade serve`` (tiny preset),
sweeps two request rates with the openai async client, writes the JSON and the plot,
and stops the server (exit 0)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from benchmarks import bench_serve  # noqa: E402

CFG = """
model: {name: tiny, dtype: float32, device: cpu, max_seq_len: 128}
policy: {name: full}
runtime: {topology: inline}
"""


def test_bench_serve_smoke(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(CFG)
    out = tmp_path / "bench.json"
    rc = bench_serve.main(["--config", str(cfg), "--num-prompts", "4", "--input-len", "12", "--output-len", "5",
                           "--rates", "8,inf", "--search", "1", "--warmup", "1", "--out", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    (run,) = rep["runs"]
    assert run["server_exit_code"] == 0 and run["server"]["policy"] == "full"
    # one search probe: 16 req/s if 8 met the SLO, else 4; the rows in rate order
    probe = [r["rate"] for r in run["rows"] if r.get("probe")]
    assert probe in ([16.0], [4.0])
    assert [r["rate"] for r in run["rows"]] == sorted([8.0, *probe]) + ["inf"]
    for r in run["rows"]:
        assert r["completed"] == 4 and r["failed"] == 0, r["errors"]
        assert r["output_tokens"] == 4 * 5  # ignore_eos: every request runs to max_tokens
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and 0 < r["tpot_p50_ms"] <= r["tpot_p99_ms"]
        assert r["output_tok_per_s"] > 0
    assert run["idle_tpot_ms"] > 0 and run["slo_factor"] == 2.0
    slo = run["slo"]  # the highest finite rate within 2x the idle TPOT and 5x the idle TTFT (or none)
    assert slo["tpot_p99_limit_ms"] == 2.0 * run["idle_tpot_ms"]
    assert slo["ttft_p99_limit_ms"] == 5.0 * run["idle_ttft_ms"]
    meets = [r["rate"] for r in run["rows"] if r["rate"] != "inf" and r["tpot_p99_ms"] <= slo["tpot_p99_limit_ms"]
             and r["ttft_p99_ms"] <= slo["ttft_p99_limit_ms"]]
    assert slo["rate"] == (max(meets) if meets else None)
    assert (tmp_path / "bench.png").stat().st_size > 0
    both = tmp_path / "both.png"
    assert bench_serve.main(["--plot-from", str(out), str(out), "--plot", str(both)]) == 0
    assert both.stat().st_size > 0


def test_slo_rate_picks_the_highest_rate_within_the_limit():
    def row(rate, p99, failed=0):
        return {"rate": rate, "tpot_p99_ms": p99, "failed": failed, "req_per_s": 0.9 * rate if rate != "inf" else 5}

    rows = [row(0.5, 30.0), row(1.0, 39.0), row(2.0, 41.0), row(4.0, 35.0, failed=1), row("inf", 10.0)]
    slo = bench_serve.slo_rate(rows, 20.0, 2.0)
    assert slo == {"tpot_p99_limit_ms": 40.0, "ttft_p99_limit_ms": None, "rate": 1.0, "achieved_req_per_s": 0.9,
                   "bounded": True}
    assert bench_serve.slo_rate(rows[:2], 20.0, 2.0)["bounded"] is False  # every rate tried met it
    assert bench_serve.slo_rate(rows, 10.0, 2.0)["rate"] is None  # none within 20 ms
    assert bench_serve.slo_rate(rows, None, 2.0) is None
    runs = [{"label": "full", "idle_tpot_ms": 20.0, "slo": bench_serve.slo_rate(rows, 20.0, 2.0)},
            {"label": "asyncspade", "idle_tpot_ms": 15.0, "slo": bench_serve.slo_rate(rows, 15.0, 3.0)}]
    lines = bench_serve.slo_lines(runs)
    assert lines[-1] == "SLO rate asyncspade / full: 2.00x"
    # with their rows: one SLO for both at the first run's limits (asyncspade's own was looser here)
    fast = [row(0.5, 30.0), row(1.0, 41.0), row(2.0, 45.0)]
    runs[0]["rows"], runs[1]["rows"] = rows, fast
    assert bench_serve.slo_lines(runs)[-1] == ("SLO at full's limits for all (TPOT p99 <= 40.00 ms): full 1 req/s, "
                                               "asyncspade 0.5 req/s")


def test_slo_rate_counts_only_rates_served_without_a_growing_queue():
    """A server that admits requests in waves keeps its TPOT at any offered rate while
    they wait: with the TTFT condition the rate whose TTFT p99 left 5x the idle TTFT
    does not count, whatever its TPOT."""
    rows = [{"rate": 0.1, "tpot_p99_ms": 14.0, "ttft_p99_ms": 2000.0, "failed": 0, "req_per_s": 0.08},
            {"rate": 0.2, "tpot_p99_ms": 16.0, "ttft_p99_ms": 4900.0, "failed": 0, "req_per_s": 0.15},
            {"rate": 0.4, "tpot_p99_ms": 17.0, "ttft_p99_ms": 22000.0, "failed": 0, "req_per_s": 0.13}]
    assert bench_serve.slo_rate(rows, 11.0, 2.0)["rate"] == 0.4  # TPOT alone: every rate
    slo = bench_serve.slo_rate(rows, 11.0, 2.0, idle_ttft_ms=1000.0, ttft_factor=5.0)
    assert slo["rate"] == 0.2 and slo["ttft_p99_limit_ms"] == 5000.0 and slo["bounded"] is True
    assert bench_serve.slo_rate(rows, 11.0, 2.0, idle_ttft_ms=1000.0, ttft_factor=0)["rate"] == 0.4
    lines = bench_serve.slo_lines([{"label": "full", "idle_tpot_ms": 11.0, "slo": slo}])
    assert lines == ["SLO full: idle TPOT 11.00 ms, TPOT p99 <= 22.00 ms and TTFT p99 <= 5000 ms up to "
                     "0.2 req/s offered (0.150 achieved)"]


def test_make_prompts_same_for_every_rate():
    a, b = bench_serve.make_prompts(3, 7, seed=1), bench_serve.make_prompts(3, 7, seed=1)
    assert a == b and all(len(p) == 7 and all(10 <= t < 500 for t in p) for p in a)
    assert bench_serve.percentile([1, 2, 3, 4], 0.5) == 2.5 and bench_serve.percentile([], 0.5) is None


def test_next_probe_bisects_toward_the_highest_rate_meeting_the_slo():
    def row(rate, p99, ttft=1000.0):
        return {"rate": rate, "tpot_p99_ms": p99, "ttft_p99_ms": ttft, "failed": 0, "req_per_s": rate}

    # 0.1 meets (p99 <= 2 x 10 ms), 0.4 does not: the geometric midpoint 0.2
    assert bench_serve.next_probe([row(0.1, 15.0), row(0.4, 30.0)], 10.0, 2.0) == 0.2
    # none meets: half the lowest; every one meets: twice the highest; "inf" rows are ignored
    assert bench_serve.next_probe([row(0.25, 30.0), row(0.4, 35.0), row("inf", 50.0)], 10.0, 2.0) == 0.125
    assert bench_serve.next_probe([row(0.1, 15.0), row(0.2, 18.0)], 10.0, 2.0) == 0.4
    # a bracket within 10% ends the search; nothing tried: nothing to bisect
    assert bench_serve.next_probe([row(0.2, 15.0), row(0.21, 30.0)], 10.0, 2.0) is None
    assert bench_serve.next_probe([row("inf", 15.0)], 10.0, 2.0) is None
    # a rate whose queue grew (TTFT p99 past 5 x the idle TTFT) counts as failing
    rows = [row(0.1, 15.0), row(0.4, 18.0, ttft=9000.0)]
    assert bench_serve.next_probe(rows, 10.0, 2.0) == 0.8
    assert bench_serve.next_probe(rows, 10.0, 2.0, idle_ttft_ms=1000.0, ttft_factor=5.0) == 0.2


def test_warmup_plan_fills_every_slot():
    """The default warm-up: one request per batch slot, each outlasting every prompt piece
    before the last join (8 tokens more), capped by the context left after the prompt."""
    from types import SimpleNamespace

    a = SimpleNamespace(warmup=-1, num_prompts=20, input_len=5000)
    info = {"max_batch": 16, "prefill_chunk": 2048, "max_seq_len": 36000}
    assert bench_serve.warmup_plan(a, info) == (16, 8 + 16 * 3)
    assert bench_serve.warmup_plan(SimpleNamespace(warmup=-1, num_prompts=4, input_len=5000), info) == (4, 8 + 4 * 3)
    assert bench_serve.warmup_plan(a, {**info, "prefill_chunk": 0}) == (16, 8 + 16)
    assert bench_serve.warmup_plan(a, {**info, "max_seq_len": 5020}) == (16, 20)  # the room after the prompt
    assert bench_serve.warmup_plan(a, {}) == (2, 8 + 2)  # an older server: no slots in its metadata
    assert bench_serve.warmup_plan(SimpleNamespace(warmup=0, num_prompts=4, input_len=5), info) == (0, 0)
    assert bench_serve.warmup_plan(SimpleNamespace(warmup=3, num_prompts=4, input_len=5), info)[0] == 3

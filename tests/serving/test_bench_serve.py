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
                           "--rates", "8,inf", "--warmup", "1", "--out", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    (run,) = rep["runs"]
    assert run["server_exit_code"] == 0 and run["server"]["policy"] == "full"
    assert [r["rate"] for r in run["rows"]] == [8.0, "inf"]
    for r in run["rows"]:
        assert r["completed"] == 4 and r["failed"] == 0, r["errors"]
        assert r["output_tokens"] == 4 * 5  # ignore_eos: every request runs to max_tokens
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and 0 < r["tpot_p50_ms"] <= r["tpot_p99_ms"]
        assert r["output_tok_per_s"] > 0
    assert (tmp_path / "bench.png").stat().st_size > 0
    both = tmp_path / "both.png"
    assert bench_serve.main(["--plot-from", str(out), str(out), "--plot", str(both)]) == 0
    assert both.stat().st_size > 0


def test_make_prompts_same_for_every_rate():
    a, b = bench_serve.make_prompts(3, 7, seed=1), bench_serve.make_prompts(3, 7, seed=1)
    assert a == b and all(len(p) == 7 and all(10 <= t < 500 for t in p) for p in a)
    assert bench_serve.percentile([1, 2, 3, 4], 0.5) == 2.5 and bench_serve.percentile([], 0.5) is None

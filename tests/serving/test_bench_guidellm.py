"""benchmarks/bench_guidellm.py: guidellm's report read into bench_serve's rows (a trimmed
report of a real guidellm 0.8.1 run against `spade serve` on SmolLM2, CPU), the byte-level
tokenizer of a model without one, and the whole path (a `spade serve` of the tiny preset
started, warmed up, driven, stopped) with a stand-in for the guidellm executable, which
is not installed in CI (it brings its own environment)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from benchmarks import bench_guidellm  # noqa: E402

REPORT = Path(__file__).parent / "data" / "guidellm_report.json"


def test_read_report_maps_guidellm_metrics():
    rows = bench_guidellm.read_report(REPORT)
    assert [(r["profile"], r["rate"]) for r in rows] == [("poisson", 0.5), ("poisson", 1.0)]
    raw = json.loads(REPORT.read_text())["benchmarks"][0]["metrics"]
    r = rows[0]
    assert r["completed"] == 6 and r["failed"] == 0 and r["requests"] == 6
    assert r["tpot_p99_ms"] == raw["inter_token_latency_ms"]["successful"]["percentiles"]["p99"]  # first token out
    assert r["guidellm_tpot_p50_ms"] == raw["time_per_output_token_ms"]["successful"]["percentiles"]["p50"]
    assert r["e2e_p50_ms"] == pytest.approx(raw["request_latency"]["successful"]["percentiles"]["p50"] * 1e3)
    assert r["output_tok_per_s"] == raw["output_tokens_per_second"]["successful"]["mean"] > 0
    assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]


def test_byte_tokenizer_counts_utf8_bytes(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bench_guidellm.byte_tokenizer(tmp_path / "bytes")))
    text = "héllo, wörld: 42"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text.encode("utf-8")) and tok.decode(ids) == text


def test_guidellm_command_names_every_setting(tmp_path):
    cmd = bench_guidellm.guidellm_command("gl", "http://127.0.0.1:9", "m", ["--profile", "kind=synchronous"], 5,
                                          64, 16, tmp_path / "tok", tmp_path / "o.json")
    line = " ".join(cmd)
    for want in ("run --backend kind=openai_http,target=http://127.0.0.1:9,model=m", "kind=max_requests,count=5",
                 "kind=synthetic_text,prompt_tokens=64,output_tokens=16", f"model={tmp_path / 'tok'}",
                 f"kind=json,path={tmp_path / 'o.json'}", "--profile kind=synchronous"):
        assert want in line
    assert bench_guidellm.guidellm_env()["GUIDELLM__MAX_WORKER_PROCESSES"] == "1"
    as_module = bench_guidellm.guidellm_command("python3 -m guidellm", "http://h", "m", [], 1, 1, 1, tmp_path, tmp_path)
    assert as_module[:4] == ["python3", "-m", "guidellm", "run"]


STAND_IN = '''#!{python}
"""A stand-in for guidellm: checks its arguments against the live server, writes a report."""
import json, os, sys, urllib.request
args = sys.argv[1:]
if args == ["--version"]:
    print("guidellm version: stand-in"); sys.exit(0)
assert args[0] == "run" and os.environ["GUIDELLM__MAX_WORKER_PROCESSES"] == "1", args
opt = {{args[i]: args[i + 1] for i in range(1, len(args) - 1) if args[i].startswith("--")}}
kv = lambda s: dict(x.split("=", 1) for x in s.split(","))
backend = kv(opt["--backend"])
models = json.load(urllib.request.urlopen(backend["target"] + "/v1/models", timeout=30))
assert backend["model"] == models["data"][0]["id"], (backend, models)
assert os.path.isfile(os.path.join(kv(opt["--tokenizer"])["model"], "tokenizer.json"))
rep = json.load(open({report!r}))
profile = kv(opt["--profile"])
if profile["kind"] == "synchronous":
    rep["benchmarks"] = rep["benchmarks"][:1]
    rep["benchmarks"][0]["config"]["strategy"] = {{"type_": "synchronous"}}
else:
    i = args.index("--override") if "--override" in args else None  # --override profile.rate R1,R2
    rates = [float(r) for r in (args[i + 2] if i is not None else profile["rate"]).split(",")]
    b0 = rep["benchmarks"][0]
    rep["benchmarks"] = [json.loads(json.dumps(b0)) for _ in rates]
    for b, r in zip(rep["benchmarks"], rates):
        b["config"]["strategy"] = {{"type_": "poisson", "rate": r}}
json.dump(rep, open(kv(opt["--output"])["path"], "w"))
'''


def test_sweep_with_a_stand_in_guidellm(tmp_path):
    exe = tmp_path / "guidellm"
    exe.write_text(STAND_IN.format(python=sys.executable, report=str(REPORT)))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text("model: {name: tiny, dtype: float32, device: cpu, max_seq_len: 128}\n"
                   "policy: {name: full}\nruntime: {topology: inline}\n")
    out = tmp_path / "gl.json"
    rc = bench_guidellm.main(["--config", str(cfg), "--guidellm", str(exe), "--rates", "0.5,1", "--num-prompts", "4",
                              "--input-len", "12", "--output-len", "5", "--warmup", "1", "--out", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["load_generator"] == "guidellm stand-in"
    assert Path(rep["tokenizer"]).name == "byte_tokenizer"  # the tiny preset has no tokenizer
    (run,) = rep["runs"]
    assert run["server_exit_code"] == 0 and run["label"] == "full" and run["server"]["policy"] == "full"
    assert [r["rate"] for r in run["rows"]] == [0.5, 1.0] and all(r["policy"] == "full" for r in run["rows"])
    assert run["idle_tpot_ms"] == run["idle"]["tpot_p50_ms"] > 0
    assert run["slo"]["tpot_p99_limit_ms"] == 2.0 * run["idle_tpot_ms"]
    assert set(run["guidellm"]) == {"idle", "rates"} and "--override" in run["guidellm"]["rates"]["command"]
    assert out.with_suffix(".png").stat().st_size > 0
    assert os.path.getsize(out.with_name("gl.full.guidellm.log")) > 0

"""benchmarks.long_context: the long-context summary of bench_tpot results (table,
ratios, fallback rates, Table 3, plots), on synthetic results and on a real CPU run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks import long_context

#: the benchmark subprocesses on one torch thread, like the tests' own process (small ops on
#: a shared 2-core box); what they measure is not compared with anything here
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def _conf(B, L, rows, overlap=None, **extra):
    c = {"batch": B, "context": L, "budget": 2048, "rows": rows}
    if overlap is not None:
        c["overlap"] = overlap
    c.update(extra)
    return c


def _row(t, **kw):
    return {"tpot_ms": t, "p90_ms": t * 1.1, **kw}


def test_several_pack_sizes_keep_their_own_rows_table3_and_the_local_fallback_rate():
    """A run of P=4 and P=9 side by side: the labels carry P, Table 3 is per P, and the
    fallback column reads a local row even when a colocated row comes first."""
    loc_ch = {"topk_calls": 400.0, "topk_fallbacks": 10.0}
    col_ch = {"topk_calls": 200.0, "topk_fallbacks": 10.0}
    res = {"meta": {"gpu": "NVIDIA H200"}, "configs": [_conf(1, 262144, {
        "full": _row(14.0), "optimal": _row(4.6),
        "asyncspade/colocated/P=4/int4": _row(6.8, cache_host=col_ch),
        "asyncspade/colocated/P=9/int4": _row(6.6, cache_host=col_ch),
        "asyncspade/local/P=4/int4": _row(5.1, cache_host=loc_ch),
        "asyncspade/local/P=9/int4": _row(4.8, cache_host=loc_ch)},
        overlap=[{"pack_layers": 4, "inference_ms_per_pack": 0.5, "cache_ms_per_pack_runtime_int4": 0.35},
                 {"pack_layers": 9, "inference_ms_per_pack": 1.1, "cache_ms_per_pack_runtime_int4": 0.66}])]}
    rows = long_context.summarise([res])
    by = {r["method"]: r for r in rows}
    assert {"local/P=4", "local/P=9", "colocated/P=4", "colocated/P=9"} <= set(by)
    assert abs(by["local/P=4"]["table3"] - 0.7) < 1e-9 and abs(by["local/P=9"]["table3"] - 0.6) < 1e-9
    line = next(x for x in long_context.markdown(rows).splitlines() if x.startswith("| 1 x 256k"))
    assert "| 2.5% |" in line and "5.0%" not in line
    # one pack size: plain labels, as the single-P runs always had
    one = {"configs": [_conf(1, 65536, {"optimal": _row(4.6), "asyncspade/local/P=9/int4": _row(4.7)})]}
    assert {r["method"] for r in long_context.summarise([one])} == {"optimal", "local"}


def test_summary_ratios_fallbacks_and_table3(tmp_path):
    ch = {"topk_calls": 200.0, "topk_fallbacks": 10.0, "topk_fallbacks_too_many": 4.0}
    res = {"meta": {"gpu": "NVIDIA H200"}, "configs": [
        _conf(1, 524288, {"full": _row(22.0), "quest": _row(11.0), "optimal": _row(5.0),
                          "asyncspade/local/P=4/int4": _row(5.5, cache_host=ch),
                          "asyncspade/colocated/P=4/int4": _row(7.0),
                          "asyncspade/local/P=4/int4/topk=radix": _row(8.0)},
              overlap=[{"pack_layers": 4, "inference_ms_per_pack": 0.5, "cache_ms_per_pack_runtime_int4": 0.4}],
              overlap_topk_radix=[{"pack_layers": 4, "inference_ms_per_pack": 0.5,
                                   "cache_ms_per_pack_runtime_int4": 0.75}]),
        _conf(1, 65536, {"full": _row(7.0), "optimal": _row(4.6), "asyncspade/local/P=4/int4": _row(4.7)}),
        {"batch": 2, "context": 1 << 20, "skipped": "OutOfMemoryError"}]}
    rows = long_context.summarise([res])
    by = {(r["context"], r["method"]): r for r in rows}
    loc = by[(524288, "local")]
    assert abs(loc["vs_optimal"] - 1.1) < 1e-9 and abs(loc["full_over"] - 4.0) < 1e-9
    assert loc["topk_fallback_rate"] == 0.05 and loc["topk_fallbacks_too_many_rate"] == 0.02
    assert abs(loc["table3"] - 0.8) < 1e-9 and abs(by[(524288, "local/topk=radix")]["table3"] - 1.5) < 1e-9
    assert by[(524288, "colocated")]["vs_optimal"] == 1.4 and "topk_fallback_rate" not in by[(524288, "colocated")]
    assert [r["context"] for r in rows][0] == 65536  # ordered by tokens in the batch
    md = long_context.markdown(rows)
    assert "| 1 x 512k | 22.00 | 11.00 (2.20x) | 5.00 | 5.50 (1.10x) | 7.00 (1.40x)" in md and "5.0%" in md
    out = tmp_path / "long.json"
    f = tmp_path / "r.json"
    f.write_text(json.dumps(res))
    assert long_context.main([str(f), str(tmp_path / "missing.json"), "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert len(got["rows"]) == len(rows) and all(p.endswith(".png") for p in got["plots"])
    assert (tmp_path / "long_context_b1.png").stat().st_size > 0 and out.with_suffix(".md").exists()
    assert long_context.main([str(tmp_path / "missing.json"), "--out", str(out)]) == 1


def test_on_a_cpu_bench_tpot_run(tmp_path):
    """The real bench_tpot JSON (tiny preset, CPU) goes through: every row kept, the
    colocated row's ratio to optimal computed."""
    out = tmp_path / "t.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_tpot", "--device", "cpu", "--preset", "tiny", "--batch", "1",
           "--context", "300", "--budget", "64", "--iters", "2", "--warmup", "1", "--recent", "8", "--window", "4",
           "--packs", "2", "--methods", "full,optimal,asyncspade/colocated", "--linear", "cublas", "--no-plots",
           "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = long_context.summarise([json.loads(out.read_text())])
    assert {r["method"] for r in rows} == {"full", "optimal", "colocated"}
    col = next(r for r in rows if r["method"] == "colocated")
    assert col["vs_optimal"] > 0 and col["context"] == 300

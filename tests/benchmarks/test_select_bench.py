"""Smoke test of ``python -m benchmarks.bench_select --tiny`` (CPU: Triton interpreter):
every configuration's selection is checked against ``torch.topk`` before it is timed,
each stage is reported, and a bad configuration is reported rather than fatal."""

from __future__ import annotations

import json

from benchmarks import bench_select


def test_tiny_run(tmp_path):
    out = tmp_path / "sel.json"
    assert bench_select.main(["--tiny", "--keys", "exact,int8", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["keys"] for r in rows} == {"exact", "int8"}
    timed = [r for r in rows if "total_ms" in r]
    assert len(timed) == len(rows)  # nothing failed or was refused at the tiny shape
    for r in timed:
        assert r["deficit"] <= 1e-4  # the selection equals torch.topk's (sum of true scores)
        stages = [r[f"{n}_ms"] for n in ("score", "pass1", "split", "tie")]
        assert abs(sum(stages) - r["total_ms"]) < 1e-6 and r["select_ms"] == r["total_ms"] - r["score_ms"]
    assert any(r["config"] == "default" for r in rows) and any(isinstance(r["config"], dict) for r in rows)

"""Smoke test of ``python -m benchmarks.bench_gemv --device cpu --grid`` (Triton interpreter):
tiny shapes, every row checked against ``F.linear``, the grid search prints overrides
that are valid ``GemvConfig`` tuples."""

from __future__ import annotations

import json

from benchmarks import bench_gemv
from spade.kernels.gemv import GemvConfig


def test_cpu_smoke(tmp_path, capsys):
    out = tmp_path / "gemv.json"
    assert bench_gemv.main(["--device", "cpu", "--grid", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {(r["shape"], r["M"]) for r in doc["rows"]} == {(s, m) for s in bench_gemv.TINY_SHAPES for m in (1, 8)}
    for r in doc["rows"]:
        assert r["rel_err"] < 2e-2 and r["triton_us"] > 0 and r["cublas_us"] > 0 and r["floor_us"] > 0
    assert doc["grid"] and all(g["ok"] for g in doc["grid"])
    assert len(doc["overrides"]) == len(bench_gemv.TINY_SHAPES)
    for v in doc["overrides"].values():
        GemvConfig(*v)
    assert "GEMV_OVERRIDES.update({" in capsys.readouterr().out


def test_cpu_glu_rows(tmp_path):
    """``--glu``: the fused gate/up + SiLU-product rows on the even tiny shape, bit-identical
    to the two launches (the script raises otherwise), timings positive."""
    out = tmp_path / "gemv.json"
    assert bench_gemv.main(["--device", "cpu", "--glu", "--shapes", "tiny_b", "--out", str(out)]) == 0
    glu = json.loads(out.read_text())["glu"]
    assert [(r["shape"], r["M"]) for r in glu] == [("tiny_b", 1), ("tiny_b", 8)]
    assert all(r["bit_identical"] and r["glu_us"] > 0 and r["two_launch_us"] > 0 for r in glu)

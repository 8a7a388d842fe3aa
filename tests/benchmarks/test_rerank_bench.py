"""Smoke test of ``python -m benchmarks.bench_rerank --tiny`` (CPU: Triton interpreter):
the kept set is checked against the reference before anything is timed, and every row
is timed with its bytes floor."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_rerank
from tests.conftest import INTERPRET

pytestmark = pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels on CPU tensors (the interpreter)")


def test_tiny_run(tmp_path):
    out = tmp_path / "rr.json"
    assert bench_rerank.main(["--tiny", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [(r["op"], r["impl"]) for r in rows] == [
        ("rerank", "select"), ("rerank", "select+attend"), ("rerank", "torch+attend"),
        ("attend_K", "triton"), ("attend_M", "triton")]
    assert rows[0]["deficit"] <= 1e-3 and rows[0]["M"] == 2 * rows[0]["K_mid"]
    for r in rows:
        assert "error" not in r and r["ms"] > 0 and r["floor_ms"] > 0
    assert doc["budget"] == 16 and doc["copy_bw_gbs"] > 0

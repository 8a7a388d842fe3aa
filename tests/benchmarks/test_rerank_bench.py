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


def test_tiny_paged(tmp_path):
    """``--block-size`` adds the paged rows, each kept set equal to the contiguous kernel's."""
    out = tmp_path / "rr.json"
    assert bench_rerank.main(["--tiny", "--block-size", "8", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    paged = [r for r in rows if r.get("block_size") == 8]
    assert [r["impl"] for r in paged] == ["select paged", "select+attend paged", "select gathered"]
    for r in paged:
        assert "error" not in r and r["ms"] > 0 and r["floor_ms"] > 0


def test_tiny_sweep(tmp_path):
    """``--sweep`` adds a checked, timed select row per RERANK_CONFIG setting (here two
    split launches, the second with its rows past SELECT_MAX: the wide path) and leaves
    the config as it was."""
    from spade.kernels import rerank

    out = tmp_path / "rr.json"
    assert bench_rerank.main(["--tiny", "--sweep", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    sweep = [r for r in rows if r["impl"].startswith("select[")]
    assert [r["impl"] for r in sweep] == ["select[FUSE=0 MIN_CHUNK=16 BLOCK_M=16]",
                                          "select[FUSE=0 SELECT_MAX=16 SELECT_BLOCK=16]"]
    assert [(r["fused"], r["one_tile"]) for r in sweep] == [(False, True), (False, False)]
    assert sweep[0]["nsplit"] > 1
    for r in sweep:
        assert "error" not in r and r["ms"] > 0 and r["deficit"] <= 1e-3
    assert rerank.RERANK_CONFIG == {}

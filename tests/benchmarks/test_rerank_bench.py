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


def test_tiny_sweep(tmp_path):
    """``--sweep`` adds a checked, timed select row per RERANK_CONFIG setting (here the
    split and the fused launch, the latter selecting in tiles) and leaves the config as
    it was."""
    from spade.kernels import rerank

    out = tmp_path / "rr.json"
    assert bench_rerank.main(["--tiny", "--sweep", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    sweep = [r for r in rows if r["impl"].startswith("select[")]
    assert [r["impl"] for r in sweep] == ["select[FUSE=0 MIN_CHUNK=16 BLOCK_M=16]",
                                          "select[FUSE=1 SELECT_MAX=16 SELECT_BLOCK=16]"]
    assert [(r["fused"], r["one_tile"]) for r in sweep] == [(False, True), (True, False)]
    assert sweep[0]["nsplit"] > 1
    for r in sweep:
        assert "error" not in r and r["ms"] > 0 and r["deficit"] <= 1e-3
    assert rerank.RERANK_CONFIG == {}


def test_tiny_compressed_keys(tmp_path):
    """``--keys exact,int8,int4``: the exact keys' rows as ever, then a checked, timed
    select row per compressed copy whose floor counts its own key bytes (d, d / 2) plus
    the 4-byte scale and index per candidate."""
    out = tmp_path / "rr.json"
    assert bench_rerank.main(["--tiny", "--keys", "exact,int8,int4", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [(r["op"], r["impl"], r["keys"]) for r in rows] == [
        ("rerank", "select", "exact"), ("rerank", "select+attend", "exact"), ("rerank", "torch+attend", "exact"),
        ("attend_K", "triton", "exact"), ("attend_M", "triton", "exact"),
        ("rerank", "select", "int8"), ("rerank", "select", "int4")]
    for r in rows:
        assert "error" not in r and r["ms"] > 0 and r["floor_ms"] > 0
    sel = {r["keys"]: r for r in rows if r["impl"] == "select"}
    d, M, k_mid, bw = doc["d"], sel["int8"]["M"], sel["int8"]["K_mid"], doc["copy_bw_gbs"] * 1e9
    for kind, row_bytes in (("exact", 4 * d), ("int8", d + 4), ("int4", d // 2 + 4)):  # --tiny: fp32 cache
        assert sel[kind]["deficit"] <= 1e-3
        # (B = Hkv = 1) candidates' rows + their indices, the kept indices, the fp32 query
        floor_bytes = M * (row_bytes + 4) + k_mid * 4 + doc["hq"] * d * 4
        assert abs(sel[kind]["floor_ms"] / (floor_bytes / bw * 1e3) - 1) <= 1e-9


def test_unknown_keys_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench_rerank.main(["--tiny", "--keys", "int8,fp8"])
    assert "--keys 'int8,fp8': use one or more of exact,int8,int4" in capsys.readouterr().err

"""Smoke test of ``python -m benchmarks.bench_select --tiny`` (CPU: Triton interpreter):
every configuration's selection is checked against ``torch.topk`` before it is timed,
each stage is reported, and a bad configuration is reported rather than fatal."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_select
from tests.conftest import INTERPRET

# --tiny runs the Triton kernels on CPU tensors: the interpreter must be on in this process
# (on a GPU machine triton is imported compiled; the GPU runs the real benchmark instead)
pytestmark = pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels on CPU tensors (the interpreter)")


def test_tiny_run(tmp_path):
    out = tmp_path / "sel.json"
    assert bench_select.main(["--tiny", "--keys", "exact,int8", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["keys"] for r in rows} == {"exact", "int8"}
    timed = [r for r in rows if "select_ms" in r]
    assert len(timed) == len(rows)  # nothing failed or was refused at the tiny shape
    for r in timed:
        assert r["deficit"] <= 1e-4  # the selection equals torch.topk's (sum of true scores)
        stages = [r[f"{n}_ms"] for n in ("score", "pass1", "split", "tie")]
        assert abs(sum(stages) - r["total_ms"]) < 1e-6 and r["select_ms"] == r["total_ms"] - r["score_ms"]
    assert any(r["config"] == "default" for r in rows) and any(isinstance(r["config"], dict) for r in rows)


def test_tiny_carry_and_overlap_rows(tmp_path):
    """``--carry BITS:WARPS``: the threshold-carry top-K's stages (scoring alone, the
    compaction, the select) and its forced fallback, each selection checked first.
    ``--overlap``: a pack of layers timed serially, then with the select on a side
    stream (a no-op on a CPU), every layer's selection checked. ``--carry-tiles`` x
    ``--carry-packs``: the scoring tiles under one and four int4 tokens per MMA row. One
    run for all: each run of the script also times the default select first."""
    out = tmp_path / "sel.json"
    assert bench_select.main(["--tiny", "--keys", "int4", "--no-grid", "--carry", "8:1,4:1", "--overlap", "4:-1",
                              "--overlap-layers", "2", "--carry-tiles", "64:1:1", "--carry-packs", "1,4",
                              "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    carry = [r for r in rows if isinstance(r["config"], dict) and set(r["config"]) == {"carry"}]
    assert [r["config"]["carry"] for r in carry] == ["8:1", "4:1"]
    for r in carry:
        assert "error" not in r and r["deficit"] <= 1e-4
        assert abs(r["score_ms"] + r["compact_ms"] + r["carry_select_ms"] - r["total_ms"]) < 1e-6
        assert r["fallback_total_ms"] > 0 and r["vs_default"] > 0
    ov = [r for r in rows if isinstance(r["config"], dict) and "overlap" in r["config"]]
    assert [r["config"]["overlap"] for r in ov] == ["off", "4:-1"]
    for r in ov:
        assert "error" not in r and r["deficit"] <= 1e-4 and r["config"]["layers"] == 2
        assert r["config"]["carry"] == "8:1"  # the first --carry config
        assert abs(r["per_layer_ms"] * 2 - r["total_ms"]) < 1e-9
    assert all(r["vs_serial"] > 0 for r in ov[1:])
    # --carry-tiles x --carry-packs: scoring + compaction under each tile and int4 tokens per MMA row
    tiles = [r for r in rows if isinstance(r["config"], dict) and "score_tile" in r["config"]]
    assert [(r["config"]["score_tile"], r["config"]["pack"]) for r in tiles] == [("64:1:1", 1), ("64:1:1", 4)]
    assert all("error" not in r and r["deficit"] <= 1e-4 and r["score_compact_ms"] > 0 for r in tiles)
    with pytest.raises(SystemExit):
        bench_select.main(["--tiny", "--carry-packs", "2"])

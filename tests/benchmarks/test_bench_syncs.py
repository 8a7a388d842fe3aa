"""benchmarks/bench_syncs.py: the served trace's host synchronisations by line (CPU: the path)."""

from __future__ import annotations

import json
import warnings

from benchmarks import bench_syncs


def test_count_syncs_counts_by_line():
    with bench_syncs.count_syncs(False) as counts:
        for _ in range(3):
            warnings.warn("a host synchronisation")  # the line counted
    [(where, n)] = counts.items()
    assert n == 3 and where.startswith("tests/benchmarks/test_bench_syncs.py:")


def test_smoke_runs_a_served_trace(tmp_path):
    out = bench_syncs.run(["--smoke", "--out", str(tmp_path / "s.json")])
    assert out["steps"] > 0 and out["prefill_pieces"] == 3
    assert out["syncs"] == 0 and out["by_line"] == {}  # a CPU has no GPU to wait for
    assert json.loads((tmp_path / "s.json").read_text())["steps"] == out["steps"]

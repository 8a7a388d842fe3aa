"""CPU smoke tests of ``python -m benchmarks.bench_attention --sweep-sparse --smoke``
(Triton interpreter, tiny shapes, a few configs): they check the script, not speed —
the JSON rows (errors against the default call, floors and x
floor consistent), the statistics rows, the budget cut and the config order."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_attention as BA


def test_sweep_sparse_smoke(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert BA.main(["--sweep-sparse", "--smoke", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["smoke"] and doc["complete"] and doc["floor_us"] > 0 and doc["hbm_bytes_per_s"] > 0
    assert doc["default_rel_err_vs_torch"] < 1e-5
    rows = doc["rows"]
    assert rows[0]["tag"] == "default" and rows[0]["num_splits"] is None
    sweep = [r for r in rows if r["tag"] == "sweep"]
    assert {r["num_splits"] for r in sweep} == {1, doc["heuristic_splits"]}
    for r in rows:
        assert "error" not in r, r
        assert r["ok"] and r["max_abs_err"] <= doc["tol_max_abs"], r
        assert r["x_floor"] == pytest.approx(r["us"] / doc["floor_us"])
        assert r["tb_s"] == pytest.approx(doc["sel_bytes"] / (r["us"] * 1e-6) / 1e12)
        assert r["eff_splits"] == (r["num_splits"] or doc["heuristic_splits"])
    assert {r["tag"] for r in rows if r["stats"]} == {"default_stats_on", "best_stats_on"}
    assert doc["best"]["us"] == min(r["us"] for r in sweep)
    printed = capsys.readouterr().out
    assert "best:" in printed and "default (the runtime's call" in printed


def test_sweep_budget_cut_writes_json(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert BA.main(["--sweep-sparse", "--smoke", "--budget-s", "0", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert not doc["complete"]
    assert [r["tag"] for r in doc["rows"]] == ["default", "default_stats_on"]
    assert doc["best"] is None
    assert "budget: stopped after 0 of 2 configs" in capsys.readouterr().out


def test_sweep_order_puts_defaults_and_heuristic_first():
    default = (64, 4, 3)
    splits, bns, warps, stages = [1, 2, 6, 16], [32, 64], [4, 8], [3, 5]
    order = BA.sweep_order(splits, bns, warps, stages, default, heuristic=6)
    assert len(order) == len(set(order)) == 4 * 2 * 2 * 2
    first = order[:4]  # the default launch config over every split count
    assert all(c[1:] == default for c in first)
    assert {c[0] for c in first} == set(splits) and first[0][0] == 6
    second = order[4:4 + 8 - 1]  # every launch config at the heuristic split count
    assert all(c[0] == 6 for c in second)
    assert all(c[0] != 6 for c in order[len(first) + len(second):])

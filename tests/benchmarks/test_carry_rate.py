"""Smoke test of ``python -m benchmarks.carry_rate --tiny`` (a random tiny model, the Triton
kernels under the CPU interpreter): every (layer, method, budget) reports its fallbacks over
the calls after the first, and the summary adds them up."""

from __future__ import annotations

import json

import pytest

from benchmarks import carry_rate
from tests.conftest import INTERPRET


@pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels on CPU tensors (the interpreter)")
def test_tiny_run(tmp_path):
    out = tmp_path / "cr.json"
    # one predictor: oracle and a predictor are the script's two paths ("last" differs from
    # "assembled" only in the mode string handed to predict, tested in tests/policies)
    assert carry_rate.main(["--tiny", "--predictors", "assembled", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert {r["method"] for r in rows} == {"oracle", "asyncspade/assembled"}
    assert len(rows) == 4  # 2 layers x 2 methods x 1 budget
    for r in rows:  # 5 steps after the first, 2 KV heads (rows) each
        assert r["calls"] == 10 and 0 <= r["fallbacks"] <= r["calls"]
    for key, s in res["summary"].items():
        method = key.split("/K=")[0]
        assert s["calls"] == sum(r["calls"] for r in rows if r["method"] == method)
        assert s["fallbacks"] == sum(r["fallbacks"] for r in rows if r["method"] == method)

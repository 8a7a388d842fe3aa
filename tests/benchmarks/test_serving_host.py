"""benchmarks/serving_host.py: the serving engine's host time per step, end to end (CPU, seconds)."""

import json

import pytest

from benchmarks import serving_host

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_reports_each_round(tmp_path):
    out = tmp_path / "h.json"
    assert serving_host.main(["--rows", "3", "--tokens", "12", "--rounds", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["rows"] == 3 and len(res["runs"]) == 2
    assert all(r["steps"] >= 11 and r["wall_ms_per_step"] > r["worker_decode_ms_per_step"] > 0 for r in res["runs"])


def test_refuses_a_bad_count(capsys):
    with pytest.raises(SystemExit):
        serving_host.main(["--rows", "0"])
    assert "--rows must be >= 1" in capsys.readouterr().err

"""CPU smoke test of ``python -m benchmarks.soak``: a short soak on the tiny preset
with an in-process cache rank (it checks the script and its figures, not speed)."""

from __future__ import annotations

import json

from benchmarks import soak


def test_soak_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("SPADE_KERNELS", "torch")
    out = tmp_path / "soak.json"
    rc = soak.main(["--steps", "40", "--steps-per-request", "20", "--fault-every", "8", "--prompt-len", "24",
                    "--budget", "16", "--faults", "kill,close", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 0 and doc["requests_lost"] == 0 and doc["steps"] == 40 == len(doc["step_ms"])
    assert doc["faults_injected"] >= 3 and doc["faults_survived"] == doc["faults_injected"]
    assert {f["kind"] for f in doc["faults"]} == {"kill", "close"}
    restored = [f for f in doc["faults"] if f["restored_step"] is not None]
    assert len(restored) >= doc["faults_injected"] - 2  # (a fault on a request's last steps is not restored in it)
    assert doc["longest_degraded_steps"] == max(f["degraded_steps"] for f in restored) >= 1
    assert all(f["restored_step"] > f["lost_step"] >= f["step"] - 1 for f in restored)
    # every step after a restore attends the budget again: the per-step count is the steady one
    steady = doc["attended_per_step"][5]
    for f in restored:
        assert doc["attended_per_step"][f["restored_step"] - 1] == steady
    assert out.with_suffix(".png").stat().st_size > 0

"""benchmarks/bench_transports.py on CPU: the --tiny smoke run, the kill of a hung
transport (rows that finished are kept), and the global time budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["local", "nccl", "ucx", "nixl", "raw_nccl"]


def _bench(tmp_path: Path, *args: str, env: dict | None = None, timeout: float = 240) -> dict:
    out = tmp_path / "bt.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_transports", "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_tiny_smoke_measures_every_usable_transport(tmp_path):
    from spade.transports import availability

    rep = _bench(tmp_path, "--tiny", "--limit-s", "90")
    msgs = rep["config"]["messages"]
    assert set(msgs) == {"qkv", "sel_delta", "sel", "kv", "raw_1MiB"}
    assert rep["config"]["batch"] == 1 and rep["config"]["pack"] == 2
    usable = {n: ok for n, (ok, _) in availability().items()}
    for name in NAMES:
        ent = rep["results"][name]
        if name != "raw_nccl" and not usable[name]:
            assert ent["status"] == "skipped" and ent["reason"], ent
            continue
        assert ent["status"] == "ok", f"{name}: {ent.get('error')}"
        assert set(ent["messages"]) == set(msgs), f"{name}: rows {sorted(ent['messages'])}"
        for m, row in ent["messages"].items():
            assert row["bytes"] == msgs[m]["bytes"]
            for key in ("latency_rtt_half_us", "latency_oneway_us", "bandwidth_GBps"):
                assert 0 < row[key] < 1e7, f"{name}/{m}: {key} = {row[key]}"
            assert row["oneway_iters"] >= 2 and row["pingpong_iters"] >= 3
        assert all(Path(p).exists() for p in ent["logs"])
    # the NCCL children log with NCCL_DEBUG=INFO (visible on a GPU; on CPU it is gloo)
    assert any("rank0" in p for p in rep["results"]["raw_nccl"]["logs"])


def test_a_hung_transport_is_killed_and_its_finished_rows_kept(tmp_path):
    rep = _bench(tmp_path, "--tiny", "--transports", "local,raw_nccl", "--limit-s", "10",
                 env={"SPADE_BENCH_HANG": "local"})
    hung = rep["results"]["local"]
    assert hung["status"] == "timeout", hung
    assert list(hung["messages"]) == ["sel_delta"], "the row finished before the hang must be kept"
    assert "bandwidth_GBps" in hung["messages"]["sel_delta"]
    log = Path(hung["logs"][0]).read_text()
    assert "hanging on purpose" in log and "File " in log, "SIGTERM should dump the hung child's stacks"
    assert rep["results"]["raw_nccl"]["status"] == "ok", "the run must go on after a hung transport"


def test_the_global_budget_skips_what_does_not_fit(tmp_path):
    rep = _bench(tmp_path, "--tiny", "--transports", "local,ucx", "--budget-s", "1")
    for name in ("local", "ucx"):
        assert rep["results"][name]["status"] == "skipped"
        assert "budget" in rep["results"][name]["reason"]


@pytest.mark.parametrize("tiny", [True, False])
def test_message_sizes_follow_the_runtime_layouts(tiny):
    from benchmarks.bench_transports import MiB, message_specs, spec_bytes

    B, P, K = 8, 4, 2048
    specs = message_specs(B, P, K, None, tiny=tiny)
    qkv = P * B * (32 + 16) * 128 * 2
    assert spec_bytes(specs["qkv"]) == qkv
    assert spec_bytes(specs["sel"]) == P * 8 * 8 + P * B * 8 * K * 4
    assert spec_bytes(specs["kv"]) == P * 8 * 8 + P * B * 8 * K * 4 + 2 * P * B * 8 * K * 128 * 2
    sizes = [spec_bytes(v) for v in specs.values()]
    assert sizes == sorted(sizes), "smallest first, so cheap rows finish before a hang"
    assert ("raw_512MiB" in specs) != tiny
    assert all(b <= 64 * MiB for b in (spec_bytes(v) for v in message_specs(B, P, K, 64 * MiB).values()))

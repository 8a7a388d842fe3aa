"""Smoke tests of ``python -m benchmarks.kernels --tiny`` (CPU: Triton interpreter).

They check the script, not speed: the JSON rows (every kernel and variant
present, correct against its torch reference, floors and x-floor consistent,
skips carrying a reason), the JSON rewritten after every row, the budget, the
markdown table and the plot, and the ``spade bench kernels`` route."""

from __future__ import annotations

import json

import pytest

from benchmarks import kernels as KB

SHAPE = "1x67"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("kb") / "kernels.json"
    writes: list[int] = []
    real_flush = KB.Recorder.flush

    def counting_flush(self):
        real_flush(self)
        writes.append(len(json.loads(self.path.read_text())["rows"]))

    KB.Recorder.flush = counting_flush
    try:
        rc = KB.main(["--tiny", "--shapes", SHAPE, "--out", str(out)])
    finally:
        KB.Recorder.flush = real_flush
    return rc, out, json.loads(out.read_text()), writes


def test_tiny_rows(tiny_run):
    rc, out, doc, _ = tiny_run
    assert rc == 0
    assert doc["tiny"] and doc["copy_bytes_per_s"] > 0
    rows = [r for r in doc["rows"] if "skipped" not in r]
    have = {(r["op"], r["impl"]) for r in rows}
    want = {("dense_attn", i) for i in ("fused", "torch")}
    want |= {("sparse_attn", i) for i in ("fused", "single", "torch", "fused_sorted", "fused_contig",
                                          "torch_contig")}
    want |= {("gather", "triton"), ("gather", "torch"), ("quest_scores", "triton"), ("quest_scores", "torch")}
    want |= {("quest_select", i) for i in ("radix", "rowselect", "torch")}
    assert want <= have, want - have
    for r in rows:
        assert r["B"] == 1 and r["L"] == 67
        assert r["ms"] is not None and r["ms"] > 0, r
        assert r["floor_ms"] > 0 and r["x_floor"] == pytest.approx(r["ms"] / r["floor_ms"])
        if "rel_err" in r:
            assert isinstance(r["rel_err"], float) and r["rel_err"] < 1e-4, r  # fp32 on CPU
        assert r.get("exact", True) is True and r.get("selection_ok", True) is True, r
    # floors: selected K/V bytes = 2 * B * Hkv * K * D * 4 (fp32), at the measured bandwidth
    sp = next(r for r in rows if r["op"] == "sparse_attn" and r["impl"] == "fused" and r["K"] == 13)
    assert sp["floor_ms"] == pytest.approx(2 * 1 * 2 * 13 * 16 * 4 / doc["copy_bytes_per_s"] * 1e3)
    skipped = [r for r in doc["rows"] if "skipped" in r]
    assert skipped and all(r["skipped"] for r in skipped)  # the scoring rows need a GPU: a reason


def test_json_written_after_every_row(tiny_run):
    _, _, doc, writes = tiny_run
    n = len(doc["rows"])
    assert set(range(1, n + 1)) <= set(writes)  # every prefix of the rows reached the file


def test_table_and_plot(tiny_run):
    _, out, doc, _ = tiny_run
    md = out.with_suffix(".md").read_text()
    assert "### sparse_attn" in md and "| 1 | 67 | 13 |" in md
    assert doc["plot"] == str(out.with_suffix(".png"))
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_budget_and_memory_skips(tmp_path, monkeypatch):
    """A spent budget records skipped rows with the reason (no timing) and still
    writes the JSON; a shape too large for memory is skipped with the reason."""
    out = tmp_path / "k.json"
    assert KB.main(["--tiny", "--shapes", SHAPE, "--budget-s", "0", "--out", str(out), "--no-scoring"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and all("budget" in r["skipped"] for r in rows)
    monkeypatch.setattr(KB, "_free_bytes", lambda cuda, device: 2**20)
    out2 = tmp_path / "k2.json"
    assert KB.main(["--tiny", "--shapes", SHAPE, "--out", str(out2), "--no-scoring"]) == 0
    rows = json.loads(out2.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["skipped"].startswith("does not fit")


def test_sweep_rows(tmp_path, monkeypatch):
    # shortened sweep lists (the interpreter is slow); the mechanism is the same
    monkeypatch.setattr(KB, "SPLIT_SWEEP", (1, 3))
    monkeypatch.setattr(KB, "QUEST_SWEEP", KB.QUEST_SWEEP[:2] + KB.QUEST_SWEEP[-1:])
    monkeypatch.setattr(KB, "ROWSELECT_SWEEP", KB.ROWSELECT_SWEEP[:2])
    monkeypatch.setattr(KB, "ATTN_CONFIGS", KB.ATTN_CONFIGS[:2])
    out = tmp_path / "s.json"
    assert KB.main(["--tiny", "--shapes", SHAPE, "--sweep", "--iters", "1", "--out", str(out), "--no-scoring"]) == 0
    rows = json.loads(out.read_text())["rows"]
    splits = {r["impl"] for r in rows if r["op"] == "sparse_attn" and r["impl"].startswith("S")}
    assert splits == {f"S{s}_fused" for s in KB.SPLIT_SWEEP}
    cfgs = [r for r in rows if r["op"] == "quest_scores" and r["impl"].startswith("cfg_")]
    assert len(cfgs) == len(KB.QUEST_SWEEP) and all(r["ms"] for r in cfgs)
    sel = [r for r in rows if r["op"] == "quest_select" and r["impl"].startswith("cfg_rowselect")]
    assert len(sel) == len(KB.ROWSELECT_SWEEP) * len(KB.TINY["BUDGETS"]) and all(r["ms"] for r in sel)
    attn_cfgs = [r for r in rows if r["op"] == "sparse_attn" and r["impl"].startswith("cfg_bn")]
    assert len(attn_cfgs) == len(KB.ATTN_CONFIGS) and all(r["ms"] for r in attn_cfgs)
    md = out.with_suffix(".md").read_text()
    assert "### sweeps" in md and "| S1_fused ms" not in md  # sweeps summarised, not main-table columns


def test_cli_routes_to_this_benchmark(tmp_path):
    from spade import cli

    assert cli.BENCHES["kernels"] == ["benchmarks.kernels"]
    out = tmp_path / "c.json"
    assert cli.main(["bench", "kernels", "--tiny", "--budget-s", "0", "--out", str(out), "--no-scoring"]) == 0
    assert json.loads(out.read_text())["tiny"]


def _fake_scoring(tmp_path, body: str):
    """A stand-in ``benchmarks.bench_scoring`` module written to a file (run_scoring
    reads its source to learn which flags it takes)."""
    import importlib.util

    src = tmp_path / "fake_scoring.py"
    src.write_text(body)
    spec = importlib.util.spec_from_file_location("benchmarks.bench_scoring", src)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_scoring_rows_folded_in(tmp_path, monkeypatch):
    import benchmarks

    mod = _fake_scoring(tmp_path, '''
import json
CALLS = []
def main(argv):
    CALLS.append(list(argv))
    ap_flags = ["--full", "--out", "--budget-s"]  # "--full" "--budget-s"
    out = argv[argv.index("--out") + 1]
    json.dump(dict(rows=[dict(op="score_topk", impl="triton", B=8, L=32768, K=2048, ms=0.2, floor_ms=0.1,
                               x_floor=2.0)]), open(out, "w"))
    return 0
''')
    monkeypatch.setitem(__import__("sys").modules, "benchmarks.bench_scoring", mod)
    monkeypatch.setattr(benchmarks, "bench_scoring", mod, raising=False)
    rec = KB.Recorder(tmp_path / "r.json", {}, budget_s=1000)
    KB.run_scoring(rec, tmp_path, sweep=False)
    argv = mod.CALLS[0]
    assert "--full" in argv and "--budget-s" in argv and "--sweep" not in argv
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["rows"][0]["op"] == "scoring:score_topk" and doc["rows"][0]["x_floor"] == 2.0
    assert doc["scoring_rc"] == 0


def test_scoring_failure_is_a_skip_row(tmp_path, monkeypatch):
    import benchmarks

    mod = _fake_scoring(tmp_path, "def main(argv):\n    raise SystemExit(2)\n")
    monkeypatch.setitem(__import__("sys").modules, "benchmarks.bench_scoring", mod)
    monkeypatch.setattr(benchmarks, "bench_scoring", mod, raising=False)
    rec = KB.Recorder(tmp_path / "r.json", {}, budget_s=1000)
    KB.run_scoring(rec, tmp_path, sweep=True)
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert len(rows) == 1 and "bench_scoring failed" in rows[0]["skipped"]

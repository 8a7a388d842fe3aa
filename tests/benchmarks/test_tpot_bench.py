"""``benchmarks.bench_tpot`` CPU smoke run and ``benchmarks.trace_summary`` on a hand-made trace."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

from benchmarks.trace_summary import format_summary, summarize_trace

#: the benchmark subprocesses on one torch thread, like the tests' own process (small ops on
#: a shared 2-core box); what they measure is not compared with anything here
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def _k(name, ts, dur, dev=0, stream=7, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"device": dev, "stream": stream}}


def test_trace_summary_busy_idle_and_gaps(tmp_path):
    ev = [
        _k("gemm", 0, 10), _k("attn", 5, 10, stream=8),  # overlapping streams: busy 0-15
        _k("ncclDevKernel_SendRecv", 15, 5, stream=9),  # comm: busy, not compute
        _k("Memcpy DtoD", 50, 10, cat="gpu_memcpy"),  # 30 us gap before it
        _k("gemm", 61, 9),  # 1 us gap: under min_gap_us
        _k("gemm", 0, 40, dev=1),  # second device, no gaps
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},  # host events are ignored
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 3},
    ]
    p = tmp_path / "t.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    s = summarize_trace(p, steps=2)
    d0, d1 = s["devices"][0], s["devices"][1]
    assert d0["span_ms"] == pytest.approx(0.070)
    assert d0["busy_ms"] == pytest.approx(0.039)  # 0-20, 50-60, 61-70
    assert d0["compute_ms"] == pytest.approx(0.034)  # without the NCCL kernel's 5 us
    assert d0["idle_ms"] == pytest.approx(0.031)
    assert d0["per_step"]["idle_ms"] == pytest.approx(0.0155)
    assert d0["gaps_over_min"] == 1
    assert d0["largest_gaps"] == [{"us": 30.0, "before": "ncclDevKernel_SendRecv", "after": "Memcpy DtoD"}]
    assert d1["busy_fraction"] == 1.0 and d1["largest_gaps"] == []
    text = format_summary(s)
    assert "cuda:0" in text and "gap     30.0 us" in text
    with pytest.raises(ValueError, match="steps"):
        summarize_trace(p, steps=0)


def test_trace_compare_splits_a_streams_excess(tmp_path, capsys):
    """``--compare``: each trace's busiest stream on device 0 (not the side stream, not device
    1), its span per step split into kernel time by name and the time between kernels by
    pair (negative: an overlapped launch), and B's excess over A by both."""
    from benchmarks.trace_summary import compare_streams, main, stream_account

    a_ev = [_k("norm", 0, 10), _k("gemv", 8, 30), _k("attn", 40, 20),  # overlap -2, gap +2
            _k("score", 0, 5, stream=9), _k("gemv", 0, 500, dev=1)]
    b_ev = [_k("norm", 0, 10), _k("gemv", 12, 40), _k("attn", 60, 25),  # gaps +2, +8
            _k("score", 0, 30, stream=9), _k("select", 30, 20, stream=9)]
    paths = []
    for name, ev in (("a", a_ev), ("b", b_ev)):
        paths.append(tmp_path / f"{name}.json.gz")
        with gzip.open(paths[-1], "wt") as f:
            json.dump({"traceEvents": ev}, f)
    sa, sb = stream_account(paths[0], 2), stream_account(paths[1], 2)
    assert sa["stream"] == sb["stream"] == 7 and sa["events"] == 3
    assert sa["span_ms"] == pytest.approx(0.030) and sa["kernel_ms"] == pytest.approx(0.030)
    assert sa["between_ms"] == pytest.approx(0.0)  # -2 us and +2 us
    assert sa["between_pairs_ms"] == {"gemv -> attn": pytest.approx(0.001), "norm -> gemv": pytest.approx(-0.001)}
    assert sb["span_ms"] == pytest.approx(0.0425) and sb["between_ms"] == pytest.approx(0.005)
    assert stream_account(paths[1], 2, stream=9)["kernels_ms"] == {"score": 0.015, "select": 0.010}
    c = compare_streams(sa, sb)
    assert c["span_ms"][2] == pytest.approx(0.0125)
    assert c["kernel_ms"][2] == pytest.approx(0.0075) and c["between_ms"][2] == pytest.approx(0.005)
    assert dict(c["kernels"]) == {"gemv": pytest.approx(0.005), "attn": pytest.approx(0.0025)}
    assert dict(c["between_pairs"]) == {"gemv -> attn": pytest.approx(0.003), "norm -> gemv": pytest.approx(0.002)}
    assert main([str(paths[0]), "--steps", "2", "--compare", str(paths[1])]) == 0
    out = capsys.readouterr().out
    assert "span        0.030 ->    0.043  (+0.013)" in out and "+0.003  gemv -> attn" in out
    with pytest.raises(SystemExit):
        main([str(paths[0]), "--steps", "2", "--compare", str(paths[1]), "--stream", "3"])
    assert "no stream 3" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no device events of device 1"):
        stream_account(paths[1], 2, device=1)


def _run_tiny(tmp_path, *args: str) -> tuple[dict, str]:
    """``bench_tpot`` on the tiny preset on the CPU (B=2, L=256, K=64, 3 timed steps, P=2)
    with ``args``: the first shape's config and the printed output."""
    out = tmp_path / "bench_tpot.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_tpot", "--device", "cpu", "--preset", "tiny", "--batch", "2",
           "--context", "256", "--budget", "64", "--iters", "3", "--warmup", "1", "--recent", "8", "--window", "4",
           "--packs", "2", "--linear", "cublas", "--no-plots", *args, "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(out.read_text())["configs"][0], r.stdout


def test_bench_tpot_cpu_smoke(tmp_path):
    conf, stdout = _run_tiny(tmp_path, "--methods", "optimal,asyncspade/local", "--profile-rows", "local_P2_exact",
                             "--select-overlap", "off,on")
    # --select-overlap off,on: the cache rank's rows again under the second mode (a no-op on a
    # CPU), with its own Table 3; the rows without a cache rank only once
    assert set(conf["rows"]) == {"optimal", "asyncspade/local/P=2", "asyncspade/local/P=2/sov=on"}
    assert conf["overlap_sov=on"][0]["cache_ms_per_pack_runtime"] > 0
    assert not conf["errors"]  # the layer timings (Fig. 2 / Table 3) ran too
    assert conf["layer_ms"]["select_asyncspade_pack2_graph_ms"] > 0
    row = conf["rows"]["asyncspade/local/P=2"]
    assert row["tpot_ms"] > 0 and row["steps"] == 3 and "host_ms_per_step" in row
    ch = row["cache_host"]  # the cache rank's account, sent with the END acknowledgement
    assert ch["packs"] >= 3 * 2 and ch["selections"] >= 1 and ch["host_ms_per_pack"] > 0
    assert row["timeline"]["steps"] == 4  # profiled (CPU: no device activity to summarise)
    assert "timeline" not in conf["rows"]["optimal"]
    assert (tmp_path / "profile_local_P2_exact_B2_L256_K64.json.gz").exists()
    assert conf["linear_kernels"] == {k: "cublas" for k in ("qkv", "o", "gate_up", "down", "lm_head")}
    ov = conf["overlap"][0]  # Table 3, printed as it is written
    ratio = ov["cache_ms_per_pack_runtime"] / ov["inference_ms_per_pack"]
    assert f"Table 3, P=2: inference {ov['inference_ms_per_pack']:.3f} ms per pack; cache rank exact " \
           f"{ov['cache_ms_per_pack_runtime']:.3f} ({ratio:.2f}x)" in stdout


def test_bench_tpot_refresh_every_rows(tmp_path):
    """``--refresh-every 1,2``: the asyncspade rows again with a selection every 2 steps
    (suffix /r=2), inline and on the cache rank; the rows without a selection once; each row's
    mean next to its median, a refresh row warmed past its graph captures."""
    conf, _ = _run_tiny(tmp_path, "--methods", "optimal,asyncspade/inline,asyncspade/colocated",
                        "--refresh-every", "1,2")
    assert set(conf["rows"]) == {"optimal", "asyncspade/inline", "asyncspade/inline/r=2", "asyncspade/colocated/P=2",
                                 "asyncspade/colocated/P=2/r=2"}
    assert all(row["tpot_ms"] > 0 for row in conf["rows"].values())
    assert conf["rows"]["asyncspade/colocated/P=2/r=2"]["late_packs"] == 0
    assert all(row["mean_ms"] > 0 and row["steps"] == 3 for row in conf["rows"].values())


def test_bench_tpot_score_pack_rows(tmp_path):
    """``--score-pack 4,1``: every row again with one int4 token per MMA row (suffix
    /pack=1), the first value's rows unsuffixed."""
    conf, _ = _run_tiny(tmp_path, "--methods", "optimal,asyncspade/colocated", "--score-keys", "int4",
                        "--score-pack", "4,1")
    assert set(conf["rows"]) == {"optimal", "asyncspade/colocated/P=2/int4", "optimal/pack=1",
                                 "asyncspade/colocated/P=2/int4/pack=1"}
    assert all(row["tpot_ms"] > 0 for row in conf["rows"].values()) and not conf["errors"]


def test_bench_tpot_carry_store_rows(tmp_path):
    """``--carry-store mark,compact``: the rows with a top-K again with the threshold carry's
    scores stored compacted (suffix /store=compact); the rows without one once."""
    conf, _ = _run_tiny(tmp_path, "--methods", "optimal,asyncspade/colocated", "--score-keys", "int4",
                        "--carry-store", "mark,compact")
    assert set(conf["rows"]) == {"optimal", "asyncspade/colocated/P=2/int4",
                                 "asyncspade/colocated/P=2/int4/store=compact"}
    assert all(row["tpot_ms"] > 0 for row in conf["rows"].values()) and not conf["errors"]


def test_bench_tpot_carry_store_sets_the_select_config():
    """``set_carry_store``: compact / mark set ``SELECT_CONFIG["carry_compact"]`` (what
    ``scoring.carry_store`` reads), the library's default clears it; only a later mode's rows
    are suffixed; the flag takes each of mark, compact once."""
    from benchmarks.bench_tpot import parse_args, set_carry_store
    from spade.kernels import radix_topk

    a = parse_args(["--carry-store", "mark, compact"])
    assert a.carry_store == ["mark", "compact"] and parse_args([]).carry_store == [""]
    try:
        set_carry_store("compact", a)
        assert radix_topk.SELECT_CONFIG["carry_compact"] is True and a.cur_store_sfx == "/store=compact"
        set_carry_store("mark", a)
        assert radix_topk.SELECT_CONFIG["carry_compact"] is False and a.cur_store_sfx == ""
    finally:
        set_carry_store("", parse_args([]))
    assert "carry_compact" not in radix_topk.SELECT_CONFIG
    for bad in ("dense", "mark,mark"):
        with pytest.raises(SystemExit):
            parse_args(["--carry-store", bad])


def test_bench_tpot_table3_with_channel_subsets_only(tmp_path):
    """``--score-channels 8`` alone (no all-channel rows): the layer timings and Table 3 run,
    based on the rows' own variant (exact keys on 8 channels), the int4 copy's beside it."""
    conf, stdout = _run_tiny(tmp_path, "--methods", "optimal,asyncspade/colocated", "--score-keys", "int4",
                             "--score-channels", "8")
    assert not conf["errors"], conf["errors"]
    (row,) = conf["overlap"]
    assert row["cache_variant"] == "asyncspade_c8" and row["cache_ms_per_pack"] > 0
    assert row["cache_ms_per_pack_runtime"] > 0 and row["cache_ms_per_pack_runtime_int4_c8"] > 0
    assert "cache_ms_per_pack_c8" not in row  # the base is not listed again as a variant
    assert "Table 3, P=2" in stdout and "c8 " in stdout and "int4_c8 " in stdout


def test_bench_tpot_score_tile_sets_the_scoring_launch():
    """``--score-tile``: a spec overrides the scoring kernel's launch tile for the rows after
    it (what ``_gemv_config`` resolves), ``default`` takes the override back, and the later
    value's rows carry its suffix."""
    import torch
    from benchmarks.bench_tpot import parse_args, set_score_tile
    from spade.kernels import scoring

    a = parse_args(["--score-tile", "default,256:2:3:4"])
    k = torch.zeros(1, 1, 64, 16, dtype=torch.uint8)
    base = scoring._gemv_config(k)
    try:
        set_score_tile("256:2:3:4", a)
        cfg = scoring._gemv_config(k)
        assert (cfg["BLOCK_L"], cfg["num_warps"], cfg["num_stages"], cfg["PER_SM"]) == (256, 2, 3, 4)
        assert a.cur_tile_sfx == "/tile=256:2:3:4"
        set_score_tile("default", a)
        assert scoring._gemv_config(k) == base and a.cur_tile_sfx == ""
    finally:
        set_score_tile("default", a)


def test_bench_tpot_config_defaults_and_flags(tmp_path, capsys):
    """``spade bench tpot --config X``: the config's preset, policy speed settings and bench
    section become the defaults; flags win; a real-weights model is refused by name."""
    from benchmarks.bench_tpot import config_defaults, parse_args

    d = config_defaults("configs/h200x2_qwen3_8b.yaml")
    assert d["preset"] == "qwen3-8b" and d["score_keys"] == "int4" and d["group_reduce"] == "sum_logits"
    assert d["batch"] == [1, 8, 16, 32] and d["packs"] == [2, 4, 6, 12] and "asyncspade/local" in d["methods"]
    a = parse_args(["--config", "configs/h200x2_qwen3_8b.yaml", "--batch", "8", "--iters", "3"])
    assert a.batch == [8] and a.iters == 3 and a.context == [16384, 32768, 65536] and a.score_keys == ["int4"]
    assert parse_args(["--pdl", "auto, OFF"]).pdl == ["auto", "off"] and parse_args([]).pdl == [""]
    assert a.topk == [""] and parse_args(["--topk", "radix, carry"]).topk == ["radix", "carry"]
    assert a.sov == [""] and parse_args(["--select-overlap", "off, ON"]).sov == ["off", "on"]
    with pytest.raises(SystemExit):
        parse_args(["--select-overlap", "yes"])
    assert a.refresh_every == [1] and parse_args(["--refresh-every", "1, 4"]).refresh_every == [1, 4]
    assert a.score_pack == [0] and parse_args(["--score-pack", "4,1"]).score_pack == [4, 1]
    for bad in ("2", "0", "8", "four"):
        with pytest.raises(SystemExit):
            parse_args(["--score-pack", bad])
    assert a.score_tile == ["default"]
    assert parse_args(["--score-tile", "default, 512:4:3:4"]).score_tile == ["default", "512:4:3:4"]
    for bad in ("512:4", "512:4:3:4:1", "512:0:3", "a:b:c", "default,512:4:3,default"):
        with pytest.raises(SystemExit):
            parse_args(["--score-tile", bad])
    from benchmarks.bench_tpot import warmup_steps

    w = parse_args(["--warmup", "3"])
    assert warmup_steps(w) == 3
    w.cur_refresh = 4  # a refresh row: its refresh key's second call (the capture) falls in the warm-up
    assert warmup_steps(w) == 9
    for bad in ("0", "two", "65"):
        with pytest.raises(SystemExit):
            parse_args(["--refresh-every", bad])
    with pytest.raises(SystemExit):
        parse_args(["--topk", "sort"])
    with pytest.raises(SystemExit):
        parse_args(["--pdl", "on"])
    capsys.readouterr()
    with pytest.raises(SystemExit):  # the sinks and the recent window do not fit the budget: refused before any row
        parse_args(["--budget", "2048,32", "--sink", "4", "--recent", "64"])
    assert "--budget 32: smaller than --sink 4 + --recent 64" in capsys.readouterr().err
    assert parse_args(["--budget", "68", "--sink", "4", "--recent", "64"]).budget == [68]
    with pytest.raises(SystemExit, match="smollm2-135m.*not a random-weight shape preset"):
        config_defaults("configs/cpu_tiny.yaml")
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(f"""
model: {{name: tiny, dtype: float32}}
policy: {{name: asyncspade, budget: 64, sink_tokens: 4, recent_tokens: 8, window: 4}}
bench:
  out_dir: {tmp_path}/out
  iters: 3
  warmup: 1
  batch_sizes: [2]
  context_lengths: [256]
  budgets: [64]
  pack_layers: [2]
  policies: [full, optimal]
""")
    r = subprocess.run([sys.executable, "-m", "spade.cli", "bench", "tpot", "--config", str(cfg), "--device", "cpu",
                        "--no-plots", "--pdl", "off,auto"], capture_output=True, text=True, timeout=600, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "out" / "bench_tpot.json").read_text())
    assert res["meta"]["preset"] == "tiny" and res["meta"]["recent"] == 8
    # --pdl off,auto: every row under each mode, the later one suffixed
    assert set(res["configs"][0]["rows"]) == {"full", "optimal", "full/pdl=auto", "optimal/pdl=auto"}


def test_breakdown_amortises_selection_over_refresh_steps():
    """Fig. 2's selection bar of an inline row that selects every N steps (``/r=N``) is the
    per-step selection cost over N; rows off the critical path carry none."""
    from benchmarks.bench_tpot import breakdown

    rows = {n: {"tpot_ms": t} for n, t in [("optimal", 5.0), ("full", 13.0), ("asyncspade/inline/int4", 9.0),
                                            ("asyncspade/inline/int4/r=4", 6.0), ("asyncspade/local/P=4/int4", 5.1)]}
    lt = {"attention_sparse_ms": 0.02, "attention_dense_ms": 0.25, "select_asyncspade_int4_ms": 0.1}
    bd = breakdown(rows, lt, n_layers=10)
    assert bd["asyncspade/inline/int4"]["selection_ms"] == pytest.approx(1.0)
    assert bd["asyncspade/inline/int4/r=4"]["selection_ms"] == pytest.approx(0.25)
    assert bd["asyncspade/local/P=4/int4"]["selection_ms"] == 0.0
    assert bd["optimal"]["parameters_ms"] == pytest.approx(4.8) and bd["full"]["attention_ms"] == pytest.approx(2.5)


def test_bench_tpot_rerank_rows_and_overrides(monkeypatch):
    """``--rerank 1,2``: every asyncspade row again with ``policy.rerank=2`` (named ``/m=2``),
    the other methods once; bad values are refused. (The rows' runs are replaced by a
    record of the policy overrides they would run with.)"""
    from benchmarks import bench_tpot as bt

    a = bt.parse_args(["--methods", "optimal,asyncspade/inline,asyncspade/colocated", "--packs", "2",
                       "--rerank", "1,2", "--refresh-every", "1,3"])
    ran = {}
    monkeypatch.setattr(bt, "run_inline", lambda model, m, *rest: bt.policy_overrides("asyncspade", 64, a))
    monkeypatch.setattr(bt, "run_async", lambda *rest: bt.policy_overrides("asyncspade", 64, a))
    bt.rows_for_budget(None, 2, 256, 64, a, {}, False, lambda name, fn: ran.setdefault(name, fn()))
    assert list(ran) == ["asyncspade/inline", "optimal", "asyncspade/inline/r=3", "asyncspade/inline/m=2",
                         "asyncspade/inline/r=3/m=2", "asyncspade/colocated/P=2", "asyncspade/colocated/P=2/r=3",
                         "asyncspade/colocated/P=2/m=2", "asyncspade/colocated/P=2/r=3/m=2"]
    for name, ov in ran.items():
        if name.startswith("asyncspade"):
            assert ("policy.rerank=2" in ov) == name.endswith("/m=2")
            assert ("policy.refresh_every=3" in ov) == ("/r=3" in name)
    with pytest.raises(SystemExit):
        bt.parse_args(["--rerank", "0"])

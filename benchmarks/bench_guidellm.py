"""A request-rate sweep of `spade serve` by guidellm, the load generator from PyPI.

`benchmarks/bench_serve.py` drives the server with our own script on the `openai`
client; this drives it with guidellm (vLLM project), which nobody here wrote: its
OpenAI HTTP backend streams chat completions of synthetic text (`prompt_tokens`,
`output_tokens` by its tokenizer, `ignore_eos`), Poisson arrivals at each rate. Per
policy this starts one `spade serve` (`bench_serve.Server`), warms it up as
`bench_serve` does, runs guidellm's `synchronous` profile (one request at a time: the
idle TTFT and TPOT the SLO is relative to), then its `poisson` profile at `--rates`,
and reads guidellm's JSON into `bench_serve`'s rows, SLO lines and plot. TPOT here is
guidellm's inter-token latency (first token excluded, as `bench_serve`'s TPOT);
guidellm's own TPOT (first token included) is kept as `guidellm_tpot_*`.

guidellm runs from its own environment (it brings datasets, pandas, sanic and more; left unpinned, pip
resolves a newer torch for it than spade's), torch pinned there to the CPU wheel:

    python -m venv .venv-guidellm && .venv-guidellm/bin/pip install torch==2.13.0 guidellm==0.8.1
    python -m benchmarks.bench_guidellm --guidellm .venv-guidellm/bin/guidellm --config configs/cpu_serve.yaml \\
        --rates 0.5,1 --num-prompts 10 --input-len 64 --output-len 16 --out results/bench_guidellm.json

Its tokenizer: the served model's (an offline model's converted folder), or for a
random-weight preset, which reads text as UTF-8 bytes, a byte-level tokenizer written
beside the report (one token per byte, as the server counts). guidellm runs with one
worker process (`GUIDELLM__MAX_WORKER_PROCESSES=1`: with several, 0.8.1 sent its first
Poisson benchmark's requests at once) and offline (no Hub access).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import bench_serve

def byte_tokenizer(folder: Path) -> Path:
    """A Hugging Face tokenizer folder whose tokens are the UTF-8 bytes of the text (256
    ids, no special tokens): what `spade serve` counts for a model without a tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    folder.mkdir(parents=True, exist_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(folder))
    return folder


def model_tokenizer(config: str | None, sets: list[str], out_dir: Path) -> Path:
    """The tokenizer folder guidellm counts tokens with: the served model's converted
    folder when it is an offline model, else a byte-level one (a random-weight preset)."""
    import spade
    from spade.models.registry import OFFLINE, cache_dir

    name = spade.load_config(config, overrides=list(sets)).model.name
    if name in OFFLINE and (cache_dir() / "hf" / name / "tokenizer.json").is_file():
        return cache_dir() / "hf" / name
    return byte_tokenizer(out_dir / "byte_tokenizer")


def guidellm_command(exe: str, target: str, model: str, profile: list[str], requests: int, input_len: int,
                     output_len: int, tokenizer: Path, out_json: Path) -> list[str]:
    """``exe``: guidellm's command, e.g. ``.venv-guidellm/bin/guidellm`` or ``python3 -m guidellm``."""
    return [*shlex.split(exe), "run", "--backend", f"kind=openai_http,target={target},model={model}", *profile,
            "--constraint", f"kind=max_requests,count={requests}",
            "--data", f"kind=synthetic_text,prompt_tokens={input_len},output_tokens={output_len}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
            "--output", f"kind=json,path={out_json}", "--disable-console-interactive"]


def guidellm_env() -> dict[str, str]:
    return {**os.environ, "GUIDELLM__MAX_WORKER_PROCESSES": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _pct(metrics: dict, name: str, q: str, scale: float = 1.0) -> float | None:
    p = (((metrics.get(name) or {}).get("successful") or {}).get("percentiles") or {}).get(q)
    return None if p is None else p * scale


def read_report(path: Path) -> list[dict]:
    """guidellm's JSON report -> one `bench_serve`-style row per benchmark (rate or profile)."""
    rep = json.loads(Path(path).read_text())
    rows = []
    for b in rep["benchmarks"]:
        strat = b["config"]["strategy"]
        m, st = b["metrics"], b["scheduler_state"]
        ok, bad = st.get("successful_requests", 0), st.get("errored_requests", 0) + st.get("cancelled_requests", 0)
        out_tok = ((m.get("output_tokens_per_second") or {}).get("successful") or {}).get("mean")
        req_s = ((m.get("requests_per_second") or {}).get("successful") or {}).get("mean")
        rows.append({
            "profile": strat.get("type_"), "rate": strat.get("rate"), "requests": ok + bad, "completed": ok,
            "failed": bad, "errors": sorted({str(r.get("error"))[:200] for r in b["requests"].get("errored", [])})[:5],
            "wall_s": b.get("duration"), "output_tok_per_s": out_tok, "req_per_s": req_s,
            "ttft_p50_ms": _pct(m, "time_to_first_token_ms", "p50"), "ttft_p99_ms": _pct(m, "time_to_first_token_ms", "p99"),
            "tpot_p50_ms": _pct(m, "inter_token_latency_ms", "p50"), "tpot_p99_ms": _pct(m, "inter_token_latency_ms", "p99"),
            "e2e_p50_ms": _pct(m, "request_latency", "p50", 1e3), "e2e_p99_ms": _pct(m, "request_latency", "p99", 1e3),
            "guidellm_tpot_p50_ms": _pct(m, "time_per_output_token_ms", "p50"),
            "guidellm_tpot_p99_ms": _pct(m, "time_per_output_token_ms", "p99"),
            "warnings": [w.get("message", "")[:200] for w in b.get("warnings") or []],
        })
    return rows


def run_guidellm(cmd: list[str], log: Path, timeout_s: float) -> None:
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=guidellm_env(), timeout=timeout_s)
    if p.returncode != 0:
        raise RuntimeError(f"guidellm exited {p.returncode} (log: {log}):\n{log.read_text()[-3000:]}")


def guidellm_version(exe: str) -> str:
    p = subprocess.run([*shlex.split(exe), "--version"], capture_output=True, text=True, env=guidellm_env(), timeout=120)
    if p.returncode != 0:
        return f"unknown (rc {p.returncode})"
    return (p.stdout or p.stderr).strip().splitlines()[-1].removeprefix("guidellm version:").strip()  # "0.8.1"


def sweep(args, url: str, label: str | None, tokenizer: Path, out: Path) -> dict:
    info = bench_serve.server_info(url + "/v1", args.api_key)
    label = label or info.get("policy") or "server"
    n_warm, warm_len = bench_serve.warmup_plan(args, info)
    if n_warm:  # graphs and kernels made before anything is timed, as bench_serve does
        import asyncio

        prompts = bench_serve.make_prompts(n_warm, args.input_len, args.seed)
        asyncio.run(bench_serve.run_rate(url + "/v1", args.api_key, info["id"], prompts, warm_len, math.inf,
                                         args.seed, None))
    log, runs = out.with_name(f"{out.stem}.{label}.guidellm.log"), {}
    for kind, profile, n in (("idle", ["--profile", "kind=synchronous"], args.idle_requests),
                             ("rates", ["--profile", f"kind=poisson,rate={args.rates[0]}"]
                              + (["--override", "profile.rate", ",".join(map(str, args.rates))]
                                 if len(args.rates) > 1 else []), args.num_prompts)):
        if kind == "idle" and n <= 0:
            continue
        path = out.with_name(f"{out.stem}.{label}.{kind}.guidellm.json")
        cmd = guidellm_command(args.guidellm, url, info["id"], profile, n, args.input_len, args.output_len,
                               tokenizer, path)
        run_guidellm(cmd, log, args.timeout_s)
        runs[kind] = {"command": cmd, "json": str(path), "rows": read_report(path)}
    idle = runs.get("idle", {}).get("rows", [{}])[0]
    rows = [dict(r, policy=label) for r in runs["rates"]["rows"]]
    for r in rows:
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()
                          if k not in ("errors", "warnings")}), flush=True)
    idle_tpot, idle_ttft = idle.get("tpot_p50_ms"), idle.get("ttft_p50_ms")
    return {"label": label, "server": info, "idle_tpot_ms": idle_tpot, "idle_ttft_ms": idle_ttft,
            "slo_factor": args.slo_factor, "ttft_factor": args.ttft_factor,
            "slo": bench_serve.slo_rate(rows, idle_tpot, args.slo_factor, idle_ttft, args.ttft_factor),
            "rows": rows, "idle": idle, "guidellm": {k: {"command": v["command"], "json": v["json"]}
                                                      for k, v in runs.items()}}


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_guidellm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", "-c", required=True, help="start `spade serve --config X` (one per --policies entry)")
    ap.add_argument("--set", action="append", default=[], help="config override for the server (repeatable)")
    ap.add_argument("--policies", default="", help="comma list: one server per policy; default: the config's")
    ap.add_argument("--guidellm", default="guidellm",
                    help="guidellm's command (its own environment), e.g. .venv-guidellm/bin/guidellm or "
                         "'python3 -m guidellm' where it is importable")
    ap.add_argument("--tokenizer", help="tokenizer folder for guidellm's token counts (default: the served model's, "
                                        "or byte-level for a model without one)")
    ap.add_argument("--rates", default="0.5,1", help="comma list of Poisson request rates (req/s)")
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per rate (guidellm's max_requests)")
    ap.add_argument("--idle-requests", type=int, default=3, help="requests of the synchronous (idle) run; 0: none")
    ap.add_argument("--input-len", type=int, default=1024, help="prompt tokens (guidellm's synthetic text)")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens (ignore_eos)")
    ap.add_argument("--warmup", type=int, default=-1, help="as bench_serve's --warmup")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo-factor", type=float, default=2.0, help="the SLO: TPOT p99 <= this x the idle TPOT")
    ap.add_argument("--ttft-factor", type=float, default=5.0, help="sustained: TTFT p99 <= this x the idle TTFT; 0: off")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"))
    ap.add_argument("--start-timeout-s", type=float, default=600)
    ap.add_argument("--timeout-s", type=float, default=3600, help="per guidellm invocation")
    ap.add_argument("--out", default="results/bench_guidellm.json")
    args = ap.parse_args(argv)
    try:
        args.rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        ap.error(f"--rates: a comma list of numbers, got {args.rates!r}")
    if not args.rates or any(not (r > 0 and math.isfinite(r)) for r in args.rates):
        ap.error(f"--rates: every rate is a finite number > 0, got {args.rates}")
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = Path(args.tokenizer) if args.tokenizer else model_tokenizer(args.config, args.set, out.parent)
    version = guidellm_version(args.guidellm)
    runs = []
    for pol in [p.strip() for p in args.policies.split(",") if p.strip()] or [None]:
        sets = list(args.set) + ([f"policy.name={pol}"] if pol else [])
        srv = bench_serve.Server(args.config, sets, out.with_name(f"{out.stem}.{pol or 'server'}.log"),
                                 args.start_timeout_s)
        try:
            run = sweep(args, srv.url.removesuffix("/v1").rstrip("/"), pol, tokenizer, out)
        finally:
            rc = srv.stop()
        run["server_exit_code"] = rc
        runs.append(run)
    report = {"bench": "guidellm", "load_generator": f"guidellm {version}",
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
              "command": " ".join(["python -m benchmarks.bench_guidellm", *(argv if argv is not None else sys.argv[1:])]),
              "config": {k: v for k, v in vars(args).items() if k != "api_key"}, "tokenizer": str(tokenizer),
              "runs": runs}
    out.write_text(json.dumps(report, indent=2))
    png = out.with_suffix(".png")
    srv0 = runs[0]["server"] if runs else {}
    bench_serve.plot(runs, png, f"spade serve driven by guidellm {version}, {srv0.get('model', '?')} "
                                f"({srv0.get('topology', '?')}), input {args.input_len} / output {args.output_len} "
                                f"tokens, {args.num_prompts} requests per rate")
    print("\n".join(bench_serve.slo_lines(runs)))
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

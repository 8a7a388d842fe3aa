"""Serving load: a request-rate sweep against an OpenAI-compatible server (``spade serve``).

    # a server already running
    python -m benchmarks.bench_serve --base-url http://127.0.0.1:8000/v1 --rates 1,2,4,inf
    # or let the benchmark start one `spade serve` per policy (stopped with SIGTERM after)
    python -m benchmarks.bench_serve --config configs/h100_qwen3_8b.yaml --policies full,quest,asyncspade \\
        --input-len 16384 --output-len 256 --num-prompts 64 --rates 0.25,0.5,1,2,inf
    # CPU smoke test (~1 min): the tiny random-weight preset
    python -m benchmarks.bench_serve --config configs/cpu_tiny.yaml --set model.name=tiny \\
        --num-prompts 6 --input-len 32 --output-len 8 --rates 2,inf --out /tmp/bench_serve.json

The load generator is the official ``openai`` async client: each request streams a
completion (``stream_options.include_usage``) with a prompt of ``--input-len`` random
token ids and ``max_tokens = --output-len`` with ``ignore_eos`` (fixed output lengths).
Arrivals are a Poisson process of ``rate`` requests/s (``inf``: all at once), with a
fixed seed: every rate and policy sends the same prompts in the same order.

Per rate: TTFT (send to the first streamed token), TPOT ((last token - first token) /
(output tokens - 1)), end-to-end latency, each p50/p99 in ms; output tokens/s and
requests/s over the wall time of the rate's run (first send to last finish); failed
requests. ``--out`` gets the JSON (config, the server's /v1/models metadata, rows);
``--plot`` (default: beside ``--out``) a PNG: TTFT and TPOT p50/p99 and output tokens/s
against the offered rate, one line per policy; ``--plot-from A.json B.json --plot X.png``
draws several reports (one run per policy) in one figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def make_prompts(n: int, length: int, seed: int, lo: int = 10, hi: int = 500) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids in [lo, hi): inside every vocabulary spade
    serves (the tiny preset has 512 ids), clear of the low special ids."""
    rng = random.Random(seed)
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


async def one_request(client, model: str, prompt: list[int], output_len: int, t_send: float) -> dict:
    first = last = None
    n_out = 0
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=output_len, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for ch in stream:
            now = time.perf_counter()
            if ch.choices and (ch.choices[0].text or ch.choices[0].finish_reason is None):
                if first is None:
                    first = now
                last = now
            if ch.usage is not None:
                n_out = ch.usage.completion_tokens
    except Exception as e:  # a refused (429) or failed request counts, it does not stop the run
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:300], "t_send": t_send}
    end = time.perf_counter()
    if first is None:
        return {"ok": False, "error": "no token streamed", "t_send": t_send}
    return {"ok": True, "t_send": t_send, "t_end": end, "ttft_s": first - t_send, "e2e_s": end - t_send,
            "tpot_s": (last - first) / (n_out - 1) if n_out > 1 else None, "output_tokens": n_out}


async def run_rate(base_url: str, api_key: str, model: str, prompts: list[list[int]], output_len: int,
                   rate: float, seed: int, max_concurrency: int | None) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=3600)
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def send(p):
        t = time.perf_counter()
        if sem is None:
            return await one_request(client, model, p, output_len, t)
        async with sem:
            return await one_request(client, model, p, output_len, t)

    t0 = time.perf_counter()
    tasks = []
    for p in prompts:
        tasks.append(asyncio.ensure_future(send(p)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
    res = await asyncio.gather(*tasks)
    await client.close()
    ok = [r for r in res if r["ok"]]
    wall = (max(r["t_end"] for r in ok) - t0) if ok else None
    out_tok = sum(r["output_tokens"] for r in ok)

    def ms(key, q):
        v = percentile([r[key] for r in ok if r.get(key) is not None], q)
        return None if v is None else v * 1e3

    return {
        "rate": rate if math.isfinite(rate) else "inf", "requests": len(res), "completed": len(ok),
        "failed": len(res) - len(ok), "errors": sorted({r["error"] for r in res if not r["ok"]})[:5],
        "wall_s": wall, "output_tokens": out_tok,
        "output_tok_per_s": out_tok / wall if wall else None,
        "req_per_s": len(ok) / wall if wall else None,
        "ttft_p50_ms": ms("ttft_s", 0.5), "ttft_p99_ms": ms("ttft_s", 0.99),
        "tpot_p50_ms": ms("tpot_s", 0.5), "tpot_p99_ms": ms("tpot_s", 0.99),
        "e2e_p50_ms": ms("e2e_s", 0.5), "e2e_p99_ms": ms("e2e_s", 0.99),
        "tpot_mean_ms": (statistics.fmean([r["tpot_s"] for r in ok if r["tpot_s"] is not None]) * 1e3
                         if any(r["tpot_s"] is not None for r in ok) else None),
    }


class Server:
    """``spade serve --config X --port 0`` in a subprocess; its output goes to ``log``.
    ``url`` is where it listens once the constructor returns. ``env``: variables to
    set (None: to unset) for the server."""

    def __init__(self, config: str, sets: list[str], log: Path, start_timeout_s: float,
                 env: dict[str, str | None] | None = None):
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log
        self._log = open(log, "w")
        cmd = [sys.executable, "-m", "spade.cli", "serve", "--config", config, "--port", "0"]
        for s in sets:
            cmd += ["--set", s]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        env = {k: v for k, v in env.items() if v is not None}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.PIPE, text=True)
        self.url = None
        ready = threading.Event()

        def pump():
            for line in self.proc.stderr:
                self._log.write(line)
                self._log.flush()
                m = re.search(r"listening on (http://\S+)", line)
                if m and self.url is None:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        if not ready.wait(start_timeout_s) or self.url is None:
            self.stop(signal.SIGKILL)
            raise RuntimeError(f"spade serve did not start (log: {log}):\n{self.log()}")

    def log(self, chars: int = 3000) -> str:
        return self.log_path.read_text()[-chars:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> int | None:
        """Send ``sig`` (unless it has exited), wait for the exit; SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._pump.join(10)
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode


def server_info(base_url: str, api_key: str) -> dict:
    import openai

    models = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=2, timeout=60).models.list()
    m = models.data[0]
    return {"id": m.id, **(m.model_extra or {}).get("spade", {})}


def prompt_pieces(T: int, chunk: int) -> int:
    """Iterations a prompt of ``T`` tokens takes to join with ``serving.prefill_chunk`` =
    ``chunk`` (0: whole, one), its pieces whole chunks (the engine's first piece may be
    shorter, what is left of an iteration's budget: one more)."""
    from spade.serving.slots import chunk_sizes

    return len(chunk_sizes(T, chunk, chunk)) if chunk > 0 else 1


def warmup_plan(args, info: dict) -> tuple[int, int]:
    """(requests, max_tokens) of the warm-up before the sweep. ``--warmup -1`` (the
    default): one request per batch slot of the server (``max_batch`` in its /v1/models
    metadata), at once, each decoding until the last has joined (one prompt piece of
    ``prefill_chunk`` tokens per iteration, 8 tokens more), so every row bucket's decode
    graphs and kernels are made before the first measured rate; the server's decode
    graphs are keyed by the bucket of rows in use, and a bucket first reached inside a
    measured run stalls it (its TPOT p99). Without the metadata: 2 requests."""
    n = args.warmup
    if n == 0:
        return 0, 0
    slots = info.get("max_batch")
    if n < 0:
        n = int(slots) if slots else 2
    n = max(1, min(n, args.num_prompts))
    chunk = info.get("prefill_chunk") or 0
    pieces = n * prompt_pieces(args.input_len, chunk)
    room = int(info.get("max_seq_len") or 0) - args.input_len
    tokens = 8 + pieces
    return n, max(1, min(tokens, room)) if room > 0 else tokens


def sweep(base_url: str, api_key: str, args, rates: list[float], label: str | None = None) -> dict:
    info = server_info(base_url, api_key)
    label = label or info.get("policy") or "server"
    model = args.model or info["id"]
    prompts = make_prompts(args.num_prompts, args.input_len, args.seed)
    n_warm, warm_len = warmup_plan(args, info)
    if n_warm:  # compiles, allocations and graph captures out of the measured runs
        asyncio.run(run_rate(base_url, api_key, model, prompts[:n_warm], warm_len, math.inf, args.seed, None))
    idle = idle_ttft = None
    if args.idle:  # one request alone: the TPOT the SLO is relative to, and the TTFT of an empty queue
        one = asyncio.run(run_rate(base_url, api_key, model, prompts[:1], args.output_len, math.inf, args.seed, None))
        idle, idle_ttft = one["tpot_p50_ms"], one["ttft_p50_ms"]
        print(json.dumps({"idle_tpot_ms": idle, "idle_ttft_ms": idle_ttft, "policy": label}), flush=True)
    rows = []

    def measure(rate: float, **mark) -> None:
        row = asyncio.run(run_rate(base_url, api_key, model, prompts, args.output_len, rate, args.seed,
                                   args.max_concurrency))
        row.update(policy=label, **mark)
        rows.append(row)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()
                          if k != "errors"}), flush=True)

    for rate in rates:
        measure(rate)
    for _ in range(args.search if idle is not None else 0):  # bisect toward the highest rate meeting the SLO
        rate = next_probe(rows, idle, args.slo_factor, idle_ttft, args.ttft_factor)
        if rate is None:
            break
        measure(rate, probe=True)
    rows.sort(key=lambda r: math.inf if r["rate"] == "inf" else r["rate"])
    return {"label": label, "server": info, "idle_tpot_ms": idle, "idle_ttft_ms": idle_ttft,
            "slo_factor": args.slo_factor, "ttft_factor": args.ttft_factor,
            "slo": slo_rate(rows, idle, args.slo_factor, idle_ttft, args.ttft_factor), "rows": rows}


def _limits(idle_tpot_ms: float, factor: float, idle_ttft_ms: float | None, ttft_factor: float | None):
    return factor * idle_tpot_ms, (None if idle_ttft_ms is None or not ttft_factor else ttft_factor * idle_ttft_ms)


def _meets(r: dict, limit: float, ttft_limit: float | None) -> bool:
    """A rate's row meets the SLO: every request completed, TPOT p99 within ``limit`` and,
    with ``ttft_limit``, TTFT p99 within it (sustained: no growing queue)."""
    return (r["failed"] == 0 and r["tpot_p99_ms"] is not None and r["tpot_p99_ms"] <= limit
            and (ttft_limit is None or (r.get("ttft_p99_ms") is not None and r["ttft_p99_ms"] <= ttft_limit)))


def next_probe(rows: list[dict], idle_tpot_ms: float, factor: float, idle_ttft_ms: float | None = None,
               ttft_factor: float | None = None, tight: float = 1.1) -> float | None:
    """The next offered rate to try in the search for the highest rate meeting the SLO:
    the geometric midpoint of the highest finite rate that met it and the lowest higher one
    that did not; half the lowest rate tried when none met it; twice the highest when every
    one did. None once the bracket is within ``tight`` (a ratio) or nothing was tried."""
    limit, ttft_limit = _limits(idle_tpot_ms, factor, idle_ttft_ms, ttft_factor)
    finite = [r for r in rows if r["rate"] != "inf"]
    ok = [r["rate"] for r in finite if _meets(r, limit, ttft_limit)]
    lo = max(ok) if ok else None
    bad = [r["rate"] for r in finite if not _meets(r, limit, ttft_limit) and (lo is None or r["rate"] > lo)]
    hi = min(bad) if bad else None
    if lo is None and hi is None:
        return None
    if lo is None:
        return hi / 2
    if hi is None:
        return lo * 2
    return None if hi / lo <= tight else round(math.sqrt(lo * hi), 4)


def slo_rate(rows: list[dict], idle_tpot_ms: float | None, factor: float, idle_ttft_ms: float | None = None,
             ttft_factor: float | None = None) -> dict | None:
    """The highest finite offered rate whose TPOT p99 stays within ``factor`` x the idle
    TPOT, with every request completed (``rate``: None when none does), and the
    request rate the server then achieved. ``bounded``: a higher rate tried broke the
    SLO (else the true limit may lie above the rates tried).

    Sustained (``ttft_factor`` with ``idle_ttft_ms``): a rate counts only if its TTFT p99
    stays within ``ttft_factor`` x the TTFT of one request alone. A server that admits
    requests in waves (they wait in its queue) keeps a low TPOT at any offered rate while
    it serves far fewer requests than were offered; its TTFT shows the queue."""
    if idle_tpot_ms is None:
        return None
    limit, ttft_limit = _limits(idle_tpot_ms, factor, idle_ttft_ms, ttft_factor)
    finite = sorted((r for r in rows if r["rate"] != "inf"), key=lambda r: r["rate"])
    best = None
    for r in finite:
        if _meets(r, limit, ttft_limit):
            best = r
    return {"tpot_p99_limit_ms": limit, "ttft_p99_limit_ms": ttft_limit,
            "rate": None if best is None else best["rate"],
            "achieved_req_per_s": None if best is None else best["req_per_s"],
            "bounded": any(r["rate"] > (best["rate"] if best else 0) for r in finite)}


def slo_lines(runs: list[dict]) -> list[str]:
    """One line per run: its idle TPOT and the highest rate meeting the SLO; then each
    run's rate over the first run's (e.g. asyncspade over full, when full came first); then
    each run's highest rate within the first run's limits (one SLO for all)."""
    out = []
    for run in runs:
        slo = run.get("slo")
        if not slo:
            continue
        rate = slo["rate"]
        ttft = slo.get("ttft_p99_limit_ms")
        out.append(f"SLO {run['label']}: idle TPOT {run['idle_tpot_ms']:.2f} ms, TPOT p99 <= "
                   f"{slo['tpot_p99_limit_ms']:.2f} ms" + ("" if ttft is None else f" and TTFT p99 <= {ttft:.0f} ms")
                   + " up to "
                   + ("no rate tried" if rate is None else f"{rate:g} req/s offered ({slo['achieved_req_per_s']:.3f} "
                      f"achieved){'' if slo['bounded'] else ', the highest tried'}"))
    base = runs[0].get("slo") if runs else None
    if base and base["rate"]:
        for run in runs[1:]:
            if run.get("slo") and run["slo"]["rate"]:
                out.append(f"SLO rate {run['label']} / {runs[0]['label']}: {run['slo']['rate'] / base['rate']:.2f}x")
    if base and len(runs) > 1 and all(run.get("rows") for run in runs):
        # one SLO for every run: the first run's limits (its idle TPOT and TTFT), so a run whose
        # own idle step is faster is not held to a tighter limit
        first = runs[0]
        common = {run["label"]: slo_rate(run["rows"], first["idle_tpot_ms"], first.get("slo_factor", 2.0),
                                         first.get("idle_ttft_ms"), first.get("ttft_factor"))
                  for run in runs}
        out.append(f"SLO at {first['label']}'s limits for all (TPOT p99 <= {base['tpot_p99_limit_ms']:.2f} ms"
                   + ("" if base.get("ttft_p99_limit_ms") is None else f", TTFT p99 <= {base['ttft_p99_limit_ms']:.0f} ms")
                   + "): " + ", ".join(f"{k} {'none' if v['rate'] is None else format(v['rate'], 'g')} req/s"
                                       f"{'' if v['bounded'] else ' (the highest tried)'}" for k, v in common.items()))
    return out


def plot(runs: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from spade.eval.plots import save_figure

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    def rate(r) -> float:  # "inf" (all at once) sorts last
        return float(r["rate"])

    # the offered rates as categories, in increasing order (a search's probes fall in between)
    labels = [str(x) for x in sorted({r["rate"] for run in runs for r in run["rows"]}, key=float)]
    for run in runs:
        rows = sorted((r for r in run["rows"] if r["completed"]), key=rate)
        x = [labels.index(str(r["rate"])) for r in rows]
        for ax, key in ((axes[0], "ttft"), (axes[1], "tpot")):
            ax.plot(x, [r[f"{key}_p50_ms"] for r in rows], marker="o", label=f"{run['label']} p50")
            ax.plot(x, [r[f"{key}_p99_ms"] for r in rows], marker="x", linestyle="--", label=f"{run['label']} p99")
        axes[2].plot(x, [r["output_tok_per_s"] for r in rows], marker="o", label=run["label"])
    for ax, yl in zip(axes, ("TTFT (ms)", "TPOT (ms)", "output tokens/s")):
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", help="an OpenAI-compatible server's /v1 URL (else --config starts one)")
    ap.add_argument("--config", "-c", help="start `spade serve --config X` (one per --policies entry)")
    ap.add_argument("--set", action="append", default=[], help="config override for the started server (repeatable)")
    ap.add_argument("--policies", default="", help="comma list: one started server per policy (policy.name=X); "
                                                   "default: the config's policy")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"))
    ap.add_argument("--model", help="the model name to send (default: the server's first model)")
    ap.add_argument("--rates", default="1,2,4,inf", help="comma list of request rates (req/s); inf: all at once")
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per rate")
    ap.add_argument("--input-len", type=int, default=1024, help="prompt tokens (random ids)")
    ap.add_argument("--output-len", type=int, default=128, help="max_tokens, with ignore_eos")
    ap.add_argument("--max-concurrency", type=int, default=0, help="cap on requests in flight (0: none)")
    ap.add_argument("--warmup", type=int, default=-1,
                    help="requests sent (all at once) before the sweep; -1: one per batch slot of the server, each "
                         "decoding until the last has joined, so every row bucket is captured (warmup_plan); 0: none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--idle", action=argparse.BooleanOptionalAction, default=True,
                    help="first time one request alone (the idle TPOT), for the SLO below")
    ap.add_argument("--slo-factor", type=float, default=2.0,
                    help="the SLO: TPOT p99 <= this x the idle TPOT; each run reports the highest rate meeting it")
    ap.add_argument("--search", type=int, default=0,
                    help="after --rates, up to this many more rates per policy, bisecting (geometric midpoints) "
                         "toward the highest rate meeting the SLO until the bracket is within 10%%; needs the idle run")
    ap.add_argument("--ttft-factor", type=float, default=5.0,
                    help="a rate counts as sustained only if its TTFT p99 <= this x the idle TTFT (one request "
                         "alone): no growing queue; 0: TPOT only")
    ap.add_argument("--start-timeout-s", type=float, default=600)
    ap.add_argument("--out", default="results/bench_serve.json")
    ap.add_argument("--plot", help="PNG path (default: --out with .png)")
    ap.add_argument("--plot-from", nargs="+", metavar="JSON",
                    help="no run: plot the runs of these reports together into --plot (e.g. one GPU command per "
                         "policy, then one figure)")
    args = ap.parse_args(argv)
    if args.plot_from:
        if not args.plot:
            ap.error("--plot-from needs --plot (the PNG to write)")
        reports = [json.loads(Path(p).read_text()) for p in args.plot_from]
        runs = [run for rep in reports for run in rep["runs"]]
        c = reports[0]["config"]
        srv0 = runs[0]["server"] if runs else {}
        plot(runs, Path(args.plot), f"spade serve, {srv0.get('model', '?')} ({srv0.get('topology', '?')}), input "
                                    f"{c['input_len']} / output {c['output_len']} tokens, {c['num_prompts']} "
                                    "requests per rate")
        print("\n".join(slo_lines(runs)))
        print(f"wrote {args.plot}")
        return 0
    if bool(args.base_url) == bool(args.config):
        ap.error("give one of --base-url (a running server) or --config (start one)")
    if args.policies and not args.config:
        ap.error("--policies starts one server per policy: it needs --config")
    try:
        rates = [math.inf if r.strip() in ("inf", "Inf") else float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        ap.error(f"--rates: a comma list of numbers or inf, got {args.rates!r}")
    if not rates or any(r <= 0 for r in rates):
        ap.error(f"--rates: every rate is > 0 (inf: all at once), got {args.rates!r}")
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.search < 0 or (args.search and not args.idle):
        ap.error(f"--search: a count >= 0 that needs the idle run (the SLO's reference), got {args.search}"
                 + ("" if args.idle else " with --no-idle"))
    if args.ttft_factor < 0:
        ap.error(f"--ttft-factor: must be >= 0 (0: the SLO on TPOT alone), got {args.ttft_factor}")
    out = Path(args.out)
    runs = []
    if args.base_url:
        runs.append(sweep(args.base_url.rstrip("/"), args.api_key, args, rates))
    else:
        for pol in [p.strip() for p in args.policies.split(",") if p.strip()] or [None]:
            sets = list(args.set) + ([f"policy.name={pol}"] if pol else [])
            srv = Server(args.config, sets, out.with_name(f"{out.stem}.{pol or 'server'}.log"), args.start_timeout_s)
            try:
                run = sweep(srv.url + "/v1", args.api_key, args, rates, label=pol)
            finally:
                rc = srv.stop()
            run["server_exit_code"] = rc
            runs.append(run)
    report = {
        "bench": "serve", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "config": {k: v for k, v in vars(args).items() if k != "api_key"}, "runs": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    srv0 = runs[0]["server"] if runs else {}
    plot(runs, png, f"spade serve, {srv0.get('model', '?')} ({srv0.get('topology', '?')}), input "
                    f"{args.input_len} / output {args.output_len} tokens, {args.num_prompts} requests per rate")
    print("\n".join(slo_lines(runs)))
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

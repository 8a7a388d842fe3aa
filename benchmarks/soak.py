"""Soak: many decode steps with a cache-rank fault every few hundred, and what the
runtime made of them (issue 25's reliability figures).

A random-weight model (``--preset``, ``FastModel``) decodes ``--requests``
generations of ``--steps-per-request`` steps each (``--steps`` in all, greedy, the
asyncspade policy), one after the other, as a serving process would. Every
``--fault-every`` steps (+- a seeded jitter of a third) one fault hits the cache
rank, cycling through ``--faults``:

* ``kill``: the cache rank dies (``multiprocess``: SIGKILL of its process;
  in-process: its task is cancelled);
* ``close``: its transport end closes under it (in-process only);
* ``stop``: SIGSTOP of its process, never continued (``multiprocess`` only): only
  the liveness deadline (``runtime.peer_deadline_s``) finds it.

Recorded: faults injected, faults survived (the generation went on), requests lost
(a generation that raised: target 0), every loss and restore (step, seconds), the
longest degraded window (steps and seconds from loss to restore), TPOT before /
during / after a fault (medians over the ``--window`` steps before the fault, the
steps from loss to restore, and the ``--window`` steps after the restore), and the
tokens attended per step. JSON to ``--out``, a plot beside it (``.png``).

    python -m benchmarks.soak --preset tiny --device cpu            # CPU, in-process cache rank
    python -m benchmarks.soak --topology multiprocess --transport nccl --faults kill,stop \\
        --fault-every 500 --device cuda:0                           # GPU pair, a cache process
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

from spade.config import load_config
from spade.models.fast import FastModel
from spade.models.presets import preset_config
from spade.policies import build_policy
from spade.runtime.asyncrt import AsyncRuntime


class SoakRuntime(AsyncRuntime):
    """An ``AsyncRuntime`` that keeps a handle on its current session (to inject faults)."""

    session_now = None

    async def session(self):
        s = await super().session()
        self.session_now = s
        return s


def _inject(kind: str, sess) -> str:
    """One fault on the session's cache rank; returns what was done."""
    link = sess.link
    if kind == "kill":
        if link.proc is not None:
            os.kill(link.proc.pid, signal.SIGKILL)
            return f"SIGKILL pid {link.proc.pid}"
        link.cache_task.cancel()
        return "cache task cancelled"
    if kind == "close":
        if link.cache_transport is None:
            raise SystemExit("--faults close needs an in-process cache rank (colocated/local)")
        link.loop.create_task(link.cache_transport.close())
        return "cache transport end closed"
    if kind == "stop":
        if link.proc is None:
            raise SystemExit("--faults stop needs a cache process (--topology multiprocess)")
        os.kill(link.proc.pid, signal.SIGSTOP)
        return f"SIGSTOP pid {link.proc.pid}"
    raise SystemExit(f"--faults: unknown fault {kind!r} (kill, close, stop)")


def _med_ms(xs: list[float]) -> float | None:
    return round(1e3 * statistics.median(xs), 4) if xs else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--topology", default="colocated", choices=["colocated", "local", "multiprocess"])
    ap.add_argument("--transport", default="nccl", help="multiprocess: nccl, ucx or nixl")
    ap.add_argument("--port", type=int, default=29731, help="multiprocess: the transport's port")
    ap.add_argument("--steps", type=int, default=10000, help="decode steps in all")
    ap.add_argument("--steps-per-request", type=int, default=500)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--budget", type=int, default=32, help="policy.budget (tokens per KV head)")
    ap.add_argument("--fault-every", type=int, default=300)
    ap.add_argument("--faults", default="kill,close", help="comma list, cycled: kill, close, stop")
    ap.add_argument("--on-late", default="wait", choices=["wait", "stale", "full"])
    ap.add_argument("--peer-deadline-s", type=float, default=2.0)
    ap.add_argument("--late-timeout-s", type=float, default=1.0)
    ap.add_argument("--max-restarts-per-min", type=int, default=60)
    ap.add_argument("--window", type=int, default=50, help="steps before/after a fault for the TPOT figures")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: small CPU ops crawl with more on a busy box; 0: torch's default)")
    ap.add_argument("--set", action="append", default=[], help="extra config override (key=value)")
    ap.add_argument("--out", default="results/soak.json")
    args = ap.parse_args(argv)
    kinds = [f.strip() for f in args.faults.split(",") if f.strip()]
    bad = [f for f in kinds if f not in ("kill", "close", "stop")]
    if bad or not kinds:
        ap.error(f"--faults {args.faults!r}: each fault is one of kill, close, stop")
    if "close" in kinds and args.topology == "multiprocess":  # refused before any work, not at the third fault
        ap.error("--faults close closes an in-process cache rank's transport end: use colocated or local, or "
                 "--faults kill,stop with multiprocess")

    torch.manual_seed(args.seed)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    n_req = max(1, -(-args.steps // args.steps_per_request))
    over = [
        "policy.name=asyncspade", f"policy.budget={args.budget}", "policy.sink_tokens=4", "policy.recent_tokens=8",
        f"runtime.topology={args.topology}", f"runtime.on_late={args.on_late}",
        f"runtime.peer_deadline_s={args.peer_deadline_s}", f"runtime.late_timeout_s={args.late_timeout_s}",
        f"runtime.max_restarts_per_min={args.max_restarts_per_min}", *args.set,
    ]
    if args.topology == "multiprocess":
        over.append(f"runtime.transport.name={args.transport}")
        over.append(f"runtime.transport.{'master_port' if args.transport == 'nccl' else 'port'}={args.port}")
    cfg = load_config(None, overrides=over)
    model = FastModel.from_config(preset_config(args.preset), device=dev, dtype=dtype, max_batch=args.batch,
                                  max_seq_len=args.prompt_len + args.steps_per_request + 8)
    rt = SoakRuntime(cfg, model, build_policy(cfg.policy, model.spec))
    rng = random.Random(args.seed)
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]

    def next_fault(after: int) -> int:
        j = args.fault_every // 3
        return after + args.fault_every + rng.randint(-j, j)

    step_ms: list[float] = []  # per global decode step
    attended: list[float] = []  # tokens per (row, KV head, layer) of each step
    faults: list[dict] = []
    events: list[dict] = []
    requests = []
    state = {"next": next_fault(0), "g0": 0, "att": 0}
    n_rows = args.batch * model.spec.n_kv_heads * model.spec.n_layers
    t_start = time.perf_counter()
    for r in range(n_req):
        steps = min(args.steps_per_request, args.steps - r * args.steps_per_request)
        g = torch.Generator().manual_seed(args.seed * 1000 + r)
        ids = torch.randint(3, 500,
                            (args.batch, args.prompt_len), generator=g)
        mask = torch.ones_like(ids)
        state["att"] = 0

        def on_token(i, _host):
            sess = rt.session_now
            if sess is not None and i >= 1:  # decode step i just ran
                tot = int(sess.ctx.stats[:, 0].sum())
                attended.append((tot - state["att"]) / n_rows)
                state["att"] = tot
            gstep = state["g0"] + i
            if gstep >= state["next"] and sess is not None and sess.peer_gone is None and sess.link is not None:
                kind = kinds[len(faults) % len(kinds)]
                what = _inject(kind, sess)
                faults.append({"kind": kind, "step": gstep + 1, "request": r, "what": what,
                               "t_s": time.perf_counter() - t_start})
                state["next"] = next_fault(gstep)
            return False

        t0 = time.perf_counter()
        try:
            tr = rt.generate(ids, mask, max_new_tokens=steps + 1, sample_fn=lambda lg: lg.argmax(-1),
                             on_token=on_token)
            ok, err = True, None
        except Exception as e:  # a lost request: recorded, the soak goes on
            tr, ok, err = None, False, f"{type(e).__name__}: {e}"
        sess = rt.session_now
        times = tr.step_times_s if tr is not None else []
        step_ms.extend(1e3 * t for t in times)
        for e in (tr.stats.get("events", []) if tr is not None else []):
            events.append({**e, "request": r, "global_step": state["g0"] + e["step"]})
        requests.append({"request": r, "ok": ok, "error": err, "steps": len(times),
                         "wall_s": round(time.perf_counter() - t0, 3),
                         "sparse_steps": tr.stats.get("sparse_steps") if tr is not None else None,
                         "dense_fallback_steps": tr.stats.get("dense_fallback_steps") if tr is not None else None})
        state["g0"] += steps
        del sess
        print(f"request {r + 1}/{n_req}: {'ok' if ok else 'LOST ' + err}, {len(times)} steps, "
              f"{len(faults)} faults so far, {sum(e['event'] == 'peer_restored' for e in events)} restores",
              file=sys.stderr)
    rt.close()
    wall = time.perf_counter() - t_start

    # per fault: loss and restore (the first of each after the injection), TPOT around it
    per_fault = []
    for f in faults:
        lost = next((e for e in events if e["event"] == "peer_lost" and e["request"] == f["request"]
                     and e["global_step"] >= f["step"] - 1), None)
        back = None
        if lost is not None:
            back = next((e for e in events if e["event"] == "peer_restored" and e["request"] == lost["request"]
                         and e["global_step"] >= lost["global_step"]), None)
        s0 = f["step"] - 1  # index of the fault's step in step_ms (global steps start at 1)
        before = step_ms[max(0, s0 - args.window):s0]
        if back is not None:
            during = step_ms[lost["global_step"] - 1:back["global_step"] - 1]
            after = step_ms[back["global_step"] - 1:back["global_step"] - 1 + args.window]
        else:
            during, after = [], []
        per_fault.append({**f, "lost_step": lost["global_step"] if lost else None,
                          "restored_step": back["global_step"] if back else None,
                          "degraded_steps": back["degraded_steps"] if back else None,
                          "degraded_s": back.get("degraded_s") if back else None,
                          "tpot_before_ms": _med_ms([x / 1e3 for x in before]),
                          "tpot_during_ms": _med_ms([x / 1e3 for x in during]),
                          "tpot_after_ms": _med_ms([x / 1e3 for x in after])})
    restored = [p for p in per_fault if p["restored_step"] is not None]
    longest = max(restored, key=lambda p: p["degraded_steps"], default=None)
    out = {
        "benchmark": "soak",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus"
                   + (f", {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else ""),
        "command": "python -m benchmarks.soak " + " ".join(argv if argv is not None else sys.argv[1:]),
        "preset": args.preset, "device": str(dev), "dtype": args.dtype, "topology": args.topology,
        "transport": args.transport if args.topology == "multiprocess" else "local",
        "on_late": args.on_late, "peer_deadline_s": args.peer_deadline_s, "batch": args.batch,
        "prompt_len": args.prompt_len, "budget": args.budget, "fault_every": args.fault_every,
        "steps": len(step_ms), "requests": n_req, "wall_s": round(wall, 2),
        "faults_injected": len(faults),
        "faults_survived": sum(1 for f in faults if requests[f["request"]]["ok"]),
        "faults_restored": len(restored),
        "requests_lost": sum(1 for q in requests if not q["ok"]),
        "longest_degraded_steps": longest["degraded_steps"] if longest else None,
        "longest_degraded_s": max((p["degraded_s"] for p in restored), default=None),
        "tpot_before_ms": _med_ms([p["tpot_before_ms"] / 1e3 for p in per_fault if p["tpot_before_ms"]]),
        "tpot_during_ms": _med_ms([p["tpot_during_ms"] / 1e3 for p in per_fault if p["tpot_during_ms"]]),
        "tpot_after_ms": _med_ms([p["tpot_after_ms"] / 1e3 for p in per_fault if p["tpot_after_ms"]]),
        "tpot_all_ms": _med_ms([x / 1e3 for x in step_ms]),
        "dense_fallback_steps": sum(q["dense_fallback_steps"] or 0 for q in requests),
        "faults": per_fault, "events": events, "per_request": requests,
        "step_ms": [round(x, 4) for x in step_ms], "attended_per_step": [round(x, 2) for x in attended],
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    _plot(out, path.with_suffix(".png"))
    keys = ("steps", "wall_s", "faults_injected", "faults_survived", "faults_restored", "requests_lost",
            "longest_degraded_steps", "longest_degraded_s", "tpot_before_ms", "tpot_during_ms", "tpot_after_ms",
            "dense_fallback_steps")
    print(json.dumps({k: out[k] for k in keys}, indent=1))
    print(f"wrote {path} and {path.with_suffix('.png')}", file=sys.stderr)
    return 0 if out["requests_lost"] == 0 else 1


def _plot(out: dict, png: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    xs = range(1, len(out["step_ms"]) + 1)
    a1.plot(xs, out["step_ms"], lw=0.4, color="tab:blue")
    a1.set_ylabel("step time (ms)")
    a1.set_yscale("log")
    a2.plot(range(1, len(out["attended_per_step"]) + 1), out["attended_per_step"], lw=0.6, color="tab:green")
    a2.set_ylabel("tokens attended / (row, head, layer)")
    a2.set_xlabel("decode step (all requests)")
    for f in out["faults"]:
        for a in (a1, a2):
            a.axvline(f["step"], color="tab:red", lw=0.5, alpha=0.6)
            if f["restored_step"]:
                a.axvspan(f["step"], f["restored_step"], color="tab:red", alpha=0.12)
    a1.set_title(f"soak: {out['preset']} {out['topology']}/{out['transport']} on {out['device']}, "
                 f"{out['faults_injected']} faults, {out['requests_lost']} requests lost ({out['date'][:10]})")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

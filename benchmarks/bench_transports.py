"""Latency and bandwidth of every transport, for the messages the runtime really sends.

    python -m benchmarks.bench_transports                          # all, JSON to results/
    python -m benchmarks.bench_transports --transports ucx,nixl --pack 4 --out /tmp/t.json
    python -m benchmarks.bench_transports --tiny --out /tmp/t.json # CPU smoke test, ~30 s

Messages (Qwen3-8B shape: 32 q / 8 KV heads, head_dim 128; batch B, pack of P
layers, budget K; spade/runtime/protocol.py has the layouts):

* ``qkv``    one fused bf16 [P, B, 32 + 2*8, 128] per pack per step
* ``sel_delta`` a delta selection: int32 slots and values [P, B, 8, K/8]
* ``sel``    indices mode: meta int64 [P, 8] (host) + int32 [P, B, 8, K]
* ``kv``     kv mode: meta + indices + gathered bf16 K and V [P, B, 8, K, 128]
* ``raw_1MiB``, ``raw_64MiB``, ``raw_512MiB``: one uint8 tensor

Per (transport, message), three numbers, each with the device synchronised
before the clock is read:

* ``latency_rtt_half_us``: median of a ping-pong round trip / 2;
* ``latency_oneway_us``: median of send -> received-and-synchronised on the
  peer, both read on ``CLOCK_MONOTONIC`` (one clock for every process of a
  host; the ranks run on one host here), each message sent to an idle peer;
* ``bandwidth_GBps``: bytes / time of a stream of back-to-back messages (sends
  as concurrent tasks) into the receiver's registered buffers, closed by an ack.

``raw_nccl`` is the same with plain ``torch.distributed`` send/recv (NCCL on GPU,
gloo on CPU): the floor the transports are compared with.

Robustness: every transport runs in its own child processes (``python -m
benchmarks.bench_transports --worker ...``; ``local``: one process, both
endpoints), rank r on ``cuda:r`` when two GPUs exist (one GPU: both on cuda:0;
none: CPU). Rank 0 appends each finished row to a JSON-lines file; the parent
rewrites the report JSON after every row, so a hang keeps what finished. A
transport that outlives its budget (``--limit-s``, and the global ``--budget-s``)
gets SIGTERM (which makes Python dump every thread's stack into its log), then
SIGKILL. Each child's stdout/stderr goes to a log file named in the JSON; the
NCCL children run with ``NCCL_DEBUG=INFO`` (unless set), so an NCCL hang leaves
its reason in ``<log-dir>/<transport>.rank<r>.log``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

#: Default order: the transport that hung on the H200 pair before (nccl) goes last.
ALL = ["local", "ucx", "nixl", "raw_nccl", "nccl"]
MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
#: Test hook: a transport named here hangs (sleeps) after its first row, so the
#: kill path can be tested without a broken library.
HANG_ENV = "SPADE_BENCH_HANG"
#: Seconds between SIGTERM (stack dump) and SIGKILL of a hung child.
TERM_GRACE_S = 3.0


def _now() -> float:
    """One clock for every process of this host (one-way latency across processes)."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


# --------------------------------------------------------------------------- messages
def message_specs(batch: int, pack: int, budget: int, max_bytes: int | None, tiny: bool = False) -> dict[str, list]:
    """name -> [(shape, dtype name, on_host), ...], smallest first (cheap rows finish first)."""
    P, B, K = pack, batch, budget
    Hq, Hkv, D = 32, 8, 128
    C = max(1, K // 8)
    meta = ((P, 8), "int64", True)
    specs = {
        "qkv": [((P, B, Hq + 2 * Hkv, D), "bfloat16", False)],
        "sel_delta": [meta, ((P, B, Hkv, C), "int32", False), ((P, B, Hkv, C), "int32", False)],
        "sel": [meta, ((P, B, Hkv, K), "int32", False)],
        "raw_1MiB": [((MiB,), "uint8", False)],
        "raw_64MiB": [((64 * MiB,), "uint8", False)],
        "kv": [meta, ((P, B, Hkv, K), "int32", False), ((P, B, Hkv, K, D), "bfloat16", False),
               ((P, B, Hkv, K, D), "bfloat16", False)],
        "raw_512MiB": [((512 * MiB,), "uint8", False)],
    }
    if tiny:
        specs = {k: v for k, v in specs.items() if k in ("qkv", "sel_delta", "sel", "kv", "raw_1MiB")}
    if max_bytes is not None:
        specs = {k: v for k, v in specs.items() if spec_bytes(v) <= max_bytes}
    return dict(sorted(specs.items(), key=lambda kv: spec_bytes(kv[1])))


def spec_bytes(spec) -> int:
    import torch

    total = 0
    for shape, dt, _ in spec:
        n = 1
        for s in shape:
            n *= s
        total += n * getattr(torch, dt).itemsize
    return total


def iters_for(nbytes: int, mode: str) -> tuple[int, int, int]:
    """(ping-pong round trips, one-way sends, stream messages): fewer for big messages."""
    if mode == "tiny":
        return 3, 3, 4
    budget = (256 if mode == "quick" else 2048) * MiB
    cap = 10 if mode == "quick" else 50
    pp = int(min(cap, max(3, budget // max(nbytes, 1) // 2)))
    ow = int(min(cap, max(3, budget // max(nbytes, 1) // 2)))
    st = int(min(2 * cap, max(4, budget // max(nbytes, 1))))
    return pp, ow, st


def _config(name: str, port: int, timeout_s: float):
    from spade.transports import TRANSPORTS

    if name == "local":
        return TRANSPORTS.config("local")()
    if name == "nccl":
        return TRANSPORTS.config("nccl")(master_port=port, timeout_s=timeout_s)
    if name == "ucx":
        return TRANSPORTS.config("ucx")(port=port, timeout_s=timeout_s)
    if name == "nixl":
        return TRANSPORTS.config("nixl")(port=port, timeout_s=timeout_s)
    raise ValueError(name)


def _device(rank: int):
    import torch

    if torch.cuda.is_available():
        return torch.device(f"cuda:{rank % torch.cuda.device_count()}")
    return torch.device("cpu")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make(spec, device):
    import torch

    return [torch.ones(shape, dtype=getattr(torch, dt), device="cpu" if host else device)
            for shape, dt, host in spec]


def _pct(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q / 100))]


def _row(nbytes: int, rtts: list[float], oneway: list[float], n_st: int, st_s: float, **extra) -> dict:
    return {"bytes": nbytes,
            "latency_rtt_half_us": statistics.median(rtts) / 2 * 1e6,
            "latency_rtt_half_us_p10_p90": [_pct(rtts, 10) / 2 * 1e6, _pct(rtts, 90) / 2 * 1e6],
            "latency_oneway_us": statistics.median(oneway) * 1e6,
            "latency_oneway_us_p10_p90": [_pct(oneway, 10) * 1e6, _pct(oneway, 90) * 1e6],
            "pingpong_iters": len(rtts), "oneway_iters": len(oneway), "stream_msgs": n_st,
            "bandwidth_GBps": nbytes * n_st / st_s / 1e9, **extra}


class Rows:
    """Rank 0's JSON-lines output: one line per finished row, flushed to disk at once."""

    def __init__(self, path: str, name: str):
        self.path, self.name = path, name
        self.count = 0

    def write(self, message: str, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"transport": self.name, "message": message, **row}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.count += 1
        if os.environ.get(HANG_ENV) == self.name and self.count == 1:
            print(f"{HANG_ENV}: hanging on purpose", file=sys.stderr, flush=True)
            time.sleep(3600)


# --------------------------------------------------------------------------- transports
async def _bench_rank(t, rank: int, device, specs: dict, mode: str, rows: Rows | None) -> None:
    """The three measurements for every message, on one rank of a connected transport."""
    import torch

    tmo = 300.0
    for name, spec in specs.items():
        nbytes = spec_bytes(spec)
        n_pp, n_ow, n_st = iters_for(nbytes, mode)
        try:
            msg, bufs = _make(spec, device), _make(spec, device)
            ack = [torch.zeros(1, device=device)]
            for suffix in ("pp", "ow", "st") if rank == 1 else ("pp",):  # what this rank receives
                t.register(f"{name}.{suffix}", bufs)
            _sync(device)
            # ping-pong: 2 warm-up round trips (registration, connection set-up)
            rtts = []
            for i in range(n_pp + 2):
                t0 = _now()
                if rank == 0:
                    await t.send(f"{name}.pp", msg)
                    await t.recv(f"{name}.pp", timeout=tmo)
                else:
                    await t.recv(f"{name}.pp", timeout=tmo)
                    await t.send(f"{name}.pp", msg)
                _sync(device)
                if i >= 2:
                    rtts.append(_now() - t0)
            # one-way: rank 0 stamps the send, rank 1 stamps receipt after a sync; the
            # ack (not timed) keeps every message going to an idle peer
            sent, got = [], []
            for i in range(n_ow + 1):
                if rank == 0:
                    _sync(device)
                    sent.append(_now())
                    await t.send(f"{name}.ow", msg)
                    await t.recv(f"{name}.ack", timeout=tmo)
                else:
                    await t.recv(f"{name}.ow", timeout=tmo)
                    _sync(device)
                    got.append(_now())
                    await t.send(f"{name}.ack", ack)
            if rank == 1:
                await t.send(f"{name}.stamps", [torch.tensor(got, dtype=torch.float64)])
            else:
                got = (await t.recv(f"{name}.stamps", timeout=tmo))[0].tolist()
            oneway = [g - s for s, g in zip(sent[1:], got[1:])]  # the first one warms up
            # stream
            await (t.send(f"{name}.ack", ack) if rank == 1 else t.recv(f"{name}.ack", timeout=tmo))
            t0 = _now()
            if rank == 0:
                await asyncio.gather(*[asyncio.ensure_future(t.send(f"{name}.st", msg)) for _ in range(n_st)])
                await t.recv(f"{name}.ack", timeout=tmo)
            else:
                for _ in range(n_st):
                    await t.recv(f"{name}.st", timeout=tmo)
                _sync(device)
                await t.send(f"{name}.ack", ack)
            dt = _now() - t0
            if rows is not None:
                rows.write(name, _row(nbytes, rtts, oneway, n_st, dt))
        except Exception as e:  # noqa: BLE001 - one failed row is recorded; the next may work
            if rows is not None:
                rows.write(name, {"bytes": nbytes, "error": f"{type(e).__name__}: {e}",
                                  "traceback": traceback.format_exc()})
            raise
        finally:
            msg = bufs = None


async def _run_transport(name: str, ranks: list[int], port: int, specs: dict, mode: str, rows: Rows) -> None:
    from spade.transports import TRANSPORTS, Handshake

    cls = TRANSPORTS.get(name)

    async def one(rank: int):
        device = _device(rank)
        t = cls(_config(name, port, 300.0), rank=rank, world=2, device=device)
        await t.connect(Handshake(role=("inference", "cache")[rank]))
        print(f"rank {rank}: connected on {device}", flush=True)
        try:
            await _bench_rank(t, rank, device, specs, mode, rows if rank == 0 else None)
        finally:
            await t.close()

    await asyncio.gather(*(one(r) for r in ranks))


# --------------------------------------------------------------------------- raw torch.distributed
def _run_raw(rank: int, port: int, specs: dict, mode: str, rows: Rows | None) -> None:
    import torch
    import torch.distributed as dist

    device = _device(rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    print(f"rank {rank}: process group up ({backend}) on {device}", flush=True)
    try:
        peer = 1 - rank
        for name, spec in specs.items():
            spec = [(s, d, False) for s, d, _ in spec]  # plain send/recv: every tensor on the device
            nbytes = spec_bytes(spec)
            n_pp, n_ow, n_st = iters_for(nbytes, mode)
            msg, bufs = _make(spec, device), _make(spec, device)
            flag = torch.zeros(1, device=device)
            rtts = []
            for i in range(n_pp + 2):
                _sync(device)
                t0 = _now()
                if rank == 0:
                    for x in msg:
                        dist.send(x, peer)
                    for x in bufs:
                        dist.recv(x, peer)
                else:
                    for x in bufs:
                        dist.recv(x, peer)
                    for x in msg:
                        dist.send(x, peer)
                _sync(device)
                if i >= 2:
                    rtts.append(_now() - t0)
            stamps = []
            for i in range(n_ow + 1):
                if rank == 0:
                    _sync(device)
                    stamps.append(_now())
                    for x in msg:
                        dist.send(x, peer)
                    dist.recv(flag, peer)
                else:
                    for x in bufs:
                        dist.recv(x, peer)
                    _sync(device)
                    stamps.append(_now())
                    dist.send(flag, peer)
            st = torch.tensor(stamps, dtype=torch.float64, device=device)
            if rank == 1:
                dist.send(st, peer)
            else:
                got = torch.empty_like(st)
                dist.recv(got, peer)
                oneway = [g - s for s, g in zip(stamps[1:], got.tolist()[1:])]
            dist.barrier()
            _sync(device)
            t0 = _now()
            works = []
            for _ in range(n_st):
                for x, y in zip(msg, bufs):
                    works.append(dist.isend(x, peer) if rank == 0 else dist.irecv(y, peer))
            for w in works:
                w.wait()
            _sync(device)
            dist.barrier()
            dt = _now() - t0
            if rows is not None:
                rows.write(name, _row(nbytes, rtts, oneway, n_st, dt, backend=backend))
    finally:
        dist.destroy_process_group()


def worker_main(args: dict) -> int:
    """A child process: one rank (or both, for ``local``) of one transport."""
    import faulthandler

    faulthandler.enable()
    faulthandler.register(signal.SIGTERM, all_threads=True)  # the parent's SIGTERM dumps stacks
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    name, ranks, specs = args["name"], args["ranks"], args["specs"]
    specs = {k: [(tuple(s), d, h) for s, d, h in v] for k, v in specs.items()}
    rows = Rows(args["rows"], name) if 0 in ranks else None
    if name == "raw_nccl":
        _run_raw(ranks[0], args["port"], specs, args["mode"], rows)
    else:
        asyncio.run(_run_transport(name, ranks, args["port"], specs, args["mode"], rows))
    print("done", flush=True)
    return 0


# --------------------------------------------------------------------------- parent
def _read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill
            pass
    return out


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM (stack dump into the log), then SIGKILL the child's whole process group."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
    end = time.monotonic() + TERM_GRACE_S
    for p in procs:
        try:
            p.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait(10)


def run_one(name: str, specs: dict, mode: str, limit_s: float, log_dir: Path,
            on_row=None) -> dict:
    """Run one transport in child processes with a time limit; returns its entry of
    the report. ``on_row(entry)`` is called after every new row."""
    from spade.transports._framing import free_port

    entry: dict[str, Any] = {"status": "running", "messages": {}, "logs": []}
    if name != "raw_nccl":
        from spade.transports import availability

        ok, why = availability().get(name, (False, "not registered"))
        if not ok:
            entry.update(status="skipped", reason=why)
            return entry
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    rows_path = log_dir / f"{name}.rows.jsonl"
    rows_path.unlink(missing_ok=True)
    rank_sets = [[0, 1]] if name == "local" else [[0], [1]]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    # NVLink multicast stays off on shared GPU hosts (it can take the GPUs out of service).
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        env.setdefault(k, v)
    if name in ("nccl", "raw_nccl"):
        env.setdefault("NCCL_DEBUG", "INFO")
        env.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "1000")
    procs, logs = [], []
    t0 = time.monotonic()
    for rs in rank_sets:
        log = log_dir / f"{name}.rank{''.join(map(str, rs))}.log"
        logs.append(log)
        arg = json.dumps({"name": name, "ranks": rs, "port": port, "mode": mode, "rows": str(rows_path),
                          "specs": {k: [[list(s), d, h] for s, d, h in v] for k, v in specs.items()}})
        with open(log, "w") as f:
            procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.bench_transports", "--worker", arg],
                                          cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    entry["logs"] = [str(p) for p in logs]
    seen = 0
    deadline = t0 + limit_s
    try:
        while True:
            done = all(p.poll() is not None for p in procs)
            rows = _read_rows(rows_path)
            if len(rows) > seen:
                for r in rows[seen:]:
                    entry["messages"][r.pop("message")] = {k: v for k, v in r.items() if k != "transport"}
                seen = len(rows)
                if on_row is not None:
                    on_row(entry)
            if done:
                break
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(1.0)  # let the other rank notice (it may write its error)
                break
            if time.monotonic() > deadline:
                entry.update(status="timeout", error=f"killed after {limit_s:.0f} s "
                             f"({seen} of {len(specs)} messages finished); stacks and logs: {entry['logs']}")
                break
            time.sleep(0.1)
    finally:
        _stop(procs)
    rows = _read_rows(rows_path)
    for r in rows[seen:]:
        entry["messages"][r.pop("message")] = {k: v for k, v in r.items() if k != "transport"}
    entry["seconds"] = round(time.monotonic() - t0, 2)
    entry["exit_codes"] = [p.returncode for p in procs]
    if entry["status"] == "running":
        if all(p.returncode == 0 for p in procs):
            entry["status"] = "ok"
        else:
            entry["status"] = "error"
            entry["error"] = "; ".join(f"{lg.name}: exit {p.returncode}: {_tail(lg, 800).strip()[-800:]}"
                                       for p, lg in zip(procs, logs) if p.returncode != 0)
    return entry


def _environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node(),
           "cuda": torch.cuda.is_available(), "clock": "CLOCK_MONOTONIC (one-way latency: ranks on one host)"}
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    env["placement"] = ("rank r on cuda:r" if torch.cuda.device_count() >= 2 else
                        "both ranks on cuda:0" if torch.cuda.is_available() else "CPU")
    env["transport_env"] = {k: v for k, v in os.environ.items()
                            if k.startswith(("UCX_", "NIXL_", "NCCL_", "TORCH_NCCL", "NVSHMEM_"))}
    return env


def run_bench(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_transports", description=__doc__.split("\n")[0])
    ap.add_argument("--transports", default=",".join(ALL), help=f"comma list of {ALL}")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--pack", type=int, default=4, help="P: layers per message")
    ap.add_argument("--budget", type=int, default=2048, help="K: selected tokens per KV head")
    ap.add_argument("--max-mib", type=float, default=None,
                    help="skip messages larger than this (default: none on GPU, 64 on CPU)")
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU smoke test: B=1, P=2, K=16, messages <= 1 MiB, 3-4 iterations")
    ap.add_argument("--limit-s", "--transport-budget-s", dest="limit_s", type=float, default=150.0,
                    help="time budget of one transport (then it is killed)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="time budget of the whole run (each transport gets at most an equal share of what is left)")
    ap.add_argument("--out", default="results/bench_transports.json")
    ap.add_argument("--log-dir", default=None, help="children's logs (default: <out>.logs/)")
    args = ap.parse_args(argv)
    start = time.monotonic()

    import torch

    if args.tiny:
        args.batch, args.pack, args.budget = 1, 2, 16
        max_mib = 1.0 if args.max_mib is None else args.max_mib
    else:
        max_mib = args.max_mib if args.max_mib is not None else (None if torch.cuda.is_available() else 64)
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    specs = message_specs(args.batch, args.pack, args.budget, None if max_mib is None else int(max_mib * MiB),
                          tiny=args.tiny)
    names = [n.strip() for n in args.transports.split(",") if n.strip()]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(args.log_dir) if args.log_dir else out.with_name(out.name + ".logs")
    report: dict[str, Any] = {
        "config": {"batch": args.batch, "pack": args.pack, "budget": args.budget, "mode": mode,
                   "limit_s": args.limit_s, "budget_s": args.budget_s,
                   "messages": {k: {"bytes": spec_bytes(v), "tensors": [[list(s), d, "host" if h else "device"]
                                                                        for s, d, h in v]}
                                for k, v in specs.items()}},
        "environment": _environment(),
        "results": {},
    }

    def save(*_):
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2))
        tmp.replace(out)  # atomic: a reader never sees half a file

    save()
    for idx, name in enumerate(names):
        if name not in ALL:
            report["results"][name] = {"status": "skipped", "reason": f"unknown transport (known: {ALL})"}
            save()
            continue
        limit = args.limit_s
        if args.budget_s is not None:
            left = args.budget_s - (time.monotonic() - start) - TERM_GRACE_S - 2.0
            if left < 5.0:
                report["results"][name] = {"status": "skipped", "reason": "the global --budget-s is spent"}
                save()
                continue
            # a fair share of what is left (time a transport does not use rolls over),
            # so one hung transport cannot starve the ones after it
            limit = min(limit, left / (len(names) - idx))
        report["results"][name] = {"status": "running"}
        save()

        def on_row(entry, name=name):
            report["results"][name] = entry
            save()

        t0 = time.monotonic()
        entry = run_one(name, specs, mode, limit, log_dir, on_row=on_row)
        report["results"][name] = entry
        save()
        why = entry.get("error") or entry.get("reason") or ""
        print(f"{name:9s} {time.monotonic() - t0:6.1f} s  {entry['status']}  {why.splitlines()[0][:120] if why else ''}",
              flush=True)
        for msg, r in entry.get("messages", {}).items():
            if "bandwidth_GBps" in r:
                print(f"    {msg:11s} {r['bytes'] / MiB:9.3f} MiB  rtt/2 {r['latency_rtt_half_us']:9.1f} us"
                      f"  one-way {r['latency_oneway_us']:9.1f} us  {r['bandwidth_GBps']:8.3f} GB/s", flush=True)
            else:
                print(f"    {msg:11s} error: {r.get('error', '?')[:120]}", flush=True)
    report["seconds"] = round(time.monotonic() - start, 2)
    save()
    print(f"wrote {out}")
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        return worker_main(json.loads(argv[1]))
    run_bench(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())

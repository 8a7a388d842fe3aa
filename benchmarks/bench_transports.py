"""Bandwidth and latency of every available transport, for the messages the runtime sends.

    python -m benchmarks.bench_transports                     # all transports, JSON to results/
    python -m benchmarks.bench_transports --transports ucx,nixl --pack 4 --out /tmp/t.json

Message sizes (Qwen3-8B shape: 32 q / 8 KV heads, head_dim 128, batch B, pack of
P layers; see DESIGN.md):

* ``qkv``  q, k, v of one decode step:  3 bf16 tensors [P, B, 32|8|8, 128]
* ``sel``  selections (indices mode):    int32 [P, B, 8, K]
* ``kv``   gathered K and V (kv mode):   2 bf16 tensors [P, B, 8, K, 128]
* ``raw_1MiB``, ``raw_64MiB``, ``raw_512MiB``: one uint8 tensor

For each (transport, message): *latency* is half the median round trip of a
ping-pong (rank 0 sends, rank 1 answers with the same message), *bandwidth* is
bytes / time of a one-way stream of back-to-back messages into registered
buffers, closed by a small acknowledgement. ``raw_nccl`` is the same two
measurements with plain ``torch.distributed`` send/recv (NCCL on GPU, gloo on
CPU), the floor the transports are compared with. Rank r runs on ``cuda:r`` when
two GPUs exist (one GPU: both on ``cuda:0``; none: CPU). Each transport runs in
its own pair of spawned processes (``local``: one process, both endpoints), with
a time limit; a failure is recorded in the JSON and the run goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ALL = ["local", "nccl", "ucx", "nixl", "raw_nccl"]
MiB = 1 << 20


# --------------------------------------------------------------------------- messages
def message_specs(batch: int, pack: int, budget: int, max_bytes: int | None) -> dict[str, list]:
    """name -> [(shape, dtype name), ...] of the messages to measure."""
    P, B, K = pack, batch, budget
    specs = {
        "qkv": [((P, B, 32, 128), "bfloat16"), ((P, B, 8, 128), "bfloat16"), ((P, B, 8, 128), "bfloat16")],
        "sel": [((P, B, 8, K), "int32")],
        "kv": [((P, B, 8, K, 128), "bfloat16"), ((P, B, 8, K, 128), "bfloat16")],
        "raw_1MiB": [((MiB,), "uint8")],
        "raw_64MiB": [((64 * MiB,), "uint8")],
        "raw_512MiB": [((512 * MiB,), "uint8")],
    }
    if max_bytes is not None:
        specs = {k: v for k, v in specs.items() if spec_bytes(v) <= max_bytes}
    return specs


def spec_bytes(spec) -> int:
    import torch

    total = 0
    for shape, dt in spec:
        n = 1
        for s in shape:
            n *= s
        total += n * getattr(torch, dt).itemsize
    return total


def iters_for(nbytes: int, quick: bool) -> tuple[int, int]:
    """(ping-pong round trips, stream messages): fewer for big messages."""
    budget = (256 if quick else 2048) * MiB
    pp = int(min(50 if not quick else 10, max(3, budget // max(nbytes, 1) // 2)))
    st = int(min(100 if not quick else 20, max(4, budget // max(nbytes, 1))))
    return pp, st


def _config(name: str, port: int):
    from spade import config as C

    if name == "local":
        return C.LocalTransportConfig()
    if name == "nccl":
        return C.NcclTransportConfig(master_port=port, timeout_s=120.0)
    if name == "ucx":
        return C.UcxTransportConfig(port=port, timeout_s=120.0)
    if name == "nixl":
        return C.NixlTransportConfig(port=port, timeout_s=120.0)
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

    return [torch.ones(shape, dtype=getattr(torch, dt), device=device) for shape, dt in spec]


# --------------------------------------------------------------------------- transports
async def _bench_rank(t, rank: int, device, specs: dict, quick: bool) -> dict:
    """Both measurements for every message, on one rank of a connected transport."""
    import torch

    out = {}
    ack = [torch.zeros(1, device=device)]
    for name, spec in specs.items():
        nbytes = spec_bytes(spec)
        n_pp, n_st = iters_for(nbytes, quick)
        msg = _make(spec, device)
        bufs = _make(spec, device)
        t.register(f"{name}.pp", bufs)
        t.register(f"{name}.st", bufs)
        t.register(f"{name}.ack", [torch.zeros(1, device=device)])
        _sync(device)
        # ping-pong: the first 2 round trips warm up (registration, connection)
        rtts = []
        for i in range(n_pp + 2):
            t0 = time.perf_counter()
            if rank == 0:
                await t.send(f"{name}.pp", msg)
                await t.recv(f"{name}.pp", timeout=300)
            else:
                await t.recv(f"{name}.pp", timeout=300)
                await t.send(f"{name}.pp", msg)
            _sync(device)
            if i >= 2:
                rtts.append(time.perf_counter() - t0)
        # one-way stream, into the registered buffers; sends run as concurrent tasks
        await (t.send(f"{name}.ack", ack) if rank == 1 else t.recv(f"{name}.ack", timeout=300))
        t0 = time.perf_counter()
        if rank == 0:
            sends = [asyncio.ensure_future(t.send(f"{name}.st", msg)) for _ in range(n_st)]
            await asyncio.gather(*sends)
            await t.recv(f"{name}.ack", timeout=300)
        else:
            for _ in range(n_st):
                await t.recv(f"{name}.st", timeout=300)
            _sync(device)
            await t.send(f"{name}.ack", ack)
        dt = time.perf_counter() - t0
        out[name] = {"bytes": nbytes, "latency_us": statistics.median(rtts) / 2 * 1e6,
                     "latency_us_p10_p90": [_pct(rtts, 10) / 2 * 1e6, _pct(rtts, 90) / 2 * 1e6],
                     "pingpong_iters": n_pp, "stream_msgs": n_st,
                     "bandwidth_GBps": nbytes * n_st / dt / 1e9}
        del msg, bufs
    return out


def _pct(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q / 100))]


async def _run_transport(name: str, ranks: tuple[int, ...], port: int, specs: dict, quick: bool) -> dict:
    from spade.transports import TRANSPORTS, Handshake

    cls = TRANSPORTS.get(name)

    async def one(rank: int):
        device = _device(rank)
        t = cls(_config(name, port), rank=rank, world=2, device=device)
        await t.connect(Handshake(role=("inference", "cache")[rank]))
        try:
            return await _bench_rank(t, rank, device, specs, quick)
        finally:
            await t.close()

    res = await asyncio.gather(*(one(r) for r in ranks))
    return res[0] if 0 in ranks else {}


# --------------------------------------------------------------------------- raw torch.distributed
def _run_raw(rank: int, port: int, specs: dict, quick: bool) -> dict:
    import torch
    import torch.distributed as dist

    device = _device(rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = {}
    try:
        peer = 1 - rank
        for name, spec in specs.items():
            nbytes = spec_bytes(spec)
            n_pp, n_st = iters_for(nbytes, quick)
            msg, bufs = _make(spec, device), _make(spec, device)
            rtts = []
            for i in range(n_pp + 2):
                _sync(device)
                t0 = time.perf_counter()
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
                    rtts.append(time.perf_counter() - t0)
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            works = []
            for _ in range(n_st):
                for x, y in zip(msg, bufs):
                    works.append(dist.isend(x, peer) if rank == 0 else dist.irecv(y, peer))
            for w in works:
                w.wait()
            _sync(device)
            dist.barrier()
            dt = time.perf_counter() - t0
            out[name] = {"bytes": nbytes, "latency_us": statistics.median(rtts) / 2 * 1e6,
                         "latency_us_p10_p90": [_pct(rtts, 10) / 2 * 1e6, _pct(rtts, 90) / 2 * 1e6],
                         "pingpong_iters": n_pp, "stream_msgs": n_st,
                         "bandwidth_GBps": nbytes * n_st / dt / 1e9, "backend": backend}
    finally:
        dist.destroy_process_group()
    return out


# --------------------------------------------------------------------------- processes
def _worker(name: str, ranks: tuple[int, ...], port: int, specs: dict, quick: bool, conn) -> None:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        if name == "raw_nccl":
            res = _run_raw(ranks[0], port, specs, quick)
        else:
            res = asyncio.run(_run_transport(name, ranks, port, specs, quick))
        conn.send(("ok", res))
    except BaseException as e:  # noqa: BLE001 - reported in the JSON
        conn.send(("err", f"{type(e).__name__}: {e}", traceback.format_exc()))


def run_one(name: str, specs: dict, quick: bool, limit_s: float) -> dict:
    """Run one transport in its own process(es); returns {message: stats} or {"error": ...}."""
    from spade.transports._framing import free_port

    if name != "raw_nccl":
        from spade.transports import availability

        ok, why = availability().get(name, (False, "not registered"))
        if not ok:
            return {"skipped": why}
    ctx = mp.get_context("spawn")
    port = free_port()
    rank_sets = [(0, 1)] if name == "local" else [(0,), (1,)]
    procs, conns = [], []
    for rs in rank_sets:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(name, rs, port, specs, quick, child), daemon=True)
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    result: dict = {}
    deadline = time.monotonic() + limit_s
    for i, c in enumerate(conns):
        if not c.poll(max(0.0, deadline - time.monotonic())):
            result = {"error": f"timed out after {limit_s:.0f} s"}
            break
        try:
            msg = c.recv()
        except EOFError:
            result = {"error": f"rank set {rank_sets[i]} died"}
            break
        if msg[0] == "err":
            result = {"error": msg[1], "traceback": msg[2]}
            break
        if msg[1]:
            result = msg[1]
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)
    return result


def _environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node(),
           "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    env["ucx_env"] = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_", "NCCL_"))}
    return env


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_transports", description=__doc__.split("\n")[0])
    ap.add_argument("--transports", default=",".join(ALL), help=f"comma list of {ALL}")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--pack", type=int, default=4, help="P: layers per message")
    ap.add_argument("--budget", type=int, default=2048, help="K: selected tokens per KV head")
    ap.add_argument("--max-mib", type=float, default=None,
                    help="skip messages larger than this (default: none on GPU, 64 on CPU)")
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--limit-s", type=float, default=150.0, help="time limit per transport")
    ap.add_argument("--out", default="results/bench_transports.json")
    args = ap.parse_args(argv)

    import torch

    max_mib = args.max_mib if args.max_mib is not None else (None if torch.cuda.is_available() else 64)
    specs = message_specs(args.batch, args.pack, args.budget, None if max_mib is None else int(max_mib * MiB))
    names = [n.strip() for n in args.transports.split(",") if n.strip()]
    report: dict[str, Any] = {
        "config": {"batch": args.batch, "pack": args.pack, "budget": args.budget, "quick": args.quick,
                   "messages": {k: {"bytes": spec_bytes(v), "tensors": [[list(s), d] for s, d in v]}
                                for k, v in specs.items()}},
        "environment": _environment(),
        "results": {},
    }
    for name in names:
        t0 = time.perf_counter()
        res = run_one(name, specs, args.quick, args.limit_s)
        report["results"][name] = res
        status = res.get("error") or res.get("skipped") or "ok"
        print(f"{name:9s} {time.perf_counter() - t0:6.1f} s  {status.splitlines()[0][:100]}", flush=True)
        for msg, r in res.items():
            if isinstance(r, dict) and "bandwidth_GBps" in r:
                print(f"    {msg:11s} {r['bytes'] / MiB:9.2f} MiB  latency {r['latency_us']:10.1f} us"
                      f"  bandwidth {r['bandwidth_GBps']:8.3f} GB/s", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])

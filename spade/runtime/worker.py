"""Entry point of a cache-rank process: ``python -m spade.runtime.worker``.

Spawned by ``AsyncRuntime`` (topology ``multiprocess``) with the transport
config on the command line, or started by torchrun as rank 1 (no arguments:
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` from the environment).
The process knows nothing about the model: each generation's BOOT message
carries the policy config, the ``AttentionSpec`` and the shapes; the weights
never travel. It serves generations until the inference rank sends SHUTDOWN or
goes away, and exits when its parent dies.

Under torchrun, run the same program on both ranks and let rank 1 turn into
the cache rank early::

    import spade.runtime.worker as w
    w.maybe_serve()          # returns on rank 0; serves and exits on rank 1
    ...                      # rank 0: build the engine with runtime.topology=multiprocess
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import torch

from spade.envs import env


def _default_device() -> str:
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '1')) % max(1, torch.cuda.device_count())}"
    return "cpu"


async def serve(transport_cfg, device: str, *, parent_pid: int | None = None, init_method: str | None = None) -> None:
    """Connect as the cache rank (rank 1) and serve until told to stop."""
    from spade.runtime.cache_rank import CacheRank
    from spade.runtime.protocol import PROTOCOL
    from spade.transports import TRANSPORTS, Handshake

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    kw = {"init_method": init_method} if init_method is not None and transport_cfg.name == "nccl" else {}
    t = TRANSPORTS.get(transport_cfg.name)(transport_cfg, rank=1, world=2, device=dev, **kw)
    await t.connect(Handshake(role="cache", layout={"protocol": PROTOCOL}))
    cache = CacheRank(t, dev, in_process=False)
    task = asyncio.ensure_future(cache.serve())
    try:
        while not task.done():  # watch the parent: an orphaned cache rank must not linger
            await asyncio.wait([task], timeout=1.0)
            if parent_pid is not None and os.getppid() != parent_pid:
                task.cancel()
                break
        if task.done() and not task.cancelled():
            task.result()
    finally:
        await t.close()


def _transport_from_env():
    from spade.transports.nccl import NcclTransportConfig

    return NcclTransportConfig(master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                               master_port=int(os.environ.get("MASTER_PORT", "29517")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spade.runtime.worker",
                                 description="spade cache rank (rank 1 of an AsyncRuntime link)")
    ap.add_argument("--transport", help="transport config as JSON (default: nccl from torchrun's env)")
    ap.add_argument("--device", default=None, help="cache-rank device (default: cuda:LOCAL_RANK or cpu)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    init_method = None
    if args.transport:
        from spade.config import transport_config

        tcfg = transport_config(json.loads(args.transport))
    else:
        if os.environ.get("RANK", "1") == "0":
            print("spade worker: rank 0 is the inference rank; run your program there", file=sys.stderr)
            return 2
        tcfg = _transport_from_env()
        init_method = "env://"
    device = args.device or _default_device()
    try:
        from spade.runtime.link import new_event_loop

        loop = new_event_loop()
        prof = _host_profiler()
        try:
            loop.run_until_complete(serve(tcfg, device, parent_pid=args.parent_pid, init_method=init_method))
        finally:
            loop.close()
            if prof is not None:
                _write_host_profile(prof)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # the inference rank gets the reason over the link ("err"); say it here too
        from spade.errors import PeerGone

        if isinstance(e, PeerGone):
            return 0
        print(f"spade worker: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


def _host_profiler():
    """``SPADE_HOST_PROFILE=<file>``: cProfile this cache process's host for its whole
    life (the inference process is profiled by ``bench_tpot --host-profile``); the
    table goes to ``<file>`` when it exits."""
    if not env("SPADE_HOST_PROFILE"):
        return None
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    return prof


def profile_table(prof, rows: int = 50) -> str:
    """A cProfile's top ``rows`` functions by own time, then by cumulative time."""
    import io
    import pstats

    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(rows)
    st.sort_stats("cumtime").print_stats(rows)
    return buf.getvalue()


def _write_host_profile(prof) -> None:
    prof.disable()
    path = env("SPADE_HOST_PROFILE")
    try:
        with open(path, "w") as f:
            f.write(f"cache process {os.getpid()}, host only (cProfile), its whole life\n{profile_table(prof)}")
    except OSError as e:
        print(f"spade worker: host profile not written to {path}: {e}", file=sys.stderr)


def maybe_serve() -> None:
    """Under torchrun: on rank 1 serve as the cache rank and exit; on rank 0 return."""
    if os.environ.get("WORLD_SIZE") == "2" and os.environ.get("RANK") == "1":
        sys.exit(main([]))


if __name__ == "__main__":
    t0 = time.time()
    sys.exit(main())

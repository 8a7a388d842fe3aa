"""A live ``spade serve`` for the tests: a subprocess on 127.0.0.1, on a port the OS
picks (``--port 0``; the server prints where it listens), stopped with SIGTERM.
Also the helpers to read /metrics and the process table."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.bench_serve import Server

START_TIMEOUT_S = 240  # import torch + load SmolLM2 on two busy cores


def children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(d.name))
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class LiveServer(Server):
    """``spade serve --config <yaml> --port 0`` in a subprocess (the benchmark's launcher),
    with one OpenMP thread (small CPU GEMMs crawl with two on a busy two-core machine)."""

    def __init__(self, tmp: Path, config: str):
        cfg = tmp / "serve.yaml"
        cfg.write_text(config)
        try:
            super().__init__(str(cfg), [], tmp / "serve.log", START_TIMEOUT_S,
                             env={"OMP_NUM_THREADS": "1", "SPADE_SERVE__API_KEY": None})
        except RuntimeError as e:
            pytest.fail(str(e))
        self.base = self.url + "/v1"


def metric(text: str, name: str, **labels) -> float | None:
    """The value of the first sample of ``name`` whose labels include ``labels``."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        series, _, lab = head.partition("{")
        if series != name:
            continue
        if all(f'{k}="{v}"' in lab for k, v in labels.items()):
            return float(value)
    return None


def http_module():
    """The raw HTTP client library: httpx, or its successor httpx2, which newer openai
    releases bring."""
    try:
        import httpx2 as mod
    except ImportError:
        mod = pytest.importorskip("httpx")
    return mod

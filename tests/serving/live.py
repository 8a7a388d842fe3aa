"""A live ``spade serve`` for the tests: a subprocess on 127.0.0.1, on a port the OS
picks (``--port 0``; the server prints where it listens), stopped with SIGTERM.
Also the helpers to read /metrics and the process table."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


class LiveServer:
    """``spade serve --config <yaml> --port 0`` in a subprocess."""

    def __init__(self, tmp: Path, config: str, *extra: str):
        self.cfg_path = tmp / "serve.yaml"
        self.cfg_path.write_text(config)
        self.log_path = tmp / "serve.log"
        # one OpenMP thread: small CPU GEMMs crawl with two on a busy two-core machine
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env.pop("SPADE_SERVE__API_KEY", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "spade.cli", "serve", "--config", str(self.cfg_path), "--port", "0", *extra],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.url = None
        found = threading.Event()

        def pump():  # keep reading stderr (a full pipe would block the server)
            for line in self.proc.stderr:
                self.lines.append(line)
                m = re.search(r"listening on (http://\S+)", line)
                if m and self.url is None:
                    self.url = m.group(1)
                    found.set()
            found.set()

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        if not found.wait(START_TIMEOUT_S) or self.url is None:
            self.stop(kill=True)
            pytest.fail(f"spade serve did not start:\n{self.log()}")
        self.base = self.url + "/v1"

    def log(self) -> str:
        return "".join(self.lines[-60:])

    def stop(self, kill: bool = False, timeout: float = 60) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._pump.join(5)
        return self.proc.returncode


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

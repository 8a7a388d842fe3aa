"""Ahead-of-time sm_90 builds for the kernel tests (no GPU needed: ptxas ships with triton).

The interpreter accepts code the compiler rejects, so each kernel module's tests also
compile its kernels for Hopper in a child process (without ``TRITON_INTERPRET``, which
the parent may have set before importing triton) and inspect what comes out."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_aot_script(script: str) -> dict:
    """Run ``script`` (which prints one JSON object on its last line) in a child process
    that imports this checkout's spade without the interpreter; returns the object.
    Skips where this triton cannot build ahead of time."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "GPUTarget" in proc.stderr and "ImportError" in proc.stderr:
        pytest.skip("this triton cannot build ahead of time")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])

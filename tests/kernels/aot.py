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


def sm90_compile(fn, args: dict, cons: dict, num_warps: int = 4, num_stages: int = 3):
    """(In the child process.) Compile the ``@triton.jit`` function ``fn`` for sm_90 as a
    launcher's call would specialise it: ``args`` maps argument names to ``("ptr",
    dtype)`` or an int (``("i64", v)`` for another int type); ints equal to 1 become
    constants, pointers and multiples of 16 get the divisibility hint; ``cons`` are the
    constexprs; arguments in neither keep their defaults (constexprs the launcher leaves
    alone). Returns the compiled kernel (``.asm["ttgir"]``, ``.asm["ptx"]``, ``.metadata``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs, consts = {}, {}, dict(cons)
    for i, n in enumerate(fn.arg_names):
        if n in cons:
            sig[n] = "constexpr"
            continue
        if n not in args:
            sig[n], consts[n] = "constexpr", fn.params[i].default
            continue
        kind, val = args[n] if isinstance(args[n], tuple) else ("i32", args[n])
        if kind == "ptr":
            sig[n], attrs[(i,)] = "*" + val, [["tt.divisibility", 16]]
        elif kind == "i32" and val == 1:
            sig[n], consts[n] = "constexpr", 1
        else:
            sig[n] = kind
            if kind == "i32" and val % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def loop_body(ttgir: str, last: bool = False) -> str:
    """The body of the first (or, ``last``, the innermost last) ``scf.for`` of a TTGIR dump."""
    loop = ttgir[(ttgir.rfind if last else ttgir.find)("scf.for"):]
    return loop[:loop.find("scf.yield")]


def smem_buffers(ttgir: str, dtype: str = "") -> list[str]:
    """The leading dimension of each mutable shared-memory buffer (pipeline stages),
    optionally only those of ``dtype`` (e.g. "xbf16")."""
    return [l.split("memdesc<")[1].split("x")[0] for l in ttgir.splitlines()
            if "local_alloc" in l and "mutable" in l and dtype in l]

"""Ahead-of-time sm_90 compile check of ``spade.kernels.gemv`` (no GPU needed).

Compiles ``_gemv_kernel`` for every launch config ``gemv_config`` can return on the
Qwen3-8B decode projections (M = 1..32, bf16 / fp16 / fp32), with the constexprs
``linear_triton`` would pass, for ``GPUTarget("cuda", 90, 128)``; then reports each
variant's registers per thread and spill bytes (``cuobjdump --dump-resource-usage``
of the cubin, the tool Triton ships) and fails if any config does not compile or
spills. ``--extra`` also compiles a spread of configs of the ``--grid`` sweep space.

Run WITHOUT ``TRITON_INTERPRET`` (the interpreter replaces the compiler)::

    env -u TRITON_INTERPRET python scripts/aot_gemv.py [--extra] [--json results/aot_gemv.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("aot_gemv: unset TRITON_INTERPRET (the interpreter has no compiler to check)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from spade.kernels import gemv as G  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
TDT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
TARGET = GPUTarget("cuda", 90, 128)
SMEM_MAX = 232448  # sm_90: 227 KiB of shared memory per block (opt-in maximum)


def launch_constexprs(M: int, N: int, K: int, dtype: torch.dtype, cfg: G.GemvConfig) -> dict:
    """The constexprs ``linear_triton`` passes for this shape and config (same arithmetic)."""
    block_k = min(cfg.BLOCK_K, max(16, triton.next_power_of_2(K)))
    n_kb = triton.cdiv(K, block_k)
    split = max(1, min(cfg.SPLIT_K, n_kb))
    k_per_split = triton.cdiv(n_kb, split) * block_k
    split = triton.cdiv(K, k_per_split)
    return dict(K=K, K_PER_SPLIT=k_per_split, SPLIT_K=split, BLOCK_M=G._block_m(M, cfg.variant),
                BLOCK_N=cfg.BLOCK_N, BLOCK_K=block_k, VARIANT=G._VARIANT_CODE[cfg.variant], HAS_BIAS=True,
                EVEN_K=k_per_split * split == K, EVEN_N=N % cfg.BLOCK_N == 0, UPCAST=False,
                IEEE=dtype == torch.float32)


def compile_one(dtype: torch.dtype, const: dict, num_warps: int, num_stages: int):
    fn = G._gemv_kernel
    t = TDT[dtype]
    sig = dict(x_ptr=f"*{t}", w_ptr=f"*{t}", b_ptr=f"*{t}", out_ptr=f"*{t}", ws_ptr="*fp32", cnt_ptr="*i32",
               M="i32", N="i32", stride_xm="i32", stride_wn="i32", stride_om="i32")
    sig.update({k: "constexpr" for k in const})
    # pointers 16-byte aligned, N and the row strides multiples of 16 (true of every model shape)
    div16 = ["x_ptr", "w_ptr", "b_ptr", "out_ptr", "ws_ptr", "cnt_ptr", "N", "stride_xm", "stride_wn", "stride_om"]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in div16}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages))


def resource_usage(compiled) -> dict:
    """Registers / spill bytes / shared memory of the cubin (``cuobjdump --dump-resource-usage``)."""
    info = dict(n_regs=getattr(compiled, "n_regs", None), n_spills=getattr(compiled, "n_spills", None),
                shared=compiled.metadata.shared)
    try:
        cuobjdump = triton.knobs.nvidia.cuobjdump.path
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            txt = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                 check=True).stdout
        m = re.search(r"REG:(\d+)", txt)
        s = re.search(r"STACK:(\d+)", txt)
        ls = re.search(r"LOCAL:(\d+)", txt)
        if m:
            info["n_regs"] = int(m.group(1))
        info["stack_bytes"] = int(s.group(1)) if s else None
        info["local_bytes"] = int(ls.group(1)) if ls else None
        if info["n_spills"] is None and info["local_bytes"] is not None:
            info["n_spills"] = info["local_bytes"]  # spills live in local memory
    except Exception as e:  # keep the compile result even without the tool
        info["resource_error"] = f"{type(e).__name__}: {e}"
    return info


def heuristic_jobs(dtypes) -> dict:
    jobs: dict = {}
    for dtype in dtypes:
        for name, (N, K) in SHAPES.items():
            for M in range(1, G.MAX_M + 1):
                cfg = G.gemv_config(M, N, K, dtype)
                const = launch_constexprs(M, N, K, dtype, cfg)
                key = (TDT[dtype], tuple(sorted(const.items())), cfg.num_warps, cfg.num_stages)
                jobs.setdefault(key, dict(dtype=dtype, const=const, warps=cfg.num_warps, stages=cfg.num_stages,
                                          used_by=[]))["used_by"].append(f"{name} M={M}")
    return jobs


def extra_jobs() -> dict:
    """A spread of the sweep space on o_proj (4096 x 4096) and down (4096 x 12288), bf16, M=8 and 1."""
    jobs: dict = {}
    for (N, K), M, variant, bn, bk, sk, w, s in itertools.product(
            [(4096, 4096), (4096, 12288)], [1, 8], G.VARIANTS, [16, 64, 128], [128, 512], [1, 4], [4, 8], [2, 5]):
        if variant != "dot" and (bn * G._block_m(M, variant) * bk > 128 * 32 * w * (1 if variant == "fma" else 4)):
            continue  # the bench prunes these too (register blow-up)
        cfg = G.GemvConfig(bn, bk, sk, w, s, variant)
        const = launch_constexprs(M, N, K, torch.bfloat16, cfg)
        key = ("bf16", tuple(sorted(const.items())), w, s)
        jobs.setdefault(key, dict(dtype=torch.bfloat16, const=const, warps=w, stages=s, used_by=[]))[
            "used_by"].append(f"sweep {N}x{K} M={M}")
    return jobs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--extra", action="store_true", help="also compile a spread of the --grid sweep space")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    dtypes = [{v: k for k, v in TDT.items()}[d] for d in args.dtypes.split(",")]
    jobs = heuristic_jobs(dtypes)
    if args.extra:
        jobs.update({k: v for k, v in extra_jobs().items() if k not in jobs})
    print(f"# triton {triton.__version__}, target {TARGET}; {len(jobs)} distinct compiles")
    rows, bad = [], 0
    for job in jobs.values():
        c = job["const"]
        label = (f"{TDT[job['dtype']]} {G.VARIANTS[c['VARIANT']]:>3} BM={c['BLOCK_M']:<2} BN={c['BLOCK_N']:<3} "
                 f"BK={c['BLOCK_K']:<3} SK={c['SPLIT_K']} K={c['K']:<5} w={job['warps']} s={job['stages']}")
        t0 = time.time()
        try:
            compiled = compile_one(job["dtype"], c, job["warps"], job["stages"])
            info = resource_usage(compiled)
            ok = not info.get("n_spills") and info["shared"] <= SMEM_MAX
        except Exception as e:
            info, ok = dict(error=f"{type(e).__name__}: {str(e)[:400]}"), False
        bad += not ok
        uses = job["used_by"]
        print(f"{'ok ' if ok else 'BAD'} {label}  regs={info.get('n_regs')} spills={info.get('n_spills')} "
              f"smem={info.get('shared')}  ({time.time() - t0:.1f}s) <- {uses[0]}"
              f"{f' (+{len(uses) - 1})' if len(uses) > 1 else ''}" + (f"\n    {info['error']}" if "error" in info else ""))
        rows.append(dict(dtype=TDT[job["dtype"]], constexprs=c, num_warps=job["warps"], num_stages=job["stages"],
                         used_by=uses, ok=ok, **info))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(target=str(TARGET), triton=triton.__version__, rows=rows),
                                              indent=1))
    print(f"# {len(rows) - bad}/{len(rows)} compiled without spills")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

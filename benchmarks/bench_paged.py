"""Paged vs contiguous KV cache: decode attention, the selected-K/V gather and scoring, against the byte floor.

The same kernels (``spade.kernels.sparse_decode_attention``, ``gather_kv``) read the
same tokens twice: from the contiguous cache [B, Hkv, L, D], and from block pools
[num_blocks, Hkv, block_size, D] through a *shuffled* block table (every row's blocks
in a random order across one shared pool, ``spade.kernels.paged.scatter_to_pool``), for
each ``--block-sizes``. Rows:

* ``sparse``: indexed attention, 4 sinks + K random (unsorted) middle tokens + 64
  recent (``--K``, default 2048);
* ``dense``: the ``indices=None`` path over the whole context (the ``full`` policy);
* ``gather``: ``gather_kv`` of the K selected rows (the ``kv`` return mode);
* ``score``: ``score_topk`` over the exact keys of the middle range (sum of the
  group's logits, radix top-K): the cache side's selection from exact keys;
* ``int4``: ``score_topk`` over asyncspade's packed int4 scoring copy (its pool shares
  the K pool's table), the served default: ``sum_softmax`` per head, the threshold-carry
  top-K (a carry per layout, in its steady state: the same query every call);
* ``quest``: ``quest_select`` (page scores + the row select, pages of ``--page-size``,
  ``K // page_size`` pages) over the per-row page bounds [B, Hkv, P, D] against pool bounds
  in the blocks [num_blocks, Hkv, ceil(block_size / page_size), D] read through the table.

Each row reports the median time (CUDA events, L2 flushed before every call by a
512 MiB memset, which also hides the host's launch), the K/V bytes it must read, the
byte floor (those bytes / the device-to-device copy rate measured in the same run,
read + write counted), the paged / contiguous ratio (target: <= 1.05, issue 22) and
the relative error of the paged output against the contiguous one (the kernels do
the same arithmetic in the same order: 0 expected). ``--graph`` times CUDA-graph
replays instead (no launch latency at all).

Default shape: Qwen3-8B attention (32 q / 8 KV heads, d = 128), bf16, B = 8,
L = 32k, K = 2k, block sizes 16, 32, 64. JSON to ``--out``.

    python -m benchmarks.bench_paged --out results/gpu/bench_paged.json
    python -m benchmarks.bench_paged --block-sizes 8,16,32,64,128 --out results/gpu/paged_block_sweep.json
    python -m benchmarks.bench_paged --smoke      # tiny shapes, CPU / TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.args import int_list
from benchmarks.bench_attention import Timer, hbm_bandwidth, random_middle

TARGET_RATIO = 1.05
KINDS = ("sparse", "dense", "gather", "score", "int4", "quest")


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_paged", description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--L", type=int, default=32768, help="context length of every row")
    ap.add_argument("--K", type=int, default=2048, help="middle tokens selected per (row, KV head)")
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--g", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--recent", type=int, default=64)
    ap.add_argument("--block-sizes", type=int_list(1), default=[16, 32, 64], help="tokens per block, comma-separated")
    ap.add_argument("--kinds", default=",".join(KINDS), help="rows to run, comma-separated")
    ap.add_argument("--page-size", type=int, default=16, help="Quest's page size (the quest row)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU / TRITON_INTERPRET=1)")
    ap.add_argument("--out", default=None, help="JSON path")
    a = ap.parse_args(argv)
    if a.smoke:
        a.B, a.L, a.K, a.hkv, a.g, a.d, a.sink, a.recent, a.iters, a.page_size = 2, 77, 16, 2, 2, 16, 2, 4, 1, 4
        a.block_sizes = [8]
    for f in ("B", "L", "K", "hkv", "g", "d", "iters", "page_size"):
        if getattr(a, f) < 1:
            ap.error(f"--{f} must be >= 1, got {getattr(a, f)}")
    if a.K + a.sink + a.recent > a.L:
        ap.error(f"--K + --sink + --recent ({a.K + a.sink + a.recent}) must be <= --L ({a.L})")
    a.kinds = [k for k in a.kinds.split(",") if k]
    bad = set(a.kinds) - set(KINDS)
    if bad or not a.kinds:
        ap.error(f"--kinds takes {', '.join(KINDS)}; got {a.kinds}")
    return a


def run(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    from spade import kernels
    from spade.kernels.paged import scatter_to_pool

    cuda = torch.cuda.is_available() and not a.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    timer = Timer(a.iters, warmup=1 if a.smoke else 3, flush=True, device=dev.type)
    if a.graph and not cuda:
        raise SystemExit("--graph needs a GPU")
    time_fn = timer.graph if a.graph else timer
    B, Hkv, L, D, K = a.B, a.hkv, a.L, a.d, a.K
    esz = torch.empty((), dtype=dtype).element_size()
    res: dict = {"shape": dict(B=B, Hkv=Hkv, Hq=Hkv * a.g, L=L, K=K, D=D, sink=a.sink, recent=a.recent,
                               page_size=a.page_size, dtype=str(dtype).replace("torch.", ""),
                               block_sizes=a.block_sizes),
                 "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "graph": a.graph,
                 "target_ratio": TARGET_RATIO, "rows": []}
    copy_bw = hbm_bandwidth(timer, 2**30 if cuda else 2**20, device=dev.type)
    res["copy_TBps"] = copy_bw / 1e12
    print(f"device {res['device']}; copy {copy_bw / 1e12:.2f} TB/s (read + write); shape {res['shape']}", flush=True)

    g = torch.Generator(device=dev).manual_seed(a.seed)
    q = torch.randn(B, Hkv * a.g, D, generator=g, device=dev).to(dtype)
    kv_lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    mid = random_middle(B, Hkv, L, K, a.sink, a.recent, dev)
    n_tok = a.sink + K + a.recent
    lo = torch.full((B,), a.sink, dtype=torch.int32, device=dev)
    hi = torch.full((B,), L - a.recent, dtype=torch.int32, device=dev)
    nbytes = {"sparse": 2 * B * Hkv * n_tok * D * esz, "dense": 2 * B * Hkv * L * D * esz,
              "gather": 2 * B * Hkv * K * D * esz, "score": B * Hkv * (L - a.sink - a.recent) * D * esz,
              "int4": B * Hkv * L * (D // 2 + 4),  # the normaliser spans the row: every key and scale
              "quest": 2 * B * Hkv * -(-L // a.page_size) * D * esz}  # both bounds of every page
    n_pages_sel = max(1, K // a.page_size)

    def calls(k, v, kq, ks, table, bounds):
        """``bounds``: Quest's (kmin, kmax), per-row or pool bounds (with ``table``)."""
        paged = {} if table is None else {"block_table": table}
        from spade.kernels.carry import new_carry

        carry = new_carry(B, Hkv, dev) if cuda else None  # (the threshold carry is the Triton path's)
        return {"sparse": lambda: kernels.sparse_decode_attention(q, k, v, kv_lens, mid, n_sink=a.sink,
                                                                  n_recent=a.recent, **paged),
                "dense": lambda: kernels.sparse_decode_attention(q, k, v, kv_lens, **paged),
                "gather": lambda: torch.cat(kernels.gather_kv(k, v, mid, **paged), dim=-1),
                "score": lambda: kernels.score_topk(q, k, lo, hi, K, **paged).sort(-1).values,
                "int4": lambda: kernels.score_topk(q, kq, lo, hi, K, reduce="sum_softmax", kv_lens=kv_lens,
                                                   k_scale=ks, carry=carry, **paged).sort(-1).values,
                "quest": lambda: kernels.quest_select(q, *bounds, kv_lens, n_pages_sel, a.page_size,
                                                      **({} if table is None else {"block_table": table,
                                                                                   "block_size": k.shape[2]})
                                                      ).sort(-1).values}

    def row(kind: str, layout: str, bs: int | None, ms: float, err: float | None) -> dict:
        floor_ms = nbytes[kind] / copy_bw * 1e3
        r = dict(kind=kind, layout=layout, block_size=bs, us=ms * 1e3, bytes=nbytes[kind],
                 TBps=nbytes[kind] / (ms * 1e-3) / 1e12, floor_us=floor_ms * 1e3, x_floor=ms / floor_ms)
        if err is not None:
            r["rel_err_vs_contiguous"] = err
        res["rows"].append(r)
        print(f"{kind:7s} {layout:10s} bs={str(bs):5s} {r['us']:9.1f} us  {r['TBps']:5.2f} TB/s  "
              f"{r['x_floor']:5.2f}x floor" + ("" if err is None else f"  err {err:.1e}"), flush=True)
        return r

    k = torch.randn(B, Hkv, L, D, generator=g, device=dev).to(dtype)
    v = torch.randn(B, Hkv, L, D, generator=g, device=dev).to(dtype)
    kq, ks = kernels.quantize_keys_int4(k)
    bounds = kernels.quest_build(k, kv_lens, a.page_size)
    ref: dict = {}
    base: dict = {}
    for kind, fn in calls(k, v, kq, ks, None, bounds).items():
        if kind in a.kinds:
            ref[kind] = fn().float()
            base[kind] = row(kind, "contiguous", None, time_fn(fn), None)["us"]
    res["ratios_paged_vs_contiguous"] = {}
    for bs in a.block_sizes:
        pg = torch.Generator().manual_seed(a.seed + bs)
        k_pool, table = scatter_to_pool(k, bs, pg, poison=0.0)  # the same shuffle for K and V:
        v_pool, table_v = scatter_to_pool(v, bs, torch.Generator().manual_seed(a.seed + bs), poison=0.0)
        assert torch.equal(table, table_v)
        kq_pool, table_q = scatter_to_pool(kq, bs, torch.Generator().manual_seed(a.seed + bs), poison=0)
        ks_pool, table_s = scatter_to_pool(ks[..., None], bs, torch.Generator().manual_seed(a.seed + bs), poison=0.0)
        assert torch.equal(table, table_q) and torch.equal(table, table_s)
        spb = -(-bs // a.page_size)
        pool_bounds = tuple(torch.zeros(k_pool.shape[0], Hkv, spb, D, dtype=dtype, device=dev) for _ in range(2))
        kernels.quest_write_pool(*pool_bounds, *bounds, table, kv_lens, a.page_size, bs)
        for kind, fn in calls(k_pool, v_pool, kq_pool, ks_pool[..., 0], table, pool_bounds).items():
            if kind not in a.kinds:
                continue
            out = fn().float()
            # score: the selections compared (sorted indices): 0 when they are the same set
            err = float((out - ref[kind]).norm() / ref[kind].norm().clamp_min(1e-12))
            r = row(kind, "paged", bs, time_fn(fn), err)
            res["ratios_paged_vs_contiguous"][f"{kind}/bs={bs}"] = r["us"] / base[kind]
        del k_pool, v_pool, kq_pool, ks_pool, pool_bounds
        if cuda:
            torch.cuda.empty_cache()
    ratios = res["ratios_paged_vs_contiguous"]
    res["within_target"] = {name: x <= TARGET_RATIO for name, x in ratios.items()}
    print("paged / contiguous:", {n: round(x, 3) for n, x in ratios.items()}, f"(target <= {TARGET_RATIO})")
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1))
        print(f"wrote {out}")
    return res


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())

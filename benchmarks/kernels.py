"""All of spade's kernel benchmarks in one run: each kernel vs its torch reference vs its byte floor.

Qwen3-8B attention layer (32 q / 8 KV heads, d=128), bf16; B in {1, 8, 32},
L in {8k, 32k, 128k}, budget K in {1k, 2k} (the headline shape B=8, L=32k runs
first). Per shape:

* ``sparse_attn``: decode attention through index lists (4 sinks + K-68 random
  middle tokens + a 64-token recent window), side by side: ``fused`` (the split
  merge inside the one launch), ``single`` (one split per (b, KV head): no merge at all), ``fused_graph``
  (replayed from a CUDA graph: no host launch gaps), vs ``torch`` (``gather`` +
  SDPA); floor = the selected K/V bytes. Diagnostic rows: ``fused_sorted``
  (sorted indices), ``fused_contig`` (one contiguous run: the sequential access
  the floor assumes), ``torch_contig`` (SDPA over K contiguous tokens): the gap
  between ``fused`` and ``fused_contig`` is the cost of random rows in DRAM, not
  of the kernel;
* ``dense_attn``: the ``indices=None`` path (``fused``) vs SDPA; floor
  = the whole cache;
* ``gather``: ``gather_kv`` vs ``torch.gather``; floor = read + write;
* ``quest_scores``: Quest page scores (page 16) vs two torch matmuls; floor = the
  page metadata (kmin + kmax) bytes;
* ``quest_select``: scores + top pages + expansion token indices: ``radix``
  (plan inside the score kernel + multi-program radix top-K + expansion),
  ``rowselect`` (score kernel + one program per row selecting and expanding:
  two launches),
  each eager and replayed from a CUDA graph, vs torch (also from a graph);
  floor = the page metadata bytes.

``--sweep`` adds, per shape, the attention kernel at split counts
{1, 2, 4, 8, 16, 32} and, at the headline shape, its
launch configs (BLOCK_N, warps, stages); at three shapes the Quest score
kernel's and row-select kernel's tile configs (``spade.kernels.quest.QUEST_CONFIG``).

Scoring rows (score + top-K, group scores, Quest build) come from
``benchmarks.bench_scoring`` (its ``main`` with ``--full`` where it has one),
folded into this run's JSON, table and plot; a missing or failing scoring
benchmark is reported, not fatal.

Floors are bytes / bandwidth, the bandwidth measured in the same run by a
device-to-device copy (read + write bytes). Times: median of CUDA-event timings,
L2 flushed before every call. Shapes that do not fit in memory are skipped with
the reason; ``--budget-s`` bounds the whole run (rows past it are recorded as
skipped). The JSON is rewritten after every row, so a run cut short keeps what
it measured; a PNG (x-floor per kernel per shape) and a markdown table follow.

    python -m benchmarks.kernels [--sweep] [--budget-s 420] [--out results/kernels.json]
    python -m benchmarks.kernels --tiny   # seconds on a CPU (Triton interpreter): checks the script
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

# the attention benchmark's torch references and input builders (shared, not copied)
from benchmarks.bench_attention import (Timer, _empty_cache, _rel, full_index, hbm_bandwidth,  # noqa: E402,F401
                                        random_middle, torch_dense, torch_sparse)

HQ, HKV, D = 32, 8, 128
N_SINK, N_RECENT = 4, 64
PAGE = 16
BATCHES = (8, 1, 32)  # headline first
LENGTHS = (32768, 8192, 131072)
BUDGETS = (2048, 1024)
TINY = dict(HQ=4, HKV=2, D=16, N_SINK=2, N_RECENT=4, PAGE=4, BATCHES=(1, 3), LENGTHS=(67,), BUDGETS=(13, 40))
SPLIT_SWEEP = (1, 2, 4, 8, 16, 32)
QUEST_SWEEP = [dict(BLOCK_P=bp, TILES=t, num_stages=st) for bp in (32, 64, 128) for t in (1, 2, 4, 8)
               for st in (2, 3)] + [dict(PER_SM=n) for n in (2, 8, 16)]
QUEST_SWEEP_SHAPES = {(8, 32768), (1, 131072), (32, 32768)}
QUEST_IMPLS = ("radix", "rowselect")
ROWSELECT_SWEEP = [dict(SEL_BLOCK=b, SEL_BLOCK_E=e, SEL_WARPS=w) for b in (1024, 4096) for e in (64, 256)
                   for w in (4, 8)]
ATTN_CONFIGS = [(32, 4, 3), (32, 4, 4), (32, 2, 4), (64, 4, 2), (64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 8, 3)]
HEADLINE = (8, 32768, 2048)
SCORING_MIN_S = 150.0  # bench_scoring cannot be stopped midway: start it only with this much budget left
TARGET_X_FLOOR = 1.3


# ----------------------------------------------------------------------------- recording
class Recorder:
    """Rows of the run; the JSON file is rewritten after every row."""

    def __init__(self, path: Path, meta: dict, budget_s: float):
        self.path, self.meta, self.rows = path, meta, []
        self.t0, self.budget_s = time.time(), budget_s
        path.parent.mkdir(parents=True, exist_ok=True)
        self.flush()

    def left_s(self) -> float:
        return self.budget_s - (time.time() - self.t0)

    def flush(self) -> None:
        doc = dict(self.meta, rows=self.rows, wall_s=round(time.time() - self.t0, 2))
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(self.path)  # a reader never sees a half-written file

    def skip(self, op: str, impl: str, shape: dict, reason: str) -> None:
        self.rows.append(dict(op=op, impl=impl, **shape, skipped=reason))
        print(f"{op:14s} {impl:12s} {_dims(shape):26s} skipped: {reason}", flush=True)
        self.flush()

    def add(self, op: str, impl: str, shape: dict, timed: Callable[[], float], floor_bytes: int | None,
            bw: float, **extra) -> dict | None:
        """Time one variant (``timed`` returns ms) unless the budget is spent; a
        failure (e.g. out of memory, capture refused) is recorded as the row's error."""
        if self.left_s() <= 0:
            self.skip(op, impl, shape, "budget spent (--budget-s)")
            return None
        try:
            ms = float(timed())
            err = None
        except Exception as e:  # noqa: BLE001 - one failed variant must not end the run
            ms, err = None, f"{type(e).__name__}: {str(e)[:160]}"
            _empty_cache()
        floor_ms = floor_bytes / bw * 1e3 if floor_bytes else None
        row = dict(op=op, impl=impl, **shape, ms=ms, floor_ms=floor_ms,
                   x_floor=ms / floor_ms if ms is not None and floor_ms else None, **extra)
        if err:
            row["error"] = err
        self.rows.append(row)
        t = f"{ms:9.4f} ms" if ms is not None else f"failed ({err})"
        xf = f"{row['x_floor']:7.2f}x floor" if row["x_floor"] is not None else ""
        more = " ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items())
        print(f"{op:14s} {impl:12s} {_dims(shape):26s} {t} {xf} {more}", flush=True)
        self.flush()
        return row


def _dims(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


# ----------------------------------------------------------------------------- torch references
def torch_page_scores(q, kmin, kmax, scale: float):
    """Quest bounds as two matmuls on the positive / negative query parts, fp32
    group sum: [B, Hkv, P]."""
    B, Hq, Dq = q.shape
    Hkv = kmin.shape[1]
    qg = q.view(B, Hkv, Hq // Hkv, Dq)
    s = qg.clamp(min=0) @ kmax.transpose(-1, -2) + qg.clamp(max=0) @ kmin.transpose(-1, -2)  # [B, Hkv, G, P]
    return s.float().sum(2) * scale


def torch_quest_select(q, kmin, kmax, kv_lens, n_sel: int, page: int, scale: float):
    """Quest selection in torch: page scores, the last page forced, ``topk`` of the
    others, expansion to token indices."""
    import torch

    s = torch_page_scores(q, kmin, kmax, scale)  # [B, Hkv, P]
    P = s.shape[-1]
    n_pages = (kv_lens.long() + page - 1) // page  # [B]
    pidx = torch.arange(P, device=s.device)
    s = s.masked_fill(pidx[None, None, :] >= (n_pages - 1)[:, None, None], float("-inf"))
    top = s.topk(n_sel - 1, dim=-1).indices  # [B, Hkv, n_sel - 1]
    last = (n_pages - 1).view(-1, 1, 1).expand(-1, s.shape[1], 1)
    pages = torch.cat([last, top], -1)
    tok = pages[..., None] * page + torch.arange(page, device=s.device)
    return tok.flatten(2).int()


# ----------------------------------------------------------------------------- one shape
def run_shape(rec: Recorder, timer: Timer, bw: float, B: int, L: int, cfg: dict, *, sweep: bool,
              graphs: bool, device) -> None:
    import torch

    from spade.kernels import attention, gather, quest

    hq, hkv, d, n_sink, n_recent, page, dtype = (cfg[k] for k in ("HQ", "HKV", "D", "N_SINK", "N_RECENT", "PAGE",
                                                                   "dtype"))
    elem = torch.finfo(dtype).bits // 8
    q = torch.randn(B, hq, d, device=device, dtype=dtype)
    k = torch.randn(B, hkv, L, d, device=device, dtype=dtype)
    v = torch.randn(B, hkv, L, d, device=device, dtype=dtype)
    kv_lens = torch.full((B,), L, device=device, dtype=torch.int32)
    kv_bytes = 2 * B * hkv * L * d * elem
    shape = dict(B=B, L=L)

    def attn(idx=None, **kw):
        return attention.sparse_decode_attention_triton(q, k, v, kv_lens, idx, n_sink=n_sink if idx is not None else 0,
                                                        n_recent=n_recent if idx is not None else 0, **kw)

    # dense decode attention (the `full` policy) vs SDPA over the whole cache
    err = _safe_err(lambda: attn(), lambda: torch_dense(q, k, v))
    rec.add("dense_attn", "fused", dict(shape, K=L), lambda: timer(lambda: attn()), kv_bytes, bw, rel_err=err)
    rec.add("dense_attn", "torch", dict(shape, K=L), lambda: timer(lambda: torch_dense(q, k, v)), kv_bytes, bw)

    n_pages = (L + page - 1) // page
    kmin, kmax = quest.quest_build_triton(k, kv_lens, page)
    meta_bytes = 2 * B * hkv * n_pages * d * elem
    scale = d ** -0.5
    n_pages_t = torch.full((B,), n_pages, device=device, dtype=torch.int32)
    s_ref = torch_page_scores(q, kmin, kmax, scale)
    s_err = _safe_err(lambda: quest.quest_page_scores_triton(q, kmin, kmax, n_pages_t), lambda: s_ref)
    rec.add("quest_scores", "triton", shape, lambda: timer(lambda: quest.quest_page_scores_triton(
        q, kmin, kmax, n_pages_t)), meta_bytes, bw, rel_err=s_err)
    rec.add("quest_scores", "torch", shape, lambda: timer(lambda: torch_page_scores(q, kmin, kmax, scale)),
            meta_bytes, bw)
    if sweep and (B, L) in QUEST_SWEEP_SHAPES | {cfg.get("TINY_SWEEP_SHAPE")}:
        for over in QUEST_SWEEP:
            tag = "_".join(f"{a}{b}" for a, b in over.items())
            quest.QUEST_CONFIG.clear()
            quest.QUEST_CONFIG.update(over)
            try:
                rec.add("quest_scores", f"cfg_{tag}", shape, lambda: timer(lambda: quest.quest_page_scores_triton(
                    q, kmin, kmax, n_pages_t)), meta_bytes, bw)
            finally:
                quest.QUEST_CONFIG.clear()

    for K in cfg["BUDGETS"]:
        if K >= L:
            rec.skip("sparse_attn", "*", dict(shape, K=K), "K >= L")
            continue
        kshape = dict(shape, K=K)
        mid = random_middle(B, hkv, L, K - n_sink - n_recent, n_sink, n_recent, device)
        idx_full = full_index(mid, L, n_sink, n_recent)
        sel_bytes = 2 * B * hkv * K * d * elem
        err = _safe_err(lambda: attn(mid), lambda: torch_sparse(q, k, v, idx_full))
        variants = {"fused": dict(), "single": dict(num_splits=1)}
        for name, kw in variants.items():
            e = err if name == "fused" else _safe_err(lambda: attn(mid, **kw), lambda: torch_sparse(q, k, v, idx_full))
            rec.add("sparse_attn", name, kshape, lambda: timer(lambda: attn(mid, **kw)), sel_bytes, bw, rel_err=e)
        if graphs:
            rec.add("sparse_attn", "fused_graph", kshape, lambda: timer.graph(lambda: attn(mid)), sel_bytes, bw)
        rec.add("sparse_attn", "torch", kshape, lambda: timer(lambda: torch_sparse(q, k, v, idx_full)), sel_bytes, bw)
        # How much is the memory system's, not the kernel's: the same kernel on sorted
        # middle indices (DRAM locality) and on one contiguous run of them (the
        # sequential best case the floor assumes), and SDPA over K contiguous tokens.
        mid_sorted = mid.sort(dim=-1).values
        c0 = (L - K) // 2
        mid_contig = torch.arange(c0, c0 + mid.shape[-1], device=device, dtype=torch.int32).expand_as(mid).contiguous()
        for name, m in (("fused_sorted", mid_sorted), ("fused_contig", mid_contig)):
            rec.add("sparse_attn", name, kshape, lambda: timer(lambda: attn(m)), sel_bytes, bw)
        kc, vc = k[:, :, :K], v[:, :, :K]
        rec.add("sparse_attn", "torch_contig", kshape, lambda: timer(lambda: torch_dense(q, kc, vc)), sel_bytes, bw)
        del mid_sorted, mid_contig, kc, vc
        if sweep:
            for S in SPLIT_SWEEP:
                rec.add("sparse_attn", f"S{S}_fused", kshape, lambda: timer(lambda: attn(mid, num_splits=S)),
                        sel_bytes, bw)
            if (B, L, K) == cfg.get("HEADLINE"):
                for bn, nw, ns in ATTN_CONFIGS:
                    kw = dict(block_n=bn, num_warps=nw, num_stages=ns)
                    rec.add("sparse_attn", f"cfg_bn{bn}_w{nw}_s{ns}", kshape, lambda: timer(lambda: attn(mid, **kw)),
                            sel_bytes, bw)

        # gather of the selected K/V (the `kv` return mode)
        g = idx_full.long()[..., None].expand(-1, -1, -1, d)
        ks, vs = gather.gather_kv_triton(k, v, idx_full)
        exact = bool(torch.equal(ks, torch.gather(k, 2, g)) and torch.equal(vs, torch.gather(v, 2, g)))
        del ks, vs
        rec.add("gather", "triton", kshape, lambda: timer(lambda: gather.gather_kv_triton(k, v, idx_full)),
                2 * sel_bytes, bw, exact=exact)
        rec.add("gather", "torch", kshape, lambda: timer(lambda: (torch.gather(k, 2, g), torch.gather(v, 2, g))),
                2 * sel_bytes, bw)
        del g

        # Quest select at the same token budget (K / page pages)
        n_sel = max(2, K // page)
        if n_sel > n_pages:
            rec.skip("quest_select", "*", kshape, "more pages than the context")
        else:
            t_ref = torch_quest_select(q, kmin, kmax, kv_lens, n_sel, page, scale)
            for impl in QUEST_IMPLS:
                def sel(impl=impl):
                    return quest.quest_select_triton(q, kmin, kmax, kv_lens, n_sel, page, impl=impl)

                ok = _same_selection(sel(), t_ref, s_ref, page)
                rec.add("quest_select", impl, kshape, lambda: timer(sel), meta_bytes, bw, selection_ok=ok)
                if graphs:
                    rec.add("quest_select", f"{impl}_graph", kshape, lambda: timer.graph(sel), meta_bytes, bw)
            if sweep and (B, L) in QUEST_SWEEP_SHAPES | {cfg.get("TINY_SWEEP_SHAPE")}:
                for over in ROWSELECT_SWEEP:
                    tag = "_".join(f"{a}{b}" for a, b in over.items())
                    quest.QUEST_CONFIG.clear()
                    quest.QUEST_CONFIG.update(over)
                    try:
                        rec.add("quest_select", f"cfg_rowselect_{tag}", kshape, lambda: timer(
                            lambda: quest.quest_select_triton(q, kmin, kmax, kv_lens, n_sel, page, impl="rowselect")),
                            meta_bytes, bw)
                    finally:
                        quest.QUEST_CONFIG.clear()
            rec.add("quest_select", "torch", kshape, lambda: timer(
                lambda: torch_quest_select(q, kmin, kmax, kv_lens, n_sel, page, scale)), meta_bytes, bw)
            if graphs:
                rec.add("quest_select", "torch_graph", kshape, lambda: timer.graph(
                    lambda: torch_quest_select(q, kmin, kmax, kv_lens, n_sel, page, scale)), meta_bytes, bw)
        del mid, idx_full
    del q, k, v, kmin, kmax
    _empty_cache()


def _safe_err(a_fn, b_fn) -> float | str:
    try:
        return _rel(a_fn(), b_fn())
    except Exception as e:  # noqa: BLE001
        _empty_cache()
        return f"error: {type(e).__name__}: {str(e)[:120]}"


def _same_selection(idx, ref_idx, scores, page: int) -> bool:
    """Both selections keep the same total page score (ties may pick other pages)."""
    import torch

    def total(i):
        pages = (i[..., ::page].long() // page).clamp(min=0)  # first token of each selected page
        return torch.gather(scores, 2, pages).sum(-1)

    a, b = total(idx), total(ref_idx)
    return bool(((a - b).abs() <= 1e-3 * b.abs().clamp_min(1.0)).all())


# ----------------------------------------------------------------------------- scoring rows
def run_scoring(rec: Recorder, out_dir: Path, *, sweep: bool) -> None:
    """Fold ``benchmarks.bench_scoring`` rows in (``--full`` where it has one)."""
    try:
        from benchmarks import bench_scoring
    except Exception as e:  # noqa: BLE001 - absent or broken: report and go on
        rec.skip("scoring", "*", {}, f"benchmarks.bench_scoring not importable: {type(e).__name__}: {e}")
        return
    src = inspect.getsource(bench_scoring)
    path = out_dir / "kernels_scoring.json"
    argv = ["--out", str(path)]
    if '"--full"' in src:
        argv.append("--full")
    if sweep and '"--sweep"' in src:
        argv.append("--sweep")
    if '"--budget-s"' in src:
        argv += ["--budget-s", str(max(1, int(rec.left_s())))]
    print(f"# benchmarks.bench_scoring {' '.join(argv)}", flush=True)
    try:
        rc = bench_scoring.main(argv)
    except BaseException as e:  # noqa: BLE001 - includes SystemExit from its argparse
        rec.skip("scoring", "*", {}, f"bench_scoring failed: {type(e).__name__}: {e}")
        return
    try:
        rows = json.loads(path.read_text())["rows"]
    except Exception as e:  # noqa: BLE001
        rec.skip("scoring", "*", {}, f"bench_scoring (rc={rc}) wrote no readable rows: {type(e).__name__}: {e}")
        return
    for r in rows:
        r = dict(r)
        r["op"] = f"scoring:{r.get('op')}"
        r.setdefault("impl", "?")
        rec.rows.append(r)
    rec.meta["scoring_rc"] = rc
    rec.flush()


# ----------------------------------------------------------------------------- report
def markdown_table(rows: list[dict]) -> str:
    """One line per (op, shape): each variant's ms and x-floor side by side."""
    groups: dict[tuple, dict] = {}
    impls: dict[str, list[str]] = {}
    best: dict[tuple, dict] = {}
    for r in rows:
        if "skipped" in r or r.get("ms") is None:
            continue
        if _is_sweep(r):
            key = (r["op"], r.get("B"), r.get("L"), r.get("K"))
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
            continue
        key = (r["op"], r.get("B"), r.get("L"), r.get("K"))
        groups.setdefault(key, {})[r["impl"]] = r
        impls.setdefault(r["op"], [])
        if r["impl"] not in impls[r["op"]]:
            impls[r["op"]].append(r["impl"])
    lines = []
    for op, names in impls.items():
        lines.append(f"\n### {op}\n")
        lines.append("| B | L | K | floor ms | " + " | ".join(f"{n} ms (x floor)" for n in names) + " |")
        lines.append("|" + " ---: |" * (4 + len(names)))
        for (o, B, L, K), vs in groups.items():
            if o != op:
                continue
            fl = next((x["floor_ms"] for x in vs.values() if x.get("floor_ms")), None)
            cells = []
            for n in names:
                x = vs.get(n)
                if x is None:
                    cells.append("-")
                elif x.get("x_floor"):
                    cells.append(f"{x['ms']:.4f} ({x['x_floor']:.2f})")
                else:
                    cells.append(f"{x['ms']:.4f}")
            lines.append(f"| {B} | {L} | {K if K is not None else '-'} | "
                         f"{f'{fl:.4f}' if fl else '-'} | " + " | ".join(cells) + " |")
    if best:
        lines.append("\n### sweeps: fastest variant per shape (all of them in the JSON)\n")
        lines.append("| op | B | L | K | variant | ms | x floor |")
        lines.append("| --- | ---: | ---: | ---: | --- | ---: | ---: |")
        for (op, B, L, K), r in best.items():
            xf = f"{r['x_floor']:.2f}" if r.get("x_floor") else "-"
            lines.append(f"| {op} | {B} | {L} | {K if K is not None else '-'} | {r['impl']} | {r['ms']:.4f} | {xf} |")
    return "\n".join(lines)


def _is_sweep(r: dict) -> bool:
    """Rows of ``--sweep`` (split counts ``S<n>_*``, tile configs ``cfg_*``)."""
    impl = r.get("impl", "")
    return impl.startswith("cfg_") or (impl[:1] == "S" and impl[1:2].isdigit())


def plot(rows: list[dict], path: Path) -> str | None:
    """x-floor per kernel (one panel per op) per shape, one series per variant
    (sweep rows left out); the 1.3x target as a dashed line. Returns a reason when
    no plot is written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        return f"matplotlib unavailable: {e}"
    ops: dict[str, dict[str, dict[str, float]]] = {}
    for r in rows:
        if r.get("x_floor") is None or _is_sweep(r):
            continue
        shape = f"B{r.get('B')} L{r.get('L')}" + (f" K{r['K']}" if r.get("K") not in (None, r.get("L")) else "")
        ops.setdefault(r["op"], {}).setdefault(r["impl"], {})[shape] = r["x_floor"]
    if not ops:
        return "no timed rows with a floor"
    n = len(ops)
    cols = min(3, n)
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 3.6 * nrows), squeeze=False)
    for ax, (op, series) in zip(axes.flat, ops.items()):
        shapes = sorted({s for v in series.values() for s in v}, key=_shape_key)
        for impl, pts in series.items():
            xs = [i for i, s in enumerate(shapes) if s in pts]
            ax.plot(xs, [pts[shapes[i]] for i in xs], marker="o", label=impl)
        ax.axhline(TARGET_X_FLOOR, ls="--", c="gray", lw=1)
        ax.axhline(1.0, c="k", lw=0.5)
        ax.set_yscale("log")
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes, rotation=45, ha="right", fontsize=7)
        ax.set_title(op, fontsize=9)
        ax.set_ylabel("time / byte floor")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _free_bytes(cuda: bool, device) -> int:
    """Free device memory (a CPU run pretends 16 GiB)."""
    import torch

    return torch.cuda.mem_get_info(device)[0] if cuda else 2**34


def _shape_key(s: str) -> tuple:
    return tuple(int(p[1:]) for p in s.split())


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (1 without a GPU unless --tiny)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/kernels.json", help="JSON path (the PNG and .md go beside it)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="wall-clock budget of the whole run (bench_scoring runs only with >= "
                         f"{SCORING_MIN_S:.0f} s left, and gets the rest as its own budget where it takes one)")
    ap.add_argument("--sweep", action="store_true", help="split counts x merges, Quest score tile configs")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per measurement")
    ap.add_argument("--no-scoring", action="store_true", help="leave out benchmarks.bench_scoring")
    ap.add_argument("--shapes", default=None, help="comma list of BxL (e.g. 8x32768,1x8192) instead of the grid")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny shapes on any device (CPU: Triton interpreter): checks the script, not speed")
    args = ap.parse_args(argv)

    if args.tiny:
        # the interpreter must be chosen before triton is first imported
        try:
            import torch as _t

            if not _t.cuda.is_available():
                os.environ.setdefault("TRITON_INTERPRET", "1")
        except ImportError:
            pass
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print("benchmarks.kernels needs a CUDA GPU (or --tiny)", file=sys.stderr)
        return 1
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        print("--tiny on a CPU needs TRITON_INTERPRET=1 before triton is imported", file=sys.stderr)
        return 1
    import triton

    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = dict(HQ=HQ, HKV=HKV, D=D, N_SINK=N_SINK, N_RECENT=N_RECENT, PAGE=PAGE, BATCHES=BATCHES, LENGTHS=LENGTHS,
               BUDGETS=BUDGETS, dtype=torch.bfloat16, HEADLINE=HEADLINE)
    if args.tiny:
        cfg.update(TINY, dtype=torch.bfloat16 if cuda else torch.float32, TINY_SWEEP_SHAPE=(1, 67),
                   HEADLINE=(1, 67, 13))
    iters = args.iters or (2 if args.tiny else 30)
    timer = Timer(iters, warmup=1 if args.tiny else 3, device="cuda" if cuda else "cpu")
    bw = hbm_bandwidth(timer, 2**20 if args.tiny else 2**30, device=device)
    if cuda:
        props = torch.cuda.get_device_properties(device)
        name, sms = props.name, props.multi_processor_count
    else:
        name, sms = "cpu (Triton interpreter)", 0
    out = Path(args.out)
    meta = dict(device=name, sms=sms, copy_bytes_per_s=bw, torch=torch.__version__, triton=triton.__version__,
                dtype=str(cfg["dtype"]), heads=dict(q=cfg["HQ"], kv=cfg["HKV"], d=cfg["D"]), n_sink=cfg["N_SINK"],
                n_recent=cfg["N_RECENT"], page_size=cfg["PAGE"], iters=iters, tiny=args.tiny, sweep=args.sweep,
                budget_s=args.budget_s, target_x_floor=TARGET_X_FLOOR, argv=list(argv or sys.argv[1:]))
    rec = Recorder(out, meta, args.budget_s)
    print(f"# {name} ({sms} SMs), copy bandwidth {bw / 1e9:.0f} GB/s (read+write); {cfg['HQ']} q / {cfg['HKV']} KV "
          f"heads, d={cfg['D']}, {cfg['dtype']}; budget {args.budget_s:.0f} s", flush=True)

    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    else:
        shapes = [(B, L) for B in cfg["BATCHES"] for L in cfg["LENGTHS"]]
    elem = torch.finfo(cfg["dtype"]).bits // 8
    for B, L in shapes:
        kv_bytes = 2 * B * cfg["HKV"] * L * cfg["D"] * elem
        need = 2.6 * kv_bytes + 2**30  # cache + SDPA / gather / Quest workspaces + slack
        free = _free_bytes(cuda, device)
        if need > free:
            rec.skip("*", "*", dict(B=B, L=L), f"does not fit: needs ~{need / 2**30:.1f} GiB, "
                                               f"{free / 2**30:.1f} GiB free")
            continue
        if rec.left_s() <= 0:
            rec.skip("*", "*", dict(B=B, L=L), "budget spent (--budget-s)")
            continue
        try:
            run_shape(rec, timer, bw, B, L, cfg, sweep=args.sweep, graphs=cuda, device=device)
        except torch.cuda.OutOfMemoryError as e:
            _empty_cache()
            rec.skip("*", "*", dict(B=B, L=L), f"out of memory: {str(e)[:120]}")

    if args.no_scoring:
        pass
    elif not cuda:
        rec.skip("scoring", "*", {}, "bench_scoring needs a CUDA GPU")
    elif rec.left_s() < SCORING_MIN_S:
        rec.skip("scoring", "*", {}, "budget spent (--budget-s) before bench_scoring")
    else:
        run_scoring(rec, out.parent, sweep=args.sweep)

    table = markdown_table(rec.rows)
    print(table)
    out.with_suffix(".md").write_text(f"# Kernel benchmarks ({name})\n" + table + "\n")
    why = plot(rec.rows, out.with_suffix(".png"))
    rec.meta["plot"] = why or str(out.with_suffix(".png"))
    rec.flush()
    print(f"# wrote {out}, {out.with_suffix('.md')}" + (f", {out.with_suffix('.png')}" if not why else f" (no plot: {why})")
          + f" ({time.time() - rec.t0:.0f} s)")
    bad = [r for r in rec.rows if r.get("selection_ok") is False or r.get("exact") is False
           or (isinstance(r.get("rel_err"), float) and r["rel_err"] > 3e-2)]
    for r in bad:
        print(f"# MISMATCH: {r}", file=sys.stderr)
    return 2 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

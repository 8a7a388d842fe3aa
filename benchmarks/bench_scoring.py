"""GPU microbenchmark of spade's selection kernels against torch and the byte floor.

Qwen3-8B attention layer (32 q / 8 KV heads, d=128), bf16, B in {1, 8, 32},
L in {8k, 32k, 128k} (shapes that do not fit are skipped), budget K in {1k, 2k};
candidates ``[4, L - 64)`` (4 sinks and a 64-token recent window excluded):

* ``group_scores``: the Triton GQA scoring kernel vs torch ``matmul`` + group sum;
* ``score_topk``: the fused scoring + exact radix top-K vs the naive torch
  selection (``matmul`` + ``torch.topk``), also replayed from a CUDA graph (no
  host launch gaps; shows the op is capturable);
* ``quest_build``, ``quest_page_scores``, ``quest_select`` (page size 16,
  K / 16 pages) vs torch (two ``matmul`` on the positive / negative query parts);
* ``score_topk`` over int8 keys (``triton_int8``: the symmetric per-token copy
  of ``spade.kernels.quant`` that ``asyncspade``'s ``score_keys="int8"`` scores),
  floor = int8 key bytes + fp32 scale bytes of the candidates; its selection is
  checked against the naive top-K of the int8 scores, and its overlap with the
  exact-key selection is recorded (random keys: a pessimistic stand-in);
* the same over packed int4 keys (``triton_int4``: ``score_keys="int4"``'s copy,
  smoothed per channel with the smoothing folded into the query), floor = D/2
  bytes + a fp32 scale per token;
* ``score_topk_softmax`` (``sum_softmax``) rows, exact, int8 and int4, at every shape,
  and int8 / int4 through the float tile (``*_tile``: the int8-tensor-core logits off);
* ``variants``: the pass-0 histogram fused into stage 1 or not, stage-2 tile
  sizes, and ``sum_softmax`` with per-element online statistics
  (``SCORE_CONFIG["LANE_STATS"]``), at a few shapes;
* ``--sweep``: tile configs of the scoring kernel at B=8, L=32k;
* ``--softmax-sweep BxL,...``: ``sum_softmax``'s two passes (logits, finalize) under the
  launch configs of ``SOFTMAX_SWEEP`` over int4 / int8 keys: scores alone, + radix top-K,
  + threshold carry (eager medians, host launch cost included), and the carry path's
  kernels by device time (torch.profiler: what a CUDA graph replays; the row's time, and
  its floor ratio, on a GPU); ``--no-grid`` skips the shape grid.

Floors: bytes that must be read (keys of the candidate range once; Quest page
bounds once) over the HBM bandwidth measured in the same run by a large
device-to-device copy (read + write bytes). Times are medians of
``triton.testing.do_bench`` (L2 flushed before each call). Every shape also
checks the fused selection against the naive one through the fp32 scores.

The JSON is rewritten after every row (a run cut short keeps what it measured);
``--budget-s`` bounds the wall time (shapes past it are listed as skipped with
the reason, as are shapes that do not fit in memory); a PNG beside the JSON
plots x floor per shape for the selection rows.

    python -m benchmarks.bench_scoring [--quick | --full] [--sweep] [--budget-s S] [--out results/bench_scoring.json]
    python -m benchmarks.bench_scoring --tiny   # seconds on a CPU (Triton interpreter): checks the script
    python -m benchmarks.bench_scoring --no-grid --softmax-sweep 16x16384,8x32768   # sum_softmax's launch configs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

HQ, HKV, D = 32, 8, 128
G = HQ // HKV
N_SINK, N_RECENT = 4, 64
PAGE = 16
DTYPE = torch.bfloat16
ELT = 2  # bytes per bf16 element
DEVICE = "cuda"


# ------------------------------------------------------------------------------------- timing
def bench(fn: Callable[[], object], *, warmup: int = 10, rep: int = 40) -> float:
    """Median time of ``fn`` in ms (``triton.testing.do_bench``: L2 flushed per call;
    the wall clock of one call on a CPU, where only the script is being checked)."""
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def bench_graph(fn: Callable[[], object], **kw) -> float | None:
    """Median time of ``fn`` replayed from a CUDA graph (None if capture fails or on CPU)."""
    if DEVICE != "cuda":
        return None
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()  # warm-up: compile and allocate outside the capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return bench(g.replay, **kw)
    except Exception as e:  # report, do not abort the whole run
        print(f"  (graph capture failed: {type(e).__name__}: {e})", file=sys.stderr)
        return None


def hbm_bandwidth(nbytes: int = 2**30) -> float:
    """Bytes/s of a device-to-device copy, counting read + write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), rep=100)
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


# --------------------------------------------------------------------------- torch baselines
def naive_scores(q: torch.Tensor, k: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scale: float) -> torch.Tensor:
    """sum_logits group scores the way one writes them in torch: one batched matmul per
    KV head (bf16 out), fp32 group sum, ``-inf`` outside ``[lo, hi)``. [B, Hkv, L] fp32."""
    B, L = k.shape[0], k.shape[2]
    s = torch.matmul(q.view(B, HKV, G, D), k.transpose(-1, -2)).float().sum(2) * scale  # [B, Hkv, L]
    pos = torch.arange(L, device=k.device)
    ok = (pos >= lo[:, None]) & (pos < hi[:, None])  # [B, L]
    return s.masked_fill(~ok[:, None, :], float("-inf"))


def naive_topk(q, k, lo, hi, k_top: int, scale: float) -> torch.Tensor:
    """The naive selection: full scores, then ``torch.topk``."""
    return naive_scores(q, k, lo, hi, scale).topk(k_top, dim=-1).indices.to(torch.int32)


def torch_page_scores(q, kmin, kmax, n_pages, scale: float) -> torch.Tensor:
    """Quest bounds in torch: ``q⁺·kmax + q⁻·kmin`` as two matmuls, fp32 group sum. [B, Hkv, P]."""
    B, P = kmin.shape[0], kmin.shape[2]
    qg = q.view(B, HKV, G, D)
    s = (torch.matmul(qg.clamp(min=0), kmax.transpose(-1, -2)).float()
         + torch.matmul(qg.clamp(max=0), kmin.transpose(-1, -2)).float()).sum(2) * scale
    ok = torch.arange(P, device=q.device) < n_pages[:, None]
    return s.masked_fill(~ok[:, None, :], float("-inf"))


def torch_quest_select(q, kmin, kmax, kv_lens, n_sel: int, scale: float) -> torch.Tensor:
    """Quest selection in torch: page scores, last page forced, ``topk``, expand to tokens."""
    B = q.shape[0]
    n_pages = (kv_lens + PAGE - 1) // PAGE
    last = n_pages - 1
    s = torch_page_scores(q, kmin, kmax, n_pages, scale)
    s.scatter_(2, last.view(B, 1, 1).expand(B, HKV, 1), float("-inf"))
    top = s.topk(n_sel - 1, dim=-1).indices  # [B, Hkv, n_sel - 1]
    pages = torch.cat([last.view(B, 1, 1).expand(B, HKV, 1), top], dim=-1)
    tok = pages[..., None] * PAGE + torch.arange(PAGE, device=q.device)
    tok = torch.where(tok < kv_lens.view(B, 1, 1, 1), tok, -1)
    return tok.view(B, HKV, -1).to(torch.int32)


# ------------------------------------------------------------------------------------ checks
def selection_deficit(idx: torch.Tensor, ref_idx: torch.Tensor, scores: torch.Tensor) -> float:
    """Relative shortfall of ``idx``'s summed scores vs ``ref_idx``'s (<= ~1e-6 when both
    are exact top-K of ``scores``; ties make the index sets differ, not the sums)."""
    def total(i):
        i = i.long()
        return torch.where(i >= 0, scores.gather(2, i.clamp(min=0)), 0.0).double().sum(-1)

    a, b = total(idx), total(ref_idx)
    return float(((b - a) / b.abs().clamp(min=1e-12)).max())


# ------------------------------------------------------------------------------------- runner
class Runner:
    """Collects rows and rewrites the JSON document ``doc`` at ``path`` after every row."""

    def __init__(self, bw: float, rows: list, *, path: Path | None = None, doc: dict | None = None,
                 budget_s: float | None = None):
        self.bw, self.rows = bw, rows
        self.path, self.doc = path, doc if doc is not None else {}
        self.t0 = time.time()
        self.budget_s = budget_s

    def left_s(self) -> float:
        return float("inf") if self.budget_s is None else self.budget_s - (time.time() - self.t0)

    def flush(self) -> None:
        if self.path is None:
            return
        self.doc["rows"] = self.rows
        self.doc["seconds"] = time.time() - self.t0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1))
        tmp.replace(self.path)  # never a half-written file, even if killed mid-write

    def skip(self, shape: dict, reason: str) -> None:
        self.doc.setdefault("skipped", []).append(dict(**shape, reason=reason))
        print(f"skip {' '.join(f'{k}={v}' for k, v in shape.items())}: {reason}", flush=True)
        self.flush()

    def add(self, op: str, impl: str, shape: dict, ms: float | None, floor_bytes: int | None, **extra):
        floor_ms = floor_bytes / self.bw * 1e3 if floor_bytes else None
        row = dict(op=op, impl=impl, **shape, ms=ms, floor_ms=floor_ms,
                   x_floor=(ms / floor_ms if ms and floor_ms else None), **extra)
        self.rows.append(row)
        fl = f"{floor_ms:8.4f}" if floor_ms else "       -"
        xf = f"{row['x_floor']:6.2f}x" if row["x_floor"] else "      -"
        t = f"{ms:9.4f}" if ms is not None else "     fail"
        dims = " ".join(f"{k}={v}" for k, v in shape.items())
        more = " ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items())
        print(f"{op:18s} {impl:14s} {dims:28s} {t} ms  floor {fl} ms  {xf}  {more}", flush=True)
        self.flush()


def need_bytes(B: int, L: int) -> int:
    """Keys (+ their int8 / int4 copies and scales) + Quest bounds + the naive baseline's
    temporaries + the sum_softmax logits, with 1 GiB headroom."""
    keys = B * HKV * L * D * ELT
    int8 = B * HKV * L * (D + 4) + B * HKV * L * (D // 2 + 4)
    bounds = 2 * keys // PAGE
    naive = B * HQ * L * (ELT + 4) + 3 * B * HKV * L * 4
    softmax = B * HQ * L * 4
    return keys + int8 + bounds + naive + softmax + 2**30


def fits(B: int, L: int) -> tuple[bool, str]:
    """Whether a shape fits in free device memory, and the reason when not."""
    if DEVICE != "cuda":
        return True, ""
    free, _ = torch.cuda.mem_get_info()
    need = need_bytes(B, L)
    if need < 0.85 * free:
        return True, ""
    return False, f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"


def overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean fraction of ``b``'s selected positions that ``a`` also selected ([B, H, K] each)."""
    B, H, K = b.shape
    hit = 0
    n = 0
    a_, b_ = a.cpu(), b.cpu()
    for i in range(B):
        for h in range(H):
            sa = set(a_[i, h].tolist()) - {-1}
            sb = set(b_[i, h].tolist()) - {-1}
            hit += len(sa & sb)
            n += len(sb)
    return hit / max(n, 1)


def run_shape(r: Runner, B: int, L: int, ks: list[int], *, variants: bool) -> None:
    from spade.kernels import quant, quest, radix_topk, scoring

    dev = DEVICE
    scale = D ** -0.5
    g = torch.Generator(device=dev).manual_seed(B * 131 + L)
    q = torch.randn(B, HQ, D, device=dev, generator=g, dtype=DTYPE)
    k = torch.randn(B, HKV, L, D, device=dev, generator=g, dtype=DTYPE)
    kv_lens = torch.full((B,), L, device=dev, dtype=torch.int64)
    lo = torch.full((B,), N_SINK, device=dev, dtype=torch.int64)
    hi = kv_lens - N_RECENT
    shape = dict(B=B, L=L)
    key_bytes = B * HKV * L * D * ELT
    mid_bytes = B * HKV * (L - N_SINK - N_RECENT) * D * ELT

    r.add("group_scores", "triton", shape, bench(lambda: scoring.group_scores_triton(q, k, kv_lens)), key_bytes)
    # sum_softmax scoring alone (stage 1 + finalize, no top-K): isolates what its extra cost comes from
    r.add("group_scores_softmax", "triton", shape,
          bench(lambda: scoring.group_scores_triton(q, k, kv_lens, reduce="sum_softmax")), key_bytes)
    r.add("group_scores", "torch", shape, bench(lambda: naive_scores(q, k, torch.zeros_like(lo), kv_lens, scale)),
          key_bytes)

    kmin, kmax = quest.quest_build_triton(k, kv_lens, PAGE)
    r.add("quest_build", "triton", shape, bench(lambda: quest.quest_build_triton(k, kv_lens, PAGE)), key_bytes)
    n_pages = (kv_lens + PAGE - 1) // PAGE
    meta_bytes = 2 * kmin.numel() * ELT
    r.add("quest_page_scores", "triton", shape,
          bench(lambda: quest.quest_page_scores_triton(q, kmin, kmax, n_pages)), meta_bytes)
    r.add("quest_page_scores", "torch", shape, bench(lambda: torch_page_scores(q, kmin, kmax, n_pages, scale)),
          meta_bytes)

    truth = scoring.group_scores_triton(q, k, kv_lens)  # fp32 scores for the checks
    pscores = quest.quest_page_scores_triton(q, kmin, kmax, n_pages)
    # int8 scoring copy (what asyncspade score_keys="int8" reads): 1 byte per element + a fp32 scale per token
    kq, kscale = quant.quantize_keys_triton(k)
    r.add("quantize_keys", "triton", shape, bench(lambda: quant.quantize_keys_triton(k)),
          key_bytes + B * HKV * L * (D + 4))
    int8_key_bytes = B * HKV * L * (D + 4)
    int8_mid_bytes = B * HKV * (L - N_SINK - N_RECENT) * (D + 4)
    r.add("group_scores", "triton_int8", shape,
          bench(lambda: scoring.group_scores_triton(q, kq, kv_lens, k_scale=kscale)), int8_key_bytes)
    truth8 = scoring.group_scores_triton(q, kq, kv_lens, k_scale=kscale)
    # int4 scoring copy (score_keys="int4"): D/2 bytes per token + a fp32 scale; smoothed per
    # channel, the smoothing folded into the query (once per step: [B, HQ, D], not timed)
    smooth = quant.fit_smoothing(k)
    kq4, kscale4 = quant.quantize_keys_int4_triton(k, smooth)
    q4 = quant.fold_smoothing(q, smooth)
    int4_key_bytes = B * HKV * L * (D // 2 + 4)
    int4_mid_bytes = B * HKV * (L - N_SINK - N_RECENT) * (D // 2 + 4)
    r.add("quantize_keys", "triton_int4", shape, bench(lambda: quant.quantize_keys_int4_triton(k, smooth)),
          key_bytes + int4_key_bytes)
    r.add("group_scores", "triton_int4", shape,
          bench(lambda: scoring.group_scores_triton(q4, kq4, kv_lens, k_scale=kscale4)), int4_key_bytes)
    truth4 = scoring.group_scores_triton(q4, kq4, kv_lens, k_scale=kscale4)
    for K in ks:
        if r.left_s() <= 0:
            r.skip(dict(B=B, L=L, K=K), "--budget-s spent")
            continue
        shp = dict(B=B, L=L, K=K)
        fused = scoring.score_topk_triton(q, k, lo, hi, K)
        naive = naive_topk(q, k, lo, hi, K, scale)
        ok = dict(deficit=selection_deficit(fused, naive, truth))
        r.add("score_topk", "triton", shp, bench(lambda: scoring.score_topk_triton(q, k, lo, hi, K)), mid_bytes, **ok)
        r.add("score_topk", "triton_graph", shp,
              bench_graph(lambda: scoring.score_topk_triton(q, k, lo, hi, K)), mid_bytes)
        r.add("score_topk", "torch_naive", shp, bench(lambda: naive_topk(q, k, lo, hi, K, scale)), mid_bytes)

        for impl, qq, kk, ksc, tr, fb in (("triton_int8", q, kq, kscale, truth8, int8_mid_bytes),
                                          ("triton_int4", q4, kq4, kscale4, truth4, int4_mid_bytes)):
            got = scoring.score_topk_triton(qq, kk, lo, hi, K, k_scale=ksc)
            want = tr.masked_fill(~_cand_mask(lo, hi, L)[:, None, :], float("-inf")).topk(K, dim=-1).indices
            ok = dict(deficit=selection_deficit(got, want.to(torch.int32), tr), overlap_exact=overlap(got, fused))
            r.add("score_topk", impl, shp,
                  bench(lambda: scoring.score_topk_triton(qq, kk, lo, hi, K, k_scale=ksc)), fb, **ok)
            r.add("score_topk", f"{impl}_graph", shp,
                  bench_graph(lambda: scoring.score_topk_triton(qq, kk, lo, hi, K, k_scale=ksc)), fb)
        # sum_softmax: the normaliser spans [0, kv_lens), so the floor reads every key once
        for impl, qq, kk, ksc, fb in (("triton", q, k, None, key_bytes), ("triton_int8", q, kq, kscale, int8_key_bytes),
                                      ("triton_int4", q4, kq4, kscale4, int4_key_bytes)):
            r.add("score_topk_softmax", impl, shp,
                  bench(lambda: scoring.score_topk_triton(qq, kk, lo, hi, K, reduce="sum_softmax", kv_lens=kv_lens,
                                                          k_scale=ksc)), fb)
        # int8 / int4 logits through the float tile (every key element converted) instead of
        # the int8 tensor cores (the default): the two side by side
        for impl, qq, kk, ksc, fb in (("triton_int8_tile", q, kq, kscale, int8_key_bytes),
                                      ("triton_int4_tile", q4, kq4, kscale4, int4_key_bytes)):
            scoring.GEMV_CONFIG.update(int8_dot=False)
            try:
                r.add("score_topk_softmax", impl, shp,
                      bench(lambda: scoring.score_topk_triton(qq, kk, lo, hi, K, reduce="sum_softmax",
                                                              kv_lens=kv_lens, k_scale=ksc)), fb)
            finally:
                scoring.GEMV_CONFIG.clear()

        n_sel = K // PAGE
        t_sel = quest.quest_select_triton(q, kmin, kmax, kv_lens, n_sel, PAGE)
        r_sel = torch_quest_select(q, kmin, kmax, kv_lens, n_sel, scale)
        pages_t = torch.where(t_sel[..., ::PAGE] >= 0, t_sel[..., ::PAGE] // PAGE, -1)
        pages_r = torch.where(r_sel[..., ::PAGE] >= 0, r_sel[..., ::PAGE] // PAGE, -1)
        ok = dict(deficit=selection_deficit(pages_t, pages_r, pscores))
        r.add("quest_select", "triton", shp,
              bench(lambda: quest.quest_select_triton(q, kmin, kmax, kv_lens, n_sel, PAGE)), meta_bytes, **ok)
        r.add("quest_select", "torch", shp,
              bench(lambda: torch_quest_select(q, kmin, kmax, kv_lens, n_sel, scale)), meta_bytes)

    if variants:
        K = max(ks)
        shp = dict(B=B, L=L, K=K)
        for fuse in (True, False):
            radix_topk.SELECT_CONFIG.clear()
            radix_topk.SELECT_CONFIG.update(fuse_hist=fuse)
            try:
                out = scoring.score_topk_triton(q, k, lo, hi, K)
                ok = dict(deficit=selection_deficit(out, naive_topk(q, k, lo, hi, K, scale), truth))
                ms = bench(lambda: scoring.score_topk_triton(q, k, lo, hi, K))
            finally:
                radix_topk.SELECT_CONFIG.clear()
            r.add("score_topk", "fuse_hist" if fuse else "separate_hist0", shp, ms, mid_bytes, **ok)
        for block, warps in ((1024, 4), (2048, 8), (4096, 8)):
            radix_topk.SELECT_CONFIG.update(BLOCK=block, num_warps=warps)
            try:
                ms = bench(lambda: scoring.score_topk_triton(q, k, lo, hi, K))
            finally:
                radix_topk.SELECT_CONFIG.clear()
            r.add("score_topk", f"sel{block}w{warps}", shp, ms, mid_bytes)
        # sum_logits as a GEMV (group collapsed into one query): int8 default vs the
        # tensor-core tile path, bf16 keys through the GEMV, GEMV tile configs
        gemv_rows = [("triton_int8_tc", q, kq, kscale, int8_mid_bytes, dict(use="off")),
                     ("triton_gemv", q, k, None, mid_bytes, dict(use="all")),
                     # int4: the int8-tensor-core GEMV (default for sum_logits), the float GEMV
                     # (converts every nibble) and the bf16 tensor-core tile
                     ("triton_int4_gemv", q4, kq4, kscale4, int4_mid_bytes, {}),
                     ("triton_int4_gemv_noasm", q4, kq4, kscale4, int4_mid_bytes, dict(int4_asm=False)),
                     ("triton_int4_fgemv", q4, kq4, kscale4, int4_mid_bytes, dict(int8_dot=False)),
                     ("triton_int4_tc", q4, kq4, kscale4, int4_mid_bytes, dict(use="off"))]
        for bl, nw, ns in ((64, 4, 4), (128, 4, 3), (128, 8, 4), (256, 8, 3), (32, 2, 4)):
            gemv_rows.append((f"int8_gemv_l{bl}w{nw}s{ns}", q, kq, kscale, int8_mid_bytes,
                              dict(BLOCK_L=bl, num_warps=nw, num_stages=ns)))
        for bl, nw, ns in ((128, 4, 3), (256, 8, 3), (512, 8, 3)):
            gemv_rows.append((f"int4_gemv_l{bl}w{nw}s{ns}", q4, kq4, kscale4, int4_mid_bytes,
                              dict(BLOCK_L=bl, num_warps=nw, num_stages=ns)))
        for name, qq, kk, ksc, fb, over in gemv_rows:
            scoring.GEMV_CONFIG.clear()
            scoring.GEMV_CONFIG.update(over)
            try:
                ms = bench_graph(lambda: scoring.score_topk_triton(qq, kk, lo, hi, K, k_scale=ksc))
                ms_g = bench(lambda: scoring.group_scores_triton(qq, kk, kv_lens, k_scale=ksc))
            except Exception as e:  # a config that does not compile must not lose the others
                print(f"  {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            finally:
                scoring.GEMV_CONFIG.clear()
            r.add("score_topk_graph", name, shp, ms, fb)
            r.add("group_scores", name, shape, ms_g, fb)
        # sum_softmax with the online statistics per tile element (one reduction per chunk)
        scoring.SCORE_CONFIG.update(LANE_STATS=True)
        try:
            ms_g = bench(lambda: scoring.group_scores_triton(q, k, kv_lens, reduce="sum_softmax"))
            ms_t = bench(lambda: scoring.score_topk_triton(q, k, lo, hi, K, reduce="sum_softmax", kv_lens=kv_lens))
        finally:
            scoring.SCORE_CONFIG.clear()
        r.add("group_scores_softmax", "lane_stats", shape, ms_g, key_bytes)
        r.add("score_topk_softmax", "lane_stats", shp, ms_t, key_bytes)
    del q, k, kmin, kmax, truth, pscores, kq, kscale, truth8, kq4, kscale4, q4, truth4
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def _cand_mask(lo: torch.Tensor, hi: torch.Tensor, L: int) -> torch.Tensor:
    """[B, L] bool: lo[b] <= p < hi[b]."""
    pos = torch.arange(L, device=lo.device)
    return (pos[None, :] >= lo[:, None]) & (pos[None, :] < hi[:, None])


def run_sweep(r: Runner) -> None:
    """Tile configs of the scoring kernel (group_scores and score_topk, bf16 and int8
    keys: int8 tiles are half the bytes, so their best tile may differ) at B=8, L=32k."""
    from spade.kernels import quant, scoring

    B, L, K = 8, 32768, 2048
    q = torch.randn(B, HQ, D, device="cuda", dtype=DTYPE)
    k = torch.randn(B, HKV, L, D, device="cuda", dtype=DTYPE)
    kv_lens = torch.full((B,), L, device="cuda")
    lo, hi = torch.full_like(kv_lens, N_SINK), kv_lens - N_RECENT
    key_bytes = B * HKV * L * D * ELT
    kq, kscale = quant.quantize_keys_triton(k)
    configs = [dict(BLOCK_L=bl, num_warps=w, num_stages=st) for bl in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
    configs += [dict(PER_SM=n) for n in (4, 8, 32)]  # grid size at the default tiles (16 programs per SM)
    for over in configs:
        scoring.SCORE_CONFIG.clear()
        scoring.SCORE_CONFIG.update(over)
        cfg = dict(B=B, L=L, **over)
        try:
            ms = bench(lambda: scoring.group_scores_triton(q, k, kv_lens))
            ms_topk = bench(lambda: scoring.score_topk_triton(q, k, lo, hi, K))
            ms_topk8 = bench(lambda: scoring.score_topk_triton(q, kq, lo, hi, K, k_scale=kscale))
        except Exception as e:  # e.g. out of shared memory
            print(f"  config {cfg} failed: {type(e).__name__}", file=sys.stderr)
            ms = ms_topk = ms_topk8 = None
        r.add("sweep_group_scores", "triton", cfg, ms, key_bytes, topk_ms=ms_topk if ms_topk else -1.0,
              topk_int8_ms=ms_topk8 if ms_topk8 else -1.0)
    scoring.SCORE_CONFIG.clear()


SOFTMAX_SWEEP = [  # (logits BLOCK_L, warps, stages, PER_SM, MIN_CHUNK), (finalize BLOCK_L, warps, PER_SM, MIN_CHUNK)
    # [, more SOFTMAX_CONFIG overrides]; the first: the built-in GPU configs (scoring.SOFTMAX_GPU) at int4
    ((256, 4, 3, 8, 512), (1024, 8, 4, 1024)),
    ((64, 4, 3, 16, 256), (64, 4, 16, 256)),
    ((128, 4, 3, 8, 512), (256, 4, 8, 512)),
    ((128, 8, 3, 8, 512), (256, 8, 8, 512)),
    ((256, 8, 3, 8, 512), (256, 4, 8, 512)),
    ((256, 8, 3, 8, 512), (512, 8, 8, 1024)),
    ((128, 4, 2, 16, 256), (1024, 8, 4, 1024)),
    ((256, 4, 3, 8, 512), (512, 4, 8, 512)),
]


def _profile_kernels(fn: Callable[[], object], n: int = 20) -> dict[str, float]:
    """Device microseconds per call of each kernel ``fn`` launches (torch.profiler over
    ``n`` calls after a warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    from benchmarks.trace_summary import kernel_us

    return {name: us / n for name, us in kernel_us(prof, key_len=60).items()}


def softmax_overrides(i: int) -> dict:
    """``scoring.SOFTMAX_CONFIG`` of ``SOFTMAX_SWEEP[i]``."""
    (lb, lw, ls, lp, lm), (fb, fw, fp, fm), *more = SOFTMAX_SWEEP[i]
    return dict(logits_BLOCK_L=lb, logits_num_warps=lw, logits_num_stages=ls, logits_PER_SM=lp, logits_MIN_CHUNK=lm,
                finalize_BLOCK_L=fb, finalize_num_warps=fw, finalize_PER_SM=fp, finalize_MIN_CHUNK=fm,
                **(more[0] if more else {}))


def run_softmax_sweep(r: Runner, shapes: list[tuple[int, int]], K: int = 2048) -> None:
    """``sum_softmax`` over int4 / int8 keys: the two passes' launch configs
    (``scoring.SOFTMAX_CONFIG``) at ``shapes``: the scores alone, the score + top-K with
    the radix select and with the threshold carry (the served path, steady state), each
    config's kernels by device time (the carry rows), selections checked against the
    first config's."""
    from spade.kernels import carry as carry_mod
    from spade.kernels import quant, scoring

    for B, L in shapes:
        ok, why = fits(B, L)
        if not ok:
            r.skip(dict(B=B, L=L, sweep="softmax"), f"does not fit in memory: {why}")
            continue
        g = torch.Generator(device=DEVICE).manual_seed(B * 7 + L)
        q = torch.randn(B, HQ, D, device=DEVICE, generator=g, dtype=DTYPE)
        k = torch.randn(B, HKV, L, D, device=DEVICE, generator=g, dtype=DTYPE)
        kv_lens = torch.full((B,), L, device=DEVICE, dtype=torch.int64)
        lo, hi = torch.full_like(kv_lens, N_SINK), kv_lens - N_RECENT
        smooth = quant.fit_smoothing(k)
        keys = {"int4": (quant.fold_smoothing(q, smooth), *quant.quantize_keys_int4_triton(k, smooth),
                         B * HKV * L * (D // 2 + 4)),
                "int8": (q, *quant.quantize_keys_triton(k), B * HKV * L * (D + 4))}
        del k
        for kname, (qq, kk, ksc, nbytes) in keys.items():
            want = None
            for i, ((lb, lw, ls, lp, lm), (fb, fw, fp, fm), *more) in enumerate(SOFTMAX_SWEEP):
                scoring.SOFTMAX_CONFIG.clear()
                scoring.SOFTMAX_CONFIG.update(softmax_overrides(i))
                cfg = dict(B=B, L=L, K=K, keys=kname, config=i, logits=f"{lb}:{lw}:{ls}:{lp}:{lm}",
                           finalize=f"{fb}:{fw}:{fp}:{fm}", more=more[0] if more else {})
                try:
                    got = scoring.score_topk_triton(qq, kk, lo, hi, K, reduce="sum_softmax", kv_lens=kv_lens,
                                                    k_scale=ksc)
                    same = None if want is None else overlap(got, want)
                    want = got if want is None else want
                    ms_s = bench(lambda: scoring.group_scores_triton(qq, kk, kv_lens, reduce="sum_softmax",
                                                                     k_scale=ksc))
                    ms_r = bench(lambda: scoring.score_topk_triton(qq, kk, lo, hi, K, reduce="sum_softmax",
                                                                   kv_lens=kv_lens, k_scale=ksc))
                    c = carry_mod.new_carry(B, HKV, DEVICE)

                    def carried():
                        return scoring.score_topk_triton(qq, kk, lo, hi, K, reduce="sum_softmax", kv_lens=kv_lens,
                                                         k_scale=ksc, carry=c)
                    for _ in range(4):  # the threshold settles (first call: radix fallback)
                        carried()
                    ms_c = bench(carried)
                    kern = _profile_kernels(carried) if DEVICE == "cuda" else {}
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: report, go on
                    print(f"  softmax config {cfg} failed: {type(e).__name__}: {e}", file=sys.stderr)
                    continue
                # the row's time: the carry path's kernels by device time (what a graph replays; the
                # eager medians carry the host's launch cost and spread two-fold between calls)
                dev_ms = sum(kern.values()) / 1e3 if kern else None
                r.add("softmax_sweep", kname, cfg, dev_ms or ms_c, nbytes, scores_ms=ms_s, radix_ms=ms_r,
                      carry_eager_ms=ms_c, overlap_first=same,
                      kernels_us={n: round(v, 2) for n, v in sorted(kern.items(), key=lambda kv: -kv[1])[:8]})
                print(f"  {kname} B={B} L={L} logits {cfg['logits']} finalize {cfg['finalize']}: scores {ms_s:.3f} "
                      f"ms, +radix {ms_r:.3f}, +carry {ms_c:.3f}; " +
                      ", ".join(f"{n.split('(')[0][:28]} {v:.1f}" for n, v in
                                sorted(kern.items(), key=lambda kv: -kv[1])[:5]))
        scoring.SOFTMAX_CONFIG.clear()
        del keys, q
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def plot(rows: list[dict], path: Path) -> Path | None:
    """One PNG: x floor (time / byte floor) of each selection variant per shape."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001 - a plot is a convenience, not the result
        print(f"# no plot: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    series = [("score_topk", "triton"), ("score_topk", "triton_int8"), ("score_topk", "triton_int4"),
              ("score_topk", "torch_naive"), ("score_topk_softmax", "triton"), ("score_topk_softmax", "triton_int8"),
              ("score_topk_softmax", "triton_int4"), ("group_scores", "triton"), ("group_scores", "triton_int8"),
              ("group_scores", "triton_int4")]
    shapes = sorted({(r["B"], r["L"], r["K"]) for r in rows if r.get("op") == "score_topk" and "K" in r})
    if not shapes:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(shapes) + 3), 4.5))
    x = list(range(len(shapes)))
    for op, impl in series:
        y = []
        for B, L, K in shapes:
            hit = [r for r in rows if r.get("op") == op and r.get("impl") == impl and r.get("B") == B
                   and r.get("L") == L and r.get("K", K) == K and r.get("x_floor")]
            y.append(hit[0]["x_floor"] if hit else float("nan"))
        if any(v == v for v in y):
            ax.plot(x, y, marker="o", label=f"{op} {impl}")
    ax.axhline(1.0, color="k", lw=0.8, ls=":")
    def size(n: int) -> str:
        return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)

    ax.set_xticks(x, [f"B{B}\nL{size(L)}\nK{size(K)}" for B, L, K in shapes], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("time / byte floor")
    ax.set_title("selection kernels vs the bytes they must read")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _set_model(hq: int, hkv: int, d: int) -> None:
    """Model dimensions of the run (``--tiny`` shrinks them for the interpreter)."""
    global HQ, HKV, D, G
    HQ, HKV, D, G = hq, hkv, d, hq // hkv


def main(argv: list[str] | None = None) -> int:
    global DEVICE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a few shapes only (B in {1, 8}, L in {8k, 32k}, K=2k)")
    mode.add_argument("--full", action="store_true",
                      help="the full grid: B in {1, 8, 32}, L in {8k, 32k, 128k}, K in {1k, 2k} (the default)")
    mode.add_argument("--tiny", action="store_true",
                      help="tiny shapes on the CPU under the Triton interpreter: checks the script in seconds")
    ap.add_argument("--sweep", action="store_true", help="also sweep the scoring kernel's tile configs")
    ap.add_argument("--softmax-sweep", default="",
                    help="BxL,...: sweep sum_softmax's two launch configs (SOFTMAX_CONFIG) over int4 / int8 keys at "
                         "these shapes (scores, + radix top-K, + threshold carry, kernels by device time)")
    ap.add_argument("--no-grid", action="store_true", help="skip the shape grid (run only the sweeps asked for)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget; shapes that would start past it are skipped (recorded)")
    ap.add_argument("--out", default="results/bench_scoring.json", help="JSON output path (PNG beside it)")
    args = ap.parse_args(argv)
    if args.tiny:
        import os

        if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
            print("--tiny on a CPU needs TRITON_INTERPRET=1 set before triton is imported", file=sys.stderr)
            return 1
        DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
        _set_model(8, 2, 32)
    elif not torch.cuda.is_available():
        print("bench_scoring needs a CUDA GPU; nothing to do (--tiny checks the script on a CPU).", file=sys.stderr)
        return 1
    else:
        DEVICE = "cuda"
        _set_model(32, 8, 128)
    import triton

    t0 = time.time()
    if DEVICE == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        props = torch.cuda.get_device_properties(0)
        dev_name, sms = props.name, props.multi_processor_count
    else:
        dev_name, sms = "cpu (Triton interpreter)", 0
    bw = hbm_bandwidth(2**30 if DEVICE == "cuda" else 2**24)
    print(f"# {dev_name}, {sms} SMs, copy bandwidth {bw / 1e9:.0f} GB/s "
          f"(read+write); torch {torch.__version__}, triton {triton.__version__}")
    print(f"# layer: {HQ} q / {HKV} KV heads, d={D}, {DTYPE}; candidates [{N_SINK}, L-{N_RECENT}); "
          f"Quest page {PAGE}")
    path = Path(args.out)
    doc = dict(device=dev_name, sms=sms, hbm_bytes_per_s=bw, torch=torch.__version__, triton=triton.__version__,
               model=dict(hq=HQ, hkv=HKV, d=D, dtype=str(DTYPE)), n_sink=N_SINK, n_recent=N_RECENT,
               page_size=PAGE, tiny=args.tiny, budget_s=args.budget_s, skipped=[], rows=[])
    rows: list = []
    r = Runner(bw, rows, path=path, doc=doc, budget_s=args.budget_s)
    r.flush()
    if args.tiny:
        Bs, Ls, Ks = [1, 3], [133], [16]
        variant_shapes = {(1, 133)}  # the code path, not the numbers
    elif args.quick:
        Bs, Ls, Ks = [1, 8], [8192, 32768], [2048]
        variant_shapes = {(8, 32768)}
    else:
        Bs, Ls, Ks = [1, 8, 32], [8192, 32768, 131072], [1024, 2048]
        variant_shapes = {(8, 32768), (1, 131072), (32, 32768)}
    # the headline shape first, so a short budget still measures it
    order = sorted(((B, L) for B in Bs for L in Ls), key=lambda s: (s != (8, 32768), s[1], s[0]))
    for B, L in [] if args.no_grid else order:
        if r.left_s() <= 0:
            r.skip(dict(B=B, L=L), "--budget-s spent")
            continue
        ok, why = fits(B, L)
        if not ok:
            r.skip(dict(B=B, L=L), f"does not fit in memory: {why}")
            continue
        run_shape(r, B, L, Ks, variants=(B, L) in variant_shapes)
    if args.sweep and DEVICE == "cuda" and r.left_s() > 0:
        run_sweep(r)
    if args.softmax_sweep:
        run_softmax_sweep(r, [tuple(int(v) for v in s.lower().split("x")) for s in args.softmax_sweep.split(",") if s],
                          K=Ks[0] if args.tiny else 2048)
    png = plot(rows, path.with_suffix(".png"))
    doc["plot"] = None if png is None else str(png)
    r.flush()
    worst = max((x["deficit"] for x in rows if "deficit" in x), default=0.0)
    print(f"# wrote {path} ({len(rows)} rows, {time.time() - t0:.0f} s); worst selection deficit {worst:.2e}")
    return 0 if worst <= 1e-3 else 2  # a NaN deficit fails too


if __name__ == "__main__":
    raise SystemExit(main())

"""TPOT of every selection method and runtime topology, side by side (the paper's
Fig. 2 breakdown and Table 3 overlap analysis).

Qwen3-8B shape (``--preset``), random weights, bf16, on the fast path
(``FastModel``: static cache, CUDA graphs per pack); the cache is filled with
random K/V (``FastModel.fake_prefill``) and every policy is told about the
"prompt" through ``ctx.prefill`` with random queries (its last W+1), as a real
prefill would. Rows, per (batch B, context L, budget K):

* ``full``: dense attention (the reference);
* ``quest``, ``tova``, ``oracle``, ``asyncspade/inline``: selection on the
  critical path of every layer (``InlineSelector``);
* ``asyncspade/colocated/P``: the cache rank on a side stream of the same GPU
  (reading the model's own cache), P layers per message;
* ``asyncspade/local/P``: the cache rank on a second GPU of this process (local
  transport, peer copies) — when two GPUs are visible;
* ``asyncspade/multiprocess/P``: the cache rank in its own process on the second
  GPU (nccl transport) — when two GPUs are visible;
* ``optimal``: the selection given for free (one fixed ``Selection``): the floor
  any selection method can reach at budget K.

TPOT is the median over ``--iters`` steps after ``--warmup``, every row timed the
same way: host wall clock from a synced device to the device synced again after
the step, as an engine sampling on the host pays it (``time_steps`` /
``time_async``; until session 4 the synchronous rows were timed by CUDA events
around the step, which left their host launch latency out).

Breakdown (Fig. 2): per step, ``attention`` = n_layers x one layer's attention
kernel at that method's token count, ``selection`` = n_layers x one layer's
``observe`` + ``select`` (0 when off the critical path), ``parameters`` = the
optimal step minus its attention: everything else (GEMMs, norms, lm_head).

Overlap (Table 3): per pack of P layers, the cache rank's work (``observe`` +
``select``, measured alone on its device) against the inference rank's time per
pack (the asynchronous TPOT / packs), and the bandwidth a link needs so that a
pack's messages (q/k/v up, indices down) move within one inference pack.

    python -m benchmarks.bench_tpot --quick            # B=8, L=32k, K=2k, P in {4, 9}
    python -m benchmarks.bench_tpot --batch 1,8,16,32 --context 16384,32768,65536 --budget 1024,2048
    python -m benchmarks.bench_tpot --device cpu --preset tiny --quick   # smoke run anywhere
    python -m benchmarks.bench_tpot --quick --methods optimal,asyncspade/colocated --rerank 1,2,4
        # two-stage selection (policy.rerank m) side by side: rows .../m=2, .../m=4

Writes JSON to ``--out`` (default results/bench_tpot.json) and PNG plots beside it.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from spade.attention import FixedSelector

METHODS = ["full", "quest", "tova", "oracle", "asyncspade/inline", "asyncspade/colocated", "asyncspade/local",
           "asyncspade/multiprocess", "optimal"]


# ----------------------------------------------------------------------------- timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


PROFILE_STEPS = 4  # torch.profiler steps of --profile
HOST_PROFILE_STEPS = 20  # cProfile steps of --host-profile


def time_calls(fn: Callable[[], Any], *, iters: int, warmup: int, device: torch.device) -> list[float]:
    """Milliseconds per call of ``fn`` after ``warmup`` calls (CUDA events + sync)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(iters):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize(device)
            out.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out




def _wait_poll(device: torch.device) -> None:
    """The device's current stream done, by polling an event (what ``wait_device`` does,
    without an event loop to serve: the synchronous rows have nothing else to run)."""
    if device.type != "cuda":
        return
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    while not ev.query():
        pass


def time_steps(fn: Callable[[], Any], *, iters: int, warmup: int, device: torch.device) -> list[float]:
    """TPOT of a synchronous decode step: host wall clock from an idle device to the
    step's device work done — exactly how ``time_async`` times the asynchronous rows, so
    every row of a TPOT table pays the same launch latency (a serving loop, which reads
    each sampled token on the host, pays it too) and waits the same way: it polls an
    event recorded after the step, as the asynchronous rows do through
    ``InferenceSession.wait_device`` (a blocking sync lost: docs/tried.md).
    Device events around the call (``time_calls``, for kernel-level timings) would
    leave the host's launch time out of the inline rows only."""
    wait = _wait_poll
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(iters):
        wait(device)
        t0 = time.perf_counter()
        fn()
        wait(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


async def time_async(step, *, iters: int, warmup: int, device: torch.device, wait=None) -> list[float]:
    """``time_calls`` for a coroutine step (the asynchronous runtime): host wall clock from
    the device idle to the step's device work done. ``wait``: how the runtime's own token
    loop waits for the device between steps (``InferenceSession.wait_device``: the event
    loop keeps serving the cache rank and the receiver meanwhile); default a blocking sync."""
    async def done() -> None:
        if wait is not None:
            await wait()
        else:
            _sync(device)

    for _ in range(warmup):
        await step()
    _sync(device)
    out = []
    for _ in range(iters):
        await done()
        t0 = time.perf_counter()
        await step()
        await done()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def summary(ms: list[float]) -> dict:
    s = sorted(ms)
    q = lambda f: s[min(len(s) - 1, int(f * (len(s) - 1) + 0.5))]  # noqa: E731
    # the mean is what a generation's tokens cost on average: a schedule with slow steps
    # every N (policy.refresh_every) hides them from the median (tpot_ms)
    return {"tpot_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms), "p10_ms": q(0.1), "p90_ms": q(0.9),
            "steps": len(ms)}


def warmup_steps(a) -> int:
    """Untimed steps before a row's timed ones: ``--warmup``, and with ``policy.refresh_every``
    N > 1 at least 2N + 1, so that the refresh steps' CUDA graphs (captured at a key's second
    call, N steps after its first) are made before the timing starts, not inside it."""
    n = getattr(a, "cur_refresh", 1)
    return a.warmup if n <= 1 else max(a.warmup, 2 * n + 1)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- set-up
def policy_overrides(name: str, K: int, a) -> list[str]:
    if name == "full":
        return ["policy.name=full"]
    if name == "quest":
        return ["policy.name=quest", f"policy.budget={K}", f"policy.page_size={a.page_size}"]
    if name == "tova":
        return ["policy.name=tova", f"policy.budget={K}"]
    common = [f"policy.budget={K}", f"policy.sink_tokens={a.sink}", f"policy.recent_tokens={a.recent}",
              f"policy.group_reduce={a.group_reduce}"]
    if name == "oracle":
        return ["policy.name=oracle", *common, *_topk_override(a)]
    out = ["policy.name=asyncspade", *common, f"policy.window={a.window}", f"policy.predictor={a.predictor}",
           f"policy.rope_aware={str(a.rope_aware).lower()}", *_topk_override(a)]
    if getattr(a, "cur_score_keys", "exact") != "exact":
        out.append(f"policy.score_keys={a.cur_score_keys}")
    if getattr(a, "cur_refresh", 1) != 1:
        out.append(f"policy.refresh_every={a.cur_refresh}")
    if getattr(a, "cur_rerank", 1) != 1:
        out.append(f"policy.rerank={a.cur_rerank}")
    if getattr(a, "cur_channels", 0):
        out.append(f"policy.score_channels={a.cur_channels}")
    return out


def _topk_override(a) -> list[str]:
    """``policy.topk`` of the current ``--topk`` mode (none: each policy's default)."""
    mode = getattr(a, "cur_topk", "")
    return [f"policy.topk={mode}"] if mode else []


def make_config(overrides: list[str]):
    from spade.config import load_config

    return load_config(None, overrides=overrides)


def random_selection(B: int, Hkv: int, L: int, K: int, sink: int, recent: int, device):
    """``K - sink - recent`` distinct random middle positions per (row, KV head)."""
    from spade.policies.base import Selection

    k_mid = K - sink - recent
    g = torch.Generator(device=device).manual_seed(0)
    r = torch.rand(B, Hkv, L - sink - recent, device=device, generator=g)
    idx = (r.topk(k_mid, dim=-1).indices + sink).to(torch.int32)
    return Selection(indices=idx, n_sink=sink, n_recent=recent)


def fake_prompt(model, ctx, B: int, L: int, W: int, seed: int = 0) -> torch.Tensor:
    """Fill the cache with L random tokens and report each layer to ``ctx.prefill``
    with W random queries (what a prefill of an L-token prompt reports last);
    returns placeholder logits."""
    model.fake_prefill(L, B, ctx=ctx, seed=seed)
    model._bind(ctx, prefill=True)  # (a paged cache: the prompt's keys go to the policy contiguous)
    ctx.begin_step(L)
    a = model.arch
    g = torch.Generator(device=model.device).manual_seed(seed + 1)
    for layer in range(a.n_layers):
        q = torch.randn(B, a.n_q_heads, W, a.head_dim, device=model.device, generator=g).to(model.dtype)
        if model.paged:  # as the model's paged prefill reports it: the prompt's keys contiguous, and the pools
            from spade.kernels.paged import paged_to_contiguous

            bt = model.block_table
            k, v = paged_to_contiguous(model.k_cache[layer], bt, L), paged_to_contiguous(model.v_cache[layer], bt, L)
            ctx.prefill(layer, q, k, v, model.kv_lens, pool=(model.k_cache[layer], model.v_cache[layer], bt))
            del k, v
            continue
        ctx.prefill(layer, q, model.k_cache[layer][:B], model.v_cache[layer][:B], model.kv_lens)
    return torch.zeros(B, model.vocab_size, device=model.device)


# ----------------------------------------------------------------------------- rows
def run_inline(model, method: str, B: int, L: int, K: int, a) -> dict:
    from spade.attention import AttentionContext, InlineSelector
    from spade.policies import build_policy

    if method == "optimal":
        sel = FixedSelector(random_selection(B, model.spec.n_kv_heads, L, K, a.sink, a.recent, model.device))
    else:
        cfg = make_config(policy_overrides(method.split("/")[0], K, a))
        pol = build_policy(cfg.policy, model.spec)
        sel = InlineSelector(pol, pol.new_state(B, model.device))
    ctx = AttentionContext(model.spec, sel, device=model.device, track_stats=False)
    fake_prompt(model, ctx, B, L, a.window + 1)
    tok = torch.randint(0, model.vocab_size, (B,), device=model.device)
    ms = time_steps(lambda: model.decode(tok, ctx), iters=a.iters, warmup=warmup_steps(a), device=model.device)
    timeline = None
    ptag = method + _pdl_tag(a)
    want = (a.profile and method in ("optimal", "full") and not _pdl_tag(a)) or ptag in a.profile_rows.split(",")
    if want and not getattr(a, f"_profiled_{ptag}", False):
        setattr(a, f"_profiled_{ptag}", True)

        async def one():
            model.decode(tok, ctx)

        import asyncio

        timeline = asyncio.run(profile_steps(one, model.device, Path(a.out).parent,
                                             f"profile_{method}_B{B}_L{L}_K{K}"))
    if not torch.isfinite(model.last_logits).all():
        raise RuntimeError(f"{method}: non-finite logits")
    res = summary(ms)
    if timeline is not None:
        res["timeline"] = timeline
    return res


def run_async(model, topology: str, P: int, mode: str, B: int, L: int, K: int, a, shared: dict) -> dict:
    """One asynchronous row. ``shared`` keeps the multiprocess link (one cache
    process for every P, budget and mode of this model)."""
    from spade.policies import build_policy
    from spade.runtime.asyncrt import AsyncRuntime

    over = policy_overrides("asyncspade", K, a) + [
        f"runtime.topology={topology}", f"runtime.pack_layers={P}", f"runtime.return_mode={mode}",
        f"runtime.on_late={a.on_late}", "runtime.late_timeout_s=120",
        f"runtime.cache_thread={getattr(a, 'cur_cache_thread', 'auto')}"]
    if topology == "multiprocess":
        over += ["runtime.transport.name=nccl", f"runtime.transport.master_port={a.port}",
                 "runtime.transport.timeout_s=90"]
    cfg = make_config(over)
    pol = build_policy(cfg.policy, model.spec)
    loop = shared["loop"]
    link = shared.get("multiprocess") if topology == "multiprocess" else None
    rt = AsyncRuntime(cfg, model, pol, link=link, loop=loop)
    tok = torch.randint(0, model.vocab_size, (B,), device=model.device)

    async def go():
        sess = await rt.session()
        steps = warmup_steps(a) + a.iters + PROFILE_STEPS + HOST_PROFILE_STEPS  # + the profiled steps, when asked
        await sess.begin(lambda ctx: fake_prompt(model, ctx, B, L, a.window + 1), batch=B, max_new_tokens=steps + 2)
        try:
            ms = await time_async(lambda: sess.step(tok), iters=a.iters, warmup=warmup_steps(a), device=model.device,
                                  wait=sess.wait_device)
            ct = getattr(a, "cur_cache_thread", "auto")
            tag = (f"{topology}_P{P}_{getattr(a, 'cur_score_keys', 'exact')}"
                   + ("" if topology == "multiprocess" or ct == a.cache_thread[0] else f"_{ct}") + _pdl_tag(a)
                   + "".join(f"_{k}{v}" for k, v in (("r", getattr(a, "cur_refresh", 1)),
                                                      ("m", getattr(a, "cur_rerank", 1)),
                                                      ("c", getattr(a, "cur_channels", 0))) if v not in (0, 1)))
            timeline = None
            if (a.profile and not a.profile_rows and not shared.get("profiled_" + topology)) \
                    or tag in a.profile_rows.split(","):
                shared["profiled_" + topology] = True
                timeline = await profile_steps(lambda: sess.step(tok), model.device, Path(a.out).parent,
                                               f"profile_{tag}_B{B}_L{L}_K{K}")
            if a.host_profile and tag in a.host_profile.split(","):
                await host_profile_steps(lambda: sess.step(tok), model.device, Path(a.out).parent,
                                         f"host_profile_{tag}_B{B}_L{L}_K{K}")
        finally:
            await sess.end()
        host = list(sess.host_step_ms)[-a.iters:]  # the timed steps (not warm-up or graph capture)
        return ms, sess.trace([[]], []).stats, host, timeline

    ms, stats, host, timeline = loop.run_until_complete(go())
    if topology == "multiprocess":
        if link is None:  # this runtime opened the cache process: keep it for the next rows
            shared["multiprocess"], shared["owner"] = rt._link, rt
    else:
        loop.run_until_complete(rt.aclose())
    row = summary(ms)
    row.update({k: stats.get(k) for k in ("late_packs", "stale_packs", "waited_packs", "wait_s", "sparse_steps")})
    # host time per step inside step() (launches, transport, waits for late packs; the device
    # runs behind it): near the TPOT means the host, not the device, sets the pace
    if host:
        row["host_ms_per_step"] = float(statistics.median(host))
    if timeline is not None:
        row["timeline"] = timeline
    if stats.get("cache_host"):  # the cache rank's own host account (medians over the generation)
        row["cache_host"] = stats["cache_host"]
    if not torch.isfinite(model.last_logits).all():
        raise RuntimeError(f"asyncspade/{topology}: non-finite logits")
    return row


def profile_work(work: Callable[[], Any], device: torch.device, out_dir: Path, name: str, reps: int = 10) -> None:
    """Kernel by kernel, one layer of the cache rank's work (``observe`` + ``select``),
    run eagerly ``reps`` times under ``torch.profiler`` (device times per kernel are
    those of the graph replay; the graph only removes the launch gaps)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=acts) as prof:
        for _ in range(reps):
            work()
        _sync(device)
    out_dir.mkdir(parents=True, exist_ok=True)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=40)
    (out_dir / f"{name}.txt").write_text(f"{reps} calls of one layer's observe + select\n{table}\n")
    print(f"  profile of one cache-rank layer -> {out_dir / name}.txt", flush=True)


async def profile_steps(step, device: torch.device, out_dir: Path, name: str,
                        steps: int = PROFILE_STEPS) -> dict | None:
    """``torch.profiler`` over a few steady-state steps: a table of the top CUDA
    kernels, the device timeline summary (busy / idle per GPU and the largest gaps,
    ``benchmarks.trace_summary``) and the Chrome trace, gzipped. Returns the summary."""
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile

    from benchmarks.trace_summary import format_summary, summarize_trace

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=acts) as prof:
        for _ in range(steps):
            await step()
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                torch.cuda.synchronize(i)
    out_dir.mkdir(parents=True, exist_ok=True)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=30)
    timeline = None
    trace = out_dir / f"{name}.json"
    try:
        prof.export_chrome_trace(str(trace))
        timeline = summarize_trace(trace, steps)
        with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()
    except Exception as e:  # pragma: no cover
        print(f"chrome trace not written / summarised: {type(e).__name__}: {e}", file=sys.stderr)
    text = f"{steps} steps\n{table}\n"
    if timeline is not None:
        text += "\n" + format_summary(timeline) + "\n"
        print(format_summary(timeline), flush=True)
    (out_dir / f"{name}.txt").write_text(text)
    print(f"  profile of {steps} steps -> {out_dir / name}.txt", flush=True)
    return timeline


async def host_profile_steps(step, device: torch.device, out_dir: Path, name: str,
                             steps: int = HOST_PROFILE_STEPS) -> None:
    """cProfile of the host over a few steps (the device synced after each, as in
    ``time_async``): where an asynchronous step's host time goes, function by function."""
    import cProfile

    from spade.runtime.worker import profile_table

    prof = cProfile.Profile()
    for _ in range(steps):
        _sync(device)
        prof.enable()
        await step()
        prof.disable()
        _sync(device)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.txt").write_text(f"{steps} steps, host only (cProfile)\n{profile_table(prof, 45)}")
    print(f"  host profile of {steps} steps -> {out_dir / name}.txt", flush=True)


def time_graph(fn: Callable[[], Any], *, iters: int, warmup: int, device: torch.device) -> list[float]:
    """``time_calls`` of ``fn`` replayed as one CUDA graph (what the cache rank
    does per pack); eager when capture fails or off CUDA."""
    if device.type != "cuda":
        return time_calls(fn, iters=iters, warmup=warmup, device=device)
    s = torch.cuda.Stream(device=device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, stream=s):
            fn()
    except Exception as e:
        print(f"  (graph capture failed: {type(e).__name__}: {str(e)[:100]}; timing eagerly)", flush=True)
        torch.cuda.synchronize(device)
        return time_calls(fn, iters=iters, warmup=warmup, device=device)
    return time_calls(g.replay, iters=iters, warmup=warmup, device=device)


# ----------------------------------------------------------------------------- micro timings
def _variant(score_keys: str, channels: int, rerank: int) -> str:
    """The name of an asyncspade selection variant in ``layer_timings`` (``select_<name>_ms``):
    ``asyncspade``, then ``_<keys>`` for a compressed copy, ``_c<r>``, ``_m<m>``."""
    return ("asyncspade" + ("" if score_keys == "exact" else f"_{score_keys}") + (f"_c{channels}" if channels else "")
            + (f"_m{rerank}" if rerank > 1 else ""))


def layer_timings(model, B: int, L: int, K: int, a) -> dict:
    """One layer's attention (dense, sparse at K) and each policy's per-layer
    selection work (``observe`` + ``select``), in ms, each replayed as a CUDA graph
    (the device time the captured decode step spends on it; eager calls would time
    the host's launch overhead instead, ``*_eager_ms``)."""
    from spade import kernels
    from spade.policies import build_policy

    dev = model.device
    spec = model.spec
    model.fake_prefill(L, B)
    kc, vc = model.k_cache[0][:B], model.v_cache[0][:B]
    kv = model.kv_lens
    g = torch.Generator(device=dev).manual_seed(5)
    q = torch.randn(B, spec.n_q_heads, spec.head_dim, device=dev, generator=g).to(model.dtype)
    it = dict(iters=max(5, a.iters), warmup=3, device=dev)
    sel = random_selection(B, spec.n_kv_heads, L, K, a.sink, a.recent, dev)
    out = {
        "attention_dense_ms": statistics.median(time_graph(
            lambda: kernels.sparse_decode_attention(q, kc, vc, kv, None, scale=spec.softmax_scale), **it)),
        "attention_sparse_ms": statistics.median(time_graph(
            lambda: kernels.sparse_decode_attention(q, kc, vc, kv, sel.indices, n_sink=sel.n_sink,
                                                    n_recent=sel.n_recent, scale=spec.softmax_scale), **it)),
        "gather_kv_ms": statistics.median(time_graph(lambda: kernels.gather_kv(kc, vc, sel.indices), **it)),
    }
    W = a.window + 1
    # (name, scoring keys, score_channels, rerank): asyncspade once per variant of the rows
    variants = [(n, "exact", 0, 1) for n in ("quest", "tova", "oracle")]
    for sk, ch, m in itertools.product(["exact"] + [sk for sk in a.score_keys if sk != "exact"],
                                       getattr(a, "score_channels", [0]), getattr(a, "rerank", [1])):
        variants.append((_variant(sk, ch, m), sk, ch, m))
    for name, sk, ch, m in variants:
        a.cur_score_keys, a.cur_channels, a.cur_rerank = sk, ch, m
        try:
            cfg = make_config(policy_overrides(name.split("_")[0], K, a))
        except Exception as e:
            out[f"select_{name}_error"] = f"{type(e).__name__}: {e}"
            continue
        finally:
            a.cur_score_keys, a.cur_channels, a.cur_rerank = "exact", 0, 1
        pol = build_policy(cfg.policy, spec)
        st = pol.new_state(B, dev)
        st.seq_len = L
        qp = torch.randn(B, spec.n_q_heads, W, spec.head_dim, device=dev, generator=g).to(model.dtype)
        pol.prefill(st, 0, qp, kc, vc, kv)
        st.seq_len = L + 1
        kv1 = kv + 1

        def work():
            pol.observe(st, 0, q, kc, kv1)
            pol.select(st, 0, q if pol.needs_current_query else None, kc, kv1)

        out[f"select_{name}_eager_ms"] = statistics.median(time_calls(work, **it))  # launches included
        out[f"select_{name}_ms"] = statistics.median(time_graph(work, **it))
        if name.startswith("asyncspade"):  # the cache rank replays its pack work as a CUDA graph
            out[f"select_{name}_graph_ms"] = out[f"select_{name}_ms"]
            if a.profile and not getattr(a, f"_profiled_layer_{name}", False):
                setattr(a, f"_profiled_layer_{name}", True)  # the first shape only
                profile_work(work, dev, Path(a.out).parent, f"profile_cache_layer_{name}_B{B}_L{L}_K{K}")
            for P in sorted({min(p, spec.n_layers) for p in a.packs}):
                out[f"select_{name}_pack{P}_graph_ms"] = statistics.median(
                    time_graph(pack_work(model, pol, B, L, P, q, g, W), **it))
    free_memory()
    return out


def pack_work(model, pol, B: int, L: int, P: int, q: torch.Tensor, g: torch.Generator, W: int) -> Callable[[], None]:
    """The cache rank's work for one pack of P layers, as ``CacheRank`` does it: observe
    every layer (compressed scoring keys quantised straight from the step's received key,
    ``Policy.takes_new_keys``; else the key appended to the store first), predict the
    pack's queries together (``predict_layers``), select every layer inside one
    ``shared_derived`` block, writing into the pack's output rows where the policy takes
    ``out=`` (``select_takes_out``)."""
    from spade import kernels
    from spade.policies.common import shared_derived

    dev, spec = model.device, model.spec
    st = pol.new_state(B, dev)
    st.seq_len = L
    kv = model.kv_lens
    caches = [(model.k_cache[i][:B], model.v_cache[i][:B]) for i in range(P)]
    for i, (kc, vc) in enumerate(caches):
        qp = torch.randn(B, spec.n_q_heads, W, spec.head_dim, device=dev, generator=g).to(model.dtype)
        pol.prefill(st, i, qp, kc, vc, kv)
    st.seq_len = L + 1
    kv1 = kv + 1
    predict_layers = getattr(pol, "predict_layers", None)
    new_keys = getattr(pol, "takes_new_keys", lambda _s: False)(st)
    k_new = torch.randn(B, spec.n_kv_heads, spec.head_dim, device=dev, generator=g).to(model.dtype)
    pos = (kv1 - 1).to(torch.int64)[:1]  # the runtime appends at one device-side position
    K = pol.budget - getattr(pol.cfg, "sink_tokens", 0) - getattr(pol.cfg, "recent_tokens", 0)
    rows = (list(torch.full((P, B, spec.n_kv_heads, K), -1, dtype=torch.int32, device=dev).unbind(0))
            if getattr(pol, "select_takes_out", False) and K > 0 else None)

    def work():
        for i, (kc, _) in enumerate(caches):
            if new_keys:
                pol.observe(st, i, q, kc, kv1, k_new=k_new)
            else:
                kc.index_copy_(2, pos, k_new.unsqueeze(2))
                pol.observe(st, i, q, kc, kv1)
        if predict_layers is not None:
            predict_layers(st, range(P))
        with shared_derived(st), kernels.select_overlap(dev):  # as CacheRank.select_pack
            for i, (kc, _) in enumerate(caches):
                if rows is None:
                    pol.select(st, i, None, kc, kv1)
                else:
                    pol.select(st, i, None, kc, kv1, out=rows[i])

    return work


def breakdown(rows: dict, lt: dict, n_layers: int) -> dict:
    """Fig. 2: parameters / attention / selection per step, per method (a ``/r=N`` row,
    ``policy.refresh_every=N``, selects every N steps: its selection is amortised over them)."""
    if "optimal" not in rows:
        return {}
    params = rows["optimal"]["tpot_ms"] - n_layers * lt["attention_sparse_ms"]
    out = {}
    for name, row in rows.items():
        base = name.split("/")[0]
        attn = n_layers * (lt["attention_dense_ms"] if base == "full" else lt["attention_sparse_ms"])
        on_path = name in ("quest", "tova", "oracle") or name.startswith("asyncspade/inline")
        sk = name.split("/")[2] if name.startswith("asyncspade/inline/") else ""
        key = f"select_{base}_{sk}_ms" if sk else f"select_{base}_ms"
        sel = n_layers * lt.get(key, 0.0) if on_path else 0.0
        refresh = next((int(t[2:]) for t in name.split("/") if t.startswith("r=") and t[2:].isdigit()), 1)
        sel /= refresh  # policy.refresh_every=N: one selection every N steps
        out[name] = {"parameters_ms": params, "attention_ms": attn, "selection_ms": sel,
                     "other_ms": row["tpot_ms"] - params - attn - sel, "tpot_ms": row["tpot_ms"]}
    return out


def table3_lines(overlap: list[dict]) -> list[str]:
    """Console lines of Table 3: per P, the cache rank's pack as it runs it (per scoring-key
    variant) over the inference pack, the ratio the issue's target bounds."""
    out = []
    for row in overlap:
        inf = row.get("inference_ms_per_pack")
        if not inf:
            continue
        parts = []
        for key in sorted(k for k in row if k.startswith("cache_ms_per_pack_runtime")):
            sk = (key[len("cache_ms_per_pack_runtime"):].lstrip("_")
                  or row.get("cache_variant", "asyncspade").removeprefix("asyncspade").lstrip("_") or "exact")
            parts.append(f"{sk} {row[key]:.3f} ({row[key] / inf:.2f}x)")
        if parts:
            out.append(f"  Table 3, P={row['pack_layers']}: inference {inf:.3f} ms per pack; cache rank "
                       + ", ".join(parts))
    return out


def overlap_table(model, B: int, K: int, a, rows: dict, lt: dict) -> list[dict]:
    """Table 3: per P, the cache rank's work per pack (``observe`` + ``select`` of P
    layers, measured alone) against the inference rank's compute per pack (the
    ``optimal`` step, selection free, over the packs), whether it overlaps, and the
    link bandwidth a pack's messages (q/k/v up, selection down) need to move
    within one inference pack. The measured asynchronous TPOTs per pack are
    listed beside (``measured_ms_per_pack``: per topology).

    ``cache_ms_per_pack`` is P x one layer's work (each layer with its own
    prediction launch); ``cache_ms_per_pack_runtime`` times the pack whole, as the
    cache rank runs it (``pack_work``: one prediction launch per pack)."""
    spec = model.spec
    elt = torch.finfo(model.dtype).bits // 8
    k_mid = K - a.sink - a.recent
    t_opt = rows.get("optimal", {}).get("tpot_ms")
    out = []
    for P in a.packs:
        n_packs = -(-spec.n_layers // P)
        n = min(P, spec.n_layers)  # layers in a (full) pack
        up = n * B * (spec.n_q_heads + 2 * spec.n_kv_heads) * spec.head_dim * elt
        down = {"indices": n * B * spec.n_kv_heads * k_mid * 4,
                "kv": n * B * spec.n_kv_heads * k_mid * (4 + 2 * spec.head_dim * elt)}
        # the base: exact keys under the rows' first score_channels and rerank (the other
        # variants follow under their own keys)
        base = _variant("exact", getattr(a, "score_channels", [0])[0], getattr(a, "rerank", [1])[0])
        cache_pack = n * lt[f"select_{base}_ms"]
        row: dict[str, Any] = {"pack_layers": P, "packs": n_packs, "cache_variant": base,
                               "cache_ms_per_pack": cache_pack,
                               "cache_ms_per_pack_kv": cache_pack + n * lt["gather_kv_ms"],
                               "bytes_up_per_pack": up}
        if t_opt is not None:
            infer_pack = t_opt / n_packs
            row["inference_ms_per_pack"] = infer_pack
            row["overlaps"] = cache_pack <= infer_pack
            for mode, d in down.items():
                row[f"bytes_down_per_pack_{mode}"] = d
                row[f"min_bandwidth_GBps_{mode}"] = (up + d) / (infer_pack * 1e-3) / 1e9
        # the pack timed whole, as the runtime runs it (one prediction launch per pack)
        runtime_pack = lt.get(f"select_{base}_pack{n}_graph_ms")
        if runtime_pack is not None:
            row["cache_ms_per_pack_runtime"] = runtime_pack
            if t_opt is not None:
                row["overlaps_runtime"] = runtime_pack <= row["inference_ms_per_pack"]
        # every other variant (scoring keys, _c<r> score_channels, _m<m> rerank) the rows ran
        pre, suf = "select_asyncspade_", f"_pack{n}_graph_ms"
        for key in [k for k in lt if k.startswith(pre) and k.endswith(suf) and k != f"select_{base}{suf}"]:
            v = key[len(pre):-len(suf)]
            row[f"cache_ms_per_pack_runtime_{v}"] = lt[key]
            if t_opt is not None:
                row[f"overlaps_runtime_{v}"] = lt[key] <= row["inference_ms_per_pack"]
        for key in [k for k in lt if k.startswith(pre) and k.endswith("_graph_ms") and "_pack" not in k
                    and k != f"select_{base}_graph_ms"]:
            v = key[len(pre):-len("_graph_ms")]
            row[f"cache_ms_per_pack_{v}"] = n * lt[key]
            if t_opt is not None:
                row[f"overlaps_{v}"] = row[f"cache_ms_per_pack_{v}"] <= row["inference_ms_per_pack"]
        row["measured_ms_per_pack"] = {
            name.removeprefix("asyncspade/"): r["tpot_ms"] / n_packs for name, r in rows.items()
            if name.startswith("asyncspade/") and f"/P={P}" in name}
        out.append(row)
    return out


# ----------------------------------------------------------------------------- plots
def plots(result: dict, out_dir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # pragma: no cover - matplotlib is a dependency
        print(f"plots skipped: {e}", file=sys.stderr)
        return []
    files = []
    for c in result["configs"]:
        if "budget" not in c:  # a shape skipped before any budget ran (did not fit)
            continue
        tag = f"B{c['batch']}_L{c['context']}_K{c['budget']}"
        names = list(c["rows"])
        if names:
            fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(names)), 4))
            vals = [c["rows"][n]["tpot_ms"] for n in names]
            ax.bar(range(len(names)), vals, color=["#888" if n in ("full", "optimal") else "#3a7" for n in names])
            ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=8)
            ax.set_ylabel("median TPOT (ms)")
            ax.set_title(f"TPOT, B={c['batch']} L={c['context']} K={c['budget']}")
            fig.tight_layout()
            p = out_dir / f"bench_tpot_{tag}.png"
            fig.savefig(p, dpi=120)
            plt.close(fig)
            files.append(str(p))
        bd = c.get("breakdown") or {}
        if bd:
            names = list(bd)
            fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(names)), 4))
            bottom = [0.0] * len(names)
            for part, color in (("parameters_ms", "#69c"), ("attention_ms", "#e93"), ("selection_ms", "#c44")):
                vals = [max(0.0, bd[n][part]) for n in names]
                ax.bar(range(len(names)), vals, bottom=bottom, label=part.removesuffix("_ms"), color=color)
                bottom = [b + v for b, v in zip(bottom, vals)]
            ax.plot(range(len(names)), [bd[n]["tpot_ms"] for n in names], "k_", markersize=18, label="measured")
            ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=8)
            ax.set_ylabel("ms per step")
            ax.set_title(f"latency breakdown, B={c['batch']} L={c['context']} K={c['budget']}")
            ax.legend(fontsize=8)
            fig.tight_layout()
            p = out_dir / f"bench_tpot_breakdown_{tag}.png"
            fig.savefig(p, dpi=120)
            plt.close(fig)
            files.append(str(p))
        ov = c.get("overlap") or []
        if ov:
            fig, ax = plt.subplots(figsize=(6, 4))
            xs = [r["pack_layers"] for r in ov]
            if all("inference_ms_per_pack" in r for r in ov):
                ax.plot(xs, [r["inference_ms_per_pack"] for r in ov], "o-", color="k", label="inference rank / pack")
            ax.plot(xs, [r["cache_ms_per_pack"] for r in ov], "s--", color="#c44", label="cache rank / pack")
            for topo in ("colocated", "local", "multiprocess"):
                pts = [(r["pack_layers"], v) for r in ov for k, v in r["measured_ms_per_pack"].items()
                       if k.split("/")[0] == topo and k.count("/") == 1]
                if pts:
                    ax.plot(*zip(*pts), "^:", label=f"measured step / packs ({topo})")
            for sk in sorted({k.removeprefix("cache_ms_per_pack_") for r in ov for k in r
                              if k.startswith("cache_ms_per_pack_") and k != "cache_ms_per_pack_kv"}):
                ax.plot(xs, [r.get(f"cache_ms_per_pack_{sk}", float("nan")) for r in ov], "s:",
                        label=f"cache rank / pack ({sk} scoring keys)")
            ax.set_xlabel("layers per pack (P)")
            ax.set_ylabel("ms")
            ax.set_title(f"overlap, B={c['batch']} L={c['context']} K={c['budget']}")
            ax.legend(fontsize=8)
            fig.tight_layout()
            p = out_dir / f"bench_tpot_overlap_{tag}.png"
            fig.savefig(p, dpi=120)
            plt.close(fig)
            files.append(str(p))
    return files


# ----------------------------------------------------------------------------- main
def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _packs(s: str) -> list[int | str]:
    """``--packs``: layers per pack, comma-separated; ``auto`` is the runtime's default
    (``runtime.pack_layers: auto``, four packs per step), resolved for the preset's layers."""
    return [x.strip() if x.strip() == "auto" else int(x) for x in s.split(",") if x.strip()]


def config_defaults(path: str) -> dict:
    """Argument defaults from a spade config (``spade bench tpot --config X``): the model
    preset, dtype and projection kernels, the policy's speed settings, the runtime's
    late-pack handling, and the ``bench`` section's shapes, methods, steps and output
    folder. Flags given on the command line win."""
    from spade.config import load_config
    from spade.models.presets import PRESETS

    cfg = load_config(path)
    m, pol, rt, b = cfg.model, cfg.policy, cfg.runtime, cfg.bench
    if m.name not in PRESETS:
        raise SystemExit(f"bench_tpot --config {path}: model.name {m.name!r} is not a random-weight shape preset "
                         f"({', '.join(sorted(PRESETS))}); the TPOT benchmark times presets")
    d = {"preset": m.name, "linear": m.linear, "batch": list(b.batch_sizes), "context": list(b.context_lengths),
         "budget": list(b.budgets), "packs": list(b.pack_layers), "iters": b.iters, "warmup": b.warmup,
         "on_late": rt.on_late, "cache_thread": rt.cache_thread,
         "out": str(Path(b.out_dir) / "bench_tpot.json")}
    if m.dtype != "auto":
        d["dtype"] = m.dtype
    methods = [p for p in b.policies if p != "asyncspade"]
    if "asyncspade" in b.policies:
        methods += ["asyncspade/inline", "asyncspade/colocated", "asyncspade/local", "asyncspade/multiprocess"]
    d["methods"] = ",".join(methods)
    for name, key in (("sink", "sink_tokens"), ("recent", "recent_tokens"), ("window", "window"),
                      ("predictor", "predictor"), ("group_reduce", "group_reduce")):
        if hasattr(pol, key):
            d[name] = getattr(pol, key)
    if getattr(pol, "rope_aware", "auto") is True:
        d["rope_aware"] = True
    if getattr(pol, "score_keys", "exact") != "exact":
        d["score_keys"] = pol.score_keys
    if hasattr(pol, "topk") and pol.topk != type(pol).model_fields["topk"].default:
        d["topk"] = pol.topk  # a config choosing the non-default mode (the oracle rows then take it too)
    return d


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_tpot", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None,
                    help="a spade YAML config: defaults for the preset, policy speed settings, shapes, methods "
                         "and output from its model / policy / runtime / bench sections (flags win)")
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=0, help="cut the preset to this many layers (0: all)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--batch", type=_ints, default=[1, 8, 16, 32])
    ap.add_argument("--context", type=_ints, default=[16384, 32768, 65536])
    ap.add_argument("--budget", type=_ints, default=[1024, 2048])
    ap.add_argument("--packs", type=_packs, default=["auto", 4], help="P values for the asynchronous rows (auto: "
                    "the runtime's default, four packs per step: P=9 on the 36-layer Qwen3-8B preset)")
    ap.add_argument("--modes", default="indices", help="return modes of the asynchronous rows (indices,kv,delta)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--recent", type=int, default=64)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--predictor", default="assembled")
    ap.add_argument("--group-reduce", default="sum_logits", choices=["sum_logits", "max_logits", "sum_softmax"],
                    help="GQA reduction of oracle/asyncspade (default: the one-pass speed setting, not the "
                         "fidelity default sum_softmax)")
    ap.add_argument("--rope-aware", action="store_true", help="asyncspade predicts pre-RoPE queries")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--on-late", default="wait", choices=["wait", "stale", "full"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--linear", default="auto", choices=("auto", "cublas", "triton"),
                    help="kernel of the decode projections (model.linear): auto = the Triton GEMV where a GPU "
                         "sweep measured it faster than cuBLAS")
    ap.add_argument("--port", type=int, default=29611, help="master port of the multiprocess link (and port + 1)")
    ap.add_argument("--score-keys", default="exact",
                    help="scoring-key variants of the asyncspade rows, comma-separated from exact,int8,int4 "
                         "(policy.score_keys); each non-exact one adds asyncspade_<keys> rows")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="wall-clock budget: no new row starts after it (0: none); what finished is written")
    ap.add_argument("--host-profile", default="",
                    help="cProfile the host over 20 steps of these async rows (topology_P<P>_<keys>, e.g. "
                         "local_P4_int4,multiprocess_P4_int4); with a multiprocess row, also the cache "
                         "process over its whole life (host_profile_cache_process.txt)")
    ap.add_argument("--profile", action="store_true",
                    help="torch.profiler over a few steps of the first row of each asynchronous topology")
    ap.add_argument("--profile-rows", default="",
                    help="torch.profiler (kernel table, device timeline summary, gzipped Chrome trace) of these "
                         "async rows (topology_P<P>_<keys>[_r<n>][_m<m>][_c<r>], e.g. local_P4_int4,colocated_P4_int4_c64) "
                         "instead of --profile's first row per topology; --profile still profiles optimal and full")
    ap.add_argument("--cache-thread", default="auto",
                    help="runtime.cache_thread of the colocated / local rows, comma-separated from "
                         "auto,coroutine: the first names the rows, each further one adds rows "
                         "suffixed /<mode>, side by side")
    ap.add_argument("--pdl", default="",
                    help="SPADE_PDL modes to run every row under, comma-separated from auto,all,decode,off "
                         "(programmatic dependent launch, spade.kernels.pdl): the first names the rows, each "
                         "further one adds rows suffixed /pdl=<mode>, side by side; empty: the environment's. "
                         "The multiprocess rows' cache process keeps the mode it was started under (the first)")
    ap.add_argument("--topk", default="",
                    help="policy.topk of the oracle and asyncspade rows, comma-separated from carry,radix: the "
                         "first names the rows, each further one adds rows suffixed /topk=<mode> and its own "
                         "Table 3 (layer_ms_topk=<mode>, overlap_topk=<mode>), side by side; empty: each "
                         "policy's default (asyncspade carry, oracle radix)")
    ap.add_argument("--select-overlap", default="",
                    help="SPADE_SELECT_OVERLAP modes (auto,on,off: the cache rank's top-K select of layer j beside "
                         "layer j+1's scoring, spade.kernels.select_overlap), comma-separated: the first names the "
                         "rows, each further one adds rows suffixed /sov=<mode> and its own Table 3, side by side; "
                         "empty: the environment's. The multiprocess cache process keeps the first")
    ap.add_argument("--score-pack", default="",
                    help="int4 tokens per MMA row of the scoring tile (1,4: GEMV_CONFIG pack, "
                         "spade.kernels.scoring), comma-separated: the first names the rows, each further one adds "
                         "rows suffixed /pack=<n>, side by side; empty: the library's default")
    ap.add_argument("--score-tile", default="",
                    help="launch tiles of the int8 / int4 scoring kernel, BLOCK_L:warps:stages[:PER_SM] or default "
                         "(GEMV_CONFIG over the device's tile, spade.kernels.scoring), comma-separated: the first "
                         "names the rows, each further one adds rows suffixed /tile=<spec>, side by side; "
                         "empty: the library's default")
    ap.add_argument("--carry-store", default="",
                    help="what the threshold carry's scoring stores (SELECT_CONFIG carry_compact, "
                         "spade.kernels.scoring.carry_store): mark (whole score rows) or compact (only the "
                         "candidates' scores), comma-separated: the first names the rows, each further one adds "
                         "rows suffixed /store=<mode>, side by side; empty: the library's default. The "
                         "multiprocess cache process keeps the library's default")
    ap.add_argument("--block-size", default="0",
                    help="paged KV cache: comma list of model.block_size values, 0 = the contiguous cache; each "
                         "builds its own model and its rows carry /paged<bs> (e.g. 0,16: side by side)")
    ap.add_argument("--refresh-every", default="1",
                    help="policy.refresh_every values of the asyncspade rows (comma-separated; a value N > 1 "
                         "adds rows suffixed /r=N: a selection every N steps, reused in between)")
    ap.add_argument("--rerank", default="1",
                    help="policy.rerank values m of the asyncspade rows (comma-separated; m > 1: the cache rank "
                         "selects m*K_mid candidates and the inference rank re-ranks them with the true query; "
                         "rows named .../m=<m>)")
    ap.add_argument("--score-channels", default="0",
                    help="policy.score_channels values of the asyncspade rows (comma-separated; r of the head "
                         "dim's channels in the scoring copy, 0: all; r > 0 adds rows named .../c=<r>)")
    ap.add_argument("--quick", action="store_true", help="B=8, L=32k, K=2k, P in {2, 4}")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--out", default="results/bench_tpot.json")
    pre, _ = ap.parse_known_args(argv)
    if pre.config:
        ap.set_defaults(**config_defaults(pre.config))
    a = ap.parse_args(argv)
    if a.quick:
        a.batch, a.context, a.budget, a.packs = [8], [32768], [2048], [4, 9]
        if a.device == "cpu":  # smoke run: tiny shapes
            a.batch, a.context, a.budget, a.iters, a.packs = [2], [256], [64], 5, [1, 2]
            a.recent, a.window = 8, 4
    a.methods = [m for m in a.methods.split(",") if m]
    if bad := [K for K in a.budget if a.sink + a.recent > K]:
        ap.error(f"--budget {','.join(map(str, bad))}: smaller than --sink {a.sink} + --recent {a.recent}, "
                 "the tokens every sparse row attends besides its selection; raise --budget or lower --sink / --recent")
    from spade.policies import POLICIES

    if bad := [m for m in a.methods if m.split("/")[0] not in POLICIES and m != "optimal"]:
        ap.error(f"--methods {','.join(bad)}: not a registered policy ({', '.join(POLICIES.names())}) or optimal")
    a.cache_thread = [m.strip() for m in a.cache_thread.split(",") if m.strip()]
    if not a.cache_thread or any(m not in ("auto", "coroutine") for m in a.cache_thread):
        ap.error(f"--cache-thread takes auto,coroutine (comma-separated); got {a.cache_thread}")
    a.modes = [m for m in a.modes.split(",") if m]
    a.score_keys = [m for m in a.score_keys.split(",") if m]
    bad = [m for m in a.score_keys if m not in ("exact", "int8", "int4")]
    if bad:
        ap.error(f"--score-keys: unknown {bad} (choose from exact,int8,int4)")
    a.cur_score_keys = "exact"
    from spade.kernels.pdl import PDL_MODES

    a.pdl = [m.strip().lower() for m in a.pdl.split(",") if m.strip()]
    if any(m not in PDL_MODES for m in a.pdl):
        ap.error(f"--pdl takes {','.join(PDL_MODES)} (comma-separated); got {a.pdl}")
    if not a.pdl:
        a.pdl = [""]  # the environment's SPADE_PDL, no suffix
    a.cur_pdl_sfx = ""
    a.topk = [m.strip().lower() for m in a.topk.split(",") if m.strip()]
    if any(m not in ("carry", "radix") for m in a.topk):
        ap.error(f"--topk takes carry,radix (comma-separated); got {a.topk}")
    a.topk = a.topk or [""]  # the policies' defaults, no suffix
    set_topk(a.topk[0], a)
    a.sov = [m.strip().lower() for m in a.select_overlap.split(",") if m.strip()]
    if any(m not in ("auto", "on", "off") for m in a.sov):
        ap.error(f"--select-overlap takes auto,on,off (comma-separated); got {a.sov}")
    a.sov = a.sov or [""]  # the environment's, no suffix
    a.cur_sov_sfx = ""  # (set_sov sets the environment: not here, the rows' loop does)
    a.refresh_every = _int_list(ap, "--refresh-every", a.refresh_every, 1, 64, "policy.refresh_every", 1)
    a.block_size = _int_list(ap, "--block-size", a.block_size, 0, 1 << 20, "model.block_size", 0)
    a.cur_bs_sfx = ""
    a.rerank = _int_list(ap, "--rerank", a.rerank, 1, 16, "policy.rerank", 1)
    a.score_channels = _int_list(ap, "--score-channels", a.score_channels, 0, 1 << 16,
                                 "policy.score_channels; 0: all", 0)
    a.cur_refresh, a.cur_rerank = 1, 1
    a.cur_channels = 0
    a.score_pack = _int_list(ap, "--score-pack", a.score_pack, 1, 4, "GEMV_CONFIG pack", 0) if a.score_pack else [0]
    if any(v not in (1, 4) for v in a.score_pack if v):
        ap.error(f"--score-pack takes 1,4 (comma-separated); got {a.score_pack}")
    a.cur_pack_sfx = ""
    a.score_tile = [t.strip() for t in a.score_tile.split(",") if t.strip()] or ["default"]
    for t in a.score_tile:
        parts = t.split(":")
        if t != "default" and (len(parts) not in (3, 4) or not all(x.isdigit() and int(x) > 0 for x in parts)):
            ap.error(f"--score-tile takes default or BLOCK_L:warps:stages[:PER_SM] (positive integers), "
                     f"comma-separated; got {t!r}")
    if len(set(a.score_tile)) != len(a.score_tile):
        ap.error(f"--score-tile names each tile once (rows are keyed by it); got {','.join(a.score_tile)}")
    a.cur_tile_sfx = ""
    a.carry_store = [m.strip().lower() for m in a.carry_store.split(",") if m.strip()]
    if any(m not in ("mark", "compact") for m in a.carry_store) or len(set(a.carry_store)) != len(a.carry_store):
        ap.error(f"--carry-store takes mark,compact (comma-separated, each once); got {','.join(a.carry_store)}")
    a.carry_store = a.carry_store or [""]  # the library's default, no suffix
    a.cur_store_sfx = ""
    return a


def _int_list(ap, flag: str, text: str, lo: int, hi: int, field: str, default: int) -> list[int]:
    """A comma-separated list of integers in [lo, hi] (``[default]`` when empty), or an
    argparse error naming the flag, the value and the range."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()] or [default]
    except ValueError:
        ap.error(f"{flag} takes integers in [{lo}, {hi}] (comma-separated); got {text!r}")
    if any(v < lo or v > hi for v in vals):
        ap.error(f"{flag} values must lie in [{lo}, {hi}] ({field}); got {vals}")
    return vals


def kv_bytes(model, B: int, L: int) -> int:
    s = model.spec
    return 2 * s.n_layers * B * s.n_kv_heads * L * s.head_dim * (torch.finfo(model.dtype).bits // 8)


def _pdl_tag(a) -> str:
    """Suffix of profile tags for rows of a later ``--pdl`` mode (``_pdloff``), else ``""``."""
    return getattr(a, "cur_pdl_sfx", "").replace("/pdl=", "_pdl")


def set_pdl(mode: str, a) -> None:
    """Rows from here on launch the decode kernels under ``SPADE_PDL=mode`` (``""``: the
    environment's, untouched); rows of a later mode are named ``.../pdl=<mode>``. Graphs
    are keyed by the mode (``spade.kernels.pdl.capture_key``), so each mode captures its own."""
    if mode:
        os.environ["SPADE_PDL"] = mode
    a.cur_pdl_sfx = "" if mode == a.pdl[0] else f"/pdl={mode}"


def set_sov(mode: str, a) -> None:
    """Rows from here on run the cache rank's selects under ``SPADE_SELECT_OVERLAP=mode``
    (``""``: the environment's); rows of a later mode are named ``.../sov=<mode>``
    (graphs are keyed by it: ``spade.kernels.pdl.capture_key``)."""
    if mode:
        os.environ["SPADE_SELECT_OVERLAP"] = mode
    a.cur_sov_sfx = "" if mode == a.sov[0] else f"/sov={mode}"


def set_score_pack(pack: int, a) -> None:
    """Rows from here on score int4 keys with ``pack`` tokens per MMA row (0: the
    library's default); rows of a later value of ``--score-pack`` are named
    ``.../pack=<n>``. Each row captures its own graphs, so each value compiles its own kernels."""
    from spade.kernels import scoring

    if pack:
        scoring.GEMV_CONFIG["pack"] = pack
    else:
        scoring.GEMV_CONFIG.pop("pack", None)
    a.cur_pack_sfx = "" if pack == a.score_pack[0] else f"/pack={pack}"


_TILE_KEYS = ("BLOCK_L", "num_warps", "num_stages", "PER_SM")


def set_score_tile(spec: str, a) -> None:
    """Rows from here on score int8 / int4 keys on the launch tile ``spec``
    (BLOCK_L:warps:stages[:PER_SM] over the device's tile, or ``default``); rows of a later
    value of ``--score-tile`` are named ``.../tile=<spec>``. Each row captures its own graphs."""
    from spade.kernels import scoring

    for key in _TILE_KEYS:
        scoring.GEMV_CONFIG.pop(key, None)
    if spec != "default":
        scoring.GEMV_CONFIG.update(zip(_TILE_KEYS, (int(x) for x in spec.split(":"))))
    a.cur_tile_sfx = "" if spec == a.score_tile[0] else f"/tile={spec}"


def set_carry_store(mode: str, a) -> None:
    """Rows from here on store the threshold carry's scores as ``mode`` (mark: whole rows;
    compact: the candidates' only; ``""``: the library's default); rows of a later mode of
    ``--carry-store`` are named ``.../store=<mode>``. Each row captures its own graphs."""
    from spade.kernels import radix_topk

    if mode == "compact":
        radix_topk.SELECT_CONFIG["carry_compact"] = True
    elif mode == "mark":
        radix_topk.SELECT_CONFIG["carry_compact"] = False
    else:
        radix_topk.SELECT_CONFIG.pop("carry_compact", None)
    a.cur_store_sfx = "" if mode == a.carry_store[0] else f"/store={mode}"


def set_topk(mode: str, a) -> None:
    """Rows from here on select with ``policy.topk=mode`` (oracle, asyncspade); rows of a
    later mode of ``--topk`` are named ``.../topk=<mode>``."""
    a.cur_topk = mode
    a.cur_topk_sfx = "" if mode == a.topk[0] else f"/topk={mode}"


def rows_for_budget(model, B: int, L: int, K: int, a, shared: dict, two: bool, record) -> None:
    """Every method row of ``a.methods`` at one (B, L, K), through ``record(name, fn)``."""
    for m in ("full", "quest", "tova", "oracle", "asyncspade/inline", "optimal"):
        if m in a.methods and not a.cur_sov_sfx and not (  # (select_overlap: the cache rank's only)
                (a.cur_topk_sfx or a.cur_store_sfx) and m in ("full", "quest", "tova", "optimal")):  # no top-K there
            record(m, lambda m=m: run_inline(model, m, B, L, K, a))
    if "asyncspade/inline" in a.methods and not a.cur_sov_sfx:
        for rr, ch, n, sk in itertools.product(a.rerank, a.score_channels, a.refresh_every, a.score_keys):
            if rr == 1 and ch == 0 and n == 1 and sk == "exact":
                continue  # the plain asyncspade/inline row above

            def go_inline(sk=sk, n=n, rr=rr, ch=ch):
                a.cur_score_keys, a.cur_refresh, a.cur_rerank, a.cur_channels = sk, n, rr, ch
                try:
                    return run_inline(model, "asyncspade/inline", B, L, K, a)
                finally:
                    a.cur_score_keys, a.cur_refresh, a.cur_rerank, a.cur_channels = "exact", 1, 1, 0

            record("asyncspade/inline" + ("" if sk == "exact" else f"/{sk}") + ("" if n == 1 else f"/r={n}")
                   + ("" if rr == 1 else f"/m={rr}") + ("" if ch == 0 else f"/c={ch}"), go_inline)
    for topo in ("colocated", "local", "multiprocess"):
        if f"asyncspade/{topo}" not in a.methods or (topo != "colocated" and not two):
            continue
        threads = a.cache_thread if topo != "multiprocess" else ["auto"]
        for rr, ch, n, sk, mode, P, ct in itertools.product(a.rerank, a.score_channels, a.refresh_every,
                                                             a.score_keys, a.modes, a.packs, threads):
            name = (f"asyncspade/{topo}/P={P}" + ("" if mode == "indices" else f"/{mode}")
                    + ("" if sk == "exact" else f"/{sk}")
                    + ("" if ct == threads[0] else f"/{ct}") + ("" if n == 1 else f"/r={n}")
                    + ("" if rr == 1 else f"/m={rr}") + ("" if ch == 0 else f"/c={ch}"))

            def go(topo=topo, P=P, mode=mode, sk=sk, ct=ct, n=n, rr=rr, ch=ch):
                a.cur_score_keys, a.cur_cache_thread, a.cur_refresh, a.cur_rerank = sk, ct, n, rr
                a.cur_channels = ch
                try:
                    return run_async(model, topo, P, mode, B, L, K, a, shared)
                finally:
                    a.cur_score_keys, a.cur_cache_thread, a.cur_refresh, a.cur_rerank = "exact", "auto", 1, 1
                    a.cur_channels = 0

            record(name, go)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see the module docstring); returns the exit status."""
    run(argv)
    return 0


def run(argv: list[str] | None = None) -> dict:
    """Run the benchmark and return the result dict (also written to ``--out``)."""
    a = parse_args(argv)
    from spade.models.fast import FastModel
    from spade.models.presets import preset_config

    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU visible: use --device cpu --preset tiny for a smoke run")
    if any(r.startswith("multiprocess") for r in a.host_profile.split(",")):
        import os  # the cache process (spawned by the first multiprocess row) profiles itself

        os.environ["SPADE_HOST_PROFILE"] = str(Path(a.out).parent / "host_profile_cache_process.txt")
    dtype = getattr(torch, a.dtype)
    n_gpu = torch.cuda.device_count() if device.type == "cuda" else 0
    two = device.type == "cpu" or n_gpu >= 2  # local/multiprocess rows (CPU: same device, gloo)
    t_start = time.time()
    hf_cfg = preset_config(a.preset, **({"num_hidden_layers": a.layers} if a.layers else {}))
    from spade.runtime.protocol import resolve_pack_layers

    a.packs = list(dict.fromkeys(resolve_pack_layers(p, hf_cfg.num_hidden_layers) for p in a.packs))
    result: dict[str, Any] = {"meta": {
        "preset": a.preset, "layers": hf_cfg.num_hidden_layers, "dtype": a.dtype, "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "gpus_visible": n_gpu,
        "torch": torch.__version__, "argv": sys.argv[1:] if argv is None else argv, "iters": a.iters,
        "warmup": a.warmup, "sink": a.sink, "recent": a.recent, "window": a.window, "predictor": a.predictor,
        "packs": a.packs, "modes": a.modes, "group_reduce": a.group_reduce, "rope_aware": a.rope_aware,
        "linear": a.linear},
        "configs": []}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    steps = (a.warmup + 2 * max(a.refresh_every) + a.iters + 8  # (warmup_steps: the longest warm-up of a row)
             + PROFILE_STEPS + HOST_PROFILE_STEPS)  # + an async row's profiled steps
    for B in a.batch:
        for L, bs in itertools.product(a.context, a.block_size):  # bs 0: the contiguous cache
            model = None
            a.cur_bs_sfx = f"/paged{bs}" if bs else ""
            try:
                free_memory()
                model = FastModel.from_config(hf_cfg, device=device, dtype=dtype, max_batch=B,
                                              max_seq_len=L + steps, linear=a.linear, block_size=bs or None)
            except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
                print(f"B={B} L={L}: skipped ({type(e).__name__}: {str(e)[:120]})", flush=True)
                result["configs"].append({"batch": B, "context": L, "skipped": str(e)[:300]})
                model = None
                free_memory()
                continue
            from spade.runtime.link import new_event_loop

            shared: dict = {"loop": new_event_loop()}
            lin_kernels = model.linear_kernels(B)
            fuse_glu = bool(getattr(model, "fuse_glu", False))
            print(f"B={B}: projections " + ", ".join(f"{k} {v}" for k, v in lin_kernels.items())
                  + f"; gate/up + SiLU product fused: {'on' if fuse_glu else 'off'}", flush=True)
            for K in a.budget:
                conf: dict[str, Any] = {"batch": B, "context": L, "budget": K, "block_size": bs, "rows": {}, "errors": {},
                                        "linear_kernels": lin_kernels,
                                        "fuse_glu": fuse_glu}
                print(f"\n== B={B} L={L} K={K}  (KV {kv_bytes(model, B, L) / 2**30:.1f} GiB)", flush=True)

                def record(name: str, fn):
                    name += (a.cur_pdl_sfx + a.cur_pack_sfx + a.cur_tile_sfx + a.cur_store_sfx + a.cur_sov_sfx
                             + a.cur_topk_sfx + a.cur_bs_sfx)
                    if a.budget_s and time.time() - t_start > a.budget_s:
                        conf["errors"][name] = f"not run: --budget-s {a.budget_s:g} spent"
                        print(f"  {name:<28} not run (budget spent)", flush=True)
                        return
                    t0 = time.time()
                    try:
                        conf["rows"][name] = fn()
                        r = conf["rows"][name]
                        extra = f"  late={r['late_packs']}" if r.get("late_packs") else ""
                        if r.get("host_ms_per_step") is not None:
                            extra += f"  host={r['host_ms_per_step']:.2f} ms/step"
                        ch = r.get("cache_host")
                        if ch:
                            extra += (f"  cache host={ch['host_ms_per_pack']:.3f}+send {ch['send_ms_per_pack']:.3f} "
                                      f"ms/pack, waits {ch['recv_wait_ms_per_step']:.2f} ms/step")
                            if ch.get("topk_calls", 0) > 0:
                                extra += f", top-K fallbacks {ch['topk_fallbacks'] / ch['topk_calls']:.1%}"
                        print(f"  {name:<28} {r['tpot_ms']:8.3f} ms  (mean {r.get('mean_ms', 0.0):.3f}, "
                              f"p90 {r['p90_ms']:.3f}; "
                              f"{time.time() - t0:.1f}s){extra}", flush=True)
                    except Exception as e:  # one failing row must not lose the others
                        conf["errors"][name] = f"{type(e).__name__}: {e}"
                        print(f"  {name:<28} FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    free_memory()
                    out.write_text(json.dumps({**result, "configs": result["configs"] + [conf]}, indent=2))

                for pm, sp, st, cs in itertools.product(a.pdl, a.score_pack, a.score_tile, a.carry_store):
                    set_pdl(pm, a)
                    set_score_pack(sp, a)
                    set_score_tile(st, a)
                    set_carry_store(cs, a)
                    for so in a.sov:
                        set_sov(so, a)
                        for tk in a.topk:
                            set_topk(tk, a)
                            rows_for_budget(model, B, L, K, a, shared, two, record)
                set_pdl(a.pdl[0], a)
                set_score_pack(a.score_pack[0], a)
                set_score_tile(a.score_tile[0], a)
                set_carry_store(a.carry_store[0], a)
                # Table 3 per select-overlap and top-K mode (the first ones' is the config's "overlap");
                # its per-layer timings read a contiguous cache: not for a paged row set
                for so, tk in itertools.product(a.sov, a.topk) if not bs else ():
                    set_sov(so, a)
                    set_topk(tk, a)
                    tag = a.cur_sov_sfx + a.cur_topk_sfx
                    sfx = tag.replace("/", "_")
                    try:
                        lt = layer_timings(model, B, L, K, a)
                        conf["layer_ms" + sfx] = lt
                        if not sfx:
                            conf["breakdown"] = breakdown(conf["rows"], lt, model.spec.n_layers)
                        conf["overlap" + sfx] = overlap_table(model, B, K, a, conf["rows"], lt)
                        for line in table3_lines(conf["overlap" + sfx]):
                            print(line + (f" [{tag[1:]}]" if sfx else ""), flush=True)
                    except Exception as e:
                        conf["errors"]["layer_timings" + sfx] = f"{type(e).__name__}: {e}"
                set_topk(a.topk[0], a)
                set_sov(a.sov[0], a)
                result["configs"].append(conf)
                out.write_text(json.dumps(result, indent=2))  # partial results survive a crash
            if "owner" in shared:  # the multiprocess cache process
                shared["loop"].run_until_complete(shared["owner"].aclose())
            shared["loop"].close()
            model.close()
            model = None
            free_memory()
    result["meta"]["wall_s"] = time.time() - t_start
    if not a.no_plots:
        result["plots"] = plots(result, out.parent)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out} ({result['meta']['wall_s']:.0f} s)")
    return result


if __name__ == "__main__":
    sys.exit(main())

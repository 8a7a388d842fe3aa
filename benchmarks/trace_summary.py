"""Where a profiled decode step's device time goes: busy / idle per GPU from a Chrome trace.

``torch.profiler`` traces list every kernel, copy and memset with its device, stream,
start and duration. A decode step is as fast as its inference GPU is kept busy, so this
reports, per device over the profiled window:

* ``busy_ms``: the union of all device activity (overlapping streams counted once);
* ``compute_ms``: the same without communication kernels (NCCL's send/recv kernels
  occupy SMs while they wait for their peer, so they count as busy without doing the
  step's work);
* ``idle_ms`` = span - busy: the bubbles, i.e. what the host or a late peer cost;
* per step (``/ steps``) and the largest gaps with the activity on either side, which
  name the cause (a gap before a selection copy: the cache rank was late; between two
  graph kernels of one pack: the host launched late).

Under programmatic dependent launch (``spade.kernels.pdl``) a kernel's recorded span
starts when its programs are launched, i.e. while they still wait for the previous
kernel: busy time stays right (the union), but per-kernel totals of the short kernels
that follow long ones include that wait (profile with ``SPADE_PDL=off`` to attribute time
per kernel).

    python -m benchmarks.trace_summary results/gpu/profile_local_P4_B8_L32768_K2048.json --steps 4
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
COMM_PREFIXES = ("ncclDevKernel", "ncclKernel", "nccl:")


def kernel_us(prof, key_len: int | None = None) -> dict[str, float]:
    """Device microseconds by kernel name (cut to ``key_len`` characters) over a finished
    ``torch.profiler.profile``: its self device time, summed over calls."""
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if us > 0:
            key = ev.key if key_len is None else ev.key[:key_len]
            out[key] = out.get(key, 0.0) + us
    return out


def _load(trace) -> dict:
    if isinstance(trace, dict):
        return trace
    p = Path(trace)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt") as f:
        return json.load(f)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def summarize_trace(trace, steps: int, *, top_gaps: int = 8, min_gap_us: float = 2.0) -> dict:
    """Per-device busy/idle summary of a Chrome trace (a path, ``.json`` or ``.json.gz``,
    or the loaded dict) covering ``steps`` decode steps. Times in ms (gaps in us)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    events = _load(trace).get("traceEvents", [])
    by_dev: dict[int, list[dict]] = {}
    for ev in events:
        if ev.get("ph") != "X" or ev.get("cat") not in DEVICE_CATS or "dur" not in ev:
            continue
        dev = (ev.get("args") or {}).get("device")
        if dev is None:
            continue
        by_dev.setdefault(int(dev), []).append(ev)
    out: dict = {"steps": steps, "devices": {}}
    for dev, evs in sorted(by_dev.items()):
        evs.sort(key=lambda e: float(e["ts"]))
        iv = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in evs]
        busy = _union(iv)
        comp = _union([x for x, e in zip(iv, evs) if not str(e.get("name", "")).startswith(COMM_PREFIXES)])
        span = busy[-1][1] - busy[0][0]
        busy_us = sum(e - s for s, e in busy)
        comp_us = sum(e - s for s, e in comp)
        # gaps between merged busy intervals, named by the activity ending before / starting after
        ends = sorted(((b, str(e.get("name", "?"))[:60]) for (a, b), e in zip(iv, evs)))
        gaps = []
        for (s0, e0), (s1, _e1) in zip(busy, busy[1:]):
            g = s1 - e0
            if g < min_gap_us:
                continue
            before = max((x for x in ends if x[0] <= e0 + 1e-6), default=(0, "?"))[1]
            after = next((str(e.get("name", "?"))[:60] for (a, _b), e in zip(iv, evs) if a >= s1 - 1e-6), "?")
            gaps.append({"us": round(g, 1), "before": before, "after": after})
        n_gaps = len(gaps)
        gap_us = sum(g["us"] for g in gaps)
        gaps.sort(key=lambda g: -g["us"])
        names: dict[str, float] = {}
        for (a, b), e in zip(iv, evs):
            k = str(e.get("name", "?"))[:60]
            names[k] = names.get(k, 0.0) + (b - a)
        top = sorted(names.items(), key=lambda kv: -kv[1])[:10]
        out["devices"][dev] = {
            "span_ms": span / 1e3, "busy_ms": busy_us / 1e3, "compute_ms": comp_us / 1e3,
            "idle_ms": (span - busy_us) / 1e3,
            "per_step": {"span_ms": span / 1e3 / steps, "busy_ms": busy_us / 1e3 / steps,
                         "compute_ms": comp_us / 1e3 / steps, "idle_ms": (span - busy_us) / 1e3 / steps},
            "busy_fraction": busy_us / span if span > 0 else 0.0,
            "gaps_over_min": n_gaps, "gap_ms_over_min": gap_us / 1e3, "min_gap_us": min_gap_us,
            "largest_gaps": gaps[:top_gaps],
            "top_activity_ms": [{"name": k, "ms": v / 1e3, "ms_per_step": v / 1e3 / steps} for k, v in top],
        }
    return out


def format_summary(s: dict) -> str:
    lines = [f"device timeline over {s['steps']} steps (ms per step; idle = span - union of device activity)"]
    for dev, d in s["devices"].items():
        p = d["per_step"]
        lines.append(f"  cuda:{dev}: span {p['span_ms']:.3f}  busy {p['busy_ms']:.3f} ({100 * d['busy_fraction']:.1f}%)"
                     f"  compute (no NCCL kernels) {p['compute_ms']:.3f}  idle {p['idle_ms']:.3f}"
                     f"  gaps >= {d['min_gap_us']:g} us: {d['gaps_over_min']}")
        for g in d["largest_gaps"]:
            lines.append(f"      gap {g['us']:8.1f} us   after {g['before']}   before {g['after']}")
        for t in d["top_activity_ms"][:6]:
            lines.append(f"      {t['ms_per_step']:8.3f} ms/step  {t['name']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.trace_summary", description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="Chrome trace of torch.profiler (.json or .json.gz)")
    ap.add_argument("--steps", type=int, required=True, help="decode steps the trace covers")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = ap.parse_args(argv)
    s = summarize_trace(a.trace, a.steps)
    print(json.dumps(s, indent=2) if a.json else format_summary(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

``--compare B --steps-b N`` accounts for one stream of each trace (by default the one with the
most kernel time on device 0: the inference rank's, beside a colocated cache rank's side stream)
and splits the difference of their spans per step into kernel time, by kernel name, and the
time between consecutive kernels, by the pair of names (negative: launches that overlapped,
PDL): where a step's excess over another goes (``stream_account``, ``compare_streams``).

    python -m benchmarks.trace_summary optimal.json.gz --steps 4 --compare colocated.json.gz --steps-b 4
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


def _device_events(trace):
    """(device, event) of each device activity (kernel, copy, memset) of a trace with its device."""
    for ev in _load(trace).get("traceEvents", []):
        if ev.get("ph") != "X" or ev.get("cat") not in DEVICE_CATS or "dur" not in ev:
            continue
        dev = (ev.get("args") or {}).get("device")
        if dev is not None:
            yield int(dev), ev


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
    by_dev: dict[int, list[dict]] = {}
    for dev, ev in _device_events(trace):
        by_dev.setdefault(dev, []).append(ev)
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


def stream_account(trace, steps: int, *, device: int = 0, stream: int | None = None, key_len: int = 60) -> dict:
    """One device stream's account over ``steps`` steps, ms per step: its span (first start
    to last end), kernel time by name, and the time between consecutive events summed by
    the pair of names (``span = kernels + between``; a negative ``between``: the next
    launch started before the last ended, PDL). ``stream``: default the stream of
    ``device`` with the most event time. Copies and memsets count as kernels here."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    by_stream: dict[int, list[dict]] = {}
    for dev, ev in _device_events(trace):
        if dev == device and ev["args"].get("stream") is not None:
            by_stream.setdefault(int(ev["args"]["stream"]), []).append(ev)
    if not by_stream:
        raise ValueError(f"the trace has no device events of device {device}")
    if stream is None:
        stream = max(by_stream, key=lambda k: sum(float(e["dur"]) for e in by_stream[k]))
    elif stream not in by_stream:
        raise ValueError(f"device {device} has no stream {stream} in the trace (streams: {sorted(by_stream)})")
    evs = sorted(by_stream[stream], key=lambda e: float(e["ts"]))
    kernels: dict[str, float] = {}
    pairs: dict[str, float] = {}
    for i, e in enumerate(evs):
        name = str(e.get("name", "?"))[:key_len]
        kernels[name] = kernels.get(name, 0.0) + float(e["dur"])
        if i:
            prev = evs[i - 1]
            gap = float(e["ts"]) - float(prev["ts"]) - float(prev["dur"])
            key = f"{str(prev.get('name', '?'))[:key_len]} -> {name}"
            pairs[key] = pairs.get(key, 0.0) + gap
    span = float(evs[-1]["ts"]) + float(evs[-1]["dur"]) - float(evs[0]["ts"])
    per = 1e3 * steps
    return {"device": device, "stream": stream, "steps": steps, "events": len(evs),
            "span_ms": span / per, "kernel_ms": sum(kernels.values()) / per, "between_ms": sum(pairs.values()) / per,
            "kernels_ms": {k: v / per for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])},
            "between_pairs_ms": {k: v / per for k, v in sorted(pairs.items(), key=lambda kv: -kv[1])}}


def compare_streams(a: dict, b: dict, *, top: int = 8) -> dict:
    """Where stream account ``b``'s span per step goes over ``a``'s (``stream_account``):
    the kernel-time and between-kernel deltas, each by name (or pair), largest first."""
    def delta(x: dict, y: dict) -> list[tuple[str, float]]:
        d = {k: y.get(k, 0.0) - x.get(k, 0.0) for k in set(x) | set(y)}
        return sorted(((k, v) for k, v in d.items() if abs(v) > 0), key=lambda kv: -abs(kv[1]))[:top]

    return {"span_ms": (a["span_ms"], b["span_ms"], b["span_ms"] - a["span_ms"]),
            "kernel_ms": (a["kernel_ms"], b["kernel_ms"], b["kernel_ms"] - a["kernel_ms"]),
            "between_ms": (a["between_ms"], b["between_ms"], b["between_ms"] - a["between_ms"]),
            "kernels": delta(a["kernels_ms"], b["kernels_ms"]),
            "between_pairs": delta(a["between_pairs_ms"], b["between_pairs_ms"])}


def format_compare(c: dict, a_name: str = "A", b_name: str = "B") -> str:
    lines = [f"stream accounts, ms per step: {a_name} -> {b_name} (delta)"]
    for part in ("span_ms", "kernel_ms", "between_ms"):
        x, y, d = c[part]
        lines.append(f"  {part[:-3]:<8} {x:8.3f} -> {y:8.3f}  ({d:+.3f})")
    lines.append("  kernel time by name:")
    lines += [f"      {d:+8.3f}  {k}" for k, d in c["kernels"]]
    lines.append("  time between consecutive kernels, by pair:")
    lines += [f"      {d:+8.3f}  {k}" for k, d in c["between_pairs"]]
    return "\n".join(lines)


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
    ap.add_argument("--compare", default="", help="a second trace: split its span per step over the first's by "
                                                  "kernel and by the time between kernels, on one stream each")
    ap.add_argument("--steps-b", type=int, default=0, help="decode steps the --compare trace covers (default --steps)")
    ap.add_argument("--device", type=int, default=0, help="--compare: the device whose stream is accounted")
    ap.add_argument("--stream", type=int, default=None,
                    help="--compare: the stream of both traces (default each one's busiest on --device)")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.steps_b < 0:
        ap.error(f"--steps must be >= 1 and --steps-b >= 0 (0: --steps); got {a.steps} and {a.steps_b}")
    if a.compare:
        try:
            sa = stream_account(a.trace, a.steps, device=a.device, stream=a.stream)
            sb = stream_account(a.compare, a.steps_b or a.steps, device=a.device, stream=a.stream)
        except ValueError as e:
            ap.error(str(e))
        c = compare_streams(sa, sb)
        print(json.dumps({"a": sa, "b": sb, "compare": c}, indent=2) if a.json
              else format_compare(c, f"{Path(a.trace).name} (stream {sa['stream']})",
                                  f"{Path(a.compare).name} (stream {sb['stream']})"))
        return 0
    s = summarize_trace(a.trace, a.steps)
    print(json.dumps(s, indent=2) if a.json else format_summary(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())

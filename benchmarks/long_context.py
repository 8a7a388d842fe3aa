"""Long-context summary: TPOT of every method against context length (the paper's
Fig. 2(b), measured), from ``bench_tpot`` JSON files.

``scripts/gpu_all.sh long`` runs ``bench_tpot`` once per shape of ``LONG_SHAPES``
(B=1 at 64k-512k, B=2 256k, B=4 128k, B=8 64k, beside 8x32k, 16x32k and 32x16k);
this script reads their JSON and writes

* ``long_context.json``: one row per (B, L, K, method): TPOT median and p90, the ratio
  to ``optimal``, full / method, the cache rank's top-K fallback rate (asynchronous rows)
  and Table 3 (the cache rank's pack over the inference rank's, per top-K mode);
* ``long_context.md``: the same as a markdown table (for docs/perf.md);
* ``long_context_b1.png``: TPOT against context at B=1 for full, quest, optimal and
  asyncspade (local and colocated), log-scaled context axis;
* ``long_context_ratio.png``: every shape's asyncspade / optimal ratio.

    python -m benchmarks.long_context results/gpu/bench_tpot_long_*.json --out results/gpu/long_context.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# method label -> how a bench_tpot row name starts (the asynchronous rows carry /P=.. and
# their scoring keys after the topology)
_LABELS = (("full", "full"), ("quest", "quest"), ("optimal", "optimal"), ("inline", "asyncspade/inline"),
           ("local", "asyncspade/local"), ("colocated", "asyncspade/colocated"),
           ("multiprocess", "asyncspade/multiprocess"))


def _label(name: str, with_packs: bool = False) -> str | None:
    """The summary's method label of a bench_tpot row name (``.../topk=radix`` rows keep
    their mode as a suffix: ``local/topk=radix``; with ``with_packs``, a run of several
    pack sizes, the pack size too: ``local/P=9``)."""
    parts = name.split("/")
    mode = next((p for p in parts if p.startswith("topk=")), None)
    refresh = next((p for p in parts if p.startswith("r=")), None)
    packs = next((p for p in parts if p.startswith("P=")), None) if with_packs else None
    for label, prefix in _LABELS:
        if name == prefix or name.startswith(prefix.rstrip("/") + "/"):
            return (label + (f"/{packs}" if packs else "") + (f"/{mode}" if mode else "")
                    + (f"/{refresh}" if refresh else ""))
    return None


def _pack_sizes(conf: dict) -> set[str]:
    return {p for name in conf["rows"] for p in name.split("/") if p.startswith("P=")}


def _table3(conf: dict) -> dict[str, float]:
    """Table 3 per top-K mode: the cache rank's pack (as the runtime runs it, the first
    non-exact scoring keys measured) over the inference rank's pack."""
    out = {}
    for key, rows in conf.items():
        if not key.startswith("overlap") or not isinstance(rows, list):
            continue
        tag = key[len("overlap"):].lstrip("_") or "default"
        for r in rows:
            inf = r.get("inference_ms_per_pack")
            runtime = sorted(k for k in r if k.startswith("cache_ms_per_pack_runtime"))
            if inf and runtime:
                out[tag] = r[runtime[-1]] / inf
                if r.get("pack_layers") is not None:
                    out[f"{tag}/P={r['pack_layers']}"] = r[runtime[-1]] / inf
    return out


def summarise(results: list[dict]) -> list[dict[str, Any]]:
    """One row per (B, L, K, method) over every config of every result."""
    rows = []
    for res in results:
        gpu = res.get("meta", {}).get("gpu", "?")
        for conf in res.get("configs", []):
            if "rows" not in conf:
                continue
            opt = conf["rows"].get("optimal", {}).get("tpot_ms")
            full = conf["rows"].get("full", {}).get("tpot_ms")
            t3 = _table3(conf)
            several = len(_pack_sizes(conf)) > 1
            for name, r in conf["rows"].items():
                label = _label(name, several)
                if label is None:
                    continue
                row = {"gpu": gpu, "batch": conf["batch"], "context": conf["context"], "budget": conf["budget"],
                       "method": label, "row": name, "tpot_ms": r["tpot_ms"], "p90_ms": r.get("p90_ms"),
                       "vs_optimal": r["tpot_ms"] / opt if opt else None,
                       "full_over": full / r["tpot_ms"] if full else None,
                       "late_packs": r.get("late_packs", 0)}
                ch = r.get("cache_host") or {}
                if ch.get("topk_calls"):
                    row["topk_fallback_rate"] = ch["topk_fallbacks"] / ch["topk_calls"]
                    if "topk_fallbacks_too_many" in ch:
                        row["topk_fallbacks_too_many_rate"] = ch["topk_fallbacks_too_many"] / ch["topk_calls"]
                if label.split("/")[0] in ("local", "colocated", "multiprocess"):
                    mode = next((p for p in name.split("/") if p.startswith("topk=")), None)
                    key = f"topk_{mode[5:]}" if mode else "default"
                    packs = next((p for p in name.split("/") if p.startswith("P=")), None)
                    if several and packs:
                        key = f"{key}/{packs}"
                    if key in t3:
                        row["table3"] = t3[key]
                    elif "default" in t3 and not mode:
                        row["table3"] = t3["default"]
                rows.append(row)
    rows.sort(key=lambda r: (r["batch"] * r["context"], r["batch"], r["method"]))
    return rows


def markdown(rows: list[dict]) -> str:
    """A table per shape: methods as columns (TPOT ms and the ratio to optimal)."""
    shapes = sorted({(r["batch"], r["context"], r["budget"]) for r in rows}, key=lambda s: (s[0] * s[1], s[0]))
    methods = []
    for r in rows:
        if r["method"] not in methods:
            methods.append(r["method"])
    order = [m for m in ("full", "quest", "optimal", "inline", "local", "colocated", "multiprocess") if m in methods]
    order += [m for m in methods if m not in order]
    head = "| B x L | " + " | ".join(order) + " | top-K fallbacks (local) | Table 3 |"
    lines = [head, "|" + "---|" * (len(order) + 3)]
    for B, L, K in shapes:
        by = {r["method"]: r for r in rows if (r["batch"], r["context"], r["budget"]) == (B, L, K)}
        cells = []
        for m in order:
            r = by.get(m)
            if r is None:
                cells.append("—")
            elif m in ("full", "optimal") or r["vs_optimal"] is None:
                cells.append(f"{r['tpot_ms']:.2f}")
            else:
                cells.append(f"{r['tpot_ms']:.2f} ({r['vs_optimal']:.2f}x)")
        loc = next((by[m] for topo in ("local", "colocated") for m in [topo, *order]
                    if m in by and m.split("/")[0] == topo), {})
        fb = loc.get("topk_fallback_rate")
        t3 = loc.get("table3")
        lines.append(f"| {B} x {L // 1024}k | " + " | ".join(cells)
                     + f" | {'—' if fb is None else f'{fb:.1%}'} | {'—' if t3 is None else f'{t3:.2f}'} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], out_dir: Path) -> list[str]:
    import matplotlib  # a dependency of spade

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        p = out_dir / name
        fig.savefig(p, dpi=120)
        plt.close(fig)
        files.append(str(p))

    b1 = [r for r in rows if r["batch"] == 1]
    if b1:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        refresh = sorted({r["method"] for r in b1 if r["method"].startswith("colocated/r=")})
        for m, style in (("full", "k-o"), ("quest", "-s"), ("optimal", "k--"), ("local", "-^"), ("colocated", "-v"),
                         *((m, ":v") for m in refresh)):
            pts = sorted((r["context"], r["tpot_ms"]) for r in b1 if r["method"] == m)
            if pts:
                label = {"local": "asyncspade (cache rank on GPU 2)", "colocated": "asyncspade (one GPU)"}.get(m, m)
                if m.startswith("colocated/r="):
                    label = f"asyncspade (one GPU, selecting every {m.split('=')[1]} steps)"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("median TPOT (ms)")
        gpu = b1[0]["gpu"]
        ax.set_title(f"decode step vs context, B=1, K={b1[0]['budget']} ({gpu})", fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        save(fig, "long_context_b1.png")
    asy = [r for r in rows if r["method"] in ("local", "colocated") and r["vs_optimal"]]
    if asy:
        fig, ax = plt.subplots(figsize=(7, 4))
        shapes = sorted({(r["batch"], r["context"]) for r in asy}, key=lambda s: (s[0] * s[1], s[0]))
        for i, m in enumerate(("local", "colocated")):
            vals = [next((r["vs_optimal"] for r in asy if (r["batch"], r["context"]) == s and r["method"] == m),
                         float("nan")) for s in shapes]
            ax.bar([j + 0.4 * i for j in range(len(shapes))], vals, width=0.4, label=m)
        ax.axhline(1.1, color="k", ls=":", lw=1, label="1.1x")
        ax.set_xticks([j + 0.2 for j in range(len(shapes))], [f"{b}x{c // 1024}k" for b, c in shapes], rotation=45)
        ax.set_ylabel("TPOT / optimal")
        ax.set_title("asyncspade against the optimal sparse step", fontsize=9)
        ax.legend(fontsize=8)
        save(fig, "long_context_ratio.png")
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="bench_tpot JSON files")
    ap.add_argument("--out", default="results/long_context.json")
    ap.add_argument("--no-plots", action="store_true")
    a = ap.parse_args(argv)
    results = []
    for f in a.inputs:
        try:
            results.append(json.loads(Path(f).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            print(f"long_context: skipping {f}: {e}", file=sys.stderr)
    rows = summarise(results)
    if not rows:
        print("long_context: no rows in the inputs", file=sys.stderr)
        return 1
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    md = markdown(rows)
    files = [] if a.no_plots else plot(rows, out.parent)
    out.write_text(json.dumps({"rows": rows, "plots": files}, indent=2))
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {out}" + (f", {', '.join(files)}" if files else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

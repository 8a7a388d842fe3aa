"""PNG plots of the eval results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save_figure(fig, path: Path) -> str:
    """Lay ``fig`` out, write it to ``path`` (folders made) as a PNG and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _zoom(ax, series: dict[str, list]) -> None:
    """y from a little below the smallest bar to 1: differences of a few hundredths show."""
    vals = [v for vs in series.values() for v in vs if v is not None]
    if vals:
        lo = max(0.0, int((min(vals) - 0.05) * 10) / 10)
        ax.set_ylim(lo, min(1.02, max(vals) + 0.04) if max(vals) <= 1 else max(vals) * 1.05)


def _budgets(rows: list[dict]) -> list[str]:
    seen: list[str] = []
    for r in rows:
        if r["budget"] not in seen:
            seen.append(r["budget"])
    fixed = sorted((b for b in seen if "ctx" not in b), key=lambda b: int(b.split("=")[1]))
    return fixed + [b for b in seen if "ctx" in b]


def _get(rows: list[dict], budget: str, policy: str, reduce: str) -> dict | None:
    for r in rows:
        if r["budget"] == budget and r["policy"] == policy and r["reduce"] == reduce:
            return r
    return None


def _colors(n: int) -> list:
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def _bars(ax, groups: list[str], series: dict[str, list[float]], ylabel: str, title: str) -> None:
    n = max(1, len(series))
    width = 0.8 / n
    for i, ((lab, vals), col) in enumerate(zip(series.items(), _colors(n))):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [v if v is not None else 0.0 for v in vals], width, label=lab, color=col)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)


def selection_plots(name: str, rows: list[dict], cfg, out_dir: Path) -> list[str]:
    """Summary bars, per-layer recall, GQA reductions, Fig. 4 and Fig. 5."""
    from spade.eval.selection import baseline_reduces

    out: list[str] = []
    budgets = _budgets(rows)
    red = cfg.group_reduces[0]
    preds = [p for p in cfg.predictors]
    others = [b for b in cfg.baselines if b != "oracle"]
    main = ([("oracle", red)] if "oracle" in cfg.baselines else []) + \
        [(f"asyncspade[{p}{',rope' if r else ''}]", red) for p in preds for r in cfg.rope_aware] + \
        [(b, red if red in baseline_reduces(b, [red]) else "-") for b in others]
    for metric in ("recall", "overlap"):
        fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(budgets) * len(main) / 3), 4.5))
        series = {}
        for pol, rd in main:
            vals = [(_get(rows, b, pol, rd) or {}).get(metric) for b in budgets]
            if any(v is not None for v in vals):
                series[pol] = vals
        _bars(ax, budgets, series, metric, f"{name}: {metric} by policy and budget ({red}; layer mean)")
        _zoom(ax, series)
        ax.legend(fontsize=7, ncol=3, loc="lower right")
        out.append(save_figure(fig, out_dir / f"selection_{name}_{metric}.png"))

    # per-layer recall at the first budget
    b0 = budgets[0]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    key = [(p, rd) for p, rd in main if not p.startswith("asyncspade[") or p in (
        "asyncspade[last]", "asyncspade[assembled]", "asyncspade[assembled,rope]")]
    for (pol, rd), col in zip(key, _colors(len(key))):
        r = _get(rows, b0, pol, rd)
        if r is not None and "recall_per_layer" in r:
            ax.plot(range(len(r["recall_per_layer"])), r["recall_per_layer"], marker=".", label=pol, color=col)
    ax.set_xlabel("layer")
    ax.set_ylabel("attention recall")
    ax.set_title(f"{name}: recall per layer, {b0}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    out.append(save_figure(fig, out_dir / f"selection_{name}_layers.png"))

    # GQA group reductions
    pols = (["oracle"] if "oracle" in cfg.baselines else []) + [f"asyncspade[{p}]" for p in preds]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric in zip(axes, ("recall", "overlap")):
        series = {rd: [(_get(rows, b0, p, rd) or {}).get(metric) for p in pols] for rd in cfg.group_reduces}
        _bars(ax, pols, series, metric, f"{name}: GQA reduction, {b0}")
        _zoom(ax, series)
        ax.tick_params(axis="x", labelsize=7, rotation=15)
        ax.legend(fontsize=7)
    out.append(save_figure(fig, out_dir / f"selection_{name}_reduce.png"))

    # Fig. 4: overlap of the top-K of q_{t-d} with that of q_t
    ds = list(cfg.distances)
    if ds:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for b in budgets:
            vals = [(_get(rows, b, f"stale[d={d}]", red) or {}).get("overlap") for d in ds]
            ax.plot(ds, vals, marker="o", label=b)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("distance d (steps)")
        ax.set_ylabel("overlap |S(q_{t-d}) ∩ S(q_t)| / |S|")
        ax.set_title(f"{name}: top-K overlap vs query distance (Fig. 4)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        out.append(save_figure(fig, out_dir / f"selection_{name}_fig4.png"))

    # Fig. 5: ridge with vs without the one-step shift
    if cfg.shift_ablation:
        fig, ax = plt.subplots(figsize=(8, 4.2))
        labels = ["ridge[shift]", "ridge[no shift]", "assembled[shift]", "assembled[no shift]", "stale[d=1]"]
        series = {lab.replace("stale[d=1]", "last (q_{t-1})"): [(_get(rows, b, lab, red) or {}).get("overlap")
                                                                for b in budgets] for lab in labels}
        _bars(ax, budgets, series, "overlap", f"{name}: one-step shift of the ridge weights (Fig. 5)")
        _zoom(ax, series)
        ax.legend(fontsize=7, ncol=3, loc="lower right")
        out.append(save_figure(fig, out_dir / f"selection_{name}_fig5.png"))
    return out


def perplexity_plot(name: str, res: dict, out_dir: Path) -> list[str]:
    rows = res["rows"]
    budgets: list[str] = []
    pols: list[str] = []
    for r in rows:
        budgets += [r["budget"]] if r["budget"] not in budgets else []
        pols += [r["policy"]] if r["policy"] not in pols else []
    fig, ax = plt.subplots(figsize=(9, 4.5))
    series = {p: [next((100 * r["rel_change"] for r in rows if r["budget"] == b and r["policy"] == p), None)
                  for b in budgets] for p in pols}
    _bars(ax, budgets, series, "perplexity change vs full (%)",
          f"{name}: perplexity under sparse decoding (full {res['ppl_full']:.2f})")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.legend(fontsize=7, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return [save_figure(fig, out_dir / f"perplexity_{name}.png")]


def gsm8k_plot(res: dict, out_dir: Path) -> list[str]:
    rows = res["rows"]
    labels = [r["run"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(labels)), 4.5))
    _bars(ax, labels, {"accuracy": [r["accuracy"] for r in rows],
                       "prefix agreement": [r["prefix_agreement"] for r in rows],
                       "token agreement": [r["token_agreement"] for r in rows]},
          "fraction", f"GSM8K, {res['model']}, {res['n_problems']} problems (greedy)")
    ax.errorbar([i - 0.8 / 3 for i in range(len(rows))], [r["accuracy"] for r in rows], yerr=[r["stderr"] for r in rows], fmt="none",
                ecolor="k", capsize=3, elinewidth=0.8, xerr=None)
    ax.tick_params(axis="x", labelsize=7, rotation=20)
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    return [save_figure(fig, out_dir / f"gsm8k_{res['model']}.png")]


def niah_plot(res: dict, cfg, out_dir: Path) -> list[str]:
    rows = res["rows"]
    labels = [r["run"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(labels)), 4.5))
    series: dict[str, list[Any]] = {f"ctx {n}": [r["by_context"][str(n)] for r in rows] for n in cfg.context_lengths}
    _bars(ax, labels, series, "exact retrieval", f"needle in a haystack, {res['model']}")
    ax.tick_params(axis="x", labelsize=7, rotation=25)
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    return [save_figure(fig, out_dir / f"niah_{res['model']}.png")]

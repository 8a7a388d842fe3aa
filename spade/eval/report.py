"""Markdown tables from ``spade eval`` result files (for ``docs/fidelity.md``).

    python -m spade.eval.report results/eval/smollm2 [more result folders...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _md(cols: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _f(v, nd: int = 3) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def _budget_order(labels) -> list[str]:
    labels = list(dict.fromkeys(labels))
    fixed = sorted((b for b in labels if "ctx" not in b), key=lambda b: int(b.split("=")[1]))
    return fixed + [b for b in labels if "ctx" in b]


def selection_tables(path: Path) -> str:
    d = json.loads(path.read_text())
    rows = d["rows"]
    reds = d["config"]["group_reduces"]
    red = reds[0]
    budgets = _budget_order(r["budget"] for r in rows)
    get = {(r["budget"], r["policy"], r["reduce"]): r for r in rows}
    pols = list(dict.fromkeys(r["policy"] for r in rows if not r["policy"].startswith(("stale", "ridge[", "assembled["))))
    out = [f"**{path.stem}** ({d['spec']}, {len(d['positions'])} positions {d['positions'][0]}..{d['positions'][-1]})",
           "", f"Attention recall / overlap, GQA reduction `{red}`, mean over layers:", ""]
    body = []
    for p in pols:
        rd = red if (budgets[0], p, red) in get else "-"
        cells = [f"{_f(get.get((b, p, rd), {}).get('recall'))} / {_f(get.get((b, p, rd), {}).get('overlap'))}"
                 for b in budgets]
        body.append([p] + cells)
    out.append(_md(["policy"] + budgets, body))
    out += ["", "GQA reductions (recall / overlap), " + budgets[0] + " and " + budgets[-1] + ":", ""]
    body = []
    for p in [x for x in pols if x == "oracle" or x.startswith("asyncspade")] + (["quest"] if "quest" in pols else []):
        cells = []
        for b in (budgets[0], budgets[-1]):
            for r in reds:
                g = get.get((b, p, r))
                cells.append("-" if g is None else f"{_f(g['recall'])} / {_f(g['overlap'])}")
        body.append([p] + cells)
    out.append(_md(["policy"] + [f"{b} {r}" for b in (budgets[0], budgets[-1]) for r in reds], body))
    dists = d["config"]["distances"]
    out += ["", "Fig. 4: overlap of the top-K of q_{t-d} with that of q_t:", ""]
    out.append(_md(["budget"] + [f"d={x}" for x in dists],
                   [[b] + [_f(get.get((b, f"stale[d={x}]", red), {}).get("overlap")) for x in dists] for b in budgets]))
    labs = ["ridge[shift]", "ridge[no shift]", "assembled[shift]", "assembled[no shift]", "stale[d=1]"]
    out += ["", "Fig. 5: ridge weights applied with / without the one-step shift (overlap):", ""]
    out.append(_md(["budget"] + labs, [[b] + [_f(get.get((b, lab, red), {}).get("overlap")) for lab in labs]
                                      for b in budgets]))
    return "\n".join(out)


def perplexity_tables(path: Path) -> str:
    d = json.loads(path.read_text())
    budgets = list(dict.fromkeys(r["budget"] for r in d["rows"]))
    pols = list(dict.fromkeys(r["policy"] for r in d["rows"]))
    body = []
    for p in pols:
        cells = []
        for b in budgets:
            r = next((r for r in d["rows"] if r["policy"] == p and r["budget"] == b), None)
            cells.append("-" if r is None else f"{r['ppl']:.3f} ({100 * r['rel_change']:+.2f}%), top-1 "
                         f"{r['top1_agreement']:.3f}, att {r['mean_attended']:.0f}")
        body.append([p] + cells)
    head = (f"**{path.stem}**: full attention {d['ppl_full']:.3f} (plain HF forward {d['ppl_hf']:.3f}), "
            f"{d['tokens_per_text']} scored tokens per text, {len(d['nll_full_per_text'])} text(s)")
    return head + "\n\n" + _md(["policy"] + budgets, body)


def gsm8k_tables(path: Path) -> str:
    d = json.loads(path.read_text())
    body = [[r["run"], f"{r['correct']}/{r['n']} = {r['accuracy']:.3f} ± {r['stderr']:.3f}",
             f"{r['lost_vs_full']} / {r['gained_vs_full']}", _f(r["prefix_agreement"]), _f(r["token_agreement"]),
             f"{r['mean_generated']:.0f}", f"{r['mean_attended']:.0f}"] for r in d["rows"]]
    head = f"**{path.stem}**: {d['n_problems']} problems, mean prompt {d['mean_prompt_tokens']:.0f} tokens"
    return head + "\n\n" + _md(["run", "accuracy", "lost / gained vs full", "prefix agreement", "token agreement",
                                "generated tokens", "mean attended"], body)


def niah_tables(path: Path) -> str:
    d = json.loads(path.read_text())
    ctxs = list(d["rows"][0]["by_context"]) if d["rows"] else []
    body = [[r["run"], _f(r["retrieval"], 2)] + [_f(r["by_context"][c], 2) for c in ctxs] for r in d["rows"]]
    n = d["rows"][0]["n"] if d["rows"] else 0
    return f"**{path.stem}**: exact passphrase retrieval, {n} needles per run\n\n" + _md(
        ["run", "all"] + [f"ctx {c}" for c in ctxs], body)


def report(folder: Path) -> str:
    parts = []
    for f in sorted(folder.glob("*.json")):
        kind = f.stem.split("_")[0]
        fn = {"selection": selection_tables, "perplexity": perplexity_tables, "gsm8k": gsm8k_tables,
              "niah": niah_tables}.get(kind)
        if fn is not None:
            parts.append(fn(f))
    return "\n\n".join(parts)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(report(Path(arg)))
        print()

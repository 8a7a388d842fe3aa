"""``spade eval``: does predicted-query selection keep the model's answers?

Four measurements, each a section of ``SpadeConfig.eval`` and runnable alone:

* ``selection``: overlap with the exact top-K and attention recall of every
  policy, predictor and GQA reduction, on captured queries/keys of real text
  (plus the paper's Fig. 4 and Fig. 5);
* ``perplexity``: teacher-forced perplexity under sparse decoding vs full;
* ``gsm8k``: greedy GSM8K accuracy and token agreement vs full attention;
* ``niah``: needle-in-a-haystack retrieval.

Results go to ``<out_dir>/<section>_<model>.json`` with PNG plots beside them,
and a summary table is printed. See ``docs/fidelity.md``.

>>> import spade                                                   # doctest: +SKIP
>>> cfg = spade.load_config("configs/eval_smollm2.yaml")
>>> from spade.eval import run_eval
>>> res = run_eval(cfg, "results/eval", ["selection"])
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from spade.eval.config import SECTIONS, EvalConfig

__all__ = ["run_eval", "EvalConfig", "SECTIONS", "eval_config"]


def eval_config(cfg: Any) -> EvalConfig:
    """The ``EvalConfig`` of a ``SpadeConfig`` (also accepts the older placeholder
    section ``{out_dir, extra}``, whose ``extra`` holds the measurement sections)."""
    ev = getattr(cfg, "eval", cfg)
    if isinstance(ev, EvalConfig):
        return ev
    extra = dict(getattr(ev, "extra", {}) or {})
    return EvalConfig(out_dir=getattr(ev, "out_dir", "results/eval"), **extra)


def run_eval(cfg: Any, out: str | None = None, sections: list[str] | None = None) -> dict:
    """Run the requested ``sections`` (default: every enabled one) and return their
    results; writes JSON and PNG files under ``out`` (default ``eval.out_dir``) and
    prints a summary table per section."""
    from spade.errors import ConfigError
    from spade.eval.common import say, write_json

    ecfg = eval_config(cfg)
    if sections:
        bad = [s for s in sections if s not in SECTIONS]
        if bad:
            raise ConfigError(f"unknown eval section(s) {', '.join(bad)}; choose from: {', '.join(SECTIONS)}")
        todo = list(sections)
    else:
        todo = [s for s in SECTIONS if getattr(ecfg, s).enabled]
    if not todo:
        raise ConfigError("no eval section enabled; set eval.<section>.enabled: true or pass --only")
    out_dir = Path(out or ecfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    timings: dict[str, float] = {}
    for sec in todo:
        t0 = time.time()
        say(f"section {sec} -> {out_dir}")
        results[sec] = _run_section(sec, ecfg, out_dir)
        timings[sec] = time.time() - t0
        say(f"section {sec} done in {timings[sec]:.0f} s")
        _print_section(sec, results[sec])
    write_json(out_dir / "summary.json", {"sections": todo, "seconds": timings,
                                          "config": ecfg.model_dump(mode="json"),
                                          "summary": {s: _summary_rows(s, results[s]) for s in todo}})
    results["seconds"] = timings
    return results


def _run_section(sec: str, ecfg: EvalConfig, out_dir: Path) -> dict:
    if sec == "selection":
        from spade.eval.selection import run_selection

        return run_selection(ecfg.selection, out_dir, ecfg.device)
    if sec == "perplexity":
        from spade.eval.perplexity import run_perplexity

        return run_perplexity(ecfg.perplexity, out_dir, ecfg.device)
    if sec == "gsm8k":
        from spade.eval.generation import run_gsm8k

        return run_gsm8k(ecfg.gsm8k, out_dir, ecfg.device)
    from spade.eval.niah import run_niah

    return run_niah(ecfg.niah, out_dir, ecfg.device)


# --------------------------------------------------------------------------- summaries
def _summary_rows(sec: str, res: dict) -> dict[str, tuple[list[str], list[list[Any]]]]:
    """{table title: (columns, rows)} of a section's headline numbers."""
    tables: dict[str, tuple[list[str], list[list[Any]]]] = {}
    if sec == "selection":
        red = res["config"]["group_reduces"][0]
        for name, m in res["models"].items():
            rows = [r for r in m["rows"] if r["reduce"] in (red, "-") and not r["policy"].startswith(("stale", "ridge[", "assembled["))]
            budgets = _order_budgets(dict.fromkeys(r["budget"] for r in rows))
            pols = list(dict.fromkeys(r["policy"] for r in rows))
            cols = ["policy"] + [f"recall {b}" for b in budgets] + [f"overlap {b}" for b in budgets]
            body = []
            for p in pols:
                get = {(r["budget"], k): r.get(k) for r in rows if r["policy"] == p for k in ("recall", "overlap")}
                body.append([p] + [_fmt(get.get((b, "recall"))) for b in budgets]
                            + [_fmt(get.get((b, "overlap"))) for b in budgets])
            tables[f"selection {name} ({red}, mean over layers)"] = (cols, body)
    elif sec == "perplexity":
        for name, m in res["models"].items():
            budgets = list(dict.fromkeys(r["budget"] for r in m["rows"]))
            pols = list(dict.fromkeys(r["policy"] for r in m["rows"]))
            cols = ["policy"] + [f"ppl {b}" for b in budgets]
            body = [["full", *[f"{m['ppl_full']:.3f}"] * len(budgets)]]
            for p in pols:
                cells = []
                for b in budgets:
                    r = next((r for r in m["rows"] if r["policy"] == p and r["budget"] == b), None)
                    cells.append("-" if r is None else f"{r['ppl']:.3f} ({100 * r['rel_change']:+.2f}%)")
                body.append([p] + cells)
            tables[f"perplexity {name} (HF forward: {m['ppl_hf']:.3f})"] = (cols, body)
    elif sec == "gsm8k":
        cols = ["run", "accuracy", "± s.e.", "changed vs full", "prefix agree", "token agree", "gen tokens",
                "attended"]
        body = [[r["run"], f"{r['accuracy']:.3f}", f"{r['stderr']:.3f}", r["changed_vs_full"],
                 f"{r['prefix_agreement']:.3f}", f"{r['token_agreement']:.3f}", f"{r['mean_generated']:.0f}",
                 f"{r['mean_attended']:.0f}"] for r in res["rows"]]
        tables[f"gsm8k {res['model']} ({res['n_problems']} problems)"] = (cols, body)
    elif sec == "niah":
        ctxs = list(res["rows"][0]["by_context"]) if res["rows"] else []
        cols = ["run", "retrieval"] + [f"ctx {c}" for c in ctxs]
        body = [[r["run"], f"{r['retrieval']:.2f}", *[f"{r['by_context'][c]:.2f}" for c in ctxs]]
                for r in res["rows"]]
        tables[f"niah {res['model']}"] = (cols, body)
    return tables


def _order_budgets(labels) -> list[str]:
    """Fixed budgets by size, then the context fractions."""
    labels = list(labels)
    fixed = sorted((b for b in labels if "ctx" not in b), key=lambda b: int(b.split("=")[1]))
    return fixed + [b for b in labels if "ctx" in b]


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}"


def _print_section(sec: str, res: dict) -> None:
    from spade.eval.common import print_table

    for title, (cols, rows) in _summary_rows(sec, res).items():
        print_table(title, cols, rows)

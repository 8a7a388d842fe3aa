"""The measured rows of ``benchmarks.bench_tpot`` result folders as one compact table: ``docs/perf_runs.json``.

    python scripts/perf_runs.py RUN_DIR [RUN_DIR ...] --out docs/perf_runs.json [--append]
    python scripts/perf_runs.py --csv docs/perf_runs.json > perf_runs.csv    # one flat row per measurement

A run folder holds the JSON files ``bench_tpot`` wrote (``--out``) and, optionally, a README.md whose
first line is ``# runNN (GPU, YYYY-MM-DD): what it measured``. Each timed row of each file becomes one
row (metric ``tpot_ms``; ``ratio`` = the row / the optimal row of the same file and variant), and each
Table 3 measurement (the cache rank's pack as the runtime runs it vs the inference rank's pack) a row of
metric ``table3_cache_ms_per_pack`` (``..._standalone`` before the runtime's own pack was timed) whose
``ratio`` is cache / inference. The reproduce command is rebuilt from the file's ``meta.argv``,
prefixed with the environment setting its file name encodes (see ``ENV_FROM_NAME``). ``date`` and
``commit`` default to the commit that added the folder (``git log``) when it is tracked. The command,
GPU and run fields are stored once per result file, the measurements as arrays under ``columns``;
``--csv`` flattens them back into one row per measurement with every field.
"""
from __future__ import annotations

import argparse
import csv
import json
import re
import subprocess
import sys
from pathlib import Path

COLUMNS = ["metric", "method", "topology", "B", "L", "K", "P", "score_keys", "variant", "value_ms",
           "p90_ms", "steps", "late_packs", "ratio"]
FILE_FIELDS = ["run", "source", "gpu", "gpus", "env", "command"]
RUN_FIELDS = ["date", "commit", "title"]

# file-name patterns -> the environment setting the file was measured under (the gpu_all.sh stages
# name their files this way); anything else runs under the defaults of its commit
ENV_FROM_NAME = [
    (re.compile(r"glu_.*_(on|off)_\d"), lambda m: f"SPADE_FUSE_GLU={m.group(1)}"),
    (re.compile(r"attn_.*_(early|late)"), lambda m: f"SPADE_ATTN_RELEASE={m.group(1)}"),
    (re.compile(r"p2p_(\d+)"), lambda m: f"NCCL_MAX_P2P_NCHANNELS={m.group(1)}"),
    (re.compile(r"ab_\d+x\d+_([0-9.]+)$"), lambda m: f"SPADE_ATTN_PREFETCH={m.group(1)}"),
    (re.compile(r"^tpot_loop$"), lambda m: "SPADE_ATTN_INDEX_MODE=loop"),
    (re.compile(r"prefetch0$"), lambda m: "SPADE_GEMV_PREFETCH=0"),
    # gpu_all.sh pdl's AB_ENVS files carry the variable's name only: its default values then
    (re.compile(r"ab_(SPADE_[A-Z_]+)$"), lambda m: m.group(1) + "=" + AB_DEFAULTS.get(m.group(1), "?")),
]
AB_DEFAULTS = {"SPADE_ATTN_PROGRAMS_PER_SM": "3", "SPADE_GEMV_PREFETCH": "2", "SPADE_FUSE_SILU": "0"}

_KEYS = ("exact", "int8", "int4")


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _added(folder: Path) -> tuple[str, str]:
    out = _git("log", "--diff-filter=A", "--format=%ad %h", "--date=short", "--", str(folder))
    last = out.splitlines()[-1].split() if out else ["", ""]
    return last[0], last[1]


def _title(folder: Path) -> tuple[str, str]:
    """(title, date) from the README's first line, if any."""
    readme = folder / "README.md"
    if not readme.exists():
        return "", ""
    first = readme.read_text().splitlines()[0].lstrip("# ").strip()
    date = re.search(r"\d{4}-\d\d-\d\d", first)
    title = first.split("): ", 1)[1] if "): " in first else first
    return title.replace("`", ""), date.group(0) if date else ""


def _env(stem: str) -> str:
    for pat, make in ENV_FROM_NAME:
        m = pat.search(stem)
        if m:
            return make(m)
    return ""


def _command(meta: dict, env: str) -> str:
    argv = list(meta.get("argv") or [])
    if "--out" in argv:  # the output path is the machine's; keep the file's own name
        i = argv.index("--out")
        if i + 1 < len(argv):
            argv[i + 1] = Path(argv[i + 1]).name
    cmd = "python -m benchmarks.bench_tpot " + " ".join(argv)
    return f"{env} {cmd}" if env else cmd


def _parse_row(name: str) -> dict:
    """'asyncspade/local/P=4/int4/r=4' -> method, topology, P, keys, refresh / variant."""
    parts = name.split("/")
    out = {"method": parts[0], "topology": "", "P": "", "score_keys": "", "variant": []}
    for p in parts[1:]:
        if p in ("inline", "colocated", "local", "multiprocess"):
            out["topology"] = p
        elif p.startswith("P="):
            out["P"] = int(p[2:])
        elif p in _KEYS:
            out["score_keys"] = p
        else:
            out["variant"].append(p)
    if out["method"] == "asyncspade" and not out["score_keys"]:
        out["score_keys"] = "exact"
    if out["method"] in ("full", "optimal", "quest", "tova", "oracle"):
        out["topology"] = "inline"
    return out


def _fmt(x, nd=3):
    return None if x is None or x == "" else round(float(x), nd)


def rows_of(folder: Path, date: str = "", commit: str = "") -> list[dict]:
    title, rdate = _title(folder)
    gdate, gcommit = _added(folder)
    date = date or rdate or gdate
    commit = commit or gcommit
    run = re.match(r"(run\d+b?)", folder.name)
    run = run.group(1) if run else folder.name
    rows = []
    for f in sorted(folder.glob("*.json")):
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if not (isinstance(d, dict) and "configs" in d and "meta" in d):
            continue
        meta = d["meta"]
        env = _env(f.stem)
        base = {"run": run, "date": date, "commit": commit, "gpu": meta.get("gpu", ""),
                "gpus": meta.get("gpus_visible", ""), "env": env, "title": title,
                "command": _command(meta, env), "source": f"{folder.name}/{f.name}"}
        for c in d["configs"]:
            shape = {"B": c.get("batch", ""), "L": c.get("context", ""), "K": c.get("budget", "")}
            trows = c.get("rows") or {}
            for name, r in trows.items():
                if not isinstance(r, dict) or "tpot_ms" not in r:
                    continue
                p = _parse_row(name)
                variant = p["variant"]
                # optimal measured under the same variant (pdl=off, topk=radix, ...) when there is one
                opt = None
                for v in variant:
                    if v.startswith(("pdl=", "sov=")):
                        opt = trows.get(f"optimal/{v}")
                opt = opt or trows.get("optimal")
                ratio = r["tpot_ms"] / opt["tpot_ms"] if opt and opt.get("tpot_ms") else None
                rows.append({**base, **shape, "metric": "tpot_ms", "method": p["method"],
                             "topology": p["topology"], "P": p["P"], "score_keys": p["score_keys"],
                             "variant": ";".join(variant) or None, "value_ms": _fmt(r["tpot_ms"]),
                             "p90_ms": _fmt(r.get("p90_ms")), "steps": r.get("steps"),
                             "late_packs": r.get("late_packs"), "ratio": _fmt(ratio)})
            for key, ov in c.items():
                if not key.startswith("overlap") or not isinstance(ov, list):
                    continue
                variant = key.split("_", 1)[1] if "_" in key else ""
                for o in ov:
                    inf = o.get("inference_ms_per_pack")
                    for keys in _KEYS:
                        sfx = "" if keys == "exact" else "_" + keys
                        val = o.get("cache_ms_per_pack_runtime" + sfx)
                        metric = "table3_cache_ms_per_pack"
                        if val is None:  # before the runtime's own pack was timed: the standalone pack
                            val = o.get("cache_ms_per_pack" + sfx)
                            metric = "table3_cache_ms_per_pack_standalone"
                        if val is None or not inf:
                            continue
                        rows.append({**base, **shape, "metric": metric, "method": "asyncspade",
                                     "topology": "cache rank", "P": o.get("pack_layers", ""),
                                     "score_keys": keys, "variant": variant or None, "value_ms": _fmt(val),
                                     "p90_ms": None, "steps": None, "late_packs": None,
                                     "ratio": _fmt(val / inf)})
    return rows




def table_of(folders: list[Path], date: str = "", commit: str = "") -> dict:
    runs, files = {}, {}
    for folder in folders:
        for r in rows_of(folder, date, commit):
            runs.setdefault(r["run"], {k: r[k] for k in RUN_FIELDS})
            f = files.setdefault(r["source"], {**{k: r[k] for k in FILE_FIELDS}, "rows": []})
            f["rows"].append([r[c] if r[c] != "" else None for c in COLUMNS])
    return {"runs": runs, "files": list(files.values())}


def dump(table: dict) -> str:
    """JSON with one measurement per line (diffs and grep stay readable)."""
    head = {"about": "docs/perf.md; rows: scripts/perf_runs.py (--csv flattens them)",
            "columns": COLUMNS}
    out = ["{"]
    for k, v in head.items():
        out.append(f" {json.dumps(k)}: {json.dumps(v)},")
    out.append(' "runs": {')
    items = list(table["runs"].items())
    for i, (k, v) in enumerate(items):
        out.append(f"  {json.dumps(k)}: {json.dumps(v)}" + ("," if i < len(items) - 1 else ""))
    out.append(" },")
    out.append(' "files": [')
    for i, f in enumerate(table["files"]):
        meta = {k: f[k] for k in FILE_FIELDS}
        out.append("  " + json.dumps(meta)[:-1] + ', "rows": [')
        out.append(",\n".join("  " + json.dumps(r, separators=(",", ":")) for r in f["rows"]))
        out.append("  ]}" + ("," if i < len(table["files"]) - 1 else ""))
    out.append(" ]")
    out.append("}")
    return "\n".join(out) + "\n"


def flatten(table: dict) -> list[dict]:
    flat = []
    for f in table["files"]:
        run = table["runs"].get(f["run"], {})
        for r in f["rows"]:
            flat.append({**{k: run.get(k, "") for k in RUN_FIELDS}, **{k: f[k] for k in FILE_FIELDS},
                         **dict(zip(table["columns"], r))})
    return flat


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run folders (or, with --csv, the table)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--append", action="store_true",
                    help="merge into an existing --out (a result file already there is replaced)")
    ap.add_argument("--csv", action="store_true", help="print the table given as one flat CSV")
    ap.add_argument("--date", default="")
    ap.add_argument("--commit", default="")
    args = ap.parse_args(argv)
    if args.csv:
        table = json.loads(args.runs[0].read_text())
        flat = flatten(table)
        w = csv.DictWriter(sys.stdout, fieldnames=RUN_FIELDS + FILE_FIELDS + table["columns"],
                           lineterminator="\n")
        w.writeheader()
        w.writerows(flat)
        return 0
    table = table_of(args.runs, args.date, args.commit)
    if args.append and args.out and args.out.exists():
        old = json.loads(args.out.read_text())
        new_sources = {f["source"] for f in table["files"]}
        old["runs"].update(table["runs"])
        old["files"] = [f for f in old["files"] if f["source"] not in new_sources] + table["files"]
        table = old
    text = dump(table)
    if args.out:
        args.out.write_text(text)
        n = sum(len(f["rows"]) for f in table["files"])
        print(f"{n} rows, {len(table['files'])} files -> {args.out} ({len(text) // 1024} KiB)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

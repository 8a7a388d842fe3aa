"""``spade`` command line. Thin: every command calls the library.

    spade run --config configs/cpu_tiny.yaml [--set policy.budget=512] [--out result.json]
    spade validate --config X.yaml
    spade policies | transports | models
    spade bench {kernels,scoring,attention,decode,tpot,transports,serving,paged,prefill,serve} [benchmark args...]
    spade eval --config configs/eval_smollm2.yaml [--out DIR] [--only selection,perplexity]
    spade serve --config X.yaml [--host 127.0.0.1] [--port 8000]   (the OpenAI-compatible server)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _err(msg: str) -> None:
    print(f"spade: error: {msg}", file=sys.stderr)


def _console():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def _check_utf8(path) -> None:
    """A config file must be UTF-8 text: name the file and the first bad byte."""
    from spade.errors import ConfigError

    p = Path(path)
    try:
        data = p.read_bytes()
    except IsADirectoryError:
        raise ConfigError(f"--config {p}: is a directory; give a YAML file") from None
    except FileNotFoundError:
        return  # load_config says so
    except OSError as e:
        raise ConfigError(f"--config {p}: cannot read it: {e.strerror or e}") from None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(f"{p}: not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} (line {line}, "
                          f"column {col}); save the file as UTF-8") from None


def _load(args):
    from spade.config import load_config
    from spade.errors import ConfigError

    if args.config:
        _check_utf8(args.config)
    for item in args.set or []:
        try:
            item.encode("utf-8")
        except UnicodeEncodeError as e:  # argv bytes that were not UTF-8 arrive as lone surrogates
            ch = ord(item[e.start])
            what = f"byte 0x{ch - 0xDC00:02x}" if 0xDC80 <= ch <= 0xDCFF else f"a lone surrogate U+{ch:04X}"
            raise ConfigError(f"--set {item.split('=', 1)[0]}: the value is not UTF-8 text ({what} at character "
                              f"{e.start}); pass UTF-8 text") from None
    return load_config(args.config, overrides=args.set)


def _precheck(cfg) -> None:
    """What a run would trip on that the config schema cannot see: prompt text that is
    not valid Unicode, SPADE_KERNELS=triton without a GPU. Nothing is loaded."""
    import torch

    from spade.engine import check_kernels_env, check_prompt_text

    for i, p in enumerate(cfg.generation.prompts):
        check_prompt_text(p.text, f"generation.prompts[{i}].text")
    # the device as named (a GPU config validates on a laptop; run says if no GPU is there)
    name = cfg.model.device
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    check_kernels_env(torch.device(auto if name == "auto" else name))


def cmd_validate(args) -> int:
    from spade.config import summary

    cfg = _load(args)
    from spade.models.registry import resolve_source

    resolve_source(cfg.model.name)  # a known model name (nothing is loaded)
    _precheck(cfg)
    print(f"{args.config}: ok")
    print(summary(cfg))
    return 0


def cmd_run(args) -> int:
    from spade.static import run
    from spade.paths import check_output_file
    from spade.runtime.worker import maybe_serve

    maybe_serve()  # under torchrun, rank 1 becomes the cache rank here and exits

    cfg = _load(args)
    _precheck(cfg)
    out = check_output_file(args.out or "results/run.json", what="--out")  # before any work
    con = _console()
    con.print(f"[bold]spade run[/bold] {args.config or '(defaults)'}: model={cfg.model.name} "
              f"policy={cfg.policy.name} topology={cfg.runtime.topology} transport={cfg.runtime.transport.name}")
    n = len(cfg.generation.prompts)
    stream = cfg.generation.stream and n == 1 and not args.quiet

    def on_text(row: int, delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    try:
        with con.status("loading model and generating...", spinner="dots") if not stream else _Null():
            summary = run(cfg, on_text=on_text if stream else None, progress=lambda m: con.print(f"[dim]{m}[/dim]"))
    except BaseException as e:
        if stream:
            sys.stdout.write("\n")
        return _run_failed(e, out)
    if stream:
        sys.stdout.write("\n")
    elif not args.quiet:
        for i, r in enumerate(summary["results"]):
            print(f"--- [{i}] ---\n{r['text']}")
    _print_summary(summary)
    _write_json(out, summary)
    con.print(f"wrote {out}")
    return 0


def _write_json(out: Path, summary: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    tmp.write_text(json.dumps(summary, indent=2, default=str))
    tmp.replace(out)  # a reader never sees half a file


def _run_failed(e: BaseException, out: Path) -> int:
    """A run that failed after its output path was checked: write the partial JSON
    (tokens so far, the error, the events) and print one line."""
    from spade.errors import SpadeError

    if isinstance(e, SystemExit):
        raise e
    partial = getattr(e, "partial_summary", None)
    where = ""
    if partial is not None:
        try:
            _write_json(out, partial)
            n = partial.get("generated_tokens") or []
            where = f" (partial results, {n} token(s) per prompt so far: {out})" if n else f" (see {out})"
        except OSError as we:
            where = f" (could not write the partial results to {out}: {we.strerror or we})"
    if isinstance(e, KeyboardInterrupt):
        _err(f"interrupted{where}")
        return 130
    if _debug() and not isinstance(e, SpadeError):
        raise e
    msg = " ".join(str(e).split()) or "(no message)"
    if isinstance(e, ModuleNotFoundError) and e.name:
        _err(f"missing package '{e.name}': pip install {e.name}{where}")
    elif isinstance(e, SpadeError):
        _err(f"{msg}{where}")
    else:
        _err(f"the run failed: {type(e).__name__}: {msg}{where} (set SPADE_DEBUG=1 for the traceback)")
    return 2


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _print_summary(s: dict) -> None:
    def f(x, unit=""):
        return "n/a" if x is None else (f"{x:.2f}{unit}" if isinstance(x, float) else f"{x}{unit}")

    rows = [
        ("model", s["model"]),
        ("policy", f"{s['policy']}" + (f" (budget {s['budget']})" if s.get("budget") else "")),
        ("topology / transport", f"{s['topology']} / {s['transport']}"),
        ("batch", s["batch"]),
        ("prompt tokens", ", ".join(map(str, s["prompt_tokens"]))),
        ("generated tokens", ", ".join(map(str, s["generated_tokens"]))),
        ("TPOT median", f(s["tpot_median_ms"], " ms")),
        ("TPOT p90", f(s["tpot_p90_ms"], " ms")),
        ("tokens attended / step", f(s["tokens_attended_per_step"])),
        ("late packs", s.get("late_packs", 0)),
    ]
    w = max(len(k) for k, _ in rows)
    print("summary")
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")


def cmd_policies(args) -> int:
    from spade.policies import POLICIES

    for name in POLICIES.names():
        try:
            cls = POLICIES.get(name)
            doc = (cls.__doc__ or cls.__module__ and __import__(cls.__module__, fromlist=['x']).__doc__ or "")
            doc = doc.strip().splitlines()[0] if doc.strip() else ""
            ahead = "runs ahead (predicted query)" if not cls.needs_current_query else "needs the current query"
            print(f"{name:<11} {ahead:<30} {doc}")
        except Exception as e:  # pragma: no cover - shown, not hidden
            print(f"{name:<11} (cannot load: {type(e).__name__}: {e})")
    return 0


def cmd_transports(args) -> int:
    from spade.transports import availability

    for name, (ok, why) in availability().items():
        print(f"{name:<6} {'usable' if ok else 'unavailable':<12} {why}")
    return 0


def cmd_models(args) -> int:
    from spade.models.registry import OFFLINE

    for m in OFFLINE.values():
        print(f"{m.name:<20} {m.description}\n{'':<20} install: {m.install_hint()[:100]}{'...' if len(m.install_hint()) > 100 else ''}")
    try:
        from spade.models.presets import PRESETS

        print("shape presets (random weights): " + ", ".join(sorted(PRESETS)))
    except ImportError:
        pass
    return 0


BENCHES = {
    "kernels": ["benchmarks.kernels"],
    "scoring": ["benchmarks.bench_scoring"],
    "attention": ["benchmarks.bench_attention"],
    "decode": ["benchmarks.bench_decode"],
    "tpot": ["benchmarks.bench_tpot"],
    "transports": ["benchmarks.bench_transports"],
    "serving": ["benchmarks.bench_serving"],
    "paged": ["benchmarks.bench_paged"],
    "prefill": ["benchmarks.bench_prefill"],
    "serve": ["benchmarks.bench_serve"],
    "syncs": ["benchmarks.bench_syncs"],
    "guidellm": ["benchmarks.bench_guidellm"],
}
"""``spade bench KIND`` -> the ``main(argv)`` modules it runs, from ``benchmarks/`` of a
source checkout (the folder is not part of the installed package)."""

TAKES_CONFIG = {"tpot", "serve", "guidellm"}
"""Benchmarks whose ``main`` takes ``--config`` (``spade bench KIND --config X.yaml``)."""


def cmd_bench(args, rest: list[str]) -> int:
    import importlib
    import importlib.util

    root = Path(__file__).resolve().parent.parent
    if (root / "benchmarks").is_dir() and str(root) not in sys.path:
        sys.path.insert(0, str(root))  # a source checkout: benchmarks/ sits beside spade/
    if importlib.util.find_spec("benchmarks") is None:
        _err(f"'spade bench {args.kind}' runs the benchmarks/ folder of a source checkout, which an installed "
             "package does not include: run it from a clone of the spade repository")
        return 2
    if args.config and args.kind not in TAKES_CONFIG:
        _err(f"'spade bench {args.kind}' takes no --config (only: {', '.join(sorted(TAKES_CONFIG))})")
        return 2
    rc = 0
    for mod in BENCHES[args.kind]:
        m = importlib.import_module(mod)
        argv = ["--config", args.config, *rest] if args.config else list(rest)
        rc = rc or (m.main(argv) or 0)
    return rc


def cmd_eval(args) -> int:
    from spade.eval import run_eval

    cfg = _load(args)
    sections = [s.strip() for s in args.only.split(",")] if args.only else None
    run_eval(cfg, args.out, sections)
    return 0


def cmd_serve(args) -> int:
    from spade.errors import MissingDependencyError

    for pkg in ("fastapi", "uvicorn"):  # before the model loads
        try:
            __import__(pkg)
        except ImportError:
            raise MissingDependencyError(pkg, "spade serve", "pip install -e '.[serve]' (fastapi, uvicorn)") from None
    overrides = list(args.set or [])
    if args.host is not None:
        overrides.append(f"serve.host={args.host}")
    if args.port is not None:
        overrides.append(f"serve.port={args.port}")
    args.set = overrides
    cfg = _load(args)
    _precheck(cfg)
    from spade.serving.server import run_server

    return run_server(cfg)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spade", description="Asynchronous sparse decoding (AsyncSpade).")
    sub = p.add_subparsers(dest="cmd", required=True)

    def with_config(sp, required=True):
        sp.add_argument("--config", "-c", required=required, help="YAML config file")
        sp.add_argument("--set", "-s", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set policy.budget=512 (repeatable)")

    r = sub.add_parser("run", help="load the model and generate for the configured prompts")
    with_config(r, required=False)
    r.add_argument("--out", "-o", help="summary JSON path (default results/run.json)")
    r.add_argument("--quiet", "-q", action="store_true", help="do not print the generated text")
    r.set_defaults(fn=cmd_run)

    v = sub.add_parser("validate", help="check a config and print a one-screen summary")
    with_config(v)
    v.set_defaults(fn=cmd_validate)

    sub.add_parser("policies", help="list registered policies").set_defaults(fn=cmd_policies)
    sub.add_parser("transports", help="list transports and whether they are usable here").set_defaults(
        fn=cmd_transports)
    sub.add_parser("models", help="list offline models and shape presets").set_defaults(fn=cmd_models)

    b = sub.add_parser("bench", help="GPU benchmarks (extra arguments go to the benchmark)")
    b.add_argument("kind", choices=sorted(BENCHES))
    b.add_argument("--config", "-c", help="config for benchmarks that take one")
    b.set_defaults(fn=None)

    e = sub.add_parser("eval", help="fidelity measurements on real models")
    with_config(e)
    e.add_argument("--out", "-o", help="output folder (default: eval.out_dir)")
    e.add_argument("--only", help="comma-separated sections to run (selection,perplexity,gsm8k,niah)")
    e.set_defaults(fn=cmd_eval)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                      "/v1/models, /health, /metrics)")
    with_config(sv, required=False)
    sv.add_argument("--host", help="address to listen on (default: serve.host, 127.0.0.1)")
    sv.add_argument("--port", type=int, help="TCP port (default: serve.port, 8000; 0: any free port)")
    sv.set_defaults(fn=cmd_serve)
    return p



def _debug() -> bool:
    """``SPADE_DEBUG=1``: unexpected errors keep their traceback (a bad value counts as off)."""
    from spade.envs import env

    try:
        return env("SPADE_DEBUG") == "1"
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    from spade.errors import SpadeError

    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.cmd != "bench" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.cmd == "bench":
            return cmd_bench(args, rest)
        return args.fn(args)
    except SpadeError as e:
        _err(str(e))
        return 2
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except ModuleNotFoundError as e:
        if _debug():
            raise
        _err(f"missing package '{e.name}': pip install {e.name} (set SPADE_DEBUG=1 for the traceback)")
        return 2


if __name__ == "__main__":
    sys.exit(main())

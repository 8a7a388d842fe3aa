"""Helpers shared by the eval sections: models, texts, budgets, policy configs,
progress and result files."""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch


# --------------------------------------------------------------------------- models
_MODELS: dict[tuple[str, str], tuple[Any, Any]] = {}


def load_model(name: str, device: str = "cpu") -> tuple[Any, Any]:
    """(transformers model in eval mode, tokenizer) for a registered offline model
    or a local folder; cached per process so sections share one load."""
    from spade.engine import resolve_device
    from spade.models.hf import load_pretrained

    dev = str(resolve_device(device))
    key = (name, dev)
    if key not in _MODELS:
        t0 = time.time()
        say(f"loading {name} on {dev} ...")
        _MODELS[key] = load_pretrained(name, device=dev, dtype=torch.float32)
        say(f"loaded {name} in {time.time() - t0:.1f} s")
    return _MODELS[key]


def model_device(model) -> torch.device:
    return next(model.parameters()).device


# --------------------------------------------------------------------------- texts
def essay_token_segments(tokenizer, n_tokens: int, n_texts: int, *, offset_tokens: int = 0) -> list[torch.Tensor]:
    """``n_texts`` consecutive, non-overlapping segments of ``n_tokens`` essay tokens
    each ([n_tokens] int64), starting ``offset_tokens`` into the concatenated essays.

    A BOS token (when the tokenizer has one) starts each segment, so every
    segment is a fresh document for the model.
    """
    from spade.data import essays

    need = offset_tokens + n_tokens * n_texts
    text = essays()
    ids = tokenizer(text[: need * 8], add_special_tokens=False)["input_ids"]
    if len(ids) < need:
        raise ValueError(f"the essays hold only {len(ids)} tokens; asked for {need} "
                         f"({n_texts} text(s) of {n_tokens} tokens)")
    bos = tokenizer.bos_token_id
    out = []
    for i in range(n_texts):
        a = offset_tokens + i * n_tokens
        seg = ids[a:a + n_tokens]
        if bos is not None:
            seg = [bos] + seg[:-1]
        out.append(torch.tensor(seg, dtype=torch.long))
    return out


# --------------------------------------------------------------------------- budgets
def fraction_budget(context: int, fraction: int, floor: int) -> int:
    """K = context / fraction, rounded down to a multiple of 8, at least ``floor``."""
    return max(floor, (context // fraction) // 8 * 8)


def budget_label(budget: int | None = None, fraction: int | None = None) -> str:
    return f"K=ctx/{fraction}" if fraction is not None else f"K={budget}"


# --------------------------------------------------------------------------- policies
def policy_label(entry: dict[str, Any]) -> str:
    """A short readable name of a policy entry: ``asyncspade[assembled]``,
    ``asyncspade[ridge,rope]``, ``quest``, ``oracle[max_logits]``."""
    name = entry["name"]
    bits = []
    if name == "asyncspade":
        bits.append(entry.get("predictor", "assembled"))
        if entry.get("rope_aware"):
            bits.append("rope")
    for k, v in entry.items():
        if k in ("name", "predictor", "rope_aware"):
            continue
        short = {"sink_tokens": "sinks", "recent_tokens": "recent"}.get(k, k)  # set in the entry: shown
        bits.append(f"{v}" if k == "group_reduce" else f"{short}={v}")
    return f"{name}[{','.join(bits)}]" if bits else name


def policy_config(entry: dict[str, Any], budget: int, *, sink_tokens: int, recent_tokens: int,
                  page_size_cap: bool = True):
    """A validated ``spade.config`` policy section from an eval entry and a budget.

    Sinks and recent window come from the section unless the entry sets them;
    policies without them (quest, tova) ignore them. Quest's page size is capped
    at ``budget // 2`` so small budgets still hold two pages.
    """
    from spade import config
    from spade.policies import POLICIES

    d = dict(entry)
    fields = POLICIES.config(d["name"]).model_fields  # what this policy's section has
    if "sink_tokens" in fields:
        d.setdefault("sink_tokens", sink_tokens)
    if "recent_tokens" in fields:
        d.setdefault("recent_tokens", recent_tokens)
    if "page_size" in fields and page_size_cap:
        d["page_size"] = min(d.get("page_size", fields["page_size"].default), max(1, budget // 2))
    if "budget" in fields:
        d["budget"] = budget
    return config.policy_config(d)


def check_policy_entries(entries: list[dict[str, Any]], section: str, *, sink_tokens: int, recent_tokens: int,
                         budgets: list[int]) -> None:
    """Fail before any long work when an entry is not a valid policy section."""
    from spade.errors import ConfigError

    for i, e in enumerate(entries):
        for b in budgets:
            try:
                policy_config(e, b, sink_tokens=sink_tokens, recent_tokens=recent_tokens)
            except Exception as err:  # pydantic ValidationError: say which entry
                raise ConfigError(f"eval.{section}.policies[{i}] = {e} with budget {b}: {err}") from None


# --------------------------------------------------------------------------- progress and output
def say(msg: str) -> None:
    print(f"[spade eval] {msg}", file=sys.stderr, flush=True)


@contextmanager
def progress(description: str, total: int) -> Iterator[Any]:
    """A rich progress bar on stderr; yields ``advance(n=1)``."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    console = Console(stderr=True)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False) as prog:
        task = prog.add_task(description, total=total)

        def advance(n: int = 1, description: str | None = None) -> None:
            if description is not None:
                prog.update(task, description=description)
            prog.advance(task, n)

        yield advance


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return _jsonable(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(data), indent=1))
    return path


def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    """A rich table on stdout (the summary the CLI shows)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=escape(title), title_justify="left")
    for c in columns:
        first = c == columns[0]
        t.add_column(escape(c), justify="left" if first else "right", no_wrap=first)
    for r in rows:  # labels such as "asyncspade[last]" are not rich markup
        t.add_row(*[escape(f"{v:.4f}" if isinstance(v, float) else str(v)) for v in r])
    width = max(len(str(r[0])) for r in rows) + sum(max(len(c), 8) + 3 for c in columns[1:]) + 8 if rows else 100
    Console(width=max(100, width)).print(t)

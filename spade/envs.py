"""Every ``SPADE_*`` environment variable spade reads, in one table (``VARS``).

Each entry names the variable, its choices (or kind of value), its default, whether
CUDA graphs record it (a graph captured under one value keeps it: graph caches key on
``capture_key()``), and one line of meaning. Every read in ``spade/`` goes through
``env(name)``, which parses the value the same way for every variable: stripped,
lower-cased for choices, aliases mapped; a value outside the choices is an error
naming the variable, the value and the choices.

>>> import os; os.environ["SPADE_PDL"] = "OFF"
>>> env("SPADE_PDL")
'off'
>>> os.environ["SPADE_PDL"] = "sometimes"; env("SPADE_PDL")
Traceback (most recent call last):
...
ValueError: SPADE_PDL must be one of auto, all, decode, off, got 'sometimes'
>>> del os.environ["SPADE_PDL"]

Not in the table: the config overrides ``SPADE_<SECTION>__<FIELD>`` (e.g.
``SPADE_POLICY__BUDGET=512``), which pydantic-settings reads for ``spade.config``
(prefix ``SPADE_``, ``__`` between levels; see that module).

``python -m spade.envs --markdown`` prints the table for the docs (docs/runtime.md).

Imports nothing heavy (no torch, triton, pydantic or other spade module): kernels and
the model module read settings through it without importing each other.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Mapping

__all__ = ["EnvVar", "VARS", "env", "env_choice", "capture_key", "triton_interpret", "markdown"]


@dataclass(frozen=True)
class EnvVar:
    name: str
    choices: tuple[str, ...] | None
    """Allowed values (lower case), or None for a free value (``kind``)."""
    default: str | None
    """The value when unset or empty (None: unset means "not given")."""
    capture: bool
    """CUDA graphs record it: a captured graph keeps the value it was captured with."""
    meaning: str
    kind: str = "choice"
    """``choice``, ``int`` (an integer >= 1) or ``text`` (a path, kept as given)."""
    aliases: Mapping[str, str] = field(default_factory=dict)


_ON_OFF = {"1": "on", "0": "off", "true": "on", "false": "off", "yes": "on", "no": "off"}
_BOOL01 = {"on": "1", "off": "0", "true": "1", "false": "0", "yes": "1", "no": "0"}

VARS: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("SPADE_KERNELS", ("auto", "triton", "torch"), "auto", False,
           "Kernel dispatch: Triton on CUDA tensors and the torch references elsewhere (auto), Triton "
           "everywhere (triton; on CPU with TRITON_INTERPRET=1), or the torch references everywhere."),
    EnvVar("SPADE_PDL", ("auto", "all", "decode", "off"), "auto", True,
           "Programmatic dependent launch on sm_90+: every kernel (all), the decode step's kernels only "
           "(decode), or none (off); auto: all, but decode for a cache rank on the inference rank's GPU "
           "(colocated); spade.kernels.pdl."),
    EnvVar("SPADE_SELECT_OVERLAP", ("auto", "on", "off"), "auto", True,
           "A cache rank's threshold-carry top-K select on a side stream beside the next layer's "
           "scoring (kernels.select_overlap; auto: on for CUDA)."),
    EnvVar("SPADE_FUSE_GLU", ("on", "off"), "on", False,
           "FastModel.fuse_glu's default: the gate/up GEMV forms silu(gate) * up in its epilogue "
           "(one launch per layer fewer).", aliases=_ON_OFF),
    EnvVar("SPADE_ATTN_PROGRAMS_PER_SM", None, None, False,
           "Decode attention programs per SM when it picks its number of splits (default 3 dense, "
           "2 indexed); an A/B knob read at launch.", kind="int"),
    EnvVar("SPADE_CACHE_GRAPHS", ("1", "0"), "1", False,
           "A CUDA cache rank replays each pack's selection work as a CUDA graph (0: eagerly).",
           aliases=_BOOL01),
    EnvVar("SPADE_NIXL_PROGRESS_THREAD", ("0", "1"), "0", False,
           "The nixl transport uses NIXL's own progress thread (as transport.progress_thread: true) "
           "instead of spade's asyncio poller.", aliases=_BOOL01),
    EnvVar("SPADE_HOST_PROFILE", None, None, False,
           "A file: the multiprocess cache rank cProfiles its host side for its whole life and "
           "writes the table there on exit.", kind="text"),
    EnvVar("SPADE_CACHE", None, "~/.cache/spade", False,
           "Folder of downloaded and converted model files.", kind="text"),
    EnvVar("SPADE_DEBUG", ("0", "1"), "0", False,
           "spade's CLI shows the traceback of a missing package instead of one line.", aliases=_BOOL01),
)}


def env(name: str) -> str | int | None:
    """The value of table variable ``name`` from the environment (its default when unset
    or empty); a choice is lower-cased with its aliases applied, an ``int`` parsed.
    A value outside the choices raises ``ValueError`` naming the variable, the value
    and the choices; a name outside the table raises ``KeyError``."""
    var = VARS.get(name)
    if var is None:
        raise KeyError(f"{name} is not in spade.envs.VARS; add it to the table")
    raw = os.environ.get(name, "")
    val = raw.strip()
    if not val:
        return var.default
    if var.kind == "text":
        return val
    if var.kind == "int":
        try:
            n = int(val)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {raw!r}")
        return n
    val = val.lower()
    val = var.aliases.get(val, val)
    if val not in var.choices:
        c = var.choices
        allowed = f"{c[0]} or {c[1]}" if len(c) == 2 else "one of " + ", ".join(c)
        raise ValueError(f"{name} must be {allowed}, got {raw!r}")
    return val


def env_choice(name: str, *, error: type[Exception] = ValueError) -> str:
    """``env(name)`` of a choice variable, raising ``error`` (e.g. ``ConfigError``) on a
    bad value."""
    try:
        return env(name)
    except ValueError as e:
        raise error(str(e)) from None


def capture_key() -> tuple:
    """The values of the variables CUDA graphs record (graph caches key on it)."""
    return tuple(env(v.name) for v in VARS.values() if v.capture)


def triton_interpret() -> bool:
    """True when Triton runs under its CPU interpreter (``TRITON_INTERPRET=1``, read at
    call time: a test harness sets it before the first kernel import)."""
    return os.environ.get("TRITON_INTERPRET", "").strip() == "1"


def markdown() -> str:
    """The table as a markdown list (docs/runtime.md holds this text)."""
    lines = []
    for v in VARS.values():
        if v.choices is not None:
            values = " \\| ".join(f"`{c}`" for c in v.choices)
        else:
            values = {"int": "integer >= 1", "text": "a path"}[v.kind]
        default = "unset" if v.default is None else f"`{v.default}`"
        graph = "; CUDA graphs record it" if v.capture else ""
        lines.append(f"- `{v.name}` ({values}; default {default}{graph}): {v.meaning}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        print("usage: python -m spade.envs --markdown", file=sys.stderr)
        sys.exit(2)
    sys.stdout.write(markdown())

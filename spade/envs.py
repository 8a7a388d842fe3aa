"""Launch and speed settings read from the environment (``SPADE_PDL``, ``SPADE_SELECT_OVERLAP``,
``SPADE_ATTN_RELEASE``, ``SPADE_FUSE_GLU``, ...): one parser, so every setting takes its
value the same way and a bad value names the variable and its choices. Imports nothing
heavy (the model module reads settings without importing triton)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence


def env_choice(name: str, choices: Sequence[str], default: str, *, aliases: Mapping[str, str] | None = None,
               error: type[Exception] = ValueError) -> str:
    """The value of environment variable ``name``: stripped and lower-cased, ``default`` when
    unset or empty, ``aliases`` mapped onto ``choices``; anything else raises ``error``
    naming the variable, its choices and the value given."""
    raw = os.environ.get(name, "")
    val = raw.strip().lower() or default
    val = (aliases or {}).get(val, val)
    if val not in choices:
        allowed = f"{choices[0]} or {choices[1]}" if len(choices) == 2 else "one of " + ", ".join(choices)
        raise error(f"{name} must be {allowed}, got {raw!r}")
    return val

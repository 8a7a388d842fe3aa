"""Command-line value parsers the benchmarks share."""

from __future__ import annotations

import argparse
from typing import Callable


def int_list(minimum: int | None = None) -> Callable[[str], list[int]]:
    """An argparse ``type``: comma-separated integers, at least one, each ``>= minimum``
    when given; a bad value is refused naming it."""

    def parse(text: str) -> list[int]:
        try:
            vals = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        if not vals:
            raise argparse.ArgumentTypeError("expected at least one value")
        if minimum is not None and min(vals) < minimum:
            raise argparse.ArgumentTypeError(f"expected integers >= {minimum}, got {text!r}")
        return vals

    return parse

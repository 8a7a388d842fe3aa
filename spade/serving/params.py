"""What a request asks for (``SamplingParams``) and what it gets back (``RequestOutput``).

The names and meanings follow vLLM's, so that a serving team recognises them:

>>> from spade.serving import SamplingParams
>>> SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, seed=1, stop=["\\n\\n"]).greedy
False
>>> SamplingParams().greedy
True
"""

from __future__ import annotations

import enum
import math
import operator
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from spade.errors import ArgumentError, ArgumentTypeError


def _int(name: str, v, lo: int | None = None, hint: str = "") -> int:
    if isinstance(v, bool) or not hasattr(v, "__index__"):
        raise ArgumentTypeError(f"SamplingParams.{name}: expected an int, got {type(v).__name__} {v!r}{hint}")
    v = operator.index(v)
    if lo is not None and v < lo:
        raise ArgumentError(f"SamplingParams.{name}: must be >= {lo}, got {v}{hint}")
    return v


def _float(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ArgumentTypeError(f"SamplingParams.{name}: expected a number, got {type(v).__name__} {v!r}")
    v = float(v)
    if not math.isfinite(v):
        raise ArgumentError(f"SamplingParams.{name}: must be finite, got {v}")
    return v


class RequestOutputKind(enum.StrEnum):
    """What each ``RequestOutput`` of a request holds (``SamplingParams.output_kind``;
    vLLM's ``RequestOutputKind``). A member equals its value: ``RequestOutputKind.DELTA
    == "delta"``.

    ``CUMULATIVE``: one output per token, its ``token_ids`` / ``text`` everything so far
    (a fresh list each time). ``DELTA``: one output per token, its ``token_ids`` / ``text``
    only what is new since the request's previous output (they concatenate to the
    cumulative ones). ``FINAL_ONLY``: one output, the last, with the cumulative
    ``token_ids`` / ``text``."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


_KINDS = ", ".join(repr(k.value) for k in RequestOutputKind)


def _output_kind(v) -> RequestOutputKind:
    """``v`` (a ``RequestOutputKind`` or its value) as a ``RequestOutputKind``."""
    if isinstance(v, RequestOutputKind):
        return v
    if not isinstance(v, str):
        raise ArgumentTypeError(f"SamplingParams.output_kind: expected one of {_KINDS} (or a "
                                f"spade.RequestOutputKind), got {type(v).__name__} {v!r}")
    try:
        return RequestOutputKind(v)
    except ValueError:
        raise ArgumentError(f"SamplingParams.output_kind: {v!r} is not an output kind; use one of {_KINDS} "
                            "(cumulative: every output holds everything so far; delta: only what is new; "
                            "final_only: just the last output)") from None


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    ``max_tokens``: tokens to generate at most (>= 1). ``temperature``: 0 is greedy.
    ``top_p`` in (0, 1]; ``top_k``: -1 (or 0) keeps every token. ``seed``: a per-request
    generator (None: the engine's). ``stop``: strings that end the request (not
    included in the text); ``stop_token_ids``: token ids that end it (the model's EOS
    ends it too unless ``ignore_eos``). ``output_kind``: what each ``RequestOutput`` holds,
    a ``RequestOutputKind`` or its value: ``"cumulative"`` (everything so far),
    ``"delta"`` (only what is new since the previous output: no O(n) copy per token),
    ``"final_only"`` (one output, the last)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: Optional[int] = None
    stop: Sequence[str] = field(default_factory=list)
    stop_token_ids: Sequence[int] = field(default_factory=list)
    ignore_eos: bool = False
    output_kind: Union[RequestOutputKind, str] = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self.max_tokens = _int("max_tokens", self.max_tokens, 1, " (the number of tokens to generate, e.g. 64)")
        self.temperature = _float("temperature", self.temperature)
        if self.temperature < 0:
            raise ArgumentError(f"SamplingParams.temperature: must be >= 0 (0 is greedy), got {self.temperature}")
        self.top_p = _float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ArgumentError(f"SamplingParams.top_p: must be in (0, 1] (1 keeps every token), got {self.top_p}")
        self.top_k = _int("top_k", self.top_k, -1, " (-1 or 0 keeps every token)")
        if self.seed is not None:
            self.seed = _int("seed", self.seed)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise ArgumentTypeError(f"SamplingParams.stop: expected a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ArgumentError("SamplingParams.stop: an empty stop string would stop at once; remove it")
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ArgumentTypeError(f"SamplingParams.stop_token_ids: expected a list of ints, got "
                                    f"{self.stop_token_ids!r}")
        self.stop_token_ids = [_int(f"stop_token_ids[{i}]", t, 0) for i, t in enumerate(self.stop_token_ids)]
        if not isinstance(self.ignore_eos, bool):
            raise ArgumentTypeError(f"SamplingParams.ignore_eos: expected a bool, got {self.ignore_eos!r}")
        self.output_kind = _output_kind(self.output_kind)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RequestOutput:
    """One update of a request's generation (``AsyncEngine.generate`` yields one per
    step the request takes part in, and a last one with ``finish_reason`` set).

    ``token_ids`` / ``text``: everything generated so far (cumulative; a stop string
    and what follows it are cut from ``text``); ``delta_text``: the text this update
    added. With ``SamplingParams.output_kind`` ``"delta"``, ``token_ids`` / ``text`` hold
    only what this update added (``text`` equals ``delta_text``; ``num_output_tokens``
    counts this update's tokens); with ``"final_only"`` the request yields only its last
    output, cumulative, whose ``delta_text`` is the whole text. ``finish_reason``: None
    while running, then ``"stop"`` (EOS, a stop token or a stop string), ``"length"``
    (``max_tokens`` or the context), ``"abort"``.
    ``prompt_token_ids``: the prompt's ids, one list shared by every update of the
    request (read it, do not change it). Timing: ``ttft_s`` (arrival to first token), ``tpot_s`` (mean seconds per output
    token after the first), ``queue_s`` (arrival to admission)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_text: str
    finish_reason: Optional[str] = None
    stop_reason: Optional[str | int] = None  # the stop string or token id that ended it
    ttft_s: Optional[float] = None
    tpot_s: Optional[float] = None
    queue_s: Optional[float] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

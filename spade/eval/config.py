"""Settings of ``spade eval``: one sub-model per measurement.

This module imports only pydantic (``spade.config`` imports it to type
``SpadeConfig.eval``). Policy entries (``policies``) are plain mappings in the
shape of ``spade.config``'s policy sections without ``budget`` (the sweep sets
it); they are validated against those sections before any long work starts.

The defaults are sized for a 2-core CPU: each section finishes in a few
minutes with the registered offline models (``docs/fidelity.md`` lists the
timings). Raise the sample counts in a YAML file for tighter numbers.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from spade.policies import POLICIES  # light: the registry, no policy module

GroupReduce = Literal["sum_logits", "max_logits", "sum_softmax"]
Predictor = Literal["last", "ridge", "softmax_ridge", "assembled"]
PosInt = Annotated[int, Field(gt=0)]

NOT_BASELINES = ("full", "asyncspade")
"""Registered policies the selection measurement does not compare as baselines:
``full`` attends everything, ``asyncspade`` is the measured policy (per predictor)."""


def baseline_names() -> list[str]:
    """Every registered policy the selection measurement can compare against."""
    return [n for n in POLICIES.names() if n not in NOT_BASELINES]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class _Budgets(_Section):
    budgets: list[PosInt] = Field(default_factory=lambda: [64, 128, 256])
    """Fixed budgets K (tokens attended per step and KV head, sinks and recent included)."""
    context_fractions: list[PosInt] = Field(default_factory=lambda: [16])
    """Budgets relative to the context: ``n`` means K = context / n (rounded down to
    a multiple of 8)."""
    sink_tokens: int = Field(4, ge=0)
    recent_tokens: int = Field(16, ge=1)


class SelectionEvalConfig(_Budgets):
    """Overlap and attention recall of each selection, on captured queries/keys.

    Defaults (one 2048-token text, 48 positions, every predictor x RoPE x GQA
    reduction, 3 fixed budgets + K = t/16) take about 1 minute for SmolLM2
    on 2 CPU cores.

    One dense teacher-forced pass per text captures every layer's post-RoPE
    queries and keys; every decode position ``t`` in the sample is then replayed
    through the policies' own ``prefill``/``select`` (or ``observe`` step by step
    for TOVA's eviction) with the prefix ``[0, t)`` as the prompt.
    """

    enabled: bool = True
    models: list[str] = Field(default_factory=lambda: ["smollm2-135m"], min_length=1)
    context_tokens: int = Field(2048, gt=16)
    """Tokens of essay text per sample (the last decode position is context - 1)."""
    n_texts: int = Field(1, gt=0)
    """Independent essay segments (consecutive, non-overlapping)."""
    start: int = Field(512, ge=1)
    """First evaluated decode position (the warm-up prefix is dense)."""
    positions: int = Field(48, gt=0)
    """Decode positions evaluated per text, evenly spaced in [start, context)."""
    predictors: list[Predictor] = Field(default_factory=lambda: ["last", "ridge", "softmax_ridge", "assembled"])
    rope_aware: list[bool] = Field(default_factory=lambda: [False, True])
    group_reduces: list[GroupReduce] = Field(default_factory=lambda: ["sum_logits", "max_logits", "sum_softmax"])
    baselines: list[str] = Field(default_factory=baseline_names)
    """Registered policies replayed beside asyncspade (default: all of them but full):
    ``oracle`` is the exact top-K every overlap is measured against; a policy that
    evicts (tova) is replayed along the sequence, the others at each position."""
    reranks: list[Annotated[int, Field(ge=1, le=16)]] = Field(default_factory=lambda: [1])
    """``policy.rerank`` values m replayed for each predictor: with m > 1 the predicted
    query's top ``m * K_mid`` middle tokens are the candidates and the true query keeps
    the best ``K_mid`` of them (group reduction over the candidates), rows
    ``asyncspade[<predictor>,...,rerank=m]``."""
    rerank_keys: list[Literal["exact", "int8", "int4"]] = Field(default_factory=lambda: ["exact"])
    """The keys the re-rank (``reranks`` m > 1) scores its candidates on: ``exact`` (the
    cache, what ``policy.rerank`` does), or the int8 / int4 copy the cache rank scores on
    (``policy.score_keys``: per-token scales, int4 with the prompt-fitted per-channel
    smoothing), as a candidate scan reading a quarter / half of the exact key bytes would;
    rows ``...,rerank=m,keys=int4]`` beside the exact ones."""
    score_channels: list[PosInt] = Field(default_factory=lambda: [1])
    """asyncspade's ``score_channels`` as divisors of the head dim: ``n`` scores r = d/n
    channels per KV head (1: all of them), chosen as the policy chooses them (the window's
    queries and the prefix's keys, rotary pairs kept), for every predictor and RoPE
    setting. With more than one value the summary recommends an r per model and budget
    (``recommend_channels``: the smallest whose recall is within
    ``channels_tolerance`` of r = d)."""
    channels_tolerance: float = Field(0.01, ge=0)
    window: int = Field(16, ge=1, le=64)
    ridge_eps: float = Field(1e-2, gt=0)
    page_size: int = Field(16, gt=0)
    """Quest page size."""
    distances: list[PosInt] = Field(default_factory=lambda: [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64])
    """Fig. 4: overlap of the top-K of q_{t-d} with the top-K of q_t, for these d."""
    shift_ablation: bool = True
    """Fig. 5: ridge weights applied with vs without the one-step shift."""
    batch_positions: int = Field(64, gt=0)
    """Decode positions replayed together as batch rows (memory vs speed)."""

    @field_validator("baselines")
    @classmethod
    def _registered(cls, v: list[str]) -> list[str]:
        for name in v:
            if name not in baseline_names():
                raise ValueError(f"{name!r} is not a baseline; choose from: {', '.join(baseline_names())} "
                                 f"(registered policies but {' and '.join(NOT_BASELINES)})")
        return v

    @field_validator("score_channels")
    @classmethod
    def _divisors(cls, v: list[int]) -> list[int]:
        bad = [n for n in v if n > 1 and n % 2]
        if bad:
            raise ValueError(f"score_channels {bad}: use 1 or even divisors of the head dim (r = d/n must be "
                             "whole rotary pairs), e.g. [1, 2, 4]")
        return v

    @model_validator(mode="after")
    def _start_inside(self):
        if self.start >= self.context_tokens:
            raise ValueError(f"start ({self.start}) must be below context_tokens ({self.context_tokens})")
        return self


class PerplexityEvalConfig(_Budgets):
    """Teacher-forced perplexity under each policy vs full attention.

    Defaults (one 512-token text, 384 scored tokens, K = 64) take about 40
    seconds for SmolLM2 on 2 CPU cores; longer texts cost more than linearly:
    every scored position runs the policy once per layer, and the CPU
    references of the predictors and Quest cost milliseconds per call.
    """

    enabled: bool = True
    models: list[str] = Field(default_factory=lambda: ["smollm2-135m"], min_length=1)
    context_tokens: int = Field(512, gt=16)
    n_texts: int = Field(1, gt=0)
    first_text: int = Field(0, ge=0)
    """Index of the first essay segment (segments of ``context_tokens`` each, in
    order): a later run can measure other texts without repeating these."""
    prefill_tokens: int = Field(128, ge=1)
    """Dense prompt; the perplexity is measured on the tokens after it."""
    budgets: list[PosInt] = Field(default_factory=list)
    context_fractions: list[PosInt] = Field(default_factory=lambda: [8])
    """K = context_tokens / n (the whole text's length: one budget per run)."""
    policies: list[dict[str, Any]] = Field(default_factory=lambda: [
        {"name": "oracle"},
        {"name": "asyncspade", "predictor": "assembled"},
        {"name": "asyncspade", "predictor": "last"},
        {"name": "quest"},
        {"name": "streaming"},
        {"name": "tova"},
    ])
    """Policy sections without ``budget`` (sinks/recent default to this section's)."""


class Gsm8kEvalConfig(_Section):
    """Greedy GSM8K answers under each policy vs full attention.

    The default (Qwen2.5-Coder-0.5B, 8 problems, 256 new tokens, full + 2
    policies) takes about 5.5 minutes on 2 CPU cores; ``configs/eval_qwen15b_gsm8k.yaml``
    is the 1.5B run.
    """

    enabled: bool = True
    model: str = "qwen2.5-coder-0.5b"
    n_problems: int = Field(8, gt=0)
    first_problem: int = Field(0, ge=0)
    """Index of the first test problem (problems are taken in file order)."""
    batch_size: int = Field(8, gt=0)
    max_new_tokens: int = Field(256, gt=0)
    budgets: list[PosInt] = Field(default_factory=lambda: [64])
    sink_tokens: int = Field(4, ge=0)
    recent_tokens: int = Field(16, ge=1)
    policies: list[dict[str, Any]] = Field(default_factory=lambda: [
        {"name": "asyncspade", "predictor": "assembled"},
        {"name": "oracle"},
    ])
    instruction: str = ("Solve the problem step by step, briefly. End with the final answer as a number "
                        "on its own line in the form '#### <number>'.")


class NiahEvalConfig(_Section):
    """Needle in a haystack: exact retrieval of a passphrase hidden in essays."""

    enabled: bool = True
    model: str = "qwen2.5-coder-0.5b"
    context_lengths: list[PosInt] = Field(default_factory=lambda: [1024, 2048])
    """Tokens of essays around the needle (the prompt adds the question and template)."""
    depths: list[Annotated[float, Field(ge=0, le=1)]] = Field(default_factory=lambda: [0.1, 0.5, 0.9])
    budgets: list[PosInt] = Field(default_factory=lambda: [64])
    sink_tokens: int = Field(4, ge=0)
    recent_tokens: int = Field(16, ge=1)
    max_new_tokens: int = Field(32, gt=0)
    """Room for a preamble ("The secret passphrase is ...") before the passphrase."""
    batch_size: int = Field(3, gt=0)
    policies: list[dict[str, Any]] = Field(default_factory=lambda: [
        {"name": "asyncspade", "predictor": "assembled"},
        {"name": "asyncspade", "predictor": "last"},
        {"name": "oracle"},
        {"name": "quest"},
        {"name": "streaming"},
        {"name": "tova"},
    ])
    seed: int = 0
    """Seed of the passphrases (one per (length, depth) cell)."""


class EvalConfig(_Section):
    """``spade eval``: does predicted-query selection keep the model's answers?"""

    out_dir: str = "results/eval"
    device: str = "cpu"
    """Where the models run (``cpu``, ``cuda``, ``auto``)."""
    selection: SelectionEvalConfig = Field(default_factory=SelectionEvalConfig)
    perplexity: PerplexityEvalConfig = Field(default_factory=PerplexityEvalConfig)
    gsm8k: Gsm8kEvalConfig = Field(default_factory=Gsm8kEvalConfig)
    niah: NiahEvalConfig = Field(default_factory=NiahEvalConfig)

    @model_validator(mode="after")
    def _policy_entries(self):
        for sec in ("perplexity", "gsm8k", "niah"):
            for i, p in enumerate(getattr(self, sec).policies):
                if not isinstance(p.get("name"), str):
                    raise ValueError(f"eval.{sec}.policies[{i}] needs a 'name' (e.g. asyncspade, quest)")
                if p["name"] not in POLICIES:
                    raise ValueError(f"eval.{sec}.policies[{i}].name: unknown policy {p['name']!r}; "
                                     f"choose one of: {', '.join(POLICIES.names())}")
                if "budget" in p:
                    raise ValueError(f"eval.{sec}.policies[{i}]: leave out 'budget' (eval.{sec}.budgets sets it)")
        return self


SECTIONS = ("selection", "perplexity", "gsm8k", "niah")

"""The engine serving teams embed: config in, generations and measurements out.

>>> import spade                                             # doctest: +SKIP
>>> cfg = spade.load_config("configs/cpu_tiny.yaml", overrides=["generation.max_new_tokens=16"])
>>> engine = spade.Engine(cfg)
>>> [r.text for r in engine.generate(["What is a sink token?"])]

``Engine`` is the synchronous front of ``spade.AsyncEngine``: ``generate(prompts)``
submits every prompt as a request of the one serving core (continuous batching over
row slots, ``serving.max_batch`` at once) and returns when all have finished. Also
here: what the engines share (device and dtype, prompt checks and encoding, model
loading). ``spade.static`` holds the static batch engine that ``spade run`` measures.
"""

from __future__ import annotations

import asyncio
import itertools
import operator
import queue
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence, Union

import torch

from spade.config import PromptConfig, SpadeConfig
from spade.errors import (ArgumentError, ArgumentTypeError, ConfigError, EngineClosedError, ModelError,
                          SpadeError)
from spade.streams import indexed_device

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"model.device: {name!r} requested but no CUDA GPU is visible; use 'cpu' or 'auto'")
    return indexed_device(dev)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def check_kernels_env(device: torch.device) -> None:
    """``SPADE_KERNELS=triton`` needs a GPU (or Triton's CPU interpreter): say so before
    the model loads, not as "0 active drivers" from the cache rank mid-generation."""
    from spade.envs import env_choice, triton_interpret

    if env_choice("SPADE_KERNELS", error=ConfigError) != "triton" or triton_interpret():
        return
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ConfigError(
            f"SPADE_KERNELS=triton: Triton kernels need a CUDA GPU and the model runs on {device} "
            f"({'no GPU is visible' if not torch.cuda.is_available() else 'not on a GPU'}); unset SPADE_KERNELS "
            "(or set it to torch) on CPU, or set TRITON_INTERPRET=1 to run Triton's interpreter (slow)"
        )


def check_prompt_text(text: str, name: str) -> None:
    """Prompt text must be encodable Unicode: a lone surrogate (from bytes decoded with
    ``surrogateescape``, or a ``\\ud800`` escape) breaks the tokenizer and the JSON."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ArgumentError(
            f"{name}: the text has a lone surrogate {text[e.start]!r} (U+{ord(text[e.start]):04X}) at character "
            f"{e.start}, which is not valid Unicode; remove it, or decode the source bytes with errors='replace'"
        ) from None


def check_prompts(prompts, where: str, vocab: int, model_name: str) -> list:
    """``prompts`` as a list of str / PromptConfig / list[int] (token ids), checked against
    a vocabulary of ``vocab`` ids (``where`` names the argument in errors).

    A bare string (or one ``PromptConfig``) is one prompt, never one per character."""
    if isinstance(prompts, (str, PromptConfig)):
        prompts = [prompts]
    elif isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)):
        raise ArgumentTypeError(
            f"{where}: expected a prompt (str) or a list of prompts, got {type(prompts).__name__}; "
            "e.g. generate(['Hello']) or generate([[1, 2, 3]]) for token ids")
    if not prompts:
        raise ArgumentError(f"{where}: got an empty list; pass at least one prompt, e.g. generate(['Hello'])")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        raise ArgumentTypeError(
            f"{where}: got a flat list of ints ({list(prompts)[:4]}...); a token-id prompt goes inside the "
            f"list: generate([{list(prompts)[:3]}]) (one prompt) or generate(['text', ...])")
    out: list = []
    for i, p in enumerate(prompts):
        name = f"{where}[{i}]"
        if isinstance(p, (str, PromptConfig)):
            check_prompt_text(p if isinstance(p, str) else p.text, name)
            if isinstance(p, str) and not p.strip():
                raise ArgumentError(f"{name}: the prompt is empty; give it some text")
            out.append(p)
            continue
        if isinstance(p, torch.Tensor):
            if p.dim() != 1 or p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool:
                raise ArgumentTypeError(f"{name}: a tensor prompt must be 1-D integer token ids, got "
                                        f"{tuple(p.shape)} {p.dtype}")
            p = p.tolist()
        if isinstance(p, (list, tuple)):
            if not p:
                raise ArgumentError(f"{name}: the token-id list is empty; give at least one token id")
            ids = []
            for j, t in enumerate(p):
                if isinstance(t, bool) or not hasattr(t, "__index__"):
                    raise ArgumentTypeError(f"{name}[{j}]: token ids are ints, got {type(t).__name__} {t!r}")
                t = operator.index(t)
                if not 0 <= t < vocab:
                    raise ArgumentError(f"{name}[{j}]: token id {t} is outside the vocabulary [0, {vocab}) "
                                        f"of model '{model_name}'")
                ids.append(t)
            out.append(ids)
            continue
        raise ArgumentTypeError(
            f"{name}: a prompt is a str, a PromptConfig or a list of token ids, got "
            f"{'None' if p is None else type(p).__name__}")
    return out


def preflight_transport(cfg: SpadeConfig) -> None:
    """A spawned cache process listens on the transport's port: a port another program
    holds fails here, before the model loads (under torchrun the cache rank may already
    listen there, so only its own listening side checks)."""
    rt = cfg.runtime
    if rt.topology != "multiprocess":
        return
    from spade.runtime.link import torchrun_world
    from spade.transports import TRANSPORTS

    if not torchrun_world():
        TRANSPORTS.get(rt.transport.name).preflight(rt.transport)


def build_prompt(cfg: SpadeConfig, tok, p: PromptConfig | str) -> str:
    """The text of prompt ``p``: its essay context (``essay_tokens``) and the model's chat
    template (``model.chat_template``) applied."""
    if isinstance(p, str):
        p = PromptConfig(text=p)
    body = p.text
    if p.essay_tokens:
        if tok is None:
            raise ConfigError("generation.prompts[].essay_tokens needs a model with a tokenizer")
        from spade.data import essay_context

        body = f"{essay_context(tok, p.essay_tokens)}\n\n{p.text}".strip()
    if tok is not None and cfg.model.chat_template and getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": body}], tokenize=False,
                                       add_generation_prompt=True)
    return body


def preset_len(p: PromptConfig | str) -> int:
    """Prompt length for tokenizer-less presets: essay_tokens + one per word of text."""
    if isinstance(p, str):
        p = PromptConfig(text=p)
    return p.essay_tokens + max(1, len(p.text.split()))


def encode_prompts(cfg: SpadeConfig, tok, vocab: int, prompts: list) -> tuple[list[str], list[list[int]]]:
    """Checked ``prompts`` (``check_prompts``) as texts (for the results) and token ids.
    Token ids are used as given; text gets ``build_prompt``. Without a tokenizer (a
    random-weight preset) a text prompt becomes deterministic random ids of
    ``preset_len`` tokens (``generation.seed``)."""
    g = torch.Generator().manual_seed(cfg.generation.seed)
    texts: list[str] = []
    seqs: list[list[int]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, list):  # token ids
            seqs.append(list(p))
            texts.append(tok.decode(p) if tok is not None else " ".join(map(str, p)))
        elif tok is None:
            seqs.append(torch.randint(0, vocab, (preset_len(p),), generator=g).tolist())
            texts.append(p if isinstance(p, str) else p.text)
        else:
            text = build_prompt(cfg, tok, p)
            seqs.append(list(tok(text, add_special_tokens=False)["input_ids"]))
            texts.append(text)
        if len(seqs[-1]) == 0:
            raise ArgumentError(f"prompts[{i}]: encodes to no tokens; give it some text")
    return texts, seqs


def check_max_new(g, max_new_tokens) -> int:
    """``max_new_tokens`` checked: a positive int, or None for ``generation.max_new_tokens``."""
    if max_new_tokens is None:
        return g.max_new_tokens
    ok = not isinstance(max_new_tokens, bool) and hasattr(max_new_tokens, "__index__")
    n = operator.index(max_new_tokens) if ok else None
    if n is None or n < 1:
        raise ArgumentError(
            f"max_new_tokens must be a positive int, got {max_new_tokens!r}: pass e.g. max_new_tokens=32, "
            f"or None for the config's generation.max_new_tokens ({g.max_new_tokens})")
    return n


#: a prompt: text, a ``PromptConfig``, or token ids (a list of ints or a 1-D integer tensor)
Prompt = Union[str, PromptConfig, Sequence[int], torch.Tensor]


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class GenerationResult:
    """One prompt's generation and its measurements.

    ``step_times_s``: seconds per decode step (``spade.Engine``: between this request's
    tokens after its first; ``StaticEngine``: the batch's steps). ``prefill_time_s``:
    ``spade.Engine``: seconds from submission to the first token (queueing and prompt
    pass); ``StaticEngine``: the batch's prompt pass. ``mean_attended``: tokens attended
    per decode step (``spade.Engine``: this request's window while it is dense, the
    policy's budget once sparse; ``StaticEngine``: the attention kernels' count over the
    batch). ``finished``: ``"eos"``, ``"length"``, or ``"error"`` in the
    ``partial_results`` of a failed call."""

    prompt: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    step_times_s: list[float] = field(default_factory=list)
    prefill_time_s: float = 0.0
    mean_attended: float = 0.0
    finished: str = "length"  # "eos" | "length"

    @property
    def tpot_median_ms(self) -> float:
        return statistics.median(self.step_times_s) * 1e3 if self.step_times_s else float("nan")

    @property
    def tpot_p90_ms(self) -> float:
        return _percentile(self.step_times_s, 0.9) * 1e3

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tpot_median_ms"] = self.tpot_median_ms
        d["tpot_p90_ms"] = self.tpot_p90_ms
        return d


@dataclass
class LoadedModel:
    """What ``load_model`` built: the backend (weights and KV cache) and the policy."""

    device: torch.device
    dtype: torch.dtype
    source: object  # spade.models.registry's resolved source (kind: preset / folder / ...)
    backend_kind: str  # "fast" | "hf"
    backend: object  # DecodeBackend
    policy: object  # Policy


def load_model(config: SpadeConfig, *, max_batch: int, say: Callable[[str], None] | None = None,
               backend: str | None = None) -> LoadedModel:
    """Resolve the device and dtype, load the backend with a KV cache of ``max_batch``
    rows of ``model.max_seq_len`` tokens, and build the policy: what ``Engine`` and
    ``spade.AsyncEngine`` share. ``backend``: overrides ``model.backend``."""
    say = say or (lambda msg: None)
    m = config.model
    device = resolve_device(m.device)
    dtype = resolve_dtype(m.dtype, device)
    check_kernels_env(device)
    from spade.models.registry import resolve_source

    source = resolve_source(m.name)
    backend = backend or m.backend
    if backend == "auto":
        backend = "fast" if (device.type == "cuda" or source.kind == "preset") else "hf"
    if backend == "hf" and source.kind == "preset":
        raise ConfigError(
            f"model.backend: 'hf' needs real weights; '{m.name}' is a random-weight shape preset: use backend 'fast'"
        )
    t0 = time.time()
    model = _load_backend(config, backend, source, device, dtype, max_batch)
    say(f"loaded {m.name} ({backend} backend, {device}, {str(dtype).removeprefix('torch.')}) "
        f"in {time.time() - t0:.1f} s")
    from spade.policies import build_policy

    return LoadedModel(device=device, dtype=dtype, source=source, backend_kind=backend, backend=model,
                       policy=build_policy(config.policy, model.spec))


def _load_backend(config: SpadeConfig, kind: str, source, device: torch.device, dtype: torch.dtype,
                  max_batch: int):
    m = config.model
    if kind == "hf":
        from spade.models.hf import HFBackend

        if m.block_size is not None:
            raise ConfigError(f"model.block_size ({m.block_size}): the paged KV cache needs the fast backend; "
                              "set model.backend: fast, or model.block_size: null")
        from spade.models.registry import resolve_model

        return HFBackend.from_pretrained(str(resolve_model(m.name)), device=device, dtype=dtype)
    from spade.models.fast import FastModel

    if source.kind == "preset":
        from spade.models.presets import preset_config

        return FastModel.from_config(preset_config(m.name), device=device, dtype=dtype,
                                     max_batch=max_batch, max_seq_len=m.max_seq_len, seed=m.seed,
                                     linear=m.linear, block_size=m.block_size, kv_blocks=m.kv_blocks)
    from spade.models.registry import resolve_model

    return FastModel.from_hf_folder(str(resolve_model(m.name)), device=device, dtype=dtype,
                                    max_batch=max_batch, max_seq_len=m.max_seq_len, linear=m.linear,
                                    block_size=m.block_size, kv_blocks=m.kv_blocks)


class _Live:
    """One prompt's request as it streams (written on the engine's loop thread)."""

    __slots__ = ("ids", "times", "out")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.times: list[float] = []  # the arrival of each token
        self.out = None  # its newest RequestOutput


class Engine:
    """Load the model once; ``generate`` many times: the synchronous front of
    ``spade.AsyncEngine``.

    ``generate(prompts)`` submits every prompt as a request of one ``AsyncEngine``
    (continuous batching: ``serving.max_batch`` rows decode at once, the rest wait, a row
    freed by a finished prompt takes the next) and returns when all have finished, so each
    prompt gets the tokens it would get alone. It serves what ``AsyncEngine`` serves
    (``check_served``: the fast backend, index-list selections); ``spade.run`` /
    ``spade run`` decode one static batch on the batch runtime, which takes every backend
    and setting. It holds ``serving.max_batch`` rows of ``model.max_seq_len`` tokens of KV
    cache (or ``model.kv_blocks`` blocks when paged). ``cache_hooks``:
    ``spade.runtime.protocol.CacheHooks`` for tests.
    """

    def __init__(self, config: SpadeConfig, *, progress: Callable[[str], None] | None = None, cache_hooks=None):
        from spade.runtime.link import LoopThread
        from spade.serving.engine import AsyncEngine, check_served

        check_kernels_env(resolve_device(config.model.device))
        try:
            check_served(config)
        except ConfigError as e:
            raise ConfigError(f"{e} (spade.Engine serves its prompts through spade.AsyncEngine; `spade run` / "
                              "spade.run(cfg) decode one static batch and take this setting)") from None
        preflight_transport(config)
        self.cfg = config
        self._cv = threading.Condition()  # the calls in flight, the closed flag
        self._active = 0
        self._callers: set[int] = set()  # the threads inside generate()
        self._closed = False
        self._calls = itertools.count()
        self._core = AsyncEngine(config, progress=progress, cache_hooks=cache_hooks)
        self._loop = LoopThread("spade-engine")  # the core's scheduler runs on this loop

    # -- what was loaded ----------------------------------------------------
    @property
    def tokenizer(self):
        return self._core.tokenizer

    @property
    def backend(self):
        return self._core.backend

    @property
    def policy(self):
        return self._core.policy

    @property
    def device(self) -> torch.device:
        return self._core.device

    @property
    def dtype(self) -> torch.dtype:
        return self._core.dtype

    @property
    def core(self):
        """The ``spade.AsyncEngine`` underneath (its scheduler runs on this engine's own loop thread)."""
        return self._core

    def stats(self) -> dict:
        """The core's counters (``AsyncEngine.stats``)."""
        return self._core.stats()

    # -- generation ---------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt] | None = None, max_new_tokens: int | None = None,
                 *, on_text: Callable[[int, str], None] | None = None) -> list[GenerationResult]:
        """Generate for ``prompts`` (default: the config's); one ``GenerationResult`` per
        prompt, in order.

        A prompt is a str, a ``PromptConfig`` or a list of token ids (used as given: no
        chat template); a bare str is one prompt. ``max_new_tokens``: a positive int, or
        None for the config's value. Sampling follows ``generation`` (temperature, top_p;
        prompt ``i`` samples from its own generator seeded ``generation.seed + i``, so its
        tokens do not depend on the others). ``on_text(i, delta)`` streams prompt ``i``'s
        new text, on the calling thread.

        Every prompt is checked before any runs. Thread-safe: concurrent calls (threads,
        ``asyncio.to_thread``) share the batch, each with its own results. On a failure
        the exception carries ``partial_results`` (the tokens generated so far,
        ``finished="error"``); the engine goes on serving.

        >>> engine.generate("Hello", max_new_tokens=8)[0].text      # doctest: +SKIP
        """
        me = threading.get_ident()
        with self._cv:
            if me in self._callers:
                raise RuntimeError("Engine.generate() called again from inside its own on_text callback; "
                                   "generate after the call returns")
            if self._closed:
                raise EngineClosedError("this Engine is closed (close() was called); build a new spade.Engine(cfg)")
            self._active += 1
            self._callers.add(me)
        try:
            return self._generate(prompts, max_new_tokens, on_text)
        finally:
            with self._cv:
                self._active -= 1
                self._callers.discard(me)
                self._cv.notify_all()

    def _requests(self, prompts, max_new_tokens) -> tuple[list[str], list[list[int]], list]:
        """The checked prompts as texts, token ids and ``SamplingParams`` (nothing runs yet)."""
        from spade.serving.params import RequestOutputKind, SamplingParams

        g = self.cfg.generation
        core = self._core
        if prompts is None:
            prompts = check_prompts(list(g.prompts), "generation.prompts", core.vocab, self.cfg.model.name)
        else:
            prompts = check_prompts(prompts, "prompts", core.vocab, self.cfg.model.name)
        max_new = check_max_new(g, max_new_tokens)
        texts, seqs = encode_prompts(self.cfg, self.tokenizer, core.vocab, prompts)
        longest = max(len(s) for s in seqs)
        # (validate below checks each request too, in SamplingParams' terms; this names the caller's fields)
        if longest + max_new > core.max_seq_len:
            raise ConfigError(
                f"model.max_seq_len ({core.max_seq_len}) is too small: the prompt has {longest} tokens and "
                f"generation.max_new_tokens is {max_new}; raise model.max_seq_len to at least {longest + max_new}")
        params = [SamplingParams(max_tokens=max_new, temperature=g.temperature, top_p=g.top_p, seed=g.seed + i,
                                 ignore_eos=not g.stop_at_eos, output_kind=RequestOutputKind.DELTA)
                  for i in range(len(seqs))]
        for s, p in zip(seqs, params):
            core.validate(s, p)  # (the KV pool's limit, ...): every prompt before any runs
        return texts, seqs, params

    def _generate(self, prompts, max_new_tokens, on_text) -> list[GenerationResult]:
        texts, seqs, params = self._requests(prompts, max_new_tokens)
        live = [_Live() for _ in seqs]
        feed: queue.SimpleQueue = queue.SimpleQueue()  # (i, delta) for on_text, handed to this thread
        finished = threading.Event()
        call = next(self._calls)
        core, loop = self._core, self._loop.loop

        async def one(i: int) -> None:
            st = live[i]
            async for out in core.generate(seqs[i], params[i], f"engine-{call}-{i}"):
                if out.token_ids:
                    st.ids.extend(out.token_ids)
                    st.times.extend([time.perf_counter()] * len(out.token_ids))
                st.out = out
                if on_text is not None and out.delta_text:
                    feed.put((i, out.delta_text))

        async def every() -> None:
            tasks = [asyncio.ensure_future(one(i)) for i in range(len(seqs))]
            try:
                await asyncio.gather(*tasks)
            finally:  # one failed, or the call was cancelled: the others end too (their requests abort)
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        box: dict = {}

        def start() -> None:
            box["task"] = loop.create_task(every())
            box["task"].add_done_callback(lambda t: finished.set())

        loop.call_soon_threadsafe(start)
        try:
            while not (finished.is_set() and feed.empty()):
                try:
                    item = feed.get(timeout=0.05)
                except queue.Empty:
                    continue
                on_text(*item)
            task = box["task"]
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
        except BaseException as e:
            loop.call_soon_threadsafe(lambda: box["task"].cancel())  # (runs after start: the loop's FIFO)
            finished.wait()
            e.partial_results = self._results(texts, seqs, live, error=True)
            raise
        return self._results(texts, seqs, live)

    def _results(self, texts, seqs, live, error: bool = False) -> list[GenerationResult]:
        tok = self.tokenizer
        batch, budget = self._core.batch, self.policy.budget
        theta = batch.theta_row  # None: always dense
        out = []
        for text, ids, st in zip(texts, seqs, live):
            toks = list(st.ids)
            reason = st.out.finish_reason if st.out is not None else None
            finished = "error" if error or reason is None else ("eos" if reason == "stop" else reason)
            T = len(ids)
            # decode steps: one per sampled token after the first (an EOS is sampled, not kept)
            steps = max(0, len(toks) + (reason == "stop") - 1)
            windows = [T + k for k in range(1, steps + 1)]  # the row's window at each decode step
            attended = [w if theta is None or w <= theta else min(budget, w) for w in windows]
            out.append(GenerationResult(
                prompt=text,
                text=tok.decode(toks, skip_special_tokens=True) if tok is not None else " ".join(map(str, toks)),
                token_ids=toks, prompt_tokens=T,
                step_times_s=[b - a for a, b in zip(st.times, st.times[1:])],
                prefill_time_s=(st.out.ttft_s or 0.0) if st.out is not None else 0.0,
                mean_attended=sum(attended) / len(attended) if attended else 0.0,
                finished=finished))
        return out

    def close(self) -> None:
        """Wait for running ``generate`` calls, then free the model (and cache rank);
        idempotent. Later calls raise ``EngineClosedError``."""
        with self._cv:
            if threading.get_ident() in self._callers:
                raise RuntimeError("Engine.close() called from inside generate's on_text callback")
            if self._closed:
                return
            self._closed = True
            while self._active:
                self._cv.wait()
        try:
            asyncio.run_coroutine_threadsafe(self._core.close(), self._loop.loop).result()
        finally:
            self._loop.stop()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Engine", "GenerationResult", "Prompt", "load_model", "SpadeError", "ModelError"]

"""The engine serving teams embed: config in, generations and measurements out.

>>> import spade                                             # doctest: +SKIP
>>> cfg = spade.load_config("configs/cpu_tiny.yaml", overrides=["generation.max_new_tokens=16"])
>>> engine = spade.Engine(cfg)
>>> [r.text for r in engine.generate(["What is a sink token?"])]
"""

from __future__ import annotations

import operator
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


def _kernels_setting() -> str:
    """``SPADE_KERNELS`` as the run used it (a bad value reads as itself: the run JSON
    records what was set, the error is raised elsewhere)."""
    from spade.envs import env

    try:
        return env("SPADE_KERNELS")
    except ValueError:
        return "invalid"


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
    """One prompt's generation and its per-step measurements."""

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


class Engine:
    """Load the model, policy and runtime once; ``generate`` many times."""

    def __init__(self, config: SpadeConfig, *, progress: Callable[[str], None] | None = None):
        self.cfg = config
        self.say = progress or (lambda msg: None)
        check_kernels_env(resolve_device(config.model.device))  # (load_model checks again: cheap)
        self._preflight_transport()
        # one generation at a time: the runtime's event loop and cache link serve one batch
        self._lock = threading.Lock()
        self._busy: int | None = None  # the thread inside generate(), if any
        self._closed = False
        self.last_trace = None
        parts = load_model(config, max_batch=max(1, len(config.generation.prompts)), say=self.say)
        self.device, self.dtype, self.source = parts.device, parts.dtype, parts.source
        self.backend_kind, self.backend, self.policy = parts.backend_kind, parts.backend, parts.policy
        from spade.runtime import build_runtime

        self.runtime = build_runtime(config, self.backend, self.policy)

    def _preflight_transport(self) -> None:
        """A spawned cache process listens on the transport's port: a port another
        program holds fails here, before the model loads (under torchrun the cache rank
        may already listen there, so only its own listening side checks)."""
        rt = self.cfg.runtime
        if rt.topology != "multiprocess":
            return
        from spade.runtime.link import torchrun_world
        from spade.transports import TRANSPORTS

        if not torchrun_world():
            TRANSPORTS.get(rt.transport.name).preflight(rt.transport)

    @property
    def tokenizer(self):
        return getattr(self.backend, "tokenizer", None)

    # -- prompts ------------------------------------------------------------
    def build_prompt(self, p: PromptConfig | str) -> str:
        if isinstance(p, str):
            p = PromptConfig(text=p)
        tok = self.tokenizer
        body = p.text
        if p.essay_tokens:
            if tok is None:
                raise ConfigError("generation.prompts[].essay_tokens needs a model with a tokenizer")
            from spade.data import essay_context

            body = f"{essay_context(tok, p.essay_tokens)}\n\n{p.text}".strip()
        if tok is not None and self.cfg.model.chat_template and getattr(tok, "chat_template", None):
            return tok.apply_chat_template([{"role": "user", "content": body}], tokenize=False,
                                           add_generation_prompt=True)
        return body

    @staticmethod
    def _preset_len(p: PromptConfig | str) -> int:
        """Prompt length for tokenizer-less presets: essay_tokens + one per word of text."""
        if isinstance(p, str):
            p = PromptConfig(text=p)
        return p.essay_tokens + max(1, len(p.text.split()))

    def _check_prompts(self, prompts, where: str) -> list:
        """``prompts`` as a list of str / PromptConfig / list[int] (token ids), checked
        (``check_prompts``)."""
        return check_prompts(prompts, where, int(getattr(self.backend, "vocab_size", 0) or 0), self.cfg.model.name)

    def _check_max_new(self, max_new_tokens) -> int:
        g = self.cfg.generation
        if max_new_tokens is None:
            return g.max_new_tokens
        ok = not isinstance(max_new_tokens, bool) and hasattr(max_new_tokens, "__index__")
        n = operator.index(max_new_tokens) if ok else None
        if n is None or n < 1:
            raise ArgumentError(
                f"max_new_tokens must be a positive int, got {max_new_tokens!r}: pass e.g. max_new_tokens=32, "
                f"or None for the config's generation.max_new_tokens ({g.max_new_tokens})")
        return n

    def _encode(self, prompts: list) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        """Prompt texts (for the results), ids [B, T] and mask [B, T], left padded.
        Without a tokenizer (random-weight preset) a text prompt becomes deterministic
        random ids of ``_preset_len`` tokens."""
        tok = self.tokenizer
        g = torch.Generator().manual_seed(self.cfg.generation.seed)
        texts: list[str] = []
        seqs: list[torch.Tensor] = []
        for i, p in enumerate(prompts):
            if isinstance(p, list):  # token ids
                seqs.append(torch.tensor(p, dtype=torch.long))
                texts.append(tok.decode(p) if tok is not None else " ".join(map(str, p)))
            elif tok is None:
                seqs.append(torch.randint(0, self.backend.vocab_size, (self._preset_len(p),), generator=g))
                texts.append(p if isinstance(p, str) else p.text)
            else:
                text = self.build_prompt(p)
                seqs.append(torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long))
                texts.append(text)
            if len(seqs[-1]) == 0:
                raise ArgumentError(f"prompts[{i}]: encodes to no tokens; give it some text")
        T = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), T, dtype=torch.long)
        mask = torch.zeros(len(seqs), T, dtype=torch.long)
        pad = getattr(tok, "pad_token_id", None) if tok is not None else None
        if pad is not None:
            ids.fill_(pad)
        for i, s in enumerate(seqs):  # left padding
            ids[i, T - len(s):] = s
            mask[i, T - len(s):] = 1
        return texts, ids, mask

    # -- sampling -----------------------------------------------------------
    def _sampler(self, temperature: float, top_p: float, seed: int):
        if temperature == 0:
            return lambda logits: logits.argmax(dim=-1)
        gen = torch.Generator(device=self.device).manual_seed(seed)

        def sample(logits: torch.Tensor) -> torch.Tensor:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            if top_p < 1.0:
                sp, si = probs.sort(dim=-1, descending=True)
                keep = sp.cumsum(-1) - sp < top_p
                sp = sp * keep
                probs = torch.zeros_like(probs).scatter_(-1, si, sp)
            return torch.multinomial(probs, 1, generator=gen).squeeze(-1)

        return sample

    # -- generation ---------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt] | None = None, max_new_tokens: int | None = None,
                 *, on_text: Callable[[int, str], None] | None = None) -> list[GenerationResult]:
        """Generate for ``prompts`` (default: the config's) as one batch.

        A prompt is a str, a ``PromptConfig`` or a list of token ids (used as given: no
        chat template); a bare str is one prompt. ``max_new_tokens``: a positive int, or None for the config's value.
        ``on_text(row, delta)`` streams decoded text as tokens arrive.

        Thread-safe: concurrent calls (threads, ``asyncio.to_thread``) run one after
        the other, each with its own results. On a failure the exception carries
        ``partial_results`` (the tokens generated so far, ``finished="error"``).

        >>> engine.generate("Hello", max_new_tokens=8)[0].text      # doctest: +SKIP
        """
        me = threading.get_ident()
        if self._busy == me:
            raise RuntimeError("Engine.generate() called again from inside its own on_text callback; "
                               "generate after the call returns")
        with self._lock:
            if self._closed:
                raise EngineClosedError("this Engine is closed (close() was called); build a new spade.Engine(cfg)")
            self._busy = me
            try:
                return self._generate(prompts, max_new_tokens, on_text)
            finally:
                self._busy = None

    def _generate(self, prompts, max_new_tokens, on_text) -> list[GenerationResult]:
        g = self.cfg.generation
        if prompts is None:
            prompts = self._check_prompts(list(g.prompts), "generation.prompts")
        else:
            prompts = self._check_prompts(prompts, "prompts")
        max_new = self._check_max_new(max_new_tokens)
        texts, ids, mask = self._encode(prompts)
        need = ids.shape[1] + max_new
        if need > self.cfg.model.max_seq_len:
            raise ConfigError(
                f"model.max_seq_len ({self.cfg.model.max_seq_len}) is too small: the prompt has "
                f"{ids.shape[1]} tokens and generation.max_new_tokens is {max_new}; raise model.max_seq_len "
                f"to at least {need}"
            )
        eos = set(getattr(self.backend, "eos_token_ids", []) or [])
        done = [False] * len(texts)
        finished = ["length"] * len(texts)
        tok = self.tokenizer
        streamed: list[list[int]] = [[] for _ in texts]
        detoks = None
        if on_text is not None and tok is not None:
            from spade.serving.detok import IncrementalDetokenizer

            detoks = [IncrementalDetokenizer(tok) for _ in texts]  # a window per token, not the whole text

        def on_token(step: int, host: torch.Tensor) -> bool:
            for b in range(len(texts)):
                if done[b]:
                    continue
                t = int(host[b])
                if g.stop_at_eos and t in eos:
                    done[b], finished[b] = True, "eos"
                    continue
                streamed[b].append(t)
                if detoks is not None:
                    new = detoks[b].step(streamed[b])
                    if new:
                        on_text(b, new)
            return g.stop_at_eos and all(done)

        def results(trace) -> list[GenerationResult]:
            out = []
            for b, text in enumerate(texts):
                toks = list(streamed[b])
                out.append(GenerationResult(
                    prompt=text, text=tok.decode(toks, skip_special_tokens=True) if tok is not None
                    else " ".join(map(str, toks)),
                    token_ids=toks, prompt_tokens=int(mask[b].sum()),
                    step_times_s=list(trace.step_times_s) if trace is not None else [],
                    prefill_time_s=trace.prefill_time_s if trace is not None else 0.0,
                    mean_attended=trace.mean_attended if trace is not None else 0.0,
                    finished=finished[b] if trace is not None or finished[b] == "eos" else "error",
                ))
            return out

        self.last_trace = None
        try:
            trace = self.runtime.generate(ids, mask, max_new_tokens=max_new,
                                          sample_fn=self._sampler(g.temperature, g.top_p, g.seed),
                                          on_token=on_token)
        except BaseException as e:
            e.partial_results = results(None)  # what was generated before the failure
            raise
        self.last_trace = trace
        self.last_prompt_len = int(ids.shape[1])
        return results(trace)

    def close(self) -> None:
        """Release the runtime (cache rank, transport) and the backend; idempotent.
        Waits for a running ``generate`` to finish; later calls raise ``EngineClosedError``."""
        if self._busy == threading.get_ident():
            raise RuntimeError("Engine.close() called from inside generate's on_text callback")
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.runtime.close()
            close = getattr(self.backend, "close", None)
            if close is not None:
                close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_events(trace, prompt_len: int = 0) -> list[dict]:
    """What went off the plain path in one generation, from the runtime's record:
    each loss and restart of the cache rank (``peer_lost``, ``restart_failed``,
    ``peer_restored``, ``no_restart``, with the decode step and ``t_s``, seconds
    since the generation began), dense steps past the sparse threshold
    (``dense_fallback``: how many, and their [first, last] step ranges), late packs
    by what ``runtime.on_late`` did with them."""
    if trace is None:
        return []
    st = trace.stats or {}
    events: list[dict] = [dict(e) for e in st.get("events", [])]
    theta = st.get("theta")
    if theta is not None and not st.get("sync_policy"):
        n = len(trace.step_times_s)
        past = sum(1 for i in range(1, n + 1) if prompt_len + i > theta)  # steps meant to be sparse
        dense = int(st.get("dense_fallback_steps", 0))
        if dense > 0:
            events.append({"event": "dense_fallback", "steps": dense, "of_sparse_steps": past,
                           "ranges": st.get("dense_fallback", [])})
    if trace.late_packs:
        events.append({"event": "late_packs", "total": trace.late_packs, "stale": st.get("stale_packs", 0),
                       "full": st.get("full_packs", 0), "waited": st.get("waited_packs", 0),
                       "timed_out": st.get("timed_out_packs", 0), "wait_s": st.get("wait_s", 0.0)})
    return events


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and x != x:
        return None  # NaN is not JSON
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def summarize(cfg: SpadeConfig, results: list[GenerationResult], trace=None, *, engine: Engine | None = None,
              error: BaseException | None = None) -> dict:
    """The summary ``spade run`` prints and writes as JSON. With ``error`` it is the
    partial record of a failed run: the tokens generated so far and the error."""
    steps = results[0].step_times_s if results else []
    pol = cfg.policy
    events = run_events(trace, getattr(engine, "last_prompt_len", 0) if engine is not None else 0)
    out = {
        "status": "failed" if error is not None else "ok",
        "model": cfg.model.name,
        "backend": engine.backend_kind if engine is not None else cfg.model.backend,
        "device": str(engine.device) if engine is not None else cfg.model.device,
        "dtype": str(engine.dtype).removeprefix("torch.") if engine is not None else cfg.model.dtype,
        "kernels": _kernels_setting(),
        "policy": pol.name,
        "budget": getattr(pol, "budget", None),
        "topology": cfg.runtime.topology,
        "transport": cfg.runtime.transport.name,
        "on_late": cfg.runtime.on_late,
        "batch": len(results),
        "prompt_tokens": [r.prompt_tokens for r in results],
        "generated_tokens": [len(r.token_ids) for r in results],
        "decode_steps": len(steps),
        "tpot_median_ms": statistics.median(steps) * 1e3 if steps else None,
        "tpot_p90_ms": _percentile(steps, 0.9) * 1e3 if steps else None,
        "prefill_ms": results[0].prefill_time_s * 1e3 if results else None,
        "tokens_attended_per_step": results[0].mean_attended if results else None,
        "late_packs": getattr(trace, "late_packs", 0) if trace is not None else 0,
        "events": events,
        "runtime_stats": _jsonable(trace.stats) if trace is not None else {},
        "results": [r.to_dict() for r in results],
        "config": cfg.dump(),
    }
    if error is not None:
        msg = str(error).strip().splitlines()[0] if str(error).strip() else ""
        out["error"] = {"type": type(error).__name__, "message": msg}
        out["events"].append({"event": "error", "type": type(error).__name__, "message": msg,
                              "tokens_generated": [len(r.token_ids) for r in results]})
    return out


def run(config: SpadeConfig, *, on_text=None, progress=None) -> dict:
    """``spade run`` as a function: load, generate the configured prompts, summarise.

    On any failure the exception carries ``partial_summary``: the summary of what was
    generated before it (``status: failed``, the error, the events)."""
    engine = None
    try:
        engine = Engine(config, progress=progress)
        results = engine.generate(on_text=on_text)
        return summarize(config, results, engine.last_trace, engine=engine)
    except BaseException as e:
        try:
            e.partial_summary = summarize(config, getattr(e, "partial_results", []), None, engine=engine, error=e)
        except Exception:  # pragma: no cover - the record must never mask the error
            pass
        if engine is not None:
            try:
                engine.close()
            except Exception:
                pass
        raise
    finally:
        if engine is not None:
            engine.close()


__all__ = ["Engine", "GenerationResult", "Prompt", "run", "run_events", "summarize", "SpadeError", "ModelError"]

"""The static batch: what ``spade run`` measures.

>>> import spade                                             # doctest: +SKIP
>>> summary = spade.run(spade.load_config("configs/cpu_tiny.yaml"))
>>> summary["tpot_median_ms"], summary["events"]

``StaticEngine`` decodes every prompt of a call in one left-padded batch on the batch
runtime (``spade.runtime``: inline, or an inference rank with its cache rank), timing
each step and recording what went off the plain path (a lost cache rank, late packs,
dense fallbacks); ``run`` loads it, generates the configured prompts and summarises.
The library's request API is ``spade.Engine`` / ``spade.AsyncEngine`` (continuous
batching over row slots); this is the benchmark engine, and the one that takes every
backend, return mode and policy setting.
"""

from __future__ import annotations

import statistics
import threading
from typing import Callable, Sequence

import torch

from spade.config import SpadeConfig
from spade.engine import (GenerationResult, Prompt, _percentile, check_kernels_env, check_max_new, check_prompts,
                          encode_prompts, load_model, preflight_transport, resolve_device)
from spade.errors import ConfigError, EngineClosedError


def _kernels_setting() -> str:
    """``SPADE_KERNELS`` as the run used it (a bad value reads as itself: the run JSON
    records what was set, the error is raised elsewhere)."""
    from spade.envs import env

    try:
        return env("SPADE_KERNELS")
    except ValueError:
        return "invalid"


class StaticEngine:
    """One static batch at a time on the batch runtime: load the model, policy and
    runtime once; ``generate`` many times. What ``spade run`` (``spade.run``) measures:
    every prompt of a call decodes in one left-padded batch, each step timed
    (``GenerationResult.step_times_s``: the batch's step times), with the runtime's
    record of the generation in ``last_trace``. Every backend (``hf`` included), return
    mode and policy setting runs here; the library's ``spade.Engine`` serves requests
    through ``spade.AsyncEngine`` instead."""

    def __init__(self, config: SpadeConfig, *, progress: Callable[[str], None] | None = None):
        self.cfg = config
        self.say = progress or (lambda msg: None)
        check_kernels_env(resolve_device(config.model.device))  # (load_model checks again: cheap)
        preflight_transport(config)
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

    @property
    def tokenizer(self):
        return getattr(self.backend, "tokenizer", None)

    # -- prompts ------------------------------------------------------------
    def _encode(self, prompts: list) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        """Prompt texts (for the results), ids [B, T] and mask [B, T], left padded."""
        texts, seqs = encode_prompts(self.cfg, self.tokenizer, self.backend.vocab_size, prompts)
        T = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), T, dtype=torch.long)
        mask = torch.zeros(len(seqs), T, dtype=torch.long)
        tok = self.tokenizer
        pad = getattr(tok, "pad_token_id", None) if tok is not None else None
        if pad is not None:
            ids.fill_(pad)
        for i, s in enumerate(seqs):  # left padding
            ids[i, T - len(s):] = torch.tensor(s, dtype=torch.long)
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
            raise RuntimeError("StaticEngine.generate() called again from inside its own on_text callback; "
                               "generate after the call returns")
        with self._lock:
            if self._closed:
                raise EngineClosedError("this Engine is closed (close() was called); build a new StaticEngine(cfg)")
            self._busy = me
            try:
                return self._generate(prompts, max_new_tokens, on_text)
            finally:
                self._busy = None

    def _generate(self, prompts, max_new_tokens, on_text) -> list[GenerationResult]:
        g = self.cfg.generation
        vocab = int(getattr(self.backend, "vocab_size", 0) or 0)
        if prompts is None:
            prompts = check_prompts(list(g.prompts), "generation.prompts", vocab, self.cfg.model.name)
        else:
            prompts = check_prompts(prompts, "prompts", vocab, self.cfg.model.name)
        max_new = check_max_new(g, max_new_tokens)
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
            raise RuntimeError("StaticEngine.close() called from inside generate's on_text callback")
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

    def __enter__(self) -> "StaticEngine":
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


def summarize(cfg: SpadeConfig, results: list[GenerationResult], trace=None, *, engine: StaticEngine | None = None,
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
        engine = StaticEngine(config, progress=progress)
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


__all__ = ["StaticEngine", "run", "run_events", "summarize"]

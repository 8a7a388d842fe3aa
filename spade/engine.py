"""The engine serving teams embed: config in, generations and measurements out.

>>> import spade                                             # doctest: +SKIP
>>> cfg = spade.load_config("configs/cpu_tiny.yaml", overrides=["generation.max_new_tokens=16"])
>>> engine = spade.Engine(cfg)
>>> [r.text for r in engine.generate(["What is a sink token?"])]
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from spade.config import PromptConfig, SpadeConfig
from spade.errors import ConfigError, ModelError, SpadeError
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


class Engine:
    """Load the model, policy and runtime once; ``generate`` many times."""

    def __init__(self, config: SpadeConfig, *, progress: Callable[[str], None] | None = None):
        self.cfg = config
        self.say = progress or (lambda msg: None)
        m = config.model
        self.device = resolve_device(m.device)
        self.dtype = resolve_dtype(m.dtype, self.device)
        from spade.models.registry import resolve_source

        self.source = resolve_source(m.name)
        backend = m.backend
        if backend == "auto":
            backend = "fast" if (self.device.type == "cuda" or self.source.kind == "preset") else "hf"
        if backend == "hf" and self.source.kind == "preset":
            raise ConfigError(
                f"model.backend: 'hf' needs real weights; '{m.name}' is a random-weight shape preset: use backend 'fast'"
            )
        self.backend_kind = backend
        t0 = time.time()
        self.backend = self._load_backend(backend)
        self.say(f"loaded {m.name} ({backend} backend, {self.device}, {str(self.dtype).removeprefix('torch.')}) "
                 f"in {time.time() - t0:.1f} s")
        from spade.policies import build_policy

        self.policy = build_policy(config.policy, self.backend.spec)
        from spade.runtime import build_runtime

        self.runtime = build_runtime(config, self.backend, self.policy)

    # -- loading ------------------------------------------------------------
    def _load_backend(self, kind: str):
        m = self.cfg.model
        max_batch = max(1, len(self.cfg.generation.prompts))
        if kind == "hf":
            from spade.models.hf import HFBackend
            from spade.models.registry import resolve_model

            return HFBackend.from_pretrained(str(resolve_model(m.name)), device=self.device, dtype=self.dtype)
        from spade.models.fast import FastModel

        if self.source.kind == "preset":
            from spade.models.presets import preset_config

            return FastModel.from_config(preset_config(m.name), device=self.device, dtype=self.dtype,
                                         max_batch=max_batch, max_seq_len=m.max_seq_len, seed=m.seed,
                                         linear=m.linear)
        from spade.models.registry import resolve_model

        return FastModel.from_hf_folder(str(resolve_model(m.name)), device=self.device, dtype=self.dtype,
                                        max_batch=max_batch, max_seq_len=m.max_seq_len, linear=m.linear)

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

    def _encode(self, texts: list[str], lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        tok = self.tokenizer
        if tok is None:  # random-weight preset: deterministic random token ids
            g = torch.Generator().manual_seed(self.cfg.generation.seed)
            vocab = self.backend.vocab_size
            seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
        else:
            seqs = [torch.tensor(tok(t, add_special_tokens=False)["input_ids"], dtype=torch.long) for t in texts]
        T = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), T, dtype=torch.long)
        mask = torch.zeros(len(seqs), T, dtype=torch.long)
        pad = getattr(tok, "pad_token_id", None) if tok is not None else None
        if pad is not None:
            ids.fill_(pad)
        for i, s in enumerate(seqs):  # left padding
            ids[i, T - len(s):] = s
            mask[i, T - len(s):] = 1
        return ids, mask

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
    def generate(self, prompts: list[str | PromptConfig] | None = None, max_new_tokens: int | None = None,
                 *, on_text: Callable[[int, str], None] | None = None) -> list[GenerationResult]:
        """Generate for ``prompts`` (default: the config's) as one batch.

        ``on_text(row, delta)`` streams decoded text as tokens arrive.
        """
        g = self.cfg.generation
        prompts = list(prompts) if prompts is not None else list(g.prompts)
        if not prompts:
            raise ConfigError("generate() needs at least one prompt")
        max_new = max_new_tokens or g.max_new_tokens
        if self.tokenizer is None:
            texts = [p if isinstance(p, str) else p.text for p in prompts]
            ids, mask = self._encode(texts, [self._preset_len(p) for p in prompts])
        else:
            texts = [self.build_prompt(p) for p in prompts]
            ids, mask = self._encode(texts)
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
        shown = [""] * len(texts)

        def on_token(step: int, host: torch.Tensor) -> bool:
            for b in range(len(texts)):
                if done[b]:
                    continue
                t = int(host[b])
                if g.stop_at_eos and t in eos:
                    done[b], finished[b] = True, "eos"
                    continue
                streamed[b].append(t)
                if on_text is not None and tok is not None:
                    txt = tok.decode(streamed[b], skip_special_tokens=True)
                    if txt.startswith(shown[b]) and len(txt) > len(shown[b]):
                        on_text(b, txt[len(shown[b]):])
                        shown[b] = txt
            return g.stop_at_eos and all(done)

        trace = self.runtime.generate(ids, mask, max_new_tokens=max_new,
                                      sample_fn=self._sampler(g.temperature, g.top_p, g.seed), on_token=on_token)
        results = []
        for b, text in enumerate(texts):
            toks = streamed[b]
            out = tok.decode(toks, skip_special_tokens=True) if tok is not None else " ".join(map(str, toks))
            results.append(GenerationResult(
                prompt=text, text=out, token_ids=toks, prompt_tokens=int(mask[b].sum()),
                step_times_s=list(trace.step_times_s), prefill_time_s=trace.prefill_time_s,
                mean_attended=trace.mean_attended, finished=finished[b],
            ))
        self.last_trace = trace
        return results

    def close(self) -> None:
        self.runtime.close()
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()


def summarize(cfg: SpadeConfig, results: list[GenerationResult], trace=None) -> dict:
    """The summary ``spade run`` prints and writes as JSON."""
    steps = results[0].step_times_s if results else []
    pol = cfg.policy
    return {
        "model": cfg.model.name,
        "policy": pol.name,
        "budget": getattr(pol, "budget", None),
        "topology": cfg.runtime.topology,
        "transport": cfg.runtime.transport.name,
        "batch": len(results),
        "prompt_tokens": [r.prompt_tokens for r in results],
        "generated_tokens": [len(r.token_ids) for r in results],
        "decode_steps": len(steps),
        "tpot_median_ms": statistics.median(steps) * 1e3 if steps else None,
        "tpot_p90_ms": _percentile(steps, 0.9) * 1e3 if steps else None,
        "prefill_ms": results[0].prefill_time_s * 1e3 if results else None,
        "tokens_attended_per_step": results[0].mean_attended if results else None,
        "late_packs": getattr(trace, "late_packs", 0) if trace is not None else 0,
        "results": [r.to_dict() for r in results],
        "config": cfg.dump(),
    }


def run(config: SpadeConfig, *, on_text=None, progress=None) -> dict:
    """``spade run`` as a function: load, generate the configured prompts, summarise."""
    engine = Engine(config, progress=progress)
    try:
        results = engine.generate(on_text=on_text)
        return summarize(config, results, getattr(engine, "last_trace", None))
    finally:
        engine.close()


__all__ = ["Engine", "GenerationResult", "run", "summarize", "SpadeError", "ModelError"]

"""Hugging Face ``transformers`` models with spade's sparse decode attention.

spade plugs into transformers through its attention interface (no patched model
classes): importing this module registers an attention implementation named
``"spade"`` (``AttentionInterface.register``) and its mask builder (the sdpa
one, ``AttentionMaskInterface.register``). A model switched to it
(``model.set_attn_implementation("spade")``) calls :func:`spade_attention` in
every attention layer with the post-RoPE query ``[B, Hq, Tq, D]`` and the
layer's whole cache ``[B, Hkv, Tk, D]`` (after the cache update):

* ``Tq > 1`` or an empty cache before this call (the prompt): dense attention
  (transformers' sdpa with the given mask), then ``ctx.prefill``;
* ``Tq == 1`` on a non-empty cache (a decode step): ``ctx.attend`` — the
  policy's selection and spade's sparse decode kernel.

Where the ``AttentionContext`` comes from, first match wins:

1. the ``spade_ctx=`` keyword of the model call (transformers forwards unknown
   keywords of a forward down to the attention function): the caller owns the
   step bookkeeping (``ctx.kv_start``, ``ctx.begin_step``); :class:`HFBackend`
   does this;
2. a binding set on the model's attention modules by :func:`apply` or
   :func:`attach`: the hook itself sets ``ctx.kv_start`` from the prompt's
   padding mask and calls ``ctx.begin_step`` at layer 0 of every forward, so
   ``model.generate(...)`` works unchanged (greedy or sampled, batch > 1 with
   left padding). :func:`apply` creates a fresh ``InlineSelector`` context at
   every prompt;
3. none: plain sdpa, i.e. the model behaves exactly as with ``"sdpa"``.

HF's ``DynamicCache`` grows by one token per step, so every row's cache holds
``seq_len`` tokens (``kv_lens = seq_len`` for all rows) and left padding is
expressed by ``ctx.kv_start`` (the first non-pad position of each row).

Supported: decoder-only GQA models with full (not sliding-window) attention and
the ``rotate_half`` RoPE: Llama (SmolLM2), Qwen2 (Qwen2.5, Qwen2.5-Coder), Qwen3, Mistral
(``spade.models.base.SUPPORTED_MODEL_TYPES``).

>>> import torch, spade.hf                                     # doctest: +SKIP
>>> from spade.policies.oracle import OraclePolicyConfig
>>> model = spade.hf.apply(model, OraclePolicyConfig(budget=64, sink_tokens=4, recent_tokens=8))
>>> out = model.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
>>> spade.hf.last_context(model).mean_attended()             # tokens attended per step
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from spade.attention import AttentionContext, InlineSelector
from spade.errors import ModelError
from spade.models.base import SUPPORTED_MODEL_TYPES, DecodeBackend
from spade.policies import build_policy
from spade.policies.base import AttentionSpec, Policy, RopeSpec

log = logging.getLogger(__name__)

#: the attention implementation name registered with transformers
IMPL = "spade"

__all__ = [
    "IMPL",
    "apply",
    "attach",
    "remove",
    "generate",
    "last_context",
    "attention_spec",
    "spade_attention",
    "use_spade_attention",
    "load_pretrained",
    "HFBackend",
    "HFSnapshot",
]


# --------------------------------------------------------------------------- model introspection
def _config(model_or_config) -> Any:
    return getattr(model_or_config, "config", model_or_config)


def _decoder(model) -> Any:
    """The decoder stack (``model.model`` for ``*ForCausalLM``): has ``layers``,
    ``embed_tokens``, ``rotary_emb`` and ``norm``."""
    inner = getattr(model, "model", model)
    if not hasattr(inner, "layers"):
        raise ModelError(f"{type(model).__name__}: no decoder layers found (expected model.model.layers)")
    return inner


def _attention_modules(model) -> list[torch.nn.Module]:
    return [layer.self_attn for layer in _decoder(model).layers]


def check_supported(model_or_config) -> None:
    """Raise ``ModelError`` unless every layer is a full-attention GQA layer."""
    cfg = _config(model_or_config)
    types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in types):
        raise ModelError(
            f"{cfg.model_type}: layers of type {sorted(set(types) - {'full_attention'})} are not supported by "
            "spade's sparse attention (only full attention); disable sliding windows in the config"
        )
    if getattr(cfg, "is_encoder_decoder", False):
        raise ModelError(f"{cfg.model_type}: encoder-decoder models are not supported (decoder-only only)")


def attention_spec(model_or_config) -> AttentionSpec:
    """The ``AttentionSpec`` of a transformers decoder (from its config).

    RoPE: ``theta`` from ``config.rope_parameters["rope_theta"]`` (transformers 5)
    or ``config.rope_theta``; ``dim`` = ``head_dim`` times the partial rotary
    factor. Scaled RoPE variants (llama3, yarn, ...) change the frequencies in
    ways ``RopeSpec`` does not model: ``rope`` is then None (``asyncspade`` with
    ``rope_aware: true`` refuses with a clear error; the default ``auto`` turns it off).
    The softmax scale is the attention modules' own ``scaling`` when a model is
    given (``head_dim ** -0.5`` for the supported families).
    """
    cfg = _config(model_or_config)
    n_q = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_q
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    rope_type = params.get("rope_type", params.get("type", "default"))
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0
    rope = None
    if theta is not None and rope_type == "default":
        rope = RopeSpec(theta=float(theta), dim=int(head_dim * factor))
    elif theta is not None:
        log.warning("rope_type %r is not modelled by RopeSpec: spec.rope is None", rope_type)
    scale = None
    if hasattr(model_or_config, "config"):
        mods = _attention_modules(model_or_config)
        scale = getattr(mods[0], "scaling", None) if mods else None
    return AttentionSpec(n_layers=cfg.num_hidden_layers, n_q_heads=n_q, n_kv_heads=n_kv, head_dim=head_dim,
                         scale=float(scale) if scale is not None else None, rope=rope)


def _as_policy(policy: Any, spec: AttentionSpec) -> Policy:
    """A ``Policy`` instance from a policy or a ``*PolicyConfig``."""
    if isinstance(policy, Policy):
        s = policy.spec
        if (s.n_layers, s.n_q_heads, s.n_kv_heads, s.head_dim) != (spec.n_layers, spec.n_q_heads,
                                                                    spec.n_kv_heads, spec.head_dim):
            raise ModelError(f"policy was built for {s}, but the model has {spec}")
        return policy
    return build_policy(policy, spec)


# --------------------------------------------------------------------------- the attention hook
@dataclass
class _Binding:
    """What the hook of one model reads when no ``spade_ctx`` keyword is given.

    Shared by the model's attention modules (one object per model, set as the
    ``_spade_binding`` attribute of each); ``apply`` / ``attach`` install it.
    """

    spec: AttentionSpec
    policy: Policy | None = None
    """``apply`` mode: a fresh InlineSelector context per prompt."""
    ctx: AttentionContext | None = None
    """The context in use (attached, or created at the last prompt)."""
    fixed: bool = False
    """True when ``ctx`` was attached explicitly (never replaced)."""
    track_stats: bool = True

    def step(self, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
             prefill: bool) -> AttentionContext | None:
        """Layer 0 of a forward: start a step (and a new context at a prompt)."""
        if prefill and not self.fixed:
            if self.policy is None:
                self.ctx = None
            else:
                state = self.policy.new_state(query.shape[0], query.device)
                self.ctx = AttentionContext(self.spec, InlineSelector(self.policy, state), device=query.device,
                                            track_stats=self.track_stats)
        if self.ctx is None:
            return None
        if prefill:
            self.ctx.kv_start = _kv_start_from_mask(attention_mask, query.shape[0])
        self.ctx.begin_step(key.shape[2])
        return self.ctx


def _kv_start_from_mask(mask: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """First attended position of each row from a 4D boolean prompt mask
    ``[B|1, 1, Tq, Tk]`` (its last query row: causal, so it sees the whole
    prompt); None when no row is padded. One host sync, once per prompt."""
    if mask is None:
        return None
    if mask.dtype != torch.bool:  # additive float mask
        mask = mask == 0
    last = mask[:, 0, -1]  # [B|1, Tk]
    start = last.to(torch.int32).argmax(-1).to(torch.int32).expand(batch).contiguous()  # [B]
    return None if not bool(start.any()) else start


def _is_prefill(query: torch.Tensor, key: torch.Tensor) -> bool:
    """A prompt pass: several query tokens, or the cache held nothing before."""
    return query.shape[2] > 1 or key.shape[2] == query.shape[2]


def spade_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function ``"spade"``.

    ``query`` [B, Hq, Tq, D] (post-RoPE), ``key``/``value`` [B, Hkv, Tk, D] (the
    whole cache after this step's update). Returns ``([B, Tq, Hq, D], None)``
    like transformers' own implementations.

    Keywords read (and not passed on): ``spade_ctx`` (an ``AttentionContext``
    the caller drives) and ``spade_forced`` (an object with
    ``attention(layer, query, key, value, scale) -> [B, Hq, Tq, D]``, used by
    ``spade.eval.teacher`` to run a whole sequence with per-position sparse masks).
    """
    ctx = kwargs.pop("spade_ctx", None)
    forced = kwargs.pop("spade_forced", None)
    layer = module.layer_idx
    if forced is not None:
        _check_full_attention(kwargs)
        out = forced.attention(layer, query, key, value, scaling)  # [B, Hq, Tq, D]
        return out.transpose(1, 2).contiguous(), None
    prefill = _is_prefill(query, key)
    if ctx is None:
        binding: _Binding | None = getattr(module, "_spade_binding", None)
        if binding is not None:
            ctx = binding.step(query, key, attention_mask, prefill) if layer == 0 else binding.ctx
    if ctx is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    _check_full_attention(kwargs)
    B, Hq, Tq, D = query.shape
    kv_lens = torch.full((B,), key.shape[2], dtype=torch.int32, device=query.device)  # DynamicCache: all rows full
    if prefill:
        if key.shape[2] != Tq:
            raise NotImplementedError(
                "spade attention: a multi-token step on a non-empty cache (chunked prefill, speculative "
                "decoding) is not supported; prefill the whole prompt at once, then decode token by token"
            )
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                        dropout=dropout, **kwargs)
        ctx.prefill(layer, query, key, value, kv_lens)
        return out, None
    out = ctx.attend(layer, query[:, :, 0], key, value, kv_lens)  # [B, Hq, D]
    return out.unsqueeze(1), None


@functools.lru_cache(maxsize=None)
def _cache_kwarg_of(fn) -> str:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg(method) -> str:
    """The name under which this transformers version's decoder (or decoder layer) takes
    its KV cache: ``cache`` where it has one (newer versions warn on the older name),
    else ``past_key_values``."""
    return _cache_kwarg_of(getattr(method, "__func__", method))


def _check_full_attention(kwargs: dict) -> None:
    if kwargs.get("sliding_window") is not None:
        raise ModelError("spade attention: sliding-window layers are not supported")


AttentionInterface.register(IMPL, spade_attention)
AttentionMaskInterface.register(IMPL, sdpa_mask)


# --------------------------------------------------------------------------- public API
def _set_impl(model, impl: str) -> None:
    model.set_attn_implementation(impl)
    if model.config._attn_implementation != impl:  # models that cannot switch dynamically
        raise ModelError(f"{type(model).__name__} cannot switch its attention implementation to {impl!r}")


def _install(model, binding: _Binding | None) -> None:
    for m in _attention_modules(model):
        if binding is None:
            m.__dict__.pop("_spade_binding", None)
        else:
            m._spade_binding = binding


def _binding(model) -> _Binding | None:
    mods = _attention_modules(model)
    return getattr(mods[0], "_spade_binding", None) if mods else None


def apply(model, policy: Any = None, *, track_stats: bool = True):
    """Switch ``model`` to spade attention under ``policy`` (a ``Policy`` or a
    ``*PolicyConfig``; None: attention stays dense) and return it.

    Every later prompt forward (``model(...)``, ``model.generate(...)``) starts a
    fresh policy state; decode steps then attend what the policy selects.
    ``last_context(model)`` gives the last generation's ``AttentionContext``
    (its statistics). Undo with :func:`remove`.
    """
    check_supported(model)
    spec = attention_spec(model)
    pol = _as_policy(policy, spec) if policy is not None else None
    _set_impl(model, IMPL)
    _install(model, _Binding(spec, policy=pol, track_stats=track_stats))
    return model


def remove(model, impl: str = "sdpa"):
    """Undo :func:`apply`: drop the binding and switch back to ``impl``."""
    _install(model, None)
    _set_impl(model, impl)
    return model


def last_context(model) -> AttentionContext | None:
    """The ``AttentionContext`` of the model's last prompt under :func:`apply`/:func:`attach`."""
    b = _binding(model)
    return b.ctx if b is not None else None


@contextlib.contextmanager
def use_spade_attention(model) -> Iterator[Any]:
    """Temporarily switch ``model`` to the ``"spade"`` implementation (restored on exit)."""
    prev = model.config._attn_implementation
    if prev != IMPL:
        check_supported(model)
        _set_impl(model, IMPL)
    try:
        yield model
    finally:
        if prev != IMPL:
            _set_impl(model, prev)


@contextlib.contextmanager
def attach(model, ctx: AttentionContext) -> Iterator[AttentionContext]:
    """Run the model's forwards (and ``generate``) under ``ctx`` for the duration.

    The hook drives ``ctx``: at layer 0 of a prompt forward it sets
    ``ctx.kv_start`` from the padding mask, and at layer 0 of every forward it
    calls ``ctx.begin_step(cache length)``. One attached context serves one
    generation (its policy state is not reset between prompts). The previous
    binding and attention implementation are restored on exit.
    """
    prev = _binding(model)
    with use_spade_attention(model):
        _install(model, _Binding(ctx.spec, ctx=ctx, fixed=True))
        try:
            yield ctx
        finally:
            _install(model, prev)


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, policy: Any = None,
             max_new_tokens: int = 32, *, return_context: bool = False, **generate_kwargs):
    """Greedy ``model.generate`` under ``policy`` (a ``Policy`` or a ``*PolicyConfig``).

    ``input_ids`` [B, T] left-padded with ``attention_mask`` [B, T]. Returns the
    sequences [B, T + n] (prompt included, as ``model.generate``), and the
    generation's ``AttentionContext`` too when ``return_context``. The model's
    attention implementation and binding are restored afterwards.
    """
    spec = attention_spec(model)
    pol = _as_policy(policy if policy is not None else _full_config(), spec)
    state = pol.new_state(input_ids.shape[0], input_ids.device)
    ctx = AttentionContext(spec, InlineSelector(pol, state), device=input_ids.device)
    kw = dict(do_sample=False, max_new_tokens=max_new_tokens)
    pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        eos = model.generation_config.eos_token_id
        kw["pad_token_id"] = eos[0] if isinstance(eos, (list, tuple)) else eos
    kw.update(generate_kwargs)
    with attach(model, ctx):
        out = model.generate(input_ids, attention_mask=attention_mask, **kw)
    return (out, ctx) if return_context else out


def _full_config():
    from spade.policies.full import FullPolicyConfig

    return FullPolicyConfig()


# --------------------------------------------------------------------------- loading
def load_pretrained(path_or_name: str | Path, *, device: torch.device | str = "cpu",
                    dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) from a Hugging Face folder, a folder or file
    holding one GGUF, or a registered offline model name (``spade models``).

    ``dtype`` defaults to float32 on CPU and bfloat16 on CUDA.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    p = Path(path_or_name).expanduser()
    kw: dict[str, Any] = {}
    if p.is_file() and p.suffix == ".gguf":
        p, kw = p.parent, {"gguf_file": p.name}
    elif p.is_dir() and not (p / "config.json").is_file():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelError(f"{p}: expected a Hugging Face folder (config.json) or exactly one .gguf file; "
                             f"found {len(ggufs)} .gguf files")
        kw = {"gguf_file": ggufs[0].name}
    elif not p.exists():
        from spade.models.registry import resolve_model

        p = Path(resolve_model(str(path_or_name)))
    try:
        tok = AutoTokenizer.from_pretrained(str(p), **kw)
        model = AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype, **kw)
    except ImportError as e:  # gguf / accelerate missing
        raise ModelError(f"loading {p} needs an optional package: {e}") from None
    model = model.to(device).eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return model, tok


# --------------------------------------------------------------------------- decode backend
@dataclass
class HFSnapshot:
    """Where an ``HFBackend`` stood after a prefill (or any step): its KV cache
    object, the sequence length and the next RoPE position per row.

    Decoding only appends to the cache, so restoring crops the same cache back
    to ``seq_len``: one dense prompt pass can serve many decode runs (one per
    policy). A later ``prefill`` builds a new cache and leaves this one intact.
    """

    cache: Any
    seq_len: int
    next_pos: torch.Tensor  # [B, 1]
    last_logits: torch.Tensor  # [B, V]


class HFBackend(DecodeBackend):
    """``DecodeBackend`` over a transformers model (any supported family, any device).

    Prefill runs the model's own forward (dense sdpa, then ``ctx.prefill`` per
    layer). A decode step runs the decoder layers one by one in this class
    (embedding, RoPE tables, layers, final norm, ``lm_head`` on the new token),
    so ``decode_stages`` yields after every pack of ``pack_layers`` layers with
    their ``ctx.attend`` calls done; the layers themselves are the model's
    modules, unchanged. The KV cache is transformers' ``DynamicCache`` (it grows
    by concatenation: fine for CPU and correctness work, the ``fast`` backend is
    the one for speed).

    >>> be = HFBackend.from_pretrained("smollm2-135m")           # doctest: +SKIP
    >>> logits = be.prefill(ids, mask, ctx); logits = be.decode(next_tok, ctx)
    """

    kind = "hf"

    def __init__(self, model, tokenizer=None, device: torch.device | str | None = None):
        check_supported(model)
        if model.config.model_type not in SUPPORTED_MODEL_TYPES:
            log.warning("model type %r is untested with spade's HF path (tested: %s)", model.config.model_type,
                        ", ".join(SUPPORTED_MODEL_TYPES))
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.model = model.to(self.device).eval()
        _set_impl(self.model, IMPL)
        self.dtype = param.dtype
        self.spec = attention_spec(model)
        self.tokenizer = tokenizer
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.eos_token_ids = self._eos_ids(model, tokenizer)
        self._cache = None
        self._seq_len = 0
        self._next_pos: torch.Tensor | None = None  # [B, 1] RoPE position of the next token
        self.last_logits = torch.empty(0)

    @staticmethod
    def _eos_ids(model, tokenizer) -> list[int]:
        ids: list[int] = []
        for src in (getattr(model.generation_config, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                    getattr(tokenizer, "eos_token_id", None)):
            for i in (src if isinstance(src, (list, tuple)) else [src]):
                if i is not None and int(i) not in ids:
                    ids.append(int(i))
        return ids

    @classmethod
    def from_pretrained(cls, path_or_folder: str | Path, *, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> "HFBackend":
        """Load with :func:`load_pretrained` (HF folder, GGUF, or offline model name)."""
        model, tok = load_pretrained(path_or_folder, device=device, dtype=dtype)
        return cls(model, tok, device)

    def _ensure_impl(self) -> None:
        """The model may have been switched back to another implementation since
        (``spade.models.hf.remove``): the ``spade_ctx`` keyword only works under "spade"."""
        if self.model.config._attn_implementation != IMPL:
            _set_impl(self.model, IMPL)

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, ctx) -> torch.Tensor:
        from transformers import DynamicCache

        self._ensure_impl()
        input_ids = input_ids.to(self.device)
        B, T = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = attention_mask.to(self.device).long()
        start = mask.argmax(-1)  # first valid position per row
        valid = torch.arange(T, device=self.device)[None, :] >= start[:, None]
        if not bool((valid == mask.bool()).all()):
            raise ValueError("HFBackend.prefill: attention_mask must be left padding (0s, then only 1s per row)")
        ctx.kv_start = start.to(torch.int32) if bool(start.any()) else None
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]: RoPE positions count real tokens only
        self._cache = DynamicCache(config=self.model.config)
        ctx.begin_step(T)
        dec = _decoder(self.model)
        out = dec(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                  spade_ctx=ctx, **{cache_kwarg(dec.forward): self._cache})
        h = out.last_hidden_state[:, -1]  # [B, hidden]
        self._seq_len = T
        self._next_pos = position_ids[:, -1:] + 1  # [B, 1]
        self.last_logits = self.model.lm_head(h).float()  # [B, V]
        return self.last_logits

    def decode_stages(self, tokens: torch.Tensor, ctx, pack_layers: int) -> Iterator[int]:
        if self._cache is None:
            raise RuntimeError("HFBackend.decode before prefill")
        self._ensure_impl()
        dec = _decoder(self.model)
        layers = dec.layers
        n = len(layers)
        pack_layers = max(1, min(pack_layers, n))
        self._seq_len += 1
        ctx.begin_step(self._seq_len)
        pos = self._next_pos  # [B, 1]
        cache_kw = {cache_kwarg(layers[0].forward): self._cache}
        with torch.no_grad():
            h = dec.embed_tokens(tokens.to(self.device).view(-1, 1))  # [B, 1, hidden]
            pe = dec.rotary_emb(h, pos)  # (cos, sin) [B, 1, rot]
        for pack, first in enumerate(range(0, n, pack_layers)):
            with torch.no_grad():
                for layer in layers[first:first + pack_layers]:
                    # no mask: decode attention goes through ctx.attend, whose kv_start handles padding
                    h = layer(h, attention_mask=None, position_ids=pos, use_cache=True, position_embeddings=pe,
                              spade_ctx=ctx, **cache_kw)
                    h = h[0] if isinstance(h, tuple) else h
            yield pack
        with torch.no_grad():
            self.last_logits = self.model.lm_head(dec.norm(h)[:, -1]).float()  # [B, V]
        self._next_pos = pos + 1

    def snapshot(self) -> HFSnapshot:
        """The backend's position now (after ``prefill`` or ``decode``), for :meth:`restore`.

        >>> snap = be.snapshot(); be.decode(tok, ctx); be.restore(snap)   # doctest: +SKIP
        """
        if self._cache is None or self._next_pos is None:
            raise RuntimeError("HFBackend.snapshot before prefill")
        return HFSnapshot(cache=self._cache, seq_len=self._seq_len, next_pos=self._next_pos.clone(),
                          last_logits=self.last_logits.clone())

    def restore(self, snap: HFSnapshot) -> None:
        """Go back to ``snap``: drop the tokens appended since (the cache is cropped
        in place) and restore the length, next RoPE position and last logits. The
        policy state is not part of the backend: start a new context for the run."""
        extra = snap.cache.get_seq_length() - snap.seq_len
        if extra < 0:
            raise RuntimeError(f"HFBackend.restore: the cache holds {snap.cache.get_seq_length()} tokens, fewer "
                               f"than the snapshot's {snap.seq_len} (it was cropped or replaced)")
        if extra > 0:
            snap.cache.crop(-extra)  # DynamicCache.crop(-n) drops the last n tokens
        self._cache, self._seq_len = snap.cache, snap.seq_len
        self._next_pos = snap.next_pos.clone()
        self.last_logits = snap.last_logits.clone()

    def close(self) -> None:
        self._cache = None
        self._seq_len = 0
        self._next_pos = None

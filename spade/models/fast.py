"""spade's fast decode path: a static-cache decoder captured as CUDA graphs.

``FastModel`` runs Llama / Qwen2 / Qwen3-style decoders (RMSNorm, RoPE in the
``rotate_half`` layout, GQA, SwiGLU MLP, optional QK-RMSNorm, optional QKV
bias, tied or untied ``lm_head``) with

* a static KV cache: per layer ``k``/``v`` [max_batch, Hkv, max_seq_len, D]
  (the layout every spade kernel reads), left-padded, so that this step's token
  goes to the same index ``seq_len - 1`` in every row;
* step metadata on the device (``kv_lens``, RoPE positions, write index), bumped
  by one tiny kernel before each step: no host synchronisation in a step;
* fused Triton kernels for the elementwise work between GEMMs on CUDA
  (residual add + RMSNorm; QK-norm + RoPE + cache write; SiLU·mul), in decode
  steps and in the prompt pass, with plain torch references beside them that
  follow the transformers op order (used on CPU and in tests);
* the prompt pass in slices of ``prefill_chunk`` tokens per GEMM, attention on
  the fused SDPA kernels; a serving prompt in pieces attends its earlier pieces
  through ``spade.models.prompt_attention`` (no grouped-head copies);
* decode projections on the split-K Triton GEMV where a GPU sweep measured it
  faster than cuBLAS (``model.linear``); the gate/up GEMV then forms the SiLU
  product in its epilogue (``fuse_glu``: one launch per layer fewer, the same
  values as the GEMV followed by the SiLU·mul kernel);
* one CUDA graph per pack of ``pack_layers`` layers (embedding in the first,
  final norm and ``lm_head`` in the last), keyed by ``(pack_layers, B,
  ctx.graph_key())``, so the asynchronous runtime can post/await transport work
  between packs. On CPU the same code runs eagerly.

Every layer's decode attention is ``ctx.attend`` (``spade.attention``): the
model knows policies only through that call.

>>> from spade.models.fast import FastModel
>>> from spade.models.presets import preset_config
>>> m = FastModel.from_config(preset_config("tiny"), device="cpu", dtype=torch.float32,
...                           max_batch=2, max_seq_len=64)
>>> m.spec.n_layers, m.vocab_size
(3, 512)
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from spade.envs import env_choice
from spade.errors import ConfigError, ModelError
from spade.models.base import SUPPORTED_MODEL_TYPES, DecodeBackend
from spade.policies.base import AttentionSpec, RopeSpec
from spade.streams import indexed_device

log = logging.getLogger(__name__)

#: RoPE variants whose frequencies do not depend on the sequence length.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


# =============================================================================== architecture
@dataclass(frozen=True)
class FastArch:
    """The shape facts of a supported decoder, read from a transformers config."""

    model_type: str
    hidden: int
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    tie: bool
    rope_type: str
    rope_theta: float
    rotary_dim: int

    @classmethod
    def from_hf_config(cls, cfg) -> "FastArch":
        """Validate ``cfg`` and extract the shape; raise ``ModelError`` naming what
        the fast path does not support (the ``hf`` backend may still run it)."""
        mt = getattr(cfg, "model_type", None)
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ModelError(f"the fast backend supports model types {', '.join(SUPPORTED_MODEL_TYPES)}; "
                             f"got {mt!r} (use model.backend=hf)")
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ModelError(f"the fast backend needs a SiLU MLP; config has hidden_act={act!r}")
        if getattr(cfg, "mlp_bias", False):
            raise ModelError("the fast backend does not support MLP biases (config.mlp_bias=True)")
        layer_types = getattr(cfg, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types) or (
                mt == "mistral" and getattr(cfg, "sliding_window", None) is not None):
            raise ModelError("the fast backend does not support sliding-window layers "
                             f"(layer_types={sorted(set(layer_types))}); use model.backend=hf")
        n_q = int(cfg.num_attention_heads)
        n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_q)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q)
        rp = getattr(cfg, "rope_parameters", None)
        if rp is None:  # older configs: rope_theta / rope_scaling attributes
            rp = dict(getattr(cfg, "rope_scaling", None) or {})
            rp.setdefault("rope_type", rp.get("type", "default"))
            rp.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        if "rope_type" not in rp:
            raise ModelError(f"the fast backend needs one RoPE setting for all layers; got {rp!r}")
        rope_type = rp["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelError(f"the fast backend supports RoPE types {', '.join(SUPPORTED_ROPE_TYPES)}; "
                             f"config has rope_type={rope_type!r} (length-dependent frequencies)")
        rot = int(head_dim * float(rp.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))))
        if rot % 2 or rot <= 0 or rot > head_dim:
            raise ModelError(f"unsupported rotary dimension {rot} for head_dim {head_dim}")
        if n_q % n_kv:
            raise ModelError(f"num_attention_heads ({n_q}) must be a multiple of num_key_value_heads ({n_kv})")
        if mt == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(getattr(cfg, "attention_bias", False))
        return cls(
            model_type=mt, hidden=int(cfg.hidden_size), n_layers=int(cfg.num_hidden_layers), n_q_heads=n_q,
            n_kv_heads=n_kv, head_dim=head_dim, intermediate=int(cfg.intermediate_size),
            vocab=int(cfg.vocab_size), eps=float(cfg.rms_norm_eps), qk_norm=(mt == "qwen3"),
            qkv_bias=qkv_bias, o_bias=o_bias, tie=bool(getattr(cfg, "tie_word_embeddings", False)),
            rope_type=rope_type, rope_theta=float(rp["rope_theta"]), rotary_dim=rot,
        )

    @property
    def qkv_out(self) -> int:
        return (self.n_q_heads + 2 * self.n_kv_heads) * self.head_dim

    def n_params(self) -> int:
        """Parameter count (a tied head counts once), without building anything."""
        H, D = self.hidden, self.head_dim
        per_layer = (2 * H + self.qkv_out * H + self.n_q_heads * D * H + 3 * H * self.intermediate
                     + (self.qkv_out if self.qkv_bias else 0) + (H if self.o_bias else 0)
                     + (2 * D if self.qk_norm else 0))
        return self.n_layers * per_layer + H + self.vocab * H * (1 if self.tie else 2)


def rope_inv_freq(cfg, arch: FastArch) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim/2] float32, attention_scaling), computed exactly as
    transformers computes it for this config (so llama3 / yarn scaling match)."""
    if arch.rope_type == "default":
        d = arch.rotary_dim
        inv = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, scaling = ROPE_INIT_FUNCTIONS[arch.rope_type](cfg, "cpu")
    return inv.float().cpu(), float(scaling)


# =============================================================================== weights
@dataclass
class LayerWeights:
    """One decoder layer, projections fused for fewer, larger GEMMs."""

    ln1: torch.Tensor  # [H]
    wqkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]: q rows, then k rows, then v rows
    bqkv: torch.Tensor | None  # [(Hq + 2 Hkv) D]
    q_norm: torch.Tensor | None  # [D]
    k_norm: torch.Tensor | None  # [D]
    wo: torch.Tensor  # [H, Hq D]
    bo: torch.Tensor | None  # [H]
    ln2: torch.Tensor  # [H]
    wgu: torch.Tensor  # [2 I, H]: gate rows, then up rows
    wd: torch.Tensor  # [H, I]


def _hf_names(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return {
        "ln1": p + "input_layernorm.weight", "ln2": p + "post_attention_layernorm.weight",
        "q": p + "self_attn.q_proj.weight", "k": p + "self_attn.k_proj.weight", "v": p + "self_attn.v_proj.weight",
        "o": p + "self_attn.o_proj.weight", "bq": p + "self_attn.q_proj.bias", "bk": p + "self_attn.k_proj.bias",
        "bv": p + "self_attn.v_proj.bias", "bo": p + "self_attn.o_proj.bias",
        "qn": p + "self_attn.q_norm.weight", "kn": p + "self_attn.k_norm.weight",
        "gate": p + "mlp.gate_proj.weight", "up": p + "mlp.up_proj.weight", "down": p + "mlp.down_proj.weight",
    }


# =============================================================================== elementwise ops
# Plain-torch versions follow transformers' op order and rounding (RMSNorm in
# float32, cast back, then the weight multiply in the model dtype; RoPE with cos/sin
# cast to the model dtype), so on CPU in float32 the fast path matches the HF model
# to rounding noise. The Triton versions (spade.kernels.elementwise) compute the
# same formulas with one rounding per stored value.

def rms_norm_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (transformers' LlamaRMSNorm arithmetic)."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [..., D]; ``cos``/``sin`` [..., rot] broadcastable, already in x's dtype.
    Dims past ``rot`` pass through (partial rotary)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    xr, xp = x[..., :rot], x[..., rot:]
    return torch.cat((xr * cos + rotate_half(xr) * sin, xp), dim=-1)


def add_rms_norm_torch(x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += delta`` in place (the residual add, in x's dtype), then RMSNorm(x).
    ``x``/``delta`` [B, H]; returns [B, H]."""
    if delta is not None:
        x.add_(delta)
    return rms_norm_torch(x, w, eps)


def qkv_rope_store_torch(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                         cos_tab: torch.Tensor, sin_tab: torch.Tensor, pos: torch.Tensor, widx: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, n_q: int, n_kv: int,
                         q_out: torch.Tensor | None = None) -> torch.Tensor:
    """Split the fused projection ``qkv`` [B, (Hq + 2 Hkv) D], QK-norm (if given) and
    rotate q and k at positions ``pos`` [B], write k and v into the caches
    [B, Hkv, L, D] at index ``widx`` [1]; returns q [B, Hq, D] (written into ``q_out``
    and returned as it, when given)."""
    B = qkv.shape[0]
    D = k_cache.shape[-1]
    q, k, v = qkv.split([n_q * D, n_kv * D, n_kv * D], dim=-1)
    q, k, v = q.view(B, n_q, D), k.view(B, n_kv, D), v.view(B, n_kv, D)
    if q_norm is not None:
        q, k = rms_norm_torch(q, q_norm, eps), rms_norm_torch(k, k_norm, eps)
    cos = cos_tab[pos].to(qkv.dtype)[:, None, :]  # [B, 1, rot]
    sin = sin_tab[pos].to(qkv.dtype)[:, None, :]
    q, k = apply_rope_torch(q, cos, sin), apply_rope_torch(k, cos, sin)
    k_cache.index_copy_(2, widx, k[:, :, None, :].to(k_cache.dtype))
    v_cache.index_copy_(2, widx, v[:, :, None, :].to(v_cache.dtype))
    if q_out is not None:
        return q_out.copy_(q)
    return q


def silu_mul_torch(gu: torch.Tensor) -> torch.Tensor:
    """``gu`` [B, 2I] (gate then up) -> silu(gate) * up [B, I]."""
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


_TRITON_OPS: dict[str, Callable] | None = None

LINEAR_MODES = ("auto", "cublas", "triton")
"""``FastModel(linear=...)``: the decode projections' kernel (``spade.kernels.gemv.make_linear``)."""


def _make_linear(mode: str, M: int, w: torch.Tensor) -> Callable:
    """``spade.kernels.gemv.make_linear``, imported on first use (importing this module
    never imports triton). ``"cublas"`` needs no Triton at all."""
    if mode == "cublas":
        return F.linear
    from spade.kernels.gemv import make_linear

    return make_linear(mode, M, w)


def fuse_glu_default() -> bool:
    """``FastModel.fuse_glu``'s default: ``SPADE_FUSE_GLU`` = on (default) | off."""
    return env_choice("SPADE_FUSE_GLU", error=ConfigError) == "on"


def triton_ops() -> dict[str, Callable]:
    """The Triton versions of the three elementwise ops (``spade.kernels.elementwise``),
    imported on first use (so that importing this module never imports triton, and
    ``TRITON_INTERPRET`` set by a test harness before the first call is honoured)."""
    global _TRITON_OPS
    if _TRITON_OPS is not None:
        return _TRITON_OPS
    from spade.kernels.elementwise import add_rms_norm_triton, qkv_rope_store_triton, silu_mul_triton

    _TRITON_OPS = {"add_rms_norm": add_rms_norm_triton, "qkv_rope_store": qkv_rope_store_triton,
                   "silu_mul": silu_mul_triton}
    return _TRITON_OPS


_TORCH_OPS: dict[str, Callable] = {"add_rms_norm": add_rms_norm_torch, "qkv_rope_store": qkv_rope_store_torch,
                                   "silu_mul": silu_mul_torch}


# =============================================================================== the model
def _resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    except KeyError:
        raise ConfigError(f"model.dtype: unknown dtype {dtype!r}") from None


def _eos_ids(*sources: Any) -> list[int]:
    ids: list[int] = []
    for src in sources:
        for i in (src if isinstance(src, (list, tuple)) else [src]):
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


class FastModel(DecodeBackend):
    """Static-cache decoder with CUDA-graph decode steps (see the module docstring).

    Build it with ``from_hf_folder``, ``from_hf_model`` or ``from_config`` (random
    weights). ``max_batch`` and ``max_seq_len`` size the static KV cache; a prompt
    batch may use fewer rows. ``use_cuda_graphs`` (CUDA only) may be toggled
    between generations. ``fused_kernels`` picks the Triton elementwise kernels
    (default: on CUDA) or the torch references. ``fuse_glu`` (default: on, unless
    ``SPADE_FUSE_GLU=off``): where the gate/up projection runs on the Triton GEMV, its
    epilogue forms ``silu(gate) * up`` (``linear_glu_triton``: one launch per layer
    fewer, the same values as the two launches).

    ``last_logits`` / returned logits are fresh float32 [B, V] tensors.
    """

    kind = "fast"

    def __init__(self, hf_config, arch: FastArch, layers: list[LayerWeights], embed: torch.Tensor,
                 norm: torch.Tensor, lm_head: torch.Tensor, *, device: torch.device, dtype: torch.dtype,
                 max_batch: int, max_seq_len: int, tokenizer: Any = None, eos_token_ids: list[int] | None = None,
                 use_cuda_graphs: bool = True, fused_kernels: bool | None = None, prefill_chunk: int = 1024,
                 linear: str = "auto", fuse_glu: bool | None = None, block_size: int | None = None,
                 kv_blocks: int | None = None):
        if max_batch < 1 or max_seq_len < 2:
            raise ConfigError(f"max_batch ({max_batch}) must be >= 1 and max_seq_len ({max_seq_len}) >= 2")
        self.hf_config = hf_config
        self.arch = arch
        self.device = indexed_device(device)
        self.dtype = dtype
        self.layers = layers
        self.embed = embed  # [V, H]
        self.norm = norm  # [H]
        self.lm_head = lm_head  # [V, H] (the embedding itself when tied)
        self.max_batch = int(max_batch)
        self.max_seq_len = int(max_seq_len)
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids or [])
        self.vocab_size = arch.vocab
        self.use_cuda_graphs = bool(use_cuda_graphs)
        self.fused_kernels = (device.type == "cuda") if fused_kernels is None else bool(fused_kernels)
        self.prefill_chunk = int(prefill_chunk)
        self._linears: dict[tuple, Callable] = {}
        self.linear = linear
        self.fuse_glu = fuse_glu_default() if fuse_glu is None else bool(fuse_glu)

        inv_freq, scaling = rope_inv_freq(hf_config, arch)
        self.rope_scaling = scaling
        rope = (RopeSpec(theta=arch.rope_theta, dim=arch.rotary_dim, attention_scaling=scaling)
                if arch.rope_type == "default" else None)  # RopeSpec cannot express scaled frequencies
        self.spec = AttentionSpec(n_layers=arch.n_layers, n_q_heads=arch.n_q_heads, n_kv_heads=arch.n_kv_heads,
                                  head_dim=arch.head_dim, scale=arch.head_dim ** -0.5, rope=rope)
        # RoPE tables [max_seq_len, rot] float32: transformers' float32 frequencies,
        # angles in float64 (exact at 100k+ positions).
        ang = torch.arange(self.max_seq_len, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]
        emb = torch.cat([ang, ang], dim=-1)
        self.cos_tab = (emb.cos() * scaling).float().to(device).contiguous()
        self.sin_tab = (emb.sin() * scaling).float().to(device).contiguous()

        B, Hkv, L, D = self.max_batch, arch.n_kv_heads, self.max_seq_len, arch.head_dim
        self.block_size = None if block_size is None else int(block_size)
        self.blocks = None  # spade.kvcache.RowBlocks (paged): the pool, the table, each row's blocks
        self.kv_pool = None  # = blocks.pool
        self.table = None  # = blocks.table
        if self.block_size is None:
            if kv_blocks is not None:
                raise ConfigError(f"model.kv_blocks ({kv_blocks}) needs a paged cache: set model.block_size too")
            shape = (B, Hkv, L, D)
        else:  # paged (spade.kvcache): per layer a pool of blocks, one table for every layer
            if self.block_size < 1:
                raise ConfigError(f"model.block_size must be >= 1 (tokens per KV block); got {block_size}")
            from spade.kvcache import RowBlocks, blocks_for

            max_blocks = blocks_for(L, self.block_size)
            nb = B * max_blocks + 1 if kv_blocks is None else int(kv_blocks)
            if nb < 2:
                raise ConfigError(f"model.kv_blocks must be >= 2 (block 0 is the null block); got {kv_blocks}")
            self.blocks = RowBlocks(nb, self.block_size, B, max_blocks, device)
            self.kv_pool, self.table = self.blocks.pool, self.blocks.table
            shape = (nb, Hkv, self.block_size, D)
        # Zeroed, not empty: reference attention multiplies masked probabilities (0) by
        # values, and 0 * NaN garbage would poison the output.
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.n_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.n_layers)]
        # Step metadata, one tensor so that one kernel advances it: row 0 kv_lens,
        # row 1 RoPE position of the current token, row 2 (first entry) write index.
        self._meta = torch.zeros(3, B, dtype=torch.int64, device=device)
        self._tokens = torch.zeros(B, dtype=torch.int64, device=device)
        self._x = torch.zeros(B, arch.hidden, dtype=dtype, device=device)  # residual stream
        self._logits = torch.zeros(B, arch.vocab, dtype=torch.float32, device=device)
        self._batch = 0
        self._seq_len = 0
        self.last_logits = torch.empty(0)
        self._graphs: dict[tuple, list] = {}
        self._graph_ctx_id: int | None = None
        self._pool = None
        self._stream = None
        if device.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(device=device)

    # ------------------------------------------------------------------ properties
    @property
    def attention_spec(self) -> AttentionSpec:
        return self.spec

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def batch_size(self) -> int:
        """Rows of the current generation (set by ``prefill`` / ``fake_prefill``)."""
        return self._batch

    @property
    def kv_lens(self) -> torch.Tensor:
        """[B] int64 device view: valid cache length per row (same value in every row)."""
        return self._meta[0, : self._batch]

    @property
    def positions(self) -> torch.Tensor:
        """[B] int64 device view: RoPE position of the most recent token per row."""
        return self._meta[1, : self._batch]

    def _ops(self) -> dict[str, Callable]:
        return triton_ops() if self.fused_kernels else _TORCH_OPS

    def _bind(self, ctx, prefill: bool = False) -> None:
        """Tell the attention context about the cache's layout: the block table for decode
        steps (None while prefilling: the policies then get the prompt's keys,
        contiguous) and the logical capacity per row."""
        if ctx is None or not self.paged:
            return
        ctx.block_table = None if prefill else self.block_table
        ctx.cache_len = self.max_seq_len

    # ------------------------------------------------------------------ paged KV cache
    @property
    def paged(self) -> bool:
        return self.table is not None

    @property
    def block_table(self) -> torch.Tensor | None:
        """[B, max_blocks] int32 device view of the current rows' block table (paged), or None."""
        return None if self.table is None else self.table.tensor[: self._batch]

    def kv_blocks_free(self) -> int:
        """Free blocks of the paged cache's pool (0 for a contiguous cache)."""
        return 0 if self.kv_pool is None else self.kv_pool.num_free

    def kv_blocks_used(self) -> int:
        return 0 if self.kv_pool is None else self.kv_pool.num_used

    def kv_row_blocks(self, row: int) -> int:
        """Blocks row ``row`` holds (paged)."""
        return 0 if self.blocks is None else self.blocks.held(row)

    def kv_map(self, row: int, lo: int, hi: int) -> None:
        """Paged: give row ``row`` blocks for its logical positions ``[lo, hi)`` (those it
        lacks; all or none: ``spade.kvcache.OutOfBlocks`` takes nothing). Positions of
        the row no block covers read and write the null block. The device table follows
        at the next step (or ``sync_table``)."""
        if self.blocks is None or hi <= lo:
            return
        if hi > self.blocks.capacity_tokens:
            raise ConfigError(f"row {row}: position {hi - 1} is past the cache's {self.max_seq_len} tokens "
                              "(raise model.max_seq_len)")
        self.blocks.map(row, lo, hi)

    def kv_free(self, row: int) -> None:
        """Paged: free every block of row ``row`` at once; its table row points at the null block."""
        if self.blocks is not None:
            self.blocks.free(row)

    def sync_table(self) -> None:
        """Copy the host block table to the device if a row changed (between steps)."""
        if self.blocks is not None:
            self.blocks.sync()

    def _grow_rows(self, pos: int) -> None:
        """Paged decode: every row holding blocks gets the block of position ``pos`` (the
        step's write) when it enters a new block."""
        from spade.kvcache import OutOfBlocks

        try:
            self.blocks.grow(pos)
        except OutOfBlocks as e:
            raise ModelError(f"out of KV blocks: {e.requested} rows need a block at position {pos}, "
                             f"{e.free} free of {e.num_blocks} (raise model.kv_blocks)") from None

    def _paged_store(self, li: int, rows: torch.Tensor | slice, k: torch.Tensor, v: torch.Tensor,
                     start: torch.Tensor | int) -> None:
        """Write k/v [n, Hkv, T, D] of the table's rows ``rows`` at logical ``start``."""
        from spade.kernels.paged import paged_write

        self.sync_table()
        table = self.table.tensor[rows]
        paged_write(self.k_cache[li], table, k, start)
        paged_write(self.v_cache[li], table, v, start)

    def _paged_row(self, li: int, row: int, lo: int, hi: int, cap: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``row``'s cache positions ``[lo, hi)`` as [1, Hkv, (cap or hi) - lo, D] copies
        (positions past ``hi`` zero; with ``cap``, a view of a buffer of
        ``prompt_attention.plan_capacity`` positions: cuDNN plans are keyed by strides too)."""
        from spade.kernels.paged import paged_range
        from spade.models.prompt_attention import plan_capacity

        self.sync_table()
        table = self.table.tensor[row]
        out = []
        for pool in (self.k_cache[li], self.v_cache[li]):
            x = paged_range(pool, table, lo, hi)
            if cap is not None and cap > hi:  # room for positions [hi, cap), in a buffer of bounded strides
                buf = x.new_zeros(1, x.shape[1], plan_capacity(cap - lo), x.shape[3])
                buf[:, :, :hi - lo] = x
                x = buf[:, :, :cap - lo]
            out.append(x)
        return out[0], out[1]

    @property
    def linear(self) -> str:
        """Kernel choice of the decode projections (``LINEAR_MODES``); may be changed between
        steps (graphs are keyed by it)."""
        return self._linear

    @linear.setter
    def linear(self, mode: str) -> None:
        if mode not in LINEAR_MODES:
            raise ConfigError(f"model.linear must be one of {', '.join(LINEAR_MODES)}, got {mode!r} "
                              "(auto: the Triton GEMV where a GPU sweep measured it faster, else cuBLAS)")
        self._linear = mode
        self._linears.clear()

    def _lin(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """A decode projection ``x @ w.T + b`` through the kernel ``self.linear`` picks for
        the shape (``spade.kernels.gemv.make_linear``: the Triton split-K GEMV where a sweep
        measured it faster than cuBLAS, cuBLAS elsewhere), chosen once per shape."""
        key = (x.shape[0], w.shape[0], w.shape[1], w.device)
        f = self._linears.get(key)
        if f is None:
            f = self._linears[key] = _make_linear(self._linear, x.shape[0], w)
        return f(x, w, b)

    def _glu(self, h: torch.Tensor, w: torch.Tensor, silu_mul: Callable) -> torch.Tensor:
        """``silu(gate) * up`` of ``h @ w.T`` (``w`` the stacked gate/up weight): one fused
        launch where the projection runs on the Triton GEMV and ``fuse_glu`` is on
        (``linear_glu_triton``), else the projection then ``silu_mul``."""
        key = ("glu", h.shape[0], w.shape[0], w.shape[1], w.device, self.fuse_glu)
        f = self._linears.get(key)
        if f is None:  # the GLU fuses where the projection itself runs on the Triton GEMV
            f = False
            if self.fuse_glu and _make_linear(self._linear, h.shape[0], w) is not F.linear:
                from spade.kernels.gemv import linear_glu_triton

                f = linear_glu_triton
            self._linears[key] = f
        if f is False:
            return silu_mul(self._lin(h, w))
        return f(h, w)

    def linear_kernels(self, batch: int | None = None) -> dict[str, str]:
        """Which kernel each decode projection uses at ``batch`` rows (``"triton"`` or
        ``"cublas"``): what a benchmark reports next to its timings."""
        B = self.max_batch if batch is None else int(batch)
        L = self.layers[0]
        ws = {"qkv": L.wqkv, "o": L.wo, "gate_up": L.wgu, "down": L.wd, "lm_head": self.lm_head}
        return {k: ("cublas" if _make_linear(self.linear, B, w) is F.linear else "triton") for k, w in ws.items()}

    def weight_bytes(self) -> int:
        """Bytes of parameters one decode step reads (all layers, final norm, lm_head;
        the embedding rows read are negligible, a tied head counts once)."""
        n = sum(t.numel() * t.element_size() for L in self.layers for t in vars(L).values() if t is not None)
        return n + self.norm.numel() * self.norm.element_size() + self.lm_head.numel() * self.lm_head.element_size()

    def kv_bytes(self, tokens: int, batch: int | None = None) -> int:
        """Bytes of K and V read when every layer attends ``tokens`` tokens per row."""
        b = self._batch if batch is None else batch
        a = self.arch
        return 2 * a.n_layers * b * a.n_kv_heads * tokens * a.head_dim * self.k_cache[0].element_size()

    # ------------------------------------------------------------------ constructors
    @classmethod
    def _build(cls, hf_config, get: Callable[[str], torch.Tensor | None], *, device, dtype, max_batch: int,
               max_seq_len: int, **kw) -> "FastModel":
        """Assemble from a name -> tensor getter (transformers parameter names)."""
        device = torch.device(device)
        dtype = _resolve_dtype(dtype, device)
        arch = FastArch.from_hf_config(hf_config)

        def need(name: str) -> torch.Tensor:
            t = get(name)
            if t is None:
                raise ModelError(f"checkpoint has no tensor {name!r} (model type {arch.model_type})")
            return t.to(device=device, dtype=dtype)

        def opt(name: str) -> torch.Tensor | None:
            t = get(name)
            return None if t is None else t.to(device=device, dtype=dtype)

        layers = []
        for i in range(arch.n_layers):
            n = _hf_names(i)
            bq, bk, bv = opt(n["bq"]), opt(n["bk"]), opt(n["bv"])
            if arch.qkv_bias and bq is None:
                raise ModelError(f"checkpoint has no tensor {n['bq']!r} although the config asks for QKV bias")
            layers.append(LayerWeights(
                ln1=need(n["ln1"]), ln2=need(n["ln2"]),
                wqkv=torch.cat([need(n["q"]), need(n["k"]), need(n["v"])], 0).contiguous(),
                bqkv=torch.cat([bq, bk, bv], 0).contiguous() if bq is not None else None,
                q_norm=need(n["qn"]) if arch.qk_norm else None, k_norm=need(n["kn"]) if arch.qk_norm else None,
                wo=need(n["o"]).contiguous(), bo=opt(n["bo"]),
                wgu=torch.cat([need(n["gate"]), need(n["up"])], 0).contiguous(), wd=need(n["down"]).contiguous(),
            ))
            exp = (arch.qkv_out, arch.hidden)
            if tuple(layers[-1].wqkv.shape) != exp:
                raise ModelError(f"layer {i}: fused qkv weight {tuple(layers[-1].wqkv.shape)} != expected {exp}")
        embed = need("model.embed_tokens.weight")
        head = get("lm_head.weight")
        lm_head = embed if (arch.tie or head is None) else head.to(device=device, dtype=dtype)
        return cls(hf_config, arch, layers, embed, need("model.norm.weight"), lm_head, device=device, dtype=dtype,
                   max_batch=max_batch, max_seq_len=max_seq_len, **kw)

    @classmethod
    def from_hf_model(cls, model, *, device=None, dtype=None, max_batch: int = 1, max_seq_len: int = 4096,
                      tokenizer: Any = None, **kw) -> "FastModel":
        """Take the weights of a loaded transformers ``*ForCausalLM`` (norms and the
        embedding may share storage with it when device and dtype already match)."""
        param = next(model.parameters())
        device = torch.device(device) if device is not None else param.device
        dtype = dtype if dtype is not None else param.dtype
        sd = {k: v.detach() for k, v in model.state_dict().items()}
        gen = getattr(model, "generation_config", None)
        kw.setdefault("eos_token_ids", _eos_ids(getattr(gen, "eos_token_id", None), model.config.eos_token_id,
                                                getattr(tokenizer, "eos_token_id", None)))
        with torch.no_grad():
            return cls._build(model.config, sd.get, device=device, dtype=dtype, max_batch=max_batch,
                              max_seq_len=max_seq_len, tokenizer=tokenizer, **kw)

    @classmethod
    def from_hf_folder(cls, path: str | Path, *, device="cpu", dtype=None, max_batch: int = 1,
                       max_seq_len: int = 4096, tokenizer: Any = "auto", **kw) -> "FastModel":
        """Load ``config.json`` + ``*.safetensors`` of a Hugging Face folder (tensor by
        tensor, straight to ``device``). A folder holding one ``.gguf`` instead is
        loaded through transformers on the CPU and converted. ``tokenizer="auto"``
        loads the folder's tokenizer (left padding) when it has one."""
        from transformers import AutoConfig

        p = Path(path).expanduser()
        ggufs = sorted(p.glob("*.gguf")) if p.is_dir() else []
        if p.is_dir() and not (p / "config.json").is_file() and len(ggufs) == 1:
            return cls._from_gguf(p, ggufs[0].name, device=device, dtype=dtype, max_batch=max_batch,
                                  max_seq_len=max_seq_len, tokenizer=tokenizer, **kw)
        if not (p / "config.json").is_file():
            raise ModelError(f"{p}: not a Hugging Face folder (no config.json)")
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise ModelError(f"{p}: no *.safetensors weights (the fast backend reads safetensors only)")
        from safetensors import safe_open

        cfg = AutoConfig.from_pretrained(str(p))
        handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        where: dict[str, Any] = {}
        for h in handles:
            for name in h.keys():
                where[name] = h

        def get(name: str) -> torch.Tensor | None:
            for cand in (name, name.removeprefix("model.")):
                if cand in where:
                    return where[cand].get_tensor(cand)
            return None

        gen_eos = None
        if (p / "generation_config.json").is_file():
            gen_eos = json.loads((p / "generation_config.json").read_text()).get("eos_token_id")
        tok = cls._auto_tokenizer(str(p), {}) if tokenizer == "auto" else tokenizer
        kw.setdefault("eos_token_ids", _eos_ids(gen_eos, cfg.eos_token_id, getattr(tok, "eos_token_id", None)))
        with torch.no_grad():
            return cls._build(cfg, get, device=device, dtype=dtype, max_batch=max_batch, max_seq_len=max_seq_len,
                              tokenizer=tok, **kw)

    @classmethod
    def _from_gguf(cls, folder: Path, gguf: str, *, tokenizer: Any, **kw) -> "FastModel":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf, dtype=torch.float32)
        tok = cls._auto_tokenizer(str(folder), {"gguf_file": gguf}) if tokenizer == "auto" else tokenizer
        kw["device"] = kw.get("device") or "cpu"
        kw["dtype"] = _resolve_dtype(kw.get("dtype"), torch.device(kw["device"]))
        return cls.from_hf_model(model, tokenizer=tok, **kw)

    @staticmethod
    def _auto_tokenizer(path: str, kw: dict) -> Any:
        files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if not kw.get("gguf_file") and not any((Path(path) / f).is_file() for f in files):
            return None  # transformers would build an empty tokenizer from the config
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path, **kw)
        except Exception as e:  # no tokenizer files: the caller tokenizes
            log.info("no tokenizer loaded from %s: %s", path, e)
            return None
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        tok.padding_side = "left"
        return tok

    @classmethod
    def from_config(cls, hf_config, *, device="cpu", dtype=None, max_batch: int = 1, max_seq_len: int = 4096,
                    seed: int = 0, std: float = 0.02, **kw) -> "FastModel":
        """Random weights for a config (or a preset name): projections and the
        embedding ~ N(0, ``std``), biases ~ N(0, ``std``), norms at 1. With std 0.02
        the residual stream stays O(10) over 64 layers, finite in bf16. Weights are
        drawn on ``device`` (seconds for 8B on a GPU)."""
        if isinstance(hf_config, str):
            from spade.models.presets import preset_config

            hf_config = preset_config(hf_config)
        device = torch.device(device)
        dtype = _resolve_dtype(dtype, device)
        arch = FastArch.from_hf_config(hf_config)
        gen = torch.Generator(device=device)
        gen.manual_seed(int(seed))

        def rnd(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, dtype=dtype, device=device)

        a = arch
        layers = [LayerWeights(
            ln1=ones(a.hidden), wqkv=rnd(a.qkv_out, a.hidden), bqkv=rnd(a.qkv_out) if a.qkv_bias else None,
            q_norm=ones(a.head_dim) if a.qk_norm else None, k_norm=ones(a.head_dim) if a.qk_norm else None,
            wo=rnd(a.hidden, a.n_q_heads * a.head_dim), bo=rnd(a.hidden) if a.o_bias else None,
            ln2=ones(a.hidden), wgu=rnd(2 * a.intermediate, a.hidden), wd=rnd(a.hidden, a.intermediate),
        ) for _ in range(a.n_layers)]
        embed = rnd(a.vocab, a.hidden)
        lm_head = embed if a.tie else rnd(a.vocab, a.hidden)
        kw.setdefault("eos_token_ids", _eos_ids(getattr(hf_config, "eos_token_id", None)))
        return cls(hf_config, arch, layers, embed, ones(a.hidden), lm_head, device=device, dtype=dtype,
                   max_batch=max_batch, max_seq_len=max_seq_len, **kw)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under transformers' parameter names (fused tensors split back),
        e.g. to load a random-weight model into ``Qwen3ForCausalLM`` for comparison."""
        a = self.arch
        D = a.head_dim
        sd = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm,
              "lm_head.weight": self.lm_head}
        for i, L in enumerate(self.layers):
            n = _hf_names(i)
            q, k, v = L.wqkv.split([a.n_q_heads * D, a.n_kv_heads * D, a.n_kv_heads * D], 0)
            g, u = L.wgu.chunk(2, 0)
            sd.update({n["ln1"]: L.ln1, n["ln2"]: L.ln2, n["q"]: q, n["k"]: k, n["v"]: v, n["o"]: L.wo,
                       n["gate"]: g, n["up"]: u, n["down"]: L.wd})
            if L.bqkv is not None:
                bq, bk, bv = L.bqkv.split([a.n_q_heads * D, a.n_kv_heads * D, a.n_kv_heads * D], 0)
                sd.update({n["bq"]: bq, n["bk"]: bk, n["bv"]: bv})
            if L.bo is not None:
                sd[n["bo"]] = L.bo
            if L.q_norm is not None:
                sd.update({n["qn"]: L.q_norm, n["kn"]: L.k_norm})
        return sd

    # ------------------------------------------------------------------ prefill
    def _reset(self, batch: int, seq_len: int, n_valid: torch.Tensor) -> None:
        """Point the step metadata at a cache holding ``seq_len`` entries per row
        (``n_valid`` [B] of them real tokens); drop graphs of the previous generation
        (they hold pointers into its AttentionContext)."""
        if not 1 <= batch <= self.max_batch:
            raise ConfigError(f"batch of {batch} rows does not fit max_batch={self.max_batch}")
        if not 1 <= seq_len <= self.max_seq_len:
            raise ConfigError(f"a cache of {seq_len} tokens does not fit max_seq_len={self.max_seq_len} "
                              "(raise model.max_seq_len)")
        self._graphs.clear()
        self._batch = batch
        self._seq_len = seq_len
        if self.paged:  # a static batch: rows 0..batch-1 hold [0, seq_len), the rest nothing
            for b in range(self.max_batch):
                self.kv_free(b)
            for b in range(batch):
                self.kv_map(b, 0, seq_len)
            self.sync_table()
        self._meta[0].fill_(seq_len)
        self._meta[1, :batch].copy_(n_valid.to(self._meta.device) - 1)
        self._meta[2].fill_(seq_len - 1)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, ctx) -> torch.Tensor:
        """Dense pass over the left-padded prompt ``input_ids`` [B, T]; fills the
        cache, reports each layer to ``ctx.prefill`` and returns the last
        position's logits [B, V] float32. One host sync (is any row padded?)."""
        a = self.arch
        dev = self.device
        ids = input_ids.to(dev)
        B, T = ids.shape
        mask = (torch.ones_like(ids, dtype=torch.bool) if attention_mask is None
                else attention_mask.to(dev).bool())  # [B, T]
        n_valid = mask.sum(1)  # [B]
        padded, right_padded = torch.stack([(n_valid < T).any(), (~mask[:, -1]).any()]).tolist()
        if right_padded:
            raise ConfigError("prefill needs left-padded prompts (every row's last position must be a real token)")
        self._reset(B, T, n_valid)
        ctx.kv_start = (T - n_valid).to(torch.int32) if padded else None
        self._bind(ctx, prefill=True)
        ctx.begin_step(T)
        kv_lens = self.kv_lens
        tmp: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # paged: the layer's prompt K/V, contiguous

        def region(li: int):
            if self.paged:
                shape = (B, a.n_kv_heads, T, a.head_dim)
                tmp[li] = (torch.zeros(shape, dtype=self.dtype, device=dev),
                           torch.zeros(shape, dtype=self.dtype, device=dev))
                return tmp[li]
            return self.k_cache[li][:B, :, :T], self.v_cache[li][:B, :, :T]

        def report(li: int, q_all: torch.Tensor) -> None:
            if self.paged:  # into the pool, then the policy sees the prompt's keys (contiguous) and the pool
                kc, vc = tmp.pop(li)
                self._paged_store(li, slice(0, B), kc, vc, 0)
                ctx.prefill(li, q_all, kc, vc, kv_lens, pool=(self.k_cache[li], self.v_cache[li], self.table.tensor[:B]))
                return
            ctx.prefill(li, q_all, self.k_cache[li][:B], self.v_cache[li][:B], kv_lens)

        x = self._prompt_pass(ids, mask, padded, region, report)
        h = rms_norm_torch(x[:, -1], self.norm, a.eps)  # [B, H]
        self._x[:B].copy_(x[:, -1])
        self.last_logits = F.linear(h, self.lm_head).float()
        return self.last_logits

    # ------------------------------------------------------------------ slots (serving)
    def reset_slots(self, seq_len: int) -> None:
        """Serving (``spade.serving``): from now on every one of the ``max_batch`` rows
        decodes, all sharing the write cursor: the cache holds ``seq_len`` entries per
        row (``kv_lens``), the next step writes index ``seq_len``. Positions restart at 0;
        rows hold nothing until ``prefill_row``. Captured graphs stay valid (they read
        the cursor from the device metadata), so a reset does not re-capture."""
        if not 1 <= seq_len <= self.max_seq_len:
            raise ConfigError(f"a cache of {seq_len} tokens does not fit max_seq_len={self.max_seq_len} "
                              "(raise model.max_seq_len)")
        self._batch = self.max_batch
        self._seq_len = int(seq_len)
        self._meta[0].fill_(seq_len)
        self._meta[1].zero_()
        self._meta[2].fill_(seq_len - 1)

    @torch.no_grad()
    def prefill_row(self, row: int, input_ids: torch.Tensor,
                    report: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None], *,
                    first: int | None = None, offset: int = 0, last: bool = True) -> torch.Tensor | None:
        """Serving: prefill one prompt, or one chunk of it, into row ``row`` (after
        ``reset_slots``; the other rows are untouched).

        Whole prompt (the defaults): ``input_ids`` [T] go right-aligned at the shared
        cursor, cache positions ``[seq_len - T, seq_len)``, RoPE positions ``0 .. T-1``.
        A chunk (chunked prefill, ``spade.serving.slots``): the prompt's first token sits
        at cache index ``first``; ``input_ids`` [c] are its tokens ``offset .. offset+c-1``
        at cache positions ``first + offset ..`` (RoPE positions ``offset ..``), and they
        attend the row's cache ``[first, first + offset)`` written by the earlier chunks
        and themselves, causally. Every position written lies below the cursor; the last
        chunk (``last``) ends exactly at it.

        Each layer reports ``report(layer, q [1, Hq, c, D], k_row [1, Hkv, L, D], v_row)``
        (the chunk's queries and the row's cache views). With ``last`` the row's decode
        position becomes the prompt's last and the last position's logits [1, V] float32
        are returned; else None."""
        S, c = self._seq_len, int(input_ids.numel())
        if self._batch != self.max_batch:
            raise ModelError("prefill_row before reset_slots: the backend is not in slot mode")
        if not 0 <= row < self.max_batch:
            raise ConfigError(f"row {row} is outside the {self.max_batch} slots (model max_batch)")
        if first is None:
            first = S - c - offset
        end = first + offset + c  # one past the chunk's last cache position
        if c < 1 or offset < 0 or first < 0 or end > S or (last and end != S):
            raise ConfigError(
                f"a prompt chunk of {c} tokens at prompt offset {offset} from cache position {first} does not "
                f"fit before the cursor at {S}" + (" (a last chunk must end at the cursor)" if last else ""))
        ids = input_ids.to(self.device, non_blocking=True).reshape(1, c)  # (a blocking copy waits for the GPU)
        mask = torch.ones(1, c, dtype=torch.bool, device=self.device)
        tmp: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # paged: the prompt's K/V so far, contiguous
        if self.paged:
            self.kv_map(row, first, end)

        def region(li: int):  # the prompt's cache so far: its earlier chunks, then this one
            if self.paged:
                tmp[li] = self._paged_row(li, row, first, first + offset, cap=first + offset + c)
                return tmp[li]
            return self.k_cache[li][row:row + 1, :, first:end], self.v_cache[li][row:row + 1, :, first:end]

        def fwd(li: int, q_all: torch.Tensor) -> None:
            if self.paged:  # this piece into the pool; the report sees the row's [0, end), contiguous
                kc, vc = tmp.pop(li)
                self._paged_store(li, slice(row, row + 1), kc[:, :, offset:], vc[:, :, offset:], first + offset)
                pad = (0, 0, first, 0)  # positions before the prompt: zeros (outside the row's window)
                report(li, q_all, F.pad(kc, pad) if last else kc, F.pad(vc, pad) if last else vc)
                return
            report(li, q_all, self.k_cache[li][row:row + 1], self.v_cache[li][row:row + 1])

        x = self._prompt_pass(ids, mask, False, region, fwd, offset=offset)
        if not last:
            return None
        self._meta[1, row:row + 1].fill_(offset + c - 1)  # (a scalar fill: no host wait)
        self._x[row].copy_(x[0, -1])
        h = rms_norm_torch(x[:, -1], self.norm, self.arch.eps)  # [1, H]
        return F.linear(h, self.lm_head).float()

    def _prompt_pass(self, ids: torch.Tensor, mask: torch.Tensor, padded: bool,
                     region: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                     report: Callable[[int, torch.Tensor], None], offset: int = 0) -> torch.Tensor:
        """The dense pass over a left-padded prompt ``ids`` [B, T] (``mask`` [B, T]):
        layer ``li``'s keys and values go to ``region(li)`` (two [B, Hkv, offset + T, D]
        views of the cache: ``offset`` > 0 is a later chunk of one unpadded prompt, whose
        first ``offset`` positions hold the earlier chunks' keys and values), then
        ``report(li, q_all)`` gets the tokens' queries [B, Hq, T, D]. Returns the residual
        stream [B, T, H] after the last layer."""
        a = self.arch
        dev = self.device
        B, T = ids.shape
        if offset and padded:
            raise ValueError("a prompt chunk at an offset cannot be padded")
        # [B, T]: left padding does not shift positions; a chunk starts at its offset
        pos = (mask.long().cumsum(1) - 1).clamp(min=0) + offset
        fused = self.fused_kernels  # the Triton norms, QK-norm + RoPE + store and SiLU product
        ops = self._ops()
        if fused:  # the kernel reads the tables at pos itself
            widx0 = torch.zeros(1, dtype=torch.long, device=dev)
        else:
            cos = self.cos_tab[pos].to(self.dtype)[:, :, None, :]  # [B, T, 1, rot]
            sin = self.sin_tab[pos].to(self.dtype)[:, :, None, :]
        C = max(1, min(self.prefill_chunk, T))
        D, Hq, Hkv = a.head_dim, a.n_q_heads, a.n_kv_heads
        x = F.embedding(ids, self.embed)  # [B, T, H]
        for li, L in enumerate(self.layers):
            kc, vc = region(li)
            q_all = torch.empty(B, Hq, T, D, dtype=self.dtype, device=dev)
            for c0 in range(0, T, C):  # pass 1: q/k/v of every prompt token, k/v into the cache
                c1 = min(T, c0 + C)
                if fused:  # the decode step's Triton kernels, one token per row (a view of each row's region)
                    for b in range(B):
                        h = ops["add_rms_norm"](x[b, c0:c1], None, L.ln1, a.eps)
                        ops["qkv_rope_store"](
                            F.linear(h, L.wqkv, L.bqkv), L.q_norm, L.k_norm, a.eps, self.cos_tab, self.sin_tab,
                            pos[b, c0:c1], widx0, kc[b, :, offset + c0:offset + c1].transpose(0, 1).unsqueeze(2),
                            vc[b, :, offset + c0:offset + c1].transpose(0, 1).unsqueeze(2), Hq, Hkv,
                            q_out=q_all[b, :, c0:c1].transpose(0, 1))
                    continue
                qkv = F.linear(rms_norm_torch(x[:, c0:c1], L.ln1, a.eps), L.wqkv, L.bqkv)  # [B, c, N]
                q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
                q = q.view(B, c1 - c0, Hq, D)
                k = k.view(B, c1 - c0, Hkv, D)
                v = v.view(B, c1 - c0, Hkv, D)
                if L.q_norm is not None:
                    q, k = rms_norm_torch(q, L.q_norm, a.eps), rms_norm_torch(k, L.k_norm, a.eps)
                q = apply_rope_torch(q, cos[:, c0:c1], sin[:, c0:c1])
                k = apply_rope_torch(k, cos[:, c0:c1], sin[:, c0:c1])
                q_all[:, :, c0:c1] = q.transpose(1, 2)
                kc[:, :, offset + c0:offset + c1] = k.transpose(1, 2)
                vc[:, :, offset + c0:offset + c1] = v.transpose(1, 2)
            if offset:  # a later chunk: its queries attend the earlier chunks and themselves
                o_all = self._chunk_attention(q_all, kc[:, :, :offset + T], vc[:, :, :offset + T])
            else:
                o_all = self._prefill_attention(q_all, kc[:, :, :T], vc[:, :, :T], mask, padded, C)  # [B, Hq, T, D]
            for c0 in range(0, T, C):  # pass 2: o_proj and MLP per chunk of tokens
                c1 = min(T, c0 + C)
                o = F.linear(o_all[:, :, c0:c1].transpose(1, 2).reshape(B, c1 - c0, Hq * D), L.wo, L.bo)
                if fused:
                    for b in range(B):  # x += o, then the norm: one kernel
                        h = ops["add_rms_norm"](x[b, c0:c1], o[b], L.ln2, a.eps)
                        x[b, c0:c1] += F.linear(ops["silu_mul"](F.linear(h, L.wgu)), L.wd)
                    continue
                xc = x[:, c0:c1] + o
                h = rms_norm_torch(xc, L.ln2, a.eps)
                x[:, c0:c1] = xc + F.linear(silu_mul_torch(F.linear(h, L.wgu)), L.wd)
            del o_all
            report(li, q_all)
        return x

    def _prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                           padded: bool, chunk: int) -> torch.Tensor:
        """Causal attention over the prompt: q [B, Hq, T, D], k/v [B, Hkv, T, D],
        mask [B, T] (left padding). Returns [B, Hq, T, D].

        Grouped K/V heads are expanded once (a copy the size of q) so that the fused
        SDPA kernels apply whatever torch version runs: without padding one causal
        call (flash); with padding, query chunks of ``chunk`` rows with a boolean
        mask (memory-efficient kernel; the mask is [B, chunk, T], never [B, T, T])."""
        B, Hq, T, D = q.shape
        scale = self.spec.softmax_scale
        G = Hq // k.shape[1]
        if G > 1:
            k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # [B, Hq, T, D]
        if not padded:
            from spade.models.prompt_attention import causal_attention

            return causal_attention(q, k, v, scale)
        out = torch.empty_like(q)
        kpos = torch.arange(T, device=q.device)[None, :]  # [1, T]
        for c0 in range(0, T, chunk):
            c1 = min(T, c0 + chunk)
            qpos = torch.arange(c0, c1, device=q.device)[:, None]  # [c, 1]
            # A padded query attends itself too, so that its (unused) row never has
            # every key masked (which would give NaN).
            allowed = (kpos[:, :c1] <= qpos) & (mask[:, None, :c1] | (kpos[:, :c1] == qpos))  # [B, c, c1]
            out[:, :, c0:c1] = F.scaled_dot_product_attention(q[:, :, c0:c1], k[:, :, :c1], v[:, :, :c1],
                                                              attn_mask=allowed[:, None], scale=scale)
        return out

    def _chunk_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of a prompt chunk: q [B, Hq, c, D] are the last ``c`` of the
        ``n`` positions of k/v [B, Hkv, n, D]; query ``i`` sees keys ``0 .. n - c + i`` (the
        lower-right causal mask). Returns [B, Hq, c, D]
        (``spade.models.prompt_attention.chunk_attention``)."""
        from spade.models.prompt_attention import chunk_attention

        return chunk_attention(q, k, v, self.spec.softmax_scale)

    @torch.no_grad()
    def fake_prefill(self, seq_len: int, batch: int | None = None, *, ctx=None, std: float = 1.0,
                     seed: int = 0) -> None:
        """Benchmark helper: pretend a prompt of ``seq_len`` tokens was prefetched by
        filling the cache with N(0, std) keys/values (no prefill compute) and setting
        the step metadata. No row is padded (``ctx.kv_start = None`` if ``ctx``)."""
        B = self.max_batch if batch is None else int(batch)
        self._reset(B, seq_len, torch.full((B,), seq_len, dtype=torch.int64))
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(seed))
        for kc, vc in zip(self.k_cache, self.v_cache):
            if self.paged:  # every block of the pool (the rows' blocks among them)
                kc.normal_(0.0, std, generator=gen)
                vc.normal_(0.0, std, generator=gen)
                continue
            kc[:B, :, :seq_len].normal_(0.0, std, generator=gen)
            vc[:B, :, :seq_len].normal_(0.0, std, generator=gen)
        self._x[:B].zero_()
        if ctx is not None:
            ctx.kv_start = None

    # ------------------------------------------------------------------ decode
    def _run_pack(self, ctx, B: int, l0: int, l1: int, first: bool, last: bool) -> None:
        """Layers [l0, l1) of one decode step on the static buffers (the body that is
        captured as one CUDA graph)."""
        a = self.arch
        ops = self._ops()
        add_rms_norm, qkv_rope_store, silu_mul = ops["add_rms_norm"], ops["qkv_rope_store"], ops["silu_mul"]
        x = self._x[:B]  # [B, H], updated in place
        kv_lens = self._meta[0, :B]
        pos = self._meta[1, :B]
        widx = self._meta[2, :B] if self.paged else self._meta[2, :1]  # paged: one write position per row
        paged = {} if not self.paged else {"block_table": self.table.tensor[:B]}
        if paged and not self.fused_kernels:
            from spade.kernels.elementwise import qkv_rope_store_paged_torch as qkv_rope_store
        if first:
            x.copy_(F.embedding(self._tokens[:B], self.embed))
        pending = None  # the previous layer's MLP output, added to x inside the next norm
        for li in range(l0, l1):
            L = self.layers[li]
            h = add_rms_norm(x, pending, L.ln1, a.eps)
            qkv = self._lin(h, L.wqkv, L.bqkv)  # [B, (Hq + 2 Hkv) D]
            kc, vc = (self.k_cache[li], self.v_cache[li]) if paged else (self.k_cache[li][:B], self.v_cache[li][:B])
            # q straight into the slot the selector ships it from, if it has one (no copy after the attention)
            q = qkv_rope_store(qkv, L.q_norm, L.k_norm, a.eps, self.cos_tab, self.sin_tab, pos, widx, kc, vc,
                               a.n_q_heads, a.n_kv_heads, **paged, q_out=ctx.q_out(li, B))  # [B, Hq, D]
            o = ctx.attend(li, q, kc, vc, kv_lens)  # [B, Hq, D]
            attn = self._lin(o.reshape(B, -1), L.wo, L.bo)
            h = add_rms_norm(x, attn, L.ln2, a.eps)
            pending = self._lin(self._glu(h, L.wgu, silu_mul), L.wd)
        if last:
            h = add_rms_norm(x, pending, self.norm, a.eps)
            self._logits[:B].copy_(self._lin(h, self.lm_head))
        elif pending is not None:
            x.add_(pending)

    def _packs(self, pack_layers: int) -> list[tuple[int, int]]:
        n = self.arch.n_layers
        P = max(1, int(pack_layers))
        return [(l0, min(n, l0 + P)) for l0 in range(0, n, P)]

    @torch.no_grad()
    def decode_stages(self, tokens: torch.Tensor, ctx, pack_layers: int) -> Iterator[int]:
        """One decode step for ``tokens`` [B], pack by pack (see ``DecodeBackend``).

        CUDA graphs: the first step with a new key ``(pack_layers, B, ctx,
        ctx.graph_key())`` runs eagerly on the capture stream (it is the warm-up
        torch asks for before a capture, and it compiles Triton kernels), then one
        graph per pack is captured (capture records, it does not execute, so the
        step's side effects happen once); later steps replay. Replays do not call
        Python: whatever a selector does per layer must be device work recorded at
        capture, or happen between packs.
        """
        B = self._batch
        if B == 0:
            raise ModelError("decode before prefill: call prefill (or fake_prefill) first")
        if self._seq_len + 1 > self.max_seq_len:
            raise ModelError(f"the KV cache is full ({self.max_seq_len} tokens): raise model.max_seq_len")
        packs = self._packs(pack_layers)
        n_packs = len(packs)
        if self.paged:  # the rows entering a new block get it; the table follows before the step
            self._grow_rows(self._seq_len)
            self.sync_table()
            self._bind(ctx)
        # Host bookkeeping and the device metadata bump (kv_lens, position, write index).
        self._seq_len += 1
        self._tokens[:B].copy_(tokens.reshape(-1), non_blocking=True)
        self._meta.add_(1)
        ctx.begin_step(self._seq_len)

        graphs = None
        key = None
        if self._stream is not None and self.use_cuda_graphs:
            from spade.kernels.pdl import capture_key

            key = (max(1, int(pack_layers)), B, id(ctx), id(ctx.selector), ctx.graph_key(), self._linear,
                   self.fuse_glu, capture_key())
            graphs = self._graphs.get(key)
        if graphs == "eager":  # capture failed for this key: stay eager
            key = None
            graphs = None
        if graphs is not None:
            for i, g in enumerate(graphs):
                g.replay()
                if i == n_packs - 1:
                    self.last_logits = self._logits[:B].clone()
                yield i
            return
        if key is None:  # eager (CPU, or graphs off)
            for i, (l0, l1) in enumerate(packs):
                self._run_pack(ctx, B, l0, l1, i == 0, i == n_packs - 1)
                if i == n_packs - 1:
                    self.last_logits = self._logits[:B].clone()
                yield i
            return
        # First step with this key: eager on the capture stream, then capture.
        cur = torch.cuda.current_stream(self.device)
        for i, (l0, l1) in enumerate(packs):
            self._stream.wait_stream(cur)
            with torch.cuda.stream(self._stream):
                self._run_pack(ctx, B, l0, l1, i == 0, i == n_packs - 1)
            cur.wait_stream(self._stream)
            if i == n_packs - 1:
                self.last_logits = self._logits[:B].clone()
            yield i
        try:
            self._graphs[key] = self._capture(ctx, B, packs)
        except Exception as e:  # e.g. a selector that syncs with the host
            log.warning("CUDA graph capture failed for key %r; decoding eagerly for it: %s", key[4:], e)
            self._graphs[key] = "eager"

    def _capture(self, ctx, B: int, packs: list[tuple[int, int]]) -> list:
        graphs = []
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        for i, (l0, l1) in enumerate(packs):
            g = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of other threads (transport progress threads)
            # do not invalidate this capture.
            with torch.cuda.graph(g, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                self._run_pack(ctx, B, l0, l1, i == 0, i == len(packs) - 1)
            graphs.append(g)
        return graphs

    def close(self) -> None:
        """Free the KV cache and the graphs (the model cannot decode afterwards)."""
        self._graphs.clear()
        self.k_cache = []
        self.v_cache = []
        if self.blocks is not None:
            self.blocks.free_all()
        self._batch = 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

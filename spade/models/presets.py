"""Named model shapes for random-weight runs (benchmarks, CPU tests).

Each preset is a dict of Hugging Face config kwargs (``model_type`` picks the
config class), so a preset builds the same ``transformers`` config that a real
checkpoint of that shape ships with; ``FastModel.from_config`` then fills it
with random weights. The big shapes follow the published Qwen3 dense configs
(head_dim 128 everywhere, QK-RMSNorm, RoPE theta 1e6, vocab 151936).

Example::

    >>> from spade.models.presets import preset_config
    >>> cfg = preset_config("tiny")
    >>> (cfg.model_type, cfg.num_hidden_layers, cfg.head_dim)
    ('qwen3', 3, 32)
"""

from __future__ import annotations

import copy
from typing import Any

from spade.errors import ConfigError

_QWEN3_COMMON: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_act": "silu",
    "head_dim": 128,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "max_position_embeddings": 40960,
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-8b": {
        **_QWEN3_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "qwen3-32b": {
        **_QWEN3_COMMON,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "qwen3-1.7b": {
        **_QWEN3_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    # CPU-sized Qwen3 (QK-norm, GQA 2:1); 3 layers so that packs of 2 are uneven.
    "tiny": {
        **_QWEN3_COMMON,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # CPU-sized Qwen2 (QKV bias, no QK-norm, tied embeddings).
    "tiny-qwen2": {
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # CPU-sized Llama with llama3 RoPE scaling and MQA.
    "tiny-llama": {
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 96,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "vocab_size": 384,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


def preset_config(name: str, **overrides: Any):
    """The ``transformers`` config of preset ``name`` (``overrides`` replace kwargs,
    e.g. ``num_hidden_layers=4`` for a cut-down benchmark)."""
    from transformers import AutoConfig

    if name not in PRESETS:
        raise ConfigError(f"model.name: unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    kw = copy.deepcopy(PRESETS[name])
    kw.update(overrides)
    model_type = kw.pop("model_type")
    return AutoConfig.for_model(model_type, **kw)

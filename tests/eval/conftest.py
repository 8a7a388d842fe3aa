"""Shared fixtures of the eval tests: SmolLM2-135M loaded once per session."""

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the registered offline SmolLM2-135M (float32, CPU)."""
    from spade.eval.common import load_model

    try:
        return load_model("smollm2-135m", "cpu")
    except Exception as e:  # the weights package is missing: say how to get it
        pytest.skip(f"smollm2-135m unavailable: {e}")


@pytest.fixture(scope="session")
def smollm2_spec(smollm2):
    from spade.models.hf import attention_spec

    return attention_spec(smollm2[0])


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)

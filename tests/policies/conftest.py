"""Policy tests run the kernels' torch references unless a test asks for Triton."""

import pytest


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    monkeypatch.setenv("SPADE_KERNELS", "torch")

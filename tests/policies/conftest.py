"""Policy tests run the kernels' torch references unless a test asks for Triton, on one
torch intra-op thread per module (``one_torch_thread``: small ops, a shared 2-core box;
an inline run and the async run it is compared with share the count)."""

import pytest


@pytest.fixture(scope="module", autouse=True)
def _policies_one_torch_thread(one_torch_thread):
    yield


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    monkeypatch.setenv("SPADE_KERNELS", "torch")

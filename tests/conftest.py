"""Test setup: Triton kernels run under the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is first imported, so this runs
before any spade kernel module is imported.
"""

import os
import shutil

_HAS_GPU = shutil.which("nvidia-smi") is not None and os.path.exists("/dev/nvidiactl")
if not _HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and (not HAS_CUDA or torch.cuda.device_count() < 2):
            item.add_marker(skip_multi)


@pytest.fixture
def device():
    """The device kernel tests run on: cuda when present, else cpu (interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tests of many tiny ops (a decode step = hundreds of small kernels): one intra-op
    thread is several times faster than two, and far faster when the cores are shared
    (spinning worker threads). Use it with ``pytestmark = pytest.mark.usefixtures(...)``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)

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


def _helpers_reuse_the_launch_patch() -> None:
    """Speed of the interpreted kernel tests, nothing else. Triton 3.6's interpreter
    patches ``triton.language`` for each launch (``GridExecutor``: the modules the
    kernel's globals name) and again on every call of a ``@triton.jit`` helper from
    inside the kernel (the modules the helper's globals name; ``inspect.getmembers``
    over them, ~2-8 ms a call), although nothing is restored until the grid is done.
    Kernels that call tile helpers per loop iteration spent about a third of their
    test time re-patching. Here each launch patches both namespaces jit code can
    reach the language through (``triton.language`` and ``triton.language.core``,
    all that the interpreter ever patches), and helper calls run under that patch.
    Only for the pinned version, whose interpreter this relies on."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter as it

    if triton.__version__ != "3.6.0":
        return

    def patch_lang(fn):  # it._patch_lang with both language namespaces, whatever fn's globals name
        scope = it._LangPatchScope()
        for lang in (tl, tl.core):
            it._patch_builtin(lang, it.interpreter_builder, scope)
            it._patch_builtin(lang.tensor, it.interpreter_builder, scope)
            if lang is tl:
                it._patch_builtin(lang.math, it.interpreter_builder, scope)
            it._patch_lang_tensor(lang.tensor, scope)
            it._patch_lang_core(lang, scope)
        it._patch_builtin(tl.core.tensor_descriptor_base, it.interpreter_builder, scope)
        return scope

    def call(self, *args, **kwargs):  # it.InterpretedFunction.__call__ without its re-patch
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise it.InterpreterError(repr(e)) from e

    it._patch_lang = patch_lang
    it.InterpretedFunction.__call__ = call


if INTERPRET:
    _helpers_reuse_the_launch_patch()


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

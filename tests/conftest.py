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


def _interpreter_pure_lookups_cached() -> None:
    """Speed of the interpreted kernel tests, nothing else: two pure functions of
    Triton 3.6's interpreter front end that ran on every op, computed once.
    ``interpreter._get_np_dtype`` built a 19-entry dict of numpy dtypes per call (one
    call per splat, cast and load); here the same table is built once. A
    ``tl.tuple_type`` formatted its name (``str`` of each member type) on creation,
    and every ``tl.tensor`` creates one for its shape, while the name is read only
    by ``str()``; here it is formatted when read. Only for the pinned version."""
    import numpy as np
    import triton
    import triton.language as tl
    from triton.language import core
    from triton.runtime import interpreter as it

    if triton.__version__ != "3.6.0":
        return
    orig = it._get_np_dtype
    scalars = [tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32,
               tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16, tl.float8e4nv,
               tl.float8e4b8, tl.float8e4b15]
    table = {t: orig(t) for t in scalars}
    u64 = np.dtype(np.uint64)

    def np_dtype(tt_dtype):  # it._get_np_dtype with its table built once
        if isinstance(tt_dtype, tl.pointer_type):
            return u64
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
            if isinstance(tt_dtype, tl.pointer_type):
                return u64
        return table[tt_dtype]

    def tuple_type_init(self, types, fields=None):  # core.tuple_type.__init__ less the name
        self.types = types
        self.fields = fields or [''] * len(types)

    def tuple_type_name(self):
        return '[' + ','.join([f"{k}:{v}" for k, v in zip(self.fields, self.types)]) + ']'

    it._get_np_dtype = np_dtype
    core.tuple_type.__init__ = tuple_type_init
    core.tuple_type.name = property(tuple_type_name)


def _interpreter_types_shared() -> None:
    """Speed of the interpreted kernel tests, nothing else. Triton 3.6's interpreter
    builds a new ``tl.block_type`` for the result of every op of every program (its
    shape as a ``tl.tuple`` with a ``tuple_type``, validated, its name formatted), and
    every ``tl.tensor`` then builds a ``tl.tuple`` of ``constexpr`` for its shape: about
    a third of an interpreted kernel's time went to these. The types are never changed
    after construction, so here a block type is made once per (element type, shape) and
    shared, and a tensor takes its ``shape`` / ``numel`` from its type's, made once per
    type. The element type is a dict key through its own ``__eq__`` / ``__hash__``
    (pointer types keep their address space and constness apart). A shape that does not
    make a key, or a type that fails validation, takes the original path. Only for the
    pinned version."""
    import builtins
    import math

    import triton
    from triton.language import core

    if triton.__version__ != "3.6.0":
        return
    BT = core.block_type
    bt_init = BT.__init__
    types: dict = {}

    def bt_new(cls, element_ty=None, shape=None):  # copy/pickle call cls.__new__(cls): a bare object
        if cls is not BT or element_ty is None:
            return object.__new__(cls)
        try:
            key = (element_ty, builtins.tuple(core._unwrap_shape(shape)))
            obj = types.get(key)
        except TypeError:  # unhashable: not a shape of ints (the original raises its own error)
            key, obj = None, None
        if obj is None:
            obj = object.__new__(cls)
            bt_init(obj, element_ty, shape)  # validates; raises before anything is kept
            obj._built = True
            if key is not None:
                types[key] = obj
        return obj

    def bt_init_once(self, element_ty, shape):  # __init__ after __new__: built there
        if not self.__dict__.get("_built"):
            bt_init(self, element_ty, shape)

    def tensor_init(self, handle, type):  # core.tensor.__init__ with the shape made once per type
        self.handle = handle
        self.type = type
        self.dtype = type.scalar
        made = type.__dict__.get("_tensor_shape")
        if made is None:
            shape = type.shape if type.is_block() else ()
            made = (core.constexpr(math.prod(shape)), core.tuple([core.constexpr(s) for s in shape]))
            type._tensor_shape = made
        self.numel, self.shape = made

    BT.__new__ = bt_new
    BT.__init__ = bt_init_once
    core.tensor.__init__ = tensor_init


if INTERPRET:
    _helpers_reuse_the_launch_patch()
    _interpreter_pure_lookups_cached()
    _interpreter_types_shared()


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


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread_per_session():
    """One torch intra-op thread for the whole session (cache processes spawned by a
    runtime inherit it through their ``--threads``). The CPU tests are small ops: with two
    OpenMP threads spinning on a shared 2-core box they ran several times slower (two eval
    tests of SmolLM2: 4.7x the CPU time; tests/policies/test_rerank.py: 23 s, 1.2 s with
    one thread). Numerics do not
    depend on it beyond the reduction order the tolerances allow, and every comparison of
    two runs in one test has both on the same count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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

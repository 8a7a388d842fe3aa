"""The cache rank's small ops: launches per pack of ``_Generation._observe_pack`` / ``_select_pack``,
pinned on CPU with ``torch.profiler`` (Triton kernels under the interpreter), so that a
change adding per-layer launches to the hot path shows up here.

What is counted (``_launches``): every Triton launch (the interpreter's launcher is
wrapped in a ``record_function`` marker; the torch ops the interpreter runs inside it
are not counted), and every aten op with no counted op below it that is not a view,
an allocation or a no-op conversion (``_FREE``) — on a GPU each of those is a kernel
(``aten::zeros``: one fill; ``aten::to`` when it converts: one copy). An op is named by
its outermost aten op.

Setup: the benchmark's cache path (``score_keys=int4`` or exact keys, ``return_mode=
indices``, ``group_reduce=sum_logits``, ``rope_aware=false``, predictor ``assembled``,
no left padding) on the tiny Qwen3 preset in bf16, local topology (the cache rank keeps
its own store), all 3 layers in one pack, one row (the counts are per layer and per pack,
not per row; a second row doubled every interpreted kernel's programs).
"""

from __future__ import annotations

import collections

import pytest
import torch

from spade.kernels import radix_topk
from tests.conftest import INTERPRET

_FREE = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::view", "aten::_unsafe_view", "aten::alias",
    "aten::select", "aten::slice", "aten::narrow", "aten::unsqueeze", "aten::squeeze", "aten::reshape",
    "aten::_reshape_alias", "aten::expand", "aten::expand_as", "aten::view_as", "aten::as_strided", "aten::t",
    "aten::transpose", "aten::permute", "aten::unbind", "aten::split", "aten::to", "aten::_to_copy",
    "aten::detach", "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::result_type",
}
"""Ops that launch nothing by themselves (views, allocations; ``to`` without a copy)."""

# Per pack of 3 layers (L = per layer, P = per pack).
CARRY = {"triton::_carry_prep_kernel": 3, "triton::_carry_count_kernel": 3, "triton::_carry_expand_kernel": 3,
         "triton::_carry_select_kernel": 3, "triton::_radix_pass_kernel": 6, "triton::_radix_split_kernel": 3,
         "triton::_tie_select_kernel": 3}
"""The threshold-carry top-K's launches per pack (every layer's, besides its scoring)."""
COMPACT = {**CARRY, "triton::_radix_pass_kernel": 3}
"""... with the candidates' scores stored compacted (``SELECT_CONFIG["carry_compact"]``): the
scoring runs again per layer, gated on the rows that fell back (their whole rows and the
radix pass-0 histogram), in place of the gated pass 0."""
EXPECTED = {
    "int4": {
        # observe as radix; select: L: this call's threshold from the carried one and the
        # query's norm, int4 scoring marking the candidates above it, the bitmask counted and
        # expanded, the carry select (no workspace memset: it zeroes a falling-back row's), the
        # radix passes gated on the rows that fell back (two passes, split, ties); P: as radix
        "observe": {"triton::_window_push_kernel": 3, "triton::_quantize4_append_kernel": 3},
        "select": {**CARRY, "triton::_i8dot_score_kernel": 3,
                   "triton::_ridge_kernel": 1, "aten::mul": 1, "aten::clamp": 1, "aten::sub": 1,
                   "aten::maximum": 1},
    },
    "int4/carry/compact": {
        "observe": {"triton::_window_push_kernel": 3, "triton::_quantize4_append_kernel": 3},
        "select": {**COMPACT, "triton::_i8dot_score_kernel": 6,
                   "triton::_ridge_kernel": 1, "aten::mul": 1, "aten::clamp": 1, "aten::sub": 1,
                   "aten::maximum": 1},
    },
    "exact": {
        "observe": {"aten::index_copy_": 3, "triton::_window_push_kernel": 3},
        "select": {**CARRY, "aten::to": 3, "triton::_score_kernel": 3,
                   "triton::_ridge_kernel": 1, "aten::clamp": 1, "aten::sub": 1, "aten::maximum": 1},
    },
    "int4/radix": {
        # observe, per layer: window push, int4 append of the step's key (read from the
        # received pack: no bf16 store append, no kv_lens - 1 launch)
        "observe": {"triton::_window_push_kernel": 3, "triton::_quantize4_append_kernel": 3},
        # select: L: the radix workspace memset, int4 scoring (+ pass-0 histogram), radix
        # pass 1, split, tie select (writing the pack's output rows: no copy);
        # P: ridge prediction, smoothing fold + bf16 rounding, middle bounds (clamp, sub, max)
        "select": {"aten::zeros": 3, "triton::_i8dot_score_kernel": 3, "triton::_radix_pass_kernel": 3,
                   "triton::_radix_split_kernel": 3, "triton::_tie_select_kernel": 3,
                   "triton::_ridge_kernel": 1, "aten::mul": 1, "aten::clamp": 1, "aten::sub": 1,
                   "aten::maximum": 1},
    },
    "exact/radix": {
        # observe, per layer: the bf16 store append (exact scoring reads it), window push
        "observe": {"aten::index_copy_": 3, "triton::_window_push_kernel": 3},
        # select: L: workspace memset, q̂ rounded to bf16 (inside score_topk), bf16 scoring,
        # radix pass 1, split, tie select; P: ridge prediction, middle bounds
        "select": {"aten::zeros": 3, "aten::to": 3, "triton::_score_kernel": 3, "triton::_radix_pass_kernel": 3,
                   "triton::_radix_split_kernel": 3, "triton::_tie_select_kernel": 3,
                   "triton::_ridge_kernel": 1, "aten::clamp": 1, "aten::sub": 1, "aten::maximum": 1},
    },
}


def _launches(prof) -> collections.Counter:
    """Launch-like ops of a CPU profile by outermost name (see the module docstring)."""
    counts: collections.Counter = collections.Counter()

    def walk(e) -> int:
        if e.name.startswith("triton::"):
            return 1
        n = sum(walk(c) for c in e.cpu_children)
        return n if n or e.name in _FREE else 1

    for e in prof.events():
        if e.cpu_parent is None:
            n = walk(e)
            if n:
                counts[e.name] += n
    return counts


@pytest.mark.skipif(not INTERPRET, reason="counts Triton launches through the CPU interpreter's launcher")
@pytest.mark.parametrize("keys", ["int4", "exact", "int4/radix", "exact/radix", "int4/carry/compact"])
def test_cache_rank_launches_per_pack(keys, monkeypatch):
    """Launches of one steady-state ``_observe_pack`` and ``_select_pack`` (3 layers):

    ``policy.topk=carry`` (the default): the radix path's memset, pass, split and tie
    kernels become one select kernel: int4 2 + 2 per layer + 5 per pack = 17 per pack of
    3 (5.7 per layer); exact keys 2 + 3 per layer + 4 per pack = 19.

    int4 / indices, ``topk=radix``: 2 per layer in observe, 5 per layer + 5 per pack in select — 26 per
    pack of 3 (8.7 per layer). Before the small-op work it was 46 (15.3 per layer):
    observe also appended k to the bf16 store (``index_copy_``) and launched
    ``kv_lens - 1``; select launched, per layer, the smoothing fold (``mul``) and the
    bf16 rounding (``to``) of q̂, the middle bounds (``clamp``, ``sub``, ``maximum``)
    and a copy of the indices into the pack's output buffer.

    exact keys: 2 per layer in observe, 6 per layer + 4 per pack in select — 28 per
    pack of 3 (9.3 per layer; 37 before: per-layer bounds and output copies).

    int4 with ``SELECT_CONFIG["carry_compact"]``: the same count, the gated re-score of the
    rows that fall back in place of the gated pass 0 (``COMPACT``).

    int4: also checks that the profiled run's tokens are the inline runtime's (the
    counts are of a path that works)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    import triton.runtime.interpreter as interp

    from spade.config import load_config
    from spade.models.fast import FastModel
    from spade.models.presets import preset_config
    from spade.policies import build_policy
    from spade.runtime.asyncrt import AsyncRuntime
    from spade.runtime.cache_rank import CacheRank
    from spade.runtime.inline import InlineRuntime

    monkeypatch.setenv("SPADE_KERNELS", "triton")
    launch = interp.GridExecutor.__call__

    def marked(self, *a, **k):
        with record_function("triton::" + self.fn.__name__):
            return launch(self, *a, **k)

    monkeypatch.setattr(interp.GridExecutor, "__call__", marked)
    calls: collections.Counter = collections.Counter()
    got: dict[str, collections.Counter] = {}
    run = CacheRank._run

    def profiled(self, key, fn, graphs_on):
        calls[key[0]] += 1
        if calls[key[0]] != 3:  # observe of decode step 3 (the last), select for step 3 (steady state)
            return run(self, key, fn, graphs_on)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            info = run(self, key, fn, graphs_on)
        got[key[0]] = _launches(prof)
        return info

    monkeypatch.setattr(CacheRank, "_run", profiled)
    B, T, NEW = 1, 24, 4
    torch.manual_seed(1234)
    model = FastModel.from_config(preset_config("tiny"), device="cpu", dtype=torch.bfloat16, max_batch=B,
                                  max_seq_len=40)
    sk, _, topk = keys.partition("/")
    topk, _, store = topk.partition("/")
    if store:
        monkeypatch.setitem(radix_topk.SELECT_CONFIG, "carry_compact", True)
    common = ["policy.name=asyncspade", "policy.budget=16", "policy.sink_tokens=2", "policy.recent_tokens=3",
              "policy.window=4", "policy.predictor=assembled", f"policy.score_keys={sk}",
              "policy.group_reduce=sum_logits", "policy.rope_aware=false", f"policy.topk={topk or 'carry'}"]
    ids = torch.randint(3, 500, (B, T), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(B, T, dtype=torch.long)
    sample = lambda logits: logits.argmax(-1)  # noqa: E731
    cfg = load_config(None, overrides=[*common, "runtime.topology=local", "runtime.pack_layers=3",
                                       "runtime.return_mode=indices", "runtime.cache_thread=coroutine"])
    rt = AsyncRuntime(cfg, model, build_policy(cfg.policy, model.spec))
    try:
        tokens = rt.generate(ids, mask, max_new_tokens=NEW, sample_fn=sample).tokens
    finally:
        rt.close()
    assert {k: dict(v) for k, v in got.items()} == EXPECTED[keys]
    if sk == "int4":
        base = load_config(None, overrides=common)
        want = InlineRuntime(base, model, build_policy(base.policy, model.spec)).generate(
            ids, mask, max_new_tokens=NEW, sample_fn=sample).tokens
        assert tokens == want

"""AsyncRuntime in one process (topologies colocated and local on CPU): the
asynchronous pipeline must produce exactly InlineRuntime's tokens, and late or
dead cache ranks must be handled as configured, never by hanging."""

from __future__ import annotations

import time

import pytest
import torch

from spade.policies import build_policy
from spade.runtime import build_runtime
from spade.runtime.asyncrt import AsyncRuntime, ThresholdSelector, theta_eff
from spade.runtime.inline import InlineRuntime
from spade.runtime.protocol import CacheHooks, packs_of
from tests.runtime.conftest import BUDGET, NEW, T, Selectors, config, generate_cfg, greedy, run_with_selector


def generate(model, prompt, *overrides, hooks=None, new=NEW):
    cfg = config(*overrides)
    pol = build_policy(cfg.policy, model.spec)
    rt = AsyncRuntime(cfg, model, pol, hooks=hooks)
    try:
        return rt.generate(*prompt, max_new_tokens=new, sample_fn=greedy)
    finally:
        rt.close()


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("topology,pack,mode", [
    ("colocated", 1, "indices"),  # the cache rank reads the model's own (static) cache
    ("colocated", 2, "kv"),       # gathered K/V merged with the local sinks + recent window
    ("local", 2, "indices"),      # the cache rank keeps its own KV store (copies)
    ("local", 1, "delta"),        # slot-aligned index deltas
])
def test_matches_inline_tokens(model, prompt, inline_tokens, topology, pack, mode):
    tr = generate(model, prompt, f"runtime.topology={topology}", f"runtime.pack_layers={pack}",
                  f"runtime.return_mode={mode}")
    assert tr.tokens == inline_tokens
    n_packs = len(packs_of(model.spec.n_layers, pack))
    sparse_steps = sum(1 for s in range(1, NEW) if T + s > BUDGET)
    assert tr.stats["sparse_steps"] == sparse_steps > 0  # the budget is crossed inside the generated span
    assert tr.stats["sel_messages"] >= sparse_steps * n_packs
    assert tr.late_packs == 0
    assert len(tr.step_times_s) == NEW - 1
    # indices / kv: every pack's selection landed in one copy into its pack's buffers, but
    # each pack's first (made at the boot, below the budget: no selection, landed per layer)
    assert tr.stats["packs_landed_whole"] == (tr.stats["sel_messages"] - n_packs if mode != "delta" else 0)


@pytest.mark.parametrize("mode", ["indices", "kv", "delta"])
def test_selection_without_middle_tokens(model, prompt, mode):
    """streaming selects no middle tokens (sinks and the recent window only): nothing
    travels but the layout, and every return mode gives InlineRuntime's tokens."""
    from spade.config import load_config

    over = ["policy.name=streaming", f"policy.budget={BUDGET}", "policy.sink_tokens=2", "policy.recent_tokens=3"]
    cfg = load_config(None, overrides=over)
    want = InlineRuntime(cfg, model, build_policy(cfg.policy, model.spec)).generate(
        *prompt, max_new_tokens=NEW, sample_fn=greedy).tokens
    cfg = load_config(None, overrides=[*over, "runtime.topology=colocated", "runtime.pack_layers=2",
                                       f"runtime.return_mode={mode}"])
    rt = AsyncRuntime(cfg, model, build_policy(cfg.policy, model.spec))
    try:
        tr = rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)
    finally:
        rt.close()
    assert tr.tokens == want and tr.stats["sparse_steps"] > 0


def test_generate_inside_a_running_event_loop(model, prompt, inline_tokens):
    """The synchronous API from a coroutine (a notebook cell, an async application's helper):
    the runtime runs its loop on a thread of its own, keeps it (and the cache link) for a
    second call, and stops it on close; the tokens stay the inline ones."""
    import asyncio
    import threading

    cfg = config("runtime.topology=colocated", "runtime.pack_layers=2")
    rt = AsyncRuntime(cfg, model, build_policy(cfg.policy, model.spec))

    async def caller():
        a = rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)
        b = rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)
        return a, b

    try:
        a, b = asyncio.run(caller())
        runner = rt._loop_thread
        assert runner is not None and runner.thread is not threading.current_thread()
        assert rt._link.loop is runner.loop  # the link lives on the runtime's thread loop
        c = rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)  # and serves plain callers too
    finally:
        rt.close()
    assert a.tokens == b.tokens == c.tokens == inline_tokens
    assert a.stats["sparse_steps"] > 0
    assert not runner.thread.is_alive() and rt._loop_thread is None


def test_generate_inside_a_loop_after_a_plain_call_names_agenerate(model, prompt):
    """A link opened on this thread's own loop cannot move to another loop: a clear error."""
    import asyncio

    cfg = config("runtime.topology=colocated")
    rt = AsyncRuntime(cfg, model, build_policy(cfg.policy, model.spec))
    try:
        rt.generate(*prompt, max_new_tokens=3, sample_fn=greedy)

        async def caller():
            return rt.generate(*prompt, max_new_tokens=3, sample_fn=greedy)

        with pytest.raises(RuntimeError, match="agenerate"):
            asyncio.run(caller())
    finally:
        rt.close()


def test_threshold_inside_the_span_and_reused_runtime(model, prompt):
    """θ above the budget (dense until the cache holds 19 tokens): the same tokens as
    inline selection with that threshold; a second generate on the same runtime
    (same cache rank) gives them again."""
    theta = 19
    cfg = config("runtime.topology=colocated", f"runtime.sparse_threshold={theta}", "runtime.pack_layers=2")
    pol = build_policy(cfg.policy, model.spec)
    want = run_with_selector(model, pol, Selectors.threshold(theta), *prompt)
    rt = AsyncRuntime(cfg, model, pol)
    try:
        a = rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)
        b = rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)
    finally:
        rt.close()
    assert a.tokens == want and b.tokens == want
    assert a.stats["sparse_steps"] == sum(1 for s in range(1, NEW) if T + s > theta) > 0
    # and the threshold matters: without it the tokens differ on this model
    assert run_with_selector(model, pol, Selectors.threshold(0), *prompt) != want


@pytest.mark.parametrize("name", ["quest", "oracle"])
def test_query_aware_policies_run_inline_through_the_runtime(model, prompt, name):
    over = ["policy.budget=32", "policy.page_size=4"] if name == "quest" else \
        ["policy.budget=24", "policy.sink_tokens=2", "policy.recent_tokens=4"]
    from spade.config import load_config

    cfg = load_config(None, overrides=[f"policy.name={name}", *over, "runtime.topology=colocated"])
    pol = build_policy(cfg.policy, model.spec)
    assert pol.needs_current_query
    want = InlineRuntime(cfg, model, pol).generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)
    rt = build_runtime(cfg, model, pol)
    assert isinstance(rt, AsyncRuntime)
    try:
        got = rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)
    finally:
        rt.close()
    assert got.tokens == want.tokens
    assert got.stats["sync_policy"] is True and rt._link is None  # no cache rank was started


# ----------------------------------------------------------------------------- late packs
STALL = 10  # the cache rank sends no selection for decode steps >= STALL


def test_on_late_stale_uses_the_newest_selection(model, prompt):
    """A cache rank that stops answering: every later pack reuses the selection of
    step STALL-1, exactly like an inline run frozen there; all of them count as late."""
    tr = generate(model, prompt, "runtime.topology=colocated", "runtime.pack_layers=2", "runtime.on_late=stale",
                  hooks=CacheHooks(stall_from_step=STALL))
    pol = build_policy(config().policy, model.spec)
    want = run_with_selector(model, pol, Selectors.frozen_from(T + STALL), *prompt)
    assert tr.tokens == want
    late_steps = NEW - STALL  # steps STALL .. NEW-1 run
    assert tr.late_packs == late_steps * 2 == tr.stats["stale_packs"]
    assert want != run_with_selector(model, pol, Selectors.threshold(0), *prompt)  # staleness is visible


def test_on_late_full_goes_dense(model, prompt):
    tr = generate(model, prompt, "runtime.topology=local", "runtime.pack_layers=1", "runtime.on_late=full",
                  hooks=CacheHooks(stall_from_step=STALL))
    pol = build_policy(config().policy, model.spec)
    assert tr.tokens == run_with_selector(model, pol, Selectors.dense_from(T + STALL), *prompt)
    assert tr.late_packs == (NEW - STALL) * model.spec.n_layers == tr.stats["full_packs"]


def test_on_late_wait_waits_for_a_slow_cache_rank(model, prompt, inline_tokens):
    tr = generate(model, prompt, "runtime.topology=colocated", "runtime.pack_layers=2", "runtime.on_late=wait",
                  hooks=CacheHooks(delay_s=0.03, delay_from_step=9))
    assert tr.tokens == inline_tokens  # waiting changes nothing but time
    assert tr.late_packs > 0 and tr.stats["waited_packs"] == tr.late_packs
    assert tr.stats["wait_s"] > 0


def test_wait_late_timeout_is_lateness_the_deadline_is_loss(model, prompt):
    """under wait a stalled cache rank costs each pack late_timeout_s at most (that pack
    runs dense); its silence past peer_deadline_s is a loss, survived by a restart."""
    t0 = time.monotonic()
    tr = generate(model, prompt, "runtime.topology=colocated", "runtime.on_late=wait", "runtime.late_timeout_s=0.2",
                  "runtime.peer_deadline_s=0.5", hooks=CacheHooks(stall_from_step=9))
    assert time.monotonic() - t0 < 60
    assert all(len(r) == NEW for r in tr.tokens)
    assert tr.stats["timed_out_packs"] >= 1
    kinds = [e["event"] for e in tr.stats["events"]]
    assert kinds == ["peer_lost", "peer_restored"] and "peer_deadline_s" in tr.stats["events"][0]["reason"]


def test_dead_cache_rank(model, prompt, inline_tokens):
    """Every mode survives a dead cache rank (a restart); with restarts off it
    finishes densely (the behaviour of stale/full before restarts existed)."""
    for mode in ("wait", "full"):
        tr = generate(model, prompt, "runtime.topology=colocated", f"runtime.on_late={mode}",
                      "runtime.late_timeout_s=5", hooks=CacheHooks(die_at_step=9))
        assert "peer_gone" in tr.stats and all(len(r) == NEW for r in tr.tokens)
        assert tr.stats["restarts"] == 1
        # until the cache rank died the tokens are the inline ones (token 0 + steps 1..8)
        assert [r[:9] for r in tr.tokens] == [r[:9] for r in inline_tokens]
    tr = generate(model, prompt, "runtime.topology=colocated", "runtime.on_late=full", "runtime.late_timeout_s=5",
                  "runtime.max_restarts_per_min=0", hooks=CacheHooks(die_at_step=9))
    assert [r[:9] for r in tr.tokens] == [r[:9] for r in inline_tokens]
    assert tr.tokens != inline_tokens  # and dense decoding afterwards is visible


# ----------------------------------------------------------------------------- pieces
def test_threshold_selector_and_theta():
    cfg = config()
    from spade.policies.base import AttentionSpec

    spec = AttentionSpec(n_layers=1, n_q_heads=2, n_kv_heads=1, head_dim=8)
    pol = build_policy(cfg.policy, spec)
    assert theta_eff(0, pol) == BUDGET and theta_eff(40, pol) == 40 and theta_eff(BUDGET - 3, pol) == BUDGET
    st = pol.new_state(1, "cpu")
    sel = ThresholdSelector(pol, st, theta=30)
    st.seq_len = 30
    assert sel.selection(0, torch.zeros(1, 2, 8), torch.zeros(1, 1, 40, 8), torch.tensor([30])) is None
    assert packs_of(5, 2) == [(0, 2), (2, 4), (4, 5)] and packs_of(3, 8) == [(0, 3)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_delta_encoding_round_trip(seed):
    from spade.runtime.cache_rank import align_selection, delta_apply, delta_encode

    g = torch.Generator().manual_seed(seed)
    B, H, K, L = 3, 2, 7, 40
    held = torch.full((B, H, K), -1, dtype=torch.int32)
    for _ in range(6):
        new = torch.stack([torch.stack([torch.randperm(L, generator=g)[:K] for _ in range(H)]) for _ in range(B)])
        new = new.to(torch.int32)
        new[0, 0, -2:] = -1  # fewer candidates than slots
        aligned = align_selection(held, new, L)
        # same set per (b, h); every kept position keeps its slot
        for b in range(B):
            for h in range(H):
                assert sorted(aligned[b, h].tolist()) == sorted(new[b, h].tolist())
                for k in range(K):
                    if held[b, h, k] >= 0 and held[b, h, k] in new[b, h].tolist():
                        assert aligned[b, h, k] == held[b, h, k]
        slots, vals = delta_encode(held, aligned)
        got = held.clone()
        delta_apply(got, slots, vals)
        assert torch.equal(got, aligned)
        held = aligned


def test_tova_selects_ahead_on_the_cache_rank(model, prompt):
    """TOVA evicts in ``observe`` with the current query and ``select`` ignores the
    query, so it runs one step ahead too: the same tokens as inline."""
    from spade.config import load_config

    cfg = load_config(None, overrides=["policy.name=tova", f"policy.budget={BUDGET}", "runtime.topology=colocated",
                                       "runtime.pack_layers=2"])
    pol = build_policy(cfg.policy, model.spec)
    want = InlineRuntime(cfg, model, pol).generate(*prompt, max_new_tokens=NEW, sample_fn=greedy).tokens
    tr = generate_cfg(cfg, model, prompt)
    assert not tr.stats["sync_policy"] and tr.stats["sparse_steps"] > 0
    assert tr.tokens == want


@pytest.mark.parametrize("topology,pack,mode", [("colocated", 2, "indices"), ("local", 1, "delta"),
                                                ("local", 3, "kv")])
def test_refresh_every_matches_inline_tokens(model, prompt, inline_tokens, topology, pack, mode):
    """``policy.refresh_every=3``: the cache rank selects at the same steps as the inline run
    (cache lengths that are multiples of 3, and the first sparse step) and sends the reused
    selection in between; the tokens are the inline ones with the same setting, and the
    setting matters on this model (they differ from every-step selection)."""
    from spade.runtime.inline import InlineRuntime

    cfg = config("policy.refresh_every=3", f"runtime.topology={topology}", f"runtime.pack_layers={pack}",
                 f"runtime.return_mode={mode}")
    pol = build_policy(cfg.policy, model.spec)
    want = InlineRuntime(cfg, model, pol).generate(*prompt, max_new_tokens=NEW, sample_fn=greedy).tokens
    tr = generate_cfg(cfg, model, prompt)
    assert tr.tokens == want != inline_tokens
    sparse_steps = sum(1 for s in range(1, NEW) if T + s > BUDGET)
    assert tr.stats["sparse_steps"] == sparse_steps and tr.late_packs == 0
    assert tr.stats["sel_messages"] >= sparse_steps * len(packs_of(model.spec.n_layers, pack))


def test_hf_backend_growing_cache(prompt):
    """transformers' DynamicCache grows by concatenation: the cache rank keeps its
    own store and shows the policy the same cache length the inline run sees."""
    from transformers import AutoModelForCausalLM

    from spade.models.hf import HFBackend
    from spade.models.presets import preset_config

    torch.manual_seed(0)
    be = HFBackend(AutoModelForCausalLM.from_config(preset_config("tiny"), dtype=torch.float32), None, "cpu")
    cfg = config("runtime.topology=colocated", "runtime.pack_layers=2", "runtime.return_mode=kv")
    pol = build_policy(cfg.policy, be.spec)
    want = InlineRuntime(cfg, be, pol).generate(*prompt, max_new_tokens=NEW, sample_fn=greedy).tokens
    tr = generate_cfg(cfg, be, prompt)
    assert tr.tokens == want and tr.stats["sparse_steps"] > 0


def test_prefill_keeps_only_the_queries_the_boot_sends():
    """A prefill reports every prompt query per layer; the selector keeps a copy of the newest
    ``Policy.rows`` (what the cache rank's boot takes), not a view holding the whole tensor."""
    from types import SimpleNamespace

    from spade.runtime.selector import AsyncSelector

    spec = SimpleNamespace(n_layers=2)
    sel = AsyncSelector(spec, [(0, 1), (1, 2)], stage_kv=True, shared=None, return_mode="indices", q_rows=5)
    q = torch.randn(2, 4, 37, 8)
    k = torch.randn(2, 2, 40, 8)
    sel.prefill(0, q, k, k, torch.full((2,), 37))
    kept = sel.boot[0][0]
    assert kept.shape == (2, 4, 5, 8) and torch.equal(kept, q[:, :, -5:])
    assert kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()  # its own storage
    everything = AsyncSelector(spec, [(0, 2)], stage_kv=True, shared=None, return_mode="indices")
    everything.prefill(0, q, k, k, torch.full((2,), 37))
    assert everything.boot[0][0] is q  # q_rows 0: a policy that reads every prompt query gets them


@pytest.mark.parametrize("topology,pack,mode,into_slot", [
    ("colocated", 2, "indices", True),  # q alone ships: the step writes it into its staging slot
    ("colocated", 1, "kv", True),
    ("local", 2, "indices", False),     # q, k, v staged together by one launch (stage_qkv)
])
def test_query_made_in_its_staging_slot(model, prompt, inline_tokens, monkeypatch, topology, pack, mode,
                                        into_slot):
    """Where the selector offers a slot (``q_out``), the decode step's query projection writes
    q there and the attention reads it from there, so ``after`` has nothing to copy; where it
    offers none, ``after`` stages q as before. Either way the tokens are the inline ones."""
    from spade.models import fast
    from spade.runtime.selector import AsyncSelector

    offered, staged = [], []
    rope = fast._TORCH_OPS["qkv_rope_store"]

    def spy_rope(*args, q_out=None, **kw):
        q = rope(*args, q_out=q_out, **kw)
        if q_out is not None:
            assert q is q_out
        offered.append(q_out is not None)
        return q

    after = AsyncSelector.after

    def spy_after(self, layer, q, k_cache, v_cache, kv_lens):
        p, j = self.where[layer]
        staged.append(q.data_ptr() == self.q_buf[p][j].data_ptr())
        return after(self, layer, q, k_cache, v_cache, kv_lens)

    monkeypatch.setitem(fast._TORCH_OPS, "qkv_rope_store", spy_rope)
    monkeypatch.setattr(AsyncSelector, "after", spy_after)
    tr = generate(model, prompt, f"runtime.topology={topology}", f"runtime.pack_layers={pack}",
                  f"runtime.return_mode={mode}")
    assert tr.tokens == inline_tokens and tr.stats["sparse_steps"] > 0
    decode_layers = (NEW - 1) * model.spec.n_layers
    assert len(staged) == decode_layers
    assert staged == [into_slot] * decode_layers
    assert offered.count(True) == (decode_layers if into_slot else 0)


def test_query_slot_offered_only_where_q_is_staged_alone():
    """``AsyncSelector.q_out``: the layer's slot where q has a buffer of its own (a q-only pack,
    or q, k and v in three buffers), None for a fused pack message (contiguous or paged cache),
    before the buffers exist, and for another batch size."""
    from types import SimpleNamespace

    from spade.runtime.selector import AsyncSelector

    spec = SimpleNamespace(n_layers=3)
    shared = AsyncSelector(spec, [(0, 2), (2, 3)], stage_kv=False, shared=None, return_mode="indices")
    assert shared.q_out(1, 2) is None  # no buffers yet
    shared.allocate(2, 4, 2, 8, torch.float32, torch.float32, "cpu")
    assert shared.q_out(1, 2).data_ptr() == shared.q_buf[0][1].data_ptr()
    assert shared.q_out(2, 2).data_ptr() == shared.q_buf[1][0].data_ptr()
    assert shared.q_out(1, 3) is None
    fused = AsyncSelector(spec, [(0, 3)], stage_kv=True, shared=None, return_mode="indices")
    fused.allocate(2, 4, 2, 8, torch.float32, torch.float32, "cpu")
    assert fused.pack_buf and fused.q_out(0, 2) is None
    fused.block_table = torch.zeros(2, 4, dtype=torch.int32)  # paged: q still a view into the message
    assert fused.q_out(2, 2) is None
    apart = AsyncSelector(spec, [(0, 3)], stage_kv=True, shared=None, return_mode="indices")
    apart.allocate(2, 4, 2, 8, torch.float32, torch.bfloat16, "cpu")  # two dtypes: q, k, v buffers apart
    assert not apart.pack_buf
    assert apart.q_out(2, 2).data_ptr() == apart.q_buf[0][2].data_ptr()

"""The runtime on a paged KV cache (``model.block_size``): greedy tokens equal the
contiguous cache's, inline and behind a cache rank (colocated: the cache rank reads the
pools through the shared block table; local and multiprocess: the step's keys are staged
through the table), in fp32 on the CPU. The GPU half (CUDA graphs, Triton) is at the end."""

from __future__ import annotations

import pytest
import torch

from spade.models.fast import FastModel
from spade.models.presets import preset_config
from spade.policies import build_policy
from spade.runtime.asyncrt import AsyncRuntime
from spade.runtime.inline import InlineRuntime
from tests.runtime.conftest import B, BUDGET, NEW, config, free_port, greedy


def paged_model(device="cpu", dtype=torch.float32, block_size=4, max_seq_len=48) -> FastModel:
    torch.manual_seed(1234)  # the same weights as the contiguous ``model`` fixture
    return FastModel.from_config(preset_config("tiny"), device=device, dtype=dtype, max_batch=B,
                                 max_seq_len=max_seq_len, block_size=block_size)


@pytest.fixture(scope="module")
def pmodel():
    return paged_model()


def make(*over):
    """``config`` (asyncspade) with ``over``; an override naming another policy replaces
    the asyncspade fields (same budget)."""
    if not any(o.startswith("policy.name=") for o in over):
        return config(*over)
    from spade.config import load_config

    return load_config(None, overrides=[*over] + ([] if "policy.name=full" in over else [f"policy.budget={BUDGET}"]))


def tokens(model, prompt, *over):
    cfg = make(*over)
    pol = build_policy(cfg.policy, model.spec)
    if cfg.runtime.topology == "inline":
        return InlineRuntime(cfg, model, pol).generate(*prompt, max_new_tokens=NEW, sample_fn=greedy).tokens, None
    rt = AsyncRuntime(cfg, model, pol)
    try:
        tr = rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)
        return tr.tokens, tr
    finally:
        rt.close()


INLINE = [[], ["policy.score_keys=int4"], ["policy.refresh_every=4"], ["policy.name=quest", "policy.page_size=4"],
          ["policy.name=tova"], ["policy.name=oracle", "policy.sink_tokens=2", "policy.recent_tokens=3"],
          ["policy.name=streaming", "policy.sink_tokens=2", "policy.recent_tokens=3"]]


@pytest.mark.parametrize("over", INLINE, ids=lambda o: ",".join(o) or "asyncspade")
def test_inline_paged_equals_contiguous(model, pmodel, prompt, over):
    want, _ = tokens(model, prompt, *over)
    got, _ = tokens(pmodel, prompt, *over)
    assert got == want


def test_full_attention_paged_equals_contiguous(model, pmodel, prompt):
    cfg = make("policy.name=full")
    want = InlineRuntime(cfg, model, build_policy(cfg.policy, model.spec)).generate(
        *prompt, max_new_tokens=NEW, sample_fn=greedy).tokens
    got = InlineRuntime(cfg, pmodel, build_policy(cfg.policy, pmodel.spec)).generate(
        *prompt, max_new_tokens=NEW, sample_fn=greedy).tokens
    assert got == want


@pytest.mark.parametrize("topology,extra", [
    ("colocated", []), ("colocated", ["policy.score_keys=int4"]), ("colocated", ["runtime.return_mode=delta"]),
    ("local", []), ("multiprocess", ["runtime.transport.name=nccl"]),
    ("multiprocess", ["runtime.transport.name=nccl", "policy.score_keys=int4"])])  # int4 pool copies of its own
def test_async_paged_equals_contiguous_inline(model, pmodel, prompt, topology, extra):
    over = [f"runtime.topology={topology}", "runtime.pack_layers=2", *extra]
    if topology == "multiprocess":
        over.append(f"runtime.transport.master_port={free_port()}")  # (gloo on a CPU)
    want, _ = tokens(model, prompt, *[o for o in extra if o.startswith("policy.")])
    got, tr = tokens(pmodel, prompt, *over)
    assert got == want and tr.stats["sparse_steps"] > 0


@pytest.mark.parametrize("topology", ["colocated", "local", "multiprocess"])
def test_kv_return_mode_on_a_paged_cache(model, pmodel, prompt, topology):
    """The ``kv`` return mode: the cache rank gathers the selected K/V (colocated: from the
    inference rank's pools through its table; local / multiprocess: from its own store,
    filled through the table) and the inference rank merges them with the sinks and
    recent window it attends in its pools: the contiguous cache's tokens (fp32)."""
    over = [f"runtime.topology={topology}", "runtime.pack_layers=2", "runtime.return_mode=kv"]
    if topology == "multiprocess":  # (gloo on a CPU)
        over.append("runtime.transport.name=nccl")
    port = [f"runtime.transport.master_port={free_port()}"] if topology == "multiprocess" else []
    want, _ = tokens(model, prompt, *over, *port)
    port = [f"runtime.transport.master_port={free_port()}"] if topology == "multiprocess" else []
    got, tr = tokens(pmodel, prompt, *over, *port)
    assert got == want and tr.stats["sparse_steps"] > 0


@pytest.mark.parametrize("topology,over", [
    ("inline", ["policy.score_keys=int4"]), ("colocated", ["policy.score_keys=int4"]),
    ("colocated", ["policy.score_keys=int8"]), ("local", ["policy.score_keys=int4"]),
    # a channel subset, re-chosen as the cache grows: requantised into the pool through the table
    ("inline", ["policy.score_keys=int8", "policy.score_channels=16", "policy.channel_refresh=1.05"]),
    ("local", ["policy.score_keys=int4", "policy.score_channels=16", "policy.channel_refresh=1.05"]),
    ("inline", ["policy.name=quest", "policy.page_size=4"])])
def test_static_batch_state_in_the_pool(model, pmodel, prompt, topology, over, monkeypatch):
    """A static batch on a paged cache: the prefill hands the policy the pool the prompt went
    into (inline, and the `colocated` cache rank's boot), or a cache rank of its own (`local`)
    maps its rows' prompts into a pool of as many blocks under a table of its own, so
    asyncspade's int8 / int4 copy and Quest's page bounds are pools of the cache's block
    count, not rows at the logical capacity; the tokens are the contiguous cache's."""
    from spade import kernels
    from spade.policies.asyncspade import AsyncSpadePolicy

    seen = []
    copy_rows = AsyncSpadePolicy._copy_rows

    def spy_copy(st, new, idx, B, join_pool=None, S=0):
        copy_rows(st, new, idx, B, join_pool, S)
        seen.append((join_pool is not None, tuple(st.kq.shape)))

    monkeypatch.setattr(AsyncSpadePolicy, "_copy_rows", staticmethod(spy_copy))
    write = kernels.quest_write_pool
    monkeypatch.setattr(kernels, "quest_write_pool", lambda kmin, *a, **k: seen.append(
        (True, tuple(kmin.shape))) or write(kmin, *a, **k))
    extra = [f"runtime.topology={topology}"] + (["runtime.pack_layers=2"] if topology != "inline" else [])
    want, _ = tokens(model, prompt, *over, *extra)
    assert not seen  # a contiguous cache: per-row state
    got, tr = tokens(pmodel, prompt, *over, *extra)
    assert got == want
    n_blocks = pmodel.k_cache[0].shape[0]
    assert seen and all(pooled and shape[0] == n_blocks for pooled, shape in seen)
    assert len(seen) == pmodel.spec.n_layers  # one prefill: every layer's state into the pool once
    if tr is not None:
        assert tr.stats["sparse_steps"] > 0


@pytest.mark.parametrize("topology", ["colocated", "local"])
def test_boot_keeps_the_pools_not_a_second_cache(model, pmodel, prompt, topology, monkeypatch):
    """A static batch's prefill on a paged cache: what the cache rank's boot waits for is the
    pools and the table (its K/V read through them one layer at a time), not each layer's
    prompt K/V in contiguous copies, which would hold a second cache until the boot."""
    from spade.runtime.selector import AsyncSelector

    kept = []
    real = AsyncSelector.prefill

    def spy(self, layer, q, k_cache, v_cache, kv_lens, pool=None):
        real(self, layer, q, k_cache, v_cache, kv_lens, pool=pool)
        kept.append((self.boot[layer][1], self.boot[layer][2], self.boot_table))

    monkeypatch.setattr(AsyncSelector, "prefill", spy)
    over = [f"runtime.topology={topology}", "runtime.pack_layers=2", "policy.score_keys=int4"]
    want, _ = tokens(model, prompt, *over)
    got, tr = tokens(pmodel, prompt, *over)
    assert got == want and tr.stats["sparse_steps"] > 0
    paged = kept[-pmodel.spec.n_layers:]
    assert all(k is pmodel.k_cache[i] and v is pmodel.v_cache[i] and t is not None for i, (k, v, t) in enumerate(paged))


def test_a_static_batch_cache_rank_of_its_own_restarted_on_a_paged_cache(pmodel, prompt, monkeypatch):
    """`local`, int4, a static batch on a paged cache: the cache rank dies at step 6; its
    successor boots from the pools at the current cursor, into pool copies of its own again
    (every row's positions mapped), and the generation completes, sparse after the restore."""
    from spade.runtime import cache_rank as CR
    from spade.runtime.protocol import CacheHooks

    gens, real = [], CR._Generation.run

    async def recorded(self):
        gens.append(self)
        return await real(self)

    monkeypatch.setattr(CR._Generation, "run", recorded)
    cfg = make("runtime.topology=local", "runtime.pack_layers=2", "policy.score_keys=int4",
               "runtime.peer_deadline_s=1.5", "runtime.late_timeout_s=1")
    rt = AsyncRuntime(cfg, pmodel, build_policy(cfg.policy, pmodel.spec), hooks=CacheHooks(die_at_step=6))
    try:
        tr = rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)
    finally:
        rt.close()
    assert all(len(r) == NEW for r in tr.tokens)
    assert [e["event"] for e in tr.stats["events"]] == ["peer_lost", "peer_restored"]
    assert len(gens) == 2 and all(g.copy_blocks is not None for g in gens)
    copies = [st for st in gens[-1].state.layers if st is not None and st.kq is not None]
    assert copies and all(st.paged and st.kq.shape[0] == pmodel.k_cache[0].shape[0] for st in copies)
    assert all(gens[-1].copy_blocks.held(b) > 0 for b in range(B))


# ----------------------------------------------------------------------------- GPU
@pytest.fixture
def _triton(monkeypatch):
    monkeypatch.delenv("SPADE_KERNELS", raising=False)


@pytest.mark.gpu
@pytest.mark.parametrize("over", [[], ["runtime.topology=colocated", "runtime.pack_layers=2"],
                                  ["runtime.topology=colocated", "runtime.pack_layers=2", "policy.refresh_every=4"],
                                  # a channel subset in the pools, re-chosen (requantised through the table)
                                  ["policy.score_keys=int8", "policy.score_channels=16", "policy.channel_refresh=1.05"],
                                  ["runtime.topology=local", "runtime.return_mode=kv"]])
def test_gpu_paged_equals_contiguous_with_graphs(_triton, prompt, over):
    """bf16, Triton kernels, CUDA graphs: the paged model's tokens are the contiguous
    model's (the paged kernels compute the same tiles in the same order)."""
    torch.manual_seed(1234)
    base = FastModel.from_config(preset_config("tiny"), device="cuda:0", dtype=torch.bfloat16, max_batch=B,
                                 max_seq_len=64)
    paged = paged_model("cuda:0", torch.bfloat16, block_size=16, max_seq_len=64)
    want, _ = tokens(base, prompt, *over)
    got, tr = tokens(paged, prompt, *over)
    assert got == want
    if tr is not None:
        assert tr.stats["sparse_steps"] > 0

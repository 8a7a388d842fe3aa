"""AsyncRuntime on CUDA: FastModel with CUDA graphs per pack, Triton kernels, the
cache rank on a side stream (colocated), on a second GPU (local) or in its own
process (multiprocess, NCCL). Skipped without GPUs; run by the lead on H100/H200."""

from __future__ import annotations

import pytest
import torch

from spade.policies import build_policy
from spade.runtime.asyncrt import AsyncRuntime
from spade.runtime.inline import InlineRuntime
from spade.runtime.protocol import CacheHooks
from tests.runtime.conftest import B, NEW, T, config, free_port, greedy


@pytest.fixture(autouse=True)
def _triton(_torch_kernels, monkeypatch):
    monkeypatch.delenv("SPADE_KERNELS", raising=False)


@pytest.fixture(scope="module")
def gpu_model():
    from spade.models.fast import FastModel
    from spade.models.presets import preset_config

    torch.manual_seed(1234)
    return FastModel.from_config(preset_config("tiny"), device="cuda:0", dtype=torch.bfloat16, max_batch=B,
                                 max_seq_len=64)


def _run(model, prompt, *over, hooks=None):
    cfg = config(*over)
    rt = AsyncRuntime(cfg, model, build_policy(cfg.policy, model.spec), hooks=hooks)
    try:
        return rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)
    finally:
        rt.close()


@pytest.fixture(scope="module")
def gpu_inline(gpu_model, prompt):
    cfg = config()
    return InlineRuntime(cfg, gpu_model, build_policy(cfg.policy, gpu_model.spec)).generate(
        *prompt, max_new_tokens=NEW, sample_fn=greedy).tokens


@pytest.mark.gpu
@pytest.mark.parametrize("pack,mode", [(1, "indices"), (2, "kv"), (2, "delta")])
def test_colocated_side_stream_matches_inline(gpu_model, prompt, gpu_inline, pack, mode):
    assert gpu_model.use_cuda_graphs
    tr = _run(gpu_model, prompt, "runtime.topology=colocated", f"runtime.pack_layers={pack}",
              f"runtime.return_mode={mode}")
    assert tr.tokens == gpu_inline
    assert tr.stats["sparse_steps"] > 0


@pytest.mark.gpu
def test_stale_with_graphs_counts_late_packs(gpu_model, prompt):
    tr = _run(gpu_model, prompt, "runtime.topology=colocated", "runtime.pack_layers=2", "runtime.on_late=stale",
              hooks=CacheHooks(stall_from_step=10))
    assert tr.late_packs == (NEW - 10) * 2 == tr.stats["stale_packs"]
    assert all(len(r) == NEW for r in tr.tokens)


@pytest.mark.multigpu
@pytest.mark.parametrize("mode", ["indices", "kv"])
def test_local_second_gpu_matches_inline(gpu_model, prompt, gpu_inline, mode):
    tr = _run(gpu_model, prompt, "runtime.topology=local", "runtime.cache_device=cuda:1", "runtime.pack_layers=2",
              f"runtime.return_mode={mode}")
    assert tr.stats["cache_device"] == "cuda:1"
    assert tr.tokens == gpu_inline


@pytest.mark.multigpu
def test_multiprocess_nccl_matches_inline(gpu_model, prompt, gpu_inline):
    tr = _run(gpu_model, prompt, "runtime.topology=multiprocess", "runtime.cache_device=cuda:1",
              "runtime.transport.name=nccl", f"runtime.transport.master_port={free_port()}",
              "runtime.pack_layers=2")
    assert tr.tokens == gpu_inline
    assert T + NEW <= 64

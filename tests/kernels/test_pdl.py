"""Programmatic dependent launch: mode switch, the sm_90 build (wait / release in the
right order) and, on a GPU, identical results
with PDL on and off (eager and captured)."""

from __future__ import annotations

import pytest
import torch

from spade.kernels import gemv
from spade.kernels.pdl import (DEFAULT_MODE, PDL_MODES, SHARED_MODE, capture_key, pdl_enabled, pdl_kwargs, pdl_mode,
                              shared_gpu)
from tests.kernels.aot import run_aot_script


def test_mode_from_environment(monkeypatch):
    monkeypatch.delenv("SPADE_PDL", raising=False)
    assert pdl_mode() == DEFAULT_MODE and PDL_MODES == ("auto", "all", "decode", "off")
    monkeypatch.setenv("SPADE_PDL", "auto")
    assert pdl_mode() == DEFAULT_MODE
    monkeypatch.setenv("SPADE_PDL", " OFF ")
    assert pdl_mode() == "off"
    monkeypatch.setenv("SPADE_PDL", "decode")
    assert pdl_mode() == "decode"
    monkeypatch.setenv("SPADE_PDL", "on")
    with pytest.raises(ValueError, match="SPADE_PDL must be one of"):
        pdl_mode()


def test_shared_gpu_resolves_auto_only(monkeypatch):
    """Inside ``shared_gpu`` (a cache rank on the inference GPU) ``auto`` is SHARED_MODE,
    an explicit mode stays itself; the scope nests, restores, and is this thread's only."""
    import threading

    assert SHARED_MODE == "decode" != DEFAULT_MODE
    monkeypatch.delenv("SPADE_PDL", raising=False)
    with shared_gpu():
        assert pdl_mode() == SHARED_MODE
        other = []
        th = threading.Thread(target=lambda: other.append(pdl_mode()))
        th.start()
        th.join()
        assert other == [DEFAULT_MODE]
        with shared_gpu(False):
            assert pdl_mode() == DEFAULT_MODE
        assert pdl_mode() == SHARED_MODE
        monkeypatch.setenv("SPADE_PDL", "all")
        assert pdl_mode() == "all"
        monkeypatch.setenv("SPADE_PDL", "off")
        assert pdl_mode() == "off"
        monkeypatch.setenv("SPADE_PDL", "auto")
        assert pdl_mode() == SHARED_MODE
    assert pdl_mode() == DEFAULT_MODE


def test_families(monkeypatch):
    """``decode`` leaves the selection kernels without PDL; the family is checked. (On a
    CPU nothing launches with PDL; the rule is visible through a stubbed capability.)"""
    import spade.kernels.pdl as P

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(P, "_capability", lambda index: (9, 0))
    cuda = torch.device("cuda", 0)
    for mode, want in [("all", (True, True)), ("decode", (True, False)), ("off", (False, False))]:
        monkeypatch.setenv("SPADE_PDL", mode)
        assert (pdl_enabled(cuda, "decode"), pdl_enabled(cuda, "select")) == want, mode
        assert pdl_kwargs(torch.empty(0, device="meta"), "select") == {"PDL": False, "launch_pdl": False}
    monkeypatch.setattr(P, "_capability", lambda index: (8, 0))
    monkeypatch.setenv("SPADE_PDL", "all")
    assert not pdl_enabled(cuda)  # before Hopper: never
    with pytest.raises(ValueError, match="family must be one of"):
        pdl_enabled(cuda, "cache")


def test_enabled_only_on_compiled_cuda(monkeypatch):
    monkeypatch.delenv("SPADE_PDL", raising=False)
    assert not pdl_enabled(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # decided before any CUDA query
    assert not pdl_enabled(torch.device("cuda", 0))
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("SPADE_PDL", "off")
    assert not pdl_enabled(torch.device("cuda", 0))


def test_capture_key_follows_the_environment(monkeypatch):
    monkeypatch.delenv("SPADE_PDL", raising=False)
    monkeypatch.delenv("SPADE_SELECT_OVERLAP", raising=False)
    base = capture_key()
    monkeypatch.setenv("SPADE_PDL", "off")
    off = capture_key()
    monkeypatch.setenv("SPADE_SELECT_OVERLAP", "off")
    assert len({base, off, capture_key()}) == 3


_AOT = r'''
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from spade.kernels import gemv as G

def build(pdl, glu=False):
    sig = dict(x_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", out_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32",
               M="i32", N="i32", stride_xm="i32", stride_wn="i32", stride_om="i32")
    cons = dict(K=4096, K_PER_SPLIT=1024, SPLIT_K=4, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, VARIANT=0,
                HAS_BIAS=False, EVEN_K=True, EVEN_N=True, UPCAST=False, IEEE=False, PDL=pdl, GLU=glu)
    sig.update({k: "constexpr" for k in cons})
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(G._gemv_kernel.arg_names) if n.endswith("_ptr")}
    k = triton.compile(ASTSource(G._gemv_kernel, sig, cons, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, num_stages=3))
    ptx = k.asm["ptx"]
    body = ptx[ptx.find(".entry"):]
    def at(s):
        return body.find(s)
    first_load = min(i for i in (at("cp.async"), at("ld.global")) if i >= 0)
    return dict(wait=at("griddepcontrol.wait"), release=at("griddepcontrol.launch_dependents"),
                first_load=first_load)

print(json.dumps({"pdl": build(True), "plain": build(False), "glu": build(True, glu=True)}))
'''


def test_gemv_builds_with_pdl_for_hopper():
    """sm_90 build of the GEMV: with PDL the wait comes before the first load (of x or w);
    without PDL none of it is emitted. The GLU variant lets its dependents launch only
    after its weight loop."""
    res = run_aot_script(_AOT)
    pdl, plain = res["pdl"], res["plain"]
    assert 0 <= pdl["wait"] < pdl["release"] < pdl["first_load"], pdl
    assert plain["wait"] == -1 and plain["release"] == -1, plain
    # the fused gate/up + SiLU GEMV (followed by the down GEMV) releases its dependents after its loop
    glu = res["glu"]
    assert 0 <= glu["wait"] < glu["first_load"] < glu["release"], glu


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_cuda_kernels_match_with_and_without_pdl(monkeypatch):
    """The GEMV (split-K and not) and the decode attention
    give bit-identical results with PDL on and off, in a chain of dependent launches
    (each kernel reads the previous one's output) replayed from a CUDA graph."""
    from spade.kernels.attention import sparse_decode_attention_triton

    dev = torch.device("cuda")
    if not pdl_enabled(dev):
        pytest.skip("PDL needs compute capability 9.0+")
    g = torch.Generator(device=dev).manual_seed(3)
    B, Hq, Hkv, L, D, H = 3, 8, 2, 301, 64, 512
    w1 = torch.randn(Hq * D, H, device=dev, dtype=torch.bfloat16, generator=g) * 0.05
    w2 = torch.randn(H, Hq * D, device=dev, dtype=torch.bfloat16, generator=g) * 0.05
    k = torch.randn(B, Hkv, L, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, Hkv, L, D, device=dev, dtype=torch.bfloat16, generator=g)
    lens = torch.tensor([301, 17, 200], device=dev, dtype=torch.int32)
    idx = torch.stack([torch.randperm(L - 70, device=dev, generator=g)[:33] + 4 for _ in range(B * Hkv)])
    idx = idx.reshape(B, Hkv, 33).to(torch.int32)
    x0 = torch.randn(B, H, device=dev, dtype=torch.bfloat16, generator=g)

    def chain(x):
        for _ in range(3):
            q = gemv.linear_triton(x, w1, config=(64, 128, 4, 4, 3, "dot")).reshape(B, Hq, D)
            o = sparse_decode_attention_triton(q, k, v, lens, idx, n_sink=4, n_recent=16)
            o = sparse_decode_attention_triton(o, k, v, lens)  # dense path
            x = gemv.linear_triton(o.reshape(B, -1), w2, config=(32, 256, 1, 4, 3, "dot"))
        return x

    results = {}
    for mode in ("off", "auto"):
        monkeypatch.setenv("SPADE_PDL", mode)
        eager = chain(x0)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            chain(x0)  # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = chain(x0)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, eager, rtol=0, atol=0, msg=f"{mode}: graph vs eager")
        results[mode] = eager
    ref = results["off"]
    for key, r in results.items():
        torch.testing.assert_close(r, ref, rtol=0, atol=0, msg=f"{key} vs PDL off")

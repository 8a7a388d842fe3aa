"""Programmatic dependent launch: mode switch, GEMV prefetch sizing, the sm_90 build
(wait / release / L2 prefetch in the right order) and, on a GPU, identical results
with PDL on and off (eager and captured)."""

from __future__ import annotations

import pytest
import torch

from spade.kernels import gemv
from spade.kernels.pdl import DEFAULT_MODE, PDL_MODES, capture_key, pdl_enabled, pdl_kwargs, pdl_mode
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
    monkeypatch.delenv("SPADE_GEMV_PREFETCH", raising=False)
    base = capture_key()
    monkeypatch.setenv("SPADE_PDL", "off")
    off = capture_key()
    monkeypatch.setenv("SPADE_GEMV_PREFETCH", "0")
    assert len({base, off, capture_key()}) == 3


def test_capture_key_holds_the_attention_release(monkeypatch):
    """``SPADE_ATTN_RELEASE`` is a launch setting a captured graph records: graphs key on it."""
    monkeypatch.delenv("SPADE_ATTN_RELEASE", raising=False)
    base = capture_key()
    monkeypatch.setenv("SPADE_ATTN_RELEASE", "early")
    assert capture_key() != base


def test_prefetch_lines(monkeypatch):
    monkeypatch.delenv("SPADE_GEMV_PREFETCH", raising=False)
    # default: PREFETCH_TILES tiles of 128 bf16 = 2 lines each
    assert gemv._prefetch_lines(4096, 128, 2) == gemv.PREFETCH_TILES * 2  # (off by default: 0)
    monkeypatch.setenv("SPADE_GEMV_PREFETCH", "2")
    assert gemv._prefetch_lines(4096, 128, 2) == 4
    assert gemv._prefetch_lines(64, 128, 2) == 1  # the K slice is shorter than the tiles
    assert gemv._prefetch_lines(16, 16, 2) == 0  # under one line: nothing
    monkeypatch.setenv("SPADE_GEMV_PREFETCH", "3")
    assert gemv._prefetch_lines(4096, 256, 2) == 8  # 12 lines rounded down to a power of two
    monkeypatch.setenv("SPADE_GEMV_PREFETCH", "0")
    assert gemv._prefetch_lines(4096, 256, 2) == 0
    for bad in ("-1", "two"):
        monkeypatch.setenv("SPADE_GEMV_PREFETCH", bad)
        with pytest.raises(ValueError, match="SPADE_GEMV_PREFETCH"):
            gemv._prefetch_lines(4096, 256, 2)


_AOT = r'''
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from spade.kernels import gemv as G

def build(pdl, pf, glu=False):
    sig = dict(x_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", out_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32",
               M="i32", N="i32", stride_xm="i32", stride_wn="i32", stride_om="i32")
    cons = dict(K=4096, K_PER_SPLIT=1024, SPLIT_K=4, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, VARIANT=0,
                HAS_BIAS=False, EVEN_K=True, EVEN_N=True, UPCAST=False, IEEE=False, PDL=pdl, PF_LINES=pf,
                LINE_ELEMS=64, GLU=glu)
    sig.update({k: "constexpr" for k in cons})
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(G._gemv_kernel.arg_names) if n.endswith("_ptr")}
    k = triton.compile(ASTSource(G._gemv_kernel, sig, cons, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, num_stages=3))
    ptx = k.asm["ptx"]
    body = ptx[ptx.find(".entry"):]
    def at(s):
        return body.find(s)
    first_load = min(i for i in (at("cp.async"), at("ld.global")) if i >= 0)
    return dict(prefetch=body.count("prefetch.global.L2"), wait=at("griddepcontrol.wait"),
                release=at("griddepcontrol.launch_dependents"), first_prefetch=at("prefetch.global.L2"),
                first_load=first_load)

print(json.dumps({"pdl_pf": build(True, 4), "pdl": build(True, 0), "plain": build(False, 0),
                  "glu": build(True, 0, glu=True)}))
'''


def test_gemv_builds_with_pdl_for_hopper():
    """sm_90 build of the GEMV: with PDL the weight prefetch comes before the wait, and
    the wait before the first load (of x or w); without PDL none of it is emitted. The
    GLU variant lets its dependents launch only after its weight loop."""
    res = run_aot_script(_AOT)
    pf, pdl, plain = res["pdl_pf"], res["pdl"], res["plain"]
    assert pf["prefetch"] >= 1 and 0 <= pf["first_prefetch"] < pf["wait"] < pf["release"] < pf["first_load"], pf
    assert pdl["prefetch"] == 0 and 0 <= pdl["wait"] < pdl["first_load"], pdl
    assert plain["prefetch"] == 0 and plain["wait"] == -1 and plain["release"] == -1, plain
    # the fused gate/up + SiLU GEMV (followed by the down GEMV) releases its dependents after its loop
    glu = res["glu"]
    assert 0 <= glu["wait"] < glu["first_load"] < glu["release"], glu


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_cuda_kernels_match_with_and_without_pdl(monkeypatch):
    """The GEMV (split-K and not, with and without the prefetch) and the decode attention
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
    for mode, pf in [("off", "0"), ("auto", "0"), ("auto", "4")]:
        monkeypatch.setenv("SPADE_PDL", mode)
        monkeypatch.setenv("SPADE_GEMV_PREFETCH", pf)
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
        torch.testing.assert_close(y, eager, rtol=0, atol=0, msg=f"{mode} pf={pf}: graph vs eager")
        results[(mode, pf)] = eager
    ref = results[("off", "0")]
    for key, r in results.items():
        torch.testing.assert_close(r, ref, rtol=0, atol=0, msg=f"{key} vs PDL off")

"""``spade.kernels.gemv``: the decode GEMV against its torch reference and ``F.linear`` in fp32.

CPU runs go through the Triton interpreter (small shapes only); the ``gpu`` test
runs the Qwen3-8B projection shapes on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spade.kernels import gemv as G
from spade.kernels.gemv import GemvConfig, gemv_config, linear_glu_ref, linear_glu_triton, linear_ref, linear_triton

N, K = 77, 200  # odd on purpose: tail rows of w and a ragged last K tile


def _inputs(M, n, k, dtype, device, bias=True):
    x = (torch.randn(M, k, device=device) / k**0.5).to(dtype)
    w = torch.randn(n, k, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    return x, w, b


def _check_close(y, x, w, b):
    """``y`` vs the fp32 product: bf16/fp16 outputs within output rounding (plus fp32
    summation order), fp32 within summation order; also equal to ``linear_ref`` up to one
    rounding step of the output dtype."""
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.dtype == x.dtype and y.shape == exact.shape
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}[x.dtype]
    torch.testing.assert_close(y.double(), exact, rtol=tol, atol=tol)
    torch.testing.assert_close(y.float(), linear_ref(x, w, b).float(), rtol=2 * tol, atol=2 * tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 8, 16, 17, 32])
@pytest.mark.parametrize("bias", [False, True])
def test_heuristic_config(device, M, dtype, bias):
    x, w, b = _inputs(M, N, K, dtype, device, bias)
    _check_close(linear_triton(x, w, b), x, w, b)


CONFIGS = [
    GemvConfig(32, 64, 1, 4, 2, "dot"),
    GemvConfig(16, 64, 2, 4, 2, "dot"),  # split-K, ragged last split
    GemvConfig(64, 32, 4, 4, 3, "dot"),  # split-K over more splits than tiles need
    GemvConfig(16, 64, 1, 4, 2, "sum"),
    GemvConfig(16, 64, 3, 4, 2, "sum"),
    GemvConfig(8, 128, 1, 2, 2, "fma"),
    GemvConfig(32, 32, 2, 4, 2, "fma"),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(map(str, c.as_tuple())))
@pytest.mark.parametrize("M", [1, 5, 17])
def test_forced_configs(device, cfg, M):
    x, w, b = _inputs(M, N, K, torch.bfloat16, device)
    _check_close(linear_triton(x, w, b, config=cfg), x, w, b)


def test_split_k_deterministic_and_counters_reset(device):
    """The split-K reduction sums the partials in split order: bitwise equal across calls;
    the ticket counters are left zeroed."""
    x, w, b = _inputs(8, 64, 256, torch.bfloat16, device)
    cfg = GemvConfig(16, 32, 8, 4, 2, "dot")
    y1 = linear_triton(x, w, b, config=cfg)
    y2 = linear_triton(x, w, b, config=cfg.as_tuple())
    assert torch.equal(y1, y2)
    _check_close(y1, x, w, b)
    assert int(G._counters(x.device, 1).abs().sum()) == 0


def test_even_shapes_fp16(device):
    x, w, b = _inputs(4, 64, 256, torch.float16, device)
    _check_close(linear_triton(x, w, b, config=GemvConfig(32, 128, 2, 4, 2, "dot")), x, w, b)


def test_out_and_strided_x(device):
    M = 6
    x, w, b = _inputs(M, N, K, torch.bfloat16, device)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=device)
    y = linear_triton(x, w, b, out=out)
    assert y.data_ptr() == out.data_ptr()
    _check_close(out, x, w, b)
    # rows strided (a slice of a wider buffer) and columns strided (made contiguous)
    wide = torch.zeros(M, K + 24, dtype=torch.bfloat16, device=device)
    wide[:, :K] = x
    _check_close(linear_triton(wide[:, :K], w, b), x, w, b)
    gapped = torch.zeros(M, 2 * K, dtype=torch.bfloat16, device=device)
    gapped[:, ::2] = x
    _check_close(linear_triton(gapped[:, ::2], w, b), x, w, b)
    # out as a row slice of a wider output buffer
    big = torch.zeros(M, N + 3, dtype=torch.bfloat16, device=device)
    linear_triton(x, w, None, out=big[:, :N])
    _check_close(big[:, :N], x, w, None)
    assert not big[:, N:].any()


def _silu_mul_two_step(gu: torch.Tensor) -> torch.Tensor:
    """The decode path's separate SiLU-product launch (``silu_mul``), on a GEMV output."""
    from spade.models.fast import triton_ops

    return triton_ops()["silu_mul"](gu)


GLU_CONFIGS = [None, GemvConfig(32, 64, 1, 4, 2, "dot"), GemvConfig(16, 64, 3, 4, 2, "dot"),
               GemvConfig(8, 64, 2, 4, 2, "sum"), GemvConfig(4, 32, 1, 4, 2, "fma")]


@pytest.mark.parametrize("cfg", GLU_CONFIGS, ids=lambda c: "heuristic" if c is None else "-".join(map(str, c.as_tuple())))
@pytest.mark.parametrize("M, I", [(1, 37), (5, 64), (17, 45)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glu_matches_reference_and_the_two_launches(device, cfg, M, I, dtype):
    """``linear_glu_triton`` (odd I: a ragged last block of gate / up rows; split-K configs)
    against the fp64 ``silu(x g^T) * (x u^T)``, against ``linear_glu_ref`` within a rounding
    step, and bit for bit against the unfused GEMV followed by the SiLU-product kernel (fp32 in
    the interpreter: within a few ulps)."""
    x, w, _ = _inputs(M, 2 * I, K, dtype, device, bias=False)
    y = linear_glu_triton(x, w, config=cfg)
    assert y.shape == (M, I) and y.dtype == dtype
    g, u = F.linear(x.double(), w.double()).chunk(2, dim=-1)
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(y.double(), F.silu(g) * u, rtol=tol, atol=tol)
    torch.testing.assert_close(y.float(), linear_glu_ref(x, w).float(), rtol=tol, atol=tol)
    # bit for bit on a GPU; the interpreter's numpy evaluates the epilogue's exp on other array
    # shapes than the elementwise kernel's (SIMD vs scalar lanes): a few fp32 ulps there
    exact = device.type == "cuda" or dtype != torch.float32
    torch.testing.assert_close(y, _silu_mul_two_step(linear_triton(x, w, config=cfg)),
                               rtol=0 if exact else 4e-6, atol=0 if exact else 1e-6)


def test_glu_out_and_bad_input(device):
    x, w, _ = _inputs(3, 2 * 45, K, torch.bfloat16, device, bias=False)
    out = torch.full((3, 45), float("nan"), dtype=torch.bfloat16, device=device)
    assert linear_glu_triton(x, w, out=out) is out
    torch.testing.assert_close(out, _silu_mul_two_step(linear_triton(x, w)), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"stack gate over up rows.*odd row count: shape \(89, 200\)"):
        linear_glu_triton(x, w[:89])
    with pytest.raises(ValueError, match=r"out must be \[M, I\]=\[3, 45\]"):
        linear_glu_triton(x, w, out=torch.empty(3, 90, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match=r"w has K=100 columns but x has K=200"):
        linear_glu_triton(x, w[:, :100].contiguous())


def test_dispatch_cpu_uses_reference():
    x, w, b = _inputs(2, 9, 16, torch.float32, "cpu")
    torch.testing.assert_close(G.linear(x, w, b), linear_ref(x, w, b))
    out = torch.empty(2, 9)
    assert G.linear(x, w, b, out=out) is out


@pytest.mark.parametrize(
    "args, match",
    [
        (((3, 2, 16), (8, 16)), r"x must be 2-D \[M, K\], got shape \(3, 2, 16\)"),
        (((2, 16), (16,)), r"w must be 2-D \[N, K\].*\(16,\)"),
        (((2, 16), (8, 12)), r"w has K=12 columns but x has K=16.*pass the nn.Linear weight"),
        (((33, 16), (8, 16)), r"M=33 rows \(shape \(33, 16\)\).*1 <= M <= 32.*F.linear"),
        (((0, 16), (8, 16)), r"M=0 rows"),
    ],
)
def test_bad_shapes(args, match):
    xs, ws = args
    with pytest.raises(ValueError, match=match):
        linear_triton(torch.randn(*xs), torch.randn(*ws))


def test_bad_dtype_bias_out_w_layout():
    x = torch.randn(2, 16)
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"share a float dtype.*x torch.float32 and w torch.bfloat16"):
        linear_triton(x, w.bfloat16())
    with pytest.raises(ValueError, match=r"bias must be \[N\]=\[8\].*\(7,\)"):
        linear_triton(x, w, torch.randn(7))
    with pytest.raises(ValueError, match=r"out must be \[M, N\]=\[2, 8\].*\(8, 2\)"):
        linear_triton(x, w, out=torch.empty(8, 2))
    with pytest.raises(ValueError, match=r"w must be row-major.*w.contiguous\(\)"):
        linear_triton(x, torch.randn(16, 8).t())
    with pytest.raises(ValueError, match="variant must be one of"):
        linear_triton(x, w, config=(16, 64, 1, 4, 2, "mma"))
    with pytest.raises(ValueError, match="BLOCK_K must be a power of two"):
        GemvConfig(BLOCK_K=100)


QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
            "lm_head": (151936, 4096)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_heuristic_is_valid_for_model_shapes(dtype, monkeypatch):
    monkeypatch.setattr(G, "GEMV_OVERRIDES", {})  # the heuristic itself
    for n, k in QWEN3_8B.values():
        for M in (1, 2, 4, 8, 16, 32):
            cfg = gemv_config(M, n, k, dtype)
            assert isinstance(cfg, GemvConfig) and cfg.variant == "dot"
            elt = torch.empty((), dtype=dtype).element_size()
            smem = cfg.num_stages * (cfg.BLOCK_N + G._block_m(M, "dot")) * cfg.BLOCK_K * elt
            assert smem <= G.SMEM_BYTES, (n, k, M, cfg)
    split = {name: gemv_config(8, n, k).SPLIT_K for name, (n, k) in QWEN3_8B.items()}
    assert split == {"qkv": 1, "o": 4, "gate_up": 1, "down": 8, "lm_head": 1}
    assert gemv_config(8, *QWEN3_8B["lm_head"]).BLOCK_N == 128


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tuned_configs_fit_shared_memory(dtype):
    elt = torch.empty((), dtype=dtype).element_size()
    for n, k in QWEN3_8B.values():
        for M in range(1, G.MAX_M + 1):
            cfg = gemv_config(M, n, k, dtype)
            assert cfg.num_stages * (cfg.BLOCK_N + G._block_m(M, cfg.variant)) * cfg.BLOCK_K * elt <= G.SMEM_BYTES


def test_tuned_table_is_valid():
    for key, v in G.GEMV_OVERRIDES.items():
        cfg = G._as_config(v)
        M = key[2] if len(key) == 3 else G.MAX_M
        smem = cfg.num_stages * (cfg.BLOCK_N + G._block_m(M, cfg.variant)) * cfg.BLOCK_K * 2
        assert smem <= G.SMEM_BYTES, (key, cfg)
    assert gemv_config(8, 4096, 4096) == GemvConfig(64, 128, 4, 4, 3, "dot")  # o_proj M=8: the M=16 entry


def test_prefers_triton_and_make_linear():
    """Tuned shapes go to the GEMV except the buckets where cuBLAS measured faster; untimed
    shapes, batches past MAX_M and CPU tensors stay on F.linear under ``auto``."""
    assert G.prefers_triton(8, 6144, 4096) and G.prefers_triton(1, 151936, 4096)
    assert G.prefers_triton(8, 4096, 12288) and not G.prefers_triton(24, 4096, 12288)  # down: cuBLAS at M=17..32
    assert not G.prefers_triton(32, 6144, 4096) and G.prefers_triton(32, 24576, 4096)
    assert not G.prefers_triton(8, 77, 200)  # never timed
    assert not G.prefers_triton(33, 24576, 4096) and not G.prefers_triton(0, 24576, 4096)
    for key in G.CUBLAS_WINS:
        assert key in G.GEMV_OVERRIDES, key  # a cuBLAS win is a measured bucket
    w = torch.empty(6144, 4096, dtype=torch.bfloat16, device="meta")
    assert G.make_linear("cublas", 8, w) is F.linear
    assert G.make_linear("triton", 8, w) is linear_triton
    assert G.make_linear("triton", 40, w) is F.linear  # past MAX_M
    assert G.make_linear("auto", 8, w) is F.linear  # not CUDA
    with pytest.raises(ValueError, match="linear mode must be one of"):
        G.make_linear("fast", 8, w)
    from spade.models.fast import LINEAR_MODES

    assert LINEAR_MODES == G.LINEAR_MODES


def test_overrides_win(monkeypatch):
    monkeypatch.setattr(G, "GEMV_OVERRIDES", {})
    G.GEMV_OVERRIDES[(4096, 4096)] = (32, 128, 4, 8, 3, "dot")
    assert gemv_config(8, 4096, 4096) == GemvConfig(32, 128, 4, 8, 3, "dot")
    G.GEMV_OVERRIDES[(4096, 4096, 1)] = {"BLOCK_N": 16, "variant": "fma"}
    G.GEMV_OVERRIDES[(4096, 4096, 16)] = (64, 128, 2, 4, 3, "dot")
    assert gemv_config(1, 4096, 4096) == GemvConfig(BLOCK_N=16, variant="fma")
    # other batches: the nearest tuned batch at or above, else the largest tuned
    assert gemv_config(2, 4096, 4096) == gemv_config(16, 4096, 4096) == GemvConfig(64, 128, 2, 4, 3, "dot")
    assert gemv_config(32, 4096, 4096) == GemvConfig(64, 128, 2, 4, 3, "dot")
    assert gemv_config(8, 4096, 4097) != GemvConfig(32, 128, 4, 8, 3, "dot")


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 32])
def test_gpu_glu_model_shape(M):
    """Qwen3-8B's gate/up (I=12288, K=4096) fused with the SiLU product, tuned config:
    bit-identical to the two launches, eager and replayed from a CUDA graph."""
    dev = torch.device("cuda")
    n, k = QWEN3_8B["gate_up"]
    x, w, _ = _inputs(M, n, k, torch.bfloat16, dev, bias=False)
    two = _silu_mul_two_step(linear_triton(x, w))
    torch.testing.assert_close(linear_glu_triton(x, w), two, rtol=0, atol=0)
    out = torch.empty_like(two)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        linear_glu_triton(x, w, out=out)
    x.copy_(torch.randn_like(x) / k**0.5)
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, _silu_mul_two_step(linear_triton(x, w)), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 32])
def test_gpu_model_shapes(M):
    """Realistic shapes on CUDA: heuristic config vs F.linear in fp32, and a graph replay."""
    dev = torch.device("cuda")
    for name, (n, k) in QWEN3_8B.items():
        x, w, b = _inputs(M, n, k, torch.bfloat16, dev, bias=name == "qkv")
        y = linear_triton(x, w, b)
        _check_close(y, x, w, b)
        out = torch.empty_like(y)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            linear_triton(x, w, b, out=out)
        x.copy_(torch.randn_like(x) / k**0.5)
        g.replay()
        torch.cuda.synchronize()
        _check_close(out, x, w, b)

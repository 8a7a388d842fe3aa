"""GSM8K plumbing: answer parsing, prefill-once decoding equals HF greedy
generation, policies do not leak into each other, and the run writes its file."""

import json

import torch

from spade.policies.asyncspade import AsyncSpadePolicyConfig
from spade.policies.full import FullPolicyConfig
from spade.policies.oracle import OraclePolicyConfig
from spade.eval.config import Gsm8kEvalConfig
from spade.eval.generation import gold_answer, load_gsm8k, parse_answer


def test_gold_and_parsed_answers():
    assert gold_answer("so 3 + 4 = <<3+4=7>>7\n#### 1,234") == "1234"
    assert parse_answer("She has 5 apples.\n#### 18") == "18"
    assert parse_answer("Total: $1,250.00 dollars") == "1250"
    assert parse_answer("The answer is \\boxed{42}. Then 7.") == "42"
    assert parse_answer("#### -3.5") == "-3.5"
    assert parse_answer("no digits at all") is None
    probs = load_gsm8k(3, first=1)
    assert len(probs) == 3 and probs[0]["idx"] == 1 and probs[0]["answer"].lstrip("-").isdigit()


def test_prefilled_decoding_equals_hf_generate(smollm2):
    from spade.eval.decoding import agreement, chat_prompt, decode, encode_batch, prefill
    from spade.models.hf import HFBackend
    from spade.policies import build_policy

    model, tok = smollm2
    backend = HFBackend(model, tok)
    texts = [chat_prompt(tok, q) for q in ("What is 2 + 3?", "Name a colour of the sky on a clear day, please.")]
    ids, mask = encode_batch(tok, texts)
    n = 10
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                             pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    pre = prefill(backend, ids, mask)
    eos = backend.eos_token_ids
    full, _ = decode(backend, pre, build_policy(FullPolicyConfig(), backend.spec), n, eos)
    for b in range(2):
        want = [t for t in ref[b].tolist()]
        cut = next((i for i, t in enumerate(want) if t in eos), len(want))
        assert full[b] == want[:cut]
    # a sparse run in between must not disturb the next one (cache cropped back to the prompt)
    sparse_pc = AsyncSpadePolicyConfig(budget=24, sink_tokens=2, recent_tokens=4, predictor="assembled")
    sparse, att = decode(backend, pre, build_policy(sparse_pc, backend.spec), n, eos)
    assert att <= 24 + 1e-9
    again, _ = decode(backend, pre, build_policy(FullPolicyConfig(), backend.spec), n, eos)
    assert again == full
    # a budget covering prompt + generation is full attention
    big, _ = decode(backend, pre, build_policy(OraclePolicyConfig(budget=512), backend.spec), n, eos)
    assert big == full
    assert agreement(full[0], full[0]) == (1.0, 1.0)
    assert agreement([1, 2, 3, 4], [1, 2, 9, 4]) == (0.5, 0.75)


def test_run_gsm8k_plumbing(smollm2, tmp_path):
    from spade.eval.generation import run_gsm8k

    cfg = Gsm8kEvalConfig(model="smollm2-135m", n_problems=2, batch_size=2, max_new_tokens=6, budgets=[32],
                          sink_tokens=2, recent_tokens=4, policies=[{"name": "asyncspade", "predictor": "last"}])
    res = run_gsm8k(cfg, tmp_path, "cpu")
    full, sparse = res["rows"]
    assert full["run"] == "full" and full["prefix_agreement"] == 1.0 and full["changed_vs_full"] == 0
    assert sparse["run"] == "asyncspade[last] K=32"
    assert 0.0 <= sparse["token_agreement"] <= 1.0 and sparse["n"] == 2
    data = json.loads((tmp_path / "gsm8k_smollm2-135m.json").read_text())
    assert len(data["rows"][0]["samples"]) == 2
    assert (tmp_path / "gsm8k_smollm2-135m.png").is_file()


def test_backend_snapshot_restore(smollm2):
    """``HFBackend.snapshot``/``restore``: decoding after a restore repeats the
    same logits, and a snapshot whose cache was cropped below it is refused."""
    import pytest

    from spade.attention import AttentionContext, InlineSelector
    from spade.models.hf import HFBackend
    from spade.policies import build_policy

    model, tok = smollm2
    backend = HFBackend(model, tok)
    ids = tok(["The sky is", "One, two,"], add_special_tokens=False, return_tensors="pt", padding=True)
    pol = build_policy(OraclePolicyConfig(budget=8, sink_tokens=1, recent_tokens=2), backend.spec)

    def run(steps: int) -> list[torch.Tensor]:
        ctx = AttentionContext(backend.spec, InlineSelector(pol, pol.new_state(2, backend.device)), device=backend.device)
        nxt, out = backend.last_logits.argmax(-1), []
        for _ in range(steps):
            out.append(backend.decode(nxt, ctx).clone())
            nxt = out[-1].argmax(-1)
        return out

    first = backend.prefill(ids["input_ids"], ids["attention_mask"],
                            AttentionContext(backend.spec, InlineSelector(pol, pol.new_state(2, backend.device)),
                                             device=backend.device))
    snap = backend.snapshot()
    T = snap.seq_len
    a = run(3)
    assert backend.seq_len == T + 3 and snap.cache.get_seq_length() == T + 3
    backend.restore(snap)
    assert backend.seq_len == T and snap.cache.get_seq_length() == T
    assert torch.equal(backend.last_logits, first)
    b = run(3)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
    assert not torch.allclose(a[0], a[2])  # the steps really moved on
    backend.restore(snap)
    assert backend.seq_len == T and snap.cache.get_seq_length() == T
    snap.cache.crop(-1)  # below the snapshot: its tokens are gone
    with pytest.raises(RuntimeError, match="fewer"):
        backend.restore(snap)

"""Perplexity measurement: full attention through spade equals the plain HF
forward; a budget covering the context changes nothing; the file is written."""

import json
import math

import pytest

from spade.policies.oracle import OraclePolicyConfig
from spade.eval.common import essay_token_segments
from spade.eval.config import PerplexityEvalConfig


def test_nll_matches_sparse_perplexity(smollm2):
    from spade.eval.perplexity import nll_and_argmax
    from spade.eval.teacher import sparse_perplexity

    model, tok = smollm2
    ids = essay_token_segments(tok, 48, 1)[0]
    pc = OraclePolicyConfig(budget=24, sink_tokens=2, recent_tokens=4)
    nll, pred, attended = nll_and_argmax(model, ids, pc, 20)
    assert math.exp(nll) == pytest.approx(sparse_perplexity(model, ids, pc, 20), rel=1e-6)
    assert pred.shape == (28,)
    assert 20 <= attended <= 24 + 1e-9


def test_run_perplexity(smollm2, tmp_path):
    from spade.eval.perplexity import run_perplexity

    cfg = PerplexityEvalConfig(context_tokens=40, prefill_tokens=24, n_texts=1, budgets=[64], context_fractions=[2],  # K = 20
                               sink_tokens=2, recent_tokens=4,
                               policies=[{"name": "oracle"}, {"name": "asyncspade", "predictor": "last"},
                                         {"name": "tova"}])
    res = run_perplexity(cfg, tmp_path, "cpu")["models"]["smollm2-135m"]
    # full attention through spade's teacher forcing == the plain transformers forward
    assert res["ppl_full"] == pytest.approx(res["ppl_hf"], rel=1e-4)
    rows = {(r["budget"], r["policy"]): r for r in res["rows"]}
    for p in ("oracle", "asyncspade[last]", "tova"):
        r = rows["K=64", p]  # K >= context: dense, so exactly full attention
        assert r["ppl"] == pytest.approx(res["ppl_full"], rel=1e-4)
        assert r["top1_agreement"] == 1.0
        sparse = rows["K=ctx/2 (20)", p]
        assert sparse["mean_attended"] <= 20 + 1e-9
        assert 0.0 < sparse["top1_agreement"] <= 1.0
    data = json.loads((tmp_path / "perplexity_smollm2-135m.json").read_text())
    assert data["tokens_per_text"] == 16 and len(data["rows"]) == 6
    assert all(r["seconds"] >= 0 for r in data["rows"])
    assert (tmp_path / "perplexity_smollm2-135m.png").is_file()


def test_bad_policy_entry_fails_before_work(tmp_path):
    from spade.errors import ConfigError
    from spade.eval.perplexity import run_perplexity

    cfg = PerplexityEvalConfig(policies=[{"name": "asyncspade", "predictor": "nope"}])
    with pytest.raises(ConfigError, match="predictor"):
        run_perplexity(cfg, tmp_path, "cpu")


def test_prompt_cache_path_equals_teacher(smollm2):
    """The shared prompt pass + continuation (what run_perplexity uses) gives the
    NLL, argmax and attended counts of ``spade.eval.teacher`` on the whole text, for
    policies with per-step state (asyncspade's query window, TOVA's evictions;
    ``test_run_perplexity`` runs oracle/last/tova through this path too), and the cache is cropped back so the next policy starts from the
    same prompt (the policies run in a row on one ``PromptPass``)."""
    from spade.policies.full import FullPolicyConfig
    from spade.eval.common import policy_config
    from spade.eval.perplexity import PromptPass, continuation_nll, nll_and_argmax

    model, tok = smollm2
    ids = essay_token_segments(tok, 43, 1, offset_tokens=300)[0]  # odd length
    P = 31
    prompt = PromptPass(model, ids, P)
    full_nll, _, _ = continuation_nll(prompt, FullPolicyConfig())
    for entry in ({"name": "asyncspade", "predictor": "assembled", "rope_aware": True,
                   "group_reduce": "sum_softmax"},
                  {"name": "tova"}):
        pc = policy_config(entry, 16, sink_tokens=2, recent_tokens=4)
        ref_nll, ref_pred, ref_att = nll_and_argmax(model, ids, pc, P)
        nll, pred, att = continuation_nll(prompt, pc)
        assert nll == pytest.approx(ref_nll, rel=1e-5, abs=1e-5), entry
        assert pred.shape == (43 - P,)
        assert (pred == ref_pred).double().mean() >= 0.95  # near-ties may flip under fp32 reordering
        assert att == pytest.approx(ref_att)
        assert prompt.cache.get_seq_length() == P
        assert nll != pytest.approx(full_nll, rel=1e-6)  # the budget binds: sparse differs from dense


def test_first_text_moves_to_the_next_segment(smollm2, tmp_path):
    """``first_text`` = 1 scores the segment after the first (the same tokens as
    the second of ``n_texts`` = 2), not the first again."""
    from spade.eval.perplexity import run_perplexity

    base = dict(context_tokens=36, prefill_tokens=28, budgets=[], context_fractions=[2], sink_tokens=2,
                recent_tokens=4, policies=[{"name": "oracle"}])
    two = run_perplexity(PerplexityEvalConfig(n_texts=2, **base), tmp_path / "a", "cpu")["models"]["smollm2-135m"]
    second = run_perplexity(PerplexityEvalConfig(first_text=1, **base), tmp_path / "b",
                            "cpu")["models"]["smollm2-135m"]
    assert second["nll_full_per_text"][0] == pytest.approx(two["nll_full_per_text"][1], rel=1e-5)
    assert second["nll_full_per_text"][0] != pytest.approx(two["nll_full_per_text"][0], rel=1e-3)
    assert second["rows"][0]["nll_per_text"][0] == pytest.approx(two["rows"][0]["nll_per_text"][1], rel=1e-5)

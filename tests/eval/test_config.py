"""Eval settings: defaults validate, unknown keys and bad entries fail early,
``run_eval`` picks sections and writes its summary."""

import pytest
from pydantic import ValidationError

from spade.eval import eval_config, run_eval
from spade.eval.common import fraction_budget, policy_config, policy_label
from spade.eval.config import EvalConfig


def test_defaults_and_forbidden_keys():
    cfg = EvalConfig()
    assert cfg.out_dir == "results/eval"
    assert cfg.selection.enabled and cfg.perplexity.enabled and cfg.gsm8k.enabled and cfg.niah.enabled
    with pytest.raises(ValidationError):
        EvalConfig(selection={"nope": 1})
    with pytest.raises(ValidationError, match="budget"):
        EvalConfig(perplexity={"policies": [{"name": "oracle", "budget": 64}]})
    with pytest.raises(ValidationError, match="name"):
        EvalConfig(niah={"policies": [{"predictor": "last"}]})


def test_policy_entries():
    pc = policy_config({"name": "asyncspade", "predictor": "ridge"}, 64, sink_tokens=4, recent_tokens=16)
    assert (pc.name, pc.budget, pc.predictor, pc.sink_tokens, pc.recent_tokens) == ("asyncspade", 64, "ridge", 4, 16)
    q = policy_config({"name": "quest"}, 24, sink_tokens=4, recent_tokens=16)
    assert q.page_size == 12  # capped so two pages fit
    assert policy_config({"name": "tova"}, 32, sink_tokens=4, recent_tokens=16).budget == 32
    assert policy_label({"name": "asyncspade", "predictor": "last", "rope_aware": True}) == "asyncspade[last,rope]"
    assert policy_label({"name": "oracle", "group_reduce": "max_logits"}) == "oracle[max_logits]"
    assert policy_label({"name": "asyncspade", "recent_tokens": 64, "score_channels": 32}) == \
        "asyncspade[assembled,recent=64,score_channels=32]"  # an entry's own recent window is named
    assert fraction_budget(2048, 16, 28) == 128 and fraction_budget(300, 16, 28) == 28


def test_eval_config_from_placeholder():
    class Placeholder:
        out_dir = "x"
        extra = {"selection": {"positions": 5}}

    class Root:
        eval = Placeholder()

    e = eval_config(Root())
    assert e.out_dir == "x" and e.selection.positions == 5
    assert eval_config(EvalConfig()) is not None


def test_run_eval_sections(tmp_path):
    from spade.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown eval section"):
        run_eval(EvalConfig(), str(tmp_path), ["selections"])
    off = EvalConfig(selection={"enabled": False}, perplexity={"enabled": False}, gsm8k={"enabled": False},
                     niah={"enabled": False})
    with pytest.raises(ConfigError, match="no eval section"):
        run_eval(off, str(tmp_path), None)


def test_run_eval_writes_summary(smollm2, tmp_path):
    import json

    cfg = EvalConfig(perplexity={"context_tokens": 40, "prefill_tokens": 30, "n_texts": 1, "budgets": [],
                                 "context_fractions": [2], "sink_tokens": 2, "recent_tokens": 4,
                                 "policies": [{"name": "streaming"}]})
    res = run_eval(cfg, str(tmp_path), ["perplexity"])
    assert "perplexity" in res and "selection" not in res
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["sections"] == ["perplexity"]
    (title, (cols, rows)), = summary["summary"]["perplexity"].items()
    assert rows[0][0] == "full" and rows[1][0] == "streaming"

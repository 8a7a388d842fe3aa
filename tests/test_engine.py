"""The engines end to end on the real embedded default (SmolLM2-135M, CPU): ``spade.Engine``
(through ``spade.AsyncEngine``, the fast backend) and the static batch (``spade run``)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import spade

ROOT = Path(__file__).resolve().parent.parent
CFG = ROOT / "configs" / "cpu_tiny.yaml"
SHORT = ["generation.prompts=[{essay_tokens: 300, text: 'What is the essay about?'}]",
         "generation.max_new_tokens=10", "model.max_seq_len=512"]

pytestmark = pytest.mark.slow


def _gen(*over, static: bool = False):
    from spade.static import StaticEngine

    cfg = spade.load_config(CFG, overrides=[*SHORT, *over])
    eng = StaticEngine(cfg) if static else spade.Engine(cfg)
    try:
        return eng.generate()
    finally:
        eng.close()


def test_fast_and_hf_paths_agree_on_full_attention():
    """The static batch on the hf backend, on the fast one, and spade.Engine (the serving core)."""
    hf = _gen("policy.name=full", "model.backend=hf", static=True)
    fast = _gen("policy.name=full", "model.backend=fast", static=True)
    served = _gen("policy.name=full")
    assert hf[0].token_ids == fast[0].token_ids == served[0].token_ids
    assert hf[0].text == served[0].text
    assert len(hf[0].token_ids) > 0 and hf[0].text.strip()


def test_engine_refuses_the_hf_backend_with_the_fix():
    with pytest.raises(spade.ConfigError, match="model.backend 'hf'.*spade run"):
        spade.Engine(spade.load_config(CFG, overrides=[*SHORT, "model.backend=hf"]))


def test_sparse_policy_attends_the_budget_and_batches():
    res = _gen("policy.budget=64", "generation.prompts=[{essay_tokens: 300, text: 'Summarise.'}, {text: 'Hi!'}]")
    assert len(res) == 2
    long, short = res
    assert long.prompt_tokens > 300 and short.prompt_tokens < 64
    # budget counts everything: the long row attends the budget at every step, the short one
    # (under the threshold) its whole window
    assert long.mean_attended == 64
    assert short.prompt_tokens < short.mean_attended < 64
    assert all(len(r.token_ids) > 0 for r in res)


def test_budget_above_context_is_exactly_full():
    full = _gen("policy.name=full")
    sparse = _gen("policy.budget=4096", "policy.recent_tokens=16")
    assert sparse[0].token_ids == full[0].token_ids


def test_cli_run_writes_summary_json(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "spade.cli", "run", "--config", str(CFG), "--out", str(out)]
    for o in SHORT + ["policy.budget=96"]:
        cmd += ["--set", o]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TPOT median" in r.stdout and "tokens attended / step" in r.stdout
    s = json.loads(out.read_text())
    assert s["policy"] == "asyncspade" and s["budget"] == 96 and s["transport"] == "local"
    assert s["decode_steps"] >= 1 and s["tpot_median_ms"] > 0
    assert s["results"][0]["text"].strip()

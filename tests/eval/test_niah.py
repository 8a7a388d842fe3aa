"""Needle in a haystack: the prompt holds the needle at the asked depth; the run
scores every policy and a budget covering the context matches full attention."""

import random


from spade.eval.config import NiahEvalConfig


def test_haystack_prompt_places_the_needle(smollm2):
    from spade.eval.niah import QUESTION, haystack_prompt, passphrase

    _, tok = smollm2
    secret = passphrase(random.Random(0))
    for depth in (0.0, 0.5, 1.0):
        p = haystack_prompt(tok, 200, depth, secret)
        at = p.index(f"The secret passphrase is {secret}.")
        assert p.endswith(QUESTION)
        frac = at / len(p)
        assert abs(frac - depth) < 0.2


def test_run_niah(smollm2, tmp_path):
    from spade.eval.niah import run_niah

    cfg = NiahEvalConfig(model="smollm2-135m", context_lengths=[96], depths=[0.3, 0.7], budgets=[32, 512],
                         sink_tokens=2, recent_tokens=4, max_new_tokens=5, batch_size=2,
                         policies=[{"name": "oracle"}, {"name": "streaming"}])
    res = run_niah(cfg, tmp_path, "cpu")
    runs = {r["run"]: r for r in res["rows"]}
    assert set(runs) == {"full", "oracle K=32", "streaming K=32", "oracle K=512", "streaming K=512"}
    full = [r for r in res["records"] if r["run"] == "full"]
    dense = [r for r in res["records"] if r["run"] == "oracle K=512"]
    assert [r["answer"] for r in full] == [r["answer"] for r in dense]  # K >= context: dense
    assert all(r["n"] == 2 for r in res["rows"])
    assert (tmp_path / "niah_smollm2-135m.json").is_file() and (tmp_path / "niah_smollm2-135m.png").is_file()

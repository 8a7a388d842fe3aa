"""CPU smoke test of ``python -m benchmarks.bench_prefill --smoke`` (the tiny preset): the
script, not speed — every (length, piece size) row present, the pieces' last logits equal
the whole prompt's (fp32 rounding), the FLOP count and the JSON self-consistent."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_prefill as BP


@pytest.mark.parametrize("paged", [False, True])
def test_smoke_rows(paged, tmp_path, capsys):
    out = tmp_path / "prefill.json"
    doc = BP.run(["--smoke", "--profile", "--top", "3", "--out", str(out)]
                 + (["--block-size", "16"] if paged else []))
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert [(r["T"], r["chunk"]) for r in doc["rows"]] == [(40, 0), (40, 32), (96, 0), (96, 32)]
    for r in doc["rows"]:
        assert r["pieces"] == (1 if r["chunk"] == 0 else -(-r["T"] // r["chunk"]))
        assert r["logits_rel_err_vs_whole"] < 1e-5  # the pieces compute the whole prompt's pass
        assert r["ms"] > 0 and r["tokens_per_s"] == pytest.approx(r["T"] / (r["ms"] / 1e3))
        assert r["flops"]["total"] == r["flops"]["projections"] + r["flops"]["attention"]
    assert [p["chunk"] for p in doc["profiles"]] == [0, 32]
    assert all(p["total_ms"] > 0 and len(p["top"]) == 3 for p in doc["profiles"])
    assert "# profile T=96 chunk=32" in capsys.readouterr().out


def test_flops_by_hand():
    """One layer of hidden 4, 2 q heads / 1 KV head of dim 2, intermediate 8, vocab 10, T = 3."""
    from types import SimpleNamespace

    a = SimpleNamespace(head_dim=2, n_q_heads=2, n_kv_heads=1, hidden=4, intermediate=8, n_layers=1, vocab=10)
    f = BP.flops(a, 3)
    per_token = 4 * (2 + 2) * 2 + 2 * 2 * 4 + 3 * 4 * 8  # qkv, o, gate/up/down
    assert f["projections"] == 2 * 3 * per_token + 2 * 4 * 10
    assert f["attention"] == 2 * 2 * 6 * 2 * 2  # 6 (query, key) pairs under the causal mask

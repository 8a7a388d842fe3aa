"""CPU smoke tests of ``python -m benchmarks.bench_kv_layout --smoke`` (tiny shapes):
the script, not speed — the interleaved layout's strided views hold the same values
as the separate caches and give the same attention outputs, and the JSON rows are
complete and self-consistent."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_kv_layout as KL
from tests.conftest import INTERPRET


def test_caches_layouts_hold_the_same_values():
    ks, vs = KL.caches(2, 3, 11, 16, "separate", torch.float32, "cpu", seed=5)
    ki, vi = KL.caches(2, 3, 11, 16, "interleaved", torch.float32, "cpu", seed=5)
    assert torch.equal(ks, ki) and torch.equal(vs, vi)
    assert ks.is_contiguous() and not ki.is_contiguous()
    assert ki.stride(2) == 2 * 16 and vi.data_ptr() == ki.data_ptr() + 16 * ki.element_size()
    with pytest.raises(ValueError, match="layout must be"):
        KL.caches(1, 1, 4, 16, "paged", torch.float32, "cpu")


@pytest.mark.parametrize("kernels", [
    pytest.param("triton", marks=pytest.mark.skipif(not INTERPRET, reason="Triton on the smoke's CPU tensors needs "
                                                                         "the interpreter")),
    "torch"])
def test_smoke_rows(kernels, tmp_path, capsys, monkeypatch):
    """``triton``: the Triton kernels (the interpreter on a CPU) read the strided views."""
    monkeypatch.setenv("SPADE_KERNELS", kernels)
    out = tmp_path / "kv_layout.json"
    doc = KL.run(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    rows = doc["rows"]
    sh = doc["shape"]
    assert sh["K"] == [8, 16]
    kinds = [(r["kind"], r["layout"], r["order"], r["K"]) for r in rows]
    want = []
    for K in sh["K"]:
        want += [("gather", lay, o, K) for lay in ("separate", "interleaved", "separate-2d")
                 for o in ("unsorted", "sorted")]
        for lay in ("separate", "interleaved"):
            want += [("sparse", lay, o, K) for o in ("unsorted", "sorted")]
            want += [("dense", lay, "-", 0)] if K == sh["K"][0] else []
    assert kinds == want
    esz = 4  # fp32 on the CPU
    for r in rows:
        assert r["us"] > 0 and r["TBps"] == pytest.approx(r["bytes"] / (r["us"] * 1e-6) / 1e12)
        n_tok = sh["sink"] + r["K"] + sh["recent"]
        per = {"gather": 2 * r["K"] * sh["D"] * (2 if r["layout"] == "separate-2d" else 1),
               "sparse": 2 * n_tok * sh["D"], "dense": 2 * sh["L"] * sh["D"]}[r["kind"]]
        assert r["bytes"] == sh["B"] * sh["Hkv"] * per * esz
        if r["kind"] != "gather":
            assert r["rel_err_vs_separate"] == 0.0  # same values, same kernel: only the strides differ
    assert set(doc["ratios_interleaved_vs_separate"]) == {
        f"{kind}/{o}/K={K}" for kind, o in (("gather", "unsorted"), ("gather", "sorted"), ("sparse", "unsorted"),
                                           ("sparse", "sorted")) for K in sh["K"]} | {"dense/-/K=0"}
    (m,) = doc["sparse_marginal"]
    r0, r1 = (next(r for r in rows if r["kind"] == "sparse" and r["layout"] == "separate"
                   and r["order"] == "unsorted" and r["K"] == K) for K in (8, 16))
    assert m["added_bytes"] == r1["bytes"] - r0["bytes"] and m["added_us"] == pytest.approx(r1["us"] - r0["us"])
    assert m["intercept_us"] == pytest.approx(r0["us"] - m["added_us"] * r0["bytes"] / m["added_bytes"])
    assert out.with_suffix(".png").stat().st_size > 0
    assert "interleaved / separate:" in capsys.readouterr().out


def test_bad_budget_names_the_flags(capsys):
    with pytest.raises(SystemExit):
        KL.parse_args(["--L", "100", "--K", "8,90", "--sink", "4", "--recent", "64"])
    assert "--K + --sink + --recent" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        KL.parse_args(["--K", "1k"])
    assert "comma-separated integers" in capsys.readouterr().err

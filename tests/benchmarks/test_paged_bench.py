"""CPU smoke test of ``python -m benchmarks.bench_paged --smoke`` (tiny shapes): the
script, not speed — every row present, the paged kernels give the contiguous
kernels' outputs exactly, and the JSON is self-consistent."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_paged as BP
from tests.conftest import INTERPRET


@pytest.mark.parametrize("kernels", [
    pytest.param("triton", marks=pytest.mark.skipif(not INTERPRET, reason="Triton on the smoke's CPU tensors needs "
                                                                         "the interpreter")),
    "torch"])
def test_smoke_rows(kernels, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPADE_KERNELS", kernels)
    out = tmp_path / "paged.json"
    doc = BP.run(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    sh = doc["shape"]
    kinds = [(r["kind"], r["layout"], r["block_size"]) for r in doc["rows"]]
    assert kinds == ([(k, "contiguous", None) for k in BP.KINDS]
                     + [(k, "paged", bs) for bs in sh["block_sizes"] for k in BP.KINDS])
    esz = 4  # fp32 on the CPU
    for r in doc["rows"]:
        if r["kind"] == "int4":  # every key's packed bytes (D / 2) and its fp32 scale
            assert r["bytes"] == sh["B"] * sh["Hkv"] * sh["L"] * (sh["D"] // 2 + 4)
        else:
            per = {"sparse": 2 * (sh["sink"] + sh["K"] + sh["recent"]), "dense": 2 * sh["L"], "gather": 2 * sh["K"],
                   "score": sh["L"] - sh["sink"] - sh["recent"],  # K and V rows; keys only for score
                   "quest": 2 * -(-sh["L"] // sh["page_size"])}[r["kind"]]  # both bounds of every page
            assert r["bytes"] == sh["B"] * sh["Hkv"] * per * sh["D"] * esz
        assert r["us"] > 0 and r["x_floor"] == pytest.approx(r["us"] / r["floor_us"])
        if r["layout"] == "paged" and (kernels == "triton" or r["kind"] in ("gather", "score", "int4", "quest")):
            assert r["rel_err_vs_contiguous"] == 0.0  # same arithmetic, only the addresses differ
        elif r["layout"] == "paged":  # the torch reference zeroes unattended rows first: fp32 rounding
            assert r["rel_err_vs_contiguous"] < 1e-6
    assert set(doc["ratios_paged_vs_contiguous"]) == {f"{k}/bs={bs}" for bs in sh["block_sizes"] for k in BP.KINDS}
    assert set(doc["within_target"]) == set(doc["ratios_paged_vs_contiguous"])
    assert "paged / contiguous:" in capsys.readouterr().out


def test_bad_arguments_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        BP.parse_args(["--L", "100", "--K", "90"])
    assert "--K + --sink + --recent" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        BP.parse_args(["--block-sizes", "16,0"])
    assert "integers >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        BP.parse_args(["--kinds", "sparse,tova"])
    assert "--kinds" in capsys.readouterr().err

"""Each policy once through the Triton kernels (the interpreter on CPU): the same
selections and outputs as with the torch references."""

from __future__ import annotations

import os

import pytest
import torch

from spade.policies.base import RopeSpec
from tests.policies.sim import DecodeSim, make_policy, middle_sets

CASES = {
    "oracle": dict(budget=20, sink_tokens=2, recent_tokens=3),
    "streaming": dict(budget=20, sink_tokens=2, recent_tokens=3),
    "quest": dict(budget=16, page_size=4),
    "tova": dict(budget=12),
    "asyncspade": dict(budget=20, sink_tokens=2, recent_tokens=3, window=4, rope_aware=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_policy_with_triton_kernels(name, monkeypatch):
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("drives the kernels on CPU tensors (interpreter); on a GPU the kernel and runtime GPU tests cover Triton")
    sim = DecodeSim(B=2, Hq=4, Hkv=2, D=16, kv_start=[0, 3], prompt_len=29, steps=3, seed=12,
                    rope=RopeSpec(theta=10000.0))
    ref = sim.run(make_policy(name, sim, **CASES[name]))
    monkeypatch.setenv("SPADE_KERNELS", "triton")
    tri = sim.run(make_policy(name, sim, **CASES[name]))
    assert len(ref) == len(tri)
    for a, b in zip(ref, tri):
        assert b.sel is not None
        assert middle_sets(a.sel) == middle_sets(b.sel)
        assert (a.sel.n_sink, a.sel.n_recent) == (b.sel.n_sink, b.sel.n_recent)
        torch.testing.assert_close(b.out, a.out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b.full, a.full, rtol=1e-4, atol=1e-4)

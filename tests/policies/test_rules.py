"""The common rules every policy follows (``spade.policies.base``), on simulated
multi-step decodes: full attention when the budget covers the context, the
Selection invariants, and the oracle's attention mass as an upper bound."""

from __future__ import annotations

import pytest
import torch

from spade.policies import POLICIES
from spade.policies.base import RopeSpec
from tests.policies.sim import DecodeSim, attended_sets, make_policy, middle_sets

# (B, Hq, Hkv, kv_start): MHA B=1, GQA and MQA with left-padded rows
SHAPES = {
    "mha-b1": (1, 2, 2, None),
    "gqa-b3-pad": (3, 4, 2, [0, 5, 11]),
    "mqa-b3-pad": (3, 4, 1, [3, 0, 0]),
}

BUDGET = 24
CONFIGS = {
    "full": {},
    "oracle": dict(budget=BUDGET, sink_tokens=2, recent_tokens=4),
    "streaming": dict(budget=BUDGET, sink_tokens=2, recent_tokens=4),
    "quest": dict(budget=BUDGET, page_size=4),
    "tova": dict(budget=BUDGET),
    "asyncspade": dict(budget=BUDGET, sink_tokens=2, recent_tokens=4, window=4),
    "asyncspade-last-rope": dict(budget=BUDGET, sink_tokens=2, recent_tokens=4, window=3, predictor="last",
                                 rope_aware=True),
    "oracle-max": dict(budget=BUDGET, sink_tokens=0, recent_tokens=1, group_reduce="max_logits"),
    "quest-max": dict(budget=BUDGET, page_size=8, group_reduce="max_logits"),
    # smallest budgets: no middle at all, one held token, two pages
    "oracle-nomid": dict(budget=6, sink_tokens=2, recent_tokens=4),
    "asyncspade-nomid": dict(budget=5, sink_tokens=0, recent_tokens=5, predictor="ridge"),
    "tova-min": dict(budget=2),
    "quest-min": dict(budget=8, page_size=4),
}


def _sim(shape: str, **kw) -> DecodeSim:
    B, Hq, Hkv, starts = SHAPES[shape]
    return DecodeSim(B=B, Hq=Hq, Hkv=Hkv, kv_start=starts, rope=RopeSpec(theta=10000.0), **kw)


def _policy(key: str, sim: DecodeSim, **override):
    return make_policy(key.split("-")[0], sim, **{**CONFIGS[key], **override})


def test_registry_names_match_classes():
    for name in POLICIES.names():
        assert POLICIES.get(name).name == name


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("key", [k for k in CONFIGS if not k.endswith(("-min", "-nomid"))])
def test_full_attention_when_budget_covers_context(key, shape):
    """budget >= every context: select returns None and the output is exactly full."""
    sim = _sim(shape, prompt_len=21, steps=4, n_layers=2)
    budget = sim.prompt_len + sim.steps
    override = {} if key == "full" else {"budget": budget}
    recs = sim.run(_policy(key, sim, **override))
    assert len(recs) == sim.steps * sim.n_layers
    for r in recs:
        assert r.sel is None
        assert torch.equal(r.out, r.full)


@pytest.mark.parametrize("key", ["oracle", "streaming", "tova", "asyncspade", "asyncspade-last-rope"])
def test_padded_rows_within_budget_attend_everything(key):
    """seq_len > budget, but rows with a long left padding have a context <= budget:
    token-level policies must still give those rows exactly their whole context."""
    sim = _sim("gqa-b3-pad", prompt_len=40, steps=5)
    sim.kv_start = [0, 25, 30]  # contexts 40+t, 15+t, 10+t with budget 24
    recs = sim.run(_policy(key, sim))
    sparse = [r for r in recs if r.sel is not None]
    assert sparse, "expected sparse steps (seq_len > budget)"
    for r in sparse:
        sets = attended_sets(r.sel, r.kv_lens)
        for b in (1, 2):
            whole = set(range(sim.kv_start[b], int(r.kv_lens[b])))
            assert all(s == whole for s in sets[b])
        torch.testing.assert_close(r.out[1:], r.full[1:], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(r.out[0], r.full[0], atol=1e-3)  # row 0 is really sparse


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("key", [k for k in CONFIGS if k != "full"])
def test_selection_invariants(key, shape):
    """No duplicates, inside [kv_start, kv_len), middle disjoint from sinks and the
    recent window, the current token attended, attended count <= budget (== budget
    for the top-K policies once the context exceeds it)."""
    sim = _sim(shape, prompt_len=37, steps=6, n_layers=2)
    pol = _policy(key, sim)
    budget = pol.budget
    recs = sim.run(pol)
    n_sparse = 0
    for r in recs:
        if r.kv_lens.max() <= budget:
            assert r.sel is None
            continue
        sel = r.sel
        assert sel is not None
        n_sparse += 1
        B, Hkv = sim.B, sim.Hkv
        assert sel.indices.dtype == torch.int32 and sel.indices.shape[:2] == (B, Hkv)
        attended = sel.attended(r.kv_lens)  # [B, Hkv]
        assert int(attended.max()) <= budget
        sets = attended_sets(sel, r.kv_lens)
        mids = middle_sets(sel)
        for b in range(B):
            n = int(r.kv_lens[b])
            s = 0 if sim.kv_start is None else sim.kv_start[b]
            sink_end = min(s + sel.n_sink, n)
            recent_start = max(n - sel.n_recent, sink_end)
            for h in range(Hkv):
                valid = [x for x in sel.indices[b, h].tolist() if x >= 0]
                assert len(valid) == len(set(valid)), "duplicate positions"
                assert all(s <= x < n for x in valid), "position outside [kv_start, kv_len)"
                assert all(sink_end <= x < recent_start for x in mids[b][h]), "middle overlaps sink/recent"
                assert n - 1 in sets[b][h], "the current token must be attended"
                assert len(sets[b][h]) == int(attended[b, h])
                if not key.startswith("quest") and n - s > budget:
                    assert int(attended[b, h]) == budget, "token-level policies fill the budget"
    assert n_sparse > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["oracle", "streaming", "quest", "tova", "asyncspade"])
def test_low_precision_caches(name, dtype):
    """fp16/bf16 caches and queries: same invariants, outputs close to full where dense."""
    sim = _sim("gqa-b3-pad", prompt_len=33, steps=4, dtype=dtype)
    pol = _policy(name, sim)
    recs = sim.run(pol)
    for r in recs:
        assert r.sel is not None and r.out.dtype == dtype
        assert int(r.sel.attended(r.kv_lens).max()) <= pol.budget
        for b, row in enumerate(attended_sets(r.sel, r.kv_lens)):
            s = sim.kv_start[b]
            assert all(min(st) >= s and max(st) < int(r.kv_lens[b]) for st in row)
        assert torch.isfinite(r.out.float()).all()


def _mass(sim: DecodeSim, recs) -> list[torch.Tensor]:
    """Per record, the true attention mass kept per (b, KV head): [B, Hkv] float64."""
    out = []
    G = sim.Hq // sim.Hkv
    for r in recs:
        p = sim.probs(r.layer, r.q, r.kv_lens).view(sim.B, sim.Hkv, G, -1).sum(2)  # [B, Hkv, L]
        if r.sel is None:
            out.append(p.sum(-1))
            continue
        m = torch.zeros_like(p, dtype=torch.bool)
        for b, row in enumerate(attended_sets(r.sel, r.kv_lens)):
            for h, st in enumerate(row):
                m[b, h, list(st)] = True
        out.append((p * m).sum(-1))
    return out


@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (6, 2)])
def test_oracle_keeps_the_most_attention_mass(Hq, Hkv):
    """With ``sum_softmax`` the oracle maximises the true attention mass of every
    (row, KV head) over the sets of its shape, so at equal budget: oracle(sink=0,
    recent=1) >= every policy (all keep the current token); oracle(sink, recent)
    >= streaming and asyncspade, which share that shape."""
    sim = DecodeSim(B=3, Hq=Hq, Hkv=Hkv, prompt_len=61, steps=5, seed=3)
    common = dict(budget=BUDGET, sink_tokens=2, recent_tokens=4)
    best_any = _mass(sim, sim.run(make_policy("oracle", sim, budget=BUDGET, sink_tokens=0, recent_tokens=1,
                                              group_reduce="sum_softmax")))
    best_shape = _mass(sim, sim.run(make_policy("oracle", sim, **common, group_reduce="sum_softmax")))
    others = {
        "streaming": (make_policy("streaming", sim, **common), best_shape),
        "asyncspade": (make_policy("asyncspade", sim, **common, window=4), best_shape),
        "quest": (make_policy("quest", sim, budget=BUDGET, page_size=4), best_any),
        "tova": (make_policy("tova", sim, budget=BUDGET), best_any),
        "oracle-logits": (make_policy("oracle", sim, **common), best_shape),
    }
    for name, (pol, ref) in others.items():
        got = _mass(sim, sim.run(pol))
        for a, b in zip(ref, got):
            assert (a >= b - 1e-6).all(), f"{name} kept more mass than the oracle"
            assert (b > 0).all()
    # the comparison is not vacuous: the oracle really drops mass here
    assert all((m < (Hq // Hkv) * 0.999).all() for m in best_shape)

"""TOVA: a fixed set of held tokens, the least attended one evicted for good."""

from __future__ import annotations

import pytest
import torch

from tests.policies.sim import DecodeSim, make_policy, middle_sets


def _weights(sim: DecodeSim, layer: int, q: torch.Tensor, b: int, positions: list[int]) -> list[float]:
    """q's attention over ``positions`` only (softmax per query head), averaged over heads."""
    G = sim.Hq // sim.Hkv
    k = sim.k_all[layer, b].double()[:, positions]  # [Hkv, n, D]
    qg = q[b].double().view(sim.Hkv, G, sim.D)
    p = torch.softmax(torch.einsum("hgd,hnd->hgn", qg, k) * sim.spec.softmax_scale, -1)
    return p.mean((0, 1)).tolist()


def _reference(sim: DecodeSim, budget: int, layer: int = 0) -> list[list[set[int]]]:
    """Brute-force TOVA per row: the held set after prefill and after each step."""
    T = sim.prompt_len
    out = []
    for b in range(sim.B):
        s = 0 if sim.kv_start is None else sim.kv_start[b]
        prompt = list(range(s, T))
        if len(prompt) > budget - 1:
            w = _weights(sim, layer, sim.q_all[layer, :, :, T - 1], b, prompt)
            order = sorted(range(len(prompt)), key=lambda i: w[i], reverse=True)
            held = {prompt[i] for i in order[: budget - 1]}
        else:
            held = set(prompt)
        hist = [set(held)]
        for step in range(sim.steps):
            pos = T + step
            att = sorted(held | {pos})
            assert len(att) <= budget
            if len(att) == budget:  # full: the next token needs a slot
                w = _weights(sim, layer, sim.q_all[layer, :, :, pos], b, att)
                att.pop(min(range(len(att)), key=lambda i: w[i]))
            held = set(att)
            hist.append(set(held))
        out.append(hist)
    return out


@pytest.mark.parametrize("B,Hq,Hkv,starts,T", [(1, 2, 2, None, 13), (2, 4, 2, [0, 4], 13), (3, 3, 1, [0, 2, 9], 5)])
def test_tova_matches_bruteforce(B, Hq, Hkv, starts, T):
    """Held sets after prefill and after every step equal a brute-force TOVA; each
    sparse step attends exactly held ∪ {current}; never more than budget tokens."""
    budget = 7
    sim = DecodeSim(B=B, Hq=Hq, Hkv=Hkv, kv_start=starts, prompt_len=T, steps=14, seed=4)
    pol = make_policy("tova", sim, budget=budget)
    ref = _reference(sim, budget)
    held_after = []

    def on_step(rec, state):
        held_after.append(pol.held(state, rec.layer).clone())

    recs = sim.run(pol, on_step=on_step)
    for i, r in enumerate(recs):
        if r.sel is not None:
            mids = middle_sets(r.sel)
            for b in range(B):
                for h in range(Hkv):
                    assert mids[b][h] == ref[b][i], f"step {i} row {b}: attended held set"
            assert int(r.sel.attended(r.kv_lens).max()) <= budget
        for b in range(B):
            got = [x for x in held_after[i][b].tolist() if x >= 0]
            assert len(got) == len(set(got)) <= budget - 1
            assert set(got) == ref[b][i + 1], f"step {i} row {b}: held set after eviction"


def test_tova_evicts_for_good():
    """A token evicted once never reappears, even when later queries would want it
    (the difference to the query-aware policies)."""
    sim = DecodeSim(B=1, Hq=2, Hkv=1, prompt_len=12, steps=10, seed=5)
    target = 3
    # later queries point straight at the key of token 3
    sim.q_all[0, 0, :, 16:] = sim.k_all[0, 0, 0, target] * 8
    sim.q_all[0, 0, :, :16] = -sim.k_all[0, 0, 0, target] * 8  # early queries ignore it
    pol = make_policy("tova", sim, budget=6)
    seen = []
    recs = sim.run(pol, on_step=lambda rec, st: seen.append(set(pol.held(st, 0)[0].tolist())))
    gone = [i for i, h in enumerate(seen) if target not in h]
    assert gone, "token 3 should be evicted early"
    assert all(target not in h for h in seen[gone[0]:])
    oracle = make_policy("oracle", sim, budget=6, sink_tokens=0, recent_tokens=1)
    orecs = sim.run(oracle)
    assert target in middle_sets(orecs[-1].sel)[0][0]  # a query-aware policy brings it back
    assert recs[-1].sel is not None

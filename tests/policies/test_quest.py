"""Quest: page-level selection from incrementally maintained page bounds."""

from __future__ import annotations

import pytest
import torch

from tests.policies.sim import DecodeSim, make_policy, middle_sets


def _expected_pages(sim: DecodeSim, layer: int, q: torch.Tensor, n: int, b: int, h: int, page: int,
                    n_sel: int, reduce: str) -> set[int]:
    """Brute force: bounds over tokens [s, n-1) (the current token is not folded in
    yet), the last page always, then the best other pages by the Quest bound."""
    s = 0 if sim.kv_start is None else sim.kv_start[b]
    k = sim.k_all[layer, b, h].double()  # [L, D]
    G = sim.Hq // sim.Hkv
    qg = q[b, h * G:(h + 1) * G].double()  # [G, D]
    last = (n - 1) // page
    scores = {}
    for p in range(last):
        lo, hi = max(p * page, s), min((p + 1) * page, n - 1)
        if lo >= hi:
            continue
        kmin, kmax = k[lo:hi].amin(0), k[lo:hi].amax(0)
        per_head = torch.maximum(qg * kmin, qg * kmax).sum(-1)  # [G]
        scores[p] = float(per_head.sum() if reduce == "sum_logits" else per_head.max())
    best = sorted(scores, key=scores.get, reverse=True)[: n_sel - 1]
    return {last, *best}


@pytest.mark.parametrize("B,Hq,Hkv,starts", [(1, 2, 2, None), (3, 6, 2, [0, 7, 13]), (3, 4, 1, [2, 0, 9])])
@pytest.mark.parametrize("page,reduce", [(4, "sum_logits"), (8, "max_logits")])
def test_quest_pages_match_bruteforce(B, Hq, Hkv, starts, page, reduce):
    """Every sparse step keeps the last page plus the budget//page_size - 1 best
    other pages of a brute-force Quest on the same cache (checks the prefill build,
    the per-step update order and the selection)."""
    budget = 32
    sim = DecodeSim(B=B, Hq=Hq, Hkv=Hkv, kv_start=starts, prompt_len=45, steps=9, n_layers=2, seed=1)
    pol = make_policy("quest", sim, budget=budget, page_size=page, group_reduce=reduce)
    n_sel = budget // page
    recs = sim.run(pol)
    for r in recs:
        sel = r.sel
        assert sel is not None and sel.n_sink == 0 and sel.n_recent == 0
        mids = middle_sets(sel)
        for b in range(B):
            n = int(r.kv_lens[b])
            s = 0 if starts is None else starts[b]
            for h in range(Hkv):
                got = mids[b][h]
                pages = {x // page for x in got}
                want = _expected_pages(sim, r.layer, r.q, n, b, h, page, n_sel, reduce)
                assert pages == want
                assert len(pages) == n_sel and (n - 1) // page in pages
                # whole pages, clipped to [kv_start, kv_len)
                assert got == {x for p in pages for x in range(p * page, (p + 1) * page) if s <= x < n}
                assert len(got) <= budget


def test_quest_dense_then_sparse_switch():
    """The bounds are maintained through the dense phase, so the first sparse
    step already selects from bounds covering every earlier token."""
    sim = DecodeSim(B=2, Hq=4, Hkv=2, prompt_len=20, steps=12, seed=2)
    pol = make_policy("quest", sim, budget=24, page_size=4)
    recs = sim.run(pol)
    dense = [r for r in recs if r.sel is None]
    sparse = [r for r in recs if r.sel is not None]
    assert [r.seq_len for r in dense] == list(range(21, 25))
    for r in sparse:
        for b in range(2):
            for h in range(2):
                want = _expected_pages(sim, 0, r.q, int(r.kv_lens[b]), b, h, 4, 6, "sum_logits")
                assert {x // 4 for x in middle_sets(r.sel)[b][h]} == want

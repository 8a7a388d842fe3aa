"""Quest: page-level selection from incrementally maintained page bounds, pages counted
from each row's own start (``kv_start``)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.policies.sim import DecodeSim, make_policy, middle_sets


def _expected_pages(sim: DecodeSim, layer: int, q: torch.Tensor, n: int, b: int, h: int, page: int,
                    n_sel: int, reduce: str) -> set[int]:
    """Brute force: bounds over tokens [s, n-1) (the current token is not folded in
    yet) in pages relative to s (page p: [s + p*page, s + (p+1)*page)), the last page
    always, then the best other pages by the Quest bound."""
    s = 0 if sim.kv_start is None else sim.kv_start[b]
    k = sim.k_all[layer, b, h].double()  # [L, D]
    G = sim.Hq // sim.Hkv
    qg = q[b, h * G:(h + 1) * G].double()  # [G, D]
    last = (n - 1 - s) // page
    scores = {}
    for p in range(last):
        lo, hi = s + p * page, min(s + (p + 1) * page, n - 1)
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
                pages = {(x - s) // page for x in got}
                want = _expected_pages(sim, r.layer, r.q, n, b, h, page, n_sel, reduce)
                assert pages == want
                assert len(pages) == n_sel and (n - 1 - s) // page in pages
                # whole pages, clipped to kv_len
                assert got == {x for p in pages for x in range(s + p * page, s + (p + 1) * page) if x < n}
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


@pytest.mark.parametrize("mode", ["torch", "triton"])
def test_left_padded_rows_select_as_alone(mode, monkeypatch):
    """Left-padded rows (starts not on a page boundary) select, as positions minus
    kv_start, exactly what the same rows select alone, with the same outputs; a row whose
    own context still fits the budget while the batch's does not (sparse path) attends
    its whole context, as dense alone."""
    if mode == "triton" and torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("drives the kernels on CPU tensors (interpreter); on a GPU tests/kernels/test_quest.py covers them")
    monkeypatch.setenv("SPADE_KERNELS", mode)
    starts, T, steps, budget, page = [0, 7, 31], 45, 6, 16, 4
    sim = DecodeSim(B=3, Hq=4, Hkv=2, kv_start=starts, prompt_len=T, steps=steps, n_layers=2, seed=5)
    recs = sim.run(make_policy("quest", sim, budget=budget, page_size=page))
    assert all(r.sel is not None for r in recs)
    n_whole = 0
    for b, s in enumerate(starts):
        one = DecodeSim(B=1, Hq=4, Hkv=2, prompt_len=T - s, steps=steps, n_layers=2, seed=5,
                        k_all=sim.k_all[:, b:b + 1, :, s:], v_all=sim.v_all[:, b:b + 1, :, s:],
                        q_all=sim.q_all[:, b:b + 1, :, s:])
        alone = one.run(make_policy("quest", one, budget=budget, page_size=page))
        for r, a in zip(recs, alone):
            n = int(r.kv_lens[b])
            got = [{x - s for x in m} for m in middle_sets(r.sel)[b]]
            if a.sel is None:  # dense alone: the padded row's pages cover its whole context
                assert n - s <= budget and got == [set(range(n - s))] * 2
                n_whole += 1
            else:
                assert got == middle_sets(a.sel)[0], (b, r.step, r.layer)
            torch.testing.assert_close(r.out[b], a.out[0], rtol=1e-5, atol=1e-5)
    assert n_whole >= 4  # row 2 (own context 15, 16 at its first steps) was covered


def test_left_padded_static_batch_generates_as_alone(monkeypatch):
    """Engine level (tiny random preset, fp32, CPU): a static batch of prompts of
    different lengths (left-padded to the longest, so most rows start off a page
    boundary) gives every row the greedy tokens its prompt gets alone."""
    import spade

    monkeypatch.setenv("SPADE_KERNELS", "torch")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (23, 9, 14, 18)]
    cfg = spade.load_config(None, overrides=[
        "model.name=tiny", "model.dtype=float32", "model.device=cpu", "model.max_seq_len=64",
        "runtime.topology=inline", "generation.stop_at_eos=false", "policy.name=quest", "policy.budget=16",
        "policy.page_size=4", "generation.prompts=[{text: a}, {text: b}, {text: c}, {text: d}]"])
    engine = spade.Engine(cfg)
    try:
        batch = engine.generate(prompts, max_new_tokens=24)
        alone = [engine.generate([p], max_new_tokens=24)[0] for p in prompts]
    finally:
        engine.close()
    for p, t, a in zip(prompts, batch, alone):
        assert len(t.token_ids) == 24
        assert t.token_ids == a.token_ids, f"the prompt of {len(p)} tokens"

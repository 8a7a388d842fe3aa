"""asyncspade's page prefilter (``prefilter_pages``): page bounds first, then the tokens of
the best pages. Pages covering the middle give the token-level selection; a crafted case
whose true top-K lies in a few pages gives it with fewer pages; on random data the recall
against the token-level selection is reported and must beat choosing pages blindly."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from spade.policies.asyncspade import AsyncSpadePolicyConfig
from spade.policies.base import AttentionSpec
from tests.policies.sim import DecodeSim, make_policy, middle_sets

COMMON = dict(budget=13, sink_tokens=2, recent_tokens=3, window=4)


@pytest.mark.parametrize("summary", ["mean", "bounds"])
@pytest.mark.parametrize("score_keys", ["exact", "int4"])
@pytest.mark.parametrize("reduce", ["sum_softmax", "sum_logits", "max_logits"])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_pages_covering_the_row_give_the_token_level_selection(summary, score_keys, reduce, heads):
    """prefilter_pages x page_size >= the context: every step's selection is the token-level
    one (GQA and MHA, left padding, B > 1); the bounds grow through observe past the
    prompt's pages."""
    Hq, Hkv = heads
    sim = DecodeSim(B=2, Hq=Hq, Hkv=Hkv, D=16, prompt_len=29, steps=6, n_layers=2, kv_start=[0, 3], seed=5)
    cfg = dict(COMMON, score_keys=score_keys, group_reduce=reduce)
    base = sim.run(make_policy("asyncspade", sim, **cfg))
    got = sim.run(make_policy("asyncspade", sim, **cfg, prefilter_pages=5, prefilter_page_size=7,
                              prefilter_summary=summary))
    for a, b in zip(base, got):
        assert middle_sets(a.sel) == middle_sets(b.sel)
        assert b.sel.indices.shape == a.sel.indices.shape


def test_k_of_one_and_k_above_the_context():
    sim = DecodeSim(B=1, Hq=4, Hkv=1, D=8, prompt_len=11, steps=3, n_layers=1, seed=2)
    for budget in (6, 11, 40):  # K_mid = 1; K_mid just under the middle; K above every cache length (dense)
        cfg = dict(budget=budget, sink_tokens=2, recent_tokens=3, window=2)
        base = sim.run(make_policy("asyncspade", sim, **cfg))
        got = sim.run(make_policy("asyncspade", sim, **cfg, prefilter_pages=40, prefilter_page_size=1))
        sets = [[None if r.sel is None else middle_sets(r.sel) for r in rs] for rs in (base, got)]
        assert sets[0] == sets[1] and (sets[0][-1] is None) == (budget == 40)


@pytest.mark.parametrize("summary", ["mean", "bounds"])
@pytest.mark.parametrize("score_keys", ["exact", "int4"])
def test_crafted_top_k_inside_few_pages(summary, score_keys):
    """Keys aligned with every query in two pages (the rest small noise): two pages hold the
    whole true top-K, so 2 of the 25 pages give the token-level selection (K_mid = 2: the
    fewest pages of 8 that always fill it are 2)."""
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D, L, ps = 1, 4, 2, 16, 200, 8
    spec = AttentionSpec(n_layers=1, n_q_heads=Hq, n_kv_heads=Hkv, head_dim=D)
    u = torch.randn(Hq, D, generator=g)
    q_win = u[None, :, None, :].expand(B, Hq, L, D).contiguous()  # every past query = u
    k = torch.randn(B, Hkv, L, D, generator=g) * 0.05
    G = Hq // Hkv
    for h in range(Hkv):
        dirn = u[h * G:(h + 1) * G].sum(0)
        for p in (5, 17):
            k[0, h, p * ps:(p + 1) * ps] += 2 * dirn * (1 + torch.rand(ps, 1, generator=g))
    kv = torch.tensor([L])
    sels = []
    from spade.policies.asyncspade import AsyncSpadePolicy
    for pages in (0, 2):
        cfg = AsyncSpadePolicyConfig(budget=2 + 4 + 2, sink_tokens=2, recent_tokens=4, predictor="last", window=2,
                                     rope_aware=False, score_keys=score_keys, prefilter_pages=pages,
                                     prefilter_page_size=ps, prefilter_summary=summary)
        pol = AsyncSpadePolicy(cfg, spec)
        st = pol.new_state(B, "cpu")
        st.seq_len = L
        pol.prefill(st, 0, q_win, k, k, kv)
        st.seq_len = L + 1
        sels.append(middle_sets(pol.select(st, 0, None, k, kv)))
    assert sels[0] == sels[1]
    assert all(len(s) == 2 and all(p * ps <= t < (p + 1) * ps for t in s for p in [t // ps]) and
               {t // ps for t in s} <= {5, 17} for s in sels[1][0])


@pytest.mark.parametrize("summary", ["mean", "bounds"])
def test_recall_on_random_data_beats_blind_pages(summary):
    """Random keys have no page structure, yet the bounds still rank pages by what they
    can hold: the prefiltered selection keeps more of the token-level top-K than the
    fraction of the middle its pages cover (the expectation of choosing pages blindly)."""
    sim = DecodeSim(B=2, Hq=4, Hkv=2, D=16, prompt_len=160, steps=4, n_layers=2, kv_start=[0, 5], seed=9)
    cfg = dict(budget=21, sink_tokens=2, recent_tokens=3, window=4, group_reduce="sum_logits")
    base = sim.run(make_policy("asyncspade", sim, **cfg))
    pages, ps = 4, 8  # 32 of ~150 middle tokens
    got = sim.run(make_policy("asyncspade", sim, **cfg, prefilter_pages=pages, prefilter_page_size=ps,
                              prefilter_summary=summary))
    hit = tot = 0
    cover = []
    for a, b in zip(base, got):
        for ra, rb, n in zip(middle_sets(a.sel), middle_sets(b.sel), a.kv_lens.tolist()):
            cover.append(pages * ps / (n - 5))
            for x, y in zip(ra, rb):
                hit, tot = hit + len(x & y), tot + len(x)
    recall, blind = hit / tot, sum(cover) / len(cover)
    print(f"prefilter ({summary}) recall vs token-level on random data: {recall:.3f} (blind pages: {blind:.3f})")
    assert blind < recall < 1.0


def test_config_refuses_too_few_candidates():
    # K_mid = 80: 80 + 2 x 31 = 142 tokens of pages of 32 -> at least 5 pages
    with pytest.raises(ValidationError, match="at least 5"):
        AsyncSpadePolicyConfig(budget=100, sink_tokens=4, recent_tokens=16, prefilter_pages=4, prefilter_page_size=32)
    AsyncSpadePolicyConfig(budget=100, sink_tokens=4, recent_tokens=16, prefilter_pages=5, prefilter_page_size=32)
    with pytest.raises(ValidationError, match="prefilter_pages"):
        AsyncSpadePolicyConfig(budget=100, sink_tokens=4, recent_tokens=16, rerank=2, prefilter_pages=5)


@pytest.mark.parametrize("summary", ["mean", "bounds"])
def test_pages_from_new_keys_equal_pages_from_the_cache(summary):
    """A cache rank observing with ``k_new`` (``takes_new_keys``) folds the same page
    summaries as one reading the cache's newest row; a rebuild then needs the exact keys
    and refuses."""
    sim = DecodeSim(B=2, Hq=4, Hkv=2, D=8, prompt_len=13, steps=9, n_layers=1, kv_start=[0, 2], seed=4)
    pol = make_policy("asyncspade", sim, **COMMON, score_keys="int4", prefilter_pages=4, prefilter_page_size=4,
                      prefilter_summary=summary)
    assert pol.takes_new_keys(pol.new_state(2, "cpu"))
    k = sim.k_all[0].clone()
    L = k.shape[2]
    kv = torch.tensor([13, 13])
    states = []
    for use_new in (False, True):
        st = pol.new_state(2, "cpu")
        st.seq_len = 13
        pol.prefill(st, 0, sim.q_all[0, :, :, :13], k, k, kv)
        for t in range(13, L - 2):
            st.seq_len = t + 1
            kn = k[:, :, t]
            pol.observe(st, 0, sim.q_all[0, :, :, t], k, torch.tensor([t + 1, t + 1]), k_new=kn if use_new else None)
        states.append(st.layers[0])
    assert all(torch.equal(a, b) for a, b in zip(states[0].pages, states[1].pages))
    with pytest.raises(RuntimeError, match="needs a rebuild"):
        pol.observe(st, 0, sim.q_all[0, :, :, 0], torch.cat([k, k], 2), torch.tensor([L, L]), k_new=k[:, :, 0])

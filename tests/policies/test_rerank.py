"""``asyncspade``'s two-stage selection (``policy.rerank`` m): the candidates, their
re-rank by the true query at attention, and that it moves the kept set toward the
exact top-K."""

from __future__ import annotations

import pytest
import torch

from spade import kernels
from tests.policies.sim import DecodeSim, make_policy, middle_sets

COMMON = dict(budget=12, sink_tokens=2, recent_tokens=3, predictor="last", window=3)  # K_mid = 7


def _overlaps(m: int, *, reduce: str = "sum_softmax", Hq: int = 4, Hkv: int = 2, starts=None,
              refresh_every: int = 1) -> list[float]:
    """Per (step, layer): |kept ∩ exact top-K_mid by the true query| / K_mid, averaged over
    (row, KV head). Queries are independent per step, so the predicted (last) query is
    stale: the one-stage selection misses much of the exact top-K."""
    sim = DecodeSim(B=2, Hq=Hq, Hkv=Hkv, kv_start=starts, prompt_len=50, steps=8, n_layers=2, seed=21)
    pol = make_policy("asyncspade", sim, **COMMON, rerank=m, group_reduce=reduce, refresh_every=refresh_every)
    oracle = make_policy("oracle", sim, budget=12, sink_tokens=2, recent_tokens=3, group_reduce=reduce)
    got = []

    def on_step(rec, state):
        k, v = sim.k_all[rec.layer], sim.v_all[rec.layer]
        sel = rec.sel
        assert sel.indices.shape[-1] == m * 7 and sel.keep == (7 if m > 1 else 0)
        kept = sel.reranked(rec.q, k, sim.spec.softmax_scale)
        assert kept.keep == 0 and kept.indices.shape[-1] == 7
        # what the run attended is the re-ranked selection
        want_out = kernels.sparse_decode_attention(rec.q, k, v, rec.kv_lens, kept.indices, n_sink=2, n_recent=3,
                                                   scale=sim.spec.softmax_scale, kv_start=sim.starts)
        torch.testing.assert_close(rec.out, want_out, rtol=1e-5, atol=1e-6)
        cands, keeps = middle_sets(sel), middle_sets(kept)
        exact = middle_sets(oracle.select(state, rec.layer, rec.q, k, rec.kv_lens))
        ov = []
        for b in range(sim.B):
            for h in range(sim.Hkv):
                assert keeps[b][h] <= cands[b][h]
                ov.append(len(keeps[b][h] & exact[b][h]) / max(1, len(exact[b][h])))
        got.append(sum(ov) / len(ov))

    sim.run(pol, on_step=on_step)
    return got


def test_rerank_one_is_the_one_stage_selection():
    sim = DecodeSim(B=2, Hq=4, Hkv=2, prompt_len=30, steps=1, seed=5)
    one = make_policy("asyncspade", sim, **COMMON)
    assert one.cfg.rerank == 1 and one.rerank_keep() is None and one.selection_layout() == (7, 2, 3)
    four = make_policy("asyncspade", sim, **COMMON, rerank=4)
    assert four.rerank_keep() == (7, "sum_softmax") and four.selection_layout() == (28, 2, 3)
    # the candidates of m = 4 contain the one-stage selection (same predicted query)
    ks, vs, kv = sim.fresh_cache()
    sels = []
    for pol in (one, four):
        st = pol.new_state(2, "cpu")
        st.seq_len = 30
        pol.prefill(st, 0, sim.q_all[0, :, :, :30], ks[0], vs[0], kv)
        st.seq_len = 31
        sels.append(pol.select(st, 0, None, ks[0], kv + 1))
    assert sels[0].keep == 0 and sels[1].keep == 7
    for a, b in zip(middle_sets(sels[0]), middle_sets(sels[1])):
        for x, y in zip(a, b):
            assert len(x) == 7 and len(y) == 26 and x <= y  # middle [2, 28): 26 < 28 candidates


@pytest.mark.parametrize("reduce", ["sum_softmax", "sum_logits"])
def test_rerank_moves_the_kept_set_toward_the_exact_top_k(reduce):
    """Mean overlap with the true query's exact top-K rises with m; once the candidates
    cover the whole middle (m K_mid >= middle) the kept set *is* the exact top-K for a
    reduction whose ranking needs no normaliser over the whole row (sum_logits; MHA for
    sum_softmax, where each head's softmax is monotone in its logits)."""
    means = {m: sum(o) / len(o) for m, o in ((m, _overlaps(m, reduce=reduce)) for m in (1, 2, 4))}
    assert means[1] < 0.7 and means[1] + 0.1 < means[2] < means[4]
    full = _overlaps(8, reduce=reduce, **({} if reduce == "sum_logits" else dict(Hq=2, Hkv=2)))
    assert min(full) == 1.0  # 8 * 7 = 56 candidates >= the middle (<= 53 positions)


def test_rerank_of_a_reused_candidate_set_follows_each_steps_query():
    """refresh_every = 3: between refreshes the candidates are the last refresh's, and the
    kept set still comes from each step's true query (left-padded rows too)."""
    reused = _overlaps(3, refresh_every=3, starts=[0, 7])
    stale = _overlaps(1, refresh_every=3, starts=[0, 7])
    assert sum(reused) > sum(stale) + 0.1 * len(stale)


def test_rerank_validates():
    from pydantic import ValidationError

    from spade.policies.asyncspade import AsyncSpadePolicyConfig

    with pytest.raises(ValidationError, match="rerank"):
        AsyncSpadePolicyConfig(rerank=0)

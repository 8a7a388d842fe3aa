"""Selection measurement: the replay measures what the policies select, and the
metrics keep their invariants (recall 1 at full budget, oracle overlap 1, ...)."""

import json
import math

import pytest
import torch

from spade import kernels
from spade.policies.asyncspade import AsyncSpadePolicyConfig
from spade.policies.oracle import OraclePolicyConfig
from spade.eval.config import SelectionEvalConfig
from spade.eval.selection import (Acc, Ranked, attended_mask, evaluate_captured, fixed_mass, group_scores_multi,
                                  index_mask, ridge_predict_shift, summarize, true_probs)
from spade.kernels.ridge import ridge_predict_ref
from spade.policies.asyncspade import AsyncSpadePolicy
from spade.policies.base import AttentionSpec, PolicyState, RopeSpec
from spade.policies.common import middle_bounds
from spade.policies.oracle import OraclePolicy

REDUCES = ["sum_logits", "max_logits", "sum_softmax"]


def _spec(hq, hkv, d=16, layers=1):
    return AttentionSpec(n_layers=layers, n_q_heads=hq, n_kv_heads=hkv, head_dim=d,
                         rope=RopeSpec(theta=10000.0, dim=d))


def _state(seq_len, batch):
    return PolicyState(batch_size=batch, layers=[None], seq_len=seq_len)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (3, 1)])
def test_group_scores_multi_matches_kernel(hq, hkv, rng):
    B, L, D = 3, 37, 16
    q = torch.randn(B, hq, D, generator=rng)
    k = torch.randn(hkv, L, D, generator=rng)
    kv = torch.tensor([37, 20, 5], dtype=torch.int32)
    got = group_scores_multi(q, k, kv, 0.25, REDUCES)
    for red in REDUCES:
        ref = kernels.group_scores(q, k[None].expand(B, hkv, L, D), kv, scale=0.25, reduce=red)
        assert torch.allclose(got[red], ref, atol=1e-5, rtol=1e-5), red


def test_index_mask_empty_slots_never_clear_a_position():
    idx = torch.tensor([[[-1, 0, 5, -1], [-1, -1, -1, -1]]], dtype=torch.int32)
    m = index_mask(idx, 8)
    assert m[0, 0].nonzero().flatten().tolist() == [0, 5]
    assert not m[0, 1].any()


@pytest.mark.parametrize("mode", ["ridge", "softmax_ridge", "assembled"])
def test_ridge_shift_equals_kernel_reference(mode, rng):
    w = torch.randn(5, 9, 16, generator=rng)
    ours = ridge_predict_shift(w, mode, 1e-2, shift=True)
    assert torch.allclose(ours, ridge_predict_ref(w, 9, mode=mode, eps=1e-2), atol=1e-5)
    # without the shift, plain ridge (λ -> 0) is the projection of the newest query onto
    # the span of its predecessors: the residual is orthogonal to them
    rec = ridge_predict_shift(w, "ridge", 1e-9, shift=False)
    resid = w[:, -1] - rec  # [5, 16]
    assert torch.allclose(torch.einsum("nwd,nd->nw", w[:, :-1], resid), torch.zeros(5, 8), atol=1e-3)
    assert not torch.allclose(rec, ridge_predict_shift(w, "ridge", 1e-9, shift=True), atol=1e-2)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("budget", [12, 19, 40, 200])
def test_ranked_prefix_is_the_oracle_selection(hq, hkv, budget, rng):
    """One ranking, cut at K - sink - recent, is exactly ``OraclePolicy.select``."""
    B, L, D, sink, recent = 4, 61, 16, 2, 5
    spec = _spec(hq, hkv, D)
    k = torch.randn(hkv, L, D, generator=rng)
    kc = k[None].expand(B, hkv, L, D)
    q = torch.randn(B, hq, D, generator=rng)
    kv = torch.tensor([61, 50, 33, 30], dtype=torch.int32)
    lo, hi = middle_bounds(kv, None, sink, recent)
    probs = true_probs(q, kc, kv, spec.softmax_scale)
    fm = fixed_mass(probs, kv, sink, recent)
    for red in REDUCES:
        pol = OraclePolicy(OraclePolicyConfig(budget=budget, sink_tokens=sink, recent_tokens=recent,
                                              group_reduce=red), spec)
        sel = pol.select(_state(int(kv.max()), B), 0, q, kc, kv)
        want = attended_mask(sel, kv, L, hkv)
        rk = Ranked(group_scores_multi(q, k, kv, spec.softmax_scale, [red])[red], lo, hi, 64)
        kt = torch.full((B,), budget - sink - recent)
        fixed = attended_mask(type(sel)(indices=torch.empty(B, hkv, 0, dtype=torch.int32), n_sink=sink,
                                        n_recent=recent) if sel is not None else None, kv, L, hkv)
        got = fixed | rk.mask(kt) if sel is not None else fixed
        assert torch.equal(got, want), red
        # recall from the ranking == recall of the mask
        rec_mask = torch.einsum("bhgl,bhl->bhg", probs, want.float()).mean(dim=(1, 2))
        assert torch.allclose(rk.recall(probs, fm, kt), rec_mask, atol=1e-5)
        assert torch.allclose(rk.overlap(rk, kt), torch.ones(B, dtype=torch.float64))



def _select_once(pol, win, kc, ts):
    """The policy's prefill of windows ``win`` at positions ``ts``, then one select and
    the predicted query: (state, selection, q_hat, kv_lens)."""
    st = _state(int(ts.max()), len(ts))
    pol.prefill(st, 0, win, kc, kc, ts.to(torch.int32))
    st.seq_len += 1
    kv = (ts + 1).to(torch.int32)
    return st, pol.select(st, 0, None, kc, kv), pol.predict_query(st, 0, kv), kv

@pytest.mark.parametrize("predictor", ["last", "assembled"])
@pytest.mark.parametrize("rope", [False, True])
def test_ranked_matches_asyncspade_select(predictor, rope, rng):
    """The predicted query the replay ranks gives exactly ``AsyncSpadePolicy.select``'s set."""
    B, L, D, W, budget = 3, 70, 16, 4, 30
    spec = _spec(6, 2, D)
    cfg = AsyncSpadePolicyConfig(budget=budget, sink_tokens=2, recent_tokens=4, predictor=predictor, window=W,
                                 rope_aware=rope, group_reduce="sum_logits")
    k = torch.randn(2, L, D, generator=rng)
    kc = k[None].expand(B, 2, L, D)
    ts = torch.tensor([69, 50, 40])
    qall = torch.randn(6, L, D, generator=rng)
    win = torch.stack([qall[:, t - W - 1:t] for t in ts.tolist()])
    pol = AsyncSpadePolicy(cfg, spec)
    st, sel, q_hat, kv = _select_once(pol, win, kc, ts)
    lo, hi = middle_bounds(kv, None, 2, 4)
    rk = Ranked(group_scores_multi(q_hat, k, kv, spec.softmax_scale, ["sum_logits"])["sum_logits"], lo, hi, 64)
    got = rk.mask(torch.full((B,), budget - 6)) | attended_mask(
        type(sel)(indices=torch.empty(B, 2, 0, dtype=torch.int32), n_sink=2, n_recent=4), kv, L, 2)
    assert torch.equal(got, attended_mask(sel, kv, L, 2))
    if predictor == "last" and not rope:  # the prediction is q_{t-1}
        assert torch.allclose(q_hat, qall[:, ts - 1].transpose(0, 1))


def _random_capture(rng, layers=2, hq=4, hkv=2, T=90, D=16):
    qs = [torch.randn(hq, T, D, generator=rng) for _ in range(layers)]
    ks = [torch.randn(hkv, T, D, generator=rng) for _ in range(layers)]
    return qs, ks


def _cfg(**kw):
    base = dict(context_tokens=90, start=40, positions=6, budgets=[24], context_fractions=[2], sink_tokens=2,
                recent_tokens=4, window=4, distances=[1, 3], page_size=4,
                baselines=["oracle", "quest", "streaming", "tova"])
    base.update(kw)
    return SelectionEvalConfig(**base)


def test_full_budget_recalls_everything(rng):
    qs, ks = _random_capture(rng)
    spec = _spec(4, 2, 16, layers=2)
    cfg = _cfg(budgets=[128], context_fractions=[])
    acc = Acc(2)
    evaluate_captured(cfg, spec, qs, ks, acc)
    rows = summarize(acc)
    assert {r["policy"] for r in rows} >= {"oracle", "quest", "streaming", "tova", "asyncspade[assembled,rope]"}
    for r in rows:
        assert r["recall"] == pytest.approx(1.0, abs=1e-5), r["policy"]


def test_invariants_at_small_budget(rng):
    qs, ks = _random_capture(rng)
    spec = _spec(4, 2, 16, layers=2)
    cfg = _cfg()
    acc = Acc(2)
    evaluate_captured(cfg, spec, qs, ks, acc)
    rows = {(r["budget"], r["policy"], r["reduce"]): r for r in summarize(acc)}
    for (b, p, red), r in rows.items():
        assert 0.0 <= r["recall"] <= 1.0 + 1e-6
        assert 0.0 <= r["overlap"] <= 1.0 + 1e-9
        if p == "oracle":
            assert r["overlap"] == pytest.approx(1.0)
    for b in ("K=24", "K=ctx/2"):
        # asyncspade[last] predicts q_{t-1}: the same selection as the stale query at d = 1
        last, stale = rows[b, "asyncspade[last]", "sum_logits"], rows[b, "stale[d=1]", "sum_logits"]
        assert last["overlap"] == pytest.approx(stale["overlap"]) and last["recall"] == pytest.approx(stale["recall"])
        # the Fig. 5 "shift" ridge is the policy's ridge predictor
        ridge, shifted = rows[b, "asyncspade[ridge]", "sum_logits"], rows[b, "ridge[shift]", "sum_logits"]
        assert ridge["overlap"] == pytest.approx(shifted["overlap"], abs=1e-6)
    assert rows["K=24", "tova", "-"]["n"] == 2 * 6  # layers x positions


def test_oracle_recall_dominates_with_mha(rng):
    """With one query head per KV head the oracle's middle is the top attention mass,
    so no predictor (same sinks and recent window) can keep more."""
    qs, ks = _random_capture(rng, hq=3, hkv=3)
    spec = _spec(3, 3, 16, layers=2)
    acc = Acc(2)
    evaluate_captured(_cfg(baselines=["oracle"]), spec, qs, ks, acc)
    rows = summarize(acc)
    for r in rows:
        if r["policy"].startswith("asyncspade"):
            o = next(x for x in rows if x["policy"] == "oracle" and x["budget"] == r["budget"]
                     and x["reduce"] == r["reduce"])
            for a, b in zip(r["recall_per_layer"], o["recall_per_layer"]):
                assert a <= b + 1e-6


def test_capture_matches_the_model(smollm2):
    from spade.eval.capture import capture_qk

    model, tok = smollm2
    ids = torch.tensor(tok("The quick brown fox jumps over the lazy dog. " * 4)["input_ids"][:40])
    cap = capture_qk(model, ids)
    with torch.no_grad():
        out = model(input_ids=ids[None], use_cache=True)
    assert torch.allclose(cap.logits, out.logits[0], atol=1e-4)
    cfg = model.config
    assert len(cap.q) == cfg.num_hidden_layers
    assert cap.q[0].shape == (cfg.num_attention_heads, 40, cfg.head_dim)
    keys = out.past_key_values.layers[3].keys[0]  # post-RoPE keys of layer 3
    assert torch.allclose(cap.k[3], keys, atol=1e-5)


def test_run_selection_end_to_end(smollm2, tmp_path):
    from spade.eval.selection import run_selection

    cfg = SelectionEvalConfig(context_tokens=72, start=36, positions=3, budgets=[32], context_fractions=[2],
                              distances=[1, 2], predictors=["last", "assembled"], rope_aware=[False, True],
                              group_reduces=["sum_logits", "sum_softmax"])
    res = run_selection(cfg, tmp_path, "cpu")
    m = res["models"]["smollm2-135m"]
    data = json.loads((tmp_path / "selection_smollm2-135m.json").read_text())
    assert len(data["rows"]) == len(m["rows"])
    for p in m["plots"]:
        assert (tmp_path / p.split("/")[-1]).stat().st_size > 1000
    for r in m["rows"]:
        assert len(r["recall_per_layer"]) == 30
        assert not math.isnan(r["recall"]) and 0 < r["recall"] <= 1 + 1e-6
        if r["policy"] == "oracle":
            assert r["overlap"] == pytest.approx(1.0)


def test_rerank_rows_measure_the_policys_reranked_selection(rng):
    """``reranks``: the replayed two-stage rows give the recall of ``AsyncSpadePolicy(rerank=m)``'s
    candidates re-ranked by the true query (``Selection.reranked``), position by position;
    candidates covering the whole middle keep exactly the oracle's set (overlap 1)."""
    from spade.eval.selection import positions_for

    qs, ks = _random_capture(rng, layers=1, hq=6, hkv=2)
    spec = _spec(6, 2, 16, layers=1)
    cfg = _cfg(budgets=[24], context_fractions=[], baselines=["oracle"], predictors=["last"], rope_aware=[False],
               group_reduces=["sum_logits"], reranks=[1, 3, 5], shift_ablation=False, distances=[1])
    acc = Acc(1)
    evaluate_captured(cfg, spec, qs, ks, acc)
    rows = {r["policy"]: r for r in summarize(acc)}
    q, k = qs[0], ks[0]
    ts = positions_for(cfg, q.shape[1])
    B, L, R = len(ts), q.shape[1], cfg.window + 1
    kc = k[None].expand(B, *k.shape)
    pol = AsyncSpadePolicy(AsyncSpadePolicyConfig(budget=24, sink_tokens=2, recent_tokens=4, predictor="last",
                                                  window=cfg.window, group_reduce="sum_logits", rerank=3,
                                                  rope_aware=False), spec)
    st = _state(int(ts.max()), B)
    pol.prefill(st, 0, torch.stack([q[:, t - R:t] for t in ts.tolist()]), kc, kc, ts.to(torch.int32))
    st.seq_len += 1
    kv = (ts + 1).to(torch.int32)
    q_t = q[:, ts].transpose(0, 1).contiguous()
    sel = pol.select(st, 0, None, kc, kv)
    assert sel.keep == 18 and sel.indices.shape[-1] == 54
    mask = attended_mask(sel.reranked(q_t, kc, spec.softmax_scale), kv, L, 2)
    probs = true_probs(q_t, kc, kv, spec.softmax_scale)
    want = float(torch.einsum("bhgl,bhl->bhg", probs, mask.to(probs.dtype)).mean())
    assert rows["asyncspade[last,rerank=3]"]["recall"] == pytest.approx(want, abs=1e-6)
    assert rows["asyncspade[last,rerank=5]"]["overlap"] == pytest.approx(1.0)  # 5 * 18 >= every middle here
    assert rows["asyncspade[last,rerank=3]"]["overlap"] > rows["asyncspade[last]"]["overlap"]


def test_rerank_keys_score_the_candidates_on_the_policys_copy(rng):
    """``rerank_keys``: rows per key kind beside the exact re-rank, each scoring the same
    candidates on the copy the policy keeps with ``score_keys`` of that kind (int4: each row's
    smoothing fitted on its prompt), which the replay's dequantised cache equals."""
    from spade.eval.selection import _LayerReplay, positions_for
    from spade.kernels.quant import unpack_int4

    qs, ks = _random_capture(rng, layers=1, hq=6, hkv=2)
    spec = _spec(6, 2, 16, layers=1)
    cfg = _cfg(budgets=[24], context_fractions=[], baselines=["oracle"], predictors=["last"], rope_aware=[False],
               group_reduces=["sum_logits"], reranks=[3], rerank_keys=["exact", "int8", "int4"],
               shift_ablation=False, distances=[1])
    acc = Acc(1)
    evaluate_captured(cfg, spec, qs, ks, acc)
    rows = {r["policy"]: r for r in summarize(acc)}
    names = ["asyncspade[last,rerank=3]", "asyncspade[last,rerank=3,keys=int8]", "asyncspade[last,rerank=3,keys=int4]"]
    assert all(0 < rows[n]["recall"] <= 1 + 1e-6 for n in names)
    q, k = qs[0], ks[0]
    ts = positions_for(cfg, q.shape[1])
    B, R = len(ts), cfg.window + 1
    rep = _LayerReplay(cfg, spec, q, k, ts, 0, Acc(1))
    kc = k[None].expand(B, *k.shape)
    for kind in ("int8", "int4"):
        pol = AsyncSpadePolicy(AsyncSpadePolicyConfig(budget=24, sink_tokens=2, recent_tokens=4, predictor="last",
                                                      window=cfg.window, group_reduce="sum_logits", score_keys=kind,
                                                      rope_aware=False), spec)
        st = _state(int(ts.max()), B)
        pol.prefill(st, 0, torch.stack([q[:, t - R:t] for t in ts.tolist()]), kc, kc, ts.to(torch.int32))
        lay = st.layers[0]
        vals = unpack_int4(lay.kq).float() * lay.k_smooth[:, :, None, :] if kind == "int4" else lay.kq.float()
        got = vals * lay.ks[..., None]
        want = rep.rerank_cache(kind).float()
        assert not torch.equal(want, kc.float())  # a copy, not the exact keys
        for b, t in enumerate(ts.tolist()):
            assert torch.allclose(got[b, :, :t], want[b, :, :t], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rope", [False, True])
def test_channel_ranking_matches_asyncspade_select_with_score_channels(rope, rng):
    """The replay's ``r = d/n`` rows (the query masked to the channels the policy picks
    from the window and the prefix's keys) give exactly the set ``select`` gives with
    ``score_channels = d/n`` (the gathered copy); and the recommendation takes the smallest
    r within the tolerance."""
    from spade.eval.selection import _LayerReplay, recommend_channels

    B, L, D, W, budget = 3, 70, 16, 4, 30
    spec = _spec(6, 2, D)
    k = torch.randn(2, L, D, generator=rng) * torch.rand(D, generator=rng) * 2
    qall = torch.randn(6, L, D, generator=rng)
    ts = torch.tensor([69, 50, 40])
    cfg = _cfg(budgets=[budget], context_fractions=[], window=W, predictors=["assembled"], rope_aware=[rope],
               group_reduces=["sum_logits"], baselines=["oracle"], score_channels=[1, 4])
    rep = _LayerReplay(cfg, spec, qall, k, ts, 0, Acc(1))
    win = torch.stack([qall[:, t - W - 1:t] for t in ts.tolist()])
    kc = k[None].expand(B, 2, L, D)
    pol = AsyncSpadePolicy(AsyncSpadePolicyConfig(budget=budget, sink_tokens=2, recent_tokens=4, predictor="assembled",
                                                  window=W, rope_aware=rope, group_reduce="sum_logits",
                                                  score_channels=D // 4), spec)
    st, sel, q_hat, kv = _select_once(pol, win, kc, ts)
    mask = rep.channel_mask(win, D // 4)
    assert torch.equal(mask.view(B, 2, 3, D)[:, :, 0].nonzero()[:, 2].view(B, 2, -1), st.layers[0].chans)
    lo, hi = middle_bounds(kv, None, 2, 4)
    rk = Ranked(group_scores_multi(q_hat * mask, k, kv, spec.softmax_scale, ["sum_logits"])["sum_logits"], lo, hi, 64)
    got = rk.mask(torch.full((B,), budget - 6)) | attended_mask(
        type(sel)(indices=torch.empty(B, 2, 0, dtype=torch.int32), n_sink=2, n_recent=4), kv, L, 2)
    assert torch.equal(got, attended_mask(sel, kv, L, 2))
    rows = [{"budget": "K=8", "policy": "asyncspade[last]", "reduce": "-", "recall": 0.80},
            {"budget": "K=8", "policy": "asyncspade[last,r=d/2]", "reduce": "-", "recall": 0.795},
            {"budget": "K=8", "policy": "asyncspade[last,r=d/4]", "reduce": "-", "recall": 0.78}]
    assert recommend_channels(rows, [1, 2, 4], 0.01)["K=8 asyncspade[last] -"]["r"] == "d/2"
    assert recommend_channels(rows, [1, 2, 4], 0.03)["K=8 asyncspade[last] -"]["r"] == "d/4"
    assert recommend_channels(rows, [1, 2, 4], 0.001)["K=8 asyncspade[last] -"]["r"] == "d"

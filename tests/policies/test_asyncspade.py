"""AsyncSpade: top-K with a predicted query; predictors and the RoPE helpers."""

from __future__ import annotations

import pytest
import torch

from spade.policies.base import RopeSpec
from spade.policies.predictors import predict, rotate
from tests.conftest import INTERPRET
from tests.policies.sim import DecodeSim, attended_sets, make_policy, middle_sets


@pytest.mark.parametrize("B,Hq,Hkv,starts", [(1, 2, 2, None), (3, 4, 2, [0, 6, 3]), (3, 4, 1, [5, 0, 0])])
def test_last_predictor_equals_oracle_on_previous_query(B, Hq, Hkv, starts):
    """predictor=last selects exactly what the oracle selects with q_{t-1} (the last
    prompt query at the first decode step). ``sum_logits``: with ``sum_softmax`` the
    policy's normaliser leaves out the newest key (it selects ahead), the oracle's not."""
    sim = DecodeSim(B=B, Hq=Hq, Hkv=Hkv, kv_start=starts, prompt_len=43, steps=6, n_layers=2, seed=6)
    common = dict(budget=20, sink_tokens=2, recent_tokens=3, group_reduce="sum_logits")
    pol = make_policy("asyncspade", sim, **common, predictor="last", window=3)
    oracle = make_policy("oracle", sim, **common)
    checked = 0

    def on_step(rec, state):
        nonlocal checked
        prev_q = sim.q_all[rec.layer, :, :, rec.seq_len - 2]  # q_{t-1}
        want = oracle.select(state, rec.layer, prev_q, sim.k_all[rec.layer], rec.kv_lens)
        assert middle_sets(rec.sel) == middle_sets(want)
        assert (rec.sel.n_sink, rec.sel.n_recent) == (want.n_sink, want.n_recent)
        checked += 1

    sim.run(pol, on_step=on_step)
    assert checked == sim.steps * sim.n_layers


def test_select_ignores_the_current_query():
    sim = DecodeSim(B=2, Hq=4, Hkv=2, prompt_len=30, steps=1, seed=7)
    pol = make_policy("asyncspade", sim, budget=12, sink_tokens=1, recent_tokens=2, window=4)
    st = pol.new_state(2, "cpu")
    ks, vs, kv = sim.fresh_cache()
    st.seq_len = 30
    pol.prefill(st, 0, sim.q_all[0, :, :, :30], ks[0], vs[0], kv)
    st.seq_len, kv = 31, kv + 1
    a = pol.select(st, 0, None, ks[0], kv)
    b = pol.select(st, 0, torch.randn(2, 4, 16), ks[0], kv)
    assert torch.equal(a.indices, b.indices)
    assert type(pol).needs_current_query is False


def test_window_bookkeeping_and_graph_key():
    """n_valid grows by one per observed step from the prefill count up to W+1;
    it is derived from seq_len, so it needs no host counter."""
    sim = DecodeSim(B=1, Hq=2, Hkv=2, prompt_len=3, steps=6, seed=8)
    pol = make_policy("asyncspade", sim, budget=4, sink_tokens=0, recent_tokens=1, window=5)
    got = []
    sim.run(pol, on_step=lambda rec, st: got.append((pol.n_valid(st), pol.graph_key(st))))
    # select at seq_len 4 sees the 3 prompt queries; each later step one more, capped at 6
    assert [n for n, _ in got] == [3, 4, 5, 6, 6, 6]
    assert got[0][1] == (True, 3) and got[-1][1] == (False, 6)


@pytest.mark.parametrize("n,starts", [(3, None), (2, [0, 5])])
def test_refresh_every_reuses_the_last_selection_between_refreshes(n, starts):
    """``refresh_every=n``: every layer selects at the first sparse step, then layer l at
    the steps d after it with d % n == l % n (the layers take turns) — the scan's best
    K_mid - (n - 1), what an every-step policy with n - 1 fewer tokens of budget makes
    there (the window still takes every step's query) — and in between the same selection
    object, whose n - 1 tail slots take each token as it leaves the recent window (attended
    from then on, budget kept); every refresh writes the layer's one buffer in place; the
    graph key carries the step's phase."""
    sim = DecodeSim(B=2, Hq=4, Hkv=2, kv_start=starts, prompt_len=31, steps=9, n_layers=2, seed=41)
    common = dict(sink_tokens=2, recent_tokens=3, window=4, predictor="assembled")
    every = {}
    sim.run(make_policy("asyncspade", sim, budget=14 - (n - 1), **common),
            on_step=lambda rec, st: every.setdefault((rec.seq_len, rec.layer), middle_sets(rec.sel)))
    pol = make_policy("asyncspade", sim, budget=14, **common, refresh_every=n)
    seen = []  # (seq_len, layer, selection, its indices' storage, middle sets then, kv_lens, graph key)
    sim.run(pol, on_step=lambda rec, st: seen.append(
        (rec.seq_len, rec.layer, rec.sel, rec.sel.indices.data_ptr(), middle_sets(rec.sel), rec.kv_lens.tolist(),
         pol.graph_key(st))))
    first = 32  # the first decode step (the prompt alone is past the budget)
    lo = [2 + (0 if starts is None else starts[b]) for b in range(2)]
    last: dict = {}
    turns = set()
    for seq, layer, sel, ptr, sets, kv, key in seen:
        d = seq - first
        assert key[-1] == (-1 if d == 0 else d % n)
        if d == 0 or d % n == layer % n:
            turns.add((d, layer))
            assert sets == every[(seq, layer)]
            assert sel.indices.shape[2] == 14 - 2 - 3  # K_mid slots: the scan's, then n - 1 tail slots (-1 here)
            assert layer not in last or ptr == last[layer][1]  # the same buffer, rewritten
            last[layer] = (sel, ptr, sets, kv)
        else:
            held, base = last[layer][0], last[layer][3]
            assert sel is held
            for b in range(2):
                tail = {p for p in range(base[b] - 3, kv[b] - 3) if p >= lo[b]}
                assert tail and all(sets[b][h] == last[layer][2][b][h] | tail for h in range(2))
    assert {(1, 1), (n, 0)} <= turns and (1, 0) not in turns  # the two layers take turns
    assert len(make_policy("asyncspade", sim, budget=14, **common).graph_key(pol.new_state(2, "cpu"))) == 2


@pytest.mark.parametrize("n,want", [(1, None), (3, 2.0)])
def test_refresh_every_widens_the_carry_margin(n, want, monkeypatch):
    """Selecting every n > 1 steps, the threshold carried to the next selection is n steps
    old: the policy asks the top-K for a wider margin (``REFRESH_CARRY_MARGIN``)."""
    from spade import kernels
    from spade.policies import asyncspade as A

    seen = []
    real = kernels.score_topk

    def spy(*a, carry_margin=None, **kw):
        seen.append(carry_margin)
        return real(*a, carry_margin=carry_margin, **kw)

    monkeypatch.setattr(kernels, "score_topk", spy)
    sim = DecodeSim(B=1, Hq=2, Hkv=1, prompt_len=30, steps=4, seed=9)
    sim.run(make_policy("asyncspade", sim, budget=12, sink_tokens=1, recent_tokens=2, window=3, refresh_every=n))
    assert seen and set(seen) == {want} and A.REFRESH_CARRY_MARGIN == 2.0
    assert len(seen) == (4 if n == 1 else 2)  # refreshes at the first step and 3 steps later


def test_refresh_every_is_a_function_of_the_cache_length():
    """A warm-up run and the CUDA-graph capture after it call ``select`` twice at one
    cache length, and a cache rank's packs read the graph key after earlier packs
    selected: at the first selection (odd length, n=2) and every 2 after, all refresh;
    in between all reuse."""
    sim = DecodeSim(B=1, Hq=2, Hkv=1, prompt_len=30, steps=1, seed=9)
    pol = make_policy("asyncspade", sim, budget=12, sink_tokens=1, recent_tokens=2, window=3, refresh_every=2)
    st = pol.new_state(1, "cpu")
    (k,), (v,), kv = sim.fresh_cache()
    st.seq_len = 30
    pol.prefill(st, 0, sim.q_all[0, :, :, :30], k, v, kv)
    for seq, fresh in ((31, True), (32, False), (33, True), (34, False)):
        st.seq_len, kv = seq, kv + 1
        key = pol.graph_key(st)
        a = pol.select(st, 0, None, k, kv)
        # (read after a selection, as a later pack reads it)
        assert pol.graph_key(st) == key and (key[-1] in (-1, 0)) is fresh
        b = pol.select(st, 0, None, k, kv)
        if fresh:
            assert a is not b and a.indices is b.indices is st.layers[0].keep  # one buffer, written in place
        else:
            assert a is b is st.layers[0].last_sel
    assert st.refresh_anchor == 31
    pol.prefill(st, 0, sim.q_all[0, :, :, :30], k, v, kv - 4)  # a new prompt: a new anchor
    assert st.refresh_anchor is None and st.layers[0].last_sel is None


def test_no_query_seen_means_full_attention():
    sim = DecodeSim(B=1, Hq=2, Hkv=2, prompt_len=30, steps=1)
    pol = make_policy("asyncspade", sim, budget=12, sink_tokens=1, recent_tokens=2)
    st = pol.new_state(1, "cpu")
    st.seq_len = 31
    ks, _, kv = sim.fresh_cache()
    assert pol.select(st, 0, None, ks[0], kv + 1) is None


def test_requires_seq_len():
    sim = DecodeSim(B=1, Hq=2, Hkv=2, prompt_len=30, steps=1)
    pol = make_policy("oracle", sim, budget=12, sink_tokens=1, recent_tokens=2)
    ks, _, kv = sim.fresh_cache()
    with pytest.raises(RuntimeError, match="seq_len"):
        pol.select(pol.new_state(1, "cpu"), 0, sim.q_all[0, :, :, 0], ks[0], kv)


# ------------------------------------------------------------------ RoPE
@pytest.mark.parametrize("dim,scaling", [(0, 1.0), (8, 1.0), (16, 0.7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_round_trip_is_exact(dim, scaling, dtype):
    """un-rotate ∘ rotate is the identity (to float32 rounding), partial rotary and
    attention_scaling included; the rotation preserves norms."""
    spec = RopeSpec(theta=10000.0, dim=dim, attention_scaling=scaling)
    x = torch.randn(3, 4, 16).to(dtype)
    pos = torch.tensor([0, 17, 4093])
    y = rotate(x, pos, spec)
    torch.testing.assert_close(rotate(y, pos, spec, inverse=True), x.float(), rtol=0, atol=2e-5)
    torch.testing.assert_close(y.norm(dim=-1), x.float().norm(dim=-1), rtol=1e-5, atol=1e-5)
    if dim:
        assert torch.equal(y[..., dim:], x.float()[..., dim:])
    # [B, H, T, D] with per-row positions [B, T]
    x4 = torch.randn(2, 3, 5, 16)
    p2 = torch.arange(10).view(2, 5) * 7
    y4 = rotate(x4, p2, spec)
    torch.testing.assert_close(y4[:, :, 2], rotate(x4[:, :, 2], p2[:, 2], spec), rtol=0, atol=1e-6)
    torch.testing.assert_close(rotate(y4, p2, spec, inverse=True), x4, rtol=0, atol=2e-5)


def test_rope_matches_hf_convention():
    """rotate() equals q·cos + rotate_half(q)·sin with RopeSpec's own cos/sin."""
    spec = RopeSpec(theta=500.0, dim=8)
    x = torch.randn(2, 3, 8)
    pos = torch.tensor([3, 11])
    cos, sin = spec.cos_sin(pos)
    rh = torch.cat([-x[..., 4:], x[..., :4]], -1)
    torch.testing.assert_close(rotate(x, pos, spec), x * cos[:, None] + rh * sin[:, None], rtol=1e-6, atol=1e-6)


def _rope_queries(sim: DecodeSim, spec: RopeSpec, seed: int) -> torch.Tensor:
    """Queries that are one fixed pre-RoPE vector per (row, head) rotated to their position."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(sim.n_layers, sim.B, sim.Hq, 1, sim.D, generator=g).expand(-1, -1, -1, sim.capacity, -1)
    starts = torch.tensor(sim.kv_start or [0] * sim.B)
    pos = torch.arange(sim.capacity)[None, :] - starts[:, None]  # [B, L]
    return torch.stack([rotate(u[layer], pos, spec) for layer in range(sim.n_layers)])


@pytest.mark.parametrize("starts", [None, [0, 4, 9]])
def test_rope_aware_last_predicts_rotating_queries_exactly(starts):
    """If queries are a fixed vector under RoPE, rope_aware + last predicts q_t
    itself (un-rotate by t-1, rotate by t), so it selects what the oracle selects
    with the true query; without rope_aware it does not."""
    spec = RopeSpec(theta=50.0)  # fast rotation: q_{t-1} is a poor guess for q_t
    B = 1 if starts is None else 3
    sim = DecodeSim(B=B, Hq=4, Hkv=2, kv_start=starts, prompt_len=50, steps=5, rope=spec, seed=9)
    sim.q_all = _rope_queries(sim, spec, 1)
    # sum_logits: the oracle's sum_softmax normaliser counts the newest key, asyncspade's not
    common = dict(budget=16, sink_tokens=1, recent_tokens=2, group_reduce="sum_logits")
    oracle_sets = [middle_sets(r.sel) for r in sim.run(make_policy("oracle", sim, **common))]
    aware = [middle_sets(r.sel) for r in sim.run(make_policy("asyncspade", sim, **common, predictor="last",
                                                             window=2, rope_aware=True))]
    plain = [middle_sets(r.sel) for r in sim.run(make_policy("asyncspade", sim, **common, predictor="last",
                                                             window=2, rope_aware=False))]
    assert aware == oracle_sets
    assert plain != oracle_sets


# ------------------------------------------------------------------ predictors
def _recurrent_queries(n_seq: int, T: int, D: int, seed: int, noise: float = 0.01) -> torch.Tensor:
    """[n_seq, T, D]: an offset plus a rotation that advances by a fixed angle per
    step (the same angle in every plane, so q_t = c + R^t u obeys one scalar linear
    recurrence across all dims), plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(n_seq, 1, D, generator=g)
    u = torch.randn(n_seq, 1, D, generator=g) * 2
    theta = 0.35
    t = torch.arange(T, dtype=torch.float32)[None, :, None]
    half = D // 2
    cos, sin = torch.cos(theta * t), torch.sin(theta * t)
    rot = torch.cat([u[..., :half] * cos - u[..., half:] * sin, u[..., :half] * sin + u[..., half:] * cos], -1)
    return c + rot + noise * torch.randn(n_seq, T, D, generator=g)


def _topk_overlap(q_hat: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, k: int) -> float:
    a = (keys @ q_hat[..., None]).squeeze(-1).topk(k).indices  # [N, k]
    b = (keys @ q[..., None]).squeeze(-1).topk(k).indices
    return sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b)) / (k * len(a))


def test_ridge_beats_last_on_a_linear_recurrence():
    """On queries that follow a linear recurrence, ridge has lower error than last
    and a higher top-K overlap with the true query's top-K. (The softmax variants
    are convex combinations of past queries, so they cannot extrapolate a rotation:
    no such claim for them.)"""
    kind = "ridge"
    W = 8
    seq = _recurrent_queries(24, W + 2, 32, seed=10)  # [N, W+2, D]
    window, truth = seq[:, : W + 1].reshape(4, 6, W + 1, 32), seq[:, W + 1].reshape(4, 6, 32)
    eps = 1e-3
    q_last = predict(window, W + 1, "last", eps)
    q_ridge = predict(window, W + 1, kind, eps)
    assert torch.equal(q_last, window[:, :, -1])
    err_last = (q_last - truth).norm(dim=-1).mean()
    err_ridge = (q_ridge - truth).norm(dim=-1).mean()
    assert err_ridge < 0.25 * err_last
    keys = torch.randn(24, 256, 32, generator=torch.Generator().manual_seed(11))
    ov_last = _topk_overlap(q_last.view(24, 32), truth.view(24, 32), keys, 16)
    ov_ridge = _topk_overlap(q_ridge.view(24, 32), truth.view(24, 32), keys, 16)
    assert ov_ridge > ov_last + 0.1


@pytest.mark.parametrize("kind", ["last", "ridge", "softmax_ridge", "assembled"])
def test_predict_shapes_and_partial_windows(kind):
    """Any n_valid in [1, R] works; with one valid query every kind returns it; rows
    before the valid ones do not matter."""
    w = torch.randn(2, 3, 5, 8)
    out = predict(w, 1, kind)
    assert out.shape == (2, 3, 8) and out.dtype == torch.float32
    torch.testing.assert_close(out, w[:, :, -1], rtol=1e-4, atol=1e-4)
    w2 = w.clone()
    w2[:, :, :2] = 1e3 * torch.randn(2, 3, 2, 8)
    torch.testing.assert_close(predict(w2, 3, kind), predict(w, 3, kind), rtol=1e-4, atol=1e-4)
    assert torch.isfinite(predict(w, 5, kind)).all()
    with pytest.raises(ValueError):
        predict(w, 0, kind)
    with pytest.raises(ValueError):
        predict(w, 6, kind)


# ------------------------------------------------------------------ int8 scoring keys
def _fresh_int8(k: torch.Tensor):
    from spade.kernels import quant

    return quant.quantize_keys_ref(k)


@pytest.mark.parametrize("B,Hq,Hkv,starts,dtype,reduce", [
    (1, 2, 2, None, torch.float32, "sum_logits"),
    (3, 4, 2, [0, 6, 3], torch.bfloat16, "sum_softmax"),
    (3, 4, 1, [5, 0, 0], torch.float16, "max_logits"),
])
def test_int8_copy_tracks_the_cache_and_selects_on_it(B, Hq, Hkv, starts, dtype, reduce):
    """After prefill and each observe, the policy's int8 copy equals a fresh quantisation
    of the valid cache; select scores exactly that copy (= topk_selection over freshly
    quantised keys with q_{t-1} rounded to the cache dtype); and it stays close to the
    exact-key selection."""
    from spade.policies.common import topk_selection

    sim = DecodeSim(B=B, Hq=Hq, Hkv=Hkv, kv_start=starts, prompt_len=43, steps=5, n_layers=2, seed=9, dtype=dtype)
    common = dict(budget=20, sink_tokens=2, recent_tokens=3, predictor="last", window=3, group_reduce=reduce)
    pol = make_policy("asyncspade", sim, **common, score_keys="int8")
    exact = make_policy("asyncspade", sim, **common)
    assert pol.cfg.score_keys == "int8" and exact.cfg.score_keys == "exact"
    st_exact = exact.new_state(B, "cpu")
    checked, overlap, total = 0, 0, 0

    def on_step(rec, state):
        nonlocal checked, overlap, total
        st = state.layers[rec.layer]
        k_live = sim.k_all[rec.layer]  # the valid part of the live cache
        want_q, want_s = _fresh_int8(k_live)
        for b in range(B):
            s, n = (0 if starts is None else starts[b]), int(rec.kv_lens[b])
            assert torch.equal(st.kq[b, :, s:n], want_q[b, :, s:n]), "int8 copy drifted from the cache"
            assert torch.equal(st.ks[b, :, s:n], want_s[b, :, s:n])
        prev_q = sim.q_all[rec.layer, :, :, rec.seq_len - 2].float().to(dtype)  # q_{t-1}
        # norm_lens: the policy's sum_softmax normaliser leaves out the newest key (asyncspade.select)
        want = topk_selection(prev_q, want_q, rec.kv_lens, sim.starts, budget=20, n_sink=2, n_recent=3,
                              scale=sim.spec.softmax_scale, reduce=reduce, k_scale=want_s,
                              norm_lens=rec.kv_lens - 1)
        assert middle_sets(rec.sel) == middle_sets(want)
        # the same step scored with exact keys
        st_exact.seq_len = state.seq_len
        st_exact.layers[rec.layer] = st
        ref = topk_selection(prev_q, k_live, rec.kv_lens, sim.starts, budget=20, n_sink=2, n_recent=3,
                             scale=sim.spec.softmax_scale, reduce=reduce, norm_lens=rec.kv_lens - 1)
        for a_row, b_row in zip(middle_sets(rec.sel), middle_sets(ref)):
            for a, b in zip(a_row, b_row):
                overlap += len(a & b)
                total += len(b)
        checked += 1

    sim.run(pol, on_step=on_step)
    assert checked == sim.steps * sim.n_layers
    assert overlap / total >= 0.9, overlap / total


def test_int8_copy_grows_with_a_growing_cache_view():
    """The cache rank without a static length passes views of length seq: the copy is
    rebuilt with doubled capacity when the view outgrows it, else appended in place."""
    sim = DecodeSim(B=2, Hq=4, Hkv=2, kv_start=[0, 3], prompt_len=10, steps=12, seed=10, extra=0)
    pol = make_policy("asyncspade", sim, budget=8, sink_tokens=1, recent_tokens=2, predictor="last", window=2,
                      score_keys="int8")
    st = pol.new_state(2, "cpu")
    ks, vs, kv = sim.fresh_cache()
    T = sim.prompt_len
    st.seq_len = T
    pol.prefill(st, 0, sim.q_all[0, :, :, :T], ks[0][:, :, :T], vs[0][:, :, :T], kv)
    caps = [st.layers[0].kq.shape[2]]
    for step in range(sim.steps):
        pos = T + step
        ks[0][:, :, pos] = sim.k_all[0, :, :, pos]
        kv = kv + 1
        st.seq_len = pos + 1
        view = ks[0][:, :, :pos + 1]
        sel = pol.select(st, 0, None, view, kv)
        pol.observe(st, 0, sim.q_all[0, :, :, pos], view, kv)
        caps.append(st.layers[0].kq.shape[2])
        want_q, want_s = _fresh_int8(sim.k_all[0, :, :, :pos + 1])
        lay = st.layers[0]
        for b, s in enumerate([0, 3]):
            assert torch.equal(lay.kq[b, :, s:pos + 1], want_q[b, :, s:pos + 1])
            assert torch.equal(lay.ks[b, :, s:pos + 1], want_s[b, :, s:pos + 1])
        assert sel is not None and sel.indices.shape[-1] == 5
    assert caps[0] == T and caps[-1] == 40 and len(set(caps)) == 3  # 10 -> 20 -> 40: rebuilt twice


@pytest.mark.parametrize("kernels_mode", ["torch", "triton"])
@pytest.mark.parametrize("score_keys", ["int8", "int4"])
def test_observe_with_the_steps_keys_needs_no_cache_append(score_keys, kernels_mode, monkeypatch):
    """``observe(k_new=...)`` (``takes_new_keys``: what the cache rank does with compressed
    keys) keeps the same copy and selections as appending each key to the cache and
    reading it back, while its cache never gets a decoded key; a copy that would need a
    rebuild from such a cache (a longer view) raises instead of reading stale keys."""
    if kernels_mode == "triton" and not INTERPRET:  # a GPU machine: its CUDA path is the GPU tests'
        pytest.skip("Triton on CPU tensors needs the interpreter")
    monkeypatch.setenv("SPADE_KERNELS", kernels_mode)
    sim = DecodeSim(B=2, Hq=4, Hkv=2, kv_start=[0, 3], prompt_len=20, steps=4, seed=21, dtype=torch.bfloat16)
    pol = make_policy("asyncspade", sim, budget=10, sink_tokens=1, recent_tokens=2, predictor="last", window=2,
                      score_keys=score_keys, rope_aware=False)
    assert pol.takes_new_keys(None)
    assert not make_policy("asyncspade", sim, budget=10, sink_tokens=1, recent_tokens=2).takes_new_keys(None)
    T = sim.prompt_len
    (ka,), (va,), kv = sim.fresh_cache()
    kb, vb = ka.clone(), va.clone()  # b: never appended to
    sa, sb = pol.new_state(2, "cpu"), pol.new_state(2, "cpu")
    sa.kv_start = sb.kv_start = sim.starts
    for st, k, v in ((sa, ka, va), (sb, kb, vb)):
        st.seq_len = T
        pol.prefill(st, 0, sim.q_all[0, :, :, :T], k, v, kv)
    for step in range(sim.steps):
        pos = T + step
        kv = kv + 1
        ka[:, :, pos] = sim.k_all[0, :, :, pos]
        sa.seq_len = sb.seq_len = pos + 1
        q = sim.q_all[0, :, :, pos]
        pol.observe(sa, 0, q, ka, kv)
        pol.observe(sb, 0, q, kb, kv, k_new=sim.k_all[0, :, :, pos])
        la, lb = sa.layers[0], sb.layers[0]
        assert torch.equal(la.kq, lb.kq) and torch.equal(la.ks, lb.ks)
        sa.seq_len = sb.seq_len = pos + 2
        a = pol.select(sa, 0, None, ka, kv + 1)
        b = pol.select(sb, 0, None, kb, kv + 1)
        assert torch.equal(a.indices, b.indices)
    assert not torch.equal(ka, kb)  # b's cache really lacks the decoded keys
    assert sb.layers[0].keys_elsewhere
    longer = torch.zeros(2, 2, kb.shape[2] + 1, sim.D, dtype=kb.dtype)
    with pytest.raises(RuntimeError, match="rebuild"):
        pol.select(sb, 0, None, longer, kv + 1)
    sb.seq_len = T  # a new prompt (a whole cache) clears it
    pol.prefill(sb, 0, sim.q_all[0, :, :, :T], longer, longer, kv)
    assert not sb.layers[0].keys_elsewhere


@pytest.mark.parametrize("score_keys", ["exact", "int4"])
def test_select_writes_into_out(score_keys):
    """``select(out=...)`` (``select_takes_out``: a cache rank's output row) returns a
    Selection whose indices are ``out`` itself, equal to the selection made without it;
    a buffer of another shape is ignored (a fresh tensor comes back)."""
    sim = DecodeSim(B=2, Hq=4, Hkv=2, kv_start=[0, 3], prompt_len=30, steps=1, seed=22)
    pol = make_policy("asyncspade", sim, budget=12, sink_tokens=1, recent_tokens=2, window=3,
                      score_keys=score_keys, rope_aware=False)
    assert type(pol).select_takes_out
    st = pol.new_state(2, "cpu")
    st.kv_start = sim.starts
    (k,), (v,), kv = sim.fresh_cache()
    st.seq_len = 30
    pol.prefill(st, 0, sim.q_all[0, :, :, :30], k, v, kv)
    st.seq_len, kv = 31, kv + 1
    want = pol.select(st, 0, None, k, kv)
    buf = torch.full((3, 2, 2, 9), 5, dtype=torch.int32)
    row = buf[1]
    got = pol.select(st, 0, None, k, kv, out=row)
    assert got.indices is row and torch.equal(row, want.indices)
    assert (buf[0] == 5).all() and (buf[2] == 5).all()
    assert (got.n_sink, got.n_recent) == (want.n_sink, want.n_recent)
    wrong = torch.zeros(2, 2, 8, dtype=torch.int32)
    other = pol.select(st, 0, None, k, kv, out=wrong)
    assert other.indices is not wrong and torch.equal(other.indices, want.indices) and (wrong == 0).all()


@pytest.mark.parametrize("reduce", ["sum_logits", "sum_softmax"])
def test_shared_derived_computes_a_packs_bounds_once(reduce, monkeypatch):
    """Inside ``shared_derived`` (the cache rank's pack) the selects of several layers
    with the same ``kv_lens`` compute the middle bounds (and sum_softmax's
    ``kv_lens - 1``) once, and select exactly what they select without it; another
    ``kv_lens`` object recomputes, and a new block starts afresh."""
    from spade.policies import common

    sim = DecodeSim(B=2, Hq=4, Hkv=2, prompt_len=30, steps=1, seed=23, n_layers=3)
    pol = make_policy("asyncspade", sim, budget=12, sink_tokens=1, recent_tokens=2, window=3,
                      group_reduce=reduce, rope_aware=False)
    st = pol.new_state(2, "cpu")
    ks, vs, kv = sim.fresh_cache()
    st.seq_len = 30
    for layer in range(3):
        pol.prefill(st, layer, sim.q_all[layer, :, :, :30], ks[layer], vs[layer], kv)
    st.seq_len, kv = 31, kv + 1
    want = [pol.select(st, layer, None, ks[layer], kv).indices for layer in range(3)]
    calls = []
    bounds = common.middle_bounds
    monkeypatch.setattr(common, "middle_bounds", lambda *a: calls.append(1) or bounds(*a))
    for _ in range(2):
        with common.shared_derived(st):
            got = [pol.select(st, layer, None, ks[layer], kv).indices for layer in range(3)]
            assert (("kv_lens - 1",) in st.memo) == (reduce == "sum_softmax")
            pol.select(st, 0, None, ks[0], kv.clone())  # another kv_lens object
        assert st.memo is None
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(calls) == 4  # twice per block
    calls.clear()
    for layer in range(3):  # no block: every call
        pol.select(st, layer, None, ks[layer], kv)
    assert len(calls) == 3
    assert common.derived(None, ("k",), (kv,), lambda: 5) == 5


def test_int8_budget_covering_the_context_is_full_attention():
    """Rows whose context fits the budget attend to all of it (bit-for-bit the dense
    output), also when another row of the batch is sparse."""
    sim = DecodeSim(B=3, Hq=4, Hkv=2, kv_start=[0, 14, 20], prompt_len=30, steps=4, seed=11)
    pol = make_policy("asyncspade", sim, budget=20, sink_tokens=1, recent_tokens=2, predictor="last", window=2,
                      score_keys="int8")
    recs = sim.run(pol)
    for rec in recs:
        assert rec.sel is not None  # seq_len > budget: the sparse path
        for b in (1, 2):
            ctx = int(rec.kv_lens[b]) - sim.kv_start[b]
            assert ctx <= 20
            assert all(len(s) == ctx for s in attended_sets(rec.sel, rec.kv_lens)[b])
            torch.testing.assert_close(rec.out[b], rec.full[b], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("score_keys,reduce", [("int8", "sum_softmax"), ("int8", "sum_logits"),
                                               ("int4", "sum_logits"), ("int4", "sum_softmax")])
def test_compressed_keys_observe_and_select_replay_in_a_cuda_graph(score_keys, reduce, monkeypatch):
    """observe + select with int8 / int4 keys (append, folded query for int4, compressed
    score_topk) captured once and replayed at later steps give the eager selections (no
    host sync, no host-side data-dependent shapes)."""
    monkeypatch.setenv("SPADE_KERNELS", "triton")  # the policies' conftest pins the torch refs
    from spade.policies.base import AttentionSpec
    from spade.policies.asyncspade import AsyncSpadePolicyConfig
    from spade.policies import build_policy

    dev = torch.device("cuda")
    B, Hq, Hkv, D, L, T = 2, 8, 2, 64, 512, 300
    spec = AttentionSpec(n_layers=1, n_q_heads=Hq, n_kv_heads=Hkv, head_dim=D)
    cfg = AsyncSpadePolicyConfig(budget=64, sink_tokens=4, recent_tokens=8, predictor="last", window=2,
                                 score_keys=score_keys, group_reduce=reduce, rope_aware=False)
    pols = [build_policy(cfg, spec) for _ in range(2)]
    k_all = torch.randn(B, Hkv, L, D, device=dev, dtype=torch.bfloat16)
    q_all = torch.randn(B, Hq, L, D, device=dev, dtype=torch.bfloat16)
    states, caches = [], []
    for pol in pols:
        st = pol.new_state(B, dev)
        st.seq_len = T
        k = k_all.clone()
        pol.prefill(st, 0, q_all[:, :, :T], k, k, torch.full((B,), T, device=dev))
        states.append(st)
        caches.append(k)
    kv = torch.full((B,), T, device=dev)  # the graph's input buffer
    q_in = torch.zeros(B, Hq, D, device=dev, dtype=torch.bfloat16)

    def step(pol, st, k):
        pol.observe(st, 0, q_in, k, kv)
        return pol.select(st, 0, None, k, kv).indices

    pg, sg, kg = pols[1], states[1], caches[1]
    # warm up (compiles) on a side stream, then capture at step T+3 (window saturated)
    for t in range(T, T + 3):
        kv.fill_(t + 1); q_in.copy_(q_all[:, :, t]); sg.seq_len = t + 1
        step(pg, sg, kg)
        states[0].seq_len = t + 1
        pols[0].observe(states[0], 0, q_all[:, :, t], caches[0], torch.full((B,), t + 1, device=dev))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    t = T + 3
    kv.fill_(t + 1); q_in.copy_(q_all[:, :, t]); sg.seq_len = t + 1
    with torch.cuda.graph(graph):
        out = step(pg, sg, kg)
    for t in range(T + 3, T + 8):
        kv.fill_(t + 1); q_in.copy_(q_all[:, :, t]); sg.seq_len = t + 1
        graph.replay()
        st0 = states[0]
        st0.seq_len = t + 1
        kv0 = torch.full((B,), t + 1, device=dev)
        pols[0].observe(st0, 0, q_all[:, :, t], caches[0], kv0)
        want = pols[0].select(st0, 0, None, caches[0], kv0).indices
        assert torch.equal(out.sort(-1).values, want.sort(-1).values)


@pytest.mark.parametrize("backend,keys", [("fast", "int8"), ("hf", "int8"), ("fast", "int4")])
def test_int8_through_the_async_runtime_matches_inline(backend, keys, monkeypatch):
    """score_keys=int8 / int4 on the cache rank (its own prefill/observe/select flow:
    static cache view, copied store, transformers' growing cache) gives the inline
    tokens. With a static view and a copied store the cache rank hands the step's keys
    to observe and appends nothing to its store (no index_copy_); with the growing
    cache it keeps appending (the copy is rebuilt from the store as the view grows)."""
    import sys

    from transformers import AutoModelForCausalLM

    from spade.models.hf import HFBackend
    from spade.models.fast import FastModel
    from spade.models.presets import preset_config
    from spade.policies import build_policy
    from spade.runtime.asyncrt import AsyncRuntime
    from spade.runtime.inline import InlineRuntime
    from tests.runtime.conftest import B, NEW, T, config, greedy

    monkeypatch.setenv("SPADE_KERNELS", "torch")
    torch.manual_seed(1234)
    if backend == "fast":
        be = FastModel.from_config(preset_config("tiny"), device="cpu", dtype=torch.float32, max_batch=B,
                                   max_seq_len=48)
    else:
        be = HFBackend(AutoModelForCausalLM.from_config(preset_config("tiny"), dtype=torch.float32), None, "cpu")
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 500, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :6] = 0
    ids[mask == 0] = 0
    base = config(f"policy.score_keys={keys}")
    want = InlineRuntime(base, be, build_policy(base.policy, be.spec)).generate(
        ids, mask, max_new_tokens=NEW, sample_fn=greedy).tokens
    appends = []
    index_copy = torch.Tensor.index_copy_

    def spy(self, *a, **k):
        if sys._getframe(1).f_code.co_name == "_store":  # the cache rank's store appends, not the model's cache
            appends.append(tuple(self.shape))
        return index_copy(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "index_copy_", spy)
    for topo, mode in (("colocated", "indices"), ("local", "delta"), ("local", "indices")):
        appends.clear()
        cfg = config(f"policy.score_keys={keys}", f"runtime.topology={topo}", "runtime.pack_layers=2",
                     f"runtime.return_mode={mode}")
        rt = AsyncRuntime(cfg, be, build_policy(cfg.policy, be.spec))
        try:
            tr = rt.generate(ids, mask, max_new_tokens=NEW, sample_fn=greedy)
        finally:
            rt.close()
        assert tr.tokens == want and tr.stats["sparse_steps"] > 0
        # a growing cache (hf) is copied and appended in both topologies; a static one is
        # shared (colocated) or copied without appends (local)
        assert bool(appends) == (backend == "hf"), (topo, mode, len(appends))


# ------------------------------------------------------------------ rope_aware resolution
@pytest.mark.parametrize("rope", [None, RopeSpec(theta=10000.0)])
def test_rope_aware_auto_follows_the_model_and_never_raises(rope, caplog):
    """The default ``auto`` is on exactly when the spec has (unscaled) RoPE, logs the
    choice at INFO, and selects as the explicit setting it resolved to."""
    import logging

    from spade.policies import asyncspade as mod

    mod._AUTO_LOGGED.clear()
    sim = DecodeSim(B=2, Hq=4, Hkv=2, kv_start=[0, 3], prompt_len=30, steps=3, rope=rope, seed=13)
    common = dict(budget=12, sink_tokens=1, recent_tokens=2, predictor="assembled", window=3)
    with caplog.at_level(logging.INFO, logger=mod.__name__):
        auto = make_policy("asyncspade", sim, **common)
        make_policy("asyncspade", sim, **common)  # a second policy logs nothing more
    assert auto.cfg.rope_aware == "auto" and auto.rope_aware is (rope is not None)
    msgs = [r.getMessage() for r in caplog.records if "rope_aware=auto" in r.getMessage()]
    assert len(msgs) == 1 and f"-> {rope is not None} " in msgs[0]
    explicit = make_policy("asyncspade", sim, **common, rope_aware=rope is not None)
    a = [middle_sets(r.sel) for r in sim.run(auto)]
    assert a == [middle_sets(r.sel) for r in sim.run(explicit)]
    if rope is not None:  # and the setting matters on this sim, so the equality above means something
        off = make_policy("asyncspade", sim, **common, rope_aware=False)
        assert a != [middle_sets(r.sel) for r in sim.run(off)]


def test_rope_aware_true_refuses_a_model_without_rope():
    from spade.errors import ConfigError

    sim = DecodeSim(B=1, Hq=4, Hkv=2, prompt_len=20, steps=1, seed=14)  # spec.rope is None
    with pytest.raises(ConfigError, match="rope_aware=true"):
        make_policy("asyncspade", sim, budget=12, sink_tokens=1, recent_tokens=2, rope_aware=True)


@pytest.mark.skipif(not INTERPRET, reason="SPADE_KERNELS=triton on CPU tensors needs the Triton interpreter")
@pytest.mark.parametrize("predictor,score_keys,dtype,rope,chans", [
    ("assembled", "exact", torch.float32, False, None),  # not folded
    ("assembled", "int4", torch.bfloat16, False, None),
    ("assembled", "int8", torch.bfloat16, False, None),
    ("ridge", "int4", torch.float32, False, None),  # ridge's mode
    ("assembled", "int4", torch.bfloat16, True, None),
    ("assembled", "exact", torch.float32, True, None),
    ("assembled", "int4", torch.bfloat16, False, 8),  # score_channels: gathered for the run too
    ("assembled", "int8", torch.float32, True, 8),
    ("assembled", "exact", torch.bfloat16, False, 4)])
def test_predict_layers_gives_the_per_layer_predictions(predictor, score_keys, dtype, rope, chans, monkeypatch):
    """``predict_layers`` (one predictor launch for a run of layers, what the cache rank
    does per pack) leaves every layer's selection exactly as predicting per layer does;
    each prediction made ahead serves one select only. Compressed keys: the run's
    queries are also folded with the int4 smoothing and rounded to the cache dtype in
    one launch (``q_scored``), and select uses them instead of its own fold; with
    ``score_channels`` restricted to each layer's channels in one gather too, so select
    gathers nothing. rope_aware (rows at different positions: left padding): given the
    step's ``kv_lens``, the run's predictions are rotated there in one launch, and folded too."""
    from spade import kernels
    from spade.policies import asyncspade as mod
    from spade.policies.base import RopeSpec

    monkeypatch.setenv("SPADE_KERNELS", "triton")  # the batched path is the kernel's (interpreter here)
    sim = DecodeSim(B=2, Hq=4, Hkv=2, prompt_len=20, steps=1, seed=11, n_layers=3, dtype=dtype,
                    kv_start=[0, 5] if rope else None, rope=RopeSpec(theta=1e4, dim=16) if rope else None)
    pol = make_policy("asyncspade", sim, budget=10, sink_tokens=1, recent_tokens=2, window=4,
                      predictor=predictor, group_reduce="sum_logits", rope_aware=rope, score_keys=score_keys,
                      score_channels=chans)
    rotations = []
    rot = kernels.rope_rotate
    monkeypatch.setattr(kernels, "rope_rotate", lambda x, *a: rotations.append(x.shape[0]) or rot(x, *a))
    gathers = []
    gather = mod.gather_channels
    monkeypatch.setattr(mod, "gather_channels", lambda x, c: gathers.append(x.dim()) or gather(x, c))
    ks, vs, kv = sim.fresh_cache()
    states = []
    for _ in range(2):
        st = pol.new_state(2, "cpu")
        st.seq_len, st.kv_start = 20, sim.starts
        for layer in range(3):
            pol.prefill(st, layer, sim.q_all[layer, :, :, :20], ks[layer], vs[layer], kv)
        st.seq_len = 21
        states.append(st)
    kv1 = kv + 1
    rotations.clear()
    pol.predict_layers(states[0], range(0, 3), kv1)
    assert all(s.q_pred is not None for s in states[0].layers)
    assert rotations == ([3 * 2] if rope else [])  # the run's 3 layers x 2 rows in one launch
    folded = score_keys == "int4" or (score_keys == "int8" and dtype != torch.float32) or chans is not None
    assert all((s.q_scored is not None) == folded for s in states[0].layers)
    folds = []
    fold = kernels.fold_smoothing
    monkeypatch.setattr(kernels, "fold_smoothing", lambda q, sm: folds.append(1) or fold(q, sm))
    for layer in range(3):
        n = len(folds)
        gathers.clear()
        a = pol.select(states[0], layer, None, ks[layer], kv1)  # uses the batched prediction
        assert len(folds) == n + (score_keys != "exact" and not folded)
        assert gathers == []
        b = pol.select(states[1], layer, None, ks[layer], kv1)  # predicts on its own
        assert gathers == ([3] if chans else [])  # (the per-layer path gathers the query's channels)
        assert torch.equal(a.indices, b.indices)
        assert rotations[1:] == [2] * (layer + 1) * rope  # (the per-layer path rotates per layer)
        assert states[0].layers[layer].q_pred is None and states[0].layers[layer].q_scored is None  # consumed
    if score_keys == "int4":
        assert states[0].layers[1].k_smooth.data_ptr() == states[0].layers[1].all_smooth[1].data_ptr()
    if chans:
        assert states[0].layers[1].chans.data_ptr() == states[0].layers[1].all_chans[1].data_ptr()


@pytest.mark.skipif(not INTERPRET, reason="SPADE_KERNELS=triton on CPU tensors needs the Triton interpreter")
@pytest.mark.parametrize("score_keys,dtype", [("exact", torch.float32), ("int4", torch.bfloat16)])
def test_predict_layers_with_the_layers_taking_turns(score_keys, dtype, monkeypatch):
    """``refresh_every=2`` over a run of 5 layers: at a step where only some layers refresh
    (their turn, 2 apart), ``predict_layers`` predicts those layers only, in one launch (a
    step with one such layer leaves it to its select); the refreshing layers select what
    per-layer prediction selects (int4: the run's queries folded with the strided layers'
    smoothing), the others return their last selection, and no prediction made ahead is
    left over for a later step."""
    from spade import kernels

    monkeypatch.setenv("SPADE_KERNELS", "triton")
    sim = DecodeSim(B=2, Hq=4, Hkv=2, prompt_len=20, steps=1, seed=12, n_layers=5, dtype=dtype)
    pol = make_policy("asyncspade", sim, budget=10, sink_tokens=1, recent_tokens=2, window=4, predictor="assembled",
                      group_reduce="sum_logits", rope_aware=False, refresh_every=2, score_keys=score_keys)
    solves = []
    ridge = kernels.ridge_predict
    monkeypatch.setattr(kernels, "ridge_predict", lambda w, *a, **k: solves.append(w.shape[0]) or ridge(w, *a, **k))
    ks, vs, kv = sim.fresh_cache()
    states = []
    for _ in range(2):
        st = pol.new_state(2, "cpu")
        st.seq_len = 20
        for layer in range(5):
            pol.prefill(st, layer, sim.q_all[layer, :, :, :20], ks[layer], vs[layer], kv)
        states.append(st)
    held = {}
    turns = {21: [0, 1, 2, 3, 4], 22: [1, 3], 23: [0, 2, 4]}
    for seq in (21, 22, 23):
        kvs = kv + (seq - 20)
        for st in states:
            st.seq_len = seq
        solves.clear()
        for run in (range(0, 3), range(3, 5)):  # two packs, as a cache rank runs them
            pol.predict_layers(states[0], run, kvs)
        fresh = [i for i in range(5) if pol.refreshes(states[0], i)]
        assert fresh == turns[seq]
        ahead = [i for i in range(5) if states[0].layers[i].q_pred is not None]
        # a run's refreshing layers in one launch when there are two or more of them
        want = [i for run in (range(0, 3), range(3, 5)) if len(f := [j for j in run if j in fresh]) >= 2 for i in f]
        assert ahead == want
        assert all((states[0].layers[i].q_scored is not None) == (score_keys == "int4") for i in ahead)
        assert solves == [len([j for j in run if j in fresh]) * 2 * 4
                          for run in (range(0, 3), range(3, 5)) if len([j for j in run if j in fresh]) >= 2]
        for layer in range(5):
            a = pol.select(states[0], layer, None, ks[layer], kvs)
            b = pol.select(states[1], layer, None, ks[layer], kvs)
            assert torch.equal(a.indices, b.indices)
            if layer not in fresh:
                assert a is held[layer]
            held[layer] = a
            assert states[0].layers[layer].q_pred is None
        for st in states:
            for layer in range(5):
                pol.observe(st, layer, sim.q_all[layer, :, :, seq - 1], ks[layer], kvs)


@pytest.mark.skipif(not INTERPRET, reason="SPADE_KERNELS=triton on CPU tensors needs the Triton interpreter")
@pytest.mark.parametrize("name,score_keys", [("asyncspade", "exact"), ("asyncspade", "int4"), ("oracle", "exact")])
def test_topk_carry_selects_what_radix_selects(name, score_keys, monkeypatch):
    """``topk: carry`` (each layer carries its threshold across steps) and ``topk: radix``
    give the same selections step after step; after the first step the carry mostly takes
    its candidate path; a new prompt (prefill) resets the layer's carried threshold in place.
    The ``last`` predictor: q̂ is the newest query, so the steps exercise the carry with
    queries that move (the ridge kernel, tested in tests/kernels/test_ridge.py, took
    over half of this test's interpreter time)."""
    monkeypatch.setenv("SPADE_KERNELS", "triton")
    from spade.kernels.carry import carry_stats

    sim = DecodeSim(B=2, Hq=4, Hkv=2, kv_start=[0, 5], prompt_len=60, steps=5, seed=17, n_layers=2)
    kw = dict(budget=20, sink_tokens=2, recent_tokens=3, group_reduce="sum_logits")
    if name == "asyncspade":
        kw.update(predictor="last", window=4, rope_aware=False, score_keys=score_keys)
    pols = {t: make_policy(name, sim, topk=t, **kw) for t in ("carry", "radix")}
    T = sim.prompt_len
    caches, states = {}, {}
    for t, pol in pols.items():
        ks, vs, kv = sim.fresh_cache()
        st = pol.new_state(2, "cpu")
        st.kv_start, st.seq_len = sim.starts, T
        for layer in range(2):
            pol.prefill(st, layer, sim.q_all[layer, :, :, :T], ks[layer], vs[layer], kv)
        caches[t], states[t] = (ks, vs, kv), st
    for step in range(sim.steps):
        pos = T + step
        sels = {}
        for t, pol in pols.items():
            ks, vs, kv = caches[t]
            st = states[t]
            kv1 = kv + step + 1
            for layer in range(2):
                ks[layer][:, :, pos] = sim.k_all[layer, :, :, pos]
                q = sim.q_all[layer, :, :, pos]
                st.seq_len = pos + 1
                if name == "asyncspade":
                    pol.observe(st, layer, q, ks[layer], kv1)
                    st.seq_len = pos + 2
                    sel = pol.select(st, layer, None, ks[layer], kv1 + 1)
                else:
                    sel = pol.select(st, layer, q, ks[layer], kv1)
                sels[t, layer] = sel.indices.sort(-1).values
        for layer in range(2):
            assert torch.equal(sels["carry", layer], sels["radix", layer]), (step, layer)
    carry, radix = states["carry"], states["radix"]
    assert not radix.carry and sorted(carry.carry) == [0, 1]
    for layer in range(2):
        st = carry_stats(carry.carry[layer])
        # 2 rows x 2 KV heads fall back at the first step; random queries over a short middle
        # move the K-th score a lot, so some later steps fall back too (still exact, above)
        assert st["calls"] == 4 * sim.steps and 4 <= st["fallbacks"] < st["calls"] - 4, st
    c0 = carry.carry[0]
    ks, vs, kv = caches["carry"]
    pols["carry"].prefill(carry, 0, sim.q_all[0, :, :, :T], ks[0], vs[0], kv)
    assert carry.carry[0] is c0 and carry_stats(c0)["calls"] == 0


def test_a_join_restarts_the_refresh_schedule():
    """Serving: rows joining a running batch (``prefill_rows``) have no selection to reuse,
    so the next step refreshes every row whatever the schedule said, and the schedule
    counts from there; the joining row's selection is then its fresh top-K."""
    from spade.policies.asyncspade import AsyncSpadePolicy, AsyncSpadePolicyConfig
    from spade.policies.base import AttentionSpec

    common = dict(budget=12, sink_tokens=1, recent_tokens=2, predictor="last", window=2, group_reduce="sum_logits")
    spec = AttentionSpec(n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=8)
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 2, 64, 8, generator=g)
    q = torch.randn(2, 4, 64, 8, generator=g)
    pols = [AsyncSpadePolicy(AsyncSpadePolicyConfig(**common, refresh_every=n), spec) for n in (4, 1)]
    sts = [p.new_state(2, "cpu") for p in pols]
    kv = torch.tensor([30, 30])
    for p, st in zip(pols, sts):
        st.seq_len = 30
        p.prefill(st, 0, q[:, :, :30], k, k, kv)
    for seq in (31, 32):  # a refresh at 31, a reuse step at 32
        for p, st in zip(pols, sts):
            st.seq_len = seq
            p.select(st, 0, None, k, torch.tensor([seq, seq]))
            p.observe(st, 0, q[:, :, seq - 1], k, torch.tensor([seq, seq]))
    assert not pols[0].refreshes(_at(sts[0], 33), 0)
    for p, st in zip(pols, sts):  # row 1 takes a new request: its prompt's queries at [9, 32)
        st.seq_len = 32
        p.prefill_rows(st, 0, [1], q[1:, :, 9:32], k[1:], k[1:], torch.tensor([32]))
    assert pols[0].refreshes(_at(sts[0], 33), 0)  # (33 - 31) % 4 != 0, but the join restarts the schedule
    a, b = (p.select(_at(st, 33), 0, None, k, torch.tensor([33, 33])) for p, st in zip(pols, sts))
    assert middle_sets(a)[1] <= middle_sets(b)[1] and len(middle_sets(a)[1][0]) == 12 - 3 - 3
    assert not pols[0].refreshes(_at(sts[0], 34), 0)


def _at(state, seq):
    state.seq_len = seq
    return state

"""asyncspade's cheaper candidate scan: ``score_channels`` (r of d channels per KV head in
the scoring copy)."""

from __future__ import annotations

import pytest
import torch

from spade import kernels
from spade.errors import ConfigError
from spade.policies.asyncspade import (AsyncSpadePolicyConfig, gather_channels, key_pair_mass, pick_channels,
                                       query_pair_mass)
from spade.policies.base import RopeSpec
from spade.policies.predictors import rotate
from tests.policies.sim import DecodeSim, make_policy, middle_sets


def _pairs_closed(chans: torch.Tensor, D: int) -> bool:
    """Every (row, head)'s channel set holds c + D/2 with each c < D/2 and vice versa."""
    h = D // 2
    for row in chans.reshape(-1, chans.shape[-1]).tolist():
        s = set(row)
        if len(s) != len(row) or any(((c + h) % D) not in s for c in s):
            return False
    return True


@pytest.mark.parametrize("score_keys", ["exact", "int8", "int4"])
@pytest.mark.parametrize("r", [0, 16])
def test_all_channels_is_todays_selection_bit_for_bit(score_keys, r):
    """r = 0 or r = d (16 here) is exactly the policy without channels: the same indices
    and attention outputs at every step and layer (MHA rows, GQA, left padding)."""
    sim = DecodeSim(B=2, Hq=4, Hkv=2, D=16, prompt_len=29, steps=6, n_layers=2, kv_start=[0, 3], seed=5)
    common = dict(budget=13, sink_tokens=2, recent_tokens=3, window=4, score_keys=score_keys)
    base = sim.run(make_policy("asyncspade", sim, **common))
    pol = make_policy("asyncspade", sim, **common, score_channels=r)
    assert pol.channels is None
    got = sim.run(pol)
    for a, b in zip(base, got):
        assert torch.equal(a.sel.indices, b.sel.indices) and torch.equal(a.out, b.out)


def test_channel_choice_keeps_rope_pairs_and_ignores_rotation():
    """``pick_channels`` returns whole rotate_half pairs (c, c + d/2); a pair's norm is
    RoPE-invariant, so pre- and post-RoPE windows choose the same channels."""
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, n, L, D = 3, 6, 2, 7, 41, 32
    q = torch.randn(B, Hq, n, D, generator=g) * torch.rand(D, generator=g) * 3
    k = torch.randn(B, Hkv, L, D, generator=g) * torch.rand(D, generator=g) * 3
    lo, hi = torch.tensor([0, 5, 2]), torch.tensor([41, 30, 17])
    spec = RopeSpec(theta=10000.0, dim=D)
    pos = torch.arange(n)[None, :].expand(B, n) + 100
    q_rot = rotate(q, pos, spec)
    for r in (2, 8, 16, 30):
        ch = pick_channels(query_pair_mass(q, Hkv), key_pair_mass(k, lo, hi), r)
        assert ch.shape == (B, Hkv, r) and _pairs_closed(ch, D)
        ch_rot = pick_channels(query_pair_mass(q_rot, Hkv), key_pair_mass(k, lo, hi), r)
        assert torch.equal(ch, ch_rot)
    # key positions outside [lo, hi) never count
    k2 = k.clone()
    k2[1, :, 30:] = 1e6
    k2[2, :, :2] = 1e6
    assert torch.allclose(key_pair_mass(k2, lo, hi), key_pair_mass(k, lo, hi))


@pytest.mark.parametrize("score_keys", ["exact", "int8", "int4"])
@pytest.mark.parametrize("B,Hq,Hkv,starts", [(1, 4, 1, None), (2, 4, 2, [0, 4]), (2, 2, 2, None)])
def test_channel_copy_tracks_the_cache(score_keys, B, Hq, Hkv, starts):
    """With r < d the copy holds only r channels (int4: r/2 bytes) and equals the gathered
    exact keys, quantised as a whole (appends bit for bit with a rebuild); the selection is
    the top-K of the query restricted to those channels, checked against ``score_topk`` on
    the gathered keys."""
    D, r = 16, 8
    sim = DecodeSim(B=B, Hq=Hq, Hkv=Hkv, D=D, prompt_len=27, steps=5, kv_start=starts, seed=11, extra=0)
    pol = make_policy("asyncspade", sim, budget=12, sink_tokens=1, recent_tokens=2, window=3,
                      score_keys=score_keys, score_channels=r, channel_refresh=None)

    def check(rec, st):
        lay = st.layers[rec.layer]
        ch = lay.chans
        assert ch.shape == (B, Hkv, r) and _pairs_closed(ch, D)
        kv = int(rec.kv_lens.max())
        k_sub = gather_channels(sim.k_all[rec.layer][:, :, :kv], ch)  # [B, Hkv, kv, r]
        kq, ks = lay.kq, lay.ks
        for b in range(B):
            s = 0 if starts is None else starts[b]
            n = int(rec.kv_lens[b])
            if score_keys == "exact":
                assert kq.shape[-1] == r and torch.equal(kq[b, :, s:n], k_sub[b, :, s:n])
            elif score_keys == "int8":
                q8, s8 = kernels.quantize_keys(k_sub[b:b + 1, :, s:n])
                assert kq.shape[-1] == r and torch.equal(kq[b:b + 1, :, s:n], q8)
                assert torch.equal(ks[b:b + 1, :, s:n], s8)
            else:
                q4, s4 = kernels.quantize_keys_int4(k_sub[b:b + 1, :, s:n], lay.k_smooth[b:b + 1])
                assert kq.shape[-1] == r // 2 and torch.equal(kq[b:b + 1, :, s:n], q4)
                assert torch.equal(ks[b:b + 1, :, s:n], s4)
        # the selection of this step: the predicted query on those channels
        if rec.sel is not None:
            assert rec.sel.indices.shape == (B, Hkv, 12 - 3)

    sim.run(pol, on_step=check)


def test_channel_selection_is_the_top_k_on_the_channels():
    """Exact keys, r < d: the policy's selection equals ``topk_selection`` of the predicted
    query gathered to the chosen channels against the gathered keys (``last`` predictor:
    the previous query), at every step."""
    from spade.policies.common import topk_selection

    D, r = 16, 6
    sim = DecodeSim(B=2, Hq=4, Hkv=2, D=D, prompt_len=33, steps=5, kv_start=[0, 2], seed=17)
    pol = make_policy("asyncspade", sim, budget=14, sink_tokens=2, recent_tokens=3, predictor="last",
                      window=2, rope_aware=False, score_channels=r)
    n = 0

    def check(rec, st):
        nonlocal n
        ch = st.layers[0].chans
        kv = rec.kv_lens
        q_prev = sim.q_all[0, :, :, rec.seq_len - 2]  # the last observed query before this step
        k_sub = gather_channels(sim.k_all[0], ch)
        want = topk_selection(gather_channels(q_prev, ch), k_sub, kv, sim.starts, budget=14, n_sink=2,
                              n_recent=3, scale=sim.spec.softmax_scale, reduce="sum_softmax", norm_lens=kv - 1)
        assert middle_sets(rec.sel) == middle_sets(want)
        n += 1

    sim.run(pol, on_step=check)
    assert n == 5


def test_channels_are_rechosen_as_the_cache_doubles():
    """``channel_refresh=2``: the channels are re-chosen (in place) at the first step whose
    cache length reaches twice that of the last choice, and the copy is rebuilt from the
    exact keys on the new channels; the graph key marks that step."""
    D, r = 16, 2
    g = torch.Generator().manual_seed(2)
    T, steps = 12, 16
    L = T + steps + 1
    # the prompt's energy on pair 1, the continuation's on pair 5: the choice must move
    k_all = torch.randn(1, 1, 1, L, D, generator=g) * 0.1
    k_all[..., :T, [1, 9]] += 3.0
    k_all[..., T:, [5, 13]] += 30.0
    q_all = torch.randn(1, 1, 2, L, D, generator=g) * 0.1
    q_all[..., [1, 9, 5, 13]] += 1.0
    sim = DecodeSim(B=1, Hq=2, Hkv=1, D=D, prompt_len=T, steps=steps, q_all=q_all, k_all=k_all, seed=2, extra=1)
    pol = make_policy("asyncspade", sim, budget=8, sink_tokens=1, recent_tokens=2, window=3,
                      score_keys="int8", score_channels=r)
    assert not pol.takes_new_keys(pol.new_state(1, "cpu"))  # re-choosing needs the exact keys
    seen = []

    def rec_(rec, st):
        lay = st.layers[0]
        seen.append((rec.seq_len, sorted(lay.chans.flatten().tolist()), lay.chans.data_ptr(), lay.chan_seq))
        kv = rec.seq_len
        q8, s8 = kernels.quantize_keys(gather_channels(sim.k_all[0][:, :, :kv], lay.chans))
        assert torch.equal(lay.kq[:, :, :kv], q8) and torch.equal(lay.ks[:, :, :kv], s8)

    sim.run(pol, on_step=rec_)
    first = [s for s in seen if s[0] < 2 * T]
    later = [s for s in seen if s[0] >= 2 * T]
    assert first and later
    assert [s[1] for s in first] == [[1, 9]] * len(first), seen
    assert [s[1] for s in later] == [[5, 13]] * len(later), seen
    assert len({s[2] for s in seen}) == 1  # one tensor, rewritten in place
    assert later[0][3] == 2 * T
    # the graph key read before the step (chan_seq still T) marks the re-choosing step
    st = pol.new_state(1, "cpu")
    st.layers[0].chans, st.layers[0].chan_seq = torch.zeros(1, 1, r, dtype=torch.long), T
    st.seq_len = 2 * T
    assert pol.graph_key(st)[-1] is True
    st.seq_len = 2 * T - 1
    assert pol.graph_key(st)[-1] is False


def test_channel_choice_finds_the_few_channels_that_carry_the_score(monkeypatch):
    """A head whose attention is decided by one rotary pair (keys and queries large there,
    small noise elsewhere): at r = d/4 the chosen channels hold that pair in every row and
    head, and keep the recall of the full-channel selection; a choice without it (the
    complement pairs) loses most of it: random channels would fail this test."""
    D, r, L, T = 16, 4, 87, 80  # L: the sim's capacity (T + 4 steps + 3 spare)
    g = torch.Generator().manual_seed(23)
    B, Hq, Hkv = 2, 4, 2
    k_all = torch.randn(1, B, Hkv, L, D, generator=g) * 0.3
    q_all = torch.randn(1, B, Hq, L, D, generator=g) * 0.3
    sig = torch.randn(1, B, Hkv, L, 2, generator=g) * 4.0  # the informative pair (3, 11)
    k_all[..., 3], k_all[..., 11] = sig[..., 0], sig[..., 1]
    qd = torch.randn(1, B, Hq, 1, 2, generator=g).expand(1, B, Hq, L, 2) * 4.0  # a steady direction
    q_all[..., 3], q_all[..., 11] = qd[..., 0], qd[..., 1]
    sim = DecodeSim(B=B, Hq=Hq, Hkv=Hkv, D=D, prompt_len=T, steps=4, q_all=q_all, k_all=k_all, seed=1)
    common = dict(budget=16, sink_tokens=1, recent_tokens=2, window=4, predictor="last", rope_aware=False)

    def recall(pol, chans_override=None):
        total = []

        def on(rec, st):
            if chans_override is None and pol.channels is not None:
                assert all(3 in row and 11 in row for row in st.layers[0].chans.reshape(-1, r).tolist())
            p = sim.probs(0, rec.q, rec.kv_lens).view(B, Hkv, Hq // Hkv, -1)
            m = rec.sel.to_mask(rec.kv_lens, sim.capacity)  # [B, Hkv, L]
            total.append(float((p * m[:, :, None]).sum(-1).mean()))

        if chans_override is not None:
            import spade.policies.asyncspade as A

            monkeypatch.setattr(A, "pick_channels", lambda qm, km, rr: chans_override.expand(*qm.shape[:2], rr))
        sim.run(pol, on_step=on)
        monkeypatch.undo()
        return sum(total) / len(total)

    full = recall(make_policy("asyncspade", sim, **common))
    sub = recall(make_policy("asyncspade", sim, **common, score_channels=r))
    other = recall(make_policy("asyncspade", sim, **common, score_channels=r),
                   torch.tensor([0, 1, 8, 9]))
    assert sub >= full - 0.02, (sub, full)
    assert other < full - 0.2, (other, full)


def test_score_channels_validation():
    with pytest.raises(ValueError, match="score_channels .* must be even"):
        AsyncSpadePolicyConfig(score_channels=7)
    sim = DecodeSim(D=16)
    with pytest.raises(ConfigError, match="exceeds the model's head_dim"):
        make_policy("asyncspade", sim, score_channels=32)
    part = DecodeSim(D=16, rope=RopeSpec(theta=1e4, dim=8))
    with pytest.raises(ConfigError, match="partial rotary"):
        make_policy("asyncspade", part, score_channels=8, rope_aware=False)


@pytest.mark.parametrize("extra", [("policy.score_keys=int4", "policy.score_channels=16"),
                                   ("policy.score_channels=8",)])
def test_channels_through_the_async_runtime_match_inline(extra, monkeypatch):
    """The cache rank (its prompt tail of W+1 queries, its own store or the shared cache,
    channels re-chosen when the cache doubles at step 12 -> 24) selects what the inline run
    selects: the same greedy tokens in every topology and return mode (tiny preset, d = 32)."""
    from spade.models.fast import FastModel
    from spade.models.presets import preset_config
    from spade.policies import build_policy
    from spade.runtime.asyncrt import AsyncRuntime
    from spade.runtime.inline import InlineRuntime
    from tests.runtime.conftest import B, NEW, T, config, greedy

    assert 2 * T < T + NEW  # the run crosses a channel re-choice
    monkeypatch.setenv("SPADE_KERNELS", "torch")
    torch.manual_seed(1234)
    be = FastModel.from_config(preset_config("tiny"), device="cpu", dtype=torch.float32, max_batch=B,
                               max_seq_len=48)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 500, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :3] = 0
    ids[mask == 0] = 0
    base = config(*extra)
    pol = build_policy(base.policy, be.spec)
    assert pol.channels in (None, 8, 16)
    want = InlineRuntime(base, be, pol).generate(ids, mask, max_new_tokens=NEW, sample_fn=greedy).tokens
    for topo, mode in (("colocated", "indices"), ("local", "delta")):
        cfg = config(*extra, f"runtime.topology={topo}", "runtime.pack_layers=2", f"runtime.return_mode={mode}")
        rt = AsyncRuntime(cfg, be, build_policy(cfg.policy, be.spec))
        try:
            tr = rt.generate(ids, mask, max_new_tokens=NEW, sample_fn=greedy)
        finally:
            rt.close()
        assert tr.tokens == want and tr.stats["sparse_steps"] > 0, (topo, mode)


@pytest.mark.parametrize("score_keys", ["exact", "int8", "int4"])
def test_channel_copy_on_the_triton_kernels(score_keys, monkeypatch):
    """The Triton kernels (interpreter on CPU) take an r-channel copy (r = 8 of d = 32: int4
    rows of 4 bytes, below the kernels' 16/32-wide blocks, masked) and give the torch
    path's copy and selections."""
    from tests.conftest import INTERPRET

    if not INTERPRET:
        pytest.skip("Triton on CPU tensors needs the interpreter")
    sim = DecodeSim(B=2, Hq=4, Hkv=2, D=32, kv_start=[0, 3], prompt_len=20, steps=2, seed=13)
    common = dict(budget=11, sink_tokens=1, recent_tokens=2, window=3, score_keys=score_keys, score_channels=8,
                  topk="radix")
    runs = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("SPADE_KERNELS", mode)
        copies = []
        recs = sim.run(make_policy("asyncspade", sim, **common),
                       on_step=lambda rec, st: copies.append(
                           [st.layers[0].kq[b, :, s:int(rec.kv_lens[b])].clone() for b, s in enumerate([0, 3])]))
        runs[mode] = ([middle_sets(r.sel) for r in recs], copies)  # (rows past kv_len hold the sim's garbage)
    assert runs["torch"][0] == runs["triton"][0]
    assert all(torch.equal(a, b) for x, y in zip(runs["torch"][1], runs["triton"][1]) for a, b in zip(x, y))

"""int4 scoring keys: smoothing, packing, quantize / append (Triton vs reference vs the
definition), int4 scores and the fused top-K against their torch references, and the
selection quality the smoothing buys on keys with an outlier channel."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import INTERPRET

from spade import kernels
from spade.kernels import quant, scoring

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 1, 37, 16), (3, 2, 5, 64), (3, 4, 3, 24)]  # (B, H, L, D); D/2 = 12 pads the tile


def _keys(shape, dtype, g, *, outlier: float = 0.0):
    """Random keys with per-token magnitudes over ~2 decades, optional per-channel
    magnitudes (``outlier``: log-scale spread), and one all-zero token."""
    B, H, L, D = shape
    k = torch.randn(*shape, generator=g) * torch.exp(torch.randn(B, H, L, 1, generator=g))
    if outlier:
        k = k * torch.exp(outlier * torch.randn(B, H, 1, D, generator=g))
    k[:, :, 0] = 0.0
    return k.to(dtype)


def test_pack_layout_and_round_trip():
    """Byte i = (v_i + 8) | (v_{i+D/2} & 15) << 4 (as int8: v_i + 8 + 16 v_{i+D/2});
    unpack inverts pack on [-8, 7]."""
    v = torch.tensor([[-7, 0, 7, -8, 3, -1]])  # D = 6
    p = quant.pack_int4(v)
    assert p.dtype == torch.uint8 and p.tolist() == [[1 | (8 << 4), 8 | (3 << 4), 15 | (15 << 4)]]
    assert p.view(torch.int8).tolist() == [[1 - 128, 8 + 48, 15 - 16]]
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-8, 8, (3, 2, 5, 10), generator=g)
    assert torch.equal(quant.unpack_int4(quant.pack_int4(w)), w.to(torch.int8))
    with pytest.raises(ValueError, match="even"):
        quant.pack_int4(torch.zeros(1, 3))


def test_fit_smoothing_masks_range_and_floors():
    k = torch.zeros(2, 1, 5, 4)
    k[:, 0, :, 0] = torch.tensor([1.0, 2.0, 3.0, 9.0, 4.0])  # channel 0
    k[:, 0, :, 1] = 0.5
    k[1, 0, 0, 1] = 100.0  # row 1: a large value in left padding
    s = quant.fit_smoothing(k, kv_lens=torch.tensor([3, 5]), kv_start=torch.tensor([0, 1]))
    assert s.shape == (2, 1, 4) and s.dtype == torch.float32
    assert quant.SMOOTH_FLOOR == 0.1
    assert s[0, 0].tolist() == pytest.approx([3.0, 0.5, 0.3, 0.3])  # channels 2-3 floored at 10 % of 3
    assert s[1, 0].tolist() == pytest.approx([9.0, 0.9, 0.9, 0.9])  # padding at 0 ignored; 0.5 < 10 % of 9
    assert quant.fit_smoothing(torch.zeros(1, 1, 3, 2)).min() > 0  # never zero


@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_int4_definition_and_triton(shape, dtype, smooth, device):
    g = torch.Generator().manual_seed(1)
    k = _keys(shape, dtype, g, outlier=1.0)
    sm = quant.fit_smoothing(k) if smooth else None
    kq, ks = quant.quantize_keys_int4_ref(k, sm)
    B, H, L, D = shape
    assert kq.dtype == torch.uint8 and kq.shape == (B, H, L, D // 2) and ks.shape == (B, H, L)
    v = quant.unpack_int4(kq).float()  # [B, H, L, D]
    x = k.float() / (sm[:, :, None] if smooth else 1.0)
    amax = x.abs().amax(-1)
    torch.testing.assert_close(ks, amax.clamp_min(quant.SCALE_FLOOR) / 7)
    assert v.abs().max() <= 7 and (kq & 15).min() >= 1 and ((kq >> 4) != 8).all()  # never the -8 code
    assert ((v * ks[..., None] - x).abs() <= 0.5 * ks[..., None] * (1 + 1e-5) + 1e-12).all()  # half a step
    assert (v.abs().amax(-1)[amax > 0] == 7).all() and (v[:, :, 0] == 0).all()
    kq_t, ks_t = quant.quantize_keys_int4_triton(k.to(device), None if sm is None else sm.to(device))
    assert torch.equal(ks_t.cpu(), ks) and torch.equal(kq_t.cpu(), kq)  # bit for bit


def test_quantize_int4_rounds_half_to_even(device):
    vals = torch.tensor([7.0, 2.5, -2.5, 1.5, -1.5, 0.5, -0.5, 6.5])  # amax 7: scale 1
    k = vals.view(1, 1, 1, 8).to(device)
    want = [7, 2, -2, 2, -2, 0, 0, 6]
    assert quant.unpack_int4(quant.quantize_keys_int4_ref(k)[0]).flatten().tolist() == want
    assert quant.unpack_int4(quant.quantize_keys_int4_triton(k)[0].cpu()).flatten().tolist() == want


def test_quantize_int4_strided_input(device):
    g = torch.Generator().manual_seed(2)
    k = torch.randn(2, 9, 3, 32, generator=g).permute(0, 2, 1, 3).to(device)  # [B, H, L, D] non-contiguous
    sm = quant.fit_smoothing(k).transpose(1, 2).contiguous().transpose(1, 2)  # strided smoothing too
    a = quant.quantize_keys_int4_triton(k, sm)
    b = quant.quantize_keys_int4_ref(k.cpu(), sm.cpu())
    assert torch.equal(a[0].cpu(), b[0]) and torch.equal(a[1].cpu(), b[1])


@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("B,H,L,D", [(1, 1, 7, 16), (3, 2, 11, 64), (3, 4, 5, 24)])
def test_quantize_append_int4_writes_only_pos(impl, smooth, B, H, L, D, device):
    g = torch.Generator().manual_seed(3)
    k = torch.randn(B, H, L, D, generator=g)
    sm = quant.fit_smoothing(k) if smooth else None
    kq, ks = quant.quantize_keys_int4_ref(k, sm)
    kq, ks = kq.to(device), ks.to(device)
    k_new = (torch.randn(B, H, D, generator=g) * 3).to(device)
    pos = torch.tensor([L - 1, 0, L][:B] if B > 1 else [3], dtype=torch.int64)
    if B == 3:
        pos[1] = -1
    kq0, ks0 = kq.clone(), ks.clone()
    fn = quant.quantize_append_int4_ref if impl == "ref" else quant.quantize_append_int4_triton
    fn(kq, ks, k_new, pos.to(device), None if sm is None else sm.to(device))
    want_q, want_s = quant.quantize_keys_int4_ref(k_new[:, :, None].cpu(), sm)
    # the Triton kernel is bit-for-bit the CPU reference; torch on CUDA may round the
    # smoothed division one ulp apart (the codes still agree)
    s_tol = dict(rtol=1e-6, atol=0) if impl == "ref" and device.type == "cuda" else dict(rtol=0, atol=0)
    for b in range(B):
        p = int(pos[b])
        keep = torch.ones(L, dtype=torch.bool)
        if 0 <= p < L:
            keep[p] = False
            torch.testing.assert_close(ks[b, :, p].cpu(), want_s[b, :, 0], **s_tol)
            assert torch.equal(kq[b, :, p].cpu(), want_q[b, :, 0])
        assert torch.equal(kq[b, :, keep], kq0[b, :, keep]) and torch.equal(ks[b, :, keep], ks0[b, :, keep])


def test_int4_dispatch_and_bad_inputs(monkeypatch, device):
    k = torch.randn(2, 1, 3, 16, device=device)
    sm = quant.fit_smoothing(k)
    got = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("SPADE_KERNELS", mode)
        kq, ks = kernels.quantize_keys_int4(k, sm)
        kernels.quantize_append_int4(kq, ks, torch.zeros(2, 1, 16, device=device), torch.tensor([1, 2], device=device), sm)
        got[mode] = (kq.cpu(), ks.cpu())
        assert (quant.unpack_int4(kq[0, :, 1]) == 0).all() and (quant.unpack_int4(kq[1, :, 2]) == 0).all()
        assert ks[0, 0, 1] < 1e-8 and ks[1, 0, 2] < 1e-8  # zero key: the floor scale, no NaN
    assert torch.equal(got["torch"][0], got["triton"][0])
    # torch on CUDA may round the smoothed scales one ulp apart from the kernel (bit-exact on CPU)
    torch.testing.assert_close(got["torch"][1], got["triton"][1], rtol=1e-6 if device.type == "cuda" else 0, atol=0)
    kq, ks = quant.quantize_keys_int4_ref(torch.randn(1, 1, 4, 8))
    with pytest.raises(ValueError, match="even"):
        quant.quantize_keys_int4_ref(torch.randn(1, 1, 4, 7))
    with pytest.raises(ValueError, match="smooth"):
        quant.quantize_keys_int4_ref(torch.randn(1, 1, 4, 8), torch.ones(1, 1, 4))
    with pytest.raises(ValueError, match="kq must be packed"):
        quant.quantize_append_int4_ref(kq.to(torch.int8), ks, torch.randn(1, 1, 8), torch.tensor([0]))
    with pytest.raises(ValueError, match="k_new"):
        quant.quantize_append_int4_triton(kq, ks, torch.randn(1, 1, 4), torch.tensor([0]))


# ------------------------------------------------------------------------------------------------
# scoring with int4 keys: logits = scale * (fold_smoothing(q, s) . unpack(kq)) * ks
# ------------------------------------------------------------------------------------------------

HEADS = [(2, 2), (4, 2), (4, 1)]  # (Hq, Hkv): MHA, GQA, MQA
CASES = [(1, 37, 16), (3, 29, 24), (3, 45, 64)]  # (B, L, D): odd lengths; D = 24 pads the packed tile


def _int4_inputs(B, Hq, Hkv, L, D, qdtype, device, *, seed, smooth=True):
    """Smoothed int4 keys of random caches with left padding (rows 1, 2 start late and end
    early), the folded query, and the float64 keys the int4 path really scores
    (``unpack(kq) * ks``; the smoothing sits in the query)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, Hkv, L, D, generator=g) * torch.exp(torch.randn(B, Hkv, 1, D, generator=g))
    kv_lens = torch.tensor([L, L - 4, L - 9][:B])
    kv_start = torch.tensor([0, 3, 1][:B])
    sm = quant.fit_smoothing(k, kv_lens, kv_start) if smooth else None
    kq, ks = quant.quantize_keys_int4_ref(k, sm)
    q = quant.fold_smoothing(torch.randn(B, Hq, D, generator=g).to(qdtype), sm)
    k64 = quant.unpack_int4(kq).double() * ks.double()[..., None]
    return q.to(device), kq.to(device), ks.to(device), kv_lens.to(device), kv_start.to(device), k64


def _scores64(q, k64, reduce, lo, hi):
    """Definition in float64: group-reduced scores [B, Hkv, L], -inf outside [lo, hi)
    (the sum_softmax support)."""
    B, Hq, D = q.shape
    Hkv, L = k64.shape[1], k64.shape[2]
    lg = torch.einsum("bhgd,bhld->bhgl", q.double().view(B, Hkv, Hq // Hkv, D), k64) * D ** -0.5
    pos = torch.arange(L)
    ok = (pos[None] >= lo[:, None]) & (pos[None] < hi[:, None])  # [B, L]
    if reduce == "sum_logits":
        s = lg.sum(2)
    elif reduce == "max_logits":
        s = lg.amax(2)
    else:
        s = torch.softmax(lg.masked_fill(~ok[:, None, None], float("-inf")), -1).nan_to_num(0.0).sum(2)
    return s.masked_fill(~ok[:, None], float("-inf"))


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("reduce,gemv", [(r, "on") for r in scoring.REDUCES]
                         + [("sum_logits", "float"), ("sum_logits", "off"), ("sum_softmax", "off")])
def test_group_scores_int4_matches_ref_and_definition(reduce, gemv, heads, qdtype, device, monkeypatch):
    """Every reduce through the tensor-core tile; sum_logits through its three paths:
    ``on`` (the default: the int8-tensor-core GEMV, query in int8 digits), ``float``
    (the float GEMV tile) and ``off`` (the tile); sum_softmax's logits through the int8
    tensor cores (``on``: each head's query in digits) and the float tile (``off``)."""
    monkeypatch.setitem(scoring.GEMV_CONFIG, "use", "off" if gemv == "off" else "int8")
    monkeypatch.setitem(scoring.GEMV_CONFIG, "int8_dot", gemv == "on")
    for i, (B, L, D) in enumerate(CASES):
        q, kq, ks, kv, st, k64 = _int4_inputs(B, *heads, L, D, qdtype, device, seed=10 + i)
        ref = scoring.group_scores_ref(q, kq, kv, reduce=reduce, kv_start=st, k_scale=ks)
        out = scoring.group_scores_triton(q, kq, kv, reduce=reduce, kv_start=st, k_scale=ks)
        true = _scores64(q.cpu(), k64, reduce, st.cpu(), kv.cpu())
        assert torch.equal(out.isinf().cpu(), true.isinf()) and not out.isnan().any()
        torch.testing.assert_close(ref.cpu().double(), true, rtol=1e-5, atol=1e-5)
        # fp32 rounding only (the digit GEMV also rounds the query to max|qs| / 1.6e7 per channel)
        torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=1e-5, atol=1e-5)


def _check_topk(idx, true, lo, hi, k_top):
    """``idx`` [B, Hkv, k_top] is a valid top-K of ``true`` over [lo, hi): distinct
    candidates, ``min(k_top, n)`` of them, none scoring below the K-th best (ties allowed)."""
    B, Hkv, _ = idx.shape
    idx = idx.cpu()
    for b in range(B):
        n = max(0, int(hi[b]) - int(lo[b]))
        for h in range(Hkv):
            row = idx[b, h]
            got = row[row >= 0]
            assert len(got) == min(k_top, n) and len(set(got.tolist())) == len(got)
            assert ((got >= lo[b]) & (got < hi[b])).all()
            if k_top >= n:  # K >= length: the whole candidate set
                assert sorted(got.tolist()) == list(range(int(lo[b]), int(hi[b])))
            elif len(got):
                cand = true[b, h, int(lo[b]):int(hi[b])]
                kth = cand.topk(k_top).values[-1]
                assert (true[b, h, got] >= kth - 1e-6).all()


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("reduce", scoring.REDUCES)
def test_score_topk_int4_matches_ref(reduce, heads, device):
    for i, (B, L, D) in enumerate(CASES):
        q, kq, ks, kv, st, k64 = _int4_inputs(B, *heads, L, D, torch.bfloat16, device, seed=20 + i)
        lo, hi = st + 1, kv - 2  # sinks 1, recent 2
        norm = kv if reduce == "sum_softmax" else None
        s_lo, s_hi = (torch.zeros_like(lo), kv) if norm is not None else (lo, hi)
        true = _scores64(q.cpu(), k64, reduce, s_lo.cpu(), s_hi.cpu())
        for k_top in (1, 7, L):
            ref = scoring.score_topk_ref(q, kq, lo, hi, k_top, reduce=reduce, kv_lens=norm, k_scale=ks)
            out = scoring.score_topk_triton(q, kq, lo, hi, k_top, reduce=reduce, kv_lens=norm, k_scale=ks)
            _check_topk(ref, true, lo.cpu(), hi.cpu(), k_top)
            _check_topk(out, true, lo.cpu(), hi.cpu(), k_top)
            assert torch.equal(out.sort(-1).values.cpu(), ref.sort(-1).values.cpu())


def test_int4_keys_need_their_scales_and_half_width():
    q = torch.randn(1, 2, 16)
    kq, ks = quant.quantize_keys_int4_ref(torch.randn(1, 1, 8, 16))
    lo, hi = torch.tensor([0]), torch.tensor([8])
    for fn in (scoring.score_topk_ref, scoring.score_topk_triton):
        with pytest.raises(ValueError, match="k_scale"):
            fn(q, kq, lo, hi, 2)
        with pytest.raises(ValueError, match="k_scale"):
            fn(q, kq, lo, hi, 2, k_scale=ks[..., :4])
        with pytest.raises(ValueError, match="head_dim"):  # a packed row holds D/2 bytes
            fn(torch.randn(1, 2, 8), kq, lo, hi, 2, k_scale=ks)
    with pytest.raises(ValueError, match="k_scale"):
        scoring.group_scores_triton(q, kq, torch.tensor([8]))


def test_int4_dispatch(monkeypatch, device):
    q, kq, ks, kv, st, _ = _int4_inputs(3, 4, 2, 29, 16, torch.float32, device, seed=3)
    got = []
    for mode in ("torch", "triton"):
        monkeypatch.setenv("SPADE_KERNELS", mode)
        got.append(kernels.score_topk(q, kq, st, kv, 5, k_scale=ks).sort(-1).values.cpu())
    assert torch.equal(got[0], got[1])


def _overlap(a, b):
    B, H, K = a.shape
    return sum(len(set(a[i, h].tolist()) & set(b[i, h].tolist())) for i in range(B) for h in range(H)) / (B * H * K)


@pytest.mark.parametrize("reduce", scoring.REDUCES)
def test_smoothing_rescues_an_outlier_channel(reduce):
    """Keys with one large, nearly constant channel (as real keys have): per-token int4
    spends its 15 levels on that channel and the others collapse to 0 / +-1, so plain
    int4 keeps under half of the exact top-K; the smoothing fitted on a "prompt" (the
    first quarter) keeps >= 80 %. Torch references (the kernels match them above)."""
    g = torch.Generator().manual_seed(5)
    B, Hq, Hkv, L, D, K = 2, 4, 2, 512, 64, 48
    k = torch.randn(B, Hkv, L, D, generator=g)
    k[..., 3] = 30 + 2 * torch.randn(B, Hkv, L, generator=g)
    q = k[:, :, torch.randint(0, L, (Hq // Hkv,), generator=g)].reshape(B, Hq, D) + torch.randn(B, Hq, D, generator=g)
    q[..., 3] = 0.3 * torch.randn(B, Hq, generator=g)
    lo, hi = torch.zeros(B, dtype=torch.long), torch.full((B,), L)
    exact = scoring.score_topk_ref(q, k, lo, hi, K, reduce=reduce, kv_lens=hi)
    kq, ks = quant.quantize_keys_int4_ref(k)
    plain = _overlap(exact, scoring.score_topk_ref(q, kq, lo, hi, K, reduce=reduce, kv_lens=hi, k_scale=ks))
    sm = quant.fit_smoothing(k, kv_lens=torch.full((B,), L // 4))
    kq, ks = quant.quantize_keys_int4_ref(k, sm)
    smooth = _overlap(exact, scoring.score_topk_ref(quant.fold_smoothing(q, sm), kq, lo, hi, K, reduce=reduce,
                                                    kv_lens=hi, k_scale=ks))
    print(f"int4 top-{K} overlap with exact ({reduce}): plain {plain:.3f}, smoothed {smooth:.3f}")
    assert plain < 0.5 and smooth >= 0.8, (plain, smooth)


# ------------------------------------------------------------------------------------------------
# asyncspade with score_keys="int4"
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("B,Hq,Hkv,starts,dtype,reduce", [
    (1, 2, 2, None, torch.float32, "sum_logits"),
    (3, 4, 2, [0, 6, 3], torch.bfloat16, "max_logits"),
    (3, 4, 1, [5, 0, 0], torch.float16, "sum_logits"),
])
@pytest.mark.skipif(not INTERPRET, reason="SPADE_KERNELS=triton on the simulator's CPU tensors needs the interpreter")
def test_policy_int4_copy_and_selection(B, Hq, Hkv, starts, dtype, reduce, monkeypatch):
    """asyncspade with int4 keys, on the Triton kernels: the smoothing equals
    ``fit_smoothing`` of the prompt's valid keys (garbage after kv_lens and in the left
    padding ignored); after every observe the copy equals a fresh quantisation of the
    valid cache under it; each selection equals the torch-reference path's
    (``topk_selection`` of the folded q_{t-1} over those keys); the whole run gives the
    selections of the same policy on the torch references."""
    from spade.policies.common import topk_selection
    from tests.policies.sim import DecodeSim, make_policy, middle_sets

    sim = DecodeSim(B=B, Hq=Hq, Hkv=Hkv, kv_start=starts, prompt_len=41, steps=3, seed=9, dtype=dtype)
    common = dict(budget=20, sink_tokens=2, recent_tokens=3, predictor="last", window=3, group_reduce=reduce,
                  score_keys="int4", rope_aware=False)
    T = sim.prompt_len
    sm_want = quant.fit_smoothing(sim.k_all[0], torch.full((B,), T), sim.starts)
    runs = {}
    for mode in ("triton", "torch"):
        monkeypatch.setenv("SPADE_KERNELS", mode)
        pol = make_policy("asyncspade", sim, **common)
        sels = []

        def on_step(rec, state):
            st = state.layers[rec.layer]
            assert st.kq.dtype == torch.uint8 and torch.equal(st.k_smooth, sm_want)
            want_q, want_s = quant.quantize_keys_int4_ref(sim.k_all[rec.layer], sm_want)
            for b in range(B):
                s, n = (0 if starts is None else starts[b]), int(rec.kv_lens[b])
                assert torch.equal(st.kq[b, :, s:n], want_q[b, :, s:n]), "int4 copy drifted from the cache"
                assert torch.equal(st.ks[b, :, s:n], want_s[b, :, s:n])
            prev_q = quant.fold_smoothing(sim.q_all[rec.layer, :, :, rec.seq_len - 2].float(), sm_want).to(dtype)
            monkeypatch.setenv("SPADE_KERNELS", "torch")
            want = topk_selection(prev_q, st.kq, rec.kv_lens, sim.starts, budget=20, n_sink=2, n_recent=3,
                                  scale=sim.spec.softmax_scale, reduce=reduce, k_scale=st.ks)
            monkeypatch.setenv("SPADE_KERNELS", mode)
            assert middle_sets(rec.sel) == middle_sets(want)
            sels.append(middle_sets(rec.sel))

        sim.run(pol, on_step=on_step)
        runs[mode] = sels
    assert len(runs["triton"]) == sim.steps and runs["triton"] == runs["torch"]


def test_policy_int4_config_and_growing_view(monkeypatch):
    """``score_keys`` accepts int4; a growing cache view rebuilds the copy with doubled
    capacity but keeps the prompt's smoothing (the copy's scale is fixed per sequence)."""
    from spade.policies.asyncspade import AsyncSpadePolicyConfig
    from tests.policies.sim import DecodeSim, make_policy

    monkeypatch.setenv("SPADE_KERNELS", "torch")
    with pytest.raises(ValueError):
        AsyncSpadePolicyConfig(budget=8, sink_tokens=1, recent_tokens=2, score_keys="int2")
    sim = DecodeSim(B=2, Hq=4, Hkv=2, kv_start=[0, 3], prompt_len=10, steps=12, seed=10, extra=0)
    pol = make_policy("asyncspade", sim, budget=8, sink_tokens=1, recent_tokens=2, predictor="last", window=2,
                      score_keys="int4", rope_aware=False)
    st = pol.new_state(2, "cpu")
    ks, vs, kv = sim.fresh_cache()
    T = sim.prompt_len
    st.seq_len = T
    pol.prefill(st, 0, sim.q_all[0, :, :, :T], ks[0][:, :, :T], vs[0][:, :, :T], kv)
    sm = st.layers[0].k_smooth
    caps = [st.layers[0].kq.shape[2]]
    for step in range(sim.steps):
        pos = T + step
        ks[0][:, :, pos] = sim.k_all[0, :, :, pos]
        kv = kv + 1
        st.seq_len = pos + 1
        view = ks[0][:, :, :pos + 1]
        sel = pol.select(st, 0, None, view, kv)
        pol.observe(st, 0, sim.q_all[0, :, :, pos], view, kv)
        lay = st.layers[0]
        caps.append(lay.kq.shape[2])
        assert lay.k_smooth is sm
        want_q, want_s = quant.quantize_keys_int4_ref(sim.k_all[0, :, :, :pos + 1], sm)
        for b, s in enumerate([0, 3]):
            assert torch.equal(lay.kq[b, :, s:pos + 1], want_q[b, :, s:pos + 1])
            assert torch.equal(lay.ks[b, :, s:pos + 1], want_s[b, :, s:pos + 1])
        assert sel is not None and sel.indices.shape[-1] == 5
    assert caps[0] == T and caps[-1] == 40 and len(set(caps)) == 3


@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_int4_through_the_async_runtime_matches_inline(backend, monkeypatch):
    """score_keys=int4 on the cache rank (its own prefill / observe / select on a static
    cache view or transformers' growing cache; the smoothing fitted there from its own
    copy of the prompt's keys) gives the inline runtime's tokens."""
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
    base = config("policy.score_keys=int4")
    want = InlineRuntime(base, be, build_policy(base.policy, be.spec)).generate(
        ids, mask, max_new_tokens=NEW, sample_fn=greedy).tokens
    cfg = config("policy.score_keys=int4", "runtime.topology=local", "runtime.pack_layers=2",
                 "runtime.return_mode=delta")
    rt = AsyncRuntime(cfg, be, build_policy(cfg.policy, be.spec))
    try:
        tr = rt.generate(ids, mask, max_new_tokens=NEW, sample_fn=greedy)
    finally:
        rt.close()
    assert tr.tokens == want and tr.stats["sparse_steps"] > 0


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("logits_tile,finalize_tile,kbits", [(32, 128, "int4"), (64, 32, "int8")])
def test_sum_softmax_passes_chunked_apart(logits_tile, finalize_tile, kbits, heads, device, monkeypatch):
    """sum_softmax's logits pass and its finalize run their own tiles and chunks
    (``scoring.SOFTMAX_CONFIG``): the finalize merges every chunk's statistics of the
    logits pass, whatever its own chunking. Scores, radix top-K and the threshold-carry
    top-K (a few calls: first the fallback, then the carried threshold) match the
    reference on fresh inputs with odd lengths."""
    from spade.kernels import carry as carry_mod

    monkeypatch.setattr(scoring, "SOFTMAX_CONFIG", dict(
        logits_BLOCK_L=logits_tile, logits_MIN_CHUNK=logits_tile, finalize_BLOCK_L=finalize_tile,
        finalize_MIN_CHUNK=finalize_tile))
    B, L, D = 3, 301, 32
    if kbits == "int4":
        q, kq, ks, kv, st, _ = _int4_inputs(B, *heads, L, D, torch.float32, device, seed=31 + logits_tile)
    else:
        g = torch.Generator().manual_seed(41 + finalize_tile)
        q = torch.randn(B, heads[0], D, generator=g).to(device)
        kq, ks = quant.quantize_keys_ref(torch.randn(B, heads[1], L, D, generator=g).to(device))
        kv = torch.tensor([L, 190, 77], device=device)
        st = torch.tensor([0, 5, 2], device=device)
    ref = scoring.group_scores_ref(q, kq, kv, reduce="sum_softmax", kv_start=st, k_scale=ks)
    out = scoring.group_scores_triton(q, kq, kv, reduce="sum_softmax", kv_start=st, k_scale=ks)
    assert torch.equal(out.isinf(), ref.isinf())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    lo, hi = st + 1, kv - 2
    c = carry_mod.new_carry(B, heads[1], device)
    for k_top in (5, 5, 5, 40):
        want = scoring.score_topk_ref(q, kq, lo, hi, k_top, reduce="sum_softmax", kv_lens=kv, k_scale=ks)
        for kw in ({}, {"carry": c}):
            got = scoring.score_topk_triton(q, kq, lo, hi, k_top, reduce="sum_softmax", kv_lens=kv, k_scale=ks, **kw)
            assert torch.equal(got.sort(-1).values.cpu(), want.sort(-1).values.cpu()), (k_top, kw.keys())


def test_sum_softmax_finalize_tile_checked_under_the_carry(device, monkeypatch):
    """A finalize tile the threshold carry's bitmask cannot take (over its 2048-position
    slack past L) is refused, naming the setting."""
    from spade.kernels import carry as carry_mod

    monkeypatch.setattr(scoring, "SOFTMAX_CONFIG", {"finalize_BLOCK_L": 4096})
    q, kq, ks, kv, st, _ = _int4_inputs(1, 4, 2, 40, 16, torch.float32, device, seed=3)
    with pytest.raises(ValueError, match="finalize_BLOCK_L"):
        scoring.score_topk_triton(q, kq, st + 1, kv - 2, 4, reduce="sum_softmax", kv_lens=kv, k_scale=ks,
                                  carry=carry_mod.new_carry(1, 2, device))


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("D", [16, 32])  # packed rows of 8 and 16 bytes
def test_int4_scores_four_tokens_per_mma_row(heads, D, device, monkeypatch):
    """``GEMV_CONFIG["pack"] = 4`` (four int4 tokens per MMA row, block-diagonal digits)
    against one token per row: the same scores up to fp32's summation order, the same
    top-K with and without the threshold carry, and over a pool of 16-key blocks the
    contiguous copy's scores bit for bit (blocks of 5 take one token per row). 64-key tiles, three
    per chunk: odd lengths end inside a tile and inside a packed row."""
    from spade.kernels import carry as C
    from spade.kernels.paged import scatter_to_pool

    seen = []
    real = scoring._pack
    monkeypatch.setattr(scoring, "_pack", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
    monkeypatch.setitem(scoring.GEMV_CONFIG, "BLOCK_L", 64)
    monkeypatch.setitem(scoring.GEMV_CONFIG, "MIN_CHUNK", 192)
    for i, (B, L) in enumerate([(1, 203), (3, 130)]):
        q, kq, ks, kv, st, k64 = _int4_inputs(B, *heads, L, D, torch.float32, device, seed=40 + i)
        lo, hi = st + 1, kv - 2
        got = {}
        for pack in (1, 4):
            monkeypatch.setitem(scoring.GEMV_CONFIG, "pack", pack)
            seen.clear()
            s = scoring.group_scores_triton(q, kq, kv, kv_start=st, k_scale=ks)
            assert seen[-1] == pack
            idx = scoring.score_topk_triton(q, kq, lo, hi, 9, k_scale=ks).sort(-1).values
            carry = C.new_carry(B, heads[1], device)
            for _ in range(2):  # the first call falls back, the second selects among its candidates
                cidx = scoring.score_topk_triton(q, kq, lo, hi, 9, k_scale=ks, carry=carry).sort(-1).values
                assert torch.equal(cidx, idx)
            got[pack] = s, idx
        (s1, i1), (s4, i4) = got[1], got[4]
        assert torch.equal(s4.isinf(), s1.isinf()) and not s4.isnan().any()
        torch.testing.assert_close(s4, s1, rtol=1e-5, atol=1e-5)
        true = _scores64(q.cpu(), k64, "sum_logits", st.cpu(), kv.cpu())
        _check_topk(i4, true, lo.cpu(), hi.cpu(), 9)
        for bs in (16, 5):
            pool, table = scatter_to_pool(kq.cpu(), bs, torch.Generator().manual_seed(bs), lens=kv.cpu(), poison=0xFF)
            spool, _ = scatter_to_pool(ks.cpu()[..., None], bs, torch.Generator().manual_seed(bs), lens=kv.cpu())
            sp = scoring.group_scores_triton(q, pool.to(device), kv, kv_start=st, k_scale=spool[..., 0].to(device),
                                             block_table=table.to(device))[..., :L]  # logical: whole blocks
            assert torch.equal(sp, s4 if bs == 16 else s1), (bs, (sp - s4).abs().nan_to_num().max())
            assert seen[-1] == (4 if bs == 16 else 1)


def test_int4_pack_setting_checked():
    """A ``pack`` other than 1 or 4 is refused, naming the setting; rows that cannot pack
    (12 or 32 bytes, int8 keys, tiles of fewer than 64 keys, rows not back to back, pool
    blocks that split a group of four or map by slot) take one token per row."""
    k = torch.zeros(1, 2, 64, 16, dtype=torch.uint8)
    assert scoring._pack(k, 256, {}) == 4
    assert scoring._pack(k[..., :8], 256, {}) == 1  # 8 bytes, but strided (rows 16 apart)
    assert scoring._pack(torch.zeros(1, 2, 64, 8, dtype=torch.uint8), 256, {}) == 4
    assert scoring._pack(torch.zeros(1, 2, 64, 12, dtype=torch.uint8), 256, {}) == 1
    assert scoring._pack(torch.zeros(1, 2, 64, 32, dtype=torch.uint8), 256, {}) == 1
    assert scoring._pack(k, 32, {}) == 1
    assert scoring._pack(k.view(torch.int8), 256, {}) == 1
    assert scoring._pack(k, 256, {"pack": 1}) == 1
    assert scoring._pack(k[:, 1:], 256, {}) == 4  # a head of the copy: rows still back to back
    assert scoring._pack(k, 256, {}, {"BLOCK_SIZE": 16}) == 4
    assert scoring._pack(k, 256, {}, {"BLOCK_SIZE": 6}) == 1
    assert scoring._pack(k, 256, {}, {"BLOCK_SIZE": 12}) == 1  # 256 % 12: slots
    with pytest.raises(ValueError, match=r"GEMV_CONFIG\['pack'\] must be 1 or 4.*got 2"):
        scoring._pack(k, 256, {"pack": 2})
    assert scoring._gemv_config(k)["pack"] == 4 and scoring._gemv_config(k[..., :12])["pack"] == 1

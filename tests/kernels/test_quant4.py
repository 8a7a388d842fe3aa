"""int4 scoring keys: smoothing, packing, quantize / append (Triton vs reference vs the
definition), int4 scores and the fused top-K against their torch references, and the
selection quality the smoothing buys on keys with an outlier channel."""

from __future__ import annotations

import pytest
import torch

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
    """Byte i = (v_i + 8) | (v_{i+D/2} + 8) << 4; unpack inverts pack on [-8, 7]."""
    v = torch.tensor([[-7, 0, 7, -8, 3, -1]])  # D = 6
    p = quant.pack_int4(v)
    assert p.dtype == torch.uint8 and p.tolist() == [[1 | (0 << 4), 8 | (11 << 4), 15 | (7 << 4)]]
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
    assert s[0, 0].tolist() == pytest.approx([3.0, 0.5, 0.03, 0.03])  # channels 2-3 floored at 1 % of 3
    assert s[1, 0].tolist() == pytest.approx([9.0, 0.5, 0.09, 0.09])  # padding at 0 ignored
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
    assert v.abs().max() <= 7 and (kq & 15).min() >= 1 and (kq >> 4).min() >= 1  # never the -8 code
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
    for b in range(B):
        p = int(pos[b])
        keep = torch.ones(L, dtype=torch.bool)
        if 0 <= p < L:
            keep[p] = False
            assert torch.equal(ks[b, :, p].cpu(), want_s[b, :, 0]) and torch.equal(kq[b, :, p].cpu(), want_q[b, :, 0])
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
    assert torch.equal(got["torch"][0], got["triton"][0]) and torch.equal(got["torch"][1], got["triton"][1])
    kq, ks = quant.quantize_keys_int4_ref(torch.randn(1, 1, 4, 8))
    with pytest.raises(ValueError, match="even"):
        quant.quantize_keys_int4_ref(torch.randn(1, 1, 4, 7))
    with pytest.raises(ValueError, match="smooth"):
        quant.quantize_keys_int4_ref(torch.randn(1, 1, 4, 8), torch.ones(1, 1, 4))
    with pytest.raises(ValueError, match="kq must be packed"):
        quant.quantize_append_int4_ref(kq.to(torch.int8), ks, torch.randn(1, 1, 8), torch.tensor([0]))
    with pytest.raises(ValueError, match="k_new"):
        quant.quantize_append_int4_triton(kq, ks, torch.randn(1, 1, 4), torch.tensor([0]))

"""int8 scoring keys: quantize_keys / quantize_append, Triton vs the torch reference vs the definition."""

from __future__ import annotations

import pytest
import torch

from spade import kernels
from spade.kernels import quant

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 1, 37, 16), (3, 2, 5, 64), (3, 4, 1, 24)]  # (B, H, L, D); D=24 pads the tile


def _keys(shape, dtype, g):
    """Random keys with per-token magnitudes spanning 1e-3..1e2 and one all-zero token."""
    k = torch.randn(*shape, generator=g) * torch.exp(2.5 * torch.randn(*shape[:3], 1, generator=g))
    k[:, :, 0] = 0.0
    return k.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_keys_definition_and_triton(shape, dtype, device):
    g = torch.Generator().manual_seed(1)
    k = _keys(shape, dtype, g)
    kq, ks = quant.quantize_keys_ref(k)
    assert kq.dtype == torch.int8 and ks.dtype == torch.float32 and kq.shape == k.shape and ks.shape == k.shape[:3]
    kf = k.float()
    # the definition: scale = amax / 127 (floored), |kq| <= 127, error <= half a step
    amax = kf.abs().amax(-1)
    torch.testing.assert_close(ks, amax.clamp_min(quant.SCALE_FLOOR) / 127)
    assert kq.abs().max() <= 127 and not ks.isnan().any()
    assert ((kq.float() * ks[..., None] - kf).abs() <= 0.5 * ks[..., None] * (1 + 1e-5) + 1e-12).all()
    assert (kq[:, :, 0] == 0).all()  # the zero key stays zero, finite scale
    # the largest element of each nonzero key maps to +-127
    nz = amax > 0
    assert (kq.abs().amax(-1)[nz] == 127).all()

    # IEEE division and round-half-to-even in the kernel: bit-for-bit the reference
    kq_t, ks_t = quant.quantize_keys_triton(k.to(device))
    assert torch.equal(ks_t.cpu(), ks) and torch.equal(kq_t.cpu(), kq)


def test_quantize_rounds_half_to_even_like_torch(device):
    """Exact .5 ties (amax 127 makes the scale 1): 2.5 -> 2, -2.5 -> -2, 1.5 -> 2, 0.5 -> 0."""
    vals = torch.tensor([127.0, 2.5, -2.5, 1.5, -1.5, 0.5, -0.5, 126.5])
    k = vals.view(1, 1, 1, 8).to(device)
    want = [127, 2, -2, 2, -2, 0, 0, 126]
    assert quant.quantize_keys_ref(k)[0].flatten().tolist() == want
    assert quant.quantize_keys_triton(k)[0].flatten().tolist() == want


def test_quantize_keys_strided_input(device):
    g = torch.Generator().manual_seed(2)
    base = torch.randn(2, 9, 3, 32, generator=g)  # [B, L, H, D]
    k = base.permute(0, 2, 1, 3).to(device)  # [B, H, L, D], non-contiguous
    kq_t, ks_t = quant.quantize_keys_triton(k)
    kq, ks = quant.quantize_keys_ref(k.cpu())
    assert torch.equal(ks_t.cpu(), ks) and torch.equal(kq_t.cpu(), kq)


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("B,H,L,D", [(1, 1, 7, 16), (3, 2, 11, 64), (3, 4, 5, 24)])
def test_quantize_append_writes_only_pos(impl, B, H, L, D, device):
    """Slot ``pos[b]`` of row b gets quantize(k_new[b]); every other slot, and rows with
    pos outside [0, L), are untouched."""
    g = torch.Generator().manual_seed(3)
    kq, ks = quant.quantize_keys_ref(torch.randn(B, H, L, D, generator=g))
    kq, ks = kq.to(device), ks.to(device)
    k_new = torch.randn(B, H, D, generator=g).to(device)
    pos = torch.tensor([L - 1, -1, 2][:B] if B > 1 else [3], dtype=torch.int64)
    if B == 3 and L > 2:
        pos[2] = L  # past the end: skipped too
        pos[1] = 0
    kq0, ks0 = kq.clone(), ks.clone()
    fn = quant.quantize_append_ref if impl == "ref" else quant.quantize_append_triton
    fn(kq, ks, k_new, pos.to(device))
    want_q, want_s = quant.quantize_keys_ref(k_new[:, :, None].cpu())
    for b in range(B):
        p = int(pos[b])
        keep = torch.ones(L, dtype=torch.bool)
        if 0 <= p < L:
            keep[p] = False
            assert torch.equal(ks[b, :, p].cpu(), want_s[b, :, 0])
            assert torch.equal(kq[b, :, p].cpu(), want_q[b, :, 0])
        assert torch.equal(kq[b, :, keep], kq0[b, :, keep]) and torch.equal(ks[b, :, keep], ks0[b, :, keep])


def test_quantize_append_zero_key_and_dispatch(monkeypatch, device):
    kq = torch.zeros(2, 1, 4, 16, dtype=torch.int8, device=device)
    ks = torch.ones(2, 1, 4, device=device)
    for mode in ("torch", "triton"):
        monkeypatch.setenv("SPADE_KERNELS", mode)
        kernels.quantize_append(kq, ks, torch.zeros(2, 1, 16, device=device), torch.tensor([1, 3], device=device))
        assert not ks.isnan().any()
        assert ks[0, 0, 1] < 1e-9 and ks[1, 0, 3] < 1e-9  # the floor, not 0/0
        assert (kq == 0).all()
        ks.fill_(1.0)
    k = torch.randn(1, 1, 3, 16, device=device)
    monkeypatch.setenv("SPADE_KERNELS", "triton")
    a = kernels.quantize_keys(k)
    monkeypatch.setenv("SPADE_KERNELS", "torch")
    b = kernels.quantize_keys(k)
    torch.testing.assert_close(a[1], b[1])


def test_quantize_rejects_bad_inputs():
    kq, ks = quant.quantize_keys_ref(torch.randn(1, 1, 4, 8))
    with pytest.raises(ValueError, match="k must be"):
        quant.quantize_keys_ref(torch.randn(1, 4, 8))
    with pytest.raises(ValueError, match="pos"):
        quant.quantize_append_ref(kq, ks, torch.randn(1, 1, 8), torch.tensor([0.0]))
    with pytest.raises(ValueError, match="ks must be"):
        quant.quantize_append_triton(kq, ks.half(), torch.randn(1, 1, 8), torch.tensor([0]))


def _append_case(bits: int, impl: str, cache: torch.Tensor, g: torch.Generator, device):
    """A random quantised copy [B, H, L, .] of the cache's shape and the append to test:
    (kq0, ks0, fn, ref, extra on device, extra for ref) — int4 with the cache's smoothing."""
    B, H, L, D = cache.shape
    smooth = quant.fit_smoothing(cache) if bits == 4 else None
    quant_keys = (lambda k: quant.quantize_keys_int4_ref(k, smooth)) if bits == 4 else quant.quantize_keys_ref
    kq0, ks0 = quant_keys(torch.randn(B, H, L, D, generator=g))
    names = {8: ("quantize_append_ref", "quantize_append_triton"),
             4: ("quantize_append_int4_ref", "quantize_append_int4_triton")}[bits]
    fn = getattr(quant, names[0] if impl == "ref" else names[1])
    extra = (smooth,) if bits == 4 else ()
    return kq0, ks0, fn, getattr(quant, names[0]), tuple(x.to(device) for x in extra), extra


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_quantize_append_reads_the_cache_row(bits, impl, device):
    """``k_new`` given as the cache [B, H, L', D] (strided: a view of a longer buffer):
    slot ``pos[b]`` gets the cache's row ``pos[b]``, exactly as appending the gathered
    row; rows with ``pos`` outside the copy are untouched."""
    B, H, L, D = 3, 2, 9, 16
    g = torch.Generator().manual_seed(7)
    buf = torch.randn(B, H, L + 4, D, generator=g)
    cache = buf[:, :, :L]  # [B, H, L, D], row stride of the longer buffer
    pos = torch.tensor([L - 1, 4, -1])
    kq0, ks0, fn, ref, extra, extra_ref = _append_case(bits, impl, cache, g, device)
    got_q, got_s = kq0.clone().to(device), ks0.clone().to(device)
    fn(got_q, got_s, cache.to(device), pos.to(device), *extra)
    rows = torch.stack([cache[b, :, max(int(pos[b]), 0)] for b in range(B)])  # [B, H, D]
    want_q, want_s = kq0.clone(), ks0.clone()
    ref(want_q, want_s, rows, pos, *extra_ref)
    assert torch.equal(got_q.cpu(), want_q) and torch.equal(got_s.cpu(), want_s)
    assert torch.equal(want_q[2], kq0[2]) and not torch.equal(want_q[0], kq0[0])


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("source", ["new", "cache"])
def test_quantize_append_pos_offset(bits, impl, source, device):
    """``pos_offset`` (added in the kernel, e.g. ``kv_lens`` with -1) writes exactly what
    appending at ``pos + pos_offset`` writes, for new keys and for the cache read at that
    row; rows whose shifted slot falls outside ``[0, L)`` stay untouched."""
    B, H, L, D = 4, 2, 9, 16
    g = torch.Generator().manual_seed(11)
    cache = torch.randn(B, H, L + 3, D, generator=g)[:, :, :L]
    k_new = cache if source == "cache" else torch.randn(B, H, D, generator=g)
    kv = torch.tensor([L, 5, 0, L + 1])  # slots L-1, 4, -1 (skipped), L (skipped)
    kq0, ks0, fn, ref, extra, extra_ref = _append_case(bits, impl, cache, g, device)
    got_q, got_s = kq0.clone().to(device), ks0.clone().to(device)
    fn(got_q, got_s, k_new.to(device), kv.to(device), *extra, pos_offset=-1)
    want_q, want_s = kq0.clone(), ks0.clone()
    ref(want_q, want_s, k_new, kv - 1, *extra_ref)
    assert torch.equal(got_q.cpu(), want_q)
    # scales: the torch reference run on a GPU may round its fp32 scale one ulp apart from the CPU
    torch.testing.assert_close(got_s.cpu(), want_s, rtol=1e-6, atol=0)
    assert torch.equal(want_q[2:], kq0[2:]) and not torch.equal(want_q[0], kq0[0])
    append = kernels.quantize_append_int4 if bits == 4 else kernels.quantize_append
    disp_q, disp_s = kq0.clone().to(device), ks0.clone().to(device)
    append(disp_q, disp_s, k_new.to(device), kv.to(device), *extra, pos_offset=-1)  # the public op passes it on
    assert torch.equal(disp_q.cpu(), want_q) and torch.equal(disp_s.cpu(), want_s)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("source", ["new", "cache"])
def test_quantize_append_of_a_channel_subset(bits, impl, source, device):
    """``chans`` [B, H, r] (each row and head its own channels, in any order, as
    ``score_channels`` picks them): the append writes exactly what appending the gathered
    channels writes — read from new keys [B, H, D] or from the cache's row — and leaves
    rows whose slot falls outside the copy untouched; a wrong ``chans`` is refused."""
    B, H, L, D, r = 3, 2, 7, 32, 12
    g = torch.Generator().manual_seed(23)
    cache = torch.randn(B, H, L + 2, D, generator=g)[:, :, :L]
    k_new = cache if source == "cache" else torch.randn(B, H, D, generator=g)
    chans = torch.stack([torch.stack([torch.randperm(D, generator=g)[:r] for _ in range(H)]) for _ in range(B)])
    kv = torch.tensor([L, 3, L + 1])  # slots L-1, 2, L (skipped)
    sub = cache.gather(3, chans[:, :, None, :].expand(B, H, L, r))  # [B, H, L, r]: the channels' own cache
    kq0, ks0, fn, ref, extra, extra_ref = _append_case(bits, impl, sub, g, device)
    got_q, got_s = kq0.clone().to(device), ks0.clone().to(device)
    fn(got_q, got_s, k_new.to(device), kv.to(device), *extra, pos_offset=-1, chans=chans.to(device))
    rows = quant._new_rows(k_new, kv - 1).gather(2, chans)  # [B, H, r]
    want_q, want_s = kq0.clone(), ks0.clone()
    ref(want_q, want_s, rows, kv - 1, *extra_ref)
    assert torch.equal(got_q.cpu(), want_q)
    torch.testing.assert_close(got_s.cpu(), want_s, rtol=1e-6, atol=0)
    assert torch.equal(want_q[2], kq0[2]) and not torch.equal(want_q[0], kq0[0])
    append = kernels.quantize_append_int4 if bits == 4 else kernels.quantize_append
    with pytest.raises(ValueError, match=r"chans must be an integer \[3, 2, 12\]"):
        append(got_q, got_s, k_new.to(device), kv.to(device), *extra, chans=chans[:, :, :-1].to(device))
    with pytest.raises(ValueError, match="chans must be"):
        append(got_q, got_s, k_new.to(device), kv.to(device), *extra, chans=chans.float().to(device))

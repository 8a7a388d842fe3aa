"""Quantised key copies in a paged pool (``quantize_append`` / ``quantize_append_int4``
with ``block_table``): the copy lives in a pool shared by the rows under a shuffled,
non-monotone table, with poison in every block no row owns. Appending through the
table must leave the pool holding, seen through the table, exactly what the contiguous
append leaves in the logical copy (bit for bit: same arithmetic, only the addresses
differ), and must not touch any block no row owns."""

from __future__ import annotations

import pytest
import torch

from spade import kernels
from spade.kernels import quant
from spade.kernels.paged import paged_to_contiguous, scatter_to_pool

CASES = [  # (B, H, D, block_size, L of the contiguous copy)
    (1, 1, 8, 1, 5),  # one token per block
    (3, 2, 16, 4, 10),  # L not a multiple of the block: the last block's tail is padding
    (3, 1, 8, 5, 12),  # odd block size
    (3, 2, 16, 16, 20),
    (1, 2, 16, 16, 7),  # B=1, its slot past the table: skipped
]
VARIANTS = {  # name: (bits, smooth)
    "int8": (8, False), "int4": (4, False), "int4_smooth": (4, True),
}
APPEND = {8: (quant.quantize_append_ref, quant.quantize_append_triton),
          4: (quant.quantize_append_int4_ref, quant.quantize_append_int4_triton)}
POISON_Q = {8: -99, 4: 157}  # int8 / packed-uint8 filler of the unowned blocks (the scales get NaN)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor, so that NaN poison compares bit for bit."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _setup(case: int, variant: str, device):
    """A random quantised copy moved into a pool: (pool_q, pool_s, table, logical_q,
    logical_s, smooth, g) where logical_* is the pool seen through the table
    [B, H, max_blocks * bs, .] (padding past L poisoned)."""
    B, H, D, bs, L = CASES[case]
    bits, smooth_on = VARIANTS[variant]
    g = torch.Generator().manual_seed(900 + case)
    keys = torch.randn(B, H, L, D, generator=g) * torch.exp(torch.randn(B, H, L, 1, generator=g))
    smooth = quant.fit_smoothing(keys) if smooth_on else None
    kq, ks = quant.quantize_keys_int4_ref(keys, smooth) if bits == 4 else quant.quantize_keys_ref(keys)
    pool_q, table = scatter_to_pool(kq, bs, torch.Generator().manual_seed(case), poison=POISON_Q[bits])
    pool_s, table_s = scatter_to_pool(ks[..., None], bs, torch.Generator().manual_seed(case))
    assert torch.equal(table, table_s)  # the same generator state draws the same table
    pool_q, pool_s, table = pool_q.to(device), pool_s[..., 0].to(device), table.to(device)
    logical_q = paged_to_contiguous(pool_q, table)
    logical_s = paged_to_contiguous(pool_s[..., None], table)[..., 0]
    return pool_q, pool_s, table, logical_q, logical_s, smooth if smooth is None else smooth.to(device), g


def _slots(case: int, L: int, g: torch.Generator) -> torch.Tensor:
    """Logical slots [B]: random in [0, L), the middle row of three (and B=1's last case)
    outside [0, L)."""
    B = CASES[case][0]
    p = torch.randint(0, L, (B,), generator=g)
    if B == 3:
        p[1] = -1 if case % 2 else L
    elif case == len(CASES) - 1:
        p[0] = L
    return p


@pytest.mark.parametrize("pos_offset", [0, -1])
@pytest.mark.parametrize("source", ["new", "cache"])
@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_paged_append_matches_contiguous(case, variant, impl, source, pos_offset, device):
    B, H, D, bs, _ = CASES[case]
    bits = VARIANTS[variant][0]
    pool_q, pool_s, table, logical_q, logical_s, smooth, g = _setup(case, variant, device)
    L = logical_q.shape[2]  # max_blocks * block_size
    p = _slots(case, L, g)
    pos = (p - pos_offset).to(device)
    if source == "cache":  # the cache [B, H, L, D] as a strided view of a longer buffer, read at the slot
        k_new = torch.randn(B, H, L + 3, D, generator=g)[:, :, :L].to(device)
    else:
        k_new = (3 * torch.randn(B, H, D, generator=g)).to(device)
    fn = APPEND[bits][0 if impl == "ref" else 1]
    extra = (smooth,) if bits == 4 else ()
    owned = torch.zeros(pool_q.shape[0], dtype=torch.bool)
    owned[table.cpu().long().reshape(-1)] = True
    before_q, before_s = pool_q.clone(), pool_s.clone()

    want_q, want_s = logical_q.clone(), logical_s.clone()
    fn(want_q, want_s, k_new, pos, *extra, pos_offset=pos_offset)
    fn(pool_q, pool_s, k_new, pos, *extra, pos_offset=pos_offset, block_table=table)

    assert torch.equal(paged_to_contiguous(pool_q, table), want_q)
    assert torch.equal(_bits(paged_to_contiguous(pool_s[..., None], table)[..., 0]), _bits(want_s))
    assert torch.equal(pool_q[~owned], before_q[~owned]) and torch.equal(_bits(pool_s[~owned]), _bits(before_s[~owned]))
    for b in range(B):  # the contiguous append did write the valid rows (and only those)
        wrote = not torch.equal(_bits(want_s[b]), _bits(logical_s[b]))
        assert wrote == bool(0 <= p[b] < L)


@pytest.mark.parametrize("bits", [8, 4])
def test_paged_append_dispatch(bits, device, monkeypatch):
    """The public ops pass the table on; torch and Triton agree on the pool."""
    variant = "int8" if bits == 8 else "int4_smooth"
    pool_q, pool_s, table, _, _, smooth, g = _setup(1, variant, device)
    L = table.shape[1] * pool_q.shape[2]
    k_new = torch.randn(3, 2, 16, generator=g).to(device)
    kv = (_slots(1, L, g) + 1).to(device)  # kv_lens: the slot is kv_lens - 1
    append = kernels.quantize_append_int4 if bits == 4 else kernels.quantize_append
    extra = (smooth,) if bits == 4 else ()
    got = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("SPADE_KERNELS", mode)
        q, s = pool_q.clone(), pool_s.clone()
        append(q, s, k_new, kv, *extra, pos_offset=-1, block_table=table)
        got[mode] = (q.cpu(), s.cpu())
        assert not torch.equal(q, pool_q)
    assert torch.equal(got["torch"][0], got["triton"][0])
    # torch on CUDA may round a scale one ulp apart from the kernel (bit-exact on CPU)
    torch.testing.assert_close(got["torch"][1], got["triton"][1], equal_nan=True,
                               rtol=1e-6 if device.type == "cuda" else 0, atol=0)


@pytest.mark.parametrize("impl", [0, 1])
def test_paged_append_bad_inputs_and_empty_table(impl, device):
    B, H, D, bs, nb = 2, 1, 8, 4, 5
    table = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32, device=device)
    k_new = torch.randn(B, H, D, device=device)
    pos = torch.tensor([2, 5], device=device)
    for bits in (8, 4):
        fn = APPEND[bits][impl]
        kq = torch.zeros(nb, H, bs, D // (8 // bits), dtype=torch.int8 if bits == 8 else torch.uint8, device=device)
        ks = torch.ones(nb, H, bs, device=device)
        with pytest.raises(ValueError, match="ks must be"):
            fn(kq, ks[:, :, :-1], k_new, pos, block_table=table)
        with pytest.raises(ValueError, match="ks must be"):
            fn(kq, ks[..., None], k_new, pos, block_table=table)
        with pytest.raises(ValueError, match="kq must be"):
            fn(kq[0], ks, k_new, pos, block_table=table)
        with pytest.raises(ValueError, match="block_table"):
            fn(kq, ks, k_new, pos, block_table=table.long())
        with pytest.raises(ValueError, match="block_table"):
            fn(kq, ks, k_new, pos, block_table=table[:1])
        with pytest.raises(ValueError, match="block_table"):
            fn(kq, ks, k_new, pos, block_table=table[0])
        with pytest.raises(ValueError, match="k_new"):
            fn(kq, ks, torch.randn(B, H + 1, D, device=device), pos, block_table=table)
        with pytest.raises(ValueError, match="pos"):
            fn(kq, ks, k_new, pos[:1], block_table=table)
        if bits == 4:
            with pytest.raises(ValueError, match="smooth"):
                fn(kq, ks, k_new, pos, torch.ones(B, H, D - 2, device=device), block_table=table)
        fn(kq, ks, k_new, pos, block_table=table[:, :0])  # no blocks: every slot is outside, nothing written
        assert (kq == 0).all() and (ks == 1).all()


@pytest.mark.parametrize("source", ["new", "cache"])
@pytest.mark.parametrize("variant", ["int8", "int4_smooth"])
@pytest.mark.parametrize("case", [1, 2])
def test_paged_append_of_a_channel_subset(case, variant, source, device):
    """``chans`` through the table (``score_channels`` on a paged copy): the pool holds what
    the same kernel's contiguous append of the gathered channels holds (bit for bit; one
    kernel on both sides, as above: a torch reference run on a GPU may round a scale one
    ulp apart), and no unowned block changes."""
    B, H, D, _, _ = CASES[case]
    bits = VARIANTS[variant][0]
    pool_q, pool_s, table, logical_q, logical_s, smooth, g = _setup(case, variant, device)
    L = logical_q.shape[2]
    p = _slots(case, L, g).to(device)
    Dk = 3 * D  # the keys' own head dim: the copy holds D of its channels
    chans = torch.stack([torch.stack([torch.randperm(Dk, generator=g)[:D] for _ in range(H)]) for _ in range(B)])
    if source == "cache":
        k_new = torch.randn(B, H, L + 3, Dk, generator=g)[:, :, :L].to(device)
    else:
        k_new = torch.randn(B, H, Dk, generator=g).to(device)
    extra = (smooth,) if bits == 4 else ()
    owned = torch.zeros(pool_q.shape[0], dtype=torch.bool)
    owned[table.cpu().long().reshape(-1)] = True
    before_q, before_s = pool_q.clone(), pool_s.clone()
    want_q, want_s = logical_q.clone(), logical_s.clone()
    APPEND[bits][1](want_q, want_s, quant._new_rows(k_new, p).gather(2, chans.to(device)), p, *extra)
    APPEND[bits][1](pool_q, pool_s, k_new, p, *extra, block_table=table, chans=chans.to(device))
    assert torch.equal(paged_to_contiguous(pool_q, table), want_q)
    assert torch.equal(_bits(paged_to_contiguous(pool_s[..., None], table)[..., 0]), _bits(want_s))
    assert torch.equal(pool_q[~owned], before_q[~owned]) and torch.equal(_bits(pool_s[~owned]), _bits(before_s[~owned]))

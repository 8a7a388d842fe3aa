"""The decode-step K/V write through a block table (``qkv_rope_store_triton(block_table=)``)
and its torch reference: each row writes at its own logical position into a pool
shared with other rows; padded rows (``widx = -1``) write nothing; every other slot
of the pool, NaN-poisoned, stays as it was."""

from __future__ import annotations

import pytest
import torch

from spade.kernels.elementwise import qkv_rope_store_paged_torch, qkv_rope_store_triton
from spade.kernels.paged import paged_write, scatter_to_pool


def _tol(dtype, ref):  # as tests/models/test_fast.py: fp32 ~1e-5, bf16 a few ulps
    scale = float(ref.float().abs().max())
    return {torch.float32: (1e-5, 1e-5 * scale), torch.bfloat16: (2 ** -6, 2 ** -6 * scale)}[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,Hq,Hkv,D,rot,norm,bs", [
    (1, 2, 2, 32, 32, False, 16),  # B=1, MHA
    (3, 4, 2, 32, 32, True, 4),  # GQA + QK-norm
    (4, 3, 1, 24, 24, True, 5),  # MQA, odd head_dim and block size
])
def test_paged_qkv_rope_store(device, dtype, B, Hq, Hkv, D, rot, norm, bs):
    gen = torch.Generator().manual_seed(B * 100 + bs)
    L, nb = 40, 9
    qkv = torch.randn(B, (Hq + 2 * Hkv) * D, generator=gen).to(device, dtype)
    qn = (1 + 0.3 * torch.randn(D, generator=gen)).to(device, dtype) if norm else None
    kn = (1 + 0.3 * torch.randn(D, generator=gen)).to(device, dtype) if norm else None
    ang = torch.rand(L, rot // 2, generator=gen) * 6.0
    cos, sin = torch.cat([ang, ang], -1).cos().to(device), torch.cat([ang, ang], -1).sin().to(device)
    pos = torch.randint(0, L, (B,), generator=gen).to(device)
    num_blocks = B * nb + 2
    table = (torch.randperm(num_blocks - 1, generator=gen)[: B * nb] + 1).view(B, nb).int().to(device)
    widx = torch.randint(0, nb * bs, (B,), generator=gen)
    if B > 1:
        widx[1] = -1  # a padded row: no write
    widx = widx.to(device)
    kp_r = torch.full((num_blocks, Hkv, bs, D), float("nan"), device=device, dtype=dtype)
    vp_r = torch.full_like(kp_r, float("nan"))
    kp_t, vp_t = kp_r.clone(), vp_r.clone()
    args = (qkv, qn, kn, 1e-6, cos, sin, pos, widx)
    slot_r, slot_t = (torch.full((2, B, Hq, D), float("nan"), device=device, dtype=dtype) for _ in range(2))
    q_r = qkv_rope_store_paged_torch(*args, kp_r, vp_r, Hq, Hkv, table, q_out=slot_r[1])  # into a staging slot
    q_t = qkv_rope_store_triton(*args, kp_t, vp_t, Hq, Hkv, block_table=table, q_out=slot_t[1])
    assert q_r.data_ptr() == slot_r[1].data_ptr() and q_t.data_ptr() == slot_t[1].data_ptr()
    assert torch.isnan(slot_r[0]).all() and torch.isnan(slot_t[0]).all()
    rtol, atol = _tol(dtype, q_r)
    torch.testing.assert_close(q_t.float(), q_r.float(), rtol=rtol, atol=atol)
    written = ~torch.isnan(kp_r)
    assert torch.equal(written, ~torch.isnan(kp_t)) and torch.equal(written, ~torch.isnan(vp_t))
    assert int(written.sum()) == int((widx >= 0).sum()) * Hkv * D  # one token per writing row, nothing else
    rtol, atol = _tol(dtype, kp_r[written])
    torch.testing.assert_close(kp_t[written].float(), kp_r[written].float(), rtol=rtol, atol=atol)
    assert torch.equal(vp_t[written], vp_r[written])  # v is a copy
    for b in range(B):  # the token sits where the table says
        w = int(widx[b])
        if w >= 0:
            blk = int(table[b, w // bs])
            assert not torch.isnan(kp_t[blk, :, w % bs]).any()
            assert torch.equal(vp_t[blk, :, w % bs].reshape(-1).cpu(),
                               qkv[b, (Hq + Hkv) * D:].reshape(-1).cpu().to(dtype))


def test_paged_write_checks_widx(device):
    qkv = torch.randn(2, 4 * 16, device=device)
    cos = torch.ones(8, 16, device=device)
    pool = torch.zeros(3, 1, 4, 16, device=device)
    table = torch.zeros(2, 2, dtype=torch.int32, device=device)
    pos = torch.zeros(2, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match=r"widx must be the rows' integer write positions \[B=2\]"):
        qkv_rope_store_triton(qkv, None, None, 1e-6, cos, cos, pos, torch.tensor([3], device=device), pool, pool,
                              2, 1, block_table=table)


@pytest.mark.parametrize("bs", [1, 3, 16])
@pytest.mark.parametrize("T,start", [(5, 0), (32, 0), (33, 3), (70, 17), (40, 16)])
def test_prefill_fast_path_equals_the_scatter(bs, T, start):
    """A host-int start (prefill) writes whole blocks with one index_copy_ and the partial
    ends through the scatter: the same pool as the scatter alone (a tensor start), NaN
    poison in unowned blocks left alone; ``paged_range`` reads the row's range back."""
    from spade.kernels.paged import paged_range

    g = torch.Generator().manual_seed(bs * 1000 + T + start)
    L = start + T + 7
    pool, table = scatter_to_pool(torch.zeros(2, 2, L, 8), bs, g)
    slow = pool.clone()
    x = torch.randn(2, 2, T, 8, generator=g)
    paged_write(pool, table, x, start)
    paged_write(slow, table, x, torch.tensor(start))
    assert torch.equal(pool.isnan(), slow.isnan())
    assert torch.equal(pool.nan_to_num(0.5), slow.nan_to_num(0.5))
    for r in range(2):
        assert torch.equal(paged_range(pool, table[r], start, start + T)[0], x[r])
        assert paged_range(pool, table[r], start, start).shape == (1, 2, 0, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("T,start", [(5, 0), (33, 3), (70, 17), (2048, 1000)])
def test_prefill_write_waits_for_no_gpu(T, start):
    """A prompt piece's write at a host-int start, unaligned ends included, and the gather of
    the row's range queue their work without a host synchronisation (each used to wait for
    the GPU several times per layer: a boolean index and a host int made a tensor)."""
    from spade.kernels.paged import paged_range

    g = torch.Generator().manual_seed(T + start)
    pool, table = scatter_to_pool(torch.zeros(2, 2, start + T + 40, 8), 16, g)
    pool, table = pool.cuda(), table.cuda()
    x = torch.randn(2, 2, T, 8, generator=g).cuda()
    ref = pool.clone()
    paged_write(ref, table, x, torch.tensor(start, device="cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        paged_write(pool, table, x, start)
        got = paged_range(pool, table[1], start, start + T)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(pool.nan_to_num(0.5), ref.nan_to_num(0.5)) and torch.equal(got[0], x[1])

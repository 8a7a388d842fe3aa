"""stage_qkv: the pack-staging kernel equals its torch reference (exact copies)."""

from __future__ import annotations

import pytest
import torch

from spade.kernels.stage import stage_qkv_ref, stage_qkv_triton


@pytest.mark.parametrize("B,Hq,Hkv,D", [(1, 4, 4, 16), (3, 6, 2, 24), (2, 5, 1, 8)])  # MHA, GQA, MQA; D=24 pads
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_reference(B, Hq, Hkv, D, dtype, device):
    g = torch.Generator().manual_seed(B * 100 + Hq * 10 + Hkv)
    L, Bmax = 13, B + 2
    k_all = torch.randn(Bmax, Hkv, L, D, generator=g).to(dtype)
    v_all = torch.randn(Bmax, Hkv, L, D, generator=g).to(dtype)
    k, v = k_all[:B], v_all[:B]  # a batch slice of a larger static cache, as the fast path passes it
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    kv_lens = torch.randint(1, L + 1, (B,), generator=g)
    kv_lens[0] = L  # the last position
    if B > 1:
        kv_lens[1] = 0  # an empty row reads position 0
    want = stage_qkv_ref(q, k, v, kv_lens, torch.full((B, Hq + 2 * Hkv, D), float("nan"), dtype=dtype))
    got = stage_qkv_triton(q.to(device), k.to(device), v.to(device), kv_lens.to(device),
                           torch.full((B, Hq + 2 * Hkv, D), float("nan"), dtype=dtype, device=device)).cpu()
    assert torch.equal(got, want)
    pos = (kv_lens - 1).clamp(min=0)
    assert torch.equal(got[0, Hq], k[0, 0, pos[0]]) and torch.equal(got[-1, -1], v[-1, -1, pos[-1]])


def test_into_a_pack_buffer_slot_and_shape_errors(device):
    B, Hq, Hkv, D = 2, 4, 2, 8
    pack = torch.zeros(3, B, Hq + 2 * Hkv, D, device=device)  # [n layers, B, heads, D]: one slot per layer
    q, k, v = (torch.randn(B, Hq, D, device=device), torch.randn(B, Hkv, 5, D, device=device),
               torch.randn(B, Hkv, 5, D, device=device))
    lens = torch.tensor([5, 2], device=device)
    stage_qkv_triton(q, k, v, lens, pack[1])
    assert torch.equal(pack[1], stage_qkv_ref(q, k, v, lens, torch.empty_like(pack[1])))
    assert pack[0].abs().sum() == 0 and pack[2].abs().sum() == 0
    with pytest.raises(ValueError, match="out must be"):
        stage_qkv_triton(q, k, v, lens, torch.empty(B, Hq + Hkv, D, device=device))
    with pytest.raises(ValueError, match="kv_lens"):
        stage_qkv_triton(q, k, v, torch.tensor([5], device=device), pack[0])

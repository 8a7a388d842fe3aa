"""Selection bookkeeping (mask and attended counts) against a brute-force set."""

import pytest
import torch

from spade.policies.base import Selection


def _brute(sel, kv_lens, length):
    B, H, _ = sel.indices.shape
    out = torch.zeros(B, H, length, dtype=torch.bool)
    for b in range(B):
        s = 0 if sel.kv_start is None else int(sel.kv_start[b])
        n = int(kv_lens[b])
        sink_end = min(s + sel.n_sink, n)
        for h in range(H):
            keep = set(range(s, sink_end)) | set(range(max(n - sel.n_recent, sink_end), n))
            keep |= {int(i) for i in sel.indices[b, h] if i >= 0}
            for p in keep:
                out[b, h, p] = True
    return out


@pytest.mark.parametrize("seed", range(5))
def test_mask_and_counts_match_bruteforce(seed):
    g = torch.Generator().manual_seed(seed)
    B, H, L = 3, 2, 40
    kv_lens = torch.tensor([40, 23, 9])
    kv_start = torch.tensor([0, 3, 1])
    n_sink, n_recent = 2, 3
    idx = torch.full((B, H, 6), -1, dtype=torch.int32)
    for b in range(B):
        lo, hi = int(kv_start[b]) + n_sink, int(kv_lens[b]) - n_recent
        for h in range(H):
            cand = torch.randperm(max(hi - lo, 0), generator=g)[:4] + lo
            slots = torch.randperm(6, generator=g)[: len(cand)]
            idx[b, h, slots] = cand.to(torch.int32)
    sel = Selection(indices=idx, n_sink=n_sink, n_recent=n_recent, kv_start=kv_start)
    ref = _brute(sel, kv_lens, L)
    assert torch.equal(sel.to_mask(kv_lens, L), ref)
    assert torch.equal(sel.attended(kv_lens), ref.sum(-1))


def test_index_zero_survives_empty_slots():
    sel = Selection(indices=torch.tensor([[[-1, 0, -1, -1]]], dtype=torch.int32))
    assert sel.to_mask(torch.tensor([5]), 5)[0, 0].tolist() == [True, False, False, False, False]

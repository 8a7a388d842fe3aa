"""Re-rank of candidates with the true query (``spade.kernels.rerank``).

``_expected`` is a float64 loop over (b, KV head) written from the module docstring
(scores over the valid candidates only, the best ``keep``, ties to the lower slot,
output in slot order): the torch reference must equal it, and the Triton kernel must
equal the reference wherever the keep-th and (keep+1)-th scores are apart by more than
the products' rounding; near a tie the two may pick either, so everywhere the kept
sets must carry the same total score (QU's "compare what is stable").
"""

from __future__ import annotations

import pytest
import torch

from spade import kernels
from spade.kernels import rerank as R

HEADS = [(4, 4), (4, 2), (6, 1)]  # MHA, GQA, MQA (G = 6: a group that is not a power of two)
REDUCES = ["sum_softmax", "sum_logits", "max_logits"]


def _scores64(q, k, cand, reduce, scale=None):
    """float64 group scores [B, Hkv, M] of the candidates (-inf at -1 slots), by loops."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    out = torch.full(cand.shape, float("-inf"), dtype=torch.float64)
    qd, kd = q.double(), k.double()
    for b in range(B):
        for h in range(Hkv):
            slots = [j for j in range(cand.shape[2]) if int(cand[b, h, j]) >= 0]
            if not slots:
                continue
            pos = torch.tensor([int(cand[b, h, j]) for j in slots])
            lg = qd[b, h * G:(h + 1) * G] @ kd[b, h, pos].T * scale  # [G, n]
            if reduce == "sum_logits":
                s = lg.sum(0)
            elif reduce == "max_logits":
                s = lg.max(0).values
            else:
                s = torch.softmax(lg, dim=-1).sum(0)
            for i, j in enumerate(slots):
                out[b, h, j] = s[i]
    return out


def _expected(q, k, cand, keep, reduce, scale=None):
    s = _scores64(q, k, cand, reduce, scale)
    B, H, M = cand.shape
    out = torch.full((B, H, keep), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            valid = [j for j in range(M) if int(cand[b, h, j]) >= 0]
            best = sorted(valid, key=lambda j: (-float(s[b, h, j]), j))[:keep]
            kept = [int(cand[b, h, j]) for j in sorted(best)]
            out[b, h, :len(kept)] = torch.tensor(kept, dtype=torch.int32)
    return out


def _inputs(B, Hq, Hkv, D, L, M, holes=True, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, L, D, generator=g).to(dtype)
    cand = torch.stack([torch.stack([torch.randperm(L, generator=g)[:M] for _ in range(Hkv)]) for _ in range(B)])
    cand = cand.to(torch.int32)
    if holes and M > 2:
        cand[0, 0, 1] = -1  # empty slots anywhere in the list
        cand[-1, -1, M - 1] = -1
    return q.to(device), k.to(device), cand.to(device)


def _check_stable(got, want, q, k, cand, keep, reduce):
    """Same count of kept tokens, no duplicates, all candidates, slot order, and the same
    total score; equal lists where the cut is not a near-tie."""
    s = _scores64(q.cpu(), k.cpu(), cand.cpu(), reduce)
    got, want, c = got.cpu(), want.cpu(), cand.cpu()
    assert ((got >= 0).sum(-1) == (want >= 0).sum(-1)).all()
    B, H, M = c.shape
    for b in range(B):
        for h in range(H):
            slot_of = {int(c[b, h, j]): j for j in range(M) if int(c[b, h, j]) >= 0}
            g = [int(x) for x in got[b, h] if int(x) >= 0]
            w = [int(x) for x in want[b, h] if int(x) >= 0]
            assert len(set(g)) == len(g) and all(p in slot_of for p in g)
            assert [slot_of[p] for p in g] == sorted(slot_of[p] for p in g)  # candidate order
            sg = sum(float(s[b, h, slot_of[p]]) for p in g)
            sw = sum(float(s[b, h, slot_of[p]]) for p in w)
            assert abs(sg - sw) <= 1e-5 * max(1.0, abs(sw))
            ranked = sorted((float(s[b, h, j]) for j in slot_of.values()), reverse=True)
            if len(ranked) > keep and ranked[keep - 1] - ranked[keep] > 1e-4 * max(1.0, abs(ranked[keep])):
                assert g == w


@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("Hq,Hkv", HEADS)
def test_reference_matches_the_loop(reduce, Hq, Hkv):
    q, k, cand = _inputs(2, Hq, Hkv, 16, 41, 13)
    for keep in (1, 5, 13, 20):
        assert torch.equal(R.rerank_select_ref(q, k, cand, keep, reduce=reduce), _expected(q, k, cand, keep, reduce))


# (the interpreter runs a program's 32 bisection sweeps op by op: a few cases, each
# shape with its own head layout and reduction, rather than their full product)
@pytest.mark.parametrize("B,Hq,Hkv,L,M,D,reduce", [
    (1, 4, 4, 7, 7, 16, "sum_softmax"),    # B=1, MHA, every position a candidate
    (2, 4, 2, 37, 23, 8, "sum_logits"),     # GQA, odd lengths
    (2, 6, 1, 37, 23, 8, "max_logits"),     # MQA, a group of 6
    (2, 4, 2, 150, 70, 16, "sum_softmax"),  # candidates over several tiles
])
def test_triton_matches_reference(device, B, Hq, Hkv, L, M, D, reduce):
    q, k, cand = _inputs(B, Hq, Hkv, D, L, M, device=device, seed=B * 100 + M)
    for keep in (1, M // 2, M + 3):  # K = 1, a real cut, keep every candidate (m K >= context)
        want = R.rerank_select_ref(q, k, cand, keep, reduce=reduce)
        got = R.rerank_select_triton(q, k, cand, keep, reduce=reduce)
        assert got.shape == (B, Hkv, keep) and got.dtype == torch.int32
        _check_stable(got, want, q, k, cand, keep, reduce)


@pytest.mark.parametrize("reduce", ["sum_softmax", "sum_logits"])
def test_triton_splits_the_candidates(device, reduce, monkeypatch):
    """Small tiles and chunks: the candidates of a row are scored by several programs and
    the select kernel merges their softmax statistics; the same kept sets."""
    monkeypatch.setitem(R.RERANK_CONFIG, "BLOCK_M", 16)
    monkeypatch.setitem(R.RERANK_CONFIG, "MIN_CHUNK", 16)
    monkeypatch.setitem(R.RERANK_CONFIG, "SELECT_BLOCK", 32)
    B, Hq, Hkv, L, M, D = 2, 6, 2, 90, 61, 16
    assert R._config(M, B * Hkv, torch.device(device))["NSPLIT"] > 1
    q, k, cand = _inputs(B, Hq, Hkv, D, L, M, device=device, seed=9)
    for keep in (1, 20):
        want = R.rerank_select_ref(q, k, cand, keep, reduce=reduce)
        _check_stable(R.rerank_select_triton(q, k, cand, keep, reduce=reduce), want, q, k, cand, keep, reduce)


# the select's paths, forced through RERANK_CONFIG: (overrides, fused, rows in registers)
PATHS = {
    "fused-registers": (dict(FUSE=True), True, True),
    "split-registers": (dict(FUSE=False, BLOCK_M=16, MIN_CHUNK=16), False, True),
    "split-tiled": (dict(FUSE=False, BLOCK_M=16, MIN_CHUNK=16, SELECT_MAX=8, SELECT_BLOCK=8), False, False),
    "fused-tiled": (dict(FUSE=True, SELECT_MAX=32, SELECT_BLOCK=32), True, False),
}


def _force(monkeypatch, path, M, rows, device):
    over, fused, one_tile = PATHS[path]
    for key, val in over.items():
        monkeypatch.setitem(R.RERANK_CONFIG, key, val)
    cfg = R._config(M, rows, torch.device(device))
    assert (cfg["FUSED"], cfg["ONE_TILE"]) == (fused, one_tile)
    return cfg


@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("path", list(PATHS))
def test_every_select_path(device, path, reduce, monkeypatch):
    """Fused or not, the row in registers or swept in tiles: the same kept sets, for
    every reduction (odd M over several select tiles, GQA with G = 3, a short row)."""
    B, Hq, Hkv, L, M, D = 2, 6, 2, 90, 61, 16
    cfg = _force(monkeypatch, path, M, B * Hkv, device)
    assert cfg["FUSED"] or cfg["NSPLIT"] > 1  # unfused paths merge several chunks' statistics
    q, k, cand = _inputs(B, Hq, Hkv, D, L, M, device=device, seed=11)
    cand[1, 1, 40:] = -1  # fewer valid candidates than keep below in one row
    for keep in (1, 30, M):
        want = R.rerank_select_ref(q, k, cand, keep, reduce=reduce)
        _check_stable(R.rerank_select_triton(q, k, cand, keep, reduce=reduce), want, q, k, cand, keep, reduce)


@pytest.mark.parametrize("M,one_tile", [(3001, True), (5000, False)])
def test_large_candidate_lists(device, M, one_tile):
    """m K_mid at a real model's size: 3001 candidates selected in registers, 5000 past
    the interpreter's SELECT_MAX (8192 on GPU) swept in tiles; the default launch."""
    B, Hq, Hkv, L, D = 1, 2, 1, M + 700, 16
    # (on a GPU SELECT_MAX is 8192: both lists fit in registers there)
    assert R._config(M, B * Hkv, torch.device(device))["ONE_TILE"] == (one_tile or torch.device(device).type == "cuda")
    q, k, cand = _inputs(B, Hq, Hkv, D, L, M, device=device, seed=M)
    for keep in (1, M // 3):
        want = R.rerank_select_ref(q, k, cand, keep)
        _check_stable(R.rerank_select_triton(q, k, cand, keep), want, q, k, cand, keep, "sum_softmax")


def test_unknown_config_key_is_refused(monkeypatch):
    monkeypatch.setitem(R.RERANK_CONFIG, "BLOCK", 64)
    with pytest.raises(ValueError, match="RERANK_CONFIG has unknown keys \\['BLOCK'\\]"):
        R._config(100, 4, torch.device("cpu"))


@pytest.mark.parametrize("path", ["fused-registers", "split-tiled"])
@pytest.mark.parametrize("reduce", ["sum_softmax", "max_logits"])
def test_ties_go_to_the_lower_slot(device, reduce, path, monkeypatch):
    """Identical keys give identical scores: the first ``keep`` valid slots win, in both."""
    B, Hq, Hkv, D, L, M = 1, 4, 2, 16, 20, 11
    q = torch.randn(B, Hq, D, device=device)
    k = torch.randn(B, Hkv, 1, D, device=device).expand(B, Hkv, L, D).contiguous()
    cand = torch.arange(L - 1, L - 1 - M, -1, dtype=torch.int32, device=device).expand(B, Hkv, M).contiguous()
    cand[:, :, 2] = -1
    _force(monkeypatch, path, M, B * Hkv, device)
    for keep in (1, 4, 12):
        want = _expected(q.cpu(), k.cpu(), cand.cpu(), keep, reduce)
        assert torch.equal(R.rerank_select_ref(q, k, cand, keep, reduce=reduce).cpu(), want)
        assert torch.equal(R.rerank_select_triton(q, k, cand, keep, reduce=reduce).cpu(), want)


def test_empty_rows_and_out_buffer(device):
    """A (row, head) with no valid candidate keeps nothing (-1 everywhere, no NaN from an
    empty softmax); ``out`` is written in place."""
    q, k, cand = _inputs(2, 4, 2, 16, 30, 9, device=device)
    cand[1, 0] = -1
    out = torch.full((2, 2, 4), 7, dtype=torch.int32, device=device)
    got = R.rerank_select_triton(q, k, cand, 4, out=out)
    assert got is out and (out[1, 0] == -1).all() and (out[0] >= 0).all()
    assert torch.equal(R.rerank_select_ref(q, k, cand, 4)[1, 0], out[1, 0])
    with pytest.raises(ValueError, match="out must be int32"):
        R.rerank_select_triton(q, k, cand, 3, out=out)
    with pytest.raises(ValueError, match="reduce must be one of"):
        R.rerank_select_ref(q, k, cand, 3, reduce="mean")


def test_rerank_decode_attention_attends_the_kept_set(device):
    """The two-stage attention equals plain sparse attention over the reference's kept
    indices (sinks and recent window disjoint from the candidates, as a Selection's)."""
    B, Hq, Hkv, D, L = 2, 4, 2, 16, 45
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, Hq, D, generator=g).to(device)
    k = torch.randn(B, Hkv, L, D, generator=g).to(device)
    v = torch.randn(B, Hkv, L, D, generator=g).to(device)
    kv_lens = torch.tensor([45, 33], device=device)
    n_sink, n_recent = 2, 3
    cand = torch.full((B, Hkv, 12), -1, dtype=torch.int32)
    for b, n in enumerate((45, 33)):
        for h in range(Hkv):
            mid = torch.randperm(n - n_sink - n_recent, generator=g)[:12 - b] + n_sink
            cand[b, h, :len(mid)] = mid.to(torch.int32)
    cand = cand.to(device)
    kept = R.rerank_select_ref(q, k, cand, 5)
    want = kernels.sparse_decode_attention(q, k, v, kv_lens, kept, n_sink=n_sink, n_recent=n_recent)
    got = kernels.rerank_decode_attention(q, k, v, kv_lens, cand, 5, n_sink=n_sink, n_recent=n_recent)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("over", [{}, dict(FUSE=True), dict(FUSE=False), dict(SELECT_MAX=1024)],
                         ids=["default", "fused", "split", "tiled"])
@pytest.mark.parametrize("M", [1000, 3960])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_keys_on_gpu(dtype, M, over, monkeypatch):
    """The Qwen3-8B head layout, M = 2 K_mid at K = 2048 (3960), every launch path."""
    for key, val in over.items():
        monkeypatch.setitem(R.RERANK_CONFIG, key, val)
    q, k, cand = _inputs(4, 32, 8, 128, 4096, M, dtype=dtype, device="cuda")
    keep = M // 2
    want = R.rerank_select_ref(q, k, cand, keep)
    got = R.rerank_select_triton(q, k, cand, keep)
    _check_stable(got, want, q.float(), k.float(), cand, keep, "sum_softmax")

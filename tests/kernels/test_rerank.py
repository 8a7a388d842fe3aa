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
    "wide": (dict(FUSE=False, BLOCK_M=16, MIN_CHUNK=16, SELECT_MAX=8, SELECT_BLOCK=8), False, False),
    "wide-fuse-asked": (dict(FUSE=True, BLOCK_M=16, MIN_CHUNK=16, SELECT_MAX=32, SELECT_BLOCK=32), False, False),
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
    """Fused or not, the row in registers or past them (the radix passes, then the
    emission): the same kept sets, for every reduction (odd M over several select
    tiles, GQA with G = 3, a short row)."""
    B, Hq, Hkv, L, M, D = 2, 6, 2, 90, 61, 16
    cfg = _force(monkeypatch, path, M, B * Hkv, device)
    assert cfg["FUSED"] or cfg["NSPLIT"] > 1  # unfused paths merge several chunks' statistics
    q, k, cand = _inputs(B, Hq, Hkv, D, L, M, device=device, seed=11)
    cand[1, 1, 40:] = -1  # fewer valid candidates than keep below in one row
    for keep in (1, 30, M):
        want = R.rerank_select_ref(q, k, cand, keep, reduce=reduce)
        _check_stable(R.rerank_select_triton(q, k, cand, keep, reduce=reduce), want, q, k, cand, keep, reduce)


@pytest.mark.parametrize("reduce", REDUCES)
def test_wide_path_keeps_what_the_registers_keep(device, reduce, monkeypatch):
    """The same rows through the registers path and, with SELECT_MAX lowered, through the
    wide path (scores in memory, the radix passes, the emission): identical kept lists,
    order and -1 padding included (the same fp32 scores; ties to the lower slot in both)."""
    B, Hq, Hkv, L, M, D = 2, 6, 2, 90, 61, 16
    q, k, cand = _inputs(B, Hq, Hkv, D, L, M, device=device, seed=31)
    cand[1, 1, 40:] = -1
    k[0, 0, 5:9] = k[0, 0, 4]  # exact ties among the candidates
    for keep in (1, 17, 45, M + 2):
        want = R.rerank_select_triton(q, k, cand, keep, reduce=reduce)
        with monkeypatch.context() as mp:
            mp.setitem(R.RERANK_CONFIG, "SELECT_MAX", 16)
            mp.setitem(R.RERANK_CONFIG, "SELECT_BLOCK", 16)
            assert not R._config(M, B * Hkv, torch.device(device))["ONE_TILE"]
            got = R.rerank_select_triton(q, k, cand, keep, reduce=reduce)
        assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("M,one_tile", [(3001, True), (5000, False)])
def test_large_candidate_lists(device, M, one_tile):
    """m K_mid at a real model's size: 3001 candidates selected in registers, 5000 past
    the interpreter's SELECT_MAX (8192 on GPU) through the wide path; the default launch."""
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


@pytest.mark.parametrize("path", ["fused-registers", "wide"])
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
    indices (sinks and recent window disjoint from the candidates, as a Selection's), on
    a contiguous cache and on paged K/V."""
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
    # the same over paged K/V (one shuffled table for both pools: the same seed)
    kp, table = _paged(k, 4, [45, 33], seed=2)
    vp, _ = _paged(v, 4, [45, 33], seed=2)
    got = kernels.rerank_decode_attention(q, kp, vp, kv_lens, cand, 5, n_sink=n_sink, n_recent=n_recent,
                                          block_table=table)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _paged(k, block_size, lens, seed):
    """(pool, table) of ``k`` under a random, non-monotone table over a shared pool;
    every slot no row owns is NaN (a key read through a wrong block shows)."""
    from spade.kernels.paged import scatter_to_pool

    pool, table = scatter_to_pool(k.cpu(), block_size, torch.Generator().manual_seed(seed), lens=lens)
    return pool.to(k.device), table.to(k.device)


def _cand_within(lens, Hkv, M, seed):
    """Candidates [B, Hkv, M] below each row's length (the slots a row owns), -1 holes."""
    g = torch.Generator().manual_seed(seed)
    cand = torch.full((len(lens), Hkv, M), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        for h in range(Hkv):
            pick = torch.randperm(n, generator=g)[:M]
            cand[b, h, :len(pick)] = pick.to(torch.int32)
    cand[0, 0, 1] = -1
    return cand


@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
@pytest.mark.parametrize("B,Hq,Hkv,reduce,path", [
    (1, 4, 4, "sum_softmax", {}),                                   # B=1, MHA
    (3, 4, 2, "sum_logits", dict(BLOCK_M=16, MIN_CHUNK=16, FUSE=False)),  # GQA, split chunks
    (2, 6, 1, "sum_softmax", dict(FUSE=True)),                       # MQA, a group of 6, fused
    (2, 4, 2, "max_logits", dict(SELECT_MAX=16, SELECT_BLOCK=16)),   # wide rows (radix passes)
])
def test_paged_pool_gives_the_contiguous_selection(device, block_size, B, Hq, Hkv, reduce, path, monkeypatch):
    """Keys in a shared pool under a random table: the kernel maps each candidate's
    logical position through the table and keeps exactly what it keeps on the
    contiguous cache (the same keys, the same products), for blocks of 1 to past a row."""
    for key, val in path.items():
        monkeypatch.setitem(R.RERANK_CONFIG, key, val)
    D, L, M = 16, 53, 29
    lens = [53, 41, 19][:B]
    q, k, _ = _inputs(B, Hq, Hkv, D, L, M, device=device, seed=block_size + B)
    cand = _cand_within(lens, Hkv, M, seed=block_size).to(device)
    pool, table = _paged(k, block_size, lens, seed=block_size * 7 + B)
    for keep in (1, 11, M + 2):
        want = R.rerank_select_triton(q, k, cand, keep, reduce=reduce)
        got = R.rerank_select_triton(q, pool, cand, keep, reduce=reduce, block_table=table)
        assert torch.equal(got.cpu(), want.cpu())
        ref = R.rerank_select_ref(q, pool, cand, keep, reduce=reduce, block_table=table)
        assert torch.equal(ref.cpu(), R.rerank_select_ref(q, k, cand, keep, reduce=reduce).cpu())
        _check_stable(got, ref, q, k, cand, keep, reduce)


def test_paged_table_is_read(device):
    """A wrong table (two of row 0's entries swapped) changes what is kept: the kernel
    reads keys through the table it is given, not by position."""
    q, k, _ = _inputs(1, 4, 2, 16, 64, 8, device=device, seed=5)
    cand = _cand_within([64], 2, 24, seed=5).to(device)
    pool, table = _paged(k, 8, [64], seed=9)
    right = R.rerank_select_triton(q, pool, cand, 6, block_table=table)
    swapped = table.clone()
    swapped[0, [0, 1, 2, 3]] = table[0, [3, 2, 1, 0]]
    wrong = R.rerank_select_triton(q, pool, cand, 6, block_table=swapped)
    assert torch.equal(wrong.cpu(), R.rerank_select_ref(q, pool, cand, 6, block_table=swapped).cpu())
    assert not torch.equal(wrong.cpu(), right.cpu())


def test_paged_inputs_are_checked(device):
    q, k, cand = _inputs(2, 4, 2, 16, 32, 8, device=device)
    pool, table = _paged(k, 8, [32, 32], seed=1)
    with pytest.raises(ValueError, match="block_table must be an int32"):
        R.rerank_select_triton(q, pool, cand, 3, block_table=table.long())
    with pytest.raises(ValueError, match="needs block_table="):
        R.rerank_select_triton(q, pool[:3], cand, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("over", [{}, dict(FUSE=True), dict(FUSE=False), dict(SELECT_MAX=1024)],
                         ids=["default", "fused", "split", "wide"])
@pytest.mark.parametrize("M", [1000, 3960, 15840])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_keys_on_gpu(dtype, M, over, monkeypatch):
    """The Qwen3-8B head layout, M = 2 K_mid and 8 K_mid at K = 2048 (3960, 15840: past
    SELECT_MAX, the wide path), every launch path."""
    for key, val in over.items():
        monkeypatch.setitem(R.RERANK_CONFIG, key, val)
    B = 4 if M <= 4096 else 1  # (the check walks every row's candidates in Python)
    q, k, cand = _inputs(B, 32, 8, 128, max(4096, M + 1000), M, dtype=dtype, device="cuda")
    keep = M // 2
    want = R.rerank_select_ref(q, k, cand, keep)
    got = R.rerank_select_triton(q, k, cand, keep)
    _check_stable(got, want, q.float(), k.float(), cand, keep, "sum_softmax")


@pytest.mark.gpu
@pytest.mark.parametrize("over", [{}, dict(FUSE=True), dict(FUSE=False)], ids=["default", "fused", "split"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_paged_half_keys_on_gpu(block_size, over, monkeypatch):
    """The Qwen3-8B head layout in bf16, M = 2 K_mid: the pool gives the contiguous cache's kept sets."""
    for key, val in over.items():
        monkeypatch.setitem(R.RERANK_CONFIG, key, val)
    q, k, cand = _inputs(4, 32, 8, 128, 4096, 3960, dtype=torch.bfloat16, device="cuda")
    pool, table = _paged(k, block_size, [4096] * 4, seed=block_size)
    want = R.rerank_select_triton(q, k, cand, 1980)
    assert torch.equal(R.rerank_select_triton(q, pool, cand, 1980, block_table=table), want)


_AOT_RERANK = r'''
import json
from spade.kernels import rerank as R
from tests.kernels.aot import loop_body, sm90_compile

Hkv, D, M = 8, 128, 3960
p, f, i = ("ptr", "bf16"), ("ptr", "fp32"), ("ptr", "i32")
out = {}
for paged in (False, True):
    bs = 16 if paged else 1
    common = dict(Q=p, K=p, CAND=i, LOGITS=f, SCORES=f, PART=f, BT=i, Hkv=Hkv, M=M, scale=("fp32", 0.1),
                  stride_qb=32 * D, stride_qh=D, stride_qd=1, stride_kb=Hkv * (bs if paged else 4096) * D,
                  stride_kh=(bs if paged else 4096) * D, stride_kl=D, stride_kd=1, stride_cb=Hkv * M,
                  stride_ch=M, stride_cm=1, stride_tb=2048 if paged else 0)
    cons = dict(G=4, G_PAD=16, D=D, BLOCK_D=D, BLOCK_M=64, REDUCE=2, UPCAST=False, IEEE=False, PAGED=paged,
                BLOCK_SIZE=bs, INTERPRET=False, PDL=False)
    k = sm90_compile(R._rerank_score_kernel, dict(common, CHUNK=512, NSPLIT=8), cons)
    fused = sm90_compile(R._rerank_fused_kernel, dict(common, OUT=i, KEEP=1980, stride_ob=Hkv * 1980,
                                                     stride_oh=1980, stride_ok=1),
                         dict(cons, BLOCK=4096, UNROLL_G=True), num_warps=16)
    copies = [loop_body(x.asm["ttgir"]).count("async_copy_global_to_local") for x in (k, fused)]
    out[str(paged)] = dict(copies=copies, smem=[k.metadata.shared, fused.metadata.shared])
print(json.dumps(out))
'''


def test_paged_rerank_builds_for_hopper():
    """The re-rank's scoring and fused kernels compile for sm_90 with the table, and the
    candidates' tile loop stays a pipeline of async copies: the table's entries one
    more stage between the candidate ids and the keys (a few hundred bytes of shared memory)."""
    from tests.kernels.aot import run_aot_script

    res = run_aot_script(_AOT_RERANK)
    paged, flat = res["True"], res["False"]
    assert flat["copies"][0] >= 2 and paged["copies"] == [c + 1 for c in flat["copies"]], res
    assert all(p - f <= 1024 for p, f in zip(paged["smem"], flat["smem"])), res

"""Decode attention over a paged KV cache (``block_table``): shared pools, shuffled tables.

Every case moves a fresh random contiguous cache into one pool shared by the batch
rows under a random, non-monotone block table (``scatter_to_pool``): the blocks a
row does not own, and the slots past its length, hold NaN, so a kernel that reads
one shows it. The paged Triton kernel must equal the contiguous Triton kernel on the
logical cache bit for bit (same tiles, same splits, same arithmetic: only addresses
differ), and both references (the paged torch reference and the float64 one of
``test_attention``) within the dtype's tolerance.
"""

from __future__ import annotations

import pytest
import torch

from spade import kernels
from spade.kernels import attention as A
from spade.kernels.paged import paged_to_contiguous, scatter_to_pool
from tests.kernels.test_attention import LSE_ATOL, TOL, _expected, _messy_middle, _middle_indices, _rel

CASES = [  # (B, (Hq, Hkv), D, lens, kv_start, block_size, k_mid | None, n_sink, n_recent, num_splits, dtype)
    (1, (4, 1), 16, [37], None, 16, None, 0, 0, None, torch.float32),  # MQA, B=1, dense
    (3, (4, 2), 16, [130, 7, 61], [0, 2, 17], 16, None, 0, 0, 3, torch.float32),  # GQA dense, kv_start
    (3, (4, 4), 16, [99, 61, 13], [3, 0, 1], 8, 120, 2, 0, 4, torch.float32),  # MHA, K >= context
    (2, (4, 2), 16, [131, 50], [0, 7], 32, 1, 1, 16, 1, torch.float32),  # K=1, one split
    (2, (6, 2), 16, [131, 1], None, 16, 33, 3, 5, 7, torch.bfloat16),  # G=3, a length-1 row, bf16
    (3, (4, 1), 24, [77, 40, 5], None, 4, 20, 4, 8, None, torch.float16),  # blocks smaller than a tile
    (2, (4, 2), 16, [50, 33], None, 7, None, 0, 0, 2, torch.float32),  # block size not a power of two
    (2, (4, 2), 16, [64, 64], None, 64, 30, 4, 8, 2, torch.float32),  # one tile per block
]


def _pools(k, v, bs, kv_lens, kv_start, seed):
    """K and V pools sharing one table (as a cache's layers do)."""
    B, Hkv, L, D = k.shape
    kv = torch.cat([k, v], dim=-1)  # one scatter for both, so their tables agree
    pool, table = scatter_to_pool(kv, bs, torch.Generator().manual_seed(seed), lens=kv_lens)
    if kv_start is not None:  # blocks wholly before kv_start: unowned, pointed at the poisoned block
        poisoned = int(table[0, -1]) if table.shape[1] * bs > int(kv_lens[0]) else None
        for b in range(B):
            for j in range(int(kv_start[b]) // bs):
                if poisoned is None:
                    pool[table[b, j]] = float("nan")
                else:
                    table[b, j] = poisoned
    return pool[..., :D].contiguous(), pool[..., D:].contiguous(), table


@pytest.mark.parametrize("case", range(len(CASES)))
def test_paged_equals_contiguous_and_references(case, device):
    _run_case(case, device)


@pytest.mark.parametrize("splits", [1, 3, 64])
def test_indexed_path_maps_one_tile_ahead_at_every_split(splits, device):
    """The indexed path maps each tile's slots one iteration ahead: a chunk of one tile,
    of several, and splits with nothing to read (64 splits of a short row) all give the
    contiguous kernel's output bit for bit, with poisoned blocks outside the rows."""
    gen = torch.Generator().manual_seed(7)
    B, Hq, Hkv, D, L, bs = 2, 4, 2, 16, 177, 8
    q = torch.randn(B, Hq, D, generator=gen).to(device)
    k, v = torch.randn(B, Hkv, L, D, generator=gen), torch.randn(B, Hkv, L, D, generator=gen)
    kv_lens, kv_start = torch.tensor([L, L - 3]), torch.tensor([0, 5])
    idx = torch.randint(-1, L, (B, Hkv, 70), generator=gen).to(device)
    k_pool, v_pool, table = _pools(k, v, bs, kv_lens, kv_start, seed=7)
    args = dict(n_sink=2, n_recent=3, kv_start=kv_start.to(device), num_splits=splits)
    out = A.sparse_decode_attention_triton(q, k_pool.to(device), v_pool.to(device), kv_lens.to(device), idx,
                                           block_table=table.to(device), **args)
    ref = A.sparse_decode_attention_triton(q, k.to(device), v.to(device), kv_lens.to(device), idx, **args)
    assert torch.isfinite(out).all()
    assert torch.equal(out, ref)


def _run_case(case, device):
    B, (Hq, Hkv), D, lens, start, bs, k_mid, n_sink, n_recent, splits, dtype = CASES[case]
    gen = torch.Generator().manual_seed(2000 + case)
    L = max(lens)
    q = torch.randn(B, Hq, D, generator=gen).to(device, dtype)
    k = torch.randn(B, Hkv, L, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, L, D, generator=gen).to(dtype)
    kv_lens = torch.tensor(lens)
    kv_start = None if start is None else torch.tensor(start)
    k_pool, v_pool, table = _pools(k, v, bs, kv_lens, kv_start, seed=case)
    k_pool, v_pool, table = k_pool.to(device), v_pool.to(device), table.to(device)
    assert torch.isnan(k_pool).any() and table.shape[0] == B
    idx = None
    if k_mid is not None:
        idx = _middle_indices(kv_lens, kv_start, Hkv, k_mid, n_sink, n_recent, gen=gen).to(device)
    kw = dict(n_sink=n_sink, n_recent=n_recent, return_lse=True, num_splits=splits,
              kv_start=None if kv_start is None else kv_start.to(device))
    kl = kv_lens.to(device)
    st_p = torch.zeros(2, dtype=torch.int64, device=device)
    st_c = torch.zeros(2, dtype=torch.int64, device=device)
    out, lse = A.sparse_decode_attention_triton(q, k_pool, v_pool, kl, idx, block_table=table, stats=st_p, **kw)
    # the logical cache: NaN past each length and in unowned blocks, as the pool holds them
    k_log, v_log = paged_to_contiguous(k_pool, table), paged_to_contiguous(v_pool, table)
    out_c, lse_c = A.sparse_decode_attention_triton(q, k_log, v_log, kl, idx, stats=st_c, **kw)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)  # only the addresses differ
    assert st_p.tolist() == st_c.tolist() and st_p[0] > 0
    assert not torch.isnan(out).any()
    exp_out, exp_lse = _expected(q, k, v, kv_lens, None if idx is None else idx.cpu(), n_sink=n_sink,
                                 n_recent=n_recent, kv_start=kv_start)
    kw.pop("num_splits")
    ref, ref_lse = A.sparse_decode_attention_ref(q, k_pool, v_pool, kl, idx, block_table=table, **kw)
    for o, l in ((out, lse), (ref, ref_lse)):
        assert o.dtype == dtype
        assert _rel(o, exp_out) < TOL[dtype], _rel(o, exp_out)
        fin = torch.isfinite(exp_lse)
        assert torch.equal(torch.isfinite(l.double().cpu()), fin)
        assert (l.double().cpu()[fin] - exp_lse[fin]).abs().max().item() < LSE_ATOL


def test_messy_indices_never_read_unowned_blocks(device):
    """Middle indices the kernel must ignore (sinks, recent, past kv_len, past the
    table, below -1) never reach a poisoned block: the output stays finite and equals
    the contiguous kernel's."""
    gen = torch.Generator().manual_seed(7)
    B, Hq, Hkv, D, bs = 3, 4, 2, 16, 8
    lens = torch.tensor([45, 9, 70])
    L = 70
    q = torch.randn(B, Hq, D, generator=gen).to(device)
    k, v = torch.randn(B, Hkv, L, D, generator=gen), torch.randn(B, Hkv, L, D, generator=gen)
    k_pool, v_pool, table = _pools(k, v, bs, lens, None, seed=3)
    idx = _messy_middle(lens, None, Hkv, 24, 2, 4, L, gen).to(device)
    kw = dict(n_sink=2, n_recent=4, num_splits=3)
    kl = lens.to(device)
    out = A.sparse_decode_attention_triton(q, k_pool.to(device), v_pool.to(device), kl, idx,
                                           block_table=table.to(device), **kw)
    out_c = A.sparse_decode_attention_triton(q, k.to(device), v.to(device), kl, idx, **kw)
    assert torch.isfinite(out).all() and torch.equal(out, out_c)


def test_public_dispatch_and_contiguous_special_case(device, monkeypatch):
    """``spade.kernels.sparse_decode_attention(block_table=...)`` reaches both
    implementations; the contiguous cache seen as a pool (num_blocks = B,
    block_size = L, table[b] = [b]) gives the unpaged result."""
    gen = torch.Generator().manual_seed(11)
    B, Hq, Hkv, L, D = 2, 4, 2, 29, 16
    q = torch.randn(B, Hq, D, generator=gen).to(device)
    k = torch.randn(B, Hkv, L, D, generator=gen).to(device)
    v = torch.randn(B, Hkv, L, D, generator=gen).to(device)
    kl = torch.tensor([29, 11], device=device)
    ident = torch.arange(B, dtype=torch.int32, device=device)[:, None]  # one block of L per row
    outs = {}
    for impl in ("torch", "triton"):
        monkeypatch.setenv("SPADE_KERNELS", impl)
        outs[impl] = kernels.sparse_decode_attention(q, k, v, kl, block_table=ident)
        assert torch.equal(outs[impl], kernels.sparse_decode_attention(q, k, v, kl))
    assert _rel(outs["triton"], outs["torch"].float()) < TOL[torch.float32]


def test_bad_block_tables_raise(device):
    q = torch.randn(2, 4, 16, device=device)
    pool = torch.randn(5, 2, 8, 16, device=device)
    kl = torch.tensor([8, 8], device=device)
    good = torch.zeros(2, 3, dtype=torch.int32, device=device)
    for bad, msg in ((good.long(), "int32"), (good[:1], r"\[B=2"), (good[:, :, None], "int32 tensor"),
                     (torch.zeros(3, 2, dtype=torch.int32, device=device).t(), "contiguous")):
        with pytest.raises(ValueError, match=msg):
            A.sparse_decode_attention_triton(q, pool, pool, kl, block_table=bad)
    with pytest.raises(ValueError, match="pools"):
        A.sparse_decode_attention_ref(q, pool[0], pool[0], kl, block_table=good)


_AOT_PAGED = r'''
import json
from spade.kernels import attention as A
from tests.kernels.aot import loop_body, sm90_compile, smem_buffers

def build(fn, args, cons, num_stages):
    k = sm90_compile(fn, args, cons, num_stages=num_stages)
    ttgir = k.asm["ttgir"]
    return dict(pipelined="async_copy_global_to_local" in ttgir, shared=k.metadata.shared,
                loads_in_loop=loop_body(ttgir, last=True).count("tt.load "), kv_buffers=smem_buffers(ttgir, "xbf16"))

out = {}
Hkv, G, D, KM, NB = 8, 4, 128, 1980, 2048
for has_idx in (True, False):
    for bs in (16, 64):
        p = ("ptr", "bf16")
        args = dict(Q=p, K=p, V=p, KV_LENS=("ptr", "i32"), KV_START=("ptr", "i32"), IDX=("ptr", "i32"),
                    O_PART=("ptr", "fp32"), LSE_PART=("ptr", "fp32"), OUT=p, LSE=("ptr", "fp32"), BT=("ptr", "i32"),
                    stride_qb=Hkv * G * D, stride_qh=D, stride_qd=1, stride_kb=Hkv * bs * D, stride_kh=bs * D,
                    stride_kl=D, stride_kd=1, stride_vb=Hkv * bs * D, stride_vh=bs * D, stride_vl=D, stride_vd=1,
                    stride_ib=Hkv * KM, stride_ih=KM, stride_ik=1, Hkv=Hkv, Hq=Hkv * G, K_MID=KM, N_SINK=4,
                    N_RECENT=64, NUM_SPLITS=6, qk_scale=("fp32", 0.1), COUNTER=("ptr", "i32"), STATS=("ptr", "i64"))
        # the launcher's config (_launch_config outside the interpreter): indexed 64 / 3, dense 128 / 2
        block_n, _, stages = (64, 4, 3) if has_idx else (128, 4, 2)
        out[f"{has_idx}_{bs}"] = build(A._decode_split_kernel, args, dict(
            G=G, G_PAD=16, D=D, D_PAD=D, BLOCK_N=block_n, MAX_BLOCKS=1 if not has_idx else 8, DIRECT=False,
            HAS_INDICES=has_idx, HAS_START=True, UPCAST=False, DOT_PREC="tf32", INTERPRET=False,
            FUSED_COMBINE=True, HAS_STATS=True, COUNT_CALL=True, PDL=False, PAGED=True, BLOCK_SIZE=bs,
            stride_tb=NB), stages)
print(json.dumps(out))
'''


def test_paged_kernel_builds_for_hopper_and_pipelines():
    """The paged kernel compiles for sm_90 at the launcher's configs and pipelines K/V
    through async copies into shared buffers (two each on the indexed path's three
    stages, one each on the dense path's two); the one other load in the innermost
    loop is the table's (the next tile's slots on the indexed path, this tile's on the
    dense path), and three programs per SM still fit in shared memory."""
    from tests.kernels.aot import run_aot_script

    res = run_aot_script(_AOT_PAGED)
    for name, r in res.items():
        indexed = name.startswith("True")
        assert r["pipelined"] and r["loads_in_loop"] == 1, (name, r)
        assert len(r["kv_buffers"]) == 2 and all(int(n) >= (2 if indexed else 1) for n in r["kv_buffers"]), (name, r)
        assert r["shared"] < 227 * 1024 // 3, (name, r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: GPU only")
def test_gpu_graph_replay_follows_the_table_in_place():
    """A CUDA graph captured over the ``BlockTable`` buffer reads whatever the table
    holds at replay: rows re-pointed at other blocks (holding the same tokens) and a
    row grown by one block give the results of a fresh call."""
    from spade.kvcache import BlockTable

    gen = torch.Generator().manual_seed(5)
    B, Hq, Hkv, D, bs, nb = 4, 32, 8, 128, 16, 64
    num_blocks = 2 * B * nb + 1
    k_pool = torch.randn(num_blocks, Hkv, bs, D, generator=gen).cuda().bfloat16()
    v_pool = torch.randn(num_blocks, Hkv, bs, D, generator=gen).cuda().bfloat16()
    q = torch.randn(B, Hq, D, generator=gen).cuda().bfloat16()
    kv_lens = torch.tensor([1000, 17, 640, 1023], dtype=torch.int32, device="cuda")
    idx = torch.randint(4, 900, (B, Hkv, 256), generator=gen).int().cuda()
    idx = torch.where(idx < kv_lens[:, None, None] - 64, idx, -1)
    table = BlockTable(B, nb, "cuda")
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    for b in range(B):
        table.set_row(b, perm[b * nb:(b + 1) * nb])
    tab = table.sync()
    kw = dict(n_sink=4, n_recent=64, block_table=tab)
    for i, indices in enumerate((idx, None)):
        A.sparse_decode_attention_triton(q, k_pool, v_pool, kv_lens, indices, **kw)  # compile, make counters
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = A.sparse_decode_attention_triton(q, k_pool, v_pool, kv_lens, indices, **kw)
        # move row 1's blocks elsewhere (copying their tokens) and re-point the table in place
        new = perm[(B + i) * nb:(B + i + 1) * nb]  # blocks row 1 never held
        old = table.host_row(1)
        k_pool[new] = k_pool[old]
        v_pool[new] = v_pool[old]
        k_pool[old] = float("nan")
        v_pool[old] = float("nan")
        table.set_row(1, new)
        table.sync()
        g.replay()
        fresh = A.sparse_decode_attention_triton(q, k_pool, v_pool, kv_lens, indices, **kw)
        torch.cuda.synchronize()
        # (the split-K combine's order may differ between launches: equal up to bf16 rounding)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), fresh.float(), rtol=2e-2, atol=2e-3)
        k_pool[old] = k_pool[new]  # back where they were, for the next pass
        v_pool[old] = v_pool[new]
        table.set_row(1, old)
        table.sync()

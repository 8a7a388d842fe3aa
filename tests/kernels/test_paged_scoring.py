"""Exact-key scoring over a paged cache (``group_scores`` / ``score_topk`` with
``block_table``): keys in one pool shared by the rows under a shuffled, non-monotone
table, NaN in every block a row does not own and past each row's length. The paged
kernel must give the contiguous kernel's scores bit for bit (same tiles and
arithmetic, only the key addresses differ) and the same selection, and agree with
the paged torch reference and the float64 scores of ``test_scoring``."""

from __future__ import annotations

import pytest
import torch

from spade import kernels
from spade.kernels import carry as C
from spade.kernels import scoring
from spade.kernels.paged import paged_to_contiguous, scatter_to_pool
from tests.kernels.test_scoring import TOL, _bounds, _check_topk, _scores64, _sel_sum

CASES = [  # (reduce, (Hq, Hkv), dtype, lens, kv_start, D, block_size, k_top)
    ("sum_logits", (4, 1), torch.float32, [37], [0], 16, 16, 1),  # B=1, MQA, K=1
    ("max_logits", (4, 2), torch.bfloat16, [130, 61, 7], [0, 2, 1], 16, 8, 20),  # GQA, odd lengths
    ("sum_softmax", (4, 4), torch.float32, [99, 40], [3, 0], 24, 5, 200),  # MHA, K >= candidates, odd block
    ("sum_softmax", (6, 2), torch.float16, [300, 129], [0, 4], 16, 32, 33),  # G=3, several chunks
]


def _paged_keys(case, device):
    reduce, (Hq, Hkv), dtype, lens, start, D, bs, k_top = CASES[case]
    gen = torch.Generator().manual_seed(500 + case)
    B, L = len(lens), max(lens)
    q = torch.randn(B, Hq, D, generator=gen).to(device, dtype)
    k = torch.randn(B, Hkv, L, D, generator=gen).to(dtype)
    kv_lens = torch.tensor(lens)
    pool, table = scatter_to_pool(k, bs, torch.Generator().manual_seed(case), lens=kv_lens)
    return q, k, pool.to(device), table.to(device), kv_lens.to(device), torch.tensor(start).to(device)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_paged_group_scores(case, device):
    reduce, _, dtype, *_ = CASES[case]
    q, k, pool, table, kv_lens, kv_start = _paged_keys(case, device)
    kw = dict(reduce=reduce, kv_start=kv_start)
    out = scoring.group_scores_triton(q, pool, kv_lens, block_table=table, **kw)
    out_c = scoring.group_scores_triton(q, paged_to_contiguous(pool, table), kv_lens, **kw)
    assert torch.equal(out, out_c)  # only the key addresses differ
    assert not torch.isnan(out).any()
    ref = scoring.group_scores_ref(q, pool, kv_lens, block_table=table, **kw)
    L = k.shape[2]
    assert out.shape[-1] >= L and torch.isneginf(out[..., L:]).all()  # the table's capacity past the longest row
    out, ref = out[..., :L], ref[..., :L]
    true = _scores64(q, k, reduce, kv_start.cpu(), kv_lens.cpu())
    fin = torch.isfinite(true)
    assert torch.equal(torch.isfinite(out.cpu()), fin) and torch.equal(torch.isfinite(ref.cpu()), fin)
    rtol, atol = TOL[dtype]
    for o in (out, ref):
        torch.testing.assert_close(o.cpu().double()[fin], true[fin], rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_paged_score_topk(case, device):
    reduce, _, _, _, _, _, _, k_top = CASES[case]
    q, k, pool, table, kv_lens, kv_start = _paged_keys(case, device)
    lo, hi = _bounds(kv_lens, kv_start, 2, 3)
    norm_lens = kv_lens if reduce == "sum_softmax" else None
    kw = dict(reduce=reduce, kv_lens=norm_lens, kv_start=kv_start)
    out = scoring.score_topk_triton(q, pool, lo, hi, k_top, block_table=table, **kw)
    out_c = scoring.score_topk_triton(q, paged_to_contiguous(pool, table), lo, hi, k_top, **kw)
    assert torch.equal(out.sort(-1).values, out_c.sort(-1).values)  # the same selection
    ref = scoring.score_topk_ref(q, pool, lo, hi, k_top, block_table=table, **kw)
    n_lo = torch.minimum(kv_start, lo) if norm_lens is not None else lo
    n_hi = torch.maximum(kv_lens, hi) if norm_lens is not None else hi
    true = _scores64(q, k, reduce, n_lo.cpu(), n_hi.cpu())
    _check_topk(out, true, lo.cpu(), hi.cpu(), k_top, atol=1e-3)
    torch.testing.assert_close(_sel_sum(out, true), _sel_sum(ref, true), rtol=1e-5, atol=1e-3)


def test_paged_scoring_dispatch_and_errors(device, monkeypatch):
    q, k, pool, table, kv_lens, kv_start = _paged_keys(0, device)
    lo, hi = _bounds(kv_lens, kv_start, 1, 1)
    for impl in ("torch", "triton"):
        monkeypatch.setenv("SPADE_KERNELS", impl)
        s = kernels.group_scores(q, pool, kv_lens, block_table=table)
        assert s.shape == (1, 1, table.shape[1] * pool.shape[2])
        idx = kernels.score_topk(q, pool, lo, hi, 4, block_table=table)
        assert idx.shape == (1, 1, 4) and (idx >= 0).all()
    with pytest.raises(ValueError, match="k_scale must have shape"):  # a pool's scales are a pool too
        scoring.score_topk_triton(q, pool.to(torch.int8), lo, hi, 4, block_table=table,
                                  k_scale=torch.ones(1, 1, table.shape[1] * pool.shape[2], device=device))


QUANT_CASES = [  # (keys, reduce, (Hq, Hkv), lens, kv_start, D, block_size, k_top)
    ("int4", "sum_softmax", (4, 2), [130, 61, 7], [0, 2, 1], 16, 8, 20),  # GQA, odd lengths, a 7-token row
    ("int4", "sum_logits", (4, 1), [37], [0], 16, 16, 1),  # B=1, MQA, K=1
    ("int8", "sum_softmax", (6, 2), [300, 129], [0, 4], 16, 5, 33),  # G=3, odd block, several chunks
    ("int8", "sum_logits", (4, 4), [99, 40], [3, 0], 24, 32, 200),  # MHA, K >= candidates
    ("int4", "max_logits", (4, 2), [70, 33], [1, 0], 16, 4, 9),  # the float tile's paged path
]


def _paged_quant(case, device, block_size=None):
    """A quantised copy (int8, or packed int4 with a smoothing fold) moved into a pool
    under a shuffled table, its scales into a pool of the same table: keys past a row's
    length 0xFF (int8: 127), scales there and in unowned blocks NaN. ``block_size``
    overrides the case's."""
    keys, reduce, (Hq, Hkv), lens, start, D, bs, k_top = QUANT_CASES[case]
    bs = block_size or bs
    gen = torch.Generator().manual_seed(900 + case)
    B, L = len(lens), max(lens)
    q = torch.randn(B, Hq, D, generator=gen)
    k = torch.randn(B, Hkv, L, D, generator=gen)
    if keys == "int4":
        kq, ks = kernels.quantize_keys_int4(k)
    else:
        kq, ks = kernels.quantize_keys(k)
    kv_lens = torch.tensor(lens)
    pool, table = scatter_to_pool(kq, bs, torch.Generator().manual_seed(case), lens=kv_lens,
                                  poison=0xFF if keys == "int4" else 127)
    spool, table2 = scatter_to_pool(ks[..., None], bs, torch.Generator().manual_seed(case), lens=kv_lens)
    assert torch.equal(table, table2)
    return (q.to(device), pool.to(device), spool[..., 0].to(device), table.to(device), kv_lens.to(device),
            torch.tensor(start).to(device))


@pytest.mark.parametrize("case", range(len(QUANT_CASES)))
def test_paged_quant_scores_equal_the_contiguous_copy(case, device, monkeypatch):
    """int8 / int4 copies in a pool: the paged kernels give the contiguous kernels' scores
    bit for bit (int8 tensor-core kernels; case 4 the float tile), the same selection with
    and without the threshold carry, and the paged reference agrees."""
    keys, reduce, _, _, _, _, _, k_top = QUANT_CASES[case]
    if case == 4:
        monkeypatch.setitem(scoring.GEMV_CONFIG, "int8_dot", False)
    q, pool, spool, table, kv_lens, kv_start = _paged_quant(case, device)
    kc = paged_to_contiguous(pool, table)
    sc = paged_to_contiguous(spool[..., None], table)[..., 0]
    kw = dict(reduce=reduce, kv_start=kv_start)
    out = scoring.group_scores_triton(q, pool, kv_lens, k_scale=spool, block_table=table, **kw)
    out_c = scoring.group_scores_triton(q, kc, kv_lens, k_scale=sc, **kw)
    assert torch.equal(out, out_c)  # only the addresses differ
    assert not torch.isnan(out).any()
    ref = scoring.group_scores_ref(q, pool, kv_lens, k_scale=spool, block_table=table, **kw)
    fin = torch.isfinite(out)
    assert torch.equal(torch.isfinite(ref), fin)
    torch.testing.assert_close(ref[fin], out[fin], rtol=1e-5, atol=1e-5)
    lo, hi = _bounds(kv_lens, kv_start, 2, 3)
    kw = dict(reduce=reduce, kv_lens=kv_lens if reduce == "sum_softmax" else None, kv_start=kv_start)
    want = scoring.score_topk_triton(q, kc, lo, hi, k_top, k_scale=sc, **kw).sort(-1).values
    got = scoring.score_topk_triton(q, pool, lo, hi, k_top, k_scale=spool, block_table=table, **kw)
    assert torch.equal(got.sort(-1).values, want)
    carry = C.new_carry(*q.shape[:1], pool.shape[1], device)
    for _ in range(2):  # the first call falls back, the second selects among its candidates
        got = scoring.score_topk_triton(q, pool, lo, hi, k_top, k_scale=spool, block_table=table, carry=carry, **kw)
        assert torch.equal(got.sort(-1).values, want)
    ref = scoring.score_topk_ref(q, pool, lo, hi, k_top, k_scale=spool, block_table=table, **kw)
    true = out_c.double() if reduce != "sum_softmax" else scoring.group_scores_ref(
        q, kc, kv_lens, k_scale=sc, **dict(reduce=reduce, kv_start=kv_start)).double()
    torch.testing.assert_close(_sel_sum(ref, true.cpu()), _sel_sum(want, true.cpu()), rtol=1e-5, atol=1e-4)


def test_paged_scoring_maps_the_table_in_several_rounds(device, monkeypatch):
    """One tile of slots mapped per round (``PAGED_TILES_MAX = 1``): the same scores."""
    q, k, pool, table, kv_lens, kv_start = _paged_keys(3, device)
    want = scoring.group_scores_triton(q, paged_to_contiguous(pool, table), kv_lens, reduce="sum_logits")
    monkeypatch.setattr(scoring, "PAGED_TILES_MAX", 1)
    assert torch.equal(scoring.group_scores_triton(q, pool, kv_lens, reduce="sum_logits", block_table=table), want)


_AOT_SCORE = r'''
import json
from spade.kernels import scoring as S
from tests.kernels.aot import loop_body, sm90_compile, smem_buffers

def build(fn, args, cons):
    k = sm90_compile(fn, args, cons)
    ttgir = k.asm["ttgir"]
    return dict(pipelined="async_copy_global_to_local" in ttgir,
                loads_in_loop=loop_body(ttgir, last=True).count("tt.load "), k_buffers=smem_buffers(ttgir))

L, Hkv, D = 32768, 8, 128
p, f, i = ("ptr", "bf16"), ("ptr", "fp32"), ("ptr", "i32")
out = {}
for paged in (False, True):
    for bs in ((16, 64) if paged else (L,)):
        args = dict(q_ptr=p, k_ptr=p, ks_ptr=f, out_ptr=f, stats_ptr=f, hist_ptr=i, lo_ptr=i, hi_ptr=i, carry_ptr=f,
                    cand_ptr=i, NW=4, stride_qb=32 * D, stride_qh=D, stride_qd=1, stride_kb=Hkv * bs * D,
                    stride_kh=bs * D, stride_kl=D, stride_kd=1, stride_sb=0, stride_sh=0, stride_sl=0, L=L,
                    CHUNK=1024, N_CHUNKS=32, scale=("fp32", 0.1))
        cons = dict(HKV=Hkv, G=4, G_PAD=16, D=D, BLOCK_D=D, BLOCK_L=64, REDUCE=0, FULL_ROW=False, HIST=True,
                    UPCAST=False, IEEE=False, KINT8=False, LANE_STATS=False, INTERPRET=False, KINT4=False)
        if paged:
            args["BT"] = i
            cons.update(PAGED=True, BLOCK_SIZE=bs, stride_tb=2048, PAGED_TILES=16)
        out[f"{paged}_{bs}"] = build(S._score_kernel, args, cons)
print(json.dumps(out))
'''


def test_paged_scoring_builds_for_hopper_and_pipelines():
    """The paged scoring kernel compiles for sm_90 with the contiguous kernel's key
    pipelining: keys through async copies with as many buffers, and no other load in
    the innermost loop (slots are mapped through the table before it)."""
    from tests.kernels.aot import run_aot_script

    res = run_aot_script(_AOT_SCORE)
    contiguous = res.pop(f"False_{32768}")
    assert contiguous["pipelined"]
    for name, r in res.items():
        assert r["pipelined"] and r["k_buffers"] == contiguous["k_buffers"], (name, r, contiguous)
        assert r["loads_in_loop"] == contiguous["loads_in_loop"], (name, r, contiguous)


_LAUNCH_OPTIONS = {"num_warps", "num_stages", "launch_pdl", "PDL"}


def test_paged_quant_launches_pass_only_kernel_arguments(device, monkeypatch):
    """Every keyword a paged quantised scoring launch sends is one of its kernel's
    arguments (or a launch option): the interpreter ignores unknown ones, a GPU build
    refuses them (``PAGED_TILES`` once reached the int8 tensor-core logits kernel)."""
    seen = []

    class Checked:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def launch(*args, **kw):
                unknown = set(kw) - set(self.fn.arg_names) - _LAUNCH_OPTIONS
                assert not unknown, (self.fn.__name__, unknown)
                seen.append(self.fn.__name__)
                return self.fn[grid](*args, **kw)
            return launch

    for name in ("_score_kernel", "_i8dot_score_kernel", "_i8dot_logits_kernel", "_softmax_finalize_kernel"):
        monkeypatch.setattr(scoring, name, Checked(getattr(scoring, name)))
    for case in range(len(QUANT_CASES)):
        keys, reduce, _, _, _, _, _, k_top = QUANT_CASES[case]
        q, pool, spool, table, kv_lens, kv_start = _paged_quant(case, device)
        lo, hi = _bounds(kv_lens, kv_start, 2, 3)
        norm = kv_lens if reduce == "sum_softmax" else None
        for carry in (None, C.new_carry(q.shape[0], pool.shape[1], device)):
            scoring.score_topk_triton(q, pool, lo, hi, k_top, k_scale=spool, block_table=table, reduce=reduce,
                                      kv_lens=norm, kv_start=kv_start, carry=carry)
    assert {"_i8dot_score_kernel", "_i8dot_logits_kernel", "_score_kernel"} <= set(seen)


@pytest.mark.parametrize("case,block_size", [(0, None), (1, None), (2, None), (3, None), (0, 64), (3, 64)])
def test_paged_quant_maps_the_table_in_groups_of_tiles(case, block_size, device, monkeypatch):
    """The int8 tensor-core kernels map the table for groups of key tiles before the loop
    that loads keys: with 32-key tiles (several per chunk), groups of 16, 2 and 1 tiles
    (a chunk's last group partial) give the contiguous copy's scores bit for bit, for
    blocks that divide a tile (block ids: 8, 16, 32), do not (slots: 5) and span
    several tiles (slots: 64)."""
    keys, reduce, _, _, _, _, _, k_top = QUANT_CASES[case]
    q, pool, spool, table, kv_lens, kv_start = _paged_quant(case, device, block_size)
    kc = paged_to_contiguous(pool, table)
    sc = paged_to_contiguous(spool[..., None], table)[..., 0]
    monkeypatch.setitem(scoring.GEMV_CONFIG, "BLOCK_L", 32)
    monkeypatch.setitem(scoring.SCORE_CONFIG, "BLOCK_L", 32)
    for cfg in (scoring.GEMV_CONFIG, scoring.SCORE_CONFIG):
        monkeypatch.setitem(cfg, "MIN_CHUNK", 96)  # three tiles per chunk
    kw = dict(reduce=reduce, kv_start=kv_start)
    want = scoring.group_scores_triton(q, kc, kv_lens, k_scale=sc, **kw)
    for tiles in (16, 2, 1):
        monkeypatch.setattr(scoring, "PAGED_TILES_MAX", tiles)
        got = scoring.group_scores_triton(q, pool, kv_lens, k_scale=spool, block_table=table, **kw)
        assert torch.equal(got, want), (tiles, (got - want).abs().nan_to_num().max())


_AOT_I8DOT = r'''
import json
from spade.kernels import scoring as S
from tests.kernels.aot import loop_body, sm90_compile, smem_buffers

def build(fn, args, cons, **kw):
    t = sm90_compile(fn, args, cons, **kw).asm["ttgir"]
    return dict(dots=t.count("tt.dot") + t.count("warp_group_dot"), pipelined="async_copy_global_to_local" in t,
                loads_in_loop=loop_body(t, last=True).count("tt.load "), k_buffers=smem_buffers(t))

L, Hkv, Dk = 32768, 8, 64  # int4: the packed row's 64 bytes
p, f, i = ("ptr", "u8"), ("ptr", "fp32"), ("ptr", "i32")
out = {}
for paged in (False, True):
    bs = 16 if paged else L
    common = dict(q_ptr=("ptr", "bf16"), k_ptr=p, ks_ptr=f, out_ptr=f, lo_ptr=i, hi_ptr=i,
                  stride_qb=32 * 128, stride_qh=128, stride_qd=1, stride_kb=Hkv * bs * Dk, stride_kh=bs * Dk,
                  stride_kl=Dk, stride_kd=1, stride_sb=Hkv * bs, stride_sh=bs, stride_sl=1, L=L, CHUNK=2048,
                  scale=("fp32", 0.1))
    cons = dict(HKV=Hkv, D=Dk, BLOCK_D=Dk, INTERPRET=False, KINT4=True, ASM4=True)
    if paged:
        common["BT"] = i
        cons.update(PAGED=True, BLOCK_SIZE=bs, stride_tb=2048, PAGED_TILES=8)
    out[f"logits_{paged}"] = build(S._i8dot_logits_kernel, dict(common, stats_ptr=f, N_CHUNKS=32),
                                   dict(cons, G=4, GH=4, BLOCK_L=256))
    out[f"score_{paged}"] = build(S._i8dot_score_kernel, dict(common, hist_ptr=i, carry_ptr=f, cand_ptr=i, NW=4),
                                  dict(cons, G=4, G_PAD=4, BLOCK_L=256, FULL_ROW=False, HIST=True, CARRY=True),
                                  num_warps=8)
    # four tokens per MMA row (PACK): r = 32 channels, rows of 16 bytes
    pk = dict(common, hist_ptr=i, carry_ptr=f, cand_ptr=i, NW=4, stride_kb=Hkv * bs * 16, stride_kh=bs * 16,
              stride_kl=16)
    out[f"pack_{paged}"] = build(S._i8dot_score_kernel, pk, dict(cons, D=16, BLOCK_D=64, PACK=4, G=4, G_PAD=4,
                                 BLOCK_L=512, FULL_ROW=False, HIST=False, CARRY=True), num_warps=4)
print(json.dumps(out))
'''


def test_paged_int8_dot_kernels_build_for_hopper_and_pipeline():
    """The int8 tensor-core scoring kernels compile for sm_90 with a block table (the
    interpreter accepts code the compiler rejects), with the contiguous kernels' dots and
    key pipelining: as many key buffers, and no load but the keys' and scales' in the
    innermost loop (mapping each tile through the table inside the loop left one buffer);
    likewise the int4 scoring kernel with four tokens per MMA row."""
    from tests.kernels.aot import run_aot_script

    res = run_aot_script(_AOT_I8DOT)
    for name in ("logits", "score", "pack"):
        paged, contiguous = res[f"{name}_True"], res[f"{name}_False"]
        assert contiguous["dots"] > 0 and contiguous["pipelined"], res
        assert paged == contiguous, (name, paged, contiguous)

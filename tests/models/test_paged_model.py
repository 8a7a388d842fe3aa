"""FastModel on a paged KV cache (``model.block_size``) against the contiguous cache:
the same logits, token for token, in fp32 on the CPU — static batches (left padding,
chunked prefill, decode across block boundaries) and serving's slot mode (rows joining
in pieces at a shared cursor, leaving, their blocks freed)."""

from __future__ import annotations

import pytest
import torch

from spade.errors import ConfigError, ModelError
from spade.kvcache import NULL_BLOCK
from spade.models.fast import FastModel
from tests.models.test_fast import _one_cpu_thread, full_ctx, left_padded, perturbed_hf  # noqa: F401 (autouse)


def pair(hf, block_size: int, **kw):
    base = FastModel.from_hf_model(hf, **kw)
    paged = FastModel.from_hf_model(hf, block_size=block_size, **kw)
    return base, paged


@pytest.mark.parametrize("block_size", [1, 3, 8, 64])
@pytest.mark.parametrize("lengths", [[7], [9, 2, 5]])
def test_static_batch_paged_equals_contiguous(block_size, lengths):
    hf = perturbed_hf("tiny", seed=21)
    base, paged = pair(hf, block_size, max_batch=3, max_seq_len=40, prefill_chunk=4)
    assert paged.paged and not base.paged and paged.k_cache[0].shape[2] == block_size
    ids, mask = left_padded(lengths, base.vocab_size, torch.Generator().manual_seed(22))
    B = len(lengths)
    ca, cb = full_ctx(base, B), full_ctx(paged, B)
    la, lb = base.prefill(ids, mask, ca), paged.prefill(ids, mask, cb)
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
    for _ in range(12):  # crosses block boundaries for every block size but 64
        tok = la.argmax(-1)
        assert torch.equal(tok, lb.argmax(-1))
        la, lb = base.decode(tok, ca), paged.decode(tok, cb)
        torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
    used = sum(paged.kv_row_blocks(b) for b in range(3))
    assert used == B * -(-base.seq_len // block_size) == paged.kv_blocks_used()
    torch.testing.assert_close(cb.stats, ca.stats)


def test_fake_prefill_and_out_of_blocks():
    m = FastModel.from_config("tiny", max_batch=2, max_seq_len=32, block_size=4, kv_blocks=6)  # 5 usable
    m.fake_prefill(8, 2)  # 2 blocks per row
    assert m.kv_blocks_free() == 1
    ctx = full_ctx(m, 2)
    with pytest.raises(ModelError, match="out of KV blocks.*raise model.kv_blocks"):
        m.decode(torch.tensor([1, 2]), ctx)  # position 8 opens a third block in both rows: one is left
    with pytest.raises(ConfigError, match="model.kv_blocks .* needs a paged cache"):
        FastModel.from_config("tiny", max_batch=1, max_seq_len=8, kv_blocks=4)
    with pytest.raises(ConfigError, match="model.block_size must be >= 1"):
        FastModel.from_config("tiny", max_batch=1, max_seq_len=8, block_size=0)


def test_slot_rows_paged_equal_contiguous_and_free_blocks():
    """Slot mode: a row prefilled whole, one in pieces with decode steps between them, a
    leave and a new join; logits equal the contiguous model's, a row holds only the
    blocks of its own window, and a leave frees them all."""
    hf = perturbed_hf("tiny", seed=23)
    bs = 4
    base, paged = pair(hf, bs, max_batch=3, max_seq_len=64)
    g = torch.Generator().manual_seed(24)
    p0 = torch.randint(3, base.vocab_size, (10,), generator=g)
    p1 = torch.randint(3, base.vocab_size, (9,), generator=g)
    p2 = torch.randint(3, base.vocab_size, (5,), generator=g)
    ctxs = [full_ctx(m, 3) for m in (base, paged)]
    free0 = paged.kv_blocks_free()
    for m, ctx in zip((base, paged), ctxs):
        m.reset_slots(13)
        ctx.kv_start = torch.tensor([13 - 10, 13, 13], dtype=torch.int32)
    outs = [m.prefill_row(0, p0, lambda *a: None) for m in (base, paged)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    # row 0 owns [3, 13): blocks 0..3 of the table, none below its window... block 0 holds 3
    assert sorted(paged.blocks.rows[0]) == [0, 1, 2, 3] and paged.kv_row_blocks(1) == 0
    tok = torch.stack([outs[0].argmax(-1)[0], torch.tensor(1), torch.tensor(1)])
    # row 1 joins in three pieces (4, 4, 1) decoding from cursor 13 + 2 = 15: prompt at [6, 15)
    sizes, end, off = [4, 4, 1], 15, 0
    for i, c in enumerate(sizes):
        last = i == len(sizes) - 1
        for m in (base, paged):
            r = m.prefill_row(1, p1[off:off + c], lambda *a: None, first=end - 9, offset=off, last=last)
            if last:
                outs = outs[:1] + [r] if m is base else outs
                rl = r
        off += c
        if not last:
            la = base.decode(tok, ctxs[0])
            lb = paged.decode(tok, ctxs[1])
            torch.testing.assert_close(lb[0], la[0], rtol=1e-5, atol=1e-5)  # row 0 decodes on
            tok = torch.stack([la[0].argmax(), torch.tensor(1), torch.tensor(1)])
    torch.testing.assert_close(rl, outs[1], rtol=1e-5, atol=1e-5)
    for ctx in ctxs:
        ctx.kv_start[1] = end - 9
    tok[1] = rl.argmax(-1)[0]
    for step in range(10):
        if step == 4:  # row 0 leaves; row 2 joins whole at the cursor
            S = base.seq_len
            paged.kv_free(0)
            for m, ctx in zip((base, paged), ctxs):
                ctx.kv_start[0] = S
                ctx.kv_start[2] = S - 5
                r = m.prefill_row(2, p2, lambda *a: None)
            tok[2] = r.argmax(-1)[0]
        la, lb = base.decode(tok, ctxs[0]), paged.decode(tok, ctxs[1])
        live = [1, 2] if step >= 4 else [0, 1]
        torch.testing.assert_close(lb[live], la[live], rtol=1e-5, atol=1e-5)
        tok = la.argmax(-1)
    assert paged.table._host[0].eq(NULL_BLOCK).all()  # the left row points at the null block only
    for row in (1, 2):
        paged.kv_free(row)
    assert paged.kv_blocks_free() == free0 and paged.kv_blocks_used() == 0
    paged.kv_pool.check()


@pytest.mark.parametrize("sizes", [[11], [4, 4, 3]])
def test_a_join_writes_only_its_prompt_positions(sizes):
    """Every pool slot outside the joining prompt's positions keeps its (NaN) poison: a
    piece writes its own tokens and nothing past them, and the null block is untouched."""
    m = FastModel.from_config("tiny", max_batch=2, max_seq_len=64, block_size=4)
    for pool in m.k_cache + m.v_cache:
        pool.fill_(float("nan"))
    ctx = full_ctx(m, 2)
    T, n = sum(sizes), len(sizes)
    m.reset_slots(30)
    end = 30 + n - 1
    ids = torch.randint(3, m.vocab_size, (T,), generator=torch.Generator().manual_seed(25))
    off = 0
    for i, c in enumerate(sizes):
        m.prefill_row(1, ids[off:off + c], lambda *a: None, first=end - T, offset=off, last=i == n - 1)
        off += c
        if i < n - 1:  # the cursor moves one per piece; the step's dummy writes go to row 1's own next slots
            m.kv_map(1, end - T, end)
            ctx.kv_start = torch.tensor([m.seq_len, end - T], dtype=torch.int32)
            m.decode(torch.tensor([1, 1]), ctx)
    from spade.kernels.paged import paged_range

    for pool in m.k_cache + m.v_cache:
        row = paged_range(pool, m.table.tensor[1], (end - T) // 4 * 4, -(-end // 4) * 4)[0]  # its whole blocks
        lo = (end - T) % 4
        assert not row[:, lo:lo + T].isnan().any()  # the prompt, written
        assert row[:, :lo].isnan().all() and row[:, lo + T:].isnan().all()  # around it: untouched
        assert pool[0].isnan().all() or n > 1  # the null block (row 0 idle decodes write it in pieces)

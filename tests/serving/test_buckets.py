"""Batch-size buckets: every decode step is keyed by the bucket of rows in use (1, 2, 4,
..., max_batch), which sizes the attention's split plan (``SlotContext.rows``); joins and
leaves inside a bucket keep the step's graph key."""

from __future__ import annotations

import pytest

import spade
from spade.kernels import row_bucket

from .conftest import final, greedy, make_config, random_prompts, run, staggered


def test_row_bucket():
    assert [row_bucket(n, 16) for n in range(0, 18)] == [1, 1, 2, 4, 4] + [8] * 4 + [16] * 9
    assert [row_bucket(n, 6) for n in range(1, 8)] == [1, 2, 4, 4, 6, 6, 6]
    assert row_bucket(1, 1) == 1 and row_bucket(3, 3) == 3


@pytest.mark.parametrize("policy,topology", [("full", "inline"), ("asyncspade", "colocated")])
def test_steps_are_keyed_by_the_bucket_of_rows_in_use(policy, topology):
    """Two rounds of six staggered requests through four slots: each step's ``rows`` is the
    bucket of its active rows, steps of one bucket and mode share one graph key whichever
    rows are in use (so joins and leaves inside a bucket capture nothing new), and the
    tokens equal each request's alone run."""
    engine = spade.AsyncEngine(make_config(policy, topology, max_batch=4))
    batch = engine.batch
    seen = []
    decode = batch._decode

    def spy(tokens, mode):
        seen.append((sum(batch.active), batch.ctx.rows, mode, batch.ctx.graph_key()))
        return decode(tokens, mode)

    batch._decode = spy

    async def main():
        prompts = random_prompts(6, seed=7, lo=14, hi=20)
        ns = [14 + 3 * i for i in range(6)]
        together = await staggered(engine, [(i, p, n) for i, (p, n) in enumerate(zip(prompts, ns))], "r")
        first = len(seen)
        await staggered(engine, [(first + i, p, 12 + 2 * i) for i, p in
                                 enumerate(random_prompts(6, seed=8, lo=14, hi=20))], "s")
        alone = [await final(engine, p, greedy(n)) for p, n in zip(prompts, ns)]
        await engine.close()
        return together, alone, first

    together, alone, first = run(main())
    assert [t.token_ids for t in together] == [a.token_ids for a in alone]
    assert all(rows == row_bucket(n, 4) for n, rows, _, _ in seen)
    buckets = {rows for _, rows, _, _ in seen[:first]}
    assert {1, 4} <= buckets  # one row alone, and the batch full
    assert {3, 4} <= {n for n, rows, _, _ in seen if rows == 4}  # a join / leave inside a bucket
    if topology == "inline":  # one graph key per (bucket, mode), whichever rows are in use
        by = {}
        for _, rows, mode, key in seen:
            assert by.setdefault((rows, mode), key) == key  # (both rounds)
    else:  # the inference rank's key: (mode, bucket) then the selector's (selections there or not)
        assert all(key[:2] == (mode, rows) for _, rows, mode, key in seen)


@pytest.mark.parametrize("policy,topology", [("full", "inline"), ("quest", "inline"), ("asyncspade", "colocated")])
def test_idle_rows_attend_their_newest_token_only(policy, topology, monkeypatch):
    """A row with no request (never joined, or left long ago) attends one token at every
    step, however far the shared cursor has moved since; the running rows' tokens equal
    their alone runs."""
    from spade import kernels

    engine = spade.AsyncEngine(make_config(policy, topology, max_batch=4))
    batch = engine.batch
    windows = []  # per attention call: (idle rows, kv_lens - kv_start per row)
    real = kernels.sparse_decode_attention

    def spy(q, k, v, kv_lens, indices=None, **kw):
        start = kw.get("kv_start")
        if start is not None and kv_lens.shape[0] == batch.B:
            idle = [b for b in range(batch.B) if not batch.active[b]]
            windows.append((idle, (kv_lens.long() - start.long()).tolist()))
        return real(q, k, v, kv_lens, indices, **kw)

    monkeypatch.setattr(kernels, "sparse_decode_attention", spy)

    async def main():
        import asyncio

        long, short = random_prompts(2, seed=9, lo=14, hi=20)
        both = await asyncio.gather(final(engine, long, greedy(40), "long"), final(engine, short, greedy(4), "short"))
        alone = [await final(engine, p, greedy(n)) for p, n in ((long, 40), (short, 4))]
        await engine.close()
        return both, alone

    both, alone = run(main())
    assert [b.token_ids for b in both] == [a.token_ids for a in alone]
    late = [(idle, w) for idle, w in windows if len(idle) == 3]  # the short request gone, the long one decoding
    assert len(late) > 20
    for idle, w in late:
        assert all(w[b] == 1 for b in idle), (idle, w)
        assert max(w) >= 14  # the running row attends its whole sequence


@pytest.mark.parametrize("topology", ["colocated", "local"])
def test_the_cache_rank_hears_idle_windows_move(topology, monkeypatch):
    """While rows are idle the cache rank gets the ``kv_start`` vector every
    ``IDLE_WINDOW_REFRESH`` steps (a LEAVE with no other news), so its windows of rows that
    never joined follow the cursor, and the idle mask: its selection grids are planned for
    one row; the running request's tokens equal its alone run."""
    from spade.runtime.cache_rank import _Generation
    from spade.serving import async_slots

    monkeypatch.setattr(async_slots, "IDLE_WINDOW_REFRESH", 4)
    seen, masks = [], []
    orig = _Generation._leave

    def spy(self, kv_start, idle):
        orig(self, kv_start, idle)
        seen.append(self.state.kv_start.tolist())
        masks.append((self.state.idle.tolist(), self.plan))

    monkeypatch.setattr(_Generation, "_leave", spy)
    prompt = random_prompts(1, seed=11, lo=14, hi=18)[0]
    engine = spade.AsyncEngine(make_config("asyncspade", topology, max_batch=3))

    async def main():
        together = await final(engine, prompt, greedy(30), "r")
        stats = engine.stats()
        alone = await final(engine, prompt, greedy(30), "a")
        await engine.close()
        return together, alone, stats

    together, alone, stats = run(main())
    assert together.token_ids == alone.token_ids
    first = seen[: stats["cache_leaves"]]
    assert len(first) >= 30 // 4 - 1  # one LEAVE per 4 steps of the request's 30
    idle = [r[2] for r in first]  # row 2 never joins
    assert all(b - a == 4 for a, b in zip(idle, idle[1:])), idle
    # the request decodes in row 0 throughout the first generation's refreshes
    assert masks[: len(first) - 1] == [([False, True, True], 1)] * (len(first) - 1), masks

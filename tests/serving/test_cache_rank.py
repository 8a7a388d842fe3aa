"""AsyncEngine with asyncspade on a cache rank that follows the rows (colocated, local,
multiprocess over nccl (gloo on a CPU), ucx and nixl):
joined == alone == inline, joins while a selection is in flight, abort, a lost cache
rank, a soak."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

import spade
from spade.runtime.protocol import CacheHooks
from spade.transports import availability
from tests.runtime.conftest import free_port

from .conftest import final, greedy, make_config, random_prompts, run, serve_staggered, staggered

TOPOLOGIES = ("colocated", "local")
def _multiprocess(transport: str) -> list[str]:
    """Overrides of a cache process over ``transport`` on free ports (skips an unusable one)."""
    ok, why = availability()[transport]
    if not ok:
        pytest.skip(f"transport {transport!r} is not usable here: {why}")
    port = "master_port" if transport == "nccl" else "port"  # (nccl: gloo on a CPU)
    return [f"runtime.transport.name={transport}", f"runtime.transport.{port}={free_port()}"]


def _jobs(n: int, seed: int, *, lo: int = 3, hi: int = 22, first: int = 30, last_arrival: int = 24,
          out_hi: int = 24):
    """(arrival step, prompt, max_tokens): the first at once (a long prompt: the cursor
    starts past θ, so short prompts joining it are dense rows in mixed steps), the others
    at random steps."""
    g = torch.Generator().manual_seed(seed)
    prompts = random_prompts(n, seed=seed + 1, lo=lo, hi=hi)
    prompts[0] = random_prompts(1, seed=seed + 2, lo=first, hi=first)[0]
    return [(int(torch.randint(0, last_arrival, (1,), generator=g)) if i else 0, p,
             int(torch.randint(4, out_hi + 1, (1,), generator=g)) if i else out_hi) for i, p in enumerate(prompts)]


def _own_tasks(loop) -> list[str]:
    """The names of spade's own tasks on ``loop``: a transport library's (ucxx: a pending
    ``Endpoint.recv``, its request notifier) come and go with its traffic, so they are not
    counted as leaks."""
    root = os.path.dirname(spade.__file__)
    names = []
    for t in asyncio.all_tasks(loop):
        code = getattr(t.get_coro(), "cr_code", None)
        if code is not None and code.co_filename.startswith(root):
            names.append(code.co_qualname)
    return sorted(names)


_INLINE: dict[str, list[list[int]]] = {}


def _inline_alone(jobs, policy: str = "asyncspade", **kw) -> list[list[int]]:
    """Greedy tokens of each job alone through an inline engine (the reference). A pure
    function of its arguments: computed once per session for each (jobs, policy, kw), as
    the topologies of one test share their jobs."""
    key = repr((jobs, policy, sorted(kw.items())))
    if key not in _INLINE:
        engine = spade.AsyncEngine(make_config(policy, "inline", **kw))

        async def main():
            out = [(await final(engine, p, greedy(n), f"i{i}")).token_ids for i, (_, p, n) in enumerate(jobs)]
            await engine.close()
            return out

        _INLINE[key] = run(main())
    return [list(t) for t in _INLINE[key]]


def _together_then_alone(engine, jobs):
    """``jobs`` joining at their steps, then each alone through the same engine, which is
    closed after: (together, alone, the stats after the joined run)."""
    async def main():
        together = await staggered(engine, jobs)
        stats = engine.stats()
        alone = [await final(engine, p, greedy(n), f"a{i}") for i, (_, p, n) in enumerate(jobs)]
        await engine.close()
        return together, alone, stats

    return run(main())


def _generations(monkeypatch) -> list:
    """The in-process cache ranks' generations (``local``, ``colocated``), as they start."""
    from spade.runtime import cache_rank as CR

    gens, real = [], CR._Generation.run

    async def recorded(self):
        gens.append(self)
        return await real(self)

    monkeypatch.setattr(CR._Generation, "run", recorded)
    return gens


@pytest.mark.parametrize("topology", ["colocated", "local", "multiprocess", "local/paged", "multiprocess/paged"])
def test_return_modes_follow_joins(topology, monkeypatch):
    """Every ``runtime.return_mode`` in serving. ``delta``: the cache rank sends each layer's
    changed slots against what the inference rank holds; selections made before a join are
    applied all the same (the next delta builds on them) and the join waits for the
    re-selection. ``kv``: the cache rank gathers the selected K/V (colocated: from the
    inference rank's cache; else from a store of its own that joins fill, in pools of the
    cache's block count on a paged cache) and a sparse row attends them merged with its
    local sinks and window. Each request's greedy tokens equal the `indices` mode's and the
    request's alone."""
    from spade.runtime.selector import AsyncSelector

    jobs = _jobs(6, seed=9)
    topology, _, opt = topology.partition("/")
    extra = ["model.block_size=4", "model.kv_blocks=40"] if opt == "paged" else []
    gathered, real = [], AsyncSelector.attend_gathered
    monkeypatch.setattr(AsyncSelector, "attend_gathered", lambda self, *a, **k: gathered.append(1) or real(
        self, *a, **k))
    gens = _generations(monkeypatch)
    tokens, dropped, stores = {}, {}, {}
    for mode in ("indices", "delta", "kv"):
        gathered.clear()
        gens.clear()
        engine = spade.AsyncEngine(make_config("asyncspade", topology, extra=extra + [f"runtime.return_mode={mode}"]
                                               + (_multiprocess("nccl") if topology == "multiprocess" else [])))
        together, alone, stats = _together_then_alone(engine, jobs)
        assert stats["requests_finished"] == len(jobs) and stats["cache_peers_lost"] == 0
        assert stats["joins_into_running"] >= 2 and stats["sparse_steps"] > 0 and stats["join_resyncs"] > 0
        for (_, _, n), t, a in zip(jobs, together, alone):
            assert len(t.token_ids) == n and t.token_ids == a.token_ids
        assert bool(gathered) == (mode == "kv")  # the gathered K/V are what a kv-mode row attends
        tokens[mode] = [t.token_ids for t in together]
        dropped[mode] = stats["dropped_selections"]
        stores[mode] = {(tuple(g.kstore[0].shape), None if g.vstore is None else tuple(g.vstore[0].shape))
                        for g in gens if g.kstore is not None}
    assert tokens["delta"] == tokens["indices"] == tokens["kv"]
    assert dropped["delta"] == 0  # (delta applies the selections indices drops)
    if topology == "local":  # a store of its own: values only for kv; pools on a paged cache
        shape = (40, 2, 4, 32) if opt == "paged" else (3, 2, 96, 32)  # [kv_blocks, Hkv, block, D] / [B, Hkv, L, D]
        assert stores == {"indices": {(shape, None)}, "delta": {(shape, None)}, "kv": {(shape, shape)}}, stores


def test_kv_return_mode_reranks_the_gathered_candidates(monkeypatch):
    """``policy.rerank`` with the kv return mode in serving (a cache rank of its own, a
    paged cache): the candidates' K/V travel and the true query keeps the best of them
    (``kernels.rerank_select`` on the gathered keys); tokens equal the `indices` mode's
    re-rank over the cache and each request's alone."""
    from spade import kernels

    jobs = _jobs(5, seed=11)
    reranked, real = [], kernels.rerank_select
    monkeypatch.setattr(kernels, "rerank_select", lambda *a, **k: reranked.append(1) or real(*a, **k))
    tokens = {}
    for mode in ("indices", "kv"):
        reranked.clear()
        engine = spade.AsyncEngine(make_config("asyncspade", "local", extra=[
            "model.block_size=4", "policy.rerank=2", f"runtime.return_mode={mode}"]))
        together, alone, stats = _together_then_alone(engine, jobs)
        assert stats["joins_into_running"] >= 2 and stats["sparse_steps"] > 0
        assert reranked  # (kv: every sparse row attends the gathered K/V, so each re-rank read them)
        for (_, _, n), t, a in zip(jobs, together, alone):
            assert len(t.token_ids) == n and t.token_ids == a.token_ids
        tokens[mode] = [t.token_ids for t in together]
    assert tokens["kv"] == tokens["indices"]


@pytest.mark.parametrize("topology", TOPOLOGIES + ("multiprocess/nccl", "multiprocess/ucx", "multiprocess/nixl"))
def test_joined_rows_match_alone_and_inline(topology):
    """Requests of different prompt lengths and max_tokens join a running batch at random
    steps, past θ (the cache rank re-selects the step after each join): each one's greedy
    tokens equal the same request alone through the same engine, and the inline
    topology's."""
    jobs = _jobs(8, seed=5)
    topology, _, transport = topology.partition("/")
    engine = spade.AsyncEngine(make_config("asyncspade", topology,
                                           extra=_multiprocess(transport) if transport else None))

    async def main():
        together = await staggered(engine, jobs)
        stats = engine.stats()
        tasks = [_own_tasks(engine.batch.rt._loop)]
        alone = [await final(engine, p, greedy(n), f"a{i}") for i, (_, p, n) in enumerate(jobs)]
        tasks.append(_own_tasks(engine.batch.rt._loop))
        link = engine.batch.rt._link
        await engine.close()
        return together, alone, stats, tasks, link

    together, alone, stats, tasks, link = run(main())
    assert stats["slots_used"] == 0 and stats["requests_finished"] == len(jobs)
    assert stats["joins_into_running"] >= 2 and stats["sparse_steps"] > 0 and stats["mixed_steps"] > 0
    assert stats["join_resyncs"] > 0  # joins past θ: the cache rank's selections were made again
    assert stats["cache_peers_lost"] == 0
    # eight more epochs leave no task of spade's behind on the runtime's loop (what stays: the
    # open epoch's receiver and the link's own, an in-process cache rank's serve task)
    assert tasks[0] == tasks[1]
    assert link.closed and (link.proc is None or link.proc.poll() is not None)  # no cache process outlives close
    inline = _inline_alone(jobs)
    for (_, p, n), t, a, i in zip(jobs, together, alone, inline):
        assert len(t.token_ids) == n
        assert t.token_ids == a.token_ids == i


@pytest.mark.parametrize("topology", ["local", "multiprocess/nccl"])
def test_compressed_scoring_keys_need_no_key_store(topology, monkeypatch):
    """asyncspade with int4 scoring keys on a cache rank of its own: the cache rank keeps
    no exact-key store (a join's prompt keys go through one row-sized buffer into the
    policy's copy; each step's keys from its pack), and joined rows still equal alone
    and inline. Exact keys keep the store."""
    jobs = _jobs(6, seed=7)
    topology, _, transport = topology.partition("/")
    gens = _generations(monkeypatch)
    stores = {}
    for policy in ("asyncspade_int4", "asyncspade"):
        gens.clear()
        engine = spade.AsyncEngine(make_config(policy, topology, extra=_multiprocess(transport) if transport else None))
        together, alone, stats = _together_then_alone(engine, jobs)
        assert stats["joins_into_running"] >= 2 and stats["sparse_steps"] > 0 and stats["join_resyncs"] > 0
        if gens:
            stores[policy] = {(g.lean, g.kstore is not None, g.join_buf is not None) for g in gens}
        for (_, _, n), t, a, i in zip(jobs, together, alone, _inline_alone(jobs, policy)):
            assert len(t.token_ids) == n
            assert t.token_ids == a.token_ids == i
    if topology == "local":
        assert stores == {"asyncspade_int4": {(True, False, True)}, "asyncspade": {(False, True, False)}}


@pytest.mark.parametrize("topology", ["local", "multiprocess/nccl", "local/paged"])
def test_channel_subsets_follow_joins_on_a_cache_rank(topology):
    """``score_channels`` served (``channel_refresh: null``): each joining row's channels are
    chosen from its own prompt on the cache rank, kept beside the other rows' (and its int4
    copy, a pool under the cache rank's table on a paged cache), so joined rows equal alone
    and inline, and the first two equal ``spade run``'s static batch (which chooses each
    row's channels in one batch prefill, not through joins)."""
    from spade.static import StaticEngine

    jobs = _jobs(6, seed=11)
    topology, _, rest = topology.partition("/")
    paged = ["model.block_size=4", "model.kv_blocks=40"] if rest == "paged" else []
    extra = paged + (_multiprocess(rest) if rest and rest != "paged" else [])
    engine = spade.AsyncEngine(make_config("asyncspade_int4_c8", topology, extra=extra))
    together, alone, stats = _together_then_alone(engine, jobs)
    assert stats["joins_into_running"] >= 2 and stats["sparse_steps"] > 0 and stats["cache_peers_lost"] == 0
    for (_, _, n), t, a, i in zip(jobs, together, alone, _inline_alone(jobs, "asyncspade_int4_c8", extra=paged)):
        assert len(t.token_ids) == n
        assert t.token_ids == a.token_ids == i
    ref = StaticEngine(make_config("asyncspade_int4_c8", "inline", extra=paged))
    try:
        for (_, p, n), a in zip(jobs[:2], alone):
            assert ref.generate([p], max_new_tokens=n)[0].token_ids == a.token_ids
    finally:
        ref.close()


@pytest.mark.parametrize("topology", ["local", "multiprocess/nccl"])
def test_a_cache_rank_of_its_own_keeps_pool_copies_on_a_paged_cache(topology, monkeypatch):
    """Serving on a paged cache, asyncspade int4 on a cache rank of its own: the scoring
    copies are pools of the inference rank's block count (not max_batch x max_seq_len)
    under the cache rank's own table, whose blocks follow the rows (a join's prompt, one
    more as the cursor enters a block, all back at a leave), and joined rows equal alone
    and inline."""
    from spade.policies.asyncspade import AsyncSpadePolicy
    from spade.runtime import cache_rank as CR

    jobs = _jobs(6, seed=9, out_hi=20)
    topology, _, transport = topology.partition("/")
    paged = ["model.block_size=4", "model.kv_blocks=40"]  # 39 usable: a third under 3 rows x 96 positions
    gens = _generations(monkeypatch)
    stray, real_join = [], CR._Generation._join

    async def join(self, S, step, gen, rows, kv_start, idle):  # after a JOIN: the idle rows hold no copy blocks
        await real_join(self, S, step, gen, rows, kv_start, idle)
        stray.extend(r for r in range(self.B) if idle[r] and self.copy_blocks.held(r))

    shapes, real_keys = [], AsyncSpadePolicy._paged_keys
    monkeypatch.setattr(CR._Generation, "_join", join)
    monkeypatch.setattr(AsyncSpadePolicy, "_paged_keys", lambda self, st, *a: shapes.append(tuple(st.kq.shape))
                        or real_keys(self, st, *a))
    engine = spade.AsyncEngine(make_config("asyncspade_int4", topology, extra=paged + (
        _multiprocess(transport) if transport else [])))
    # alone one at a time after the joined run: each JOIN tells the cache rank of the rows that left since
    together, alone, stats = _together_then_alone(engine, jobs)
    assert stats["joins_into_running"] >= 2 and stats["sparse_steps"] > 0 and stats["join_resyncs"] > 0
    assert stats["cache_peers_lost"] == 0  # (a copy pool out of blocks would have killed the cache rank)
    if topology == "local":
        assert gens and all(g.copy_blocks is not None and g.kstore is None for g in gens) and not stray
        assert shapes and all(sh[0] == 40 and sh[2] == 4 for sh in shapes)  # [kv_blocks, Hkv, block_size, D/2]
        held = [(sum(1 for own in g.copy_blocks.rows if own), g.copy_blocks.pool.num_used) for g in gens]
        _, p_last, n_last = jobs[-1]
        # only the last request's row holds blocks: its window's, at most one partial block more
        assert held[-1][0] == 1 and 0 < held[-1][1] <= -(-(len(p_last) + n_last) // 4) + 1, held
    for (_, _, n), t, a, i in zip(jobs, together, alone, _inline_alone(jobs, "asyncspade_int4", extra=paged)):
        assert len(t.token_ids) == n
        assert t.token_ids == a.token_ids == i


@pytest.mark.parametrize("policy", ["asyncspade", "tova"])
def test_a_cache_rank_of_its_own_keeps_its_key_store_in_pools(policy, monkeypatch):
    """Policies that read exact keys (asyncspade with exact scoring keys, TOVA) on a cache
    rank of its own, serving on a paged cache: the rank's key store is pools of the
    inference rank's block count under a table of its own (a join writes its prompt, each
    step its key, through it), not max_batch x max_seq_len, and joined rows equal alone and
    inline."""
    jobs = _jobs(6, seed=9, out_hi=20)
    paged = ["model.block_size=4", "model.kv_blocks=40"]
    gens = _generations(monkeypatch)
    engine = spade.AsyncEngine(make_config(policy, "local", extra=paged))
    together, alone, stats = _together_then_alone(engine, jobs)
    assert stats["joins_into_running"] >= 2 and stats["sparse_steps"] > 0 and stats["cache_peers_lost"] == 0
    assert gens and all(g.copy_blocks is not None and g.vstore is None for g in gens)
    assert {tuple(x.shape) for g in gens for x in g.kstore} == {(40, 2, 4, 32)}  # [kv_blocks, Hkv, block, D]
    for (_, _, n), t, a, i in zip(jobs, together, alone, _inline_alone(jobs, policy, extra=paged)):
        assert len(t.token_ids) == n
        assert t.token_ids == a.token_ids == i


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_join_while_a_selection_is_in_flight(topology):
    """A slow cache rank: when a request joins, the selections of the next step made from
    the row's old content are still on their way; they are dropped (join counter), the
    re-selection is waited for, and every request keeps its alone tokens."""
    # two rows, many requests: joins land in rows that served another request just before
    jobs = _jobs(8, seed=11, lo=17, hi=30, last_arrival=16, out_hi=10)
    engine = spade.AsyncEngine(make_config("asyncspade", topology, max_batch=2),
                               cache_hooks=CacheHooks(delay_s=0.01, delay_from_step=2))

    together, stats = serve_staggered(engine, jobs)
    assert stats["dropped_selections"] > 0 and stats["join_resyncs"] > 0
    assert stats["joins_into_running"] >= 2 and stats["sparse_steps"] > 0
    for t, i in zip(together, _inline_alone(jobs)):
        assert t.token_ids == i


def test_abort_mid_decode_frees_the_slot():
    engine = spade.AsyncEngine(make_config("asyncspade", "colocated", max_batch=2))
    prompts = random_prompts(3, seed=4, lo=18, hi=26)

    async def main():
        got = []
        async for out in engine.generate(prompts[0], greedy(40), "long"):
            got.append(out)
            if len(got) == 6:
                await engine.abort("long")
        mid = engine.stats()
        after = await final(engine, prompts[1], greedy(12), "next")
        await engine.close()
        return got[-1], mid, after

    last, mid, after = run(main())
    assert last.finish_reason == "abort" and len(last.token_ids) < 40
    assert mid["slots_used"] == 0 and mid["requests_running"] == 0
    assert after.token_ids == _inline_alone([(0, prompts[1], 12)])[0]


@pytest.mark.parametrize("policy,topology,extra", [
    ("asyncspade", "colocated", []), ("tova", "colocated", []),
    ("asyncspade_int4", "colocated", ["model.block_size=4"]),
    ("asyncspade_int4", "local", []),  # no key store: the new cache rank boots from the BOOT message alone
    ("asyncspade_int4", "local", ["model.block_size=4"]),  # pool copies, before the loss and after
])
def test_a_lost_cache_rank_is_restarted_mid_serving(policy, topology, extra, monkeypatch):
    """The cache rank dies at step 6 of the first epoch: the running rows decode densely,
    a new cache rank boots from the current batch (every row; on a paged cache from the
    shared pools, read through the table into the contiguous keys a prefill takes, its int4
    copies pools of the cache's blocks; a cache rank of its own on a paged cache: an epoch of idle rows that the busy rows join again,
    their windows as prompts, so its copies are pools too), and every request completes.
    Tokens after the loss may differ from the alone runs (the new cache rank's query
    windows, or TOVA's held sets, restart), so only completion is asserted."""
    gens = _generations(monkeypatch)
    jobs = _jobs(5, seed=3, lo=18, hi=28, last_arrival=12, out_hi=20)
    engine = spade.AsyncEngine(make_config(policy, topology, extra=extra), cache_hooks=CacheHooks(die_at_step=6))

    outs, stats = serve_staggered(engine, jobs)
    assert stats["cache_peers_lost"] >= 1 and stats["cache_restarts"] >= 1
    assert stats["requests_finished"] == len(jobs) and stats["slots_used"] == 0
    for (_, _, n), o in zip(jobs, outs):
        assert o.finish_reason == "length" and len(o.token_ids) == n
    if topology == "local" and extra:  # the lost one and its successor: pool copies, rows by JOIN
        assert len(gens) >= 2 and all(g.copy_blocks is not None and g.s.serving for g in gens)
        assert gens[1].gen >= 1 and stats["sparse_steps"] > 0
    if topology == "colocated" and extra:  # the successor booted from the shared pools: its copies are pools too
        assert len(gens) >= 2
        copies = [st for st in gens[-1].state.layers if st is not None and st.kq is not None]
        assert copies and all(st.paged and st.kq.shape[2] == 4 for st in copies)  # [kv_blocks, Hkv, 4, D/2]


@pytest.mark.timeout(90)
def test_a_cache_rank_that_fails_its_boot_is_noticed_at_once(monkeypatch):
    """The restarted cache rank raises while it boots (once): the inference rank notices
    the failed task at once, not after ``runtime.peer_deadline_s`` (set far past the test's
    timeout here), starts another, and every request completes."""
    from spade.runtime import cache_rank as CR

    real, calls = CR._Generation._boot, []

    async def boot_fails_once(self):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boot failed (test)")
        await real(self)

    monkeypatch.setattr(CR._Generation, "_boot", boot_fails_once)
    jobs = _jobs(5, seed=3, lo=18, hi=28, last_arrival=12, out_hi=20)
    cfg = make_config("asyncspade", "colocated", extra=["runtime.peer_deadline_s=3600"])
    engine = spade.AsyncEngine(cfg, cache_hooks=CacheHooks(die_at_step=6))

    outs, stats = serve_staggered(engine, jobs)
    assert len(calls) >= 2  # the failed boot, then a booted one
    assert stats["cache_peers_lost"] >= 2 and stats["cache_restarts"] >= 1
    assert stats["requests_finished"] == len(jobs)
    for (_, _, n), o in zip(jobs, outs):
        assert o.finish_reason == "length" and len(o.token_ids) == n


@pytest.mark.parametrize("topology", ["colocated", "multiprocess", "colocated/paged", "local/paged/int4"])
def test_soak_leaks_nothing(topology, monkeypatch):
    """120 random requests (lengths, arrivals, aborts; fixed seed): all end; slots, queue,
    the runtime loop's tasks and the cache process are gone or back afterwards; on a paged
    cache of fewer blocks than the rows hold (the cache rank reading the pools through the
    shared table; `local` int4: its copies in a pool of as many blocks, never short of
    one), every block too."""
    g = torch.Generator().manual_seed(7)
    n = 120
    prompts = random_prompts(n, seed=8, lo=2, hi=24)
    topology, *opts = topology.split("/")
    paged = "paged" in opts
    extra = _multiprocess("nccl") if topology == "multiprocess" else []
    if paged:
        extra += ["model.block_size=4", "model.kv_blocks=25"]  # 24 usable: 96 tokens for 4 rows of 80
    gens = _generations(monkeypatch)
    policy = "asyncspade_int4" if "int4" in opts else "asyncspade"
    engine = spade.AsyncEngine(make_config(policy, topology, max_batch=4, max_seq_len=80, extra=extra))
    free0 = engine.backend.kv_blocks_free()

    async def one(i):
        await asyncio.sleep(float(torch.rand(1, generator=g)) * 0.5)
        m = int(torch.randint(1, 12, (1,), generator=g))
        cut = int(torch.randint(0, 3 * m, (1,), generator=g))  # < m: aborted after `cut` tokens
        outs = []
        async for out in engine.generate(prompts[i], greedy(m), f"s{i}"):
            outs.append(out)
            if len(outs) == cut:
                await engine.abort(f"s{i}")
        return outs[-1]

    async def main():
        outs = await asyncio.gather(*(one(i) for i in range(n)))
        stats = engine.stats()
        tasks = len(asyncio.all_tasks(engine.batch.rt._loop))
        link = engine.batch.rt._link
        await engine.close()
        return outs, stats, tasks, link

    outs, stats, tasks, link = run(main())
    assert all(o.finished for o in outs)
    assert stats["requests_finished"] + stats["requests_aborted"] == n and stats["requests_failed"] == 0
    assert stats["requests_aborted"] > 0 and stats["slots_used"] == 0 and stats["requests_waiting"] == 0
    assert stats["join_resyncs"] > 0 and stats["sparse_steps"] > 0
    assert stats["cache_epochs"] > 1
    assert tasks <= 2  # the open epoch's receiver and the link's own task (serve, or the transport's)
    assert link.closed and (link.proc is None or link.proc.poll() is not None)
    if paged:
        assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_reserved"] == 0 and stats["kv_blocks_free"] == free0
        assert stats["cache_leaves"] > 0
        engine.backend.kv_pool.check()
    if topology == "local":  # the copies' pool: consistent, and no cache rank died short of a block
        assert stats["cache_peers_lost"] == 0
        assert gens and all(gen.copy_blocks is not None for gen in gens)
        for gen in gens:
            gen.copy_blocks.pool.check()


@pytest.mark.parametrize("on_late", ["stale", "full"])
def test_late_selections_between_joins_follow_on_late(on_late):
    """A slow cache rank with ``on_late`` stale / full: late packs take the stale selection
    or dense attention between joins (tokens may then differ from the alone runs), joins
    still wait for their re-selection, and every request completes."""
    jobs = _jobs(5, seed=13, lo=17, hi=26, last_arrival=8, out_hi=10)
    engine = spade.AsyncEngine(make_config("asyncspade", "colocated", max_batch=2,
                                           extra=[f"runtime.on_late={on_late}"]),
                               cache_hooks=CacheHooks(delay_s=0.01, delay_from_step=2))

    outs, stats = serve_staggered(engine, jobs)
    assert stats["late_packs"] > 0 and stats["join_resyncs"] > 0
    assert stats["requests_finished"] == len(jobs) and stats["slots_used"] == 0
    for (_, _, n), o in zip(jobs, outs):
        assert o.finish_reason == "length" and len(o.token_ids) == n


def test_epoch_account_sums_the_cache_ranks_topk_counts():
    """The cache rank's threshold-carry top-K account (sent with each epoch's END) is summed
    over epochs into the engine's stats; an epoch without a carried threshold (NaN) adds
    nothing, and with none at all the stats stay None."""
    from types import SimpleNamespace

    from spade.serving.async_slots import _SESSION_COUNTS, AsyncSlotBatch

    b = object.__new__(AsyncSlotBatch)
    b.totals = {"late_packs": 0, "epochs": 0, "topk_fallbacks": None, "topk_fallbacks_too_many": None,
                "topk_calls": None, **{k: 0 for k in _SESSION_COUNTS}}
    nan = float("nan")
    b._account(SimpleNamespace(late_packs=0, stats={"cache_host": {"topk_fallbacks": nan}}))
    assert b.totals["topk_fallbacks"] is None and b.totals["topk_calls"] is None
    for fb, many, calls in ((3.0, 1.0, 40.0), (2.0, 0.0, 24.0)):
        b._account(SimpleNamespace(late_packs=1, stats={"cache_host": {
            "topk_fallbacks": fb, "topk_fallbacks_too_many": many, "topk_calls": calls}}))
    assert (b.totals["topk_fallbacks"], b.totals["topk_fallbacks_too_many"], b.totals["topk_calls"]) == (5, 1, 64)
    assert b.totals["late_packs"] == 2


@pytest.mark.parametrize("topology", ("colocated", "multiprocess/nccl"))
def test_refresh_every_serves_one_schedule_per_batch(topology):
    """``policy.refresh_every=3`` behind the AsyncEngine: a join restarts the batch's refresh
    schedule (every row selects afresh at the next step), so the tokens depend on when
    requests joined, and only on that. Five requests for three slots, all at once: the
    later two join as earlier ones finish (steps fixed by max_tokens), the same steps in
    every topology, so the cache rank's tokens are the inline engine's. A request alone gets
    what Engine.generate gives it (one schedule from its first sparse step)."""
    extra = ["policy.refresh_every=3"]
    jobs = [(0, p, n) for p, n in zip(random_prompts(5, seed=11, lo=14, hi=30), (18, 9, 14, 20, 11))]
    topology, _, transport = topology.partition("/")

    def serve(topo, more):
        engine = spade.AsyncEngine(make_config("asyncspade", topo, extra=extra + more))

        async def main():
            together = await staggered(engine, jobs)
            stats = engine.stats()
            alone = (await final(engine, jobs[0][1], greedy(jobs[0][2]), "alone")).token_ids
            await engine.close()
            return [t.token_ids for t in together], alone, stats

        return run(main())

    want, alone_inline, _ = serve("inline", [])
    got, alone, stats = serve(topology, _multiprocess(transport) if transport else [])
    assert stats["requests_finished"] == 5 and stats["joins_into_running"] >= 2 and stats["sparse_steps"] > 0
    assert stats["cache_peers_lost"] == 0
    assert got == want and alone == alone_inline
    from spade.static import StaticEngine

    ref = StaticEngine(make_config("asyncspade", "inline", extra=extra))  # the static batch runtime
    try:
        assert ref.generate([jobs[0][1]], max_new_tokens=jobs[0][2])[0].token_ids == alone
    finally:
        ref.close()


@pytest.mark.parametrize("topology", ["colocated", "local"])
def test_a_leave_moves_the_cache_ranks_windows(topology, monkeypatch):
    """A row that leaves (no JOIN before the next step) is a LEAVE: the cache rank's
    ``kv_start`` becomes the inference rank's (the left row's window starts at its leave's
    cursor: its old request is no longer scanned); the other rows' tokens are unchanged."""
    from spade.runtime.cache_rank import _Generation

    seen, masks = [], []
    orig = _Generation._leave

    def spy(self, kv_start, idle):
        orig(self, kv_start, idle)
        seen.append((kv_start.tolist(), self.state.kv_start.tolist()))
        masks.append(self.state.idle.tolist())

    monkeypatch.setattr(_Generation, "_leave", spy)
    prompts = random_prompts(2, seed=9, lo=14, hi=18)
    jobs = [(0, prompts[0], 4), (0, prompts[1], 24)]  # the first leaves early, the second decodes on
    engine = spade.AsyncEngine(make_config("asyncspade", topology))

    async def main():
        together = await asyncio.gather(*[final(engine, p, greedy(n), f"r{i}") for i, (_, p, n) in enumerate(jobs)])
        stats = engine.stats()
        alone = await final(engine, prompts[1], greedy(24), "a1")
        await engine.close()
        return together, alone, stats

    together, alone, stats = run(main())
    assert stats["cache_leaves"] >= 1 and seen and all(sent == got for sent, got in seen)
    left_row_start = seen[0][1]
    assert max(left_row_start) > min(left_row_start)  # one row's window moved to a later cursor
    assert together[1].token_ids == alone.token_ids and len(together[0].token_ids) == 4
    # the first LEAVE: the early request's row is idle, the other one decodes on
    assert sorted(masks[0])[:1] == [False] and sum(masks[0]) == len(masks[0]) - 1, masks


@pytest.mark.parametrize("policy,topology,extra", [
    ("tova", "colocated", []), ("tova", "multiprocess/nccl", []), ("streaming", "local", []),
    ("tova", "colocated", ["serving.prefill_chunk=5", "model.block_size=4", "model.kv_blocks=80"]),
])
def test_tova_and_streaming_on_a_cache_rank_match_alone_and_inline(policy, topology, extra):
    """The other policies that select a step ahead (TOVA's held set chosen by the last
    query's attention, streaming's sinks + recent window) on a cache rank that follows the
    rows: requests joining at random steps get the greedy tokens they get alone and
    through the inline topology (also chunked into a paged cache)."""
    jobs = _jobs(8, seed=7)
    topology, _, transport = topology.partition("/")
    extra = list(extra) + (_multiprocess(transport) if transport else [])

    def serve(topo: str, more: list[str]):
        return _together_then_alone(spade.AsyncEngine(make_config(policy, topo, extra=more)), jobs)

    together, alone, stats = serve(topology, extra)
    _, inline, _ = serve("inline", [])
    assert stats["joins_into_running"] >= 2 and stats["sparse_steps"] > 0 and stats["requests_finished"] == 8
    assert stats["cache_peers_lost"] == 0 and stats["slots_used"] == 0
    for (_, p, n), t, a, i in zip(jobs, together, alone, inline):
        assert len(t.token_ids) == n
        assert t.token_ids == a.token_ids == i.token_ids


@pytest.mark.parametrize("topology", ["colocated", "local"])
def test_serving_epochs_renew_the_cache_ranks_generation(topology):
    """Requests one at a time (the batch drains between them: an epoch each, at cursors of
    their own): from the second epoch on the cache rank renews the first epoch's generation
    (policy state, buffers, graphs) instead of building one; every request's tokens equal
    its inline run (the GPU test checks the graphs and the top-K accounts)."""
    jobs = [(0, p, n) for p, n in zip(random_prompts(4, seed=21, lo=10, hi=26), (9, 14, 6, 11))]
    want = _inline_alone(jobs)
    engine = spade.AsyncEngine(make_config("asyncspade", topology))

    async def main():
        got = [(await final(engine, p, greedy(n), f"r{i}")).token_ids for i, (_, p, n) in enumerate(jobs)]
        rank = engine.batch.rt._link.cache
        await engine.close()
        return got, engine.stats(), rank

    got, stats, rank = run(main())
    assert got == want
    assert stats["cache_epochs"] >= len(jobs)
    assert rank.stats["renewed"] == rank.stats["generations"] - 1 >= len(jobs) - 1
    assert stats["sparse_steps"] > 0


@pytest.mark.parametrize("topology", ["colocated", "multiprocess"])
def test_engine_front_over_a_cache_rank(topology):
    """``spade.Engine`` (the synchronous front) with asyncspade's cache rank, a process of
    its own for ``multiprocess``: more prompts than rows (they wait and join a running
    batch), each gets the greedy tokens the static batch gives it alone; close ends the
    link and the cache process."""
    from spade.static import StaticEngine

    extra = _multiprocess("nccl") if topology == "multiprocess" else []
    prompts = random_prompts(5, seed=21, lo=14, hi=26)  # past the budget: sparse steps from the first
    eng = spade.Engine(make_config("asyncspade", topology, max_batch=2, extra=extra))
    try:
        got = eng.generate(prompts, max_new_tokens=9)
        stats = eng.stats()
        link = eng.core.batch.rt._link
    finally:
        eng.close()
    assert link.closed and (link.proc is None or link.proc.poll() is not None)
    assert stats["joins_into_running"] >= 1 and stats["sparse_steps"] > 0 and stats["slots_used"] == 0
    ref = StaticEngine(make_config("asyncspade", "inline"))
    try:
        want = [ref.generate([p], max_new_tokens=9)[0].token_ids for p in prompts]
    finally:
        ref.close()
    assert [r.token_ids for r in got] == want and all(r.finished == "length" for r in got)

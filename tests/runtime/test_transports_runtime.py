"""The multiprocess runtime over every cross-process transport: the cache rank in
its own process (spawned by the runtime) must give the inline runtime's tokens.

The transports' own contract suite checks messages; this checks what the runtime
really sends on one link: BOOT and STEP commands on one tag, prompt-length
dependent boot shapes, a short last pack (3 layers in packs of 2), selections
and gathered K/V whose widths change per step, across the sparse threshold,
B = 3 with left padding. One cache process per transport serves every runtime
of the module (``link=``), as a serving process would across requests.
"""

from __future__ import annotations

import pytest

from spade.policies import build_policy
from spade.runtime.asyncrt import AsyncRuntime
from spade.runtime.inline import InlineRuntime
from spade.transports import availability
from tests.runtime.conftest import BUDGET, NEW, T, config, free_port, greedy

TRANSPORTS = ["nccl", "ucx", "nixl"]


def _port_overrides(name: str) -> list[str]:
    if name == "nccl":  # gloo on CPU
        return [f"runtime.transport.master_port={free_port()}"]
    return [f"runtime.transport.port={free_port()}"]


def _cfg(name: str, *over: str):
    return config("runtime.topology=multiprocess", f"runtime.transport.name={name}",
                  "runtime.transport.timeout_s=60", *over)


@pytest.fixture(scope="module", params=TRANSPORTS)
def link_rt(request, model):
    """A multiprocess runtime (indices mode, packs of 2 layers) owning its cache process."""
    name = request.param
    ok, why = availability()[name]
    if not ok:
        pytest.skip(f"transport {name!r} is not usable here: {why}")
    cfg = _cfg(name, *_port_overrides(name), "runtime.pack_layers=2", "runtime.return_mode=indices")
    rt = AsyncRuntime(cfg, model, build_policy(cfg.policy, model.spec))
    yield name, rt
    rt.close()


def _sparse_steps(prompt_len: int) -> int:
    return sum(1 for s in range(1, NEW) if prompt_len + s > BUDGET)


def test_indices_mode_matches_inline(link_rt, prompt, inline_tokens):
    name, rt = link_rt
    tr = rt.generate(*prompt, max_new_tokens=NEW, sample_fn=greedy)
    assert tr.tokens == inline_tokens, f"{name}: multiprocess tokens differ from inline"
    assert tr.stats["sparse_steps"] == _sparse_steps(T) > 0
    link = rt._link
    assert link.proc is not None and link.proc.poll() is None, f"{name}: the cache process is not serving"
    assert link.transport.name == name


def test_kv_mode_and_other_prompt_lengths_on_the_same_link(link_rt, model, prompt):
    """kv return mode (gathered K/V of varying width), one pack of all layers, then a
    shorter and a longer prompt on the same cache process (new boot shapes)."""
    name, rt = link_rt
    link = rt.run(rt.link())
    ids, mask = prompt
    cases = [("kv", 3, ids, mask), ("indices", 1, ids[:, 4:], mask[:, 4:]),
             ("kv", 2, ids.repeat(1, 2)[:, :T + 5], mask.repeat(1, 2)[:, :T + 5].clamp(min=1))]
    for mode, pack, i, m in cases:
        ref_cfg = config()
        want = InlineRuntime(ref_cfg, model, build_policy(ref_cfg.policy, model.spec)).generate(
            i, m, max_new_tokens=NEW, sample_fn=greedy).tokens
        cfg = _cfg(name, f"runtime.pack_layers={pack}", f"runtime.return_mode={mode}")
        other = AsyncRuntime(cfg, model, build_policy(cfg.policy, model.spec), link=link)
        try:
            tr = other.generate(i, m, max_new_tokens=NEW, sample_fn=greedy)
        finally:
            other.close()  # does not close the link it does not own
        assert tr.tokens == want, f"{name}: {mode} mode, pack {pack}, prompt length {i.shape[1]}: tokens differ"
        assert tr.stats["return_mode"] == mode and tr.stats["pack_layers"] == pack
        assert tr.stats["sparse_steps"] == _sparse_steps(i.shape[1]) > 0
    assert link.proc.poll() is None and not link.closed

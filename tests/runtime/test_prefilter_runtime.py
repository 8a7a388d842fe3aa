"""asyncspade with the page prefilter in the asynchronous runtime: the cache rank (in
process, colocated or with its own KV store) runs the same policy code, so the tokens
are the inline run's with the same setting."""

from __future__ import annotations

import pytest

from spade.policies import build_policy
from spade.runtime.inline import InlineRuntime
from tests.runtime.conftest import BUDGET, NEW, T, config, generate_cfg, greedy


@pytest.mark.parametrize("score_keys,topology,pack,mode,summary", [
    ("int4", "local", 2, "indices", "mean"),   # the cache rank quantises and folds the keys it receives (k_new)
    ("exact", "colocated", 1, "kv", "bounds"),   # reads the model's own cache
    ("int4", "local", 1, "delta", "bounds"),
])
def test_prefilter_matches_inline_tokens(model, prompt, inline_tokens, score_keys, topology, pack, mode, summary):
    # 4 pages of 4 (at least 10 candidates) for K_mid = 9, of middles up to ~25 tokens: a real prefilter
    pf = [f"policy.score_keys={score_keys}", "policy.prefilter_pages=4", "policy.prefilter_page_size=4",
          f"policy.prefilter_summary={summary}"]
    cfg = config(*pf)
    want = InlineRuntime(cfg, model, build_policy(cfg.policy, model.spec)).generate(
        *prompt, max_new_tokens=NEW, sample_fn=greedy).tokens
    tr = generate_cfg(config(*pf, f"runtime.topology={topology}", f"runtime.pack_layers={pack}",
                             f"runtime.return_mode={mode}"), model, prompt)
    assert tr.tokens == want
    if score_keys == "exact":  # (inline_tokens: the same config without the prefilter)
        assert want != inline_tokens  # the prefilter chose other tokens: the test exercises it
    assert tr.stats["sparse_steps"] == sum(1 for s in range(1, NEW) if T + s > BUDGET) > 0
    assert tr.late_packs == 0

"""``inline`` topology: the policy selects on the critical path of each step
(dense until the cache passes ``runtime.sparse_threshold``, as in the async runtime)."""

from __future__ import annotations

import time

from spade.attention import AttentionContext, ThresholdSelector
from spade.runtime.base import GenerationTrace, Runtime, _sync, timed_loop


class InlineRuntime(Runtime):
    def generate(self, input_ids, attention_mask, *, max_new_tokens, sample_fn, on_token=None):
        be = self.backend
        state = self.policy.new_state(input_ids.shape[0], be.device)
        theta = self.cfg.runtime.sparse_threshold
        ctx = AttentionContext(be.spec, ThresholdSelector(self.policy, state, theta), device=be.device)
        _sync(be.device)
        t0 = time.perf_counter()
        logits = be.prefill(input_ids.to(be.device), attention_mask.to(be.device), ctx)
        _sync(be.device)
        prefill = time.perf_counter() - t0
        rows, times = timed_loop(be, logits, max_new_tokens=max_new_tokens, sample_fn=sample_fn,
                                 on_token=on_token, step=lambda tok: be.decode(tok, ctx))
        return GenerationTrace(tokens=rows, step_times_s=times, prefill_time_s=prefill,
                               mean_attended=ctx.mean_attended())

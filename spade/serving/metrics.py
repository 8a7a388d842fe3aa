"""``GET /metrics`` of ``spade serve``: Prometheus text exposition (format 0.0.4).

The server records what it sees per request (TTFT, TPOT, end-to-end latency, tokens,
finish reasons, refusals); gauges and the engine's own counters (late packs, top-K
fallbacks, tokens generated) are read from ``AsyncEngine.stats()`` when scraped. Every
series carries the labels ``model``, ``policy``, ``topology``, ``transport``.

>>> m = ServerMetrics({"model": "tiny", "policy": "full", "topology": "inline", "transport": "local"})
>>> m.ttft.observe(0.02)
>>> "spade_time_to_first_token_seconds_bucket" in m.render({})
True

No dependency (``prometheus_client`` is not needed): a few counters and histograms.
"""

from __future__ import annotations

import bisect
import math
from typing import Mapping

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


def _esc(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(d: Mapping[str, str]) -> str:
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in d.items()) + "}" if d else ""


def _num(x: float) -> str:
    if isinstance(x, float) and math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if isinstance(x, float) else str(int(x))


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.bounds = tuple(buckets)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        if v is None or not math.isfinite(v):
            return
        i = bisect.bisect_left(self.bounds, v)
        if i < len(self.counts):
            self.counts[i] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str, labels: Mapping[str, str]) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.bounds, self.counts):
            acc += c
            out.append(f"{name}_bucket{_labels({**labels, 'le': _num(float(b))})} {acc}")
        out.append(f"{name}_bucket{_labels({**labels, 'le': '+Inf'})} {self.count}")
        out.append(f"{name}_sum{_labels(labels)} {_num(self.sum)}")
        out.append(f"{name}_count{_labels(labels)} {self.count}")
        return out


# engine.stats() key -> (metric, type, help); a key the engine does not report is left out
ENGINE_SERIES = (
    ("running", "spade_num_requests_running", "gauge", "Requests in the running batch."),
    ("waiting", "spade_num_requests_waiting", "gauge", "Requests waiting for a batch slot."),
    ("prefilling", "spade_num_requests_prefilling", "gauge", "Requests whose prompt is being prefilled in pieces."),
    ("slots_used", "spade_slots_used", "gauge", "Batch slots (a request's KV cache rows) in use."),
    ("slots_free", "spade_slots_free", "gauge", "Batch slots free."),
    ("kv_blocks_used", "spade_kv_blocks_used", "gauge", "KV cache blocks in use."),
    ("kv_blocks_free", "spade_kv_blocks_free", "gauge", "KV cache blocks free."),
    ("kv_blocks_reserved", "spade_kv_blocks_reserved", "gauge",
     "Free KV cache blocks promised to running requests' later tokens."),
    ("tokens_generated", "spade_generation_tokens_total", "counter", "Tokens the engine generated."),
    ("steps", "spade_decode_steps_total", "counter", "Decode steps the engine ran (one for the whole batch)."),
    ("sparse_steps", "spade_sparse_decode_steps_total", "counter",
     "Decode steps in which a row attended a sparse top-K selection (not every token)."),
    ("prefill_s", "spade_prefill_seconds_total", "counter", "Engine wall seconds spent prefilling joining requests."),
    ("decode_s", "spade_decode_seconds_total", "counter", "Engine wall seconds spent in decode steps."),
    ("joins_held_by_cursor", "spade_joins_held_by_cursor_total", "counter",
     "Requests that waited, with batch rows free, for the batch to drain: the shared write cursor plus their "
     "max_tokens passed model.max_seq_len (raise it; with a paged KV cache it costs no KV memory)."),
    ("late_packs", "spade_late_packs_total", "counter",
     "Selection packs the cache rank delivered late (runtime.on_late handled them)."),
    ("topk_fallbacks", "spade_topk_fallbacks_total", "counter",
     "Threshold-carry top-K calls (one per row and KV head per layer) that fell back to the whole-row radix "
     "select (a speed fallback: the selection is the same); summed over ended cache-rank epochs."),
    ("cache_peers_lost", "spade_cache_peers_lost_total", "counter",
     "Cache ranks lost (died, transport broke, silent past runtime.peer_deadline_s); decoding went dense."),
    ("cache_restarts", "spade_cache_restarts_total", "counter",
     "Cache ranks restarted and booted from the running batch after a loss; sparse again from there."),
    ("cache_dense_fallback_steps", "spade_cache_dense_fallback_steps_total", "counter",
     "Decode steps meant sparse that ran dense because the cache rank was lost (until its restart)."),
)


def engine_value(stats: Mapping, key: str):
    """``stats[key]`` (or ``requests_<key>``, as ``AsyncEngine`` names request counts).
    A key present with None (e.g. no cache rank, so no fallbacks) reads as 0; an
    absent key as None (the series is left out)."""
    for k in (key, f"requests_{key}"):
        if k in stats:
            v = stats[k]
            if v is None:
                return 0
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return v
    return None


class ServerMetrics:
    """What the HTTP layer measures; ``render(engine_stats)`` is the /metrics body."""

    def __init__(self, labels: Mapping[str, str]):
        self.labels = dict(labels)
        self.ttft = Histogram()
        self.tpot = Histogram()
        self.e2e = Histogram(LATENCY_BUCKETS + (160.0, 320.0, 640.0))
        self.queue = Histogram()
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.finished: dict[str, int] = {}
        self.rejected: dict[str, int] = {}
        self.in_flight = 0

    def finish(self, reason: str | None, *, ttft=None, tpot=None, e2e=None, queue=None, prompt_tokens=0,
               completion_tokens=0) -> None:
        self.finished[reason or "error"] = self.finished.get(reason or "error", 0) + 1
        self.ttft.observe(ttft)
        self.tpot.observe(tpot)
        self.e2e.observe(e2e)
        self.queue.observe(queue)
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens

    def reject(self, why: str) -> None:
        self.rejected[why] = self.rejected.get(why, 0) + 1

    def render(self, stats: Mapping) -> str:
        L = self.labels
        out: list[str] = []

        def head(name, typ, help_):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {typ}")

        for key, name, typ, help_ in ENGINE_SERIES:
            v = engine_value(stats, key)
            if v is not None:
                head(name, typ, help_)
                out.append(f"{name}{_labels(L)} {_num(v)}")
        head("spade_http_requests_in_flight", "gauge", "Requests the HTTP server is handling now.")
        out.append(f"spade_http_requests_in_flight{_labels(L)} {self.in_flight}")
        head("spade_prompt_tokens_total", "counter", "Prompt tokens of finished requests.")
        out.append(f"spade_prompt_tokens_total{_labels(L)} {self.prompt_tokens}")
        head("spade_completion_tokens_total", "counter", "Tokens returned to clients by finished requests.")
        out.append(f"spade_completion_tokens_total{_labels(L)} {self.completion_tokens}")
        head("spade_request_finished_total", "counter", "Finished requests by finish reason.")
        for r in sorted(set(self.finished) | {"stop", "length", "abort"}):
            out.append(f"spade_request_finished_total{_labels({**L, 'finish_reason': r})} "
                       f"{self.finished.get(r, 0)}")
        head("spade_request_rejected_total", "counter",
             "Requests refused before reaching the engine, by reason (bad_request, unauthorized, overload).")
        for r in sorted(set(self.rejected) | {"bad_request", "unauthorized", "overload"}):
            out.append(f"spade_request_rejected_total{_labels({**L, 'reason': r})} {self.rejected.get(r, 0)}")
        for name, h, help_ in (
                ("spade_time_to_first_token_seconds", self.ttft, "Arrival to first token."),
                ("spade_time_per_output_token_seconds", self.tpot, "Mean seconds per output token after the "
                                                                   "first, per request."),
                ("spade_e2e_request_latency_seconds", self.e2e, "Arrival to the last token."),
                ("spade_request_queue_time_seconds", self.queue, "Arrival to admission into the batch.")):
            head(name, "histogram", help_)
            out.extend(h.lines(name, L))
        return "\n".join(out) + "\n"


__all__ = ["Histogram", "ServerMetrics", "ENGINE_SERIES", "LATENCY_BUCKETS", "engine_value"]

"""The metrics fold: Prometheus series computed only from log records.

``fold_metrics(state, record) -> state`` is the single definition; the live ``/metrics``
endpoint, ``ninfer replay`` and the tests all run it. ``MetricsCollector`` exposes a state through
prometheus-client. Series (names follow llama.cpp's ``llamacpp:*`` and vLLM's ``vllm:*``):

- ``llamacpp:prompt_tokens_total`` prompt tokens computed by prefill (prefix-cache hits
  excluded); ``llamacpp:prompt_seconds_total`` prefill seconds.
- ``llamacpp:tokens_predicted_total`` generated tokens; ``llamacpp:tokens_predicted_seconds_total``
  decode-round seconds.
- ``llamacpp:requests_processing`` requests holding a lane; ``llamacpp:requests_deferred``
  requests received but still waiting for one.
- ``ninfer:requests_total{finish}`` terminal requests by outcome; ``ninfer:requests_prefix_waits_total``
  waits for a lane building a shared prompt prefix (``request.deferred``);
  ``ninfer:num_requests_running`` / ``ninfer:num_requests_waiting`` (vLLM's names).
- prefix reuse (serving contract §3.3): ``ninfer:continuation_lookup_hits_total`` /
  ``…_misses_total`` per admitted request, ``ninfer:continuation_l1_restore_successes_total``
  and ``…_l1_restored_tokens_total`` (reuse from a retained lane), the same for ``l2`` (host
  images restored into a lane; plus ``…_l2_restored_bytes_total``), ``ninfer:l1_demotions_total``,
  ``ninfer:continuation_l2_evictions_total`` / ``…_evicted_bytes_total``, the ``l3`` restore
  series, ``ninfer:continuation_persistence_{successes,failures}_total``,
  ``ninfer:continuation_l3_dropped_entries_total`` (corrupt entries deleted at load), gauges
  ``ninfer:continuation_l3_entries`` / ``…_l3_bytes``, gauges
  ``ninfer:continuation_l2_entries`` / ``…_l2_bytes``, ``ninfer:l1_evictions_total``
  (retained prefixes dropped for another request), gauges ``ninfer:l1_resident_entries`` and
  ``ninfer:l1_resident_tokens``; vLLM's ``ninfer:prefix_cache_queries`` / ``…_hits`` in tokens;
  ``ninfer:continuation_publication_{successes,failures}_total`` (prompt-cache breakpoints).
- tool calls (serving contract §7.5): ``ninfer:tool_calls_total``,
  ``…_incomplete_total``, ``…_invalid_arguments_total``, ``ninfer:tool_call_discarded_bytes_total``.
- histograms ``ninfer:time_to_first_token_seconds``, ``ninfer:inter_token_latency_seconds``,
  ``ninfer:e2e_request_latency_seconds``, ``ninfer:request_queue_time_seconds``.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.registry import CollectorRegistry

from .cache import CACHE_KINDS, TIERS, CacheState, fold_cache
from .schema import Record

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0)
QUEUE_BUCKETS = E2E_BUCKETS


@dataclass(slots=True)
class Histogram:
    """Cumulative-bucket histogram state (seconds)."""
    bounds: tuple
    counts: list = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        if not self.counts:
            self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.n += 1

    def buckets(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for bound, c in zip(self.bounds, self.counts):
            acc += c
            out.append((repr(float(bound)), acc))
        out.append(("+Inf", self.n))
        return out


@dataclass(slots=True)
class MetricsState:
    """Everything ``/metrics`` shows, folded from records."""
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    tokens_predicted: int = 0
    tokens_predicted_seconds: float = 0.0
    decode_rounds: int = 0
    prefill_chunks: int = 0
    waiting: set = field(default_factory=set)
    running: set = field(default_factory=set)
    finished: dict = field(default_factory=dict)
    rejected: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)   # request.error: (status, code) -> count
    received: int = 0
    deferred: int = 0   # request.deferred: waits for a lane building a shared prefix
    sink_failures: int = 0
    cache: CacheState = field(default_factory=CacheState)
    tool_calls: int = 0
    tool_calls_incomplete: int = 0
    tool_calls_invalid: int = 0
    tool_call_discarded_bytes: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(QUEUE_BUCKETS))


def _end(state: MetricsState, request_id: str, outcome: str) -> None:
    state.waiting.discard(request_id)
    state.running.discard(request_id)
    state.finished[outcome] = state.finished.get(outcome, 0) + 1


def fold_metrics(state: MetricsState, record: Record) -> MetricsState:
    """Apply one record to ``state`` (updated in place and returned)."""
    ev = record.event
    kind = record.kind
    if kind == "request.received":
        state.received += 1
        state.waiting.add(ev.request_id)
    elif kind == "request.admitted":
        state.waiting.discard(ev.request_id)
        state.running.add(ev.request_id)
        state.queue.observe(ev.queue_s)
    elif kind == "request.prefill_chunk":
        state.prompt_tokens += ev.tokens
        state.prompt_seconds += ev.duration_s
        state.prefill_chunks += 1
    elif kind == "request.first_token":
        state.tokens_predicted += 1
        state.ttft.observe(ev.ttft_s)
    elif kind == "scheduler.round":
        state.tokens_predicted += ev.tokens
        state.tokens_predicted_seconds += ev.duration_s
        state.decode_rounds += 1
        for v in ev.itl_s:
            state.itl.observe(v)
    elif kind == "request.finished":
        _end(state, ev.request_id, "finished")
        state.e2e.observe(ev.timings["total_s"])
    elif kind == "request.failed":
        _end(state, ev.request_id, "failed")
    elif kind == "request.cancelled":
        _end(state, ev.request_id, "cancelled")
    elif kind == "request.deferred":
        state.deferred += 1
    elif kind == "request.rejected":
        state.waiting.discard(ev.request_id)
        state.rejected[ev.code] = state.rejected.get(ev.code, 0) + 1
    elif kind == "request.error":
        key = (str(ev.status), ev.code)
        state.errors[key] = state.errors.get(key, 0) + 1
    elif kind in CACHE_KINDS:
        fold_cache(state.cache, kind, ev)
    elif kind == "request.tool_calls":
        state.tool_calls += ev.calls
        state.tool_calls_incomplete += ev.incomplete
        state.tool_calls_invalid += ev.invalid_arguments
        state.tool_call_discarded_bytes += ev.discarded_bytes
    elif kind == "sink.failed":
        state.sink_failures += 1
    return state


def counters(s: MetricsState) -> dict:
    """The headline counters the dashboard shows, with the same values as ``/metrics``."""
    return {"prompt_tokens": s.prompt_tokens, "tokens_predicted": s.tokens_predicted,
            "requests_finished": s.finished.get("finished", 0),
            "requests_failed": s.finished.get("failed", 0),
            "requests_cancelled": s.finished.get("cancelled", 0),
            "requests_running": len(s.running), "requests_waiting": len(s.waiting)}


def _counter(name, doc, value):
    m = CounterMetricFamily(name, doc)
    m.add_metric([], value)
    return m


def _gauge(name, doc, value):
    m = GaugeMetricFamily(name, doc)
    m.add_metric([], value)
    return m


def _hist(name, doc, h: Histogram):
    m = HistogramMetricFamily(name, doc)
    m.add_metric([], h.buckets(), h.total)
    return m


class MetricsCollector:
    """prometheus-client collector over a live state getter (``lambda: fold_sink.state``)."""

    def __init__(self, get_state, max_concurrency: int):
        self._get = get_state
        self.max_concurrency = max_concurrency

    def collect(self):
        s: MetricsState = self._get()
        yield _counter("llamacpp:prompt_tokens", "Prompt tokens computed by prefill "
                       "(prefix-cache hits excluded).", s.prompt_tokens)
        yield _counter("llamacpp:prompt_seconds", "Prefill seconds.", s.prompt_seconds)
        yield _counter("llamacpp:tokens_predicted", "Generated tokens.", s.tokens_predicted)
        yield _counter("llamacpp:tokens_predicted_seconds", "Decode-round seconds.",
                       s.tokens_predicted_seconds)
        yield _counter("llamacpp:n_decode", "Forward passes (prefill chunks + decode rounds).",
                       s.decode_rounds + s.prefill_chunks)
        yield _gauge("llamacpp:requests_processing", "Requests holding a lane.", len(s.running))
        yield _gauge("llamacpp:requests_deferred", "Requests waiting for a lane.", len(s.waiting))
        yield _gauge("ninfer:num_requests_running", "Requests holding a lane.", len(s.running))
        yield _gauge("ninfer:num_requests_waiting", "Requests waiting for a lane.",
                     len(s.waiting))
        req = CounterMetricFamily("ninfer:requests", "Terminal requests by outcome.",
                                  labels=["finish"])
        for outcome in ("finished", "failed", "cancelled"):
            req.add_metric([outcome], s.finished.get(outcome, 0))
        yield req
        rej = CounterMetricFamily("ninfer:requests_rejected", "Requests refused before a lane, "
                                  "by error code.", labels=["code"])
        for code, n in sorted(s.rejected.items()):
            rej.add_metric([code], n)
        yield rej
        err = CounterMetricFamily("ninfer:request_errors", "HTTP requests answered with an "
                                  "error no engine record explains (request.error), by status "
                                  "and code.", labels=["status", "code"])
        for (status, code), n in sorted(s.errors.items()):
            err.add_metric([status, code], n)
        yield err
        yield _counter("ninfer:requests_received", "Prepared requests received.", s.received)
        yield _counter("ninfer:requests_prefix_waits", "Waits of a request for a lane "
                       "building the prompt prefix it shares (request.deferred: one builder per "
                       "cold prefix).", s.deferred)
        c = s.cache
        yield _counter("ninfer:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                       "cache.", c.lookup_prompt_tokens)
        yield _counter("ninfer:prefix_cache_hits", "Prompt tokens served from the prefix "
                       "cache.", c.reused_tokens)
        for name, doc, value in (
                ("continuation_lookup_hits", "Admitted requests that reused a prefix.", c.hits),
                ("continuation_lookup_misses", "Admitted requests that prefilled their whole "
                 "prompt.", c.misses),
                ("l1_demotions", "Retained prefixes copied to L2 before their lane lost them.",
                 c.l2_demotions),
                ("l1_evictions", "Retained prefixes dropped for a request that could not reuse "
                 "them.", c.evictions),
                ("continuation_publication_successes", "Prompt-cache breakpoint prefixes "
                 "published to L2 and / or L3.", c.publications),
                ("continuation_publication_failures", "Breakpoint prefixes copied out that no "
                 "tier took.", c.publication_failures),
                ("continuation_l2_evictions", "L2 images dropped for room.", c.l2_evictions),
                ("continuation_l2_evicted_bytes", "Bytes of L2 images dropped for room.",
                 c.l2_evicted_bytes),
                ("continuation_persistence_successes", "Images written to L3.", c.l3_persisted),
                ("continuation_persistence_failures", "L3 writes that failed (nothing became "
                 "visible).", c.l3_persist_failures),
                ("continuation_l3_dropped_entries", "L3 entries found corrupt on load and "
                 "deleted.", c.l3_dropped)):
            yield _counter("ninfer:" + name, doc, value)
        where = {"l1": "retained lanes (L1)", "l2": "host memory (L2)",
                 "l3": "the LMDB store (L3)"}
        for t in TIERS:
            yield _counter(f"ninfer:continuation_{t}_restore_successes", "Prefixes reused from "
                           f"{where[t]}.", c.restores[t])
            yield _counter(f"ninfer:continuation_{t}_restored_tokens", "Prompt tokens reused "
                           f"from {where[t]}.", c.restored_tokens[t])
            if t != "l1":
                yield _counter(f"ninfer:continuation_{t}_restored_bytes", "Image bytes restored "
                               f"from {where[t]}.", c.restored_bytes[t])
        yield _gauge("ninfer:continuation_l2_entries", "Images in L2.", c.l2_entries)
        yield _gauge("ninfer:continuation_l2_bytes", "Bytes of the images in L2.", c.l2_bytes)
        yield _gauge("ninfer:continuation_l3_entries", "Images in L3 (at open, then as of the "
                     "last write).", c.l3_entries)
        yield _gauge("ninfer:continuation_l3_bytes", "Bytes of the images in L3 (at open, then "
                     "as of the last write).", c.l3_bytes)
        yield _gauge("ninfer:l1_resident_entries", "Idle lanes holding a prefix.",
                     len(c.resident))
        yield _gauge("ninfer:l1_resident_tokens", "Tokens held by idle lanes for reuse.",
                     sum(c.resident.values()))
        yield _counter("ninfer:tool_calls", "Tool calls parsed out of answers.", s.tool_calls)
        yield _counter("ninfer:tool_calls_incomplete", "Tool calls the output ended inside.",
                       s.tool_calls_incomplete)
        yield _counter("ninfer:tool_calls_invalid_arguments", "Closed tool calls whose "
                       "arguments are not a JSON object.", s.tool_calls_invalid)
        yield _counter("ninfer:tool_call_discarded_bytes", "Answer bytes after the first tool "
                       "call that were dropped: not a call, or calls past the one allowed "
                       "(parallel tool calls off).", s.tool_call_discarded_bytes)
        yield _counter("ninfer:decode_rounds", "Decode rounds.", s.decode_rounds)
        yield _counter("ninfer:prefill_chunks", "Prefill chunks.", s.prefill_chunks)
        yield _counter("ninfer:log_sink_failures", "Log sinks disabled after a write failure.",
                       s.sink_failures)
        yield _hist("ninfer:time_to_first_token_seconds", "Received to first token.", s.ttft)
        yield _hist("ninfer:inter_token_latency_seconds", "Time between a lane's tokens.", s.itl)
        yield _hist("ninfer:e2e_request_latency_seconds", "Received to finished.", s.e2e)
        yield _hist("ninfer:request_queue_time_seconds", "Received to admitted.", s.queue)


def make_registry(get_state, max_concurrency: int) -> CollectorRegistry:
    """A registry holding only the fold's series (no process/platform collectors, so replayed
    and live text are comparable)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(MetricsCollector(get_state, max_concurrency))
    return reg

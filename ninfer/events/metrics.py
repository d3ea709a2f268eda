"""The ``/metrics`` view of the serving fold (``events.fold``): Prometheus series rendered from a
``ServingState``, so live ``/metrics`` and ``ninfer replay`` give the same text for the same
log. ``MetricsCollector`` exposes a state through prometheus-client. Series (names follow
llama.cpp's ``llamacpp:*`` and vLLM's ``vllm:*``):

- ``llamacpp:prompt_tokens_total`` prompt tokens computed by prefill (prefix-cache hits
  excluded); ``llamacpp:prompt_seconds_total`` prefill seconds.
- ``llamacpp:tokens_predicted_total`` generated tokens; ``llamacpp:tokens_predicted_seconds_total``
  decode-round seconds.
- ``llamacpp:requests_processing`` requests holding a lane; ``llamacpp:requests_deferred``
  requests received but still waiting for one.
- ``ninfer:requests_total{finish}`` terminal requests by outcome; ``ninfer:requests_prefix_waits_total``
  waits for a lane building a shared prompt prefix (``request.deferred``);
  ``ninfer:num_requests_running`` / ``ninfer:num_requests_waiting`` and
  ``ninfer:kv_cache_usage_perc`` (vLLM's names; the usage as in ``fleet.worker_load``).
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
- speculative decoding (``--spec mtp``; vLLM's and llama.cpp's names):
  ``ninfer:spec_decode_num_drafts_total``, ``…_num_draft_tokens_total``,
  ``…_num_accepted_tokens_total``, ``…_num_accepted_tokens_per_pos_total{position}``.
- tool calls (serving contract §7.5): ``ninfer:tool_calls_total``,
  ``…_incomplete_total``, ``…_invalid_arguments_total``, ``ninfer:tool_call_discarded_bytes_total``.
- histograms ``ninfer:time_to_first_token_seconds``, ``ninfer:inter_token_latency_seconds``,
  ``ninfer:e2e_request_latency_seconds``, ``ninfer:request_queue_time_seconds``.
"""
from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.registry import CollectorRegistry

from .cache import TIERS
from .fleet import kv_usage
from .fold import ServingState
from .requests import OUTCOMES, Histogram


def counters(s: ServingState) -> dict:
    """The headline counters the dashboard shows, with the same values as ``/metrics``."""
    r = s.requests
    return {"prompt_tokens": r.prompt_tokens, "tokens_predicted": r.tokens_predicted,
            "requests_finished": r.outcomes.get("finished", 0),
            "requests_failed": r.outcomes.get("failed", 0),
            "requests_cancelled": r.outcomes.get("cancelled", 0),
            "requests_running": len(r.running), "requests_waiting": r.waiting}


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
        s: ServingState = self._get()
        r = s.requests
        yield _counter("llamacpp:prompt_tokens", "Prompt tokens computed by prefill "
                       "(prefix-cache hits excluded).", r.prompt_tokens)
        yield _counter("llamacpp:prompt_seconds", "Prefill seconds.", r.prompt_seconds)
        yield _counter("llamacpp:tokens_predicted", "Generated tokens.", r.tokens_predicted)
        yield _counter("llamacpp:tokens_predicted_seconds", "Decode-round seconds.",
                       r.tokens_predicted_seconds)
        yield _counter("llamacpp:n_decode", "Forward passes (prefill chunks + decode rounds).",
                       r.decode_rounds + r.prefill_chunks)
        yield _gauge("llamacpp:requests_processing", "Requests holding a lane.", len(r.running))
        yield _gauge("llamacpp:requests_deferred", "Requests waiting for a lane.", r.waiting)
        yield _gauge("ninfer:num_requests_running", "Requests holding a lane.", len(r.running))
        yield _gauge("ninfer:num_requests_waiting", "Requests waiting for a lane.", r.waiting)
        used, total = kv_usage(s)
        yield _gauge("ninfer:kv_cache_usage_perc", "Fraction of the KV pages that running "
                     "requests hold, 0-1, as of the last telemetry sample (pages idle lanes "
                     "retain for reuse count as free: they are taken back on demand).",
                     round(used / total, 4) if total else 0.0)
        req = CounterMetricFamily("ninfer:requests", "Terminal requests by outcome.",
                                  labels=["finish"])
        for outcome in OUTCOMES:
            req.add_metric([outcome], r.outcomes.get(outcome, 0))
        yield req
        rej = CounterMetricFamily("ninfer:requests_rejected", "Requests refused before a lane, "
                                  "by error code.", labels=["code"])
        for code, n in sorted(r.rejected.items()):
            rej.add_metric([code], n)
        yield rej
        err = CounterMetricFamily("ninfer:request_errors", "HTTP requests answered with an "
                                  "error no engine record explains (request.error), by status "
                                  "and code.", labels=["status", "code"])
        for (status, code), n in sorted(r.errors.items()):
            err.add_metric([status, code], n)
        yield err
        yield _counter("ninfer:requests_received", "Prepared requests received.", r.received)
        yield _counter("ninfer:requests_prefix_waits", "Waits of a request for a lane "
                       "building the prompt prefix it shares (request.deferred: one builder per "
                       "cold prefix).", r.deferred)
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
        yield _counter("ninfer:tool_calls", "Tool calls parsed out of answers.", r.tool_calls)
        yield _counter("ninfer:tool_calls_incomplete", "Tool calls the output ended inside.",
                       r.tool_calls_incomplete)
        yield _counter("ninfer:tool_calls_invalid_arguments", "Closed tool calls whose "
                       "arguments are not a JSON object.", r.tool_calls_invalid)
        yield _counter("ninfer:tool_call_discarded_bytes", "Answer bytes after the first tool "
                       "call that were dropped: not a call, or calls past the one allowed "
                       "(parallel tool calls off).", r.tool_call_discarded_bytes)
        yield _counter("ninfer:spec_decode_num_drafts", "Speculative rounds of a request "
                       "with drafts (--spec mtp).", r.spec_drafts)
        yield _counter("ninfer:spec_decode_num_draft_tokens", "Tokens the MTP head drafted.",
                       r.spec_draft_tokens)
        yield _counter("ninfer:spec_decode_num_accepted_tokens", "Drafted tokens verification "
                       "accepted.", r.spec_accepted_tokens)
        per = CounterMetricFamily("ninfer:spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted drafts at each draft position (1 = the first).",
                                  labels=["position"])
        for i, n in enumerate(r.spec_accepted_per_pos):
            per.add_metric([str(i + 1)], n)
        yield per
        yield _counter("ninfer:decode_rounds", "Decode rounds.", r.decode_rounds)
        yield _counter("ninfer:prefill_chunks", "Prefill chunks.", r.prefill_chunks)
        yield _counter("ninfer:log_sink_failures", "Log sinks disabled after a write failure.",
                       len(s.sink_failures))
        yield _hist("ninfer:time_to_first_token_seconds", "Received to first token.", r.ttft)
        yield _hist("ninfer:inter_token_latency_seconds", "Time between a lane's tokens.", r.itl)
        yield _hist("ninfer:e2e_request_latency_seconds", "Received to finished.", r.e2e)
        yield _hist("ninfer:request_queue_time_seconds", "Received to admitted.", r.queue)


def make_registry(get_state, max_concurrency: int) -> CollectorRegistry:
    """A registry holding only the fold's series (no process/platform collectors, so replayed
    and live text are comparable)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(MetricsCollector(get_state, max_concurrency))
    return reg


def metrics_text(state: ServingState, max_concurrency: int = 0) -> str:
    """The ``/metrics`` body for ``state`` (the registry the live endpoint serves)."""
    return generate_latest(make_registry(lambda: state, max_concurrency)).decode()

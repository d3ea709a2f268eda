"""The dashboard fold: time series and the request table, from records only.

One definition serves the live page (``GET /dashboard/state``) and offline replay of a JSONL file
(``POST /dashboard/replay``): the browser only renders what this fold returns, so live and offline
views cannot drift. Time is bucketed by record timestamp into ``bucket_s`` intervals.

Per bucket: decode tokens / seconds / rounds / lane-rounds (→ aggregate and per-sequence decode
tok/s, mean decode batch), prefill tokens / seconds (→ prefill tok/s), the last occupancy sample
(running, waiting, prefilling, decode-ready, free KV pages) and the execution thread's
wall-clock split over the bucket (the deltas of the cumulative ``worker_seconds`` between
consecutive samples, spread over the buckets that interval covers in proportion to their
overlap). Samples come when a reading changed, else every 10 s (``ninfer.sampler``): a bucket
between two samples holds the earlier one's occupancy, which held until the later one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .cache import CACHE_KINDS, CacheState, fold_cache
from .schema import Record

MAX_BUCKETS = 900
MAX_REQUESTS = 200
MAX_SPREAD_BUCKETS = 120   # a longer gap between samples (a restart) lands in one bucket


@dataclass(slots=True)
class Bucket:
    t: float
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_rounds: int = 0
    decode_lane_rounds: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    occupancy: dict | None = None
    worker_delta: dict | None = None


@dataclass(slots=True)
class DashboardState:
    bucket_s: float = 1.0
    buckets: dict = field(default_factory=dict)
    requests: dict = field(default_factory=dict)
    order: list = field(default_factory=list)
    last_worker: dict | None = None
    last_sample_ts: float = 0.0
    last_occupancy: dict | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    started: dict | None = None
    gpu: dict | None = None
    instance: str = ""
    cache: CacheState = field(default_factory=CacheState)   # prefix reuse and tiers


def _bucket(state: DashboardState, ts: float) -> Bucket:
    return _bucket_at(state, math.floor(ts / state.bucket_s))


def _bucket_at(state: DashboardState, index: int) -> Bucket:
    key = index * state.bucket_s
    b = state.buckets.get(key)
    if b is None:
        b = state.buckets[key] = Bucket(key)
        if len(state.buckets) > MAX_BUCKETS:
            del state.buckets[min(state.buckets)]
    return b


def _req(state: DashboardState, rid: str) -> dict:
    r = state.requests.get(rid)
    if r is None:
        r = state.requests[rid] = {"id": rid, "state": "waiting"}
        state.order.append(rid)
        if len(state.order) > MAX_REQUESTS:
            state.requests.pop(state.order.pop(0), None)
    return r


def fold_dashboard(state: DashboardState, record: Record) -> DashboardState:
    """Apply one record to ``state`` (updated in place and returned)."""
    ev, kind, ts = record.event, record.kind, record.ts
    if kind in CACHE_KINDS:
        fold_cache(state.cache, kind, ev)
    if kind == "server.started":
        state.instance = record.instance
        state.started = {"config": ev.config, "memory": ev.memory, "artifact": ev.artifact,
                         "environment": ev.environment}
    elif kind == "scheduler.round":
        b = _bucket(state, ts)
        b.decode_tokens += ev.tokens
        b.decode_seconds += ev.duration_s
        b.decode_rounds += 1
        b.decode_lane_rounds += len(ev.lanes)
    elif kind == "request.prefill_chunk":
        b = _bucket(state, ts)
        b.prefill_tokens += ev.tokens
        b.prefill_seconds += ev.duration_s
        r = _req(state, ev.request_id)
        r["prefill_compute_s"] = r.get("prefill_compute_s", 0.0) + ev.duration_s
    elif kind == "telemetry.sample":
        cur = dict(ev.worker_seconds)
        if state.last_worker is not None:
            _spread_worker(state, state.last_sample_ts, ts,
                           {k: cur[k] - state.last_worker.get(k, 0.0) for k in cur})
        b = _bucket(state, ts)
        b.occupancy = dict(ev.scheduler)
        state.last_worker, state.last_sample_ts = cur, ts
        state.last_occupancy = b.occupancy
        state.gpu = dict(ev.gpu)
    elif kind == "request.received":
        r = _req(state, ev.request_id)
        r.update(protocol=ev.protocol, stream=ev.stream, prompt_tokens=ev.prompt_tokens,
                 max_tokens=ev.max_tokens, received_ts=ts)
    elif kind == "request.admitted":
        r = _req(state, ev.request_id)
        r.update(state="running", lane=ev.lane, queue_s=ev.queue_s,
                 cached_tokens=ev.cached_tokens)
    elif kind == "request.first_token":
        _req(state, ev.request_id)["ttft_s"] = ev.ttft_s
    elif kind == "request.finished":
        r = _req(state, ev.request_id)
        t = ev.timings
        decode_rate = (ev.completion_tokens - 1) / t["decode_s"] \
            if t["decode_s"] > 0 and ev.completion_tokens > 1 else None
        r.update(state="finished", finish_reason=ev.finish_reason,
                 completion_tokens=ev.completion_tokens, queue_s=t["queue_s"],
                 prefill_s=t["prefill_s"], ttft_s=t["ttft_s"], total_s=t["total_s"],
                 decode_tok_s=decode_rate, cached_tokens=ev.cached_tokens,
                 computed_tokens=ev.prompt_tokens - ev.cached_tokens)
        state.prompt_tokens += ev.prompt_tokens
        state.cached_tokens += ev.cached_tokens
    elif kind == "cache.lookup":
        # how the prompt was served: the tier and the path ("l1 append_frontier"), or a miss
        _req(state, ev.request_id)["reuse"] = (f"{ev.source} {ev.path}" if ev.cached_tokens
                                               else ev.path)
    elif kind == "cache.restored":
        _req(state, ev.request_id)["restore_s"] = ev.duration_s  # inside its queue time
    elif kind == "request.failed":
        _req(state, ev.request_id).update(state="failed", finish_reason=ev.code)
    elif kind == "request.cancelled":
        _req(state, ev.request_id).update(state="cancelled", finish_reason=ev.reason)
    elif kind == "request.rejected":
        _req(state, ev.request_id).update(state="rejected", finish_reason=ev.code)
    return state


def _spread_worker(state: DashboardState, t0: float, t1: float, delta: dict) -> None:
    """Add ``delta`` (seconds by activity, accrued from ``t0`` to ``t1``) to the buckets of
    that interval, in proportion to their overlap with it; those before ``t1``'s that have no
    occupancy get ``state.last_occupancy`` (the level that held)."""
    first, last = math.floor(t0 / state.bucket_s), math.floor(t1 / state.bucket_s)
    if t1 <= t0 or first == last or last - first > MAX_SPREAD_BUCKETS:
        first = last
    for i in range(first, last + 1):
        lo, hi = max(t0, i * state.bucket_s), min(t1, (i + 1) * state.bucket_s)
        share = 1.0 if first == last else (hi - lo) / (t1 - t0)
        b = _bucket_at(state, i)
        acc = b.worker_delta or {}
        b.worker_delta = {k: acc.get(k, 0.0) + v * share for k, v in delta.items()}
        if i < last and b.occupancy is None and state.last_occupancy is not None:
            b.occupancy = dict(state.last_occupancy)


def _rate(tokens: float, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def _percentile(values: list, q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    v = sorted(values)
    return v[max(0, math.ceil(q / 100 * len(v)) - 1)]


def dashboard_view(state: DashboardState) -> dict:
    """Everything the page draws: series per bucket, latency summary, requests, budget."""
    series = []
    for key in sorted(state.buckets):
        b = state.buckets[key]
        batch = b.decode_lane_rounds / b.decode_rounds if b.decode_rounds else None
        agg = _rate(b.decode_tokens, b.decode_seconds)
        series.append({
            "t": b.t, "decode_tok_s": agg,
            "decode_tok_s_per_seq": agg / batch if agg is not None and batch else None,
            "decode_batch": batch, "prefill_tok_s": _rate(b.prefill_tokens, b.prefill_seconds),
            "occupancy": b.occupancy, "worker": b.worker_delta})
    reqs = [state.requests[r] for r in state.order if r in state.requests]
    done = [r for r in reqs if r["state"] == "finished"]
    ttfts = [r["ttft_s"] for r in done]
    latency = {"requests": len(done), "ttft_p50_s": _percentile(ttfts, 50),
               "ttft_p90_s": _percentile(ttfts, 90), "ttft_p99_s": _percentile(ttfts, 99)}
    if done:
        restore = sum(r.get("restore_s", 0.0) for r in done)
        latency["queue_share"] = (sum(r["queue_s"] for r in done) - restore) / max(sum(ttfts),
                                                                                  1e-12)
        latency["prefill_share"] = sum(r["prefill_s"] for r in done) / max(sum(ttfts), 1e-12)
        latency["restore_share"] = restore / max(sum(ttfts), 1e-12)
    return {
        "instance": state.instance, "bucket_s": state.bucket_s, "series": series,
        "latency": latency, "requests": reqs[::-1][:50],
        "prefill_avoided_share": (state.cached_tokens / state.prompt_tokens
                                  if state.prompt_tokens else None),
        "started": state.started, "gpu": state.gpu,
        "cache": _cache_view(state),
    }


def _cache_view(state: DashboardState) -> dict | None:
    """The cache panel: L1 prefix reuse (retained lanes); None when the server did not report
    prefix reuse (the panel then says there is nothing to show)."""
    cfg = (state.started or {}).get("config", {})
    if cfg.get("prefix_reuse") is None:
        return None
    c = state.cache
    return {
        "prefix reuse": "on" if cfg["prefix_reuse"] else "off (--no-prefix-reuse)",
        "L1 lanes retaining a prefix": f"{len(c.resident)} of {cfg.get('max_concurrency')}",
        "L1 retained tokens": sum(c.resident.values()),
        "lookups (hits / total)": f"{c.hits} / {c.lookups}",
        "prompt tokens reused": c.reused_tokens,
        "evicted prefixes (tokens)": f"{c.evictions} ({c.evicted_tokens})",
        "truncated prefixes (tokens cut)": f"{c.truncations} ({c.truncated_tokens})",
        "L2 host images (bytes)": (f"{c.l2_entries} ({c.l2_bytes})"
                                   if cfg.get("continuation_cache") in ("l1-l2", "l1-l2-l3")
                                   else "off"),
        "L2 demotions / restores": f"{c.l2_demotions} / {c.restores['l2']}",
        "L3 disk images (bytes)": (f"{c.l3_entries} ({c.l3_bytes})"
                                   if cfg.get("continuation_cache") == "l1-l2-l3" else "off"),
        "L3 writes / restores": f"{c.l3_persisted} / {c.restores['l3']}",
    }

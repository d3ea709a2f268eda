"""The time series of the serving fold: records bucketed by timestamp into ``bucket_s``
intervals, which the dashboard draws.

Per bucket: decode tokens / seconds / rounds / lane-rounds, prefill tokens / seconds, the
occupancy sample that held and the execution thread's wall-clock split over the bucket (the
deltas of the cumulative ``worker_seconds`` between consecutive samples, spread over the buckets
that interval covers in proportion to their overlap). Samples come when a reading changed, else
every 10 s (``ninfer.sampler``): a bucket between two samples holds the earlier one's
occupancy, which held until the later one.

``fold_series(state, record, last_sample) -> state``; ``last_sample`` is the serving state's
previous ``(ts, occupancy, worker_seconds)`` (a sample's deltas are taken against it).
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass

from .schema import Record
from .values import evolve, frozen

MAX_BUCKETS = 900
MAX_SPREAD_BUCKETS = 120   # a longer gap between samples (a restart) lands in one bucket


@dataclass(frozen=True)
class Bucket:
    t: float
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_rounds: int = 0
    decode_lane_rounds: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    occupancy: Mapping | None = None
    worker_delta: Mapping | None = None


@dataclass(frozen=True)
class Series:
    bucket_s: float = 1.0
    buckets: tuple = ()            # Bucket, by time; at most MAX_BUCKETS (the oldest go)


def _change(s: Series, index: int, change) -> Series:
    """``s`` with bucket ``index`` (of ``bucket_s`` each) replaced by ``change(bucket)``, the
    bucket made empty first when absent; past ``MAX_BUCKETS`` the oldest bucket goes, even when
    that is the one just made."""
    key = index * s.bucket_s
    buckets = s.buckets
    if buckets and buckets[-1].t == key:   # (most records land in the newest bucket)
        return evolve(s, buckets=buckets[:-1] + (change(buckets[-1]),))
    times = [b.t for b in buckets]
    i = bisect.bisect_left(times, key)
    if i < len(buckets) and buckets[i].t == key:
        return evolve(s, buckets=buckets[:i] + (change(buckets[i]),) + buckets[i + 1:])
    buckets = buckets[:i] + (change(Bucket(key)),) + buckets[i:]
    if len(buckets) > MAX_BUCKETS:
        buckets = buckets[1:]
    return evolve(s, buckets=buckets)


def _index(s: Series, ts: float) -> int:
    return math.floor(ts / s.bucket_s)


def fold_series(s: Series, record: Record, last_sample: tuple) -> Series:
    """``s`` after one record."""
    ev, kind = record.event, record.kind
    if kind == "scheduler.round":
        return _change(s, _index(s, record.ts), lambda b: evolve(
            b, decode_tokens=b.decode_tokens + ev.tokens,
            decode_seconds=b.decode_seconds + ev.duration_s, decode_rounds=b.decode_rounds + 1,
            decode_lane_rounds=b.decode_lane_rounds + len(ev.lanes)))
    if kind == "request.prefill_chunk":
        return _change(s, _index(s, record.ts), lambda b: evolve(
            b, prefill_tokens=b.prefill_tokens + ev.tokens,
            prefill_seconds=b.prefill_seconds + ev.duration_s))
    if kind == "telemetry.sample":
        last_ts, last_occupancy, last_worker = last_sample
        cur = ev.worker_seconds
        if last_worker is not None:
            s = _spread_worker(s, last_ts, record.ts, last_occupancy,
                               {k: cur[k] - last_worker.get(k, 0.0) for k in cur})
        occupancy = frozen(ev.scheduler)
        return _change(s, _index(s, record.ts), lambda b: evolve(b, occupancy=occupancy))
    return s


def _spread_worker(s: Series, t0: float, t1: float, occupancy: Mapping | None,
                   delta: dict) -> Series:
    """``s`` with ``delta`` (seconds by activity, accrued from ``t0`` to ``t1``) added to the
    buckets of that interval, in proportion to their overlap with it; those before ``t1``'s
    that have no occupancy get ``occupancy`` (the level that held)."""
    first, last = _index(s, t0), _index(s, t1)
    if t1 <= t0 or first == last or last - first > MAX_SPREAD_BUCKETS:
        first = last
    for i in range(first, last + 1):
        lo, hi = max(t0, i * s.bucket_s), min(t1, (i + 1) * s.bucket_s)
        share = 1.0 if first == last else (hi - lo) / (t1 - t0)

        def add(b: Bucket, share=share, i=i) -> Bucket:
            acc = b.worker_delta or {}
            b = evolve(b, worker_delta=frozen({k: acc.get(k, 0.0) + v * share
                                                for k, v in delta.items()}))
            if i < last and b.occupancy is None and occupancy is not None:
                b = evolve(b, occupancy=occupancy)
            return b

        s = _change(s, i, add)
    return s

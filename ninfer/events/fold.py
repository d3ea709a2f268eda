"""The serving fold: one state of everything observable, folded from records only.

``fold(state, record) -> state`` is the single definition that the live server (one
``FoldSink``), ``ninfer replay`` and the tests run; ``/metrics`` (``events.metrics``),
``/telemetry`` and ``/slots`` (``events.telemetry``) and the dashboard (``events.dashboard``)
are views of the state it returns. States are immutable values: a fold returns a new one.

Error policy, the same live and in replay (``fold_or_skip``): a record the fold raises on (a
record of a known kind whose payload lacks what the kind promises, e.g. a hand-edited log) is
skipped whole and counted in ``fold_errors``; the state is otherwise the one before it. Live,
the ``FoldSink`` also emits one ``fold.failed`` record per skipped record and stays attached.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .cache import CACHE_KINDS, CacheState, fold_cache
from .lanes import LanesState, fold_lanes
from .requests import RequestsState, fold_requests
from .schema import Record
from .series import Series, fold_series
from .table import RequestTable, fold_table
from .values import evolve, frozen, no_entries

_REQUEST_KINDS = frozenset({
    "request.received", "request.admitted", "request.prefill_chunk", "request.first_token",
    "scheduler.round", "request.finished", "request.failed", "request.cancelled",
    "request.deferred", "request.rejected", "request.error", "request.tool_calls",
    "spec.round"})
_LANE_KINDS = frozenset({
    "server.started", "request.admitted", "request.prefill_chunk", "request.first_token",
    "scheduler.round", "spec.round", "request.finished", "request.failed", "request.cancelled",
    "lane.assigned", "lane.retained", "lane.evicted", "lane.released"})
_TABLE_KINDS = frozenset({
    "request.prefill_chunk", "request.received", "request.admitted", "request.first_token",
    "request.finished", "cache.lookup", "cache.restored", "request.failed",
    "request.cancelled", "request.rejected"})
_SERIES_KINDS = frozenset({"scheduler.round", "request.prefill_chunk", "telemetry.sample"})


@dataclass(frozen=True)
class ServingState:
    """What the log says about one server instance (fields that no record set yet keep their
    defaults; ``started``: a ``server.started`` was folded)."""
    instance: str = ""
    last_seq: int = 0
    records: int = 0                  # folded, fold errors included
    fold_errors: int = 0              # records skipped because the fold raised on them
    started: bool = False
    config: Mapping = no_entries()
    artifact: Mapping = no_entries()
    environment: Mapping = no_entries()
    memory: Mapping = no_entries()
    model_id: str = ""
    gpu: Mapping | None = None        # the last telemetry.sample's readings ...
    occupancy: Mapping | None = None
    worker_seconds: Mapping | None = None
    sample_ts: float = 0.0            # ... and its timestamp
    sink_failures: tuple = ()         # ({sink, error, seq}, ...)
    engine_error: str = ""            # engine.failed: the execution thread stopped
    requests: RequestsState = field(default_factory=RequestsState)
    lanes: LanesState = field(default_factory=LanesState)
    cache: CacheState = field(default_factory=CacheState)
    table: RequestTable = field(default_factory=RequestTable)
    series: Series = field(default_factory=Series)


def fold(s: ServingState, record: Record) -> ServingState:
    """``s`` after one record.

    Raises:
        Exception: the record's payload does not hold what its kind promises (a KeyError,
            TypeError, ...); ``fold_or_skip`` applies the error policy.
    """
    ev, kind = record.event, record.kind
    changes: dict = {"last_seq": record.seq, "records": s.records + 1}
    if kind in _REQUEST_KINDS:
        changes["requests"] = fold_requests(s.requests, record)
    if kind in _LANE_KINDS:
        changes["lanes"] = fold_lanes(s.lanes, record, s.requests.pending)
    if kind in CACHE_KINDS:
        changes["cache"] = fold_cache(s.cache, kind, ev)
    if kind in _TABLE_KINDS:
        changes["table"] = fold_table(s.table, record)
    if kind in _SERIES_KINDS:
        changes["series"] = fold_series(s.series, record,
                                        (s.sample_ts, s.occupancy, s.worker_seconds))
    if kind == "server.started":
        changes.update(instance=record.instance, started=True, config=frozen(ev.config),
                       artifact=frozen(ev.artifact), environment=frozen(ev.environment),
                       memory=frozen(ev.memory), model_id=ev.artifact.get("model_id", ""))
    elif kind == "telemetry.sample":
        changes.update(gpu=frozen(ev.gpu), occupancy=frozen(ev.scheduler),
                       worker_seconds=frozen(ev.worker_seconds), sample_ts=record.ts)
    elif kind == "sink.failed":
        changes["sink_failures"] = s.sink_failures + (
            frozen(sink=ev.sink, error=ev.error, seq=record.seq),)
    elif kind == "engine.failed":
        changes["engine_error"] = ev.error
    return evolve(s, **changes)


def fold_or_skip(s: ServingState, record: Record) -> tuple[ServingState, Exception | None]:
    """``(fold(s, record), None)``; or, when the fold raises, ``(s with the record counted in
    records and fold_errors and its last_seq, the error)``."""
    try:
        return fold(s, record), None
    except Exception as exc:  # a bad record must not stop the fold (live or replay)
        return evolve(s, last_seq=record.seq, records=s.records + 1,
                       fold_errors=s.fold_errors + 1), exc

"""The lane part of the serving fold: what each lane serves or keeps, as ``/slots`` and the
``/telemetry`` slots show it.

``fold_lanes(state, record, pending) -> state`` applies one record; ``pending`` is the request
lifecycle's table *before* the record (an admission takes the request's prompt and output sizes
from it). Lanes come with ``server.started`` (``max_concurrency`` of them).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .schema import Record
from .values import evolve, frozen, no_entries, with_item, without


@dataclass(frozen=True)
class LaneView:
    """One lane as the log describes it."""
    id: int
    n_ctx: int = 0
    request_id: str = ""
    processing: bool = False
    prompt_tokens: int = 0
    prompt_done: int = 0
    cached_tokens: int = 0
    max_tokens: int = 0
    decoded: int = 0
    retained_tokens: int = 0      # idle lane holding a prefix for reuse (0: none)
    session_digest: str | None = None
    checkpoints: tuple = ()       # ({frontier, session_digest}, ...), oldest first


@dataclass(frozen=True)
class LanesState:
    views: tuple = ()             # LaneView per lane id
    lane_of: Mapping = no_entries()   # request_id -> the lane it was admitted to


def _set(s: LanesState, lane_id: int, **changes) -> LanesState:
    """``s`` with lane ``lane_id`` changed (``s`` itself for a lane id it has no lane for)."""
    if not 0 <= lane_id < len(s.views):
        return s
    views = list(s.views)
    views[lane_id] = evolve(views[lane_id], **changes)
    return evolve(s, views=tuple(views))


def _lane(s: LanesState, lane_id: int) -> LaneView | None:
    return s.views[lane_id] if 0 <= lane_id < len(s.views) else None


def _ended(s: LanesState, request_id: str) -> LanesState:
    lane_id = s.lane_of.get(request_id, -1)
    s = evolve(s, lane_of=without(s.lane_of, request_id))
    lane = _lane(s, lane_id)
    if lane is not None and lane.request_id == request_id:
        s = _set(s, lane_id, processing=False)
    return s


def _decoded(s: LanesState, counts, busy_only: bool) -> LanesState:
    """``s`` with ``n`` tokens added to ``decoded`` for each ``(lane_id, n)`` of ``counts``
    (only to lanes serving a request when ``busy_only``)."""
    views = list(s.views)
    for lane_id, n in counts:
        if 0 <= lane_id < len(views) and (views[lane_id].processing or not busy_only):
            views[lane_id] = evolve(views[lane_id], decoded=views[lane_id].decoded + n)
    return evolve(s, views=tuple(views))


def fold_lanes(s: LanesState, record: Record, pending: Mapping) -> LanesState:
    """``s`` after one record."""
    ev, kind = record.event, record.kind
    if kind == "server.started":
        cfg = ev.config
        n_ctx = int(cfg.get("max_context_effective", cfg.get("max_context", 0)))
        return evolve(s, views=tuple(LaneView(i, n_ctx)
                                      for i in range(int(cfg["max_concurrency"]))))
    if kind == "request.admitted":
        prompt, max_tokens = pending.get(ev.request_id, (0, 0))
        if _lane(s, ev.lane) is None:
            return s
        s = _set(s, ev.lane, request_id=ev.request_id, processing=True, prompt_tokens=prompt,
                 max_tokens=max_tokens, cached_tokens=ev.cached_tokens, prompt_done=0,
                 decoded=0)
        return evolve(s, lane_of=with_item(s.lane_of, ev.request_id, ev.lane))
    if kind == "request.prefill_chunk":
        return _set(s, ev.lane, prompt_done=ev.done_tokens)
    if kind == "request.first_token":
        lane = _lane(s, ev.lane)
        return s if lane is None else _set(s, ev.lane, decoded=lane.decoded + 1)
    if kind == "scheduler.round":   # one token per lane of the round
        return _decoded(s, [(lane_id, 1) for lane_id in ev.lanes], busy_only=False)
    if kind == "spec.round":  # each lane also committed its accepted drafts
        return _decoded(s, zip(ev.lanes, ev.accepted), busy_only=True)
    if kind in ("request.finished", "request.failed", "request.cancelled"):
        return _ended(s, ev.request_id)
    if kind == "lane.assigned":
        return _set(s, ev.lane, retained_tokens=0, session_digest=None)
    if kind == "lane.retained":
        marks = {ev.anchor_tokens: ev.anchor_digest, ev.checkpoint_tokens: ev.checkpoint_digest}
        return _set(s, ev.lane, retained_tokens=ev.tokens, session_digest=ev.session_digest,
                    checkpoints=tuple(frozen(frontier=t, session_digest=d)
                                      for t, d in sorted(marks.items()) if t))
    if kind in ("lane.evicted", "lane.released"):
        lane = _lane(s, ev.lane)
        if lane is None or lane.processing:
            return s
        return _set(s, ev.lane, retained_tokens=0, session_digest=None, checkpoints=())
    return s

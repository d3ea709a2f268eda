"""The telemetry fold: the ``/telemetry`` snapshot and the ``/slots`` table, from records only.

``fold_telemetry(state, record) -> state`` is the single definition used live, by ``ninfer
replay`` and by tests. ``telemetry_snapshot(state)`` and ``slots_table(state)`` render it.
Fields that do not apply (no GPU; ``cache`` on a log whose server did not report
``prefix_reuse``) are absent, never a fake zero. Keys under
``live`` (uptime, wall-clock time, SSE subscribers, sink health) only exist on a live server;
everything else is reproduced exactly by replaying the log.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .cache import CACHE_KINDS, CacheState, fold_cache
from .schema import Record


@dataclass(slots=True)
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
    checkpoints: list = field(default_factory=list)   # [{frontier, session_digest}]


@dataclass(slots=True)
class TelemetryState:
    instance: str = ""
    last_seq: int = 0
    records: int = 0
    model_id: str = ""
    config: dict = field(default_factory=dict)
    artifact: dict = field(default_factory=dict)
    environment: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    gpu: dict | None = None
    occupancy: dict = field(default_factory=dict)
    worker_seconds: dict = field(default_factory=dict)
    admitted: int = 0
    queue_seconds_total: float = 0.0
    rejected: dict = field(default_factory=dict)
    decode_rounds: int = 0
    decode_row_rounds: int = 0
    prefill_steps: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    sink_failures: list = field(default_factory=list)
    lanes: list = field(default_factory=list)
    pending: dict = field(default_factory=dict)      # request_id -> (prompt_tokens, max_tokens)
    lane_of: dict = field(default_factory=dict)      # request_id -> lane id
    cache: CacheState = field(default_factory=CacheState)   # prefix reuse and tiers
    engine_error: str = ""   # engine.failed: the execution thread stopped


def _lane(state: TelemetryState, lane_id: int) -> LaneView | None:
    if 0 <= lane_id < len(state.lanes):
        return state.lanes[lane_id]
    return None


def _end(state: TelemetryState, request_id: str) -> None:
    state.pending.pop(request_id, None)
    lane = _lane(state, state.lane_of.pop(request_id, -1))
    if lane is not None and lane.request_id == request_id:
        lane.processing = False


def fold_telemetry(state: TelemetryState, record: Record) -> TelemetryState:
    """Apply one record to ``state`` (updated in place and returned)."""
    ev, kind = record.event, record.kind
    state.last_seq = record.seq
    state.records += 1
    if kind in CACHE_KINDS:
        fold_cache(state.cache, kind, ev)
    if kind == "server.started":
        state.instance = record.instance
        state.config = dict(ev.config)
        state.artifact = dict(ev.artifact)
        state.environment = dict(ev.environment)
        state.memory = dict(ev.memory)
        state.model_id = ev.artifact.get("model_id", "")
        n_ctx = int(ev.config.get("max_context_effective", ev.config.get("max_context", 0)))
        state.lanes = [LaneView(i, n_ctx) for i in range(int(ev.config["max_concurrency"]))]
    elif kind == "telemetry.sample":
        state.gpu = dict(ev.gpu)
        state.occupancy = dict(ev.scheduler)
        state.worker_seconds = dict(ev.worker_seconds)
    elif kind == "request.received":
        state.pending[ev.request_id] = (ev.prompt_tokens, ev.max_tokens)
    elif kind == "request.admitted":
        state.admitted += 1
        state.queue_seconds_total += ev.queue_s
        prompt, max_tokens = state.pending.pop(ev.request_id, (0, 0))
        lane = _lane(state, ev.lane)
        if lane is not None:
            lane.request_id, lane.processing = ev.request_id, True
            lane.prompt_tokens, lane.max_tokens = prompt, max_tokens
            lane.cached_tokens, lane.prompt_done, lane.decoded = ev.cached_tokens, 0, 0
            state.lane_of[ev.request_id] = ev.lane
    elif kind == "request.prefill_chunk":
        state.prefill_steps += 1
        lane = _lane(state, ev.lane)
        if lane is not None:
            lane.prompt_done = ev.done_tokens
    elif kind == "request.first_token":
        lane = _lane(state, ev.lane)
        if lane is not None:
            lane.decoded += 1
    elif kind == "scheduler.round":
        state.decode_rounds += 1
        state.decode_row_rounds += len(ev.lanes)
        for lane_id in ev.lanes:
            lane = _lane(state, lane_id)
            if lane is not None:
                lane.decoded += 1
    elif kind == "spec.round":  # each lane also committed its accepted drafts
        for lane_id, accepted in zip(ev.lanes, ev.accepted):
            lane = _lane(state, lane_id)
            if lane is not None and lane.processing:
                lane.decoded += accepted
    elif kind == "request.finished":
        state.finished += 1
        _end(state, ev.request_id)
    elif kind == "request.failed":
        state.failed += 1
        _end(state, ev.request_id)
    elif kind == "request.cancelled":
        state.cancelled += 1
        _end(state, ev.request_id)
    elif kind == "request.rejected":
        state.pending.pop(ev.request_id, None)
        state.rejected[ev.code] = state.rejected.get(ev.code, 0) + 1
    elif kind == "lane.assigned":
        lane = _lane(state, ev.lane)
        if lane is not None:
            lane.retained_tokens, lane.session_digest = 0, None
    elif kind == "lane.retained":
        lane = _lane(state, ev.lane)
        if lane is not None:
            lane.retained_tokens, lane.session_digest = ev.tokens, ev.session_digest
            marks = {ev.anchor_tokens: ev.anchor_digest, ev.checkpoint_tokens:
                     ev.checkpoint_digest}
            lane.checkpoints = [{"frontier": t, "session_digest": d}
                                for t, d in sorted(marks.items()) if t]   # oldest first
    elif kind in ("lane.evicted", "lane.released"):
        lane = _lane(state, ev.lane)
        if lane is not None and not lane.processing:
            lane.retained_tokens, lane.session_digest, lane.checkpoints = 0, None, []
    elif kind == "sink.failed":
        state.sink_failures.append({"sink": ev.sink, "error": ev.error, "seq": record.seq})
    elif kind == "engine.failed":
        state.engine_error = ev.error
    return state


def telemetry_snapshot(state: TelemetryState, live: dict | None = None) -> dict:
    """The ``/telemetry`` document (spec §2.11 shape, fields that apply so far)."""
    cfg = state.config
    scheduler = {
        "max_concurrency": cfg.get("max_concurrency"),
        "max_pending_requests": cfg.get("max_pending_requests"),
        # greedy decode rounds run one ahead (EngineConfig.decode_lookahead, as it applies)
        "decode_lookahead": bool(cfg.get("decode_lookahead_effective", False)),
        "admitted_requests": state.admitted,
        "queue_seconds_total": state.queue_seconds_total,
        "rejected_overloaded": state.rejected.get("server_overloaded", 0),
        "rejected_queue_timeout": state.rejected.get("request_queue_timeout", 0),
        "decode_rounds": state.decode_rounds,
        "decode_row_rounds": state.decode_row_rounds,
        "prefill_steps": state.prefill_steps,
        "finished_requests": state.finished,
        "failed_requests": state.failed,
        "cancelled_requests": state.cancelled,
    }
    # levels from events (exact at every record); the prefill/decode split is sampled
    scheduler["running"] = sum(ln.processing for ln in state.lanes)
    scheduler["waiting"] = len(state.pending)
    if state.occupancy:
        scheduler["sampled"] = {k: state.occupancy[k] for k in
                                ("prefilling", "decode_ready") if k in state.occupancy}
    if state.worker_seconds:
        scheduler["worker_seconds"] = dict(state.worker_seconds)
    memory = dict(state.memory)
    for key in ("free_pages", "total_pages", "retained_pages"):
        if key in state.occupancy:
            memory["kv_" + key] = state.occupancy[key]
    memory["max_context"] = cfg.get("max_context_effective", cfg.get("max_context"))
    out = {
        "server_instance_id": state.instance,
        "last_seq": state.last_seq,
        "model_id": state.model_id,
        "attached": bool(state.instance),
        "artifact": {k: state.artifact.get(k) for k in ("path", "sha256", "size_bytes",
                                                         "architecture")},
        "environment": dict(state.environment),
        "scheduler": scheduler,
        "memory": memory,
        "slots": [{"id": ln.id, "processing": ln.processing, "prompt_tokens": ln.prompt_tokens,
                   "cached_tokens": ln.cached_tokens,
                   "retained_tokens": 0 if ln.processing else ln.retained_tokens,
                   "work": "generation" if ln.processing else "none"} for ln in state.lanes],
        "events": {"sink_failures": list(state.sink_failures)},
    }
    if cfg.get("prefix_reuse") is not None:
        c = state.cache
        out["cache"] = {
            "prefix_reuse": bool(cfg.get("prefix_reuse")),
            "lookups": c.lookups, "hits": c.hits, "misses": c.misses,
            "lookup_prompt_tokens": c.lookup_prompt_tokens, "reused_tokens": c.reused_tokens,
            "paths": {p: c.paths.get(p, 0) for p in
                      ("append_frontier", "truncate_frontier", "restore_turn_checkpoint",
                       "full_reset", "disabled")},
            "l1": {"resident_lanes": len(c.resident), "resident_tokens": sum(c.resident.values()),
                   "evictions": c.evictions, "truncations": c.truncations},
            # prompt-cache breakpoint prefixes published to L2 / L3 (cache.published)
            "publications": {"published": c.publications, "failed": c.publication_failures,
                             "tokens": c.published_tokens},
            # images a lane's cache could not take (cache.restore_refused)
            "restore_refusals": c.restore_refusals,
        }
        if cfg.get("continuation_cache") == "l1-l2-l3" and cfg.get("prefix_reuse"):
            out["cache"]["l3"] = {
                "enabled": c.l3_enabled,   # False: the store could not be used
                "disabled_reason": c.l3_disabled,
                "dir": cfg.get("continuation_cache_dir"),
                "namespace": cfg.get("continuation_cache_namespace"),
                "quota_bytes": int(cfg.get("continuation_cache_l3_mib", 0)) << 20,
                "entries": c.l3_entries, "bytes": c.l3_bytes, "persisted": c.l3_persisted,
                "persist_failures": c.l3_persist_failures, "restores": c.restores["l3"],
                "restored_tokens": c.restored_tokens["l3"],
                # corrupt entries deleted at load (store.entry_dropped); where a store that
                # did not read whole at start was moved (store.quarantined), else None
                "dropped_entries": c.l3_dropped, "quarantined_to": c.l3_quarantined}
        if cfg.get("continuation_cache") in ("l1-l2", "l1-l2-l3") and cfg.get("prefix_reuse"):
            out["cache"]["l2"] = {
                "budget_bytes": int(cfg.get("continuation_cache_l2_mib", 0)) << 20,
                "entries": c.l2_entries, "bytes": c.l2_bytes, "demotions": c.l2_demotions,
                "evictions": c.l2_evictions, "restores": c.restores["l2"],
                "restored_tokens": c.restored_tokens["l2"]}
    if state.gpu is not None:
        out["gpu"] = dict(state.gpu)
    if state.engine_error:
        out["engine"] = {"failed": True, "error": state.engine_error}
    if live is not None:
        out["live"] = live
    return out


def slots_table(state: TelemetryState) -> list[dict]:
    """The llama.cpp-shaped ``GET /slots`` array, one entry per lane."""
    out = []
    for ln in state.lanes:
        busy = ln.processing
        kept = 0 if busy else ln.retained_tokens  # idle retained: the session depth
        out.append({
            "id": ln.id,
            "id_task": ln.request_id if busy else None,
            "n_ctx": ln.n_ctx,
            "speculative": state.config.get("spec", "none") != "none",   # --spec mtp
            "is_processing": busy,
            "retained": kept > 0,
            "n_prompt_tokens": ln.prompt_tokens if busy else kept,
            "n_prompt_tokens_processed": ln.prompt_done if busy else 0,
            "n_prompt_tokens_cache": ln.cached_tokens if busy else kept,
            "next_token": {"has_next_token": busy,
                           "n_remain": max(ln.max_tokens - ln.decoded, 0) if busy else 0,
                           "n_decoded": ln.decoded if busy else 0},
            "session_digest": None if busy or not kept else ln.session_digest,
            "checkpoints": [] if busy or not kept else list(ln.checkpoints),
        })
    return out

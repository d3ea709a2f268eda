"""The ``/telemetry`` snapshot and the ``/slots`` table: views of the serving fold's state
(``events.fold``), so the live server and ``ninfer replay`` render the same log the same way.

Fields that do not apply (no GPU; ``cache`` on a log whose server did not report
``prefix_reuse``; ``events.fold_errors`` while no record was skipped) are absent, never a fake
zero. Keys under ``live`` (uptime, wall-clock time, SSE subscribers, sink health) only exist on
a live server; everything else is reproduced exactly by replaying the log.
"""
from __future__ import annotations

from .fold import ServingState


def telemetry_snapshot(state: ServingState, live: dict | None = None) -> dict:
    """The ``/telemetry`` document (spec §2.11 shape, fields that apply so far)."""
    cfg, r, lanes = state.config, state.requests, state.lanes.views
    occupancy = state.occupancy or {}
    scheduler = {
        "max_concurrency": cfg.get("max_concurrency"),
        "max_pending_requests": cfg.get("max_pending_requests"),
        # greedy decode rounds run one ahead (EngineConfig.decode_lookahead, as it applies)
        "decode_lookahead": bool(cfg.get("decode_lookahead_effective", False)),
        "admitted_requests": r.queue.n,
        "queue_seconds_total": r.queue.total,
        "rejected_overloaded": r.rejected.get("server_overloaded", 0),
        "rejected_queue_timeout": r.rejected.get("request_queue_timeout", 0),
        "decode_rounds": r.decode_rounds,
        "decode_row_rounds": r.decode_row_rounds,
        "prefill_steps": r.prefill_chunks,
        "finished_requests": r.outcomes.get("finished", 0),
        "failed_requests": r.outcomes.get("failed", 0),
        "cancelled_requests": r.outcomes.get("cancelled", 0),
    }
    # levels from events (exact at every record); the prefill/decode split is sampled
    scheduler["running"] = sum(ln.processing for ln in lanes)
    scheduler["waiting"] = r.waiting
    if occupancy:
        scheduler["sampled"] = {k: occupancy[k] for k in
                                ("prefilling", "decode_ready") if k in occupancy}
    if "prefill_chunk_effective" in cfg:   # the chunk in use (auto resolved), and how chosen
        scheduler["prefill_chunk"] = cfg["prefill_chunk_effective"]
        scheduler["prefill_chunk_choice"] = dict(cfg.get("prefill_chunk_choice") or {})
    if state.worker_seconds:
        scheduler["worker_seconds"] = dict(state.worker_seconds)
    memory = dict(state.memory)
    for key in ("free_pages", "total_pages", "retained_pages"):
        if key in occupancy:
            memory["kv_" + key] = occupancy[key]
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
                   "work": "generation" if ln.processing else "none"} for ln in lanes],
        "events": {"sink_failures": [dict(f) for f in state.sink_failures]},
    }
    if state.fold_errors:
        out["events"]["fold_errors"] = state.fold_errors
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
                "budget_bytes": _l2_budget(cfg),
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


def slots_table(state: ServingState) -> list[dict]:
    """The llama.cpp-shaped ``GET /slots`` array, one entry per lane."""
    out = []
    for ln in state.lanes.views:
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
            "checkpoints": [] if busy or not kept else [dict(c) for c in ln.checkpoints],
        })
    return out


def _l2_budget(cfg: dict) -> int:
    """The L2 ceiling a ``server.started`` config reports (older logs: the MiB given)."""
    if "continuation_cache_l2_bytes" in cfg:
        return int(cfg["continuation_cache_l2_bytes"])
    mib = cfg.get("continuation_cache_l2_mib", 0)
    return int(mib) << 20 if isinstance(mib, int) else 0

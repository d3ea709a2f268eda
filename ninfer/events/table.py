"""The request table of the serving fold: the last ``MAX_REQUESTS`` requests, one row each
(state, lane, queue and prefill seconds, time to first token, reuse path, ...), which the
dashboard lists; and the prompt tokens of finished requests with the share served from cache.

``fold_table(state, record) -> state`` applies one record. A row is a read-only mapping whose
keys appear in the order the records first set them (the dashboard's JSON keeps that order).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .schema import Record
from .values import evolve, no_entries, updated, with_item

MAX_REQUESTS = 200


@dataclass(frozen=True)
class RequestTable:
    rows: Mapping = no_entries()      # request_id -> row, oldest first
    prompt_tokens: int = 0            # of finished requests
    cached_tokens: int = 0            # ... served from the prefix cache


def reuse_label(lookup) -> str:
    """How a ``cache.lookup`` served the prompt: the tier and the path
    (``"l1 append_frontier"``), or the path alone when nothing was reused (``"full_reset"``)."""
    return f"{lookup.source} {lookup.path}" if lookup.cached_tokens else lookup.path


def _row(t: RequestTable, rid: str, **items) -> RequestTable:
    """``t`` with ``items`` set on ``rid``'s row (made, and the oldest row dropped past
    ``MAX_REQUESTS``, when there is none)."""
    row = t.rows.get(rid)
    if row is not None:
        return evolve(t, rows=with_item(t.rows, rid, updated(row, **items)))
    rows = dict(t.rows)
    rows[rid] = updated({"id": rid, "state": "waiting"}, **items)
    if len(rows) > MAX_REQUESTS:
        del rows[next(iter(rows))]
    return evolve(t, rows=updated(rows))


def fold_table(t: RequestTable, record: Record) -> RequestTable:
    """``t`` after one record."""
    ev, kind = record.event, record.kind
    if kind == "request.prefill_chunk":
        row = t.rows.get(ev.request_id, {})
        return _row(t, ev.request_id,
                    prefill_compute_s=row.get("prefill_compute_s", 0.0) + ev.duration_s)
    if kind == "request.received":
        return _row(t, ev.request_id, protocol=ev.protocol, stream=ev.stream,
                    prompt_tokens=ev.prompt_tokens, max_tokens=ev.max_tokens,
                    received_ts=record.ts)
    if kind == "request.admitted":
        return _row(t, ev.request_id, state="running", lane=ev.lane, queue_s=ev.queue_s,
                    cached_tokens=ev.cached_tokens)
    if kind == "request.first_token":
        return _row(t, ev.request_id, ttft_s=ev.ttft_s)
    if kind == "request.finished":
        tm = ev.timings
        decode_rate = (ev.completion_tokens - 1) / tm["decode_s"] \
            if tm["decode_s"] > 0 and ev.completion_tokens > 1 else None
        t = _row(t, ev.request_id, state="finished", finish_reason=ev.finish_reason,
                 completion_tokens=ev.completion_tokens, queue_s=tm["queue_s"],
                 prefill_s=tm["prefill_s"], ttft_s=tm["ttft_s"], total_s=tm["total_s"],
                 decode_tok_s=decode_rate, cached_tokens=ev.cached_tokens,
                 computed_tokens=ev.prompt_tokens - ev.cached_tokens)
        return evolve(t, prompt_tokens=t.prompt_tokens + ev.prompt_tokens,
                       cached_tokens=t.cached_tokens + ev.cached_tokens)
    if kind == "cache.lookup":
        return _row(t, ev.request_id, reuse=reuse_label(ev))
    if kind == "cache.restored":
        return _row(t, ev.request_id, restore_s=ev.duration_s)  # inside its queue time
    if kind == "request.failed":
        return _row(t, ev.request_id, state="failed", finish_reason=ev.code)
    if kind == "request.cancelled":
        return _row(t, ev.request_id, state="cancelled", finish_reason=ev.reason)
    if kind == "request.rejected":
        return _row(t, ev.request_id, state="rejected", finish_reason=ev.code)
    return t

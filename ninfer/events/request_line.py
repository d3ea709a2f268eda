"""One line per request on stderr, as llama.cpp's server prints each task's timings: a fold of
one request's records (received, admitted, cache lookup and restore, prefill chunks, first
token, then finished / failed / cancelled / rejected), rendered when the request ends; a
``request.error``, a ``slot.action`` (``POST /slots``) or a ``store.entry_dropped`` (a corrupt
L3 entry deleted) is a line of its own.

``fold_request_lines(state, record) -> state`` is pure; ``state.ended`` holds the summary of
the request that record ended (None otherwise) and ``format_line`` renders it. Live, a
``RequestLineSink`` on the bus prints it (on by default; ``--no-log-requests``); offline,
``request_lines(records)`` renders a recorded log (``ninfer replay --requests LOG``).

Durations are the payloads' own (the producer's monotonic clock, as ``/metrics`` uses); only a
request that ended without ``timings`` (failed, cancelled, rejected) takes its total from the
records' ``ts``.
"""
from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .schema import Record
from .table import reuse_label
from .values import evolve, no_entries, with_item, without

# the HTTP route of each request.received protocol (one route per protocol)
ROUTES = {"openai_chat_completions": "/v1/chat/completions",
          "openai_completions": "/v1/completions", "openai_responses": "/v1/responses",
          "anthropic_messages": "/v1/messages"}
_ENDS = {"request.finished": "finished", "request.failed": "failed",
         "request.cancelled": "cancelled", "request.rejected": "rejected"}
_KINDS = frozenset({"request.received", "request.admitted", "cache.lookup", "cache.restored",
                    "request.prefill_chunk", "request.first_token", *_ENDS})


@dataclass(frozen=True)
class RequestSummary:
    """What the records said of one request (None: no record said it). Seconds throughout."""
    request_id: str
    route: str = ""                   # its protocol's route; request.error: "METHOD /path";
    #                                   a 429 before request.received: its x-request-id
    lane: int = -1
    received_ts: float | None = None  # request.received's record ts (unix seconds)
    prompt_tokens: int | None = None
    reused_tokens: int = 0            # prompt tokens not recomputed (prefix reuse)
    reuse: str = ""                   # cache.lookup's path, with the tier when it reused some
    restore_s: float | None = None    # an L2 / L3 image copied into the lane (cache.restored)
    queue_s: float | None = None
    prefill_tokens: int = 0           # computed by prefill chunks ...
    prefill_s: float = 0.0            # ... in this much forward-pass time
    ttft_s: float | None = None
    generated: int = 0
    decode_s: float | None = None     # first token to the last (request.finished timings)
    total_s: float | None = None
    drafts: int = 0                   # speculative decoding: tokens drafted, ...
    accepted: int = 0                 # ... and accepted by verification
    outcome: str = ""                 # finished | failed | cancelled | rejected | error | slot
    #                                   | dropped | unfinished (replay: no end in the log)
    reason: str = ""                  # finish reason, error code or cancel reason
    status: int = 0                   # request.error's HTTP status
    action: str = ""                  # slot.action: save | restore | erase, ...
    filename: str = ""                # ... its file ("" for erase), ...
    tokens: int = 0                   # ... the tokens saved, restored or erased, ...
    bytes: int = 0                    # ... and the bytes written or read


@dataclass(frozen=True)
class RequestLines:
    open: Mapping = no_entries()      # request_id -> RequestSummary, not ended yet
    ended: RequestSummary | None = None   # the request the last record ended


def _summary(r: RequestSummary, record: Record) -> RequestSummary:
    """``r`` after one of its request's records (a kind of ``_KINDS``)."""
    ev, kind = record.event, record.kind
    if kind == "request.received":
        return evolve(r, route=ROUTES.get(ev.protocol, ev.protocol), received_ts=record.ts,
                      prompt_tokens=ev.prompt_tokens)
    if kind == "request.admitted":
        return evolve(r, lane=ev.lane, queue_s=ev.queue_s)
    if kind == "cache.lookup":
        return evolve(r, reused_tokens=ev.cached_tokens, reuse=reuse_label(ev))
    if kind == "cache.restored":
        return evolve(r, restore_s=(r.restore_s or 0.0) + ev.duration_s)
    if kind == "request.prefill_chunk":
        return evolve(r, lane=ev.lane, prefill_tokens=r.prefill_tokens + ev.tokens,
                      prefill_s=r.prefill_s + ev.duration_s)
    if kind == "request.first_token":
        return evolve(r, ttft_s=ev.ttft_s)
    if kind == "request.finished":
        tm = ev.timings
        return evolve(r, lane=ev.lane, prompt_tokens=ev.prompt_tokens,
                      reused_tokens=ev.cached_tokens, generated=ev.completion_tokens,
                      queue_s=tm["queue_s"], ttft_s=tm["ttft_s"], decode_s=tm["decode_s"],
                      total_s=tm["total_s"], drafts=ev.draft_n, accepted=ev.draft_n_accepted,
                      outcome="finished", reason=ev.finish_reason)
    # failed / cancelled / rejected: no timings on the record; the total from the records' ts
    total = None if r.received_ts is None else record.ts - r.received_ts
    r = evolve(r, outcome=_ENDS[kind], total_s=total,
               reason=ev.reason if kind == "request.cancelled" else ev.code)
    if kind != "request.rejected":
        r = evolve(r, generated=ev.completion_tokens, lane=ev.lane if ev.lane >= 0 else r.lane)
    elif not r.route and (ev.path or ev.http_request_id):   # a 429 before request.received:
        route = " ".join(([ev.path] if ev.path else [])       # its route and response's id
                         + ([f"(x-request-id {ev.http_request_id})"] if ev.http_request_id
                            else []))
        r = evolve(r, route=route)
    return r


def fold_request_lines(s: RequestLines, record: Record) -> RequestLines:
    """``s`` after one record (``ended`` set when the record ended a request).

    Raises:
        Exception: the record's payload lacks what its kind promises (KeyError, ...).
    """
    kind = record.kind
    if s.ended is not None:
        s = evolve(s, ended=None)
    if kind == "server.started":   # a new server instance: its requests start afresh
        return RequestLines()
    if kind == "request.error":    # an HTTP error no engine record explains
        ev = record.event
        return evolve(s, ended=RequestSummary(ev.http_request_id, route=f"{ev.method} {ev.path}",
                                              outcome="error", reason=ev.code, status=ev.status))
    if kind == "slot.action":      # POST /slots/{id}?action=...: one line, ok or refused
        ev = record.event
        return evolve(s, ended=RequestSummary(
            ev.http_request_id, route=f"POST /slots/{ev.lane}", outcome="slot",
            action=ev.action, filename=ev.filename, tokens=ev.tokens, bytes=ev.bytes,
            total_s=ev.duration_s, reason="" if ev.ok else ev.code))
    if kind == "store.entry_dropped":   # a corrupt L3 entry deleted: the store says why
        ev = record.event
        return evolve(s, ended=RequestSummary("", outcome="dropped", action=ev.tier,
                                              reason=ev.reason, tokens=ev.tokens,
                                              bytes=ev.bytes))
    if kind not in _KINDS:
        return s
    rid = record.event.request_id
    r = _summary(s.open.get(rid) or RequestSummary(rid), record)
    if kind in _ENDS:
        return evolve(s, open=without(s.open, rid), ended=r)
    return evolve(s, open=with_item(s.open, rid, r))


def _dur(seconds: float) -> str:
    if seconds < 0.01:
        return f"{seconds * 1000:.1f} ms"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _tokens(n: int) -> str:
    return f"{n:,} token" + ("" if n == 1 else "s")


def _rate(tokens: int, seconds: float) -> str:
    """`` (N tok/s)``, or "" when there is no time to divide by."""
    if seconds <= 0:
        return ""
    r = tokens / seconds
    return f" ({r:,.0f} tok/s)" if r >= 1000 else f" ({r:.1f} tok/s)"


def _turns_waited(r: RequestSummary) -> float:
    """Seconds of the time to first token that are neither the queue, a restore nor this
    request's own prefill: other lanes' prefill chunks and decode rounds run in between (and a
    prefill turn waited for past ``--max-prefill-lanes``); 0 when under a tenth of it or 10 ms,
    or when no ``request.prefill_chunk`` record said what its own prefill took."""
    if r.ttft_s is None or r.queue_s is None or not r.prefill_tokens:
        return 0.0
    gap = r.ttft_s - r.queue_s - (r.restore_s or 0.0) - r.prefill_s
    return gap if gap >= max(0.01, 0.1 * r.ttft_s) else 0.0


def format_line(r: RequestSummary) -> str:
    """The ``ninfer: request ...`` line of an ended request (fields in a fixed order; those no
    record gave are left out)."""
    if r.outcome == "dropped":
        what = ", ".join(([_tokens(r.tokens)] if r.tokens else []) + [f"{r.bytes:,} bytes"])
        return (f"ninfer: {r.action} store entry dropped ({what}): {r.reason}; its prompts "
                f"prefill instead")
    head = " ".join([f"request {r.request_id}"] + ([r.route] if r.route else [])
                    + ([f"lane {r.lane}"] if r.lane >= 0 else []))
    if r.outcome == "error":
        return f"ninfer: {head}: error {r.status}" + (f" {r.reason}" if r.reason else "")
    if r.outcome == "slot":
        parts = [" ".join([r.action] + ([r.filename] if r.filename else []))]
        if r.tokens:
            parts.append(_tokens(r.tokens))
        if r.bytes:
            parts.append(f"{r.bytes:,} bytes")
        parts.append(f"total {_dur(r.total_s or 0.0)}")
        return f"ninfer: {head}: " + ", ".join(parts) + (f", failed: {r.reason}" if r.reason
                                                          else "")
    parts = []
    if r.prompt_tokens is not None:
        prompt = f"prompt {_tokens(r.prompt_tokens)}"
        if r.reuse:
            restored = "" if r.restore_s is None else f", copied in {_dur(r.restore_s)}"
            prompt += f" ({r.reused_tokens:,} reused: {r.reuse}{restored})"
        parts.append(prompt)
    if r.queue_s is not None:
        parts.append(f"queued {_dur(r.queue_s)}")
    if r.prefill_tokens:
        parts.append(f"prefill {r.prefill_tokens:,} in {_dur(r.prefill_s)}"
                     + _rate(r.prefill_tokens, r.prefill_s))
    waited = _turns_waited(r)
    if waited:
        parts.append(f"waited {_dur(waited)} for other lanes' turns")
    if r.ttft_s is not None:
        parts.append(f"first token {_dur(r.ttft_s)}")
    if r.decode_s is not None and r.generated > 1:   # (the first token came from prefill:
        parts.append(f"{r.generated:,} generated in {_dur(r.decode_s)}"   # the rate is the rest's)
                     + _rate(r.generated - 1, r.decode_s))
    elif r.generated:
        parts.append(f"{r.generated:,} generated")
    if r.drafts:
        parts.append(f"drafts {r.drafts:,}, accepted {r.accepted:,}")
    if r.total_s is not None:
        parts.append(f"total {_dur(r.total_s)}")
    parts.append(r.reason if r.outcome == "finished" else f"{r.outcome}: {r.reason}")
    return f"ninfer: {head}: " + ", ".join(parts)


def request_lines(records: Iterable[Record], skipped: list | None = None) -> list[str]:
    """The line of every request that ends in ``records``, in order (a record the fold raises
    on is skipped, as the live sink skips it, and appended to ``skipped`` when given), across
    server instances; a request still open when its instance's records stop (a killed server)
    or the log ends gets an ``unfinished`` line there."""
    s, out, instance = RequestLines(), [], None

    def unfinished(why: str) -> None:
        out.extend(format_line(evolve(r, outcome="unfinished", reason=why))
                   for r in s.open.values())

    for rec in records:
        if rec.instance != instance:
            if instance is not None:
                unfinished(f"its server ({instance}) stopped")
                s = RequestLines()
            instance = rec.instance
        try:
            s = fold_request_lines(s, rec)
        except Exception:  # a malformed record: skipped (replay counts it as malformed)
            if skipped is not None:
                skipped.append(rec)
            continue
        if s.ended is not None:
            out.append(format_line(s.ended))
    unfinished("the log ends")
    return out


class RequestLineSink:
    """Prints each ended request's line to ``out`` (default: ``sys.stderr`` at write time, so a
    redirected stderr is followed). A record the fold raises on is skipped here; the serving
    fold's sink reports it as ``fold.failed``."""

    name = "request_lines"

    def __init__(self, out=None):
        self.state = RequestLines()
        self._out = out

    def write(self, record: Record, line: str) -> None:
        try:
            self.state = fold_request_lines(self.state, record)
        except Exception:  # (the state stays the one before the record)
            return
        if self.state.ended is not None:
            print(format_line(self.state.ended), file=self._out or sys.stderr, flush=True)

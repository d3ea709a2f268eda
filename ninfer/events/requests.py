"""The request-lifecycle part of the serving fold: who waits, who runs, how requests ended, and
the token, round and latency totals that ``/metrics`` and ``/telemetry`` both render.

``fold_requests(state, record) -> state`` applies one record; kinds it does not concern return
``state`` itself. Latency histograms are cumulative-bucket states in seconds.
"""
from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field

from .schema import Record
from .values import counted, evolve, no_entries, with_item, without

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0)
QUEUE_BUCKETS = E2E_BUCKETS
OUTCOMES = ("finished", "failed", "cancelled")


@dataclass(frozen=True)
class Histogram:
    """Observations per bucket (``counts[i]``: values up to ``bounds[i]``, above the one
    before; values above the last bound only count in ``n``), their sum and count."""
    bounds: tuple
    counts: tuple = None   # zeros when not given
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        if self.counts is None:
            object.__setattr__(self, "counts", (0,) * len(self.bounds))

    def observed(self, *values: float) -> "Histogram":
        """This histogram with ``values`` added, in order."""
        counts, bounds, total = list(self.counts), self.bounds, self.total
        size = len(counts)
        for v in values:
            i = bisect.bisect_left(bounds, v)
            if i < size:
                counts[i] += 1
            total += v
        return evolve(self, counts=tuple(counts), total=total, n=self.n + len(values))

    def buckets(self) -> list[tuple[str, int]]:
        """Prometheus' cumulative buckets: ``(upper bound, count)``, ``+Inf`` last."""
        out, acc = [], 0
        for bound, c in zip(self.bounds, self.counts):
            acc += c
            out.append((repr(float(bound)), acc))
        out.append(("+Inf", self.n))
        return out


@dataclass(frozen=True)
class RequestsState:
    """Request levels and totals, from records only."""
    received: int = 0
    pending: Mapping = no_entries()   # request_id -> (prompt_tokens, max_tokens): no lane yet
    running: frozenset = frozenset()  # request ids holding a lane
    outcomes: Mapping = no_entries()  # finished / failed / cancelled -> requests
    rejected: Mapping = no_entries()  # error code -> requests refused before a lane
    errors: Mapping = no_entries()    # (status, code) -> HTTP errors no engine record explains
    deferred: int = 0                 # waits for a lane building a shared prefix
    prompt_tokens: int = 0            # computed by prefill (prefix-cache hits excluded)
    prompt_seconds: float = 0.0
    prefill_chunks: int = 0
    tokens_predicted: int = 0
    tokens_predicted_seconds: float = 0.0
    decode_rounds: int = 0
    decode_row_rounds: int = 0        # lanes summed over decode rounds
    tool_calls: int = 0
    tool_calls_incomplete: int = 0
    tool_calls_invalid: int = 0
    tool_call_discarded_bytes: int = 0
    spec_drafts: int = 0              # lanes' speculative rounds with drafts (vLLM's num_drafts)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple = ()  # accepted drafts at position 1, 2, ..
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(QUEUE_BUCKETS))  # admissions

    @property
    def waiting(self) -> int:
        """Requests received and not yet holding a lane or refused."""
        return len(self.pending)


def _ended(s: RequestsState, request_id: str, outcome: str) -> RequestsState:
    return evolve(s, pending=without(s.pending, request_id), running=s.running - {request_id},
                   outcomes=counted(s.outcomes, outcome))


def fold_requests(s: RequestsState, record: Record) -> RequestsState:
    """``s`` after one record."""
    ev, kind = record.event, record.kind
    if kind == "request.received":
        return evolve(s, received=s.received + 1, pending=with_item(
            s.pending, ev.request_id, (ev.prompt_tokens, ev.max_tokens)))
    if kind == "request.admitted":
        return evolve(s, pending=without(s.pending, ev.request_id),
                       running=s.running | {ev.request_id}, queue=s.queue.observed(ev.queue_s))
    if kind == "request.prefill_chunk":
        return evolve(s, prompt_tokens=s.prompt_tokens + ev.tokens,
                       prompt_seconds=s.prompt_seconds + ev.duration_s,
                       prefill_chunks=s.prefill_chunks + 1)
    if kind == "request.first_token":
        return evolve(s, tokens_predicted=s.tokens_predicted + 1, ttft=s.ttft.observed(ev.ttft_s))
    if kind == "scheduler.round":
        return evolve(s, tokens_predicted=s.tokens_predicted + ev.tokens,
                       tokens_predicted_seconds=s.tokens_predicted_seconds + ev.duration_s,
                       decode_rounds=s.decode_rounds + 1,
                       decode_row_rounds=s.decode_row_rounds + len(ev.lanes),
                       itl=s.itl.observed(*ev.itl_s))
    if kind == "request.finished":
        total_s = ev.timings["total_s"]
        return evolve(_ended(s, ev.request_id, "finished"), e2e=s.e2e.observed(total_s))
    if kind == "request.failed":
        return _ended(s, ev.request_id, "failed")
    if kind == "request.cancelled":
        return _ended(s, ev.request_id, "cancelled")
    if kind == "spec.round":
        per = list(s.spec_accepted_per_pos)
        per += [0] * (len(ev.accepted_per_position) - len(per))
        for i, n in enumerate(ev.accepted_per_position):   # (lanes accepted there)
            per[i] += n
        return evolve(s, spec_drafts=s.spec_drafts + sum(d > 0 for d in ev.drafted),
                       spec_draft_tokens=s.spec_draft_tokens + sum(ev.drafted),
                       spec_accepted_tokens=s.spec_accepted_tokens + sum(ev.accepted),
                       spec_accepted_per_pos=tuple(per))
    if kind == "request.deferred":
        return evolve(s, deferred=s.deferred + 1)
    if kind == "request.rejected":
        return evolve(s, pending=without(s.pending, ev.request_id),
                       rejected=counted(s.rejected, ev.code))
    if kind == "request.error":
        return evolve(s, errors=counted(s.errors, (str(ev.status), ev.code)))
    if kind == "request.tool_calls":
        return evolve(s, tool_calls=s.tool_calls + ev.calls,
                       tool_calls_incomplete=s.tool_calls_incomplete + ev.incomplete,
                       tool_calls_invalid=s.tool_calls_invalid + ev.invalid_arguments,
                       tool_call_discarded_bytes=s.tool_call_discarded_bytes
                       + ev.discarded_bytes)
    return s

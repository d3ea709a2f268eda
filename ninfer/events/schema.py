"""The record log's schema: one frozen dataclass per event kind (the registry, the decorator and
the ``Record`` envelope are in ``registry.py`` and re-exported here).

Every record is ``Record(schema_version, seq, ts, instance, event)``; ``event`` is one of the
dataclasses below, registered by its dotted ``kind``. Units are in the field names where
ambiguous: ``_s`` seconds, ``_tokens`` token counts, ``_bytes`` bytes. Times inside payloads are
durations measured on the producer's monotonic clock, so folds never depend on wall-clock
differences between records.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .registry import (REGISTRY, SCHEMA_VERSION, Record, SchemaError, SchemaTooNew,
                       UnknownEventKind, all_kinds, event)


# --- server ---------------------------------------------------------------------------------

@event("server.started")
class ServerStarted:
    """The server is about to listen. ``config``: every ServeConfig option, plus what start-up
    resolved: ``max_context_effective``, ``decode_lookahead_effective``,
    ``prefill_chunk_effective`` (the chunk in use) and ``prefill_chunk_choice`` (``tokens``,
    ``source``: given / default / measured; measured adds the fit ``time(T) = F + c T`` as
    ``fixed_ms`` and ``per_token_us``, ``measured_tokens``, ``measured_ms``,
    ``wanted_tokens`` before the memory bound and ``memory_max_tokens``); ``artifact``: path,
    sha256, size_bytes, load_s, architecture, model_id; ``environment``: backend, python,
    numpy, platform (+ GPU fields when present); ``memory``: budget in bytes; ``warnings``:
    what the server printed as warnings at start-up (e.g. a ``--max-context`` beyond the
    model's trained length)."""
    kind: ClassVar[str]
    config: dict
    artifact: dict
    environment: dict
    memory: dict
    argv: list
    warnings: list = field(default_factory=list)


@event("server.stopping")
class ServerStopping:
    """Shutdown began; ``reason`` says why: ``"signal SIGINT"`` / ``"signal SIGTERM"`` (emitted
    when the signal arrives, before the requests it fails), ``"shutdown"`` (the server task was
    cancelled)."""
    kind: ClassVar[str]
    reason: str


@event("sink.failed")
class SinkFailed:
    """A log sink failed (e.g. disk full) and was disabled; serving continues."""
    kind: ClassVar[str]
    sink: str
    error: str


@event("engine.failed")
class EngineFailed:
    """The execution thread stopped on an internal error (``error``: its type and message);
    every running and waiting request fails with ``service_unavailable`` after it, and
    ``/health`` answers 503 from then on."""
    kind: ClassVar[str]
    error: str


@event("fold.failed")
class FoldFailed:
    """The serving fold raised on record ``seq`` (of kind ``record_kind``; ``error``: the
    exception's type and message): that record was skipped by ``/metrics``, ``/telemetry`` and
    the dashboard, and counted in ``/telemetry`` ``events.fold_errors``; ``ninfer replay``
    skips and counts the same record."""
    kind: ClassVar[str]
    seq: int
    record_kind: str
    error: str


# --- requests -------------------------------------------------------------------------------

@event("request.received")
class RequestReceived:
    """A prepared generation request entered the engine's queue.

    ``protocol``: ``openai_chat_completions`` | ``openai_completions`` | ``openai_responses`` |
    ``anthropic_messages``; ``model``: the served id
    (Messages: its requested label is not the model); ``prompt_tokens``: rendered prompt length;
    ``max_tokens``: output cap and ``max_tokens_source`` (``client`` |
    ``client_clamped``: the client's, cut to what the context had left | ``server_default``);
    ``sampling``: the resolved parameters actually used; ``http_request_id``: the
    ``x-request-id`` of the HTTP response that carried it ("" from a client of the engine), so
    that an id a client logged finds its requests (``n`` choices share one);
    ``ignored_fields``: the request's fields served as if absent (array indices folded:
    ``tools[].defer_loading``; README "Request fields"); ``volatile_spans``: the known
    volatile prompt spans dropped before rendering (``api.volatile``: e.g.
    ``claude_code_billing_header``), so that the prompt's prefix is shared across sessions."""
    kind: ClassVar[str]
    request_id: str
    protocol: str
    model: str
    stream: bool
    message_count: int
    prompt_tokens: int
    max_tokens: int
    max_tokens_source: str
    sampling: dict
    http_request_id: str = ""
    ignored_fields: list = field(default_factory=list)
    volatile_spans: list = field(default_factory=list)


@event("request.admitted")
class RequestAdmitted:
    """The request got a lane. ``queue_s``: time from received to admitted."""
    kind: ClassVar[str]
    request_id: str
    lane: int
    queue_s: float
    cached_tokens: int = 0


@event("request.deferred")
class RequestDeferred:
    """A free lane was left to others: the request waits for ``builder_lane`` (serving
    ``builder_request``) to compute and publish the first ``tokens`` of the prompt they share
    up to a prompt-cache breakpoint (one builder per cold prefix, serving contract §1.7); it is
    admitted afterwards and restores that prefix (``cache.lookup``). Once per request."""
    kind: ClassVar[str]
    request_id: str
    builder_lane: int
    builder_request: str
    tokens: int


@event("request.rejected")
class RequestRejected:
    """Refused before it got a lane (e.g. queue full, queue timeout). ``code``: stable error
    code; ``http_request_id``: the HTTP response's ``x-request-id`` (as on
    ``request.received``); ``path``: the HTTP route of a request refused before its
    ``request.received`` (the 429 of a full queue; "" otherwise and in older logs)."""
    kind: ClassVar[str]
    request_id: str
    code: str
    message: str
    http_request_id: str = ""
    path: str = ""


@event("request.error")
class RequestError:
    """An HTTP request answered with an error that no engine record explains (``request.failed``
    and ``request.rejected`` cover those): a client mistake (400 ``unknown_parameter``,
    ``invalid_json``, ...; 404, 405, 408, 413), a store or slot refusal, an internal error
    (500). ``http_request_id``: the response's ``x-request-id``; ``method``, ``path``: the
    request line; ``status``: the HTTP status; ``code``, ``param``, ``message``: as in the
    error body ("" where the body has none)."""
    kind: ClassVar[str]
    http_request_id: str
    method: str
    path: str
    status: int
    code: str
    param: str
    message: str


@event("request.prefill_chunk")
class RequestPrefillChunk:
    """One prefill chunk ran. ``tokens``: prompt tokens computed; ``done_tokens``: prompt tokens
    computed so far including this chunk; ``duration_s``: wall time of the forward pass;
    ``prefill_lanes``: the lanes taking prefill chunks in turn when this one was chosen
    (``lane`` among them, oldest admission first; at most ``--max-prefill-lanes``);
    ``prefill_queued``: the prefilling lanes past that limit, waiting for a turn (both empty
    in logs written before they existed)."""
    kind: ClassVar[str]
    request_id: str
    lane: int
    tokens: int
    done_tokens: int
    prompt_tokens: int
    duration_s: float
    prefill_lanes: list = field(default_factory=list)
    prefill_queued: list = field(default_factory=list)


@event("request.first_token")
class RequestFirstToken:
    """The first output token was sampled. ``ttft_s``: received → first token."""
    kind: ClassVar[str]
    request_id: str
    lane: int
    ttft_s: float


@dataclass(frozen=True, slots=True)
class Timings:
    """Durations of one request, seconds (engine monotonic clock). ``prefill_s``: admitted to
    first token, other lanes' turns between its chunks included; ``prefill_compute_s``: its own
    prefill chunks' forward passes (llama.cpp's ``prompt_ms``; 0 in logs written before it)."""
    queue_s: float
    prefill_s: float
    decode_s: float
    ttft_s: float
    total_s: float
    prefill_compute_s: float = 0.0


@event("request.finished")
class RequestFinished:
    """The request completed. ``finish_reason``: ``stop_token`` | ``stop_string`` |
    ``output_limit`` | ``context_capacity`` | ``tool_calls`` (the API ended it after the one
    tool call ``parallel_tool_calls: false`` allows); ``timings``: a Timings as a dict; ``draft_n`` /
    ``draft_n_accepted``: tokens the MTP head drafted for it and how many verification accepted
    (0 without speculative decoding)."""
    kind: ClassVar[str]
    request_id: str
    lane: int
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    timings: dict
    draft_n: int = 0
    draft_n_accepted: int = 0


@event("request.failed")
class RequestFailed:
    """The request ended with an error after it was received. ``code``: stable error code."""
    kind: ClassVar[str]
    request_id: str
    lane: int
    code: str
    message: str
    completion_tokens: int = 0


@event("request.tool_calls")
class RequestToolCalls:
    """The API parsed tool calls out of a finished answer (serving contract §7.5), emitted
    before the reply's last byte: ``calls`` announced, of which ``incomplete`` (the output ended
    inside one) and ``invalid_arguments`` (closed but not a JSON object); ``discarded_bytes``:
    output after the first call that was dropped (not a call, or a call past the one allowed
    when parallel tool calls are off; whitespace not counted)."""
    kind: ClassVar[str]
    request_id: str
    calls: int
    incomplete: int
    invalid_arguments: int
    discarded_bytes: int


@event("request.cancelled")
class RequestCancelled:
    """The request was ended early and the lane (``-1`` if none yet) and its pages were freed.
    ``reason``: ``client_disconnected``, ``request_failed`` (another of its ``n`` choices
    failed), ``internal_error`` (an exception of the server's; a ``request.error`` follows)."""
    kind: ClassVar[str]
    request_id: str
    lane: int
    completion_tokens: int
    reason: str = "client_disconnected"


# --- scheduler and lanes --------------------------------------------------------------------

@event("scheduler.round")
class SchedulerRound:
    """One decode round over every decode-ready lane.

    ``lanes``: lane ids that decoded; ``tokens``: tokens committed (one per lane);
    ``duration_s``: wall time of the round (forward + sample + commit; with the decode lookahead
    a round is launched before the previous one's commit and counts from that commit: rounds
    tile the time); ``itl_s``: for each lane in ``lanes`` the time since that lane's previous
    token (inter-token latency)."""
    kind: ClassVar[str]
    round: int
    lanes: list
    tokens: int
    duration_s: float
    itl_s: list
    waiting: int = 0


@event("spec.round")
class SpecRound:
    """One speculative (MTP) decode round (``--spec mtp``), emitted with the round's
    ``scheduler.round`` (same ``round``; that one's ``tokens`` counts the tokens committed).

    ``lanes``: lane ids in the round; ``drafted`` / ``accepted``: per lane, tokens the MTP head
    drafted (``--draft-tokens``, fewer near ``max_tokens`` or the context end) and how many of
    them verification accepted (each lane also commits one token of its own past them);
    ``accepted_per_position``: for draft position 1..k, the lanes whose draft there was
    accepted (non-increasing); ``duration_s``: draft + verify + commit wall time."""
    kind: ClassVar[str]
    round: int
    lanes: list
    drafted: list
    accepted: list
    accepted_per_position: list
    duration_s: float


@event("lane.assigned")
class LaneAssigned:
    """A lane was bound to a request; ``pages``: KV pages it holds after assignment."""
    kind: ClassVar[str]
    lane: int
    request_id: str
    n_ctx: int
    pages: int


@event("lane.released")
class LaneReleased:
    """A lane became idle; its KV pages (``pages_freed``) returned to the pool."""
    kind: ClassVar[str]
    lane: int
    request_id: str
    pages_freed: int
    free_pages: int


@event("lane.retained")
class LaneRetained:
    """A lane became idle and keeps its request's computed prefix for reuse (L1 prefix reuse):
    ``tokens`` positions of KV (and, on hybrid models, the recurrent state at exactly that
    frontier) in ``pages`` pages; ``pages_freed``: pages past the frontier returned to the pool;
    ``session_digest``: opaque 16-hex digest of the retained token ledger (``request_id`` ""
    when a slot restore, not a request, left the lane holding it);
    ``checkpoint_tokens`` / ``checkpoint_digest``: the lane's turn checkpoint (hybrid models;
    0 / "" when it holds none), ``anchor_tokens`` / ``anchor_digest`` its user-turn anchor;
    ``ring_tokens``: the depths of its past turn checkpoints, oldest first (the ring,
    ``--turn-checkpoints``);
    ``token_ids``: the retained ledger itself, only on a server that publishes KV-cache events
    (``--kv-events-endpoint``; empty otherwise)."""
    kind: ClassVar[str]
    lane: int
    request_id: str
    tokens: int
    pages: int
    pages_freed: int
    free_pages: int
    session_digest: str
    checkpoint_tokens: int = 0
    checkpoint_digest: str = ""
    anchor_tokens: int = 0
    anchor_digest: str = ""
    ring_tokens: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)


@event("lane.checkpointed")
class LaneCheckpointed:
    """A hybrid lane's prefill reached the request's turn checkpoint (``tokens`` deep: the end
    of the history before the generation opener) and its recurrent state, ``bytes``, was
    copied aside; a later prompt that keeps that history but not the rest of the lane's
    ledger resumes there (``restore_turn_checkpoint``). ``session_digest``: of the ledger up to
    the checkpoint."""
    kind: ClassVar[str]
    lane: int
    request_id: str
    tokens: int
    bytes: int
    session_digest: str


@event("lane.evicted")
class LaneEvicted:
    """A retained lane's prefix was dropped: ``reason`` ``reassigned`` (a request that cannot
    reuse it took the lane), ``truncated`` (a request reused only part of it: ``tokens`` is the
    part dropped), ``failed`` (its state was not kept consistent), ``restored`` (a slot restore
    replaced it) or ``erased`` (a slot erase); ``pages_freed`` pages returned to the pool."""
    kind: ClassVar[str]
    lane: int
    tokens: int
    pages_freed: int
    free_pages: int
    reason: str


@event("cache.lookup")
class CacheLookup:
    """Prefix reuse decided for a request at admission. ``path``: ``append_frontier`` (the
    prompt extends the lane's retained frontier), ``truncate_frontier`` (attention-only models:
    the retained KV was cut back to the longest common prefix), ``restore_turn_checkpoint``
    (hybrid models: the KV cut back to a checkpoint, ``lane.checkpointed``, and its recurrent
    state copied in: the lane's turn checkpoint, anchor or a ring entry, or one an L2 / L3
    image carried), ``full_reset`` (nothing
    reusable: cold prefill) or ``disabled`` (``--no-prefix-reuse``); ``cached_tokens``:
    prompt tokens not recomputed; ``candidates``: idle lanes holding a prefix when it was
    decided; ``source``: ``l1`` (a retained lane), ``l2`` / ``l3`` (a host or disk image
    restored into the lane, ``cache.restored``) or ``none``; ``routed``: the lane held the
    request's own session (its session key, ``session``: ``prompt_cache_key``, ``user_id`` or
    ``root``; a routing hint: the reuse is still the tokens');
    ``shared_tokens``: the longest prefix of the prompt that an idle lane or an L2 / L3 image
    held, whatever could be reused of it (the depth of the first divergent token): above
    ``cached_tokens``, reuse missed by policy (a hybrid state rewinds only to its frontier and
    checkpoints; lane choice), not because the prompt changed; ``resumed_from``: where the
    reused state came from: ``frontier`` (a lane's retained frontier, or a cut of it),
    ``turn_checkpoint``, ``anchor``, ``ring`` (a lane's rewind points), ``l2`` / ``l3`` (an
    image), ``miss`` (nothing reused); "" in logs written before it existed."""
    kind: ClassVar[str]
    request_id: str
    lane: int
    prompt_tokens: int
    cached_tokens: int
    path: str
    candidates: int
    source: str
    routed: bool = False
    shared_tokens: int = 0
    resumed_from: str = ""
    session: str = ""


@event("cache.demoted")
class CacheDemoted:
    """A retained lane's prefix was copied to a lower tier before the lane lost it: ``tokens``
    positions, ``bytes`` of image; ``admitted`` False when the tier refused it (larger than its
    budget; when its ledger and K / V alone are, it is not copied out and ``bytes`` counts
    those); ``entries`` / ``tier_bytes``: the tier's occupancy after."""
    kind: ClassVar[str]
    lane: int
    tier: str
    tokens: int
    bytes: int
    admitted: bool
    entries: int
    tier_bytes: int


@event("cache.published")
class CachePublished:
    """A request's prompt prefix up to one of its prompt-cache breakpoints (``tokens``
    positions: the end of the system / tools prefix, or an explicit breakpoint; serving
    contract §1.7) was copied out of its lane during prefill, ``bytes`` of image in
    ``duration_s`` (on the execution thread), and published to ``tiers`` (``l2`` admitted,
    ``l3`` queued: ``store.persisted`` follows); empty when no tier took it (larger than the
    L2 budget, the L3 writer busy). ``session_digest``: of those tokens. A prefix every tier
    already holds is not copied again (no event). ``l2_entries`` / ``l2_bytes``: L2's
    occupancy after (0 without L2). ``token_ids``: those tokens, only with
    ``--kv-events-endpoint`` (as on ``lane.retained``)."""
    kind: ClassVar[str]
    request_id: str
    lane: int
    tokens: int
    bytes: int
    tiers: list
    session_digest: str
    duration_s: float
    l2_entries: int = 0
    l2_bytes: int = 0
    token_ids: list = field(default_factory=list)


@event("cache.restored")
class CacheRestored:
    """A request's prefix was copied from a lower tier into its lane: ``tokens`` positions,
    ``bytes`` copied (the whole image, or its K / V up to ``tokens`` when the prompt reuses
    less of it), in ``duration_s`` seconds (on the execution thread)."""
    kind: ClassVar[str]
    request_id: str
    lane: int
    tier: str
    tokens: int
    bytes: int
    duration_s: float


@event("cache.evicted")
class CacheEvicted:
    """A tier dropped an image: to make room (``reason`` ``capacity``), or because an image it
    admitted extends it (``superseded``: L2 on attention-only models); ``entries`` /
    ``tier_bytes``: the tier's occupancy after; ``session_digest``: of the image's ledger."""
    kind: ClassVar[str]
    tier: str
    tokens: int
    bytes: int
    reason: str
    entries: int
    tier_bytes: int
    session_digest: str = ""


@event("slot.action")
class SlotAction:
    """``POST /slots/{id}?action=save|restore|erase`` that passed the request's own checks (id,
    action, body, filename: else a ``request.error``) ended (``ok``; else ``code``, the error
    code the client got): ``tokens`` saved / restored / erased, ``bytes`` written or read,
    ``duration_s`` end to end (engine boundary and file), ``session_digest`` the lane holds
    after a save or restore ("" otherwise), ``http_request_id`` the response's
    ``x-request-id`` (a refusal here is not also a ``request.error``)."""
    kind: ClassVar[str]
    lane: int
    action: str
    filename: str
    ok: bool
    code: str
    tokens: int
    bytes: int
    duration_s: float
    session_digest: str
    http_request_id: str = ""


@event("cache.restore_refused")
class CacheRestoreRefused:
    """An image a request would have restored from ``tier`` did not fit its lane's cache
    (``error``); the lane was left empty and the request prefills its whole prompt."""
    kind: ClassVar[str]
    request_id: str
    lane: int
    tier: str
    tokens: int
    error: str


# --- auto-save spills (their own module, re-exported here) ------------------------------------

from .spill_events import SlotSpilled, SlotSpillFailed  # noqa: E402,F401
from .store_events import (StoreDisabled, StoreEntryDropped, StoreOpened,  # noqa: E402,F401
                           StorePersisted, StorePersistFailed, StoreQuarantined)


# --- telemetry ------------------------------------------------------------------------------

@event("telemetry.sample")
class TelemetrySample:
    """Instantaneous readings, taken every ``--telemetry-interval-ms`` and recorded when they
    changed, else every 10 s (``ninfer.sampler.sample_changed``; ``interval_s``: the reading
    interval).

    ``gpu``: NVML readings (``available``, ``name``, ``uuid``, ``driver_version``,
    ``temperature_c``, ``power_watts``, ``power_limit_watts``, ``sm_clock_mhz``,
    ``memory_clock_mhz``, ``utilization_gpu_percent``, ``utilization_memory_percent``,
    ``memory_used_bytes``, ``memory_total_bytes``, ``throttle_reasons``) or
    ``{available: false, reason}``; ``scheduler``: occupancy (``running``, ``prefilling``,
    ``decode_ready``, ``waiting``, ``free_pages``, ``total_pages``, ``retained_lanes``,
    ``retained_pages``); ``worker_seconds``:
    cumulative execution-thread wall clock by activity (prefill, decode, admission, upkeep,
    idle), seconds."""
    kind: ClassVar[str]
    interval_s: float
    gpu: dict
    scheduler: dict
    worker_seconds: dict


__all__ = ["SCHEMA_VERSION", "REGISTRY", "Record", "Timings", "SchemaError", "SchemaTooNew",
           "UnknownEventKind", "all_kinds", "event", "field"]

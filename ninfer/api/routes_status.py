"""The read-only routes: health, models, props, metrics, telemetry, slots and the event
stream. Every answer comes from the event log's folds (``state.bus.flush()`` first: what was
emitted before the request is in them), or from the configuration."""
from __future__ import annotations

import importlib.metadata
import json
import time

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from quart import Response, request

from ..events.fleet import worker_load
from ..events.sinks import InvalidLastEventId
from ..events.telemetry import slots_table, telemetry_snapshot
from .errors import ApiError, model_not_found
from .streaming import SSE_HEADERS

try:
    _VERSION = importlib.metadata.version("ninfer")
except importlib.metadata.PackageNotFoundError:   # a checkout on PYTHONPATH, not installed
    _VERSION = "0+checkout"
ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]


def live_readings(state) -> dict:
    """What ``/telemetry`` adds to the fold: the clock, the uptime and the event sinks."""
    jsonl = [s for s in state.bus.sinks if s.name == "jsonl"]
    return {"timestamp_unix_ms": int(time.time() * 1000),
            "uptime_seconds": time.time() - state.started_unix,
            "events": {"jsonl_enabled": bool(jsonl), "subscribers":
                       state.hub.subscriber_count}}


class StatusRoutes:
    """The read-only routes of one ServerState."""

    def __init__(self, state):
        self.state = state

    async def health(self):
        state = self.state
        state.bus.flush()   # (from the log: engine.failed)
        failed = state.folds.state.engine_error
        if failed:
            raise ApiError(503, f"the engine stopped after an internal error ({failed[:200]})",
                           "service_unavailable")
        return {"status": "ok"}

    def _model_object(self) -> dict:
        state = self.state
        return {"id": state.model_id, "object": "model", "created": state.started_unix,
                "owned_by": "ninfer", "context_window": state.n_ctx,
                "supported_endpoints": list(ENDPOINTS),
                # vLLM's fields, read by gateways at registration (smg: the context length)
                "root": state.model_path, "max_model_len": state.n_ctx}

    async def models(self):
        return {"object": "list", "data": [self._model_object()]}

    async def one_model(self, model_id: str):
        if model_id != self.state.model_id:
            raise model_not_found(model_id, self.state.model_id)
        return self._model_object()

    async def props(self):
        """``GET /props``: llama-server's server properties (what its web UI and clients read
        for the context size, the slots and the chat template)."""
        state, cfg = self.state, self.state.config
        return {"default_generation_settings": {
                    "n_ctx": state.n_ctx,
                    "params": {"temperature": cfg.temperature, "top_k": cfg.top_k,
                               "top_p": cfg.top_p, "min_p": cfg.min_p,
                               "n_predict": cfg.default_max_tokens,
                               "seed": -1 if cfg.seed is None else cfg.seed}},
                "total_slots": cfg.max_concurrency, "model_path": state.model_path,
                "model_alias": state.model_id, "chat_template": state.template.source,
                "bos_token": state.template.bos_token, "eos_token": state.template.eos_token,
                "modalities": {"vision": False, "audio": False},
                "build_info": f"ninfer {_VERSION}"}

    async def loads(self):
        """``GET /v1/loads`` (and ``/loads``): SGLang's load document, which smg polls for
        load-aware and cache-aware routing (``events.fleet``)."""
        self.state.bus.flush()
        return worker_load(self.state.folds.state, _VERSION)

    async def metrics(self):
        self.state.bus.flush()
        return Response(generate_latest(self.state.registry), content_type=CONTENT_TYPE_LATEST)

    async def telemetry(self):
        self.state.bus.flush()
        return telemetry_snapshot(self.state.folds.state, live_readings(self.state))

    async def slots(self):
        self.state.bus.flush()
        return Response(json.dumps(slots_table(self.state.folds.state)),
                        content_type="application/json")

    async def events(self):
        """``GET /events``: the event log as SSE, from the hub's backlog (``Last-Event-ID``
        resumes after the last record a reconnecting EventSource got)."""
        hub, cfg = self.state.hub, self.state.config
        if request.http_version not in ("1.0", "1.1"):
            # over HTTP/2 a client that never opens its flow-control window is not seen:
            # hypercorn takes the stream's bytes into a buffer without bound, and neither
            # --send-timeout-s (the socket drains) nor the hub's ring (it is read) stops it
            raise ApiError(505, "GET /events streams over HTTP/1.1 only (HTTP/2 streams "
                           "cannot be cut off when their client stops reading)",
                           "http_version_not_supported")
        try:
            sub = hub.subscribe(request.headers.get("Last-Event-ID"))
        except InvalidLastEventId as exc:
            raise ApiError(400, str(exc), "invalid_value", "Last-Event-ID") from None

        async def gen():
            try:
                while True:
                    items = await hub.next_items(sub, cfg.sse_keepalive_s)
                    if items:
                        yield "".join(
                            (f"id: {it.event_id}\n" if it.event_id else "")
                            + f"event: {it.kind}\ndata: {it.line}\n\n" for it in items)
                    if hub.closed:   # the server is stopping: end the stream, do not cut it
                        return
                    if not items:
                        yield ": keepalive\n\n"
            finally:
                hub.unsubscribe(sub)

        return Response(gen(), mimetype="text/event-stream", headers=SSE_HEADERS)

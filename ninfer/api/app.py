"""The HTTP app (QuartTrio): OpenAI chat completions, models, health, metrics and events.

Each HTTP request runs in its own task; a client that goes away cancels it, and the ``finally``
blocks below turn that into ``Engine.cancel`` so the lane and its pages are freed at the next
engine boundary. Errors are OpenAI-shaped (``ninfer.api.errors``); a client mistake is never a 500.
"""
from __future__ import annotations

import hmac
import itertools
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from quart import Response, g, request, send_from_directory
from quart_trio import QuartTrio

from ..events.dashboard import dashboard_view
from ..events.metrics import counters
from ..events.schema import SchemaTooNew
from ..events.sinks import InvalidLastEventId
from ..events.telemetry import slots_table, telemetry_snapshot
from ..replay import replay_bytes, report
from . import fields
from . import origin
from .chat import RETRY_AFTER_S, SSE_HEADERS, ChatHandler
from .completions import CompletionsHandler
from .messages import MessagesHandler
from .responses import ResponsesHandler
from .slots import SlotHandler
from .errors import ApiError, error_record, internal_error, model_not_found


DEFAULT_WEB_DIR = Path(__file__).resolve().parents[2] / "web" / "dist"


@dataclass
class ServerState:
    """Everything the app needs. ``folds`` is the FoldSink holding the serving fold's state
    (``events.fold``); ``hub`` the SSE hub; ``registry`` the prometheus registry over it."""
    engine: object
    bus: object
    tokenizer: object
    template: object
    config: object
    model_id: str
    n_ctx: int
    folds: object
    hub: object
    registry: object
    recorder: object = None
    artifact_sha256: str = ""
    # what a stored session must match to be restored here (artifact + cache layout): the L3
    # store's identity, also the slot files'
    runtime_identity: dict = field(default_factory=dict)
    started_unix: int = 0


class _App(QuartTrio):
    """QuartTrio whose HTTP sends are shielded from the request's own cancellation.

    Quart-Trio cancels a request's task group as soon as the request has both sent its
    response and received ``http.disconnect``. Hypercorn closes a connection (the client sent
    ``Connection: close``, or HTTP/1.0) from inside the app's last ``send``, and delivers
    that ``http.disconnect`` before it closes. The cancellation then interrupted the close, so
    the socket was never shut: a client that reads to EOF hung, and the connection leaked
    (quart-trio 0.12, hypercorn 0.18). Only HTTP/1 sends are shielded: there hypercorn
    already shields its socket writes, so shielding the whole send changes nothing else."""

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("http_version") in ("1.0", "1.1"):
            # (HTTP/2's sends wait on flow control and its buffer's drain, which only a
            # cancellation ends for a client that stops reading: never shield those)
            inner = send

            async def send(message):
                with trio.CancelScope(shield=True):
                    await inner(message)
        await super().__call__(scope, receive, send)


def create_app(state: ServerState) -> QuartTrio:
    app = _App("ninfer")
    cfg = state.config
    app.config["RESPONSE_TIMEOUT"] = None
    # a slow upload holds an admission slot: bound it by the same deadline as the queue
    app.config["BODY_TIMEOUT"] = max(cfg.pending_timeout_ms / 1000.0, 1.0)
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_request_mib << 20
    app.json.sort_keys = False

    # serving contract §1.2: the key on every route but /health (and a CORS preflight), an
    # x-request-id on every response, permissive CORS with --cors
    request_ids = itertools.count(1)
    id_prefix = f"{os.getpid():x}-{secrets.token_hex(3)}-"
    cors_headers = {
        "Access-Control-Allow-Origin": "*",
        "Access-Control-Allow-Headers": "Authorization, Content-Type, OpenAI-Organization, "
                                        "OpenAI-Project, X-API-Key, Anthropic-Version, "
                                        "Anthropic-Beta, X-Stainless-*",
        "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
        "Access-Control-Expose-Headers": "x-request-id, request-id, Retry-After, "
                                         + fields.HEADER}

    def anthropic_route() -> bool:
        return request.path.startswith("/v1/messages")

    @app.before_request
    async def _request_id():
        g.request_id = id_prefix + str(next(request_ids))   # before the handler: the log has it

    # what a web page in the user's browser may not do (ninfer/api/origin.py): reach us under
    # a name of its own (DNS rebinding), POST from another origin, or POST a body that needs no
    # CORS preflight (text/plain, a form, no type); before the key check, which stops neither
    # on a server without --api-key
    host_names = origin.local_names(cfg.host, cfg.allowed_host_names())

    @app.before_request
    async def _browser_guard():
        host = request.headers.get("Host", "")
        if not origin.host_allowed(host, host_names):
            raise ApiError(403, f"Host {host[:200]!r} is not a name of this server (a page "
                           "re-pointing its own name at it would send that): use its address, "
                           "or start the server with --allowed-hosts NAME", "host_not_allowed")
        page = request.headers.get("Origin")
        if page is not None and not cfg.cors and request.method not in ("GET", "HEAD",
                                                                        "OPTIONS") \
                and not origin.origin_allowed(page, host):
            raise ApiError(403, f"{request.method} from the web page origin {page[:200]!r} "
                           "refused: start the server with --cors to serve pages of other "
                           "origins", "origin_not_allowed")

    @app.before_request
    async def _auth():
        if cfg.cors and request.method == "OPTIONS":
            # allow whatever headers the client asks for (the SDKs send X-Stainless-*,
            # anthropic-dangerous-direct-browser-access, ...: a listed prefix is no wildcard)
            asked = request.headers.get("Access-Control-Request-Headers")
            return Response("", status=204, headers={
                **cors_headers, **({"Access-Control-Allow-Headers": asked} if asked else {})})
        if cfg.api_key is None or request.path == "/health":
            return None
        auth = request.headers.get("Authorization", "")
        given = auth[7:] if auth.startswith("Bearer ") else request.headers.get("x-api-key")
        if given is None or not hmac.compare_digest(given.encode(), cfg.api_key.encode()):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY or "
                           "x-api-key: KEY)", "invalid_api_key")
        return None

    @app.before_request
    async def _json_body():
        if request.method != "POST":
            return None
        replay = request.path == "/dashboard/replay"   # a JSONL log
        ctype = request.headers.get("Content-Type", "")
        if origin.json_media_type(ctype, origin.NDJSON_TYPES if replay else ()):
            return None
        if request.content_length == 0 or (request.content_length is None
                                            and not await request.get_data()):
            return None   # a body-less action (curl -X POST '.../slots/0?action=erase')
        want = "application/x-ndjson" if replay else "application/json"
        raise ApiError(415, f"the request body must be sent as Content-Type: {want} (got "
                       f"{ctype[:100] or 'none'!r}; curl: -H 'content-type: {want}')",
                       "unsupported_media_type")

    @app.after_request
    async def _common_headers(response):
        rid = g.get("request_id") or id_prefix + str(next(request_ids))
        response.headers["x-request-id"] = rid
        if anthropic_route():
            response.headers["request-id"] = rid   # (the header Anthropic's SDKs read)
        if g.get("ignored_fields"):   # the fields the request was served without (fields.py)
            response.headers[fields.HEADER] = fields.header_value(g.ignored_fields)
        if cfg.cors:
            for k, v in cors_headers.items():
                response.headers.setdefault(k, v)
        return response

    def render(err: ApiError, headers: dict | None = None):
        """The error response: Anthropic's envelope on ``/v1/messages*``, else OpenAI's; and
        a ``request.error`` record unless an engine record already explains it, so that the
        x-request-id a client got finds its error in the log."""
        if not err.logged:
            state.bus.emit(error_record(err, g.get("request_id", ""), request.method,
                                        request.path))
        body = err.anthropic_body() if anthropic_route() else err.body()
        out = {**(err.headers or {}), **(headers or {})}
        # every "try again later" says when (contract §1.2); an engine that stopped for good
        # (service_unavailable: restart the server) is not one
        if err.status in (429, 503) and err.code != "service_unavailable":
            out.setdefault("Retry-After", str(RETRY_AFTER_S))
        return body, err.status, out

    @app.errorhandler(ApiError)
    async def _api_error(err: ApiError):
        return render(err)

    @app.errorhandler(413)
    async def _too_large(_err):
        return render(ApiError(413, "request body too large", "request_too_large"))

    @app.errorhandler(404)
    async def _not_found(_err):
        return render(ApiError(404, f"no route {request.method} {request.path}", "not_found"))

    @app.errorhandler(405)
    async def _bad_method(err):
        allow = ", ".join(sorted(getattr(err, "valid_methods", None) or []))
        return render(ApiError(405, f"method {request.method} not allowed on {request.path}",
                               "method_not_allowed"), {"Allow": allow} if allow else None)

    @app.errorhandler(408)
    async def _body_timeout(_err):
        return render(ApiError(408, "the request body did not arrive in time",
                               "request_timeout"))

    @app.errorhandler(Exception)
    async def _internal(err: Exception):
        app.logger.exception("internal error", exc_info=err)
        return render(internal_error())

    @app.get("/health")
    async def health():
        state.bus.flush()   # (from the log: engine.failed)
        failed = state.folds.state.engine_error
        if failed:
            raise ApiError(503, f"the engine stopped after an internal error ({failed[:200]})",
                           "service_unavailable")
        return {"status": "ok"}

    def model_object() -> dict:
        return {"id": state.model_id, "object": "model", "created": state.started_unix,
                "owned_by": "ninfer", "context_window": state.n_ctx,
                "supported_endpoints": ["/v1/chat/completions", "/v1/completions",
                                        "/v1/responses", "/v1/messages"]}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_object()]}

    @app.get("/v1/models/<path:model_id>")
    async def one_model(model_id: str):
        if model_id != state.model_id:
            raise model_not_found(model_id, state.model_id)
        return model_object()

    @app.get("/metrics")
    async def metrics():
        state.bus.flush()
        return Response(generate_latest(state.registry), content_type=CONTENT_TYPE_LATEST)

    def _live() -> dict:
        jsonl = [s for s in state.bus.sinks if s.name == "jsonl"]
        return {"timestamp_unix_ms": int(time.time() * 1000),
                "uptime_seconds": time.time() - state.started_unix,
                "events": {"jsonl_enabled": bool(jsonl), "subscribers":
                           state.hub.subscriber_count}}

    @app.get("/telemetry")
    async def telemetry():
        state.bus.flush()
        return telemetry_snapshot(state.folds.state, _live())

    web_dir = Path(cfg.web_dir) if cfg.web_dir else DEFAULT_WEB_DIR

    @app.get("/")
    async def dashboard_page():
        index = web_dir / "index.html"
        if not index.is_file():
            return Response(f"The dashboard is not built ({index} is missing): run "
                            f"npm ci --prefix web && npm run build --prefix web",
                            status=404, content_type="text/plain")
        return await send_from_directory(web_dir, "index.html")

    @app.get("/<path:name>.<any(js,css):ext>")
    async def dashboard_asset(name: str, ext: str):
        return await send_from_directory(web_dir, f"{name}.{ext}")

    @app.get("/dashboard/state")
    async def dashboard_state():
        state.bus.flush()
        folded = state.folds.state
        return {"dashboard": dashboard_view(folded),
                "telemetry": telemetry_snapshot(folded, _live()),
                "counters": counters(folded)}

    @app.post("/dashboard/replay")
    async def dashboard_replay():
        data = await request.get_data()
        try:
            res = replay_bytes(data)
        except SchemaTooNew as exc:
            raise ApiError(400, str(exc), "schema_too_new") from None
        if res.records == 0:
            raise ApiError(400, "no ninfer records in this file", "invalid_log")
        _, snapshot, _ = report(res)
        return {"dashboard": dashboard_view(res.state), "telemetry": snapshot,
                "counters": counters(res.state), "replay": snapshot.pop("replay")}

    @app.get("/slots")
    async def slots():
        state.bus.flush()
        return Response(json.dumps(slots_table(state.folds.state)),
                        content_type="application/json")

    slot_handler = SlotHandler(state)

    @app.post("/slots/<slot_id>")
    async def slot_action(slot_id: str):
        return await slot_handler.handle(slot_id)

    @app.get("/events")
    async def events():
        hub = state.hub
        if request.http_version not in ("1.0", "1.1"):
            # over HTTP/2 a client that never opens its flow-control window is not seen:
            # hypercorn takes the stream's bytes into a buffer without bound, and neither
            # --send-timeout-s (the socket drains) nor the hub's ring (it is read) stops it
            raise ApiError(505, "GET /events streams over HTTP/1.1 only (HTTP/2 streams "
                           "cannot be cut off when their client stops reading)",
                           "http_version_not_supported")
        try:   # an EventSource that reconnects resumes after the last record it got
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

    chat = ChatHandler(state)
    app.chat_handler = chat
    # one admission for both protocols: a request-lifetime slot per request, whichever route
    messages = MessagesHandler(state, admission=chat)
    app.messages_handler = messages

    @app.post("/v1/chat/completions")
    async def chat_completions():
        return await chat.handle()

    completions = CompletionsHandler(state, admission=chat)
    app.completions_handler = completions

    @app.post("/v1/completions")
    async def openai_completions():
        return await completions.handle()

    @app.post("/v1/messages")
    async def anthropic_messages():
        return await messages.handle()

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens():
        return await messages.count_tokens()

    responses = ResponsesHandler(state, admission=chat,
                                 max_records=state.config.response_store_max_records,
                                 max_bytes=state.config.response_store_max_mib << 20)
    app.responses_handler = responses

    @app.post("/v1/responses")
    async def openai_responses():
        return await responses.handle()

    @app.get("/v1/responses/<rid>")
    async def openai_response(rid: str):
        return responses.retrieve(rid)

    @app.delete("/v1/responses/<rid>")
    async def openai_response_delete(rid: str):
        return responses.delete(rid)

    @app.get("/v1/responses/<rid>/input_items")
    async def openai_response_input_items(rid: str):
        return responses.input_items(rid, request.args)

    return app

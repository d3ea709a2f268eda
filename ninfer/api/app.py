"""The HTTP app (QuartTrio): its routes, and the state they serve.

Each HTTP request runs in its own task; a client that goes away cancels it, and the request's
cleanup turns that into ``Engine.cancel`` so the lane and its pages are freed at the next
engine boundary (``pipeline``). Guards and common headers: ``middleware``; error bodies:
``http_errors``; the protocols: ``chat``, ``completions``, ``messages``, ``responses`` over one
``admission``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import trio
from quart_trio import QuartTrio

from .admission import Admission
from .chat import ChatHandler
from .completions import CompletionsHandler
from .http_errors import install_error_handlers
from .messages import MessagesHandler
from .middleware import install_middleware
from .prompt import ChatPrompt
from .responses import ResponsesHandler
from .routes_dashboard import DashboardRoutes
from .routes_status import StatusRoutes
from .slots import SlotHandler
from .tokenize import TokenizeHandler


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
    model_path: str = ""   # the model file served (the default model resolved), vLLM's "root"


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
    cfg = state.config
    app = _App("ninfer")
    app.config["RESPONSE_TIMEOUT"] = None
    # a slow upload holds an admission slot: bound it by the same deadline as the queue
    app.config["BODY_TIMEOUT"] = max(cfg.pending_timeout_ms / 1000.0, 1.0)
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_request_mib << 20
    app.json.sort_keys = False
    install_middleware(app, cfg)
    install_error_handlers(app, state)

    # one admission for every protocol: a request-lifetime slot per request, whichever route
    admission, prompt = Admission(state), ChatPrompt(state)
    app.chat_handler = chat = ChatHandler(state, admission, prompt)
    app.completions_handler = completions = CompletionsHandler(state, admission)
    app.messages_handler = messages = MessagesHandler(state, admission, prompt)
    app.responses_handler = responses = ResponsesHandler(
        state, admission, prompt, max_records=cfg.response_store_max_records,
        max_bytes=cfg.response_store_max_mib << 20)
    status, dashboard, slots = StatusRoutes(state), DashboardRoutes(state), SlotHandler(state)
    tokenize = TokenizeHandler(state, chat)

    def route(method: str, rule: str, view) -> None:
        app.add_url_rule(rule, f"{method} {rule}", view, methods=[method])

    route("GET", "/health", status.health)
    route("GET", "/api/hello", status.health)   # Claude Code's reachability probe (HEAD)
    route("GET", "/v1/models", status.models)
    route("GET", "/v1/models/<path:model_id>", status.one_model)
    route("GET", "/props", status.props)
    route("GET", "/v1/loads", status.loads)
    route("GET", "/loads", status.loads)
    route("GET", "/metrics", status.metrics)
    route("GET", "/telemetry", status.telemetry)
    route("GET", "/slots", status.slots)
    route("POST", "/slots/<slot_id>", slots.handle)
    route("GET", "/events", status.events)
    route("GET", "/", dashboard.page)
    route("GET", "/<path:name>.<any(js,css):ext>", dashboard.asset)
    route("GET", "/dashboard/state", dashboard.folded_state)
    route("POST", "/dashboard/replay", dashboard.replay)
    route("POST", "/v1/chat/completions", chat.handle)
    route("POST", "/v1/completions", completions.handle)
    route("POST", "/v1/messages", messages.handle)
    route("POST", "/v1/messages/count_tokens", messages.count_tokens)
    route("POST", "/tokenize", tokenize.handle)
    route("POST", "/v1/responses", responses.handle)
    route("GET", "/v1/responses/<rid>", responses.retrieve)
    route("DELETE", "/v1/responses/<rid>", responses.delete)
    route("GET", "/v1/responses/<rid>/input_items", responses.input_items)
    return app

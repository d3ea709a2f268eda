"""The HTTP app (QuartTrio): OpenAI chat completions, models, health, metrics and events.

Each HTTP request runs in its own task; a client that goes away cancels it, and the ``finally``
blocks below turn that into ``Engine.cancel`` so the lane and its pages are freed at the next
engine boundary. Errors are OpenAI-shaped (``ninfer.api.errors``); a client mistake is never a 500.
"""
from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass

import trio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from quart import Response, request
from quart_trio import QuartTrio

from ..engine.chat_template import TemplateError
from ..engine.engine import ErrorOutput, FinalOutput, Request, TokenOutput
from ..engine.sampling import SamplingError, SamplingParams
from ..events.telemetry import slots_table, telemetry_snapshot
from .chat_request import parse_chat_request
from .errors import ApiError, internal_error

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ServerState:
    """Everything the app needs. ``metrics`` is the FoldSink holding the metrics fold;
    ``hub`` the SSE hub; ``registry`` the prometheus registry over ``metrics``."""
    engine: object
    bus: object
    tokenizer: object
    template: object
    config: object
    model_id: str
    n_ctx: int
    metrics: object
    hub: object
    registry: object
    telemetry: object = None
    recorder: object = None
    artifact_sha256: str = ""
    started_unix: int = 0


def _timings(final: FinalOutput) -> dict:
    t = final.timings
    prompt_ms = t["prefill_s"] * 1000.0
    predicted_ms = t["decode_s"] * 1000.0
    out = {"prompt_n": final.prompt_tokens, "prompt_ms": prompt_ms,
           "predicted_n": final.completion_tokens, "predicted_ms": predicted_ms}
    if prompt_ms > 0:
        out["prompt_per_second"] = final.prompt_tokens / t["prefill_s"]
    if predicted_ms > 0 and final.completion_tokens > 1:
        out["predicted_per_second"] = (final.completion_tokens - 1) / t["decode_s"]
    if t["ttft_s"] > 0:
        out["ttft_ms"] = t["ttft_s"] * 1000.0
    if final.cached_tokens > 0:
        out["cache_n"] = final.cached_tokens
    return out


def _usage(final: FinalOutput) -> dict:
    return {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens,
            "total_tokens": final.prompt_tokens + final.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": final.cached_tokens}}


def _sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def create_app(state: ServerState) -> QuartTrio:
    app = QuartTrio("ninfer")
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 600
    app.config["MAX_CONTENT_LENGTH"] = 64 * 1024 * 1024
    app.json.sort_keys = False
    cfg = state.config

    @app.errorhandler(ApiError)
    async def _api_error(err: ApiError):
        return err.body(), err.status

    @app.errorhandler(413)
    async def _too_large(_err):
        e = ApiError(413, "request body too large", "request_too_large")
        return e.body(), 413

    @app.errorhandler(404)
    async def _not_found(_err):
        return ApiError(404, f"no route {request.method} {request.path}", "not_found").body(), 404

    @app.errorhandler(405)
    async def _bad_method(_err):
        return ApiError(405, f"method {request.method} not allowed on {request.path}",
                        "method_not_allowed").body(), 405

    @app.errorhandler(Exception)
    async def _internal(err: Exception):
        app.logger.exception("internal error", exc_info=err)
        return internal_error().body(), 500

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.model_id, "object": "model", "created": state.started_unix,
            "owned_by": "ninfer", "context_window": state.n_ctx}]}

    @app.get("/metrics")
    async def metrics():
        state.bus.flush()
        return Response(generate_latest(state.registry), content_type=CONTENT_TYPE_LATEST)

    @app.get("/telemetry")
    async def telemetry():
        state.bus.flush()
        jsonl = [s for s in state.bus.sinks if s.name == "jsonl"]
        live = {"timestamp_unix_ms": int(time.time() * 1000),
                "uptime_seconds": time.time() - state.started_unix,
                "events": {"jsonl_enabled": bool(jsonl), "subscribers":
                           state.hub.subscriber_count}}
        return telemetry_snapshot(state.telemetry.state, live)

    @app.get("/slots")
    async def slots():
        state.bus.flush()
        return Response(json.dumps(slots_table(state.telemetry.state)),
                        content_type="application/json")

    @app.get("/events")
    async def events():
        hub = state.hub
        sub = hub.subscribe()

        async def gen():
            try:
                while True:
                    items = await hub.next_items(sub, cfg.sse_keepalive_s)
                    if not items:
                        yield ": keepalive\n\n"
                        continue
                    yield "".join(f"event: {kind}\ndata: {line}\n\n" for kind, line in items)
            finally:
                hub.unsubscribe(sub)

        return Response(gen(), mimetype="text/event-stream", headers=SSE_HEADERS)

    @app.post("/v1/chat/completions")
    async def chat_completions():
        raw = await request.get_data()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from None
        creq = parse_chat_request(body)
        if creq.model is not None and creq.model != state.model_id:
            raise ApiError(404, f"model '{creq.model}' not found; this server serves "
                           f"'{state.model_id}'", "model_not_found", "model")
        try:
            prompt = state.template.render(creq.messages, tools=creq.tools,
                                           add_generation_prompt=True)
        except TemplateError as exc:
            raise ApiError(400, f"chat template error: {exc}", None, "messages") from None
        prompt_ids = state.tokenizer.encode(prompt)
        n_prompt = len(prompt_ids)
        if n_prompt + (creq.max_tokens or 1) > state.n_ctx:
            raise ApiError(400, f"the request needs {n_prompt} prompt tokens"
                           + (f" + {creq.max_tokens} output tokens" if creq.max_tokens else "")
                           + f", more than the context window of {state.n_ctx} tokens",
                           "context_length_exceeded", "messages",
                           {"n_prompt_tokens": n_prompt, "n_ctx": state.n_ctx})
        source = "client" if creq.max_tokens else "server_default"
        max_tokens = creq.max_tokens or min(cfg.default_max_tokens, state.n_ctx - n_prompt)
        seed = creq.seed if creq.seed is not None else (
            cfg.seed if cfg.seed is not None else secrets.randbits(63))
        try:
            params = SamplingParams(
                temperature=1.0 if creq.temperature is None else creq.temperature,
                top_k=creq.top_k or 0, top_p=1.0 if creq.top_p is None else creq.top_p,
                min_p=creq.min_p or 0.0, seed=seed)
        except SamplingError as exc:
            raise ApiError(400, str(exc)) from None
        rid = "chatcmpl-" + secrets.token_hex(8)
        created = int(time.time())
        send, recv = trio.open_memory_channel(math.inf)
        ereq = Request(request_id=rid, prompt_ids=prompt_ids, params=params,
                       max_tokens=max_tokens, deliver=send.send_nowait, stop=creq.stop,
                       protocol="openai_chat_completions", model=state.model_id,
                       stream=creq.stream, message_count=len(creq.messages),
                       max_tokens_source=source)
        base = {"id": rid, "created": created, "model": state.model_id}
        state.engine.submit(ereq)
        if creq.stream:
            return Response(_stream(state, ereq, recv, base, creq.include_usage, body),
                            mimetype="text/event-stream", headers=SSE_HEADERS)
        return await _collect(state, ereq, recv, base, body)

    return app


def _record(state: ServerState, ereq: Request, body: dict, ids: list, final: FinalOutput,
            text: str) -> None:
    if state.recorder is None:
        return
    cfg = state.config
    state.recorder.record(
        request_id=ereq.request_id, protocol=ereq.protocol, body=body,
        prompt_ids=ereq.prompt_ids, params=ereq.params.to_dict(), max_tokens=ereq.max_tokens,
        stop=ereq.stop, output_ids=ids, finish_reason=final.engine_reason, text=text,
        model={"id": state.model_id, "sha256": state.artifact_sha256},
        server={"max_concurrency": cfg.max_concurrency, "max_context": state.n_ctx,
                "prefill_chunk": cfg.prefill_chunk, "page_size": cfg.page_size})


async def _collect(state: ServerState, ereq: Request, recv, base: dict, body: dict):
    parts: list[str] = []
    ids: list[int] = []
    done = False
    try:
        async with recv:
            async for item in recv:
                if isinstance(item, TokenOutput):
                    parts.append(item.text)
                    ids.append(item.token_id)
                elif isinstance(item, FinalOutput):
                    parts.append(item.text)
                    done = True
                    _record(state, ereq, body, ids, item, "".join(parts))
                    return {**base, "object": "chat.completion", "choices": [{
                        "index": 0, "message": {"role": "assistant", "content": "".join(parts)},
                        "finish_reason": item.finish_reason}],
                        "usage": _usage(item), "timings": _timings(item), "id_slot": item.lane}
                elif isinstance(item, ErrorOutput):
                    done = True
                    raise ApiError(503, item.message, item.code)
    finally:
        if not done:
            state.engine.cancel(ereq.request_id)
    raise internal_error()


async def _stream(state: ServerState, ereq: Request, recv, base: dict, include_usage: bool,
                  body: dict):
    chunk = {**base, "object": "chat.completion.chunk"}
    extra = {"usage": None} if include_usage else {}

    def delta(d: dict, finish=None, **more) -> str:
        return _sse({**chunk, "choices": [{"index": 0, "delta": d, "finish_reason": finish}],
                     **extra, **more})

    done = False
    ids: list[int] = []
    parts: list[str] = []
    try:
        yield delta({"role": "assistant", "content": ""})
        async with recv:
            async for item in recv:
                if isinstance(item, TokenOutput):
                    ids.append(item.token_id)
                    parts.append(item.text)
                    if item.text:
                        yield delta({"content": item.text})
                elif isinstance(item, FinalOutput):
                    done = True
                    _record(state, ereq, body, ids, item, "".join(parts) + item.text)
                    out = delta({"content": item.text}) if item.text else ""
                    out += delta({}, item.finish_reason, timings=_timings(item),
                                 id_slot=item.lane)
                    if include_usage:
                        out += _sse({**chunk, "choices": [], "usage": _usage(item),
                                     "timings": _timings(item)})
                    yield out + "data: [DONE]\n\n"
                    return
                elif isinstance(item, ErrorOutput):
                    done = True
                    yield _sse(ApiError(503, item.message, item.code).body())
                    return
    finally:
        if not done:
            state.engine.cancel(ereq.request_id)

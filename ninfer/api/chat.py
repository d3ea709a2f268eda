"""``POST /v1/chat/completions``: preparation, admission, and the streamed or collected reply.

Admission follows the serving contract (§1.11): a request-lifetime slot (``max_concurrency +
max_pending_requests`` of them) is taken before preparation and held until the reply is
released; none free → 429 ``server_overloaded``. One deadline (``--pending-timeout-ms``) starts
then and covers preparation and the engine FIFO; expiry → 503 ``request_queue_timeout`` with
``Retry-After`` — or, once a stream has committed its 200, one in-band SSE error frame and the end
of the stream (no ``[DONE]``, no finish chunk). While a stream waits for tokens, SSE comment
pings keep clients from timing out. ``n > 1`` runs n engine requests (seeds ``seed + i``), each
holding a request-lifetime slot (429 when fewer are free; 400 ``invalid_value`` when n exceeds
them all).
"""
from __future__ import annotations

import json
import math
import re
import secrets
import sys
import time
import traceback
from dataclasses import dataclass, field

import trio
from quart import Response, g, request

from ..engine.chat_template import TemplateError
from ..engine.engine import routing_key
from ..engine.requests import ErrorOutput, FinalOutput, Request, TokenOutput
from ..engine.sampling import SamplingError, SamplingParams
from ..events.schema import RequestRejected, RequestToolCalls
from . import fields
from .breakpoints import breakpoint_depths
from .chat_request import ChatRequest, parse_chat_request
from .errors import ApiError, error_record, model_not_found
from .tool_calls import ToolCallParser

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
RETRY_AFTER_S = 1
# prompts rendered and tokenized at once (worker threads: the tokenizer releases the GIL for
# long texts, so each one in flight holds its memory, up to ~150 bytes per byte of text)
_PROMPT_THREADS = trio.CapacityLimiter(4)
ENGINE_ERROR_STATUS = {"context_length_exceeded": 400, "request_queue_timeout": 503,
                       "kv_cache_full": 503, "server_shutting_down": 503,
                       "service_unavailable": 503}


@dataclass
class Choice:
    """One of the ``n`` generations of a request and what it produced so far."""
    index: int
    ereq: Request
    body: dict
    ids: list = field(default_factory=list)
    parts: list = field(default_factory=list)
    reasoning: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    final: FinalOutput | None = None
    error: ErrorOutput | None = None
    reasoning_tokens: int = 0
    tools: ToolCallParser | None = None   # when the request declared tools
    call_events: list = field(default_factory=list)   # ToolEvents not yet streamed
    finish_asked: bool = False   # the engine was asked to end it (tool-call limit reached)

    @property
    def calls_done(self) -> bool:
        """Every call the request allows is complete (``parallel_tool_calls: false``): the
        answer ended there, whichever limit the engine met while it got word."""
        return self.tools is not None and self.tools.saturated

    @property
    def finish_reason(self) -> str:
        """OpenAI's reason: ``tool_calls`` when the answer ended in complete calls, ``length``
        when it ended inside one."""
        if self.tools is not None and self.tools.calls:
            if self.tools.incomplete:
                return "length"
            if self.final.finish_reason == "stop" or self.calls_done:
                return "tool_calls"
        return self.final.finish_reason

    @property
    def done(self) -> bool:
        return self.final is not None or self.error is not None


def _timings(finals: list[FinalOutput]) -> dict:
    """llama.cpp ``timings``; with ``n`` choices (decoded together) the predicted figures cover
    all of them: tokens summed, wall time the longest choice's."""
    f = finals[0]
    t = f.timings
    prompt_n = f.prompt_tokens - f.cached_tokens  # computed by prefill, as llama.cpp's
    predicted = sum(x.completion_tokens for x in finals)
    decode_s = max(x.timings["decode_s"] for x in finals)
    out = {"prompt_n": prompt_n, "prompt_ms": t["prefill_s"] * 1000.0,
           "predicted_n": predicted, "predicted_ms": decode_s * 1000.0}
    if t["prefill_s"] > 0:
        out["prompt_per_second"] = prompt_n / t["prefill_s"]
    if decode_s > 0 and predicted > len(finals):
        out["predicted_per_second"] = (predicted - len(finals)) / decode_s
    if t["ttft_s"] > 0:
        out["ttft_ms"] = t["ttft_s"] * 1000.0
    if f.cached_tokens > 0:
        out["cache_n"] = f.cached_tokens
    draft_n = sum(getattr(x, "draft_n", 0) for x in finals)
    if draft_n > 0:  # speculative decoding drafted for this response
        out["draft_n"] = draft_n
        out["draft_n_accepted"] = sum(getattr(x, "draft_n_accepted", 0) for x in finals)
    return out


def _usage(finals: list[FinalOutput]) -> dict:
    prompt = finals[0].prompt_tokens
    completion = sum(f.completion_tokens for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            # n > 1: the choices may reuse different prefixes; never over-report
            "prompt_tokens_details": {"cached_tokens": min(f.cached_tokens for f in finals)}}


def _call_deltas(c: Choice) -> list[dict]:
    """Streamed ``delta.tool_calls`` of the calls parsed since the last chunk: the first names
    the call (``id``, ``type``, ``function.name``, empty ``arguments``), the next ones carry
    argument fragments that concatenate to the final ``arguments``."""
    out = []
    for e in c.call_events:
        k = e.call
        if e.kind == "start":
            out.append({"tool_calls": [{"index": k.index, "id": k.id, "type": "function",
                                        "function": {"name": k.name, "arguments": ""}}]})
        elif e.kind == "args":
            out.append({"tool_calls": [{"index": k.index, "function": {"arguments": e.text}}]})
    c.call_events = []
    return out


def _sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def unpaired_surrogate(body, raw: bytes) -> str | None:
    """The path (``messages[0].content``) of the first string (or key) in ``body``, a JSON value
    decoded from ``raw``, that holds an unpaired surrogate (such a string cannot be encoded,
    echoed or logged as UTF-8), or None. Only bodies whose text holds a ``\\uD800``-``\\uDFFF``
    escape at all are walked."""
    if not _SURROGATE_ESCAPE.search(raw):
        return None
    stack = [(body, "")]
    while stack:   # iterative: a body may nest deeper than Python's recursion limit
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            for k in value:
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
            stack.extend((v, f"{path}.{k}" if path else k) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(value))))
    return None


async def json_body():
    """The request's body decoded as JSON.

    Raises:
        ApiError: 400 ``invalid_json``; 400 ``invalid_unicode`` naming the field where a string
            holds an unpaired surrogate (anywhere in the body, prompt or not: echoed fields
            could not be sent back or logged).
    """
    raw = await request.get_data()
    try:
        # strict UTF-8 (RFC 8259): json.loads(bytes) would also take UTF-16 / UTF-32 and
        # surrogates written as raw bytes ('surrogatepass'), which the \\u prefilter misses
        body = json.loads(raw.decode("utf-8-sig"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    path = unpaired_surrogate(body, raw)
    if path is not None:
        raise ApiError(400, f"'{path}' holds invalid Unicode (an unpaired surrogate)",
                       "invalid_unicode", path)
    return body


async def next_output(recv, ping_s: float):
    """The engine's next ``(choice index, output)`` from ``recv``, or None when ``ping_s``
    passed without one (a stream's keep-alive is due)."""
    with trio.move_on_after(ping_s):
        return await recv.receive()
    return None


def is_reasoning(item) -> bool:
    """Whether an engine output's text belongs to the thinking block."""
    return getattr(item, "reasoning", getattr(item, "text_is_reasoning", False))


def _engine_error(err: ErrorOutput) -> ApiError:
    """The client-visible error of an engine failure (its ``Retry-After``, on a 503, comes
    from the app's error renderer, as every retryable 429 / 503's)."""
    return ApiError(ENGINE_ERROR_STATUS.get(err.code, 500), err.message, err.code,
                    logged=True)   # (the engine logged request.failed / request.rejected)


def _takes_later_system(template) -> bool:
    """Whether the chat template renders a system message after the first turn."""
    try:
        template.render([{"role": "user", "content": "u"}, {"role": "system", "content": "s"}],
                        add_generation_prompt=True)
        return True
    except TemplateError:
        return False


@dataclass
class _Slots:
    """The request-lifetime slots in use, shared by the protocol handlers."""
    in_flight: int = 0


class ChatHandler:
    """Serves chat completions for one ServerState (see module docstring). Another protocol
    over the same admission and engine path (``messages.MessagesHandler``) overrides
    ``protocol``, ``id_prefix``, ``_parse``, ``_check_model``, ``_collect`` and ``_stream``."""

    protocol = "openai_chat_completions"
    id_prefix = "chatcmpl-"
    prompt_param = "messages"   # the parameter a too-long prompt is blamed on
    # the route's names of the chat path's thinking parameters (in errors and ignored_fields)
    thinking_params = {"reasoning_effort": "reasoning_effort",
                       "enable_thinking": "enable_thinking"}

    def __init__(self, state, admission: ChatHandler | None = None):
        """``admission``: a handler whose request-lifetime slots this one shares (one pool for
        every protocol); None: its own."""
        self.state = state
        self._slots = admission._slots if admission is not None else _Slots()
        # thinking-capable template: it reads enable_thinking and </think> is one token
        source = getattr(state.template, "source", "") or ""
        end = state.tokenizer.encode("</think>")
        self.think_end_id = end[0] if "enable_thinking" in source and len(end) == 1 else None
        self.mid_system = state.template is not None and _takes_later_system(state.template)

    def placed_system(self, messages: list[dict]) -> list[dict]:
        """``messages`` with each system message after the first turn as a user turn when the
        template takes a system message only first (Qwen3.5's raises; SmolLM2's renders it
        where it is, which its model follows better)."""
        if self.mid_system:
            return messages
        return [{**m, "role": "user"} if m["role"] == "system" and i > 0 else m
                for i, m in enumerate(messages)]

    def _thinking(self, creq: ChatRequest) -> tuple[dict, int | None]:
        """(template kwargs, thinking-token budget or None) for a request.

        Thinking asked of a template without a thinking mode is served without thinking,
        the parameter logged as ignored (``fields``).

        Raises:
            ApiError: 400 ``reasoning_effort_not_supported`` for an effort the loaded chat
                template does not offer, or (``--strict-request-fields``) any thinking on a
                template without it.
        """
        cfg = self.state.config
        effort = creq.reasoning_effort
        names = self.thinking_params
        if self.think_end_id is None:
            if effort not in (None, "none") or creq.enable_thinking:
                param = names["reasoning_effort" if effort else "enable_thinking"]
                fields.current().refuse_or_ignore(ApiError(
                    400, "this model's chat template has no thinking mode",
                    "reasoning_effort_not_supported", param), param)
            return {}, None
        if effort not in (None, "none", "low", "medium", "high"):
            raise ApiError(400, f"reasoning_effort '{effort}' is not offered by this model "
                           "(none, low, medium, high)", "reasoning_effort_not_supported",
                           names["reasoning_effort"])
        if effort is None:
            effort = "none" if creq.enable_thinking is False else cfg.reasoning_effort
            if creq.enable_thinking and effort == "none":
                effort = "medium"
        preserve = {"preserve_thinking": cfg.preserve_thinking if creq.preserve_thinking is None
                    else creq.preserve_thinking}
        if effort == "none":
            return {"enable_thinking": False, **preserve}, None
        return {"enable_thinking": True, **preserve}, getattr(cfg, f"reasoning_budget_{effort}")

    @property
    def in_flight(self) -> int:
        """Requests holding a request-lifetime slot (of the shared pool)."""
        return self._slots.in_flight

    @in_flight.setter
    def in_flight(self, n: int) -> None:
        self._slots.in_flight = n

    @property
    def capacity(self) -> int:
        cfg = self.state.config
        return cfg.max_concurrency + cfg.max_pending_requests

    async def handle(self):
        state, cfg = self.state, self.state.config
        rid = self.id_prefix + secrets.token_hex(8)
        if state.engine.fatal is not None:
            raise ApiError(503, "the engine stopped after an internal error; restart the "
                           "server", "service_unavailable")
        def overloaded(want: int) -> ApiError:
            msg = (f"server overloaded: {self.in_flight} requests in flight, {want} more asked "
                   f"(max_concurrency {cfg.max_concurrency} + max_pending_requests "
                   f"{cfg.max_pending_requests})")
            state.bus.emit(RequestRejected(request_id=rid, code="server_overloaded", message=msg,
                                           http_request_id=g.get("request_id", "")))
            return ApiError(429, msg, "server_overloaded", logged=True)

        held = 0
        released = False

        def take(k: int) -> None:
            """``k`` more request-lifetime slots for this request, or 429."""
            nonlocal held
            if self.in_flight + k > self.capacity:
                raise overloaded(k)
            self.in_flight += k
            held += k

        def release():
            nonlocal released
            if not released:
                released = True
                self.in_flight -= held

        def reserve(n: int) -> None:
            """Once ``n`` is known, before any engine request: the other n - 1 choices take
            slots too, so that ``n`` cannot fill the engine queue past the admission bound."""
            if n > self.capacity:
                raise ApiError(400, f"'n' is {n}: at most {self.capacity} choices fit in this "
                               f"server's admission (max_concurrency + max_pending_requests)",
                               "invalid_value", "n")
            take(n - 1)

        take(1)

        try:
            deadline = time.monotonic() + cfg.pending_timeout_ms / 1000.0
            body, creq, choices, send, recv = await self._prepare(rid, deadline, reserve)
        except BaseException:
            release()
            raise
        base = {"id": rid, "created": int(time.time()), "model": state.model_id}
        if creq.stream:
            # Start the body generator here, so its ``finally`` (cancel + release) is armed
            # before the 200 is handed to the server: a client that disconnects before the
            # body is iterated still cancels its request — the started generator is closed
            # explicitly, or by trio's async-generator finalizer when it is dropped.
            stream = self._stream(creq, body, choices, recv, base, release)
            try:
                first = await stream.__anext__()
            except BaseException:
                await stream.aclose()
                raise
            return Response(self._guarded(first, stream, g.get("request_id", ""),
                                          request.method, request.path),
                            mimetype="text/event-stream", headers=SSE_HEADERS)
        try:
            return await self._collect(creq, body, choices, recv, base)
        finally:
            release()

    async def _prepare(self, rid: str, deadline: float, reserve):
        state, cfg = self.state, self.state.config
        body = await json_body()
        with fields.field_policy(cfg.strict_request_fields) as policy:
            creq: ChatRequest = self._parse(body)
            self._check_model(creq)
            template_kwargs, think_budget = self._thinking(creq)
        g.ignored_fields = policy.names()   # the response header (app)
        creq.messages = self.placed_system(creq.messages)
        ecfg = state.engine.config
        prompt_ids, checkpoint_at, publish_at = await self._prompt(
            creq, template_kwargs, checkpoint=state.engine.recurrent and ecfg.turn_checkpoint
            and ecfg.prefix_reuse, breakpoints=state.engine.publishes)
        n_prompt = len(prompt_ids)
        max_tokens, source = self._max_tokens(creq.max_tokens, n_prompt)
        seed = self._seed(creq)
        reserve(creq.n)
        send, recv = trio.open_memory_channel(math.inf)
        choices = []
        for i in range(creq.n):
            params = self._sampling(creq, seed + i)
            ereq = Request(request_id=rid if creq.n == 1 else f"{rid}-{i}",
                           prompt_ids=prompt_ids, params=params, max_tokens=max_tokens,
                           deliver=lambda item, i=i: send.send_nowait((i, item)),
                           stop=creq.stop, protocol=self.protocol,
                           model=state.model_id, stream=creq.stream,
                           message_count=len(creq.messages), max_tokens_source=source,
                           deadline=deadline, logprobs=creq.logprobs,
                           think_budget=think_budget, think_end_id=self.think_end_id,
                           cache_key=routing_key(creq.prompt_cache_key),
                           checkpoint_at=checkpoint_at, checkpoint_anchor=bool(
                               creq.messages and creq.messages[-1].get("role") == "user"),
                           publish_at=publish_at, http_request_id=g.get("request_id", ""),
                           ignored_fields=tuple(policy.names()))
            choices.append(Choice(i, ereq, body, tools=self._tool_parser(creq)))
        for c in choices:
            state.engine.submit(c.ereq)
        return body, creq, choices, send, recv

    def _seed(self, creq) -> int:
        """The request's seed, else the server's ``--seed``, else a fresh random one."""
        cfg = self.state.config
        if creq.seed is not None:
            return creq.seed
        return cfg.seed if cfg.seed is not None else secrets.randbits(63)

    def _sampling(self, creq, seed: int) -> SamplingParams:
        """The sampling parameters of ``creq`` (``--temperature`` when it gives none).

        Raises:
            ApiError: 400 ``invalid_value`` for a combination the sampler refuses.
        """
        temperature = creq.temperature
        if temperature is None:
            temperature = self.state.config.temperature
        try:
            return SamplingParams(
                temperature=temperature, top_k=creq.top_k or 0,
                top_p=1.0 if creq.top_p is None else creq.top_p, min_p=creq.min_p or 0.0,
                seed=seed % 2 ** 64, presence_penalty=creq.presence_penalty,
                frequency_penalty=creq.frequency_penalty,
                repetition_penalty=creq.repetition_penalty)
        except SamplingError as exc:
            raise ApiError(400, str(exc), "invalid_value") from None

    def _max_tokens(self, asked: int | None, n_prompt: int) -> tuple[int, str]:
        """(output cap, ``max_tokens_source``) of a prompt of ``n_prompt`` tokens: the client's
        ``max_tokens`` clamped to what is left of the context (``client_clamped``: generation
        ends there with ``length``, as llama.cpp and Ollama do), else the server default.

        Raises:
            ApiError: 400 ``context_length_exceeded`` when the prompt leaves no room for one
                token, or (``--strict-max-tokens``) for the prompt plus ``max_tokens``.
        """
        n_ctx, cfg = self.state.n_ctx, self.state.config
        room = n_ctx - n_prompt
        if room < 1 or (asked is not None and asked > room and cfg.strict_max_tokens):
            raise ApiError(400, f"the request needs {n_prompt} prompt tokens"
                           + (f" + {asked} output tokens" if asked else "")
                           + f", more than the context window of {n_ctx} tokens",
                           "context_length_exceeded", self.prompt_param,
                           {"n_prompt_tokens": n_prompt, "n_ctx": n_ctx})
        if asked is None:
            return min(cfg.default_max_tokens, room), "server_default"
        return (room, "client_clamped") if asked > room else (asked, "client")

    async def _prompt_ids(self, creq: ChatRequest, template_kwargs: dict) -> list[int]:
        """The rendered and tokenized prompt of ``creq`` (see ``_prompt``)."""
        return (await self._prompt(creq, template_kwargs, checkpoint=False))[0]

    async def _prompt(self, creq: ChatRequest, template_kwargs: dict, checkpoint: bool,
                      breakpoints: bool = False) -> tuple[list[int], int | None, tuple]:
        """The rendered and tokenized prompt of ``creq`` (on a worker thread: a long prompt
        must not stall the event loop); with ``checkpoint``, the depth of its turn checkpoint:
        where the history ends and the generation opener begins (the prompt rendered with and
        without the generation prompt; None when the opener's tokens are not the prompt's
        tail); with ``breakpoints``, the depths of its prompt-cache breakpoints
        (``breakpoint_depths``, for ``Request.publish_at``; else ()).

        Raises:
            ApiError: 400 ``template_error`` / ``invalid_unicode``.
        """
        state = self.state

        def render_and_tokenize() -> tuple[list[int], int | None, tuple]:
            text = state.template.render(creq.messages, tools=creq.tools,
                                         add_generation_prompt=True, **template_kwargs)
            n_bytes = len(text.encode("utf-8"))  # lone surrogates (invalid Unicode) fail here
            if n_bytes > state.n_ctx * state.tokenizer.max_token_bytes:
                # more tokens than the context holds, for certain: refused before the
                # tokenizer spends seconds and gigabytes on it (a 64 MiB body took 66 s, 9 GiB)
                raise ApiError(400, f"the prompt is {n_bytes} bytes of text, more than the "
                               f"context window of {state.n_ctx} tokens can hold",
                               "context_length_exceeded", self.prompt_param,
                               {"n_prompt_bytes": n_bytes, "n_ctx": state.n_ctx})
            ids = state.tokenizer.encode(text)
            at = None
            if checkpoint:
                try:
                    hist = state.template.render(creq.messages, tools=creq.tools,
                                                 add_generation_prompt=False,
                                                 **template_kwargs)
                except TemplateError:   # a template that needs the opener: no checkpoint
                    hist = None
                if hist is not None and text.startswith(hist) and len(text) > len(hist):
                    opener = state.tokenizer.encode(text[len(hist):])
                    if 0 < len(opener) < len(ids) and ids[-len(opener):] == opener:
                        at = len(ids) - len(opener)
            publish = breakpoint_depths(state.template, state.tokenizer, creq, template_kwargs,
                                        text, ids) if breakpoints else ()
            return ids, at, publish

        try:
            return await trio.to_thread.run_sync(render_and_tokenize, limiter=_PROMPT_THREADS)
        except TemplateError as exc:
            raise ApiError(400, f"chat template error: {exc}", "template_error",
                           self.prompt_param) from None
        except UnicodeEncodeError:
            raise ApiError(400, "messages contain invalid Unicode (an unpaired surrogate)",
                           "invalid_unicode", self.prompt_param) from None

    def _parse(self, body) -> ChatRequest:
        return parse_chat_request(body)

    def _check_model(self, creq: ChatRequest) -> None:
        if creq.model is not None and creq.model != self.state.model_id:
            raise model_not_found(creq.model, self.state.model_id)

    # -- replies ----------------------------------------------------------------------------
    def _logprob_entries(self, item: TokenOutput) -> list[dict]:
        tok = self.state.tokenizer

        def entry(tid, lp):
            return {"token": tok.decode([tid]), "logprob": lp,
                    "bytes": list(tok.token_bytes(tid))}

        return [{**entry(item.token_id, item.logprob),
                 "top_logprobs": [entry(t, lp) for t, lp in item.top_logprobs]}]

    def _tool_parser(self, creq: ChatRequest, **options) -> ToolCallParser | None:
        """A parser of the answer's tool calls when the request declared tools (at most one
        call without ``parallel_tool_calls``; ``options``: ToolCallParser's, by route)."""
        if not creq.tools:
            return None
        return ToolCallParser(creq.tools, **{"max_name": 64, **options},
                              max_calls=None if creq.parallel_tool_calls else 1)

    @staticmethod
    def _add_text(c: Choice, text: str, reasoning: bool, final: bool = False) -> str:
        """Append ``text`` to the right channel; returns the text as delivered (the answer's
        leading blank lines after ``</think>`` are dropped; tool calls go to
        ``c.call_events``)."""
        if reasoning:
            c.reasoning.append(text)
            return text
        if c.tools is not None:
            events = c.tools.feed(text) + (c.tools.close() if final else [])
            text = "".join(e.text for e in events if e.kind == "text")
            c.call_events += [e for e in events if e.kind != "text"]
        if c.reasoning and not "".join(c.parts):
            text = text.lstrip()
        c.parts.append(text)
        return text

    def _absorb(self, c: Choice, item) -> str:
        """Take one engine output into ``c``; returns the text it adds (for streaming)."""
        if isinstance(item, TokenOutput):
            c.ids.append(item.token_id)
            c.reasoning_tokens += item.reasoning
            if item.logprob is not None:
                c.logprobs.extend(self._logprob_entries(item))
            text = self._add_text(c, item.text, item.reasoning)
            if c.calls_done and not c.finish_asked:
                # every call allowed is complete: whatever follows would be dropped, so the
                # generation ends here instead of decoding (and billing) it
                c.finish_asked = True
                self.state.engine.finish(c.ereq.request_id, "tool_calls")
            return text
        if isinstance(item, FinalOutput):
            # a final reasoning tail means no answer text ever reached the tool parser
            text = self._add_text(c, item.text, item.text_is_reasoning, final=True)
            c.final = item
            self._record(c)
            self._log_tool_calls(c)
            return text
        if isinstance(item, ErrorOutput):
            c.error = item
        return ""

    def _log_tool_calls(self, c: Choice) -> None:
        """``request.tool_calls`` for an answer that held calls (or dropped output after
        one)."""
        p = c.tools
        if p is None or not (p.calls or p.discarded_bytes):
            return
        self.state.bus.emit(RequestToolCalls(
            request_id=c.ereq.request_id, calls=len(p.calls),
            incomplete=sum(not k.complete for k in p.calls),
            invalid_arguments=sum(k.complete and k.parsed_arguments() is None for k in p.calls),
            discarded_bytes=p.discarded_bytes))

    def _record(self, c: Choice) -> None:
        state = self.state
        if state.recorder is None or c.final is None:
            return
        cfg, e = state.config, c.ereq
        state.recorder.record(
            request_id=e.request_id, protocol=e.protocol, body=c.body,
            prompt_ids=e.prompt_ids, params=e.params.to_dict(), max_tokens=e.max_tokens,
            stop=e.stop, output_ids=c.ids, finish_reason=c.final.engine_reason,
            text="".join(c.parts), model={"id": state.model_id, "sha256": state.artifact_sha256},
            server={"max_concurrency": cfg.max_concurrency, "max_context": state.n_ctx,
                    "prefill_chunk": cfg.prefill_chunk, "page_size": cfg.page_size})

    def _cancel_unfinished(self, choices: list[Choice]) -> None:
        """Cancel the choices still running (from a ``finally``): the reason says what ended
        the request: an error of the request (``request_failed``: another choice failed), an
        exception of ours (``internal_error``), else the client went away."""
        exc = sys.exc_info()[1]
        reason = ("request_failed" if isinstance(exc, ApiError) else
                  "internal_error" if isinstance(exc, Exception) else "client_disconnected")
        for c in choices:
            if not c.done:
                self.state.engine.cancel(c.ereq.request_id, reason)

    async def _guarded(self, first: str, rest, http_id: str, method: str, path: str):
        """The SSE body: ``first``, then everything of the started generator ``rest`` (closing
        this closes ``rest`` and runs its cleanup). An exception of ours after the 200 is
        logged as a ``request.error`` 500 ``internal_error`` under the response's x-request-id
        (its traceback on stderr) before the stream is cut."""
        try:
            yield first
            async for item in rest:
                yield item
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            err = ApiError(500, f"{type(exc).__name__} in the stream", "internal_error")
            self.state.bus.emit(error_record(err, http_id, method, path))
            raise
        finally:
            await rest.aclose()

    async def _receive_all(self, choices, recv) -> None:
        """Absorb the engine's outputs until every choice is done (non-streaming replies).

        Raises:
            ApiError: the engine failed a choice (the others are cancelled).
        """
        try:
            async with recv:
                while not all(c.done for c in choices):
                    i, item = await recv.receive()
                    self._absorb(choices[i], item)
                    if choices[i].error is not None:
                        raise _engine_error(choices[i].error)
        finally:
            self._cancel_unfinished(choices)

    async def _collect(self, creq, body, choices, recv, base):
        await self._receive_all(choices, recv)
        finals = [c.final for c in choices]
        out_choices = []
        for c in choices:
            msg = {"role": "assistant", "content": "".join(c.parts)}
            if "".join(c.reasoning):
                msg["reasoning_content"] = "".join(c.reasoning)
            if c.tools is not None and c.tools.calls:
                msg["content"] = msg["content"] or None
                msg["tool_calls"] = [{"id": k.id, "type": "function",
                                      "function": {"name": k.name, "arguments": k.arguments}}
                                     for k in c.tools.calls]
            ch = {"index": c.index, "message": msg, "finish_reason": c.finish_reason}
            if creq.logprobs is not None:
                ch["logprobs"] = {"content": c.logprobs, "refusal": None}
            out_choices.append(ch)
        return {**base, "object": "chat.completion", "choices": out_choices,
                "usage": _usage(finals), "timings": _timings(finals),
                "id_slot": finals[0].lane}

    async def _stream(self, creq, body, choices, recv, base, release):
        chunk = {**base, "object": "chat.completion.chunk"}
        extra = {"usage": None} if creq.include_usage else {}
        ping_s = self.state.config.sse_ping_interval_s

        def delta(index: int, d: dict, finish=None, logprobs=None, **more) -> str:
            ch = {"index": index, "delta": d, "finish_reason": finish}
            if creq.logprobs is not None:
                ch["logprobs"] = {"content": logprobs} if logprobs else None
            return _sse({**chunk, "choices": [ch], **extra, **more})

        try:
            yield "".join(delta(c.index, {"role": "assistant", "content": ""}) for c in choices)
            async with recv:
                while not all(c.done for c in choices):
                    got = await next_output(recv, ping_s)
                    if got is None:
                        yield ": ping\n\n"
                        continue
                    i, item = got
                    c = choices[i]
                    n_lp = len(c.logprobs)
                    text = self._absorb(c, item)
                    key = "reasoning_content" if is_reasoning(item) else "content"
                    calls = "".join(delta(i, d) for d in _call_deltas(c))
                    if isinstance(item, TokenOutput):
                        lps = c.logprobs[n_lp:]
                        if text or lps:
                            yield delta(i, {key: text} if text else {}, logprobs=lps) + calls
                        elif calls:
                            yield calls
                    elif isinstance(item, FinalOutput):
                        out = (delta(i, {key: text}) if text else "") + calls
                        more = {"timings": _timings([item]), "id_slot": item.lane}
                        yield out + delta(i, {}, c.finish_reason, **more)
                    elif isinstance(item, ErrorOutput):
                        yield _sse(_engine_error(item).body())
                        return
            if creq.include_usage:
                finals = [c.final for c in choices]
                yield _sse({**chunk, "choices": [], "usage": _usage(finals),
                            "timings": _timings(finals)})
            yield "data: [DONE]\n\n"
        finally:
            self._cancel_unfinished(choices)
            release()

"""The engine requests of one HTTP request (its choices) and what they produced so far.

Every protocol absorbs the engine's outputs the same way: tokens to the answer or the
thinking channel, tool calls parsed out of the answer, logprobs in the protocol's format, the
request recorded and its calls logged when it ends; choices still running when the reply ends
are cancelled with the reason that ended it.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Callable

import trio

from ..engine.requests import ErrorOutput, FinalOutput, Request, TokenOutput
from ..events.schema import RequestToolCalls
from .errors import ApiError
from .streaming import ChoiceOutput
from .tool_calls import ToolCallParser

ENGINE_ERROR_STATUS = {"context_length_exceeded": 400, "request_queue_timeout": 503,
                       "kv_cache_full": 503, "server_shutting_down": 503,
                       "service_unavailable": 503}


def engine_error(err: ErrorOutput) -> ApiError:
    """The client-visible error of an engine failure (its ``Retry-After``, on a 503, comes
    from the app's error renderer, as every retryable 429 / 503's)."""
    return ApiError(ENGINE_ERROR_STATUS.get(err.code, 500), err.message, err.code,
                    logged=True)   # (the engine logged request.failed / request.rejected)


@dataclass
class Choice:
    """One of the choices of a request and what it produced so far."""
    index: int
    ereq: Request | None   # None: nothing to generate (a completion's echo only)
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

    def take_call_events(self) -> list:
        """The tool-call events parsed since the last call (then forgotten)."""
        events, self.call_events = self.call_events, []
        return events


class Generation:
    """The choices of one request, the channel their outputs arrive on, and their absorption.

    Args:
        state: the server's ServerState.
        body: the request's decoded body (recorded with the session).
        request: the protocol's validated request.
        logprob_entries: a token's logprobs in the protocol's format (a list of entries), or
            None when the protocol never asks for them.
    """

    def __init__(self, state, body, request, logprob_entries: Callable | None = None):
        self.state = state
        self.body = body
        self.request = request
        self.logprob_entries = logprob_entries
        self.choices: list[Choice] = []
        self._send, self.recv = trio.open_memory_channel(math.inf)

    def deliver_to(self, index: int) -> Callable:
        """The ``Request.deliver`` of the choice at ``index``."""
        send = self._send
        return lambda item: send.send_nowait(ChoiceOutput(index=index, output=item))

    def submit(self) -> None:
        """Hand every choice that has something to generate to the engine."""
        for c in self.choices:
            if c.ereq is not None:
                self.state.engine.submit(c.ereq)

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices)

    def absorb(self, c: Choice, item) -> str:
        """Take one engine output into ``c``; returns the text it adds (for streaming)."""
        if isinstance(item, TokenOutput):
            c.ids.append(item.token_id)
            c.reasoning_tokens += item.reasoning
            if item.logprob is not None and self.logprob_entries is not None:
                c.logprobs.extend(self.logprob_entries(item))
            text = _add_text(c, item.text, item.reasoning)
            if c.calls_done and not c.finish_asked:
                # every call allowed is complete: whatever follows would be dropped, so the
                # generation ends here instead of decoding (and billing) it
                c.finish_asked = True
                self.state.engine.finish(c.ereq.request_id, "tool_calls")
            return text
        if isinstance(item, FinalOutput):
            # a final reasoning tail means no answer text ever reached the tool parser
            text = _add_text(c, item.text, item.text_is_reasoning, final=True)
            c.final = item
            self._record(c)
            self._log_tool_calls(c)
            return text
        if isinstance(item, ErrorOutput):
            c.error = item
        return ""

    async def receive_all(self) -> None:
        """Absorb the engine's outputs until every choice is done (non-streaming replies).

        Raises:
            ApiError: the engine failed a choice (the others are cancelled).
        """
        try:
            async with self.recv:
                while not self.done:
                    got = await self.recv.receive()
                    c = self.choices[got.index]
                    self.absorb(c, got.output)
                    if c.error is not None:
                        raise engine_error(c.error)
        finally:
            self.cancel_unfinished()

    def cancel_unfinished(self) -> None:
        """Cancel the choices still running (from a ``finally``): the reason says what ended
        the request: an error of the request (``request_failed``: another choice failed), an
        exception of ours (``internal_error``), else the client went away."""
        exc = sys.exc_info()[1]
        reason = ("request_failed" if isinstance(exc, ApiError) else
                  "internal_error" if isinstance(exc, Exception) else "client_disconnected")
        for c in self.choices:
            if not c.done:
                self.state.engine.cancel(c.ereq.request_id, reason)

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
        """The finished choice as a recorded session (``--record``), for replay."""
        state = self.state
        if state.recorder is None or c.final is None:
            return
        cfg, e = state.config, c.ereq
        state.recorder.record(
            request_id=e.request_id, protocol=e.protocol, body=self.body,
            prompt_ids=e.prompt_ids, params=e.params.to_dict(), max_tokens=e.max_tokens,
            stop=e.stop, output_ids=c.ids, finish_reason=c.final.engine_reason,
            text="".join(c.parts), model={"id": state.model_id, "sha256": state.artifact_sha256},
            server={"max_concurrency": cfg.max_concurrency, "max_context": state.n_ctx,
                    "prefill_chunk": state.engine.config.prefill_chunk,   # (auto resolved)
                    "page_size": cfg.page_size,
                    "max_prefill_lanes": cfg.max_prefill_lanes})


def _add_text(c: Choice, text: str, reasoning: bool, final: bool = False) -> str:
    """Append ``text`` to the right channel; returns the text as delivered (the answer's
    leading blank lines after ``</think>`` are dropped; tool calls go to ``c.call_events``)."""
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

"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: the Anthropic Messages API over
the chat-form path (same admission, template, engine and events; serving contract §1.8). The
body: ``messages_request``; replies:

- JSON: ``{"id": "msg_…", "type": "message", "role": "assistant", "model", "content": [thinking
  block, text block, tool_use blocks] (the text block only when text was produced),
  "stop_reason", "stop_sequence", "usage"}``; stop reasons ``end_turn`` (stop token),
  ``stop_sequence`` (with the matched string), ``max_tokens`` (output or context limit).
- SSE (``stream: true``): ``message_start`` (sent with the first output, when the reused
  prefix is known: its usage has ``cache_read_input_tokens``; ``ping`` events before it while
  the prompt waits or prefills), then per block ``content_block_start`` /
  ``content_block_delta`` (``thinking_delta``, ``text_delta``, ``input_json_delta``) /
  ``content_block_stop`` with contiguous indices (no block when nothing was produced:
  ``content`` is ``[]`` then, as in the JSON form), ``message_delta`` (stop reason, the final
  usage), ``message_stop``; keep-alives are ``ping`` events; an engine error after the 200 is
  one ``error`` event, then the end of the stream.
- Usage: ``input_tokens`` (prompt tokens neither reused nor published), ``cache_read_input_tokens``
  (the reused prefix), ``cache_creation_input_tokens`` (prompt tokens past the reused prefix up
  to the deepest prompt-cache breakpoint this request published to L2 / L3:
  ``FinalOutput.cache_write_tokens``), ``output_tokens``.

Errors on these routes use Anthropic's envelope (``errors.ApiError.anthropic_body``).
Source of the wire format: Anthropic's Messages API reference ("Messages", "Streaming
Messages", "Count tokens") and llama.cpp server's PR #17570.
"""
from __future__ import annotations

import secrets

from ..engine.requests import ErrorOutput, FinalOutput
from .admission import Admission
from .chat_prepare import prepare_chat
from .chat_request import ChatRequest
from .generation import Choice, Generation, engine_error
from .messages_request import parse_messages_request
from .pipeline import AdmittedProtocol
from .prompt import ChatPrompt, Thinking, ThinkingParams
from .request_body import field_scope, json_body
from .streaming import is_reasoning, next_output, sse_event
from .timings import llama_timings
from .tool_calls import ToolCallParser, parser_for_request

STOP_REASONS = {"stop_token": "end_turn", "stop_string": "stop_sequence",
                "output_limit": "max_tokens", "context_capacity": "max_tokens"}


def _stop_reason(c: Choice) -> str:
    """Anthropic's stop reason: ``tool_use`` when the answer ended in complete tool calls,
    ``max_tokens`` when it ended inside one, else the engine's reason."""
    if c.tools is not None and c.tools.calls:
        if c.tools.incomplete:
            return "max_tokens"
        if c.final.finish_reason == "stop" or c.calls_done:
            return "tool_use"
    return STOP_REASONS.get(c.final.engine_reason)


def _usage(final: FinalOutput) -> dict:
    write = min(final.cache_write_tokens, final.prompt_tokens - final.cached_tokens)
    return {"input_tokens": final.prompt_tokens - final.cached_tokens - write,
            "cache_creation_input_tokens": write,
            "cache_read_input_tokens": final.cached_tokens,
            "output_tokens": final.completion_tokens}


def _message(rid: str, model: str, content: list, c: Choice | None) -> dict:
    """The ``message`` object (without a final output yet: no stop reason, no usage)."""
    final = c.final if c is not None else None
    return {"id": rid, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": _stop_reason(c) if final else None,
            "stop_sequence": final.stop_string if final else None,
            "usage": _usage(final) if final else None}


class ContentBlocks:
    """The content blocks of a streamed message: opened and closed as the answer changes
    channel (thinking, text) or a tool call starts, with contiguous indices.

    Args:
        signature: the thinking blocks' signature (the message id).
        omit_thinking: ``thinking.display`` ``omitted``: thinking blocks without their text.
    """

    def __init__(self, signature: str, omit_thinking: bool):
        self.signature = signature
        self.omit_thinking = omit_thinking
        self.opened: list[str] = []   # the kinds of the blocks opened so far
        self.is_open = False          # the last one is still open

    @property
    def index(self) -> int:
        return len(self.opened) - 1

    def switch(self, kind: str, call=None) -> str:
        """Close the open block if it is of another kind (a thinking block with its
        signature) or a tool call, open one of ``kind``."""
        if self.is_open and self.opened[-1] == kind and kind != "tool_use":
            return ""
        out = self.close() if self.is_open else ""
        self.opened.append(kind)
        self.is_open = True
        block = {"thinking": {"type": "thinking", "thinking": "", "signature": ""},
                 "text": {"type": "text", "text": ""}}.get(kind)
        if kind == "tool_use":
            block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
        return out + sse_event("content_block_start", {"type": "content_block_start",
                                                        "index": self.index,
                                                        "content_block": block})

    def close(self) -> str:
        out = ""
        if self.opened[-1] == "thinking":
            out = sse_event("content_block_delta", {
                "type": "content_block_delta", "index": self.index,
                "delta": {"type": "signature_delta", "signature": self.signature}})
        self.is_open = False
        return out + sse_event("content_block_stop", {"type": "content_block_stop",
                                                       "index": self.index})

    def close_open(self) -> str:
        """Close the open block, if any (an empty answer has no block at all)."""
        return self.close() if self.is_open else ""

    def text(self, kind: str, text: str) -> str:
        """``text`` of the ``thinking`` or ``text`` channel, in a block of that kind."""
        if kind == "thinking" and self.omit_thinking:
            return self.switch(kind)   # the block and its signature, not its text
        d = ({"type": "thinking_delta", "thinking": text} if kind == "thinking"
             else {"type": "text_delta", "text": text})
        return self.switch(kind) + sse_event("content_block_delta", {
            "type": "content_block_delta", "index": self.index, "delta": d})

    def tool_calls(self, c: Choice) -> str:
        """The tool calls parsed since the last event: a ``tool_use`` block each, its input
        streamed as ``input_json_delta`` fragments."""
        out = ""
        for e in c.take_call_events():
            if e.kind == "start":
                out += self.switch("tool_use", e.call)
            elif e.kind == "args":
                out += sse_event("content_block_delta", {
                    "type": "content_block_delta", "index": self.index,
                    "delta": {"type": "input_json_delta", "partial_json": e.text}})
            elif e.kind == "end":
                out += self.close()
        return out


class MessagesHandler(AdmittedProtocol):
    """Serves ``/v1/messages`` (and ``count_tokens``) for one ServerState (module docstring)."""

    protocol = "anthropic_messages"
    id_prefix = "msg_"
    prompt_param = "messages"
    thinking_params = ThinkingParams(reasoning_effort="output_config.effort",
                                     enable_thinking="thinking")

    def __init__(self, state, admission: Admission | None = None,
                 prompt: ChatPrompt | None = None):
        super().__init__(state, admission)
        self.prompt = prompt or ChatPrompt(state)

    # -- the chat-form request ----------------------------------------------------------------
    def parse(self, body) -> ChatRequest:
        # (model: a free label, §1.8, never a 404)
        return parse_messages_request(body, keep_volatile=self.state.config.keep_volatile_spans)

    def thinking(self, creq: ChatRequest) -> Thinking:
        """The chat path's thinking, the thinking-token budget capped by
        ``thinking.budget_tokens``."""
        thinking = self.prompt.thinking(creq, self.thinking_params)
        cap, budget = creq.thinking_budget, thinking.budget
        if cap is not None and thinking.template_kwargs.get("enable_thinking"):
            budget = cap if budget is None else min(budget, cap)
        return Thinking(template_kwargs=thinking.template_kwargs, budget=budget)

    def tool_parser(self, creq: ChatRequest) -> ToolCallParser | None:
        return parser_for_request(creq, max_name=128,
                                  new_id=lambda: "toolu_" + secrets.token_hex(12))

    async def prepare(self, rid: str, ticket) -> Generation:
        return await prepare_chat(self, self.prompt, rid, ticket)

    async def count_tokens(self) -> dict:
        """``{"input_tokens": N}``: the prompt a Messages body renders to, without generating."""
        body = await json_body()
        with field_scope(self.state.config):
            creq = parse_messages_request(
                body, count_only=True, keep_volatile=self.state.config.keep_volatile_spans)
            thinking = self.thinking(creq)
        creq.messages = self.prompt.placed_system(creq.messages)
        rendered = await self.prompt.render(creq, thinking.template_kwargs, self.prompt_param)
        return {"input_tokens": len(rendered.ids)}

    # -- replies ------------------------------------------------------------------------------
    async def collect(self, gen: Generation, base: dict) -> dict:
        await gen.receive_all()
        creq, c = gen.request, gen.choices[0]
        content = []
        if "".join(c.reasoning):   # (thinking.display "omitted": the block without its text)
            content.append({"type": "thinking", "signature": base["id"],
                            "thinking": "" if creq.thinking_display == "omitted"
                            else "".join(c.reasoning)})
        calls = c.tools.calls if c.tools is not None else []
        if "".join(c.parts):   # no empty text block (Anthropic's API refuses them as input)
            content.append({"type": "text", "text": "".join(c.parts)})
        content += [{"type": "tool_use", "id": k.id, "name": k.name,
                     "input": k.parsed_arguments() or {}} for k in calls]
        out = _message(base["id"], creq.model, content, c)
        out["timings"] = llama_timings([c.final])
        return out

    async def stream(self, gen: Generation, base: dict):
        creq, c = gen.request, gen.choices[0]
        ping_s = self.state.config.sse_ping_interval_s
        blocks = ContentBlocks(base["id"], creq.thinking_display == "omitted")
        started = False
        while not c.done:
            got = await next_output(gen.recv, ping_s)
            if got is None:
                yield sse_event("ping", {"type": "ping"})
                continue
            item = got.output
            if not started:   # at the first output: the lane's reuse is known by then
                started = True
                cached = c.ereq.cached_tokens or 0
                yield sse_event("message_start", {"type": "message_start", "message": {
                    **_message(base["id"], creq.model, [], None),
                    "usage": {"input_tokens": len(c.ereq.prompt_ids) - cached,
                              "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": cached, "output_tokens": 0}}})
            kind = "thinking" if is_reasoning(item) else "text"
            text = gen.absorb(c, item)
            if isinstance(item, ErrorOutput):
                yield sse_event("error", engine_error(item).anthropic_body())
                return
            out = (blocks.text(kind, text) if text else "") + blocks.tool_calls(c)
            if isinstance(item, FinalOutput):
                # the open block (an unfinished call's too); an empty answer has no block at
                # all, as in the non-streaming content
                out += blocks.close_open()
                out += sse_event("message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": _stop_reason(c), "stop_sequence": item.stop_string},
                    "usage": _usage(item)})
                out += sse_event("message_stop", {"type": "message_stop"})
            if out:
                yield out

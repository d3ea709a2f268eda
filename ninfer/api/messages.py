"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: the Anthropic Messages API over
the chat completions path (same admission, template, engine and events; serving contract §1.8).

A Messages body is validated (closed allow-lists, as Chat: an unknown field is ignored or, with
``--strict-request-fields``, 400 ``unknown_parameter`` naming its dotted path; ``fields``) and
turned into the chat form the template renders: ``system`` first (with the ``system``-role
messages that open ``messages``; a later one stays where it is, ``ChatHandler.placed_system``),
a turn's text blocks joined by a blank line, ``tool_use`` blocks as assistant tool calls,
``tool_result`` blocks as tool messages (``Error: `` before a failed one's text), ``thinking``
blocks as the assistant's reasoning; images are refused (``modality_not_supported``)
and so is a last assistant turn to continue (``prefill_not_supported``). Thinking is off unless
``thinking`` (enabled / adaptive; ``budget_tokens`` caps the thinking tokens) or
``output_config.effort`` asks for it (Anthropic's default);
``temperature`` is 0..1 as Anthropic's. ``model`` is a free label, echoed back, never a 404.
Replies:

- JSON: ``{"id": "msg_…", "type": "message", "role": "assistant", "model", "content": [thinking
  block, text block, tool_use blocks] (the text block only when text was produced), "stop_reason", "stop_sequence", "usage"}``; stop reasons ``end_turn`` (stop
  token), ``stop_sequence`` (with the matched string), ``max_tokens`` (output or context limit).
- SSE (``stream: true``): ``message_start``, then per block ``content_block_start`` /
  ``content_block_delta`` (``thinking_delta``, ``text_delta``) / ``content_block_stop`` with
  contiguous indices (no block when nothing was produced: ``content`` is ``[]`` then, as in
  the JSON form), ``message_delta`` (stop
  reason, the final usage), ``message_stop``; keep-alives are ``ping`` events; an engine error after
  the 200 is one ``error`` event, then the end of the stream.
- Usage: ``input_tokens`` (prompt tokens neither reused nor published), ``cache_read_input_tokens``
  (the reused prefix), ``cache_creation_input_tokens`` (prompt tokens past the reused prefix up
  to the deepest prompt-cache breakpoint this request published to L2 / L3:
  ``FinalOutput.cache_write_tokens``), ``output_tokens``.
- Prompt caching: ``cache_control: {"type": "ephemeral"}`` on a ``text`` / ``tool_result`` block
  is a breakpoint at the end of that block (on an assistant's tool call or last block: the
  turn's end); on ``system`` blocks and ``tools`` it is accepted and counted (the implicit
  system / tools boundary covers them); at most 4 per request
  (``too_many_cache_control_breakpoints``); a ``ttl`` other than ``"5m"`` is
  ``parameter_not_supported`` (``api.breakpoints``).

Errors on these routes use Anthropic's envelope (``errors.ApiError.anthropic_body``).
Source of the wire format: Anthropic's Messages API reference ("Messages", "Streaming
Messages", "Count tokens") and llama.cpp server's PR #17570.
"""
from __future__ import annotations

import json
import secrets

from quart import g

from ..engine.requests import ErrorOutput, FinalOutput
from . import fields
from .breakpoints import MAX_EXPLICIT
from .chat import (ChatHandler, Choice, _engine_error, _timings, is_reasoning, json_body,
                   next_output)
from .chat_request import (ChatRequest, _bad, _integer, _keys, _number, _object,
                           check_fields, preserve_thinking, required_model)
from .tool_calls import ToolCallParser

KNOWN_FIELDS = {"model", "messages", "max_tokens", "system", "stop_sequences", "stream",
                "temperature", "top_p", "top_k", "metadata", "thinking", "tools",
                "tool_choice", "service_tier", "output_config", "preserve_thinking",
                "cache_control"}
COUNT_FIELDS = {"model", "messages", "system", "thinking", "tools", "tool_choice",
                "output_config", "preserve_thinking", "cache_control"}
THINKING_DISPLAYS = ("summarized", "omitted")
SEP = "\n\n"   # between the text blocks of one turn (a system prompt in several blocks)
BLOCK_FIELDS = {"text": {"type", "text", "cache_control", "citations"},
                "tool_use": {"type", "id", "name", "input", "cache_control"},
                "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
                "thinking": {"type", "thinking", "signature"},
                "redacted_thinking": {"type", "data"}}
EFFORTS = ("low", "medium", "high", "xhigh", "max")
STOP_REASONS = {"stop_token": "end_turn", "stop_string": "stop_sequence",
                "output_limit": "max_tokens", "context_capacity": "max_tokens"}


def _cache_control(v, path: str) -> None:
    if v is None:
        return
    if not isinstance(v, dict) or v.get("type") != "ephemeral":
        raise _bad("'cache_control' must be {\"type\": \"ephemeral\"}", path)
    if v.get("ttl", "5m") != "5m":   # (Anthropic's default lifetime; images here have none)
        raise _bad("'cache_control.ttl' other than \"5m\" is not supported", f"{path}.ttl",
                   "parameter_not_supported")
    _keys(v, path, ("type", "ttl"))


def _blocks(content, path: str, allowed: tuple[str, ...]) -> list[dict]:
    """Content (a string or an array of blocks) as validated blocks of the ``allowed`` types."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad("'content' must be a string or an array of content blocks", path)
    out = []
    for i, b in enumerate(content):
        bp = f"{path}[{i}]"
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise _bad("each content block must be an object with a 'type'", bp)
        kind = b["type"]
        if kind in ("image", "document"):
            raise _bad(f"'{kind}' blocks are not supported (text only)", f"{bp}.type",
                       "modality_not_supported")
        if kind not in BLOCK_FIELDS or kind not in allowed:
            raise _bad(f"content block type '{kind}' is not accepted here", f"{bp}.type")
        _keys(b, bp, BLOCK_FIELDS[kind])
        _cache_control(b.get("cache_control"), f"{bp}.cache_control")
        if kind == "text" and not isinstance(b.get("text"), str):
            raise _bad("a text block needs 'text' (a string)", f"{bp}.text")
        if kind == "thinking" and not isinstance(b.get("thinking"), str):
            raise _bad("a thinking block needs 'thinking' (a string)", f"{bp}.thinking")
        if kind == "tool_use" and not (isinstance(b.get("id"), str)
                                       and isinstance(b.get("name"), str)
                                       and isinstance(b.get("input", {}), dict)):
            raise _bad("a tool_use block needs 'id', 'name' (strings) and 'input' (an object)",
                       bp)
        if kind == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise _bad("a tool_result block needs 'tool_use_id' (a string)",
                           f"{bp}.tool_use_id")
            if b.get("is_error") is not None and not isinstance(b["is_error"], bool):
                raise _bad("'is_error' must be a boolean", f"{bp}.is_error")
            inner = _blocks("" if b.get("content") is None else b["content"],
                            f"{bp}.content", ("text",))
            text = SEP.join(x["text"] for x in inner)
            # cache_control on the result's own text blocks: marks of the result's end
            b = {**b, "content": ("Error: " + text) if b.get("is_error") else text,
                 "inner_marks": sum(x.get("cache_control") is not None for x in inner)}
        out.append(b)
    return out


def _chat_messages(body: dict) -> tuple[list[dict], list[tuple], int]:
    """The Messages body's ``system`` and ``messages`` in the chat form the template renders,
    the prompt-cache breakpoints their ``cache_control`` marks ask for (``(message index,
    char offset or None)``, ``ChatRequest.cache_breakpoints``: a ``text`` / ``tool_result``
    block's end; on an assistant turn, whose text and tool calls the template lays out, the end
    of a marked text block followed by more, else the turn's end) and how many marks there were
    (``system`` blocks included: accepted and counted, but the implicit system / tools boundary
    already covers them)."""
    out, marks, count = [], [], 0
    system = body.get("system")
    if system is not None:
        blocks = _blocks(system, "system", ("text",))
        count += sum(b.get("cache_control") is not None for b in blocks)
        text = SEP.join(b["text"] for b in blocks)
        out.append({"role": "system", "content": text})
    raw = body.get("messages")
    if raw is None:
        raise _bad("'messages' is required", "messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty array", "messages")
    for i, m in enumerate(raw):
        path = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad("each message must be an object", path)
        _keys(m, path, ("role", "content"))
        role = m.get("role")
        if role not in ("user", "assistant", "system"):
            raise _bad("'role' must be 'user', 'assistant' or 'system'", f"{path}.role")
        if "content" not in m:
            raise _bad("'content' is required", f"{path}.content")
        if role == "system" and all(x["role"] == "system" for x in out):
            # leading: part of the system prompt (its marks covered by the implicit boundary)
            blocks = _blocks(m["content"], f"{path}.content", ("text",))
            count += sum(b.get("cache_control") is not None for b in blocks)
            text = SEP.join([x["content"] for x in out] + [b["text"] for b in blocks])
            out[:] = [{"role": "system", "content": text}]
            continue
        if role in ("user", "system"):
            # (a system message after the conversation began, as Claude Code's environment
            # block: ChatHandler.placed_system makes it a user turn where the template needs)
            blocks = _blocks(m["content"], f"{path}.content",
                             ("text", "tool_result") if role == "user" else ("text",))
            count += sum((b.get("cache_control") is not None) + b.get("inner_marks", 0)
                         for b in blocks)
            for b in blocks:
                if b["type"] == "tool_result":
                    if b.get("cache_control") is not None or b["inner_marks"]:
                        marks.append((len(out), None))
                    out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                                "content": b["content"]})
            texts = [b for b in blocks if b["type"] == "text"]
            for j, b in enumerate(texts):
                if b.get("cache_control") is not None:   # the end of this block's text
                    marks.append((len(out), None if j == len(texts) - 1 else
                                  len(SEP.join(x["text"] for x in texts[:j + 1]))))
            if texts or not blocks:
                out.append({"role": role, "content": SEP.join(b["text"] for b in texts)})
            continue
        if i == len(raw) - 1:
            raise _bad("a last assistant turn (a prefill to continue) is not supported",
                       f"{path}.role", "prefill_not_supported")
        blocks = _blocks(m["content"], f"{path}.content",
                         ("text", "tool_use", "thinking", "redacted_thinking"))
        count += sum(b.get("cache_control") is not None for b in blocks)
        shown = [b for b in blocks if b["type"] in ("text", "tool_use")]
        texts = [b for b in blocks if b["type"] == "text"]
        for j, b in enumerate(shown):
            if b.get("cache_control") is None:
                continue
            if j == len(shown) - 1 or b["type"] == "tool_use":
                marks.append((len(out), None))   # the turn's end
            else:   # a text block with more after it: the end of its text
                upto = texts[:next(k for k, x in enumerate(texts) if x is b) + 1]
                marks.append((len(out), len(SEP.join(x["text"] for x in upto))))
        msg = {"role": "assistant",
               "content": SEP.join(b["text"] for b in blocks if b["type"] == "text")}
        reasoning = "".join(b["thinking"] for b in blocks if b["type"] == "thinking")
        if reasoning:
            msg["reasoning_content"] = reasoning
        calls = [{"id": b["id"], "type": "function",
                  "function": {"name": b["name"],
                               "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)}}
                 for b in blocks if b["type"] == "tool_use"]
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out, marks, count


def _tools(body: dict) -> list | None:
    """Anthropic client tools as the chat template's function tools."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be an array", "tools")
    out = []
    for i, t in enumerate(tools):
        path = f"tools[{i}]"
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise _bad("each tool needs a 'name' (a string)", path)
        if t.get("type") not in (None, "custom"):
            raise _bad(f"tool type '{t.get('type')}' is not supported (client tools only)",
                       f"{path}.type", "tool_type_not_supported")
        _keys(t, path, ("name", "description", "input_schema", "type", "cache_control"))
        _cache_control(t.get("cache_control"), f"{path}.cache_control")
        schema = t.get("input_schema")
        if schema is not None and not isinstance(schema, dict):
            raise _bad("'input_schema' must be an object (a JSON schema)",
                       f"{path}.input_schema")
        if t.get("strict") is True:
            raise _bad("strict tools are not supported (no constrained decoding)",
                       f"{path}.strict", "strict_tools_not_supported")
        fn = {"name": t["name"], "parameters": schema or {"type": "object"}}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out or None


def _thinking(body: dict) -> tuple[bool | None, str | None, int | None, str | None]:
    """(enable_thinking, reasoning effort, budget_tokens, display) from ``thinking`` and
    ``output_config.effort``; ``output_config.format`` (structured output) is refused."""
    th = _object(body.get("thinking"), "thinking", ("type", "budget_tokens", "display"))
    enable = bt = display = None
    if th is not None:
        display = th.get("display")
        if display is not None and display not in THINKING_DISPLAYS:
            raise _bad("'thinking.display' must be summarized or omitted", "thinking.display")
        if th.get("type") not in ("enabled", "disabled", "adaptive"):
            raise _bad("'thinking.type' must be enabled, disabled or adaptive", "thinking.type")
        bt = th.get("budget_tokens")
        if bt is not None and (isinstance(bt, bool) or not isinstance(bt, int) or bt < 1):
            raise _bad("'thinking.budget_tokens' must be a positive integer",
                       "thinking.budget_tokens")
        enable = th["type"] != "disabled"
    oc = _object(body.get("output_config"), "output_config", ("effort", "format"))
    effort = None
    if oc is not None and oc.get("format") is not None:
        raise _bad("structured output (output_config.format) is not supported (no "
                   "constrained decoding)", "output_config.format",
                   "response_format_not_supported")
    if oc is not None:
        effort = oc.get("effort")
        if effort is not None and effort not in EFFORTS:
            raise _bad(f"'output_config.effort' must be one of {', '.join(EFFORTS)}",
                       "output_config.effort")
    if enable is False and effort is not None:
        raise _bad("'thinking': disabled contradicts 'output_config.effort'",
                   "output_config.effort", "conflicting_template_option")
    if enable is None and effort is None:
        enable = False   # Anthropic's default: no thinking unless asked for
    # the chat path's efforts: xhigh / max ask for the most it offers
    if effort in ("xhigh", "max"):
        effort = "high"
    return enable, effort, bt, display


def _auto_cache_control(body: dict) -> dict:
    """``body`` with a top-level ``cache_control`` moved onto the last block of the last
    message that has none of its own (Anthropic's automatic prompt caching: a breakpoint at
    the last cacheable block)."""
    cc = body.get("cache_control")
    if cc is None:
        return body
    _cache_control(cc, "cache_control")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw or not isinstance(raw[-1], dict):
        return body   # (the messages' own validation names what is wrong)
    last = raw[-1]
    content = last.get("content")
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list) or not content or not isinstance(content[-1], dict):
        return body
    if content[-1].get("cache_control") is None:
        content = content[:-1] + [{**content[-1], "cache_control": cc}]
    return {**body, "messages": raw[:-1] + [{**last, "content": content}]}


def parse_messages_request(body, count_only: bool = False) -> ChatRequest:
    """Validate a decoded Messages body into the chat request the handler runs (``model``: the
    requested label). ``count_only``: a ``count_tokens`` body (no ``max_tokens``, no sampling).

    Raises:
        ApiError: 400 with a stable code / param for every client mistake.
    """
    check_fields(body, COUNT_FIELDS if count_only else KNOWN_FIELDS)
    model = required_model(body)
    messages, marks, n_marks = _chat_messages(_auto_cache_control(body))
    if all(m["role"] == "system" for m in messages):
        raise _bad("'messages' needs a user turn (system text alone is no conversation)",
                   "messages")
    enable, effort, budget, display = _thinking(body)
    tools = _tools(body)
    raw_tools = body.get("tools") or []
    n_marks += sum(isinstance(t, dict) and t.get("cache_control") is not None for t in raw_tools)
    if n_marks > MAX_EXPLICIT:
        raise _bad(f"{n_marks} cache_control breakpoints: at most {MAX_EXPLICIT} per request",
                   "messages", "too_many_cache_control_breakpoints")
    tc = body.get("tool_choice")
    parallel = True   # tool_choice.disable_parallel_tool_use: at most one tool_use block
    if tc is not None:
        if not isinstance(tc, dict) or tc.get("type") not in ("auto", "none"):
            raise _bad("only tool_choice {\"type\": \"auto\"} or {\"type\": \"none\"} is "
                       "supported", "tool_choice", "tool_choice_not_supported")
        _keys(tc, "tool_choice", ("type", "disable_parallel_tool_use"))
        single = tc.get("disable_parallel_tool_use")
        if single is not None and not isinstance(single, bool):
            raise _bad("'tool_choice.disable_parallel_tool_use' must be a boolean",
                       "tool_choice.disable_parallel_tool_use")
        parallel = not single
        if tc["type"] == "none":
            tools = None
    preserve = preserve_thinking(body)   # (no chat_template_kwargs on this route)
    if count_only:
        return ChatRequest(model=model, messages=messages, max_tokens=None, temperature=None,
                           top_p=None, top_k=None, min_p=None, seed=None, stop=(),
                           stream=False, include_usage=False, tools=tools,
                           reasoning_effort=effort, enable_thinking=enable,
                           thinking_budget=budget, preserve_thinking=preserve,
                           cache_breakpoints=tuple(marks))
    if body.get("max_tokens") is None:
        raise _bad("'max_tokens' is required", "max_tokens")
    max_tokens = _integer(body, "max_tokens", 1, 2 ** 31 - 1)
    stops = body.get("stop_sequences")
    if stops is None:
        stops = []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("'stop_sequences' must be an array of strings", "stop_sequences")
    if len(stops) > 16:
        raise _bad("at most 16 stop sequences", "stop_sequences")
    stream = body.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    for name, kind in (("metadata", dict), ("service_tier", str)):
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise _bad(f"'{name}' must be {'an object' if kind is dict else 'a string'}", name)
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p is not None and top_p <= 0.0:
        raise _bad("'top_p' must be greater than 0", "top_p")
    return ChatRequest(
        model=model, messages=messages, max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 1.0), top_p=top_p,
        top_k=_integer(body, "top_k", 0, 2 ** 31 - 1), min_p=None, seed=None,
        stop=tuple(s for s in stops if s), stream=stream, include_usage=False, tools=tools,
        reasoning_effort=effort, enable_thinking=enable, thinking_budget=budget,
        preserve_thinking=preserve, cache_breakpoints=tuple(marks),
        parallel_tool_calls=parallel, thinking_display=display)


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


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: " + json.dumps(data, ensure_ascii=False,
                                                  separators=(",", ":")) + "\n\n"


class MessagesHandler(ChatHandler):
    """Serves ``/v1/messages`` (and ``count_tokens``) for one ServerState (module docstring)."""

    protocol = "anthropic_messages"
    id_prefix = "msg_"
    thinking_params = {"enable_thinking": "thinking", "reasoning_effort": "output_config.effort"}

    def _parse(self, body) -> ChatRequest:
        return parse_messages_request(body)

    def _check_model(self, creq: ChatRequest) -> None:
        pass  # a free label (§1.8): any string is accepted and echoed

    def _thinking(self, creq: ChatRequest):
        """The chat path's thinking resolution, the thinking-token budget capped by
        ``thinking.budget_tokens``."""
        kwargs, budget = super()._thinking(creq)
        cap = creq.thinking_budget
        if cap is not None and kwargs.get("enable_thinking"):
            budget = cap if budget is None else min(budget, cap)
        return kwargs, budget

    async def count_tokens(self) -> dict:
        """``{"input_tokens": N}``: the prompt a Messages body renders to, without generating."""
        body = await json_body()
        with fields.field_policy(self.state.config.strict_request_fields) as policy:
            creq = parse_messages_request(body, count_only=True)
            template_kwargs, _ = self._thinking(creq)
        g.ignored_fields = policy.names()
        creq.messages = self.placed_system(creq.messages)
        return {"input_tokens": len(await self._prompt_ids(creq, template_kwargs))}

    def _tool_parser(self, creq: ChatRequest, **options) -> ToolCallParser | None:
        return super()._tool_parser(creq, max_name=128,
                                    new_id=lambda: "toolu_" + secrets.token_hex(12))

    @staticmethod
    def _message(rid: str, model: str, content: list, c: Choice | None) -> dict:
        final = c.final if c is not None else None
        return {"id": rid, "type": "message", "role": "assistant", "model": model,
                "content": content, "stop_reason": _stop_reason(c) if final else None,
                "stop_sequence": final.stop_string if final else None,
                "usage": _usage(final) if final else None}

    async def _collect(self, creq, body, choices, recv, base):
        await self._receive_all(choices, recv)
        c = choices[0]
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
        out = self._message(base["id"], creq.model, content, c)
        out["timings"] = _timings([c.final])
        return out

    async def _stream(self, creq, body, choices, recv, base, release):
        c = choices[0]
        ping_s = self.state.config.sse_ping_interval_s
        n_prompt = len(c.ereq.prompt_ids)
        opened: list[str] = []   # the kinds of the blocks opened so far
        is_open = False          # the last one is still open

        def switch(kind: str, call=None) -> str:
            """Close the open block if it is of another kind (a thinking block with its
            signature) or a tool call, open one of ``kind``."""
            nonlocal is_open
            if is_open and opened[-1] == kind and kind != "tool_use":
                return ""
            out = close() if is_open else ""
            opened.append(kind)
            is_open = True
            block = {"thinking": {"type": "thinking", "thinking": "", "signature": ""},
                     "text": {"type": "text", "text": ""}}.get(kind)
            if kind == "tool_use":
                block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
            return out + _event("content_block_start", {"type": "content_block_start",
                                                        "index": len(opened) - 1,
                                                        "content_block": block})

        def tool_blocks() -> str:
            """The tool calls parsed since the last event: a ``tool_use`` block each, its
            input streamed as ``input_json_delta`` fragments."""
            out = ""
            for e in c.call_events:
                if e.kind == "start":
                    out += switch("tool_use", e.call)
                elif e.kind == "args":
                    out += _event("content_block_delta", {
                        "type": "content_block_delta", "index": len(opened) - 1,
                        "delta": {"type": "input_json_delta", "partial_json": e.text}})
                elif e.kind == "end":
                    out += close()
            c.call_events = []
            return out

        def close() -> str:
            nonlocal is_open
            i = len(opened) - 1
            out = ""
            if opened[-1] == "thinking":
                out = _event("content_block_delta", {
                    "type": "content_block_delta", "index": i,
                    "delta": {"type": "signature_delta", "signature": base["id"]}})
            is_open = False
            return out + _event("content_block_stop", {"type": "content_block_stop", "index": i})

        def delta(kind: str, text: str) -> str:
            if kind == "thinking" and creq.thinking_display == "omitted":
                return switch(kind)   # the block and its signature, not its text
            d = ({"type": "thinking_delta", "thinking": text} if kind == "thinking"
                 else {"type": "text_delta", "text": text})
            return switch(kind) + _event("content_block_delta", {
                "type": "content_block_delta", "index": len(opened) - 1, "delta": d})

        try:
            yield _event("message_start", {"type": "message_start", "message": {
                **self._message(base["id"], creq.model, [], None),
                "usage": {"input_tokens": n_prompt, "cache_creation_input_tokens": 0,
                          "cache_read_input_tokens": 0, "output_tokens": 0}}})
            async with recv:
                while not c.done:
                    got = await next_output(recv, ping_s)
                    if got is None:
                        yield _event("ping", {"type": "ping"})
                        continue
                    _, item = got
                    kind = "thinking" if is_reasoning(item) else "text"
                    text = self._absorb(c, item)
                    if isinstance(item, ErrorOutput):
                        err = _engine_error(item)
                        yield _event("error", err.anthropic_body())
                        return
                    out = (delta(kind, text) if text else "") + tool_blocks()
                    if isinstance(item, FinalOutput):
                        # the open block (an unfinished call's too); an empty answer has
                        # no block at all, as in the non-streaming content
                        out += close() if is_open else ""
                        out += _event("message_delta", {
                            "type": "message_delta",
                            "delta": {"stop_reason": _stop_reason(c),
                                      "stop_sequence": item.stop_string},
                            "usage": _usage(item)})
                        out += _event("message_stop", {"type": "message_stop"})
                    if out:
                        yield out
        finally:
            self._cancel_unfinished(choices)
            release()

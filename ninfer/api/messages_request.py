"""Validation of ``POST /v1/messages`` (and ``count_tokens``) bodies into the ``ChatRequest``
the chat-form path runs (serving contract §1.8).

Closed allow-lists, as Chat: an unknown field is ignored or, with ``--strict-request-fields``,
400 ``unknown_parameter`` naming its dotted path (``fields``). Thinking is off unless
``thinking`` (enabled / adaptive; ``budget_tokens`` caps the thinking tokens) or
``output_config.effort`` asks for it (Anthropic's default); ``temperature`` is 0..1 as
Anthropic's; ``model`` is a free label, echoed back, never a 404. Prompt caching:
``cache_control: {"type": "ephemeral"}`` on a ``text`` / ``tool_result`` block is a breakpoint
at the end of that block (on an assistant's tool call or last block: the turn's end); on
``system`` blocks and ``tools`` it is accepted and counted (the implicit system / tools boundary
covers them); at most 4 per request (``too_many_cache_control_breakpoints``); a ``ttl`` other
than ``"5m"`` is ``parameter_not_supported`` (``api.breakpoints``). The content itself:
``messages_content``.
"""
from __future__ import annotations

import re

from dataclasses import dataclass

from .breakpoints import MAX_EXPLICIT
from .chat_request import ChatRequest
from .validation import (check_fields, check_keys, integer_field, invalid, number_field,
                         object_field, preserve_thinking, required_model, tool_entries)
from .messages_content import chat_form, check_cache_control
from .volatile import strip_system

KNOWN_FIELDS = {"model", "messages", "max_tokens", "system", "stop_sequences", "stream",
                "temperature", "top_p", "top_k", "metadata", "thinking", "tools",
                "tool_choice", "service_tier", "output_config", "preserve_thinking",
                "cache_control"}
COUNT_FIELDS = {"model", "messages", "system", "thinking", "tools", "tool_choice",
                "output_config", "preserve_thinking", "cache_control"}
THINKING_DISPLAYS = ("summarized", "omitted")
EFFORTS = ("low", "medium", "high", "xhigh", "max")


@dataclass(frozen=True, slots=True)
class MessagesThinking:
    """What ``thinking`` and ``output_config.effort`` ask for (None: not said)."""
    enable: bool | None
    effort: str | None          # the chat path's effort (xhigh / max read as high)
    budget_tokens: int | None   # a cap on the thinking tokens
    display: str | None         # "omitted": the thinking block without its text


MESSAGES_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")


def _tools(body: dict) -> list | None:
    """Anthropic client tools as the chat template's function tools."""
    tools = tool_entries(body.get("tools"))
    if tools is None:
        return None
    out, names = [], set()
    for path, t in tools:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise invalid("each tool needs a 'name' (a string)", path)
        if t["name"] in names:   # (as Anthropic's API: a call could not say which one)
            raise invalid(f"tool names must be unique ('{t['name'][:128]}' twice)",
                       f"{path}.name")
        names.add(t["name"])
        if t.get("type") not in (None, "custom"):
            raise invalid(f"tool type '{t.get('type')}' is not supported (client tools only)",
                       f"{path}.type", "tool_type_not_supported")
        check_keys(t, path, ("name", "description", "input_schema", "type", "cache_control"))
        check_cache_control(t.get("cache_control"), f"{path}.cache_control")
        if not MESSAGES_TOOL_NAME.fullmatch(t["name"]):   # (Anthropic's pattern)
            raise invalid("a tool's name is 1-128 characters of A-Z a-z 0-9 _ -",
                       f"{path}.name")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):   # (required by Anthropic for client tools)
            raise invalid("each tool needs an 'input_schema' object (a JSON schema)",
                       f"{path}.input_schema")
        if t.get("strict") is True:
            raise invalid("strict tools are not supported (no constrained decoding)",
                       f"{path}.strict", "strict_tools_not_supported")
        fn = {"name": t["name"], "parameters": schema}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out or None


def _thinking(body: dict) -> MessagesThinking:
    """The thinking asked for by ``thinking`` and ``output_config.effort``;
    ``output_config.format`` (structured output) is refused."""
    th = object_field(body.get("thinking"), "thinking", ("type", "budget_tokens", "display"))
    enable = bt = display = None
    if th is not None:
        display = th.get("display")
        if display is not None and display not in THINKING_DISPLAYS:
            raise invalid("'thinking.display' must be summarized or omitted", "thinking.display")
        if th.get("type") not in ("enabled", "disabled", "adaptive"):
            raise invalid("'thinking.type' must be enabled, disabled or adaptive", "thinking.type")
        bt = th.get("budget_tokens")
        if bt is not None and (isinstance(bt, bool) or not isinstance(bt, int) or bt < 1):
            raise invalid("'thinking.budget_tokens' must be a positive integer",
                       "thinking.budget_tokens")
        enable = th["type"] != "disabled"
    oc = object_field(body.get("output_config"), "output_config", ("effort", "format"))
    effort = None
    if oc is not None and oc.get("format") is not None:
        raise invalid("structured output (output_config.format) is not supported (no "
                   "constrained decoding)", "output_config.format",
                   "response_format_not_supported")
    if oc is not None:
        effort = oc.get("effort")
        if effort is not None and effort not in EFFORTS:
            raise invalid(f"'output_config.effort' must be one of {', '.join(EFFORTS)}",
                       "output_config.effort")
    if enable is False and effort is not None:
        raise invalid("'thinking': disabled contradicts 'output_config.effort'",
                   "output_config.effort", "conflicting_template_option")
    if enable is None and effort is None:
        enable = False   # Anthropic's default: no thinking unless asked for
    # the chat path's efforts: xhigh / max ask for the most it offers
    if effort in ("xhigh", "max"):
        effort = "high"
    return MessagesThinking(enable=enable, effort=effort, budget_tokens=bt, display=display)


def _auto_cache_control(body: dict) -> dict:
    """``body`` with a top-level ``cache_control`` moved onto the last block of the last
    message that has none of its own (Anthropic's automatic prompt caching: a breakpoint at
    the last cacheable block)."""
    cc = body.get("cache_control")
    if cc is None:
        return body
    check_cache_control(cc, "cache_control")
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


def parse_messages_request(body, count_only: bool = False,
                           keep_volatile: bool = False) -> ChatRequest:
    """Validate a decoded Messages body into the chat request the handler runs (``model``: the
    requested label). ``count_only``: a ``count_tokens`` body (no ``max_tokens``, no sampling).
    The known volatile spans of its system prompt are dropped (``api.volatile``) unless
    ``keep_volatile``; ``ChatRequest.volatile_spans`` names them.

    Raises:
        ApiError: 400 with a stable code / param for every client mistake.
    """
    check_fields(body, COUNT_FIELDS if count_only else KNOWN_FIELDS)
    model = required_model(body)
    spans = ()
    if not keep_volatile:
        body, spans = strip_system(body)
    form = chat_form(_auto_cache_control(body))
    messages, marks, n_marks = form.messages, form.marks, form.n_marks
    if all(m["role"] == "system" for m in messages):
        raise invalid("'messages' needs a user turn (system text alone is no conversation)",
                   "messages")
    thinking = _thinking(body)
    tools = _tools(body)
    raw_tools = body.get("tools") or []
    n_marks += sum(isinstance(t, dict) and t.get("cache_control") is not None for t in raw_tools)
    if n_marks > MAX_EXPLICIT:
        raise invalid(f"{n_marks} cache_control breakpoints: at most {MAX_EXPLICIT} per request",
                   "messages", "too_many_cache_control_breakpoints")
    tc = body.get("tool_choice")
    parallel = True   # tool_choice.disable_parallel_tool_use: at most one tool_use block
    if tc is not None:
        if not isinstance(tc, dict) or tc.get("type") not in ("auto", "none"):
            raise invalid("only tool_choice {\"type\": \"auto\"} or {\"type\": \"none\"} is "
                       "supported", "tool_choice", "tool_choice_not_supported")
        check_keys(tc, "tool_choice", ("type", "disable_parallel_tool_use"))
        single = tc.get("disable_parallel_tool_use")
        if single is not None and not isinstance(single, bool):
            raise invalid("'tool_choice.disable_parallel_tool_use' must be a boolean",
                       "tool_choice.disable_parallel_tool_use")
        parallel = not single
        if tc["type"] == "none":
            tools = None
    preserve = preserve_thinking(body)   # (no chat_template_kwargs on this route)
    if count_only:
        return ChatRequest(model=model, messages=messages, max_tokens=None, temperature=None,
                           top_p=None, top_k=None, min_p=None, seed=None, stop=(),
                           stream=False, include_usage=False, tools=tools,
                           reasoning_effort=thinking.effort,
                           enable_thinking=thinking.enable,
                           thinking_budget=thinking.budget_tokens, preserve_thinking=preserve,
                           cache_breakpoints=tuple(marks), volatile_spans=spans)
    if body.get("max_tokens") is None:
        raise invalid("'max_tokens' is required", "max_tokens")
    max_tokens = integer_field(body, "max_tokens", 1, 2 ** 31 - 1)
    stops = body.get("stop_sequences")
    if stops is None:
        stops = []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("'stop_sequences' must be an array of strings", "stop_sequences")
    if len(stops) > 16:
        raise invalid("at most 16 stop sequences", "stop_sequences")
    stream = body.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise invalid("'stream' must be a boolean", "stream")
    for name, kind in (("metadata", dict), ("service_tier", str)):
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise invalid(f"'{name}' must be {'an object' if kind is dict else 'a string'}", name)
    top_p = number_field(body, "top_p", 0.0, 1.0)
    if top_p is not None and top_p <= 0.0:
        raise invalid("'top_p' must be greater than 0", "top_p")
    return ChatRequest(
        model=model, messages=messages, max_tokens=max_tokens,
        temperature=number_field(body, "temperature", 0.0, 1.0), top_p=top_p,
        top_k=integer_field(body, "top_k", 0, 2 ** 31 - 1), min_p=None, seed=None,
        stop=tuple(s for s in stops if s), stream=stream, include_usage=False, tools=tools,
        reasoning_effort=thinking.effort, enable_thinking=thinking.enable,
        thinking_budget=thinking.budget_tokens, preserve_thinking=preserve,
        cache_breakpoints=tuple(marks), parallel_tool_calls=parallel,
        thinking_display=thinking.display, volatile_spans=spans,
        session_user=_user_id(body.get("metadata")))


def _user_id(metadata) -> str | None:
    """``metadata.user_id`` when it is a non-empty string (Claude Code sends one per session):
    the request's session key for lane choice, never an authorisation."""
    uid = metadata.get("user_id") if isinstance(metadata, dict) else None
    return uid if isinstance(uid, str) and uid else None

"""Validation of ``POST /v1/chat/completions`` bodies into a typed ``ChatRequest``.

Closed allow-list: an unrecognised top-level or message field is a 400 ``unknown_parameter``
naming it (param = dotted path); recognised but unsupported values fail with a specific code;
wrong types and out-of-range values are 400 ``invalid_request_error`` with code
``invalid_value``, naming the parameter.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

from .tool_calls import strict_json
from .validation import (boolean_field, check_fields, check_keys, echo_only_fields,
                         integer_field, invalid, number_field, object_field, positive_top_p,
                         preserve_thinking)

KNOWN_FIELDS = {
    "model", "messages", "max_completion_tokens", "max_tokens", "temperature", "top_p", "top_k",
    "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop",
    "stream", "stream_options", "tools", "tool_choice", "parallel_tool_calls", "logit_bias",
    "logprobs", "top_logprobs", "n", "user", "metadata", "service_tier", "store",
    "response_format", "modalities", "audio", "web_search_options",
    "verbosity", "functions", "function_call", "chat_template_kwargs",
    "reasoning_effort", "enable_thinking", "prompt_cache_key", "preserve_thinking",
    "ignore_eos",   # vLLM's and llama.cpp's: generate through end-of-turn tokens (benchmarks)
}
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
UNSUPPORTED = {"audio", "web_search_options", "verbosity"}
ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_N = 16
MAX_TOP_LOGPROBS = 20
MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "function_call",
                  "reasoning_content", "refusal", "audio", "annotations", "parsed"}
# nested closed allow-lists (serving contract §1.3: any unrecognised nested field is
# unknown_parameter, named by its dotted path)
TEXT_PART_FIELDS = ("type", "text")
# between the text parts of one message, as vLLM ("\n".join in chat_utils) and llama.cpp
# (concat_typed_text in common/chat.cpp) join them for a template that takes a string
PART_SEP = "\n"
# (index: a history built from streamed delta.tool_calls carries it; accepted and dropped)
TOOL_CALL_FIELDS = ("id", "type", "function", "index")
# (parsed_arguments, and a message's parsed: what the OpenAI SDK's stream helpers add to the
# message they return, sent back whole; accepted and dropped)
TOOL_CALL_FUNCTION_FIELDS = ("name", "arguments", "parsed_arguments")
TOOL_FIELDS = ("type", "function")
TOOL_FUNCTION_FIELDS = ("name", "description", "parameters", "strict")


class CacheMark(NamedTuple):
    """An explicit prompt-cache breakpoint: in message ``message``, after ``offset`` characters
    of its content (None: the end of the message)."""
    message: int
    offset: int | None


@dataclass(slots=True)
class ChatRequest:
    """A validated chat completion request (sampling values resolved later against defaults)."""
    model: str | None
    messages: list
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    stop: tuple
    stream: bool
    include_usage: bool
    tools: list | None
    n: int = 1
    parallel_tool_calls: bool = True   # False: at most one call (ToolCallParser.max_calls)
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    reasoning_effort: str | None = None
    enable_thinking: bool | None = None
    preserve_thinking: bool | None = None   # None: the server's --preserve-thinking
    prompt_cache_key: str | None = None
    session_user: str | None = None   # Messages' metadata.user_id (a session key)
    ignore_eos: bool = False
    thinking_budget: int | None = None   # Messages' thinking.budget_tokens (a cap)
    # prompt-cache breakpoints (api.breakpoints): explicit marks (CacheMark), and whether the
    # implicit system / tools boundary applies (Responses' prompt_cache_options.mode
    # "explicit" turns it off)
    cache_breakpoints: tuple = ()
    implicit_breakpoints: bool = True
    thinking_display: str | None = None   # Messages' thinking.display ("omitted": no text)
    volatile_spans: tuple = ()   # known volatile prompt spans dropped (api.volatile)
    loose_arguments: tuple = ()   # Chat: tool calls' arguments that are no JSON object (params)


def _text_content(content, path: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise invalid("only text content parts are supported", f"{path}[{i}]",
                           "modality_not_supported" if isinstance(part, dict) else None)
            check_keys(part, f"{path}[{i}]", TEXT_PART_FIELDS)
            parts.append(part["text"])
        return PART_SEP.join(parts)
    raise invalid("'content' must be a string or an array of text parts", path)


def _messages(raw) -> list[dict]:
    if raw is None:
        raise invalid("'messages' is required", "messages")
    if not isinstance(raw, list):
        raise invalid("'messages' must be an array", "messages")
    if not raw:
        raise invalid("'messages' must not be empty", "messages")
    out = []
    for i, m in enumerate(raw):
        path = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid("each message must be an object", path)
        check_keys(m, path, MESSAGE_FIELDS)
        role = m.get("role")
        if not isinstance(role, str):
            raise invalid("'role' must be a string", f"{path}.role")
        if role == "function":
            raise invalid("role 'function' is not supported", f"{path}.role", "unsupported_role")
        if role not in ROLES:
            raise invalid(f"unknown role '{role}'", f"{path}.role")
        if m.get("function_call") is not None:
            raise invalid("legacy function_call is not supported; use tool_calls",
                       f"{path}.function_call", "tools_not_supported")
        if m.get("audio") is not None:
            raise invalid("audio is not supported (text-only model)", f"{path}.audio",
                       "modality_not_supported")
        if m.get("refusal") is not None and not isinstance(m["refusal"], str):
            raise invalid("'refusal' must be a string", f"{path}.refusal")
        # a response message sent back whole (``message.model_dump()``) has annotations:
        # URL citations of a search, which this server never makes; accepted and dropped
        if m.get("annotations") is not None and not isinstance(m["annotations"], list):
            raise invalid("'annotations' must be an array", f"{path}.annotations")
        msg = {"role": role}
        content = m.get("content")
        if content is None:
            if role != "assistant" or not m.get("tool_calls"):
                if "content" not in m:
                    raise invalid("'content' is required", f"{path}.content")
                raise invalid("'content' must be a string or an array of text parts, not null"
                              + (" (null only beside 'tool_calls')" if role == "assistant"
                                 else ""), f"{path}.content")
            msg["content"] = None
        else:
            msg["content"] = _text_content(content, f"{path}.content")
        for k in ("name", "tool_call_id", "reasoning_content"):
            if m.get(k) is not None:
                if not isinstance(m[k], str):
                    raise invalid(f"'{k}' must be a string", f"{path}.{k}")
                msg[k] = m[k]
        if m.get("tool_calls") is not None:
            if role != "assistant" or not isinstance(m["tool_calls"], list):
                raise invalid("'tool_calls' must be an array on an assistant message",
                           f"{path}.tool_calls")
            for j, call in enumerate(m["tool_calls"]):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                        not isinstance(fn.get("arguments", ""), str):
                    raise invalid("each tool call needs function.name and function.arguments "
                               "(a JSON string)", f"{path}.tool_calls[{j}]")
                check_keys(call, f"{path}.tool_calls[{j}]", TOOL_CALL_FIELDS)
                check_keys(fn, f"{path}.tool_calls[{j}].function", TOOL_CALL_FUNCTION_FIELDS)
            msg["tool_calls"] = m["tool_calls"]
        if role == "tool" and "tool_call_id" not in msg:
            raise invalid("tool messages need 'tool_call_id'", f"{path}.tool_call_id")
        out.append(msg)
    return out


def _object_or_empty(arguments: str) -> bool:
    """Whether a tool call's ``arguments`` text is empty or a JSON object."""
    if not arguments.strip():
        return True
    try:
        return isinstance(strict_json(arguments), dict)
    except ValueError:
        return False


def _loose_arguments(raw: list) -> tuple[str, ...]:
    """The params of the (validated) messages' tool calls whose ``arguments`` are not a JSON
    object: kept as sent (an answer cut inside a call, echoed back), and named if the chat
    template fails on them."""
    return tuple(f"messages[{i}].tool_calls[{j}].function.arguments"
                 for i, m in enumerate(raw) for j, call in enumerate(m.get("tool_calls") or ())
                 if not _object_or_empty(call["function"].get("arguments", "")))


TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def parse_chat_request(body) -> ChatRequest:
    """Validate a decoded JSON body.

    Raises:
        ApiError: 400 with a stable code / param for every client mistake.
    """
    for k in check_fields(body, KNOWN_FIELDS):
        if k in UNSUPPORTED and body[k] is not None:
            raise invalid(f"'{k}' is not supported", k, "parameter_not_supported")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("'model' must be a string", "model")
    messages = _messages(body.get("messages"))
    n = integer_field(body, "n", 1, MAX_N) or 1
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise invalid("'logprobs' must be a boolean", "logprobs")
    top = integer_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logprob_k = (top or 0) if logprobs else None
    if body.get("logit_bias") not in (None, {}):
        raise invalid("logit_bias is not supported", "logit_bias", "logit_bias_not_supported")
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise invalid("legacy functions are not supported; use tools", name,
                       "tools_not_supported")
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise invalid("only response_format {type: text} is supported", "response_format",
                   "response_format_not_supported")
    presence = number_field(body, "presence_penalty", -2.0, 2.0) or 0.0
    frequency = number_field(body, "frequency_penalty", -2.0, 2.0) or 0.0
    repetition = number_field(body, "repetition_penalty", 0.01, 10.0)
    max_tokens = integer_field(body, "max_completion_tokens", 1, 2 ** 31 - 1)
    if max_tokens is None:
        max_tokens = integer_field(body, "max_tokens", 1, 2 ** 31 - 1)
    stop = body.get("stop")
    if stop is None:
        stops = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > 16:
            raise invalid("at most 16 stop strings", "stop")
        stops = tuple(s for s in stop if s)
    else:
        raise invalid("'stop' must be a string or an array of strings", "stop")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid("'stream' must be a boolean", "stream")
    so = object_field(body.get("stream_options"), "stream_options", ("include_usage",))
    if so is not None and body.get("stream") is not True:
        raise invalid("'stream_options' is only allowed with 'stream': true", "stream_options")
    include_usage = False
    if so is not None:
        iu = so.get("include_usage", False)
        if not isinstance(iu, bool):
            raise invalid("'stream_options.include_usage' must be a boolean",
                       "stream_options.include_usage")
        include_usage = iu
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in EFFORTS:
        raise invalid(f"'reasoning_effort' must be one of {', '.join(EFFORTS)}",
                   "reasoning_effort")
    thinking = body.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise invalid("'enable_thinking' must be a boolean", "enable_thinking")
    if thinking is False and effort not in (None, "none"):
        raise invalid("'enable_thinking': false contradicts 'reasoning_effort'",
                   "reasoning_effort", "conflicting_template_option")
    preserve = preserve_thinking(body)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise invalid("'tools' must be an array", "tools")
    for i, t in enumerate(tools or ()):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid("each tool must be {\"type\": \"function\", \"function\": {\"name\": "
                       "...}}", f"tools[{i}]")
        check_keys(t, f"tools[{i}]", TOOL_FIELDS)
        check_keys(fn, f"tools[{i}].function", TOOL_FUNCTION_FIELDS)
        if not TOOL_NAME.fullmatch(fn["name"]):
            raise invalid("a tool's name is 1-64 characters of A-Z a-z 0-9 _ -",
                       f"tools[{i}].function.name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise invalid("a tool's parameters must be a JSON schema object",
                       f"tools[{i}].function.parameters")
        if fn.get("strict") is True:
            raise invalid("strict tools are not supported (no constrained decoding)",
                       f"tools[{i}].function.strict", "strict_tools_not_supported")
    # only the honoured keys reach the template (an ignored one would be rendered)
    tools = None if tools is None else [
        {"type": "function", "function": {k: v for k, v in t["function"].items()
                                          if k in TOOL_FUNCTION_FIELDS}} for t in tools]
    echo_only_fields(body)
    tc = body.get("tool_choice")
    if tc is not None and tc not in ("auto", "none"):
        raise invalid("only tool_choice \"auto\" or \"none\" is supported (no constrained "
                   "decoding)", "tool_choice", "tool_choice_not_supported")
    if tc == "none":
        tools = None  # neither offered to the model nor parsed
    pck = body.get("prompt_cache_key")  # a routing hint: reuse is found by tokens alone
    if pck is not None and not isinstance(pck, str):
        raise invalid("'prompt_cache_key' must be a string", "prompt_cache_key")
    ptc = body.get("parallel_tool_calls")
    if ptc is not None and not isinstance(ptc, bool):
        raise invalid("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    return ChatRequest(
        model=model, messages=messages, max_tokens=max_tokens,
        temperature=number_field(body, "temperature", 0.0, 2.0),
        top_p=positive_top_p(body),
        top_k=integer_field(body, "top_k", 0, 2 ** 31 - 1),
        min_p=number_field(body, "min_p", 0.0, 1.0),
        seed=integer_field(body, "seed", 0, 2 ** 64 - 1),
        stop=stops, stream=stream, include_usage=include_usage, tools=tools or None, n=n,
        logprobs=logprob_k, presence_penalty=presence, frequency_penalty=frequency,
        repetition_penalty=1.0 if repetition is None else repetition,
        reasoning_effort=effort, enable_thinking=thinking, preserve_thinking=preserve,
        prompt_cache_key=pck, parallel_tool_calls=ptc is not False,
        ignore_eos=bool(boolean_field(body, "ignore_eos")),
        loose_arguments=_loose_arguments(body["messages"]))

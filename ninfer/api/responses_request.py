"""Validation of ``POST /v1/responses`` bodies into a ``ResponsesRequest`` (serving contract
§1.6): the chat form of the Items (``responses_input``), with what the response echoes and
stores.

``model`` (required, the served id), ``input`` (a string or Items; at most 4 prompt-cache
breakpoints: ``too_many_prompt_cache_breakpoints``; ``prompt_cache_options.mode`` ``explicit``
drops the implicit system / tools boundary: ``api.breakpoints``), ``instructions`` (this request
only, never carried forward), ``previous_response_id`` (the stored chain's Items come first;
tools must be resent), ``max_output_tokens`` (>= 16), ``stream``, ``store`` (default true),
``temperature``, ``top_p``, ``metadata`` (<= 16 string pairs), ``reasoning.effort``, ``tools``
(flat function definitions), ``tool_choice`` ``auto`` | ``none``, ``prompt_cache_key`` (a
lane-routing hint, echoed; reuse itself is found by the tokens), ``parallel_tool_calls`` (false:
at most one function call, a further one the model writes is dropped), and the accepted no-ops
``truncation`` disabled, ``text.format`` text, ``service_tier``, ``background`` false,
``include``, ``top_logprobs`` 0, ``user`` / ``safety_identifier``. Anything else is 400
``unknown_parameter``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .breakpoints import MAX_EXPLICIT
from .chat_request import CacheMark, ChatRequest
from .validation import (check_fields, check_keys, integer_field, invalid, number_field,
                         preserve_thinking, required_model, tool_entries)
from .errors import ApiError
from .response_store import ResponseStore
from .responses_input import items_chat_form, resolve_items

FIELDS = {"model", "input", "instructions", "previous_response_id", "prompt_cache_key",
          "preserve_thinking", "chat_template_kwargs",
          "prompt_cache_options", "max_output_tokens", "stream", "store", "temperature",
          "top_p", "metadata", "reasoning", "text", "tools", "tool_choice",
          "parallel_tool_calls", "truncation", "top_logprobs", "service_tier", "background",
          "include", "stream_options", "user", "safety_identifier", "conversation", "prompt"}
EFFORTS = {"none": "none", "minimal": "low", "low": "low", "medium": "medium",
           "high": "high"}


@dataclass(slots=True)
class ResponsesRequest(ChatRequest):
    """A validated Responses request: the chat form plus what the response echoes and stores."""
    items: list = field(default_factory=list)        # the chain's input Items, this one last
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict = field(default_factory=dict)
    effort_label: str | None = None
    flat_tools: list = field(default_factory=list)
    tool_choice: str = "auto"
    inherited_preserve: bool | None = None   # the parent's resolved preserve_thinking


def _chat_tools(raw) -> list | None:
    """Flat function definitions (validated) in their chat-template form."""
    tools = tool_entries(raw)
    if tools is None:
        return None
    chat = []
    for path, t in tools:
        if not isinstance(t, dict) or t.get("type") != "function":
            raise invalid("only function tools are supported ({\"type\": \"function\", "
                       "\"name\", \"parameters\"})", f"{path}.type", "tool_type_not_supported")
        check_keys(t, path, ("type", "name", "description", "parameters", "strict"))
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise invalid("a function tool needs a 'name'", f"{path}.name")
        if t.get("parameters") is not None and not isinstance(t["parameters"], dict):
            raise invalid("'parameters' must be an object (a JSON schema)", f"{path}.parameters")
        fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object"}}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        chat.append({"type": "function", "function": fn})
    return chat or None


def parse_responses_request(body, store: ResponseStore) -> ResponsesRequest:
    """Validate a Responses body and resolve its chain into chat messages.

    Raises:
        ApiError: 400 with a stable code naming the parameter; 404 ``previous_response_not_found``
            / ``item_not_found``.
    """
    check_fields(body, FIELDS)
    model = required_model(body)
    if "input" not in body:
        raise invalid("'input' is required", "input")
    def same(v, *allowed) -> bool:  # equal and of the same type (True != 1 here)
        return any(v == a and type(v) is type(a) for a in allowed)

    for name, ok in (("parallel_tool_calls", same(body.get("parallel_tool_calls"), None, True,
                                                  False)),
                     ("truncation", body.get("truncation") in (None, "disabled")),
                     ("background", same(body.get("background"), None, False)),
                     # hosted state this server does not hold: the answer would lack it
                     ("conversation", body.get("conversation") is None),
                     ("prompt", body.get("prompt") is None),
                     ("top_logprobs", same(body.get("top_logprobs"), None, 0)),
                     ("service_tier", body.get("service_tier") in (None, "auto", "default")),
                     ("text", body.get("text") in (None, {}, {"format": {"type": "text"}})),
                     ("include", body.get("include") in (None, [],
                                                         ["reasoning.encrypted_content"])),
                     ("stream_options", body.get("stream_options") in (
                         None, {}, {"include_obfuscation": False})),
                     ("prompt_cache_options", body.get("prompt_cache_options") in (
                         None, {"mode": "implicit"}, {"mode": "explicit"}))):
        if not ok:
            raise invalid(f"this value of '{name}' is not supported", name,
                       "parameter_not_supported")
    for name in ("instructions", "previous_response_id", "prompt_cache_key", "user",
                 "safety_identifier"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise invalid(f"'{name}' must be a string", name)
    for name in ("stream", "store"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise invalid(f"'{name}' must be a boolean", name)
    metadata = body.get("metadata")
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or len(metadata) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise invalid("'metadata' must be an object of at most 16 string pairs", "metadata")
    max_tokens = integer_field(body, "max_output_tokens", 16, 2 ** 31 - 1)
    reasoning = body.get("reasoning")
    effort = None
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise invalid("'reasoning' must be an object", "reasoning")
        check_keys(reasoning, "reasoning", ("effort", "summary", "generate_summary"))
        effort = reasoning.get("effort")
        if effort is not None and (not isinstance(effort, str) or effort not in EFFORTS):
            raise invalid(f"'reasoning.effort' must be one of {', '.join(EFFORTS)}",
                       "reasoning.effort")
    tools = _chat_tools(body.get("tools"))
    tc = body.get("tool_choice")
    if tc not in (None, "auto", "none"):
        raise invalid("only tool_choice \"auto\" or \"none\" is supported (no constrained "
                   "decoding)", "tool_choice", "tool_choice_not_supported")
    items = resolve_items(body["input"], store)
    preserve, inherited, first_new = preserve_thinking(body), None, 0
    prev = body.get("previous_response_id")
    if prev is not None:
        rec = store.get(prev)
        if rec is None:
            raise ApiError(404, f"no stored response with id {prev!r} (responses created "
                           "with store: false, evicted ones, and those of another server "
                           "process cannot be continued)", "previous_response_not_found",
                           "previous_response_id")
        first_new = len(rec.history)
        chain_ids = {it.get("id") for it in rec.history}
        for j, item in enumerate(items):
            if isinstance(item.get("id"), str) and item["id"] in chain_ids:
                raise invalid(f"Item id {item['id']!r} is already in the chain of "
                           f"previous_response_id", f"input[{j}].id")
        items = rec.history + items
        inherited = rec.preserve_thinking
    form = items_chat_form(items, first_new)
    messages, marks = form.messages, form.marks
    if len(marks) > MAX_EXPLICIT:
        raise invalid(f"{len(marks)} prompt_cache_breakpoint parts: at most {MAX_EXPLICIT} per "
                   "request", "input", "too_many_prompt_cache_breakpoints")
    instructions = body.get("instructions")
    if instructions:
        messages = [{"role": "system", "content": instructions}] + messages
        marks = [CacheMark(m.message + 1, m.offset) for m in marks]
    top_p = number_field(body, "top_p", 0.0, 1.0)
    return ResponsesRequest(
        model=model, messages=messages, max_tokens=max_tokens,
        temperature=number_field(body, "temperature", 0.0, 2.0), top_p=top_p, top_k=None,
        min_p=None, seed=None, stop=(), stream=bool(body.get("stream")), include_usage=False,
        tools=tools if tc != "none" else None,
        reasoning_effort=EFFORTS.get(effort) if effort else None,
        items=items, instructions=instructions, previous_response_id=prev,
        store=body.get("store") is not False, metadata=dict(metadata), effort_label=effort,
        flat_tools=list(body.get("tools") or []), tool_choice=tc or "auto",
        preserve_thinking=preserve,
        prompt_cache_key=body.get("prompt_cache_key"),
        inherited_preserve=inherited, cache_breakpoints=tuple(marks),
        implicit_breakpoints=body.get("prompt_cache_options") != {"mode": "explicit"},
        parallel_tool_calls=body.get("parallel_tool_calls") is not False)

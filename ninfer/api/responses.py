"""``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``: the core of OpenAI's Responses
API over the chat completions path (same admission, template, engine and events; serving
contract §1.6).

Request: ``model`` (required, the served id), ``input`` (a string, or Items: ``message`` with
roles user / assistant / system / developer and ``input_text`` / ``output_text`` parts,
``function_call``, ``function_call_output``, ``reasoning`` with ``summary_text``,
``item_reference`` to a stored output Item; a text part may carry ``prompt_cache_breakpoint:
{"mode": "explicit"}``, at most 4 per request: ``too_many_prompt_cache_breakpoints``;
``prompt_cache_options.mode`` ``explicit`` drops the implicit system / tools boundary:
``api.breakpoints``), ``instructions`` (this request only, never
carried forward), ``previous_response_id`` (the stored chain's Items come first; tools must be
resent), ``max_output_tokens`` (>= 16), ``stream``, ``store`` (default true), ``temperature``,
``top_p``, ``metadata`` (<= 16 string pairs), ``reasoning.effort``, ``tools`` (flat function
definitions), ``tool_choice`` ``auto`` | ``none``, ``prompt_cache_key`` (a lane-routing
hint, echoed; reuse itself is found by the tokens), ``parallel_tool_calls`` (false: at
most one function call, a further one the model writes is dropped), and the accepted no-ops
``truncation`` disabled, ``text.format`` text, ``service_tier``, ``background`` false,
``include``, ``top_logprobs`` 0, ``user`` / ``safety_identifier``. Anything else is 400
``unknown_parameter``; images are ``modality_not_supported``.

Response: ``object: "response"``, ``status`` ``completed`` | ``incomplete`` (output or context
limit, or an answer cut inside a tool call: ``incomplete_details.reason`` ``max_output_tokens``)
| ``failed``; ``output`` Items: a ``reasoning`` Item (``summary_text``) when the model thought,
an assistant ``message`` (``output_text``) unless the answer was only tool calls, then one
``function_call`` Item per call (``fc_…`` id, ``call_…`` call_id). ``usage``: ``input_tokens``,
``input_tokens_details.cached_tokens`` (reused prefix), ``input_tokens_details.cache_write_tokens``
(tokens past it up to the deepest breakpoint this request published), ``output_tokens``,
``output_tokens_details.reasoning_tokens``, ``total_tokens``.

Stream (``stream: true``): ``event: TYPE`` frames whose JSON carries the same ``type`` and an
increasing ``sequence_number``: ``response.created``, ``response.in_progress``, per Item
``response.output_item.added`` → (reasoning: ``response.reasoning_summary_part.added``,
``response.reasoning_summary_text.delta`` …, ``.done``, ``response.reasoning_summary_part.done``;
message: ``response.content_part.added``, ``response.output_text.delta`` …,
``response.output_text.done``, ``response.content_part.done``; call:
``response.function_call_arguments.delta`` …, ``response.function_call_arguments.done``) →
``response.output_item.done``, then exactly one ``response.completed`` | ``response.incomplete``
| ``response.failed``. No ``[DONE]``. Keep-alives are SSE comments.

Store: a process-local LRU of ``--response-store-max-records`` responses with their Item
history. Storing is the commit point: the terminal event is sent after the record is stored.
``store: false`` responses can be neither fetched nor continued.
"""
from __future__ import annotations

import collections
import json
import secrets
from dataclasses import dataclass, field

from quart import g, request

from ..engine.requests import ErrorOutput, FinalOutput
from .breakpoints import MAX_EXPLICIT
from .chat import Choice, ChatHandler, _engine_error, is_reasoning, next_output
from .chat_request import (PART_SEP, ChatRequest, _bad, _integer, _keys, _number, check_fields,
                           preserve_thinking, required_model)
from .errors import ApiError, error_record
from .tool_calls import strict_json

FIELDS = {"model", "input", "instructions", "previous_response_id", "prompt_cache_key",
          "preserve_thinking", "chat_template_kwargs",
          "prompt_cache_options", "max_output_tokens", "stream", "store", "temperature",
          "top_p", "metadata", "reasoning", "text", "tools", "tool_choice",
          "parallel_tool_calls", "truncation", "top_logprobs", "service_tier", "background",
          "include", "stream_options", "user", "safety_identifier", "conversation", "prompt"}
ROLES = ("user", "assistant", "system", "developer")
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


class ResponseStore:
    """Process-local LRU of stored responses: ``id -> (response object, Item history)``.

    Args:
        max_records: responses kept; the least recently used one goes first (>= 1).
        max_bytes: their JSON size kept at most (None: no byte budget); least recently used
            first out.
    """

    def __init__(self, max_records: int = 1024, max_bytes: int | None = None):
        if max_records < 1:
            raise ValueError(f"max_records must be >= 1, got {max_records}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._records: collections.OrderedDict = collections.OrderedDict()
        self._sizes: dict = {}   # id -> bytes
        self._items: dict = {}   # output Item id -> Item (for item_reference)

    @staticmethod
    def size_of(response: dict, history: list) -> int:
        """What a record counts against ``max_bytes``: its response and history as JSON."""
        return len(json.dumps([response, history], ensure_ascii=False,
                              separators=(",", ":")).encode())

    def put(self, response: dict, history: list, preserve_thinking: bool | None = None) -> None:
        """Store a record (least recently used ones go to make room) with the request's
        resolved ``preserve_thinking``, which a continuation inherits.

        Raises:
            ApiError: 400 ``response_store_capacity_exceeded``, nothing stored: the record
                alone is larger than ``max_bytes``.
        """
        size = self.size_of(response, history)
        if self.max_bytes is not None and size > self.max_bytes:
            raise ApiError(400, f"the response ({size} bytes with its input history) is "
                           f"larger than the whole response store ({self.max_bytes} bytes, "
                           "--response-store-max-mib); send it with store: false",
                           "response_store_capacity_exceeded", "store")
        self.delete(response["id"])
        self._records[response["id"]] = (response, history, preserve_thinking)
        self._sizes[response["id"]] = size
        self.nbytes += size
        for item in response["output"]:
            self._items[item["id"]] = item
        while len(self._records) > self.max_records or (
                self.max_bytes is not None and self.nbytes > self.max_bytes):
            self.delete(next(iter(self._records)))

    def get(self, rid: str):
        """``(response, history, preserve_thinking)`` or None."""
        rec = self._records.get(rid)
        if rec is not None:
            self._records.move_to_end(rid)
        return rec

    def item(self, item_id: str) -> dict | None:
        return self._items.get(item_id)

    def delete(self, rid: str) -> bool:
        rec = self._records.pop(rid, None)
        if rec is None:
            return False
        self.nbytes -= self._sizes.pop(rid)
        for item in rec[0]["output"]:
            self._items.pop(item["id"], None)
        return True


def _breakpoint(v, path: str) -> bool:
    """Whether a part's ``prompt_cache_breakpoint`` marks it (``{"mode": "explicit"}``).

    Raises:
        ApiError: another value (``invalid_value``) or member (``parameter_not_supported``).
    """
    if v is None:
        return False
    if not isinstance(v, dict) or v.get("mode") != "explicit":
        raise _bad("'prompt_cache_breakpoint' must be {\"mode\": \"explicit\"}", path)
    extra = sorted(set(v) - {"mode"})
    if extra:
        raise _bad(f"'prompt_cache_breakpoint.{extra[0]}' is not supported",
                   f"{path}.{extra[0]}", "parameter_not_supported")
    return True


def _text_of(content, path: str) -> tuple[str, list]:
    """A message's text: a string, or its ``input_text`` / ``output_text`` parts joined; and
    the prompt-cache breakpoints its parts mark (``_breakpoint``): the char offset after each
    marked part's text, None for a marked last part (the message's end)."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise _bad("'content' must be a string or an array of parts", path)
    out, marks = [], []
    for j, part in enumerate(content):
        pp = f"{path}[{j}]"
        if not isinstance(part, dict):
            raise _bad("each content part must be an object", pp)
        kind = part.get("type")
        if kind in ("input_image", "input_file", "input_audio", "input_video"):
            raise _bad(f"'{kind}' parts are not supported by this text-only model", pp,
                       "modality_not_supported")
        if kind not in ("input_text", "output_text"):
            raise _bad(f"content part type '{kind}' is not supported (input_text, "
                       "output_text)", f"{pp}.type")
        # (parsed: the OpenAI SDK's parsed output text, in an output Item dumped back whole)
        _keys(part, pp, ("type", "text", "annotations", "logprobs", "parsed",
                         "prompt_cache_breakpoint"))
        if not isinstance(part.get("text"), str):
            raise _bad("a text part needs 'text' (a string)", f"{pp}.text")
        out.append(part["text"])
        if _breakpoint(part.get("prompt_cache_breakpoint"), f"{pp}.prompt_cache_breakpoint"):
            marks.append(None if j == len(content) - 1 else len(PART_SEP.join(out)))
    return PART_SEP.join(out), marks


def _resolve_items(raw, store: ResponseStore) -> list:
    """The request's ``input`` as a list of Items (``item_reference`` replaced)."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise _bad("'input' must be a string or a non-empty array of Items", "input")
    items, seen = [], set()
    for i, item in enumerate(raw):
        path = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad("each input Item must be an object", path)
        if item.get("type") == "item_reference":
            _keys(item, path, ("type", "id"))
            ref = store.item(item.get("id")) if isinstance(item.get("id"), str) else None
            if ref is None:
                raise ApiError(404, f"no stored Item with id {item.get('id')!r}",
                               "item_not_found", f"{path}.id")
            item = ref
        if item.get("id") is not None and not isinstance(item["id"], str):
            raise _bad("an Item 'id' must be a string", f"{path}.id")
        if isinstance(item.get("id"), str):
            if item["id"] in seen:
                raise _bad(f"Item id {item['id']!r} appears twice", f"{path}.id")
            seen.add(item["id"])
        items.append(item)
    return items


def _messages(items: list, marks_from: int = 0) -> tuple[list[dict], list[tuple]]:
    """Items in the chat form the template renders: adjacent function calls grouped into one
    assistant turn, a reasoning Item attached to the assistant turn after it; and the
    prompt-cache breakpoints the parts of Items ``marks_from`` onwards mark (``(message index,
    char offset or None)``, ``ChatRequest.cache_breakpoints``; an earlier response's Items
    replayed by ``previous_response_id`` publish nothing again)."""
    out: list[dict] = []
    marks: list[tuple] = []
    reasoning: str | None = None
    calls: set = set()   # call_ids of the function calls so far

    def assistant() -> dict:
        nonlocal reasoning
        msg = {"role": "assistant", "content": ""}
        if reasoning:
            msg["reasoning_content"] = reasoning
        reasoning = None
        out.append(msg)
        return msg

    for i, item in enumerate(items):
        path = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            _keys(item, path, ("type", "role", "content", "id", "status", "phase"))
            if item.get("phase") is not None:
                raise _bad("message 'phase' is not supported", f"{path}.phase",
                           "parameter_not_supported")
            role = item.get("role")
            if role not in ROLES:
                raise _bad(f"'role' must be one of {', '.join(ROLES)}", f"{path}.role")
            text, offsets = _text_of(item.get("content"), f"{path}.content")
            if role == "assistant":
                msg = assistant()
                msg["content"] = text
            else:
                out.append({"role": "system" if role == "developer" else role,
                            "content": text})
            if i >= marks_from:
                marks += [(len(out) - 1, off) for off in offsets]
        elif kind == "function_call":
            _keys(item, path, ("type", "call_id", "name", "arguments", "id", "status"))
            for k in ("call_id", "name", "arguments"):
                if not isinstance(item.get(k), str):
                    raise _bad(f"a function_call Item needs '{k}' (a string)", f"{path}.{k}")
            try:
                args = strict_json(item["arguments"])
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise _bad("function_call 'arguments' must be a JSON object string",
                           f"{path}.arguments")
            prev = out[-1] if out else None
            msg = prev if prev is not None and prev["role"] == "assistant" and \
                reasoning is None else assistant()
            calls.add(item["call_id"])
            if marks and marks[-1] == (len(out) - 1, None) and msg is out[-1] and \
                    not msg.get("tool_calls"):
                # a mark at the end of the text this call follows: the end of that text
                marks[-1] = (len(out) - 1, len(msg["content"]))
            msg.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            _keys(item, path, ("type", "call_id", "output", "id", "status"))
            if not isinstance(item.get("call_id"), str):
                raise _bad("a function_call_output Item needs 'call_id' (a string)",
                           f"{path}.call_id")
            if item["call_id"] not in calls:
                raise _bad(f"no function_call with call_id {item['call_id']!r} before this "
                           "output", f"{path}.call_id")
            text, offsets = _text_of(item.get("output"), f"{path}.output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
            if i >= marks_from:
                marks += [(len(out) - 1, off) for off in offsets]
        elif kind == "reasoning":
            _keys(item, path, ("type", "id", "summary", "content", "encrypted_content",
                               "status"))
            if item.get("encrypted_content") is not None:
                raise _bad("encrypted reasoning cannot be replayed here",
                           f"{path}.encrypted_content", "encrypted_reasoning_not_supported")
            key = "summary" if item.get("summary") is not None else "content"
            parts = item.get(key) or []
            if not isinstance(parts, list):
                raise _bad(f"'{key}' must be an array", f"{path}.{key}")
            texts = []
            for j, part in enumerate(parts):
                pp = f"{path}.{key}[{j}]"
                if not isinstance(part, dict) or part.get("type") not in (
                        "summary_text", "reasoning_text") or not isinstance(part.get("text"),
                                                                            str):
                    raise _bad("each part must be {\"type\": \"summary_text\", \"text\": "
                               "string}", pp)
                texts.append(part["text"])
            reasoning = "".join(texts)
        else:
            raise _bad(f"Item type {kind!r} is not supported (message, function_call, "
                       "function_call_output, reasoning, item_reference)", f"{path}.type")
    if out and out[-1]["role"] == "assistant" and not out[-1].get("tool_calls"):
        raise _bad("a last assistant message (a prefill to continue) is not supported",
                   "input", "prefill_not_supported")
    return out, marks


def _flat_tools(raw) -> tuple[list, list | None]:
    """(the tools as given, their chat-template form) for flat function definitions."""
    if raw is None:
        return [], None
    if not isinstance(raw, list):
        raise _bad("'tools' must be an array", "tools")
    chat = []
    for i, t in enumerate(raw):
        path = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise _bad("only function tools are supported ({\"type\": \"function\", "
                       "\"name\", \"parameters\"})", f"{path}.type", "tool_type_not_supported")
        _keys(t, path, ("type", "name", "description", "parameters", "strict"))
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise _bad("a function tool needs a 'name'", f"{path}.name")
        if t.get("parameters") is not None and not isinstance(t["parameters"], dict):
            raise _bad("'parameters' must be an object (a JSON schema)", f"{path}.parameters")
        fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object"}}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        chat.append({"type": "function", "function": fn})
    return raw, chat or None


def parse_responses_request(body, store: ResponseStore) -> ResponsesRequest:
    """Validate a Responses body and resolve its chain into chat messages.

    Raises:
        ApiError: 400 with a stable code naming the parameter; 404 ``previous_response_not_found``
            / ``item_not_found``.
    """
    check_fields(body, FIELDS)
    model = required_model(body)
    if "input" not in body:
        raise _bad("'input' is required", "input")
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
            raise _bad(f"this value of '{name}' is not supported", name,
                       "parameter_not_supported")
    for name in ("instructions", "previous_response_id", "prompt_cache_key", "user",
                 "safety_identifier"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise _bad(f"'{name}' must be a string", name)
    for name in ("stream", "store"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise _bad(f"'{name}' must be a boolean", name)
    metadata = body.get("metadata")
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or len(metadata) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise _bad("'metadata' must be an object of at most 16 string pairs", "metadata")
    max_tokens = _integer(body, "max_output_tokens", 16, 2 ** 31 - 1)
    reasoning = body.get("reasoning")
    effort = None
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise _bad("'reasoning' must be an object", "reasoning")
        _keys(reasoning, "reasoning", ("effort", "summary", "generate_summary"))
        effort = reasoning.get("effort")
        if effort is not None and (not isinstance(effort, str) or effort not in EFFORTS):
            raise _bad(f"'reasoning.effort' must be one of {', '.join(EFFORTS)}",
                       "reasoning.effort")
    flat, tools = _flat_tools(body.get("tools"))
    tc = body.get("tool_choice")
    if tc not in (None, "auto", "none"):
        raise _bad("only tool_choice \"auto\" or \"none\" is supported (no constrained "
                   "decoding)", "tool_choice", "tool_choice_not_supported")
    items = _resolve_items(body["input"], store)
    preserve, inherited, first_new = preserve_thinking(body), None, 0
    prev = body.get("previous_response_id")
    if prev is not None:
        rec = store.get(prev)
        if rec is None:
            raise ApiError(404, f"no stored response with id {prev!r} (responses created "
                           "with store: false, evicted ones, and those of another server "
                           "process cannot be continued)", "previous_response_not_found",
                           "previous_response_id")
        first_new = len(rec[1])
        chain_ids = {it.get("id") for it in rec[1]}
        for j, item in enumerate(items):
            if isinstance(item.get("id"), str) and item["id"] in chain_ids:
                raise _bad(f"Item id {item['id']!r} is already in the chain of "
                           f"previous_response_id", f"input[{j}].id")
        items = rec[1] + items
        inherited = rec[2]
    messages, marks = _messages(items, first_new)
    if len(marks) > MAX_EXPLICIT:
        raise _bad(f"{len(marks)} prompt_cache_breakpoint parts: at most {MAX_EXPLICIT} per "
                   "request", "input", "too_many_prompt_cache_breakpoints")
    instructions = body.get("instructions")
    if instructions:
        messages = [{"role": "system", "content": instructions}] + messages
        marks = [(i + 1, off) for i, off in marks]
    top_p = _number(body, "top_p", 0.0, 1.0)
    return ResponsesRequest(
        model=model, messages=messages, max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 2.0), top_p=top_p, top_k=None,
        min_p=None, seed=None, stop=(), stream=bool(body.get("stream")), include_usage=False,
        tools=tools if tc != "none" else None,
        reasoning_effort=EFFORTS.get(effort) if effort else None,
        items=items, instructions=instructions, previous_response_id=prev,
        store=body.get("store") is not False, metadata=dict(metadata), effort_label=effort,
        flat_tools=list(flat), tool_choice=tc or "auto", preserve_thinking=preserve,
        prompt_cache_key=body.get("prompt_cache_key"),
        inherited_preserve=inherited, cache_breakpoints=tuple(marks),
        implicit_breakpoints=body.get("prompt_cache_options") != {"mode": "explicit"},
        parallel_tool_calls=body.get("parallel_tool_calls") is not False)


def _new(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class ResponsesHandler(ChatHandler):
    """Serves ``/v1/responses`` for one ServerState (module docstring)."""

    protocol = "openai_responses"
    id_prefix = "resp_"
    prompt_param = "input"
    thinking_params = {"reasoning_effort": "reasoning.effort",
                       "enable_thinking": "reasoning.effort"}

    def __init__(self, state, admission: ChatHandler | None = None, max_records: int = 1024,
                 max_bytes: int | None = None):
        super().__init__(state, admission)
        self.store = ResponseStore(max_records, max_bytes)

    def _parse(self, body) -> ChatRequest:
        return parse_responses_request(body, self.store)

    def _thinking(self, creq: ChatRequest):
        if creq.preserve_thinking is None:   # a continuation keeps its chain's setting
            creq.preserve_thinking = creq.inherited_preserve
        return super()._thinking(creq)

    # -- the response object ------------------------------------------------------------------
    def _shell(self, creq: ResponsesRequest, base: dict, status: str) -> dict:
        return {"id": base["id"], "object": "response", "created_at": base["created"],
                "status": status, "error": None, "incomplete_details": None,
                "instructions": creq.instructions, "max_output_tokens": creq.max_tokens,
                "model": self.state.model_id, "output": [],
                "parallel_tool_calls": creq.parallel_tool_calls,
                "previous_response_id": creq.previous_response_id,
                "reasoning": {"effort": creq.effort_label, "summary": None},
                "store": creq.store, "temperature": creq.temperature, "top_p": creq.top_p,
                "text": {"format": {"type": "text"}}, "tool_choice": creq.tool_choice,
                "tools": creq.flat_tools, "truncation": "disabled", "usage": None,
                "metadata": creq.metadata, "prompt_cache_key": creq.prompt_cache_key}

    @staticmethod
    def _status(c: Choice) -> str:
        incomplete = (c.final.finish_reason == "length" and not c.calls_done) or (
            c.tools is not None and c.tools.incomplete)
        return "incomplete" if incomplete else "completed"

    @staticmethod
    def _usage(c: Choice) -> dict:
        f = c.final
        return {"input_tokens": f.prompt_tokens,
                "input_tokens_details": {"cached_tokens": f.cached_tokens,
                                         "cache_write_tokens": min(
                                             f.cache_write_tokens,
                                             f.prompt_tokens - f.cached_tokens)},
                "output_tokens": f.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": c.reasoning_tokens},
                "total_tokens": f.prompt_tokens + f.completion_tokens}

    def _finish(self, creq: ResponsesRequest, base: dict, c: Choice, output: list) -> dict:
        """The final response object; stored (the commit point) when ``store``."""
        status = self._status(c)
        resp = {**self._shell(creq, base, status), "output": output, "usage": self._usage(c)}
        if status == "incomplete":
            resp["incomplete_details"] = {"reason": "max_output_tokens"}
        if creq.store:
            # input Items without an id get one, so that input_items can page through them
            suffix = base["id"].split("_", 1)[-1]
            history = [item if isinstance(item.get("id"), str) else
                       {**item, "id": f"{_ID_PREFIX.get(item.get('type'), 'msg')}_{suffix}_{i}"}
                       for i, item in enumerate(creq.items)]
            history += [item for item in output if _replayable(item)]
            self.store.put(resp, history, self.state.config.preserve_thinking
                           if creq.preserve_thinking is None else creq.preserve_thinking)
        return resp

    # -- replies ------------------------------------------------------------------------------
    async def _collect(self, creq, body, choices, recv, base):
        await self._receive_all(choices, recv)
        c = choices[0]
        output = []
        if "".join(c.reasoning):
            output.append(_reasoning_item(_new("rs_"), "".join(c.reasoning)))
        calls = c.tools.calls if c.tools is not None else []
        if "".join(c.parts) or not calls:
            output.append(_message_item(_new("msg_"), "".join(c.parts),
                                        "completed" if calls else self._status(c)))
        output += [_call_item(_new("fc_"), k) for k in calls]
        return self._finish(creq, base, c, output)

    async def _stream(self, creq, body, choices, recv, base, release):
        c = choices[0]
        # (this runs at the first __anext__, inside the request: its line and x-request-id for
        # the log)
        where = (g.get("request_id", ""), request.method, request.path)
        ping_s = self.state.config.sse_ping_interval_s
        seq = 0
        output: list[dict] = []
        current: dict | None = None      # the Item being streamed
        texts: dict = {}                 # item id -> text so far

        def ev(kind: str, **data) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: " + json.dumps(
                {"type": kind, "sequence_number": seq - 1, **data}, ensure_ascii=False,
                separators=(",", ":")) + "\n\n"

        def close_current() -> str:
            nonlocal current
            if current is None:
                return ""
            item, idx, out = current, len(output) - 1, ""
            text = texts.get(item["id"], "")
            if item["type"] == "reasoning":
                part = {"type": "summary_text", "text": text}
                out += ev("response.reasoning_summary_text.done", item_id=item["id"],
                          output_index=idx, summary_index=0, text=text)
                out += ev("response.reasoning_summary_part.done", item_id=item["id"],
                          output_index=idx, summary_index=0, part=part)
                output[idx] = _reasoning_item(item["id"], text)
            elif item["type"] == "message":
                part = {"type": "output_text", "text": text, "annotations": []}
                out += ev("response.output_text.done", item_id=item["id"], output_index=idx,
                          content_index=0, text=text, logprobs=[])
                out += ev("response.content_part.done", item_id=item["id"], output_index=idx,
                          content_index=0, part=part)
                # the answer's last Item shares the response's fate (cut by the token limit)
                done = c.final is not None and not (c.tools is not None and c.tools.calls)
                output[idx] = _message_item(item["id"], text, self._status(c) if done
                                            else "completed")
            else:
                call = item["_call"]
                out += ev("response.function_call_arguments.done", item_id=item["id"],
                          output_index=idx, arguments=call.arguments)
                output[idx] = _call_item(item["id"], call)
            out += ev("response.output_item.done", output_index=idx, item=output[idx])
            current = None
            return out

        def open_item(kind: str, call=None) -> str:
            nonlocal current
            out = close_current()
            iid = _new({"reasoning": "rs_", "message": "msg_", "function_call": "fc_"}[kind])
            if kind == "reasoning":
                item = {"id": iid, "type": "reasoning", "summary": []}
            elif kind == "message":
                item = {"id": iid, "type": "message", "status": "in_progress",
                        "role": "assistant", "content": []}
            else:
                item = {"id": iid, "type": "function_call", "status": "in_progress",
                        "call_id": call.id, "name": call.name, "arguments": ""}
            output.append(item)
            idx = len(output) - 1
            out += ev("response.output_item.added", output_index=idx, item=item)
            if kind == "reasoning":
                out += ev("response.reasoning_summary_part.added", item_id=iid,
                          output_index=idx, summary_index=0,
                          part={"type": "summary_text", "text": ""})
            elif kind == "message":
                out += ev("response.content_part.added", item_id=iid, output_index=idx,
                          content_index=0,
                          part={"type": "output_text", "text": "", "annotations": []})
            current = {**item, "_call": call}
            texts[iid] = ""
            return out

        def text_delta(kind: str, text: str) -> str:
            out = ""
            if current is None or current["type"] != kind:
                out += open_item(kind)
            iid, idx = current["id"], len(output) - 1
            texts[iid] += text
            if kind == "reasoning":
                return out + ev("response.reasoning_summary_text.delta", item_id=iid,
                                output_index=idx, summary_index=0, delta=text)
            return out + ev("response.output_text.delta", item_id=iid, output_index=idx,
                            content_index=0, delta=text, logprobs=[])

        def call_events() -> str:
            out = ""
            for e in c.call_events:
                if e.kind == "start":
                    out += open_item("function_call", e.call)
                elif e.kind == "args":
                    out += ev("response.function_call_arguments.delta", item_id=current["id"],
                              output_index=len(output) - 1, delta=e.text)
                elif e.kind == "end":
                    out += close_current()
            c.call_events = []
            return out

        try:
            yield ev("response.created", response=self._shell(creq, base, "in_progress"))
            yield ev("response.in_progress", response=self._shell(creq, base, "in_progress"))
            async with recv:
                while not c.done:
                    got = await next_output(recv, ping_s)
                    if got is None:
                        yield ": ping\n\n"
                        continue
                    _, item = got
                    kind = "reasoning" if is_reasoning(item) else "message"
                    text = self._absorb(c, item)
                    if isinstance(item, ErrorOutput):
                        err = _engine_error(item)
                        failed = {**self._shell(creq, base, "failed"),
                                  "output": [o for o in output if o.get("status") !=
                                             "in_progress"],
                                  "error": {"code": err.code, "message": err.message}}
                        yield ev("response.failed", response=failed)
                        return
                    out = (text_delta(kind, text) if text else "") + call_events()
                    if isinstance(item, FinalOutput):
                        calls = c.tools.calls if c.tools is not None else []
                        if not calls and not any(o["type"] == "message" for o in output):
                            if current is None or current["type"] != "message":
                                out += open_item("message")  # an answer, maybe empty
                        out += close_current()
                        try:
                            resp = self._finish(creq, base, c, list(output))
                        except ApiError as err:   # not stored: the stream fails instead
                            failed = {**self._shell(creq, base, "failed"), "output": output,
                                      "error": {"code": err.code, "message": err.message}}
                            # (the 200 went out: the log says why it failed all the same)
                            self.state.bus.emit(error_record(err, *where))
                            yield out + ev("response.failed", response=failed)
                            return
                        out += ev(f"response.{resp['status']}", response=resp)
                    if out:
                        yield out
        finally:
            self._cancel_unfinished(choices)
            release()

    # -- stored responses ---------------------------------------------------------------------
    def retrieve(self, rid: str) -> dict:
        rec = self.store.get(rid)
        if rec is None:
            raise ApiError(404, f"no stored response with id {rid!r}", "response_not_found")
        return rec[0]

    def delete(self, rid: str) -> dict:
        if not self.store.delete(rid):
            raise ApiError(404, f"no stored response with id {rid!r}", "response_not_found")
        return {"id": rid, "object": "response", "deleted": True}

    def input_items(self, rid: str, args) -> dict:
        """``GET /v1/responses/{id}/input_items``: the Items the response was generated from
        (its chain's, ``previous_response_id`` ones included), normalized (a message's string
        content as one ``input_text`` / ``output_text`` part), a page at a time.

        Args:
            args: the query: ``limit`` (1-100, default 20), ``order`` (``desc``, newest first,
                the default, or ``asc``), ``after`` (an Item id of the list: the page starts
                after it), ``before`` (an Item id: the page is the ``limit`` Items just before
                it), ``include`` (accepted, nothing to add).
        Raises:
            ApiError: 404 ``response_not_found``; 400 ``invalid_pagination`` for a bad
                ``limit``, ``order``, ``after`` or ``before``; 400 ``unknown_parameter`` for
                another query parameter.
        """
        for k in args:
            if k not in ("limit", "order", "after", "before", "include"):
                raise ApiError(400, f"unknown query parameter {k!r}", "unknown_parameter", k)
        rec = self.store.get(rid)
        if rec is None:
            raise ApiError(404, f"no stored response with id {rid!r}", "response_not_found")
        response, history = rec[0], rec[1]
        n_out = sum(1 for item in response["output"] if _replayable(item))
        items = [_normalized(item) for item in history[:len(history) - n_out]]
        limit, order = args.get("limit", "20"), args.get("order", "desc")
        if not (limit.isascii() and limit.isdigit() and 1 <= int(limit) <= 100):
            raise ApiError(400, "'limit' must be an integer from 1 to 100",
                           "invalid_pagination", "limit")
        if order not in ("asc", "desc"):
            raise ApiError(400, "'order' must be asc or desc", "invalid_pagination", "order")
        if order == "desc":
            items.reverse()
        ids = [item.get("id") for item in items]

        def position(name: str) -> int:
            cursor = args.get(name)
            if cursor not in ids:
                raise ApiError(400, f"'{name}' is not an input Item of {rid}: {cursor!r}",
                               "invalid_pagination", name)
            return ids.index(cursor)

        lo = position("after") + 1 if args.get("after") is not None else 0
        end = position("before") if args.get("before") is not None else len(items)
        # paging backwards (before): the page is the Items just before the cursor, and more
        # remain if the page does not reach back to the start (or to after)
        start = max(lo, end - int(limit)) if args.get("before") is not None else lo
        page = items[start:max(start, min(end, start + int(limit)))]
        more = start > lo if args.get("before") is not None else start + len(page) < end
        return {"object": "list", "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": more}


_ID_PREFIX = {"message": "msg", None: "msg", "function_call": "fc",
              "function_call_output": "fco", "reasoning": "rs"}


def _normalized(item: dict) -> dict:
    """An input Item as input_items lists it: a message typed, its string content one part."""
    if item.get("type", "message") != "message":
        return dict(item)
    content = item.get("content")
    if isinstance(content, str):
        content = [{"type": "output_text" if item.get("role") == "assistant" else "input_text",
                    "text": content}]
    out = {"id": item["id"], "type": "message", "role": item.get("role"), "content": content}
    if item.get("status") is not None:
        out["status"] = item["status"]
    return out


def _reasoning_item(iid: str, text: str) -> dict:
    return {"id": iid, "type": "reasoning",
            "summary": [{"type": "summary_text", "text": text}]}


def _message_item(iid: str, text: str, status: str) -> dict:
    return {"id": iid, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(iid: str, call) -> dict:
    return {"id": iid, "type": "function_call",
            "status": "completed" if call.complete else "incomplete",
            "call_id": call.id, "name": call.name, "arguments": call.arguments}


def _replayable(item: dict) -> bool:
    """Whether an output Item enters a continued chain's history: a call only when it closed
    with JSON-object arguments (serving contract §7.5)."""
    if item["type"] != "function_call":
        return True
    try:
        return item["status"] == "completed" and isinstance(strict_json(item["arguments"]),
                                                            dict)
    except ValueError:
        return False

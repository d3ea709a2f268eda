"""Responses input Items into the chat form the template renders: ``message`` (roles user /
assistant / system / developer, ``input_text`` / ``output_text`` parts), ``function_call``,
``function_call_output``, ``reasoning`` (``summary_text``) and ``item_reference`` to a stored
output Item; a text part's ``prompt_cache_breakpoint: {"mode": "explicit"}`` marks a
prompt-cache breakpoint (``CacheMark``); images are ``modality_not_supported``."""
from __future__ import annotations

from dataclasses import dataclass

from .chat_request import PART_SEP, CacheMark
from .validation import check_keys, invalid
from .errors import ApiError
from .tool_calls import strict_json

ROLES = ("user", "assistant", "system", "developer")


@dataclass(frozen=True, slots=True)
class MarkedText:
    """A message's text and its breakpoints: the char offset after each marked part, None
    for a marked last part (the message's end)."""
    text: str
    offsets: list


@dataclass(slots=True)
class ItemsChatForm:
    """Items as chat messages, with the prompt-cache breakpoints their parts mark."""
    messages: list
    marks: list


def _breakpoint(v, path: str) -> bool:
    """Whether a part's ``prompt_cache_breakpoint`` marks it (``{"mode": "explicit"}``).

    Raises:
        ApiError: another value (``invalid_value``) or member (``parameter_not_supported``).
    """
    if v is None:
        return False
    if not isinstance(v, dict) or v.get("mode") != "explicit":
        raise invalid("'prompt_cache_breakpoint' must be {\"mode\": \"explicit\"}", path)
    extra = sorted(set(v) - {"mode"})
    if extra:
        raise invalid(f"'prompt_cache_breakpoint.{extra[0]}' is not supported",
                   f"{path}.{extra[0]}", "parameter_not_supported")
    return True


def _text_of(content, path: str) -> MarkedText:
    """A message's text: a string, or its ``input_text`` / ``output_text`` parts joined; and
    the prompt-cache breakpoints its parts mark (``_breakpoint``)."""
    if isinstance(content, str):
        return MarkedText(text=content, offsets=[])
    if not isinstance(content, list):
        raise invalid("'content' must be a string or an array of parts", path)
    out, marks = [], []
    for j, part in enumerate(content):
        pp = f"{path}[{j}]"
        if not isinstance(part, dict):
            raise invalid("each content part must be an object", pp)
        kind = part.get("type")
        if kind in ("input_image", "input_file", "input_audio", "input_video"):
            raise invalid(f"'{kind}' parts are not supported by this text-only model", pp,
                       "modality_not_supported")
        if kind not in ("input_text", "output_text"):
            raise invalid(f"content part type '{kind}' is not supported (input_text, "
                       "output_text)", f"{pp}.type")
        # (parsed: the OpenAI SDK's parsed output text, in an output Item dumped back whole)
        check_keys(part, pp, ("type", "text", "annotations", "logprobs", "parsed",
                         "prompt_cache_breakpoint"))
        if not isinstance(part.get("text"), str):
            raise invalid("a text part needs 'text' (a string)", f"{pp}.text")
        out.append(part["text"])
        if _breakpoint(part.get("prompt_cache_breakpoint"), f"{pp}.prompt_cache_breakpoint"):
            marks.append(None if j == len(content) - 1 else len(PART_SEP.join(out)))
    return MarkedText(text=PART_SEP.join(out), offsets=marks)


def resolve_items(raw, store) -> list:
    """The request's ``input`` as a list of Items (``item_reference`` replaced)."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise invalid("'input' must be a string or a non-empty array of Items", "input")
    items, seen = [], set()
    for i, item in enumerate(raw):
        path = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid("each input Item must be an object", path)
        if item.get("type") == "item_reference":
            check_keys(item, path, ("type", "id"))
            ref = store.item(item.get("id")) if isinstance(item.get("id"), str) else None
            if ref is None:
                raise ApiError(404, f"no stored Item with id {item.get('id')!r}",
                               "item_not_found", f"{path}.id")
            item = ref
        if item.get("id") is not None and not isinstance(item["id"], str):
            raise invalid("an Item 'id' must be a string", f"{path}.id")
        if isinstance(item.get("id"), str):
            if item["id"] in seen:
                raise invalid(f"Item id {item['id']!r} appears twice", f"{path}.id")
            seen.add(item["id"])
        items.append(item)
    return items


def items_chat_form(items: list, first_new: int = 0) -> ItemsChatForm:
    """Items in the chat form the template renders: adjacent function calls grouped into one
    assistant turn, a reasoning Item attached to the assistant turn after it; and the
    prompt-cache breakpoints the parts of Items ``first_new`` onwards mark (``CacheMark``s,
    ``ChatRequest.cache_breakpoints``; an earlier response's Items replayed by
    ``previous_response_id`` publish nothing again). Items before ``first_new`` are that
    chain's: an error names the request's own ``input[i]`` counted from ``first_new``."""
    out: list[dict] = []
    marks: list[CacheMark] = []
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
        path = f"input[{i - first_new}]" if i >= first_new else "previous_response_id"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            check_keys(item, path, ("type", "role", "content", "id", "status", "phase"))
            if item.get("phase") is not None:
                raise invalid("message 'phase' is not supported", f"{path}.phase",
                           "parameter_not_supported")
            role = item.get("role")
            if role not in ROLES:
                raise invalid(f"'role' must be one of {', '.join(ROLES)}", f"{path}.role")
            marked = _text_of(item.get("content"), f"{path}.content")
            text = marked.text
            if role == "assistant":
                msg = assistant()
                msg["content"] = text
            else:
                out.append({"role": "system" if role == "developer" else role,
                            "content": text})
            if i >= first_new:
                marks += [CacheMark(len(out) - 1, off) for off in marked.offsets]
        elif kind == "function_call":
            check_keys(item, path, ("type", "call_id", "name", "arguments", "id", "status"))
            for k in ("call_id", "name", "arguments"):
                if not isinstance(item.get(k), str):
                    raise invalid(f"a function_call Item needs '{k}' (a string)", f"{path}.{k}")
            try:
                args = strict_json(item["arguments"])
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise invalid("function_call 'arguments' must be a JSON object string",
                           f"{path}.arguments")
            prev = out[-1] if out else None
            msg = prev if prev is not None and prev["role"] == "assistant" and \
                reasoning is None else assistant()
            calls.add(item["call_id"])
            if marks and marks[-1] == (len(out) - 1, None) and msg is out[-1] and \
                    not msg.get("tool_calls"):
                # a mark at the end of the text this call follows: the end of that text
                marks[-1] = CacheMark(len(out) - 1, len(msg["content"]))
            msg.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            check_keys(item, path, ("type", "call_id", "output", "id", "status"))
            if not isinstance(item.get("call_id"), str):
                raise invalid("a function_call_output Item needs 'call_id' (a string)",
                           f"{path}.call_id")
            if item["call_id"] not in calls:
                raise invalid(f"no function_call with call_id {item['call_id']!r} before this "
                           "output", f"{path}.call_id")
            marked = _text_of(item.get("output"), f"{path}.output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": marked.text})
            if i >= first_new:
                marks += [CacheMark(len(out) - 1, off) for off in marked.offsets]
        elif kind == "reasoning":
            check_keys(item, path, ("type", "id", "summary", "content", "encrypted_content",
                               "status"))
            if item.get("encrypted_content") is not None:
                raise invalid("encrypted reasoning cannot be replayed here",
                           f"{path}.encrypted_content", "encrypted_reasoning_not_supported")
            key = "summary" if item.get("summary") is not None else "content"
            parts = item.get(key) or []
            if not isinstance(parts, list):
                raise invalid(f"'{key}' must be an array", f"{path}.{key}")
            texts = []
            for j, part in enumerate(parts):
                pp = f"{path}.{key}[{j}]"
                if not isinstance(part, dict) or part.get("type") not in (
                        "summary_text", "reasoning_text") or not isinstance(part.get("text"),
                                                                            str):
                    raise invalid("each part must be {\"type\": \"summary_text\", \"text\": "
                               "string}", pp)
                texts.append(part["text"])
            reasoning = "".join(texts)
        else:
            raise invalid(f"Item type {kind!r} is not supported (message, function_call, "
                       "function_call_output, reasoning, item_reference)", f"{path}.type")
    if out and out[-1]["role"] == "assistant" and not out[-1].get("tool_calls"):
        raise invalid("a last assistant message (a prefill to continue) is not supported",
                   "input", "prefill_not_supported")
    return ItemsChatForm(messages=out, marks=marks)

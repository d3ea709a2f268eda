"""Anthropic Messages content into the chat form the template renders: ``system`` first (with
the ``system``-role messages that open ``messages``; a later one stays where it is), a turn's
text blocks joined by a blank line, ``tool_use`` blocks as assistant tool calls,
``tool_result`` blocks as tool messages (``Error: `` before a failed one's text), ``thinking``
blocks as the assistant's reasoning; images are refused (``modality_not_supported``) and so is
a last assistant turn to continue (``prefill_not_supported``). ``cache_control`` marks become
prompt-cache breakpoints (``CacheMark``)."""
from __future__ import annotations

import json
from dataclasses import dataclass

from .chat_request import CacheMark
from .validation import check_keys, invalid

SEP = "\n\n"   # between the text blocks of one turn (a system prompt in several blocks)
BLOCK_FIELDS = {"text": {"type", "text", "cache_control", "citations"},
                "tool_use": {"type", "id", "name", "input", "cache_control"},
                "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
                "thinking": {"type", "thinking", "signature"},
                "redacted_thinking": {"type", "data"}}


@dataclass(slots=True)
class ChatForm:
    """A Messages conversation as chat messages, with its prompt-cache breakpoints and the
    number of ``cache_control`` marks it held (each counts against the limit)."""
    messages: list
    marks: list
    n_marks: int


def check_cache_control(v, path: str) -> None:
    if v is None:
        return
    if not isinstance(v, dict) or v.get("type") != "ephemeral":
        raise invalid("'cache_control' must be {\"type\": \"ephemeral\"}", path)
    if v.get("ttl", "5m") != "5m":   # (Anthropic's default lifetime; images here have none)
        raise invalid("'cache_control.ttl' other than \"5m\" is not supported", f"{path}.ttl",
                   "parameter_not_supported")
    check_keys(v, path, ("type", "ttl"))


def _blocks(content, path: str, allowed: tuple[str, ...]) -> list[dict]:
    """Content (a string or an array of blocks) as validated blocks of the ``allowed`` types."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise invalid("'content' must be a string or an array of content blocks", path)
    out = []
    for i, b in enumerate(content):
        bp = f"{path}[{i}]"
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise invalid("each content block must be an object with a 'type'", bp)
        kind = b["type"]
        if kind in ("image", "document"):
            raise invalid(f"'{kind}' blocks are not supported (text only)", f"{bp}.type",
                       "modality_not_supported")
        if kind not in BLOCK_FIELDS or kind not in allowed:
            raise invalid(f"content block type '{kind}' is not accepted here", f"{bp}.type")
        check_keys(b, bp, BLOCK_FIELDS[kind])
        check_cache_control(b.get("cache_control"), f"{bp}.cache_control")
        if kind == "text" and not isinstance(b.get("text"), str):
            raise invalid("a text block needs 'text' (a string)", f"{bp}.text")
        if kind == "thinking" and not isinstance(b.get("thinking"), str):
            raise invalid("a thinking block needs 'thinking' (a string)", f"{bp}.thinking")
        if kind == "tool_use" and not (isinstance(b.get("id"), str)
                                       and isinstance(b.get("name"), str)
                                       and isinstance(b.get("input", {}), dict)):
            raise invalid("a tool_use block needs 'id', 'name' (strings) and 'input' (an object)",
                       bp)
        if kind == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise invalid("a tool_result block needs 'tool_use_id' (a string)",
                           f"{bp}.tool_use_id")
            if b.get("is_error") is not None and not isinstance(b["is_error"], bool):
                raise invalid("'is_error' must be a boolean", f"{bp}.is_error")
            inner = _blocks("" if b.get("content") is None else b["content"],
                            f"{bp}.content", ("text",))
            text = SEP.join(x["text"] for x in inner)
            # cache_control on the result's own text blocks: marks of the result's end
            b = {**b, "content": ("Error: " + text) if b.get("is_error") else text,
                 "inner_marks": sum(x.get("cache_control") is not None for x in inner)}
        out.append(b)
    return out


def chat_form(body: dict) -> ChatForm:
    """The Messages body's ``system`` and ``messages`` in the chat form the template renders,
    the prompt-cache breakpoints their ``cache_control`` marks ask for (``CacheMark``s,
    ``ChatRequest.cache_breakpoints``: a ``text`` / ``tool_result``
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
        raise invalid("'messages' is required", "messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("'messages' must be a non-empty array", "messages")
    for i, m in enumerate(raw):
        path = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid("each message must be an object", path)
        check_keys(m, path, ("role", "content"))
        role = m.get("role")
        if role not in ("user", "assistant", "system"):
            raise invalid("'role' must be 'user', 'assistant' or 'system'", f"{path}.role")
        if "content" not in m:
            raise invalid("'content' is required", f"{path}.content")
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
                        marks.append(CacheMark(len(out), None))
                    out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                                "content": b["content"]})
            texts = [b for b in blocks if b["type"] == "text"]
            for j, b in enumerate(texts):
                if b.get("cache_control") is not None:   # the end of this block's text
                    marks.append(CacheMark(len(out), None if j == len(texts) - 1 else
                                           len(SEP.join(x["text"] for x in texts[:j + 1]))))
            if texts or not blocks:
                out.append({"role": role, "content": SEP.join(b["text"] for b in texts)})
            continue
        if i == len(raw) - 1:
            raise invalid("a last assistant turn (a prefill to continue) is not supported",
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
                marks.append(CacheMark(len(out), None))   # the turn's end
            else:   # a text block with more after it: the end of its text
                upto = texts[:next(k for k, x in enumerate(texts) if x is b) + 1]
                marks.append(CacheMark(len(out), len(SEP.join(x["text"] for x in upto))))
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
    return ChatForm(messages=out, marks=marks, n_marks=count)


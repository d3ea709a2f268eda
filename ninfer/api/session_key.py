"""A chat-form request's session key: which conversation it belongs to, for lane choice
(``engine/prefix.py``). A routing hint, never an authorisation: what is reused is still found
by the tokens alone.

In order: the request's ``prompt_cache_key`` (OpenAI Chat, Responses), Anthropic's
``metadata.user_id`` (Claude Code sends one per session), else the conversation's root digest:
the system / developer messages, the tools and the first user message, without the
``<system-reminder>`` blocks agent clients append to the newest user message and drop from
older ones (so the first turn and the next share a root). The engine sees a 16-hex digest.
"""
from __future__ import annotations

import hashlib
import json
import re

from ..engine.prefix import routing_key

_REMINDER = re.compile(r"\s*<system-reminder>.*?</system-reminder>\s*", re.S)


def session_key(prompt_cache_key: str | None, user_id: str | None, messages: list,
                tools: list | None) -> tuple[str, str]:
    """``(key, kind)``: the 16-hex session key and where it came from (``prompt_cache_key``,
    ``user_id`` or ``root``); ``("", "")`` for a conversation without a user message."""
    if prompt_cache_key:
        return routing_key(prompt_cache_key), "prompt_cache_key"
    if user_id:
        return routing_key("metadata.user_id\0" + user_id), "user_id"
    root = root_digest(messages, tools)
    return (root, "root") if root else ("", "")


def root_digest(messages: list, tools: list | None) -> str:
    """16-hex BLAKE2b of the conversation's root (the messages up to and including the first
    user message, reminders dropped, and the tools); "" when there is no user message."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if first is None:
        return ""
    root = [{"role": m.get("role"), "content": _strip(m.get("content"))}
            for m in messages[:first + 1]]
    data = json.dumps({"root": root, "tools": tools or []}, sort_keys=True, default=str)
    return hashlib.blake2b(data.encode(), digest_size=8, person=b"ninfer-root").hexdigest()


def _strip(content):
    """``content`` without ``<system-reminder>`` blocks (strings, and text parts)."""
    if isinstance(content, str):
        return _REMINDER.sub(" ", content).strip()
    if isinstance(content, list):
        return [_strip(p) for p in content]
    if isinstance(content, dict):
        return {k: _strip(v) if k in ("text", "content") else v for k, v in content.items()}
    return content

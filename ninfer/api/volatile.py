"""Volatile prompt spans: bytes an agent client puts at the top of a prompt that differ between
requests sharing everything after them, so every later token would miss the prefix cache.

Claude Code opens its system prompt with a billing line, ``x-anthropic-billing-header:
cc_version=2.1.332.573; cc_entrypoint=sdk-cli;``, whose version suffix is a fingerprint of the
session's first user message: two sessions of one user (sibling agents, a sub-agent, the next
``claude -p``) share their ~10K-token system prompt and tools but not that first line. The line
is attribution metadata for Anthropic's API, not an instruction to the model, so ninfer drops it
before rendering and names what it dropped in the log (``request.received``
``volatile_spans``); ``--keep-volatile-spans`` serves the prompt as sent.
"""
from __future__ import annotations

import re

# name -> a whole system text block (or the first line of a string system prompt) it drops
SPANS = {
    "claude_code_billing_header": re.compile(r"x-anthropic-billing-header:[^\n]*"),
}


def _volatile(text: str) -> str | None:
    """The name of the span ``text`` (one line, surrounding blanks ignored) is, or None."""
    line = text.strip()
    return next((name for name, rx in SPANS.items() if rx.fullmatch(line)), None)


def strip_system(body: dict) -> tuple[dict, tuple[str, ...]]:
    """A Messages ``body`` without the known volatile spans of its ``system`` (a copy; the
    original is untouched) and their names. A system prompt that is not well formed is left
    for validation to name."""
    system = body.get("system") if isinstance(body, dict) else None
    names: list[str] = []
    if isinstance(system, str):
        first, sep, rest = system.partition("\n")
        name = _volatile(first)
        if name is None:
            return body, ()
        return _with_system(body, rest if sep else ""), (name,)
    if not isinstance(system, list):
        return body, ()
    kept = []
    for block in system:
        name = (_volatile(block["text"]) if isinstance(block, dict)
                and block.get("type") == "text" and isinstance(block.get("text"), str)
                and block.get("cache_control") is None else None)
        if name is None:
            kept.append(block)
        else:
            names.append(name)
    if not names:
        return body, ()
    return _with_system(body, kept), tuple(names)


def _with_system(body: dict, system) -> dict:
    """``body`` with ``system`` replaced (dropped when nothing is left of it)."""
    out = {k: v for k, v in body.items() if k != "system"}
    if system:
        out["system"] = system
    return out

"""Request-field policy: what a route does with a field it does not honour.

Every route validates its body against closed lists of the fields it honours. A field outside
them — one of the ``IGNORED`` table below (it tunes a hosted service or a client feature) or
one this server has never heard of — is by default accepted and *ignored*, as vLLM does with
unknown fields: the request is served as if the field were absent, and the field is named, its
array indices folded (``tools[].defer_loading``), in the log (``request.received``
``ignored_fields``) and in the ``ninfer-ignored-fields`` response header. The same holds for a
thinking request on a chat template without a thinking mode (served without thinking).
``--strict-request-fields`` refuses all of them instead (400 ``unknown_parameter``, or the
field's own code), as before. Fields whose absence would silently change the answer
(``response_format``, ``logit_bias``, a ``tool_choice`` that needs constrained decoding, strict
tools, images) are refused in both modes by the route's own validation.

The policy of the request being parsed is a context variable set by ``field_policy`` around
the parse (parsing is synchronous, so it never leaks across requests); without one, parsing is
strict, which keeps the validators usable on their own.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from urllib.parse import quote
from contextvars import ContextVar
from dataclasses import dataclass, field

from .errors import ApiError

HEADER = "ninfer-ignored-fields"

# What the fields clients commonly send do elsewhere, and why they change nothing here
# (docs/api.md "Request fields" prints this table).
IGNORED = {
    # Anthropic Messages (Claude Code, the Anthropic SDKs)
    "context_management": "server-side clearing of old tool results / thinking (a hosted "
                          "context-editing feature); the client's history is served as sent",
    "container": "a hosted code-execution container",
    "mcp_servers": "MCP servers the hosted API would connect to (no server-side tools here)",
    "speed": "a hosted fast-output tier",
    "inference_geo": "where a hosted request may run",
    "tools[].defer_loading": "tool search: every declared tool reaches the template anyway",
    "tools[].eager_input_streaming": "fine-grained tool-input streaming (tool input is "
                                     "always streamed as it is parsed)",
    "tools[].allowed_callers": "programmatic tool calling from a hosted sandbox",
    "tools[].input_examples": "examples for hosted tool use; the template gets the schema",
    "output_config.task_budget": "a hosted agentic budget hint",
    # OpenAI Chat / Responses (OpenCode, the OpenAI SDKs)
    "prediction": "predicted output, a speed hint only",
    "safety_identifier": "an end-user id for the hosted abuse checks",
    "prompt_cache_retention": "how long a hosted prompt cache lives (ninfer's tiers decide)",
}
# The fields honoured on a route although their neighbours are not (docs/api.md table).
HONOURED = {
    "cache_control (Messages, top level)": "an automatic prompt-cache breakpoint at the last "
                                           "cacheable block of the request",
    "thinking.display (Messages)": "\"omitted\": thinking blocks carry no text (signature "
                                   "only); \"summarized\": the full thinking",
}
_INDEX = re.compile(r"\[\d+\]")
MAX_NAMED = 64        # names kept per request (then one "... N more")
MAX_NAME_CHARS = 128  # a longer name is cut
MAX_HEADER_BYTES = 2048


@dataclass(slots=True)
class FieldPolicy:
    """One request's field policy and the fields it ignored so far."""
    strict: bool = True
    ignored: list = field(default_factory=list)
    more: int = 0   # ignored beyond MAX_NAMED

    def unknown(self, path: str) -> None:
        """A field the route does not honour: refused when strict, else ignored.

        Raises:
            ApiError: 400 ``unknown_parameter`` naming ``path`` (strict).
        """
        self.refuse_or_ignore(ApiError(400, f"unknown parameter '{path}'", "unknown_parameter",
                                       path), path)

    def refuse_or_ignore(self, err: ApiError, path: str) -> None:
        """``err`` when strict, else ``path`` (indices folded) is recorded as ignored."""
        if self.strict:
            raise err
        name = _INDEX.sub("[]", path)[:MAX_NAME_CHARS]
        if name in self.ignored:
            return
        if len(self.ignored) < MAX_NAMED:
            self.ignored.append(name)
        else:
            self.more += 1

    def names(self) -> list[str]:
        """The ignored fields for the log: the first ``MAX_NAMED`` and a count of the rest."""
        return self.ignored + ([f"... {self.more} more"] if self.more else [])


def header_value(names: list[str]) -> str:
    """``names`` as a header value: each percent-encoded (a field name may hold a comma, a
    newline or any Unicode), comma-separated, cut at ``MAX_HEADER_BYTES``."""
    out, size = [], 0
    for i, name in enumerate(names):
        item = quote(name, safe="[]._-:!$*+@~ ")
        if size + len(item) + 2 > MAX_HEADER_BYTES:
            out.append(f"... {len(names) - i} more")
            break
        out.append(item)
        size += len(item) + 2
    return ", ".join(out)


_current: ContextVar[FieldPolicy | None] = ContextVar("ninfer_field_policy", default=None)


def current() -> FieldPolicy:
    """The policy of the request being parsed (strict outside ``field_policy``)."""
    return _current.get() or FieldPolicy()


@contextmanager
def field_policy(strict: bool):
    """Parse a request under a fresh policy; yields it (its ``ignored`` list)."""
    policy = FieldPolicy(strict)
    token = _current.set(policy)
    try:
        yield policy
    finally:
        _current.reset(token)

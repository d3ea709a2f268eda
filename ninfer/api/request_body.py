"""Reading a request body: strict JSON with valid Unicode, and the field policy under which it
is parsed (unknown fields ignored and reported, or refused with ``--strict-request-fields``)."""
from __future__ import annotations

import json
import re
from contextlib import contextmanager

from quart import g, request

from . import fields
from .errors import ApiError

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def unpaired_surrogate(body, raw: bytes) -> str | None:
    """The path (``messages[0].content``) of the first string (or key) in ``body``, a JSON value
    decoded from ``raw``, that holds an unpaired surrogate (such a string cannot be encoded,
    echoed or logged as UTF-8), or None. Only bodies whose text holds a ``\\uD800``-``\\uDFFF``
    escape at all are walked."""
    if not _SURROGATE_ESCAPE.search(raw):
        return None
    stack = [(body, "")]
    while stack:   # iterative: a body may nest deeper than Python's recursion limit
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            for k in value:
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
            stack.extend((v, f"{path}.{k}" if path else k) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(value))))
    return None


async def json_body():
    """The request's body decoded as JSON.

    Raises:
        ApiError: 400 ``invalid_json``; 400 ``invalid_unicode`` naming the field where a string
            holds an unpaired surrogate (anywhere in the body, prompt or not: echoed fields
            could not be sent back or logged).
    """
    raw = await request.get_data()
    try:
        # strict UTF-8 (RFC 8259): json.loads(bytes) would also take UTF-16 / UTF-32 and
        # surrogates written as raw bytes ('surrogatepass'), which the \\u prefilter misses
        body = json.loads(raw.decode("utf-8-sig"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    path = unpaired_surrogate(body, raw)
    if path is not None:
        raise ApiError(400, f"'{path}' holds invalid Unicode (an unpaired surrogate)",
                       "invalid_unicode", path)
    return body


@contextmanager
def field_scope(config):
    """Parse a body under the server's field policy; once parsed, the ignored fields go to the
    response header (``g.ignored_fields``, set by the app after the request)."""
    with fields.field_policy(config.strict_request_fields) as policy:
        yield policy
    g.ignored_fields = policy.names()

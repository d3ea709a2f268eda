"""Server-sent events shared by every streaming protocol: frames, the wait for the engine's
next output (with keep-alives), and the wrappers that release a stream's request and log a
failure after its 200 went out."""
from __future__ import annotations

import json
import sys
import traceback
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import trio

from .errors import ApiError, error_record

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_PING = ": ping\n\n"   # an SSE comment: keeps a waiting client from timing out


@dataclass(frozen=True, slots=True)
class ChoiceOutput:
    """One engine output (token, final or error) of the choice at ``index``."""
    index: int
    output: object


@dataclass(frozen=True, slots=True)
class HttpSite:
    """Where an HTTP request came in: its x-request-id, method and path (for its log record)."""
    request_id: str
    method: str
    path: str


def sse_data(obj) -> str:
    """A ``data:`` frame of ``obj`` as compact JSON (OpenAI's streams)."""
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def sse_event(name: str, data: dict) -> str:
    """An ``event: name`` frame with ``data`` as compact JSON (Anthropic's, Responses')."""
    return f"event: {name}\ndata: " + json.dumps(data, ensure_ascii=False,
                                                  separators=(",", ":")) + "\n\n"


async def next_output(recv, ping_s: float) -> ChoiceOutput | None:
    """The engine's next output from ``recv``, or None when ``ping_s`` passed without one (a
    stream's keep-alive is due)."""
    with trio.move_on_after(ping_s):
        return await recv.receive()
    return None


def is_reasoning(item) -> bool:
    """Whether an engine output's text belongs to the thinking block."""
    return getattr(item, "reasoning", getattr(item, "text_is_reasoning", False))


async def released_stream(frames: AsyncIterator[str], recv,
                          release: Callable[[], None]) -> AsyncIterator[str]:
    """``frames``, then (however the stream ends) ``recv`` closed and ``release()`` called."""
    try:
        async with recv, aclosing(frames):
            async for frame in frames:
                yield frame
    finally:
        release()


async def guarded_stream(first: str, rest: AsyncIterator[str], bus,
                         site: HttpSite) -> AsyncIterator[str]:
    """The SSE body: ``first``, then everything of the started generator ``rest`` (closing
    this closes ``rest`` and runs its cleanup). An exception of ours after the 200 is logged
    as a ``request.error`` 500 ``internal_error`` under the response's x-request-id (its
    traceback on stderr) before the stream is cut."""
    try:
        yield first
        async for item in rest:
            yield item
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        err = ApiError(500, f"{type(exc).__name__} in the stream", "internal_error")
        bus.emit(error_record(err, site.request_id, site.method, site.path))
        raise
    finally:
        await rest.aclose()

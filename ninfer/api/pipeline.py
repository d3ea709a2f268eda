"""One generating request, whatever its protocol: admit, prepare, collect or stream, release.

A protocol is an adapter (``ProtocolAdapter``): it parses its body into engine requests
(``prepare``), renders the collected reply (``collect``) or the SSE frames (``stream``). This
module holds what they share: the request-lifetime slot taken before preparation and released
with the reply, the started stream whose cleanup is armed before the 200 goes out, and the log
record of a failure after it.

Expiry of the admission deadline → 503 ``request_queue_timeout`` with ``Retry-After`` — or, once
a stream has committed its 200, one in-band error frame and the end of the stream. While a
stream waits for tokens, keep-alives keep clients from timing out.
"""
from __future__ import annotations

import secrets
import time
from typing import AsyncIterator, Protocol

from quart import Response, g, request

from .admission import Admission, AdmissionTicket
from .generation import Generation
from .streaming import SSE_HEADERS, HttpSite, guarded_stream, released_stream


class ProtocolAdapter(Protocol):
    """What a protocol brings to the shared request flow."""
    protocol: str    # ``Request.protocol`` and ``request.received``'s
    id_prefix: str   # of the response id (``chatcmpl-``, ``msg_``, …)

    async def prepare(self, rid: str, ticket: AdmissionTicket) -> Generation:
        """Read and validate the body, submit its engine requests (more slots through
        ``ticket.reserve_choices``)."""

    async def collect(self, gen: Generation, base: dict) -> dict:
        """The whole reply, once every choice is done."""

    def stream(self, gen: Generation, base: dict) -> AsyncIterator[str]:
        """The reply's SSE frames as the outputs arrive (read from ``gen.recv``)."""


async def serve(adapter: ProtocolAdapter, admission: Admission):
    """The reply to the current HTTP request through ``adapter`` (a JSON object, or an SSE
    ``Response`` when the request streams)."""
    state = admission.state
    rid = adapter.id_prefix + secrets.token_hex(8)
    ticket = admission.admit(rid)
    try:
        gen = await adapter.prepare(rid, ticket)
    except BaseException:
        ticket.release()
        raise
    base = {"id": rid, "created": int(time.time()), "model": state.model_id}
    if gen.request.stream:
        def release() -> None:
            gen.cancel_unfinished()
            ticket.release()

        # Start the body generator here, so its cleanup (cancel + release) is armed before the
        # 200 is handed to the server: a client that disconnects before the body is iterated
        # still cancels its request — the started generator is closed explicitly, or by trio's
        # async-generator finalizer when it is dropped.
        stream = released_stream(adapter.stream(gen, base), gen.recv, release)
        try:
            first = await stream.__anext__()
        except BaseException:
            await stream.aclose()
            raise
        site = HttpSite(request_id=g.get("request_id", ""), method=request.method,
                        path=request.path)
        return Response(guarded_stream(first, stream, state.bus, site),
                        mimetype="text/event-stream", headers=SSE_HEADERS)
    try:
        return await adapter.collect(gen, base)
    finally:
        ticket.release()


class AdmittedProtocol:
    """What every protocol handler holds beside its adapter methods: the server state and the
    shared admission (None: a pool of its own), through which ``handle()`` serves the current
    request."""

    def __init__(self, state, admission: Admission | None = None):
        self.state = state
        self.admission = admission if admission is not None else Admission(state)

    @property
    def in_flight(self) -> int:
        """Requests holding a request-lifetime slot (of the shared pool)."""
        return self.admission.in_flight

    async def handle(self):
        return await serve(self, self.admission)

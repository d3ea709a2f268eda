"""The event bus: one ordered, gap-free stream of records fanned out to sinks.

Producers:
- trio code calls ``emit(event)``: the record is dispatched before ``emit`` returns.
- the execution thread calls ``emit_threadsafe(event)``: the event is appended to a lock-free
  ``collections.deque`` and one idempotent trio wake-up (``TrioToken.run_sync_soon``) is
  requested; the thread never waits for trio or for any sink.

The dispatcher (always on the trio thread) assigns ``seq``, encodes the canonical JSON line once
and hands ``(record, line)`` to every sink's ``write``. A sink that raises is disabled and the
failure itself is emitted as ``sink.failed``; the other sinks keep receiving records.
"""
from __future__ import annotations

import collections
import os
import threading
import time
from typing import Protocol

import trio

from .codec import encode_line
from .schema import SCHEMA_VERSION, Record, SinkFailed


class Sink(Protocol):
    name: str

    def write(self, record: Record, line: str) -> None: ...


def new_instance_id() -> str:
    """Process-unique id: ``serve-<pid>-<unix microseconds>``."""
    return f"serve-{os.getpid()}-{int(time.time() * 1e6)}"


class EventBus:
    """Assigns ``seq`` and fans records out to sinks.

    Args:
        instance: the server instance id stamped on every record.

    Attach to a running trio loop with ``attach()`` (inside trio) before the execution thread
    emits; events emitted from a thread before that are buffered and delivered on attach.
    """

    def __init__(self, instance: str | None = None):
        self.instance = instance or new_instance_id()
        self._sinks: list[Sink] = []
        self._seq = 0
        self._inbox: collections.deque = collections.deque()
        self._token: trio.lowlevel.TrioToken | None = None
        self._trio_thread: int | None = None
        self.records_emitted = 0

    # -- wiring ---------------------------------------------------------------------------
    def add_sink(self, sink: Sink) -> None:
        self._sinks.append(sink)

    @property
    def sinks(self) -> list:
        """The sinks currently attached (a disabled sink is no longer listed)."""
        return list(self._sinks)

    def remove_sink(self, sink: Sink) -> None:
        if sink in self._sinks:
            self._sinks.remove(sink)

    def attach(self) -> None:
        """Bind to the current trio run (call from trio). Delivers buffered thread events."""
        self._token = trio.lowlevel.current_trio_token()
        self._trio_thread = threading.get_ident()
        self._drain()

    # -- producers ------------------------------------------------------------------------
    def emit(self, event) -> Record:
        """Dispatch ``event`` now (trio thread only). Returns its record."""
        self._drain()
        return self._dispatch(time.time(), event)

    def emit_threadsafe(self, event) -> None:
        """Queue ``event`` from any thread without blocking; trio dispatches it soon."""
        self._inbox.append((time.time(), event))
        token = self._token
        if token is not None:
            try:
                token.run_sync_soon(self._drain, idempotent=True)
            except trio.RunFinishedError:
                pass

    def flush(self) -> None:
        """Dispatch everything queued by threads (trio thread only)."""
        self._drain()

    # -- dispatcher -----------------------------------------------------------------------
    def _drain(self) -> None:
        inbox = self._inbox
        while inbox:
            ts, ev = inbox.popleft()
            self._dispatch(ts, ev)

    def _dispatch(self, ts: float, event) -> Record:
        self._seq += 1
        record = Record(SCHEMA_VERSION, self._seq, ts, self.instance, event)
        line = encode_line(record)
        self.records_emitted += 1
        failed = []
        for sink in list(self._sinks):
            try:
                sink.write(record, line)
            except Exception as exc:  # a sink failure must never stop serving
                failed.append((sink, exc))
        for sink, exc in failed:
            self.remove_sink(sink)
            self._dispatch(time.time(), SinkFailed(sink=getattr(sink, "name", type(sink).__name__),
                                                   error=f"{type(exc).__name__}: {exc}"))
        return record

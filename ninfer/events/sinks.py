"""Sinks: the JSONL file, the SSE hub behind ``GET /events``, and the fold sink (``FoldSink``).

Every sink receives ``(record, line)`` where ``line`` is the canonical JSON text formatted once by
the bus, so the file and ``/events`` carry byte-identical data for the same record.
"""
from __future__ import annotations

import collections
import os
import stat
import sys
from dataclasses import dataclass
from typing import NamedTuple

import trio

from .schema import FoldFailed, Record


class JsonlSink:
    """Appends one line per record to ``path``, each in one unbuffered ``write`` (never drops
    while the file system takes them).

    Raises:
        OSError: at construction when the file cannot be opened (startup must fail then).
    An existing file whose last line is torn (a writer killed mid-write) is cut back to its
    last whole line at construction, so that the first record appended starts a line of its
    own. A write error raised later (a full disk) first cuts the file back to its last whole line,
    so that the log stays valid JSONL, prints one console error, then propagates to the bus,
    which disables this sink and records ``sink.failed``.
    """

    name = "jsonl"

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        # a pipe or a terminal (/dev/stdout) cannot seek or be cut back
        self._regular = stat.S_ISREG(os.fstat(self._fd).st_mode)
        if self._regular:
            torn = _cut_torn_tail(self._fd)
            if torn:
                print(f"ninfer: request log {self.path}: cut {torn} bytes of a torn last line "
                      f"(a writer stopped mid-record) before appending", file=sys.stderr,
                      flush=True)

    def write(self, record: Record, line: str) -> None:
        if self._fd < 0:
            raise OSError(f"request log {self.path} is closed")
        data = (line + "\n").encode("utf-8")
        end = None
        try:
            if self._regular:
                end = os.lseek(self._fd, 0, os.SEEK_END)
            done = 0
            while done < len(data):   # a short write (disk nearly full) continues or raises
                done += os.write(self._fd, data[done:])
        except OSError as exc:
            if end is not None:
                try:
                    os.ftruncate(self._fd, end)   # no torn last line
                except OSError:
                    pass
            print(f"ninfer: request log {self.path}: {exc.strerror or exc}; logging to it is "
                  f"disabled from record {record.seq} on", file=sys.stderr, flush=True)
            raise

    def close(self) -> None:
        fd, self._fd = self._fd, -1   # (a later write must not reach a reused fd number)
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


def _cut_torn_tail(fd: int, block: int = 1 << 16) -> int:
    """Truncate the file ``fd`` after its last newline (nothing when it ends with one or is
    empty); returns the bytes cut."""
    size = end = os.lseek(fd, 0, os.SEEK_END)
    while end > 0:
        start = max(0, end - block)
        chunk = os.pread(fd, end - start, start)
        if end == size and chunk.endswith(b"\n"):
            return 0
        cut = chunk.rfind(b"\n")
        if cut >= 0:
            os.ftruncate(fd, start + cut + 1)
            return size - (start + cut + 1)
        end = start
    os.ftruncate(fd, 0)   # (one torn line and nothing before it)
    return size


@dataclass(slots=True)
class _Subscriber:
    queue: collections.deque
    limit: int
    dropped: int = 0
    wake: trio.Event | None = None


class SseItem(NamedTuple):
    """One ``/events`` frame: the record's kind (the SSE ``event:``), its canonical JSON line
    (``data:``) and its event id (``id:``, ``<instance>:<seq>``; empty for a ``gap`` frame)."""
    kind: str
    line: str
    event_id: str


class InvalidLastEventId(ValueError):
    """A ``Last-Event-ID`` that is not ``<instance>:<seq>`` (this server only sends those)."""


class SseHub:
    """Fan-out to ``/events`` subscribers.

    A new subscriber first receives the backlog, in seq order: the ``server.started`` line and
    the ring of the last ``ring_size`` records. A subscriber that resumes (``subscribe(last_event_id=...)``, the
    ``Last-Event-ID`` an EventSource sends when it reconnects) gets only the ring's records after
    that one; where the ring no longer holds all of them, a ``gap`` frame first says how many are
    lost to it (a ``--request-log-jsonl`` file still has them). An id of another server instance (a restart) gets
    the whole backlog. Each subscriber has a bounded queue of ``queue_limit`` lines; when it is
    full the oldest line is dropped and the subscriber is told how many it lost (a ``gap`` frame)
    before its next line. ``write`` never blocks.
    """

    name = "sse"

    def __init__(self, ring_size: int = 512, queue_limit: int = 1024):
        self._ring: collections.deque = collections.deque(maxlen=ring_size)   # (seq, SseItem)
        self._started: tuple[int, SseItem] | None = None   # (seq, item)
        self._instance: str | None = None
        self._last_seq = 0   # of the newest record written
        self._subs: list[_Subscriber] = []
        self.queue_limit = queue_limit
        self.closed = False

    def write(self, record: Record, line: str) -> None:
        item = SseItem(record.kind, line, f"{record.instance}:{record.seq}")
        self._instance = record.instance
        self._last_seq = max(self._last_seq, record.seq)
        if record.kind == "server.started":
            self._started = (record.seq, item)
        else:
            self._ring.append((record.seq, item))
        for sub in self._subs:
            if len(sub.queue) >= sub.limit:
                sub.queue.popleft()
                sub.dropped += 1
            sub.queue.append(item)
            if sub.wake is not None:
                sub.wake.set()

    @staticmethod
    def parse_event_id(value: str) -> tuple[str, int]:
        """``"<instance>:<seq>"`` -> ``(instance, seq)``.

        Raises:
            InvalidLastEventId: another shape, a seq below 1 (seqs start at 1) or one of more
                than 19 digits.
        """
        instance, sep, seq = value.strip().rpartition(":")
        if (not sep or not instance or not seq.isascii() or not seq.isdigit() or len(seq) > 19
                or int(seq) < 1):
            raise InvalidLastEventId(
                f"Last-Event-ID {value[:80]!r} is not an id this server sent (<instance>:<seq>)")
        return instance, int(seq)

    def subscribe(self, last_event_id: str | None = None) -> _Subscriber:
        """A new subscriber with its backlog queued (see the class docstring).

        Raises:
            InvalidLastEventId: ``last_event_id`` is malformed (``parse_event_id``), or names
                this instance's record that was not written yet (a seq ahead of the log).
        """
        dropped = 0
        if last_event_id is not None and last_event_id.strip():
            instance, last = self.parse_event_id(last_event_id)
        else:
            instance, last = None, 0
        resume = instance is not None and instance == self._instance
        if resume and last > self._last_seq:
            raise InvalidLastEventId(f"Last-Event-ID {last_event_id[:80]!r} is ahead of this "
                                     f"server's log (its newest record is {self._last_seq})")
        if not resume:
            last = 0
        # in seq order: a record emitted before server.started (store.opened) comes first
        kept = sorted([(seq, item) for seq, item in self._ring if seq > last]
                      + ([self._started] if self._started and self._started[0] > last else []),
                      key=lambda e: e[0])
        if resume:   # records after `last` that are no longer held (evicted from the ring)
            newest = kept[-1][0] if kept else last
            dropped = max(0, newest - last - len(kept))
        backlog = [item for _, item in kept]
        if len(backlog) > self.queue_limit:
            dropped += len(backlog) - self.queue_limit
            backlog = backlog[-self.queue_limit:]
        sub = _Subscriber(collections.deque(backlog), self.queue_limit, dropped)
        self._subs.append(sub)
        return sub

    def close(self) -> None:
        """The server is stopping: subscribers get what is queued, then their streams end."""
        self.closed = True
        for sub in self._subs:
            if sub.wake is not None:
                sub.wake.set()

    def unsubscribe(self, sub: _Subscriber) -> None:
        if sub in self._subs:
            self._subs.remove(sub)

    async def next_items(self, sub: _Subscriber, timeout_s: float) -> list[SseItem]:
        """Wait up to ``timeout_s`` for lines; returns ``SseItem``s (empty on timeout). A
        ``gap`` item (``{"kind":"gap","dropped":N}``, no event id) comes first when lines were
        dropped."""
        if not sub.queue and not self.closed:
            sub.wake = trio.Event()
            with trio.move_on_after(timeout_s):
                await sub.wake.wait()
            sub.wake = None
        out = []
        if sub.dropped:
            out.append(SseItem("gap", '{"kind":"gap","dropped":%d}' % sub.dropped, ""))
            sub.dropped = 0
        while sub.queue:
            out.append(sub.queue.popleft())
        return out

    @property
    def subscriber_count(self) -> int:
        return len(self._subs)


class FoldSink:
    """Folds every record into ``state`` as it is emitted, with replay's error policy.

    Args:
        fold_or_skip: ``(state, record) -> (state, error | None)``; on an error the returned
            state is the one that skipped the record (``events.fold.fold_or_skip``).
        report: called with one ``fold.failed`` event per skipped record (the server passes
            ``bus.emit_threadsafe``, which queues it behind the record being dispatched).
    The sink never raises, so the bus never disables it.
    """

    def __init__(self, name: str, fold_or_skip, state, report=None):
        self.name = name
        self._fold = fold_or_skip
        self.state = state
        self._report = report

    def write(self, record: Record, line: str) -> None:
        self.state, error = self._fold(self.state, record)
        if error is not None and self._report is not None:
            self._report(FoldFailed(seq=record.seq, record_kind=record.kind,
                                    error=f"{type(error).__name__}: {error}"))

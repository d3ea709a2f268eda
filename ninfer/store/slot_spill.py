"""The auto-save writer (``--auto-save-evicted``): sessions a lane lost involuntarily are
written to their slot files off the execution thread.

The engine exports a lane's session as a ``LaneImage`` at a step boundary (as a slot save
does) and queues it here; one writer thread writes it with ``write_slot_file`` (temporary
file, fsync, rename: a crash leaves the old file or the new one, never half of one). Each
outcome is an event, ``slot.spilled`` or ``slot.spill_failed`` (the latter also a line on
stderr); a failed write never reaches the engine or a request. A newer spill of a file
replaces an older one still queued, and ``wait_file`` lets a slot save or restore of that file
wait until no spill of it is pending, so they see each other in order.
"""
from __future__ import annotations

import collections
import os
import sys
import threading
import time
from dataclasses import dataclass

from ..engine.continuation import LaneImage
from .slot_file import write_slot_file


@dataclass(frozen=True, slots=True)
class Spill:
    """One queued spill: ``image`` of lane ``lane`` for ``DIR/filename``; ``reason``: how the
    lane lost it (``lane.evicted``'s reason); ``digest``: its ``session_digest``."""
    lane: int
    filename: str
    reason: str
    image: LaneImage
    digest: str


class SlotSpiller:
    """One writer thread for spilled sessions.

    Args:
        directory: ``--slot-save-path``.
        identity: the runtime identity the slot files are bound to (as the ``/slots`` saves).
        bus: EventBus (``emit_threadsafe``).
        max_queued: files waiting at most; a spill beyond them fails (``writer busy``) rather
            than piling sessions up in host memory.
    """

    def __init__(self, directory: str, identity: dict, bus, max_queued: int = 8):
        from ..events import schema as ev
        self._ev = ev
        self.directory, self.identity, self.bus = directory, identity, bus
        self._max_queued = max_queued
        self._queue: collections.OrderedDict[str, Spill] = collections.OrderedDict()
        self._writing = ""   # the file being written now
        self._closed = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ninfer-slot-spill", daemon=True)
        self._thread.start()

    def submit(self, spill: Spill) -> bool:
        """Queue ``spill`` (replacing a queued older one of the same file); False, and
        ``slot.spill_failed``, when ``max_queued`` other files wait or the writer is closed."""
        with self._cv:
            full = spill.filename not in self._queue and len(self._queue) >= self._max_queued
            if not (full or self._closed):
                self._queue.pop(spill.filename, None)
                self._queue[spill.filename] = spill
                self._cv.notify_all()
                return True
        self._failed(spill, "writer busy: session not spilled" if full else "writer closed")
        return False

    def pending(self, filename: str) -> bool:
        """Whether a spill of ``filename`` is queued or being written."""
        with self._cv:
            return filename in self._queue or self._writing == filename

    def wait_file(self, filename: str, timeout: float = 60.0) -> bool:
        """Block until no spill of ``filename`` is queued or being written (a slot save or
        restore of it first lets the spill land); False on ``timeout`` seconds."""
        with self._cv:
            return self._cv.wait_for(
                lambda: filename not in self._queue and self._writing != filename, timeout)

    def flush(self, timeout: float = 60.0) -> bool:
        """Block until every queued spill has been written (or failed)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._writing, timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Write what is queued, then stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                _, spill = self._queue.popitem(last=False)
                self._writing = spill.filename
            self._write(spill)
            with self._cv:
                self._writing = ""
                self._cv.notify_all()

    def _write(self, spill: Spill) -> None:
        t0 = time.monotonic()
        try:
            n = write_slot_file(os.path.join(self.directory, spill.filename), spill.image,
                                self.identity)
        except Exception as exc:  # a full or failing disk never stops serving
            self._failed(spill, f"{type(exc).__name__}: {exc}")
            return
        self.bus.emit_threadsafe(self._ev.SlotSpilled(
            lane=spill.lane, filename=spill.filename, reason=spill.reason, tokens=spill.image.n,
            bytes=n, duration_s=time.monotonic() - t0, session_digest=spill.digest))

    def _failed(self, spill: Spill, error: str) -> None:
        print(f"ninfer: warning: auto-save of slot {spill.lane}'s session to "
              f"{spill.filename} failed: {error}", file=sys.stderr, flush=True)
        self.bus.emit_threadsafe(self._ev.SlotSpillFailed(
            lane=spill.lane, filename=spill.filename, reason=spill.reason,
            tokens=spill.image.n, error=error))

"""The hand-off of outputs from the execution thread to their requesters.

A requester's ``deliver`` callback is scheduled onto the trio loop with
``TrioToken.run_sync_soon`` (never blocking the thread), or called at once when the engine is
driven by hand (tests, ``ninfer generate``). The outputs of a decode round may be held back
until the next round's forward is launched (``defer``), so trio formats and sends them while
the device computes instead of contending for the GIL with the thread's step preparation.
"""
from __future__ import annotations

from typing import Callable


def _safe_call(fn: Callable, item) -> None:
    try:
        fn(item)
    except Exception:  # a requester that went away must not break the loop that delivers
        pass


class Outbox:
    """Ordered delivery of outputs (``TokenOutput``, ``FinalOutput``, ``ErrorOutput``,
    ``SlotResult``) to requesters' callbacks.

    ``trio_token``: the loop deliveries go through (None: call at once); ``defer``: hold a
    round's outputs (``holding``) until ``flush``, which pays only where ``forward`` returns
    before the device is done (the GPU backends)."""

    def __init__(self):
        self.trio_token = None
        self.defer = False
        self.holding = False          # inside a round's commit whose outputs are held back
        self.pending: list[tuple[Callable, object]] = []

    def post(self, fn: Callable, item) -> None:
        """Deliver ``item`` to ``fn``, after every output held before it (FIFO)."""
        if self.holding or self.pending:  # keep every requester's outputs in order
            self.pending.append((fn, item))
            return
        self._now(fn, item)

    def hold(self) -> None:
        """Hold the outputs posted from now until ``release`` (where ``defer`` is on)."""
        self.holding = self.defer

    def release(self) -> None:
        self.holding = False

    def flush(self) -> None:
        """Hand the held outputs to the requesters, in order."""
        pending, self.pending = self.pending, []
        for fn, item in pending:
            self._now(fn, item)

    def _now(self, fn: Callable, item) -> None:
        if self.trio_token is None:
            _safe_call(fn, item)
        else:
            try:
                self.trio_token.run_sync_soon(_safe_call, fn, item)
            except Exception:  # trio loop gone: nobody is listening any more
                pass

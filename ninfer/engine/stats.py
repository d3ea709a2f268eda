"""The execution thread's published statistics: occupancy counts and its wall clock by
activity, as one immutable snapshot swapped in after every unit of work."""
from __future__ import annotations

import time
from dataclasses import dataclass

WORKER_ACTIVITIES = ("prefill", "decode", "admission", "upkeep", "idle")


@dataclass(frozen=True, slots=True)
class EngineStats:
    """An immutable snapshot the execution thread publishes after every unit of work (a single
    reference swap, so readers on other threads never see a torn value).

    ``worker_seconds``: cumulative wall clock of the execution thread by activity (mutually
    exclusive; ``WORKER_ACTIVITIES``). Counts are current occupancy."""
    running: int = 0
    prefilling: int = 0
    decode_ready: int = 0
    waiting: int = 0
    decode_rounds: int = 0
    prefill_steps: int = 0
    free_pages: int = 0
    total_pages: int = 0
    retained_lanes: int = 0
    retained_pages: int = 0
    worker_seconds: tuple = tuple((a, 0.0) for a in WORKER_ACTIVITIES)


class WorkerClock:
    """Cumulative wall clock of the execution thread by activity (``WORKER_ACTIVITIES``)."""

    def __init__(self):
        self.seconds = dict.fromkeys(WORKER_ACTIVITIES, 0.0)
        self._mark = time.monotonic()

    def account(self, activity: str) -> None:
        """Charge the wall clock since the last mark to ``activity``."""
        now = time.monotonic()
        self.seconds[activity] += now - self._mark
        self._mark = now


def snapshot(lanes, waiting: int, decode_rounds: int, prefill_steps: int, free_pages: int,
             total_pages: int, clock: WorkerClock) -> EngineStats:
    """The ``EngineStats`` of ``lanes`` now."""
    running = sum(ln.req is not None for ln in lanes)
    prefilling = sum(ln.prefilling for ln in lanes)
    retained = [ln for ln in lanes if ln.retained]
    return EngineStats(running=running, prefilling=prefilling, decode_ready=running - prefilling,
                       waiting=waiting, decode_rounds=decode_rounds, prefill_steps=prefill_steps,
                       free_pages=free_pages, total_pages=total_pages,
                       retained_lanes=len(retained),
                       retained_pages=sum(len(ln.pages) for ln in retained),
                       worker_seconds=tuple(clock.seconds.items()))

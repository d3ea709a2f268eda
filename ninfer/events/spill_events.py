"""The auto-save events (``--auto-save-evicted``, ``store/slot_spill.py``), registered like the
kinds of ``schema.py``, which re-exports them."""
from __future__ import annotations

from typing import ClassVar

from .registry import event


@event("slot.spilled")
class SlotSpilled:
    """``--auto-save-evicted``: lane ``lane`` lost its session involuntarily (``reason``, as
    ``lane.evicted``'s: ``reassigned``, ``truncated``, ``restored``) and the session, bound to
    slot file ``filename`` by its last save or restore, was written there (atomically):
    ``tokens``, ``bytes`` written, ``duration_s`` of the write (off the execution thread),
    ``session_digest`` of what the file now holds."""
    kind: ClassVar[str]
    lane: int
    filename: str
    reason: str
    tokens: int
    bytes: int
    duration_s: float
    session_digest: str


@event("slot.spill_failed")
class SlotSpillFailed:
    """An auto-save (``slot.spilled``) could not be written (``error``: the exception, or
    ``writer busy`` when too many spills wait): the file keeps what it held, the session is
    gone from the lane (to L2 when there is one) and serving continues."""
    kind: ClassVar[str]
    lane: int
    filename: str
    reason: str
    tokens: int
    error: str

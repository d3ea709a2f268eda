"""``--auto-save-evicted``: a session bound to a slot file (``Lane.slot_file``: the file it was
last saved to or restored from) is written back there when its lane loses it involuntarily,
so rotating more sessions than lanes through slot files loses nothing.

Involuntary: another request takes the lane, or an L2 / L3 image restored for it replaces the
session (``reassigned``), a request cuts the session back without continuing it
(``truncated``), a slot restore replaces it (``restored``). An
explicit erase, a failed request and a session the next request continues never spill. The
session is copied out here, on the execution thread at that boundary, as a slot save does;
the file is written by ``store.slot_spill.SlotSpiller``'s thread.
"""
from __future__ import annotations

import collections

from ..events import schema as ev
from .lanes import Lane, LanePool, session_digest
from .slots import session_image
from .tiers import Tiers


class AutoSave:
    """Spills bound sessions through ``spiller`` (execution thread only).

    Args:
        lanes: the LanePool (this hooks its ``spill``).
        tiers: the engine's Tiers (``session_image`` exports through it).
        spiller: a ``SlotSpiller`` (``submit``, ``flush``, ``close``).
        bus: EventBus (a session that cannot be exported is a ``slot.spill_failed``).
    """

    def __init__(self, lanes: LanePool, tiers: Tiers, spiller, bus):
        self.tiers, self.spiller, self.bus = tiers, spiller, bus
        # digest of each session spilled lately -> (file, session key): an L2 / L3 restore of
        # that very session binds its new lane to the file again
        self.spilled: collections.OrderedDict[str, tuple[str, str]] = \
            collections.OrderedDict()
        lanes.spill = self.spill

    def spill(self, lane: Lane, reason: str) -> None:
        """``LanePool.spill``: queue ``lane``'s session for its slot file, if it has one."""
        if not lane.slot_file or not lane.retained:
            return
        from ..store.slot_spill import Spill
        digest = session_digest(lane.tokens[:lane.num_computed])
        try:
            image = session_image(lane, self.tiers)
        except ValueError as exc:   # state not at the ledger's frontier: nothing to keep
            self.bus.emit_threadsafe(ev.SlotSpillFailed(
                lane=lane.id, filename=lane.slot_file, reason=reason,
                tokens=lane.num_computed, error=str(exc)))
            return
        if self.spiller.submit(Spill(lane.id, lane.slot_file, reason, image, digest)):
            self.spilled[digest] = (lane.slot_file, lane.cache_key)
            self.spilled.move_to_end(digest)
            while len(self.spilled) > 1024:
                self.spilled.popitem(last=False)

    def rebind(self, lane: Lane, tokens, depth: int, key: str) -> None:
        """After an L2 / L3 restore of image ledger ``tokens`` (``depth`` of them) into
        ``lane`` for a request of session ``key``: when that image is a session spilled
        earlier, and the request continues it (its whole image, or the same session key),
        the lane is bound to its file again."""
        hit = self.spilled.get(session_digest(tokens))
        if hit is not None and (depth == len(tokens) or (key and key == hit[1])):
            lane.slot_file = hit[0]

    def close(self) -> None:
        """Write the queued spills and stop the writer."""
        self.spiller.close()

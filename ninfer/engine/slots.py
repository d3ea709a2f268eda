"""Slot commands: save, restore and erase an idle lane's session (the llama.cpp ``/slots``
actions), run on the execution thread between steps.

A save exports the lane's retained prefix as a ``LaneImage`` (with a hybrid lane's rewind
points: turn checkpoint, anchor, ring); the HTTP side writes it to a slot file. A restore
imports such an image into the lane, after checking that its layout fits this cache. An erase
drops the prefix.
"""
from __future__ import annotations

from .continuation import check_layout, import_lane
from .kv import OutOfPages
from .lanes import Lane, LanePool, session_digest
from .requests import SlotCommand, SlotResult
from .tiers import Tiers


def run_slot_command(cmd: SlotCommand, lane: Lane, lanes: LanePool, tiers: Tiers,
                     max_context: int) -> SlotResult:
    """Carry out ``cmd`` on ``lane``; the result says what happened (never raises for a bad
    image or a busy lane: those are ``SlotResult`` codes)."""
    action = cmd.action
    if lane.req is not None:
        return SlotResult(False, "slot_busy", f"slot {lane.id} is serving a request")
    held = session_digest(lane.tokens[:lane.num_computed]) if lane.retained else ""
    if cmd.if_digest is not None and action in ("save", "erase") and cmd.if_digest != held:
        return SlotResult(False, "slot_session_mismatch",
                          f"slot {lane.id} does not hold session {cmd.if_digest} (it "
                          + (f"holds {held})" if held else "holds none)"))
    if action == "save":
        return _save(lane, tiers, held, cmd.filename)
    if action == "erase":
        return SlotResult(True, tokens=lanes.erase(lane))
    return _restore(cmd, lane, lanes, tiers, max_context)


def _save(lane: Lane, tiers: Tiers, held: str, filename: str) -> SlotResult:
    if not lane.retained:
        return SlotResult(False, "slot_save_failed", f"slot {lane.id} holds no session to save")
    try:
        image = session_image(lane, tiers)
    except ValueError as exc:
        return SlotResult(False, "slot_save_failed", str(exc))
    lane.slot_file = filename   # (its involuntary loss spills there: autosave.py)
    return SlotResult(True, tokens=image.n, image=image, session_digest=held)


def session_image(lane: Lane, tiers: Tiers):
    """``lane``'s retained session as a slot file holds it: the image of its computed prefix
    with a hybrid lane's checkpoints (one mark each, with the roles it plays: turn, anchor,
    ring).

    Raises:
        ValueError: the recurrent state is not at the ledger's frontier.
    """
    return tiers.export(lane, marks=True)


def _restore(cmd: SlotCommand, lane: Lane, lanes: LanePool, tiers: Tiers,
             max_context: int) -> SlotResult:
    image = cmd.image
    if image is None or image.n < 1 or image.n + 1 > max_context:
        return SlotResult(False, "slot_restore_failed",
                          f"the saved session has {0 if image is None else image.n} "
                          f"tokens; a lane holds {max_context} (the session "
                          "+ at least one token)")
    try:
        check_layout(tiers.layout_identity(), image)
    except ValueError as exc:   # refused before the lane's own session is touched
        return SlotResult(False, "slot_restore_failed", f"the session does not fit this "
                          f"cache: {exc}")
    if lane.retained:
        lanes.evict(lane, "restored")
    try:
        lanes.take_pages(lane, image.n)
    except OutOfPages as exc:
        return SlotResult(False, "slot_restore_failed", f"no room in the KV pool: {exc}")
    try:
        import_lane(tiers.kv, image, image.n, lane.pages, lane.id if tiers.recurrent else None)
    except Exception as exc:  # whatever the image holds, the engine goes on
        lanes.reset(lane, 0)
        return SlotResult(False, "slot_restore_failed", f"the session does not fit this "
                          f"cache: {exc}")
    # ("": the restored session's latest request took its checkpoints)
    lanes.load(lane, image.tokens, 0, image.checkpoints if tiers.recurrent else None,
               tiers.ring)
    tiers.resume_rows(lane, image)
    lane.slot_file = cmd.filename
    lanes.retained(lane, "", 0)
    return SlotResult(True, tokens=image.n, session_digest=session_digest(lane.tokens))

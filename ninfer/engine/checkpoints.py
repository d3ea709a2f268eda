"""A hybrid lane's rewind points below its frontier: the rolling turn checkpoint, the user-turn
anchor and the turn-checkpoint ring (``--turn-checkpoints N``: up to N past turn checkpoints
and message boundaries of the lane's prefills).

The recurrent state integrates every token and cannot be cut back, so a prompt that edits the
lane's history resumes at the deepest of these still below the edit (the C++ engine's ring of
turn checkpoints, recommended N = 32). Each point is a ``Checkpoint``: a host copy of the state
at one depth. They leave the lane with its session as ``ImageCheckpoint`` marks (L2 / L3
images, slot files), whose ``roles`` say which of ``turn`` / ``anchor`` / ``ring`` each plays.
"""
from __future__ import annotations

from dataclasses import dataclass

from .continuation import ImageCheckpoint

ROLES = ("turn", "anchor", "ring")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A hybrid lane's recurrent state copied aside at frontier ``depth`` (a turn boundary).

    ``conv`` / ``ssm``: per GDN layer, host copies of the state; ``request_id``: the request
    whose prefill took it ("" for a session restored from an image or a slot file);
    ``mtp_row``: on a speculative lane, the main model's hidden row at ``depth - 1`` (the MTP
    head's KV row there pairs it with the token after it, which a resumed prompt may change),
    else None: such a checkpoint serves no speculative lane."""
    depth: int
    conv: list
    ssm: list
    request_id: str
    mtp_row: object = None


def points(lane) -> list[tuple[str, Checkpoint]]:
    """``(role, checkpoint)`` of every rewind point ``lane`` holds: the turn checkpoint, the
    anchor, then the ring newest first (one checkpoint may appear under two roles)."""
    out = [(role, c) for role, c in (("turn", lane.ckpt), ("anchor", lane.anchor))
           if c is not None]
    return out + [("ring", c) for c in reversed(lane.ring)]


def push(lane, new: Checkpoint, ring_size: int, anchor: bool) -> None:
    """Make ``new`` the lane's turn checkpoint (and its anchor when ``anchor``); the one it
    replaces, when shallower, joins the ring, whose oldest entries go past ``ring_size``."""
    old = lane.ckpt
    if old is not None and old.depth < new.depth:
        to_ring(lane, old, ring_size)
    lane.ckpt = new
    if anchor:
        lane.anchor = new


def to_ring(lane, c: Checkpoint, ring_size: int) -> None:
    """Add ``c`` to the lane's ring, kept in depth order (one history: the deepest are the
    newest); the shallowest go past ``ring_size``."""
    if ring_size <= 0:
        return
    lane.ring.append(c)
    lane.ring.sort(key=lambda e: e.depth)
    del lane.ring[:-ring_size]


def boundaries(req, start: int, prompt_len: int, spacing: int, limit: int) -> list[int]:
    """The message boundaries (``req.boundaries``) a prefill from ``start`` stops at to add to
    the ring: past ``start``, below the prompt's end, at least ``spacing`` deep and ``spacing``
    below the next deeper one kept, the turn checkpoint and the anchor; the deepest ``limit``."""
    if limit <= 0 or not req.boundaries:
        return []
    taken = [d for d in (req.checkpoint_at, req.anchor_at) if d is not None]
    out: list[int] = []
    for d in sorted(set(req.boundaries), reverse=True):
        if len(out) == limit or d <= start:
            break
        if spacing <= d < prompt_len and all(abs(t - d) >= spacing for t in taken + out):
            out.append(d)
    return sorted(out)


def drop_past(lane, depth: int) -> None:
    """Forget the rewind points deeper than ``depth`` (the ledger was cut back there)."""
    if lane.ckpt is not None and lane.ckpt.depth > depth:
        lane.ckpt = None
    if lane.anchor is not None and lane.anchor.depth > depth:
        lane.anchor = None
    lane.ring = [c for c in lane.ring if c.depth <= depth]


def deepest(lane, common: int, lo: int, spec: bool = False) -> tuple[str, Checkpoint] | None:
    """The deepest rewind point at a depth in ``[lo, common]`` (``common``: where the prompt
    first differs from the lane's ledger, capped below the prompt's last token), with its
    role, or None (``spec``: only points with an ``mtp_row``). Ties go to the turn checkpoint,
    then the anchor, then the ring."""
    best = None
    for role, c in points(lane):
        if (lo <= c.depth <= common and (best is None or c.depth > best[1].depth)
                and (not spec or c.mtp_row is not None)):
            best = (role, c)
    return best


def role_at(lane, depth: int, spec: bool = False) -> tuple[str, Checkpoint] | None:
    """The rewind point at exactly ``depth`` (as ``deepest``'s tie order and ``spec``), or
    None."""
    return deepest(lane, depth, depth, spec)


def to_marks(lane, below: int, host=None) -> list[ImageCheckpoint]:
    """The lane's rewind points shallower than ``below`` as image marks, one per checkpoint
    with every role it plays, shallowest first; ``host(row)``: a host float32 copy of a
    checkpoint's MTP row (without it the marks carry none)."""
    marks: dict[int, list] = {}
    for role, c in points(lane):
        if 0 < c.depth < below:
            marks.setdefault(id(c), [c, []])[1].append(role)
    return [ImageCheckpoint(c.depth, c.conv, c.ssm, tuple(dict.fromkeys(roles)),
                            None if c.mtp_row is None or host is None else host(c.mtp_row))
            for c, roles in sorted(marks.values(), key=lambda m: m[0].depth)]


def from_marks(lane, marks, depth: int, ring_size: int) -> None:
    """Give ``lane`` (just loaded with an image's first ``depth`` tokens) the image's marks
    at most ``depth`` deep: the turn checkpoint and anchor by role, the ring (at most
    ``ring_size``, the deepest kept) from the ``ring`` marks; "" as their request."""
    lane.ckpt = lane.anchor = None
    ring = []
    for m in sorted(marks or (), key=lambda m: m.depth):
        if not 0 < m.depth <= depth:
            continue
        c = Checkpoint(depth=m.depth, conv=m.conv, ssm=m.ssm, request_id="",
                       mtp_row=m.mtp_row)   # (a host row: admission uploads it)
        if "turn" in m.roles:
            lane.ckpt = c
        if "anchor" in m.roles:
            lane.anchor = c
        if "ring" in m.roles:
            ring.append(c)
    lane.ring = ring[-ring_size:] if ring_size > 0 else []


def state_nbytes(c: Checkpoint) -> int:
    """Host bytes of one checkpoint's state arrays."""
    return sum(a.nbytes for a in list(c.conv) + list(c.ssm))

"""A hybrid lane's rewind points (``checkpoints.py``), without a model: the ring keeps at most N
past turn checkpoints, oldest out first; a cut drops the deeper ones; the deepest point below a
prompt's divergence wins; marks carry every role through an image and back."""
from __future__ import annotations

import numpy as np

from ninfer.engine import checkpoints
from ninfer.engine.checkpoints import Checkpoint
from ninfer.engine.lanes import Lane


def _ck(depth: int, rid: str = "r") -> Checkpoint:
    state = [np.full((2, 3), depth, dtype=np.float32)]
    return Checkpoint(depth=depth, conv=state, ssm=[np.zeros((1, 2, 2), np.float32)],
                      request_id=rid)


def test_the_ring_keeps_the_last_n_past_turn_checkpoints():
    lane = Lane(0)
    for d in (10, 20, 30, 40, 50):
        checkpoints.push(lane, _ck(d), ring_size=3, anchor=d == 20)
    assert lane.ckpt.depth == 50 and lane.anchor.depth == 20
    assert [c.depth for c in lane.ring] == [20, 30, 40]       # 10 went out first
    roles = [(r, c.depth) for r, c in checkpoints.points(lane)]
    assert roles == [("turn", 50), ("anchor", 20), ("ring", 40), ("ring", 30), ("ring", 20)]
    # a regenerated answer takes its checkpoint at the same depth: replaced, not pushed
    checkpoints.push(lane, _ck(50, "again"), ring_size=3, anchor=False)
    assert lane.ckpt.request_id == "again" and [c.depth for c in lane.ring] == [20, 30, 40]


def test_without_a_ring_the_turn_checkpoint_is_replaced_as_before():
    lane = Lane(0)
    for d in (10, 20, 30):
        checkpoints.push(lane, _ck(d), ring_size=0, anchor=False)
    assert lane.ckpt.depth == 30 and lane.ring == [] and lane.anchor is None


def test_a_cut_drops_the_deeper_points_and_the_deepest_below_divergence_wins():
    lane = Lane(0)
    for d in (10, 20, 30, 40):
        checkpoints.push(lane, _ck(d), ring_size=8, anchor=d == 30)
    # the prompt first differs at 35: the anchor (30) is the deepest at or below it
    role, c = checkpoints.deepest(lane, 35, lo=1)
    assert (role, c.depth) == ("anchor", 30)
    assert checkpoints.deepest(lane, 25, lo=1)[1].depth == 20
    assert checkpoints.deepest(lane, 25, lo=21) is None        # below min_restore_tokens
    assert checkpoints.role_at(lane, 10)[0] == "ring"
    checkpoints.drop_past(lane, 25)
    assert lane.ckpt is None and lane.anchor is None
    assert [c.depth for c in lane.ring] == [10, 20]


def test_marks_carry_every_role_and_come_back_bounded_by_the_ring():
    lane = Lane(0)
    for d in (10, 20, 30, 40):
        checkpoints.push(lane, _ck(d), ring_size=8, anchor=d == 40)
    marks = checkpoints.to_marks(lane, below=100)
    assert [(m.depth, m.roles) for m in marks] == [
        (10, ("ring",)), (20, ("ring",)), (30, ("ring",)), (40, ("turn", "anchor"))]
    assert checkpoints.to_marks(lane, below=30)[-1].depth == 20   # only those below the image
    back = Lane(1)
    checkpoints.from_marks(back, marks, depth=100, ring_size=2)
    assert back.ckpt.depth == back.anchor.depth == 40 and back.ckpt.request_id == ""
    assert [c.depth for c in back.ring] == [20, 30]               # the deepest two
    np.testing.assert_array_equal(back.ring[0].conv[0], marks[1].conv[0])
    # restored at an inner mark: the points past it are not the new ledger's
    checkpoints.from_marks(back, marks, depth=30, ring_size=8)
    assert back.ckpt is None and [c.depth for c in back.ring] == [10, 20, 30]
    checkpoints.from_marks(back, marks, depth=100, ring_size=0)
    assert back.ring == [] and back.ckpt.depth == 40

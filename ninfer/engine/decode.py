"""Decode rounds: one token for every decode-ready lane per round, with the lookahead (the
next round launched before this one's tokens are read) and speculative rounds for the lanes
the MTP head drafts for. A round is launched by the runner, then committed here: the lanes'
computed positions advance, ``scheduler.round`` is emitted, and each token goes to
``Output.commit``.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from ..events import schema as ev
from .kv import OutOfPages
from .lanes import Lane, LanePool
from .outbox import Outbox
from .output import Output
from .runner import DecodeRound, ModelRunner


class Decoder:
    """Runs and commits decode rounds (execution thread only).

    Args:
        runner, lanes, output, outbox, bus: the engine's parts.
        spec: the MtpSpeculator, or None.
        waiting: the number of queued requests now (for ``scheduler.round``).
        account: charges the wall clock since the last mark to an activity.
    """

    def __init__(self, runner: ModelRunner, lanes: LanePool, output: Output, outbox: Outbox,
                 bus, spec, waiting: Callable[[], int], account: Callable[[str], None]):
        self.runner, self.lanes, self.output = runner, lanes, output
        self.outbox, self.bus, self.spec = outbox, bus, spec
        self.waiting, self.account = waiting, account
        self.rounds = 0             # committed rounds (``scheduler.round``'s number)
        self.ahead: DecodeRound | None = None   # launched ahead, not committed yet
        self._committed_t = 0.0     # when the last round was committed

    def round(self, lanes: list[Lane]) -> None:
        """One decode round of ``lanes``: launch, then commit each lane's token. With the
        lookahead (``EngineConfig.decode_lookahead``) and greedy lanes the next round is
        launched before this one's tokens are read, its tokens fed on the device, and left in
        flight as ``ahead``: the device never waits for the host between rounds. A round ahead
        whose lane a commit changed (a finish, a forced token) is committed at once for the
        lanes it is still right for; an inbox op, an admission or a prefill chunk commits it
        first (``resolve_ahead``)."""
        if self.spec is not None and any(ln.spec for ln in lanes):
            self.resolve_ahead()
            self.outbox.flush()
            self._spec_round([ln for ln in lanes if ln.spec])
            lanes = [ln for ln in lanes if not ln.spec and ln.decode_ready]
            if not lanes:
                return
        cur, self.ahead = self.ahead, None
        still = _still(cur) if cur is not None else []
        if cur is not None and (cur.lanes != lanes or not all(still)):
            self._commit(cur, still)
            cur = None
            lanes = [ln for ln in lanes if ln.decode_ready]
        if cur is None:
            ok = []
            for ln in lanes:
                try:
                    self.lanes.ensure_pages(ln, ln.num_computed + 1)
                    ok.append(ln)
                except OutOfPages:
                    self.output.fail(ln, "kv_cache_full", "no free KV pages for this request")
            if not ok:
                self.outbox.flush()
                return
            cur = self.runner.launch(ok, feed=False)
        # (none while a lane prefills: the next turn is its chunk, which commits the round ahead)
        ahead = cur.fed and not any(ln.prefilling for ln in self.lanes.lanes)
        nxt = self.runner.launch(cur.lanes, feed=True) \
            if ahead and self._pages_ahead(cur) else None
        if nxt is not None:
            for ln in nxt.lanes:
                ln.ahead += 1
        self.outbox.flush()  # the previous round's outputs, while this one computes
        self._commit(cur)
        if nxt is not None:
            keep = [k and ln.tokens[-1] == t for k, ln, t in zip(_still(nxt), nxt.lanes,
                                                                  cur.ids)]
            if all(keep):
                self.ahead = nxt
            else:
                # the lanes a commit finished drop their position ahead: KV rows past their
                # length, and a recurrent state that release() counted (``Lane.ahead``)
                self._commit(nxt, keep)

    def resolve_ahead(self) -> None:
        """Commit the round launched ahead, if any (before the lanes change otherwise)."""
        r, self.ahead = self.ahead, None
        if r is not None:
            self._commit(r)
            self.account("decode")

    def _pages_ahead(self, r: DecodeRound) -> bool:
        """Whether every lane of round ``r`` has (or now gets) the page of the position after
        it; a lane that cannot get it simply runs without a round ahead."""
        if any(ln.num_computed + 2 > self.runner.config.max_context for ln in r.lanes):
            return False
        try:
            for ln in r.lanes:
                self.lanes.ensure_pages(ln, ln.num_computed + 2)
        except OutOfPages:
            return False
        return True

    def _commit(self, r: DecodeRound, keep: list[bool] | None = None) -> None:
        """Read round ``r``'s tokens and commit them (only for the lanes ``keep`` marks): the
        lanes' computed positions advance, the round's event, then each token."""
        if r.feed:
            for ln in r.lanes:
                ln.ahead -= 1
        keep = [(keep is None or keep[i]) and ln.req is r.reqs[i]
                for i, ln in enumerate(r.lanes)]
        idx = [i for i, k in enumerate(keep) if k]
        lanes = [r.lanes[i] for i in idx]
        if r.logits is not None:
            if not lanes:
                return
            sampled = self.runner.sample(lanes, r.logits if len(idx) == len(keep)
                                         else r.logits[idx])
        else:
            r.ids = r.result()
            sampled = [(int(r.ids[i]), None) for i in idx]
            if not lanes:
                return
        for ln in lanes:
            ln.num_computed += 1
        if r.ids is None:   # (a logits round: the kept lanes' tokens; never fed on)
            r.ids = np.array([t for t, _ in sampled], dtype=np.int64)
        t1 = time.monotonic()
        self.rounds += 1
        itl = [t1 - ln.last_token_t for ln in lanes]
        # (a round launched ahead counts from the commit before it: rounds tile the time)
        t0, self._committed_t = max(r.t0, self._committed_t), t1
        self.bus.emit_threadsafe(ev.SchedulerRound(round=self.rounds,
                                                   lanes=[ln.id for ln in lanes],
                                                   tokens=len(lanes), duration_s=t1 - t0,
                                                   itl_s=itl, waiting=self.waiting()))
        self.outbox.hold()
        try:
            for ln, tok in zip(lanes, sampled):
                self.output.commit(ln, tok, t1)
        finally:
            self.outbox.release()

    def _spec_round(self, lanes: list[Lane]) -> None:
        """A speculative round (``MtpSpeculator.round``) and its ``spec.round`` and
        ``scheduler.round`` events."""
        t0 = time.monotonic()
        res = self.spec.round(lanes)
        if res is None:
            return
        self.rounds += 1
        ids = [ln.id for ln in res.lanes]
        self.bus.emit_threadsafe(ev.SpecRound(round=self.rounds, lanes=ids,
                                              drafted=res.drafted, accepted=res.accepted,
                                              accepted_per_position=res.accepted_per_position,
                                              duration_s=res.t1 - t0))
        self.bus.emit_threadsafe(ev.SchedulerRound(round=self.rounds, lanes=ids,
                                                   tokens=res.committed,
                                                   duration_s=time.monotonic() - t0,
                                                   itl_s=res.itl, waiting=self.waiting()))


def _still(r: DecodeRound) -> list[bool]:
    """Per lane of the launched round ``r``: whether the round is still the lane's next
    position of the same request (not finished, cancelled or reassigned since)."""
    return [ln.req is q and ln.decode_ready and ln.num_computed + 1 == p
            for ln, q, p in zip(r.lanes, r.reqs, r.positions)]

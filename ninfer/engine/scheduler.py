"""The scheduler: the pending queue, its deadlines, the order of admission, deferral behind a
lane that builds a shared prefix, and the choice of the next unit of work (one prefill chunk
or one decode round; up to ``max_prefill_lanes`` prefilling lanes take chunk turns in
round-robin). It knows lanes and requests only, never the model, so a test drives it with
hand-made lanes.
"""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import Callable

from ..events import schema as ev
from .lanes import Lane
from .requests import Request


@dataclass(frozen=True, slots=True)
class Deferral:
    """A waiting request's claim on a builder: lane ``lane`` serving ``request_id`` prefills
    toward breakpoint ``depth``, which the waiting request will restore instead of
    computing it again; ``at_frontier``: the builder already held that depth (reused) and
    publishes it when its next chunk starts."""
    lane: int
    request_id: str
    depth: int
    at_frontier: bool = False


@dataclass(frozen=True, slots=True)
class Unit:
    """The next unit of work: one prefill chunk of ``prefill``, or one decode round over
    ``decode`` (every decode-ready lane). A prefill unit also says how it was chosen:
    ``prefill_lanes``, the ids of the lanes taking prefill turns (``prefill`` among them,
    oldest admission first), and ``prefill_queued``, those of the prefilling lanes past
    ``max_prefill_lanes`` that wait for a turn; ``publish_first``: the depth ``prefill`` already
    holds and publishes before its chunk, because a request waits for it (``Deferral``'s
    ``at_frontier``), or None."""
    prefill: Lane | None = None
    decode: tuple[Lane, ...] = ()
    prefill_lanes: tuple[int, ...] = ()
    prefill_queued: tuple[int, ...] = ()
    publish_first: int | None = None


class Scheduler:
    """Queue and choice of work for one engine's ``lanes`` (execution thread only).

    Args:
        lanes: every lane (the scheduler reads them, never changes them).
        max_context: tokens per lane (a prompt must leave room for one output token).
        emit: where ``request.deferred`` events go (``bus.emit_threadsafe``).
        max_prefill_lanes: prefilling lanes (the first admitted) that take chunk turns; 1
            prefills one lane's whole prompt before the next one's (``--max-prefill-lanes``).
    """

    def __init__(self, lanes: list[Lane], max_context: int, emit: Callable = lambda e: None,
                 max_prefill_lanes: int = 1):
        self.lanes = lanes
        self.max_context = max_context
        self.emit = emit
        self.max_prefill_lanes = max_prefill_lanes
        self.waiting: collections.deque[Request] = collections.deque()
        self.deferrals: dict[str, Deferral] = {}   # by waiting request id
        self.prefill_turn = True
        self.prefill_last: tuple[float, int] | None = None   # the last chunk's lane (_admission)

    def enqueue(self, req: Request) -> bool:
        """Queue ``req``; False (not queued) when its prompt is empty or leaves no room for an
        output token in a lane (``context_length_exceeded``)."""
        if len(req.prompt_ids) + 1 > self.max_context or not req.prompt_ids:
            return False
        self.waiting.append(req)
        return True

    def remove(self, request_id: str) -> Request | None:
        """Take ``request_id`` out of the queue (a cancel); None when it is not waiting."""
        req = next((r for r in self.waiting if r.request_id == request_id), None)
        if req is not None:
            self.waiting.remove(req)
        return req

    def expire(self, now: float) -> list[Request]:
        """Remove and return the waiting requests whose deadline passed (never admitted
        ones), except those the last admission deferred (they wait on a builder's progress
        with a free lane as their claim, and are looked at again, first, by the next
        admission), and those a free lane is there for now: the first ones in the queue, as
        many as lanes are free (a long step of the engine delayed them, not the lack of a
        lane)."""
        free = sum(1 for ln in self.lanes if ln.req is None)
        first = {r.request_id for r in itertools.islice(self.waiting, free)}
        out = [r for r in self.waiting if r.deadline is not None and r.deadline <= now
               and r.request_id not in self.deferrals and r.request_id not in first]
        for req in out:
            self.waiting.remove(req)
        return out

    def admit(self, admit_one: Callable[[Request, list[Lane]], None],
              defer: Callable[[Request, list[Lane]], bool]) -> None:
        """Offer waiting requests, in order, to ``admit_one(req, free_lanes)`` while a lane is
        free; a request ``defer`` holds back keeps its place and a free lane as its claim."""
        deferred = []   # waiting for a lane that is building a prefix they share (in order)
        try:
            while self.waiting:
                free = [ln for ln in self.lanes if ln.req is None]
                if len(free) <= len(deferred):   # the free lanes left are the deferred' claim
                    return
                req = self.waiting.popleft()
                if defer(req, free):
                    deferred.append(req)
                    continue
                admit_one(req, free)
        finally:   # (they keep their place, whatever happened)
            self.waiting.extendleft(reversed(deferred))
            live = {r.request_id for r in self.waiting}
            self.deferrals = {k: v for k, v in self.deferrals.items() if k in live}

    def deferral_holds(self, request_id: str) -> bool:
        """Whether the request's recorded builder still serves the same request and has not
        computed the depth it waits for yet."""
        rec = self.deferrals.get(request_id)
        if rec is None:
            return False
        ln = self.lanes[rec.lane]
        return ln.req is not None and ln.req.request_id == rec.request_id and \
            (ln.num_computed < rec.depth or rec.at_frontier and ln.num_computed == rec.depth)

    def defer(self, req: Request, eligible: bool, fits: Callable[[int], bool],
              unpublished: Callable[[Lane, int], bool], reused: Callable[[], int],
              spec: bool = False) -> bool:
        """Whether ``req`` waits for a lane that is prefilling toward a breakpoint both share
        (the same tokens up to a depth in both ``publish_at``, not yet published and not
        reached: serving contract §1.7, one builder per cold prefix; or, on a plain lane, its
        reused frontier, published when its next chunk starts), when the lane it would take
        does not hold that much of its prompt already (``reused()`` tokens).

        ``eligible``: the request may wait at all (an L2 tier to publish to, prefix reuse on);
        ``fits(d)``: an image of ``d`` tokens can fit L2; ``unpublished(lane, d)``: depth
        ``d`` of ``lane``'s prompt is not held by every tier yet; ``spec``: the request is
        decoded speculatively, so only a speculative builder's image (with its MTP row)
        serves it. ``request.deferred`` names each new builder it waits for."""
        if self.deferral_holds(req.request_id):
            return True   # (the tokens were compared when the builder was found)
        self.deferrals.pop(req.request_id, None)
        if not eligible or not req.publish_at:
            return False
        for ln in self.lanes:
            b = ln.req
            if b is None or (spec and not ln.spec) or not ln.prefilling or b is req:
                continue
            for d in sorted(set(req.publish_at) & set(b.publish_at)):
                if not fits(d):
                    break
                # it reused exactly that far and computed nothing yet (Prefiller.chunk)
                at = ln.num_computed == ln.cached == d and not ln.spec
                if (ln.num_computed < d or at) and d < len(req.prompt_ids) and \
                        ln.tokens[:d] == list(req.prompt_ids[:d]) and unpublished(ln, d):
                    if reused() >= d:
                        return False
                    self.deferrals[req.request_id] = Deferral(ln.id, b.request_id, d, at)
                    self.emit(ev.RequestDeferred(request_id=req.request_id, builder_lane=ln.id,
                                                 builder_request=b.request_id, tokens=d))
                    return True
        return False

    def next_unit(self) -> Unit | None:
        """The next unit of work, or None when no lane has any: prefill chunks and decode
        rounds take turns while both are waiting. The first ``max_prefill_lanes`` prefilling
        lanes (oldest admission first) take the prefill turns in round-robin, one chunk
        each; the others wait until one of them is done."""
        prefill = sorted((ln for ln in self.lanes if ln.prefilling), key=_admission)
        decode = [ln for ln in self.lanes if ln.decode_ready]
        if not prefill and not decode:
            return None
        if prefill and (not decode or self.prefill_turn):
            turns, queued = prefill[:self.max_prefill_lanes], prefill[self.max_prefill_lanes:]
            # the next lane after the last one served, in admission order (wrapping around)
            last = self.prefill_last
            lane = next((ln for ln in turns if last is not None and _admission(ln) > last),
                        turns[0])
            self.prefill_last = _admission(lane)
            first = next((d.depth for d in self.deferrals.values() if d.at_frontier and
                          d.lane == lane.id and d.depth == lane.num_computed), None)
            unit = Unit(prefill=lane, prefill_lanes=tuple(ln.id for ln in turns),
                        prefill_queued=tuple(ln.id for ln in queued), publish_first=first)
        else:
            unit = Unit(decode=tuple(decode))
        self.prefill_turn = not self.prefill_turn
        return unit


def _admission(lane: Lane) -> tuple[float, int]:
    """A lane's place in admission order (ties: the lower lane id first)."""
    return lane.admitted_t, lane.id

"""Admission: binding waiting requests to lanes. For each request the scheduler offers, the
reuse policy picks the free lane and its reusable depth, a deeper L2 / L3 image is restored
into it when that saves enough, a turn checkpoint is rewound to where one matches, and the
lane is assigned (``lane.assigned``, ``cache.lookup``, ``request.admitted``).
"""
from __future__ import annotations

import time

import numpy as np

from ..events import schema as ev
from .continuation import device_like, restore_state
from .lanes import Lane, LanePool, MtpRows
from .outbox import Outbox
from .prefix import ReusePolicy, reuse_path, rewind_point, shared_prefix
from .requests import ErrorOutput, Request
from .runner import ModelRunner
from .scheduler import Scheduler
from .tiers import Tiers


# cache.lookup's resumed_from for a lane's rewind point of each role (checkpoints.ROLES)
_RESUMED = {"turn": "turn_checkpoint", "anchor": "anchor", "ring": "ring"}


class Admission:
    """Admits waiting requests into free lanes (execution thread only)."""

    def __init__(self, sched: Scheduler, lanes: LanePool, tiers: Tiers, runner: ModelRunner,
                 spec, tokenizer, bus, outbox: Outbox, config):
        self.sched, self.lanes, self.tiers, self.runner = sched, lanes, tiers, runner
        self.spec, self.tokenizer, self.bus, self.outbox = spec, tokenizer, bus, outbox
        self.config = config
        self.autosave = None   # AutoSave (--auto-save-evicted): rebinds restored sessions

    @property
    def policy(self) -> ReusePolicy:
        """The reuse rules of the current config (the engine may swap it between steps)."""
        c = self.config
        return ReusePolicy(c.prefix_reuse, self.runner.recurrent, c.page_size,
                           c.min_restore_tokens, c.recompute_horizon_tokens)

    def run(self) -> None:
        """Refuse the requests whose queue deadline passed, then admit while lanes are free."""
        for req in self.sched.expire(time.monotonic()):
            msg = "the request waited too long for a free lane"
            self.bus.emit_threadsafe(ev.RequestRejected(request_id=req.request_id,
                                                        code="request_queue_timeout",
                                                        message=msg,
                                                        http_request_id=req.http_request_id))
            self.outbox.post(req.deliver, ErrorOutput("request_queue_timeout", msg))
        self.sched.admit(self._admit_one, self._defer)

    def _spec(self, req: Request) -> bool:
        return self.spec is not None and self.spec.eligible(req)

    def _defer(self, req: Request, free: list[Lane]) -> bool:
        """``Scheduler.defer`` with this engine's tiers: only with L2 (an L3 image becomes
        visible later, on the writer thread), nor for a depth whose image could not fit L2's
        budget; a speculative request waits for a speculative builder only."""
        eligible = self.tiers.l2 is not None and self.config.prefix_reuse
        spec = self._spec(req)

        def reused() -> int:   # what the lane the request would take holds of its prompt
            prompt = np.asarray(req.prompt_ids, dtype=np.int64)
            depth = self.policy.depths(free, prompt, spec)
            return depth[self.policy.choose(free, depth, len(prompt), req.cache_key,
                                            req.session_kind == "root").id]
        return self.sched.defer(req, eligible,
                                fits=lambda d: d * self.runner.kv.bytes_per_token
                                <= self.tiers.l2.budget_bytes,
                                unpublished=self.tiers.unpublished, reused=reused, spec=spec)

    def _admit_one(self, req: Request, free: list[Lane]) -> None:
        spec = self._spec(req)
        prompt = np.asarray(req.prompt_ids, dtype=np.int64)
        depth = self.policy.depths(free, prompt, spec)
        lane = self.policy.choose(free, depth, len(prompt), req.cache_key,
                                  req.session_kind == "root")
        # where the prompt first diverges from what any lane or image holds, before any lane
        # below is cut back
        shared = max(shared_prefix(free, prompt), self.tiers.shared(prompt))
        # (a speculative request: only an image with a speculative lane's MTP rows)
        image, d2, tier = self.tiers.lookup(prompt, depth[lane.id], spec)
        source, path = "l1", None
        if d2 > depth[lane.id] and d2 >= self.config.min_restore_tokens and \
                self.tiers.restore(lane, req, image, d2, tier):
            depth[lane.id], source = d2, tier
            path = "append_frontier" if d2 == image.n else "restore_turn_checkpoint" \
                if self.runner.recurrent else "truncate_frontier"
            if self.autosave is not None:
                self.autosave.rebind(lane, image.tokens, d2, req.cache_key)
        self.assign(lane, req, spec, depth[lane.id],
                    candidates=sum(ln.retained for ln in free), source=source, path=path,
                    shared=max(shared, d2))

    def assign(self, lane: Lane, req: Request, spec: bool, depth: int,
               candidates: int, source: str = "l1", path: str | None = None,
               shared: int = 0) -> None:
        """Bind ``req`` to ``lane``, reusing its first ``depth`` retained tokens (``source``:
        the tier they came from; ``path``: the reuse path when it was decided elsewhere;
        ``shared``: the longest prefix of the prompt any lane or image held)."""
        now = time.monotonic()
        kv = self.runner.kv
        routed = bool(req.cache_key) and self.policy.own(lane, depth, req.cache_key,
                                                         req.session_kind == "root")
        # the request continues the lane's session (its slot file binding carries over):
        # it extends the whole frontier, or is the same session by key
        continues = depth > 0 and (depth >= lane.num_computed or routed)
        point = rewind_point(lane, depth, spec)
        resumed = source if source != "l1" else "frontier"
        if point is not None:
            role, entry = point
            # KV back to the checkpoint, then its state
            self.lanes.truncate(lane, depth, continues)
            restore_state(kv, lane.id, entry.conv, entry.ssm, depth)
            path, resumed = "restore_turn_checkpoint", _RESUMED[role]
        if depth > 0 and self.runner.recurrent and int(kv.lengths[lane.id]) != depth:
            depth = 0  # the state slot is not at the frontier the ledger says: a safe miss
        if depth == 0 or path is None:
            path = reuse_path(self.config.prefix_reuse, depth, lane.num_computed)
        if depth == 0:
            resumed = "miss"
            if lane.retained:
                self.lanes.evict(lane, "reassigned")
            else:
                self.lanes.reset(lane, 0)   # a new conversation: nothing of it is kept
                lane.slot_file = ""
        elif depth < lane.num_computed:
            self.lanes.truncate(lane, depth, continues)
        self.lanes.assign(lane, req, self.tokenizer, self.runner.vocab, spec, depth, now)
        if not continues or source != "l1":   # the lane's session starts with this request
            lane.opened = lane.prompt_len
        if spec and depth > 0:
            if point is not None:   # the MTP row kept at the checkpoint
                lane.mtp_pending = MtpRows(depth - 1, device_like(kv, point[1].mtp_row))
            self.spec.resume(lane)  # the retained pending MTP rows meet the new prompt
        lane.mtp_pending = None
        req.cached_tokens = depth
        self.bus.emit_threadsafe(ev.LaneAssigned(lane=lane.id, request_id=req.request_id,
                                                 n_ctx=self.config.max_context,
                                                 pages=len(lane.pages)))
        self.bus.emit_threadsafe(ev.CacheLookup(request_id=req.request_id, lane=lane.id,
                                                prompt_tokens=lane.prompt_len, cached_tokens=depth,
                                                path=path, candidates=candidates,
                                                source=source if depth else "none",
                                                routed=routed,
                                                session=req.session_kind if routed else "",
                                                shared_tokens=max(shared, depth),
                                                resumed_from=resumed))
        self.bus.emit_threadsafe(ev.RequestAdmitted(request_id=req.request_id, lane=lane.id,
                                                    queue_s=now - req.received_t,
                                                    cached_tokens=depth))

"""Prefill: a lane's prompt computed in chunks of at most ``prefill_chunk`` tokens, a chunk
ending early at a hybrid lane's turn checkpoint, anchor or message boundary (the ring), or at
a publish breakpoint (so the state or the prefix there can be copied out), the last chunk
sampling the first output token.
"""
from __future__ import annotations

import time

from ..events import schema as ev
from . import checkpoints
from .kv import OutOfPages
from .lanes import Lane, LanePool
from .output import Output
from .runner import ModelRunner
from .tiers import Tiers


class Prefiller:
    """Runs prefill chunks (execution thread only); ``spec``: the MtpSpeculator (its lanes
    prefill through the MTP head too), or None."""

    def __init__(self, runner: ModelRunner, lanes: LanePool, tiers: Tiers, output: Output,
                 spec, bus, config):
        self.runner, self.lanes, self.tiers, self.output = runner, lanes, tiers, output
        self.spec, self.bus, self.config = spec, bus, config
        self.recurrent = runner.recurrent

    def chunk(self, lane: Lane, turns: tuple[int, ...] = (), queued: tuple[int, ...] = (),
              publish_first: int | None = None) -> None:
        """Compute the lane's next prompt chunk (stopping at a turn checkpoint or a publish
        breakpoint inside it); the last chunk samples the first output token. ``turns`` /
        ``queued``: the lanes taking prefill turns and those waiting for one when the
        scheduler chose this chunk (``Unit``; carried on ``request.prefill_chunk``);
        ``publish_first``: a breakpoint the lane reused up to, which a deferred request waits
        for: published before the chunk."""
        req, cfg = lane.req, self.config
        a = lane.num_computed
        if publish_first == a and self.tiers.publish_depth(lane, a - 1, a):
            self.tiers.publish(lane, a)   # (a plain lane: its state is there now)
        b = min(lane.prompt_len, a + cfg.prefill_chunk)
        keeps = self.recurrent and cfg.turn_checkpoint and cfg.prefix_reuse
        # the turn checkpoint and the user-turn anchor inside this chunk
        marks = [d for d in (req.checkpoint_at, req.anchor_at)
                 if keeps and d is not None and a < d <= b and d < lane.prompt_len]
        # message boundaries joining the ring (taken past the reused prefix)
        ring = [d for d in checkpoints.boundaries(req, lane.cached, lane.prompt_len,
                                                  cfg.min_restore_tokens, self.tiers.ring)
                if a < d <= b] if keeps else []
        marks += ring
        publish = self.tiers.publish_depth(lane, a, b)
        if marks or publish:
            # this chunk ends at the nearest mark or breakpoint; the next one goes on from there
            b = min(marks + ([publish] if publish else []))
            publish = publish if publish == b else None
        turn, anchor = b in marks and b == req.checkpoint_at, b in marks and b == req.anchor_at
        try:
            self.lanes.ensure_pages(lane, b)
        except OutOfPages:
            self.output.fail(lane, "kv_cache_full", "no free KV pages for this request")
            return
        t0 = time.monotonic()
        row = None   # (a speculative lane's last hidden row: its checkpoints keep it)
        if lane.spec:
            logits, row = self.spec.prefill(lane, a, b)
        else:
            logits = self.runner.prefill(lane, a, b)
        lane.num_computed = b
        if turn or anchor or b in ring:
            self.tiers.checkpoint(lane, b, turn, anchor, mtp_row=row)
        if publish:
            self.tiers.publish(lane, publish, mtp_row=row)
        done = b >= lane.prompt_len
        sampled = self.runner.sample([lane], logits)[0] if done else None
        t1 = time.monotonic()
        lane.prefill_compute_s += t1 - t0
        self.bus.emit_threadsafe(ev.RequestPrefillChunk(request_id=req.request_id, lane=lane.id,
                                                        tokens=b - a, done_tokens=b,
                                                        prompt_tokens=lane.prompt_len,
                                                        duration_s=t1 - t0,
                                                        prefill_lanes=list(turns or (lane.id,)),
                                                        prefill_queued=list(queued)))
        if done:
            lane.first_token_t = t1
            self.bus.emit_threadsafe(ev.RequestFirstToken(request_id=req.request_id, lane=lane.id,
                                                          ttft_s=t1 - req.received_t))
            self.output.commit(lane, sampled, t1)

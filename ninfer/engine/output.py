"""Committing a lane's chosen tokens: detokenizing, stop tokens and stop strings, the thinking
budget, output limits, and the request's end (finished, failed or refused).

Each committed token becomes one ``TokenOutput`` for the requester (text held back while it
may be the start of a stop string); the request's end becomes a ``FinalOutput`` or an
``ErrorOutput`` and its ``request.finished`` / ``request.failed`` event, and its lane is
released (``LanePool.release``).
"""
from __future__ import annotations

from ..events import schema as ev
from .lanes import Lane, LanePool
from .outbox import Outbox
from .requests import ErrorOutput, FinalOutput, Request, TokenOutput


def find_stop(text: str, stops) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string in ``text`` (the longest of those that
    start there), or None."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i, -len(s)) < (best[0], -len(best[1]))):
            best = (i, s)
    return best


def stop_prefix_len(text: str, stops) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class Output:
    """Turns committed tokens into outputs and events (execution thread only).

    Args:
        lanes: the LanePool (a request's end releases its lane).
        tokenizer: stop ids.
        bus: EventBus (``emit_threadsafe``).
        outbox: where outputs go.
        max_context: tokens per lane (a request ends at ``context_capacity``).
    """

    def __init__(self, lanes: LanePool, tokenizer, bus, outbox: Outbox, max_context: int):
        self.lanes, self.tokenizer, self.bus = lanes, tokenizer, bus
        self.outbox = outbox
        self.max_context = max_context

    def commit(self, lane: Lane, sampled: tuple, now: float) -> None:
        """Append the chosen ``(token, logprobs)`` to ``lane``'s request and deliver it; ends
        the request at a stop token, a stop string or a limit."""
        req = lane.req
        token, lp = sampled
        if lane.thinking and lane.think_tokens >= req.think_budget:
            token, lp = req.think_end_id, None  # budget spent: close the thinking block
        lane.tokens.append(token)
        if lane.counts is not None:
            lane.counts[token] += 1
            lane.seen[token] = True
        extra = {}
        if lp is not None:
            extra = {"logprob": lp[0], "top_logprobs": tuple(lp[1])}
        lane.generated += 1
        lane.last_token_t = now
        index = lane.generated - 1
        if not req.ignore_eos and token in self.tokenizer.stop_ids:
            self.finish(lane, "stop_token", now)
            return
        if lane.thinking:
            if token == req.think_end_id:  # the boundary token itself is not text
                lane.thinking = False
                tail = lane.detok.flush().rstrip("\ufffd")
                self.outbox.post(req.deliver, TokenOutput(token, tail, index, reasoning=True,
                                                          **extra))
            else:
                lane.think_tokens += 1
                self.outbox.post(req.deliver, TokenOutput(token, lane.detok.push(token), index,
                                                          reasoning=True, **extra))
            self._check_limits(lane, now)
            return
        text = lane.held + lane.detok.push(token)
        lane.held = ""
        if req.stop:
            hit = find_stop(text, req.stop)
            if hit is not None:
                self.outbox.post(req.deliver, TokenOutput(token, text[:hit[0]], index, **extra))
                self.finish(lane, "stop_string", now, flush=False, stop=hit[1])
                return
            keep = stop_prefix_len(text, req.stop)
            if keep:
                text, lane.held = text[:-keep], text[-keep:]
        self.outbox.post(req.deliver, TokenOutput(token, text, index, **extra))
        self._check_limits(lane, now)

    def _check_limits(self, lane: Lane, now: float) -> None:
        if lane.generated >= lane.req.max_tokens:
            self.finish(lane, "output_limit", now)
        elif len(lane.tokens) >= self.max_context:
            self.finish(lane, "context_capacity", now)

    def finish(self, lane: Lane, reason: str, now: float, flush: bool = True,
               stop: str | None = None) -> None:
        """End ``lane``'s request normally (``stop``: the stop string that ended it); the lane
        keeps its prefix."""
        req = lane.req
        tail = ""
        if flush:
            # an output cut inside a multi-byte character ends before it (never U+FFFD)
            tail = lane.held + lane.detok.flush().rstrip("\ufffd")
            if req.stop and not lane.thinking:
                hit = find_stop(tail, req.stop)
                if hit is not None:
                    (cut, stop), reason = hit, "stop_string"
                    tail = tail[:cut]
        timings = ev.Timings(queue_s=lane.admitted_t - req.received_t,
                             prefill_s=lane.first_token_t - lane.admitted_t,
                             decode_s=now - lane.first_token_t,
                             ttft_s=lane.first_token_t - req.received_t,
                             total_s=now - req.received_t,
                             prefill_compute_s=lane.prefill_compute_s)
        tdict = {k: getattr(timings, k) for k in timings.__slots__}
        finish = "stop" if reason in ("stop_token", "stop_string", "tool_calls") else "length"
        out = FinalOutput(finish, reason, tail, lane.id, lane.prompt_len, lane.cached,
                          lane.generated,
                          tdict, text_is_reasoning=lane.thinking, draft_n=lane.draft_n,
                          draft_n_accepted=lane.draft_n_accepted,
                          stop_string=stop,
                          cache_write_tokens=max(0, lane.published - lane.cached))
        self.bus.emit_threadsafe(ev.RequestFinished(request_id=req.request_id, lane=lane.id,
                                                    finish_reason=reason,
                                                    prompt_tokens=lane.prompt_len,
                                                    cached_tokens=lane.cached,
                                                    completion_tokens=lane.generated, timings=tdict,
                                                    draft_n=lane.draft_n,
                                                    draft_n_accepted=lane.draft_n_accepted))
        self.lanes.release(lane, retain=True)
        self.outbox.post(req.deliver, out)

    def fail(self, lane: Lane, code: str, message: str) -> None:
        """End ``lane``'s request with error ``code``; the lane keeps nothing."""
        req = lane.req
        self.bus.emit_threadsafe(ev.RequestFailed(request_id=req.request_id, lane=lane.id,
                                                  code=code, message=message,
                                                  completion_tokens=lane.generated))
        self.lanes.release(lane)
        self.outbox.post(req.deliver, ErrorOutput(code, message))

    def refuse(self, req: Request, code: str, message: str) -> None:
        """Fail a request that holds no lane: ``request.failed`` and its error delivered."""
        self.bus.emit_threadsafe(ev.RequestFailed(request_id=req.request_id, lane=-1, code=code,
                                                  message=message, completion_tokens=0))
        self.outbox.post(req.deliver, ErrorOutput(code, message))

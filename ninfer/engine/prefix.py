"""Prefix reuse policy, as pure functions of the lanes and the prompt: how many prompt tokens
a lane's retained prefix saves, which free lane a request takes, which turn checkpoint it
resumes at (serving contract §1.7). Nothing here changes a lane.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from . import checkpoints
from .continuation import best_prefix, reusable_depth
from .lanes import Checkpoint, Lane


def routing_key(prompt_cache_key: str | None) -> str:
    """The engine's form of a ``prompt_cache_key``: a 16-hex BLAKE2b digest ("" for None), so
    the raw key never reaches the lanes, the events or the logs."""
    if not prompt_cache_key:
        return ""
    return hashlib.blake2b(prompt_cache_key.encode(), digest_size=8,
                           person=b"ninfer-pck").hexdigest()


@dataclass(frozen=True, slots=True)
class ReusePolicy:
    """The reuse rules of one engine (``EngineConfig`` and the model's kind).

    ``recurrent``: hybrid model (recurrent state reused only at exact frontiers and turn
    checkpoints); ``min_restore_tokens``: the least depth worth a checkpoint rewind or a
    restore; ``horizon_tokens``: the depth cost's scale (``cost``)."""
    prefix_reuse: bool
    recurrent: bool
    page_size: int
    min_restore_tokens: int
    horizon_tokens: int = 8192

    def cost(self, a: int, b: int) -> float:
        """Recompute cost of positions ``a .. b-1`` in tokens: position p costs
        ``1 + p / horizon_tokens`` (its matmuls plus attention over the p before it)."""
        if b <= a:
            return 0.0
        return (b - a) + (b * (b - 1) - a * (a - 1)) / (2 * self.horizon_tokens)

    def depth(self, lane: Lane, prompt: np.ndarray, spec: bool) -> int:
        """Prompt tokens ``lane``'s retained prefix saves recomputing (0: none).

        At least the prompt's last token is always recomputed (its logits give the first
        output). Attention-only models reuse the longest common prefix (KV can be cut back to
        any position); hybrid models and speculative lanes only their exact frontier (the
        recurrent state and the MTP head's pending rows cannot be rewound)."""
        if not lane.retained or not self.prefix_reuse:
            return 0
        depth = 0
        if not spec or lane.mtp_pending is not None:   # (else the MTP head's KV lacks it)
            depth = reusable_depth(np.asarray(lane.tokens[:lane.num_computed], dtype=np.int64),
                                   prompt, len(prompt) - 1, self.recurrent or spec)
        if depth == 0 and self.recurrent:
            # the deepest rewind point of the recurrent state below the frontier (the turn
            # checkpoint, the anchor, the ring) still inside the prompt's shared prefix; a
            # speculative lane's must carry the MTP row to resume from
            common = reusable_depth(np.asarray(lane.tokens[:lane.num_computed],
                                               dtype=np.int64), prompt, len(prompt) - 1, False)
            hit = checkpoints.deepest(lane, common, max(1, self.min_restore_tokens), spec)
            depth = 0 if hit is None else hit[1].depth
        return depth

    def depths(self, lanes: list[Lane], prompt: np.ndarray, spec: bool) -> dict[int, int]:
        """``depth`` of each of ``lanes``, by lane id."""
        return {ln.id: self.depth(ln, prompt, spec) for ln in lanes}

    def own(self, lane: Lane, depth: int, key: str, weak: bool = False) -> bool:
        """The request's own session (the lane's last request had the same session key),
        sharing more than a chat-template header with the prompt. ``weak``: a key inferred
        from the conversation's root (not named by the client): only when the cut stays
        within the lane's latest turn (what its last request added past the prefix it
        reused), or the prompt carries at least that much more of the lane's history than
        the request that opened the session there (``Lane.opened``: a later turn, which a
        stranger whose first message happens to match does not have)."""
        least = max(self.page_size, self.min_restore_tokens)
        if not (key and lane.retained and lane.cache_key == key and depth >= least):
            return False
        return not weak or depth >= lane.cached or 0 < lane.opened <= depth - least

    def choose(self, free: list[Lane], depth: dict, n_prompt: int = 0, key: str = "",
               weak: bool = False) -> Lane:
        """The free lane a request takes, given the prompt tokens each would reuse.

        While an empty lane is free, a retained session is taken only when the request keeps
        (nearly) all of it: it extends the session, or cuts back at most a page or 1/16 of the
        reused depth (a re-rendered tail: retokenization, a rewritten last message). Otherwise
        sessions that merely share a header (a long system prompt, the tool list) would keep
        cutting each other back to it while lanes stand empty. A hybrid lane's turn checkpoint
        counts as kept: the request carries that session's whole history, and so does a session
        served under the request's session key (``own``; its loss does not count). With no
        empty lane, some session must go: the most recompute cost saved net of the cost of
        the retained tokens destroyed (``cost``: deeper positions cost more). Ties go to the
        request's own session, then an empty lane, then the shallowest retained prefix, then
        the longest idle."""
        def own(ln: Lane) -> bool:
            return self.own(ln, depth[ln.id], key, weak)

        def loss(ln: Lane) -> int:
            return 0 if own(ln) else ln.num_computed - depth[ln.id]

        if any(not ln.retained for ln in free):
            keep = [ln for ln in free if not ln.retained or own(ln) or (
                depth[ln.id] > 0 and loss(ln) <= max(self.page_size, depth[ln.id] // 16))
                or at_checkpoint(ln, depth[ln.id], n_prompt)]
            return max(keep, key=lambda ln: (depth[ln.id], own(ln), not ln.retained,
                                             -ln.num_computed, -ln.retained_t))

        def net(ln: Lane) -> float:   # recompute saved less recompute destroyed
            lost = 0.0 if own(ln) else self.cost(depth[ln.id], ln.num_computed)
            return self.cost(0, depth[ln.id]) - lost

        return max(free, key=lambda ln: (net(ln), own(ln), -ln.num_computed, -ln.retained_t))


def shared_prefix(lanes: list[Lane], prompt: np.ndarray) -> int:
    """The longest prefix of ``prompt`` any of ``lanes`` retains, reusable or not (where the
    first divergent token is; ``cache.lookup``'s ``shared_tokens``)."""
    held = ((ln, np.asarray(ln.tokens[:ln.num_computed], dtype=np.int64))
            for ln in lanes if ln.retained)
    return best_prefix(held, prompt, len(prompt), exact=False)[1]


def at_checkpoint(lane: Lane, d: int, n_prompt: int) -> bool:
    """The request resumes ``lane``'s session at a turn checkpoint (reusing ``d`` tokens)
    rather than merely sharing a header with it: at the latest request's checkpoint (the next
    turn of that request), or at the user-turn anchor or a ring entry with a prompt that
    carries at least half of what the lane holds past it (the turns since, their thinking
    dropped, or an older message edited)."""
    if d <= 0:
        return False
    if lane.ckpt is not None and d == lane.ckpt.depth and \
            lane.ckpt.request_id == lane.last_request:
        return True
    return any(c.depth == d for role, c in checkpoints.points(lane) if role != "turn") and \
        n_prompt - d >= (lane.num_computed - d) // 2


def rewind_point(lane: Lane, depth: int, spec: bool = False) -> tuple[str, Checkpoint] | None:
    """The rewind point a reuse of ``depth`` tokens below ``lane``'s frontier goes back to
    (its recurrent state is restored there) with its role (``turn`` / ``anchor`` / ``ring``),
    or None (``spec``: only one with the MTP row a speculative lane resumes from)."""
    if not 0 < depth < lane.num_computed:
        return None
    return checkpoints.role_at(lane, depth, spec)


def reuse_path(prefix_reuse: bool, depth: int, frontier: int) -> str:
    """``cache.lookup``'s path for a reuse of ``depth`` tokens of a lane at ``frontier``."""
    if not prefix_reuse:
        return "disabled"
    if depth == 0:
        return "full_reset"
    return "append_frontier" if depth == frontier else "truncate_frontier"

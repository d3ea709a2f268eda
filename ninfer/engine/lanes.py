"""Lanes and the page pool: which request each lane serves, which KV pages it holds, and what
it keeps for prefix reuse once idle.

Every change to a lane's computed prefix goes through ``LanePool.reset`` (cut back to a depth,
0: to nothing), so assign, release, truncate, evict, erase and a failed restore leave the same
fields in the same state. The tiers (L2 demotion, L3 persistence) hook in through ``demote``
and ``persist``, the auto-save (``autosave.py``) through ``spill``.
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..events import schema as ev
from . import checkpoints
from .checkpoints import Checkpoint  # noqa: F401  (lanes' rewind points, re-exported)
from .kv import PagePool
from .requests import Request
from .tokenizer import IncrementalDetokenizer


@dataclass(frozen=True, slots=True)
class MtpRows:
    """The main model's hidden rows of positions ``start ..`` that the MTP head has not seen
    yet (``speculative.py``); ``drafts``: the next round's drafts, where a device round
    already made them from these rows."""
    start: int
    hidden: object
    drafts: tuple | None = None


@dataclass(slots=True)
class Lane:
    """One slot of the batch: the request it serves and the KV pages it holds."""
    id: int
    req: Request | None = None
    pages: list = field(default_factory=list)       # block table (page ids)
    tokens: list = field(default_factory=list)      # prompt + generated
    prompt_len: int = 0
    num_computed: int = 0                           # tokens whose K/V are in the cache
    generated: int = 0
    detok: IncrementalDetokenizer | None = None
    held: str = ""                                  # text held back (possible stop prefix)
    thinking: bool = False                          # inside the thinking block
    think_tokens: int = 0                           # reasoning tokens generated so far
    counts: np.ndarray | None = None                # (V,) int32 output counts (penalties)
    seen: np.ndarray | None = None                  # (V,) bool prompt+output (repetition)
    admitted_t: float = 0.0
    first_token_t: float = 0.0
    last_token_t: float = 0.0
    prefill_compute_s: float = 0.0                  # its prefill chunks' forward passes
    cached: int = 0                                 # prompt tokens reused (prefix reuse)
    opened: int = 0                                 # prompt length of the session's first
    #                                                 request here (0: unknown, a restore)
    persisted: int = 0                              # frontier last queued for L3
    retained_t: float = 0.0                         # when an idle lane kept its prefix
    spec: bool = False                              # decoded speculatively (speculative.py)
    ahead: int = 0                                  # launched rounds ahead not committed yet
    mtp_pending: MtpRows | None = None              # rows waiting for the MTP head
    draft_n: int = 0                                # MTP tokens drafted / accepted
    draft_n_accepted: int = 0
    # hybrid models: the latest request's turn checkpoint, the one taken where the
    # current user turn began (the anchor) and past turn checkpoints, oldest first (the ring,
    # --turn-checkpoints; checkpoints.py)
    ckpt: Checkpoint | None = None
    anchor: Checkpoint | None = None
    ring: list = field(default_factory=list)
    last_request: str = ""                          # the id of the lane's latest request
    cache_key: str = ""                             # its session key ("" without one)
    published: int = 0                              # deepest breakpoint its request published
    # the slot file its session was last saved to or restored from ("": none); an
    # involuntary loss spills the session there (--auto-save-evicted)
    slot_file: str = ""

    @property
    def prefilling(self) -> bool:
        return self.req is not None and self.num_computed < self.prompt_len

    @property
    def decode_ready(self) -> bool:
        return self.req is not None and self.num_computed >= self.prompt_len

    @property
    def retained(self) -> bool:
        """Idle, and holding a computed prefix (``tokens[:num_computed]``) for reuse."""
        return self.req is None and self.num_computed > 0


def session_digest(tokens) -> str:
    """Opaque 16-hex digest of a token ledger (BLAKE2b-64 of the int32 ids): equal ledgers
    give equal digests, so clients can tell whether a lane still holds their session."""
    data = np.asarray(tokens, dtype="<i4").tobytes()  # little-endian int32 on every host
    return hashlib.blake2b(data, digest_size=8).hexdigest()


class LanePool:
    """The lanes and the KV page pool they draw from; owned by the execution thread.

    Args:
        kv: the model's KV cache (``reset_state`` on hybrid models).
        bus: EventBus for ``lane.*`` events.
        num_lanes, num_pages, page_size: sizing (``EngineConfig``).
        recurrent: hybrid model (a lane's recurrent state slot is reset with its prefix).
        prefix_reuse: a released lane may keep its computed prefix.
    """

    def __init__(self, kv, bus, num_lanes: int, num_pages: int, page_size: int,
                 recurrent: bool, prefix_reuse: bool):
        self.kv, self.bus = kv, bus
        self.page_size = page_size
        self.recurrent = recurrent
        self.prefix_reuse = prefix_reuse
        self.ledger_events = False   # EngineConfig.ledger_events (set by the engine)
        self.pages = PagePool(num_pages)
        self.lanes = [Lane(i) for i in range(num_lanes)]
        # tier hooks (tiers.py): copy a prefix to L2 before a lane loses it; queue it for L3
        self.demote: Callable[[Lane], None] = lambda lane: None
        self.persist: Callable[[Lane], None] = lambda lane: None
        # auto-save hook (autosave.py): write a bound session to its slot file before a lane
        # loses it involuntarily (the reason, as lane.evicted's)
        self.spill: Callable[[Lane, str], None] = lambda lane, reason: None

    def free_lanes(self) -> list[Lane]:
        return [ln for ln in self.lanes if ln.req is None]

    def lane_of(self, request_id: str) -> Lane | None:
        """The lane running ``request_id``, or None."""
        return next((ln for ln in self.lanes
                     if ln.req is not None and ln.req.request_id == request_id), None)

    def ensure_pages(self, lane: Lane, n_tokens: int) -> None:
        """Give ``lane`` the pages to hold ``n_tokens`` positions.

        Raises:
            OutOfPages: the pool is short (the lane keeps what it had).
        """
        need = math.ceil(n_tokens / self.page_size) - len(lane.pages)
        if need > 0:
            lane.pages.extend(self.pages.allocate(need))

    def take_pages(self, lane: Lane, n_tokens: int) -> None:
        """Give an empty lane fresh pages for ``n_tokens`` positions (a restore)."""
        lane.pages = self.pages.allocate(math.ceil(n_tokens / self.page_size))

    def reset(self, lane: Lane, depth: int = 0) -> int:
        """Cut ``lane``'s computed prefix back to ``depth`` tokens: pages past it return to the
        pool, the ledger, turn checkpoints and L3 mark past it are dropped, the MTP rows when
        anything computed is dropped, and at 0 the recurrent state. Returns the pages freed."""
        keep = math.ceil(depth / self.page_size)
        extra = lane.pages[keep:]
        if extra:
            self.pages.free(extra)
        del lane.pages[keep:]
        del lane.tokens[depth:]
        if depth < lane.num_computed or depth == 0:
            lane.mtp_pending = None
        lane.num_computed = depth
        lane.persisted = min(lane.persisted, depth)
        checkpoints.drop_past(lane, depth)
        if depth == 0:
            lane.opened = 0
            if self.recurrent:
                self.kv.reset_state(lane.id)
        return len(extra)

    def load(self, lane: Lane, tokens, persisted: int, marks=None, ring_size: int = 0) -> None:
        """``lane`` now holds ``tokens`` (just imported into its pages from an image): an idle
        session of its own, with no MTP rows and the image's checkpoint ``marks`` at most that
        deep (``checkpoints.from_marks``); ``persisted``: the frontier L3 already holds."""
        lane.tokens = [int(t) for t in tokens]
        lane.num_computed = len(lane.tokens)
        lane.mtp_pending = None
        checkpoints.from_marks(lane, marks, lane.num_computed, ring_size)
        lane.persisted = persisted
        lane.retained_t, lane.cache_key, lane.last_request = time.monotonic(), "", ""
        lane.slot_file, lane.opened = "", 0

    def assign(self, lane: Lane, req: Request, tokenizer, vocab: int, spec: bool,
               depth: int, now: float) -> None:
        """Bind ``req`` to ``lane`` at ``now``, whose first ``depth`` tokens are already
        computed (the caller cut it there): fresh per-request state, penalty counts when
        penalized (``vocab`` ids)."""
        lane.req = req
        lane.last_request, lane.cache_key = req.request_id, req.cache_key
        lane.tokens = list(req.prompt_ids)
        lane.prompt_len = len(req.prompt_ids)
        lane.num_computed = lane.cached = depth
        lane.generated = lane.published = 0
        lane.detok = IncrementalDetokenizer(tokenizer)
        lane.held = ""
        lane.thinking, lane.think_tokens = req.think_budget is not None, 0
        lane.counts = lane.seen = None
        if req.params.penalized:
            lane.counts = np.zeros(vocab, dtype=np.int32)
            lane.seen = np.zeros(vocab, dtype=bool)
            lane.seen[np.asarray(req.prompt_ids, dtype=np.int64)] = True
        lane.admitted_t = now
        lane.first_token_t = lane.last_token_t = lane.prefill_compute_s = 0.0
        lane.spec = spec
        lane.draft_n, lane.draft_n_accepted = 0, 0

    def release(self, lane: Lane, retain: bool = False) -> None:
        """End ``lane``'s request. With ``retain`` (and prefix reuse on) the lane keeps the
        KV of its computed positions, those whose tokens it knows, for the next request;
        otherwise every page returns to the pool."""
        rid = lane.req.request_id if lane.req else ""
        lane.req = None
        lane.detok = None
        n = lane.num_computed
        if self.recurrent:
            # a round launched ahead has fed the lane's last token into its state, which
            # cannot be cut back: the lane holds that position too
            n += lane.ahead
        # a speculative run that finished mid-way computed positions it never committed
        if retain and self.prefix_reuse and 0 < n <= len(lane.tokens):
            freed = self.reset(lane, n)
            lane.retained_t = time.monotonic()
            self.retained(lane, rid, freed)
            self.persist(lane)
            return
        freed = self.reset(lane, 0)
        lane.slot_file = ""   # (a failed request's lane holds nothing consistent to spill)
        self.bus.emit_threadsafe(ev.LaneReleased(lane=lane.id, request_id=rid, pages_freed=freed,
                                                 free_pages=self.pages.num_free))

    def retained(self, lane: Lane, request_id: str, pages_freed: int) -> None:
        """``lane.retained``: the lane now holds ``lane.tokens`` (and its turn checkpoints)."""
        ck = lane.ckpt.depth if lane.ckpt is not None else 0
        an = lane.anchor.depth if lane.anchor is not None else 0
        self.bus.emit_threadsafe(ev.LaneRetained(
            lane=lane.id, request_id=request_id, tokens=lane.num_computed, pages=len(lane.pages),
            pages_freed=pages_freed,
            free_pages=self.pages.num_free, session_digest=session_digest(lane.tokens),
            checkpoint_tokens=ck,
            checkpoint_digest=session_digest(lane.tokens[:ck]) if ck else "", anchor_tokens=an,
            anchor_digest=session_digest(lane.tokens[:an]) if an else "",
            ring_tokens=[c.depth for c in lane.ring],
            token_ids=[int(t) for t in lane.tokens[:lane.num_computed]] if self.ledger_events
            else []))

    def evict(self, lane: Lane, reason: str) -> None:
        """Drop an idle lane's retained prefix (spilled to its slot file and demoted to L2
        first, when there are those); its pages return to the pool."""
        self.spill(lane, reason)
        lane.slot_file = ""
        self.demote(lane)
        n = lane.num_computed
        freed = self.reset(lane, 0)
        self.bus.emit_threadsafe(ev.LaneEvicted(lane=lane.id, tokens=n, pages_freed=freed,
                                                free_pages=self.pages.num_free, reason=reason))

    def erase(self, lane: Lane) -> int:
        """Drop an idle lane's retained prefix without demoting it (a slot erase); returns the
        tokens it held."""
        n = lane.num_computed
        lane.slot_file = ""   # an explicit erase never auto-saves
        if lane.retained:
            freed = self.reset(lane, 0)
            self.bus.emit_threadsafe(ev.LaneEvicted(lane=lane.id, tokens=n, pages_freed=freed,
                                                    free_pages=self.pages.num_free,
                                                    reason="erased"))
        return n

    def truncate(self, lane: Lane, depth: int, continues: bool = False) -> None:
        """Cut an idle lane's retained prefix back to ``depth`` tokens (attention-only, or a
        hybrid lane back to its turn checkpoint, whose state the caller restores). The whole
        prefix is demoted to L2 first when the cut drops a page or more, unless the request
        cutting it ``continues`` the lane's session and keeps at least half of it (an edit or
        a regenerated answer abandons the old branch: as llama-server, which saves a slot to
        its prompt cache only when another prompt takes it). Unless the request ``continues``
        the session, a session bound to a slot file is spilled there first and the binding
        ends."""
        if not continues:
            self.spill(lane, "truncated")
            lane.slot_file = ""
        if lane.num_computed - depth >= self.page_size and \
                not (continues and 2 * depth >= lane.num_computed):
            self.demote(lane)
        dropped = lane.num_computed - depth
        freed = self.reset(lane, depth)
        self.bus.emit_threadsafe(ev.LaneEvicted(lane=lane.id, tokens=dropped,
                                                pages_freed=freed,
                                                free_pages=self.pages.num_free, reason="truncated"))

    def check_integrity(self) -> None:
        """Verify page ownership: the pool's free list and the lanes' pages partition every
        page, and an idle lane holds exactly the pages of its retained prefix (none when it
        retains nothing).

        Raises:
            RuntimeError: a leaked, shared or double-counted page, or an idle lane holding
                pages it does not need.
        """
        self.pages.check_integrity()
        held = [p for ln in self.lanes for p in ln.pages]
        if len(set(held)) != len(held):
            raise RuntimeError("a KV page is held by two lanes (or twice by one)")
        total = self.pages.num_pages
        if len(held) + self.pages.num_free != total:
            raise RuntimeError(f"{total - self.pages.num_free - len(held)} "
                               "allocated pages belong to no lane")
        for ln in self.lanes:
            if ln.req is None and len(ln.pages) != math.ceil(ln.num_computed / self.page_size):
                raise RuntimeError(f"idle lane {ln.id} holds {len(ln.pages)} pages for "
                                   f"{ln.num_computed} retained tokens")

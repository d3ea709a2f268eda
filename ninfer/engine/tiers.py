"""The continuation tiers beyond the lanes: L2 host images, the L3 store hand-off,
breakpoint publication and hybrid turn checkpoints (serving contract §4).

A lane's computed prefix leaves the lane as a ``LaneImage``: demoted to L2 when the lane is
about to lose it, queued for L3 when a finished request retained enough new tokens, published
to both at a request's breakpoints (``Request.publish_at``). A later request whose prompt
continues an image is restored from it into a lane instead of prefilling it again.
"""
from __future__ import annotations

import collections
import time

import numpy as np

from ..events import schema as ev
from . import checkpoints
from .continuation import (HostTier, LaneImage, device_like, export_lane, export_state,
                           image_key, import_lane, kv_image_bytes)
from .lanes import Checkpoint, Lane, LanePool, MtpRows, session_digest
from .requests import Request


class Tiers:
    """L2 and L3 for one engine (execution thread only).

    Args:
        kv: the model's KV cache; ops: its backend (host copies of device arrays).
        lanes: the LanePool (restores take pages; tiers hook into its evict and release).
        bus: EventBus for ``cache.*`` / ``store.*`` / ``lane.checkpointed`` events.
        config: EngineConfig (``l2_bytes``, ``prefix_reuse``, ``min_restore_tokens``,
            ``page_size``).
        recurrent: hybrid model (images carry the recurrent state; reuse at exact frontiers).
    """

    def __init__(self, kv, ops, lanes: LanePool, bus, config, recurrent: bool):
        self.kv, self.ops, self.lanes, self.bus = kv, ops, lanes, bus
        self.config = config
        self.recurrent = recurrent
        self.l2 = HostTier(config.l2_bytes, supersede=not recurrent) \
            if config.l2_bytes > 0 and config.prefix_reuse else None
        self.store = None       # L3 ContinuationStore (attach_store)
        self.persister = None
        self.persist_min_tokens = 0
        # keys of breakpoint images every tier refused for their size (publish)
        self.unpublishable: collections.OrderedDict = collections.OrderedDict()
        lanes.demote, lanes.persist = self.demote, self.persist

    def attach_store(self, store, persist_min_tokens: int) -> None:
        """Use ``store`` (``ContinuationStore``) as L3, written by a ``Persister`` thread."""
        from ..store.continuation_store import Persister
        self.store = store
        self.persister = Persister(store, self.bus)
        self.persist_min_tokens = persist_min_tokens
        if getattr(store, "quarantined", None) is not None:   # it opened empty, in its place
            moved_to, reason = store.quarantined
            self.bus.emit_threadsafe(ev.StoreQuarantined(tier="l3", path=store.path,
                                                         moved_to=moved_to, reason=reason))
        self.bus.emit_threadsafe(ev.StoreOpened(
            tier="l3", path=store.path, entries=len(store), bytes=store.nbytes,
            foreign=store.foreign,
            token_ids=store.ledgers() if self.config.ledger_events else []))
        for nbytes, reason in getattr(store, "dropped_at_open", ()):   # (their ledgers unread)
            self.bus.emit_threadsafe(ev.StoreEntryDropped(
                tier="l3", tokens=0, bytes=nbytes, reason=reason, entries=len(store),
                store_bytes=store.nbytes))

    def close(self) -> None:
        """Write the queued L3 images and close the writer."""
        if self.persister is not None:
            self.persister.close()
            self.persister = None

    def layout_identity(self) -> dict:
        """What a stored image's layout must match to be restored here: the paged KV geometry
        and storage dtype (``KVCache.dtype``: an image of another dtype is a miss, never
        re-encoded) and, on hybrid models, the recurrent state shapes."""
        kv = getattr(self.kv, "kv", self.kv) if self.recurrent else self.kv
        out = {"kv_layers": len(kv.k), "nkv": kv.nkv, "hd": kv.hd, "kv_dtype": kv.dtype,
               "backend": getattr(self.ops, "name", "numpy"), "recurrent": self.recurrent}
        if self.recurrent:
            out["conv"] = [list(a.shape[1:]) for a in self.kv.conv]
            out["ssm"] = [list(a.shape[1:]) for a in self.kv.ssm]
        return out

    @property
    def ring(self) -> int:
        """Past turn checkpoints a hybrid lane keeps (``--turn-checkpoints``; 0: no ring, and
        L2 / L3 images carry no checkpoints)."""
        return self.config.turn_checkpoints if self.recurrent else 0

    def export(self, lane: Lane, depth: int | None = None, marks: bool = False) -> LaneImage:
        """``lane``'s first ``depth`` computed positions (default: all) as an image; with
        ``marks``, also the lane's rewind points below them (``checkpoints.to_marks``).

        Raises:
            ValueError: the recurrent state is not at the ledger's frontier.
        """
        n = lane.num_computed if depth is None else depth
        image = export_lane(self.kv, lane.pages, n, lane.tokens,
                            lane.id if self.recurrent else None)
        if marks and self.recurrent:
            image.checkpoints = checkpoints.to_marks(lane, n, self._host) or None
        rows = lane.mtp_pending
        if rows is not None and n == lane.num_computed and \
                rows.start + int(rows.hidden.shape[0]) == n:
            image.mtp_start, image.mtp_rows = rows.start, self._host(rows.hidden)
        return image

    def _host(self, rows) -> np.ndarray:
        """A host float32 copy of backend hidden rows."""
        return np.array(self.ops.to_numpy(rows), dtype=np.float32)

    def resume_rows(self, lane: Lane, image: LaneImage) -> None:
        """After ``image`` was loaded into ``lane`` (whole, or at one of its checkpoints): the
        MTP rows there become the lane's pending ones (on the model's backend), so that a
        speculative request may continue it."""
        n = lane.num_computed
        if image.mtp_rows is not None and n == image.n:
            lane.mtp_pending = MtpRows(image.mtp_start, device_like(self.kv, image.mtp_rows))
            return
        mark = next((c for c in image.checkpoints or () if c.depth == n), None)
        if mark is not None and mark.mtp_row is not None:
            lane.mtp_pending = MtpRows(n - 1, device_like(self.kv, mark.mtp_row))

    def shared(self, prompt: np.ndarray) -> int:
        """The longest prefix of ``prompt`` an L2 or L3 image holds, reusable or not."""
        d = self.l2.shared(prompt) if self.l2 is not None else 0
        if self.store is not None:
            d = max(d, self.store.best(prompt, len(prompt), exact=False)[1])
        return d

    # -- restore --------------------------------------------------------------------------
    def lookup(self, prompt: np.ndarray, l1_depth: int,
               spec: bool = False) -> tuple[LaneImage | None, int, str]:
        """The deepest image of L2 or L3 that continues ``prompt``: ``(image, depth, tier)``
        (L3 only when it beats ``l1_depth`` and L2, and is at least ``min_restore_tokens``
        deep; loading it may drop a corrupt entry, a safe miss). ``spec``: a speculative
        request, which resumes an image only where it keeps MTP rows (``mtp_marks``)."""
        image, d2, tier = None, 0, "l2"
        if self.l2 is not None:
            image, d2 = self.l2.best(prompt, len(prompt) - 1, exact=self.recurrent, mtp=spec)
        if self.store is not None:
            entry, d3 = self.store.best(prompt, len(prompt) - 1, exact=self.recurrent,
                                        mtp=spec)
            if d3 > max(d2, l1_depth) and d3 >= self.config.min_restore_tokens:
                loaded = self.store.load(entry, on_drop=self._l3_dropped)
                if loaded is not None:
                    image, d2, tier = loaded, d3, "l3"
        return image, d2, tier

    def _l3_dropped(self, entry, reason: str) -> None:
        """``ContinuationStore.load``'s ``on_drop``: a corrupt entry was deleted."""
        self.bus.emit_threadsafe(ev.StoreEntryDropped(
            tier="l3", tokens=int(entry.tokens.size), bytes=entry.nbytes, reason=reason,
            entries=len(self.store),
            store_bytes=self.store.nbytes, session_digest=session_digest(entry.tokens)))

    def restore(self, lane: Lane, req: Request, image: LaneImage, depth: int,
                tier: str = "l2") -> bool:
        """Load ``image``'s first ``depth`` positions into ``lane`` (whose own retained prefix,
        if any, is demoted first); the lane then retains exactly that prefix. False when the
        image does not fit this cache (the lane is left empty: a cold prefill, never a crash)."""
        t0 = time.monotonic()
        if lane.retained:
            self.lanes.evict(lane, "reassigned")
        self.lanes.take_pages(lane, depth)
        try:
            import_lane(self.kv, image, depth, lane.pages, lane.id if self.recurrent else None)
        except (ValueError, IndexError) as exc:
            self.lanes.reset(lane, 0)
            self.bus.emit_threadsafe(ev.CacheRestoreRefused(request_id=req.request_id,
                                                            lane=lane.id, tier=tier,
                                                            tokens=depth, error=str(exc)))
            return False
        self.lanes.load(lane, image.tokens[:depth], depth if tier == "l3" else 0,
                        image.checkpoints, self.ring)
        self.resume_rows(lane, image)
        # the bytes copied: the whole image, or the K / V of its first ``depth`` positions
        copied = image.nbytes if depth == image.n else \
            (image.k.nbytes + image.v.nbytes) * depth // image.n
        self.bus.emit_threadsafe(ev.CacheRestored(request_id=req.request_id, lane=lane.id,
                                                  tier=tier, tokens=depth,
                                                  bytes=copied, duration_s=time.monotonic() - t0))
        return True

    # -- demotion and persistence ---------------------------------------------------------
    def persist(self, lane: Lane) -> None:
        """Queue a just-retained prefix for L3 (long enough, not stored yet)."""
        n = lane.num_computed
        # due when the session grew by persist_min_tokens since the lane last queued one
        if self.persister is None or n - lane.persisted < max(self.persist_min_tokens, 1):
            return
        held = self.store.catalog.get(self.store.key_of(np.asarray(lane.tokens[:n])))
        if held is not None and (held.mtp or lane.mtp_pending is None):
            return
        try:
            image = self.export(lane, marks=self.ring > 0)
        except ValueError:  # state not at the ledger's frontier: nothing consistent to keep
            return
        if self.persister.submit(image, lane.cache_key):
            lane.persisted = n

    def demote(self, lane: Lane) -> None:
        """Copy an idle lane's retained prefix to L2 before the lane loses it (a prefix
        shorter than a page is not worth an image)."""
        n = lane.num_computed
        if self.l2 is None or n < self.config.page_size:
            return
        nbytes = kv_image_bytes(self.kv, n)
        admitted = nbytes <= self.l2.budget_bytes   # else refused whatever its state adds:
        if admitted:                                 # not copied out
            try:
                image = self.export(lane, marks=self.ring > 0)
            except ValueError:
                return
            admitted, evicted, superseded = self.l2.put(image, lane.cache_key)
            self._l2_evicted(evicted, superseded)
            nbytes = image.nbytes
        self.bus.emit_threadsafe(ev.CacheDemoted(lane=lane.id, tier="l2", tokens=n,
                                                 bytes=nbytes, admitted=admitted,
                                                 entries=len(self.l2), tier_bytes=self.l2.nbytes))

    def _l2_evicted(self, evicted: list, superseded: list) -> None:
        """``cache.evicted`` for the images an L2 admission dropped."""
        for reason, images in (("capacity", evicted), ("superseded", superseded)):
            for old in images:
                self.bus.emit_threadsafe(ev.CacheEvicted(tier="l2", tokens=old.n, bytes=old.nbytes,
                                                         reason=reason,
                                                         entries=len(self.l2),
                                                         tier_bytes=self.l2.nbytes,
                                                         session_digest=session_digest(old.tokens)))

    # -- publication ----------------------------------------------------------------------
    @property
    def publishes(self) -> bool:
        """Whether prompt-cache breakpoints can publish anything: prefix reuse on and an L2 or
        L3 tier in use (``Request.publish_at`` is ignored otherwise)."""
        return self.config.prefix_reuse and (self.l2 is not None or self.persister is not None)

    def publish_depth(self, lane: Lane, a: int, b: int) -> int | None:
        """The nearest of the request's breakpoints (``Request.publish_at``) in (a, b] that
        this chunk should stop at to publish, or None: only with a tier to publish to, prefix
        reuse on, a depth of at least ``min_restore_tokens`` below the prompt's end, not held
        by every tier already (or refused by all, ``holds``)."""
        if not self.publishes:
            return None
        for d in sorted(lane.req.publish_at):
            if a < d <= b and self.unpublished(lane, d):
                return d
        return None

    def unpublished(self, lane: Lane, d: int) -> bool:
        """Whether depth ``d`` of ``lane``'s prompt is worth publishing: below the prompt's end,
        at least ``min_restore_tokens`` deep, and not held (or refused) by every tier (a
        speculative lane's: held with MTP rows)."""
        return d < lane.prompt_len and d >= max(self.config.min_restore_tokens, 1) and \
            not all(self.holds(lane.tokens[:d], mtp=lane.spec))

    def holds(self, tokens, mtp: bool = False) -> tuple[bool, bool]:
        """Whether L2 and L3 (each True when absent) hold an image of ledger ``tokens`` (with
        ``mtp``: one with MTP rows), or cannot take it (an earlier copy was refused by every
        tier for its size: never copied out again)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        key = image_key(tokens)
        if key in self.unpublishable:
            return True, True
        entry = None if self.persister is None else self.store.catalog.get(
            self.store.key_of(tokens))
        return (self.l2 is None or self.l2.holds(key, mtp),
                self.persister is None or (entry is not None and (entry.mtp or not mtp)))

    def publish(self, lane: Lane, depth: int, mtp_row=None) -> None:
        """Publish the lane's prefix ``tokens[:depth]`` (its frontier now) as an image to L2
        and L3, skipping the tiers that already hold it (``cache.published``); an image
        larger than L2's budget and half of L3's quota (what L3 refuses) is remembered as
        unpublishable. ``mtp_row``: a speculative lane's hidden row at ``depth - 1`` (its MTP
        head's KV holds the positions before): the image's MTP row, which a speculative
        request resuming it pairs with its own next token."""
        in_l2, in_l3 = self.holds(lane.tokens[:depth], mtp=mtp_row is not None)
        t0 = time.monotonic()
        try:
            image = self.export(lane, depth)
        except ValueError:  # state not at the ledger's frontier: nothing consistent to keep
            return
        if mtp_row is not None:
            image.mtp_start = depth - 1
            image.mtp_rows = self._host(mtp_row)
        tiers, too_big = [], True
        if not in_l2:
            admitted, evicted, superseded = self.l2.put(image)
            self._l2_evicted(evicted, superseded)
            if admitted:
                tiers.append("l2")
            too_big = not admitted
        if not in_l3:
            fits = image.nbytes <= self.store.quota_bytes // 2   # what ContinuationStore takes
            too_big = too_big and not fits
            if fits and self.persister.submit(image):
                tiers.append("l3")   # queued (store.persisted when durable)
        if tiers:
            lane.published = max(lane.published, depth)
        elif too_big:
            self.unpublishable[image.key] = None
            while len(self.unpublishable) > 256:
                self.unpublishable.popitem(last=False)
        self.bus.emit_threadsafe(ev.CachePublished(
            request_id=lane.req.request_id, lane=lane.id, tokens=depth, bytes=image.nbytes,
            tiers=tiers,
            session_digest=session_digest(lane.tokens[:depth]), duration_s=time.monotonic() - t0,
            l2_entries=len(self.l2) if self.l2 is not None else 0,
            l2_bytes=self.l2.nbytes if self.l2 is not None else 0,
            token_ids=[int(t) for t in lane.tokens[:depth]] if self.config.ledger_events else []))

    def checkpoint(self, lane: Lane, depth: int, turn: bool = True, anchor: bool = False,
                   mtp_row=None) -> None:
        """Copy the lane's recurrent state (at frontier ``depth``) aside as its turn
        checkpoint (``turn``: the previous one joins the ring), its user-turn anchor, or
        (neither) a ring entry (a message boundary); ``mtp_row``: a speculative lane's hidden
        row at ``depth - 1``."""
        conv, ssm = export_state(self.kv, lane.id, depth)
        ck = Checkpoint(depth, conv, ssm, lane.req.request_id, mtp_row)
        if turn:
            checkpoints.push(lane, ck, self.ring, anchor)
        elif anchor:
            lane.anchor = ck
        else:
            checkpoints.to_ring(lane, ck, self.ring)
        self.bus.emit_threadsafe(ev.LaneCheckpointed(
            lane=lane.id, request_id=lane.req.request_id, tokens=depth,
            bytes=sum(a.nbytes for a in conv + ssm),
            session_digest=session_digest(lane.tokens[:depth])))

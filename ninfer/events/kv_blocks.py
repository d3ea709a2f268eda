"""KV-cache events in vLLM's format, folded from ninfer's own cache records.

A cache-aware gateway with an event-driven index (vLLM's ``KVEventBatch`` stream, read by
vllm-router's ``kv_aware`` policy, NVIDIA Dynamo's KV router, llm-d and others) learns which replica holds which prefix from three
events: ``BlockStored`` (a run of blocks: their hashes, the hash of the block before them,
their token ids, the block size, the medium that holds them), ``BlockRemoved`` (hashes no
longer held in a medium) and ``AllBlocksCleared``. ``KvBlockIndex`` turns the log's lane, tier
and store records into those events; ``kv_publisher`` encodes and publishes them.

- A block is one KV page (``--page-size`` tokens); only full pages are blocks. Its hash chains
  the previous block's: ``block_hash`` (below), so equal prefixes give equal hashes on every
  replica and a gateway can hash a request's tokens the same way.
- Media: ``GPU`` for lanes (L1; the device's pages, or host arrays on the NumPy backend), ``CPU``
  for L2 images, ``DISK`` for the L3 store. A block held twice in one medium (two lanes, two
  images sharing a prefix) is stored once and removed when the last holder lets it go.
- Hybrid models (Gated DeltaNet state cannot rewind) resume only at a lane's frontier and its
  turn checkpoint / anchor: attention pages go out as group 0 (``full_attention``) and the
  resumable boundaries as group 1 (``mamba``): the block that ends at or just below each one.
- Token ids come from ``lane.retained`` / ``cache.published`` ``token_ids``, which the engine
  fills only when this stream is on (``EngineConfig.ledger_events``); L3 images are named by
  the ledgers seen so far (``store.persisted`` ``session_digest``), and so are the entries
  it deleted (``deleted_digests``: evicted for room, or extended) and corrupt ones dropped at
  load (``store.entry_dropped``). The entries kept from before a restart come with
  ``store.opened`` ``token_ids`` and are stored (``DISK``) right after ``server.started``'s
  ``AllBlocksCleared``.
"""
from __future__ import annotations

import collections
import hashlib
import struct

from ..engine.lanes import session_digest
from .schema import Record

GPU, CPU, DISK = "GPU", "CPU", "DISK"
_TIER_MEDIUM = {"l2": CPU, "l3": DISK}
_LEDGERS_KEPT = 4096   # ledgers remembered for store.persisted (one per retained or published)


def block_hash(parent: int | None, tokens) -> int:
    """The block's hash: the first 8 bytes of SHA-256 over the parent's hash (8 bytes,
    big-endian; nothing for the first block) and the block's token ids (int32 little-endian),
    read as an unsigned 64-bit integer (vLLM's ``ExternalBlockHash`` as an int)."""
    h = hashlib.sha256()
    if parent is not None:
        h.update(struct.pack(">Q", parent))
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    return struct.unpack(">Q", h.digest()[:8])[0]


def chain(tokens, page_size: int) -> list[int]:
    """Hashes of the full pages of ``tokens``, first page first."""
    out, parent = [], None
    for i in range(len(tokens) // page_size):
        parent = block_hash(parent, tokens[i * page_size:(i + 1) * page_size])
        out.append(parent)
    return out


class KvBlockIndex:
    """Who holds which block, per medium and group, and the events that changes produce.

    ``apply(record)`` returns the events (vLLM's tagged maps, see ``stored`` / ``removed``)
    that one record implies, in order; an empty list when it changes nothing a gateway sees.

    Args:
        page_size: tokens per KV page (the blocks' size).
        recurrent: the model keeps recurrent state (a hybrid model).
    """

    def __init__(self, page_size: int, recurrent: bool):
        self.page_size, self.recurrent = page_size, recurrent
        self.refs: collections.Counter = collections.Counter()   # (medium, group, hash) -> holders
        self.lanes: dict[int, tuple[list, list]] = {}   # lane -> (token ids, boundaries)
        self.images: dict[tuple[str, str], list] = {}   # (tier, session digest) -> token ids
        self.ledgers: collections.OrderedDict = collections.OrderedDict()   # digest -> token ids
        self.opened: list = []   # the L3 ledgers of store.opened, until server.started

    # -- events: vLLM's structs as msgpack maps tagged by "type" (fields left at their
    # defaults omitted, as vLLM's omit_defaults does) ------------------------------------
    def stored(self, hashes, parent, tokens, medium, group) -> dict:
        """``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id,
        medium, lora_name, and on hybrid models group_idx and kv_cache_spec_kind."""
        ev = {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
              "token_ids": list(tokens), "block_size": self.page_size, "lora_id": None,
              "medium": medium, "lora_name": None}
        if self.recurrent:
            ev.update(group_idx=group, kv_cache_spec_kind="full_attention" if group == 0
                      else "mamba")
        return ev

    def removed(self, hashes, medium, group) -> dict:
        """``BlockRemoved``: block_hashes, medium, and on hybrid models group_idx."""
        ev = {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}
        if self.recurrent:
            ev["group_idx"] = group
        return ev

    # -- holders --------------------------------------------------------------------------
    def _blocks(self, tokens, boundaries) -> list[tuple[int, int, int | None, list]]:
        """``(group, hash, parent, token ids)`` of every block a holder of ``tokens`` holds:
        each full page (group 0), and on hybrid models the page ending at or below each
        resumable boundary (group 1)."""
        ps, out, parent = self.page_size, [], None
        hashes = chain(tokens, ps)
        for i, h in enumerate(hashes):
            out.append((0, h, parent, tokens[i * ps:(i + 1) * ps]))
            parent = h
        if self.recurrent:
            for b in sorted({b // ps for b in boundaries if b >= ps}):
                i = b - 1
                out.append((1, hashes[i], hashes[i - 1] if i else None,
                            tokens[i * ps:(i + 1) * ps]))
        return out

    def _hold(self, medium: str, tokens, boundaries=()) -> list:
        events, run = [], []

        def flush():
            if run:
                group = run[0][0]
                events.append(self.stored([h for _, h, _, _ in run], run[0][2],
                                          [t for _, _, _, ts in run for t in ts], medium, group))
                run.clear()

        for group, h, parent, toks in self._blocks(tokens, boundaries):
            key = (medium, group, h)
            self.refs[key] += 1
            if self.refs[key] > 1:
                flush()
                continue
            if run and (run[-1][0] != group or run[-1][1] != parent):
                flush()
            run.append((group, h, parent, toks))
        flush()
        return events

    def _let_go(self, medium: str, tokens, boundaries=()) -> list:
        gone: dict[int, list] = {}
        for group, h, _, _ in self._blocks(tokens, boundaries):
            key = (medium, group, h)
            self.refs[key] -= 1
            if self.refs[key] <= 0:
                del self.refs[key]
                gone.setdefault(group, []).append(h)
        return [self.removed(hs, medium, g) for g, hs in sorted(gone.items())]

    def _remember(self, tokens) -> None:
        """Keep ``tokens`` findable by digest (``store.persisted`` names images by it)."""
        digest = session_digest(tokens)
        self.ledgers[digest] = tokens
        self.ledgers.move_to_end(digest)
        while len(self.ledgers) > _LEDGERS_KEPT:
            self.ledgers.popitem(last=False)

    def _set_lane(self, lane: int, tokens, boundaries=()) -> list:
        # the new holding first: blocks both share never drop to no holder
        old = self.lanes.pop(lane, None)
        events = []
        if tokens:
            self.lanes[lane] = (tokens, tuple(boundaries))
            events = self._hold(GPU, tokens, boundaries)
        return events + (self._let_go(GPU, *old) if old else [])

    def _image(self, tier: str, tokens) -> list:
        key = (tier, session_digest(tokens))
        if key in self.images or tier not in _TIER_MEDIUM:
            return []
        self.images[key] = tokens
        return self._hold(_TIER_MEDIUM[tier], tokens, (len(tokens),))

    def _drop_image(self, tier: str, digest: str) -> list:
        """An image named by its ledger's digest left ``tier`` (nothing if it was not known)."""
        tokens = self.images.pop((tier, digest), None)
        if tokens is None:
            return []
        return self._let_go(_TIER_MEDIUM[tier], tokens, (len(tokens),))

    # -- the fold -------------------------------------------------------------------------
    def apply(self, record: Record) -> list:
        """The events ``record`` implies (see the class docstring)."""
        ev, kind = record.event, record.kind
        if kind == "store.opened" and ev.token_ids:   # (announced once the process starts)
            self.opened = [list(t) for t in ev.token_ids]
            return []
        if kind == "server.started":   # a new process holds nothing yet but its L3 entries
            self.refs.clear()
            self.lanes.clear()
            self.images.clear()
            events = [{"type": "AllBlocksCleared"}]
            for tokens in self.opened:
                self._remember(tokens)
                events += self._image("l3", tokens)
            self.opened = []
            return events
        if kind == "lane.retained" and ev.token_ids:
            tokens = list(ev.token_ids)
            self._remember(tokens)
            return self._set_lane(ev.lane, tokens,
                                  (ev.tokens, ev.checkpoint_tokens, ev.anchor_tokens))
        if kind == "lane.evicted" and ev.lane in self.lanes:
            tokens, bounds = self.lanes[ev.lane]
            if ev.reason != "truncated":
                return self._set_lane(ev.lane, [])
            keep = tokens[:max(len(tokens) - ev.tokens, 0)]
            return self._set_lane(ev.lane, keep, [b for b in bounds if b <= len(keep)])
        if kind == "lane.released":
            return self._set_lane(ev.lane, [])
        if kind == "cache.demoted" and ev.admitted and ev.lane in self.lanes:
            return self._image(ev.tier, self.lanes[ev.lane][0][:ev.tokens])
        if kind == "cache.published" and ev.token_ids:
            tokens = list(ev.token_ids)
            self._remember(tokens)
            return [e for t in ev.tiers if t == "l2" for e in self._image(t, tokens)]
        if kind == "store.persisted":
            # the new image first: blocks it shares with the entries it replaces stay held
            events = self._image("l3", self.ledgers[ev.session_digest]) \
                if ev.session_digest in self.ledgers else []
            return events + [e for d in ev.deleted_digests for e in self._drop_image("l3", d)]
        if kind == "cache.evicted":
            return self._drop_image(ev.tier, ev.session_digest)
        if kind == "store.entry_dropped":
            return self._drop_image("l3", ev.session_digest)
        return []

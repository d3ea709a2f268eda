"""The continuation-cache fold: one definition of every prefix-reuse and tier counter, shared by
the metrics, telemetry and dashboard folds (so ``/metrics``, ``/telemetry`` and the dashboard's
cache panel cannot drift apart).

``fold_cache(state, kind, event)`` applies one record of a kind in ``CACHE_KINDS``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

CACHE_KINDS = frozenset({"cache.lookup", "cache.restored", "cache.demoted", "cache.evicted",
                         "cache.published",
                         "lane.retained", "lane.assigned", "lane.evicted", "lane.released",
                         "store.opened", "store.persisted", "store.persist_failed",
                         "store.disabled", "cache.restore_refused", "store.quarantined",
                         "store.entry_dropped"})
TIERS = ("l1", "l2", "l3")


@dataclass(slots=True)
class CacheState:
    """Counters in requests / tokens / bytes; ``entries`` and ``bytes`` of L2 and L3 are the
    tier's occupancy after its last event."""
    lookups: int = 0
    hits: int = 0
    lookup_prompt_tokens: int = 0
    reused_tokens: int = 0
    paths: dict = field(default_factory=dict)             # reuse path -> requests
    restores: dict = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    restored_tokens: dict = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    restored_bytes: dict = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    resident: dict = field(default_factory=dict)          # lane -> tokens it retains
    evictions: int = 0                                     # retained prefixes dropped
    evicted_tokens: int = 0
    truncations: int = 0                                   # retained prefixes cut back
    truncated_tokens: int = 0
    l2_demotions: int = 0
    publications: int = 0                                  # breakpoint prefixes published
    publication_failures: int = 0                          # ... that no tier took
    published_tokens: int = 0
    l2_evictions: int = 0
    l2_evicted_bytes: int = 0
    l2_entries: int = 0
    l2_bytes: int = 0
    l3_enabled: bool = False
    l3_disabled: str | None = None                         # why the store could not open
    restore_refusals: int = 0                              # images that did not fit a lane
    l3_persisted: int = 0
    l3_persist_failures: int = 0
    l3_entries: int = 0
    l3_bytes: int = 0
    l3_dropped: int = 0                                    # corrupt entries deleted at load
    l3_quarantined: str | None = None                      # where a corrupt store was moved

    @property
    def misses(self) -> int:
        return self.lookups - self.hits


def fold_cache(c: CacheState, kind: str, ev) -> None:
    """Apply one record (``kind`` in ``CACHE_KINDS``) to ``c``."""
    if kind == "cache.lookup":  # every admitted request, whatever its outcome
        c.lookups += 1
        c.lookup_prompt_tokens += ev.prompt_tokens
        c.reused_tokens += ev.cached_tokens
        c.paths[ev.path] = c.paths.get(ev.path, 0) + 1
        if ev.cached_tokens > 0:
            c.hits += 1
            if ev.source == "l1":  # lower tiers are counted by their cache.restored
                c.restores["l1"] += 1
                c.restored_tokens["l1"] += ev.cached_tokens
    elif kind == "cache.restored":
        c.restores[ev.tier] += 1
        c.restored_tokens[ev.tier] += ev.tokens
        c.restored_bytes[ev.tier] += ev.bytes
    elif kind == "cache.demoted":
        c.l2_demotions += ev.admitted
        c.l2_entries, c.l2_bytes = ev.entries, ev.tier_bytes
    elif kind == "cache.published":
        if ev.tiers:
            c.publications += 1
            c.published_tokens += ev.tokens
        else:
            c.publication_failures += 1
        if "l2" in ev.tiers:
            c.l2_entries, c.l2_bytes = ev.l2_entries, ev.l2_bytes
    elif kind == "cache.evicted":
        if ev.reason == "capacity":   # (a superseded image was not dropped for room)
            c.l2_evictions += 1
            c.l2_evicted_bytes += ev.bytes
        c.l2_entries, c.l2_bytes = ev.entries, ev.tier_bytes
    elif kind == "lane.retained":
        c.resident[ev.lane] = ev.tokens
    elif kind in ("lane.assigned", "lane.released"):
        c.resident.pop(ev.lane, None)
    elif kind == "lane.evicted":
        if ev.reason == "truncated":
            c.truncations += 1
            c.truncated_tokens += ev.tokens
        else:
            c.evictions += 1
            c.evicted_tokens += ev.tokens
            c.resident.pop(ev.lane, None)
    elif kind == "store.opened":
        c.l3_enabled = True
        c.l3_entries, c.l3_bytes = ev.entries, ev.bytes
    elif kind == "store.persisted":
        c.l3_persisted += 1
        c.l3_entries, c.l3_bytes = ev.entries, ev.store_bytes
    elif kind == "store.persist_failed":
        c.l3_persist_failures += 1
    elif kind == "store.disabled":
        c.l3_enabled, c.l3_disabled = False, ev.error
    elif kind == "cache.restore_refused":
        c.restore_refusals += 1
    elif kind == "store.quarantined":
        c.l3_quarantined = ev.moved_to
    elif kind == "store.entry_dropped":
        c.l3_dropped += 1
        c.l3_entries, c.l3_bytes = ev.entries, ev.store_bytes

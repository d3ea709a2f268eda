"""The continuation-cache part of the serving fold: every prefix-reuse and tier counter, which
``/metrics``, ``/telemetry`` and the dashboard's cache panel all render.

``fold_cache(state, kind, event) -> state`` applies one record of a kind in ``CACHE_KINDS``
and returns a new state (the one given is never changed).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .values import counted, evolve, frozen, no_entries, with_item, without

CACHE_KINDS = frozenset({"cache.lookup", "cache.restored", "cache.demoted", "cache.evicted",
                         "cache.published",
                         "lane.retained", "lane.assigned", "lane.evicted", "lane.released",
                         "store.opened", "store.persisted", "store.persist_failed",
                         "store.disabled", "cache.restore_refused", "store.quarantined",
                         "store.entry_dropped"})
TIERS = ("l1", "l2", "l3")
_ZERO_TIERS = frozen(dict.fromkeys(TIERS, 0))


@dataclass(frozen=True)
class CacheState:
    """Counters in requests / tokens / bytes; ``entries`` and ``bytes`` of L2 and L3 are the
    tier's occupancy after its last event."""
    lookups: int = 0
    hits: int = 0
    lookup_prompt_tokens: int = 0
    reused_tokens: int = 0
    paths: Mapping = no_entries()                          # reuse path -> requests
    restores: Mapping = field(default_factory=lambda: _ZERO_TIERS)         # tier -> count
    restored_tokens: Mapping = field(default_factory=lambda: _ZERO_TIERS)
    restored_bytes: Mapping = field(default_factory=lambda: _ZERO_TIERS)
    resident: Mapping = no_entries()                       # lane -> tokens it retains
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


def _add(per_tier: Mapping, tier: str, n: int) -> Mapping:
    """``per_tier`` with ``n`` added under ``tier`` (KeyError: not a tier, a malformed record)."""
    return with_item(per_tier, tier, per_tier[tier] + n)


def fold_cache(c: CacheState, kind: str, ev) -> CacheState:
    """``c`` after one record (``kind`` in ``CACHE_KINDS``)."""
    if kind == "cache.lookup":  # every admitted request, whatever its outcome
        c = evolve(c, lookups=c.lookups + 1,
                    lookup_prompt_tokens=c.lookup_prompt_tokens + ev.prompt_tokens,
                    reused_tokens=c.reused_tokens + ev.cached_tokens,
                    paths=counted(c.paths, ev.path))
        if ev.cached_tokens > 0:
            c = evolve(c, hits=c.hits + 1)
            if ev.source == "l1":  # lower tiers are counted by their cache.restored
                c = evolve(c, restores=_add(c.restores, "l1", 1),
                            restored_tokens=_add(c.restored_tokens, "l1", ev.cached_tokens))
        return c
    if kind == "cache.restored":
        return evolve(c, restores=_add(c.restores, ev.tier, 1),
                       restored_tokens=_add(c.restored_tokens, ev.tier, ev.tokens),
                       restored_bytes=_add(c.restored_bytes, ev.tier, ev.bytes))
    if kind == "cache.demoted":
        return evolve(c, l2_demotions=c.l2_demotions + ev.admitted, l2_entries=ev.entries,
                       l2_bytes=ev.tier_bytes)
    if kind == "cache.published":
        if ev.tiers:
            c = evolve(c, publications=c.publications + 1,
                        published_tokens=c.published_tokens + ev.tokens)
        else:
            c = evolve(c, publication_failures=c.publication_failures + 1)
        if "l2" in ev.tiers:
            c = evolve(c, l2_entries=ev.l2_entries, l2_bytes=ev.l2_bytes)
        return c
    if kind == "cache.evicted":
        if ev.reason == "capacity":   # (a superseded image was not dropped for room)
            c = evolve(c, l2_evictions=c.l2_evictions + 1,
                        l2_evicted_bytes=c.l2_evicted_bytes + ev.bytes)
        return evolve(c, l2_entries=ev.entries, l2_bytes=ev.tier_bytes)
    if kind == "lane.retained":
        return evolve(c, resident=with_item(c.resident, ev.lane, ev.tokens))
    if kind in ("lane.assigned", "lane.released"):
        return evolve(c, resident=without(c.resident, ev.lane))
    if kind == "lane.evicted":
        if ev.reason == "truncated":
            return evolve(c, truncations=c.truncations + 1,
                           truncated_tokens=c.truncated_tokens + ev.tokens)
        return evolve(c, evictions=c.evictions + 1, evicted_tokens=c.evicted_tokens + ev.tokens,
                       resident=without(c.resident, ev.lane))
    if kind == "store.opened":
        return evolve(c, l3_enabled=True, l3_entries=ev.entries, l3_bytes=ev.bytes)
    if kind == "store.persisted":
        return evolve(c, l3_persisted=c.l3_persisted + 1, l3_entries=ev.entries,
                       l3_bytes=ev.store_bytes)
    if kind == "store.persist_failed":
        return evolve(c, l3_persist_failures=c.l3_persist_failures + 1)
    if kind == "store.disabled":
        return evolve(c, l3_enabled=False, l3_disabled=ev.error)
    if kind == "cache.restore_refused":
        return evolve(c, restore_refusals=c.restore_refusals + 1)
    if kind == "store.quarantined":
        return evolve(c, l3_quarantined=ev.moved_to)
    if kind == "store.entry_dropped":
        return evolve(c, l3_dropped=c.l3_dropped + 1, l3_entries=ev.entries,
                       l3_bytes=ev.store_bytes)
    return c

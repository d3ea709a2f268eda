"""The L3 store's events (``store/continuation_store.py``), registered like the kinds of
``schema.py``, which re-exports them."""
from __future__ import annotations

from dataclasses import field
from typing import ClassVar

from .registry import event


@event("store.opened")
class StoreOpened:
    """The restart-persistent tier is in use: ``entries`` images of ``bytes`` under ``path``
    usable by this runtime, ``foreign`` entries of another model or layout (ignored);
    ``token_ids``: each usable entry's ledger, only on a server that publishes KV-cache events
    (``EngineConfig.ledger_events``), so that what it kept across a restart is announced."""
    kind: ClassVar[str]
    tier: str
    path: str
    entries: int
    bytes: int
    foreign: int
    token_ids: list = field(default_factory=list)


@event("store.persisted")
class StorePersisted:
    """An image became durable in the restart-persistent tier (``tier`` ``l3``) in
    ``duration_s`` (the writer thread); ``deleted``: entries removed with it (older images it
    extends, least recently used ones evicted for room); ``entries`` / ``store_bytes``: the
    store's occupancy after; ``session_digest``: of the image's ledger; ``deleted_digests``:
    the session digests of the ledgers of the entries deleted (this model's)."""
    kind: ClassVar[str]
    tier: str
    tokens: int
    bytes: int
    duration_s: float
    deleted: int
    entries: int
    store_bytes: int
    session_digest: str = ""
    deleted_digests: list = field(default_factory=list)


@event("store.persist_failed")
class StorePersistFailed:
    """An image could not be stored (``error``: the exception); nothing became visible and
    serving continues."""
    kind: ClassVar[str]
    tier: str
    tokens: int
    error: str


@event("store.disabled")
class StoreDisabled:
    """The restart-persistent tier could not be opened at start (``error``: why: another
    process holds the directory, it cannot be written, ...): the server serves without L3."""
    kind: ClassVar[str]
    tier: str
    error: str


@event("store.quarantined")
class StoreQuarantined:
    """The restart-persistent tier's directory ``path`` did not read whole at start
    (``reason``: a truncated ``data.mdb``, damaged pages, the signal that ended the check) and
    was renamed to ``moved_to``; the tier starts empty there (``store.opened`` follows)."""
    kind: ClassVar[str]
    tier: str
    path: str
    moved_to: str
    reason: str


@event("store.entry_dropped")
class StoreEntryDropped:
    """An image of ``tokens`` positions and ``bytes`` failed its checks on load (``reason``:
    payload digest mismatch, ledger not matching its key, undecodable, wrong layout) and was
    deleted; the request prefilled instead. Also, after ``store.opened``, for each entry whose
    descriptor did not decode at open (``tokens`` 0 and ``session_digest`` "": its ledger is
    unknown). ``entries`` / ``store_bytes``: the store's occupancy after; ``session_digest``:
    of the entry's ledger."""
    kind: ClassVar[str]
    tier: str
    tokens: int
    bytes: int
    reason: str
    entries: int
    store_bytes: int
    session_digest: str = ""

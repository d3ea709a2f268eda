"""L3: the restart-persistent continuation store, an LMDB environment under ``DIR/NAMESPACE``
(serving contract §4.3).

Two named databases, both keyed by the image's content address (SHA-256 of the runtime
identity and the token ledger):

- ``ledgers``: small msgpack descriptors — identity digest, token ids, image bytes, payload
  SHA-256, last use, the depths of the image's checkpoints (``marks``), the depths a
  speculative request resumes it at (``mtp_marks``) — read whole at open to build the
  in-memory catalog that look-ups search;
- ``images``: the msgpack payload (K, V and, on hybrid models, recurrent state arrays, the
  lane's checkpoints with the turn-checkpoint ring on, and a speculative lane's pending MTP
  rows). Entries written before checkpoints (or MTP rows) were carried have neither key and
  restore at their frontier alone (for plain requests).

Both are written in one LMDB transaction, so a crash never leaves a half-visible entry. A
descriptor whose identity differs from this runtime's (another model, layout or format) is
never in the catalog; a payload whose SHA-256 does not match its descriptor, or that fails to
decode, is a safe miss (and is deleted). The quota bounds the images' bytes (this runtime's
and another's, which share it): before a write that would pass it, the least recently used
entries go first. LMDB's map (the file's ceiling) is twice the quota plus 16 MiB, room for its
copy-on-write pages and page overhead, so that the quota, not LMDB, is what fills. Entries a newer image extends (same ledger
prefix) are deleted once the newer one is durable. One process per directory. Before LMDB
maps the file, ``store_check`` reads it whole in a child process; one that is not (truncated,
damaged pages: LMDB would fault or abort) is moved aside and the store starts empty.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import queue
import threading
import time
from dataclasses import dataclass

import lmdb
import msgpack
import numpy as np

from ..engine.continuation import (ImageCheckpoint, LaneImage, best_prefix,  # noqa: F401
                                   best_resume, check_layout)
from ..engine.lanes import session_digest
from . import store_check

FORMAT_VERSION = 1


_FOREIGN = "\x00foreign"   # the session key another runtime's entries share in eviction


class StoreUnavailable(RuntimeError):
    """The store cannot be used here (another process holds the namespace, the directory
    cannot be written, or LMDB refused to open it); the server runs without L3."""


@dataclass(slots=True)
class Entry:
    """A catalog entry: the ledger and sizes of one stored image."""
    key: bytes
    tokens: np.ndarray
    nbytes: int
    last_used: float
    marks: tuple = ()     # depths of the image's checkpoints (hybrid: it restores there too)
    session: str = ""     # the session key it was stored under ("": none, e.g. a breakpoint)
    mtp_marks: tuple = ()  # the depths a speculative request resumes it at (mtp_marks)

    @property
    def mtp(self) -> bool:
        """It carries a speculative lane's MTP rows at its frontier (``LaneImage.mtp_rows``)."""
        return int(self.tokens.size) in self.mtp_marks


def _arrays(a: list | None):
    return None if a is None else [_pack_array(x) for x in a]


def _pack_array(x: np.ndarray) -> dict:
    x = np.ascontiguousarray(x)
    return {"dtype": x.dtype.str, "shape": list(x.shape), "data": x.tobytes()}


def _unpack_array(d: dict) -> np.ndarray:
    return np.frombuffer(d["data"], dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy()


def _pack_marks(marks) -> list:
    return [{"depth": int(c.depth), "roles": list(c.roles), "conv": _arrays(c.conv),
             "ssm": _arrays(c.ssm)} | ({} if c.mtp_row is None else
                                       {"mtp": _pack_array(c.mtp_row)}) for c in marks or ()]


def _unpack_marks(raw) -> list[ImageCheckpoint] | None:
    return [ImageCheckpoint(int(m["depth"]), [_unpack_array(a) for a in m["conv"]],
                            [_unpack_array(a) for a in m["ssm"]],
                            tuple(str(r) for r in m["roles"]),
                            None if m.get("mtp") is None else _unpack_array(m["mtp"]))
            for m in raw or ()] or None


class ContinuationStore:
    """The L3 store.

    Args:
        root: the cache directory (``--continuation-cache-dir``).
        namespace: one path component of ``[A-Za-z0-9._-]`` (not ``.`` / ``..``).
        quota_bytes: the images' bytes kept at most (the LMDB map is ``map_size``).
        identity: what a restore must match (artifact SHA-256, cache layout, ...), any
            JSON-serialisable dict.

    Raises:
        ValueError: a bad namespace or quota.
        StoreUnavailable: another process holds the namespace (an exclusive ``flock`` on
            ``ninfer.lock``), or the directory or environment cannot be opened, checked or
            written.

    An environment that is not whole (``store_check``: truncated, damaged pages) is moved
    aside before LMDB maps it and this store starts empty; ``quarantined`` is then
    (where it went, why).
    """

    def __init__(self, root: str, namespace: str, quota_bytes: int, identity: dict):
        if not namespace or namespace in (".", "..") or not all(
                c.isalnum() or c in "._-" for c in namespace) or not namespace.isascii():
            raise ValueError(f"bad continuation-cache namespace {namespace!r}: one path "
                             "component of ASCII letters, digits, '.', '_', '-'")
        if quota_bytes < 1 << 20:
            raise ValueError("the L3 quota must be at least 1 MiB")
        self.path = os.path.join(root, namespace)
        self.quota_bytes = quota_bytes
        self.layout = dict(identity)
        self.identity = hashlib.sha256(json.dumps(
            {"format": FORMAT_VERSION, **identity}, sort_keys=True).encode()).digest()
        self._lockfile = self._take_lock()
        # (moved to, why): the store found here was not whole, this one starts empty
        self.quarantined: tuple[str, str] | None = None
        try:
            problem = store_check.check(self.path)
        except store_check.CheckFailed as exc:
            self._lockfile.close()
            raise StoreUnavailable(str(exc)) from None
        if problem is not None:
            try:
                moved_to = store_check.quarantine(self.path)
            except OSError as exc:
                self._lockfile.close()
                raise StoreUnavailable(f"{self.path} is corrupt ({problem}) and cannot be "
                                       f"moved aside: {exc}") from None
            self._lockfile.close()   # (the lock file moved with it)
            self._lockfile = self._take_lock()
            self.quarantined = (moved_to, problem)
        try:
            self.map_size = 2 * quota_bytes + (16 << 20)
            self.env = lmdb.open(self.path, map_size=self.map_size, max_dbs=2, subdir=True,
                                 mode=0o600, lock=True)
            self._ledgers = self.env.open_db(b"ledgers")
            self._images = self.env.open_db(b"images")
        except lmdb.Error as exc:
            self._lockfile.close()
            raise StoreUnavailable(f"cannot open the LMDB store in {self.path}: {exc}") \
                from None
        self.catalog: dict[bytes, Entry] = {}
        self._lock = threading.Lock()   # the catalog: searched by the engine, changed by writes
        self.foreign = 0   # descriptors of another identity (never restored here)
        # ... but they take room under the same quota: key -> (last use, bytes), so that a
        # write that does not fit evicts them too, least recently used first with this
        # runtime's own
        self._foreign: dict[bytes, tuple[float, int]] = {}
        # entries whose descriptor does not decode: (image bytes, why), deleted below, so that
        # their images do not hold room that no eviction could ever free
        self.dropped_at_open: list[tuple[int, str]] = []
        bad: list[tuple[bytes, str]] = []
        with self.env.begin() as txn:
            for key, raw in txn.cursor(db=self._ledgers):
                try:
                    d = msgpack.unpackb(raw)
                    if d["identity"] != self.identity:
                        self.foreign += 1
                        self._foreign[bytes(key)] = (float(d.get("last_used", 0.0)),
                                                     int(d.get("nbytes", 0)))
                        continue
                    self.catalog[bytes(key)] = Entry(
                        bytes(key), np.frombuffer(d["tokens"], dtype="<i4").astype(np.int32),
                        int(d["nbytes"]), float(d["last_used"]),
                        tuple(int(m) for m in d.get("marks", ())), str(d.get("session", "")),
                        tuple(int(m) for m in d.get("mtp_marks", ())))
                except Exception as exc:  # a malformed descriptor: deleted, never a crash
                    bad.append((bytes(key), f"undecodable descriptor ({type(exc).__name__})"))
        for key, why in bad:
            with self.env.begin(write=True) as txn:
                image = txn.get(key, db=self._images)
                txn.delete(key, db=self._images)
                txn.delete(key, db=self._ledgers)
            self.dropped_at_open.append((0 if image is None else len(image), why))

    def _take_lock(self):
        """Create the directory and hold ``ninfer.lock`` in it exclusively (one process per
        directory and namespace); returns the open lock file."""
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            lockfile = open(os.path.join(self.path, "ninfer.lock"), "a")
        except OSError as exc:
            raise StoreUnavailable(f"cannot use {self.path}: {exc}") from None
        try:
            fcntl.flock(lockfile, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lockfile.close()
            raise StoreUnavailable(f"{self.path} is in use by another ninfer process "
                                   "(one process per directory and namespace)") from None
        return lockfile

    # -- identity -------------------------------------------------------------------------
    def key_of(self, tokens: np.ndarray) -> bytes:
        """The content address of an image with this ledger (under this identity)."""
        return hashlib.sha256(self.identity + np.asarray(tokens, "<i4").tobytes()).digest()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self.catalog.values())

    def __len__(self) -> int:
        return len(self.catalog)

    def ledgers(self) -> list[list[int]]:
        """Every usable entry's token ids, least recently used first."""
        with self._lock:
            entries = sorted(self.catalog.values(), key=lambda e: e.last_used)
        return [e.tokens.tolist() for e in entries]

    def used_bytes(self) -> int:
        """Image bytes under the quota: this runtime's entries and another's."""
        with self._lock:
            return sum(e.nbytes for e in self.catalog.values()) + \
                sum(n for _, n in self._foreign.values())

    def _size_of(self, key: bytes) -> int:
        """Bytes of entry ``key`` when it is this runtime's (a rewrite replaces it), else 0."""
        with self._lock:
            e = self.catalog.get(key)
            return e.nbytes if e is not None else 0

    # -- writes (the writer thread) ---------------------------------------------------------
    def put(self, image: LaneImage, session: str = "") -> tuple[bytes, list[Entry]]:
        """Store ``image`` of session ``session`` durably; returns (its key, entries deleted:
        ones evicted for room and older images it extends; another model's evicted are not
        listed). Room is shared fairly, as L2's: the session holding the most bytes loses its
        least recently used entry first (entries without a session count as one session,
        another runtime's entries as one more).

        Raises:
            lmdb.MapFullError: the image alone does not fit the quota.
            lmdb.Error: any other write failure (nothing becomes visible).
        """
        key = self.key_of(image.tokens)
        payload = {"k": _pack_array(image.k), "v": _pack_array(image.v),
                   "conv": _arrays(image.conv), "ssm": _arrays(image.ssm)}
        if image.checkpoints:   # (an older reader skips the key: the frontier alone)
            payload["checkpoints"] = _pack_marks(image.checkpoints)
        if image.mtp_rows is not None:   # (likewise: a plain request's image)
            payload["mtp"] = {"start": int(image.mtp_start),
                              "rows": _pack_array(image.mtp_rows)}
        payload = msgpack.packb(payload)
        if len(payload) > self.quota_bytes // 2:  # refused, never admitted-then-evicted
            raise lmdb.MapFullError(f"an image of {len(payload)} bytes exceeds half the "
                                    f"L3 quota ({self.quota_bytes} bytes)")
        now = time.time()
        ledger = {"identity": self.identity, "tokens": image.tokens.astype("<i4").tobytes(),
                  "nbytes": len(payload), "sha256": hashlib.sha256(payload).digest(),
                  "last_used": now}
        if image.marks:   # (without checkpoints, the descriptor is the one before them)
            ledger["marks"] = list(image.marks)
        if session:
            ledger["session"] = session
        if image.mtp_marks:
            ledger["mtp_marks"] = list(image.mtp_marks)
        ledger = msgpack.packb(ledger)
        deleted = []

        def evict_one() -> bool:
            """Delete the least recently used entry, but this one, of the session holding the
            most bytes; False: none is left."""
            with self._lock:
                held = [(e.session, e.last_used, e.nbytes, e.key)
                        for e in self.catalog.values() if e.key != key]
                held += [(_FOREIGN, t, n, k) for k, (t, n) in self._foreign.items()]
            if not held:
                return False
            shares: dict[str, int] = {}
            for sess, _, n, _ in held:
                shares[sess] = shares.get(sess, 0) + n
            top = max(shares, key=lambda sess: (shares[sess], sess))
            victim = min((t, k) for sess, t, _, k in held if sess == top)[1]
            if self._foreign.pop(victim, None) is None:   # (another model's: not listed)
                with self._lock:
                    deleted.append(self.catalog[victim])
            self._delete(victim)
            return True

        while self.used_bytes() - self._size_of(key) + len(payload) > self.quota_bytes \
                and evict_one():
            pass
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    txn.put(key, payload, db=self._images)
                    txn.put(key, ledger, db=self._ledgers)
                break
            except lmdb.MapFullError:   # LMDB's own overhead: more room, the same way
                if not evict_one():
                    raise
        with self._lock:
            self.catalog[key] = Entry(key, image.tokens.copy(), len(payload), now, image.marks,
                                      session, image.mtp_marks)
            entries = list(self.catalog.values())
        # an older image whose whole ledger this one extends is redundant now (on hybrid
        # models it is a branch point: an image restores only at its exact end)
        for e in entries if not self.layout.get("recurrent") else ():
            if e.key != key and e.tokens.size < image.n and np.array_equal(
                    image.tokens[:e.tokens.size], e.tokens):
                self._delete(e.key)
                deleted.append(e)
        return key, deleted

    def _delete(self, key: bytes) -> None:
        with self._lock:
            self.catalog.pop(key, None)
        with self.env.begin(write=True) as txn:
            txn.delete(key, db=self._images)
            txn.delete(key, db=self._ledgers)

    # -- reads ------------------------------------------------------------------------------
    def best(self, prompt: np.ndarray, limit: int, exact: bool,
             mtp: bool = False) -> tuple[Entry | None, int]:
        """The catalog entry reusing the most of ``prompt`` (at most ``limit`` tokens), and that
        depth; ``exact``: only entries whose whole ledger is a prefix, or one of its
        checkpoints' (hybrid models); ``mtp`` (a speculative request): only at an entry's
        ``mtp_marks``."""
        with self._lock:
            entries = list(self.catalog.values())
        if mtp:
            return best_resume(((e, e.tokens, e.mtp_marks) for e in entries), prompt, limit)
        return best_prefix(((e, e.tokens) for e in entries), prompt, limit, exact,
                           marks=lambda e: e.marks)

    def load(self, entry: Entry, on_drop=None) -> LaneImage | None:
        """The image of ``entry``, or None (a safe miss: missing, corrupt or undecodable; the
        entry is then deleted). ``on_drop(entry, reason)`` is called after a present but
        corrupt entry is deleted (not for one already gone: evicted since the look-up)."""
        gone = False
        try:
            with self.env.begin() as txn:
                raw = txn.get(entry.key, db=self._images)
                meta = txn.get(entry.key, db=self._ledgers)
            gone = raw is None and meta is None
            if raw is None or meta is None:
                raise ValueError("missing" if gone else "half an entry is missing")
            d = msgpack.unpackb(meta)
            tokens = np.frombuffer(d["tokens"], dtype="<i4").astype(np.int32)
            if self.key_of(tokens) != entry.key or not np.array_equal(tokens, entry.tokens):
                raise ValueError("ledger does not match its key")
            if hashlib.sha256(raw).digest() != d["sha256"]:
                raise ValueError("payload digest mismatch")
            p = msgpack.unpackb(raw)
            image = LaneImage(tokens, _unpack_array(p["k"]), _unpack_array(p["v"]),
                              None if p["conv"] is None else [_unpack_array(a) for a in p["conv"]],
                              None if p["ssm"] is None else [_unpack_array(a) for a in p["ssm"]],
                              _unpack_marks(p.get("checkpoints")))
            if p.get("mtp") is not None:
                image.mtp_start = int(p["mtp"]["start"])
                image.mtp_rows = _unpack_array(p["mtp"]["rows"])
            if image.marks != entry.marks or image.mtp_marks != entry.mtp_marks:
                raise ValueError("checkpoints or MTP rows do not match the descriptor")
            self._check_shapes(image)
        except Exception as exc:
            try:
                self._delete(entry.key)
            except lmdb.Error:
                pass
            if on_drop is not None and not gone:
                on_drop(entry, f"{type(exc).__name__}: {exc}")
            return None
        entry.last_used = time.time()
        return image

    def _check_shapes(self, image: LaneImage) -> None:
        check_layout(self.layout, image)

    def close(self) -> None:
        self.env.close()
        self._lockfile.close()


class Persister:
    """The writer thread: images queued by the engine are stored in order, off the execution
    thread; each outcome is an event (``store.persisted`` / ``store.persist_failed``).

    Args:
        store: the ContinuationStore.
        bus: EventBus (``emit_threadsafe``).
    """

    def __init__(self, store: ContinuationStore, bus, max_queued: int = 4):
        from ..events import schema as ev
        self._ev = ev
        self.store = store
        self.bus = bus
        self._queue: queue.Queue = queue.Queue(max_queued + 2)  # + flush / close markers
        self._max_queued = max_queued
        self._thread = threading.Thread(target=self._run, name="ninfer-l3-writer", daemon=True)
        self._thread.start()

    def submit(self, image: LaneImage, session: str = "") -> bool:
        """Queue ``image`` of session ``session``; False (and ``store.persist_failed``) when
        ``max_queued`` images already wait (a slow disk must not pile images up in host
        memory)."""
        if self._queue.qsize() >= self._max_queued:
            self.bus.emit_threadsafe(self._ev.StorePersistFailed(
                tier="l3", tokens=image.n, error="writer busy: image dropped"))
            return False
        self._queue.put((image, session))
        return True

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued image has been written (or failed)."""
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, stop the thread and close the store."""
        self._queue.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():  # never close the environment under a live writer
            self.store.close()

    def _run(self) -> None:
        ev = self._ev
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            t0 = time.monotonic()
            item, session = item
            try:
                _, deleted = self.store.put(item, session)
                self.bus.emit_threadsafe(ev.StorePersisted(
                    tier="l3", tokens=item.n, bytes=item.nbytes, duration_s=time.monotonic() - t0,
                    deleted=len(deleted),
                    entries=len(self.store), store_bytes=self.store.nbytes,
                    session_digest=session_digest(item.tokens),
                    deleted_digests=[session_digest(e.tokens) for e in deleted]))
            except Exception as exc:  # a full or failing disk never stops serving
                self.bus.emit_threadsafe(ev.StorePersistFailed(
                    tier="l3", tokens=item.n, error=f"{type(exc).__name__}: {exc}"))

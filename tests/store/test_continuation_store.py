"""The L3 continuation store on its own: another runtime's entries share the quota."""
from __future__ import annotations

import numpy as np

from ninfer.engine.continuation import LaneImage
from ninfer.store.continuation_store import ContinuationStore


def _image(rng, n: int) -> LaneImage:
    k = rng.standard_normal((2, n, 2, 64)).astype(np.float32)
    return LaneImage(rng.integers(0, 1000, n).astype(np.int32), k, k * 0.5)


def test_another_models_entries_are_evicted_when_a_write_needs_their_room(tmp_path):
    """Model A fills most of the quota; model B (another identity) never restores A's entries
    but must be able to write: the least recently used entries go, A's included, instead of
    every write of B failing with a full map (they used to stay forever)."""
    rng = np.random.default_rng(0)
    quota = 8 << 20
    a = ContinuationStore(str(tmp_path), "ns", quota, {"artifact_sha256": "A"})
    for _ in range(12):                   # ~0.8 MB each: A fills the map, evicting its own
        a.put(_image(rng, 400))
    kept = len(a)
    assert 2 <= kept < 12
    a.close()
    b = ContinuationStore(str(tmp_path), "ns", quota, {"artifact_sha256": "B"})
    assert len(b) == 0 and b.foreign == kept
    for i in range(4):
        key, deleted = b.put(_image(rng, 400))   # MapFullError if only B's own could go
        assert key in b.catalog and len(b) == i + 1
    b.close()
    a = ContinuationStore(str(tmp_path), "ns", quota, {"artifact_sha256": "A"})
    assert len(a) < kept and a.foreign == 4   # A's oldest went; B's are all there
    a.close()


def test_the_quota_is_what_the_images_may_take(tmp_path):
    """Images fill the quota (LMDB's copy-on-write and page overhead are outside it: a store
    with an 8 MiB quota used to hold about half of that), least recently used ones going
    first; reopened with a smaller quota, the next write brings the images under it."""
    rng = np.random.default_rng(1)
    quota = 8 << 20
    s = ContinuationStore(str(tmp_path), "ns", quota, {"artifact_sha256": "A"})
    for _ in range(30):
        key, _ = s.put(_image(rng, 400))
        assert s.used_bytes() <= quota
    per = s.catalog[key].nbytes
    assert len(s) == quota // per and s.used_bytes() > quota - per
    s.close()
    s = ContinuationStore(str(tmp_path), "ns", quota // 2, {"artifact_sha256": "A"})
    assert s.used_bytes() > quota // 2
    s.put(_image(rng, 400))
    assert s.used_bytes() <= quota // 2 and len(s) == (quota // 2) // per
    s.close()


def test_room_is_shared_fairly_between_sessions(tmp_path):
    """A long session's images do not push every other session's out: a write that needs room
    evicts the least recently used entry of the session holding the most bytes (its own
    session included), and the session keys survive a reopen."""
    rng = np.random.default_rng(2)
    quota = 8 << 20
    s = ContinuationStore(str(tmp_path), "ns", quota, {"artifact_sha256": "A"})
    small = s.put(_image(rng, 400), session="b")[0]          # the oldest entry
    big = [s.put(_image(rng, 400), session="a")[0] for _ in range(9)]
    per = s.catalog[small].nbytes
    assert len(s) == quota // per == 10                      # full
    _, deleted = s.put(_image(rng, 400), session="b")        # room: "a" holds the most
    assert [e.key for e in deleted] == [big[0]] and small in s.catalog
    s.close()
    s = ContinuationStore(str(tmp_path), "ns", quota, {"artifact_sha256": "A"})
    assert s.catalog[small].session == "b" and s.catalog[big[1]].session == "a"
    for _ in range(3):                                       # "a" still holds the most
        _, deleted = s.put(_image(rng, 400), session="c")
        assert deleted[0].session == "a"
    assert small in s.catalog
    s.close()


def test_an_entry_whose_descriptor_does_not_decode_is_deleted_at_open(tmp_path):
    """A damaged descriptor (here its first byte made msgpack's never-used 0xc1) used to be
    skipped in silence, its image kept in LMDB outside every count, so no eviction could free
    it: now the entry is deleted at open and said (``dropped_at_open``: its image's bytes and
    why), and the other entries load."""
    import lmdb
    rng = np.random.default_rng(3)
    ident = {"artifact_sha256": "A"}
    s = ContinuationStore(str(tmp_path), "ns", 8 << 20, ident)
    bad_key, _ = s.put(_image(rng, 100))
    good_key, _ = s.put(_image(rng, 120))
    bad_bytes = s.catalog[bad_key].nbytes
    path = s.path
    s.close()
    env = lmdb.open(path, max_dbs=2, subdir=True)
    with env.begin(write=True) as txn:
        ledgers = env.open_db(b"ledgers", txn=txn)
        raw = txn.get(bad_key, db=ledgers)
        txn.put(bad_key, b"\xc1" + raw[1:], db=ledgers)
        image_len = len(txn.get(bad_key, db=env.open_db(b"images", txn=txn)))
    env.close()
    s = ContinuationStore(str(tmp_path), "ns", 8 << 20, ident)
    assert list(s.catalog) == [good_key]
    ((dropped, why),) = s.dropped_at_open
    assert dropped == image_len and why.startswith("undecodable descriptor (")
    assert image_len >= bad_bytes > 0
    s.close()
    env = lmdb.open(path, max_dbs=2, subdir=True, readonly=True)
    with env.begin() as txn:   # the image went with its descriptor
        assert txn.get(bad_key, db=env.open_db(b"images", txn=txn)) is None
        assert txn.get(bad_key, db=env.open_db(b"ledgers", txn=txn)) is None
    env.close()
    s = ContinuationStore(str(tmp_path), "ns", 8 << 20, ident)   # said once: it is gone now
    assert s.dropped_at_open == [] and list(s.catalog) == [good_key]
    s.close()

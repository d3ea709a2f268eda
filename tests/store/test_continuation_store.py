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

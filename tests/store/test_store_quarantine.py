"""An L3 store that is not whole (a truncated copy, damaged B-tree pages) used to crash the
process that opened it (SIGBUS, or an LMDB error at open); now it is moved aside at open and
the store starts empty. Real LMDB files, damaged on disk; what LMDB would do to an unchecked
process is shown in a child process."""
from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
import sys

import numpy as np

from ninfer.engine.continuation import LaneImage
from ninfer.store import store_check
from ninfer.store.continuation_store import ContinuationStore

# a runtime identity whose layout the images below match (K / V: (2, n, 2, 64) float32)
IDENTITY = {"artifact_sha256": "A", "kv_layers": 2, "nkv": 2, "hd": 64, "recurrent": False}
QUOTA = 8 << 20

# the store as it was before the check: trusted as found, then read and written
UNCHECKED = """
import sys
import numpy as np
from ninfer.engine.continuation import LaneImage
from ninfer.store import store_check
store_check.check = lambda path, timeout_s=0: None
from ninfer.store.continuation_store import ContinuationStore
s = ContinuationStore(sys.argv[1], "ns", 8 << 20, {"artifact_sha256": "A", "kv_layers": 2,
                                                   "nkv": 2, "hd": 64, "recurrent": False})
for e in list(s.catalog.values()):
    s.load(e)
k = np.zeros((2, 40, 2, 64), np.float32)
s.put(LaneImage(np.arange(40, dtype=np.int32), k, k))
"""


def _image(rng, n: int) -> LaneImage:
    k = rng.standard_normal((2, n, 2, 64)).astype(np.float32)
    return LaneImage(rng.integers(0, 1000, n).astype(np.int32), k, k * 0.5)


def _copied_store(tmp_path) -> tuple[str, str]:
    """A store with six entries written through the store API, copied (closed) to
    ``root/ns`` as a backup or a migration would; returns (root, root/ns)."""
    rng = np.random.default_rng(0)
    s = ContinuationStore(str(tmp_path / "orig"), "ns", QUOTA, IDENTITY)
    for n in (40, 60, 80, 100, 30, 50):
        s.put(_image(rng, n))
    assert len(s) == 6
    s.close()
    root = tmp_path / "root"
    shutil.copytree(tmp_path / "orig" / "ns", root / "ns")
    return str(root), str(root / "ns")


def _child(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=120)


def _walk_unchecked(path: str) -> int:
    """Exit status of a child walking ``path`` without the size check (as LMDB reads it)."""
    return _child("import sys; from ninfer.store.store_check import walk; "
                  "walk(sys.argv[1], check_size=False)", path).returncode


def _damage_btree_pages(data_mdb: str) -> int:
    """Overwrite the second half of every B-tree (branch / leaf) page but the main DB's root
    (which names the two databases) with garbage; returns how many pages."""
    rng = np.random.default_rng(7)
    psize, n = 4096, 0
    with open(data_mdb, "r+b") as f:
        metas = []   # (txnid, main DB root) of meta pages 0 and 1; LMDB uses the newer
        for m in (0, 1):
            f.seek(m * psize + 128)
            root, _, txnid = struct.unpack("<QQQ", f.read(24))
            metas.append((txnid, root))
        main_root = max(metas)[1]
        for pgno in range(2, os.path.getsize(data_mdb) // psize):
            f.seek(pgno * psize)
            stored, _, flags = struct.unpack("<QHH", f.read(12))
            if stored == pgno and flags & 0x3 and pgno != main_root:
                f.seek(pgno * psize + psize // 2)
                f.write(rng.integers(0, 256, psize // 2, dtype=np.uint8).tobytes())
                n += 1
    return n


def _opens_quarantined_then_serves(root: str, path: str, damaged: bytes, why: str) -> None:
    """Opening ``root/ns`` moves it aside (byte for byte), starts empty, takes writes, and
    the fresh store reopens whole."""
    s = ContinuationStore(root, "ns", QUOTA, IDENTITY)
    assert s.quarantined is not None
    moved_to, reason = s.quarantined
    assert why in reason
    assert os.path.dirname(moved_to) == root and \
        os.path.basename(moved_to).startswith("ns.corrupt-")
    with open(os.path.join(moved_to, "data.mdb"), "rb") as f:
        assert f.read() == damaged          # kept as found, for a post-mortem
    assert len(s) == 0 and s.foreign == 0 and s.path == path
    key, _ = s.put(_image(np.random.default_rng(1), 50))
    s.close()
    s = ContinuationStore(root, "ns", QUOTA, IDENTITY)
    assert s.quarantined is None and list(s.catalog) == [key]
    assert s.load(s.catalog[key]) is not None
    s.close()
    assert sorted(os.listdir(root)) == sorted(["ns", os.path.basename(moved_to)])


def test_a_truncated_store_is_moved_aside_and_a_fresh_one_serves(tmp_path):
    """A ``data.mdb`` cut to half (an interrupted copy): LMDB maps pages past the file's end,
    and reading one is SIGBUS, the process's end with nothing on stderr."""
    root, path = _copied_store(tmp_path)
    data = os.path.join(path, "data.mdb")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    with open(data, "rb") as f:
        damaged = f.read()
    assert _walk_unchecked(path) == -signal.SIGBUS
    r = _child(UNCHECKED, root)
    assert r.returncode == -signal.SIGBUS, r.stderr
    assert "truncated" in store_check.check(path)
    _opens_quarantined_then_serves(root, path, damaged, "truncated")


def test_a_store_with_damaged_btree_pages_is_moved_aside_and_a_fresh_one_serves(tmp_path):
    """Garbage in the middle of the B-tree pages: the walk meets LMDB's own corruption
    error, which the unchecked store raised at open (not ``StoreUnavailable``: the server
    did not start), and the store is moved aside."""
    root, path = _copied_store(tmp_path)
    data = os.path.join(path, "data.mdb")
    assert _damage_btree_pages(data) > 0
    with open(data, "rb") as f:
        damaged = f.read()
    assert _walk_unchecked(path) != 0
    r = _child(UNCHECKED, root)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith(
        "lmdb.CorruptedError"), r.stderr
    assert "CorruptedError" in store_check.check(path)
    _opens_quarantined_then_serves(root, path, damaged, "MDB_CORRUPTED")


def test_a_check_that_dies_is_a_verdict_and_a_whole_store_is_left_alone(tmp_path):
    """A whole store (and a directory with no store yet) passes and stays where it is. The
    signal that ends the check child is the reason given; a meta page whose last page was cut
    back with the file passes the size check, and LMDB then refuses the pages past it."""
    root, path = _copied_store(tmp_path)
    assert store_check.check(path) is None
    assert store_check.check(str(tmp_path / "none")) is None
    s = ContinuationStore(root, "ns", QUOTA, IDENTITY)
    assert s.quarantined is None and len(s) == 6 and os.listdir(root) == ["ns"]
    s.close()
    data, psize = os.path.join(path, "data.mdb"), 4096
    pages = os.path.getsize(data) // psize // 2
    with open(data, "r+b") as f:
        f.truncate(pages * psize)
    assert store_check.check(path, check_size=False) == \
        "reading it killed the check process (SIGBUS)"
    with open(data, "r+b") as f:
        txnids = []   # of meta pages 0 and 1 (LMDB uses the newer), 144 bytes in
        for m in (0, 1):
            f.seek(m * psize + 144)
            txnids.append(struct.unpack("<Q", f.read(8))[0])
        f.seek(int(np.argmax(txnids)) * psize + 136)   # its last page number
        f.write(struct.pack("<Q", pages - 1))
    s = ContinuationStore(root, "ns", QUOTA, IDENTITY)
    assert s.quarantined[1].startswith("PageNotFoundError") and len(s) == 0
    s.close()


def test_a_corrupt_entry_dropped_at_load_is_reported(tmp_path):
    """``load``'s ``on_drop`` hears of a corrupt entry it deleted (the engine emits
    ``store.entry_dropped``), not of one that was already gone."""
    rng = np.random.default_rng(2)
    s = ContinuationStore(str(tmp_path), "ns", QUOTA, IDENTITY)
    bad, _ = s.put(_image(rng, 40))
    gone, _ = s.put(_image(rng, 30))
    with s.env.begin(write=True) as txn:   # flip a byte of one payload
        raw = bytearray(txn.get(bad, db=s._images))
        raw[len(raw) // 2] ^= 0xFF
        txn.put(bad, bytes(raw), db=s._images)
    dropped = []
    entry = s.catalog[bad]
    assert s.load(entry, on_drop=lambda e, why: dropped.append((e.key, why))) is None
    assert dropped == [(bad, "ValueError: payload digest mismatch")] and bad not in s.catalog
    entry = s.catalog[gone]
    s._delete(gone)      # evicted between the look-up and the load
    assert s.load(entry, on_drop=lambda e, why: dropped.append((e.key, why))) is None
    assert len(dropped) == 1
    s.close()

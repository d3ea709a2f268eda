"""Slot persistence in the engine (``SlotCommand``: save / restore / erase between steps) and
the slot file format, on the tiny Qwen3.5 hybrid (KV plus recurrent state): a saved session
restored into another lane of a fresh engine continues exactly as a cold prefill would; every
refusal leaves the lane and the page pool as they were."""
from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

from ninfer.engine.continuation import LaneImage
from ninfer.engine.engine import session_digest
from ninfer.store.continuation_store import check_layout
from ninfer.store.slot_file import (SlotFileError, read_slot_file, valid_filename,
                                    write_slot_file)
from test_engine_spec import mtp_bundle  # noqa: F401  (the fixture, same folder)
from test_prefix_reuse import Driver, _cold, _ids  # same folder

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hybrid(mtp_bundle):
    return mtp_bundle[:2]


def identity(d: Driver) -> dict:
    return {"artifact_sha256": "test", **d.engine.layout_identity()}


def test_a_hybrid_session_saved_restores_into_another_lane_of_a_fresh_engine(hybrid, tmp_path):
    model, tok = hybrid
    rng = np.random.default_rng(7)
    p1 = rng.integers(0, 256, 50).tolist()
    d = Driver(model, tok, max_concurrency=2, max_context=512)
    _, o1 = d.ask(p1, max_tokens=9, ignore_eos=True)
    lane = d.engine.lanes[0]
    frontier = p1 + _ids(o1)[:-1]
    assert lane.retained and lane.tokens == frontier
    digest = session_digest(frontier)

    bad = d.slot("save", 0, if_digest="0" * 16)
    assert not bad.ok and bad.code == "slot_session_mismatch" and lane.retained
    res = d.slot("save", 0, if_digest=digest)
    assert res.ok and res.tokens == len(frontier) and res.session_digest == digest
    assert res.image.conv is not None   # the recurrent state at exactly that frontier
    empty = d.slot("save", 1)
    assert not empty.ok and empty.code == "slot_save_failed"
    path = str(tmp_path / "s1.slot")
    n = write_slot_file(path, res.image, identity(d))
    assert n == os.path.getsize(path) and n > res.image.nbytes - res.image.tokens.nbytes

    # "restart": a fresh engine, the session restored into lane 1 over another session there
    d2 = Driver(model, tok, max_concurrency=2, max_context=512, l2_bytes=1 << 30)
    other = rng.integers(0, 256, 30).tolist()
    d2.ask(other, max_tokens=4, ignore_eos=True)
    d2.ask(rng.integers(0, 256, 20).tolist(), max_tokens=4, ignore_eos=True)
    assert d2.engine.lanes[1].retained
    image, n_read = read_slot_file(path, identity(d2),
                                   lambda im: check_layout(d2.engine.layout_identity(), im))
    assert n_read == n and image.tokens.tolist() == frontier
    res2 = d2.slot("restore", 1, image=image)
    assert res2.ok and res2.tokens == len(frontier) and res2.session_digest == digest
    lane1 = d2.engine.lanes[1]
    assert lane1.retained and lane1.tokens == frontier
    assert int(d2.engine.kv.lengths[1]) == len(frontier)
    (evicted,) = [e for e in d2.rec.kinds("lane.evicted") if e.reason == "restored"]
    assert evicted.lane == 1 and len(d2.engine.l2) == 1   # what lane 1 held went to L2
    assert d2.rec.kinds("lane.retained")[-1].session_digest == digest

    follow = p1 + _ids(o1) + rng.integers(0, 256, 12).tolist()
    r, o = d2.ask(follow, max_tokens=9, ignore_eos=True)
    lk = d2.lookup(r)
    assert lk.lane == 1 and lk.path == "append_frontier" and lk.cached_tokens == len(frontier)
    assert d2.prefilled(r) == len(follow) - len(frontier)
    assert _ids(o) == _cold(model, tok, follow, max_tokens=9, ignore_eos=True)

    # erase: a wrong digest changes nothing; the right one drops the session (not to L2)
    held = session_digest(d2.engine.lanes[1].tokens)
    assert d2.slot("erase", 1, if_digest=digest).code == "slot_session_mismatch"
    before = len(d2.engine.l2)
    res3 = d2.slot("erase", 1, if_digest=held)
    assert res3.ok and res3.tokens > len(frontier) and not d2.engine.lanes[1].retained
    assert len(d2.engine.l2) == before and int(d2.engine.kv.lengths[1]) == 0
    assert d2.slot("erase", 1).tokens == 0   # nothing held: erases nothing


def test_busy_and_oversized_restores_are_refused_and_change_nothing(hybrid, tmp_path):
    model, tok = hybrid
    rng = np.random.default_rng(8)
    d = Driver(model, tok, max_concurrency=1, max_context=64)
    d.ask(rng.integers(0, 256, 20).tolist(), max_tokens=3, ignore_eos=True)
    kept = list(d.engine.lanes[0].tokens)
    img = d.slot("save", 0).image
    too_long = LaneImage(np.zeros(64, np.int32), np.zeros((img.k.shape[0], 64) + img.k.shape[2:],
                                                            np.float32),
                         np.zeros((img.v.shape[0], 64) + img.v.shape[2:], np.float32),
                         img.conv, img.ssm)
    res = d.slot("restore", 0, image=too_long)
    assert res.code == "slot_restore_failed" and d.engine.lanes[0].tokens == kept
    wrong = LaneImage(img.tokens, img.k[:, :, :1], img.v[:, :, :1], img.conv, img.ssm)
    res = d.slot("restore", 0, image=wrong)   # refused before the lane's session is evicted
    assert res.code == "slot_restore_failed" and d.engine.lanes[0].tokens == kept
    # a request on the lane: every action is refused with slot_busy
    rid, out = d.submit(rng.integers(0, 256, 20).tolist(), max_tokens=30, ignore_eos=True)
    d.engine.step()
    assert d.engine.lanes[0].req is not None
    for action in ("save", "restore", "erase"):
        res = d.slot(action, 0, image=img if action == "restore" else None)
        assert not res.ok and res.code == "slot_busy"
    d.engine.cancel(rid)
    d.run()


def _saved(hybrid, tmp_path, n_prompt: int):
    """(driver, the image its lane 0 saved after an ``n_prompt``-token request, the runtime
    identity, a file path under ``tmp_path``)."""
    model, tok = hybrid
    d = Driver(model, tok, max_concurrency=1, max_context=256)
    d.ask(list(range(n_prompt)), max_tokens=3, ignore_eos=True)
    return d, d.slot("save", 0).image, identity(d), str(tmp_path / "a")


def test_slot_files_refuse_what_they_cannot_trust(hybrid, tmp_path):
    _, img, ident, path = _saved(hybrid, tmp_path, 40)
    n = write_slot_file(path, img, ident)
    back, _ = read_slot_file(path, ident)
    for a, b in zip([back.k, back.v, *back.conv, *back.ssm], [img.k, img.v, *img.conv,
                                                                  *img.ssm]):
        np.testing.assert_array_equal(a, b)

    def refused(data: bytes, ident_=ident, match="") -> None:
        p = str(tmp_path / "b")
        with open(p, "wb") as f:
            f.write(data)
        with pytest.raises(SlotFileError, match=match):
            read_slot_file(p, ident_)

    raw = open(path, "rb").read()
    refused(raw[:-1], match="truncated")
    refused(raw[:-7] + bytes([raw[-7] ^ 1]) + raw[-6:], match="checksum")
    # a flipped bit of a token id (the header's ledger): its K / V belong to the other token
    at = raw.index(np.arange(40, dtype="<i4").tobytes()) + 24 * 4
    refused(raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1:], match="checksum")
    refused(b"GGUF" + raw[4:], match="not a ninfer slot file")
    refused(raw, {**ident, "artifact_sha256": "other"}, match="another model")
    refused(raw[:12] + b"\xc1" + raw[13:], match="malformed header")
    with pytest.raises(SlotFileError, match="cannot read"):
        read_slot_file(str(tmp_path / "missing"), ident)
    # a failed save leaves the old file whole and no temporary file behind
    import ninfer.store.slot_file as sf

    def boom(*_):
        raise OSError(28, "No space left on device")
    real = sf.os.replace
    sf.os.replace = boom
    try:
        with pytest.raises(OSError):
            write_slot_file(path, img, ident)
    finally:
        sf.os.replace = real
    assert open(path, "rb").read() == raw and sorted(os.listdir(tmp_path)) == ["a", "b"]
    assert n == len(raw)


@pytest.mark.parametrize("name,ok", [("s1.bin", True), ("A-b_c.9", True), ("x" * 128, True),
                                     ("x" * 129, False), ("", False), (".hidden", False),
                                     ("../etc", False), ("a/b", False), ("é", False),
                                     (None, False), (3, False)])
def test_slot_filenames(name, ok):
    assert valid_filename(name) is ok


def _recraft(raw: bytes, edit) -> bytes:
    """``raw`` with its msgpack header passed through ``edit`` (the payload kept as is) and
    its checksum made again, as a crafted file's would be."""
    import struct

    import msgpack

    from ninfer.store.slot_file import _checksum
    (hlen,) = struct.unpack("<I", raw[8:12])
    h = msgpack.unpackb(raw[12:12 + hlen])
    edit(h)
    with contextlib.suppress(Exception):   # (an edit the checksum cannot even read)
        sha = _checksum(h["version"], bytes(h["tokens"]), h["checkpoints"], h["mtp_start"])
        sha.update(raw[12 + hlen:])
        h["payload_sha256"] = sha.hexdigest()
    head = msgpack.packb(h)
    return raw[:8] + struct.pack("<I", len(head)) + head + raw[12 + hlen:]


def test_crafted_slot_files_are_refused_before_anything_is_allocated(hybrid, tmp_path):
    """A header that keeps the payload's size and checksum but names another dtype (4 bytes
    too: int32, a 1-char string), a negative or empty shape, or no tokens, is refused; the
    engine refuses a non-float32 image before it touches the lane's session."""
    d, img, ident, path = _saved(hybrid, tmp_path, 30)
    write_slot_file(path, img, ident)
    raw = open(path, "rb").read()

    def dtype(dt):
        return lambda h: [a.__setitem__(1, dt) for a in h["arrays"]]

    def shape(i, v):
        return lambda h: h["arrays"][0][2].__setitem__(i, v)

    for edit, match in [(dtype("<i4"), "float32"), (dtype("<U1"), "float32"),
                        (shape(0, -1), "float32"), (lambda h: h["arrays"][0].__setitem__(2, []),
                                                    "float32"),
                        (lambda h: h.__setitem__("tokens", b""), "no tokens")]:
        p = tmp_path / "c"
        p.write_bytes(_recraft(raw, edit))
        with pytest.raises(SlotFileError, match=match):
            read_slot_file(str(p), ident)
    with pytest.raises(SlotFileError, match="a lane holds 20"):
        read_slot_file(path, ident, max_tokens=20)   # from the header, before the payload
    kept = list(d.engine.lanes[0].tokens)
    bad = LaneImage(img.tokens, img.k.astype(np.int32), img.v, img.conv, img.ssm)
    res = d.slot("restore", 0, image=bad)
    assert res.code == "slot_restore_failed" and "float32" in res.message
    assert d.engine.lanes[0].tokens == kept   # refused before the lane's session was evicted


def test_only_regular_files_are_read_and_saves_never_share_a_temporary_file(hybrid, tmp_path):
    import threading

    from ninfer.store.slot_file import sweep_temporary_files
    model, tok = hybrid
    d = Driver(model, tok, max_concurrency=2, max_context=256)
    d.ask(list(range(30)), max_tokens=3, ignore_eos=True)
    d.ask(list(range(100, 140)), max_tokens=3, ignore_eos=True)
    imgs = [d.slot("save", i).image for i in (0, 1)]
    ident = identity(d)
    target = str(tmp_path / "same")
    threads = [threading.Thread(target=write_slot_file, args=(target, im, ident))
               for im in imgs * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    back, _ = read_slot_file(target, ident)   # whole: one of the two sessions
    assert any(back.tokens.tolist() == im.tokens.tolist() for im in imgs)
    assert sorted(os.listdir(tmp_path)) == ["same"]
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(SlotFileError, match="not a regular file"):
        read_slot_file(str(tmp_path / "fifo"), ident)
    os.symlink(target, tmp_path / "link")
    with pytest.raises(SlotFileError, match="cannot read"):
        read_slot_file(str(tmp_path / "link"), ident)
    old, new = tmp_path / ".same.tmp-abc", tmp_path / ".same.tmp-def"
    old.write_bytes(b"x")
    new.write_bytes(b"y")
    os.utime(old, (0, 0))
    assert sweep_temporary_files(str(tmp_path)) == 1
    assert not old.exists() and new.exists() and (tmp_path / "same").exists()


def test_turn_checkpoints_travel_in_slot_files(hybrid, tmp_path):
    """A hybrid lane's turn checkpoint (here also its user-turn anchor) is saved with the
    session; after a restore in a fresh engine, a next turn that re-renders the last answer
    resumes at it as it would have in the lane that saved it."""
    model, tok = hybrid
    rng = np.random.default_rng(12)
    op = [60, 61, 62]
    hist = rng.integers(0, 256, 40).tolist()
    d = Driver(model, tok, max_concurrency=1, max_context=512, min_restore_tokens=16)
    _, o1 = d.ask(hist + op, max_tokens=8, ignore_eos=True, checkpoint_at=len(hist),
                  anchor_at=len(hist))
    res = d.slot("save", 0)
    (mark,) = res.image.checkpoints
    assert mark[0] == len(hist) and set(mark[3]) == {"turn", "anchor"}
    path = str(tmp_path / "ck")
    write_slot_file(path, res.image, identity(d))
    d2 = Driver(model, tok, max_concurrency=2, max_context=512, min_restore_tokens=16)
    image, _ = read_slot_file(path, identity(d2))
    assert image.checkpoints[0][0] == len(hist)
    for a, b in zip(image.checkpoints[0][1] + image.checkpoints[0][2], mark[1] + mark[2]):
        np.testing.assert_array_equal(a, b)
    assert d2.slot("restore", 1, image=image).ok
    (ret,) = d2.rec.kinds("lane.retained")
    assert ret.checkpoint_tokens == ret.anchor_tokens == len(hist)
    p2 = hist + op + rng.integers(0, 256, 15).tolist() + op
    r, o = d2.ask(p2, max_tokens=8, ignore_eos=True)
    lk = d2.lookup(r)
    assert lk.lane == 1 and lk.path == "restore_turn_checkpoint"
    assert lk.cached_tokens == len(hist)
    assert _ids(o) == _cold(model, tok, p2, max_tokens=8, ignore_eos=True)
    # a header that names a checkpoint outside the session is refused
    raw = open(path, "rb").read()
    bad = tmp_path / "bad"
    bad.write_bytes(_recraft(raw, lambda h: h["checkpoints"][0].__setitem__(0, 10 ** 6)))
    with pytest.raises(SlotFileError, match="checkpoint"):
        read_slot_file(str(bad), identity(d2))

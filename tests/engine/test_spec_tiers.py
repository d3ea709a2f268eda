"""Speculative (``--spec mtp``) sessions beyond the lanes: an image of a speculative lane carries
its pending MTP rows (``LaneImage.mtp_rows``), so a speculative request resumes it from L2, L3 or
a slot file at its frontier, with the MTP head's KV exactly a cold prefill's; an image without
them (a plain request's lane, an older slot file) is not resumed by one. Tiny Qwen3.5 with an
MTP head (test_engine_spec's model), greedy tokens equal to a cold prefill's every time."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ninfer.store.continuation_store import ContinuationStore
from ninfer.store.continuation_store import check_layout
from ninfer.store.slot_file import (SlotFileError, identity_digest, read_slot_file,
                                    write_slot_file)
from test_engine_spec import mtp_bundle  # noqa: F401  (the fixture, same folder)
from test_prefix_reuse import Driver, _ids  # same folder
from test_slot_persistence import _recraft  # same folder

pytestmark = pytest.mark.slow
CFG = {"max_concurrency": 1, "max_context": 512, "min_restore_tokens": 16, "spec": "mtp"}


@pytest.fixture(scope="module")
def hybrid(mtp_bundle):
    return mtp_bundle[:2]


def _mtp_k(d: Driver, lane: int, n: int) -> np.ndarray:
    """The MTP head's K (the cache's last attention layer) of ``lane``'s first ``n``
    positions, on the host."""
    k = d.engine.kv.kv.k[-1]
    k = k.get() if hasattr(k, "get") else k   # (a CuPy array on the GPU)
    return np.concatenate([k[p] for p in d.engine.lanes[lane].pages])[:n]


def _cold(model, tok, prompt, max_tokens=8):
    """(tokens, MTP K of every prompt position) of ``prompt`` prefilled cold (a fresh engine,
    whose lane keeps what it computed)."""
    d = Driver(model, tok, **CFG)
    rid, out = d.ask(prompt, max_tokens=max_tokens, ignore_eos=True)
    assert d.lookup(rid).cached_tokens == 0
    return _ids(out), _mtp_k(d, d.lookup(rid).lane, len(prompt))


def _resumed(d: Driver, model, tok, prompt, depth: int, source: str,
             path: str = "append_frontier") -> None:
    """``prompt`` resumes ``depth`` tokens from ``source`` (by ``path``) and then runs as a
    cold prefill does: the same tokens, the MTP head's KV of every prompt position the same."""
    rid, out = d.ask(prompt, max_tokens=8, ignore_eos=True)
    lk = d.lookup(rid)
    assert (lk.source, lk.path, lk.cached_tokens) == (source, path, depth)
    ids, k = _cold(model, tok, prompt)
    assert _ids(out) == ids
    got = _mtp_k(d, lk.lane, len(prompt))
    # (the GPU's passes round apart where one pass is split in two: 1.5e-4 seen on an H100)
    tol = 1e-3 if hasattr(d.engine.kv.kv.k[-1], "get") else 1e-4
    np.testing.assert_allclose(got, k, rtol=tol, atol=tol)
    assert np.abs(got[depth - 3:depth + 3]).max() > 0   # (rows at the seam were written)


def _session(seed: int):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, 40).tolist(), rng.integers(0, 256, 30).tolist(), \
        rng.integers(0, 256, 20).tolist()


def test_a_speculative_session_resumes_from_l2(hybrid):
    model, tok = hybrid
    pa, pb, more = _session(31)
    d = Driver(model, tok, **CFG, l2_bytes=1 << 30)
    _, oa = d.ask(pa, max_tokens=8, ignore_eos=True)
    d.ask(pb, max_tokens=8, ignore_eos=True)   # A goes to L2 with its MTP rows
    (dem,) = d.rec.kinds("cache.demoted")
    (image,) = d.engine.tiers.l2._images.values()
    assert image.mtp_rows is not None and image.mtp_start + image.mtp_rows.shape[0] == image.n
    assert dem.bytes == image.nbytes   # (the rows counted in L2's bytes)
    _resumed(d, model, tok, pa + _ids(oa) + more, len(pa) + 7, "l2")


def test_a_plain_requests_image_is_not_resumed_speculatively(hybrid):
    """A request with logprobs decodes plainly beside speculative ones: its lane's MTP head saw
    nothing, so its image has no rows; a speculative request prefills cold, a plain one
    resumes it."""
    model, tok = hybrid
    pa, pb, more = _session(32)
    d = Driver(model, tok, **CFG, l2_bytes=1 << 30)
    _, oa = d.ask(pa, max_tokens=8, ignore_eos=True, logprobs=0)
    d.ask(pb, max_tokens=8, ignore_eos=True)
    (image,) = d.engine.tiers.l2._images.values()
    assert image.mtp_rows is None
    follow = pa + _ids(oa) + more
    rid, out = d.ask(follow, max_tokens=8, ignore_eos=True)
    assert d.lookup(rid).cached_tokens == 0 and _ids(out) == _cold(model, tok, follow)[0]
    rid, _ = d.ask(follow, max_tokens=2, ignore_eos=True, logprobs=0)
    assert (d.lookup(rid).source, d.lookup(rid).cached_tokens) == ("l2", len(pa) + 7)


def test_a_speculative_session_resumes_from_l3_after_a_restart(hybrid, tmp_path):
    model, tok = hybrid
    pa, _, more = _session(33)

    def with_store():
        d = Driver(model, tok, **CFG, turn_checkpoints=8)
        ident = {"artifact_sha256": "t", **d.engine.layout_identity()}
        d.engine.attach_store(ContinuationStore(str(tmp_path), "t", 64 << 20, ident),
                              persist_min_tokens=16)
        return d

    def restart(d):
        d.engine.persister.flush()
        d.engine.tiers.close()
        d.engine.tiers.store.close()
        return with_store()   # nothing in its lanes

    d = with_store()
    _, oa = d.ask(pa, max_tokens=8, ignore_eos=True, checkpoint_at=30)
    d2 = restart(d)
    (entry,) = d2.engine.tiers.store.catalog.values()
    assert entry.mtp and entry.mtp_marks == (30, len(pa) + 7)
    _resumed(d2, model, tok, pa + _ids(oa) + more, len(pa) + 7, "l3")
    # an edit after the checkpoint resumes there (the image's checkpoint keeps its MTP row)
    d3 = restart(d2)
    _resumed(d3, model, tok, pa[:30] + more, 30, "l3", "restore_turn_checkpoint")


def test_a_speculative_session_travels_in_a_slot_file(hybrid, tmp_path):
    model, tok = hybrid
    pa, _, more = _session(34)
    d = Driver(model, tok, **CFG)
    _, oa = d.ask(pa, max_tokens=8, ignore_eos=True)
    res = d.slot("save", 0)
    assert res.image.mtp_rows is not None
    ident = {"artifact_sha256": "t", **d.engine.layout_identity()}
    write_slot_file(str(tmp_path / "s"), res.image, ident)
    follow = pa + _ids(oa) + more

    d2 = Driver(model, tok, **CFG)
    image, _ = read_slot_file(str(tmp_path / "s"), ident)
    np.testing.assert_array_equal(image.mtp_rows, res.image.mtp_rows)
    assert image.mtp_start == res.image.mtp_start
    assert d2.slot("restore", 0, image=image).ok
    _resumed(d2, model, tok, follow, len(pa) + 7, "l1")

    # a file without the rows (as version 2 wrote them) restores, for plain requests only
    d3 = Driver(model, tok, **CFG)
    bare = dataclasses.replace(res.image, mtp_rows=None, mtp_start=0)
    assert d3.slot("restore", 0, image=bare).ok
    rid, out = d3.ask(follow, max_tokens=8, ignore_eos=True)
    assert d3.lookup(rid).cached_tokens == 0 and _ids(out) == _cold(model, tok, follow)[0]

    # rows that do not cover the session's end, or in a version 2 file, are refused
    raw = (tmp_path / "s").read_bytes()
    for name, edit in (("off", lambda h: h.update(mtp_start=image.mtp_start + 1)),
                       ("v2", lambda h: h.update(version=2, identity=identity_digest(ident, 2)))):
        bad = tmp_path / name
        bad.write_bytes(_recraft(raw, edit))
        with pytest.raises(SlotFileError, match="MTP rows"):
            read_slot_file(str(bad), ident, check=lambda im: check_layout(
                d.engine.layout_identity(), im))


def test_a_speculative_lane_publishes_a_breakpoint_siblings_resume(hybrid):
    """A prompt-cache breakpoint on a speculative lane publishes the prefix with the hidden row
    before it; a sibling conversation (another speculative request, the same system prefix)
    resumes it and pairs that row with its own next token, as a cold prefill would."""
    model, tok = hybrid
    rng = np.random.default_rng(35)
    system = rng.integers(0, 256, 40).tolist()
    pa = system + rng.integers(0, 256, 23).tolist()
    pb = system + rng.integers(0, 256, 17).tolist()
    d = Driver(model, tok, **CFG, l2_bytes=1 << 30)
    ra, oa = d.ask(pa, max_tokens=6, ignore_eos=True, publish_at=(len(system),))
    (pub,) = d.rec.kinds("cache.published")
    assert (pub.request_id, pub.tokens, pub.tiers) == (ra, len(system), ["l2"])
    (image,) = d.engine.tiers.l2._images.values()
    assert (image.mtp_start, image.mtp_rows.shape[0]) == (len(system) - 1, 1)
    assert _ids(oa) == _cold(model, tok, pa, max_tokens=6)[0]
    _resumed(d, model, tok, pb, len(system), "l2")
    assert len(d.rec.kinds("cache.published")) == 1


def test_a_speculative_request_waits_for_a_speculative_builder(hybrid):
    """Two speculative conversations with the same unpublished prefix arrive together: one
    lane builds it, the other request waits (``request.deferred``) and resumes the published
    image; a speculative request does not wait for a plain builder (``logprobs``), whose image
    it could not resume."""
    model, tok = hybrid
    rng = np.random.default_rng(36)
    system = rng.integers(0, 256, 40).tolist()
    pa = system + rng.integers(0, 256, 12).tolist()
    pb = system + rng.integers(0, 256, 13).tolist()
    for plain in (False, True):
        d = Driver(model, tok, **(CFG | {"max_concurrency": 2}), l2_bytes=1 << 30)
        ra, oa = d.submit(pa, max_tokens=4, ignore_eos=True, publish_at=(40,),
                          logprobs=0 if plain else None)
        rb, ob = d.submit(pb, max_tokens=4, ignore_eos=True, publish_at=(40,))
        d.run()
        lk = d.lookup(rb)
        if plain:
            assert not d.rec.kinds("request.deferred") and lk.cached_tokens == 0
            assert d.prefilled(rb) == len(pb)
            continue
        (w,) = d.rec.kinds("request.deferred")
        assert (w.request_id, w.builder_request, w.tokens) == (rb, ra, 40)
        assert (lk.source, lk.cached_tokens, d.prefilled(rb)) == ("l2", 40, len(pb) - 40)
        ids, k = _cold(model, tok, pb, max_tokens=4)
        assert _ids(ob) == ids
        np.testing.assert_allclose(_mtp_k(d, lk.lane, len(pb)), k, rtol=1e-4, atol=1e-4)


def test_checkpoints_keep_their_mtp_rows_in_l2_and_slot_files(hybrid, tmp_path):
    """A speculative lane's turn checkpoint keeps the hidden row before it; the row leaves with
    the session (L2 with the ring on, a slot file), so a regenerated answer resumes at the
    checkpoint from either, as in the lane that took it."""
    model, tok = hybrid
    rng = np.random.default_rng(37)
    op = [60, 61, 62]
    hist = rng.integers(0, 256, 40).tolist()
    regen = hist + op + rng.integers(0, 256, 15).tolist() + op   # another answer after hist
    d = Driver(model, tok, **CFG, l2_bytes=1 << 30, turn_checkpoints=8)
    d.ask(hist + op, max_tokens=8, ignore_eos=True, checkpoint_at=len(hist),
          anchor_at=len(hist))
    res = d.slot("save", 0)
    (mark,) = res.image.checkpoints
    assert mark.depth == len(hist) and mark.mtp_row.shape == (1, res.image.mtp_rows.shape[1])
    ident = {"artifact_sha256": "t", **d.engine.layout_identity()}
    write_slot_file(str(tmp_path / "s"), res.image, ident)
    d.ask(rng.integers(0, 256, 30).tolist(), max_tokens=4, ignore_eos=True)   # displaced
    (image,) = [im for im in d.engine.tiers.l2._images.values() if im.n > len(hist)]
    assert image.mtp_marks == (len(hist), image.n)
    _resumed(d, model, tok, regen, len(hist), "l2", "restore_turn_checkpoint")

    d2 = Driver(model, tok, **CFG)
    image, _ = read_slot_file(str(tmp_path / "s"), ident, check=lambda im: check_layout(
        d2.engine.layout_identity(), im))
    np.testing.assert_array_equal(image.checkpoints[0].mtp_row, mark.mtp_row)
    assert d2.slot("restore", 0, image=image).ok
    _resumed(d2, model, tok, regen, len(hist), "l1", "restore_turn_checkpoint")

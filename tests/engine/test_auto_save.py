"""``--auto-save-evicted`` in the engine (``autosave.py``, ``store/slot_spill.py``) on the real
SmolLM2, L1 only (no L2: a lost session comes back only from its slot file): more sessions
than lanes rotate through slot files and none re-prefills from zero after its first turn; each
spill is a ``slot.spilled`` event and its file restores to the same greedy tokens; an erase
never spills; a write that fails is a ``slot.spill_failed`` and serving goes on."""
from __future__ import annotations

import numpy as np
import pytest

from ninfer.engine.engine import session_digest
from ninfer.store.continuation_store import check_layout
from ninfer.store.slot_file import read_slot_file
from ninfer.store.slot_spill import SlotSpiller
from test_engine_spec import mtp_bundle  # noqa: F401  (the fixture, same folder)
from test_prefix_reuse import Driver, _cold, _ids, runtime  # noqa: F401  (same folder)

pytestmark = pytest.mark.slow


def _driver(rt, directory, lanes=2, **cfg) -> tuple[Driver, dict]:
    d = Driver(rt.model, rt.tokenizer, max_concurrency=lanes, max_context=512, **cfg)
    identity = {"artifact_sha256": "test", **d.engine.layout_identity()}
    d.engine.attach_autosave(SlotSpiller(str(directory), identity, d.bus))
    return d, identity


def _slot(d: Driver, action: str, lane: int, **kw):
    res = d.slot(action, lane, **kw)
    assert res.ok, res
    return res


def _spills(d: Driver) -> list:
    d.engine.spiller.flush()
    d.bus.flush()
    return d.rec.kinds("slot.spilled")


def _restore(d: Driver, identity: dict, path, lane: int, filename: str):
    image, _ = read_slot_file(str(path), identity,
                              lambda im: check_layout(d.engine.layout_identity(), im))
    return _slot(d, "restore", lane, image=image, filename=filename)


def test_more_sessions_than_lanes_rotate_through_slot_files_and_lose_nothing(runtime,
                                                                                 tmp_path):
    rt = runtime
    rng = np.random.default_rng(3)
    d, identity = _driver(rt, tmp_path)
    names = ["a", "b", "c"]
    held: dict[str, list] = {}   # each session's frontier (prompt + fed outputs)
    lane_of: dict[str, int] = {}
    # turn 1: a and b fill both lanes, saved once by the client; c's first turn takes one of
    # their lanes, and the session there is spilled to its file
    for s in names:
        prompt = rng.integers(100, 2000, 40).tolist()
        r, o = d.ask(prompt, max_tokens=4, ignore_eos=True)
        lane = d.lookup(r).lane
        assert d.lookup(r).cached_tokens == 0
        held[s], lane_of[s] = prompt + _ids(o)[:-1], lane
        if s != "c":
            _slot(d, "save", lane, filename=s)
        else:
            (spill,) = _spills(d)
            lost = next(x for x in ("a", "b") if lane_of[x] == lane)
            assert spill.filename == lost and spill.reason == "reassigned"
            assert spill.lane == lane and spill.tokens == len(held[lost])
            assert spill.session_digest == session_digest(held[lost])
            image, _ = read_slot_file(str(tmp_path / lost), identity)
            assert image.tokens.tolist() == held[lost]
            lane_of[lost] = None
            _slot(d, "save", lane, filename="c")
    # turns 2..4: each session is restored from its file into the lane of the session used
    # longest ago (llama.cpp-style rotation, no explicit save after the first): the restore
    # spills that lane's session, and the turn reuses the whole restored frontier
    for turn in range(3):
        for s in names:
            if lane_of[s] is None:
                victim = min((x for x in names if lane_of[x] is not None and x != s),
                             key=lambda x: d.engine.lanes[lane_of[x]].retained_t)
                lane = lane_of[victim]
                before = len(_spills(d))
                res = _restore(d, identity, tmp_path / s, lane, s)
                assert res.tokens == len(held[s])
                spills = _spills(d)[before:]
                assert [(x.filename, x.reason, x.tokens) for x in spills] == \
                    [(victim, "restored", len(held[victim]))]
                lane_of[victim], lane_of[s] = None, lane
            follow = held[s] + rng.integers(100, 2000, 6).tolist()
            r, o = d.ask(follow, max_tokens=3, ignore_eos=True)
            lk = d.lookup(r)
            assert lk.lane == lane_of[s] and lk.cached_tokens == len(held[s]) > 0
            assert d.prefilled(r) == len(follow) - len(held[s])
            held[s] = follow + _ids(o)[:-1]
    assert not d.rec.kinds("slot.spill_failed")
    # what a file holds decodes exactly as the session would have in its lane
    spilled = [x for x in names if lane_of[x] is None]
    s = spilled[0]
    image, _ = read_slot_file(str(tmp_path / s), identity)
    assert image.tokens.tolist() == held[s]
    follow = held[s] + rng.integers(100, 2000, 5).tolist()
    (tmp_path / "other").mkdir()
    d2, _ = _driver(rt, tmp_path / "other", lanes=1)
    _restore(d2, identity, tmp_path / s, 0, s)
    r, o = d2.ask(follow, max_tokens=6, ignore_eos=True)
    assert d2.lookup(r).cached_tokens == len(held[s])
    assert _ids(o) == _cold(rt.model, rt.tokenizer, follow, max_tokens=6, ignore_eos=True)
    d.engine.stop()
    d2.engine.stop()


def test_erase_never_spills_and_a_failed_write_keeps_serving(runtime, tmp_path, capsys):
    rt = runtime
    rng = np.random.default_rng(4)
    d, identity = _driver(rt, tmp_path, lanes=1)
    p1 = rng.integers(100, 2000, 30).tolist()
    d.ask(p1, max_tokens=3, ignore_eos=True)
    _slot(d, "save", 0, filename="s1")
    _slot(d, "erase", 0)
    d.ask(rng.integers(100, 2000, 30).tolist(), max_tokens=3, ignore_eos=True)
    assert _spills(d) == [] and not (tmp_path / "s1").exists()

    # a session bound to a file its directory cannot take: the spill fails, the request runs
    _slot(d, "save", 0, filename="s2")
    (tmp_path / "s2").mkdir()   # the rename over a directory fails
    r, o = d.ask(rng.integers(100, 2000, 30).tolist(), max_tokens=3, ignore_eos=True)
    assert len(_ids(o)) == 3 and d.lookup(r).lane == 0
    (failed,) = d.rec.kinds("slot.spill_failed")
    assert failed.filename == "s2" and failed.reason == "reassigned" and failed.tokens > 30
    assert "auto-save of slot 0's session to s2 failed" in capsys.readouterr().err
    assert (tmp_path / "s2").is_dir() and not list(tmp_path.glob(".s2*"))   # no leftovers
    # a request continuing a bound session keeps the binding: no spill when it grows
    _slot(d, "save", 0, filename="s3")
    grown = list(d.engine.lanes[0].tokens) + rng.integers(100, 2000, 5).tolist()
    r, _ = d.ask(grown, max_tokens=3, ignore_eos=True)
    assert d.lookup(r).cached_tokens == len(grown) - 5 and d.engine.lanes[0].slot_file == "s3"
    assert _spills(d) == []
    d.engine.stop()


def test_a_hybrid_spill_carries_the_turn_checkpoints(mtp_bundle, tmp_path):
    """On the tiny Qwen3.5 hybrid the spilled file holds what a save writes: the recurrent state
    at the frontier and the turn checkpoint, which a restore resumes at."""
    model, tok = mtp_bundle[:2]
    rng = np.random.default_rng(12)
    op = [60, 61, 62]
    hist = rng.integers(0, 256, 40).tolist()
    d = Driver(model, tok, max_concurrency=1, max_context=512, min_restore_tokens=16)
    identity = {"artifact_sha256": "test", **d.engine.layout_identity()}
    d.engine.attach_autosave(SlotSpiller(str(tmp_path), identity, d.bus))
    d.ask(hist + op, max_tokens=8, ignore_eos=True, checkpoint_at=len(hist),
          anchor_at=len(hist))
    _slot(d, "save", 0, filename="h")
    held = list(d.engine.lanes[0].tokens)
    d.ask(rng.integers(0, 256, 30).tolist(), max_tokens=3, ignore_eos=True)   # a stranger
    (spill,) = _spills(d)
    assert spill.filename == "h" and spill.reason == "reassigned" and spill.tokens == len(held)
    image, _ = read_slot_file(str(tmp_path / "h"), identity)
    assert image.tokens.tolist() == held and image.conv is not None
    (mark,) = image.checkpoints
    assert mark.depth == len(hist) and set(mark.roles) == {"turn", "anchor"}
    _restore(d, identity, tmp_path / "h", 0, "h")
    p2 = hist + op + rng.integers(0, 256, 15).tolist() + op
    r, o = d.ask(p2, max_tokens=8, ignore_eos=True)
    lk = d.lookup(r)
    assert lk.path == "restore_turn_checkpoint" and lk.cached_tokens == len(hist)
    assert _ids(o) == _cold(model, tok, p2, max_tokens=8, ignore_eos=True)
    d.engine.stop()

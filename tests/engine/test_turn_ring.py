"""The turn-checkpoint ring (``--turn-checkpoints N``) on the tiny Qwen3.5 hybrid: a multi-turn
conversation whose fifth turn edits the second turn's message resumes at the ring entry below
the edit, prefills only what follows it, and decodes as a cold prefill; the ring holds at most
N entries; it survives L2 demotion, L3 and a slot save + restore; N = 0 is today's engine."""
from __future__ import annotations

import numpy as np
import pytest

from ninfer.store.slot_file import read_slot_file, write_slot_file
from test_engine_spec import mtp_bundle  # noqa: F401  (the fixture, same folder)
from test_prefix_reuse import Driver, _cold, _ids  # same folder

pytestmark = pytest.mark.slow
OP = [60, 61, 62]   # stands for the generation opener ("<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def hybrid(mtp_bundle):
    return mtp_bundle[:2]


class Chat:
    """A conversation as a thinking template renders it: each turn's prompt is the history
    (earlier turns' answers re-rendered without their thinking, then the new user message),
    then the opener; the turn checkpoint (and anchor) at the history's end."""

    def __init__(self, seed: int, first: int = 40):
        self.rng = np.random.default_rng(seed)
        self.messages = [self.rng.integers(0, 256, first).tolist()]   # system + user 1
        self.answers: list[list[int]] = []

    def history(self, messages=None) -> list[int]:
        messages = messages or self.messages
        out = list(messages[0])
        for answer, user in zip(self.answers, messages[1:]):
            out += OP + answer + user
        return out

    def ends(self) -> list[int]:
        """The depth where each turn's history ended (its turn checkpoint)."""
        return [len(self.history(self.messages[:k + 1])) for k in range(len(self.messages))]

    def turn(self, d: Driver, max_tokens: int = 6):
        """Serve the next turn (the last message is its user message); returns its id."""
        hist = self.history()
        rid, out = d.ask(hist + OP, max_tokens=max_tokens, ignore_eos=True,
                         checkpoint_at=len(hist), anchor_at=len(hist))
        self.answers.append(self.rng.integers(0, 256, 5).tolist())   # rendered, no thinking
        self.messages.append(self.rng.integers(0, 256, 12).tolist())  # the next user message
        return rid, out

    def edited(self, k: int, at: int = 4) -> tuple[list[int], int]:
        """The next prompt with user message ``k`` (1-based turn) changed at token ``at``;
        and the depth of the first divergent token."""
        msgs = [list(m) for m in self.messages]
        msgs[k - 1][at] = (msgs[k - 1][at] + 1) % 256
        return self.history(msgs) + OP, len(self.history(self.messages[:k - 1])) + \
            (len(OP) + len(self.answers[k - 2]) if k > 1 else 0) + at


def four_turns(d: Driver, chat: Chat) -> list[int]:
    for _ in range(4):
        chat.turn(d)
    return chat.ends()


@pytest.mark.parametrize("lanes", [1, 2])
def test_an_edit_of_turn_two_resumes_at_the_ring_entry_below_it(hybrid, lanes):
    model, tok = hybrid
    d = Driver(model, tok, max_concurrency=lanes, max_context=512, min_restore_tokens=16,
               turn_checkpoints=8)
    chat = Chat(5)
    ends = four_turns(d, chat)
    lane = d.engine.lanes[d.lookup("r3").lane]
    # each turn resumed at the previous turn's checkpoint, which then joined the ring
    assert [d.lookup(f"r{i}").resumed_from for i in range(4)] == \
        ["miss"] + ["turn_checkpoint"] * 3
    assert lane.ckpt.depth == ends[3] and [c.depth for c in lane.ring] == ends[:3]
    assert d.rec.kinds("lane.retained")[-1].ring_tokens == ends[:3]
    prompt, diverge = chat.edited(2)
    rid, out = d.ask(prompt, max_tokens=6, ignore_eos=True, checkpoint_at=len(prompt) - 3,
                     anchor_at=len(prompt) - 3)
    lk = d.lookup(rid)
    assert lk.lane == lane.id and lk.resumed_from == "ring"
    assert lk.path == "restore_turn_checkpoint" and lk.source == "l1"
    assert lk.cached_tokens == ends[0] and lk.shared_tokens == diverge
    assert d.prefilled(rid) == len(prompt) - ends[0]
    assert _ids(out) == _cold(model, tok, prompt, max_tokens=6, ignore_eos=True)
    # the ring entries past the edit were the old history's: gone; the one below stays
    assert [c.depth for c in lane.ring] == ends[:1]


def test_an_edit_deeper_in_the_history_takes_the_deepest_entry_below_it(hybrid):
    model, tok = hybrid
    d = Driver(model, tok, max_concurrency=1, max_context=512, min_restore_tokens=16,
               turn_checkpoints=8)
    chat = Chat(6)
    ends = four_turns(d, chat)
    prompt, diverge = chat.edited(3, at=7)   # trimmed tool result / compaction in turn 3
    rid, out = d.ask(prompt, max_tokens=5, ignore_eos=True)
    lk = d.lookup(rid)
    assert (lk.resumed_from, lk.cached_tokens, lk.shared_tokens) == ("ring", ends[1], diverge)
    assert d.prefilled(rid) == len(prompt) - ends[1]
    assert _ids(out) == _cold(model, tok, prompt, max_tokens=5, ignore_eos=True)


@pytest.mark.parametrize("n", [0, 1])
def test_a_ring_too_short_or_off_misses_as_today(hybrid, n):
    """N = 0 is the engine without a ring (the turn checkpoint and anchor alone): the edit of
    turn two costs a cold prefill; N = 1 keeps only the last past checkpoint, above the edit."""
    model, tok = hybrid
    d = Driver(model, tok, max_concurrency=1, max_context=512, min_restore_tokens=16,
               turn_checkpoints=n, l2_bytes=64 << 20)
    chat = Chat(5)
    ends = four_turns(d, chat)
    lane = d.engine.lanes[0]
    assert [c.depth for c in lane.ring] == ends[3 - n:3]
    assert all(len(e.ring_tokens) <= n for e in d.rec.kinds("lane.retained"))
    prompt, diverge = chat.edited(2)
    rid, out = d.ask(prompt, max_tokens=6, ignore_eos=True)
    lk = d.lookup(rid)
    assert (lk.path, lk.resumed_from, lk.cached_tokens) == ("full_reset", "miss", 0)
    assert lk.shared_tokens == diverge and d.prefilled(rid) == len(prompt)
    assert _ids(out) == _cold(model, tok, prompt, max_tokens=6, ignore_eos=True)
    # the displaced session went to L2, with its checkpoints only when there is a ring
    (image,) = d.engine.l2._images.values()
    assert image.marks == (() if n == 0 else (ends[2], ends[3]))


def test_the_ring_rides_an_l2_image_and_restores_at_its_entry(hybrid):
    """Another conversation takes the only lane: the session, its ring with it, goes to L2;
    the edited turn is restored from the image at the ring entry below the edit."""
    model, tok = hybrid
    d = Driver(model, tok, max_concurrency=1, max_context=512, min_restore_tokens=16,
               turn_checkpoints=8, l2_bytes=64 << 20)
    chat = Chat(7)
    ends = four_turns(d, chat)
    other = np.random.default_rng(99).integers(0, 256, 30).tolist()
    d.ask(other + OP, max_tokens=4, ignore_eos=True)
    (demoted,) = d.rec.kinds("cache.demoted")
    (image,) = d.engine.l2._images.values()
    assert image.marks == tuple(ends[:4]) and demoted.bytes == image.nbytes
    prompt, diverge = chat.edited(2)
    rid, out = d.ask(prompt, max_tokens=6, ignore_eos=True)
    lk = d.lookup(rid)
    assert (lk.source, lk.resumed_from, lk.path) == ("l2", "l2", "restore_turn_checkpoint")
    assert lk.cached_tokens == ends[0] and lk.shared_tokens == diverge
    assert d.prefilled(rid) == len(prompt) - ends[0]
    assert _ids(out) == _cold(model, tok, prompt, max_tokens=6, ignore_eos=True)


def test_the_ring_survives_l3_and_a_restart(hybrid, tmp_path):
    from ninfer.store.continuation_store import ContinuationStore

    model, tok = hybrid

    def server():
        d = Driver(model, tok, max_concurrency=1, max_context=512, min_restore_tokens=16,
                   turn_checkpoints=8)
        store = ContinuationStore(str(tmp_path), "test", 64 << 20,
                                  {"artifact_sha256": "t", **d.engine.layout_identity()})
        d.engine.attach_store(store, persist_min_tokens=16)
        return d

    d = server()
    chat = Chat(8)
    ends = four_turns(d, chat)
    d.engine.persister.flush()
    d.bus.flush()
    # each turn's session went to L3 with the checkpoints it had (the last: all four)
    assert [e.tokens for e in d.rec.kinds("store.persisted")] == \
        [e.tokens for e in d.rec.kinds("lane.retained")]
    d.engine.stop()   # closes the store
    d2 = server()   # a restart: the lanes are empty, the store holds the sessions
    prompt, diverge = chat.edited(2)
    rid, out = d2.ask(prompt, max_tokens=6, ignore_eos=True)
    lk = d2.lookup(rid)
    assert (lk.source, lk.resumed_from, lk.cached_tokens) == ("l3", "l3", ends[0])
    assert lk.shared_tokens == diverge and d2.prefilled(rid) == len(prompt) - ends[0]
    assert _ids(out) == _cold(model, tok, prompt, max_tokens=6, ignore_eos=True)
    d2.engine.stop()


def test_the_ring_travels_in_a_slot_file(hybrid, tmp_path):
    model, tok = hybrid
    d = Driver(model, tok, max_concurrency=1, max_context=512, min_restore_tokens=16,
               turn_checkpoints=8)
    chat = Chat(9)
    ends = four_turns(d, chat)
    res = d.slot("save", 0)
    assert [(m.depth, m.roles) for m in res.image.checkpoints] == \
        [(e, ("ring",)) for e in ends[:3]] + [(ends[3], ("turn", "anchor"))]
    ident = {"artifact_sha256": "t", **d.engine.layout_identity()}
    path = str(tmp_path / "ring.slot")
    write_slot_file(path, res.image, ident)
    d2 = Driver(model, tok, max_concurrency=2, max_context=512, min_restore_tokens=16,
                turn_checkpoints=8)
    image, _ = read_slot_file(path, ident)
    assert d2.slot("restore", 1, image=image).ok
    assert d2.rec.kinds("lane.retained")[-1].ring_tokens == ends[:3]
    prompt, _ = chat.edited(2)
    rid, out = d2.ask(prompt, max_tokens=6, ignore_eos=True)
    lk = d2.lookup(rid)
    assert (lk.lane, lk.resumed_from, lk.cached_tokens) == (1, "ring", ends[0])
    assert _ids(out) == _cold(model, tok, prompt, max_tokens=6, ignore_eos=True)


def _as_version_1(raw: bytes, ident: dict, roles=None) -> bytes:
    """A slot file as the version 1 writer made it: the same layout, ``version`` 1, the
    identity digested with it and the checksum over the arrays alone (``roles``: replace the
    checkpoints' roles)."""
    import hashlib
    import struct

    import msgpack

    from ninfer.store.slot_file import identity_digest
    (hlen,) = struct.unpack("<I", raw[8:12])
    h = msgpack.unpackb(raw[12:12 + hlen])
    h["version"], h["identity"] = 1, identity_digest(ident, 1)
    h["payload_sha256"] = hashlib.sha256(raw[12 + hlen:]).hexdigest()
    if roles is not None:
        h["checkpoints"] = [[depth, roles] for depth, _ in h["checkpoints"]]
    head = msgpack.packb(h)
    return raw[:8] + struct.pack("<I", len(head)) + head + raw[12 + hlen:]


def test_a_version_1_slot_file_still_restores(hybrid, tmp_path):
    from ninfer.store.slot_file import VERSION, SlotFileError

    model, tok = hybrid
    d = Driver(model, tok, max_concurrency=1, max_context=512, min_restore_tokens=16)
    chat = Chat(10)
    chat.turn(d)
    ends = chat.ends()
    res = d.slot("save", 0)   # no ring: the turn checkpoint (also the anchor) alone
    ident = {"artifact_sha256": "t", **d.engine.layout_identity()}
    new = tmp_path / "new.slot"
    write_slot_file(str(new), res.image, ident)
    old = tmp_path / "old.slot"
    old.write_bytes(_as_version_1(new.read_bytes(), ident))
    assert VERSION == 4
    d2 = Driver(model, tok, max_concurrency=1, max_context=512, min_restore_tokens=16,
                turn_checkpoints=8)
    image, _ = read_slot_file(str(old), ident)
    assert [(m.depth, m.roles) for m in image.checkpoints] == [(ends[0], ("turn", "anchor"))]
    assert d2.slot("restore", 0, image=image).ok
    lane = d2.engine.lanes[0]
    assert lane.ckpt.depth == lane.anchor.depth == ends[0] and lane.ring == []
    rid, out = d2.ask(chat.history() + OP, max_tokens=5, ignore_eos=True)
    assert (d2.lookup(rid).resumed_from, d2.lookup(rid).cached_tokens) == \
        ("turn_checkpoint", ends[0])
    assert _ids(out) == _cold(model, tok, chat.history() + OP, max_tokens=5, ignore_eos=True)
    # version 1 had no ring: a file claiming one is not a version 1 file
    bad = tmp_path / "bad.slot"
    bad.write_bytes(_as_version_1(new.read_bytes(), ident, roles=["ring"]))
    with pytest.raises(SlotFileError, match="checkpoint"):
        read_slot_file(str(bad), ident)


def test_the_memory_plan_counts_the_ring_in_host_memory(hybrid):
    """``checkpoint_bytes``: per lane the turn checkpoint, the anchor and N ring entries, each
    one recurrent state (what ``lane.checkpointed`` reports copying); beside the device total,
    like the L2 budget."""
    from ninfer.engine.engine import EngineConfig
    from ninfer.engine.memory import checkpoint_states, plan_memory, state_bytes_per_lane

    model, tok = hybrid
    state = state_bytes_per_lane(model.config)
    kw = {"max_concurrency": 3, "max_context": 256, "page_size": 16, "prefill_chunk": 64}
    assert checkpoint_states(EngineConfig(turn_checkpoints=32)) == 34
    assert checkpoint_states(EngineConfig(turn_checkpoints=32, turn_checkpoint=False)) == 0
    assert checkpoint_states(EngineConfig(prefix_reuse=False)) == 0
    plan = plan_memory(model, checkpoints=34, **kw)
    assert plan.checkpoint_bytes == 3 * 34 * state > 0
    assert plan.to_dict()["checkpoint_bytes"] == plan.checkpoint_bytes
    assert plan.total_bytes == plan_memory(model, **kw).total_bytes   # host, not the device's
    d = Driver(model, tok, max_concurrency=1, max_context=512, min_restore_tokens=16,
               turn_checkpoints=2)
    four_turns(d, Chat(11))
    assert {e.bytes for e in d.rec.kinds("lane.checkpointed")} == {state}
    lane = d.engine.lanes[0]
    held = {id(c): c for c in [lane.ckpt, lane.anchor, *lane.ring] if c is not None}
    assert len(held) == 3 and sum(
        a.nbytes for c in held.values() for a in c.conv + c.ssm) <= (2 + 2) * state


@pytest.mark.parametrize("ring", [0, 2, 8])
def test_an_edit_inside_an_older_tool_result_resumes_at_its_message_boundary(hybrid, ring):
    """``Request.boundaries`` (where messages begin): with the ring on, prefill stops at those
    past the reused prefix and copies the state into the ring, at most its size, at least
    ``min_restore_tokens`` apart; a later edit inside that message resumes at its start instead
    of the turn checkpoint below it. Without the ring nothing is taken (the memory plan's
    N + 2 states per lane hold either way)."""
    model, tok = hybrid
    d = Driver(model, tok, max_concurrency=1, max_context=512, min_restore_tokens=16,
               turn_checkpoints=ring)
    rng = np.random.default_rng(12)
    head = rng.integers(0, 256, 40).tolist()            # system + user 1
    tool = rng.integers(0, 256, 60).tolist()            # answer 1 (a tool call) + its result
    users = [rng.integers(0, 256, 12).tolist() for _ in range(3)]
    answers = [rng.integers(0, 256, 5).tolist() for _ in range(3)]

    def ask(hist: list[int], bounds: tuple, anchor: int):
        return d.ask(hist + OP, max_tokens=4, ignore_eos=True, checkpoint_at=len(hist),
                     anchor_at=anchor, boundaries=bounds)

    d.ask(head + OP, max_tokens=4, ignore_eos=True, checkpoint_at=40, anchor_at=40)
    t1 = 40 + len(OP) + 5                                # where the tool result begins
    hist = head + OP + answers[0] + tool + users[0]
    ask(hist, (40, t1, t1 + 60), t1 + 60)                # t1 + 60: the anchor, no second copy
    lane = d.engine.lanes[0]
    # 40 is turn 1's checkpoint (already kept), t1 + 60 the anchor: only t1 is a new copy
    copies = [e.tokens for e in d.rec.kinds("lane.checkpointed") if e.request_id == "r1"]
    assert copies == ([t1] if ring else []) + [t1 + 60, len(hist)]
    assert [c.depth for c in lane.ring] == [40, t1][-ring:] if ring else lane.ring == []
    hist2 = hist + OP + answers[1] + users[1]
    ask(hist2, (len(hist), len(hist2) - 12), len(hist2) - 12)
    edited = list(tool)
    edited[10] = (edited[10] + 1) % 256                  # compaction inside the tool result
    prompt = head + OP + answers[0] + edited + users[0] + OP + answers[1] + users[2] + OP
    rid, out = d.ask(prompt, max_tokens=6, ignore_eos=True)
    lk = d.lookup(rid)
    want = {0: 0, 2: t1, 8: t1}[ring]
    assert lk.shared_tokens == t1 + 10 and lk.cached_tokens == want
    assert lk.resumed_from == ("ring" if ring else "miss")
    assert d.prefilled(rid) == len(prompt) - want
    assert len(lane.ring) <= ring
    assert _ids(out) == _cold(model, tok, prompt, max_tokens=6, ignore_eos=True)

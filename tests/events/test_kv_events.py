"""KV-cache events from the log (``events.kv_blocks``, ``events.kv_publisher``): hand-made cache
records go through the publisher's ZeroMQ socket and are read back by the reference decoder of
vLLM's format (``tests/kv_reference.py``), which rebuilds the index a gateway would hold."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest
import zmq
from kv_reference import (AllBlocksCleared, BlockRemoved, BlockStored, Index, Subscriber,
                          index_of, ref_hash)

DECODE_EVENT = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)

from ninfer.engine.lanes import session_digest
from ninfer.events import schema as ev
from ninfer.events.kv_blocks import KvBlockIndex
from ninfer.events.kv_publisher import KvEventPublisher

PS = 4


class Log:
    """Records with a running seq, written to ``sink``."""

    def __init__(self, sink):
        self.sink, self.seq = sink, 0

    def __call__(self, event):
        self.seq += 1
        rec = ev.Record(ev.SCHEMA_VERSION, self.seq, 1000.0 + self.seq, "serve-test", event)
        self.sink.write(rec, "")


def started():
    return ev.ServerStarted(config={}, artifact={}, environment={}, memory={}, argv=[])


def retained(lane, tokens, ckpt=0):
    return ev.LaneRetained(lane=lane, request_id=f"r{lane}", tokens=len(tokens), pages=0,
                           pages_freed=0, free_pages=0, session_digest=session_digest(tokens),
                           checkpoint_tokens=ckpt, token_ids=list(tokens))


@pytest.fixture
def wire():
    """(publisher over tcp on 127.0.0.1, subscriber, log) for an attention-only model."""
    pub = KvEventPublisher(KvBlockIndex(PS, recurrent=False), "tcp://127.0.0.1:*",
                           "tcp://127.0.0.1:*")
    sub = Subscriber(pub.endpoint)
    Log(pub)   # (a subscriber needs a moment to join a PUB socket: slow-joiner)
    sub.batches(0.3)
    yield pub, sub, Log(pub)
    sub.close()
    pub.close()


def test_an_address_that_cannot_be_bound_is_one_line_naming_it(wire):
    """serve prints an OSError in one line; ZeroMQ's own error was a traceback."""
    pub, _, _ = wire
    for endpoint, replay, why in [("garbage", None, "Invalid argument"),
                                  (pub.endpoint, None, "Address already in use"),
                                  ("tcp://127.0.0.1:*", pub.replay_endpoint,
                                   "Address already in use")]:
        with pytest.raises(OSError) as exc:
            KvEventPublisher(KvBlockIndex(PS, recurrent=False), endpoint, replay)
        assert str(exc.value) == (f"cannot bind the KV-cache events address "
                                  f"{replay or endpoint!r}: {why} (give e.g. tcp://*:5557)")


def test_lanes_and_tiers_as_vllm_block_events(wire):
    pub, sub, log = wire
    a = list(range(10, 20))              # 2 full pages + 2 tokens
    b = a[:8] + [7, 7, 7, 7, 7]          # shares a's 2 pages, then 1 page of its own
    log(started())
    log(retained(0, a))
    log(retained(1, b))
    log(ev.LaneEvicted(lane=0, tokens=6, pages_freed=1, free_pages=0, reason="truncated"))
    log(ev.CacheDemoted(lane=1, tier="l2", tokens=13, bytes=1, admitted=True, entries=1,
                        tier_bytes=1))
    log(ev.LaneEvicted(lane=1, tokens=13, pages_freed=4, free_pages=0, reason="reassigned"))
    log(ev.StorePersisted(tier="l3", tokens=10, bytes=1, duration_s=0.0, deleted=0, entries=1,
                          store_bytes=1, session_digest=session_digest(a)))
    log(ev.CacheEvicted(tier="l2", tokens=13, bytes=1, reason="capacity", entries=0,
                        tier_bytes=0, session_digest=session_digest(b)))
    got = sub.batches()
    assert [s for s, _ in got] == list(range(len(got)))          # gap-free from 0
    events = [e for _, batch in got for e in batch.events]
    assert isinstance(events[0], AllBlocksCleared)
    h0 = ref_hash(None, a[:4])
    h1 = ref_hash(h0, a[4:8])
    hb = ref_hash(h1, b[8:12])
    first, second = events[1], events[2]
    assert isinstance(first, BlockStored) and first.block_hashes == [h0, h1]
    assert first.parent_block_hash is None and first.token_ids == a[:8]
    assert (first.block_size, first.medium, first.group_idx) == (PS, "GPU", None)
    # lane 1 shares lane 0's pages: only its own page is new, chained to theirs
    assert second.block_hashes == [hb] and second.parent_block_hash == h1
    # lane 0 cut back to 4 tokens: its second page is still lane 1's, so no batch; then b
    # to L2, lane 1 dropped (h1 and hb leave the GPU), a to L3, b out of L2
    said = [(type(e).__name__, e.medium, list(e.block_hashes)) for e in events[3:]]
    assert said == [("BlockStored", "CPU", [h0, h1, hb]), ("BlockRemoved", "GPU", [h1, hb]),
                    ("BlockStored", "DISK", [h0, h1]), ("BlockRemoved", "CPU", [h0, h1, hb])]
    index = Index()
    for _, batch in got:
        index.apply(batch)
    # what is left: lane 0's first page on the GPU; b in L2 (CPU) went; a in L3 (DISK)
    assert {(m, h) for m, _, h in index.blocks} == {("GPU", h0), ("DISK", h0), ("DISK", h1)}
    assert index.chain_tokens("DISK", h1) == a[:8]
    assert index.cleared == 1


def persisted(tokens, deleted=()):
    return ev.StorePersisted(tier="l3", tokens=len(tokens), bytes=1, duration_s=0.0,
                             deleted=len(deleted), entries=1, store_bytes=1,
                             session_digest=session_digest(tokens),
                             deleted_digests=[session_digest(t) for t in deleted])


def test_l3_deletions_leave_the_disk_medium(wire):
    pub, sub, log = wire
    a = list(range(10, 19))              # 2 full pages + 1 token
    b = a + list(range(40, 47))          # extends a: 4 pages
    c = [5] * 8                          # 2 pages of its own
    log(started())
    for tokens in (a, c):                # (ledgers are known from the lanes that held them)
        log(retained(0, tokens))
    log(retained(0, b))
    log(persisted(a))
    log(persisted(c))
    log(persisted(b, deleted=[a]))       # b extends a: a's entry goes, its pages stay b's
    log(persisted([1] * 8, deleted=[c]))  # an unknown ledger evicts c for room
    log(ev.StoreEntryDropped(tier="l3", tokens=len(b), bytes=1, reason="digest mismatch",
                             entries=0, store_bytes=0, session_digest=session_digest(b)))
    got = sub.batches()
    disk = [(type(e).__name__, list(e.block_hashes)) for _, batch in got for e in batch.events
            if not isinstance(e, AllBlocksCleared) and e.medium == "DISK"]
    ha = [ref_hash(None, a[:4])]
    ha.append(ref_hash(ha[0], a[4:8]))
    hb = [ref_hash(ha[1], b[8:12]), None]
    hb[1] = ref_hash(hb[0], b[12:16])
    hc = [ref_hash(None, c[:4])]
    hc.append(ref_hash(hc[0], c[4:8]))
    assert disk == [("BlockStored", ha), ("BlockStored", hc), ("BlockStored", hb),
                    ("BlockRemoved", hc), ("BlockRemoved", ha + hb)]
    index = index_of(got)
    assert not [k for k in index.blocks if k[0] == "DISK"]


def test_the_store_names_what_it_deleted(tmp_path):
    from ninfer.store.continuation_store import ContinuationStore, Persister
    from ninfer.engine.continuation import LaneImage

    class Bus:
        def __init__(self):
            self.got = []

        def emit_threadsafe(self, event):
            self.got.append(event)

    def image(tokens):   # 230 kB of K and V a token: 4 tokens fit the 1 MiB quota, not 5
        kv = np.zeros((1, len(tokens), 1, 28_750), np.float32)
        return LaneImage(np.array(tokens, np.int32), kv, kv)

    bus = Bus()
    persister = Persister(ContinuationStore(str(tmp_path), "t", 1 << 20, {}), bus)
    a, b, c = [1], [3], [3, 4]
    for tokens in (a, b, c, [6, 7]):
        persister.submit(image(tokens))
        persister.flush()
    persister.close()
    assert [e.kind for e in bus.got] == ["store.persisted"] * 4
    # c extends b (b goes once c is durable); the fourth evicts the oldest, a
    assert [e.deleted_digests for e in bus.got] == [
        [], [], [session_digest(b)], [session_digest(a)]]
    assert [e.deleted for e in bus.got] == [0, 0, 1, 1]


def test_l3_entries_kept_across_a_restart_are_announced_after_it(wire, tmp_path):
    """A store reopened by a new process lists its entries' ledgers on ``store.opened`` (the
    engine's ``attach_store`` with KV events on, before ``server.started``); the stream clears
    everything, then stores those entries on DISK, so a gateway's index knows them at once."""
    from ninfer.engine.continuation import LaneImage
    from ninfer.store.continuation_store import ContinuationStore
    pub, sub, log = wire
    a, b = list(range(10, 19)), [5] * 8
    store = ContinuationStore(str(tmp_path), "t", 1 << 22, {})
    for tokens in (a, b):
        kv = np.zeros((1, len(tokens), 1, 8), np.float32)
        store.put(LaneImage(np.array(tokens, np.int32), kv, kv))
    store.close()
    store = ContinuationStore(str(tmp_path), "t", 1 << 22, {})   # the restart
    assert store.ledgers() == [a, b]
    log(ev.StoreOpened(tier="l3", path=store.path, entries=2, bytes=store.nbytes, foreign=0,
                       token_ids=store.ledgers()))
    log(started())
    store.close()
    got = [e for _, batch in sub.batches() for e in batch.events]
    assert isinstance(got[0], AllBlocksCleared)
    ha = [ref_hash(None, a[:4])]
    ha.append(ref_hash(ha[0], a[4:8]))
    hb = [ref_hash(None, b[:4])]
    hb.append(ref_hash(hb[0], b[4:8]))
    assert [(type(e).__name__, e.medium, list(e.block_hashes)) for e in got[1:]] == [
        ("BlockStored", "DISK", ha), ("BlockStored", "DISK", hb)]


def test_replay_answers_from_a_sequence_number(wire):
    pub, sub, log = wire
    log(started())
    log(retained(0, list(range(9))))
    log(ev.LaneReleased(lane=0, request_id="r0", pages_freed=3, free_pages=3))
    assert pub.batches_sent == 3
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    dealer.send_multipart([b"", (1).to_bytes(8, "big")])
    replies = []
    while True:
        assert dealer.poll(5000), "no replay answer"
        _, seq, payload = dealer.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            assert payload == b""
            break
        replies.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
    dealer.close(linger=0)
    ctx.term()
    assert [s for s, _ in replies] == [1, 2]
    assert replies[0][1][1][0]["type"] == "BlockStored"
    assert replies[1][1][1][0]["type"] == "BlockRemoved"


def test_hybrid_models_mark_only_resumable_boundaries():
    out = []

    class Sink:
        name = "capture"

        def write(self, rec, line):
            out.extend(index.apply(rec))

    index = KvBlockIndex(PS, recurrent=True)
    log = Log(Sink())
    tokens = list(range(30))             # frontier 30, turn checkpoint at 21
    log(retained(0, tokens, ckpt=21))
    stored = [DECODE_EVENT.decode(msgspec.msgpack.encode(e)) for e in out]
    attn = [e for e in stored if e.group_idx == 0]
    marks = [e for e in stored if e.group_idx == 1]
    assert len(attn) == 1 and len(attn[0].block_hashes) == 7
    assert attn[0].kv_cache_spec_kind == "full_attention"
    # the pages that end at or just below 21 and 30: pages 5 (tokens 16-19) and 7 (24-27)
    chain = attn[0].block_hashes
    assert sorted(e.block_hashes[0] for e in marks) == sorted([chain[4], chain[6]])
    assert all(e.kv_cache_spec_kind == "mamba" and
               e.parent_block_hash == chain[chain.index(e.block_hashes[0]) - 1] for e in marks)
    out.clear()
    log(ev.LaneEvicted(lane=0, tokens=9, pages_freed=2, free_pages=0, reason="truncated"))
    removed = {(e.group_idx, h) for e in (DECODE_EVENT.decode(msgspec.msgpack.encode(e))
                                          for e in out) for h in e.block_hashes}
    assert removed == {(0, chain[5]), (0, chain[6]), (1, chain[6])}


def test_no_token_ids_no_events():
    index = KvBlockIndex(PS, recurrent=False)
    rec = ev.Record(ev.SCHEMA_VERSION, 1, 0.0, "i", ev.LaneRetained(
        lane=0, request_id="r", tokens=9, pages=3, pages_freed=0, free_pages=0,
        session_digest="x"))
    assert index.apply(rec) == []

"""A reference decoder of vLLM's KV-cache event stream, for the tests: vLLM's structs
(``vllm/distributed/kv_events.py``: ``KVEventBatch`` of ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``, msgspec: the batch an array, each event a map tagged by its class name)
declared here from their definitions, a ZeroMQ subscriber, and the block hash ``ninfer/events/kv_blocks.py``
documents, computed independently of it."""
from __future__ import annotations

import hashlib
import time
from typing import Any

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the KV cache events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def ref_hash(parent, tokens) -> int:
    """SHA-256 over the parent's hash (8 bytes big-endian, absent for the first block) and the
    tokens (int32 little-endian); the digest's first 8 bytes as an unsigned integer."""
    data = (b"" if parent is None else parent.to_bytes(8, "big")) + \
        b"".join(int(t).to_bytes(4, "little", signed=True) for t in tokens)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


class Subscriber:
    """A SUB socket on ``endpoint``; ``batches()`` returns ``(seq, KVEventBatch)`` received so
    far, checking that sequence numbers run without a gap."""

    def __init__(self, endpoint: str, topic: bytes = b""):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.got: list[tuple[int, KVEventBatch]] = []

    def batches(self, wait_s: float = 0.5) -> list:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                _topic, seq, payload = self.sock.recv_multipart()
                self.got.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        return self.got

    def close(self):
        self.sock.close(linger=0)
        self.ctx.term()


class Index:
    """What a gateway's event-driven index keeps: the blocks each medium holds, with their
    parent and token ids, built from decoded events only."""

    def __init__(self):
        self.blocks: dict[tuple, tuple] = {}   # (medium, group, hash) -> (parent, token ids)
        self.cleared = 0

    def apply(self, batch: KVEventBatch) -> None:
        for e in batch.events:
            if isinstance(e, AllBlocksCleared):
                self.blocks.clear()
                self.cleared += 1
            elif isinstance(e, BlockStored):
                parent, n = e.parent_block_hash, e.block_size
                assert len(e.token_ids) == n * len(e.block_hashes)
                for i, h in enumerate(e.block_hashes):
                    toks = e.token_ids[i * n:(i + 1) * n]
                    assert h == ref_hash(parent, toks), "block hash is not the documented one"
                    if parent is not None and e.group_idx in (None, 0):
                        assert (e.medium, e.group_idx, parent) in self.blocks or \
                            (e.medium, 0, parent) in self.blocks, "a block without its parent"
                    assert (e.medium, e.group_idx, h) not in self.blocks, "stored twice"
                    self.blocks[(e.medium, e.group_idx, h)] = (parent, toks)
                    parent = h
            else:
                for h in e.block_hashes:
                    assert self.blocks.pop((e.medium, e.group_idx, h), None) is not None, \
                        "removed a block that was not stored"

    def chain_tokens(self, medium: str, leaf) -> list[int]:
        """The token ids from the first block to ``leaf``, following parents."""
        out = []
        while leaf is not None:
            parent, toks = self.blocks[(medium, None, leaf)]
            out[:0] = toks
            leaf = parent
        return out

    def leaves(self, medium: str) -> list:
        held = {h for (m, g, h) in self.blocks if m == medium and g in (None, 0)}
        parents = {self.blocks[(medium, None, h)][0] for h in held}
        return [h for h in held if h not in parents]


def replay(endpoint: str, start: int = 0, timeout_ms: int = 10_000) -> list:
    """Every buffered batch from ``start`` on, asked of a replay (ROUTER) socket:
    ``[(seq, KVEventBatch), ...]``, checking the end marker."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(timeout_ms), f"no replay answer from {endpoint}"
            _, seq, payload = sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    finally:
        sock.close(linger=0)
        ctx.term()


def index_of(batches) -> Index:
    """The index a gateway builds from ``batches`` (gap-free from seq 0)."""
    assert [s for s, _ in batches] == list(range(len(batches))), "a gap in the stream"
    index = Index()
    for _, batch in batches:
        index.apply(batch)
    return index


def check_against_slots(index: Index, slots: list, page_size: int, tokenizer=None) -> None:
    """Every idle lane of ``/slots`` that retains a prefix is a chain of its full pages on the
    GPU medium, and every GPU chain end is such a lane's."""
    depths = sorted((s["n_prompt_tokens"] // page_size) * page_size for s in slots
                    if s["retained"] and s["n_prompt_tokens"] >= page_size)
    chains = sorted(len(index.chain_tokens("GPU", leaf)) for leaf in index.leaves("GPU"))
    assert chains == depths, (chains, depths)

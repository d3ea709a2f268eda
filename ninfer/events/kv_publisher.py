"""The KV-event publisher: a sink of the bus that sends ``KvBlockIndex``'s events as vLLM's
``KVEventBatch`` messages over ZeroMQ, the way vLLM's ``ZmqEventPublisher`` does.

Wire format (vLLM's, so that its consumers read ninfer unchanged):

- PUB socket, bound at ``--kv-events-endpoint`` (``tcp://*:5557``); each message is three
  frames: the topic (``--kv-events-topic``, "" by default), the batch's sequence number (8 bytes,
  big-endian, from 0, gap-free for this process) and the batch.
- A batch is msgpack of vLLM's ``KVEventBatch``, an array ``[ts, [event, ...]]`` (``ts``: unix
  seconds of the record that caused it; ``data_parallel_rank`` omitted), each event a map tagged
  by ``type`` (``kv_blocks``): the layout vLLM's current structs encode to and vllm-router
  0.1.17 reads (vLLM before it sent events as tagged arrays). One record gives at most one
  batch.
- Replay (``--kv-events-replay-endpoint``): a ROUTER socket; a request ``["", start seq
  (8 bytes big-endian)]`` is answered with every buffered batch from that seq on, each
  ``["", seq, batch]``, then ``["", -1 (8 bytes, signed), ""]``. The last ``buffer_steps``
  batches are kept.

``write`` runs on the trio thread and never blocks: a PUB socket drops messages for a slow
subscriber past its high-water mark (which the subscriber sees as a gap in ``seq`` and asks the
replay socket for). The replay socket is served by a thread of its own; only the buffer is
shared, under a lock.
"""
from __future__ import annotations

import collections
import threading

import msgpack
import zmq

from .kv_blocks import KvBlockIndex
from .schema import Record

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KvEventPublisher:
    """A bus sink publishing vLLM KV-cache events (see the module docstring).

    Args:
        index: the block index that turns records into events (its page size and model kind).
        endpoint: ZeroMQ address the PUB socket binds (``tcp://*:5557``, ``ipc://...``).
        replay_endpoint: address the replay ROUTER socket binds, or None for no replay.
        topic: the first frame of every message.
        buffer_steps: batches kept for replay; ``hwm``: the PUB socket's send high-water mark.
    Raises:
        OSError: at construction, when an address cannot be bound (startup fails then).
    ``close()`` stops the replay thread and closes the sockets and their context.
    """

    name = "kv_events"

    def __init__(self, index: KvBlockIndex, endpoint: str, replay_endpoint: str | None = None,
                 topic: str = "", buffer_steps: int = 10_000, hwm: int = 100_000):
        self.index = index
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._topic = topic.encode("utf-8")
        self._seq = 0
        self._buffer: collections.deque = collections.deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        address, router = endpoint, None
        try:
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint = None
            if replay_endpoint:
                router = self._ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                address = replay_endpoint
                router.bind(replay_endpoint)
                self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
                self._thread = threading.Thread(target=self._serve_replay, args=(router,),
                                                name="kv-events-replay", daemon=True)
                self._thread.start()
        except zmq.ZMQError as exc:
            if router is not None:   # an open socket would block close()'s context term forever
                router.close(linger=0)
            self.close()
            # serve prints an OSError in one line: the address and why, not ZeroMQ's traceback
            raise OSError(f"cannot bind the KV-cache events address {address!r}: "
                          f"{zmq.strerror(exc.errno)} (give e.g. tcp://*:5557)") from exc

    @property
    def batches_sent(self) -> int:
        return self._seq

    def write(self, record: Record, line: str) -> None:
        events = self.index.apply(record)
        if not events:
            return
        payload = msgpack.packb([record.ts, events], use_bin_type=True)
        seq = self._seq
        self._seq += 1
        with self._lock:
            self._buffer.append((seq, payload))
        # PUB never blocks: past the high-water mark a message is dropped for that subscriber
        self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload],
                                 flags=zmq.NOBLOCK)

    def _serve_replay(self, router) -> None:
        """The replay thread: answer requests until ``close``; it owns ``router``."""
        try:
            while not self._stop.is_set():
                if not router.poll(100):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue   # not a replay request: ignored, as vLLM does
                ident, start = frames[0], int.from_bytes(frames[2], "big")
                with self._lock:
                    kept = [(s, p) for s, p in self._buffer if s >= start]
                for s, p in kept:
                    router.send_multipart([ident, b"", s.to_bytes(8, "big"), p])
                router.send_multipart([ident, b"", END_SEQ, b""])
        except zmq.ZMQError:
            pass   # the context is being closed
        finally:
            router.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._pub.close(linger=0)
        self._ctx.term()

"""Decode passes replayed from CUDA graphs, one graph per batch-size bucket.

A decode pass of a Llama model is some 13 kernel launches per layer; issued from Python each
costs tens of microseconds of host time, far more than the kernel itself for a small model, so
batch-1 decode is bound by the host. ``CudaGraphDecoder`` captures ``model.forward`` once per
bucket (1, 2, 4, 8, 16, 32 sequences) over static input buffers and replays it: per pass the
host only copies the batch's index arrays into the static buffers (two uploads) and launches
one graph.

Static inputs (vLLM's scheme): token ids, positions, ``cu_seqlens_q``, context lengths, block
tables (width ``max_pages`` = pages one sequence may hold) and slot mapping. A batch of S < B
sequences is padded to its bucket B with dummy sequences (token 0, position 0, context length 1
over page 0, KV slot -1 so nothing is written); their logits are dropped. The attention split
count is fixed at capture for the longest context (``max_pages * page_size``): partitions past a
sequence's length are empty and skipped by the merge. Everything the graph allocates comes from
a private memory pool per bucket that is never shared, so replays never write into memory that
CuPy has handed to someone else.

A model with per-lane recurrent state (``model.is_recurrent``: the Gated DeltaNet layers of
Qwen3.5) takes its lanes' state slots as one more static input (padding rows get ``NO_SLOT``:
zero state in, none written), so admission, release and restores only write the slots, never
re-capture. Its host checks (each slot at its sequence's frontier) and frontier bookkeeping
run around the replay (``model.check_batch`` / ``model.advance``); the graph holds
``model.run``, the pass's device work.

Single-sequence prefill passes (``prefill_graphs``) get graphs of a few lengths, a pass padded
in front to the next one: a small model's prefill pass is bound by the host as its decode is.

With ``enabled=False`` the same padded decode schedule runs eagerly (``--no-cuda-graph``);
prefill passes then run unpadded (padding only pays where a graph replaces the host's work).

Every graph ends with the greedy choice of its rows (``gpu.elementwise.argmax_rows``), written
both to the bucket's id output and into its own static token-id input: ``greedy`` replays a
bucket and returns the ids through pinned host memory without waiting for them, and with
``feed=True`` the next replay takes as its tokens the ids the previous one chose, on the device.
So a greedy decode loop can enqueue pass N + 1 before it reads pass N's tokens, and the device
never waits for the host between passes (SGLang's overlap scheduler, vLLM's async scheduling).
"""
from __future__ import annotations

import bisect

import cupy as cp
import cupyx
import numpy as np

from ninfer.kernels.gdn import NO_SLOT
from ninfer.kernels.gpu import attention as gattn
from ninfer.kernels.gpu import elementwise as gew
from ninfer.kernels.graph_buckets import DEFAULT_BUCKETS, prefill_lengths


class _Bucket:
    """Static host/device buffers of one bucket, its captured graph and its output: ``b``
    sequences of one token each (decode), or with ``tokens`` one sequence of up to that many (a
    prefill pass, padded in front)."""

    def __init__(self, b: int, max_pages: int, page_size: int, tokens: int | None = None):
        self.page_size = page_size
        self.b = b
        self.tokens = t = tokens or b
        self.prefill = tokens is not None
        # one buffer, uploaded by one copy: the KV slots (int64), then positions, cu, lens,
        # tables, recurrent-state slots and last the token ids (int32), so that a fed replay
        # (greedy) uploads all but the ids, also in one copy
        n32 = t + (b + 1) + b + b * max_pages + b + t
        self.h = np.zeros(8 * t + 4 * n32, dtype=np.uint8)
        self.h64 = self.h[:8 * t].view(np.int64)
        self.h64[:] = -1
        # (the device copy starts as the host's: the capture's warm-up pass reads it as it is,
        # and its slots of -1 write no KV)
        self.d = cp.asarray(self.h)
        self.d64 = self.d[:8 * t].view(cp.int64)
        self.h32, self.d32 = self.h[8 * t:].view(np.int32), self.d[8 * t:].view(cp.int32)
        o = np.cumsum([0, t, b + 1, b, b * max_pages, b, t])
        sl = [slice(o[i], o[i + 1]) for i in range(6)]
        self.pos, self.cu, self.lens = (self.h32[s] for s in sl[:3])
        self.bt = self.h32[sl[3]].reshape(b, max_pages)
        self.states, self.d_states = self.h32[sl[4]], self.d32[sl[4]]
        self.states[:] = NO_SLOT
        self.ids = self.h32[sl[5]]
        self.d_ids = self.d32[sl[5]]
        self.dev = [(self.ids, self.d_ids), (self.pos, self.d32[sl[0]]),
                    (self.cu, self.d32[sl[1]]), (self.lens, self.d32[sl[2]]),
                    (self.bt, self.d32[sl[3]].reshape(b, max_pages)), (self.h64, self.d64)]
        self.d_cu = self.d32[sl[1]]
        self.tok_seq = cp.arange(b, dtype=cp.int32)   # (one token per sequence)
        self.pool = cp.cuda.MemoryPool()
        self.graph = None
        self.logits = None
        self.chosen = None     # (b,) int64 device: the captured argmax of the logits rows
        # greedy(): pinned host copies of the ids, two in turn, each with the event after it
        self.pinned = cupyx.empty_pinned((2, b), dtype=np.int64)
        self.events = [cp.cuda.Event(disable_timing=True) for _ in range(2)]
        self.turn = 0
        self.fed = False       # the last replay was greedy(): its ids are in the token input


class CudaGraphDecoder:
    """A model wrapper whose ``forward`` replays CUDA graphs for pure decode batches.

    Args:
        model: a ``LlamaModel`` or ``Qwen35Model`` on the cupy backend (anything with
            ``forward``, ``ops``, ``config``, ``new_kv_cache``; recurrent ones also ``run``,
            ``check_batch`` and ``advance``).
        kv: the KV cache the graphs are captured against (other caches run eagerly); None
            binds the cache of the first decode pass.
        max_pages: block-table width, i.e. the most pages one sequence may hold.
        buckets: batch sizes captured (ascending); larger batches run eagerly.
        enabled: False runs the same padded schedule without graphs.

    ``prefill_graphs(chunk)`` adds single-sequence prefill passes of up to ``chunk`` tokens
    (``graph_buckets.prefill_lengths``: 16, 32, 64, ... up to 2,048), each length replayed from
    a graph of its own: a small model's pass is bound by the host's issue time, not the
    device's (a model without recurrent state). A pass of T tokens runs in the first length L
    >= T with L - T padding rows in front of its own: token 0 at the first real position, KV
    slot -1 (nothing written), and the rows' implied positions below the real ones (the
    attention's causal limits; below 0 they see no key, and their rows end NaN). Every op of
    the pass works row by row, so the real rows and the last row's logits are the unpadded
    pass's (up to the GEMMs' summation order at another width).

    ``forward`` returns, for graph replays, a view of the bucket's static logits: it is valid
    until the next pass of the same bucket (the engine reads it at once).
    """

    def __init__(self, model, kv=None, max_pages: int = 512, buckets=DEFAULT_BUCKETS,
                 enabled=True):
        from ninfer.engine.models.llama import ForwardBatch
        self._fb = ForwardBatch
        self.model, self.kv, self.max_pages = model, kv, max_pages
        self.buckets = tuple(sorted(buckets))
        self.enabled = enabled
        self._b: dict[int, _Bucket] = {}
        self._p: dict[int, _Bucket] = {}   # prefill buckets by captured length
        self.replays = 0
        self.recurrent = bool(getattr(model, "is_recurrent", False))
        self.prefill_tokens: tuple[int, ...] = ()

    def prefill_graphs(self, chunk: int) -> tuple[int, ...]:
        """Replay single-sequence prefill passes of up to ``chunk`` tokens from graphs too
        (none for a recurrent model: its chunked prefill keeps host-side state); returns the
        captured lengths (``graph_buckets.prefill_lengths``)."""
        self.prefill_tokens = () if self.recurrent else prefill_lengths(chunk)
        return self.prefill_tokens

    def __getattr__(self, name):  # config, ops, new_kv_cache, ...
        return getattr(self.model, name)

    def spec_rounds(self):
        """Whole speculative rounds of the model from CUDA graphs (``gpu.spec_graphs``), or
        None for a model without them."""
        if not hasattr(self.model, "spec_round"):
            return None
        from ninfer.kernels.gpu.spec_graphs import SpecGraphs
        return SpecGraphs(self)

    def _bind(self, kv) -> None:
        """Capture against ``kv``: prefill lengths past a sequence's pages are dropped (the
        capture's context of ``max_pages`` pages must hold the pass)."""
        self.kv = kv
        self.prefill_tokens = tuple(t for t in self.prefill_tokens
                                    if t <= self.max_pages * kv.page_size)

    def capture_all(self, kv) -> None:
        """Bind ``kv`` and build every bucket now (capture its graph, or with ``enabled=False``
        only its static buffers), so that no request pays for a capture."""
        self._bind(kv)
        for b in self.buckets:
            if b not in self._b:
                bk = self._b[b] = _Bucket(b, self.max_pages, kv.page_size)
                if self.enabled:
                    self._capture(bk)
        for t in self.prefill_tokens if self.enabled else ():
            if t not in self._p:
                self._capture(self._p.setdefault(t, _Bucket(1, self.max_pages, kv.page_size, t)))

    @property
    def pool_bytes(self) -> int:
        """Device bytes held by the buckets' private memory pools (what the captured graphs
        allocated: activations, logits, attention partials) plus their static inputs."""
        return sum(bk.pool.total_bytes() + bk.d.nbytes
                   for bk in (*self._b.values(), *self._p.values()))

    def _fill(self, bk: _Bucket, batch) -> int:
        s = batch.num_seqs
        if bk.prefill:   # (one sequence of up to bk.tokens, padded in front: see the class)
            pad = bk.tokens - batch.num_tokens
            bk.ids[:pad] = 0
            bk.ids[pad:] = batch.token_ids
            bk.pos[:pad] = batch.positions[0]
            bk.pos[pad:] = batch.positions
            bk.cu[:] = (0, bk.tokens)
            bk.lens[:] = batch.context_lens
            w = batch.block_tables.shape[1]
            bk.bt[:, :w] = batch.block_tables
            bk.bt[:, w:] = -1
            bk.h64[:pad] = -1
            bk.h64[pad:] = batch.slot_mapping
            return s
        bk.ids[:s] = batch.token_ids
        bk.ids[s:] = 0
        bk.pos[:s] = batch.positions
        bk.pos[s:] = 0
        bk.cu[:] = np.arange(bk.b + 1)
        bk.lens[:s] = batch.context_lens
        bk.lens[s:] = 1
        w = batch.block_tables.shape[1]
        bk.bt[:s, :w] = batch.block_tables
        bk.bt[:s, w:] = -1
        bk.bt[s:] = 0
        bk.h64[:s] = batch.slot_mapping
        bk.h64[s:] = -1
        if self.recurrent:
            bk.states[:s] = batch.state_slots
            bk.states[s:] = NO_SLOT
        return s

    def _static_batch(self, bk: _Bucket):
        return self._fb(token_ids=bk.ids, positions=bk.pos, cu_seqlens_q=bk.cu,
                        context_lens=bk.lens, block_tables=bk.bt, slot_mapping=bk.h64,
                        state_slots=bk.states if self.recurrent else None)

    def _register(self, bk: _Bucket) -> None:
        """Make the ops object resolve the static host arrays to the static device buffers
        (no upload happens inside a capture)."""
        ragged = ((bk.cu, bk.states, self.kv.max_lanes, (bk.d_cu, bk.d_states, bk.tok_seq))
                  if self.recurrent else None)
        self.model.ops.bind_static(bk.dev, ragged)

    def _pass(self, bk: _Bucket):
        """The bucket's pass over its static inputs (a recurrent model's device work only:
        its host checks and frontiers are ``forward``'s, around the replay)."""
        if self.recurrent:
            return self.model.run(self._static_batch(bk), self.kv, bk.states)
        return self.model.forward(self._static_batch(bk), self.kv)

    def _capture(self, bk: _Bucket) -> None:
        # worst-case lengths at capture: the attention split count covers any context (a
        # prefill pass: one sequence's tiles, in the same order at any depth)
        bk.ids[:] = 0
        bk.pos[:] = 0
        bk.cu[:] = (0, bk.tokens) if bk.prefill else np.arange(bk.b + 1)
        bk.lens[:] = self.max_pages * self.kv.page_size
        bk.bt[:] = 0
        bk.h64[:] = -1
        bk.states[:] = NO_SLOT
        if bk.prefill:   # (its tile list made anew below, in this bucket's private pool)
            gattn.drop_prefill_tiles()
        stream = cp.cuda.Stream(non_blocking=True)
        # after everything queued so far (an eager pass still running must not overlap the
        # warm-up: the persistent decode kernel's barrier counter is shared)
        stream.wait_event(cp.cuda.get_current_stream().record())
        with cp.cuda.using_allocator(bk.pool.malloc), stream:
            bk.d.set(bk.h, stream=stream)   # (the warm-up reads these: slots -1, no KV write)
            self._register(bk)
            self._pass(bk)   # warm-up: compile, cache
            stream.synchronize()
            self._register(bk)
            gew.argmax_counters(bk.b)   # (allocated and zeroed outside the capture)
            stream.begin_capture()
            try:
                bk.logits = self._pass(bk)
                # (also the next replay's tokens, where greedy() feeds)
                bk.chosen = gew.argmax_rows(bk.logits,
                                            out32=None if bk.prefill else bk.d_ids)
            finally:
                bk.graph = stream.end_capture()
        stream.synchronize()

    def forward(self, batch, kv, all_logits: bool = False):
        """``model.forward``, replayed from a bucket's graph when ``batch`` is a pure decode
        batch (one new token per sequence) or a prefill pass of one sequence a captured length
        takes (``prefill_graphs``), on the captured cache."""
        bk = self._bucket(batch, kv, all_logits)
        if bk is None:
            return self.model.forward(batch, kv, all_logits)
        self._check(batch, kv)
        s = self._fill(bk, batch)
        if not self.enabled:
            self._register(bk)
            bk.d.set(bk.h)
            out = self._pass(bk)[:s]
        else:
            self._replay(bk, False)
            bk.fed = False
            out = bk.logits[:s]
        self._advance(batch, kv)
        return out

    def _check(self, batch, kv) -> None:
        """A recurrent model's host checks of ``batch`` (state slots at their frontiers)."""
        if self.recurrent:
            self.model.check_batch(batch, kv)

    def _advance(self, batch, kv) -> None:
        if self.recurrent:
            self.model.advance(batch, kv)

    def _bucket(self, batch, kv, all_logits: bool = False):
        """The bucket that runs ``batch`` (made, and captured where graphs are on, the first
        time), or None where it runs as a plain ``model.forward``."""
        s = batch.num_seqs
        if self.kv is None and (batch.num_tokens == s or self._prefill(batch)):
            self._bind(kv)
        if self.enabled and self._prefill(batch) and not all_logits and kv is self.kv:
            t = self.prefill_tokens[bisect.bisect_left(self.prefill_tokens, batch.num_tokens)]
            bk = self._p.get(t)
            if bk is None:
                bk = self._p[t] = _Bucket(1, self.max_pages, kv.page_size, t)
                self._capture(bk)
            return bk
        if (all_logits or kv is not self.kv or batch.num_tokens != s or s > self.buckets[-1]
                or batch.block_tables.shape[1] > self.max_pages):
            return None
        b = self.buckets[bisect.bisect_left(self.buckets, s)]
        bk = self._b.get(b)
        if bk is None:
            bk = self._b[b] = _Bucket(b, self.max_pages, kv.page_size)
            if self.enabled:
                self._capture(bk)
        return bk

    def _prefill(self, batch) -> bool:
        """Whether ``batch`` is a single-sequence prefill pass a captured length takes (not
        one of up to ``verify_rows`` rows: its own attention kernel, float32, runs eagerly)."""
        return (batch.num_seqs == 1 and bool(self.prefill_tokens)
                and self.model.ops.config.verify_rows < batch.num_tokens
                <= self.prefill_tokens[-1]
                and batch.block_tables.shape[1] <= self.max_pages)

    def _replay(self, bk: _Bucket, feed: bool) -> None:
        """Upload the bucket's inputs (without the token ids where ``feed``) and launch it."""
        stream = cp.cuda.get_current_stream()
        n = bk.h.size - (4 * bk.b if feed else 0)
        bk.d[:n].set(bk.h[:n], stream=stream)
        bk.graph.launch(stream=stream)
        self.replays += 1

    def greedy(self, batch, kv, feed: bool = False):
        """Replay the pure decode ``batch`` from its bucket's graph and return, without waiting
        for the device, a function that returns the greedy token of each sequence ((S,) int64
        NumPy; the first index of each row's largest logit, as ``ops.argmax``), blocking until
        they are there. None (nothing run) where ``forward`` would run the batch eagerly.

        ``feed=True``: ``batch.token_ids`` are ignored, and each sequence's token is the one the
        previous replay of this bucket chose for it (a ``greedy`` call on the same sequences in
        the same order), taken on the device: the caller may enqueue this pass before it has
        read the previous one's tokens. At most two results may be pending: each must be read
        before the second ``greedy`` call after the one that returned it.

        Raises:
            ValueError: ``feed`` where the bucket's last replay was no ``greedy`` call.
        """
        bk = self._bucket(batch, kv)
        if bk is None or not self.enabled or bk.prefill:
            return None
        if feed and not bk.fed:
            raise ValueError("greedy(feed=True): the bucket's last replay chose no tokens")
        self._check(batch, kv)
        s = self._fill(bk, batch)
        self._replay(bk, feed)
        self._advance(batch, kv)
        bk.fed = True
        stream = cp.cuda.get_current_stream()
        out, done = bk.pinned[bk.turn], bk.events[bk.turn]
        bk.turn ^= 1
        cp.cuda.runtime.memcpyAsync(out.ctypes.data, bk.chosen.data.ptr, out.nbytes,
                                    cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        done.record(stream)

        def result() -> np.ndarray:
            done.synchronize()
            return out[:s].copy()
        return result

"""Speculative rounds replayed from CUDA graphs, one graph per (lanes bucket, k).

``Qwen35Spec.spec_round`` (verify k drafts, accept, commit the GDN state, draft k more) is
captured once per bucket of lanes (1, 2, 4, 8) and draft count over the static buffers of a
``SpecIO``: per round the host fills the inputs (pending tokens, drafts, positions, tables,
state slots), uploads them in one copy, launches one graph and reads targets, acceptance and
the next drafts back in one copy. The chained MTP passes' positions and KV slots depend on
the acceptance, so kernels in the graph compute them into buffers the later passes read
(``CupyOps._bound``). Padding lanes have state slot ``NO_SLOT`` and KV slots -1: they store
nothing. With ``enabled=False`` the same bound round runs eagerly (``--no-cuda-graph``).
"""
from __future__ import annotations

import bisect

import cupy as cp
import numpy as np

from ninfer.engine.models.qwen35_spec import SpecIO, SpecResult
from ninfer.kernels.gpu import elementwise as gew

SPEC_BUCKETS = (1, 2, 4, 8)


class _SpecBucket:
    def __init__(self, model, b: int, k: int, max_pages: int, page_size: int):
        self.io = io = SpecIO(model, b, k, max_pages, page_size)
        self.d = cp.asarray(io.h)
        self.dev = {}
        for name, arr in io.a.items():
            off = arr.ctypes.data - io.h.ctypes.data
            self.dev[name] = self.d[off:off + arr.nbytes].view(arr.dtype).reshape(arr.shape)
        t = b * (k + 1)
        self.tok_seq = cp.repeat(cp.arange(b, dtype=cp.int32), k + 1)
        self.pairs = [(arr, self.dev[name]) for name, arr in io.a.items()]
        self.pairs += [(io.drafts[j], self.dev["drafts"][j]) for j in range(k)]
        self.t = t
        self.pool = cp.cuda.MemoryPool()
        self.graph = None
        self.kept = None
        self.pinned = cp.cuda.alloc_pinned_memory(io.out[1] - io.out[0])


class SpecGraphs:
    """Whole speculative rounds of a ``CudaGraphDecoder``'s model on its cache.

    Args:
        decoder: the decode runner (model, cache, ``max_pages``, ``enabled``).
    """

    def __init__(self, decoder):
        self.decoder = decoder
        self.model = decoder.model
        self._b: dict[tuple[int, int], _SpecBucket] = {}
        self.replays = 0

    def run(self, rows, k: int, kv) -> SpecResult:
        """One round over ``rows`` (``SpecIO.fill``'s) with ``k`` drafts each; more lanes than
        the largest bucket run as several rounds."""
        top = SPEC_BUCKETS[-1]
        if len(rows) > top:
            parts = [self.run(rows[i:i + top], k, kv) for i in range(0, len(rows), top)]
            return SpecResult(*(np.concatenate([getattr(p, f) for p in parts])
                                for f in ("targets", "acc", "drafts")),
                              cp.concatenate([p.kept for p in parts]))
        b = SPEC_BUCKETS[bisect.bisect_left(SPEC_BUCKETS, len(rows))]
        bk = self._b.get((b, k))
        if bk is None:
            bk = self._b[(b, k)] = _SpecBucket(self.model, b, k, self.decoder.max_pages,
                                               kv.page_size)
            self._capture(bk, kv)
        io = bk.io
        s = io.fill(rows)
        stream = cp.cuda.get_current_stream()
        bk.d[:io.n_in].set(io.h[:io.n_in], stream=stream)
        if bk.graph is not None:
            bk.graph.launch(stream=stream)
            kept = bk.kept
        else:
            self._register(bk, kv)
            kept = self.model.spec_round(io, kv)
        self.replays += 1
        lo, hi = io.out
        host = np.frombuffer(bk.pinned, dtype=np.uint8, count=hi - lo)
        cp.cuda.runtime.memcpyAsync(host.ctypes.data, bk.d[lo:hi].data.ptr, hi - lo,
                                    cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        kept = kept[:s].copy()
        stream.synchronize()
        io.h[lo:hi] = host
        return SpecResult(io.targets.reshape(-1, k + 1)[:s].astype(np.int64),
                          io.acc[:s].astype(np.int64),
                          np.stack(io.drafts, axis=1)[:s].astype(np.int64), kept)

    def _register(self, bk: _SpecBucket, kv) -> None:
        io = bk.io
        ragged = (io.a["cu"], io.a["states"], kv.max_lanes,
                  (bk.dev["cu"], bk.dev["states"], bk.tok_seq), io.k + 1)
        self.model.ops.bind_static(bk.pairs, ragged)

    def _capture(self, bk: _SpecBucket, kv) -> None:
        """Capture the bucket's round (or, not ``enabled``, only prepare its buffers) with
        worst-case context lengths, so the attention's split count covers any context."""
        io = bk.io
        io.fill([])
        a = io.a
        if not self.decoder.enabled:   # (eager: the host checks see one position a pass)
            for j in range(2, io.k + 1):
                a[f"clens{j}"][:] = 1
            return
        worst = self.decoder.max_pages * kv.page_size
        a["lens"][:] = worst
        a["bt"][:] = 0
        for j in range(2, io.k + 1):
            a[f"clens{j}"][:] = worst
        stream = cp.cuda.Stream(non_blocking=True)
        stream.wait_event(cp.cuda.get_current_stream().record())
        with cp.cuda.using_allocator(bk.pool.malloc), stream:
            bk.d.set(io.h, stream=stream)   # (the warm-up stores nothing: slots -1, NO_SLOT)
            self._register(bk, kv)
            self.model.spec_round(io, kv)   # warm-up: compile, cache
            stream.synchronize()
            self._register(bk, kv)
            gew.argmax_counters(bk.t)
            stream.begin_capture()
            try:
                bk.kept = self.model.spec_round(io, kv)
            finally:
                bk.graph = stream.end_capture()
        stream.synchronize()

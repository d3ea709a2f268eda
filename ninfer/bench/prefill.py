"""Prefill throughput: one sequence of P random tokens in one forward pass, or in forward passes
of ``chunk`` tokens as the engine's prefill runs it (the last row's logits and their argmax, as
the engine's last prefill chunk), median of ``reps`` prefills after a warm-up, into one KV
cache of the longest P's positions."""
from __future__ import annotations

import statistics
import time

import numpy as np

from ninfer.bench.model import PAGE_SIZE, BenchModel, pages


def prefill_s(bm: BenchModel, length: int, reps: int = 3, chunk: int | None = None,
              kv=None) -> list[float]:
    """Seconds of each of ``reps`` timed prefills of ``length`` tokens (one warm-up first), in
    passes of at most ``chunk`` tokens (None: one pass), into ``kv`` (None: a new cache of
    ``length`` positions)."""
    from ninfer.engine.models.llama import ForwardBatch

    n = pages(length)
    kv = kv if kv is not None else bm.new_kv(1, length)
    ids = np.random.default_rng(1).integers(0, bm.config.vocab_size, size=length).tolist()
    step = chunk or length
    times = []
    for i in range(reps + 1):
        slots = bm.slots(kv, 1)
        bm.synchronize()
        t0 = time.perf_counter()
        for a in range(0, length, step):
            batch = ForwardBatch.from_sequences([ids[a:a + step]], [a], [list(range(n))],
                                                PAGE_SIZE, slots)
            logits = bm.model.forward(batch, kv)
        bm.argmax(logits)
        t1 = time.perf_counter()
        if i:
            times.append(t1 - t0)
    return times


def auto_chunk(bm: BenchModel, longest: int) -> tuple[int, dict]:
    """The pass size ``--prefill-chunk auto`` picks for this model (``resolve_prefill_chunk``
    as the engine runs it: measured on the GPU up to ``longest``, the default unmeasured on the
    CPU; no memory bound, the bench sizes its cache itself) and its record
    (``ChunkChoice.to_dict``, plus ``chunk``)."""
    from ninfer.engine.chunk_size import AUTO, resolve_prefill_chunk

    choice = resolve_prefill_chunk(AUTO, bm.model, max_context=longest,
                                   total_bytes_at=lambda _: 0, capacity_bytes=None,
                                   kv_dtype=bm.kv_dtype)
    return choice.tokens, {"chunk": choice.tokens, **choice.to_dict()}


def measure(bm: BenchModel, *, lengths: tuple[int, ...], rounds: int = 1,
            chunk: int | None = None, reps: int = 3, log=print) -> dict:
    """Prefill tok/s at each length -> ``{"prefill": {P: {"tok_s", "ms_median",
    "tok_s_all"}}}`` (median over ``rounds`` x ``reps`` passes; ``"chunk"``: the pass
    size)."""
    out: dict = {"prefill": {}, "prefill_chunk": chunk}
    kv = bm.new_kv(1, max(lengths))   # one cache, as serve has (graphs replay on theirs)
    for p in lengths:
        times = []
        for r in range(rounds):
            got = prefill_s(bm, p, reps=reps, chunk=chunk, kv=kv)
            times += got
            log(f"prefill {p} round {r}: {p / statistics.median(got):.1f} tok/s")
        med = statistics.median(times)
        out["prefill"][p] = {"tok_s": round(p / med, 1), "ms_median": round(med * 1e3, 3),
                             "tok_s_all": [round(p / t, 1) for t in times]}
    return out

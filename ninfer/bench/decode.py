"""Decode throughput: tok/s of B lanes after a cached context, plain and with the engine's
lookahead, GB/s and the fraction of the memory roofline measured in the same run.

Per batch size B and round: B lanes with ``context`` random cached tokens (one ragged prefill),
then ``steps`` timed decode steps after 3 warm-up steps, twice:
- plain: ``model.forward`` + greedy argmax, the ids read back before the next step is built;
- lookahead (where the model replays CUDA graphs: ``greedy``): step N + 1 launched with the ids
  of step N fed on the device before step N's ids are read, as the engine's greedy rounds run
  (``EngineConfig.decode_lookahead``); its tokens must equal the plain steps'
  (``lookahead_tokens_match``).
``tok_s`` is the lookahead's rate where it ran, else the plain one; with several rounds the
median over rounds.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from ninfer.bench import roofline
from ninfer.bench.model import PAGE_SIZE, BenchModel, pages

WARMUP = 3
CONTEXT_PASS = 512   # tokens of the cached context a prefill pass takes (the timed steps follow)


@dataclass(frozen=True, slots=True)
class LaneRun:
    """One timed decode of B lanes."""

    tok_s: float
    step_s: float          # median seconds a step
    tokens: list[int]      # lane 0's tokens, the prefill's first
    lookahead: bool        # whether the lookahead ran (graphs replayed)


def run_lanes(bm: BenchModel, kv, batch: int, context: int, steps: int,
              lookahead: bool = False) -> LaneRun:
    """Time ``steps`` decode steps of ``batch`` lanes over ``kv`` (one cache for every batch
    size, so graphs captured against it are reused)."""
    from ninfer.engine.models.llama import ForwardBatch

    model, vocab = bm.model, bm.config.vocab_size
    per = pages(context + steps + 8)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, size=context).tolist() for _ in range(batch)]

    slots = bm.slots(kv, batch)

    def fb(tokens, n):
        return ForwardBatch.from_sequences(tokens, [n] * batch, tables, PAGE_SIZE, slots)

    # the untimed context goes in passes of CONTEXT_PASS tokens, as the engine's chunked prefill:
    # one pass holds its whole score matrix (149 GiB for --context 100000 on the numpy backend)
    for start in range(0, context, CONTEXT_PASS):
        last = bm.argmax(model.forward(ForwardBatch.from_sequences(
            [p[start:start + CONTEXT_PASS] for p in prompts], [start] * batch, tables,
            PAGE_SIZE, slots), kv))
    out, n, times = [last[0]], context, []
    greedy = getattr(model, "greedy", None) if lookahead else None
    pending = greedy(fb([[t] for t in last], n), kv) if greedy else None
    if pending is not None:
        t0 = time.perf_counter()
        for step in range(steps + WARMUP):
            n += 1
            nxt = greedy(fb([[0]] * batch, n), kv, feed=True)
            out.append(int(pending()[0]))
            t1 = time.perf_counter()
            if step >= WARMUP:
                times.append(t1 - t0)
            t0, pending = t1, nxt
        pending()
    else:  # plain steps (also where the batch runs eagerly: greedy returned None)
        for step in range(steps + WARMUP):
            t0 = time.perf_counter()
            last = bm.argmax(model.forward(fb([[t] for t in last], n), kv))
            t1 = time.perf_counter()
            out.append(last[0])
            n += 1
            if step >= WARMUP:
                times.append(t1 - t0)
    return LaneRun(batch * steps / sum(times), statistics.median(times), out,
                   pending is not None)


def device_step_s(bm: BenchModel, reps: int = 64) -> float | None:
    """Device seconds of one batch-1 decode step: the captured graph of the bucket of one (as
    ``run_lanes`` last filled it) replayed ``reps`` times between two events, no host work in
    between; None without a captured graph (numpy, eager)."""
    bucket = getattr(bm.model, "_b", {}).get(1)
    graph = getattr(bucket, "graph", None)
    if graph is None:
        return None
    return graph_device_s(graph, reps)


def graph_device_s(graph, reps: int = 64, stream=None) -> float:
    """Device seconds of one replay of a captured CUDA graph: 3 replays to warm up, then
    ``reps`` queued between two events on ``stream`` (the current one by default)."""
    import cupy as cp

    stream = stream or cp.cuda.get_current_stream()
    for _ in range(3):
        graph.launch(stream=stream)
    s, e = cp.cuda.Event(), cp.cuda.Event()
    s.record(stream)
    for _ in range(reps):
        graph.launch(stream=stream)
    e.record(stream)
    e.synchronize()
    return cp.cuda.get_elapsed_time(s, e) / 1e3 / reps


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first step where two token lists differ, or None."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def measure(bm: BenchModel, *, batches: tuple[int, ...], steps: int, context: int,
            rounds: int, lookahead: bool, bandwidth: float, log=print) -> dict:
    """Decode at each batch size, ``rounds`` times -> ``{"weight_bytes_per_token", "decode":
    {B: entry}}``; ``bandwidth``: the copy bandwidth of this run (bytes/s)."""
    weights = roofline.weight_bytes(bm.model)
    lookahead = lookahead and callable(getattr(bm.model, "greedy", None))
    kv = bm.new_kv(max(batches), context + steps + 8)
    kv_pos = kv.bytes_per_token
    state = int(getattr(kv, "state_bytes_per_lane", 0))
    mean_ctx = context + steps / 2
    out: dict = {"weight_bytes_per_token": weights, "kv_bytes_per_position": kv_pos,
                 "state_bytes_per_lane": state, "decode": {}}
    runs: dict[int, list] = {b: [] for b in batches}
    for r in range(rounds):
        for b in batches:
            plain = run_lanes(bm, kv, b, context, steps)
            ahead = run_lanes(bm, kv, b, context, steps, lookahead=True) if lookahead else None
            runs[b].append((plain, ahead if ahead is not None and ahead.lookahead else None))
            log(f"decode batch {b} round {r}: plain {plain.tok_s:.1f} tok/s"
                + (f", lookahead {ahead.tok_s:.1f} tok/s" if ahead and ahead.lookahead else ""))
    for b in batches:
        out["decode"][b] = entry = _entry(runs[b], weights, kv_pos, state, b, mean_ctx,
                                          bandwidth, log)
        if b == 1:
            dev = device_step_s(bm)
            if dev:  # the step's device time alone: the rest of the step is host time
                entry["device_step_ms"] = round(dev * 1e3, 3)
    return out


def _entry(runs: list, weights: int, kv_pos: int, state: int, batch: int, mean_ctx: float,
           bandwidth: float, log) -> dict:
    """One batch size's result over its rounds (medians) with its roofline fraction."""
    plain_tok_s = statistics.median(p.tok_s for p, _ in runs)
    entry: dict = {"tok_s_plain": round(plain_tok_s, 1),
                   "step_ms_median_plain": round(statistics.median(p.step_s for p, _ in runs)
                                                 * 1e3, 3)}
    ahead = [a for _, a in runs if a is not None]
    entry["lookahead"] = bool(ahead)
    timed = ahead or [p for p, _ in runs]
    if ahead:
        diffs = [first_difference(a.tokens, p.tokens) for p, a in runs if a is not None]
        entry["lookahead_tokens_match"] = all(d is None for d in diffs)
        for d in diffs:
            if d is not None:
                log(f"decode batch {batch}: the lookahead's tokens differ from the plain "
                    f"steps' from step {d}")
    tok_s = statistics.median(x.tok_s for x in timed)
    step_b = roofline.step_bytes(weights, kv_pos, batch, mean_ctx, state)
    entry.update({
        "tok_s": round(tok_s, 1),
        "step_ms_median": round(statistics.median(x.step_s for x in timed) * 1e3, 3),
        "tok_s_rounds": [round(x.tok_s, 1) for x in timed],
        "bytes_per_step": step_b,
        "GBs": round(step_b * tok_s / batch / 1e9, 1),
        "roofline_fraction": round(roofline.fraction(step_b, tok_s / batch, bandwidth), 3),
        "roofline_fraction_plain": round(roofline.fraction(step_b, plain_tok_s / batch,
                                                           bandwidth), 3)})
    if batch == 1:
        entry["bytes_per_token"] = step_b
    return entry

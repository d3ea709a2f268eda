"""``--prefill-chunk auto``: the prefill chunk size chosen at start-up.

On the GPU a prefill pass pays a fixed cost per call (every int4 weight is dequantized to fp16
once a pass before cuBLAS runs, about 1.3 ms a GDN layer on the 27B shape on an H200) besides
its cost per token, so tokens/s grows with the chunk; a larger chunk, though, holds other
lanes' decode rounds for one chunk's time and needs more activation memory.
``measure_prefill`` times the model's prefill at two sizes and fits ``time(T) = F + c T``;
``choose_chunk`` takes the smallest chunk whose fixed cost is at most ``FIXED_SHARE`` of its
time, within [``MIN_TOKENS``, ``MAX_TOKENS``] and what the memory plan's capacity allows
(``memory_max_tokens``); ``resolve_prefill_chunk`` puts them together. The NumPy backend's
per-call costs are small: there ``auto`` is ``MIN_TOKENS``, without measuring.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

AUTO = "auto"
MIN_TOKENS = 512         # the smallest chunk auto picks (the fixed default before auto)
MAX_TOKENS = 8192        # the largest: one chunk's time is a gap in other lanes' decoding
MULTIPLE = 64            # chunks are whole chunks of the GPU's chunked delta rule
FIXED_SHARE = 0.1        # the fixed cost may be at most this share of a chunk's time
MAX_CHUNK_S = 0.5        # a chunk holds other lanes' decode rounds: at most this long
MEASURE_TOKENS = (256, 2048)


@dataclass(frozen=True, slots=True)
class PrefillFit:
    """``time(T) = fixed_s + per_token_s * T`` of a prefill pass of T tokens (seconds), fitted
    to the fastest of the timed passes at each of ``sizes_tokens`` (``times_s``)."""
    fixed_s: float
    per_token_s: float
    sizes_tokens: tuple[int, ...]
    times_s: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class ChunkChoice:
    """The resolved ``--prefill-chunk``: ``tokens``, and how: ``given`` (an explicit size),
    ``default`` (auto on a backend that is not measured, or whose measurement failed:
    ``warning``) or ``measured`` (``fit``;
    ``wanted_tokens``: the rule's choice before the memory bound; ``memory_max_tokens``: the
    largest chunk the capacity allows, None when the capacity is unknown)."""
    tokens: int
    source: str
    fit: PrefillFit | None = None
    wanted_tokens: int | None = None
    memory_max_tokens: int | None = None
    warning: str | None = None   # the measurement failed and the default was taken: why

    def to_dict(self) -> dict:
        """The ``server.started`` ``config.prefill_chunk_choice`` record (times in ms / µs)."""
        out = {"tokens": self.tokens, "source": self.source}
        if self.warning:
            out["warning"] = self.warning
        if self.fit is not None:
            f = self.fit
            out |= {"fixed_ms": round(f.fixed_s * 1e3, 3),
                    "per_token_us": round(f.per_token_s * 1e6, 3),
                    "measured_tokens": list(f.sizes_tokens),
                    "measured_ms": [round(t * 1e3, 3) for t in f.times_s],
                    "wanted_tokens": self.wanted_tokens,
                    "memory_max_tokens": self.memory_max_tokens}
        return out


def choose_chunk(fixed_s: float, per_token_s: float, memory_max_tokens: int | None = None, *,
                 lo: int = MIN_TOKENS, hi: int = MAX_TOKENS, fixed_share: float = FIXED_SHARE,
                 max_chunk_s: float = MAX_CHUNK_S, multiple: int = MULTIPLE) -> int:
    """The smallest chunk T, a multiple of ``multiple`` in [lo, hi], whose fixed cost is at
    most ``fixed_share`` of its time: ``F <= share (F + c T)``, i.e. ``T >= F (1 - share) /
    (share c)``; then no longer than ``max_chunk_s`` (``F + c T``: the gap it leaves in other
    lanes' decoding) and no more than ``memory_max_tokens`` (each rounded down to a multiple),
    but never below ``lo`` (a plan that cannot afford ``lo`` fails its own check).

    Args:
        fixed_s, per_token_s: F and c of ``time(T) = F + c T``, seconds (c <= 0: no cost per
            token, so the largest chunk).

    Raises:
        ValueError: lo / hi not multiples of ``multiple``, lo > hi, or share not in (0, 1).
    """
    if lo <= 0 or lo % multiple or hi % multiple or lo > hi:
        raise ValueError(f"chunk bounds [{lo}, {hi}] must be positive multiples of {multiple}, "
                         "lo <= hi")
    if not 0 < fixed_share < 1:
        raise ValueError(f"fixed_share must be in (0, 1), got {fixed_share}")
    if per_token_s <= 0:
        t = hi
    else:
        want = max(fixed_s, 0.0) * (1 - fixed_share) / (fixed_share * per_token_s)
        t = min(max(math.ceil(want / multiple) * multiple, lo), hi)
        longest = (max_chunk_s - max(fixed_s, 0.0)) / per_token_s
        t = max(lo, min(t, int(longest // multiple) * multiple))
    if memory_max_tokens is not None:
        t = max(lo, min(t, memory_max_tokens // multiple * multiple))
    return t


def memory_max_tokens(total_bytes_at: Callable[[int], int], capacity_bytes: int | None, *,
                      lo: int = MIN_TOKENS, hi: int = MAX_TOKENS,
                      multiple: int = MULTIPLE) -> int | None:
    """The largest chunk (a multiple of ``multiple`` in [lo, hi]) whose memory plan fits:
    ``total_bytes_at(T) <= capacity_bytes`` (``total_bytes_at`` grows with T). None when the
    capacity is unknown; ``lo`` when even that does not fit (its plan check then says so)."""
    if capacity_bytes is None:
        return None
    a, b = lo // multiple, hi // multiple
    if total_bytes_at(a * multiple) > capacity_bytes:
        return lo
    while a < b:   # the last k in [a, b] that fits; a always fits
        k = (a + b + 1) // 2
        if total_bytes_at(k * multiple) <= capacity_bytes:
            a = k
        else:
            b = k - 1
    return a * multiple


def fit_line(sizes: Sequence[int], times: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``(F, c)`` of ``time = F + c T`` over at least two distinct sizes, F and c
    clamped at 0 (timing noise, or attention's growth past linear, can push F below)."""
    x, y = np.asarray(sizes, dtype=np.float64), np.asarray(times, dtype=np.float64)
    if len(set(x.tolist())) < 2:
        raise ValueError(f"a line needs two distinct sizes, got {list(sizes)}")
    dx = x - x.mean()
    c = float(dx @ (y - y.mean()) / (dx @ dx))
    return max(float(y.mean() - c * x.mean()), 0.0), max(c, 0.0)


def measure_prefill(model, kv, *, sizes: Sequence[int] = MEASURE_TOKENS, reps: int = 3,
                    slot: int = 0, pages: Sequence[int] | None = None,
                    seed: int = 0) -> PrefillFit:
    """Time ``model``'s prefill of one sequence of random ids at each of ``sizes`` tokens into
    ``kv`` (device synchronised around each pass; one warm-up pass at each size first, then the
    fastest of ``reps``) and fit ``time(T) = F + c T``.

    Writes K/V into ``pages`` (default: the first pages of ``kv``) and, on a hybrid model, the
    recurrent state slot ``slot``, which is reset (zero state, frontier 0) before every pass and
    after the last: give a scratch cache, or pages and a slot that no lane holds.

    Raises:
        ValueError: fewer than two distinct sizes, or too few pages (or pages beyond the
            cache) for the largest size.
    """
    from .models.llama import ForwardBatch

    ps = int(kv.page_size)
    longest = max(sizes)
    pages = list(range(math.ceil(longest / ps))) if pages is None else list(pages)
    if len(pages) * ps < longest or max(pages) >= kv.num_pages:
        raise ValueError(f"pages {pages[0]}..{pages[-1]} of a cache of {kv.num_pages} pages of "
                         f"{ps} tokens cannot hold {longest} tokens")
    ids = np.random.default_rng(seed).integers(0, model.config.vocab_size, longest).tolist()
    recurrent = bool(model.is_recurrent)
    sync = getattr(model.ops, "synchronize", None) or (lambda: None)

    def one(n: int) -> float:
        if recurrent:
            kv.reset_state(slot)
        batch = ForwardBatch.from_sequences([ids[:n]], [0], [pages], ps,
                                            state_slots=[slot] if recurrent else None)
        sync()
        t0 = time.perf_counter()
        model.forward(batch, kv)
        sync()
        return time.perf_counter() - t0

    try:
        for n in sizes:   # warm-up: kernel compiles, the memory pool's first allocations
            one(n)
        best = tuple(min(one(n) for _ in range(reps)) for n in sizes)
    finally:
        if recurrent:
            kv.reset_state(slot)
    f, c = fit_line(sizes, best)
    return PrefillFit(f, c, tuple(int(n) for n in sizes), best)


def resolve_prefill_chunk(asked: int | str, model, *, max_context: int,
                          total_bytes_at: Callable[[int], int],
                          capacity_bytes: int | None, kv_dtype: str = "fp32",
                          measure: bool | None = None) -> ChunkChoice:
    """``--prefill-chunk`` as a size: an int as given; ``auto`` measured on the GPU
    (``measure_prefill`` into a scratch cache of one lane, freed after) and chosen by
    ``choose_chunk`` within [``MIN_TOKENS``, ``MAX_TOKENS``] (the top capped at
    ``max_context`` rounded up to ``MULTIPLE``) and the memory bound (``memory_max_tokens``
    of ``total_bytes_at``, the plan's total at a chunk size, against ``capacity_bytes``);
    elsewhere ``MIN_TOKENS`` unmeasured. ``measure``: override the backend's answer (tests)."""
    if asked != AUTO:
        return ChunkChoice(int(asked), "given")
    if measure is None:
        measure = getattr(model.ops, "name", "numpy") == "cupy"
    if not measure:
        return ChunkChoice(MIN_TOKENS, "default")
    hi = min(MAX_TOKENS, math.ceil(max_context / MULTIPLE) * MULTIPLE)
    lo = min(MIN_TOKENS, hi)
    mem = memory_max_tokens(total_bytes_at, capacity_bytes, lo=lo, hi=hi)
    if mem is not None and total_bytes_at(lo) > capacity_bytes:
        return ChunkChoice(lo, "default")   # not even lo fits: the plan check says so next
    ps = 16
    kw = {"max_lanes": 1} if model.is_recurrent else {}
    kv = model.new_kv_cache(math.ceil(max(MEASURE_TOKENS) / ps), ps, kv_dtype=kv_dtype, **kw)
    try:
        fit = measure_prefill(model, kv)
    except Exception as exc:   # (a start-up measurement must not stop the server)
        return ChunkChoice(lo, "default", warning=f"--prefill-chunk auto: the measurement "
                           f"failed ({type(exc).__name__}: {exc}); prefilling in chunks of {lo}")
    finally:
        del kv   # (the scratch; CuPy's pool hands its blocks back when the KV pool needs them)
    wanted = choose_chunk(fit.fixed_s, fit.per_token_s, lo=lo, hi=hi)
    return ChunkChoice(choose_chunk(fit.fixed_s, fit.per_token_s, mem, lo=lo, hi=hi),
                       "measured", fit, wanted, mem)

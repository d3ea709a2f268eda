"""The batch-size buckets whose decode passes the CuPy backend captures as CUDA graphs
(``gpu.graphs``), and the lengths of its captured single-sequence prefill passes; here without
CuPy so that ``ninfer plan`` can size their memory anywhere."""
from __future__ import annotations

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)


def buckets_for(max_batch: int, largest: int = DEFAULT_BUCKETS[-1]) -> tuple[int, ...]:
    """Batch-size buckets 1, 2, 4, ... up to the first one >= ``max_batch`` (at most
    ``largest``; batches above the last bucket run eagerly).

    Raises:
        ValueError: ``max_batch < 1``.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    out, b = [], 1
    while True:
        out.append(b)
        if b >= max_batch or b * 2 > largest:
            return tuple(out)
        b *= 2


PREFILL_MIN = 16     # the shortest captured prefill pass (shorter ones are padded to it)
PREFILL_MAX = 2048   # passes longer than this run eagerly (bound by the device, not the host)


def prefill_lengths(chunk: int, largest: int = PREFILL_MAX) -> tuple[int, ...]:
    """Single-sequence prefill pass lengths captured as CUDA graphs for a prefill chunk of
    ``chunk`` tokens: 16, 32, 64, ... below ``min(chunk, largest)``, then that length itself.
    A pass of T tokens (1 < T <= the last) is padded to the first length >= T, so at most
    half of a replay's rows are padding; () below 16 tokens (a pass of up to ``verify_rows``
    rows takes the verify attention, which is not written for padding rows)."""
    cap = min(chunk, largest)
    if cap < PREFILL_MIN:
        return ()
    out, t = [], PREFILL_MIN
    while t < cap:
        out.append(t)
        t *= 2
    return (*out, cap)

"""The batch-size buckets whose decode passes the CuPy backend captures as CUDA graphs
(``gpu.graphs``); here without CuPy so that ``ninfer plan`` can size their memory anywhere."""
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

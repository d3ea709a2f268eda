"""Helpers shared by the benchmark scripts (bench/ is on sys.path when a script runs)."""
from __future__ import annotations

import json
import statistics
from collections.abc import Callable


def report(res: dict, path: str | None) -> None:
    """Print ``res`` as one JSON line and, with ``path``, write it there (indented)."""
    print(json.dumps(res))
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)


def graph_seconds(step: Callable[[int], None], reps: int, replays: int = 5) -> float:
    """Device seconds per call of ``step(i)``: ``step(0)``, ``step(1)`` run once eagerly (compile,
    caches), then ``step(0) .. step(reps - 1)`` are captured in one CUDA graph on a private
    stream and the median of ``replays`` event-timed replays is divided by ``reps`` (host launch
    cost excluded, the inter-kernel gaps of graph replay included, as in decode)."""
    import cupy as cp
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for i in range(min(2, reps)):
            step(i)
        stream.synchronize()
        stream.begin_capture()
        for i in range(reps):
            step(i)
        g = stream.end_capture()
        g.launch(stream=stream)
        stream.synchronize()
        ts = []
        for _ in range(replays):
            s, e = cp.cuda.Event(), cp.cuda.Event()
            s.record(stream)
            g.launch(stream=stream)
            e.record(stream)
            e.synchronize()
            ts.append(cp.cuda.get_elapsed_time(s, e) / 1e3)
    return statistics.median(ts) / reps

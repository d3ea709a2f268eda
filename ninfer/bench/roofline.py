"""The memory roofline of decode: bytes a token streams, the copy bandwidth measured in the same
run, and the fraction of that bandwidth a measured rate reaches.

A decode step reads every prepared weight once (the embedding table only where it is tied to the
output head: otherwise only its gathered rows) plus each lane's K/V up to its context and, for a
hybrid model, reads and writes each lane's recurrent state. The
roofline is the copy bandwidth (bytes read + written by one large device-to-device copy) over
those bytes; a rate's fraction is ``bytes x steps/s / bandwidth``.
"""
from __future__ import annotations

import statistics
import time

import numpy as np


def copy_bandwidth(backend: str, nbytes: int | None = None) -> float:
    """Bytes/s of a large copy on ``backend`` (``"cupy"``: device to device, median of 10
    event-timed copies of 2 GiB; ``"numpy"``: host, best of 5 copies of 256 MiB), counting
    bytes read plus bytes written."""
    if backend == "cupy":
        return _device_copy_bandwidth(nbytes or 2 << 30)
    return _host_copy_bandwidth(nbytes or 256 << 20)


def _device_copy_bandwidth(nbytes: int) -> float:
    import cupy as cp

    a = cp.empty(nbytes // 4, dtype=cp.float32)
    a.fill(1.0)
    b = cp.empty_like(a)
    times = []
    for i in range(12):
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record()
        cp.copyto(b, a)
        e.record()
        e.synchronize()
        if i >= 2:  # two warm-up copies
            times.append(cp.cuda.get_elapsed_time(s, e) / 1e3)
    del a, b
    return 2 * nbytes / statistics.median(times)


def _host_copy_bandwidth(nbytes: int, reps: int = 5) -> float:
    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def array_bytes(w) -> int:
    """Bytes of one prepared weight: an array, a packed GPU weight (``nbytes``: codes + scales)
    or a weight fused from parts (``parts``)."""
    if hasattr(w, "parts"):
        return sum(array_bytes(p) for p in w.parts)
    return int(w.nbytes)


LAYER_WEIGHTS = ("input_norm", "qkv", "o", "post_norm", "gate_up", "down")


BLOCK_WEIGHTS = ("input_norm", "post_norm", "gate_up", "down")


def weight_bytes(model) -> int:
    """Bytes one decode pass streams from the weights: every layer's (a Llama model's
    ``layers``, or a hybrid model's ``blocks`` and their mixers), the final norm and the output
    head (the embedding table only as the tied head; not an MTP head). ``model`` may be a decode
    wrapper around the model (``.model``)."""
    model = getattr(model, "model", model)
    total = array_bytes(model.norm) + array_bytes(model.lm_head)
    for layer in getattr(model, "layers", ()):
        total += sum(array_bytes(getattr(layer, f)) for f in LAYER_WEIGHTS)
    for blk in getattr(model, "blocks", ()):
        total += sum(array_bytes(getattr(blk, f)) for f in BLOCK_WEIGHTS)
        total += sum(array_bytes(getattr(blk.mixer, f)) for f in blk.mixer.__slots__)
    return total


def step_bytes(weights: int, kv_bytes_per_position: int, batch: int, context: float,
               state_bytes: int = 0) -> int:
    """Bytes of one decode step of ``batch`` lanes at a mean ``context`` of cached positions:
    the weights once, each lane's K/V and its recurrent state read and written
    (``state_bytes`` a lane, a hybrid model's)."""
    return int(weights + batch * (context * kv_bytes_per_position + 2 * state_bytes))


def fraction(bytes_per_step: float, steps_per_s: float, bandwidth: float) -> float:
    """The share of ``bandwidth`` (bytes/s) that ``steps_per_s`` steps of ``bytes_per_step``
    bytes stream."""
    return bytes_per_step * steps_per_s / bandwidth

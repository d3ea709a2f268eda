"""What the CuPy KV tests (``test_cupy_kv16``, ``test_cupy_kv8``, ``test_cupy_kvrk``) share: the
GPU check, the NaN poisoning of every array the GPU code allocates, the backends, the float32
bound and the relative error, and the head shapes of the RoPE writers' cases. A test module
imports the fixtures by name (pytest collects them from its namespace)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ninfer.kernels import get_ops
from ninfer.kernels.config import KernelConfig

cp = pytest.importorskip("cupy")

F32 = 1e-5
# (nq, nk, hd, rotary_dim, style): Llama-shaped (GQA, full RoPE) and Qwen3.5-shaped (24 / 4
# scaled down to 6 / 1, head dim 256, partial rotary 64)
LLAMA = [(8, 2, 64, None, "half"), (16, 4, 128, None, "half")]
QWEN = [(6, 1, 256, 64, "half")]


def has_gpu() -> bool:
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Fill every new CuPy float array with NaN and integer arrays with their largest value (an
    index past any array)."""
    orig = cp.empty

    def nan_empty(shape, dtype=float, order="C"):
        a = orig(shape, dtype=dtype, order=order)
        kind = cp.dtype(dtype).kind
        a.fill(np.nan if kind == "f" else np.iinfo(dtype).max if kind in "ui" else -1)
        return a

    monkeypatch.setattr(cp, "empty", nan_empty)


@pytest.fixture(scope="module")
def gops():
    return get_ops("cupy")


@pytest.fixture(scope="module")
def nops():
    return get_ops("numpy")


def kconf(**changes) -> KernelConfig:
    return replace(KernelConfig(), **changes)


def rel(gpu, ref) -> float:
    g = cp.asnumpy(gpu) if isinstance(gpu, cp.ndarray) else np.asarray(gpu)
    assert not np.isnan(g).any(), "unwritten (NaN-poisoned) or NaN output"
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.abs(g.astype(np.float64) - ref).max() / np.abs(ref).max())


def host(rows) -> np.ndarray:
    a = cp.asnumpy(rows) if isinstance(rows, cp.ndarray) else np.asarray(rows)
    return np.ascontiguousarray(a).view(np.uint8)

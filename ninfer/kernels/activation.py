"""Gated activations, NumPy reference."""
from __future__ import annotations

import numpy as np


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """SwiGLU core: silu(gate) * up, with silu(x) = x * sigmoid(x) = x / (1 + exp(-x)).

    Source: Shazeer 2020, "GLU Variants Improve Transformer" (HF ``LlamaMLP``).

    Args:
        gate: (T, I) float32.
        up: (T, I) float32.

    Returns:
        New (T, I) float32 array.
    """
    with np.errstate(over="ignore"):  # exp(-x) -> inf for very negative x gives silu -> -0
        den = np.exp(-gate)
    den += np.float32(1.0)
    out = gate / den
    out *= up
    return out


def sigmoid_mul(x: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """Output gate: x * sigmoid(gate) (Qwen3.5 / Qwen3-Next gated attention, spec A.5).

    Args:
        x: (T, N) float32.
        gate: (T, N) or (T, H, d) float32 with H d = N (any strides).

    Returns:
        New (T, N) float32 array.
    """
    with np.errstate(over="ignore"):
        g = np.asarray(gate, dtype=np.float32)
        den = np.exp(-(g.reshape(g.shape[0], -1) if g.ndim == 3 else g))
    den += np.float32(1.0)
    return (np.asarray(x, dtype=np.float32) / den).astype(np.float32, copy=False)

"""RMSNorm, NumPy reference.

Source: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"; semantics of
HF ``LlamaRMSNorm`` (statistics in float32, plain weight) and of the zero-centred ``1 + w``
variant used by Qwen3.5 / Gemma (``unit_offset=True``).
"""
from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, unit_offset: bool = False) -> np.ndarray:
    """y = x / sqrt(mean(x**2, -1) + eps) * w   (or ``* (1 + w)`` with ``unit_offset``).

    Args:
        x: (T, H) float32 (any leading shape; normalised over the last axis).
        w: (H,) float32.
        eps: added to the mean square before the square root.
        unit_offset: scale by ``1 + w`` instead of ``w``.

    Returns:
        New (T, H) float32 array; ``x`` is not modified.
    """
    x = np.asarray(x, dtype=np.float32)
    ms = np.einsum("...h,...h->...", x, x)[..., None]
    ms *= np.float32(1.0 / x.shape[-1])
    ms += np.float32(eps)
    y = x / np.sqrt(ms)
    if unit_offset:
        y *= np.float32(1.0) + w
    else:
        y *= w
    return y

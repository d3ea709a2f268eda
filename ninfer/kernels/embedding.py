"""Token embedding gather, NumPy reference."""
from __future__ import annotations

import numpy as np


def embedding(w: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Rows of the embedding table for each token id.

    Args:
        w: (V, H) float32, a prepared weight (see ``linear.prepare_weight``).
        ids: (T,) integer token ids, each in ``[0, V)``.

    Returns:
        New (T, H) float32 array.

    Raises:
        IndexError: an id outside ``[0, V)`` (negative ids are rejected, not wrapped).
    """
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= w.shape[0]):
        raise IndexError(f"token id out of range [0, {w.shape[0]}): "
                         f"min {ids.min()}, max {ids.max()}")
    return w[ids]

"""Rotary position embedding (RoPE), NumPy reference.

Source: Su et al. 2021, "RoFormer" (arXiv:2104.09864). Two pairings of the rotated dims:

- ``"half"`` (HF ``rotate_half``, GPT-NeoX): dim ``i`` pairs with ``i + r/2``;
- ``"adjacent"`` (GPT-J, llama.cpp ``LLAMA_ROPE_TYPE_NORM``): dim ``2i`` pairs with ``2i + 1``.

Pair ``i`` (``i < r/2``, ``r`` = rotary dims) is rotated by the angle ``pos * inv_freq[i]`` with
``inv_freq[i] = theta ** (-2i / r)``. The two styles are the same map up to the fixed
permutation of dims described in ``spec/models.md`` B.5. With partial rotary (``r < hd``) only the
first ``r`` dims of each head rotate; the rest pass through.

Numerics follow HF ``LlamaRotaryEmbedding``: ``inv_freq`` in float32, ``pos * inv_freq`` in
float32, then cos/sin.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

ROPE_STYLES = ("half", "adjacent")
SUPPORTED_SCALING = ("llama3",)


def rope_inv_freq(rotary_dim: int, theta: float,
                  scaling: Mapping | None = None) -> np.ndarray:
    """Per-pair inverse frequencies, (rotary_dim // 2,) float32.

    Args:
        rotary_dim: number of rotated dims per head (even).
        theta: RoPE base.
        scaling: None, or an HF ``rope_scaling`` dict whose type (``rope_type`` or ``type``) is
            ``"default"`` (no scaling) or ``"llama3"`` (keys ``factor``, ``low_freq_factor``,
            ``high_freq_factor``, ``original_max_position_embeddings``), computed as HF
            ``_compute_llama3_parameters`` does.

    Raises:
        ValueError: odd ``rotary_dim`` or an unsupported scaling type.
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    exps = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rotary_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exps)).astype(np.float32)
    kind = rope_scaling_type(scaling)
    if kind is None:
        return inv_freq
    # llama3 (HF transformers modeling_rope_utils._compute_llama3_parameters), float32.
    factor = np.float32(scaling["factor"])
    low = np.float32(scaling["low_freq_factor"])
    high = np.float32(scaling["high_freq_factor"])
    old_ctx = np.float32(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_ctx / low
    high_freq_wavelen = old_ctx / high
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (np.float32(1.0) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_scaling_type(scaling: Mapping | None) -> str | None:
    """The effective scaling type of an HF ``rope_scaling`` dict: None (no scaling) or "llama3".

    Raises:
        ValueError: a type other than "default" / "llama3", or llama3 keys missing.
    """
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in SUPPORTED_SCALING:
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, llama3)")
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings") if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling llama3 lacks {missing}")
    return kind


def rope_cos_sin(positions: np.ndarray, rotary_dim: int, theta: float,
                 scaling: Mapping | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of ``pos * inv_freq``, each (T, 1, rotary_dim // 2) float32."""
    inv_freq = rope_inv_freq(rotary_dim, theta, scaling)
    freqs = np.asarray(positions).astype(np.float32)[:, None] * inv_freq[None, :]
    return np.cos(freqs)[:, None, :], np.sin(freqs)[:, None, :]


class RopeCache:
    """Remembers the last (positions, frequencies) -> (cos, sin) result.

    A forward pass ropes q and k of every layer at the same positions, so one remembered entry
    turns 2 x layers trig evaluations into one. Owned by one ops object (one thread).
    """

    __slots__ = ("key", "positions", "cos", "sin")

    def __init__(self) -> None:
        self.key = None
        self.positions = None
        self.cos = None
        self.sin = None

    def get(self, positions: np.ndarray, rotary_dim: int, theta: float,
            scaling: Mapping | None) -> tuple[np.ndarray, np.ndarray]:
        """``rope_cos_sin(...)``, recomputed only when an argument differs from the last call."""
        skey = tuple(sorted(scaling.items())) if scaling else None
        key = (rotary_dim, float(theta), skey)
        if (key == self.key and self.positions.shape == positions.shape
                and np.array_equal(self.positions, positions)):
            return self.cos, self.sin
        cos, sin = rope_cos_sin(positions, rotary_dim, theta, scaling)
        self.key, self.positions, self.cos, self.sin = key, positions.copy(), cos, sin
        return cos, sin


def rotary_dims(style: str, hd: int, rotary_dim: int | None) -> int:
    """Checked rotated dims per head (``rotary_dim``, or ``hd`` when None).

    Raises:
        ValueError: unknown style or ``rotary_dim`` above ``hd``.
    """
    if style not in ROPE_STYLES:
        raise ValueError(f"unknown rope style {style!r} (expected one of {ROPE_STYLES})")
    r = hd if rotary_dim is None else rotary_dim
    if r > hd:
        raise ValueError(f"rotary_dim {r} exceeds head dim {hd}")
    return r


def rope(x: np.ndarray, positions: np.ndarray, theta: float, style: str = "half",
         rotary_dim: int | None = None, scaling: Mapping | None = None,
         cache: RopeCache | None = None) -> np.ndarray:
    """Rotate each head of each token by its position.

    Args:
        x: (T, n, hd) float32 (q or k heads; any strides).
        positions: (T,) integer absolute positions.
        theta: RoPE base (``rope_theta``).
        style: ``"half"`` or ``"adjacent"`` pairing (see module docstring).
        rotary_dim: rotated dims per head, even, ``<= hd``; None means ``hd``.
        scaling: HF ``rope_scaling`` dict or None (see ``rope_inv_freq``).
        cache: optional ``RopeCache`` reused across calls at the same positions.

    Returns:
        New (T, n, hd) float32 C-contiguous array.

    Raises:
        ValueError: unknown style, bad ``rotary_dim`` or unsupported scaling.
    """
    hd = x.shape[-1]
    r = rotary_dims(style, hd, rotary_dim)
    positions = np.asarray(positions)
    if cache is None:
        cos, sin = rope_cos_sin(positions, r, theta, scaling)
    else:
        cos, sin = cache.get(positions, r, theta, scaling)
    h = r // 2
    out = np.empty(x.shape, dtype=np.float32)
    if style == "half":
        x1, x2 = x[..., :h], x[..., h:r]
        o1, o2 = out[..., :h], out[..., h:r]
    else:
        x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
        o1, o2 = out[..., 0:r:2], out[..., 1:r:2]
    np.multiply(x1, cos, out=o1)
    o1 -= x2 * sin
    np.multiply(x2, cos, out=o2)
    o2 += x1 * sin
    if r < hd:
        out[..., r:] = x[..., r:]
    return out

"""Weight tensors as ninfer stores them: plain float, or groupwise int8 / int4 along K.

Layouts (row-major ``(N, K)`` weights, K = in_features contiguous; groups of ``group`` elements
along K):

- ``f32`` / ``f16``: ``data`` holds the values, any shape.
- ``bf16``: ``data`` is ``uint16`` holding the bfloat16 bit pattern (NumPy has no bfloat16).
- ``q8``: ``codes`` int8 ``(N, K)``; ``scales`` float16 ``(N, K // group)``; x = s * q.
- ``q4``: ``codes`` uint8 ``(N, K // 2)``, element ``2i`` in the low nibble and ``2i + 1`` in the
  high nibble; ``scales`` float16 ``(N, K // group)``; ``mins`` float16 ``(N, K // group)`` or
  ``None``. With mins: x = s * q + m (GGUF Q4_1); without: x = s * (q - 8) (GGUF Q4_0).

GGUF Q4_0, Q4_1 and Q8_0 (group 32) map onto ``q4`` / ``q8`` losslessly: the dequantized
float32 values are bit-identical to ``gguf.quants.dequantize`` (same float32 arithmetic).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FLOAT_SCHEMES = ("f32", "f16", "bf16")
QUANT_SCHEMES = ("q8", "q4")
SCHEMES = FLOAT_SCHEMES + QUANT_SCHEMES


@dataclass(slots=True, frozen=True)
class QuantTensor:
    """One stored weight tensor.

    Attributes:
        scheme: one of ``SCHEMES``.
        shape: logical shape (for quantized schemes ``(N, K)``).
        data: float payload for float schemes, else None.
        codes / scales / mins: quantized payload (see module docstring), else None.
        group: elements per scale group along K (quantized schemes), else 0.
    """

    scheme: str
    shape: tuple[int, ...]
    data: np.ndarray | None = None
    codes: np.ndarray | None = None
    scales: np.ndarray | None = None
    mins: np.ndarray | None = None
    group: int = 0

    @property
    def nbytes(self) -> int:
        """Stored payload size in bytes (codes + scales + mins, or data)."""
        parts = (self.data, self.codes, self.scales, self.mins)
        return sum(int(p.nbytes) for p in parts if p is not None)

    def parts(self) -> dict[str, np.ndarray]:
        """The named payload arrays that an artifact stores for this tensor."""
        names = ("data", "codes", "scales", "mins")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16, any shape) -> float32, exact."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def dequantize(t: QuantTensor) -> np.ndarray:
    """Expand a stored tensor to float32 of shape ``t.shape``.

    Raises:
        ValueError: unknown scheme.
    """
    if t.scheme == "f32":
        return np.asarray(t.data, dtype=np.float32)
    if t.scheme == "f16":
        return np.asarray(t.data).astype(np.float32)
    if t.scheme == "bf16":
        return bf16_to_f32(np.asarray(t.data))
    n, k = t.shape
    g = t.group
    s = t.scales.astype(np.float32).reshape(n, k // g, 1)
    if t.scheme == "q8":
        q = t.codes.astype(np.float32).reshape(n, k // g, g)
        return (q * s).reshape(n, k)
    if t.scheme == "q4":
        packed = np.asarray(t.codes)
        q = np.empty((n, k), dtype=np.uint8)
        q[:, 0::2] = packed & 0x0F
        q[:, 1::2] = packed >> 4
        qf = q.astype(np.float32).reshape(n, k // g, g)
        if t.mins is None:
            return (s * (qf - np.float32(8.0))).reshape(n, k)
        m = t.mins.astype(np.float32).reshape(n, k // g, 1)
        return (s * qf + m).reshape(n, k)
    raise ValueError(f"unknown weight scheme {t.scheme!r}")


def quantize_q8(w: np.ndarray, group: int = 32) -> QuantTensor:
    """Symmetric groupwise int8 quantization of a float ``(N, K)`` matrix (round to nearest).

    Raises:
        ValueError: K not a multiple of ``group`` or not 2-D.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % group:
        raise ValueError(f"q8 needs a 2-D tensor with K % {group} == 0, got shape {w.shape}")
    n, k = w.shape
    blocks = w.reshape(n, k // group, group)
    d = np.abs(blocks).max(axis=-1) / np.float32(127.0)
    d16 = d.astype(np.float16)
    d32 = d16.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(d32 == 0, 0.0, 1.0 / d32).astype(np.float32)
    q = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int8)
    return QuantTensor("q8", (n, k), codes=q.reshape(n, k), scales=d16, group=group)

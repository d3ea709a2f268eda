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


def f32_to_bf16(w: np.ndarray) -> np.ndarray:
    """float32 (any shape) -> bfloat16 bit patterns (uint16), round to nearest even.

    NaN stays NaN (quiet); values past the bf16 range round to +-inf, as torch's
    ``tensor.to(torch.bfloat16)`` does.
    """
    bits = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(np.asarray(w, dtype=np.float32))
    if nan.any():
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return out


def quantize_q4(w: np.ndarray, group: int = 32) -> QuantTensor:
    """Asymmetric groupwise int4 quantization with mins of a float ``(N, K)`` matrix.

    Per group of ``group`` elements along K: ``m = min(x)``, ``s = (max(x) - m) / 15`` (both
    rounded to float16 first), ``q = clip(rint((x - m) / s), 0, 15)``; dequantized as
    ``x = s * q + m`` (the GGUF Q4_1 rule, ``quant.dequantize``). The max error per element is
    about ``s / 2`` plus the float16 rounding of ``m``. Codes are packed two per byte (element
    ``2i`` in the low nibble).

    Args:
        w: (N, K) float array.
        group: elements per scale/min group along K (even; 32 matches Q4_1).

    Returns:
        A ``q4`` QuantTensor with ``mins``.

    Raises:
        ValueError: not 2-D, or K not a multiple of ``group``, or ``group`` odd.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or group <= 0 or group % 2 or w.shape[1] % group:
        raise ValueError(f"q4 needs a 2-D tensor with K % {group} == 0 (even group), "
                         f"got shape {w.shape}")
    n, k = w.shape
    blocks = w.reshape(n, k // group, group)
    lo = blocks.min(axis=-1)
    hi = blocks.max(axis=-1)
    m16 = lo.astype(np.float16)
    m32 = m16.astype(np.float32)
    d16 = ((hi - m32) / np.float32(15.0)).astype(np.float16)
    d32 = d16.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(d32 == 0, 0.0, 1.0 / d32).astype(np.float32)
    q = np.clip(np.rint((blocks - m32[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
    q = q.reshape(n, k)
    codes = np.ascontiguousarray(q[:, 0::2] | (q[:, 1::2] << 4))
    return QuantTensor("q4", (n, k), codes=codes, scales=d16, mins=m16, group=group)

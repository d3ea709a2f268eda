"""Reference codecs of the KV storage modes (``engine.kv_dtypes.KV_DTYPES``), NumPy.

One token's K (or V) head of ``head_dim`` dims is stored as ``codes`` (uint8 bytes) plus fp16
``scales``, one per 64-dim group (none for fp16/fp32, whose codes are the raw float bytes), so
every mode has the same storage shape. Source: spec/models.md D.1-D.3, after the ninfer-4090
kernels it cites:

- ``int8``: s = fp16(max|x| / 127) per group, codes clamp(rint(x / s), +-127);
- ``rk*`` modes first rotate each group, y = H64 x (orthonormal Sylvester-Hadamard), then
  int8 (/127), int4 (s = fp16(max|y| / 7), codes +-7, two a byte, low nibble = even dim), E8
  rounding to int4 (``rk4v4-e8`` K, codes -8..7) or the E8-root codec (``rk2v4-e8`` K,
  2 bytes per 8 dims); decode applies the inverse rotation (H64 is self-inverse).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ninfer.engine.kv_dtypes import GROUP, KV_DTYPES
from ninfer.kernels import e8

_F = np.float32
_FP16_MAX = 65504.0
# code bits per dim, and the largest code magnitude that sets the scale
_BITS = {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4, "e8": 4, "e8root": 2}
_QMAX = {"int8": 127, "int4": 7, "e8": 7, "e8root": 7}


def hadamard(n: int = GROUP) -> np.ndarray:
    """Orthonormal Sylvester-Hadamard matrix in natural order, H[i,j] = (-1)^popcount(i&j)/sqrt(n),
    (n, n) float32; symmetric and its own inverse. ``n`` must be a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, not {n}")
    i = np.arange(n)
    sign = 1 - 2 * (np.bitwise_count(i[:, None] & i[None, :]).astype(np.int64) & 1)
    return (sign / np.sqrt(n)).astype(_F)


H64 = hadamard(GROUP)


def rotate(x: np.ndarray) -> np.ndarray:
    """y = H64 x per 64-dim group of the last axis (..., D) float32; also the inverse rotation.

    A fast Walsh-Hadamard butterfly in float32 with a fixed order, so that a GPU encoder gets
    the same bits (a matrix product's summation order is unspecified): stages h = 1, 2, .., 32
    each map the pair (i, i + h), i & h == 0, to (x_i + x_{i+h}, x_i - x_{i+h}); then times
    0.125 (H64 = H / 8, a power of two)."""
    x = np.asarray(x, dtype=_F)
    lead = x.shape[:-1]
    y = x.reshape(-1, GROUP)
    h = 1
    while h < GROUP:
        pairs = y.reshape(-1, GROUP // (2 * h), 2, h)
        lo, hi = pairs[:, :, 0, :], pairs[:, :, 1, :]
        y = np.stack([lo + hi, lo - hi], axis=2).reshape(-1, GROUP)
        h *= 2
    return (y * _F(0.125)).reshape(*lead, x.shape[-1])


def _pack4(q: np.ndarray) -> np.ndarray:
    """int codes in -8..7 (..., D) -> (..., D/2) uint8, low nibble = even dim."""
    q = q.astype(np.uint8) & 0xF
    return q[..., 0::2] | (q[..., 1::2] << 4)


def _unpack4(b: np.ndarray) -> np.ndarray:
    """(..., D/2) uint8 -> (..., D) int8 codes, ((nibble ^ 8) - 8)."""
    nib = np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])
    return (nib.astype(np.int8) ^ 8) - 8


@dataclass(frozen=True, slots=True)
class PartCodec:
    """The codec of one of K or V in a mode.

    Attributes:
        kind: ``fp32``, ``fp16``, ``int8``, ``int4``, ``e8`` (E8-rounded int4) or ``e8root``.
        rotated: the codes hold the Hadamard-rotated vector (decode rotates back).
    """

    kind: str
    rotated: bool = False

    def code_bytes(self, head_dim: int) -> int:
        """Code bytes of one head of ``head_dim`` dims (the fp16 scales not included)."""
        return head_dim * _BITS[self.kind] // 8

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one head's storage row: its codes, then its fp16 scales' bytes
        (``kv_dtypes.head_bytes``)."""
        scales = 0 if self.kind in ("fp32", "fp16") else 2 * (head_dim // GROUP)
        return self.code_bytes(head_dim) + scales

    def encode_rows(self, x: np.ndarray) -> np.ndarray:
        """``encode`` of heads x (..., head_dim) as storage rows (..., row_bytes) uint8: the
        codes, then the scales' little-endian fp16 bytes (what a quantized ``KVCache`` holds).

        Raises:
            ValueError: as ``encode``.
        """
        codes, scales = self.encode(x)
        if not scales.shape[-1]:
            return codes
        sb = np.ascontiguousarray(scales.astype("<f2")).view(np.uint8)
        return np.concatenate([codes, sb], axis=-1)

    def decode_rows(self, rows: np.ndarray, head_dim: int) -> np.ndarray:
        """Heads (..., head_dim) float32 back from ``encode_rows``'s rows (..., row_bytes).

        Raises:
            ValueError: rows of another width or dtype than this codec's rows of ``head_dim``.
        """
        rows = np.asarray(rows)
        if rows.dtype != np.uint8 or rows.ndim < 1 or \
                rows.shape[-1] != self.row_bytes(head_dim):
            raise ValueError(f"{rows.dtype} rows of {rows.shape[-1:]} bytes are no {self.kind} "
                             f"rows of head dim {head_dim} ({self.row_bytes(head_dim)} bytes)")
        cb = self.code_bytes(head_dim)
        scales = np.ascontiguousarray(rows[..., cb:]).view("<f2").astype(np.float16)
        return self.decode(rows[..., :cb], scales)

    def encode(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Encode heads x (..., head_dim) float32.

        Returns:
            codes (..., code_bytes(head_dim)) uint8 and scales (..., head_dim // 64) float16
            ((..., 0) for fp16 / fp32).

        Raises:
            ValueError: x is not a float array, holds NaN or inf, has a head dim that is not a
                multiple of 64 (quantized kinds), or values beyond what fp16 (scales) can hold.
        """
        x = np.asarray(x)
        if x.ndim < 1 or x.dtype.kind != "f":
            raise ValueError(f"KV codec input must be a float array (..., head_dim), got "
                             f"{x.dtype} of shape {x.shape}")
        x = x.astype(_F, copy=False)
        if not np.isfinite(x).all():
            raise ValueError("KV codec input holds NaN or inf")
        lead, hd = x.shape[:-1], x.shape[-1]
        if self.kind in ("fp32", "fp16"):
            if self.kind == "fp16" and x.size and np.abs(x).max() > _FP16_MAX:
                raise ValueError("KV values beyond the fp16 range cannot be stored as fp16")
            dt = np.float32 if self.kind == "fp32" else np.float16
            codes = np.ascontiguousarray(x.astype(dt)).view(np.uint8)
            return codes, np.empty((*lead, 0), dtype=np.float16)
        if hd % GROUP:
            raise ValueError(f"head dim {hd} is not a multiple of {GROUP}")
        y = (rotate(x) if self.rotated else x).reshape(*lead, hd // GROUP, GROUP)
        qmax = _QMAX[self.kind]
        absmax = np.abs(y).max(axis=-1)
        if (absmax / qmax > _FP16_MAX).any():
            raise ValueError("KV values too large for an fp16 group scale")
        scales = (absmax / _F(qmax)).astype(np.float16)
        s = scales.astype(_F)[..., None]
        # times 1/s as the GPU encoders do; absmax 0 (or a scale under fp16's range) -> codes 0
        z = y * np.where(s > 0, _F(1) / np.where(s > 0, s, _F(1)), _F(0))
        if self.kind in ("int8", "int4"):
            q = np.clip(np.rint(z), -qmax, qmax).astype(np.int8)
        elif self.kind == "e8":                  # E8 point per 8 dims, then int4 (coset collapses)
            p = e8.e8_nearest(z.reshape(*z.shape[:-1], 8, 8)).reshape(z.shape)
            q = np.clip(np.rint(p), -8, 7).astype(np.int8)
        else:                                    # e8root: (root, radius|axis) per 8 dims
            root, rad_axis = e8.root_encode(y.reshape(*y.shape[:-1], 8, 8), s)
            keep = (s > 0).astype(np.uint8)
            codes = np.stack([root * keep, rad_axis * keep], axis=-1)
            return codes.reshape(*lead, hd // 4), scales
        q = q.reshape(*lead, hd)
        codes = q.view(np.uint8) if self.kind == "int8" else _pack4(q)
        return codes, scales

    def decode(self, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
        """Heads (..., head_dim) float32 back from ``encode``'s codes and scales, unrotated.

        Raises:
            ValueError: dtypes, leading shapes or byte counts that do not fit this codec.
        """
        codes, scales = np.asarray(codes), np.asarray(scales)
        if codes.dtype != np.uint8 or scales.dtype != np.float16:
            raise ValueError(f"codes must be uint8 and scales float16, got {codes.dtype} and "
                             f"{scales.dtype}")
        if codes.ndim < 1 or codes.shape[:-1] != scales.shape[:-1]:
            raise ValueError(f"codes {codes.shape} and scales {scales.shape} differ in their "
                             f"leading shape")
        lead, nbytes = codes.shape[:-1], codes.shape[-1]
        if self.kind in ("fp32", "fp16"):
            dt = np.float32 if self.kind == "fp32" else np.float16
            if nbytes % np.dtype(dt).itemsize or scales.shape[-1]:
                raise ValueError(f"{nbytes} code bytes / {scales.shape[-1]} scales are no "
                                 f"{self.kind} head")
            return np.ascontiguousarray(codes).view(dt).astype(_F)
        hd = scales.shape[-1] * GROUP
        if hd == 0 or nbytes != self.code_bytes(hd):
            raise ValueError(f"{nbytes} code bytes do not fit {scales.shape[-1]} groups of "
                             f"{self.kind} codes ({self.code_bytes(hd)} expected)")
        if self.kind == "int8":
            q = np.ascontiguousarray(codes).view(np.int8)
        elif self.kind in ("int4", "e8"):
            q = _unpack4(codes)
        else:
            q = e8.root_decode(codes[..., 0::2], codes[..., 1::2]).reshape(*lead, hd)
        y = q.reshape(*lead, hd // GROUP, GROUP).astype(_F) * scales.astype(_F)[..., None]
        y = y.reshape(*lead, hd)
        return rotate(y) if self.rotated else y


@dataclass(frozen=True, slots=True)
class KVCodec:
    """The K and V codecs of one ``--kv-dtype`` mode."""

    dtype: str
    k: PartCodec
    v: PartCodec


_INT4_ROT = PartCodec("int4", rotated=True)
_CODECS = {
    "fp32": KVCodec("fp32", PartCodec("fp32"), PartCodec("fp32")),
    "fp16": KVCodec("fp16", PartCodec("fp16"), PartCodec("fp16")),
    "int8": KVCodec("int8", PartCodec("int8"), PartCodec("int8")),
    "rk8v4": KVCodec("rk8v4", PartCodec("int8", rotated=True), _INT4_ROT),
    "rk4v4": KVCodec("rk4v4", _INT4_ROT, _INT4_ROT),
    "rk4v4-e8": KVCodec("rk4v4-e8", PartCodec("e8", rotated=True), _INT4_ROT),
    "rk2v4-e8": KVCodec("rk2v4-e8", PartCodec("e8root", rotated=True), _INT4_ROT),
}


def codec(dtype: str) -> KVCodec:
    """The codec of a KV dtype.

    Raises:
        ValueError: not one of ``KV_DTYPES``.
    """
    try:
        return _CODECS[dtype]
    except KeyError:
        raise ValueError(f"unknown KV dtype {dtype!r} (expected one of "
                         f"{', '.join(KV_DTYPES)})") from None

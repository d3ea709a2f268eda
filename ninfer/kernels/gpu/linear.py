"""Linear layers over stored weights on the GPU.

Quantized weights (``q4`` / ``q8`` of ``ninfer.store.quant``) stay packed in VRAM exactly as
stored: int4/int8 codes plus fp16 scales (and mins). ``linear`` then picks by T (tokens):

- T <= ``GEMV_MAX_T``: the GEMV kernels of ``linear.cu`` read the packed codes directly, 8 token
  rows per launch (decode is memory-bound: the cost is the packed bytes read once per launch);
- larger T (prefill): the weight is dequantized into an fp16 scratch matrix owned by the ops
  object (reused by every weight, never kept per weight), the activations are rounded to fp16,
  and cuBLAS ``gemmEx`` multiplies them on the tensor cores with float32 accumulation and a
  float32 result.

Float weights (``f32 f16 bf16``) are kept as float32 arrays and multiplied with cuBLAS sgemm.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import cupy as cp
import numpy as np

from ninfer.kernels.gpu import function
from ninfer.kernels.linear import fused_k
from ninfer.store.quant import QuantTensor, dequantize

GEMV_MAX_T = 32   # token rows up to which linear uses the GEMV kernels
GEMV_CHUNK = 8    # token rows per GEMV launch (template parameter T of the kernels)
_R = {1: 4, 2: 4, 3: 4, 4: 4, 5: 4, 6: 4, 7: 4, 8: 4}  # output rows per block, by T (q8)
# q4 GEMV shape by T: (R output rows per block, U steps whose code loads are issued together,
# P: 1 = ``gemv_q4p``, every load of the U steps (codes, scales, activations) issued before any
# arithmetic; 0 = ``gemv_q4``, code loads first). A streaming variant (fixed resident grid, next
# chunk's loads in flight) measured 25-40 % slower and was removed (commit ba81050). Module state so that benchmarks can try the
# compiled alternatives (``Q4_VARIANTS``).
# T = 1 uses (4, 4, 0): the 8B-shape sweep (bench/gpu_notes.md) put it 5 % ahead of (4, 2, 0)
# over a token's GEMVs; more rows per block, prefetching and U = 8 were all slower.
Q4_SHAPE = {t: (4, 2, 0) for t in range(1, 9)} | {1: (4, 4, 0)}
Q4_VARIANTS = {1: [(4, 2, 0), (4, 4, 0), (2, 4, 0), (2, 4, 1), (4, 2, 1), (4, 4, 1), (8, 2, 1)],
               2: [(4, 4, 0), (2, 4, 1), (4, 4, 1)]}


def _q4_name(t: int, shape: tuple, mins: bool) -> str:
    r, u, p = shape
    return f"gemv_q4{'p' if p else ''}<{t},{r},{'true' if mins else 'false'},{u}>"


_NAMES = tuple([_q4_name(t, sh, m) for m in (True, False) for t in range(1, 9)
                for sh in sorted(set([Q4_SHAPE[t]] + Q4_VARIANTS.get(t, [])))]
               + [f"gemv_q8<{t},{_R[t]}>" for t in range(1, 9)])

_CUDA_R_16F, _CUDA_R_32F, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT = 2, 0, 68, -1
_ONE = np.array(1.0, dtype=np.float32)
_ZERO = np.array(0.0, dtype=np.float32)


def _fn(fname: str):
    return function("linear", fname, _NAMES)


@dataclass(slots=True)
class GpuWeight:
    """A quantized ``(N, K)`` weight resident on the GPU in its stored layout.

    Attributes:
        scheme: ``"q4"`` or ``"q8"``.
        shape: ``(N, K)``.
        group: elements per scale group along K (a multiple of 32 for the GEMV kernels).
        codes: q4 uint8 ``(N, K/2)`` / q8 int8 ``(N, K)``; scales: float16 ``(N, K/group)``;
        mins: float16 ``(N, K/group)`` or None (q4 only).
    """

    scheme: str
    shape: tuple[int, int]
    group: int
    codes: cp.ndarray
    scales: cp.ndarray
    mins: cp.ndarray | None = None

    @property
    def nbytes(self) -> int:
        """Device bytes of codes + scales + mins (what one GEMV pass reads)."""
        return sum(int(a.nbytes) for a in (self.codes, self.scales, self.mins) if a is not None)

    @property
    def gemv_ok(self) -> bool:
        """Whether the GEMV kernels accept this layout (K and group multiples of 32)."""
        return self.shape[1] % 32 == 0 and self.group % 32 == 0


@dataclass(slots=True)
class FusedWeight:
    """Weights of differing schemes fused along N: ``parts[i]`` yields columns
    ``offsets[i]:offsets[i+1]`` of ``linear``'s output."""

    parts: list
    offsets: list[int]
    shape: tuple[int, int]


def upload(t: QuantTensor):
    """A stored 2-D weight on the GPU: ``GpuWeight`` for q4/q8, else a float32 ``cp.ndarray``."""
    if t.scheme == "q4":
        return GpuWeight("q4", tuple(t.shape), t.group, cp.asarray(np.ascontiguousarray(t.codes)),
                         cp.asarray(np.ascontiguousarray(t.scales, dtype=np.float16)),
                         None if t.mins is None else
                         cp.asarray(np.ascontiguousarray(t.mins, dtype=np.float16)))
    if t.scheme == "q8":
        return GpuWeight("q8", tuple(t.shape), t.group,
                         cp.asarray(np.ascontiguousarray(t.codes, dtype=np.int8)),
                         cp.asarray(np.ascontiguousarray(t.scales, dtype=np.float16)))
    return cp.asarray(np.ascontiguousarray(dequantize(t), dtype=np.float32))


def upload_fused(ts: Sequence[QuantTensor]):
    """Several ``(N_i, K)`` weights as one ``(sum N_i, K)`` weight (see ``NumpyOps.prepare_fused``).

    Same quantized scheme, group and mins presence: the packed parts are concatenated along N
    (one GEMV launch). Otherwise a ``FusedWeight`` of separately uploaded parts.

    Raises:
        ValueError: empty list, a tensor that is not 2-D, or differing K.
    """
    k = fused_k(ts)
    n = sum(t.shape[0] for t in ts)
    kinds = {(t.scheme, t.group, t.mins is None) for t in ts}
    if len(kinds) == 1 and ts[0].scheme in ("q4", "q8"):
        t0 = ts[0]
        cat = lambda name, dt: np.concatenate(
            [np.asarray(getattr(t, name), dtype=dt) for t in ts], axis=0)
        codes = cat("codes", np.uint8 if t0.scheme == "q4" else np.int8)
        mins = None if t0.mins is None else cat("mins", np.float16)
        return upload(QuantTensor(t0.scheme, (n, k), codes=codes,
                                  scales=cat("scales", np.float16), mins=mins, group=t0.group))
    if all(t.scheme not in ("q4", "q8") for t in ts):
        return cp.asarray(np.concatenate([dequantize(t).astype(np.float32) for t in ts], axis=0))
    offs = np.cumsum([0] + [t.shape[0] for t in ts]).tolist()
    return FusedWeight([upload(t) for t in ts], offs, (n, k))


def gemv(x: cp.ndarray, w: GpuWeight, out: cp.ndarray) -> None:
    """``out[:T] = x @ dequant(w).T`` with the packed-weight GEMV kernels.

    Args:
        x: (T, K) float32 C-contiguous, ``1 <= T``.
        w: q4/q8 weight with ``gemv_ok``.
        out: (T, N) float32 C-contiguous, overwritten.
    """
    t_total, k = x.shape
    n = w.shape[0]
    for t0 in range(0, t_total, GEMV_CHUNK):
        tc = min(GEMV_CHUNK, t_total - t0)
        r = Q4_SHAPE[tc][0] if w.scheme == "q4" else _R[tc]
        blocks = -(-n // r)  # one 128-thread block per r rows
        xs, os_ = x[t0:t0 + tc], out[t0:t0 + tc]
        if w.scheme == "q4":
            mins = w.mins is not None
            fn = _fn(_q4_name(tc, Q4_SHAPE[tc], mins))
            fn((blocks,), (128,), (xs, w.codes, w.scales, w.mins if mins else w.scales, os_,
                                   np.int32(n), np.int32(n), np.int32(k), np.int32(w.group)))
        else:
            fn = _fn(f"gemv_q8<{tc},{r}>")
            fn((blocks,), (128,), (xs, w.codes, w.scales, os_, np.int32(n), np.int32(n),
                                   np.int32(k), np.int32(w.group)))


def dequantize_f16(w: GpuWeight, out: cp.ndarray) -> None:
    """Write ``dequant(w)`` as float16 into ``out`` (at least N*K elements, C order)."""
    n, k = w.shape
    if w.scheme == "q4":
        nbytes = n * k // 2
        blocks = min(-(-nbytes // 256), 65535 * 4)
        _fn("dequant_q4_f16")(
            (blocks,), (256,), (w.codes, w.scales,
                                w.mins if w.mins is not None else np.uint64(0), out,
                                np.int64(nbytes), np.int32(k), np.int32(w.group)))
    else:
        total = n * k
        blocks = min(-(-total // 256), 65535 * 4)
        _fn("dequant_q8_f16")((blocks,), (256,), (w.codes, w.scales, out,
                                                               np.int64(total), np.int32(k),
                                                               np.int32(w.group)))


def gemm_f16(x16: cp.ndarray, w16: cp.ndarray, n: int, out: cp.ndarray) -> None:
    """``out = x16 @ w16[:n*K].reshape(n, K).T`` through cuBLAS gemmEx: fp16 operands on the
    tensor cores, float32 accumulation and float32 ``out`` ((T, n), C order)."""
    try:
        from cupy_backends.cuda.libs import cublas
    except ImportError:  # older CuPy layout
        from cupy.cuda import cublas
    t, k = x16.shape
    handle = cp.cuda.device.get_cublas_handle()
    # row-major out (T, n) is column-major out^T (n, T) = W (n x K, from row-major (n, K) read
    # transposed) times x^T (K x T)
    cublas.gemmEx(handle, 1, 0, n, t, k, _ONE.ctypes.data, w16.data.ptr, _CUDA_R_16F, k,
                  x16.data.ptr, _CUDA_R_16F, k, _ZERO.ctypes.data, out.data.ptr, _CUDA_R_32F,
                  n, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)

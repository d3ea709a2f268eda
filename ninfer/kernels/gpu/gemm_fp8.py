"""Prefill GEMMs of packed weights on the fp8 tensor cores (``KernelConfig.prefill_fp8``;
Hopper with cuBLAS 12.9 or newer, ``supported``): both operands as e4m3 codes with a float32
scale a row, the product by cuBLASLt with the scales as outer vectors
(``CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F``: ``D[t, n] = sx[t] sw[n] sum_k x8[t, k]
w8[n, k]``, applied in its epilogue), float32 out, or bf16 where the consumer reads it (gate |
up, read by ``silu_mul_e4m3``: half the bytes).

- The weight: ``dequant_mma_e4m3`` of linear.cu writes each row over its scale (the row's
  largest |value| / 448, ``row_scales``, computed once a weight) into a scratch a pass: half
  the bytes of the fp16 copy.
- The activations: ``quant_rows_e4m3`` of elementwise.cu from the fp16 operand the prologue
  kernels already write, a scale a token row: a row's codes depend on that row alone (the
  product's summation order may still change with the call's width, as cuBLAS's fp16 one's).

e4m3 keeps 3 mantissa bits: a product is within ~2^-4 of the fp16 path's per term (bench/README
says what the model's outputs move by). cuBLASLt is called through ctypes on a handle and
workspace of our own (``cublasLtMatmul`` takes the stream as an argument: capturable).
"""
from __future__ import annotations

import ctypes
import functools
from collections import OrderedDict

import cupy as cp
import numpy as np

from ninfer.kernels.gpu import elementwise as gew
from ninfer.kernels.gpu.gemm import check, library, walk_tiles
from ninfer.kernels.gpu.linear import GpuWeight

E4M3_MAX = 448.0
# cudaDataType_t, cublasComputeType_t, cublasLtMatmulDescAttributes_t, cublasLtMatmulMatrixScale_t,
# cublasLtMatmulPreferenceAttributes_t
_R_32F, _R_16BF, _R_8F_E4M3, _COMPUTE_32F = 0, 14, 28, 68
_TRANSA, _TRANSB, _A_SCALE_PTR, _B_SCALE_PTR, _A_SCALE_MODE, _B_SCALE_MODE = 3, 4, 17, 18, 31, 32
_OUTER_VEC, _PREF_MAX_WORKSPACE = 3, 1
_P = ctypes.c_void_p
_ONE, _ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)


class _Heuristic(ctypes.Structure):   # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t),
                ("state", ctypes.c_int), ("waves", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


@functools.lru_cache(maxsize=None)
def supported(device: int) -> bool:
    """Whether ``device`` runs the product: fp8 tensor cores and a cuBLASLt with outer-vector
    scales for them (12.9 and newer, Hopper; elsewhere the prefill GEMMs stay on fp16)."""
    with cp.cuda.Device(device):
        if int(cp.cuda.Device().compute_capability) < 89:
            return False
        try:
            _lt(device).plan(64, 64, 64)
        except (RuntimeError, OSError, AttributeError):
            return False
    return True


def fits(x: cp.ndarray, out: cp.ndarray) -> bool:
    """Whether cuBLASLt's fp8 product takes these operands (16-byte rows and pointers)."""
    return (x.shape[1] % 16 == 0 and out.shape[1] * out.itemsize % 16 == 0
            and out.flags.c_contiguous and out.data.ptr % 16 == 0 and x.flags.c_contiguous
            and x.data.ptr % 16 == 0)


class _Lt:
    """A cuBLASLt handle of the current device, its workspace and a plan (descriptor, layouts,
    algorithm) for each of the last ``PLANS`` (T, N, K, out type) (a prompt's last chunk may have
    any T)."""

    WORKSPACE_BYTES = 32 << 20
    PLANS = 64

    def __init__(self) -> None:
        self.lib = lib = library("cublasLt", (
            "cublasLtCreate", "cublasLtMatmulDescCreate", "cublasLtMatmulDescSetAttribute",
            "cublasLtMatrixLayoutCreate", "cublasLtMatmulPreferenceCreate",
            "cublasLtMatmulPreferenceSetAttribute", "cublasLtMatmulAlgoGetHeuristic",
            "cublasLtMatmul", "cublasLtMatmulDescDestroy", "cublasLtMatrixLayoutDestroy",
            "cublasLtMatmulPreferenceDestroy"))
        lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(_P), ctypes.c_int,
                                                   ctypes.c_uint64, ctypes.c_uint64,
                                                   ctypes.c_int64]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [_P, ctypes.c_int, _P, ctypes.c_size_t]
        self.handle = _P()
        check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):
            self.workspace = cp.empty(self.WORKSPACE_BYTES, dtype=cp.uint8)
        self.plans: OrderedDict[tuple[int, int, int, int], tuple] = OrderedDict()

    def set(self, desc, attr: int, value) -> None:
        check(self.lib.cublasLtMatmulDescSetAttribute(
            desc, attr, ctypes.cast(ctypes.byref(value), _P), ctypes.sizeof(value)),
            f"cublasLtMatmulDescSetAttribute {attr}")

    def plan(self, t: int, n: int, k: int, out_type: int = _R_32F) -> tuple:
        """(descriptor, A / B / D layouts, algorithm) of the (T, K) x (N, K)^T product, D
        float32 or (``_R_16BF``) bf16."""
        key = (t, n, k, out_type)
        got = self.plans.get(key)
        if got is not None:
            self.plans.move_to_end(key)
            return got
        if len(self.plans) >= self.PLANS:
            desc, lay, _ = self.plans.popitem(last=False)[1]
            self.lib.cublasLtMatmulDescDestroy(desc)
            for x in lay:
                self.lib.cublasLtMatrixLayoutDestroy(x)
        lib = self.lib
        desc, pref = _P(), _P()
        check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F),
              "cublasLtMatmulDescCreate")
        for attr, v in ((_TRANSA, 1), (_TRANSB, 0), (_A_SCALE_MODE, _OUTER_VEC),
                        (_B_SCALE_MODE, _OUTER_VEC)):
            self.set(desc, attr, ctypes.c_int32(v))
        for attr in (_A_SCALE_PTR, _B_SCALE_PTR):   # (each call sets its own)
            self.set(desc, attr, _P(self.workspace.data.ptr))
        # column-major: A = W^T read transposed (K x N), B = x^T (K x T), D = out^T (N x T)
        lay = [_P(), _P(), _P()]
        for i, (dt, r, c) in enumerate(((_R_8F_E4M3, k, n), (_R_8F_E4M3, k, t),
                                        (out_type, n, t))):
            check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay[i]), dt, r, c, r),
                  "cublasLtMatrixLayoutCreate")
        check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)),
              "cublasLtMatmulPreferenceCreate")
        wsz = ctypes.c_uint64(self.WORKSPACE_BYTES)
        check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE,
                                                       ctypes.byref(wsz), ctypes.c_size_t(8)),
              "cublasLtMatmulPreferenceSetAttribute")
        found, count = _Heuristic(), ctypes.c_int(0)
        st = lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, lay[0], lay[1], lay[2],
                                                lay[2], pref, 1, ctypes.byref(found),
                                                ctypes.byref(count))
        lib.cublasLtMatmulPreferenceDestroy(pref)
        if st or not count.value:
            lib.cublasLtMatmulDescDestroy(desc)
            for x in lay:
                lib.cublasLtMatrixLayoutDestroy(x)
            raise RuntimeError(f"cuBLASLt has no e4m3 outer-vector product of {key} "
                               f"(status {st})")
        got = self.plans[key] = (desc, lay, found)
        return got


@functools.lru_cache(maxsize=None)
def _lt(device: int) -> _Lt:
    return _Lt()


def row_scales(w: GpuWeight) -> cp.ndarray:
    """(N,) float32: each row's largest |value| of ``w`` / 448, 1 for an all-zero row (the
    row's e4m3 codes then span the format's range)."""
    amax = cp.zeros((w.shape[0],), dtype=cp.uint32)
    walk_tiles("row_absmax", w, amax)
    m = amax.view(cp.float32)
    return cp.where(m > 0, m / np.float32(E4M3_MAX), np.float32(1.0)).astype(cp.float32)


def dequantize_e4m3(w: GpuWeight, scale: cp.ndarray, out: cp.ndarray) -> None:
    """Write ``dequant(w) / scale[:, None]`` as e4m3 codes into ``out`` (uint8, at least N*K,
    C order)."""
    walk_tiles("dequant_mma_e4m3", w, scale, out)


def gemm(x16: cp.ndarray, w: GpuWeight, scratch: cp.ndarray, out: cp.ndarray,
         accumulate: bool = False) -> None:
    """``out (+)= x16 @ dequant(w).T`` on the fp8 tensor cores: ``x16`` (T, K) fp16 C order,
    quantized a row (``quant_rows_e4m3``), then ``gemm_codes``."""
    x8, sx = gew.quant_rows_e4m3(x16)
    gemm_codes(x8, sx, w, scratch, out, accumulate)


def gemm_codes(x8: cp.ndarray, sx: cp.ndarray, w: GpuWeight, scratch: cp.ndarray,
               out: cp.ndarray, accumulate: bool = False) -> None:
    """``out (+)= (sx[:, None] * e4m3(x8)) @ dequant(w).T``: ``x8`` (T, K) e4m3 codes and
    ``sx`` (T,) their row scales; ``scratch`` uint8 of at least N*K bytes (the weight's codes);
    ``out`` (T, N) C order, float32 or uint16 (bf16 bits, rounded to nearest even; no
    ``accumulate``); ``accumulate``: beta = 1, the residual add in the epilogue. Capturable
    once the weight's scales exist (``w.f8_scale``, made on the first call).

    Raises:
        ValueError: ``accumulate`` into bf16, or an output type other than the two.
    """
    t, k = x8.shape
    n = w.shape[0]
    out_type = {cp.dtype(cp.float32): _R_32F, cp.dtype(cp.uint16): _R_16BF}.get(out.dtype)
    if out_type is None or (accumulate and out_type != _R_32F):
        raise ValueError(f"gemm_codes: out {out.dtype} (accumulate={accumulate}); float32, "
                         f"or uint16 bf16 bits without accumulate")
    if w.f8_scale is None:
        with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):
            w.f8_scale = row_scales(w)
    dequantize_e4m3(w, w.f8_scale, scratch)
    lt = _lt(cp.cuda.Device().id)
    desc, lay, found = lt.plan(t, n, k, out_type)
    lt.set(desc, _A_SCALE_PTR, _P(w.f8_scale.data.ptr))
    lt.set(desc, _B_SCALE_PTR, _P(sx.data.ptr))
    check(lt.lib.cublasLtMatmul(
        lt.handle, desc, ctypes.byref(_ONE), _P(scratch.data.ptr), lay[0], _P(x8.data.ptr),
        lay[1], ctypes.byref(_ONE if accumulate else _ZERO), _P(out.data.ptr), lay[2],
        _P(out.data.ptr), lay[2], ctypes.byref(found.algo), _P(lt.workspace.data.ptr),
        ctypes.c_size_t(lt.WORKSPACE_BYTES), _P(cp.cuda.get_current_stream().ptr)),
        "cublasLtMatmul")

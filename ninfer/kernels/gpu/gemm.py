"""Prefill GEMMs of packed weights (T above the GEMV kernels' rows): the weight dequantized
into an fp16 scratch matrix (``dequant_mma_f16`` of linear.cu), then cuBLAS ``gemmEx`` on the
tensor cores (fp16 operands, float32 accumulation and result)."""
from __future__ import annotations

import cupy as cp
import numpy as np

from ninfer.kernels import mma_layout
from ninfer.kernels.gpu.linear import GpuWeight, _fn

_CUDA_R_16F, _CUDA_R_32F, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT = 2, 0, 68, -1
_ONE = np.array(1.0, dtype=np.float32)
_ZERO = np.array(0.0, dtype=np.float32)
_DQ_WARPS = 8   # (DQ_WARPS of linear.cu)


def dequantize_f16(w: GpuWeight, out: cp.ndarray) -> None:
    """Write ``dequant(w)`` as float16 into ``out`` (at least N*K elements, C order)."""
    n, k = w.shape
    n16, kc = mma_layout.padded(n, k)
    blocks = min(-(-(n16 * kc) // _DQ_WARPS), 65535)   # a warp a 16 x 64 tile
    _fn(f"dequant_mma_f16<{w.sch}>")((blocks,), (32 * _DQ_WARPS,),
                                     (w.codes, w.scales, out, np.int32(n), np.int32(k)))


def gemm_f16(x16: cp.ndarray, w16: cp.ndarray, n: int, out: cp.ndarray,
             accumulate: bool = False) -> None:
    """``out = x16 @ w16[:n*K].reshape(n, K).T`` through cuBLAS gemmEx: fp16 operands on the
    tensor cores, float32 accumulation and float32 ``out`` ((T, n), C order); ``accumulate``:
    ``out +=`` instead (beta = 1: the residual add in the GEMM's epilogue)."""
    try:
        from cupy_backends.cuda.libs import cublas
    except ImportError:  # older CuPy layout
        from cupy.cuda import cublas
    t, k = x16.shape
    handle = cp.cuda.device.get_cublas_handle()
    # row-major out (T, n) is column-major out^T (n, T) = W (n x K, from row-major (n, K) read
    # transposed) times x^T (K x T)
    beta = _ONE if accumulate else _ZERO
    cublas.gemmEx(handle, 1, 0, n, t, k, _ONE.ctypes.data, w16.data.ptr, _CUDA_R_16F, k,
                  x16.data.ptr, _CUDA_R_16F, k, beta.ctypes.data, out.data.ptr, _CUDA_R_32F,
                  n, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)

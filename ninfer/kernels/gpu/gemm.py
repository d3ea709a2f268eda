"""Prefill GEMMs of packed weights (T above the GEMV kernels' rows): the weight dequantized
into an fp16 scratch matrix (``dequant_mma_f16`` of linear.cu), then cuBLAS ``cublasGemmEx`` on
the tensor cores (fp16 operands, float32 accumulation and result).

cuBLAS is called through ctypes on a handle of our own, with a workspace of our own: CuPy's
``cublas.gemmEx`` sets the handle's stream on every call and refuses to while a stream is
capturing, so a prefill pass could not be replayed from a CUDA graph. The stream is set only
when it changes (``cublasSetStream`` drops the workspace, so it is set again after).
"""
from __future__ import annotations

import ctypes
import functools

import cupy as cp
import numpy as np

from ninfer.kernels import mma_layout
from ninfer.kernels.gpu.linear import GpuWeight, _fn

_CUDA_R_16F, _CUDA_R_32F, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT = 2, 0, 68, -1
_ONE = np.array(1.0, dtype=np.float32)
_ZERO = np.array(0.0, dtype=np.float32)
_DQ_WARPS = 8   # (DQ_WARPS of linear.cu)


def walk_tiles(kernel: str, w: GpuWeight, *args) -> None:
    """Launch ``kernel<scheme>`` of linear.cu, whose warps walk ``w``'s 16 x 64 tiles (a warp a
    tile: ``for_each_tile``), with arguments (codes, scales, *args, N, K)."""
    n, k = w.shape
    n16, kc = mma_layout.padded(n, k)
    blocks = min(-(-(n16 * kc) // _DQ_WARPS), 65535)
    _fn(f"{kernel}<{w.sch}>")((blocks,), (32 * _DQ_WARPS,),
                              (w.codes, w.scales, *args, np.int32(n), np.int32(k)))


def dequantize_f16(w: GpuWeight, out: cp.ndarray) -> None:
    """Write ``dequant(w)`` as float16 into ``out`` (at least N*K elements, C order)."""
    walk_tiles("dequant_mma_f16", w, out)


class _Cublas:
    """A cuBLAS handle of the current device, its workspace and the stream last set on it."""

    WORKSPACE_BYTES = 32 << 20

    def __init__(self) -> None:
        self.lib = lib = library("cublas", ("cublasCreate_v2", "cublasSetStream_v2",
                                             "cublasSetWorkspace_v2", "cublasGemmEx"))
        self.handle = ctypes.c_void_p()
        check(lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        # (from CuPy's default pool even where the first GEMM runs in a graph's warm-up, under
        # that graph's private pool)
        with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):
            self.workspace = cp.empty(self.WORKSPACE_BYTES, dtype=cp.uint8)
        self.stream: int | None = None

    def bind(self) -> None:
        """Set the current stream (and the workspace, which setting a stream drops) where it
        changed since the last call."""
        s = cp.cuda.get_current_stream().ptr
        if s != self.stream:
            check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(s)),
                   "cublasSetStream")
            check(self.lib.cublasSetWorkspace_v2(
                self.handle, ctypes.c_void_p(self.workspace.data.ptr),
                ctypes.c_size_t(self.WORKSPACE_BYTES)), "cublasSetWorkspace")
            self.stream = s


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed: cublasStatus_t {status}")


def library(stem: str, functions: tuple[str, ...]) -> ctypes.CDLL:
    """``lib{stem}`` as CuPy loaded it (its cublas module links libcublas, which links
    libcublasLt), else the system's; ``functions`` return C ints (status codes)."""
    try:
        from cupy_backends.cuda.libs import cublas  # noqa: F401  (loads libcublas)
    except ImportError:
        pass
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if f"/lib{stem}.so" in line}
    names = sorted(paths) + [f"lib{stem}.so.{cp.cuda.runtime.runtimeGetVersion() // 1000}",
                             f"lib{stem}.so"]
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        for fn in functions:
            getattr(lib, fn).restype = ctypes.c_int
        return lib
    raise RuntimeError(f"lib{stem} not found (the prefill GEMMs need it)")


@functools.lru_cache(maxsize=None)
def _cublas(device: int) -> _Cublas:
    return _Cublas()


def gemm_f16(x16: cp.ndarray, w16: cp.ndarray, n: int, out: cp.ndarray,
             accumulate: bool = False) -> None:
    """``out = x16 @ w16[:n*K].reshape(n, K).T`` through cuBLAS gemmEx: fp16 operands on the
    tensor cores, float32 accumulation and float32 ``out`` ((T, n), C order); ``accumulate``:
    ``out +=`` instead (beta = 1: the residual add in the GEMM's epilogue). Capturable."""
    t, k = x16.shape
    cb = _cublas(cp.cuda.Device().id)
    cb.bind()
    # row-major out (T, n) is column-major out^T (n, T) = W (n x K, from row-major (n, K) read
    # transposed) times x^T (K x T); alpha / beta are host scalars, read at the call (or at
    # capture: both are constants)
    beta = _ONE if accumulate else _ZERO
    i32, vp = ctypes.c_int, ctypes.c_void_p
    check(cb.lib.cublasGemmEx(
        cb.handle, i32(1), i32(0), i32(n), i32(t), i32(k), vp(_ONE.ctypes.data),
        vp(w16.data.ptr), i32(_CUDA_R_16F), i32(k), vp(x16.data.ptr), i32(_CUDA_R_16F), i32(k),
        vp(beta.ctypes.data), vp(out.data.ptr), i32(_CUDA_R_32F), i32(n),
        i32(_CUBLAS_COMPUTE_32F), i32(_CUBLAS_GEMM_DEFAULT)), "cublasGemmEx")

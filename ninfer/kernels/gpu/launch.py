"""Kernel launches with Programmatic Dependent Launch (PDL).

On Hopper (sm_90) and newer a kernel launched with the
``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` attribute may start while the previous
kernel in its stream is still running, as soon as every block of that kernel has executed
``griddepcontrol.launch_dependents`` (``pdl_trigger()`` in ``common.cuh``) or exited. The new
kernel must execute ``griddepcontrol.wait`` (``pdl_wait()``) before it touches memory the
previous kernels write or read; whatever it does before that (the decode GEMVs issue their first
weight loads) overlaps the previous kernel's tail and the launch latency. CUDA graph capture
keeps these edges (programmatic dependencies). Source: CUDA C++ Programming Guide,
"Programmatic Dependent Launch and Synchronization"; PTX ISA, ``griddepcontrol``.

CuPy's ``RawKernel.__call__`` cannot set launch attributes, so ``launch`` calls the driver's
``cuLaunchKernelEx`` through ctypes. Without a driver that has it, on a GPU older than sm_90, or
with ``pdl=False`` (the backend's ``KernelConfig.pdl``), kernels are launched the ordinary way;
the ``griddepcontrol`` instructions are then no-ops.
"""
from __future__ import annotations

import ctypes
import functools

import cupy as cp
import numpy as np

_ATTR_CLUSTER_DIMENSION = 4                   # CUlaunchAttributeID
_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_FUNC_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14  # CUfunction_attribute


class _Attr(ctypes.Structure):
    # CUlaunchAttribute: the id, padding, a 64-byte CUlaunchAttributeValue union (an int, or
    # clusterDim's three unsigned ints)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_uint * 16)]


def _attr(ident: int, *values: int) -> _Attr:
    a = _Attr(id=ident)
    for i, v in enumerate(values):
        a.value[i] = v
    return a
NULL = np.uint64(0)  # a null pointer argument
_NON_PORTABLE: set[int] = set()   # kernels allowed clusters above 8 blocks


class _Config(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=None)
def _driver():
    """``cuLaunchKernelEx`` of libcuda, or None (no such symbol, or a GPU below sm_90)."""
    try:
        if int(cp.cuda.Device().compute_capability) >= 90:   # "90", "100", "120": ints
            f = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
            f.restype = ctypes.c_int
            f.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p,
                          ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
            return f
    except (OSError, AttributeError):
        pass
    return None


def _arg(v):
    if isinstance(v, cp.ndarray):
        return ctypes.c_void_p(v.data.ptr)
    if isinstance(v, np.int32):
        return ctypes.c_int32(int(v))
    if isinstance(v, np.float32):
        return ctypes.c_float(float(v))
    if isinstance(v, np.int64):
        return ctypes.c_int64(int(v))
    if isinstance(v, np.uint64):
        return ctypes.c_uint64(int(v))
    raise TypeError(f"launch: unsupported kernel argument {type(v).__name__}")


@functools.lru_cache(maxsize=None)
def _set_attribute():
    try:
        f = ctypes.CDLL("libcuda.so.1").cuFuncSetAttribute
    except (OSError, AttributeError):
        return None
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return f


def clusters_available() -> bool:
    """Whether ``launch(..., cluster=n)`` can launch thread block clusters (sm_90+, a driver
    with ``cuLaunchKernelEx``)."""
    return _driver() is not None


def available() -> bool:
    """Whether kernels launched with ``pdl=True`` get PDL here (sm_90+, a driver with
    cuLaunchKernelEx)."""
    return _driver() is not None


def launch(fn, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0,
           pdl: bool = True, cluster: int = 0) -> None:
    """Launch ``fn`` (a ``RawKernel`` of ``gpu.function``) on the current stream, with PDL when
    ``pdl`` and ``available()``; the kernel must then call ``pdl_wait()`` before it reads or
    writes memory that earlier kernels use.

    Args:
        grid, block: up to three dimensions each.
        args: ``cp.ndarray`` (passed as device pointers), ``np.int32``, ``np.int64``,
            ``np.float32`` or ``np.uint64`` values (``NULL``: a null pointer).
        cluster: > 0: thread block clusters of ``cluster`` blocks along the grid's z (which it
            must divide; above 8, the non-portable sizes Hopper allows up to 16); needs
            ``clusters_available()``.

    Raises:
        TypeError: an argument of another type.
        RuntimeError: the driver refused the launch (its CUresult is in the message), or
            ``cluster`` without ``clusters_available()``.
    """
    drv = _driver() if (pdl or cluster) else None
    if drv is None:
        if cluster:
            raise RuntimeError("thread block clusters need sm_90+ and cuLaunchKernelEx")
        fn(grid, block, args, shared_mem=shared_mem)
        return
    vals = [_arg(v) for v in args]
    ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
    g = tuple(grid) + (1,) * (3 - len(grid))
    b = tuple(block) + (1,) * (3 - len(block))
    attrs = ([_attr(_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION, 1)] if pdl else []) + (
        [_attr(_ATTR_CLUSTER_DIMENSION, 1, 1, cluster)] if cluster else [])
    arr = (_Attr * len(attrs))(*attrs)
    cfg = _Config((ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b), shared_mem,
                  cp.cuda.get_current_stream().ptr, arr, len(attrs))
    kern = getattr(fn, "kernel", fn)
    if cluster > 8 and kern.ptr not in _NON_PORTABLE:
        rc = _set_attribute()(ctypes.c_void_p(kern.ptr), _FUNC_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                              1)
        if rc != 0:
            raise RuntimeError(f"cuFuncSetAttribute (non-portable cluster size): CUresult {rc}")
        _NON_PORTABLE.add(kern.ptr)
    rc = drv(ctypes.byref(cfg), ctypes.c_void_p(kern.ptr), ptrs, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed: CUresult {rc}")

"""Host time of the CuPy backend's forward passes, measured on a machine without a GPU.

A stand-in for CuPy (numpy arrays with a ``.data.ptr``; compiled kernels, cuBLAS and the
driver's ``cuLaunchKernelEx`` that do nothing; ``astype`` that allocates without converting)
is installed in ``sys.modules`` before ninfer imports CuPy, so a forward pass runs every line of
Python the GPU path runs (configs, argument marshalling, allocations, launches) and none of the
device work. Where the device finishes a pass sooner than the host issues it (a small model, a
short prompt), this is the pass's time; numpy's own elementwise ops (residual adds and the like,
kernels on the GPU) count here too, so it is an upper bound of the Python share.

    PYTHONPATH=$PWD python bench/experiments/host_overhead.py --prefill 512 [--model F.gguf]

Prints ms a pass (median of ``--reps``), launches a pass (kernels, cuBLAS calls) and, with
``--profile N``, the N functions with the most time of their own.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import sys
import types

import numpy as np

LAUNCHES = {"kernels": 0, "cublas": 0}


class _Mem:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


class _Array(np.ndarray):
    @property
    def data(self):   # (numpy's own .data is a memoryview)
        return _Mem(self.__array_interface__["data"][0])

    def astype(self, dtype, copy=True, **kw):   # a device kernel: allocate, do not convert
        return np.empty(self.shape, dtype=dtype).view(_Array)


def _wrap(f):
    return lambda *a, **kw: np.asarray(f(*a, **kw)).view(_Array)


class _Kernel:
    def __init__(self):
        self.ptr = id(self)
        self.kernel = self
        self.max_dynamic_shared_size_bytes = 0

    def __call__(self, grid, block, args, shared_mem=0):
        LAUNCHES["kernels"] += 1


class _Module:
    def __init__(self, *a, **kw):
        pass

    def get_function(self, name):
        return _Kernel()


class _Stream:
    ptr = 0

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        pass


class _Device:
    attributes = {"MultiProcessorCount": 132, "MaxSharedMemoryPerBlockOptin": 232448,
                  "MaxSharedMemoryPerMultiprocessor": 233472}
    compute_capability = "90"

    def __init__(self, i: int = 0):
        self.id = i

    def synchronize(self):
        pass


class _Pool:
    def malloc(self, n):
        return None

    def used_bytes(self):
        return 0

    def total_bytes(self):
        return 0

    def free_all_blocks(self):
        pass


def install() -> None:
    """Put the stand-in CuPy (and cupyx) in ``sys.modules``."""
    cp = types.ModuleType("cupy")
    for name in ("asarray", "array", "empty", "zeros", "ones", "full", "empty_like",
                 "zeros_like", "ascontiguousarray", "concatenate", "stack", "arange", "argmax",
                 "copy"):
        setattr(cp, name, _wrap(getattr(np, name)))
    cp.asnumpy = lambda a, **kw: np.array(a).view(np.ndarray)
    cp.ndarray, cp.RawModule, cp.array_equal, cp.nan = _Array, _Module, np.array_equal, np.nan
    for t in ("float32", "float16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
              "int8", "bool_"):
        setattr(cp, t, getattr(np, t))
    cp.get_default_memory_pool = cp.get_default_pinned_memory_pool = _Pool
    cuda = types.ModuleType("cupy.cuda")
    cuda.Device, cuda.Stream, cuda.get_current_stream = _Device, _Stream, _Stream
    cuda.Event = lambda *a, **kw: types.SimpleNamespace(record=lambda *a: None,
                                                        synchronize=lambda: None)
    cuda.get_elapsed_time = lambda a, b: 0.0
    cuda.using_allocator = lambda *a: contextlib.nullcontext()
    cuda.runtime = types.SimpleNamespace(getDeviceCount=lambda: 1,
                                         memGetInfo=lambda: (130 << 30, 140 << 30),
                                         deviceSynchronize=lambda: None)
    cp.cuda = cuda
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = lambda shape, dtype=np.float32: np.empty(shape, dtype=dtype)
    cupyx.zeros_pinned = lambda shape, dtype=np.float32: np.zeros(shape, dtype=dtype)
    sys.modules.update({"cupy": cp, "cupy.cuda": cuda, "cupyx": cupyx})


class _Cublas:
    """``gpu.gemm._Cublas`` whose library calls are counted (their ctypes arguments built by
    ``gemm_f16`` as on the GPU), nothing run."""

    handle = None

    def __init__(self) -> None:
        self.lib = types.SimpleNamespace(cublasGemmEx=self._gemm)

    def bind(self) -> None:
        pass

    @staticmethod
    def _gemm(*a) -> int:
        LAUNCHES["cublas"] += 1
        return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a Llama / Qwen3.5 file (default: SmolLM2)")
    ap.add_argument("--prefill", type=int, default=512, help="tokens in one pass")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    a = ap.parse_args()
    install()
    from ninfer.kernels.gpu import launch

    def count_pdl(*a, **kw):   # cuLaunchKernelEx: the arguments marshalled, nothing launched
        LAUNCHES["kernels"] += 1
        return 0
    launch._driver = lambda: count_pdl
    from ninfer.kernels.gpu import gemm
    stub = _Cublas()
    gemm._cublas = lambda device: stub
    from ninfer.bench.model import load
    from ninfer.bench.prefill import prefill_s
    bm = load(a.model, "cupy", max_positions=a.prefill + 64, max_batch=1, cuda_graph=False)
    with np.errstate(all="ignore"):   # (the stand-in's arrays hold whatever memory held)
        times = prefill_s(bm, a.prefill, reps=a.reps)
        LAUNCHES.update(kernels=0, cublas=0)
        prefill_s(bm, a.prefill, reps=1)   # a warm-up and one timed pass: two
        per = {k: v // 2 for k, v in LAUNCHES.items()}
        print(f"prefill {a.prefill}: host {statistics.median(times) * 1e3:.2f} ms a pass "
              f"({bm.config.num_hidden_layers} layers), {per['kernels']} kernels and "
              f"{per['cublas']} cuBLAS calls a pass")
        if a.profile:
            prof = cProfile.Profile()
            prof.enable()
            prefill_s(bm, a.prefill, reps=1)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(a.profile)


if __name__ == "__main__":
    main()

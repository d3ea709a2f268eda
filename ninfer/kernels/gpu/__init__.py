"""CUDA kernels of the CuPy backend, one module per op family, each with its ``.cu`` source
beside it (``linear``, ``attention``, ``elementwise``, ``gdn``; ``common.cuh`` holds shared device
helpers and is prepended to every source). Sources are compiled with NVRTC through
``cupy.RawModule`` at first use, once per process (CuPy also caches the compiled binaries on
disk). Importing this package imports CuPy; only ``ninfer.kernels.cupy_ops`` does so.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import cupy as cp

_DIR = Path(__file__).parent
_MODULES: dict[tuple, cp.RawModule] = {}
# extra NVRTC options (``-DNAME``) for experiments (bench/gpu_megakernel_trace.py --variants, or
# ``NINFER_GPU_DEFINES=NAME,NAME=VALUE`` to run the GPU tests with an experiment switch); empty in
# normal use
DEFINES: tuple[str, ...] = tuple(
    f"-D{d.strip()}" for d in os.environ.get("NINFER_GPU_DEFINES", "").split(",") if d.strip())


def source(name: str) -> str:
    """The CUDA C++ source of op family ``name`` with ``common.cuh`` prepended, and before it the
    sources that its first line names as ``// requires: a b`` (megakernel.cu: linear,
    attention)."""
    common = (_DIR / "common.cuh").read_text().replace("#pragma once", "")
    text = (_DIR / f"{name}.cu").read_text()
    first = text.split("\n", 1)[0]
    deps = first.split(":", 1)[1].split() if first.startswith("// requires:") else []
    return "\n".join([common] + [(_DIR / f"{d}.cu").read_text() for d in deps] + [text])


def module(name: str, name_expressions: tuple[str, ...] = ()) -> cp.RawModule:
    """The compiled module of ``name.cu`` (with template instantiations ``name_expressions``),
    compiled on the first call and cached for the process."""
    key = (name, name_expressions, DEFINES)
    mod = _MODULES.get(key)
    if mod is None:
        mod = cp.RawModule(code=source(name), options=("--std=c++17",) + DEFINES,
                           name_expressions=list(name_expressions) or None)
        _MODULES[key] = mod
    return mod


_FUNCTIONS: dict[tuple, object] = {}
# experiment (gpu_decode.py's carveout= knob): every kernel's preferred shared-memory carveout
# (cudaFuncAttributePreferredSharedMemoryCarveout: percent of the unified L1 / shared memory to
# be shared memory), or None for the driver's choice (bench/gpu_notes.md, session 19: why a
# smaller o GEMV block decoded faster is open; one carveout for every kernel of a decode step is
# the first guess to test)
CARVEOUT: int | None = None


def set_carveout(pct: int | None) -> None:
    """``CARVEOUT`` for the kernels looked up so far and those looked up from now on (-1 on
    each where None: no preference)."""
    global CARVEOUT
    CARVEOUT = pct
    for fn in _FUNCTIONS.values():
        fn.preferred_shared_memory_carveout = -1 if pct is None else pct


def function(name: str, fname: str, name_expressions: tuple[str, ...] = ()):
    """Kernel ``fname`` (a plain name or one of ``name_expressions``) of ``name.cu``, looked up
    once per process (``RawModule.get_function`` builds a new wrapper on every call)."""
    key = (name, name_expressions, fname, DEFINES)
    fn = _FUNCTIONS.get(key)
    if fn is None:
        fn = module(name, name_expressions).get_function(fname)
        if CARVEOUT is not None:
            fn.preferred_shared_memory_carveout = CARVEOUT
        _FUNCTIONS[key] = fn
    return fn


@functools.lru_cache(maxsize=None)
def sm_count() -> int:
    """Multiprocessors of the current device."""
    return cp.cuda.Device().attributes["MultiProcessorCount"]

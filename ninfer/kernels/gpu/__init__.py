"""CUDA kernels of the CuPy backend, one module per op family, each with its ``.cu`` source
beside it (``linear``, ``attention``, ``elementwise``, ``gdn``; ``common.cuh`` holds shared device
helpers and is prepended to every source). Sources are compiled with NVRTC through
``cupy.RawModule`` at first use, once per process (CuPy also caches the compiled binaries on
disk). Importing this package imports CuPy; only ``ninfer.kernels.cupy_ops`` does so.

Which kernel takes which case, and the knobs, are in ``README.md`` beside this file.
"""
from __future__ import annotations

import functools
from pathlib import Path

import cupy as cp

_DIR = Path(__file__).parent
_MODULES: dict[tuple, cp.RawModule] = {}
_FUNCTIONS: dict[tuple, object] = {}


def source(name: str) -> str:
    """The CUDA C++ source of op family ``name`` with ``common.cuh`` prepended."""
    common = (_DIR / "common.cuh").read_text().replace("#pragma once", "")
    return "\n".join([common, (_DIR / f"{name}.cu").read_text()])


def module(name: str, name_expressions: tuple[str, ...] = ()) -> cp.RawModule:
    """The compiled module of ``name.cu`` (with template instantiations ``name_expressions``),
    compiled on the first call and cached for the process."""
    key = (name, name_expressions)
    mod = _MODULES.get(key)
    if mod is None:
        mod = cp.RawModule(code=source(name), options=("--std=c++17",),
                           name_expressions=list(name_expressions) or None)
        _MODULES[key] = mod
    return mod


def function(name: str, fname: str, name_expressions: tuple[str, ...] = ()):
    """Kernel ``fname`` (a plain name or one of ``name_expressions``) of ``name.cu``, looked up
    once per process (``RawModule.get_function`` builds a new wrapper on every call)."""
    key = (name, name_expressions, fname)
    fn = _FUNCTIONS.get(key)
    if fn is None:
        fn = module(name, name_expressions).get_function(fname)
        _FUNCTIONS[key] = fn
    return fn


def function_sm90a(name: str, fname: str, name_expressions: tuple[str, ...]):
    """Kernel ``fname`` (one of ``name_expressions``) of ``name.cu`` compiled for sm_90a, the
    target of Hopper's architecture-specific instructions (wgmma), which ``cupy.RawModule``
    does not offer: NVRTC straight, the cubin loaded as a module (compiled once per process).

    Raises:
        RuntimeError: the compile failed (NVRTC's log).
    """
    from cupy_backends.cuda.libs import nvrtc

    key = (name, name_expressions, fname, "sm_90a")
    fn = _FUNCTIONS.get(key)
    if fn is not None:
        return fn
    prog = nvrtc.createProgram(source(name), f"{name}.cu", (), ())
    try:
        for expr in name_expressions:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, ("--std=c++17", "-arch=sm_90a", "-ftz=true"))
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"{name}.cu for sm_90a: {nvrtc.getProgramLog(prog)}") from e
        cubin = nvrtc.getCUBIN(prog)
        lowered = {expr: nvrtc.getLoweredName(prog, expr) for expr in name_expressions}
    finally:
        nvrtc.destroyProgram(prog)
    mod = cp.cuda.function.Module()
    mod.load(cubin)
    for expr in name_expressions:
        _FUNCTIONS[(name, name_expressions, expr, "sm_90a")] = mod.get_function(lowered[expr])
    return _FUNCTIONS[key]


def set_max_dynamic_smem(fn, nbytes: int) -> None:
    """Let a ``cupy.cuda.function.Function`` (a RawKernel's ``kernel``, or ``function_sm90a``'s)
    launch with ``nbytes`` of dynamic shared memory (over the 48 KB default)."""
    cp.cuda.driver.funcSetAttribute(fn.ptr, 8, nbytes)   # (8: ..._MAX_DYNAMIC_SHARED_SIZE_BYTES)


@functools.lru_cache(maxsize=None)
def sm90a() -> bool:
    """Whether the current device runs sm_90a code (``function_sm90a``'s): Hopper itself, not
    the later architectures that run sm_90 code."""
    return cp.cuda.Device().compute_capability == "90"


@functools.lru_cache(maxsize=None)
def sm90() -> bool:
    """Whether the current device is sm_90 or newer (bulk copies, mbarrier transactions)."""
    return int(cp.cuda.Device().compute_capability) >= 90


@functools.lru_cache(maxsize=None)
def sm_count() -> int:
    """Multiprocessors of the current device."""
    return cp.cuda.Device().attributes["MultiProcessorCount"]

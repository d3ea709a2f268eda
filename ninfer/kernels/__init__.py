"""Kernels: the op interface (``ops.Ops``) and its backends, ``numpy_ops.NumpyOps`` (CPU
reference) and ``cupy_ops.CupyOps`` (NVIDIA GPU; kernel choices in ``config.KernelConfig``).
``get_ops`` picks one.
"""
from __future__ import annotations

BACKENDS = ("numpy", "cupy")


def cupy_usable() -> bool:
    """Whether CuPy is installed and sees a CUDA device (never raises)."""
    try:
        from ninfer.kernels.cupy_ops import cuda_available
    except Exception:  # CuPy missing or broken: no GPU backend here
        return False
    return cuda_available()


def resolve_backend(backend: str) -> str:
    """``"auto"`` -> ``"cupy"`` when a CUDA device is usable through CuPy, else ``"numpy"``;
    other names are returned unchanged."""
    if backend == "auto":
        return "cupy" if cupy_usable() else "numpy"
    return backend


def get_ops(backend: str = "numpy", config=None):
    """The ops object of a backend (an ``ninfer.kernels.ops.Ops``).

    Args:
        backend: ``"numpy"`` (CPU reference), ``"cupy"`` (NVIDIA GPU) or ``"auto"`` (cupy when
            a GPU is usable, else numpy).
        config: the cupy backend's ``KernelConfig`` (None: the defaults); the numpy backend has
            no choices and ignores it.

    Raises:
        ValueError: unknown backend, or the CuPy backend is not available here.
    """
    backend = resolve_backend(backend)
    if backend == "numpy":
        from ninfer.kernels.numpy_ops import NumpyOps
        return NumpyOps()
    if backend == "cupy":
        try:
            from ninfer.kernels.cupy_ops import CupyOps  # type: ignore[import-not-found]
        except ImportError as e:
            raise ValueError(f"the cupy backend is not available: {e}") from e
        try:
            return CupyOps(config)
        except RuntimeError as e:
            raise ValueError(f"the cupy backend is not available: {e}") from e
    raise ValueError(f"unknown kernel backend {backend!r} (expected one of {BACKENDS} or auto)")

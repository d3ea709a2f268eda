"""Linear layers over stored weights, NumPy reference.

The NumPy backend dequantizes every stored weight once, at load, to a float32 C-contiguous
``(N, K)`` matrix; ``linear`` is then one BLAS sgemm/sgemv call over it (no copy of the weight).
Decode at small batch is memory-bound, so the cost is the float32 bytes of the weights read once
per step.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ninfer.store.quant import QuantTensor, dequantize


def prepare_weight(t: QuantTensor) -> np.ndarray:
    """Expand a stored tensor to the backend's compute form.

    Args:
        t: any scheme of ``ninfer.store.quant`` and any shape (matrices ``(N, K)``, norm
            vectors ``(H,)``).

    Returns:
        float32 C-contiguous array of shape ``t.shape`` that owns its memory (a copy, never a
        view of a memory-mapped artifact).
    """
    w = dequantize(t)
    if tuple(w.shape) != tuple(t.shape):
        raise ValueError(f"dequantized shape {w.shape} != stored shape {tuple(t.shape)}")
    return np.array(w, dtype=np.float32, order="C", copy=True)


def fused_k(ts: Sequence[QuantTensor]) -> int:
    """The common K of weights to be fused along N.

    Raises:
        ValueError: empty list, a tensor that is not 2-D, or differing K.
    """
    if not ts:
        raise ValueError("prepare_fused needs at least one tensor")
    ks = {tuple(t.shape)[1] if len(t.shape) == 2 else None for t in ts}
    if None in ks or len(ks) != 1:
        raise ValueError(f"prepare_fused needs 2-D tensors with equal K, got "
                         f"{[tuple(t.shape) for t in ts]}")
    return ks.pop()


def prepare_fused(ts: Sequence[QuantTensor]) -> np.ndarray:
    """Several ``(N_i, K)`` weights concatenated along N into one ``(sum N_i, K)`` matrix.

    ``linear(x, fused)[:, a:b]`` then equals ``linear(x, ts[j])`` for the j-th row range, so one
    call replaces several (e.g. q/k/v, gate/up).

    Raises:
        ValueError: empty list, a tensor that is not 2-D, or differing K.
    """
    k = fused_k(ts)
    n = sum(t.shape[0] for t in ts)
    out = np.empty((n, k), dtype=np.float32)
    row = 0
    for t in ts:
        out[row:row + t.shape[0]] = dequantize(t)
        row += t.shape[0]
    return out


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y = x @ w.T (no bias).

    Computed as ``(w @ x.T).T``: with a C-contiguous ``w`` OpenBLAS runs a plain
    (non-transposed) sgemm/sgemv on it, which for small T (batched decode) is 2-4x faster than
    the transposed form ``x @ w.T`` and no slower for large T.

    Args:
        x: (T, K) float32.
        w: (N, K) float32 prepared weight.

    Returns:
        New (T, N) float32 C-contiguous array.
    """
    return np.ascontiguousarray(np.matmul(w, x.T).T)


def fused_prologue(ops, x, norm, eps: float, gated: bool):
    """The activations ``fused_linear`` multiplies: ``ops.rms_norm(x, norm, eps)`` with
    ``norm``, ``ops.silu_mul(gate, up)`` of ``x = gate | up`` ((T, 2K)) when ``gated``, else
    ``x`` (any backend's arrays)."""
    if norm is not None:
        x = ops.rms_norm(x, norm, eps)
    if gated:
        i = x.shape[1] // 2
        x = ops.silu_mul(x[:, :i], x[:, i:])
    return x


def check_swiglu(w, gated: bool, residual) -> None:
    """``fused_linear(..., swiglu=True)``'s arguments (every backend).

    Raises:
        ValueError: an odd N, or ``gated`` / ``residual`` given too.
    """
    if residual is not None or gated or w.shape[0] % 2:
        raise ValueError(f"fused_linear: swiglu needs an even N and no residual or gating "
                         f"(N {w.shape[0]}, gated {gated})")


def fused_linear(ops, linear_fn, x, w, *, norm=None, eps: float = 0.0, gated: bool = False,
                 residual=None, swiglu: bool = False):
    """``ops.fused_linear`` composed of separate ops: the prologue, ``linear_fn(a, w)``, then
    ``residual += y`` in place (``residual`` returned) when a residual is given, or with
    ``swiglu`` ``ops.silu_mul(y[:, :N/2], y[:, N/2:])``.

    Raises:
        ValueError: ``swiglu`` with ``residual`` or ``gated``, or an odd N.
    """
    if swiglu:
        check_swiglu(w, gated, residual)
    y = linear_fn(fused_prologue(ops, x, norm, eps, gated), w)
    if swiglu:
        i = y.shape[1] // 2
        return ops.silu_mul(y[:, :i], y[:, i:])
    if residual is None:
        return y
    residual += y
    return residual

"""The tensor-core weight layout (``ninfer.kernels.mma_layout``) on the CPU: packing then
unpacking gives the stored weight bit for bit, and a lane-by-lane emulation of the GPU GEMV
(A registers decoded with the kernel's bit tricks, the PTX m16n8k16 fragment layout) equals the
dense product, on fresh random weights of every scheme, odd N and K not a multiple of 64."""
from __future__ import annotations

import numpy as np
import pytest

from ninfer.kernels import mma_layout as ml
from ninfer.store.quant import QuantTensor, dequantize, quantize_q8


def _q4(rng, n, k, group, mins):
    return QuantTensor(
        "q4", (n, k), codes=rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8),
        scales=(rng.random((n, k // group)) * 0.02 + 0.001).astype(np.float16),
        mins=(rng.standard_normal((n, k // group)) * 0.02).astype(np.float16) if mins else None,
        group=group)


def _packed(rng, kind, n, k, group):
    """A fresh random weight of ``kind`` and its packed codes and scales."""
    if kind == "q8":
        w = quantize_q8(rng.standard_normal((n, k)).astype(np.float32), group)
        codes = ml.pack_q8(w.codes, n, k)
    else:
        w = _q4(rng, n, k, group, mins=kind == "q4")
        codes = ml.pack_q4(w.codes, n, k)
    return w, codes, ml.pack_scales(w.scales, w.mins, n, k, group)


@pytest.mark.parametrize("kind", ["q4", "q4_0", "q8"])
@pytest.mark.parametrize("n,k,group", [(40, 96, 32), (16, 64, 64), (33, 128, 128), (7, 32, 32)])
def test_pack_unpack_and_emulated_gemv(kind, n, k, group):
    rng = np.random.default_rng(n * 1000 + k + group + len(kind))
    w, codes, scales = _packed(rng, kind, n, k, group)
    n16, kc = ml.padded(n, k)
    assert scales.shape == (n16, kc, 8, 4 if kind == "q4" else 2)
    dense = dequantize(w)
    assert np.array_equal(ml.unpack(w.scheme, codes, scales, n, k), dense)
    x = rng.standard_normal((5, k))
    got = ml.emulate_gemv(w.scheme, codes, scales, x, n, k)
    ref = x @ dense.astype(np.float64).T
    assert np.abs(got - ref).max() <= 1e-12 * np.abs(ref).max()


def test_layout_requirements():
    assert ml.layout_ok(576, 32) and ml.layout_ok(4128, 64)
    assert not ml.layout_ok(100, 32) and not ml.layout_ok(576, 48)
    assert ml.padded(1003, 4128) == (63, 65)


def test_quantize_activations_q8():
    rng = np.random.default_rng(7)
    a = (rng.standard_normal((3, 96)) * rng.random((3, 1)) * 10).astype(np.float32)
    a[1, 32:64] = 0.0                                   # an all-zero segment
    q, d = ml.quantize_activations_q8(a)
    assert q.dtype == np.int8 and d.shape == (3, 3) and d[1, 1] == 0 and not q[1, 32:64].any()
    seg = np.abs(a).reshape(3, 3, 32)
    assert (np.abs(q).reshape(3, 3, 32).max(axis=-1)[seg.max(-1) > 0] == 127).all()
    err = np.abs(ml.dequantize_activations_q8(q, d) - a)
    assert (err.reshape(3, 3, 32) <= d[..., None] / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("kind", ["q4", "q4_0", "q8"])
@pytest.mark.parametrize("n,k,group,t", [(40, 96, 32, 1), (16, 64, 64, 3), (33, 128, 128, 8)])
def test_emulated_int8_activation_gemv(kind, n, k, group, t):
    """The q8a GEMV's lane arithmetic (integer m16n8k32 fragments over the packed words, the
    staged k order) equals the dense product of the weight and the int8-rounded activations."""
    rng = np.random.default_rng(n * 100 + k + t + len(kind))
    w, codes, scales = _packed(rng, kind, n, k, group)
    x = rng.standard_normal((t, k)).astype(np.float32)
    got = ml.emulate_gemv_q8a(w.scheme, codes, scales, x, n, k)
    ref = ml.dequantize_activations_q8(*ml.quantize_activations_q8(x)) @ (
        dequantize(w).astype(np.float64).T)
    assert np.abs(got - ref).max() <= 1e-12 * np.abs(ref).max()
    exact = x.astype(np.float64) @ dequantize(w).astype(np.float64).T
    assert np.abs(got - exact).max() <= 0.03 * np.abs(exact).max()

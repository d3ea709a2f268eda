"""CuPy backend kernels against the NumPy reference (marker ``gpu``; skipped without CUDA).

Every test draws fresh random inputs; every array the GPU code allocates is NaN-poisoned first
(``cupy.empty`` is patched), so an element a kernel fails to write shows up as NaN. Error bound:
``max |gpu - ref| / max |ref|`` with float32 kernels under 1e-5 (float64 references), the fp16
tensor-core GEMM / GEMV (activations rounded to fp16) under 4e-3, and the int8-activation GEMV
(decode, T <= 8) under 2e-5 against the product of the int8-rounded activations
(``mma_layout.quantize_activations_q8``) and 2e-2 against the unrounded ones; the tensor-core
prefill attention (fp16 operands, fp32 accumulation) under 4e-3.
"""
from __future__ import annotations

import zlib
from dataclasses import replace

import numpy as np
import pytest

from ninfer.kernels import get_ops
from ninfer.kernels.config import KernelConfig
from ninfer.kernels.attention import paged_attention as ref_attention
from ninfer.kernels.kv_codec import codec
from ninfer.store.quant import QuantTensor, dequantize, quantize_q8

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from cupy_common import gops, has_gpu, nops, poison, rel  # noqa: E402,F401

if not has_gpu():
    pytest.skip("no CUDA device", allow_module_level=True)

F32 = 1e-5
F16_GEMM = 4e-3
F16_ATTN = 4e-3    # tensor-core prefill attention: Q, K, V and P rounded to fp16
Q8A_EXACT = 2e-5   # q8a GEMV against float64 on the same int8-rounded activations
Q8A = 2e-2         # q8a GEMV against float64 on the float32 activations


def kconf(**changes) -> KernelConfig:
    """The default kernel config with ``changes``; mapping fields may be given as a dict of the
    entries that change (``bulk_shape={"q8": ...}``)."""
    base = KernelConfig()
    for name, value in changes.items():
        if name in ("mma_shape", "q8a_shape", "bulk_shape", "prefill_mma_tiling"):
            changes[name] = {**getattr(base, name), **value}
    return replace(base, **changes)


def lin_bound(kc: KernelConfig, t: int, n: int = 0, k: int = 0) -> float:
    """Error bound of a packed-weight linear over T rows of an (N, K) weight under ``kc``: int8
    activations through ``gemv_q8a`` (activations "q8", T <= ``q8a_max_t``) or ``gemv_bulk``
    (T = 1, "auto" or "q8", a weight ``bulk_config`` takes), else fp16."""
    from ninfer.kernels.gpu import linear as glin
    if kc.activations == "q8" and t <= kc.q8a_max_t:
        return Q8A
    if n and kc.bulk_q8 and glin.bulk_config(kc, t, k, n, 0, True) is not None:
        return Q8A
    return F16_GEMM


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()) + 12345)


def q4(rng, n, k, mins=True, group=32) -> QuantTensor:
    codes = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    scales = (rng.random((n, k // group)) * 0.02 + 0.001).astype(np.float16)
    m = (rng.standard_normal((n, k // group)) * 0.02).astype(np.float16) if mins else None
    return QuantTensor("q4", (n, k), codes=codes, scales=scales, mins=m, group=group)


def q8(rng, n, k, group=32) -> QuantTensor:
    return quantize_q8(rng.standard_normal((n, k)).astype(np.float32), group)


def f32(rng, *shape) -> QuantTensor:
    return QuantTensor("f32", shape, data=rng.standard_normal(shape).astype(np.float32))


def test_get_ops_cupy_and_auto(gops):
    assert gops.name == "cupy"
    assert get_ops("auto").name == "cupy"


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("h,rows", [(576, 37), (4096, 3), (8192, 2), (578, 5), (16000, 2)])
def test_rms_norm(gops, rng, unit_offset, h, rows):
    """Vectorised rows (H % 4 == 0: one, two, four float4 per thread) and the scalar kernel
    (H = 578), on a strided view (row stride H + 4)."""
    base = rng.standard_normal((rows, h + 4)).astype(np.float32) * 3
    x = base[:, :h]
    w = rng.standard_normal(h).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * ((1 + w) if unit_offset else w)
    got = gops.rms_norm(cp.asarray(base)[:, :h], cp.asarray(w), 1e-5, unit_offset)
    assert got.shape == (rows, h)
    assert rel(got, ref) < F32


@pytest.mark.parametrize("style,rotary_dim,scaling", [
    ("half", None, None), ("adjacent", None, None), ("half", 32, None),
    ("half", None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})])
def test_rope(gops, nops, rng, style, rotary_dim, scaling):
    t, n, hd = 19, 12, 64
    base = rng.standard_normal((t, n * hd + 40)).astype(np.float32)  # strided rows
    x = base[:, :n * hd].reshape(t, n, hd)
    pos = rng.integers(0, 30000, size=t).astype(np.int32)
    ref = nops.rope(x, pos, 500000.0, style, rotary_dim, scaling)
    xd = cp.asarray(base)[:, :n * hd].reshape(t, n, hd)
    assert rel(gops.rope(xd, pos, 500000.0, style, rotary_dim, scaling), ref) < 2e-5


@pytest.mark.parametrize("rotary_dim", [None, 32])
def test_rope_write_kv(gops, nops, rng, rotary_dim):
    """Fused RoPE + paged KV write against rope then write_kv (poisoned q; caches compared
    whole, a negative slot writes nothing)."""
    t, nq, nk, hd = 5, 8, 2, 64
    qkv = rng.standard_normal((t, (nq + 2 * nk) * hd)).astype(np.float32)
    pos = np.array([0, 3, 17, 100, 4095], dtype=np.int32)
    slots = np.array([0, 5, -1, 33, 47], dtype=np.int64)
    caches = [rng.standard_normal((4, 16, nk, hd)).astype(np.float32) for _ in range(2)]
    ref_k, ref_v = caches[0].copy(), caches[1].copy()
    ref_q = nops.rope_write_kv(qkv, nq, nk, pos, 500000.0, ref_k, ref_v, slots,
                               rotary_dim=rotary_dim)
    kc, vc = cp.asarray(caches[0]), cp.asarray(caches[1])
    q = gops.rope_write_kv(cp.asarray(qkv), nq, nk, pos, 500000.0, kc, vc, slots,
                           rotary_dim=rotary_dim)
    assert rel(q, ref_q) < 2e-5
    assert rel(kc, ref_k) < 2e-5 and rel(vc, ref_v) == 0.0


@pytest.mark.parametrize("gated_q,hd,rotary_dim", [(True, 256, 64), (False, 64, None),
                                                    (True, 96, 32)])
def test_norm_rope_write_kv(gops, nops, rng, gated_q, hd, rotary_dim):
    """Gated attention's q / k preparation in one kernel (per-head RMSNorm, partial RoPE, paged
    KV write) against the NumPy reference's composed ops: q (its memory pool block NaN-filled
    first), the caches whole (a negative slot writes nothing), strided rows."""
    t, nq, nk = 5, 6, 2
    width = nq * hd * (2 if gated_q else 1) + 2 * nk * hd
    qkv = (rng.standard_normal((t, width + 7)) * 3).astype(np.float32)[:, 7:]
    qn, kn = [(1 + 0.2 * rng.standard_normal(hd)).astype(np.float32) for _ in range(2)]
    pos = np.array([0, 3, 17, 100, 4095], dtype=np.int32)
    slots = np.array([0, 5, -1, 33, 47], dtype=np.int64)
    caches = [rng.standard_normal((4, 16, nk, hd)).astype(np.float32) for _ in range(2)]
    ref_k, ref_v = caches[0].copy(), caches[1].copy()
    ref_q = nops.norm_rope_write_kv(qkv, nq, nk, gated_q, qn, kn, 1e-6, pos, 1e7, ref_k, ref_v,
                                    slots, rotary_dim=rotary_dim)
    kc, vc = cp.asarray(caches[0]), cp.asarray(caches[1])
    dq = cp.asarray(np.pad(qkv, ((0, 0), (7, 0))))[:, 7:]
    poison = cp.full((t, nq, hd), cp.nan, cp.float32)   # (the pool hands this block to q)
    del poison
    q = gops.norm_rope_write_kv(dq, nq, nk, gated_q, cp.asarray(qn), cp.asarray(kn), 1e-6, pos,
                                1e7, kc, vc, slots, rotary_dim=rotary_dim)
    assert q.shape == (t, nq, hd) and rel(q, ref_q) < 2e-5
    assert rel(kc, ref_k) < 2e-5 and rel(vc, ref_v) == 0.0
    assert np.array_equal(cp.asnumpy(kc).reshape(-1, nk, hd)[1:5], caches[0].reshape(-1, nk,
                                                                                     hd)[1:5])


def test_silu_mul_strided(gops, nops, rng):
    gu = (rng.standard_normal((23, 2 * 1536)) * 4).astype(np.float32)
    ref = nops.silu_mul(gu[:, :1536], gu[:, 1536:])
    d = cp.asarray(gu)
    assert rel(gops.silu_mul(d[:, :1536], d[:, 1536:]), ref) < F32


@pytest.mark.parametrize("kind", ["q4", "q4_0", "q8", "f32"])
def test_embedding(gops, rng, kind):
    v, h = 1000, 576
    t = {"q4": q4(rng, v, h), "q4_0": q4(rng, v, h, mins=False), "q8": q8(rng, v, h),
         "f32": f32(rng, v, h)}[kind]
    ids = rng.integers(0, v, size=29).astype(np.int32)
    ref = dequantize(t)[ids]
    assert rel(gops.embedding(gops.prepare_weight(t), ids), ref) < F32
    with pytest.raises(IndexError):
        gops.embedding(gops.prepare_weight(t), np.array([v], np.int32))


@pytest.mark.parametrize("kind", ["q4", "q4_0", "q8", "f32"])
@pytest.mark.parametrize("t", [1, 2, 3, 8, 13, 32, 33, 300])
def test_linear(gops, rng, kind, t):
    n, k = 1000, 576 if t % 2 else 1536
    w = {"q4": lambda: q4(rng, n, k), "q4_0": lambda: q4(rng, n, k, mins=False),
         "q8": lambda: q8(rng, n, k), "f32": lambda: f32(rng, n, k)}[kind]()
    x = rng.standard_normal((t, k)).astype(np.float32)
    ref = x.astype(np.float64) @ dequantize(w).astype(np.float64).T
    bound = lin_bound(gops.config, t, n, k) if kind != "f32" else 1e-4
    assert rel(gops.linear(cp.asarray(x), gops.prepare_weight(w)), ref) < bound


# (row tiles per block, chunks in flight, warps per block or None = by K)
MMA_VARIANTS = {1: [(1, 2, None), (1, 4, None), (2, 4, 4), (1, 8, 16), (1, 2, 8)],
                2: [(1, 2, None), (2, 2, 8)], 4: [(1, 2, None), (1, 1, 16)]}


@pytest.mark.parametrize("ring", [4, 2, 0])
@pytest.mark.parametrize("stage", [True, False])
@pytest.mark.parametrize("kind", ["q4", "q4_0", "q8"])
def test_gemv_every_compiled_shape(gops, rng, monkeypatch, kind, stage, ring):
    """Every (row tiles per block, chunks in flight, warps) variant of ``gemv_mma`` for 1, 2
    and 4 token tiles, activations staged in shared memory or read from global memory, weights
    through a shared-memory ring of 4 or 2 steps or through registers, with N not a multiple of
    16 and K not a multiple of 64 (half a chunk)."""
    from ninfer.kernels.gpu import linear as glin
    base = dict(gemv_stages=ring,
                ring_schemes=frozenset({0, 1, 2}),   # the ring for every scheme,
                ring_min_steps=1,                    # every shape where it fits
                activations="f16",                   # gemv_mma at every T
                mma_shape_t3_8=None,
                gemv_chunk=32)   # one launch of 27 rows: the NT = 4 kernel
    if not stage:
        base["stage_max_bytes"] = 0
    n, k = 1003, 4128
    w = {"q4": lambda: q4(rng, n, k), "q4_0": lambda: q4(rng, n, k, mins=False),
         "q8": lambda: q8(rng, n, k)}[kind]()
    gw = gops.prepare_weight(w)
    for nt, shapes in MMA_VARIANTS.items():
        t = {1: 3, 2: 11, 4: 27}[nt]
        x = rng.standard_normal((t, k)).astype(np.float32)
        ref = x.astype(np.float64) @ dequantize(w).astype(np.float64).T
        for rt, u, warps in shapes:
            kc = kconf(mma_shape={nt: (rt, u)}, warps=warps, **base)
            cfg = glin.gemv_config(kc, t, k, False, True, gw.sch, n)   # what linear launches
            assert cfg.stage == (stage and nt < 4) and cfg.stages <= ring
            assert cfg.smem <= glin.smem_limits()[0]
            ops = get_ops("cupy", kc)
            assert rel(ops.linear(cp.asarray(x), gw), ref) < F16_GEMM, (nt, rt, u, warps)


@pytest.mark.parametrize("kind", ["q4", "q4_0", "q8"])
@pytest.mark.parametrize("t", [1, 6, 8, 9, 16, 32, 33])
@pytest.mark.parametrize("mode", ["norm", "gated_residual", "residual"])
@pytest.mark.parametrize("stage", [True, False, "q8a"])
def test_fused_linear_matches_composed_ops(gops, nops, rng, monkeypatch, kind, t, mode, stage):
    """RMSNorm prologue, SiLU-gate prologue and residual epilogue of ``fused_linear`` against
    the NumPy ops composed (T = 33 takes the unfused GEMM path): fp16 activations staged in
    shared memory or read from global memory, or (T <= 8) int8 activations."""
    kc = kconf(activations="q8" if stage == "q8a" else "f16", q8a_max_t=8,
               **({} if stage else {"stage_max_bytes": 0}))
    if stage == "q8a" and t > kc.q8a_max_t:
        pytest.skip("int8 activations are for T <= 8")
    gops = get_ops("cupy", kc)
    n, k = 1003, 4128 if kind != "q8" else 576
    w = {"q4": lambda: q4(rng, n, k), "q4_0": lambda: q4(rng, n, k, mins=False),
         "q8": lambda: q8(rng, n, k)}[kind]()
    kx = 2 * k if mode == "gated_residual" else k
    x = (rng.standard_normal((t, kx)) * 3).astype(np.float32)
    nw = (rng.random(k) + 0.5).astype(np.float32)
    res = rng.standard_normal((t, n)).astype(np.float32)
    kw = {"norm": dict(norm=nw, eps=1e-5), "gated_residual": dict(gated=True, residual=res),
          "residual": dict(residual=res)}[mode]
    ref = nops.fused_linear(x, dequantize(w), **{a: (v.copy() if isinstance(v, np.ndarray)
                                                     else v) for a, v in kw.items()})
    gkw = {a: (cp.asarray(v) if isinstance(v, np.ndarray) else v) for a, v in kw.items()}
    got = gops.fused_linear(cp.asarray(x), gops.prepare_weight(w), **gkw)
    if "residual" in gkw:
        assert got is gkw["residual"]
    assert rel(got, ref) < lin_bound(kc, t, n, k)


@pytest.mark.parametrize("h,rows", [(576, 37), (8192, 2), (578, 5), (16000, 2)])
def test_rms_norm_and_silu_mul_f16_are_the_float32_results_rounded(gops, rng, h, rows):
    """The prefill GEMM's fp16 operand written by the prologue's own kernel (vectorised rows
    and the scalar fallback, strided views) is its float32 result cast as ``astype`` casts."""
    from ninfer.kernels.gpu import elementwise as gew
    x = cp.asarray(rng.standard_normal((rows, 2 * h + 4)).astype(np.float32) * 3)
    w = cp.asarray(rng.standard_normal(h).astype(np.float32))
    for got, want in ((gew.rms_norm(x[:, :h], w, 1e-5, f16=True),
                       gew.rms_norm(x[:, :h], w, 1e-5)),
                      (gew.silu_mul(x[:, :h], x[:, h:2 * h], f16=True),
                       gew.silu_mul(x[:, :h], x[:, h:2 * h])),
                      (gew.to_f16(x[:, h:2 * h]), x[:, h:2 * h])):
        assert got.dtype == cp.float16 and got.shape == (rows, h)
        assert cp.array_equal(got.view(cp.uint16), want.astype(cp.float16).view(cp.uint16))


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("mode", ["norm", "gated_residual", "residual", "plain"])
def test_prefill_linear_equals_the_composed_ops(gops, rng, kind, mode):
    """A packed weight over more rows than the GEMVs take: the prologue writing fp16 and the
    residual added in cuBLAS's epilogue give the composed ops' floats (rms_norm / silu_mul,
    the cast, the GEMM, then ``residual += y``), the residual updated in place."""
    from ninfer.kernels import linear as linear_ref
    t, n = gops.config.gemv_max_t + 31, 1003
    k = 4128 if kind == "q4" else 576
    w = gops.prepare_weight({"q4": q4, "q8": q8}[kind](rng, n, k))
    kx = 2 * k if mode == "gated_residual" else k
    x = cp.asarray((rng.standard_normal((t, kx)) * 3).astype(np.float32))
    res = rng.standard_normal((t, n)).astype(np.float32)
    kw = {"norm": dict(norm=cp.asarray((rng.random(k) + 0.5).astype(np.float32)), eps=1e-5),
          "gated_residual": dict(gated=True), "residual": {}, "plain": {}}[mode]
    with_res = "residual" in mode
    want = linear_ref.fused_linear(gops, gops._linear, x, w, **kw,
                                   residual=cp.asarray(res) if with_res else None)
    r = cp.asarray(res) if with_res else None
    got = gops.fused_linear(x, w, **kw, residual=r)
    assert got is r if with_res else got.shape == (t, n)
    assert rel(got, cp.asnumpy(want)) < 1e-6


def test_kept_fp16_weights_give_the_per_pass_copys_floats(rng):
    """A model whose layers' packed weights fit ``prefill_f16_mib`` keeps each one's fp16 copy
    (a fused weight's parts too; the embedding outside the layers does not): its prefill GEMMs
    give the floats of the copy written a pass, bit for bit; one that does not fit keeps none."""
    from types import SimpleNamespace

    from ninfer.kernels.gpu.linear import FusedWeight
    ops = get_ops("cupy")
    t = ops.config.gemv_max_t + 9
    a, b = ops.prepare_weight(q4(rng, 300, 576)), ops.prepare_weight(q8(rng, 200, 576))
    c, emb = ops.prepare_weight(q4(rng, 576, 1024)), ops.prepare_weight(q4(rng, 64, 576))
    fused = FusedWeight([a, b], [0, 300, 500], (500, 576))
    model = SimpleNamespace(embed=emb, layers=[SimpleNamespace(qkv=fused, down=c)])
    x = cp.asarray((rng.standard_normal((t, 576)) * 3).astype(np.float32))
    h = cp.asarray((rng.standard_normal((t, 1024)) * 3).astype(np.float32))
    res = cp.asarray(rng.standard_normal((t, 576)).astype(np.float32))
    before = [ops.linear(x, fused), ops.fused_linear(h, c, residual=res.copy())]
    small = get_ops("cupy", KernelConfig(prefill_f16_mib=0))
    assert small.keep_f16(model) == 0 and a.f16 is None and c.f16 is None
    assert ops.keep_f16(model) == 2 * (300 + 200 + 1024) * 576
    assert emb.f16 is None and all(w.f16.dtype == cp.float16 for w in (a, b, c))
    ops._scratch[...] = 0xFF   # (fp16 NaNs: a GEMM that still read the per-pass copy would differ)
    after = [ops.linear(x, fused), ops.fused_linear(h, c, residual=res.copy())]
    for want, got in zip(before, after):
        assert cp.array_equal(got, want)


def q8_activation_reference(x, w: QuantTensor, nw, res, mode: str) -> np.ndarray:
    """float64 GEMV of ``dequant(w)`` with the activations rounded to int8 per 32 columns exactly
    as the int8 kernels round them (``mma_layout.quantize_activations_q8``): of x, of
    silu(gate) * up for mode "gated_*", or of x * ``nw`` for "norm" (rstd applied after); plus
    ``res`` for modes containing "residual"."""
    from ninfer.kernels import mma_layout as ml
    from ninfer.kernels.activation import silu_mul
    k = w.shape[1]
    a = silu_mul(x[:, :k], x[:, k:]) if mode.startswith("gated") else x
    a = a * nw if mode == "norm" else a
    ref = ml.dequantize_activations_q8(*ml.quantize_activations_q8(a)) @ (
        dequantize(w).astype(np.float64).T)
    if mode == "norm":
        x64 = x.astype(np.float64)
        ref /= np.sqrt((x64 * x64).mean(axis=1, keepdims=True) + 1e-5)
    if "residual" in mode:
        ref += res
    return ref


@pytest.mark.parametrize("kind", ["q4", "q4_0", "q8"])
@pytest.mark.parametrize("t", [1, 2, 5, 8])
@pytest.mark.parametrize("mode", ["plain", "norm", "residual"])
def test_gemv_q8a_equals_the_int8_activation_product(gops, rng, monkeypatch, kind, t, mode):
    """``gemv_q8a`` against float64 on the activations rounded exactly as the kernel rounds them
    (``quantize_activations_q8``, of x * norm weight for RMSNorm, rstd applied after), N not a
    multiple of 16, K = 4128 (an odd number of 64-column chunks) and 576, every row-tile shape,
    for every T the kernel serves (the default routes only T = 1 to it)."""
    from ninfer.kernels.gpu import linear as glin
    for n, k in ((1003, 4128), (200, 576)):
        w = {"q4": lambda: q4(rng, n, k), "q4_0": lambda: q4(rng, n, k, mins=False),
             "q8": lambda: q8(rng, n, k)}[kind]()
        x = (rng.standard_normal((t, k)) * rng.random((t, 1)) * 4).astype(np.float32)
        x[0, 64:96] = 0.0                                 # an all-zero segment
        nw = (rng.random(k) + 0.5).astype(np.float32)
        res = rng.standard_normal((t, n)).astype(np.float32)
        ref = q8_activation_reference(x, w, nw, res, mode)
        for shape in ((1, 4), (1, 2), (2, 2), (2, 4)):
            kc = kconf(activations="q8", q8a_max_t=8, q8a_shape={t == 1: shape})
            out = cp.asarray(res) if mode == "residual" else cp.empty((t, n), cp.float32)
            glin.gemv(kc, cp.asarray(x), gops.prepare_weight(w), out,
                      norm=cp.asarray(nw) if mode == "norm" else None, eps=1e-5,
                      accumulate=mode == "residual")
            assert rel(out, ref) < Q8A_EXACT, (n, k, shape)


# (consumer warps, chunks per warp per slot, ring slots, blocks per multiprocessor)
BULK_VARIANTS = [(8, 2, 6, 2), (4, 1, 3, 2), (16, 1, 4, 1), (8, 4, 3, 2), (16, 2, 5, 1),
                 (16, 2, 8, 1)]


@pytest.mark.parametrize("kind", ["q4", "q4_0", "q8"])
@pytest.mark.parametrize("mode", ["plain", "norm", "gated_residual", "residual"])
@pytest.mark.parametrize("acts", ["f16", "q8"])
def test_gemv_bulk_matches_the_reference(gops, nops, rng, monkeypatch, kind, mode, acts):
    """``gemv_bulk`` (batch-1 decode: persistent blocks fed by bulk copies through a ring of
    shared-memory slots), every compiled shape, with fp16 activations against the composed NumPy
    ops, with int8 activations against float64 on the int8-rounded activations; N not a multiple
    of 16 and not a multiple of the grid, K = 4128 and 8224 (65 and 129 chunks: a partial last
    slot), one and two blocks per multiprocessor."""
    from ninfer.kernels.gpu import linear as glin
    from ninfer.kernels.gpu import sm_count
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("gemv_bulk needs sm_90")
    for n, k in ((sm_count() * 16 * 2 + 37, 4128), (sm_count() * 16 + 5, 8224)):
        w = {"q4": lambda: q4(rng, n, k), "q4_0": lambda: q4(rng, n, k, mins=False),
             "q8": lambda: q8(rng, n, k)}[kind]()
        gw = gops.prepare_weight(w)
        kx = 2 * k if mode == "gated_residual" else k
        x = (rng.standard_normal((1, kx)) * 3).astype(np.float32)
        x[0, 64:96] = 0.0                                 # an all-zero segment
        nw = (rng.random(k) + 0.5).astype(np.float32)
        res = rng.standard_normal((1, n)).astype(np.float32)
        kw = {"plain": {}, "norm": {"norm": nw, "eps": 1e-5},
              "gated_residual": {"gated": True, "residual": res},
              "residual": {"residual": res}}[mode]
        if acts == "f16":
            ref = nops.fused_linear(x, dequantize(w), **{
                a: (v.copy() if isinstance(v, np.ndarray) else v) for a, v in kw.items()})
            bound = F16_GEMM
        else:
            ref = q8_activation_reference(x, w, nw, res, mode)
            # silu: __expf in the kernel may round a code the other way (one step of d)
            bound = 1e-3 if mode == "gated_residual" else Q8A_EXACT
        for shape in BULK_VARIANTS:
            kc = kconf(activations=acts, bulk_shape={acts: shape})
            per_sm = shape[3]
            pro = glin.PRO["norm" if mode == "norm" else "silu" if "gated" in mode else "plain"]
            _, cfg = glin.gemv_kernel(kc, gw.sch, 1, k, pro, "residual" in kw, True, kx, n)
            assert cfg.threads == 32 * (shape[0] + 1), cfg   # gemv_bulk: W + 1 warps
            # shape[3] blocks per multiprocessor, or fewer where they would not all be resident
            assert cfg.grid in {min(-(-n // 16), sm_count() * p) for p in range(1, per_sm + 1)}
            out = cp.asarray(res) if "residual" in kw else cp.empty((1, n), cp.float32)
            glin.gemv(kc, cp.asarray(x), gw, out, norm=cp.asarray(nw) if mode == "norm" else None,
                      eps=1e-5, gated="gated" in mode, accumulate="residual" in kw)
            assert rel(out, ref) < bound, (n, k, shape)


@pytest.mark.parametrize("kind", ["q4", "q4_0", "q8"])
@pytest.mark.parametrize("mode", ["plain", "norm", "gated_residual", "residual"])
@pytest.mark.parametrize("t", [2, 3, 4, 5, 8])
def test_gemv_bulk_mt_matches_the_int8_activation_product(gops, rng, kind, mode, t):
    """``gemv_bulk_mt`` (2 <= T <= 8 rows through gemv_bulk's ring, the tokens in the integer
    MMA's columns) against float64 on the int8-rounded activations, every token row, N not a
    multiple of 16 and not of the grid, K = 4128 and 8224 (a partial last slot), the ring
    shapes of ``BULK_VARIANTS`` (fewer slots where the staged rows need the room)."""
    from ninfer.kernels.gpu import linear as glin
    from ninfer.kernels.gpu import sm_count
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("gemv_bulk_mt needs sm_90")
    for n, k in ((sm_count() * 16 * 2 + 37, 4128), (sm_count() * 16 + 5, 8224)):
        w = {"q4": lambda: q4(rng, n, k), "q4_0": lambda: q4(rng, n, k, mins=False),
             "q8": lambda: q8(rng, n, k)}[kind]()
        gw = gops.prepare_weight(w)
        kx = 2 * k if mode == "gated_residual" else k
        x = (rng.standard_normal((t, kx)) * rng.random((t, 1)) * 4).astype(np.float32)
        x[0, 64:96] = 0.0                                 # an all-zero segment
        nw = (rng.random(k) + 0.5).astype(np.float32)
        res = rng.standard_normal((t, n)).astype(np.float32)
        ref = q8_activation_reference(x, w, nw, res, mode)
        bound = 1e-3 if mode == "gated_residual" else Q8A_EXACT
        for shape in BULK_VARIANTS:
            kc = kconf(activations="q8", bulk_shape={"q8": shape})
            pro = glin.PRO["norm" if mode == "norm" else "silu" if "gated" in mode else "plain"]
            fn, cfg = glin.gemv_kernel(kc, gw.sch, t, k, pro, "residual" in mode, True, kx, n)
            assert cfg.tb == (2 if t <= 2 else 4 if t <= 4 else 8), cfg   # gemv_bulk_mt
            out = cp.asarray(res) if "residual" in mode else cp.full((t, n), cp.nan, cp.float32)
            glin.gemv(kc, cp.asarray(x), gw, out, norm=cp.asarray(nw) if mode == "norm" else None,
                      eps=1e-5, gated="gated" in mode, accumulate="residual" in mode)
            assert rel(out, ref) < bound, (n, k, shape)


@pytest.mark.parametrize("t", [7, 8])
def test_gemv_bulk_mt_takes_long_rows_with_half_the_warps(gops, rng, t):
    """Where the T staged rows leave no room for a ring of the default 16 consumer warps (the
    27B's down projection: K = 17,408 at 7-8 rows), ``gemv_bulk_mt`` runs with 8 (smaller slots
    and partial sums) instead of falling back to ``gemv_mma``: every token row against float64
    on the int8-rounded activations, with the residual, prestaged and not."""
    from ninfer.kernels.gpu import linear as glin
    from ninfer.kernels.gpu import sm_count
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("gemv_bulk_mt needs sm_90")
    n, k = sm_count() * 16 + 21, 17408
    w = q4(rng, n, k, mins=False)
    gw = gops.prepare_weight(w)
    x = (rng.standard_normal((t, k)) * rng.random((t, 1)) * 4).astype(np.float32)
    res = rng.standard_normal((t, n)).astype(np.float32)
    ref = q8_activation_reference(x, w, None, res, "residual")
    for kc in (kconf(), kconf(bulk_mt_prestage=0)):
        fn, cfg = glin.gemv_kernel(kc, gw.sch, t, k, glin.PRO["plain"], True, True, k, n,
                                   prestaged=glin.prestages(kc, t, k))
        assert cfg.tb == 8 and cfg.w == kc.bulk_shape["q8"][0] // 2, cfg   # gemv_bulk_mt
        out = cp.asarray(res)
        glin.gemv(kc, cp.asarray(x), gw, out, accumulate=True)
        assert rel(out, ref) < Q8A_EXACT


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("mode", ["plain", "norm", "gated_residual", "residual", "swiglu"])
@pytest.mark.parametrize("t", [3, 8])
def test_gemv_bulk_mt_prestaged_rows_are_bit_identical(gops, rng, kind, mode, t):
    """``gemv_bulk_mt`` with its int8 rows made once by ``stage_rows_q8`` (``bulk_mt_prestage``)
    writes the same bits as with every block staging them: the words, the (chunk, token) meta
    and the RMSNorm's rstd are the same floats; K with an odd and an even chunk count (the
    staged rows' stride pad), every prologue, the residual and the SwiGLU epilogue."""
    from ninfer.kernels.gpu import linear as glin
    from ninfer.kernels.gpu import sm_count
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("gemv_bulk_mt needs sm_90")
    on, off = kconf(bulk_mt_prestage=1), kconf(bulk_mt_prestage=0)
    for n, k in ((sm_count() * 32 + 64, 4128), (sm_count() * 32 + 32, 4096)):
        w = q4(rng, n, k) if kind == "q4" else q8(rng, n, k)
        gw = gops.prepare_weight(w)
        kx = 2 * k if mode == "gated_residual" else k
        x = cp.asarray((rng.standard_normal((t, kx)) * rng.random((t, 1))).astype(np.float32))
        x[0, 64:96] = 0.0
        nw = cp.asarray((rng.random(k) + 0.5).astype(np.float32))
        res = cp.asarray(rng.standard_normal((t, n)).astype(np.float32))
        pro = glin.PRO["norm" if mode == "norm" else "silu" if "gated" in mode else "plain"]
        width = n // 2 if mode == "swiglu" else n
        outs = []
        for kc in (on, off):
            _, cfg = glin.gemv_kernel(kc, gw.sch, t, k, pro, "residual" in mode, True, kx, n,
                                      swiglu=mode == "swiglu",
                                      prestaged=glin.prestages(kc, t, k))
            assert cfg.tb == (2 if t <= 2 else 4 if t <= 4 else 8) and \
                cfg.prestaged == (kc is on), cfg
            out = res.copy() if "residual" in mode else cp.full((t, width), cp.nan, cp.float32)
            glin.gemv(kc, x, gw, out, norm=nw if mode == "norm" else None, eps=1e-5,
                      gated="gated" in mode, accumulate="residual" in mode,
                      swiglu=mode == "swiglu")
            assert not cp.isnan(out).any()
            outs.append(out)
        assert cp.array_equal(*outs), (kind, mode, t, k)
    assert glin.prestage_words(3, 4096) == 3 * (64 * 16 + 16) + 4 * 64 * 3 + 3
    assert not glin.prestages(off, 8, 17408) and glin.prestages(kconf(), 2, 8192)
    assert not glin.prestages(kconf(), 2, 5120)


def _silu_mul64(gu, i: int) -> np.ndarray:
    """silu(gate) * up in float64 of a (T, 2 I) gate | up."""
    g, u = np.asarray(gu[:, :i], np.float64), np.asarray(gu[:, i:], np.float64)
    return g / (1 + np.exp(-g)) * u


@pytest.mark.parametrize("kind", ["q4", "q4_0", "q8"])
@pytest.mark.parametrize("t", [2, 3, 4, 5, 8])
def test_gemv_bulk_mt_swiglu_epilogue_matches_the_composed_path(gops, rng, monkeypatch, kind, t):
    """``gemv_bulk_mt`` with the SwiGLU epilogue (a (2 I, K) gate | up weight, T = 2..8) writes
    act (T, I) = silu(gate) * up, every token row (output NaN-poisoned): against float64 on the
    int8-rounded activations, against the SwiGLU of the plain GEMV's gate | up (the composed
    path) within float32 rounding of exp, and bit for bit through a down GEMV against the SiLU
    prologue of that gate | up; for the ring shapes of ``BULK_VARIANTS``, with RMSNorm and I / 16
    = SMs + 3 or 4 pairs of row tiles (K = 4128), and plain with 7 "SMs" (many pairs a block:
    several groups of sums; K = 8224, a partial last slot). ``swiglu_epilogue`` says the launch
    is ``gemv_bulk_mt``'s; an odd row stride of x is refused."""
    from ninfer.kernels.gpu import linear as glin
    from ninfer.kernels.gpu import sm_count
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("gemv_bulk_mt needs sm_90")
    make = {"q4": lambda n, kk: q4(rng, n, kk), "q4_0": lambda n, kk: q4(rng, n, kk, mins=False),
            "q8": lambda n, kk: q8(rng, n, kk)}[kind]
    mt = 2 if t <= 2 else 4 if t <= 4 else 8
    for sms, i, k, mode in ((sm_count(), 32 * -(-(sm_count() + 3) // 2), 4128, "norm"),
                            (7, 32 * 41, 8224, "plain")):
        with monkeypatch.context() as m:
            m.setattr(glin, "sm_count", lambda: sms)
            w = make(2 * i, k)
            gw, dw = gops.prepare_weight(w), gops.prepare_weight(make(768, i))
            x = (rng.standard_normal((t, k)) * rng.random((t, 1)) * 0.5).astype(np.float32)
            x[0, 64:96] = 0.0   # an all-zero segment; (a gate beyond ~700 overflows exp in float64)
            nw = (rng.random(k) + 0.5).astype(np.float32)
            norm = cp.asarray(nw) if mode == "norm" else None
            ref = _silu_mul64(q8_activation_reference(x, w, nw, None, mode), i)
            res = cp.asarray(rng.standard_normal((t, 768)).astype(np.float32))
            xd = cp.asarray(x)
            assert glin.swiglu_epilogue(kconf(), gw, t)                        # on by default
            assert not glin.swiglu_epilogue(kconf(swiglu_epilogue=False), gw, t)
            assert glin.swiglu_epilogue(kconf(swiglu_epilogue=False), gw, t, force=True)
            assert not glin.swiglu_epilogue(kconf(activations="f16"), gw, t)   # int8 only
            for shape in BULK_VARIANTS:
                kc = kconf(activations="q8", bulk_shape={"q8": shape})
                assert glin.swiglu_epilogue(kc, gw, t)
                pro = glin.PRO[mode]
                _, cfg = glin.gemv_kernel(kc, gw.sch, t, k, pro, False, True, k, 2 * i,
                                          swiglu=True)
                assert (cfg.tb, cfg.grid) == (mt, min(i // 16, sms)), cfg   # gemv_bulk_mt
                gu = cp.full((t, 2 * i), cp.nan, cp.float32)
                glin.gemv(kc, xd, gw, gu, norm=norm, eps=1e-5)
                act = cp.full((t, i), cp.nan, cp.float32)
                glin.gemv(kc, xd, gw, act, norm=norm, eps=1e-5, swiglu=True)
                # silu: __expf against exp, on top of the int8 GEMV's bound
                assert rel(act, ref) < 10 * Q8A_EXACT, (i, k, shape)
                assert rel(act, _silu_mul64(cp.asnumpy(gu), i)) < 1e-5, (i, k, shape)
                via_prologue, via_epilogue = res.copy(), res.copy()
                glin.gemv(kc, gu, dw, via_prologue, gated=True, accumulate=True)
                glin.gemv(kc, act, dw, via_epilogue, accumulate=True)
                assert cp.array_equal(via_prologue, via_epilogue), (i, k, shape)
            odd = cp.zeros((t, k + 1), cp.float32)[:, :k]     # row stride K + 1: no gemv_bulk_mt
            with pytest.raises(ValueError, match="SwiGLU"):
                glin.gemv(kconf(), odd, gw, cp.empty((t, i), cp.float32), swiglu=True)


@pytest.mark.parametrize("kind", ["q4", "q4_0", "q8"])
@pytest.mark.parametrize("t", [2, 3, 4, 5, 8])
def test_bulk_mt_swiglu_mlp_runs_gate_up_with_the_epilogue(nops, rng, monkeypatch, kind, t):
    """``swiglu_mlp`` for T = 2..8 rows of a large gate | up weight: one gate_up GEMV with the
    SwiGLU epilogue (out (T, I)), then a plain down GEMV with the residual, no ``silu_mul`` and
    no gated prologue; the block equals the NumPy one within the int8 activations' bound."""
    from ninfer.kernels.gpu import linear as glin
    from ninfer.kernels.gpu import sm_count
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("gemv_bulk_mt needs sm_90")
    ops = get_ops("cupy", kconf())
    i, k = 32 * -(-(sm_count() + 3) // 2), 4128
    make = {"q4": lambda n, kk: q4(rng, n, kk), "q4_0": lambda n, kk: q4(rng, n, kk, mins=False),
            "q8": lambda n, kk: q8(rng, n, kk)}[kind]
    wgu, wd = make(2 * i, k), make(k, i)
    gw, dw = ops.prepare_weight(wgu), ops.prepare_weight(wd)
    assert glin.swiglu_epilogue(ops.config, gw, t)
    x = (rng.standard_normal((t, k)) * 3).astype(np.float32)
    nw = (rng.random(k) + 0.5).astype(np.float32)
    calls = []
    gemv = glin.gemv
    names = {id(gw): "gate_up", id(dw): "down"}

    def spy(kc, xa, w, out, **kw):
        calls.append((names.get(id(w)), kw.get("swiglu", False), kw.get("gated", False),
                      out.shape))
        return gemv(kc, xa, w, out, **kw)

    def no_silu_mul(*args):
        raise AssertionError("silu_mul ran: the SwiGLU epilogue was not taken")

    monkeypatch.setattr(glin, "gemv", spy)
    monkeypatch.setattr(ops, "silu_mul", no_silu_mul)
    got = ops.swiglu_mlp(cp.asarray(x), cp.asarray(nw), gw, dw, 1e-5)
    assert calls == [("gate_up", True, False, (t, i)), ("down", False, False, (t, k))], calls
    ref = nops.swiglu_mlp(x.copy(), nw, dequantize(wgu), dequantize(wd), 1e-5)
    assert rel(got, ref) < Q8A


@pytest.mark.parametrize("kind", ["q4", "q4_0", "q8"])
@pytest.mark.parametrize("acts", ["q8", "f16"])
def test_gemv_bulk_swiglu_epilogue_is_bit_identical_to_the_silu_prologue(
        gops, rng, monkeypatch, kind, acts):
    """``gemv_bulk`` with the SwiGLU epilogue (a gate | up weight; the block split over pairs of
    row tiles, I / 16 = SMs + 3 or 4 of them: not a multiple of the grid; K = 4128: a partial
    last slot)
    writes act = silu(gate) * up, every row (outputs NaN-poisoned), equal to the NumPy SwiGLU of
    the plain GEMV's gate | up within float32 rounding of exp; and the down GEMV of act equals,
    bit for bit, the down GEMV of gate | up with the SiLU prologue (the same silu_mul1 of the
    same floats), for every compiled ``gemv_bulk`` shape. Refused where it does not apply."""
    from ninfer.kernels.gpu import linear as glin
    from ninfer.kernels.gpu import sm_count
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("gemv_bulk needs sm_90")
    kc = kconf(activations=acts)
    i, k = 32 * -(-(sm_count() + 3) // 2), 4128   # I a multiple of 32 (q4 groups of down)
    make = {"q4": lambda n, kk: q4(rng, n, kk), "q4_0": lambda n, kk: q4(rng, n, kk, mins=False),
            "q8": lambda n, kk: q8(rng, n, kk)}[kind]
    gw, dw = gops.prepare_weight(make(2 * i, k)), gops.prepare_weight(make(768, i))
    x = cp.asarray((rng.standard_normal((1, k)) * 3).astype(np.float32))
    nw = cp.asarray((rng.random(k) + 0.5).astype(np.float32))
    res = cp.asarray(rng.standard_normal((1, 768)).astype(np.float32))
    assert glin.swiglu_epilogue(kc, gw, 1)                      # on by default ...
    kc = kconf(activations=acts, swiglu_epilogue=False)
    assert not glin.swiglu_epilogue(kc, gw, 1)                  # ... off when switched off ...
    assert glin.swiglu_epilogue(kc, gw, 1, force=True)          # ... applies when asked
    assert glin.swiglu_epilogue(kc, gw, 2, force=True) == (acts == "q8")   # T = 2..8:
    assert not glin.swiglu_epilogue(kc, gw, 9, force=True)      # gemv_bulk_mt, int8 only
    assert not glin.swiglu_epilogue(kc, dw, 1, force=True)      # too few row tiles
    for shape in BULK_VARIANTS:
        kc = kconf(activations=acts, swiglu_epilogue=False, bulk_shape={acts: shape})
        gu = cp.empty((1, 2 * i), cp.float32)
        glin.gemv(kc, x, gw, gu, norm=nw, eps=1e-5)
        act = cp.empty((1, i), cp.float32)
        glin.gemv(kc, x, gw, act, norm=nw, eps=1e-5, swiglu=True)
        g, u = cp.asnumpy(gu[0, :i]).astype(np.float64), cp.asnumpy(gu[0, i:])
        assert rel(act, g / (1 + np.exp(-g)) * u) < 1e-5, shape
        via_prologue, via_epilogue = res.copy(), res.copy()
        glin.gemv(kc, gu, dw, via_prologue, gated=True, accumulate=True)
        glin.gemv(kc, act, dw, via_epilogue, accumulate=True)
        assert cp.array_equal(via_prologue, via_epilogue), shape
    with pytest.raises(ValueError, match="SwiGLU"):
        glin.gemv(kc, x, gw, cp.empty((1, i), cp.float32), swiglu=True, accumulate=True)
    with pytest.raises(ValueError, match="SwiGLU"):
        glin.gemv(kc, x[:, :768], dw, cp.empty((1, 384), cp.float32), swiglu=True)


@pytest.mark.parametrize("kind", ["q4", "q4_0", "q8"])
def test_q8_shadow_hands_the_activations_on(gops, rng, monkeypatch, kind):
    """q8 shadows (``KernelConfig.q8_shadow``): a ``gemv_bulk`` that also writes its output as a
    shadow (its blocks split into 32-row segments: 192 of them over the grid with a residual
    add, 130 with the SwiGLU epilogue, and 128 of a 4,096 x 4,096 weight, which takes the short
    path of ``bulk_short_bps`` blocks a multiprocessor) writes the very same floats; the next ``gemv_bulk``,
    copying the shadow instead of staging the floats, gives the same result bit for bit without
    an RMSNorm (the same codes and scales) and within float32 rounding of its rstd with one;
    for every compiled ``gemv_bulk`` shape, shadows NaN-poisoned before each run. A shadow where
    it does not apply is refused."""
    from ninfer.kernels.gpu import linear as glin
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("gemv_bulk needs sm_90")
    kc = kconf(activations="q8")
    make = {"q4": lambda n, kk: q4(rng, n, kk), "q4_0": lambda n, kk: q4(rng, n, kk, mins=False),
            "q8": lambda n, kk: q8(rng, n, kk)}[kind]
    k, n1, i = 4096, 6144, 4160
    pw, cw = gops.prepare_weight(make(n1, k)), gops.prepare_weight(make(2176, n1))
    ow = gops.prepare_weight(make(k, k))   # 128 segments: a short stream (bulk_short_bps)
    gw, dw = gops.prepare_weight(make(2 * i, k)), gops.prepare_weight(make(2176, i))
    x = cp.asarray((rng.standard_normal((1, k)) * 3).astype(np.float32))
    res = cp.asarray(rng.standard_normal((1, n1)).astype(np.float32))
    nw = cp.asarray((rng.random(n1) + 0.5).astype(np.float32))
    nw1 = cp.asarray((rng.random(k) + 0.5).astype(np.float32))
    assert glin.shadow_producer(kc, pw, 1) and glin.shadow_consumer(kc, cw, 1)
    assert glin.shadow_producer(kc, gw, 1, swiglu=True) and glin.shadow_consumer(kc, dw, 1)
    assert not glin.shadow_consumer(kc, cw, 2) and not glin.shadow_consumer(kc, cw, 1, gated=True)

    def poisoned(cols):
        sh = glin.new_shadow(cols)
        sh.fill(255)   # codes -1, every float NaN
        return sh

    def y(xx, w, **kw):
        out = cp.empty((1, w.shape[0]), cp.float32)
        glin.gemv(kc, xx, w, out, **kw)
        return out

    for shape in BULK_VARIANTS:
        kc = kconf(activations="q8", bulk_shape={"q8": shape})
        ref = res.copy()
        glin.gemv(kc, x, pw, ref, accumulate=True)
        for norm in (nw, None):
            sh, out = poisoned(n1), res.copy()
            glin.gemv(kc, x, pw, out, accumulate=True, shadow_out=(sh, norm, cw.sch))
            assert cp.array_equal(out, ref), shape
            want = y(ref, cw, norm=norm, eps=1e-5)
            got = y(out, cw, norm=norm, eps=1e-5, shadow_in=sh)
            if norm is None:
                assert cp.array_equal(got, want), shape
            else:
                assert rel(got, cp.asnumpy(want)) < F32, shape
        # at most one 32-row segment a multiprocessor: with a shadow out, bulk_short_bps blocks
        # a multiprocessor and a ring of one segment (where it fits), the same floats
        short = glin.bulk_config(kc, 1, k, k, ow.sch, True, qout=True)
        if shape in ((16, 2, 8, 1), (16, 2, 5, 1)) and kind != "q8" and k // 32 <= glin.sm_count():
            assert short.grid == 256 and short.stages == 4, (shape, short)
        ref = x.copy()
        glin.gemv(kc, x, ow, ref, accumulate=True)
        sh, out = poisoned(k), x.copy()
        glin.gemv(kc, x, ow, out, accumulate=True, shadow_out=(sh, nw1, pw.sch))
        assert cp.array_equal(out, ref), shape
        got = y(out, pw, norm=nw1, eps=1e-5, shadow_in=sh)
        assert rel(got, cp.asnumpy(y(ref, pw, norm=nw1, eps=1e-5))) < F32, shape
        act = cp.empty((1, i), cp.float32)
        glin.gemv(kc, x, gw, act, norm=nw1, eps=1e-5, swiglu=True)
        sh, act_sh = poisoned(i), cp.empty((1, i), cp.float32)
        glin.gemv(kc, x, gw, act_sh, norm=nw1, eps=1e-5, swiglu=True, shadow_out=(sh, None, dw.sch))
        assert cp.array_equal(act_sh, act), shape
        assert cp.array_equal(y(act_sh, dw, shadow_in=sh), y(act, dw)), shape
    kc = kconf(activations="q8")
    small = gops.prepare_weight(make(768, k))   # too few row tiles for gemv_bulk
    with pytest.raises(ValueError, match="q8 shadow"):
        y(x, small, shadow_in=poisoned(k))
    with pytest.raises(ValueError, match="q8 shadow"):
        y(x, small, shadow_out=(poisoned(768 // 64 * 64), None, 0))


@pytest.mark.parametrize("acts", ["q8", "f16"])
def test_gemv_bulk_adds_many_tiles_a_block_in_groups(gops, nops, rng, monkeypatch, acts):
    """``gemv_bulk`` adds and writes its row tiles a group (``GemvConfig.tb``, at most 2 W) at a
    time: with 18 row tiles a block at one block a multiprocessor and 9 at two (two groups, the
    last one partial, for 16x2x5x1, 16x1x4x1 and 4x1x3x2; one for the 8-warp shapes) and N not a
    multiple of 16, a residual add matches the reference for every compiled shape; with int8
    activations and a q8 shadow out (N a multiple of 64) the output is the same and the next
    GEMV's result from the shadow is bit-identical to the staged one."""
    from ninfer.kernels.gpu import linear as glin
    from ninfer.kernels.gpu import sm_count
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("gemv_bulk needs sm_90")
    k, n = 4096, sm_count() * 16 * 18 + 37
    w = q4(rng, n, k, mins=False)
    gw = gops.prepare_weight(w)
    x = (rng.standard_normal((1, k)) * 3).astype(np.float32)
    res = rng.standard_normal((1, n)).astype(np.float32)
    if acts == "f16":
        ref, bound = nops.fused_linear(x, dequantize(w), residual=res.copy()), F16_GEMM
    else:
        ref, bound = q8_activation_reference(x, w, None, res, "residual"), Q8A_EXACT
    n2 = sm_count() * 16 * 18 // 64 * 64
    pw = gops.prepare_weight(q4(rng, n2, k, mins=False))
    cw = gops.prepare_weight(q4(rng, 2176, n2, mins=False))
    res2 = cp.asarray(rng.standard_normal((1, n2)).astype(np.float32))
    for shape in BULK_VARIANTS:
        kc = kconf(activations=acts, bulk_shape={acts: shape})
        _, cfg = glin.gemv_kernel(kc, gw.sch, 1, k, glin.PRO["plain"], True, True, k, n)
        assert cfg.tb == min(16, 2 * shape[0]), (shape, cfg)
        out = cp.asarray(res)
        glin.gemv(kc, cp.asarray(x), gw, out, accumulate=True)
        assert rel(out, ref) < bound, shape
        if acts == "q8":
            staged = res2.copy()
            glin.gemv(kc, cp.asarray(x), pw, staged, accumulate=True)
            sh, out2 = glin.new_shadow(n2), res2.copy()
            sh.fill(255)   # codes -1, every float NaN
            glin.gemv(kc, cp.asarray(x), pw, out2, accumulate=True, shadow_out=(sh, None, cw.sch))
            assert cp.array_equal(out2, staged), shape
            want, got = cp.empty((1, 2176), cp.float32), cp.empty((1, 2176), cp.float32)
            glin.gemv(kc, staged, cw, want)
            glin.gemv(kc, out2, cw, got, shadow_in=sh)
            assert cp.array_equal(got, want), shape


def _prefilled(rng, config, kernel_configs: dict):
    """Llama models of ``config`` on the GPU with the same weights, one per kernel config of
    ``kernel_configs`` (key -> ``KernelConfig``), each with the same 20-token prompt prefilled
    into its own 8-page KV cache, and the batch of one decode step after it: ({key: (ops, model,
    kv)}, step)."""
    from ninfer.engine.models.llama import ForwardBatch, LlamaConfig, LlamaModel
    weights = _tiny_weights(rng, config)
    prompt = rng.integers(0, 512, 20).tolist()
    table = list(range(8))
    out = {}
    for key, kc in kernel_configs.items():
        ops = get_ops("cupy", kc)
        model = LlamaModel(LlamaConfig.from_dict(config), weights, ops)
        kv = model.new_kv_cache(8, 16)
        model.forward(ForwardBatch.from_sequences([prompt], [0], [table], 16), kv)
        out[key] = (ops, model, kv)
    return out, ForwardBatch.from_sequences([[7]], [20], [table], 16)


SHADOW_MODEL = dict(vocab_size=512, hidden_size=4096, num_hidden_layers=2,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                    intermediate_size=4160, rope_theta=10000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=False)


@pytest.mark.parametrize("cluster", [0, 8])
def test_llama_decode_with_q8_shadows_matches_staging(rng, monkeypatch, cluster):
    """A decode step of a two-layer 8B-width model whose GEMVs take ``gemv_bulk`` hands the
    activations on as q8 shadows (o -> gate_up, gate_up -> down, down -> the next qkv; from
    ``attn_merge`` to o where the attention has splits: in the graph, captured for 128
    positions; or from the attention's cluster merge, ``cluster``) and gives the logits of the
    staged path within the rounding of the RMSNorm's sum of squares, eagerly and from a CUDA
    graph."""
    from ninfer.kernels.gpu import attention as gattn
    from ninfer.kernels.gpu import linear as glin
    from ninfer.kernels.gpu.graphs import CudaGraphDecoder
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("gemv_bulk needs sm_90")
    kc = kconf(decode_attention="rope", attn_cluster=cluster)
    runs, step = _prefilled(rng, SHADOW_MODEL, {on: replace(kc, q8_shadow=on)
                                                 for on in (False, True)})
    calls = []
    real_gemv = glin.gemv

    def counting(*a, **kw):
        calls.append((kw.get("shadow_in") is not None, kw.get("shadow_out") is not None))
        return real_gemv(*a, **kw)

    monkeypatch.setattr(glin, "gemv", counting)
    out = {}
    merged = gattn.merge_shadow(kc, 1, 32, 8, 128, np.array([21]), True)  # splits at 21
    for on in (False, True):
        _, model, kv = runs[on]
        calls.clear()
        out[on] = cp.asnumpy(model.forward(step, kv))   # rewrites the same KV row
        # gate_up and down of both layers, the second qkv, and o where attn_merge runs
        # (lm_head, 512 rows, is not gemv_bulk; the first qkv reads the embedding)
        assert sum(i for i, _ in calls) == ((5 + 2 * merged) if on else 0), calls
        assert sum(o for _, o in calls) == sum(i for i, _ in calls) - (2 * merged if on else 0)
        graph = CudaGraphDecoder(model, max_pages=8, buckets=(1,))
        calls.clear()
        graph.capture_all(kv)
        out[on, "graph"] = cp.asnumpy(graph.forward(step, kv))
        # every pass of the capture: 128 positions, so the attention splits hand on to o too
        assert calls and sum(i for i, _ in calls) == (7 * len(calls) // 9 if on else 0), calls
    assert not np.isnan(out[True]).any()
    assert rel(out[True], out[False]) < 2e-3
    assert rel(out[True, "graph"], out[False, "graph"]) < 2e-3
    assert rel(out[True, "graph"], out[True]) < 2e-3


SWIGLU_MODEL = dict(vocab_size=512, hidden_size=4096, num_hidden_layers=1,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                    intermediate_size=2176, rope_theta=10000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=False)


def test_llama_decode_with_the_swiglu_epilogue_is_bit_identical(rng, monkeypatch):
    """A decode step of a one-layer 8B-width model (its gate_up takes ``gemv_bulk``) gives the
    very same logits with the SwiGLU epilogue (``KernelConfig.swiglu_epilogue``: the act (1, I)
    into a plain down GEMV) as with the SiLU in down's prologue, eagerly and from a CUDA
    graph."""
    from ninfer.kernels.gpu import linear as glin
    from ninfer.kernels.gpu.graphs import CudaGraphDecoder
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("gemv_bulk needs sm_90")
    runs, step = _prefilled(rng, SWIGLU_MODEL, {on: kconf(swiglu_epilogue=on)
                                                 for on in (False, True)})
    out = {}
    for on in (False, True):
        ops, model, kv = runs[on]
        assert glin.swiglu_epilogue(ops.config, model.layers[0].gate_up, 1) == on
        out[on] = cp.asnumpy(model.forward(step, kv))   # rewrites the same KV row
        graph = CudaGraphDecoder(model, max_pages=8, buckets=(1,))
        graph.capture_all(kv)
        out[on, "graph"] = cp.asnumpy(graph.forward(step, kv))
    assert not np.isnan(out[True]).any()
    assert np.array_equal(out[True], out[False])
    assert np.array_equal(out[True, "graph"], out[False, "graph"])
    # the graph was captured for 128 positions: more attention splits than eager at 21, so the
    # last bits differ (as in test_programmatic_dependent_launch_changes_nothing)
    assert rel(out[True, "graph"], out[True]) < F32


@pytest.mark.parametrize("kind", ["q4", "q4_0", "q8"])
def test_device_packing_equals_the_numpy_layout(rng, kind):
    """The device repacking gives the very bytes of ``mma_layout``'s NumPy packing (which the CPU
    tests check against the dense weight and the fragment layout)."""
    from ninfer.kernels import mma_layout as ml
    from ninfer.kernels.gpu import linear as glin
    n, k, group = 45, 320, 64
    w = {"q4": lambda: q4(rng, n, k, group=group),
         "q4_0": lambda: q4(rng, n, k, mins=False, group=group),
         "q8": lambda: q8(rng, n, k, group=group)}[kind]()
    gw = glin.upload(w)
    pack = ml.pack_q4 if w.scheme == "q4" else ml.pack_q8
    assert np.array_equal(cp.asnumpy(gw.codes), pack(w.codes, n, k))
    assert np.array_equal(cp.asnumpy(gw.scales), ml.pack_scales(w.scales, w.mins, n, k, group))


@pytest.mark.parametrize("kind", ["q4", "q4_0", "q8"])
@pytest.mark.parametrize("n,k", [(45, 320), (1000, 576), (16, 96)])
def test_dequantize_f16_equals_the_numpy_weight(rng, kind, n, k):
    """The prefill GEMM's fp16 operand (``gemm.dequantize_f16``): every element of the packed
    weight, rows past a 16-row tile and a half chunk included, is ``quant.dequantize``'s float32
    rounded to fp16, bit for bit; nothing past (N, K) is written."""
    from ninfer.kernels.gpu import gemm as ggemm
    from ninfer.kernels.gpu import linear as glin
    w = {"q4": lambda: q4(rng, n, k), "q4_0": lambda: q4(rng, n, k, mins=False),
         "q8": lambda: q8(rng, n, k)}[kind]()
    out = cp.full(n * k + 64, np.nan, dtype=cp.float16)
    ggemm.dequantize_f16(glin.upload(w), out)
    got = cp.asnumpy(out)
    assert np.array_equal(got[:n * k].view(np.uint16),
                          dequantize(w).astype(np.float16).reshape(-1).view(np.uint16)), kind
    assert np.isnan(got[n * k:]).all()


def test_fused_linear_same_and_mixed(gops, rng):
    k = 576
    parts = [q4(rng, 576, k), q4(rng, 192, k), q4(rng, 192, k)]
    mixed = [q4(rng, 576, k), q8(rng, 192, k), f32(rng, 192, k)]
    for ts in (parts, mixed):
        x = rng.standard_normal((3, k)).astype(np.float32)
        ref = x.astype(np.float64) @ np.concatenate([dequantize(t) for t in ts]).T
        got = gops.linear(cp.asarray(x), gops.prepare_fused(ts))
        assert rel(got, ref) < lin_bound(gops.config, 3)


def test_write_kv(gops, nops, rng):
    pages, ps, nkv, hd, t = 9, 16, 3, 64, 21
    kc = rng.standard_normal((pages, ps, nkv, hd)).astype(np.float32)
    vc = rng.standard_normal((pages, ps, nkv, hd)).astype(np.float32)
    qkv = rng.standard_normal((t, 15 * hd)).astype(np.float32)
    k, v = qkv[:, 9 * hd:12 * hd].reshape(t, nkv, hd), qkv[:, 12 * hd:].reshape(t, nkv, hd)
    slots = rng.permutation(pages * ps)[:t].astype(np.int64)
    slots[3] = -1
    kd, vd, qd = cp.asarray(kc), cp.asarray(vc), cp.asarray(qkv)
    nops.write_kv(kc, vc, k, v, slots)
    gops.write_kv(kd, vd, qd[:, 9 * hd:12 * hd].reshape(t, nkv, hd),
                  qd[:, 12 * hd:].reshape(t, nkv, hd), slots)
    assert np.array_equal(cp.asnumpy(kd), kc) and np.array_equal(cp.asnumpy(vd), vc)
    with pytest.raises(IndexError):
        gops.write_kv(kd, vd, qd[:1, :nkv * hd].reshape(1, nkv, hd),
                      qd[:1, :nkv * hd].reshape(1, nkv, hd), np.array([pages * ps], np.int64))


def _attn_case(rng, q_lens, ctx, nh, nkv, hd, ps=16):
    s = len(q_lens)
    need = [-(-c // ps) for c in ctx]
    num_pages = sum(need) + 3
    perm = rng.permutation(num_pages)
    tables = np.full((s, max(need) + 2), -1, np.int32)
    o = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[o:o + n]
        o += n
    kc = rng.standard_normal((num_pages, ps, nkv, hd)).astype(np.float32)
    vc = rng.standard_normal((num_pages, ps, nkv, hd)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), nh, hd)).astype(np.float32) * 2
    return q, kc, vc, cu, np.asarray(ctx, np.int32), tables


@pytest.mark.parametrize("q_lens,ctx,nh,nkv,hd", [
    ([1], [1], 9, 3, 64),                               # first token
    ([1, 1, 1], [17, 300, 5000], 9, 3, 64),             # decode, split-K on the long one
    ([1] * 8, [40, 1, 99, 700, 33, 2048, 16, 17], 32, 8, 128),  # Llama-3-8B heads
    ([1, 1], [100, 3000], 8, 8, 64),                    # MHA
    ([37], [37], 9, 3, 64),                             # prefill from empty
    ([50, 1, 7], [120, 9, 7], 32, 8, 128),              # prefill after a cached prefix, mixed
    ([300], [1000], 4, 1, 32),                          # MQA, long chunk
    ([1500, 3], [1500, 70], 32, 8, 128),                # 8B heads, 24 KV tiles, a short one
    ([130, 1, 61], [700, 5, 64], 16, 2, 256),           # head dim 256, G 8, mixed
])
@pytest.mark.parametrize("prefill_kernel", ["mma", "mma-32-smemq", "mma-64-regq", "mma-32-8w",
                                            "mma-64-8w", "fp32"])
def test_paged_attention(gops, rng, monkeypatch, q_lens, ctx, nh, nkv, hd, prefill_kernel):
    """Decode (split-K) and prefill / mixed attention against the float64 reference, both
    prefill kernels (``KernelConfig.prefill_attention``: tensor cores with fp16 operands, in the
    default tiling and, at head dim 128, others of ``prefill_mma_tiling``, 8-warp blocks at head
    dims 128 and 256 too; or float32)."""
    if max(q_lens) == 1 and prefill_kernel != "mma":
        pytest.skip("decode: the prefill kernel is not used")
    if prefill_kernel.startswith("mma-") and hd not in ((128, 256) if "8w" in prefill_kernel
                                                        else (128,)):
        pytest.skip("other tilings: head dim 128 only (a module build per tiling and head dim)")
    tilings = {}
    if prefill_kernel.startswith("mma-"):
        tiling = {"mma-32-smemq": (32, False, 4), "mma-64-regq": (64, True, 1),
                  "mma-32-8w": (32, False, 1, 8), "mma-64-8w": (64, False, 1, 8)}[prefill_kernel]
        tilings = {hd: tiling}
    gops = get_ops("cupy", kconf(prefill_mma_tiling=tilings,
                                 prefill_attention=prefill_kernel.split("-")[0]))
    q, kc, vc, cu, lens, bt = _attn_case(rng, q_lens, ctx, nh, nkv, hd)
    ref = ref_attention(q.astype(np.float64), kc.astype(np.float64), vc.astype(np.float64),
                        cu, lens, bt, hd ** -0.5)
    # q arrives as a strided view, like the model's slice of the rope output
    qpad = cp.asarray(np.concatenate([q, np.zeros((q.shape[0], 2, hd), np.float32)], axis=1))
    out = gops.paged_attention(qpad[:, :nh], cp.asarray(kc), cp.asarray(vc), cu, lens, bt,
                               hd ** -0.5)
    err = rel(out, ref)
    fp16 = max(q_lens) > 1 and prefill_kernel != "fp32"
    assert err < (F16_ATTN if fp16 else F32), err
    if fp16:
        assert err > F32 / 10   # (it did run in fp16)


@pytest.mark.parametrize("q_lens,ctx,nh,nkv,hd,splits", [
    ([4], [4000], 24, 4, 256, None),                    # a verify pass at depth (Qwen3.5 27B)
    ([4, 4, 0, 2], [64, 3000, 5, 9], 24, 4, 256, None),   # lanes of a batch, one with no rows
    ([2, 1, 8], [2, 700, 1500], 32, 8, 128, None),      # Llama-3-8B heads, up to 8 rows
    ([3] * 34, [50 + i for i in range(34)], 32, 8, 128, 1),   # one split: the output direct
    ([8], [2020], 32, 8, 128, 32),   # rows' partitions of 63 and 64 positions (2013..2020 / 32)
    ([6, 3], [900, 1500], 24, 4, 256, 7),   # likewise: 895..900 / 7 (128 and 129), 1498..1500
])
def test_verify_rows_take_the_decode_split_k(gops, rng, monkeypatch, q_lens, ctx, nh, nkv, hd,
                                             splits):
    """A pass of at most ``verify_rows`` query rows a sequence reads each sequence's KV once for
    all its rows (``attn_verify``, a warp a row) and merges the splits as ``attn_decode``'s
    one-row sequences (``attn_rows``), or with ``verify_shared_kv`` off runs ``attn_decode``
    with each row as such a sequence: float32 against the float64 reference either way (the
    prefill kernel's fp16 operands would not pass), twice the same floats; ``verify_rows=0``
    takes the prefill kernel again."""
    from ninfer.kernels.gpu import attention as gattn
    q, kc, vc, cu, lens, bt = _attn_case(rng, q_lens, ctx, nh, nkv, hd)
    ref = ref_attention(q.astype(np.float64), kc.astype(np.float64), vc.astype(np.float64),
                        cu, lens, bt, hd ** -0.5)
    kd, vd = cp.asarray(kc), cp.asarray(vc)
    if splits is not None:   # (the host's choice depends on the multiprocessor count)
        monkeypatch.setattr(gattn, "_decode_split", lambda *a: splits)
    rows_calls, lookups = [], []
    real, real_function = gattn._rows_as_sequences, gattn.function
    monkeypatch.setattr(gattn, "_rows_as_sequences",
                        lambda *a: rows_calls.append(1) or real(*a))
    monkeypatch.setattr(gattn, "function", lambda name, fname, names=():
                        lookups.append(fname) or real_function(name, fname, names))
    out = gops.paged_attention(cp.asarray(q), kd, vd, cu, lens, bt, hd ** -0.5)
    assert rows_calls and rel(out, ref) < F32
    assert f"attn_verify<float,{hd},{nh // nkv}>" in lookups
    assert cp.array_equal(out, gops.paged_attention(cp.asarray(q), kd, vd, cu, lens, bt,
                                                    hd ** -0.5))
    lookups.clear()
    per_row = get_ops("cupy", kconf(verify_shared_kv=False))
    err = rel(per_row.paged_attention(cp.asarray(q), kd, vd, cu, lens, bt, hd ** -0.5), ref)
    assert err < F32 and f"attn_decode<float,{hd},{nh // nkv},false,false>" in lookups
    assert not any(f.startswith("attn_verify") for f in lookups)
    off = get_ops("cupy", kconf(verify_rows=0))
    rows_calls.clear()
    err = rel(off.paged_attention(cp.asarray(q), kd, vd, cu, lens, bt, hd ** -0.5), ref)
    assert not rows_calls and F32 / 10 < err < F16_ATTN


@pytest.mark.parametrize("ctx,nh,nkv,hd,rotary_dim,style", [
    ([1], 9, 3, 64, None, "half"),                                   # first token, one split
    ([17, 300, 5000], 9, 3, 64, None, "half"),                       # split-K, merged by a block
    ([40, 1, 99, 700, 33, 2048, 16, 17], 32, 8, 128, None, "half"),  # Llama-3-8B heads, a batch
    ([100, 3000], 8, 8, 64, 32, "adjacent"),                         # MHA, partial rotary
    ([66], 32, 8, 128, None, "half"),                                # batch 1, several splits
    ([4096], 8, 1, 256, None, "adjacent"),                           # MQA: 64 splits, G 8
])
def test_rope_paged_attention_decode_equals_rope_write_kv_then_paged_attention(
        gops, nops, rng, monkeypatch, ctx, nh, nkv, hd, rotary_dim, style):
    """The fused decode kernel (RoPE of q and the new k, the KV write, attention, the merge of
    the splits by the last block), and the two-kernel form ("rope": attn_merge merges), against
    the three kernels they replace: attention output and
    both caches bit-identical (a negative slot writes nothing), the arrival counters back at
    zero, the same again on a second call; and against the NumPy reference within float32."""
    from ninfer.kernels.gpu import attention as gattn
    fused_calls = []
    real = gattn.rope_paged_attention
    monkeypatch.setattr(gattn, "rope_paged_attention",
                        lambda *a, **kw: fused_calls.append(1) or real(*a, **kw))
    s = len(ctx)
    _, kc, vc, cu, lens, bt = _attn_case(rng, [1] * s, ctx, nh, nkv, hd)
    qkv = rng.standard_normal((s, (nh + 2 * nkv) * hd)).astype(np.float32)
    pos = (lens - 1).astype(np.int32)
    ps = kc.shape[1]
    slots = np.array([bt[i, (n - 1) // ps] * ps + (n - 1) % ps for i, n in enumerate(ctx)],
                     np.int64)
    slots[-1] = -1 if s > 1 else slots[-1]        # a padded lane: no KV write
    args = (nh, nkv, pos, 500000.0)
    tail = (cu, lens, bt, hd ** -0.5, style, rotary_dim)
    ref_k, ref_v = kc.copy(), vc.copy()
    ref = nops.rope_paged_attention(qkv, *args, ref_k, ref_v, slots, *tail)
    out = {}
    # "rope": RoPE and the KV write in the attention kernel, the merge in attn_merge (the
    # clusters' merge partitions differently: test_cluster_merged_decode_attention)
    for mode in ("off", "on", "on", "rope", "rope"):
        ops = get_ops("cupy", kconf(attn_cluster=0, decode_attention=mode))
        k, v = cp.asarray(kc), cp.asarray(vc)
        o = ops.rope_paged_attention(cp.asarray(qkv), *args, k, v, slots, *tail)
        out.setdefault(mode, []).append((cp.asnumpy(o), cp.asnumpy(k), cp.asnumpy(v)))
        assert not cp.any(gattn._arrivals())
    assert len(fused_calls) == 4                  # the fused kernels ran (no fallback)
    if nkv == 1:                                  # the most splits the merge takes
        assert gattn._decode_split(s, nkv, max(ctx)) == gattn.MAX_SPLITS
    (o0, k0, v0), = out["off"]
    for o1, k1, v1 in out["on"] + out["rope"]:
        assert np.array_equal(o1, o0) and np.array_equal(k1, k0) and np.array_equal(v1, v0)
    assert rel(o0, ref) < F32 and rel(k0, ref_k) < 2e-5 and rel(v0, ref_v) == 0.0
    # "auto" (the default): one kernel unless an o projection of this width takes gemv_bulk;
    # there RoPE in the attention kernel, the merge in attn_merge
    ops = get_ops("cupy", kconf(attn_cluster=0, decode_attention="auto"))
    sm90 = int(cp.cuda.Device().compute_capability) >= 90
    bulk_mode = "rope"
    assert ops._decode_attention_mode(576, 1) == "on"
    assert ops._decode_attention_mode(4096, 1) == (bulk_mode if sm90 else "on")
    assert ops._decode_attention_mode(4096, 2) == "on"   # no gemv_bulk for two rows
    with pytest.raises(ValueError, match="auto, on, rope or off"):
        kconf(decode_attention="yes")
    if s > 1:   # the padded lane's page is untouched
        page = bt[-1, (ctx[-1] - 1) // ps]
        assert np.array_equal(k0[page], kc[page]) and np.array_equal(v0[page], vc[page])


@pytest.mark.parametrize("ctx,cl,cap", [
    (3, 8, 64),      # one cluster, one active block, the others empty
    (66, 8, 64),     # one cluster, five active blocks
    (200, 16, 64),   # one cluster of 16 (non-portable size)
    (130, 4, 64),    # one cluster of 4, three positions past the granule
    (1500, 8, 64),   # three clusters: merged through global memory by the last block
    (700, 16, 16),   # several clusters of 16
])
def test_cluster_merged_decode_attention(gops, nops, rng, monkeypatch, ctx, cl, cap):
    """``rope_paged_attention`` of a batch-1 decode with 8B heads whose split partials are
    merged by thread block clusters (``KernelConfig.attn_cluster``: one kernel, through distributed
    shared memory while one cluster covers the context, else by the last block): the output
    within float32 of the NumPy reference and of attn_merge's, the KV caches bit-identical, the
    arrival counters back at zero, the same bits on a second call, and the q8 shadow it writes
    for the o GEMV gives that GEMV's result bit for bit (NaN-poisoned before each run)."""
    from ninfer.kernels.gpu import attention as gattn
    from ninfer.kernels.gpu import launch as gl
    from ninfer.kernels.gpu import linear as glin
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("thread block clusters need sm_90")
    conf = kconf(activations="q8", cluster_part_cap=cap)
    nh, nkv, hd = 32, 8, 128
    _, kc, vc, cu, lens, bt = _attn_case(rng, [1], [ctx], nh, nkv, hd)
    qkv = rng.standard_normal((1, (nh + 2 * nkv) * hd)).astype(np.float32)
    pos = (lens - 1).astype(np.int32)
    ps = kc.shape[1]
    slots = np.array([bt[0, (ctx - 1) // ps] * ps + (ctx - 1) % ps], np.int64)
    ref_k, ref_v = kc.copy(), vc.copy()
    ref = nops.rope_paged_attention(qkv, nh, nkv, pos, 500000.0, ref_k, ref_v, slots, cu, lens,
                                    bt, hd ** -0.5, "half", None)
    ow = gops.prepare_weight(q4(rng, nh * hd, nh * hd))
    assert glin.shadow_consumer(conf, ow, 1)
    launched = []
    real_launch = gattn.launch
    monkeypatch.setattr(gattn, "launch", lambda fn, grid, block, args, **kw: launched.append(
        (grid, kw.get("cluster", 0))) or real_launch(fn, grid, block, args, **kw))
    out = {}
    for c in (0, cl, cl):
        conf = replace(conf, attn_cluster=c)
        assert gattn._cluster(conf, 1, nkv, nh // nkv, hd) == (c if gl.clusters_available() else 0)
        assert gattn.merge_shadow(conf, 1, nh, nkv, hd, lens, True) == (c > 0 or ctx > 32)
        k, v = cp.asarray(kc), cp.asarray(vc)
        sh = glin.new_shadow(nh * hd)
        sh.fill(255)
        launched.clear()
        o = gattn.rope_paged_attention(
            conf, cp.asarray(qkv), nh, cp.asarray(pos), gops._rope_freq(hd, 500000.0, None), 0, hd,
            cp.asarray(slots), k, v, lens, cp.asarray(cu), cp.asarray(lens), cp.asarray(bt),
            hd ** -0.5, merge_kernel=True,
            shadow_out=(sh, ow.sch) if gattn.merge_shadow(conf, 1, nh, nkv, hd, lens, True)
            else None)
        assert not cp.any(gattn._arrivals())
        if c:   # one kernel, in clusters along the splits
            assert len(launched) == 1 and launched[0][1] == c and launched[0][0][2] % c == 0
            y_out, y_sh = cp.empty((1, nh * hd), cp.float32), cp.empty((1, nh * hd), cp.float32)
            glin.gemv(conf, o.reshape(1, -1), ow, y_out)
            glin.gemv(conf, o.reshape(1, -1), ow, y_sh, shadow_in=sh)
            assert cp.array_equal(y_sh, y_out)
        out.setdefault(c, []).append((cp.asnumpy(o), cp.asnumpy(k), cp.asnumpy(v)))
    (o0, k0, v0), = out[0]
    (o1, k1, v1), (o2, k2, v2) = out[cl]
    assert np.array_equal(o1, o2) and np.array_equal(k1, k0) and np.array_equal(v1, v0)
    assert np.array_equal(k2, k0) and np.array_equal(v2, v0)
    assert rel(o1, ref) < F32 and rel(o1, o0) < F32 and rel(k0, ref_k) < 2e-5


@pytest.mark.parametrize("ctx,nh,nkv,hd,rotary_dim,kv", [
    ([1], 8, 2, 64, 16, "fp32"),                  # first token, one split
    ([17, 300, 5000], 8, 2, 64, None, "fp32"),    # split-K, a padded lane
    ([66], 24, 4, 256, 64, "fp32"),               # Qwen3.5-27B heads, batch 1
    ([66, 1500, 3], 24, 4, 256, 64, "fp16"),      # 27B heads over fp16 pages
    ([3, 1500], 24, 4, 256, 64, "fp16"),          # a lane of one active split writing its k
    ([4096], 16, 2, 256, 64, "fp16"),             # GQA 8, many splits
    ([1], 8, 2, 64, 16, "int8"),                  # int8 pages: the new k / v quantized in it
    ([3, 300, 66], 24, 4, 256, 64, "int8"),
    ([66], 24, 4, 256, 64, "rk4v4"),              # rk pages: the composed ops (no fusion)
])
def test_gated_paged_attention_decode_equals_the_composed_ops(gops, nops, rng, monkeypatch,
                                                               ctx, nh, nkv, hd, rotary_dim, kv):
    """The gated attention's decode in one kernel (the q / k heads' RMSNorm, RoPE, the KV write,
    the attention, the merge by the last block or by attn_merge ("rope"), the output gate) over
    strided rows, against ``norm_rope_write_kv``, ``paged_attention`` and ``sigmoid_mul``
    ("off"): output and caches bit-identical (a negative slot writes nothing), the arrival
    counters back at zero, the same on a second call; merged by thread block clusters, within
    float32 of it (they partition the context differently); fp32 pages: within float32 of the
    NumPy reference. Under a rk KV dtype (output rotated back after the kernel) nothing fuses."""
    from ninfer.kernels.gpu import attention as gattn
    from ninfer.kernels.gpu import launch as gl
    fused = []
    real = gattn.rope_paged_attention
    monkeypatch.setattr(gattn, "rope_paged_attention",
                        lambda *a, **kw: fused.append(kw.get("gated")) or real(*a, **kw))
    s, eps, theta = len(ctx), 1e-6, 1e7
    _, kc, vc, cu, lens, bt = _attn_case(rng, [1] * s, ctx, nh, nkv, hd)
    if kv == "fp16":
        kc, vc = kc.astype(np.float16), vc.astype(np.float16)
    elif kv != "fp32":   # uint8 rows of the dtype's K / V codecs
        kc, vc = codec(kv).k.encode_rows(kc), codec(kv).v.encode_rows(vc)
    width = (2 * nh + 2 * nkv) * hd
    wide = rng.standard_normal((s, width + 24)).astype(np.float32) * 2
    qkv = wide[:, 8:8 + width]                      # rows of a wider array: a row stride
    qn, kn = (rng.standard_normal(hd).astype(np.float32) * 0.5 + 1 for _ in range(2))
    pos = (lens - 1).astype(np.int32)
    ps = kc.shape[1]
    slots = np.array([bt[i, (n - 1) // ps] * ps + (n - 1) % ps for i, n in enumerate(ctx)],
                     np.int64)
    slots[-1] = -1 if s > 1 else slots[-1]        # a padded lane: no KV write
    tail = (slots, cu, lens, bt, hd ** -0.5, "half", rotary_dim, kv)

    def run(conf):
        ops = get_ops("cupy", conf)
        k, v = cp.asarray(kc), cp.asarray(vc)
        o = ops.gated_paged_attention(cp.asarray(wide)[:, 8:8 + width], nh, nkv, cp.asarray(qn),
                                      cp.asarray(kn), eps, pos, theta, k, v, *tail)
        assert o.shape == (s, nh * hd) and not cp.any(gattn._arrivals())
        return cp.asnumpy(o), cp.asnumpy(k), cp.asnumpy(v)

    o0, k0, v0 = run(kconf(attn_cluster=0, decode_attention="off"))
    assert not fused
    for mode in ("on", "on", "rope", "rope"):
        o1, k1, v1 = run(kconf(attn_cluster=0, decode_attention=mode))
        assert np.array_equal(o1, o0) and np.array_equal(k1, k0) and np.array_equal(v1, v0)
    assert fused == ([] if kv.startswith("rk") else [True] * 4)   # fused unless rk pages
    if (int(cp.cuda.Device().compute_capability) >= 90 and gl.clusters_available()
            and not kv.startswith("rk")):
        conf = kconf(attn_cluster=8, decode_attention="rope")
        assert gattn._cluster(conf, s, nkv, nh // nkv, hd) == 8
        o1, k1, v1 = run(conf)
        assert rel(o1, o0) < F32 and np.array_equal(k1, k0) and np.array_equal(v1, v0)
    if s > 1:   # the padded lane's page is untouched
        page = bt[-1, (ctx[-1] - 1) // ps]
        assert np.array_equal(k0[page], kc[page]) and np.array_equal(v0[page], vc[page])
    if kv == "fp32":
        ref_k, ref_v = kc.copy(), vc.copy()
        ref = nops.gated_paged_attention(qkv, nh, nkv, qn, kn, eps, pos, theta, ref_k, ref_v,
                                         *tail)
        assert rel(o0, ref) < F32 and rel(k0, ref_k) < 2e-5 and rel(v0, ref_v) == 0.0


@pytest.mark.parametrize("q_lens,ctx,splits,shared", [
    ([4], [68], 3, True),              # a verify pass (attn_verify), merged by attn_merge
    ([4, 4], [300, 2000], 8, False),   # verify rows as one-row sequences (attn_decode)
    ([1, 1], [17, 5000], 4, True),     # decode, split-K
    ([1], [3], 1, True),               # one split: sigmoid_mul after
    ([20], [20], None, True),          # prefill: sigmoid_mul after
])
def test_paged_attention_gates_where_the_splits_merge(gops, rng, monkeypatch, q_lens, ctx,
                                                      splits, shared):
    """The gated attention's gate (the gate halves of strided q | gate rows) given to
    ``paged_attention``: bit for bit attention then ``sigmoid_mul``; ``attn_merge`` applies it
    where it merges the splits (no ``sigmoid_mul`` launched), else ``sigmoid_mul`` runs after."""
    from ninfer.kernels.gpu import attention as gattn
    nh, nkv, hd = 24, 4, 256
    if splits is not None:
        monkeypatch.setattr(gattn, "_decode_split", lambda *a: splits)
    after = []
    real = gattn.sigmoid_mul
    monkeypatch.setattr(gattn, "sigmoid_mul", lambda *a, **kw: after.append(1) or real(*a, **kw))
    q, kc, vc, cu, lens, bt = _attn_case(rng, q_lens, ctx, nh, nkv, hd)
    t = q.shape[0]
    rows = cp.asarray(rng.standard_normal((t, 2 * nh * hd + 32)).astype(np.float32) * 3)
    gate = rows[:, :2 * nh * hd].reshape(t, nh, 2 * hd)[:, :, hd:]
    ops = get_ops("cupy", kconf(verify_shared_kv=shared))
    kd, vd = cp.asarray(kc), cp.asarray(vc)
    plain = ops.paged_attention(cp.asarray(q), kd, vd, cu, lens, bt, hd ** -0.5)
    want = ops.sigmoid_mul(plain.reshape(t, nh * hd), gate)
    got = ops._attend(cp.asarray(q), kd, vd, cu, lens, bt, hd ** -0.5, "fp32", gate)
    assert cp.array_equal(got.reshape(t, nh * hd), want)
    assert after == ([] if splits is not None and splits > 1 else [1])


def test_argmax_ties_first(gops, rng):
    x = rng.standard_normal((5, 49152)).astype(np.float32)
    x[2, 7] = x[2, 9] = 100.0
    assert list(gops.argmax(cp.asarray(x))) == list(np.argmax(x, axis=-1))
    assert gops.argmax(cp.asarray(x))[2] == 7


def test_argmax_rows_kernel_matches_numpy(gops, rng):
    """The device argmax over wide rows, a column slice (strided rows), late ties, NaN (largest,
    first one, as NumPy) and -inf rows."""
    x = rng.standard_normal((6, 128256)).astype(np.float32)
    x[0, 128000] = x[0, 5] = 50.0
    x[1, 99999] = 7.0
    x[1, 100001] = np.nan
    x[1, 70000] = np.nan
    x[2] = -np.inf
    x[3, 127] = 1e30
    d = cp.asarray(x)
    ids = gops.argmax(d)
    assert ids.dtype == np.int64
    assert list(ids) == list(np.argmax(x, axis=-1))
    assert ids[0] == 5 and ids[1] == 70000 and ids[2] == 0 and ids[3] == 127
    assert list(gops.argmax(d[:, :1000])) == list(np.argmax(x[:, :1000], axis=-1))


def test_argmax_rows_across_blocks_and_launches(gops, rng):
    """The multi-block argmax: ties across block boundaries (first wins), -0 equal to +0 (the
    first wins, as NumPy), maxima at the first / last column of a block, narrow rows (one block,
    fewer columns than threads), many rows, and the arrival counters reset for the next launch
    (every call on fresh random rows)."""
    from ninfer.kernels.gpu import elementwise as gew
    v = 128256
    nb = -(-v // gew.ARGMAX_COLS_PER_BLOCK)
    per = -(-v // nb)   # the columns of a block (the last one's fewer)
    for _ in range(3):
        x = rng.standard_normal((40, v)).astype(np.float32)
        x[0, 3 * per] = x[0, 3 * per - 1] = 9.0   # a tie across a block boundary
        x[1] = -1.0
        x[1, 5 * per + 7] = 0.0
        x[1, 2 * per + 3] = -0.0
        x[2, per] = 8.0        # a block's first column
        x[3, per - 1] = 8.0    # a block's last column
        x[4, -1] = 8.0
        x[5, [17, 60000, 128255]] = np.nan
        d = cp.asarray(x)
        got = gops.argmax(d)
        assert list(got) == list(np.argmax(x, axis=-1))
        assert got[0] == 3 * per - 1 and got[1] == 2 * per + 3 and got[5] == 17
        for w in (1, 3, 255, 2049):
            assert list(gops.argmax(d[:, :w])) == list(np.argmax(x[:, :w], axis=-1))
        o32 = cp.full(40, -5, dtype=cp.int32)
        assert np.array_equal(cp.asnumpy(gew.argmax_rows(d, out32=o32)), got)
        assert np.array_equal(cp.asnumpy(o32), got)
    with pytest.raises(ValueError):
        gew.argmax_rows(d, out32=cp.zeros(40, dtype=cp.int64))
    assert not gew.argmax_counters(40)[:40].any()


TINY = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, head_dim=32, intermediate_size=512, rope_theta=10000.0,
            rms_norm_eps=1e-5, tie_word_embeddings=False)


def _tiny_weights(rng, c):
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    qd, kd = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    w = {"model.embed_tokens.weight": q8(rng, v, h), "model.norm.weight": f32(rng, h),
         "lm_head.weight": q4(rng, v, h)}
    for L in range(c["num_hidden_layers"]):
        p = f"model.layers.{L}."
        w[p + "input_layernorm.weight"] = f32(rng, h)
        w[p + "post_attention_layernorm.weight"] = f32(rng, h)
        for name, shape in (("self_attn.q_proj", (qd, h)), ("self_attn.k_proj", (kd, h)),
                            ("self_attn.v_proj", (kd, h)), ("self_attn.o_proj", (h, qd)),
                            ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)),
                            ("mlp.down_proj", (h, i))):
            w[p + name + ".weight"] = q4(rng, *shape, mins=L == 0)
    return w


@pytest.mark.parametrize("acts", ["q8", "f16"])
def test_tiny_model_forward_matches_numpy(rng, monkeypatch, acts):
    """Ragged prefill of three prompts, then two decode steps (int8 or fp16 activations in the
    decode GEMVs; the decode logits' bound follows)."""
    from ninfer.engine.models.llama import ForwardBatch, LlamaConfig, LlamaModel
    # (q8a_max_t 8: the 3-row decode steps take gemv_q8a too)
    kc = kconf(activations=acts, q8a_max_t=8)
    c = LlamaConfig.from_dict(TINY)
    w = _tiny_weights(rng, TINY)
    models = [LlamaModel(c, w, get_ops(b, kc)) for b in ("numpy", "cupy")]
    kvs = [m.new_kv_cache(64, 16) for m in models]
    prompts = [rng.integers(0, 512, size=n).tolist() for n in (40, 7, 90)]
    tables = [[0, 1, 2, 3], [4], [5, 6, 7, 8, 9, 10]]
    # prefill all three (ragged), then two decode steps
    b = ForwardBatch.from_sequences(prompts, [0, 0, 0], tables, 16)
    outs = [m.forward(b, kv) for m, kv in zip(models, kvs)]
    assert rel(outs[1], outs[0]) < (5 * Q8A if acts == "q8" else F16_GEMM)  # logits: T = 3
    for step in range(2):
        b = ForwardBatch.from_sequences([[3], [5], [7]], [len(p) + step for p in prompts],
                                        tables, 16)
        outs = [m.forward(b, kv) for m, kv in zip(models, kvs)]
        err = rel(outs[1], outs[0])
        print(f"decode step {step} ({acts} activations): relative logit error {err:.2e}")
        assert err < (5 * Q8A if acts == "q8" else F16_GEMM)


PROMPTS = ["What is the capital of France?", "Write a haiku about autumn.",
           "List three prime numbers.", "Explain what a CPU does in one sentence.",
           "Translate 'good morning' into Spanish."]


@pytest.mark.slow
@pytest.mark.parametrize("acts,max_margin", [("f16", 0.05), ("q8", 0.5)])
def test_smollm2_greedy_gpu_equals_cpu(smollm2_gguf, acts, max_margin):
    """Greedy SmolLM2 tokens on the GPU equal the CPU's for 5 prompts; where they do not, the
    first divergence must be a near-tie on the CPU logits (margin between the two tokens below
    0.05 with fp16 decode activations, 0.5 with int8 ones), and is reported."""
    from ninfer.engine.models.llama import ForwardBatch, LlamaModel
    from ninfer.server import load_runtime
    from ninfer.store.artifact import load_model_file
    art = load_model_file(smollm2_gguf)
    rt = load_runtime(str(smollm2_gguf), "numpy")
    models = [rt.model, LlamaModel.from_artifact(art, get_ops("cupy", kconf(activations=acts)))]
    report = []
    for text in PROMPTS:
        ids = rt.tokenizer.encode(rt.template.render([{"role": "user", "content": text}]))
        seqs, margins = [], []
        for m in models:
            ops = m.ops
            kv = m.new_kv_cache(16, 16)
            toks = list(ids)
            out_l = []
            for step in range(24):
                start = 0 if step == 0 else len(toks) - 1
                b = ForwardBatch.from_sequences([toks[start:]], [start],
                                                [list(range(16))], 16)
                logits = ops.to_numpy(m.forward(b, kv))[0]
                out_l.append(logits)
                toks.append(int(np.argmax(logits)))
            seqs.append(toks[len(ids):])
            margins.append(out_l)
        if seqs[0] != seqs[1]:
            i = next(j for j, (a, b) in enumerate(zip(*seqs)) if a != b)
            cpu = margins[0][i]
            margin = float(cpu[seqs[0][i]] - cpu[seqs[1][i]])
            report.append((text, i, margin))
            assert margin < max_margin, (text, i, margin)
    print(f"greedy divergences ({acts}; prompt, index, cpu logit margin):", report)


@pytest.mark.parametrize("attention", ["on", "rope", "off"])
def test_programmatic_dependent_launch_changes_nothing(rng, monkeypatch, attention):
    """The decode kernels launched with PDL (``gpu.launch``, sm_90+) give bit-identical logits to
    ordinary launches, eagerly and replayed from a CUDA graph, with each form of the decode
    attention (the fused ones load their first cached K / V rows before griddepcontrol.wait,
    while the qkv GEMV runs)."""
    from ninfer.engine.models.llama import ForwardBatch, LlamaConfig, LlamaModel
    from ninfer.kernels.gpu import launch as gl
    from ninfer.kernels.gpu.graphs import CudaGraphDecoder
    if int(cp.cuda.Device().compute_capability) >= 90:
        assert gl.available()
    c = LlamaConfig.from_dict(TINY)
    w = _tiny_weights(rng, TINY)
    prompts = [rng.integers(0, 512, size=n).tolist() for n in (12, 30)]
    tables = [[0, 1, 2], [3, 4, 5]]
    results = {}
    for enabled in (False, True):
        model = LlamaModel(c, w, get_ops("cupy", kconf(decode_attention=attention,
                                                       pdl=enabled)))
        for graph in (False, True):
            dec = CudaGraphDecoder(model, max_pages=8, enabled=graph)
            kv = dec.new_kv_cache(8, 16)
            dec.forward(ForwardBatch.from_sequences(prompts, [0, 0], tables, 16), kv)
            outs = []
            for step in range(3):
                b = ForwardBatch.from_sequences([[3 + step], [9]], [len(p) + step for p in prompts],
                                                tables, 16)
                outs.append(cp.asnumpy(dec.forward(b, kv)))
            results[enabled, graph] = np.stack(outs)
    # (a graph is captured for the longest context, so its attention splits, and its last
    # bits, differ from the eager pass: compare PDL on / off within each mode)
    for graph in (False, True):
        assert np.array_equal(results[True, graph], results[False, graph])
    assert rel(results[True, True], results[True, False]) < F32


@pytest.mark.parametrize("enabled", [True, False])
def test_cuda_graph_decode_matches_plain(rng, enabled):
    """Graph replays (and the eager padded schedule) give the plain forward's logits, for
    batch sizes that hit a bucket exactly and that need padding, as contexts grow."""
    from ninfer.engine.models.llama import ForwardBatch, LlamaConfig, LlamaModel
    from ninfer.kernels.gpu.graphs import CudaGraphDecoder
    c = LlamaConfig.from_dict(TINY)
    w = _tiny_weights(rng, TINY)
    plain = LlamaModel(c, w, get_ops("cupy"))
    graphed = CudaGraphDecoder(LlamaModel(c, w, get_ops("cupy")), max_pages=8, enabled=enabled)
    kvs = [plain.new_kv_cache(64, 16), graphed.new_kv_cache(64, 16)]
    for s in (1, 3, 4):
        prompts = [rng.integers(0, 512, size=n).tolist() for n in (5, 20, 33, 17)[:s]]
        tables = [[8 * i + j for j in range(8)] for i in range(s)]
        b = ForwardBatch.from_sequences(prompts, [0] * s, tables, 16)
        for m, kv in zip((plain, graphed), kvs):
            m.forward(b, kv)
        for step in range(3):
            toks = rng.integers(0, 512, size=s).tolist()
            b = ForwardBatch.from_sequences([[t] for t in toks],
                                            [len(p) + step for p in prompts], tables, 16)
            ref = cp.asnumpy(plain.forward(b, kvs[0]))
            got = cp.asnumpy(graphed.forward(b, kvs[1]))
            assert got.shape == ref.shape
            assert rel(got, ref) < F32
    assert graphed.replays == (9 if enabled else 0)


@pytest.mark.parametrize("enabled", [True, False])
def test_prefill_passes_replayed_from_padded_graphs_equal_the_plain_passes(rng, enabled):
    """Single-sequence prefill passes of up to the chunk (``prefill_graphs(48)``: lengths 16,
    32, 48) replay the graph of the first length >= theirs, padded in front: the logits and
    the KV rows written equal the plain unpadded passes' within float32 rounding (a GEMM may
    sum in another order at another width), from the first pass (its padding rows see no key)
    to depth, over caches poisoned with NaN; a pass of up to ``verify_rows`` rows, a longer pass and
    a two-sequence batch run eagerly; decode after them agrees. Without graphs, prefill passes run unpadded."""
    from ninfer.engine.models.llama import ForwardBatch, LlamaConfig, LlamaModel
    from ninfer.kernels.gpu.graphs import CudaGraphDecoder
    c = LlamaConfig.from_dict(TINY)
    w = _tiny_weights(rng, TINY)
    plain = LlamaModel(c, w, get_ops("cupy"))
    graphed = CudaGraphDecoder(LlamaModel(c, w, get_ops("cupy")), max_pages=12, enabled=enabled)
    assert graphed.prefill_graphs(48) == (16, 32, 48)
    kvs = [plain.new_kv_cache(64, 16), graphed.new_kv_cache(64, 16)]
    for kv in kvs:
        for a in kv.k + kv.v:
            a[...] = cp.nan
    prompt = rng.integers(0, 512, size=150).tolist()
    table = [list(range(12))]
    # 20 tokens in 32 (12 padding rows at positions below 0), 48 exactly, 6 eagerly (up to
    # verify_rows: the verify attention), 12 in 16, 64 eagerly
    for a, b in ((0, 20), (20, 68), (68, 74), (74, 86), (86, 150)):
        batch = ForwardBatch.from_sequences([prompt[a:b]], [a], table, 16)
        ref = cp.asnumpy(plain.forward(batch, kvs[0]))
        got = cp.asnumpy(graphed.forward(batch, kvs[1]))
        assert got.shape == ref.shape == (1, c.vocab_size) and np.isfinite(got).all()
        assert rel(got, ref) < F32, (a, b)
    for x, y in zip(kvs[0].k + kvs[0].v, kvs[1].k + kvs[1].v):
        # (150 positions: pages 0-9; the unwritten rest of page 9 stays NaN in both)
        np.testing.assert_allclose(cp.asnumpy(y[:10]), cp.asnumpy(x[:10]), rtol=1e-5,
                                   atol=1e-5, equal_nan=True)
    two = ForwardBatch.from_sequences([prompt[:48], prompt[48:96]], [0, 0],
                                      [[20, 21, 22], [23, 24, 25]], 16)
    assert np.array_equal(cp.asnumpy(graphed.forward(two, kvs[1])),
                          cp.asnumpy(plain.forward(two, kvs[0])))
    step = ForwardBatch.from_sequences([[7]], [150], table, 16)
    assert rel(cp.asnumpy(graphed.forward(step, kvs[1])),
               cp.asnumpy(plain.forward(step, kvs[0]))) < F32
    assert graphed.replays == (4 if enabled else 0)   # (three prefill passes, one decode step)


def test_greedy_replays_feed_their_tokens_on_the_device(rng):
    """``CudaGraphDecoder.greedy``: each replay's greedy ids equal ``ops.argmax`` of a plain
    forward's logits, and with ``feed=True`` a replay launched before the previous one's ids
    were read decodes those ids (a one-ahead loop gives the plain loop's tokens), for a bucket
    hit exactly and a padded one; ``feed`` after a plain replay is refused, and eager decoders
    decline (None)."""
    from ninfer.engine.models.llama import ForwardBatch, LlamaConfig, LlamaModel
    from ninfer.kernels.gpu.graphs import CudaGraphDecoder
    c = LlamaConfig.from_dict(TINY)
    w = _tiny_weights(rng, TINY)
    ops = get_ops("cupy")
    plain = LlamaModel(c, w, ops)
    graphed = CudaGraphDecoder(LlamaModel(c, w, ops), max_pages=8)
    kvs = [plain.new_kv_cache(32, 16), graphed.new_kv_cache(32, 16)]   # (graphs: one cache)
    for s in (1, 3):
        prompts = [rng.integers(0, 512, size=n).tolist() for n in (5, 20, 33)[:s]]
        tables = [[8 * i + j for j in range(8)] for i in range(s)]
        b = ForwardBatch.from_sequences(prompts, [0] * s, tables, 16)
        first = ops.argmax(plain.forward(b, kvs[0]))
        assert np.array_equal(ops.argmax(graphed.forward(b, kvs[1])), first)
        ref, last = [], first.tolist()
        for step in range(6):
            b = ForwardBatch.from_sequences([[t] for t in last],
                                            [len(p) + step for p in prompts], tables, 16)
            last = ops.argmax(plain.forward(b, kvs[0])).tolist()
            ref.append(last)
        b = ForwardBatch.from_sequences([[t] for t in first.tolist()],
                                        [len(p) for p in prompts], tables, 16)
        if s == 1:   # a plain replay of the bucket before: nothing to feed on
            graphed.forward(b, kvs[1])
            with pytest.raises(ValueError):
                graphed.greedy(b, kvs[1], feed=True)
        pending, got = graphed.greedy(b, kvs[1]), []
        for step in range(1, 6):
            fed = ForwardBatch.from_sequences([[0]] * s, [len(p) + step for p in prompts],
                                              tables, 16)
            nxt = graphed.greedy(fed, kvs[1], feed=True)
            got.append(pending().tolist())
            pending = nxt
        got.append(pending().tolist())
        assert got == ref
    eager = CudaGraphDecoder(LlamaModel(c, w, ops), max_pages=8, enabled=False)
    assert eager.greedy(b, eager.new_kv_cache(32, 16)) is None


def test_capturing_a_bucket_writes_no_kv(rng):
    """Capturing every bucket (``capture_all``: an eager warm-up pass, then the capture, over
    the static inputs) leaves a cache that sequences already fill, page 0 included, as it
    was: the padded rows' slots are -1 on the device too."""
    from ninfer.engine.models.llama import ForwardBatch, LlamaConfig, LlamaModel
    from ninfer.kernels.gpu.graphs import CudaGraphDecoder
    c = LlamaConfig.from_dict(TINY)
    dec = CudaGraphDecoder(LlamaModel(c, _tiny_weights(rng, TINY), get_ops("cupy")),
                           max_pages=8, buckets=(1, 2, 4))
    kv = dec.new_kv_cache(16, 16)
    prompts = [rng.integers(0, 512, size=n).tolist() for n in (20, 9)]
    dec.forward(ForwardBatch.from_sequences(prompts, [0, 0], [[0, 1], [2, 3]], 16), kv)
    before = [cp.asnumpy(a) for a in kv.k + kv.v]
    dec.capture_all(kv)
    assert sorted(dec._b) == [1, 2, 4]
    assert all(np.array_equal(cp.asnumpy(a), b) for a, b in zip(kv.k + kv.v, before))


class _LetterTokenizer:
    """The engine's view of a tokenizer for the tiny model's 512 ids: one letter a token."""

    vocab_size = 512
    special_ids = frozenset()

    def __init__(self, stop_ids=()):
        self.stop_ids = frozenset(stop_ids)

    def token_bytes(self, i: int) -> bytes:
        return bytes([97 + i % 26])


def test_engine_lookahead_on_graph_replays_gives_the_plain_rounds_tokens(rng):
    """The engine's greedy rounds on CUDA graph replays with the lookahead (the next round
    launched with its tokens fed on the device before this one's are read: the default) give
    exactly the tokens of plain rounds on the same graphs, for 3 lanes on bucket 4 ending at
    different rounds (output limits, a stop token), and leave the page pool consistent."""
    from ninfer.engine.engine import Engine, EngineConfig, FinalOutput, Request, TokenOutput
    from ninfer.engine.models.llama import LlamaConfig, LlamaModel
    from ninfer.engine.sampling import SamplingParams
    from ninfer.events.bus import EventBus
    c = LlamaConfig.from_dict(TINY)
    w = _tiny_weights(rng, TINY)
    prompts = [rng.integers(0, 512, size=n).tolist() for n in (7, 19, 40)]

    def run(lookahead, stop=(), ignore_eos=True):
        inner = LlamaModel(c, w, get_ops("cupy"))
        ecfg = EngineConfig(max_concurrency=3, max_context=128, decode_lookahead=lookahead)
        runner = inner.ops.decode_runner(inner, max_pages=ecfg.pages_per_lane, max_batch=3)
        feeds, greedy = [], runner.greedy

        def counted(batch, kv, feed=False):
            feeds.append(feed)
            return greedy(batch, kv, feed=feed)
        runner.greedy = counted
        engine = Engine(runner, _LetterTokenizer(stop), EventBus(), ecfg)
        runner.capture_all(engine.kv)
        outs = [[] for _ in prompts]
        for i, (p, n) in enumerate(zip(prompts, (6, 11, 30))):
            engine.submit(Request(f"r{i}", p, SamplingParams(temperature=0.0), n,
                                  outs[i].append, ignore_eos=ignore_eos))
        while engine.step():
            pass
        engine.check_integrity()
        assert engine.lookahead is (lookahead == "auto")
        assert runner.replays > 20 or not ignore_eos
        # rounds fed on the device with the lookahead (greedy() never called without it)
        assert (any(feeds) if ignore_eos else True) if lookahead == "auto" else not feeds
        return ([[o.token_id for o in out if isinstance(o, TokenOutput)] for out in outs],
                [out[-1].engine_reason for out in outs if isinstance(out[-1], FinalOutput)])

    plain, _ = run("off")
    assert [len(t) for t in plain] == [6, 11, 30]
    assert run("auto")[0] == plain
    j = next(i for i in range(1, 30) if plain[2][i] not in plain[2][:i])   # (a first time)
    stop = plain[2][j]
    plain_stop = run("off", stop=(stop,), ignore_eos=False)
    assert plain_stop[0][2] == plain[2][:j] and plain_stop[1][2] == "stop_token"   # (not sent)
    assert run("auto", stop=(stop,), ignore_eos=False) == plain_stop


def test_buckets_for_cover_the_concurrency_in_powers_of_two():
    from ninfer.kernels.graph_buckets import buckets_for
    assert buckets_for(1) == (1,)
    assert buckets_for(3) == buckets_for(4) == (1, 2, 4)
    assert buckets_for(5) == (1, 2, 4, 8)
    assert buckets_for(100) == (1, 2, 4, 8, 16, 32)


@pytest.mark.parametrize("cuda_graph", [True, False])
def test_decode_runner_captures_every_bucket_up_front_within_the_planned_allowance(
        rng, cuda_graph):
    """``ops.decode_runner`` + ``capture_all``: buckets 1, 2, 4 for 3 lanes, all captured before
    the first pass; replays give the plain forward's logits; the graphs' private pools stay
    within ``memory.cuda_graph_bytes``."""
    from ninfer.engine.memory import cuda_graph_bytes
    from ninfer.engine.models.llama import ForwardBatch, LlamaConfig, LlamaModel
    c = LlamaConfig.from_dict(TINY)
    w = _tiny_weights(rng, TINY)
    plain = LlamaModel(c, w, get_ops("cupy"))
    inner = LlamaModel(c, w, get_ops("cupy"))
    runner = inner.ops.decode_runner(inner, max_pages=8, max_batch=3, cuda_graph=cuda_graph)
    assert runner.buckets == (1, 2, 4) and runner.enabled is cuda_graph
    kvs = [plain.new_kv_cache(32, 16), runner.new_kv_cache(32, 16)]
    runner.capture_all(kvs[1])
    assert sorted(runner._b) == [1, 2, 4]
    assert all((bk.graph is not None) is cuda_graph for bk in runner._b.values())
    planned = cuda_graph_bytes(c, runner.buckets, 8 * 16, 16)
    if cuda_graph:
        assert 0 < runner.pool_bytes <= planned
    else:  # static inputs only
        assert runner.pool_bytes == sum(bk.d32.nbytes + bk.d64.nbytes
                                        for bk in runner._b.values())
    prompts = [rng.integers(0, 512, size=n).tolist() for n in (9, 30, 17)]
    tables = [[8 * i + j for j in range(8)] for i in range(3)]
    b = ForwardBatch.from_sequences(prompts, [0] * 3, tables, 16)
    for m, kv in zip((plain, runner), kvs):
        m.forward(b, kv)
    for step in range(2):
        toks = rng.integers(0, 512, size=3).tolist()
        b = ForwardBatch.from_sequences([[t] for t in toks], [len(p) + step for p in prompts],
                                        tables, 16)
        ref = cp.asnumpy(plain.forward(b, kvs[0]))
        got = cp.asnumpy(runner.forward(b, kvs[1]))
        assert got.shape == ref.shape == (3, 512)
        assert rel(got, ref) < F32
    assert runner.replays == (2 if cuda_graph else 0)


def _engine_tokens(model, tokenizer, ids, ecfg, steps=24):
    from ninfer.engine.engine import Engine, Request, TokenOutput
    from ninfer.engine.sampling import SamplingParams
    from ninfer.events.bus import EventBus
    bus = EventBus()
    engine = Engine(model, tokenizer, bus, ecfg)
    if hasattr(model, "capture_all"):
        model.capture_all(engine.kv)
    outs = [[] for _ in ids]
    for i, p in enumerate(ids):
        engine.submit(Request(f"r{i}", p, SamplingParams(temperature=0.0), steps,
                              outs[i].append, ignore_eos=True))
    while engine.step():
        bus.flush()
    return [[o.token_id for o in out if isinstance(o, TokenOutput)] for out in outs]


@pytest.mark.slow
def test_server_on_the_gpu_graph_and_eager_decode_agree_and_the_budget_is_real(smollm2_gguf):
    """``build_server`` on the cupy backend: the memory plan's weights equal what loading put in
    CuPy's pool, the captured graphs fit their allowance, graph and eager (padded) decode give
    identical greedy tokens for 4 concurrent prompts (and the CPU's), and a configuration larger
    than the GPU is refused before any KV is allocated, with the deficit in bytes."""
    from ninfer.config import ServeConfig
    from ninfer.engine.engine import EngineConfig
    from ninfer.engine.memory import MemoryBudgetError
    from ninfer.server import build_server, decode_model, load_runtime, started_event
    pool = cp.get_default_memory_pool()
    before = pool.used_bytes()
    rt = load_runtime(str(smollm2_gguf), "cupy")
    loaded = pool.used_bytes() - before
    cfg = dict(backend="cupy", max_context=1024, max_concurrency=4)
    server = build_server(ServeConfig(**cfg), rt)
    ev = started_event(server)
    m = ev.memory
    assert ev.environment["backend"] == "cupy"
    assert m["weights_bytes"] <= loaded < m["weights_bytes"] + 512 * 1024  # pool rounds to 512
    # packed, not dequantized, besides the layers' fp16 copies (LinearOps.keep_f16)
    kept = sum(p.f16.nbytes for ly in rt.model.layers for w in (ly.qkv, ly.o, ly.gate_up, ly.down)
               for p in getattr(w, "parts", (w,)) if getattr(p, "f16", None) is not None)
    assert kept > 0 and m["weights_bytes"] < m["weights_stored_bytes"] * 1.1 + kept
    # (4 lanes x 64 pages of 16 positions; K and V of 30 layers x 3 KV heads x 64 dims, fp16:
    # the GPU's default KV dtype)
    assert m["kv_pool_bytes"] == server.engine.kv.nbytes == 4 * 64 * 16 * (2 * 30 * 3 * 64 * 2)
    assert m["cuda_graph_buckets"] == [1, 2, 4] and m["budget_enforced"] is True
    assert 0 < m["cuda_graph_pool_bytes"] <= m["cuda_graph_bytes"]
    assert m["capacity_bytes"] <= cp.cuda.runtime.memGetInfo()[1]
    print("gpu memory plan:", m)

    ids = [rt.tokenizer.encode(rt.template.render([{"role": "user", "content": t}],
                                                  add_generation_prompt=True))
           for t in PROMPTS[:4]]
    ecfg = EngineConfig(max_concurrency=4, max_context=1024)
    graphed, runner = decode_model(rt.model, ecfg, cuda_graph=True)
    eager, _ = decode_model(rt.model, ecfg, cuda_graph=False)
    t_graph = _engine_tokens(graphed, rt.tokenizer, ids, ecfg)
    t_eager = _engine_tokens(eager, rt.tokenizer, ids, ecfg)
    assert runner.replays >= 23 and eager.replays == 0
    assert t_graph == t_eager
    cpu = load_runtime(str(smollm2_gguf), "numpy")
    t_cpu = _engine_tokens(cpu.model, cpu.tokenizer, ids, ecfg)
    same = [next((j for j, (a, b) in enumerate(zip(g, c)) if a != b), len(g))
            for g, c in zip(t_graph, t_cpu)]
    print("tokens equal to the CPU's, per prompt:", same)
    assert min(same) >= 8

    used = pool.used_bytes()
    with pytest.raises(MemoryBudgetError) as err:
        build_server(ServeConfig(backend="cupy", max_context=8192, max_concurrency=512), rt)
    plan = err.value.plan
    assert plan.kv_pool_bytes == 512 * 512 * 16 * (2 * 30 * 3 * 64 * 2)   # (fp16)
    assert err.value.deficit_bytes == plan.total_bytes - plan.capacity_bytes > 0
    assert "not enough GPU memory" in str(err.value)
    assert pool.used_bytes() == used  # refused before the KV pool was allocated


# ---------------------------------------------------------------------------------------------
# Gated DeltaNet ops and the gated-attention output gate (Qwen3.5; reference ninfer.kernels.gdn)
# ---------------------------------------------------------------------------------------------

GDN_TOL = 1e-4  # long sequential recurrences in float32 (different summation order)


def _strided(rng, t, n, extra=5):
    """(T, N) float32 view with a row stride (like ``p[:, a:b]`` of a fused projection)."""
    full = rng.standard_normal((t, n + extra)).astype(np.float32)
    return full, full[:, 2:2 + n]


@pytest.mark.parametrize("t,n", [(1, 64), (7, 300), (33, 1024)])
def test_sigmoid_mul(gops, rng, t, n):
    from ninfer.kernels.activation import sigmoid_mul
    x = rng.standard_normal((t, n)).astype(np.float32)
    full, gate = _strided(rng, t, n)
    got = gops.sigmoid_mul(cp.asarray(x), cp.asarray(full)[:, 2:2 + n])
    assert rel(got, sigmoid_mul(x, gate)) < F32


@pytest.mark.parametrize("t,h,d", [(1, 24, 256), (5, 3, 32)])
def test_sigmoid_mul_reads_a_head_strided_gate(gops, rng, t, h, d):
    """The gate halves of a fused projection's per-head [query | gate] rows (row stride
    beyond them), read in place: the same floats as the kernel over the gate made contiguous."""
    from ninfer.kernels.activation import sigmoid_mul
    x = rng.standard_normal((t, h * d)).astype(np.float32)
    p = rng.standard_normal((t, 2 * h * d + 40)).astype(np.float32) * 4
    pg = cp.asarray(p)
    qg = pg[:, :2 * h * d].reshape(t, h, 2 * d)
    got = gops.sigmoid_mul(cp.asarray(x), qg[:, :, d:])
    flat = gops.sigmoid_mul(cp.asarray(x), cp.ascontiguousarray(qg[:, :, d:]).reshape(t, h * d))
    assert cp.array_equal(got, flat)
    gate = p[:, :2 * h * d].reshape(t, h, 2 * d)[:, :, d:]
    assert rel(got, sigmoid_mul(x, gate)) < F32


@pytest.mark.parametrize("t,h,d", [(1, 2, 16), (9, 4, 128), (40, 3, 96)])
def test_l2_norm_and_gated_rms_norm(gops, rng, t, h, d):
    from ninfer.kernels import gdn
    full = rng.standard_normal((t, h * d + 7)).astype(np.float32)
    xv = full[:, 3:3 + h * d].reshape(t, h, d)
    got = gops.l2_norm(cp.asarray(full)[:, 3:3 + h * d].reshape(t, h, d), 1e-6)
    assert rel(got, gdn.l2_norm(xv, 1e-6)) < F32
    x = rng.standard_normal((t, h, d)).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    got = gops.gated_rms_norm(cp.asarray(x), cp.asarray(full)[:, 3:3 + h * d].reshape(t, h, d),
                              cp.asarray(w), 1e-6)
    assert rel(got, gdn.gated_rms_norm(x, xv, w, 1e-6)) < F32


@pytest.mark.parametrize("t,h", [(1, 4), (37, 16)])
def test_gdn_gates(gops, rng, t, h):
    from ninfer.kernels import gdn
    full = (rng.standard_normal((t, 2 * h + 3)) * 8).astype(np.float32)  # softplus > 20 too
    a, b = full[:, :h], full[:, h + 3:]
    A_log = rng.standard_normal(h).astype(np.float32)
    dt = rng.standard_normal(h).astype(np.float32)
    dfull = cp.asarray(full)
    g, beta = gops.gdn_gates(dfull[:, :h], dfull[:, h + 3:], cp.asarray(A_log), cp.asarray(dt))
    rg, rb = gdn.gdn_gates(a, b, A_log, dt)
    assert rel(g, rg) < F32 and rel(beta, rb) < F32


def _ragged(rng, lens, pool):
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    slots = rng.permutation(pool)[:len(lens)].astype(np.int64)
    return cu, slots


@pytest.mark.parametrize("lens,kc,act", [((1, 1, 1), 4, "silu"), ((5, 1, 70, 2), 4, "silu"),
                                         ((3, 17), 3, None), ((1, 2), 4, "silu")])
def test_causal_conv1d(gops, nops, rng, lens, kc, act):
    c, pool = 96, 6
    t = sum(lens)
    cu, slots = _ragged(rng, lens, pool)
    full = rng.standard_normal((t, c + 11)).astype(np.float32)
    w = rng.standard_normal((c, kc)).astype(np.float32)
    state = rng.standard_normal((pool, kc - 1, c)).astype(np.float32)
    ref_state = state.copy()
    ref = nops.causal_conv1d(full[:, 4:4 + c], w, ref_state, cu, slots, act)
    dstate = cp.asarray(state)
    got = gops.causal_conv1d(cp.asarray(full)[:, 4:4 + c], cp.asarray(w), dstate, cu, slots, act)
    assert rel(got, ref) < F32
    assert np.array_equal(cp.asnumpy(dstate), ref_state)  # copies only, untouched slots kept
    # continuing from the carried state equals the reference continuing from its own
    x2 = rng.standard_normal((t, c)).astype(np.float32)
    ref2 = nops.causal_conv1d(x2, w, ref_state, cu, slots, act)
    got2 = gops.causal_conv1d(cp.asarray(x2), cp.asarray(w), dstate, cu, slots, act)
    assert rel(got2, ref2) < F32
    assert np.array_equal(cp.asnumpy(dstate), ref_state)


def _gdr_inputs(rng, t, hk, hv, dk, dv):
    from ninfer.kernels import gdn
    q = gdn.l2_norm(rng.standard_normal((t, hk, dk)).astype(np.float32))
    k = gdn.l2_norm(rng.standard_normal((t, hk, dk)).astype(np.float32))
    v = rng.standard_normal((t, hv, dv)).astype(np.float32)
    g, beta = gdn.gdn_gates(rng.standard_normal((t, hv)).astype(np.float32),
                            rng.standard_normal((t, hv)).astype(np.float32),
                            (rng.standard_normal(hv) * 0.5).astype(np.float32),
                            rng.standard_normal(hv).astype(np.float32))
    return q, k, v, g, beta


@pytest.mark.parametrize("lens,hk,hv,dk,dv", [
    ((1, 1, 1, 1), 2, 4, 128, 128),        # decode step, Qwen3.5 head dims
    ((1, 70, 3), 1, 2, 16, 32),           # ragged prefill + decode, dk < 32
    ((130,), 2, 2, 64, 48),               # several chunks of the reference's chunked form
    ((5, 9), 1, 3, 200, 256),             # dk above 128, dv at the limit
])
def test_gated_delta_rule(gops, nops, rng, lens, hk, hv, dk, dv):
    pool, t = 6, sum(lens)
    cu, slots = _ragged(rng, lens, pool)
    q, k, v, g, beta = _gdr_inputs(rng, t, hk, hv, dk, dv)
    state = (rng.standard_normal((pool, hv, dk, dv)) * 0.1).astype(np.float32)
    scale = dk ** -0.5
    for mode in ("recurrent", "auto", "chunked"):
        ref_state = state.copy()
        ref = nops.gated_delta_rule(q, k, v, g, beta, ref_state, cu, slots, scale, mode)
        dstate = cp.asarray(state)
        got = gops.gated_delta_rule(cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(g),
                                    cp.asarray(beta), dstate, cu, slots, scale, mode)
        assert rel(got, ref) < GDN_TOL, mode
        assert rel(dstate, ref_state) < GDN_TOL, mode
    # records: what every token did to the state, the pool left as it was (speculative
    # verification)
    from ninfer.kernels.gdn import record_width
    ref_state = state.copy()
    ref_rec = np.zeros((len(lens), max(lens) + 1, record_width(hk, hv, dk, dv)), np.float32)
    ref = nops.gated_delta_rule(q, k, v, g, beta, ref_state, cu, slots, scale, records=ref_rec)
    dstate = cp.asarray(state)
    rec = cp.zeros(ref_rec.shape, dtype=cp.float32)
    got = gops.gated_delta_rule(cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(g),
                                cp.asarray(beta), dstate, cu, slots, scale, records=rec)
    assert rel(got, ref) < GDN_TOL and np.array_equal(cp.asnumpy(dstate), state)
    assert rel(rec, ref_rec) < GDN_TOL


def test_gated_delta_rule_strided_views(gops, nops, rng):
    """q / k / v as column slices of one conv output and g / beta as column slices, as the
    model passes them (no copies on either side)."""
    t, hk, hv, dk, dv = 12, 2, 4, 32, 32
    kd = hk * dk
    cu, slots = _ragged(rng, (4, 8), 3)
    y = (rng.standard_normal((t, 2 * kd + hv * dv + 3)) * 0.1).astype(np.float32)
    gb = rng.random((t, 2 * hv + 1)).astype(np.float32)
    state = np.zeros((3, hv, dk, dv), np.float32)

    def views(y, gb):
        return (y[:, :kd].reshape(t, hk, dk), y[:, kd:2 * kd].reshape(t, hk, dk),
                y[:, 2 * kd:2 * kd + hv * dv].reshape(t, hv, dv), gb[:, :hv] * -0.5,
                gb[:, hv + 1:])

    ref = nops.gated_delta_rule(*views(y, gb), state.copy(), cu, slots, 0.3)
    dgb = cp.asarray(gb)
    q, k, v, _, _ = views(cp.asarray(y), dgb)
    got = gops.gated_delta_rule(q, k, v, dgb[:, :hv] * -0.5, dgb[:, hv + 1:],
                                cp.asarray(state), cu, slots, 0.3)
    assert rel(got, ref) < GDN_TOL


def _tiny_qwen35(seed=0):
    """A random 4-layer Qwen3.5 (3 GDN + 1 gated attention, GQA 2, Hv = 2 Hk, untied head)
    as (config dict, f32 QuantTensor weights); attention head dim 32 (the GPU paged attention
    supports 32 / 64 / 128 / 256), GDN dk 16 / dv 32."""
    from ninfer.store.quant import QuantTensor
    rng = np.random.default_rng(seed)
    cfg = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, intermediate_size=96, rms_norm_eps=1e-6,
               rope_theta=10000.0, partial_rotary_factor=0.25, linear_conv_kernel_dim=4,
               linear_key_head_dim=16, linear_value_head_dim=32, linear_num_key_heads=2,
               linear_num_value_heads=4, tie_word_embeddings=False,
               layer_types=["linear_attention"] * 3 + ["full_attention"])
    hs, inter, nh, nkv, hd = 64, 96, 4, 2, 32
    kd, vd, hv = 2 * 16, 4 * 32, 4
    shapes = {"model.embed_tokens.weight": (300, hs), "model.norm.weight": (hs,),
              "lm_head.weight": (300, hs)}
    for i in range(4):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hs,), p + "post_attention_layernorm.weight":
                       (hs,), p + "mlp.gate_proj.weight": (inter, hs),
                       p + "mlp.up_proj.weight": (inter, hs), p + "mlp.down_proj.weight": (hs, inter)})
        if i < 3:
            a = p + "linear_attn."
            shapes.update({a + "in_proj_qkv.weight": (2 * kd + vd, hs), a + "in_proj_z.weight":
                           (vd, hs), a + "in_proj_b.weight": (hv, hs), a + "in_proj_a.weight": (hv, hs),
                           a + "conv1d.weight": (2 * kd + vd, 4), a + "A_log": (hv,),
                           a + "dt_bias": (hv,), a + "norm.weight": (32,),
                           a + "out_proj.weight": (hs, vd)})
        else:
            a = p + "self_attn."
            shapes.update({a + "q_proj.weight": (2 * nh * hd, hs), a + "k_proj.weight": (nkv * hd, hs),
                           a + "v_proj.weight": (nkv * hd, hs), a + "q_norm.weight": (hd,),
                           a + "k_norm.weight": (hd,), a + "o_proj.weight": (hs, nh * hd)})
    weights = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            data = rng.standard_normal(shape) * 0.1 + (1.0 if "norm.weight" in name
                                                      and "linear_attn" in name else 0.0)
        elif "conv1d" in name:
            data = rng.standard_normal(shape) * 0.3
        else:
            data = rng.standard_normal(shape) * shape[1] ** -0.5
        weights[name] = QuantTensor("f32", shape, data=np.ascontiguousarray(data, np.float32))
    return cfg, weights


def test_qwen35_model_gpu_equals_cpu(gops, nops):
    """A tiny random Qwen3.5 on cupy vs numpy: ragged prefill of two prompts (state slots 2 and
    0), 12 greedy decode steps (logits within 1e-3 relative, identical tokens), then one
    speculative verify + commit pass."""
    from ninfer.engine.models.llama import ForwardBatch
    from ninfer.engine.models.qwen35 import Qwen35Config, Qwen35Model
    cfg, weights = _tiny_qwen35(7)
    config = Qwen35Config.from_dict(cfg)
    models = {name: Qwen35Model(config, weights, ops) for name, ops in
              (("gpu", gops), ("cpu", nops))}
    kvs = {name: m.new_kv_cache(32, 16, max_lanes=3) for name, m in models.items()}
    for kv in kvs.values():
        for slot in range(3):
            kv.reset_state(slot)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 300, 45).tolist(), rng.integers(0, 300, 6).tolist()]
    slots, tables = [2, 0], [list(range(16)), list(range(16, 32))]
    seqs = [list(p) for p in prompts]
    batch = ForwardBatch.from_sequences(prompts, [0, 0], tables, 16, state_slots=slots)
    worst = 0.0
    for step in range(13):
        logits = {n: m.ops.to_numpy(m.forward(batch, kvs[n])) for n, m in models.items()}
        err = np.abs(logits["gpu"] - logits["cpu"]).max() / np.abs(logits["cpu"]).max()
        worst = max(worst, float(err))
        assert err < 1e-3, step
        toks = [int(t) for t in np.argmax(logits["cpu"], axis=-1)]
        assert toks == [int(t) for t in np.argmax(logits["gpu"], axis=-1)], step
        starts = [len(s) for s in seqs]
        for s, t in zip(seqs, toks):
            s.append(t)
        batch = ForwardBatch.from_sequences([[t] for t in toks], starts, tables, 16,
                                            state_slots=slots)
    # speculative verify of 3 tokens per sequence, accept 2 and 1
    starts = [len(s) - 1 for s in seqs]
    drafts = [[seqs[0][-1], 5, 9], [seqs[1][-1], 17, 3]]
    vb = ForwardBatch.from_sequences(drafts, starts, tables, 16, state_slots=slots)
    out = {}
    for n, m in models.items():
        logits, rec = m.verify(vb, kvs[n])
        m.commit(kvs[n], rec, [2, 1])
        out[n] = m.ops.to_numpy(logits)
    assert np.abs(out["gpu"] - out["cpu"]).max() / np.abs(out["cpu"]).max() < 1e-3
    for j in range(3):
        assert rel(kvs["gpu"].ssm[j], kvs["cpu"].ssm[j]) < 1e-3
        assert rel(kvs["gpu"].conv[j], kvs["cpu"].conv[j]) < 1e-3
    print(f"qwen35 tiny: worst logits rel err gpu vs cpu {worst:.2e}")


def test_no_slot_padding_keeps_no_state_on_the_gpu(gops, nops, rng):
    """Conv and delta rule with a ``NO_SLOT`` sequence (a graph bucket's padding) equal the
    reference: zero state in, no slot written, outputs of every row written."""
    from ninfer.kernels.gdn import NO_SLOT
    lens, slots = (1, 1, 1), np.array([3, NO_SLOT, 0], np.int64)
    cu = np.cumsum([0, *lens]).astype(np.int32)
    c, hk, hv, dk, dv = 64, 2, 4, 128, 128
    x = rng.standard_normal((3, c)).astype(np.float32)
    w = rng.standard_normal((c, 4)).astype(np.float32)
    conv = rng.standard_normal((4, 3, c)).astype(np.float32)
    ref_conv = conv.copy()
    ref = nops.causal_conv1d(x, w, ref_conv, cu, slots)
    dconv = cp.asarray(conv)
    got = gops.causal_conv1d(cp.asarray(x), cp.asarray(w), dconv, cu, slots)
    assert rel(got, ref) < F32
    assert np.array_equal(cp.asnumpy(dconv), ref_conv)
    q, k, v, g, beta = _gdr_inputs(rng, 3, hk, hv, dk, dv)
    state = (rng.standard_normal((4, hv, dk, dv)) * 0.1).astype(np.float32)
    ref_state = state.copy()
    ref = nops.gated_delta_rule(q, k, v, g, beta, ref_state, cu, slots, dk ** -0.5)
    dstate = cp.asarray(state)
    got = gops.gated_delta_rule(cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(g),
                                cp.asarray(beta), dstate, cu, slots, dk ** -0.5)
    assert rel(got, ref) < GDN_TOL and rel(dstate, ref_state) < GDN_TOL
    assert np.array_equal(cp.asnumpy(dstate)[[1, 2]], state[[1, 2]])


def _gdn_layer(rng, cd, hv, dk, dv, kc, pool):
    """A GDN layer's conv kernel, gate parameters and gated-norm weight, and random conv and
    recurrent state pools of ``pool`` slots (float32 host arrays)."""
    w = (rng.standard_normal((cd, kc)) * 0.5).astype(np.float32)
    A_log = (rng.standard_normal(hv) * 0.5).astype(np.float32)
    dt = rng.standard_normal(hv).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(dv)).astype(np.float32)
    conv = rng.standard_normal((pool, kc - 1, cd)).astype(np.float32)
    ssm = (rng.standard_normal((pool, hv, dk, dv)) * 0.1).astype(np.float32)
    return w, A_log, dt, nw, conv, ssm


@pytest.mark.parametrize("hk,hv,dk,dv,kc", [(2, 6, 128, 128, 4),   # Qwen3.5-27B head dims
                                            (2, 4, 16, 32, 4), (1, 2, 64, 64, 3),
                                            (1, 3, 32, 48, 4)])
def test_gdn_mixer_decode_step_matches_the_composed_reference(gops, nops, rng, hk, hv, dk, dv,
                                                              kc):
    """``gdn_mixer`` on a decode batch (the fused ``gdn_step``: conv, L2 norms, gates, delta
    rule, gated norm in two kernels) equals the composed NumPy reference, output and both
    state pools, a ``NO_SLOT`` padding row included; two steps, so the carried state is
    exercised."""
    from ninfer.kernels import gdn
    from ninfer.kernels.gpu import gdn as ggdn
    s, pool = 3, 5
    vd, cd = hv * dv, 2 * hk * dk + hv * dv
    slots = np.array([4, gdn.NO_SLOT, 1], np.int64)
    cu = np.arange(s + 1, dtype=np.int32)
    w, A_log, dt, nw, conv, ssm = _gdn_layer(rng, cd, hv, dk, dv, kc, pool)
    dconv, dssm = cp.asarray(conv), cp.asarray(ssm)
    dev = [cp.asarray(a) for a in (w, A_log, dt, nw)]
    assert ggdn.gdn_step_applies(cp.zeros((s, cd + vd + 2 * hv), cp.float32), dconv, dssm)
    for _ in range(2):
        p = rng.standard_normal((s, cd + vd + 2 * hv + 5)).astype(np.float32)[:, 5:]
        ref = nops.gdn_mixer(p, w, A_log, dt, nw, conv, ssm, cu, slots, dk ** -0.5, 1e-6)
        got = gops.gdn_mixer(cp.asarray(p), *dev, dconv, dssm, cu, slots, dk ** -0.5, 1e-6)
        assert got.shape == (s, vd)
        assert rel(got, ref) < GDN_TOL
        assert rel(dconv, conv) < F32 and rel(dssm, ssm) < GDN_TOL


@pytest.mark.parametrize("hk,hv,dk,dv,kc", [(2, 6, 128, 128, 4), (1, 2, 64, 64, 3),
                                            (1, 3, 32, 48, 4)])
@pytest.mark.parametrize("with_records", [True, False])
def test_gdn_mixer_few_token_sequences_match_the_composed_reference(gops, nops, rng, hk, hv, dk,
                                                                    dv, kc, with_records):
    """``gdn_mixer`` on sequences of 1 to 6 tokens (a verify pass: ``gdn_step`` runs each
    sequence's tokens in turn) equals the composed NumPy reference: output, both state pools and
    the per-token records (NaN-poisoned; the recurrent pool then left as it was), a ``NO_SLOT``
    sequence of several tokens (its conv history starts from zeros) included."""
    from ninfer.kernels import gdn
    from ninfer.kernels.gpu import gdn as ggdn
    lens, pool = [4, 1, 3, 6], 6
    s, t = len(lens), sum(lens)
    vd, cd = hv * dv, 2 * hk * dk + hv * dv
    slots = np.array([5, 0, gdn.NO_SLOT, 2], np.int64)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    w, A_log, dt, nw, conv, ssm = _gdn_layer(rng, cd, hv, dk, dv, kc, pool)
    dconv, dssm = cp.asarray(conv), cp.asarray(ssm)
    dev = [cp.asarray(a) for a in (w, A_log, dt, nw)]
    p = rng.standard_normal((t, cd + vd + 2 * hv + 3)).astype(np.float32)[:, 3:]
    assert ggdn.gdn_step_applies(cp.asarray(p), dconv, dssm) and max(lens) <= ggdn.STEP_MAX_T
    width = gdn.record_width(hk, hv, dk, dv)
    rec = np.zeros((s, max(lens), width), np.float32) if with_records else None
    drec = cp.full((s, max(lens), width), cp.nan, cp.float32) if with_records else None
    ref = nops.gdn_mixer(p, w, A_log, dt, nw, conv, ssm, cu, slots, dk ** -0.5, 1e-6,
                         records=rec)
    got = gops.gdn_mixer(cp.asarray(p), *dev, dconv, dssm, cu, slots, dk ** -0.5, 1e-6,
                         records=drec)
    assert got.shape == (t, vd) and rel(got, ref) < GDN_TOL
    assert rel(dconv, conv) < F32 and rel(dssm, ssm) < GDN_TOL
    if with_records:   # (rows past a sequence's length are not written)
        for i, n in enumerate(lens):
            assert rel(drec[i, :n], rec[i, :n]) < GDN_TOL


@pytest.mark.parametrize("hk,hv,dk,dv,kc", [(2, 6, 128, 128, 4),   # gdn_verify
                                            (1, 3, 32, 48, 4)])     # gdn_step
def test_gdn_records_then_commit_equal_the_plain_pass(gops, rng, hk, hv, dk, dv, kc):
    """A verify pass with records, then ``gdn_commit`` of every token, leaves both pools as the
    same pass without records does, bit for bit (the commit repeats the pass's own float
    operations), the recurrent pool untouched in between; the outputs are the same floats."""
    from ninfer.kernels import gdn
    lens, pool = [4, 2], 4
    s, t = len(lens), sum(lens)
    vd, cd = hv * dv, 2 * hk * dk + hv * dv
    slots = np.array([3, 1], np.int64)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    w, A_log, dt, nw, conv, ssm = _gdn_layer(rng, cd, hv, dk, dv, kc, pool)
    dev = [cp.asarray(a) for a in (w, A_log, dt, nw)]
    p = cp.asarray(rng.standard_normal((t, cd + vd + 2 * hv)).astype(np.float32))
    plain_conv, plain_ssm = cp.asarray(conv), cp.asarray(ssm)
    want = gops.gdn_mixer(p, *dev, plain_conv, plain_ssm, cu, slots, dk ** -0.5, 1e-6)
    dconv, dssm = cp.asarray(conv), cp.asarray(ssm)
    rec = cp.full((s, max(lens), gdn.record_width(hk, hv, dk, dv)), cp.nan, cp.float32)
    rconv = cp.full((s, kc - 1 + max(lens), cd), cp.nan, cp.float32)
    gops.gdn_record_conv(rconv, dconv, p[:, :cd], cu, slots)
    got = gops.gdn_mixer(p, *dev, dconv, dssm, cu, slots, dk ** -0.5, 1e-6, records=rec)
    assert cp.array_equal(got, want) and cp.array_equal(dssm, cp.asarray(ssm))
    gops.gdn_commit([dssm], [dconv], [rec], [rconv], slots, np.array(lens, np.int32))
    assert cp.array_equal(dssm, plain_ssm) and cp.array_equal(dconv, plain_conv)


@pytest.mark.parametrize("col_split", [1, 2, 8])
@pytest.mark.parametrize("hk,hv,dk,dv,kc,lens", [(2, 6, 128, 128, 4, [1, 1, 1]),
                                                 (2, 6, 128, 128, 4, [4, 1, 3]),
                                                 (1, 3, 32, 48, 4, [2, 5])])
def test_gdn_step_split_over_clusters_matches_the_reference(rng, nops, col_split, hk, hv, dk, dv,
                                                            kc, lens):
    """``gdn_step`` with each value head split over ``col_split`` blocks (a thread block cluster
    adding the gated norm's sum through distributed shared memory; the default is 4) equals the
    composed NumPy reference for decode and verify-shaped batches: output, both state pools and
    the records; the launch takes the split ``step_split`` allows for the shape."""
    from ninfer.kernels import gdn
    from ninfer.kernels.gpu import gdn as ggdn
    from ninfer.kernels.gpu.launch import clusters_available
    want = ggdn.step_split(col_split, dk, dv)
    assert want == (col_split if clusters_available() else 1)
    # past 1.5 blocks a multiprocessor (value heads x sequences x split), fewer blocks a head
    sms = ggdn.sm_count()
    assert ggdn.step_split(col_split, dk, dv, blocks=2 * sms) == 1
    assert ggdn.step_split(col_split, dk, dv, blocks=sms // 2) == min(want, 2)
    ops = get_ops("cupy", kconf(gdn_col_split=col_split))
    pool, s, t = 6, len(lens), sum(lens)
    vd, cd = hv * dv, 2 * hk * dk + hv * dv
    slots = np.array([5, gdn.NO_SLOT, 2][:s], np.int64)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    w, A_log, dt, nw, conv, ssm = _gdn_layer(rng, cd, hv, dk, dv, kc, pool)
    dconv, dssm = cp.asarray(conv), cp.asarray(ssm)
    dev = [cp.asarray(a) for a in (w, A_log, dt, nw)]
    for _ in range(2):   # (the carried conv state)
        p = rng.standard_normal((t, cd + vd + 2 * hv)).astype(np.float32)
        rec = np.zeros((s, max(lens), gdn.record_width(hk, hv, dk, dv)), np.float32)
        drec = cp.full(rec.shape, cp.nan, cp.float32)
        ref = nops.gdn_mixer(p, w, A_log, dt, nw, conv, ssm, cu, slots, dk ** -0.5, 1e-6,
                             records=rec)
        got = ops.gdn_mixer(cp.asarray(p), *dev, dconv, dssm, cu, slots, dk ** -0.5, 1e-6,
                            records=drec)
        assert rel(got, ref) < GDN_TOL
        assert rel(dconv, conv) < F32 and rel(dssm, ssm) < GDN_TOL
        for i, n in enumerate(lens):
            assert rel(drec[i, :n], rec[i, :n]) < GDN_TOL
    with pytest.raises(ValueError, match="gdn_col_split"):
        kconf(gdn_col_split=3)


@pytest.mark.parametrize("enabled", [True, False])
def test_qwen35_graph_decode_matches_the_plain_forward(enabled):
    """A hybrid model's decode replayed from CUDA graphs (and the eager padded schedule): the
    lanes' state slots are a static input, so batches of any lanes, padded to their bucket
    with stateless rows, give the plain forward's logits and leave the same conv, recurrent
    and KV state, across lanes released and re-admitted (slot reset) without a new capture."""
    from ninfer.engine.models.llama import ForwardBatch
    from ninfer.engine.models.qwen35 import Qwen35Config, Qwen35Model
    from ninfer.kernels.gpu.graphs import CudaGraphDecoder
    cfg, weights = _tiny_qwen35(5)
    config = Qwen35Config.from_dict(cfg)
    plain = Qwen35Model(config, weights, get_ops("cupy"))
    graphed = CudaGraphDecoder(Qwen35Model(config, weights, get_ops("cupy")), max_pages=8,
                               buckets=(1, 2, 4), enabled=enabled)
    kvs = [m.new_kv_cache(40, 16, max_lanes=5) for m in (plain, graphed)]
    graphed.capture_all(kvs[1])
    rng = np.random.default_rng(3)
    tables = [[8 * i + j for j in range(8)] for i in range(5)]
    frontier = {}

    def admit(slot, n):
        prompt = rng.integers(0, 300, n).tolist()
        b = ForwardBatch.from_sequences([prompt], [0], [tables[slot]], 16, state_slots=[slot])
        for m, kv in zip((plain, graphed), kvs):
            kv.reset_state(slot)
            m.forward(b, kv)
        frontier[slot] = n

    def decode(slots):
        toks = rng.integers(0, 300, len(slots)).tolist()
        b = ForwardBatch.from_sequences([[t] for t in toks], [frontier[s] for s in slots],
                                        [tables[s] for s in slots], 16, state_slots=slots)
        ref = cp.asnumpy(plain.forward(b, kvs[0]))
        got = cp.asnumpy(graphed.forward(b, kvs[1]))
        assert got.shape == ref.shape == (len(slots), 300)
        assert rel(got, ref) < 1e-4
        for s in slots:
            frontier[s] += 1

    for slot, n in ((4, 21), (0, 5), (2, 40)):
        admit(slot, n)
    for slots in ([4], [0, 4, 2], [2, 0], [4, 2, 0], [0]):   # buckets 1, 4 (padded), 2, 4, 1
        decode(slots)
    admit(0, 9)          # lane 0 released and re-admitted: its slot is reset and prefilled
    admit(1, 12)
    for slots in ([1, 0, 2, 4], [0, 1], [4, 1, 0]):
        decode(slots)
    for a, b in zip(kvs[0].conv + kvs[0].ssm + kvs[0].kv.k + kvs[0].kv.v,
                    kvs[1].conv + kvs[1].ssm + kvs[1].kv.k + kvs[1].kv.v):
        assert rel(b, cp.asnumpy(a)) < 1e-4
    assert np.array_equal(kvs[0].lengths, kvs[1].lengths)
    assert graphed.replays == (8 if enabled else 0)
    with pytest.raises(ValueError, match="frontier|starts at position"):   # checked on replay
        graphed.forward(ForwardBatch.from_sequences([[1]], [3], [tables[4]], 16,
                                                    state_slots=[4]), kvs[1])


def test_continuation_images_round_trip_through_device_pages():
    """export_lane / import_lane on a device KV cache: the image holds exactly the lane's
    positions and lands in other pages bit for bit (prefix reuse L2 / L3 on the GPU)."""
    from ninfer.engine.continuation import export_lane, import_lane
    from ninfer.engine.kv import KVCache
    ops = get_ops("cupy")
    rng = np.random.default_rng(31)
    kv = KVCache(2, 9, 4, 2, 8, zeros=ops.zeros)
    host = [rng.standard_normal(kv.k[0].shape).astype(np.float32) for _ in range(4)]
    for a, h in zip(kv.k + kv.v, host):
        a[...] = cp.asarray(h)
    src, dst = [6, 1, 4], [0, 2, 8]
    image = export_lane(kv, src, 11, list(range(11)), None)
    want = np.stack([h[src].reshape(12, 2, 8)[:11] for h in host[:2]])
    np.testing.assert_array_equal(image.k, want)
    # copied into pinned host memory (one DMA a layer, no page faults once the pool has it)
    assert cp.cuda.runtime.pointerGetAttributes(image.k.ctypes.data).type == 1
    import_lane(kv, image, 10, dst, None)
    for a in kv.k + kv.v:
        got = cp.asnumpy(a[cp.asarray(dst)]).reshape(12, 2, 8)[:10]
        np.testing.assert_array_equal(got, cp.asnumpy(a[cp.asarray(src)]).reshape(12, 2, 8)[:10])
    # a hybrid lane's recurrent state goes with it: slot 1's into slot 2, bit for bit
    from types import SimpleNamespace
    hyb = SimpleNamespace(kv=kv, lengths=np.array([0, 11, 0]),
                          conv=[cp.asarray(rng.standard_normal((3, 3, 5)).astype(np.float32))],
                          ssm=[cp.asarray(rng.standard_normal((3, 2, 4, 4)).astype(np.float32))])
    image = export_lane(hyb, src, 11, list(range(11)), 1)
    assert cp.cuda.runtime.pointerGetAttributes(image.ssm[0].ctypes.data).type == 1
    import_lane(hyb, image, 11, dst, 2)
    for a in hyb.conv + hyb.ssm:
        np.testing.assert_array_equal(cp.asnumpy(a[2]), cp.asnumpy(a[1]))
    assert hyb.lengths[2] == 11
    # images of ever-new lengths, each dropped at once: the K / V rows' own pool keeps at most
    # PINNED_FREE_BLOCKS free blocks (CuPy's default pool would keep one a length)
    from ninfer.engine.continuation import PINNED_FREE_BLOCKS, _image_pool
    for n in range(1, 12):
        assert export_lane(kv, src, n, list(range(n)), None).k.shape == (2, n, 2, 8)
    assert 0 < _image_pool().n_free_blocks() <= PINNED_FREE_BLOCKS + 2

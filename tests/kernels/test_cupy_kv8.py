"""``--kv-dtype int8`` on the CuPy backend against the NumPy reference codec (marker ``gpu``;
skipped without CUDA).

An int8 ``KVCache`` holds uint8 rows of hd + hd / 32 bytes per (token, head): the hd int8 codes,
then one fp16 scale per 64-dim group (``kv_codec``: s = fp16(max|x| / 127), codes
clamp(rint(x / s), +-127)); the backend views them as int8 (element type ``kvq8`` of the KV
templates). Checked here: the bytes ``write_kv`` stores are NumPy's exactly (ties, zero and
tiny groups included); the RoPE writers' bytes are exactly the codec's bytes of the fp32
kernels' K (and V NumPy's), and within one code / one scale step of NumPy's K, whose float32
RoPE differs in the last bits (the fp16 test's caveat: a value on a rounding boundary); decode,
verify-pass and prefill attention within the float32 bounds of ``test_cupy_kv16`` of the
float64 reference over the decoded pages and of NumPy's int8 mode, and bit-identical to fp32
pages of the decoded values (the kernels read code x scale, rounded once, as the codec
decodes); the fused decode kernels bit-identical to the unfused ones; greedy tokens of a tiny
random Llama on both backends. Every array the GPU code allocates is NaN-poisoned first.

    pytest -q -m gpu tests/kernels/test_cupy_kv8.py
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from ninfer.engine.kv import KVCache
from ninfer.kernels import get_ops
from ninfer.kernels.attention import paged_attention as ref_attention
from ninfer.kernels.kv_codec import codec

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from cupy_common import (F32, LLAMA, QWEN, gops, has_gpu, host, kconf, nops,  # noqa: E402,F401
                         poison, rel)


if not has_gpu():
    pytest.skip("no CUDA device", allow_module_level=True)

F16_ATTN = 4e-3    # tensor-core prefill attention: K, V (dequantized), Q and P rounded to fp16
INT8 = codec("int8").k


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()) + 808)


def decoded(rows, hd) -> np.ndarray:
    """int8 rows (..., hd + hd / 32) as the float32 values the codec decodes."""
    return INT8.decode_rows(host(rows), hd)


def split(rows, hd) -> tuple[np.ndarray, np.ndarray]:
    """(codes as int32, scales' fp16 bits as int32) of int8 rows."""
    r = host(rows)
    codes = r[..., :hd].view(np.int8).astype(np.int32)
    scales = np.ascontiguousarray(r[..., hd:]).view(np.int16).astype(np.int32)
    return codes, scales


def _pages(rng, pages, ps, nk, hd) -> list[np.ndarray]:
    """Random int8 K and V pages as a ``KVCache`` holds them (uint8 codec rows)."""
    return [INT8.encode_rows((rng.standard_normal((pages, ps, nk, hd)) * 2).astype(np.float32))
            for _ in range(2)]


def test_kv_cache_rows_view_as_int8_and_other_pages_are_refused(gops):
    from ninfer.kernels.gpu.attention_ops import kv_pages
    from ninfer.kernels.gpu import elementwise as gew
    kv = KVCache(1, 3, 16, 2, 128, zeros=gops.zeros, dtype="int8")
    assert kv.k[0].dtype == cp.uint8 and kv.k[0].shape == (3, 16, 2, 132)
    k, v = kv_pages(kv.k[0], kv.v[0], "int8")
    assert k.dtype == cp.int8 and k.shape == (3, 16, 2, 132) and k.data.ptr == kv.k[0].data.ptr
    assert gew.kv_head_dim(k) == 128 and gew.kv_type(k, v) == "signed char"
    with pytest.raises(ValueError, match="int8 KV rows must be"):
        kv_pages(cp.zeros((3, 16, 2, 128), cp.uint8), kv.v[0], "int8")
    with pytest.raises(ValueError, match="int8 KV pages must be int8"):
        kv_pages(cp.zeros((3, 16, 2, 128), cp.float32), kv.v[0], "int8")


@pytest.mark.parametrize("nk,hd", [(2, 64), (4, 128), (1, 256)])
def test_write_kv_stores_numpys_int8_bytes(gops, nops, rng, nk, hd):
    pages, ps, t = 5, 16, 23
    kc, vc = _pages(rng, pages, ps, nk, hd)
    k = (rng.standard_normal((t, nk, hd)) * 4).astype(np.float32)
    v = (rng.standard_normal((t, nk, hd)) * 4).astype(np.float32)
    k[0, 0, :64] = 0.0                                   # a zero group: scale 0, codes 0
    k[0, 0, :5] = [127.0, 0.5, 1.5, 2.5, -2.5]          # scale 1: ties to even
    k[1, 0, :64] = rng.standard_normal(64) * 1e-6        # a scale in fp16's subnormals / 0
    v[2, 0, :64] = rng.standard_normal(64) * 3e3         # a large scale
    v[3, 0, :64] *= 1e-3
    slots = rng.permutation(pages * ps)[:t].astype(np.int64)
    slots[5] = -1
    kd, vd = cp.asarray(kc), cp.asarray(vc)
    nops.write_kv(kc, vc, k, v, slots, kv_dtype="int8")
    gops.write_kv(kd, vd, cp.asarray(k), cp.asarray(v), slots, kv_dtype="int8")
    assert np.array_equal(host(kd), kc) and np.array_equal(host(vd), vc)
    assert (split(kc, hd)[0].reshape(-1, nk, hd)[slots[0], 0, 1:5] == [0, 2, 2, -2]).all()
    # int8 views of the pages take the same kernel
    k8, v8 = cp.zeros(kc.shape, cp.int8), cp.zeros(vc.shape, cp.int8)
    gops.write_kv(k8, v8, cp.asarray(k), cp.asarray(v), slots, kv_dtype="int8")
    keep = slots >= 0
    assert np.array_equal(host(k8).reshape(-1, nk, kc.shape[-1])[slots[keep]],
                          INT8.encode_rows(k[keep]))


def _rope_case(rng, nq, nk, hd, gated=False):
    t = 5
    width = nq * hd * (2 if gated else 1) + 2 * nk * hd
    qkv = (rng.standard_normal((t, width + 7)) * 3).astype(np.float32)[:, 7:]   # strided rows
    pos = np.array([0, 3, 17, 100, 4095], dtype=np.int32)
    slots = np.array([0, 5, -1, 33, 47], dtype=np.int64)
    return qkv, pos, slots


def _check_pages(kd, vd, ref_k, ref_v, k32, kc0, slots, hd):
    """V: NumPy's bytes; K: the codec's bytes of the fp32 kernel's K (exactly), and within one
    code and one scale step of NumPy's K; rows of no slot untouched."""
    assert np.array_equal(host(vd), ref_v)
    w = kc0.shape[-1]
    nk = kc0.shape[2]
    rows = slots[slots >= 0]
    got = host(kd).reshape(-1, nk, w)
    assert np.array_equal(got[rows], INT8.encode_rows(cp.asnumpy(k32).reshape(-1, nk, hd)[rows]))
    (c1, s1), (c2, s2) = split(kd, hd), split(ref_k, hd)
    assert np.abs(c1 - c2).max() <= 1 and np.abs(s1 - s2).max() <= 1
    untouched = np.setdiff1d(np.arange(kc0.shape[0] * kc0.shape[1]), rows)
    assert np.array_equal(got[untouched], kc0.reshape(-1, nk, w)[untouched])


@pytest.mark.parametrize("nq,nk,hd,rotary_dim,style", LLAMA + [(8, 2, 64, 32, "adjacent")])
def test_rope_write_kv_int8(gops, nops, rng, nq, nk, hd, rotary_dim, style):
    qkv, pos, slots = _rope_case(rng, nq, nk, hd)
    kc, vc = _pages(rng, 4, 16, nk, hd)
    ref_k, ref_v = kc.copy(), vc.copy()
    ref_q = nops.rope_write_kv(qkv, nq, nk, pos, 500000.0, ref_k, ref_v, slots, style,
                               rotary_dim, kv_dtype="int8")
    kd, vd = cp.asarray(kc), cp.asarray(vc)
    dq = cp.asarray(np.pad(qkv, ((0, 0), (7, 0))))[:, 7:]
    q = gops.rope_write_kv(dq, nq, nk, pos, 500000.0, kd, vd, slots, style, rotary_dim,
                           kv_dtype="int8")
    k32 = cp.zeros((4, 16, nk, hd), cp.float32)
    v32 = cp.zeros_like(k32)
    q32 = gops.rope_write_kv(dq, nq, nk, pos, 500000.0, k32, v32, slots, style, rotary_dim)
    assert rel(q, ref_q) < 2e-5 and cp.array_equal(q, q32)
    _check_pages(kd, vd, ref_k, ref_v, k32, kc, slots, hd)


@pytest.mark.parametrize("nq,nk,hd,rotary_dim,style,gated", [
    (*QWEN[0], True), (8, 2, 64, None, "half", False), (4, 2, 128, 32, "half", True)])
def test_norm_rope_write_kv_int8(gops, nops, rng, nq, nk, hd, rotary_dim, style, gated):
    qkv, pos, slots = _rope_case(rng, nq, nk, hd, gated)
    qn, kn = [(1 + 0.2 * rng.standard_normal(hd)).astype(np.float32) for _ in range(2)]
    kc, vc = _pages(rng, 4, 16, nk, hd)
    ref_k, ref_v = kc.copy(), vc.copy()
    ref_q = nops.norm_rope_write_kv(qkv, nq, nk, gated, qn, kn, 1e-6, pos, 1e7, ref_k, ref_v,
                                    slots, style, rotary_dim, kv_dtype="int8")
    kd, vd = cp.asarray(kc), cp.asarray(vc)
    dq = cp.asarray(np.pad(qkv, ((0, 0), (7, 0))))[:, 7:]
    args = (nq, nk, gated, cp.asarray(qn), cp.asarray(kn), 1e-6, pos, 1e7)
    q = gops.norm_rope_write_kv(dq, *args, kd, vd, slots, style, rotary_dim, kv_dtype="int8")
    k32 = cp.zeros((4, 16, nk, hd), cp.float32)
    v32 = cp.zeros_like(k32)
    q32 = gops.norm_rope_write_kv(dq, *args, k32, v32, slots, style, rotary_dim)
    assert q.shape == (5, nq, hd) and rel(q, ref_q) < 2e-5 and cp.array_equal(q, q32)
    _check_pages(kd, vd, ref_k, ref_v, k32, kc, slots, hd)


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
    kc, vc = _pages(rng, num_pages, ps, nkv, hd)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), nh, hd)).astype(np.float32) * 2
    return q, kc, vc, cu, np.asarray(ctx, np.int32), tables


@pytest.mark.parametrize("q_lens,ctx,nh,nkv,hd", [
    ([1, 1, 1], [17, 300, 5000], 8, 2, 64),             # decode, split-K
    ([1] * 4, [40, 1, 700, 2048], 32, 8, 128),          # Llama-3-8B heads
    ([1, 1], [3, 1500], 6, 1, 256),                     # Qwen3.5-shaped, G 6
    ([37], [37], 8, 2, 64),                             # prefill from empty
    ([50, 1, 7], [120, 9, 7], 32, 8, 128),              # after a cached prefix, mixed
    ([130, 1, 61], [700, 5, 64], 6, 1, 256),            # Qwen3.5-shaped prefill, mixed
])
@pytest.mark.parametrize("prefill_kernel", ["mma", "fp32"])
def test_paged_attention_over_int8_pages(rng, nops, q_lens, ctx, nh, nkv, hd, prefill_kernel):
    """Decode (split-K + attn_merge) and prefill (tensor cores, or float32) over int8 pages
    against the float64 reference over the decoded pages and NumPy's int8 mode; bit-identical
    to fp32 pages of the decoded values."""
    if max(q_lens) == 1 and prefill_kernel != "mma":
        pytest.skip("decode: the prefill kernel is not used")
    gops = get_ops("cupy", kconf(prefill_attention=prefill_kernel))
    q, kc, vc, cu, lens, bt = _attn_case(rng, q_lens, ctx, nh, nkv, hd)
    k32, v32 = decoded(kc, hd), decoded(vc, hd)
    ref = ref_attention(q.astype(np.float64), k32.astype(np.float64), v32.astype(np.float64),
                        cu, lens, bt, hd ** -0.5)
    ref32 = nops.paged_attention(q, kc, vc, cu, lens, bt, hd ** -0.5, kv_dtype="int8")
    qpad = cp.asarray(np.concatenate([q, np.zeros((q.shape[0], 2, hd), np.float32)], axis=1))
    out = gops.paged_attention(qpad[:, :nh], cp.asarray(kc), cp.asarray(vc), cu, lens, bt,
                               hd ** -0.5, kv_dtype="int8")
    fp16 = max(q_lens) > 1 and prefill_kernel == "mma"
    bound = F16_ATTN if fp16 else F32
    assert rel(out, ref) < bound and rel(out, ref32) < bound
    out32 = gops.paged_attention(qpad[:, :nh], cp.asarray(k32), cp.asarray(v32), cu, lens, bt,
                                 hd ** -0.5)
    assert cp.array_equal(out, out32)


@pytest.mark.parametrize("q_lens,ctx,nh,nkv,hd", [
    ([4], [4000], 6, 1, 256),                           # a verify pass at depth (Qwen3.5-shaped)
    ([4, 4, 0, 2], [64, 3000, 5, 9], 6, 1, 256),        # lanes of a batch, one with no rows
    ([2, 1, 8], [2, 700, 1500], 32, 8, 128),            # Llama-3-8B heads, up to 8 rows
])
def test_verify_rows_over_int8_pages(gops, nops, rng, monkeypatch, q_lens, ctx, nh, nkv, hd):
    """A verify pass over int8 pages: ``attn_rows`` then the int8 ``attn_verify`` instance,
    from the one module of (head dim, int8); within float32 of the references, bit-identical
    to fp32 pages of the decoded values."""
    from ninfer.kernels.gpu import attention as gattn
    q, kc, vc, cu, lens, bt = _attn_case(rng, q_lens, ctx, nh, nkv, hd)
    k32, v32 = decoded(kc, hd), decoded(vc, hd)
    ref = ref_attention(q.astype(np.float64), k32.astype(np.float64), v32.astype(np.float64),
                        cu, lens, bt, hd ** -0.5)
    ref32 = nops.paged_attention(q, kc, vc, cu, lens, bt, hd ** -0.5, kv_dtype="int8")
    rows_calls, lookups = [], []
    real_rows, real_function = gattn._rows_as_sequences, gattn.function
    monkeypatch.setattr(gattn, "_rows_as_sequences",
                        lambda *a: rows_calls.append(1) or real_rows(*a))
    monkeypatch.setattr(gattn, "function", lambda name, fname, names=():
                        lookups.append((fname, names)) or real_function(name, fname, names))
    out = gops.paged_attention(cp.asarray(q), cp.asarray(kc), cp.asarray(vc), cu, lens, bt,
                               hd ** -0.5, kv_dtype="int8")
    assert rows_calls and rel(out, ref) < F32 and rel(out, ref32) < F32
    decode = f"attn_verify<signed char,{hd},{nh // nkv}>"
    assert [f for f, _ in lookups][:2] == ["attn_rows", decode]
    assert len({names for _, names in lookups}) == 1 and decode in lookups[0][1]
    out32 = gops.paged_attention(cp.asarray(q), cp.asarray(k32), cp.asarray(v32), cu, lens, bt,
                                 hd ** -0.5)
    assert cp.array_equal(out, out32)


@pytest.mark.parametrize("ctx,nh,nkv,hd,rotary_dim,style", [
    ([1], 8, 2, 64, None, "half"),
    ([17, 300, 5000], 8, 2, 64, None, "half"),
    ([40, 1, 99, 700], 32, 8, 128, None, "half"),
    ([66], 32, 8, 128, None, "half"),
    ([3, 1500], 6, 1, 256, 64, "half"),
])
def test_fused_decode_over_int8_pages(nops, rng, monkeypatch, ctx, nh, nkv, hd, rotary_dim,
                                      style):
    """``rope_paged_attention`` on int8 pages: the fused kernels (the new k / v quantized in
    the kernel and attended to as stored) bit-identical to rope_write_kv then paged_attention,
    outputs and pages; V pages NumPy's bytes, K within one code / scale step of NumPy's; the
    output within float32 of the reference over the pages the GPU wrote."""
    from ninfer.kernels.gpu import attention as gattn
    fused = []
    real = gattn.rope_paged_attention
    monkeypatch.setattr(gattn, "rope_paged_attention",
                        lambda *a, **kw: fused.append(1) or real(*a, **kw))
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
    nops.rope_paged_attention(qkv, *args, ref_k, ref_v, slots, *tail, kv_dtype="int8")
    modes = [("off", 0), ("on", 0), ("rope", 0)]
    if s == 1 and int(cp.cuda.Device().compute_capability) >= 90:
        modes.append(("rope", 8))
    out = []
    for mode, cl in modes:
        ops = get_ops("cupy", kconf(attn_cluster=cl, decode_attention=mode))
        k, v = cp.asarray(kc), cp.asarray(vc)
        o = ops.rope_paged_attention(cp.asarray(qkv), *args, k, v, slots, *tail, kv_dtype="int8")
        out.append((cp.asnumpy(o), host(k), host(v)))
        assert not cp.any(gattn._arrivals())
    assert len(fused) == len(modes) - 1
    o0, k0, v0 = out[0]
    for (mode, cl), (o1, k1, v1) in zip(modes[1:], out[1:]):
        assert np.array_equal(k1, k0) and np.array_equal(v1, v0), mode
        if cl:   # (the clusters partition the context differently: float32 rounding)
            assert rel(o1, o0) < F32
        else:
            assert np.array_equal(o1, o0), mode
    assert np.array_equal(v0, ref_v)
    (c1, s1), (c2, s2) = split(k0, hd), split(ref_k, hd)
    assert np.abs(c1 - c2).max() <= 1 and np.abs(s1 - s2).max() <= 1
    q = nops.rope(qkv[:, :nh * hd].reshape(s, nh, hd), pos, 500000.0, style, rotary_dim)
    ref = ref_attention(q.astype(np.float64), decoded(k0, hd).astype(np.float64),
                        decoded(v0, hd).astype(np.float64), cu, lens, bt, hd ** -0.5)
    assert rel(o0, ref) < F32


def test_tiny_llama_greedy_int8_kv_equals_numpy(rng):
    """Prefill (tensor-core attention over int8 pages) and decode (the fused kernel) of a tiny
    random Llama with int8 KV: the tokens NumPy's int8 mode gives."""
    from test_cupy_kv16 import TINY, _greedy, _tiny_llama_weights, assert_greedy_match

    from ninfer.engine.models.llama import LlamaConfig, LlamaModel
    w = _tiny_llama_weights(rng, TINY)
    prompts = [rng.integers(0, 512, n).tolist() for n in (20, 3, 45)]
    ref, margins = _greedy(LlamaModel(LlamaConfig.from_dict(TINY), w, get_ops("numpy")),
                           prompts, 12, "int8")
    got, _ = _greedy(LlamaModel(LlamaConfig.from_dict(TINY), w, get_ops("cupy")), prompts, 12,
                     "int8")
    assert_greedy_match(got, ref, margins)

"""``--kv-dtype rk8v4 | rk4v4 | rk4v4-e8 | rk2v4-e8`` on the CuPy backend against the NumPy
reference codec (marker ``gpu``; skipped without CUDA).

A rk ``KVCache`` holds uint8 rows per (token, head), K and V each of its codec's width
(``kv_codec``: the Hadamard-rotated 64-dim groups' codes, then their fp16 scales); the backend
takes them as they are (element type ``kvrk<KK>`` of the KV templates). Checked here: the bytes
``write_kv`` stores are NumPy's exactly (zero, tiny and large groups included; head dims 64, 128
and 256); the RoPE writers' bytes are exactly the codec's bytes of the fp32 kernels' K (and V
NumPy's); decode, verify-pass and prefill attention (in the rotated domain: q and the output
rotated, the pages read as code x scale) within the float32 bounds of ``test_cupy_kv8`` of the
float64 reference over the decoded pages and of NumPy's mode; the fused decode kernels
bit-identical to the unfused ones; greedy tokens of a tiny random Llama on both backends. Every
array the GPU code allocates is NaN-poisoned first.

    pytest -q -m gpu tests/kernels/test_cupy_kvrk.py
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from ninfer.engine.kv import KVCache
from ninfer.kernels import get_ops
from ninfer.kernels.attention import paged_attention as ref_attention
from ninfer.kernels.kv_codec import PartCodec, codec, rotate

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from cupy_common import (F32, LLAMA, QWEN, gops, has_gpu, host, kconf, nops,  # noqa: E402,F401
                         poison, rel)


if not has_gpu():
    pytest.skip("no CUDA device", allow_module_level=True)

F16_ATTN = 4e-3    # tensor-core prefill attention: K, V (dequantized), Q and P rounded to fp16
MODES = ("rk8v4", "rk4v4", "rk4v4-e8", "rk2v4-e8")
TYPES = {"rk8v4": "kvrk<0>", "rk4v4": "kvrk<1>", "rk4v4-e8": "kvrk<2>", "rk2v4-e8": "kvrk<3>"}


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()) + 909)


def decoded(mode, rows, hd, v=False) -> np.ndarray:
    """K (V where ``v``) rows of ``mode`` as the float32 values the codec decodes (unrotated)."""
    part = codec(mode).v if v else codec(mode).k
    return part.decode_rows(host(rows), hd)


def rotated_values(mode, rows, hd, v=False) -> np.ndarray:
    """K (V where ``v``) rows of ``mode`` as the attention kernels read them: code x scale in
    the rotated domain (float32; the codec's decode without its inverse rotation)."""
    part = codec(mode).v if v else codec(mode).k
    return PartCodec(part.kind).decode_rows(host(rows), hd)


def _pages(rng, mode, pages, ps, nk, hd) -> list[np.ndarray]:
    """Random K and V pages of ``mode`` as a ``KVCache`` holds them (uint8 codec rows)."""
    c = codec(mode)
    return [part.encode_rows((rng.standard_normal((pages, ps, nk, hd)) * 2).astype(np.float32))
            for part in (c.k, c.v)]


@pytest.mark.parametrize("mode", MODES)
def test_kv_cache_rows_are_taken_as_they_are_and_other_pages_refused(gops, mode):
    from ninfer.kernels.gpu.attention_ops import kv_pages
    from ninfer.kernels.gpu import elementwise as gew
    kv = KVCache(1, 3, 16, 2, 128, zeros=gops.zeros, dtype=mode)
    c = codec(mode)
    assert kv.k[0].shape == (3, 16, 2, c.k.row_bytes(128))
    assert kv.v[0].shape == (3, 16, 2, c.v.row_bytes(128))
    k, v = kv_pages(kv.k[0], kv.v[0], mode)
    assert k.data.ptr == kv.k[0].data.ptr and v.data.ptr == kv.v[0].data.ptr
    assert gew.kv_head_dim(k, mode) == 128 and gew.kv_head_dim(v, mode, True) == 128
    assert gew.kv_type(k, v, mode) == TYPES[mode]
    with pytest.raises(ValueError, match=f"{mode} KV pages must be"):
        kv_pages(cp.zeros((3, 16, 2, 128), cp.uint8), kv.v[0], mode)
    with pytest.raises(ValueError, match=f"{mode} KV pages must be"):
        kv_pages(kv.k[0].view(cp.int8), kv.v[0], mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nk,hd", [(2, 64), (4, 128), (1, 256)])
def test_write_kv_stores_numpys_bytes(gops, nops, rng, mode, nk, hd):
    pages, ps, t = 5, 16, 23
    kc, vc = _pages(rng, mode, pages, ps, nk, hd)
    k = (rng.standard_normal((t, nk, hd)) * 4).astype(np.float32)
    v = (rng.standard_normal((t, nk, hd)) * 4).astype(np.float32)
    k[0, 0, :64] = 0.0                                   # a zero group: scale 0, codes 0
    v[0, 0, :64] = 0.0
    k[1, 0, :64] = rng.standard_normal(64) * 1e-6        # a scale in fp16's subnormals / 0
    v[1, 0, :64] = rng.standard_normal(64) * 1e-6
    k[2, 0, :64] = rng.standard_normal(64) * 3e3         # a large scale
    v[2, 0, :64] = rng.standard_normal(64) * 3e3
    k[3, 0, :64] = np.round(rng.standard_normal(64) * 4)   # small integers: ties after rotation
    k[4, 0, :8] = 1.0                                      # a single point of the lattice
    k[4, 0, 8:64] = 0.0
    slots = rng.permutation(pages * ps)[:t].astype(np.int64)
    slots[5] = -1
    kd, vd = cp.asarray(kc), cp.asarray(vc)
    nops.write_kv(kc, vc, k, v, slots, kv_dtype=mode)
    gops.write_kv(kd, vd, cp.asarray(k), cp.asarray(v), slots, kv_dtype=mode)
    assert np.array_equal(host(kd), kc) and np.array_equal(host(vd), vc)
    keep = slots >= 0
    rows = host(kd).reshape(-1, nk, kc.shape[-1])[slots[keep]]
    assert np.array_equal(rows, codec(mode).k.encode_rows(k[keep]))


@pytest.mark.parametrize("hd", [64, 128, 256])
def test_kv_hadamard_rows_is_kv_codec_rotate_bit_for_bit(gops, rng, hd):
    """``kv_hadamard_rows`` (strided rows into a new array, and in place) gives
    ``kv_codec.rotate``'s float32 bits: the butterfly every rk writer and reader relies on."""
    from ninfer.kernels.gpu import attention as gattn
    t, nh = 7, 3
    x = (rng.standard_normal((t, nh + 1, hd)) * np.array([1e-3, 1.0, 1e3, 7.0])[None, :, None]
         ).astype(np.float32)
    xd = cp.asarray(x)
    y = gattn.hadamard_rows(gops.config, hd, TYPES["rk4v4"], xd[:, :nh])
    assert np.array_equal(cp.asnumpy(y), rotate(x[:, :nh]))
    z = cp.ascontiguousarray(xd[:, :nh])
    gattn.hadamard_rows(gops.config, hd, TYPES["rk4v4"], z, z)
    assert np.array_equal(cp.asnumpy(z), rotate(x[:, :nh]))
    one = cp.ascontiguousarray(xd[:1])
    assert np.array_equal(cp.asnumpy(gattn.hadamard_rows(gops.config, hd, TYPES["rk2v4-e8"],
                                                          one)), rotate(x[:1]))


def _rope_case(rng, nq, nk, hd, gated=False):
    t = 5
    width = nq * hd * (2 if gated else 1) + 2 * nk * hd
    qkv = (rng.standard_normal((t, width + 7)) * 3).astype(np.float32)[:, 7:]   # strided rows
    pos = np.array([0, 3, 17, 100, 4095], dtype=np.int32)
    slots = np.array([0, 5, -1, 33, 47], dtype=np.int64)
    return qkv, pos, slots


def _check_pages(mode, kd, vd, ref_v, k32, kc0, vc0, slots, hd):
    """V: NumPy's bytes; K: the codec's bytes of the fp32 kernel's K, exactly (NumPy's float32
    RoPE may differ in the last bits); rows of no slot untouched."""
    assert np.array_equal(host(vd), ref_v)
    nk, w = kc0.shape[2], kc0.shape[-1]
    rows = slots[slots >= 0]
    got = host(kd).reshape(-1, nk, w)
    assert np.array_equal(got[rows],
                          codec(mode).k.encode_rows(cp.asnumpy(k32).reshape(-1, nk, hd)[rows]))
    untouched = np.setdiff1d(np.arange(kc0.shape[0] * kc0.shape[1]), rows)
    assert np.array_equal(got[untouched], kc0.reshape(-1, nk, w)[untouched])
    assert np.array_equal(host(vd).reshape(-1, nk, vc0.shape[-1])[untouched],
                          vc0.reshape(-1, nk, vc0.shape[-1])[untouched])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nq,nk,hd,rotary_dim,style", LLAMA + [(8, 2, 64, 32, "adjacent")]
                         + [(6, 1, 256, None, "half")])
def test_rope_write_kv_rk(gops, nops, rng, mode, nq, nk, hd, rotary_dim, style):
    qkv, pos, slots = _rope_case(rng, nq, nk, hd)
    kc, vc = _pages(rng, mode, 4, 16, nk, hd)
    ref_k, ref_v = kc.copy(), vc.copy()
    ref_q = nops.rope_write_kv(qkv, nq, nk, pos, 500000.0, ref_k, ref_v, slots, style,
                               rotary_dim, kv_dtype=mode)
    kd, vd = cp.asarray(kc), cp.asarray(vc)
    dq = cp.asarray(np.pad(qkv, ((0, 0), (7, 0))))[:, 7:]
    q = gops.rope_write_kv(dq, nq, nk, pos, 500000.0, kd, vd, slots, style, rotary_dim,
                           kv_dtype=mode)
    k32 = cp.zeros((4, 16, nk, hd), cp.float32)
    v32 = cp.zeros_like(k32)
    q32 = gops.rope_write_kv(dq, nq, nk, pos, 500000.0, k32, v32, slots, style, rotary_dim)
    assert rel(q, ref_q) < 2e-5 and cp.array_equal(q, q32)
    _check_pages(mode, kd, vd, ref_v, k32, kc, vc, slots, hd)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nq,nk,hd,rotary_dim,style,gated", [
    (*QWEN[0], True), (8, 2, 64, None, "half", False), (4, 2, 128, 32, "half", True)])
def test_norm_rope_write_kv_rk(gops, nops, rng, mode, nq, nk, hd, rotary_dim, style, gated):
    qkv, pos, slots = _rope_case(rng, nq, nk, hd, gated)
    qn, kn = [(1 + 0.2 * rng.standard_normal(hd)).astype(np.float32) for _ in range(2)]
    kc, vc = _pages(rng, mode, 4, 16, nk, hd)
    ref_k, ref_v = kc.copy(), vc.copy()
    ref_q = nops.norm_rope_write_kv(qkv, nq, nk, gated, qn, kn, 1e-6, pos, 1e7, ref_k, ref_v,
                                    slots, style, rotary_dim, kv_dtype=mode)
    kd, vd = cp.asarray(kc), cp.asarray(vc)
    dq = cp.asarray(np.pad(qkv, ((0, 0), (7, 0))))[:, 7:]
    args = (nq, nk, gated, cp.asarray(qn), cp.asarray(kn), 1e-6, pos, 1e7)
    q = gops.norm_rope_write_kv(dq, *args, kd, vd, slots, style, rotary_dim, kv_dtype=mode)
    k32 = cp.zeros((4, 16, nk, hd), cp.float32)
    v32 = cp.zeros_like(k32)
    q32 = gops.norm_rope_write_kv(dq, *args, k32, v32, slots, style, rotary_dim)
    assert q.shape == (5, nq, hd) and rel(q, ref_q) < 2e-5 and cp.array_equal(q, q32)
    _check_pages(mode, kd, vd, ref_v, k32, kc, vc, slots, hd)


def _attn_case(rng, mode, q_lens, ctx, nh, nkv, hd, ps=16):
    s = len(q_lens)
    need = [-(-c // ps) for c in ctx]
    num_pages = sum(need) + 3
    perm = rng.permutation(num_pages)
    tables = np.full((s, max(need) + 2), -1, np.int32)
    o = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[o:o + n]
        o += n
    kc, vc = _pages(rng, mode, num_pages, ps, nkv, hd)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), nh, hd)).astype(np.float32) * 2
    return q, kc, vc, cu, np.asarray(ctx, np.int32), tables


def _refs(nops, mode, q, kc, vc, cu, lens, bt, hd):
    """(float64 reference over the decoded pages, NumPy's float32 mode)."""
    k64, v64 = decoded(mode, kc, hd), decoded(mode, vc, hd, v=True)
    ref = ref_attention(q.astype(np.float64), k64.astype(np.float64), v64.astype(np.float64),
                        cu, lens, bt, hd ** -0.5)
    return ref, nops.paged_attention(q, kc, vc, cu, lens, bt, hd ** -0.5, kv_dtype=mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("q_lens,ctx,nh,nkv,hd", [
    ([1, 1, 1], [17, 300, 5000], 8, 2, 64),             # decode, split-K
    ([1] * 4, [40, 1, 700, 2048], 32, 8, 128),          # Llama-3-8B heads
    ([1, 1], [3, 1500], 6, 1, 256),                     # Qwen3.5-shaped, G 6
    ([37], [37], 8, 2, 64),                             # prefill from empty
    ([50, 1, 7], [120, 9, 7], 32, 8, 128),              # after a cached prefix, mixed
    ([130, 1, 61], [700, 5, 64], 6, 1, 256),            # Qwen3.5-shaped prefill, mixed
])
@pytest.mark.parametrize("prefill_kernel", ["mma", "fp32"])
def test_paged_attention_over_rk_pages(rng, nops, mode, q_lens, ctx, nh, nkv, hd,
                                       prefill_kernel):
    """Decode (split-K + attn_merge) and prefill (tensor cores, or float32) over rk pages,
    q and the output rotated, against the float64 reference over the decoded pages and
    NumPy's mode."""
    if max(q_lens) == 1 and prefill_kernel != "mma":
        pytest.skip("decode: the prefill kernel is not used")
    gops = get_ops("cupy", kconf(prefill_attention=prefill_kernel))
    q, kc, vc, cu, lens, bt = _attn_case(rng, mode, q_lens, ctx, nh, nkv, hd)
    ref, ref32 = _refs(nops, mode, q, kc, vc, cu, lens, bt, hd)
    qpad = cp.asarray(np.concatenate([q, np.zeros((q.shape[0], 2, hd), np.float32)], axis=1))
    out = gops.paged_attention(qpad[:, :nh], cp.asarray(kc), cp.asarray(vc), cu, lens, bt,
                               hd ** -0.5, kv_dtype=mode)
    bound = F16_ATTN if max(q_lens) > 1 and prefill_kernel == "mma" else F32
    assert out.shape == q.shape and rel(out, ref) < bound and rel(out, ref32) < bound
    # bit for bit: the float32-page kernels over the rotated-domain values (code x scale) with
    # q rotated, the output rotated back (kv_codec.rotate is the GPU's butterfly, bit for bit)
    out32 = gops.paged_attention(cp.asarray(rotate(q)), cp.asarray(rotated_values(mode, kc, hd)),
                                 cp.asarray(rotated_values(mode, vc, hd, v=True)), cu, lens, bt,
                                 hd ** -0.5)
    assert np.array_equal(cp.asnumpy(out), rotate(cp.asnumpy(out32)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("q_lens,ctx,nh,nkv,hd", [
    ([4], [4000], 6, 1, 256),                           # a verify pass at depth (Qwen3.5-shaped)
    ([4, 4, 0, 2], [64, 3000, 5, 9], 6, 1, 256),        # lanes of a batch, one with no rows
    ([2, 1, 8], [2, 700, 1500], 32, 8, 128),            # Llama-3-8B heads, up to 8 rows
])
def test_verify_rows_over_rk_pages(gops, nops, rng, monkeypatch, mode, q_lens, ctx, nh, nkv,
                                   hd):
    """A verify pass over rk pages: ``kv_hadamard_rows``, ``attn_rows``, the rk
    ``attn_verify`` instance (and ``kv_hadamard_rows`` back), from the one module of (head dim,
    mode); within float32 of the references."""
    from ninfer.kernels.gpu import attention as gattn
    q, kc, vc, cu, lens, bt = _attn_case(rng, mode, q_lens, ctx, nh, nkv, hd)
    ref, ref32 = _refs(nops, mode, q, kc, vc, cu, lens, bt, hd)
    rows_calls, lookups = [], []
    real_rows, real_function = gattn._rows_as_sequences, gattn.function
    monkeypatch.setattr(gattn, "_rows_as_sequences",
                        lambda *a: rows_calls.append(1) or real_rows(*a))
    monkeypatch.setattr(gattn, "function", lambda name, fname, names=():
                        lookups.append((fname, names)) or real_function(name, fname, names))
    out = gops.paged_attention(cp.asarray(q), cp.asarray(kc), cp.asarray(vc), cu, lens, bt,
                               hd ** -0.5, kv_dtype=mode)
    assert rows_calls and rel(out, ref) < F32 and rel(out, ref32) < F32
    decode = f"attn_verify<{TYPES[mode]},{hd},{nh // nkv}>"
    fnames = [f for f, _ in lookups]
    assert fnames[0] == "kv_hadamard_rows" and fnames[-1] == "kv_hadamard_rows"
    assert "attn_rows" in fnames and decode in fnames
    assert len({names for _, names in lookups}) == 1 and decode in lookups[0][1]
    out32 = gops.paged_attention(cp.asarray(rotate(q)), cp.asarray(rotated_values(mode, kc, hd)),
                                 cp.asarray(rotated_values(mode, vc, hd, v=True)), cu, lens, bt,
                                 hd ** -0.5)
    assert np.array_equal(cp.asnumpy(out), rotate(cp.asnumpy(out32)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ctx,nh,nkv,hd,rotary_dim,style", [
    ([1], 8, 2, 64, None, "half"),
    ([17, 300, 5000], 8, 2, 64, None, "half"),
    ([40, 1, 99, 700], 32, 8, 128, None, "half"),
    ([66], 32, 8, 128, None, "half"),
    ([3, 1500], 6, 1, 256, 64, "half"),
])
def test_fused_decode_over_rk_pages(nops, rng, monkeypatch, mode, ctx, nh, nkv, hd, rotary_dim,
                                    style):
    """``rope_paged_attention`` on rk pages: the fused kernels (q rotated and the new k / v
    quantized in the kernel, attended to as stored) bit-identical to rope_write_kv then
    paged_attention, outputs and pages; V pages NumPy's bytes, K the codec's bytes of the fp32
    kernels' K; the output within float32 of the reference over the pages the GPU wrote."""
    from ninfer.kernels.gpu import attention as gattn
    fused = []
    real = gattn.rope_paged_attention
    monkeypatch.setattr(gattn, "rope_paged_attention",
                        lambda *a, **kw: fused.append(1) or real(*a, **kw))
    s = len(ctx)
    _, kc, vc, cu, lens, bt = _attn_case(rng, mode, [1] * s, ctx, nh, nkv, hd)
    qkv = rng.standard_normal((s, (nh + 2 * nkv) * hd)).astype(np.float32)
    pos = (lens - 1).astype(np.int32)
    ps = kc.shape[1]
    slots = np.array([bt[i, (n - 1) // ps] * ps + (n - 1) % ps for i, n in enumerate(ctx)],
                     np.int64)
    slots[-1] = -1 if s > 1 else slots[-1]        # a padded lane: no KV write
    args = (nh, nkv, pos, 500000.0)
    tail = (cu, lens, bt, hd ** -0.5, style, rotary_dim)
    ref_k, ref_v = kc.copy(), vc.copy()
    nops.rope_paged_attention(qkv, *args, ref_k, ref_v, slots, *tail, kv_dtype=mode)
    modes = [("off", 0), ("on", 0), ("rope", 0)]
    if s == 1 and int(cp.cuda.Device().compute_capability) >= 90:
        modes.append(("rope", 8))
    out = []
    for dmode, cl in modes:
        ops = get_ops("cupy", kconf(attn_cluster=cl, decode_attention=dmode))
        k, v = cp.asarray(kc), cp.asarray(vc)
        o = ops.rope_paged_attention(cp.asarray(qkv), *args, k, v, slots, *tail, kv_dtype=mode)
        out.append((cp.asnumpy(o), host(k), host(v)))
        assert not cp.any(gattn._arrivals())
    assert len(fused) == len(modes) - 1
    o0, k0, v0 = out[0]
    for (dmode, cl), (o1, k1, v1) in zip(modes[1:], out[1:]):
        assert np.array_equal(k1, k0) and np.array_equal(v1, v0), dmode
        if cl:   # (the clusters partition the context differently: float32 rounding)
            assert rel(o1, o0) < F32
        else:
            assert np.array_equal(o1, o0), dmode
    assert np.array_equal(v0, ref_v)
    k32 = cp.zeros((kc.shape[0], ps, nkv, hd), cp.float32)
    get_ops("cupy").rope_write_kv(cp.asarray(qkv), nh, nkv, pos, 500000.0, k32,
                                  cp.zeros_like(k32), slots, style, rotary_dim)
    w = slots[slots >= 0]
    assert np.array_equal(k0.reshape(-1, nkv, kc.shape[-1])[w], codec(mode).k.encode_rows(
        cp.asnumpy(k32).reshape(-1, nkv, hd)[w]))
    q = nops.rope(qkv[:, :nh * hd].reshape(s, nh, hd), pos, 500000.0, style, rotary_dim)
    ref = ref_attention(q.astype(np.float64), decoded(mode, k0, hd).astype(np.float64),
                        decoded(mode, v0, hd, v=True).astype(np.float64), cu, lens, bt,
                        hd ** -0.5)
    assert rel(o0, ref) < F32


@pytest.mark.parametrize("mode", MODES)
def test_tiny_llama_greedy_rk_kv_equals_numpy(rng, mode):
    """Prefill (tensor-core attention over rk pages) and decode (the fused kernel) of a tiny
    random Llama with rk KV: the tokens NumPy's mode gives."""
    from test_cupy_kv16 import TINY, _greedy, _tiny_llama_weights, assert_greedy_match

    from ninfer.engine.models.llama import LlamaConfig, LlamaModel
    w = _tiny_llama_weights(rng, TINY)
    prompts = [rng.integers(0, 512, n).tolist() for n in (20, 3, 45)]
    ref, margins = _greedy(LlamaModel(LlamaConfig.from_dict(TINY), w, get_ops("numpy")),
                           prompts, 12, mode)
    got, _ = _greedy(LlamaModel(LlamaConfig.from_dict(TINY), w, get_ops("cupy")), prompts, 12,
                     mode)
    assert_greedy_match(got, ref, margins)

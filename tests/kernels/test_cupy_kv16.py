"""``--kv-dtype fp16`` on the CuPy backend against the NumPy reference's fp16 mode (marker
``gpu``; skipped without CUDA).

The KV kernels are templates over the page element type; an fp16 ``KVCache`` holds uint8 rows of
2 hd bytes, which the backend views as float16. A write stores float32 rounded to nearest even
(NumPy's ``astype(float16)``); attention reads fp16 and computes in float32. Checked here: the
pages' bytes (V and ``write_kv`` exactly as NumPy's; rotated K exactly the fp16 rounding of the
fp32 kernels' K, and within one fp16 ulp of NumPy's, whose float32 RoPE differs in the last
bits), decode, verify-pass (the decode split-K, a row a sequence) and prefill attention within
the float32 bounds of ``test_cupy_ops`` (the tensor-core prefill: fp16 operands) of the float64
reference over the same fp16 pages, the fused decode kernel bit-identical to the unfused
kernels on fp16 pages, and greedy tokens of tiny random models on both backends. Every array
the GPU code allocates is NaN-poisoned first.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from ninfer.engine.kv import KVCache
from ninfer.kernels import get_ops
from ninfer.kernels.attention import paged_attention as ref_attention

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from cupy_common import (F32, LLAMA, QWEN, gops, has_gpu, kconf, nops, poison,  # noqa: E402,F401
                         rel)


if not has_gpu():
    pytest.skip("no CUDA device", allow_module_level=True)

F16_ATTN = 4e-3    # tensor-core prefill attention: Q and P rounded to fp16 too


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()) + 1616)


def halves(rows) -> np.ndarray:
    """fp16 pages (uint8 rows of 2 hd bytes, or float16) as float16 (host)."""
    a = cp.asnumpy(rows) if isinstance(rows, cp.ndarray) else np.asarray(rows)
    return np.ascontiguousarray(a).view(np.float16)


def ulps(a, b) -> int:
    """Largest distance in fp16 steps between two same-signed fp16 arrays."""
    return int(np.abs(halves(a).view(np.int16).astype(np.int32)
                      - halves(b).view(np.int16).astype(np.int32)).max())


def _pages(rng, pages, ps, nk, hd) -> list[np.ndarray]:
    """Random fp16 K and V pages as a ``KVCache`` holds them (uint8 rows)."""
    return [np.ascontiguousarray(rng.standard_normal((pages, ps, nk, hd)).astype(np.float16))
            .view(np.uint8) for _ in range(2)]


def test_kv_cache_rows_view_as_float16_and_other_pages_are_refused(gops):
    from ninfer.kernels.gpu.attention_ops import kv_pages
    kv = KVCache(1, 3, 16, 2, 64, zeros=gops.zeros, dtype="fp16")
    assert kv.k[0].dtype == cp.uint8 and kv.k[0].shape == (3, 16, 2, 128)
    k, v = kv_pages(kv.k[0], kv.v[0], "fp16")
    assert k.dtype == cp.float16 and k.shape == (3, 16, 2, 64) and k.data.ptr == kv.k[0].data.ptr
    f32 = cp.zeros((3, 16, 2, 64), cp.float32)
    with pytest.raises(ValueError, match="fp16 KV pages must be float16"):
        kv_pages(f32, f32, "fp16")
    with pytest.raises(ValueError, match="fp32 KV pages must be float32"):
        kv_pages(k, v, "fp32")
    with pytest.raises(ValueError, match="stores KV as fp32, fp16, int8, rk8v4, .* only"):
        kv_pages(kv.k[0], kv.v[0], "bf16")
    from ninfer.kernels.gpu import elementwise as gew
    with pytest.raises(ValueError, match="float32 or both float16"):
        gew.kv_type(k, f32)
    with pytest.raises(ValueError, match="float32 or both float16"):
        gew.kv_type(kv.k[0], kv.v[0])   # (uint8 rows: kv_pages views them first)


@pytest.mark.parametrize("nk,hd", [(2, 64), (4, 128), (1, 256)])
def test_write_kv_stores_numpys_fp16_bytes(gops, nops, rng, nk, hd):
    pages, ps, t = 5, 16, 23
    kc, vc = _pages(rng, pages, ps, nk, hd)
    k = (rng.standard_normal((t, nk, hd)) * 4).astype(np.float32)
    v = (rng.standard_normal((t, nk, hd)) * 4).astype(np.float32)
    k[0, 0, :4] = [65504.0, -1e-8, 6e-5, 2049.0]   # fp16 max, underflow, subnormal, a tie
    slots = rng.permutation(pages * ps)[:t].astype(np.int64)
    slots[5] = -1
    kd, vd = cp.asarray(kc), cp.asarray(vc)
    nops.write_kv(kc, vc, k, v, slots, kv_dtype="fp16")
    gops.write_kv(kd, vd, cp.asarray(k), cp.asarray(v), slots, kv_dtype="fp16")
    assert np.array_equal(cp.asnumpy(kd), kc) and np.array_equal(cp.asnumpy(vd), vc)
    # float16 pages (not KVCache's rows) take the same kernel
    kh, vh = cp.zeros((pages, ps, nk, hd), cp.float16), cp.zeros((pages, ps, nk, hd), cp.float16)
    gops.write_kv(kh, vh, cp.asarray(k), cp.asarray(v), slots, kv_dtype="fp16")
    keep = slots >= 0
    assert np.array_equal(halves(kh).reshape(-1, nk, hd)[slots[keep]],
                          k[keep].astype(np.float16))


def _rope_case(rng, nq, nk, hd, gated=False):
    t = 5
    width = nq * hd * (2 if gated else 1) + 2 * nk * hd
    qkv = (rng.standard_normal((t, width + 7)) * 3).astype(np.float32)[:, 7:]   # strided rows
    pos = np.array([0, 3, 17, 100, 4095], dtype=np.int32)
    slots = np.array([0, 5, -1, 33, 47], dtype=np.int64)
    return qkv, pos, slots


def _check_pages(kd, vd, ref_k, ref_v, k32, kc0, slots):
    """V: NumPy's bytes; K: the fp16 rounding of the fp32 kernel's K (exactly) and within one
    fp16 ulp of NumPy's; rows of no slot untouched."""
    assert np.array_equal(cp.asnumpy(vd), ref_v)
    row_bytes = kc0.shape[2] * kc0.shape[3]          # (the pages are uint8 rows: 2 bytes a value)
    rows = slots[slots >= 0]
    assert np.array_equal(halves(kd).reshape(-1, row_bytes // 2)[rows],
                          cp.asnumpy(k32).reshape(-1, row_bytes // 2)[rows].astype(np.float16))
    assert ulps(kd, ref_k) <= 1
    untouched = np.setdiff1d(np.arange(kc0.shape[0] * kc0.shape[1]), rows)
    assert np.array_equal(cp.asnumpy(kd).reshape(-1, row_bytes)[untouched],
                          kc0.reshape(-1, row_bytes)[untouched])


@pytest.mark.parametrize("nq,nk,hd,rotary_dim,style", LLAMA + [(8, 2, 64, 32, "adjacent")])
def test_rope_write_kv_fp16(gops, nops, rng, nq, nk, hd, rotary_dim, style):
    qkv, pos, slots = _rope_case(rng, nq, nk, hd)
    kc, vc = _pages(rng, 4, 16, nk, hd)
    ref_k, ref_v = kc.copy(), vc.copy()
    ref_q = nops.rope_write_kv(qkv, nq, nk, pos, 500000.0, ref_k, ref_v, slots, style,
                               rotary_dim, kv_dtype="fp16")
    kd, vd = cp.asarray(kc), cp.asarray(vc)
    dq = cp.asarray(np.pad(qkv, ((0, 0), (7, 0))))[:, 7:]
    q = gops.rope_write_kv(dq, nq, nk, pos, 500000.0, kd, vd, slots, style, rotary_dim,
                           kv_dtype="fp16")
    k32 = cp.zeros((4, 16, nk, hd), cp.float32)
    v32 = cp.zeros_like(k32)
    q32 = gops.rope_write_kv(dq, nq, nk, pos, 500000.0, k32, v32, slots, style, rotary_dim)
    assert rel(q, ref_q) < 2e-5 and cp.array_equal(q, q32)
    _check_pages(kd, vd, ref_k, ref_v, k32, kc, slots)


@pytest.mark.parametrize("nq,nk,hd,rotary_dim,style,gated", [
    (*QWEN[0], True), (8, 2, 64, None, "half", False), (4, 2, 128, 32, "half", True)])
def test_norm_rope_write_kv_fp16(gops, nops, rng, nq, nk, hd, rotary_dim, style, gated):
    """Qwen3.5's gated attention q / k preparation (per-head RMSNorm, partial RoPE, KV write)."""
    qkv, pos, slots = _rope_case(rng, nq, nk, hd, gated)
    qn, kn = [(1 + 0.2 * rng.standard_normal(hd)).astype(np.float32) for _ in range(2)]
    kc, vc = _pages(rng, 4, 16, nk, hd)
    ref_k, ref_v = kc.copy(), vc.copy()
    ref_q = nops.norm_rope_write_kv(qkv, nq, nk, gated, qn, kn, 1e-6, pos, 1e7, ref_k, ref_v,
                                    slots, style, rotary_dim, kv_dtype="fp16")
    kd, vd = cp.asarray(kc), cp.asarray(vc)
    dq = cp.asarray(np.pad(qkv, ((0, 0), (7, 0))))[:, 7:]
    args = (nq, nk, gated, cp.asarray(qn), cp.asarray(kn), 1e-6, pos, 1e7)
    q = gops.norm_rope_write_kv(dq, *args, kd, vd, slots, style, rotary_dim, kv_dtype="fp16")
    k32 = cp.zeros((4, 16, nk, hd), cp.float32)
    v32 = cp.zeros_like(k32)
    q32 = gops.norm_rope_write_kv(dq, *args, k32, v32, slots, style, rotary_dim)
    assert q.shape == (5, nq, hd) and rel(q, ref_q) < 2e-5 and cp.array_equal(q, q32)
    _check_pages(kd, vd, ref_k, ref_v, k32, kc, slots)


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
def test_paged_attention_over_fp16_pages(rng, nops, q_lens, ctx, nh, nkv, hd, prefill_kernel):
    """Decode (split-K + attn_merge) and prefill (tensor cores, or float32) over fp16 pages
    against the float64 reference over the same fp16 values, and NumPy's fp16 mode."""
    if max(q_lens) == 1 and prefill_kernel != "mma":
        pytest.skip("decode: the prefill kernel is not used")
    gops = get_ops("cupy", kconf(prefill_attention=prefill_kernel))
    q, kc, vc, cu, lens, bt = _attn_case(rng, q_lens, ctx, nh, nkv, hd)
    ref = ref_attention(q.astype(np.float64), halves(kc).astype(np.float64),
                        halves(vc).astype(np.float64), cu, lens, bt, hd ** -0.5)
    ref32 = nops.paged_attention(q, kc, vc, cu, lens, bt, hd ** -0.5, kv_dtype="fp16")
    qpad = cp.asarray(np.concatenate([q, np.zeros((q.shape[0], 2, hd), np.float32)], axis=1))
    out = gops.paged_attention(qpad[:, :nh], cp.asarray(kc), cp.asarray(vc), cu, lens, bt,
                               hd ** -0.5, kv_dtype="fp16")
    fp16 = max(q_lens) > 1 and prefill_kernel == "mma"
    bound = F16_ATTN if fp16 else F32
    assert rel(out, ref) < bound and rel(out, ref32) < bound
    # the same values in fp32 pages: the same output (the kernels read floats either way)
    out32 = gops.paged_attention(qpad[:, :nh], cp.asarray(halves(kc).astype(np.float32)),
                                 cp.asarray(halves(vc).astype(np.float32)), cu, lens, bt,
                                 hd ** -0.5)
    assert cp.array_equal(out, out32)


@pytest.mark.parametrize("q_lens,ctx,nh,nkv,hd", [
    ([37], [37], 8, 2, 128),                            # prefill from empty, one block a head
    ([50, 1, 7], [120, 9, 7], 32, 8, 128),              # after a cached prefix, mixed
    ([130, 1, 61], [700, 5, 64], 6, 1, 256),            # Qwen3.5-shaped prefill, mixed
    ([300, 90], [1000, 90], 24, 4, 256),                # 27B heads: 1,800 rows, a ragged tile
    ([9], [3000], 24, 4, 256),                          # short rows deep (a warpgroup idle)
])
def test_wgmma_prefill_attention_over_fp16_pages(rng, nops, monkeypatch, q_lens, ctx, nh, nkv,
                                                 hd):
    """``prefill_attention="wgmma"`` (``attn_prefill_wgmma``, Hopper's warpgroup MMAs) against
    the float64 reference over the same fp16 values within the tensor-core bound, and near
    ``attn_prefill_mma`` (the same fp16 operands, the sums in another order)."""
    from ninfer.kernels.gpu import attention as gattn
    if not gattn.sm90a():
        pytest.skip("sm_90a only")
    q, kc, vc, cu, lens, bt = _attn_case(rng, q_lens, ctx, nh, nkv, hd)
    ref = ref_attention(q.astype(np.float64), halves(kc).astype(np.float64),
                        halves(vc).astype(np.float64), cu, lens, bt, hd ** -0.5)
    calls, real = [], gattn._prefill_wgmma
    monkeypatch.setattr(gattn, "_prefill_wgmma", lambda *a: calls.append(1) or real(*a))
    args = (cp.asarray(q), cp.asarray(kc), cp.asarray(vc), cu, lens, bt, hd ** -0.5)
    out = get_ops("cupy", kconf(prefill_attention="wgmma")).paged_attention(*args,
                                                                            kv_dtype="fp16")
    mma = get_ops("cupy", kconf(prefill_attention="mma")).paged_attention(*args,
                                                                          kv_dtype="fp16")
    assert calls
    err = rel(out, ref)
    near = rel(out, cp.asnumpy(mma))
    assert F32 / 10 < err < F16_ATTN and near < F16_ATTN, (err, near)
    assert cp.array_equal(out, get_ops("cupy", kconf(prefill_attention="wgmma"))
                          .paged_attention(*args, kv_dtype="fp16"))   # (no race)


@pytest.mark.parametrize("q_lens,ctx,nh,nkv,hd", [
    ([4], [4000], 6, 1, 256),                           # a verify pass at depth (Qwen3.5-shaped)
    ([4, 4, 0, 2], [64, 3000, 5, 9], 6, 1, 256),        # lanes of a batch, one with no rows
    ([2, 1, 8], [2, 700, 1500], 32, 8, 128),            # Llama-3-8B heads, up to 8 rows
])
def test_verify_rows_over_fp16_pages(gops, rng, monkeypatch, q_lens, ctx, nh, nkv, hd):
    """A verify pass (at most ``verify_rows`` rows a sequence) over fp16 pages: ``attn_rows``
    then the fp16 ``attn_verify`` instance (and ``attn_merge``), all from the one module of
    (head dim, fp16) that the decode path compiles; within float32 of the float64 reference over
    the same fp16 values, bit-identical to fp32 pages of those values; ``verify_rows=0`` takes
    the tensor-core prefill kernel again."""
    from ninfer.kernels.gpu import attention as gattn
    q, kc, vc, cu, lens, bt = _attn_case(rng, q_lens, ctx, nh, nkv, hd)
    k16, v16 = halves(kc), halves(vc)
    ref = ref_attention(q.astype(np.float64), k16.astype(np.float64), v16.astype(np.float64),
                        cu, lens, bt, hd ** -0.5)
    rows_calls, lookups = [], []
    real_rows, real_function = gattn._rows_as_sequences, gattn.function
    monkeypatch.setattr(gattn, "_rows_as_sequences",
                        lambda *a: rows_calls.append(1) or real_rows(*a))
    monkeypatch.setattr(gattn, "function", lambda name, fname, names=():
                        lookups.append((fname, names)) or real_function(name, fname, names))
    kd, vd = cp.asarray(kc), cp.asarray(vc)
    out = gops.paged_attention(cp.asarray(q), kd, vd, cu, lens, bt, hd ** -0.5, kv_dtype="fp16")
    assert rows_calls and rel(out, ref) < F32
    decode = f"attn_verify<unsigned short,{hd},{nh // nkv}>"
    assert [f for f, _ in lookups][:2] == ["attn_rows", decode]
    assert len({names for _, names in lookups}) == 1 and decode in lookups[0][1]
    out32 = gops.paged_attention(cp.asarray(q), cp.asarray(k16.astype(np.float32)),
                                 cp.asarray(v16.astype(np.float32)), cu, lens, bt, hd ** -0.5)
    assert cp.array_equal(out, out32)
    off = get_ops("cupy", kconf(verify_rows=0))
    rows_calls.clear()
    err = rel(off.paged_attention(cp.asarray(q), kd, vd, cu, lens, bt, hd ** -0.5,
                                  kv_dtype="fp16"), ref)
    assert not rows_calls and F32 / 10 < err < F16_ATTN


@pytest.mark.parametrize("ctx,nh,nkv,hd,rotary_dim,style", [
    ([1], 8, 2, 64, None, "half"),
    ([17, 300, 5000], 8, 2, 64, None, "half"),
    ([40, 1, 99, 700], 32, 8, 128, None, "half"),
    ([66], 32, 8, 128, None, "half"),
    ([3, 1500], 6, 1, 256, 64, "half"),
])
def test_fused_decode_over_fp16_pages(nops, rng, monkeypatch, ctx, nh, nkv, hd, rotary_dim,
                                      style):
    """``rope_paged_attention`` on fp16 pages: the fused kernels ("on": merge by the last
    block, "rope": attn_merge; and the cluster merge where the GPU has clusters) bit-identical
    to rope_write_kv then paged_attention ("off"), outputs and pages; the pages as
    ``test_rope_write_kv_fp16`` checks them; the output within float32 of the NumPy reference
    over the pages the GPU wrote."""
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
    nops.rope_paged_attention(qkv, *args, ref_k, ref_v, slots, *tail, kv_dtype="fp16")
    modes = [("off", 0), ("on", 0), ("rope", 0)]
    if s == 1 and int(cp.cuda.Device().compute_capability) >= 90:
        modes.append(("rope", 8))
    out = []
    for mode, cl in modes:
        ops = get_ops("cupy", kconf(attn_cluster=cl, decode_attention=mode))
        k, v = cp.asarray(kc), cp.asarray(vc)
        o = ops.rope_paged_attention(cp.asarray(qkv), *args, k, v, slots, *tail, kv_dtype="fp16")
        out.append((cp.asnumpy(o), cp.asnumpy(k), cp.asnumpy(v)))
        assert not cp.any(gattn._arrivals())
    assert len(fused) == len(modes) - 1
    o0, k0, v0 = out[0]
    for (mode, cl), (o1, k1, v1) in zip(modes[1:], out[1:]):
        assert np.array_equal(k1, k0) and np.array_equal(v1, v0), mode
        if cl:   # (the clusters partition the context differently: float32 rounding)
            assert rel(o1, o0) < F32
        else:
            assert np.array_equal(o1, o0), mode
    assert np.array_equal(v0, ref_v) and ulps(k0, ref_k) <= 1
    q = nops.rope(qkv[:, :nh * hd].reshape(s, nh, hd), pos, 500000.0, style, rotary_dim)
    ref = ref_attention(q.astype(np.float64), halves(k0).astype(np.float64),
                        halves(v0).astype(np.float64), cu, lens, bt, hd ** -0.5)
    assert rel(o0, ref) < F32


# engine level: greedy tokens of tiny random models on both backends, fp16 KV

TINY = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, head_dim=64, intermediate_size=512, rope_theta=10000.0,
            rms_norm_eps=1e-5, tie_word_embeddings=False)


def _tiny_llama_weights(rng, c):
    """float32 weights (the GPU's float32 GEMMs: logits within float32 of NumPy's)."""
    from ninfer.store.quant import QuantTensor
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    qd, kd = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]

    def f32(*shape, scale=1.0):
        return QuantTensor("f32", shape, data=(rng.standard_normal(shape) * scale)
                           .astype(np.float32))

    w = {"model.embed_tokens.weight": f32(v, h), "model.norm.weight": f32(h),
         "lm_head.weight": f32(v, h, scale=h ** -0.5)}
    for L in range(c["num_hidden_layers"]):
        p = f"model.layers.{L}."
        w[p + "input_layernorm.weight"] = f32(h)
        w[p + "post_attention_layernorm.weight"] = f32(h)
        for name, (n, k) in (("self_attn.q_proj", (qd, h)), ("self_attn.k_proj", (kd, h)),
                             ("self_attn.v_proj", (kd, h)), ("self_attn.o_proj", (h, qd)),
                             ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)),
                             ("mlp.down_proj", (h, i))):
            w[p + name + ".weight"] = f32(n, k, scale=k ** -0.5)
    return w


def _greedy(model, prompts, n, kv_dtype, page_size=16):
    """Greedy tokens of a ragged batch of ``prompts`` (one prefill pass, then ``n - 1`` decode
    steps of the batch), and each token's top-2 logit margin (a list a sequence)."""
    from ninfer.engine.models.llama import ForwardBatch
    pages = [-(-(len(p) + n) // page_size) for p in prompts]
    kv = model.new_kv_cache(sum(pages), page_size, kv_dtype=kv_dtype)
    assert kv.dtype == kv_dtype
    tables, o = [], 0
    for m in pages:
        tables.append(list(range(o, o + m)))
        o += m
    seqs = [list(p) for p in prompts]
    batch = ForwardBatch.from_sequences(seqs, [0] * len(seqs), tables, page_size)
    out, margins = [[] for _ in prompts], [[] for _ in prompts]
    for _ in range(n):
        logits = model.ops.to_numpy(model.forward(batch, kv))
        top = np.sort(logits, axis=-1)
        ids = np.argmax(logits, axis=-1)
        for i, t in enumerate(ids):
            out[i].append(int(t))
            margins[i].append(float(top[i, -1] - top[i, -2]))
        batch = ForwardBatch.from_sequences([[int(t)] for t in ids],
                                            [len(s) for s in seqs], tables, page_size)
        for s, t in zip(seqs, ids):
            s.append(int(t))
    return out, margins


def assert_greedy_match(got, ref, margins, tie=1e-2):
    """``got == ref``, except that a sequence may part from ``ref`` at a token whose reference
    top-2 margin is below ``tie``: a near tie that float32 sums in another order can flip (a
    quantized KV code on a rounding boundary moves the logits by more than the sums' rounding).
    At most one sequence may part."""
    parted = []
    for i, (g, r) in enumerate(zip(got, ref)):
        j = next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), None)
        if j is not None:
            assert margins[i][j] < tie, (
                f"sequence {i} parts at token {j} ({g[j]} != {r[j]}), reference top-2 margin "
                f"{margins[i][j]:.4g}: not a near tie")
            parted.append(i)
    assert len(parted) <= 1, f"sequences {parted} part from the reference"


def test_tiny_llama_greedy_fp16_kv_equals_numpy(rng):
    """Prefill (tensor-core attention over fp16 pages) and decode (the fused kernel) of a tiny
    random Llama with fp16 KV: the tokens NumPy's fp16 mode gives."""
    from ninfer.engine.models.llama import LlamaConfig, LlamaModel
    w = _tiny_llama_weights(rng, TINY)
    prompts = [rng.integers(0, 512, n).tolist() for n in (20, 3, 45)]
    ref, margins = _greedy(LlamaModel(LlamaConfig.from_dict(TINY), w, get_ops("numpy")),
                           prompts, 12, "fp16")
    got, _ = _greedy(LlamaModel(LlamaConfig.from_dict(TINY), w, get_ops("cupy")), prompts, 12,
                     "fp16")
    assert_greedy_match(got, ref, margins)


def test_tiny_qwen35_greedy_fp16_kv_equals_numpy(tmp_path):
    """The tiny Qwen3.5 hybrid (gated attention: norm_rope_write_kv, partial RoPE, GQA 2)
    served by the engine on each backend with ``kv_dtype="fp16"`` (CUDA graphs on the GPU, as
    ``ninfer serve`` captures them): the same greedy tokens."""
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
    from test_engine_hybrid import run
    from test_qwen35_vs_transformers import byte_level_tokenizer, make_checkpoint

    from ninfer.engine.models import load_model
    from ninfer.store.artifact import load_model_file
    make_checkpoint(tmp_path, "l4_gqa2_hv2x", seed=3)
    tok = byte_level_tokenizer()
    prompts = [[3, 14, 15, 92, 65], list(range(40, 77)), [7]]
    toks = {}
    for backend in ("numpy", "cupy"):
        model = load_model(load_model_file(tmp_path), get_ops(backend))
        toks[backend] = run((model, tok), prompts, max_tokens=12, kv_dtype="fp16")
    assert toks["cupy"] == toks["numpy"]

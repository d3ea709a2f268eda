"""Quantized KV pages through the ops (``--kv-dtype``, NumPy reference): a write stores each
head as its codec's row (codes, then fp16 scales) and a read equals the codec's decode; paged
attention over quantized pages equals attention over the decoded pages; the CuPy backend refuses
every dtype but fp32, fp16 and int8 (checked without a GPU)."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from ninfer.engine import kv_dtypes
from ninfer.engine.kv import KVCache
from ninfer.kernels import attention
from ninfer.kernels.kv_codec import codec
from ninfer.kernels.numpy_ops import NumpyOps

MODES = kv_dtypes.KV_DTYPES
NKV, HD, PAGE, PAGES = 2, 128, 4, 8


def _cache(dtype: str) -> KVCache:
    return KVCache(1, PAGES, PAGE, NKV, HD, dtype=dtype)


@pytest.mark.parametrize("dtype", MODES)
def test_a_write_stores_the_codec_rows_and_a_read_decodes_them(dtype):
    rng = np.random.default_rng(1)
    kv = _cache(dtype)
    k, v = rng.standard_normal((2, 7, NKV, HD)).astype(np.float32)
    slots = np.array([5, 0, -1, 9, 30, 31, 2])   # a padding token (-1) is not stored
    NumpyOps().write_kv(kv.k[0], kv.v[0], k, v, slots, kv_dtype=dtype)
    keep = slots >= 0
    kf = kv.k[0].reshape(PAGES * PAGE, NKV, -1)[slots[keep]]
    vf = kv.v[0].reshape(PAGES * PAGE, NKV, -1)[slots[keep]]
    assert kv.k[0].shape[-1] == kv.k_width and kv.v[0].shape[-1] == kv.v_width
    assert (kv.k_width, kv.v_width) == ((HD, HD) if dtype == "fp32" else
                                        kv_dtypes.head_bytes(dtype, HD))
    if dtype == "fp32":
        np.testing.assert_array_equal(kf, k[keep])
        return
    c = codec(dtype)
    for part, x, rows in ((c.k, k[keep], kf), (c.v, v[keep], vf)):
        codes, scales = part.encode(x)
        cb = part.code_bytes(HD)
        np.testing.assert_array_equal(rows[..., :cb], codes)            # bit for bit
        np.testing.assert_array_equal(rows[..., cb:].copy().view("<f2"),
                                      scales.reshape(*rows.shape[:-1], -1))
        np.testing.assert_array_equal(part.decode_rows(rows, HD), part.decode(codes, scales))
    assert kv.nbytes == kv.bytes_per_token * PAGES * PAGE == \
        sum(a.nbytes for a in kv.k + kv.v)


@pytest.mark.parametrize("dtype", MODES)
def test_attention_over_quantized_pages_equals_attention_over_the_decoded_pages(dtype):
    """A prefill of two sequences then a decode step each, through ``rope_paged_attention``;
    the same on fp32 pages holding the decoded K/V gives the same output."""
    rng = np.random.default_rng(2)
    ops = NumpyOps()
    nq = 4
    kv = _cache(dtype)
    bt = np.array([[0, 1, 2, -1], [4, 5, 6, 7]], dtype=np.int32)
    lens = [9, 13]

    def slots_of(s, a, b):
        return np.array([bt[s, j // PAGE] * PAGE + j % PAGE for j in range(a, b)])

    outs = []
    for step in ("prefill", "decode"):
        spans = [(0, n - 1) for n in lens] if step == "prefill" else [(n - 1, n) for n in lens]
        t = sum(b - a for a, b in spans)
        qkv = rng.standard_normal((t, (nq + 2 * NKV) * HD)).astype(np.float32)
        pos = np.concatenate([np.arange(a, b) for a, b in spans])
        slots = np.concatenate([slots_of(s, a, b) for s, (a, b) in enumerate(spans)])
        cu = np.concatenate([[0], np.cumsum([b - a for a, b in spans])]).astype(np.int32)
        ctx = np.array([b for _, b in spans], dtype=np.int32)
        out = ops.rope_paged_attention(qkv, nq, NKV, pos, 1e4, kv.k[0], kv.v[0], slots, cu,
                                       ctx, bt, HD ** -0.5, kv_dtype=dtype)
        # the reference: fp32 pages holding what the quantized pages decode to
        q = ops.rope(qkv[:, :nq * HD].reshape(t, nq, HD), pos, 1e4)
        if dtype == "fp32":
            kd, vd = kv.k[0], kv.v[0]
        else:
            c = codec(dtype)
            kd, vd = c.k.decode_rows(kv.k[0], HD), c.v.decode_rows(kv.v[0], HD)
        ref = attention.paged_attention(q, kd, vd, cu, ctx, bt, HD ** -0.5)
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
        outs.append(out)


def test_quantized_attention_stays_near_fp32():
    """The modes' attention outputs against fp32's on Gaussian K/V (cosine, looser for fewer
    bits): a sanity floor, not the accuracy study."""
    rng = np.random.default_rng(3)
    ops = NumpyOps()
    n, nq = 29, 4
    k, v = rng.standard_normal((2, n, NKV, HD)).astype(np.float32)
    q = rng.standard_normal((1, nq, HD)).astype(np.float32)
    bt = np.arange(PAGES, dtype=np.int32)[None]
    cu, ctx = np.array([0, 1], dtype=np.int32), np.array([n], dtype=np.int32)
    got = {}
    for dtype in MODES:
        kv = _cache(dtype)
        ops.write_kv(kv.k[0], kv.v[0], k, v, np.arange(n), kv_dtype=dtype)
        got[dtype] = ops.paged_attention(q, kv.k[0], kv.v[0], cu, ctx, bt, HD ** -0.5,
                                         kv_dtype=dtype).ravel()
    ref = got["fp32"]
    floor = {"fp16": 0.9999, "int8": 0.999, "rk8v4": 0.97, "rk4v4": 0.95, "rk4v4-e8": 0.95,
             "rk2v4-e8": 0.9}
    for dtype, lo in floor.items():
        cos = got[dtype] @ ref / np.linalg.norm(got[dtype]) / np.linalg.norm(ref)
        print(f"{dtype}: attention cosine to fp32 {cos:.5f}")
        assert cos > lo, (dtype, cos)


def test_pages_of_another_layout_are_refused():
    ops = NumpyOps()
    kv = _cache("int8")
    k = np.zeros((1, NKV, HD), np.float32)
    with pytest.raises(ValueError, match="uint8 rows"):
        ops.write_kv(kv.k[0], kv.v[0], k, k, np.array([0]), kv_dtype="rk4v4")
    with pytest.raises(ValueError, match="unknown KV dtype"):
        ops.write_kv(kv.k[0], kv.v[0], k, k, np.array([0]), kv_dtype="int3")
    with pytest.raises(ValueError, match="multiple of 64"):
        KVCache(1, 1, 4, 1, 96, dtype="int8")


def test_the_cupy_backend_checks_its_kv_dtypes():
    """Where its KV cache would be made (``kv_dtypes.check_backend`` against its declared
    ``kv_dtypes``: all seven modes; a backend without one is refused), and in every KV op it
    has (its source: CuPy is absent here): each takes its pages through ``kv_pages``, which
    checks the dtype first."""
    CUPY_KV = ("fp32", "fp16", "int8", "rk8v4", "rk4v4", "rk4v4-e8", "rk2v4-e8")

    class GpuLike:
        name = "cupy"
        kv_dtypes = CUPY_KV

    for dtype in CUPY_KV:
        kv_dtypes.check_backend(dtype, GpuLike())
    for dtype in MODES:
        if dtype in CUPY_KV:
            continue
        with pytest.raises(ValueError, match=f"--kv-dtype {dtype} is not available on the "
                                             "cupy backend"):
            kv_dtypes.check_backend(dtype, GpuLike())
    kv_dtypes.check_backend("rk2v4-e8", NumpyOps())

    class Fp32Only:
        name = "cupy"
        kv_dtypes = ("fp32",)

    with pytest.raises(ValueError, match="--kv-dtype rk2v4-e8 is not available on the cupy"):
        kv_dtypes.check_backend("rk2v4-e8", Fp32Only())
    src = Path(__file__).parents[2] / "ninfer" / "kernels" / "gpu" / "attention_ops.py"
    tree = ast.parse(src.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AttentionOps")
    declared = next(ast.literal_eval(s.value) for s in cls.body if isinstance(s, ast.Assign)
                    and s.targets[0].id == "kv_dtypes")
    assert declared == CUPY_KV
    pages = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "kv_pages")
    first = pages.body[1] if isinstance(pages.body[0].value, ast.Constant) else pages.body[0]
    assert ast.unparse(first) == "check_kv_dtype(kv_dtype)"
    checked = ("write_kv", "rope_write_kv", "_attend",
               "rope_paged_attention", "gated_paged_attention")
    seen = set()
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef) and fn.name in checked + ("paged_attention",):
            first = fn.body[1] if isinstance(fn.body[0].value, ast.Constant) else fn.body[0]
            seen.add(fn.name)
            if fn.name == "paged_attention":   # checks its pages in _attend
                assert ast.unparse(first).startswith("return self._attend("), fn.name
                continue
            assert ast.unparse(first) == ("k_cache, v_cache = kv_pages(k_cache, v_cache, "
                                          "kv_dtype)"), fn.name
    assert seen == set(checked) | {"paged_attention"}

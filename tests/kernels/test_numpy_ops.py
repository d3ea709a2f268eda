"""NumPy reference ops, each against an independent straightforward formulation (float64 math,
dense attention, complex-number RoPE) on fresh random inputs."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from ninfer.kernels import get_ops
from ninfer.kernels.rope import rope_inv_freq
from ninfer.store.quant import QuantTensor, dequantize, quantize_q8


@pytest.fixture
def ops():
    return get_ops("numpy")


@pytest.fixture
def rng(request):
    # fresh inputs per test, reproducible from the test's name
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def test_get_ops_backends():
    assert get_ops().name == "numpy"
    with pytest.raises(ValueError, match="unknown kernel backend"):
        get_ops("tpu")


# ---------------------------------------------------------------------------------- rms_norm

@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_matches_float64(ops, rng, unit_offset):
    x = rng.standard_normal((7, 96)).astype(np.float32) * 3
    w = rng.standard_normal(96).astype(np.float32)
    eps = 1e-5
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + eps)
    ref = ref * ((1 + w) if unit_offset else w)
    y = ops.rms_norm(x, w, eps, unit_offset=unit_offset) if unit_offset else ops.rms_norm(x, w, eps)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert rel_err(y, ref) < 1e-6
    # the input is not modified
    assert np.array_equal(x, x64.astype(np.float32))


def test_rms_norm_eps_dominates_zero_rows(ops):
    x = np.zeros((2, 8), np.float32)
    x[1] = 1e-4
    y = ops.rms_norm(x, np.ones(8, np.float32), 1e-2)
    assert np.all(y[0] == 0)
    np.testing.assert_allclose(y[1], 1e-4 / np.sqrt(1e-8 + 1e-2), rtol=1e-6)


# ---------------------------------------------------------------------------------- silu_mul

def test_silu_mul_matches_float64(ops, rng):
    gate = rng.standard_normal((5, 64)).astype(np.float32) * 4
    gate[0, :4] = [-200.0, -90.0, 90.0, 200.0]  # exp overflow territory must stay finite
    up = rng.standard_normal((5, 64)).astype(np.float32)
    g64 = gate.astype(np.float64)
    ref = g64 / (1 + np.exp(-g64)) * up
    y = ops.silu_mul(gate, up)
    assert y.dtype == np.float32 and np.isfinite(y).all()
    assert rel_err(y, ref) < 1e-6
    assert y[0, 0] == 0 and abs(y[0, 3] - 200.0 * up[0, 3]) < 1e-3


# --------------------------------------------------------------------------------- embedding

def test_embedding_gathers_rows(ops, rng):
    w = rng.standard_normal((50, 12)).astype(np.float32)
    ids = np.array([3, 0, 49, 3], np.int32)
    y = ops.embedding(w, ids)
    for r, i in enumerate(ids):
        assert np.array_equal(y[r], w[i])
    y[0] += 1  # a copy, not a view of the table
    assert not np.array_equal(y[0], w[3])
    with pytest.raises(IndexError):
        ops.embedding(w, np.array([50]))
    with pytest.raises(IndexError):
        ops.embedding(w, np.array([-1]))


# ------------------------------------------------------------------------------------ linear

def _q4(rng, n, k, group, with_mins):
    codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scales = (rng.random((n, k // group)) * 0.1).astype(np.float16)
    mins = (rng.standard_normal((n, k // group)) * 0.1).astype(np.float16) if with_mins else None
    return QuantTensor("q4", (n, k), codes=codes, scales=scales, mins=mins, group=group)


def _schemes(rng, n=24, k=64):
    w = rng.standard_normal((n, k)).astype(np.float32)
    bits = (w.view(np.uint32) >> 16).astype(np.uint16)
    return {
        "f32": QuantTensor("f32", (n, k), data=w),
        "f16": QuantTensor("f16", (n, k), data=w.astype(np.float16)),
        "bf16": QuantTensor("bf16", (n, k), data=bits),
        "q8": quantize_q8(w, 32),
        "q4": _q4(rng, n, k, 32, True),
        "q4_sym": _q4(rng, n, k, 32, False),
    }


def test_prepare_weight_every_scheme(ops, rng):
    for name, t in _schemes(rng).items():
        w = ops.prepare_weight(t)
        assert w.dtype == np.float32 and w.flags.c_contiguous and w.flags.owndata, name
        assert np.array_equal(w, dequantize(t)), name
    # bf16 is exact truncation of float32: spot-check against the bit pattern by hand
    t = QuantTensor("bf16", (2,), data=np.array([0x3F80, 0xC040], np.uint16))
    assert ops.prepare_weight(t).tolist() == [1.0, -3.0]


def test_prepare_weight_copies_a_strided_source(ops, rng):
    base = rng.standard_normal((16, 40)).astype(np.float32)
    view = base[:, ::2]  # not contiguous
    w = ops.prepare_weight(QuantTensor("f32", view.shape, data=view))
    assert w.flags.c_contiguous and np.array_equal(w, view)
    w[0, 0] += 1
    assert base[0, 0] != w[0, 0]


def test_linear_matches_float64(ops, rng):
    w32 = rng.standard_normal((40, 72)).astype(np.float32)
    w = ops.prepare_weight(QuantTensor("f32", w32.shape, data=w32))
    for t in (1, 2, 3, 5, 64):
        x = rng.standard_normal((t, 72)).astype(np.float32)
        y = ops.linear(x, w)
        ref = x.astype(np.float64) @ w32.astype(np.float64).T
        assert y.shape == (t, 40) and y.dtype == np.float32 and y.flags.c_contiguous
        assert rel_err(y, ref) < 1e-5


def test_fused_linear_swiglu_matches_float64(ops, rng):
    """``fused_linear(..., swiglu=True)``: silu(y[:, :I]) * y[:, I:] of the (RMSNorm'd) product,
    against float64; bad combinations refused."""
    w32 = rng.standard_normal((48, 72)).astype(np.float32)
    w = ops.prepare_weight(QuantTensor("f32", w32.shape, data=w32))
    nw = (rng.random(72) + 0.5).astype(np.float32)
    for t in (1, 3):
        x = rng.standard_normal((t, 72)).astype(np.float32)
        act = ops.fused_linear(x, w, norm=nw, eps=1e-5, swiglu=True)
        x64 = x.astype(np.float64)
        a = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-5) * nw
        y = a @ w32.astype(np.float64).T
        ref = y[:, :24] / (1 + np.exp(-y[:, :24])) * y[:, 24:]
        assert act.shape == (t, 24) and act.dtype == np.float32
        assert rel_err(act, ref) < 1e-5
    x = rng.standard_normal((1, 72)).astype(np.float32)
    with pytest.raises(ValueError, match="swiglu"):
        ops.fused_linear(x, w, swiglu=True, residual=np.zeros((1, 48), np.float32))
    with pytest.raises(ValueError, match="swiglu"):
        ops.fused_linear(x, w[:47], swiglu=True)


def test_swiglu_mlp_adds_the_block_into_the_residual(ops, rng):
    """``swiglu_mlp``: x += down(silu(g) * u) with g | u = gate_up(RMSNorm(x)), in place,
    against float64 (the NumPy backend composes it: SiLU in down's prologue)."""
    gu32 = rng.standard_normal((48, 40)).astype(np.float32)
    dn32 = rng.standard_normal((40, 24)).astype(np.float32)
    gate_up = ops.prepare_weight(QuantTensor("f32", gu32.shape, data=gu32))
    down = ops.prepare_weight(QuantTensor("f32", dn32.shape, data=dn32))
    nw = (rng.random(40) + 0.5).astype(np.float32)
    for t in (1, 3):
        x = rng.standard_normal((t, 40)).astype(np.float32)
        x64 = x.astype(np.float64)
        a = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-5) * nw
        y = a @ gu32.astype(np.float64).T
        ref = x64 + (y[:, :24] / (1 + np.exp(-y[:, :24])) * y[:, 24:]) @ dn32.astype(
            np.float64).T
        out = ops.swiglu_mlp(x, nw, gate_up, down, 1e-5)
        assert out is x and out.shape == (t, 40)
        assert rel_err(out, ref) < 1e-5


def test_prepare_fused_splits_back(ops, rng):
    s = _schemes(rng, n=24, k=64)
    parts = [s["q8"], s["q4"], QuantTensor("f32", (8, 64), data=rng.standard_normal((8, 64))
                                            .astype(np.float32))]
    fused = ops.prepare_fused(parts)
    assert fused.shape == (56, 64) and fused.flags.c_contiguous
    x = rng.standard_normal((3, 64)).astype(np.float32)
    y = ops.linear(x, fused)
    row = 0
    for t in parts:
        ref = x.astype(np.float64) @ dequantize(t).astype(np.float64).T
        assert rel_err(y[:, row:row + t.shape[0]], ref) < 1e-5
        row += t.shape[0]
    with pytest.raises(ValueError):
        ops.prepare_fused([s["q8"], QuantTensor("f32", (4, 32), data=np.zeros((4, 32),
                                                                              np.float32))])
    with pytest.raises(ValueError):
        ops.prepare_fused([])


# -------------------------------------------------------------------------------------- rope

def _rope_complex(x, positions, theta, style, rotary_dim=None):
    """Reference: pairs as complex numbers times exp(i * pos * theta^(-2i/r)), float64."""
    t, n, hd = x.shape
    r = rotary_dim or hd
    h = r // 2
    x = x.astype(np.float64)
    if style == "half":
        re, im = x[..., :h], x[..., h:r]
    else:
        re, im = x[..., 0:r:2], x[..., 1:r:2]
    freqs = theta ** (-np.arange(h) * 2.0 / r)
    z = (re + 1j * im) * np.exp(1j * positions[:, None, None] * freqs)
    out = x.copy()
    if style == "half":
        out[..., :h], out[..., h:r] = z.real, z.imag
    else:
        out[..., 0:r:2], out[..., 1:r:2] = z.real, z.imag
    return out


@pytest.mark.parametrize("style", ["half", "adjacent"])
@pytest.mark.parametrize("rotary_dim", [None, 16])
def test_rope_matches_complex_formulation(ops, rng, style, rotary_dim):
    x = rng.standard_normal((9, 5, 32)).astype(np.float32)
    pos = rng.permutation(300)[:9].astype(np.int32)
    y = ops.rope(x, pos, 10000.0, style=style, rotary_dim=rotary_dim)
    ref = _rope_complex(x, pos, 10000.0, style, rotary_dim)
    assert y.dtype == np.float32 and y.shape == x.shape
    # float32 angle pos * inv_freq (as HF computes it) costs ~pos * 2^-24 rad
    assert rel_err(y, ref) < 1e-4
    if rotary_dim:
        assert np.array_equal(y[..., rotary_dim:], x[..., rotary_dim:])
    # position 0 is the identity
    y0 = ops.rope(x, np.zeros(9, np.int32), 10000.0, style=style, rotary_dim=rotary_dim)
    np.testing.assert_allclose(y0, x, atol=1e-7)


def test_rope_adjacent_equals_half_under_permutation(ops, rng):
    hd = 64
    # adjacent dim 2i + j holds half dim j * hd/2 + i (spec/models.md B.5)
    perm = np.array([j * hd // 2 + i for i in range(hd // 2) for j in range(2)])
    x = rng.standard_normal((6, 3, hd)).astype(np.float32)
    pos = rng.integers(0, 5000, 6)
    half = ops.rope(x, pos, 100000.0, style="half")
    adj = ops.rope(np.ascontiguousarray(x[..., perm]), pos, 100000.0, style="adjacent")
    assert np.array_equal(adj, half[..., perm])


def test_rope_accepts_strided_views_and_new_positions(ops, rng):
    qkv = rng.standard_normal((4, 3 * 16)).astype(np.float32)
    view = qkv[:, 16:32].reshape(4, 2, 8)  # a column slice, as the model passes q/k
    for start in (0, 7, 7, 100):  # same positions twice, then new ones (cache must notice)
        pos = np.arange(start, start + 4)
        y = ops.rope(view, pos, 500.0)
        assert rel_err(y, _rope_complex(view, pos, 500.0, "half")) < 1e-5
    pos = np.arange(4)
    ops.rope(view, pos, 500.0)
    pos[:] = [50, 51, 52, 53]  # mutated in place by the caller
    assert rel_err(ops.rope(view, pos, 500.0), _rope_complex(view, pos, 500.0, "half")) < 1e-5


def test_rope_rejects_bad_arguments(ops):
    x = np.zeros((1, 1, 8), np.float32)
    with pytest.raises(ValueError, match="style"):
        ops.rope(x, np.zeros(1, np.int32), 1e4, style="gptj")
    with pytest.raises(ValueError, match="rotary_dim"):
        ops.rope(x, np.zeros(1, np.int32), 1e4, rotary_dim=16)
    with pytest.raises(ValueError, match="rope_scaling"):
        ops.rope(x, np.zeros(1, np.int32), 1e4, scaling={"rope_type": "yarn", "factor": 4.0})


def test_rope_llama3_scaling_regimes():
    sc = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
    base = rope_inv_freq(16, 10000.0)
    scaled = rope_inv_freq(16, 10000.0, sc)
    wavelen = 2 * np.pi / base
    high = wavelen < 64 / 4  # short wavelengths: unchanged
    low = wavelen > 64 / 1  # long wavelengths: divided by factor
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()
    assert np.array_equal(scaled[high], base[high])
    np.testing.assert_allclose(scaled[low], base[low] / 8, rtol=1e-6)
    s = (64 / wavelen[mid] - 1) / 3
    np.testing.assert_allclose(scaled[mid], (1 - s) * base[mid] / 8 + s * base[mid], rtol=1e-5)
    assert np.array_equal(rope_inv_freq(16, 10000.0, {"rope_type": "default"}), base)


# --------------------------------------------------------------------------------- attention

def _paged_setup(rng, page_size, lens, nkv, hd, spare_pages=3):
    """Random K/V per sequence, scattered over a randomly permuted page pool."""
    need = [-(-n // page_size) for n in lens]
    num_pages = sum(need) + spare_pages
    order = rng.permutation(num_pages)
    kc = rng.standard_normal((num_pages, page_size, nkv, hd)).astype(np.float32)  # junk
    vc = rng.standard_normal((num_pages, page_size, nkv, hd)).astype(np.float32)
    ks, vs, tables, at = [], [], [], 0
    for n, p in zip(lens, need):
        table = order[at:at + p]
        at += p
        k = rng.standard_normal((n, nkv, hd)).astype(np.float32)
        v = rng.standard_normal((n, nkv, hd)).astype(np.float32)
        for j in range(n):
            kc[table[j // page_size], j % page_size] = k[j]
            vc[table[j // page_size], j % page_size] = v[j]
        ks.append(k)
        vs.append(v)
        tables.append(table)
    bt = np.full((len(lens), max(need) + 2), -1, np.int32)
    for s, table in enumerate(tables):
        bt[s, :len(table)] = table
    return kc, vc, ks, vs, bt


def _dense_attention(q, k, v, scale):
    """Reference: float64 causal attention of q (n, nh, hd) = the last n of k/v (L, nkv, hd)."""
    n, nh, hd = q.shape
    L, nkv = k.shape[0], k.shape[1]
    kk = np.repeat(k.astype(np.float64), nh // nkv, axis=1)  # (L, nh, hd)
    vv = np.repeat(v.astype(np.float64), nh // nkv, axis=1)
    out = np.empty((n, nh, hd))
    for i in range(n):
        p = L - n + i
        s = np.einsum("hd,jhd->hj", q[i].astype(np.float64), kk[:p + 1]) * scale
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        out[i] = np.einsum("hj,jhd->hd", s, vv[:p + 1])
    return out


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_attention_matches_dense_ragged_batch(ops, rng, page_size):
    nh, nkv, hd = 6, 2, 16
    lens = [37, 1, 20, 16, 5]  # KV length after the pass
    q_lens = [37, 1, 1, 7, 5]  # full prefill, 1-token prefill, decode, chunk, exact prefill
    kc, vc, ks, vs, bt = _paged_setup(rng, page_size, lens, nkv, hd)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((cu[-1], nh, hd)).astype(np.float32) * 2
    scale = hd ** -0.5
    out = ops.paged_attention(q, kc, vc, cu, np.array(lens, np.int32), bt, scale)
    assert out.shape == q.shape and out.dtype == np.float32
    for s in range(len(lens)):
        ref = _dense_attention(q[cu[s]:cu[s + 1]], ks[s], vs[s], scale)
        assert rel_err(out[cu[s]:cu[s + 1]], ref) < 1e-5, s
    # batch composition does not change a sequence's result beyond float32 rounding
    alone = ops.paged_attention(q[cu[3]:cu[4]], kc, vc, np.array([0, q_lens[3]], np.int32),
                                np.array([lens[3]], np.int32), bt[3:4], scale)
    np.testing.assert_allclose(alone, out[cu[3]:cu[4]], rtol=1e-5, atol=1e-6)


def test_paged_attention_is_causal(ops, rng):
    """Changing KV after a query's position must not change that query's output."""
    nh, nkv, hd, ps = 4, 4, 8, 4
    kc, vc, ks, vs, bt = _paged_setup(rng, ps, [12], nkv, hd)
    q = rng.standard_normal((12, nh, hd)).astype(np.float32)
    args = (np.array([0, 12], np.int32), np.array([12], np.int32), bt, 0.3)
    before = ops.paged_attention(q, kc, vc, *args)
    kc[bt[0, 2], 1] += 5.0  # KV position 9
    vc[bt[0, 2], 1] -= 5.0
    after = ops.paged_attention(q, kc, vc, *args)
    assert np.array_equal(before[:9], after[:9])
    assert not np.allclose(before[9:], after[9:])


def test_paged_attention_rejects_short_block_table(ops, rng):
    kc, vc, _, _, bt = _paged_setup(rng, 4, [8], 1, 8)
    q = np.zeros((1, 1, 8), np.float32)
    with pytest.raises(ValueError, match="block table"):
        ops.paged_attention(q, kc, vc, np.array([0, 1], np.int32), np.array([13], np.int32),
                            bt, 1.0)
    with pytest.raises(ValueError, match="context_len"):
        ops.paged_attention(np.zeros((3, 1, 8), np.float32), kc, vc,
                            np.array([0, 3], np.int32), np.array([2], np.int32), bt, 1.0)


def test_write_kv_places_tokens_by_slot(ops, rng):
    num_pages, ps, nkv, hd = 5, 4, 2, 8
    kc = np.zeros((num_pages, ps, nkv, hd), np.float32)
    vc = np.zeros_like(kc)
    k = rng.standard_normal((4, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((4, nkv, hd)).astype(np.float32)
    slots = np.array([3 * ps + 0, 0 * ps + 3, -1, 4 * ps + 2], np.int64)  # -1: padding
    ops.write_kv(kc, vc, k, v, slots)
    expect_k = np.zeros_like(kc)
    expect_v = np.zeros_like(vc)
    for t, (page, off) in {0: (3, 0), 1: (0, 3), 3: (4, 2)}.items():
        expect_k[page, off] = k[t]
        expect_v[page, off] = v[t]
    assert np.array_equal(kc, expect_k) and np.array_equal(vc, expect_v)
    with pytest.raises(IndexError):
        ops.write_kv(kc, vc, k[:1], v[:1], np.array([num_pages * ps], np.int64))


def test_write_then_attend_roundtrip(ops, rng):
    """write_kv + paged_attention over permuted pages equals dense attention."""
    nh, nkv, hd, ps = 4, 2, 8, 4
    n = 10
    table = rng.permutation(6)[:3]
    kc = np.zeros((6, ps, nkv, hd), np.float32)
    vc = np.zeros_like(kc)
    k = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    pos = np.arange(n)
    ops.write_kv(kc, vc, k, v, (table[pos // ps] * ps + pos % ps).astype(np.int64))
    q = rng.standard_normal((n, nh, hd)).astype(np.float32)
    out = ops.paged_attention(q, kc, vc, np.array([0, n], np.int32), np.array([n], np.int32),
                              table[None].astype(np.int32), 0.35)
    assert rel_err(out, _dense_attention(q, k, v, 0.35)) < 1e-5

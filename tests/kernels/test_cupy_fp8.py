"""The fp8 prefill GEMMs (``gpu.gemm_fp8``, ``KernelConfig.prefill_fp8``) against NumPy on fresh
random inputs, every CuPy allocation poisoned first (uint8 with 0xFF: an e4m3 NaN): the
activations' and the weight's codes are the nearest e4m3 values of x / scale with the rows'
largest |x| / 448 as scales, the product is the float64 one of the decoded operands, and a
prefill linear and a tiny model's prefill with ``prefill_fp8`` stay within e4m3's rounding of
the references (the same greedy token)."""
from __future__ import annotations

import numpy as np
import pytest

from ninfer.kernels import get_ops
from ninfer.store.quant import dequantize
from tests.kernels.test_cupy_ops import (TINY, _tiny_weights, cp, kconf, nops,  # noqa: F401
                                         poison, q4, q8, rel, rng)

pytestmark = pytest.mark.gpu

E4M3_BOUND = 8e-2   # a product of two e4m3-rounded operands (3 mantissa bits each), max over rows
MODEL_BOUND = 0.12  # two layers of it, each logit (0.05-0.07 on random tiny models)
FP8_SUM = 1e-3      # the fp8 tensor cores' sums against float64 on the same codes (1.4e-4 at 5K)


def _e4m3_values() -> np.ndarray:
    """The 256 codes' values (NaN for 0x7F and 0xFF)."""
    b = np.arange(256)
    e, m = (b >> 3) & 15, (b & 7).astype(np.float64)
    v = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
    v = np.where(b & 0x80, -v, v)
    v[(b & 0x7F) == 0x7F] = np.nan
    return v


E4M3 = _e4m3_values()
GRID = np.unique(E4M3[np.isfinite(E4M3)])


def assert_nearest(codes: np.ndarray, want: np.ndarray, slack: float = 0.0) -> None:
    """Each code decodes to a nearest e4m3 value of ``want`` saturated to +-448 (either one at
    a tie; ``slack``: a relative allowance where ``want`` is one rounding off the kernel's)."""
    got = E4M3[codes]
    assert np.isfinite(got).all(), "an unwritten (0xFF) or NaN code"
    w = np.clip(want.astype(np.float64), -448.0, 448.0)
    i = np.clip(np.searchsorted(GRID, w), 1, len(GRID) - 1)
    best = np.minimum(np.abs(GRID[i] - w), np.abs(GRID[i - 1] - w))
    bad = np.abs(got - w) > best + slack * np.abs(w) + 1e-30
    assert not bad.any(), (np.argwhere(bad)[:5], got[bad][:5], w[bad][:5])


@pytest.fixture(scope="module")
def fp8():
    from ninfer.kernels.gpu import gemm_fp8
    if not gemm_fp8.supported(cp.cuda.Device().id):
        pytest.skip("no fp8 tensor cores or no cuBLASLt with outer-vector scales for them")
    return gemm_fp8


def test_activation_rows_are_the_nearest_e4m3_of_x_over_their_scale(fp8, rng):
    """Rows of mixed magnitudes, an outlier row (one value 1e4 times the rest), a row of
    zeros (scale 1, codes 0)."""
    from ninfer.kernels.gpu import elementwise as gew
    t, k = 37, 5120
    x = (rng.standard_normal((t, k)) * rng.random((t, 1)) * 8).astype(np.float16)
    x[3] = 0
    x[5, 17] = 3e3
    q, s = gew.quant_rows_e4m3(cp.asarray(x))
    q, s = cp.asnumpy(q), cp.asnumpy(s)
    m = np.abs(x.astype(np.float32)).max(axis=1)
    want_s = np.where(m > 0, m / np.float32(448), np.float32(1)).astype(np.float32)
    assert np.array_equal(s, want_s)
    inv = (np.float32(1) / want_s).astype(np.float32)
    assert_nearest(q, x.astype(np.float32) * inv[:, None])
    assert (q[3] == 0).all() and E4M3[q[5, 17]] == 448.0


@pytest.mark.parametrize("make,n,k", [(lambda r, n, k: q4(r, n, k, mins=True), 300, 544),
                                      (lambda r, n, k: q4(r, n, k, mins=False), 64, 1024),
                                      (q8, 200, 576)])
def test_weight_rows_are_the_nearest_e4m3_of_w_over_their_scale(fp8, rng, make, n, k):
    """q4 with and without mins, q8; N not a multiple of 16 and K a multiple of 32 but not of
    64 (the tiles' padding is neither scanned nor written)."""
    ops = get_ops("cupy")
    qt = make(rng, n, k)
    w = ops.prepare_weight(qt)
    dq = dequantize(qt).astype(np.float32)
    s = cp.asnumpy(fp8.row_scales(w))
    m = np.abs(dq).max(axis=1)
    np.testing.assert_allclose(s, np.where(m > 0, m / 448, 1), rtol=1e-6)
    out = cp.empty((n * k + 64,), dtype=cp.uint8)   # (0xFF past the end stays)
    fp8.dequantize_e4m3(w, cp.asarray(s), out)
    codes = cp.asnumpy(out)
    assert (codes[n * k:] == 0xFF).all()
    inv = (np.float32(1) / s).astype(np.float32)
    # (the kernel's q4-with-mins value is s q + m, which it may fuse: one rounding apart)
    assert_nearest(codes[:n * k].reshape(n, k), dq * inv[:, None], slack=1e-6)


@pytest.mark.parametrize("t", [40, 100, 1000])
def test_gemm_is_the_product_of_the_decoded_operands(fp8, rng, t):
    """``gemm`` against float64 on the codes and scales it used (each checked above), plain
    and accumulating onto a residual, and a narrower call's rows (each row's codes are its
    own: only the summation order may change with the width)."""
    from ninfer.kernels.gpu import elementwise as gew
    ops = get_ops("cupy")
    n, k = 300, 544
    w = ops.prepare_weight(q4(rng, n, k))
    x16 = cp.asarray((rng.standard_normal((t, k)) * 2).astype(np.float16))
    scratch = cp.empty((n * k,), dtype=cp.uint8)
    out = cp.empty((t, n), dtype=cp.float32)
    fp8.gemm(x16, w, scratch, out)
    x8, sx = gew.quant_rows_e4m3(x16)
    xd = E4M3[cp.asnumpy(x8)] * cp.asnumpy(sx)[:, None]
    wd = E4M3[cp.asnumpy(scratch).reshape(n, k)] * cp.asnumpy(w.f8_scale)[:, None]
    ref = xd @ wd.T
    assert rel(out, ref) < FP8_SUM
    res = rng.standard_normal((t, n)).astype(np.float32)
    acc = cp.asarray(res)
    fp8.gemm(x16, w, scratch, acc, accumulate=True)
    assert rel(acc, ref + res) < FP8_SUM
    few = cp.empty((20, n), dtype=cp.float32)
    fp8.gemm(x16[:20].copy(), w, scratch, few)
    assert rel(few, ref[:20]) < FP8_SUM


def test_prefill_linear_with_prefill_fp8_is_within_e4m3_of_the_reference(fp8, nops, rng):
    """``fused_linear`` of more rows than the GEMVs take (RMSNorm before, a residual after;
    SwiGLU's gated prologue) on the fp8 path: within e4m3's rounding of NumPy's float32
    one."""
    ops = get_ops("cupy", kconf(prefill_fp8=True))
    t, k, n = 100, 512, 384
    qt = q4(rng, n, k)
    w = ops.prepare_weight(qt)
    x = (rng.standard_normal((t, k)) * 3).astype(np.float32)
    nw = rng.standard_normal(k).astype(np.float32)
    res = rng.standard_normal((t, n)).astype(np.float32)
    want = nops.fused_linear(x, dequantize(qt), norm=nw, eps=1e-5, residual=res.copy())
    got = ops.fused_linear(cp.asarray(x), w, norm=cp.asarray(nw), eps=1e-5,
                           residual=cp.asarray(res))
    err = rel(got, want)
    print("fp8 prefill linear: rel", err)
    assert err < E4M3_BOUND and w.f8_scale is not None   # (the fp8 path ran)
    gu = (rng.standard_normal((t, 2 * n)) * 2).astype(np.float32)
    qd = q4(rng, k, n)
    down = ops.prepare_weight(qd)
    want = nops.fused_linear(gu, dequantize(qd), gated=True)
    assert rel(ops.fused_linear(cp.asarray(gu), down, gated=True), want) < E4M3_BOUND


def test_tiny_model_prefill_with_prefill_fp8_gives_the_references_greedy_token(fp8, nops, rng):
    """A two-layer model's 150-token prefill (every projection a GEMM of packed weights,
    no fp16 copies kept) with ``prefill_fp8``: its logits within e4m3's rounding of NumPy's,
    the greedy token NumPy's unless within that error of NumPy's best (a near-tie)."""
    from ninfer.engine.models.llama import ForwardBatch, LlamaConfig, LlamaModel
    c = LlamaConfig.from_dict(TINY)
    w = _tiny_weights(rng, TINY)
    gpu = LlamaModel(c, w, get_ops("cupy", kconf(prefill_fp8=True, prefill_f16_mib=0)))
    ref = LlamaModel(c, w, nops)
    prompt = rng.integers(0, TINY["vocab_size"], size=150).tolist()
    got, want = [], []
    for model, into in ((gpu, got), (ref, want)):
        kv = model.new_kv_cache(16, 16)
        batch = ForwardBatch.from_sequences([prompt], [0], [list(range(10))], 16)
        into.append(np.asarray(model.ops.to_numpy(model.forward(batch, kv)), np.float64))
    err = rel(got[0], want[0])
    print("tiny model, fp8 prefill: logits rel", err)
    assert err < MODEL_BOUND
    g, w_ = got[0].ravel(), want[0].ravel()
    assert w_[int(g.argmax())] >= w_.max() - 2 * err * np.abs(w_).max()


def test_the_output_head_and_kept_fp16_copies_stay_off_fp8(fp8, rng):
    """With ``prefill_fp8`` a model's output head still multiplies on fp16 (its 150-row product
    is the fp16 config's, bit for bit, and it never gets e4m3 scales while the layers' weights
    do), and where the layers keep fp16 copies nothing runs on fp8: ``prefill_gemm`` says fp16,
    no weight has e4m3 scales and the all-rows logits are the fp16 config's, bit for bit."""
    from ninfer.engine.models.llama import ForwardBatch, LlamaConfig, LlamaModel
    from ninfer.kernels.gpu.linear_ops import layer_weights
    c = LlamaConfig.from_dict(TINY)
    w = _tiny_weights(rng, TINY)
    prompt = rng.integers(0, TINY["vocab_size"], size=150).tolist()
    x = cp.asarray((rng.standard_normal((150, TINY["hidden_size"])) * 2).astype(np.float32))

    def run(**changes):
        model = LlamaModel(c, w, get_ops("cupy", kconf(**changes)))
        kv = model.new_kv_cache(16, 16)
        batch = ForwardBatch.from_sequences([prompt], [0], [list(range(10))], 16)
        logits = cp.asnumpy(model.forward(batch, kv, all_logits=True))
        head = cp.asnumpy(model.ops.linear(x, model.lm_head))
        return model, logits, layer_weights(model), head

    ref, ref_logits, _, ref_head = run(prefill_f16_mib=0)
    m8, _, weights, head = run(prefill_f16_mib=0, prefill_fp8=True)
    assert m8.ops.prefill_gemm() == "fp8" and not m8.lm_head.prefill_fp8
    assert m8.lm_head.f8_scale is None and any(v.f8_scale is not None for v in weights)
    assert np.array_equal(head, ref_head)
    kept, logits, weights, _ = run(prefill_fp8=True)
    assert kept.ops.prefill_gemm() == "fp16" and kept.ops._f16_kept > 0
    assert all(v.f8_scale is None for v in weights + [kept.lm_head])
    assert np.array_equal(logits, ref_logits)


@pytest.mark.slow
def test_smollm2_prefill_fp8_keeps_the_greedy_tokens(fp8, smollm2_gguf):
    """Real weights: SmolLM2 with no fp16 copies kept prefills a ~300-token prompt through the
    fp16 GEMMs and through fp8 (``prefill_fp8``), then decodes 16 greedy tokens; each run's
    tokens equal the CPU's or first differ at a near-tie of the CPU's logits (margin below 0.5,
    as int8 decode activations are allowed). Prints each path's last-row logit error."""
    from ninfer.engine.models.llama import ForwardBatch, LlamaModel
    from ninfer.server import load_runtime
    from ninfer.store.artifact import load_model_file
    from tests.kernels.test_cupy_ops import PROMPTS
    art = load_model_file(smollm2_gguf)
    rt = load_runtime(str(smollm2_gguf), "numpy")
    text = "Answer each of these in turn, briefly. " + " Then: ".join(PROMPTS * 5)
    ids = rt.tokenizer.encode(rt.template.render([{"role": "user", "content": text}],
                                                 add_generation_prompt=True))
    assert len(ids) > 200

    def run(model):
        kv = model.new_kv_cache(32, 16)
        toks, first, logits_at = list(ids), None, []
        for step in range(17):
            start = 0 if step == 0 else len(toks) - 1
            b = ForwardBatch.from_sequences([toks[start:]], [start], [list(range(32))], 16)
            logits = np.asarray(model.ops.to_numpy(model.forward(b, kv))[0], np.float64)
            first = logits if first is None else first
            logits_at.append(logits)
            toks.append(int(np.argmax(logits)))
        return toks[len(ids):], first, logits_at

    cpu_toks, cpu_first, cpu_logits = run(rt.model)
    for name, kc in (("fp16", kconf(prefill_f16_mib=0)),
                     ("fp8", kconf(prefill_f16_mib=0, prefill_fp8=True))):
        toks, first, _ = run(LlamaModel.from_artifact(art, get_ops("cupy", kc)))
        err = rel(first, cpu_first)
        same = next((i for i, (a, b) in enumerate(zip(toks, cpu_toks)) if a != b), len(toks))
        print(f"SmolLM2 {len(ids)}-token prefill, {name} GEMMs: last-row logits rel {err:.4f}, "
              f"greedy tokens equal to the CPU's: {same} of {len(toks)}")
        if same < len(toks):
            cpu = cpu_logits[same]
            assert float(cpu[cpu_toks[same]] - cpu[toks[same]]) < 0.5, (name, same)


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), rounded to nearest even."""
    b = x.astype(np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def _f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("t,i", [(33, 1088), (3, 4104)])   # (4,104: past a block's first pass)
def test_silu_mul_codes_are_the_nearest_e4m3_of_the_rows_over_their_scale(fp8, rng, t, i):
    """``silu_mul_e4m3`` of bf16 gate | up rows: the scale is the row's largest |silu(g) u| /
    448 and each code the nearest e4m3 value of silu(g) u / scale (float32 here, as the kernel
    computes it; its expf may differ in the last place)."""
    from ninfer.kernels.gpu import elementwise as gew
    gu = _bf16((rng.standard_normal((t, 2 * i)) * 3).astype(np.float32))
    gu[t // 2] = 0
    q, s = gew.silu_mul_e4m3(cp.asarray(gu))
    q, s = cp.asnumpy(q), cp.asnumpy(s)
    g, u = _f32(gu[:, :i]), _f32(gu[:, i:])
    y = (g / (np.float32(1) + np.exp(-g)) * u).astype(np.float32)
    m = np.abs(y).max(axis=1)
    want = np.where(m > 0, m / np.float32(448), np.float32(1)).astype(np.float32)
    np.testing.assert_allclose(s, want, rtol=1e-6)
    assert s[t // 2] == 1 and (q[t // 2] == 0).all()
    assert_nearest(q, y * (np.float32(1) / s)[:, None], slack=1e-6)


def test_gemm_into_bf16_is_the_product_rounded_to_bf16(fp8, rng):
    """``gemm_codes`` into uint16 bf16 bits: the float64 product of the decoded operands,
    rounded to bf16 (2^-8 a value); accumulating into bf16 is refused."""
    from ninfer.kernels.gpu import elementwise as gew
    ops = get_ops("cupy")
    t, n, k = 100, 320, 544
    w = ops.prepare_weight(q4(rng, n, k))
    x8, sx = gew.quant_rows_e4m3(cp.asarray((rng.standard_normal((t, k)) * 2).astype(np.float16)))
    scratch = cp.empty((n * k,), dtype=cp.uint8)
    out = cp.empty((t, n), dtype=cp.uint16)
    fp8.gemm_codes(x8, sx, w, scratch, out)
    xd = E4M3[cp.asnumpy(x8)] * cp.asnumpy(sx)[:, None]
    wd = E4M3[cp.asnumpy(scratch).reshape(n, k)] * cp.asnumpy(w.f8_scale)[:, None]
    ref = xd @ wd.T
    got = _f32(cp.asnumpy(out)).astype(np.float64)
    assert (np.abs(got - ref) <= np.abs(ref) * 2.0 ** -8 + 1e-3 * np.abs(ref).max()).all()
    with pytest.raises(ValueError, match="accumulate"):
        fp8.gemm_codes(x8, sx, w, scratch, out, accumulate=True)


def test_swiglu_mlp_with_prefill_fp8_is_within_e4m3_of_the_reference(fp8, nops, rng,
                                                                     monkeypatch):
    """``swiglu_mlp`` over more rows than the GEMVs take on fp8 (gate | up in bf16, the SwiGLU
    written as down's codes, the residual added in down's epilogue): within e4m3's rounding of
    NumPy's float32 MLP; x is the result, updated in place as the fp16 path does. Zero-mean
    weights (no mins), so that gate and up swapped or the residual dropped are far off."""
    from ninfer.kernels.gpu import elementwise as gew
    calls = []
    kernel = gew.silu_mul_e4m3
    monkeypatch.setattr(gew, "silu_mul_e4m3", lambda gu: calls.append(gu.shape) or kernel(gu))
    ops = get_ops("cupy", kconf(prefill_fp8=True))
    t, h, i = 80, 512, 1024
    gq, dq = q4(rng, 2 * i, h, mins=False), q4(rng, h, i, mins=False)
    gate_up, down = ops.prepare_weight(gq), ops.prepare_weight(dq)
    x = (rng.standard_normal((t, h)) * 2).astype(np.float32)
    nw = rng.standard_normal(h).astype(np.float32)
    want = nops.swiglu_mlp(x.copy(), nw, dequantize(gq), dequantize(dq), 1e-5)
    dx = cp.asarray(x)
    got = ops.swiglu_mlp(dx, cp.asarray(nw), gate_up, down, 1e-5)
    err = rel(got, want)
    print("fp8 swiglu_mlp: rel", err)
    assert got is dx and err < E4M3_BOUND and calls == [(t, 2 * i)]

"""KV storage codecs (spec/models.md D.1-D.3): layouts, the Hadamard rotation, E8 pieces, and the
reconstruction cosine on Gaussian data and on SmolLM2's real K and V."""
from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest

from ninfer.engine.kv_dtypes import KV_DTYPES, head_bytes
from ninfer.kernels import e8
from ninfer.kernels.kv_codec import H64, codec, hadamard, rotate

QUANTIZED = [d for d in KV_DTYPES if d not in ("fp32", "fp16")]


@pytest.fixture
def rng(request):
    # fresh inputs per test, reproducible from the test's name
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def group_cosine(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Cosine per 64-dim group, (n_groups,) float64."""
    a = x.reshape(-1, 64).astype(np.float64)
    b = y.reshape(-1, 64).astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def parts(dtype):
    c = codec(dtype)
    return (("K", c.k), ("V", c.v))


# ------------------------------------------------------------------------------ layout

@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_round_trip_shapes_dtypes_and_bytes_match_kv_dtypes(dtype, head_dim, rng):
    x = rng.standard_normal((5, 3, head_dim)).astype(np.float32)
    for i, (_, part) in enumerate(parts(dtype)):
        codes, scales = part.encode(x)
        groups = 0 if dtype in ("fp32", "fp16") else head_dim // 64
        assert codes.dtype == np.uint8 and codes.shape == (5, 3, part.code_bytes(head_dim))
        assert scales.dtype == np.float16 and scales.shape == (5, 3, groups)
        assert part.code_bytes(head_dim) + 2 * groups == head_bytes(dtype, head_dim)[i]
        y = part.decode(codes, scales)
        assert y.dtype == np.float32 and y.shape == x.shape
        # any leading shape: a flat batch of heads encodes the same bytes
        flat = part.encode(x.reshape(-1, head_dim))
        assert (flat[0] == codes.reshape(15, -1)).all()
        assert (flat[1] == scales.reshape(15, -1)).all()
        # no heads at all is a valid (empty) batch
        empty = part.encode(np.zeros((0, 3, head_dim), np.float32))
        assert part.decode(*empty).shape == (0, 3, head_dim)


def test_codec_names_and_rotation_flags():
    assert {d: (codec(d).k.rotated, codec(d).v.rotated) for d in KV_DTYPES} == {
        "fp32": (False, False), "fp16": (False, False), "int8": (False, False),
        "rk8v4": (True, True), "rk4v4": (True, True), "rk4v4-e8": (True, True),
        "rk2v4-e8": (True, True)}
    with pytest.raises(ValueError, match="unknown KV dtype"):
        codec("int3")


def test_float_modes_store_raw_bytes(rng):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    codes, _ = codec("fp16").k.encode(x)
    assert (codes.view(np.float16) == x.astype(np.float16)).all()
    codes, _ = codec("fp32").v.encode(x)
    assert (codec("fp32").v.decode(codes, np.empty((4, 0), np.float16)) == x).all()


def test_int8_and_int4_layouts_follow_the_spec():
    # one group, unrotated int8: s = fp16(max|x| / 127), codes rint(x / s)
    x = np.zeros((1, 64), np.float32)
    x[0, :4] = [1.27, -0.64, 0.01, -1.27]
    codes, scales = codec("int8").k.encode(x)
    assert scales[0, 0] == np.float16(1.27 / 127)
    assert codes.view(np.int8)[0, :5].tolist() == [127, -64, 1, -127, 0]
    # rotated int4: y = H x; x = H e_0 gives y = e_0, so s = fp16(1/7) and code 7 at dim 0;
    # two codes a byte, low nibble the even dim
    x = H64[:1].copy()
    codes, scales = codec("rk4v4").v.encode(x)
    assert scales[0, 0] == np.float16(1 / 7) and codes[0, 0] == 0x07 and not codes[0, 1:].any()
    x = (H64[0] * 0.7 - H64[1] * 0.3).astype(np.float32)[None]      # y = (0.7, -0.3, 0...)
    codes, _ = codec("rk4v4").v.encode(x)
    assert codes[0, 0] == ((-3 & 0xF) << 4 | 7)


def test_hadamard_is_orthonormal_symmetric_and_self_inverse():
    h = hadamard(64)
    assert h.dtype == np.float32 and (np.abs(h) == np.float32(0.125)).all()
    assert (h == h.T).all() and np.allclose(h @ h, np.eye(64), atol=1e-6)
    assert h[3, 5] == -0.125 and h[3, 4] == 0.125        # popcount(3 & 5) = 1, popcount(3 & 4) = 0
    x = np.random.default_rng(0).standard_normal((7, 128)).astype(np.float32)
    assert np.allclose(rotate(rotate(x)), x, atol=1e-5)
    with pytest.raises(ValueError):
        hadamard(48)


def test_rotate_is_the_butterfly_of_x_h64_and_its_own_inverse():
    """rotate's fixed-order float32 butterfly equals x @ H64 within float32 rounding (6 stages
    of sums, |error| <= 6 eps of the group's sum of |x| / 8), is its own inverse within
    rounding, and keeps the shape and the float32 dtype."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 3, 192)) * np.array([1e-3, 1.0, 1e3])[None, :, None]
         ).astype(np.float32)
    y = rotate(x)
    assert y.dtype == np.float32 and y.shape == x.shape
    ref = (x.astype(np.float64).reshape(5, 3, 3, 64) @ hadamard(64).astype(np.float64))
    bound = 6 * np.finfo(np.float32).eps * np.abs(x).reshape(5, 3, 3, 64).sum(-1) / 8
    assert (np.abs(y.reshape(5, 3, 3, 64) - ref).max(-1) <= bound + 1e-30).all()
    back = rotate(y)
    assert (np.abs(back - x) <= 16 * np.finfo(np.float32).eps * np.abs(x).max()).all()
    e = np.eye(64, dtype=np.float32)
    assert np.array_equal(rotate(e), hadamard(64))          # exact on unit vectors
    assert np.array_equal(rotate(np.float64(x[0, 0])), y[0, 0])   # float32 arithmetic


# ------------------------------------------------------------------------------ E8

_OFFSETS = np.array(list(itertools.product((-1, 0, 1), repeat=8)), dtype=np.float64)


def _brute_e8(z: np.ndarray) -> float:
    """Squared distance from z (8,) to E8 by search: E8's covering radius is 1, so its nearest
    point has every coordinate within 1 of z, i.e. in floor(z) + {-1, 0, 1} (and likewise for
    the half coset): 2 x 3^8 candidates hold it."""
    best = np.inf
    for shift in (0.0, 0.5):
        cand = np.floor(z - shift) + _OFFSETS
        cand = cand[cand.sum(1) % 2 == 0] + shift
        best = min(best, ((cand - z) ** 2).sum(1).min())
    return best


def test_e8_nearest_point_matches_a_brute_force_search(rng):
    z = np.concatenate([rng.standard_normal((150, 8)) * 3,
                        rng.integers(-6, 7, (50, 8)) / 2,     # half-integers: the tie cases
                        rng.uniform(-7, 7, (100, 8))]).astype(np.float32)
    p = e8.e8_nearest(z).astype(np.float64)
    zz = z.astype(np.float64)
    twice = 2 * p
    assert (twice == np.rint(twice)).all()
    int_pt, half_pt = (p == np.rint(p)).all(1), (p - 0.5 == np.rint(p - 0.5)).all(1)
    assert (int_pt | half_pt).all()                           # in D8 u (D8 + 1/2)
    assert (np.rint(np.where(int_pt[:, None], p, p - 0.5)).sum(1) % 2 == 0).all()
    dist = ((p - zz) ** 2).sum(1)
    d8 = e8.d8_nearest(z).astype(np.float64)
    coset = e8.d8_nearest(z - np.float32(0.5)) + 0.5
    assert (dist <= ((d8 - zz) ** 2).sum(1) + 1e-6).all()
    assert (dist <= ((coset - zz) ** 2).sum(1) + 1e-6).all()
    brute = np.array([_brute_e8(v) for v in zz])
    assert np.allclose(dist, brute, atol=1e-5)


def test_e8_tie_rules():
    # odd sum: the worst-rounded coordinate moves toward z; equal errors -> the lowest index
    z = np.array([[0.4, 0.4, 0, 0, 0, 0, 0, 0]], np.float32)  # f = 0, even: no move
    assert (e8.d8_nearest(z) == 0).all()
    z = np.array([[0.75, 0.25, 0, 0, 0, 0, 0, 0]], np.float32)  # f = e_0, odd; errors tie
    assert e8.d8_nearest(z).tolist() == [[0, 0, 0, 0, 0, 0, 0, 0]]
    # D8 and the coset at equal distance: D8 wins
    z = np.full((1, 8), 0.25, np.float32)
    assert (e8.e8_nearest(z) == 0).all()


def test_e8_int4_codes_clamp_to_minus_8_7_and_plain_int4_to_7(rng):
    from ninfer.kernels.kv_codec import _unpack4
    x = rng.standard_normal((4000, 128)).astype(np.float32)
    e8_codes = _unpack4(codec("rk4v4-e8").k.encode(x)[0])
    int4_codes = _unpack4(codec("rk4v4").k.encode(x)[0])
    assert e8_codes.min() == -8 and e8_codes.max() == 7       # E8 points at +-7.5 / +-8 clamp
    assert int4_codes.min() == -7 and int4_codes.max() == 7
    # E8 rounding differs from scalar rounding on a good share of blocks
    assert 0.05 < (e8_codes != int4_codes).reshape(-1, 8).any(1).mean() < 0.95


def test_e8_roots_are_the_240_roots_and_the_encoder_picks_the_best(rng):
    roots = e8.ROOTS4.astype(np.float64) / 4
    assert roots.shape == (240, 8) and len({tuple(r) for r in roots}) == 240
    assert np.allclose((roots ** 2).sum(1), 2)
    in_e8 = e8.e8_nearest(roots.astype(np.float32)) == roots
    assert in_e8.all()
    u = rng.standard_normal((2000, 8)).astype(np.float32)
    root, rad_axis = e8.root_encode(u, np.full(2000, 0.3, np.float32))
    assert (root < 240).all()
    dots = (u / np.linalg.norm(u, axis=1, keepdims=True)) @ roots.T
    assert np.allclose(dots[np.arange(2000), root], dots.max(1), atol=1e-5)
    # decode: 4*root (+-1 on the axis) times R_k; radius 0 is the empty block
    assert (e8.root_decode(np.array([5]), np.array([0x0F])) == 0).all()
    c = e8.root_decode(np.array([0]), np.array([(8 << 4) | 3]))   # root -e0-e1, axis -e1, R=.5
    assert c.tolist() == [[-2, -2, 0, 0, 0, 0, 0, 0]]             # rint(-4*.5), rint(-5*.5)


# ------------------------------------------------------------------------------ edge inputs

@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_zero_heads_encode_to_zero_codes(dtype):
    for _, part in parts(dtype):
        codes, scales = part.encode(np.zeros((2, 128), np.float32))
        assert not codes.any() and not scales.any()
        assert (part.decode(codes, scales) == 0).all()


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_are_refused(dtype, bad):
    x = np.ones((2, 64), np.float32)
    x[1, 7] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        codec(dtype).k.encode(x)


def test_bad_shapes_and_dtypes_are_refused():
    with pytest.raises(ValueError, match="multiple of 64"):
        codec("rk4v4").k.encode(np.ones((2, 96), np.float32))
    with pytest.raises(ValueError, match="float array"):
        codec("int8").k.encode(np.ones((2, 64), np.int32))
    with pytest.raises(ValueError, match="fp16"):
        codec("int8").v.encode(np.full((1, 64), 1e7, np.float32))
    codes, scales = codec("rk2v4-e8").k.encode(np.ones((2, 128), np.float32))
    with pytest.raises(ValueError, match="code bytes"):
        codec("rk4v4").k.decode(codes, scales)
    with pytest.raises(ValueError, match="leading shape"):
        codec("rk2v4-e8").k.decode(codes, scales[:1])


# ------------------------------------------------------------------------------ quality

# Mean cosine per 64-group, decode(encode(x)) vs x, on N(0, 1) heads (8192 groups). Measured
# int8 0.99998, int4 0.99437, E8 int4 0.98697, E8-root 0.89189; the floors are these less 0.003,
# over 20x the std of the mean between seeds (<= 1.3e-4), so only a codec change trips them.
# They clear spec D.4's vendor numbers less 0.003 (int8 .998, rk8v4 K .998, rk4v4 .978,
# rk4v4-e8 .987) except rk2v4-e8's 0.962, which its root + axis code cannot reach on
# isotropic blocks (the direction alone caps the block cosine near 0.897).
GAUSSIAN_FLOOR = {"int8": 0.9969, "int4": 0.9913, "e8": 0.9839, "e8root": 0.8888}


def test_gaussian_cosine_per_mode():
    x = np.random.default_rng(0).standard_normal((2048, 2, 128)).astype(np.float32)
    rows = []
    for dtype in QUANTIZED:
        cos = {}
        for name, part in parts(dtype):
            c = group_cosine(x, part.decode(*part.encode(x)))
            cos[name] = c.mean()
            assert cos[name] >= GAUSSIAN_FLOOR[part.kind], (dtype, name, cos[name])
        rows.append(f"{dtype:9s} K {cos['K']:.5f}  V {cos['V']:.5f}")
    print("\nGaussian per-group cosine\n" + "\n".join(rows))


@pytest.fixture(scope="module")
def smollm2_kv(smollm2_gguf):
    """K and V of every layer of SmolLM2 after a prefill of a short prompt,
    [(k, v)] each (tokens, kv_heads, 64) float32."""
    from ninfer.engine.models import load_model
    from ninfer.engine.models.llama import ForwardBatch
    from ninfer.engine.tokenizer import Tokenizer
    from ninfer.kernels import get_ops
    from ninfer.store.artifact import load_model_file

    art = load_model_file(smollm2_gguf)
    model = load_model(art, get_ops("numpy"))
    ids = Tokenizer.from_dict(art.tokenizer).encode(
        "The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published four "
        "papers that changed physics: on the photoelectric effect, Brownian motion, special "
        "relativity and the equivalence of mass and energy.")
    pages = -(-len(ids) // 16)
    kv = model.new_kv_cache(pages, 16)
    model.forward(ForwardBatch.from_sequences([ids], [0], [list(range(pages))], 16), kv)
    n = len(ids)
    return [(kv.k[i].reshape(-1, kv.nkv, kv.hd)[:n], kv.v[i].reshape(-1, kv.nkv, kv.hd)[:n])
            for i in range(kv.num_layers)]


# Measured on the prompt above (all 30 layers, head_dim 64), worst-layer mean cosine: int8
# 0.9999, int4 0.9940 (K) / 0.9943 (V), E8 int4 0.9864, E8-root 0.8898; the floors sit 0.01
# (0.02 for the E8-root key) under them, room for other prompts or a re-quantised model file.
SMOLLM2_FLOOR = {"int8": 0.99, "int4": 0.984, "e8": 0.976, "e8root": 0.87}


@pytest.mark.slow
def test_smollm2_kv_cosine_per_mode(smollm2_kv):
    assert smollm2_kv[0][0].shape[-1] == 64
    rows = []
    for dtype in QUANTIZED:
        cells = []
        for j, (name, part) in enumerate(parts(dtype)):
            per_layer = []
            for layer in smollm2_kv:
                x = layer[j]
                c = group_cosine(x, part.decode(*part.encode(x)))
                assert np.isfinite(c).all(), (dtype, name)
                per_layer.append(c.mean())
            worst = min(per_layer)
            cells.append(f"{name} {np.mean(per_layer):.4f} (worst layer {worst:.4f})")
            assert worst >= SMOLLM2_FLOOR[part.kind], (dtype, name, worst)
        rows.append(f"{dtype:9s} " + "  ".join(cells))
    print("\nSmolLM2 K/V per-group cosine\n" + "\n".join(rows))

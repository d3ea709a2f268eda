"""E8 lattice pieces of the rk4v4-e8 and rk2v4-e8 KV key codecs, NumPy reference.

Every function works on blocks of 8 consecutive rotated dims, (..., 8) float32, vectorised over
any leading shape. Sources: Conway & Sloane 1982, "Fast quantizing and decoding algorithms for
lattice quantizers and codes" (nearest point); spec/models.md D.2 / D.3 and the ninfer-4090 forks
it cites (the root "cylinder" codec, its code order and tie rules).
"""
from __future__ import annotations

import numpy as np

_F = np.float32
_INV_SQRT2 = _F(0.7071067811865475)
_SQRT8 = _F(2.82842712474619)
RADIUS_FLOOR = _F(0.08)   # relative block norms below this are stored as the empty block
# radius index k stands for R_k = 1/2 * 2^((k-8)/3); the 4-decimal values the GPU decode tables use
RADIUS_SCALE = np.array([0.0, .0992, .1250, .1575, .1984, .2500, .3150, .3969, .5000, .6300,
                         .7937, 1.0, 1.2599, 1.5874, 2.0, 2.5198], dtype=_F)
# k = round(3 log2 r + 8) clamped to [1, 15] is 1 + #{k' = 2..15 : r >= 2^((k'-8.5)/3)}: no log
RADIUS_BOUNDS = (2.0 ** ((np.arange(2, 16) - 8.5) / 3)).astype(_F)


def octet_sum(x: np.ndarray) -> np.ndarray:
    """(..., 8) -> (...): ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7)), the warp butterfly's order, so a
    GPU encoder can reproduce the same float32 bits."""
    a = x[..., 0::2] + x[..., 1::2]
    b = a[..., 0::2] + a[..., 1::2]
    return b[..., 0] + b[..., 1]


def _take(x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    return np.take_along_axis(x, idx[..., None], axis=-1)[..., 0]


def d8_nearest(x: np.ndarray) -> np.ndarray:
    """Nearest point of D8 (integer vectors with an even sum): round, and if the sum is odd move
    the coordinate rounded worst (lowest index on ties) one step toward x (+1 when x == f)."""
    f = np.rint(x)
    worst = np.argmax(np.abs(x - f), axis=-1)
    odd = (f.astype(np.int64).sum(axis=-1) & 1).astype(_F)
    step = np.where(_take(x, worst) >= _take(f, worst), _F(1), _F(-1)) * odd
    np.put_along_axis(f, worst[..., None], (_take(f, worst) + step)[..., None], axis=-1)
    return f


def e8_nearest(z: np.ndarray) -> np.ndarray:
    """Nearest point of E8 = D8 u (D8 + 1/2) to z (..., 8) float32; on equal distance D8 wins."""
    z = np.asarray(z, dtype=_F)
    d8 = d8_nearest(z)
    coset = d8_nearest(z - _F(0.5)) + _F(0.5)
    near_d8 = octet_sum(np.square(z - d8)) <= octet_sum(np.square(z - coset))
    return np.where(near_d8[..., None], d8, coset)


def _roots4() -> np.ndarray:
    """The 240 E8 roots times 4 as int8 (240, 8), row = root code (spec D.3 step 2)."""
    rows = []
    for i in range(7):                      # type A: +-e_i +-e_j, pairs in lexicographic order
        for j in range(i + 1, 8):
            for bits in range(4):           # bit 1: sign of i positive, bit 0: sign of j
                r = [0] * 8
                r[i], r[j] = (4 if bits & 2 else -4), (4 if bits & 1 else -4)
                rows.append(r)
    for bits in range(128):                 # type B: 1/2(+-1)^8, even minus count; dim 7 by parity
        signs = [1 if bits >> i & 1 else -1 for i in range(7)]
        signs.append(1 if signs.count(-1) % 2 == 0 else -1)
        rows.append([2 * s for s in signs])
    return np.array(rows, dtype=np.int8)


ROOTS4 = _roots4()
_PAIR_INDEX = np.full((8, 8), -1, dtype=np.int64)
_PAIR_INDEX[np.triu_indices(8, 1)] = np.arange(28)


def root_encode(y: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Encode rotated key blocks y (..., 8) float32 with their group scales s (...) float32 as
    (root code (...) uint8, (radius << 4) | axis (...) uint8), spec D.3. Empty blocks are (0, 0)."""
    y = np.asarray(y, dtype=_F)
    norm = np.sqrt(octet_sum(y * y))
    rel = norm / (np.asarray(s, dtype=_F) * _SQRT8 + _F(1e-8))
    radius = np.where(rel >= RADIUS_FLOOR, 1 + (rel[..., None] >= RADIUS_BOUNDS).sum(-1), 0)
    u = y * (_F(1) / (norm + _F(1e-8)))[..., None]
    a = np.abs(u)
    pos = u >= 0                                    # -0.0 counts as positive, as on the GPU
    # type A: the two largest |u|, lowest index first on ties
    top = np.argsort(-a, axis=-1, kind="stable")[..., :2]
    i, j = top.min(axis=-1), top.max(axis=-1)
    pair_score = _take(a, top[..., 0]) + _take(a, top[..., 1])
    pair_code = 4 * _PAIR_INDEX[i, j] + 2 * _take(pos, i) + _take(pos, j)
    # type B: signs of u; an odd minus count flips the smallest |u| (lowest index on ties)
    small = np.argmin(a, axis=-1)
    odd = ((~pos).sum(axis=-1) & 1) == 1
    half_score = _F(0.5) * octet_sum(a) - np.where(odd, _take(a, small), _F(0))
    half_pos = pos ^ (odd[..., None] & (np.arange(8) == small[..., None]))
    half_code = 112 + (half_pos[..., :7] << np.arange(7)).sum(axis=-1)
    root = np.where(pair_score >= half_score, pair_code, half_code)
    # residual axis: largest |u - (u.r)r| (lowest index on ties), r the unit root, and its sign
    direction = (ROOTS4[root].astype(_F) * _F(0.25)) * _INV_SQRT2
    residual = u - octet_sum(u * direction)[..., None] * direction
    axis_dim = np.argmax(np.abs(residual), axis=-1)
    axis = 2 * axis_dim + (_take(residual, axis_dim) < 0)
    empty = radius == 0
    return (np.where(empty, 0, root).astype(np.uint8),
            np.where(empty, 0, (radius << 4) | axis).astype(np.uint8))


def root_decode(root: np.ndarray, radius_axis: np.ndarray) -> np.ndarray:
    """Blocks back to int8 codes (..., 8): c_d = rint((4 root_d +- [d = axis]) R_k), spec D.3
    step 5 (in units of the group scale). Radius 0, or a root code >= 240, decodes to zeros."""
    root = np.asarray(root, dtype=np.int64)
    radius_axis = np.asarray(radius_axis, dtype=np.int64)
    radius = radius_axis >> 4
    valid = (radius > 0) & (root < 240)
    v = ROOTS4[np.where(valid, root, 0)].astype(np.int64)
    sign = np.where(radius_axis & 1, -1, 1)
    v += (np.arange(8) == ((radius_axis >> 1) & 7)[..., None]) * sign[..., None]
    c = np.rint(v.astype(_F) * RADIUS_SCALE[radius][..., None])
    return np.where(valid[..., None], c, 0).astype(np.int8)

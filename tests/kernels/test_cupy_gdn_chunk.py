"""The chunked gated delta rule on the GPU (``gpu.gdn_chunk``) against the NumPy references
(token by token and chunked, float32) on fresh random inputs, every CuPy allocation
NaN-poisoned first (the ``poison`` fixture of ``test_cupy_ops``): lengths around the 64-token
chunk, ragged batches with a sequence without a state slot, the untouched slots of the pool,
and a sequence prefilled in two calls against one call."""
from __future__ import annotations

import numpy as np
import pytest

from ninfer.kernels import gdn as ref
from tests.kernels.test_cupy_ops import (GDN_TOL, _gdr_inputs, cp, gops, nops,  # noqa: F401
                                         poison, rel, rng)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("lens,hk,hv,dk,dv", [
    ((1,), 2, 4, 128, 128),
    ((63,), 2, 4, 128, 128),
    ((64,), 2, 4, 128, 128),
    ((65,), 2, 4, 128, 128),
    ((1000,), 2, 4, 128, 128),            # Qwen3.5's head dims, 16 chunks
    ((65, 1, 130, 7), 1, 3, 64, 48),      # ragged: a 64-column block's columns past dv
    ((200, 3), 2, 2, 16, 8),              # the tiny test models' dims
    ((129,), 1, 2, 100, 96),              # dk padded to 128
    ((32768,), 1, 2, 128, 128),           # 512 chunks: the state's carry over a long prompt
])
def test_chunked_equals_the_references(gops, nops, rng, lens, hk, hv, dk, dv):
    pool = len(lens) + 2
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    slots = rng.permutation(pool)[:len(lens)].astype(np.int64)
    if len(lens) > 1:
        slots[1] = ref.NO_SLOT   # zero state in, nothing written
    t = int(cu[-1])
    q, k, v, g, beta = _gdr_inputs(rng, t, hk, hv, dk, dv)
    state = (rng.standard_normal((pool, hv, dk, dv)) * 0.1).astype(np.float32)
    scale = dk ** -0.5
    dstate = cp.asarray(state)
    got = gops.gated_delta_rule(cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(g),
                                cp.asarray(beta), dstate, cu, slots, scale, "chunked")
    for mode in ("recurrent", "chunked"):
        ref_state = state.copy()
        want = nops.gated_delta_rule(q, k, v, g, beta, ref_state, cu, slots, scale, mode)
        assert rel(got, want) < GDN_TOL, mode
        assert rel(dstate, ref_state) < GDN_TOL, mode
    kept = np.setdiff1d(np.arange(pool), slots[slots >= 0])
    assert np.array_equal(cp.asnumpy(dstate)[kept], state[kept])


@pytest.mark.parametrize("split", [64, 100, 1])
def test_two_calls_equal_one(gops, rng, split):
    """A prompt's delta rule in two calls (the state carried through the pool) equals one call."""
    t, hk, hv, dk, dv = 300, 2, 4, 128, 128
    q, k, v, g, beta = (cp.asarray(a) for a in _gdr_inputs(rng, t, hk, hv, dk, dv))
    state = cp.zeros((2, hv, dk, dv), cp.float32)
    one = gops.gated_delta_rule(q, k, v, g, beta, state, np.array([0, t]), np.array([1]),
                                dk ** -0.5)
    two_state = cp.zeros_like(state)
    parts = [gops.gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], two_state,
                                   np.array([0, b - a]), np.array([1]), dk ** -0.5)
             for a, b in ((0, split), (split, t))]
    assert rel(cp.concatenate(parts), cp.asnumpy(one)) < GDN_TOL
    assert rel(two_state, cp.asnumpy(state)) < GDN_TOL

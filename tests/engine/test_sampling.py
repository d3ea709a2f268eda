"""Sampling: filters against a brute-force reference, Philox determinism, the distribution."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from ninfer.engine.sampling import (LOG_PROB_FLOOR, SamplingError, SamplingParams, filtered_candidates,
                                    philox_uniform, sample, sample_batch)


def reference_filter(logits, p: SamplingParams):
    """Straightforward full-vocabulary version of the documented filter order."""
    z = (logits / np.float32(p.temperature)).astype(np.float64)
    floor = (logits / np.float32(p.temperature)) >= (logits / np.float32(p.temperature)).max() \
        - LOG_PROB_FLOOR
    probs = np.where(floor, np.exp(z - z.max()), 0.0)
    probs /= probs.sum()
    keep = floor.copy()
    if p.top_k:
        order = np.lexsort((np.arange(probs.size), -probs))
        keep[:] = False
        keep[order[:p.top_k]] = True
        keep &= floor
    if p.top_p < 1:
        q = np.where(keep, probs, 0)
        order = np.lexsort((np.arange(probs.size), -q))
        csum = np.cumsum(q[order])
        n = int(np.argmax(csum >= p.top_p * q.sum() - 1e-15)) + 1
        new = np.zeros_like(keep)
        new[order[:n]] = True
        keep &= new
    if p.min_p:
        keep &= probs >= p.min_p * probs[keep].max()
    ids = np.flatnonzero(keep)
    return ids, probs[ids] / probs[ids].sum()


@pytest.mark.parametrize("scale", [1.0, 4.0, 12.0])
@pytest.mark.parametrize("params", [
    dict(temperature=1.0), dict(temperature=0.7, top_k=40), dict(temperature=1.3, top_p=0.9),
    dict(temperature=0.8, min_p=0.05), dict(temperature=0.6, top_k=50, top_p=0.8, min_p=0.02),
    dict(temperature=1.0, top_k=1), dict(temperature=2.0, top_p=0.3),
])
def test_filters_match_bruteforce_reference(scale, params):
    # crc32 of the repr, not hash(): str hashes differ per process (PYTHONHASHSEED).
    rng = np.random.default_rng(zlib.crc32(repr((scale, sorted(params.items()))).encode()))
    logits = (rng.standard_normal(5000) * scale).astype(np.float32)
    p = SamplingParams(seed=1, **params)
    ids, probs = filtered_candidates(logits, p)
    rids, rprobs = reference_filter(logits, p)
    assert ids.tolist() == rids.tolist()
    np.testing.assert_allclose(probs, rprobs, rtol=1e-9, atol=1e-15)
    assert np.all(np.diff(ids) > 0)


def test_greedy_is_argmax_and_ignores_seed():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(1000).astype(np.float32)
    for seed in (0, 1, 2**64 - 1):
        assert sample(logits, SamplingParams(temperature=0.0, seed=seed), 5) == \
            int(np.argmax(logits))


def test_philox_stream_depends_only_on_seed_and_position():
    a = [philox_uniform(42, i) for i in range(64)]
    b = [philox_uniform(42, i) for i in reversed(range(64))][::-1]
    assert a == b
    assert a != [philox_uniform(43, i) for i in range(64)]
    assert all(0.0 <= u < 1.0 for u in a)
    assert len(set(a)) == 64


def test_sampled_frequencies_follow_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    p = SamplingParams(temperature=1.0, seed=12345)
    n = 20000
    counts = np.bincount([sample(logits, p, i) for i in range(n)], minlength=4)
    expected = np.array([0.5, 0.3, 0.15, 0.05]) * n
    sigma = np.sqrt(expected * (1 - expected / n))
    assert np.all(np.abs(counts - expected) < 4 * sigma), counts


def test_batch_rows_are_independent_of_each_other():
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((4, 3000)).astype(np.float32) * 3
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s) for s in (1, 2, 3, 4)]
    alone = [sample(logits[i], params[i], 9) for i in range(4)]
    assert sample_batch(logits, params, [9] * 4) == alone
    assert sample_batch(logits[::-1].copy(), params[::-1], [9] * 4) == alone[::-1]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5),
                                 dict(top_k=-1), dict(min_p=2), dict(seed=-1),
                                 dict(temperature=float("nan"))])
def test_invalid_params_raise(bad):
    with pytest.raises(SamplingError):
        SamplingParams(**bad)

"""The rejection rule of speculative sampling: every emitted token is distributed as the
target's own (filtered) distribution, whatever the drafts' distribution, and seeded draws
repeat."""
from __future__ import annotations

import numpy as np

from ninfer.engine.sampling import SamplingParams, filtered_candidates
from ninfer.engine.spec_sampling import accept_sampled, sample_draft

V = 6
N = 3000


def emitted(p_logits, q_logits, params_of, k: int = 1) -> np.ndarray:
    """Counts of the first emitted token over N seeds, drafts drawn from q."""
    counts = np.zeros(V)
    for seed in range(N):
        p = params_of(seed)
        drafts, dists = [], []
        for j in range(k):
            x, d = sample_draft(q_logits[j], p, j)
            drafts.append(x)
            dists.append(d)
        a, toks = accept_sampled(drafts, dists, p_logits, p, 0)
        assert 0 <= a <= k and len(toks) == a + 1 and toks[:a] == drafts[:a]
        counts[toks[0]] += 1
    return counts / N


def target(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    ids, probs = filtered_candidates(row, p)
    out = np.zeros(V)
    out[ids] = probs
    return out


def test_first_token_follows_the_target_distribution():
    rng = np.random.default_rng(0)
    p_logits = rng.standard_normal((3, V)).astype(np.float32) * 1.5
    q_logits = rng.standard_normal((2, V)).astype(np.float32) * 1.5
    for params_of in (lambda s: SamplingParams(temperature=1.0, seed=s),
                      lambda s: SamplingParams(temperature=0.7, top_k=3, seed=s)):
        want = target(p_logits[0], params_of(0))
        for k in (1, 2):
            got = emitted(p_logits, q_logits, params_of, k)
            assert np.abs(got - want).max() < 0.035, (got, want)
            assert (got[want == 0] == 0).all()   # filtered-out tokens never come out


def test_drafts_equal_to_the_target_are_always_kept():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, V)).astype(np.float32)
    for seed in range(200):
        p = SamplingParams(temperature=1.0, seed=seed)
        x0, d0 = sample_draft(logits[0], p, 0)
        x1, d1 = sample_draft(logits[1], p, 1)
        a, toks = accept_sampled([x0, x1], [d0, d1], logits, p, 0)
        assert a == 2 and toks[:2] == [x0, x1]
        assert accept_sampled([x0, x1], [d0, d1], logits, p, 0) == (a, toks)   # seeded

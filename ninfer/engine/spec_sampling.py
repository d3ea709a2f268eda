"""Speculative sampling by the standard rejection rule (Leviathan et al. 2023, Chen et al.
2023), seeded: a sampled request's drafts come from the MTP head's filtered distribution q,
draft j is kept with probability ``min(1, p(x) / q(x))`` under the target's filtered
distribution p, the first rejected one is replaced by a draw from ``max(0, p - q)``
(renormalised), and when every draft is kept the next token is drawn from p. Each emitted
token is then distributed exactly as plain sampling from p would draw it.

Every draw takes its uniform from the request's Philox stream at the token's output index, on a
counter word of its own (``STREAM_*``), so a seeded request gives the same tokens whatever else
is batched with it; the token after all kept drafts is the plain draw (``sampling.sample``).
"""
from __future__ import annotations

import numpy as np

from .sampling import SamplingParams, filtered_candidates, philox_uniform, sample

STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL = 1, 2, 3


def draw(ids: np.ndarray, probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw of one of ``ids`` with ``probs`` at uniform ``u``."""
    cdf = np.cumsum(probs)
    return int(ids[min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), ids.size - 1)])


def _prob(ids: np.ndarray, probs: np.ndarray, x) -> np.ndarray:
    """Probabilities of tokens ``x`` under sparse ``(ids ascending, probs)`` (0 elsewhere)."""
    x = np.asarray(x, dtype=np.int64)
    i = np.clip(np.searchsorted(ids, x), 0, ids.size - 1)
    return np.where(ids[i] == x, probs[i], 0.0)


def sample_draft(logits: np.ndarray, p: SamplingParams, index: int):
    """A draft for output ``index`` from the MTP logits ``(V,)``: ``(token, (ids, probs))``."""
    ids, probs = filtered_candidates(logits, p)
    return draw(ids, probs, philox_uniform(p.seed, index, STREAM_DRAFT)), (ids, probs)


def accept_sampled(drafts, dists, targets: np.ndarray, p: SamplingParams,
                   index: int) -> tuple[int, list[int]]:
    """The rejection rule over one lane's ``drafts`` (output indices ``index ..``) with their
    draft distributions ``dists`` and the target logits ``targets`` ``(len(drafts) + 1, V)``
    (row j: the distribution of draft j's token). Returns ``(a, tokens)``: ``a`` drafts kept
    and the ``a + 1`` tokens to commit."""
    for j, (x, (qi, qp)) in enumerate(zip(drafts, dists)):
        pi, pp = filtered_candidates(targets[j], p)
        px, qx = float(_prob(pi, pp, x)), float(_prob(qi, qp, x))
        if philox_uniform(p.seed, index + j, STREAM_ACCEPT) * qx < px:
            continue
        ids = np.union1d(pi, qi)
        r = np.maximum(_prob(pi, pp, ids) - _prob(qi, qp, ids), 0.0)
        if r.sum() <= 0.0:   # p == q where both live: a draw from p
            ids, r = pi, pp
        tok = draw(ids, r, philox_uniform(p.seed, index + j, STREAM_RESIDUAL))
        return j, [int(t) for t in drafts[:j]] + [tok]
    return len(drafts), [int(t) for t in drafts] + [sample(targets[len(drafts)], p,
                                                            index + len(drafts))]

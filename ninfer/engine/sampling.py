"""Token sampling with a per-request counter-based RNG.

Each sampled token draws one uniform number from Philox-4x64 keyed by the request's seed with the
counter set to the token's output position, so a request's random stream depends only on
(seed, position) — never on batch composition, concurrency or a shared generator
(Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11; NumPy's ``Philox``).

Filter order (as vLLM): temperature scaling, then top-k, top-p (nucleus) and min-p on the
resulting distribution, then inverse-CDF sampling. ``temperature == 0`` is greedy (argmax, ties
to the lowest id).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


GREEDY_BELOW = 1e-5
MIN_REPETITION_PENALTY = 0.01


class SamplingError(ValueError):
    """Invalid sampling parameters (message names the parameter)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Resolved sampling parameters of one request.

    Attributes:
        temperature: >= 0; below ``GREEDY_BELOW`` (1e-5, as vLLM) means greedy.
        top_k: keep the k most likely tokens; 0 disables.
        top_p: nucleus mass in (0, 1]; 1 disables.
        min_p: drop tokens with p < min_p * p_max; 0 disables.
        seed: non-negative integer < 2**64 keying the Philox stream.
        presence_penalty: subtracted once from the logit of every token already generated
            (OpenAI semantics), in [-2, 2].
        frequency_penalty: subtracted per occurrence in the output so far, in [-2, 2].
        repetition_penalty: HF/llama.cpp multiplicative penalty on tokens seen in the prompt or
            the output (positive logits divided, negative multiplied); 1 disables.
    """
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if not (self.temperature >= 0) or not np.isfinite(self.temperature):
            raise SamplingError("temperature must be a finite number >= 0")
        if self.top_k < 0:
            raise SamplingError("top_k must be >= 0")
        if not (0 < self.top_p <= 1):
            raise SamplingError("top_p must be in (0, 1]")
        if not (0 <= self.min_p <= 1):
            raise SamplingError("min_p must be in [0, 1]")
        if not (0 <= self.seed < 2 ** 64):
            raise SamplingError("seed must be in [0, 2**64)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (-2.0 <= v <= 2.0):
                raise SamplingError(f"{name} must be in [-2, 2]")
        if not (MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10):
            raise SamplingError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 10]")

    @property
    def greedy(self) -> bool:
        """Temperatures below ``GREEDY_BELOW`` are greedy (dividing logits by them overflows)."""
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "min_p": self.min_p, "seed": self.seed,
                "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty,
                "repetition_penalty": self.repetition_penalty}


def apply_penalties(logits: np.ndarray, output_counts: np.ndarray, seen: np.ndarray,
                    p: SamplingParams) -> np.ndarray:
    """Penalised copy of ``logits``.

    Args:
        logits: ``(V,)`` float32.
        output_counts: ``(V,)`` int32, occurrences of each token in the output so far.
        seen: ``(V,)`` bool, tokens present in the prompt or the output (repetition penalty).
        p: the request's parameters.
    Returns:
        ``(V,)`` float32. Sources: OpenAI's presence/frequency penalty definition; HF
        ``RepetitionPenaltyLogitsProcessor`` (CTRL, Keskar et al. 2019) for repetition.
    """
    out = np.array(logits, dtype=np.float32, copy=True)
    if p.repetition_penalty != 1.0:
        idx = np.flatnonzero(seen)
        v = out[idx]
        out[idx] = np.where(v > 0, v / np.float32(p.repetition_penalty),
                            v * np.float32(p.repetition_penalty))
    if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
        idx = np.flatnonzero(output_counts)
        out[idx] -= np.float32(p.presence_penalty) + \
            np.float32(p.frequency_penalty) * output_counts[idx].astype(np.float32)
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``(V,)`` float32 logits -> float64 log-probabilities (numerically stable)."""
    z = logits.astype(np.float64)
    z -= z.max()
    return z - np.log(np.exp(z).sum())


def top_logprobs(logits: np.ndarray, token: int, k: int) -> tuple[float, list]:
    """(log-probability of ``token``, ``[(id, logprob)]`` of the ``k`` most likely, best first)
    under the model's raw distribution ``softmax(logits)``."""
    lp = log_softmax(logits)
    top = []
    if k > 0:
        idx = np.argpartition(-lp, k - 1)[:k]
        idx = idx[np.lexsort((idx, -lp[idx]))]
        top = [(int(i), float(lp[i])) for i in idx]
    return float(lp[token]), top


def philox_uniform(seed: int, position: int, stream: int = 0) -> float:
    """The uniform draw in [0, 1) for output ``position`` of the stream keyed by ``seed``
    (``stream``: another counter word, for draws of the same position that must differ)."""
    bitgen = np.random.Philox(key=seed, counter=[position, stream, 0, 0])
    return float(np.random.Generator(bitgen).random())


NUCLEUS_PROBE = 256
LOG_PROB_FLOOR = 30.0


def filtered_candidates(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Token ids that survive temperature, top-k, top-p and min-p, with their renormalised
    probabilities.

    Args:
        logits: ``(V,)`` float32 raw logits; ``p.temperature`` must be > 0.
    Returns:
        ``(ids, probs)``: ``ids`` int64 ascending, ``probs`` float64 summing to 1.

    Tokens whose probability is below ``exp(-LOG_PROB_FLOOR)`` times the most likely token's
    (about 1e-13) are dropped first; this changes no other token's probability by more than
    V * 1e-13. Top-p first looks at the ``NUCLEUS_PROBE`` most likely tokens and sorts the whole candidate
    set only when their mass is below ``top_p`` (the result is the same, it is just cheaper).
    """
    z = np.asarray(logits, dtype=np.float32) / np.float32(p.temperature)
    zmax = z.max()
    # tokens more than e^-LOG_PROB_FLOOR below the most likely one are never sampled
    cand = np.flatnonzero(z >= zmax - LOG_PROB_FLOOR)
    zc = z[cand].astype(np.float64) - float(zmax)
    probs = np.zeros(z.size, dtype=np.float64)
    probs[cand] = np.exp(zc)
    probs[cand] /= probs[cand].sum()
    ids = cand
    if p.top_k and p.top_k < ids.size:
        ids = ids[np.argpartition(probs[ids], -p.top_k)[-p.top_k:]]
    if p.top_p < 1.0:
        total = probs[ids].sum()
        probe = ids
        if ids.size > NUCLEUS_PROBE:
            probe = ids[np.argpartition(probs[ids], -NUCLEUS_PROBE)[-NUCLEUS_PROBE:]]
            if probs[probe].sum() < p.top_p * total:
                probe = ids
        order = probe[np.lexsort((probe, -probs[probe]))]  # prob desc, id asc
        csum = np.cumsum(probs[order])
        cut = int(np.searchsorted(csum, p.top_p * total, side="left")) + 1
        ids = order[:cut]
    kept = probs[ids]
    if p.min_p > 0.0:
        keep = kept >= p.min_p * kept.max()
        ids, kept = ids[keep], kept[keep]
    order = np.argsort(ids)
    ids, kept = ids[order], kept[order]
    return ids, kept / kept.sum()


def sample(logits: np.ndarray, p: SamplingParams, position: int) -> int:
    """Sample one token id from ``logits`` ``(V,)`` float32 for output ``position``."""
    if p.greedy:
        return int(np.argmax(logits))
    ids, probs = filtered_candidates(logits, p)
    u = philox_uniform(p.seed, position)
    cdf = np.cumsum(probs)
    idx = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), ids.size - 1)
    return int(ids[idx])


def sample_batch(logits: np.ndarray, params: list[SamplingParams],
                 positions: list[int]) -> list[int]:
    """Sample one token per row of ``logits`` ``(S, V)``; row i uses ``params[i]`` and
    ``positions[i]``. Each row's result is independent of the other rows."""
    return [sample(logits[i], params[i], positions[i]) for i in range(len(params))]

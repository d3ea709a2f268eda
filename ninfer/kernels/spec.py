"""The speculative round's bookkeeping ops, NumPy reference (``Qwen35Model.spec_round``).

A device round verifies ``k`` drafts of each of B lanes in one pass over ``B (k + 1)`` rows
(lane b's rows ``b (k + 1) .. b (k + 1) + k`` hold its pending token and drafts), then
accepts, advances the recurrent state by the accepted tokens and drafts the next ``k`` tokens
without the host.
These ops are the glue between the passes; on the GPU (``gpu.spec``) each is one kernel whose
index inputs and outputs are a CUDA graph's static buffers.

Conventions: ``acc[b]`` counts the tokens lane b keeps, ``a + 1`` for ``a`` accepted drafts
(1 .. k + 1); a lane whose first KV slot is negative is a padding row: its outputs are
computed but nothing of it is stored.
"""
from __future__ import annotations

import numpy as np

from ninfer.kernels import gdn
from ninfer.kernels.gdn import NO_SLOT


def argmax_into(logits: np.ndarray, out: np.ndarray) -> None:
    """``out[r]`` = index of the largest value of row r (the first on ties), int32."""
    out[:] = np.argmax(logits, axis=-1)


def accept_counts(ids: np.ndarray, targets: np.ndarray, k: int, out: np.ndarray) -> None:
    """``out[b]`` = 1 + the number of leading drafts of lane b equal to the target before them:
    ``ids[b (k + 1) + i]`` is draft i (i >= 1), ``targets[b (k + 1) + i - 1]`` the model's
    choice after the tokens before it."""
    d = np.asarray(ids).reshape(-1, k + 1)[:, 1:]
    t = np.asarray(targets).reshape(-1, k + 1)[:, :k]
    miss = d != t
    out[:] = 1 + np.where(miss.any(axis=1), miss.argmax(axis=1), k)


def accepted_rows(x: np.ndarray, acc: np.ndarray, k: int) -> np.ndarray:
    """Row ``b (k + 1) + acc[b] - 1`` of (B (k + 1), H) ``x`` for every lane: (B, H), new."""
    b = np.arange(acc.shape[0]) * (k + 1) + np.asarray(acc, dtype=np.int64) - 1
    return x[b].copy()


def chain_inputs(positions: np.ndarray, slot_mapping: np.ndarray, acc: np.ndarray, j: int,
                 block_tables: np.ndarray, page_size: int, out_pos: np.ndarray,
                 out_slots: np.ndarray, out_lens: np.ndarray) -> None:
    """Inputs of the MTP head's j-th chained pass (j >= 2) of a round, one row per lane: the
    drafted token ``j - 1`` pairs with the head's state at position ``n + acc - 1 + j - 1``,
    ``n`` being the lane's first verified position (``positions[b (k + 1)]``). Writes that
    position, its KV slot in the lane's block table (-1 for a padding lane) and the context
    length ``position + 1``."""
    nb = acc.shape[0]
    k1 = positions.shape[0] // nb
    n = np.asarray(positions, dtype=np.int64).reshape(nb, k1)[:, 0]
    p = n + np.asarray(acc, dtype=np.int64) + j - 2
    pad = np.asarray(slot_mapping).reshape(nb, k1)[:, 0] < 0
    page = np.asarray(block_tables)[np.arange(nb), np.where(pad, 0, p // page_size)]
    out_pos[:] = p
    out_slots[:] = np.where(pad, -1, page.astype(np.int64) * page_size + p % page_size)
    out_lens[:] = p + 1


def record_conv(rec: np.ndarray, conv_state: np.ndarray, x: np.ndarray, cu: np.ndarray,
                slots: np.ndarray) -> None:
    """Fill a verify pass's conv records: ``rec[s, :Kc-1]`` = slot s's conv state before the
    pass (zeros for ``NO_SLOT``), then sequence s's pre-conv rows ``x[cu[s]:cu[s+1]]``."""
    kc1 = conv_state.shape[1]
    cu = np.asarray(cu, dtype=np.int64)
    for s, slot in enumerate(np.asarray(slots, dtype=np.int64)):
        rec[s, :kc1] = 0 if slot == NO_SLOT else conv_state[slot]
        rec[s, kc1:kc1 + cu[s + 1] - cu[s]] = x[cu[s]:cu[s + 1]]


def commit_state(ssm: np.ndarray, conv: np.ndarray, rec_ssm: np.ndarray, rec_conv: np.ndarray,
                 slots: np.ndarray, acc: np.ndarray) -> None:
    """Move each slot's recurrent state to its first ``acc[s]`` verified tokens: the ssm state
    (the pool holds it from before the pass) advanced by the first ``acc`` token records
    (``gdn.apply_records``), the conv state to rows ``acc .. acc + Kc - 2`` of the conv records
    (``NO_SLOT`` rows are skipped)."""
    kc1 = conv.shape[1]
    hv, dk, dv = ssm.shape[1:]
    hk = gdn.record_key_heads(rec_ssm.shape[2], hv, dk, dv)
    for s, slot in enumerate(np.asarray(slots, dtype=np.int64)):
        n = int(acc[s])
        if slot == NO_SLOT:
            continue
        ssm[slot] = gdn.apply_records(ssm[slot], rec_ssm[s], n, hk)
        conv[slot] = rec_conv[s, n:n + kc1]

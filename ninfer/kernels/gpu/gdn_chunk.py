"""The chunked gated delta rule on the GPU (``gdn_chunk.cu``): prefill's delta rule in chunks
of 64 tokens, the work inside every chunk done at once and only the state carried chunk by
chunk (the sequential ``gdn.gated_delta_rule`` takes a step per token). Same semantics as the
NumPy ``ninfer.kernels.gdn.chunk_gated_delta_rule`` applied to each sequence of a ragged batch
(chunks start at each sequence's first token), float32 throughout.

Two kernels: ``gdn_chunk_prep`` (every chunk at once: W, U, P) and ``gdn_chunk_scan`` (the
state carried chunk by chunk, each chunk's outputs made from the state it started from and
its V' on the way); the scan's products on the tensor cores in 3xTF32 (float32's accuracy).
Workspace per call, for every (chunk, value head): W^T, U, P^T and gamma, (dk + dv + 65) * 64
floats; about 60 KiB a token on the 27B shape (48 value heads of 128 x 128).
"""
from __future__ import annotations

import cupy as cp
import numpy as np

from ninfer.kernels.gpu import function
from ninfer.kernels.gpu.gdn import rows_args

BT = 64     # tokens a chunk (gdn_chunk.cu GDN_BT; the reference's CHUNK_SIZE)
_CB = 64    # state columns a scan block (GDN_CB)
_LT = BT + 4
_DK = (16, 32, 64, 128)


def applies(dk: int, hv: int, hk: int) -> bool:
    """Whether the chunked kernels take these head shapes (dk up to 128)."""
    return dk <= _DK[-1] and hk > 0 and hv % hk == 0


def chunk_table(cu: np.ndarray) -> tuple[cp.ndarray, cp.ndarray]:
    """Device (int32 [start (nch) | length (nch)], int32 (S + 1) first chunk of each sequence)
    for the host offsets ``cu`` (S + 1,)."""
    starts, lens, first = [], [], [0]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        for c in range(a, b, BT):
            starts.append(c)
            lens.append(min(BT, b - c))
        first.append(len(starts))
    return (cp.asarray(np.asarray(starts + lens, dtype=np.int32)),
            cp.asarray(np.asarray(first, dtype=np.int32)))


def _smem_prep(dkt: int) -> int:
    return 4 * (2 * dkt * _LT + BT * _LT + 3 * BT)


def _smem_scan(dkt: int) -> int:
    # the state and V' (rows of _CB + 8), W^T and P^T (rows of BT + 8), k (rows of dkt + 8),
    # q (rows of dkt + 4), e^(gamma_C - gamma) and scale e^gamma
    return 4 * ((dkt + BT) * (_CB + 8) + (dkt + BT) * (BT + 8) + BT * (2 * dkt + 12) + 2 * BT)


def _kernel(name: str, dkt: int, smem: int):
    fname = f"{name}<{dkt}>"
    fn = function("gdn_chunk", fname, (fname,))
    if smem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem
    return fn


def gated_delta_rule(q, k, v, g, beta, state: cp.ndarray, chunks: cp.ndarray,
                     seq_c0: cp.ndarray, slots: cp.ndarray, scale: float) -> cp.ndarray:
    """The ragged gated delta rule in chunks: q, k (T, Hk, dk), v (T, Hv, dv), g, beta (T, Hv);
    ``state`` (N, Hv, dk, dv) float32 pool updated in place at ``slots`` (S,) int32 device
    (< 0: zero state, none written); ``chunks``, ``seq_c0``: the batch's ``chunk_table``.
    Returns a new (T, Hv, dv) array. Callers check ``applies`` and the shapes."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    out = cp.empty((t, hv, dv), dtype=cp.float32)
    if not t:
        return out
    nch, s = chunks.shape[0] // 2, seq_c0.shape[0] - 1
    dkt = next(d for d in _DK if d >= dk)
    rows = rows_args(q, k, v, g, beta)   # [q, ldq, k, ldk, v, ldv, g, ldg, beta, ldb]
    wt = cp.empty((nch, hv, dkt, BT), dtype=cp.float32)
    u = cp.empty((nch, hv, BT, dv), dtype=cp.float32)
    pt = cp.empty((nch, hv, BT, BT), dtype=cp.float32)
    gam = cp.empty((nch, hv, BT), dtype=cp.float32)
    dims = (np.int32(hk), np.int32(hv), np.int32(dk), np.int32(dv))
    smem = _smem_prep(dkt)
    _kernel("gdn_chunk_prep", dkt, smem)((nch, hv), (256,), (
        *rows, chunks, np.int32(nch), wt, u, pt, gam, *dims, np.float32(scale)),
        shared_mem=smem)
    smem = _smem_scan(dkt)
    _kernel("gdn_chunk_scan", dkt, smem)((-(-dv // _CB), hv, s), (256,), (
        *rows[:4], wt, u, pt, gam, chunks, np.int32(nch), seq_c0, state, slots, out, *dims,
        np.float32(scale)), shared_mem=smem)
    return out

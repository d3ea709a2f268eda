"""Gated DeltaNet ops and the gated-attention output gate on the GPU (``gdn.cu``).

Each function has the semantics of the NumPy reference of the same name in ``ninfer.kernels.gdn``
(``sigmoid_mul``: ``ninfer.kernels.activation``). Arrays are float32 CuPy arrays whose inner axes
are contiguous (token rows may be strided; anything else is copied first); index arrays
(``cu_seqlens``, ``slots``, the per-token sequence map) are int32 device arrays prepared by
``cupy_ops``. The delta rule runs each sequence's tokens sequentially (one block per (sequence,
value head), one state column per thread, in registers; at the 27B's head dims a verify pass's
few tokens a chunk at a time, ``gdn_verify``); the chunked and recurrent modes of the reference
therefore give the same GPU result.
"""
from __future__ import annotations

import cupy as cp
import numpy as np

from ninfer.kernels.gdn import record_width
from ninfer.kernels.gpu import function, sm_count
from ninfer.kernels.gpu.elementwise import _as_rows, _row_stride
from ninfer.kernels.gpu.launch import clusters_available, launch

_GDR_DK = (32, 64, 128, 256)
GDR_MAX_DV = 256


def _fn(fname: str):
    return function("gdn", fname)


def _grid(n: int, threads: int = 256) -> int:
    return max(1, min(-(-n // threads), 65535))


def _rows3(x: cp.ndarray) -> tuple[cp.ndarray, int]:
    """(x with contiguous inner axes, its element stride between leading-axis rows)."""
    x = _as_rows(x)
    return x, _row_stride(x, int(np.prod(x.shape[1:])))


def rows_args(*arrays: cp.ndarray) -> list:
    """The kernels' (array, int32 row stride) argument pairs of head-shaped ``arrays``, in
    order (``_rows3``: inner axes made contiguous where they are not)."""
    out = []
    for a in arrays:
        a, ld = _rows3(a)
        out += [a, np.int32(ld)]
    return out


def causal_conv1d(x: cp.ndarray, w: cp.ndarray, conv_state: cp.ndarray, cu: cp.ndarray,
                  slots: cp.ndarray, tok_seq: cp.ndarray, num_seqs: int,
                  activation: str | None) -> cp.ndarray:
    """Ragged causal depthwise conv over (T, C) ``x`` with (C, Kc) ``w``; ``conv_state``
    (N, Kc - 1, C) is updated in place at ``slots``. Returns a new (T, C) array."""
    t, c = x.shape
    kc = w.shape[1]
    x, ldx = _rows3(x)
    w = cp.ascontiguousarray(w, dtype=cp.float32)
    out = cp.empty((t, c), dtype=cp.float32)
    if not t:
        return out
    act = np.int32(0 if activation is None else 1)
    _fn("conv1d_fwd")((_grid(t * c),), (256,), (
        x, np.int32(ldx), w, conv_state, cu, slots, tok_seq, out, np.int32(t), np.int32(c),
        np.int32(kc), act))
    if kc > 1:
        _fn("conv1d_state")((_grid(num_seqs * c),), (256,), (
            x, np.int32(ldx), conv_state, cu, slots, np.int32(num_seqs), np.int32(c),
            np.int32(kc)))
    return out


def _row_norm(x: cp.ndarray, z, w, eps: float, mode: int) -> cp.ndarray:
    shape = x.shape
    d = shape[-1]
    x3 = x.reshape(1, -1, d) if x.ndim == 1 else (x[:, None, :] if x.ndim == 2 else x)
    if x3.ndim > 3:
        x3 = cp.ascontiguousarray(x3).reshape(shape[0], -1, d)
    x3, ldx = _rows3(x3)
    t, r = x3.shape[0], x3.shape[1]
    out = cp.empty((t * r, d), dtype=cp.float32)
    zp, ldz, wp = np.uint64(0), 0, np.uint64(0)
    if mode == 1:
        z3 = z.reshape(x3.shape) if z.ndim != 3 else z
        z3, ldz = _rows3(z3)
        zp, wp = z3, cp.ascontiguousarray(w, dtype=cp.float32)
    rows = t * r
    if rows:
        _fn("row_norm")((-(-rows // 8),), (256,), (
            x3, np.int32(ldx), zp, np.int32(ldz), wp, out, np.int32(rows), np.int32(r),
            np.int32(d), np.float32(eps), np.int32(mode)))
    return out.reshape(shape)


def l2_norm(x: cp.ndarray, eps: float) -> cp.ndarray:
    """x / sqrt(sum(x**2, -1) + eps); new array of ``x.shape``."""
    return _row_norm(x, None, None, eps, 0)


def gated_rms_norm(x: cp.ndarray, z: cp.ndarray, w: cp.ndarray, eps: float) -> cp.ndarray:
    """x / sqrt(mean(x**2, -1) + eps) * w * silu(z); new array of ``x.shape``."""
    if z.shape != x.shape:
        raise ValueError(f"gated_rms_norm: z {z.shape} does not match x {x.shape}")
    return _row_norm(x, z, w, eps, 1)


def gdn_gates(a: cp.ndarray, b: cp.ndarray, A_log: cp.ndarray,
              dt_bias: cp.ndarray) -> tuple[cp.ndarray, cp.ndarray]:
    """(g, beta), new (T, H) arrays: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)."""
    t, h = a.shape
    a, lda = _rows3(a)
    b, ldb = _rows3(b)
    g = cp.empty((t, h), dtype=cp.float32)
    beta = cp.empty((t, h), dtype=cp.float32)
    if t * h:
        _fn("gdn_gates")((_grid(t * h),), (256,), (
            a, np.int32(lda), b, np.int32(ldb), cp.ascontiguousarray(A_log, dtype=cp.float32),
            cp.ascontiguousarray(dt_bias, dtype=cp.float32), g, beta, np.int32(t), np.int32(h)))
    return g, beta


def sigmoid_mul(x: cp.ndarray, gate: cp.ndarray, pdl: bool = True) -> cp.ndarray:
    """x * sigmoid(gate) for x (T, N) and gate (T, N) or (T, H, d) with H d = N, read through
    its strides (a head-strided view needs no copy: one kernel); new contiguous (T, N).
    ``pdl``: see ``gpu.launch``."""
    t, n = x.shape
    x, ldx = _rows3(x)
    fits = (gate.shape == (t, n) if gate.ndim == 2 else
            gate.ndim == 3 and gate.shape[0] == t and gate.shape[1] * gate.shape[2] == n)
    if not fits:
        raise ValueError(f"gate {gate.shape} does not match x {x.shape}")
    g3 = gate.reshape(t, 1, n) if gate.ndim == 2 else gate
    if g3.dtype != cp.float32 or (g3.shape[2] > 1 and g3.strides[2] != 4):
        g3 = cp.ascontiguousarray(g3, dtype=cp.float32)
    # (a size-1 axis's stride is never used, and may be anything)
    ldg = g3.strides[0] // 4 if t > 1 else 0
    ghs = g3.strides[1] // 4 if g3.shape[1] > 1 else 0
    out = cp.empty((t, n), dtype=cp.float32)
    if t * n:
        launch(_fn("sigmoid_mul"), (_grid(t * n),), (256,), (
            x, np.int32(ldx), g3, np.int32(ldg), np.int32(ghs), np.int32(g3.shape[2]), out,
            np.int32(t), np.int32(n)), pdl=pdl)
    return out


def gated_delta_rule(q, k, v, g, beta, state: cp.ndarray, cu: cp.ndarray, slots: cp.ndarray,
                     num_seqs: int, scale: float, records: cp.ndarray | None = None) -> cp.ndarray:
    """Sequential gated delta rule over each sequence (see ``gdn.cu``); ``state`` (N, Hv, dk, dv)
    updated in place at ``slots``, or with ``records`` (S, L, ``gdn.record_width``) left as it
    was while they receive each token's record. Returns a new (T, Hv, dv) array.

    Raises:
        ValueError: dk > 256 or dv > 256 (the register-resident state column).
    """
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if dk > _GDR_DK[-1] or dv > GDR_MAX_DV:
        raise ValueError(f"gated_delta_rule on the GPU supports dk, dv <= 256 (got {dk}, {dv})")
    if hv % hk:
        raise ValueError(f"value heads {hv} are not a multiple of key heads {hk}")
    dkt = next(d for d in _GDR_DK if d >= dk)
    rows = rows_args(q, k, v, g, beta)
    out = cp.empty((t, hv, dv), dtype=cp.float32)
    if not t:
        return out
    if records is not None:
        if not (records.flags.c_contiguous and records.dtype == cp.float32):
            raise ValueError("records must be a C-contiguous float32 array")
        rec, rl = records, records.shape[1]
    else:
        rec, rl = np.uint64(0), 0
    threads = max(32, -(-dv // 32) * 32)
    _fn(f"gdr_{dkt}")((hv, num_seqs), (threads,), (
        *rows, state, cu, slots, out, rec, np.int32(rl), np.int32(hk), np.int32(hv),
        np.int32(dk), np.int32(dv), np.float32(scale)))
    return out


_STEP_DK = 128                 # key head dims ``gdn_step`` takes, up to this (gdn.cu GDN_STEP_DK)
_STEP_RPT = (4, 8, 16, 32, 64)  # state rows a thread, instantiated (gdn.cu gdn_step_r* / _x*)


STEP_MAX_T = 16   # tokens per sequence up to which ``gdn_mixer`` runs ``gdn_step``
_STEP_KC = 8      # conv kernel widths ``gdn_step`` keeps in registers (gdn.cu GDN_KC)


def gdn_step_applies(p: cp.ndarray, conv_state: cp.ndarray, state: cp.ndarray) -> bool:
    """Whether ``gdn_step`` runs these shapes: an even dk <= 128, dv a multiple of 16 up to 256,
    Hv a multiple of Hk, a conv kernel of at most 8 taps, contiguous state pools and ``p``
    rows."""
    _, hv, dk, dv = state.shape
    kd2 = conv_state.shape[2] - hv * dv
    if kd2 <= 0 or kd2 % (2 * dk) or hv % (kd2 // (2 * dk)):
        return False
    return (dk <= _STEP_DK and dk % 2 == 0 and dv % 16 == 0 and dv <= 256
            and conv_state.shape[1] + 1 <= _STEP_KC
            and p.dtype == cp.float32 and p.strides[-1] == 4
            and state.flags.c_contiguous and conv_state.flags.c_contiguous)


def step_split(want: int, dk: int, dv: int, blocks: int = 0) -> int:
    """Blocks a value head for ``gdn_step``: the largest power of two up to ``want`` (at most 8,
    a portable cluster) that splits the dv columns evenly and gives each column's 2 x split
    threads whole rows of dk (and a warp whole columns), and keeps ``blocks`` (value heads x
    sequences, when given) times it within 1.5 blocks a multiprocessor: the split fills the
    multiprocessors at batch 1, and past them only adds barriers (27B shape on an H100, 8 lanes:
    the mixer 24.4 us a layer unsplit, 40.5 us split in 4); 1 without thread block clusters."""
    cs = 1
    if clusters_available():
        while (2 * cs <= min(want, 8) and dv % (2 * cs) == 0 and dk % (4 * cs) == 0
               and 4 * cs <= 32 and 2 * cs * blocks <= 1.5 * sm_count()):
            cs *= 2
    return cs


def gdn_step(p: cp.ndarray, conv_w: cp.ndarray, conv_state: cp.ndarray, A_log: cp.ndarray,
             dt_bias: cp.ndarray, norm_w: cp.ndarray, state: cp.ndarray, cu: cp.ndarray,
             slots: cp.ndarray, num_seqs: int, scale: float, eps: float,
             records: cp.ndarray | None = None, pdl: bool = True,
             col_split: int = 1) -> cp.ndarray:
    """The GDN mixer for ``num_seqs`` sequences of a few tokens each (``gdn.cu`` ``gdn_qk`` then
    ``gdn_step``, each sequence's tokens in turn; at dk = dv = 128 a batch with a sequence of
    several tokens runs ``gdn_verify``, the chunked form): ``p`` (T, C + Hv dv + 2 Hv)
    input-projection rows, ``cu`` (S + 1,) and ``slots`` (S,) int32 device; both state pools
    updated in place, but with ``records`` (S, L, ``gdn.record_width``) the recurrent one is
    left as it was while they receive each token's record (``spec_commit`` applies them).
    Returns a new (T, Hv dv) array. Callers check ``gdn_step_applies`` first. Both kernels start
    early under PDL (``pdl``, see ``gpu.launch``), and ``gdn_step`` lets the next kernel start
    at once (its blocks enter as this kernel's leave: bench/README, "Where a one-row GEMV's
    time goes").
    ``col_split``: blocks a value head, at most (``step_split``; above 1, a thread block
    cluster of them per head: ``KernelConfig.gdn_col_split``; fewer where the heads of
    ``num_seqs`` sequences fill the multiprocessors).

    Raises:
        ValueError: records that are not a C-contiguous float32 (S, L, record width) array.
    """
    t = p.shape[0]
    _, hv, dk, dv = state.shape
    c, kc = conv_w.shape
    hk = (c - hv * dv) // (2 * dk)
    out = cp.empty((t, hv * dv), dtype=cp.float32)
    if not t:
        return out
    if records is not None:
        if not (records.flags.c_contiguous and records.dtype == cp.float32
                and records.ndim == 3 and records.shape[0] == num_seqs
                and records.shape[2] == record_width(hk, hv, dk, dv)):
            raise ValueError(f"records {records.shape} must be a C-contiguous float32 "
                             f"({num_seqs}, L, {record_width(hk, hv, dk, dv)}) array")
        rec, rl = records, records.shape[1]
    else:
        rec, rl = np.uint64(0), 0
    qk = cp.empty((t, hk, 2, dk), dtype=cp.float32)
    ldp = np.int32(_row_stride(p, p.shape[1]))
    cw = cp.ascontiguousarray(conv_w, dtype=cp.float32)
    dims = (np.int32(hk), np.int32(hv), np.int32(dk), np.int32(dv), np.int32(kc))
    launch(_fn("gdn_qk"), (hk, num_seqs), (2 * dk,), (p, ldp, cw, conv_state, cu, slots, qk,
                                                      *dims, np.float32(scale)), pdl=pdl)
    f32 = lambda a: cp.ascontiguousarray(a, dtype=cp.float32)
    cs = step_split(col_split, dk, dv, hv * num_seqs)
    rows = dk // (2 * cs)
    rpt = next(r for r in _STEP_RPT if r >= rows)
    if dk == dv == 128 and cs in (2, 4):   # the head dims and split compiled in
        # sequences of several tokens (a verify pass): the chunked form, 4 tokens a round
        name = f"gdn_{'verify' if t > num_seqs else 'step'}_h128_c{cs}"
    else:   # x: exactly rpt rows a thread, no bounds checks
        name = f"gdn_step_{'x' if rows == rpt <= 32 and dk % (2 * cs) == 0 else 'r'}{rpt}"
    launch(_fn(name), (hv, num_seqs, cs), (2 * dv,), (
        p, ldp, cw, conv_state, qk, f32(A_log), f32(dt_bias), f32(norm_w), state, cu, slots,
        out, rec, np.int32(rl), *dims, np.float32(eps)), pdl=pdl, cluster=cs if cs > 1 else 0)
    return out

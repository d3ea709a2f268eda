"""Gated DeltaNet (GDN) ops, NumPy reference.

The token mixer of the Qwen3.5 / Qwen3-Next "linear_attention" layers (``spec/models.md`` A.4):
a causal depthwise conv1d with carried state, L2-normalised q/k, the gated delta rule over a
per-head ``(dk, dv)`` fp32 state, and a gated RMSNorm on the output.

Sources:

- Yang, Kautz & Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule"
  (ICLR 2025, arXiv:2412.06464): the gated delta rule
  ``S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``, ``o_t = S_t^T q_t``.
- Yang, Wang, Zhang, Shen & Kim, "Parallelizing Linear Transformers with the Delta Rule over
  Sequence Length" (NeurIPS 2024, arXiv:2406.06484): the chunked WY / UT-transform form.
- fla-org/flash-linear-attention: ``fla/ops/gated_delta_rule/{fused_recurrent,chunk,wy_fast}.py``
  and ``fla/ops/common/{chunk_delta_h,chunk_o}.py`` (order of operations, chunk size 64, state
  layout ``(Hv, dk, dv)``, value head ``h`` reading key head ``h // (Hv / Hk)``).
- HF transformers ``torch_recurrent_gated_delta_rule`` / ``torch_chunk_gated_delta_rule`` /
  ``causal_conv1d_update`` (``models/qwen3_5``) for the exact semantics a checkpoint expects.

Layouts (all float32): T tokens, S sequences, C conv channels, Kc conv kernel width,
Hk / Hv key / value heads (``Hv % Hk == 0``), dk / dv key / value head dims.

- conv weight ``w``: ``(C, Kc)``; ``w[:, Kc - 1]`` multiplies the current token
  (cross-correlation, as ``torch.nn.Conv1d``).
- conv state: ``(Kc - 1, C)`` per sequence, time-major: row ``j`` is the pre-conv input of token
  ``t - (Kc - 1) + j`` (the last ``Kc - 1`` inputs; zeros before the sequence start).
  A pool of states is ``(N, Kc - 1, C)``.
- recurrent state: ``(Hv, dk, dv)`` per sequence; a pool is ``(N, Hv, dk, dv)``.

The ragged entry points (``causal_conv1d``, ``gated_delta_rule``) work on the token-major
batch of ``ForwardBatch`` (``cu_seqlens_q``) and update the state of each sequence's pool slot
in place, so a decode step and a prefill chunk continue exactly where the previous pass ended.
A sequence whose slot is ``NO_SLOT`` (-1) starts from zero state and keeps none: the padding
rows of a CUDA-graph decode bucket, as a KV slot of -1 writes no KV.
"""
from __future__ import annotations

import numpy as np

CHUNK_SIZE = 64
_MODES = ("auto", "recurrent", "chunked")
NO_SLOT = -1


# --------------------------------------------------------------------------------------------
# Activations and norms
# --------------------------------------------------------------------------------------------

def _silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        den = np.exp(-x)
    den += np.float32(1.0)
    return (x / den).astype(np.float32, copy=False)


def _activate(y: np.ndarray, activation: str | None) -> np.ndarray:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return _silu(y)
    raise ValueError(f"unsupported conv activation {activation!r} (expected 'silu' or None)")


def l2_norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x / sqrt(sum(x**2, -1) + eps) over the last axis (fla / HF ``l2norm``).

    Args:
        x: (..., d) float32, any strides.
        eps: added to the sum of squares (1e-6 in Qwen3.5, not scaled by d).

    Returns:
        New float32 array of ``x.shape``.
    """
    x = np.asarray(x, dtype=np.float32)
    ss = np.einsum("...d,...d->...", x, x)[..., None]
    ss += np.float32(eps)
    return x / np.sqrt(ss)


def gated_rms_norm(x: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """GDN output norm: ``x / sqrt(mean(x**2, -1) + eps) * w * silu(z)`` (norm before gate).

    HF ``Qwen3_5RMSNormGated`` / fla ``FusedRMSNormGated``; the weight is plain (not 1 + w) and
    shared by every head.

    Args:
        x: (..., dv) float32 (e.g. (T, Hv, dv) delta-rule output).
        z: (..., dv) float32 gate, same shape as ``x``.
        w: (dv,) float32.
        eps: RMSNorm epsilon (``rms_norm_eps``).

    Returns:
        New float32 array of ``x.shape``.
    """
    x = np.asarray(x, dtype=np.float32)
    ms = np.einsum("...d,...d->...", x, x)[..., None]
    ms *= np.float32(1.0 / x.shape[-1])
    ms += np.float32(eps)
    y = x / np.sqrt(ms)
    y *= w
    y *= _silu(np.asarray(z, dtype=np.float32))
    return y


def _softplus(x: np.ndarray) -> np.ndarray:
    """torch ``F.softplus`` (beta 1, threshold 20): x for x > 20, else log1p(exp(x))."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0)))).astype(np.float32)


def gdn_gates(a: np.ndarray, b: np.ndarray, A_log: np.ndarray,
              dt_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-head log-decay and write strength of the gated delta rule (fp32).

    ``g = -exp(A_log) * softplus(a + dt_bias)`` (so ``g <= 0`` and the decay is ``exp(g)``),
    ``beta = sigmoid(b)`` (spec A.4.3; Mamba2-style discretisation as in HF / vLLM).

    Args:
        a: (T, Hv) float32, ``in_proj_a`` output.
        b: (T, Hv) float32, ``in_proj_b`` output.
        A_log: (Hv,) float32.
        dt_bias: (Hv,) float32.

    Returns:
        ``(g, beta)``, each a new (T, Hv) float32 array.
    """
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    g = -np.exp(np.asarray(A_log, dtype=np.float32)) * _softplus(a + dt_bias)
    with np.errstate(over="ignore"):
        beta = np.float32(1.0) / (np.float32(1.0) + np.exp(-b))
    return g.astype(np.float32), beta.astype(np.float32)


# --------------------------------------------------------------------------------------------
# Causal depthwise conv1d with carried state
# --------------------------------------------------------------------------------------------

def conv1d_prefill(x: np.ndarray, w: np.ndarray, state: np.ndarray | None = None,
                   activation: str | None = "silu") -> tuple[np.ndarray, np.ndarray]:
    """Causal depthwise conv over the T tokens of one sequence, continuing from ``state``.

    ``y_t[c] = act(sum_j w[c, j] * u_{t - Kc + 1 + j}[c])`` where ``u`` is ``state`` followed by
    ``x`` (zeros before the sequence start when ``state`` is None). No bias.

    Args:
        x: (T, C) float32 pre-conv inputs (T >= 1).
        w: (C, Kc) float32 depthwise kernel.
        state: (Kc - 1, C) float32 carried inputs, or None for a fresh sequence.
        activation: "silu" (Qwen3.5) or None.

    Returns:
        ``(y (T, C), new_state (Kc - 1, C))``, new float32 arrays; ``new_state`` holds the last
        Kc - 1 inputs (older state rows when T < Kc - 1).

    Raises:
        ValueError: mismatched shapes or an unknown activation.
    """
    x = np.asarray(x, dtype=np.float32)
    c, kc = w.shape
    if x.ndim != 2 or x.shape[1] != c:
        raise ValueError(f"conv1d_prefill: x {x.shape} does not match weight {w.shape}")
    if state is None:
        state = np.zeros((kc - 1, c), dtype=np.float32)
    if state.shape != (kc - 1, c):
        raise ValueError(f"conv1d_prefill: state {state.shape}, expected {(kc - 1, c)}")
    t = x.shape[0]
    u = np.concatenate([state, x], axis=0)  # (Kc - 1 + T, C)
    y = u[0:t] * w[:, 0]
    for j in range(1, kc):
        y += u[j:j + t] * w[:, j]
    return _activate(y, activation), np.array(u[t:], dtype=np.float32)


def conv1d_step(x: np.ndarray, w: np.ndarray, state: np.ndarray,
                activation: str | None = "silu") -> tuple[np.ndarray, np.ndarray]:
    """One decode token for each of S sequences (HF ``causal_conv1d_update``).

    Args:
        x: (S, C) float32, one new input per sequence.
        w: (C, Kc) float32.
        state: (S, Kc - 1, C) float32 carried inputs.
        activation: "silu" or None.

    Returns:
        ``(y (S, C), new_state (S, Kc - 1, C))``: ``new_state`` is the window shifted by one.

    Raises:
        ValueError: mismatched shapes or an unknown activation.
    """
    x = np.asarray(x, dtype=np.float32)
    c, kc = w.shape
    if x.ndim != 2 or x.shape[1] != c or state.shape != (x.shape[0], kc - 1, c):
        raise ValueError(f"conv1d_step: x {x.shape}, state {state.shape}, weight {w.shape}")
    window = np.concatenate([state, x[:, None, :]], axis=1)  # (S, Kc, C)
    y = np.einsum("skc,ck->sc", window, w)
    return _activate(y.astype(np.float32), activation), np.array(window[:, 1:], dtype=np.float32)


def causal_conv1d(x: np.ndarray, w: np.ndarray, conv_state: np.ndarray, cu_seqlens: np.ndarray,
                  slots: np.ndarray, activation: str | None = "silu") -> np.ndarray:
    """Ragged causal conv over a batch; updates each sequence's pool slot in place.

    Sequence ``s`` owns tokens ``cu_seqlens[s]:cu_seqlens[s+1]`` and the state
    ``conv_state[slots[s]]``, which must hold the inputs before its first token (zeros for a
    fresh sequence). Single-token sequences go through one batched ``conv1d_step``.

    Args:
        x: (T, C) float32 (any strides).
        w: (C, Kc) float32.
        conv_state: (N, Kc - 1, C) float32 pool, modified in place.
        cu_seqlens: (S+1,) integer offsets.
        slots: (S,) integer pool slots, distinct (``NO_SLOT``: no state).
        activation: "silu" or None.

    Returns:
        New (T, C) float32 array.

    Raises:
        ValueError: mismatched shapes, repeated slots or an unknown activation.
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    slots = np.asarray(slots, dtype=np.int64)
    _check_ragged(x.shape[0], cu, slots, conv_state.shape[0])
    out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    lens = np.diff(cu)
    ones = np.flatnonzero(lens == 1)
    if ones.size:
        rows = cu[ones]
        y, st = conv1d_step(x[rows], w, _gather(conv_state, slots[ones]), activation)
        out[rows] = y
        _scatter(conv_state, slots[ones], st)
    for s in np.flatnonzero(lens > 1):
        a, b = int(cu[s]), int(cu[s + 1])
        y, st = conv1d_prefill(x[a:b], w, _gather(conv_state, slots[s:s + 1])[0], activation)
        out[a:b] = y
        _scatter(conv_state, slots[s:s + 1], st[None])
    return out


# --------------------------------------------------------------------------------------------
# Gated delta rule
# --------------------------------------------------------------------------------------------

def _expand_heads(x: np.ndarray, hv: int) -> np.ndarray:
    """(..., Hk, d) -> (..., Hv, d): value head h reads key head h // (Hv / Hk)."""
    hk = x.shape[-2]
    if hv % hk:
        raise ValueError(f"value heads {hv} are not a multiple of key heads {hk}")
    return x if hk == hv else np.repeat(x, hv // hk, axis=-2)


def gated_delta_rule_step(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                          beta: np.ndarray, state: np.ndarray,
                          scale: float) -> tuple[np.ndarray, np.ndarray]:
    """One recurrent step for each of S sequences (fla ``fused_recurrent``, HF
    ``torch_recurrent_gated_delta_rule``), in this order per value head:

    ``S' = exp(g) S``; ``u = beta (v - S'^T k)``; ``S = S' + k u^T``; ``o = S^T (scale q)``.

    Args:
        q: (S, Hk, dk) float32 (already L2-normalised when the model asks for it).
        k: (S, Hk, dk) float32.
        v: (S, Hv, dv) float32.
        g: (S, Hv) float32 log-decay (<= 0).
        beta: (S, Hv) float32 write strength.
        state: (S, Hv, dk, dv) float32 (not modified).
        scale: query scale (``dk ** -0.5``).

    Returns:
        ``(o (S, Hv, dv), new_state (S, Hv, dk, dv))``, new float32 arrays.
    """
    o, st, _, _ = _step(q, k, v, g, beta, state, scale)
    return o, st


def _step(q, k, v, g, beta, state, scale) -> tuple:
    """``gated_delta_rule_step``, also returning each head's delta (S, Hv, dv) and decay
    exp(g) (S, Hv): what a record keeps of the token."""
    hv = v.shape[-2]
    qe = _expand_heads(np.asarray(q, dtype=np.float32), hv) * np.float32(scale)
    ke = _expand_heads(np.asarray(k, dtype=np.float32), hv)
    decay = np.exp(g, dtype=np.float32)
    st = state * decay[..., None, None]
    kv_mem = np.einsum("shkv,shk->shv", st, ke)
    delta = ((v - kv_mem) * beta[..., None]).astype(np.float32)
    st += ke[..., :, None] * delta[..., None, :]
    o = np.einsum("shkv,shk->shv", st, qe)
    return o.astype(np.float32), st.astype(np.float32, copy=False), delta, decay


def record_width(hk: int, hv: int, dk: int, dv: int) -> int:
    """Floats of one token's record (``gated_delta_rule`` with ``records``): its deltas
    (Hv, dv), its k (Hk, dk), then its decays exp(g) (Hv)."""
    return hv * dv + hk * dk + hv


def record_key_heads(width: int, hv: int, dk: int, dv: int) -> int:
    """Hk of records ``width`` floats wide (``record_width``'s inverse; 0 where none fits)."""
    hk = (width - hv * dv - hv) // dk
    return hk if hk > 0 and record_width(hk, hv, dk, dv) == width else 0


def apply_records(state: np.ndarray, rec: np.ndarray, n: int, hk: int) -> np.ndarray:
    """A (Hv, dk, dv) state advanced by the first ``n`` of a sequence's records (L, W) as the
    rule advances it a token: ``S = exp(g) S + k delta^T`` (the same float32 operations as
    ``gated_delta_rule_step``, so the result is the recurrent one's). Returns a new array."""
    hv, dk, dv = state.shape
    st = np.array(state, dtype=np.float32)
    for i in range(n):
        delta = rec[i, :hv * dv].reshape(hv, dv)
        k = rec[i, hv * dv:hv * dv + hk * dk].reshape(hk, dk)
        decay = rec[i, hv * dv + hk * dk:hv * dv + hk * dk + hv]
        st = st * decay[:, None, None]
        st += _expand_heads(k, hv)[:, :, None] * delta[:, None, :]
    return st


def recurrent_gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                               beta: np.ndarray, state: np.ndarray | None,
                               scale: float) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule token by token over one sequence (the reference the chunked form
    must equal).

    Args:
        q, k: (T, Hk, dk) float32; v: (T, Hv, dv); g, beta: (T, Hv).
        state: (Hv, dk, dv) float32 initial state, or None for zeros.
        scale: query scale.

    Returns:
        ``(o (T, Hv, dv), final_state (Hv, dk, dv))``.
    """
    t, hv, dv = v.shape
    dk = k.shape[-1]
    st = (np.zeros((1, hv, dk, dv), dtype=np.float32) if state is None
          else np.asarray(state, dtype=np.float32)[None])
    out = np.empty((t, hv, dv), dtype=np.float32)
    for i in range(t):
        o, st = gated_delta_rule_step(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1],
                                      beta[i:i + 1], st, scale)
        out[i] = o[0]
    return out, st[0]


def chunk_gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                           beta: np.ndarray, state: np.ndarray | None, scale: float,
                           chunk_size: int = CHUNK_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule over one sequence in chunks of ``chunk_size`` tokens (WY form).

    Per value head and chunk (local index r, ``gamma_r = sum_{s<=r} g_s``,
    ``Gamma_rs = exp(gamma_r - gamma_s)`` for r >= s else 0), following fla
    ``chunk_gated_delta_rule_fwd`` and HF ``torch_chunk_gated_delta_rule``:

    1. ``A_rs = beta_r (k_r . k_s) Gamma_rs`` for r > s (strictly lower triangular);
    2. solve ``(I + A) [W | U] = [diag(beta exp(gamma)) K | diag(beta) V]`` (UT transform);
    3. with the incoming state S: ``V' = U - W S``;
       ``O = diag(exp(gamma)) Q S + (tril(Q K^T) * Gamma) V'``;
       ``S <- exp(gamma_C) S + (diag(exp(gamma_C - gamma)) K)^T V'``.

    The last chunk may be shorter (equivalent to zero-padding with g = beta = 0). Results equal
    ``recurrent_gated_delta_rule`` up to float32 rounding.

    Args:
        q, k: (T, Hk, dk) float32; v: (T, Hv, dv); g, beta: (T, Hv).
        state: (Hv, dk, dv) float32 initial state, or None for zeros.
        scale: query scale.
        chunk_size: tokens per chunk (64 in fla and HF).

    Returns:
        ``(o (T, Hv, dv), final_state (Hv, dk, dv))``, new float32 arrays.
    """
    t, hv, dv = v.shape
    dk = k.shape[-1]
    # head-major (Hv, T, d)
    qh = np.ascontiguousarray((_expand_heads(np.asarray(q, np.float32), hv)
                               * np.float32(scale)).transpose(1, 0, 2))
    kh = np.ascontiguousarray(_expand_heads(np.asarray(k, np.float32), hv).transpose(1, 0, 2))
    vh = np.ascontiguousarray(np.asarray(v, np.float32).transpose(1, 0, 2))
    gh = np.ascontiguousarray(np.asarray(g, np.float32).T)
    bh = np.ascontiguousarray(np.asarray(beta, np.float32).T)
    st = (np.zeros((hv, dk, dv), dtype=np.float32) if state is None
          else np.array(state, dtype=np.float32))
    out = np.empty((hv, t, dv), dtype=np.float32)
    for a in range(0, t, chunk_size):
        b = min(a + chunk_size, t)
        n = b - a
        kc, vc, qc = kh[:, a:b], vh[:, a:b], qh[:, a:b]
        bc = bh[:, a:b]
        gam = np.cumsum(gh[:, a:b], axis=-1, dtype=np.float32)  # (Hv, n)
        lower = np.tril(np.ones((n, n), dtype=bool))
        diff = gam[:, :, None] - gam[:, None, :]
        decay = np.exp(np.where(lower, diff, -np.inf)).astype(np.float32)  # Gamma, 0 above diag
        eg = np.exp(gam)
        amat = (kc @ kc.transpose(0, 2, 1)) * decay * bc[:, :, None]
        amat[:, np.arange(n), np.arange(n)] = 1.0  # Gamma is 0 above the diagonal: I + A
        rhs = np.concatenate([kc * (bc * eg)[..., None], vc * bc[..., None]], axis=-1)
        wu = np.linalg.solve(amat, rhs).astype(np.float32)
        w, u = wu[..., :dk], wu[..., dk:]
        vnew = u - w @ st
        out[:, a:b] = (qc * eg[..., None]) @ st + ((qc @ kc.transpose(0, 2, 1)) * decay) @ vnew
        glast = gam[:, -1]
        kdec = kc * np.exp(glast[:, None] - gam)[..., None]
        st = st * np.exp(glast)[:, None, None] + kdec.transpose(0, 2, 1) @ vnew
    return np.ascontiguousarray(out.transpose(1, 0, 2)), st.astype(np.float32, copy=False)


def gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                     beta: np.ndarray, state: np.ndarray, cu_seqlens: np.ndarray,
                     slots: np.ndarray, scale: float, mode: str = "auto",
                     chunk_size: int = CHUNK_SIZE,
                     records: np.ndarray | None = None) -> np.ndarray:
    """Ragged gated delta rule over a batch; updates each sequence's pool slot in place.

    Sequence ``s`` owns tokens ``cu_seqlens[s]:cu_seqlens[s+1]`` and state
    ``state[slots[s]]`` (its state after all earlier tokens; zeros for a fresh sequence).

    Args:
        q, k: (T, Hk, dk) float32; v: (T, Hv, dv); g, beta: (T, Hv) (any strides).
        state: (N, Hv, dk, dv) float32 pool, modified in place.
        cu_seqlens: (S+1,) integer offsets.
        slots: (S,) integer pool slots, distinct (``NO_SLOT``: no state).
        scale: query scale.
        mode: "auto" (single tokens batched through ``gated_delta_rule_step``, longer sequences
            chunked, as HF switches on ``seq_len == 1``), "recurrent" (all token by token) or
            "chunked" (all through the chunked form).
        chunk_size: chunk length for the chunked form.
        records: optional (S, L, ``record_width``) float32 array (L >= the longest sequence);
            when given every sequence runs token by token, ``records[s, i]`` receives what its
            i-th token did to its state (deltas, k, decays) and the pool keeps the states from
            before the pass: ``apply_records`` (``spec.commit_state``) then advances each slot
            by the tokens it keeps (speculative verification).

    Returns:
        New (T, Hv, dv) float32 array.

    Raises:
        ValueError: mismatched shapes, repeated slots, an unknown mode or too small records.
    """
    if records is not None:
        return _gated_delta_rule_recorded(q, k, v, g, beta, state, cu_seqlens, slots, scale,
                                          records)
    if mode not in _MODES:
        raise ValueError(f"unknown gated delta rule mode {mode!r} (expected one of {_MODES})")
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    slots = np.asarray(slots, dtype=np.int64)
    _check_ragged(v.shape[0], cu, slots, state.shape[0])
    out = np.empty(v.shape, dtype=np.float32)
    lens = np.diff(cu)
    rest = np.arange(lens.shape[0])
    if mode == "auto":
        ones = np.flatnonzero(lens == 1)
        if ones.size:
            r = cu[ones]
            o, st = gated_delta_rule_step(q[r], k[r], v[r], g[r], beta[r],
                                          _gather(state, slots[ones]), scale)
            out[r] = o
            _scatter(state, slots[ones], st)
        rest = np.flatnonzero(lens > 1)
    fn = recurrent_gated_delta_rule if mode == "recurrent" else chunk_gated_delta_rule
    for s in rest:
        a, b = int(cu[s]), int(cu[s + 1])
        kw = {} if mode == "recurrent" else {"chunk_size": chunk_size}
        o, st = fn(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b],
                   _gather(state, slots[s:s + 1])[0], scale, **kw)
        out[a:b] = o
        _scatter(state, slots[s:s + 1], st[None])
    return out


def _gated_delta_rule_recorded(q, k, v, g, beta, state, cu_seqlens, slots, scale,
                               records) -> np.ndarray:
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    slots = np.asarray(slots, dtype=np.int64)
    _check_ragged(v.shape[0], cu, slots, state.shape[0])
    lens = np.diff(cu)
    hv, dk, dv = state.shape[1:]
    width = record_width(k.shape[1], hv, dk, dv)
    if (records.shape[0] != lens.shape[0] or records.shape[1] < int(lens.max())
            or records.shape[2:] != (width,)):
        raise ValueError(f"records {records.shape} do not fit {lens.shape[0]} sequences of up "
                         f"to {int(lens.max())} tokens of {width}-float records")
    out = np.empty(v.shape, dtype=np.float32)
    for s in range(lens.shape[0]):
        st = _gather(state, slots[s:s + 1])
        for i in range(int(cu[s]), int(cu[s + 1])):
            o, st, delta, decay = _step(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1],
                                        beta[i:i + 1], st, scale)
            out[i] = o[0]
            records[s, i - int(cu[s])] = np.concatenate(
                [delta[0].ravel(), np.asarray(k[i], np.float32).ravel(), decay[0]])
    return out


def _check_ragged(t: int, cu: np.ndarray, slots: np.ndarray, pool: int) -> None:
    if (cu.ndim != 1 or cu.shape[0] != slots.shape[0] + 1 or int(cu[0]) != 0
            or int(cu[-1]) != t or (np.diff(cu) <= 0).any()):
        raise ValueError(f"cu_seqlens {cu.tolist()} does not split {t} tokens among "
                         f"{slots.shape[0]} sequences")
    live = slots[slots != NO_SLOT]
    if np.unique(live).shape[0] != live.shape[0] or (live < 0).any() or (live >= pool).any():
        raise ValueError(f"state slots {slots.tolist()} must be distinct and in [0, {pool}) "
                         f"(or {NO_SLOT}: no state)")


def _gather(pool: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Copies of the pool rows at ``slots``; zeros for ``NO_SLOT``."""
    out = pool[np.maximum(slots, 0)]
    out[slots == NO_SLOT] = 0
    return out


def _scatter(pool: np.ndarray, slots: np.ndarray, values: np.ndarray) -> None:
    """``pool[slots] = values``, skipping ``NO_SLOT`` rows (their state is dropped)."""
    keep = slots != NO_SLOT
    pool[slots[keep]] = values[keep]


def gdn_mixer(ops, p, conv_w, A_log, dt_bias, norm_w, conv_state, ssm_state, cu_seqlens_q,
              state_slots, scale: float, eps: float, mode: str = "auto", records=None):
    """The Gated DeltaNet token mixer after its input projection, composed from ``ops``' GDN
    ops: causal conv + SiLU, L2-normalised q / k, gates, the gated delta rule and the gated
    RMSNorm (``spec/models.md`` A.4). Dimensions come from the arrays: ``ssm_state`` (N, Hv, dk,
    dv), ``conv_w`` (C, Kc) with C = 2 Hk dk + Hv dv.

    Args:
        p: (T, C + Hv dv + 2 Hv) rows ``[q k v | z | b | a]`` (any row stride).
        conv_w, A_log, dt_bias, norm_w: the layer's conv kernel, gate parameters and gated
            norm weight (dv,).
        conv_state, ssm_state: the state pools, updated in place at ``state_slots``.
        cu_seqlens_q, state_slots: the ragged batch (as ``causal_conv1d``).
        scale: query scale (dk ** -0.5); eps: the gated norm's epsilon.
        mode, records: as ``gated_delta_rule``.

    Returns:
        (T, Hv dv) mixer output, before the output projection.
    """
    t = p.shape[0]
    _, hv, dk, dv = ssm_state.shape
    cd, vd = conv_w.shape[0], hv * dv
    kd = (cd - vd) // 2
    hk = kd // dk
    y = ops.causal_conv1d(p[:, :cd], conv_w, conv_state, cu_seqlens_q, state_slots)
    q = ops.l2_norm(y[:, :kd].reshape(t, hk, dk))
    k = ops.l2_norm(y[:, kd:2 * kd].reshape(t, hk, dk))
    v = y[:, 2 * kd:].reshape(t, hv, dv)
    g, beta = ops.gdn_gates(p[:, cd + vd + hv:], p[:, cd + vd:cd + vd + hv], A_log, dt_bias)
    o = ops.gated_delta_rule(q, k, v, g, beta, ssm_state, cu_seqlens_q, state_slots, scale,
                             mode=mode, records=records)
    o = ops.gated_rms_norm(o, p[:, cd:cd + vd].reshape(t, hv, dv), norm_w, eps)
    return o.reshape(t, vd)

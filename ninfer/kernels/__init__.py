"""Op interface: the heavy math a model runs, behind one backend object.

A model calls only these methods (plus slicing, reshape and ``+`` on the arrays they return),
so the same model code runs on the NumPy reference backend and on a CuPy backend that
implements the same methods with the same shapes, dtypes and semantics. Backend arrays are
float32 unless stated. Index arrays (token ids, positions, ``cu_seqlens_q``, ``context_lens``,
``block_tables``, ``slot_mapping``) are passed as host NumPy integer arrays; a device backend
uploads them. T = tokens, S = sequences, H = hidden, K / N = in / out features, nh / nkv =
query / KV heads, hd = head dim.

Arrays and weights:
- ``zeros(shape, dtype=float32)`` -> zero-filled backend array (KV cache pages).
- ``to_numpy(x)`` -> host ``np.ndarray`` copy/view of a backend array.
- ``argmax(x (S, V))`` (device backends only) -> host (S,) int64 row argmax (first on ties),
  computed where ``x`` lives, so greedy sampling reads back only the ids.
- ``prepare_weight(t: QuantTensor)`` -> the backend's compute form of a stored weight (NumPy:
  float32 C-contiguous array of ``t.shape``, dequantized once). Norm vectors go through it too.
- ``prepare_fused([t0, t1, ...])`` -> one weight whose rows are the (N_i, K) weights
  concatenated along N; ``linear`` output columns split at the cumulative N_i.

Ops (all return new arrays unless stated):
- ``embedding(w (V, H), ids (T,)) -> (T, H)``.
- ``rms_norm(x (T, H), w (H,), eps, unit_offset=False) -> (T, H)``: x / sqrt(mean x^2 + eps) * w
  (``* (1 + w)`` with ``unit_offset``).
- ``rope(x (T, n, hd), positions (T,), theta, style="half"|"adjacent", rotary_dim=None,
  scaling=None) -> (T, n, hd)``: rotary embedding; ``rotary_dim`` < hd rotates only the first
  dims; ``scaling`` an HF ``rope_scaling`` dict (None / "default" / "llama3").
- ``linear(x (T, K), w (N, K)) -> (T, N)``: x @ w.T.
- ``fused_linear(x, w (N, K), *, norm=None, eps=0.0, gated=False, residual=None,
  swiglu=False, feeds=None)``: ``y = linear(a, w)`` with ``a = rms_norm(x, norm, eps)`` when ``norm``
  (x (T, K)), ``a = silu_mul(x[:, :K], x[:, K:])`` when ``gated`` (x (T, 2K)), else ``a = x``;
  with ``residual`` (T, N) the result is added into it in place and ``residual`` is returned;
  with ``swiglu`` (N even; not with ``residual`` / ``gated``: ValueError) it returns
  ``silu_mul(y[:, :N/2], y[:, N/2:])`` (T, N/2). The GPU backend runs it as one kernel for
  decode-sized T (the NumPy backend composes the ops). ``feeds=(w2, norm2)`` is a hint: the
  result is the input of the very next op call, ``fused_linear(result, w2, norm=norm2, ...)``
  (norm2 None: no RMSNorm); the GPU backend then also writes the result pre-quantized for that
  GEMV (``gpu.linear.Q8_SHADOW``). Results do not depend on it beyond rounding.
- ``fuses_swiglu(w, t) -> bool``: whether ``fused_linear(x, w, swiglu=True)`` of T rows is one
  kernel (so a model should ask for it instead of ``gated`` in the next ``fused_linear``);
  False on the NumPy backend.
- ``silu_mul(gate (T, I), up (T, I)) -> (T, I)``: silu(gate) * up.
- ``write_kv(k_cache, v_cache, k (T, nkv, hd), v (T, nkv, hd), slot_mapping (T,) int64)``:
  in place; caches ``(num_pages, page_size, nkv, hd)``; slot = page * page_size + offset;
  negative slots skipped.
- ``rope_write_kv(qkv (T, (nq + 2 nk) hd), nq, nk, positions, theta, k_cache, v_cache,
  slot_mapping, style="half", rotary_dim=None, scaling=None) -> q (T, nq, hd)``: ``rope`` of
  the q and k heads of a fused q|k|v row, then ``write_kv`` of the rotated k and of v; returns
  the rotated q (one kernel on the GPU).
- ``paged_attention(q (T, nh, hd), k_cache, v_cache, cu_seqlens_q (S+1,), context_lens (S,),
  block_tables (S, P), scale) -> (T, nh, hd)``: causal GQA; each sequence's new tokens are the
  last of its context (see ``attention.paged_attention``).
- ``rope_paged_attention(qkv, nq, nk, positions, theta, k_cache, v_cache, slot_mapping,
  cu_seqlens_q, context_lens, block_tables, scale, style="half", rotary_dim=None, scaling=None,
  feeds=None) -> (T, nq, hd)`` (``feeds`` as for ``fused_linear``): ``rope_write_kv`` then ``paged_attention`` of the rotated q; on the GPU one
  kernel for a decode batch (one new token per sequence, its slot at position
  ``context_lens - 1``) where ``cupy_ops.FUSED_DECODE_ATTENTION`` says so; where the o
  projection takes ``gemv_bulk`` by default two kernels instead (RoPE, the KV write and the
  attention, then ``attn_merge``): there the one kernel measured slower.

Gated attention and Gated DeltaNet (Qwen3.5 / Qwen3-Next; semantics and sources in
``ninfer.kernels.gdn``; Hk / Hv = key / value heads, dk / dv their dims, C = conv channels,
Kc = conv width, N = state slots):
- ``sigmoid_mul(x (T, N), gate (T, N)) -> (T, N)``: x * sigmoid(gate).
- ``l2_norm(x (..., d), eps=1e-6) -> (..., d)``: x / sqrt(sum x^2 + eps).
- ``gated_rms_norm(x (..., dv), z (..., dv), w (dv,), eps) -> (..., dv)``:
  x / sqrt(mean x^2 + eps) * w * silu(z).
- ``gdn_gates(a (T, Hv), b (T, Hv), A_log (Hv,), dt_bias (Hv,)) -> (g, beta)``, each (T, Hv):
  g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b).
- ``causal_conv1d(x (T, C), w (C, Kc), conv_state (N, Kc-1, C), cu_seqlens_q (S+1,),
  state_slots (S,), activation="silu") -> (T, C)``: causal depthwise conv continuing each
  sequence's carried inputs; ``conv_state[state_slots[s]]`` updated in place.
- ``gated_delta_rule(q (T, Hk, dk), k (T, Hk, dk), v (T, Hv, dv), g (T, Hv), beta (T, Hv),
  state (N, Hv, dk, dv), cu_seqlens_q, state_slots, scale, mode="auto", chunk_size=64,
  records=None) -> (T, Hv, dv)``: per sequence, recurrent for single tokens and chunked (WY
  form, C = 64) otherwise; ``state[state_slots[s]]`` updated in place; with ``records``
  (S, L, Hv, dk, dv) also the state after every token (speculative verification).
"""
from __future__ import annotations

BACKENDS = ("numpy", "cupy")


def cupy_usable() -> bool:
    """Whether CuPy is installed and sees a CUDA device (never raises)."""
    try:
        from ninfer.kernels.cupy_ops import cuda_available
    except Exception:  # CuPy missing or broken: no GPU backend here
        return False
    return cuda_available()


def resolve_backend(backend: str) -> str:
    """``"auto"`` -> ``"cupy"`` when a CUDA device is usable through CuPy, else ``"numpy"``;
    other names are returned unchanged."""
    if backend == "auto":
        return "cupy" if cupy_usable() else "numpy"
    return backend


def get_ops(backend: str = "numpy"):
    """The ops object of a backend.

    Args:
        backend: ``"numpy"`` (CPU reference), ``"cupy"`` (NVIDIA GPU) or ``"auto"`` (cupy when
            a GPU is usable, else numpy).

    Raises:
        ValueError: unknown backend, or the CuPy backend is not available here.
    """
    backend = resolve_backend(backend)
    if backend == "numpy":
        from ninfer.kernels.numpy_ops import NumpyOps
        return NumpyOps()
    if backend == "cupy":
        try:
            from ninfer.kernels.cupy_ops import CupyOps  # type: ignore[import-not-found]
        except ImportError as e:
            raise ValueError(f"the cupy backend is not available: {e}") from e
        try:
            return CupyOps()
        except RuntimeError as e:
            raise ValueError(f"the cupy backend is not available: {e}") from e
    raise ValueError(f"unknown kernel backend {backend!r} (expected one of {BACKENDS} or auto)")

"""``Ops``: the op interface a model's forward pass runs on, as a typed protocol.

A model calls only these methods (plus slicing, reshape and ``+`` on the arrays they return),
so the same model code runs on the NumPy reference backend (``numpy_ops.NumpyOps``) and on the
CuPy backend (``cupy_ops.CupyOps``), which implement them with the same shapes, dtypes and
semantics. Backend arrays (``Array``) are float32 unless stated. Index arrays (token ids,
positions, ``cu_seqlens_q``, ``context_lens``, ``block_tables``, ``slot_mapping``) are host
NumPy integer arrays; a device backend uploads them. T = tokens, S = sequences, H = hidden,
K / N = in / out features, nh / nkv = query / KV heads, hd = head dim. Ops return new arrays
unless stated. How a backend runs an op (which kernels, which fusions) is its own business: a
model describes its forward pass, the backend plans (``prepare_model``).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ninfer.store.quant import QuantTensor

Array = Any   # np.ndarray on the CPU, cupy.ndarray on the GPU


@runtime_checkable
class Ops(Protocol):
    """The ops of a backend (see the module docstring)."""

    name: str
    kv_dtypes: tuple[str, ...]   # the KV storage modes (``engine.kv_dtypes``) its ops take

    # arrays and weights
    def zeros(self, shape: tuple[int, ...], dtype=np.float32) -> Array:
        """A zero-filled backend array (KV cache pages, state)."""

    def to_numpy(self, x) -> np.ndarray:
        """A host ``np.ndarray`` copy (or view) of a backend array."""

    def prepare_model(self, model) -> None:
        """Called once by a model after its weights are prepared: the backend may plan how to
        run the model's forward pass (the CuPy backend: which kernel hands its output on to
        which GEMV in a decode step). Results never depend on it beyond rounding."""

    def prepare_weight(self, t: QuantTensor) -> Array:
        """The backend's compute form of a stored weight (NumPy: float32 C-contiguous array of
        ``t.shape``, dequantized once). Norm vectors go through it too."""

    def prepare_fused(self, ts: Sequence[QuantTensor]) -> Array:
        """One weight whose rows are the (N_i, K) weights ``ts`` concatenated along N;
        ``linear`` output columns split at the cumulative N_i."""

    # ops
    def embedding(self, w: Array, ids: np.ndarray) -> Array:
        """(T, H) rows ``ids`` (T,) of ``w`` (V, H)."""

    def rms_norm(self, x: Array, w: Array, eps: float, unit_offset: bool = False) -> Array:
        """x (T, H) / sqrt(mean x^2 + eps) * w (H,) (``* (1 + w)`` with ``unit_offset``)."""

    def rope(self, x: Array, positions: np.ndarray, theta: float, style: str = "half",
             rotary_dim: int | None = None, scaling: Mapping | None = None) -> Array:
        """Rotary embedding of x (T, n, hd) at ``positions`` (T,); ``style`` "half" or
        "adjacent"; ``rotary_dim`` < hd rotates only the first dims; ``scaling`` an HF
        ``rope_scaling`` dict (None / "default" / "llama3")."""

    def linear(self, x: Array, w: Array) -> Array:
        """x (T, K) @ w (N, K).T -> (T, N)."""

    def fused_linear(self, x: Array, w: Array, *, norm: Array | None = None, eps: float = 0.0,
                     gated: bool = False, residual: Array | None = None,
                     swiglu: bool = False) -> Array:
        """``y = linear(a, w)`` with ``a = rms_norm(x, norm, eps)`` when ``norm`` (x (T, K)),
        ``a = silu_mul(x[:, :K], x[:, K:])`` when ``gated`` (x (T, 2K)), else ``a = x``; with
        ``residual`` (T, N) the result is added into it in place and ``residual`` is returned;
        with ``swiglu`` (N even; not with ``residual`` / ``gated``: ValueError) it returns
        ``silu_mul(y[:, :N/2], y[:, N/2:])`` (T, N/2)."""

    def swiglu_mlp(self, x: Array, norm: Array, gate_up: Array, down: Array,
                   eps: float) -> Array:
        """The SwiGLU MLP block with its residual: ``x += down(silu(g) * u)`` where ``g | u =
        gate_up(rms_norm(x, norm, eps))`` (gate_up (2 I, H), down (H, I)); ``x`` (T, H) is
        updated in place and returned. The backend chooses where the SiLU runs."""

    def silu_mul(self, gate: Array, up: Array) -> Array:
        """silu(gate) * up, both (T, I)."""

    def write_kv(self, k_cache: Array, v_cache: Array, k: Array, v: Array,
                 slot_mapping: np.ndarray, kv_dtype: str = "fp32") -> None:
        """k, v (T, nkv, hd) written in place into caches ``(num_pages, page_size, nkv, hd)``
        at ``slot_mapping`` (T,) int64 (slot = page * page_size + offset; negative: skipped);
        under a ``kv_dtype`` other than fp32 the caches hold uint8 rows (``(..., nkv, K / V
        row bytes)``) and each head is encoded by ``kv_codec.codec(kv_dtype)``
        (``attention.write_kv``). ValueError: a ``kv_dtype`` not in ``self.kv_dtypes``."""

    def rope_write_kv(self, qkv: Array, nq: int, nk: int, positions: np.ndarray, theta: float,
                      k_cache: Array, v_cache: Array, slot_mapping: np.ndarray,
                      style: str = "half", rotary_dim: int | None = None,
                      scaling: Mapping | None = None, kv_dtype: str = "fp32") -> Array:
        """``rope`` of the q and k heads of fused rows qkv (T, (nq + 2 nk) hd), then
        ``write_kv`` of the rotated k and of v; returns the rotated q (T, nq, hd)."""

    def norm_rope_write_kv(self, qkv: Array, nq: int, nk: int, gated_q: bool, q_norm: Array,
                           k_norm: Array, eps: float, positions: np.ndarray, theta: float,
                           k_cache: Array, v_cache: Array, slot_mapping: np.ndarray,
                           style: str = "half", rotary_dim: int | None = None,
                           kv_dtype: str = "fp32") -> Array:
        """``rms_norm`` of each q and k head of fused rows qkv (T, nq (2 if ``gated_q``, a q
        head then its gate, else 1) hd + 2 nk hd), ``rope``, then ``write_kv`` of k and v;
        returns q (T, nq, hd) (``attention.norm_rope_write_kv``)."""

    def gated_paged_attention(self, qkv: Array, nq: int, nk: int, q_norm: Array, k_norm: Array,
                              eps: float, positions: np.ndarray, theta: float, k_cache: Array,
                              v_cache: Array, slot_mapping: np.ndarray,
                              cu_seqlens_q: np.ndarray, context_lens: np.ndarray,
                              block_tables: np.ndarray, scale: float, style: str = "half",
                              rotary_dim: int | None = None, kv_dtype: str = "fp32") -> Array:
        """Gated attention (Qwen3.5) of fused rows qkv (T, 2 nq hd + 2 nk hd; each q head then
        its output gate): ``norm_rope_write_kv``, ``paged_attention`` of q, the output times
        sigmoid of its gate -> (T, nq hd) (``attention.gated_paged_attention``)."""

    def rope_paged_attention(self, qkv: Array, nq: int, nk: int, positions: np.ndarray,
                             theta: float, k_cache: Array, v_cache: Array,
                             slot_mapping: np.ndarray, cu_seqlens_q: np.ndarray,
                             context_lens: np.ndarray, block_tables: np.ndarray, scale: float,
                             style: str = "half", rotary_dim: int | None = None,
                             scaling: Mapping | None = None, kv_dtype: str = "fp32") -> Array:
        """``rope_write_kv`` then ``paged_attention`` of the rotated q -> (T, nq, hd)."""

    def paged_attention(self, q: Array, k_cache: Array, v_cache: Array,
                        cu_seqlens_q: np.ndarray, context_lens: np.ndarray,
                        block_tables: np.ndarray, scale: float,
                        kv_dtype: str = "fp32") -> Array:
        """Causal GQA of q (T, nh, hd) over the paged caches (stored as ``kv_dtype``, as
        ``write_kv``); sequence s's new tokens are rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``,
        the last of its ``context_lens[s]`` positions, whose pages are ``block_tables[s]``
        (see ``attention.paged_attention``)."""

    # gated attention and Gated DeltaNet (Qwen3.5 / Qwen3-Next; semantics in ninfer.kernels.gdn;
    # Hk / Hv = key / value heads, dk / dv their dims, C = conv channels, Kc = conv width,
    # N = state slots)
    def sigmoid_mul(self, x: Array, gate: Array) -> Array:
        """x * sigmoid(gate): x (T, N), gate (T, N) or (T, H, d) with H d = N (a head-strided
        view, e.g. the gate halves of a fused projection's per-head [query | gate] rows)."""

    def l2_norm(self, x: Array, eps: float = 1e-6) -> Array:
        """x (..., d) / sqrt(sum x^2 + eps)."""

    def gated_rms_norm(self, x: Array, z: Array, w: Array, eps: float) -> Array:
        """x (..., dv) / sqrt(mean x^2 + eps) * w (dv,) * silu(z)."""

    def gdn_gates(self, a: Array, b: Array, A_log: Array,
                  dt_bias: Array) -> tuple[Array, Array]:
        """(g, beta), each (T, Hv): g = -exp(A_log) * softplus(a + dt_bias), beta =
        sigmoid(b)."""

    def gdn_mixer(self, p: Array, conv_w: Array, A_log: Array, dt_bias: Array, norm_w: Array,
                  conv_state: Array, ssm_state: Array, cu_seqlens_q: np.ndarray,
                  state_slots: np.ndarray, scale: float, eps: float, mode: str = "auto",
                  records: Array | None = None) -> Array:
        """The Gated DeltaNet mixer after its input projection ``p`` (T, C + Hv dv + 2 Hv) ->
        (T, Hv dv): conv, L2 norms, gates, delta rule, gated RMSNorm (``kernels.gdn.gdn_mixer``);
        both state pools updated in place (with ``records``, the recurrent one is left as it
        was: ``gated_delta_rule``). The backend chooses the fusion."""

    def causal_conv1d(self, x: Array, w: Array, conv_state: Array, cu_seqlens_q: np.ndarray,
                      state_slots: np.ndarray, activation: str | None = "silu") -> Array:
        """Causal depthwise conv of x (T, C) with w (C, Kc) continuing each sequence's carried
        inputs; ``conv_state[state_slots[s]]`` ((N, Kc-1, C)) updated in place."""

    def gated_delta_rule(self, q: Array, k: Array, v: Array, g: Array, beta: Array,
                         state: Array, cu_seqlens_q: np.ndarray, state_slots: np.ndarray,
                         scale: float, mode: str = "auto", chunk_size: int = 64,
                         records: Array | None = None) -> Array:
        """Per sequence, the gated delta rule over q, k (T, Hk, dk), v (T, Hv, dv), g, beta
        (T, Hv) -> (T, Hv, dv); ``state[state_slots[s]]`` ((N, Hv, dk, dv)) updated in place,
        or with ``records`` (S, L, ``gdn.record_width``) left as it was while each token's
        record (deltas, k, decays) is written; ``gdn_commit`` then applies a kept prefix."""

    # a speculative round's glue (``ninfer.kernels.spec``): index outputs go into ``out*``
    # arrays, which a device backend resolves to a CUDA graph's static buffers
    def argmax_into(self, logits: Array, out: np.ndarray) -> None:
        """``out[r]`` = the first index of row r's largest value (int32)."""

    def spec_accept(self, ids: np.ndarray, targets: np.ndarray, k: int,
                    out: np.ndarray) -> None:
        """``out[b]`` = 1 + lane b's leading drafts equal to their targets."""

    def spec_rows(self, x: Array, acc: np.ndarray, k: int) -> Array:
        """(B, H): row ``b (k + 1) + acc[b] - 1`` of x for every lane."""

    def spec_chain(self, positions: np.ndarray, slot_mapping: np.ndarray, acc: np.ndarray,
                   j: int, block_tables: np.ndarray, page_size: int, out_pos: np.ndarray,
                   out_slots: np.ndarray, out_lens: np.ndarray) -> None:
        """Positions, KV slots and context lengths of the MTP head's chained pass j."""

    def gdn_record_conv(self, rec: Array, conv_state: Array, x: Array,
                        cu_seqlens_q: np.ndarray, state_slots: np.ndarray) -> None:
        """A verify pass's conv records: each slot's conv state, then its pre-conv rows."""

    def gdn_commit(self, ssm: Sequence[Array], conv: Sequence[Array], rec_ssm: Sequence[Array],
                   rec_conv: Sequence[Array], state_slots: np.ndarray, acc: np.ndarray) -> None:
        """Each slot's recurrent state moved to its first ``acc`` verified tokens, in every
        layer (``ssm[l]``, ``conv[l]``: layer l's pools, of one shape for all layers; ``rec_*``:
        its records; ``spec.commit_state``)."""


@runtime_checkable
class DeviceOps(Ops, Protocol):
    """A device backend's extras (CuPy), which the engine uses where present."""

    def argmax(self, x: Array) -> np.ndarray:
        """Host (S,) int64 row argmax of x (S, V) (first on ties), computed on the device."""

    def decode_runner(self, model, max_pages: int, max_batch: int, cuda_graph: bool = True):
        """``model`` wrapped to run decode batches from CUDA graphs, or None."""

    def synchronize(self) -> None:
        """Wait for all queued device work."""

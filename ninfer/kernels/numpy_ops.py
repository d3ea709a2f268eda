"""The NumPy backend: every op family's reference implementation behind one object."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ninfer.engine.kv_dtypes import KV_DTYPES
from ninfer.kernels import activation, attention, embedding, gdn, linear, norm, rope, spec
from ninfer.store.quant import QuantTensor


class NumpyOps:
    """CPU ops over NumPy float32 arrays (the reference backend of ``ninfer.kernels.ops.Ops``)."""

    name = "numpy"
    kv_dtypes = KV_DTYPES   # every KV storage mode (the reference codecs)

    def __init__(self) -> None:
        self._rope_cache = rope.RopeCache()

    # arrays
    def zeros(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        """A zero-filled backend array (KV caches, scratch)."""
        return np.zeros(shape, dtype=dtype)

    def to_numpy(self, x) -> np.ndarray:
        """A backend array as a host NumPy array (here: the array itself)."""
        return np.asarray(x)

    # weights
    def prepare_model(self, model) -> None:
        """Nothing to plan: every op runs on its own here."""

    def prepare_weight(self, t: QuantTensor) -> np.ndarray:
        return linear.prepare_weight(t)

    def prepare_fused(self, ts: Sequence[QuantTensor]) -> np.ndarray:
        return linear.prepare_fused(ts)

    # ops
    def embedding(self, w: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return embedding.embedding(w, ids)

    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float,
                 unit_offset: bool = False) -> np.ndarray:
        return norm.rms_norm(x, w, eps, unit_offset)

    def rope(self, x: np.ndarray, positions: np.ndarray, theta: float, style: str = "half",
             rotary_dim: int | None = None, scaling: Mapping | None = None) -> np.ndarray:
        return rope.rope(x, positions, theta, style, rotary_dim, scaling,
                         cache=self._rope_cache)

    def linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return linear.linear(x, w)

    def fused_linear(self, x: np.ndarray, w: np.ndarray, *, norm: np.ndarray | None = None,
                     eps: float = 0.0, gated: bool = False, residual: np.ndarray | None = None,
                     swiglu: bool = False) -> np.ndarray:
        return linear.fused_linear(self, self.linear, x, w, norm=norm, eps=eps, gated=gated,
                                   residual=residual, swiglu=swiglu)

    def swiglu_mlp(self, x: np.ndarray, norm: np.ndarray, gate_up: np.ndarray,
                   down: np.ndarray, eps: float) -> np.ndarray:
        gu = self.fused_linear(x, gate_up, norm=norm, eps=eps)   # (T, 2 I)
        return self.fused_linear(gu, down, gated=True, residual=x)

    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        return activation.silu_mul(gate, up)

    def write_kv(self, k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
                 slot_mapping: np.ndarray, kv_dtype: str = "fp32") -> None:
        attention.write_kv(k_cache, v_cache, k, v, slot_mapping, kv_dtype)

    def rope_write_kv(self, qkv: np.ndarray, nq: int, nk: int, positions: np.ndarray,
                      theta: float, k_cache: np.ndarray, v_cache: np.ndarray,
                      slot_mapping: np.ndarray, style: str = "half",
                      rotary_dim: int | None = None,
                      scaling: Mapping | None = None, kv_dtype: str = "fp32") -> np.ndarray:
        t, hd = qkv.shape[0], qkv.shape[1] // (nq + 2 * nk)
        qk = self.rope(qkv[:, :(nq + nk) * hd].reshape(t, nq + nk, hd), positions, theta,
                       style, rotary_dim, scaling)
        v = qkv[:, (nq + nk) * hd:(nq + 2 * nk) * hd].reshape(t, nk, hd)
        self.write_kv(k_cache, v_cache, qk[:, nq:], v, slot_mapping, kv_dtype)
        return qk[:, :nq]

    def norm_rope_write_kv(self, qkv, nq: int, nk: int, gated_q: bool, q_norm, k_norm,
                           eps: float, positions, theta: float, k_cache, v_cache, slot_mapping,
                           style: str = "half", rotary_dim: int | None = None,
                           kv_dtype: str = "fp32") -> np.ndarray:
        return attention.norm_rope_write_kv(self, qkv, nq, nk, gated_q, q_norm, k_norm, eps,
                                            positions, theta, k_cache, v_cache, slot_mapping,
                                            style, rotary_dim, kv_dtype)

    def gated_paged_attention(self, qkv: np.ndarray, nq: int, nk: int, q_norm, k_norm,
                              eps: float, positions, theta: float, k_cache, v_cache,
                              slot_mapping, cu_seqlens_q, context_lens, block_tables,
                              scale: float, style: str = "half", rotary_dim: int | None = None,
                              kv_dtype: str = "fp32") -> np.ndarray:
        return attention.gated_paged_attention(self, qkv, nq, nk, q_norm, k_norm, eps,
                                               positions, theta, k_cache, v_cache, slot_mapping,
                                               cu_seqlens_q, context_lens, block_tables, scale,
                                               style, rotary_dim, kv_dtype)

    def rope_paged_attention(self, qkv: np.ndarray, nq: int, nk: int, positions: np.ndarray,
                             theta: float, k_cache: np.ndarray, v_cache: np.ndarray,
                             slot_mapping: np.ndarray, cu_seqlens_q: np.ndarray,
                             context_lens: np.ndarray, block_tables: np.ndarray, scale: float,
                             style: str = "half", rotary_dim: int | None = None,
                             scaling: Mapping | None = None,
                             kv_dtype: str = "fp32") -> np.ndarray:
        q = self.rope_write_kv(qkv, nq, nk, positions, theta, k_cache, v_cache, slot_mapping,
                               style, rotary_dim, scaling, kv_dtype)
        return self.paged_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens,
                                    block_tables, scale, kv_dtype)

    def paged_attention(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                        cu_seqlens_q: np.ndarray, context_lens: np.ndarray,
                        block_tables: np.ndarray, scale: float,
                        kv_dtype: str = "fp32") -> np.ndarray:
        return attention.paged_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens,
                                         block_tables, scale, kv_dtype)

    # gated attention and Gated DeltaNet (Qwen3.5 / Qwen3-Next; see ninfer.kernels.gdn)
    def sigmoid_mul(self, x: np.ndarray, gate: np.ndarray) -> np.ndarray:
        return activation.sigmoid_mul(x, gate)

    def l2_norm(self, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
        return gdn.l2_norm(x, eps)

    def gated_rms_norm(self, x: np.ndarray, z: np.ndarray, w: np.ndarray,
                       eps: float) -> np.ndarray:
        return gdn.gated_rms_norm(x, z, w, eps)

    def gdn_gates(self, a: np.ndarray, b: np.ndarray, A_log: np.ndarray,
                  dt_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return gdn.gdn_gates(a, b, A_log, dt_bias)

    def gdn_mixer(self, p, conv_w, A_log, dt_bias, norm_w, conv_state, ssm_state,
                  cu_seqlens_q: np.ndarray, state_slots: np.ndarray, scale: float, eps: float,
                  mode: str = "auto", records=None) -> np.ndarray:
        return gdn.gdn_mixer(self, p, conv_w, A_log, dt_bias, norm_w, conv_state, ssm_state,
                             cu_seqlens_q, state_slots, scale, eps, mode, records)

    def causal_conv1d(self, x: np.ndarray, w: np.ndarray, conv_state: np.ndarray,
                      cu_seqlens_q: np.ndarray, state_slots: np.ndarray,
                      activation: str | None = "silu") -> np.ndarray:
        return gdn.causal_conv1d(x, w, conv_state, cu_seqlens_q, state_slots, activation)

    def gated_delta_rule(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                         beta: np.ndarray, state: np.ndarray, cu_seqlens_q: np.ndarray,
                         state_slots: np.ndarray, scale: float, mode: str = "auto",
                         chunk_size: int = gdn.CHUNK_SIZE,
                         records: np.ndarray | None = None) -> np.ndarray:
        return gdn.gated_delta_rule(q, k, v, g, beta, state, cu_seqlens_q, state_slots, scale,
                                    mode, chunk_size, records)

    # the speculative round's glue (``ninfer.kernels.spec``); outputs are written into ``out*``
    def argmax_into(self, logits: np.ndarray, out: np.ndarray) -> None:
        spec.argmax_into(logits, out)

    def spec_accept(self, ids: np.ndarray, targets: np.ndarray, k: int,
                    out: np.ndarray) -> None:
        spec.accept_counts(ids, targets, k, out)

    def spec_rows(self, x: np.ndarray, acc: np.ndarray, k: int) -> np.ndarray:
        return spec.accepted_rows(x, acc, k)

    def spec_chain(self, positions: np.ndarray, slot_mapping: np.ndarray, acc: np.ndarray,
                   j: int, block_tables: np.ndarray, page_size: int, out_pos: np.ndarray,
                   out_slots: np.ndarray, out_lens: np.ndarray) -> None:
        spec.chain_inputs(positions, slot_mapping, acc, j, block_tables, page_size, out_pos,
                          out_slots, out_lens)

    def gdn_record_conv(self, rec: np.ndarray, conv_state: np.ndarray, x: np.ndarray,
                        cu_seqlens_q: np.ndarray, state_slots: np.ndarray) -> None:
        spec.record_conv(rec, conv_state, x, cu_seqlens_q, state_slots)

    def gdn_commit(self, ssm, conv, rec_ssm, rec_conv, state_slots: np.ndarray,
                   acc: np.ndarray) -> None:
        for layer in zip(ssm, conv, rec_ssm, rec_conv):
            spec.commit_state(*layer, state_slots, acc)

"""Qwen3.5 / Qwen3.6 (and dense Qwen3-Next) hybrid decoder over an ops backend.

Three of every four layers are Gated DeltaNet (GDN) token mixers, every fourth is gated full
attention (``spec/models.md`` A.4-A.6; HF ``Qwen3_5ForCausalLM``):

- block: ``h = x + Mixer(norm_in(x))``; ``out = h + down(silu(gate(n)) * up(n))`` with
  ``n = norm_post(h)``; every RMSNorm here is zero-centred (scale ``1 + w``).
- GDN mixer: ``[qkv | z | b | a] = x W^T``; causal depthwise conv (Kc = 4, carried state) +
  SiLU on ``qkv``; L2-normalised q/k (query scaled by ``dk ** -0.5``); ``g = -exp(A_log)
  softplus(a + dt_bias)``, ``beta = sigmoid(b)``; gated delta rule over a per-head
  ``(dk, dv)`` fp32 state (recurrent for single tokens, chunked C = 64 for prefill); gated
  RMSNorm ``norm(o) * w * silu(z)`` (plain weight); ``out_proj``.
- attention mixer: ``q_proj`` gives per head ``[query (hd) | gate (hd)]``; q/k RMSNorm
  (``1 + w``) per head before partial rotate-half RoPE (``rotary_dim = hd *
  partial_rotary_factor``); causal GQA over the paged KV; output ``* sigmoid(gate)``; ``o_proj``.
- final zero-centred norm; ``lm_head`` (or the embedding table when tied).

State: attention layers keep paged KV (``KVCache``, one layer per attention layer); GDN layers
keep per-lane state slots (conv inputs ``(Kc - 1, conv_dim)`` and the recurrent state
``(Hv, dk, dv)``) in a ``Qwen35Cache``. A slot integrates every token it has seen and cannot
be rewound, so a pass must continue a slot exactly at its frontier (``forward`` checks it).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ninfer.engine import kv_dtypes
from ninfer.engine.models.llama import ForwardBatch
from ninfer.engine.models.qwen35_cache import Qwen35Cache
from ninfer.engine.models.qwen35_config import Qwen35Config
from ninfer.engine.models.qwen35_spec import Qwen35Spec, SpecRecords
from ninfer.store.quant import QuantTensor, dequantize

ARCHITECTURE = "qwen35"


def _prepare_plain(ops, t: QuantTensor):
    """A small non-linear-layer matrix (the conv kernel) as a plain float32 backend array:
    prepared as a 1-D vector (never a GEMM-packed weight) and reshaped."""
    flat = QuantTensor("f32", (int(np.prod(t.shape)),),
                       data=np.ascontiguousarray(dequantize(t), dtype=np.float32).reshape(-1))
    return ops.prepare_weight(flat).reshape(tuple(t.shape))


def _prepare_centred(ops, t: QuantTensor):
    """A zero-centred RMSNorm weight prepared as its scale ``1 + w``, so every norm of the model
    is a plain one (and folds into the GEMV after it: ``ops.fused_linear(norm=...)``)."""
    scale = 1.0 + np.asarray(dequantize(t), dtype=np.float32)
    return ops.prepare_weight(QuantTensor("f32", tuple(t.shape), data=scale))


def split_k(t: QuantTensor, k0: int) -> tuple[QuantTensor, QuantTensor]:
    """Split an ``(N, K)`` stored matrix into columns ``[:k0]`` and ``[k0:]`` without
    requantizing (quantized schemes need ``k0`` on a group boundary).

    Raises:
        ValueError: ``k0`` not on a group boundary of a quantized tensor.
    """
    n, k = t.shape
    if t.scheme in ("f32", "f16", "bf16"):
        d = np.asarray(t.data)
        return (QuantTensor(t.scheme, (n, k0), data=np.ascontiguousarray(d[:, :k0])),
                QuantTensor(t.scheme, (n, k - k0), data=np.ascontiguousarray(d[:, k0:])))
    if k0 % t.group or (t.scheme == "q4" and k0 % 2):
        raise ValueError(f"cannot split a {t.scheme} tensor with group {t.group} at K={k0}")
    per_code = 2 if t.scheme == "q4" else 1
    g0 = k0 // t.group
    out = []
    for sl_c, sl_g, kk in ((slice(None, k0 // per_code), slice(None, g0), k0),
                           (slice(k0 // per_code, None), slice(g0, None), k - k0)):
        parts = {"codes": np.ascontiguousarray(np.asarray(t.codes)[:, sl_c]),
                 "scales": np.ascontiguousarray(np.asarray(t.scales)[:, sl_g])}
        if t.mins is not None:
            parts["mins"] = np.ascontiguousarray(np.asarray(t.mins)[:, sl_g])
        out.append(QuantTensor(t.scheme, (n, kk), group=t.group, **parts))
    return out[0], out[1]


@dataclass(slots=True)
class _GdnLayer:
    in_proj: object  # (conv_dim + value_dim + 2 Hv, H): in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
    conv: object  # (conv_dim, Kc)
    A_log: object  # (Hv,)
    dt_bias: object  # (Hv,)
    norm: object  # (dv,) plain weight
    out: object  # (H, value_dim)


@dataclass(slots=True)
class _AttnLayer:
    qkv: object  # (2 nh hd + 2 nkv hd, H): q_proj (query|gate per head), k_proj, v_proj
    q_norm: object  # (hd,)
    k_norm: object  # (hd,)
    o: object  # (H, nh hd)


@dataclass(slots=True)
class _Block:
    kind: str  # "linear_attention" | "full_attention"
    index: int  # index into Qwen35Cache.conv/ssm (GDN) or kv layers (attention)
    input_norm: object
    mixer: _GdnLayer | _AttnLayer
    post_norm: object
    gate_up: object  # (2 I, H)
    down: object  # (H, I)


@dataclass(slots=True)
class _Mtp:
    """The multi-token-prediction head (spec A.8): ``fc([norm_e(embed(t)), norm_h(h)])``, one
    full-attention decoder block, a final norm; the embedding and lm_head are shared."""

    norm_e: object  # (H,) mtp.pre_fc_norm_embedding (zero-centred)
    norm_h: object  # (H,) mtp.pre_fc_norm_hidden (zero-centred)
    fc_e: object  # (H, H) embedding half of mtp.fc
    fc_h: object  # (H, H) hidden half of mtp.fc
    block: _Block
    norm: object  # (H,) mtp.norm


class Qwen35Model(Qwen35Spec):
    """A Qwen3.5 hybrid decoder with weights prepared for one ops backend.

    Attributes:
        config: the architecture.
        ops: the backend every op runs on.
        embed: (V, H); lm_head: (V, H), the same array when tied.
        blocks: per-layer prepared weights (GDN projections fused, q/k/v fused, gate/up fused).
        norm: (H,) final norm weight (zero-centred).
        mtp: the MTP head's prepared weights, or None (no ``mtp.*`` tensors, or
            ``load_mtp=False``).
        gdn_mode: "auto" | "recurrent" | "chunked", passed to ``ops.gated_delta_rule``.
    """

    __slots__ = ("config", "ops", "embed", "blocks", "norm", "lm_head", "gdn_mode", "mtp")
    is_recurrent = True   # GDN state per lane: reuse only at exact frontiers and checkpoints

    def __init__(self, config: Qwen35Config, weights: Mapping[str, QuantTensor], ops,
                 gdn_mode: str = "auto", load_mtp: bool = True) -> None:
        """Prepare every weight through ``ops``.

        Args:
            config: the architecture.
            weights: stored tensors with ``hf_import`` names (``model.layers.{i}...``,
                ``lm_head.weight`` absent when tied; ``mtp.*`` for the MTP head).
            ops: a backend from ``ninfer.kernels.get_ops``.
            gdn_mode: how GDN layers run the delta rule (tests use "recurrent" / "chunked").
            load_mtp: prepare the MTP head when its weights are present.

        Raises:
            ValueError: a tensor missing or of the wrong shape.
        """
        c = config
        hsz, inter, hd = c.hidden_size, c.intermediate_size, c.head_dim
        nh, nkv = c.num_attention_heads, c.num_key_value_heads
        hv, dv = c.linear_num_value_heads, c.linear_value_head_dim

        def get(name: str, shape: tuple[int, ...]) -> QuantTensor:
            t = weights.get(name)
            if t is None:
                raise ValueError(f"qwen35 weights lack {name!r}")
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {shape}")
            return t

        self.config, self.ops, self.gdn_mode = c, ops, gdn_mode
        self.embed = ops.prepare_weight(get("model.embed_tokens.weight", (c.vocab_size, hsz)))
        self.blocks: list[_Block] = []
        n_gdn = n_attn = 0
        for i, kind in enumerate(c.layer_types):
            p = f"model.layers.{i}."
            if kind == "linear_attention":
                a = p + "linear_attn."
                mixer = _GdnLayer(
                    in_proj=ops.prepare_fused([get(a + "in_proj_qkv.weight", (c.conv_dim, hsz)),
                                               get(a + "in_proj_z.weight", (c.value_dim, hsz)),
                                               get(a + "in_proj_b.weight", (hv, hsz)),
                                               get(a + "in_proj_a.weight", (hv, hsz))]),
                    conv=_prepare_plain(ops, get(a + "conv1d.weight",
                                                 (c.conv_dim, c.linear_conv_kernel_dim))),
                    A_log=ops.prepare_weight(get(a + "A_log", (hv,))),
                    dt_bias=ops.prepare_weight(get(a + "dt_bias", (hv,))),
                    norm=ops.prepare_weight(get(a + "norm.weight", (dv,))),
                    out=ops.prepare_weight(get(a + "out_proj.weight", (hsz, c.value_dim))))
                index, n_gdn = n_gdn, n_gdn + 1
            else:
                a = p + "self_attn."
                mixer = _AttnLayer(
                    qkv=ops.prepare_fused([get(a + "q_proj.weight", (2 * nh * hd, hsz)),
                                           get(a + "k_proj.weight", (nkv * hd, hsz)),
                                           get(a + "v_proj.weight", (nkv * hd, hsz))]),
                    q_norm=_prepare_centred(ops, get(a + "q_norm.weight", (hd,))),
                    k_norm=_prepare_centred(ops, get(a + "k_norm.weight", (hd,))),
                    o=ops.prepare_weight(get(a + "o_proj.weight", (hsz, nh * hd))))
                index, n_attn = n_attn, n_attn + 1
            self.blocks.append(_Block(
                kind=kind, index=index,
                input_norm=_prepare_centred(ops, get(p + "input_layernorm.weight", (hsz,))),
                mixer=mixer,
                post_norm=_prepare_centred(ops, get(p + "post_attention_layernorm.weight", (hsz,))),
                gate_up=ops.prepare_fused([get(p + "mlp.gate_proj.weight", (inter, hsz)),
                                           get(p + "mlp.up_proj.weight", (inter, hsz))]),
                down=ops.prepare_weight(get(p + "mlp.down_proj.weight", (hsz, inter)))))
        self.norm = _prepare_centred(ops, get("model.norm.weight", (hsz,)))
        if c.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = self.embed
        else:
            self.lm_head = ops.prepare_weight(get("lm_head.weight", (c.vocab_size, hsz)))
        self.mtp = None
        if load_mtp and "mtp.fc.weight" in weights:
            p = "mtp.layers.0."
            a = p + "self_attn."
            fc_e, fc_h = split_k(get("mtp.fc.weight", (hsz, 2 * hsz)), hsz)
            block = _Block(
                kind="full_attention", index=n_attn,
                input_norm=_prepare_centred(ops, get(p + "input_layernorm.weight", (hsz,))),
                mixer=_AttnLayer(
                    qkv=ops.prepare_fused([get(a + "q_proj.weight", (2 * nh * hd, hsz)),
                                           get(a + "k_proj.weight", (nkv * hd, hsz)),
                                           get(a + "v_proj.weight", (nkv * hd, hsz))]),
                    q_norm=_prepare_centred(ops, get(a + "q_norm.weight", (hd,))),
                    k_norm=_prepare_centred(ops, get(a + "k_norm.weight", (hd,))),
                    o=ops.prepare_weight(get(a + "o_proj.weight", (hsz, nh * hd)))),
                post_norm=_prepare_centred(ops, get(p + "post_attention_layernorm.weight", (hsz,))),
                gate_up=ops.prepare_fused([get(p + "mlp.gate_proj.weight", (inter, hsz)),
                                           get(p + "mlp.up_proj.weight", (inter, hsz))]),
                down=ops.prepare_weight(get(p + "mlp.down_proj.weight", (hsz, inter))))
            self.mtp = _Mtp(
                norm_e=_prepare_centred(ops, get("mtp.pre_fc_norm_embedding.weight", (hsz,))),
                norm_h=_prepare_centred(ops, get("mtp.pre_fc_norm_hidden.weight", (hsz,))),
                fc_e=ops.prepare_weight(fc_e), fc_h=ops.prepare_weight(fc_h), block=block,
                norm=_prepare_centred(ops, get("mtp.norm.weight", (hsz,))))
        ops.prepare_model(self)

    @classmethod
    def from_artifact(cls, artifact, ops, gdn_mode: str = "auto") -> Qwen35Model:
        """Model of an opened artifact whose architecture is ``qwen35``.

        Raises:
            ValueError: another architecture, or weights that do not fit the config.
        """
        arch = getattr(artifact, "architecture", None)
        if arch != ARCHITECTURE:
            raise ValueError(f"Qwen35Model cannot run architecture {arch!r}")
        return cls(Qwen35Config.from_dict(artifact.config), artifact.tensors, ops, gdn_mode)

    def new_kv_cache(self, num_pages: int, page_size: int, max_lanes: int = 16,
                     kv_dtype: str = "fp32") -> Qwen35Cache:
        """A zeroed cache: paged KV (stored as ``kv_dtype``) for the attention layers (and the
        MTP head's layer, when loaded) and ``max_lanes`` state slots.

        Raises:
            ValueError: a KV dtype the head dim or this model's backend cannot store.
        """
        kv_dtypes.check_backend(kv_dtype, self.ops)
        return Qwen35Cache(self.config, num_pages, page_size, max_lanes, zeros=self.ops.zeros,
                           mtp_layers=1 if self.mtp is not None else 0, kv_dtype=kv_dtype)

    # ----------------------------------------------------------------------------- forward

    def forward(self, batch: ForwardBatch, kv: Qwen35Cache, all_logits: bool = False,
                return_hidden: bool = False, _records: SpecRecords | None = None):
        """Run one pass over a ragged batch, advancing each sequence's KV and state slot.

        Args:
            batch: the T new tokens of S sequences; ``batch.state_slots`` (S,) gives each
                sequence's state slot in ``kv`` (required when the model has GDN layers).
                Sequence s's first new token must be at position ``kv.lengths[slot]`` (its
                slot's frontier).
            kv: cache from ``new_kv_cache``.
            all_logits: logits for every token instead of each sequence's last.
            return_hidden: also return the final-normed hidden states of all T tokens (the
                MTP head's input, spec A.8).

        Returns:
            (S, V) float32 backend logits, or (T, V) with ``all_logits``; with
            ``return_hidden`` a tuple ``(logits, hidden (T, H))``.

        Raises:
            ValueError: inconsistent batch arrays, missing or repeated state slots, or a
                sequence that does not start at its slot's frontier (nothing is modified).
        """
        slots = self.check_batch(batch, kv)
        out = self.run(batch, kv, slots, all_logits, return_hidden, _records)
        self.advance(batch, kv)
        return out

    def check_batch(self, batch: ForwardBatch, kv: Qwen35Cache) -> np.ndarray | None:
        """Validate ``batch`` against ``kv`` on the host: its arrays, and distinct state slots
        each at the frontier where its sequence starts. Returns the (S,) int64 slots (None for
        a model without GDN layers).

        Raises:
            ValueError: as ``forward``.
        """
        batch.validate()
        slots = batch.state_slots
        if slots is None:
            if self.config.gdn_layers:
                raise ValueError("a Qwen3.5 forward needs ForwardBatch.state_slots")
            return None
        slots = np.asarray(slots, dtype=np.int64)
        if (slots.shape != (batch.num_seqs,) or (slots < 0).any()
                or (slots >= kv.max_lanes).any() or np.unique(slots).size != slots.size):
            raise ValueError(f"state_slots {slots.tolist()} must be {batch.num_seqs} "
                             f"distinct slots in [0, {kv.max_lanes})")
        starts = np.asarray(batch.positions)[np.asarray(batch.cu_seqlens_q[:-1], dtype=np.int64)]
        bad = np.flatnonzero(kv.lengths[slots] != starts)
        if bad.size:
            s = int(bad[0])
            raise ValueError(f"sequence {s} starts at position {int(starts[s])} but state "
                             f"slot {int(slots[s])} is at {int(kv.lengths[slots[s]])} "
                             f"tokens (GDN state cannot be rewound; reset the slot)")
        return slots

    def advance(self, batch: ForwardBatch, kv: Qwen35Cache) -> None:
        """Move the frontier of each state slot of ``batch`` past its new tokens (host
        bookkeeping of a pass that ran; ``forward`` does it itself)."""
        if batch.state_slots is not None:
            slots = np.asarray(batch.state_slots, dtype=np.int64)
            kv.lengths[slots] = np.asarray(batch.context_lens, dtype=np.int64)

    def run(self, batch: ForwardBatch, kv: Qwen35Cache, slots, all_logits: bool = False,
            return_hidden: bool = False, _records: SpecRecords | None = None):
        """The device work of ``forward`` without its host checks and frontier bookkeeping:
        what a CUDA graph of a decode bucket captures (``gpu.graphs``). ``slots`` may hold
        ``NO_SLOT`` (-1) for padding sequences, which keep no state."""
        c, ops = self.config, self.ops
        eps = c.rms_norm_eps
        h = ops.embedding(self.embed, batch.token_ids)  # (T, H)
        for blk in self.blocks:
            if blk.kind == "linear_attention":
                h = self._gdn(blk.mixer, blk.index, h, blk.input_norm, batch, slots, kv,
                              _records)
            else:
                h = self._attention(blk.mixer, blk.index, h, blk.input_norm, batch, kv)
            h = ops.swiglu_mlp(h, blk.post_norm, blk.gate_up, blk.down, eps)
        return self._head(h, self.norm, batch.cu_seqlens_q, all_logits, return_hidden)

    def _head(self, h, norm, cu, all_logits: bool, return_hidden: bool):
        ops, eps = self.ops, self.config.rms_norm_eps
        # (each sequence's last row; a decode batch's rows are those already, and a CUDA
        # graph's capture may not gather with a host index)
        last = all_logits or len(cu) - 1 == h.shape[0]
        if return_hidden:
            hn = ops.rms_norm(h, norm, eps)
            rows = hn if last else hn[np.asarray(cu[1:], dtype=np.int64) - 1]
            return ops.linear(rows, self.lm_head), hn
        if not last:
            h = h[np.asarray(cu[1:], dtype=np.int64) - 1]  # (S, H)
        return ops.fused_linear(h, self.lm_head, norm=norm, eps=eps)

    def _gdn(self, m: _GdnLayer, index: int, h, norm, batch: ForwardBatch, slots: np.ndarray,
             kv: Qwen35Cache, rec: SpecRecords | None = None):
        """``h`` plus the GDN mixer of ``norm(h)``."""
        c, ops = self.config, self.ops
        cd = c.conv_dim
        p = ops.fused_linear(h, m.in_proj, norm=norm, eps=c.rms_norm_eps)   # (T, cd + vd + 2 Hv)
        if rec is not None:   # the conv inputs of the pass, for commit's accepted prefix
            ops.gdn_record_conv(rec.conv[index], kv.conv[index], p[:, :cd], batch.cu_seqlens_q,
                                slots)
        o = ops.gdn_mixer(p, m.conv, m.A_log, m.dt_bias, m.norm, kv.conv[index], kv.ssm[index],
                          batch.cu_seqlens_q, slots, c.linear_key_head_dim ** -0.5,
                          c.rms_norm_eps, mode=self.gdn_mode,
                          records=None if rec is None else rec.ssm[index])
        return ops.fused_linear(o, m.out, residual=h)

    def _attention(self, m: _AttnLayer, index: int, h, norm, batch: ForwardBatch,
                   kv: Qwen35Cache):
        """``h`` plus the gated attention mixer of ``norm(h)``."""
        c, ops = self.config, self.ops
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        p = ops.fused_linear(h, m.qkv, norm=norm, eps=c.rms_norm_eps)  # (T, 2 nh hd + 2 nkv hd)
        a = ops.gated_paged_attention(p, nh, nkv, m.q_norm, m.k_norm, c.rms_norm_eps,
                                      batch.positions, c.rope_theta, kv.kv.k[index],
                                      kv.kv.v[index], batch.slot_mapping, batch.cu_seqlens_q,
                                      batch.context_lens, batch.block_tables, hd ** -0.5, "half",
                                      c.rotary_dim, kv.kv.dtype)   # (T, qd)
        return ops.fused_linear(a, m.o, residual=h)

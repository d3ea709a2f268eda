"""Llama-family decoder (SmolLM2, Llama 2/3, and other dense rotate-half RoPE models) over an
ops backend.

Forward pass (HF ``LlamaForCausalLM``; ``spec/models.md`` B.2): ``x = embed[tok]``; per layer
``h = x + o_proj(attn(rope(q_proj(n1(x))), rope(k_proj(n1(x))), v_proj(n1(x))))`` and
``x = h + down(silu(gate(n2(h))) * up(n2(h)))``; final norm; logits through ``lm_head`` (or the
embedding table when tied). Weights carry HF names and HF's rotate-half q/k layout.

The model only calls the ops interface (``ninfer.kernels``) for math; it builds small host
index arrays and never touches NumPy vs CuPy specifics, so the same code runs on both.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ninfer.engine import kv_dtypes
from ninfer.engine.kv import KVCache
from ninfer.engine.models.config_values import head_dim as config_head_dim, whole
from ninfer.kernels.rope import rope_scaling_type
from ninfer.store.quant import QuantTensor

_REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "intermediate_size", "rms_norm_eps")


@dataclass(slots=True, frozen=True)
class LlamaConfig:
    """Architecture hyper-parameters (HF ``LlamaConfig`` names and meanings)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @classmethod
    def from_dict(cls, cfg: Mapping) -> LlamaConfig:
        """Build from an artifact's ``config`` dict (keys: ``docs/architecture.md``).

        ``num_key_value_heads`` defaults to ``num_attention_heads``, ``head_dim`` to
        ``hidden_size // num_attention_heads``, ``rope_theta`` to 10000 (HF defaults). An HF-5
        style ``rope_parameters`` dict is read when ``rope_theta`` / ``rope_scaling`` are absent.

        Raises:
            ValueError: a required key missing, a shape field that is not a positive whole
                number (``config_values.whole``), inconsistent head counts, or a
                ``rope_scaling`` type other than none / "default" / "llama3".
        """
        missing = [k for k in _REQUIRED_KEYS if cfg.get(k) is None]
        if missing:
            raise ValueError(f"llama config lacks {missing}")
        nh = whole(cfg, "num_attention_heads")
        nkv = whole(cfg, "num_key_value_heads", nh)
        head_dim = config_head_dim(cfg, nh)
        rope_params = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope_params.get("rope_type", "default") != "default":
            scaling = dict(rope_params)
        if rope_scaling_type(scaling) is None:  # raises ValueError on unsupported types
            scaling = None
        if nh % nkv:
            raise ValueError(f"num_attention_heads {nh} is not a multiple of "
                             f"num_key_value_heads {nkv}")
        return cls(
            vocab_size=whole(cfg, "vocab_size"),
            hidden_size=whole(cfg, "hidden_size"),
            num_hidden_layers=whole(cfg, "num_hidden_layers"),
            num_attention_heads=nh,
            num_key_value_heads=nkv,
            head_dim=head_dim,
            intermediate_size=whole(cfg, "intermediate_size"),
            rope_theta=float(theta),
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            max_position_embeddings=whole(cfg, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=dict(scaling) if scaling else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
        )


@dataclass(slots=True)
class ForwardBatch:
    """One forward pass over a ragged batch of sequences (vLLM names).

    Sequence ``s`` contributes tokens ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``, which are the last
    tokens of its ``context_lens[s]`` KV positions (the KV length after this pass).

    Attributes:
        token_ids: (T,) int32.
        positions: (T,) int32 absolute positions.
        cu_seqlens_q: (S+1,) int32, ``[0, q_len_0, q_len_0 + q_len_1, ..., T]``.
        context_lens: (S,) int32.
        block_tables: (S, P) int32 page ids, padded with -1.
        slot_mapping: (T,) int64, ``page * page_size + offset`` of each token's KV slot.
        state_slots: (S,) int32 recurrent-state slot (lane) of each sequence, for models with
            per-lane state (Qwen3.5 GDN layers); None for attention-only models, which ignore it.
    """

    token_ids: np.ndarray
    positions: np.ndarray
    cu_seqlens_q: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    slot_mapping: np.ndarray
    state_slots: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    def validate(self) -> None:
        """Check the arrays agree with each other.

        Raises:
            ValueError: token/position/slot counts or ``cu_seqlens_q`` disagree, or a sequence
                has no tokens.
        """
        t, cu = self.num_tokens, self.cu_seqlens_q
        if (self.positions.shape[0] != t or self.slot_mapping.shape[0] != t
                or cu.shape[0] != self.num_seqs + 1 or int(cu[-1]) != t
                or (np.diff(cu) <= 0).any()):
            raise ValueError("inconsistent ForwardBatch: token/position/slot counts or "
                             "cu_seqlens_q disagree, or a sequence has no tokens")

    @classmethod
    def from_sequences(cls, new_tokens: Sequence[Sequence[int]], num_cached: Sequence[int],
                       block_tables: Sequence[Sequence[int]], page_size: int,
                       state_slots: Sequence[int] | None = None) -> ForwardBatch:
        """Build the arrays for sequences that append ``new_tokens[s]`` after
        ``num_cached[s]`` tokens already in their KV pages ``block_tables[s]``
        (``state_slots[s]``: the sequence's recurrent-state slot, for hybrid models).

        Raises:
            ValueError: lengths disagree, a sequence has no new tokens, or its block table has
                too few pages for its context.
        """
        if not len(new_tokens) == len(num_cached) == len(block_tables):
            raise ValueError("new_tokens, num_cached and block_tables differ in length")
        if state_slots is not None and len(state_slots) != len(new_tokens):
            raise ValueError("state_slots and new_tokens differ in length")
        ids, pos, slots, cu, ctx = [], [], [], [0], []
        for s, (toks, start, table) in enumerate(zip(new_tokens, num_cached, block_tables)):
            n = len(toks)
            end = start + n
            if n == 0:
                raise ValueError(f"sequence {s} has no new tokens")
            if len(table) * page_size < end:
                raise ValueError(f"sequence {s}: {len(table)} pages of {page_size} cannot hold "
                                 f"{end} tokens")
            p = np.arange(start, end)
            table_arr = np.asarray(table, dtype=np.int64)
            ids.extend(toks)
            pos.append(p)
            slots.append(table_arr[p // page_size] * page_size + p % page_size)
            cu.append(cu[-1] + n)
            ctx.append(end)
        width = max(len(t) for t in block_tables)
        bt = np.full((len(block_tables), width), -1, dtype=np.int32)
        for s, table in enumerate(block_tables):
            bt[s, :len(table)] = table
        return cls(token_ids=np.asarray(ids, dtype=np.int32),
                   positions=np.concatenate(pos).astype(np.int32),
                   cu_seqlens_q=np.asarray(cu, dtype=np.int32),
                   context_lens=np.asarray(ctx, dtype=np.int32),
                   block_tables=bt,
                   slot_mapping=np.concatenate(slots).astype(np.int64),
                   state_slots=(None if state_slots is None
                                else np.asarray(state_slots, dtype=np.int32)))


@dataclass(slots=True)
class _Layer:
    """One decoder layer's prepared weights (backend arrays)."""

    input_norm: object  # (H,)
    qkv: object  # ((nh + 2 nkv) hd, H): q_proj, k_proj, v_proj rows
    o: object  # (H, nh hd)
    post_norm: object  # (H,)
    gate_up: object  # (2 I, H): gate_proj, up_proj rows
    down: object  # (H, I)


class LlamaModel:
    """A Llama decoder with weights prepared for one ops backend.

    Attributes:
        config: the architecture.
        ops: the backend every op runs on.
        embed: (V, H) embedding table; lm_head: (V, H), the same array when tied.
        layers: per-layer prepared weights; q/k/v and gate/up fused along N.
        norm: (H,) final norm weight.
    """

    __slots__ = ("config", "ops", "embed", "layers", "norm", "lm_head", "scale")
    is_recurrent = False   # attention only: reuse may cut the KV back to any prefix

    def __init__(self, config: LlamaConfig, weights: Mapping[str, QuantTensor], ops) -> None:
        """Prepare (dequantize / fuse / upload) every weight through ``ops``.

        Args:
            config: the architecture.
            weights: HF-named stored tensors (``model.embed_tokens.weight``, ...);
                ``lm_head.weight`` may be absent when embeddings are tied.
            ops: a backend from ``ninfer.kernels.get_ops``.

        Raises:
            ValueError: a tensor missing or of the wrong shape.
        """
        c = config
        hd, nh, nkv, hsz, inter = (c.head_dim, c.num_attention_heads, c.num_key_value_heads,
                                   c.hidden_size, c.intermediate_size)

        def get(name: str, shape: tuple[int, ...]) -> QuantTensor:
            t = weights.get(name)
            if t is None:
                raise ValueError(f"llama weights lack {name!r}")
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {shape}")
            return t

        self.config, self.ops = c, ops
        self.embed = ops.prepare_weight(get("model.embed_tokens.weight", (c.vocab_size, hsz)))
        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(_Layer(
                input_norm=ops.prepare_weight(get(p + "input_layernorm.weight", (hsz,))),
                qkv=ops.prepare_fused([get(p + "self_attn.q_proj.weight", (nh * hd, hsz)),
                                       get(p + "self_attn.k_proj.weight", (nkv * hd, hsz)),
                                       get(p + "self_attn.v_proj.weight", (nkv * hd, hsz))]),
                o=ops.prepare_weight(get(p + "self_attn.o_proj.weight", (hsz, nh * hd))),
                post_norm=ops.prepare_weight(get(p + "post_attention_layernorm.weight", (hsz,))),
                gate_up=ops.prepare_fused([get(p + "mlp.gate_proj.weight", (inter, hsz)),
                                           get(p + "mlp.up_proj.weight", (inter, hsz))]),
                down=ops.prepare_weight(get(p + "mlp.down_proj.weight", (hsz, inter))),
            ))
        self.norm = ops.prepare_weight(get("model.norm.weight", (hsz,)))
        if c.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = self.embed
        else:
            self.lm_head = ops.prepare_weight(get("lm_head.weight", (c.vocab_size, hsz)))
        self.scale = hd ** -0.5
        ops.prepare_model(self)

    @classmethod
    def from_artifact(cls, artifact, ops) -> LlamaModel:
        """Model of an opened artifact (``ninfer.store.artifact.Artifact``).

        Raises:
            ValueError: the artifact is not a llama-architecture model, or its weights do not
                fit its config.
        """
        arch = getattr(artifact, "architecture", "llama")
        if arch != "llama":
            raise ValueError(f"LlamaModel cannot run architecture {arch!r}")
        return cls(LlamaConfig.from_dict(artifact.config), artifact.tensors, ops)

    def new_kv_cache(self, num_pages: int, page_size: int, kv_dtype: str = "fp32") -> KVCache:
        """A zeroed paged KV cache for this model (one K and V array per layer) storing
        ``kv_dtype`` (``kv_dtypes.KV_DTYPES``).

        Raises:
            ValueError: a KV dtype the head dim or this model's backend cannot store.
        """
        c = self.config
        kv_dtypes.check_backend(kv_dtype, self.ops)
        return KVCache(c.num_hidden_layers, num_pages, page_size, c.num_key_value_heads,
                       c.head_dim, zeros=self.ops.zeros, dtype=kv_dtype)

    def forward(self, batch: ForwardBatch, kv: KVCache, all_logits: bool = False):
        """Run one pass: write this pass's K/V into ``kv`` and return logits.

        Args:
            batch: token ids, positions and paging of the T new tokens of S sequences.
            kv: cache from ``new_kv_cache``; positions before each sequence's new tokens must
                already be written.
            all_logits: return logits for every token instead of each sequence's last.

        Returns:
            (S, V) float32 backend array of each sequence's last-token logits, or (T, V) with
            ``all_logits``.

        Raises:
            ValueError: inconsistent batch arrays.
        """
        c, ops = self.config, self.ops
        t = batch.num_tokens
        batch.validate()
        cu = batch.cu_seqlens_q
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qd = nh * hd
        eps, theta, scaling = c.rms_norm_eps, c.rope_theta, c.rope_scaling
        pos = batch.positions

        h = ops.embedding(self.embed, batch.token_ids)  # (T, H)
        for i, layer in enumerate(self.layers):
            qkv = ops.fused_linear(h, layer.qkv, norm=layer.input_norm, eps=eps)  # q|k|v
            # rotate q and k, store k and v in the pages, attend with q (T, nh, hd)
            a = ops.rope_paged_attention(qkv, nh, nkv, pos, theta, kv.k[i], kv.v[i],
                                         batch.slot_mapping, cu, batch.context_lens,
                                         batch.block_tables, self.scale, "half",
                                         scaling=scaling, kv_dtype=kv.dtype)
            h = ops.fused_linear(a.reshape(t, qd), layer.o, residual=h)  # h += o(a)
            h = ops.swiglu_mlp(h, layer.post_norm, layer.gate_up, layer.down, eps)
        if not all_logits and t != batch.num_seqs:  # T == S: every row is a last token
            # (one sequence: a view, no index upload, which a CUDA graph could not capture)
            h = h[t - 1:] if batch.num_seqs == 1 else h[np.asarray(cu[1:], dtype=np.int64) - 1]
        return ops.fused_linear(h, self.lm_head, norm=self.norm, eps=eps)

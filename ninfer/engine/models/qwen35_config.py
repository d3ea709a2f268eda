"""``Qwen35Config``: the architecture hyper-parameters of a Qwen3.5 / Qwen3.6 hybrid (HF
``Qwen3_5TextConfig`` names), checked as they are read."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ninfer.engine.models.config_values import head_dim, whole

_REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
                  "linear_key_head_dim", "linear_value_head_dim")


@dataclass(slots=True, frozen=True)
class Qwen35Config:
    """Architecture hyper-parameters (HF ``Qwen3_5TextConfig`` names and meanings)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    mtp_num_hidden_layers: int = 0
    eos_token_id: int | list[int] | None = None

    @classmethod
    def from_dict(cls, cfg: Mapping) -> Qwen35Config:
        """Build from an artifact's ``config`` (``hf_import.qwen35_config``) or an HF text
        config dict.

        Raises:
            ValueError: a required key missing, a shape field that is not a positive whole
                number (``config_values.whole``), head counts that do not divide, or
                ``layer_types`` of the wrong length / with unknown kinds.
        """
        missing = [k for k in _REQUIRED_KEYS if cfg.get(k) is None]
        if missing:
            raise ValueError(f"qwen35 config lacks {missing}")
        n = whole(cfg, "num_hidden_layers")
        nh = whole(cfg, "num_attention_heads")
        nkv = whole(cfg, "num_key_value_heads", nh)
        rope = cfg.get("rope_parameters") or {}
        layer_types = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % whole(cfg, "full_attention_interval", 4) == 0
            else "linear_attention" for i in range(n)]
        c = cls(
            vocab_size=whole(cfg, "vocab_size"),
            hidden_size=whole(cfg, "hidden_size"),
            num_hidden_layers=n,
            num_attention_heads=nh,
            num_key_value_heads=nkv,
            head_dim=head_dim(cfg, nh),
            intermediate_size=whole(cfg, "intermediate_size"),
            rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
            rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            partial_rotary_factor=float(cfg.get("partial_rotary_factor")
                                        or rope.get("partial_rotary_factor") or 0.25),
            layer_types=tuple(layer_types),
            linear_conv_kernel_dim=whole(cfg, "linear_conv_kernel_dim", 4),
            linear_key_head_dim=whole(cfg, "linear_key_head_dim"),
            linear_value_head_dim=whole(cfg, "linear_value_head_dim"),
            linear_num_key_heads=whole(cfg, "linear_num_key_heads"),
            linear_num_value_heads=whole(cfg, "linear_num_value_heads"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=whole(cfg, "max_position_embeddings", 32768),
            mtp_num_hidden_layers=whole(cfg, "mtp_num_hidden_layers", 0, least=0),
            eos_token_id=cfg.get("eos_token_id"),
        )
        if len(c.layer_types) != n or set(c.layer_types) - {"full_attention", "linear_attention"}:
            raise ValueError(f"layer_types {list(c.layer_types)} do not fit {n} layers")
        if nh % nkv:
            raise ValueError(f"num_attention_heads {nh} is not a multiple of "
                             f"num_key_value_heads {nkv}")
        if c.linear_num_value_heads % c.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads {c.linear_num_value_heads} is not a "
                             f"multiple of linear_num_key_heads {c.linear_num_key_heads}")
        if c.rotary_dim % 2 or not 0 < c.rotary_dim <= c.head_dim:
            raise ValueError(f"rotary dim {c.rotary_dim} (head_dim {c.head_dim} x "
                             f"{c.partial_rotary_factor}) must be even and in (0, head_dim]")
        return c

    @property
    def rotary_dim(self) -> int:
        """Rotated dims per attention head: ``int(head_dim * partial_rotary_factor)``."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Conv channels: ``2 * key_dim + value_dim`` (q, k, v)."""
        return 2 * self.key_dim + self.value_dim

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

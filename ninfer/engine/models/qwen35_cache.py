"""``Qwen35Cache``: the state a Qwen3.5 hybrid model carries between passes (paged KV of its
attention layers, per-lane conv and recurrent state of its Gated DeltaNet layers)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ninfer.engine.kv import KVCache

if TYPE_CHECKING:
    from ninfer.engine.models.qwen35_config import Qwen35Config


class Qwen35Cache:
    """Paged KV of the attention layers plus per-lane recurrent state of the GDN layers.

    Attributes:
        kv: ``KVCache`` with one K/V pair per attention layer (in layer order, then the MTP
            head's layer when the model has one), pages shared with the engine's ``PagePool``,
            stored as ``kv_dtype``.
        conv: per GDN layer, ``(max_lanes, Kc - 1, conv_dim)`` float32 carried conv inputs.
        ssm: per GDN layer, ``(max_lanes, Hv, dk, dv)`` float32 recurrent state.
        lengths: ``(max_lanes,)`` int64 host array, tokens integrated into each state slot
            (its frontier); ``forward`` checks and advances it.
        max_lanes: number of state slots.

    Owned by the execution thread; ``reset_state`` must be called before a slot starts a new
    sequence (a fresh cache starts with every slot reset).
    """

    __slots__ = ("kv", "conv", "ssm", "lengths", "max_lanes", "_zeros")

    def __init__(self, config: Qwen35Config, num_pages: int, page_size: int, max_lanes: int,
                 zeros: Callable[..., object] | None = None, mtp_layers: int = 0,
                 kv_dtype: str = "fp32") -> None:
        if max_lanes <= 0:
            raise ValueError(f"max_lanes must be > 0, got {max_lanes}")
        zeros = zeros or np.zeros
        c = config
        n_attn = max(len(c.attention_layers) + mtp_layers, 1)
        self.kv = KVCache(n_attn, num_pages, page_size, c.num_key_value_heads, c.head_dim,
                          zeros=zeros, dtype=kv_dtype)
        kc = c.linear_conv_kernel_dim - 1
        hv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        self.conv = [zeros((max_lanes, kc, c.conv_dim), dtype=np.float32) for _ in c.gdn_layers]
        self.ssm = [zeros((max_lanes, hv, dk, dv), dtype=np.float32) for _ in c.gdn_layers]
        self.lengths = np.zeros(max_lanes, dtype=np.int64)
        self.max_lanes = max_lanes
        self._zeros = zeros

    # paging facts, as KVCache has them
    @property
    def num_pages(self) -> int:
        return self.kv.num_pages

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    @property
    def bytes_per_token(self) -> int:
        """Attention K + V bytes one token takes over all attention layers."""
        return self.kv.bytes_per_token

    @property
    def state_bytes_per_lane(self) -> int:
        """Conv + recurrent state bytes of one lane over all GDN layers (constant in length)."""
        per = sum(int(np.prod(a.shape[1:])) for a in self.conv + self.ssm)
        return 4 * per

    @property
    def nbytes(self) -> int:
        """Total bytes: paged KV plus every lane's state."""
        return self.kv.nbytes + self.state_bytes_per_lane * self.max_lanes

    def _check(self, slot: int) -> int:
        slot = int(slot)
        if not 0 <= slot < self.max_lanes:
            raise ValueError(f"state slot {slot} is not in [0, {self.max_lanes})")
        return slot

    def reset_state(self, slot: int) -> None:
        """Zero a lane's conv and recurrent state and set its frontier to 0 tokens.

        Raises:
            ValueError: slot out of range.
        """
        slot = self._check(slot)
        for a in self.conv + self.ssm:
            a[slot] = 0
        self.lengths[slot] = 0

    def copy_state(self, src: int, dst: int) -> None:
        """Copy lane ``src``'s state and frontier to lane ``dst`` (e.g. to fork a sequence at
        its exact frontier; the KV pages are shared or copied by the caller).

        Raises:
            ValueError: slot out of range.
        """
        src, dst = self._check(src), self._check(dst)
        for a in self.conv + self.ssm:
            a[dst] = a[src]
        self.lengths[dst] = self.lengths[src]

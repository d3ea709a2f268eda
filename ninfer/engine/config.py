"""Engine sizing and policy switches (``EngineConfig``), built from ``ServeConfig`` by the
server and the CLI."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .kv_dtypes import KV_DTYPES


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine sizing. ``max_context``: tokens per lane (prompt + output); ``page_size``: tokens
    per KV page; ``prefill_chunk``: max prompt tokens per prefill forward pass;
    ``max_prefill_lanes``: prefilling lanes (the first admitted) that take chunk turns in
    round-robin (1: one prompt's whole prefill before the next one's); ``spec``:
    ``none`` | ``mtp`` (greedy requests drafted by the model's MTP head, ``draft_tokens`` 1..5
    per round; ignored when the model has no MTP head); ``prefix_reuse``: an idle lane keeps
    its last request's computed prefix, and a new request whose prompt starts with it skips
    recomputing it (``cache.lookup``); ``l2_bytes``: host memory for prefixes demoted from
    lanes that lost them (0: no L2 tier); ``min_restore_tokens``: a host or disk image is
    restored only when it saves at least this many tokens (a shared chat-template header is
    cheaper to prefill than to copy in); ``turn_checkpoint``: hybrid models keep one turn
    checkpoint per lane (``Request.checkpoint_at``), reused as ``restore_turn_checkpoint``;
    ``turn_checkpoints``: with it, up to this many past turn checkpoints per lane (the ring,
    ``checkpoints.py``; 0: none), carried by L2 / L3 images too;
    ``decode_lookahead``: ``auto`` | ``on`` | ``off``: a decode round of greedy lanes (no
    penalties, logprobs or drafts) launches the next round before it reads its own tokens, the
    next round's tokens taken on the device (``auto``: where the model replays CUDA graphs
    (``greedy``, ``enabled``) and its head is the tokenizer's width; ``on`` also elsewhere,
    through ``forward`` and the host's choice, for tests; a recurrent lane that finishes keeps
    the position its round ahead fed, ``LanePool.release``);
    ``kv_dtype``: how the KV pages store every attention layer's K and V
    (``kv_dtypes.KV_DTYPES``: ``fp32``, ``fp16`` or a quantized mode);
    ``recompute_horizon_tokens``: lane choice weighs a position p's recompute cost as
    ``1 + p / recompute_horizon_tokens`` tokens (``ReusePolicy.cost``)."""
    max_concurrency: int = 4
    max_context: int = 8192
    prefill_chunk: int = 512
    max_prefill_lanes: int = 2
    page_size: int = 16
    spec: str = "none"
    draft_tokens: int = 3
    prefix_reuse: bool = True
    l2_bytes: int = 0
    min_restore_tokens: int = 64
    turn_checkpoint: bool = True
    turn_checkpoints: int = 0
    decode_lookahead: str = "auto"
    kv_dtype: str = "fp32"
    recompute_horizon_tokens: int = 8192
    # put token ledgers on lane.retained / cache.published (the KV-cache event publisher's input)
    ledger_events: bool = False

    def __post_init__(self):
        if self.decode_lookahead not in ("auto", "on", "off"):
            raise ValueError(f"decode_lookahead must be 'auto', 'on' or 'off', got "
                             f"{self.decode_lookahead!r}")
        if self.spec not in ("none", "mtp"):
            raise ValueError(f"spec must be 'none' or 'mtp', got {self.spec!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got "
                             f"{self.kv_dtype!r}")
        if self.max_prefill_lanes < 1:
            raise ValueError(f"max_prefill_lanes must be >= 1, got {self.max_prefill_lanes}")
        if self.turn_checkpoints < 0:
            raise ValueError(f"turn_checkpoints must be >= 0, got {self.turn_checkpoints}")
        if not 1 <= self.draft_tokens <= 5:
            raise ValueError(f"draft_tokens must be in [1, 5], got {self.draft_tokens}")

    @property
    def pages_per_lane(self) -> int:
        return math.ceil(self.max_context / self.page_size)

    @property
    def num_pages(self) -> int:
        return self.max_concurrency * self.pages_per_lane

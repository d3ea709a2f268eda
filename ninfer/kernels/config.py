"""``KernelConfig``: every tuning choice of the CuPy backend, fixed when the backend is created.

The defaults are the production path (``ninfer/kernels/gpu/README.md``); a test or a benchmark
that wants another kernel builds its own config (``dataclasses.replace(KernelConfig(), ...)``)
and a backend with it (``get_ops("cupy", config)``). This module imports no CuPy, so the server
can build a config from its command line on any machine.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

ACTIVATIONS = ("auto", "f16", "q8")
DECODE_ATTENTION = ("auto", "on", "rope", "off")
PREFILL_ATTENTION = ("mma", "wgmma", "fp32")
ATTN_CLUSTERS = (0, 4, 8, 16)   # 0: attn_merge; else gpu.attention.CLUSTER_SIZES


def _frozen(d: dict) -> Mapping:
    return MappingProxyType(d)


@dataclass(frozen=True)
class KernelConfig:
    """Kernel choices of the CuPy backend (T = token rows of a launch, K / N = a weight's in /
    out features). Mappings are read-only; build a new one to change an entry.

    GEMVs (``gpu.linear``):
        activations: rounding of the decode GEMVs' activations: "auto" int8 in ``gemv_bulk``
            (batch-1 decode of large weights) and fp16 elsewhere; "q8" int8 wherever a kernel
            has it (``gemv_q8a`` for T <= ``q8a_max_t``); "f16" fp16 everywhere.
        fuse_max_t: token rows up to which ``fused_linear`` folds RMSNorm / SiLU into the GEMV
            (beyond, every block redoing the prologue costs more than a separate kernel), and
            wherever ``gemv_bulk_mt`` runs (up to 8 rows: it stages the rows once a block).
        gemv_max_t: token rows up to which ``linear`` takes a GEMV kernel, not dequant + GEMM.
        gemv_chunk: token rows a GEMV launch takes (staged activations must fit).
        prefill_f16_mib: a model whose layers' packed weights fit in this many MiB as fp16
            keeps an fp16 copy of each (dequantized once, at load), so its prefill GEMMs skip
            the copy a pass (0: never; larger models dequantize each weight every pass).
        prefill_fp8: the prefill GEMMs of weights without that copy on the fp8 tensor cores
            (Hopper, cuBLAS 12.9 and newer; ``gpu.gemm_fp8``: e4m3 codes of both operands, a
            scale a row) instead of an fp16 copy a pass.
        mma_shape: ``gemv_mma`` (row tiles a block, chunks in flight) by token tiles (1, 2, 4).
        mma_shape_t3_8: the same for 3..8 token rows (None: ``mma_shape[1]``).
        warps: ``gemv_mma`` / ``gemv_q8a`` warps a block (None: by K).
        stage_max_bytes: shared memory for staged activation rows, at most.
        gemv_stages: steps of ``gemv_mma``'s shared-memory weight ring (0 or 1: registers).
        ring_min_steps: the least ring steps a warp must have for the ring to be used.
        ring_schemes: weight schemes (``SCH_*``) that take the ring.
        q8a_max_t: token rows up to which "q8" takes ``gemv_q8a``.
        q8a_shape: ``gemv_q8a`` (row tiles, chunks in flight) for T = 1 (True) and T > 1.
        bulk: ``gemv_bulk`` for batch-1 decode of large weights on sm_90+.
        bulk_shape: ``gemv_bulk`` (consumer warps, chunks a warp a slot, ring slots, blocks a
            multiprocessor) by activations ("q8", "f16").
        bulk_min_slots: the least ring slots a weight row must fill for ``gemv_bulk``.
        bulk_short_bps: blocks a multiprocessor for a short shadow-writing stream (1: off).
        bulk_group_tiles: row tiles ``gemv_bulk`` adds and writes at a time, by preference.
        swiglu_epilogue: SwiGLU in ``gemv_bulk``'s / ``gemv_bulk_mt``'s epilogue (gate_up
            writes silu(gate) * up).
        q8_shadow: batch-1 decode kernels hand their output on pre-quantized to the next GEMV.
        bulk_mt_prestage: ``gemv_bulk_mt`` of T rows of K columns with T x K at least this takes
            its int8 rows from one ``stage_rows_q8`` launch instead of each block staging them
            from the float32 activations (0: never).
    Attention (``gpu.attention``):
        decode_attention: a decode batch's RoPE + KV write + attention as one kernel ("on"),
            with the split partials merged by ``attn_merge`` or a cluster ("rope"), as three
            kernels ("off"), or "auto": "rope" where the o projection takes ``gemv_bulk``
            (its weights stream during the attention), else "on".
        attn_cluster: thread block cluster size of the "rope" merge (0: ``attn_merge``).
        cluster_part_cap: positions a cluster's partition covers at most.
        prefill_attention: "wgmma" (Hopper's warpgroup MMAs over fp16 pages at head dims 128
            / 256; elsewhere "mma"), "mma" (tensor cores, fp16 operands) or "fp32" (CUDA cores).
        verify_rows: query rows a sequence may have (above one) for the decode kernel's split-K
            to take a pass, each row as a one-row sequence over its causal prefix: a verify
            pass of k + 1 rows reads a long context in parallel, in float32 as decode does
            (0: such passes take the prefill kernel, one block a KV head, fp16 operands).
        verify_shared_kv: such a pass reads each sequence's KV once for all its rows
            (``attn_verify``: a warp a row over tiles in shared memory) instead of once a row.
        prefill_mma_tiling: ``attn_prefill_mma`` (KV positions a tile, Q in registers, blocks a
            multiprocessor[, warps a block: 16 query rows each, default 4]) by head dim.
    Gated DeltaNet (``gpu.gdn``):
        gdn_col_split: blocks a value head in the decode / verify ``gdn_step`` (a thread block
            cluster sharing the gated norm's sum; 1: one block a head), at most: fewer where
            the batch's heads fill the multiprocessors (``gpu.gdn.step_split``).
    Launches (``gpu.launch``):
        pdl: programmatic dependent launch (sm_90+): a kernel starts while the one before ends.

    Raises (constructor):
        ValueError: an unknown ``activations``, ``decode_attention`` or ``prefill_attention``.
    """

    activations: str = "auto"
    fuse_max_t: int = 2
    gemv_max_t: int = 32
    gemv_chunk: int = 16
    prefill_f16_mib: int = 1024
    prefill_fp8: bool = False
    mma_shape: Mapping[int, tuple[int, int]] = field(
        default_factory=lambda: _frozen({1: (1, 2), 2: (2, 2), 4: (2, 2)}))
    mma_shape_t3_8: tuple[int, int] | None = (2, 2)
    warps: int | None = None
    stage_max_bytes: int = 160 * 1024
    gemv_stages: int = 4
    ring_min_steps: int = 4
    ring_schemes: frozenset[int] = frozenset({0})
    q8a_max_t: int = 1
    q8a_shape: Mapping[bool, tuple[int, int]] = field(
        default_factory=lambda: _frozen({True: (1, 2), False: (2, 2)}))
    bulk: bool = True
    bulk_shape: Mapping[str, tuple[int, int, int, int]] = field(
        default_factory=lambda: _frozen({"q8": (16, 2, 8, 1), "f16": (8, 4, 3, 2)}))
    bulk_min_slots: int = 2
    bulk_short_bps: int = 2
    bulk_group_tiles: tuple[int, ...] = (16, 8, 4)
    swiglu_epilogue: bool = True
    q8_shadow: bool = True
    bulk_mt_prestage: int = 16384
    decode_attention: str = "auto"
    attn_cluster: int = 8
    cluster_part_cap: int = 64
    prefill_attention: str = "wgmma"
    verify_rows: int = 8
    verify_shared_kv: bool = True
    prefill_mma_tiling: Mapping[int, tuple] = field(
        default_factory=lambda: _frozen({32: (64, True, 4), 64: (64, True, 4),
                                         128: (64, False, 3), 256: (64, False, 1, 8)}))
    gdn_col_split: int = 4
    pdl: bool = True

    def __post_init__(self) -> None:
        for name, allowed in (("activations", ACTIVATIONS),
                              ("decode_attention", DECODE_ATTENTION),
                              ("prefill_attention", PREFILL_ATTENTION)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"KernelConfig.{name}: {getattr(self, name)!r} is not "
                                 f"{', '.join(allowed[:-1])} or {allowed[-1]}")
        if self.attn_cluster not in ATTN_CLUSTERS:
            raise ValueError(f"KernelConfig.attn_cluster: {self.attn_cluster!r} is not one of "
                             f"{ATTN_CLUSTERS}")
        if self.gdn_col_split not in (1, 2, 4, 8):
            raise ValueError(f"KernelConfig.gdn_col_split: {self.gdn_col_split!r} is not 1, 2, "
                             f"4 or 8")
        for name in ("mma_shape", "q8a_shape", "bulk_shape", "prefill_mma_tiling"):
            value = getattr(self, name)
            if not isinstance(value, MappingProxyType):
                object.__setattr__(self, name, _frozen(dict(value)))

    @property
    def bulk_q8(self) -> bool:
        """Whether ``gemv_bulk`` takes int8 activations ("q8" or "auto")."""
        return self.activations != "f16"

"""Linear layers over stored weights on the GPU.

Quantized weights (``q4`` / ``q8`` of ``ninfer.store.quant``) stay packed in VRAM: int4/int8
codes plus fp16 scales (and mins), rearranged once at load, on the device, into the
tensor-core layout of ``ninfer.kernels.mma_layout`` (same bytes per weight; scales repeated per
32 columns for groups wider than 32). ``linear`` then picks by T (tokens):

- T = 1 (batch-1 decode) on sm_90+, for weights with at least one 16-row tile per
  multiprocessor and rows of at least two ring slots (8B-class models; ``bulk_config``):
  ``gemv_bulk``, a persistent grid that streams each block's contiguous row tiles through a
  shared-memory ring filled by bulk copies (``cp.async.bulk`` + mbarriers) while its warps
  multiply; with ``KernelConfig.activations`` "auto" (the default) or "q8" the activations are
  rounded to int8 per 32 columns (as below), with "f16" to fp16 (as ``gemv_mma``, whose math then
  bounds it).
- T <= ``q8a_max_t`` with activations "q8" (``--gemv-activations q8``): ``gemv_q8a``
  quantizes the activations per 32 columns to int8 (``mma_layout.quantize_activations_q8``, as
  llama.cpp's q8_1) and multiplies them with the packed codes on the integer tensor cores
  (``mma.sync`` m16n8k32, exact int32 sums per segment, float32 scaling): about half the
  instructions per weight of the fp16 path. Relative error ~1e-2 against float32 activations
  (that of the 8-bit rounding).
- T <= ``gemv_max_t``: ``gemv_mma`` of ``linear.cu`` reads the packed codes once per launch and
  multiplies them on the tensor cores (``mma.sync`` m16n8k16, fp16 operands, float32
  accumulation; the activations are rounded to fp16), for up to 32 token rows at once. It can
  fold RMSNorm into its prologue (``norm=``), SiLU(gate) * up (``gated=``) and the residual add
  into its epilogue (``residual=``), which is how the decode step avoids separate kernels.
- larger T (prefill): ``gpu.gemm``: the weight is dequantized into an fp16 scratch matrix
  owned by the ops object (reused by every weight, never kept per weight), the activations are
  rounded to fp16, and cuBLAS ``gemmEx`` multiplies them on the tensor cores with float32
  accumulation and a float32 result.

Float weights (``f32 f16 bf16``) and quantized ones whose K or group is not a multiple of 32 are
kept as float32 arrays and multiplied with cuBLAS sgemm.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import cupy as cp
import numpy as np

from ninfer.kernels import mma_layout
from ninfer.kernels.config import KernelConfig
from ninfer.kernels.gpu import function, sm90, sm_count
from ninfer.kernels.gpu.launch import NULL, launch
from ninfer.kernels.linear import fused_k
from ninfer.store.quant import QuantTensor, dequantize

# Tuning choices (kernel shapes, which kernel takes which case) are fields of the backend's
# ``KernelConfig`` (``kc`` below), passed to every function that chooses; what is left here are
# the kernels' fixed facts.
Q8A_SMEM_MAX = 200 * 1024   # gemv_q8a's staged int8 rows, at most
_SCH = {("q4", False): 0, ("q4", True): 1, ("q8", False): 2}
PRO = {"plain": 0, "norm": 1, "silu": 2}
_RED_MAX_BYTES = 40 * 1024  # gemv_mma's cross-warp sums, at most


@dataclass(frozen=True, slots=True)
class GemvConfig:
    """One GEMV kernel instantiation and launch: token tiles ``nt``, row tiles per block
    ``rt``, warps per block ``w``, chunks per step ``u``, staged activations ``stage``, steps in
    the shared-memory weight ring ``stages`` (0: register pipeline) and the dynamic shared
    memory ``smem`` (bytes) that staging and the ring need. For ``gemv_bulk`` ``w`` counts the
    consumer warps, ``u`` is UPW, ``stages`` NS, and ``grid`` / ``threads`` its persistent
    launch."""

    nt: int
    rt: int
    w: int
    u: int
    stage: bool
    smem: int
    stages: int = 0
    grid: int = 0      # blocks (0: one per ``rt`` row tiles)
    threads: int = 0   # per block (0: 32 w)
    tb: int = 0        # gemv_bulk: row tiles a group (KernelConfig.bulk_group_tiles)
    prestaged: bool = False   # gemv_bulk_mt: its rows come from stage_rows_q8 (``prestages``)


def gemv_config(kc: KernelConfig, t: int, k: int, norm: bool, x_aligned16: bool, sch: int = 0,
                n: int | None = None) -> GemvConfig:
    """Kernel shape for T token rows and K columns of a scheme-``sch`` (N, K) weight: more warps
    per block for longer rows (each warp gets a few steps of U chunks), activations staged in
    shared memory when they fit and their rows are 16-byte aligned, a weight ring of up to
    ``kc.gemv_stages`` steps where it pays (``_ring_stages``; without ``n``: wherever it
    fits)."""
    nt = 1 if t <= 8 else 2 if t <= 16 else 4
    chunks = -(-k // 64)
    rt, u = kc.mma_shape[nt]
    w = kc.warps or (16 if chunks >= 128 else 8 if chunks >= 32 else 4)
    if nt == 1 and t > 2 and kc.mma_shape_t3_8:
        rt, u = kc.mma_shape_t3_8
    while w > 4 and (w - 1) * rt * nt * 4 * 32 * 4 > _RED_MAX_BYTES:
        w //= 2
    words = t * (chunks * 32 + 4)
    stage = x_aligned16 and words * 4 <= min(kc.stage_max_bytes,
                                             smem_limits()[0] - _RED_MAX_BYTES - 1024)
    staged = -(-words // 4) * 16 if stage else 0
    static = (w - 1) * rt * nt * 4 * 32 * 4 + w * nt * 8 * 4   # red + ssq of linear.cu
    stages = _ring_stages(kc, sch, n, chunks, w, u, rt, staged + static)
    return GemvConfig(nt, rt, w, u, stage, staged + w * stages * u * rt * _ring_slot(sch),
                      stages)


def _chunk_bytes(sch: int, scale_copies: int) -> int:
    """Bytes of one (chunk, row tile) of a scheme-``sch`` weight as a kernel holds it in shared
    memory: codes (512, q8 1024), then the scale (and min) words of the 8 row groups, each
    ``scale_copies`` times (4: gemv_mma's ring, where each of a group's 4 lanes copies its own;
    1: gemv_bulk)."""
    return (2 if sch == _SCH[("q8", False)] else 1) * 512 + 8 * scale_copies * 4 * (
        4 if sch == _SCH[("q4", True)] else 2)


def _ring_slot(sch: int) -> int:
    """Bytes of one (chunk, row tile) in gemv_mma's weight ring: codes, then each lane's scale
    (and min) words."""
    return _chunk_bytes(sch, 4)


def _ring_stages(kc: KernelConfig, sch: int, n: int | None, chunks: int, w: int, u: int,
                 rt: int, fixed: int) -> int:
    """Weight-ring steps of ``gemv_mma`` for a block with ``fixed`` other bytes of shared
    memory: the most up to ``kc.gemv_stages`` that fit, or 0 (register pipeline) where fewer
    than 2 fit or, given N, where the ring does not pay. The ring costs shared memory, hence
    resident blocks: it pays only where the whole grid is resident at once and each warp has
    at least ``kc.ring_min_steps`` steps, for the schemes in ``kc.ring_schemes``."""
    per_block, per_sm = smem_limits()
    ring = w * u * rt * _ring_slot(sch)   # bytes per step
    stages = kc.gemv_stages
    while stages >= 2 and fixed + stages * ring > per_block:
        stages -= 1
    if stages < 2:
        return 0
    if n is None:
        return stages
    resident = sm_count() * min(per_sm // (fixed + stages * ring + 1024), 64 // w)
    pays = (sch in kc.ring_schemes and -(-chunks // (w * u)) >= kc.ring_min_steps
            and -(-(-(-n // 16)) // rt) <= resident)
    return stages if pays else 0


@functools.lru_cache(maxsize=None)
def smem_limits() -> tuple[int, int]:
    """(shared memory a block may use, static + dynamic, with the opt-in; shared memory per
    multiprocessor) of the current device, in bytes (sm_90: 227 KiB, 228 KiB)."""
    attrs = cp.cuda.Device().attributes
    return (int(attrs.get("MaxSharedMemoryPerBlockOptin", 227 * 1024)),
            int(attrs.get("MaxSharedMemoryPerMultiprocessor", 228 * 1024)))


def q8a_config(kc: KernelConfig, t: int, k: int) -> GemvConfig | None:
    """``gemv_q8a`` shape for T <= ``kc.q8a_max_t`` token rows and K columns, or None when the
    staged int8 rows (``T * (KC * 16 + pad)`` words plus 4 floats per chunk and token) exceed
    ``Q8A_SMEM_MAX`` bytes."""
    chunks = -(-k // 64)
    rt, u = kc.q8a_shape[t == 1]
    w = kc.warps or (16 if chunks >= 128 else 8 if chunks >= 32 else 4)
    words = t * (chunks * 16 + (0 if chunks % 2 else 16)) + chunks * t * 4
    if t > kc.q8a_max_t or t > 8 or words * 4 > min(Q8A_SMEM_MAX, smem_limits()[0] - 32 * 1024):
        return None
    return GemvConfig(1, rt, w, u, True, words * 4)


def _bulk_static(tb: int, w: int) -> int:
    """Shared memory (bytes) of a ``gemv_bulk`` block besides the dynamic part: the group sums
    (double-buffered, TB tiles of W warps' 16 floats), ssq (W x 8 floats) and the system's
    1 KiB a block."""
    return 2 * tb * w * 16 * 4 + w * 8 * 4 + 1024


def bulk_config(kc: KernelConfig, t: int, k: int, n: int, sch: int, x_aligned16: bool,
                qout: bool = False) -> GemvConfig | None:
    """``gemv_bulk`` launch for T token rows of a scheme-``sch`` (N, K) weight, or None where it
    does not apply: T > 1, ``kc.bulk`` off, a GPU below sm_90, fewer 16-row tiles than
    multiprocessors, rows shorter than ``kc.bulk_min_slots`` ring slots (of ``W UPW`` chunks of
    64), fp16 activations whose rows are not 16-byte aligned, or a ring of 3 slots and the
    staged row that do not fit in shared memory (the ring has NS slots, or fewer where NS do
    not fit). (W, UPW, NS, BPS): ``kc.bulk_shape`` of the activations.

    ``smem`` (bytes): NS slots of ``W UPW`` chunks (codes: 512 bytes, q8 1024; scale words: 64,
    with mins 128), 32 NS for the mbarriers, the staged row (int8 with ``kc.bulk_q8``: 80 bytes
    per chunk with its scales, else fp16: 128), and at least ``1 / (BPS + 1)`` of the
    multiprocessor's shared memory: at most BPS such blocks share a multiprocessor, so the
    blocks of the next GEMV, launched early (PDL), wait for a whole block to leave instead of
    crowding multiprocessors that still hold their share of this one (the static split then
    runs as long as its most loaded multiprocessor).

    ``qout`` (the launch writes a q8 shadow: whole 32-row segments a block; not with the SwiGLU
    epilogue): with at most one segment per multiprocessor and a segment's slots within the
    ring, ``kc.bulk_short_bps`` blocks a multiprocessor where that many fit, each with a ring
    of one segment's slots and the smallest group (a smaller block: the next GEMV's blocks find
    room sooner)."""
    if t != 1 or not kc.bulk or not sm90():
        return None
    q8 = kc.bulk_q8
    w, upw, ns, per_sm = kc.bulk_shape["q8" if q8 else "f16"]
    n16, chunks = mma_layout.padded(n, k)
    if n16 < sm_count() or chunks < kc.bulk_min_slots * w * upw or (not q8 and not x_aligned16):
        return None
    static_of = lambda tb: _bulk_static(tb, w)  # noqa: E731
    ring = lambda ns: (ns * w * upw * _chunk_bytes(sch, 1) + 32 * ns  # noqa: E731
                       + chunks * (80 if q8 else 128))
    seg_slots = 2 * -(-chunks // (w * upw))   # a 32-row segment's ring slots
    tb = min(kc.bulk_group_tiles)
    if (qout and kc.bulk_short_bps > 1 and n16 // 2 <= sm_count() and seg_slots <= ns
            and tb <= 2 * w):
        per_sm = kc.bulk_short_bps
        smem = max(ring(seg_slots), smem_limits()[1] // (per_sm + 1) + 1)
        if per_sm * (smem + static_of(tb)) <= smem_limits()[1]:   # that many fit
            return GemvConfig(1, 1, w, upw, True, smem, seg_slots,
                              min(n16, sm_count() * per_sm), 32 * (w + 1), tb)
    # (group size, slots) in order of preference: the largest group with a ring of NS slots or
    # fewer but at least 5 (q8 weights' slots are twice as large as q4's), then rings down to 3
    deep = range(ns, min(ns, 5) - 1, -1)
    tb, ns = next(((tb, n) for n_range in (deep, range(min(ns, 5) - 1, 2, -1))
                   for tb in kc.bulk_group_tiles for n in n_range
                   if tb <= 2 * w and ring(n) + static_of(tb) <= smem_limits()[0]), (0, 0))
    if tb == 0:
        return None
    smem = ring(ns)
    static = static_of(tb)
    per_sm = max(1, min(per_sm, smem_limits()[1] // (smem + static),   # all blocks resident
                        2048 // (32 * (w + 1))))
    smem = max(smem, smem_limits()[1] // (per_sm + 1) + 1)
    return GemvConfig(1, 1, w, upw, True, smem, ns, min(n16, sm_count() * per_sm),
                      32 * (w + 1), tb)


def bulk_mt_config(kc: KernelConfig, t: int, k: int, n: int, sch: int) -> GemvConfig | None:
    """``gemv_bulk_mt`` launch for 2 <= T <= 8 token rows (``tb``: MT, the token columns it is
    built for: 2, 4 or 8), or None where it does not apply: int8 activations off, no sm_90,
    fewer 16-row tiles than multiprocessors, rows shorter than ``kc.bulk_min_slots`` ring
    slots, or a ring of 3 slots and the T staged rows that do not fit. The ring keeps
    ``kc.bulk_shape["q8"]``'s shape with as many of its slots as fit beside the staged rows;
    where none do, half its consumer warps (smaller slots and partial sums: the 27B's down
    projection, K = 17,408, at 8 rows)."""
    if not (2 <= t <= 8 and kc.bulk and kc.bulk_q8 and sm90()):
        return None
    w0, upw, ns, _ = kc.bulk_shape["q8"]
    n16, chunks = mma_layout.padded(n, k)
    if n16 < sm_count():
        return None
    mt = 2 if t <= 2 else 4 if t <= 4 else 8
    kcw = -(-k // 64)
    staged = t * (4 * (kcw * 16 + (0 if kcw % 2 else 16)) + 16 * kcw)
    for w in dict.fromkeys((w0, max(4, w0 // 2))):
        if chunks < kc.bulk_min_slots * w * upw:
            return None
        static = 2 * 16 * w * 16 * 4 + w * 8 * 4 + 64 + 1024
        for slots in range(ns, 2, -1):
            smem = slots * (w * upw * _chunk_bytes(sch, 1) + 32) + staged
            if smem + static <= smem_limits()[0]:
                return GemvConfig(1, 1, w, upw, True, smem, slots, min(n16, sm_count()),
                                  32 * (w + 1), mt)
    return None


def prestage_words(t: int, k: int) -> int:
    """32-bit words of ``stage_rows_q8``'s buffer for T rows of K columns: the T staged rows
    (``gemv_bulk_mt``'s shared-memory stride), the (chunk, token) meta, each token's rstd."""
    kcw = -(-k // 64)
    return t * (kcw * 16 + (0 if kcw % 2 else 16)) + 4 * kcw * t + t


def prestages(kc: KernelConfig, t: int, k: int) -> bool:
    """Whether a ``gemv_bulk_mt`` launch of T rows of K columns takes its staged rows from one
    ``stage_rows_q8`` launch (``kc.bulk_mt_prestage``: at least that many T x K elements; 0:
    never) instead of every block staging them from ``x``."""
    return 0 < kc.bulk_mt_prestage <= t * k


def prologue_fuses(kc: KernelConfig, w, t: int) -> bool:
    """Whether T rows of ``w`` take their RMSNorm / SiLU prologue inside the GEMV: T <=
    ``kc.fuse_max_t``, or ``gemv_bulk_mt`` runs them (its staging applies the prologue)."""
    return t <= kc.fuse_max_t or (isinstance(w, GpuWeight) and bulk_mt_config(
        kc, t, w.shape[1], w.shape[0], w.sch) is not None)


def gemv_name(sch: int, cfg: GemvConfig, pro: int, acc: bool) -> str:
    b = lambda v: "true" if v else "false"  # noqa: E731
    return (f"gemv_mma<{sch},{cfg.nt},{cfg.rt},{cfg.w},{cfg.u},{pro},{b(acc)},"
            f"{b(cfg.stage)},{cfg.stages}>")


def _fn(fname: str):
    """Kernel ``fname`` (a template instantiation of linear.cu), compiled in a module of its
    own: only the variants a model uses get compiled."""
    return function("linear", fname, (fname,))


@dataclass(slots=True)
class GpuWeight:
    """A quantized ``(N, K)`` weight resident on the GPU in the tensor-core layout of
    ``ninfer.kernels.mma_layout``.

    Attributes:
        scheme: ``"q4"`` or ``"q8"``.
        shape: ``(N, K)``.
        group: elements per scale group along K of the stored weight (a multiple of 32).
        codes: uint32, q4 ``(N16, KC, 32, 4)`` / q8 ``(N16, KC, 2, 32, 4)``.
        scales: uint32 ``(N16, KC, 8, 2)``, or ``(N16, KC, 8, 4)`` with mins (q4 only).
        f16: the dequantized weight as float16, ``N * K`` in C order, kept where the model's
            fit ``KernelConfig.prefill_f16_mib`` (``LinearOps.keep_f16``); else None.
        f8_scale: (N,) float32 scales of the weight's e4m3 rows (``gemm_fp8.row_scales``),
            made by its first fp8 prefill GEMM; else None.
        prefill_fp8: whether ``KernelConfig.prefill_fp8`` applies to its prefill GEMMs; False
            for a model's output head (``CupyOps.prepare_model``): its logits are what sampling
            and scoring read, and serving multiplies it by a few rows at most.
    """

    scheme: str
    shape: tuple[int, int]
    group: int
    codes: cp.ndarray
    scales: cp.ndarray
    f16: cp.ndarray | None = None
    f8_scale: cp.ndarray | None = None
    prefill_fp8: bool = True

    @property
    def mins(self) -> bool:
        return self.scales.shape[-1] == 4

    @property
    def sch(self) -> int:
        """Kernel scheme id (``SCH_*`` of linear.cu)."""
        return _SCH[(self.scheme, self.mins)]

    @property
    def nbytes(self) -> int:
        """Device bytes of codes + scales (what one GEMV pass reads)."""
        return int(self.codes.nbytes) + int(self.scales.nbytes)

    @classmethod
    def pack(cls, scheme: str, shape: tuple[int, int], group: int, codes, scales,
             mins=None) -> GpuWeight:
        """Pack stored-layout payloads (host NumPy or device CuPy arrays; see
        ``ninfer.store.quant``) into the tensor-core layout, on the device.

        Raises:
            ValueError: unknown scheme, mins with q8, or K / group not multiples of 32.
        """
        n, k = shape
        if scheme not in ("q4", "q8") or (scheme == "q8" and mins is not None):
            raise ValueError(f"cannot pack scheme {scheme!r} (mins: {mins is not None})")
        if not mma_layout.layout_ok(k, group):
            raise ValueError(f"K {k} and group {group} must be multiples of 32")
        dc = cp.asarray(codes)
        packed = (mma_layout.pack_q4(dc, n, k, cp) if scheme == "q4"
                  else mma_layout.pack_q8(dc, n, k, cp))
        sc = mma_layout.pack_scales(cp.asarray(scales, dtype=cp.float16),
                                    None if mins is None else cp.asarray(mins, dtype=cp.float16),
                                    n, k, group, cp)
        del dc
        return cls(scheme, (n, k), group, cp.ascontiguousarray(packed),
                   cp.ascontiguousarray(sc))


@dataclass(slots=True)
class FusedWeight:
    """Weights of differing schemes fused along N: ``parts[i]`` yields columns
    ``offsets[i]:offsets[i+1]`` of ``linear``'s output."""

    parts: list
    offsets: list[int]
    shape: tuple[int, int]


def upload(t: QuantTensor):
    """A stored 2-D weight on the GPU: ``GpuWeight`` for q4/q8 whose K and group are multiples
    of 32, else a float32 ``cp.ndarray``."""
    if t.scheme in ("q4", "q8") and mma_layout.layout_ok(t.shape[1], t.group):
        return GpuWeight.pack(t.scheme, tuple(t.shape), t.group, t.codes, t.scales, t.mins)
    return cp.asarray(np.ascontiguousarray(dequantize(t), dtype=np.float32))


def upload_fused(ts: Sequence[QuantTensor]):
    """Several ``(N_i, K)`` weights as one ``(sum N_i, K)`` weight (see ``NumpyOps.prepare_fused``).

    Same quantized scheme, group and mins presence: the stored parts are concatenated along N
    and packed as one weight (one GEMV launch). Otherwise a ``FusedWeight`` of separately
    uploaded parts.

    Raises:
        ValueError: empty list, a tensor that is not 2-D, or differing K.
    """
    k = fused_k(ts)
    n = sum(t.shape[0] for t in ts)
    kinds = {(t.scheme, t.group, t.mins is None) for t in ts}
    if len(kinds) == 1 and ts[0].scheme in ("q4", "q8"):
        t0 = ts[0]
        cat = lambda name, dt: np.concatenate(
            [np.asarray(getattr(t, name), dtype=dt) for t in ts], axis=0)
        codes = cat("codes", np.uint8 if t0.scheme == "q4" else np.int8)
        mins = None if t0.mins is None else cat("mins", np.float16)
        return upload(QuantTensor(t0.scheme, (n, k), codes=codes,
                                  scales=cat("scales", np.float16), mins=mins, group=t0.group))
    if all(t.scheme not in ("q4", "q8") for t in ts):
        return cp.asarray(np.concatenate([dequantize(t).astype(np.float32) for t in ts], axis=0))
    offs = np.cumsum([0] + [t.shape[0] for t in ts]).tolist()
    return FusedWeight([upload(t) for t in ts], offs, (n, k))


def _row_stride(x: cp.ndarray) -> int:
    """Row stride (elements) of a 2-D float32 array whose rows are contiguous."""
    return x.strides[0] // 4 if x.shape[0] > 1 else x.shape[1]


def swiglu_epilogue(kc: KernelConfig, w, t: int, force: bool = False) -> bool:
    """Whether ``gemv(..., swiglu=True)`` runs for T rows of ``w`` as one kernel with the SwiGLU
    epilogue, for a packed (2 I, K) gate | up weight with I a multiple of 16, when
    ``kc.swiglu_epilogue`` (or ``force``) is on: ``gemv_bulk`` (T = 1) or ``gemv_bulk_mt`` (T =
    2..8) where ``bulk_config`` / ``bulk_mt_config`` applies to each half."""
    if not (kc.swiglu_epilogue or force) or not isinstance(w, GpuWeight):
        return False
    n, k = w.shape
    if n % 32:
        return False
    if t == 1:
        return bulk_config(kc, 1, k, n // 2, w.sch, True) is not None
    return bulk_mt_config(kc, t, k, n // 2, w.sch) is not None


def shadow_consumer(kc: KernelConfig, w, t: int, gated: bool = False) -> bool:
    """Whether a T-row ``gemv`` of ``w`` can take its activations from a q8 shadow
    (``kc.q8_shadow`` on, T = 1, ``gemv_bulk`` with int8 activations, K a multiple of 64, no
    SiLU gating)."""
    if (not kc.q8_shadow or t != 1 or gated or not isinstance(w, GpuWeight)
            or not kc.bulk_q8):
        return False
    n, k = w.shape
    return k % 64 == 0 and bulk_config(kc, 1, k, n, w.sch, True) is not None


def shadow_producer(kc: KernelConfig, w, t: int, swiglu: bool = False) -> bool:
    """Whether a T-row ``gemv`` of ``w`` (with the SwiGLU epilogue where ``swiglu``) can also
    write its output as a q8 shadow: ``gemv_bulk`` for T = 1 with an output width (N, or N / 2)
    that is a multiple of 64."""
    if not kc.q8_shadow or t != 1 or not isinstance(w, GpuWeight):
        return False
    n, k = w.shape
    n_out = n // 2 if swiglu else n
    return n_out % 64 == 0 and bulk_config(kc, 1, k, n_out, w.sch, True) is not None


def new_shadow(k: int) -> cp.ndarray:
    """An unwritten q8 shadow of a K-column vector (K a multiple of 64): uint8 (K / 64 * 88,)
    (layout: common.cuh, "Pre-quantized activations")."""
    return cp.empty((k // 64 * 88,), dtype=cp.uint8)


def gemv(kc: KernelConfig, x: cp.ndarray, w: GpuWeight, out: cp.ndarray, *,
         norm: cp.ndarray | None = None,
         eps: float = 0.0, gated: bool = False, accumulate: bool = False,
         swiglu: bool = False, shadow_in: cp.ndarray | None = None,
         shadow_out: tuple | None = None) -> None:
    """``out[:T] (+)= a @ dequant(w).T`` with the kernel ``gemv_kernel`` picks (``gemv_bulk``,
    ``gemv_q8a`` or ``gemv_mma``) for ``kc``, one launch per ``kc.gemv_chunk`` rows.

    ``a`` is ``x`` (T, K); with ``norm`` the RMSNorm ``x / sqrt(mean(x^2) + eps) * norm``;
    with ``gated`` ``x`` is (T, 2K) ``gate | up`` and ``a = silu(gate) * up``. ``accumulate``
    adds into ``out`` (the residual stream) instead of overwriting it. With ``swiglu`` (``w`` a
    (2 I, K) gate | up weight for which ``swiglu_epilogue(kc, w, T, force=True)``, T > 1 with an
    even row stride of ``x``; not with ``gated`` or ``accumulate``) ``out`` (T, I) gets
    ``silu(y[:, :I]) * y[:, I:]`` of the product ``y``, computed in the epilogue of
    ``gemv_bulk`` (T = 1) or ``gemv_bulk_mt`` (T = 2..8). ``a`` is rounded to int8
    per 32 columns (relative error ~1e-2: ``gemv_bulk`` with ``kc.activations`` "auto", the
    default, or "q8"; ``gemv_q8a`` for T <= ``kc.q8a_max_t`` with "q8") or to fp16 (~1e-4) for
    the tensor cores.

    ``shadow_in`` (where ``shadow_consumer``): a q8 shadow of ``x`` (``new_shadow(K)``) that the
    previous kernel wrote; the activations are copied from it instead of staged from ``x``.
    ``shadow_out`` (where ``shadow_producer``): ``(shadow, norm_w, sch)``: the written output
    (T = 1) also goes to ``shadow`` (``new_shadow(N)``, or N / 2 with ``swiglu``), quantized for
    a consumer of weight scheme ``sch`` with RMSNorm weight ``norm_w`` (or None).

    Args:
        x: float32, rows contiguous (any row stride, 8-byte aligned), 1 <= T <= 32.
        w: packed weight; norm: float32 (K,) or None; eps: RMSNorm epsilon.
        out: (T, N) float32 with contiguous rows.

    Raises:
        ValueError: strided columns, a K that does not match the weight, ``swiglu`` where
            the epilogue does not apply (or with ``gated`` / ``accumulate``), or a shadow where
            ``shadow_consumer`` / ``shadow_producer`` says no.
    """
    t, kx = x.shape
    n, k = w.shape
    if swiglu and (gated or accumulate or not swiglu_epilogue(kc, w, t, force=True)
                   or out.shape[-1] != n // 2):
        raise ValueError(f"gemv: no SwiGLU epilogue for weight {w.shape}, T = {t}, out "
                         f"{out.shape} (gated {gated}, accumulate {accumulate})")
    if (shadow_in is not None and not shadow_consumer(kc, w, t, gated)) or (
            shadow_out is not None and not shadow_producer(kc, w, t, swiglu)):
        raise ValueError(f"gemv: no q8 shadow for weight {w.shape}, T = {t}")
    step = kc.gemv_chunk
    if t > step:  # weights read once per chunk of rows, activations staged
        for t0 in range(0, t, step):
            gemv(kc, x[t0:t0 + step], w, out[t0:t0 + step], norm=norm, eps=eps, gated=gated,
                 accumulate=accumulate, swiglu=swiglu)
        return
    pro = PRO["norm"] if norm is not None else PRO["silu"] if gated else PRO["plain"]
    if x.strides[1] != 4 or out.strides[1] != 4 or kx != (2 * k if gated else k):
        raise ValueError(f"gemv: x {x.shape} {x.strides}, out {out.shape} {out.strides}, "
                         f"weight {w.shape}")
    ldx = _row_stride(x)
    fn, cfg = gemv_kernel(kc, w.sch, t, k, pro, accumulate, x.data.ptr % 16 == 0, ldx, n,
                          swiglu, shadow_in is not None, shadow_out is not None,
                          prestages(kc, t, k))
    if cfg.smem > _smem_set.get(id(fn), 0):
        fn.max_dynamic_shared_size_bytes = cfg.smem
        _smem_set[id(fn)] = cfg.smem
    n16 = -(-n // 16)
    args = (x, np.int32(ldx), norm if norm is not None else x, np.float32(eps),
            w.codes, w.scales, out, np.int32(_row_stride(out)), np.int32(t), np.int32(n),
            np.int32(k))
    if cfg.prestaged:   # gemv_bulk_mt: its rows made once, by stage_rows_q8
        pre = cp.empty(prestage_words(t, k), dtype=cp.uint32)
        launch(_fn(f"stage_rows_q8<{w.sch},{pro},{cfg.w}>"), (t,), (32 * cfg.w,),
               (x, np.int32(ldx), norm if norm is not None else x, np.float32(eps),
                np.int32(t), np.int32(k), pre), pdl=kc.pdl)
        args += (pre, NULL, NULL, np.int32(0))
    elif cfg.grid:  # gemv_bulk: the shadows
        qo, qnw, qsch = shadow_out if shadow_out is not None else (None, None, 0)
        args += (NULL if shadow_in is None else shadow_in, NULL if qo is None else qo,
                 NULL if qnw is None else qnw, np.int32(qsch))
    launch(fn, (cfg.grid or -(-n16 // cfg.rt),), (cfg.threads or 32 * cfg.w,), args,
           shared_mem=cfg.smem, pdl=kc.pdl)


_smem_set: dict[int, int] = {}


def gemv_kernel(kc: KernelConfig, sch: int, t: int, k: int, pro: int, accumulate: bool,
                x_aligned16: bool, ldx: int, n: int | None = None, swiglu: bool = False,
                qin: bool = False, qout: bool = False, prestaged: bool = False):
    """``(kernel, GemvConfig)`` that ``gemv`` launches for T rows of K columns (row stride
    ``ldx`` elements) of an (N, K) weight: ``gemv_bulk`` where ``bulk_config`` applies (given
    N), else ``gemv_q8a`` when ``kc.activations == "q8"`` and ``q8a_config`` fits, else
    ``gemv_mma``. ``swiglu``: ``gemv_bulk`` (T = 1) or ``gemv_bulk_mt`` with the SwiGLU
    epilogue (the caller checked ``swiglu_epilogue``), its grid over the N / 32 pairs of row
    tiles. ``qin`` / ``qout``: ``gemv_bulk`` reading / writing a q8 shadow (the caller checked
    ``shadow_consumer`` / ``shadow_producer``). ``prestaged``: ``gemv_bulk_mt`` copies its
    staged rows from ``stage_rows_q8``'s buffer (``prestages``).

    Raises:
        ValueError: ``swiglu`` where neither bulk kernel applies (an odd ``ldx`` for T > 1).
    """
    b = lambda v: "true" if v else "false"  # noqa: E731
    cfg = (bulk_config(kc, t, k, n // 2 if swiglu else n, sch, x_aligned16,
                       qout and not swiglu) if n is not None else None)
    if cfg is not None:
        return _fn(f"gemv_bulk<{sch},{pro},{b(accumulate)},{b(kc.bulk_q8)},{cfg.w},{cfg.u},"
                   f"{cfg.stages},{b(swiglu)},{b(qin)},{b(qout)},{cfg.tb}>"), cfg
    cfg = (bulk_mt_config(kc, t, k, n // 2 if swiglu else n, sch)
           if n is not None and not (qin or qout) and ldx % 2 == 0 else None)
    if cfg is not None:
        cfg = dataclasses.replace(cfg, prestaged=prestaged)
        return _fn(f"gemv_bulk_mt<{sch},{pro},{b(accumulate)},{cfg.w},{cfg.u},{cfg.stages},"
                   f"{cfg.tb},{b(swiglu)},{b(prestaged)}>"), cfg
    if swiglu:   # (the other kernels have no SwiGLU epilogue)
        raise ValueError(f"gemv: no SwiGLU epilogue for T = {t}, K = {k}, N = {n}, ldx {ldx}")
    cfg = q8a_config(kc, t, k) if kc.activations == "q8" and ldx % 2 == 0 else None
    if cfg is not None:
        return _fn(f"gemv_q8a<{sch},{cfg.rt},{cfg.w},{cfg.u},{pro},{b(accumulate)},"
                   f"{b(t == 1)}>"), cfg
    cfg = gemv_config(kc, t, k, pro == PRO["norm"], x_aligned16 and ldx % 4 == 0, sch, n)
    return _fn(gemv_name(sch, cfg, pro, accumulate)), cfg


def embedding(w: GpuWeight, ids: cp.ndarray) -> cp.ndarray:
    """Rows ``ids`` (int32 device (T,), range-checked) of a packed (V, H) weight, dequantized as
    ``quant.dequantize`` does -> new (T, H) float32."""
    t = ids.shape[0]
    h = w.shape[1]
    out = cp.empty((t, h), dtype=cp.float32)
    if t:
        _fn(f"embed_mma<{w.sch}>")((t,), (min(256, -(-h // 32) * 32),),
                                   (w.codes, w.scales, ids, out, np.int32(h)))
    return out

"""Paged causal GQA attention on the GPU (``attention.cu``); semantics of
``ninfer.kernels.attention.paged_attention``.

- Decode (every sequence has one new token): ``attn_decode`` splits each sequence's context into
  ``splits`` partitions (chosen on the host from the longest context so that the grid has about
  two blocks per multiprocessor, partitions of at least ``MIN_PARTITION`` positions); on the
  device each sequence divides its own length by ``splits`` (at least ``PART_GRANULE`` positions
  per partition), so a short context inside a graph captured for a long one is still spread over
  the blocks. ``attn_merge`` combines the partial softmax results (split-K).
  ``rope_paged_attention`` (the Llama decode step) runs RoPE, the KV write, the attention and
  the merge of the splits (by the last block of each sequence and KV head) in that one kernel;
  with ``merge_kernel`` the merge is ``attn_merge``'s, or, in thread block clusters
  (``KernelConfig.attn_cluster``), the kernel's own through distributed shared memory. With
  ``norm`` and ``gated`` (Qwen3.5's gated attention) the same kernel also normalises the q and k
  heads before RoPE and multiplies the output by sigmoid of its gate where it stores it.
- A pass of at most ``KernelConfig.verify_rows`` rows a sequence (an MTP verify pass):
  ``attn_rows`` makes each query row a one-row sequence over its causal prefix (on the
  device, so a CUDA graph recomputes it), and ``attn_decode`` / ``attn_merge`` run as above;
  or (``KernelConfig.verify_shared_kv``, where the rows are 4-byte multiples) ``attn_verify``
  reads each KV tile of a sequence once for all its rows (a warp a row, the tiles in shared
  memory) and writes the partials ``attn_merge`` reads for those one-row sequences.
- Otherwise (prefill chunks, mixed batches): on Hopper over fp16 pages at head dims 128 / 256,
  ``attn_prefill_wgmma`` (``KernelConfig.prefill_attention`` "wgmma", the default): two
  warpgroups of 64 query rows, S and O on the asynchronous warpgroup MMAs from shared memory,
  and a third that loads K / V a tile ahead (a ring of two stages on mbarriers); elsewhere (or
  "mma") ``attn_prefill_mma``: FlashAttention-2 on tensor cores, 64 x 64 tiles, fp16 operands
  (Q, K, V, P) with fp32 accumulation and softmax; or ``attn_prefill`` ("fp32"): flash-style
  32 x 32 tiles on CUDA cores in float32. All: online softmax, causal limit per query row.
- The rk KV modes (``elementwise.RK_TYPES``) store Hadamard-rotated rows; as H64 is orthonormal
  and symmetric, the kernels attend in the rotated domain: q is rotated first
  (``kv_hadamard_rows``; the fused decode kernel rotates its own q), the pages are read as code
  times scale, and the output is rotated back (``kv_hadamard_rows`` again).
"""
from __future__ import annotations

import functools

import cupy as cp
import numpy as np

from ninfer.engine import kv_dtypes
from ninfer.kernels.config import KernelConfig
from ninfer.kernels.gpu import function, function_sm90a, set_max_dynamic_smem, sm90a, sm_count
from ninfer.kernels.gpu.elementwise import RK_TYPES, _as_rows, _row_stride, kv_head_dim, kv_type
from ninfer.kernels.gpu.gdn import sigmoid_mul
from ninfer.kernels.gpu.launch import NULL, clusters_available, launch

HEAD_DIMS = (32, 64, 128, 256)
MAX_GROUP = 8
MIN_PARTITION = 32   # host: positions per partition when choosing the split count
PART_GRANULE = 16    # device: least positions per partition (four per warp)
MAX_SPLITS = 64      # partitions per sequence at most (MERGE_MAX_SPLITS of attention.cu)
# cluster sizes of the "rope" merge (KernelConfig.attn_cluster: one of these, or 0)
CLUSTER_SIZES = (4, 8, 16)
_PREFILL_BR = 32
# attn_prefill_wgmma (prefill_attention "wgmma"): head dims, rows a block (two warpgroups of
# 64), KV positions a tile, threads a block (and a loading warpgroup), its mbarriers' bytes
WGMMA_HEAD_DIMS, WGMMA_BR, WGMMA_BC, WGMMA_THREADS, WGMMA_BARS = (128, 256), 128, 64, 384, 4 * 8


def _prefill_mma_tiling(kc: KernelConfig, hd: int) -> tuple[int, bool, int, int]:
    """(KV positions a tile, Q in registers, blocks a multiprocessor, warps a block) of
    ``attn_prefill_mma`` at head dim ``hd`` (4 warps where the config gives three fields)."""
    bc, qreg, minb, *nw = kc.prefill_mma_tiling[hd]
    return bc, qreg, minb, (nw[0] if nw else 4)


# the KV element types' --kv-dtype names (kv_dtypes.head_bytes: their rows' bytes)
_KT_DTYPE = {"float": "fp32", "unsigned short": "fp16", "signed char": "int8"} | {
    t: name for name, t in RK_TYPES.items()}
_SMEM_BLOCK, _SMEM_SM = 227 * 1024, 228 * 1024   # sm_90's shared memory a block, a multiprocessor


def _prefill_mma_launch(kc: KernelConfig, hd: int, t: str) -> tuple[str, int]:
    """(instantiation, dynamic shared memory in bytes) of ``attn_prefill_mma`` at head dim
    ``hd`` over KV element type ``t``: Q, K and V tiles in fp16; MODE 2 (fp16 caches: a second K
    and V tile filled by cp.async during this tile's MMAs) where it fits without lowering the
    tiling's blocks a multiprocessor, MODE 1 (1-byte caches whose rows are 4-byte multiples: a
    tile's raw rows staged by cp.async) where it fits, else MODE 0 (converted through
    registers)."""
    bc, qreg, minb, nw = _prefill_mma_tiling(kc, hd)
    base = 2 * (16 * nw + 2 * bc) * (hd + 8)
    mode, smem = 0, base
    two = base + 4 * bc * (hd + 8)
    if t == "unsigned short" and two <= _SMEM_BLOCK and minb * (two + 1024) <= _SMEM_SM:
        mode, smem = 2, two
    elif (t == "signed char" or t in RK_TYPES.values()) and hd % kv_dtypes.GROUP == 0:
        wk, wv = kv_dtypes.head_bytes(_KT_DTYPE[t], hd)
        if wk % 4 == 0 and wv % 4 == 0 and base + bc * (wk + wv) <= _SMEM_BLOCK:
            mode, smem = 1, base + bc * (wk + wv)
    return (f"attn_prefill_mma<{t},{hd},{bc},{str(qreg).lower()},{minb},{nw},{mode}>", smem)


# attn_decode's ring (RING in attention.cu): 4 warps x 3 batches x 4 rows of K and V a block
_DECODE_RING_ROWS = 4 * 3 * 4
_ring_set: set[int] = set()   # functions whose dynamic shared memory limit is raised


def decode_ring_bytes(k_cache: cp.ndarray, v_cache: cp.ndarray) -> int:
    """Dynamic shared memory of an ``attn_decode`` launch over these caches: its warps' rings of
    cached rows where the rows are of 1- or 2-byte elements and 4-byte multiples wide (fp16,
    int8 and rk pages but int8 / rk at head dim 64), else 0 (float32 pages: no ring).

    Raises:
        ValueError: ring pages at addresses not aligned to the kernel's copies (16, 8 or 4
            bytes, the largest that divides both row widths).
    """
    wk, wv = k_cache.shape[3] * k_cache.itemsize, v_cache.shape[3] * v_cache.itemsize
    if k_cache.itemsize > 2 or wk % 4 or wv % 4:
        return 0
    cpy = next(c for c in (16, 8, 4) if wk % c == 0 and wv % c == 0)
    if k_cache.data.ptr % cpy or v_cache.data.ptr % cpy:
        raise ValueError(f"attn_decode copies KV rows {cpy} bytes at a time: the pages must "
                         f"start at {cpy}-byte aligned addresses")
    return _DECODE_RING_ROWS * (wk + wv)


VERIFY_TILE, VERIFY_STAGES = 16, 3   # attn_verify's VT positions a tile, VNS tiles in its ring
VERIFY_MAX_ROWS = 8                  # rows a sequence (a warp each: its __launch_bounds__(256))


def verify_ring_bytes(k_cache: cp.ndarray, v_cache: cp.ndarray) -> int:
    """Dynamic shared memory of an ``attn_verify`` launch over these caches (its ring of
    ``VERIFY_STAGES`` tiles of ``VERIFY_TILE`` K and V rows), or 0 where it does not apply: rows
    that are not 4-byte multiples, or pages not aligned to its copies (the per-row path then
    takes the pass, and refuses such pages itself where it copies them)."""
    wk, wv = k_cache.shape[3] * k_cache.itemsize, v_cache.shape[3] * v_cache.itemsize
    if wk % 4 or wv % 4:
        return 0
    cpy = next(c for c in (16, 8, 4) if wk % c == 0 and wv % c == 0)
    if k_cache.data.ptr % cpy or v_cache.data.ptr % cpy:
        return 0
    return VERIFY_STAGES * VERIFY_TILE * (wk + wv)


def _with_ring(fn, ring: int):
    """``fn`` allowed ``ring`` bytes of dynamic shared memory (over the 48 KB default; set once
    a function)."""
    kern = getattr(fn, "kernel", fn)   # (a RawKernel's function, or a Module's itself)
    if ring and kern.ptr not in _ring_set:
        set_max_dynamic_smem(kern, ring)
        _ring_set.add(kern.ptr)
    return fn


def _fn(kc: KernelConfig, hd: int, t: str, fname: str):
    """Kernel ``fname`` of the module compiled for head dim ``hd`` and KV element type ``t``
    (``elementwise.kv_type``): one module per pair, so an fp32 cache compiles no fp16 kernels."""
    names = tuple([f"attn_decode<{t},{hd},{g},{r}>" for g in range(1, MAX_GROUP + 1)
                   for r in ("false,false", "true,true", "true,false")]
                  + [f"attn_decode<{t},{hd},{g},true,true,{c}>" for g in range(1, MAX_GROUP + 1)
                     for c in CLUSTER_SIZES if (g * hd) % (32 * c) == 0]
                  + [f"attn_verify<{t},{hd},{g}>" for g in range(1, MAX_GROUP + 1)]
                  + [f"attn_prefill<{t},{hd}>", _prefill_mma_launch(kc, hd, t)[0]])
    return function("attention", fname, names)


def hadamard_rows(kc: KernelConfig, hd: int, t: str, x: cp.ndarray,
                  out: cp.ndarray | None = None) -> cp.ndarray:
    """y = H64 x per 64-dim group of each row of (T, n, hd) ``x`` (rows may be strided;
    ``kv_hadamard_rows``, from the module of (hd, ``t``)), into ``out`` (may be ``x`` itself, then
    contiguous) or a new contiguous array; H64 is its own inverse."""
    rows, width = x.shape[0], x.shape[1] * x.shape[2]
    if x.strides[2] != 4 or x.strides[1] != hd * 4:
        x = cp.ascontiguousarray(x)
    y = cp.empty(x.shape, dtype=cp.float32) if out is None else out
    if rows:
        launch(_fn(kc, hd, t, "kv_hadamard_rows"), (rows,), (128,), (
            x, np.int32(x.strides[0] // 4 if rows > 1 else width), y, np.int32(width),
            np.int32(width)), pdl=kc.pdl)
    return y


# attn_decode with ROPE: one int32 arrival counter per (sequence, KV head), zero between
# launches (the merging block resets its own), so one launch at a time may use them (the engine
# decodes on one stream). One buffer per device for the process, from the default memory pool
# (not a graph bucket's) and never freed, so that captured graphs may keep its address.
MAX_COUNTERS = 8192
_counters: dict[int, cp.ndarray] = {}


def _arrivals() -> cp.ndarray:
    dev = cp.cuda.Device().id
    if dev not in _counters:
        with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):
            _counters[dev] = cp.zeros(MAX_COUNTERS, dtype=cp.int32)
    return _counters[dev]


def _decode_split(s: int, nkv: int, lmax: int) -> int:
    """Splits (partitions per sequence) of ``attn_decode`` for S sequences of at most ``lmax``
    positions: about two blocks per multiprocessor, at most ``MAX_SPLITS``, partitions of at
    least ``MIN_PARTITION`` positions (a multiple of 32)."""
    want = min(MAX_SPLITS, max(1, -(-2 * sm_count() // (s * nkv))))
    part = -(-max(MIN_PARTITION, -(-lmax // want)) // 32) * 32
    return -(-lmax // part)


def _cluster(kc: KernelConfig, s: int, nkv: int, g: int, hd: int) -> int:
    """Cluster size of ``rope_paged_attention``'s merge through distributed shared memory for S
    sequences (0: attn_merge): ``kc.attn_cluster`` where it is one of ``CLUSTER_SIZES``, clusters
    can be launched, each block gets whole warps of the G hd outputs of a KV head, and S nkv
    clusters do not exceed the two blocks per multiprocessor that ``_decode_split`` aims at."""
    c = kc.attn_cluster
    if (c not in CLUSTER_SIZES or (g * hd) % (32 * c) or s * nkv * c > 2 * sm_count()
            or not clusters_available()):
        return 0
    return c


def decode_applies(q_lens: np.ndarray, nh: int, nkv: int, hd: int) -> bool:
    """Whether ``attn_decode`` serves the batch: one new token per sequence (at least one
    sequence), a GQA group of at most ``MAX_GROUP`` and a head dim in ``HEAD_DIMS``."""
    return (q_lens.size > 0 and bool((q_lens == 1).all()) and nh // nkv <= MAX_GROUP
            and hd in HEAD_DIMS)


def verify_applies(kc: KernelConfig, q_lens: np.ndarray, nh: int, nkv: int, hd: int) -> bool:
    """Whether a pass of at most ``kc.verify_rows`` query rows a sequence (more than one
    somewhere: a verify pass) goes to ``attn_decode``, each row as a one-row sequence."""
    return (q_lens.size > 0 and 1 < int(q_lens.max()) <= kc.verify_rows
            and nh // nkv <= MAX_GROUP and hd in HEAD_DIMS)


def _rows_as_sequences(fn, cu: cp.ndarray, lens: cp.ndarray, block_tables: cp.ndarray,
                       rows: int) -> tuple[cp.ndarray, cp.ndarray, cp.ndarray]:
    """Device (cu, lens, block tables) of ``rows`` one-row sequences, one per query row of
    the batch, computed on the device by ``fn`` (``attention.cu`` ``attn_rows``), so a CUDA
    graph recomputes them from its static inputs at every replay."""
    width = block_tables.shape[1]
    cu_v = cp.empty((rows + 1,), dtype=cp.int32)
    lens_v = cp.empty((rows,), dtype=cp.int32)
    bt_v = cp.empty((rows, width), dtype=cp.int32)
    launch(fn, (rows,), (128,), (
        cu, lens, block_tables, np.int32(width), np.int32(lens.shape[0]), cu_v, lens_v, bt_v))
    return cu_v, lens_v, bt_v


def rope_paged_attention(kc: KernelConfig, qkv: cp.ndarray, nq: int, positions: cp.ndarray,
                         inv_freq: cp.ndarray, style: int, rotary_dim: int, slots: cp.ndarray,
                         k_cache: cp.ndarray, v_cache: cp.ndarray, lens_host: np.ndarray,
                         cu: cp.ndarray, lens: cp.ndarray, block_tables: cp.ndarray, scale: float,
                         merge_kernel: bool = False,
                         shadow_out: tuple | None = None,
                         kv_dtype: str | None = None, norm: tuple | None = None,
                         gated: bool = False) -> cp.ndarray:
    """Decode attention straight from the fused (S, (nq + 2 nkv) hd) q | k | v rows (one new
    token per sequence, ``decode_applies``; rows may be strided): RoPE of q and of the new k
    (``style`` 0 rotate-half / 1 adjacent, ``rotary_dim`` dims, int32 device ``positions``,
    ``inv_freq`` (rotary_dim / 2,)), the new k and v written at int64 device ``slots`` of the
    caches (negative: skipped; the slot must be position ``lens - 1`` of the block table), and
    the attention over the paged caches, in one kernel (``attn_decode<HD, G, true, true>``); with
    ``merge_kernel`` the split partials are merged by ``attn_merge`` launched after it
    (``attn_decode<HD, G, true, false>``) instead of by the last block of each KV head, or,
    where ``_cluster`` gives a cluster size, through distributed shared memory by the kernel's
    thread block clusters (``attn_decode<HD, G, true, true, CL>``; one kernel). Returns
    a new (S, nq, hd) float32 array, bit-identical to ``rope_write_kv`` then
    ``paged_attention`` (float16 caches included: the new k / v are attended to as stored,
    rounded to fp16). The kernel reads ``positions``, ``lens``, ``cu``, ``block_tables``,
    ``slots``, ``inv_freq`` and the cached rows before L - 1 before ``griddepcontrol.wait``
    (while the kernel before it runs): no PDL-launched kernel of the pass may write them (they
    are host uploads and rows of earlier passes).

    A rk ``kv_dtype`` (uint8 rows, ``elementwise.kv_type``): the kernel rotates q and
    quantizes the new k / v as ``kv_codec``, the output is rotated back after it (no shadow).

    The gated attention (Qwen3.5): ``norm`` ``(q_norm, k_norm, eps)`` (float32 (hd,) weights):
    the q and k heads are RMS-normalised before RoPE (``norm_rope_write_kv``'s floats);
    ``gated``: the rows are (S, 2 nq hd + 2 nkv hd), each q head followed by its output gate, and
    the output is ``sigmoid_mul``'s of the attention and the gate, bit-identical to
    ``norm_rope_write_kv``, ``paged_attention`` and ``sigmoid_mul`` (the clusters' merge, which
    partitions the context otherwise: within float32) (no rk ``kv_dtype``: its output is rotated
    back after the kernel).

    ``shadow_out`` (where ``merge_shadow`` says so for the same arguments): ``(shadow, sch)``:
    ``attn_merge`` (or the clusters' merge) also writes the output as a q8 shadow
    (``gpu.linear.new_shadow(nq hd)``) for a consumer GEMV of weight scheme ``sch`` (the o
    projection).

    Raises:
        ValueError: more (sequences x KV heads) than ``MAX_COUNTERS`` (without
            ``merge_kernel``), ``qkv`` not (S, (nq (2 if ``gated``) + 2 nkv) hd), a
            ``shadow_out`` where ``merge_shadow`` says no, or ``gated`` with a rk ``kv_dtype``.
    """
    s = lens_host.shape[0]
    page_size, nkv, hd = k_cache.shape[1], k_cache.shape[2], kv_head_dim(k_cache, kv_dtype)
    kt = kv_type(k_cache, v_cache, kv_dtype)
    if (shadow_out is not None or gated) and kv_dtype in RK_TYPES:
        raise ValueError("rope_paged_attention: no q8 shadow or output gate under a rk KV dtype")
    if s * nkv > MAX_COUNTERS and not merge_kernel:
        raise ValueError(f"{s} sequences x {nkv} KV heads > {MAX_COUNTERS} arrival counters")
    qhs = 2 * hd if gated else hd   # a q head's columns (gated: then its gate's)
    width = nq * qhs + 2 * nkv * hd
    if qkv.ndim != 2 or qkv.shape != (s, width):
        raise ValueError(f"qkv {qkv.shape}: expected ({s}, {width})")
    if shadow_out is not None and not merge_shadow(kc, s, nq, nkv, hd, lens_host, merge_kernel):
        raise ValueError("rope_paged_attention: no q8 shadow for this batch")
    qkv = _as_rows(qkv)
    ldx = _row_stride(qkv, width) if s > 1 else width
    out = cp.empty((s, nq, hd), dtype=cp.float32)
    splits = _decode_split(s, nkv, int(lens_host.max()))
    cl = _cluster(kc, s, nkv, nq // nkv, hd) if merge_kernel else 0
    if cl:   # whole clusters, at least one
        splits = -(-splits // cl) * cl
    part_o = cp.empty((s * nq * splits * hd,), dtype=cp.float32) if splits > 1 else out
    part_ml = cp.empty((s * nq * splits * 2,), dtype=cp.float32) if splits > 1 else out
    qo, qsch = shadow_out if shadow_out is not None else (NULL, 0)
    qw, kw, eps = norm if norm is not None else (NULL, NULL, 0.0)
    gate = qkv[:, hd:] if gated else NULL   # (a view: the kernel reads it at ldx, head stride qhs)
    if cl:
        name = f"attn_decode<{kt},{hd},{nq // nkv},true,true,{cl}>"
    else:
        name = f"attn_decode<{kt},{hd},{nq // nkv},true,{'false' if merge_kernel else 'true'}>"
    ring = decode_ring_bytes(k_cache, v_cache)
    launch(_with_ring(_fn(kc, hd, kt, name), ring), (s, nkv, splits), (128,), (
        qkv, np.int32(ldx), k_cache, v_cache, cu, lens, block_tables,
        np.int32(block_tables.shape[1]), np.int32(page_size), np.int32(nkv), np.float32(scale),
        np.int32(PART_GRANULE), np.int32(splits), out, np.int32(nq * hd), part_o, part_ml,
        positions, inv_freq, np.int32(rotary_dim), np.int32(style), slots, k_cache, v_cache,
        _arrivals(), qo if cl else NULL, np.int32(qsch if cl else 0),
        np.int32(kc.cluster_part_cap), gate, np.int32(qhs), np.int32(nq * qhs), qw, kw,
        np.float32(eps)), shared_mem=ring, cluster=cl, pdl=kc.pdl)
    if merge_kernel and splits > 1 and not cl:
        launch(_fn(kc, hd, kt, "attn_merge"), (s, nq), (min(hd, 128),), (
            part_o, part_ml, cu, lens, out, np.int32(nq * hd), np.int32(nq), np.int32(hd),
            np.int32(splits), np.int32(PART_GRANULE), qo, np.int32(qsch), gate, np.int32(ldx),
            np.int32(qhs)), pdl=kc.pdl)
    if kv_dtype in RK_TYPES:   # back from the pages' rotated domain
        hadamard_rows(kc, hd, kt, out, out)
    return out


def merge_shadow(kc: KernelConfig, s: int, nq: int, nkv: int, hd: int, lens_host: np.ndarray,
                 merge_kernel: bool) -> bool:
    """Whether ``rope_paged_attention`` with these arguments can write a q8 shadow of its
    output: one sequence, nq hd a multiple of 64, and either the clusters' merge (``_cluster``)
    or ``attn_merge`` launched (``merge_kernel`` and more than one split) with one block of hd
    threads per head, hd a multiple of 32."""
    if not (s == 1 and merge_kernel and (nq * hd) % 64 == 0):
        return False
    if _cluster(kc, s, nkv, nq // nkv, hd):
        return True
    return hd % 32 == 0 and hd <= 128 and _decode_split(s, nkv, int(lens_host.max())) > 1


def paged_attention(kc: KernelConfig, q: cp.ndarray, k_cache: cp.ndarray, v_cache: cp.ndarray,
                    cu_host: np.ndarray, lens_host: np.ndarray, cu: cp.ndarray,
                    lens: cp.ndarray, block_tables: cp.ndarray, scale: float,
                    kv_dtype: str | None = None, gate: cp.ndarray | None = None) -> cp.ndarray:
    """Attention of (T, nh, hd) ``q`` (rows may be strided) over the paged caches.

    ``cu``/``lens``/``block_tables`` are int32 device copies of the host ``cu_host``/``lens_host``
    and the block table (validated by the caller). The caches are float32 or float16, or int8
    rows (``elementwise.kv_type``; read as float, int8 codes times their group's fp16 scale,
    straight from the pages; attention in float32), or a rk ``kv_dtype``'s uint8 rows (q
    rotated first, the pages read as code times scale, the output rotated back). Returns a new
    (T, nh, hd) float32 array.

    ``gate`` (the gated attention's, else None): a (T, nh, hd) float32 view (the gate halves of
    its q | gate rows): the output times sigmoid of it, as ``gdn.sigmoid_mul``, by
    ``attn_merge`` where it merges a decode or verify pass's splits (no kernel of its own;
    not under a rk ``kv_dtype``), else by ``sigmoid_mul`` after.

    Raises:
        ValueError: caches of another dtype (``elementwise.kv_type``).
        NotImplementedError: head dim not in ``HEAD_DIMS`` or a group larger than ``MAX_GROUP``
            on the decode path.
    """
    t, nh, hd = q.shape
    page_size, nkv = k_cache.shape[1], k_cache.shape[2]
    g = nh // nkv
    kt = kv_type(k_cache, v_cache, kv_dtype)
    if hd not in HEAD_DIMS:
        raise NotImplementedError(f"head dim {hd} (supported: {HEAD_DIMS})")
    rk = kv_dtype in RK_TYPES
    if rk:   # q into the pages' rotated domain; the output comes back from it at the end
        if hd % 64:
            raise ValueError(f"{kv_dtype} KV needs a head dim that is a multiple of 64, not {hd}")
        q = hadamard_rows(kc, hd, kt, q)
    if q.strides[2] != 4 or q.strides[1] != hd * 4:
        q = cp.ascontiguousarray(q)
    ldq = q.strides[0] // 4 if t > 1 else nh * hd
    s = lens_host.shape[0]
    out = cp.empty((t, nh, hd), dtype=cp.float32)
    if int(cu_host[-1]) < t:
        out[int(cu_host[-1]):] = 0
    q_lens = np.diff(cu_host)
    bt_stride = np.int32(block_tables.shape[1])
    rows = not decode_applies(q_lens, nh, nkv, hd) and verify_applies(kc, q_lens, nh, nkv, hd)
    # a verify pass: each sequence's KV read once for all its rows (attn_verify), where it applies
    vring = (verify_ring_bytes(k_cache, v_cache) if rows and kc.verify_shared_kv
             and int(q_lens.max()) <= VERIFY_MAX_ROWS else 0)
    if rows or decode_applies(q_lens, nh, nkv, hd):
        common = (q, np.int32(ldq), k_cache, v_cache)
        seqs = s   # sequences of the partials and the merge: with rows, one a query row
        if rows:   # (attn_rows is type-agnostic: it is taken from the module the attention
            # launch below uses, so no other module is compiled)
            seqs = int(cu_host[-1])
            cu_r, lens_r, bt_r = _rows_as_sequences(_fn(kc, hd, kt, "attn_rows"), cu, lens,
                                                    block_tables, seqs)
            if not vring:   # the attention itself over one-row sequences
                s, cu, lens, block_tables = seqs, cu_r, lens_r, bt_r
        splits = _decode_split(s, nkv, int(lens_host.max()))
        if splits > 1:
            part_o = cp.empty((seqs * nh * splits * hd,), dtype=cp.float32)
            part_ml = cp.empty((seqs * nh * splits * 2,), dtype=cp.float32)
        else:
            part_o = part_ml = out
        common += (cu, lens, block_tables, bt_stride, np.int32(page_size), np.int32(nkv),
                   np.float32(scale), np.int32(PART_GRANULE), np.int32(splits), out,
                   np.int32(nh * hd), part_o, part_ml)
        if vring:
            launch(_with_ring(_fn(kc, hd, kt, f"attn_verify<{kt},{hd},{g}>"), vring),
                   (s, nkv, splits), (32 * int(q_lens.max()),), common, shared_mem=vring,
                   pdl=kc.pdl)
        else:
            ring = decode_ring_bytes(k_cache, v_cache)
            launch(_with_ring(_fn(kc, hd, kt, f"attn_decode<{kt},{hd},{g},false,false>"), ring),
                   (s, nkv, splits), (128,), common + (
                cu, out, np.int32(0), np.int32(0), cu, out, out, cu, NULL, np.int32(0),
                np.int32(0), NULL, np.int32(hd), np.int32(0), NULL, NULL, np.float32(0)),
                shared_mem=ring, pdl=kc.pdl)   # (ROPE's: unused)
        merged = (splits > 1 and gate is not None and not rk and gate.dtype == cp.float32
                  and gate.strides[2] == 4)   # the gate applied where the splits merge
        if splits > 1:
            launch(_fn(kc, hd, kt, "attn_merge"), (seqs, nh), (min(hd, 128),), (
                part_o, part_ml, cu_r if rows else cu, lens_r if rows else lens, out,
                np.int32(nh * hd), np.int32(nh), np.int32(hd), np.int32(splits),
                np.int32(PART_GRANULE), NULL, np.int32(0), gate if merged else NULL,
                np.int32(gate.strides[0] // 4 if merged else 0),
                np.int32(gate.strides[1] // 4 if merged else 0)),
                pdl=kc.pdl and not rows)   # (it reads lens before its wait: attn_rows wrote them)
        return _gated(kc, hadamard_rows(kc, hd, kt, out, out) if rk else out,
                      None if merged else gate)
    aligned = k_cache.data.ptr % 16 == 0 and v_cache.data.ptr % 16 == 0
    wg = (kc.prefill_attention == "wgmma" and aligned and kt == "unsigned short"
          and hd in WGMMA_HEAD_DIMS and sm90a())
    mma = kc.prefill_attention in ("mma", "wgmma") and aligned and not wg
    bc, _, _, nw = _prefill_mma_tiling(kc, hd)
    br = WGMMA_BR if wg else 16 * nw if mma else _PREFILL_BR
    n_tiles, tiles_d = _prefill_tiles(np.asarray(q_lens, np.int64).tobytes(),
                                      np.asarray(lens_host, np.int64).tobytes(), g, br)
    if not n_tiles:
        return _gated(kc, out, gate)
    if wg:
        return _gated(kc, _prefill_wgmma(q, ldq, k_cache, v_cache, cu, lens, block_tables,
                                         bt_stride, page_size, nkv, g, scale, n_tiles, tiles_d,
                                         out, nh, hd), gate)
    if mma:
        name, smem = _prefill_mma_launch(kc, hd, kt)
        fn = _fn(kc, hd, kt, name)
    else:
        fn = _fn(kc, hd, kt, f"attn_prefill<{kt},{hd}>")
        qp = hd + 1
        smem = 4 * (_PREFILL_BR * qp + 32 * qp + 32 * hd + _PREFILL_BR * 33)
        nw = 4
    if smem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem
    fn((n_tiles, nkv), (32 * nw,), (
        q, np.int32(ldq), k_cache, v_cache, cu, lens, block_tables, bt_stride,
        np.int32(page_size), np.int32(nkv), np.int32(g), np.float32(scale), tiles_d, out,
        np.int32(nh * hd)), shared_mem=smem)
    return _gated(kc, hadamard_rows(kc, hd, kt, out, out) if rk else out, gate)


def _prefill_wgmma(q, ldq, k_cache, v_cache, cu, lens, block_tables, bt_stride, page_size,
                   nkv, g, scale, n_tiles, tiles_d, out, nh, hd):
    """``attn_prefill_wgmma`` (``attention_wgmma.cu``) over fp16 pages: blocks of ``WGMMA_BR``
    rows (and a loading warpgroup), one a tile of ``tiles_d`` and KV head."""
    fn = function_sm90a("attention_wgmma", f"attn_prefill_wgmma<{hd}>",
                        tuple(f"attn_prefill_wgmma<{d}>" for d in WGMMA_HEAD_DIMS))
    # Q, then K and V twice, and 1,024 bytes to align the swizzle's atoms
    smem = 2 * WGMMA_BR * hd + 4 * WGMMA_BC * hd * 2 + WGMMA_BARS + 1024
    _with_ring(fn, smem)((n_tiles, nkv), (WGMMA_THREADS,), (
        q, np.int32(ldq), k_cache, v_cache, cu, lens, block_tables, bt_stride,
        np.int32(page_size), np.int32(nkv), np.int32(g), np.float32(scale), tiles_d, out,
        np.int32(nh * hd)), shared_mem=smem)
    return out


def _gated(kc: KernelConfig, out: cp.ndarray, gate: cp.ndarray | None) -> cp.ndarray:
    """(T, nh, hd) ``out`` times sigmoid of ``gate`` (``gdn.sigmoid_mul``), or ``out`` itself
    where there is none (or it was applied already)."""
    if gate is None:
        return out
    t, nh, hd = out.shape
    return sigmoid_mul(out.reshape(t, nh * hd), gate, pdl=kc.pdl).reshape(t, nh, hd)


def drop_prefill_tiles() -> None:
    """Forget the kept tile lists, so that the next pass uploads its own: a prefill graph's
    warm-up then makes the list its capture reads in that graph's private pool, which no later
    allocation shares (a list from the default pool would be freed once the cache drops it)."""
    _prefill_tiles.cache_clear()


@functools.lru_cache(maxsize=8)
def _prefill_tiles(q_lens: bytes, lens: bytes, g: int, br: int) -> tuple[int, cp.ndarray | None]:
    """(count, int32 device (sequence, first row) pairs) of a prefill batch's tiles of ``br``
    rows (int64 ``q_lens`` / context ``lens`` bytes), heaviest first: the last rows of a
    sequence see the most positions, so the multiprocessors are not left waiting on a few long
    blocks at the end of the grid. Kept for the batch's later layers (one sort and one upload a
    pass, not a layer)."""
    ql, cl = np.frombuffer(q_lens, np.int64), np.frombuffer(lens, np.int64)
    tiles = sorted(((i, r0) for i in range(ql.shape[0]) for r0 in range(0, int(ql[i]) * g, br)),
                   key=lambda tile: int(cl[tile[0]]) - int(ql[tile[0]]) + (tile[1] + br) // g,
                   reverse=True)
    if not tiles:
        return 0, None
    return len(tiles), cp.asarray(np.asarray(tiles, dtype=np.int32).reshape(-1))


def slots_at_last_position(slot_mapping, context_lens, block_tables, page_size: int) -> bool:
    """Whether every non-negative slot of a decode batch is its sequence's position
    ``context_len - 1`` in its block table (the fused kernel takes that position's k / v
    from the new row instead of the cache). A few vectorised operations on (S,) arrays; a
    captured graph replays the kernel without this check: the engine's decode slots are
    always that position."""
    slots = np.asarray(slot_mapping, dtype=np.int64)
    last = np.asarray(context_lens, dtype=np.int64) - 1
    bt = np.asarray(block_tables)
    if not (last.shape == slots.shape and (last >= 0).all()
            and (last // page_size < bt.shape[1]).all()):
        return False
    page = bt[np.arange(last.shape[0]), last // page_size].astype(np.int64)
    return bool(((slots < 0) | (slots == page * page_size + last % page_size)).all())

"""RMSNorm, RoPE, SwiGLU core, embedding gather and paged KV write on the GPU (``elementwise.cu``).

Each function has the semantics of the NumPy reference of the same name (``ninfer.kernels.norm``,
``rope``, ``activation``, ``embedding``, ``attention.write_kv``); arrays are float32 CuPy arrays
whose last axis (or last two, for head-shaped arrays) is contiguous; rows may be strided.
"""
from __future__ import annotations

import cupy as cp
import numpy as np

from ninfer.kernels.gpu import function
from ninfer.kernels.gpu.launch import NULL, launch


# template argument of the KV kernels per cache dtype (T of elementwise.cu / attention.cu:
# float, fp16 bits as unsigned short, or int8 rows (kvq8: hd codes, then hd / 64 fp16 scales'
# bytes) as signed char)
KV_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float16): "unsigned short",
            np.dtype(np.int8): "signed char"}
# the rk modes' template argument (kvrk<KK>, KK the K codec of common.cuh: RK_INT8, RK_INT4,
# RK_E8, RK_E8ROOT; V is int4) and K code bits per dim; their pages stay uint8 (kv_codec rows)
RK_TYPES = {"rk8v4": "kvrk<0>", "rk4v4": "kvrk<1>", "rk4v4-e8": "kvrk<2>", "rk2v4-e8": "kvrk<3>"}
_RK_BITS = {"rk8v4": (8, 4), "rk4v4": (4, 4), "rk4v4-e8": (4, 4), "rk2v4-e8": (2, 4)}
_KV_KERNELS = ("rope_write_kv", "norm_rope_write_kv", "write_kv")
_NAMES = tuple(f"{k}<{t}>" for k in _KV_KERNELS for t in KV_TYPES.values())
# a rk mode's writers, in a module of their own: compiled only where a cache uses the mode
_RK_NAMES = {t: tuple(f"{k}<{t}>" for k in _KV_KERNELS) for t in RK_TYPES.values()}


def _fn(fname: str):
    rk = next((names for t, names in _RK_NAMES.items() if fname.endswith(f"<{t}>")), None)
    return function("elementwise", fname, rk or _NAMES)


def kv_type(k_cache: cp.ndarray, v_cache: cp.ndarray, kv_dtype: str | None = None) -> str:
    """The KV kernels' template argument for the caches' element type ("float" for float32
    pages, "unsigned short" for float16, "signed char" for int8 rows), or for a rk
    ``kv_dtype``'s uint8 rows (``RK_TYPES``).

    Raises:
        ValueError: K and V pages of different dtypes, or a dtype other than those three (rk:
            pages that are not uint8).
    """
    if kv_dtype in RK_TYPES:
        if k_cache.dtype != np.uint8 or v_cache.dtype != np.uint8:
            raise ValueError(f"{kv_dtype} KV pages must both be uint8 rows, got "
                             f"{k_cache.dtype} / {v_cache.dtype}")
        return RK_TYPES[kv_dtype]
    if k_cache.dtype != v_cache.dtype or np.dtype(k_cache.dtype) not in KV_TYPES:
        raise ValueError(f"KV pages must both be float32 or both float16 (or both int8 rows), "
                         f"got {k_cache.dtype} / {v_cache.dtype}")
    return KV_TYPES[np.dtype(k_cache.dtype)]


def kv_head_dim(cache: cp.ndarray, kv_dtype: str | None = None, v: bool = False) -> int:
    """The head dim of (num_pages, page_size, nkv, width) pages: the width, or for int8 rows
    (hd codes, then hd / 64 fp16 scales: width = 33 hd / 32) hd, or for a rk ``kv_dtype``'s K
    (V where ``v``) rows of b code bits per dim (width = hd b / 8 + hd / 32) hd."""
    w = int(cache.shape[-1])
    if kv_dtype in RK_TYPES:
        return 32 * w // (4 * _RK_BITS[kv_dtype][int(v)] + 1)
    return w * 32 // 33 if cache.dtype == np.int8 else w


def _row_stride(x: cp.ndarray, inner: int) -> int:
    """Element stride between rows of ``x`` (leading axis) whose trailing ``inner`` elements
    are contiguous; raises ValueError when they are not."""
    if x.dtype != cp.float32:
        raise ValueError(f"expected float32, got {x.dtype}")
    expect = 4
    for dim, st in zip(reversed(x.shape[1:]), reversed(x.strides[1:])):
        if dim > 1 and st != expect:
            raise ValueError("inner axes must be contiguous")
        expect *= dim
    return x.strides[0] // 4 if x.shape[0] > 1 else inner


def _as_rows(x: cp.ndarray) -> cp.ndarray:
    """``x`` with contiguous inner axes (a copy only when they are not)."""
    try:
        _row_stride(x, int(np.prod(x.shape[1:])))
        return x
    except ValueError:
        return cp.ascontiguousarray(x, dtype=cp.float32)


def rms_norm(x: cp.ndarray, w: cp.ndarray, eps: float, unit_offset: bool = False,
             f16: bool = False) -> cp.ndarray:
    """(T, H) float32 -> new (T, H): x / sqrt(mean(x^2) + eps) * w (or ``* (1 + w)``); with
    ``f16`` as float16 (the float32 result rounded to nearest even, as ``astype`` rounds)."""
    shape = x.shape
    h = shape[-1]
    x2 = _as_rows(x.reshape(-1, h) if x.ndim != 2 else x)
    ld = _row_stride(x2, h)
    h4 = h // 4
    if (x2.shape[0] and h % 4 == 0 and ld % 4 == 0 and x2.data.ptr % 16 == 0
            and w.data.ptr % 16 == 0 and h4 <= 4096 and w.flags.c_contiguous):
        out = cp.empty((x2.shape[0], h), dtype=cp.float16 if f16 else cp.float32)
        threads = min(1024, -(-h4 // 32) * 32)
        nv = -(-h4 // threads)
        nv = 1 if nv == 1 else (2 if nv == 2 else 4)
        _fn(f"rms_norm4{'h' if f16 else ''}_{nv}")((x2.shape[0],), (threads,), (
            x2, np.int32(ld // 4), w, out, np.int32(h4), np.float32(eps),
            np.int32(1 if unit_offset else 0), np.float32(1.0 / h)))
        return out.reshape(shape)
    out = cp.empty((x2.shape[0], h), dtype=cp.float32)
    if x2.shape[0]:
        _fn("rms_norm")((x2.shape[0],), (256,), (
            x2, np.int32(_row_stride(x2, h)), w, out, np.int32(h), np.float32(eps),
            np.int32(1 if unit_offset else 0)))
    return (out.astype(cp.float16) if f16 else out).reshape(shape)


# argmax_rows: columns per block (AM_THREADS x AM_LOADS of elementwise.cu) and the per-row
# arrival counters of its last-block reduction, one buffer per device for the process (from the
# default memory pool, never freed, zero between launches; a larger one for more rows). Launches of
# argmax_rows on different streams at once must not share a device (as the decode attention's).
ARGMAX_COLS_PER_BLOCK = 2048
ARGMAX_MAX_BLOCKS = 256
_am_counters: dict[int, list] = {}


def argmax_counters(s: int) -> cp.ndarray:
    """The arrival counters of ``argmax_rows`` for at least ``s`` rows: a uint32 device array
    (allocated, zeroed, on first use: call it before a graph capture that runs
    ``argmax_rows``). A larger ``s`` gets a larger buffer; the smaller ones stay allocated
    (captured graphs keep their address)."""
    dev = cp.cuda.Device().id
    bufs = _am_counters.setdefault(dev, [])
    if not bufs or bufs[-1].size < s:
        with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):
            bufs.append(cp.zeros(max(s, 4096), dtype=cp.uint32))
    return bufs[-1]


def argmax_rows(x: cp.ndarray, out32: cp.ndarray | None = None) -> cp.ndarray:
    """(S,) int64 index of the largest value of each row of (S, V) float32 ``x`` (first index on
    ties, -0 equal to +0; NaN counts as largest, as ``numpy.argmax``); rows may be strided,
    columns must be contiguous. One launch: ``ceil(V / ARGMAX_COLS_PER_BLOCK)`` blocks a row
    (at most ``ARGMAX_MAX_BLOCKS``), the last of them reducing the others' bests. ``out32``: a
    contiguous (S,) int32 device array that also gets the indices (V > 0). Launches on two
    streams of one device at once share the arrival counters: not supported (the engine and
    the graphs use one stream).

    Raises:
        ValueError: not float32 or strided columns (S, V > 0), or an ``out32`` of another
            shape or dtype.
    """
    if out32 is not None and (out32.dtype != cp.int32 or out32.shape != (x.shape[0],)
                              or not out32.flags.c_contiguous):
        raise ValueError(f"argmax_rows: out32 must be ({x.shape[0]},) int32, contiguous")
    s, v = x.shape
    out = cp.empty((s,), dtype=cp.int64) if v else cp.zeros((s,), dtype=cp.int64)
    if s and v:
        nb = max(1, min(ARGMAX_MAX_BLOCKS, -(-v // ARGMAX_COLS_PER_BLOCK)))
        part = cp.empty((s * nb,), dtype=cp.uint64)
        _fn("argmax_rows")((s, nb), (256,), (x, np.int64(_row_stride(x, v)), np.int32(v), out,
                                             part, argmax_counters(s),
                                             out32 if out32 is not None else NULL))
    return out


def rope(x: cp.ndarray, positions: cp.ndarray, inv_freq: cp.ndarray, style: int,
         rotary_dim: int) -> cp.ndarray:
    """Rotate (T, n, hd) ``x`` by int32 device ``positions`` (T,) with device ``inv_freq``
    (rotary_dim / 2,); style 0 = half, 1 = adjacent. Returns a new contiguous (T, n, hd)."""
    t, n, hd = x.shape
    x = _as_rows(x)
    out = cp.empty((t, n, hd), dtype=cp.float32)
    if t:
        threads = max(32, min(256, -(-max(rotary_dim // 2, hd - rotary_dim) // 32) * 32))
        _fn("rope")((t * n,), (threads,), (
            x, np.int32(_row_stride(x, n * hd)), positions, inv_freq, out, np.int32(n),
            np.int32(hd), np.int32(rotary_dim), np.int32(style)))
    return out


def rope_write_kv(qkv: cp.ndarray, nq: int, nk: int, hd: int, positions: cp.ndarray,
                  inv_freq: cp.ndarray, style: int, rotary_dim: int, k_cache: cp.ndarray,
                  v_cache: cp.ndarray, slots: cp.ndarray, pdl: bool = True,
                  kv_dtype: str | None = None) -> cp.ndarray:
    """RoPE of the q and k heads of (T, (nq + 2 nk) hd) ``qkv`` (rows may be strided), k
    (rotated) and v written at int64 device ``slots`` of the paged caches (negative: skipped).
    Returns the rotated q as a new contiguous (T, nq, hd). ``pdl``: see ``gpu.launch``. The
    caches are float32 or float16 (``kv_type``; stored rounded to nearest even), or int8 rows
    (each 64-dim group quantized as ``kv_codec``'s int8; hd <= 512), or a rk ``kv_dtype``'s
    rows (rotated and quantized as ``kv_codec``'s; hd <= 512)."""
    t = qkv.shape[0]
    x = _as_rows(qkv)
    q = cp.empty((t, nq, hd), dtype=cp.float32)
    if (k_cache.dtype == np.int8 or kv_dtype in RK_TYPES) and hd > 512:
        raise ValueError(f"quantized KV rows of head dim {hd} > 512")
    if t:
        threads = max(32, min(256, -(-max(rotary_dim // 2, hd - rotary_dim) // 32) * 32))
        kt = kv_type(k_cache, v_cache, kv_dtype)
        launch(_fn(f"rope_write_kv<{kt}>"), (t, nq + nk + 1), (threads,), (
            x, np.int32(_row_stride(x, (nq + 2 * nk) * hd)), positions, inv_freq, slots, q,
            k_cache, v_cache, np.int32(nq), np.int32(nk), np.int32(hd), np.int32(rotary_dim),
            np.int32(style)), pdl=pdl)
    return q


def norm_rope_write_kv(qkv: cp.ndarray, nq: int, nk: int, hd: int, gated_q: bool,
                       q_norm: cp.ndarray, k_norm: cp.ndarray, eps: float,
                       positions: cp.ndarray, inv_freq: cp.ndarray, style: int, rotary_dim: int,
                       k_cache: cp.ndarray, v_cache: cp.ndarray, slots: cp.ndarray,
                       pdl: bool = True, kv_dtype: str | None = None) -> cp.ndarray:
    """RMSNorm and RoPE of the q and k heads of (T, nq (2 if ``gated_q`` else 1) hd + 2 nk hd)
    ``qkv`` (rows may be strided), k and v written at int64 device ``slots`` of the paged caches
    (negative: skipped); hd <= 512. Returns q as a new contiguous (T, nq, hd). The caches are
    float32, float16 or int8 rows, or a rk ``kv_dtype``'s rows (``kv_type``)."""
    t = qkv.shape[0]
    x = _as_rows(qkv)
    q = cp.empty((t, nq, hd), dtype=cp.float32)
    if t:
        kcol = nq * hd * (2 if gated_q else 1)
        f32 = lambda a: cp.ascontiguousarray(a, dtype=cp.float32)  # noqa: E731
        launch(_fn(f"norm_rope_write_kv<{kv_type(k_cache, v_cache, kv_dtype)}>"), (t, nq + nk + 1),
               (128,), (
            x, np.int32(_row_stride(x, kcol + 2 * nk * hd)), np.int32(gated_q), np.int32(kcol),
            f32(q_norm), f32(k_norm), np.float32(eps), positions, inv_freq, slots, q, k_cache,
            v_cache, np.int32(nq), np.int32(nk), np.int32(hd), np.int32(rotary_dim),
            np.int32(style)), pdl=pdl)
    return q


def silu_mul(gate: cp.ndarray, up: cp.ndarray, f16: bool = False) -> cp.ndarray:
    """silu(gate) * up for (T, I) arrays (rows may be strided); new contiguous (T, I), float16
    with ``f16`` (the float32 result rounded to nearest even)."""
    t, i = gate.shape
    gate, up = _as_rows(gate), _as_rows(up)
    out = cp.empty((t, i), dtype=cp.float16 if f16 else cp.float32)
    n = t * i
    if n:
        blocks = min(-(-n // 256), 4096)
        _fn("silu_mul_h" if f16 else "silu_mul")((blocks,), (256,), (
            gate, np.int32(_row_stride(gate, i)), up, np.int32(_row_stride(up, i)), out,
            np.int32(t), np.int32(i)))
    return out


def quant_rows_e4m3(x16: cp.ndarray) -> tuple[cp.ndarray, cp.ndarray]:
    """(T, K) contiguous float16 (K % 8 == 0) -> new (T, K) uint8 e4m3 codes and (T,) float32
    row scales (the row's largest |x| / 448, 1 for a row of zeros): codes = e4m3(x * (1 /
    scale)), rounded to nearest even."""
    t, k = x16.shape
    if k % 8 or not x16.flags.c_contiguous or x16.data.ptr % 16:
        raise ValueError(f"quant_rows_e4m3: ({t}, {k}) needs K % 8 == 0, aligned C order")
    q = cp.empty((t, k), dtype=cp.uint8)
    scale = cp.empty((t,), dtype=cp.float32)
    if t:
        _fn("quant_rows_e4m3")((t,), (256,), (x16, q, scale, np.int32(k)))
    return q, scale


def silu_mul_e4m3(gu: cp.ndarray) -> tuple[cp.ndarray, cp.ndarray]:
    """(T, 2 I) contiguous bf16 bits (uint16: gate | up, I % 8 == 0) -> new (T, I) uint8 e4m3
    codes of silu(gate) * up and (T,) float32 row scales, as ``quant_rows_e4m3`` (the values
    in float32 from the bf16 inputs, never stored)."""
    t, i2 = gu.shape
    i = i2 // 2
    if gu.dtype != cp.uint16 or i2 % 16 or not gu.flags.c_contiguous or gu.data.ptr % 16:
        raise ValueError(f"silu_mul_e4m3: ({t}, {i2}) {gu.dtype} needs bf16 bits, 2 I % 16 "
                         f"== 0, aligned C order")
    q = cp.empty((t, i), dtype=cp.uint8)
    scale = cp.empty((t,), dtype=cp.float32)
    if t:
        _fn("silu_mul_e4m3")((t,), (512,), (gu, q, scale, np.int32(i)))
    return q, scale


def to_f16(x: cp.ndarray) -> cp.ndarray:
    """(T, I) rows (strided float32 as they are, others through a float32 copy) -> new
    contiguous (T, I) float16, each value rounded to nearest even as ``astype`` rounds."""
    t, i = x.shape
    x = _as_rows(x)
    out = cp.empty((t, i), dtype=cp.float16)
    n = t * i
    if n:
        _fn("cast_h")((min(-(-n // 256), 4096),), (256,),
                      (x, np.int32(_row_stride(x, i)), out, np.int32(t), np.int32(i)))
    return out


def embedding(w, ids: cp.ndarray, h: int) -> cp.ndarray:
    """Rows ``ids`` (int32 device, (T,)) of ``w`` (float32 array or packed q4/q8
    ``gpu.linear.GpuWeight``) as a new (T, H) float32 array. Ids must already be range-checked."""
    if not isinstance(w, cp.ndarray):
        from ninfer.kernels.gpu import linear as glin
        return glin.embedding(w, ids)
    t = ids.shape[0]
    out = cp.empty((t, h), dtype=cp.float32)
    if t:
        _fn("embed_f32")((t,), (min(256, -(-h // 32) * 32),), (w, ids, out, np.int32(h)))
    return out


def write_kv(k_cache: cp.ndarray, v_cache: cp.ndarray, k: cp.ndarray, v: cp.ndarray,
             slots: cp.ndarray, kv_dtype: str | None = None) -> None:
    """Store (T, nkv, hd) ``k``/``v`` rows at int64 device ``slots`` of the paged caches
    (num_pages, page_size, nkv, hd), float32 or float16 (``kv_type``; rounded to nearest
    even), or int8 rows (num_pages, page_size, nkv, hd + hd / 32; ``kv_codec``'s int8 bytes),
    or a rk ``kv_dtype``'s uint8 rows (``kv_codec``'s bytes); negative slots are skipped. In
    place."""
    t = k.shape[0]
    if not t:
        return
    hd = kv_head_dim(k_cache, kv_dtype)
    row = k_cache.shape[2] * hd
    k, v = _as_rows(k), _as_rows(v)
    _fn(f"write_kv<{kv_type(k_cache, v_cache, kv_dtype)}>")((t,), (min(256, -(-row // 32) * 32),), (
        k, np.int32(_row_stride(k, row)), v, np.int32(_row_stride(v, row)), slots, k_cache,
        v_cache, np.int32(row), np.int32(hd)))


def matmul_nt(x: cp.ndarray, w: cp.ndarray) -> cp.ndarray:
    """(T, K) float32 @ (N, K) float32 ``w``.T -> new (T, N), without cuBLAS (a CUDA-graph
    capture's plain-weight product; ``w`` C-contiguous)."""
    x = _as_rows(x)
    t, k = x.shape
    n = w.shape[0]
    out = cp.empty((t, n), dtype=cp.float32)
    if t * n:
        _fn("matmul_f32_nt")((-(-(t * n) // 8),), (256,), (
            x, np.int32(_row_stride(x, k)), cp.ascontiguousarray(w), out, np.int32(t),
            np.int32(n), np.int32(k)))
    return out

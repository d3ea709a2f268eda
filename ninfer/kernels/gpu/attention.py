"""Paged causal GQA attention on the GPU (``attention.cu``); semantics of
``ninfer.kernels.attention.paged_attention``.

- Decode (every sequence has one new token): ``attn_decode`` splits each sequence's context into
  ``splits`` partitions (chosen on the host from the longest context so that the grid has about
  two blocks per multiprocessor, partitions of at least ``MIN_PARTITION`` positions); on the
  device each sequence divides its own length by ``splits`` (at least ``PART_GRANULE`` positions
  per partition), so a short context inside a graph captured for a long one is still spread over
  the blocks. ``attn_merge`` combines the partial softmax results (split-K).
- Otherwise (prefill chunks, mixed batches): ``attn_prefill``, flash-style 32 x 32 tiles with
  the online softmax, causal limit per query row.
"""
from __future__ import annotations

import cupy as cp
import numpy as np

from ninfer.kernels.gpu import function, sm_count
from ninfer.kernels.gpu.launch import launch

HEAD_DIMS = (32, 64, 128, 256)
MAX_GROUP = 8
MIN_PARTITION = 32   # host: positions per partition when choosing the split count
PART_GRANULE = 16    # device: least positions per partition (four per warp)
_PREFILL_BR = 32


def _fn(hd: int, fname: str):
    names = tuple([f"attn_decode<{hd},{g}>" for g in range(1, MAX_GROUP + 1)]
                  + [f"attn_prefill<{hd}>"])
    return function("attention", fname, names)


def paged_attention(q: cp.ndarray, k_cache: cp.ndarray, v_cache: cp.ndarray,
                    cu_host: np.ndarray, lens_host: np.ndarray, cu: cp.ndarray,
                    lens: cp.ndarray, block_tables: cp.ndarray, scale: float) -> cp.ndarray:
    """Attention of (T, nh, hd) ``q`` (rows may be strided) over the paged caches.

    ``cu``/``lens``/``block_tables`` are int32 device copies of the host ``cu_host``/``lens_host``
    and the block table (validated by the caller). Returns a new (T, nh, hd) float32 array.

    Raises:
        NotImplementedError: head dim not in ``HEAD_DIMS`` or a group larger than ``MAX_GROUP``
            on the decode path.
    """
    t, nh, hd = q.shape
    page_size, nkv = k_cache.shape[1], k_cache.shape[2]
    g = nh // nkv
    if hd not in HEAD_DIMS:
        raise NotImplementedError(f"head dim {hd} (supported: {HEAD_DIMS})")
    if q.strides[2] != 4 or q.strides[1] != hd * 4:
        q = cp.ascontiguousarray(q)
    ldq = q.strides[0] // 4 if t > 1 else nh * hd
    s = lens_host.shape[0]
    out = cp.empty((t, nh, hd), dtype=cp.float32)
    if int(cu_host[-1]) < t:
        out[int(cu_host[-1]):] = 0
    q_lens = np.diff(cu_host)
    bt_stride = np.int32(block_tables.shape[1])
    if s and (q_lens == 1).all() and g <= MAX_GROUP:
        lmax = int(lens_host.max())
        want = max(1, -(-2 * sm_count() // (s * nkv)))
        part = max(MIN_PARTITION, -(-lmax // want))
        part = -(-part // 32) * 32
        splits = -(-lmax // part)
        if splits > 1:
            part_o = cp.empty((s * nh * splits * hd,), dtype=cp.float32)
            part_ml = cp.empty((s * nh * splits * 2,), dtype=cp.float32)
        else:
            part_o = part_ml = out
        launch(_fn(hd, f"attn_decode<{hd},{g}>"), (s, nkv, splits), (128,), (
            q, np.int32(ldq), k_cache, v_cache, cu, lens, block_tables, bt_stride,
            np.int32(page_size), np.int32(nkv), np.float32(scale), np.int32(PART_GRANULE),
            np.int32(splits), out, np.int32(nh * hd), part_o, part_ml))
        if splits > 1:
            launch(_fn(hd, "attn_merge"), (s, nh), (min(hd, 128),), (
                part_o, part_ml, cu, lens, out, np.int32(nh * hd), np.int32(nh), np.int32(hd),
                np.int32(splits), np.int32(PART_GRANULE)))
        return out
    tiles = [(i, r0) for i in range(s) for r0 in range(0, int(q_lens[i]) * g, _PREFILL_BR)]
    if not tiles:
        return out
    tiles_d = cp.asarray(np.asarray(tiles, dtype=np.int32).reshape(-1))
    fn = _fn(hd, f"attn_prefill<{hd}>")
    qp = hd + 1
    smem = 4 * (_PREFILL_BR * qp + 32 * qp + 32 * hd + _PREFILL_BR * 33)
    if smem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem
    fn((len(tiles), nkv), (128,), (
        q, np.int32(ldq), k_cache, v_cache, cu, lens, block_tables, bt_stride,
        np.int32(page_size), np.int32(nkv), np.int32(g), np.float32(scale), tiles_d, out,
        np.int32(nh * hd)), shared_mem=smem)
    return out

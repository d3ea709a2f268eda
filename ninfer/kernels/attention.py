"""Paged KV writes and paged causal GQA attention, NumPy reference.

KV layout (one layer): ``k_cache`` / ``v_cache`` of shape ``(num_pages, page_size, nkv, hd)``;
token slot ``page * page_size + offset``. A sequence's KV position ``j`` lives in page
``block_table[j // page_size]`` at offset ``j % page_size``. Source: Kwon et al. 2023,
"Efficient Memory Management for LLM Serving with PagedAttention" (vLLM names).

``kv_dtype`` (``engine.kv_dtypes.KV_DTYPES``) names how the pages store a head: ``fp32`` as the
float32 vector itself (last axis ``hd``), every other mode as one uint8 row of its codec's codes
and fp16 scales per token and head (``kv_codec.PartCodec.encode_rows``; last axis the K or V
row bytes). A quantized write encodes each token's heads; attention decodes the pages of the
sequence it attends to, per call (no dequantized copy of the cache is kept).
"""
from __future__ import annotations

import numpy as np

from ninfer.kernels.kv_codec import codec


def write_kv(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
             slot_mapping: np.ndarray, kv_dtype: str = "fp32") -> None:
    """Store each token's K and V at its slot, in place (encoded when ``kv_dtype`` is not fp32).

    Args:
        k_cache, v_cache: (num_pages, page_size, nkv, hd) float32 (``fp32``), else
            (num_pages, page_size, nkv, K / V row bytes) uint8; modified in place.
        k, v: (T, nkv, hd) float32.
        slot_mapping: (T,) int64, ``page * page_size + offset``; a negative slot marks a padding
            token whose K/V is not stored.
        kv_dtype: the caches' storage mode.

    Raises:
        IndexError: a slot at or beyond ``num_pages * page_size``.
        ValueError: an unknown ``kv_dtype``, caches whose rows do not fit it, or K/V values
            its codec cannot store (NaN, inf, beyond fp16's range).
    """
    num_pages, page_size, nkv = k_cache.shape[:3]
    kf = k_cache.reshape(num_pages * page_size, nkv, k_cache.shape[-1])
    vf = v_cache.reshape(num_pages * page_size, nkv, v_cache.shape[-1])
    slots = np.asarray(slot_mapping)
    if slots.size and slots.min() < 0:
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    if slots.size and slots.max() >= kf.shape[0]:
        raise IndexError(f"slot {slots.max()} out of range for {kf.shape[0]} KV slots")
    if kv_dtype != "fp32":
        c = codec(kv_dtype)
        _check_rows(c, k_cache, v_cache, k.shape[-1])
        k, v = c.k.encode_rows(k), c.v.encode_rows(v)
    kf[slots] = k
    vf[slots] = v


def _check_rows(c, k_cache: np.ndarray, v_cache: np.ndarray, hd: int) -> None:
    """ValueError unless the caches hold ``c``'s uint8 rows of heads of ``hd`` dims."""
    want = (c.k.row_bytes(hd), c.v.row_bytes(hd))
    if k_cache.dtype != np.uint8 or v_cache.dtype != np.uint8 or \
            (k_cache.shape[-1], v_cache.shape[-1]) != want:
        raise ValueError(f"{c.dtype} KV pages must be uint8 rows of {want} bytes (K, V), got "
                         f"{k_cache.dtype} {k_cache.shape[-1]} / {v_cache.dtype} "
                         f"{v_cache.shape[-1]}")


def _gather(cache: np.ndarray, pages: np.ndarray, ctx: int, part, hd: int) -> np.ndarray:
    """The first ``ctx`` positions of ``pages`` of one cache as (ctx, nkv, hd) float32
    (``part``: the K or V codec, decoding rows; None for fp32 pages)."""
    n_pages, page_size, nkv = pages.shape[0], cache.shape[1], cache.shape[2]
    rows = cache[pages].reshape(n_pages * page_size, nkv, cache.shape[-1])[:ctx]
    return rows if part is None else part.decode_rows(rows, hd)


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    cu_seqlens_q: np.ndarray, context_lens: np.ndarray,
                    block_tables: np.ndarray, scale: float,
                    kv_dtype: str = "fp32") -> np.ndarray:
    """Causal grouped-query attention of a ragged batch over paged KV.

    Sequence ``s`` owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` (``q_len`` tokens) and
    ``L = context_lens[s]`` KV positions, already written (this pass's tokens included). Its new
    tokens are the last ``q_len`` of its context: query ``i`` is at absolute position
    ``L - q_len + i`` and attends to KV positions ``<= L - q_len + i``. Query head ``h`` reads KV
    head ``h // (nh // nkv)`` (HF ``repeat_kv``). Scores are ``scale * q.k``; softmax in float32
    with max subtraction.

    Args:
        q: (T, nh, hd) float32, already rotated.
        k_cache, v_cache: pages as ``write_kv`` stores them under ``kv_dtype``.
        cu_seqlens_q: (S+1,) int32, 0 first, nondecreasing, T last.
        context_lens: (S,) int32, ``L >= q_len`` for each sequence.
        block_tables: (S, P) int32, page ids in sequence order, padded with -1; the first
            ``ceil(L / page_size)`` entries of row ``s`` must be valid pages.
        scale: score multiplier, usually ``hd ** -0.5``.
        kv_dtype: the caches' storage mode; a quantized one is decoded per sequence (the
            pages it attends to), as ``kv_codec`` decodes.

    Returns:
        New (T, nh, hd) float32 array (rows past ``cu_seqlens_q[-1]``, i.e. padding, are 0).

    Raises:
        ValueError: inconsistent batch description (``L < q_len``, nh not a multiple of nkv, a
            needed block-table entry missing), an unknown ``kv_dtype`` or caches whose rows do
            not fit it.
    """
    t, nh, hd = q.shape
    page_size, nkv = k_cache.shape[1], k_cache.shape[2]
    if nh % nkv:
        raise ValueError(f"{nh} query heads is not a multiple of {nkv} KV heads")
    g = nh // nkv
    kpart = vpart = None
    if kv_dtype != "fp32":
        c = codec(kv_dtype)
        _check_rows(c, k_cache, v_cache, hd)
        kpart, vpart = c.k, c.v
    cu = np.asarray(cu_seqlens_q)
    lens = np.asarray(context_lens)
    out = np.zeros((t, nh, hd), dtype=np.float32)  # rows outside every sequence stay 0
    scale = np.float32(scale)
    for s in range(lens.shape[0]):
        start, end = int(cu[s]), int(cu[s + 1])
        q_len, ctx = end - start, int(lens[s])
        if q_len == 0:
            continue
        if ctx < q_len:
            raise ValueError(f"sequence {s}: context_len {ctx} < {q_len} new tokens")
        n_pages = -(-ctx // page_size)
        pages = block_tables[s, :n_pages]
        if pages.shape[0] < n_pages or (pages < 0).any():
            raise ValueError(f"sequence {s}: block table lacks the {n_pages} pages "
                             f"that {ctx} KV positions need")
        # (ctx, nkv, hd) -> (nkv, hd, ctx) / (nkv, ctx, hd)
        k = _gather(k_cache, pages, ctx, kpart, hd)
        v = _gather(v_cache, pages, ctx, vpart, hd)
        kt = k.transpose(1, 2, 0)
        vt = v.transpose(1, 0, 2)
        # queries of one KV head side by side: (nkv, q_len * g, hd), row = i * g + head-in-group
        qs = q[start:end].reshape(q_len, nkv, g, hd).transpose(1, 0, 2, 3)
        qs = qs.reshape(nkv, q_len * g, hd)
        scores = np.matmul(qs, kt)  # (nkv, q_len * g, ctx)
        scores *= scale
        if q_len > 1:
            # query i sees KV j <= ctx - q_len + i
            qpos = np.repeat(np.arange(ctx - q_len, ctx), g)  # (q_len * g,)
            masked = np.arange(ctx)[None, :] > qpos[:, None]
            scores[:, masked] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        o = np.matmul(scores, vt)  # (nkv, q_len * g, hd)
        out[start:end] = o.reshape(nkv, q_len, g, hd).transpose(1, 0, 2, 3).reshape(q_len, nh, hd)
    return out


def gated_paged_attention(ops, qkv, nq: int, nk: int, q_norm, k_norm, eps: float,
                          positions: np.ndarray, theta: float, k_cache, v_cache,
                          slot_mapping: np.ndarray, cu_seqlens_q: np.ndarray,
                          context_lens: np.ndarray, block_tables: np.ndarray, scale: float,
                          style: str = "half", rotary_dim: int | None = None,
                          kv_dtype: str = "fp32"):
    """Gated attention composed of ``ops``' own ops: ``norm_rope_write_kv`` of the fused rows
    ``qkv`` (T, 2 nq hd + 2 nk hd; each q head followed by its output gate), ``paged_attention``
    of q, then ``sigmoid_mul`` of the output and the gate (read as (T, nq, hd) heads in place);
    returns (T, nq hd)."""
    t, hd = qkv.shape[0], q_norm.shape[0]
    q = ops.norm_rope_write_kv(qkv, nq, nk, True, q_norm, k_norm, eps, positions, theta, k_cache,
                               v_cache, slot_mapping, style, rotary_dim, kv_dtype)
    a = ops.paged_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                            kv_dtype)
    gate = qkv[:, :2 * nq * hd].reshape(t, nq, 2 * hd)[:, :, hd:]
    return ops.sigmoid_mul(a.reshape(t, nq * hd), gate)


def norm_rope_write_kv(ops, qkv, nq: int, nk: int, gated_q: bool, q_norm, k_norm, eps: float,
                       positions: np.ndarray, theta: float, k_cache, v_cache,
                       slot_mapping: np.ndarray, style: str = "half",
                       rotary_dim: int | None = None, kv_dtype: str = "fp32"):
    """Gated attention's q / k preparation composed of ``ops``' own ops: RMSNorm of each q and k
    head of the fused rows ``qkv`` (T, nq (2 if ``gated_q``: each q head followed by its output
    gate, else 1) hd + 2 nk hd), RoPE, ``write_kv`` of k and v; returns q (T, nq, hd)."""
    t, hd = qkv.shape[0], q_norm.shape[0]
    qw = 2 * hd if gated_q else hd
    kcol = nq * qw
    q = ops.rms_norm(qkv[:, :kcol].reshape(t, nq, qw)[:, :, :hd], q_norm, eps)
    k = ops.rms_norm(qkv[:, kcol:kcol + nk * hd].reshape(t, nk, hd), k_norm, eps)
    v = qkv[:, kcol + nk * hd:kcol + 2 * nk * hd].reshape(t, nk, hd)
    q = ops.rope(q, positions, theta, style, rotary_dim=rotary_dim)
    k = ops.rope(k, positions, theta, style, rotary_dim=rotary_dim)
    ops.write_kv(k_cache, v_cache, k, v, slot_mapping, kv_dtype=kv_dtype)
    return q

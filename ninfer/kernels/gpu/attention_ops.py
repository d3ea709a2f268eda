"""``CupyOps``' attention ops (``ninfer.kernels.ops``): KV writes, RoPE into the caches, paged
attention (plain and with the gated attention's norms and gate), and the fused decode attention
where ``config.decode_attention`` takes it; ``kv_pages`` views a cache as its kernels take it."""
from __future__ import annotations

from collections.abc import Mapping

import cupy as cp
import numpy as np

from ninfer.engine.kv_dtypes import GROUP
from ninfer.kernels import attention as attn_ref
from ninfer.kernels import kv_codec
from ninfer.kernels import rope as rope_ref
from ninfer.kernels.gpu import attention as gattn
from ninfer.kernels.gpu import elementwise as gew
from ninfer.kernels.gpu import linear as glin


def check_kv_dtype(kv_dtype: str) -> None:
    """Raise ValueError unless this backend stores KV as ``kv_dtype``
    (``AttentionOps.kv_dtypes``)."""
    if kv_dtype not in AttentionOps.kv_dtypes:
        raise ValueError(f"the cupy backend stores KV as {', '.join(AttentionOps.kv_dtypes)} "
                         f"only, not {kv_dtype!r}")


def kv_pages(k_cache, v_cache, kv_dtype: str) -> tuple[cp.ndarray, cp.ndarray]:
    """The K and V pages as the kernels take them: float32 under ``fp32``, float16 under
    ``fp16`` (``KVCache`` holds fp16 as uint8 rows of 2 hd bytes, the little-endian halves
    themselves: those are viewed as float16, not copied), int8 under ``int8`` (``KVCache``'s
    uint8 rows of hd + hd / 32 bytes, ``kv_codec``'s int8 rows: hd codes, then the fp16
    scales of the hd / 64 groups; viewed as int8, not copied: ``elementwise.kv_head_dim``),
    uint8 as they are under the rk modes (``kv_codec``'s rows of the mode's K and V codecs;
    the kernels take the mode by name, ``elementwise.RK_TYPES``).

    Raises:
        ValueError: a ``kv_dtype`` this backend does not store, or pages that do not fit it.
    """
    check_kv_dtype(kv_dtype)
    if kv_dtype in gew.RK_TYPES:
        hd = [gew.kv_head_dim(c, kv_dtype, v) if c.ndim == 4 else 0
              for v, c in enumerate((k_cache, v_cache))]
        codecs = kv_codec.codec(kv_dtype)
        for c, part, h in ((k_cache, codecs.k, hd[0]), (v_cache, codecs.v, hd[1])):
            if (c.dtype != np.uint8 or h <= 0 or h % GROUP or h != hd[0]
                    or c.shape[-1] != part.row_bytes(h)):
                raise ValueError(f"{kv_dtype} KV pages must be uint8 rows of kv_codec's K / V "
                                 f"row bytes of one head dim (a multiple of {GROUP}), got "
                                 f"{c.dtype} {c.shape} / {v_cache.dtype} {v_cache.shape}")
        return k_cache, v_cache
    want = np.dtype({"fp32": np.float32, "fp16": np.float16, "int8": np.int8}[kv_dtype])
    pages = []
    for c in (k_cache, v_cache):
        w = c.shape[-1] if c.ndim else 0
        if (want == np.float16 and c.dtype == np.uint8 and w % 2 == 0
                and c.flags.c_contiguous):
            c = c.view(cp.float16)
        elif want == np.int8 and c.dtype == np.uint8:
            c = c.view(cp.int8)
        if want == np.int8 and c.dtype == want and not (
                w % 33 == 0 and (w * 32 // 33) % GROUP == 0 and w > 0):
            raise ValueError(f"int8 KV rows must be hd + hd / 32 bytes wide with hd a multiple "
                             f"of {GROUP}, got {c.shape}")
        if c.dtype != want:
            raise ValueError(f"{kv_dtype} KV pages must be {want} (or, for fp16 / int8, uint8 "
                             f"rows of 2 hd / hd + hd / 32 bytes), got {c.dtype} of shape "
                             f"{c.shape}")
        pages.append(c)
    return pages[0], pages[1]


class AttentionOps:
    """The attention ops of ``CupyOps`` (uses its ``config``, ``handoffs``, ``_dev``,
    ``_inv_freq`` and ``_validated``)."""

    # KV storage modes with GPU kernels (templates over the cache element type; the rk modes:
    # kvrk<KK>, rotated rows, attention in the rotated domain)
    kv_dtypes = ("fp32", "fp16", "int8", "rk8v4", "rk4v4", "rk4v4-e8", "rk2v4-e8")

    def _rope_freq(self, r: int, theta: float, scaling) -> cp.ndarray:
        key = (r, float(theta), tuple(sorted(scaling.items())) if scaling else None)
        inv = self._inv_freq.get(key)
        if inv is None:
            inv = cp.asarray(rope_ref.rope_inv_freq(r, theta, scaling))
            self._inv_freq[key] = inv
        return inv

    def rope_write_kv(self, qkv, nq: int, nk: int, positions: np.ndarray, theta: float,
                      k_cache, v_cache, slot_mapping: np.ndarray, style: str = "half",
                      rotary_dim: int | None = None, scaling: Mapping | None = None,
                      kv_dtype: str = "fp32"):
        """See ``ninfer.kernels``: one kernel (``rope_write_kv`` of elementwise.cu).

        Raises:
            ValueError: unknown style, bad ``rotary_dim`` or a ``kv_dtype`` not in
                ``kv_dtypes`` (``kv_pages``).
            IndexError: a slot at or beyond ``num_pages * page_size``.
        """
        k_cache, v_cache = kv_pages(k_cache, v_cache, kv_dtype)
        hd = gew.kv_head_dim(k_cache, kv_dtype)
        r = rope_ref.rotary_dims(style, hd, rotary_dim)
        return gew.rope_write_kv(qkv, nq, nk, hd, self._dev(np.asarray(positions), np.int32),
                                 self._rope_freq(r, theta, scaling),
                                 0 if style == "half" else 1, r, k_cache, v_cache,
                                 self._slots(slot_mapping, k_cache), pdl=self.config.pdl,
                                 kv_dtype=kv_dtype)

    def norm_rope_write_kv(self, qkv, nq: int, nk: int, gated_q: bool, q_norm, k_norm,
                           eps: float, positions, theta: float, k_cache, v_cache, slot_mapping,
                           style: str = "half", rotary_dim: int | None = None,
                           kv_dtype: str = "fp32") -> cp.ndarray:
        """See ``ninfer.kernels.ops``: one kernel for hd <= 512, else composed."""
        hd = q_norm.shape[0]
        if hd > 512:
            return attn_ref.norm_rope_write_kv(self, qkv, nq, nk, gated_q, q_norm, k_norm, eps,
                                               positions, theta, k_cache, v_cache,
                                               slot_mapping, style, rotary_dim, kv_dtype)
        k_cache, v_cache = kv_pages(k_cache, v_cache, kv_dtype)
        r = rope_ref.rotary_dims(style, hd, rotary_dim)
        return gew.norm_rope_write_kv(
            qkv, nq, nk, hd, gated_q, q_norm, k_norm, eps,
            self._dev(np.asarray(positions), np.int32), self._rope_freq(r, theta, None),
            0 if style == "half" else 1, r, k_cache, v_cache, self._slots(slot_mapping, k_cache),
            pdl=self.config.pdl, kv_dtype=kv_dtype)

    def rope_paged_attention(self, qkv, nq: int, nk: int, positions: np.ndarray, theta: float,
                             k_cache, v_cache, slot_mapping: np.ndarray,
                             cu_seqlens_q: np.ndarray, context_lens: np.ndarray,
                             block_tables: np.ndarray, scale: float, style: str = "half",
                             rotary_dim: int | None = None,
                             scaling: Mapping | None = None,
                             kv_dtype: str = "fp32") -> cp.ndarray:
        """See ``ninfer.kernels.ops``: one kernel for a decode batch where
        ``config.decode_attention`` says so (``gpu.attention.rope_paged_attention``), else
        ``rope_write_kv`` then ``paged_attention``. Where the planned GEMV after it takes a q8
        shadow (``gpu.handoff``), the merge of the attention's splits also writes one.

        Raises:
            ValueError: unknown style, bad ``rotary_dim``, an inconsistent batch description,
                a ``kv_dtype`` not in ``kv_dtypes`` (``kv_pages``).
            IndexError: a slot at or beyond ``num_pages * page_size``.
        """
        k_cache, v_cache = kv_pages(k_cache, v_cache, kv_dtype)
        feeds = self.handoffs.attention_feeds(qkv)
        cu = np.asarray(cu_seqlens_q)
        hd = gew.kv_head_dim(k_cache, kv_dtype)
        mode = self._fused_decode_mode(qkv, nq, nk, hd, cu, context_lens, block_tables,
                                       slot_mapping, k_cache)
        if mode is None:
            q = self.rope_write_kv(qkv, nq, nk, positions, theta, k_cache, v_cache, slot_mapping,
                                   style, rotary_dim, scaling, kv_dtype)
            return self.paged_attention(q, k_cache, v_cache, cu, context_lens, block_tables,
                                        scale, kv_dtype)
        return self._fused_attention(mode, qkv, nq, nk, hd, positions, theta, k_cache, v_cache,
                                     slot_mapping, cu, context_lens, block_tables, scale, style,
                                     rotary_dim, scaling, kv_dtype, feeds=feeds)

    def gated_paged_attention(self, qkv, nq: int, nk: int, q_norm, k_norm, eps: float,
                              positions: np.ndarray, theta: float, k_cache, v_cache,
                              slot_mapping: np.ndarray, cu_seqlens_q: np.ndarray,
                              context_lens: np.ndarray, block_tables: np.ndarray, scale: float,
                              style: str = "half", rotary_dim: int | None = None,
                              kv_dtype: str = "fp32") -> cp.ndarray:
        """See ``ninfer.kernels.ops``: for a decode batch where ``config.decode_attention`` says
        so ("auto": of one sequence), one kernel (``gpu.attention.rope_paged_attention`` with
        the norms and the gate; not under a rk ``kv_dtype``, whose output is rotated back after
        the kernel), else
        ``attention.gated_paged_attention`` of these ops, the gate applied where
        ``attn_merge`` merges the splits (``gpu.attention.paged_attention``).

        Raises:
            ValueError: unknown style, bad ``rotary_dim``, an inconsistent batch description,
                a ``kv_dtype`` not in ``kv_dtypes`` (``kv_pages``).
            IndexError: a slot at or beyond ``num_pages * page_size``.
        """
        k_cache, v_cache = kv_pages(k_cache, v_cache, kv_dtype)
        cu = np.asarray(cu_seqlens_q)
        hd = q_norm.shape[0]
        # "auto": fused for one sequence only (H100, 27B heads: the b1 step 1 % faster; at 8
        # sequences the fused kernel alone 26 us a layer against 19 composed)
        one = self.config.decode_attention != "auto" or cu.shape[0] == 2
        mode = (None if kv_dtype in gew.RK_TYPES or gew.kv_head_dim(k_cache, kv_dtype) != hd
                or not one else self._fused_decode_mode(qkv, nq, nk, hd, cu, context_lens,
                                                        block_tables, slot_mapping, k_cache))
        if mode is None:   # (attention.gated_paged_attention, the gate where the splits merge)
            t = qkv.shape[0]
            q = self.norm_rope_write_kv(qkv, nq, nk, True, q_norm, k_norm, eps, positions, theta,
                                        k_cache, v_cache, slot_mapping, style, rotary_dim,
                                        kv_dtype)
            gate = qkv[:, :2 * nq * hd].reshape(t, nq, 2 * hd)[:, :, hd:]
            return self._attend(q, k_cache, v_cache, cu, context_lens, block_tables, scale,
                                kv_dtype, gate).reshape(t, nq * hd)
        f32 = lambda a: cp.ascontiguousarray(a, dtype=cp.float32)  # noqa: E731
        out = self._fused_attention(mode, qkv, nq, nk, hd, positions, theta, k_cache, v_cache,
                                    slot_mapping, cu, context_lens, block_tables, scale, style,
                                    rotary_dim, None, kv_dtype,
                                    norm=(f32(q_norm), f32(k_norm), eps))
        return out.reshape(qkv.shape[0], nq * hd)

    def _fused_attention(self, mode: str, qkv, nq: int, nk: int, hd: int, positions, theta: float,
                         k_cache, v_cache, slot_mapping, cu: np.ndarray, context_lens,
                         block_tables, scale: float, style: str, rotary_dim: int | None,
                         scaling: Mapping | None, kv_dtype: str, feeds=None,
                         norm: tuple | None = None) -> cp.ndarray:
        """``gpu.attention.rope_paged_attention`` of a batch that ``_fused_decode_mode`` gave
        ``mode`` (pages as ``kv_pages`` gives them): gated, with the q / k ``norm`` (weights,
        eps) when given; where ``feeds`` (``handoffs.attention_feeds``) plans a q8 shadow of
        the output and the merge can write it, it does, and it is handed on."""
        kc = self.config
        r = rope_ref.rotary_dims(style, hd, rotary_dim)
        lens = np.asarray(context_lens)
        bt = np.asarray(block_tables)
        self.check_paged(cu, lens, bt, k_cache.shape[1])
        so = (self.handoffs.out_for(feeds, 1, nq * hd) if feeds is not None and feeds.norm is None
              and kv_dtype not in gew.RK_TYPES   # (rk: the output is rotated back after)
              and gattn.merge_shadow(kc, cu.shape[0] - 1, nq, nk, hd, lens, mode == "rope")
              else None)
        out = gattn.rope_paged_attention(
            kc, qkv, nq, self._dev(np.asarray(positions), np.int32),
            self._rope_freq(r, theta, scaling), 0 if style == "half" else 1, r,
            self._slots(slot_mapping, k_cache), k_cache, v_cache, lens, self._dev(cu, np.int32),
            self._dev(lens, np.int32), self._dev(bt, np.int32), scale,
            merge_kernel=mode == "rope", shadow_out=None if so is None else (so[0], so[2]),
            kv_dtype=kv_dtype, norm=norm, gated=norm is not None)
        self.handoffs.hand_on(out, feeds, so)
        return out

    def _fused_decode_mode(self, qkv, nq: int, nk: int, hd: int, cu: np.ndarray, context_lens,
                           block_tables, slot_mapping, k_cache) -> str | None:
        """``_decode_attention_mode`` ("on" or "rope") where the fused decode attention serves
        the batch of rows ``qkv`` (one new token a sequence, at its last position; with "on",
        few enough sequences for the arrival counters), else None."""
        mode = self._decode_attention_mode(nq * hd, cu.shape[0] - 1)
        if (mode != "off" and gattn.decode_applies(np.diff(cu), nq, nk, hd)
                and qkv.shape[0] == cu.shape[0] - 1 and nq % nk == 0
                and (mode == "rope" or cu.shape[0] - 1 <= gattn.MAX_COUNTERS // nk)
                and gattn.slots_at_last_position(slot_mapping, context_lens, block_tables,
                                                 k_cache.shape[1])):
            return mode
        return None

    def _decode_attention_mode(self, width: int, seqs: int) -> str:
        """``config.decode_attention`` for a decode batch of ``seqs`` sequences whose attention
        rows are ``width`` (nq hd) floats: "on", "rope" or "off" ("auto": "on" unless a Q4 o
        projection of that width, for that many rows, would take ``gemv_bulk``; there
        "rope")."""
        mode = self.config.decode_attention
        if mode == "auto":
            return ("on" if glin.bulk_config(self.config, seqs, width, width, 0, True) is None
                    else "rope")
        return mode

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping: np.ndarray,
                 kv_dtype: str = "fp32") -> None:
        """See ``ninfer.kernels.attention.write_kv``.

        Raises:
            ValueError: a ``kv_dtype`` not in ``kv_dtypes`` (``kv_pages``).
            IndexError: a slot at or beyond ``num_pages * page_size``.
        """
        k_cache, v_cache = kv_pages(k_cache, v_cache, kv_dtype)
        gew.write_kv(k_cache, v_cache, k, v, self._slots(slot_mapping, k_cache), kv_dtype)

    def _slots(self, slot_mapping: np.ndarray, k_cache) -> cp.ndarray:
        """Device int64 copy of the host KV slots, checked against the cache's capacity.

        Raises:
            IndexError: a slot at or beyond ``num_pages * page_size``.
        """
        slots = np.asarray(slot_mapping)
        cap = k_cache.shape[0] * k_cache.shape[1]
        if slots.size and slots.max() >= cap:
            raise IndexError(f"slot {slots.max()} out of range for {cap} KV slots")
        return self._dev(slots, np.int64)

    def paged_attention(self, q, k_cache, v_cache, cu_seqlens_q: np.ndarray,
                        context_lens: np.ndarray, block_tables: np.ndarray,
                        scale: float, kv_dtype: str = "fp32") -> cp.ndarray:
        """See ``ninfer.kernels.attention.paged_attention`` (same validation and errors).

        Raises:
            ValueError: inconsistent batch description, a ``kv_dtype`` not in ``kv_dtypes``
                (``kv_pages``).
        """
        return self._attend(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                            scale, kv_dtype)

    def _attend(self, q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                scale: float, kv_dtype: str, gate=None) -> cp.ndarray:
        """``paged_attention``, with the gated attention's ``gate`` (``gpu.attention``)."""
        k_cache, v_cache = kv_pages(k_cache, v_cache, kv_dtype)
        nh, nkv = q.shape[1], k_cache.shape[2]
        if nh % nkv:
            raise ValueError(f"{nh} query heads is not a multiple of {nkv} KV heads")
        cu = np.asarray(cu_seqlens_q)
        lens = np.asarray(context_lens)
        bt = np.asarray(block_tables)
        self.check_paged(cu, lens, bt, k_cache.shape[1])
        return gattn.paged_attention(self.config, q, k_cache, v_cache, cu, lens,
                                     self._dev(cu, np.int32),
                                     self._dev(lens, np.int32), self._dev(bt, np.int32), scale,
                                     kv_dtype, gate)

    def check_paged(self, cu: np.ndarray, lens: np.ndarray, bt: np.ndarray,
                    page_size: int) -> None:
        """Validate a paged batch description (host arrays): every sequence with new tokens
        has a context at least that long and block-table pages for all of it. Skipped while
        the same arrays recur (every layer of a pass passes the same ones).

        Raises:
            ValueError: a context shorter than its new tokens, or missing pages.
        """
        done = self._validated
        if done and done[0] is cu and done[1] is lens and done[2] is bt:
            return
        q_lens = np.diff(cu)
        for s in range(lens.shape[0]):
            if q_lens[s] == 0:
                continue
            if lens[s] < q_lens[s]:
                raise ValueError(f"sequence {s}: context_len {lens[s]} < {q_lens[s]} new tokens")
            n_pages = -(-int(lens[s]) // page_size)
            pages = bt[s, :n_pages]
            if pages.shape[0] < n_pages or (pages < 0).any():
                raise ValueError(f"sequence {s}: block table lacks the {n_pages} pages "
                                 f"that {lens[s]} KV positions need")
        self._validated = (cu, lens, bt)

"""A speculative round's glue on the GPU (``spec.cu``; semantics: ``ninfer.kernels.spec``).

Index arrays are int32 device arrays (KV slots int64), resolved by ``cupy_ops`` from the host
arrays of the round, in a CUDA graph its static buffers. Each function is one launch and never
waits for the device.
"""
from __future__ import annotations

from collections.abc import Sequence

import cupy as cp
import numpy as np

from ninfer.kernels.gdn import record_key_heads
from ninfer.kernels.gpu import function
from ninfer.kernels.gpu.elementwise import _as_rows, _row_stride


def _fn(name: str):
    return function("spec", name)


def accept(ids: cp.ndarray, targets: cp.ndarray, k: int, out: cp.ndarray) -> None:
    b = out.shape[0]
    _fn("spec_accept")((-(-b // 128),), (128,), (ids, targets, out, np.int32(b), np.int32(k)))


def rows(x: cp.ndarray, acc: cp.ndarray, k: int) -> cp.ndarray:
    x = _as_rows(x)
    b, h = acc.shape[0], x.shape[1]
    out = cp.empty((b, h), dtype=cp.float32)
    if b:
        _fn("spec_rows")((b,), (256,), (x, np.int32(_row_stride(x, h)), acc, out, np.int32(h),
                                        np.int32(k)))
    return out


def chain(pos: cp.ndarray, slot_mapping: cp.ndarray, acc: cp.ndarray, j: int, bt: cp.ndarray,
          page_size: int, out_pos: cp.ndarray, out_slots: cp.ndarray,
          out_lens: cp.ndarray) -> None:
    b = acc.shape[0]
    _fn("spec_chain")((-(-b // 128),), (128,), (
        pos, slot_mapping, acc, np.int32(j), bt, np.int32(bt.shape[1]), np.int32(page_size),
        out_pos, out_slots, out_lens, np.int32(b), np.int32(pos.shape[0] // b)))


def record_conv(rec: cp.ndarray, conv_state: cp.ndarray, x: cp.ndarray, cu: cp.ndarray,
                slots: cp.ndarray) -> None:
    s, rl, c = rec.shape
    kc1 = conv_state.shape[1]
    if not (rec.flags.c_contiguous and conv_state.flags.c_contiguous):
        raise ValueError("conv records and state must be C-contiguous")
    x = _as_rows(x)
    n = s * rl * c
    if n:
        _fn("spec_record_conv")((max(1, min(-(-n // 256), 65535)),), (256,), (
            rec, conv_state, x, np.int32(_row_stride(x, c)), cu, slots, np.int32(s),
            np.int32(rl - kc1), np.int32(c), np.int32(kc1)))


def commit(ssm: Sequence[cp.ndarray], conv: Sequence[cp.ndarray],
           rec_ssm: Sequence[cp.ndarray], rec_conv: Sequence[cp.ndarray], slots: cp.ndarray,
           acc: cp.ndarray) -> None:
    """Every layer's commit (``spec_commit``: each slot's state advanced by the records of the
    tokens it keeps) in one launch; the layers' pools and records share their shapes."""
    layers = list(zip(ssm, conv, rec_ssm, rec_conv))
    if not layers:
        return
    s, length, width = rec_ssm[0].shape
    hv, dk, dv = ssm[0].shape[1:]
    hk = record_key_heads(width, hv, dk, dv)
    kc1, c = conv[0].shape[1], conv[0].shape[2]
    if dv % 4 or hk < 1 or hv % hk or any(
            a.shape != b.shape or not a.flags.c_contiguous
            for layer in layers for a, b in zip(layer, layers[0])):
        raise ValueError("GDN commit: contiguous pools and records of one shape a layer, dv a "
                         "multiple of 4, records of gdn.record_width floats for Hv a multiple "
                         "of Hk")
    n = hv * dk * dv
    if s:
        _fn("spec_commit")((max(1, min(-(-n // 1024), 256)), s, len(layers)), (256,), (
            _pointer_table(layers), slots, acc, np.int32(s), np.int32(length), np.int32(hk),
            np.int32(hv), np.int32(dk), np.int32(dv), np.int32(kc1), np.int32(c)))


def _pointer_table(layers) -> cp.ndarray:
    """The layers' array addresses as a device uint64 table, made once per set of arrays (the
    first call is eager, before a CUDA graph captures the same arrays)."""
    key = tuple(a.data.ptr for layer in layers for a in layer)
    table = _tables.get(key)
    if table is None:
        table = _tables[key] = cp.asarray(np.array(key, dtype=np.uint64))
    return table


_tables: dict[tuple, cp.ndarray] = {}


class SpecOps:
    """``CupyOps``' speculative-round ops (``ninfer.kernels.ops``): index inputs resolve
    through ``_dev`` and the ``out*`` arrays through ``_bound`` (a CUDA graph's static
    buffers; ``gpu.spec_graphs``)."""

    def argmax_into(self, logits, out: np.ndarray) -> None:
        from ninfer.kernels.gpu.elementwise import argmax_rows
        argmax_rows(logits, out32=self._bound(out))

    def spec_accept(self, ids: np.ndarray, targets: np.ndarray, k: int,
                    out: np.ndarray) -> None:
        accept(self._dev(ids, np.int32), self._dev(targets, np.int32), k, self._bound(out))

    def spec_rows(self, x, acc: np.ndarray, k: int):
        return rows(x, self._dev(acc, np.int32), k)

    def spec_chain(self, positions: np.ndarray, slot_mapping: np.ndarray, acc: np.ndarray,
                   j: int, block_tables: np.ndarray, page_size: int, out_pos: np.ndarray,
                   out_slots: np.ndarray, out_lens: np.ndarray) -> None:
        chain(self._dev(positions, np.int32), self._dev(slot_mapping, np.int64),
              self._dev(acc, np.int32), j, self._dev(block_tables, np.int32), page_size,
              self._bound(out_pos), self._bound(out_slots), self._bound(out_lens))

    def gdn_record_conv(self, rec, conv_state, x, cu_seqlens_q: np.ndarray,
                        state_slots: np.ndarray) -> None:
        cu, slots, _, _, _ = self._ragged(cu_seqlens_q, state_slots, x.shape[0],
                                          conv_state.shape[0])
        record_conv(rec, conv_state, x, cu, slots)

    def gdn_commit(self, ssm, conv, rec_ssm, rec_conv, state_slots: np.ndarray,
                   acc: np.ndarray) -> None:
        commit(ssm, conv, rec_ssm, rec_conv, self._dev(np.asarray(state_slots), np.int32),
               self._dev(acc, np.int32))

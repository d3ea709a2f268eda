"""The CuPy backend: every op of ``ninfer.kernels.ops.Ops`` on an NVIDIA GPU.

Same methods, shapes and semantics as ``NumpyOps``; the kernels each case takes are chosen by the
backend's ``KernelConfig`` (``ninfer/kernels/gpu/README.md``). Backend arrays are CuPy float32
arrays in device memory, index arrays arrive as host NumPy arrays and are uploaded (each distinct
array once per forward pass: a small cache keyed by identity and checked by value). Quantized
weights stay packed in VRAM (``gpu.linear``). Logits stay on the device: ``argmax`` returns only
the ids to the host; ``to_numpy`` copies anything else.

Importing this module imports CuPy; ``get_ops`` imports it only when the cupy backend is asked
for, so the CPU backend never needs CuPy.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import cupy as cp
import numpy as np

from ninfer.kernels import gdn as gdn_ref
from ninfer.kernels import rope as rope_ref
from ninfer.kernels.config import KernelConfig
from ninfer.kernels.gpu import elementwise as gew
from ninfer.kernels.gpu import gdn as ggdn
from ninfer.kernels.gpu import gdn_chunk as gchunk
from ninfer.kernels.gpu import linear as glin
from ninfer.kernels.gpu.attention_ops import AttentionOps
from ninfer.kernels.gpu.handoff import Handoffs
from ninfer.kernels.gpu.linear_ops import LinearOps
from ninfer.kernels.gpu.spec import SpecOps
from ninfer.store.quant import QuantTensor, dequantize


def cuda_available() -> bool:
    """Whether CuPy can use a CUDA device here (False instead of raising)."""
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device, broken install
        return False


class CupyOps(AttentionOps, LinearOps, SpecOps):
    """GPU ops over CuPy float32 arrays (see ``ninfer.kernels.ops.Ops`` for the interface).

    Args:
        config: the kernel choices (``KernelConfig()``, the production path, when None).

    Raises (constructor):
        RuntimeError: no usable CUDA device.
    """

    name = "cupy"

    def __init__(self, config: KernelConfig | None = None) -> None:
        if not cuda_available():
            raise RuntimeError("no CUDA device is usable by CuPy")
        self.config = config if config is not None else KernelConfig()
        self._uploads: list[tuple] = []   # (host array ref, host copy, device array)
        self._bound_arrays: list[tuple] = []   # (host array ref, static device array)
        self._inv_freq: dict = {}
        self._scratch: cp.ndarray | None = None   # a prefill GEMM's weight operand (bytes)
        self._f16_kept = 0   # bytes of fp16 weight copies kept (prepare_model)
        self._validated: tuple | None = None
        self._ragged_cache: tuple | None = None
        self._chunk_cache: tuple | None = None
        self.handoffs = Handoffs(self.config)   # q8 shadows between decode kernels

    # arrays
    def zeros(self, shape: tuple[int, ...], dtype=np.float32) -> cp.ndarray:
        """A zero-filled device array (KV caches, scratch)."""
        return cp.zeros(shape, dtype=dtype)

    def to_numpy(self, x) -> np.ndarray:
        """A device array copied to a host NumPy array (host arrays pass through)."""
        if isinstance(x, cp.ndarray):
            return cp.asnumpy(x)
        return np.asarray(x)

    def argmax(self, x) -> np.ndarray:
        """Index of the largest value of each row of (S, V) ``x`` (first one on ties), computed
        on the device (``gpu.elementwise.argmax_rows`` for float32 rows); only the (S,) int64
        ids come back to the host."""
        if (isinstance(x, cp.ndarray) and x.ndim == 2 and x.dtype == cp.float32
                and x.shape[1] > 0 and (x.shape[1] == 1 or x.strides[1] == 4)):
            return cp.asnumpy(gew.argmax_rows(x))
        return cp.asnumpy(cp.argmax(x, axis=-1)).astype(np.int64)

    def decode_runner(self, model, max_pages: int, max_batch: int, cuda_graph: bool = True):
        """``model`` wrapped so that pure decode batches run per batch-size bucket (1, 2, 4, ...
        up to ``max_batch``) over static inputs: replayed from CUDA graphs, or with
        ``cuda_graph=False`` the same padded schedule eagerly (``gpu.graphs.CudaGraphDecoder``;
        call its ``capture_all(kv)`` before serving). ``max_pages``: the most KV pages one
        sequence may hold. Models with per-lane recurrent state (``model.is_recurrent``) take
        their lanes' state slots as one more static input. Its ``prefill_graphs(chunk)``
        adds single-sequence prefill passes of up to ``chunk`` tokens."""
        from ninfer.kernels.gpu.graphs import CudaGraphDecoder
        from ninfer.kernels.graph_buckets import buckets_for
        return CudaGraphDecoder(model, max_pages=max_pages, buckets=buckets_for(max_batch),
                                enabled=cuda_graph)

    def synchronize(self) -> None:
        """Wait for all queued device work (timing)."""
        cp.cuda.get_current_stream().synchronize()

    def bind_static(self, uploads, ragged=None) -> None:
        """Resolve host arrays to fixed device buffers, a CUDA-graph bucket's static inputs, so
        that no upload happens inside a capture and a replay reads what was copied there (or
        what the graph's own kernels wrote there: ``_bound``).

        Args:
            uploads: ``(host array, device array)`` pairs (index arrays of the batch).
            ragged: for the recurrent layers, ``(cu host, state slots host, pool size, (cu,
                slots, per-token sequence) device[, tokens per sequence])`` of a batch of
                equal-length sequences (default one token each).
        """
        self._bound_arrays = [(h, d) for h, d in uploads]
        self._uploads = []
        self._validated = None
        if ragged is not None:
            cu, slots, pool, dev, *per = ragged
            b = slots.shape[0]
            n = per[0] if per else 1
            self._ragged_cache = (cu, slots, cu, slots, (b * n, pool), (*dev, b, n))

    def _bound(self, arr: np.ndarray) -> cp.ndarray:
        """The static device buffer bound to host array ``arr`` (``bind_static``).

        Raises:
            RuntimeError: ``arr`` is bound to none (an output only a CUDA graph's buffers
                can take: run the round through ``gpu.spec_graphs``).
        """
        for ref, dev in self._bound_arrays:
            if ref is arr:
                return dev
        raise RuntimeError("an output array that no static device buffer is bound to")

    def _dev(self, arr: np.ndarray, dtype) -> cp.ndarray:
        """Device copy of a host index array, reused while the same unchanged array recurs
        (a forward pass passes the same positions / tables to every layer)."""
        for ref, dev in self._bound_arrays:
            if ref is arr and dev.dtype == dtype:
                return dev
        for ref, copy, dev in self._uploads:
            if ref is arr and dev.dtype == dtype and np.array_equal(copy, arr):
                return dev
        host = np.ascontiguousarray(arr, dtype=dtype)
        dev = cp.asarray(host)
        self._uploads.append((arr, host.copy(), dev))
        if len(self._uploads) > 8:
            self._uploads.pop(0)
        return dev

    # weights
    def prepare_model(self, model) -> None:
        """Plan the q8 shadow hand-offs of ``model``'s decode step (``gpu.handoff``), keep
        fp16 copies of its layers' weights where they fit (``LinearOps.keep_f16``), and keep
        its output head off fp8 (``GpuWeight.prefill_fp8``)."""
        self.handoffs.plan_model(model)
        self._f16_kept = self.keep_f16(model)
        head = getattr(model, "lm_head", None)
        if isinstance(head, glin.GpuWeight):
            head.prefill_fp8 = False

    def prepare_weight(self, t: QuantTensor):
        """1-D tensors (norms) -> float32 device vector; 2-D -> ``gpu.linear.upload``."""
        if len(t.shape) != 2:
            return cp.asarray(np.ascontiguousarray(dequantize(t), dtype=np.float32))
        return glin.upload(t)

    def prepare_fused(self, ts: Sequence[QuantTensor]):
        """See ``gpu.linear.upload_fused``."""
        return glin.upload_fused(ts)

    # ops
    def embedding(self, w, ids: np.ndarray) -> cp.ndarray:
        """(T, H) float32 rows of ``w`` for host ``ids``.

        Raises:
            IndexError: an id outside ``[0, V)``.
        """
        ids = np.asarray(ids)
        v, h = w.shape
        if ids.size and (ids.min() < 0 or ids.max() >= v):
            raise IndexError(f"token id out of range [0, {v}): min {ids.min()}, max {ids.max()}")
        return gew.embedding(w, self._dev(ids, np.int32), h)

    def rms_norm(self, x, w, eps: float, unit_offset: bool = False) -> cp.ndarray:
        return gew.rms_norm(x, w, eps, unit_offset)

    def rope(self, x, positions: np.ndarray, theta: float, style: str = "half",
             rotary_dim: int | None = None, scaling: Mapping | None = None) -> cp.ndarray:
        """See ``ninfer.kernels.rope.rope``; angles ``pos * inv_freq`` in float32 on the device.

        Raises:
            ValueError: unknown style, bad ``rotary_dim`` or unsupported scaling.
        """
        r = rope_ref.rotary_dims(style, x.shape[-1], rotary_dim)
        return gew.rope(x, self._dev(np.asarray(positions), np.int32),
                        self._rope_freq(r, theta, scaling), 0 if style == "half" else 1, r)

    def silu_mul(self, gate, up) -> cp.ndarray:
        return gew.silu_mul(gate, up)

    # gated attention and Gated DeltaNet (Qwen3.5 / Qwen3-Next; see ninfer.kernels.gdn)
    def _ragged(self, cu_seqlens: np.ndarray, slots: np.ndarray, t: int, pool: int) -> tuple:
        """Validated device (cu int32, slots int32, per-token sequence int32, S) for a ragged
        batch; reused while every layer of a pass passes the same unchanged host arrays."""
        done = self._ragged_cache
        if (done is not None and done[0] is cu_seqlens and done[1] is slots
                and np.array_equal(done[2], cu_seqlens) and np.array_equal(done[3], slots)
                and done[4] == (t, pool)):
            return done[5]
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        sl = np.asarray(slots, dtype=np.int64)
        gdn_ref._check_ragged(t, cu, sl, pool)
        lens = np.diff(cu)
        tok_seq = np.repeat(np.arange(lens.shape[0], dtype=np.int32), lens)
        dev = (cp.asarray(cu.astype(np.int32)), cp.asarray(sl.astype(np.int32)),
               cp.asarray(tok_seq), int(lens.shape[0]), int(lens.max()))
        self._ragged_cache = (cu_seqlens, slots, np.array(cu_seqlens), np.array(slots),
                              (t, pool), dev)
        return dev

    def _chunks(self, cu_seqlens: np.ndarray) -> tuple:
        """``gpu.gdn_chunk.chunk_table`` of a validated ragged batch; reused while every layer
        of a pass passes the same unchanged host array."""
        done = self._chunk_cache
        if done is None or done[0] is not cu_seqlens or not np.array_equal(done[1], cu_seqlens):
            done = self._chunk_cache = (cu_seqlens, np.array(cu_seqlens),
                                        gchunk.chunk_table(np.asarray(cu_seqlens, np.int64)))
        return done[2]

    def sigmoid_mul(self, x, gate) -> cp.ndarray:
        return ggdn.sigmoid_mul(x, gate, pdl=self.config.pdl)

    def l2_norm(self, x, eps: float = 1e-6) -> cp.ndarray:
        return ggdn.l2_norm(x, eps)

    def gated_rms_norm(self, x, z, w, eps: float) -> cp.ndarray:
        return ggdn.gated_rms_norm(x, z, w, eps)

    def gdn_gates(self, a, b, A_log, dt_bias) -> tuple[cp.ndarray, cp.ndarray]:
        return ggdn.gdn_gates(a, b, A_log, dt_bias)

    def gdn_mixer(self, p, conv_w, A_log, dt_bias, norm_w, conv_state, ssm_state,
                  cu_seqlens_q: np.ndarray, state_slots: np.ndarray, scale: float, eps: float,
                  mode: str = "auto", records=None) -> cp.ndarray:
        """See ``ninfer.kernels.gdn.gdn_mixer``: ``gpu.gdn.gdn_step`` (two kernels, the state
        read and written once, records written as it goes) for sequences of at most
        ``gpu.gdn.STEP_MAX_T`` tokens (decode, a verify pass) of shapes it runs, else the
        composed ops.

        Raises:
            ValueError: as the composed ops (shapes, slots, mode, records).
        """
        if p.shape[0] and ggdn.gdn_step_applies(p, conv_state, ssm_state):
            cu, slots, _, s, longest = self._ragged(cu_seqlens_q, state_slots, p.shape[0],
                                                    ssm_state.shape[0])
            if mode not in gdn_ref._MODES:
                raise ValueError(f"unknown gated delta rule mode {mode!r}")
            if longest <= ggdn.STEP_MAX_T and (records is None or records.shape[1] >= longest):
                return ggdn.gdn_step(p, conv_w, conv_state, A_log, dt_bias, norm_w, ssm_state, cu,
                                     slots, s, scale, eps, records, self.config.pdl,
                                     self.config.gdn_col_split)
        return gdn_ref.gdn_mixer(self, p, conv_w, A_log, dt_bias, norm_w, conv_state,
                                 ssm_state, cu_seqlens_q, state_slots, scale, eps, mode, records)

    def causal_conv1d(self, x, w, conv_state, cu_seqlens_q: np.ndarray,
                      state_slots: np.ndarray, activation: str | None = "silu") -> cp.ndarray:
        """See ``ninfer.kernels.gdn.causal_conv1d`` (same validation and errors).

        Raises:
            ValueError: mismatched shapes, repeated slots, an unknown activation or a
                non-contiguous state pool.
        """
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"unsupported conv activation {activation!r} "
                             "(expected 'silu' or None)")
        c, kc = w.shape
        if (x.ndim != 2 or x.shape[1] != c or conv_state.shape[1:] != (kc - 1, c)
                or not conv_state.flags.c_contiguous):
            raise ValueError(f"causal_conv1d: x {x.shape}, weight {w.shape}, "
                             f"state {conv_state.shape} (must be C-contiguous)")
        cu, slots, tok_seq, s, _ = self._ragged(cu_seqlens_q, state_slots, x.shape[0],
                                                conv_state.shape[0])
        return ggdn.causal_conv1d(x, w, conv_state, cu, slots, tok_seq, s, activation)

    def gated_delta_rule(self, q, k, v, g, beta, state, cu_seqlens_q: np.ndarray,
                         state_slots: np.ndarray, scale: float, mode: str = "auto",
                         chunk_size: int = gdn_ref.CHUNK_SIZE, records=None) -> cp.ndarray:
        """See ``ninfer.kernels.gdn.gated_delta_rule``: "auto" and "chunked" run the chunked
        form (``gpu.gdn_chunk``, chunks of 64 tokens from each sequence's start, as the
        reference's default ``chunk_size``); "recurrent" and ``records`` run each sequence's
        tokens in turn (``gpu.gdn``).

        Raises:
            ValueError: mismatched shapes, repeated slots, an unknown mode, too small records,
                a non-contiguous state pool or head dims above 256.
        """
        if mode not in gdn_ref._MODES:
            raise ValueError(f"unknown gated delta rule mode {mode!r} "
                             f"(expected one of {gdn_ref._MODES})")
        t, hv, dv = v.shape
        dk = k.shape[-1]
        if (q.shape != k.shape or g.shape != (t, hv) or beta.shape != (t, hv)
                or state.shape[1:] != (hv, dk, dv) or not state.flags.c_contiguous):
            raise ValueError(f"gated_delta_rule: q {q.shape}, k {k.shape}, v {v.shape}, "
                             f"g {g.shape}, beta {beta.shape}, state {state.shape}")
        cu, slots, _, s, longest = self._ragged(cu_seqlens_q, state_slots, t, state.shape[0])
        if records is not None and (records.shape[0] != s or records.shape[1] < longest
                                    or records.shape[2:] != (gdn_ref.record_width(
                                        k.shape[1], hv, dk, dv),)):
            raise ValueError(f"records {records.shape} too small for {s} sequences "
                             f"of up to {longest} tokens")
        if records is None and mode != "recurrent" and gchunk.applies(dk, hv, q.shape[1]):
            return gchunk.gated_delta_rule(q, k, v, g, beta, state, *self._chunks(cu_seqlens_q),
                                           slots, scale)
        return ggdn.gated_delta_rule(q, k, v, g, beta, state, cu, slots, s, scale, records)


def _drops_shadow(fn):
    """``fn`` (a ``CupyOps`` op that is no shadow's consumer) preceded by dropping the pending
    q8 shadow: the op may change the array that the shadow stands for, or reuse its memory."""
    @functools.wraps(fn)
    def op(self, *args, **kwargs):
        self.handoffs.drop()
        return fn(self, *args, **kwargs)
    return op


for _name in ("embedding", "rms_norm", "rope", "rope_write_kv", "silu_mul", "write_kv",
              "paged_attention", "gated_paged_attention", "sigmoid_mul", "l2_norm",
              "gated_rms_norm",
              "gdn_gates", "causal_conv1d", "gated_delta_rule", "gdn_mixer", "argmax_into",
              "spec_accept", "spec_rows", "spec_chain", "gdn_record_conv", "gdn_commit"):
    setattr(CupyOps, _name, _drops_shadow(getattr(CupyOps, _name)))

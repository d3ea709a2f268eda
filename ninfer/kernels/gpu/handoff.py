"""Pre-quantized activations handed from one batch-1 decode kernel to the next GEMV.

Where a decode GEMV (``gemv_bulk`` with int8 activations) reads the output of the kernel just
before it, that kernel can also write the vector as the GEMV's staging would build it (a "q8
shadow": int8 codes per 32 columns, their scales and sums of squares; layout in common.cuh), and
the GEMV's blocks copy it instead of each reading, normalizing and quantizing the floats.

Which kernel feeds which GEMV is planned once per model (``plan_model``) from its layers: the
qkv GEMV feeds the attention, which feeds the o GEMV; o feeds gate_up (with the post-attention
RMSNorm), gate_up's SwiGLU epilogue feeds down, down feeds the next layer's qkv (with its input
RMSNorm) or the final norm and lm_head. A shadow written for a consumer is taken only by the
very next op call, and only if that call is the planned consumer reading the array the shadow
stands for (same data pointer: a reshape of it counts); any other op drops it.
"""
from __future__ import annotations

from dataclasses import dataclass

import cupy as cp

from ninfer.kernels.config import KernelConfig
from ninfer.kernels.gpu import linear as glin

LLAMA_LAYER = ("input_norm", "qkv", "o", "post_norm", "gate_up", "down")


@dataclass(frozen=True, slots=True)
class Feeds:
    """The GEMV that reads an op's result next: ``fused_linear(result, weight, norm=norm)``."""

    weight: object
    norm: object | None = None


@dataclass(slots=True)
class _Pending:
    ptr: int                      # data pointer of the array the shadow stands for
    feeds: Feeds                  # the consumer it was written for
    shadow: cp.ndarray | None     # None: the consumer is the GEMV after the attention


class Handoffs:
    """The hand-off plan of the models on one backend and the shadow pending between two ops.

    The plan holds each producer weight and its consumer for the backend's life (a backend
    serves the models it prepared).
    """

    def __init__(self, kc: KernelConfig) -> None:
        self.kc = kc
        self._plan: dict[int, tuple[object, Feeds, bool]] = {}   # id(w) -> (w, feeds, attention)
        self._pending: _Pending | None = None
        # shadow buffers, two per width, taken in turn (a consumer reads one while it writes the
        # other); allocated once, so captured graphs keep their addresses
        self._bufs: dict[int, list] = {}

    def plan_model(self, model) -> None:
        """Plan the hand-offs of a Llama-shaped ``model`` (``layers`` with the fields of
        ``LLAMA_LAYER``, ``norm``, ``lm_head``); other models get none."""
        layers = list(getattr(model, "layers", ()))
        if not layers or not all(hasattr(ly, f) for ly in layers for f in LLAMA_LAYER):
            return
        for i, ly in enumerate(layers):
            nxt = (Feeds(layers[i + 1].qkv, layers[i + 1].input_norm) if i + 1 < len(layers)
                   else Feeds(model.lm_head, model.norm))
            self._plan[id(ly.qkv)] = (ly.qkv, Feeds(ly.o), True)
            self._plan[id(ly.o)] = (ly.o, Feeds(ly.gate_up, ly.post_norm), False)
            self._plan[id(ly.gate_up)] = (ly.gate_up, Feeds(ly.down), False)
            self._plan[id(ly.down)] = (ly.down, nxt, False)

    def _planned(self, w) -> tuple[Feeds, bool] | None:
        entry = self._plan.get(id(w))
        return None if entry is None or entry[0] is not w else entry[1:]

    def feeds_of(self, w) -> Feeds | None:
        """The GEMV planned to read the result of the GEMV of ``w`` (None: none, or the
        attention reads it)."""
        p = self._planned(w)
        return None if p is None or p[1] else p[0]

    def drop(self) -> None:
        """Forget the pending shadow (an op that is no planned consumer runs)."""
        self._pending = None

    def after_gemv(self, w, out) -> None:
        """After the GEMV of ``w`` wrote ``out``: where the attention reads it, remember the
        GEMV after the attention for ``attention_feeds``."""
        p = self._planned(w)
        if p is not None and p[1]:
            self._pending = _Pending(out.data.ptr, p[0], None)

    def attention_feeds(self, qkv) -> Feeds | None:
        """The GEMV planned to read the attention of ``qkv`` (the pending record of the qkv GEMV
        that wrote it), or None; the record is dropped either way."""
        p, self._pending = self._pending, None
        if p is None or p.shadow is not None or qkv.data.ptr != p.ptr:
            return None
        return p.feeds

    def take(self, x, w, norm, gated: bool):
        """The q8 shadow of ``x`` written for this ``fused_linear(x, w, norm=norm,
        gated=gated)`` call, or None; the pending shadow is dropped either way."""
        p, self._pending = self._pending, None
        if (p is None or p.shadow is None or x.shape[0] != 1 or x.data.ptr != p.ptr
                or p.feeds.weight is not w or p.feeds.norm is not norm
                or not glin.shadow_consumer(self.kc, w, 1, gated)):
            return None
        return p.shadow

    def out_for(self, feeds: Feeds | None, t: int, n_out: int):
        """``gemv``'s ``shadow_out`` for a result of ``n_out`` columns that ``feeds`` names the
        consumer of, or None."""
        if feeds is None:
            return None
        w2 = feeds.weight
        if not glin.shadow_consumer(self.kc, w2, t) or w2.shape[1] != n_out:
            return None
        bufs = self._bufs.setdefault(n_out, [])
        if len(bufs) < 2:
            bufs.append(glin.new_shadow(n_out))
        else:
            bufs.reverse()   # the other one: the one written last may be this call's input
        return bufs[-1], feeds.norm, w2.sch

    def hand_on(self, out, feeds: Feeds | None, so) -> None:
        """Keep the shadow of ``so`` (``out_for``'s, or None), just written of ``out``, for the
        next call, ``fused_linear(out, feeds.weight, norm=feeds.norm)``."""
        if so is not None:
            self._pending = _Pending(out.data.ptr, feeds, so[0])

"""``CupyOps``' projections (``ninfer.kernels.ops``: ``linear``, ``fused_linear``,
``swiglu_mlp``): packed weights through ``gpu.linear``'s GEMV kernels with their prologues,
epilogues and q8 shadows (``self.handoffs``), the fp16 dequantize + cuBLAS path for longer
calls, the composed NumPy-reference order elsewhere."""
from __future__ import annotations

import cupy as cp

from ninfer.kernels import linear as linear_ref
from ninfer.kernels.gpu import elementwise as gew
from ninfer.kernels.gpu import gemm as ggemm
from ninfer.kernels.gpu import gemm_fp8 as gfp8
from ninfer.kernels.gpu import linear as glin
from ninfer.kernels.gpu.handoff import LLAMA_LAYER, Feeds


def layer_weights(model) -> list[glin.GpuWeight]:
    """The packed weights of a Llama-shaped ``model.layers`` (``LLAMA_LAYER``'s fields, a fused
    weight's parts apart), in layer order (none for other models)."""
    out = []
    for layer in getattr(model, "layers", ()):
        for field in LLAMA_LAYER:
            v = getattr(layer, field, None)
            out += [w for w in getattr(v, "parts", (v,)) if isinstance(w, glin.GpuWeight)]
    return out


class LinearOps:
    """The linear ops of ``CupyOps`` (uses its ``config``, ``handoffs``, ``_scratch``,
    ``_f16_kept`` and ``silu_mul``)."""

    def linear(self, x, w) -> cp.ndarray:
        """(T, K) @ w.T -> new (T, N) float32 (see ``gpu.linear`` for the kernels used)."""
        return self._fused_linear(x, w, feeds=None)

    def fused_linear(self, x, w, *, norm=None, eps: float = 0.0, gated: bool = False,
                     residual=None, swiglu: bool = False) -> cp.ndarray:
        """``linear`` with RMSNorm before, SiLU-gating before and/or a residual add after, or
        SwiGLU of the result (see ``ninfer.kernels.ops``). A packed weight and T <=
        ``config.gemv_max_t`` run as ``gpu.linear.gemv`` launches (the prologue fused for T <=
        ``config.fuse_max_t``; ``swiglu`` in the epilogue where ``gpu.linear.swiglu_epilogue``);
        otherwise the separate ops run in turn. Where ``w`` is a planned producer of a model's
        decode step (``prepare_model``), its result is also handed on as a q8 shadow.

        Raises:
            ValueError: ``swiglu`` with ``residual`` or ``gated``, or an odd N.
        """
        out = self._fused_linear(x, w, norm=norm, eps=eps, gated=gated, residual=residual,
                                 swiglu=swiglu, feeds=self.handoffs.feeds_of(w))
        self.handoffs.after_gemv(w, out)
        return out

    def swiglu_mlp(self, x, norm, gate_up, down, eps: float) -> cp.ndarray:
        """See ``ninfer.kernels.ops``: SiLU(gate) * up in gate_up's epilogue where
        ``gpu.linear.swiglu_epilogue`` (decode of 1 to 8 rows of large weights), on fp8 for
        prefill with ``config.prefill_fp8`` (``_prefill_mlp_fp8``), else in down's prologue."""
        if glin.swiglu_epilogue(self.config, gate_up, x.shape[0]):
            act = self.fused_linear(x, gate_up, norm=norm, eps=eps, swiglu=True)   # (T, I)
            return self.fused_linear(act, down, residual=x)
        if self._mlp_fp8(x, gate_up, down):
            return self._prefill_mlp_fp8(x, norm, gate_up, down, eps)
        gu = self._fused_linear(x, gate_up, norm=norm, eps=eps, feeds=None)   # (T, 2 I)
        return self.fused_linear(gu, down, gated=True, residual=x)

    def _mlp_fp8(self, x, gate_up, down) -> bool:
        """Whether ``swiglu_mlp`` of ``x`` takes ``_prefill_mlp_fp8``."""
        kc, t = self.config, x.shape[0]
        return (kc.prefill_fp8 and t > kc.gemv_max_t and x.dtype == cp.float32
                and all(isinstance(w, glin.GpuWeight) and w.f16 is None for w in (gate_up, down))
                and gate_up.shape[0] % 32 == 0 and gfp8.fits(x, x)   # (I % 16: down's K)
                and gfp8.supported(cp.cuda.Device().id))

    def _prefill_mlp_fp8(self, x, norm, gate_up, down, eps: float) -> cp.ndarray:
        """``swiglu_mlp`` over more rows than the GEMVs take, on fp8 (``config.prefill_fp8``):
        gate | up as bf16 from gate_up's product, silu(gate) * up written straight as down's
        e4m3 codes (``silu_mul_e4m3``), down's product added to ``x`` in its epilogue."""
        self.handoffs.drop()
        x16 = gew.rms_norm(x, norm, eps, f16=True)
        gu = cp.empty((x.shape[0], gate_up.shape[0]), dtype=cp.uint16)   # bf16 bits
        gfp8.gemm(x16, gate_up, self._weight_scratch(gate_up.shape[0] * gate_up.shape[1]), gu)
        a8, sa = gew.silu_mul_e4m3(gu)
        gfp8.gemm_codes(a8, sa, down, self._weight_scratch(down.shape[0] * down.shape[1]), x,
                        accumulate=True)
        return x

    def _fused_linear(self, x, w, *, norm=None, eps: float = 0.0, gated: bool = False,
                      residual=None, swiglu: bool = False, feeds: Feeds | None) -> cp.ndarray:
        """``fused_linear`` that hands its result on to ``feeds`` (None: to no one)."""
        kc = self.config
        shadow_in = self.handoffs.take(x, w, norm, gated)
        if swiglu:
            linear_ref.check_swiglu(w, gated, residual)
            t = x.shape[0]
            # (T > 1 is gemv_bulk_mt's: an even row stride)
            if glin.swiglu_epilogue(kc, w, t) and x.dtype == cp.float32 and (
                    x.strides[-1] == 4 and x.data.ptr % 16 == 0
                    and (t == 1 or x.strides[0] % 8 == 0)):
                out = cp.empty((t, w.shape[0] // 2), cp.float32)
                so = (self.handoffs.out_for(feeds, t, w.shape[0] // 2)
                      if glin.shadow_producer(kc, w, t, swiglu=True) else None)
                glin.gemv(kc, x, w, out, norm=norm, eps=eps, swiglu=True, shadow_in=shadow_in,
                          shadow_out=so)
                self.handoffs.hand_on(out, feeds, so)
                return out
            y = self._fused_linear(x, w, norm=norm, eps=eps, feeds=None)
            i = y.shape[1] // 2
            return self.silu_mul(y[:, :i], y[:, i:])
        t = x.shape[0]
        packed = isinstance(w, glin.GpuWeight) and 0 < t <= kc.gemv_max_t
        if packed and not glin.prologue_fuses(kc, w, t):
            x, norm, gated = linear_ref.fused_prologue(self, x, norm, eps, gated), None, False
        if (packed and x.dtype == cp.float32 and x.strides[-1] == 4 and x.data.ptr % 8 == 0
                and (t == 1 or x.strides[0] % 8 == 0)
                and (residual is None or (residual.dtype == cp.float32
                                          and residual.strides[-1] == 4))):
            out = residual if residual is not None else cp.empty((t, w.shape[0]), cp.float32)
            so = (self.handoffs.out_for(feeds, t, w.shape[0])
                  if glin.shadow_producer(kc, w, t) else None)
            glin.gemv(kc, x, w, out, norm=norm, eps=eps, gated=gated,
                      accumulate=residual is not None, shadow_in=shadow_in, shadow_out=so)
            self.handoffs.hand_on(out, feeds, so)
            return out
        if isinstance(w, glin.GpuWeight) and t > kc.gemv_max_t:
            return self._prefill_linear(x, w, norm, eps, gated, residual)
        return linear_ref.fused_linear(self, self._linear, x, w, norm=norm, eps=eps,
                                       gated=gated, residual=residual)

    def _prefill_linear(self, x, w, norm, eps: float, gated: bool, residual) -> cp.ndarray:
        """``fused_linear`` of a packed weight over more rows than the GEMVs take: the
        prologue's kernel writes the GEMM's fp16 operand itself (no float32 copy, no cast
        launch) and a residual is added in the GEMM's epilogue; the same floats as the composed
        ops (the cast rounds as ``astype``, the epilogue adds in float32)."""
        if norm is not None or gated:   # (as the composed prologue's ops drop a pending shadow)
            self.handoffs.drop()
        if norm is not None:
            x = gew.rms_norm(x, norm, eps, f16=not gated)
        if gated:
            i = x.shape[1] // 2
            x = gew.silu_mul(x[:, :i], x[:, i:], f16=True)
        if x.dtype != cp.float16:
            x = gew.to_f16(x)
        t, n = x.shape[0], w.shape[0]
        into = (residual is not None and residual.dtype == cp.float32
                and residual.shape == (t, n) and residual.flags.c_contiguous)
        out = residual if into else cp.empty((t, n), dtype=cp.float32)
        self._gemm(x, w, out, accumulate=into)
        if residual is None or into:
            return out
        residual += out
        return residual

    def prefill_gemm(self) -> str:
        """The prefill GEMMs' operands for the prepared model: "fp8" where
        ``config.prefill_fp8``, this GPU runs it (``gemm_fp8.supported``) and no fp16 copies
        were kept (``keep_f16``); else "fp16"."""
        return ("fp8" if self.config.prefill_fp8 and not self._f16_kept
                and gfp8.supported(cp.cuda.Device().id) else "fp16")

    def keep_f16(self, model) -> int:
        """Give every packed weight of a Llama-shaped ``model.layers`` (``LLAMA_LAYER``'s fields)
        its fp16 copy (``GpuWeight.f16``) where all of them fit ``config.prefill_f16_mib``;
        returns the bytes kept (0: none)."""
        seen = {id(w): w for w in layer_weights(model)}
        need = sum(2 * w.shape[0] * w.shape[1] for w in seen.values())
        if not seen or need > self.config.prefill_f16_mib << 20:
            return 0
        for w in seen.values():
            if w.f16 is None:
                w.f16 = cp.empty((w.shape[0] * w.shape[1],), dtype=cp.float16)
                ggemm.dequantize_f16(w, w.f16)
        return need

    def _gemm(self, x16, w, out, accumulate: bool = False) -> None:
        """``out (+)= x16 @ dequant(w).T`` through the fp16 copy of ``w`` (kept, or written
        into a scratch for this call) and cuBLAS, or, with ``config.prefill_fp8`` and no kept
        copy, through e4m3 codes of both operands (``gpu.gemm_fp8``; not the output head:
        ``GpuWeight.prefill_fp8``)."""
        if w.f16 is not None:
            ggemm.gemm_f16(x16, w.f16, w.shape[0], out, accumulate=accumulate)
            return
        fp8 = (self.config.prefill_fp8 and w.prefill_fp8 and gfp8.fits(x16, out)
               and gfp8.supported(cp.cuda.Device().id))
        need = w.shape[0] * w.shape[1] * (1 if fp8 else 2)
        scratch = self._weight_scratch(need)
        if fp8:
            gfp8.gemm(x16, w, scratch, out, accumulate=accumulate)
            return
        w16 = scratch[:need].view(cp.float16)
        ggemm.dequantize_f16(w, w16)
        ggemm.gemm_f16(x16, w16, w.shape[0], out, accumulate=accumulate)

    def _weight_scratch(self, nbytes: int) -> cp.ndarray:
        """The prefill GEMMs' weight operand: uint8, at least ``nbytes``, kept between calls."""
        if self._scratch is None or self._scratch.size < nbytes:
            self._scratch = None
            # (from the default pool even where a graph's warm-up makes the first GEMM)
            with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):
                self._scratch = cp.empty((nbytes,), dtype=cp.uint8)
        return self._scratch

    def _linear(self, x, w) -> cp.ndarray:
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        t = x.shape[0]
        if isinstance(w, cp.ndarray):
            if cp.cuda.get_current_stream().is_capturing():   # (CuPy refuses cuBLAS there)
                return gew.matmul_nt(x, w)
            return cp.ascontiguousarray(cp.matmul(x, w.T))
        n = w.shape[0]
        out = cp.empty((t, n), dtype=cp.float32)
        if t == 0:
            return out
        if isinstance(w, glin.FusedWeight):
            for part, a, b in zip(w.parts, w.offsets, w.offsets[1:]):
                out[:, a:b] = self._linear(x, part)
            return out
        if t <= self.config.gemv_max_t:
            glin.gemv(self.config, x, w, out)
            return out
        self._gemm(gew.to_f16(x), w, out)
        return out

"""Device time of each piece of a Qwen3.5-27B-shape prefill pass of T tokens (eager, CUDA
events; prefill is compute-bound, so host launches hide behind the kernels): a GDN block's
input projection (dequantization and GEMM apart), mixer (its gated delta rule apart), output
projection and MLP, an attention block's pieces, and the whole 4-layer pass scaled to 48 GDN +
16 attention layers. ``--ceilings`` also times torch GEMMs of the same shapes (fp16, bf16,
fp8 and int8 tensor cores) as the rates a prefill GEMM could reach.

Usage (GPU machine): PYTHONPATH=$PWD python bench/experiments/gpu_qwen35_prefill_profile.py
    [--tokens 512 8192] [--context 0] [--kv-dtype fp32] [--ceilings] [--config FIELD=JSON ...]
    [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import cupy as cp
import numpy as np

sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..")]
from gpu_qwen35_decode import CFG_27B, config_changes, patch_ops, synth_weights  # noqa: E402

from ninfer.bench.report import write_json  # noqa: E402
from ninfer.engine.models.llama import ForwardBatch  # noqa: E402
from ninfer.engine.models.qwen35 import Qwen35Config, Qwen35Model  # noqa: E402
from ninfer.kernels import get_ops  # noqa: E402
from ninfer.kernels import gdn as gdn_ref  # noqa: E402
from ninfer.kernels.config import KernelConfig  # noqa: E402
from ninfer.kernels.gpu import gemm as ggemm  # noqa: E402


def event_ms(fn, reps: int = 3) -> float:
    """Median device milliseconds of ``fn()`` after one warm-up call."""
    fn()
    cp.cuda.Device().synchronize()
    ts = []
    for _ in range(reps):
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(cp.cuda.get_elapsed_time(s, e))
    return float(np.median(ts))


def ceilings(t: int, shapes: dict) -> dict:
    """TFLOP/s of torch GEMMs (T, K) x (K, N) per dtype for each named (N, K)."""
    import torch
    out = {}
    for name, (n, k) in shapes.items():
        row = {}
        a16 = torch.randn(t, k, device="cuda", dtype=torch.float16)
        w16 = torch.randn(n, k, device="cuda", dtype=torch.float16)
        flop = 2.0 * t * n * k
        for dt in ("fp16", "bf16"):
            tdt = torch.float16 if dt == "fp16" else torch.bfloat16
            a, w = a16.to(tdt), w16.to(tdt)
            row[dt] = flop / event_ms(lambda: a @ w.T) / 1e9
        try:
            a8 = a16.to(torch.float8_e4m3fn)
            w8 = w16.to(torch.float8_e4m3fn)
            one = torch.ones((), device="cuda")
            row["fp8"] = flop / event_ms(lambda: torch._scaled_mm(
                a8, w8.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)) / 1e9
        except Exception as e:  # noqa: BLE001 (report, go on)
            row["fp8"] = repr(e)[:80]
        try:
            ai = torch.randint(-8, 8, (t, k), device="cuda", dtype=torch.int8)
            wi = torch.randint(-8, 8, (n, k), device="cuda", dtype=torch.int8)
            row["int8"] = flop / event_ms(lambda: torch._int_mm(ai, wi.T)) / 1e9
        except Exception as e:  # noqa: BLE001
            row["int8"] = repr(e)[:80]
        out[name] = {k2: (round(v, 1) if isinstance(v, float) else v) for k2, v in row.items()}
        print(f"ceiling {name} T={t}: {out[name]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 8192])
    ap.add_argument("--context", type=int, default=0, help="tokens already cached")
    ap.add_argument("--kv-dtype", default="fp32", help="how the KV cache stores K and V")
    ap.add_argument("--ceilings", action="store_true")
    ap.add_argument("--attn-tiling", default=None, metavar="BC,QREG,MINB,NW",
                    help="attn_prefill_mma's tiling at head dim 256 (and that kernel, not wgmma)")
    ap.add_argument("--config", nargs="*", default=[], metavar="FIELD=JSON",
                    help="other KernelConfig fields to change (JSON values)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    conf = config_changes(a.config)
    tiling = dict(KernelConfig().prefill_mma_tiling)
    if a.attn_tiling:
        bc, qreg, minb, nw = a.attn_tiling.split(",")
        tiling[256] = (int(bc), qreg == "true", int(minb), int(nw))
        conf.setdefault("prefill_attention", "mma")
    ops = get_ops("cupy", KernelConfig(prefill_mma_tiling=tiling, **conf))
    patch_ops(ops, 32)
    c = Qwen35Config.from_dict(dict(CFG_27B, num_hidden_layers=4))
    model = Qwen35Model(c, synth_weights(c, 32, False), ops)
    gdn, attn = model.blocks[0], model.blocks[3]
    m, am = gdn.mixer, attn.mixer
    eps, ps = c.rms_norm_eps, 16
    res = {"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
           "kv_dtype": a.kv_dtype, "rows": {}}
    for t in a.tokens:
        total = a.context + t
        pages = -(-total // ps) + 1
        kv = model.new_kv_cache(pages, ps, max_lanes=1, kv_dtype=a.kv_dtype)
        table = [list(range(pages))]
        rng = np.random.default_rng(0)
        if a.context:
            model.forward(ForwardBatch.from_sequences(
                [rng.integers(0, c.vocab_size, a.context).tolist()], [0], table, ps, [0]), kv)
        ids = rng.integers(0, c.vocab_size, t).tolist()
        b = ForwardBatch.from_sequences([ids], [a.context], table, ps, [0])
        slots = np.asarray(b.state_slots, dtype=np.int64)
        h = cp.random.default_rng(1).standard_normal((t, c.hidden_size), dtype=cp.float32)
        p = ops.fused_linear(h, m.in_proj, norm=gdn.input_norm, eps=eps)
        o = cp.zeros((t, c.value_dim), cp.float32)
        pa = ops.fused_linear(h, am.qkv, norm=attn.input_norm, eps=eps)
        nh, nkv = c.num_attention_heads, c.num_key_value_heads
        conv0, ssm0 = kv.conv[0].copy(), kv.ssm[0].copy()

        def fresh_state():   # every timed mixer call starts from the same state
            kv.conv[0][...] = conv0
            kv.ssm[0][...] = ssm0

        def qkvr():
            return ops.norm_rope_write_kv(pa, nh, nkv, True, am.q_norm, am.k_norm, eps,
                                          b.positions, c.rope_theta, kv.kv.k[0], kv.kv.v[0],
                                          b.slot_mapping, "half", c.rotary_dim, a.kv_dtype)
        qa = qkvr()
        scratch = cp.empty((max(w.shape[0] * w.shape[1] for w in
                                (m.in_proj, gdn.gate_up, gdn.down)),), cp.float16)
        x16 = h.astype(cp.float16)
        dk = c.linear_key_head_dim
        hv = c.linear_num_value_heads
        qg = cp.random.default_rng(2).standard_normal((t, c.linear_num_key_heads, dk),
                                                      dtype=cp.float32) * 0.1
        vg = cp.random.default_rng(3).standard_normal((t, hv, c.linear_value_head_dim),
                                                      dtype=cp.float32)
        gg = -cp.abs(cp.random.default_rng(4).standard_normal((t, hv), dtype=cp.float32)) * 0.1
        bg = cp.full((t, hv), 0.5, cp.float32)
        kn = gdn_ref.l2_norm(qg.get(), 1e-6)
        kn = cp.asarray(kn)
        cases = {
            "gdn.in_proj (norm + GEMM)": lambda: ops.fused_linear(h, m.in_proj,
                                                                   norm=gdn.input_norm, eps=eps),
            "  dequantize in_proj": lambda: ggemm.dequantize_f16(m.in_proj, scratch),
            "  cuBLAS fp16 in_proj": lambda: ggemm.gemm_f16(x16, scratch, m.in_proj.shape[0],
                                                            cp.empty((t, m.in_proj.shape[0]),
                                                                     cp.float32)),
            "gdn.mixer": lambda: (fresh_state(), ops.gdn_mixer(
                p, m.conv, m.A_log, m.dt_bias, m.norm, kv.conv[0], kv.ssm[0], b.cu_seqlens_q,
                slots, dk ** -0.5, eps)),
            "  gated_delta_rule": lambda: (fresh_state(), ops.gated_delta_rule(
                kn, kn, vg, gg, bg, kv.ssm[0], b.cu_seqlens_q, slots, dk ** -0.5)),
            "gdn.out_proj (+ residual)": lambda: ops.fused_linear(o, m.out, residual=h),
            "mlp (swiglu_mlp)": lambda: ops.swiglu_mlp(h, gdn.post_norm, gdn.gate_up, gdn.down,
                                                       eps),
            "  dequantize gate_up": lambda: ggemm.dequantize_f16(gdn.gate_up, scratch),
            "attn.qkv (norm + GEMM)": lambda: ops.fused_linear(h, am.qkv, norm=attn.input_norm,
                                                                eps=eps),
            "attn.norm_rope_write_kv": qkvr,
            "attn.paged_attention": lambda: ops.paged_attention(
                qa, kv.kv.k[0], kv.kv.v[0], b.cu_seqlens_q, b.context_lens, b.block_tables,
                c.head_dim ** -0.5, a.kv_dtype),
            "attn.o (+ residual)": lambda: ops.fused_linear(
                cp.zeros((t, nh * c.head_dim), cp.float32), am.o, residual=h),
        }
        row = {}
        for name, fn in cases.items():
            row[name] = round(event_ms(fn), 3)
            print(f"T={t} ctx={a.context} {name}: {row[name]:.3f} ms", flush=True)

        def whole():
            fresh_state()
            model.run(b, kv, slots, False, False, None)
        row["4-layer pass"] = round(event_ms(whole), 3)
        gdn_ms = row["gdn.in_proj (norm + GEMM)"] + row["gdn.mixer"] + \
            row["gdn.out_proj (+ residual)"]
        attn_ms = row["attn.qkv (norm + GEMM)"] + row["attn.norm_rope_write_kv"] + \
            row["attn.paged_attention"] + row["attn.o (+ residual)"]
        est = 48 * (gdn_ms + row["mlp (swiglu_mlp)"]) + 16 * (attn_ms + row["mlp (swiglu_mlp)"])
        row["64-layer estimate ms"] = round(est, 1)
        row["tok/s estimate"] = round(t / est * 1e3, 1)
        row["share"] = {"gdn projections": round(48 * (gdn_ms - row["gdn.mixer"]) / est, 3),
                        "gdn mixer": round(48 * row["gdn.mixer"] / est, 3),
                        "mlp": round(64 * row["mlp (swiglu_mlp)"] / est, 3),
                        "attention": round(16 * attn_ms / est, 3)}
        print(f"T={t}: 4-layer pass {row['4-layer pass']} ms; estimate {est:.1f} ms = "
              f"{row['tok/s estimate']} tok/s; shares {row['share']}", flush=True)
        if a.ceilings:
            row["ceilings TFLOP/s"] = ceilings(t, {
                "in_proj": tuple(m.in_proj.shape), "gate_up": tuple(gdn.gate_up.shape),
                "down": tuple(gdn.down.shape)})
        res["rows"][t] = row
        del kv
    print(json.dumps(res))
    write_json(res, a.json)


if __name__ == "__main__":
    main()

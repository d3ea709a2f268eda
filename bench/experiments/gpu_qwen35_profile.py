"""Device time of each piece of a Qwen3.5-27B-shape decode step at batch 1, replayed from CUDA
graphs (host launch cost excluded, graph replay's inter-kernel gaps included): a GDN block's
input projection, mixer, output projection and MLP, an attention block's pieces, the head.

Usage (GPU machine): PYTHONPATH=$PWD python bench/experiments/gpu_qwen35_profile.py
    [--seqs S] [--rows T] [--json OUT]

``--seqs S``: S lanes decoding one token each (batched decode); ``--rows T`` (T > 1): one lane's
verify pass of T tokens, with GDN state records and attention over T one-token rows as
``Qwen35Spec.spec_round`` runs it.

A 4-layer model of the 27B shape (3 GDN + 1 gated attention; weights generated on the device as
``bench/gpu_qwen35_decode.py`` does), one lane after a 64-token prefill. Each piece is captured
20 times in one graph (``gpu_ops_profile.graph_seconds``); GEMVs also report GB/s of weights.
The step estimate scales the blocks to 48 GDN + 16 attention layers plus the head.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import cupy as cp
import numpy as np

sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..")]
from gpu_ops_profile import graph_seconds  # noqa: E402
from gpu_qwen35_decode import CFG_27B, config_changes, nb, patch_ops, synth_weights  # noqa: E402

from ninfer.bench.report import write_json  # noqa: E402
from ninfer.engine.models.llama import ForwardBatch  # noqa: E402
from ninfer.engine.models.qwen35 import Qwen35Config, Qwen35Model  # noqa: E402
from ninfer.engine.models.qwen35_spec import SpecRecords  # noqa: E402
from ninfer.kernels import get_ops  # noqa: E402
from ninfer.kernels.config import KernelConfig  # noqa: E402

REPS = 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--config", nargs="*", default=[], metavar="FIELD=JSON",
                    help="KernelConfig fields to change, as JSON")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.rows > 1 and a.seqs != 1:
        ap.error("--rows T > 1 profiles one lane's verify pass (--seqs 1)")
    conf = config_changes(a.config)
    ops = get_ops("cupy", KernelConfig(**conf))
    patch_ops(ops, 32)
    c = Qwen35Config.from_dict(dict(CFG_27B, num_hidden_layers=4))
    model = Qwen35Model(c, synth_weights(c, 32, False), ops)
    ns, nt = a.seqs, a.rows
    kv = model.new_kv_cache(16 * ns, 16, max_lanes=ns)
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(ns)]
    prompt = np.random.default_rng(0).integers(0, c.vocab_size, 64).tolist()
    model.forward(ForwardBatch.from_sequences([prompt] * ns, [0] * ns, tables, 16,
                                              list(range(ns))), kv)
    b = ForwardBatch.from_sequences([[5] * nt] * ns, [64] * ns, tables, 16, list(range(ns)))
    slots = np.asarray(b.state_slots, dtype=np.int64)
    rec, attn_b = None, None
    if nt > 1:   # a verify pass: state records, attention over one-token rows
        rec = SpecRecords.new(model, slots, [64], [nt], nt)
        attn_b = ForwardBatch.from_sequences([[5]] * nt, list(range(64, 64 + nt)),
                                             tables * nt, 16)
    t = ns * nt
    h = cp.random.default_rng(1).standard_normal((t, c.hidden_size), dtype=cp.float32)
    gdn, attn = model.blocks[0], model.blocks[3]
    eps = c.rms_norm_eps
    x = h.copy()
    p = ops.fused_linear(h, gdn.mixer.in_proj, norm=gdn.input_norm, eps=eps)
    o = cp.zeros((t, c.value_dim), cp.float32)
    qkv_in = h.copy()

    def t_us(fn) -> float:
        return graph_seconds(lambda i: fn(), REPS) * 1e6

    m, am = gdn.mixer, attn.mixer
    nh, nkv = c.num_attention_heads, c.num_key_value_heads
    pa = ops.fused_linear(h, am.qkv, norm=attn.input_norm, eps=eps)
    ab = b if attn_b is None else attn_b
    qa = ops.norm_rope_write_kv(pa, nh, nkv, True, am.q_norm, am.k_norm, eps, b.positions,
                                c.rope_theta, kv.kv.k[0], kv.kv.v[0], b.slot_mapping, "half",
                                c.rotary_dim)
    cases = {
        "gdn.in_proj (norm + GEMV)": (lambda: ops.fused_linear(h, m.in_proj, norm=gdn.input_norm,
                                                               eps=eps), m.in_proj),
        "gdn.mixer (gdn_step)": (lambda: ops.gdn_mixer(
            p, m.conv, m.A_log, m.dt_bias, m.norm, kv.conv[0], kv.ssm[0], b.cu_seqlens_q,
            slots, c.linear_key_head_dim ** -0.5, eps,
            records=None if rec is None else rec.ssm[0]), None),
        "gdn.out_proj (+ residual)": (lambda: ops.fused_linear(o, m.out, residual=x), m.out),
        "mlp (swiglu_mlp)": (lambda: ops.swiglu_mlp(x, gdn.post_norm, gdn.gate_up, gdn.down, eps),
                             (gdn.gate_up, gdn.down)),
        "gdn block (whole)": (lambda: model._gdn(m, 0, x, gdn.input_norm, b, slots, kv, rec),
                              None),
        "attn.qkv (norm + GEMV)": (lambda: ops.fused_linear(qkv_in, attn.mixer.qkv,
                                                            norm=attn.input_norm, eps=eps),
                                   attn.mixer.qkv),
        "attn.o (+ residual)": (lambda: ops.fused_linear(
            cp.zeros((t, c.num_attention_heads * c.head_dim), cp.float32), attn.mixer.o,
            residual=x), attn.mixer.o),
        "attn.norm_rope_write_kv": (lambda: ops.norm_rope_write_kv(
            pa, nh, nkv, True, am.q_norm, am.k_norm, eps, b.positions, c.rope_theta,
            kv.kv.k[0], kv.kv.v[0], b.slot_mapping, "half", c.rotary_dim, kv.kv.dtype), None),
        "attn.paged_attention": (lambda: ops.paged_attention(
            qa, kv.kv.k[0], kv.kv.v[0], ab.cu_seqlens_q, ab.context_lens, ab.block_tables,
            c.head_dim ** -0.5), None),
        "attn.sigmoid_mul": (lambda: ops.sigmoid_mul(qa.reshape(t, -1), qa.reshape(t, -1)), None),
        "attn.gated_paged_attention (all of the above)": (lambda: ops.gated_paged_attention(
            pa, nh, nkv, am.q_norm, am.k_norm, eps, b.positions, c.rope_theta, kv.kv.k[0],
            kv.kv.v[0], b.slot_mapping, b.cu_seqlens_q, b.context_lens, b.block_tables,
            c.head_dim ** -0.5, "half", c.rotary_dim, kv.kv.dtype), None),
        "attn block mixer (whole)": (lambda: model._attention(attn.mixer, 0, x, attn.input_norm,
                                                              ab, kv), None),
        "head (norm + lm_head)": (lambda: ops.fused_linear(h, model.lm_head, norm=model.norm,
                                                           eps=eps), model.lm_head),
    }
    res = {"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "seqs": ns,
           "rows": nt, "config": conf, "us": {}, "GBs": {}}
    for name, (fn, w) in cases.items():
        us = t_us(fn)
        res["us"][name] = round(us, 2)
        line = f"{name}: {us:.1f} us"
        if w is not None:
            nbytes = sum(nb(x) for x in w) if isinstance(w, tuple) else nb(w)
            res["GBs"][name] = round(nbytes / us / 1e3, 1)
            line += f" ({nbytes / 1e6:.1f} MB, {res['GBs'][name]} GB/s)"
        print(line, flush=True)
    u = res["us"]
    res["step_estimate_ms"] = round((48 * (u["gdn block (whole)"] + u["mlp (swiglu_mlp)"])
                                     + 16 * (u["attn block mixer (whole)"] + u["mlp (swiglu_mlp)"])
                                     + u["head (norm + lm_head)"]) / 1e3, 3)
    print(json.dumps(res))
    write_json(res, a.json)


if __name__ == "__main__":
    main()

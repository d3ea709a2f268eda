"""Synthetic Qwen3.5-27B-shape decode on the GPU: eager, and replayed from CUDA graphs at
batch 1, 8 and 32 and at long contexts.

Usage (on the GPU machine):
    python bench/gpu_qwen35_decode.py [--layers 64] [--group 32] [--context 64] [--steps 32]
        [--batches 1 8 32] [--long-contexts 32768 131072] [--mtp-rounds 16]
        [--draft-tokens 1 2 3 4 5] [--kv-dtype fp32] [--config FIELD=INT ...] [--json OUT.json]

The model is the 27B shape of ``spec/models.md`` A.2 / serving-contract 9.1: hidden 5120, 64
layers (48 Gated DeltaNet + 16 gated full attention, every 4th), 24 / 4 heads of 256, GDN 16 q/k
heads and 48 v heads of 128, intermediate 17408, vocab 248320, untied head, one MTP layer. Every
2-D weight (embedding and head included) is int4 groupwise (``gpu.linear.GpuWeight`` "q4",
symmetric, fp16 scales, ``--group`` elements per scale); its random codes and scales are
generated ON THE GPU with ``cupy.random`` (the model's ``ops.prepare_weight`` /
``ops.prepare_fused`` are intercepted for weights that carry no host payload), so nothing of
the ~14 GB crosses the host. Norms / A_log / dt_bias / the conv kernel are small host arrays.

Measures, in one process:
- device copy bandwidth (2 GiB device-to-device copy, read + write, median of 10);
- eager batch-1 decode after a ``--context``-token prefill (``model.forward`` + device argmax);
- decode replayed from the CUDA graphs of ``ops.decode_runner`` (as ``ninfer serve`` runs it),
  B lanes from a ``--context`` frontier, the ids read back every step: aggregate tok/s, and the
  device time of a step from 8 replays queued without read-back;
- one lane at each ``--long-contexts`` frontier (the attention layers' KV read grows);
- bytes a step streams = every packed weight read once (head included, embedding table
  excluded) + per lane the GDN recurrent + conv state read and written + the attention K/V read
  at the context; roofline fraction = bytes/token x tok/s / copy bandwidth;
- with the MTP head: whole speculative rounds from CUDA graphs (verify k drafts, accept, roll
  the GDN state back, draft k more: ``time_spec``) for each ``--draft-tokens`` k at known
  acceptance (0, k // 2 and k drafts a round; the drafts are the target's own greedy tokens,
  one corrupted), and each round's cost over a plain step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import cupy as cp
import numpy as np

from ninfer.engine.models.llama import ForwardBatch
from ninfer.engine.models.qwen35 import Qwen35Config, Qwen35Model
from ninfer.bench.decode import graph_device_s
from ninfer.bench.report import write_json
from ninfer.kernels import get_ops
from ninfer.kernels.config import KernelConfig
from ninfer.kernels.gpu import linear as glin
from ninfer.store.quant import QuantTensor
from ninfer.bench.roofline import copy_bandwidth

CFG_27B = dict(vocab_size=248320, hidden_size=5120, num_hidden_layers=64,
               num_attention_heads=24, num_key_value_heads=4, head_dim=256,
               intermediate_size=17408, rms_norm_eps=1e-6, rope_theta=1e7,
               partial_rotary_factor=0.25, linear_conv_kernel_dim=4,
               linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
               linear_num_value_heads=48, tie_word_embeddings=False, mtp_num_hidden_layers=1)


def device_q4(shape, group: int, rng: cp.random.RandomState) -> glin.GpuWeight:
    """Random packed q4 codes + fp16 scales of an (N, K) weight, made on the device. Scale
    ~ 1 / (4.6 sqrt(K)) keeps unit-RMS activations near unit RMS."""
    n, k = shape
    codes = rng.randint(0, 256, size=(n, k // 2), dtype=cp.uint8)
    s = 1.0 / (4.6 * np.sqrt(k))
    scales = rng.uniform(0.5 * s, 1.5 * s, size=(n, k // group), dtype=cp.float32)
    return glin.GpuWeight.pack("q4", (n, k), group, codes, scales.astype(cp.float16))


def synth_weights(c: Qwen35Config, group: int, mtp: bool) -> dict:
    """Name -> QuantTensor. 2-D weights are payload-less q4 placeholders (codes None) that the
    patched prepare_* fill on the device; the rest are small host arrays."""
    h, hd, nh, nkv, inter = (c.hidden_size, c.head_dim, c.num_attention_heads,
                             c.num_key_value_heads, c.intermediate_size)
    hv = c.linear_num_value_heads
    q4 = lambda n, k: QuantTensor("q4", (n, k), group=group)
    f32 = lambda *shape, v=0.0: QuantTensor("f32", shape, data=np.full(shape, v, np.float32))
    w = {"model.embed_tokens.weight": q4(c.vocab_size, h), "lm_head.weight": q4(c.vocab_size, h),
         "model.norm.weight": f32(h)}
    rng = np.random.default_rng(0)

    def block(p, kind):
        w[p + "input_layernorm.weight"] = f32(h)
        w[p + "post_attention_layernorm.weight"] = f32(h)
        w[p + "mlp.gate_proj.weight"] = q4(inter, h)
        w[p + "mlp.up_proj.weight"] = q4(inter, h)
        w[p + "mlp.down_proj.weight"] = q4(h, inter)
        if kind == "linear_attention":
            a = p + "linear_attn."
            w[a + "in_proj_qkv.weight"] = q4(c.conv_dim, h)
            w[a + "in_proj_z.weight"] = q4(c.value_dim, h)
            w[a + "in_proj_b.weight"] = q4(hv, h)
            w[a + "in_proj_a.weight"] = q4(hv, h)
            w[a + "conv1d.weight"] = QuantTensor(
                "f32", (c.conv_dim, c.linear_conv_kernel_dim),
                data=(rng.standard_normal((c.conv_dim, c.linear_conv_kernel_dim)) * 0.5
                      ).astype(np.float32))
            w[a + "A_log"] = f32(hv)
            w[a + "dt_bias"] = f32(hv)
            w[a + "norm.weight"] = f32(c.linear_value_head_dim, v=1.0)
            w[a + "out_proj.weight"] = q4(h, c.value_dim)
        else:
            a = p + "self_attn."
            w[a + "q_proj.weight"] = q4(2 * nh * hd, h)
            w[a + "k_proj.weight"] = q4(nkv * hd, h)
            w[a + "v_proj.weight"] = q4(nkv * hd, h)
            w[a + "q_norm.weight"] = f32(hd)
            w[a + "k_norm.weight"] = f32(hd)
            w[a + "o_proj.weight"] = q4(h, nh * hd)

    for i, kind in enumerate(c.layer_types):
        block(f"model.layers.{i}.", kind)
    if mtp:
        block("mtp.layers.0.", "full_attention")
        # mtp.fc is split on the host (split_k): a real (small, 30 MB) host q4 tensor
        k2 = 2 * h
        w["mtp.fc.weight"] = QuantTensor(
            "q4", (h, k2), group=group,
            codes=rng.integers(0, 256, size=(h, k2 // 2), dtype=np.uint8),
            scales=np.full((h, k2 // group), 1.0 / (4.6 * np.sqrt(k2)), np.float16))
        for n in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                  "mtp.norm.weight"):
            w[n] = f32(h)
    return w


def patch_ops(ops, group: int):
    rng = cp.random.RandomState(1234)
    pw, pf = ops.prepare_weight, ops.prepare_fused

    def prepare_weight(t):
        if t.scheme == "q4" and t.codes is None:
            return device_q4(tuple(t.shape), group, rng)
        return pw(t)

    def prepare_fused(ts):
        if all(t.scheme == "q4" and t.codes is None for t in ts):
            return device_q4((sum(t.shape[0] for t in ts), ts[0].shape[1]), group, rng)
        return pf(ts)

    ops.prepare_weight, ops.prepare_fused = prepare_weight, prepare_fused


def nb(w) -> int:
    if isinstance(w, cp.ndarray):
        return int(w.nbytes)
    if hasattr(w, "parts"):
        return sum(nb(p) for p in w.parts)
    return int(w.nbytes)


def weight_bytes(m: Qwen35Model) -> int:
    """Bytes one main-model decode pass reads from weights (embedding table excluded)."""
    total = nb(m.norm) + nb(m.lm_head)
    for b in m.blocks:
        total += nb(b.input_norm) + nb(b.post_norm) + nb(b.gate_up) + nb(b.down)
        total += sum(nb(getattr(b.mixer, f)) for f in b.mixer.__slots__)
    return total


def time_decode(graphs, kv, ops, tables, context: int, steps: int, ps: int, vocab: int,
                roofline) -> dict:
    """``steps`` graph-replayed decode steps of ``len(tables)`` lanes (state slots 0..B-1) from a
    frontier of ``context`` tokens set directly (zero state, unwritten KV: the speed does not
    depend on the values), each step's ids read back before the next is built, as the engine's
    plain rounds; then as many with the lookahead (``greedy(feed=True)``: each step launched
    before the last one's ids are read); then 8 replays queued without read-back, timed by CUDA
    events (device time)."""
    bsz = len(tables)
    for i in range(bsz):
        kv.reset_state(i)
        kv.lengths[i] = context
    ids = np.random.default_rng(bsz).integers(0, vocab, size=bsz).tolist()
    n, times = context, []

    def batch_at(tokens, pos):
        return ForwardBatch.from_sequences([[t] for t in tokens], [pos] * bsz, tables, ps,
                                           list(range(bsz)))

    def step(tokens):
        return graphs.forward(batch_at(tokens, n), kv)

    for i in range(steps + 3):
        t1 = time.perf_counter()
        ids = ops.argmax(step(ids)).tolist()
        n += 1
        if i >= 3:
            times.append(time.perf_counter() - t1)
    tok_s = bsz * steps / sum(times)
    # the engine's lookahead: step N + 1 launched, fed on step N's ids, before those are read
    pending, ahead = graphs.greedy(batch_at(ids, n), kv), []
    for i in range(steps + 3):
        t1 = time.perf_counter()
        n += 1
        nxt = graphs.greedy(batch_at([0] * bsz, n), kv, feed=True)
        pending()
        if i >= 3:
            ahead.append(time.perf_counter() - t1)
        pending = nxt
    ids = pending().tolist()
    n += 1
    s, e = cp.cuda.Event(), cp.cuda.Event()
    ops.synchronize()
    s.record()
    for _ in range(8):
        step(ids)
        n += 1
    e.record()
    e.synchronize()
    dev_ms = cp.cuda.get_elapsed_time(s, e) / 8
    return {"tok_s": round(tok_s, 2), "step_ms_median": round(statistics.median(times) * 1e3, 3),
            "tok_s_lookahead": round(bsz * steps / sum(ahead), 2),
            "device_ms_per_step": round(dev_ms, 3), **roofline(bsz, context + steps / 2, tok_s),
            "device_roofline_fraction": round(
                roofline(bsz, context, 1e3 * bsz / dev_ms)["roofline_fraction"], 4)}


def time_spec(model, kv, ops, a, ps: int, plain_ms: float, plain_dev_ms: float) -> dict:
    """Whole speculative rounds of one lane from CUDA graphs (``gpu.spec_graphs``) at known
    acceptance: the drafts are the target's own greedy tokens (a plain greedy decode from the
    same state), the first ``acc`` of k kept and the next one corrupted, so each round accepts
    exactly ``acc`` (random weights never draft right). Per (k, acc): ms a round, tok/s and
    the round's cost over a plain step (host time); then ``spec_device_ms`` per k."""
    kmax, rounds = max(a.draft_tokens), a.mtp_rounds
    n0 = a.context
    need = n0 + (rounds + 3) * (kmax + 1) + 2 * kmax + 8
    pages = -(-need // ps)
    table = list(range(pages))
    dec = ops.decode_runner(model, max_pages=pages, max_batch=1)
    snap = [cp.copy(x[0]) for x in kv.ssm + kv.conv]

    def restore():
        for x, y in zip(kv.ssm + kv.conv, snap):
            x[0] = y
        kv.lengths[0] = n0

    restore()
    seq, n = [0], n0   # seq[i]: the token at position n0 + i (greedy from token 0 at n0)
    while len(seq) < need - n0:
        b = ForwardBatch.from_sequences([[seq[-1]]], [n], [table], ps, [0])
        seq.append(int(ops.argmax(dec.forward(b, kv))[0]))
        n += 1
    sg = dec.spec_rounds()
    out = {"plain_step_ms": plain_ms}
    for k in a.draft_tokens:
        for acc in sorted({0, k // 2, k}):
            restore()
            n, times, got = n0, [], []
            for r in range(rounds + 2):
                d = seq[n - n0 + 1:n - n0 + 1 + k]
                if acc < k:
                    d[acc] = (d[acc] + 1) % model.config.vocab_size
                t1 = time.perf_counter()
                res = sg.run([([seq[n - n0]] + d, n, table, 0)], k, kv)
                dt = time.perf_counter() - t1
                kept = int(res.acc[0])
                kv.lengths[0] = n = n + kept
                if r >= 2:
                    times.append(dt)
                    got.append(kept - 1)
            ms = 1e3 * sum(times) / len(times)
            row = {"round_ms": round(ms, 3), "accepted_mean": round(sum(got) / len(got), 3),
                   "tok_s": round((1 + sum(got) / len(got)) / ms * 1e3, 2),
                   "cost_over_plain_step": round(ms / plain_ms, 3)}
            out[f"k{k}_acc{acc}"] = row
            print(f"mtp k={k} accepting {acc}:", row, flush=True)
        out[f"k{k}_device"] = row = spec_device_ms(sg, k, kv, ops, plain_dev_ms)
        print(f"mtp k={k} device:", row, flush=True)
    return out


def spec_device_ms(sg, k: int, kv, ops, plain_dev_ms: float, reps: int = 20) -> dict:
    """Device time of one lane's round graph (fixed work whatever it accepts) and of its
    verify pass alone (the k + 1 rows through the target model with their state records, and
    the argmax), each replayed ``reps`` times on the last round's inputs, against a plain
    step's device time."""
    bk = sg._b[(1, k)]
    io, model = bk.io, sg.model
    stream = cp.cuda.Stream(non_blocking=True)
    stream.wait_event(cp.cuda.get_current_stream().record())
    with cp.cuda.using_allocator(cp.cuda.MemoryPool().malloc), stream:
        sg._register(bk, kv)
        stream.begin_capture()
        try:
            logits = model.run(io.verify, kv, io.verify.state_slots, all_logits=True,
                               _records=io.records)
            ops.argmax_into(logits, io.targets)
        finally:
            verify = stream.end_capture()
    stream.synchronize()
    out = {"plain_step_device_ms": plain_dev_ms}
    for name, g in (("round", bk.graph), ("verify", verify)):
        ms = 1e3 * graph_device_s(g, reps, stream)
        out[f"{name}_device_ms"] = round(ms, 3)
        out[f"{name}_over_plain_step"] = round(ms / plain_dev_ms, 3)
    return out


def config_changes(pairs: list[str]) -> dict:
    """``--config`` words FIELD=JSON as KernelConfig changes (a mapping's entries change, its
    others stay)."""
    conf = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in pairs)}
    for k, v in conf.items():
        if isinstance(v, dict):
            conf[k] = {**getattr(KernelConfig(), k), **v}
    return conf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--eager-steps", type=int, default=6)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--long-contexts", type=int, nargs="*", default=[32768, 131072])
    ap.add_argument("--mtp-rounds", type=int, default=16, help="0: no MTP head")
    ap.add_argument("--draft-tokens", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--kv-dtype", default="fp32", help="how the KV cache stores K and V")
    ap.add_argument("--config", nargs="*", default=[], metavar="FIELD=JSON",
                    help='KernelConfig fields to change, as JSON (4, true, {"q8":[16,2,5,1]})')
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    conf = config_changes(a.config)
    ops = get_ops("cupy", KernelConfig(**conf))
    patch_ops(ops, a.group)
    c = Qwen35Config.from_dict(dict(CFG_27B, num_hidden_layers=a.layers))
    t0 = time.perf_counter()
    w = synth_weights(c, a.group, a.mtp_rounds > 0)
    model = Qwen35Model(c, w, ops)
    ops.synchronize()
    build_s = time.perf_counter() - t0
    del w
    bw = copy_bandwidth("cupy")
    wbytes = weight_bytes(model)
    ps = 16
    lanes = max(a.batches)
    short = -(-(a.context + 2 * (a.steps + 3) + 0 + 32) // ps)   # (plain, ahead)
    longest = max([a.context] + a.long_contexts)
    long_pages = -(-(longest + 2 * a.steps + 24) // ps)   # (time_decode runs 2 steps + 16)
    kv = model.new_kv_cache(max(lanes * short, long_pages), ps, max_lanes=lanes,
                            kv_dtype=a.kv_dtype)
    table = [list(range(short))]
    state_bytes = 2 * sum(int(x[0].nbytes) for x in kv.conv + kv.ssm)  # read + write, 1 lane
    res = {"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
           "date": time.strftime("%Y-%m-%d %H:%M"), "layers": a.layers, "group": a.group,
           "config": conf, "kv_dtype": a.kv_dtype,
           "build_s": round(build_s, 1), "copy_bw_GBs": round(bw / 1e9, 1),
           "weight_bytes_per_token": wbytes, "gdn_state_bytes_per_token_rw": state_bytes,
           "vram_used_GB": round(cp.get_default_memory_pool().used_bytes() / 1e9, 2)}
    print(res, flush=True)

    def roofline(lanes_n: int, context: float, tok_s: float) -> dict:
        """Bytes a step streams (weights once, each lane's state and KV) over the copy rate."""
        step_bytes = wbytes + lanes_n * (state_bytes + context * kv.bytes_per_token)
        return {"bytes_per_step": int(step_bytes),
                "roofline_fraction": round(step_bytes * tok_s / lanes_n / bw, 4)}

    # eager batch-1 decode after a real prefill (the path before CUDA graphs; a few steps)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, c.vocab_size, size=a.context).tolist()
    t0 = time.perf_counter()
    logits = model.forward(ForwardBatch.from_sequences([prompt], [0], table, ps, [0]), kv)
    last = int(ops.argmax(logits)[0])
    ops.synchronize()
    res["prefill_s"] = round(time.perf_counter() - t0, 2)
    n, times = a.context, []
    for step in range(a.eager_steps + 2):
        t1 = time.perf_counter()
        b = ForwardBatch.from_sequences([[last]], [n], table, ps, [0])
        last = int(ops.argmax(model.forward(b, kv))[0])
        n += 1
        if step >= 2:
            times.append(time.perf_counter() - t1)
    tps = len(times) / sum(times)
    res["decode_b1_eager"] = {"tok_s": round(tps, 2), **roofline(1, n, tps)}
    print("decode b1 eager:", res["decode_b1_eager"], flush=True)

    # CUDA-graph decode (what ninfer serve runs): buckets captured up front
    graphs = ops.decode_runner(model, max_pages=short, max_batch=lanes)
    graphs.capture_all(kv)
    res["graph_pool_GB"] = round(graphs.pool_bytes / 1e9, 3)
    rows = {}
    for bsz in a.batches:
        tables = [list(range(i * short, (i + 1) * short)) for i in range(bsz)]
        rows[f"decode_b{bsz}"] = time_decode(graphs, kv, ops, tables, a.context, a.steps, ps,
                                             c.vocab_size, roofline)
        print(f"decode b{bsz}:", rows[f"decode_b{bsz}"], flush=True)
    for ctx in a.long_contexts:   # one lane at a long frontier (KV grows; weights do not)
        lg = ops.decode_runner(model, max_pages=long_pages, max_batch=1)
        rows[f"decode_b1_ctx{ctx}"] = time_decode(lg, kv, ops, [list(range(long_pages))], ctx,
                                                  a.steps, ps, c.vocab_size, roofline)
        print(f"decode b1 at {ctx}:", rows[f"decode_b1_ctx{ctx}"], flush=True)
        del lg
    res.update(rows)
    if a.mtp_rounds > 0 and model.mtp is not None:
        b1 = rows["decode_b1"]
        res["mtp"] = time_spec(model, kv, ops, a, ps, b1["step_ms_median"],
                               b1["device_ms_per_step"])
        print(json.dumps(res))
    write_json(res, a.json)


if __name__ == "__main__":
    main()

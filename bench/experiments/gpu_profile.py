"""Where a decode step's time goes on the GPU: host (Python + launch) vs device time of one
``model.forward`` at batch 1 and 8, and the device time and bandwidth of each linear layer's
GEMV at T = 1, 2, 4, 8 (``cupyx.profiler.benchmark``, CUDA-event device times).

Usage: python bench/experiments/gpu_profile.py MODEL [--json OUT]
"""
from __future__ import annotations

import argparse
import json

import cupy as cp
import numpy as np
from cupyx.profiler import benchmark

from ninfer.engine.models.llama import ForwardBatch, LlamaModel
from ninfer.kernels import get_ops
from ninfer.store.artifact import load_model_file


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    ops = get_ops("cupy")
    model = LlamaModel.from_artifact(load_model_file(a.model), ops)
    res = {"forward": {}, "gemv": {}}
    for bsz in (1, 8):
        kv = model.new_kv_cache(bsz * 8, 16)
        tables = [list(range(i * 8, (i + 1) * 8)) for i in range(bsz)]
        b = ForwardBatch.from_sequences([[5] * 64 for _ in range(bsz)], [0] * bsz, tables, 16)
        model.forward(b, kv)
        d = ForwardBatch.from_sequences([[7] for _ in range(bsz)], [64] * bsz, tables, 16)
        r = benchmark(lambda: model.forward(d, kv), (), n_repeat=20, n_warmup=3)
        res["forward"][bsz] = {"cpu_ms": float(np.median(r.cpu_times) * 1e3),
                               "gpu_ms": float(np.median(r.gpu_times[0]) * 1e3)}
        print("forward", bsz, res["forward"][bsz], flush=True)
    layer = model.layers[0]
    for name, w in (("qkv", layer.qkv), ("o", layer.o), ("gate_up", layer.gate_up),
                    ("down", layer.down), ("lm_head", model.lm_head)):
        for t in (1, 2, 4, 8, 16):
            x = cp.asarray(np.random.default_rng(t).standard_normal((t, w.shape[1]),
                                                                   dtype=np.float32))
            r = benchmark(ops.linear, (x, w), n_repeat=50, n_warmup=5)
            g = float(np.median(r.gpu_times[0]))
            res["gemv"][f"{name}/T{t}"] = {"us": round(g * 1e6, 1),
                                           "GBs": round(w.nbytes / g / 1e9, 1),
                                           "cpu_us": round(float(np.median(r.cpu_times)) * 1e6, 1)}
            print(name, w.shape, t, res["gemv"][f"{name}/T{t}"], flush=True)
    x = cp.asarray(np.random.default_rng(0).standard_normal((1, model.config.hidden_size),
                                                           dtype=np.float32))
    for name, fn, args in (("rms_norm", ops.rms_norm, (x, model.norm, 1e-5)),
                           ("add", lambda u, v: u.__iadd__(v), (x, x))):
        r = benchmark(fn, args, n_repeat=50, n_warmup=5)
        print(name, "cpu_us", round(float(np.median(r.cpu_times)) * 1e6, 1), "gpu_us",
              round(float(np.median(r.gpu_times[0])) * 1e6, 1), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

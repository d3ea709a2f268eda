"""What each piece of a Qwen3.5-27B-shape decode step costs inside the step (with the PDL
overlap of its neighbours), by leaving it out: the batch-1 decode graph (as ``ninfer serve``
captures it) is captured again with the ops of one piece replaced by their outputs' shapes
(no launch), and its device time compared with the whole step's. A piece's time in
``gpu_qwen35_profile.py`` is its own graph's; here it is what the step saves without it.

Usage (GPU machine): PYTHONPATH=$PWD python bench/experiments/gpu_qwen35_ablate.py
    [--layers 64] [--seqs 1] [--config FIELD=INT ...]
"""
from __future__ import annotations

import argparse
import os
import sys

import cupy as cp
import numpy as np

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..")]
from gpu_qwen35_decode import CFG_27B, patch_ops, synth_weights  # noqa: E402

from ninfer.engine.models.llama import ForwardBatch  # noqa: E402
from ninfer.engine.models.qwen35 import Qwen35Config, Qwen35Model  # noqa: E402
from ninfer.kernels import get_ops  # noqa: E402
from ninfer.kernels.config import KernelConfig  # noqa: E402

OPS = ("gdn_mixer", "gated_paged_attention", "swiglu_mlp", "fused_linear")


class Ablate:
    """Wraps ``ops``' step methods: each call that runs keeps its output shape (by op, weight
    and input shapes); with ``skip`` naming pieces, their calls launch nothing and return an
    empty array of that shape (a residual GEMV returns its residual)."""

    def __init__(self, ops, pieces: dict):
        self.pieces, self.skip, self.shapes = pieces, set(), {}
        for name in OPS:
            real = getattr(ops, name)
            setattr(ops, name, self._wrap(name, real))

    def piece_of(self, name: str, args) -> str:
        if name != "fused_linear":
            return name
        w = args[1]
        return next((k for k, ws in self.pieces.items() if any(w is x for x in ws)), "other")

    def _wrap(self, name, real):
        def call(*args, **kw):
            i = (name, id(args[1]) if name == "fused_linear" else 0,
                 tuple(x.shape for x in args if isinstance(x, cp.ndarray)))
            if self.piece_of(name, args) in self.skip and i in self.shapes:
                if kw.get("residual") is not None:
                    return kw["residual"]
                return cp.empty(self.shapes[i], dtype=cp.float32)
            out = real(*args, **kw)
            self.shapes[i] = out.shape
            return out
        return call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--config", nargs="*", default=[], metavar="FIELD=INT")
    a = ap.parse_args()
    conf = {k: (v == "true") if v in ("true", "false") else int(v)
            for k, v in (kv.split("=", 1) for kv in a.config)}
    ops = get_ops("cupy", KernelConfig(**conf))
    patch_ops(ops, 32)
    c = Qwen35Config.from_dict(dict(CFG_27B, num_hidden_layers=a.layers,
                                    mtp_num_hidden_layers=0))
    model = Qwen35Model(c, synth_weights(c, 32, False), ops)
    gdn = [b for b in model.blocks if hasattr(b.mixer, "in_proj")]
    att = [b for b in model.blocks if hasattr(b.mixer, "qkv")]
    pieces = {"gdn.in_proj": [b.mixer.in_proj for b in gdn],
              "gdn.out_proj": [b.mixer.out for b in gdn],
              "attn.qkv": [b.mixer.qkv for b in att], "attn.o": [b.mixer.o for b in att],
              "head": [model.lm_head]}
    ab = Ablate(ops, pieces)
    ps, ns, ctx = 16, a.seqs, 64
    pages = 16
    kv = model.new_kv_cache(pages * ns, ps, max_lanes=ns, kv_dtype="fp16")
    tables = [list(range(pages * i, pages * (i + 1))) for i in range(ns)]
    runs = [(), ("gdn_mixer",), ("gdn.in_proj",), ("gdn.out_proj",), ("swiglu_mlp",),
            ("attn.qkv",), ("attn.o",), ("gated_paged_attention",), ("head",),
            ("gdn.in_proj", "gdn_mixer", "gdn.out_proj", "swiglu_mlp", "attn.qkv", "attn.o",
             "gated_paged_attention", "head")]

    def batch(ahead: int = 0):   # one token a lane, ``ahead`` past its frontier
        return ForwardBatch.from_sequences([[5]] * ns, [int(kv.lengths[i]) + ahead
                                                        for i in range(ns)], tables, ps,
                                           list(range(ns)))

    def frontier() -> None:
        for i in range(ns):
            kv.reset_state(i)
            kv.lengths[i] = ctx

    frontier()
    model.forward(batch(), kv)   # every call's output shape, once (the same in every run)
    base = None
    for skip in runs:
        ab.skip = set(skip)
        dec = ops.decode_runner(model, max_pages=pages, max_batch=ns)
        frontier()
        for _ in range(3):
            dec.forward(batch(), kv)      # the first call captures
        ops.synchronize()
        s, e = cp.cuda.Event(), cp.cuda.Event()
        ts = []
        for _ in range(5):
            bs = [batch(k) for k in range(8)]   # (each forward moves the frontier one on)
            s.record()
            for b in bs:
                dec.forward(b, kv)
            e.record()
            e.synchronize()
            ts.append(cp.cuda.get_elapsed_time(s, e) / 8)
        ms = float(np.median(ts))
        base = ms if base is None else base
        name = " + ".join(skip) or "whole step"
        print(f"{name:60s} {ms:7.3f} ms   saves {1e3 * (base - ms):8.1f} us", flush=True)
        del dec


if __name__ == "__main__":
    main()

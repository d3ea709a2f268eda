"""Which prefill GEMMs' fp8 rounding costs a Llama model its quality: ``--prefill-gemm fp8``
emulated on the NumPy backend (each operand rounded to the nearest e4m3 value of itself over
a scale a row, the row's largest |value| / 448, as ``gpu.gemm_fp8`` rounds them; the product in
float32), on every layer's weights and activations, on one side only, or on every GEMM but one
kind, and scored as ``ninfer bench perplexity --kl`` scores it against the plain model.

Usage (the CPU; ~1 min a variant for SmolLM2 on 2 cores):
    python bench/experiments/fp8_error_split.py [MODEL] [--text README.md] [--windows 7]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from ninfer.bench import model as bench_model
from ninfer.bench.perplexity import Scores, kl_summary, ppl_summary, window_logits, windows
from ninfer.engine.tokenizer import Tokenizer
from ninfer.server import resolve_model_path
from ninfer.store.artifact import load_model_file

KINDS = ("qkv", "o", "gate_up", "down")


def e4m3(x: np.ndarray) -> np.ndarray:
    """The nearest e4m3 value of each of ``x`` (|x| <= 448 after scaling; ties to even):
    3 mantissa bits, normals from 2^-6, subnormals in steps of 2^-9."""
    a = np.abs(x.astype(np.float64))
    step = 2.0 ** (np.floor(np.log2(np.maximum(a, 2.0 ** -6))) - 3)
    return (np.sign(x) * np.minimum(np.round(a / step) * step, 448.0)).astype(np.float32)


def rows_e4m3(x: np.ndarray) -> np.ndarray:
    """``x`` rounded as the GPU rounds an operand: e4m3 of each row over its largest |x| / 448
    (1 for a row of zeros), times that scale."""
    m = np.abs(x).max(axis=1, keepdims=True)
    s = np.where(m > 0, m / 448.0, 1.0).astype(np.float32)
    return e4m3(x / s) * s


def emulate(ops, kinds: dict[int, str], on: set[str], weights: bool, acts: bool) -> None:
    """Make ``ops.linear`` round the operands of the GEMMs of weights whose kind is in ``on``
    (``kinds``: id of a layer weight -> its field) when it multiplies more than one row."""
    plain = ops.linear
    rounded: dict[int, np.ndarray] = {}

    def linear(x, w):
        if x.shape[0] <= 1 or kinds.get(id(w)) not in on:
            return plain(x, w)
        if weights and id(w) not in rounded:
            rounded[id(w)] = rows_e4m3(w)
        return plain(rows_e4m3(x) if acts else x, rounded[id(w)] if weights else w)

    ops.linear = linear


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--text", default="README.md")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=0)
    a = ap.parse_args()
    art = load_model_file(resolve_model_path(a.model))
    tok = Tokenizer.from_dict(art.tokenizer)
    ids = tok.encode(open(a.text, encoding="utf-8").read(), parse_special=False)
    wins = windows(ids, a.ctx, a.windows, tok.bos_id if tok.add_bos else None)
    kw = dict(max_positions=a.ctx, max_batch=1, cuda_graph=False, artifact=art)
    ref = bench_model.load(a.model, "numpy", **kw)
    kv = ref.new_kv(1, a.ctx)
    base = [window_logits(ref, kv, w, None) for w in wins]
    variants = [("every GEMM, both operands", set(KINDS), True, True),
                ("weights only", set(KINDS), True, False),
                ("activations only", set(KINDS), False, True)]
    variants += [(f"all but {k}", set(KINDS) - {k}, True, True) for k in KINDS]
    variants += [(f"{k} only", {k}, True, True) for k in KINDS]
    print(f"{len(wins)} windows of {a.ctx} tokens\n| emulated on | perplexity | ln(PPL / PPL ref) "
          "| KL mean | KL p99 | same top token |", flush=True)
    for name, on, w8, x8 in variants:
        t0 = time.perf_counter()
        bm = bench_model.load(a.model, "numpy", **kw)
        kinds = {id(getattr(ly, k)): k for ly in bm.base.layers for k in KINDS}
        emulate(bm.ops, kinds, on, w8, x8)
        kv = bm.new_kv(1, a.ctx)
        s = Scores([], [], [], [])
        for w, ref_logits in zip(wins, base):
            s.add(window_logits(bm, kv, w, None), w[a.ctx // 2 + 1:], ref_logits)
        p, k = ppl_summary(s.nll), kl_summary(s)
        print(f"| {name} | {p['ppl']:.4f} | {k['ln_ppl_ratio']:+.4f} | {k['kl_mean']:.4f} | "
              f"{k['kl_p99']:.4f} | {100 * k['same_top']:.1f} % | (ref {k['ref_ppl']:.4f}, "
              f"{time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()

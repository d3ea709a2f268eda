"""Experiment: a lean batch-1 Q4_0 GEMV (``gpu_lean_gemv.cu``: plain 16-byte register loads,
dp4a on int8 activations, no shared-memory ring) alone and as the 8B shape's chain of decode
GEMVs (32 x qkv, o, gate_up, down, then lm_head; random weights) captured in one CUDA graph with
programmatic dependent launch. Prints, per variant, the chain's device time per token and its
fraction of the memory roofline (weight bytes / copy bandwidth measured in the same run), next to
the isolated GEMVs with L2 cold and warm. No attention, norms or sampling: the chain bounds what
the per-op decode step's GEMVs could cost with this kernel (session 15, bench/gpu_notes.md).

    python bench/gpu_lean_chain.py [--variants 'G=8,pref=1;G=4,pref=0'] [--spin-ns 0,8000]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ninfer.kernels import gpu  # noqa: E402
from ninfer.kernels.gpu import launch as pdl  # noqa: E402
from gpu_decode import copy_bandwidth  # noqa: E402  (bench/ is on sys.path)

HID, QKV, FF, VOCAB, LAYERS = 4096, 6144, 14336, 128256, 32


def kernel_source() -> str:
    common = (Path(gpu.__file__).parent / "common.cuh").read_text().replace("#pragma once", "")
    return common + (Path(__file__).parent / "gpu_lean_gemv.cu").read_text()


class Lean:
    """Compiled instantiations of ``lean_q4``, one per (segs, acc) and variant."""

    def __init__(self, warps: int, g: int, pref: int, minb: int):
        self.warps, self.g, self.pref, self.minb = warps, g, pref, minb
        self.names = {(s, a): f"lean_q4<{warps},{s},{g},{'true' if a else 'false'},"
                              f"{'true' if pref else 'false'},{minb}>"
                      for s in (4, 14) for a in (False, True)}
        self.mod = cp.RawModule(code=kernel_source(), options=("--std=c++17",),
                                name_expressions=list(self.names.values()) + [
                                    "spin_kernel", "empty_kernel", "barrier_kernel"])
        self.fns = {k: self.mod.get_function(v) for k, v in self.names.items()}
        self.spin = self.mod.get_function("spin_kernel")
        self.empty = self.mod.get_function("empty_kernel")
        self.barrier = self.mod.get_function("barrier_kernel")
        self.grid = gpu.sm_count() * minb

    def __call__(self, w, x, y, acc=False):
        codes, scales, n, k = w
        pdl.launch(self.fns[(k // 1024, acc)], (self.grid,), (self.warps * 32,),
                   (codes, scales, x, y, np.int32(n)))


def make_weight(n: int, k: int, rng: cp.random.RandomState):
    codes = rng.randint(0, 256, size=n * k // 2, dtype=cp.uint8)
    scales = (rng.uniform(0.5, 1.5, size=n * k // 32) * (1.0 / 64)).astype(cp.float16)
    return (codes.view(cp.uint32), scales.view(cp.uint16), n, k)


def reference(w, x: np.ndarray) -> np.ndarray:
    codes, scales, n, k = w
    c = cp.asnumpy(codes).view(np.uint8).reshape(n, k // 32, 16)
    q = np.concatenate([c & 15, c >> 4], axis=2).astype(np.int64) - 8          # (n, nb, 32)
    dw = cp.asnumpy(scales).view(np.float16).astype(np.float64).reshape(n, k // 32)
    xb = x.astype(np.float32).reshape(k // 32, 32)
    amax = np.abs(xb).max(axis=1)
    inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    xq = np.rint(xb * inv[:, None]).astype(np.int64)
    dx = (amax / np.float32(127)).astype(np.float64)
    dots = np.einsum("nbj,bj->nb", q, xq)
    return (dw * dx[None, :] * dots).sum(axis=1)


def check(lean: Lean, rng) -> dict:
    out = {}
    for k in (4096, 14336):
        w = make_weight(300, k, rng)
        x = cp.asarray(np.random.default_rng(k).standard_normal(k).astype(np.float32))
        y = cp.full(300, np.nan, dtype=cp.float32)
        lean(w, x, y)
        ref = reference(w, cp.asnumpy(x))
        got = cp.asnumpy(y).astype(np.float64)
        err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        out[f"k{k}_max_rel_err"] = err
        out[f"k{k}_ok"] = bool(np.all(np.isfinite(got)) and err < 1e-4)
    return out


def isolated(lean: Lean, rng, bw: float) -> dict:
    flush = cp.empty(256 << 20, dtype=cp.uint8)
    res = {}
    for name, (n, k) in {"qkv": (QKV, HID), "o": (HID, HID), "gate_up": (2 * FF, HID),
                         "down": (HID, FF)}.items():
        w = make_weight(n, k, rng)
        x = cp.asarray(np.random.default_rng(1).standard_normal(k).astype(np.float32))
        y = cp.zeros(n, dtype=cp.float32)
        nbytes = n * k * 9 // 16
        cold, warm = [], []
        for _ in range(7):
            flush.fill(1)
            s, m, e = cp.cuda.Event(), cp.cuda.Event(), cp.cuda.Event()
            s.record()
            lean(w, x, y)
            m.record()
            lean(w, x, y)
            e.record()
            e.synchronize()
            cold.append(cp.cuda.get_elapsed_time(s, m) * 1e3)
            warm.append(cp.cuda.get_elapsed_time(m, e) * 1e3)
        c, h = statistics.median(cold), statistics.median(warm)
        res[name] = {"MB": round(nbytes / 1e6, 1), "cold_us": round(c, 2), "warm_us": round(h, 2),
                     "cold_frac_copy_bw": round(nbytes / bw / (c * 1e-6), 3),
                     "warm_x_copy_bw": round(nbytes / bw / (h * 1e-6), 3)}
        del w
    return res


def graph_replay_s(fn, replays: int, skip: int = 0, reset=None) -> float:
    """Median seconds of one replay of ``fn``'s launches captured in a CUDA graph (run once
    eagerly first), over ``replays`` replays after ``skip`` warm-ups; ``reset()`` runs before
    each replay, outside the timed span."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        fn()
        stream.synchronize()
        stream.begin_capture()
        fn()
        g = stream.end_capture()
        ts = []
        for i in range(skip + replays):
            if reset is not None:
                reset()
            s, e = cp.cuda.Event(), cp.cuda.Event()
            s.record(stream)
            g.launch(stream=stream)
            e.record(stream)
            e.synchronize()
            if i >= skip:
                ts.append(cp.cuda.get_elapsed_time(s, e) * 1e-3)
    return statistics.median(ts)


def chain(lean: Lean, layers, head, spin_ns: int, bw: float) -> dict:
    h = cp.asarray(np.random.default_rng(2).standard_normal(HID).astype(np.float32))
    qkv = cp.zeros(QKV, dtype=cp.float32)
    gu = cp.zeros(2 * FF, dtype=cp.float32)
    logits = cp.zeros(VOCAB, dtype=cp.float32)
    flag = cp.zeros(64, dtype=cp.float32)
    h0 = h.copy()

    def step():
        for wq, wo, wgu, wd in layers:
            lean(wq, h, qkv)
            if spin_ns:
                pdl.launch(lean.spin, (8,), (32,), (flag, np.int64(spin_ns)))
            lean(wo, qkv, h, acc=True)
            lean(wgu, h, gu)
            lean(wd, gu, h, acc=True)
        lean(head, h, logits)

    t = graph_replay_s(step, 10, skip=2, reset=lambda: cp.copyto(h, h0))
    nbytes = sum(w[2] * w[3] * 9 // 16 for lw in layers for w in lw) + head[2] * head[3] * 9 // 16
    return {"spin_ns": spin_ns, "ms": round(t * 1e3, 4), "GB_per_token": round(nbytes / 1e9, 3),
            "frac_roofline": round(nbytes / bw / t, 4),
            "gemv_launches": LAYERS * 4 + 1}


def floors(lean: Lean) -> dict:
    """Device µs per PDL kernel boundary (a graph of 160 empty kernels, 132 x 512 threads) and
    per grid barrier (160 in one persistent launch of 132 x 512 threads), the latter also with
    one warp per block streaming HBM meanwhile."""
    y = cp.zeros(4, dtype=cp.float32)
    n = 160
    sms = gpu.sm_count()

    def timed(fn):   # µs
        return graph_replay_s(fn, 7) * 1e6

    out = {}
    out["pdl_boundary_us"] = round(timed(lambda: [
        pdl.launch(lean.empty, (sms,), (512,), (y,)) for _ in range(n)]) / n, 3)
    bar = cp.zeros(1, dtype=cp.uint32)
    done = cp.zeros(1, dtype=cp.uint32)
    buf = cp.zeros((2 << 30) // 16 * 4, dtype=cp.uint32)   # 2 GiB, never L2-resident
    out["grid_barrier_us"] = round(timed(lambda: pdl.launch(
        lean.barrier, (sms,), (512,), (bar, np.int32(n), np.int64(0), np.int64(0), done, y),
        pdl=False)) / n, 3)

    def loaded():
        done.fill(0)
        pdl.launch(lean.barrier, (sms,), (544,), (bar, np.int32(n), buf,
                                                   np.int64(buf.size // 4), done, y), pdl=False)
    out["grid_barrier_under_hbm_stream_us"] = round(timed(loaded) / n, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="W=16,G=8,pref=1,minb=1;W=16,G=8,pref=0,minb=1;"
                                          "W=8,G=8,pref=1,minb=1;W=8,G=8,pref=1,minb=2")
    ap.add_argument("--spin-ns", default="0,8000")
    ap.add_argument("--out")
    ap.add_argument("--floors", action="store_true",
                    help="also time a PDL kernel boundary and a grid barrier (empty phases)")
    a = ap.parse_args()
    bw = copy_bandwidth()
    rng = cp.random.RandomState(0)
    layers = [tuple(make_weight(n, k, rng) for n, k in
                    ((QKV, HID), (HID, HID), (2 * FF, HID), (HID, FF))) for _ in range(LAYERS)]
    head = make_weight(VOCAB, HID, rng)
    res = {"copy_bw_GBps": round(bw / 1e9, 1), "device": cp.cuda.runtime.getDeviceProperties(0)
           ["name"].decode(), "pdl": pdl.available(), "variants": []}
    if a.floors:
        first = Lean(16, 8, 0, 1)
        res["floors"] = floors(first)
        print(json.dumps(res["floors"]), flush=True)
    for spec in a.variants.split(";") if a.variants else []:
        kv = dict(p.split("=") for p in spec.split(","))
        lean = Lean(int(kv.get("W", 16)), int(kv.get("G", 8)), int(kv.get("pref", 1)),
                    int(kv.get("minb", 1)))
        v = {"variant": spec, "check": check(lean, rng)}
        v["isolated"] = isolated(lean, rng, bw)
        v["chain"] = [chain(lean, layers, head, int(s), bw) for s in a.spin_ns.split(",")]
        res["variants"].append(v)
        print(json.dumps(v), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "variants"}))


if __name__ == "__main__":
    main()

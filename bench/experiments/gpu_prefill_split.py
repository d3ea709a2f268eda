"""Where a prefill pass's time goes on the GPU: the host's time to issue one ``model.forward``
against the device's time for it (``cupyx.profiler.benchmark``), and the device time of each
op the model calls (CUDA events around every ``ops`` method, summed by name over the pass).

A pass whose host time is close to its device time is host-bound (launch and dispatch cost);
one whose device time is far above the sum of its ops' useful work is bound by some op: the
per-op table names it. Usage (GPU machine):

    python bench/experiments/gpu_prefill_split.py [MODEL] --prefill 512,4096 [--json OUT]
        [--profile N]

``--profile N`` adds the N functions with the most host time of their own over 10 passes
(cProfile; CuPy's launches, allocations and copies show as their callers' time).
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats

import cupy as cp
import numpy as np
from cupyx.profiler import benchmark

from ninfer.bench.model import PAGE_SIZE, load, pages
from ninfer.engine.models.llama import ForwardBatch

_OPS = ("embedding", "fused_linear", "swiglu_mlp", "rope_paged_attention", "norm_rope_write_kv",
        "paged_attention", "gdn_mixer", "sigmoid_mul", "rms_norm", "linear")


def _timed_ops(ops, totals: collections.Counter):
    """Wrap ``ops``' methods in ``_OPS`` so that each call adds its device ms to ``totals``
    (events recorded around it, read after the pass); returns the list of pending records."""
    pending = []

    def wrap(name, fn):
        def timed(*a, **kw):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            out = fn(*a, **kw)
            e1.record()
            pending.append((name, e0, e1))
            return out
        return timed

    for name in _OPS:
        fn = getattr(ops, name, None)
        if fn is not None:
            setattr(ops, name, wrap(name, fn))
    return pending


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="default: SmolLM2")
    ap.add_argument("--prefill", default="512,4096")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    a = ap.parse_args()
    lengths = [int(x) for x in a.prefill.split(",")]
    bm = load(a.model, "cupy", max_positions=max(lengths) + 64, max_batch=1, cuda_graph=False)
    res = {}
    for p in lengths:
        kv = bm.new_kv(1, p)
        ids = np.random.default_rng(1).integers(0, bm.config.vocab_size, size=p).tolist()

        def one_pass():
            batch = ForwardBatch.from_sequences([ids], [0], [list(range(pages(p)))], PAGE_SIZE,
                                                bm.slots(kv, 1))
            return bm.base.forward(batch, kv)

        r = benchmark(one_pass, (), n_repeat=10, n_warmup=3)
        row = {"host_ms": float(np.median(r.cpu_times) * 1e3),
               "device_ms": float(np.median(r.gpu_times[0]) * 1e3)}
        totals: collections.Counter = collections.Counter()
        saved = {n: getattr(bm.ops, n) for n in _OPS if hasattr(bm.ops, n)}
        pending = _timed_ops(bm.ops, totals)
        one_pass()
        cp.cuda.Device().synchronize()
        for name, e0, e1 in pending:
            totals[name] += cp.cuda.get_elapsed_time(e0, e1)
        for n, fn in saved.items():
            setattr(bm.ops, n, fn)
        row["ops_ms"] = {k: round(v, 3) for k, v in totals.most_common()}
        row["calls"] = dict(collections.Counter(n for n, _, _ in pending))
        res[p] = row
        print(f"prefill {p}: host {row['host_ms']:.2f} ms, device {row['device_ms']:.2f} ms "
              f"a pass ({p / row['device_ms'] * 1e3:,.0f} tok/s by device time)", flush=True)
        for k, v in row["ops_ms"].items():
            print(f"  {k:22s} {v:9.3f} ms  ({row['calls'][k]} calls; events around each call "
                  "include the host's issue time where the queue ran dry)")
        if a.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(10):
                one_pass()
            cp.cuda.Device().synchronize()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(a.profile)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

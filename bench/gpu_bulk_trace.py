"""Where a batch-1 decode step's GEMV time goes, launch by launch: every ``gemv_bulk`` block
records globaltimer marks (``-DBULK_TRACE``, ``gpu/linear.cu``): its start, the return of
``griddepcontrol.wait``, the end of the activation staging, the arrival of its first weight slot
and the end of its consumers. One captured decode step is replayed and, per launch, this prints
the gaps that make up the per-GEMV fixed cost (session 15, bench/gpu_notes.md):

- ``resident``: from the previous launch's last block end to this launch's first block start
  (blocks cannot become resident before the previous kernel's leave their multiprocessor);
- ``wait``: block start to the median return of griddepcontrol.wait;
- ``stage``: staging the activations (median over blocks);
- ``slot0``: from staged to the first slot's bytes (median);
- ``stream``: first slot to the median block end; ``tail``: median to last block end.

    python bench/gpu_bulk_trace.py MODEL.gguf [--context 64] [--steps 8]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out")
    a = ap.parse_args()
    import cupy as cp
    from ninfer.kernels import gpu
    gpu.DEFINES = ("-DBULK_TRACE",)
    from gpu_decode import decode_bench   # bench/ is on sys.path
    from ninfer.engine.models.llama import LlamaModel
    from ninfer.kernels import get_ops
    from ninfer.kernels.gpu.graphs import CudaGraphDecoder
    from ninfer.store.artifact import load_model_file
    ops = get_ops("cupy")
    model = LlamaModel.from_artifact(load_model_file(a.model), ops)
    dec = CudaGraphDecoder(model, max_pages=-(-(a.context + a.steps + 16) // 16))
    kv = dec.new_kv_cache(-(-(a.context + a.steps + 8) // 16), 16)
    decode_bench(dec, ops, kv, 1, a.context, a.steps)   # captures the batch-1 graph
    bk = dec._b[1]
    mods = [m for k, m in gpu._MODULES.items() if k[0] == "linear" and k[2] == gpu.DEFINES]
    counters = []
    for m in mods:
        try:
            counters.append((cp.ndarray((1,), cp.uint32, memptr=m.get_global("bt_n")),
                             cp.ndarray((65536 * 8,), cp.uint64,
                                        memptr=m.get_global("bt_buf"))))
        except Exception:   # a module without gemv_bulk
            pass
    stream = cp.cuda.get_current_stream()
    for _ in range(3):
        bk.graph.launch(stream=stream)
    stream.synchronize()
    for n, _ in counters:
        n[...] = 0
    bk.graph.launch(stream=stream)
    stream.synchronize()
    recs = []
    for n, buf in counters:
        k = min(int(n.get()[0]), 65536)
        if k:
            recs.append(buf[: k * 8].get().reshape(k, 8))
    r = np.concatenate(recs)
    # one launch = the blocks of one weight (codes address) ... a weight runs once per step
    launches = []
    for ptr in np.unique(r[:, 7]):
        b = r[r[:, 7] == ptr]
        launches.append(b)
    launches.sort(key=lambda b: int(b[:, 0].min()))
    t_origin = int(launches[0][:, 0].min())
    rows, prev_end = [], None
    for b in launches:
        st, wt, sg, s0, en = (b[:, i].astype(np.int64) for i in range(5))
        n_rows, k = int(b[0, 6] & 0xFFFFFFFF), int(b[0, 6] >> 32)
        sms = (b[:, 5] & 0xFFFF).astype(np.int64)
        med = lambda v: float(np.median(v))   # noqa: E731
        rows.append({
            "N": n_rows, "K": k, "blocks": len(b),
            "sms_with_2_blocks": int((np.bincount(sms) > 1).sum()),
            "start_us": round((st.min() - t_origin) / 1e3, 2),
            "resident_us": None if prev_end is None else round((st.min() - prev_end) / 1e3, 2),
            "start_spread_us": round((st.max() - st.min()) / 1e3, 2),
            "wait_us": round(med(wt - st) / 1e3, 2),
            "stage_us": round(med(sg - wt) / 1e3, 2),
            "slot0_us": round(med(s0 - sg) / 1e3, 2),
            "stream_us": round(med(en - s0) / 1e3, 2),
            "tail_us": round((en.max() - np.median(en)) / 1e3, 2),
            "total_us": round((en.max() - st.min()) / 1e3, 2)})
        prev_end = int(en.max())
    step_us = (prev_end - t_origin) / 1e3
    summary = {}
    for key in ("resident_us", "wait_us", "stage_us", "slot0_us", "stream_us", "tail_us",
                "total_us"):
        vals = [x[key] for x in rows if x[key] is not None]
        summary[key] = {"sum": round(sum(vals), 1), "median": round(statistics.median(vals), 2)}
    by_shape = {}
    for x in rows:
        by_shape.setdefault(f"{x['N']}x{x['K']}", []).append(x)
    shapes = {s: {key: round(statistics.median([x[key] for x in xs if x[key] is not None]), 2)
                  for key in ("resident_us", "wait_us", "stage_us", "slot0_us", "stream_us",
                              "tail_us", "total_us", "sms_with_2_blocks")}
              for s, xs in by_shape.items()}
    res = {"launches": len(rows), "gemv_span_us": round(step_us, 1), "summary": summary,
           "by_shape": shapes}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps({**res, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

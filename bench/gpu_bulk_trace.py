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

    python bench/gpu_bulk_trace.py MODEL.gguf [--context 64] [--steps 8] [--defines A,B=1]

(``--defines``: experiment switches of the kernels, as ``gpu_decode.py --variants def=...``;
``NINFER_Q8_SHADOW=0`` in the environment traces the decode without q8 shadows.) Per shape it
also gives the consumer warps' clock cycles a ring step (median over blocks): ``wait_cyc_step``
waiting for the slot's bytes, ``loop_cyc_step`` the whole loop; with ``--defines
BULK_TRACE_STEP`` also ``load_cyc_step`` (slot in -> the first chunk's words in registers) and
``math_cyc_step`` (-> the step's sums done).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def attention_timeline(ar: np.ndarray, launches: list) -> dict:
    """Per layer, from the qkv GEMV's last block to the o GEMV's release: medians over the
    layers (µs) of the attention kernel's and attn_merge's steps (``-DATTN_TRACE`` records)."""
    layers = len(launches) // 4
    att = ar[(ar[:, 5] & 0xFF) == 0]
    mrg = ar[(ar[:, 5] & 0xFF) == 1]
    att = att[np.argsort(att[:, 0])]
    mrg = mrg[np.argsort(mrg[:, 0])]
    pa, pm = len(att) // layers, len(mrg) // layers
    steps = {k: [] for k in ("release", "qkv_loaded_roped", "positions", "partials",
                             "merge_release", "merge", "o_release", "qkv_end_to_o_release")}
    for i in range(layers):
        qkv, o = launches[4 * i], launches[4 * i + 1]
        a = att[i * pa:(i + 1) * pa].astype(np.int64)
        m = mrg[i * pm:(i + 1) * pm].astype(np.int64)
        qkv_end = int(qkv[:, 4].max())
        o_rel = float(np.median(o[:, 1].astype(np.int64)))
        med = lambda v: float(np.median(v))   # noqa: E731
        steps["release"].append(med(a[:, 1]) - qkv_end)
        steps["qkv_loaded_roped"].append(med(a[:, 2] - a[:, 1]))
        steps["positions"].append(med(a[:, 3] - a[:, 2]))
        steps["partials"].append(int(a[:, 4].max()) - med(a[:, 3]))
        if pm:
            steps["merge_release"].append(med(m[:, 1]) - int(a[:, 4].max()))
            steps["merge"].append(int(m[:, 4].max()) - med(m[:, 1]))
            steps["o_release"].append(o_rel - int(m[:, 4].max()))
        steps["qkv_end_to_o_release"].append(o_rel - qkv_end)
    return {"blocks_per_launch": [pa, pm],
            **{k: round(statistics.median(v) / 1e3, 2) for k, v in steps.items() if v}}


BT_WORDS = 14   # uint64 words of a gemv_bulk trace record (linear.cu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out")
    ap.add_argument("--defines", default="",
                    help="comma-separated experiment switches (NAME or NAME=VALUE) to compile "
                         "the kernels with, besides the trace marks")
    ap.add_argument("--budget", default="",
                    help="gpu.linear.BULK_BUDGET as gpu_decode.py's budget= knob: "
                         "NxK:KiB[/BPS]+...")
    a = ap.parse_args()
    import cupy as cp
    from ninfer.kernels import gpu
    gpu.DEFINES = ("-DBULK_TRACE", "-DATTN_TRACE") + tuple(
        f"-D{d}" for d in a.defines.split(",") if d)
    from gpu_decode import decode_bench   # bench/ is on sys.path
    from ninfer.engine.models.llama import LlamaModel
    from ninfer.kernels import get_ops
    from ninfer.kernels.gpu.graphs import CudaGraphDecoder
    from ninfer.store.artifact import load_model_file
    from ninfer.kernels.gpu import linear as glin
    glin.BULK_BUDGET.update(glin.parse_bulk_budget(a.budget))
    ops = get_ops("cupy")
    model = LlamaModel.from_artifact(load_model_file(a.model), ops)
    # (graphs captured for a 4,096-position context, as gpu_decode.py: the same attention splits)
    dec = CudaGraphDecoder(model, max_pages=-(-max(4096, a.context + a.steps + 16) // 16))
    kv = dec.new_kv_cache(-(-(a.context + a.steps + 8) // 16), 16)
    decode_bench(dec, ops, kv, 1, a.context, a.steps)   # captures the batch-1 graph
    bk = dec._b[1]
    wc = glin.BULK_SHAPE["q8" if glin.bulk_q8() else "f16"][0]   # consumer warps a block
    mods = [m for k, m in gpu._MODULES.items() if k[0] == "linear" and k[2] == gpu.DEFINES]
    counters = []
    for m in mods:
        try:
            counters.append((cp.ndarray((1,), cp.uint32, memptr=m.get_global("bt_n")),
                             cp.ndarray((65536 * BT_WORDS,), cp.uint64,
                                        memptr=m.get_global("bt_buf"))))
        except Exception:   # a module without gemv_bulk
            pass
    attn_mods = []
    for k, m in gpu._MODULES.items():
        if k[0] == "attention" and k[2] == gpu.DEFINES:
            attn_mods.append((cp.ndarray((1,), cp.uint32, memptr=m.get_global("at_n")),
                              cp.ndarray((65536 * 8,), cp.uint64,
                                         memptr=m.get_global("at_buf"))))
    counters += attn_mods
    stream = cp.cuda.get_current_stream()
    for _ in range(3):
        bk.graph.launch(stream=stream)
    stream.synchronize()
    for n, _ in counters:
        n[...] = 0
    bk.graph.launch(stream=stream)
    stream.synchronize()
    recs = []
    for n, buf in counters[:len(counters) - len(attn_mods)]:
        k = min(int(n.get()[0]), 65536)
        if k:
            recs.append(buf[: k * BT_WORDS].get().reshape(k, BT_WORDS))
    arecs = [buf[: min(int(n.get()[0]), 65536) * 8].get().reshape(-1, 8)
             for n, buf in attn_mods]
    ar = np.concatenate(arecs) if arecs else np.zeros((0, 8), np.uint64)
    r = np.concatenate(recs)
    # one launch = the blocks of one weight (codes address) ... a weight runs once per step
    launches = []
    for ptr in np.unique(r[:, 7]):
        b = r[r[:, 7] == ptr]
        # (blocks with no rows, e.g. half of a short stream's grid, never mark their first
        # slot, and words 0-4 of a record are not cleared: left out)
        launches.append(b[b[:, 10] > 0] if (b[:, 10] > 0).any() else b)
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
            "total_us": round((en.max() - st.min()) / 1e3, 2),
            # consumer warps' clock cycles a ring step (median over the blocks): waiting for the
            # slot's bytes, and the whole loop
            "wait_cyc_step": round(med(b[:, 8] / b[:, 10].clip(1) / wc)),
            "loop_cyc_step": round(med(b[:, 9] / b[:, 10].clip(1) / wc)),
            # with --defines BULK_TRACE_STEP: slot in -> first chunk's words in registers, and
            # from there -> the step's sums (0 without)
            "load_cyc_step": round(med(b[:, 11] / b[:, 10].clip(1) / wc)),
            "math_cyc_step": round(med(b[:, 12] / b[:, 10].clip(1) / wc)),
            "steps": int(np.median(b[:, 10]))})
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
                              "tail_us", "total_us", "sms_with_2_blocks", "wait_cyc_step",
                              "loop_cyc_step", "load_cyc_step", "math_cyc_step", "steps")}
              for s, xs in by_shape.items()}
    res = {"launches": len(rows), "gemv_span_us": round(step_us, 1), "summary": summary,
           "by_shape": shapes}
    if len(ar):
        res["attention"] = attention_timeline(ar, launches)
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps({**res, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""Where an L2 restore's time goes on the GPU: ``import_lane`` of a 27B-shape hybrid image (16
attention layers + the MTP layer, fp16 KV as uint8 rows, 48 GDN layers of float32 state), the
path a request resuming a session from L2 takes (from a pageable image, as L3 and slot files
give, and from one ``export_lane`` wrote, as L2 holds), and ``export_lane``, the demotion of the
session the lane held before (``cache.restored`` times both: 0.86 GB each way in 0.59-0.74 s
on an H100 on 2026-12-05), against the raw host-to-device copies of the same bytes from
pageable and from pinned memory.

Usage (GPU machine): python bench/experiments/gpu_l2_restore.py [--tokens 5600 32768] [--json OUT]
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import cupy as cp
import cupyx
import numpy as np

from ninfer.bench.report import write_json
from ninfer.engine.continuation import LaneImage, export_lane, import_lane, restore_state

ATTN, NKV, WIDTH, PAGE = 17, 4, 512, 16          # fp16 rows of head dim 256: 512 bytes
GDN, CONV, HV, DK, DV = 48, (3, 10240), 48, 128, 128


def timed(fn, reps: int = 3) -> float:
    """Median wall seconds of ``fn()`` with the device synchronized around it."""
    out = []
    for _ in range(reps):
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        out.append(time.perf_counter() - t)
    return sorted(out)[len(out) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[5600, 32768])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    pages = max(args.tokens) // PAGE + 8
    kv = SimpleNamespace(k=[cp.zeros((pages, PAGE, NKV, WIDTH), cp.uint8) for _ in range(ATTN)],
                         v=[cp.zeros((pages, PAGE, NKV, WIDTH), cp.uint8) for _ in range(ATTN)],
                         page_size=PAGE, nkv=NKV, k_width=WIDTH, v_width=WIDTH)
    cache = SimpleNamespace(kv=kv, conv=[cp.zeros((4,) + CONV, cp.float32) for _ in range(GDN)],
                            ssm=[cp.zeros((4, HV, DK, DV), cp.float32) for _ in range(GDN)],
                            lengths=np.zeros(4, np.int64))
    rng = np.random.default_rng(0)
    res = {"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "rows": {}}
    for n in args.tokens:
        k = rng.integers(0, 255, (ATTN, n, NKV, WIDTH), dtype=np.uint8)
        img = LaneImage(np.zeros(n, np.int32), k, k.copy(),
                        [np.ones(CONV, np.float32) for _ in range(GDN)],
                        [np.ones((HV, DK, DV), np.float32) for _ in range(GDN)])
        nbytes = img.k.nbytes * 2 + sum(a.nbytes for a in img.conv + img.ssm)
        table = list(range((n + PAGE - 1) // PAGE))
        pinned = cupyx.empty_pinned(img.k.shape, np.uint8)
        pinned[...] = img.k
        cache.lengths[0] = n
        held = export_lane(cache, table, n, img.tokens, 0)   # (what L2 holds: pinned rows)
        row = {
            "bytes": nbytes,
            "import_lane": timed(lambda: import_lane(cache, img, n, table, 0)),
            "import_lane of an exported image": timed(
                lambda: import_lane(cache, held, n, table, 0)),
            "export_lane": timed(lambda: export_lane(cache, table, n, img.tokens, 0)),
            "state only": timed(lambda: restore_state(cache, 0, img.conv, img.ssm, n)),
            "K + V pageable, one copy each": timed(lambda: (cp.asarray(img.k), cp.asarray(img.v))),
            "K twice from pinned": timed(lambda: (cp.asarray(pinned), cp.asarray(pinned))),
            "host to pinned, K twice": timed(lambda: (np.copyto(pinned, img.k),
                                                      np.copyto(pinned, img.v))),
        }
        res["rows"][n] = row
        for name, s in row.items():
            if name != "bytes":
                print(f"{n} tokens ({nbytes / 1e9:.3f} GB) {name}: {s * 1e3:.1f} ms")
    write_json(res, args.json)


if __name__ == "__main__":
    main()

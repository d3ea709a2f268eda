"""Whether the 27B's prefill GEMMs would gain from the fp8 tensor cores, and what the scales cost.

The MLP is 44 % of a prefill pass at 8K tokens on fp16 cuBLAS (~650 TFLOP/s); torch's fp8 with
one scale a tensor measured 1,250-1,350 TFLOP/s on the same shapes. A first fp8 path (cuBLASLt
e4m3, a scale a weight row and a token, the scales applied after the product where cuBLASLt had
no algorithm for them) ran the MLP no faster (8.17 against 8.06 ms). This times, per shape and
T, one GEMM each way, so that the next design is picked by measurement:

- ``ceilings``: TFLOP/s of fp16 (the path prefill takes today), bf16, fp8 with one scale an
  operand and int8 (``gpu_qwen35_prefill_profile.ceilings``);
- ``fp8 rowwise``: ``torch._scaled_mm`` e4m3 with a scale a token and a weight row (the scales
  in the GEMM), bf16 out;
- ``quantize``: the activations' e4m3 codes and row scales in plain torch ops (an upper bound
  of a fused prologue's cost);
- ``scale after``: one pass multiplying a (T, N) bf16 product by its row and column scales (what
  applying them outside the GEMM costs, as a consumer kernel would);
- ``cublasLt outer``: whether cuBLASLt (through ctypes, as CuPy would call it) has an e4m3
  algorithm with per-row scale vectors (``CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F``), and its
  time with bf16 and float32 output.

Usage (GPU machine): PYTHONPATH=$PWD python bench/experiments/fp8_gemm_micro.py [--tokens 2048 8192]
    [--json OUT]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys

import torch

sys.path[:0] = [os.path.dirname(__file__)]
from gpu_qwen35_prefill_profile import ceilings, event_ms  # noqa: E402

SHAPES = {"in_proj": (16480, 5120), "gate_up": (34816, 5120), "down": (5120, 17408)}
# cudaDataType_t, cublasComputeType_t, cublasLtMatmulDescAttributes_t, cublasLtMatmulMatrixScale_t
_R_32F, _R_16BF, _R_8F_E4M3, _COMPUTE_32F = 0, 14, 28, 68
_TRANSA, _TRANSB, _A_SCALE_PTR, _B_SCALE_PTR, _A_SCALE_MODE, _B_SCALE_MODE = 3, 4, 17, 18, 31, 32
_OUTER_VEC, _PREF_MAX_WORKSPACE, _WS = 3, 1, 32 << 20
_P = ctypes.c_void_p


class _Heuristic(ctypes.Structure):   # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t),
                ("state", ctypes.c_int), ("waves", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


def _cublaslt() -> ctypes.CDLL:
    """The libcublasLt torch loaded (after a matmul), by its path in this process's maps."""
    torch.mm(torch.ones(16, 16, device="cuda"), torch.ones(16, 16, device="cuda"))
    with open("/proc/self/maps") as f:
        paths = sorted({ln.split()[-1] for ln in f if "/libcublasLt.so" in ln})
    lib = ctypes.CDLL(paths[0] if paths else "libcublasLt.so")
    lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(_P), ctypes.c_int,
                                               ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [_P, ctypes.c_int, _P, ctypes.c_size_t]
    return lib


def lt_outer(lib, handle, t: int, n: int, k: int, out_type: int):
    """ms of cuBLASLt's e4m3 (T, K) x (N, K)^T with outer-vector scales, or the reason there is
    no such product (status of the heuristic or of the call)."""
    def setattr_(desc, attr, value, ctype=ctypes.c_int32):
        v = ctype(value)
        return lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.cast(ctypes.byref(v), _P),
                                                  ctypes.sizeof(v))
    w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    x = torch.randn(t, k, device="cuda").to(torch.float8_e4m3fn)
    sw = torch.rand(n, device="cuda") + 0.5
    sx = torch.rand(t, device="cuda") + 0.5
    d = torch.empty(t, n, device="cuda", dtype=torch.float32 if out_type == _R_32F
                    else torch.bfloat16)
    ws = torch.empty(_WS, device="cuda", dtype=torch.uint8)
    desc, pref = _P(), _P()
    lay = [_P(), _P(), _P()]
    if lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F):
        return "desc"
    for attr, v in ((_TRANSA, 1), (_TRANSB, 0), (_A_SCALE_MODE, _OUTER_VEC),
                    (_B_SCALE_MODE, _OUTER_VEC)):
        st = setattr_(desc, attr, v)
        if st:
            return f"attribute {attr}: status {st}"
    setattr_(desc, _A_SCALE_PTR, sw.data_ptr(), _P)
    setattr_(desc, _B_SCALE_PTR, sx.data_ptr(), _P)
    for i, (dt, r, c) in enumerate(((_R_8F_E4M3, k, n), (_R_8F_E4M3, k, t), (out_type, n, t))):
        lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay[i]), dt, r, c, r)
    lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref))
    wsz = ctypes.c_uint64(_WS)
    lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE, ctypes.byref(wsz),
                                             ctypes.c_size_t(8))
    found, count = _Heuristic(), ctypes.c_int(0)
    st = lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, lay[0], lay[1], lay[2], lay[2], pref,
                                            1, ctypes.byref(found), ctypes.byref(count))
    if st or not count.value:
        return f"no algorithm (status {st}, {count.value} found)"
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def run():
        s = lib.cublasLtMatmul(handle, desc, ctypes.byref(one), _P(w.data_ptr()), lay[0],
                               _P(x.data_ptr()), lay[1], ctypes.byref(zero), _P(d.data_ptr()),
                               lay[2], _P(d.data_ptr()), lay[2], ctypes.byref(found.algo),
                               _P(ws.data_ptr()), ctypes.c_size_t(_WS),
                               _P(torch.cuda.current_stream().cuda_stream))
        if s:
            raise RuntimeError(f"cublasLtMatmul status {s}")
    try:
        ms = event_ms(run, reps=10)
    except RuntimeError as e:
        return str(e)
    ref = (x.float() * sx[:, None]) @ (w.float() * sw[:, None]).T
    err = float((d.float() - ref).abs().max() / ref.abs().max())
    return {"ms": round(ms, 4), "max rel err": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    lib = _cublaslt()
    handle = _P()
    lib.cublasLtCreate(ctypes.byref(handle))
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    e4m3 = torch.float8_e4m3fn
    for t in a.tokens:
        rates = ceilings(t, SHAPES)
        for name, (n, k) in SHAPES.items():
            x = torch.randn(t, k, device="cuda", dtype=torch.float16)
            x8 = x.to(e4m3)
            w8 = torch.randn(n, k, device="cuda", dtype=torch.float16).to(e4m3)
            row = {"T": t, "weight": name, "N": n, "K": k, "ceilings TFLOP/s": rates[name]}
            sx = torch.rand(t, 1, device="cuda") + 0.5
            sw = torch.rand(1, n, device="cuda") + 0.5
            try:
                ms = event_ms(lambda: torch._scaled_mm(
                    x8, w8.T, scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16), reps=10)
                row["fp8 rowwise TFLOP/s"] = round(2.0 * t * n * k / ms / 1e9, 1)
            except RuntimeError as e:
                row["fp8 rowwise TFLOP/s"] = str(e)[:120]

            def quantize():
                s = x.abs().amax(dim=1, keepdim=True).float() / 448.0
                return (x / s).to(e4m3), s
            row["quantize ms"] = event_ms(quantize, reps=10)
            y = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
            row["scale after ms"] = event_ms(
                lambda: y * sx.to(torch.bfloat16) * sw.to(torch.bfloat16), reps=10)
            for label, ot in (("cublasLt outer bf16", _R_16BF), ("cublasLt outer f32", _R_32F)):
                row[label] = lt_outer(lib, handle, t, n, k, ot)
            print(json.dumps(row), flush=True)
            res["rows"].append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

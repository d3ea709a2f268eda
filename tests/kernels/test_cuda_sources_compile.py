"""Every CUDA source of the CuPy backend compiles for sm_90 (sm_90a where ``ARCH`` says so; PTX,
with ``nvcc``), so a GPU-less CI still catches a broken kernel: the sources exactly as
``gpu.source`` hands them to NVRTC, plus explicit instantiations of the templates the wrappers
launch. Skipped without nvcc."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[2] / "ninfer" / "kernels" / "gpu"
NVCC = shutil.which("nvcc")

_GEMV_ARGS = ("const float*, int, const float*, float, const uint4*, const unsigned*, float*, "
              "int, int, int, int")
# {0}: the KV cache's element type (float, kvh: fp16 bits, kvq8: int8 rows, or kvrk<KK>: the rk
# modes' rotated rows, KK the K codec: rk8v4, rk4v4, rk4v4-e8, rk2v4-e8)
_ATTN_ARGS = ("const float*, int, const {0}*, const {0}*, const int*, const int*, "
              "const int*, int, int, int, float, int, int, float*, int, float*, float*, "
              "const int*, const float*, int, int, const long long*, {0}*, {0}*, int*, "
              "unsigned char*, int, int, const float*, int, int, const float*, const float*, "
              "float")
_PREFILL_ARGS = ("const float*, int, const {0}*, const {0}*, const int*, const int*, "
                 "const int*, int, int, int, int, float, const int*, float*, int")
_VERIFY_ARGS = ("const float*, int, const {0}*, const {0}*, const int*, const int*, "
                "const int*, int, int, int, float, int, int, float*, int, float*, float*")
KV_TYPES = ("float", "kvh", "kvq8", "kvrk<0>", "kvrk<1>", "kvrk<2>", "kvrk<3>")
FLOAT_KV = ("float", "kvh")   # (the others store 64-dim groups: head dims of 64 and up)
INSTANTIATIONS = {
    # (scheme, token tiles, row tiles, warps, chunks, prologue, residual, staged, ring steps)
    "linear": [f"template __global__ void gemv_mma<{v}>({_GEMV_ARGS});" for v in (
        "0,1,1,8,2,1,false,true,4", "1,1,1,4,2,2,true,true,0", "2,1,2,16,2,0,true,true,3",
        "0,2,2,8,2,0,false,true,0", "1,4,1,16,2,1,false,false,4", "2,4,1,4,1,2,true,false,2")]
    # (scheme, row tiles, warps, chunks, prologue, residual, T = 1)
    + [f"template __global__ void gemv_q8a<{v}>({_GEMV_ARGS});" for v in (
        "0,1,8,4,1,false,true", "1,2,4,2,2,true,false", "2,2,16,2,0,true,true",
        "0,2,8,2,0,false,false", "1,1,16,4,1,false,true", "2,1,4,4,2,true,false")]
    # (scheme, prologue, residual, int8 activations, warps, chunks per warp per slot, slots,
    # SwiGLU epilogue, q8 shadow in, q8 shadow out[, row tiles a group of sums])
    + [f"template __global__ void gemv_bulk<{v}>(const float*, int, const float*, float, "
       "const unsigned char*, const unsigned char*, float*, int, int, int, int, "
       "const unsigned*, unsigned char*, const float*, int);" for v in (
        "0,1,false,true,16,2,5,false,false,false", "1,2,true,false,8,4,3,false,false,false",
        "2,0,true,true,16,4,4,false,false,false", "0,1,false,true,16,2,5,true,false,false",
        "1,1,false,false,8,4,3,true,false,false", "0,1,false,true,16,2,5,false,true,false",
        "0,0,true,true,16,2,5,false,true,true", "1,1,false,true,16,2,5,true,true,true",
        "2,0,true,true,15,2,5,false,false,true", "0,0,true,true,4,1,3,false,false,false,8",
        "0,1,false,true,16,2,5,true,false,true,4", "1,0,true,false,8,4,3,false,false,false,16",
        "0,0,true,true,16,2,4,false,false,true,4")]
    # (scheme, prologue, residual, warps, chunks per warp per slot, slots, token columns[,
    # SwiGLU epilogue])
    + [f"template __global__ void gemv_bulk_mt<{v}>(const float*, int, const float*, float, "
       "const unsigned char*, const unsigned char*, float*, int, int, int, int, "
       "const unsigned*, unsigned char*, const float*, int);" for v in (
        "0,1,false,16,2,8,2", "1,0,true,16,2,5,4", "2,2,false,16,2,4,8", "0,0,true,8,4,3,8",
        "0,1,false,16,2,8,2,true", "1,1,false,16,2,5,4,true", "2,0,false,16,2,4,8,true",
        "0,0,false,8,4,3,8,true", "0,1,false,16,2,8,2,false,true", "1,2,true,16,2,5,4,false,true",
        "2,0,false,16,2,4,8,true,true", "0,0,true,8,2,4,8,false,true")]
    # (scheme, prologue, warps)
    + [f"template __global__ void stage_rows_q8<{v}>(const float*, int, const float*, float, "
       "int, int, unsigned*);" for v in ("0,1,16", "1,2,16", "2,0,8")]
    # (scheme, shadow in, warps, chunks per warp per slot, slots, row tiles a group of sums)
    + [f"template __global__ void {k}<{s}>({a});" for s in (0, 1, 2) for k, a in (
        ("embed_mma", "const unsigned*, const unsigned*, const int*, float*, int"),
        ("dequant_mma_f16", "const unsigned*, const unsigned*, unsigned short*, int, int"),
        ("dequant_mma_e4m3", "const unsigned*, const unsigned*, const float*, unsigned char*, "
         "int, int"),
        ("row_absmax", "const unsigned*, const unsigned*, unsigned*, int, int"))],
    "attention": [f"template __global__ void attn_decode<{t},{hd},{g},{r}>"
                  f"({_ATTN_ARGS.format(t)});"
                  for t in KV_TYPES for hd, g in ((32, 1), (64, 3), (128, 4), (256, 8))
                  if t in FLOAT_KV or hd % 64 == 0
                  for r in ("false,false", "true,true", "true,false")]
    + [f"template __global__ void attn_decode<{t},{v}>({_ATTN_ARGS.format(t)});"   # clusters
       for t in KV_TYPES
       for v in ("128,4,true,true,8", "128,4,true,true,16", "256,8,true,true,8", "64,2,true,true,4")]
    + [f"template __global__ void attn_verify<{t},{hd},{g}>({_VERIFY_ARGS.format(t)});"
       for t in KV_TYPES for hd, g in ((32, 1), (128, 4), (256, 6))
       if t in FLOAT_KV or hd % 64 == 0]
    + [f"template __global__ void {k}<{t},{hd}>({_PREFILL_ARGS.format(t)});"
       for t in KV_TYPES
       for k, hds in (("attn_prefill", ("128", "32")), ("attn_prefill_mma", (
           "32,64,true,4", "64,64,true,4", "128,64,false,3", "128,64,true,1", "128,32,false,4", "256,64,false,1", "256,32,false,1,8",
           "256,64,false,1,8")))
       for hd in hds if t in FLOAT_KV or int(hd.split(",")[0]) % 64 == 0]
    # attn_prefill_mma's MODEs: 2 (fp16 rows double-buffered by cp.async), 1 (1-byte rows staged)
    + [f"template __global__ void attn_prefill_mma<{t},{v},{mode}>({_PREFILL_ARGS.format(t)});"
       for t in KV_TYPES for v in ("32,64,true,4,4", "64,64,true,4,4", "256,64,false,1,8",
                                   "256,32,false,1,8")
       for mode in ((2,) if t == "kvh" else () if t == "float" else (1,))
       if t in FLOAT_KV or int(v.split(",")[0]) >= 128],   # (1-byte rows: 4-byte multiples)
    "elementwise": [
        f"template __global__ void {k}<{t}>({a.format(t)});" for t in KV_TYPES for k, a in (
            ("rope_write_kv", "const float*, int, const int*, const float*, const long long*, "
             "float*, {0}*, {0}*, int, int, int, int, int"),
            ("norm_rope_write_kv", "const float*, int, int, int, const float*, const float*, "
             "float, const int*, const float*, const long long*, float*, {0}*, {0}*, int, int, "
             "int, int, int"),
            ("write_kv", "const float*, int, const float*, int, const long long*, {0}*, {0}*, "
             "int, int"))],
    "gdn": [],
    "gdn_chunk": [f"template __global__ void {k}<{dk}>({a});" for dk in (16, 32, 64, 128)
                  for k, a in (
        ("gdn_chunk_prep", "const float*, int, const float*, int, const float*, int, "
         "const float*, int, const float*, int, const int*, int, float*, float*, float*, float*, "
         "int, int, int, int, float"),
        ("gdn_chunk_scan", "const float*, int, const float*, int, const float*, const float*, "
         "const float*, const float*, const int*, int, const int*, float*, const int*, float*, "
         "int, int, int, int, float"))],
    "spec": [],
    "attention_wgmma": [f"template __global__ void attn_prefill_wgmma<{hd}>"
                        f"({_PREFILL_ARGS.format('kvh')});" for hd in (128, 256)],
}
# sources of sm_90a's architecture-specific instructions (wgmma), compiled for that target
ARCH = {"attention_wgmma": "sm_90a"}


def _source(name: str) -> str:
    # what ninfer.kernels.gpu.source builds (that module imports CuPy, absent here)
    common = (GPU / "common.cuh").read_text().replace("#pragma once", "")
    return "\n".join([common, (GPU / f"{name}.cu").read_text()])


def test_every_cuda_source_has_a_case():
    assert {p.stem for p in GPU.glob("*.cu")} == set(INSTANTIATIONS)


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("name", sorted(INSTANTIATIONS))
def test_cuda_source_compiles(tmp_path, name):
    src = tmp_path / f"{name}.cu"
    src.write_text(_source(name) + "\n" + "\n".join(INSTANTIATIONS[name]) + "\n")
    r = subprocess.run([NVCC, f"-arch={ARCH.get(name, 'sm_90')}", "--std=c++17", "-ptx", "-o",
                        str(tmp_path / f"{name}.ptx"), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warning" not in r.stderr, r.stderr[-3000:]
    ptx = (tmp_path / f"{name}.ptx").read_text()
    assert ptx.count(".entry") >= max(1, len(INSTANTIATIONS[name]))

"""KV dtypes: the bytes a token's head takes in each storage mode (spec models.md D.1)."""
from __future__ import annotations

import pytest

from ninfer.engine import kv_dtypes


def test_head_bytes_match_the_published_layouts():
    # a 256-dim head: key rows of 256 (int8), 128 (int4) and 64 (rk2v4-e8) bytes + 4 scales
    assert kv_dtypes.head_bytes("int8", 256) == (256 + 8, 256 + 8)
    assert kv_dtypes.head_bytes("rk8v4", 256) == (264, 136)
    assert kv_dtypes.head_bytes("rk4v4-e8", 256) == (136, 136)
    assert kv_dtypes.head_bytes("rk2v4-e8", 256) == (72, 136)
    assert kv_dtypes.head_bytes("fp16", 64) == (128, 128)
    assert kv_dtypes.head_bytes("fp32", 64) == (256, 256)
    # 8.25 / 4.25 / 2.25 bits per dim, scales included
    for dtype, (kbits, vbits) in {"int8": (8.25, 8.25), "rk4v4": (4.25, 4.25),
                                  "rk2v4-e8": (2.25, 4.25)}.items():
        k, v = kv_dtypes.head_bytes(dtype, 128)
        assert (8 * k / 128, 8 * v / 128) == (kbits, vbits)
    assert kv_dtypes.bytes_per_token("fp16", 16, 4, 256) == 16 * 4 * 2 * 512


def test_bad_dtypes_and_head_dims_are_refused():
    with pytest.raises(ValueError, match="unknown KV dtype"):
        kv_dtypes.head_bytes("int3", 128)
    with pytest.raises(ValueError, match="multiple of 64"):
        kv_dtypes.head_bytes("rk4v4", 96)
    assert kv_dtypes.head_bytes("fp16", 96) == (192, 192)


def test_auto_is_fp16_on_the_gpu_and_fp32_on_numpy():
    assert kv_dtypes.resolve("auto", "cupy") == "fp16"
    assert kv_dtypes.resolve("auto", "numpy") == "fp32"
    assert kv_dtypes.resolve("int8", "cupy") == "int8"
    assert kv_dtypes.resolve("fp32", "cupy") == "fp32"

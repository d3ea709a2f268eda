"""KV cache storage types (``--kv-dtype``) and the bytes one token's K and V take per head.

``fp32`` is what the caches store today; ``fp16`` halves it; the quantized modes follow
``spec/models.md`` D.1: per token and head, each 64-dim group gets one fp16 scale, and the codes
are int8 (``int8``, and K of ``rk8v4``), int4 packed two a byte (V of the ``rk`` modes, K of
``rk4v4`` / ``rk4v4-e8``) or 16 bits per 8 dims (K of ``rk2v4-e8``). The ``rk`` modes store
the Hadamard-rotated vector (``kernels.kv_codec``).
"""
from __future__ import annotations

KV_DTYPES = ("fp32", "fp16", "int8", "rk8v4", "rk4v4", "rk4v4-e8", "rk2v4-e8")
GROUP = 64   # dims per fp16 scale (one Hadamard block) in the quantized modes
# code bits per dim of (K, V); None: a float type of that many bytes per dim
_CODE_BITS = {"int8": (8, 8), "rk8v4": (8, 4), "rk4v4": (4, 4), "rk4v4-e8": (4, 4),
              "rk2v4-e8": (2, 4)}
_FLOAT_BYTES = {"fp32": 4, "fp16": 2}


def check(dtype: str, head_dim: int) -> None:
    """Raise ValueError unless ``dtype`` is a KV dtype that can store heads of ``head_dim``
    (the quantized modes need a multiple of 64)."""
    if dtype not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {dtype!r} (expected one of {', '.join(KV_DTYPES)})")
    if dtype in _CODE_BITS and head_dim % GROUP:
        raise ValueError(f"--kv-dtype {dtype} needs a head dim that is a multiple of {GROUP}, "
                         f"not {head_dim}")


AUTO = "auto"   # --kv-dtype's default: ``resolve`` picks by backend
CHOICES = (AUTO,) + KV_DTYPES   # what --kv-dtype takes


def resolve(dtype: str, backend: str) -> str:
    """``auto``: fp16 on the GPU (half the bytes of fp32 a token, as llama.cpp's default f16
    cache; the H200's decode at long context and prefill run faster on it), fp32 on NumPy (the
    reference); any other dtype as given."""
    if dtype != AUTO:
        return dtype
    return "fp16" if backend == "cupy" else "fp32"


def resolve_for(dtype: str, model) -> str:
    """``resolve`` for the backend ``model`` runs on (its ops' name)."""
    return resolve(dtype, getattr(model.ops, "name", "numpy"))


def check_backend(dtype: str, ops) -> None:
    """Raise ValueError unless backend ``ops`` stores KV as ``dtype`` (its ``kv_dtypes``; the
    CuPy and NumPy backends: all of ``KV_DTYPES``)."""
    supported = tuple(getattr(ops, "kv_dtypes", ("fp32",)))
    if dtype not in supported:
        name = getattr(ops, "name", type(ops).__name__)
        raise ValueError(f"--kv-dtype {dtype} is not available on the {name} backend (it "
                         f"stores KV as {', '.join(supported)}); use --backend numpy, or "
                         f"--kv-dtype {supported[0]}")


def check_model(dtype: str, model) -> None:
    """``check_backend`` on ``model``'s ops, then ``check`` on its head dim."""
    check_backend(dtype, model.ops)
    check(dtype, int(model.config.head_dim))


# the dtypes a refused budget suggests, largest first (rk4v4-e8 takes rk4v4's bytes; rk2v4-e8,
# research only, is never suggested)
_SMALLER_ORDER = ("fp32", "fp16", "int8", "rk8v4", "rk4v4")


def smaller(dtype: str) -> tuple[str, ...]:
    """The dtypes that store a token in fewer bytes than ``dtype``, largest first."""
    i = _SMALLER_ORDER.index(dtype) if dtype in _SMALLER_ORDER else len(_SMALLER_ORDER)
    return _SMALLER_ORDER[i + 1:]


def head_bytes(dtype: str, head_dim: int) -> tuple[int, int]:
    """(K bytes, V bytes) one token takes for one KV head: codes plus the fp16 scales.

    Raises:
        ValueError: as ``check``.
    """
    check(dtype, head_dim)
    if dtype in _FLOAT_BYTES:
        b = _FLOAT_BYTES[dtype] * head_dim
        return b, b
    scales = 2 * (head_dim // GROUP)
    kb, vb = _CODE_BITS[dtype]
    return head_dim * kb // 8 + scales, head_dim * vb // 8 + scales


def bytes_per_token(dtype: str, layers: int, kv_heads: int, head_dim: int) -> int:
    """K + V bytes one token takes over ``layers`` attention layers."""
    k, v = head_bytes(dtype, head_dim)
    return layers * kv_heads * (k + v)

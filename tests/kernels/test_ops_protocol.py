"""Both backends conform to the op interface ``ninfer.kernels.ops.Ops``: every protocol method
exists with the same parameters (names, kinds, defaults). The CuPy backend is checked from its
source (its module imports CuPy, absent on CPU machines), and by ``isinstance`` where CuPy runs.
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from ninfer.kernels import get_ops
from ninfer.kernels.config import KernelConfig
from ninfer.kernels.numpy_ops import NumpyOps
from ninfer.kernels.ops import DeviceOps, Ops

CUPY_OPS = Path(__file__).parents[2] / "ninfer" / "kernels" / "cupy_ops.py"


def _protocol_methods(proto) -> dict[str, list[tuple[str, str, str | None]]]:
    """name -> [(parameter, kind, default as source text)] of the protocol's own methods."""
    out = {}
    for name, fn in vars(proto).items():
        if name.startswith("_") or not inspect.isfunction(fn):
            continue
        out[name] = [(p.name, p.kind.name,
                      None if p.default is inspect.Parameter.empty else repr(p.default))
                     for p in inspect.signature(fn).parameters.values()]
    return out


def _ast_signature(fn: ast.FunctionDef) -> list[tuple[str, str, str | None]]:
    a = fn.args
    pos = a.posonlyargs + a.args
    defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
    out = [(p.arg, "POSITIONAL_OR_KEYWORD", d) for p, d in zip(pos, defaults)]
    out += [(p.arg, "KEYWORD_ONLY", d) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    return [(n, k, None if d is None else repr(ast.literal_eval(d)) if not isinstance(
        d, ast.Attribute) else ast.unparse(d)) for n, k, d in out]


def _comparable(sig):
    # defaults written as names (np.float32, gdn.CHUNK_SIZE) are compared by presence only
    return [(n, k, d if d is None or d[:1] in "'\"-0123456789TFN" else "<name>")
            for n, k, d in sig]


def test_the_numpy_backend_conforms():
    ops = NumpyOps()
    assert isinstance(ops, Ops)
    for name, params in _protocol_methods(Ops).items():
        got = [(p.name, p.kind.name,
                None if p.default is inspect.Parameter.empty else repr(p.default))
               for p in inspect.signature(getattr(NumpyOps, name)).parameters.values()]
        assert _comparable(got) == _comparable(params), name


def test_the_cupy_backend_conforms_in_its_source():
    # CupyOps and its mixins (gpu/attention_ops.py's AttentionOps, gpu/linear_ops.py's
    # LinearOps, gpu/spec.py's SpecOps)
    classes = {n.name: n for path in (CUPY_OPS, *(CUPY_OPS.parent / "gpu" / f for f in (
                   "attention_ops.py", "linear_ops.py", "spec.py")))
               for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}
    cls = classes["CupyOps"]
    methods = {f.name: f for c in [cls] + [classes[b.id] for b in cls.bases]
               for f in c.body if isinstance(f, ast.FunctionDef)}
    wanted = {**_protocol_methods(Ops), **_protocol_methods(DeviceOps)}
    for name, params in wanted.items():
        assert name in methods, f"CupyOps lacks {name}"
        got = _ast_signature(methods[name])
        assert [(n, k) for n, k, _ in got] == [(n, k) for n, k, _ in params], name
        assert [d is None for *_, d in got] == [d is None for *_, d in params], name


def test_the_cupy_backend_is_a_device_ops_where_cupy_runs():
    pytest.importorskip("cupy")
    from ninfer.kernels import cupy_usable
    if not cupy_usable():
        pytest.skip("no CUDA device")
    ops = get_ops("cupy", KernelConfig(q8_shadow=False))
    assert isinstance(ops, DeviceOps) and ops.config.q8_shadow is False


def test_kernel_config_is_frozen_and_checked():
    kc = KernelConfig()
    with pytest.raises(AttributeError):
        kc.activations = "q8"   # type: ignore[misc]
    with pytest.raises(TypeError):
        kc.bulk_shape["q8"] = (1, 1, 1, 1)   # type: ignore[index]
    for field in ("activations", "decode_attention", "prefill_attention"):
        with pytest.raises(ValueError, match=field):
            KernelConfig(**{field: "nonsense"})
    for cluster in (3, 32, -1):
        with pytest.raises(ValueError, match="attn_cluster"):
            KernelConfig(attn_cluster=cluster)
    assert KernelConfig(attn_cluster=0).attn_cluster == 0
    assert KernelConfig(mma_shape={1: (2, 2)}).mma_shape[1] == (2, 2)

"""The model under test: loaded on a backend and wrapped for decode as ``ninfer serve`` wraps it,
with the few backend-neutral helpers the measurements need."""
from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PAGE_SIZE = 16


@dataclass(frozen=True, slots=True)
class BenchModel:
    """A model (Llama or Qwen3.5 hybrid) ready to time.

    Attributes:
        path: the model file.
        backend: ``"numpy"`` or ``"cupy"``.
        ops: the backend's ops.
        model: what decode runs: the CUDA-graph decode runner of the backend (as ``ninfer
            serve``: ``ops.decode_runner``) or, where there is none, the model itself.
        base: the model without the wrapper.
        load_s: seconds to load and prepare the weights.
        kv_dtype: how the caches ``new_kv`` makes store K and V (``kv_dtypes.KV_DTYPES``).
    """

    path: Path
    backend: str
    ops: object
    model: object
    base: object
    load_s: float
    kv_dtype: str = "fp32"

    @property
    def config(self):
        return self.base.config

    def argmax(self, logits) -> list[int]:
        """The greedy token of each row of ``logits``, on the host (device backends compute it
        where the logits are)."""
        if hasattr(self.ops, "argmax"):
            return self.ops.argmax(logits).tolist()
        return np.argmax(self.ops.to_numpy(logits), axis=-1).tolist()

    def synchronize(self) -> None:
        """Wait for queued device work (nothing to wait for on the host)."""
        sync = getattr(self.ops, "synchronize", None)
        if sync is not None:
            sync()

    @property
    def recurrent(self) -> bool:
        """Whether lanes carry recurrent state (a hybrid model: one state slot a lane)."""
        return bool(self.base.is_recurrent)

    def new_kv(self, lanes: int, positions: int):
        """A KV cache of ``lanes`` x ``positions`` (rounded up to whole pages), with ``lanes``
        state slots for a hybrid model."""
        kw = {"max_lanes": lanes} if self.recurrent else {}
        kw["kv_dtype"] = self.kv_dtype
        return self.model.new_kv_cache(lanes * pages(positions), PAGE_SIZE, **kw)

    def slots(self, kv, lanes: int) -> list[int] | None:
        """State slots 0..lanes-1, reset to empty (a hybrid model's lanes start over), or None
        for a model without recurrent state."""
        if not self.recurrent:
            return None
        for i in range(lanes):
            kv.reset_state(i)
        return list(range(lanes))


def pages(positions: int) -> int:
    return -(-positions // PAGE_SIZE)


def load(path: str | None, backend: str, *, max_positions: int, max_batch: int,
         cuda_graph: bool = True, kv_dtype: str = "fp32",
         prefill_fp8: bool = False, keep_f16: bool = True, artifact=None) -> BenchModel:
    """Load a Llama or Qwen3.5 model file (None: the bundled SmolLM2) on ``backend``
    (``auto``: cupy when a GPU is usable) and wrap it for decode batches up to ``max_batch``
    lanes of ``max_positions`` positions each (the graphs' block tables; at least 4,096
    positions, the attention split of a serving context), its caches storing KV as ``kv_dtype``,
    its prefill GEMMs on fp8 with ``prefill_fp8`` (``KernelConfig.prefill_fp8``; where the
    layers keep fp16 copies of their weights, a small model, those copies serve instead unless
    ``keep_f16`` is False).
    ``artifact``: the file already opened (``load_model_file``), to load it once for two models.

    Raises:
        ValueError: another architecture, the backend is not available, or it cannot store
            ``kv_dtype``.
        FileNotFoundError: no such file.
    """
    from ninfer.engine import kv_dtypes
    from ninfer.engine.models import load_model
    from ninfer.kernels import get_ops
    from ninfer.kernels.config import KernelConfig
    from ninfer.server import resolve_model_path
    from ninfer.store.artifact import load_model_file

    file = resolve_model_path(path)
    ops = get_ops(backend, KernelConfig(prefill_fp8=prefill_fp8,
                                        **({} if keep_f16 else {"prefill_f16_mib": 0})))
    kv_dtypes.check_backend(kv_dtype, ops)
    t0 = time.perf_counter()
    art = artifact if artifact is not None else load_model_file(file)
    if getattr(art, "architecture", "llama") not in ("llama", "qwen35"):
        raise ValueError(f"ninfer bench decode/prefill time llama and qwen35 models; "
                         f"{file.name} is {art.architecture!r}")
    base = load_model(art, ops)
    make = getattr(ops, "decode_runner", None)
    runner = make(base, pages(max(4096, max_positions)), max_batch, cuda_graph) if make else None
    model = runner if runner is not None else base
    sync = getattr(ops, "synchronize", None)
    if sync is not None:
        sync()
    return BenchModel(file, ops.name, ops, model, base, time.perf_counter() - t0, kv_dtype)


def device_name(backend: str) -> str:
    """The GPU's name, or the host CPU's (with its core count) on the numpy backend."""
    if backend == "cupy":
        import cupy as cp
        name = cp.cuda.runtime.getDeviceProperties(0)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"

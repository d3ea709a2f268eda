"""The start-up memory budget: what a configuration needs on the device, against what it has.

``plan_memory`` adds four parts, each in bytes:

- **weights**: the model's prepared weights as they are resident on the backend (packed int4 /
  int8 codes plus fp16 scales on the GPU; float32 on the NumPy backend), summed over every array
  reachable from the model object (shared arrays, e.g. a tied head, counted once);
- **KV pool**: ``num_pages = max_concurrency x ceil(max_context / page_size)`` pages of
  ``kv_bytes_per_token`` (``kv_dtypes.bytes_per_token`` of the KV dtype over the attention
  layers, plus the MTP head's layer when loaded), plus ``max_concurrency`` recurrent state
  slots of ``state_bytes_per_lane`` on hybrid models (what ``model.new_kv_cache`` allocates;
  ``kv_pool_bytes`` measures that without allocating the pool);
- **workspace**: activations of the largest pass (``max(prefill_chunk, max_concurrency)``
  tokens; ``activation_elems_per_token`` float32 values each), the logits of the widest decode
  round, and on the GPU the fp16 scratch the prefill GEMM dequantizes the largest packed weight
  into plus a fixed allowance for cuBLAS / NVRTC modules (``GPU_LIBRARY_BYTES``), and on a
  hybrid model the chunked gated delta rule's scratch of one GDN layer call
  (``gdn_chunk_workspace_bytes``);
- **CUDA graphs**: per captured batch-size bucket B, the private pool the graph's allocations
  live in (B tokens of activations, B logits rows, split-K attention partials) plus the static inputs and ``GRAPH_FIXED_BYTES`` for the graph itself.

Beside them, in host memory and outside the total, ``checkpoint_bytes``: a hybrid model's turn
checkpoints, at most ``checkpoints`` recurrent states per lane (the turn checkpoint, the
user-turn anchor and the ``--turn-checkpoints`` ring); and the L2 tier's ceiling
(``l2_budget_bytes``: ``--continuation-cache-l2-mib auto`` sizes it from the KV pool).

``plan_memory`` plans a loaded model; ``plan_config`` the same parts from a config and the
weights' resident size alone (``ninfer plan``, before anything loads). ``capacity_bytes`` is a
parameter: the GPU's free memory plus what this process already holds
(``device_capacity_bytes``), capped by ``--gpu-memory``, or a user's
``--memory-capacity-bytes``. ``MemoryPlan.check``
raises ``MemoryBudgetError`` (a ``ValueError``, so ``ninfer serve`` exits with status 2 and one
line) when the total exceeds the capacity, naming the deficit in bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ninfer.kernels.graph_buckets import prefill_lengths

from . import kv_dtypes

MIB = 1 << 20
GPU_LIBRARY_BYTES = 64 * MIB   # cuBLAS workspace, NVRTC-compiled modules, CuPy pool slack
GRAPH_FIXED_BYTES = 2 * MIB    # per captured graph: the executable graph's own device memory
ATTN_MIN_PARTITION = 32        # gpu.attention.MIN_PARTITION: positions per split-K partition
ATTN_SPLIT_BLOCKS = 512        # split-K aims at 2 blocks per multiprocessor: <= 256 SMs assumed


class MemoryBudgetError(ValueError):
    """The configuration needs more memory than the device has.

    Attributes:
        plan: the ``MemoryPlan`` that did not fit.
        deficit_bytes: bytes missing (total needed minus capacity).
    """

    def __init__(self, plan: MemoryPlan) -> None:
        self.plan = plan
        self.deficit_bytes = plan.deficit_bytes
        p = plan
        super().__init__(
            f"not enough {p.device} memory for this configuration: needs {p.total_bytes} bytes "
            f"({p.total_bytes / 2**30:.2f} GiB), capacity {p.capacity_bytes} bytes, short by "
            f"{p.deficit_bytes} bytes (weights {p.weights_bytes}, KV pool {p.kv_pool_bytes} = "
            f"{p.kv_pages} pages x {p.kv_page_size} tokens, workspace {p.workspace_bytes}, "
            f"CUDA graphs {p.cuda_graph_bytes}); lower --max-concurrency or --max-context"
            + (f", or store the KV cache in fewer bytes than {p.kv_dtype} (--kv-dtype "
               f"{', '.join(kv_dtypes.smaller(p.kv_dtype)[:2])}; `ninfer plan` sizes each)"
               if kv_dtypes.smaller(p.kv_dtype) else ""))


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Bytes a configuration needs, by part, and the capacity it is checked against.

    ``kv_pool_bytes`` is the whole cache allocation: paged K/V plus ``state_bytes`` of
    recurrent state slots. ``capacity_bytes`` None: unknown (not checked); ``enforced`` False: reported only."""

    backend: str
    weights_bytes: int
    kv_pool_bytes: int
    workspace_bytes: int
    cuda_graph_bytes: int
    kv_pages: int
    kv_page_size: int
    cuda_graph_buckets: tuple = ()
    capacity_bytes: int | None = None
    enforced: bool = False
    kv_dtype: str = "fp32"
    state_bytes: int = 0   # the recurrent state slots within kv_pool_bytes (hybrid models)
    checkpoint_bytes: int = 0   # host copies of the state at turn checkpoints (not in total)

    @property
    def device(self) -> str:
        """``GPU`` for the cupy backend, else ``host``."""
        return "GPU" if self.backend == "cupy" else "host"

    @property
    def total_bytes(self) -> int:
        """Weights + KV pool + workspace + CUDA graphs."""
        return self.weights_bytes + self.kv_pool_bytes + self.workspace_bytes + \
            self.cuda_graph_bytes

    @property
    def deficit_bytes(self) -> int:
        """Bytes over capacity (0 when it fits or the capacity is unknown)."""
        if self.capacity_bytes is None:
            return 0
        return max(0, self.total_bytes - self.capacity_bytes)

    def check(self) -> None:
        """Raise when an enforced plan does not fit.

        Raises:
            MemoryBudgetError: ``enforced`` and ``total_bytes > capacity_bytes``.
        """
        if self.enforced and self.deficit_bytes > 0:
            raise MemoryBudgetError(self)

    def to_dict(self) -> dict:
        """The ``server.started`` ``memory`` fields (byte counts under keys ending in
        ``_bytes``)."""
        out = {"weights_bytes": self.weights_bytes, "kv_pool_bytes": self.kv_pool_bytes,
               "workspace_bytes": self.workspace_bytes,
               "cuda_graph_bytes": self.cuda_graph_bytes, "total_bytes": self.total_bytes,
               "kv_pages": self.kv_pages, "kv_page_size": self.kv_page_size,
               "kv_dtype": self.kv_dtype, "state_bytes": self.state_bytes,
               "checkpoint_bytes": self.checkpoint_bytes,
               "cuda_graph_buckets": list(self.cuda_graph_buckets),
               "budget_enforced": self.enforced}
        if self.capacity_bytes is not None:
            out["capacity_bytes"] = self.capacity_bytes
            out["headroom_bytes"] = self.capacity_bytes - self.total_bytes
        return out


# --- the parts ---------------------------------------------------------------------------

def _array_key(o):
    """(address, nbytes) of a NumPy / CuPy array, else None."""
    if isinstance(o, np.ndarray):
        return (o.__array_interface__["data"][0], o.nbytes)
    data = getattr(o, "data", None)
    ptr = getattr(data, "ptr", None)
    if ptr is not None and hasattr(o, "nbytes") and hasattr(o, "dtype"):
        return (int(ptr), int(o.nbytes))
    return None


_SKIP = ("config", "ops", "scale")


def weights_resident_bytes(model) -> tuple[int, int]:
    """Bytes of every array reachable from ``model``'s attributes (each distinct array once;
    ``config`` and ``ops`` are not walked), and the element count of the largest packed
    (quantized, 2-D) weight among them.

    Returns:
        ``(total_bytes, max_packed_elems)``.
    """
    seen_obj: set[int] = set()
    seen_arr: set = set()
    total = 0
    max_packed = 0

    def visit(o) -> None:
        nonlocal total, max_packed
        if o is None or isinstance(o, (str, bytes, int, float, bool, type)) or id(o) in seen_obj:
            return
        seen_obj.add(id(o))
        key = _array_key(o)
        if key is not None:
            if key not in seen_arr:
                seen_arr.add(key)
                total += key[1]
            return
        if isinstance(o, dict):
            for v in o.values():
                visit(v)
            return
        if isinstance(o, (list, tuple)):
            for v in o:
                visit(v)
            return
        if getattr(o, "scheme", None) in ("q4", "q8") and len(getattr(o, "shape", ())) == 2:
            max_packed = max(max_packed, int(o.shape[0]) * int(o.shape[1]))
        names = list(getattr(o, "__dict__", {}))
        for cls in type(o).__mro__:
            names += [n for n in getattr(cls, "__slots__", ()) if isinstance(n, str)]
        for n in dict.fromkeys(names):
            if n in _SKIP or n.startswith("__"):
                continue
            visit(getattr(o, n, None))

    visit(model)
    return total, max_packed


def kv_pool_bytes(model, num_pages: int, page_size: int, max_lanes: int = 1,
                  kv_dtype: str = "fp32") -> int:
    """Exact bytes of ``model.new_kv_cache(num_pages, page_size[, max_lanes], kv_dtype=...)``,
    from the byte sizes of a 1-page and a 2-page cache (so the pool itself is never
    allocated)."""
    kw = {"max_lanes": max_lanes} if model.is_recurrent else {}
    kw["kv_dtype"] = kv_dtype
    one = int(model.new_kv_cache(1, page_size, **kw).nbytes)
    two = int(model.new_kv_cache(2, page_size, **kw).nbytes)
    return one + (two - one) * (num_pages - 1)


def kv_layers(config, mtp_layers: int = 0) -> int:
    """Attention layers whose K/V the cache pages: every layer of a Llama-family model; the
    full-attention layers (at least one) plus ``mtp_layers`` on a hybrid one (as
    ``Qwen35Cache``)."""
    attn = getattr(config, "attention_layers", None)
    if attn is None:
        return int(config.num_hidden_layers)
    return max(len(attn) + mtp_layers, 1)


def kv_bytes_per_token(config, kv_dtype: str = "fp32", mtp_layers: int = 0) -> int:
    """K + V bytes one token takes in the cache: ``kv_dtypes.bytes_per_token`` over
    ``kv_layers``.

    Raises:
        ValueError: an unknown KV dtype, or one the head dim does not fit.
    """
    *_, nkv, hd = _dims(config)
    return kv_dtypes.bytes_per_token(kv_dtype, kv_layers(config, mtp_layers), nkv, hd)


def state_bytes_per_lane(config) -> int:
    """Recurrent state one lane holds on a hybrid model: float32 conv inputs ``(Kc - 1) x
    conv_dim`` plus the delta rule's ``Hv x dk x dv`` per Gated DeltaNet layer (0 for a model
    without such layers)."""
    gdn = getattr(config, "gdn_layers", ())
    if not gdn:
        return 0
    c = config
    per = (c.linear_conv_kernel_dim - 1) * c.conv_dim + \
        c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    return 4 * per * len(gdn)


def _dims(config) -> tuple[int, int, int, int, int, int]:
    """(H, I, V, nh, nkv, hd) of any model config (missing fields fall back to the Llama
    defaults)."""
    h = int(config.hidden_size)
    nh = int(getattr(config, "num_attention_heads", 1) or 1)
    nkv = int(getattr(config, "num_key_value_heads", nh) or nh)
    hd = int(getattr(config, "head_dim", None) or h // nh)
    inter = int(getattr(config, "intermediate_size", 4 * h))
    return h, inter, int(config.vocab_size), nh, nkv, hd


def activation_elems_per_token(config) -> int:
    """float32 values one token's pass allocates in one layer (an upper bound: no reuse
    assumed): residual, two norms and the o / down outputs (4 H), q k v (nh + 2 nkv) hd, the
    roped q k (nh + nkv) hd, the attention output nh hd, gate-up 2 I and the SwiGLU product I.
    A hybrid model (``config.conv_dim``: Qwen3.5) takes its larger layer: gated attention (q
    with its gate, normed and roped q k, the gated output) or Gated DeltaNet (the fused input
    projection, the conv output, normed q k, gates, the delta rule's and gated norm's outputs)."""
    h, inter, _, nh, nkv, hd = _dims(config)
    conv = int(getattr(config, "conv_dim", 0))
    if not conv:
        return 4 * h + (nh + 2 * nkv) * hd + (nh + nkv) * hd + nh * hd + 3 * inter
    vd, kd, hv = config.value_dim, config.key_dim, config.linear_num_value_heads
    attn = (2 * nh + 2 * nkv) * hd + 2 * (nh + nkv) * hd + 2 * nh * hd
    gdn = (conv + vd + 2 * hv) + conv + 2 * kd + 2 * hv + 2 * vd
    return 4 * h + max(attn, gdn) + 3 * inter


GDN_CHUNK_TOKENS = 64    # gpu.gdn_chunk.BT: tokens a chunk of the chunked gated delta rule
GDN_CHUNK_MAX_DK = 128   # gpu.gdn_chunk.applies: key head dims it takes (else the step kernel)


def gdn_chunk_workspace_bytes(config, max_tokens: int) -> int:
    """Scratch of one Gated DeltaNet layer's chunked delta rule on the GPU (``gpu.gdn_chunk``;
    only one layer's is alive at a time) for a pass of ``max_tokens`` tokens of one sequence:
    per 64-token chunk and value head, ``(dk + dv + 65) * 64`` float32 (W^T, U, P^T, gamma; dk
    padded up to 16 / 32 / 64 / 128 as the kernel does). 0 for a model without GDN layers or
    with key heads the kernel does not take."""
    if not getattr(config, "gdn_layers", ()) or max_tokens <= 0:
        return 0
    dk, dv = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
    if dk > GDN_CHUNK_MAX_DK:
        return 0
    dkt = next(d for d in (16, 32, 64, 128) if d >= dk)
    chunks = math.ceil(max_tokens / GDN_CHUNK_TOKENS)
    per = (dkt + dv + GDN_CHUNK_TOKENS + 1) * GDN_CHUNK_TOKENS
    return 4 * chunks * int(config.linear_num_value_heads) * per


def workspace_bytes(config, max_tokens: int, max_batch: int, backend: str,
                    max_packed_elems: int = 0) -> int:
    """Scratch of eager passes: ``max_tokens`` tokens of activations, ``max_batch`` logits rows,
    and on the GPU the fp16 dequantization scratch of the largest packed weight, the fp16 copy
    of the activations fed to the GEMM, ``GPU_LIBRARY_BYTES`` and, on a hybrid model, the
    chunked delta rule's scratch (``gdn_chunk_workspace_bytes``)."""
    h, inter, v, *_ = _dims(config)
    total = 4 * max_tokens * activation_elems_per_token(config) + 4 * max_batch * v
    if backend == "cupy":
        total += 2 * max_packed_elems + 2 * max_tokens * max(h, inter) + GPU_LIBRARY_BYTES
        total += gdn_chunk_workspace_bytes(config, max_tokens)
    return total


def cuda_graph_bytes(config, buckets, max_context: int, page_size: int,
                     prefill_tokens: tuple[int, ...] = ()) -> int:
    """Allowance for the CUDA graphs of ``buckets``: per bucket B, B tokens of activations and
    logits, the split-K attention partials (``min(ceil(max_context / 32), ceil(512 / (B nkv)))``
    partitions of ``hd + 2`` floats per head), the static inputs (ids, positions, lengths,
    cu_seqlens, block tables, slots) and ``GRAPH_FIXED_BYTES``; for each length T of
    ``prefill_tokens``, a single-sequence prefill graph too: T tokens of activations and of the
    GEMMs' fp16 operands, one logits row, T tokens of static inputs and the attention's tile
    list."""
    h, inter, v, nh, nkv, hd = _dims(config)
    max_pages = math.ceil(max_context / page_size)
    total = 0
    for t in prefill_tokens:
        total += 4 * t * activation_elems_per_token(config) + 2 * t * max(h, inter) + 4 * v
        total += 16 * t + 4 * (4 + max_pages) + 8 * math.ceil(t * nh / nkv / 16)
        total += GRAPH_FIXED_BYTES
    for b in buckets:
        splits = max(1, min(math.ceil(max_context / ATTN_MIN_PARTITION),
                            math.ceil(ATTN_SPLIT_BLOCKS / (b * nkv))))
        total += 4 * b * (activation_elems_per_token(config) + v)
        total += 4 * b * nh * splits * (hd + 2)
        total += 4 * (4 * b + 1 + b * max_pages) + 8 * b
        total += GRAPH_FIXED_BYTES
    return total


def device_capacity_bytes(ops) -> int | None:
    """Memory this process may plan for on ``ops``'s device: on the GPU the free device memory
    plus what CuPy's pool already holds (weights loaded before planning included); None on the
    host (not checked)."""
    if getattr(ops, "name", None) != "cupy":
        return None
    import cupy as cp
    free, _ = cp.cuda.runtime.memGetInfo()
    return int(free) + int(cp.get_default_memory_pool().total_bytes())


def plan_config(config, weights_bytes: int, *, backend: str, max_concurrency: int,
                max_context: int, page_size: int, prefill_chunk: int, max_packed_elems: int = 0,
                mtp_layers: int = 0, kv_dtype: str = "fp32", cuda_graph_buckets=(),
                capacity_bytes: int | None = None, enforce: bool | None = None,
                checkpoints: int = 0, prefill_graph: bool = False) -> MemoryPlan:
    """The memory plan of a model known by its config and resident weight size alone.

    Args:
        config: a ``LlamaConfig`` or ``Qwen35Config``.
        weights_bytes: the weights as resident on ``backend`` (``weights_resident_bytes``,
            or ``weight_bytes.resident_bytes`` of the stored tensors' shapes).
        backend: ``"cupy"`` or ``"numpy"``.
        max_concurrency, max_context, page_size, prefill_chunk: the engine's sizing.
        max_packed_elems: elements of the largest packed (GEMM) weight (GPU scratch).
        mtp_layers: attention layers of a loaded MTP head (paged like the others).
        kv_dtype: the KV cache's storage type (``kv_dtypes.KV_DTYPES``).
        cuda_graph_buckets, capacity_bytes, enforce, checkpoints, prefill_graph: as
            ``plan_memory``.

    Raises:
        ValueError: an unknown KV dtype, or one the head dim does not fit.
    """
    pages = max_concurrency * math.ceil(max_context / page_size)
    state = state_bytes_per_lane(config) * max_concurrency
    kv = kv_bytes_per_token(config, kv_dtype, mtp_layers) * pages * page_size + state
    ws = workspace_bytes(config, max(prefill_chunk, max_concurrency), max_concurrency,
                         backend, max_packed_elems)
    graphs = cuda_graph_bytes(config, cuda_graph_buckets, max_context, page_size,
                              prefill_lengths(min(prefill_chunk, max_context))
                              if prefill_graph else ()) \
        if cuda_graph_buckets else 0
    return MemoryPlan(backend, int(weights_bytes), kv, ws, graphs, pages, page_size,
                      tuple(cuda_graph_buckets), capacity_bytes,
                      capacity_bytes is not None if enforce is None else enforce,
                      kv_dtype, state, state * checkpoints)


def plan_memory(model, *, max_concurrency: int, max_context: int, page_size: int,
                prefill_chunk: int, cuda_graph_buckets=(), capacity_bytes: int | None = None,
                enforce: bool | None = None, kv_dtype: str = "fp32",
                checkpoints: int = 0, prefill_graph: bool = False) -> MemoryPlan:
    """The memory plan of serving ``model`` with this configuration (``plan_config`` with the
    weights measured on the loaded model).

    Args:
        model: a loaded model (weights prepared on its ``ops`` backend).
        max_concurrency, max_context, page_size, prefill_chunk: the engine's sizing
            (``max_context`` already capped at the model's context length).
        cuda_graph_buckets: batch sizes whose decode passes are captured as CUDA graphs.
        capacity_bytes: memory available (None: unknown).
        enforce: whether ``check`` fails on a deficit (default: when the capacity is known).
        kv_dtype: the KV cache's storage type (``EngineConfig.kv_dtype``).
        checkpoints: recurrent states a hybrid lane may keep on the host at turn checkpoints
            (``checkpoint_states``; 0: none).
        prefill_graph: single-sequence prefill passes of up to ``prefill_chunk`` tokens (at
            most ``max_context``) are replayed from CUDA graphs too, one a length of
            ``graph_buckets.prefill_lengths`` (``CudaGraphDecoder.prefill_graphs``).
    """
    weights, max_packed = weights_resident_bytes(model)
    return plan_config(model.config, weights, backend=getattr(model.ops, "name", "numpy"),
                       max_concurrency=max_concurrency, max_context=max_context,
                       page_size=page_size, prefill_chunk=prefill_chunk,
                       max_packed_elems=max_packed,
                       mtp_layers=1 if getattr(model, "mtp", None) is not None else 0,
                       kv_dtype=kv_dtype, cuda_graph_buckets=cuda_graph_buckets,
                       capacity_bytes=capacity_bytes, enforce=enforce, checkpoints=checkpoints,
                       prefill_graph=prefill_graph)


def checkpoint_states(config) -> int:
    """Recurrent states an ``EngineConfig``'s hybrid lane keeps at most on the host: the turn
    checkpoint and the user-turn anchor, plus the ring (0 with checkpoints or reuse off)."""
    if not (config.turn_checkpoint and config.prefix_reuse):
        return 0
    return 2 + config.turn_checkpoints


L2_MIN_BYTES = 2048 * MIB   # the auto L2 ceiling's floor (the fixed default it replaced)
L2_POOL_RATIO = 2           # auto: L2 holds twice the KV pool (SGLang's --hicache-ratio 2)


def host_available_bytes() -> int | None:
    """The host memory the kernel says a new allocation can take (``MemAvailable`` of
    /proc/meminfo); None where that is not readable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def l2_budget_bytes(setting: int | str, plan: MemoryPlan,
                    available: int | None) -> tuple[int, str]:
    """The L2 tier's ceiling in bytes and how it was chosen.

    A number is MiB as given. ``auto``: ``L2_POOL_RATIO`` times the KV pool (every lane's
    pages and state, so that sessions beyond the lanes keep their images: a 27B hybrid lane at
    64K tokens of fp32 KV is 8 GiB), at least ``L2_MIN_BYTES``, at most half of ``available``
    host memory (less the plan's own total on a host backend, whose pool is not allocated yet).
    The ceiling is not a reservation: images take memory only as sessions are demoted.
    """
    if setting != "auto":
        return int(setting) * MIB, "given"
    ratio = L2_POOL_RATIO * plan.kv_pool_bytes
    want, how = (ratio, f"auto: {L2_POOL_RATIO} x the KV pool") if ratio >= L2_MIN_BYTES else \
        (L2_MIN_BYTES, f"auto: the {L2_MIN_BYTES >> 20} MiB floor")
    if available is None:
        return want, f"{how} (host memory unknown)"
    free = available - (plan.total_bytes if plan.device == "host" else 0)
    cap = max(free // 2, 64 * MIB)
    if want <= cap:
        return want, how
    return cap, "auto: half the available host memory"

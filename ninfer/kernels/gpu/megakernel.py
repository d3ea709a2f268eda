"""Batch-1 decode of every Llama layer in one persistent kernel (``megakernel.cu``).

At batch 1 a decode step streams the whole model once; with a kernel per GEMV the weight stream
drains at every kernel boundary (about 4 us per GEMV on the H200, 128 GEMVs per token on the
8B shape: bench/gpu_notes.md, session 7). ``decode_layers`` runs all layers as one launch: a
persistent grid of one block per multiprocessor, whose producer threads stream every weight
through the shared-memory ring of ``gemv_bulk`` without ever waiting for the math, and whose
consumer warps run qkv, attention, o, gate_up and down of each layer with grid-wide barriers in
between (the design of Hazy Research's "No Bubbles" Llama-1B megakernel). The embedding, the
final RMSNorm + lm_head and sampling stay separate kernels.

It is off unless ``ENABLED`` (``NINFER_MEGAKERNEL=1``): it is correct (tests against the per-op
path) but not yet faster; ``bench/gpu_megakernel_trace.py`` shows where its time goes. With it
on, it takes a step when (``plan``): the device is sm_90+ with at least as many
multiprocessors as KV heads, the batch is one sequence with one new token, every layer's four
weights are packed (``GpuWeight``) in one scheme, ``gemv_bulk`` with int8 activations would
take each of them (``linear.bulk_config``: large models; ``--gemv-activations f16`` keeps the
per-op path), head dim and group fit (``attention.HEAD_DIMS``, ``attention.MAX_GROUP``) and a
ring of at least 4 slots plus the staged row fit in shared memory with every block resident
(q8 weights: ``UPW`` halved). Otherwise the model runs its layers op by op. Numerics: the
GEMVs are ``gemv_bulk``'s with int8 activations (same rounding, same per-tile summation
order); attention splits the context over min(grid // nkv, ceil(L / 256))
blocks per KV head (a different summation order from ``attention.paged_attention``).

The grid barrier needs every block resident at once: the grid is one block per multiprocessor
and ``plan`` checks with the occupancy calculator that one fits, but the launch is not
cooperative, so an MPS limit on multiprocessors or kernels of other streams sharing the GPU
could stall it (ninfer runs its decode on one stream).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import cupy as cp
import numpy as np

from ninfer.kernels.gpu import attention as gattn
from ninfer.kernels.gpu import function, sm_count
from ninfer.kernels.gpu import linear as glin
from ninfer.kernels.gpu.launch import launch

# Off by default: on the H200 it decoded the 8B shape at 438.7 tok/s against 469.3 for the
# per-op path in the same lease, SmolLM2 at 1,181 against 1,183 (bench/gpu_notes.md, session 8)
ENABLED = os.environ.get("NINFER_MEGAKERNEL", "0") == "1"
FORCE = False        # tests: also small models that gemv_bulk would not take
# consumer warps, chunks per warp per ring slot: 16x4 (36 KiB slots) beat 16x2 (406.0 tok/s)
# and 8x8 on the 8B shape (session 8)
W, UPW = 16, 4
RING_SLOTS = (8, 6, 5, 4)   # the deepest ring that fits is taken
LAUNCHES = 0         # launches so far (tests, benchmarks)
TRACE = None         # benchmarks: a zeroed (n_layers, 5, grid, 6) uint64 device array (see .cu)


def _static_smem() -> int:
    return 2 * W * 16 * 4 + W * 8 * 4 + 16 + 1024   # red, ssq, flag; the system's 1 KiB


@dataclass
class Plan:
    """A compiled ``decode_layers`` instantiation for one model, with its scratch buffers."""

    fn: object
    grid: int
    threads: int
    smem: int
    dims: tuple            # (n_layers, H, I, nkv)
    ring_slots: int
    shape: tuple           # (consumer warps, chunks per warp per slot)
    scratch: dict = field(default_factory=dict)
    tables: dict = field(default_factory=dict)   # pointers -> int64 device table
    last_table: tuple = (None, None)               # (kv cache, its table)


def _weights(layer):
    return (layer.qkv, layer.o, layer.gate_up, layer.down)


def plan(model) -> Plan | None:
    """The model's ``Plan`` (built once per setting of ``FORCE``, ``W``, ``UPW``, ``RING_SLOTS``,
    ``linear.ACTIVATIONS`` / ``BULK`` / ``BULK_SHAPE`` and ``gpu.DEFINES``, and kept in
    ``model.ops_cache``), or None where the megakernel does not apply (see the module
    docstring)."""
    from ninfer.kernels import gpu
    key = ("megakernel", FORCE, glin.ACTIVATIONS, glin.BULK, tuple(glin.BULK_SHAPE.items()), W,
           UPW, RING_SLOTS, gpu.DEFINES)
    if key not in model.ops_cache:   # earlier plans stay: a captured graph may use their buffers
        model.ops_cache[key] = _make_plan(model)
    return model.ops_cache[key]


def _make_plan(model) -> Plan | None:
    if not glin._sm90() or not model.layers:
        return None
    c = model.config
    hd, nh, nkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    g = nh // nkv
    if hd not in gattn.HEAD_DIMS or g > gattn.MAX_GROUP or nh % nkv:
        return None
    ws = [w for layer in model.layers for w in _weights(layer)]
    if not all(isinstance(w, glin.GpuWeight) for w in ws):
        return None
    sch = ws[0].sch
    if any(w.sch != sch for w in ws):
        return None
    shapes = [w.shape for w in _weights(model.layers[0])]
    h, inter = c.hidden_size, c.intermediate_size
    if shapes != [((nh + 2 * nkv) * hd, h), (h, nh * hd), (2 * inter, h), (h, inter)]:
        return None
    if not FORCE and (not glin.bulk_q8() or any(
            glin.bulk_config(1, k, n, sch, True) is None for n, k in shapes)):
        return None
    grid = sm_count()
    if grid < nkv:   # one block per KV head at least (a small MIG slice)
        return None
    splits = max(1, grid // nkv)
    kc_max = max(-(-k // 64) for _, k in shapes)
    union = max(kc_max * 80, 4 * ((g + 2) * hd + W * g * (hd + 2)))
    limit = glin.smem_limits()[0] - _static_smem()
    # the deepest ring of the largest slots (UPW, then halved: q8 slots are twice q4's) that fits
    fit = next(((upw, n) for upw in (UPW, UPW // 2, UPW // 4) if upw >= 1 for n in RING_SLOTS
                if n * W * upw * glin._chunk_bytes(sch, 1) + 32 * n + union <= limit), None)
    if fit is None:
        return None
    upw, ns = fit
    smem = ns * W * upw * glin._chunk_bytes(sch, 1) + 32 * ns + union
    name = f"decode_layers<{sch},{hd},{g},{W},{upw},{ns}>"
    fn = function("megakernel", name, (name,))
    # the function object is shared by every model of this instantiation: only ever raise it
    fn.max_dynamic_shared_size_bytes = max(smem, int(fn.max_dynamic_shared_size_bytes or 0))
    threads = 32 * (W + 1)
    if _resident_blocks(fn, threads, smem) < 1:   # the grid barrier needs every block resident
        return None
    p = Plan(fn, grid, threads, smem, (len(model.layers), h, inter, nkv), ns, (W, upw))
    p.scratch = {
        "qkv": cp.zeros(((nh + 2 * nkv) * hd,), cp.float32),
        "att": cp.zeros((nh * hd,), cp.float32),
        "gu": cp.zeros((2 * inter,), cp.float32),
        "part": cp.zeros((nkv * splits * g * (hd + 2),), cp.float32),
        "sync": cp.zeros((1 + len(model.layers) * nkv,), cp.uint32),
    }
    return p


def _resident_blocks(fn, threads: int, smem: int) -> int:
    """Blocks of ``fn`` that fit on one multiprocessor (the driver's occupancy calculator)."""
    kern = getattr(fn, "kernel", fn)
    try:
        return int(cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
            kern.ptr, threads, smem))
    except AttributeError:   # a CuPy without the binding: shared memory and registers
        regs = int(getattr(fn, "num_regs", 0)) * threads
        return min(glin.smem_limits()[1] // (smem + _static_smem()),
                   65536 // regs if regs else 1)


def _table(p: Plan, model, kv) -> cp.ndarray:
    """The (n_layers, 12) int64 device table of ``MkLayer``: weight, norm and cache pointers.
    Kept per set of pointers (a few KiB each, one per KV cache the model decodes into) and never
    dropped: a captured CUDA graph reads it at every replay. The last cache's is found without
    walking the layers (the engine decodes into one cache)."""
    if p.last_table[0] is kv:
        return p.last_table[1]
    rows = tuple(
        tuple([w.codes.data.ptr for w in _weights(layer)]
              + [w.scales.data.ptr for w in _weights(layer)]
              + [layer.input_norm.data.ptr, layer.post_norm.data.ptr, kv.k[i].data.ptr,
                 kv.v[i].data.ptr])
        for i, layer in enumerate(model.layers))
    table = p.tables.get(rows)
    if table is None:
        table = p.tables[rows] = cp.asarray(np.asarray(rows, dtype=np.int64))
    p.last_table = (kv, table)
    return table


def applicable(model, h: cp.ndarray, batch, kv) -> Plan | None:
    """The plan to run ``batch`` with, or None where the megakernel does not apply (off, not a
    one-sequence one-token decode, or a model ``plan`` refuses)."""
    if (not ENABLED or batch.num_tokens != 1 or batch.num_seqs != 1 or h.shape[0] != 1
            or not isinstance(kv.k[0], cp.ndarray) or not h.flags.c_contiguous):
        return None
    return plan(model)


def decode_layers(p: Plan, model, h: cp.ndarray, kv, positions: cp.ndarray,
                  context_lens: cp.ndarray, block_tables: cp.ndarray, slots: cp.ndarray,
                  inv_freq: cp.ndarray) -> None:
    """Launch every layer of ``model`` for one sequence's new token: the (1, H) float32 residual
    stream ``h`` is updated in place and the token's K / V written into ``kv``. The batch
    arrays are validated int32 device copies (``slots`` int64, one each; ``block_tables`` row 0
    is the sequence's) and ``inv_freq`` the (head_dim / 2,) float32 RoPE frequencies, as
    ``CupyOps.decode_layers`` prepares them."""
    global LAUNCHES
    c = model.config
    n_layers, hs, inter, nkv = p.dims
    s = p.scratch
    launch(p.fn, (p.grid,), (p.threads,), (
        _table(p, model, kv), np.int32(n_layers), np.int32(hs), np.int32(inter), np.int32(nkv),
        np.float32(c.rms_norm_eps), np.float32(model.scale), h, s["qkv"], s["att"], s["gu"],
        s["part"], s["sync"], positions, context_lens, block_tables, slots, inv_freq,
        np.int32(kv.page_size), np.int64(0) if TRACE is None else TRACE), shared_mem=p.smem)
    LAUNCHES += 1

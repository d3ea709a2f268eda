"""Bytes a model's weights take once prepared on a backend, from the stored tensors' schemes and
shapes alone (``ninfer plan``; ``memory.weights_resident_bytes`` measures a loaded model).

The models prepare weights so (``models.llama``, ``models.qwen35``, ``kernels.*_ops``):

- NumPy backend: every tensor as float32 (4 bytes an element);
- CuPy backend: a q4 / q8 matrix whose K and group are multiples of 32 is packed into the
  tensor-core layout (``kernels.mma_layout``: rows padded to 16, columns to 64; q4 half a byte
  and q8 one byte an element, one fp16 scale (and min) per 32 columns); every other tensor
  (norms, the conv kernel, float matrices) is float32;
- q/k/v, gate/up and the Gated DeltaNet input projections are fused along N: one packed weight
  when every part has the same quantized scheme, group and mins, else each part on its own;
  ``mtp.fc`` is split along K into its embedding and hidden halves;
- CuPy backend, the Llama family: the layers' packed weights also as fp16 where they fit
  ``KernelConfig.prefill_f16_mib`` (``LinearOps.keep_f16``).
"""
from __future__ import annotations

from collections.abc import Iterable

from ninfer.kernels import mma_layout
from ninfer.kernels.config import KernelConfig
from ninfer.store.model_shapes import TensorShape

FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.qkv_proj"),
         ("mlp.gate_proj", "mlp.up_proj"),
         ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
          "linear_attn.in_proj_a"))
_PLAIN = ("conv1d.weight",)   # prepared as float32 whatever their scheme


def _fused_key(name: str):
    """(layer prefix, group index) of a tensor fused with others, else None."""
    for g, members in enumerate(FUSED):
        for m in members:
            if name.endswith("." + m + ".weight"):
                return name[:-len(m + ".weight")], g
    return None


def _packable(t: TensorShape) -> bool:
    return (t.scheme in ("q4", "q8") and len(t.shape) == 2 and not t.name.endswith(_PLAIN)
            and mma_layout.layout_ok(t.shape[1], t.group))


def packed_bytes(scheme: str, n: int, k: int, mins: bool = False) -> int:
    """Device bytes of an ``(n, k)`` q4 / q8 weight in the tensor-core layout (codes +
    scales, ``gpu.linear.GpuWeight.nbytes``)."""
    n16, kc = mma_layout.padded(n, k)
    codes = n16 * kc * (512 if scheme == "q4" else 1024)
    return codes + n16 * kc * 64 * (2 if mins else 1)


def resident_bytes(tensors: Iterable[TensorShape], backend: str) -> tuple[int, int]:
    """Bytes of the prepared weights on ``backend`` and the element count of the largest
    packed weight (0 on NumPy), as ``memory.weights_resident_bytes`` reports them."""
    tensors = list(tensors)
    if backend != "cupy":
        return sum(4 * t.elems for t in tensors), 0
    groups: dict = {}
    units: list[list[TensorShape]] = []
    for t in tensors:
        if t.name == "mtp.fc.weight" and len(t.shape) == 2:   # split_k into two halves
            half = TensorShape(t.name, t.scheme, (t.shape[0], t.shape[1] // 2), t.group, t.mins)
            units += [[half], [half]]
            continue
        key = _fused_key(t.name)
        if key is None:
            units.append([t])
        else:
            groups.setdefault(key, []).append(t)
    for parts in groups.values():
        kinds = {(p.scheme, p.group, p.mins) for p in parts}
        if len(kinds) == 1 and all(_packable(p) for p in parts):
            p0 = parts[0]
            units.append([TensorShape(p0.name, p0.scheme, (sum(p.shape[0] for p in parts),
                                                           p0.shape[1]), p0.group, p0.mins)])
        else:
            units += [[p] for p in parts]
    total = largest = layers = 0
    for (t,) in units:
        if _packable(t):
            total += packed_bytes(t.scheme, t.shape[0], t.shape[1], t.mins)
            largest = max(largest, t.elems)
            layers += 2 * t.elems if t.name.startswith("model.layers.") else 0
        else:
            total += 4 * t.elems
    llama = not any(".linear_attn." in t.name for t in tensors)
    if llama and layers <= KernelConfig().prefill_f16_mib << 20:
        total += layers   # (the fp16 copies a Llama model keeps: LinearOps.keep_f16)
    return total, largest

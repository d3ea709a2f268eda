"""llama.cpp ``qwen35`` GGUF files (Qwen3.5 / Qwen3.6 hybrid) back to HF names and semantics.

What llama.cpp's ``convert_hf_to_gguf.py`` (``Qwen3_5TextModel`` <- ``_LinearAttentionVReorderBase``
<- ``Qwen3NextModel`` <- ``_QwenMtpMixin``) does to an HF checkpoint, and what this module undoes:

- zero-centred RMSNorm weights (every ``*norm.weight`` except the GDN gated norm ``ssm_norm``,
  MTP norms included) are stored as ``1 + w``: we subtract 1 (float32).
- ``A_log`` is stored as ``ssm_a = -exp(A_log)``: we take ``log(-ssm_a)``.
- ``dt_bias`` is stored as ``ssm_dt.bias``; ``conv1d`` ``(C, 1, Kc)`` is squeezed to ``(C, Kc)``.
- when ``Hv != Hk``, V heads are reordered from grouped (by key head: ``g * r + j``) to tiled
  (``j * Hk + g``) order in the V rows of ``in_proj_qkv`` and ``conv1d``, the rows of
  ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, ``A_log`` / ``dt_bias`` and the columns of
  ``out_proj``: we apply the inverse permutation (lossless on quantized rows and, when ``dv`` is
  a multiple of the group, on quantized columns).
- attention q/k rows are NOT permuted (NeoX rotation; llama.cpp's IMROPE with equal text
  positions in every section is plain rotate-half RoPE). ``--fuse-qkv`` files hold one
  ``attn_qkv`` (q | k | v rows) per attention layer: we split it.
- the MTP head (kept by default; dropped with ``--no-mtp``) becomes extra layers
  ``blk.{n + j}`` (``block_count`` includes them, ``nextn_predict_layers`` counts them) with
  ``mtp.fc`` -> ``nextn.eh_proj``, ``pre_fc_norm_embedding`` -> ``nextn.enorm``,
  ``pre_fc_norm_hidden`` -> ``nextn.hnorm``, ``mtp.norm`` -> ``nextn.shared_head_norm``.

Names (GGUF kind -> HF suffix) are in ``COMMON`` / ``ATTENTION`` / ``GDN`` / ``NEXTN``.
"""
from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np

from ninfer.store.artifact import ArtifactError
from ninfer.store.quant import QuantTensor, dequantize

ARCHITECTURE = "qwen35"

COMMON = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
ATTENTION = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
GDN = {
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
NEXTN = {  # on the first MTP layer, as mtp.* (not mtp.layers.*)
    "nextn.eh_proj.weight": "mtp.fc.weight",
    "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
    "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
    "nextn.shared_head_norm.weight": "mtp.norm.weight",
}
GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# MTP tensors llama.cpp may read but HF Qwen3.5 has no counterpart for (the MTP head shares the
# trunk's embedding and lm_head): a file with them loads without its MTP head.
_NEXTN_UNSHARED = ("nextn.embed_tokens.weight", "nextn.shared_head_head.weight")
_BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def config(get: Callable[[str, Any], Any], require: Callable[[str], Any], n_tokens: int,
           tensor_names: set[str]) -> dict[str, Any]:
    """The ``qwen35`` artifact config (``hf_import.qwen35_config`` keys) from GGUF metadata.

    Args:
        get / require: metadata readers (``require`` raises ArtifactError when a key is missing).
        n_tokens: length of ``tokenizer.ggml.tokens``.
        tensor_names: the file's tensor names (tying, MTP presence).

    Raises:
        ArtifactError: a required key missing, RoPE scaling, or inconsistent sizes.
    """
    a = ARCHITECTURE
    n_all = int(require(f"{a}.block_count"))
    n_mtp = int(get(f"{a}.nextn_predict_layers", 0) or 0)
    n = n_all - n_mtp
    hidden = int(require(f"{a}.embedding_length"))
    heads = int(require(f"{a}.attention.head_count"))
    head_dim = int(get(f"{a}.attention.key_length", hidden // heads))
    rot = int(get(f"{a}.rope.dimension_count", head_dim // 4))
    hv = int(require(f"{a}.ssm.time_step_rank"))
    inner = int(require(f"{a}.ssm.inner_size"))
    if n <= 0 or hv <= 0 or inner % hv or head_dim <= 0:
        raise ArtifactError(f"inconsistent qwen35 metadata: block_count {n_all}, nextn "
                            f"{n_mtp}, ssm.inner_size {inner}, ssm.time_step_rank {hv}")
    kind = get(f"{a}.rope.scaling.type")
    if kind not in (None, "none") or get(f"{a}.rope.scaling.factor") not in (None, 0.0, 1.0):
        raise ArtifactError(f"RoPE scaling {kind!r} is not supported for qwen35 (default only)")
    recurrent = get(f"{a}.attention.recurrent_layers")
    if recurrent is not None:
        layer_types = ["linear_attention" if r else "full_attention" for r in list(recurrent)[:n]]
    else:
        every = int(get(f"{a}.full_attention_interval", 4))
        layer_types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                       for i in range(n)]
    if len(layer_types) != n:
        raise ArtifactError(f"{a}.attention.recurrent_layers has {len(layer_types)} entries "
                            f"for {n} layers")
    mtp_present = any(f"blk.{n}.{k}" in tensor_names for k in NEXTN)
    unshared = any(f"blk.{n}.{k}" in tensor_names for k in _NEXTN_UNSHARED)
    return {
        "model_type": "qwen3_5_text",
        "vocab_size": int(get(f"{a}.vocab_size", n_tokens)),
        "hidden_size": hidden,
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get(f"{a}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "intermediate_size": int(require(f"{a}.feed_forward_length")),
        "hidden_act": "silu",
        "rms_norm_eps": _f32(get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(get(f"{a}.rope.freq_base", 10000000.0)),
        "partial_rotary_factor": rot / head_dim,
        "max_position_embeddings": int(get(f"{a}.context_length", 32768)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": int(require(f"{a}.ssm.conv_kernel")),
        "linear_key_head_dim": int(require(f"{a}.ssm.state_size")),
        "linear_value_head_dim": inner // hv,
        "linear_num_key_heads": int(require(f"{a}.ssm.group_count")),
        "linear_num_value_heads": hv,
        "mtp_num_hidden_layers": n_mtp if mtp_present and not unshared else 0,
    }


def _f32(x: float) -> float:
    return float(str(np.float32(x)))


def hf_name(gguf_name: str, cfg: dict[str, Any]) -> str | None:
    """HF name of a qwen35 GGUF tensor under ``cfg`` (layer kinds, MTP layers), or None for a
    name this architecture does not have. MTP tensors map to ``mtp.*`` even when the config
    drops the head (the caller skips them)."""
    if gguf_name in GLOBAL:
        return GLOBAL[gguf_name]
    m = _BLK_RE.match(gguf_name)
    if not m:
        return None
    i, kind = int(m.group(1)), m.group(2)
    n = cfg["num_hidden_layers"]
    if i < n:
        table = GDN if cfg["layer_types"][i] == "linear_attention" else ATTENTION
        suffix = COMMON.get(kind) or table.get(kind)
        if suffix is None and kind == "attn_qkv.weight" and table is ATTENTION:
            suffix = "self_attn.qkv_proj.weight"   # --fuse-qkv: split by ``convert_layer``
        return f"model.layers.{i}.{suffix}" if suffix else None
    if kind in NEXTN and i == n:
        return NEXTN[kind]
    suffix = COMMON.get(kind) or ATTENTION.get(kind)
    if suffix is None and kind == "attn_qkv.weight":
        suffix = "self_attn.qkv_proj.weight"
    if suffix is None and kind in _NEXTN_UNSHARED:
        suffix = kind
    return f"mtp.layers.{i - n}.{suffix}" if suffix else None


def _take_rows(t: QuantTensor, idx: np.ndarray) -> QuantTensor:
    parts = {k: np.ascontiguousarray(np.asarray(v)[idx]) for k, v in t.parts().items()}
    return QuantTensor(t.scheme, (len(idx), *t.shape[1:]), group=t.group, **parts)


def _float(values: np.ndarray) -> QuantTensor:
    a = np.ascontiguousarray(values, dtype=np.float32)
    return QuantTensor("f32", a.shape, data=a)


def v_head_order(hk: int, hv: int) -> np.ndarray:
    """``perm`` (int64, ``(Hv,)``) with ``hf_head[h] = gguf_head[perm[h]]``: the inverse of
    ``_LinearAttentionVReorderBase._reorder_v_heads`` (grouped -> tiled V heads)."""
    r = hv // hk
    h = np.arange(hv, dtype=np.int64)
    return (h % r) * hk + h // r


def _head_rows(order: np.ndarray, d: int, offset: int = 0) -> np.ndarray:
    return offset + (order[:, None] * d + np.arange(d)).reshape(-1)


def _permute_col_blocks(t: QuantTensor, order: np.ndarray, d: int) -> QuantTensor:
    """Columns of an ``(N, K)`` tensor in blocks of ``d``: ``out[:, block b] = t[:, block
    order[b]]``. Lossless for float schemes and for quantized ones whose group divides ``d``;
    otherwise dequantized to f32."""
    n, k = t.shape
    if t.scheme in ("f32", "f16", "bf16"):
        data = np.asarray(t.data).reshape(n, len(order), d)[:, order].reshape(n, k)
        return QuantTensor(t.scheme, t.shape, data=np.ascontiguousarray(data))
    per_code = 2 if t.scheme == "q4" else 1
    if d % t.group or d % per_code:
        w = dequantize(t).reshape(n, len(order), d)[:, order].reshape(n, k)
        return _float(w)
    parts = {}
    for name, v in t.parts().items():
        v = np.asarray(v)
        parts[name] = np.ascontiguousarray(v.reshape(n, len(order), -1)[:, order].reshape(n, -1))
    return QuantTensor(t.scheme, t.shape, group=t.group, **parts)


def convert_layer(name: str, t: QuantTensor, cfg: dict[str, Any]) -> dict[str, QuantTensor]:
    """Undo the converter's transform of one tensor (already renamed to HF ``name`` and
    converted to a QuantTensor in its GGUF row order). Returns one or more HF tensors."""
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    reorder = hk != hv and ".linear_attn." in name
    order = v_head_order(hk, hv) if reorder else None
    key2 = 2 * hk * dk
    if name.endswith(".self_attn.qkv_proj.weight"):
        nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        base, q = name[:-len("qkv_proj.weight")], 2 * nh * hd
        sizes = {"q_proj": q, "k_proj": nkv * hd, "v_proj": nkv * hd}
        if t.shape[0] != sum(sizes.values()):
            raise ValueError(f"fused attn_qkv has {t.shape[0]} rows, expected {sum(sizes.values())}")
        out, row = {}, 0
        for part, rows in sizes.items():
            out[f"{base}{part}.weight"] = _take_rows(t, np.arange(row, row + rows))
            row += rows
        return out
    if "norm" in name and not name.endswith("linear_attn.norm.weight"):
        return {name: _float(dequantize(t).astype(np.float64) - 1.0)}
    if name.endswith("linear_attn.A_log"):
        a = dequantize(t).astype(np.float64)
        if np.any(a >= 0):
            raise ValueError("ssm_a must be negative (-exp(A_log))")
        t = _float(np.log(-a))
    if order is None:
        return {name: t}
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        idx = np.concatenate([np.arange(key2), _head_rows(order, dv, key2)])
    elif name.endswith("in_proj_z.weight"):
        idx = _head_rows(order, dv)
    elif name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        idx = order
    elif name.endswith("out_proj.weight"):
        return {name: _permute_col_blocks(t, order, dv)}
    else:
        return {name: t}
    return {name: _take_rows(t, idx)}


def expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every HF tensor ``Qwen35Model`` reads for ``cfg`` and its shape (``lm_head`` only when
    untied, ``mtp.*`` only when ``mtp_num_hidden_layers`` > 0)."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, kc = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    conv = 2 * hk * dk + hv * dv
    common = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
              "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
              "mlp.down_proj.weight": (h, i)}
    attn = {"self_attn.q_proj.weight": (2 * nh * hd, h), "self_attn.k_proj.weight": (nkv * hd, h),
            "self_attn.v_proj.weight": (nkv * hd, h), "self_attn.o_proj.weight": (h, nh * hd),
            "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
    gdn = {"linear_attn.in_proj_qkv.weight": (conv, h), "linear_attn.in_proj_z.weight": (hv * dv, h),
           "linear_attn.in_proj_b.weight": (hv, h), "linear_attn.in_proj_a.weight": (hv, h),
           "linear_attn.conv1d.weight": (conv, kc), "linear_attn.dt_bias": (hv,),
           "linear_attn.A_log": (hv,), "linear_attn.norm.weight": (dv,),
           "linear_attn.out_proj.weight": (h, hv * dv)}
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = (v, h)
    for li, kind in enumerate(cfg["layer_types"]):
        mixer = gdn if kind == "linear_attention" else attn
        out.update({f"model.layers.{li}.{k}": s for k, s in {**common, **mixer}.items()})
    if cfg["mtp_num_hidden_layers"]:
        out.update({"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
                    "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)})
        for j in range(cfg["mtp_num_hidden_layers"]):
            out.update({f"mtp.layers.{j}.{k}": s for k, s in {**common, **attn}.items()})
    return out

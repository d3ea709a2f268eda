"""Import llama.cpp GGUF files (architectures ``llama`` and ``qwen35``) into ninfer's tensor
layouts (``qwen35`` names, metadata and inverse transforms: ``gguf_qwen35``).

- F32 stays ``f32``, F16 stays ``f16``, BF16 stays ``bf16`` (bit patterns as uint16).
- Q8_0 -> ``q8`` group 32, Q4_0 -> ``q4`` group 32 without mins, Q4_1 -> ``q4`` group 32 with
  mins. These are repacked losslessly: ``quant.dequantize`` of the result is bit-identical to
  ``gguf.quants.dequantize`` of the source block data.
- Every other GGML type is dequantized with ``gguf.quants.dequantize`` and requantized with
  ``quant.quantize_q8`` (group 32); when K is not a multiple of 32 (or the tensor is not 2-D)
  it is kept as ``f16`` (1-D tensors as ``f32``).
- q/k projection rows are un-permuted from llama.cpp's adjacent-pair RoPE layout back to
  HF's rotate-half layout (see ``unpermute_rows``); tensor names become HF's.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from ninfer.store.artifact import ArtifactError, check_architecture, file_sha256, write_artifact
from ninfer.store.quant import QuantTensor, quantize_q8

GROUP = 32

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF name of a llama GGUF tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``), or None for an unknown name."""
    m = _LAYER_RE.match(gguf_name)
    if m:
        layer, kind, suffix = m.groups()
        if kind in _LAYER_NAMES:
            return f"model.layers.{int(layer)}.{_LAYER_NAMES[kind]}.{suffix}"
        return None
    m = _GLOBAL_RE.match(gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def unpermute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Row index map undoing ``convert_hf_to_gguf.py``'s q/k permutation.

    Returns ``perm`` (int64, shape ``(n_rows,)``) such that ``hf = gguf[perm]`` along the row
    (output) axis: within each head of ``hd = n_rows // n_heads`` rows, GGUF row ``2i + j`` is
    HF row ``j * hd/2 + i``. Works on float rows and on rows of quantized blocks alike.

    Raises:
        ArtifactError: ``n_rows`` is not divisible into heads with an even head dim.
    """
    if n_heads <= 0 or n_rows % n_heads or (n_rows // n_heads) % 2:
        raise ArtifactError(f"cannot un-permute {n_rows} rows into {n_heads} heads")
    hd = n_rows // n_heads
    return (np.arange(n_rows, dtype=np.int64)
            .reshape(n_heads, hd // 2, 2).transpose(0, 2, 1).reshape(-1))


def permute_rows(t: QuantTensor, perm: np.ndarray) -> QuantTensor:
    """Apply a row permutation (``out[r] = t[perm[r]]`` on axis 0) to every payload part."""
    parts = {k: np.ascontiguousarray(np.asarray(v)[perm]) for k, v in t.parts().items()}
    return QuantTensor(t.scheme, t.shape, group=t.group, **parts)


# --------------------------------------------------------------------------------------------
# Block repacking
# --------------------------------------------------------------------------------------------

def _blocks(raw: np.ndarray, rows: int, k: int, type_size: int) -> np.ndarray:
    return np.asarray(raw, dtype=np.uint8).reshape(rows, k // GROUP, type_size)


def _f16(col: np.ndarray) -> np.ndarray:
    """(rows, nb, 2) uint8 -> (rows, nb) float16 (little-endian)."""
    return np.ascontiguousarray(col).view("<f2")[..., 0].astype(np.float16)


def _gguf_nibbles_to_ours(qs: np.ndarray, rows: int, k: int) -> np.ndarray:
    """GGUF Q4 nibbles (byte j: low -> x[j], high -> x[j+16] per 32-block) -> our packing
    (byte i: low -> x[2i], high -> x[2i+1]); returns uint8 (rows, k // 2)."""
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, k)
    return np.ascontiguousarray(q[:, 0::2] | (q[:, 1::2] << 4))


def repack_q8_0(raw: np.ndarray, rows: int, k: int) -> QuantTensor:
    """GGUF Q8_0 blocks (uint8, ``rows * k/32 * 34`` bytes) -> ``q8`` group 32, lossless."""
    b = _blocks(raw, rows, k, 34)
    codes = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, k)
    return QuantTensor("q8", (rows, k), codes=codes, scales=_f16(b[..., :2]), group=GROUP)


def repack_q4_0(raw: np.ndarray, rows: int, k: int) -> QuantTensor:
    """GGUF Q4_0 blocks (18 bytes per 32) -> ``q4`` group 32 without mins, lossless."""
    b = _blocks(raw, rows, k, 18)
    codes = _gguf_nibbles_to_ours(b[..., 2:], rows, k)
    return QuantTensor("q4", (rows, k), codes=codes, scales=_f16(b[..., :2]), group=GROUP)


def repack_q4_1(raw: np.ndarray, rows: int, k: int) -> QuantTensor:
    """GGUF Q4_1 blocks (20 bytes per 32) -> ``q4`` group 32 with mins, lossless."""
    b = _blocks(raw, rows, k, 20)
    codes = _gguf_nibbles_to_ours(b[..., 4:], rows, k)
    return QuantTensor("q4", (rows, k), codes=codes, scales=_f16(b[..., :2]),
                       mins=_f16(b[..., 2:4]), group=GROUP)


def convert_tensor(data: np.ndarray, qtype, shape: tuple[int, ...]) -> QuantTensor:
    """Convert one GGUF tensor payload to a QuantTensor.

    Args:
        data: the reader's array (typed for F32/F16, uint8 bytes for block types and BF16).
        qtype: ``gguf.GGMLQuantizationType``.
        shape: logical numpy shape (``(rows, K)`` for matrices; GGUF ``ne`` reversed).

    Raises:
        ValueError / NotImplementedError: unsupported type (wrapped by ``import_gguf``).
    """
    import gguf
    from gguf import GGMLQuantizationType as T

    shape = tuple(int(d) for d in shape)
    if qtype == T.F32:
        return QuantTensor("f32", shape, data=np.asarray(data).view("<f4").reshape(shape))
    if qtype == T.F16:
        return QuantTensor("f16", shape, data=np.asarray(data).view("<f2").reshape(shape))
    if qtype == T.BF16:
        return QuantTensor("bf16", shape, data=np.asarray(data).view("<u2").reshape(shape))
    if qtype == T.F64:
        return QuantTensor("f32", shape, data=np.asarray(data, dtype=np.float64)
                           .astype(np.float32).reshape(shape))
    if qtype in (T.I8, T.I16, T.I32, T.I64):
        raise ValueError(f"integer tensor type {qtype.name} is not supported")
    two_d = len(shape) == 2
    rows, k = (shape[0], shape[1]) if two_d else (math.prod(shape[:-1]), shape[-1])
    if two_d and k % GROUP == 0:
        if qtype == T.Q8_0:
            return repack_q8_0(data, rows, k)
        if qtype == T.Q4_0:
            return repack_q4_0(data, rows, k)
        if qtype == T.Q4_1:
            return repack_q4_1(data, rows, k)
    w = gguf.quants.dequantize(np.asarray(data), qtype).reshape(shape)
    if two_d and k % GROUP == 0:
        return quantize_q8(w, GROUP)
    if len(shape) == 1:
        return QuantTensor("f32", shape, data=np.ascontiguousarray(w, dtype=np.float32))
    return QuantTensor("f16", shape, data=w.astype(np.float16))


def stored_scheme(qtype, shape: tuple[int, ...]) -> tuple[str, int, bool]:
    """``(scheme, group, mins)`` of the QuantTensor ``convert_tensor`` makes of a GGUF tensor of
    this type and logical shape, decided without its data.

    Raises:
        ValueError: an integer tensor type.
    """
    from gguf import GGMLQuantizationType as T

    plain = {T.F32: "f32", T.F16: "f16", T.BF16: "bf16", T.F64: "f32"}
    if qtype in plain:
        return plain[qtype], 0, False
    if qtype in (T.I8, T.I16, T.I32, T.I64):
        raise ValueError(f"integer tensor type {qtype.name} is not supported")
    if len(shape) == 2 and shape[1] % GROUP == 0:
        if qtype in (T.Q4_0, T.Q4_1):
            return "q4", GROUP, qtype == T.Q4_1
        return "q8", GROUP, False   # Q8_0 repacked, any other type requantized
    return ("f32" if len(shape) == 1 else "f16"), 0, False


# --------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------

def _f32_value(x: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not
    9.999999747378752e-06)."""
    return float(str(np.float32(x)))


class _Fields:
    def __init__(self, reader, path: Path):
        self.reader = reader
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    def require(self, key: str) -> Any:
        v = self.get(key)
        if v is None:
            raise ArtifactError(f"{self.path}: GGUF metadata key {key!r} is missing")
        return v


def _rope_scaling(fields: _Fields, arch: str, rope_freqs: np.ndarray | None) -> dict | None:
    kind = fields.get(f"{arch}.rope.scaling.type")
    factor = fields.get(f"{arch}.rope.scaling.factor")
    if rope_freqs is not None:
        return {"rope_type": "freq_factors",
                "freq_factors": [float(x) for x in np.asarray(rope_freqs, dtype=np.float32)]}
    if kind in (None, "none") and factor in (None, 1.0, 0.0):
        return None
    out: dict[str, Any] = {"rope_type": kind or "linear"}
    if factor is not None:
        out["factor"] = _f32_value(factor)
    orig = fields.get(f"{arch}.rope.scaling.original_context_length")
    if orig is not None:
        out["original_max_position_embeddings"] = int(orig)
    return out


def _tokenizer(fields: _Fields) -> dict:
    tokens = fields.require("tokenizer.ggml.tokens")
    tok = {
        "model": fields.get("tokenizer.ggml.model", "gpt2"),
        "pre": fields.get("tokenizer.ggml.pre", "default"),
        "tokens": list(tokens),
        "token_types": [int(t) for t in fields.get("tokenizer.ggml.token_type", [1] * len(tokens))],
        "merges": list(fields.get("tokenizer.ggml.merges", [])),
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": fields.get("tokenizer.ggml.padding_token_id"),
        "unk_token_id": fields.get("tokenizer.ggml.unknown_token_id"),
    }
    add_bos = fields.get("tokenizer.ggml.add_bos_token")
    tok["add_bos_token"] = bool(add_bos) if add_bos is not None else tok["model"] == "llama"
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if tok[key] is not None:
            tok[key] = int(tok[key])
    return tok


def _llama_config(fields: _Fields, tok: dict, tensor_names: set[str]) -> dict:
    arch = "llama"
    tokens = tok["tokens"]
    hidden = int(fields.require(f"{arch}.embedding_length"))
    heads = int(fields.require(f"{arch}.attention.head_count"))
    kv_heads = int(fields.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(fields.get(f"{arch}.attention.key_length", hidden // heads))
    cfg = {
        "vocab_size": int(fields.get(f"{arch}.vocab_size", len(tokens))),
        "hidden_size": hidden,
        "num_hidden_layers": int(fields.require(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": int(fields.require(f"{arch}.feed_forward_length")),
        "rope_theta": _f32_value(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": _f32_value(fields.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(fields.get(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "rope_scaling": None,
        "bos_token_id": tok["bos_token_id"],
        "eos_token_id": tok["eos_token_id"],
    }
    return cfg


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------

def _open_reader(path: Path):
    import gguf

    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise ArtifactError(f"{path}: cannot open: {e.strerror or e}") from e
    if size == 0:
        raise ArtifactError(f"{path}: empty file, not a GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ArtifactError(f"{path}: wrong magic {magic!r}, not a GGUF file")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/KeyError/... on bad files
        raise ArtifactError(f"{path}: corrupt or truncated GGUF ({type(e).__name__}: {e})") from e
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise ArtifactError(f"{path}: truncated GGUF (tensor {t.name!r} ends at byte {end}, "
                                f"file has {size})")
    return reader


def read_metadata(path: str | os.PathLike):
    """A GGUF's reader (tensor data memory-mapped, not read) and what its metadata says.

    Returns:
        ``(reader, architecture, config, tokenizer, chat_template, source)`` as
        ``import_gguf``'s header has them (``source`` without ``gguf_types``).

    Raises:
        ArtifactError: as ``import_gguf``, for the file and its metadata.
    """
    path = Path(path)
    reader = _open_reader(path)
    fields = _Fields(reader, path)
    try:
        arch = fields.get("general.architecture")
    except Exception as e:
        raise ArtifactError(f"{path}: corrupt GGUF metadata ({e})") from e
    if arch is None:
        raise ArtifactError(f"{path}: GGUF has no general.architecture")
    check_architecture(path, arch)

    names = {t.name for t in reader.tensors}
    try:
        tok = _tokenizer(fields)
        if arch == "llama":
            cfg = _llama_config(fields, tok, names)
        else:
            from ninfer.store import gguf_qwen35
            cfg = gguf_qwen35.config(fields.get, fields.require, len(tok["tokens"]), names)
            cfg.update(bos_token_id=tok["bos_token_id"], eos_token_id=tok["eos_token_id"],
                       pad_token_id=tok["pad_token_id"])
        chat_template = fields.get("tokenizer.chat_template")
        source = {"format": "gguf", "file": path.name, "size_bytes": os.path.getsize(path),
                  "name": fields.get("general.name"), "file_type": fields.get("general.file_type")}
    except ArtifactError as e:
        if str(e).startswith(str(path)):
            raise
        raise ArtifactError(f"{path}: {e}") from e
    except Exception as e:
        raise ArtifactError(f"{path}: corrupt GGUF metadata ({type(e).__name__}: {e})") from e

    return reader, arch, cfg, tok, chat_template, source


def import_gguf(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, QuantTensor]]:
    """Read a llama or qwen35 GGUF into a ``.ninfer`` header and HF-named tensors (in memory).

    Returns:
        ``(header, tensors)``: header has ``architecture`` "llama" or "qwen35", ``config``
        (``qwen35``: ``hf_import.qwen35_config``'s keys) and ``tokenizer``
        dicts (see docs/architecture.md), ``chat_template`` (str or None) and ``source``
        (``format`` "gguf", ``file``, ``size_bytes``, ``name``, ``file_type``, ``gguf_types``).
        Float tensors may be zero-copy views of the memory-mapped GGUF.

    Raises:
        ArtifactError: (message names the file) wrong magic, truncated/corrupt file, architecture
            other than llama / qwen35, missing metadata, unknown tensor name, unsupported tensor
            type, a missing tensor or one of the wrong shape (qwen35).
    """
    path = Path(path)
    reader, arch, cfg, tok, chat_template, source = read_metadata(path)
    fields = _Fields(reader, path)
    types: dict[str, int] = {}
    if arch == "llama":
        tensors, rope_freqs = _llama_tensors(path, reader, cfg, types)
        cfg["rope_scaling"] = _rope_scaling(fields, arch, rope_freqs)
    else:
        tensors = _qwen35_tensors(path, reader, cfg, types)
        if chat_template is None:
            from ninfer.engine.qwen35_template import QWEN35_CHAT_TEMPLATE
            chat_template = QWEN35_CHAT_TEMPLATE
    for need in ("model.embed_tokens.weight", "model.norm.weight"):
        if need not in tensors:
            raise ArtifactError(f"{path}: GGUF lacks tensor {need!r}")
    source["gguf_types"] = types
    header = {"architecture": arch, "config": cfg, "tokenizer": tok,
              "chat_template": chat_template, "source": source}
    return header, tensors


def _convert(path: Path, t, types: dict[str, int]) -> QuantTensor:
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    try:
        qt = convert_tensor(t.data, t.tensor_type, shape)
    except (ValueError, NotImplementedError) as e:
        raise ArtifactError(f"{path}: tensor {t.name!r} of type {t.tensor_type.name}: {e}") from e
    types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return qt


def _llama_tensors(path: Path, reader, cfg: dict, types: dict[str, int]
                   ) -> tuple[dict[str, QuantTensor], np.ndarray | None]:
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    tensors: dict[str, QuantTensor] = {}
    rope_freqs = None
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            rope_freqs = np.asarray(t.data, dtype=np.float32).reshape(-1)
            continue
        hf = hf_tensor_name(t.name)
        if hf is None:
            raise ArtifactError(f"{path}: unknown tensor {t.name!r} for architecture llama")
        qt = _convert(path, t, types)
        if ".self_attn.q_proj." in hf or ".self_attn.k_proj." in hf:
            n = heads if ".q_proj." in hf else kv_heads
            qt = permute_rows(qt, unpermute_rows(qt.shape[0], n))
        tensors[hf] = qt
    return tensors, rope_freqs


def _qwen35_tensors(path: Path, reader, cfg: dict, types: dict[str, int]
                    ) -> dict[str, QuantTensor]:
    """HF-named tensors of a ``qwen35`` GGUF (``gguf_qwen35`` undoes the converter's
    transforms); every tensor ``Qwen35Model`` reads is checked present with its shape."""
    from ninfer.store import gguf_qwen35

    expected = gguf_qwen35.expected_shapes(cfg)
    tensors: dict[str, QuantTensor] = {}
    for t in reader.tensors:
        hf = gguf_qwen35.hf_name(t.name, cfg)
        if hf is None:
            raise ArtifactError(f"{path}: unknown tensor {t.name!r} for architecture qwen35")
        if hf.startswith("mtp.") and not cfg["mtp_num_hidden_layers"]:
            continue   # an MTP head we cannot represent (unshared embedding / head)
        qt = _convert(path, t, types)
        if hf in expected and tuple(qt.shape) != expected[hf]:
            raise ArtifactError(f"{path}: tensor {t.name!r} ({hf}) has shape "
                                f"{tuple(qt.shape)}, expected {expected[hf]}")
        try:
            out = gguf_qwen35.convert_layer(hf, qt, cfg)
        except ValueError as e:
            raise ArtifactError(f"{path}: tensor {t.name!r}: {e}") from e
        for name, q in out.items():
            want = expected.get(name)
            if want is None:
                raise ArtifactError(f"{path}: tensor {t.name!r} ({name}) does not fit the "
                                    f"qwen35 config")
            if tuple(q.shape) != want:
                raise ArtifactError(f"{path}: tensor {t.name!r} ({name}) has shape "
                                    f"{tuple(q.shape)}, expected {want}")
            tensors[name] = q
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise ArtifactError(f"{path}: GGUF lacks tensor(s) {missing[:4]} "
                            f"({len(missing)} missing)")
    return tensors


def convert_gguf(src: str | os.PathLike, dst: str | os.PathLike) -> str:
    """Convert a llama or qwen35 GGUF file to a ``.ninfer`` file; returns the new file's SHA-256 hex.

    The header's ``source`` also records the GGUF's SHA-256. Written atomically.

    Raises:
        ArtifactError: as ``import_gguf`` / ``write_artifact``.
    """
    header, tensors = import_gguf(src)
    header["source"]["sha256"] = file_sha256(src)
    return write_artifact(dst, header, tensors)

"""What a model file holds, read from its headers alone: architecture, config and each stored
tensor's scheme and shape (``ninfer plan`` sizes a model before anything loads).

``read_model_shapes(path)`` takes a ``.ninfer`` artifact (its tensor directory; the payload is
memory-mapped, never read), a GGUF (the ``gguf`` reader's tensor types and shapes), an HF
checkpoint folder (its ``config.json`` and safetensors headers) or a bare ``config.json`` of a
Llama-family or Qwen3.5 model (no tensors: the plan estimates the weights from the parameter
count).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ninfer.store.artifact import MAGIC, ArtifactError

# HF model_type values of Llama-family text models (served by models.llama)
LLAMA_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm", "smollm2")


@dataclass(frozen=True, slots=True)
class TensorShape:
    """One stored tensor: ``scheme`` as ``store.quant`` names it, ``(N, K)`` for a matrix;
    ``group`` elements per scale (quantized schemes), ``mins`` whether q4 carries minimums."""

    name: str
    scheme: str
    shape: tuple[int, ...]
    group: int = 0
    mins: bool = False

    @property
    def elems(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class ModelShapes:
    """A model as its headers describe it.

    Attributes:
        source: ``"ninfer"``, ``"gguf"``, ``"hf"`` (checkpoint folder) or ``"config"``.
        architecture: ``"llama"`` or ``"qwen35"``.
        config: the config dict ``LlamaConfig`` / ``Qwen35Config.from_dict`` takes.
        tensors: the stored tensors (empty for ``"config"``).
    """

    source: str
    architecture: str
    config: dict
    tensors: tuple[TensorShape, ...] = ()

    def model_config(self):
        """The ``LlamaConfig`` or ``Qwen35Config`` of ``config``.

        Raises:
            ValueError: keys missing or inconsistent.
        """
        if self.architecture == "qwen35":
            from ninfer.engine.models.qwen35 import Qwen35Config
            return Qwen35Config.from_dict(self.config)
        from ninfer.engine.models.llama import LlamaConfig
        return LlamaConfig.from_dict(self.config)

    @property
    def mtp_layers(self) -> int:
        """Attention layers of an MTP head the model would load (0 or 1)."""
        if self.architecture != "qwen35" or not self.config.get("mtp_num_hidden_layers"):
            return 0
        if self.tensors and not any(t.name == "mtp.fc.weight" for t in self.tensors):
            return 0
        return 1

    def parameter_count(self) -> int:
        """Elements of every weight the model reads (from the tensors, else the config)."""
        if self.tensors:
            return sum(t.elems for t in self.tensors)
        return sum(math.prod(s) for s in expected_shapes(self.architecture, self.config)
                   .values())


def expected_shapes(architecture: str, cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every HF-named tensor the model of ``cfg`` reads, with its shape."""
    if architecture == "qwen35":
        from ninfer.engine.models.qwen35 import Qwen35Config
        from ninfer.store.gguf_qwen35 import expected_shapes as qwen35_shapes
        c = Qwen35Config.from_dict(cfg)
        return qwen35_shapes({**cfg, "num_key_value_heads": c.num_key_value_heads,
                              "head_dim": c.head_dim, "layer_types": list(c.layer_types),
                              "linear_conv_kernel_dim": c.linear_conv_kernel_dim,
                              "tie_word_embeddings": c.tie_word_embeddings,
                              "mtp_num_hidden_layers": c.mtp_num_hidden_layers})
    from ninfer.engine.models.llama import LlamaConfig
    c = LlamaConfig.from_dict(cfg)
    h, i, v = c.hidden_size, c.intermediate_size, c.vocab_size
    qd, kd = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (qd, h), "self_attn.k_proj.weight": (kd, h),
             "self_attn.v_proj.weight": (kd, h), "self_attn.o_proj.weight": (h, qd),
             "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
             "mlp.down_proj.weight": (h, i)}
    for n in range(c.num_hidden_layers):
        out.update({f"model.layers.{n}.{k}": s for k, s in layer.items()})
    return out


def config_architecture(cfg: dict, path) -> tuple[str, dict]:
    """(architecture, config dict) of an HF ``config.json`` dict.

    Raises:
        ArtifactError: a model type no ninfer model implements.
    """
    from ninfer.store.hf_import import _TEXT_MODEL_TYPES, qwen35_config

    text = cfg.get("text_config") or cfg
    model_type = text.get("model_type") or cfg.get("model_type")
    if model_type in _TEXT_MODEL_TYPES:
        return "qwen35", qwen35_config(cfg, path)
    archs = cfg.get("architectures") or []
    if model_type in LLAMA_MODEL_TYPES or any(a.startswith(("Llama", "Mistral")) for a in archs):
        return "llama", dict(text)
    raise ArtifactError(f"{path}: unknown architecture (model_type {model_type!r}, "
                        f"architectures {archs}): ninfer plans Llama-family and Qwen3.5 models")


def read_model_shapes(path: str | Path) -> ModelShapes:
    """The architecture, config and stored tensor shapes of a model file, folder or config.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ArtifactError: not a model ninfer reads, or a corrupt header (message names the path).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    if path.is_dir():
        return _hf_folder(path)
    with open(path, "rb") as f:
        head = f.read(len(MAGIC))
    if head == MAGIC:
        return _artifact(path)
    if head[:4] == b"GGUF":
        return _gguf(path)
    if head.lstrip()[:1] == b"{":
        arch, cfg = config_architecture(_json(path), path)
        return ModelShapes("config", arch, cfg)
    raise ArtifactError(f"{path}: neither a .ninfer artifact, a GGUF, a checkpoint folder nor "
                        "a config.json")


def _json(path: Path) -> dict:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ArtifactError(f"{path}: not a readable JSON config ({e})") from e
    if not isinstance(cfg, dict):
        raise ArtifactError(f"{path}: not a JSON object")
    return cfg


def _artifact(path: Path) -> ModelShapes:
    from ninfer.store.artifact import Artifact

    art = Artifact.open(path)   # maps the payload; reads the header and tensor directory
    tensors = tuple(TensorShape(n, t.scheme, tuple(t.shape), t.group, t.mins is not None)
                    for n, t in art.tensors.items())
    return ModelShapes("ninfer", art.architecture, dict(art.config), tensors)


def _gguf(path: Path) -> ModelShapes:
    from ninfer.store import gguf_import

    reader, arch, cfg, *_ = gguf_import.read_metadata(path)
    tensors = []
    for t in reader.tensors:
        if arch == "llama":
            if t.name == "rope_freqs.weight":
                continue
            name = gguf_import.hf_tensor_name(t.name)
        else:
            from ninfer.store import gguf_qwen35
            name = gguf_qwen35.hf_name(t.name, cfg)
            if name and name.startswith("mtp.") and not cfg["mtp_num_hidden_layers"]:
                continue
        if name is None:
            raise ArtifactError(f"{path}: unknown tensor {t.name!r} for architecture {arch}")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        try:
            scheme, group, mins = gguf_import.stored_scheme(t.tensor_type, shape)
        except ValueError as e:
            raise ArtifactError(f"{path}: tensor {t.name!r}: {e}") from e
        tensors.append(TensorShape(name, scheme, shape, group, mins))
    return ModelShapes("gguf", arch, cfg, tuple(tensors))


def _hf_folder(path: Path) -> ModelShapes:
    """A checkpoint folder as ``ninfer serve`` loads it: source precision (float schemes)."""
    from ninfer.store.hf_import import _text_name

    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise ArtifactError(f"{path}: no config.json (not a HuggingFace checkpoint folder)")
    arch, cfg = config_architecture(_json(cfg_path), cfg_path)
    if arch != "qwen35":
        raise ArtifactError(f"{path}: ninfer loads checkpoint folders of Qwen3.5 models only "
                            "(give the config.json to estimate, or a GGUF)")
    tensors = {}
    for st in sorted(path.glob("*.safetensors")):
        for name, (dt, shape) in _safetensors_header(st).items():
            ours = _text_name(name)
            if ours is not None:
                scheme = {"BF16": "bf16", "F16": "f16"}.get(dt, "f32")
                tensors[ours] = TensorShape(ours, scheme, shape)
    if not tensors:
        raise ArtifactError(f"{path}: no safetensors weights")
    if cfg.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    cfg["mtp_num_hidden_layers"] = len({n.split(".")[2] for n in tensors
                                        if n.startswith("mtp.layers.")})
    return ModelShapes("hf", arch, cfg, tuple(tensors.values()))


def _safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) from a safetensors file's JSON header (no tensor data read)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n).decode("utf-8"))
        return {k: (v["dtype"], tuple(int(d) for d in v["shape"]))
                for k, v in header.items() if k != "__metadata__"}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ArtifactError(f"{path}: corrupt safetensors header ({e})") from e

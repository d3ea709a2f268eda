"""``bench/experiments/host_overhead.py`` runs the CuPy backend's forward pass on the CPU with a
stand-in CuPy whose kernels do nothing: every line of the GPU path's Python (kernel configs,
argument marshalling, launches) runs, so a broken host side of that path fails here, in CI,
instead of on the GPU machine. Each run in a process of its own (the stand-in replaces
``cupy`` in ``sys.modules``)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"prefill (\d+): host ([\d.]+) ms a pass \((\d+) layers\), (\d+) kernels and "
                  r"(\d+) cuBLAS calls a pass")


def run(*args: str) -> re.Match:
    proc = subprocess.run([sys.executable, str(ROOT / "bench/experiments/host_overhead.py"),
                           *args], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = LINE.search(proc.stdout)
    assert m, proc.stdout
    return m


@pytest.mark.parametrize("model", ["smollm2", "qwen35"])
def test_the_cupy_path_runs_on_the_host_with_its_kernels_stubbed(tmp_path, model):
    """SmolLM2 (Llama) and a tiny Qwen3.5 hybrid prefill 80 tokens (a GEMM pass: the prefill
    kernels, cuBLAS): the run reports its layers, at least one kernel launch and one cuBLAS
    call a layer."""
    args = ["--prefill", "80", "--reps", "1"]
    layers = 30
    if model == "qwen35":
        gguf = tmp_path / "tiny.gguf"
        subprocess.run([sys.executable, str(ROOT / "bench/make_qwen35_gguf.py"), str(gguf),
                        "tiny"], check=True, capture_output=True, cwd=ROOT)
        args += ["--model", str(gguf)]
        layers = 8
    m = run(*args)
    assert int(m[1]) == 80 and int(m[3]) == layers
    assert int(m[4]) >= layers and int(m[5]) >= layers

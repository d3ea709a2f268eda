"""bench/peer.py: llama-bench's JSON (the format of llama.cpp's tools/llama-bench json_printer)
parsed, the command run through a stand-in binary, and the side-by-side arithmetic."""
from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import peer  # noqa: E402


def _test(n_prompt: int, n_gen: int, ts: float, sd: float) -> dict:
    # the fields llama-bench prints per test (a subset, in its order), then the samples
    return {"build_commit": "abc1234", "build_number": 1, "gpu_info": "NVIDIA H200",
            "backends": "CUDA", "model_filename": "l8b.gguf", "model_type": "llama 8B Q4_0",
            "n_gpu_layers": 99, "flash_attn": 1, "n_prompt": n_prompt, "n_gen": n_gen,
            "n_depth": 0, "test_time": "2026-11-30T06:00:00Z", "avg_ns": int(1e9 / ts),
            "stddev_ns": 1000, "avg_ts": ts, "stddev_ts": sd,
            "samples_ns": [1, 2, 3], "samples_ts": [ts, ts, ts]}


def test_parse_pp_and_tg():
    text = json.dumps([_test(512, 0, 10781.2, 30.5), _test(0, 128, 340.9, 2.8)], indent=2)
    got = peer.parse_llama_bench_json(text)
    assert got["pp"] == {"n": 512, "tok_s": 10781.2, "stddev": 30.5}
    assert got["tg"] == {"n": 128, "tok_s": 340.9, "stddev": 2.8}
    assert got["build_commit"] == "abc1234" and got["gpu_info"] == "NVIDIA H200"
    only_tg = peer.parse_llama_bench_json(json.dumps([_test(0, 64, 900.0, 1.0)]))
    assert only_tg["pp"] is None and only_tg["tg"]["n"] == 64


@pytest.mark.parametrize("text,match", [
    ("not json", "not JSON"), ('{"n_gen": 1}', "list of test"),
    (json.dumps([{"n_prompt": 0, "n_gen": 128}]), "avg_ts"),
    (json.dumps([{"n_prompt": "x", "n_gen": 128, "avg_ts": 1.0}]), "n_prompt")])
def test_parse_rejects_bad_output(text, match):
    with pytest.raises(ValueError, match=match):
        peer.parse_llama_bench_json(text)


def test_llama_bench_runs_the_binary_with_the_arguments(tmp_path):
    """A stand-in llama-bench that records its argv and prints two tests."""
    argv_file = tmp_path / "argv.json"
    fake = tmp_path / "llama-bench"
    rows = [_test(512, 0, 1000.0, 1.0), _test(0, 128, 100.0, 0.5)]
    fake.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"json.dump(sys.argv[1:], open({str(argv_file)!r}, 'w'))\n"
                    f"print(json.dumps({rows!r}))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    got = peer.llama_bench(str(fake), "/m/l8b.gguf", n_prompt=512, n_gen=128, reps=3)
    assert json.loads(argv_file.read_text()) == [
        "-m", "/m/l8b.gguf", "-p", "512", "-n", "128", "-r", "3", "-ngl", "99", "-fa", "1",
        "-o", "json"]
    assert got["tg"]["tok_s"] == 100.0 and got["pp"]["tok_s"] == 1000.0
    assert got["cmd"].startswith(str(fake) + " -m /m/l8b.gguf")


def test_llama_bench_failures_are_raised(tmp_path):
    with pytest.raises(FileNotFoundError):
        peer.llama_bench(str(tmp_path / "absent"), "m.gguf")
    bad = tmp_path / "llama-bench"
    bad.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    bad.chmod(bad.stat().st_mode | stat.S_IEXEC)
    import subprocess
    with pytest.raises(subprocess.CalledProcessError) as e:
        peer.llama_bench(str(bad), "m.gguf")
    assert "failed to load model" in e.value.stderr


def test_side_by_side():
    got = peer.side_by_side(521.2, 340.9, 4.248e9, 4.2e12)
    assert got == {"ninfer_tok_s": 521.2, "peer_tok_s": 340.9, "ninfer_roofline": 0.527,
                   "peer_roofline": 0.345, "speedup": 1.529}


def test_gpu_decode_help_and_refusals_without_a_gpu():
    """``bench/gpu_decode.py --help`` works where CuPy is missing (CI), and a run there stops
    with a one-line usage error (exit 2) instead of a traceback."""
    import importlib.util
    import subprocess
    script = Path(__file__).resolve().parents[2] / "bench" / "gpu_decode.py"
    ok = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "--variants" in ok.stdout and "--peer" in ok.stdout
    if importlib.util.find_spec("cupy") is None:
        bad = subprocess.run([sys.executable, str(script), "m.gguf"], capture_output=True,
                             text=True)
        assert bad.returncode == 2 and "needs CuPy" in bad.stderr
        assert "Traceback" not in bad.stderr

"""ninfer.bench.peer: llama-bench's JSON (the format of llama.cpp's tools/llama-bench
json_printer) parsed, the command run through a stand-in binary, and the side-by-side
arithmetic."""
from __future__ import annotations

import json
import stat
import sys

import pytest

from ninfer.bench import peer

# ``llama-bench -m l8b.gguf -ngl 99 -fa 1 -p 512 -n 128 -r 3 -o json`` as its json_printer
# writes it (every field, in its order, arrays on one line, %.6f floats), with the H200 numbers
# of bench/history/RESULTS.md session 22 (8B shape: pp512 10,961.1, tg128 339.1 tok/s)
_SAMPLE_SHARED = """    "build_commit": "b8a3c7e",
    "build_number": 1,
    "cpu_info": "Intel(R) Xeon(R) Platinum 8480C",
    "gpu_info": "NVIDIA H200",
    "backends": "CUDA",
    "model_filename": "/root/keep/l8b.gguf",
    "model_type": "llama 8B Q4_0",
    "model_size": 4525523968,
    "model_n_params": 8030261248,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 64,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": 99,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": true,
    "tensor_split": "0.00",
    "use_mmap": true,
    "embeddings": false,
"""


def _printed_test(n_prompt: int, n_gen: int, test_time: str, ns: tuple, ts: tuple) -> str:
    """One test object as json_printer writes it: the shared fields, then this test's."""
    return (_SAMPLE_SHARED + f"""    "n_prompt": {n_prompt},
    "n_gen": {n_gen},
    "n_depth": 0,
    "test_time": "{test_time}",
    "avg_ns": {ns[0]},
    "stddev_ns": {ns[1]},
    "avg_ts": {ts[0]:.6f},
    "stddev_ts": {ts[1]:.6f},
    "samples_ns": [ {", ".join(map(str, ns[2]))} ],
    "samples_ts": [ {", ".join(map(str, ts[2]))} ]
""")


SAMPLE = ("[\n  {\n"
          + _printed_test(512, 0, "2026-12-01T09:12:44Z",
                          (46710243, 118272, (46580128, 46812004, 46738597)),
                          (10961.136542, 27.740091, (10991.8, 10937.3, 10954.5)))
          + "  },\n  {\n"
          + _printed_test(0, 128, "2026-12-01T09:12:46Z",
                          (377468271, 1145623, (376212518, 378446102, 377746193)),
                          (339.10352, 1.028761, (340.236, 338.224, 338.851)))
          + "  }\n]\n")


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


def test_parse_the_printed_sample():
    got = peer.parse_llama_bench_json(SAMPLE)
    assert got["pp"] == {"n": 512, "tok_s": 10961.136542, "stddev": 27.740091}
    assert got["tg"] == {"n": 128, "tok_s": 339.10352, "stddev": 1.028761}
    assert got["pp_by_n"] == {512: got["pp"]} and got["tg_by_n"] == {128: got["tg"]}
    assert got["build_commit"] == "b8a3c7e" and got["gpu_info"] == "NVIDIA H200"


def test_several_prompt_lengths_each_kept():
    text = json.dumps([_test(512, 0, 43652.1, 17464.0), _test(4096, 0, 41000.0, 80.0)])
    got = peer.parse_llama_bench_json(text)
    assert got["pp_by_n"][512]["tok_s"] == 43652.1 and got["pp_by_n"][4096]["tok_s"] == 41000.0
    assert got["pp"]["n"] == 4096 and got["tg"] is None and got["tg_by_n"] == {}


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


def test_prompt_lengths_and_no_generation_on_the_command_line(tmp_path):
    """Prefill asks for ``-p 512,4096 -n 0``, decode for ``-p 0 -n STEPS`` (llama-bench skips
    tests of 0 tokens); the stand-in prints the sample, with noise on stderr."""
    argv_file = tmp_path / "argv.json"
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"json.dump(sys.argv[1:], open({str(argv_file)!r}, 'w'))\n"
                    f"print('ggml_cuda_init: found 1 CUDA devices', file=sys.stderr)\n"
                    f"sys.stdout.write({SAMPLE!r})\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    got = peer.llama_bench(str(fake), "m.gguf", n_prompt=(512, 4096), n_gen=0)
    assert json.loads(argv_file.read_text())[:6] == ["-m", "m.gguf", "-p", "512,4096", "-n", "0"]
    assert got["pp"]["tok_s"] == 10961.136542
    peer.llama_bench(str(fake), "m.gguf", n_prompt=0, n_gen=128)
    assert json.loads(argv_file.read_text())[:6] == ["-m", "m.gguf", "-p", "0", "-n", "128"]


def test_beside_decode_and_prefill():
    got = peer.parse_llama_bench_json(SAMPLE)
    decode = {1: {"tok_s": 692.8, "bytes_per_token": 4.256e9}, 8: {"tok_s": 4000.0}}
    b1 = peer.beside_decode(decode, got, 4155.6e9)
    assert b1 == {"ninfer_tok_s": 692.8, "peer_tok_s": 339.1, "ninfer_roofline": 0.71,
                  "peer_roofline": 0.347, "speedup": 2.043, "peer_test": "tg128"}
    assert peer.beside_decode({8: decode[8]}, got, 4155.6e9) is None
    pre = peer.beside_prefill({512: {"tok_s": 11139.9}, 4096: {"tok_s": 9000.0}}, got)
    assert pre == {512: {"ninfer_tok_s": 11139.9, "peer_tok_s": 10961.1, "speedup": 1.016}}


def test_side_by_side():
    got = peer.side_by_side(521.2, 340.9, 4.248e9, 4.2e12)
    assert got == {"ninfer_tok_s": 521.2, "peer_tok_s": 340.9, "ninfer_roofline": 0.527,
                   "peer_roofline": 0.345, "speedup": 1.529}

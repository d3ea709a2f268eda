"""``ninfer bench decode|prefill|serve`` as a user runs it, on the CPU with the default SmolLM2:
the JSON it writes holds real measurements whose byte counts follow from the model's shape."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ninfer.store.artifact import load_model_file

pytestmark = pytest.mark.slow


def _bench(tmp_path, *args, timeout=600) -> dict:
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "ninfer", "bench", *args, "--backend", "numpy",
                        "--json", str(out)], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["command"] == " ".join(["ninfer bench", *args, "--backend", "numpy", "--json",
                                       str(out)])
    assert res["backend"] == "numpy" and res["date"] and res["device"]
    res["_stdout"] = r.stdout
    return res


def _float32_weight_bytes(cfg: dict) -> int:
    """What one decode pass reads on the numpy backend (weights dequantized to float32): every
    layer's norms and projections, the final norm and the head (tied: the embedding table)."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh
    layer = 2 * h + (nh + 2 * nkv) * hd * h + h * nh * hd + 3 * inter * h
    return 4 * (layers * layer + h + cfg["vocab_size"] * h)


def test_decode_reports_rates_bytes_and_roofline(smollm2_gguf, tmp_path):
    res = _bench(tmp_path, "decode", "--steps", "4", "--batches", "1,2", "--context", "8")
    assert res["model"] == str(smollm2_gguf) and res["mode"] == "plain"
    cfg = load_model_file(smollm2_gguf).config
    assert cfg["tie_word_embeddings"]
    assert res["weight_bytes_per_token"] == _float32_weight_bytes(cfg)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_pos = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * hd * 4
    assert res["kv_bytes_per_position"] == kv_pos
    bw = res["copy_bw_GBs"] * 1e9
    assert bw > 0
    assert set(res["decode"]) == {"1", "2"}
    for b, e in res["decode"].items():
        batch = int(b)
        assert e["tok_s"] > 0 and e["step_ms_median"] > 0
        assert e["lookahead"] is False and "lookahead_tokens_match" not in e  # no graphs here
        assert e["tok_s"] == e["tok_s_plain"] and len(e["tok_s_rounds"]) == 1
        # mean context of the timed steps: 8 cached + 4 / 2
        assert e["bytes_per_step"] == res["weight_bytes_per_token"] + batch * 10 * kv_pos
        # (the JSON's rates are rounded to 0.1: GBs by 0.05 at most, and the tok_s it is
        # compared through by 0.05, which moves the product by 0.05 x the GB a token)
        gb_token = e["bytes_per_step"] / batch / 1e9
        assert e["GBs"] == pytest.approx(gb_token * e["tok_s"], rel=0,
                                         abs=0.05 + 0.05 * gb_token + 1e-9)
        assert e["roofline_fraction"] == pytest.approx(e["GBs"] * 1e9 / bw, rel=2e-2, abs=0.01)
    assert res["decode"]["1"]["bytes_per_token"] == res["decode"]["1"]["bytes_per_step"]
    assert "decode b1:" in res["_stdout"] and "of the roofline" in res["_stdout"]


def test_decode_rounds_are_reported_each(smollm2_gguf, tmp_path):
    res = _bench(tmp_path, "decode", str(smollm2_gguf), "--steps", "2", "--batches", "1",
                 "--context", "4", "--rounds", "2")
    e = res["decode"]["1"]
    assert len(e["tok_s_rounds"]) == 2 and all(x > 0 for x in e["tok_s_rounds"])
    assert min(e["tok_s_rounds"]) <= e["tok_s"] <= max(e["tok_s_rounds"])


def test_kv_dtype_sets_the_cache_and_its_bytes(smollm2_gguf, tmp_path):
    """``--kv-dtype`` stores the bench's KV cache as serve's does: int8 codes plus fp16 scales a
    64-dim group, so a position costs what ``kv_dtypes.head_bytes`` says, not fp32's 4 bytes."""
    from ninfer.engine.kv_dtypes import head_bytes

    res = _bench(tmp_path, "decode", "--steps", "2", "--batches", "1", "--context", "4",
                 "--kv-dtype", "int8")
    cfg = load_model_file(smollm2_gguf).config
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    k, v = head_bytes("int8", hd)
    assert (k, v) == (hd + 2 * hd // 64,) * 2
    assert res["kv_dtype"] == "int8"
    assert res["kv_bytes_per_position"] == (cfg["num_hidden_layers"]
                                            * cfg["num_key_value_heads"] * (k + v))
    assert res["decode"]["1"]["tok_s"] > 0


def test_prefill_reports_rates_per_length(smollm2_gguf, tmp_path):
    res = _bench(tmp_path, "prefill", "--prefill", "8,16")
    assert res["model"] == str(smollm2_gguf)
    assert set(res["prefill"]) == {"8", "16"}
    for p, e in res["prefill"].items():
        assert e["tok_s"] > 0 and len(e["tok_s_all"]) == 3
        # (tok_s is rounded to 0.1, ms_median to 0.001 ms: within both roundings)
        assert e["tok_s"] == pytest.approx(int(p) / (e["ms_median"] / 1e3), rel=0,
                                           abs=0.05 + e["tok_s"] * 5e-4 / e["ms_median"] + 1e-9)
    assert "prefill 16:" in res["_stdout"]
    # (--prefill-gemm chooses the GPU's GEMMs: on the CPU nothing is said to have run on fp8)
    assert "prefill_gemm" not in _bench(tmp_path, "prefill", "--prefill", "8", "--reps", "1",
                                        "--prefill-gemm", "fp8")


def test_prefill_chunk_auto_is_the_engines_choice_and_reps_are_counted(smollm2_gguf, tmp_path):
    """``--chunk auto`` picks as ``--prefill-chunk auto`` does: on the CPU the default pass size,
    unmeasured (the GPU's measurement and fit: ``tests/engine/test_chunk_size.py``)."""
    from ninfer.engine.chunk_size import MIN_TOKENS

    res = _bench(tmp_path, "prefill", "--prefill", "100", "--chunk", "auto", "--reps", "2")
    auto = res["prefill_chunk_auto"]
    assert res["prefill_chunk"] == auto["chunk"] == auto["tokens"] == MIN_TOKENS
    assert auto["source"] == "default" and "per_token_us" not in auto
    assert len(res["prefill"]["100"]["tok_s_all"]) == 2


def test_serve_compares_the_server_with_the_engine(smollm2_gguf, tmp_path):
    res = _bench(tmp_path, "serve", "--tokens", "4", "--repeats", "1")
    assert res["model"] == str(smollm2_gguf)
    eng, srv = res["engine_graph"], res["server"]
    assert eng["tok_s"] > 0 and eng["completion_tokens"] == [4]
    assert "engine_eager" not in res  # the eager comparison is the GPU's
    assert srv["client_tok_s"] > 0 and srv["server_engine_tok_s"] > 0
    assert srv["completion_tokens"] == [4] and srv["started_backend"] == "numpy"
    assert srv["records"] > 0
    assert res["overhead_client"] == pytest.approx(1 - srv["client_tok_s"] / eng["tok_s"],
                                                   abs=1e-3)
    assert "server overhead b1:" in res["_stdout"]


def test_peer_needs_a_gguf_and_the_gpu_backend_a_gpu(tmp_path):
    """Refusals are one line (exit 2), before anything is measured."""
    fake = tmp_path / "m.ninfer"
    fake.write_bytes(b"not a model")
    r = subprocess.run([sys.executable, "-m", "ninfer", "bench", "decode", str(tmp_path / "no"),
                        "--backend", "numpy"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "ninfer", "bench", "prefill", str(fake),
                        "--peer", "/bin/true", "--backend", "numpy"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "needs the GGUF" in r.stderr and "Traceback" not in r.stderr
    import importlib.util
    if importlib.util.find_spec("cupy") is None:
        r = subprocess.run([sys.executable, "-m", "ninfer", "bench", "decode", "--backend",
                            "cupy"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "cupy backend is not available" in r.stderr
        assert "Traceback" not in r.stderr


def test_help_lists_the_kinds_and_options():
    r = subprocess.run([sys.executable, "-m", "ninfer", "bench", "decode", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    for opt in ("--batches", "--steps", "--context", "--rounds", "--peer", "--json",
                "--no-lookahead", "--no-cuda-graph"):
        assert opt in r.stdout
    r = subprocess.run([sys.executable, "-m", "ninfer", "bench", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and all(k in r.stdout for k in ("decode", "prefill", "serve"))


def test_the_peer_runs_in_the_same_command_beside_decode(smollm2_gguf, tmp_path):
    """A stand-in llama-bench that answers the tests it was asked for (-p, -n) and records its
    argv: decode asks for generation only, over as many tokens as ninfer's timed steps."""
    argv_file = tmp_path / "argv.json"
    fake = tmp_path / "llama-bench"
    fake.write_text(
        f"#!{sys.executable}\nimport json, sys\na = sys.argv[1:]\n"
        f"json.dump(a, open({str(argv_file)!r}, 'w'))\n"
        "n_gen = int(a[a.index('-n') + 1])\n"
        "print(json.dumps([{'n_prompt': 0, 'n_gen': n_gen, 'avg_ts': 50.0, 'stddev_ts': 1.0,"
        " 'build_commit': 'abc', 'gpu_info': 'none'}]))\n")
    fake.chmod(0o755)
    res = _bench(tmp_path, "decode", "--steps", "3", "--batches", "1", "--context", "4",
                 "--peer", str(fake))
    assert json.loads(argv_file.read_text())[:6] == ["-m", str(smollm2_gguf), "-p", "0",
                                                     "-n", "3"]
    b1, beside = res["decode"]["1"], res["peer"]["decode_b1"]
    assert beside["peer_test"] == "tg3" and beside["peer_tok_s"] == 50.0
    assert beside["ninfer_tok_s"] == b1["tok_s"]
    # (copy_bw_GBs is rounded to 0.1 GB/s: up to ~0.5 % off on a loaded CPU)
    assert beside["peer_roofline"] == pytest.approx(
        b1["bytes_per_token"] * 50.0 / (res["copy_bw_GBs"] * 1e9), rel=1e-2, abs=2e-3)
    assert "llama.cpp tg3 50.0 tok/s" in res["_stdout"]


def test_decode_and_prefill_time_a_hybrid_gguf(tmp_path):
    """A Qwen3.5 GGUF (the synthetic tiny shape of ``bench/make_qwen35_gguf.py``): each lane's
    recurrent state, read and written, counts in the step's bytes; prefill runs too."""
    gen = tmp_path / "q35.gguf"
    r = subprocess.run([sys.executable, "bench/make_qwen35_gguf.py", str(gen), "tiny"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = _bench(tmp_path, "decode", str(gen), "--steps", "3", "--batches", "1,2",
                 "--context", "8")
    cfg = load_model_file(gen).config
    hv, dk, dv = (cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
                  cfg["linear_value_head_dim"])
    conv = 2 * cfg["linear_num_key_heads"] * dk + hv * dv
    gdn_layers = cfg["layer_types"].count("linear_attention")
    state = 4 * gdn_layers * (hv * dk * dv + (cfg["linear_conv_kernel_dim"] - 1) * conv)
    assert res["state_bytes_per_lane"] == state
    kv_pos = res["kv_bytes_per_position"]
    for b, e in res["decode"].items():
        assert e["tok_s"] > 0 and e["lookahead"] is False
        assert e["bytes_per_step"] == (res["weight_bytes_per_token"]
                                       + int(b) * (9.5 * kv_pos + 2 * state))
    pre = _bench(tmp_path, "prefill", str(gen), "--prefill", "16")
    assert pre["prefill"]["16"]["tok_s"] > 0


def test_prefill_in_chunks_and_a_short_request_behind_a_long_one(tmp_path):
    """The engine's chunked path (``--chunk``) and issue 31's short-behind row (``--behind``) on
    the tiny hybrid: with two prefill lanes the short request's first token comes before the
    long prompt's, with one it waits for the whole long prefill."""
    gen = tmp_path / "q35.gguf"
    r = subprocess.run([sys.executable, "bench/make_qwen35_gguf.py", str(gen), "tiny"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    order = {}
    for lanes in (2, 1):
        res = _bench(tmp_path, "prefill", str(gen), "--prefill", "48", "--chunk", "16",
                     "--behind", "160", "--behind-short", "8", "--behind-delay", "0",
                     "--prefill-lanes", str(lanes))
        assert res["prefill_chunk"] == 16 and res["prefill"]["48"]["tok_s"] > 0
        b = res["ttft_behind"]
        assert (b["long_tokens"], b["short_tokens"], b["chunk"], b["prefill_lanes"]) == \
            (160, 8, 16, lanes)
        assert b["short_ttft_s"] > 0 and b["long_ttft_s"] > 0
        assert "ttft short-behind-160:" in res["_stdout"]
        order[lanes] = b["short_first"]
    assert order == {2: True, 1: False}

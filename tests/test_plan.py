"""``ninfer plan``: the memory budget before anything loads, against a hand computation (the
Qwen3.5-27B config), against the server's own plan (real SmolLM2 GGUF and its artifact), its
exit codes and its errors; and ``ninfer serve --gpu-memory``."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ninfer.cli import main
from ninfer.engine.memory import GRAPH_FIXED_BYTES, cuda_graph_bytes, workspace_bytes
from ninfer.engine.models.qwen35 import Qwen35Config
from ninfer.plan import EXIT_DOES_NOT_FIT

SHAPE = str(Path(__file__).parents[1] / "bench" / "shapes" / "qwen35-27b.json")
GIB24 = 24 * 2**30


def _plan(capsys, *args):
    rc = main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def _qwen35_27b_hand():
    """Parameters, KV bytes per token per KV dtype and state bytes per lane of Qwen3.5-27B,
    from its published shape (not from ninfer's code)."""
    h, i, v, nh, nkv, hd = 5120, 17408, 248320, 24, 4, 256
    hk, hv, dk, dv, kc = 16, 48, 128, 128, 4
    conv = 2 * hk * dk + hv * dv                                          # 10240
    common = 2 * h + 3 * i * h                                            # norms, MLP
    attn = 2 * nh * hd * h + 2 * nkv * hd * h + h * nh * hd + 2 * hd  # q|gate k v o, norms
    gdn = (conv + hv * dv + 2 * hv) * h + conv * kc + 2 * hv + dv + h * hv * dv
    mtp = 2 * h * h + 3 * h + common + attn                               # fc, norms, one block
    params = 2 * v * h + h + 48 * (common + gdn) + 16 * (common + attn) + mtp
    kv_layers = 16 + 1                                                    # + the MTP layer
    per_token = {"rk4v4-e8": kv_layers * nkv * 2 * (hd // 2 + 2 * hd // 64),  # int4 + fp16 scales
                 "fp16": kv_layers * nkv * 2 * 2 * hd}
    state = 4 * ((kc - 1) * conv + hv * dk * dv) * 48
    return params, per_token, state, v * h


@pytest.mark.parametrize("kv_dtype", ["rk4v4-e8", "fp16", "auto"])
def test_qwen35_27b_at_262144_tokens_in_24_gib(capsys, kv_dtype):
    params, per_token, state, head_elems = _qwen35_27b_hand()
    rc, out, _ = _plan(capsys, SHAPE, "--max-context", "262144",
                       *(("--kv-dtype", kv_dtype) if kv_dtype != "auto" else ()),
                       "--gpu-memory", "24GiB", "--json")
    p = json.loads(out)
    if kv_dtype == "auto":   # the default on cupy, as serve's: fp16
        assert p["kv_dtype"] == "fp16"
        kv_dtype = "fp16"
    assert p["parameters"] == params and p["mtp_layers"] == 1 and p["source"] == "config"
    assert p["weights_bytes"] == math.ceil(params * 4.5 / 8)
    assert p["kv_bytes_per_token"] == per_token[kv_dtype]
    assert p["state_bytes"] == state and p["kv_pages"] == 262144 // 16
    assert p["kv_pool_bytes"] == 262144 * per_token[kv_dtype] + state
    cfg = Qwen35Config.from_dict(json.loads(Path(SHAPE).read_text()))
    assert p["workspace_bytes"] == workspace_bytes(cfg, 512, 1, "cupy", head_elems)
    assert p["cuda_graph_bytes"] == cuda_graph_bytes(cfg, (1,), 262144, 16) > GRAPH_FIXED_BYTES
    total = (p["weights_bytes"] + p["kv_pool_bytes"] + p["workspace_bytes"]
             + p["cuda_graph_bytes"])
    assert p["total_bytes"] == total and p["capacity_bytes"] == GIB24
    if kv_dtype == "rk4v4-e8":
        assert rc == 0 and p["fits"] and p["headroom_bytes"] == GIB24 - total > 0
    else:
        assert rc == EXIT_DOES_NOT_FIT and not p["fits"]
        assert p["deficit_bytes"] == total - GIB24 > 0


def test_turn_checkpoints_are_host_memory_beside_the_total(capsys):
    _, _, state, _ = _qwen35_27b_hand()
    rc, out, _ = _plan(capsys, SHAPE, "--max-context", "4096", "--max-concurrency", "2",
                       "--turn-checkpoints", "32", "--json")
    p = json.loads(out)
    assert p["checkpoint_bytes"] == 2 * 34 * state and p["turn_checkpoints"] == 32
    assert p["total_bytes"] == p["weights_bytes"] + p["kv_pool_bytes"] + \
        p["workspace_bytes"] + p["cuda_graph_bytes"]
    rc, out, _ = _plan(capsys, SHAPE, "--max-context", "4096")
    assert "host: turn ckpts" in out and "1 lane x 2 states" in out
    assert _plan(capsys, SHAPE, "--max-context", "4096", "--turn-checkpoints", "-1")[0] == 2


def test_text_output_names_the_parts_and_the_deficit(capsys):
    rc, out, err = _plan(capsys, SHAPE, "--max-context", "262144", "--kv-dtype", "fp16",
                         "--gpu-memory", "24GiB")
    assert rc == EXIT_DOES_NOT_FIT
    for part in ("weights", "KV pool", "of which state", "workspace", "CUDA graphs", "total",
                 "capacity", "deficit", "int4 group-32 with fp16 scales"):
        assert part in out
    deficit = json.loads(main(["plan", SHAPE, "--max-context", "262144", "--kv-dtype", "fp16",
                               "--gpu-memory", "24GiB", "--json"]) and
                         capsys.readouterr().out)["deficit_bytes"]
    assert f"short by {deficit} bytes" in out
    # stderr: the verdict and what would fit: the first smaller KV dtype that does (int8
    # does not, rk8v4 does), the longest context at fp16 (a multiple of the page size: one
    # page more does not fit); --json says the same under fits_with
    plans = {}
    for args in (("--kv-dtype", "int8"), ("--kv-dtype", "rk8v4"),
                 ("--kv-dtype", "fp16", "--max-context", "105408"),
                 ("--kv-dtype", "fp16", "--max-context", str(105408 + 16)),
                 ("--kv-dtype", "fp16")):
        main(["plan", SHAPE, "--max-context", "262144", "--gpu-memory", "24GiB", "--json",
              *args])
        plans[args] = json.loads(capsys.readouterr().out)
    assert [p["fits"] for p in plans.values()] == [False, True, True, False, False]
    free = plans[("--kv-dtype", "rk8v4")]["headroom_bytes"]
    assert plans[("--kv-dtype", "fp16")]["fits_with"] == {
        "kv_dtype": "rk8v4", "headroom_bytes": free, "max_context": 105408}
    assert err == (f"ninfer plan: does not fit: short by {deficit / 2**30:.2f} GiB; fits with "
                   f"--kv-dtype rk8v4 ({free / 2**20:.1f} MiB free) or --max-context 105408 "
                   "at --kv-dtype fp16\n")
    # where the model without its pages exceeds the capacity, nothing about the KV helps
    rc, _, err = _plan(capsys, SHAPE, "--max-context", "4096", "--gpu-memory", "2GiB")
    assert rc == EXIT_DOES_NOT_FIT and err.rstrip().endswith("no KV dtype or context fits")
    rc, out, _ = _plan(capsys, SHAPE, "--max-context", "262144", "--kv-dtype", "rk4v4-e8",
                       "--gpu-memory", "24GiB")
    assert rc == 0 and out.rstrip().endswith("fits") and "free" in out
    assert _plan(capsys, SHAPE, "--max-context", "262144", "--kv-dtype", "rk4v4-e8",
                 "--gpu-memory", "24G")[1] == out   # a bare G: GiB


@pytest.mark.parametrize("args, message", [
    (["/nonexistent/model.gguf"], "model not found"),
    ([SHAPE, "--gpu-memory", "24XB"], "--gpu-memory '24XB' is not a size"),
    ([SHAPE, "--kv-dtype", "rk4v4", "--max-concurrency", "0"], "--max-concurrency must be"),
    # past sane bounds: refused, not an absurd table
    ([SHAPE, "--max-context", "99999999999999"],
     "--max-context 99999999999999 is more than 2147483647 (2**31 - 1)"),
    ([SHAPE, "--max-concurrency", str(2**31)], "--max-concurrency 2147483648 is more than"),
    ([SHAPE, "--gpu-memory", "99999999999999999999999999TiB"],
     "--gpu-memory '99999999999999999999999999TiB' is more than 1 EiB (2**60 bytes)"),
    ([SHAPE, "--gpu-memory", "1" + "0" * 400], "is more than 1 EiB"),   # (no float overflow)
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    rc, out, err = _plan(capsys, "--max-context", "1024", *args)
    assert rc == 2 and message in err and "Traceback" not in err and not out
    assert len(err.splitlines()) == 1


def test_wide_numbers_keep_a_space_between_the_columns(capsys):
    """The largest context and capacity allowed: every label stays apart from its number."""
    rc, out, _ = _plan(capsys, SHAPE, "--max-context", str(2**31 - 1), "--max-concurrency",
                       "64", "--gpu-memory", str(2**60), "--kv-dtype", "fp32")
    rows = out.splitlines()[1:-1]   # (between the header and the verdict)
    assert rc == 0 and len(rows) == 10 and all(r[18] == " " for r in rows), out
    assert "  host: L2 ceiling 35651602.70 GiB  38,280,616,914,976,768 B  serve's" in out
    assert "  capacity         1073741824.00 GiB  1,152,921,504,606,846,976 B  --gpu" in out
    assert "  weights              14.31 GiB   15,367,892,544 B  27.3B" in out   # (as before)


def test_unknown_architecture_and_bad_files(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    rc, _, err = _plan(capsys, str(cfg), "--max-context", "1024")
    assert rc == 2 and "unknown architecture" in err and "gpt2" in err
    junk = tmp_path / "weights.bin"
    junk.write_bytes(b"\0" * 64)
    rc, _, err = _plan(capsys, str(junk), "--max-context", "1024")
    assert rc == 2 and "neither a .ninfer artifact" in err


LLAMA_CFG = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
             "max_position_embeddings": 512}


@pytest.mark.parametrize("arch, field, value, message", [
    ("llama", "num_attention_heads", 0, "is 0: must be at least 1"),
    ("llama", "num_hidden_layers", -30, "is -30: must be at least 1"),
    ("llama", "hidden_size", "abc", "is 'abc': not a whole number"),
    ("llama", "num_key_value_heads", 3.5, "is 3.5: not a whole number"),
    ("llama", "intermediate_size", True, "is True: not a whole number"),
    ("qwen35", "linear_num_key_heads", 0, "is 0: must be at least 1"),
    ("qwen35", "num_key_value_heads", -4, "is -4: must be at least 1"),
    ("qwen35", "hidden_size", -4, "is -4: must be at least 1"),
])
def test_a_config_field_out_of_range_is_named(capsys, tmp_path, arch, field, value, message):
    """A hand-written config.json with a zero, negative, fractional or non-numeric shape field
    is refused in one line naming the file and the field (not a division by zero, not a plan
    of negative sizes)."""
    if arch == "llama":
        cfg = dict(LLAMA_CFG)
    else:
        cfg = json.loads(Path(SHAPE).read_text())
    (cfg.get("text_config") or cfg)[field] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    rc, out, err = _plan(capsys, str(path), "--max-context", "64", "--backend", "numpy")
    assert rc == 2 and not out and "Traceback" not in err
    assert f"{path}: config {field} {message}" in err


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_an_unset_head_dim_needs_heads_that_divide_the_hidden_size(capsys, tmp_path, arch):
    """head_dim unset (absent, null or 0) is hidden_size / heads, which must divide; a set one
    need not."""
    cfg = dict(LLAMA_CFG) if arch == "llama" else json.loads(Path(SHAPE).read_text())
    text = cfg.get("text_config") or cfg
    text.update(hidden_size=text["num_attention_heads"] * 64 + 1, head_dim=0)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    rc, out, err = _plan(capsys, str(path), "--max-context", "64", "--backend", "numpy")
    assert rc == 2 and "config head_dim is unset and hidden_size" in err and not out
    text["head_dim"] = 64
    path.write_text(json.dumps(cfg))
    assert _plan(capsys, str(path), "--max-context", "64", "--backend", "numpy")[0] == 0


def test_a_context_past_the_trained_length_is_planned_with_a_warning(capsys, tmp_path):
    """As serve does (llama.cpp's n_ctx_seq > n_ctx_train): planned, and said."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_CFG))
    rc, out, err = _plan(capsys, str(path), "--max-context", "1024", "--backend", "numpy")
    # on stderr, as serve's warnings: stdout is the header and the table alone
    assert rc == 0 and err == ("ninfer plan: warning: --max-context 1024 is beyond the 512 "
                               "tokens the model was trained on: positions past that may give "
                               "poor output\n")
    assert "warning" not in out and out.splitlines()[1].startswith("  weights ")
    rc, out, err = _plan(capsys, str(path), "--max-context", "1024", "--backend", "numpy",
                         "--json")
    assert json.loads(out)["warnings"][0].startswith("--max-context 1024 is beyond") and not err
    rc, out, err = _plan(capsys, str(path), "--max-context", "512", "--backend", "numpy")
    assert rc == 0 and "warning" not in out + err


def test_llama_config_only_and_unknown_capacity(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
                               "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "intermediate_size": 128,
                               "rms_norm_eps": 1e-5, "tie_word_embeddings": True}))
    rc, out, _ = _plan(capsys, str(cfg), "--max-context", "64", "--backend", "numpy", "--json")
    p = json.loads(out)
    params = 1000 * 64 + 64 + 2 * (2 * 64 + (4 + 2 + 2) * 16 * 64 + 64 * 64 + 3 * 128 * 64)
    assert rc == 0 and p["parameters"] == params and p["weights_bytes"] == 4 * params
    assert p["kv_pool_bytes"] == 64 * 2 * 2 * 2 * 16 * 4 and "capacity_bytes" not in p


# --- against the server's own plan (real SmolLM2, NumPy backend) ----------------------------

@pytest.fixture(scope="module")
def smol_plan(smollm2_gguf):
    from ninfer.config import ServeConfig
    from ninfer.server import build_server, load_runtime
    rt = load_runtime(str(smollm2_gguf), "numpy")
    server = build_server(ServeConfig(max_context=2048, max_concurrency=2,
                                      gpu_memory="1GiB"), rt)
    return server.memory, rt


@pytest.mark.slow
def test_gguf_and_artifact_plans_equal_the_servers(capsys, tmp_path, smollm2_gguf, smol_plan):
    served, _ = smol_plan
    art = tmp_path / "smollm2.ninfer"
    assert main(["convert", str(smollm2_gguf), str(art)]) == 0
    capsys.readouterr()
    for model in (smollm2_gguf, art):
        rc, out, _ = _plan(capsys, str(model), "--max-context", "2048", "--max-concurrency",
                           "2", "--backend", "numpy", "--gpu-memory", "1GiB", "--json")
        p = json.loads(out)
        assert rc == 0
        for key in ("weights_bytes", "kv_pool_bytes", "workspace_bytes", "total_bytes",
                    "kv_pages", "capacity_bytes"):
            assert p[key] == served[key], (model, key)


@pytest.mark.slow
def test_serve_gpu_memory_is_the_capacity_and_refuses_what_does_not_fit(smol_plan):
    from ninfer.config import ServeConfig
    from ninfer.engine.memory import MemoryBudgetError
    from ninfer.server import build_server
    served, rt = smol_plan
    assert served["capacity_bytes"] == 2**30 and served["budget_enforced"] is True
    assert served["kv_dtype"] == "fp32"
    short = served["total_bytes"] - 1000
    with pytest.raises(MemoryBudgetError) as err:
        build_server(ServeConfig(max_context=2048, max_concurrency=2,
                                 gpu_memory=str(short)), rt)
    assert err.value.deficit_bytes == 1000
    assert "store the KV cache in fewer bytes than fp32 (--kv-dtype fp16, int8;" in str(
        err.value)
    with pytest.raises(MemoryBudgetError) as err:   # int8 too: the next smaller ones
        build_server(ServeConfig(max_context=2048, max_concurrency=2, kv_dtype="int8",
                                 gpu_memory="100MiB"), rt)
    assert "fewer bytes than int8 (--kv-dtype rk8v4, rk4v4;" in str(err.value)


@pytest.mark.slow
def test_the_start_up_banner_says_the_kv_cache(smol_plan):
    """serve's banner line (llama-server prints its KV buffer's size and type): the dtype,
    pages, bytes, lanes x context, weights."""
    from ninfer.config import ServeConfig
    from ninfer.server import build_server, memory_line
    _, rt = smol_plan
    server = build_server(ServeConfig(max_context=2048, max_concurrency=2, kv_dtype="int8"), rt)
    m = server.memory
    line = memory_line(server)
    assert line.startswith(f"KV cache int8: {m['kv_pages']:,} pages x 16 tokens (")
    assert f"({m['kv_pool_bytes'] / 2**30:.2f} GiB) for 2 lanes x 2048 tokens; weights" in line


def test_serve_flag_errors():
    from ninfer.config import ServeConfig, parse_size
    assert parse_size("24GiB") == 24 * 2**30 and parse_size("20000MB") == 20_000_000_000
    assert parse_size("123") == 123 and parse_size("1.5 kib") == 1536
    # a bare K/M/G/T (or Ki/Gi) is binary, as llama.cpp and vLLM read it; KB/GB stay decimal
    for text in ("24G", "24g", "24 Gi", "24GiB", "24gib", " 24 GiB "):
        assert parse_size(text) == 24 * 2**30, text
    assert parse_size("512M") == 512 * 2**20 and parse_size("2T") == 2 * 2**40
    assert parse_size("1k") == 1024 and parse_size("24GB") == 24 * 10**9
    for bad in ("24Gb!", "24 G B", "G", "24X"):
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(bad)
    assert ServeConfig(gpu_memory="24G").gpu_memory_bytes == 24 * 2**30   # serve's flag too
    with pytest.raises(ValueError, match="--gpu-memory '24XB' is not a size"):
        ServeConfig(gpu_memory="24XB")
    with pytest.raises(ValueError, match="not both"):
        ServeConfig(gpu_memory="1GiB", memory_capacity_bytes=5)
    assert parse_size(str(2**60)) == parse_size("1048576TiB") == 2**60
    with pytest.raises(ValueError, match=r"'1048577TiB' is more than 1 EiB \(2\*\*60 bytes\)"):
        ServeConfig(gpu_memory="1048577TiB")
    with pytest.raises(ValueError, match="--max-context must be 16..2147483647, got 2147483648"):
        ServeConfig(max_context=2**31)


def test_serve_refuses_an_unparsable_budget_before_loading(capsys):
    assert main(["serve", "--gpu-memory", "24XB"]) == 2
    err = capsys.readouterr().err
    assert "--gpu-memory '24XB' is not a size" in err and "Traceback" not in err


def test_prefill_chunk_auto_plans_the_floor_and_names_the_ceiling_that_fits(capsys):
    """auto (the default) plans 512 tokens, as serve starts from; on cupy with a capacity it
    names the largest chunk the capacity leaves room for (serve's measurement picks at most
    that); an explicit size is planned as given."""
    from ninfer.engine.chunk_size import memory_max_tokens
    args = [SHAPE, "--max-context", "262144", "--kv-dtype", "rk4v4-e8", "--gpu-memory", "24GiB",
            "--json"]
    auto = json.loads(_plan(capsys, *args)[1])
    given = json.loads(_plan(capsys, *args, "--prefill-chunk", "512")[1])
    assert auto["prefill_chunk"] == given["prefill_chunk"] == 512
    assert auto["workspace_bytes"] == given["workspace_bytes"]
    top = auto["prefill_chunk_max_tokens"]
    assert 512 < top < 8192 and top % 64 == 0 and "prefill_chunk_max_tokens" not in given
    at = lambda t: json.loads(_plan(capsys, *args, "--prefill-chunk", str(t))[1])
    assert at(top)["fits"] and not at(top + 64)["fits"]
    assert memory_max_tokens(lambda t: at(t)["total_bytes"], GIB24) == top
    rc, out, _ = _plan(capsys, *args[:-1])
    assert rc == 0 and f"auto: up to {top} fit" in out
    big = json.loads(_plan(capsys, *args, "--prefill-chunk", "4096")[1])
    assert big["prefill_chunk"] == 4096 and big["workspace_bytes"] > auto["workspace_bytes"]
    assert _plan(capsys, SHAPE, "--max-context", "4096", "--prefill-chunk", "0")[0] == 2


def test_without_a_model_it_plans_the_default_one(capsys, smollm2_gguf):
    """As ``serve``: no model argument plans the bundled SmolLM2 (the same plan as naming it)."""
    rc, out, _ = _plan(capsys, "--max-context", "4096", "--json")
    rc2, named, _ = _plan(capsys, str(smollm2_gguf), "--max-context", "4096", "--json")
    assert rc == rc2 == 0
    assert json.loads(out) == json.loads(named)
    assert json.loads(out)["model"] == str(smollm2_gguf)

"""bench/make_qwen35_gguf.py: the synthetic Qwen3.5 Q4_0 GGUF imports into ninfer with its
shape intact, runs a forward pass with finite logits, and the 27B plan has the real sizes."""
from __future__ import annotations

import numpy as np
import pytest

from ninfer.engine.models import load_model
from ninfer.engine.models.llama import ForwardBatch
from ninfer.engine.tokenizer import Tokenizer
from ninfer.kernels import get_ops
from ninfer.store.artifact import load_model_file
from ninfer.store.gguf_import import import_gguf



@pytest.fixture(scope="module")
def gen(bench_script):
    return bench_script("make_qwen35_gguf")


def test_tiny_round_trips_and_runs(tmp_path, gen):
    out = tmp_path / "tiny.gguf"
    assert gen.main([str(out), "tiny"]) == 0
    s = gen.SHAPES["tiny"]
    header, tensors = import_gguf(out)
    cfg = header["config"]
    assert header["architecture"] == "qwen35"
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"],
            cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
            cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
            cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]) == (
        s["vocab"], s["hidden"], s["layers"], s["ffn"], s["heads"], s["kv"], s["head_dim"],
        s["k_heads"], s["v_heads"], s["head_k"], s["head_k"], s["conv"])
    assert cfg["layer_types"][3] == "full_attention" and cfg["layer_types"][2] == "linear_attention"
    assert cfg["partial_rotary_factor"] == 0.25 and not cfg["tie_word_embeddings"]
    assert header["source"]["gguf_types"]["Q4_0"] > 50
    assert tensors["model.layers.3.self_attn.q_proj.weight"].scheme == "q4"
    assert np.allclose(tensors["model.layers.0.linear_attn.A_log"].data, 0.0)   # ssm_a = -1
    assert np.allclose(tensors["model.norm.weight"].data, 0.0)                  # stored 1 + w
    art = load_model_file(out)
    tok = Tokenizer.from_dict(art.header["tokenizer"])
    ids = tok.encode("the other hello")
    model = load_model(art, get_ops("numpy"))
    kv = model.new_kv_cache(8, 16, max_lanes=1)
    batch = ForwardBatch.from_sequences([ids + list(range(300, 320))], [0], [[0, 1, 2]], 16,
                                        state_slots=[0])
    logits = model.forward(batch, kv, all_logits=True)
    assert logits.shape == (len(ids) + 20, s["vocab"])
    assert np.isfinite(logits).all() and 0.1 < logits.std() < 10.0


def test_tiny_with_its_mtp_head_drafts(tmp_path, gen):
    """``--mtp``: the MTP block as llama.cpp names it imports as the model's MTP head."""
    out = tmp_path / "mtp.gguf"
    assert gen.main([str(out), "tiny", "--mtp"]) == 0
    s = gen.SHAPES["tiny"]
    header, tensors = import_gguf(out)
    cfg = header["config"]
    assert (cfg["num_hidden_layers"], cfg["mtp_num_hidden_layers"]) == (s["layers"], 1)
    assert tensors["mtp.fc.weight"].shape == (s["hidden"], 2 * s["hidden"])
    assert tensors["mtp.layers.0.self_attn.q_proj.weight"].scheme == "q4"
    assert load_model(load_model_file(out), get_ops("numpy")).mtp is not None


def test_27b_plan_sizes(gen):
    s = gen.SHAPES["27b"]
    q4 = f32 = 0
    for i in range(s["layers"]):
        for shp, fill in gen.layer_tensors(s, (i + 1) % 4 == 0).values():
            if fill is None:
                q4 += shp[0] * shp[1]
            else:
                f32 += int(np.prod(shp))
    q4 += 2 * s["vocab"] * s["hidden"]
    nbytes = q4 // 32 * 18 + 4 * f32
    assert 14.5e9 < nbytes < 15.5e9   # Qwen3.5-27B: ~26.9 B parameters at 4.5 bits
    assert gen.layer_tensors(s, True)["attn_q.weight"][0] == (2 * 24 * 256, 5120)
    assert gen.layer_tensors(s, False)["attn_qkv.weight"][0] == (2 * 16 * 128 + 48 * 128, 5120)

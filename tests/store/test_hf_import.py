"""HF checkpoint-folder import (``hf_import``): safetensors parsing, name mapping (text-only,
multimodal, Qwen3-Next), weight schemes, tokenizer.json, ``ninfer convert DIR``, and the
groupwise int4 / bf16 conversions in ``quant``."""
from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from ninfer.cli import main as cli_main
from ninfer.engine.models import load_model
from ninfer.engine.models.llama import ForwardBatch
from ninfer.kernels import get_ops
from ninfer.store import hf_import
from ninfer.store.artifact import Artifact, ArtifactError, load_model_file
from ninfer.store.quant import bf16_to_f32, dequantize, f32_to_bf16, quantize_q4

H, I, V = 64, 96, 200
HK, HV, DK, DV, KC = 2, 4, 16, 8, 4
NH, NKV, HD = 4, 2, 32
CONV = 2 * HK * DK + HV * DV


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def write_safetensors(path, tensors: dict[str, np.ndarray], bf16: set[str] = frozenset()):
    """Minimal safetensors writer (names in ``bf16`` are stored as BF16 of their values)."""
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        if name in bf16:
            raw, dt = f32_to_bf16(a).tobytes(), "BF16"
        else:
            a = np.ascontiguousarray(a)
            raw, dt = a.tobytes(), {"float32": "F32", "float16": "F16"}[a.dtype.name]
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def text_weights(rng, layers=("linear_attention", "full_attention"), prefix="model.",
                 qwen3_next=False):
    def m(n, k, s=None):
        return (rng.standard_normal((n, k)) * (s or k ** -0.5)).astype(np.float32)

    def vec(n, s=0.2, base=0.0):
        return (base + rng.standard_normal(n) * s).astype(np.float32)

    w = {prefix + "embed_tokens.weight": m(V, H, 1.0), prefix + "norm.weight": vec(H)}
    for i, kind in enumerate(layers):
        p = f"{prefix}layers.{i}."
        w[p + "input_layernorm.weight"] = vec(H)
        w[p + "post_attention_layernorm.weight"] = vec(H)
        w[p + "mlp.gate_proj.weight"] = m(I, H)
        w[p + "mlp.up_proj.weight"] = m(I, H)
        w[p + "mlp.down_proj.weight"] = m(H, I)
        if kind == "linear_attention":
            a = p + "linear_attn."
            if qwen3_next:
                w[a + "in_proj_qkvz.weight"] = m(CONV + HV * DV, H)
                w[a + "in_proj_ba.weight"] = m(2 * HV, H)
            else:
                w[a + "in_proj_qkv.weight"] = m(CONV, H)
                w[a + "in_proj_z.weight"] = m(HV * DV, H)
                w[a + "in_proj_b.weight"] = m(HV, H)
                w[a + "in_proj_a.weight"] = m(HV, H)
            w[a + "conv1d.weight"] = (rng.standard_normal((CONV, 1, KC)) * 0.4).astype(np.float32)
            w[a + "A_log"] = np.log(rng.uniform(0.5, 8, HV)).astype(np.float32)
            w[a + "dt_bias"] = vec(HV, 0.5, 1.0)
            w[a + "norm.weight"] = vec(DV, 0.2, 1.0)
            w[a + "out_proj.weight"] = m(H, HV * DV)
        else:
            a = p + "self_attn."
            w[a + "q_proj.weight"] = m(2 * NH * HD, H)
            w[a + "k_proj.weight"] = m(NKV * HD, H)
            w[a + "v_proj.weight"] = m(NKV * HD, H)
            w[a + "o_proj.weight"] = m(H, NH * HD)
            w[a + "q_norm.weight"] = vec(HD)
            w[a + "k_norm.weight"] = vec(HD)
    return w


def config(layers=("linear_attention", "full_attention"), **extra):
    return {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
            "vocab_size": V, "hidden_size": H, "intermediate_size": I,
            "num_hidden_layers": len(layers), "num_attention_heads": NH,
            "num_key_value_heads": NKV, "head_dim": HD, "linear_num_key_heads": HK,
            "linear_num_value_heads": HV, "linear_key_head_dim": DK,
            "linear_value_head_dim": DV, "linear_conv_kernel_dim": KC, "rms_norm_eps": 1e-6,
            "layer_types": list(layers), "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                "partial_rotary_factor": 0.25}, **extra}


def make_folder(path, rng, cfg=None, weights=None, bf16=frozenset()):
    path.mkdir(parents=True, exist_ok=True)
    cfg = cfg or config()
    weights = weights if weights is not None else text_weights(rng)
    weights.setdefault("lm_head.weight", (rng.standard_normal((V, H)) * H ** -0.5)
                       .astype(np.float32))
    (path / "config.json").write_text(json.dumps(cfg))
    write_safetensors(path / "model.safetensors", weights, bf16)
    return weights


def logits_of(art, ids):
    model = load_model(art, get_ops("numpy"))
    kv = model.new_kv_cache(8, 16, max_lanes=1)
    b = ForwardBatch.from_sequences([ids], [0], [list(range(8))], 16, state_slots=[0])
    return model.forward(b, kv, all_logits=True)


# ------------------------------------------------------------------------------ quant

def test_quantize_q4_error_and_layout(rng):
    w = (rng.standard_normal((16, 128)) * 2).astype(np.float32)
    w[0, :32] = 0.5  # constant group: exact
    t = quantize_q4(w, 32)
    assert t.scheme == "q4" and t.codes.shape == (16, 64) and t.mins.shape == (16, 4)
    d = dequantize(t)
    s = t.scales.astype(np.float32).repeat(32, axis=1)
    assert (np.abs(d - w) <= s * 0.5 + 2e-3 * np.abs(w) + 1e-3).all()
    np.testing.assert_array_equal(d[0, :32], 0.5)
    q = np.empty((16, 128), np.uint8)  # element 2i low nibble, 2i+1 high nibble
    q[:, 0::2], q[:, 1::2] = t.codes & 15, t.codes >> 4
    np.testing.assert_allclose(d, s * q + t.mins.astype(np.float32).repeat(32, axis=1),
                               rtol=0, atol=0)
    assert np.abs(d - w).mean() < 0.1 * w.std()  # ~ step / 4 with step ~ range / 15
    with pytest.raises(ValueError):
        quantize_q4(w[:, :48], 32)


def test_f32_to_bf16_rounds_to_nearest_even():
    one = 1.0
    ulp = 2.0 ** -7
    x = np.array([one, one + ulp / 2, one + 3 * ulp / 2, one + ulp / 2 + 2 ** -20, -2.5, 0.0,
                  np.inf, 3.4e38, np.nan], np.float32)
    got = bf16_to_f32(f32_to_bf16(x))
    assert got[:4].tolist() == [1.0, 1.0, one + 2 * ulp, one + ulp]
    assert got[4:6].tolist() == [-2.5, 0.0]
    assert got[6] == np.inf and got[7] == np.inf and np.isnan(got[8])


# ------------------------------------------------------------------------------ safetensors

def test_read_safetensors_dtypes(tmp_path, rng):
    a = rng.standard_normal((3, 5)).astype(np.float32)
    b = rng.standard_normal(7).astype(np.float16)
    c = rng.standard_normal((2, 2)).astype(np.float32)
    write_safetensors(tmp_path / "x.safetensors", {"a": a, "b": b, "c": c}, bf16={"c"})
    got = hf_import.read_safetensors(tmp_path / "x.safetensors")
    assert got["a"][0] == "F32" and np.array_equal(got["a"][1], a)
    assert got["b"][0] == "F16" and np.array_equal(got["b"][1], b)
    assert got["c"][0] == "BF16" and np.array_equal(got["c"][1], f32_to_bf16(c))
    raw = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[:-4])
    with pytest.raises(ArtifactError, match="out of range"):
        hf_import.read_safetensors(tmp_path / "cut.safetensors")


# ------------------------------------------------------------------------------ layouts

def test_split_qkvz_and_ba_follow_the_per_key_head_grouping(rng):
    cfg = {"linear_num_key_heads": 2, "linear_num_value_heads": 6, "linear_key_head_dim": 3,
           "linear_value_head_dim": 2}
    r, dk, dv = 3, 3, 2
    per = 2 * dk + 2 * r * dv
    rows = np.arange(2 * per)[:, None] * np.ones((1, 4))
    qkv, z = hf_import.split_qkvz(rows, cfg)
    want_q = [g * per + i for g in range(2) for i in range(dk)]
    want_k = [g * per + dk + i for g in range(2) for i in range(dk)]
    want_v = [g * per + 2 * dk + i for g in range(2) for i in range(r * dv)]
    want_z = [g * per + 2 * dk + r * dv + i for g in range(2) for i in range(r * dv)]
    assert qkv[:, 0].tolist() == want_q + want_k + want_v
    assert z[:, 0].tolist() == want_z
    ba = np.arange(12)[:, None].astype(float)
    b, a = hf_import.split_ba(ba, cfg)
    assert b[:, 0].tolist() == [0, 1, 2, 6, 7, 8] and a[:, 0].tolist() == [3, 4, 5, 9, 10, 11]


def test_qwen3_next_layout_equals_qwen35_layout(tmp_path, rng):
    """A Qwen3-Next folder whose fused projections are the Qwen3.5 ones regrouped runs
    identically to the Qwen3.5 folder."""
    w35 = make_folder(tmp_path / "a", rng)
    cfg = {"linear_num_key_heads": HK, "linear_num_value_heads": HV,
           "linear_key_head_dim": DK, "linear_value_head_dim": DV}
    r = HV // HK
    wn = {}
    for name, a in w35.items():
        if name.endswith("in_proj_qkv.weight"):
            base = name[:-len("in_proj_qkv.weight")]
            q, k, v = np.split(a, [HK * DK, 2 * HK * DK])
            z = w35[base + "in_proj_z.weight"]
            blocks = [np.concatenate([q[g * DK:(g + 1) * DK], k[g * DK:(g + 1) * DK],
                                      v[g * r * DV:(g + 1) * r * DV],
                                      z[g * r * DV:(g + 1) * r * DV]]) for g in range(HK)]
            wn[base + "in_proj_qkvz.weight"] = np.concatenate(blocks)
            b, a_ = w35[base + "in_proj_b.weight"], w35[base + "in_proj_a.weight"]
            wn[base + "in_proj_ba.weight"] = np.concatenate(
                [np.concatenate([b[g * r:(g + 1) * r], a_[g * r:(g + 1) * r]]) for g in range(HK)])
        elif not name.endswith(("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")):
            wn[name] = a
    make_folder(tmp_path / "b", rng, cfg=config(model_type="qwen3_next", num_experts=0),
                weights=wn)
    ta, tb = load_model_file(tmp_path / "a").tensors, load_model_file(tmp_path / "b").tensors
    assert set(ta) == set(tb)
    for name in ta:
        assert np.array_equal(dequantize(ta[name]), dequantize(tb[name])), name
    assert cfg  # (kept for readability of the construction above)


def test_multimodal_prefix_visual_skipped_mtp_kept(tmp_path, rng):
    w = text_weights(rng, prefix="model.language_model.")
    w["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((6, 4), np.float32)
    w["mtp.fc.weight"] = np.ones((H, 2 * H), np.float32)
    w["mtp.layers.0.input_layernorm.weight"] = np.zeros(H, np.float32)
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "tie_word_embeddings": True, "text_config": {**config(), "tie_word_embeddings": True}}
    make_folder(tmp_path, rng, cfg=cfg, weights=w)
    header, tensors = hf_import.import_hf(tmp_path, "f32")
    assert "model.layers.1.self_attn.q_proj.weight" in tensors
    assert not any("visual" in n or "language_model" in n for n in tensors)
    assert "lm_head.weight" not in tensors and header["config"]["tie_word_embeddings"]
    assert tensors["mtp.fc.weight"].shape == (H, 2 * H)
    assert header["config"]["mtp_num_hidden_layers"] == 1
    assert tensors["model.layers.0.linear_attn.conv1d.weight"].shape == (CONV, KC)


def test_rejects_moe_and_non_checkpoints(tmp_path, rng):
    make_folder(tmp_path / "moe", rng, cfg=config(model_type="qwen3_next", num_experts=8))
    with pytest.raises(ArtifactError, match="mixture-of-experts"):
        hf_import.import_hf(tmp_path / "moe")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArtifactError, match="config.json"):
        load_model_file(tmp_path / "empty")
    make_folder(tmp_path / "llama", rng, cfg={**config(), "model_type": "llama"})
    with pytest.raises(ArtifactError, match="model_type 'llama'"):
        hf_import.import_hf(tmp_path / "llama")
    with pytest.raises(ValueError, match="weight scheme"):
        hf_import.import_hf(tmp_path / "moe", "fp8")


# ------------------------------------------------------------------------------ schemes

def test_convert_cli_schemes(tmp_path, rng, capsys):
    src = tmp_path / "ckpt"
    make_folder(src, rng, bf16={"model.layers.0.mlp.up_proj.weight"})
    ids = rng.integers(0, V, 40).tolist()
    ref = logits_of(load_model_file(src), ids)
    errs = {}
    for scheme in ("f32", "bf16", "int8", "int4"):
        dst = tmp_path / f"m-{scheme}.ninfer"
        assert cli_main(["convert", str(src), str(dst), "--weights", scheme]) == 0
        assert "sha256" in capsys.readouterr().out
        art = Artifact.open(dst)
        assert art.architecture == "qwen35" and art.header["source"]["weights"] == scheme
        schemes = {n: t.scheme for n, t in art.tensors.items()}
        assert schemes["model.layers.0.linear_attn.A_log"] == "f32"
        assert schemes["model.norm.weight"] == "f32"
        want = {"f32": "f32", "bf16": "bf16", "int8": "q8", "int4": "q4"}[scheme]
        assert schemes["model.layers.1.mlp.down_proj.weight"] == want
        assert schemes["model.layers.0.linear_attn.in_proj_b.weight"] == (
            "f32" if scheme == "f32" else "bf16")
        if scheme == "int4":
            assert schemes["lm_head.weight"] == "q8"
            assert art.tensors["model.layers.1.mlp.down_proj.weight"].mins is not None
        if scheme == "bf16":  # a bf16 source tensor is kept bit for bit
            t = art.tensors["model.layers.0.mlp.up_proj.weight"]
            src_bits = hf_import.read_safetensors(src / "model.safetensors")[
                "model.layers.0.mlp.up_proj.weight"][1]
            assert np.array_equal(t.data, src_bits)
        got = logits_of(art, ids)
        errs[scheme] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    assert errs["f32"] == 0.0
    assert errs["bf16"] < 0.015 and errs["int8"] < 0.04 and errs["int4"] < 0.35
    assert errs["bf16"] < errs["int8"] < errs["int4"]


def test_tokenizer_json_and_template_are_imported(tmp_path, rng):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, AddedToken
    from ninfer.engine.tokenizer import Tokenizer as Ours
    make_folder(tmp_path, rng)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|im_end|>", special=True)])
    tok.add_tokens([AddedToken("<think>", special=False)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": "{{ messages[0]['content'] }}"}))
    header, _ = hf_import.import_hf(tmp_path, "f32")
    d = header["tokenizer"]
    assert header["chat_template"] == "{{ messages[0]['content'] }}"
    n = len(vocab)
    assert d["tokens"][n] == "<|im_end|>" and d["token_types"][n] == 3
    assert d["tokens"][n + 1] == "<think>" and d["token_types"][n + 1] == 4
    assert d["eos_token_id"] == n
    ours = Ours.from_dict({**d, "pre": "gpt2"})
    text = "hello world<think><|im_end|>"
    assert ours.encode(text) == tok.encode(text).ids


def test_builtin_chat_template_when_folder_has_none(tmp_path, rng):
    from ninfer.engine.qwen35_template import QWEN35_CHAT_TEMPLATE
    make_folder(tmp_path, rng)
    header, _ = hf_import.import_hf(tmp_path, "f32")
    assert header["chat_template"] == QWEN35_CHAT_TEMPLATE
    assert header["tokenizer"] == {}  # vocab 200 fits no known tokenizer, and none ships

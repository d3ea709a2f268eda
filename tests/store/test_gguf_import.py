"""GGUF import: lossless repacking, requantization paths, q/k un-permutation, metadata, errors."""
from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from ninfer.store.artifact import Artifact, ArtifactError, describe, load_model_file
from ninfer.store.gguf_import import (
    convert_gguf, hf_tensor_name, import_gguf, permute_rows, unpermute_rows,
)
from ninfer.store.quant import QuantTensor, dequantize, quantize_q8


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _hf_to_gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute (the operation import must undo)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _heads_for(hf_name: str, cfg: dict) -> int | None:
    if ".q_proj." in hf_name:
        return cfg["num_attention_heads"]
    if ".k_proj." in hf_name:
        return cfg["num_key_value_heads"]
    return None


# ------------------------------------------------------------------ the real SmolLM2 GGUF

@pytest.fixture(scope="module")
def smollm2_import(smollm2_gguf):
    return import_gguf(smollm2_gguf)


def test_smollm2_bit_identical_to_gguf_dequantize(smollm2_gguf, smollm2_import):
    header, tensors = smollm2_import
    cfg = header["config"]
    reader = gguf.GGUFReader(smollm2_gguf)
    assert len(reader.tensors) == len(tensors) == 272
    seen = set()
    for rt in reader.tensors:
        name = hf_tensor_name(rt.name)
        ref = gguf.quants.dequantize(rt.data, rt.tensor_type)
        heads = _heads_for(name, cfg)
        if heads is not None:
            ref = ref[unpermute_rows(ref.shape[0], heads)]
        ours = dequantize(tensors[name])
        assert ours.dtype == np.float32 and ours.shape == ref.shape, name
        assert np.array_equal(_bits(ours), _bits(ref)), name
        seen.add(name)
    assert seen == set(tensors)


def test_smollm2_schemes_names_and_metadata(smollm2_import):
    header, tensors = smollm2_import
    assert header["architecture"] == "llama"
    cfg = header["config"]
    assert cfg == {
        "vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "intermediate_size": 1536, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192, "tie_word_embeddings": True, "rope_scaling": None,
        "bos_token_id": 1, "eos_token_id": 2,
    }
    assert "lm_head.weight" not in tensors
    emb = tensors["model.embed_tokens.weight"]
    assert (emb.scheme, emb.shape, emb.group) == ("q8", (49152, 576), 32)
    assert tensors["model.norm.weight"].scheme == "f32"
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert (q.scheme, q.shape, q.group) == ("q4", (576, 576), 32) and q.mins is not None
    assert tensors["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert tensors["model.layers.3.mlp.down_proj.weight"].shape == (576, 1536)
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight",
                 "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight"]
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{n}" for i in range(30) for n in per_layer}
    assert set(tensors) == expected
    tok = header["tokenizer"]
    assert tok["model"] == "gpt2" and tok["pre"] == "smollm"
    assert len(tok["tokens"]) == len(tok["token_types"]) == 49152
    assert tok["tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert len(tok["merges"]) == 48900 and tok["merges"][0] == "Ġ t"
    assert (tok["bos_token_id"], tok["eos_token_id"], tok["pad_token_id"],
            tok["unk_token_id"], tok["add_bos_token"]) == (1, 2, 2, 0, False)
    assert header["chat_template"].startswith("{% for message in messages %}")
    assert header["source"]["format"] == "gguf"
    assert header["source"]["gguf_types"] == {"Q8_0": 1, "F32": 61, "Q4_1": 210}


def test_smollm2_convert_then_open(tmp_path, smollm2_gguf, smollm2_import):
    header, tensors = smollm2_import
    dst = tmp_path / "smollm2.ninfer"
    sha = convert_gguf(smollm2_gguf, dst)
    assert sha == hashlib.sha256(dst.read_bytes()).hexdigest()
    art = Artifact.open(dst)
    assert art.sha256 == sha
    assert art.config == header["config"]
    assert art.tokenizer == header["tokenizer"]
    assert art.chat_template == header["chat_template"]
    assert art.header["source"]["sha256"] == hashlib.sha256(
        Path(smollm2_gguf).read_bytes()).hexdigest()
    assert list(art.tensors) == list(tensors)
    for name, t in tensors.items():
        got = art.tensors[name]
        assert (got.scheme, tuple(got.shape), got.group) == (t.scheme, tuple(t.shape), t.group)
        for part, arr in t.parts().items():
            assert np.array_equal(got.parts()[part], arr), (name, part)


def test_smollm2_load_model_file_in_memory(smollm2_gguf):
    art = load_model_file(smollm2_gguf)
    assert art.file_format == "gguf"
    assert art.architecture == "llama"
    assert art.size_bytes == Path(smollm2_gguf).stat().st_size
    assert art.sha256 == hashlib.sha256(Path(smollm2_gguf).read_bytes()).hexdigest()
    assert len(art.tensors) == 272
    text = describe(smollm2_gguf)
    assert "GGUF" in text and "q4: 210" in text and "49152 tokens" in text


@pytest.mark.slow
def test_smollm2_qk_unpermute_matches_transformers(smollm2_gguf, smollm2_import):
    """transformers' own GGUF loader reverses the same permutation; its dequantized weights
    (float32) must equal ours exactly for q, k and an unpermuted tensor."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(Path(smollm2_gguf).parent), gguf_file=Path(smollm2_gguf).name,
        torch_dtype="float32")
    _, tensors = smollm2_import
    sd = model.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.7.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
                 "model.embed_tokens.weight"):
        theirs = sd[name].numpy()
        np.testing.assert_array_equal(dequantize(tensors[name]), theirs, err_msg=name)


# ------------------------------------------------------------------ synthetic GGUFs

HIDDEN, HEADS, KV_HEADS, FF, VOCAB = 64, 2, 1, 256, 16
HD = HIDDEN // HEADS


def _q6k_blocks(rng, rows: int, k: int) -> np.ndarray:
    """Random Q6_K payload with finite scales (gguf-py cannot quantize K-quants)."""
    nb = k // 256
    blocks = rng.integers(0, 256, size=(rows, nb, 210), dtype=np.uint8)
    d = (rng.uniform(1e-3, 1e-2, size=(rows, nb)).astype(np.float16)).view(np.uint8)
    blocks[..., 208:210] = d.reshape(rows, nb, 2)
    return blocks.reshape(rows, nb * 210)


def _write_llama_gguf(path: Path, arch: str = "llama", tied: bool = True, seed: int = 0,
                      with_metadata: bool = True) -> dict:
    """A one-layer llama GGUF exercising every import path. Returns the HF-layout source
    weights (float32) for the tensors whose values are known exactly."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    if with_metadata:
        w.add_context_length(256)
        w.add_embedding_length(HIDDEN)
        w.add_block_count(1)
        w.add_feed_forward_length(FF)
        w.add_head_count(HEADS)
        w.add_head_count_kv(KV_HEADS)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_vocab_size(VOCAB)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt2")
        tokens = ["<s>", "</s>", "a", "b", "c", "ab", "Ġ", "Ġa"] + [f"t{i}" for i in range(VOCAB - 8)]
        w.add_token_list(tokens)
        w.add_token_types([3, 3] + [1] * (VOCAB - 2))
        w.add_token_merges(["a b", "Ġ a"])
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
        w.add_chat_template("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
    src: dict[str, np.ndarray] = {}

    def f32(shape):
        return rng.standard_normal(shape).astype(np.float32)

    # token_embd: F16 (kept f16)
    emb = f32((VOCAB, HIDDEN)).astype(np.float16)
    w.add_tensor("token_embd.weight", emb)
    src["model.embed_tokens.weight"] = emb.astype(np.float32)
    # norms: F32 (kept f32)
    for g, hf in (("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
                  ("blk.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight"),
                  ("output_norm.weight", "model.norm.weight")):
        v = f32((HIDDEN,))
        w.add_tensor(g, v)
        src[hf] = v
    # q: F32 in HF layout, permuted as the converter does -> import must restore it exactly
    q_hf = f32((HIDDEN, HIDDEN))
    w.add_tensor("blk.0.attn_q.weight", _hf_to_gguf_permute(q_hf, HEADS))
    src["model.layers.0.self_attn.q_proj.weight"] = q_hf
    # k: Q4_0 of the permuted HF weights (lossless repack + row un-permutation)
    k_hf = f32((KV_HEADS * HD, HIDDEN))
    w.add_tensor("blk.0.attn_k.weight", gguf.quants.quantize(_hf_to_gguf_permute(k_hf, KV_HEADS),
                                                             T.Q4_0), raw_dtype=T.Q4_0)
    # v: BF16 (bit patterns kept)
    w.add_tensor("blk.0.attn_v.weight", gguf.quants.quantize(f32((KV_HEADS * HD, HIDDEN)), T.BF16),
                 raw_dtype=T.BF16)
    # o: Q8_0; gate: Q4_1 (lossless)
    w.add_tensor("blk.0.attn_output.weight", gguf.quants.quantize(f32((HIDDEN, HIDDEN)), T.Q8_0),
                 raw_dtype=T.Q8_0)
    w.add_tensor("blk.0.ffn_gate.weight", gguf.quants.quantize(f32((FF, HIDDEN)), T.Q4_1),
                 raw_dtype=T.Q4_1)
    # up: Q5_0 (requantized to q8); down: Q6_K (K-quant, requantized to q8)
    w.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(f32((FF, HIDDEN)), T.Q5_0),
                 raw_dtype=T.Q5_0)
    w.add_tensor("blk.0.ffn_down.weight", _q6k_blocks(rng, HIDDEN, FF), raw_dtype=T.Q6_K)
    if not tied:
        w.add_tensor("output.weight", gguf.quants.quantize(f32((VOCAB, HIDDEN)), T.Q8_0),
                     raw_dtype=T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return src


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    src = _write_llama_gguf(path)
    return path, src


def test_synthetic_every_path(tiny_gguf):
    path, src = tiny_gguf
    header, tensors = import_gguf(path)
    cfg = header["config"]
    assert cfg["num_attention_heads"] == HEADS and cfg["num_key_value_heads"] == KV_HEADS
    assert cfg["head_dim"] == HD and cfg["intermediate_size"] == FF
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["tie_word_embeddings"] is True
    assert "lm_head.weight" not in tensors
    schemes = {n: t.scheme for n, t in tensors.items()}
    assert schemes == {
        "model.embed_tokens.weight": "f16",
        "model.layers.0.input_layernorm.weight": "f32",
        "model.layers.0.post_attention_layernorm.weight": "f32",
        "model.norm.weight": "f32",
        "model.layers.0.self_attn.q_proj.weight": "f32",
        "model.layers.0.self_attn.k_proj.weight": "q4",
        "model.layers.0.self_attn.v_proj.weight": "bf16",
        "model.layers.0.self_attn.o_proj.weight": "q8",
        "model.layers.0.mlp.gate_proj.weight": "q4",
        "model.layers.0.mlp.up_proj.weight": "q8",
        "model.layers.0.mlp.down_proj.weight": "q8",
    }
    assert tensors["model.layers.0.self_attn.k_proj.weight"].mins is None
    assert tensors["model.layers.0.mlp.gate_proj.weight"].mins is not None
    assert tensors["model.layers.0.self_attn.v_proj.weight"].data.dtype == np.uint16
    # exact values where the source is known in HF layout (q un-permuted)
    for name, ref in src.items():
        np.testing.assert_array_equal(dequantize(tensors[name]), ref, err_msg=name)
    reader = gguf.GGUFReader(path)
    for rt in reader.tensors:
        name = hf_tensor_name(rt.name)
        ref = gguf.quants.dequantize(rt.data, rt.tensor_type).reshape(tensors[name].shape)
        heads = _heads_for(name, cfg)
        if heads is not None:
            ref = ref[unpermute_rows(ref.shape[0], heads)]
        ours = dequantize(tensors[name])
        if rt.tensor_type in (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1):
            assert np.array_equal(_bits(ours), _bits(ref)), name  # lossless
        else:  # Q5_0 / Q6_K: dequantized then requantized to q8 group 32
            assert tensors[name].group == 32
            assert np.array_equal(_bits(ours), _bits(dequantize(quantize_q8(ref, 32)))), name
            step = np.abs(ref).reshape(ref.shape[0], -1, 32).max(-1, keepdims=True) / 127
            err = np.abs(ours - ref).reshape(step.shape[0], -1, 32)
            assert np.all(err <= step * 0.5 + 1e-6 * np.abs(ref).max()), name


def test_synthetic_k_unpermuted_matches_hf_layout(tmp_path):
    """Q4_0 k rows come back in HF rotate-half order: quantizing the HF rows directly gives the
    same blocks as quantizing the permuted rows and un-permuting the block rows."""
    path = tmp_path / "k.gguf"
    _write_llama_gguf(path, seed=3)
    _, tensors = import_gguf(path)
    k = tensors["model.layers.0.self_attn.k_proj.weight"]
    reader = gguf.GGUFReader(path)
    raw = next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight").data
    gguf_rows = gguf.quants.dequantize(raw, T.Q4_0)
    perm = unpermute_rows(KV_HEADS * HD, KV_HEADS)
    assert np.array_equal(dequantize(k), gguf_rows[perm])
    # the permutation is the inverse of the converter's
    x = np.arange(HIDDEN * 3, dtype=np.float32).reshape(HIDDEN, 3)
    assert np.array_equal(_hf_to_gguf_permute(x, HEADS)[unpermute_rows(HIDDEN, HEADS)], x)
    t = QuantTensor("f32", x.shape, data=_hf_to_gguf_permute(x, HEADS))
    assert np.array_equal(permute_rows(t, unpermute_rows(HIDDEN, HEADS)).data, x)


def test_synthetic_untied_has_lm_head_and_converts(tmp_path):
    path = tmp_path / "untied.gguf"
    _write_llama_gguf(path, tied=False)
    header, tensors = import_gguf(path)
    assert header["config"]["tie_word_embeddings"] is False
    assert tensors["lm_head.weight"].scheme == "q8"
    assert header["tokenizer"]["tokens"][:3] == ["<s>", "</s>", "a"]
    assert header["tokenizer"]["merges"] == ["a b", "Ġ a"]
    assert header["tokenizer"]["token_types"][:3] == [3, 3, 1]
    assert header["chat_template"].startswith("{{ bos_token }}")
    dst = tmp_path / "untied.ninfer"
    sha = convert_gguf(path, dst)
    art = Artifact.open(dst)
    assert art.sha256 == sha
    for name, t in tensors.items():
        assert np.array_equal(_bits(dequantize(art.tensors[name])), _bits(dequantize(t))), name
    # detection by magic bytes, not extension
    renamed = tmp_path / "model.bin"
    renamed.write_bytes(path.read_bytes())
    art2 = load_model_file(renamed)
    assert art2.file_format == "gguf" and set(art2.tensors) == set(tensors)


@pytest.mark.parametrize("arch", ["qwen2", "foo"])
def test_other_architecture_rejected(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ArtifactError) as ei:
        import_gguf(path)
    assert path.name in str(ei.value) and repr(arch) in str(ei.value)
    with pytest.raises(ArtifactError, match=arch):
        load_model_file(path)


def test_truncated_gguf_rejected(tmp_path, tiny_gguf):
    path, _ = tiny_gguf
    raw = path.read_bytes()
    reader = gguf.GGUFReader(path)
    cuts = {4, 10, 30, 200, reader.data_offset - 1, reader.data_offset + 100, len(raw) - 1}
    for cut in sorted(cuts):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(raw[:cut])
        with pytest.raises(ArtifactError) as ei:
            import_gguf(bad)
        assert bad.name in str(ei.value), (cut, str(ei.value))
        with pytest.raises(ArtifactError):
            load_model_file(bad)


def test_truncated_copy_of_smollm2_rejected(tmp_path, smollm2_gguf):
    bad = tmp_path / "smollm2-cut.gguf"
    with open(smollm2_gguf, "rb") as f:
        bad.write_bytes(f.read(60_000_000))
    with pytest.raises(ArtifactError, match="smollm2-cut.gguf.*truncated"):
        import_gguf(bad)


def test_wrong_magic_and_garbage(tmp_path):
    p = tmp_path / "nota.gguf"
    p.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(ArtifactError, match="nota.gguf.*magic"):
        import_gguf(p)
    g = tmp_path / "garbage.gguf"
    g.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ArtifactError, match="garbage.gguf"):
        import_gguf(g)
    e = tmp_path / "empty.gguf"
    e.write_bytes(b"")
    with pytest.raises(ArtifactError, match="empty.gguf"):
        import_gguf(e)


def test_missing_metadata_rejected(tmp_path):
    path = tmp_path / "nometa.gguf"
    _write_llama_gguf(path, with_metadata=False)
    with pytest.raises(ArtifactError, match="nometa.gguf.*missing"):
        import_gguf(path)


def test_hf_tensor_names():
    assert hf_tensor_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert hf_tensor_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.0.mystery.weight") is None

"""Qwen35Model (NumPy ops, paged KV + per-lane GDN state) against HuggingFace transformers.

Tiny random-initialised ``Qwen3_5ForCausalLM`` / dense ``Qwen3NextForCausalLM`` models (every
parameter re-drawn at a scale where norms, gates and decays all matter) are saved with
``save_pretrained``, imported with ``hf_import`` in float32 and run by both.
"""
from __future__ import annotations

import numpy as np
import pytest

from ninfer.engine.models.llama import ForwardBatch
from ninfer.engine.models.qwen35 import Qwen35Config, Qwen35Model
from ninfer.kernels import get_ops

pytestmark = pytest.mark.slow

PAGE_SIZE = 16
NUM_PAGES = 48
VOCAB = 320

CONFIGS = {
    # 3 GDN + 1 attention, GQA 2, Hv = 2 Hk, untied
    "l4_gqa2_hv2x": dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                         tie_word_embeddings=False),
    # attention first and twice, GQA 4, Hv == Hk, tied
    "l6_gqa4_tied": dict(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
                         head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2,
                         tie_word_embeddings=True,
                         layer_types=["full_attention", "linear_attention", "linear_attention",
                                      "full_attention", "linear_attention", "linear_attention"]),
    # 1 GDN + 1 attention, no GQA, Hv = 3 Hk (the 27B ratio), head_dim 64 (rotary 16), untied
    "l2_mha_hv3x": dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                        head_dim=64, linear_num_key_heads=1, linear_num_value_heads=3,
                        tie_word_embeddings=False,
                        layer_types=["linear_attention", "full_attention"]),
}


def _randomize(model, seed: int) -> None:
    import torch
    gen = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=gen)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 7.5 + 0.5))
            elif name.endswith("dt_bias"):
                p.copy_(randn(p.shape) * 0.5 + 1.0)
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + randn(p.shape) * 0.2)
            elif "norm" in name:
                p.copy_(randn(p.shape) * 0.2)  # zero-centred: 1 + w
            elif "conv1d" in name:
                p.copy_(randn(p.shape) * 0.4)
            elif "embed_tokens" in name:
                p.copy_(randn(p.shape))
            else:
                p.copy_(randn(p.shape) / p.shape[-1] ** 0.5)


EOS = 256   # the end token of ``byte_level_tokenizer``


def byte_level_tokenizer():
    """A real byte-level BPE tokenizer over VOCAB ids: 256 byte tokens, an end token (EOS),
    spares (for the engine tests on the tiny checkpoints)."""
    from tokenizers import pre_tokenizers

    from ninfer.engine.tokenizer import Tokenizer
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + ["<|endoftext|>"] + [f"<|spare{i}|>" for i in range(VOCAB - 257)]
    return Tokenizer.from_dict({"model": "gpt2", "pre": "gpt2", "tokens": tokens,
                                "token_types": [1] * 256 + [3] * (VOCAB - 256), "merges": [],
                                "bos_token_id": None, "eos_token_id": EOS,
                                "add_bos_token": False})


def make_checkpoint(folder, name: str, seed: int = 0, next_layout: bool = False):
    """Save a random tiny model to ``folder``; return the (eval, float32) transformers model."""
    import torch
    import transformers
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, linear_key_head_dim=16,
              linear_value_head_dim=8, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                               "partial_rotary_factor": 0.25}, **CONFIGS[name])
    torch.manual_seed(seed)
    if next_layout:
        cfg = transformers.Qwen3NextConfig(num_experts=0,
                                           mlp_only_layers=list(range(kw["num_hidden_layers"])),
                                           **kw)
        model = transformers.Qwen3NextForCausalLM(cfg)
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**kw))
    _randomize(model, seed)
    model = model.eval().float()
    model.save_pretrained(str(folder))
    return model


def hf_logits(model, ids):
    import torch
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def rel_err(ours, ref) -> float:
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.abs(np.asarray(ours, np.float64) - ref).max() / np.abs(ref).max())


def run(model, kv, ids, slot=0, start=0, chunk=None, table=None):
    """Feed ``ids`` (positions start..) through ``model`` in chunks; all logits."""
    chunk = chunk or len(ids)
    table = table if table is not None else list(range(slot * 12, slot * 12 + 12))
    out = []
    for a in range(0, len(ids), chunk):
        b = ForwardBatch.from_sequences([ids[a:a + chunk]], [start + a], [table], PAGE_SIZE,
                                        state_slots=[slot])
        out.append(model.forward(b, kv, all_logits=True))
    return np.concatenate(out)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (folder, transformers model, ninfer model)."""
    from ninfer.store.artifact import load_model_file
    from ninfer.engine.models import load_model
    out = {}
    for i, name in enumerate([*CONFIGS, "next"]):
        folder = tmp_path_factory.mktemp(name)
        hf = make_checkpoint(folder, "l4_gqa2_hv2x" if name == "next" else name, seed=i,
                             next_layout=name == "next")
        art = load_model_file(folder)
        assert art.architecture == "qwen35" and art.file_format == "hf"
        out[name] = (folder, hf, load_model(art, get_ops("numpy")))
    return out


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(7).integers(0, VOCAB, 150).tolist()


NAMES = [*CONFIGS, "next"]


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(checkpoints, prompt, name):
    _, hf, ours = checkpoints[name]
    ref = hf_logits(hf, prompt)  # chunked GDN over 150 tokens (3 chunks of 64)
    kv = ours.new_kv_cache(NUM_PAGES, PAGE_SIZE, max_lanes=4)
    got = run(ours, kv, prompt, slot=2)
    assert got.shape == (150, VOCAB)
    assert np.abs(ref).max() > 1.0  # a real signal, not a degenerate model
    assert rel_err(got, ref) < 1e-3
    assert kv.lengths[2] == 150 and kv.lengths[0] == 0


@pytest.mark.parametrize("name", NAMES)
def test_32_greedy_tokens_identical(checkpoints, prompt, name):
    import torch
    _, hf, ours = checkpoints[name]
    ids = prompt[:20]
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
    ref = out[0, len(ids):].tolist()
    kv = ours.new_kv_cache(NUM_PAGES, PAGE_SIZE, max_lanes=2)
    table = list(range(8))
    logits = run(ours, kv, ids, slot=1, table=table)[-1]
    got = []
    for i in range(32):
        tok = int(np.argmax(logits))
        got.append(tok)
        b = ForwardBatch.from_sequences([[tok]], [len(ids) + i], [table], PAGE_SIZE,
                                        state_slots=[1])
        logits = ours.forward(b, kv)[0]
    assert len(ref) == 32
    assert got == ref
    if not ours.config.tie_word_embeddings:  # tied random models echo their input token
        assert len(set(got)) > 3  # not a constant stream


def test_chunked_prefill_equals_token_by_token_recurrence(checkpoints, prompt):
    folder, _, _ = checkpoints["l4_gqa2_hv2x"]
    from ninfer.store.artifact import load_model_file
    art = load_model_file(folder)
    ops = get_ops("numpy")
    chunked = Qwen35Model.from_artifact(art, ops, gdn_mode="chunked")
    recurrent = Qwen35Model.from_artifact(art, ops, gdn_mode="recurrent")
    kv_c = chunked.new_kv_cache(NUM_PAGES, PAGE_SIZE, 1)
    kv_r = recurrent.new_kv_cache(NUM_PAGES, PAGE_SIZE, 1)
    kv_t = recurrent.new_kv_cache(NUM_PAGES, PAGE_SIZE, 1)
    a = run(chunked, kv_c, prompt)
    b = run(recurrent, kv_r, prompt)
    c = run(recurrent, kv_t, prompt, chunk=1)  # decode path, one token per pass
    assert rel_err(a, b) < 1e-4
    assert rel_err(c, b) < 1e-4
    for layer in range(len(kv_c.ssm)):
        assert rel_err(kv_c.ssm[layer][0], kv_r.ssm[layer][0]) < 1e-5
        np.testing.assert_allclose(kv_c.conv[layer][0], kv_t.conv[layer][0], rtol=1e-6,
                                   atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 7, 64, 100])
def test_prefill_in_chunks_equals_one_shot(checkpoints, prompt, chunk):
    _, _, ours = checkpoints["l6_gqa4_tied"]
    kv1 = ours.new_kv_cache(NUM_PAGES, PAGE_SIZE, 1)
    one = run(ours, kv1, prompt)
    kv2 = ours.new_kv_cache(NUM_PAGES, PAGE_SIZE, 1)
    got = run(ours, kv2, prompt, chunk=chunk)
    assert rel_err(got, one) < 1e-4
    assert int(np.argmax(got[-1])) == int(np.argmax(one[-1]))
    for layer in range(len(kv1.ssm)):
        assert rel_err(kv2.ssm[layer][0], kv1.ssm[layer][0]) < 1e-4


def test_ragged_batch_equals_separate_runs(checkpoints, prompt):
    """Two sequences (one prefilling 37 tokens, one decoding) in one pass, non-adjacent state
    slots, shuffled pages: each equals its own run."""
    _, _, ours = checkpoints["l4_gqa2_hv2x"]
    rng = np.random.default_rng(3)
    pages = rng.permutation(NUM_PAGES).tolist()
    ta, tb = pages[:12], pages[12:24]
    kv = ours.new_kv_cache(NUM_PAGES, PAGE_SIZE, max_lanes=5)
    run(ours, kv, prompt[:50], slot=4, table=tb)  # sequence b: 50 tokens cached
    both = ForwardBatch.from_sequences([prompt[60:97], [prompt[50]]], [0, 50], [ta, tb],
                                       PAGE_SIZE, state_slots=[1, 4])
    logits = ours.forward(both, kv)
    kv_a = ours.new_kv_cache(NUM_PAGES, PAGE_SIZE, max_lanes=1)
    ref_a = run(ours, kv_a, prompt[60:97])[-1]
    kv_b = ours.new_kv_cache(NUM_PAGES, PAGE_SIZE, max_lanes=1)
    ref_b = run(ours, kv_b, prompt[:51])[-1]
    assert rel_err(logits[0], ref_a) < 1e-5
    assert rel_err(logits[1], ref_b) < 1e-5
    assert kv.lengths.tolist() == [0, 37, 0, 0, 51]


def test_state_frontier_is_enforced(checkpoints, prompt):
    _, _, ours = checkpoints["l2_mha_hv3x"]
    kv = ours.new_kv_cache(NUM_PAGES, PAGE_SIZE, max_lanes=2)
    table = list(range(4))
    first = run(ours, kv, prompt[:10], slot=0, table=table)
    # continuing anywhere but the frontier (a rewind or a gap) is refused, nothing changes
    before = [s.copy() for s in kv.ssm]
    for start in (5, 11, 0):
        b = ForwardBatch.from_sequences([prompt[start:start + 3]], [start], [table], PAGE_SIZE,
                                        state_slots=[0])
        with pytest.raises(ValueError, match="cannot be rewound"):
            ours.forward(b, kv)
    assert all(np.array_equal(a, b) for a, b in zip(before, kv.ssm))
    with pytest.raises(ValueError, match="state_slots"):
        ours.forward(ForwardBatch.from_sequences([prompt[:3]], [0], [table], PAGE_SIZE), kv)
    with pytest.raises(ValueError, match="distinct"):
        ours.forward(ForwardBatch.from_sequences([prompt[:3]], [0], [table], PAGE_SIZE,
                                                 state_slots=[2]), kv)
    # reset: the slot starts over and reproduces the first run exactly
    kv.reset_state(0)
    assert kv.lengths[0] == 0 and not any(s[0].any() for s in kv.ssm + kv.conv)
    again = run(ours, kv, prompt[:10], slot=0, table=table)
    np.testing.assert_array_equal(again, first)
    # copy_state forks a lane at its exact frontier
    kv.copy_state(0, 1)
    a = run(ours, kv, prompt[10:14], slot=0, start=10, table=table)
    b = run(ours, kv, prompt[10:14], slot=1, start=10, table=table)
    np.testing.assert_array_equal(a, b)
    assert kv.state_bytes_per_lane == 4 * (3 * (16 + 16 + 24) + 3 * 16 * 8)
    assert kv.nbytes == kv.kv.nbytes + 2 * kv.state_bytes_per_lane


def test_config_from_hf_dict_and_errors():
    base = dict(vocab_size=10, hidden_size=8, num_hidden_layers=4, num_attention_heads=2,
                intermediate_size=8, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=4, linear_value_head_dim=4, head_dim=8,
                rope_parameters={"rope_theta": 1e7, "partial_rotary_factor": 0.25})
    c = Qwen35Config.from_dict(base)
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (c.rotary_dim, c.rope_theta, c.conv_dim, c.num_key_value_heads) == (2, 1e7, 32, 2)
    assert c.attention_layers == (3,) and c.gdn_layers == (0, 1, 2)
    with pytest.raises(ValueError, match="multiple"):
        Qwen35Config.from_dict({**base, "linear_num_value_heads": 3})
    with pytest.raises(ValueError, match="layer_types"):
        Qwen35Config.from_dict({**base, "layer_types": ["full_attention"]})
    with pytest.raises(ValueError, match="lacks"):
        Qwen35Config.from_dict({k: v for k, v in base.items() if k != "hidden_size"})

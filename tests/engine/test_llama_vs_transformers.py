"""LlamaModel (NumPy ops, paged KV) against HuggingFace transformers on the same weights.

The real SmolLM2-135M-Instruct GGUF is loaded by both: transformers dequantizes it itself, ninfer
through ``load_model_file``. A tiny random-weight model covers what SmolLM2 lacks (llama3 RoPE
scaling, an untied lm_head).
"""
from __future__ import annotations

import numpy as np
import pytest

from ninfer.engine.models.llama import ForwardBatch, LlamaConfig, LlamaModel
from ninfer.kernels import get_ops
from ninfer.store.quant import QuantTensor

SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
          "Face<|im_end|>\n")
PROMPTS = [
    SYSTEM + "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    SYSTEM + "<|im_start|>user\nWrite a Python function that checks whether a number is prime."
             "<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n<|im_start|>user\nName three "
    "colours of the rainbow.<|im_end|>\n<|im_start|>assistant\nRed, orange and<|im_end|>\n"
    "<|im_start|>user\nAnd two more?<|im_end|>\n<|im_start|>assistant\n",
]
PAGE_SIZE = 16
NUM_PAGES = 64


def rel_err(ours, ref) -> float:
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.abs(np.asarray(ours, dtype=np.float64) - ref).max() / np.abs(ref).max())


def permuted_tables(rng, n_seqs, pages_each, num_pages=NUM_PAGES):
    """Disjoint, shuffled (non-contiguous) block tables."""
    order = rng.permutation(num_pages)
    return [order[i * pages_each:(i + 1) * pages_each].tolist() for i in range(n_seqs)]


def prefill(model, kv, ids, table, page_size=PAGE_SIZE, chunk=None, all_logits=False):
    """Run ``ids`` through ``model`` in chunks; return the concatenated logits."""
    chunk = chunk or len(ids)
    out = []
    for a in range(0, len(ids), chunk):
        b = ForwardBatch.from_sequences([ids[a:a + chunk]], [a], [table], page_size)
        out.append(model.forward(b, kv, all_logits=all_logits))
    return np.concatenate(out) if all_logits else out[-1]


# ------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def hf(smollm2_gguf):
    import torch
    import transformers
    kw = dict(gguf_file=smollm2_gguf.name)
    model = transformers.LlamaForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), torch_dtype=torch.float32, **kw).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), **kw)
    return model, tok


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    from ninfer.store.artifact import load_model_file
    return LlamaModel.from_artifact(load_model_file(smollm2_gguf), get_ops("numpy"))


@pytest.fixture(scope="module")
def prompt_ids(hf):
    _, tok = hf
    return [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_logits(hf, prompt_ids):
    import torch
    model, _ = hf
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].numpy() for ids in prompt_ids]


# ------------------------------------------------------------------- real model vs HF

@pytest.mark.slow
def test_logits_match_transformers(ours, prompt_ids, hf_logits):
    rng = np.random.default_rng(0)
    for ids, ref in zip(prompt_ids, hf_logits):
        assert len(ids) > 2 * PAGE_SIZE  # several pages per sequence
        table = permuted_tables(rng, 1, -(-len(ids) // PAGE_SIZE))[0]
        kv = ours.new_kv_cache(NUM_PAGES, PAGE_SIZE)
        logits = prefill(ours, kv, ids, table, all_logits=True)
        assert logits.shape == ref.shape and logits.dtype == np.float32
        assert rel_err(logits, ref) < 1e-3
        last = ours.forward(ForwardBatch.from_sequences([ids], [0], [table], PAGE_SIZE),
                            ours.new_kv_cache(NUM_PAGES, PAGE_SIZE))
        assert last.shape == (1, ref.shape[1])
        assert rel_err(last[0], ref[-1]) < 1e-3
        assert last[0].argmax() == ref[-1].argmax()


@pytest.mark.slow
def test_greedy_generation_matches_transformers(hf, ours, prompt_ids):
    """32 greedy tokens per prompt, past <|im_end|> (stopping is the engine's job, not the
    model's), with prefill then token-by-token decode over paged KV."""
    import torch
    model, tok = hf
    rng = np.random.default_rng(1)
    n_new = 32
    for ids in prompt_ids:
        saved = model.generation_config.eos_token_id
        model.generation_config.eos_token_id = None  # generate exactly n_new tokens
        try:
            with torch.no_grad():
                gen = model.generate(torch.tensor([ids]), do_sample=False,
                                     max_new_tokens=n_new, pad_token_id=tok.eos_token_id,
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        finally:
            model.generation_config.eos_token_id = saved
        ref = gen[0, len(ids):].tolist()
        assert len(ref) == n_new
        table = permuted_tables(rng, 1, -(-(len(ids) + n_new) // PAGE_SIZE))[0]
        kv = ours.new_kv_cache(NUM_PAGES, PAGE_SIZE)
        logits = prefill(ours, kv, ids, table)
        toks = [int(logits[0].argmax())]
        while len(toks) < n_new:
            b = ForwardBatch.from_sequences([[toks[-1]]], [len(ids) + len(toks) - 1], [table],
                                            PAGE_SIZE)
            toks.append(int(ours.forward(b, kv)[0].argmax()))
        assert toks == ref, (tok.decode(toks), tok.decode(ref))


@pytest.mark.slow
def test_chunked_prefill_equals_one_shot(ours, prompt_ids):
    rng = np.random.default_rng(2)
    ids = prompt_ids[1]
    table = permuted_tables(rng, 1, -(-len(ids) // PAGE_SIZE))[0]
    one = prefill(ours, ours.new_kv_cache(NUM_PAGES, PAGE_SIZE), ids, table, all_logits=True)
    for chunk in (7, 16):
        kv = ours.new_kv_cache(NUM_PAGES, PAGE_SIZE)
        chunked = prefill(ours, kv, ids, table, chunk=chunk, all_logits=True)
        assert rel_err(chunked, one) < 1e-5
    # the last-token form of the final chunk agrees too
    last = prefill(ours, ours.new_kv_cache(NUM_PAGES, PAGE_SIZE), ids, table, chunk=7)
    assert rel_err(last[0], one[-1]) < 1e-5


@pytest.mark.slow
def test_page_placement_does_not_change_logits(ours, prompt_ids):
    ids = prompt_ids[0]
    rng = np.random.default_rng(3)
    n_pages = -(-len(ids) // PAGE_SIZE)
    contiguous = prefill(ours, ours.new_kv_cache(NUM_PAGES, PAGE_SIZE), ids,
                         list(range(n_pages)), all_logits=True)
    permuted = prefill(ours, ours.new_kv_cache(NUM_PAGES, PAGE_SIZE), ids,
                       permuted_tables(rng, 1, n_pages)[0], all_logits=True)
    assert np.array_equal(contiguous, permuted)  # same KV values gathered in the same order
    small = prefill(ours, ours.new_kv_cache(3 * len(ids), 3), ids,
                    rng.permutation(3 * len(ids))[:-(-len(ids) // 3)].tolist(), page_size=3,
                    all_logits=True)
    assert rel_err(small, contiguous) < 1e-6


@pytest.mark.slow
def test_ragged_batch_equals_each_sequence_alone(ours, prompt_ids):
    rng = np.random.default_rng(4)
    pages_each = 6
    tables = permuted_tables(rng, 3, pages_each)
    # prefill all three prompts in one forward
    kv = ours.new_kv_cache(NUM_PAGES, PAGE_SIZE)
    batch = ForwardBatch.from_sequences(prompt_ids, [0, 0, 0], tables, PAGE_SIZE)
    together = ours.forward(batch, kv)
    assert together.shape == (3, ours.config.vocab_size)
    alone_kv = []
    for s, ids in enumerate(prompt_ids):
        kv_s = ours.new_kv_cache(NUM_PAGES, PAGE_SIZE)
        alone = prefill(ours, kv_s, ids, tables[s])
        assert rel_err(together[s], alone[0]) < 1e-5, s
        alone_kv.append(kv_s)
    # a mixed step: sequence 0 decodes one token, 1 prefills a 5-token chunk, 2 decodes
    extra = [[tok] for tok in together.argmax(-1).tolist()]
    extra[1] = extra[1] + [28, 1187, 31, 198]
    starts = [len(ids) for ids in prompt_ids]
    mixed = ours.forward(ForwardBatch.from_sequences(extra, starts, tables, PAGE_SIZE), kv,
                         all_logits=True)
    cu = np.cumsum([0] + [len(e) for e in extra])
    for s in range(3):
        b = ForwardBatch.from_sequences([extra[s]], [starts[s]], [tables[s]], PAGE_SIZE)
        alone = ours.forward(b, alone_kv[s], all_logits=True)
        assert rel_err(mixed[cu[s]:cu[s + 1]], alone) < 1e-5, s


# --------------------------------------------------------- tiny random model vs HF

TINY = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=112, rope_theta=10000.0,
            rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.slow
@pytest.mark.parametrize("scaling", [None, LLAMA3])
def test_tiny_random_model_matches_transformers(scaling):
    """Untied lm_head and (optionally) llama3 RoPE scaling at positions past the original
    context, against HF with the same random weights."""
    import torch
    import transformers
    torch.manual_seed(0)
    rope = {"rope_type": "default", "rope_theta": TINY["rope_theta"]}
    if scaling:
        rope = dict(scaling, rope_theta=TINY["rope_theta"])
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in TINY.items() if k != "rope_theta"},
                                      rope_parameters=rope, attention_bias=False,
                                      initializer_range=0.15)  # attention far from uniform
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1; make them matter
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    weights = {n: QuantTensor("f32", tuple(p.shape), data=p.detach().numpy().copy())
               for n, p in hf.state_dict().items()}
    cfg = LlamaConfig.from_dict(dict(TINY, rope_scaling=scaling))
    assert cfg.rope_scaling == scaling
    model = LlamaModel(cfg, weights, get_ops("numpy"))
    assert model.lm_head is not model.embed
    ids = np.random.default_rng(5).integers(0, 96, 200).tolist()
    offset = 3000  # rotary positions far past original_max_position_embeddings
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), position_ids=torch.arange(offset, offset + 200)[None]
                 ).logits[0].numpy()
    table = np.random.default_rng(6).permutation(40)[:25].tolist()

    def run(m):
        kv = m.new_kv_cache(40, 8)
        out = []
        for a in range(0, 200, 64):  # chunked prefill, positions shifted by offset
            b = ForwardBatch.from_sequences([ids[a:a + 64]], [a], [table], 8)
            b.positions = b.positions + offset
            out.append(m.forward(b, kv, all_logits=True))
        return np.concatenate(out)

    assert rel_err(run(model), ref) < 1e-4
    if scaling:  # the scaling is material at these positions
        plain = LlamaModel(LlamaConfig.from_dict(TINY), weights, get_ops("numpy"))
        assert rel_err(run(plain), ref) > 1e-2


# ------------------------------------------------------------------- fast checks

def test_config_from_dict_defaults_and_errors():
    cfg = LlamaConfig.from_dict({k: v for k, v in TINY.items()
                                 if k not in ("head_dim", "num_key_value_heads")})
    assert cfg.head_dim == 16 and cfg.num_key_value_heads == 4 and cfg.rope_scaling is None
    assert LlamaConfig.from_dict(dict(TINY, rope_scaling={"rope_type": "default"})) \
        .rope_scaling is None
    with pytest.raises(ValueError, match="yarn"):
        LlamaConfig.from_dict(dict(TINY, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="linear"):
        LlamaConfig.from_dict(dict(TINY, rope_scaling={"type": "linear", "factor": 2.0}))
    with pytest.raises(ValueError, match="low_freq_factor"):
        LlamaConfig.from_dict(dict(TINY, rope_scaling={"rope_type": "llama3", "factor": 8.0}))
    with pytest.raises(ValueError, match="hidden_size"):
        LlamaConfig.from_dict({k: v for k, v in TINY.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="multiple"):
        LlamaConfig.from_dict(dict(TINY, num_key_value_heads=3))


def _tiny_weights(rng, tied=True):
    c = LlamaConfig.from_dict(TINY)
    hd, h, i = c.head_dim, c.hidden_size, c.intermediate_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    for n in range(c.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (c.num_attention_heads * hd, h),
            p + "self_attn.k_proj.weight": (c.num_key_value_heads * hd, h),
            p + "self_attn.v_proj.weight": (c.num_key_value_heads * hd, h),
            p + "self_attn.o_proj.weight": (h, c.num_attention_heads * hd),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i)})
    if not tied:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return c, {n: QuantTensor("f32", s, data=(rng.standard_normal(s) * 0.2).astype(np.float32))
               for n, s in shapes.items()}


def test_model_rejects_missing_or_misshapen_weights():
    c, w = _tiny_weights(np.random.default_rng(0))
    ops = get_ops("numpy")
    tied = LlamaModel(LlamaConfig.from_dict(dict(TINY, tie_word_embeddings=True)), w, ops)
    assert tied.lm_head is tied.embed
    bad = dict(w)
    del bad["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="up_proj"):
        LlamaModel(c, bad, ops)
    bad = dict(w)
    bad["model.layers.0.self_attn.k_proj.weight"] = QuantTensor(
        "f32", (16, 64), data=np.zeros((16, 64), np.float32))
    with pytest.raises(ValueError, match="k_proj"):
        LlamaModel(c, bad, ops)


def test_forward_rejects_inconsistent_batch():
    c, w = _tiny_weights(np.random.default_rng(0))
    model = LlamaModel(c, w, get_ops("numpy"))
    kv = model.new_kv_cache(4, 4)
    good = ForwardBatch.from_sequences([[1, 2, 3]], [0], [[2]], 4)
    assert model.forward(good, kv).shape == (1, c.vocab_size)
    bad = ForwardBatch.from_sequences([[1, 2, 3]], [0], [[2]], 4)
    bad.positions = bad.positions[:2]
    with pytest.raises(ValueError, match="inconsistent"):
        model.forward(bad, kv)
    with pytest.raises(ValueError, match="cannot hold"):
        ForwardBatch.from_sequences([[1] * 5], [0], [[0]], 4)
    with pytest.raises(ValueError, match="no new tokens"):
        ForwardBatch.from_sequences([[]], [0], [[0]], 4)


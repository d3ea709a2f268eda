"""The Qwen3.5 MTP head (``Qwen35Model.mtp_forward``) against a float64 dense re-derivation of
spec A.8 (transformers has no MTP module), plus KV continuity and ``split_k``."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from ninfer.engine.models.llama import ForwardBatch
from ninfer.engine.models.qwen35 import Qwen35Config, Qwen35Model, split_k
from ninfer.kernels import get_ops
from ninfer.store.quant import QuantTensor, dequantize, quantize_q4, quantize_q8

H, I, V, NH, NKV, HD = 64, 96, 150, 4, 2, 32
CFG = dict(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=2,
           num_attention_heads=NH, num_key_value_heads=NKV, head_dim=HD,
           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
           linear_value_head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
           partial_rotary_factor=0.25, layer_types=["linear_attention", "full_attention"],
           mtp_num_hidden_layers=1)


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def f32(a):
    return QuantTensor("f32", a.shape, data=np.ascontiguousarray(a, dtype=np.float32))


def attn_block(rng, p, w):
    m = lambda n, k: rng.standard_normal((n, k)) / k ** 0.5  # noqa: E731
    w[p + "input_layernorm.weight"] = rng.standard_normal(H) * 0.2
    w[p + "post_attention_layernorm.weight"] = rng.standard_normal(H) * 0.2
    w[p + "self_attn.q_proj.weight"] = m(2 * NH * HD, H)
    w[p + "self_attn.k_proj.weight"] = m(NKV * HD, H)
    w[p + "self_attn.v_proj.weight"] = m(NKV * HD, H)
    w[p + "self_attn.o_proj.weight"] = m(H, NH * HD)
    w[p + "self_attn.q_norm.weight"] = rng.standard_normal(HD) * 0.2
    w[p + "self_attn.k_norm.weight"] = rng.standard_normal(HD) * 0.2
    w[p + "mlp.gate_proj.weight"] = m(I, H)
    w[p + "mlp.up_proj.weight"] = m(I, H)
    w[p + "mlp.down_proj.weight"] = m(H, I)


def weights(rng):
    c = Qwen35Config.from_dict(CFG)
    w = {"model.embed_tokens.weight": rng.standard_normal((V, H)),
         "model.norm.weight": rng.standard_normal(H) * 0.2,
         "lm_head.weight": rng.standard_normal((V, H)) / H ** 0.5}
    p = "model.layers.0."
    w[p + "input_layernorm.weight"] = rng.standard_normal(H) * 0.2
    w[p + "post_attention_layernorm.weight"] = rng.standard_normal(H) * 0.2
    for n, shape in (("in_proj_qkv", (c.conv_dim, H)), ("in_proj_z", (c.value_dim, H)),
                     ("in_proj_b", (4, H)), ("in_proj_a", (4, H)), ("out_proj", (H, c.value_dim))):
        w[p + f"linear_attn.{n}.weight"] = rng.standard_normal(shape) / shape[1] ** 0.5
    w[p + "linear_attn.conv1d.weight"] = rng.standard_normal((c.conv_dim, 4)) * 0.4
    w[p + "linear_attn.A_log"] = np.log(rng.uniform(0.5, 8, 4))
    w[p + "linear_attn.dt_bias"] = rng.standard_normal(4) * 0.5 + 1
    w[p + "linear_attn.norm.weight"] = 1 + rng.standard_normal(8) * 0.2
    for n in ("gate_proj", "up_proj"):
        w[p + f"mlp.{n}.weight"] = rng.standard_normal((I, H)) / H ** 0.5
    w[p + "mlp.down_proj.weight"] = rng.standard_normal((H, I)) / I ** 0.5
    attn_block(rng, "model.layers.1.", w)
    attn_block(rng, "mtp.layers.0.", w)
    w["mtp.fc.weight"] = rng.standard_normal((H, 2 * H)) / (2 * H) ** 0.5
    w["mtp.pre_fc_norm_embedding.weight"] = rng.standard_normal(H) * 0.2
    w["mtp.pre_fc_norm_hidden.weight"] = rng.standard_normal(H) * 0.2
    w["mtp.norm.weight"] = rng.standard_normal(H) * 0.2
    return {k: f32(np.asarray(v)) for k, v in w.items()}


def rms1(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1 + w)


def mtp_reference(w, hidden, next_ids, positions):
    """float64 spec A.8: x = fc([norm_e(E[t]), norm_h(h)]); attention block; mtp.norm; head."""
    g = {k: dequantize(v).astype(np.float64) for k, v in w.items()}
    x = np.concatenate([rms1(g["model.embed_tokens.weight"][next_ids],
                             g["mtp.pre_fc_norm_embedding.weight"]),
                        rms1(hidden.astype(np.float64), g["mtp.pre_fc_norm_hidden.weight"])],
                       axis=1) @ g["mtp.fc.weight"].T
    p = "mtp.layers.0."
    t = x.shape[0]
    y = rms1(x, g[p + "input_layernorm.weight"])
    qg = (y @ g[p + "self_attn.q_proj.weight"].T).reshape(t, NH, 2 * HD)
    q = rms1(qg[..., :HD], g[p + "self_attn.q_norm.weight"])
    gate = qg[..., HD:].reshape(t, NH * HD)
    k = rms1((y @ g[p + "self_attn.k_proj.weight"].T).reshape(t, NKV, HD),
             g[p + "self_attn.k_norm.weight"])
    v = (y @ g[p + "self_attn.v_proj.weight"].T).reshape(t, NKV, HD)
    rot = HD // 4
    inv = 10000.0 ** (-np.arange(0, rot, 2) / rot)
    ang = positions[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rope(a):
        a = a.copy()
        x1, x2 = a[..., :rot // 2].copy(), a[..., rot // 2:rot].copy()
        a[..., :rot // 2] = x1 * cos - x2 * sin
        a[..., rot // 2:rot] = x2 * cos + x1 * sin
        return a

    q, k = rope(q), rope(k)
    out = np.zeros((t, NH, HD))
    for h in range(NH):
        kk, vv = k[:, h // (NH // NKV)], v[:, h // (NH // NKV)]
        s = q[:, h] @ kk.T / np.sqrt(HD)
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        pr = np.exp(s - s.max(1, keepdims=True))
        out[:, h] = (pr / pr.sum(1, keepdims=True)) @ vv
    a = out.reshape(t, NH * HD) / (1 + np.exp(-gate))
    x = x + a @ g[p + "self_attn.o_proj.weight"].T
    y = rms1(x, g[p + "post_attention_layernorm.weight"])
    gt, up = y @ g[p + "mlp.gate_proj.weight"].T, y @ g[p + "mlp.up_proj.weight"].T
    x = x + (gt / (1 + np.exp(-gt)) * up) @ g[p + "mlp.down_proj.weight"].T
    hm = rms1(x, g["mtp.norm.weight"])
    return hm @ g["lm_head.weight"].T, hm


def test_mtp_head_matches_float64_spec(rng):
    w = weights(rng)
    model = Qwen35Model(Qwen35Config.from_dict(CFG), w, get_ops("numpy"))
    assert model.mtp is not None
    kv = model.new_kv_cache(8, 16, max_lanes=1)
    assert kv.kv.num_layers == 2  # one main attention layer + the MTP layer
    ids = rng.integers(0, V, 30).tolist()
    table = list(range(4))
    b = ForwardBatch.from_sequences([ids], [0], [table], 16, state_slots=[0])
    logits, hidden = model.forward(b, kv, return_hidden=True)
    assert logits.shape == (1, V) and hidden.shape == (30, H)
    nxt = ids[1:] + [int(np.argmax(logits[0]))]
    mb = ForwardBatch.from_sequences([nxt], [0], [table], 16)
    d_logits, d_hidden = model.mtp_forward(mb, hidden, kv, all_logits=True)
    ref_logits, ref_hidden = mtp_reference(w, hidden, np.array(nxt), np.arange(30))
    err = np.abs(d_logits - ref_logits).max() / np.abs(ref_logits).max()
    assert err < 1e-4
    assert np.abs(d_hidden - ref_hidden).max() < 1e-3
    # chained drafts: the head continues from its own KV, one row per step
    kv2 = model.new_kv_cache(8, 16, max_lanes=1)
    model.forward(b, kv2)
    model.mtp_forward(ForwardBatch.from_sequences([nxt[:20]], [0], [table], 16),
                      hidden[:20], kv2)
    rows = []
    for j in range(20, 30):
        lg, _ = model.mtp_forward(ForwardBatch.from_sequences([[nxt[j]]], [j], [table], 16),
                                  hidden[j:j + 1], kv2)
        rows.append(lg[0])
    np.testing.assert_allclose(np.stack(rows), d_logits[20:], rtol=1e-4, atol=1e-4)


def test_no_mtp_head_without_weights(rng):
    w = {k: v for k, v in weights(rng).items() if not k.startswith("mtp.")}
    model = Qwen35Model(Qwen35Config.from_dict(CFG), w, get_ops("numpy"))
    assert model.mtp is None and model.new_kv_cache(4, 16, 1).kv.num_layers == 1
    with pytest.raises(ValueError, match="no MTP head"):
        model.mtp_forward(ForwardBatch.from_sequences([[1]], [0], [[0]], 16),
                          np.zeros((1, H), np.float32), model.new_kv_cache(4, 16, 1))


@pytest.mark.parametrize("quant", ["f32", "bf16", "q8", "q4"])
def test_split_k_keeps_values(rng, quant):
    a = rng.standard_normal((8, 128)).astype(np.float32)
    t = {"f32": f32(a), "q8": quantize_q8(a), "q4": quantize_q4(a),
         "bf16": QuantTensor("bf16", a.shape,
                             data=(a.view(np.uint32) >> 16).astype(np.uint16))}[quant]
    left, right = split_k(t, 64)
    full = dequantize(t)
    np.testing.assert_array_equal(dequantize(left), full[:, :64])
    np.testing.assert_array_equal(dequantize(right), full[:, 64:])
    if quant in ("q8", "q4"):
        with pytest.raises(ValueError, match="group"):
            split_k(t, 48)


# ------------------------------------------------------------- speculative verify / commit

def plain_greedy(model, prompts, n):
    kv = model.new_kv_cache(16, 16, max_lanes=len(prompts))
    tables = [list(range(8 * s, 8 * s + 8)) for s in range(len(prompts))]
    b = ForwardBatch.from_sequences(prompts, [0] * len(prompts), tables, 16,
                                    state_slots=list(range(len(prompts))))
    toks = [[int(np.argmax(r))] for r in model.forward(b, kv)]
    for i in range(n - 1):
        b = ForwardBatch.from_sequences([[t[-1]] for t in toks],
                                        [len(p) + i for p in prompts], tables, 16,
                                        state_slots=list(range(len(prompts))))
        for t, r in zip(toks, model.forward(b, kv)):
            t.append(int(np.argmax(r)))
    return toks


def spec_greedy(model, prompts, n, k, truth, rng):
    """Greedy decoding with k drafts per round taken from ``truth`` with random corruptions;
    one verify pass over all sequences, then commit of each accepted prefix."""
    s_n = len(prompts)
    kv = model.new_kv_cache(16, 16, max_lanes=s_n)
    tables = [list(range(8 * s, 8 * s + 8)) for s in range(s_n)]
    b = ForwardBatch.from_sequences(prompts, [0] * s_n, tables, 16, state_slots=list(range(s_n)))
    out = [[int(np.argmax(r))] for r in model.forward(b, kv)]
    pos = [len(p) for p in prompts]
    stats = {"rounds": 0, "drafted": 0, "accepted": 0}
    while min(len(o) for o in out) < n:
        drafts = []
        for s in range(s_n):
            d = list(truth[s][len(out[s]):len(out[s]) + k]) + [0] * k
            d = d[:k]
            if rng.random() < 0.6:
                j = int(rng.integers(k))
                d[j] = (d[j] + 1 + int(rng.integers(V - 1))) % V
            drafts.append(d)
        b = ForwardBatch.from_sequences([[o[-1]] + d for o, d in zip(out, drafts)], pos,
                                        tables, 16, state_slots=list(range(s_n)))
        logits, rec = model.verify(b, kv)
        acc = []
        for s in range(s_n):
            rows = logits[s * (k + 1):(s + 1) * (k + 1)]
            a = 0
            while a < k and drafts[s][a] == int(np.argmax(rows[a])):
                a += 1
            out[s] += drafts[s][:a] + [int(np.argmax(rows[a]))]
            pos[s] += a + 1
            acc.append(a + 1)
            stats["drafted"] += k
            stats["accepted"] += a
        model.commit(kv, rec, acc)
        stats["rounds"] += 1
        assert kv.lengths[:s_n].tolist() == pos
    return [o[:n] for o in out], stats


@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculative_greedy_equals_plain_greedy(rng, k):
    model = Qwen35Model(Qwen35Config.from_dict(CFG), weights(rng), get_ops("numpy"))
    prompts = [rng.integers(0, V, 9).tolist(), rng.integers(0, V, 14).tolist()]
    truth = plain_greedy(model, prompts, 24)
    got, stats = spec_greedy(model, prompts, 24, k, truth, rng)
    assert got == truth
    assert 0 < stats["accepted"] < stats["drafted"]  # both accepted and rejected drafts


def test_commit_rejects_bad_counts(rng):
    model = Qwen35Model(Qwen35Config.from_dict(CFG), weights(rng), get_ops("numpy"))
    kv = model.new_kv_cache(4, 16, max_lanes=1)
    b = ForwardBatch.from_sequences([[1, 2, 3]], [0], [[0]], 16, state_slots=[0])
    logits, rec = model.verify(b, kv)
    # per token: 4 heads' deltas (dv 8), the key heads' k (dk 16) and 4 decays
    hk = CFG["linear_num_key_heads"]
    assert logits.shape == (3, V) and rec.ssm[0].shape == (1, 3, 4 * 8 + hk * 16 + 4)
    for bad in ([0], [4], [1, 1]):
        with pytest.raises(ValueError, match="accepted"):
            model.commit(kv, rec, bad)
    model.commit(kv, rec, [2])
    assert kv.lengths[0] == 2
    # the slot now continues from token 2 exactly as a fresh 2-token prefill would
    fresh = model.new_kv_cache(4, 16, max_lanes=1)
    model.forward(ForwardBatch.from_sequences([[1, 2]], [0], [[0]], 16, state_slots=[0]), fresh)
    np.testing.assert_allclose(kv.ssm[0][0], fresh.ssm[0][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(kv.conv[0][0], fresh.conv[0][0])


def test_memory_plan_sizes_the_hybrid_cache_it_allocates(rng):
    """The plan's KV pool (paged K/V of the attention layers and the MTP layer, plus the
    lanes' recurrent state) is the byte size of the cache the model allocates."""
    from ninfer.engine.memory import plan_memory, state_bytes_per_lane
    model = Qwen35Model(Qwen35Config.from_dict(CFG), weights(rng), get_ops("numpy"))
    plan = plan_memory(model, max_concurrency=3, max_context=100, page_size=16,
                       prefill_chunk=64)
    cache = model.new_kv_cache(plan.kv_pages, 16, max_lanes=3)
    assert plan.kv_pool_bytes == cache.nbytes and cache.kv.num_layers == 2  # 1 attn + MTP
    assert plan.state_bytes == 3 * cache.state_bytes_per_lane
    assert state_bytes_per_lane(model.config) == 4 * (3 * (2 * 32 + 32) + 4 * 16 * 8)

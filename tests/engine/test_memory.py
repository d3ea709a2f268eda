"""The start-up memory budget (``ninfer.engine.memory``): each part's arithmetic against sizes
computed independently, the capacity check with an injected capacity, and the server's
``server.started`` report and refusal to start (real SmolLM2 on the NumPy backend)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ninfer.engine.memory import (
    GPU_LIBRARY_BYTES,
    GRAPH_FIXED_BYTES,
    L2_MIN_BYTES,
    MIB,
    MemoryBudgetError,
    MemoryPlan,
    activation_elems_per_token,
    cuda_graph_bytes,
    kv_pool_bytes,
    l2_budget_bytes,
    plan_memory,
    weights_resident_bytes,
    workspace_bytes,
)
from ninfer.engine.models.llama import LlamaConfig, LlamaModel
from ninfer.kernels import get_ops
from ninfer.store.quant import QuantTensor, quantize_q4, quantize_q8

TINY = dict(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=96, rope_theta=10000.0,
            rms_norm_eps=1e-5, max_position_embeddings=512)


def _weights(rng, cfg, tied):
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    qd = cfg["num_attention_heads"] * cfg["head_dim"]
    kd = cfg["num_key_value_heads"] * cfg["head_dim"]
    m = lambda n, k: rng.standard_normal((n, k)).astype(np.float32)
    w = {"model.embed_tokens.weight": quantize_q8(m(v, h)),
         "model.norm.weight": QuantTensor("f32", (h,), data=np.ones(h, np.float32))}
    if not tied:
        w["lm_head.weight"] = quantize_q4(m(v, h))
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w[p + norm + ".weight"] = w["model.norm.weight"]
        for name, shape in (("self_attn.q_proj", (qd, h)), ("self_attn.k_proj", (kd, h)),
                            ("self_attn.v_proj", (kd, h)), ("self_attn.o_proj", (h, qd)),
                            ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)),
                            ("mlp.down_proj", (h, i))):
            w[p + name + ".weight"] = quantize_q4(m(*shape))
    return w


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def tiny(request):
    cfg = dict(TINY, tie_word_embeddings=request.param)
    model = LlamaModel(LlamaConfig.from_dict(cfg), _weights(np.random.default_rng(7), cfg,
                                                            request.param), get_ops("numpy"))
    return model, cfg


def test_weights_are_the_float32_arrays_each_counted_once(tiny):
    model, cfg = tiny
    h, i, v, L = (cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"],
                  cfg["num_hidden_layers"])
    qkv = (4 + 2 + 2) * 16
    per_layer = 2 * h + qkv * h + h * 64 + 2 * i * h + h * i   # norms, qkv, o, gate_up, down
    heads = 1 if cfg["tie_word_embeddings"] else 2               # embedding (+ untied head)
    expected = 4 * (heads * v * h + L * per_layer + h)
    total, max_packed = weights_resident_bytes(model)
    assert total == expected
    assert max_packed == 0  # the NumPy backend keeps no packed weights


def test_kv_pool_bytes_is_the_allocated_cache_size_without_allocating_it(tiny):
    model, cfg = tiny
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    for pages, page_size in ((1, 16), (7, 16), (40, 8)):
        got = kv_pool_bytes(model, pages, page_size)
        assert got == model.new_kv_cache(pages, page_size).nbytes
        assert got == per_token * pages * page_size


def test_activation_workspace_and_graph_arithmetic():
    c = LlamaConfig.from_dict(TINY)
    # 4 H + (nh + 2 nkv) hd + (nh + nkv) hd + nh hd + 3 I
    act = 4 * 64 + 8 * 16 + 6 * 16 + 4 * 16 + 3 * 96
    assert activation_elems_per_token(c) == act == 832
    assert workspace_bytes(c, 512, 4, "numpy") == 4 * 512 * act + 4 * 4 * 320
    assert workspace_bytes(c, 512, 4, "cupy", max_packed_elems=320 * 64) == (
        4 * 512 * act + 4 * 4 * 320 + 2 * 320 * 64 + 2 * 512 * 96 + GPU_LIBRARY_BYTES)
    # buckets 1, 2, 4, 32 at 1,000 positions (63 pages of 16): split-K partitions
    # min(ceil(1000 / 32) = 32, ceil(512 / (B * 2 kv heads))) = 32, 32, 32, 8
    per_b = lambda b, sp: (4 * b * (act + 320) + 4 * b * 4 * sp * (16 + 2)
                           + 4 * (4 * b + 1 + b * 63) + 8 * b + GRAPH_FIXED_BYTES)
    assert cuda_graph_bytes(c, (1, 2, 4, 32), 1000, 16) == (
        per_b(1, 32) + per_b(2, 32) + per_b(4, 32) + per_b(32, 8))
    assert cuda_graph_bytes(c, (), 1000, 16) == 0
    # with prefill graphs of 16 and 48 tokens: each its activations, fp16 operands, one logits
    # row, static inputs, the attention's tiles (G = 2 rows a token) and the graph itself
    prefill = lambda t: (4 * t * act + 2 * t * 96 + 4 * 320 + 16 * t + 4 * (4 + 63)
                         + 8 * math.ceil(t / 8) + GRAPH_FIXED_BYTES)
    assert cuda_graph_bytes(c, (1, 2), 1000, 16, prefill_tokens=(16, 48)) == (
        per_b(1, 32) + per_b(2, 32) + prefill(16) + prefill(48))


def test_prefill_graph_lengths_double_up_to_the_chunk_or_2048():
    """A pass of T tokens replays the first captured length >= T: at most half of it padding
    (above 16), nothing above 2,048 tokens (longer passes are bound by the device)."""
    from ninfer.kernels.graph_buckets import prefill_lengths
    assert prefill_lengths(64) == (16, 32, 64)
    assert prefill_lengths(48) == (16, 32, 48)
    assert prefill_lengths(3072) == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert prefill_lengths(2048) == prefill_lengths(3072)
    assert prefill_lengths(16) == (16,) and prefill_lengths(10) == prefill_lengths(1) == ()
    for chunk in (20, 100, 777, 5000):
        ls = prefill_lengths(chunk)
        assert ls[-1] == min(chunk, 2048) and all(b == 2 * a for a, b in zip(ls[:-2], ls[1:-1]))


def test_plan_sums_the_parts_and_fails_only_past_capacity(tiny):
    model, _ = tiny
    kw = {"max_concurrency": 3, "max_context": 100, "page_size": 16, "prefill_chunk": 64}
    plan = plan_memory(model, **kw)
    pages = 3 * math.ceil(100 / 16)
    assert plan.kv_pages == pages == 21
    assert plan.kv_pool_bytes == model.new_kv_cache(pages, 16).nbytes
    assert plan.weights_bytes == weights_resident_bytes(model)[0]
    assert plan.workspace_bytes == workspace_bytes(model.config, 64, 3, "numpy")
    assert plan.cuda_graph_bytes == 0 and plan.capacity_bytes is None and not plan.enforced
    assert plan.total_bytes == (plan.weights_bytes + plan.kv_pool_bytes
                                + plan.workspace_bytes)
    plan.check()  # unknown capacity: reported, never refused

    exact = plan_memory(model, capacity_bytes=plan.total_bytes, **kw)
    assert exact.enforced and exact.deficit_bytes == 0
    exact.check()
    d = exact.to_dict()
    assert d["headroom_bytes"] == 0 and d["capacity_bytes"] == plan.total_bytes
    assert all(isinstance(d[k], int) for k in d if k.endswith("_bytes"))

    short = plan_memory(model, capacity_bytes=plan.total_bytes - 4321, **kw)
    assert short.deficit_bytes == 4321
    with pytest.raises(MemoryBudgetError) as err:
        short.check()
    msg = str(err.value)
    assert "\n" not in msg and "short by 4321 bytes" in msg
    assert f"needs {plan.total_bytes} bytes" in msg and "host memory" in msg
    assert err.value.deficit_bytes == 4321 and isinstance(err.value, ValueError)
    # a graph allowance is part of the total
    graphs = plan_memory(model, cuda_graph_buckets=(1, 2, 4), **kw)
    assert graphs.cuda_graph_bytes == cuda_graph_bytes(model.config, (1, 2, 4), 100, 16)
    assert graphs.total_bytes == plan.total_bytes + graphs.cuda_graph_bytes
    # (prefill passes of up to the chunk replayed from graphs too: lengths 16, 32 and 64)
    both = plan_memory(model, cuda_graph_buckets=(1, 2, 4), prefill_graph=True, **kw)
    assert both.cuda_graph_bytes == cuda_graph_bytes(model.config, (1, 2, 4), 100, 16,
                                                     (16, 32, 64)) > graphs.cuda_graph_bytes


def test_gpu_plan_names_the_gpu_in_its_error():
    plan = MemoryPlan("cupy", 10, 20, 30, 40, 2, 16, (1, 2), capacity_bytes=60, enforced=True)
    assert plan.total_bytes == 100 and plan.deficit_bytes == 40
    with pytest.raises(MemoryBudgetError, match="not enough GPU memory .* short by 40 bytes"):
        plan.check()


# --- the server (real SmolLM2, NumPy backend) ---------------------------------------------

@pytest.fixture(scope="module")
def smol(smollm2_gguf, backend):
    from ninfer.server import load_runtime
    return load_runtime(str(smollm2_gguf), backend)


@pytest.mark.slow
def test_server_reports_the_budget_and_refuses_a_config_that_does_not_fit(smol):
    from ninfer.config import ServeConfig
    from ninfer.server import build_server, started_event
    server = build_server(ServeConfig(max_context=2048, max_concurrency=2), smol)
    ev = started_event(server)
    m = ev.memory
    plan = plan_memory(smol.model, max_concurrency=2, max_context=2048, page_size=16,
                       prefill_chunk=512)
    assert ev.environment["backend"] == "numpy" and ev.config["backend"] == "auto"
    # --kv-dtype auto (the default): fp32 on the numpy backend
    assert ev.config["kv_dtype"] == "auto" and ev.config["kv_dtype_effective"] == "fp32"
    assert m["kv_pool_bytes"] == m["kv_cache_bytes"] == server.engine.kv.nbytes
    assert m["kv_pool_bytes"] == 2 * 128 * 16 * (2 * 30 * 3 * 64 * 4)  # SmolLM2: 30 L, 3 kv
    assert m["weights_bytes"] == plan.weights_bytes == 538_060_032     # float32 on the CPU
    assert m["total_bytes"] == plan.total_bytes
    assert m["cuda_graph_bytes"] == 0 and m["budget_enforced"] is False
    assert m["checkpoint_bytes"] == 0   # no recurrent state: no turn checkpoints
    # --prefill-chunk auto (the default) is 512 on the numpy backend, unmeasured
    if ev.environment["backend"] == "numpy":
        assert ev.config["prefill_chunk"] == "auto" and ev.config["prefill_chunk_effective"] == 512
        assert ev.config["prefill_chunk_choice"] == {"tokens": 512, "source": "default"}
    # --continuation-cache-l2-mib auto: the L2 tier's ceiling as the engine runs it
    got, how = m["l2_budget_bytes"], m["l2_budget_choice"]
    assert ev.config["continuation_cache_l2_mib"] == "auto"
    assert ev.config["continuation_cache_l2_bytes"] == got == server.engine.tiers.l2.budget_bytes
    if how == "auto: the 2048 MiB floor":   # (else this host has under 2 x 2 GiB free beside it)
        assert got == L2_MIN_BYTES > 2 * plan.kv_pool_bytes
    else:
        assert how == "auto: half the available host memory" and 64 * MIB <= got < L2_MIN_BYTES
    # (the default tiers are l1-l2: a given ceiling is MiB)
    given = build_server(ServeConfig(max_context=2048, continuation_cache_l2_mib=64), smol)
    assert given.engine.tiers.l2.budget_bytes == 64 * MIB
    assert started_event(given).memory["l2_budget_choice"] == "given"
    # the same configuration with an injected capacity 1 MiB short of it
    cap = plan.total_bytes - (1 << 20)
    with pytest.raises(MemoryBudgetError) as err:
        build_server(ServeConfig(max_context=2048, max_concurrency=2,
                                 memory_capacity_bytes=cap), smol)
    assert err.value.deficit_bytes == 1 << 20
    assert err.value.plan.total_bytes == plan.total_bytes


def _plan(kv_pool: int, total: int, backend: str = "cupy") -> MemoryPlan:
    return MemoryPlan(backend=backend, weights_bytes=total - kv_pool, kv_pool_bytes=kv_pool,
                      workspace_bytes=0, cuda_graph_bytes=0, kv_pages=1, kv_page_size=16)


def test_the_auto_l2_ceiling_is_twice_the_kv_pool_within_half_the_free_host_memory():
    gib = 1 << 30
    # the 27B hybrid, 2 lanes x 64K of fp32 KV (17.3 GiB pool) on a host with 100 GiB free
    pool = 18_567_397_376
    assert l2_budget_bytes("auto", _plan(pool, 37 * gib), 100 * gib) == \
        (2 * pool, "auto: 2 x the KV pool")
    # a small pool keeps the floor; host memory unknown: not capped
    assert l2_budget_bytes("auto", _plan(10 * MIB, gib), 100 * gib) == \
        (L2_MIN_BYTES, "auto: the 2048 MiB floor")
    assert l2_budget_bytes("auto", _plan(40 * gib, 50 * gib), None)[0] == 80 * gib
    # capped at half the available memory; on a host backend the plan's own total is not
    # free yet (its KV pool is allocated after this)
    assert l2_budget_bytes("auto", _plan(40 * gib, 50 * gib), 64 * gib) == \
        (32 * gib, "auto: half the available host memory")
    assert l2_budget_bytes("auto", _plan(4 * gib, 10 * gib, "numpy"), 14 * gib)[0] == 2 * gib
    assert l2_budget_bytes("auto", _plan(4 * gib, 10 * gib, "numpy"), 9 * gib)[0] == 64 * MIB
    assert l2_budget_bytes(300, _plan(40 * gib, 50 * gib), 1) == (300 * MIB, "given")


def test_gpu_workspace_of_a_hybrid_model_holds_one_gdn_layers_chunked_delta_rule_scratch():
    """Qwen3.5-27B (48 value heads of dk = dv = 128): the cupy workspace adds, per 64-token
    chunk and value head, (dk + dv + 65) * 64 float32 (gpu/gdn_chunk.py), one layer's
    at a time; the NumPy backend's workspace has none."""
    import json
    from pathlib import Path

    from ninfer.engine.memory import gdn_chunk_workspace_bytes
    from ninfer.engine.models.qwen35 import Qwen35Config
    shape = Path(__file__).parents[2] / "bench" / "shapes" / "qwen35-27b.json"
    c = Qwen35Config.from_dict(json.loads(shape.read_text()))
    h, inter, v, hv, dk, dv = 5120, 17408, 248320, 48, 128, 128
    per_chunk = 4 * hv * (dk + dv + 65) * 64
    assert per_chunk == 3_944_448   # about 60 KiB a token
    packed = v * h
    for tokens in (512, 1000, 8192):
        chunks = math.ceil(tokens / 64)
        assert gdn_chunk_workspace_bytes(c, tokens) == chunks * per_chunk
        before = (4 * tokens * activation_elems_per_token(c) + 4 * 4 * v + 2 * packed
                  + 2 * tokens * max(h, inter) + GPU_LIBRARY_BYTES)
        assert workspace_bytes(c, tokens, 4, "cupy", packed) - before == chunks * per_chunk
        assert workspace_bytes(c, tokens, 4, "numpy") == \
            4 * tokens * activation_elems_per_token(c) + 4 * 4 * v
    # a Llama-family model has no GDN layers: no such scratch
    assert gdn_chunk_workspace_bytes(LlamaConfig.from_dict(TINY), 512) == 0

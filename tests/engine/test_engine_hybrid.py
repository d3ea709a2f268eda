"""The engine serving a Qwen3.5 hybrid (GDN + attention) model: per-lane recurrent state slots
beside the paged KV, reset on admission; batching, chunked prefill and lane reuse never change
greedy tokens. Tiny random checkpoint built with transformers, imported with our converter."""
from __future__ import annotations

import numpy as np
import pytest

from ninfer.engine.engine import Engine, EngineConfig, FinalOutput, Request, TokenOutput
from ninfer.engine.sampling import SamplingParams
from ninfer.events.bus import EventBus
from test_qwen35_vs_transformers import (  # same folder
    byte_level_tokenizer, make_checkpoint)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, backend):
    from ninfer.engine.models import load_model
    from ninfer.kernels import get_ops
    from ninfer.store.artifact import load_model_file
    folder = tmp_path_factory.mktemp("hybrid")
    make_checkpoint(folder, "l4_gqa2_hv2x", seed=3)
    model = load_model(load_model_file(folder), get_ops(backend))
    tok = byte_level_tokenizer()
    return model, tok


def run(hybrid, prompts, max_tokens=20, **cfg):
    """Greedy tokens of ``prompts`` served by an engine; on a GPU backend its decode rounds
    replay the CUDA graphs ``ninfer serve`` captures (``server.decode_model``)."""
    from ninfer.server import decode_model
    model, tok = hybrid
    ecfg = EngineConfig(max_context=512, **cfg)
    served, graphs = decode_model(model, ecfg)
    engine = Engine(served, tok, EventBus(), ecfg)
    if graphs is not None:
        graphs.capture_all(engine.kv)
    outs = []
    for i, p in enumerate(prompts):
        outs.append([])
        engine.submit(Request(f"r{i}", p, SamplingParams(temperature=0.0), max_tokens,
                              outs[-1].append, ignore_eos=True))
    while engine.step():
        pass
    assert engine.idle()
    engine.check_integrity()
    assert all(isinstance(o[-1], FinalOutput) for o in outs)
    assert graphs is None or graphs.replays > 0
    return [[t.token_id for t in o if isinstance(t, TokenOutput)] for o in outs]


def reference_greedy(hybrid, prompt, n):
    """Greedy tokens from the model directly (one state slot, pages 0..), no engine."""
    from ninfer.engine.models.llama import ForwardBatch
    model, _ = hybrid
    kv = model.new_kv_cache(64, 16, max_lanes=1)
    kv.reset_state(0)
    table = list(range(64))
    ids, out = list(prompt), []
    batch = ForwardBatch.from_sequences([ids], [0], [table], 16, state_slots=[0])
    for _ in range(n):
        logits = model.forward(batch, kv)
        t = int(np.argmax(model.ops.to_numpy(logits)[0]))
        out.append(t)
        batch = ForwardBatch.from_sequences([[t]], [len(ids)], [table], 16, state_slots=[0])
        ids.append(t)
    return out


def test_engine_batches_hybrid_lanes_exactly(hybrid):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (37, 90, 5)]
    batched = run(hybrid, prompts, max_concurrency=3)
    for p, got in zip(prompts, batched):
        assert got == reference_greedy(hybrid, p, 20)
    chunked = run(hybrid, prompts, max_concurrency=3, prefill_chunk=7)
    assert chunked == batched
    # one lane serving the three requests one after another: state is reset on admission
    assert run(hybrid, prompts, max_concurrency=1) == batched


def test_reasoning_budget_closes_the_thinking_block(hybrid):
    model, tok = hybrid
    think_end = 300
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 256, 20).tolist()

    def go(budget, max_tokens=16):
        engine = Engine(model, tok, EventBus(), EngineConfig(max_context=512))
        out = []
        engine.submit(Request("t", prompt, SamplingParams(temperature=0.0), max_tokens,
                              out.append, ignore_eos=True, think_budget=budget,
                              think_end_id=think_end))
        while engine.step():
            pass
        return out

    free = go(None)  # what the model does unconstrained
    ids = [o.token_id for o in free if isinstance(o, TokenOutput)]
    assert think_end not in ids[:5]
    out = go(5)
    toks = [o for o in out if isinstance(o, TokenOutput)]
    # five reasoning tokens exactly as the model chose them, then the forced </think>
    assert [t.token_id for t in toks[:5]] == ids[:5]
    assert all(t.reasoning for t in toks[:6]) and toks[5].token_id == think_end
    assert not any(t.reasoning for t in toks[6:])
    assert len(toks) == 16 and isinstance(out[-1], FinalOutput)
    assert not out[-1].text_is_reasoning
    reasoning = "".join(t.text for t in toks if t.reasoning)
    assert reasoning == tok.decode(ids[:5], skip_special=True).rstrip("\ufffd")
    # a budget larger than the output: everything is reasoning, the block never closes
    long = go(100, max_tokens=8)
    assert all(t.reasoning for t in long if isinstance(t, TokenOutput))
    assert long[-1].text_is_reasoning

"""``ninfer bench decode``'s cached context is prefilled in passes, as the engine prefills: one
pass of a long ``--context`` held its whole attention score matrix (an out-of-memory traceback
at 100,000 tokens on the CPU)."""
from __future__ import annotations

import dataclasses

import numpy as np

from ninfer.bench import decode
from ninfer.bench.model import PAGE_SIZE, load, pages


def test_the_context_is_prefilled_in_passes_with_a_one_pass_first_token(smollm2_gguf):
    context = 2 * decode.CONTEXT_PASS + 37
    bm = load(str(smollm2_gguf), "numpy", max_positions=context + 16, max_batch=1)
    passes: list[int] = []
    forward = bm.model.forward

    class Counting:   # the model, counting the tokens of each forward pass
        def forward(self, batch, kv, *a, **kw):
            passes.append(len(batch.token_ids))
            return forward(batch, kv, *a, **kw)

    run = decode.run_lanes(dataclasses.replace(bm, model=Counting()),
                           bm.new_kv(1, context + 16), 1, context, steps=1)
    assert passes[:3] == [decode.CONTEXT_PASS, decode.CONTEXT_PASS, 37]
    assert passes[3:] == [1] * (1 + decode.WARMUP)   # then one token a step

    # the first token is the one a single pass over the same context gives
    from ninfer.engine.models.llama import ForwardBatch
    prompt = np.random.default_rng(0).integers(0, bm.config.vocab_size, size=context).tolist()
    kv = bm.new_kv(1, context + 16)
    one = bm.argmax(forward(ForwardBatch.from_sequences(
        [prompt], [0], [list(range(pages(context + 16)))], PAGE_SIZE, None), kv))
    assert run.tokens[0] == one[0]

"""The execution engine driven by hand (``step()``) and as a thread, on the real SmolLM2."""
from __future__ import annotations

import threading

import numpy as np

import pytest

from ninfer.engine.engine import (Engine, EngineConfig, ErrorOutput, FinalOutput, Request,
                                  TokenOutput)
from ninfer.engine.sampling import SamplingParams
from ninfer.events.bus import EventBus

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a haiku about autumn.",
           "List three prime numbers.", "Explain what a CPU does in one sentence."]


@pytest.fixture(scope="module")
def runtime(smollm2_gguf, backend):
    from ninfer.server import load_runtime
    return load_runtime(str(smollm2_gguf), backend)


class Records:
    name = "records"

    def __init__(self):
        self.items = []

    def write(self, record, line):
        self.items.append(record)

    def kinds(self, kind):
        return [r.event for r in self.items if r.kind == kind]


def _ids(rt, text):
    return rt.tokenizer.encode(rt.template.render([{"role": "user", "content": text}],
                                                  add_generation_prompt=True))


def run_all(rt, prompts, params, max_tokens=24, **cfg):
    """Submit every prompt at once, step until done; returns (outputs per request, records)."""
    bus = EventBus()
    rec = Records()
    bus.add_sink(rec)
    engine = Engine(rt.model, rt.tokenizer, bus, EngineConfig(max_context=1024, **cfg))
    outs = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        outs[i] = []
        engine.submit(Request(f"r{i}", _ids(rt, p), sp, max_tokens, outs[i].append))
    while engine.step():
        bus.flush()
    bus.flush()
    assert engine.idle()
    engine.check_integrity()  # every page is free or held by an idle lane's retained prefix
    return outs, rec


def _tokens(items):
    return [o.token_id for o in items if isinstance(o, TokenOutput)]


def _text(items):
    return "".join(o.text for o in items if isinstance(o, (TokenOutput, FinalOutput)))


def test_batched_greedy_equals_alone_and_rounds_batch_every_ready_lane(runtime):
    greedy = [SamplingParams(temperature=0.0)] * 4
    batched, rec = run_all(runtime, PROMPTS, greedy, max_concurrency=4)
    for i, p in enumerate(PROMPTS):
        alone, _ = run_all(runtime, [p], greedy[:1], max_concurrency=1)
        assert _tokens(batched[i]) == _tokens(alone[0])
        assert _text(batched[i]) == _text(alone[0])
    widths = [len(r.lanes) for r in rec.kinds("scheduler.round")]
    assert max(widths) == 4  # a decode round covered every decode-ready lane
    assert "Paris" in _text(batched[0])


def test_chunked_prefill_gives_the_same_tokens(runtime):
    greedy = [SamplingParams(temperature=0.0)] * 2
    whole, _ = run_all(runtime, PROMPTS[:2], greedy, max_concurrency=2, prefill_chunk=512)
    chunked, rec = run_all(runtime, PROMPTS[:2], greedy, max_concurrency=2, prefill_chunk=7)
    assert [_tokens(chunked[i]) for i in range(2)] == [_tokens(whole[i]) for i in range(2)]
    chunks = [c for c in rec.kinds("request.prefill_chunk") if c.request_id == "r0"]
    n = len(_ids(runtime, PROMPTS[0]))
    assert [c.tokens for c in chunks] == [7] * (n // 7) + ([n % 7] if n % 7 else [])
    assert chunks[-1].done_tokens == n


def test_seeded_sampling_is_independent_of_batch_composition(runtime):
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=4242)
    others = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]
    alone, _ = run_all(runtime, PROMPTS[:1], [sp], max_concurrency=1, max_tokens=32)
    batched, _ = run_all(runtime, PROMPTS, [sp] + others, max_concurrency=4, max_tokens=32)
    assert _tokens(batched[0]) == _tokens(alone[0])
    again, _ = run_all(runtime, PROMPTS[:1], [sp], max_concurrency=1, max_tokens=32)
    assert _tokens(again[0]) == _tokens(alone[0])
    different, _ = run_all(runtime, PROMPTS[:1], [SamplingParams(temperature=0.9, top_p=0.95,
                                                                 top_k=50, seed=4243)],
                           max_concurrency=1, max_tokens=32)
    assert _tokens(different[0]) != _tokens(alone[0])


def test_more_requests_than_lanes_wait_and_all_finish(runtime):
    prompts = PROMPTS * 2
    outs, rec = run_all(runtime, prompts, [SamplingParams(temperature=0.0)] * 8,
                        max_concurrency=3, max_tokens=8)
    finals = [o for items in outs.values() for o in items if isinstance(o, FinalOutput)]
    assert len(finals) == 8
    assert {f.lane for f in finals} <= {0, 1, 2}
    assert max(len(r.lanes) for r in rec.kinds("scheduler.round")) == 3
    assert len(rec.kinds("request.finished")) == 8
    # identical prompts give identical greedy outputs whichever lane they ran in
    assert _tokens(outs[0]) == _tokens(outs[4])


def test_stop_string_never_leaks_and_max_tokens_limits(runtime):
    greedy = SamplingParams(temperature=0.0)
    full, _ = run_all(runtime, PROMPTS[:1], [greedy], max_concurrency=1)
    text = _text(full[0])
    assert "Paris" in text
    stop = text[text.index("Paris"):text.index("Paris") + 4]  # "Pari": spans tokens
    bus = EventBus()
    engine = Engine(runtime.model, runtime.tokenizer, bus, EngineConfig(max_context=1024))
    items = []
    # the final output names the stop string that matched
    engine.submit(Request("s", _ids(runtime, PROMPTS[0]), greedy, 24, items.append,
                          stop=("never-in-the-text", stop)))
    while engine.step():
        pass
    assert _text(items) == text[:text.index(stop)]
    assert items[-1].engine_reason == "stop_string" and items[-1].finish_reason == "stop"
    assert items[-1].stop_string == stop
    limited, _ = run_all(runtime, PROMPTS[:1], [greedy], max_concurrency=1, max_tokens=3)
    assert limited[0][-1].engine_reason == "output_limit"
    assert limited[0][-1].completion_tokens == 3 == len(_tokens(limited[0]))


@pytest.mark.parametrize("reuse", [False, True])
def test_cancel_frees_the_lane_and_pages(runtime, reuse):
    bus = EventBus()
    rec = Records()
    bus.add_sink(rec)
    engine = Engine(runtime.model, runtime.tokenizer, bus, EngineConfig(
        max_context=1024, max_concurrency=2, prefix_reuse=reuse))
    items = []
    engine.submit(Request("c", _ids(runtime, PROMPTS[1]), SamplingParams(temperature=0.0), 100,
                          items.append))
    for _ in range(5):
        engine.step()
    assert engine.pool.num_free < engine.config.num_pages
    engine.cancel("c")
    engine.step()
    bus.flush()
    assert engine.idle()
    engine.check_integrity()
    lane = engine.lanes[0]
    if reuse:  # the lane keeps exactly the positions it computed, for the next request
        assert lane.retained and lane.num_computed == len(lane.tokens) > 0
        assert len(lane.pages) == -(-lane.num_computed // engine.config.page_size)
        assert rec.kinds("lane.retained")[0].tokens == lane.num_computed
    else:
        assert engine.pool.num_free == engine.config.num_pages and not lane.retained
    cancelled = rec.kinds("request.cancelled")
    assert len(cancelled) == 1 and cancelled[0].completion_tokens == len(_tokens(items))
    assert not any(isinstance(o, (FinalOutput, ErrorOutput)) for o in items)


def test_thread_mode_delivers_without_trio(runtime):
    bus = EventBus()
    engine = Engine(runtime.model, runtime.tokenizer, bus, EngineConfig(max_context=1024))
    done = threading.Event()
    items = []

    def deliver(item):
        items.append(item)
        if isinstance(item, (FinalOutput, ErrorOutput)):
            done.set()

    engine.start()
    try:
        engine.submit(Request("t", _ids(runtime, PROMPTS[0]), SamplingParams(temperature=0.0),
                              12, deliver))
        assert done.wait(120)
    finally:
        engine.stop()
    assert isinstance(items[-1], FinalOutput)


class _CountingModel:
    """The model with a count of forward passes (everything else delegated)."""

    def __init__(self, model):
        self._model, self.forwards = model, 0

    def forward(self, *args, **kw):
        self.forwards += 1
        return self._model.forward(*args, **kw)

    def __getattr__(self, name):
        return getattr(self._model, name)


class _ImmediateToken:
    """A stand-in trio token that runs callbacks at once (on the calling thread)."""

    def run_sync_soon(self, fn, *args, idempotent=False):
        fn(*args)


def test_deferred_delivery_hands_a_round_over_after_the_next_launch_in_order(runtime):
    """With deferral on (the GPU server's mode), a decode round's outputs reach the requester
    right after the next forward is launched, the last ones when the engine goes idle; the
    tokens, their order and the final output are those of the undeferred engine."""
    model = _CountingModel(runtime.model)
    engine = Engine(model, runtime.tokenizer, EventBus(), EngineConfig(max_context=1024,
                                                                       max_concurrency=1))
    engine.outbox.trio_token, engine.outbox.defer = _ImmediateToken(), True
    log = []
    engine.submit(Request("d", _ids(runtime, PROMPTS[0]), SamplingParams(temperature=0.0), 6,
                          lambda item: log.append((model.forwards, item))))
    while engine.step():
        pass
    assert not engine.outbox.pending
    toks = [(n, o) for n, o in log if isinstance(o, TokenOutput)]
    assert [n for n, _ in toks] == [1, 3, 4, 5, 6, 6]  # prefill at once, decode one launch late
    assert isinstance(log[-1][1], FinalOutput) and log[-1][0] == 6
    plain, _ = run_all(runtime, PROMPTS[:1], [SamplingParams(temperature=0.0)], max_tokens=6,
                       max_concurrency=1)
    assert [o for _, o in toks] == [o for o in plain[0] if isinstance(o, TokenOutput)]
    assert _text([o for _, o in log]) == _text(plain[0])


def _run_requests(rt, reqs, model=None, **cfg):
    """Submit ``reqs`` ((prompt, max_tokens, extra Request kwargs) each, greedy), step until
    done; returns (outputs per request, records, engine)."""
    bus = EventBus()
    rec = Records()
    bus.add_sink(rec)
    engine = Engine(model or rt.model, rt.tokenizer, bus, EngineConfig(max_context=1024, **cfg))
    outs = {}
    for i, (p, n, kw) in enumerate(reqs):
        outs[i] = []
        engine.submit(Request(f"r{i}", _ids(rt, p), SamplingParams(temperature=0.0), n,
                              outs[i].append, **kw))
    while engine.step():
        bus.flush()
    bus.flush()
    assert engine.idle() and engine.decoder.ahead is None
    engine.check_integrity()
    return outs, rec, engine


def _summary(items):
    final = items[-1]
    return (_tokens(items), _text(items), type(final).__name__,
            getattr(final, "engine_reason", None), getattr(final, "completion_tokens", None))


def test_decode_lookahead_gives_the_outputs_and_retained_prefixes_of_plain_rounds(runtime):
    """A round launched ahead, its tokens fed from the round before: lanes that end at
    different rounds (output limits, a stop string, the end-of-text token), and a reasoning
    budget whose forced closing token is not the one the round ahead was fed (that round is
    dropped for the lane and recomputed), give the tokens, texts and finish reasons of the
    engine without lookahead, and every lane retains the same prefix."""
    full, _, _ = _run_requests(runtime, [(PROMPTS[0], 24, {})], decode_lookahead="off")
    text = _text(full[0])
    stop = text[text.index("Paris"):text.index("Paris") + 4]
    reqs = [(PROMPTS[0], 24, {"stop": (stop,)}), (PROMPTS[1], 5, {}), (PROMPTS[2], 200, {}),
            (PROMPTS[3], 12, {"think_budget": 3, "think_end_id": 28})]
    off, rec_off, e_off = _run_requests(runtime, reqs, max_concurrency=4,
                                        decode_lookahead="off")
    on, rec_on, e_on = _run_requests(runtime, reqs, max_concurrency=4, decode_lookahead="on")
    assert e_on.lookahead and not e_off.lookahead
    for i in range(len(reqs)):
        assert _summary(on[i]) == _summary(off[i])
    assert on[0][-1].engine_reason == "stop_string"
    assert on[1][-1].engine_reason == "output_limit"
    assert on[2][-1].engine_reason == "stop_token"   # ended by the model, before 200 tokens
    assert [o.token_id for o in on[3] if isinstance(o, TokenOutput)][3] == 28
    for a, b in zip(e_on.lanes, e_off.lanes):
        assert (a.num_computed, a.tokens, len(a.pages)) == (b.num_computed, b.tokens,
                                                             len(b.pages))
    # every round committed once, with the lanes it was right for (none empty)
    widths = [len(r.lanes) for r in rec_on.kinds("scheduler.round")]
    assert min(widths) >= 1 and sum(widths) == sum(
        len(r.lanes) for r in rec_off.kinds("scheduler.round"))


def test_decode_lookahead_launches_the_next_round_before_reading_tokens(runtime):
    """With the lookahead each decode token reaches the requester after the round after it
    was launched (the forward count at delivery is one ahead of the plain engine's), and the
    tokens are the same."""
    model = _CountingModel(runtime.model)
    log = []
    engine = Engine(model, runtime.tokenizer, EventBus(), EngineConfig(
        max_context=1024, max_concurrency=1, decode_lookahead="on"))
    engine.submit(Request("d", _ids(runtime, PROMPTS[0]), SamplingParams(temperature=0.0), 6,
                          lambda item: log.append((model.forwards, item))))
    while engine.step():
        pass
    toks = [(n, o) for n, o in log if isinstance(o, TokenOutput)]
    # prefill (1) gives token 1; decode round k is launched with round k + 1 behind it
    assert [n for n, _ in toks] == [1, 3, 4, 5, 6, 7]
    plain, _ = run_all(runtime, PROMPTS[:1], [SamplingParams(temperature=0.0)], max_tokens=6,
                       max_concurrency=1)
    assert [o for _, o in toks] == [o for o in plain[0] if isinstance(o, TokenOutput)]
    engine.check_integrity()


def test_decode_lookahead_cancel_and_a_sampled_lane(runtime):
    """A cancel that arrives while a round is ahead: the round is committed first, the lane
    keeps exactly the positions it computed; a sampling lane beside greedy ones turns the
    lookahead off for the rounds it is in (its tokens as without lookahead)."""
    bus = EventBus()
    rec = Records()
    bus.add_sink(rec)
    engine = Engine(runtime.model, runtime.tokenizer, bus, EngineConfig(
        max_context=1024, max_concurrency=2, decode_lookahead="on"))
    items = []
    engine.submit(Request("c", _ids(runtime, PROMPTS[1]), SamplingParams(temperature=0.0), 100,
                          items.append))
    for _ in range(5):
        engine.step()
    assert engine.decoder.ahead is not None
    engine.cancel("c")
    engine.step()
    bus.flush()
    assert engine.idle() and engine.decoder.ahead is None
    engine.check_integrity()
    lane = engine.lanes[0]
    assert lane.retained and lane.num_computed == len(lane.tokens)
    assert len(lane.pages) == -(-lane.num_computed // engine.config.page_size)
    cancelled = rec.kinds("request.cancelled")
    assert cancelled[0].completion_tokens == len(_tokens(items))
    sp = SamplingParams(temperature=0.9, seed=7)
    greedy = SamplingParams(temperature=0.0)
    off, _ = run_all(runtime, PROMPTS[:2], [sp, greedy], max_concurrency=2, max_tokens=10,
                     decode_lookahead="off")
    on, _ = run_all(runtime, PROMPTS[:2], [sp, greedy], max_concurrency=2, max_tokens=10,
                    decode_lookahead="on")
    assert [_tokens(on[i]) for i in range(2)] == [_tokens(off[i]) for i in range(2)]


class _BucketModel:
    """``CudaGraphDecoder``'s ``greedy`` contract on the CPU: every pure decode pass of S
    sequences (``forward`` or ``greedy``) runs in bucket S, and ends with its greedy ids written
    into the bucket's token input; ``greedy(feed=True)`` decodes those and is refused where the
    bucket's last pass was a plain ``forward`` (whose ids the engine never asked for)."""

    enabled = True

    def __init__(self, model):
        self._model, self._buckets, self.feeds = model, {}, 0

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward(self, batch, kv, all_logits=False):
        logits = self._model.forward(batch, kv, all_logits)
        if not all_logits and batch.num_tokens == batch.num_seqs:
            self._buckets[batch.num_seqs] = (np.argmax(logits, axis=-1), False)
        return logits

    def greedy(self, batch, kv, feed=False):
        if feed:
            ids, fed = self._buckets.get(batch.num_seqs, (None, False))
            if not fed:
                raise ValueError("greedy(feed=True): the bucket's last pass chose no tokens")
            batch.token_ids[:] = ids
            self.feeds += 1
        ids = np.argmax(self._model.forward(batch, kv), axis=-1)
        self._buckets[batch.num_seqs] = (ids, True)
        return lambda: ids.astype(np.int64)


def test_decode_lookahead_with_one_token_prefills_and_a_lane_reassigned(runtime):
    """On a model with ``greedy`` (the decode lookahead's "auto"): short requests whose prompts
    the lanes already hold (one-token prefills, which replay a decode bucket) arrive while a
    lane decodes with a round ahead; then that lane's request is cancelled and the same lane
    re-admitted for a new request. Every request gets the tokens it gets alone, and the
    round ahead was really used."""
    long_p, ping = _ids(runtime, PROMPTS[1]), _ids(runtime, PROMPTS[2])
    greedy = SamplingParams(temperature=0.0)

    def alone(prompt, n):
        bus = EventBus()
        engine = Engine(runtime.model, runtime.tokenizer, bus, EngineConfig(
            max_context=1024, max_concurrency=1, decode_lookahead="off"))
        items = []
        engine.submit(Request("x", prompt, greedy, n, items.append))
        while engine.step():
            pass
        return _tokens(items)

    model = _BucketModel(runtime.model)
    engine = Engine(model, runtime.tokenizer, EventBus(), EngineConfig(
        max_context=1024, max_concurrency=2))
    assert engine.lookahead
    outs = {k: [] for k in ("A", "H1", "H2", "H3", "B")}
    engine.submit(Request("A", long_p, greedy, 60, outs["A"].append))
    for _ in range(3):
        engine.step()
    for i, name in enumerate(("H1", "H2", "H3")):
        engine.submit(Request(name, ping, greedy, 1, outs[name].append))
        for _ in range(4 - i):
            engine.step()
    assert engine.decoder.ahead is not None
    engine.cancel("A")
    engine.submit(Request("B", long_p, greedy, 12, outs["B"].append))
    while engine.step():
        pass
    engine.check_integrity()
    assert model.feeds > 5
    assert _tokens(outs["B"]) == alone(long_p, 12)
    first = alone(ping, 1)
    assert all(_tokens(outs[h]) == first for h in ("H1", "H2", "H3"))
    a = _tokens(outs["A"])
    assert 0 < len(a) < 60 and a == alone(long_p, 60)[:len(a)]

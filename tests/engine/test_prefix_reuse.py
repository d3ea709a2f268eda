"""Prefix reuse (L1: idle lanes keep their computed prefix) on the real SmolLM2 and on a tiny
Qwen3.5 hybrid, with and without MTP speculation: what is reused, which lane is chosen, and that
the output equals a cold prefill's (greedy tokens) every time."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from ninfer.engine.engine import (Engine, EngineConfig, FinalOutput, Request, SlotCommand,
                                  TokenOutput, session_digest)
from ninfer.engine.continuation import kv_image_bytes
from ninfer.engine.sampling import SamplingParams
from ninfer.events.bus import EventBus
from test_engine import Records  # same folder
from test_engine_spec import mtp_bundle  # noqa: F401  (the fixture, same folder)

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def runtime(smollm2_gguf, backend):
    from ninfer.server import load_runtime
    return load_runtime(str(smollm2_gguf), backend)


class Driver:
    """An engine driven by hand; ``ask`` serves one request to completion."""

    def __init__(self, model, tok, **cfg):
        self.bus = EventBus()
        self.rec = Records()
        self.bus.add_sink(self.rec)
        from ninfer.server import decode_model   # (on the GPU: the CUDA graphs serve runs)
        # a hybrid lane's frontier is exact only without the lookahead (its round ahead keeps
        # one more position: test_hybrid_lookahead_keeps_the_position_its_round_ahead_computed)
        base = {"max_context": 1024} | ({"decode_lookahead": "off"} if model.is_recurrent else {})
        config = EngineConfig(**(base | cfg))
        self.engine = Engine(decode_model(model, config)[0], tok, self.bus, config)
        self.n = 0

    def submit(self, prompt, max_tokens=12, params=GREEDY, **kw):
        out = []
        rid = f"r{self.n}"
        self.n += 1
        self.engine.submit(Request(rid, list(prompt), params, max_tokens, out.append, **kw))
        return rid, out

    def run(self):
        while self.engine.step():
            self.bus.flush()
        self.bus.flush()
        assert self.engine.idle()
        self.engine.check_integrity()

    def ask(self, prompt, **kw):
        rid, out = self.submit(prompt, **kw)
        self.run()
        assert isinstance(out[-1], FinalOutput), out[-1]
        return rid, out

    def lookup(self, rid):
        (e,) = [e for e in self.rec.kinds("cache.lookup") if e.request_id == rid]
        return e

    def prefilled(self, rid):
        return sum(e.tokens for e in self.rec.kinds("request.prefill_chunk")
                   if e.request_id == rid)

    def slot(self, action: str, lane: int, **kw):
        """A slot command (save / restore / erase) run by the next step; its result."""
        from ninfer.engine.engine import SlotCommand
        got = []
        self.engine.slot_command(SlotCommand(action, lane, got.append, **kw))
        self.engine.step()
        self.bus.flush()
        self.engine.check_integrity()
        (res,) = got
        return res


def _ids(out):
    return [o.token_id for o in out if isinstance(o, TokenOutput)]


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _chat(rt, messages):
    return rt.tokenizer.encode(rt.template.render(messages, add_generation_prompt=True))


def _cold(model, tok, prompt, spec="none", **kw):
    d = Driver(model, tok, prefix_reuse=False, spec=spec)
    rid, out = d.ask(prompt, **kw)
    assert d.lookup(rid).path == "disabled" and d.lookup(rid).cached_tokens == 0
    return _ids(out)


# --- attention-only (SmolLM2): the longest common prefix ---------------------------------------

def test_a_second_turn_reuses_the_first_and_decodes_as_a_cold_prefill(runtime):
    rt = runtime
    m1 = [{"role": "user", "content": "What is the capital of France?"}]
    p1 = _chat(rt, m1)
    d = Driver(rt.model, rt.tokenizer, max_concurrency=2)
    r1, o1 = d.ask(p1, max_tokens=40)
    assert d.lookup(r1).path == "full_reset" and d.lookup(r1).candidates == 0
    lane = d.engine.lanes[o1[-1].lane]
    # the last sampled token (here the end-of-turn token, never delivered) was not fed back
    assert o1[-1].engine_reason == "stop_token"
    frontier = p1 + _ids(o1)
    assert lane.retained and lane.tokens == frontier and lane.num_computed == len(frontier)
    (kept,) = d.rec.kinds("lane.retained")
    assert kept.tokens == len(frontier) and kept.session_digest == session_digest(frontier)

    text = "".join(o.text for o in o1)
    m2 = m1 + [{"role": "assistant", "content": text},
               {"role": "user", "content": "And the capital of Germany?"}]
    p2 = _chat(rt, m2)
    r2, o2 = d.ask(p2, max_tokens=16)
    expect = _common(frontier, p2[:-1])
    assert expect > len(p1)  # the whole first turn and (most of) the answer are reused
    lk = d.lookup(r2)
    assert lk.cached_tokens == expect and lk.source == "l1" and lk.lane == lane.id
    assert lk.path == ("append_frontier" if expect == len(frontier) else "truncate_frontier")
    assert d.prefilled(r2) == len(p2) - expect
    assert o2[-1].cached_tokens == expect and o2[-1].prompt_tokens == len(p2)
    admitted = [e for e in d.rec.kinds("request.admitted") if e.request_id == r2]
    assert admitted[0].cached_tokens == expect
    fin = [e for e in d.rec.kinds("request.finished") if e.request_id == r2]
    assert fin[0].cached_tokens == expect
    assert _ids(o2) == _cold(rt.model, rt.tokenizer, p2, max_tokens=16)


def test_a_diverging_prompt_truncates_to_the_common_prefix(runtime):
    rt = runtime
    p1 = _chat(rt, [{"role": "user", "content": "Write a haiku about autumn leaves."}])
    p2 = _chat(rt, [{"role": "user", "content": "Write a haiku about winter snow."}])
    d = Driver(rt.model, rt.tokenizer, max_concurrency=1)
    d.ask(p1, max_tokens=8)
    n1 = d.engine.lanes[0].num_computed
    r2, o2 = d.ask(p2, max_tokens=12)
    common = _common(p1, p2)
    lk = d.lookup(r2)
    assert lk.path == "truncate_frontier" and lk.cached_tokens == common > 0
    assert lk.shared_tokens == common    # attention-only: all of what was shared is reused
    (cut,) = [e for e in d.rec.kinds("lane.evicted")]
    assert cut.reason == "truncated" and cut.tokens == n1 - common
    assert d.prefilled(r2) == len(p2) - common
    assert _ids(o2) == _cold(rt.model, rt.tokenizer, p2, max_tokens=12)
    # the same prompt again: everything but its last token is reused, same tokens again
    r3, o3 = d.ask(p2, max_tokens=12)
    assert d.lookup(r3).cached_tokens == len(p2) - 1 and d.prefilled(r3) == 1
    assert d.lookup(r3).shared_tokens == len(p2)   # the lane held the whole prompt
    assert _ids(o3) == _ids(o2)


def test_a_short_shared_header_takes_an_empty_lane_not_a_deep_session(runtime):
    rt = runtime
    deep = _chat(rt, [{"role": "user", "content": "Tell me about the history of the Roman "
                                                  "Empire, in detail, from its founding."}])
    other = _chat(rt, [{"role": "user", "content": "Hi"}])
    d = Driver(rt.model, rt.tokenizer, max_concurrency=2)
    r1, o1 = d.ask(deep, max_tokens=30)
    a = o1[-1].lane
    r2, o2 = d.ask(other, max_tokens=4)
    # reusing the shared system header would destroy far more than it saves
    assert o2[-1].lane != a and d.lookup(r2).path == "full_reset"
    assert d.lookup(r2).candidates == 1
    assert d.engine.lanes[a].num_computed == len(deep) + 29
    # with one lane only, the header is reused and the session cut back to it
    d1 = Driver(rt.model, rt.tokenizer, max_concurrency=1)
    d1.ask(deep, max_tokens=30)
    r, o = d1.ask(other, max_tokens=4)
    assert d1.lookup(r).cached_tokens == _common(deep, other) > 0
    assert _ids(o) == _ids(o2)


def test_sessions_sharing_a_long_system_prompt_keep_their_own_lanes(runtime):
    """Two agents with one long system prompt and short turns: while lanes are empty, neither
    cuts the other's session back to the shared prompt (each turn reuses its whole history)."""
    rt = runtime
    rng = np.random.default_rng(9)
    system = rng.integers(100, 20000, 200).tolist()
    d = Driver(rt.model, rt.tokenizer, max_concurrency=4)
    hist = {"A": list(system), "B": list(system)}
    lane_of = {}
    for turn in range(3):
        for user in "AB":
            p = hist[user] + rng.integers(100, 20000, 40).tolist()
            rid, out = d.ask(p, max_tokens=4, ignore_eos=True)
            lk = d.lookup(rid)
            if turn == 0:
                # A: nothing retained yet; B: A's session shares only the system prompt
                assert lk.cached_tokens == 0 and lk.path == "full_reset"
            else:
                assert lk.lane == lane_of[user] and lk.path == "append_frontier"
                assert lk.cached_tokens == len(hist[user]) - 1  # the last token never ran
            lane_of[user] = lk.lane
            hist[user] = p + _ids(out)
    assert lane_of["A"] != lane_of["B"]
    assert not d.rec.kinds("lane.evicted")
    # with every lane holding a session, a request must displace one: the choice that loses
    # the fewest retained tokens net of the tokens it saves
    d2 = Driver(rt.model, rt.tokenizer, max_concurrency=2)
    _, o1 = d2.ask(system + rng.integers(100, 20000, 300).tolist(), max_tokens=2,
                   ignore_eos=True)
    _, o2 = d2.ask(rng.integers(100, 20000, 30).tolist(), max_tokens=2, ignore_eos=True)
    deep, small = o1[-1].lane, o2[-1].lane
    assert deep != small
    rid, _ = d2.ask(system + [7, 8, 9], max_tokens=2, ignore_eos=True)
    lk = d2.lookup(rid)
    # cutting the deep one saves 200 and loses 301 (-101); taking the small one saves 0 and
    # loses 31 (-31)
    assert lk.lane == small and lk.path == "full_reset"
    (ev,) = d2.rec.kinds("lane.evicted")
    assert ev.lane == small and ev.tokens == 31 and ev.reason == "reassigned"
    # the same start again: that lane, everything but the one generated token it held
    rid, _ = d2.ask(system + [7, 8, 9, 10], max_tokens=2, ignore_eos=True)
    assert d2.lookup(rid).lane == small and d2.lookup(rid).cached_tokens == 203


def test_requests_in_flight_together_each_reuse_their_own_session(runtime):
    rt = runtime
    p = [_chat(rt, [{"role": "user", "content": q}]) for q in
         ("List three prime numbers.", "Explain what a CPU does in one sentence.")]
    d = Driver(rt.model, rt.tokenizer, max_concurrency=2)
    firsts = [d.submit(x, max_tokens=10) for x in p]
    d.run()
    lanes = {rid: out[-1].lane for rid, out in firsts}
    follow = [x + _ids(out) + rt.tokenizer.encode("\nThanks.") for x, (_, out) in
              zip(p, firsts)]
    seconds = [d.submit(x, max_tokens=10) for x in follow]
    d.run()
    for (rid1, o1), (rid2, o2), x in zip(firsts, seconds, follow):
        lk = d.lookup(rid2)
        assert lk.lane == lanes[rid1]
        assert lk.cached_tokens == len(x) - len(rt.tokenizer.encode("\nThanks.")) - 1
        assert _ids(o2) == _cold(rt.model, rt.tokenizer, x, max_tokens=10)


def test_prompt_cache_key_routes_a_rewritten_conversation_to_its_own_lane(runtime):
    """``prompt_cache_key`` is a routing hint: a conversation whose client rewrote its history
    (only the system prompt still shared) goes back to its own lane, cut back to what the
    tokens share, instead of an empty lane; another key with a prompt sharing the same header
    does not take it. The tokens are a cold prefill's either way."""
    from ninfer.engine.engine import routing_key
    rt = runtime
    system = [{"role": "system", "content": "You are a helpful assistant. " * 14}]
    d = Driver(rt.model, rt.tokenizer, max_concurrency=3)
    k1, k2 = routing_key("conversation-1"), routing_key("conversation-2")
    assert len(k1) == 16 and k1 != k2 and routing_key(None) == ""
    r1, _ = d.ask(_chat(rt, system + [{"role": "user", "content": "Tell me about Rome."}]),
                  max_tokens=30, cache_key=k1)
    own = d.lookup(r1).lane
    r2, _ = d.ask(_chat(rt, system + [{"role": "user", "content": "Tell me about Oslo."}]),
                  max_tokens=30, cache_key=k2)
    assert d.lookup(r2).lane != own and not d.lookup(r2).routed   # an empty lane, as before
    other = d.lookup(r2).lane
    p3 = _chat(rt, system + [{"role": "user", "content": "(Summary: we discussed Rome.) "
                                                        "What about Paris?"}])
    r3, o3 = d.ask(p3, max_tokens=10, cache_key=k1)
    lk = d.lookup(r3)
    assert lk.lane == own and lk.routed and lk.path == "truncate_frontier"
    assert 0 < lk.cached_tokens < len(p3) and d.engine.lanes[other].retained
    assert _ids(o3) == _cold(rt.model, rt.tokenizer, p3, max_tokens=10)
    # without the key the same prompt would have taken the empty lane
    d2 = Driver(rt.model, rt.tokenizer, max_concurrency=3)
    d2.ask(_chat(rt, system + [{"role": "user", "content": "Tell me about Rome."}]),
           max_tokens=30)
    r4, _ = d2.ask(p3, max_tokens=10)
    assert d2.lookup(r4).path == "full_reset" and not d2.lookup(r4).routed


def test_no_prefix_reuse_recomputes_every_prompt_and_keeps_nothing(runtime):
    rt = runtime
    p = _chat(rt, [{"role": "user", "content": "What is the capital of France?"}])
    d = Driver(rt.model, rt.tokenizer, max_concurrency=1, prefix_reuse=False)
    d.ask(p, max_tokens=6)
    assert not d.engine.lanes[0].retained
    assert d.engine.pool.num_free == d.engine.config.num_pages
    r, _ = d.ask(p, max_tokens=6)
    assert d.lookup(r).path == "disabled" and d.prefilled(r) == len(p)
    assert not d.rec.kinds("lane.retained")


def test_a_request_failed_by_shutdown_keeps_nothing(runtime):
    rt = runtime
    p = _chat(rt, [{"role": "user", "content": "What is the capital of France?"}])
    d = Driver(rt.model, rt.tokenizer, max_concurrency=2)
    d.ask(p, max_tokens=4)
    rid, out = d.submit(p + rt.tokenizer.encode(" Paris?"), max_tokens=50)
    for _ in range(4):
        d.engine.step()
    d.bus.flush()
    busy = [ln for ln in d.engine.lanes if ln.req is not None]
    assert len(busy) == 1 and d.lookup(rid).cached_tokens > 0
    d.engine.shutdown("test")
    d.run()
    assert out[-1].code == "server_shutting_down"
    # a failed request's state (here the reused session it extended) is not kept
    assert not busy[0].retained and busy[0].pages == []
    assert sum(ln.retained for ln in d.engine.lanes) == 0
    assert d.engine.pool.num_free == d.engine.config.num_pages


# --- hybrid (Qwen3.5: GDN + attention): the exact frontier only -------------------------------

@pytest.fixture(scope="module")
def hybrid(mtp_bundle):
    """(tiny Qwen3.5 with an MTP head, byte tokenizer): test_engine_spec's model."""
    return mtp_bundle[:2]


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_hybrid_reuses_only_its_exact_frontier(hybrid, spec):
    model, tok = hybrid
    rng = np.random.default_rng(4)
    p1 = rng.integers(0, 256, 40).tolist()
    d = Driver(model, tok, max_concurrency=1, spec=spec, max_context=512)
    r1, o1 = d.ask(p1, max_tokens=10, ignore_eos=True)
    frontier = p1 + _ids(o1)[:-1]
    lane = d.engine.lanes[0]
    assert lane.num_computed == len(frontier) == int(d.engine.kv.lengths[0])
    if spec == "mtp":
        assert lane.mtp_pending is not None  # kept for the next prompt's first MTP pass
    # an extension of the frontier: append_frontier, the suffix alone is prefilled
    p2 = p1 + _ids(o1) + rng.integers(0, 256, 25).tolist()
    r2, o2 = d.ask(p2, max_tokens=10, ignore_eos=True)
    lk = d.lookup(r2)
    assert lk.path == "append_frontier" and lk.cached_tokens == len(frontier)
    assert lk.shared_tokens == len(frontier)
    assert d.prefilled(r2) == len(p2) - len(frontier)
    cold = Driver(model, tok, max_concurrency=1, spec=spec, max_context=512)  # fresh: cold
    rc, oc = cold.ask(p2, max_tokens=10, ignore_eos=True)
    assert cold.lookup(rc).path == "full_reset"
    assert _ids(o2) == _ids(oc)
    if spec == "mtp":
        # the MTP head's KV (the last attention layer of the cache) holds every prompt
        # position, flushed by the first round's draft, as the cold run's does
        def mtp_k(engine):
            k = engine.kv.kv.k[-1]
            k = k.get() if hasattr(k, "get") else k   # a CuPy array on the GPU
            return np.concatenate([k[p] for p in engine.lanes[0].pages])[:len(p2)]
        got, want = mtp_k(d.engine), mtp_k(cold.engine)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        assert np.abs(got[len(frontier) - 3:len(frontier)]).max() > 0
    # a prompt that diverges inside the frontier cannot rewind the recurrent state: cold
    p3 = p2[:30] + [(p2[30] + 1) % 256] + p2[31:]
    r3, o3 = d.ask(p3, max_tokens=10, ignore_eos=True)
    assert d.lookup(r3).path == "full_reset" and d.prefilled(r3) == len(p3)
    # why it missed: the lane held the prompt's first 30 tokens, but no rewind point there
    assert d.lookup(r3).cached_tokens == 0 and d.lookup(r3).shared_tokens == 30
    (ev,) = [e for e in d.rec.kinds("lane.evicted")]
    assert ev.reason == "reassigned"
    assert _ids(o3) == _cold(model, tok, p3, max_tokens=10, ignore_eos=True, spec=spec)
    # the exact frontier itself leaves nothing to compute the first token from: cold
    lane = d.engine.lanes[0]
    r4, _ = d.ask(list(lane.tokens), max_tokens=2, ignore_eos=True)
    assert d.lookup(r4).cached_tokens == 0


def test_hybrid_lookahead_keeps_the_position_its_round_ahead_computed(hybrid):
    """With the decode lookahead (each round launched before the last one's tokens are read,
    fed on them), a hybrid lane that finishes has already fed its last token into its
    recurrent state, which cannot be cut back: the lane keeps that position too, the next
    turn appends at it, and every output equals plain rounds'. Two lanes finish at different
    rounds (one drops its position ahead while the other's round goes on)."""
    model, tok = hybrid
    rng = np.random.default_rng(8)
    p1 = [rng.integers(0, 256, 30).tolist(), rng.integers(0, 256, 17).tolist()]
    limits = (6, 11)

    def serve(lookahead):
        d = Driver(model, tok, max_concurrency=2, max_context=512, decode_lookahead=lookahead)
        outs = [d.submit(p, max_tokens=n, ignore_eos=True) for p, n in zip(p1, limits)]
        d.run()
        return d, [_ids(o) for _, o in outs]

    d, o1 = serve("on")
    assert o1 == serve("off")[1]
    assert d.engine.lookahead
    for lane in d.engine.lanes:
        p, out = next((p, o) for p, o in zip(p1, o1) if lane.tokens[:len(p)] == p)
        assert lane.num_computed == len(p) + len(out) == int(d.engine.kv.lengths[lane.id])
        assert lane.ahead == 0 and lane.tokens == p + out
    p2 = p1[1] + o1[1] + rng.integers(0, 256, 9).tolist()
    r2, o2 = d.ask(p2, max_tokens=8, ignore_eos=True)
    lk = d.lookup(r2)
    assert lk.path == "append_frontier" and lk.cached_tokens == len(p1[1]) + limits[1]
    assert _ids(o2) == _cold(model, tok, p2, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("chunk,lanes", [(512, 1), (16, 2)])
def test_hybrid_turn_checkpoint_resumes_a_history_whose_answer_was_rewritten(hybrid, chunk,
                                                                              lanes):
    """A template that drops the thinking of a closed turn re-renders the last answer, so the
    next prompt keeps the history but not the lane's frontier: the recurrent state cannot be
    rewound, but the turn checkpoint (taken where the history ended) can be restored; with an
    empty lane free too, the request still takes its session's lane."""
    model, tok = hybrid
    rng = np.random.default_rng(31)
    opener = [60, 61, 62]   # stands for the generation opener ("<|im_start|>assistant\n")
    hist = rng.integers(0, 256, 45).tolist()
    p1 = hist + opener
    d = Driver(model, tok, max_concurrency=lanes, max_context=512, prefill_chunk=chunk,
               min_restore_tokens=16)
    r1, o1 = d.ask(p1, max_tokens=8, ignore_eos=True, checkpoint_at=len(hist))
    (ck,) = d.rec.kinds("lane.checkpointed")
    assert ck.request_id == r1 and ck.tokens == len(hist) and ck.bytes > 0
    assert ck.session_digest == session_digest(hist)
    # the prefill chunk holding the checkpoint ended exactly there
    assert len(hist) in [e.done_tokens for e in d.rec.kinds("request.prefill_chunk")]
    lane = d.engine.lanes[0]
    assert lane.ckpt.depth == len(hist) and lane.num_computed == len(p1) + 7
    (ret,) = d.rec.kinds("lane.retained")
    assert ret.checkpoint_tokens == len(hist) and ret.checkpoint_digest == ck.session_digest

    # next turn: the same history, the answer rendered otherwise, a new user message
    hist2 = hist + opener + rng.integers(0, 256, 6).tolist() + rng.integers(0, 256, 14).tolist()
    p2 = hist2 + opener
    r2, o2 = d.ask(p2, max_tokens=8, ignore_eos=True, checkpoint_at=len(hist2))
    lk = d.lookup(r2)
    assert lk.path == "restore_turn_checkpoint" and lk.cached_tokens == len(hist)
    assert lk.lane == 0 and d.prefilled(r2) == len(p2) - len(hist)
    assert _ids(o2) == _cold(model, tok, p2, max_tokens=8, ignore_eos=True)
    assert d.engine.lanes[0].ckpt.depth == len(hist2)   # the new turn's checkpoint replaced it
    # an extension of the new frontier still takes the frontier itself
    p3 = p2 + _ids(o2) + rng.integers(0, 256, 5).tolist()
    r3, _ = d.ask(p3, max_tokens=3, ignore_eos=True)
    assert d.lookup(r3).path == "append_frontier"
    # a prompt that changes the history before the checkpoint: cold, and the checkpoint goes
    p4 = [(hist[0] + 1) % 256] + hist2[1:] + opener
    r4, o4 = d.ask(p4, max_tokens=4, ignore_eos=True)
    assert d.lookup(r4).path == "full_reset" and d.engine.lanes[d.lookup(r4).lane].ckpt is None
    assert _ids(o4) == _cold(model, tok, p4, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("cfg", [{"turn_checkpoint": False}, {"spec": "mtp"}])
def test_hybrid_turn_checkpoints_follow_the_setting_and_serve_mtp_lanes(hybrid, cfg):
    """``turn_checkpoint=False``: no checkpoint, a prompt diverging below the frontier starts
    cold. Under ``--spec mtp`` the checkpoint is kept (with the MTP row before it) and the
    prompt resumes there, answering as a cold run."""
    model, tok = hybrid
    p = list(range(40, 90))
    d = Driver(model, tok, max_concurrency=1, max_context=256, min_restore_tokens=8, **cfg)
    d.ask(p, max_tokens=4, ignore_eos=True, checkpoint_at=30)
    r, o = d.ask(p[:30] + [1, 2, 3], max_tokens=2, ignore_eos=True)
    if not cfg.get("spec"):
        assert not d.rec.kinds("lane.checkpointed") and d.engine.lanes[0].ckpt is None
        assert d.lookup(r).path == "full_reset"
        return
    assert [e.tokens for e in d.rec.kinds("lane.checkpointed")][0] == 30
    lk = d.lookup(r)
    assert lk.path == "restore_turn_checkpoint" and lk.cached_tokens == 30
    assert _ids(o) == _cold(model, tok, p[:30] + [1, 2, 3], spec="mtp", max_tokens=2,
                            ignore_eos=True)


def test_hybrid_checkpoints_do_not_hand_a_session_to_a_stranger(hybrid):
    """While an empty lane is free, a request that matches a lane only at a turn checkpoint
    takes it only when that checkpoint is the lane's latest request's and at least
    ``min_restore_tokens`` deep: two clients sending the same short first message, or a
    stranger matching an older checkpoint, get the empty lane."""
    model, tok = hybrid
    rng = np.random.default_rng(41)
    op = [60, 61, 62]
    d = Driver(model, tok, max_concurrency=2, max_context=512, min_restore_tokens=16)
    short = rng.integers(0, 256, 6).tolist()
    ra, _ = d.ask(short + op, max_tokens=20, ignore_eos=True, checkpoint_at=6)
    rb, _ = d.ask(short + op, max_tokens=20, ignore_eos=True, checkpoint_at=6)
    assert d.lookup(rb).lane != d.lookup(ra).lane and d.lookup(rb).path == "full_reset"
    # a deep checkpoint, then a turn of that session that sets none: the checkpoint is stale
    hist = rng.integers(0, 256, 30).tolist()
    r1, o1 = d.ask(hist + op, max_tokens=20, ignore_eos=True, checkpoint_at=30)
    lane = d.lookup(r1).lane
    r2, o2 = d.ask(hist + op + _ids(o1) + [7, 8], max_tokens=20, ignore_eos=True)
    assert d.lookup(r2).lane == lane and d.lookup(r2).path == "append_frontier"
    other = d.engine.lanes[1 - lane]
    d.engine.slot_command(SlotCommand("erase", other.id, lambda r: None))   # free the other
    d.run()
    r3, _ = d.ask(hist + [9, 9] + op, max_tokens=4, ignore_eos=True)
    assert d.lookup(r3).lane == other.id and d.lookup(r3).path == "full_reset"


def test_hybrid_user_turn_anchor_survives_a_tool_loop(hybrid):
    """A tool loop moves the latest checkpoint past each tool result; once the next user query
    arrives the template drops the loop's thinking, which only the user-turn anchor (taken
    where that loop's user query ended) still matches."""
    model, tok = hybrid
    rng = np.random.default_rng(43)
    op = [60, 61, 62]
    d = Driver(model, tok, max_concurrency=2, max_context=1024, min_restore_tokens=16)
    h1 = rng.integers(0, 256, 40).tolist()                      # system + user query
    r1, o1 = d.ask(h1 + op, max_tokens=12, ignore_eos=True, checkpoint_at=len(h1),
                   anchor_at=len(h1))
    h2 = h1 + op + _ids(o1) + rng.integers(0, 256, 10).tolist()   # + tool result
    r2, o2 = d.ask(h2 + op, max_tokens=12, ignore_eos=True, checkpoint_at=len(h2))
    assert d.lookup(r2).path == "append_frontier"
    lane = d.engine.lanes[d.lookup(r2).lane]
    assert lane.anchor.depth == len(h1) and lane.ckpt.depth == len(h2)
    (ret,) = [e for e in d.rec.kinds("lane.retained") if e.request_id == r2]
    assert (ret.anchor_tokens, ret.checkpoint_tokens) == (len(h1), len(h2))
    # the next user query: the loop's answers re-rendered without their thinking
    h3 = h1 + op + rng.integers(0, 256, 9).tolist() + rng.integers(0, 256, 10).tolist() \
        + rng.integers(0, 256, 12).tolist()
    r3, o3 = d.ask(h3 + op, max_tokens=8, ignore_eos=True, checkpoint_at=len(h3),
                   anchor_at=len(h3))
    lk = d.lookup(r3)
    assert lk.lane == lane.id and lk.path == "restore_turn_checkpoint"
    assert lk.cached_tokens == len(h1)
    assert _ids(o3) == _cold(model, tok, h3 + op, max_tokens=8, ignore_eos=True)
    assert lane.anchor.depth == len(h3)   # the new user turn's anchor


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_hybrid_anchor_at_the_user_content_survives_a_moved_reminder(hybrid, spec):
    """A client that appends a reminder to the newest user message and moves it to the next
    one every turn (OpenCode) rewrites that message, so the turn checkpoint after it no longer
    matches; the anchor, taken where the message's content begins (``anchor_at`` below
    ``checkpoint_at``: prefill stops at both), does, and the next turn resumes there. The
    output equals a cold prefill's. With ``--spec mtp`` the checkpoint keeps the main model's
    hidden row before it, so the MTP head's KV row there is redone with the new next token:
    the head's KV then equals a cold run's."""
    model, tok = hybrid
    rng = np.random.default_rng(44)
    op = [60, 61, 62]
    d = Driver(model, tok, max_concurrency=1, max_context=1024, min_restore_tokens=16,
               spec=spec)
    head = rng.integers(0, 256, 36).tolist()          # system prompt + the user header
    u1, reminder = rng.integers(0, 256, 6).tolist(), rng.integers(0, 256, 5).tolist()
    h1 = head + u1 + reminder
    r1, o1 = d.ask(h1 + op, max_tokens=8, ignore_eos=True, checkpoint_at=len(h1),
                   anchor_at=len(head))
    lane = d.engine.lanes[0]
    assert (lane.anchor.depth, lane.ckpt.depth) == (len(head), len(h1))
    chunks = [e.done_tokens for e in d.rec.kinds("request.prefill_chunk")
              if e.request_id == r1]
    assert chunks[:2] == [len(head), len(h1)]          # prefill stopped at both
    # the next turn: u1 without its reminder (and its first token rewritten, so the MTP
    # head's row before the anchor must be redone), the answer, a new user message with it
    u1[0] = (u1[0] + 1) % 256
    h2 = head + u1 + _ids(o1) + rng.integers(0, 256, 4).tolist() + reminder
    r2, o2 = d.ask(h2 + op, max_tokens=8, ignore_eos=True, checkpoint_at=len(h2),
                   anchor_at=len(h2) - len(reminder) - 4)
    lk = d.lookup(r2)
    assert lk.path == "restore_turn_checkpoint" and lk.resumed_from == "anchor"
    assert lk.cached_tokens == len(head)
    cold = Driver(model, tok, max_concurrency=1, max_context=1024, spec=spec)   # fresh: cold
    rc, oc = cold.ask(h2 + op, max_tokens=8, ignore_eos=True)
    assert cold.lookup(rc).path == "full_reset" and _ids(o2) == _ids(oc)
    assert lane.anchor.depth == len(h2) - len(reminder) - 4
    if spec == "mtp":
        assert lane.spec and lane.anchor.mtp_row is not None
        n = len(h2 + op)

        def mtp_k(engine):   # the MTP head's KV (the cache's last attention layer)
            k = engine.kv.kv.k[-1]
            k = k.get() if hasattr(k, "get") else k   # a CuPy array on the GPU
            return np.concatenate([k[p] for p in engine.lanes[0].pages])[:n]
        np.testing.assert_allclose(mtp_k(d.engine), mtp_k(cold.engine), rtol=1e-4, atol=1e-4)


# --- L2: prefixes a lane loses are kept in host memory and restored -------------------------

def test_an_edit_by_the_same_session_does_not_demote_the_old_branch(runtime):
    """A session that cuts its own lane back and keeps at least half of it (an edited or
    regenerated last message) abandons the old branch: nothing is copied to L2. Another
    session taking the lane demotes it as before."""
    from ninfer.engine.engine import routing_key
    rt = runtime
    system = [{"role": "system", "content": "You are a helpful assistant. " * 14}]
    d = Driver(rt.model, rt.tokenizer, max_concurrency=1, l2_bytes=1 << 30)
    k1, k2 = routing_key("conversation-1"), routing_key("conversation-2")
    d.ask(_chat(rt, system + [{"role": "user", "content": "Tell me about Rome."}]),
          max_tokens=20, cache_key=k1)
    n1 = d.engine.lanes[0].num_computed
    r2, _ = d.ask(_chat(rt, system + [{"role": "user", "content": "Tell me about Milan."}]),
                  max_tokens=20, cache_key=k1)
    lk = d.lookup(r2)
    assert lk.routed and lk.path == "truncate_frontier" and 2 * lk.cached_tokens >= n1
    assert d.rec.kinds("cache.demoted") == []
    n2 = d.engine.lanes[0].num_computed
    r3, _ = d.ask(_chat(rt, system + [{"role": "user", "content": "Tell me about Oslo."}]),
                  max_tokens=4, cache_key=k2)
    assert not d.lookup(r3).routed and d.lookup(r3).path == "truncate_frontier"
    (dem,) = d.rec.kinds("cache.demoted")
    assert dem.tokens == n2 and dem.admitted


def test_an_image_larger_than_l2_is_refused_before_it_is_copied(runtime, monkeypatch):
    rt = runtime
    p1 = _chat(rt, [{"role": "user", "content": "Tell me about the history of the Roman "
                                                "Empire in detail."}])
    d = Driver(rt.model, rt.tokenizer, max_concurrency=1, l2_bytes=4096)
    d.ask(p1, max_tokens=8)
    n1 = d.engine.lanes[0].num_computed
    import ninfer.engine.tiers as tiers
    monkeypatch.setattr(tiers, "export_lane", lambda *a, **k: pytest.fail("copied out"))
    d.ask(_chat(rt, [{"role": "user", "content": "Hi there"}]), max_tokens=2)
    (dem,) = d.rec.kinds("cache.demoted")
    assert (dem.tokens, dem.admitted, dem.entries, dem.tier_bytes) == (n1, False, 0, 0)
    assert dem.bytes == kv_image_bytes(d.engine.kv, n1) > 4096


def test_l2_keeps_a_displaced_session_and_restores_it_exactly(runtime, backend):
    rt = runtime
    p1 = _chat(rt, [{"role": "user", "content": "Tell me about the history of the Roman "
                                                "Empire in detail."}])
    other = _chat(rt, [{"role": "user", "content": "Hi there"}])
    d = Driver(rt.model, rt.tokenizer, max_concurrency=1, l2_bytes=1 << 30)
    _, o1 = d.ask(p1, max_tokens=30)
    n1 = d.engine.lanes[0].num_computed
    d.ask(other, max_tokens=5)   # the only lane: session 1 is cut back, demoted first
    (dem,) = [e for e in d.rec.kinds("cache.demoted") if e.tokens == n1]
    assert dem.admitted and dem.tier == "l2" and dem.entries == 1
    # (its ledger and K / V: what a too small L2 refuses before copying anything)
    assert dem.bytes == kv_image_bytes(d.engine.kv, n1)   # (SmolLM2: no recurrent state)
    follow = p1 + _ids(o1) + rt.tokenizer.encode(
        "<|im_end|>\n<|im_start|>user\nMore, please.<|im_end|>\n<|im_start|>assistant\n")
    r3, o3 = d.ask(follow, max_tokens=12)
    lk = d.lookup(r3)
    assert lk.source == "l2" and lk.cached_tokens == n1 and lk.path == "append_frontier"
    (res,) = d.rec.kinds("cache.restored")
    assert res.request_id == r3 and res.tokens == n1 and res.bytes == dem.bytes
    assert d.prefilled(r3) == len(follow) - n1
    # the restored session decodes exactly as if it had never left its lane
    kept = Driver(rt.model, rt.tokenizer, max_concurrency=1, l2_bytes=1 << 30)
    kept.ask(p1, max_tokens=30)
    rk, ok = kept.ask(follow, max_tokens=12)
    assert kept.lookup(rk).source == "l1" and kept.lookup(rk).cached_tokens == n1
    assert _ids(o3) == _ids(ok)
    if backend == "numpy":   # and, on the reference, as a cold prefill of the whole history
        # (on the GPU, KV written by decode steps and by a prefill differ in the last bits)
        assert _ids(o3) == _cold(rt.model, rt.tokenizer, follow, max_tokens=12)
    # the lane's own prefix ("Hi there" session) went to L2 on the way: nothing was lost
    assert len(d.engine.l2) == 2
    # the lane goes back to "Hi there": the follow session goes to L2 and supersedes session
    # 1's image (its ledger extends it); a prompt sharing only part of it restores that part,
    # and the bytes restored are that part's K / V, not the whole image
    d.ask(other, max_tokens=5)
    dem2 = d.rec.kinds("cache.demoted")[-1]
    assert dem2.tokens > n1 and len(d.engine.l2) == 2
    assert [e.reason for e in d.rec.kinds("cache.evicted")] == ["superseded"]
    part = p1[:len(p1) - 6] + rt.tokenizer.encode(
        " of Greece.<|im_end|>\n<|im_start|>assistant\n")
    # (the shared part is shorter than the default 64 tokens worth a restore)
    d.engine.config = dataclasses.replace(d.engine.config, min_restore_tokens=16)
    rp, _ = d.ask(part, max_tokens=2)
    lk = d.lookup(rp)
    assert lk.source == "l2" and lk.path == "truncate_frontier"
    assert len(p1) - 6 <= lk.cached_tokens < dem2.tokens
    (res,) = [e for e in d.rec.kinds("cache.restored") if e.request_id == rp]
    kv_bytes = dem2.bytes - 4 * dem2.tokens   # (the image's int32 ledger is the rest)
    assert res.bytes == kv_bytes * res.tokens // dem2.tokens < dem2.bytes


def test_hybrid_l2_restores_only_at_the_exact_frontier(hybrid):
    model, tok = hybrid
    rng = np.random.default_rng(21)
    pa, pb = rng.integers(0, 256, 40).tolist(), rng.integers(0, 256, 30).tolist()
    d = Driver(model, tok, max_concurrency=1, max_context=512, l2_bytes=1 << 30,
               min_restore_tokens=16)
    _, oa = d.ask(pa, max_tokens=8, ignore_eos=True)
    d.ask(pb, max_tokens=8, ignore_eos=True)  # A's state is demoted, the slot reset
    follow = pa + _ids(oa) + rng.integers(0, 256, 20).tolist()
    r, o = d.ask(follow, max_tokens=8, ignore_eos=True)
    lk = d.lookup(r)
    assert lk.source == "l2" and lk.cached_tokens == len(pa) + 7
    assert int(d.engine.kv.lengths[0]) == len(follow) + 7
    assert _ids(o) == _cold(model, tok, follow, max_tokens=8, ignore_eos=True)
    # a prompt diverging inside A's history cannot use the image
    bad = follow[:10] + [(follow[10] + 1) % 256] + follow[11:]
    r, _ = d.ask(bad, max_tokens=2, ignore_eos=True)
    assert d.lookup(r).cached_tokens == 0


@pytest.mark.parametrize("chunk", [512, 16])
def test_hybrid_breakpoint_publishes_a_system_prefix_another_conversation_reuses(hybrid, chunk):
    """A prompt-cache breakpoint (``Request.publish_at``) at the end of a shared system prefix:
    prefill stops there once and publishes the prefix to L2 (``cache.published``), so that a
    different conversation with the same prefix restores it exactly (a hybrid model's state
    restores only at an image's end, so without the breakpoint it could never reuse the
    prefix) and decodes as a cold prefill does; what every tier holds is not published
    again."""
    model, tok = hybrid
    rng = np.random.default_rng(33)
    system = rng.integers(0, 256, 40).tolist()
    pa = system + rng.integers(0, 256, 23).tolist()
    pb = system + rng.integers(0, 256, 17).tolist()
    d = Driver(model, tok, max_concurrency=1, max_context=512, l2_bytes=1 << 30,
               min_restore_tokens=16, prefill_chunk=chunk)
    ra, oa = d.ask(pa, max_tokens=6, ignore_eos=True, publish_at=(len(system),))
    (pub,) = d.rec.kinds("cache.published")
    assert (pub.request_id, pub.tokens, pub.tiers) == (ra, len(system), ["l2"])
    assert pub.session_digest == session_digest(system) and pub.bytes > 0
    assert (pub.l2_entries, pub.l2_bytes) == (1, pub.bytes)
    # the prefill stopped at the breakpoint (then went on from there)
    chunks = [e.done_tokens for e in d.rec.kinds("request.prefill_chunk") if e.request_id == ra]
    assert len(system) in chunks and chunks[-1] == len(pa)
    assert oa[-1].cache_write_tokens == len(system) and oa[-1].cached_tokens == 0
    assert _ids(oa) == _cold(model, tok, pa, max_tokens=6, ignore_eos=True)

    rb, ob = d.ask(pb, max_tokens=6, ignore_eos=True, publish_at=(len(system),))
    lk = d.lookup(rb)
    assert lk.source == "l2" and lk.cached_tokens == len(system)
    assert d.prefilled(rb) == len(pb) - len(system)
    assert len(d.rec.kinds("cache.published")) == 1   # already held: not copied again
    assert ob[-1].cache_write_tokens == 0 and ob[-1].cached_tokens == len(system)
    assert _ids(ob) == _cold(model, tok, pb, max_tokens=6, ignore_eos=True)
    # without the breakpoint the second conversation restores nothing
    d2 = Driver(model, tok, max_concurrency=1, max_context=512, l2_bytes=1 << 30,
                min_restore_tokens=16, prefill_chunk=chunk)
    d2.ask(pa, max_tokens=6, ignore_eos=True)
    r, _ = d2.ask(pb, max_tokens=6, ignore_eos=True)
    assert d2.lookup(r).cached_tokens == 0 and not d2.rec.kinds("cache.published")


def test_breakpoints_that_cannot_be_published_change_nothing(hybrid):
    """Without a tier (no L2, no L3), below min_restore_tokens, or at or past the prompt's
    end, a breakpoint publishes nothing and leaves the prefill's chunks alone."""
    model, tok = hybrid
    rng = np.random.default_rng(34)
    p = rng.integers(0, 256, 50).tolist()
    for cfg, at in (({"l2_bytes": 0}, (30,)),
                    ({"l2_bytes": 1 << 30, "min_restore_tokens": 64}, (30,)),
                    ({"l2_bytes": 1 << 30, "min_restore_tokens": 16}, (50, 70))):
        d = Driver(model, tok, max_concurrency=1, max_context=512, **cfg)
        r, o = d.ask(p, max_tokens=3, ignore_eos=True, publish_at=at)
        assert not d.rec.kinds("cache.published") and o[-1].cache_write_tokens == 0
        chunks = [e.tokens for e in d.rec.kinds("request.prefill_chunk") if e.request_id == r]
        assert chunks == [50], cfg


def test_breakpoint_and_turn_checkpoint_in_one_chunk_stop_once_each(hybrid):
    model, tok = hybrid
    p = np.random.default_rng(5).integers(0, 256, 60).tolist()
    for pub, ck in ((20, 40), (40, 20), (30, 30)):
        d = Driver(model, tok, max_concurrency=1, max_context=512, min_restore_tokens=16,
                   l2_bytes=1 << 30)
        r, o = d.ask(p, max_tokens=5, ignore_eos=True, publish_at=(pub,), checkpoint_at=ck)
        assert [e.done_tokens for e in d.rec.kinds("request.prefill_chunk")] == \
            sorted({pub, ck, 60})
        (pe,), (ce,) = d.rec.kinds("cache.published"), d.rec.kinds("lane.checkpointed")
        assert (pe.tokens, ce.tokens) == (pub, ck)
        assert _ids(o) == _cold(model, tok, p, max_tokens=5, ignore_eos=True)


def test_a_prefix_no_tier_can_take_is_copied_out_once(hybrid, tmp_path):
    """An image over the L2 budget (and, with L3, over half its quota) is copied out once,
    reported with no tier, and remembered: later requests sharing the prefix neither stop
    their prefill there nor copy it again, and report no cache write."""
    from ninfer.store.continuation_store import ContinuationStore
    model, tok = hybrid
    rng = np.random.default_rng(6)
    system = rng.integers(0, 256, 40).tolist()
    for with_l3 in (False, True):
        d = Driver(model, tok, max_concurrency=1, max_context=512, min_restore_tokens=16,
                   l2_bytes=4096)
        if with_l3:
            store = ContinuationStore(str(tmp_path), "t", 1 << 20,
                                      {"artifact_sha256": "x", **d.engine.layout_identity()})
            store.quota_bytes = 8192   # (the image is ~50 KB: over half of it)
            d.engine.attach_store(store, persist_min_tokens=1 << 20)
        outs = []
        for i in range(3):
            p = system + rng.integers(0, 256, 10 + i).tolist()
            r, o = d.ask(p, max_tokens=3, ignore_eos=True, publish_at=(len(system),))
            outs.append((o[-1].cache_write_tokens, [e.done_tokens for e in d.rec.kinds(
                "request.prefill_chunk") if e.request_id == r]))
        (pub,) = d.rec.kinds("cache.published")
        assert pub.tiers == [] and pub.bytes > 4096
        assert outs[0] == (0, [40, 50]) and outs[1] == (0, [51]) and outs[2] == (0, [52])
        assert not d.rec.kinds("store.persist_failed")
        d.engine.stop()


def test_a_past_deadline_refuses_only_requests_no_free_lane_is_there_for(runtime):
    """The queue deadline refuses a request that waited for a lane; one whose deadline passed
    while the engine was busy with a long step, with a lane free when it is looked at, is
    admitted (two lanes, three requests past their deadline: the first two get the lanes)."""
    rt = runtime
    d = Driver(rt.model, rt.tokenizer, max_concurrency=2)
    rids = [d.submit(_chat(rt, [{"role": "user", "content": f"Count to {i + 3}."}]),
                     max_tokens=2, deadline=time.monotonic() - 1.0)[0] for i in range(3)]
    d.run()
    assert [e.request_id for e in d.rec.kinds("request.rejected")] == [rids[2]]
    assert {e.request_id for e in d.rec.kinds("request.admitted")} == set(rids[:2])


@pytest.mark.parametrize("chunk", [16, 512])
def test_a_cold_request_waits_for_the_lane_building_its_prefix(hybrid, chunk):
    """Two conversations with the same unpublished 40-token prefix arrive together, lanes
    free: one lane builds it (prefill stops at the breakpoint and publishes it); the other
    request waits for that (``request.deferred``) instead of computing it too, then restores it
    from L2 and prefills only its own suffix; both decode as cold prefills do. Without a tier,
    or with an L2 smaller than the image, nothing waits."""
    model, tok = hybrid
    rng = np.random.default_rng(9)
    system = rng.integers(0, 256, 40).tolist()
    pa = system + rng.integers(0, 256, 12).tolist()
    pb = system + rng.integers(0, 256, 13).tolist()
    d = Driver(model, tok, max_concurrency=2, max_context=512, min_restore_tokens=16,
               l2_bytes=1 << 30, prefill_chunk=chunk)
    ra, oa = d.submit(pa, max_tokens=4, ignore_eos=True, publish_at=(40,))
    rb, ob = d.submit(pb, max_tokens=4, ignore_eos=True, publish_at=(40,))
    d.engine.step()
    # a deadline that passes while it waits for the builder does not refuse it
    (waiting,) = d.engine.waiting
    waiting.deadline = time.monotonic() - 1.0
    d.run()
    assert not d.rec.kinds("request.rejected")
    (w,) = d.rec.kinds("request.deferred")
    assert (w.request_id, w.builder_request, w.tokens) == (rb, ra, 40)
    from ninfer.events.fold import ServingState, fold
    state = ServingState()
    for r in d.rec.items:
        state = fold(state, r)
    assert state.requests.deferred == 1
    assert w.builder_lane == d.lookup(ra).lane
    lk = d.lookup(rb)
    assert lk.source == "l2" and lk.cached_tokens == 40 and d.prefilled(rb) == len(pb) - 40
    assert len(d.rec.kinds("cache.published")) == 1 and ob[-1].cache_write_tokens == 0
    assert _ids(oa) == _cold(model, tok, pa, max_tokens=4, ignore_eos=True)
    assert _ids(ob) == _cold(model, tok, pb, max_tokens=4, ignore_eos=True)
    # no tier, or an L2 too small for the prefix's image (which could never become visible
    # there): nothing waits
    for cfg in ({"l2_bytes": 0}, {"l2_bytes": 1024}):
        d = Driver(model, tok, max_concurrency=2, max_context=512, min_restore_tokens=16,
                   prefill_chunk=chunk, **cfg)
        d.submit(pa, max_tokens=4, ignore_eos=True, publish_at=(40,))
        rb, _ = d.submit(pb, max_tokens=4, ignore_eos=True, publish_at=(40,))
        d.run()
        assert not d.rec.kinds("request.deferred") and d.prefilled(rb) == len(pb), cfg


def test_a_deferred_request_keeps_its_claim_on_a_free_lane(hybrid):
    """Two lanes: A builds the shared prefix, B waits for it, C (unrelated, later) finds B's
    free lane claimed and waits too; B is admitted as soon as A has published (and restores),
    C when a lane frees. Nothing is refused, and the order of the waiting queue is kept."""
    model, tok = hybrid
    rng = np.random.default_rng(9)
    system = rng.integers(0, 256, 40).tolist()
    pa, pb = system + rng.integers(0, 256, 12).tolist(), system + rng.integers(0, 256, 13).tolist()
    pc = rng.integers(0, 256, 30).tolist()
    d = Driver(model, tok, max_concurrency=2, max_context=512, min_restore_tokens=16,
               l2_bytes=1 << 30, prefill_chunk=16)
    ra, _ = d.submit(pa, max_tokens=30, ignore_eos=True, publish_at=(40,))
    rb, ob = d.submit(pb, max_tokens=4, ignore_eos=True, publish_at=(40,))
    rc, oc = d.submit(pc, max_tokens=4, ignore_eos=True)
    d.engine.step()
    d.bus.flush()
    assert [e.request_id for e in d.rec.kinds("request.admitted")] == [ra]
    assert [r.request_id for r in d.engine.waiting] == [rb, rc]
    steps = 1
    while not any(e.request_id == rb for e in d.rec.kinds("request.admitted")):
        d.engine.step()
        d.bus.flush()
        steps += 1
    (pub,) = d.rec.kinds("cache.published")
    assert steps == 4   # A's chunks of 16, 16 and 8 (to the breakpoint), then B's admission
    assert [e.request_id for e in d.rec.kinds("request.admitted")] == [ra, rb]
    d.run()
    assert d.lookup(rb).cached_tokens == 40 and not d.rec.kinds("request.rejected")
    assert isinstance(ob[-1], FinalOutput) and isinstance(oc[-1], FinalOutput)


def test_pinned_image_blocks_come_in_a_ladder_of_sizes():
    """The pinned blocks a GPU image's K / V rows take: at least the bytes asked for, in
    512-byte units, at most 2^(1/4) over, and few distinct sizes across lengths (so a freed
    block serves the next image of a similar length)."""
    from ninfer.engine.continuation import pinned_block_bytes
    sizes = set()
    for n in range(10**6, 10**9, 997_331):
        b = pinned_block_bytes(n)
        assert n <= b <= n * 2 ** 0.25 + 512 and b % 512 == 0
        sizes.add(b)
    assert len(sizes) <= 41   # (4 rungs a doubling, 10 doublings)
    assert pinned_block_bytes(1) == pinned_block_bytes(512) == 512


def test_images_round_trip_through_any_pages_and_l2_evicts_least_recent():
    from ninfer.engine.continuation import HostTier, export_lane, import_lane
    from ninfer.engine.kv import KVCache
    rng = np.random.default_rng(5)
    kv = KVCache(3, 12, 4, 2, 8)
    for a in kv.k + kv.v:
        a[...] = rng.standard_normal(a.shape)
    src = [7, 2, 9]
    image = export_lane(kv, src, 10, list(range(100, 110)), None)
    assert image.k.shape == (3, 10, 2, 8) and image.tokens.tolist() == list(range(100, 110))
    dst = [0, 5, 11]
    import_lane(kv, image, 9, dst, None)
    for a in kv.k + kv.v:
        got = a[dst].reshape(12, 2, 8)[:9]
        want = a[src].reshape(12, 2, 8)[:9]
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError):
        import_lane(kv, image, 11, dst, None)
    tier = HostTier(budget_bytes=2 * image.nbytes + 10)
    imgs = [export_lane(kv, src, 10, list(range(i, i + 10)), None) for i in range(3)]
    assert tier.put(imgs[0]) == (True, [], []) and tier.put(imgs[1]) == (True, [], [])
    assert tier.best(np.arange(0, 20), 19, exact=False) == (imgs[0], 10)  # refreshes imgs[0]
    ok, evicted, _ = tier.put(imgs[2])
    assert ok and evicted == [imgs[1]] and len(tier) == 2
    assert tier.put(imgs[0]) == (True, [], [])  # already held: refreshed, not copied
    assert HostTier(budget_bytes=10).put(imgs[0]) == (False, [], [])
    assert tier.best(np.arange(1, 20), 19, exact=True) == (None, 0)
    # a conversation's next turn supersedes its earlier image (attention-only models), and an
    # unrelated image stays; on hybrid models (exact restores) both turns stay
    short = export_lane(kv, src, 6, list(range(100, 106)), None)
    longer = export_lane(kv, src, 10, list(range(100, 110)), None)
    for supersede in (True, False):
        t = HostTier(budget_bytes=10 * image.nbytes, supersede=supersede)
        t.put(imgs[0])
        t.put(short)
        ok, evicted, gone = t.put(longer)
        assert ok and evicted == [] and gone == ([short] if supersede else [])
        assert len(t) == (2 if supersede else 3)
        assert t.nbytes == sum(im.nbytes for im in ([imgs[0], longer] if supersede
                                                    else [imgs[0], short, longer]))


# --- L3: the LMDB store survives a restart ----------------------------------------------------

def _with_store(rt, root, identity=None, quota=64 << 20, **cfg):
    from ninfer.store.continuation_store import ContinuationStore
    d = Driver(rt.model, rt.tokenizer, **cfg)
    store = ContinuationStore(str(root), "test", quota,
                              identity or {"artifact_sha256": rt.artifact.sha256,
                                           **d.engine.layout_identity()})
    d.engine.attach_store(store, persist_min_tokens=16)
    return d, store


def _flush(d):
    d.engine.persister.flush()
    d.bus.flush()


def test_l3_restores_a_session_after_a_restart(runtime, tmp_path):
    rt = runtime
    p1 = _chat(rt, [{"role": "user", "content": "Tell me about the history of the Roman "
                                                "Empire in detail."}])
    d, store = _with_store(rt, tmp_path, max_concurrency=1)
    _, o1 = d.ask(p1, max_tokens=30)
    n1 = d.engine.lanes[0].num_computed
    _flush(d)
    (done,) = d.rec.kinds("store.persisted")
    assert done.tier == "l3" and done.tokens == n1 and done.entries == 1
    follow = p1 + _ids(o1) + rt.tokenizer.encode(
        "<|im_end|>\n<|im_start|>user\nMore, please.<|im_end|>\n<|im_start|>assistant\n")
    # the next turn extends the first: once durable, the older image is redundant
    _, o2 = d.ask(follow, max_tokens=6)
    _flush(d)
    assert [e.deleted for e in d.rec.kinds("store.persisted")] == [0, 1] and len(store) == 1
    d.engine.stop()   # closes the store

    # a new process, in effect (publishing KV-cache events: its kept ledgers are named)
    d2, store2 = _with_store(rt, tmp_path, max_concurrency=1, ledger_events=True)
    assert len(store2) == 1
    d2.bus.flush()
    (opened,) = d2.rec.kinds("store.opened")
    assert opened.entries == 1 and opened.bytes == store2.nbytes > 0
    assert opened.token_ids == [follow + _ids(o2)[:-1]]
    again = follow + _ids(o2) + rt.tokenizer.encode(
        "<|im_end|>\n<|im_start|>user\nThanks.<|im_end|>\n<|im_start|>assistant\n")
    r, o = d2.ask(again, max_tokens=8)
    lk = d2.lookup(r)
    assert lk.source == "l3" and lk.cached_tokens == len(follow) + 5
    (res,) = d2.rec.kinds("cache.restored")
    assert res.tier == "l3" and res.tokens == lk.cached_tokens
    assert _ids(o) == _cold(rt.model, rt.tokenizer, again, max_tokens=8)

    # a new conversation shares only the chat template's header with the stored ones: too
    # little to be worth a restore from disk, and it is persisted on its own
    d2.engine.lane_pool.evict(d2.engine.lanes[0], "reassigned")  # forget L1 (as a restart would)
    other = _chat(rt, [{"role": "user", "content": "Name three colors of the rainbow."}])
    r, _ = d2.ask(other, max_tokens=24)
    assert d2.lookup(r).cached_tokens == 0 and d2.lookup(r).path == "full_reset"
    _flush(d2)
    assert d2.rec.kinds("store.persisted")[-1].tokens == d2.engine.lanes[0].num_computed
    d2.engine.stop()
    d2, store2 = _with_store(rt, tmp_path, max_concurrency=1)
    assert len(store2) == 2
    d2.engine.stop()

    # another identity (model, layout): the entry is not even in the catalog
    d3, store3 = _with_store(rt, tmp_path, identity={"artifact_sha256": "other"},
                             max_concurrency=1)
    assert len(store3) == 0 and store3.foreign >= 1
    r, _ = d3.ask(again, max_tokens=2)
    assert d3.lookup(r).cached_tokens == 0
    d3.engine.stop()


def test_l3_corrupt_entries_are_safe_misses_and_a_full_store_keeps_serving(runtime, tmp_path):
    rt = runtime
    p1 = _chat(rt, [{"role": "user", "content": "Write a haiku about autumn leaves."}])
    d, store = _with_store(rt, tmp_path, max_concurrency=1, min_restore_tokens=16)
    _, o1 = d.ask(p1, max_tokens=10)
    _flush(d)
    (key,) = list(store.catalog)
    with store.env.begin(write=True) as txn:  # flip a byte of the payload
        raw = bytearray(txn.get(key, db=store._images))
        raw[len(raw) // 2] ^= 0xFF
        txn.put(key, bytes(raw), db=store._images)
    d.engine.lanes[0].num_computed = 0  # forget L1 and L2 so only L3 could serve it
    d.engine.lanes[0].tokens = []
    d.engine.pool.free(d.engine.lanes[0].pages)
    d.engine.lanes[0].pages = []
    follow = p1 + _ids(o1) + [198]
    r, o = d.ask(follow, max_tokens=6)
    assert d.lookup(r).cached_tokens == 0 and len(store) <= 1 and key not in store.catalog
    (dropped,) = d.rec.kinds("store.entry_dropped")   # the deletion is on the log
    assert dropped.tier == "l3" and dropped.reason == "ValueError: payload digest mismatch"
    assert dropped.entries == 0 and dropped.store_bytes == 0
    assert _ids(o) == _cold(rt.model, rt.tokenizer, follow, max_tokens=6)
    d.engine.stop()
    # a quota too small for any image: the write fails, is recorded, and serving continues
    d, store = _with_store(rt, tmp_path / "small", quota=1 << 20, max_concurrency=1)
    _, out = d.ask(_chat(rt, [{"role": "user", "content": "Tell me a long story about a "
                                                          "dragon and a knight."}]),
                   max_tokens=20)
    _flush(d)
    (fail,) = d.rec.kinds("store.persist_failed")
    assert "MapFull" in fail.error and len(store) == 0
    assert isinstance(out[-1], FinalOutput)
    d.engine.stop()


def test_l3_refuses_what_it_cannot_trust_and_never_stops_serving(runtime, tmp_path):
    from ninfer.store.continuation_store import ContinuationStore, StoreUnavailable
    rt = runtime
    p1 = _chat(rt, [{"role": "user", "content": "Write a haiku about autumn leaves."}])
    d, store = _with_store(rt, tmp_path, max_concurrency=1)
    _, o1 = d.ask(p1, max_tokens=10)
    _flush(d)
    (entry,) = list(store.catalog.values())
    # a ledger whose tokens were changed no longer matches its key: a safe miss, deleted
    import msgpack
    with store.env.begin(write=True) as txn:
        meta = msgpack.unpackb(txn.get(entry.key, db=store._ledgers))
        toks = np.frombuffer(meta["tokens"], dtype="<i4").copy()
        toks[3] += 1
        meta["tokens"] = toks.tobytes()
        txn.put(entry.key, msgpack.packb(meta), db=store._ledgers)
    assert store.load(entry) is None and entry.key not in store.catalog
    # a second process on the same namespace is refused (one process per directory)
    with pytest.raises(StoreUnavailable, match="in use"):
        ContinuationStore(str(tmp_path), "test", 64 << 20, {"x": 1})
    d.engine.stop()
    # a path that cannot hold the store: refused with a reason, not a crash
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreUnavailable):
        ContinuationStore(str(tmp_path / "file"), "test", 64 << 20, {"x": 1})
    # an image over half the quota is refused before anything is evicted
    d, store = _with_store(rt, tmp_path / "q", quota=4 << 20, max_concurrency=1)
    _, o = d.ask(_chat(rt, [{"role": "user", "content": "Hi"}]), max_tokens=4)
    _flush(d)
    assert len(store) == 1
    d.ask(_chat(rt, [{"role": "user", "content": "Tell me a long story about a dragon and a "
                                                "knight who met in a forest."}]),
          max_tokens=20)
    _flush(d)
    (fail,) = d.rec.kinds("store.persist_failed")
    assert "exceeds half" in fail.error and len(store) == 1
    d.engine.stop()

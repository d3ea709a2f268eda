"""Fair prefill (``--max-prefill-lanes``) on the real SmolLM2: a short request admitted behind a
long cold prefill gets its first token before that prefill ends, and both answers equal the ones
each gets alone (greedy). With one prefill lane the old order holds: the long prompt's whole
prefill first."""
from __future__ import annotations

import pytest

from test_prefix_reuse import Driver, _chat, _ids  # same folder

pytestmark = pytest.mark.slow
CHUNK = 16


@pytest.fixture(scope="module")
def runtime(smollm2_gguf, backend):
    from ninfer.server import load_runtime
    return load_runtime(str(smollm2_gguf), backend)


@pytest.fixture(scope="module")
def prompts(runtime):
    text = "The quick brown fox jumps over the lazy dog near the river bank. " * 24
    long = _chat(runtime, [{"role": "user", "content": f"Summarize: {text}"}])
    short = _chat(runtime, [{"role": "user", "content": "Name a colour."}])
    assert len(long) > 12 * CHUNK and len(short) <= 3 * CHUNK
    return long, short


def _alone(rt, prompt):
    d = Driver(rt.model, rt.tokenizer, prefill_chunk=CHUNK, max_concurrency=1)
    return _ids(d.ask(prompt, max_tokens=8)[1])


def _long_then_short(rt, long, short, lanes: int):
    """The long prompt admitted (and one chunk run) before the short one arrives; returns the
    driver, both request ids and both outputs."""
    d = Driver(rt.model, rt.tokenizer, prefill_chunk=CHUNK, max_concurrency=2,
               max_prefill_lanes=lanes)
    r_long, o_long = d.submit(long, max_tokens=8)
    d.engine.step()
    r_short, o_short = d.submit(short, max_tokens=8)
    d.run()
    return d, (r_long, r_short), (o_long, o_short)


def _at(d, kind, pred):
    """Log positions of the records of ``kind`` whose event satisfies ``pred``."""
    return [i for i, r in enumerate(d.rec.items) if r.kind == kind and pred(r.event)]


def test_a_short_request_behind_a_long_prefill_gets_its_first_token_first(runtime, prompts):
    long, short = prompts
    d, (r_long, r_short), (o_long, o_short) = _long_then_short(runtime, long, short, lanes=2)
    long_chunks = _at(d, "request.prefill_chunk", lambda e: e.request_id == r_long)
    (short_first,) = _at(d, "request.first_token", lambda e: e.request_id == r_short)
    assert short_first < long_chunks[-1]
    # the short lane also decoded between the long prompt's chunks
    short_lane = o_short[-1].lane
    rounds = _at(d, "scheduler.round", lambda e: short_lane in e.lanes)
    assert rounds and rounds[0] < long_chunks[-1]
    # the composition of every chunk: both lanes took turns while both prefilled
    chunks = d.rec.kinds("request.prefill_chunk")
    long_lane = o_long[-1].lane
    both = [c for c in chunks if c.request_id == r_short]
    assert all(c.prefill_lanes == [long_lane, short_lane] and c.prefill_queued == []
               for c in both)
    assert chunks[0].prefill_lanes == [long_lane]
    # the long one's prefill compute is its own chunks' passes, not the short lane's turns
    (fin,) = [f for f in d.rec.kinds("request.finished") if f.request_id == r_long]
    own = sum(c.duration_s for c in chunks if c.request_id == r_long)
    assert fin.timings["prefill_compute_s"] == pytest.approx(own, rel=1e-9)
    assert fin.timings["prefill_s"] > own + sum(c.duration_s for c in both)
    assert _ids(o_long) == _alone(runtime, long)
    assert _ids(o_short) == _alone(runtime, short)


def test_one_prefill_lane_keeps_the_long_prefill_first(runtime, prompts):
    long, short = prompts
    d, (r_long, r_short), (o_long, o_short) = _long_then_short(runtime, long, short, lanes=1)
    long_chunks = _at(d, "request.prefill_chunk", lambda e: e.request_id == r_long)
    short_chunks = _at(d, "request.prefill_chunk", lambda e: e.request_id == r_short)
    (short_first,) = _at(d, "request.first_token", lambda e: e.request_id == r_short)
    assert long_chunks[-1] < short_chunks[0] < short_first
    # while the long prompt prefilled, the short one's lane waited for a turn
    short_lane = o_short[-1].lane
    waited = [d.rec.items[i].event for i in long_chunks[1:]]
    assert waited and all(c.prefill_queued == [short_lane] for c in waited)
    assert _ids(o_long) == _alone(runtime, long)
    assert _ids(o_short) == _alone(runtime, short)


def test_the_serve_flag_reaches_the_scheduler_and_is_at_least_one(runtime):
    import argparse

    from ninfer.config import ServeConfig, add_serve_arguments, config_from_args
    from ninfer.engine.engine import EngineConfig
    from ninfer.server import build_server
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert config_from_args(parser.parse_args([])).max_prefill_lanes == 2
    cfg = config_from_args(parser.parse_args(["--max-prefill-lanes", "3", "--max-context",
                                              "256", "--max-concurrency", "2"]))
    assert build_server(cfg, runtime).engine.scheduler.max_prefill_lanes == 3
    with pytest.raises(ValueError, match="--max-prefill-lanes must be >= 1, got 0"):
        ServeConfig(max_prefill_lanes=0)
    with pytest.raises(ValueError, match="max_prefill_lanes must be >= 1, got 0"):
        EngineConfig(max_prefill_lanes=0)

"""Session-aware lane and tier policy (``prefix.ReusePolicy``, ``continuation.HostTier``):
a session's own lane (by its key) within its latest turn; lane choice by recompute cost, then
affinity, then recency; L2 shared fairly between sessions. The pure parts run without a
model; the last test drives more sessions than lanes through the real SmolLM2. The keys
themselves: ``tests/api/test_session_key.py``."""
from __future__ import annotations

import numpy as np
import pytest

from ninfer.engine.continuation import HostTier, LaneImage
from ninfer.engine.lanes import Lane
from ninfer.engine.prefix import ReusePolicy
from test_prefix_reuse import runtime  # noqa: F401  (the fixture, same folder)

POLICY = ReusePolicy(prefix_reuse=True, recurrent=False, page_size=16, min_restore_tokens=64)


def _retained(i, tokens, **kw) -> Lane:
    lane = Lane(i, tokens=list(tokens), num_computed=len(tokens), **kw)
    lane.pages = [0] * ((len(tokens) + 15) // 16)
    return lane


def test_a_root_key_takes_its_own_lane_only_within_its_latest_turn():
    # turn 1 left 226 tokens; turn 2 keeps the first 200 (the reminder was rewritten), and an
    # L2 image of the system prompt is not deeper: lane 0 is taken, cut back to 200
    prompt = np.arange(300, dtype=np.int64)
    own = _retained(0, list(range(200)) + [7] * 26, cache_key="root1", cached=0)
    empty = Lane(1)
    depth = POLICY.depths([own, empty], prompt, False)
    assert depth[0] == 200
    assert POLICY.choose([own, empty], depth, len(prompt)) is empty    # no key: a stranger's
    assert POLICY.choose([own, empty], depth, len(prompt), "root1", weak=True) is own
    # a deep session whose latest turn reused 1,000 tokens: a request sharing only its first
    # 200 (the same first message, another conversation) gets the empty lane
    deep = _retained(0, list(range(200)) + [7] * 1000, cache_key="root1", cached=1000)
    depth = POLICY.depths([deep, empty], prompt, False)
    assert not POLICY.own(deep, depth[0], "root1", weak=True)
    assert POLICY.own(deep, depth[0], "root1")   # a key the client names: its own history
    assert POLICY.choose([deep, empty], depth, len(prompt), "root1", weak=True) is empty


def test_with_no_empty_lane_the_recompute_cost_decides_then_recency():
    steep = ReusePolicy(True, False, 16, 64, horizon_tokens=50)
    assert steep.cost(0, 10) == pytest.approx(10 + 90 / 100)
    assert steep.cost(100, 110) > steep.cost(0, 10)   # deeper positions cost more
    prompt = np.arange(400, dtype=np.int64)
    # a saves 100 tokens and destroys 50 (net 50 tokens), b saves 30 and destroys none: by
    # token counts a would go; a's lost positions lie deep, so by recompute cost b goes
    a = _retained(0, list(range(100)) + [7] * 50, retained_t=1.0)
    b = _retained(1, range(30), retained_t=2.0)
    depth = steep.depths([a, b], prompt, False)
    assert (depth[0], depth[1]) == (100, 30)
    assert steep.cost(0, 100) - steep.cost(100, 150) < steep.cost(0, 30)
    assert steep.choose([a, b], depth, len(prompt)) is b
    # equal cost: the longest idle goes
    x = _retained(0, list(range(50)) + [7] * 10, retained_t=5.0)
    y = _retained(1, list(range(50)) + [9] * 10, retained_t=3.0)
    depth = steep.depths([x, y], prompt, False)
    assert steep.choose([x, y], depth, len(prompt)) is y


def _image(first: int, n: int = 10) -> LaneImage:
    return LaneImage(np.arange(first, first + n, dtype=np.int32),
                     np.zeros((1, n, 1, 4), np.float32), np.zeros((1, n, 1, 4), np.float32))


def test_l2_is_shared_fairly_between_sessions():
    one = _image(0).nbytes
    tier = HostTier(budget_bytes=4 * one)
    a = [_image(100 * i) for i in range(3)]
    for im in a:
        assert tier.put(im, "a")[0]
    b0 = _image(1000)
    tier.put(b0, "b")
    assert tier.shares() == {"a": 3 * one, "b": one}
    # b's next image needs room: a holds the most, so a's oldest goes, not b's older one
    b1 = _image(2000)
    ok, evicted, _ = tier.put(b1, "b")
    assert ok and evicted == [a[0]] and tier.shares() == {"a": 2 * one, "b": 2 * one}
    # at equal shares the least recently used image of them goes
    ok, evicted, _ = tier.put(_image(3000), "c")
    assert evicted == [a[1]]
    assert tier.best(np.arange(2000, 2020), 19, exact=False)[0] is b1   # b1 is now the newest
    ok, evicted, _ = tier.put(_image(4000), "c")
    assert evicted == [b0] and tier.shares() == {"a": one, "b": one, "c": 2 * one}


@pytest.mark.slow
def test_more_sessions_than_lanes_never_reprefill_from_zero(runtime):
    """Four tool-loop sessions sharing a system prompt, turns interleaved on two lanes (L2 on):
    every turn after a session's first reuses all it shares with that session's last frontier
    (from its lane or from L2), and L2 holds each displaced session under its own key."""
    from test_prefix_reuse import Driver, _common, _ids
    rt = runtime
    rng = np.random.default_rng(11)
    d = Driver(rt.model, rt.tokenizer, max_concurrency=2, max_context=512, l2_bytes=256 << 20)
    words = lambda n: rng.integers(100, 2000, n).tolist()   # noqa: E731
    system = words(80)
    tasks = [words(20) for _ in range(4)]
    hist: list[list] = [[] for _ in range(4)]
    last: list = [None] * 4   # each session's frontier after its latest turn
    kept = [0] * 4            # and how much of it the next turn carries unchanged
    for turn in range(3):
        for s in range(4):
            prompt = system + tasks[s] + hist[s] + words(8)   # a reminder rewritten per turn
            r, o = d.ask(prompt, max_tokens=2, ignore_eos=True, cache_key=f"k{s}",
                         session_kind="root")
            lk = d.lookup(r)
            if last[s] is not None:
                want = _common(last[s], prompt[:-1])
                assert want >= kept[s] > len(system)
                assert lk.cached_tokens == want, (turn, s, lk)
                assert d.prefilled(r) == len(prompt) - want
            last[s], kept[s] = prompt + _ids(o)[:-1], len(prompt) - 8
            hist[s] += words(12)   # the turn's tool call and result
    assert set(d.engine.l2.shares()) <= {f"k{s}" for s in range(4)}
    restored = [e for e in d.rec.kinds("cache.lookup") if e.source == "l2"]
    assert restored and all(e.cached_tokens > len(system) for e in restored)

"""LanePool with no model: one reset path for assign, release, truncate, evict and erase."""
from __future__ import annotations

import pytest

from ninfer.engine.lanes import Checkpoint, LanePool, MtpRows
from ninfer.engine.requests import Request
from ninfer.engine.sampling import SamplingParams


class _Bus:
    def __init__(self):
        self.events = []

    def emit_threadsafe(self, e):
        self.events.append(e)

    def kinds(self, kind):
        return [e for e in self.events if e.kind == kind]


class _StateSlots:
    """A hybrid KV cache's ``reset_state``, recorded."""

    def __init__(self):
        self.reset = []

    def reset_state(self, slot):
        self.reset.append(slot)


def _pool(recurrent=False, prefix_reuse=True):
    bus, kv = _Bus(), _StateSlots()
    return LanePool(kv, bus, num_lanes=2, num_pages=8, page_size=4, recurrent=recurrent,
                    prefix_reuse=prefix_reuse), bus, kv


def _serving(pool, n_tokens, computed):
    """Lane 0 serving a request of ``n_tokens`` tokens, ``computed`` of them computed."""
    lane = pool.lanes[0]
    req = Request("r", list(range(n_tokens)), SamplingParams(temperature=0.0), 4, lambda o: None)
    pool.assign(lane, req, tokenizer=None, vocab=16, spec=False, depth=0, now=1.0)
    pool.ensure_pages(lane, computed)
    lane.num_computed = computed
    return lane


def test_reset_cuts_pages_ledger_checkpoints_and_rows_back_to_a_depth():
    pool, _, _ = _pool()
    lane = _serving(pool, 14, 14)
    pool.release(lane, retain=True)
    lane.ckpt = Checkpoint(depth=6, conv=[], ssm=[], request_id="r")
    lane.anchor = Checkpoint(depth=12, conv=[], ssm=[], request_id="r")
    lane.mtp_pending, lane.persisted = MtpRows(start=13, hidden=None), 14
    assert len(lane.pages) == 4 and pool.pages.num_free == 4
    assert pool.reset(lane, 7) == 2
    assert lane.num_computed == 7 and lane.tokens == list(range(7)) and len(lane.pages) == 2
    assert lane.ckpt.depth == 6 and lane.anchor is None      # the deeper one is gone
    assert lane.mtp_pending is None and lane.persisted == 7
    pool.check_integrity()
    assert pool.reset(lane, 0) == 2
    assert (lane.pages, lane.tokens, lane.num_computed, lane.ckpt) == ([], [], 0, None)
    assert pool.pages.num_free == 8
    pool.check_integrity()


def test_release_retains_the_computed_prefix_or_frees_everything():
    pool, bus, _ = _pool()
    lane = _serving(pool, 10, 9)
    lane.tokens.append(99)        # a committed token whose K/V is not computed yet
    pool.release(lane, retain=True)
    assert lane.retained and lane.num_computed == 9 and lane.tokens == list(range(9))
    (ret,) = bus.kinds("lane.retained")
    assert ret.tokens == 9 and ret.pages == 3 and ret.pages_freed == 0
    pool.check_integrity()
    lane = _serving(pool, 10, 10)
    pool.release(lane)
    (rel,) = bus.kinds("lane.released")
    assert not lane.retained and rel.pages_freed == 3 and pool.pages.num_free == 8


def test_without_prefix_reuse_a_release_keeps_nothing():
    pool, bus, _ = _pool(prefix_reuse=False)
    lane = _serving(pool, 10, 10)
    pool.release(lane, retain=True)
    assert not lane.retained and bus.kinds("lane.released") and pool.pages.num_free == 8


def test_evict_demotes_first_and_truncate_only_when_a_page_goes():
    pool, bus, kv = _pool(recurrent=True)
    demoted = []
    pool.demote = lambda lane: demoted.append(lane.num_computed)
    lane = _serving(pool, 12, 12)
    pool.release(lane, retain=True)
    pool.truncate(lane, 10)       # drops 2 tokens: less than a page, kept in L1 only
    assert demoted == [] and lane.num_computed == 10
    pool.truncate(lane, 5)
    assert demoted == [10] and lane.num_computed == 5
    assert [e.reason for e in bus.kinds("lane.evicted")] == ["truncated", "truncated"]
    kv.reset.clear()
    pool.evict(lane, "reassigned")
    assert demoted == [10, 5] and not lane.retained and kv.reset == [0]
    assert bus.kinds("lane.evicted")[-1].tokens == 5


def test_erase_drops_a_session_without_demoting_it():
    pool, bus, _ = _pool()
    pool.demote = lambda lane: pytest.fail("an erase is not a demotion")
    lane = _serving(pool, 8, 8)
    pool.release(lane, retain=True)
    assert pool.erase(lane) == 8 and not lane.retained
    assert bus.kinds("lane.evicted")[-1].reason == "erased"
    assert pool.erase(lane) == 0


def test_check_integrity_finds_a_leaked_page():
    pool, _, _ = _pool()
    lane = _serving(pool, 8, 8)
    pool.release(lane, retain=True)
    lane.pages.pop()              # a page allocated but held by no lane
    with pytest.raises(RuntimeError, match="belong to no lane"):
        pool.check_integrity()

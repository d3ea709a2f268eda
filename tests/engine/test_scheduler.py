"""The scheduler and the reuse policy with no model: hand-made lanes and requests."""
from __future__ import annotations

import numpy as np

from ninfer.engine.lanes import Checkpoint, Lane
from ninfer.engine.prefix import ReusePolicy, at_checkpoint, reuse_path, rewind_point
from ninfer.engine.requests import Request
from ninfer.engine.sampling import SamplingParams
from ninfer.engine.scheduler import Deferral, Scheduler

GREEDY = SamplingParams(temperature=0.0)


def _req(rid, prompt, **kw) -> Request:
    return Request(rid, list(prompt), GREEDY, 8, lambda o: None, **kw)


def _busy(lane_id, req, computed) -> Lane:
    """A lane serving ``req`` with ``computed`` prompt tokens done."""
    return Lane(lane_id, req=req, tokens=list(req.prompt_ids), prompt_len=len(req.prompt_ids),
                num_computed=computed)


def _retained(lane_id, tokens, retained_t=0.0, **kw) -> Lane:
    return Lane(lane_id, tokens=list(tokens), num_computed=len(tokens), retained_t=retained_t,
                **kw)


def test_enqueue_refuses_empty_and_too_long_prompts():
    s = Scheduler([Lane(0)], max_context=8)
    assert not s.enqueue(_req("empty", []))
    assert not s.enqueue(_req("long", range(8)))     # no room for one output token
    assert s.enqueue(_req("ok", range(7)))
    assert [r.request_id for r in s.waiting] == ["ok"]


def test_remove_takes_a_waiting_request_out():
    s = Scheduler([Lane(0)], max_context=64)
    for rid in "abc":
        s.enqueue(_req(rid, [1, 2]))
    assert s.remove("b").request_id == "b"
    assert s.remove("b") is None
    assert [r.request_id for r in s.waiting] == ["a", "c"]


def test_expire_spares_deferred_requests_and_those_a_free_lane_is_there_for():
    busy = _busy(1, _req("x", [1, 2, 3]), 1)
    s = Scheduler([Lane(0), busy], max_context=64)
    for rid in ("first", "late", "deferred", "fresh"):
        s.enqueue(_req(rid, [1, 2], deadline=None if rid == "fresh" else 10.0))
    s.deferrals["deferred"] = Deferral(lane=1, request_id="x", depth=2)
    out = s.expire(now=11.0)
    # one lane is free: the first in the queue keeps its chance; the deferred one waits on
    assert [r.request_id for r in out] == ["late"]
    assert [r.request_id for r in s.waiting] == ["first", "deferred", "fresh"]
    assert s.expire(now=9.0) == []


def _admit(defer) -> tuple[list, list]:
    """Admit "a", "b", "c" into two free lanes; (what admit_one saw, what still waits)."""
    s = Scheduler([Lane(0), Lane(1)], max_context=64)
    for rid in "abc":
        s.enqueue(_req(rid, [1, 2]))
    taken = []

    def admit_one(req, free):
        taken.append((req.request_id, [ln.id for ln in free]))
        free[0].req = req

    s.admit(admit_one, defer)
    return taken, [r.request_id for r in s.waiting]


def test_admit_offers_requests_in_order_while_lanes_are_free():
    taken, waiting = _admit(lambda req, free: False)
    assert taken == [("a", [0, 1]), ("b", [1])]
    assert waiting == ["c"]


def test_a_deferred_request_keeps_its_place_and_a_free_lane_as_its_claim():
    taken, waiting = _admit(lambda req, free: req.request_id == "a")
    assert taken == [("b", [0, 1])]            # the last free lane is a's claim: c waits
    assert waiting == ["a", "c"]


def test_admit_drops_deferral_records_of_requests_no_longer_waiting():
    s = Scheduler([Lane(0)], max_context=64)
    s.enqueue(_req("a", [1, 2]))
    s.deferrals["gone"] = Deferral(lane=0, request_id="x", depth=4)
    s.admit(lambda req, free: setattr(free[0], "req", req), defer=lambda req, free: False)
    assert s.deferrals == {}


def test_defer_waits_for_a_builder_of_a_shared_unpublished_breakpoint():
    prompt = list(range(100))
    builder = _busy(0, _req("b", prompt + [7], publish_at=(64,)), 32)
    events = []
    s = Scheduler([builder, Lane(1)], max_context=256, emit=events.append)
    req = _req("w", prompt + [9], publish_at=(64,))

    def defer(eligible=True, fits=True, unpublished=True, reused=0):
        return s.defer(req, eligible, fits=lambda d: fits,
                       unpublished=lambda ln, d: unpublished, reused=lambda: reused)

    assert not defer(eligible=False)
    assert not defer(fits=False)               # its image could never become visible in L2
    assert not defer(unpublished=False)        # every tier holds it already
    assert not defer(reused=64)                # the lane it takes holds that much already
    assert s.deferrals == {} and events == []
    assert defer()
    assert s.deferrals["w"] == Deferral(lane=0, request_id="b", depth=64)
    assert [(e.builder_lane, e.builder_request, e.tokens) for e in events] == [(0, "b", 64)]
    assert defer(eligible=False)               # a recorded builder holds until it gets there
    builder.num_computed = 64
    assert not s.deferral_holds("w") and not defer()


def test_defer_waits_for_a_plain_builder_that_reused_the_breakpoint():
    """A builder that reused exactly the breakpoint (its lane held it) publishes it before its
    first chunk (``Unit.publish_first``); a speculative one keeps no MTP row there: no wait."""
    prompt = list(range(100))
    builder = _busy(0, _req("b", prompt + [7], publish_at=(64,)), 64)
    builder.cached = 64
    s = Scheduler([builder, Lane(1)], max_context=256)
    req = _req("w", prompt + [9], publish_at=(64,))

    def defer():
        return s.defer(req, True, fits=lambda d: True, unpublished=lambda ln, d: True,
                       reused=lambda: 0)
    builder.spec = True
    assert not defer()
    builder.spec = False
    assert defer() and s.deferrals["w"] == Deferral(0, "b", 64, at_frontier=True)
    unit = s.next_unit()
    assert unit.prefill is builder and unit.publish_first == 64
    assert s.deferral_holds("w")
    builder.num_computed = 65   # (its chunk ran)
    assert not s.deferral_holds("w") and not defer()
    builder.num_computed, builder.cached = 64, 32   # reached by its own chunk: published then
    assert not defer() and s.next_unit().publish_first is None


def test_defer_needs_the_same_tokens_up_to_the_breakpoint():
    builder = _busy(0, _req("b", list(range(100)), publish_at=(64,)), 10)
    s = Scheduler([builder, Lane(1)], max_context=256)
    other = _req("w", [5] + list(range(1, 100)), publish_at=(64,))
    assert not s.defer(other, True, fits=lambda d: True, unpublished=lambda ln, d: True,
                       reused=lambda: 0)


def test_next_unit_alternates_prefill_chunks_and_decode_rounds():
    pre = _busy(0, _req("p", [1, 2, 3, 4]), 1)
    pre.admitted_t = 2.0
    older = _busy(2, _req("o", [1, 2, 3, 4]), 0)
    older.admitted_t = 1.0
    dec = _busy(1, _req("d", [1, 2]), 2)
    s = Scheduler([pre, dec, older], max_context=64, max_prefill_lanes=1)
    first, second, third = s.next_unit(), s.next_unit(), s.next_unit()
    assert first.prefill is older and not first.decode      # the oldest admission first
    assert second.prefill is None and second.decode == (dec,)
    assert third.prefill is older
    assert (third.prefill_lanes, third.prefill_queued) == ((2,), (0,))
    assert Scheduler([Lane(0)], max_context=64).next_unit() is None
    only = Scheduler([dec], max_context=64)
    assert only.next_unit().decode == (dec,) and only.next_unit().decode == (dec,)


def _prefilling(lane_id, admitted_t, prompt_len=64) -> Lane:
    lane = _busy(lane_id, _req(f"p{lane_id}", range(prompt_len)), 0)
    lane.admitted_t = admitted_t
    return lane


def _prefill_order(s: Scheduler, n: int) -> list:
    """The lane ids of the next ``n`` prefill units (decode units skipped); each chosen lane
    computes 16 tokens, as a chunk would."""
    out = []
    while len(out) < n:
        unit = s.next_unit()
        if unit is None:
            break
        if unit.prefill is not None:
            out.append(unit.prefill.id)
            unit.prefill.num_computed = min(unit.prefill.prompt_len,
                                            unit.prefill.num_computed + 16)
    return out


def test_prefilling_lanes_take_chunk_turns_in_round_robin_oldest_admission_first():
    a, b, c = _prefilling(0, 3.0), _prefilling(1, 1.0), _prefilling(2, 2.0)
    s = Scheduler([a, b, c], max_context=256, max_prefill_lanes=3)
    assert _prefill_order(s, 7) == [1, 2, 0, 1, 2, 0, 1]
    unit = s.next_unit()
    assert unit.prefill_lanes == (1, 2, 0) and unit.prefill_queued == ()


def test_at_most_max_prefill_lanes_take_turns_and_the_next_admitted_follows():
    a, b, c = _prefilling(0, 1.0, 32), _prefilling(1, 2.0, 48), _prefilling(2, 3.0, 32)
    s = Scheduler([a, b, c], max_context=256, max_prefill_lanes=2)
    first = s.next_unit()
    assert first.prefill is a and (first.prefill_lanes, first.prefill_queued) == ((0, 1), (2,))
    a.num_computed = 16
    # lane 0 is done after two chunks; lane 2 then joins the turns behind lane 1
    assert _prefill_order(s, 6) == [1, 0, 1, 2, 1, 2]
    assert not any(ln.prefilling for ln in (a, b, c))
    assert s.next_unit().decode == (a, b, c)


def test_a_lane_admitted_later_joins_the_round_robin_at_its_end():
    a, b = _prefilling(0, 1.0), _prefilling(1, 2.0)
    s = Scheduler([a, b, Lane(2)], max_context=256, max_prefill_lanes=3)
    assert _prefill_order(s, 3) == [0, 1, 0]
    s.lanes[2] = _prefilling(2, 5.0)
    assert _prefill_order(s, 4) == [1, 2, 0, 1]


def test_one_prefill_lane_is_the_old_order_whatever_the_admissions():
    lanes = [_prefilling(0, 2.0, 32), _prefilling(1, 1.0, 32), _prefilling(2, 1.0, 32)]
    s = Scheduler(lanes, max_context=256, max_prefill_lanes=1)
    # the oldest admission's whole prompt first (ties: the lower lane id), then the next
    assert _prefill_order(s, 6) == [1, 1, 2, 2, 0, 0]
    assert Scheduler(lanes, max_context=256).max_prefill_lanes == 1


def test_decode_rounds_run_between_the_chunks_of_every_prefilling_lane():
    a, b = _prefilling(0, 1.0), _prefilling(1, 2.0)
    dec = _busy(2, _req("d", [1, 2]), 2)
    s = Scheduler([a, b, dec], max_context=256, max_prefill_lanes=2)
    kinds = []
    for _ in range(8):
        unit = s.next_unit()
        kinds.append(unit.prefill.id if unit.prefill is not None else "d")
        if unit.prefill is not None:
            unit.prefill.num_computed += 16
    assert kinds == [0, "d", 1, "d", 0, "d", 1, "d"]


POLICY = ReusePolicy(prefix_reuse=True, recurrent=False, page_size=16, min_restore_tokens=64)


def test_reuse_depth_is_the_common_prefix_but_never_the_prompts_last_token():
    prompt = np.arange(200, dtype=np.int64)
    lane = _retained(0, range(150))
    assert POLICY.depth(lane, prompt, spec=False) == 150
    assert POLICY.depth(_retained(0, range(300)), prompt, spec=False) == 199
    cut = _retained(0, list(range(100)) + [9999] * 20)
    assert POLICY.depth(cut, prompt, spec=False) == 100
    off = ReusePolicy(prefix_reuse=False, recurrent=False, page_size=16, min_restore_tokens=64)
    assert off.depth(lane, prompt, spec=False) == 0
    assert POLICY.depth(lane, prompt, spec=True) == 0        # no MTP rows kept


def test_a_hybrid_lane_reuses_only_its_frontier_or_a_turn_checkpoint():
    hybrid = ReusePolicy(prefix_reuse=True, recurrent=True, page_size=16, min_restore_tokens=64)
    prompt = np.arange(300, dtype=np.int64)
    tokens = list(range(100)) + [9999] * 50
    lane = _retained(0, tokens)
    assert hybrid.depth(lane, prompt, spec=False) == 0
    ck = Checkpoint(depth=100, conv=[], ssm=[], request_id="r1")
    lane = _retained(0, tokens, ckpt=ck, last_request="r1")
    assert hybrid.depth(lane, prompt, spec=False) == 100
    assert rewind_point(lane, 100) == ("turn", ck) and rewind_point(lane, 99) is None
    assert at_checkpoint(lane, 100, len(prompt))


def test_choose_prefers_an_empty_lane_to_cutting_back_a_session():
    prompt = np.arange(200, dtype=np.int64)
    header = _retained(0, list(range(40)) + [7] * 200)    # shares a short header only
    empty = Lane(1)
    free = [header, empty]
    depth = POLICY.depths(free, prompt, False)
    assert POLICY.choose(free, depth, len(prompt)) is empty
    extends = _retained(0, range(120))
    depth = POLICY.depths([extends, empty], prompt, False)
    assert POLICY.choose([extends, empty], depth, len(prompt)) is extends


def test_choose_with_no_empty_lane_destroys_the_fewest_tokens_net():
    prompt = np.arange(200, dtype=np.int64)
    a = _retained(0, list(range(30)) + [7] * 300, retained_t=1.0)   # saves 30, loses 300
    b = _retained(1, list(range(20)) + [7] * 10, retained_t=2.0)    # saves 20, loses 10
    depth = POLICY.depths([a, b], prompt, False)
    assert POLICY.choose([a, b], depth, len(prompt)) is b


def test_the_clients_own_session_is_taken_under_its_key():
    prompt = np.arange(200, dtype=np.int64)
    own = _retained(0, list(range(100)) + [7] * 300, cache_key="k")   # rewritten tail
    empty = Lane(1)
    depth = POLICY.depths([own, empty], prompt, False)
    assert POLICY.choose([own, empty], depth, len(prompt)) is empty
    assert POLICY.choose([own, empty], depth, len(prompt), key="k") is own
    assert POLICY.own(own, depth[0], "k") and not POLICY.own(own, depth[0], "other")


def test_reuse_path_names_what_a_lookup_did():
    assert reuse_path(False, 0, 0) == "disabled"
    assert reuse_path(True, 0, 50) == "full_reset"
    assert reuse_path(True, 50, 50) == "append_frontier"
    assert reuse_path(True, 30, 50) == "truncate_frontier"

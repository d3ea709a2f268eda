"""The serving fold's views — ``/metrics`` text, ``/telemetry``, ``/slots``, the dashboard and
its counters — for two fixed logs, against what the three separate folds before the redesign
gave for them (``tests/fixtures/replay/events/expected.json``, captured at 23ba198, plus the
later ``ninfer:kv_cache_usage_perc`` gauge and ``ninfer:spec_decode_*`` counters): the same
bytes, key order included, by replay and by the live sink."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ninfer.events.codec import decode_line
from ninfer.events.dashboard import dashboard_view
from ninfer.events.fold import ServingState, fold_or_skip
from ninfer.events.metrics import counters, metrics_text
from ninfer.events.sinks import FoldSink
from ninfer.events.telemetry import slots_table, telemetry_snapshot
from ninfer.replay import replay_log, report

EVENTS = Path(__file__).resolve().parents[1] / "fixtures" / "replay" / "events"
EXPECTED = json.loads((EVENTS / "expected.json").read_text(encoding="utf-8"))


def _dump(value) -> str:
    return json.dumps(value)   # (not sorted: the key order is part of what is served)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_replayed_views_are_the_old_folds_byte_for_byte(case):
    log, _, cut = case.partition("@")
    res = replay_log(EVENTS / log, upto_seq=None if cut == "end" else int(cut))
    text, snapshot, _ = report(res)
    want = EXPECTED[case]
    assert text == want["metrics"]
    assert _dump(snapshot) == _dump(want["telemetry"])
    assert _dump(slots_table(res.state)) == _dump(want["slots"])
    assert _dump(dashboard_view(res.state)) == _dump(want["dashboard"])
    assert _dump(counters(res.state)) == _dump(want["counters"])


@pytest.mark.parametrize("log", ["serve.jsonl", "rare.jsonl"])
def test_the_live_sink_folds_a_log_as_replay_does(log):
    """The sink the server runs, fed the replayed instance's records one by one."""
    res = replay_log(EVENTS / log)
    sink = FoldSink("serving", fold_or_skip, ServingState())
    for line in (EVENTS / log).read_text(encoding="utf-8").splitlines():
        try:
            rec = decode_line(line)
        except ValueError:   # the unknown kind and the torn line, which replay skips too
            continue
        if rec.instance == res.instance:
            sink.write(rec, line)
    assert sink.state == res.state
    max_conc = sink.state.config["max_concurrency"]
    assert metrics_text(sink.state, max_conc) == EXPECTED[f"{log}@end"]["metrics"]
    want = dict(EXPECTED[f"{log}@end"]["telemetry"])
    del want["replay"]
    assert _dump(telemetry_snapshot(sink.state)) == _dump(want)


def _samples(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    return {s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.mark.parametrize("side", ["replay", "live"])
def test_the_recorded_log_folds_to_the_counts_read_off_it_by_hand(side):
    """serve.jsonl by hand: 9 requests received, 2 more refused (queue full), 9 admitted on
    lanes 0 and 1, 8 finished with 53 tokens and 1 cancelled after 4 (57 generated: 9 first
    tokens + 48 in 37 decode rounds), 9 prefill chunks of 120 tokens; 9 lookups, 8 reusing
    236 tokens (6 from retained lanes: 44+24+30+30+24+24, one L2 image of 36, one L3 of 24);
    5 retained prefixes cut back and 1 dropped; lane 0 ends retaining 46 tokens, lane 1 41."""
    res = replay_log(EVENTS / "serve.jsonl")
    state = res.state
    if side == "live":
        sink = FoldSink("serving", fold_or_skip, ServingState())
        for line in (EVENTS / "serve.jsonl").read_text(encoding="utf-8").splitlines():
            sink.write(decode_line(line), line)
        state = sink.state
    m = _samples(metrics_text(state, 2))
    assert m["ninfer:requests_received_total"] == 9
    assert m["ninfer:requests_rejected_total{code=server_overloaded}"] == 2
    assert m["ninfer:requests_total{finish=finished}"] == 8
    assert m["ninfer:requests_total{finish=cancelled}"] == 1
    assert m["ninfer:requests_total{finish=failed}"] == 0
    assert m["llamacpp:tokens_predicted_total"] == 57 == 53 + 4
    assert m["ninfer:decode_rounds_total"] == 37 and m["ninfer:prefill_chunks_total"] == 9
    assert m["llamacpp:n_decode_total"] == 46
    assert m["llamacpp:prompt_tokens_total"] == 120
    assert m["ninfer:request_queue_time_seconds_count"] == 9
    assert m["ninfer:e2e_request_latency_seconds_count"] == 8
    assert m["ninfer:continuation_lookup_hits_total"] == 8
    assert m["ninfer:continuation_lookup_misses_total"] == 1
    assert m["ninfer:prefix_cache_hits_total"] == 236
    assert m["ninfer:continuation_l1_restore_successes_total"] == 6
    assert m["ninfer:continuation_l1_restored_tokens_total"] == 176
    assert m["ninfer:continuation_l2_restored_tokens_total"] == 36
    assert m["ninfer:continuation_l3_restored_tokens_total"] == 24
    assert m["ninfer:l1_evictions_total"] == 1 and m["ninfer:continuation_l3_entries"] == 6
    assert m["ninfer:l1_resident_entries"] == 2 and m["ninfer:l1_resident_tokens"] == 87
    t = telemetry_snapshot(state)
    assert t["scheduler"]["admitted_requests"] == 9 and t["scheduler"]["running"] == 0
    assert t["scheduler"]["decode_row_rounds"] == sum(
        len(decode_line(x).event.lanes) for x in (EVENTS / "serve.jsonl").read_text(
            encoding="utf-8").splitlines() if '"kind":"scheduler.round"' in x)
    assert t["cache"]["l1"]["truncations"] == 5
    assert [s["retained_tokens"] for s in t["slots"]] == [46, 41]
    d = dashboard_view(state)
    assert len(d["requests"]) == 11
    assert sorted(r["state"] for r in d["requests"]) == (["cancelled"] + ["finished"] * 8
                                                         + ["rejected"] * 2)
    assert d["latency"]["requests"] == 8


def test_kv_cache_usage_counts_the_pages_running_requests_hold():
    """rare.jsonl at seq 40: its last ``telemetry.sample`` (seq 29) saw 2 running requests, 26
    of 32 pages free, none retained: 6 / 32 in use. At its end nothing runs: 0, whatever that
    sample said. serve.jsonl ends idle too (its retained pages count as free)."""
    at40 = _samples(report(replay_log(EVENTS / "rare.jsonl", upto_seq=40))[0])
    assert at40["ninfer:kv_cache_usage_perc"] == 6 / 32
    for log in ("rare.jsonl", "serve.jsonl"):
        end = _samples(report(replay_log(EVENTS / log))[0])
        assert end["ninfer:kv_cache_usage_perc"] == 0.0

"""One error policy for the serving fold, live and in replay: a record the fold raises on is
skipped whole and counted (``/telemetry`` ``events.fold_errors``); live, the sink stays
attached and one ``fold.failed`` record says which record it was."""
from __future__ import annotations

from ninfer.events import schema as ev
from ninfer.events.bus import EventBus
from ninfer.events.fold import ServingState, fold_or_skip
from ninfer.events.metrics import metrics_text
from ninfer.events.sinks import FoldSink, JsonlSink
from ninfer.events.telemetry import telemetry_snapshot
from ninfer.replay import replay_log

STARTED = ev.ServerStarted(config={"max_concurrency": 1, "max_context": 64}, artifact={},
                           environment={}, memory={}, argv=[])
TIMINGS = {"queue_s": 0.0, "prefill_s": 0.1, "decode_s": 0.2, "ttft_s": 0.1, "total_s": 0.3}


def _request(rid: str, timings: dict) -> list:
    return [ev.RequestReceived(request_id=rid, protocol="chat", model="m", stream=False,
                               message_count=1, prompt_tokens=5, max_tokens=2,
                               max_tokens_source="request", sampling={}),
            ev.RequestAdmitted(request_id=rid, lane=0, queue_s=0.0),
            ev.RequestFirstToken(request_id=rid, lane=0, ttft_s=0.1),
            ev.RequestFinished(request_id=rid, lane=0, finish_reason="stop_token",
                               prompt_tokens=5, cached_tokens=0, completion_tokens=1,
                               timings=timings)]


# the middle request's finish lacks total_s (a hand-edited log): the fold raises on it
EVENTS = [STARTED, *_request("a", TIMINGS),
          *_request("bad", {k: v for k, v in TIMINGS.items() if k != "total_s"}),
          *_request("c", TIMINGS)]


def _check(state: ServingState) -> None:
    """What both paths must give: the bad record alone skipped, everything after it folded."""
    assert state.fold_errors == 1
    t = telemetry_snapshot(state)
    assert t["events"]["fold_errors"] == 1
    assert t["scheduler"]["finished_requests"] == 2 and t["scheduler"]["admitted_requests"] == 3
    assert t["scheduler"]["running"] == 0   # lane 0 went on to "c", which ended
    text = metrics_text(state, 1)
    assert "ninfer:e2e_request_latency_seconds_count 2.0" in text
    assert "ninfer:num_requests_running 1.0" in text   # "bad" never ended, for the folds


async def test_live_a_fold_error_skips_the_record_keeps_the_sink_and_is_recorded(tmp_path):
    log = tmp_path / "log.jsonl"
    bus = EventBus()
    sink = FoldSink("serving", fold_or_skip, ServingState(), report=bus.emit_threadsafe)
    bus.add_sink(JsonlSink(log))
    bus.add_sink(sink)
    bus.attach()
    for e in EVENTS:
        bus.emit(e)
    bus.flush()
    assert sink in bus.sinks
    _check(sink.state)
    failed = [r for r in _records(log) if r.kind == "fold.failed"]
    assert len(failed) == 1
    bad_seq = failed[0].event.seq
    assert _records(log)[bad_seq - 1].event.request_id == "bad"
    assert failed[0].event.record_kind == "request.finished"
    assert "KeyError" in failed[0].event.error and "total_s" in failed[0].event.error
    # ... and replaying that log (the fold.failed record included) gives the live state
    res = replay_log(log)
    assert res.state == sink.state
    assert res.malformed_lines == 1 and res.fold_failures[0][:2] == (bad_seq, "request.finished")


def test_replay_a_fold_error_skips_the_record_and_goes_on(tmp_path):
    from ninfer.events.codec import encode_line
    log = tmp_path / "log.jsonl"
    log.write_text("".join(encode_line(ev.Record(ev.SCHEMA_VERSION, i, 1.0 + i, "i", e)) + "\n"
                           for i, e in enumerate(EVENTS, start=1)), encoding="utf-8")
    res = replay_log(log)
    _check(res.state)
    assert res.records == len(EVENTS) - 1 and res.malformed_lines == 1
    assert res.state.records == len(EVENTS) and res.state.last_seq == len(EVENTS)


def _records(path) -> list:
    from ninfer.events.codec import decode_line
    return [decode_line(x) for x in path.read_text(encoding="utf-8").splitlines()]

"""Event log: schema registry, codec round trips, gap-free seq, thread handoff, sinks."""
from __future__ import annotations

import json
import threading

import pytest
import trio

from ninfer.events import schema as ev
from ninfer.events.bus import EventBus
from ninfer.events.codec import decode_line, decode_msgpack, encode_line, encode_msgpack
from ninfer.events.sinks import FoldSink, JsonlSink, SseHub


def _sample_events():
    return [
        ev.RequestReceived(request_id="r1", protocol="openai_chat_completions", model="m",
                           stream=True, message_count=2, prompt_tokens=17, max_tokens=32,
                           max_tokens_source="client",
                           sampling={"temperature": 0.5, "seed": 3}),
        ev.RequestAdmitted(request_id="r1", lane=0, queue_s=0.25),
        ev.RequestPrefillChunk(request_id="r1", lane=0, tokens=17, done_tokens=17,
                               prompt_tokens=17, duration_s=0.125),
        ev.RequestFirstToken(request_id="r1", lane=0, ttft_s=0.5),
        ev.SchedulerRound(round=1, lanes=[0, 1], tokens=2, duration_s=0.01, itl_s=[0.01, 0.02],
                          waiting=3),
        ev.RequestFinished(request_id="r1", lane=0, finish_reason="stop_token", prompt_tokens=17,
                           cached_tokens=0, completion_tokens=5,
                           timings={"queue_s": 0.1, "prefill_s": 0.2, "decode_s": 0.3,
                                    "ttft_s": 0.3,
                            "total_s": 0.6}),
        ev.RequestFailed(request_id="r2", lane=1, code="kv_cache_full", message="no pages",
                         completion_tokens=3),
        ev.RequestCancelled(request_id="r3", lane=-1, completion_tokens=0),
        ev.SinkFailed(sink="jsonl", error="OSError: disk full"),
    ]


def test_registry_names_every_kind_once():
    kinds = ev.all_kinds()
    assert len(kinds) == len(set(kinds))
    for k in ("server.started", "request.received", "request.admitted", "request.prefill_chunk",
              "request.first_token", "request.finished", "request.failed",
              "request.cancelled", "scheduler.round"):
        assert k in kinds


def test_json_and_msgpack_round_trip_is_lossless():
    for i, e in enumerate(_sample_events()):
        rec = ev.Record(ev.SCHEMA_VERSION, i + 1, 1700000000.123456 + i, "serve-1-2", e)
        line = encode_line(rec)
        assert "\n" not in line
        assert decode_line(line) == rec
        assert encode_line(decode_line(line)) == line
        assert decode_msgpack(encode_msgpack(rec)) == rec
        d = json.loads(line)
        assert list(d)[:5] == ["schema_version", "seq", "ts", "instance", "kind"]
        assert d["kind"] == e.kind


def test_decode_rejects_unknown_kind_newer_schema_and_garbage():
    rec = ev.Record(ev.SCHEMA_VERSION, 1, 1.0, "i", ev.RequestAdmitted(request_id="r", lane=0,
                                                                       queue_s=0.0))
    d = json.loads(encode_line(rec))
    with pytest.raises(ev.UnknownEventKind):
        decode_line(json.dumps({**d, "kind": "request.teleported"}))
    with pytest.raises(ev.SchemaTooNew):
        decode_line(json.dumps({**d, "schema_version": ev.SCHEMA_VERSION + 1}))
    with pytest.raises(ev.SchemaError):
        decode_line('{"schema_version":1,"seq":1')
    with pytest.raises(ev.SchemaError):
        decode_line(json.dumps({k: v for k, v in d.items() if k != "lane"}))


def test_a_cache_lookup_from_before_resumed_from_still_decodes():
    """``resumed_from`` (and ``lane.retained``'s ``ring_tokens``) came with defaults, without a
    schema bump: a version 2 record written before them decodes, the field empty."""
    line = ('{"schema_version":2,"seq":5,"ts":1.5,"instance":"i","kind":"cache.lookup",'
            '"request_id":"r","lane":0,"prompt_tokens":37,"cached_tokens":0,'
            '"path":"full_reset","candidates":0,"source":"none","routed":false}')
    rec = decode_line(line)
    assert rec.schema_version == ev.SCHEMA_VERSION == 2
    assert (rec.event.resumed_from, rec.event.shared_tokens) == ("", 0)
    ret = decode_line('{"schema_version":2,"seq":6,"ts":1.5,"instance":"i",'
                      '"kind":"lane.retained","lane":0,"request_id":"r","tokens":40,"pages":3,'
                      '"pages_freed":0,"free_pages":9,"session_digest":"0123456789abcdef"}')
    assert ret.event.ring_tokens == []


class _Collect:
    name = "collect"

    def __init__(self):
        self.items = []

    def write(self, record, line):
        self.items.append((record, line))


async def test_seq_is_gap_free_across_trio_and_thread_producers():
    bus = EventBus("test-instance")
    sink = _Collect()
    bus.add_sink(sink)
    bus.attach()
    n_thread = 2000

    def producer():
        for i in range(n_thread):
            bus.emit_threadsafe(ev.RequestAdmitted(request_id=f"t{i}", lane=0, queue_s=0.0))

    th = threading.Thread(target=producer)
    th.start()
    for i in range(100):
        bus.emit(ev.RequestAdmitted(request_id=f"m{i}", lane=1, queue_s=0.0))
        await trio.sleep(0)
    await trio.to_thread.run_sync(th.join)
    bus.flush()   # what the thread queued and trio has not dispatched yet
    seqs = [r.seq for r, _ in sink.items]
    assert seqs == list(range(1, n_thread + 100 + 1))
    thread_ids = [r.event.request_id for r, _ in sink.items if r.event.request_id[0] == "t"]
    assert thread_ids == [f"t{i}" for i in range(n_thread)]  # per-producer order kept
    assert all(r.instance == "test-instance" for r, _ in sink.items)


async def test_jsonl_line_is_byte_identical_to_sse_data(tmp_path):
    bus = EventBus()
    path = tmp_path / "log.jsonl"
    jsonl = JsonlSink(path)
    hub = SseHub()
    bus.add_sink(jsonl)
    bus.add_sink(hub)
    bus.attach()
    sub = hub.subscribe()
    for e in _sample_events():
        bus.emit(e)
    items = await hub.next_items(sub, 1.0)
    jsonl.close()
    file_lines = path.read_text(encoding="utf-8").splitlines()
    assert [it.line for it in items] == file_lines
    assert [it.kind for it in items] == [e.kind for e in _sample_events()]
    assert [it.event_id for it in items] == [f"{bus.instance}:{json.loads(x)['seq']}"
                                             for x in file_lines]


def test_a_log_reopened_after_a_torn_write_appends_on_a_line_of_its_own(tmp_path, capsys):
    """A writer killed mid-record leaves a torn last line: the next server's sink cuts it
    (saying so) so that its first record is not glued onto it; a whole file is left as is,
    and a file of one torn line is emptied."""
    from ninfer.events.codec import encode_line
    path = tmp_path / "log.jsonl"
    first = encode_line(ev.Record(ev.SCHEMA_VERSION, 1, 1.0, "old", ev.RequestAdmitted(
        request_id="a", lane=0, queue_s=0.0)))
    path.write_text(first + "\n" + first[:-50])
    sink = JsonlSink(path)
    assert "cut " + str(len(first) - 50) + " bytes of a torn last line" in capsys.readouterr().err
    rec = ev.Record(ev.SCHEMA_VERSION, 1, 2.0, "new", ev.RequestAdmitted(request_id="b", lane=1,
                                                                         queue_s=0.0))
    sink.write(rec, encode_line(rec))
    sink.close()
    assert path.read_text().splitlines() == [first, encode_line(rec)]
    JsonlSink(path).close()   # whole lines: nothing cut, nothing said
    assert path.read_text().splitlines() == [first, encode_line(rec)]
    assert capsys.readouterr().err == ""
    path.write_text(first[:30])
    JsonlSink(path).close()
    assert path.read_text() == ""
    import os

    from ninfer.events.sinks import _cut_torn_tail
    path.write_text("ab\n" + "x" * 40)   # the newline found blocks back from the end
    fd = os.open(path, os.O_RDWR)
    assert _cut_torn_tail(fd, block=7) == 40
    os.close(fd)
    assert path.read_text() == "ab\n"


async def test_jsonl_on_a_full_disk_keeps_whole_lines_and_says_so(tmp_path, monkeypatch,
                                                                   capsys):
    """A write that the file system cuts short (ENOSPC after part of a line) is cut back to
    the last whole line, one console error names the file, and the bus disables the sink."""
    import errno
    import os
    path = tmp_path / "log.jsonl"
    jsonl = JsonlSink(path)
    bus = EventBus()
    good = _Collect()
    bus.add_sink(jsonl)
    bus.add_sink(good)
    bus.attach()
    bus.emit(ev.RequestAdmitted(request_id="a", lane=0, queue_s=0.0))
    real_write = os.write

    def nearly_full(fd, data):
        if fd != jsonl._fd:
            return real_write(fd, data)
        if len(data) > 5:
            return real_write(fd, data[:5])   # part of the line fits
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", nearly_full)
    bus.emit(ev.RequestAdmitted(request_id="b", lane=0, queue_s=0.0))
    monkeypatch.setattr(os, "write", real_write)
    bus.emit(ev.RequestAdmitted(request_id="c", lane=0, queue_s=0.0))
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    assert len(lines) == 1 and lines[0].endswith("\n") and '"a"' in lines[0]
    assert [r.kind for r, _ in good.items] == ["request.admitted", "request.admitted",
                                               "sink.failed", "request.admitted"]
    err = capsys.readouterr().err
    assert err.count("ninfer: request log") == 1 and str(path) in err and "No space" in err


async def test_failing_sink_is_disabled_and_recorded_while_others_continue(tmp_path):
    class DiskFull:
        name = "jsonl"

        def write(self, record, line):
            raise OSError(28, "No space left on device")

    bus = EventBus()
    good = _Collect()
    bus.add_sink(DiskFull())
    bus.add_sink(good)
    bus.attach()
    bus.emit(ev.RequestAdmitted(request_id="a", lane=0, queue_s=0.0))
    bus.emit(ev.RequestAdmitted(request_id="b", lane=0, queue_s=0.0))
    kinds = [r.kind for r, _ in good.items]
    assert kinds == ["request.admitted", "sink.failed", "request.admitted"]
    failed = good.items[1][0].event
    assert failed.sink == "jsonl" and "No space left" in failed.error
    assert [r.seq for r, _ in good.items] == [1, 2, 3]


async def test_slow_sse_subscriber_gets_gap_record_and_never_blocks_producer():
    hub = SseHub(ring_size=8, queue_limit=16)
    bus = EventBus()
    bus.add_sink(hub)
    bus.attach()
    sub = hub.subscribe()
    for i in range(10_000):  # the subscriber never reads while these flow
        bus.emit(ev.RequestAdmitted(request_id=f"r{i}", lane=0, queue_s=0.0))
    items = await hub.next_items(sub, 0.1)
    assert items[0][0] == "gap"
    assert json.loads(items[0][1])["dropped"] == 10_000 - 16
    assert len(items) == 17
    assert json.loads(items[-1][1])["request_id"] == "r9999"


async def test_sse_resume_after_last_event_id_sends_only_what_followed():
    """An EventSource that reconnects with Last-Event-ID gets the records after that one (not
    server.started or the ring again); where the ring lost some, a gap frame counts them; an id
    from another instance (a restart) gets the whole backlog; a malformed id is refused."""
    from ninfer.events.sinks import InvalidLastEventId
    hub = SseHub(ring_size=8, queue_limit=64)
    assert not hub.subscribe("serve-1-2:5").queue   # nothing written yet: no instance to resume
    bus = EventBus(instance="serve-1-2")
    bus.add_sink(hub)
    bus.attach()
    bus.emit(ev.ServerStarted(config={}, artifact={}, environment={}, memory={}, argv=[]))
    first = hub.subscribe()
    for i in range(6):
        bus.emit(ev.RequestAdmitted(request_id=f"r{i}", lane=0, queue_s=0.0))
    got = await hub.next_items(first, 0.1)
    assert got[0].kind == "server.started"
    got = got[1:]
    assert [json.loads(it.line)["request_id"] for it in got] == [f"r{i}" for i in range(6)]
    last = got[2].event_id                      # the client saw r0..r2, then lost the link
    assert last == f"serve-1-2:{json.loads(got[2].line)['seq']}"
    again = await hub.next_items(hub.subscribe(last), 0.1)
    assert [json.loads(it.line)["request_id"] for it in again] == ["r3", "r4", "r5"]
    assert all(it.kind != "gap" for it in again)
    for i in range(6, 20):                      # r6..r19: the ring (8) keeps r12..r19
        bus.emit(ev.RequestAdmitted(request_id=f"r{i}", lane=0, queue_s=0.0))
    late = await hub.next_items(hub.subscribe(got[5].event_id), 0.1)
    assert late[0].kind == "gap" and late[0].event_id == ""
    assert json.loads(late[0].line)["dropped"] == 6   # r6..r11 are only in the JSONL log
    assert [json.loads(it.line)["request_id"] for it in late[1:]] == [f"r{i}"
                                                                      for i in range(12, 20)]
    other = await hub.next_items(hub.subscribe("serve-9-9:3"), 0.1)
    assert other[0].kind == "server.started"
    assert [json.loads(it.line)["request_id"] for it in other[1:]] == [f"r{i}"
                                                                       for i in range(12, 20)]
    assert (await hub.next_items(hub.subscribe(late[-1].event_id), 0.01)) == []
    newest = int(late[-1].event_id.rpartition(":")[2])
    for bad in ("17", "serve-1-2:", "serve-1-2:-1", "serve-1-2:x", ":5", "serve-1-2:" + "9" * 5000,
                "serve-9-9:" + "9" * 20, "serve-1-2:0", "serve-9-9:0",
                f"serve-1-2:{newest + 1}"):   # seqs start at 1; none ahead of the log
        with pytest.raises(InvalidLastEventId):
            hub.subscribe(bad)


async def test_sse_backlog_is_in_seq_order_when_a_record_precedes_server_started():
    """store.opened is emitted while the server is built, before server.started: the backlog
    keeps seq order, and a resume after server.started does not lose the earlier record
    silently (it was sent before it)."""
    hub = SseHub(ring_size=8, queue_limit=64)
    bus = EventBus(instance="serve-1-2")
    bus.add_sink(hub)
    bus.attach()
    bus.emit(ev.RequestAdmitted(request_id="before", lane=0,
                                queue_s=0.0))   # stands for store.opened (seq 1)
    bus.emit(ev.ServerStarted(config={}, artifact={}, environment={}, memory={},
                              argv=[]))    # seq 2
    bus.emit(ev.RequestAdmitted(request_id="after", lane=0, queue_s=0.0))    # seq 3
    got = await hub.next_items(hub.subscribe(), 0.1)
    assert [it.event_id for it in got] == ["serve-1-2:1", "serve-1-2:2", "serve-1-2:3"]
    again = await hub.next_items(hub.subscribe("serve-1-2:1"), 0.1)
    assert [it.event_id for it in again] == ["serve-1-2:2", "serve-1-2:3"]


def test_a_lone_surrogate_in_a_record_is_escaped_so_the_line_is_utf8():
    """A client string with a lone surrogate (a JSON body's "\\ud800") in a record would make
    the JSONL sink fail on encoding and drop out: the line escapes it instead."""
    rec = ev.Record(ev.SCHEMA_VERSION, 7, 1.5, "serve-1-2",
                    ev.RequestError(http_request_id="id-1", method="POST", path="/slots/0",
                                    status=400, code="unknown_parameter",
                                    param="\ud800", message="unknown parameter '\ud800'"))
    line = encode_line(rec)
    line.encode("utf-8")   # no UnicodeEncodeError
    assert decode_line(line).event.param == "\ud800"
    ok = ev.Record(ev.SCHEMA_VERSION, 8, 1.5, "serve-1-2",
                   ev.RequestError(http_request_id="id-2", method="GET", path="/v1/ünïcode",
                                   status=404, code="not_found", param="", message="x"))
    assert "ünïcode" in encode_line(ok)   # other text stays as it is


def test_fold_sink_applies_fold():
    sink = FoldSink("count", lambda s, r: (s + 1, None), 0)
    for i, e in enumerate(_sample_events()):
        sink.write(ev.Record(1, i + 1, 0.0, "i", e), "")
    assert sink.state == len(_sample_events())


def test_docs_events_md_lists_every_kind_and_field_exactly():
    from pathlib import Path

    from ninfer.events.doc import render

    doc = Path(__file__).resolve().parents[2] / "docs" / "events.md"
    assert doc.read_text(encoding="utf-8") == render(), \
        "docs/events.md is stale: run python -m ninfer.events.doc"
    text = doc.read_text(encoding="utf-8")
    for kind, cls in ev.REGISTRY.items():
        assert f"## `{kind}`" in text
        assert cls.__doc__, f"{kind} has no docstring"


async def test_jsonl_to_a_pipe_writes_every_line(tmp_path):
    """``--request-log-jsonl /dev/stdout`` in a container is a pipe, which cannot seek: the
    lines still go out (they are not cut back on a failure there), and a closed sink refuses
    writes instead of reaching whatever reuses its file descriptor."""
    import os
    path = tmp_path / "fifo"
    os.mkfifo(path)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    jsonl = JsonlSink(path)
    bus = EventBus()
    bus.add_sink(jsonl)
    bus.attach()
    bus.emit(ev.RequestAdmitted(request_id="a", lane=0, queue_s=0.0))
    bus.emit(ev.RequestAdmitted(request_id="b", lane=0, queue_s=0.0))
    lines = os.read(reader, 1 << 16).decode().splitlines()
    assert [json.loads(x)["request_id"] for x in lines] == ["a", "b"]
    jsonl.close()
    with pytest.raises(OSError, match="closed"):
        jsonl.write(None, "{}")
    os.close(reader)


def test_slots_report_the_speculative_mode_the_server_started_with():
    """``/slots`` ``speculative``: true on a ``--spec mtp`` server (which refuses to start on a
    model without an MTP head), false otherwise, from ``server.started`` alone."""
    from ninfer.events.fold import ServingState, fold
    from ninfer.events.telemetry import slots_table
    for spec, want in (("mtp", True), ("none", False)):
        started = ev.ServerStarted(config={"max_concurrency": 2, "max_context": 64,
                                           "spec": spec}, artifact={}, environment={},
                                   memory={}, argv=[])
        state = fold(ServingState(), ev.Record(ev.SCHEMA_VERSION, 1, 0.0, "i", started))
        assert [s["speculative"] for s in slots_table(state)] == [want, want]


def test_spec_rounds_fold_into_the_spec_decode_counters():
    """``spec.round`` -> vLLM's spec_decode counters: rounds of a lane with drafts, drafted
    and accepted tokens, and accepted drafts per position (the longest round's positions)."""
    from ninfer.events.fold import ServingState, fold
    from ninfer.events.metrics import MetricsCollector
    rounds = [ev.SpecRound(round=1, lanes=[0, 1], drafted=[3, 3], accepted=[2, 0],
                           accepted_per_position=[1, 1, 0], duration_s=0.01),
              ev.SpecRound(round=2, lanes=[0, 1], drafted=[2, 0], accepted=[2, 0],
                           accepted_per_position=[1, 1], duration_s=0.01)]
    s = ServingState()
    for i, e in enumerate(rounds):
        s = fold(s, ev.Record(ev.SCHEMA_VERSION, i + 1, 1.0, "i", e))
    r = s.requests
    assert (r.spec_drafts, r.spec_draft_tokens, r.spec_accepted_tokens) == (3, 8, 4)
    assert r.spec_accepted_per_pos == (2, 2, 0)
    fams = {f.name: f for f in MetricsCollector(lambda: s, 2).collect()}
    per = fams["ninfer:spec_decode_num_accepted_tokens_per_pos"].samples
    assert [(x.labels["position"], x.value) for x in per] == [("1", 2), ("2", 2), ("3", 0)]

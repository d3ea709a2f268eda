"""The per-request stderr line: the fold of one request's records and its rendering, on
hand-made records (exact lines), and the same lines from a recorded log by ``ninfer replay``."""
from __future__ import annotations

import io

from ninfer.events import schema as ev
from ninfer.events.codec import encode_line
from ninfer.events.request_line import RequestLineSink, request_lines

SAMPLING = {"temperature": 0.0}


def _records(events: list[tuple[float, object]]) -> list[ev.Record]:
    return [ev.Record(ev.SCHEMA_VERSION, i, ts, "serve-1", e)
            for i, (ts, e) in enumerate(events, 1)]


def _received(rid: str, prompt: int, protocol: str = "openai_chat_completions"):
    return ev.RequestReceived(request_id=rid, protocol=protocol, model="m", stream=False,
                              message_count=3, prompt_tokens=prompt, max_tokens=128,
                              max_tokens_source="client", sampling=SAMPLING)


def _finished_request(rid: str) -> list[tuple[float, object]]:
    """A second turn: 4,085 of 4,105 prompt tokens reused from lane 1's frontier, a 20-token
    prefill in two chunks, 128 tokens generated with MTP drafts."""
    timings = {"queue_s": 0.002, "prefill_s": 0.013, "decode_s": 1.19, "ttft_s": 0.015,
               "total_s": 1.206}
    return [
        (100.0, _received(rid, 4105)),
        (100.001, ev.CacheLookup(request_id=rid, lane=1, prompt_tokens=4105,
                                 cached_tokens=4085, path="append_frontier", candidates=2,
                                 source="l1", shared_tokens=4085, resumed_from="frontier")),
        (100.002, ev.RequestAdmitted(request_id=rid, lane=1, queue_s=0.002,
                                     cached_tokens=4085)),
        (100.009, ev.RequestPrefillChunk(request_id=rid, lane=1, tokens=12, done_tokens=4097,
                                         prompt_tokens=4105, duration_s=0.007)),
        (100.014, ev.RequestPrefillChunk(request_id=rid, lane=1, tokens=8, done_tokens=4105,
                                         prompt_tokens=4105, duration_s=0.005)),
        (100.015, ev.RequestFirstToken(request_id=rid, lane=1, ttft_s=0.015)),
        (100.5, ev.SpecRound(round=7, lanes=[1], drafted=[3], accepted=[2],
                             accepted_per_position=[1, 1, 0], duration_s=0.01)),
        (101.205, ev.RequestFinished(request_id=rid, lane=1, finish_reason="stop_token",
                                     prompt_tokens=4105, cached_tokens=4085,
                                     completion_tokens=128, timings=timings, draft_n=40,
                                     draft_n_accepted=31)),
    ]


FINISHED_LINE = (
    "ninfer: request chatcmpl-a /v1/chat/completions lane 1: prompt 4,105 tokens (4,085 "
    "reused: l1 append_frontier), queued 2.0 ms, prefill 20 in 12 ms (1,667 tok/s), first "
    "token 15 ms, 128 generated in 1.19 s (106.7 tok/s), drafts 40, accepted 31, total 1.21 s, "
    "stop_token")


def test_a_finished_request_is_one_line_with_its_counts_and_rates():
    out = io.StringIO()
    sink = RequestLineSink(out)
    for rec in _records(_finished_request("chatcmpl-a")):
        sink.write(rec, encode_line(rec))
    assert out.getvalue() == FINISHED_LINE + "\n"
    assert dict(sink.state.open) == {}


def test_interleaved_requests_and_each_way_of_ending():
    """Two requests' records interleave; each gets its own line when it ends, and requests that
    fail, are cancelled, rejected (before a request.received: the 429 of a full queue) or
    answered with an HTTP error say so with their code."""
    restored = [
        (10.0, _received("msg_b", 900, "anthropic_messages")),
        (10.25, ev.CacheLookup(request_id="msg_b", lane=0, prompt_tokens=900,
                               cached_tokens=896, path="truncate_frontier", candidates=1,
                               source="l2")),
        (10.26, ev.CacheRestored(request_id="msg_b", lane=0, tier="l2", tokens=896,
                                 bytes=1 << 20, duration_s=0.004)),
        (10.3, ev.RequestAdmitted(request_id="msg_b", lane=0, queue_s=0.3, cached_tokens=896)),
    ]
    events = [
        restored[0],
        (10.1, _received("cmpl-c", 5000, "openai_completions")),
        (10.2, ev.RequestFailed(request_id="cmpl-c", lane=-1, code="context_length_exceeded",
                                message="too long")),
        *restored[1:],
        (10.31, ev.RequestPrefillChunk(request_id="msg_b", lane=0, tokens=4, done_tokens=900,
                                       prompt_tokens=900, duration_s=0.002)),
        (10.32, ev.RequestFirstToken(request_id="msg_b", lane=0, ttft_s=0.32)),
        (12.5, ev.RequestCancelled(request_id="msg_b", lane=0, completion_tokens=57)),
        (13.0, ev.RequestRejected(request_id="chatcmpl-d", code="server_overloaded",
                                  message="full", http_request_id="72be-13e6dd-2",
                                  path="/v1/chat/completions")),
        (13.1, ev.RequestRejected(request_id="chatcmpl-f", code="server_overloaded",
                                  message="full", http_request_id="72be-13e6dd-3")),
        (13.5, ev.RequestError(http_request_id="req-e", method="POST",
                               path="/v1/chat/completions", status=400,
                               code="unknown_parameter", param="foo", message="no")),
    ]
    assert request_lines(_records(events)) == [
        "ninfer: request cmpl-c /v1/completions: prompt 5,000 tokens, total 100 ms, failed: "
        "context_length_exceeded",
        "ninfer: request msg_b /v1/messages lane 0: prompt 900 tokens (896 reused: "
        "l2 truncate_frontier, copied in 4.0 ms), queued 300 ms, prefill 4 in 2.0 ms "
        "(2,000 tok/s), first token 320 ms, 57 generated, total 2.50 s, cancelled: "
        "client_disconnected",
        "ninfer: request chatcmpl-d /v1/chat/completions (x-request-id 72be-13e6dd-2): "
        "rejected: server_overloaded",
        "ninfer: request chatcmpl-f (x-request-id 72be-13e6dd-3): rejected: server_overloaded",
        "ninfer: request req-e POST /v1/chat/completions: error 400 unknown_parameter",
    ]


def test_the_wait_for_other_lanes_turns_is_said_apart_from_the_queue():
    """A long prompt whose chunks took turns with a short one's: the time to first token that
    neither the queue nor its own chunks explain is said as a wait for other lanes' turns, and
    a gap under a tenth of it (scheduling overhead) is not."""
    def events(rid, ttft):
        return [(0.0, _received(rid, 2048)),
                (0.01, ev.RequestAdmitted(request_id=rid, lane=0, queue_s=0.01)),
                (0.6, ev.RequestPrefillChunk(request_id=rid, lane=0, tokens=1024,
                                             done_tokens=1024, prompt_tokens=2048,
                                             duration_s=0.5)),
                (ttft, ev.RequestPrefillChunk(request_id=rid, lane=0, tokens=1024,
                                              done_tokens=2048, prompt_tokens=2048,
                                              duration_s=0.5)),
                (ttft, ev.RequestFirstToken(request_id=rid, lane=0, ttft_s=ttft)),
                (ttft + 0.1, ev.RequestCancelled(request_id=rid, lane=0, completion_tokens=1))]
    long, alone = request_lines(_records(events("chatcmpl-l", 2.51) + events("chatcmpl-a",
                                                                               1.02)))
    assert ("queued 10 ms, prefill 2,048 in 1.00 s (2,048 tok/s), waited 1.50 s for other "
            "lanes' turns, first token 2.51 s, 1 generated") in long
    assert "queued 10 ms, prefill 2,048 in 1.00 s (2,048 tok/s), first token 1.02 s," in alone


def test_replay_prints_the_lines_of_a_recorded_log(tmp_path, capsys):
    """``ninfer replay --requests LOG`` renders the same lines from a JSONL log (its last
    server instance's records), as the live server printed them."""
    from ninfer.cli import main
    started = ev.ServerStarted(config={}, artifact={}, environment={}, memory={}, argv=[])
    recs = _records([(99.0, started), *_finished_request("chatcmpl-a")])
    log = tmp_path / "log.jsonl"
    log.write_text("".join(encode_line(r) + "\n" for r in recs))
    assert main(["replay", "--requests", str(log)]) == 0
    assert capsys.readouterr().out == FINISHED_LINE + "\n"


def test_a_slot_action_is_one_line_saved_or_refused():
    """``POST /slots/{id}?action=...`` ends in one ``slot.action`` record (and no
    ``request.error``, even when refused): it gets its line, as every other request does."""
    def action(lane, act, filename, ok, code, tokens, nbytes, rid):
        return ev.SlotAction(lane=lane, action=act, filename=filename, ok=ok, code=code,
                             tokens=tokens, bytes=nbytes, duration_s=0.0105,
                             session_digest="", http_request_id=rid)
    events = [
        (1.0, action(0, "save", "s0.bin", True, "", 67, 3087891, "req-1")),
        (2.0, action(1, "restore", "nope.bin", False, "slot_restore_failed", 0, 0, "req-2")),
        (3.0, action(1, "erase", "", True, "", 67, 0, "req-3")),
    ]
    assert request_lines(_records(events)) == [
        "ninfer: request req-1 POST /slots/0: save s0.bin, 67 tokens, 3,087,891 bytes, "
        "total 10 ms",
        "ninfer: request req-2 POST /slots/1: restore nope.bin, total 10 ms, failed: "
        "slot_restore_failed",
        "ninfer: request req-3 POST /slots/1: erase, 67 tokens, total 10 ms",
    ]


def test_a_one_token_prompt_and_a_one_token_answer():
    rid = "cmpl-1"
    timings = {"queue_s": 0.0004, "prefill_s": 0.029, "decode_s": 0.084, "ttft_s": 0.03,
               "total_s": 0.114}
    events = [(1.0, _received(rid, 1, "openai_completions")),
              (1.2, ev.RequestFinished(request_id=rid, lane=3, finish_reason="output_limit",
                                       prompt_tokens=1, cached_tokens=0, completion_tokens=4,
                                       timings=timings, draft_n=0, draft_n_accepted=0))]
    assert request_lines(_records(events)) == [
        "ninfer: request cmpl-1 /v1/completions lane 3: prompt 1 token, queued 0.4 ms, first "
        "token 30 ms, 4 generated in 84 ms (35.7 tok/s), total 114 ms, output_limit"]
    # one token, which prefill made: no decode time to give it
    one = dict(timings, decode_s=0.0, total_s=0.03)
    events[1] = (1.2, ev.RequestFinished(request_id=rid, lane=3, finish_reason="output_limit",
                                         prompt_tokens=1, cached_tokens=0, completion_tokens=1,
                                         timings=one, draft_n=0, draft_n_accepted=0))
    assert request_lines(_records(events)) == [
        "ninfer: request cmpl-1 /v1/completions lane 3: prompt 1 token, queued 0.4 ms, first "
        "token 30 ms, 1 generated, total 30 ms, output_limit"]


def test_replay_requests_says_when_it_skipped_malformed_records(tmp_path, capsys):
    """A record the line fold raises on (here a hand-edited ``request.finished`` without its
    timings) loses its request's end (the line says it never ended): ``replay --requests`` says
    so on stderr, as ``replay LOG`` counts it in ``malformed_lines``."""
    import json

    from ninfer.cli import main
    started = ev.ServerStarted(config={}, artifact={}, environment={}, memory={}, argv=[])
    recs = _records([(99.0, started), *_finished_request("chatcmpl-a")])
    lines = [json.loads(encode_line(r)) for r in recs]
    lines[-1]["timings"] = {}
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(d) + "\n" for d in lines))
    assert main(["replay", "--requests", str(log)]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("first token 15 ms, unfinished: the log ends\n")
    assert err == f"ninfer replay: skipped 1 malformed record(s) of {log}\n"


def test_a_corrupt_store_entry_deleted_is_a_line_of_its_own():
    """``store.entry_dropped`` (at a restore, or an undecodable descriptor at open) says on
    stderr what went and why; before, only the log had it and the request line said just
    ``full_reset``."""
    from ninfer.events.store_events import StoreEntryDropped
    events = [(1.0, StoreEntryDropped(tier="l3", tokens=2544, bytes=92_000_000,
                                      reason="payload digest mismatch", entries=3,
                                      store_bytes=1 << 20, session_digest="ab")),
              (2.0, StoreEntryDropped(tier="l3", tokens=0, bytes=4096,
                                      reason="undecodable descriptor (ExtraData)", entries=3,
                                      store_bytes=1 << 20))]
    assert request_lines(_records(events)) == [
        "ninfer: l3 store entry dropped (2,544 tokens, 92,000,000 bytes): payload digest "
        "mismatch; its prompts prefill instead",
        "ninfer: l3 store entry dropped (4,096 bytes): undecodable descriptor (ExtraData); its "
        "prompts prefill instead"]


def test_replay_lines_span_instances_and_say_what_never_ended():
    """A log appended across a kill -9 and a restart: every instance's requests get their lines
    in order, and one that no record ended says so, where its server's records stop and where
    the log ends (before, the earlier instance's lines and the open requests were left out)."""
    def rec(seq, ts, instance, e):
        return ev.Record(ev.SCHEMA_VERSION, seq, ts, instance, e)
    done = _finished_request("chatcmpl-a")
    killed = [(5.0, _received("chatcmpl-k", 2000)),
              (5.1, ev.RequestAdmitted(request_id="chatcmpl-k", lane=1, queue_s=0.1))]
    records = [rec(i, ts, "serve-1", e) for i, (ts, e) in enumerate(done + killed, 1)]
    started = ev.ServerStarted(config={}, artifact={}, environment={}, memory={}, argv=[])
    records += [rec(1, 10.0, "serve-2", started),
                rec(2, 11.0, "serve-2", _received("chatcmpl-b", 12))]
    assert request_lines(records) == [
        FINISHED_LINE,
        "ninfer: request chatcmpl-k /v1/chat/completions lane 1: prompt 2,000 tokens, queued "
        "100 ms, unfinished: its server (serve-1) stopped",
        "ninfer: request chatcmpl-b /v1/chat/completions: prompt 12 tokens, unfinished: the "
        "log ends"]

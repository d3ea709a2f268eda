"""Chat Completions over the real app (in-process Quart test client) on the real SmolLM2."""
from __future__ import annotations

import json

import pytest
import trio

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _sse_payloads(body: str) -> list:
    out = []
    for frame in body.split("\n\n"):
        if frame.startswith("data: "):
            data = frame[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_non_streaming_answer_usage_and_timings(server_factory):
    server, client = await server_factory()
    r = await client.post("/v1/chat/completions", json={
        "messages": FRANCE, "temperature": 0, "max_tokens": 24})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    usage, t = body["usage"], body["timings"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert t["prompt_n"] == usage["prompt_tokens"] and t["predicted_n"] == \
        usage["completion_tokens"]
    expected_prompt = server.state.tokenizer.encode(server.state.template.render(
        FRANCE, add_generation_prompt=True))
    assert usage["prompt_tokens"] == len(expected_prompt)
    assert t["prompt_ms"] > 0 and t["ttft_ms"] >= t["prompt_ms"]


@pytest.mark.parametrize("reuse", [True, False])
async def test_a_second_turn_reuses_the_first_turns_lane(server_factory, reuse):
    server, client = await server_factory(max_concurrency=2, prefix_reuse=reuse)
    first = (await client.post("/v1/chat/completions", json={
        "messages": FRANCE, "temperature": 0, "max_tokens": 24})).json()
    turn2 = FRANCE + [first["choices"][0]["message"],
                      {"role": "user", "content": "And of Italy?"}]
    r = (await client.post("/v1/chat/completions", json={
        "messages": turn2, "temperature": 0, "max_tokens": 16})).json()
    usage, t = r["usage"], r["timings"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    if reuse:  # the first turn's prompt and answer are not recomputed
        assert cached > first["usage"]["prompt_tokens"]
        assert t["cache_n"] == cached and t["prompt_n"] == usage["prompt_tokens"] - cached
    else:
        assert cached == 0 and "cache_n" not in t
        assert t["prompt_n"] == usage["prompt_tokens"]
    slots = (await client.get("/slots")).json()
    assert sum(s["retained"] for s in slots) == (1 if reuse else 0)
    m = (await client.get("/metrics")).text
    assert f"ninfer:continuation_l1_restored_tokens_total {float(cached)}" in m


async def test_reuse_does_not_change_the_answer(server_factory):
    answers = []
    for reuse in (True, False):
        server, client = await server_factory(max_concurrency=1, prefix_reuse=reuse)
        msgs = list(FRANCE)
        for q in ("And of Italy?", "And of Spain?"):
            r = (await client.post("/v1/chat/completions", json={
                "messages": msgs, "temperature": 0, "max_tokens": 20})).json()
            msgs += [r["choices"][0]["message"], {"role": "user", "content": q}]
        answers.append([m["content"] for m in msgs if m["role"] == "assistant"])
    assert answers[0] == answers[1]


async def test_stream_concatenates_to_the_non_streamed_content(server_factory):
    _, client = await server_factory()
    req = {"messages": [{"role": "user", "content": "Write a haiku about the sea."}],
           "temperature": 0, "max_tokens": 40}
    full = (await client.post("/v1/chat/completions", json=req)).json()
    r = await client.post("/v1/chat/completions",
                          json={**req, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    frames = _sse_payloads(r.text)
    assert frames[-1] == "[DONE]"
    chunks = frames[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == full["choices"][0]["message"]["content"]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]
                and c["choices"][0]["finish_reason"]]
    assert finishes == [full["choices"][0]["finish_reason"]]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]


async def test_stream_without_include_usage_has_no_usage_field(server_factory):
    _, client = await server_factory()
    r = await client.post("/v1/chat/completions", json={
        "messages": FRANCE, "temperature": 0, "max_tokens": 4, "stream": True})
    chunks = _sse_payloads(r.text)[:-1]
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["timings"]["predicted_n"] == 4


def test_a_null_content_is_named_as_null_not_as_missing():
    """``"content": null`` is given, not missing: said so, under the same code and param."""
    from ninfer.api.chat_request import parse_chat_request
    from ninfer.api.errors import ApiError
    for message, said in [
            ({"role": "user", "content": None},
             "'content' must be a string or an array of text parts, not null"),
            ({"role": "assistant", "content": None}, "'content' must be a string or an array "
             "of text parts, not null (null only beside 'tool_calls')"),
            ({"role": "user"}, "'content' is required")]:
        with pytest.raises(ApiError) as e:
            parse_chat_request({"messages": [message]})
        assert (e.value.message, e.value.param, e.value.code) == \
            (said, "messages[0].content", "invalid_value")


async def test_tool_call_arguments_that_are_no_json_object_are_named_where_they_are(
        server_factory):
    """An assistant tool call's ``arguments`` that is not a JSON object (an answer cut inside a
    call, echoed back) is rendered as sent; where the chat template reads its keys and fails,
    the 400 names it as the Responses API names its function_call's (it used to be
    "chat template error: chat template error: TypeError: ..." on ``messages``)."""
    from ninfer.engine.chat_template import ChatTemplate

    def call(arguments):
        return {"max_tokens": 1, "messages": [{"role": "user", "content": "x"}, {
            "role": "assistant", "content": None, "tool_calls": [{
                "id": "c1", "type": "function",
                "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "1"}]}
    server, client = await server_factory()
    r = await client.post("/v1/chat/completions", json=call('{"a":'))
    assert r.status_code == 200   # SmolLM2's template prints no arguments
    server.state.template = ChatTemplate(
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{% for k, v in c.function.arguments|items %}{{ k }}{% endfor %}{% endfor %}"
        "{{ m.content }}{% endfor %}")
    for bad in ('{"a":', "[1, 2]"):
        r = await client.post("/v1/chat/completions", json=call(bad))
        err = r.json()["error"]
        assert r.status_code == 400 and (err["code"], err["param"]) == (
            "invalid_value", "messages[1].tool_calls[0].function.arguments")
        assert err["message"].count("chat template") == 1
    for good in ("", '{"a": [1, 2]}'):
        assert (await client.post("/v1/chat/completions", json=call(good))).status_code == 200


@pytest.mark.parametrize("body,param,code", [
    (b"{not json", None, "invalid_json"),
    (b"[1, 2]", None, "invalid_value"),
    (json.dumps({}).encode(), "messages", "invalid_value"),
    (json.dumps({"messages": []}).encode(), "messages", "invalid_value"),
    (json.dumps({"messages": "hi"}).encode(), "messages", "invalid_value"),
    (json.dumps({"messages": [{"role": "user"}]}).encode(), "messages[0].content", "invalid_value"),
    (json.dumps({"messages": [{"role": "user", "content": None}]}).encode(),
     "messages[0].content", "invalid_value"),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(),
     "messages[0].role", "invalid_value"),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(),
     "messages[0].content", "invalid_value"),
    (json.dumps({"messages": FRANCE, "max_tokens": 0}).encode(), "max_tokens", "invalid_value"),
    (json.dumps({"messages": FRANCE, "max_tokens": "8"}).encode(), "max_tokens", "invalid_value"),
    (json.dumps({"messages": FRANCE, "temperature": "hot"}).encode(), "temperature", "invalid_value"),
    (json.dumps({"messages": FRANCE, "stream": "yes"}).encode(), "stream", "invalid_value"),
    (json.dumps({"messages": FRANCE, "stop": 3}).encode(), "stop", "invalid_value"),
    (json.dumps({"messages": FRANCE, "bogus": 1}).encode(), "bogus", "unknown_parameter"),
    (json.dumps({"messages": FRANCE, "n": 17}).encode(), "n", "invalid_value"),
    (json.dumps({"messages": FRANCE, "top_logprobs": 2}).encode(), "top_logprobs", "invalid_value"),
    (json.dumps({"messages": FRANCE, "logprobs": True, "top_logprobs": 21}).encode(),
     "top_logprobs", "invalid_value"),
    (json.dumps({"messages": FRANCE, "presence_penalty": 3}).encode(), "presence_penalty",
     "invalid_value"),
    (json.dumps({"messages": FRANCE, "audio": {}}).encode(), "audio",
     "parameter_not_supported"),
    (json.dumps({"messages": FRANCE, "stream_options": {"x": 1}}).encode(),
     "stream_options.x", "unknown_parameter"),
    (json.dumps({"messages": [{"role": "user", "content": "x", "extra": 1}]}).encode(),
     "messages[0].extra", "unknown_parameter"),
    (json.dumps({"messages": [{"role": "tool", "content": "x"}]}).encode(),
     "messages[0].tool_call_id", "invalid_value"),
    (json.dumps({"messages": FRANCE, "top_p": 0}).encode(), "top_p", "invalid_value"),
    (json.dumps({"messages": FRANCE, "store": True}).encode(), "store", "store_not_supported"),
    (json.dumps({"messages": FRANCE, "store": "x"}).encode(), "store", "invalid_value"),
    (json.dumps({"messages": FRANCE, "modalities": ["audio"]}).encode(), "modalities",
     "modality_not_supported"),
    (json.dumps({"messages": FRANCE, "modalities": 5}).encode(), "modalities", "invalid_value"),
    (json.dumps({"messages": FRANCE, "service_tier": "flex"}).encode(), "service_tier",
     "service_tier_not_supported"),
    (json.dumps({"messages": FRANCE, "metadata": "x"}).encode(), "metadata", "invalid_value"),
    (json.dumps({"messages": FRANCE, "metadata": {"k": "v" * 513}}).encode(), "metadata",
     "invalid_value"),
    (json.dumps({"messages": FRANCE, "user": {"id": 1}}).encode(), "user", "invalid_value"),
    (json.dumps({"messages": FRANCE, "tools": [{"type": "function", "function": {
        "name": "f", "strict": True}}]}).encode(), "tools[0].function.strict",
     "strict_tools_not_supported"),
    (json.dumps({"messages": FRANCE, "tools": [{"type": "function", "function": {
        "name": "bad name!"}}]}).encode(), "tools[0].function.name", "invalid_value"),
    (json.dumps({"messages": FRANCE, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": "notaschema"}}]}).encode(), "tools[0].function.parameters",
     "invalid_value"),
    # nested closed allow-lists (contract §1.3: param = the dotted path)
    (json.dumps({"messages": FRANCE, "tools": [{"type": "function", "cache": 1, "function": {
        "name": "f"}}]}).encode(), "tools[0].cache", "unknown_parameter"),
    (json.dumps({"messages": FRANCE, "tools": [{"type": "function", "function": {
        "name": "f", "examples": []}}]}).encode(), "tools[0].function.examples",
     "unknown_parameter"),
    (json.dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]}]}).encode(),
     "messages[0].content[0].cache_control", "unknown_parameter"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}, {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "lang": "py",
             "function": {"name": "f", "arguments": "{}"}}]}]}).encode(),
     "messages[1].tool_calls[0].lang", "unknown_parameter"),
    (json.dumps({"messages": [{"role": "assistant", "content": "x",
                               "annotations": "cite"}]}).encode(),
     "messages[0].annotations", "invalid_value"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}, {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "f", "arguments": "{}", "parsed": {}}}]}]}).encode(),
     "messages[1].tool_calls[0].function.parsed", "unknown_parameter"),
    (json.dumps({"messages": [{"role": "assistant", "content": "x",
                               "function_call": {"name": "f"}}]}).encode(),
     "messages[0].function_call", "tools_not_supported"),
    (json.dumps({"messages": [{"role": "assistant", "content": "x",
                               "audio": {"id": "a1"}}]}).encode(),
     "messages[0].audio", "modality_not_supported"),
    (json.dumps({"messages": [{"role": "assistant", "content": "x", "refusal": 3}]}).encode(),
     "messages[0].refusal", "invalid_value"),
    (json.dumps({"messages": FRANCE, "stream_options": {"include_usage": True}}).encode(),
     "stream_options", "invalid_value"),
])
async def test_client_mistakes_are_400_with_openai_error_body(server_factory, body, param,
                                                              code):
    server, client = await server_factory(strict_request_fields=True)
    r = await client.post("/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param
    assert err["code"] == code
    assert server.engine.idle()


async def test_unknown_model_is_404_and_context_overflow_is_400(server_factory):
    server, client = await server_factory(strict_max_tokens=True)
    r = await client.post("/v1/chat/completions", json={"model": "gpt-9", "messages": FRANCE})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    r = await client.post("/v1/chat/completions", json={"messages": FRANCE,
                                                        "max_tokens": 5000})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert err["n_ctx"] == server.state.n_ctx and err["n_prompt_tokens"] > 0


async def test_models_health_and_metrics_endpoints(server_factory):
    server, client = await server_factory()
    models = (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == server.state.model_id
    assert models["data"][0]["context_window"] == 2048
    assert models["data"][0]["supported_endpoints"] == [
        "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]
    one = await client.get("/v1/models/" + models["data"][0]["id"])
    assert one.status_code == 200 and one.json() == models["data"][0]
    r = await client.get("/v1/models/other-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert ((await client.get("/health")).json()) == {"status": "ok"}
    assert (await client.head("/api/hello")).status_code == 200   # Claude Code's probe
    # llama-server's /props: the context, the slots, the template the server renders with
    props = (await client.get("/props")).json()
    assert props["default_generation_settings"]["n_ctx"] == 2048
    assert props["total_slots"] == server.config.max_concurrency
    assert props["chat_template"] == server.state.template.source and "{%" in props[
        "chat_template"]
    assert props["model_alias"] == server.state.model_id
    assert props["default_generation_settings"]["params"]["temperature"] == 1.0
    assert (await client.post("/props", json={})).status_code == 405   # (read-only)
    r = await client.get("/metrics")
    text = r.text
    for name in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total",
                 "llamacpp:requests_processing", "llamacpp:requests_deferred",
                 "ninfer:time_to_first_token_seconds_bucket",
                 "ninfer:inter_token_latency_seconds_bucket"):
        assert name in text


async def test_seeded_request_is_identical_alone_and_batched_with_three_others(server_factory):
    _, client = await server_factory(max_concurrency=4)
    req = {"messages": [{"role": "user", "content": "Tell me a short story about a robot."}],
           "temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 1234, "max_tokens": 24}
    alone = (await client.post("/v1/chat/completions", json=req)).json()
    results = {}

    async def one(i, body):
        results[i] = (await client.post("/v1/chat/completions", json=body)).json()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, 0, req)
        for i, topic in enumerate(("cats", "the moon", "bread"), start=1):
            nursery.start_soon(one, i, {**req, "seed": 99 + i, "messages": [
                {"role": "user", "content": f"Tell me a short story about {topic}."}]})
    assert results[0]["choices"][0]["message"]["content"] == \
        alone["choices"][0]["message"]["content"]
    # the same usage, except that the repeat may reuse the first one's prefix (prefix reuse
    # changes what is recomputed, never the output)
    strip = lambda u: {k: v for k, v in u.items() if k != "prompt_tokens_details"}  # noqa: E731
    assert strip(results[0]["usage"]) == strip(alone["usage"])
    assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert len({results[i]["choices"][0]["message"]["content"] for i in range(4)}) == 4


async def test_reasoning_effort_on_a_template_without_thinking(server_factory):
    _, client = await server_factory(strict_request_fields=True)
    r = await client.post("/v1/chat/completions", json={"messages": FRANCE, "max_tokens": 2,
                                                        "reasoning_effort": "low"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "reasoning_effort_not_supported"
    r = await client.post("/v1/chat/completions", json={"messages": FRANCE, "max_tokens": 2,
                                                        "reasoning_effort": "none"})
    assert r.status_code == 200
    assert "reasoning_content" not in r.json()["choices"][0]["message"]
    r = await client.post("/v1/chat/completions", json={
        "messages": FRANCE, "chat_template_kwargs": {"enable_thinking": True}})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "chat_template_option_not_supported"


async def test_prompt_cache_key_routes_and_never_reaches_the_log(server_factory, tmp_path):
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(max_concurrency=3, request_log_jsonl=str(log))
    system = {"role": "system", "content": "You are a helpful assistant. " * 14}
    key = "my-secret-conversation-key"

    async def ask(text, **kw):
        r = await client.post("/v1/chat/completions", json={
            "messages": [system, {"role": "user", "content": text}], "max_tokens": 12,
            "temperature": 0, **kw})
        assert r.status_code == 200, r.text
        return r.json()

    await ask("Tell me about Rome.", prompt_cache_key=key)
    await ask("Tell me about Oslo.", prompt_cache_key="another")
    await ask("(Summary: Rome.) What about Paris?", prompt_cache_key=key)
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "system", "content": "Be terse."},
                     {"role": "user", "content": "Hi"}], "max_tokens": 4,
        "prompt_cache_key": key})
    assert r.status_code == 200
    server.state.bus.flush()
    text = log.read_text()
    assert key not in text
    lookups = [json.loads(line) for line in text.splitlines() if '"cache.lookup"' in line]
    assert [e["routed"] for e in lookups] == [False, False, True, False]
    assert lookups[2]["lane"] == lookups[0]["lane"] != lookups[1]["lane"]
    # the same key with another system prompt shares only the template's header: not routed
    assert lookups[3]["lane"] not in (lookups[0]["lane"], lookups[1]["lane"])
    r = await client.post("/v1/chat/completions", json={
        "messages": [system], "max_tokens": 2, "prompt_cache_key": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_key"


async def test_fields_that_ask_for_nothing_unsupported_are_accepted(server_factory):
    _, client = await server_factory()
    r = await client.post("/v1/chat/completions", json={
        "messages": FRANCE, "max_tokens": 2, "store": False, "modalities": ["text"],
        "service_tier": "auto", "metadata": {"k": "v"}, "user": "u1",
        "tools": [{"type": "function", "function": {"name": "get-weather_2", "strict": False,
                                                    "parameters": {"type": "object"}}}]})
    assert r.status_code == 200, r.text


async def test_a_history_built_from_sdk_objects_is_accepted(server_factory):
    """What clients send back in the history: a response message dumped whole
    (``message.model_dump()``: annotations, audio, function_call and refusal as null) and tool
    calls accumulated from streamed deltas (with their ``index``)."""
    server, client = await server_factory()
    dumped = {"role": "assistant", "content": None, "refusal": None, "annotations": None,
              "audio": None, "function_call": None, "parsed": None, "tool_calls": [
                  {"index": 0, "id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}",
                                "parsed_arguments": None}}]}
    body = {"messages": FRANCE + [dumped, {"role": "tool", "tool_call_id": "call_1",
                                           "content": "sunny"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}}}}}],
            "max_tokens": 2}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    with_annotations = {**dumped, "annotations": []}
    r = await client.post("/v1/chat/completions",
                          json={**body, "messages": FRANCE + [with_annotations] + body[
                              "messages"][2:]})
    assert r.status_code == 200, r.text

"""Anthropic Messages (``/v1/messages``, ``/v1/messages/count_tokens``) over real sockets on the
real SmolLM2: the same tokens as Chat Completions for the same conversation, the stream's event
grammar, stop reasons, the history conversion, and the Anthropic error envelope."""
from __future__ import annotations

import json

import anthropic
import pytest
import trio

from ninfer.api.errors import ApiError
from ninfer.api.messages_request import parse_messages_request

URL = "/v1/messages"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _events(text: str) -> list[tuple[str, dict]]:
    out = []
    for frame in text.strip().split("\n\n"):
        lines = frame.splitlines()
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), frame
        name, data = lines[0][7:], json.loads(lines[1][6:])
        assert data["type"] == name
        out.append((name, data))
    return out


@pytest.mark.slow
async def test_messages_equal_chat_completions_and_the_stream_equals_the_json(server_factory):
    server, client = await server_factory()
    chat = (await client.post("/v1/chat/completions", json={
        "messages": [{"role": "system", "content": "Be brief."}] + FRANCE,
        "temperature": 0, "max_tokens": 24})).json()
    body = {"model": "claude-sonnet-4-5", "system": [{"type": "text", "text": "Be brief."}],
            "messages": FRANCE, "temperature": 0, "max_tokens": 24}
    r = await client.post(URL, json=body)
    assert r.status_code == 200
    msg = r.json()
    assert msg["id"].startswith("msg_") and msg["type"] == "message"
    assert msg["role"] == "assistant" and msg["model"] == "claude-sonnet-4-5"  # echoed label
    assert msg["content"] == [{"type": "text",
                               "text": chat["choices"][0]["message"]["content"]}]
    reason = {"stop": "end_turn", "length": "max_tokens"}[chat["choices"][0]["finish_reason"]]
    assert msg["stop_reason"] == reason and msg["stop_sequence"] is None
    # the same prompt again: all of it but the last token is read from the chat request's
    # retained lane (prefix reuse), and the split says so
    n_prompt = chat["usage"]["prompt_tokens"]
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert msg["usage"] == {"input_tokens": 1, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": n_prompt - 1,
                            "output_tokens": chat["usage"]["completion_tokens"]}
    count = (await client.post(URL + "/count_tokens", json={
        k: v for k, v in body.items() if k in ("model", "system", "messages")})).json()
    assert count == {"input_tokens": chat["usage"]["prompt_tokens"]}

    r = await client.post(URL, json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = _events(r.text)
    names = [n for n, _ in ev]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    # message_start goes out with the first output, once admission decided the reuse: the
    # same split as the final usage (nothing generated yet)
    assert ev[0][1]["message"]["usage"] == {**msg["usage"], "output_tokens": 0}
    assert ev[0][1]["message"]["content"] == [] and ev[0][1]["message"]["model"] == body["model"]
    blocks = [d for n, d in ev if n == "content_block_start"]
    assert [b["index"] for b in blocks] == list(range(len(blocks)))   # contiguous
    assert [b["content_block"]["type"] for b in blocks] == ["text"]
    text = "".join(d["delta"]["text"] for n, d in ev if n == "content_block_delta")
    assert text == msg["content"][0]["text"]
    assert names.count("content_block_stop") == len(blocks)
    assert ev[-2][1]["delta"] == {"stop_reason": reason, "stop_sequence": None}
    assert ev[-2][1]["usage"] == msg["usage"]   # the final split


async def _sdk(client, fn):
    """``fn(anthropic.Anthropic)`` on a worker thread: the official sync client against the
    test's server (base_url is the server root; the key is not checked)."""
    sdk = anthropic.Anthropic(base_url=str(client.base_url), api_key="unused", max_retries=0)
    try:
        return await trio.to_thread.run_sync(lambda: fn(sdk))
    finally:
        sdk.close()


@pytest.mark.slow
async def test_the_official_anthropic_client_creates_streams_and_counts(server_factory):
    """``messages.create``, ``messages.stream(...).get_final_message()`` and
    ``messages.count_tokens`` through the official ``anthropic`` client: the SDK parses every
    reply, the greedy answer names Paris, and each usage adds up to the counted prompt."""
    _, client = await server_factory()
    # (temperature through extra_body: newer SDKs dropped the argument; greedy makes the two
    # generations below comparable)
    args = dict(model="claude-sonnet-4-5", system="Be brief.", messages=FRANCE, max_tokens=24,
                extra_body={"temperature": 0})
    count = await _sdk(client, lambda c: c.messages.count_tokens(
        model=args["model"], system=args["system"], messages=FRANCE))
    assert count.input_tokens > 0
    msg = await _sdk(client, lambda c: c.messages.create(**args))
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.model == "claude-sonnet-4-5"
    assert [b.type for b in msg.content] == ["text"]
    text = msg.content[0].text
    assert text.strip() and "Paris" in text
    assert msg.stop_reason == ("max_tokens" if msg.usage.output_tokens == 24 else "end_turn")
    assert msg.stop_sequence is None and 0 < msg.usage.output_tokens <= 24
    # a fresh server: nothing to reuse, so the whole counted prompt is input
    assert msg.usage.input_tokens == count.input_tokens
    assert msg.usage.cache_read_input_tokens == 0

    def stream(c):
        with c.messages.stream(**args) as s:
            deltas = list(s.text_stream)
            return deltas, s.get_final_message()

    deltas, final = await _sdk(client, stream)
    assert len(deltas) > 1 and "".join(deltas) == final.content[0].text == text   # greedy
    assert final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == msg.usage.output_tokens
    # the same prompt again: all but its last token read from the retained lane
    assert final.usage.cache_read_input_tokens == count.input_tokens - 1
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens + \
        final.usage.cache_creation_input_tokens == count.input_tokens


@pytest.mark.slow
async def test_stop_sequence_and_max_tokens_reasons(server_factory):
    _, client = await server_factory()
    base = {"model": "m", "messages": FRANCE, "temperature": 0}
    r0 = r = (await client.post(URL, json={**base, "max_tokens": 24,
                                           "stop_sequences": ["never", "Paris"]})).json()
    assert r["stop_reason"] == "stop_sequence" and r["stop_sequence"] == "Paris"
    assert "Paris" not in r["content"][0]["text"]
    r = (await client.post(URL, json={**base, "max_tokens": 2})).json()
    assert r["stop_reason"] == "max_tokens" and r["usage"]["output_tokens"] == 2
    r = await client.post(URL, json={**base, "max_tokens": 24, "stream": True,
                                     "stop_sequences": ["Paris"]})
    last = _events(r.text)[-2][1]
    assert last["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "Paris"}
    # an answer the stop sequence cuts to nothing has no content block (no empty text block,
    # which Anthropic's API would refuse when a client sends the turn back)
    first = r0["content"][0]["text"].split()[0]
    r = (await client.post(URL, json={**base, "max_tokens": 24,
                                      "stop_sequences": [first]})).json()
    assert r["content"] == [] and r["stop_reason"] == "stop_sequence"
    r = await client.post(URL, json={**base, "max_tokens": 24, "stream": True,
                                     "stop_sequences": [first]})
    kinds = [e[0] for e in _events(r.text) if e[0] != "ping"]
    assert kinds == ["message_start", "message_delta", "message_stop"]


@pytest.mark.slow
async def test_tool_and_thinking_history_renders_as_the_chat_form(server_factory):
    """tool_use / tool_result / thinking blocks count the same prompt tokens as the chat
    messages they stand for (assistant tool_calls, tool messages, reasoning_content)."""
    server, client = await server_factory()
    anthropic = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1",
             "content": [{"type": "text", "text": "18 C"}]},
            {"type": "text", "text": "Thanks", "cache_control": {"type": "ephemeral"}}]}]
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.",
             "tool_calls": [{"id": "t1", "type": "function", "function": {
                 "name": "weather", "arguments": json.dumps({"city": "Paris"})}}]},
            {"role": "tool", "tool_call_id": "t1", "content": "18 C"},
            {"role": "user", "content": "Thanks"}]
    st = server.state
    expect = len(st.tokenizer.encode(st.template.render(chat, add_generation_prompt=True)))
    r = await client.post(URL + "/count_tokens", json={"model": "m", "messages": anthropic})
    assert r.json() == {"input_tokens": expect}
    r = await client.post(URL, json={"model": "m", "messages": anthropic, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["input_tokens"] == expect


BAD = [
    ({"model": "m", "messages": FRANCE}, "max_tokens", "invalid_value"),
    ({"model": "m", "max_tokens": 5, "messages": FRANCE, "n": 2}, "n", "unknown_parameter"),
    ({"max_tokens": 5, "messages": FRANCE}, "model", "invalid_value"),
    ({"model": "m", "max_tokens": 0, "messages": FRANCE}, "max_tokens", "invalid_value"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]},
     "messages[0].role", "invalid_value"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, "messages[0].content[0].type",
     "modality_not_supported"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]},
     "messages[0].content[0].cache_control.ttl", "parameter_not_supported"),
    ({"model": "m", "max_tokens": 5, "messages": FRANCE, "tool_choice": {"type": "any"}},
     "tool_choice", "tool_choice_not_supported"),
    ({"model": "m", "max_tokens": 5, "messages": FRANCE, "thinking": {"type": "disabled"},
      "output_config": {"effort": "high"}}, "output_config.effort",
     "conflicting_template_option"),
    ({"model": "m", "max_tokens": 5, "messages": FRANCE, "stop_sequences": "x"},
     "stop_sequences", "invalid_value"),
    ({"model": "m", "max_tokens": 5, "messages": FRANCE + [
        {"role": "assistant", "content": "The capital is"}]}, "messages[1].role",
     "prefill_not_supported"),
    ({"model": "m", "max_tokens": 5, "messages": FRANCE, "thinking": {"type": "bogus"}},
     "thinking.type", "invalid_value"),
    ({"model": "m", "max_tokens": 5, "messages": FRANCE,
      "thinking": {"type": "enabled", "budget_tokens": "zz"}}, "thinking.budget_tokens",
     "invalid_value"),
    ({"model": "m", "max_tokens": 5, "messages": FRANCE,
      "tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}},
     "tool_choice.disable_parallel_tool_use", "invalid_value"),
    ({"model": "m", "max_tokens": 5, "messages": FRANCE,
      "tools": [{"name": "f", "input_schema": "notaschema"}]}, "tools[0].input_schema",
     "invalid_value"),
    ({"model": "m", "max_tokens": 5, "messages": FRANCE, "tools": [{"name": "f"}]},
     "tools[0].input_schema", "invalid_value"),
    ({"model": "m", "max_tokens": 5, "messages": FRANCE,
      "tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, "tools[0].name",
     "invalid_value"),
    ({"model": "m", "max_tokens": 5, "messages": FRANCE,
      "tools": [{"name": "f", "input_schema": {}}, {"name": "f", "input_schema": {}}]},
     "tools[1].name", "invalid_value"),
    ({"model": "m", "max_tokens": 5, "messages": FRANCE, "temperature": 1.5}, "temperature",
     "invalid_value"),
]


def test_conversion_to_the_chat_form():
    """Several text blocks of a turn are kept apart; a failed tool result says so; thinking
    is off unless asked for; tool_choice none drops the tools, on count_tokens too."""
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    r = parse_messages_request({
        "model": "m", "max_tokens": 3, "tools": tools, "tool_choice": {"type": "none"},
        "system": [{"type": "text", "text": "S1"}, {"type": "text", "text": "S2"}],
        "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "is_error": True, "content": "boom"},
            {"type": "text", "text": "A"}, {"type": "text", "text": "B"}]}]})
    assert r.messages == [{"role": "system", "content": "S1\n\nS2"},
                          {"role": "tool", "tool_call_id": "t", "content": "Error: boom"},
                          {"role": "user", "content": "A\n\nB"}]
    assert r.tools is None and r.enable_thinking is False and r.temperature is None
    c = parse_messages_request({"model": "m", "messages": FRANCE, "tools": tools,
                                "tool_choice": {"type": "none"},
                                "output_config": {"effort": "low"}}, count_only=True)
    assert c.tools is None and c.reasoning_effort == "low" and c.enable_thinking is None
    with pytest.raises(ApiError):   # the same refusals as the generating route
        parse_messages_request({"model": "m", "messages": FRANCE,
                                "tool_choice": {"type": "any"}}, count_only=True)


@pytest.mark.parametrize("body,param,code", BAD)
def test_bad_messages_bodies_are_refused_with_a_stable_code(body, param, code):
    with pytest.raises(ApiError) as e:   # (outside a lenient field policy: strict)
        parse_messages_request(body)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code)
    env = e.value.anthropic_body()
    assert env["type"] == "error" and env["error"]["type"] == "invalid_request_error"
    assert env["error"]["code"] == code and env["error"]["message"]


@pytest.mark.slow
async def test_errors_on_messages_routes_use_the_anthropic_envelope(server_factory):
    server, client = await server_factory(strict_request_fields=True)
    r = await client.post(URL, content=b"{bad", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["code"] == "invalid_json"
    r = await client.post(URL, json=BAD[1][0])
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = await client.get(URL)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    r = await client.post(URL + "/nope", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = await client.post("/v1/chat/completions", content=b"{bad",   # OpenAI's elsewhere
                          headers={"content-type": "application/json"})
    assert "type" not in r.json() and r.json()["error"]["code"] == "invalid_json"
    # the same admission pool as chat, released after every request
    assert server.app.messages_handler.in_flight == server.app.chat_handler.in_flight == 0

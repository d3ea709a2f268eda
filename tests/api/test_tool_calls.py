"""Tool calls parsed out of the answer (serving contract §7.5): the streaming parser on its own
(both spellings, any chunking, malformed markup, incomplete calls), then Chat Completions and
Messages on the real SmolLM2, which writes Hermes-style calls after two examples in its
history."""
from __future__ import annotations

import json
import random

import pytest

from ninfer.api.tool_calls import ToolCallParser

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": ["integer", "null"]},
        "opts": {"type": "object"}, "tags": {"type": "array"}}}}}]

XML = ("Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão \"Paulo\"\n\n"
       "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"units\": \"C\"}\n"
       "</parameter>\n<parameter=tags>\n[1, 2]\n</parameter>\n<parameter=note>\nnot json\n"
       "</parameter>\n</function>\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", "
       "\"arguments\": {\"city\": \"Rome\"}}\n</tool_call>trailing")


def parse(text, chunks=None, tools=TOOLS, **kw):
    p = ToolCallParser(tools, new_id=lambda: "id", **kw)
    events = []
    for piece in chunks if chunks is not None else [text]:
        events += p.feed(piece)
    events += p.close()
    content = "".join(e.text for e in events if e.kind == "text")
    args = {}
    for e in events:
        if e.kind == "args":
            args[e.call.index] = args.get(e.call.index, "") + e.text
    assert all(args.get(k.index, "") == k.arguments for k in p.calls)  # fragments add up
    return content, [(k.name, k.arguments, k.complete) for k in p.calls], p.discarded_bytes


def _split(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(60, len(text) - 1))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def test_both_spellings_typed_by_the_schema():
    content, calls, discarded = parse(XML)
    assert content == "Let me check."   # whitespace before the call is dropped
    (n1, a1, ok1), (n2, a2, ok2) = calls
    assert n1 == n2 == "get_weather" and ok1 and ok2
    # one framing newline stripped each side; the string escaped as written
    assert json.loads(a1) == {"city": "São \"Paulo\"\n", "days": 3, "opts": {"units": "C"},
                              "tags": [1, 2], "note": "not json"}
    assert json.loads(a2) == {"city": "Rome"}
    assert discarded == len("trailing")  # after the first call, other output is dropped


def test_any_chunking_gives_the_same_events():
    rng = random.Random(7)
    whole = parse(XML)
    for _ in range(300):
        assert parse(XML, _split(XML, rng)) == whole


def test_text_without_calls_passes_through_exactly():
    rng = random.Random(3)
    alphabet = "ab <>/\n_tool_call=function{}\"\\é"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
        if "<tool_call>" in text:
            continue
        assert parse(text, _split(text, rng) if len(text) > 1 else [text]) == (text, [], 0)


@pytest.mark.parametrize("text", [
    "hello <tool_call> not a call",                       # no <function= or JSON after it
    "x <tool_call>\n<function=bad name>\n</function></tool_call>",  # invalid name
    "<tool_call>{\"name\": 1}</tool_call> and more",      # Hermes body without a string name
    "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",  # arguments not an object
    "ends inside <tool_call>\n{\"name\": \"f\"",          # output ended before </tool_call>
    "a <tool_ca",                                          # a prefix of the tag at the end
])
def test_malformed_markup_is_released_as_text_without_loss(text):
    assert parse(text) == (text, [], 0)


def test_a_call_the_output_ends_inside_stays_incomplete_with_the_streamed_prefix():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    content, calls, _ = parse(text)
    assert content == "" and calls == [("get_weather", '{"city": "Par', False)]
    # a value not yet known to be complete is held back, never guessed
    _, calls, _ = parse("<tool_call>\n<function=get_weather>\n<parameter=days>\n12")
    assert calls == [("get_weather", "{", False)]


def test_complete_arguments_are_always_strict_json():
    # NaN / Infinity (Python's JSON extensions), broken objects, trailing text: the value
    # becomes a JSON string, the call's arguments still parse
    for value, want in (("NaN", "NaN"), ("-Infinity", "-Infinity"), ('{"u": 1', '{"u": 1'),
                        ("[1,2", "[1,2"), ('{"a":1} trailing', '{"a":1} trailing'),
                        ('{"a": [1, {"b": null}]}', {"a": [1, {"b": None}]})):
        text = (f"<tool_call>\n<function=get_weather>\n<parameter=opts>\n{value}\n"
                "</parameter>\n</function>\n</tool_call>")
        (name, args, ok), = parse(text)[1]
        assert ok and json.loads(args) == {"opts": want}
        json.loads(args, parse_constant=lambda c: pytest.fail(f"{c} in {args}"))
    # a Hermes call with NaN arguments is not a call
    text = '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'
    assert parse(text) == (text, [], 0)


def test_a_hermes_string_may_contain_the_closing_tag():
    text = ('<tool_call>{"name": "write", "arguments": {"code": "x = \'</tool_call>\'"}}'
            '</tool_call>')
    rng = random.Random(2)
    whole = parse(text)
    assert whole[0] == "" and whole[1] == [("write", '{"code": "x = \'</tool_call>\'"}', True)]
    for _ in range(100):
        assert parse(text, _split(text, rng)) == whole


def test_discarded_bytes_do_not_depend_on_the_chunking():
    text = ('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n  some words  \n'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call> more  text ')
    rng = random.Random(1)
    whole = parse(text)
    assert whole[2] == len("somewords") + len("moretext")
    for _ in range(200):
        assert parse(text, _split(text, rng)) == whole


def test_name_limits_and_undeclared_tools():
    long = "f" * 100
    text = f"<tool_call>\n<function={long}>\n</function>\n</tool_call>"
    assert parse(text, max_name=64)[1] == []
    assert parse(text, max_name=128)[1] == [(long, "{}", True)]
    # an undeclared tool's parameters are typed by what they parse as
    text = ("<tool_call>\n<function=other>\n<parameter=n>\n7\n</parameter>\n<parameter=s>\nhi\n"
            "</parameter>\n</tool_call>")
    assert parse(text)[1] == [("other", '{"n": 7, "s": "hi"}', True)]


def test_max_calls_keeps_the_first_calls_and_drops_what_follows_whatever_the_chunking():
    content, calls, dropped = parse(XML, max_calls=1)
    assert content == "Let me check."
    assert [c[0] for c in calls] == ["get_weather"] and calls[0][2]
    assert calls == parse(XML)[1][:1]
    second = XML[XML.index("</tool_call>") + len("</tool_call>"):]
    assert dropped == len("".join(second.split()).encode())
    rng = random.Random(5)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(XML)), 12))
        chunks = [XML[a:b] for a, b in zip([0] + cuts, cuts + [len(XML)])]
        assert parse(XML, chunks, max_calls=1) == (content, calls, dropped)
    assert parse(XML, max_calls=2) == parse(XML)   # both calls allowed: nothing dropped
    # an answer that ends inside its first call keeps it, incomplete
    assert parse(XML[:XML.index("</function>")], max_calls=1)[1][0][2] is False


# --- over HTTP on the real SmolLM2 -----------------------------------------------------------

SYSTEM = 'You call tools by writing <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'


def _call(city):
    return ('<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>'
            % city)


SHOTS = [{"role": "user", "content": "What is the weather in Rome?"},
         {"role": "assistant", "content": _call("Rome")},
         {"role": "user", "content": "What is the weather in Madrid?"},
         {"role": "assistant", "content": _call("Madrid")},
         {"role": "user", "content": "What is the weather in Paris?"}]
CHAT = {"messages": [{"role": "system", "content": SYSTEM}] + SHOTS, "tools": TOOLS,
        "temperature": 0, "max_tokens": 40}


def _frames(text):
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.slow
async def test_chat_returns_tool_calls_and_streams_them_in_fragments(server_factory):
    _, client = await server_factory()
    r = (await client.post("/v1/chat/completions", json=CHAT)).json()
    ch = r["choices"][0]
    assert ch["finish_reason"] == "tool_calls"
    msg = ch["message"]
    assert msg["content"] is None
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}

    s = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    frames = _frames(s.text)
    deltas = [f["choices"][0]["delta"] for f in frames if f["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert all(c["index"] == 0 for c in calls) and "id" not in calls[1]
    assert "".join(c["function"]["arguments"] for c in calls) == call["function"]["arguments"]
    assert not any(d.get("content") for d in deltas)
    assert frames[-1]["choices"][0]["finish_reason"] == "tool_calls"
    m = (await client.get("/metrics")).text
    assert "ninfer:tool_calls_total 2.0" in m and "ninfer:tool_calls_incomplete_total 0.0" in m

    # the call and its result go back as history; the model answers from the result
    follow = {**CHAT, "messages": CHAT["messages"] + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 24 C"}]}
    r2 = await client.post("/v1/chat/completions", json=follow)
    assert r2.status_code == 200, r2.text


@pytest.mark.slow
async def test_tool_choice_none_parses_nothing_and_required_is_refused(server_factory):
    _, client = await server_factory()
    r = (await client.post("/v1/chat/completions", json={**CHAT, "tool_choice": "none"})).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert "tool_calls" not in r["choices"][0]["message"]
    assert "<tool_call>" in r["choices"][0]["message"]["content"]  # plain text, as written
    r = await client.post("/v1/chat/completions", json={**CHAT, "tool_choice": "required"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "tool_choice_not_supported"
    r = await client.post("/v1/chat/completions", json={**CHAT, "tools": [{"type": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0]"


@pytest.mark.slow
async def test_messages_returns_tool_use_blocks_streamed_as_input_json(server_factory):
    _, client = await server_factory()
    body = {"model": "m", "system": SYSTEM, "messages": SHOTS, "max_tokens": 40,
            "temperature": 0, "tools": [{"name": "get_weather", "input_schema": {
                "type": "object", "properties": {"city": {"type": "string"}}}}]}
    r = (await client.post("/v1/messages", json=body)).json()
    assert r["stop_reason"] == "tool_use"
    (block,) = r["content"]
    assert block["type"] == "tool_use" and block["id"].startswith("toolu_")
    assert block["name"] == "get_weather" and block["input"] == {"city": "Paris"}

    s = await client.post("/v1/messages", json={**body, "stream": True})
    events = []
    for frame in s.text.split("\n\n"):
        lines = frame.splitlines()
        if len(lines) == 2:
            events.append(json.loads(lines[1][6:]))
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [e["content_block"]["type"] for e in starts] == ["tool_use"]
    assert starts[0]["content_block"]["name"] == "get_weather"
    parts = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert json.loads("".join(parts)) == {"city": "Paris"}
    assert [e["type"] for e in events][-3:] == ["content_block_stop", "message_delta",
                                                 "message_stop"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"

    # tool_use and tool_result blocks go back as history
    follow = {**body, "messages": SHOTS + [
        {"role": "assistant", "content": [block]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block["id"],
                                      "content": "Sunny, 24 C"}]}]}
    r2 = await client.post("/v1/messages", json=follow)
    assert r2.status_code == 200, r2.text


def _two_city_shots():
    two = [("Rome", "Oslo"), ("Lima", "Kyiv")]
    msgs = []
    for a, b in two:
        msgs += [{"role": "user", "content": f"Weather in {a} and {b}?"},
                 {"role": "assistant", "content": _call(a) + "\n" + _call(b)}]
    return msgs + [{"role": "user", "content": "Weather in Paris and Berlin?"}]


@pytest.mark.slow
async def test_one_call_at_most_when_parallel_calls_are_off_on_every_route(server_factory,
                                                                          tmp_path):
    """After two examples of two calls per answer SmolLM2 writes two calls; Chat's
    ``parallel_tool_calls: false``, Responses' likewise and Messages'
    ``disable_parallel_tool_use`` keep the first one only (streamed too), and the generation
    ends once that call is complete (request.finished says tool_calls) instead of decoding
    the second one."""
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(request_log_jsonl=str(log))
    shots = _two_city_shots()
    chat = {"messages": shots, "tools": TOOLS, "temperature": 0, "max_tokens": 80}
    both = (await client.post("/v1/chat/completions", json=chat)).json()
    calls = both["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Berlin"]
    one = (await client.post("/v1/chat/completions",
                             json={**chat, "parallel_tool_calls": False})).json()
    assert one["choices"][0]["finish_reason"] == "tool_calls"
    (call,) = one["choices"][0]["message"]["tool_calls"]
    assert call["function"] == calls[0]["function"]
    assert one["usage"]["completion_tokens"] < both["usage"]["completion_tokens"]
    server.state.bus.flush()
    fins = {r["request_id"]: r["finish_reason"] for r in map(json.loads,
                                                           log.read_text().splitlines())
            if r["kind"] == "request.finished"}
    assert fins[one["id"]] == "tool_calls" and fins[both["id"]] == "stop_token"
    # an output limit met just as the allowed call completes (or while the engine got word
    # to stop) is still a tool-call answer, not a cut one
    k = one["usage"]["completion_tokens"]
    for limit in range(max(1, k - 4), k + 1):
        r = (await client.post("/v1/chat/completions", json={
            **chat, "parallel_tool_calls": False, "max_tokens": limit})).json()["choices"][0]
        got = r["message"].get("tool_calls") or []
        if got and got[0]["function"] == calls[0]["function"]:
            assert r["finish_reason"] == "tool_calls", limit
        else:
            assert r["finish_reason"] == "length", limit
    s = await client.post("/v1/chat/completions",
                          json={**chat, "parallel_tool_calls": False, "stream": True})
    deltas = [f["choices"][0]["delta"] for f in _frames(s.text) if f["choices"]]
    assert {c["index"] for d in deltas for c in d.get("tool_calls", ())} == {0}

    flat = [{"type": "function", "name": "get_weather",
             "parameters": TOOLS[0]["function"]["parameters"]}]
    items = [{"role": m["role"], "content": m["content"]} for m in shots]
    resp = {"model": both["model"], "input": items, "tools": flat, "temperature": 0,
            "max_output_tokens": 80, "parallel_tool_calls": False}
    r = (await client.post("/v1/responses", json=resp)).json()
    assert r["parallel_tool_calls"] is False
    assert [(o["type"], json.loads(o["arguments"])) for o in r["output"]] == \
        [("function_call", {"city": "Paris"})]

    msgs = {"model": "m", "messages": shots, "max_tokens": 80, "temperature": 0,
            "tools": [{"name": "get_weather",
                       "input_schema": TOOLS[0]["function"]["parameters"]}],
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}
    m = (await client.post("/v1/messages", json=msgs)).json()
    assert m["stop_reason"] == "tool_use"
    assert [(b["type"], b["input"]) for b in m["content"]] == [("tool_use", {"city": "Paris"})]

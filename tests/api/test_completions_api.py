"""``POST /v1/completions`` (OpenAI legacy completions) over real sockets on the real SmolLM2:
the official openai client, the legacy logprobs shape checked against Chat's logprobs, echo,
token-id and list prompts with n, best_of, suffix, prefix reuse and the log."""
from __future__ import annotations

import json
from types import SimpleNamespace

import openai
import pytest
import trio

from ninfer.api.completion_prompts import fim_ids
from ninfer.api.completions import CompletionsHandler
from ninfer.api.completions_request import CompletionRequest
from ninfer.engine.tokenizer import CONTROL, NORMAL, Tokenizer, bytes_to_unicode

pytestmark = pytest.mark.slow
URL = "/v1/completions"
PROMPT = "The capital of France is"


def _sse(body: str) -> list:
    return [f[6:] if f[6:] == "[DONE]" else json.loads(f[6:])
            for f in body.split("\n\n") if f.startswith("data: ")]


async def _openai(client, fn):
    """``fn(openai.OpenAI)`` on a worker thread (the sync client, against the test's server)."""
    sdk = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key="unused", max_retries=0)
    try:
        return await trio.to_thread.run_sync(lambda: fn(sdk))
    finally:
        sdk.close()


async def test_openai_client_streamed_and_not(server_factory):
    server, client = await server_factory()
    args = dict(model=server.state.model_id, prompt=PROMPT, temperature=0, max_tokens=8)
    reply = await _openai(client, lambda c: c.completions.create(**args))

    def stream(c):
        chunks = list(c.completions.create(**args, stream=True,
                                           stream_options={"include_usage": True}))
        return chunks

    chunks = await _openai(client, stream)
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    ch = reply.choices[0]
    assert "Paris" in ch.text and ch.index == 0 and ch.finish_reason in ("stop", "length")
    assert ch.logprobs is None
    n_prompt = len(server.state.tokenizer.encode(PROMPT))   # no BOS: add_bos_token false
    assert reply.usage.prompt_tokens == n_prompt
    assert reply.usage.total_tokens == n_prompt + reply.usage.completion_tokens
    assert reply.model_extra["timings"]["predicted_n"] == reply.usage.completion_tokens
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ch.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices
                and c.choices[0].finish_reason]
    assert finishes == [ch.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        reply.usage.completion_tokens
    r = await client.post(URL, json={"prompt": PROMPT, "max_tokens": 2, "stream": True})
    assert _sse(r.text)[-1] == "[DONE]"


async def test_legacy_logprobs_are_chats_logprobs(server_factory):
    """The same prompt tokens (the chat template rendered by hand) and greedy decoding: the
    legacy shape carries exactly Chat's token logprobs and alternatives."""
    server, client = await server_factory()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = server.state.template.render(msgs, add_generation_prompt=True)
    chat = (await client.post("/v1/chat/completions", json={
        "messages": msgs, "temperature": 0, "max_tokens": 6, "logprobs": True,
        "top_logprobs": 3})).json()
    r = await client.post(URL, json={"prompt": text, "temperature": 0, "max_tokens": 6,
                                     "logprobs": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    ch = body["choices"][0]
    assert body["usage"]["prompt_tokens"] == chat["usage"]["prompt_tokens"]
    assert ch["text"] == chat["choices"][0]["message"]["content"]
    lp, ref = ch["logprobs"], chat["choices"][0]["logprobs"]["content"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lp["tokens"] == [e["token"] for e in ref]
    assert lp["token_logprobs"] == pytest.approx([e["logprob"] for e in ref], abs=1e-4)
    for top, e in zip(lp["top_logprobs"], ref):
        assert e["token"] in top and 1 <= len(top) <= 4
        alts = {a["token"]: a["logprob"] for a in e["top_logprobs"]}
        assert top == pytest.approx({**alts, e["token"]: e["logprob"]}, abs=1e-4)
    # the tokens join to the text (a final stop token, logged, adds no text)
    shown = [t for t in lp["tokens"] if t != "<|im_end|>"]
    assert "".join(shown) == ch["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i])
                                 for i in range(len(lp["tokens"]))]
    # streamed: the same entries, offsets running on across chunks
    s = await client.post(URL, json={"prompt": text, "temperature": 0, "max_tokens": 6,
                                     "logprobs": 3, "stream": True})
    frames = [f for f in _sse(s.text) if f != "[DONE]"]
    parts = [f["choices"][0]["logprobs"] for f in frames if f["choices"][0]["logprobs"]]
    assert sum((p["tokens"] for p in parts), []) == lp["tokens"]
    assert sum((p["text_offset"] for p in parts), []) == lp["text_offset"]
    # logprobs 0: the sampled token only
    z = (await client.post(URL, json={"prompt": text, "temperature": 0, "max_tokens": 3,
                                      "logprobs": 0})).json()["choices"][0]["logprobs"]
    assert [list(t) for t in z["top_logprobs"]] == [[t] for t in z["tokens"]]
    for bad in (6, -1, True):
        r = await client.post(URL, json={"prompt": "a", "logprobs": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


async def test_echo(server_factory):
    server, client = await server_factory()
    n_prompt = len(server.state.tokenizer.encode(PROMPT))
    r = (await client.post(URL, json={"prompt": PROMPT, "echo": True, "max_tokens": 0})).json()
    assert r["choices"][0]["text"] == PROMPT and r["choices"][0]["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 0,
                          "total_tokens": n_prompt,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    s = await client.post(URL, json={"prompt": PROMPT, "echo": True, "max_tokens": 0,
                                     "stream": True})
    frames = _sse(s.text)
    assert frames[-1] == "[DONE]" and "".join(f["choices"][0]["text"] for f in frames[:-1]) \
        == PROMPT
    both = (await client.post(URL, json={"prompt": PROMPT, "echo": True, "max_tokens": 4,
                                         "temperature": 0})).json()
    plain = (await client.post(URL, json={"prompt": PROMPT, "max_tokens": 4,
                                          "temperature": 0})).json()
    assert both["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]
    for body, param, code in (
            ({"max_tokens": 0}, "max_tokens", "invalid_value"),
            ({"echo": True, "logprobs": 1}, "logprobs", "prompt_logprobs_not_supported"),
            ({"echo": "yes"}, "echo", "invalid_value")):
        r = await client.post(URL, json={"prompt": PROMPT, **body})
        err = r.json()["error"]
        assert r.status_code == 400 and (err["param"], err["code"]) == (param, code)


async def test_token_id_and_list_prompts_with_n(server_factory):
    server, client = await server_factory(max_concurrency=2)
    tok = server.state.tokenizer
    other = "Water boils at"
    greedy = {"temperature": 0, "max_tokens": 5}
    single = [(await client.post(URL, json={"prompt": p, **greedy})).json()
              for p in (PROMPT, other)]
    by_ids = (await client.post(URL, json={"prompt": tok.encode(PROMPT), **greedy})).json()
    assert by_ids["choices"][0]["text"] == single[0]["choices"][0]["text"]
    echo = (await client.post(URL, json={"prompt": tok.encode(PROMPT), "echo": True,
                                         "max_tokens": 0})).json()
    assert echo["choices"][0]["text"] == PROMPT
    for prompt in ([PROMPT, other], [tok.encode(PROMPT), tok.encode(other)]):
        r = (await client.post(URL, json={"prompt": prompt, "n": 2, **greedy})).json()
        assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
        assert [c["text"] for c in r["choices"]] == [
            single[0]["choices"][0]["text"]] * 2 + [single[1]["choices"][0]["text"]] * 2
        assert r["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in single)
        assert r["usage"]["completion_tokens"] == 2 * sum(
            s["usage"]["completion_tokens"] for s in single)
    sdk = await _openai(client, lambda c: c.completions.create(
        model=server.state.model_id, prompt=[PROMPT, other], n=2, **greedy))
    assert [c.index for c in sdk.choices] == [0, 1, 2, 3]
    assert sdk.choices[3].text == single[1]["choices"][0]["text"]
    r = await client.post(URL, json={"prompt": [PROMPT] * 3, "n": 8, "max_tokens": 1})
    err = r.json()["error"]   # 24 choices past the admission's 18: the message says whose
    assert r.status_code == 400 and err["param"] == "n" and "'n' 8 x 3 prompts is 24" in \
        err["message"], err
    for prompt, param in (([], "prompt"), ([[]], "prompt[0]"), ([1, "a"], "prompt"),
                          ([tok.vocab_size], "prompt"), ([[5], [tok.vocab_size]], "prompt[1]"),
                          ("", "prompt"), (None, "prompt")):
        r = await client.post(URL, json={"prompt": prompt})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (prompt, r.text)


async def test_best_of_and_suffix(server_factory):
    server, client = await server_factory()
    for extra, code in (({"best_of": 3}, "best_of_not_supported"),
                        ({"best_of": 1, "n": 2}, "invalid_value"),
                        ({"suffix": "\n    return x"}, "suffix_not_supported"),
                        ({"logit_bias": {"5": 1}}, "logit_bias_not_supported")):
        r = await client.post(URL, json={"prompt": PROMPT, "max_tokens": 1, **extra})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == code, r.text
        assert err["param"] == next(iter(extra))
    for extra in ({"best_of": 2, "n": 2}, {"best_of": 1}, {"suffix": ""}, {"user": "u1"},
                  {"seed": 7, "top_p": 0.9, "presence_penalty": 0.5,
                   "frequency_penalty": 0.5, "stop": ["\n"]}):
        r = await client.post(URL, json={"prompt": PROMPT, "max_tokens": 2, **extra})
        assert r.status_code == 200, (extra, r.text)
    assert fim_ids(server.state.tokenizer) is None   # SmolLM2's vocabulary has no FIM tokens


def test_suffix_builds_a_fill_in_the_middle_prompt():
    """On a vocabulary with FIM tokens the prompt is PRE prefix SUF suffix MID (llama.cpp's
    ``format_infill`` order), and a text prompt gets BOS when the vocabulary asks for it."""
    base = list(bytes_to_unicode().values())
    specials = ["<s>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
    tok = Tokenizer.from_dict({"model": "gpt2", "pre": "gpt2", "tokens": base + specials,
                               "token_types": [NORMAL] * 256 + [CONTROL] * 4, "merges": [],
                               "bos_token_id": 256, "eos_token_id": 256,
                               "add_bos_token": True})
    state = SimpleNamespace(tokenizer=tok, template=None, n_ctx=256, config=None)
    handler = CompletionsHandler(state)
    assert handler.fim == (257, 258, 259)
    creq = CompletionRequest(model=None, prompts=["def f(", [1, 2]], max_tokens=None,
                             temperature=None, top_p=None, top_k=None, min_p=None, seed=None,
                             stop=(), stream=False, include_usage=False, suffix="):")
    first, second = handler.tokenize(creq)
    ids, text, ids2, text2 = first.ids, first.text, second.ids, second.text
    assert ids == [256, 257, *tok.encode("def f("), 258, *tok.encode("):"), 259]
    assert text == "def f("
    assert ids2 == [257, 1, 2, 258, *tok.encode("):"), 259] and text2 == tok.decode([1, 2])


async def test_repeated_prompt_reuses_its_prefix_and_is_logged(server_factory, tmp_path):
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(request_log_jsonl=str(log))
    prompt = "Once upon a time, in a land far away, there lived a king who had three sons."
    req = {"prompt": prompt, "temperature": 0, "max_tokens": 4}
    first = (await client.post(URL, json=req)).json()
    second = await client.post(URL, json=req)
    body = second.json()
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cached > 0 and body["timings"]["cache_n"] == cached
    assert body["choices"][0]["text"] == first["choices"][0]["text"]
    server.state.bus.flush()
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    received = [x for x in recs if x["kind"] == "request.received"]
    assert [x["protocol"] for x in received] == ["openai_completions"] * 2
    assert received[1]["http_request_id"] == second.headers["x-request-id"]
    assert received[1]["max_tokens"] == 4 and received[1]["max_tokens_source"] == "client"
    dflt = (await client.post(URL, json={"prompt": prompt, "temperature": 0})).json()
    assert dflt["usage"]["completion_tokens"] <= 16   # OpenAI's default max_tokens
    r = await client.post(URL, json={"prompt": "hello " * 3000, "max_tokens": 1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    r = await client.post(URL, json={"prompt": PROMPT, "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

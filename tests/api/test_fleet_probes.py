"""What a gateway asks of a replica, in process: ``/v1/loads`` (smg's load poll), vLLM's fields
on ``/v1/models``, and the KV-event stream (``--kv-events-endpoint``) decoded by the reference
decoder of vLLM's format and checked against ``/slots``."""
from __future__ import annotations

import pytest
import trio
from kv_reference import check_against_slots, index_of, replay

pytestmark = pytest.mark.slow

TURN = {"temperature": 0, "max_tokens": 12}


async def test_load_and_model_documents_gateways_read(server_factory, wait_sampled_idle):
    server, client = await server_factory(max_concurrency=2)
    model = (await client.get("/v1/models")).json()["data"][0]
    assert model["max_model_len"] == 2048 and model["root"] == str(server.runtime.path)
    assert model["root"].endswith((".gguf", ".ninfer")) and model["root"] != "None"
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Name a colour."}], **TURN})
    assert r.status_code == 200
    await wait_sampled_idle(server, client)
    loads = (await client.get("/v1/loads")).json()
    assert loads == (await client.get("/loads")).json()
    assert loads["dp_rank_count"] == 1 and loads["timestamp"]
    (rank,) = loads["loads"]
    assert rank["num_running_reqs"] == rank["num_waiting_reqs"] == 0
    assert rank["max_running_requests"] == 2
    assert rank["max_total_num_tokens"] == server.engine.config.num_pages * 16
    # the idle lane's retained pages are not load: a warm cache is not a full replica
    assert rank["num_used_tokens"] == 0 and rank["token_usage"] == 0.0


async def test_kv_events_tell_what_the_lanes_hold(server_factory):
    server, client = await server_factory(max_concurrency=2,
                                          kv_events_endpoint="tcp://127.0.0.1:*",
                                          kv_events_replay_endpoint="tcp://127.0.0.1:*")
    (pub,) = [s for s in server.state.bus.sinks if s.name == "kv_events"]
    history = [{"role": "user", "content": "What is the capital of France?"}]
    for turn in range(3):
        r = await client.post("/v1/chat/completions", json={"messages": history, **TURN})
        body = r.json()
        if turn:   # later turns reuse the lane that holds the conversation
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        history += [body["choices"][0]["message"],
                    {"role": "user", "content": ["And of Italy?", "And Spain?"][turn % 2]}]
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Count to five."}], **TURN})
    assert r.status_code == 200
    server.state.bus.flush()
    batches = await trio.to_thread.run_sync(replay, pub.replay_endpoint)
    index = index_of(batches)
    assert index.cleared == 1 and batches[0][1].events[0].__class__.__name__ == \
        "AllBlocksCleared"
    slots = (await client.get("/slots")).json()
    check_against_slots(index, slots, server.engine.config.page_size)
    # the conversation's blocks decode to its text
    leaves = index.leaves("GPU")
    texts = [server.state.tokenizer.decode(index.chain_tokens("GPU", h)) for h in leaves]
    assert any("capital of France" in t and "Italy" in t for t in texts), texts


async def test_tokenize_gives_the_ids_a_request_would_get(server_factory):
    server, client = await server_factory()
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "What is the capital of France?"}],
            **TURN}
    got = (await client.post("/tokenize", json={**chat, "add_generation_prompt": True})).json()
    r = (await client.post("/v1/chat/completions", json=chat)).json()
    assert got["count"] == len(got["tokens"]) == r["usage"]["prompt_tokens"]
    assert got["max_model_len"] == 2048 and got["token_strs"] is None
    tok = server.state.tokenizer
    assert tok.decode(got["tokens"]).endswith("assistant\n")
    text = (await client.post("/tokenize", json={"prompt": "Hello world"})).json()
    assert text["tokens"][-2:] == tok.encode("Hello world")[-2:]
    bad = await client.post("/tokenize", json={"text": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"

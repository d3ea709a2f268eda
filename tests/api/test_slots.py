"""``POST /slots/{id}?action=save|restore|erase`` over the real app on the real SmolLM2 (serving
contract §1.10): a session saved by one server is restored by another and continued as a cold
prefill would; the preconditions, the error codes and what bad input leaves behind."""
from __future__ import annotations

import json

import pytest
import trio

from test_serving_contract import _body, _idle_and_whole, _post, _until_a_lane_is_busy

pytestmark = pytest.mark.slow
URL = "/v1/chat/completions"
Q = [{"role": "user", "content": "What is the capital of France?"}]


async def _ask(client, messages, max_tokens=24):
    r = await client.post(URL, json={"messages": messages, "temperature": 0,
                                     "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r.json()


def _err(r, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code, r.text


async def test_a_session_saved_by_one_server_is_restored_by_another(server_factory, tmp_path):
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(max_concurrency=2, slot_save_path=str(tmp_path),
                                          telemetry_interval_ms=20, request_log_jsonl=str(log))
    a1 = await _ask(client, Q)
    (held,) = [s for s in (await client.get("/slots")).json() if s["retained"]]
    lane, digest, depth = held["id"], held["session_digest"], held["n_prompt_tokens"]

    r = await client.post(f"/slots/{lane}?action=save",
                          json={"filename": "paris.slot", "if_digest": "0" * 16})
    _err(r, 409, "slot_session_mismatch")
    refused = r.headers["x-request-id"]
    r = await client.post(f"/slots/{lane}?action=save",
                          json={"filename": "paris.slot", "if_digest": digest})
    assert r.status_code == 200, r.text
    saved = r.json()
    assert saved["id_slot"] == lane and saved["filename"] == "paris.slot"
    assert saved["n_saved"] == depth and saved["session_digest"] == digest
    assert saved["n_written"] == (tmp_path / "paris.slot").stat().st_size
    assert saved["timings"]["save_ms"] > 0
    r = await client.post(f"/slots/{lane}?action=erase", json={"if_digest": digest})
    assert r.json() == {"id_slot": lane, "n_erased": depth}
    assert not any(s["retained"] for s in (await client.get("/slots")).json())

    # another server (a restart) restores it into its slot 1 and continues the conversation
    server2, client2 = await server_factory(max_concurrency=2, slot_save_path=str(tmp_path),
                                            telemetry_interval_ms=20)
    r = await client2.post("/slots/1?action=restore", json={"filename": "paris.slot"})
    assert r.status_code == 200, r.text
    rest = r.json()
    assert rest["n_restored"] == depth and rest["session_digest"] == digest
    assert rest["n_read"] == saved["n_written"] and rest["timings"]["restore_ms"] > 0
    slots = (await client2.get("/slots")).json()
    assert slots[1]["retained"] and slots[1]["session_digest"] == digest
    assert slots[1]["n_prompt_tokens"] == depth and not slots[0]["retained"]
    follow = Q + [{"role": "assistant", "content": a1["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "And of Germany?"}]
    a2 = await _ask(client2, follow)
    assert a2["usage"]["prompt_tokens_details"]["cached_tokens"] >= depth - 2
    assert a2["timings"]["cache_n"] == a2["usage"]["prompt_tokens_details"]["cached_tokens"]
    cold = await _ask(client, follow)   # server 1 holds nothing of it any more
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert a2["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]

    server.state.bus.flush()
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    acts = [r for r in recs if r["kind"] == "slot.action"]
    assert [(a["action"], a["ok"], a["code"]) for a in acts] == [
        ("save", False, "slot_session_mismatch"), ("save", True, ""), ("erase", True, "")]
    # the refusal is one record, under the x-request-id its client got
    assert acts[0]["http_request_id"] == refused and all(a["http_request_id"] for a in acts)
    assert not [r for r in recs if r["kind"] == "request.error"]
    assert acts[1]["bytes"] == saved["n_written"] and acts[1]["tokens"] == depth
    await _idle_and_whole(client)
    await _idle_and_whole(client2)


async def test_bad_slot_requests_get_stable_codes_and_change_nothing(server_factory, tmp_path):
    server, client = await server_factory(max_concurrency=1, slot_save_path=str(tmp_path),
                                          telemetry_interval_ms=20, pending_timeout_ms=600_000)
    await _ask(client, Q, max_tokens=8)
    before = (await client.get("/slots")).json()
    assert before[0]["retained"]
    for path, body, status, code in [
            ("/slots/1?action=save", {"filename": "a"}, 400, "invalid_slot"),
            ("/slots/-1?action=save", {"filename": "a"}, 400, "invalid_slot"),
            ("/slots/x?action=save", {"filename": "a"}, 400, "invalid_slot"),
            ("/slots/00?action=save", {"filename": "a"}, 400, "invalid_slot"),
            ("/slots/" + "0" * 5000 + "?action=erase", {}, 400, "invalid_slot"),
            ("/slots/0?action=erase", {"if_digest": ""}, 400, "invalid_request"),
            ("/slots/0?action=save", {"filename": "a", "bogus": 1}, 400, "unknown_parameter"),
            ("/slots/0?action=restore", {"filename": "a", "if_digest": "0" * 16}, 400,
             "unknown_parameter"),
            ("/slots/0?action=erase", {"filename": "a"}, 400, "unknown_parameter"),
            ("/slots/0?action=load", {"filename": "a"}, 400, "invalid_action"),
            ("/slots/0", {"filename": "a"}, 400, "invalid_action"),
            ("/slots/0?action=save", {"filename": "../a"}, 400, "invalid_filename"),
            ("/slots/0?action=save", {"filename": ".a"}, 400, "invalid_filename"),
            ("/slots/0?action=save", {"filename": "a" * 129}, 400, "invalid_filename"),
            ("/slots/0?action=save", {}, 400, "invalid_filename"),
            ("/slots/0?action=save", [1], 400, "invalid_request"),
            ("/slots/0?action=erase", {"if_digest": 5}, 400, "invalid_request"),
            ("/slots/0?action=restore", {"filename": "missing"}, 400, "slot_restore_failed"),
            ("/slots/0?action=erase", {"if_digest": "0" * 16}, 409, "slot_session_mismatch")]:
        _err(await client.post(path, json=body), status, code)
    r = await client.post("/slots/0?action=save", content=b"{not json",
                          headers={"content-type": "application/json"})
    _err(r, 400, "invalid_json")   # as every route's
    assert r.json()["error"]["message"].startswith("request body is not valid JSON")
    # no filename: said to be required (a body of {}, or no body at all)
    blank = {"content": b" ", "headers": {"content-type": "application/json"}}
    for action, kw in [("save", {"json": {}}), ("restore", {}), ("restore", blank)]:
        r = await client.post(f"/slots/0?action={action}", **kw)
        _err(r, 400, "invalid_filename")
        assert r.json()["error"]["message"] == f"'filename' is required for action={action}"
        assert r.json()["error"]["param"] == "filename"
    # a repeated action: refused, not the first one run
    r = await client.post("/slots/0?action=save&action=erase", json={"filename": "a"})
    _err(r, 400, "invalid_action")
    assert r.json()["error"]["message"] == "give ?action= once (got 2: save, erase)"
    (tmp_path / "junk").write_bytes(b"NINFSLOT" + b"\xff" * 40)
    _err(await client.post("/slots/0?action=restore", json={"filename": "junk"}), 400,
         "slot_restore_failed")
    assert (await client.get("/slots")).json() == before   # nothing changed, nothing leaked
    assert (await client.post("/slots/0?action=save", json={"filename": "keep"})).status_code \
        == 200
    # a request on the slot: 409 slot_busy for every action
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_post, client, _body("Write a very long essay about the history "
                                                "of Rome.", max_tokens=2000, temperature=0))
        await _until_a_lane_is_busy(client)
        for action in ("save", "restore", "erase"):
            body = {} if action == "erase" else {"filename": "keep"}
            _err(await client.post(f"/slots/0?action={action}", json=body), 409, "slot_busy")
        nursery.cancel_scope.cancel()
    await _idle_and_whole(client)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk", "keep"]   # no partial file


async def test_slot_persistence_is_off_without_a_save_path(server_factory, tmp_path):
    _, client = await server_factory()
    r = await client.post("/slots/0?action=save", json={"filename": "a"})
    _err(r, 501, "slot_persistence_disabled")
    assert r.json()["error"]["type"] == "not_supported_error"
    # without prefix reuse nothing is retained to save, and a restore could never be reused
    _, client = await server_factory(slot_save_path=str(tmp_path), prefix_reuse=False)
    await _ask(client, Q, max_tokens=4)
    _err(await client.post("/slots/0?action=save", json={"filename": "a"}), 400,
         "slot_save_failed")
    _err(await client.post("/slots/0?action=restore", json={"filename": "a"}), 400,
         "slot_restore_failed")

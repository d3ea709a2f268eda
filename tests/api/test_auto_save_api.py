"""``--auto-save-evicted`` over the real app on the real SmolLM2, one lane and no L2: a saved
session displaced by another conversation is spilled to its slot file (``slot.spilled`` in the
log), restored by the client and continued with its whole prefix reused."""
from __future__ import annotations

import json

import pytest

from ninfer.config import ServeConfig
from test_serving_contract import _idle_and_whole
from test_slots import Q, _ask

pytestmark = pytest.mark.slow


def test_auto_save_needs_a_slot_save_path():
    with pytest.raises(ValueError, match="--auto-save-evicted needs --slot-save-path"):
        ServeConfig(model="m", auto_save_evicted=True)


async def test_a_displaced_session_is_spilled_and_restored_whole(server_factory, tmp_path):
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(max_concurrency=1, slot_save_path=str(tmp_path),
                                          auto_save_evicted=True, continuation_cache="l1",
                                          request_log_jsonl=str(log))
    a1 = await _ask(client, Q, max_tokens=8)
    r = await client.post("/slots/0?action=save", json={"filename": "paris"})
    assert r.status_code == 200, r.text
    saved = r.json()
    other = [{"role": "user", "content": "Name three prime numbers, please."}]
    await _ask(client, other, max_tokens=8)   # takes the lane: the session goes to its file
    r = await client.post("/slots/0?action=restore", json={"filename": "paris"})
    assert r.status_code == 200, r.text
    rest = r.json()
    # the file holds the session as it was when displaced (here: as saved)
    assert rest["n_restored"] == saved["n_saved"]
    assert rest["session_digest"] == saved["session_digest"]
    follow = Q + [{"role": "assistant", "content": a1["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "And of Germany?"}]
    a2 = await _ask(client, follow, max_tokens=8)
    assert a2["usage"]["prompt_tokens_details"]["cached_tokens"] >= saved["n_saved"] - 2
    server.engine.spiller.flush()
    server.state.bus.flush()
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    (spill,) = [x for x in recs if x["kind"] == "slot.spilled"]
    # (the other conversation shares the template header: the lane is cut back to it)
    assert spill["filename"] == "paris" and spill["reason"] == "truncated"
    assert spill["tokens"] == saved["n_saved"] and spill["lane"] == 0
    assert spill["session_digest"] == saved["session_digest"]
    assert spill["bytes"] == (tmp_path / "paris").stat().st_size
    assert not [x for x in recs if x["kind"] == "slot.spill_failed"]
    await _idle_and_whole(client)

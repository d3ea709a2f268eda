"""A server whose L3 directory holds a truncated LMDB file (an interrupted copy) starts, moves
the store aside, says so on stderr and on the log, and serves and persists with a fresh one;
replaying its log reproduces the live /metrics and /telemetry."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import trio

from ninfer.engine.continuation import LaneImage
from ninfer.replay import metrics_text, replay_log
from ninfer.store.continuation_store import ContinuationStore

pytestmark = pytest.mark.slow


async def test_a_truncated_l3_store_is_quarantined_and_the_server_serves(server_factory,
                                                                          tmp_path, capfd):
    root = tmp_path / "l3"
    s = ContinuationStore(str(root), "local", 8 << 20, {"artifact_sha256": "another"})
    rng = np.random.default_rng(0)
    for n in (40, 60, 80, 100):
        k = rng.standard_normal((2, n, 2, 64)).astype(np.float32)
        s.put(LaneImage(rng.integers(0, 1000, n).astype(np.int32), k, k))
    s.close()
    data = root / "local" / "data.mdb"
    half = data.stat().st_size // 2
    os.truncate(data, half)   # unchecked, the first read of a page past it was SIGBUS
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(
        continuation_cache="l1-l2-l3", continuation_cache_dir=str(root),
        continuation_cache_persist_min_tokens=1, request_log_jsonl=str(log),
        telemetry_interval_ms=60_000)
    err = capfd.readouterr().err
    (line,) = [x for x in err.splitlines() if "continuation store" in x]
    assert "is corrupt" in line and "truncated" in line and "moved to" in line
    (moved,) = [p for p in os.listdir(root) if p.startswith("local.corrupt-")]
    assert (root / moved / "data.mdb").stat().st_size == half   # kept as it was found
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert r.status_code == 200
    while not server.engine.idle():
        await trio.sleep(0.05)
    server.engine.persister.flush()   # returns once the writer has stored the image
    assert len(server.engine.store) == 1 and server.engine.store.quarantined[0] == \
        str(root / moved)
    server.state.bus.flush()
    records = [json.loads(x) for x in log.read_text().splitlines()]
    kinds = [x["kind"] for x in records]
    assert kinds.index("store.quarantined") + 1 == kinds.index("store.opened")
    (q,) = [x for x in records if x["kind"] == "store.quarantined"]
    assert q["path"] == str(root / "local") and q["moved_to"] == str(root / moved)
    assert "truncated" in q["reason"]
    opened = [x for x in records if x["kind"] == "store.opened"]
    assert opened[0]["entries"] == 0 and opened[0]["foreign"] == 0
    assert [x["entries"] for x in records if x["kind"] == "store.persisted"] == [1]
    tele = (await client.get("/telemetry")).json()
    l3 = tele["cache"]["l3"]
    assert l3["enabled"] is True and l3["quarantined_to"] == str(root / moved)
    assert l3["entries"] == 1 and l3["dropped_entries"] == 0
    live_metrics = (await client.get("/metrics")).text
    assert "ninfer:continuation_l3_dropped_entries_total 0.0" in live_metrics
    res = replay_log(log, upto_seq=tele["last_seq"])
    assert metrics_text(res.state) == live_metrics
    from ninfer.events.telemetry import telemetry_snapshot
    tele.pop("live")
    assert json.loads(json.dumps(telemetry_snapshot(res.state))) == tele


async def test_an_undecodable_descriptor_is_dropped_at_start_and_said(server_factory, tmp_path,
                                                                      capfd):
    """An entry whose descriptor does not decode is deleted when the server opens the store:
    a stderr line, ``store.entry_dropped`` after ``store.opened`` and the telemetry count,
    which a replay of the log reproduces; the other entries stay (as another model's)."""
    import lmdb
    root = tmp_path / "l3"
    s = ContinuationStore(str(root), "local", 8 << 20, {"artifact_sha256": "another"})
    rng = np.random.default_rng(1)
    keys = []
    for n in (40, 60, 80):
        k = rng.standard_normal((2, n, 2, 64)).astype(np.float32)
        keys.append(s.put(LaneImage(rng.integers(0, 1000, n).astype(np.int32), k, k))[0])
    s.close()
    env = lmdb.open(str(root / "local"), max_dbs=2, subdir=True)
    with env.begin(write=True) as txn:
        ledgers = env.open_db(b"ledgers", txn=txn)
        txn.put(keys[1], b"\xc1" + txn.get(keys[1], db=ledgers)[1:], db=ledgers)
    env.close()
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(
        continuation_cache="l1-l2-l3", continuation_cache_dir=str(root),
        request_log_jsonl=str(log), telemetry_interval_ms=60_000)
    server.state.bus.flush()
    (line,) = [x for x in capfd.readouterr().err.splitlines() if "store entry dropped" in x]
    assert line.startswith("ninfer: l3 store entry dropped (") and "undecodable descriptor" in line
    assert server.engine.store.foreign == 2
    records = [json.loads(x) for x in log.read_text().splitlines()]
    kinds = [x["kind"] for x in records]
    assert kinds.index("store.opened") + 1 == kinds.index("store.entry_dropped")
    tele = (await client.get("/telemetry")).json()
    assert tele["cache"]["l3"]["dropped_entries"] == 1
    res = replay_log(log, upto_seq=tele["last_seq"])
    assert metrics_text(res.state) == (await client.get("/metrics")).text

"""``telemetry.sample`` on change, with a 10 s heartbeat, on a real server: an idle server logs
almost no samples, a request's changes are sampled, and replay still reproduces /telemetry."""
from __future__ import annotations

import json

import pytest
import trio

from ninfer.replay import replay_log

pytestmark = pytest.mark.slow


def _samples(log) -> list[dict]:
    return [json.loads(x) for x in log.read_text().splitlines() if '"telemetry.sample"' in x]


async def test_an_idle_server_samples_on_change_not_every_interval(server_factory, tmp_path,
                                                                   wait_sampled_idle,
                                                                   monkeypatch):
    # (the board held still: NVML's readings are the whole GPU's, which other processes on a
    # shared card, such as parallel test workers, keep moving)
    from ninfer.sampler import GpuReader
    board = GpuReader().read()
    monkeypatch.setattr(GpuReader, "read", lambda self: dict(board))
    log = tmp_path / "log.jsonl"
    server, client = await server_factory(request_log_jsonl=str(log), telemetry_interval_ms=20)
    await trio.sleep(2.0)    # ~100 intervals of an idle server
    server.bus.flush()
    idle = _samples(log)
    # the first reading, perhaps one more while the engine publishes its first stats; one
    # sample per interval would be ~100 (the heartbeat is 10 s away)
    assert 1 <= len(idle) <= 3, len(idle)
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
    assert r.status_code == 200
    await wait_sampled_idle(server, client)
    live = (await client.get("/telemetry")).json()
    samples = _samples(log)
    assert len(samples) > len(idle)                  # the request's work was sampled
    last = samples[-1]
    assert last["scheduler"]["running"] == 0 and last["scheduler"]["retained_lanes"] == 1
    assert last["worker_seconds"]["decode"] > 0     # the settled state is the last sample
    assert live["memory"]["kv_retained_pages"] == last["scheduler"]["retained_pages"] > 0
    from ninfer.events.telemetry import telemetry_snapshot
    res = replay_log(log, upto_seq=live["last_seq"])
    live.pop("live")
    assert json.loads(json.dumps(telemetry_snapshot(res.state))) == live

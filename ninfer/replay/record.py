"""Re-create the recorded fixtures under ``tests/fixtures/replay/`` (run from the repo root):

    python -m ninfer.replay.record [MODEL]

Starts the real server in-process (SmolLM2 by default) and sends requests over HTTP:

- ``sessions/``, one server per scenario with ``--record-sessions``: ``greedy/`` (temperature
  0), ``seeded/`` (temperature 0.8, top_p 0.95, seed 7) and ``concurrent4/`` (four seeded
  requests in flight at once on ``--max-concurrency 4``). ``tests/test_recorded_sessions.py``
  re-executes them and requires an exact match.
- ``events/serve.jsonl``, the record log of one server with L1-L3 continuation tiers on two
  lanes: a request and its follow-up turn (prefix reuse), six at once (two refused, the queue
  holds two), a stream the client leaves (a cancel) and a repeat of the first prompt. The
  expected views of that log are the old code's (``events/expected.json``): re-recording it
  means re-capturing them.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import httpx
import trio

from ..config import ServeConfig
from ..server import build_server, load_runtime, serve

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "replay"
SCENARIOS = {
    "greedy": [dict(messages=[{"role": "user", "content": "What is the capital of France?"}],
                    temperature=0, max_tokens=32)],
    "seeded": [dict(messages=[{"role": "system", "content": "You are a poet."},
                              {"role": "user", "content": "Write two lines about rain."}],
                    temperature=0.8, top_p=0.95, seed=7, max_tokens=40)],
    "concurrent4": [dict(messages=[{"role": "user", "content": f"Give me a fun fact about {t}."}],
                         temperature=0.7, top_k=40, seed=100 + i, max_tokens=32,
                         stream=bool(i % 2))
                    for i, t in enumerate(("octopuses", "Mars", "honey", "volcanoes"))],
}
CAPITAL = "What is the capital of France?"


def _user(text: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": text}], "temperature": 0, **kw}


async def _post(client: httpx.AsyncClient, body: dict, refusable: bool = False
                ) -> httpx.Response:
    r = await client.post("/v1/chat/completions", json=body)
    if not (refusable and r.status_code == 429):
        r.raise_for_status()
    if body.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
    return r


async def _serving(rt, config: ServeConfig, drive) -> None:
    """Serve ``config`` until ``drive(client)`` returns."""
    server = build_server(config, rt)
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve, server)
        async with httpx.AsyncClient(base_url=binds[0], timeout=300) as client:
            await drive(client)
        nursery.cancel_scope.cancel()


async def record_sessions(rt, name: str, bodies: list[dict]) -> None:
    out = FIXTURES / "sessions" / name
    shutil.rmtree(out, ignore_errors=True)

    async def drive(client):
        async with trio.open_nursery() as reqs:
            for body in bodies:
                reqs.start_soon(_post, client, body)

    await _serving(rt, ServeConfig(port=0, max_context=1024, max_concurrency=4,
                                   record_sessions=str(out)), drive)


async def record_log(rt, out: Path) -> None:
    out.unlink(missing_ok=True)
    config = ServeConfig(port=0, max_context=1024, max_concurrency=2, max_pending_requests=2,
                         request_log_jsonl=str(out), telemetry_interval_ms=100,
                         continuation_cache="l1-l2-l3",
                         continuation_cache_dir=tempfile.mkdtemp(prefix="ninfer-l3-"),
                         continuation_cache_persist_min_tokens=16,
                         continuation_cache_min_restore_tokens=16)

    async def drive(client):
        first = (await _post(client, _user(CAPITAL, max_tokens=8))).json()
        answer = first["choices"][0]["message"]["content"]
        await _post(client, {"messages": [{"role": "user", "content": CAPITAL},
                                          {"role": "assistant", "content": answer},
                                          {"role": "user", "content": "And of Italy?"}],
                             "temperature": 0, "max_tokens": 6})
        async with trio.open_nursery() as reqs:   # more than lanes + queue: two are refused
            for i, t in enumerate(("octopuses", "Mars", "honey", "volcanoes", "tea", "owls")):
                reqs.start_soon(_post, client, _user(f"Give me a fun fact about {t}.",
                                                     max_tokens=6 + i), True)
        async with client.stream("POST", "/v1/chat/completions", json=_user(
                "Tell me a long story about a dragon.", max_tokens=200, stream=True)) as r:
            chunks = 0
            async for line in r.aiter_lines():   # leave after a few tokens: a cancel
                chunks += line.startswith("data:")
                if chunks >= 4:
                    break
        await _post(client, _user(CAPITAL, max_tokens=5))
        await trio.sleep(0.5)   # a last telemetry sample of the idle engine

    await _serving(rt, config, drive)


def main() -> int:
    rt = load_runtime(sys.argv[1] if len(sys.argv) > 1 else None)
    for name, bodies in SCENARIOS.items():
        trio.run(record_sessions, rt, name, bodies)
        print(name, len(list((FIXTURES / "sessions" / name).glob("*.json"))), "sessions")
    trio.run(record_log, rt, FIXTURES / "events" / "serve.jsonl")
    print("events/serve.jsonl recorded")
    return 0


if __name__ == "__main__":
    sys.exit(main())

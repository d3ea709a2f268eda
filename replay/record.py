"""Re-create the recorded SmolLM2 sessions in this folder (run from the repo root):

    python replay/record.py

Starts the real server in-process with ``--record-sessions`` per scenario and sends the requests
over HTTP: ``greedy/`` (temperature 0), ``seeded/`` (temperature 0.8, top_p 0.95, seed 7) and
``concurrent4/`` (four seeded requests in flight at once on ``--max-concurrency 4``).
``tests/test_recorded_sessions.py`` re-executes them and requires an exact match.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import httpx
import trio

from ninfer.config import ServeConfig
from ninfer.server import build_server, load_runtime, serve

HERE = Path(__file__).resolve().parent
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


async def _post(client: httpx.AsyncClient, body: dict) -> None:
    r = await client.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    if body.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]


async def record(rt, name: str, bodies: list[dict]) -> None:
    out = HERE / name
    shutil.rmtree(out, ignore_errors=True)
    cfg = ServeConfig(port=0, max_context=1024, max_concurrency=4, record_sessions=str(out))
    server = build_server(cfg, rt)
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve, server)
        async with httpx.AsyncClient(base_url=binds[0], timeout=300) as client:
            async with trio.open_nursery() as reqs:
                for body in bodies:
                    reqs.start_soon(_post, client, body)
        nursery.cancel_scope.cancel()


def main() -> int:
    rt = load_runtime(sys.argv[1] if len(sys.argv) > 1 else None)
    for name, bodies in SCENARIOS.items():
        trio.run(record, rt, name, bodies)
        print(name, len(list((HERE / name).glob("*.json"))), "sessions")
    return 0


if __name__ == "__main__":
    sys.exit(main())

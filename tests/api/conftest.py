"""Fixtures for API tests: the real SmolLM2 loaded once; a fresh engine + app per test."""
from __future__ import annotations

import httpx
import pytest
import trio

from ninfer.config import ServeConfig
from ninfer.server import build_server, load_runtime, serve


@pytest.fixture(scope="session")
def smollm2_runtime(smollm2_gguf, backend):
    return load_runtime(str(smollm2_gguf), backend)


@pytest.fixture
async def server_factory(smollm2_runtime, backend, nursery):
    """``await make(**config)`` -> (server, httpx.AsyncClient): the real app served by hypercorn
    on a free 127.0.0.1 port; the server stops when the test's nursery is cancelled."""
    clients = []

    async def make(**overrides):
        cfg = ServeConfig(model=str(smollm2_runtime.path), port=0,
                          **{"backend": backend, "max_context": 2048, **overrides})
        server = build_server(cfg, smollm2_runtime)
        binds = await nursery.start(serve, server)
        client = httpx.AsyncClient(base_url=binds[0], timeout=120)
        clients.append(client)
        return server, client

    yield make
    for c in clients:
        await c.aclose()


@pytest.fixture
def wait_sampled_idle():
    """``await wait(server, client) -> dict``: until the engine is idle, its last unit of work
    published, and the telemetry sampler has read that state (the prefill and decode seconds in
    ``/telemetry`` are the engine's own); from then on no sample is due but the heartbeat.
    Returns that ``/telemetry`` document; fails after 60 s."""
    async def wait(server, client) -> dict:
        with trio.move_on_after(60):
            while True:
                st = server.engine.stats
                busy = {a: s for a, s in st.worker_seconds if a in ("prefill", "decode")}
                t = (await client.get("/telemetry")).json()
                sampled = t["scheduler"].get("worker_seconds", {})
                if server.engine.idle() and st.running == st.waiting == 0 and \
                        all(sampled.get(a) == s for a, s in busy.items()):
                    return t
                await trio.sleep(0.02)
        raise AssertionError(f"the sampler never caught up with the idle engine: {st} "
                             f"{t['scheduler']}")

    return wait

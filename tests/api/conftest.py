"""Fixtures for API tests: the real SmolLM2 loaded once; a fresh engine + app per test."""
from __future__ import annotations

import httpx
import pytest

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

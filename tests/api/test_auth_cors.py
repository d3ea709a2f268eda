"""Serving contract §1.2 over real sockets: ``--api-key`` on every route but ``/health`` (Bearer
or ``x-api-key``; 401 ``invalid_api_key``, Anthropic-shaped on ``/v1/messages``), an
``x-request-id`` on every response, and ``--cors``."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
MSG = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}


async def test_api_key_request_ids_and_no_cors_by_default(server_factory):
    _, client = await server_factory(api_key="s3cret")
    r = await client.get("/health")
    assert r.status_code == 200                       # no key needed
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/messages", MSG)):
        for headers in ({}, {"Authorization": "Bearer nope"}, {"x-api-key": "s3cre"}):
            r = await client.post(path, json=body, headers=headers)
            assert r.status_code == 401, (path, headers)
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == (
                "authentication_error" if path == "/v1/messages" else "invalid_request_error")
        for headers in ({"Authorization": "Bearer s3cret"}, {"x-api-key": "s3cret"}):
            assert (await client.post(path, json=body, headers=headers)).status_code == 200
    for path in ("/v1/models", "/metrics", "/slots", "/telemetry"):
        assert (await client.get(path)).status_code == 401
        assert (await client.get(path, headers={"x-api-key": "s3cret"})).status_code == 200
    ids = set()
    for _ in range(3):
        r = await client.get("/health")
        ids.add(r.headers["x-request-id"])
        assert "access-control-allow-origin" not in r.headers
    r = await client.post("/v1/chat/completions", json=CHAT)   # errors carry one too
    ids.add(r.headers["x-request-id"])
    assert len(ids) == 4 and len({i.rsplit("-", 1)[0] for i in ids}) == 1   # one prefix


async def test_cors_preflight_and_headers(server_factory):
    _, client = await server_factory(api_key="k", cors=True)
    r = await client.options("/v1/messages", headers={
        "Origin": "http://x", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 204                       # unauthenticated preflight
    assert r.headers["access-control-allow-origin"] == "*"
    assert "X-API-Key" in r.headers["access-control-allow-headers"]
    asked = "x-stainless-lang, anthropic-dangerous-direct-browser-access, x-api-key"
    r = await client.options("/v1/messages", headers={
        "Origin": "http://x", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": asked})
    assert r.status_code == 204 and r.headers["access-control-allow-headers"] == asked
    r = await client.post("/v1/messages", json=MSG, headers={"x-api-key": "k"})
    assert r.headers["request-id"] == r.headers["x-request-id"]   # Anthropic SDKs read it
    r = await client.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": "k"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    assert "x-request-id" in r.headers["access-control-expose-headers"]
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"

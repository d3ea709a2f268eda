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
    for path in ("/v1/models", "/metrics", "/slots", "/telemetry", "/props"):
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


async def _error_codes(client) -> dict:
    """``ninfer:request_errors_total`` samples: code -> count."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for fam in text_string_to_metric_families((await client.get("/metrics")).text):
        for s in fam.samples:
            if s.name == "ninfer:request_errors_total":
                out[s.labels["code"]] = out.get(s.labels["code"], 0) + s.value
    return out


async def test_a_simple_cross_site_post_is_refused_before_it_runs(server_factory, tmp_path):
    """What a web page can send without a CORS preflight (a ``text/plain``, form-encoded or
    type-less body: ``fetch(url, {method: "POST", body})``, an HTML form) is refused with 415
    ``unsupported_media_type`` and never reaches the engine; JSON media types (with
    parameters, ``+json``) are served, and a POST without a body needs none."""
    import json
    server, client = await server_factory(slot_save_path=str(tmp_path / "slots"))
    body = json.dumps(CHAT).encode()
    for ctype in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x", None):
        headers = {"content-type": ctype} if ctype else {}
        r = await client.post("/v1/chat/completions", content=body, headers=headers)
        assert r.status_code == 415, (ctype, r.text)
        assert r.json()["error"]["code"] == "unsupported_media_type"
    r = await client.post("/v1/messages", content=json.dumps(MSG), headers={
        "content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["type"] == "error"   # Anthropic's envelope
    assert r.json()["error"]["code"] == "unsupported_media_type"
    m = (await client.get("/metrics")).text
    assert "llamacpp:tokens_predicted_total 0.0" in m            # nothing ran
    assert (await _error_codes(client))["unsupported_media_type"] == 6   # request.error each
    # a compressed body, or JSON in another charset, is named as such (it read as bad JSON)
    import gzip
    r = await client.post("/v1/chat/completions", content=gzip.compress(body), headers={
        "content-type": "application/json", "content-encoding": "gzip"})
    assert r.status_code == 415 and r.json()["error"]["code"] == \
        "unsupported_content_encoding" and "'gzip'" in r.json()["error"]["message"]
    r = await client.post("/v1/messages", content=json.dumps(MSG).encode("utf-16"), headers={
        "content-type": "application/json; charset=UTF-16"})
    assert r.status_code == 415 and r.json()["type"] == "error"
    assert r.json()["error"]["code"] == "unsupported_media_type"
    assert "charset=utf-16" in r.json()["error"]["message"]
    for ctype in ("application/json", "application/json; charset=utf-8",
                  'application/json; charset="UTF-8"', "Application/JSON",
                  "application/vnd.api+json"):
        r = await client.post("/v1/chat/completions", content=body,
                              headers={"content-type": ctype})
        assert r.status_code == 200, (ctype, r.text)
    # a body-less action (curl -X POST), and the dashboard's replay upload (NDJSON)
    assert (await client.post("/slots/0?action=erase")).status_code == 200
    r = await client.post("/dashboard/replay", content=b"not a log\n",
                          headers={"content-type": "application/x-ndjson"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_log"
    r = await client.post("/dashboard/replay", content=b"not a log\n",
                          headers={"content-type": "text/plain"})
    assert r.status_code == 415


async def test_a_rebinding_host_name_is_refused(server_factory):
    """DNS rebinding: a page of ``http://evil.example:PORT`` whose name now resolves to
    127.0.0.1 reaches the server with ``Host: evil.example:PORT``; that is 403
    ``host_not_allowed`` on every route (``/slots``, ``/events`` ...), while IP literals,
    ``localhost`` and ``--allowed-hosts`` names (``*``: any) are served."""
    server, client = await server_factory()
    for host in ("evil.example", "evil.example:8080", "localhost.evil.example", "127.0.0.1.nip"):
        for path in ("/slots", "/events", "/telemetry", "/health"):
            r = await client.get(path, headers={"host": host})
            assert r.status_code == 403, (host, path, r.text)
            assert r.json()["error"]["code"] == "host_not_allowed"
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"host": host})
        assert r.status_code == 403
    assert (await _error_codes(client))["host_not_allowed"] == 20
    for host in ("127.0.0.1", "127.0.0.1:8080", "localhost", "LocalHost:1", "[::1]",
                 "[::1]:8080", "10.1.2.3:80", "localhost."):
        assert (await client.get("/slots", headers={"host": host})).status_code == 200, host
    _, named = await server_factory(allowed_hosts="gpu-box, .svc.cluster.local")
    for host, status in (("gpu-box:8080", 200), ("ninfer.ns.svc.cluster.local", 200),
                         ("evil.example", 403), ("gpu-box.evil.example", 403)):
        assert (await named.get("/slots", headers={"host": host})).status_code == status, host
    _, anyhost = await server_factory(allowed_hosts="*")
    assert (await anyhost.get("/slots", headers={"host": "evil.example"})).status_code == 200


async def test_a_cross_origin_post_without_cors_is_refused(server_factory):
    """A browser names the page's origin on every POST: one that is not this server's (another
    port of localhost, an allowed host included) is 403 ``origin_not_allowed`` without ``--cors`` (so a body-less action
    such as ``/slots/0?action=erase`` cannot be triggered from another site); the dashboard's
    own origin, and clients that send none (SDKs, curl), are served."""
    _, client = await server_factory()
    r = await client.post("/v1/chat/completions", json=CHAT,
                          headers={"origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    for origin in ("null", "http://6.6.6.6", "http://evil.example:8080",
                   "http://localhost:3000"):
        r = await client.post("/slots/0?action=erase", headers={"origin": origin})
        assert r.status_code == 403, origin
    own = str(client.base_url).rstrip("/")
    r = await client.post("/v1/chat/completions", json=CHAT, headers={"origin": own})
    assert r.status_code == 200
    _, wide = await server_factory(allowed_hosts="*")
    r = await wide.post("/slots/0?action=erase", headers={"origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    _, cors = await server_factory(cors=True)
    r = await cors.post("/v1/chat/completions", json=CHAT,
                        headers={"origin": "http://evil.example"})
    assert r.status_code == 200

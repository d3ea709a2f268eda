"""What runs around every route (serving contract §1.2): an x-request-id on every response, the
browser guard (``origin``), the API key on every route but ``/health`` (and a CORS preflight),
JSON bodies only, permissive CORS with ``--cors``, and the ignored-fields header."""
from __future__ import annotations

import hmac
import itertools
import os
import secrets

from quart import Response, g, request

from . import fields, origin
from .errors import ApiError
from .http_errors import anthropic_route

CORS_HEADERS = {
    "Access-Control-Allow-Origin": "*",
    "Access-Control-Allow-Headers": "Authorization, Content-Type, OpenAI-Organization, "
                                    "OpenAI-Project, X-API-Key, Anthropic-Version, "
                                    "Anthropic-Beta, X-Stainless-*",
    "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
    "Access-Control-Expose-Headers": "x-request-id, request-id, Retry-After, " + fields.HEADER}


def install_middleware(app, cfg) -> None:
    """Register the request guards and the common response headers, in order."""
    request_ids = itertools.count(1)
    id_prefix = f"{os.getpid():x}-{secrets.token_hex(3)}-"

    @app.before_request
    async def _request_id():
        g.request_id = id_prefix + str(next(request_ids))   # before the handler: the log has it

    # what a web page in the user's browser may not do (ninfer/api/origin.py): reach us under
    # a name of its own (DNS rebinding), POST from another origin, or POST a body that needs no
    # CORS preflight (text/plain, a form, no type); before the key check, which stops neither
    # on a server without --api-key
    host_names = origin.local_names(cfg.host, cfg.allowed_host_names())

    @app.before_request
    async def _browser_guard():
        host = request.headers.get("Host", "")
        if not origin.host_allowed(host, host_names):
            raise ApiError(403, f"Host {host[:200]!r} is not a name of this server (a page "
                           "re-pointing its own name at it would send that): use its address, "
                           "or start the server with --allowed-hosts NAME", "host_not_allowed")
        page = request.headers.get("Origin")
        if page is not None and not cfg.cors and request.method not in ("GET", "HEAD",
                                                                        "OPTIONS") \
                and not origin.origin_allowed(page, host):
            raise ApiError(403, f"{request.method} from the web page origin {page[:200]!r} "
                           "refused: start the server with --cors to serve pages of other "
                           "origins", "origin_not_allowed")

    @app.before_request
    async def _auth():
        if cfg.cors and request.method == "OPTIONS":
            # allow whatever headers the client asks for (the SDKs send X-Stainless-*,
            # anthropic-dangerous-direct-browser-access, ...: a listed prefix is no wildcard)
            asked = request.headers.get("Access-Control-Request-Headers")
            return Response("", status=204, headers={
                **CORS_HEADERS, **({"Access-Control-Allow-Headers": asked} if asked else {})})
        if cfg.api_key is None or request.path == "/health":
            return None
        auth = request.headers.get("Authorization", "")
        given = auth[7:] if auth.startswith("Bearer ") else request.headers.get("x-api-key")
        if given is None or not hmac.compare_digest(given.encode(), cfg.api_key.encode()):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY or "
                           "x-api-key: KEY)", "invalid_api_key")
        return None

    @app.before_request
    async def _json_body():
        if request.method != "POST":
            return None
        replay = request.path == "/dashboard/replay"   # a JSONL log
        ctype = request.headers.get("Content-Type", "")
        coding = request.headers.get("Content-Encoding", "").strip().lower()
        if coding not in ("", "identity"):   # (a gzip body read as JSON: 'invalid start byte')
            raise ApiError(415, f"request bodies are read as sent: Content-Encoding "
                           f"{coding[:40]!r} is not decoded (send the JSON uncompressed)",
                           "unsupported_content_encoding")
        charset = origin.charset(ctype)
        if charset not in (None, "utf-8", "utf8"):
            raise ApiError(415, f"JSON request bodies are UTF-8 (RFC 8259); charset="
                           f"{charset[:40]} is not read", "unsupported_media_type")
        if origin.json_media_type(ctype, origin.NDJSON_TYPES if replay else ()):
            return None
        if request.content_length == 0 or (request.content_length is None
                                            and not await request.get_data()):
            return None   # a body-less action (curl -X POST '.../slots/0?action=erase')
        want = "application/x-ndjson" if replay else "application/json"
        raise ApiError(415, f"the request body must be sent as Content-Type: {want} (got "
                       f"{ctype[:100] or 'none'!r}; curl: -H 'content-type: {want}')",
                       "unsupported_media_type")

    @app.after_request
    async def _common_headers(response):
        rid = g.get("request_id") or id_prefix + str(next(request_ids))
        response.headers["x-request-id"] = rid
        if anthropic_route():
            response.headers["request-id"] = rid   # (the header Anthropic's SDKs read)
        if g.get("ignored_fields"):   # the fields the request was served without (fields.py)
            response.headers[fields.HEADER] = fields.header_value(g.ignored_fields)
        if cfg.cors:
            for k, v in CORS_HEADERS.items():
                response.headers.setdefault(k, v)
        return response

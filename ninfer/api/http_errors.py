"""Error responses: every error leaves as Anthropic's envelope on ``/v1/messages*`` and
OpenAI's elsewhere, with a ``request.error`` record unless an engine record already explains it
(so the x-request-id a client got finds its error in the log). A client mistake is never a 500.
"""
from __future__ import annotations

from quart import g, request

from .errors import ApiError, error_record, internal_error

RETRY_AFTER_S = 1   # every retryable 429 / 503 says when to try again (contract §1.2)


def anthropic_route() -> bool:
    """Whether the current request is on Anthropic's routes (its envelope and headers)."""
    return request.path.startswith("/v1/messages")


def install_error_handlers(app, state) -> None:
    """Render ``ApiError``s, HTTP errors of the framework and uncaught exceptions."""

    def render(err: ApiError, headers: dict | None = None):
        if not err.logged:
            state.bus.emit(error_record(err, g.get("request_id", ""), request.method,
                                        request.path))
        body = err.anthropic_body() if anthropic_route() else err.body()
        out = {**(err.headers or {}), **(headers or {})}
        # an engine that stopped for good (service_unavailable: restart the server) is no
        # "try again later"
        if err.status in (429, 503) and err.code != "service_unavailable":
            out.setdefault("Retry-After", str(RETRY_AFTER_S))
        return body, err.status, out

    @app.errorhandler(ApiError)
    async def _api_error(err: ApiError):
        return render(err)

    @app.errorhandler(413)
    async def _too_large(_err):
        return render(ApiError(413, "request body too large", "request_too_large"))

    @app.errorhandler(404)
    async def _not_found(_err):
        return render(ApiError(404, f"no route {request.method} {request.path}", "not_found"))

    @app.errorhandler(405)
    async def _bad_method(err):
        allow = ", ".join(sorted(getattr(err, "valid_methods", None) or []))
        return render(ApiError(405, f"method {request.method} not allowed on {request.path}",
                               "method_not_allowed"), {"Allow": allow} if allow else None)

    @app.errorhandler(408)
    async def _body_timeout(_err):
        return render(ApiError(408, "the request body did not arrive in time",
                               "request_timeout"))

    @app.errorhandler(Exception)
    async def _internal(err: Exception):
        app.logger.exception("internal error", exc_info=err)
        return render(internal_error())

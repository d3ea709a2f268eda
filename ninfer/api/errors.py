"""The error envelope: one exception type carrying a stable code, rendered OpenAI-shaped.

``{"error": {"message", "type", "param", "code"}}`` with ``param`` / ``code`` null when empty.
A 500 is always rendered as a generic ``internal_error`` body (the cause goes to the log).
"""
from __future__ import annotations

from dataclasses import dataclass

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          403: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 408: "invalid_request_error",
          409: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 429: "rate_limit_error",
          499: "request_cancelled", 501: "not_supported_error"}

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                    408: "timeout_error", 413: "request_too_large",
                    415: "invalid_request_error", 429: "rate_limit_error",
                    500: "api_error", 503: "overloaded_error", 504: "timeout_error"}


@dataclass
class ApiError(Exception):
    """A client-visible error. ``status``: HTTP status; ``code``: stable machine code."""
    status: int
    message: str
    code: str | None = None
    param: str | None = None
    extra: dict | None = None
    headers: dict | None = None
    # an engine record (request.failed / request.rejected) already says why: the renderer
    # logs no request.error for it
    logged: bool = False

    def __str__(self) -> str:
        return self.message

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error")

    def body(self) -> dict:
        err = {"message": self.message, "type": self.type, "param": self.param,
               "code": self.code}
        if self.extra:
            err.update(self.extra)
        return {"error": err}

    def anthropic_body(self) -> dict:
        """The error in Anthropic's envelope (``/v1/messages*``, serving contract §1.3):
        ``{"type": "error", "error": {"type", "message"}}``, plus our stable ``code`` /
        ``param`` when set."""
        err = {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"), "message": self.message}
        if self.code:
            err["code"] = self.code
        if self.param:
            err["param"] = self.param
        return {"type": "error", "error": err}


def model_not_found(requested: str, served: str) -> ApiError:
    """404 ``model_not_found`` (param ``model``) for a model id this server does not serve."""
    return ApiError(404, f"model '{requested}' not found; this server serves '{served}'",
                    "model_not_found", "model")


def error_record(err: ApiError, http_request_id: str, method: str, path: str):
    """The ``request.error`` record of ``err``, answered to ``method path`` under
    ``http_request_id`` (strings cut to a bounded size; the codec escapes what UTF-8 cannot
    hold)."""
    from ..events.schema import RequestError
    return RequestError(http_request_id=http_request_id, method=method, path=path[:200],
                        status=err.status, code=err.code or "",
                        param=(err.param or "")[:200], message=err.message[:500])


def internal_error() -> ApiError:
    return ApiError(500, "Internal server error.", "internal_error")

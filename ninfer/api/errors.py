"""The error envelope: one exception type carrying a stable code, rendered OpenAI-shaped.

``{"error": {"message", "type", "param", "code"}}`` with ``param`` / ``code`` null when empty.
A 500 is always rendered as a generic ``internal_error`` body (the cause goes to the log).
"""
from __future__ import annotations

from dataclasses import dataclass

_TYPES = {400: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 408: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 499: "request_cancelled"}


@dataclass
class ApiError(Exception):
    """A client-visible error. ``status``: HTTP status; ``code``: stable machine code."""
    status: int
    message: str
    code: str | None = None
    param: str | None = None
    extra: dict | None = None
    headers: dict | None = None

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


def internal_error() -> ApiError:
    return ApiError(500, "Internal server error.", "internal_error")

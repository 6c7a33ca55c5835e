"""Errors as OpenAI's API shapes them: `{"error": {"message", "type", "code"}}` with an HTTP status.

Every mistake a client can make becomes an ApiError; the app answers it as JSON and logs nothing
more than the request's log line (no traceback).
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


class ApiError(Exception):
    """A request the server answers with an error body instead of a completion."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 type: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.type = type
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, code: str = "invalid_value", param: str | None = None) -> ApiError:
    return ApiError(400, message, code, param=param)


def context_length_exceeded(message: str) -> ApiError:
    return ApiError(400, message, "context_length_exceeded", param="messages")


def queue_full(retry_after_s: int) -> ApiError:
    return ApiError(429, "The server's request queue is full; retry after a moment.", "rate_limit_exceeded",
                    type="rate_limit_error", headers={"Retry-After": str(retry_after_s)})


def shutting_down() -> ApiError:
    return ApiError(503, "The server is shutting down and takes no new requests.", "server_shutting_down",
                    type="server_error")


def server_error() -> ApiError:
    return ApiError(500, "The server failed while running this request; see the server's log.", "server_error",
                    type="server_error")


def renamed(error: ApiError, names: dict[str, str]) -> ApiError:
    """A request error in another API's field names: each quoted name (and the param) replaced."""
    message = error.message
    for old, new in names.items():
        message = message.replace(f"'{old}'", f"'{new}'")
    param = names.get(error.param or "", error.param)
    return ApiError(error.status, message, error.code, error.type, param, error.headers)

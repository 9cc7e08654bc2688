"""Errors in the OpenAI format: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def model_not_found(name: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{name}` does not exist.", "model", code="model_not_found")


def server_error(message: str) -> OpenAIError:
    return OpenAIError(500, message, type="server_error", code="internal_error")


def unauthorized() -> OpenAIError:
    return OpenAIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def payload_too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"The request body is larger than this server's limit of {limit} bytes.",
                       code="request_too_large")


def unsupported_media_type(content_type: str | None) -> OpenAIError:
    return OpenAIError(415, f"Content-Type must be application/json, not {content_type or 'none'}.",
                       code="unsupported_media_type")


def overloaded(retry_after_s: int) -> OpenAIError:
    return OpenAIError(429, "The server is at capacity; retry later.", type="rate_limit_error",
                       code="server_overloaded", headers={"Retry-After": str(retry_after_s)})


def deadline_exceeded(timeout_s: float) -> OpenAIError:
    return OpenAIError(504, f"The request did not finish within this server's limit of {timeout_s:g} s.",
                       type="server_error", code="timeout")


def unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, type="server_error", code="service_unavailable")


def loading(pool: str, retry_after_s: int) -> OpenAIError:
    """A pool this request needs has no replica answering yet (its model is loading)."""
    return OpenAIError(503, f"The {pool} pool is still loading its model; retry after {retry_after_s} s.",
                       type="server_error", code="service_unavailable", headers={"Retry-After": str(retry_after_s)})

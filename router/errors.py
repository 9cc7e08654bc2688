"""Errors in the OpenAI format: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def model_not_found(name: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{name}` does not exist.", "model", code="model_not_found")


def server_error(message: str) -> OpenAIError:
    return OpenAIError(500, message, type="server_error", code="internal_error")

"""OpenAI's error JSON and the one exception type the handlers raise.

Every error a client can cause answers ``{"error": {"message", "type", "param", "code"}}``
with a 4xx status (llama-server and vLLM answer in the same shape), so the official client
raises ``BadRequestError`` / ``AuthenticationError`` etc. with our message. ``param`` names
the request field at fault (``messages[1].role``), or is null.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

# status -> OpenAI error type
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "unavailable_error",
}


class APIError(Exception):
    """An error answered to the client.

    Args:
      status: HTTP status.
      message: one line saying what is wrong (and, for a field, what would be right).
      param: the request field at fault, or None.
      code: a short machine-readable code (``context_length_exceeded``), or None.
      headers: extra response headers (``Retry-After`` on a full queue).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code if code is not None else status}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, retry_after: int = 1) -> APIError:
    return APIError(503, message, code="unavailable", headers={"Retry-After": str(retry_after)})

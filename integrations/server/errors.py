"""OpenAI-style errors: every failure answers ``{"error": {"message", "type", "param", "code"}}``.

``ApiError`` is raised anywhere in a handler; ``install_error_handlers`` turns it, Starlette's own
HTTP errors (404, 405) and anything unexpected (500, logged, no traceback to the client) into that body.
"""
from __future__ import annotations

import json
import logging

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("hf_paged.server")
RETRY_AFTER_S = 1
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 499: "invalid_request_error",
               503: "service_unavailable", 500: "internal_server_error"}
# ``code`` is always a string, as OpenAI's (vLLM puts the status there); a status without a named one:
STATUS_CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                413: "body_too_large", 499: "client_closed", 500: "internal_error", 503: "unavailable"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code or STATUS_CODES.get(status, "error")}}


def error_response(status: int, message: str, param: str | None = None, code=None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


class ApiError(Exception):
    """An error answer: HTTP ``status``, a message naming the value and the limit, the request field
    (``param``) and a machine-readable ``code``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    @classmethod
    def unavailable(cls, exc: Exception, code: str) -> ApiError:
        """503 with Retry-After: the queue is full or the server is stopping."""
        return cls(503, str(exc), code=code, headers={"Retry-After": str(RETRY_AFTER_S)})

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.headers)


def as_api_error(exc: BaseException, where: str = "while streaming") -> ApiError:
    """``exc`` itself when it is an ApiError, else a 500 that says nothing of it (the error logged)."""
    if isinstance(exc, ApiError):
        return exc
    log.error("internal error %s", where, exc_info=exc)
    return ApiError(500, "internal server error")


def sse_error(exc: BaseException) -> str:
    """The server-sent event that ends a stream failing half-way (the status line went out already)."""
    return f"data: {json.dumps(as_api_error(exc).body())}\n\n"


async def _api_error(request, exc: ApiError):
    return exc.response()


async def _http_error(request, exc: StarletteHTTPException):
    if exc.status_code == 404:        # no such route: say which there are
        return error_response(404, f"no route {request.method} {request.url.path}: this server answers POST "
                                   "/v1/completions, /v1/chat/completions, /v1/responses, /v1/messages (Anthropic's), "
                                   "/invocations, GET /v1/models, /health, /metrics, /version, POST /tokenize and "
                                   "/detokenize (text generation only: no embeddings)")
    return error_response(exc.status_code, str(exc.detail))


async def _internal(request, exc: Exception):
    log.error("internal error on %s", request.url.path, exc_info=exc)
    return error_response(500, "internal server error")


def install_error_handlers(app) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)

"""The API key check, as pure ASGI middleware (it also guards streamed responses and /metrics)."""
from __future__ import annotations

import hmac

from .errors import error_response

OPEN_PATHS = ("/health", "/ping")


class ApiKeyMiddleware:
    """Every path but /health and /ping needs ``Authorization: Bearer <key>`` or, as Anthropic's clients send it,
    ``x-api-key: <key>`` (constant-time compare); else 401."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    def _authorized(self, scope) -> bool:
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return True
        key = headers.get(b"x-api-key")
        return key is not None and hmac.compare_digest(key.strip(), self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path") not in OPEN_PATHS and not self._authorized(scope):
            response = error_response(401, "invalid or missing API key (Authorization: Bearer ... or x-api-key: ...)",
                                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

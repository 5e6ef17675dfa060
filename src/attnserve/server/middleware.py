"""ASGI middlewares that answer before the body is parsed: API key and body size.

`ApiKeyMiddleware` is middleware rather than a FastAPI dependency so that a request with a
wrong key gets 401 even when its body is also malformed (dependencies run after body
parsing). ``/health`` and ``/metrics`` stay open for probes and scrapers; every other route
(``/v1/...``, ``/debug/...``) needs ``Authorization: Bearer <key>`` when a key is set.

`DeclaredBodyLimitMiddleware` answers 413 with an OpenAI error body to a request whose
``Content-Length`` is over the limit. Bodies without a declared length are limited by
FastAPI's own ``max_body_size`` (set to the same value by `create_app`) as they stream in.
"""

from __future__ import annotations

import secrets
from typing import Optional

OPEN_PATHS = ("/health", "/metrics")


class ApiKeyMiddleware:
    """Answer 401 with an OpenAI error body unless the request carries ``api_key``.

    Args:
        app: the wrapped ASGI app.
        api_key: the expected key; None disables the check.
    """

    def __init__(self, app, api_key: Optional[str]):
        self.app = app
        self.api_key = api_key

    def _authorised(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and secrets.compare_digest(
                    token.strip().encode("utf-8"), self.api_key.encode("utf-8"))
        return False

    async def __call__(self, scope, receive, send):
        if (
            self.api_key is None
            or scope["type"] != "http"
            or scope.get("path", "") in OPEN_PATHS
            or scope.get("method") == "OPTIONS"
            or self._authorised(scope)
        ):
            await self.app(scope, receive, send)
            return
        from attnserve.server.errors import APIError, error_response

        response = error_response(APIError(401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                                           None, "invalid_api_key"))
        await response(scope, receive, send)


class DeclaredBodyLimitMiddleware:
    """413 for ``Content-Length`` above ``max_body_bytes``, before the app sees the request.

    The body is read and discarded up to ``drain_limit_bytes`` first, so that a client that
    sends its whole body before reading the answer (most HTTP clients) receives the 413
    instead of a connection reset; beyond that the connection is simply closed after the
    answer.

    Args:
        app: the wrapped ASGI app.
        max_body_bytes: largest accepted body.
        drain_limit_bytes: most bytes read and discarded from a rejected body.
    """

    def __init__(self, app, max_body_bytes: int, drain_limit_bytes: int = 64 * 1024 * 1024):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.drain_limit_bytes = drain_limit_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
        if declared is None or declared <= self.max_body_bytes:
            await self.app(scope, receive, send)
            return
        if declared <= self.drain_limit_bytes:
            while True:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    break
        from attnserve.server.errors import APIError, error_response

        response = error_response(APIError(
            413, f"the request body has {declared} bytes; the limit is {self.max_body_bytes}", None,
            "request_too_large"))
        await response(scope, receive, send)

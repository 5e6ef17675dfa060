"""ASGI middlewares that answer before the body is parsed: API key, body size, media type;
and one that closes the connection after any server error.

`ApiKeyMiddleware` is middleware rather than a FastAPI dependency so that a request with a
wrong key gets 401 even when its body is also malformed (dependencies run after body
parsing). ``/health``, ``/health_generate`` and ``/metrics`` stay open for probes and
scrapers (as SGLang leaves its ``/health*`` routes open); every other route (``/v1/...``,
``/generate``, ``/tokenize``, ``/debug/...``) needs ``Authorization: Bearer <key>`` when a key is set.

`DeclaredBodyLimitMiddleware` answers 413 with an OpenAI error body to a request whose
``Content-Length`` is over the limit. Bodies without a declared length are limited by
FastAPI's own ``max_body_size`` (set to the same value by `create_app`) as they stream in.
"""

from __future__ import annotations

import secrets
from typing import Optional

OPEN_PATHS = ("/health", "/health_generate", "/metrics")


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


#: Routes outside ``/v1/`` whose POST body is JSON (`attnserve.server.native_api`).
JSON_BODY_PATHS = ("/generate", "/tokenize", "/detokenize")


class JsonContentTypeMiddleware:
    """415 with an OpenAI error body for a ``POST /v1/...`` or a POST to one of
    `JSON_BODY_PATHS` whose ``Content-Type`` is set to anything but JSON
    (``application/json``, optionally with parameters, or another ``+json`` type). A
    request without the header is read as JSON, as clients that omit it expect
    (`attnserve.server.launch.create_app` turns FastAPI's ``strict_content_type`` off).
    ``POST /flush_cache`` takes no body, so its ``Content-Type`` is not checked.

    Args:
        app: the wrapped ASGI app.
    """

    def __init__(self, app):
        self.app = app

    @staticmethod
    def _is_json(value: bytes) -> bool:
        media = value.decode("latin-1").split(";", 1)[0].strip().lower()
        return media == "application/json" or media.endswith("+json")

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if scope.get("method") == "POST" and (path.startswith("/v1/") or path in JSON_BODY_PATHS):
            for name, value in scope.get("headers", ()):
                if name == b"content-type" and not self._is_json(value):
                    from attnserve.server.errors import APIError, error_response

                    media = value.decode("latin-1").split(";", 1)[0].strip()
                    response = error_response(APIError(
                        415, f"the request body must be JSON (Content-Type: application/json), got {media!r}",
                        None, "unsupported_media_type"))
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


class CloseOnServerErrorMiddleware:
    """Adds ``Connection: close`` to every 5xx response, so a keep-alive connection is never
    reused after the server failed in an unknown state (uvicorn closes it after the body).

    Args:
        app: the wrapped ASGI app.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_wrapper(message):
            if message["type"] == "http.response.start" and message.get("status", 200) >= 500:
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": headers + [(b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send_wrapper)

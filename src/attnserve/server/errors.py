"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` for every 4xx/5xx.

Status codes:

* 400 ``invalid_request_error``: malformed JSON, non-UTF-8 bodies, text that is not valid
  Unicode (a lone surrogate; code ``invalid_value``), wrong types, values out of range,
  a field attnserve does not implement set to a non-neutral value (code
  ``unsupported_parameter``), a field no API defines (code
  ``unrecognized_request_argument``; both name the field in ``param``, see
  `attnserve.server.request_fields`), prompt + ``max_tokens`` beyond what one request can
  hold (code ``context_length_exceeded``, ``param`` ``prompt``/``messages`` or ``max_tokens``).
  Schema errors are 400 (as OpenAI answers), not FastAPI's default 422.
* 401 ``authentication_error``: missing or wrong ``Authorization: Bearer`` key.
* 404 ``not_found_error``: unknown route or model.
* 405 / 413 (``request_too_large``, the body is over the server's limit) / 415
  (``unsupported_media_type``, a ``Content-Type`` other than JSON).
* 503: ``server_overloaded`` / ``queue_full`` (the waiting queue is full,
  ``--max-queued-requests``); ``server_error`` / ``shutting_down`` (draining after SIGTERM)
  or ``engine_dead`` (the engine loop thread died).
* 500 ``server_error``: a bug; the request fails, the server keeps running.

Every 5xx carries ``Connection: close`` (`attnserve.server.middleware.CloseOnServerErrorMiddleware`).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
          415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          503: "server_overloaded"}


class APIError(Exception):
    """An error answered to the client (raise it from a handler).

    Args:
        status: HTTP status.
        message: what is wrong and, where possible, how to fix it.
        param: the offending request field (e.g. ``"max_tokens"``), or None.
        code: machine-readable code (``"context_length_exceeded"``, ``"queue_full"`` ...).
        type: OpenAI error type; derived from ``status`` when None.
    """

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
               type: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type or _TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def error_response(err: APIError):
    from fastapi.responses import JSONResponse

    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(error_body(err.status, err.message, err.param, err.code, err.type), status_code=err.status,
                        headers=headers)


_SCALAR_TAGS = {"str", "int", "float", "bool", "bytes", "none"}


def _loc_to_param(loc: Any) -> Optional[str]:
    """``("body", "messages", 0, "role")`` -> ``"messages.0.role"``; pydantic's union-member
    tags (``str``, ``list[int]``, ``TextContentPart`` ...) end the path."""
    parts = []
    for p in loc:
        if p == "body" and not parts:
            continue
        if isinstance(p, str) and (p in _SCALAR_TAGS or "[" in p or p[:1].isupper() or "-" in p):
            break
        parts.append(str(p))
    return ".".join(parts) or None


def _validation_message(errors) -> str:
    """One line: ``field: problem`` per field (alternatives of a union joined by "or")."""
    by_param: dict = {}
    for e in errors:
        by_param.setdefault(_loc_to_param(e.get("loc", ())) or "body", [])
        msgs = by_param[_loc_to_param(e.get("loc", ())) or "body"]
        if e.get("msg") not in msgs:
            msgs.append(e.get("msg"))
    return "; ".join(f"{p}: {' or '.join(m)}" for p, m in list(by_param.items())[:5])


def install_error_handlers(app) -> None:
    """Route every error of ``app`` to the OpenAI error body."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = _loc_to_param(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            ctx = first.get("ctx") or {}
            msg = f"the request body is not valid JSON ({ctx.get('error', 'decode error')})"
            return error_response(APIError(400, msg, None, "invalid_json"))
        if param is None and first.get("type") in ("model_attributes_type", "dict_type"):
            return error_response(APIError(400, "the request body must be a JSON object", None, "invalid_json"))
        msg = _validation_message(errors)
        return error_response(APIError(400, msg, param, "invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        status = exc.status_code
        if status == 400:
            msg, code = "the request body could not be parsed (it must be UTF-8 JSON)", "invalid_json"
        elif status == 413:
            msg, code = "the request body is too large", "request_too_large"
        elif status == 404:
            msg, code = f"no route {request.url.path}", "not_found"
        else:
            msg, code = str(exc.detail), None
        return error_response(APIError(status, msg, None, code))

    @app.exception_handler(Exception)
    async def _unhandled(request, exc: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}", None, "internal_error",
                                       "server_error"))

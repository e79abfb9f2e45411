"""One error hierarchy, mapped to HTTP in one place.

Every error the service raises on purpose is a ``ServiceError`` carrying its HTTP status and a
stable ``code``; the handler renders ``{"error": {"code", "message"}}``. Messages name the
field, the expected and the actual value, and never echo the request body. Anything else is a
bug: it is logged with its traceback and answered with a generic 500.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

logger = logging.getLogger("lmhead")


class ServiceError(Exception):
    """Base class: ``status`` and ``code`` say how the HTTP layer answers."""

    status = 500
    code = "internal_error"

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class MalformedBody(ServiceError):
    """400: the body cannot be parsed at all (bad JSON, bad .npy)."""

    status = 400
    code = "malformed_body"


class InvalidInput(ServiceError):
    """422: the body parses but a value is wrong (shape, dtype, range, NaN)."""

    status = 422
    code = "invalid_input"


class ModelNotFound(ServiceError):
    """404: no model of that name in the repository."""

    status = 404
    code = "model_not_found"


class VersionNotFound(ServiceError):
    """404: the model exists but not that version."""

    status = 404
    code = "version_not_found"


class PayloadTooLarge(ServiceError):
    """413: the body, the rows or the answer exceed a configured limit."""

    status = 413
    code = "payload_too_large"


class UnsupportedMediaType(ServiceError):
    """415: a Content-Type this endpoint does not read."""

    status = 415
    code = "unsupported_media_type"


class NotAcceptable(ServiceError):
    """406: an Accept header this endpoint cannot answer in."""

    status = 406
    code = "not_acceptable"


class ModelNotReady(ServiceError):
    """503: the model is loading or failed to load."""

    status = 503
    code = "model_not_ready"


class QueueFull(ServiceError):
    """503 with Retry-After: the model's batch queue is full; try again shortly."""

    status = 503
    code = "queue_full"


class ServerBusy(ServiceError):
    """503 with Retry-After: the requests in flight hold the memory budget; try again shortly."""

    status = 503
    code = "server_busy"


class InferenceFailed(ServiceError):
    """500: onnxruntime failed on a batch; every caller in it gets this, the service goes on."""

    status = 500
    code = "inference_failed"


def error_body(code: str, message: str) -> bytes:
    return orjson.dumps({"error": {"code": code, "message": message}})


def _json(
    request: Request, status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> Response:
    """Native paths: ``{"error": {"code", "message"}}``. V2 paths speak the Open Inference
    Protocol's ``{"error": "message"}``, with 400 for every bad request (422 is native only)."""
    if request.url.path.startswith("/v2"):
        body = orjson.dumps({"error": message})
        return Response(body, 400 if status == 422 else status, headers, "application/json")
    return Response(error_body(code, message), status, headers, "application/json")


def error_response(request: Request, error: Exception) -> Response:
    """The one mapping from an exception raised while serving a request to its answer."""
    if isinstance(error, ServiceError):
        return _json(request, error.status, error.code, error.message, error.headers)
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=error)
    return _json(request, 500, "internal_error", "internal error; the server log has the details")


def install_error_handlers(app: FastAPI) -> None:
    """Register the mapping with FastAPI (the inference fast path calls it directly)."""

    async def service_error(request: Request, error: Exception) -> Response:
        return error_response(request, error)

    async def validation_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, RequestValidationError)
        message = describe_validation_errors(error.errors())
        return _json(request, 422, InvalidInput.code, message)

    async def http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
        headers = dict(error.headers or {})
        return _json(request, error.status_code, code, str(error.detail), headers)

    async def unexpected(request: Request, error: Exception) -> Response:
        return error_response(request, error)

    app.add_exception_handler(ServiceError, service_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


def describe_validation_errors(errors: Any) -> str:
    """pydantic errors as ``field: message`` lines, without the offending input values."""
    parts = []
    for error in errors:
        # Field names can come from the client (unknown keys): name them, but never at length.
        location = ".".join(str(part)[:64] for part in error.get("loc", ()) if part != "body")
        parts.append(f"{location or 'body'}: {error.get('msg', 'invalid')}")
    return "; ".join(parts)


class InvalidModelName(ServiceError):
    """400: a model name that could address something outside the repository."""

    status = 400
    code = "invalid_model_name"


class Unauthorized(ServiceError):
    """401: the repository API needs ``Authorization: Bearer <LMHEAD_ADMIN_TOKEN>``."""

    status = 401
    code = "unauthorized"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class Forbidden(ServiceError):
    """403: the repository API is off (read-only service, or control_mode none)."""

    status = 403
    code = "forbidden"


class ModelLoadFailed(ServiceError):
    """500, on the load endpoint only: the new version failed; the old one keeps serving."""

    status = 500
    code = "model_load_failed"

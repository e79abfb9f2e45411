"""The one mapping from exceptions to HTTP answers (``service.errors`` holds the hierarchy).

Native paths answer ``{"error": {"code", "message"}}``; V2 paths the Open Inference Protocol's
``{"error": "message"}``. Anything that is not a ``ServiceError`` is a bug: logged with its
traceback and answered with a generic 500.
"""

from __future__ import annotations

import logging

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from service.errors import InvalidInput, ServiceError, describe_validation_errors

logger = logging.getLogger("lmhead")
#: Codes of the web framework's own errors: a path the service does not have, a method its
#: path does not take; any other status of theirs is ``HTTP_ERROR`` (docs/errors.md has all).
HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}
HTTP_ERROR = "http_error"


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
        code = HTTP_CODES.get(error.status_code, HTTP_ERROR)
        headers = dict(error.headers or {})
        return _json(request, error.status_code, code, str(error.detail), headers)

    async def unexpected(request: Request, error: Exception) -> Response:
        return error_response(request, error)

    app.add_exception_handler(ServiceError, service_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)

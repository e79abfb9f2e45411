"""One error hierarchy, for the service and its client alike (the standard library only).

Every error the service raises on purpose is a ``ServiceError`` carrying its HTTP status and a
stable ``code``; ``service.api.routes.error_handlers`` renders it as
``{"error": {"code", "message"}}`` (in one place), and ``service.client`` raises the class of
the code it reads back (``by_code``).
Messages name the field, the expected and the actual value, and never echo the request body.
"""

from __future__ import annotations

from typing import Any


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


class LogitsOverflow(InvalidInput):
    """422: finite hidden states whose logits pass float32's range (Inf logits, then NaN
    log-probs, shown as JSON null); a group of calls that meets one runs each call alone."""


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


#: Client-given names an error message lists at most (each cut to ``NAME_CHARS``).
LISTED_NAMES = 5
NAME_CHARS = 64
SHOWN_CHARS = 24  # a value shown back in a validation error: a number or a word


def few(names: list[Any]) -> str:
    """Names the client sent (unknown keys), listed briefly: never the payload back."""
    listed = ", ".join(repr(str(name)[:NAME_CHARS]) for name in names[:LISTED_NAMES])
    more = len(names) - LISTED_NAMES
    return listed + (f" and {more} more" if more > 0 else "")


def describe_validation_errors(errors: Any, whole: str = "body") -> str:
    """pydantic errors as ``field: message`` lines, without the offending input values; at
    most ``LISTED_NAMES`` of them (each error's location can be a client's key). An error of
    the whole object is named ``whole`` (nothing when empty)."""
    parts = []
    for error in errors[:LISTED_NAMES]:
        location = ".".join(str(p)[:NAME_CHARS] for p in error.get("loc", ()) if p != "body")
        where = location or whole
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        message += _what_came(error.get("input"))
        parts.append(f"{where}: {message}" if where else message)
    more = len(errors) - LISTED_NAMES
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def _what_came(value: Any) -> str:
    """ ", got ..." for a number or a short word (what a client needs to see its slip);
    nothing for anything longer, which could be a client's payload."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        shown = str(value)  # not 1.8446744073709552e+19 for a seed of 2**64 sent as digits
        plain = len(shown) <= SHOWN_CHARS and "e" not in shown.lower()
        return f", got {shown}" if plain else ""
    if isinstance(value, str) and len(value) <= SHOWN_CHARS and value.isprintable():
        return f", got {value!r}"
    return ""


class HostNotAllowed(ServiceError):
    """400: the request's ``Host`` is not a name this service answers to
    (``LMHEAD_ALLOWED_HOSTS``): a web page whose name was made to resolve to this machine."""

    status = 400
    code = "host_not_allowed"


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
    """400, on the load endpoint only: the model on disk could not be loaded (the reason says
    why); the old version keeps serving. Triton answers a failed load with 400 too."""

    status = 400
    code = "model_load_failed"


def by_code(code: str) -> type[ServiceError]:
    """The class of a service error code (``ServiceError`` for a code this version lacks)."""
    return _CODES.get(code, ServiceError)


def _subclasses(base: type[ServiceError]) -> list[type[ServiceError]]:
    return [c for sub in base.__subclasses__() for c in (sub, *_subclasses(sub))]


_CODES: dict[str, type[ServiceError]] = {}
for _error in _subclasses(ServiceError):  # a code's first class: InvalidInput, not a subclass
    _CODES.setdefault(_error.code, _error)

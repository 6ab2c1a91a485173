"""The one error type of the API, and the handlers that render every error as ``{"error": ...}``."""

from __future__ import annotations

import logging

from quart import Quart
from quart_schema import RequestSchemaValidationError
from werkzeug.exceptions import HTTPException

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error the client sees as ``{"error": message}`` with ``status``. Raise it anywhere. ``details`` adds
    fields next to ``error`` (e.g. the steps a device operation got through)."""

    status = 400

    def __init__(self, message: str, status: int | None = None, details: dict | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or {}
        if status is not None:
            self.status = status


class NotFound(APIError):
    status = 404


class Unauthorized(APIError):
    status = 401


class Forbidden(APIError):
    status = 403


class CsrRejected(APIError):
    """A CSR (or certificate request) that a PKI refused: malformed, bad signature, policy."""

    status = 400


class UpstreamUnavailable(APIError):
    """A remote PKI, CDP or device that could not be reached or answered nonsense."""

    status = 502


class DeviceFailure(UpstreamUnavailable):
    """A device operation that failed, or that certlm refused for the device's sake. ``device_status`` names the
    device protocol's status (OPC UA ``BadUserAccessDenied``), which every failed step reports."""

    def __init__(self, message: str, device_status: str) -> None:
        super().__init__(message)
        self.device_status = device_status


class UnsupportedOperation(APIError):
    """The driver or backend of an entry does not offer this operation."""

    status = 501


def describe_validation_error(error: Exception) -> str:
    """One line naming each offending field, from a pydantic ValidationError or anything else."""
    errors = getattr(error, "errors", None)
    if not callable(errors):
        return str(error) or "invalid request body"
    parts = []
    for item in errors():
        message = item.get("msg", "invalid").removeprefix("Value error, ")
        field = ".".join(str(p) for p in item.get("loc", ()) if p != "__root__")
        # A model-level rule (e.g. "at least one field") names its fields in its own message.
        parts.append(f"{field}: {message}" if field else message)
    return "; ".join(parts) or "invalid request body"


def register_error_handlers(app: Quart) -> None:
    @app.errorhandler(APIError)
    async def api_error(error: APIError):
        return {"error": error.message, **error.details}, error.status

    @app.errorhandler(RequestSchemaValidationError)
    async def schema_error(error: RequestSchemaValidationError):
        cause = error.validation_error
        if isinstance(cause, TypeError | ValueError) and not hasattr(cause, "errors"):
            # quart-schema raises a bare TypeError/ValueError when the body is not JSON at all.
            return {"error": "request body must be a JSON object"}, 400
        return {"error": describe_validation_error(cause)}, 400

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException):
        messages = {
            400: "malformed request body: expected JSON",
            404: "not found",
            405: "method not allowed",
            413: "request body too large",
            415: "unsupported content type: send application/json",
        }
        message = messages.get(error.code or 500, error.description or error.name)
        return {"error": message}, error.code or 500

    @app.errorhandler(Exception)
    async def unexpected_error(error: Exception):
        log.exception("unhandled error")
        return {"error": f"internal error: {type(error).__name__}"}, 500

"""One exception hierarchy for everything the gateway refuses or fails at.

Each error knows its HTTP status and OpenAI error ``type``; `app.py` turns any of them into an error body in
one place (`error_response`), so no handler builds error JSON by hand. What is not ours yet -- aiohttp's own
refusals, a bug -- becomes one here (`http_error`, `unexpected_error`), for the gateway's and the admin API's
middleware alike. The body is OpenAI's shape, except on Anthropic's Messages API (`/v1/messages...`), whose SDKs
read Anthropic's: `ErrorShape.for_path` decides.
"""

from __future__ import annotations

import logging
from enum import Enum
from typing import Any

from aiohttp import web

logger = logging.getLogger(__name__)


class ErrorShape(str, Enum):
    OPENAI = "openai"        # {"error": {"message", "type", "param", "code"}}
    ANTHROPIC = "anthropic"  # {"type": "error", "error": {"type", "message"}}

    @classmethod
    def for_path(cls, path: str) -> ErrorShape:
        return cls.ANTHROPIC if path == "/v1/messages" or path.startswith("/v1/messages/") else cls.OPENAI


# Anthropic's error types by status (its API reference, "Errors"); other statuses are "api_error".
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 504: "timeout_error"}


class ConfigError(ValueError):
    """A configuration key has a bad value; the message names the key and the value."""


class GatewayError(Exception):
    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param

    def headers(self) -> dict[str, str]:
        return {}

    def body(self, shape: ErrorShape = ErrorShape.OPENAI) -> dict[str, Any]:
        if shape is ErrorShape.ANTHROPIC:
            return {"type": "error",
                    "error": {"type": _ANTHROPIC_TYPES.get(self.status_code, "api_error"), "message": self.message}}
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class BadRequest(GatewayError):
    status_code = 400
    error_type = "invalid_request_error"


class Unauthorized(GatewayError):
    status_code = 401
    error_type = "invalid_request_error"

    def __init__(self, message: str = "Incorrect or missing API key: send it as 'Authorization: Bearer KEY'.") -> None:
        super().__init__(message, code="invalid_api_key")

    def headers(self) -> dict[str, str]:
        return {"www-authenticate": "Bearer"}


class ModelNotFound(GatewayError):
    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, model: str, available: list[str]) -> None:
        listed = ", ".join(available) if available else "none"
        super().__init__(f"The model '{model}' does not exist. Available models: {listed}.",
                         code="model_not_found", param="model")


class StoredResponseUnavailable(GatewayError):
    """A stored response (Responses API) lives on one engine, and that engine is not available: no other one
    can continue it, so the client is told so rather than get another engine's "not found"."""

    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, response_id: str, backend: str, param: str | None) -> None:
        super().__init__(f"The response '{response_id}' is stored on backend {backend}, which is not available now "
                         "(unhealthy, draining or removed); no other backend holds it. Send the conversation again in "
                         "full (without previous_response_id) to continue on another backend.",
                         code="stored_response_unavailable", param=param)


class BackendNotFound(GatewayError):
    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, name: str) -> None:
        super().__init__(f"No backend is named '{name}' (GET /admin/backends lists them).", code="backend_not_found")


class Conflict(GatewayError):
    status_code = 409
    error_type = "invalid_request_error"


class PayloadTooLarge(GatewayError):
    status_code = 413
    error_type = "invalid_request_error"


class UpstreamError(GatewayError):
    """The backend broke the exchange (connection reset, malformed response) after it was chosen."""

    status_code = 502
    error_type = "upstream_error"


class RetryLater(GatewayError):
    """Refused for now; `Retry-After` says when to come back."""

    status_code = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, retry_after_s: int, *, code: str) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(self.retry_after_s)}


class NoHealthyBackend(RetryLater):
    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s, code="no_healthy_backend")


class GatewayOverloaded(RetryLater):
    """The gateway's own resources ran out (file descriptors, memory): nobody's fault but ours."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 1, code="gateway_overloaded")


class Overloaded(RetryLater):
    """More requests in flight than --max-concurrent-requests, for longer than --max-queue-wait-secs."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s, code="too_many_requests")


class ShuttingDown(RetryLater):
    def __init__(self, message: str) -> None:
        super().__init__(message, 1, code="shutting_down")


class UpstreamTimeout(GatewayError):
    status_code = 504
    error_type = "timeout"


def http_error(method: str, path: str, exc: web.HTTPException) -> GatewayError:
    """aiohttp's own refusal of a request (404, 405, 413, ...) as one of ours, with its status."""
    error = GatewayError(f"{method} {path}: {exc.reason}", code=str(exc.status))
    error.status_code = exc.status
    error.error_type = "invalid_request_error"
    return error


def unexpected_error(method: str, path: str) -> GatewayError:
    """A bug, logged with its traceback (call it from the `except` block): the client gets a 500 in our shape,
    not aiohttp's plain text."""
    logger.exception("unexpected error on %s %s", method, path)
    return GatewayError("The gateway failed unexpectedly; see its log.")

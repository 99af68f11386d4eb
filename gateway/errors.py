"""One exception hierarchy for everything the gateway refuses or fails at.

Each error knows its HTTP status and OpenAI error ``type``; `app.py` turns any of them into OpenAI's error
body in one place (`gateway_error`), so no handler builds error JSON by hand.
"""

from __future__ import annotations

from typing import Any


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

    def body(self) -> dict[str, Any]:
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

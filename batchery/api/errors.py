"""OpenAI's error shape (``{"error": {"message", "type", "param", "code"}}``) with the HTTP status
codes the openai SDK maps to its exceptions (400 BadRequestError, 401 AuthenticationError, 403
PermissionDeniedError, 404 NotFoundError, 409 ConflictError, 413/422 ..., 429 RateLimitError, 5xx
InternalServerError)."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered in OpenAI's shape. Raise it from any route."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str | None = None,  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type or ("invalid_request_error" if status_code < 500 else "server_error")
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(what: str, ident: str, param: str | None = None) -> APIError:
    """404 for something that does not exist *or belongs to another key*: the two look the same."""
    return APIError(404, f"No such {what}: '{ident[:200]}'", param=param, code=None)


def unauthorized(message: str = "Incorrect API key provided.") -> APIError:
    return APIError(401, message, type="invalid_request_error", code="invalid_api_key")

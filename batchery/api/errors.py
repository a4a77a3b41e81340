"""OpenAI's error shape (``{"error": {"message", "type", "param", "code"}}``) with the HTTP status
codes the openai SDK maps to its exceptions (400 BadRequestError, 401 AuthenticationError, 403
PermissionDeniedError, 404 NotFoundError, 409 ConflictError, 413/422 ..., 429 RateLimitError, 5xx
InternalServerError). The SDK retries 408, 409, 429 and 5xx unless the answer carries
``x-should-retry: false``: errors that a retry cannot mend (a deadline the request ran out of) say so.
Also OpenAI's cursor page (``list_page``), which the list routes share."""

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
        retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type or ("invalid_request_error" if status_code < 500 else "server_error")
        self.param = param
        self.code = code
        self.retry = retry  # None: the SDK's own rule; False/True: the x-should-retry header

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.retry is None else {"x-should-retry": "true" if self.retry else "false"}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def list_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page (``GET /v1/files``, ``GET /v1/batches``): the items, their first and last
    ids (the next page is ``after=last_id``) and whether more follow."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(what: str, ident: str, param: str | None = None) -> APIError:
    """404 for something that does not exist *or belongs to another key*: the two look the same."""
    return APIError(404, f"No such {what}: '{ident[:200]}'", param=param, code=None)


def unauthorized(message: str = "Incorrect API key provided.") -> APIError:
    return APIError(401, message, type="invalid_request_error", code="invalid_api_key")


def too_large(limit: int, what: str = "request body") -> APIError:
    """413: the body is over ``limit`` bytes (``BATCHERY_API__MAX_BODY_BYTES`` for JSON bodies)."""
    return APIError(413, f"The {what} is larger than this server's limit of {limit} bytes.", code="request_too_large")

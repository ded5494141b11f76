"""The errors Velox produces itself, and the one function that turns them into responses.

Every error the gateway answers on its own is a `VeloxError` subclass whose class attributes fix the
HTTP status, the OpenAI error `type` and `code` (h2's `error_code` pattern), plus where it came from
and whether a client may retry. `to_response` is the only producer of the OpenAI error shape
`{"error": {"message", "type", "param", "code"}}`, so the SDK raises its matching exception class
(BadRequestError, AuthenticationError, PermissionDeniedError, NotFoundError, RateLimitError,
InternalServerError...) for each. Errors the upstream returns are not ours: they pass through with
the upstream's own status and body.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

import orjson


class Source(Enum):
    DOWNSTREAM = "downstream"  # the client sent something we refuse
    UPSTREAM = "upstream"  # the provider could not be reached or misbehaved
    INTERNAL = "internal"  # Velox itself (overload, shutdown, bugs)


class VeloxError(Exception):
    status = 500
    type = "server_error"
    code: str | None = "internal_error"
    source = Source.INTERNAL
    retryable = False
    default_message = "The gateway failed to process the request."

    def __init__(
        self,
        message: str | None = None,
        *,
        param: str | None = None,
        retry_after_s: int | None = None,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        super().__init__(message or self.default_message)
        self.message = message or self.default_message
        self.param = param
        self.retry_after_s = retry_after_s
        self.headers = headers


# --- 4xx: the request is refused -----------------------------------------------------------


class BadRequest(VeloxError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"
    source = Source.DOWNSTREAM
    default_message = "The request could not be understood."


class MalformedJSON(BadRequest):
    code = "invalid_json"
    default_message = "The request body is not valid JSON."


class MissingParameter(BadRequest):
    code = "missing_required_parameter"
    default_message = "A required parameter is missing."


class BadHTTP(BadRequest):
    code = "bad_http_request"
    default_message = "The HTTP request is malformed."


class Unauthorized(VeloxError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"
    source = Source.DOWNSTREAM
    default_message = "Incorrect or missing API key for this gateway."


class NotFound(VeloxError):
    status = 404
    type = "invalid_request_error"
    code = "unknown_url"
    source = Source.DOWNSTREAM
    default_message = "Unknown URL."


class ModelNotFound(NotFound):
    code = "model_not_found"
    default_message = "The model does not exist or you do not have access to it."


class MethodNotAllowed(VeloxError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"
    source = Source.DOWNSTREAM
    default_message = "Method not allowed on this URL."


class PayloadTooLarge(VeloxError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"
    source = Source.DOWNSTREAM
    default_message = "The request body is larger than this gateway accepts."


class HeadersTooLarge(VeloxError):
    status = 431
    type = "invalid_request_error"
    code = "request_header_fields_too_large"
    source = Source.DOWNSTREAM
    default_message = "The request headers are larger than this gateway accepts."


class RateLimited(VeloxError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"
    source = Source.DOWNSTREAM
    retryable = True
    default_message = "Rate limit of the gateway reached; retry after the indicated time."


class InsufficientQuota(VeloxError):
    """A gateway budget is spent: OpenAI's own answer for an account out of credit (the SDK
    raises RateLimitError with code insufficient_quota). `x-should-retry: false` tells the SDKs
    not to retry it: waiting seconds does not refill a budget."""

    status = 429
    type = "insufficient_quota"
    code = "insufficient_quota"
    source = Source.DOWNSTREAM
    default_message = "The gateway budget for this key is spent."


class ModelNotAllowed(VeloxError):
    status = 403  # the SDK raises PermissionDeniedError
    type = "invalid_request_error"
    code = "model_not_allowed"
    source = Source.DOWNSTREAM
    default_message = "This gateway key may not use the requested model."


class EndpointNotAllowed(VeloxError):
    status = 403  # the SDK raises PermissionDeniedError
    type = "invalid_request_error"
    code = "endpoint_not_allowed"
    source = Source.DOWNSTREAM
    default_message = "This gateway key may not use this endpoint."


class RequestTimeout(VeloxError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"
    source = Source.DOWNSTREAM
    default_message = ("The request did not arrive in time (VELOX_BODY_TIMEOUT_MS from its "
                       "first byte); the connection is closed.")


class InvalidPath(BadRequest):
    code = "invalid_path"
    default_message = "The URL path is not in normal form."


# --- 5xx: the gateway or the upstream failed -----------------------------------------------


class Overloaded(VeloxError):
    status = 503
    code = "overloaded"
    retryable = True
    default_message = "The gateway is overloaded (request queue full); retry shortly."


class ShuttingDown(VeloxError):
    status = 503
    code = "shutting_down"
    retryable = True
    default_message = "The gateway is shutting down; retry on another instance."


class NotReady(VeloxError):
    status = 503
    code = "not_ready"
    retryable = True
    default_message = "The upstream connection pool is not warm yet."


class UpstreamUnavailable(VeloxError):
    status = 502
    code = "upstream_unavailable"
    source = Source.UPSTREAM
    retryable = True
    default_message = "The upstream could not be reached."


class UpstreamProtocolError(VeloxError):
    status = 502
    code = "upstream_protocol_error"
    source = Source.UPSTREAM
    default_message = "The upstream broke the protocol or reset the request."


class UpstreamTimeout(VeloxError):
    status = 504
    code = "upstream_timeout"
    source = Source.UPSTREAM
    retryable = True
    default_message = "The upstream did not answer in time."


class UnsupportedTransferCoding(VeloxError):
    status = 501
    type = "invalid_request_error"
    code = "unsupported_transfer_coding"
    source = Source.DOWNSTREAM
    default_message = "Only the chunked transfer coding is supported."


class VersionNotSupported(VeloxError):
    status = 505
    type = "invalid_request_error"
    code = "http_version_not_supported"
    source = Source.DOWNSTREAM
    default_message = "This port serves HTTP/1.1 and HTTP/1.0 only."


class InternalError(VeloxError):
    default_message = "The gateway hit an internal error."


# --- the wire form --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ErrorResponse:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


_JSON = (b"content-type", b"application/json")


def to_response(exc: BaseException) -> ErrorResponse:
    """Map any exception to the response the client gets. Unknown exceptions become a 500."""
    if not isinstance(exc, VeloxError):
        exc = InternalError()
    if exc.param is None and not exc.headers and exc.message is exc.default_message:
        # (mypy reads an exception class's __hash__ as not Hashable's; classes hash by id.)
        return _canned(type(exc), exc.retry_after_s)  # type: ignore[arg-type]
    return _build(exc.status, exc.type, exc.code, exc.param, exc.message,
                  exc.retry_after_s, exc.headers)


@lru_cache(maxsize=256)
def _canned(cls: type[VeloxError], retry_after_s: int | None) -> ErrorResponse:
    # The hot errors (429, 503 overloaded) repeat with the same text: encode each once.
    return _build(cls.status, cls.type, cls.code, None, cls.default_message, retry_after_s, ())


def _build(
    status: int,
    type_: str,
    code: str | None,
    param: str | None,
    message: str,
    retry_after_s: int | None,
    extra: tuple[tuple[bytes, bytes], ...],
) -> ErrorResponse:
    body = orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )
    headers = [_JSON, *extra]
    if retry_after_s is not None:
        headers.append((b"retry-after", str(max(1, retry_after_s)).encode()))
    return ErrorResponse(status, tuple(headers), body)

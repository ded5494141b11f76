from __future__ import annotations

import orjson
import pytest

from velox.core import errors


@pytest.mark.parametrize(
    ("exc", "status", "type_", "code"),
    [
        (errors.MalformedJSON(), 400, "invalid_request_error", "invalid_json"),
        (errors.MissingParameter(param="model"), 400, "invalid_request_error",
         "missing_required_parameter"),
        (errors.Unauthorized(), 401, "invalid_request_error", "invalid_api_key"),
        (errors.NotFound(), 404, "invalid_request_error", "unknown_url"),
        (errors.MethodNotAllowed(), 405, "invalid_request_error", "method_not_allowed"),
        (errors.PayloadTooLarge(), 413, "invalid_request_error", "request_too_large"),
        (errors.RateLimited(retry_after_s=3), 429, "rate_limit_error", "rate_limit_exceeded"),
        (errors.UpstreamUnavailable(), 502, "server_error", "upstream_unavailable"),
        (errors.Overloaded(retry_after_s=1), 503, "server_error", "overloaded"),
        (errors.ShuttingDown(), 503, "server_error", "shutting_down"),
        (errors.UpstreamTimeout(), 504, "server_error", "upstream_timeout"),
        (KeyError("bug"), 500, "server_error", "internal_error"),
    ],
)
def test_every_error_has_the_openai_shape(exc: BaseException, status: int, type_: str,
                                          code: str) -> None:
    response = errors.to_response(exc)
    assert response.status == status
    body = orjson.loads(response.body)
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["type"], body["error"]["code"]) == (type_, code)
    assert body["error"]["message"]
    assert (b"content-type", b"application/json") in response.headers


def test_retry_after_is_whole_seconds_and_at_least_one() -> None:
    headers = dict(errors.to_response(errors.RateLimited(retry_after_s=0)).headers)
    assert headers[b"retry-after"] == b"1"
    headers = dict(errors.to_response(errors.RateLimited(retry_after_s=7)).headers)
    assert headers[b"retry-after"] == b"7"


def test_internal_errors_do_not_leak_details() -> None:
    body = orjson.loads(errors.to_response(RuntimeError("secret path /x/y")).body)
    assert "secret" not in body["error"]["message"]

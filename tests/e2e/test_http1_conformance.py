"""RFC 9112 request rules at a real gateway, on both ingress parsers.

Every case runs against a gateway on the native head parser and one on httptools alone
(VELOX_NATIVE=0, with every other Python twin), with
the same expectations (the two paths answer identically):

* Host (§3.2): an HTTP/1.1 request without Host, and any request with two Host fields or an
  invalid Host value, gets 400 and the connection closes; HTTP/1.0 may omit Host.
* absolute-form targets (§3.2.2): `POST http://host/v1/chat/completions HTTP/1.1` is served
  as its path (the upstream sees `/v1/chat/completions`); a malformed authority gets 400.
* HTTP/1.0 with Transfer-Encoding (§6.1): faulty framing, 400 and close, nothing forwarded.
* HTTP/0.9 and HTTP/2.0 request lines on the HTTP/1.1 port: 505 and close (before: HTTP/0.9
  and HTTP/2.0 heads were answered as HTTP/1.1 requests).
* at most 100 header fields: 431 and close, nothing forwarded (before: a 54 KB head of 5,500
  tiny fields was parsed and all 5,500 forwarded).

Clients are raw sockets on 127.0.0.1 (no SDK sends these requests). A refused request must
never reach the upstream: each carries a unique `x-case` field that the mock's request log is
searched for.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import orjson
import pytest

from velox_lab.launch import GatewayProcess
from velox_lab.mock import MockUpstream

from .conftest import gateway_env
from .test_hardening_ingress import connect, error_code, is_closed, read_response

BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]})
_cases = itertools.count()


@pytest.fixture(scope="module", params=["native", "httptools"])
def gw(request: pytest.FixtureRequest, upstream: MockUpstream,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    log = tmp_path_factory.mktemp(f"rfc9112-{request.param}") / "velox.log"
    env = gateway_env(upstream, VELOX_WORKERS="1",
                      VELOX_NATIVE="1" if request.param == "native" else "0")
    with GatewayProcess(env, log_path=log) as gateway:
        yield gateway


def marker() -> bytes:
    return b"rfc9112-%d" % next(_cases)


def forwarded(upstream: MockUpstream, mark: bytes) -> list[dict]:
    """The upstream's log entries of requests that carried `x-case: mark`."""
    return [r for r in upstream.requests(500)
            if ["x-case", mark.decode()] in r["headers"]]


def refused(gw: GatewayProcess, raw: bytes) -> tuple[int, str, dict[bytes, bytes]]:
    """Send raw on a fresh connection; the answer must come, say close, and be followed by
    the gateway closing the connection. Returns (status, error code, headers)."""
    with connect(gw) as sock:
        sock.sendall(raw)
        status, headers, body = read_response(sock)
        assert headers.get(b"connection") == b"close", (raw, status, headers)
        assert is_closed(sock), raw
    return status, error_code(body), headers


def served(gw: GatewayProcess, raw: bytes) -> tuple[int, bytes]:
    with connect(gw) as sock:
        sock.sendall(raw)
        status, _, body = read_response(sock)
    return status, body


def chat(target: bytes, fields: bytes, version: bytes = b"HTTP/1.1") -> bytes:
    return (b"POST %b %b\r\n%bcontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
            % (target, version, fields, len(BODY), BODY))


# --- Host (§3.2) ----------------------------------------------------------------------------


def test_an_http11_request_without_host_is_400(gw: GatewayProcess,
                                               upstream: MockUpstream) -> None:
    mark = marker()
    status, code, _ = refused(gw, chat(b"/v1/chat/completions", b"x-case: %b\r\n" % mark))
    assert (status, code) == (400, "bad_http_request")
    status, code, _ = refused(gw, b"GET /healthz HTTP/1.1\r\n\r\n")
    assert (status, code) == (400, "bad_http_request")
    assert not forwarded(upstream, mark)


def test_an_http10_request_may_omit_host(gw: GatewayProcess, upstream: MockUpstream) -> None:
    mark = marker()
    status, body = served(gw, chat(b"/v1/chat/completions", b"x-case: %b\r\n" % mark,
                                   b"HTTP/1.0"))
    assert status == 200, body
    assert [r["path"] for r in forwarded(upstream, mark)] == ["/v1/chat/completions"]


@pytest.mark.parametrize("fields", [
    b"host: a\r\nhost: a\r\n",  # twice, even with equal values
    b"Host: a\r\nHOST: b\r\n",
    b"host: a/b\r\n",  # not uri-host [ ":" port ]
    b"host: user@a\r\n",
    b"host: a b\r\n",
    b"host: \xc3\xa9\r\n",
])
@pytest.mark.parametrize("version", [b"HTTP/1.1", b"HTTP/1.0"])
def test_a_duplicated_or_invalid_host_is_400(gw: GatewayProcess, upstream: MockUpstream,
                                             fields: bytes, version: bytes) -> None:
    mark = marker()
    raw = chat(b"/v1/chat/completions", fields + b"x-case: %b\r\n" % mark, version)
    status, code, _ = refused(gw, raw)
    assert (status, code) == (400, "bad_http_request")
    assert not forwarded(upstream, mark)


@pytest.mark.parametrize("host", [b"127.0.0.1:8080", b"[::1]:8080", b"api.example.com",
                                  b"example.com ", b""])
def test_valid_host_values_are_served(gw: GatewayProcess, host: bytes) -> None:
    # An empty value is valid (a target URI without authority, §3.2); trailing OWS is not
    # part of the value.
    status, body = served(gw, b"GET /v1/models HTTP/1.1\r\nhost: %b\r\n\r\n" % host)
    assert status == 200, body


# --- absolute-form (§3.2.2) -----------------------------------------------------------------


@pytest.mark.parametrize("target", [
    b"http://127.0.0.1/v1/chat/completions",
    b"HTTPS://api.example.com:443/v1/chat/completions",
])
def test_an_absolute_form_target_is_served_as_its_path(
        gw: GatewayProcess, upstream: MockUpstream, target: bytes) -> None:
    mark = marker()
    status, body = served(gw, chat(target, b"host: other\r\nx-case: %b\r\n" % mark))
    assert status == 200, body
    assert orjson.loads(body)["object"] == "chat.completion"
    assert [r["path"] for r in forwarded(upstream, mark)] == ["/v1/chat/completions"]


def test_an_absolute_form_keeps_its_query_and_an_empty_path_is_the_root(
        gw: GatewayProcess, upstream: MockUpstream) -> None:
    mark = marker()
    status, body = served(gw, b"GET http://h/v1/models?limit=2 HTTP/1.1\r\nhost: h\r\n"
                          b"x-case: %b\r\n\r\n" % mark)
    assert status == 200, body
    assert [r["path"] for r in forwarded(upstream, mark)] == ["/v1/models?limit=2"]
    # "http://h" names the root, which only POST may use: its 405, not a 404 for "http://h".
    with connect(gw) as sock:
        sock.sendall(b"GET http://h HTTP/1.1\r\nhost: h\r\n\r\n")
        status, headers, body = read_response(sock)
    assert (status, error_code(body), headers[b"allow"]) == (405, "method_not_allowed", b"POST")


@pytest.mark.parametrize("target", [
    b"http://user@h/v1/chat/completions",  # userinfo (RFC 9110 §4.2.4)
    b"http:///v1/chat/completions",  # empty host (RFC 9110 §4.2.1)
    b"http://h{/v1/chat/completions",
])
def test_a_malformed_absolute_form_is_400(gw: GatewayProcess, upstream: MockUpstream,
                                          target: bytes) -> None:
    mark = marker()
    status, code, _ = refused(gw, chat(target, b"host: h\r\nx-case: %b\r\n" % mark))
    assert status == 400, code
    assert not forwarded(upstream, mark)


# --- HTTP/1.0 with Transfer-Encoding (§6.1) ---------------------------------------------------


@pytest.mark.parametrize("coding", [b"chunked", b"gzip, chunked"])
def test_http10_with_transfer_encoding_is_400_and_closed(
        gw: GatewayProcess, upstream: MockUpstream, coding: bytes) -> None:
    mark = marker()
    half = len(BODY) // 2
    raw = (b"POST /v1/chat/completions HTTP/1.0\r\nhost: h\r\nx-case: %b\r\n"
           b"content-type: application/json\r\ntransfer-encoding: %b\r\n\r\n"
           b"%x\r\n%b\r\n%x\r\n%b\r\n0\r\n\r\n"
           % (mark, coding, half, BODY[:half], len(BODY) - half, BODY[half:]))
    status, code, _ = refused(gw, raw)
    assert (status, code) == (400, "bad_http_request")
    assert not forwarded(upstream, mark)


# --- HTTP versions other than 1.0 and 1.1 -----------------------------------------------------


@pytest.mark.parametrize("raw", [
    b"GET /v1/models\r\n%b\r\n",  # an HTTP/0.9 request line (no version)
    b"GET /v1/models HTTP/0.9\r\n%b\r\n",
    b"GET /v1/models HTTP/2.0\r\nhost: h\r\n%b\r\n",
    b"POST /v1/chat/completions HTTP/2.0\r\nhost: h\r\n%%bcontent-length: %d\r\n\r\n%b"
    % (len(BODY), BODY),
])
@pytest.mark.parametrize("with_fields", [False, True])
def test_http09_and_http2_request_lines_get_505(gw: GatewayProcess, upstream: MockUpstream,
                                                raw: bytes, with_fields: bool) -> None:
    mark = marker()
    status, code, _ = refused(gw, raw % (b"x-case: %b\r\n" % mark if with_fields else b""))
    assert (status, code) == (505, "http_version_not_supported")
    assert not forwarded(upstream, mark)


# --- the number of header fields --------------------------------------------------------------


def fields(n: int) -> bytes:
    """n fields in all, Host included."""
    return b"host: h\r\n" + b"".join(b"x%d: 1\r\n" % i for i in range(n - 1))


def test_100_header_fields_are_served_and_forwarded(gw: GatewayProcess,
                                                    upstream: MockUpstream) -> None:
    mark = marker()
    # 100 fields: host, x-case, content-type, content-length and 96 more.
    status, body = served(gw, chat(b"/v1/chat/completions", fields(97) + b"x-case: %b\r\n" % mark))
    assert status == 200, body
    (entry,) = forwarded(upstream, mark)
    assert sum(name.startswith("x") and name[1:].isdigit() for name, _ in entry["headers"]) == 96


@pytest.mark.parametrize("n", [101, 5_500])
def test_more_than_100_header_fields_get_431(gw: GatewayProcess, upstream: MockUpstream,
                                             n: int) -> None:
    mark = marker()
    raw = chat(b"/v1/chat/completions", fields(n - 3) + b"x-case: %b\r\n" % mark)
    assert len(raw) < 64 * 1024  # under VELOX_MAX_HEADER_BYTES: the count alone refuses it
    status, code, _ = refused(gw, raw)
    assert (status, code) == (431, "request_header_fields_too_large")
    assert not forwarded(upstream, mark)

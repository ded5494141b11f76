"""The native request-head parser's binding (`_native.reqhead`) and ingress's native path,
case by case: what the binding returns, that it holds no references, and how a connection
moves from the native path to httptools (chunked bodies, large heads, a 408 mid-head) with
the same answers as httptools alone. The generated comparisons are in test_reqhead_fuzz.py.
"""

from __future__ import annotations

import gc
import sys

import psutil
import pytest

from velox import _native
from velox.config.settings import load
from velox.core.types import Kind
from velox.ingress.arena import Arena
from velox.ingress.auth import Auth
from velox.ingress.connection import ClientConnection, IngressState
from velox_lab.pipeline import CLIENT_REQUEST

from .test_reqhead_fuzz import _Ring, _seen, _Transport, make, run_both

reqhead = _native.reqhead


def test_the_sdk_request_in_one_call() -> None:
    head_end = CLIENT_REQUEST.index(b"\r\n\r\n") + 4
    (method, target, headers, length, authorization, expect, keep_alive, http10,
     end, traceparent) = reqhead(CLIENT_REQUEST, 0, 65536)
    assert (method, target, end) == (b"POST", b"/v1/chat/completions", head_end)
    assert len(headers) == 15 and headers[0] == (b"host", b"127.0.0.1:8080")
    assert all(name == name.lower() for name, _ in headers)
    assert length == len(CLIENT_REQUEST) - head_end
    assert authorization == b"Bearer sk-client-0123456789abcdef"
    assert (expect, keep_alive, http10, traceparent) == (False, True, False, None)
    # One shared object per method and per common name; the values are fresh.
    again = reqhead(bytearray(CLIENT_REQUEST), 0, 65536)
    assert again[0] is method and again[2][0][0] is headers[0][0]
    assert again[:-2] == (method, target, headers, length, authorization, expect, keep_alive,
                          http10)


def test_need_more_fallback_and_bad_arguments() -> None:
    assert reqhead(b"", 0, 100) is None
    assert reqhead(b"POST /v1/x HTTP/1.1\r\nHost: a\r\n", 0, 100) is None
    assert reqhead(b"POST /v1/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n", 0,
                   100) is False
    # ingress's byte count over max_header_bytes: httptools answers the 431.
    assert isinstance(reqhead(b"GET /a HTTP/1.1\r\nHost: a\r\nx: " + b"y" * 84 + b"\r\n\r\n",
                              0, 100), tuple)  # 2 + (4 + 1 + 4) + (1 + 84 + 4): exactly 100
    assert reqhead(b"GET /a HTTP/1.1\r\nHost: a\r\nx: " + b"y" * 85 + b"\r\n\r\n", 0, 100) is False
    # An incomplete head as long as REQHEAD_PARTIAL falls back instead of being rescanned.
    partial = b"GET /a HTTP/1.1\r\nx: " + b"y" * _native.REQHEAD_PARTIAL
    assert reqhead(partial[:_native.REQHEAD_PARTIAL - 1], 0, 1 << 20) is None
    assert reqhead(partial[:_native.REQHEAD_PARTIAL], 0, 1 << 20) is False
    # REQHEAD_FIELDS fields, Host included, are parsed; one more falls back (ingress's 431).
    fields = b"Host: a\r\n" + b"".join(b"x-%d: v\r\n" % i
                                        for i in range(_native.REQHEAD_FIELDS - 1))
    assert len(reqhead(b"GET / HTTP/1.1\r\n" + fields + b"\r\n", 0, 1 << 20)[2]) == 100
    assert reqhead(b"GET / HTTP/1.1\r\n" + fields + b"x: v\r\n\r\n", 0, 1 << 20) is False
    with pytest.raises(ValueError):
        reqhead(b"GET", 4, 100)
    with pytest.raises(ValueError):
        reqhead(b"GET", -1, 100)
    with pytest.raises(TypeError):
        reqhead("GET / HTTP/1.1\r\n\r\n", 0, 100)
    with pytest.raises(TypeError):
        reqhead(b"GET / HTTP/1.1\r\n\r\n", 0)


def test_reqhead_keeps_refcounts_and_rss_flat() -> None:
    data = CLIENT_REQUEST
    base = sys.getrefcount(data)
    for _ in range(10_000):  # warm-up
        reqhead(data, 0, 65536)
    gc.collect()
    before = psutil.Process().memory_info().rss
    for _ in range(100_000):
        reqhead(data, 0, 65536)
        reqhead(data, 0, 100)
        reqhead(data[:50], 0, 65536)
        with pytest.raises(ValueError):
            reqhead(data, len(data) + 1, 65536)
    gc.collect()
    assert sys.getrefcount(data) == base
    assert psutil.Process().memory_info().rss - before < 8 << 20


# --- ingress ----------------------------------------------------------------------------------


def test_sdk_requests_stay_on_the_native_path() -> None:
    sdk = CLIENT_REQUEST.replace(b"Bearer sk-client-0123456789abcdef", b"Bearer sk-x")
    in_body = sdk.index(b"\r\n\r\n") + 10
    writes = [sdk, sdk, sdk * 2,  # pipelined in one read
              sdk[:in_body], sdk[in_body:],  # split inside the body
              sdk[:40], sdk[40:]]  # and inside the head
    conn, _, ring = make("native")
    for piece in writes:
        conn.data_received(piece)
    assert conn._native and len(ring.pushed) == 6
    assert {r.kind for r in ring.pushed} == {Kind.MODEL_CALL}
    assert len({repr(_seen(r)) for r in ring.pushed}) == 1  # the same, however split
    run_both(writes)


def test_a_chunked_request_hands_the_connection_to_httptools() -> None:
    chunked = (b"POST /v1/embeddings HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer sk-x\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nx-t: 1\r\n\r\n")
    plain = b"GET /v1/models HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer sk-x\r\n\r\n"
    conn, _, ring = make("native")
    conn.data_received(plain + chunked[:30])
    assert conn._native
    conn.data_received(chunked[30:] + plain)
    assert not conn._native  # for good: httptools parsed the rest
    assert [r.method for r in ring.pushed] == [b"GET", b"POST", b"GET"]
    assert bytes(ring.pushed[1].body) == b"hello"
    run_both([plain + chunked[:30], chunked[30:] + plain])
    run_both([plain + chunked + plain])


def test_a_head_over_the_header_limit_gets_httptools_431() -> None:
    big = b"GET /v1/models HTTP/1.1\r\nHost: h\r\nx-big: " + b"y" * 2000 + b"\r\n\r\n"
    conn, transport, _ = make("native")
    conn.data_received(big)
    assert transport.log[0].startswith(b"HTTP/1.1 431 ") and "close" in transport.log
    run_both([big])
    run_both([big[:700], big[700:]])


def test_expect_100_continue_on_the_native_path() -> None:
    head = (b"POST /v1/embeddings HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer sk-x\r\n"
            b"Expect: 100-continue\r\nContent-Length: 2\r\n\r\n")
    conn, transport, ring = make("native")
    conn.data_received(head)
    assert transport.log == [b"HTTP/1.1 100 Continue\r\n\r\n"] and not ring.pushed
    conn.data_received(b"{}")
    assert bytes(ring.pushed[0].body) == b"{}" and conn._native
    run_both([head, b"{}"])
    # Refused at header time (no key): the answer comes at once and the connection closes.
    refused = head.replace(b"Authorization: Bearer sk-x\r\n", b"")
    run_both([refused, b"{}"])


@pytest.mark.parametrize("partial", [
    b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n",  # method known: the 408 to HEAD has no body
    b"POST /v1/embeddings HTTP/1.1\r\nHost: h\r\nContent-Length: 10\r\n\r\n{\"a\"",  # body
    b"PO",  # not even a method yet
])
def test_a_request_cut_off_by_the_deadline_gets_the_same_408(partial: bytes) -> None:
    conn, transport, _ = make("native")
    conn.data_received(partial)
    assert conn.receiving_since
    conn.expire_receive()
    assert transport.log[0].startswith(b"HTTP/1.1 408 ")
    run_both([partial], expire=True)


def test_bytes_after_a_closing_request_are_refused_as_httptools_does() -> None:
    closing = b"GET /healthz HTTP/1.0\r\n\r\n"
    run_both([closing + b"GET /healthz HTTP/1.1\r\n\r\n"])
    run_both([closing + b"\r\n\r\n"])
    conn, transport, _ = make("native")
    conn.data_received(closing + b"GET /x")
    assert transport.log[-1] == "close" and conn.closed


def test_the_switch_selects_the_parser() -> None:
    settings = load({"VELOX_NATIVE": "0"}, dotenv=None)
    assert not settings.native
    assert load({}, dotenv=None).native
    state = IngressState(None, _Ring(), lambda: None, Arena(0),  # type: ignore[arg-type]
                         Auth(settings), 1 << 20, 1 << 16, lambda: True,
                         None, settings.native)
    conn = ClientConnection(state)
    conn.connection_made(_Transport())  # type: ignore[arg-type]
    assert not conn._native
    with pytest.raises(Exception, match="VELOX_NATIVE"):
        load({"VELOX_NATIVE": "h11"}, dotenv=None)


# --- RFC 9112 rules and the cap on header fields, on both paths ------------------------------

_GOOD = b"GET /v1/models HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer sk-x\r\n\r\n"
_MANY = b"".join(b"x-%d: 1\r\n" % i for i in range(_native.REQHEAD_FIELDS))


@pytest.mark.parametrize("raw, status", [
    (b"GET /v1/models HTTP/1.1\r\nAuthorization: Bearer sk-x\r\n\r\n", 400),  # no Host
    (b"GET /v1/models HTTP/1.1\r\nHost: a\r\nHOST: a\r\n\r\n", 400),  # two
    (b"GET /v1/models HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    (b"GET /v1/models HTTP/1.1\r\nHost: u@a\r\n\r\n", 400),  # not host[:port]
    (b"POST /v1/embeddings HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer sk-x\r\n"
     b"Host: a b\r\nContent-Length: 2\r\n\r\n{}", 400),
    (b"POST /v1/embeddings HTTP/1.0\r\nAuthorization: Bearer sk-x\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 400),  # HTTP/1.0 framing
    (b"POST http://u@h/v1/embeddings HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\n{}", 400),
    (b"GET http:///v1/models HTTP/1.1\r\nHost: h\r\n\r\n", 400),
    (b"GET /v1/models\r\n\r\n", 505),  # HTTP/0.9
    (b"GET /v1/models HTTP/0.9\r\nHost: h\r\n\r\n", 505),
    (b"GET /v1/models HTTP/2.0\r\nHost: h\r\n\r\n", 505),
    (b"GET /v1/models HTTP/1.1\r\nHost: h\r\n" + _MANY + b"\r\n", 431),  # 101 fields
])
def test_heads_refused_at_header_time_get_the_same_answer_on_both_paths(raw: bytes,
                                                                         status: int) -> None:
    for parser in ("native", "httptools"):
        conn, transport, ring = make(parser)
        conn.data_received(_GOOD + raw)
        assert transport.log[0].startswith(b"HTTP/1.1 200 "), transport.log
        assert transport.log[1].startswith(b"HTTP/1.1 %d " % status), (parser, transport.log)
        assert transport.log[-1] == "close" and len(ring.pushed) == 1
    run_both([raw])
    run_both([_GOOD + raw])
    run_both([_GOOD, raw[:9], raw[9:]])


def test_100_fields_stay_on_the_native_path() -> None:
    raw = b"GET /v1/models HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer sk-x\r\n" + b"".join(
        b"x-%d: 1\r\n" % i for i in range(_native.REQHEAD_FIELDS - 2)) + b"\r\n"
    conn, _, ring = make("native")
    conn.data_received(raw)
    assert conn._native and len(ring.pushed[0].headers) == 100
    run_both([raw, raw])


@pytest.mark.parametrize("target, path", [
    (b"http://h/v1/embeddings", b"/v1/embeddings"),
    (b"HTTPS://api.example.com:443/v1/embeddings?a=1", b"/v1/embeddings?a=1"),
    (b"http://[::1]:8080/v1/embeddings", b"/v1/embeddings"),
])
def test_an_absolute_form_target_is_served_as_its_path(target: bytes, path: bytes) -> None:
    raw = (b"POST %b HTTP/1.1\r\nHost: other\r\nAuthorization: Bearer sk-x\r\n"
           b"Content-Length: 2\r\n\r\n{}" % target)
    for parser in ("native", "httptools"):
        conn, _, ring = make(parser)
        conn.data_received(raw + _GOOD)
        assert [(r.method, r.path, r.kind) for r in ring.pushed] == [
            (b"POST", path, Kind.MODEL_CALL),
            (b"GET", b"/v1/models", Kind.FORWARD)]
    run_both([raw + _GOOD])


@pytest.mark.parametrize("field", [b"a:", b"ab: ", b"x-%d: 1"])  # 5, 6, 8-9 counted bytes
def test_the_field_cap_holds_at_exactly_100_whatever_the_fields_size(field: bytes) -> None:
    # 100 fields are served and the 101st is refused, on both paths, whatever the fields'
    # size: the smallest count 5 bytes each against VELOX_MAX_HEADER_BYTES.
    def head(n: int) -> bytes:
        fields = b"".join((field % i if b"%" in field else field) + b"\r\n" for i in range(n))
        return b"GET /v1/models HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer sk-x\r\n" + fields

    for parser in ("native", "httptools"):
        conn, transport, ring = make(parser)
        conn.data_received(head(98) + b"\r\n")
        assert len(ring.pushed) == 1 and len(ring.pushed[0].headers) == 100
        conn, transport, ring = make(parser)
        conn.data_received(head(99) + b"\r\n")
        assert transport.log[0].startswith(b"HTTP/1.1 431 ") and not ring.pushed
    run_both([head(98) + b"\r\n"])
    run_both([head(99) + b"\r\n"])


def test_trailer_fields_count_against_the_cap() -> None:
    head = (b"POST /v1/embeddings HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer sk-x\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n")
    for trailers, answer in ((97, b"HTTP/1.1 200 "), (98, b"HTTP/1.1 431 ")):
        raw = head + b"".join(b"t%d: 1\r\n" % i for i in range(trailers)) + b"\r\n"
        for parser in ("native", "httptools"):
            conn, transport, _ = make(parser)
            conn.data_received(raw)
            assert transport.log[0].startswith(answer), (trailers, parser, transport.log)
        run_both([raw])

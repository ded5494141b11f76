"""The upstream's share of a request's headers made by the native head parser (reqhead's
`drop` argument, ingress's native path) against auth.Auth.client_headers, which the httptools
path and every request made elsewhere still use: the same list and the same credential to pass
on, for the heads clients send and for generated ones."""

from __future__ import annotations

import pytest
from hypothesis import given

from velox import _native
from velox.config.settings import load
from velox.ingress.auth import Auth
from velox.ingress.connection import _UPSTREAM_DROP
from velox_lab.pipeline import CLIENT_REQUEST

from .test_reqhead_fuzz import _FUZZ, MAX_HEADER, heads, make

NO_KEYS = Auth(load({}, dotenv=None))
KEYS = Auth(load({"VELOX_API_KEYS": "sk-x"}, dotenv=None))


def agree(raw: bytes) -> bool:
    """Both ways give the same pair for `raw` (True), or the native parser leaves it to
    Python (False: a Connection header naming other fields, or a head it does not take)."""
    got = _native.reqhead(raw, 0, MAX_HEADER, _UPSTREAM_DROP)
    if not isinstance(got, tuple):
        return False
    assert got[:10] == _native.reqhead(raw, 0, MAX_HEADER)  # the first ten items unchanged
    headers, authorization, upstream = got[2], got[4], got[10]
    if upstream is None:
        connection = [v.lower() for n, v in headers if n == b"connection"]
        assert any(v not in (b"keep-alive", b"close") for v in connection), raw
        return False
    for auth in (NO_KEYS, KEYS):
        assert (upstream, auth.passthrough_of(authorization)) == auth.client_headers(headers)
    return True


SDK = CLIENT_REQUEST[:CLIENT_REQUEST.index(b"\r\n\r\n") + 4]


@pytest.mark.parametrize("raw", [
    SDK,
    SDK.replace(b"Connection: keep-alive", b"Connection: Close\r\nTE: trailers\r\nKeep-Alive: 5"),
    SDK.replace(b"Authorization", b"x-authorization").replace(
        b"\r\n\r\n", b"\r\nAuthorization: Bearer second\r\nx-a: 1\r\n\r\n"),
    b"GET /v1/models HTTP/1.1\r\nProxy-Authorization: x\r\nHost: a\r\n\r\n",
    b"GET /v1/models HTTP/1.0\r\n\r\n",
])
def test_the_native_list_is_client_headers(raw: bytes) -> None:
    assert agree(raw)


def test_two_authorization_fields_are_left_to_python() -> None:
    # ingress's httptools path refuses them (400): one credential per request.
    assert not agree(SDK.replace(b"\r\n\r\n", b"\r\nAuthorization: Bearer second\r\n\r\n"))


def test_a_connection_header_naming_fields_is_left_to_python() -> None:
    raw = SDK.replace(b"\r\n\r\n", b"\r\nConnection: x-stainless-os, close\r\n\r\n")
    assert not agree(raw)
    with pytest.raises(TypeError):
        _native.reqhead(SDK, 0, MAX_HEADER, [b"host"])


@_FUZZ
@given(raw=heads(odd=8))
def test_generated_heads_agree(raw: bytes) -> None:
    agree(raw)


def test_ingress_hands_the_pair_to_the_request() -> None:
    # Both parsers: the native one sets Request.upstream_headers, httptools leaves it None
    # (the worker then calls client_headers); either way the pair is the same.
    seen: dict[str, object] = {}
    for parser in ("native", "httptools"):
        conn, _, ring = make(parser, answer=False)
        conn.data_received(CLIENT_REQUEST.replace(b"sk-client-0123456789abcdef", b"sk-x"))
        request = ring.pushed[-1]
        seen[parser] = request.upstream_headers
        pair = KEYS.client_headers(request.headers)
        assert (request.upstream_headers or pair) == pair
    assert seen["native"] is not None and seen["httptools"] is None

"""Fuzzing the ingress of a real worker with hypothesis-generated HTTP/1.1 traffic.

One gateway (one worker, the mock behind it) receives generated requests on fresh
connections: methods, targets (good, unnormalised, garbage), headers (framing, upgrades,
expectations, trailers), bodies sent with content-length, chunked in random chunk sizes, or
mis-framed, several pipelined on one connection, and the bytes split at random points or sent
one byte at a time. The invariant: each request gets exactly one well-formed HTTP/1.1 answer
(h11 parses the response stream strictly) or the connection is closed before it, nothing
arrives that no request asked for, and nothing hangs (VELOX_BODY_TIMEOUT_MS is short here, so
a request left incomplete gets its 408 quickly). At the end the worker is the same process
and /healthz answers.

`make test` runs a bounded number of examples; VELOX_FUZZ_EXAMPLES=2000 runs more.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import h11
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from velox.launch import GatewayProcess
from velox.mock import MockUpstream

from .conftest import gateway_env

EXAMPLES = int(os.environ.get("VELOX_FUZZ_EXAMPLES", "120"))
# A request left incomplete is answered 408 within this plus one 0.25 s tick.
BODY_TIMEOUT_MS = 300
READ_DEADLINE_S = 5.0


@pytest.fixture(scope="module")
def fuzz_gateway(upstream: MockUpstream, tmp_path_factory: pytest.TempPathFactory,
                 ) -> Iterator[GatewayProcess]:
    log = tmp_path_factory.mktemp("fuzz") / "velox.log"
    env = gateway_env(upstream, VELOX_WORKERS="1", VELOX_BODY_TIMEOUT_MS=str(BODY_TIMEOUT_MS),
                      VELOX_MAX_BODY_BYTES="100000", VELOX_MAX_HEADER_BYTES="4096")
    with GatewayProcess(env, log_path=log) as gw:
        yield gw


# --- the generated traffic ------------------------------------------------------------------

_TCHAR = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-!#$%&'*+.^_`|~"
TOKEN = st.text(alphabet=_TCHAR, min_size=1, max_size=12).map(str.encode)
METHODS = st.sampled_from([b"GET", b"POST", b"HEAD", b"PUT", b"DELETE", b"OPTIONS", b"PATCH",
                           b"CONNECT", b"TRACE"]) | TOKEN
PATHS = st.sampled_from([
    b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings", b"/v1/responses",
    b"/v1/models", b"/v1/models/gpt-4o", b"/v1/files", b"/", b"/healthz", b"/readyz", b"*",
    b"/v1/../x", b"/v1/%2e%2E/x", b"/v1//x", b"/v1/chat/completions/", b"/v1/chat/completions;x",
    b"/v1/a%2fb", b"/v1/a\\b", b"http://example.com/v1/models", b"/nowhere",
])
QUERY = st.sampled_from([b"", b"?a=1", b"?x=/../y", b"?%zz", b"?"])
TARGETS = st.one_of(
    st.tuples(PATHS, QUERY).map(b"".join),
    st.binary(min_size=1, max_size=30).filter(lambda b: not set(b) & set(b" \r\n")),
)
JSON_BODIES = st.sampled_from([
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}',
    b'{"model": "m", "input": "hi", "stream": true}',
    b'{"model": "m", "messages": [], "stream": true}',
    b"{}", b"[]", b'{"model": 5}', b"{", b"",
])
BODIES = JSON_BODIES | st.binary(max_size=300)
HEADER_NAMES = st.sampled_from([
    b"content-type", b"authorization", b"accept", b"user-agent", b"x-custom", b"te",
    b"keep-alive", b"cookie", b"Content-Type", b"X-Forwarded-For", b"via", b"trailer",
]) | TOKEN
HEADER_VALUES = st.sampled_from([
    b"application/json", b"Bearer sk-x", b"*/*", b"trailers", b"close", b"", b"x" * 100,
]) | st.binary(max_size=40).filter(lambda b: not set(b) & set(b"\r\n\x00"))
# Framing and connection-level headers, added on purpose (and sometimes wrongly).
SPECIAL = st.sampled_from([
    b"connection: close", b"connection: keep-alive", b"connection: upgrade\r\nupgrade: h2c",
    b"connection: Upgrade\r\nupgrade: websocket", b"upgrade: websocket", b"expect: 100-continue",
    b"expect: something-else", b"transfer-encoding: gzip, chunked",
    b"transfer-encoding: chunked, chunked", b"transfer-encoding: identity",
    b"content-length: 3\r\ncontent-length: 4", b"content-length: -1", b"content-length: abc",
    b"content-length: 99999999999999999999", b"host: a\r\nhost: b", b"x-long: " + b"y" * 5000,
])
FRAMINGS = st.sampled_from(["length", "length", "chunked", "chunked", "none", "short", "long"])


@st.composite
def requests(draw: st.DrawFn) -> tuple[bytes, list[bytes], bool]:
    """(raw bytes, methods of the requests the gateway will see in them, complete): one
    request, mostly well framed."""
    method = draw(METHODS)
    target = draw(TARGETS)
    version = draw(st.sampled_from([b"HTTP/1.1"] * 6 + [b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.x"]))
    headers = [b"host: x"] if draw(st.integers(0, 9)) else []
    for name, value in draw(st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=4)):
        headers.append(name + b": " + value)
    if draw(st.integers(0, 3)) == 0:
        headers.append(draw(SPECIAL))
    body = draw(BODIES)
    framing = draw(FRAMINGS)
    complete = True
    methods = [method]
    if framing == "length":
        headers.append(b"content-length: %d" % len(body))
        payload = body
    elif framing == "chunked":
        headers.append(b"transfer-encoding: chunked")
        payload, at = b"", 0
        for size in draw(st.lists(st.integers(1, 64), max_size=6)):
            piece = body[at:at + size]
            at += size
            if piece:
                payload += b"%x\r\n%b\r\n" % (len(piece), piece)
        if at < len(body):
            payload += b"%x\r\n%b\r\n" % (len(body) - at, body[at:])
        trailer = draw(st.sampled_from([b"", b"x-trailer: 1\r\n", b"authorization: x\r\n"]))
        payload += b"0\r\n" + trailer + b"\r\n"
    elif framing == "short":  # declares more than it sends: the receive deadline answers
        headers.append(b"content-length: %d" % (len(body) + 10))
        payload, complete = body, False
    elif framing == "long":  # sends more than it declares: the rest is the next "request"
        headers.append(b"content-length: 0")
        payload = body
        if body:
            methods.append(b"GET")  # the gateway sees a second request (and refuses it)
    else:
        payload = b""
    raw = b"%b %b %b\r\n%b\r\n\r\n%b" % (method, target, version, b"\r\n".join(headers), payload)
    if not headers:
        raw = b"%b %b %b\r\n\r\n%b" % (method, target, version, payload)
    return raw, methods, complete


@st.composite
def conversations(draw: st.DrawFn) -> tuple[list[tuple[bytes, bytes, bool]], list[bytes]]:
    """Requests pipelined on one connection and the writes their bytes are split into."""
    if draw(st.integers(0, 19)) == 0:  # plain garbage
        garbage = draw(st.binary(min_size=1, max_size=200))
        # Empty lines between requests are ignored (RFC 9112 §2.2): no request, no answer.
        reqs = [(garbage, [] if not garbage.strip(b"\r\n") else [b"GET"], True)]
    else:
        reqs = draw(st.lists(requests(), min_size=1, max_size=3))
        # An incomplete request holds the connection until its 408: nothing may follow it.
        for i, (_, _, complete) in enumerate(reqs):
            if not complete:
                reqs = reqs[:i + 1]
                break
    data = b"".join(r[0] for r in reqs)
    if len(data) <= 300 and draw(st.integers(0, 9)) == 0:
        writes = [data[i:i + 1] for i in range(len(data))]  # every byte boundary
    else:
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=6))))
        bounds = [0, *cuts, len(data)]
        writes = [data[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    return reqs, writes


# --- the invariant --------------------------------------------------------------------------


def talk(gw: GatewayProcess, methods: list[bytes], writes: list[bytes]) -> tuple[int, bool]:
    """Send the writes, then read until every request is answered or the connection closes.
    Returns (final responses, closed). Fails on malformed responses, extra responses, or a
    connection left open with requests unanswered after READ_DEADLINE_S."""
    client = h11.Connection(h11.CLIENT, max_incomplete_event_size=1 << 20)
    sock = socket.create_connection((gw.host, gw.port), timeout=READ_DEADLINE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    answered, closed = 0, False
    try:
        try:
            for data in writes:
                sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the gateway refused and closed mid-send: what it wrote is still readable
        if not methods:
            sock.settimeout(0.3)
            try:
                extra = sock.recv(1)
            except (TimeoutError, ConnectionResetError):
                extra = b""
            assert extra == b"", f"an answer nobody asked for: {extra!r}"
            return 0, False
        deadline = time.monotonic() + READ_DEADLINE_S
        _expect(client, methods, 0)
        while True:
            event = client.next_event()
            if event is h11.NEED_DATA:
                if closed:
                    break
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    data = sock.recv(65536)
                except ConnectionResetError:
                    data = b""
                except TimeoutError:
                    raise AssertionError(
                        f"hung: {answered} of {len(methods)} answered, connection open") from None
                closed = not data
                if closed and client.their_state is h11.SEND_RESPONSE \
                        and not client.trailing_data[0]:
                    break  # closed before any byte of the next answer: allowed
                client.receive_data(data)
                continue
            if isinstance(event, h11.ConnectionClosed):
                closed = True
                break
            if isinstance(event, h11.Response):
                assert event.http_version == b"1.1"
                assert answered < len(methods), "a response nobody asked for"
                answered += 1
            elif isinstance(event, h11.EndOfMessage):
                if client.our_state is h11.DONE and client.their_state is h11.DONE:
                    if answered == len(methods):
                        # Anything after the last answer would be unrequested: peek briefly.
                        extra = client.trailing_data[0]
                        sock.settimeout(0.05)
                        try:
                            extra += sock.recv(1)
                        except (TimeoutError, ConnectionResetError):
                            pass
                        assert extra == b"", f"unrequested bytes after the last answer: {extra!r}"
                        break
                    client.start_next_cycle()
                    _expect(client, methods, answered)
                # else the answer said connection: close (MUST_CLOSE): only EOF may follow
            elif isinstance(event, h11.InformationalResponse):
                assert event.status_code == 100
    except h11.RemoteProtocolError as exc:
        raise AssertionError(f"malformed response after {answered} answers: {exc}") from None
    finally:
        sock.close()
    return answered, closed


def _expect(client: h11.Connection, methods: list[bytes], index: int) -> None:
    """Tell h11 (as if sent) the request whose answer comes next, so it frames it right."""
    if index < len(methods):
        method = b"HEAD" if methods[index] == b"HEAD" else b"GET"
        client.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
        client.send(h11.EndOfMessage())


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(conversation=conversations())
def test_every_request_gets_one_answer_or_a_close(fuzz_gateway: GatewayProcess,
                                                  conversation: tuple) -> None:
    reqs, writes = conversation
    methods = [method for _, request_methods, _ in reqs for method in request_methods]
    answered, closed = talk(fuzz_gateway, methods, writes)
    assert answered == len(methods) or closed


def test_the_worker_survived_the_fuzzing(fuzz_gateway: GatewayProcess) -> None:
    stats = httpx.get(f"{fuzz_gateway.admin_url}/stats", timeout=5).json()
    (worker,) = stats["workers"]
    assert worker["restarts"] == 0
    assert httpx.get(f"{fuzz_gateway.base_url}/healthz", timeout=5).status_code == 200
    log = fuzz_gateway.log()
    assert "request handling failed" not in log and "Traceback" not in log, log[-3000:]

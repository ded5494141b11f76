"""Fuzzing the ingress of a real worker with hypothesis-generated HTTP/1.1 traffic.

One gateway per ingress parser (native, and httptools with VELOX_NATIVE=0; one worker, the
mock behind it) receives generated requests on fresh connections: methods, targets (good,
unnormalised, absolute-form, garbage), versions (HTTP/0.9's version-less line and HTTP/2.0
included), Host fields (one, none, two, invalid), headers (framing, upgrades, expectations,
trailers, more than 100 fields), bodies sent with content-length, chunked in random chunk
sizes, or mis-framed, several pipelined on one connection, and the bytes split at random
points or sent one byte at a time. The invariants: each request gets exactly one well-formed
HTTP/1.1 answer (h11 parses the response stream strictly) or the connection is closed before
it, nothing arrives that no request asked for, nothing hangs (VELOX_BODY_TIMEOUT_MS is short
here, so a request left incomplete gets its 408 quickly), and a request RFC 9112 says to refuse
(no Host on HTTP/1.1, two Hosts or an invalid one, chunked HTTP/1.0, a version other than 1.0
and 1.1) or with more than 100 header fields is never served. At the end the worker is the
same process and /healthz answers.

`make test` runs a bounded number of examples; VELOX_FUZZ_EXAMPLES=2000 runs more.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Iterator

import h11
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from velox_lab.launch import GatewayProcess
from velox_lab.mock import MockUpstream

from .conftest import gateway_env

EXAMPLES = int(os.environ.get("VELOX_FUZZ_EXAMPLES", "120"))
# A request left incomplete is answered 408 within this plus one 0.25 s tick.
BODY_TIMEOUT_MS = 300
READ_DEADLINE_S = 5.0


@pytest.fixture(scope="module", params=["native", "httptools"])
def fuzz_gateway(request: pytest.FixtureRequest, upstream: MockUpstream,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    log = tmp_path_factory.mktemp(f"fuzz-{request.param}") / "velox.log"
    env = gateway_env(upstream, VELOX_WORKERS="1", VELOX_BODY_TIMEOUT_MS=str(BODY_TIMEOUT_MS),
                      VELOX_MAX_BODY_BYTES="100000", VELOX_MAX_HEADER_BYTES="4096",
                      VELOX_NATIVE="1" if request.param == "native" else "0")
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
    b"http://h/v1/chat/completions", b"HTTPS://h:443/v1/embeddings", b"http://u@h/v1/models",
    b"http://h", b"http:///v1/models",
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
]) | TOKEN.filter(lambda name: name.lower() != b"host")  # Host fields come from HOSTS
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
    b"\r\n".join(b"f%d: 1" % i for i in range(120)),  # more than 100 fields
    b"\r\n".join(b"f%d: 1" % i for i in range(90)),
])
# Host fields, and whether they make the request one to refuse (RFC 9112 §3.2).
HOSTS = st.sampled_from([
    ([b"host: x"], False), ([b"host: x"], False), ([b"Host: 127.0.0.1:8080"], False),
    ([b"host: [::1]"], False), ([], None), ([b"host: x", b"host: x"], True),
    ([b"host: a/b"], True), ([b"host: u@h"], True), ([b"host: a b"], True),
])
# (version, refused whatever else the request says): b"" is HTTP/0.9's version-less line.
VERSIONS = st.sampled_from([(b"HTTP/1.1", False)] * 6 + [
    (b"HTTP/1.0", False), (b"HTTP/2.0", True), (b"HTTP/1.x", True), (b"HTTP/0.9", True),
    (b"", True)])
FRAMINGS = st.sampled_from(["length", "length", "chunked", "chunked", "none", "short", "long"])


@st.composite
def requests(draw: st.DrawFn) -> tuple[bytes, list[bytes], bool, list[bool]]:
    """(raw bytes, methods of the requests the gateway will see in them, complete, whether
    each of them must be refused): one request, mostly well framed."""
    method = draw(METHODS)
    target = draw(TARGETS)
    version, refuse = draw(VERSIONS)
    headers, bad_host = draw(HOSTS)
    headers = list(headers)
    refuse = refuse or bad_host or (bad_host is None and version == b"HTTP/1.1")
    for name, value in draw(st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=4)):
        headers.append(name + b": " + value)
    if draw(st.integers(0, 3)) == 0:
        special = draw(SPECIAL)
        headers.append(special)
        refuse = refuse or special.startswith(b"host:") or special.count(b"\r\n") >= 100
    body = draw(BODIES)
    framing = draw(FRAMINGS)
    complete = True
    methods = [method]
    if framing == "length":
        headers.append(b"content-length: %d" % len(body))
        payload = body
    elif framing == "chunked":
        headers.append(b"transfer-encoding: chunked")
        refuse = refuse or version == b"HTTP/1.0"  # faulty framing (RFC 9112 §6.1)
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
    line = b" ".join(part for part in (method, target, version) if part)
    raw = b"%b\r\n%b\r\n\r\n%b" % (line, b"\r\n".join(headers), payload)
    if not headers:
        raw = b"%b\r\n\r\n%b" % (line, payload)
    # The request that "long" framing's surplus body makes is not judged.
    return raw, methods, complete, [refuse] + [False] * (len(methods) - 1)


@st.composite
def conversations(draw: st.DrawFn) -> tuple[list[tuple[bytes, list[bytes], bool, list[bool]]],
                                            list[bytes]]:
    """Requests pipelined on one connection and the writes their bytes are split into."""
    if draw(st.integers(0, 19)) == 0:  # plain garbage
        garbage = draw(st.binary(min_size=1, max_size=200))
        # Empty lines between requests are ignored (RFC 9112 §2.2): no request, no answer.
        methods = [] if not garbage.strip(b"\r\n") else [b"GET"]
        reqs = [(garbage, methods, True, [False] * len(methods))]
    else:
        reqs = draw(st.lists(requests(), min_size=1, max_size=3))
        # An incomplete request holds the connection until its 408: nothing may follow it.
        for i, (_, _, complete, _) in enumerate(reqs):
            if not complete:
                reqs = reqs[:i + 1]
                break
    data = b"".join(r[0] for r in reqs)
    if len(data) <= 300 and draw(st.integers(0, 9)) == 0:
        writes = [data[i:i + 1] for i in range(len(data))]  # every byte boundary
    else:
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=6))))
        bounds = [0, *cuts, len(data)]
        writes = [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]
    return reqs, writes


# --- the invariant --------------------------------------------------------------------------


def talk(gw: GatewayProcess, methods: list[bytes], writes: list[bytes],
         ) -> tuple[list[int], bool]:
    """Send the writes, then read until every request is answered or the connection closes.
    Returns (the final responses' statuses, closed). Fails on malformed responses, extra
    responses, or a connection left open with requests unanswered after READ_DEADLINE_S."""
    client = h11.Connection(h11.CLIENT, max_incomplete_event_size=1 << 20)
    sock = socket.create_connection((gw.host, gw.port), timeout=READ_DEADLINE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    statuses: list[int] = []
    closed = False
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
            return [], False
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
                    raise AssertionError(f"hung: {len(statuses)} of {len(methods)} answered, "
                                         "connection open") from None
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
                assert len(statuses) < len(methods), "a response nobody asked for"
                statuses.append(event.status_code)
            elif isinstance(event, h11.EndOfMessage):
                if client.our_state is h11.DONE and client.their_state is h11.DONE:
                    if len(statuses) == len(methods):
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
                    _expect(client, methods, len(statuses))
                # else the answer said connection: close (MUST_CLOSE): only EOF may follow
            elif isinstance(event, h11.InformationalResponse):
                assert event.status_code == 100
    except h11.RemoteProtocolError as exc:
        raise AssertionError(f"malformed response after {len(statuses)} answers: {exc}") from None
    finally:
        sock.close()
    return statuses, closed


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
    methods = [method for _, request_methods, _, _ in reqs for method in request_methods]
    refuse = [flag for _, _, _, flags in reqs for flag in flags]
    statuses, closed = talk(fuzz_gateway, methods, writes)
    assert len(statuses) == len(methods) or closed
    served = [status for status, must in zip(statuses, refuse,
                                             strict=False) if must and status < 400]
    assert not served, f"served what RFC 9112 or the field cap refuses: {statuses} {writes!r}"


@st.composite
def rfc_requests(draw: st.DrawFn) -> tuple[bytes, bytes, int]:
    """(method, raw bytes, the status it must get): a request the mock serves, with its
    version, Host fields, target form, framing and number of fields varied. The status follows
    the order the gateway checks them in: fields as they arrive (two Hosts or an invalid one:
    400; Transfer-Encoding on HTTP/1.0: 400; field 101: 431), then the head (a version other
    than 1.0 and 1.1: 505; no Host on HTTP/1.1: 400; an absolute-form target without a valid
    host[:port]: 400)."""
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0",
                                    b"HTTP/0.9", b""]))
    hosts, host_error = draw(st.sampled_from([
        ([b"Host: h"], False), ([b"host: 127.0.0.1:8080"], False), ([b"HOST: [::1]:1 "], False),
        ([b"Host:"], False), ([], False), ([b"Host: h", b"host: h"], True),
        ([b"host: a/b"], True), ([b"Host: u@h"], True)]))
    origin, authority_error = draw(st.sampled_from([
        (b"", False), (b"", False), (b"http://h", False), (b"HTTPS://api.example.com:443", False),
        (b"http://[::1]:8080", False), (b"http://u@h", True), (b"http://", True)]))
    chat = draw(st.booleans())
    chunked = chat and draw(st.booleans())
    if chat:
        method, path = b"POST", b"/v1/chat/completions"
        body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
        framing = ([b"transfer-encoding: chunked"] if chunked
                   else [b"content-length: %d" % len(body)])
        payload = (b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)) if chunked else body
        framing.append(b"content-type: application/json")
    else:
        method, path, framing, payload = b"GET", b"/v1/models", [], b""
    extra = draw(st.one_of(st.integers(0, 3), st.integers(96, 100)))
    fields = hosts + framing + [b"f%d: 1" % i for i in range(extra)]
    if host_error or (chunked and version == b"HTTP/1.0"):
        status = 400
    elif len(fields) > 100:
        status = 431
    elif version not in (b"HTTP/1.1", b"HTTP/1.0"):
        status = 505
    elif (not hosts and version == b"HTTP/1.1") or authority_error:
        status = 400
    else:
        status = 200
    line = b" ".join(part for part in (method, origin + path, version) if part)
    raw = b"%b\r\n%b\r\n%b" % (line, b"".join(f + b"\r\n" for f in fields), payload)
    return method, raw, status


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(request=rfc_requests(), cuts=st.lists(st.integers(1, 4000), max_size=3))
def test_rfc9112_variations_get_their_exact_answer(fuzz_gateway: GatewayProcess,
                                                  request: tuple[bytes, bytes, int],
                                                  cuts: list[int]) -> None:
    method, raw, status = request
    bounds = [0, *sorted({c for c in cuts if c < len(raw)}), len(raw)]
    statuses, closed = talk(fuzz_gateway, [method],
                            [raw[a:b] for a, b in itertools.pairwise(bounds) if b > a])
    assert statuses == [status], raw
    assert closed or status == 200, raw


def test_the_worker_survived_the_fuzzing(fuzz_gateway: GatewayProcess) -> None:
    stats = httpx.get(f"{fuzz_gateway.admin_url}/stats", timeout=5).json()
    (worker,) = stats["workers"]
    assert worker["restarts"] == 0
    assert httpx.get(f"{fuzz_gateway.base_url}/healthz", timeout=5).status_code == 200
    log = fuzz_gateway.log()
    assert "request handling failed" not in log and "Traceback" not in log, log[-3000:]

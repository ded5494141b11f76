"""Ingress hardening against a real gateway: memory follows the bytes that arrived, requests
must arrive within VELOX_BODY_TIMEOUT_MS, unnormalised paths, upgrades, trailers, transfer
codings, and running out of file descriptors.

Clients here are raw sockets on 127.0.0.1 (the SDK cannot send these requests) plus the
`openai` SDK for the requests that must keep being served meanwhile.
"""

from __future__ import annotations

import hashlib
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import orjson
import psutil
import pytest

from velox_lab.launch import GatewayProcess
from velox_lab.mock import MockUpstream

from .conftest import GatewayFactory, client_for, wait_for

MESSAGES = [{"role": "user", "content": "hello"}]


# --- raw HTTP/1.1 helpers -------------------------------------------------------------------


def connect(gw: GatewayProcess, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection((gw.host, gw.port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[bytes, bytes], bytes]:
    """One response with a content-length body: (status, headers, body). Fails on EOF first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed before a response: {data!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get(b"content-length", b"0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError("connection closed inside a response body")
        rest += chunk
    return status, headers, rest[:length]


def is_closed(sock: socket.socket, timeout: float = 5.0) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def exchange(gw: GatewayProcess, raw_request: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    with connect(gw) as sock:
        sock.sendall(raw_request)
        return read_response(sock)


def error_code(body: bytes) -> str:
    return orjson.loads(body)["error"]["code"]


def worker_pid(gw: GatewayProcess) -> int:
    stats = httpx.get(f"{gw.admin_url}/stats", timeout=5).json()
    (worker,) = stats["workers"]
    return worker["pid"]


def metric(gw: GatewayProcess, name: str) -> float:
    text = httpx.get(f"{gw.admin_url}/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:_total)?{{[^}}]*}} (\S+)$", text, re.M))


@contextmanager
def many(n: int, gw: GatewayProcess) -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            socks.append(connect(gw))
        yield socks
    finally:
        for s in socks:
            s.close()


# --- finding 2: declared bodies, slow bodies, slow headers ----------------------------------

DECLARED = 16_000_000


def test_declared_body_sizes_cost_no_memory(start_gateway: GatewayFactory) -> None:
    """60 requests declaring 16 MB bodies and sending one byte leave the worker's RSS near
    idle: memory follows the bytes that arrived (before: 60 x 16 MB zero-filled buffers)."""
    gw = start_gateway(VELOX_WORKERS="1", VELOX_BODY_TIMEOUT_MS="60000")
    proc = psutil.Process(worker_pid(gw))
    client = client_for(gw)
    client.chat.completions.create(model="m", messages=MESSAGES)  # warm: first-request costs
    idle = proc.memory_info().rss
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n{" % DECLARED)
    with many(60, gw) as socks:
        for sock in socks:
            sock.sendall(head)
        # The worker has read everything sent before it answers a request sent after it.
        reply = client.chat.completions.create(model="m", messages=MESSAGES)
        assert reply.choices[0].message.content
        time.sleep(0.3)
        grown = proc.memory_info().rss - idle
        assert grown < 8 * 1024 * 1024, f"worker grew by {grown / 2**20:.0f} MiB"
    assert proc.pid == worker_pid(gw)


def test_a_large_body_arriving_in_pieces_is_forwarded_whole(
        start_gateway: GatewayFactory, upstream: MockUpstream) -> None:
    """The growing buffer assembles a multi-megabyte body sent in uneven pieces byte-exactly."""
    gw = start_gateway(VELOX_WORKERS="1")
    pad = bytes(range(97, 123)) * 40_000  # ~1 MB of a-z
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + pad + b'"}]}'
    with connect(gw) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
        at, step = 0, 1
        while at < len(body):
            sock.sendall(body[at:at + step])
            at += step
            step = min(step * 3 + 7, 200_000)
        status, _, reply = read_response(sock)
    assert status == 200, reply
    digest = hashlib.sha256(body).hexdigest()
    assert any(r["body_sha256"] == digest and r["body_length"] == len(body)
               for r in upstream.requests(20))


def test_slow_body_gets_408_at_the_deadline_while_others_are_served(
        start_gateway: GatewayFactory) -> None:
    gw = start_gateway(VELOX_WORKERS="1", VELOX_BODY_TIMEOUT_MS="1500")
    client = client_for(gw)
    slow = connect(gw)
    started = time.monotonic()
    slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n{")
    served = 0
    slow.settimeout(0.2)
    answer = b""
    # Trickle a byte every 0.2 s (each refreshes the idle clock) and keep other clients busy.
    while time.monotonic() - started < 8:
        try:
            answer = slow.recv(65536)
            break
        except TimeoutError:
            pass
        slow.sendall(b" ")
        reply = client.chat.completions.create(model="m", messages=MESSAGES)
        served += bool(reply.choices[0].message.content)
    took = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b'"request_timeout"' in answer
    assert 1.4 < took < 4.0, took
    assert served >= 3
    assert is_closed(slow)
    slow.close()
    assert metric(gw, "velox_request_receive_timeouts") == 1


def test_slow_headers_get_408_at_the_deadline(start_gateway: GatewayFactory) -> None:
    gw = start_gateway(VELOX_WORKERS="1", VELOX_BODY_TIMEOUT_MS="1000")
    request = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 40 + b"\r\n\r\n"
    with connect(gw) as sock:
        sock.settimeout(0.25)
        started = time.monotonic()
        answer = b""
        for byte in request[:-4]:  # never complete the headers
            sock.sendall(bytes([byte]))
            try:
                answer = sock.recv(65536)
                break
            except TimeoutError:
                if time.monotonic() - started > 8:
                    break
        took = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert 0.9 < took < 4.0, took
        assert is_closed(sock)
    # The same worker keeps serving.
    assert client_for(gw).models.list().data


# --- keep-alive: the idle time of a connection starts when its answer is written ---------


def test_a_connection_is_kept_alive_for_the_timeout_after_a_slow_answer(
        start_gateway: GatewayFactory) -> None:
    # A model answering in 6 s, the keep-alive timeout 5 s: the connection is idle from the
    # end of its answer. Counted from the request's arrival instead, the worker's first tick
    # after the answer (<= 0.25 s) closed it, just as a client sent its next request on it
    # (an SDK reusing its pooled connection), which then got a reset.
    gw = start_gateway(VELOX_WORKERS="1", VELOX_KEEPALIVE_TIMEOUT_S="5")
    body = orjson.dumps({"model": "m", "messages": MESSAGES})
    with connect(gw, timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\nx-mock-latency-ms: 6000\r\n"
                     b"content-length: %d\r\n\r\n" % len(body) + body)
        status, _, reply = read_response(sock)
        answered = time.monotonic()
        assert status == 200, reply
        assert is_closed(sock, timeout=30)  # the timeout does close it, once idle
        idle = time.monotonic() - answered
    # 5 s after the gateway wrote the answer, less the moments this client took to read it
    # on a busy host: well above 2.5 s, where the bug closed it within a tick.
    assert idle > 2.5, f"closed {idle:.2f} s after the answer"


# --- finding 6: unnormalised paths ----------------------------------------------------------

BAD_PATHS = [
    b"/v1/../x", b"/v1/%2e%2e/x", b"/v1/%2E%2E/x", b"/v1/chat/completions/../../x",
    b"/v1//host/x", b"/v1/chat/completions/", b"/v1/chat/completions;x", b"/v1/a%2fb",
    b"/v1/a%5Cb", b"/v1/a\\b", b"/v1/./models", b"/v1/models/.",
]


def test_unnormalised_paths_are_400_and_never_reach_the_upstream(
        gateway: GatewayProcess, upstream: MockUpstream) -> None:
    for path in BAD_PATHS:
        for method in (b"GET", b"POST"):
            status, _, body = exchange(gateway, method + b" " + path + b" HTTP/1.1\r\nhost: x\r\n"
                                       b"content-length: 2\r\n\r\n{}")
            assert (status, error_code(body)) == (400, "invalid_path"), (method, path, body)
    seen = {r["path"] for r in upstream.requests(200)}
    assert not seen & {p.decode("latin-1") for p in BAD_PATHS}
    # Query strings stay allowed, and normal paths are untouched.
    status, _, body = exchange(gateway, b"GET /v1/models?after=a/../b HTTP/1.1\r\nhost: x\r\n\r\n")
    assert status == 200, body


# --- finding 11: upgrades -------------------------------------------------------------------


@pytest.mark.parametrize("upgrade", [
    b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\nhttp2-settings: AAMAAABkAAQAAP__\r\n",
    b"connection: upgrade\r\nupgrade: websocket\r\nsec-websocket-version: 13\r\n"
    b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n",
])
def test_protocol_upgrades_get_400(gateway: GatewayProcess, upgrade: bytes) -> None:
    for target in (b"/v1/models", b"/healthz"):
        with connect(gateway) as sock:
            sock.sendall(b"GET " + target + b" HTTP/1.1\r\nhost: x\r\n" + upgrade + b"\r\n")
            status, headers, body = read_response(sock)
            assert (status, error_code(body)) == (400, "bad_http_request"), body
            assert headers.get(b"connection") == b"close"
            assert is_closed(sock)


# --- finding 12: trailers -------------------------------------------------------------------


def test_trailer_fields_are_not_forwarded(gateway: GatewayProcess, upstream: MockUpstream) -> None:
    body = orjson.dumps({"model": "trailer-test", "messages": MESSAGES})
    half = len(body) // 2
    chunked = b"%x\r\n%b\r\n%x\r\n%b\r\n0\r\nx-smuggled: yes\r\nx-trailer-two: 2\r\n\r\n" % (
        half, body[:half], len(body) - half, body[half:])
    status, _, reply = exchange(gateway, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                                b"content-type: application/json\r\ntrailer: x-smuggled\r\n"
                                b"transfer-encoding: chunked\r\nx-header: kept\r\n\r\n" + chunked)
    assert status == 200, reply
    entry = next(r for r in reversed(upstream.requests(50)) if r["path"] == "/v1/chat/completions")
    names = {name for name, _ in entry["headers"]}
    assert "x-header" in names
    assert not names & {"x-smuggled", "x-trailer-two", "trailer"}


# --- finding 14: unknown transfer codings ---------------------------------------------------


@pytest.mark.parametrize("coding", [b"gzip, chunked", b"deflate,chunked", b"chunked, gzip"])
def test_transfer_codings_other_than_chunked_get_501(gateway: GatewayProcess,
                                                     coding: bytes) -> None:
    with connect(gateway) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: "
                     + coding + b"\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
        try:
            status, _, body = read_response(sock)
        except AssertionError:
            # llhttp itself refuses a request whose final coding is not chunked (400).
            pytest.fail(f"no answer for {coding!r}")
        if coding.endswith(b"chunked"):
            assert (status, error_code(body)) == (501, "unsupported_transfer_coding"), body
        else:
            assert status in (400, 501), body
        assert is_closed(sock)


# --- finding 16: out of file descriptors ----------------------------------------------------


def _lists_models(gw: GatewayProcess) -> bool:
    try:
        return bool(client_for(gw).models.list().data)
    except openai.APIConnectionError:
        return False


def test_running_out_of_descriptors_is_logged_counted_and_recovered(
        start_gateway: GatewayFactory) -> None:
    gw = start_gateway(VELOX_WORKERS="1")
    proc = psutil.Process(worker_pid(gw))
    soft, hard = proc.rlimit(psutil.RLIMIT_NOFILE)
    limit = proc.num_fds() + 20
    proc.rlimit(psutil.RLIMIT_NOFILE, (limit, hard))
    try:
        with many(40, gw) as socks:
            wait_for(lambda: metric(gw, "velox_fd_exhausted") >= 1, timeout=10)
            # Some of the 40 were accepted and closed by the worker (reset) without an answer.
            answered = 0
            for sock in socks:
                try:
                    sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
                    sock.settimeout(3)
                    answered += read_response(sock)[0] == 200
                except (OSError, AssertionError):
                    pass
            assert 0 < answered < 40
        # Descriptors are free again: the worker accepts and serves new clients. The first
        # try may still meet the worker before it has read the 40 clients' EOFs and closed
        # their descriptors (accepted, then closed for want of one, as under the flood): the
        # recovery is that a try succeeds soon, not that the very first one does.
        wait_for(lambda: _lists_models(gw), timeout=30)
        wait_for(lambda: "has file descriptors again" in gw.log(), timeout=10)
        assert "out of file descriptors" in gw.log()
        assert proc.pid == worker_pid(gw)
    finally:
        proc.rlimit(psutil.RLIMIT_NOFILE, (soft, hard))


# --- found by the fuzz test (tests/e2e/test_fuzz_ingress.py) ---------------------------------


def test_a_bad_request_pipelined_behind_a_good_one_waits_its_turn(
        gateway: GatewayProcess) -> None:
    """The good request is answered first, then the 400, then the connection closes (before:
    the connection was closed at once and the good request never got its answer)."""
    body = orjson.dumps({"model": "m", "messages": MESSAGES})
    with connect(gateway) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)
                     + b"GET /v1/models HTTP/1.1\r\nhost: x\r\nbad header\r\n\r\n")
        sock.settimeout(10)
        data = b""
        while chunk := sock.recv(65536):  # until the gateway closes
            data += chunk
    first, _, rest = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", first).group(1))  # type: ignore[union-attr]
    second = rest[length:]
    assert first.startswith(b"HTTP/1.1 200 "), data
    assert second.startswith(b"HTTP/1.1 400 ") and b'"bad_http_request"' in second, data


def test_a_refused_head_request_gets_no_body(gateway: GatewayProcess) -> None:
    with connect(gateway) as sock:
        sock.sendall(b"HEAD /v1/models HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\n"
                     b"upgrade: websocket\r\n\r\n")
        sock.settimeout(5)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), data
    assert b"content-length: " in head and rest == b""

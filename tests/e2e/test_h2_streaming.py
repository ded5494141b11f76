"""Streams over the HTTP/2 + TLS upstream, end to end, on both codecs: the native one (a
stream's plain DATA written to the client from C, H2Client.direct) and the Python framer
(VELOX_NATIVE=0).

Real gateway processes, the bundled mock over TLS (ALPN h2), the official openai SDK. The tests
of the HTTP/1.1 streaming module run here against the HTTP/2 upstream (the client sees exactly
the chunks the mock sends it directly, with and without include_usage; exact tokens; the access
log's bytes; a client leaving mid-stream; concurrent streams); and two of HTTP/2's own: a client
that reads nothing while a long stream passes the gateway (its writes pause: the codec withholds
credit and the rest goes through Python's send queue) still gets every byte, in order, and the
access log counts exactly what it got; 64 streams at once on two upstream connections (frames of
many streams in one read) all arrive whole.
"""

from __future__ import annotations

import concurrent.futures as cf
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import client_for, wait_for
from tests.e2e.test_h1_streaming import (  # noqa: F401 - collected here, on HTTP/2
    MESSAGES,
    PACED,
    one_worker,
    test_a_stream_the_client_leaves_is_charged_alike_on_both_readers,
    test_many_concurrent_streams_all_complete,
    test_streams_relay_the_upstreams_chunks_and_count_its_usage,
    test_the_access_log_counts_the_bytes_the_client_received,
)
from tests.e2e.test_slow_clients import read_all, request_bytes
from tests.e2e.test_tokens import access_lines
from velox_lab.launch import GatewayProcess
from velox_lab.mock import MockUpstream


@pytest.fixture
def plain_mock(upstream: MockUpstream) -> MockUpstream:
    """The HTTP/1.1 module's tests take their upstream by this name: here the TLS (h2) mock."""
    return upstream


@pytest.fixture(params=["native", "framer"])
def gw(request: pytest.FixtureRequest, upstream: MockUpstream,
       tmp_path: Path) -> Iterator[GatewayProcess]:
    yield from one_worker(upstream, "h2", request.param == "native", tmp_path)


def test_a_client_that_reads_nothing_while_the_stream_passes_gets_it_all_in_order(
        gw: GatewayProcess) -> None:
    chunks = 3000
    data = request_bytes("/v1/chat/completions", {
        "model": "gpt-4o", "messages": MESSAGES, "stream": True,
        "stream_options": {"include_usage": True}}, f"x-mock-chunks: {chunks}\r\n")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # its writes pause soon
    try:
        sock.connect((gw.host, gw.port))
        sock.sendall(data)
        # The upstream's stream is over (the request finished) before the client reads a byte.
        line = wait_for(lambda: [a for a in access_lines(gw)
                                 if a["path"] == "/v1/chat/completions"], timeout=60)[-1]
        sock.shutdown(socket.SHUT_WR)
        got, reset = read_all(sock)
    finally:
        sock.close()
    assert not reset and got.startswith(b"HTTP/1.1 200 OK")
    head, _, body = got.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    events = _unchunk(body).split(b"\n\n")
    contents = [e for e in events if e.startswith(b"data: {")]
    assert events[-2:] == [b"data: [DONE]", b""]
    assert len(contents) == chunks + 1  # every chunk, and the usage the client asked for
    assert all(b'"index":0' in e for e in contents[:-1])
    assert b'"completion_tokens":' in contents[-1]
    assert line["bytes_out"] == len(got), (line, len(got))  # head and framed body, exactly


def test_sixty_four_streams_at_once_on_two_connections_all_arrive_whole(
        gw: GatewayProcess) -> None:
    client = client_for(gw)

    def one(i: int) -> tuple[str, int]:
        chunks = list(client.chat.completions.create(
            model="gpt-4o", stream=True,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": f"stream {i}"}],
            stream_options={"include_usage": True}, extra_headers=PACED))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage is not None
        return text, chunks[-1].usage.completion_tokens

    with cf.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(64)))
    assert all(text and n > 0 for text, n in results)
    lines = wait_for(lambda: (lambda ls: ls if len(ls) >= 64 else None)(
        [a for a in access_lines(gw) if a["path"] == "/v1/chat/completions"]))
    assert all(a["status"] == 200 and a["usage"]["exact"] for a in lines)


def _unchunk(data: bytes) -> bytes:
    body = b""
    while data:
        size, _, rest = data.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return body
        body, data = body + rest[:n], rest[n + 2:]
    raise AssertionError("the chunked body did not end")

"""Ingress without sockets: a ClientConnection fed bytes directly, its answers caught by a fake
transport and its complete requests by a fake ring. The same behaviour is tested against real
gateways in tests/e2e/test_hardening_ingress.py; these pin down the logic byte by byte."""

from __future__ import annotations

import sys
import time

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from benches._pipeline import FakeTransport
from velox._types import Request
from velox.config import load
from velox.ingress import ClientConnection, IngressState
from velox.route import Auth


class FakeRing:
    def __init__(self) -> None:
        self.pushed: list[Request] = []

    def try_push(self, request: Request) -> bool:
        self.pushed.append(request)
        return True


def make_conn(max_body: int = 16 * 1024 * 1024) -> tuple[ClientConnection, FakeTransport,
                                                          FakeRing]:
    ring = FakeRing()
    state = IngressState(None, ring, lambda: None, None,  # type: ignore[arg-type]
                         Auth(load({}, dotenv=None)), max_body, 64 * 1024, lambda: True,
                         lambda request, status, size: None)
    conn = ClientConnection(state)
    transport = FakeTransport(keep=True)
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport, ring


def status_of(transport: FakeTransport) -> tuple[int, dict]:
    data = b"".join(transport.chunks)
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), orjson.loads(body)


def test_a_declared_length_allocates_nothing_until_bytes_arrive() -> None:
    conn, transport, ring = make_conn()
    conn.data_received(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                       b"content-length: 16000000\r\n\r\n{")
    assert conn._assembled is not None
    assert sys.getsizeof(conn._assembled) < 4096  # was a zero-filled 16 MB bytearray
    assert not ring.pushed and not transport.chunks


@settings(max_examples=60, deadline=None)
@given(pattern=st.binary(min_size=1, max_size=64),
       size=st.integers(min_value=64 * 1024 + 1, max_value=300 * 1024),
       cuts=st.lists(st.integers(min_value=1, max_value=70_000), max_size=12))
def test_a_large_body_is_assembled_exactly_however_it_is_split(pattern: bytes, size: int,
                                                               cuts: list[int]) -> None:
    # Past the 64 KiB threshold the body goes to the growing buffer, not the chunk list.
    body = (pattern * (size // len(pattern) + 1))[:size]
    conn, _, ring = make_conn()
    data = b"POST /v1/files HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%b" % (
        len(body), body)
    at = 0
    for cut in cuts:
        conn.data_received(data[at:at + cut])
        at += cut
    conn.data_received(data[at:])
    (request,) = ring.pushed
    assert bytes(request.body) == body


def test_trailer_fields_are_dropped() -> None:
    conn, _, ring = make_conn()
    conn.data_received(b"POST /v1/files HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
                       b"x-a: 1\r\n\r\n"
                       b"2\r\n{}\r\n0\r\nx-trailer: smuggled\r\nauthorization: Bearer x\r\n\r\n")
    (request,) = ring.pushed
    assert [name for name, _ in request.headers] == [b"host", b"transfer-encoding", b"x-a"]
    assert bytes(request.body) == b"{}"


def test_receive_deadline_runs_from_the_first_byte_to_the_end_of_the_message() -> None:
    conn, transport, ring = make_conn()
    assert conn.receiving_since == 0.0
    before = time.monotonic()
    conn.data_received(b"P")
    started = conn.receiving_since
    assert started >= before
    conn.data_received(b"OST /v1/files HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\n{}")
    assert conn.receiving_since == started  # more bytes do not refresh it
    conn.data_received(b" ")
    assert conn.receiving_since == 0.0 and len(ring.pushed) == 1


def test_an_expired_request_gets_408_and_the_connection_closes() -> None:
    conn, transport, ring = make_conn()
    conn.data_received(b"POST /v1/files HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")
    conn.expire_receive()
    status, body = status_of(transport)
    assert (status, body["error"]["code"]) == (408, "request_timeout")
    assert transport.closed and not ring.pushed
    assert conn.state.receive_timeouts == 1


def test_transfer_codings_other_than_chunked_are_501() -> None:
    conn, transport, ring = make_conn()
    conn.data_received(b"POST /v1/files HTTP/1.1\r\ntransfer-encoding: gzip, chunked\r\n\r\n"
                       b"2\r\n{}\r\n0\r\n\r\n")
    status, body = status_of(transport)
    assert (status, body["error"]["code"]) == (501, "unsupported_transfer_coding")
    assert transport.closed and not ring.pushed


def test_upgrades_are_400_before_the_request_is_dispatched() -> None:
    conn, transport, ring = make_conn()
    conn.data_received(b"GET /v1/models HTTP/1.1\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n")
    status, body = status_of(transport)
    assert (status, body["error"]["code"]) == (400, "bad_http_request")
    assert transport.closed and not ring.pushed


def _streaming_conn(loop: object) -> tuple[ClientConnection, FakeTransport, Request]:
    conn, transport, ring = make_conn()
    conn.state.loop = loop  # type: ignore[assignment]
    body = b'{"model":"m","stream":true}'
    conn.data_received(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                       b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    assert len(ring.pushed) == 1
    return conn, transport, ring.pushed[0]


def test_a_streams_chunks_of_one_loop_pass_go_out_in_one_write() -> None:
    import asyncio

    from velox import h1write
    from velox.h1write import H1_CHUNKED, STATUS_LINES

    loop = asyncio.new_event_loop()
    try:
        conn, transport, request = _streaming_conn(loop)
        headers = [(b"content-type", b"text/event-stream")]
        events = [b"data: {\"a\":1}\n\n", b"data: {\"b\":2}\n\n", b"data: [DONE]\n\n"]

        async def upstream_reads() -> None:
            # One upstream read: the head and two events, dispatched in one callback.
            conn.start_stream(request, 200, headers)
            conn.send_chunk(events[0])
            conn.send_chunk(events[1])
            assert transport.chunks == []  # nothing written before the pass ends
            await asyncio.sleep(0)
            # The next read: the last event and the end of the stream, in one write.
            conn.send_chunk(events[2])
            conn.end_stream()

        loop.run_until_complete(upstream_reads())
        loop.run_until_complete(asyncio.sleep(0))  # the flush of the second pass finds nothing
    finally:
        loop.close()
    head = h1write.py_head(STATUS_LINES[200], headers, 0, H1_CHUNKED)
    # The bytes the per-chunk writer sent, now in two writes instead of five.
    assert transport.chunks == [head + h1write.py_chunks(events[:2]),
                                h1write.py_chunks(events[2:], last=True)]
    assert conn.current is None  # answered: the connection is ready for the next request


def test_an_aborted_stream_drops_its_queued_bytes() -> None:
    import asyncio

    loop = asyncio.new_event_loop()
    try:
        conn, transport, request = _streaming_conn(loop)

        async def run() -> None:
            conn.start_stream(request, 200, [(b"content-type", b"text/event-stream")])
            conn.send_chunk(b"data: x\n\n")
            conn.abort()
            await asyncio.sleep(0)

        loop.run_until_complete(run())
    finally:
        loop.close()
    assert transport.chunks == [] and transport.closed

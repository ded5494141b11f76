"""Ingress without sockets: a ClientConnection fed bytes directly, its answers caught by a fake
transport and its complete requests by a fake ring. The same behaviour is tested against real
gateways in tests/e2e/test_hardening_ingress.py; these pin down the logic byte by byte."""

from __future__ import annotations

import hashlib
import sys
import time

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velox.config.settings import load
from velox.core.types import Request
from velox.ingress.arena import Arena
from velox.ingress.auth import Auth, caller_of
from velox.ingress.connection import WHOLE_BYTES, ClientConnection, IngressState
from velox_lab.pipeline import FakeTransport

from ..ends import RecordingEnds, sent


class FakeRing:
    def __init__(self) -> None:
        self.pushed: list[Request] = []

    def try_push(self, request: Request) -> bool:
        self.pushed.append(request)
        return True


def make_conn(max_body: int = 16 * 1024 * 1024, parser: str = "native",
              **env: str) -> tuple[ClientConnection, FakeTransport, FakeRing]:
    ring = FakeRing()
    state = IngressState(None, ring, lambda: None, Arena(0),  # type: ignore[arg-type]
                         Auth(load(env, dotenv=None)), max_body, 64 * 1024, lambda: True,
                         None, parser == "native")
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
    conn, _transport, ring = make_conn()
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
    conn.data_received(b"POST /v1/files HTTP/1.1\r\nhost: x\r\n"
                       b"transfer-encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
    status, body = status_of(transport)
    assert (status, body["error"]["code"]) == (501, "unsupported_transfer_coding")
    assert transport.closed and not ring.pushed


def test_upgrades_are_400_before_the_request_is_dispatched() -> None:
    conn, transport, ring = make_conn()
    conn.data_received(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\n"
                       b"upgrade: h2c\r\n\r\n")
    status, body = status_of(transport)
    assert (status, body["error"]["code"]) == (400, "bad_http_request")
    assert transport.closed and not ring.pushed


@pytest.mark.parametrize("parser", ["native", "httptools"])
def test_two_authorization_fields_are_400_on_both_parsers(parser: str) -> None:
    # The key check read the last one while the cache's partition read the first: a request
    # naming two credentials is refused, whatever the parser.
    conn, transport, ring = make_conn(parser=parser, VELOX_API_KEYS="ka,kb")
    conn.data_received(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                       b"authorization: Bearer ka\r\nAuthorization: Bearer kb\r\n"
                       b"content-length: 2\r\n\r\n{}")
    status, body = status_of(transport)
    assert (status, body["error"]["type"], body["error"]["param"]) == \
        (400, "invalid_request_error", "authorization")
    assert transport.closed and not ring.pushed


@pytest.mark.parametrize("parser", ["native", "httptools"])
def test_the_callers_identity_is_the_key_that_was_checked(parser: str) -> None:
    # An Azure-style api-key before the checked Authorization named the cache partition.
    conn, _, ring = make_conn(parser=parser, VELOX_API_KEYS="ka,kb")
    conn.data_received(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\napi-key: ka\r\n"
                       b"authorization: Bearer kb\r\ncontent-length: 2\r\n\r\n{}")
    (request,) = ring.pushed
    assert caller_of(request) == hashlib.sha256(b"kb").digest()
    # Keyless: the credential the upstream gets (Authorization), whatever the order.
    conn, _transport, ring = make_conn(parser=parser)
    conn.data_received(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\napi-key: x\r\n"
                       b"authorization: Bearer y\r\ncontent-length: 2\r\n\r\n{}")
    assert caller_of(ring.pushed[0]) == hashlib.sha256(b"y").digest()


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

    from velox.ingress import h1write
    from velox.ingress.h1write import H1_CHUNKED, STATUS_LINES

    loop = asyncio.new_event_loop()
    try:
        conn, transport, request = _streaming_conn(loop)
        headers = [(b"content-type", b"text/event-stream")]
        events = [b"data: {\"a\":1}\n\n", b"data: {\"b\":2}\n\n", b"data: [DONE]\n\n"]

        async def upstream_reads() -> None:
            # One upstream read: the head and two events, dispatched in one callback.
            conn.start_stream(sent(request), 200, headers)
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
            conn.start_stream(sent(request), 200, [(b"content-type", b"text/event-stream")])
            conn.send_chunk(b"data: x\n\n")
            conn.abort()
            await asyncio.sleep(0)

        loop.run_until_complete(run())
    finally:
        loop.close()
    assert transport.chunks == [] and transport.closed


# --- answers to clients that do not read: the send queue and the write deadline ----------------


class SlowClient(FakeTransport):
    """A transport whose client takes bytes only when told. Writes pile up in its buffer; past
    64 KiB the protocol is paused from inside write(), as uvloop does, and `read()` takes
    everything buffered and resumes it."""

    HIGH = 64 * 1024

    def __init__(self, conn: ClientConnection) -> None:
        super().__init__()
        self.conn = conn
        self.buffered: list[bytes] = []
        self.size = 0
        self.taken = bytearray()
        self.paused = False
        self.aborted = False
        self.peak = 0

    def write(self, data: bytes) -> None:
        self.buffered.append(bytes(data))
        self.size += len(data)
        self.peak = max(self.peak, self.size)
        if self.size > self.HIGH and not self.paused:
            self.paused = True
            self.conn.pause_writing()

    def read(self) -> None:
        self.taken += b"".join(self.buffered)
        self.buffered, self.size = [], 0
        if self.paused:
            self.paused = False
            self.conn.resume_writing()

    def abort(self) -> None:
        self.closed = self.aborted = True


def slow_conn(arena: Arena | None = None,
              ) -> tuple[ClientConnection, SlowClient, FakeRing, list[tuple[int, int]]]:
    ring = FakeRing()
    arena = Arena(0) if arena is None else arena  # an empty arena: every body its own buffer
    ends = RecordingEnds(arena)
    answered = ends.answered
    state = IngressState(None, ring, lambda: None, arena,  # type: ignore[arg-type]
                         Auth(load({}, dotenv=None)), 1 << 20, 64 * 1024, lambda: True, ends)
    conn = ClientConnection(state)
    transport = SlowClient(conn)
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport, ring, answered


CHAT_REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")


def test_a_large_answer_is_written_as_the_client_takes_it_from_the_body_itself() -> None:
    import gc
    import weakref

    from velox.ingress import h1write
    from velox.ingress.h1write import H1_LENGTH, STATUS_LINES

    conn, client, ring, answered = slow_conn()
    conn.data_received(CHAT_REQUEST + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    (request,) = ring.pushed
    body = memoryview(bytes(range(256)) * (24 * 1024))  # 6 MiB
    alive = weakref.ref(body)
    headers = [(b"content-type", b"application/json")]
    conn.respond(request, 200, headers, body)
    # The client reads nothing: the transport got its buffer's worth and one piece at most,
    # the rest waits in the send queue as the body object itself (nothing copied per client).
    assert client.size <= SlowClient.HIGH + 256 * 1024 + 1024
    assert conn.queued > len(body) - 512 * 1024 and conn.write_paused
    assert conn.stalled_since > 0.0
    del body
    gc.collect()
    assert alive() is not None  # held by the queue until written
    # The pipelined health check waits behind the answer (HTTP/1.1 answers in order).
    head = h1write.head(STATUS_LINES[200], headers, 6 << 20, H1_LENGTH)
    assert conn.current is request and answered == [(200, len(head) + (6 << 20))]
    while client.paused:
        client.read()
        assert client.peak <= SlowClient.HIGH + 256 * 1024 + 1024
    client.read()
    expected = h1write.response(STATUS_LINES[200], headers, bytes(range(256)) * (24 * 1024),
                                H1_LENGTH)
    health = bytes(client.taken[len(expected):])
    assert bytes(client.taken[:len(expected)]) == expected
    assert health.startswith(b"HTTP/1.1 200 OK") and health.endswith(b'{"status":"ok"}')
    gc.collect()
    assert alive() is None and conn.queued == 0 and conn.current is None
    assert conn.stalled_since == 0.0


def test_a_paused_client_gets_no_further_pipelined_answers_until_it_reads() -> None:
    conn, client, ring, answered = slow_conn()
    conn.data_received(CHAT_REQUEST + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
    (request,) = ring.pushed
    conn.respond(request, 200, [], b"x" * (WHOLE_BYTES + 1))  # written, transport paused
    assert client.paused and conn.current is None
    assert len(answered) == 1 and not conn.idle  # three health checks wait for the client
    client.read()
    assert len(answered) == 4 and conn.idle
    client.read()
    assert client.taken.count(b"HTTP/1.1 200 OK") == 4


def test_a_stream_to_a_paused_client_is_queued_in_order_and_ended_once_written() -> None:
    import asyncio

    from velox.ingress import h1write
    from velox.ingress.h1write import H1_CHUNKED, STATUS_LINES

    loop = asyncio.new_event_loop()
    try:
        conn, client, ring, answered = slow_conn()
        conn.state.loop = loop  # type: ignore[assignment]
        conn.data_received(CHAT_REQUEST)
        (request,) = ring.pushed
        headers = [(b"content-type", b"text/event-stream")]
        events = [b"data: {\"n\":%d,\"pad\":\"%b\"}\n\n" % (i, b"p" * 900) for i in range(400)]

        async def relay() -> None:
            conn.start_stream(sent(request), 200, headers)
            for i, event in enumerate(events):
                conn.send_chunk(event)
                if i % 10 == 9:
                    await asyncio.sleep(0)  # one upstream read per loop pass
            conn.end_stream()
            await asyncio.sleep(0)

        loop.run_until_complete(relay())
        assert client.paused and conn.queued > 0 and conn.current is request
        assert answered == [(200, len(h1write.py_head(STATUS_LINES[200], headers, 0, H1_CHUNKED))
                             + len(h1write.py_chunks(events, last=True)))]
        while client.paused:
            client.read()
        client.read()
    finally:
        loop.close()
    data = bytes(client.taken)
    head = h1write.py_head(STATUS_LINES[200], headers, 0, H1_CHUNKED)
    assert data.startswith(head) and data.endswith(b"0\r\n\r\n")
    assert _dechunk(data[len(head):]) == b"".join(events)
    assert conn.current is None and conn.queued == 0


def _dechunk(data: bytes) -> bytes:
    out, at = [], 0
    while True:
        end = data.index(b"\r\n", at)
        size = int(data[at:end], 16)
        if not size:
            return b"".join(out)
        out.append(data[end + 2:end + 2 + size])
        at = end + 2 + size + 2


def test_a_client_that_takes_nothing_is_aborted_at_the_write_deadline() -> None:
    conn, client, ring, _answered = slow_conn()
    conn.data_received(CHAT_REQUEST)
    (request,) = ring.pushed
    conn.respond(request, 200, [], b"x" * (4 << 20))
    assert conn.stalled_since > 0.0 and conn.queued
    conn.expire_write()
    assert client.aborted and conn.closed
    assert conn.state.write_timeouts == 1
    conn.connection_lost(None)
    assert conn._q is None


def test_a_queued_answer_does_not_pin_its_request_body_in_the_arena() -> None:
    """The body's arena segment goes back when the answer is queued, not when the client has
    taken it: one that never does would pin the segment for good."""
    arena = Arena(1 << 20)
    conn, _client, ring, _answered = slow_conn(arena)
    conn.data_received(CHAT_REQUEST)
    (request,) = ring.pushed
    assert request.arena_segment >= 0 and arena.live == 1
    conn.respond(request, 200, [], b"x" * (4 << 20))
    assert conn.queued and arena.live == 0
    conn.connection_lost(None)  # the client never read
    assert arena.live == 0

"""The HTTP/1.1 pool and its connections, socket-free: canned responses into real httptools
parsing, a fake transport that records whether the connection reads."""

from __future__ import annotations

import time
from typing import Any

from velox.core.errors import UpstreamTimeout, UpstreamUnavailable
from velox.core.fields import F
from velox.egress.h1conn import H1Base, H1Connection
from velox.egress.h1pool import H1Pool, _Warmup

from ._pool_peer import CONNECT_TIMEOUT_S, REQUEST_TIMEOUT_MS, FakeClient, FakeTransport, PoolPeer

HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n")


def _pool() -> tuple[PoolPeer, H1Pool]:
    peer = PoolPeer(protocol="http1")
    pool = peer.upstream.pool
    assert isinstance(pool, H1Pool)
    return peer, pool


def _connection(pool: H1Pool, kind: type[H1Base] = H1Connection) -> tuple[Any, FakeTransport]:
    """An open, warm, idle connection (of reader `kind`), as `_open` leaves it."""
    conn = kind(pool)
    transport = FakeTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    pool.total += 1
    pool.conns.add(conn)
    pool.on_idle(conn)
    return conn, transport


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def test_a_paused_client_stops_the_reading_until_it_reads_or_leaves() -> None:
    peer, pool = _pool()
    conn, transport = _connection(pool)
    client = peer.submit()
    assert transport.take().startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    conn.data_received(HEAD + _chunk(b"data: 1\n\n"))
    assert client.status == 200 and transport.reading

    client.paused = True
    conn.data_received(_chunk(b"data: 2\n\n"))
    assert not transport.reading
    assert client.attempt is not None
    client.paused = False
    client.attempt.resume()
    assert transport.reading

    client.paused = True
    conn.data_received(_chunk(b"data: 3\n\n"))
    assert not transport.reading
    client.attempt.cancel()  # the client leaves: HTTP/1.1 can only close the connection
    assert transport.closed and conn.attempt is None
    assert peer.tally.streams_cancelled == peer.counter(F.STREAMS_CANCELLED) == 1


def test_connection_loss_mid_response_is_502_and_the_pool_refills() -> None:
    peer, pool = _pool()
    conn, _ = _connection(pool)
    client = peer.submit()
    conn.data_received(HEAD + _chunk(b"data: 1\n\n"))
    spawned = peer.loop.spawned
    conn.connection_lost(ConnectionResetError())
    assert isinstance(client.error, UpstreamUnavailable)
    assert not pool.conns and peer.loop.spawned == spawned + 1
    assert pool.total == pool.connecting == 1  # only the replacement, still connecting


def test_deadline_sweep_closes_a_silent_connection() -> None:
    peer, pool = _pool()
    _conn, transport = _connection(pool)
    client = peer.submit()
    queued = peer.submit(FakeClient())  # no idle connection left: it waits
    assert len(pool.waiting) == 1
    pool.sweep(time.monotonic() + REQUEST_TIMEOUT_MS / 1000 + 1)
    assert isinstance(client.error, UpstreamTimeout) and isinstance(queued.error, UpstreamTimeout)
    assert transport.closed and not pool.waiting


def test_a_complete_response_frees_the_connection_for_the_next_request() -> None:
    peer, pool = _pool()
    conn, _transport = _connection(pool)
    first, second = peer.submit(), peer.submit()
    assert len(pool.waiting) == 1
    conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
    assert first.ended and first.received == 2
    assert not pool.waiting and conn.attempt is not None and second.attempt is conn.attempt


def test_an_unanswered_warm_up_closes_the_connection_at_the_connect_timeout() -> None:
    peer, pool = _pool()
    conn = H1Connection(pool)
    transport = FakeTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    pool.total += 1
    pool.conns.add(conn)
    conn.send(pool.warmup_attempt(_Warmup(pool, conn)))  # as _open does for a new connection
    assert transport.take().startswith(b"GET /v1/models HTTP/1.1\r\n")
    pool.sweep(time.monotonic() + CONNECT_TIMEOUT_S + 0.1)
    assert transport.closed and conn.attempt is None
    spawned = peer.loop.spawned
    conn.connection_lost(None)
    assert peer.loop.spawned == spawned + 1  # replaced
    assert peer.tally.warmup_timeouts == 1 and peer.tally.streams_cancelled == 0
    assert not pool.ready


class _Recorder(FakeClient):
    """Records the order of the calls egress makes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[object, ...]] = []

    def on_response(self, status: int, headers: list[tuple[bytes, bytes]], end: bool) -> None:
        self.calls.append(("response", status, end))
        super().on_response(status, headers, end)

    def on_data(self, data: bytes, end_stream: bool) -> None:
        self.calls.append(("data", data, end_stream))
        super().on_data(data, end_stream)

    def on_answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.calls.append(("answer", status, body))
        FakeClient.on_response(self, status, headers, False)
        FakeClient.on_data(self, body, True)

    def on_error(self, exc: BaseException) -> None:
        self.calls.append(("error", type(exc).__name__))
        super().on_error(exc)


def _submit_recorder(peer: PoolPeer) -> _Recorder:
    client = _Recorder()
    peer.upstream.submit(client)  # type: ignore[arg-type]
    return client


PLAIN = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n"


def test_a_whole_answer_in_one_read_is_reported_in_one_call() -> None:
    # As the HTTP/2 codec's ANSWER event: head and body together, the connection idle again.
    peer, pool = _pool()
    conn, _ = _connection(pool)
    client = _submit_recorder(peer)
    conn.buffer_updated(_into(conn, PLAIN + b'{"ok":true}'))
    assert client.calls == [("answer", 200, b'{"ok":true}')]
    assert conn.attempt is None and conn in pool.idle_conns


def test_an_answer_split_across_reads_reports_its_head_when_the_first_read_ends() -> None:
    peer, pool = _pool()
    conn, _ = _connection(pool)
    client = _submit_recorder(peer)
    conn.buffer_updated(_into(conn, PLAIN + b'{"ok"'))
    assert client.calls == [("response", 200, False), ("data", b'{"ok"', False)]
    conn.buffer_updated(_into(conn, b":true}"))
    assert client.calls[2:] == [("data", b":true}", False), ("data", b"", True)]


def test_a_stream_gets_its_head_and_first_event_in_the_read_that_brought_them() -> None:
    peer, pool = _pool()
    conn, _ = _connection(pool)
    client = _submit_recorder(peer)
    conn.data_received(HEAD + _chunk(b"data: 1\n\n") + _chunk(b"data: 2\n\n"))
    assert client.calls == [("response", 200, False), ("data", b"data: 1\n\ndata: 2\n\n", False)]
    conn.data_received(_chunk(b"data: 3\n\n") + b"0\r\n\r\n")
    assert client.calls[2:] == [("data", b"data: 3\n\n", False), ("data", b"", True)]


def test_a_protocol_error_after_an_unreported_head_is_only_an_error() -> None:
    # Nothing of the broken answer reached the client: dispatch may still send it elsewhere.
    peer, pool = _pool()
    conn, transport = _connection(pool)
    client = _submit_recorder(peer)
    conn.data_received(HEAD + b"zz\r\n")  # not a chunk size
    assert client.calls == [("error", "UpstreamProtocolError")]
    assert transport.aborted
    assert not conn.held and not conn.held_body


def _into(conn: H1Connection, data: bytes) -> int:
    """Put data where the transport would (BufferedProtocol) and return its length."""
    conn.read_buffer[:len(data)] = data
    return len(data)

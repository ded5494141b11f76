"""HTTP/1.1 pipelining, socket-free, on both readers (native and httptools): a micro-batch's
requests share a connection and one write; answers go to their requests in order, however the
reads split them; every way the connection ends gives each pipelined request exactly one
outcome: sent again when the upstream provably did not process it (never written, or behind a
"Connection: close" answer), a 502 when it was written and the connection died; a client that
leaves does not cost the requests behind it their connection."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from velox.core.errors import UpstreamTimeout, UpstreamUnavailable
from velox.egress.h1conn import H1Base, H1Connection, PyH1Connection
from velox.egress.h1pool import H1Pool

from ._pool_peer import REQUEST_TIMEOUT_MS, FakeClient, FakeTransport, PoolPeer
from .test_pool_h1 import _connection

READERS = [H1Connection, PyH1Connection]
DEPTH = 4


def _answer(body: bytes, close: bool = False) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
            % (len(body), b"connection: close\r\n" if close else b"")) + body


def _pool(kind: type[H1Base], idle: int = 1) -> tuple[PoolPeer, H1Pool, list[FakeTransport]]:
    """A pipelining pool with `idle` open, warm, idle connections of reader `kind`."""
    peer = PoolPeer(protocol="http1", pipeline=DEPTH)
    pool = peer.upstream.pool
    assert isinstance(pool, H1Pool)
    return peer, pool, [_connection(pool, kind)[1] for _ in range(idle)]


def _batch(peer: PoolPeer, n: int) -> list[FakeClient]:
    """n requests submitted in one micro-batch, then its flush."""
    clients = [FakeClient(body=b'{"model":"m","n":%d}' % i) for i in range(n)]
    for client in clients:
        peer.upstream.submit(client)  # type: ignore[arg-type]
    peer.upstream.flush()
    return clients


def _conn(pool: H1Pool) -> H1Base:
    (conn,) = [c for c in pool.conns if c.attempt is not None]
    return conn


def _feed(conn: H1Base, data: bytes) -> None:
    conn.data_received(data)


@pytest.mark.parametrize("kind", READERS)
def test_a_batch_shares_one_connection_and_one_write_and_answers_go_in_order(
        kind: type[H1Base]) -> None:
    peer, pool, (transport,) = _pool(kind)
    clients = _batch(peer, 3)
    assert len(transport.chunks) == 1  # one write for the batch
    assert transport.take().count(b"POST /v1/chat/completions HTTP/1.1\r\n") == 3
    assert peer.tally.pipelined == 2 and pool.describe()["in_flight"] == 3
    # The three answers, split across reads at awkward places.
    wire = _answer(b'{"a":0}') + _answer(b'{"a":11}') + _answer(b'{"a":222}')
    conn = _conn(pool)
    for cut in (5, 40, 73):
        _feed(conn, wire[:cut])
        wire = wire[cut:]
    _feed(conn, wire)
    assert [(c.status, c.received, c.ended) for c in clients] == \
        [(200, 7, True), (200, 8, True), (200, 9, True)]
    assert conn.attempt is None and not conn.behind and conn in pool.idle_conns


@pytest.mark.parametrize("kind", READERS)
def test_a_batch_larger_than_the_depth_goes_over_more_connections(kind: type[H1Base]) -> None:
    peer, pool, transports = _pool(kind, idle=2)
    clients = _batch(peer, DEPTH + 2)
    writes = [t.take().count(b" HTTP/1.1\r\n") for t in transports]
    assert sorted(writes) == [2, DEPTH] and all(c.error is None for c in clients)
    assert not pool.waiting


@pytest.mark.parametrize("kind", READERS)
def test_a_slow_answer_holds_the_ones_behind_it_until_it_ends(kind: type[H1Base]) -> None:
    peer, pool, _ = _pool(kind)
    first, second = _batch(peer, 2)
    conn = _conn(pool)
    _feed(conn, b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n01234")  # the slow one, half
    assert first.status == 200 and not first.ended and second.status == 0
    _feed(conn, b"56789" + _answer(b"{}"))
    assert first.ended and first.received == 10 and second.ended and second.received == 2


@pytest.mark.parametrize("kind", READERS)
def test_a_connection_lost_mid_pipeline_is_a_502_for_every_request_written(
        kind: type[H1Base]) -> None:
    peer, pool, _ = _pool(kind)
    first, second, third = _batch(peer, 3)
    conn = _conn(pool)
    _feed(conn, _answer(b"{}"))  # the first is answered; the server dies before the rest
    conn.connection_lost(ConnectionResetError())
    assert first.ended and first.error is None
    assert isinstance(second.error, UpstreamUnavailable)
    assert isinstance(third.error, UpstreamUnavailable)
    assert peer.tally.retries == 0 and not pool.conns


@pytest.mark.parametrize("kind", READERS)
def test_requests_not_yet_written_are_sent_again_when_the_connection_dies(
        kind: type[H1Base]) -> None:
    peer, pool, transports = _pool(kind, idle=2)
    clients = [FakeClient(), FakeClient()]
    for client in clients:
        peer.upstream.submit(client)  # type: ignore[arg-type]
    conn = _conn(pool)  # both queued on one connection, the batch's flush not yet run
    dead = conn.transport
    conn.connection_lost(ConnectionResetError())
    assert all(c.error is None for c in clients) and peer.tally.retries == 2
    peer.loop.run_ready()  # the retries' flush
    (other,) = [t for t in transports if t is not dead]
    assert dead.take() == b"" and other.take().count(b" HTTP/1.1\r\n") == 2


@pytest.mark.parametrize("kind", READERS)
def test_requests_behind_a_connection_close_answer_are_sent_again(kind: type[H1Base]) -> None:
    # RFC 9112, 9.6: the server processes nothing after the request it answers with close.
    peer, pool, transports = _pool(kind, idle=2)
    first, second, third = _batch(peer, 3)
    conn = _conn(pool)
    transport = conn.transport
    (other,) = [t for t in transports if t is not transport]
    transport.take()
    _feed(conn, _answer(b"{}", close=True))
    assert first.ended and second.error is None and third.error is None
    assert transport.closed and peer.tally.retries == 2
    peer.loop.run_ready()
    assert other.take().count(b" HTTP/1.1\r\n") == 2  # on the other connection, together
    _feed(_conn(pool), _answer(b"[1]") + _answer(b"[22]"))
    assert (second.received, third.received) == (3, 4) and second.ended and third.ended


@pytest.mark.parametrize("kind", READERS)
def test_a_client_leaving_mid_pipeline_keeps_the_connection_for_the_others(
        kind: type[H1Base]) -> None:
    peer, pool, (transport,) = _pool(kind)
    first, second, third = _batch(peer, 3)
    conn = _conn(pool)
    assert first.attempt is not None and second.attempt is not None
    first.attempt.cancel()  # the client of the answer in progress leaves
    second.attempt.cancel()  # and one waiting behind it
    assert not transport.closed and peer.tally.streams_cancelled == 0
    _feed(conn, _answer(b"{}") + _answer(b"[0]") + _answer(b"[333]"))
    assert first.received == second.received == 0  # their answers were read and dropped
    assert third.ended and third.received == 5 and conn in pool.idle_conns


@pytest.mark.parametrize("kind", READERS)
def test_a_stuck_answer_times_out_and_its_connection_ends_with_the_rest(
        kind: type[H1Base]) -> None:
    peer, pool, (transport,) = _pool(kind)
    first, second = _batch(peer, 2)
    conn = _conn(pool)
    late = time.monotonic() + REQUEST_TIMEOUT_MS / 1000 + 1
    pool.sweep(late)
    assert isinstance(first.error, UpstreamTimeout) and isinstance(second.error, UpstreamTimeout)
    # The stand-in of the answer in progress keeps its deadline: the next tick ends it.
    pool.sweep(late + 0.5)
    assert transport.closed
    conn.connection_lost(None)
    assert not pool.conns and pool.describe()["in_flight"] == 0


@pytest.mark.parametrize("kind", READERS)
def test_streams_head_and_large_bodies_are_never_pipelined(kind: type[H1Base]) -> None:
    # Each after a plain request that would take the ones behind it: all go alone.
    peer, _, transports = _pool(kind, idle=4)
    head = FakeClient()
    head.method = b"HEAD"
    large = FakeClient(body=b"x" * (1 << 20))
    for client in (FakeClient(), _Streamed(), head, large):
        peer.upstream.submit(client)  # type: ignore[arg-type]
    peer.upstream.flush()
    assert peer.tally.pipelined == 0
    assert sorted(t.take()[:24] for t in transports) == [
        b"GET /v1/stream HTTP/1.1\r", b"HEAD /v1/chat/completion", b"POST /v1/chat/completion",
        b"POST /v1/chat/completion"]


class _Streamed(FakeClient):
    """A client whose request asked for a stream (the relay's exchange has its request)."""

    def __init__(self) -> None:
        super().__init__(path=b"/v1/stream")
        self.method = b"GET"
        self.request = SimpleNamespace(stream=True)


def test_without_the_setting_nothing_is_pipelined() -> None:
    peer = PoolPeer(protocol="http1")
    pool = peer.upstream.pool
    assert isinstance(pool, H1Pool) and pool.depth == 1
    _, transport = _connection(pool)
    _batch(peer, 3)
    assert transport.take().count(b" HTTP/1.1\r\n") == 1 and len(pool.waiting) == 2

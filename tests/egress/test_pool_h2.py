"""The HTTP/2 pool, its connections and the codec together, against in-memory h2 servers.

Socket-free (tests/egress/_pool_peer.py): every byte goes through the real codec and the real
`h2` server state machine, so what is asserted about windows, resets and retries is what an
upstream would see.
"""

from __future__ import annotations

import time

import pytest
from h2.errors import ErrorCodes
from h2.events import PingReceived, StreamReset, WindowUpdated

from velox.core.errors import UpstreamProtocolError, UpstreamTimeout, UpstreamUnavailable
from velox.core.fields import F
from velox.egress.h2conn import State

from ._codec_peer import CODECS
from ._pool_peer import (
    CONNECT_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    PING_TIMEOUT_S,
    REQUEST_TIMEOUT_MS,
    FakeClient,
    PoolPeer,
)

MIB = 1024 * 1024


@pytest.mark.parametrize("codec", CODECS)
def test_goaway_retries_the_streams_above_last_stream_id_and_completes_the_rest(
        codec: str) -> None:
    peer = PoolPeer(codec, connections=2)
    first = peer.connect(0)  # connection 1 is not up yet: everything goes to connection 0
    clients = [peer.submit() for _ in range(3)]
    peer.pump()
    assert first.requests == [3, 5, 7]
    second = peer.connect(1)

    first.goaway(last_stream_id=5)  # 7 was never processed
    peer.pump()
    assert first.conn.state is State.DRAINING
    assert second.requests == [3]  # stream 7 went to the other connection
    assert clients[2].attempt is not None and clients[2].attempt.number == 1  # type: ignore[attr-defined]

    for sid in (3, 5):  # the upstream still answers what it processed
        first.respond(sid, body=b'{"ok":1}')
    second.respond(3, body=b'{"ok":2}')
    peer.pump()
    assert [c.status for c in clients] == [200, 200, 200]
    assert all(c.ended and c.error is None for c in clients)
    assert first.transport.closed  # drained, then closed
    assert peer.tally.goaways == peer.counter(F.GOAWAYS) == 1
    assert peer.tally.retries == peer.counter(F.RETRIES) == 1


def test_a_submitted_request_goes_out_with_the_callers_flush_and_schedules_nothing() -> None:
    # The worker flushes every upstream after each micro-batch; a flush scheduled per request
    # on top of it was a loop callback (~0.7 us) finding nothing to write.
    peer = PoolPeer()
    server = peer.connect(0)
    client = FakeClient()
    peer.upstream.submit(client)
    assert peer.loop.ready == []
    assert server.transport.chunks == []  # encoded, not yet written
    peer.upstream.flush()
    assert server.transport.chunks  # one write for the batch
    peer.pump()
    assert server.requests == [3]
    server.respond(3)
    peer.pump()
    assert client.status == 200 and client.ended


def test_one_request_at_a_time_stays_on_one_connection_and_a_batch_spreads() -> None:
    # With nothing in flight, each request goes where the last one went: alternating two
    # connections at one client connection kept two TLS states and codecs warm for nothing.
    # A micro-batch still spreads: each request to the connection with the fewest streams.
    peer = PoolPeer(connections=2)
    first, second = peer.connect(0), peer.connect(1)
    for _ in range(4):  # one at a time, each answered before the next
        before = len(first.requests)
        client = peer.submit()
        peer.upstream.flush()
        peer.pump()
        server = first if len(first.requests) > before else second
        server.respond(server.requests[-1])
        peer.pump()
        assert client.status == 200 and client.ended
    assert (len(first.requests), len(second.requests)) in ((4, 0), (0, 4))
    busy, idle = (first, second) if first.requests else (second, first)
    taken = len(busy.requests)
    clients = [peer.submit() for _ in range(6)]  # one micro-batch
    peer.upstream.flush()
    peer.pump()
    assert len(busy.requests) - taken == 3 and len(idle.requests) == 3
    for server in (busy, idle):
        for sid in server.requests[-3:]:
            server.respond(sid)
    peer.pump()
    assert all(c.status == 200 and c.ended for c in clients)


@pytest.mark.parametrize("codec", CODECS)
def test_refused_stream_is_sent_again(codec: str) -> None:
    peer = PoolPeer(codec)
    server = peer.connect(0)
    client = peer.submit()
    peer.pump()
    server.h2.reset_stream(3, ErrorCodes.REFUSED_STREAM)
    peer.pump()
    assert server.requests == [3, 5]
    server.respond(5)
    peer.pump()
    assert client.status == 200 and client.ended and client.error is None
    assert peer.tally.retries == 1


def test_a_request_refused_every_time_fails_after_the_attempt_limit() -> None:
    peer = PoolPeer()
    server = peer.connect(0)
    client = peer.submit()
    peer.pump()
    for _ in range(10):
        if client.done:
            break
        server.h2.reset_stream(server.requests[-1], ErrorCodes.REFUSED_STREAM)
        peer.pump()
    assert isinstance(client.error, UpstreamProtocolError)
    assert len(server.requests) == 5  # MAX_ATTEMPTS
    assert not server.conn.streams


@pytest.mark.parametrize("codec", CODECS)
def test_connection_loss_mid_request_fails_what_may_have_been_processed(codec: str) -> None:
    peer = PoolPeer(codec)
    server = peer.connect(0)
    streaming, waiting = peer.submit(), peer.submit()
    peer.pump()
    server.respond(3, body=b"data: {}\n\n", end=False, content_type=b"text/event-stream")
    peer.pump()
    assert streaming.status == 200 and not streaming.done

    server.conn.connection_lost(ConnectionResetError())
    assert isinstance(streaming.error, UpstreamUnavailable)
    assert isinstance(waiting.error, UpstreamUnavailable)  # never replayed: it may have run
    assert server.conn.state is State.CLOSED and not server.conn.streams
    assert peer.pool.conns[0] is None and peer.loop.spawned == 1  # a replacement is underway
    assert peer.tally.reconnects == peer.counter(F.RECONNECTS) == 1
    assert peer.tally.retries == 0


def test_deadline_sweep_expires_headers_then_idle_streams_and_resets_them() -> None:
    peer = PoolPeer()
    server = peer.connect(0)
    silent, stalled = peer.submit(), peer.submit()
    peer.pump()
    server.respond(5, body=b"data: {}\n\n", end=False, content_type=b"text/event-stream")
    peer.pump()
    now = time.monotonic()

    peer.pool.sweep(now + IDLE_TIMEOUT_S / 2)  # nothing is late yet
    assert not silent.done and not stalled.done

    peer.pool.sweep(now + IDLE_TIMEOUT_S + 1)  # the streamed response went quiet
    assert isinstance(stalled.error, UpstreamTimeout) and not silent.done
    peer.pump()  # the server answers the liveness PING the quiet connection was sent
    peer.pool.sweep(now + REQUEST_TIMEOUT_MS / 1000 + 1)  # no headers in time
    assert isinstance(silent.error, UpstreamTimeout)
    peer.pump()
    resets = [e.stream_id for e in server.events if isinstance(e, StreamReset)]
    assert resets == [5, 3]
    assert not server.conn.streams
    assert peer.tally.streams_cancelled == peer.counter(F.STREAMS_CANCELLED) == 2


def test_deadline_sweep_expires_a_queued_request() -> None:
    peer = PoolPeer()  # no connection at all: the request waits in the queue
    client = peer.submit()
    assert len(peer.pool.waiting) == 1
    peer.pool.sweep(time.monotonic() + REQUEST_TIMEOUT_MS / 1000 + 1)
    assert isinstance(client.error, UpstreamTimeout)
    assert not peer.pool.waiting


def test_a_queued_request_the_client_abandons_leaves_the_queue() -> None:
    peer = PoolPeer()
    client = peer.submit()
    assert client.attempt is not None
    client.attempt.cancel()
    assert not peer.pool.waiting
    server = peer.connect(0)
    assert server.requests == []  # never sent


def test_an_unanswered_warm_up_expires_at_the_connect_timeout_and_reconnects(
        caplog: pytest.LogCaptureFixture) -> None:
    peer = PoolPeer()
    server = peer.connect(0, warm=False)
    client = peer.submit()  # waits for a warm connection
    now = time.monotonic()
    peer.pool.sweep(now + CONNECT_TIMEOUT_S / 2)
    assert server.conn.state is State.WARMING
    peer.pool.sweep(now + CONNECT_TIMEOUT_S + 0.1)
    assert server.conn.state is State.CLOSED and server.transport.closed
    assert peer.pool.conns[0] is None and peer.loop.spawned == 1  # reconnecting, with backoff
    assert peer.pool.backoff[0] > 0
    assert peer.tally.warmup_timeouts == 1 and peer.tally.streams_cancelled == 0
    assert "did not answer the warm-up request GET /v1/models within 5000 ms" in caplog.text
    assert not client.done and len(peer.pool.waiting) == 1  # still waiting for a connection


# --- liveness ----------------------------------------------------------------------------------

def test_a_silent_connection_is_pinged_then_failed_and_replaced_with_backoff(
        caplog: pytest.LogCaptureFixture) -> None:
    peer = PoolPeer()
    server = peer.connect(0)
    client = peer.submit()
    peer.pump()
    now = time.monotonic()
    peer.pool.sweep(now + 1)  # this tick notes the reads so far ...
    peer.pool.sweep(now + 2)  # ... and the next finds none since, with a stream open: PING
    peer.loop.run_ready()
    assert server.transport.take().endswith((1).to_bytes(8, "big"))  # PING, opaque data 1
    # The upstream says nothing any more (the PING is never delivered, never answered).
    peer.pool.sweep(now + 2 + PING_TIMEOUT_S / 2)
    assert server.conn.state is State.READY
    peer.pool.sweep(now + 2 + PING_TIMEOUT_S)
    assert isinstance(client.error, UpstreamUnavailable)
    assert server.conn.state is State.CLOSED and peer.loop.spawned == 1
    assert peer.pool.backoff[0] > 0  # a dead connection is not replaced in a tight loop
    assert peer.tally.ping_timeouts == peer.counter(F.UPSTREAM_PING_TIMEOUTS) == 1
    assert caplog.text.count("no answer to a PING within 5000 ms") == 1


def test_a_connection_that_answers_pings_lives_on() -> None:
    peer = PoolPeer()
    server = peer.connect(0)
    client = peer.submit()
    peer.pump()
    now = time.monotonic()
    for step in range(1, 9):  # a slow model: eight seconds without a response byte
        peer.pool.sweep(now + step * 1.1)
        peer.pump()  # PINGs are answered
    assert server.conn.state is State.READY and not client.done
    assert sum(isinstance(e, PingReceived) for e in server.events) >= 2
    server.respond(server.requests[0])
    peer.pump()
    assert client.status == 200 and peer.tally.ping_timeouts == 0


def test_requests_timing_out_in_a_row_retire_the_connection(
        caplog: pytest.LogCaptureFixture) -> None:
    peer = PoolPeer(connections=2)
    server = peer.connect(0)
    now = time.monotonic()
    for n in range(1, 4):
        client = peer.submit()
        peer.pump()
        peer.pool.sweep(now + n * (REQUEST_TIMEOUT_MS / 1000 + 1))
        peer.pump()
        assert isinstance(client.error, UpstreamTimeout)
        assert server.conn.state is (State.READY if n < 3 else State.DRAINING)
    assert "3 requests in a row got no response headers in time; retiring it" in caplog.text
    assert peer.tally.timeout_retirements == peer.counter(F.UPSTREAM_TIMEOUT_RETIREMENTS) == 1


def test_a_response_in_between_resets_the_timeout_count() -> None:
    peer = PoolPeer()
    server = peer.connect(0)
    now = time.monotonic()
    for n in range(1, 6):
        late = peer.submit()
        answered = peer.submit()
        peer.pump()
        server.respond(server.requests[-1])  # the second one is answered
        peer.pump()
        peer.pool.sweep(now + n * (REQUEST_TIMEOUT_MS / 1000 + 1))
        peer.pump()
        assert isinstance(late.error, UpstreamTimeout) and answered.status == 200
    assert server.conn.state is State.READY and peer.tally.timeout_retirements == 0


# --- a client that stops reading ---------------------------------------------------------------

def _paused_streams(peer: PoolPeer, n: int, size: int) -> list[FakeClient]:
    """n streamed responses of `size` bytes each, all received while their clients do not read."""
    server = peer.servers[0]
    clients = [peer.submit() for _ in range(n)]
    peer.pump()
    for client in clients:
        client.paused = True
    for sid in server.requests[-n:]:
        server.respond(sid, body=b"x" * size, end=False, content_type=b"text/event-stream")
    peer.pump()
    assert all(c.received == size for c in clients)
    return clients


@pytest.mark.parametrize("codec", CODECS)
def test_credit_is_withheld_while_the_client_is_paused_and_returned_when_it_reads(
        codec: str) -> None:
    peer = PoolPeer(codec)
    server = peer.connect(0)
    (client,) = _paused_streams(peer, 1, 6 * MIB)
    sid = server.requests[0]
    assert server.window(sid) == 2 * MIB  # 8 MiB stream window, nothing given back
    assert client.attempt is not None and client.attempt.withheld == 6 * MIB  # type: ignore[attr-defined]

    client.paused = False
    client.attempt.resume()
    peer.pump()
    assert server.window(sid) == 8 * MIB
    assert any(isinstance(e, WindowUpdated) and e.stream_id == sid for e in server.events)


def _end_by_client_leaving(peer: PoolPeer, clients: list[FakeClient]) -> None:
    for client in clients:
        assert client.attempt is not None
        client.attempt.cancel()
        client.ended = True  # as relay.Exchange.client_gone marks itself finished


def _end_by_upstream_reset(peer: PoolPeer, clients: list[FakeClient]) -> None:
    server = peer.servers[0]
    for sid in server.requests:
        server.h2.reset_stream(sid, ErrorCodes.INTERNAL_ERROR)


def _end_by_idle_deadline(peer: PoolPeer, clients: list[FakeClient]) -> None:
    peer.pool.sweep(time.monotonic() + IDLE_TIMEOUT_S + 1)


def _end_by_response_end(peer: PoolPeer, clients: list[FakeClient]) -> None:
    server = peer.servers[0]
    for sid in server.requests:
        server.h2.send_data(sid, b"", end_stream=True)


ENDINGS = {"client leaves": _end_by_client_leaving, "upstream resets": _end_by_upstream_reset,
           "idle deadline": _end_by_idle_deadline, "response ends": _end_by_response_end}


@pytest.mark.parametrize("ending", list(ENDINGS))
@pytest.mark.parametrize("codec", CODECS)
def test_withheld_credit_returns_to_the_connection_however_the_stream_ends(
        codec: str, ending: str) -> None:
    """Five paused streams hold 35 of the 64 MiB connection window; whatever ends them, the
    upstream gets the whole window back and the connection serves the next request."""
    peer = PoolPeer(codec)
    server = peer.connect(0)
    before = server.window()  # 64 MiB less the warm-up answer's few bytes
    clients = _paused_streams(peer, 5, 7 * MIB)
    assert server.window() == before - 35 * MIB

    attempts = [c.attempt for c in clients]
    ENDINGS[ending](peer, clients)
    peer.pump()
    assert all(c.done for c in clients)
    assert not server.conn.streams
    assert server.window() == 64 * MIB  # a connection WINDOW_UPDATE gave it all back
    for attempt in attempts:  # a client draining late must not credit the same bytes twice
        assert attempt is not None
        attempt.resume()
    peer.pump()
    assert server.window() == 64 * MIB

    after = peer.submit()
    peer.pump()
    server.respond(server.requests[-1], body=b"y" * MIB)
    peer.pump()
    assert after.status == 200 and after.ended and after.received == MIB


@pytest.mark.parametrize("codec", CODECS)
def test_a_retired_connections_streams_keep_their_deadlines(codec: str) -> None:
    # A connection told GOAWAY leaves the pool's list while its processed streams finish; they
    # must still time out if the upstream never answers them (found with a silent upstream:
    # requests on a retired connection waited for ever, the pool no longer looked at them).
    peer = PoolPeer(codec, connections=2)
    first = peer.connect(0)
    client = peer.submit()
    peer.pump()
    assert first.requests == [3]
    first.goaway(last_stream_id=3)  # 3 was processed: it stays on the draining connection
    peer.pump()
    assert first.conn.state is State.DRAINING and peer.pool.conns[0] is not first.conn
    peer.pool.sweep(time.monotonic() + REQUEST_TIMEOUT_MS / 1000 + 1)
    assert isinstance(client.error, UpstreamTimeout)
    peer.pump()
    assert first.transport.closed  # its last stream ended: the retired connection closes
    first.conn.connection_lost(None)  # what the event loop reports next (the fake does not)
    assert not peer.pool.retired


def test_a_retired_connection_that_falls_silent_is_found_by_ping() -> None:
    peer = PoolPeer(connections=2)
    first = peer.connect(0)
    client = peer.submit()
    peer.pump()
    first.goaway(last_stream_id=3)  # 3 was processed: it finishes on the draining connection
    peer.pump()
    assert first.conn in peer.pool.retired
    now = time.monotonic()
    peer.pool.sweep(now + 1)
    peer.pool.sweep(now + 2)  # a stream open and nothing read for a tick: PING (never answered)
    peer.pool.sweep(now + 2 + PING_TIMEOUT_S)
    assert isinstance(client.error, UpstreamUnavailable)  # 502 long before the request timeout
    assert first.conn.state is State.CLOSED and not peer.pool.retired
    assert peer.tally.ping_timeouts == 1

"""A client request is not tied to one connection: the relay's Exchange, moved by hand from one
upstream to another (as retries and failover will do), talks to whichever attempt is current.

Socket-free: two `Upstream`s, each with its own in-memory h2 server (tests/egress/_pool_peer.py),
and the real relay.Exchange answering a fake client connection.
"""

from __future__ import annotations

from collections.abc import Sequence

from h2.events import StreamReset

from velox.core.types import Kind, Request
from velox.relay.exchange import Exchange

from ..ends import RecordingEnds
from ._codec_peer import raw_frame
from ._pool_peer import PoolPeer


class FakeResponder:
    """The client connection side of a request (a `_types.Responder`)."""

    def __init__(self) -> None:
        self.closed = False
        self.write_paused = False
        self.answers: list[tuple[int, bytes]] = []
        self.chunks: list[bytes] = []
        self.errors: list[BaseException] = []

    def respond(self, request: Request, status: int, headers: Sequence[tuple[bytes, bytes]],
                body: bytes | memoryview) -> None:
        self.answers.append((status, bytes(body)))

    def respond_error(self, request: Request, exc: BaseException) -> None:
        self.errors.append(exc)

    def start_stream(self, request: Request, status: int,
                     headers: Sequence[tuple[bytes, bytes]]) -> None:
        self.answers.append((status, b""))

    def send_chunk(self, data: bytes) -> None:
        self.chunks.append(data)

    def end_stream(self) -> None:
        pass

    def abort(self) -> None:
        self.closed = True


def _exchange(responder: FakeResponder, done: list[int]) -> Exchange:
    request = Request(responder, b"POST", b"/v1/chat/completions", Kind.MODEL_CALL,
                      [(b"content-type", b"application/json")], b'{"model":"m"}', True, 0)
    return Exchange(request, request.path, [(b"content-type", b"application/json")],
                    lambda exchange, status: done.append(status))


def test_an_exchange_abandoned_on_one_upstream_is_answered_by_another() -> None:
    first, second = PoolPeer(), PoolPeer()
    server_a, server_b = first.connect(0), second.connect(0)
    responder, done = FakeResponder(), []
    exchange = _exchange(responder, done)

    first.upstream.submit(exchange)
    first.upstream.flush()  # as the worker does after each batch
    first.pump()
    assert server_a.requests == [3]
    tried = exchange.attempt
    assert tried is not None
    tried.cancel()  # e.g. too slow: abandon it (RST_STREAM) ...
    second.upstream.submit(exchange, number=1)  # ... and try the other upstream
    second.upstream.flush()
    second.pump()
    first.pump()
    assert [e.stream_id for e in server_a.events if isinstance(e, StreamReset)] == [3]
    assert not server_a.conn.streams and exchange.attempt is not tried

    # What the first upstream had already sent before it saw the reset: dropped by the codec.
    server_a.conn.data_received(raw_frame(0, 0x1, 3, b'{"late":1}'))
    server_b.respond(server_b.requests[0], body=b'{"ok":1}')
    first.pump()
    second.pump()
    assert responder.answers == [(200, b'{"ok":1}')] and not responder.errors
    assert done == [200] and exchange.attempt is None  # the links are cut at the end
    assert not server_b.conn.streams


def test_a_paused_client_resumes_the_attempt_it_has_now() -> None:
    first, second = PoolPeer(), PoolPeer()
    first.connect(0)
    server_b = second.connect(0)
    responder, done = FakeResponder(), []
    exchange = _exchange(responder, done)
    first.upstream.submit(exchange)
    first.upstream.flush()  # as the worker does after each batch
    first.pump()
    assert exchange.attempt is not None
    exchange.attempt.cancel()
    second.upstream.submit(exchange, number=1)
    second.upstream.flush()
    second.pump()
    sid = server_b.requests[0]

    responder.write_paused = True
    server_b.respond(sid, body=b"x" * (5 << 20), end=False, content_type=b"text/event-stream")
    second.pump()
    assert server_b.window(sid) == 3 << 20  # 8 MiB window less the 5 MiB the client holds
    responder.write_paused = False
    exchange.client_writable()
    second.pump()
    assert server_b.window(sid) == 8 << 20


class _RetryElsewhere:
    """What velox.routing.dispatch does for a retryable failure, reduced to one retry on `other`."""

    def __init__(self, other: PoolPeer) -> None:
        self.other = other
        self.retried = 0

    def response(self, exchange: Exchange, status: int, headers: object) -> bool:
        return False  # a 200: the answer to relay

    def error_failed(self, exchange: Exchange, exc: BaseException) -> bool:
        if self.retried:
            return False
        self.retried += 1
        exchange.reset_for_retry()
        self.other.upstream.submit(exchange, number=1)
        self.other.upstream.flush()
        return True

    def finish(self, exchange: Exchange, broken: bool) -> None:
        pass


class _Recorder:
    """A relay.Observer (as the cache's) that writes down what it is shown."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, object]] = []

    def head(self, status: int, headers: list) -> None:
        self.seen.append(("head", status))

    def data(self, data: bytes) -> None:
        self.seen.append(("data", bytes(data)))

    def end(self, error: BaseException | None) -> None:
        self.seen.append(("end", error))

    def client_gone(self, exchange: Exchange) -> bool:
        return False


def test_a_plain_answer_cut_after_its_headers_is_sent_again_before_anything_reaches_the_client(
        ) -> None:
    # The commit point is the first byte to the client, not the upstream's headers: a plain
    # answer is collected whole, so one whose connection dies after the headers can still be
    # answered by another upstream. Until then the request body is kept (a retry sends it) and
    # an observer (the cache) sees nothing of the abandoned attempt.
    first, second = PoolPeer(), PoolPeer()
    server_a, server_b = first.connect(0), second.connect(0)
    responder, done, ends = FakeResponder(), [], RecordingEnds()
    released = ends.segments
    request = Request(responder, b"POST", b"/v1/chat/completions", Kind.MODEL_CALL,
                      [(b"content-type", b"application/json")], b'{"model":"m"}', True, 0,
                      7, ends)  # its body in arena segment 7
    dispatch = _RetryElsewhere(second)
    exchange = Exchange(request, request.path, [(b"content-type", b"application/json")],
                        lambda exchange, status: done.append(status), dispatch)  # type: ignore[arg-type]
    observer = exchange.observer = _Recorder()

    first.upstream.submit(exchange)
    first.upstream.flush()  # as the worker does after each batch
    first.pump()
    server_a.respond(server_a.requests[0], body=b'{"half":', end=False)
    first.pump()
    assert exchange.status == 200 and not exchange.started
    assert not released and not observer.seen  # nothing is committed yet

    server_a.conn.connection_lost(ConnectionResetError())  # e.g. the upstream was SIGKILLed
    assert dispatch.retried == 1 and not responder.errors and not done
    second.pump()
    server_b.respond(server_b.requests[0], body=b'{"ok":1}')
    second.pump()
    assert responder.answers == [(200, b'{"ok":1}')] and not responder.errors
    assert done == [200] and released == [7]
    assert observer.seen == [("head", 200), ("data", b'{"ok":1}'), ("end", None)]

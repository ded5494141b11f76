"""Test helper: an `Upstream` with its real HTTP/2 pool, connections and codec, wired in memory
to `h2` servers (python-hyper, server side), one per connection. No sockets, no event loop.

`PoolPeer` builds the upstream; `connect(index)` makes a connection with a `FakeTransport` and
its own server, which answers the warm-up by itself; `pump()` shuttles bytes both ways (and runs
the callbacks the pool scheduled) until both sides are quiet. Tests then drive the servers
(`respond`, `reset`, `goaway`, `lose`) and look at what the clients saw (`FakeClient`), what
the pool counted (its `Tally` and the shared stats slot) and what the servers' flow-control
windows say.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Coroutine
from typing import Any

from h2.config import H2Configuration
from h2.connection import H2Connection as H2Server
from h2.events import Event, RequestReceived

from velox.config.tables import UpstreamSpec
from velox.egress.h2conn import H2Connection, State
from velox.egress.h2pool import H2Pool
from velox.egress.interfaces import CallHandle, Tally
from velox.egress.pool import EgressOptions
from velox.egress.upstream import Upstream
from velox.state.stats import SharedStats
from velox_lab.codecs import factory, make_codec

from ._codec_peer import raw_frame

AUTHORITY = "api.example.com"
REQUEST_TIMEOUT_MS = 10_000
IDLE_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 5.0  # UpstreamSpec's default
PING_TIMEOUT_S = 5.0  # EgressOptions' default (VELOX_UPSTREAM_PING_TIMEOUT_MS)


class FakeTransport:
    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.closed = False
        self.aborted = False
        self.reading = True

    def write(self, data: bytes) -> None:
        self.chunks.append(bytes(data))

    def take(self) -> bytes:
        data, self.chunks = b"".join(self.chunks), []
        return data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class _NoTask:
    def add_done_callback(self, fn: Callable[..., Any]) -> None:
        pass

    def cancel(self) -> None:
        pass


class FakeLoop:
    """call_soon queues until run_ready(); connects the pool starts are recorded, not run."""

    def __init__(self) -> None:
        self.ready: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self.spawned = 0

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> None:
        self.ready.append((callback, args))

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> _NoTask:
        return _NoTask()

    def create_task(self, coro: Coroutine[Any, Any, Any]) -> _NoTask:
        coro.close()  # a reconnect: the test makes connections itself with connect()
        self.spawned += 1
        return _NoTask()

    def run_ready(self) -> None:
        while self.ready:
            batch, self.ready = self.ready, []
            for callback, args in batch:
                callback(*args)


class FakeClient:
    """An egress `Client` that records what it is told; `paused` is set by the test."""

    def __init__(self, path: bytes = b"/v1/chat/completions", body: bytes = b'{"model":"m"}'):
        self.attempt: CallHandle | None = None
        self.method = b"POST"
        self.path = path
        self.headers_out = [(b"content-type", b"application/json")]
        self.body = body
        self.paused = False
        self.status = 0
        self.received = 0
        self.ended = False
        self.error: BaseException | None = None

    def on_response(self, status: int, headers: list[tuple[bytes, bytes]], end: bool) -> None:
        assert not self.ended and self.error is None
        self.status = status
        self.ended = end

    def on_data(self, data: bytes, end_stream: bool) -> None:
        assert not self.ended and self.error is None
        self.received += len(data)
        self.ended = end_stream

    def on_answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.on_response(status, headers, False)
        self.on_data(body, True)

    def on_error(self, exc: BaseException) -> None:
        assert not self.ended and self.error is None
        self.error = exc

    @property
    def done(self) -> bool:
        return self.ended or self.error is not None


class Server:
    """One in-memory h2 server behind one pool connection."""

    def __init__(self, conn: H2Connection, transport: FakeTransport) -> None:
        self.conn = conn
        self.transport = transport
        self.h2 = H2Server(H2Configuration(client_side=False, header_encoding=None))
        self.h2.initiate_connection()
        self.events: list[Event] = []
        self.requests: list[int] = []  # stream ids of requests other than the warm-up
        self.answer_warmup = True

    def pump_once(self) -> bool:
        up = self.transport.take()
        if up:
            for event in self.h2.receive_data(up):
                self.events.append(event)
                if isinstance(event, RequestReceived):
                    headers = dict(event.headers)
                    if headers[b":method"] == b"GET":  # the warm-up
                        if self.answer_warmup:
                            self.respond(event.stream_id, body=b'{"data":[]}')
                    else:
                        self.requests.append(event.stream_id)
        down = self.h2.data_to_send()
        if down and self.conn.state is not State.CLOSED:
            self.conn.data_received(down)
        return bool(up or down)

    def respond(self, sid: int, status: int = 200, body: bytes = b"{}", end: bool = True,
                content_type: bytes = b"application/json") -> None:
        self.h2.send_headers(sid, [(b":status", str(status).encode()),
                                   (b"content-type", content_type)],
                             end_stream=not body and end)
        if body:
            self.send(sid, body, end)

    def send(self, sid: int, body: bytes, end: bool = False) -> None:
        step = self.h2.max_outbound_frame_size
        for off in range(0, len(body), step):
            last = end and off + step >= len(body)
            self.h2.send_data(sid, body[off:off + step], end_stream=last)

    def goaway(self, last_stream_id: int, error_code: int = 0) -> None:
        """A raw GOAWAY (h2 would close itself, and the test wants it to answer afterwards)."""
        self.pump_once()  # whatever the server queued goes first
        payload = struct.pack(">LL", last_stream_id, error_code)
        self.conn.data_received(raw_frame(7, 0, 0, payload))

    def window(self, sid: int | None = None) -> int:
        """What the server may still send: on the connection, or on stream `sid`."""
        if sid is None:
            return self.h2.outbound_flow_control_window
        return self.h2.local_flow_control_window(sid)


class PoolPeer:
    def __init__(self, codec: str = "framer", connections: int = 1, protocol: str = "h2",
                 pipeline: int = 1) -> None:
        self.loop = FakeLoop()
        self.stats = SharedStats(1)
        self.tally = Tally(self.stats.counters, 0)
        spec = UpstreamSpec(name="test", origin=f"https://{AUTHORITY}", protocol=protocol,
                            connections=connections, request_timeout_ms=REQUEST_TIMEOUT_MS,
                            api_key="sk-test", http1_pipeline=pipeline)
        options = EgressOptions(codec=factory(codec), stream_idle_timeout_s=IDLE_TIMEOUT_S,
                                queue_limit=64)
        self.codec = codec
        self.upstream = Upstream(spec, options, self.loop, self.tally)  # type: ignore[arg-type]
        self.pool = self.upstream.pool  # type: ignore[assignment]
        self.servers: dict[int, Server] = {}

    pool: H2Pool

    def connect(self, index: int = 0, warm: bool = True) -> Server:
        """Open connection `index` and warm it up (unless `warm` is false: its server then
        never answers the warm-up)."""
        conn = H2Connection(self.pool, index, make_codec(self.codec, AUTHORITY.encode(), b"https"))
        transport = FakeTransport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        server = self.servers[index] = Server(conn, transport)
        server.answer_warmup = warm
        self.pump()
        assert conn.state is (State.READY if warm else State.WARMING)
        return server

    def pump(self) -> None:
        for _ in range(10_000):
            self.loop.run_ready()
            moved = [s.pump_once() for s in list(self.servers.values())]
            if not any(moved) and not self.loop.ready:
                return
        raise AssertionError("the conversation did not settle")

    def submit(self, client: FakeClient | None = None) -> FakeClient:
        client = client or FakeClient()
        self.upstream.submit(client)
        self.upstream.flush()
        return client

    def counter(self, field: int) -> int:
        return self.stats.counters.get(0, field)

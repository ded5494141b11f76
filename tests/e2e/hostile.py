"""A scriptable hostile upstream for fault tests: HTTP/2 over TLS or h2c, or HTTP/1.1.

Unlike the bundled mock (velox_lab.mock), which behaves like a well-mannered provider, this server
misbehaves on purpose, in ways a test chooses. It runs an asyncio server on a daemon thread of
the test process (`with HostileUpstream(...) as up:`), listens on 127.0.0.1 only, and has the
`origin` and `ca_file` attributes `tests/e2e/conftest.gateway_env` expects of an upstream.

Connection-wide behaviour comes from its `Script` (attributes a test may change at any time;
they are read when the event they govern happens):

* `warmup`: "answer" (default) or "withhold": the warm-up GET is never answered.
* `silent_after_handshake`: once the preface is exchanged, ignore everything (TCP stays open,
  no PING ACK, no response): a silent upstream.
* `silent_after_requests`: go silent on a connection once it has received this many
  non-warm-up requests (the request that reaches the count is not answered either).
* `initial_window`: the INITIAL_WINDOW_SIZE we announce (0: request bodies cannot move).
* `protocol`: "h2" (default) or "http1" (ALPN offers only http/1.1; minimal HTTP/1.1 server).

Per-request behaviour comes from the request header `x-hostile` (no header: a small JSON 200):

* `stream=N`: a `text/event-stream` 200 with N body bytes in DATA frames of up to 16 KiB,
  respecting our peer's flow control (it waits for WINDOW_UPDATEs), then END_STREAM.
* `stream-reset=N`: the same N bytes, then RST_STREAM(INTERNAL_ERROR) instead of END_STREAM.
* `hang`: never answer this stream; the connection stays alive (PINGs are answered).
* `silent`: this connection goes silent from this request on.
* `conn-headers`: a 200 carrying connection-specific fields (`connection: x-hop`, `x-hop`,
  `keep-alive`, `transfer-encoding`, `upgrade`) next to an ordinary `x-kept` header.
* `continuation`: HEADERS without END_HEADERS followed by CONTINUATION frames without end
  (raw frames; at most `CONTINUATION_LIMIT` of them, 1 KiB each).
* `goaway`: GOAWAY(NO_ERROR) naming the stream before this one as the last processed.
* `bad-frame`: a connection WINDOW_UPDATE with a 3-byte payload (FRAME_SIZE_ERROR).

Counters (read from the test thread; plain ints and lists, updated on the server thread):
`connections`, `requests` (paths of non-warm-up requests, in arrival order), `warmups`,
`pings` (PING frames received, not ACKs), `streams_finished`, `resets_received`;
`send_windows()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import struct
import threading
from dataclasses import dataclass
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from velox_lab.mock.certs import ensure_certs

CONTINUATION_LIMIT = 20_000
_FRAME = 16_384
# The SSE body a `stream=` response repeats: ~16 KiB of one event line per frame.
_EVENT = b"data: " + b"x" * (_FRAME - 8) + b"\n\n"


@dataclass
class Script:
    warmup: str = "answer"
    silent_after_handshake: bool = False
    silent_after_requests: int | None = None
    initial_window: int | None = None
    protocol: str = "h2"
    warmup_path: str = "/v1/models"


class _H2Server(asyncio.Protocol):
    def __init__(self, owner: HostileUpstream) -> None:
        self.owner = owner
        self.script = owner.script
        self.transport: asyncio.Transport | None = None
        config = h2.config.H2Configuration(client_side=False, header_encoding=None,
                                           validate_outbound_headers=False,
                                           normalize_outbound_headers=False,
                                           validate_inbound_headers=False)
        self.conn = h2.connection.H2Connection(config=config)
        self.silent = False
        self.requests = 0
        self.window_open = asyncio.Event()
        self.pending: dict[int, h2.events.RequestReceived] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.owner.connections += 1
        self.owner.live.add(self)
        if self.script.initial_window is not None:
            self.conn.local_settings = h2.settings.Settings(
                client=False,
                initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE:
                                self.script.initial_window})
        self.conn.initiate_connection()
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner.live.discard(self)
        for task in self.tasks:
            task.cancel()
        self.window_open.set()

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        if self.silent:
            return
        try:
            events = self.conn.receive_data(data)
        except h2.exceptions.ProtocolError:
            self.flush()
            if self.transport is not None:
                self.transport.close()
            return
        for event in events:
            if self.silent:
                return
            if isinstance(event, h2.events.RequestReceived):
                if event.stream_ended is not None:
                    self._on_request(event)
                else:  # answer once the whole body is in (a zero window holds it back)
                    self.pending[event.stream_id] = event
            elif isinstance(event, h2.events.StreamEnded):
                request = self.pending.pop(event.stream_id, None)
                if request is not None:
                    self._on_request(request)
            elif isinstance(event, h2.events.PingReceived):
                self.owner.pings += 1
            elif isinstance(event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged,
                                    h2.events.StreamReset)):
                if isinstance(event, h2.events.StreamReset):
                    self.owner.resets_received += 1
                self.window_open.set()
            elif isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length,
                                                    event.stream_id)
            elif isinstance(event, h2.events.SettingsAcknowledged) and \
                    self.script.silent_after_handshake:
                self.silent = True
        self.flush()

    def _on_request(self, event: h2.events.RequestReceived) -> None:
        headers = dict(event.headers)
        sid = event.stream_id
        path = headers.get(b":path", b"").decode()
        if headers.get(b":method") == b"GET" and path == self.script.warmup_path \
                and b"x-hostile" not in headers:
            self.owner.warmups += 1
            if self.script.warmup == "withhold":
                return
            self._respond(sid, b'{"object":"list","data":[]}')
            return
        self.owner.requests.append(path)
        self.requests += 1
        limit = self.script.silent_after_requests
        if limit is not None and self.requests >= limit:
            self.silent = True
            return
        action, _, arg = headers.get(b"x-hostile", b"").decode().partition("=")
        if action in ("stream", "stream-reset"):
            self._start(self._stream(sid, int(arg), reset=action == "stream-reset"))
        elif action == "hang":
            return
        elif action == "silent":
            self.silent = True
        elif action == "conn-headers":
            self._respond(sid, b'{"ok":true}', extra=[
                (b"connection", b"x-hop"), (b"x-hop", b"secret"), (b"keep-alive", b"timeout=5"),
                (b"transfer-encoding", b"chunked"), (b"upgrade", b"h2c"), (b"x-kept", b"yes")])
        elif action == "continuation":
            self._start(self._continuation(sid))
        elif action == "goaway":
            self._raw(struct.pack(">LL", max(0, sid - 2), 0), 7, 0, 0)
        elif action == "bad-frame":
            self._raw(b"\x00\x00\x01", 8, 0, 0)
        else:
            self._respond(sid, b'{"ok":true}')

    def _respond(self, sid: int, body: bytes, extra: list | None = None) -> None:
        head = [(b":status", b"200"), (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode())] + (extra or [])
        self.conn.send_headers(sid, head)
        if self.conn.local_flow_control_window(sid) >= len(body):
            self.conn.send_data(sid, body, end_stream=True)
        else:  # the gateway's windows are closed: wait for credit like a real server
            self._start(self._stream(sid, 0, reset=False, body=body, counted=False))

    def _raw(self, payload: bytes, ftype: int, flags: int, sid: int) -> None:
        self.flush()
        if self.transport is not None:
            self.transport.write(struct.pack(">L", len(payload))[1:]
                                 + bytes((ftype, flags)) + struct.pack(">L", sid) + payload)

    def _start(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _stream(self, sid: int, total: int, reset: bool, body: bytes = b"",
                      counted: bool = True) -> None:
        conn = self.conn
        if body:
            total = len(body)
        else:
            body = _EVENT
            conn.send_headers(sid, [(b":status", b"200"),
                                    (b"content-type", b"text/event-stream")])
        self.flush()
        sent = 0
        try:
            while sent < total:
                if self.silent or self.transport is None or self.transport.is_closing():
                    return
                n = min(_FRAME, total - sent, conn.local_flow_control_window(sid),
                        conn.max_outbound_frame_size)
                if n <= 0:
                    self.window_open.clear()
                    await self.window_open.wait()
                    continue
                # No pause while the window lasts, however much the transport has buffered:
                # pausing on a full buffer (a gateway slowed by a busy host) let every stream
                # send a frame in turn, so the window ended up spread over all the streams
                # with none finished, which paused clients then hold for good. Streams now
                # take the window in the order they waited for it, as on a quiet host.
                conn.send_data(sid, body[:n] if body is _EVENT else body[sent:sent + n])
                sent += n
                self.owner.bytes_sent += n
                self.flush()
            if reset:
                conn.reset_stream(sid, h2.errors.ErrorCodes.INTERNAL_ERROR)
            else:
                conn.end_stream(sid)
            self.flush()
            self.owner.streams_finished += counted
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError, KeyError):
            return  # the client reset the stream: stop producing

    async def _continuation(self, sid: int) -> None:
        # HEADERS carrying ":status: 200" (HPACK static index 8) without END_HEADERS, then
        # CONTINUATION frames of literal junk headers, never END_HEADERS.
        self._raw(b"\x88", 1, 0, sid)
        junk = b"\x40\x03x-a\x7f\x81\x07" + b"a" * 1000  # literal with incremental indexing
        for _ in range(CONTINUATION_LIMIT):
            if self.transport is None or self.transport.is_closing():
                return
            self._raw(junk[:1024], 9, 0, sid)
            await asyncio.sleep(0)


class _H1Server(asyncio.Protocol):
    """Minimal HTTP/1.1: Content-Length request bodies, `x-hostile` actions as above (subset:
    conn-headers, hang, silent; anything else is a JSON 200)."""

    def __init__(self, owner: HostileUpstream) -> None:
        self.owner = owner
        self.script = owner.script
        self.buf = b""
        self.silent = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.owner.connections += 1
        self.owner.live.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner.live.discard(self)

    def data_received(self, data: bytes) -> None:
        if self.silent:
            return
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, _, rest = self.buf.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            method, path, _ = lines[0].split(b" ", 2)
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get(b"content-length", b"0"))
            if len(rest) < length:
                return
            self.buf = rest[length:]
            self._on_request(method, path.decode(), headers)
            if self.silent:
                return

    def _on_request(self, method: bytes, path: str, headers: dict) -> None:
        if method == b"GET" and path == self.script.warmup_path and b"x-hostile" not in headers:
            self.owner.warmups += 1
            if self.script.warmup == "withhold":
                self.silent = True
                return
            self._respond(b'{"object":"list","data":[]}')
            return
        self.owner.requests.append(path)
        action = headers.get(b"x-hostile", b"").decode()
        if action in ("hang", "silent"):
            self.silent = True
        elif action == "conn-headers":
            self._respond(b'{"ok":true}', b"connection: keep-alive, x-hop\r\nx-hop: secret\r\n"
                          b"keep-alive: timeout=5\r\nx-kept: yes\r\n")
        else:
            self._respond(b'{"ok":true}')

    def _respond(self, body: bytes, extra: bytes = b"") -> None:
        assert self.transport is not None
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n%s\r\n%s" % (len(body), extra, body))


class HostileUpstream:
    """`with HostileUpstream(certdir=..., script=Script(...)) as up:` (TLS when certdir)."""

    def __init__(self, certdir: str | None = None, script: Script | None = None) -> None:
        self.script = script or Script()
        self.certdir = certdir
        self.ca_file: str | None = None
        self.port = 0
        self.connections = 0
        self.warmups = 0
        self.pings = 0
        self.streams_finished = 0  # `stream=` / `stream-reset=` responses sent to the end
        self.bytes_sent = 0  # DATA payload of those responses, so far
        self.resets_received = 0  # RST_STREAM frames the gateway sent us
        self.requests: list[str] = []
        self.live: set[Any] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None

    @property
    def origin(self) -> str:
        return f"{'https' if self.certdir else 'http'}://127.0.0.1:{self.port}"

    def __enter__(self) -> HostileUpstream:
        ctx = None
        if self.certdir:
            paths = ensure_certs(self.certdir)
            self.ca_file = paths.ca_file
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(paths.cert_file, paths.key_file)
            ctx.set_alpn_protocols(["http/1.1"] if self.script.protocol == "http1" else ["h2"])
        started = threading.Event()
        loop = self._loop = asyncio.new_event_loop()

        def factory() -> asyncio.Protocol:
            return _H1Server(self) if self.script.protocol == "http1" else _H2Server(self)

        async def serve() -> None:
            self._server = await loop.create_server(factory, "127.0.0.1", 0, ssl=ctx)
            self.port = self._server.sockets[0].getsockname()[1]
            started.set()

        def run() -> None:
            loop.run_until_complete(serve())
            loop.run_forever()

        self._thread = threading.Thread(target=run, name="hostile-upstream", daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("the hostile upstream did not start")
        return self

    def send_windows(self) -> list[int]:
        """Our connection-level send window on each live HTTP/2 connection: how much more
        response body the gateway lets us send (0 means its receive window is exhausted)."""
        return [p.conn.outbound_flow_control_window for p in list(self.live)
                if isinstance(p, _H2Server)]

    def call(self, fn: Any) -> None:
        """Run fn() on the server's loop (e.g. to change behaviour of live connections)."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn)

    def __exit__(self, *exc: object) -> None:
        loop = self._loop
        if loop is None:
            return

        async def stop_after_the_closes() -> None:
            # The transports just aborted (and any closing already) finish on the loop's next
            # passes (connection_lost, TLS teardown): stop only then, so none outlives the loop.
            for _ in range(5):
                await asyncio.sleep(0)
            loop.stop()

        def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for proto in list(self.live):
                if proto.transport is not None:
                    proto.transport.abort()
            loop.create_task(stop_after_the_closes())

        loop.call_soon_threadsafe(shutdown)
        if self._thread is not None:
            self._thread.join(10)
        with contextlib.suppress(Exception):
            loop.close()

"""asyncio shell for HTTP/1.1 on httptools: keep-alive, pipelining, chunked bodies.

Requests are parsed by httptools (Content-Length and chunked request bodies, `Expect:
100-continue`) and answered strictly in order. Like the HTTP/2 shell, an immediate response is
written synchronously from `data_received`; delayed ones use a timer, streams and faults a task.
Responses carry `connection: keep-alive` (or `close`) on purpose: a hop-by-hop header the
gateway must not forward. A client disconnecting mid-response counts as `streams_cancelled`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from http import HTTPStatus

import httptools

from .behaviour import Plan, error_plan
from .state import MockState

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_MAX_QUEUED = 64  # pipelined requests parsed ahead before we stop reading
MAX_BODY = 64 << 20  # request bodies are buffered whole; beyond this the client gets a 413
_status_lines = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in HTTPStatus}
_static_blocks: dict[tuple, bytes] = {}


def _static_block(headers: tuple[tuple[bytes, bytes], ...]) -> bytes:
    block = _static_blocks.get(headers)
    if block is None:
        block = b"".join(n + b": " + v + b"\r\n" for n, v in headers)
        if len(_static_blocks) >= 4096:
            _static_blocks.clear()
        _static_blocks[headers] = block
    return block


def response_head(plan: Plan, keep_alive: bool) -> bytes:
    parts = [_status_lines.get(plan.status) or b"HTTP/1.1 %d Mock\r\n" % plan.status,
             _static_block(plan.static)]
    for name, value in plan.dynamic:
        parts.append(name + b": " + value + b"\r\n")
    if plan.content_length is not None:
        parts.append(b"content-length: %d\r\n" % plan.content_length)
    else:
        parts.append(b"transfer-encoding: chunked\r\n")
    parts.append(b"connection: keep-alive\r\n\r\n" if keep_alive else b"connection: close\r\n\r\n")
    return b"".join(parts)


class H1Protocol(asyncio.Protocol):
    def __init__(self, state: MockState) -> None:
        self.state = state
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[tuple] = deque()
        self.busy = False  # a response is being produced; later requests wait their turn
        self.current: list | None = None  # log record of that response
        self.current_live = False  # the in-progress response is a real (non-control) one
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task | None = None
        self.control = False
        self.seen_request = False
        self.self_closed = False
        self.broken = False  # unusable input seen; see _fail()
        self.reading_paused = False
        self.write_paused = False
        self._writable: asyncio.Future | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._expect = False
        self._size = 0
        self._upgrade: tuple | None = None

    # -- transport callbacks --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.broken:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            # Upgrade (e.g. to h2c) is optional for a server and we decline it. The parser
            # stopped right after the headers, body unread, so parse that request again
            # without its Upgrade header, followed by everything that came after it.
            upgrade, self._upgrade = self._upgrade, None
            if upgrade is None or upgrade[0] == b"CONNECT":  # a tunnel: nothing to replay
                return self._fail(b"CONNECT is not supported")
            method, url, headers = upgrade
            head = b"".join([method, b" ", url, b" HTTP/1.1\r\n"]
                            + [n + b": " + v + b"\r\n" for n, v in headers if n != b"upgrade"])
            self.parser = httptools.HttpRequestParser(self)
            self.data_received(head + b"\r\n" + data[exc.args[0]:])
        except httptools.HttpParserError as exc:
            self._fail(b"body too large" if self._size > MAX_BODY else str(exc).encode())

    def _fail(self, reason: bytes) -> None:
        """Unusable input: answer what came before, then an error, then close."""
        self.broken = True
        self.queue.append((None, reason, [], b"", False))
        if not self.busy:
            self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.busy and self.current_live and not self.self_closed:
            self.state.cancelled(self.current)
        if self.timer is not None:
            self.timer.cancel()
        if self.task is not None:
            self.task.cancel()
        if self._writable is not None and not self._writable.done():
            self._writable.cancel()
        self.queue.clear()
        self.state.connection_closed(self, self.control)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def shutdown(self) -> None:
        self.self_closed = True
        if self.transport is not None:
            self.transport.close()

    # -- httptools callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._body = []
        self._size = 0
        self._expect = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        # Only when nothing is in flight: a 100 must not land inside an earlier response.
        if self._expect and not self.busy and not self.queue:
            self.transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > MAX_BODY:
            raise ValueError("body too large")  # surfaces as HttpParserCallbackError
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self.parser.should_upgrade():
            self._upgrade = (self.parser.get_method(), self._url, self._headers)
            return
        body = self._body
        self.queue.append((self.parser.get_method(), self._url, self._headers,
                           body[0] if len(body) == 1 else b"".join(body),
                           self.parser.should_keep_alive()))
        if not self.busy:
            self._next()
        elif len(self.queue) >= _MAX_QUEUED and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    # -- executing plans ------------------------------------------------------------------

    def _next(self) -> None:
        """Answer queued requests in order until one needs to wait."""
        transport = self.transport
        while self.queue and not self.busy and not transport.is_closing():
            method, target, headers, body, keep_alive = self.queue.popleft()
            if method is None:  # parse error: answer 400 and close
                too_big = target == b"body too large"
                plan = error_plan(413 if too_big else 400,
                                  f"Request body larger than {MAX_BODY} bytes" if too_big
                                  else f"Malformed HTTP request: {target.decode()}")
                record, keep_alive = None, False
            else:
                if not self.seen_request:  # before handle(): a stats snapshot excludes us
                    self.seen_request = True
                    if target[:7] == b"/_mock/":
                        self.control = True
                        self.state.mark_control()
                plan, record = self.state.handle("http/1.1", method, target, headers, body)
            if plan.simple:
                transport.write(response_head(plan, keep_alive) + plan.body)  # type: ignore
                if record is not None:
                    self.state.completed()
                if not keep_alive:
                    transport.close()
                continue
            self.busy = True
            self.current = record
            self.current_live = record is not None
            if plan.fault is None and plan.body is not None:
                self.timer = self.loop.call_later(plan.latency, self._send_delayed, plan,
                                                  keep_alive)
            else:
                self.task = self.loop.create_task(self._run(plan, keep_alive))
        if self.reading_paused and len(self.queue) < _MAX_QUEUED // 2 \
                and not transport.is_closing():
            self.reading_paused = False
            transport.resume_reading()

    def _send_delayed(self, plan: Plan, keep_alive: bool) -> None:
        self.timer = None
        self.transport.write(response_head(plan, keep_alive) + plan.body)  # type: ignore
        self._done(keep_alive)

    def _done(self, keep_alive: bool, completed: bool = True) -> None:
        if completed and self.current_live:
            self.state.completed()
        self.busy = False
        self.current = None
        self.current_live = False
        self.task = None
        if not keep_alive:
            self.transport.close()
        else:
            self._next()

    def _drop(self) -> None:
        self.self_closed = True
        self.transport.abort()

    async def _run(self, plan: Plan, keep_alive: bool) -> None:
        transport = self.transport
        try:
            if plan.latency:
                await asyncio.sleep(plan.latency)
            fault = plan.fault
            if fault == "hang":
                await self.loop.create_future()  # until the client goes away
            if fault in ("reset", "close"):
                return self._drop()
            if fault == "goaway":  # HTTP/1.1 analogue: close without answering, gracefully
                self.self_closed = True
                transport.close()
                return
            chunked = plan.content_length is None
            head = response_head(plan, keep_alive)
            if plan.body is not None:
                transport.write(head + plan.body)
                return self._done(keep_alive)
            transport.write(head)
            parts = plan.parts or []
            cut = min(2, len(parts) - 1) if fault == "reset-mid-stream" else -1
            for i, part in enumerate(parts):
                if i == cut:
                    return self._drop()
                if i and plan.part_delay:
                    await asyncio.sleep(plan.part_delay)
                if chunked:
                    transport.write(b"%x\r\n%s\r\n" % (len(part), part))
                else:
                    transport.write(part)
                if self.write_paused:
                    await self._wait_writable()
            if chunked:
                transport.write(b"0\r\n\r\n")
            self._done(keep_alive)
        except asyncio.CancelledError:
            pass

    async def _wait_writable(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = self.loop.create_future()
        await self._writable

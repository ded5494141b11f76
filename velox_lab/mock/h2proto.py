"""asyncio shell around the sans-IO `H2Server`: executes plans on HTTP/2 streams.

The hot path (no latency, no fault, body fits the windows) is synchronous inside
`data_received`: every request parsed from one read is answered before the single write at
the end, so a batch of requests costs one TLS record and one send(). Delayed responses use a
timer handle; streams, faults and flow-control waits use a task per stream. Client RST_STREAM
cancels the stream's timer or task and counts as `streams_cancelled`.
"""

from __future__ import annotations

import asyncio

from . import h2server as h2
from .behaviour import Plan
from .hpackenc import encode_response
from .state import BYTES_RECEIVED, GOAWAYS_SENT, REFUSED, MockState

GOAWAY_GRACE = 0.1  # seconds a connection lingers after our GOAWAY for in-flight streams
MAX_BODY = 64 << 20


class _Active:
    """A response being produced (delayed, streamed, hanging or flow-blocked)."""

    __slots__ = ("record", "timer", "task", "drain", "finishing")

    def __init__(self, record: list | None) -> None:
        self.record = record
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task | None = None
        self.drain: asyncio.Future | None = None
        self.finishing = False  # everything queued; waiting for flow control to send it

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.task is not None:
            self.task.cancel()


class H2Protocol(asyncio.Protocol):
    def __init__(self, state: MockState) -> None:
        self.state = state
        self.conn = h2.H2Server(self, max_concurrent_streams=state.max_concurrent_streams,
                                goaway_after=state.goaway_after)
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.receiving: dict[int, list] = {}  # sid -> [method, path, headers, parts, size]
        self.active: dict[int, _Active] = {}
        self.control = False
        self.seen_request = False
        self.self_closed = False  # we dropped the connection on purpose: not a client cancel
        self.draining = False
        self.drain_deadline = 0.0
        self.write_paused = False
        self._writable: asyncio.Future | None = None
        self._flush_pending = False

    # -- transport callbacks --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.conn.initiate()
        transport.write(self.conn.data_to_send())  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        conn.receive_data(data)
        out = conn.data_to_send()
        if out and not self.transport.is_closing():
            self.transport.write(out)
        if conn.closed:
            self._drop(abort=False)

    def connection_lost(self, exc: Exception | None) -> None:
        count = not self.self_closed
        for act in self.active.values():
            act.stop()
            if count:
                self.state.cancelled(act.record)
        if count:
            for _ in self.receiving:
                self.state.cancelled(None)
        self.active.clear()
        self.receiving.clear()
        if self._writable is not None and not self._writable.done():
            self._writable.cancel()
        self.state.connection_closed(self, self.control)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def shutdown(self) -> None:
        """Server stopping: tell the client, then close."""
        self.self_closed = True
        if not self.conn.goaway_sent:
            self.conn.goaway(self.conn.last_accepted)
        self._drop(abort=False)

    # -- H2Handler callbacks --------------------------------------------------------------

    def on_request(self, sid: int, method: bytes, path: bytes, headers: list,
                   end_stream: bool) -> None:
        if end_stream:
            self._dispatch(sid, method, path, headers, b"")
        else:
            self.receiving[sid] = [method, path, headers, [], 0]

    def on_data(self, sid: int, data: bytes, end_stream: bool) -> None:
        req = self.receiving.get(sid)
        if req is None:
            return
        if data:
            req[3].append(data)
            req[4] += len(data)
            if req[4] > MAX_BODY:
                del self.receiving[sid]
                self.state.count(BYTES_RECEIVED, req[4])
                self.conn.reset_stream(sid, h2.ENHANCE_YOUR_CALM)
                return
        if end_stream:
            del self.receiving[sid]
            parts = req[3]
            body = parts[0] if len(parts) == 1 else b"".join(parts)
            self._dispatch(sid, req[0], req[1], req[2], body)

    def on_reset(self, sid: int, code: int, by_peer: bool) -> None:
        if code == h2.REFUSED_STREAM and not by_peer:
            self.state.count(REFUSED)
            return
        was_receiving = self.receiving.pop(sid, None) is not None
        act = self.active.pop(sid, None)
        if act is not None:
            act.stop()
        if by_peer and (act is not None or was_receiving):
            self.state.cancelled(act.record if act is not None else None)
        self._maybe_close()

    def on_goaway(self, last_sid: int, code: int) -> None:
        # The client will open no more streams: finish what is in flight, then close.
        self.draining = True
        self._maybe_close()

    def on_goaway_sent(self, last_sid: int, code: int) -> None:
        self.state.count(GOAWAYS_SENT)
        if not self.draining:
            self.draining = True
            self.drain_deadline = self.loop.time() + GOAWAY_GRACE
            self.loop.call_later(GOAWAY_GRACE, self._maybe_close)

    def on_drained(self, sid: int) -> None:
        act = self.active.get(sid)
        if act is None:
            return
        if act.finishing:
            self._finish(sid)
        elif act.drain is not None and not act.drain.done():
            act.drain.set_result(None)

    # -- executing plans ------------------------------------------------------------------

    def _dispatch(self, sid: int, method: bytes, path: bytes, headers: list,
                  body: bytes) -> None:
        if not self.seen_request:  # before handle(): a stats snapshot must exclude us
            self.seen_request = True
            if path[:7] == b"/_mock/":
                self.control = True
                self.state.mark_control()
        plan, record = self.state.handle("h2", method, path, headers, body)
        if plan.simple:
            if self._send_whole(sid, plan):
                if record is not None:
                    self.state.completed()
            else:
                act = self.active[sid] = _Active(record)
                act.finishing = True
            return
        act = self.active[sid] = _Active(record)
        if plan.fault is None and plan.body is not None:
            act.timer = self.loop.call_later(plan.latency, self._send_delayed, sid, plan)
        else:
            act.task = self.loop.create_task(self._run(sid, plan, act))

    def _headers(self, plan: Plan) -> bytes:
        dynamic = plan.dynamic
        if plan.content_length is not None:
            dynamic = [*dynamic, (b"content-length", b"%d" % plan.content_length)]
        return encode_response(plan.status, plan.static, dynamic)

    def _send_whole(self, sid: int, plan: Plan) -> bool:
        """Headers + body; False if flow control holds part of the body back."""
        conn = self.conn
        conn.send_headers(sid, self._headers(plan))
        return not conn.send_data(sid, plan.body, True)  # type: ignore[arg-type]

    def _send_delayed(self, sid: int, plan: Plan) -> None:
        act = self.active.get(sid)
        if act is None:
            return
        if self._send_whole(sid, plan):
            self._finish(sid)
        else:
            act.finishing = True
        self._schedule_flush()

    async def _run(self, sid: int, plan: Plan, act: _Active) -> None:
        conn = self.conn
        try:
            if plan.latency:
                await asyncio.sleep(plan.latency)
            fault = plan.fault
            if fault == "hang":
                await self.loop.create_future()  # until the client resets or disconnects
            if fault == "reset":
                conn.reset_stream(sid, h2.INTERNAL_ERROR)
                self._finish(sid, completed=False)
                return self._schedule_flush()
            if fault == "close":
                return self._drop(abort=True)
            if fault == "goaway":
                return self._goaway_before(sid)
            conn.send_headers(sid, self._headers(plan))
            parts = plan.parts if plan.body is None else [plan.body]
            last = len(parts) - 1  # type: ignore[arg-type]
            cut = min(2, last) if fault == "reset-mid-stream" else -1
            for i, part in enumerate(parts):  # type: ignore[arg-type]
                if i == cut:
                    conn.reset_stream(sid, h2.INTERNAL_ERROR)
                    self._finish(sid, completed=False)
                    return self._schedule_flush()
                if i and plan.part_delay:
                    self._schedule_flush()
                    await asyncio.sleep(plan.part_delay)
                if conn.send_data(sid, part, i == last):
                    await self._wait_drained(act)
                if self.write_paused:
                    self._flush()
                    await self._wait_writable()
            self._schedule_flush()
            self._finish(sid)
        except asyncio.CancelledError:
            pass

    async def _wait_drained(self, act: _Active) -> None:
        self._flush()
        act.drain = self.loop.create_future()
        await act.drain
        act.drain = None

    async def _wait_writable(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = self.loop.create_future()
        await self._writable

    def _goaway_before(self, sid: int) -> None:
        """Fault `goaway`: this stream (and later ones) were not processed."""
        last = max(sid - 2, 0)
        for other in [s for s in self.active if s > last] + \
                [s for s in self.receiving if s > last]:
            act = self.active.pop(other, None)
            if act is not None and other != sid:
                act.stop()
            self.receiving.pop(other, None)
            self.conn.forget_stream(other)
        self.conn.goaway(last)
        self._flush()

    def _finish(self, sid: int, completed: bool = True) -> None:
        if self.active.pop(sid, None) is not None and completed:
            self.state.completed()
        if self.draining:
            self._maybe_close()

    def _maybe_close(self) -> None:
        if not self.draining or self.active or self.receiving or self.transport is None:
            return
        if self.conn.goaway_sent:
            left = self.drain_deadline - self.loop.time()
            if left > 0:
                # The grace timer may fire a hair early (the loop's clock and its timers round
                # differently): look again when the grace is really over, or the connection
                # would never be closed.
                self.loop.call_later(left, self._maybe_close)
                return
        self._drop(abort=False)

    # -- output ---------------------------------------------------------------------------

    def _schedule_flush(self) -> None:
        # Coalesce output of timers/tasks firing in the same loop iteration into one write.
        if not self._flush_pending:
            self._flush_pending = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        out = self.conn.data_to_send()
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(out)

    def _drop(self, abort: bool) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.self_closed = self.self_closed or abort or self.conn.closed or self.draining
        if abort:
            self.transport.abort()
        else:
            self._flush()
            self.transport.close()

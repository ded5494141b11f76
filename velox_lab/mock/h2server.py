"""Sans-IO server side of HTTP/2 (RFC 9113) for the mock upstream.

`H2Server` turns bytes from a client into calls on a handler (request headers, body data,
resets, GOAWAY, "this stream's send buffer drained") and queues the bytes to send back
(`data_to_send`). It does no I/O and knows nothing about asyncio, so the asyncio shell stays
thin and the framing can be exercised directly.

It is hand-written rather than built on the `h2` package because the mock shares two cores with the
gateway and the load generator during benchmarks: a request costs a few microseconds here where the
general-purpose `h2` state machine spends well over 100 µs. It implements what a server needs and
nothing more: no server push, no priority scheduling, no dynamic-table HPACK encoding. Responses are
encoded statelessly (static-table indexes and literals without indexing), which is legal whatever
the peer's SETTINGS_HEADER_TABLE_SIZE and lets constant header sets be cached.
"""

from __future__ import annotations

import struct
from typing import Protocol

try:  # the Rust HPACK decoder is ~10x faster; the pure-Python one is the portable fallback
    from jh2._hazmat import Decoder as _FastDecoder
except ImportError:  # pragma: no cover - depends on the environment
    _FastDecoder = None
import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0, 1, 2, 3, 4
PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 5, 6, 7, 8, 9
FLAG_END_STREAM = FLAG_ACK = 0x1
FLAG_END_HEADERS, FLAG_PADDED, FLAG_PRIORITY = 0x4, 0x8, 0x20

NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = 0x5, 0x6, 0x7, 0x8
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x9, 0xB

MAX_WINDOW = 2**31 - 1
# Receive windows: large enough that a 16 MiB body streams without stalling on round trips,
# credited back as soon as data is handed to the shell (which buffers it).
STREAM_RECV_WINDOW = 1 << 20
CONN_RECV_WINDOW = 16 << 20
MAX_RECV_FRAME = 16384  # we never advertise more, so anything larger is a FRAME_SIZE_ERROR
MAX_HEADER_BLOCK = 256 << 10

_FRAME = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id
_U32 = struct.Struct(">I")
_SETTING = struct.Struct(">HI")
_GOAWAY = struct.Struct(">II")
_CONNECTION_SPECIFIC = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade")
)


class H2Handler(Protocol):
    """What the shell implements; `H2Server` calls these while parsing input."""

    def on_request(self, sid: int, method: bytes, path: bytes, headers: list,
                   end_stream: bool) -> None: ...
    def on_data(self, sid: int, data: bytes, end_stream: bool) -> None: ...
    def on_reset(self, sid: int, code: int, by_peer: bool) -> None: ...
    def on_goaway(self, last_sid: int, code: int) -> None: ...
    def on_drained(self, sid: int) -> None: ...
    def on_goaway_sent(self, last_sid: int, code: int) -> None: ...


class H2ConnectionError(Exception):
    """A connection error (RFC 9113 §5.4.1): answered with GOAWAY, then the connection closes."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class _Stream:
    __slots__ = ("sid", "send_window", "recv_window", "recv_unacked", "recv_open", "send_open",
                 "pending", "pending_end")

    def __init__(self, sid: int, send_window: int) -> None:
        self.sid = sid
        self.send_window = send_window
        self.recv_window = STREAM_RECV_WINDOW
        self.recv_unacked = 0
        self.recv_open = True
        self.send_open = True
        self.pending = bytearray()  # response body held back by flow control
        self.pending_end = False


def _frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return _FRAME.pack(len(payload) << 8 | ftype, flags, sid) + payload


class H2Server:
    """One server-side HTTP/2 connection; see the module docstring."""

    def __init__(self, handler: H2Handler, *, max_concurrent_streams: int = 1000,
                 goaway_after: int = 0) -> None:
        self.handler = handler
        self.max_concurrent_streams = max_concurrent_streams
        self.goaway_after = goaway_after
        self.streams: dict[int, _Stream] = {}
        self.closed = False  # a connection error occurred: flush, then close the transport
        self.goaway_sent = False
        self.last_peer_sid = 0  # highest stream id the client has used
        self.last_accepted = 0  # highest stream id handed to the shell
        self.accepted = 0
        self._out: list[bytes] = []
        self._buf, self._preface = b"", False  # unparsed input; connection preface seen
        self._conn_send_window = 65535
        self._conn_recv_window = CONN_RECV_WINDOW
        self._conn_unacked = 0
        self._peer_initial_window = 65535
        self._peer_max_frame = 16384
        self._blocked: dict[int, _Stream] = {}  # streams with pending data, in arrival order
        self._cont_sid = 0  # stream whose header block continues in CONTINUATION frames
        self._cont_parts: list[bytes] = []
        self._cont_end_stream = False
        self._fast = _FastDecoder is not None
        self._decoder = (_FastDecoder if self._fast else hpack.Decoder)(
            max_header_list_size=MAX_HEADER_BLOCK)

    # -- output ---------------------------------------------------------------------------

    def initiate(self) -> None:
        """Queue the server preface: SETTINGS, then widen the connection receive window."""
        settings = (_SETTING.pack(3, self.max_concurrent_streams)
                    + _SETTING.pack(4, STREAM_RECV_WINDOW)
                    + _SETTING.pack(6, MAX_HEADER_BLOCK))
        self._out.append(_frame(SETTINGS, 0, 0, settings))
        self._out.append(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(CONN_RECV_WINDOW - 65535)))

    def data_to_send(self) -> bytes:
        data = b"".join(self._out)
        self._out.clear()
        return data

    def send_headers(self, sid: int, block: bytes, end_stream: bool = False) -> None:
        st = self.streams.get(sid)
        if st is None or not st.send_open:
            return
        out = self._out
        flags = FLAG_END_HEADERS | FLAG_END_STREAM if end_stream else FLAG_END_HEADERS
        limit = self._peer_max_frame
        if len(block) <= limit:
            out.append(_FRAME.pack(len(block) << 8 | HEADERS, flags, sid))
            out.append(block)
        else:  # too big for one frame: HEADERS, then CONTINUATION frames
            pieces = [block[i:i + limit] for i in range(0, len(block), limit)]
            out.append(_frame(HEADERS, flags & ~FLAG_END_HEADERS, sid, pieces[0]))
            for i, piece in enumerate(pieces[1:], 2):
                last = i == len(pieces)
                out.append(_frame(CONTINUATION, FLAG_END_HEADERS if last else 0, sid, piece))
        if end_stream:
            self._local_end(st)

    def send_data(self, sid: int, data: bytes, end_stream: bool = False) -> int:
        """Send (or queue behind flow control) body bytes; returns the bytes left pending."""
        st = self.streams.get(sid)
        if st is None or not st.send_open:
            return 0
        if st.pending:
            st.pending += data
            st.pending_end = st.pending_end or end_stream
            return len(st.pending)
        n = len(data)
        if n <= st.send_window and n <= self._conn_send_window and n <= self._peer_max_frame:
            # The common case: one frame, no queueing.
            st.send_window -= n
            self._conn_send_window -= n
            self._out.append(_FRAME.pack(n << 8 | DATA, FLAG_END_STREAM if end_stream else 0,
                                         sid))
            if n:
                self._out.append(data)
            if end_stream:
                self._local_end(st)
            return 0
        st.pending += data
        st.pending_end = end_stream
        self._blocked[sid] = st
        self._flush_stream(st)
        return len(st.pending)

    def reset_stream(self, sid: int, code: int = CANCEL) -> None:
        st = self.streams.pop(sid, None)
        if st is not None:
            self._blocked.pop(sid, None)
            self._out.append(_frame(RST_STREAM, 0, sid, _U32.pack(code)))

    def forget_stream(self, sid: int) -> None:
        """Drop a stream silently, e.g. one above the last_stream_id of a GOAWAY we sent."""
        self.streams.pop(sid, None)
        self._blocked.pop(sid, None)

    def goaway(self, last_sid: int, code: int = NO_ERROR, debug: bytes = b"") -> None:
        """Queue GOAWAY; streams above `last_sid` are then ignored and must be dropped."""
        self.goaway_sent = True
        self._out.append(_frame(GOAWAY, 0, 0, _GOAWAY.pack(last_sid, code) + debug))
        self.handler.on_goaway_sent(last_sid, code)

    def _local_end(self, st: _Stream) -> None:
        st.send_open = False
        self.streams.pop(st.sid, None)
        if st.recv_open:
            # The response is complete before the request body: tell the client to stop
            # sending (RFC 9113 §8.1) rather than keep crediting a body nobody reads.
            self._out.append(_frame(RST_STREAM, 0, st.sid, _U32.pack(NO_ERROR)))

    def _flush_stream(self, st: _Stream) -> None:
        out, limit = self._out, self._peer_max_frame
        pending = st.pending
        while pending:
            n = min(len(pending), st.send_window, self._conn_send_window, limit)
            if n <= 0:
                return  # still blocked; a WINDOW_UPDATE or SETTINGS will resume it
            chunk = bytes(pending[:n])
            del pending[:n]
            st.send_window -= n
            self._conn_send_window -= n
            end = st.pending_end and not pending
            out.append(_FRAME.pack(n << 8 | DATA, FLAG_END_STREAM if end else 0, st.sid))
            out.append(chunk)
        self._blocked.pop(st.sid, None)
        if st.pending_end:  # END_STREAM rode on the last frame above
            st.pending_end = False
            self._local_end(st)
        self.handler.on_drained(st.sid)

    def _flush_blocked(self) -> None:
        for st in list(self._blocked.values()):
            if self._conn_send_window <= 0:
                break
            self._flush_stream(st)

    # -- input ----------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        if self.closed:
            return
        buf = self._buf + data if self._buf else data
        pos = 0
        try:
            if not self._preface:
                if not (PREFACE.startswith(buf) if len(buf) < 24 else buf[:24] == PREFACE):
                    raise H2ConnectionError(PROTOCOL_ERROR, "bad connection preface")
                if len(buf) < 24:
                    self._buf = buf
                    return
                self._preface, pos = True, 24
            n = len(buf)
            unpack = _FRAME.unpack_from
            while n - pos >= 9:
                lt, flags, sid = unpack(buf, pos)
                length = lt >> 8
                if length > MAX_RECV_FRAME:
                    raise H2ConnectionError(FRAME_SIZE_ERROR, "frame too large")
                end = pos + 9 + length
                if end > n:
                    break
                payload = buf[pos + 9:end]
                pos = end
                self._frame_received(lt & 0xFF, flags, sid & 0x7FFFFFFF, payload)
            self._buf = buf[pos:] if pos < n else b""
        except H2ConnectionError as exc:
            self.closed = True
            self._buf = b""
            self.goaway(self.last_peer_sid, exc.code, str(exc).encode())

    def _frame_received(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if self._cont_sid and ftype != CONTINUATION:
            raise H2ConnectionError(PROTOCOL_ERROR, "expected CONTINUATION")
        if ftype == HEADERS:
            self._on_headers(flags, sid, payload)
        elif ftype == DATA:
            self._on_data(flags, sid, payload)
        elif ftype == WINDOW_UPDATE:
            self._on_window_update(sid, payload)
        elif ftype == SETTINGS:
            self._on_settings(flags, sid, payload)
        elif ftype == RST_STREAM:
            if sid == 0 or len(payload) != 4:
                raise H2ConnectionError(PROTOCOL_ERROR if sid == 0 else FRAME_SIZE_ERROR,
                                       "bad RST_STREAM")
            if sid > self.last_peer_sid:
                raise H2ConnectionError(PROTOCOL_ERROR, "RST_STREAM on idle stream")
            if self.streams.pop(sid, None) is not None:
                self._blocked.pop(sid, None)
                self.handler.on_reset(sid, _U32.unpack(payload)[0], True)
        elif ftype == PING:
            if sid != 0 or len(payload) != 8:
                raise H2ConnectionError(PROTOCOL_ERROR if sid else FRAME_SIZE_ERROR, "bad PING")
            if not flags & FLAG_ACK:
                self._out.append(_frame(PING, FLAG_ACK, 0, payload))
        elif ftype == PRIORITY:
            if sid == 0:
                raise H2ConnectionError(PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(payload) != 5:
                self._stream_error(sid, FRAME_SIZE_ERROR)
        elif ftype == GOAWAY:
            if sid != 0 or len(payload) < 8:
                raise H2ConnectionError(PROTOCOL_ERROR, "bad GOAWAY")
            last, code = _GOAWAY.unpack_from(payload)
            self.handler.on_goaway(last & 0x7FFFFFFF, code)
        elif ftype == CONTINUATION:
            self._on_continuation(flags, sid, payload)
        elif ftype == PUSH_PROMISE:
            raise H2ConnectionError(PROTOCOL_ERROR, "client sent PUSH_PROMISE")
        # Unknown frame types are ignored (RFC 9113 §4.1).

    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0 or not sid & 1:
            raise H2ConnectionError(PROTOCOL_ERROR, "HEADERS on an invalid stream id")
        if flags & FLAG_PADDED:
            payload = self._strip_padding(payload)
        if flags & FLAG_PRIORITY:
            payload = payload[5:]
        if not flags & FLAG_END_HEADERS:
            self._cont_sid = sid
            self._cont_parts = [payload]
            self._cont_end_stream = bool(flags & FLAG_END_STREAM)
            return
        self._header_block(sid, payload, bool(flags & FLAG_END_STREAM))

    def _on_continuation(self, flags: int, sid: int, payload: bytes) -> None:
        if not self._cont_sid or sid != self._cont_sid:
            raise H2ConnectionError(PROTOCOL_ERROR, "unexpected CONTINUATION")
        self._cont_parts.append(payload)
        if sum(map(len, self._cont_parts)) > MAX_HEADER_BLOCK:
            raise H2ConnectionError(ENHANCE_YOUR_CALM, "header block too large")
        if flags & FLAG_END_HEADERS:
            block = b"".join(self._cont_parts)
            self._cont_sid, self._cont_parts = 0, []
            self._header_block(sid, block, self._cont_end_stream)

    def _header_block(self, sid: int, block: bytes, end_stream: bool) -> None:
        # Decode even blocks we will ignore: the HPACK dynamic table is connection state.
        try:
            if self._fast:
                headers = [(h[0], h[1]) for h in self._decoder.decode(block)]
            else:
                headers = [(h[0], h[1]) for h in self._decoder.decode(block, raw=True)]
        except Exception as exc:
            raise H2ConnectionError(COMPRESSION_ERROR, f"HPACK: {exc}") from None
        st = self.streams.get(sid)
        if st is not None:  # trailers
            if not st.recv_open or not end_stream:
                self._stream_error(sid, PROTOCOL_ERROR if st.recv_open else STREAM_CLOSED)
                return
            st.recv_open = False
            self.handler.on_data(sid, b"", True)
            return
        if sid <= self.last_peer_sid:
            return  # a stream we already closed or reset; late frames are ignored (§5.4.2)
        self.last_peer_sid = sid
        if self.goaway_sent:
            return
        if self.goaway_after and self.accepted >= self.goaway_after:
            self.goaway(self.last_accepted)
            return
        if len(self.streams) >= self.max_concurrent_streams:
            self._out.append(_frame(RST_STREAM, 0, sid, _U32.pack(REFUSED_STREAM)))
            self.handler.on_reset(sid, REFUSED_STREAM, False)
            return
        method = path = None
        regular = False
        for name, value in headers:
            if name[:1] == b":":
                if regular:
                    method = None
                    break
                if name == b":method":
                    method = value
                elif name == b":path":
                    path = value
                elif name not in (b":scheme", b":authority"):
                    method = None
                    break
            else:
                regular = True
                if name in _CONNECTION_SPECIFIC:
                    method = None
                    break
        if method is None or path is None:
            self._out.append(_frame(RST_STREAM, 0, sid, _U32.pack(PROTOCOL_ERROR)))
            return
        st = _Stream(sid, self._peer_initial_window)
        if end_stream:
            st.recv_open = False
        self.streams[sid] = st
        self.accepted += 1
        self.last_accepted = sid
        self.handler.on_request(sid, method, path, headers, end_stream)

    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise H2ConnectionError(PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        # Flow control counts the whole payload, padding included, whatever the stream state.
        self._conn_recv_window -= size
        if self._conn_recv_window < 0:
            raise H2ConnectionError(FLOW_CONTROL_ERROR, "connection window exceeded")
        self._conn_unacked += size
        st = self.streams.get(sid)
        if st is None or not st.recv_open:
            if sid > self.last_peer_sid:
                raise H2ConnectionError(PROTOCOL_ERROR, "DATA on idle stream")
            if st is not None:
                self._stream_error(sid, STREAM_CLOSED)
            return
        st.recv_window -= size
        if st.recv_window < 0:
            self._stream_error(sid, FLOW_CONTROL_ERROR)
            return
        if flags & FLAG_PADDED:
            payload = self._strip_padding(payload)
        end = bool(flags & FLAG_END_STREAM)
        if end:
            st.recv_open = False
        else:
            st.recv_unacked += size
            if st.recv_unacked >= STREAM_RECV_WINDOW // 2:
                self._out.append(_frame(WINDOW_UPDATE, 0, sid, _U32.pack(st.recv_unacked)))
                st.recv_window += st.recv_unacked
                st.recv_unacked = 0
        if self._conn_unacked >= CONN_RECV_WINDOW // 2:
            self._credit_connection()
        self.handler.on_data(sid, payload, end)

    def _credit_connection(self) -> None:
        self._out.append(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._conn_unacked)))
        self._conn_recv_window += self._conn_unacked
        self._conn_unacked = 0

    def _on_window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise H2ConnectionError(FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
        inc = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if sid == 0:
            if inc == 0:
                raise H2ConnectionError(PROTOCOL_ERROR, "zero WINDOW_UPDATE")
            self._conn_send_window += inc
            if self._conn_send_window > MAX_WINDOW:
                raise H2ConnectionError(FLOW_CONTROL_ERROR, "connection window overflow")
            if self._blocked:
                self._flush_blocked()
            return
        st = self.streams.get(sid)
        if st is None:
            return
        st.send_window += inc
        if inc == 0 or st.send_window > MAX_WINDOW:
            self._stream_error(sid, FLOW_CONTROL_ERROR if inc else PROTOCOL_ERROR)
        elif st.pending:
            self._flush_stream(st)

    def _on_settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise H2ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & FLAG_ACK:
            if payload:
                raise H2ConnectionError(FRAME_SIZE_ERROR, "SETTINGS ACK with payload")
            return
        if len(payload) % 6:
            raise H2ConnectionError(FRAME_SIZE_ERROR, "bad SETTINGS length")
        grew = False
        for off in range(0, len(payload), 6):
            ident, value = _SETTING.unpack_from(payload, off)
            if ident == 4:  # INITIAL_WINDOW_SIZE applies retroactively to open streams
                if value > MAX_WINDOW:
                    raise H2ConnectionError(FLOW_CONTROL_ERROR, "initial window too large")
                delta = value - self._peer_initial_window
                self._peer_initial_window = value
                for st in self.streams.values():
                    st.send_window += delta
                    if st.send_window > MAX_WINDOW:
                        raise H2ConnectionError(FLOW_CONTROL_ERROR, "stream window overflow")
                grew = grew or delta > 0
            elif ident == 5:
                if not 16384 <= value <= 16777215:
                    raise H2ConnectionError(PROTOCOL_ERROR, "bad MAX_FRAME_SIZE")
                self._peer_max_frame = value
            elif ident == 2 and value > 1:
                raise H2ConnectionError(PROTOCOL_ERROR, "bad ENABLE_PUSH")
            # HEADER_TABLE_SIZE is moot: we never index into the dynamic table when encoding.
        self._out.append(_frame(SETTINGS, FLAG_ACK, 0))
        if grew and self._blocked:
            self._flush_blocked()

    def _stream_error(self, sid: int, code: int) -> None:
        st = self.streams.pop(sid, None)
        self._blocked.pop(sid, None)
        self._out.append(_frame(RST_STREAM, 0, sid, _U32.pack(code)))
        if st is not None:
            self.handler.on_reset(sid, code, False)

    @staticmethod
    def _strip_padding(payload: bytes) -> bytes:
        if not payload or payload[0] >= len(payload):
            raise H2ConnectionError(PROTOCOL_ERROR, "bad padding")
        return payload[1:len(payload) - payload[0]]

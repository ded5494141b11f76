"""A hand-written HTTP/2 client codec (RFC 9113) implementing `velox.egress.codec.Codec`.

It was Velox's default egress codec and is now the fallback and the reference of the default,
`native` (the same state machine in C, nativecodec.py): it does only what a client of an HTTP API
needs, with the per-frame work reduced to a struct unpack, a table dispatch and one slice, and it
writes every outgoing frame straight into one bytearray. Response header blocks are HPACK-decoded
with jh2's compiled decoder when it is installed, else with the pure-Python `hpack` decoder.
Requests are HPACK-encoded statelessly (static table and literals only; see hpack_static.py), so the
peer's decoder table never holds anything of ours and we need no encoder state at all. See
docs/design/codecs.md for what is deliberately left out.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import NoReturn

from .codec import (
    CANCEL,
    COMPRESSION_ERROR,
    CONNECTION_WINDOW_UPDATE_THRESHOLD,
    DATA,
    DATA_PER_CALL,
    DEFAULT_MAX_CONCURRENT_STREAMS,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    LOCAL_CONNECTION_WINDOW,
    LOCAL_INITIAL_WINDOW_SIZE,
    LOCAL_MAX_FRAME_SIZE,
    LOCAL_MAX_HEADER_LIST_SIZE,
    MAX_CONCURRENT_STREAMS_CAP,
    MAX_STREAM_ID,
    MAX_WINDOW,
    NO_ERROR,
    PING_ACK,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RESET,
    RESPONSE,
    SETTINGS,
    STREAM_CLOSED,
    STREAM_WINDOW_UPDATE_THRESHOLD,
    TRAILERS,
    CodecError,
)  # fmt: skip
from .hpack_static import (
    FIELD_CACHE,
    encode_new_field,
    hpack_field,
    make_decoder,
    make_python_decoder,
)

__all__ = ["Framer"]

# Frame types and flags (RFC 9113 section 6).
_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _SETTINGS = 0, 1, 2, 3, 4
_PUSH_PROMISE, _PING, _GOAWAY, _WINDOW_UPDATE, _CONTINUATION = 5, 6, 7, 8, 9
_END_STREAM = _ACK = 0x1
_END_HEADERS = 0x4
_PADDED = 0x8
_PRIORITY_FLAG = 0x20

# Frame header: 24-bit length split as 8 + 16 bits so a single struct call does the whole header.
_HEAD = struct.Struct(">BHBBL")
_unpack_head = _HEAD.unpack_from
_pack_head = _HEAD.pack
_pack_head_into = _HEAD.pack_into
_U32 = struct.Struct(">L")
_SETTING = struct.Struct(">HL")
_GOAWAY_HEAD = struct.Struct(">BHBBLLL")
_WINDOW_UPDATE_FRAME = struct.Struct(">BHBBLL")  # also RST_STREAM: both carry one 32-bit field

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_SETTINGS_ACK = _pack_head(0, 0, _SETTINGS, _ACK, 0)
_PING_ACK_HEAD = _pack_head(0, 8, _PING, _ACK, 0)
_PING_HEAD = _pack_head(0, 8, _PING, 0, 0)
_HEAD_PLACEHOLDER = bytes(9)
_MAX_PEER_FRAME_SIZE = 2**24 - 1

# Compressed header blocks larger than this are refused before decoding. A valid block that
# decodes within LOCAL_MAX_HEADER_LIST_SIZE is smaller than it, so only abuse is refused, and
# without the cap a peer could make us buffer CONTINUATION frames forever.
_MAX_HEADER_BLOCK = 2 * LOCAL_MAX_HEADER_LIST_SIZE

# Per-connection cache of the encoded pseudo-header prefix per (method, path); bounded because a
# gateway could in principle forward arbitrary paths.
_PREFIX_CACHE_LIMIT = 256

# Receive-side stream states.
_AWAITING_RESPONSE, _RECEIVING_BODY, _REMOTE_CLOSED = 0, 1, 2

_Handler = Callable[[int, int, bytes, int, int], None]
_Fields = Sequence[tuple[bytes, bytes]]

class _Stream:
    """What one stream needs: windows both ways, the unsent body, and the states of each side."""

    __slots__ = ("body", "body_off", "recv_window", "rx", "send_window", "tx_open", "unacked")

    def __init__(self, send_window: int) -> None:
        self.send_window = send_window
        self.recv_window = LOCAL_INITIAL_WINDOW_SIZE
        self.unacked = 0
        self.body: bytes | None = None
        self.body_off = 0
        self.rx = _AWAITING_RESPONSE
        self.tx_open = True


class Framer:
    """HTTP/2 client connection codec; see `velox.egress.codec.Codec` for the contract."""

    def __init__(self, authority: bytes, scheme: bytes, *, compiled_hpack: bool = True) -> None:
        self._authority = authority
        self._scheme = scheme
        self._decode, self._strip_pseudo, self._oversized = (
            make_decoder() if compiled_hpack else make_python_decoder()
        )
        self._out = bytearray()
        self._streams: dict[int, _Stream] = {}
        self._blocked: dict[int, _Stream] = {}  # streams with body bytes waiting for window
        self._budget = DATA_PER_CALL  # body bytes that may still be framed before data_to_send
        self._deferred = False  # the budget, not a window, held body bytes back
        self._next_sid = 1
        self._refusal: str | None = None  # why no new stream may be opened, once that is so
        self._error: CodecError | None = None
        self._goaway_sent = False
        # Flow control: send windows are the peer's, receive windows are ours.
        self._conn_send_window = 65535
        self._conn_recv_window = 65535
        self._conn_unacked = 0
        self._peer_initial_window = 65535
        self._peer_max_frame = 16384
        self._max_streams = DEFAULT_MAX_CONCURRENT_STREAMS
        self._table_update = False  # prefix the next header block with a table-size update
        self._table_zeroed = False
        self._prefixes: dict[tuple[bytes, bytes], bytes] = {}
        # Input that does not yet complete a frame; joined once enough has arrived so a frame
        # trickling in byte by byte costs linear, not quadratic, copying.
        self._held: list[bytes] = []
        self._held_len = 0
        self._need = 9
        # Header block being reassembled from HEADERS + CONTINUATION.
        self._hb_sid = 0
        self._hb_parts: list[bytes] = []
        self._hb_size = 0
        self._hb_end_stream = False
        self._events: list[tuple] = []  # the list the current receive_data call returns
        # Dispatch tables indexed by frame type. Swapping the table is how the parser enforces
        # "SETTINGS first" and "only CONTINUATION inside a header block" at no per-frame cost.
        push = self._rejecter(PROTOCOL_ERROR, "PUSH_PROMISE although we disabled push")
        stray = self._rejecter(PROTOCOL_ERROR, "CONTINUATION outside a header block")
        not_settings = self._rejecter(PROTOCOL_ERROR, "server preface must start with SETTINGS")
        self._on_interleaved = self._rejecter(PROTOCOL_ERROR, "frame inside a header block")
        self._t_normal: tuple[_Handler, ...] = (
            self._on_data, self._on_headers, self._ignore, self._on_rst_stream,
            self._on_settings, push, self._on_ping, self._on_goaway, self._on_window_update, stray,
        )  # fmt: skip
        self._t_preface = tuple(
            self._on_settings if t == _SETTINGS else not_settings for t in range(10)
        )
        self._t_continuation = tuple(
            self._on_continuation if t == _CONTINUATION else self._on_interleaved for t in range(10)
        )
        self._table = self._t_preface

    # --- Codec interface --------------------------------------------------------------------

    def initiate(self) -> None:
        settings = _SETTING.pack(2, 0) + _SETTING.pack(4, LOCAL_INITIAL_WINDOW_SIZE)
        settings += _SETTING.pack(6, LOCAL_MAX_HEADER_LIST_SIZE)
        out = self._out
        out += _PREFACE
        out += _pack_head(0, len(settings), _SETTINGS, 0, 0)
        out += settings
        increment = LOCAL_CONNECTION_WINDOW - self._conn_recv_window
        out += _WINDOW_UPDATE_FRAME.pack(0, 4, _WINDOW_UPDATE, 0, 0, increment)
        self._conn_recv_window = LOCAL_CONNECTION_WINDOW

    def send_request(
        self, method: bytes, path: bytes, headers: _Fields,
        body: bytes | bytearray | memoryview | None,
    ) -> int:
        if self._refusal is not None:
            raise CodecError(REFUSED_STREAM, self._refusal)
        sid = self._next_sid
        if sid > MAX_STREAM_ID:
            raise CodecError(REFUSED_STREAM, "stream ids exhausted")
        self._next_sid = sid + 2
        stream = _Stream(self._peer_initial_window)
        self._streams[sid] = stream
        if not body:
            self._write_headers(sid, method, path, headers, _END_HEADERS | _END_STREAM)
            stream.tx_open = False
            return sid
        self._write_headers(sid, method, path, headers, _END_HEADERS)
        n = len(body)
        if (n <= self._peer_max_frame and n <= self._conn_send_window
                and n <= stream.send_window and n <= self._budget):
            # The common case, a body that fits one DATA frame, without the general machinery.
            self._conn_send_window -= n
            self._budget -= n
            stream.send_window -= n
            self._out += _pack_head(n >> 16, n & 0xFFFF, _DATA, _END_STREAM, sid)
            self._out += body
            stream.tx_open = False
            return sid
        sent = self._write_data(sid, stream, body, 0)
        if sent < n:
            # Keep the remainder: bytes and bytearray bodies are handed over, so an offset
            # into them suffices; a memoryview is borrowed and may be reused, so it is copied.
            if type(body) is bytes or type(body) is bytearray:
                stream.body, stream.body_off = body, sent
            else:
                stream.body, stream.body_off = bytes(body[sent:]), 0
            self._blocked[sid] = stream
        return sid

    def receive_data(self, data: bytes) -> list[tuple]:
        if self._error is not None:
            raise CodecError(self._error.error_code, "connection already failed")
        if type(data) is not bytes:
            data = bytes(data)  # events must carry immutable bytes, not views of caller buffers
        if self._held:
            held = self._held
            held.append(data)
            self._held_len += len(data)
            if self._held_len < self._need:
                return []
            data = b"".join(held)
            held.clear()
        events: list[tuple] = []
        self._events = events
        try:
            pos = self._parse(data)
        except CodecError as exc:
            exc.events = events
            self._error = exc
            raise
        if pos < len(data):
            rest = data[pos:]
            self._held.append(rest)
            self._held_len = len(rest)
        return events

    def data_to_send(self) -> bytes:
        if self._deferred and self._budget > 0:
            self._deferred = False
            self._resume_bodies()
        self._budget = DATA_PER_CALL
        out = self._out
        if not out:
            return b""
        data = bytes(out)
        out.clear()
        return data

    @property
    def data_pending(self) -> bool:
        return self._deferred

    def acknowledge(self, stream_id: int, n: int) -> None:
        stream = self._streams.get(stream_id)
        if stream is None and not (stream_id & 1 and 0 < stream_id < self._next_sid):
            raise ValueError(f"stream {stream_id} was never opened on this connection")
        if n <= 0:
            return
        self._credit_connection(n)
        if stream is not None and stream.rx == _RECEIVING_BODY:
            credit = stream.unacked + n
            if credit >= STREAM_WINDOW_UPDATE_THRESHOLD:
                self._out += _WINDOW_UPDATE_FRAME.pack(0, 4, _WINDOW_UPDATE, 0, stream_id, credit)
                stream.recv_window += credit
                credit = 0
            stream.unacked = credit

    def reset_stream(self, stream_id: int, error_code: int = CANCEL) -> None:
        if self._streams.pop(stream_id, None) is None:
            return
        self._blocked.pop(stream_id, None)
        self._out += _WINDOW_UPDATE_FRAME.pack(0, 4, _RST_STREAM, 0, stream_id, error_code)

    def send_ping(self, opaque: bytes) -> None:
        if len(opaque) != 8:
            raise ValueError("a PING payload is exactly 8 bytes")
        self._out += _PING_HEAD
        self._out += opaque

    def close(self, error_code: int = NO_ERROR) -> None:
        if not self._goaway_sent:
            self._queue_goaway(error_code, b"")
        self._refusal = "connection closed locally"

    @property
    def max_concurrent_streams(self) -> int:
        return self._max_streams

    @property
    def next_stream_id(self) -> int:
        return self._next_sid

    @property
    def stream_state_count(self) -> int:
        """Streams the codec still holds state for (introspection for tests and metrics)."""
        return len(self._streams)

    # --- Sending ----------------------------------------------------------------------------

    def _write_headers(
        self, sid: int, method: bytes, path: bytes, headers: _Fields, flags: int
    ) -> None:
        # The block is encoded straight after a placeholder frame header, which is filled in
        # once the length is known, so the common case copies each field exactly once.
        out = self._out
        at = len(out)
        out += _HEAD_PLACEHOLDER
        if self._table_update:
            out += b"\x20"  # dynamic table size update to 0: legal under any peer limit
            self._table_update = False
            self._table_zeroed = True
        prefix = self._prefixes.get((method, path))
        if prefix is None:
            prefix = self._encode_prefix(method, path)
        out += prefix
        cached = FIELD_CACHE.get
        for field in headers:
            out += cached(field) or encode_new_field(field)
        size = len(out) - at - 9
        if size <= self._peer_max_frame:
            _pack_head_into(out, at, size >> 16, size & 0xFFFF, _HEADERS, flags, sid)
        else:
            self._split_header_block(at, sid, flags)

    def _encode_prefix(self, method: bytes, path: bytes) -> bytes:
        prefix = (
            hpack_field(b":method", method)
            + hpack_field(b":scheme", self._scheme)
            + hpack_field(b":authority", self._authority)
            + hpack_field(b":path", path)
        )
        if len(self._prefixes) >= _PREFIX_CACHE_LIMIT:
            self._prefixes.clear()
        self._prefixes[(method, path)] = prefix
        return prefix

    def _split_header_block(self, at: int, sid: int, flags: int) -> None:
        out = self._out
        block = bytes(out[at + 9 :])
        del out[at:]
        step = self._peer_max_frame
        chunks = [block[i : i + step] for i in range(0, len(block), step)]
        ftype, first_flags = _HEADERS, flags & ~_END_HEADERS
        for i, chunk in enumerate(chunks):
            size = len(chunk)
            last = i == len(chunks) - 1
            flags = first_flags | (_END_HEADERS if last else 0)
            out += _pack_head(size >> 16, size & 0xFFFF, ftype, flags, sid)
            out += chunk
            ftype, first_flags = _CONTINUATION, 0

    def _write_data(self, sid: int, stream: _Stream, body: bytes | bytearray | memoryview,
                    off: int) -> int:
        """Frame as much of body[off:] as the windows allow; return the new offset."""
        total = len(body)
        n = min(total - off, self._conn_send_window, stream.send_window)
        if n > self._budget:
            n = self._budget
            self._deferred = True
        if n <= 0:
            return off
        self._conn_send_window -= n
        stream.send_window -= n
        self._budget -= n
        out = self._out
        step = self._peer_max_frame
        view = memoryview(body)
        stop = off + n
        while off < stop:
            size = min(step, stop - off)
            flags = _END_STREAM if off + size == total else 0
            out += _pack_head(size >> 16, size & 0xFFFF, _DATA, flags, sid)
            out += view[off : off + size]
            off += size
        if off < total:
            return off
        self._end_local(sid, stream)
        return total

    def _end_local(self, sid: int, stream: _Stream) -> None:
        stream.tx_open = False
        stream.body = None
        self._blocked.pop(sid, None)
        if stream.rx == _REMOTE_CLOSED:
            del self._streams[sid]

    def _resume_bodies(self) -> None:
        for sid, stream in list(self._blocked.items()):
            if self._budget <= 0:
                self._deferred = True
                return
            if self._conn_send_window <= 0:
                return
            if stream.send_window > 0 and stream.body is not None:
                stream.body_off = self._write_data(sid, stream, stream.body, stream.body_off)

    def _credit_connection(self, n: int) -> None:
        self._conn_unacked += n
        self._flush_connection_credit()

    def _flush_connection_credit(self) -> None:
        """Connection credit goes back in large WINDOW_UPDATEs (half the window), unless the
        peer may send no more than what is held back: streams whose clients stopped reading
        withhold their part of the window, and credit held back for batching under them would
        starve every other stream on the connection. (On each credit and each DATA frame.)"""
        credit = self._conn_unacked
        if credit > 0 and (credit >= CONNECTION_WINDOW_UPDATE_THRESHOLD
                           or credit >= self._conn_recv_window):
            self._out += _WINDOW_UPDATE_FRAME.pack(0, 4, _WINDOW_UPDATE, 0, 0, credit)
            self._conn_recv_window += credit
            self._conn_unacked = 0

    def _queue_goaway(self, error_code: int, debug: bytes) -> None:
        self._goaway_sent = True
        self._out += _GOAWAY_HEAD.pack(0, 8 + len(debug), _GOAWAY, 0, 0, 0, error_code)
        self._out += debug

    # --- Receiving --------------------------------------------------------------------------

    def _parse(self, buf: bytes) -> int:
        """Handle every complete frame in buf; return the offset of the first incomplete one."""
        pos = 0
        end = len(buf)
        while end - pos >= 9:
            hi, lo, ftype, flags, sid = _unpack_head(buf, pos)
            length = hi << 16 | lo
            if length > LOCAL_MAX_FRAME_SIZE:
                self._fail(FRAME_SIZE_ERROR, f"{length}-byte frame exceeds our maximum frame size")
            start = pos + 9
            stop = start + length
            if stop > end:
                self._need = 9 + length
                return pos
            pos = stop
            if ftype < 10:
                self._table[ftype](flags, sid & 0x7FFFFFFF, buf, start, stop)
            elif self._hb_sid:
                self._on_interleaved(flags, sid, buf, start, stop)
            # Unknown frame types are ignored (RFC 9113 section 4.1).
        self._need = 9
        return pos

    def _on_data(self, flags: int, sid: int, buf: bytes, start: int, stop: int) -> None:
        flow = stop - start
        window = self._conn_recv_window - flow
        if window < 0:
            self._fail(FLOW_CONTROL_ERROR, "DATA exceeds the connection receive window")
        self._conn_recv_window = window
        if self._conn_unacked:
            self._flush_connection_credit()
        if flags & _PADDED:
            start, stop = self._unpad(buf, start, stop)
        stream = self._streams.get(sid)
        if stream is None or stream.rx != _RECEIVING_BODY:
            self._on_unexpected_data(sid, stream, flow)
            return
        window = stream.recv_window - flow
        if window < 0:
            self._fail(FLOW_CONTROL_ERROR, f"DATA exceeds the receive window of stream {sid}")
        stream.recv_window = window
        if flags & _END_STREAM:
            self._events.append((DATA, sid, buf[start:stop], flow, True))
            self._end_remote(sid, stream)
        else:
            self._events.append((DATA, sid, buf[start:stop], flow, False))

    def _on_unexpected_data(self, sid: int, stream: _Stream | None, flow: int) -> None:
        # The caller never sees these bytes, so the codec must hand back their connection credit.
        self._credit_connection(flow)
        if stream is None:
            if not self._opened(sid):
                self._fail(PROTOCOL_ERROR, f"DATA on stream {sid}, which we never opened")
        elif stream.rx == _AWAITING_RESPONSE:
            self._stream_error(sid, PROTOCOL_ERROR)
        else:
            self._stream_error(sid, STREAM_CLOSED)

    def _on_headers(self, flags: int, sid: int, buf: bytes, start: int, stop: int) -> None:
        if flags & _PADDED:
            start, stop = self._unpad(buf, start, stop)
        if flags & _PRIORITY_FLAG:
            start += 5  # stream dependency and weight: prioritisation is not ours to do
            if start > stop:
                self._fail(FRAME_SIZE_ERROR, "HEADERS too short for its priority fields")
        if flags & _END_HEADERS:
            self._on_header_block(sid, buf[start:stop], flags & _END_STREAM)
            return
        if not sid:
            self._fail(PROTOCOL_ERROR, "HEADERS on stream 0")
        self._hb_sid = sid
        self._hb_parts = [buf[start:stop]]
        self._hb_size = stop - start
        self._hb_end_stream = bool(flags & _END_STREAM)
        self._table = self._t_continuation

    def _on_continuation(self, flags: int, sid: int, buf: bytes, start: int, stop: int) -> None:
        if sid != self._hb_sid:
            self._fail(PROTOCOL_ERROR, "CONTINUATION for another stream inside a header block")
        self._hb_parts.append(buf[start:stop])
        self._hb_size += stop - start
        if self._hb_size > _MAX_HEADER_BLOCK:
            self._fail(ENHANCE_YOUR_CALM, "header block too large")
        if flags & _END_HEADERS:
            block = b"".join(self._hb_parts)
            self._hb_sid = 0
            self._hb_parts = []
            self._table = self._t_normal
            self._on_header_block(sid, block, self._hb_end_stream)

    def _on_header_block(self, sid: int, block: bytes, end_stream: int) -> None:
        # Decode even for streams we dropped: the HPACK table is shared by the connection.
        try:
            fields = self._decode(block)
        except self._oversized:
            self._fail(ENHANCE_YOUR_CALM, "response header list over our limit")
        except Exception as exc:
            self._fail(COMPRESSION_ERROR, f"cannot decode header block: {exc}")
        except BaseException as exc:
            # jh2's decoder reports some malformed input as a Rust panic, which pyo3 raises as
            # a BaseException subclass; anything else (KeyboardInterrupt, ...) must propagate.
            if type(exc).__name__ != "PanicException":
                raise
            self._fail(COMPRESSION_ERROR, "cannot decode header block")
        stream = self._streams.get(sid)
        if stream is None:
            if not self._opened(sid):
                self._fail(PROTOCOL_ERROR, f"HEADERS on stream {sid}, which we never opened")
            return
        try:
            headers = self._strip_pseudo(fields)
        except IndexError:  # an empty field name (RFC 9113 section 8.2.1)
            self._stream_error(sid, PROTOCOL_ERROR)
            return
        if stream.rx == _AWAITING_RESPONSE:
            self._on_response_head(sid, stream, fields, headers, end_stream)
        elif stream.rx == _RECEIVING_BODY:
            if not end_stream or len(headers) != len(fields):
                self._stream_error(sid, PROTOCOL_ERROR)  # malformed trailers
                return
            self._events.append((TRAILERS, sid, headers))
            self._end_remote(sid, stream)
        else:
            self._stream_error(sid, STREAM_CLOSED)

    def _on_response_head(
        self, sid: int, stream: _Stream, fields: list, headers: list, end_stream: int
    ) -> None:
        status = fields[0][1] if fields and fields[0][0] == b":status" else b""
        # Exactly one pseudo-header, :status, first, three digits (RFC 9113 section 8.3.2).
        if len(headers) != len(fields) - 1 or len(status) != 3 or not status.isdigit():
            self._stream_error(sid, PROTOCOL_ERROR)
            return
        # Connection-specific fields (RFC 9113 section 8.2.2) are not checked here: the relay's
        # hop-by-hop filter, which runs over every response's headers anyway, strips them. A
        # check of our own cost 6% of the round trip in benches/bench_codec.py (one more pass
        # over the headers of every response), for a response nothing but a broken server sends.
        code = int(status)
        if code < 200:
            if end_stream or code == 101:
                self._stream_error(sid, PROTOCOL_ERROR)
            return  # informational: the final response follows
        stream.rx = _RECEIVING_BODY
        self._events.append((RESPONSE, sid, code, headers, bool(end_stream)))
        if end_stream:
            self._end_remote(sid, stream)

    def _end_remote(self, sid: int, stream: _Stream) -> None:
        stream.rx = _REMOTE_CLOSED
        if not stream.tx_open:
            del self._streams[sid]
        elif stream.body is not None:
            # The response is complete while part of our body still waits for window: the
            # rest can change nothing, so stop the upload (RFC 9113 §8.1 lets either side end
            # it) rather than hold the stream until a window that may never come.
            self.reset_stream(sid, CANCEL)

    def _on_rst_stream(self, flags: int, sid: int, buf: bytes, start: int, stop: int) -> None:
        if stop - start != 4:
            self._fail(FRAME_SIZE_ERROR, "RST_STREAM payload must be 4 bytes")
        if self._streams.pop(sid, None) is None:
            if not self._opened(sid):
                self._fail(PROTOCOL_ERROR, f"RST_STREAM on stream {sid}, which we never opened")
            return
        self._blocked.pop(sid, None)
        self._events.append((RESET, sid, _U32.unpack_from(buf, start)[0]))

    def _on_settings(self, flags: int, sid: int, buf: bytes, start: int, stop: int) -> None:
        first = self._table is self._t_preface
        if sid:
            self._fail(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & _ACK:
            if first or stop != start:
                self._fail(PROTOCOL_ERROR if first else FRAME_SIZE_ERROR, "bad SETTINGS ACK")
            return
        if (stop - start) % 6:
            self._fail(FRAME_SIZE_ERROR, "SETTINGS payload is not a multiple of 6 bytes")
        old_limit = self._max_streams
        limit = MAX_CONCURRENT_STREAMS_CAP if first else old_limit  # absent means unlimited
        delta = 0
        for off in range(start, stop, 6):
            ident, value = _SETTING.unpack_from(buf, off)
            if ident == 3:  # MAX_CONCURRENT_STREAMS
                limit = min(value, MAX_CONCURRENT_STREAMS_CAP)
            elif ident == 4:  # INITIAL_WINDOW_SIZE
                if value > MAX_WINDOW:
                    self._fail(FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE above 2**31-1")
                delta += value - self._peer_initial_window
                self._peer_initial_window = value
            elif ident == 5:  # MAX_FRAME_SIZE
                if not 16384 <= value <= _MAX_PEER_FRAME_SIZE:
                    self._fail(PROTOCOL_ERROR, f"MAX_FRAME_SIZE {value} out of range")
                self._peer_max_frame = value
            elif ident == 1:  # HEADER_TABLE_SIZE: bounds *our encoder's* table
                # We never insert into the peer's table, but a decoder may insist on seeing a size
                # update after its limit shrinks (RFC 7541 section 4.2); one update to 0 settles
                # that for good.
                if value < 4096 and not self._table_zeroed:
                    self._table_update = True
            elif ident == 2 and value != 0:  # ENABLE_PUSH
                self._fail(PROTOCOL_ERROR, "a server must not enable push")
        self._out += _SETTINGS_ACK
        if delta:
            self._shift_send_windows(delta)
        self._max_streams = limit
        if first:
            self._table = self._t_normal
        if first or limit != old_limit:
            self._events.append((SETTINGS, limit))

    def _shift_send_windows(self, delta: int) -> None:
        # RFC 9113 section 6.9.2: a new INITIAL_WINDOW_SIZE moves every open stream's window by
        # the difference, possibly below zero.
        for stream in self._streams.values():
            stream.send_window += delta
            if stream.send_window > MAX_WINDOW:
                self._fail(FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE overflows a stream window")
        if delta > 0 and self._blocked:
            self._resume_bodies()

    def _on_ping(self, flags: int, sid: int, buf: bytes, start: int, stop: int) -> None:
        if sid:
            self._fail(PROTOCOL_ERROR, "PING on a stream")
        if stop - start != 8:
            self._fail(FRAME_SIZE_ERROR, "PING payload must be 8 bytes")
        if not flags & _ACK:
            self._out += _PING_ACK_HEAD
            self._out += buf[start:stop]
        else:
            self._events.append((PING_ACK, buf[start:stop]))

    def _on_goaway(self, flags: int, sid: int, buf: bytes, start: int, stop: int) -> None:
        if sid:
            self._fail(PROTOCOL_ERROR, "GOAWAY on a stream")
        if stop - start < 8:
            self._fail(FRAME_SIZE_ERROR, "GOAWAY payload shorter than 8 bytes")
        last, code = struct.unpack_from(">LL", buf, start)
        last &= 0x7FFFFFFF
        for unprocessed in [s for s in self._streams if s > last]:
            del self._streams[unprocessed]
            self._blocked.pop(unprocessed, None)
        self._refusal = "peer sent GOAWAY"
        self._events.append((GOAWAY, last, code, buf[start + 8 : stop]))

    def _on_window_update(self, flags: int, sid: int, buf: bytes, start: int, stop: int) -> None:
        if stop - start != 4:
            self._fail(FRAME_SIZE_ERROR, "WINDOW_UPDATE payload must be 4 bytes")
        increment = _U32.unpack_from(buf, start)[0] & 0x7FFFFFFF
        if not sid:
            if not increment:
                self._fail(PROTOCOL_ERROR, "connection WINDOW_UPDATE of 0")
            self._conn_send_window += increment
            if self._conn_send_window > MAX_WINDOW:
                self._fail(FLOW_CONTROL_ERROR, "connection send window above 2**31-1")
            if self._blocked:
                self._resume_bodies()
            return
        stream = self._streams.get(sid)
        if stream is None:
            if not self._opened(sid):
                self._fail(PROTOCOL_ERROR, f"WINDOW_UPDATE on stream {sid}, never opened")
            return  # the body finished before the update arrived
        if not increment:
            self._stream_error(sid, PROTOCOL_ERROR)
            return
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            self._stream_error(sid, FLOW_CONTROL_ERROR)
        elif stream.body is not None and self._conn_send_window > 0:
            stream.body_off = self._write_data(sid, stream, stream.body, stream.body_off)

    def _ignore(self, flags: int, sid: int, buf: bytes, start: int, stop: int) -> None:
        pass  # PRIORITY: deprecated by RFC 9113, and a client has nothing to schedule by it

    def _rejecter(self, error_code: int, message: str) -> _Handler:
        """A handler for frames that are connection errors wherever they appear."""

        def reject(flags: int, sid: int, buf: bytes, start: int, stop: int) -> None:
            self._fail(error_code, message)

        return reject

    # --- Helpers ----------------------------------------------------------------------------

    def _unpad(self, buf: bytes, start: int, stop: int) -> tuple[int, int]:
        if start == stop:
            self._fail(FRAME_SIZE_ERROR, "PADDED frame without a pad length")
        pad = buf[start]
        if pad >= stop - start:
            self._fail(PROTOCOL_ERROR, "padding as long as the frame payload")
        return start + 1, stop - pad

    def _opened(self, sid: int) -> bool:
        """True for ids this client has used (any odd id below the next one)."""
        return sid & 1 == 1 and 0 < sid < self._next_sid

    def _stream_error(self, sid: int, error_code: int) -> None:
        self._streams.pop(sid, None)
        self._blocked.pop(sid, None)
        self._out += _WINDOW_UPDATE_FRAME.pack(0, 4, _RST_STREAM, 0, sid, error_code)
        self._events.append((RESET, sid, error_code))

    def _fail(self, error_code: int, message: str) -> NoReturn:
        if not self._goaway_sent:
            self._queue_goaway(error_code, message.encode("ascii", "replace")[:256])
        self._refusal = "connection failed"
        raise CodecError(error_code, message)

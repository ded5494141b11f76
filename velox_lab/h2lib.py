"""`velox.egress.codec.Codec` over the python-hyper `h2` state machine or its fork `jh2`.

Both packages expose the same API, so one adapter serves both: `make_codec` passes the imported
package in and the adapter loads its submodules by name. The adapter maps the library's event
objects to the interface's tuples, keeps the unsent remainder of request bodies (the libraries
only frame what the windows allow right now), and applies the same settings and flow-control policy
as the hand-written framer, so benchmarks compare codecs, not configurations.

Outbound header validation and normalisation are switched off: the pool already hands over
lowercase, pseudo-header-free, hop-by-hop-free fields, and re-checking them cost about 20 us per
request here (a third of jh2's whole round trip). We mark credential headers never-indexed
ourselves, which the library would otherwise do while normalising. Inbound validation stays on
(about 10-20 us per request): it is the library's defence against a misbehaving upstream.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from velox.egress.codec import (
    CANCEL,
    COMPRESSION_ERROR,
    DATA,
    DATA_PER_CALL,
    DEFAULT_MAX_CONCURRENT_STREAMS,
    GOAWAY,
    LOCAL_CONNECTION_WINDOW,
    LOCAL_INITIAL_WINDOW_SIZE,
    LOCAL_MAX_HEADER_LIST_SIZE,
    MAX_CONCURRENT_STREAMS_CAP,
    MAX_STREAM_ID,
    NO_ERROR,
    PING_ACK,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RESET,
    RESPONSE,
    SENSITIVE_HEADERS,
    SETTINGS,
    TRAILERS,
    CodecError,
)  # fmt: skip

__all__ = ["H2LibCodec"]


class H2LibCodec:
    """HTTP/2 client codec backed by `h2` or `jh2`; see `velox.egress.codec.Codec`."""

    def __init__(self, library: ModuleType, authority: bytes, scheme: bytes) -> None:
        def sub(name: str) -> Any:
            return importlib.import_module(f"{library.__name__}.{name}")

        config = sub("config").H2Configuration(
            client_side=True,
            header_encoding=None,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
            validate_inbound_headers=True,
        )
        self._conn = sub("connection").H2Connection(config=config)
        settings = sub("settings")
        self._settings_class = settings.Settings
        self._codes = settings.SettingCodes
        self._never_indexed = sub("utilities").NeverIndexedHeaderTuple
        self._protocol_error: type[Exception] = sub("exceptions").ProtocolError
        events = sub("events")
        self._dispatch = {
            events.ResponseReceived: self._on_response,
            events.DataReceived: self._on_data,
            events.TrailersReceived: self._on_trailers,
            events.StreamReset: self._on_reset,
            events.ConnectionTerminated: self._on_goaway,
            events.RemoteSettingsChanged: self._on_settings,
            events.WindowUpdated: self._on_window_update,
            events.PingAckReceived: self._on_ping_ack,
        }
        self._authority = authority
        self._scheme = scheme
        self._bodies: dict[int, tuple[bytes, int]] = {}  # unsent body remainders by stream
        self._budget = DATA_PER_CALL  # body bytes that may still be sent before data_to_send
        self._deferred = False  # the budget, not a window, held body bytes back
        self._next_sid = 1
        self._max_streams = DEFAULT_MAX_CONCURRENT_STREAMS
        self._got_settings = False
        self._refusal: str | None = None
        self._malformed: set[int] = set()  # streams reset during the current receive_data

    # --- Codec interface --------------------------------------------------------------------

    def initiate(self) -> None:
        codes = self._codes
        # Values given as initial_values are in force at once, matching the framer's assumption
        # that the peer applies our SETTINGS before it sends anything on a stream.
        self._conn.local_settings = self._settings_class(
            client=True,
            initial_values={
                codes.ENABLE_PUSH: 0,
                codes.INITIAL_WINDOW_SIZE: LOCAL_INITIAL_WINDOW_SIZE,
                codes.MAX_HEADER_LIST_SIZE: LOCAL_MAX_HEADER_LIST_SIZE,
            },
        )
        self._conn.initiate_connection()
        self._conn.increment_flow_control_window(LOCAL_CONNECTION_WINDOW - 65535)

    def send_request(
        self,
        method: bytes,
        path: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes | bytearray | memoryview | None,
    ) -> int:
        if self._refusal is not None:
            raise CodecError(REFUSED_STREAM, self._refusal)
        sid = self._next_sid
        if sid > MAX_STREAM_ID:
            raise CodecError(REFUSED_STREAM, "stream ids exhausted")
        fields: list[tuple[bytes, bytes]] = [
            (b":method", method),
            (b":scheme", self._scheme),
            (b":authority", self._authority),
            (b":path", path),
        ]
        never_indexed = self._never_indexed
        fields.extend(never_indexed(*field) if field[0] in SENSITIVE_HEADERS else field
                      for field in headers)
        try:
            self._conn.send_headers(sid, fields, end_stream=not body)
        except self._protocol_error as exc:
            raise CodecError(REFUSED_STREAM, f"cannot open a stream: {exc}") from exc
        self._next_sid = sid + 2
        if body:
            # A memoryview is borrowed (see the Codec contract): copy it; owned bodies are not.
            self._send_body(sid, bytes(body) if type(body) is memoryview else body, 0)
        return sid

    def receive_data(self, data: bytes) -> list[tuple]:
        try:
            library_events = self._conn.receive_data(data)
        except self._protocol_error as exc:
            # The library has already queued GOAWAY with this code.
            self._refusal = "connection failed"
            raise CodecError(int(exc.error_code), str(exc)) from exc
        except BaseException as exc:
            # jh2's compiled HPACK decoder turns some malformed input into a Rust panic, which
            # escapes the library as a BaseException; treat it as the decoding error it is.
            if type(exc).__name__ != "PanicException":
                raise
            self._refusal = "connection failed"
            self._conn.close_connection(error_code=COMPRESSION_ERROR)
            raise CodecError(COMPRESSION_ERROR, "cannot decode header block") from exc
        events: list[tuple] = []
        dispatch = self._dispatch
        for event in library_events:
            handler = dispatch.get(type(event))
            if handler is not None:
                if self._malformed and getattr(event, "stream_id", 0) in self._malformed:
                    continue  # the rest of a stream reset in this batch (see _on_response)
                handler(event, events)
        self._malformed.clear()
        return events

    def data_to_send(self) -> bytes:
        if self._deferred and self._budget > 0:
            self._deferred = False
            self._resume_bodies()
        self._budget = DATA_PER_CALL
        return self._conn.data_to_send()

    @property
    def data_pending(self) -> bool:
        return self._deferred

    def acknowledge(self, stream_id: int, n: int) -> None:
        if not (stream_id & 1 and 0 < stream_id < self._next_sid):
            raise ValueError(f"stream {stream_id} was never opened on this connection")
        if n > 0:
            # The library credits the connection and, if the stream is still open, the stream;
            # both lazily, once half a window is consumed, like the framer.
            self._conn.acknowledge_received_data(n, stream_id)

    def reset_stream(self, stream_id: int, error_code: int = CANCEL) -> None:
        self._bodies.pop(stream_id, None)
        try:
            self._conn.reset_stream(stream_id, error_code)
        except self._protocol_error:
            pass  # already closed or never opened: nothing to cancel

    def send_ping(self, opaque: bytes) -> None:
        if len(opaque) != 8:
            raise ValueError("a PING payload is exactly 8 bytes")
        try:
            self._conn.ping(opaque)
        except self._protocol_error:
            pass  # the connection is closed: no answer will come, which is the right verdict

    def close(self, error_code: int = NO_ERROR) -> None:
        self._refusal = "connection closed locally"
        try:
            self._conn.close_connection(error_code=error_code)
        except self._protocol_error:
            pass  # the connection is already closed

    @property
    def max_concurrent_streams(self) -> int:
        return self._max_streams

    @property
    def next_stream_id(self) -> int:
        return self._next_sid

    @property
    def stream_state_count(self) -> int:
        """Streams with state in the library or here (introspection for tests and metrics)."""
        _ = self._conn.open_outbound_streams  # prunes closed streams from the library's table
        return len(self._conn.streams) + len(self._bodies)

    # --- Sending ----------------------------------------------------------------------------

    def _send_body(self, sid: int, body: bytes, off: int) -> None:
        conn = self._conn
        total = len(body)
        window = conn.local_flow_control_window(sid)
        step = conn.max_outbound_frame_size
        while off < total and window > 0:
            if self._budget <= 0:
                self._deferred = True
                break
            n = min(window, step, total - off, self._budget)
            chunk = body if n == total else body[off : off + n]
            conn.send_data(sid, chunk, end_stream=off + n == total)
            off += n
            window -= n
            self._budget -= n
        if off < total:
            self._bodies[sid] = (body, off)
        else:
            self._bodies.pop(sid, None)

    def _resume_bodies(self, only: int = 0) -> None:
        for sid, (body, off) in list(self._bodies.items()):
            if only and sid != only:
                continue
            try:
                self._send_body(sid, body, off)
            except self._protocol_error:
                self._bodies.pop(sid, None)  # the stream or connection closed meanwhile

    # --- Event mapping ----------------------------------------------------------------------

    def _on_response(self, event: Any, out: list[tuple]) -> None:
        # Inbound validation guarantees :status comes first and is the only pseudo-header, but
        # not that it is three digits (RFC 9113 section 8.3.2): a malformed one (b"abc" after a
        # 1xx, say) is a stream error, answered like the framer does: RST_STREAM
        # PROTOCOL_ERROR and a RESET event, never an exception out of receive_data.
        headers = event.headers
        status = headers[0][1]
        if len(status) != 3 or not status.isdigit():
            self._reset_malformed(event.stream_id, out)
            return
        out.append((RESPONSE, event.stream_id, int(status), headers[1:],
                    event.stream_ended is not None))

    def _reset_malformed(self, sid: int, out: list[tuple]) -> None:
        self._bodies.pop(sid, None)
        self._malformed.add(sid)
        try:
            self._conn.reset_stream(sid, error_code=PROTOCOL_ERROR)
        except self._protocol_error:
            pass  # the response also ended the stream: nothing left to reset on the wire
        out.append((RESET, sid, PROTOCOL_ERROR))

    def _on_data(self, event: Any, out: list[tuple]) -> None:
        out.append(
            (
                DATA,
                event.stream_id,
                event.data,
                event.flow_controlled_length,
                event.stream_ended is not None,
            )
        )

    def _on_trailers(self, event: Any, out: list[tuple]) -> None:
        out.append((TRAILERS, event.stream_id, list(event.headers)))

    def _on_reset(self, event: Any, out: list[tuple]) -> None:
        self._bodies.pop(event.stream_id, None)
        out.append((RESET, event.stream_id, int(event.error_code)))

    def _on_goaway(self, event: Any, out: list[tuple]) -> None:
        last = event.last_stream_id
        for sid in [s for s in self._bodies if s > last]:
            del self._bodies[sid]
        self._refusal = "peer sent GOAWAY"
        out.append((GOAWAY, last, int(event.error_code), event.additional_data or b""))

    def _on_settings(self, event: Any, out: list[tuple]) -> None:
        # Read the value from the event, not from the library's current settings: when several
        # SETTINGS frames arrive in one read, the library has applied all of them already.
        changed = event.changed_settings.get(self._codes.MAX_CONCURRENT_STREAMS)
        if changed is not None:
            limit = min(changed.new_value, MAX_CONCURRENT_STREAMS_CAP)
        else:  # absent from the first SETTINGS means unlimited
            limit = self._max_streams if self._got_settings else MAX_CONCURRENT_STREAMS_CAP
        if not self._got_settings or limit != self._max_streams:
            self._got_settings = True
            self._max_streams = limit
            out.append((SETTINGS, limit))
        if self._bodies:
            self._resume_bodies()  # INITIAL_WINDOW_SIZE or MAX_FRAME_SIZE may have grown

    def _on_window_update(self, event: Any, out: list[tuple]) -> None:
        if self._bodies:
            self._resume_bodies(event.stream_id)

    def _on_ping_ack(self, event: Any, out: list[tuple]) -> None:
        out.append((PING_ACK, event.ping_data))

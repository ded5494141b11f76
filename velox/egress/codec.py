"""The sans-IO HTTP/2 client codec interface that Velox's egress pool is written against.

Contract: a codec owns no socket and no timer. Requests go in (`send_request`), bytes come out
(`data_to_send`); bytes go in (`receive_data`), events come out. That keeps every implementation
swappable (the native codec, or its Python twin the framer with VELOX_NATIVE=0; the pool is
handed the choice as a factory, egress.pool.EgressOptions) and lets the benchmarks drive them
head-to-head without I/O.

Events are plain tuples whose first item is the kind, because building a tuple is the cheapest
allocation Python has and the pool dispatches on `event[0]` anyway.

The implementations depend on this module, never the reverse.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = [
    "ANSWER",
    "DATA",
    "GOAWAY",
    "PING_ACK",
    "RESET",
    "RESPONSE",
    "SETTINGS",
    "TRAILERS",
    "Codec",
    "CodecError",
]

# --- Event kinds -------------------------------------------------------------------------------

RESPONSE = 1
"""``(RESPONSE, stream_id, status, headers, end_stream)``: the final (non-1xx) response headers.

``status`` is an ``int``; ``headers`` is a ``list[tuple[bytes, bytes]]`` without pseudo-headers, in
wire order. ``end_stream`` is true when the response has no body (for example a 204). Informational
1xx responses are swallowed: a gateway has nothing to do with them.
"""

DATA = 2
"""``(DATA, stream_id, data, flow_len, end_stream)``: a chunk of the response body.

``flow_len`` is the flow-controlled length, which includes padding and so may exceed ``len(data)``.
The caller must eventually pass it to `Codec.acknowledge` (even for a stream it has since reset),
otherwise the connection's receive window drains and the connection stalls.
"""

TRAILERS = 3
"""``(TRAILERS, stream_id, headers)``: trailing header fields; the response has ended."""

RESET = 4
"""``(RESET, stream_id, error_code)``: the stream is dead and its state freed.

Emitted when the peer sends RST_STREAM, and also when the codec itself resets a stream because the
peer broke the protocol on that stream only (for example a response without ``:status``); in that
case the codec has already queued the RST_STREAM and ``error_code`` is the one it sent. It can
follow a response that already ended: a server may send RST_STREAM(NO_ERROR) after a complete
response to stop an upload it does not need (RFC 9113 section 8.1), so a RESET for a stream the
caller has finished with can be ignored.
"""

GOAWAY = 5
"""``(GOAWAY, last_stream_id, error_code, debug)``: the peer is closing the connection.

Streams with ids above ``last_stream_id`` were never processed by the peer, so the pool may retry
them elsewhere; the codec has already forgotten them. Streams at or below it may still complete.
No new stream can be opened on this connection.
"""

SETTINGS = 6
"""``(SETTINGS, max_concurrent_streams)``: the peer's SETTINGS arrived.

Emitted for the peer's first SETTINGS frame and afterwards whenever its MAX_CONCURRENT_STREAMS
changes. The value is capped at `MAX_CONCURRENT_STREAMS_CAP`.
"""

PING_ACK = 7
"""``(PING_ACK, opaque)``: the peer acknowledged one of our PINGs (`Codec.send_ping`).

``opaque`` is the 8-byte payload the ACK carried. The caller matches it against what it sent;
an ACK nobody asked for is harmless. The peer's own PINGs never surface: they are answered
inside the codec.
"""

ANSWER = 8
"""``(ANSWER, stream_id, status, headers, body)``: a whole response in one event.

Only the native codec's ``receive_answers`` (not part of `Codec`; h2conn uses it when the codec
has it) emits it: a `RESPONSE` immediately followed, in the same read, by the `DATA` event that
ends the same stream. The body's flow-controlled length has already been acknowledged by the
codec, so the caller neither acknowledges it nor dispatches twice. Everything else is as the two
events it replaces.
"""

# --- HTTP/2 error codes (RFC 9113 section 7) ---------------------------------------------------

NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
INTERNAL_ERROR = 0x2
FLOW_CONTROL_ERROR = 0x3
SETTINGS_TIMEOUT = 0x4
STREAM_CLOSED = 0x5
FRAME_SIZE_ERROR = 0x6
REFUSED_STREAM = 0x7
CANCEL = 0x8
COMPRESSION_ERROR = 0x9
CONNECT_ERROR = 0xA
ENHANCE_YOUR_CALM = 0xB
INADEQUATE_SECURITY = 0xC
HTTP_1_1_REQUIRED = 0xD

# --- Settings ----------------------------------------------------------------------------------

MAX_WINDOW = 2**31 - 1  # largest legal flow-control window (RFC 9113 section 6.9.1)
MAX_STREAM_ID = 2**31 - 1

# Our per-stream receive window. A non-streamed completion is a few KiB and a long streamed one a
# few hundred, so 8 MiB means the provider never waits for a stream WINDOW_UPDATE in practice while
# still bounding what one stalled client can make us buffer.
LOCAL_INITIAL_WINDOW_SIZE = 8 * 1024 * 1024

# Our connection receive window. With up to hundreds of multiplexed streams the connection window
# is the shared bottleneck, so it is 8 stream windows: a few slow readers cannot starve the rest.
LOCAL_CONNECTION_WINDOW = 64 * 1024 * 1024

# Largest decoded response header list we accept (RFC 9113 section 6.5.2 accounting: name + value
# + 32 per field). Real provider responses are ~1 KiB; 64 KiB is generous yet stops a header bomb.
LOCAL_MAX_HEADER_LIST_SIZE = 64 * 1024

# We keep the protocol defaults for these two, so we never send them: a 4 KiB HPACK table suffices
# for the handful of repeated response headers, and 16 KiB frames keep per-frame buffering bounded
# while being far larger than a typical streamed token chunk.
LOCAL_HEADER_TABLE_SIZE = 4096
LOCAL_MAX_FRAME_SIZE = 16384

# A WINDOW_UPDATE is queued once half of a window has been consumed and acknowledged: one frame per
# 4 MiB (stream) / 32 MiB (connection) instead of one per DATA frame, and the peer still always has
# at least half a window of credit, so it never stalls waiting for us.
STREAM_WINDOW_UPDATE_THRESHOLD = LOCAL_INITIAL_WINDOW_SIZE // 2
CONNECTION_WINDOW_UPDATE_THRESHOLD = LOCAL_CONNECTION_WINDOW // 2

# The peer's MAX_CONCURRENT_STREAMS before its SETTINGS arrive. The RFC default is unlimited, but
# opening hundreds of streams into a server that then announces 100 would get them refused, so we
# assume the common server value until told otherwise.
DEFAULT_MAX_CONCURRENT_STREAMS = 100

# Most request-body bytes framed per `data_to_send` call. Framing copies the body, so a 16 MiB
# upload framed at once would hold the event loop for milliseconds; in 1 MiB steps (well under a
# millisecond each) the rest waits for the caller's next loop pass, when `data_pending` says so.
# A whole micro-batch of ordinary requests (64 x a few KiB) still goes out in one call.
DATA_PER_CALL = 1024 * 1024

# Upper bound on what we report for the peer's MAX_CONCURRENT_STREAMS: per-connection bookkeeping
# and head-of-line blocking on one TCP connection make more streams than this counterproductive.
MAX_CONCURRENT_STREAMS_CAP = 512

# Request header names whose values are credentials. They are encoded as never-indexed literals so
# that no intermediary re-compressing the request puts them in a shared HPACK table.
SENSITIVE_HEADERS = frozenset(
    {b"authorization", b"proxy-authorization", b"api-key", b"x-api-key", b"cookie"}
)

class CodecError(Exception):
    """A connection-level HTTP/2 error: the connection is unusable and must be closed.

    By the time this is raised the codec has queued a GOAWAY carrying `error_code`, so the caller
    should flush `Codec.data_to_send` and then close the transport. `events` holds the events the
    same `receive_data` call produced before the error, so responses that completed just before a
    broken frame are not lost.

    `send_request` raises it with `REFUSED_STREAM` (and queues nothing) when the connection can no
    longer open streams: GOAWAY sent or received, an earlier connection error, or stream ids
    exhausted. The request was not sent and may be retried on another connection.
    """

    def __init__(self, error_code: int, message: str, events: list[tuple] | None = None) -> None:
        super().__init__(f"{message} (HTTP/2 error code 0x{error_code:x})")
        self.error_code = error_code
        self.events: list[tuple] = events if events is not None else []


class Codec(Protocol):
    """A sans-IO HTTP/2 client connection.

    The codec keeps per-stream state only for flow control and for recognising frames of streams
    it has reset; it frees that state when a stream has finished in both directions. The pool does
    its own accounting of open streams against `max_concurrent_streams`.
    """

    def initiate(self) -> None:
        """Queue the connection preface.

        That is the client magic string, our SETTINGS (ENABLE_PUSH=0,
        INITIAL_WINDOW_SIZE=`LOCAL_INITIAL_WINDOW_SIZE`, MAX_HEADER_LIST_SIZE=
        `LOCAL_MAX_HEADER_LIST_SIZE`) and a WINDOW_UPDATE raising the connection receive window to
        `LOCAL_CONNECTION_WINDOW`. Call once, before anything else.
        """
        ...

    def send_request(
        self,
        method: bytes,
        path: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes | bytearray | memoryview | None,
    ) -> int:
        """Open a stream carrying one request and return its stream id.

        :param method: e.g. ``b"POST"``.
        :param path: the request target, e.g. ``b"/v1/chat/completions"``.
        :param headers: regular header fields as ``(name, value)`` tuples: lowercase, no
            pseudo-headers, no hop-by-hop fields, no ``host``. The codec prepends ``:method``,
            ``:scheme``, ``:authority`` and ``:path`` (scheme and authority are given to
            the codec's constructor).
        :param body: the request body, or ``None``/empty for none (END_STREAM then rides on
            HEADERS). As much as the peer's windows allow is framed at once, END_STREAM on the
            last DATA frame; the rest is sent from `receive_data` as WINDOW_UPDATEs arrive. A
            ``bytes`` or ``bytearray`` body is handed over and kept by reference (the caller
            must not modify a bytearray afterwards); a ``memoryview`` is borrowed (it may point
            into a buffer the caller reuses, such as the arena), so its unsent rest is copied.
        :raises CodecError: with `REFUSED_STREAM` if no stream can be opened here any more.

        Staying within `max_concurrent_streams` is the caller's job; an implementation may refuse
        a stream beyond it (the library-backed ones do) or leave it to the peer, which will reset
        it with REFUSED_STREAM.
        """
        ...

    def receive_data(self, data: bytes) -> list[tuple]:
        """Feed bytes read from the transport; return the events they complete.

        Any split of the byte stream is accepted. PING and SETTINGS are acknowledged internally,
        PRIORITY and unknown frame types are ignored. Event payloads are ``bytes`` the caller may
        keep; the codec holds no reference to them.

        :raises CodecError: on a connection error, after queuing a GOAWAY.
        """
        ...

    def data_to_send(self) -> bytes:
        """Return everything queued since the last call, or ``b""``.

        The caller writes it with one ``transport.write`` per event-loop iteration: coalescing the
        frames of many streams into one write is where much of the CPU saving comes from. Request
        bodies are framed at most `DATA_PER_CALL` bytes per call (counted from the previous call);
        when that, not flow control, held body data back, `data_pending` is true and the next
        call frames more.
        """
        ...

    @property
    def data_pending(self) -> bool:
        """Body data the windows would allow is waiting for the next `data_to_send` call.

        The caller should call `data_to_send` again on a later event-loop pass (once it has
        written what it already has), so one large upload never holds the loop for long.
        """
        ...

    def acknowledge(self, stream_id: int, n: int) -> None:
        """Report that the caller has consumed ``n`` flow-controlled bytes of ``stream_id``.

        WINDOW_UPDATEs are queued lazily (see `STREAM_WINDOW_UPDATE_THRESHOLD`), never one per DATA
        frame. For a stream that is already closed or reset only the connection is credited.

        :raises ValueError: if ``stream_id`` was never opened by this codec.
        """
        ...

    def reset_stream(self, stream_id: int, error_code: int = CANCEL) -> None:
        """Queue RST_STREAM for ``stream_id`` (CANCEL by default) and forget the stream.

        Frames the peer sent before it saw the reset are dropped silently; their DATA still
        credits the connection window. Resetting an unknown or finished stream does nothing.
        """
        ...

    def send_ping(self, opaque: bytes) -> None:
        """Queue a PING carrying ``opaque`` (exactly 8 bytes); the answer is a `PING_ACK` event.

        The pool uses it as a liveness probe: a peer that stops answering PINGs while the TCP
        connection stays open is dead to us (RFC 9113 section 6.7).

        :raises ValueError: if ``opaque`` is not 8 bytes long.
        """
        ...

    def close(self, error_code: int = NO_ERROR) -> None:
        """Queue GOAWAY with ``error_code``; no new streams can be opened afterwards."""
        ...

    @property
    def max_concurrent_streams(self) -> int:
        """The peer's MAX_CONCURRENT_STREAMS, capped at `MAX_CONCURRENT_STREAMS_CAP`.

        `DEFAULT_MAX_CONCURRENT_STREAMS` until the peer's SETTINGS arrive.
        """
        ...

    @property
    def next_stream_id(self) -> int:
        """The id the next `send_request` will use, so the pool can retire the connection before
        ids run out at `MAX_STREAM_ID`."""
        ...

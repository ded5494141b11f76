"""The bytes of an HTTP/1.1 response to a client: head, body, chunk framing.

Ingress writes every answer through the three functions `response`, `head` and `chunks`
(and the relay formats `server-timing` with `server_timing`),
which are the native core's (`velox._native.h1_*`, native/vx_http1.c): one C call builds the
whole response (status line, content-length, the header fields in the order given, connection:
close, the body) into one bytes object, where the Python writer built a list of parts and
joined it (a quarter of a worker's Python time was the client write, in a profile under load).

`py_response`, `py_head`, `py_chunks` and `py_server_timing` below are that Python writer,
kept as the reference:
the tests compare both byte for byte over generated headers and bodies
(tests/native/test_http1.py), and `use(native=False)` switches ingress back to them.

Headers are a list or tuple of (name, value) bytes pairs, written in order with nothing added
or checked: the stages pass fields they already trust (the relay drops hop-by-hop fields; any
per-request extra such as x-ratelimit-* is appended to the same sequence by its stage).
"""

from __future__ import annotations

import http
from collections.abc import Sequence

from velox import _native

H1_LENGTH = _native.H1_LENGTH  # write content-length (the body's length, or the one given)
H1_CHUNKED = _native.H1_CHUNKED  # write transfer-encoding: chunked
H1_CLOSE = _native.H1_CLOSE  # write connection: close

# The reason phrases are the running Python's (they changed between versions), so the C core
# is handed the whole status line.
class _StatusLines(dict[int, bytes]):
    """Status code -> status line. A code Python has no phrase for (an upstream's 529, Anthropic's
    overloaded) gets an empty reason phrase, which RFC 9112 §4 allows, instead of a KeyError
    that left its client without an answer."""

    def __missing__(self, status: int) -> bytes:
        line = self[status] = b"HTTP/1.1 %d \r\n" % status
        return line


STATUS_LINES = _StatusLines({
    s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in http.HTTPStatus
})
LAST_CHUNK = b"0\r\n\r\n"
_CONTENT_LENGTH = b"content-length: %d\r\n"
_CLOSE = b"connection: close\r\n"
_CHUNKED = b"transfer-encoding: chunked\r\n"

Headers = Sequence[tuple[bytes, bytes]]
Body = bytes | bytearray | memoryview


def py_head(status_line: bytes, headers: Headers, content_length: int, flags: int) -> bytes:
    parts = [status_line]
    if flags & H1_LENGTH:
        parts.append(_CONTENT_LENGTH % content_length)
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    if flags & H1_CHUNKED:
        parts.append(_CHUNKED)
    if flags & H1_CLOSE:
        parts.append(_CLOSE)
    parts.append(b"\r\n")
    return b"".join(parts)


def py_response(status_line: bytes, headers: Headers, body: Body | Sequence[Body] | None,
                flags: int) -> bytes:
    if body is None:
        return py_head(status_line, headers, 0, flags)
    whole = body if isinstance(body, (bytes, bytearray, memoryview)) else b"".join(body)
    return py_head(status_line, headers, len(whole), flags) + whole


def py_chunks(data: Body | Sequence[Body], last: bool = False) -> bytes:
    pieces = data if isinstance(data, (list, tuple)) else (data,)
    out = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces if len(p))
    return out + LAST_CHUNK if last else out


_TIMING = (b"ring;dur=%d.%03d, parse;dur=%d.%03d, ratelimit;dur=%d.%03d, "
           b"upstream;dur=%d.%03d")


def py_server_timing(t_received: int, t_popped: int, t_parsed: int, t_admitted: int,
                     t_sent: int, t_headers: int) -> bytes:
    """The relay's server-timing value from its perf_counter_ns stamps: each stage's
    max(0, difference) in integer microseconds, shown as milliseconds."""
    ring = max(0, t_popped - t_received) // 1000
    parse = max(0, t_parsed - t_popped) // 1000
    limit = max(0, t_admitted - t_parsed) // 1000
    upstream = max(0, t_headers - t_sent) // 1000
    return _TIMING % (ring // 1000, ring % 1000, parse // 1000, parse % 1000,
                      limit // 1000, limit % 1000, upstream // 1000, upstream % 1000)


response = _native.h1_response
head = _native.h1_head
chunks = _native.h1_chunks
server_timing = _native.h1_server_timing
# The native writer's own functions, whatever `use` selected: the relay formats a client's
# whole response head (kept fields, server-timing, extras) in one call when ingress writes
# natively (velox.relay.exchange), and its Python twin otherwise.
native_server_timing = _native.h1_server_timing
relay_head = _native.relay_head


def use(native: bool) -> None:
    """Switch the writer ingress uses: VELOX_NATIVE=0 selects the Python one (the worker calls
    this once; a worker is a process of its own, so module globals are the cheapest switch)."""
    global response, head, chunks, server_timing  # noqa: PLW0603 - the switch is these globals
    if native:
        response, head, chunks = _native.h1_response, _native.h1_head, _native.h1_chunks
        server_timing = _native.h1_server_timing
    else:
        response, head, chunks = py_response, py_head, py_chunks  # type: ignore[assignment]
        server_timing = py_server_timing

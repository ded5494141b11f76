"""Differential fuzz of the native HTTP/1.1 response reader (native/vx_h1resp.c through
`velox._native.H1Reader`) against httptools (llhttp), the reader of its twin.

The same upstream byte stream (one or more responses, heads generated near the subset's edges,
bodies with Content-Length or chunked in random chunk sizes with extensions and trailers,
sometimes a byte mutated) is cut into random reads and fed to both: the native reader (which
hands a head outside its subset, and everything after it, to an httptools parser of its own, as
egress's connection does) and httptools alone. Both report the same messages: status, header
fields (names lower-cased, values as llhttp gives them), keep-alive, body bytes and completion,
in order; a body framing one rejects the other rejects too, and the messages completed before it
are the same.

`make test` runs a bounded number of examples; VELOX_FUZZ_EXAMPLES=2000 runs more.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import httptools
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from velox import _native

EXAMPLES = int(os.environ.get("VELOX_FUZZ_EXAMPLES", "300"))

_TCHAR = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-!#$%&'*+.^_`|~"
TOKEN = st.text(alphabet=_TCHAR, min_size=1, max_size=10).map(str.encode)
VALUE = st.binary(max_size=12).map(
    lambda b: bytes(c for c in b if c == 9 or 0x20 <= c != 0x7F))


class _Events:
    """What a reader reported: a list of messages, each [status, headers, keep_alive, body,
    complete], plus whether a protocol error ended the stream."""

    def __init__(self) -> None:
        self.messages: list[list[Any]] = []
        self.error = False

    def head(self, status: int, headers: list[tuple[bytes, bytes]], keep_alive: bool) -> None:
        self.messages.append([status, headers, keep_alive, b"", False])

    def body(self, data: bytes) -> None:
        self.messages[-1][3] += data

    def end(self) -> None:
        self.messages[-1][4] = True


class _Llhttp:
    """httptools' callbacks into _Events (as PyH1Connection's, 1xx skipped)."""

    def __init__(self, events: _Events) -> None:
        self.events = events
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []

    def on_message_begin(self) -> None:
        self.headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status >= 200:  # a copy: trailer fields come through on_header too (not reported)
            self.events.head(status, list(self.headers), self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        self.events.body(body)

    def on_message_complete(self) -> None:
        if self.parser.get_status_code() >= 200:
            self.events.end()

    def feed(self, data: bytes) -> None:
        if self.events.error:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.events.error = True


class _Native(_native.H1Reader):
    """The native reader's reports into _Events; a fallback feeds its own httptools."""

    def __init__(self) -> None:
        self.events = _Events()
        self.llhttp: _Llhttp | None = None

    def _h_answer(self, status: int, headers: Any, keep_alive: bool, body: bytes) -> None:
        self.events.head(status, headers, keep_alive)
        self.events.body(body)
        self.events.end()

    def _h_head(self, status: int, headers: Any, keep_alive: bool, body: bytes) -> None:
        self.events.head(status, headers, keep_alive)
        self.events.body(body)

    def _h_body(self, body: bytes) -> None:
        self.events.body(body)

    def _h_end(self, body: bytes) -> None:
        self.events.body(body)
        self.events.end()

    def _h_error(self, message: str) -> None:
        self.events.error = True

    def _h_fallback(self, data: bytes) -> None:
        if self.llhttp is None:
            self.llhttp = _Llhttp(self.events)
        self.llhttp.feed(data)


@st.composite
def response(draw: st.DrawFn) -> bytes:
    odd = draw(st.integers(0, 9)) == 0  # one in ten heads leaves the usual shapes
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0"])) if odd else b"HTTP/1.1"
    status = draw(st.sampled_from([200, 200, 201, 204, 304, 400, 429, 500, 503, 100]))
    reason = draw(st.sampled_from([b" OK", b"", b" Some Reason", b" "]))
    body = draw(st.binary(max_size=300))
    framing = draw(st.sampled_from(["length", "chunked", "chunked", "none"] if odd
                                   else ["length", "chunked"]))
    fields = [(draw(TOKEN), draw(VALUE)) for _ in range(draw(st.integers(0, 4)))]
    fields = [(n, v) for n, v in fields if n.lower() not in (
        b"content-length", b"transfer-encoding", b"connection", b"upgrade",
        b"proxy-connection")]
    if framing == "length":
        fields.append((draw(st.sampled_from([b"Content-Length", b"content-length"])),
                       b"%d" % len(body)))
    elif framing == "chunked":
        fields.append((b"Transfer-Encoding", draw(st.sampled_from(
            [b"chunked", b"Chunked", b"chunked "]))))
    if draw(st.booleans()):
        fields.append((b"Connection", draw(st.sampled_from(
            [b"keep-alive", b"close", b"Close", b"upgrade"] if odd else [b"keep-alive"]))))
    draw(st.randoms()).shuffle(fields)
    head = b"%s %d%s\r\n" % (version, status, reason) + b"".join(
        b"%s:%s%s\r\n" % (n, draw(st.sampled_from([b" ", b"", b"\t "])), v) for n, v in fields)
    if status < 200:  # an interim answer, then the real one
        return head + b"\r\n" + draw(response())
    out = head + b"\r\n"
    if framing == "length":
        return out + body
    if framing != "chunked":
        return out
    rest = body
    while rest:
        n = draw(st.integers(1, max(1, len(rest))))
        ext = draw(st.sampled_from([b"", b"", b";a=b", b";x"]))
        out += b"%x%s\r\n%s\r\n" % (n, ext, rest[:n])
        rest = rest[n:]
    trailer = draw(st.sampled_from([b"", b"", b"x-trailer: 1\r\n"]))
    return out + b"0\r\n" + trailer + b"\r\n"


@st.composite
def stream(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    data = b"".join(draw(st.lists(response(), min_size=1, max_size=3)))
    if data and draw(st.integers(0, 3)) == 0:  # a mutated byte
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1:]
    cuts = sorted(set(draw(st.lists(st.integers(0, len(data)), max_size=6))))
    return data, cuts


def _reads(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def _agreed(native: _Events, reference: _Events) -> None:
    assert native.error == reference.error
    if native.error:  # the message in progress may have been reported further by one
        done = [m for m in native.messages if m[4]]
        assert done == [m for m in reference.messages if m[4]][:len(done)]
        return
    assert native.messages == reference.messages


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(stream())
def test_the_native_reader_reports_what_httptools_does(case: tuple[bytes, list[int]]) -> None:
    data, cuts = case
    native = _Native()
    reference = _Events()
    llhttp = _Llhttp(reference)
    for read in _reads(data, cuts):
        if len(read) <= len(native.read_buffer):  # as uvloop: into the buffer, then its size
            native.read_buffer[:len(read)] = read
            native.buffer_updated(len(read))
        else:
            native.data_received(read)
        llhttp.feed(read)
    _agreed(native.events, reference)


def test_a_plain_answer_is_one_report_and_a_stream_one_per_read() -> None:
    """The point of the reader: one Python call per read, whatever the read holds."""
    calls: list[str] = []

    class Counting(_Native):
        def _h_answer(self, *args: Any) -> None:
            calls.append("answer")

        def _h_head(self, *args: Any) -> None:
            calls.append("head")

        def _h_body(self, body: bytes) -> None:
            calls.append("body")

        def _h_end(self, body: bytes) -> None:
            calls.append("end")

    reader = Counting()
    reader.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-a: 1\r\nx-b: 2\r\n\r\n{}")
    assert calls == ["answer"]
    calls.clear()
    reader.data_received(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    for _ in range(3):  # several events, several chunks, one read
        reader.data_received(b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n")
    reader.data_received(b"0\r\n\r\n")
    assert calls == ["head", "body", "body", "body", "end"]
    assert not reader.native_fallback


def test_a_head_outside_the_subset_hands_the_connection_to_httptools() -> None:
    reader = _Native()
    reader.data_received(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 1\r\n")
    reader.data_received(b"\r\nx")
    assert reader.native_fallback
    assert reader.events.messages == [[200, [(b"content-length", b"1")], True, b"x", True]]

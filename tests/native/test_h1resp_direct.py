"""The native reader's direct path (H1Reader.direct), socket-free, against the Python path.

A streamed answer's reads, each a piece of an event stream (whole events or not, with a usage
chunk, with the `,"usage":null` an OpenAI upstream adds to every chunk when asked for usage,
split anywhere), go to two meters (velox.relay.usage.SSEUsage, stripping or not): once all
through the Python path (feed, then h1write's chunk framing, as the relay and ingress do) and
once through the native reader with a direct target installed, whose reads that it does not
take fall back to the same Python path. The client gets the same bytes, and the meters and
byte counts end the same; reads C wrote never reached Python. Backpressure: a write that
pauses the client makes the reader withhold.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from velox import _native
from velox.ingress import h1write
from velox.relay.usage import SSEUsage

CHUNK = b'data: {"id":"c","choices":[{"delta":{"content":"%b"}}]%b}\n\n'
NULL = b',"usage":null'
USAGE = (b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":%d,'
         b'"total_tokens":%d}}\n\n')
HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


class Client:
    """What the reader reads of ingress's connection (velox.ingress.connection)."""

    def __init__(self) -> None:
        self._out: list[bytes] | None = None
        self._q: Any = None
        self._out_head = b""
        self.write_paused = False
        self.closed = False
        self._stream_bytes = 0
        self.written: list[bytes] = []
        self.pause_after = -1  # pause writing at this write (as a full transport buffer does)

    def write(self, data: bytes) -> None:
        self.written.append(data)
        if len(self.written) == self.pause_after:
            self.write_paused = True

    def send(self, data: bytes) -> None:  # the Python path: send_chunk + flush_stream
        if data:
            framed = h1write.chunks([data], False)
            self._stream_bytes += len(framed)
            self.write(framed)


class Holder:
    """The exchange's and the attempt's attributes the reader keeps up to date."""

    tail = b""
    last_activity = 0.0
    withheld = 0


class SlotClient(Client):
    """The client with its attributes in slots, as ingress's connection keeps them: the sink
    then reads and writes them at their offsets instead of through getattr/setattr."""

    __slots__ = ("_out", "_q", "_out_head", "write_paused", "closed", "_stream_bytes")


class SlotHolder(Holder):
    __slots__ = ("tail", "last_activity", "withheld")

    def __init__(self) -> None:
        self.tail, self.last_activity, self.withheld = b"", 0.0, 0


class Reader(_native.H1Reader):
    def __init__(self, client: Client, sse: SSEUsage | None, holder: type = Holder) -> None:
        self.client = client
        self.sse = sse
        self.python_reads = 0
        self.withheld = 0
        self.exchange = holder()
        self.attempt = holder()

    def _h_head(self, status: int, headers: Any, keep_alive: bool, body: bytes) -> None:
        self.direct(self.client, self.client.write, self.sse, self.exchange, self.attempt, True)
        if body:
            self._h_body(body)

    def _h_body(self, body: bytes) -> None:
        self.python_reads += 1
        self.client.send(body if self.sse is None else self.sse.feed(body))

    def _h_withhold(self, size: int) -> None:
        self.withheld += size

    def _h_answer(self, status: int, headers: Any, keep_alive: bool, body: bytes) -> None:
        pass

    def _h_end(self, body: bytes) -> None:
        if body:
            self._h_body(body)

    def _h_error(self, message: str) -> None:
        self.error = message

    def _h_fallback(self, data: bytes) -> None:
        self.fallen = data


def _python_path(reads: list[bytes], sse: SSEUsage | None) -> Client:
    client = Client()
    for read in reads:
        client.send(read if sse is None else sse.feed(read))
    return client


def _events(draw: st.DrawFn) -> bytes:
    out = b""
    for i in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["plain", "null", "null", "usage"]))
        if kind == "usage":
            out += USAGE % (i, i + 3)
        else:
            out += CHUNK % (b"tok%d" % i, NULL if kind == "null" else b"")
    return out


@st.composite
def stream(draw: st.DrawFn) -> tuple[list[bytes], str]:
    data = _events(draw)
    if draw(st.booleans()):  # reads on event boundaries, one or several events each
        events = [e + b"\n\n" for e in data.split(b"\n\n") if e]
        reads, i = [], 0
        while i < len(events):
            n = draw(st.integers(1, 3))
            reads.append(b"".join(events[i:i + n]))
            i += n
    else:  # cut anywhere
        cuts = sorted(set(draw(st.lists(st.integers(1, len(data) - 1), max_size=8))))
        bounds = [0, *cuts, len(data)]
        reads = [data[a:b] for a, b in itertools.pairwise(bounds)]
    return reads, draw(st.sampled_from(["strip", "keep", "none"]))


@settings(max_examples=300, deadline=None)
@given(stream(), st.booleans())
def test_the_direct_path_sends_and_counts_what_the_python_path_does(
        case: tuple[list[bytes], str], slots: bool) -> None:
    reads, meter = case
    sse_py = None if meter == "none" else SSEUsage(meter == "strip")
    sse_c = None if meter == "none" else SSEUsage(meter == "strip")
    expected = _python_path(reads, sse_py)
    client = SlotClient() if slots else Client()
    reader = Reader(client, sse_c, SlotHolder if slots else Holder)
    reader.data_received(HEAD)
    for read in reads:
        reader.data_received(b"%x\r\n%b\r\n" % (len(read), read))
    assert b"".join(client.written) == b"".join(expected.written)
    assert client._stream_bytes == expected._stream_bytes
    if sse_c is not None and sse_py is not None:
        assert (sse_c.events, sse_c.relayed, sse_c.found, sse_c.input, sse_c.output) == \
            (sse_py.events, sse_py.relayed, sse_py.found, sse_py.input, sse_py.output)
    assert reader.python_reads <= len(reads)
    if reads[-1].endswith(b"\n\n"):
        assert reader.exchange.tail == b"\n\n" or reader.python_reads
    if reader.python_reads < len(reads):  # C wrote some: it kept the attempt's activity
        assert reader.attempt.last_activity > 0


def test_plain_reads_never_reach_python_and_a_full_client_withholds() -> None:
    client = Client()
    reader = Reader(client, SSEUsage(True))
    reader.data_received(HEAD)
    client.pause_after = 3
    for i in range(3):
        event = CHUNK % (b"t%d" % i, NULL)
        reader.data_received(b"%x\r\n%b\r\n" % (len(event), event))
    assert reader.python_reads == 0
    assert len(client.written) == 3 and NULL not in b"".join(client.written)
    assert reader.attempt.last_activity > 0 and reader.exchange.tail == b"\n\n"
    assert reader.withheld == len(CHUNK % (b"t2", NULL))  # the third write paused the client
    # Paused: the next read goes through Python (which queues it in ingress).
    event = CHUNK % (b"t3", b"")
    reader.data_received(b"%x\r\n%b\r\n" % (len(event), event))
    assert reader.python_reads == 1
    reader.undirect()
    client.write_paused = False
    reader.data_received(b"%x\r\n%b\r\n" % (len(event), event))
    assert reader.python_reads == 2  # no target: Python


def test_counts_past_int64_and_of_int_subclasses_add_as_python_does() -> None:
    class Count(int):
        pass

    client = SlotClient()
    client._stream_bytes = 2**70
    sse = SSEUsage(True)
    sse.relayed = Count(5)
    reader = Reader(client, sse, SlotHolder)
    reader.data_received(HEAD)
    event = CHUNK % (b"t", b"")
    reader.data_received(b"%x\r\n%b\r\n" % (len(event), event))
    assert reader.python_reads == 0
    assert client._stream_bytes == 2**70 + len(client.written[0])
    assert sse.relayed == 5 + len(event) and sse.events == 1


def test_readers_and_their_reads_keep_refcounts_and_rss_flat() -> None:
    """200k answers (whole, streamed through C and through Python, a fallback, an error) and
    20k readers made and dropped: the objects handed to C keep their refcounts, RSS stays."""
    import gc
    import sys

    import psutil

    def rss() -> int:
        gc.collect()
        return int(psutil.Process().memory_info().rss)

    client, sse = Client(), SSEUsage(True)
    reader = Reader(client, sse)
    whole = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-a: 1\r\n\r\n{}"
    plain = CHUNK % (b"t", NULL)
    held = [client, client.write, sse, reader.exchange, reader.attempt]

    def rounds(n: int) -> None:
        for _ in range(n):
            reader.data_received(whole)
            reader.data_received(HEAD)
            reader.data_received(b"%x\r\n%b\r\n" % (len(plain), plain))  # C
            reader.data_received(b"5\r\ndata:\r\n")  # Python (half an event)
            reader.data_received(b"2\r\n\n\n\r\n0\r\n\r\n")  # its end, and the answer's
            reader.undirect()
            client.written.clear()
        for _ in range(n // 10):
            other = Reader(Client(), None)
            other.data_received(b"HTTP/1.1 100 Continue\r\n\r\n")  # fallback: httptools
            broken = Reader(Client(), None)
            broken.data_received(HEAD + b"zz\r\n")  # a broken chunk size: _h_error

    rounds(2_000)  # warm up allocator and caches
    assert reader.python_reads == 2 * 2_000 and not sse.pending  # the C read never reached it
    before = [sys.getrefcount(o) for o in held]
    base = rss()
    rounds(20_000)
    assert [sys.getrefcount(o) for o in held] == before
    if not os.environ.get("VELOX_NATIVE_LIB"):  # ASan's quarantine holds freed memory a while
        assert rss() - base < 8 << 20

"""The whole-answer fast path: the native codec's ANSWER event and the relay's answer head.

`H2Client.receive_answers` must produce exactly what `receive_data` does, except that a
response's HEADERS followed in the same read by the DATA frame ending the same stream become one
ANSWER event whose flow-controlled length the codec credits itself (checked by the bytes it then
writes, against a twin codec credited by hand). `relay_head` must build the same header list
as the step-by-step Python it replaces, and the gateway's answers must not change whichever
codec carries them.
"""

from __future__ import annotations

import re
import struct
from typing import ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velox import _native
from velox.egress.codec import ANSWER, DATA, RESPONSE, CodecError
from velox.egress.framer import Framer
from velox.relay.exchange import _DROP, _DROP_KEYED, Exchange, answer_head
from velox_lab.pipeline import FakeTransport, Pipeline

AUTHORITY = b"api.example.com"
_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00" + b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"


def frame(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + \
        struct.pack(">I", sid) + payload


def headers(sid: int, end: bool = False, status: bytes = b"\x88") -> bytes:
    # :status from the static table (0x88: 200, 0x8e: 500... here 200), one literal field
    block = status + b"\x00\x0ccontent-type\x10application/json"
    return frame(1, 0x4 | (0x1 if end else 0), sid, block)


def data(sid: int, payload: bytes, end: bool) -> bytes:
    return frame(0, 0x1 if end else 0, sid, payload)


def twins(streams: int) -> tuple[_native.H2Client, _native.H2Client]:
    """Two native codecs in the same state: preface sent, peer SETTINGS seen, streams open."""
    pair = []
    for _ in range(2):
        codec = _native.H2Client(AUTHORITY, b"https", CodecError)
        codec.initiate()
        for _ in range(streams):
            codec.send_request(b"GET", b"/", [], None)
        codec.data_to_send()
        codec.receive_data(_SETTINGS)
        codec.data_to_send()
        pair.append(codec)
    return pair[0], pair[1]


def by_hand(codec: _native.H2Client, wire: bytes) -> list[tuple]:
    """receive_data, with each DATA acknowledged as h2conn does for an ended stream."""
    events = codec.receive_data(wire)
    for event in events:
        if event[0] == DATA:
            codec.acknowledge(event[1], event[3])
    return events


def test_headers_then_ending_data_become_one_answer() -> None:
    merged, plain = twins(4)
    wire = (headers(1) + data(1, b'{"a":1}', True)  # merged
            + headers(3, end=True)  # no body: stays RESPONSE
            + headers(5) + data(5, b"part", False)  # a stream goes on: no merge
            + headers(7) + data(7, b"", True))  # an empty ending frame still merges
    got = merged.receive_answers(wire)
    reference = by_hand(plain, wire)
    assert [e[0] for e in got] == [ANSWER, RESPONSE, RESPONSE, DATA, ANSWER]
    assert got[0] == (ANSWER, 1, 200, [(b"content-type", b"application/json")], b'{"a":1}')
    assert got[4] == (ANSWER, 7, 200, [(b"content-type", b"application/json")], b"")
    assert got[1:4] == reference[2:5]
    assert merged.data_to_send() == plain.data_to_send()


def test_frames_of_other_streams_in_between_are_not_merged() -> None:
    merged, plain = twins(2)
    wire = headers(1) + headers(3) + data(1, b"x", True) + data(3, b"y", True)
    assert merged.receive_answers(wire) == plain.receive_data(wire)


def test_an_answer_credits_the_connection_like_an_acknowledged_data_frame() -> None:
    # 2,100 answers of 16 KiB pass the 32 MiB connection threshold: only a codec that credits
    # them writes the connection WINDOW_UPDATE, and both must write the same bytes.
    merged, plain = twins(0)
    body = b"x" * 16384
    for i in range(2100):
        sid = 2 * i + 1
        for codec in (merged, plain):
            assert codec.send_request(b"GET", b"/", [], None) == sid
        wire = headers(sid) + data(sid, body, True)
        assert [e[0] for e in merged.receive_answers(wire)] == [ANSWER]
        by_hand(plain, wire)
    out = merged.data_to_send()
    assert out == plain.data_to_send()
    connection_update = re.escape(b"\x00\x00\x04\x08\x00\x00\x00\x00\x00")
    window_updates = [m.start() for m in re.finditer(connection_update, out)]
    assert window_updates, "no connection WINDOW_UPDATE: the answers were not credited"
    assert merged.stream_state_count == 0


def test_the_pipeline_answers_the_same_natively_and_on_the_python_twins() -> None:
    # "framer": VELOX_NATIVE=0, so the framer, httptools alone and the Python writer.
    written = {}
    for codec in ("framer", "native"):
        pipeline = Pipeline(clients=2, codec=codec)
        pipeline.round()
        spy = FakeTransport(keep=True)
        client, _ = pipeline.clients[0]
        client.transport = spy  # type: ignore[assignment]
        pipeline.round()
        written[codec] = re.sub(rb"server-timing: [^\r]*", b"server-timing: -",
                                b"".join(spy.chunks))
        assert pipeline.worker.in_flight == 0 and not pipeline.conn.streams
    assert written["framer"] == written["native"]
    assert b"\r\nx-velox-upstream: default\r\nx-velox-attempts: 1\r\n" in written["native"]


class _Retrying:
    """A dispatch that sends every response again (as for a 503 with another target)."""

    def response(self, exchange: Exchange, status: int, hdrs: list) -> bool:
        return True


class _Conn:
    write_paused = False

    def __init__(self) -> None:
        self.calls: list[str] = []

    def respond(self, *args: object) -> None:
        self.calls.append("respond")

    def start_stream(self, *args: object) -> None:
        self.calls.append("start_stream")


class _Request:
    def __init__(self) -> None:
        self.conn = _Conn()
        self.method = b"POST"
        self.body = b"{}"
        self.exchange = None
        self.extra_headers = None
        self.released = 0

    def release_body(self) -> None:
        self.released += 1


def test_a_retried_answer_reaches_neither_the_client_nor_the_observer() -> None:
    request = _Request()
    exchange = Exchange(request, b"/", [], lambda e, s: None,  # type: ignore[arg-type]
                        _Retrying())  # type: ignore[arg-type]

    class Observer:
        seen: ClassVar[list[str]] = []

        def head(self, *a: object) -> None:
            self.seen.append("head")

        def data(self, *a: object) -> None:
            self.seen.append("data")

    exchange.observer = Observer()  # type: ignore[assignment]
    exchange.on_answer(503, [(b"content-type", b"application/json")], b'{"error":1}')
    assert request.conn.calls == [] and request.released == 0 and Observer.seen == []
    assert not exchange.finished and exchange.chunks == []


_names = st.sampled_from([b"content-type", b"content-length", b"connection", b"x-request-id",
                          b"x-ratelimit-limit-requests", b"te", b"retry-after", b"x-hop",
                          b"close", b"keep-alive", b"Connection", b"x-velox-upstream"])
_values = st.sampled_from([b"application/json", b"text/event-stream", b"text/event-stream; a",
                           b"text/event", b"1", b""])
# What a Connection field may say: plain keep-alive / close in any case, names of other
# fields in any case, with spaces, tabs and other ASCII whitespace, empty items, commas only.
_tokens = st.sampled_from([b"x-hop", b"X-Hop", b"te", b"x-request-id", b"content-type",
                           b"close", b"keep-alive", b"x-velox-upstream", b"server-timing",
                           b"", b" ", b"\tx-hop\x0b", b"\x0cRETRY-AFTER\r\n", b"x-h\xc3\x96p"])
_connection = st.one_of(
    st.sampled_from([b"keep-alive", b"Keep-Alive", b"close", b"CLOSE", b",", b""]),
    st.lists(_tokens, min_size=1, max_size=4).map(b",".join))
_field = st.one_of(st.tuples(_names, _values), st.tuples(st.just(b"connection"), _connection))


@settings(max_examples=1000, deadline=None)
@given(st.lists(_field, max_size=12), st.booleans(),
       st.lists(st.integers(-(1 << 62), 1 << 62), min_size=6, max_size=6),
       st.sampled_from([(), ((b"x-velox-upstream", b"u"), (b"x-velox-attempts", b"2"))]))
def test_relay_head_matches_its_python_twin(hdrs: list, keyed: bool, stamps: list[int],
                                            extra: tuple) -> None:
    # The native filter against velox.relay.exchange.answer_head (the Python writer's path), field
    # for field, the fields a Connection field names included (dropped by both).
    drop = _DROP_KEYED if keyed else _DROP
    out, sse, request_id = _native.relay_head(hdrs, drop, *stamps, extra)
    assert (out, sse, request_id) == answer_head(hdrs, drop, *stamps, extra)
    assert request_id == next((v for n, v in out if n == b"x-request-id"), None)
    assert out[-len(extra) - 1][0] == b"server-timing"  # the gateway's own are never dropped
    expected_sse = False
    for name, value in hdrs:
        if name == b"content-type":
            expected_sse = value.startswith(b"text/event-stream")
            break
    assert sse == expected_sse
    out.append((b"a", b"b"))  # the list grows like any other (observers append to it)
    assert out[-1] == (b"a", b"b")


@pytest.mark.parametrize("head", [_native.relay_head, answer_head])
def test_fields_a_connection_field_names_do_not_reach_the_client(head: object) -> None:
    # An HTTP/2 upstream must not send Connection at all (RFC 9113 section 8.2.2); one that
    # does, and an HTTP/1.1 one, gets the fields it names dropped like the field itself.
    hdrs = [(b"content-type", b"application/json"), (b"connection", b"x-hop, Keep-Alive"),
            (b"x-hop", b"1"), (b"keep-alive", b"timeout=5"), (b"x-kept", b"yes"),
            (b"connection", b"\tX-Other ,"), (b"x-other", b"2")]
    out, _, _ = head(hdrs, _DROP, 0, 0, 0, 0, 0, 0, ())  # type: ignore[operator]
    assert [name for name, _ in out] == [b"content-type", b"x-kept", b"server-timing"]


@pytest.mark.parametrize("bad", [[(b"a",)], [(b"a", "text")], [[b"a", b"b"]], ("a",)])
def test_relay_head_refuses_what_is_not_a_header_list(bad: object) -> None:
    with pytest.raises(TypeError):
        _native.relay_head(bad, _DROP, 0, 0, 0, 0, 0, 0, ())  # type: ignore[arg-type]


def test_codecs_without_receive_answers_keep_the_two_events() -> None:
    assert not hasattr(Framer(AUTHORITY, b"https"), "receive_answers")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_answers_and_heads_keep_refcounts_and_rss_flat() -> None:
    import sys

    codec = _native.H2Client(AUTHORITY, b"https", CodecError)
    codec.initiate()
    codec.receive_data(_SETTINGS)
    hdrs = [(b"content-type", b"application/json"), (b"content-length", b"2"), (b"x-a", b"b")]
    extra = ((b"x-velox-upstream", b"u"),)
    watched = (hdrs, hdrs[0], hdrs[1], extra, extra[0], _DROP)
    base = [sys.getrefcount(o) for o in watched]

    def one() -> None:
        sid = codec.send_request(b"GET", b"/", [], None)
        codec.data_to_send()
        events = codec.receive_answers(headers(sid) + data(sid, b"{}", True))
        assert events[0][0] == ANSWER and events[0][4] == b"{}"
        out, _, _ = _native.relay_head(hdrs, _DROP, 1, 2, 3, 4, 5, 6, extra)
        assert len(out) == 4
        with pytest.raises(TypeError):  # fails after keeping two fields: they go back
            _native.relay_head([*hdrs, (b"x", 1)], _DROP, 1, 2, 3, 4, 5, 6, extra)

    for _ in range(2_000):
        one()
    before = _rss()
    for _ in range(30_000):
        one()
    codec.data_to_send()
    assert [sys.getrefcount(o) for o in watched] == base
    assert codec.stream_state_count == 0
    assert _rss() - before < 8 * 1024 * 1024

"""The incremental SSE splitter: any split of the bytes (mid-line, mid-CRLF, mid-UTF-8) gives the
same events, for every line ending the SSE grammar allows."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from velox.providers import sse

EVENTS = [(b"message_start", '{"a": "h\u00e9llo \u4e16\u754c \U0001f389"}'.encode()),
          (b"", b'{"choices": []}'), (b"ping", b"{}"), (b"", b"[DONE]")]


def _stream(newline: bytes) -> bytes:
    out = b""
    for name, data in EVENTS:
        out += (b"event: " + name + newline if name else b"") + b"data: " + data + newline
        out += newline
    return out


def _read(pieces: list[bytes]) -> list[tuple[bytes, bytes]]:
    splitter = sse.Splitter()
    events = [sse.fields(block) for piece in pieces for block in splitter.feed(piece)]
    events += [sse.fields(block) for block in splitter.close()]
    assert splitter.pending() == b""
    return events


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([b"\n", b"\r\n", b"\r"]), st.data())
def test_any_split_any_line_end(newline, data):
    raw = _stream(newline)
    points = sorted(set(data.draw(st.lists(st.integers(1, len(raw) - 1), max_size=30))))
    pieces = [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)], strict=False)]
    assert _read(pieces) == EVENTS


def test_general_blocks():
    splitter = sse.Splitter()
    blocks = splitter.feed(b": comment\nid: 7\ndata: one\ndata:two\nevent:x\n\ndata: tail")
    assert [sse.fields(b) for b in blocks] == [(b"x", b"one\ntwo")]
    assert splitter.pending() == b"data: tail"
    assert sse.event(b"ping", b"{}") == b"event: ping\ndata: {}\n\n"
    assert sse.data(b"[DONE]") == b"data: [DONE]\n\n"


_LINES = st.sampled_from([b"event: message_stop", b"event: ping", b"data: {}", b"data: [DONE]",
                          b"data: {\"a\":\"b\\nc\"}", b"", b"\r", b"\r\n", b": comment",
                          b"event:x", b"data:1", b"id: 7"])


@given(st.lists(_LINES, max_size=6).map(lambda lines: b"\n".join(lines) + b"\n\n"))
def test_one_event_fast_path_agrees_with_feed_and_fields(data: bytes) -> None:
    """`Splitter.one` takes only reads that are exactly one event, and reads them as `feed`
    and `fields` would."""
    one = sse.Splitter().one(data)
    if one is not None:
        blocks = sse.Splitter().feed(data)
        assert len(blocks) == 1 and sse.fields(blocks[0]) == one
    held = sse.Splitter()
    held.feed(b"event: pi")
    assert held.one(b"ng\ndata: {}\n\n") is None  # something held: the slow path joins it

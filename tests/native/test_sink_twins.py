"""The direct path's decision on one streamed read (native/bind_sink.c, shared by the HTTP/1.1
reader and the HTTP/2 codec) against its Python twin (velox.relay.twins.sink_piece), and both
against the meter they stand in for (velox.relay.usage.SSEUsage.feed with nothing pending):
whenever the direct path takes a read, the meter would have sent exactly that piece and counted
the same events and bytes.

Reads are generated from OpenAI chunks (plain, with the `,"usage":null` an upstream adds when
asked for usage, a usage chunk, `[DONE]`), cut anywhere or on event boundaries, with stray
`"usage"`, CRLF boundaries and random bytes mixed in.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from velox import _native
from velox.relay.twins import SINK_MAX, sink_piece
from velox.relay.usage import SSEUsage

CHUNK = b'data: {"id":"c","choices":[{"delta":{"content":"%b"}}]%b}\n\n'
NULL = b',"usage":null'
USAGE = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":%d}}\n\n'
PIECES = st.one_of(
    st.builds(lambda t, n: CHUNK % (t, NULL if n else b""), st.binary(max_size=8), st.booleans()),
    st.integers(0, 99).map(lambda n: USAGE % n),
    st.sampled_from([b"data: [DONE]\n\n", b'"usage"', b",\"usage\":null", b"\r\n\r\n", b"\n",
                     b"\n\n", b": keep-alive\n\n"]),
    st.binary(max_size=12),
)


@st.composite
def reads(draw: st.DrawFn) -> bytes:
    data = b"".join(draw(st.lists(PIECES, min_size=1, max_size=6)))
    if draw(st.booleans()) and len(data) > 1:
        data = data[:draw(st.integers(1, len(data)))]
    return data


@settings(max_examples=3000, deadline=None)
@given(reads(), st.sampled_from(["strip", "keep", "none"]))
def test_the_sink_decides_as_its_twin_and_as_the_meter(data: bytes, meter: str) -> None:
    metered, strip = meter != "none", meter == "strip"
    native = _native.sink_piece(data, metered, strip)
    assert native == sink_piece(data, metered, strip)
    if native is None or not metered:
        return
    sse = SSEUsage(strip)
    assert sse.feed(data) == native
    assert not sse.pending and not sse.skipping and not sse.found
    assert sse.relayed == len(native)
    assert sse.events == (1 if native != data else data.count(b"\n\n"))


def test_long_reads_and_a_lone_null_usage_event() -> None:
    event = CHUNK % (b"x", NULL)
    assert _native.sink_piece(event, True, True) == CHUNK % (b"x", b"")
    assert _native.sink_piece(event * 2, True, True) is None  # two events: the meter's
    assert _native.sink_piece(event, True, False) is None  # kept usage: the meter reads it
    assert _native.sink_piece(event, False, False) == event
    big = b"data: " + b"x" * SINK_MAX + b"\n\n"
    assert _native.sink_piece(big, False, False) is None is sink_piece(big, False, False)

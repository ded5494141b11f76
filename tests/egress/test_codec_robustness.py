"""Egress codecs under hostile or unlucky input: malformed frames, arbitrary byte splits, fuzz.

Same in-memory `h2` server as test_codec_conformance. Where `h2`/`jh2` deviate from RFC 9113 the
expected outcome is pinned per codec, so a library upgrade that changes behaviour is noticed.
"""

from __future__ import annotations

import struct

import pytest
from h2.settings import SettingCodes
from hpack import Encoder
from hyperframe.frame import DataFrame, GoAwayFrame, HeadersFrame, RstStreamFrame
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from velox.egress.codec import (
    CANCEL,
    COMPRESSION_ERROR,
    DATA,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RESET,
    RESPONSE,
    STREAM_CLOSED,
    CodecError,
)

from ._codec_peer import (
    CODECS,
    DECODER_VARIANTS,
    FRAMER_LIKE,
    Peer,
    cycling_splitter,
    new_codec,
    parse_frames,
    raw_frame,
)

STATUS_200 = b"\x88"  # HPACK: static index 8
U32 = struct.Struct(">L")
SETTING = struct.Struct(">HL")
ACCEPTED = None  # the codec lets the frame through without an error



def oversized_headers(total: int) -> bytes:
    """A response header block of about `total` bytes in HEADERS + CONTINUATION frames."""
    fields = [(b":status", b"200")] + [(b"x-h%d" % i, b"v" * 1000) for i in range(total // 1000)]
    block = Encoder().encode(fields, huffman=False)
    chunks = [block[i : i + 16384] for i in range(0, len(block), 16384)]
    frames = [raw_frame(9, 0, 1, chunk) for chunk in chunks[1:-1]]
    return raw_frame(1, 0, 1, chunks[0]) + b"".join(frames) + raw_frame(9, 4, 1, chunks[-1])


# (frame bytes, expected error code, {codec: deviating outcome}); stream 1 is open, 3+ are idle.
MALFORMED = {
    "data_on_stream_0": (raw_frame(0, 0, 0, b"x"), PROTOCOL_ERROR, {}),
    "frame_over_max_size": (raw_frame(0, 0, 1, bytes(16385)), FRAME_SIZE_ERROR, {}),
    "connection_window_overflow": (
        raw_frame(8, 0, 0, U32.pack(2**31 - 1)),
        FLOW_CONTROL_ERROR,
        {},
    ),
    "zero_connection_window_update": (raw_frame(8, 0, 0, U32.pack(0)), PROTOCOL_ERROR, {}),
    # RFC 9113 section 4.3 calls for COMPRESSION_ERROR; the libraries report PROTOCOL_ERROR.
    "hpack_truncated": (
        raw_frame(1, 4, 1, b"\x04"),
        COMPRESSION_ERROR,
        {"jh2": PROTOCOL_ERROR, "h2": PROTOCOL_ERROR},
    ),
    "hpack_bad_index": (
        raw_frame(1, 4, 1, b"\xbf"),
        COMPRESSION_ERROR,
        {"jh2": PROTOCOL_ERROR, "h2": PROTOCOL_ERROR},
    ),
    "push_promise": (raw_frame(5, 4, 1, U32.pack(2) + STATUS_200), PROTOCOL_ERROR, {}),
    "frame_inside_header_block": (
        raw_frame(1, 0, 1, STATUS_200) + raw_frame(0, 1, 1, b"x"),
        PROTOCOL_ERROR,
        {},
    ),
    "continuation_of_another_stream": (
        raw_frame(1, 0, 1, STATUS_200) + raw_frame(9, 4, 3, b""),
        PROTOCOL_ERROR,
        {},
    ),
    "stray_continuation": (raw_frame(9, 4, 1, STATUS_200), PROTOCOL_ERROR, {}),
    "padding_too_long": (
        raw_frame(1, 4, 1, STATUS_200) + raw_frame(0, 8, 1, bytes([5]) + b"abcd"),
        PROTOCOL_ERROR,
        {},
    ),
    "settings_bad_length": (raw_frame(4, 0, 0, bytes(5)), FRAME_SIZE_ERROR, {}),
    "settings_window_too_large": (
        raw_frame(4, 0, 0, SETTING.pack(4, 2**31)),
        FLOW_CONTROL_ERROR,
        {},
    ),
    "settings_frame_size_too_small": (
        raw_frame(4, 0, 0, SETTING.pack(5, 100)),
        PROTOCOL_ERROR,
        {},
    ),
    "settings_enable_push": (
        raw_frame(4, 0, 0, SETTING.pack(2, 1)),
        PROTOCOL_ERROR,
        {"jh2": ACCEPTED},
    ),
    # RFC 9113 section 6.5 requires FRAME_SIZE_ERROR here.
    "settings_ack_with_payload": (
        raw_frame(4, 1, 0, bytes(6)),
        FRAME_SIZE_ERROR,
        {"jh2": PROTOCOL_ERROR, "h2": PROTOCOL_ERROR},
    ),
    "ping_bad_length": (raw_frame(6, 0, 0, bytes(7)), FRAME_SIZE_ERROR, {}),
    "ping_on_stream": (raw_frame(6, 0, 1, bytes(8)), PROTOCOL_ERROR, {}),
    "data_on_idle_stream": (raw_frame(0, 0, 7, b"x"), PROTOCOL_ERROR, {}),
    "headers_on_idle_stream": (raw_frame(1, 4, 7, STATUS_200), PROTOCOL_ERROR, {}),
    "rst_stream_on_idle_stream": (
        raw_frame(3, 0, 7, bytes(4)),
        PROTOCOL_ERROR,
        {"jh2": ACCEPTED, "h2": ACCEPTED},
    ),
    "rst_stream_bad_length": (raw_frame(3, 0, 1, bytes(3)), FRAME_SIZE_ERROR, {}),
    "window_update_bad_length": (raw_frame(8, 0, 0, bytes(3)), FRAME_SIZE_ERROR, {}),
    "goaway_on_stream": (raw_frame(7, 0, 1, bytes(8)), PROTOCOL_ERROR, {}),
    "header_list_over_64k": (oversized_headers(70_000), ENHANCE_YOUR_CALM, {}),
    "header_block_over_128k": (oversized_headers(140_000), ENHANCE_YOUR_CALM, {}),
}

# Stream-level violations: the framer resets just that stream (RFC 9113 section 5.4.2); the
# libraries escalate to a connection error, which section 5.4 permits.
STREAM_MALFORMED = {
    "response_without_status": raw_frame(1, 5, 1, b"\x0f\x10\x01a"),
    "data_before_response": raw_frame(0, 1, 1, b"x"),
    "trailers_without_end_stream": (
        raw_frame(1, 4, 1, STATUS_200) + raw_frame(1, 4, 1, b"\x0f\x10\x01a")
    ),
    "zero_stream_window_update": raw_frame(8, 0, 1, U32.pack(0)),
    "informational_with_end_stream": raw_frame(1, 5, 1, b"\x08\x03100"),
    "pseudo_header_after_status": raw_frame(1, 5, 1, STATUS_200 + b"\x01\x01a"),
}


def with_stream_open(codec: str) -> Peer:
    peer = Peer(codec)
    peer.pump()
    peer.codec.send_request(b"GET", b"/", [], None)
    peer.up()
    return peer


@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("codec", DECODER_VARIANTS)
def test_connection_errors(codec: str, case: str) -> None:
    frame, expected, deviations = MALFORMED[case]
    expected = deviations.get(codec, expected)
    peer = with_stream_open(codec)
    if expected is ACCEPTED:
        peer.codec.receive_data(frame)
        return
    with pytest.raises(CodecError) as info:
        peer.codec.receive_data(frame)
    assert info.value.error_code == expected
    goaways = [f for f in parse_frames(peer.codec.data_to_send()) if isinstance(f, GoAwayFrame)]
    assert [g.error_code for g in goaways] == [expected]
    with pytest.raises(CodecError) as refused:
        peer.codec.send_request(b"GET", b"/", [], None)
    assert refused.value.error_code == REFUSED_STREAM


@pytest.mark.parametrize("codec", CODECS)
def test_http1_garbage_is_a_frame_size_error(codec: str) -> None:
    peer = with_stream_open(codec)
    garbage = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 11\r\n\r\nBad Request"
    # The framer rejects the 4.7 MB "frame length" at once; the libraries only once a whole
    # frame's worth of bytes is buffered, so keep feeding until they do.
    with pytest.raises(CodecError) as info:
        peer.codec.receive_data(garbage)
        for _ in range(80):
            peer.codec.receive_data(bytes(65536))
    assert info.value.error_code == FRAME_SIZE_ERROR
    assert parse_frames(peer.codec.data_to_send())[-1].error_code == FRAME_SIZE_ERROR


@pytest.mark.parametrize("case", sorted(STREAM_MALFORMED))
@pytest.mark.parametrize("codec", CODECS)
def test_stream_errors(codec: str, case: str) -> None:
    peer = with_stream_open(codec)
    if codec not in FRAMER_LIKE:
        with pytest.raises(CodecError) as info:
            peer.codec.receive_data(STREAM_MALFORMED[case])
        assert info.value.error_code == PROTOCOL_ERROR
        return
    events = peer.codec.receive_data(STREAM_MALFORMED[case])
    assert events[-1] == (RESET, 1, PROTOCOL_ERROR)
    resets = [f for f in parse_frames(peer.codec.data_to_send()) if isinstance(f, RstStreamFrame)]
    assert [(f.stream_id, f.error_code) for f in resets] == [(1, PROTOCOL_ERROR)]
    assert peer.codec.stream_state_count == 0  # type: ignore[attr-defined]
    sid = peer.codec.send_request(b"GET", b"/", [], None)  # the connection carries on
    peer.up()
    peer.respond(sid, 200)
    assert peer.pump() == [(RESPONSE, sid, 200, [], True)]


# A :status that is not three digits (RFC 9113 section 8.3.2), which the h2 libraries' own
# validation lets through: every codec resets just that stream (the h2 adapter used to let a
# ValueError out of receive_data, found by the fuzz with a mutated status after a 1xx).
BAD_STATUS = {
    "non_numeric_status_after_informational": (
        raw_frame(1, 4, 1, b"\x08\x03100") + raw_frame(1, 4, 1, b"\x48\x03abc")
    ),
    "non_numeric_status_after_informational_with_end_stream": (
        raw_frame(1, 4, 1, b"\x08\x03100") + raw_frame(1, 5, 1, b"\x48\x03abc")
    ),
    "non_numeric_status": raw_frame(1, 4, 1, b"\x48\x032x0"),
    "two_digit_status": raw_frame(1, 4, 1, b"\x48\x0220"),
}


@pytest.mark.parametrize("case", sorted(BAD_STATUS))
@pytest.mark.parametrize("codec", CODECS)
def test_a_malformed_status_resets_only_its_stream(codec: str, case: str) -> None:
    peer = with_stream_open(codec)
    events = peer.codec.receive_data(BAD_STATUS[case])
    assert events == [(RESET, 1, PROTOCOL_ERROR)]
    resets = [f for f in parse_frames(peer.codec.data_to_send()) if isinstance(f, RstStreamFrame)]
    closed = case.endswith("end_stream") and codec not in FRAMER_LIKE
    # With END_STREAM on a GET the stream is closed both ways in the libraries' state: nothing
    # is left to reset on the wire (the framer and native send the RST_STREAM all the same).
    assert [(f.stream_id, f.error_code) for f in resets] == ([] if closed else
                                                             [(1, PROTOCOL_ERROR)])
    # The rest of that stream is dropped; the connection carries on.
    peer.codec.receive_data(raw_frame(0, 1, 1, b"late"))
    sid = peer.codec.send_request(b"GET", b"/", [], None)
    peer.up()
    peer.respond(sid, 200)
    assert peer.pump() == [(RESPONSE, sid, 200, [], True)]


@pytest.mark.parametrize("codec", CODECS)
def test_data_after_end_stream_resets_the_stream(codec: str) -> None:
    peer = Peer(codec, server_acks=False)
    peer.pump()
    peer.codec.send_request(b"POST", b"/", [], bytes(70_000))  # body still blocked on window
    peer.up()
    events = peer.codec.receive_data(raw_frame(1, 5, 1, STATUS_200) + raw_frame(0, 0, 1, b"x"))
    resets = [f for f in parse_frames(peer.codec.data_to_send()) if isinstance(f, RstStreamFrame)]
    if codec in FRAMER_LIKE:
        # A complete response ends the blocked upload at once (CANCEL), so the stray DATA
        # arrives on a stream already reset by us and is dropped (RFC 9113 §5.4.2).
        assert events == [(RESPONSE, 1, 200, [], True)]
        assert [(f.stream_id, f.error_code) for f in resets] == [(1, CANCEL)]
        assert peer.codec.stream_state_count == 0  # type: ignore[attr-defined]
    else:
        assert events == [(RESPONSE, 1, 200, [], True), (RESET, 1, STREAM_CLOSED)]
        assert [(f.stream_id, f.error_code) for f in resets] == [(1, STREAM_CLOSED)]


# --- Arbitrary splits ---------------------------------------------------------------------------

REQUESTS = [
    (b"GET", b"/v1/models", [(b"authorization", b"Bearer sk-1")], None),
    (b"POST", b"/v1/chat/completions", [(b"content-type", b"application/json")], bytes(30_000)),
    (b"GET", b"/v1/files", [], None),
]
_transcripts: dict[str, tuple[bytes, list[tuple]]] = {}


def transcript(codec: str) -> tuple[bytes, list[tuple]]:
    """Everything a real server sent in one busy exchange, and the events the codec saw."""
    if codec in _transcripts:
        return _transcripts[codec]
    peer = Peer(codec)
    peer.pump()
    s1, s2, s3 = (peer.codec.send_request(*request) for request in REQUESTS)
    peer.pump()
    peer.server.ping(b"12345678")
    peer.server.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: 50})
    big = [(b"x-big-%d" % i, bytes([65 + i]) * 900 + b"%d" % i) for i in range(40)]
    peer.respond(s1, 200, big, bytes(range(256)) * 150, trailers=[(b"x-usage", b"7")])
    peer.server.send_headers(s2, [(b":status", b"100")])
    peer.respond(s2, 201, [(b"x-request-id", b"req_2")], b'{"ok": true}')
    padded = HeadersFrame(s3, flags=["END_HEADERS", "PADDED"], pad_length=3)
    padded.data = peer.server.encoder.encode([(b":status", b"200"), (b"x-p", b"p")])
    data = DataFrame(s3, data=b"tail", flags=["PADDED", "END_STREAM"], pad_length=9)
    peer.down(padded.serialize() + data.serialize(), client_acks=True)
    peer.pump(client_acks=True)
    assert peer.codec.stream_state_count == 0  # type: ignore[attr-defined]
    _transcripts[codec] = (bytes(peer.server_wire), list(peer.events))
    return _transcripts[codec]


@pytest.mark.parametrize("codec", DECODER_VARIANTS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(min_value=1, max_value=3000), min_size=1, max_size=12))
def test_any_split_gives_the_same_events(codec: str, sizes: list[int]) -> None:
    wire, expected = transcript(codec)
    replay = new_codec(codec)
    replay.initiate()
    for request in REQUESTS:
        replay.send_request(*request)
    events: list[tuple] = []
    for chunk in cycling_splitter(sizes)(wire):
        new = replay.receive_data(chunk)
        for event in new:
            if event[0] == DATA:
                replay.acknowledge(event[1], event[3])
        events.extend(new)
    assert events == expected


# --- Fuzz ---------------------------------------------------------------------------------------

frames = st.builds(
    raw_frame,
    st.integers(min_value=0, max_value=11),
    st.integers(min_value=0, max_value=255),
    st.sampled_from([0, 1, 2, 3, 5, 0x80000001]),
    st.binary(max_size=24),
)


@pytest.mark.parametrize("codec", CODECS)
@settings(max_examples=150, deadline=None)
@given(stream=st.lists(frames, max_size=6), tail=st.binary(max_size=12))
def test_random_frames_raise_nothing_but_codec_errors(
    codec: str, stream: list[bytes], tail: bytes
) -> None:
    peer = with_stream_open(codec)
    try:
        peer.codec.receive_data(b"".join(stream) + tail)
    except CodecError as exc:
        frames_out = parse_frames(peer.codec.data_to_send())
        assert isinstance(frames_out[-1], GoAwayFrame)
        assert frames_out[-1].error_code == exc.error_code

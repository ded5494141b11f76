"""Every egress HTTP/2 codec against a real HTTP/2 server (python-hyper `h2`, in memory).

Each test runs for the native codec and its Python twin, the framer; the HPACK-heavy ones also
for the framer on its pure-Python decoder fallback. What a test asserts is observable protocol
behaviour: what the server receives, which events the codec emits, and which frames it writes.
"""

from __future__ import annotations

import hashlib
import random

import pytest
from h2.events import (
    DataReceived,
    PingAckReceived,
    RemoteSettingsChanged,
    RequestReceived,
    SettingsAcknowledged,
    StreamEnded,
    StreamReset,
    WindowUpdated,
)
from h2.settings import SettingCodes
from hpack import NeverIndexedHeaderTuple
from hpack.table import HeaderTable
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    HeadersFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from velox.egress import hpack_static
from velox.egress.codec import (
    CANCEL,
    DATA,
    DATA_PER_CALL,
    GOAWAY,
    LOCAL_CONNECTION_WINDOW,
    LOCAL_INITIAL_WINDOW_SIZE,
    LOCAL_MAX_HEADER_LIST_SIZE,
    PING_ACK,
    REFUSED_STREAM,
    RESET,
    RESPONSE,
    SETTINGS,
    TRAILERS,
    CodecError,
)

from ._codec_peer import (
    AUTHORITY,
    CODECS,
    DECODER_VARIANTS,
    Peer,
    cycling_splitter,
    new_codec,
    parse_frames,
    server_settings,
)

MiB = 1024 * 1024
STATIC_NAMES = list(dict.fromkeys(name for name, _ in HeaderTable.STATIC_TABLE))
CHAT_HEADERS = [
    (b"content-type", b"application/json"),
    (b"accept", b"application/json"),
    (b"accept-encoding", b"gzip, deflate"),  # an exact static-table entry
    (b"user-agent", b"OpenAI/Python 1.54.0"),
    (b"x-stainless-lang", b"python"),
    (b"x-long", b"v" * 300),  # string length needs a multi-byte HPACK integer
    (b"authorization", b"Bearer sk-test-0123456789"),
    (b"api-key", b"azure-key-abcdef"),
]

each_codec = pytest.mark.parametrize("codec", CODECS)


def ready(codec: str, settings: dict[int, int] | None = None, **kwargs: object) -> Peer:
    peer = Peer(codec, settings, **kwargs)  # type: ignore[arg-type]
    peer.pump()
    return peer


def received(peer: Peer, cls: type) -> list:
    return [e for e in peer.server_events if isinstance(e, cls)]


def body_received(peer: Peer, sid: int) -> bytes:
    return b"".join(e.data for e in received(peer, DataReceived) if e.stream_id == sid)


# --- Connection setup ---------------------------------------------------------------------------


@each_codec
def test_preface_and_settings_exchange(codec: str) -> None:
    peer = Peer(codec)
    assert peer.codec.max_concurrent_streams == 100  # conservative until the server speaks
    assert peer.codec.next_stream_id == 1
    assert peer.pump() == [(SETTINGS, 100)]

    (changed,) = received(peer, RemoteSettingsChanged)
    ours = {code: setting.new_value for code, setting in changed.changed_settings.items()}
    assert ours[SettingCodes.ENABLE_PUSH] == 0
    assert ours[SettingCodes.INITIAL_WINDOW_SIZE] == LOCAL_INITIAL_WINDOW_SIZE
    assert ours[SettingCodes.MAX_HEADER_LIST_SIZE] == LOCAL_MAX_HEADER_LIST_SIZE
    (window,) = received(peer, WindowUpdated)
    assert window.stream_id == 0
    assert window.delta == LOCAL_CONNECTION_WINDOW - 65535
    assert len(received(peer, SettingsAcknowledged)) == 1  # the codec ACKed the server
    assert peer.server.outbound_flow_control_window == LOCAL_CONNECTION_WINDOW


@each_codec
def test_max_concurrent_streams_absent_means_unlimited_capped(codec: str) -> None:
    peer = Peer(codec, {})  # the server announces no MAX_CONCURRENT_STREAMS at all
    assert peer.pump() == [(SETTINGS, 512)]
    assert peer.codec.max_concurrent_streams == 512


@each_codec
def test_settings_changes_emit_events_only_when_the_limit_changes(codec: str) -> None:
    peer = ready(codec)
    peer.server.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: 10})
    assert peer.pump() == [(SETTINGS, 10)]
    assert peer.codec.max_concurrent_streams == 10
    assert len(received(peer, SettingsAcknowledged)) == 2
    peer.server.update_settings({SettingCodes.MAX_HEADER_LIST_SIZE: 32768})
    assert peer.pump() == []
    peer.server.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: 100_000})
    assert peer.pump() == [(SETTINGS, 512)]


@each_codec
def test_ping_is_answered(codec: str) -> None:
    peer = ready(codec)
    peer.server.ping(b"velox-01")
    assert peer.pump() == []
    (ack,) = received(peer, PingAckReceived)
    assert ack.ping_data == b"velox-01"


@each_codec
def test_our_ping_is_acknowledged_by_the_peer(codec: str) -> None:
    # The liveness probe: the peer sees our PING, and its ACK comes back as a PING_ACK event.
    peer = ready(codec)
    peer.codec.send_ping(b"live-001")
    events = peer.pump()
    assert events == [(PING_ACK, b"live-001")]
    assert any(type(e).__name__ == "PingReceived" and e.ping_data == b"live-001"
               for e in peer.server_events)
    with pytest.raises(ValueError):
        peer.codec.send_ping(b"short")


@each_codec
def test_ping_ack_arrives_between_response_frames(codec: str) -> None:
    peer = ready(codec)
    sid = peer.codec.send_request(b"GET", b"/v1/models", [], None)
    peer.up()
    peer.codec.send_ping(b"\x00\x01\x02\x03\x04\x05\x06\x07")
    peer.up()
    peer.server.send_headers(sid, [(b":status", b"200")])
    peer.server.send_data(sid, b"ok", end_stream=True)
    events = peer.pump(client_acks=True)
    kinds = [e[0] for e in events]
    assert PING_ACK in kinds and RESPONSE in kinds and DATA in kinds
    assert (PING_ACK, b"\x00\x01\x02\x03\x04\x05\x06\x07") in events


# --- Requests and responses ---------------------------------------------------------------------


@each_codec
def test_get_without_body(codec: str) -> None:
    peer = ready(codec)
    sid = peer.codec.send_request(b"GET", b"/v1/models", CHAT_HEADERS, None)
    assert sid == 1 and peer.codec.next_stream_id == 3
    peer.up()
    (request,) = received(peer, RequestReceived)
    assert request.headers == [
        (b":method", b"GET"),
        (b":scheme", b"https"),
        (b":authority", AUTHORITY),
        (b":path", b"/v1/models"),
        *CHAT_HEADERS,
    ]
    sensitive = {name for name, _ in CHAT_HEADERS if name in (b"authorization", b"api-key")}
    never_indexed = {h[0] for h in request.headers if isinstance(h, NeverIndexedHeaderTuple)}
    assert never_indexed == sensitive
    assert request.stream_ended is not None  # END_STREAM rode on HEADERS
    assert received(peer, DataReceived) == []

    peer.respond(sid, 200, [(b"content-type", b"application/json")], b'{"data": []}')
    assert peer.pump() == [
        (RESPONSE, sid, 200, [(b"content-type", b"application/json")], False),
        (DATA, sid, b'{"data": []}', 12, True),
    ]
    assert peer.codec.stream_state_count == 0  # type: ignore[attr-defined]


@each_codec
def test_post_with_body_and_bodiless_response(codec: str) -> None:
    peer = ready(codec)
    body = b'{"model": "gpt-4o-mini", "messages": []}'
    sid = peer.codec.send_request(b"POST", b"/v1/chat/completions", CHAT_HEADERS, body)
    peer.up()
    (request,) = received(peer, RequestReceived)
    assert request.headers[0] == (b":method", b"POST")
    assert body_received(peer, sid) == body
    assert [e.stream_id for e in received(peer, StreamEnded)] == [sid]
    peer.respond(sid, 204, [(b"x-request-id", b"req_1")])
    assert peer.pump() == [(RESPONSE, sid, 204, [(b"x-request-id", b"req_1")], True)]
    assert peer.codec.stream_state_count == 0  # type: ignore[attr-defined]


@each_codec
def test_informational_responses_are_swallowed(codec: str) -> None:
    peer = ready(codec)
    sid = peer.codec.send_request(b"GET", b"/", [], None)
    peer.up()
    peer.server.send_headers(sid, [(b":status", b"103"), (b"link", b"</a>; rel=preload")])
    peer.respond(sid, 200, body=b"ok")
    assert peer.pump() == [(RESPONSE, sid, 200, [], False), (DATA, sid, b"ok", 2, True)]


@each_codec
def test_trailers(codec: str) -> None:
    peer = ready(codec)
    sid = peer.codec.send_request(b"GET", b"/stream", [], None)
    peer.up()
    peer.respond(sid, 200, body=b"chunk", trailers=[(b"x-usage", b"42")])
    assert peer.pump() == [
        (RESPONSE, sid, 200, [], False),
        (DATA, sid, b"chunk", 5, False),
        (TRAILERS, sid, [(b"x-usage", b"42")]),
    ]
    assert peer.codec.stream_state_count == 0  # type: ignore[attr-defined]


@each_codec
def test_large_response_headers_arrive_in_continuation_frames(codec: str) -> None:
    peer = ready(codec)
    sid = peer.codec.send_request(b"GET", b"/", [], None)
    peer.up()
    # Random hex defeats Huffman coding: ~37 KiB encoded, more than two 16 KiB frames.
    big = [(b"x-big-%d" % i, random.Random(i).randbytes(500).hex().encode()) for i in range(60)]
    peer.respond(sid, 200, big, b"done")
    assert peer.pump() == [(RESPONSE, sid, 200, big, False), (DATA, sid, b"done", 4, True)]
    frames = parse_frames(bytes(peer.server_wire))
    assert sum(isinstance(f, ContinuationFrame) for f in frames) >= 2


@each_codec
def test_padded_headers_and_data(codec: str) -> None:
    peer = ready(codec)
    sid = peer.codec.send_request(b"GET", b"/", [], None)
    peer.up()
    # h2 never pads, so these frames are built by hand, HPACK-encoded with the server's own
    # encoder so both sides' tables stay in step.
    headers = HeadersFrame(sid, flags=["END_HEADERS", "PADDED", "PRIORITY"], pad_length=7)
    headers.data = peer.server.encoder.encode([(b":status", b"200"), (b"x-p", b"1")])
    headers.depends_on, headers.stream_weight = 0, 15
    data = DataFrame(sid, data=b"padded body", flags=["PADDED", "END_STREAM"], pad_length=20)
    assert peer.down(headers.serialize() + data.serialize()) == [
        (RESPONSE, sid, 200, [(b"x-p", b"1")], False),
        (DATA, sid, b"padded body", 11 + 1 + 20, True),
    ]
    peer.codec.acknowledge(sid, 32)
    assert peer.codec.stream_state_count == 0  # type: ignore[attr-defined]


# --- Flow control -------------------------------------------------------------------------------


@each_codec
def test_body_larger_than_the_window_waits_for_window_updates(codec: str) -> None:
    peer = ready(codec, server_settings(INITIAL_WINDOW_SIZE=1000), server_acks=False)
    body = random.Random(7).randbytes(200_000)  # beyond the connection window too
    buffer = bytearray(body)
    sid = peer.codec.send_request(b"POST", b"/v1/files", [], memoryview(buffer))
    buffer[:] = bytes(len(buffer))  # the caller reuses its buffer: the codec must have copied
    peer.up()
    assert body_received(peer, sid) == body[:1000]
    assert received(peer, StreamEnded) == []
    assert peer.codec.data_to_send() == b""  # blocked until the server grants more
    peer.server_acks = True
    for event in received(peer, DataReceived):
        peer.server.acknowledge_received_data(event.flow_controlled_length, sid)
    peer.pump()
    assert body_received(peer, sid) == body
    assert [e.stream_id for e in received(peer, StreamEnded)] == [sid]
    frames = [f for f in parse_frames(bytes(peer.client_wire)) if isinstance(f, DataFrame)]
    assert max(len(f.data) for f in frames) <= 1000


@each_codec
def test_a_large_body_is_framed_a_budget_per_call(codec: str) -> None:
    # Windows wide open: only DATA_PER_CALL limits what one data_to_send call carries.
    big = {SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1}
    peer = ready(codec, big)
    peer.server.increment_flow_control_window(2**31 - 1 - 65535)
    peer.pump()
    body = random.Random(11).randbytes(3 * DATA_PER_CALL + 12345)
    small = b'{"model": "m"}'
    sid = peer.codec.send_request(b"POST", b"/v1/files", [], body)
    calls = 0
    while True:
        data = peer.codec.data_to_send()
        calls += 1
        frames = parse_frames(data)
        assert sum(len(f.data) for f in frames if isinstance(f, DataFrame)) <= DATA_PER_CALL
        peer._up(data)
        if calls == 2:  # another request in between is not held up behind the upload
            other = peer.codec.send_request(b"POST", b"/v1/chat/completions", [], small)
        if not peer.codec.data_pending:
            break
        assert calls < 10
    assert calls == 4
    assert body_received(peer, sid) == body
    assert body_received(peer, other) == small
    assert sorted(e.stream_id for e in received(peer, StreamEnded)) == [sid, other]


@each_codec
def test_initial_window_size_change_mid_body(codec: str) -> None:
    peer = ready(codec, server_settings(INITIAL_WINDOW_SIZE=1000), server_acks=False)
    body = bytes(range(256)) * 40  # 10240 bytes
    sid = peer.codec.send_request(b"POST", b"/upload", [], body)
    peer.pump()
    assert len(body_received(peer, sid)) == 1000
    peer.server.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 3000})
    peer.pump()  # +2000 on every open stream (RFC 9113 section 6.9.2)
    assert len(body_received(peer, sid)) == 3000
    peer.server.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 500})
    peer.pump()  # -2500: the window is now negative, so nothing more may be sent
    assert len(body_received(peer, sid)) == 3000
    peer.server.increment_flow_control_window(2600, stream_id=sid)
    peer.pump()  # -2500 + 2600 leaves exactly 100 bytes of credit
    assert len(body_received(peer, sid)) == 3100
    peer.server_acks = True
    peer.server.increment_flow_control_window(20_000, stream_id=sid)
    peer.pump()
    assert body_received(peer, sid) == body
    assert peer.codec.stream_state_count == 1  # type: ignore[attr-defined]  # awaits response


@each_codec
def test_acknowledge_is_lazy_and_keeps_a_long_stream_flowing(codec: str) -> None:
    peer = ready(codec)
    sid = peer.codec.send_request(b"GET", b"/big", [], None)
    peer.up()
    peer.server.send_headers(sid, [(b":status", b"200")])
    peer.server.send_data(sid, b"x" * 16384)
    assert [e[0] for e in peer.down(client_acks=True)] == [RESPONSE, DATA]
    assert peer.codec.data_to_send() == b""  # 16 KiB acknowledged is far below the threshold

    sent, got = hashlib.sha256(b"x" * 16384), hashlib.sha256(b"x" * 16384)
    chunks, chunk, step = 20, MiB, peer.server.max_outbound_frame_size
    for i in range(chunks):
        # The server never finds the window close to empty: credit returns at half a window.
        assert peer.server.local_flow_control_window(sid) >= chunk
        block = bytes([i]) * chunk
        sent.update(block)
        for off in range(0, chunk, step):
            last = i == chunks - 1 and off + step >= chunk
            peer.server.send_data(sid, block[off : off + step], end_stream=last)
        for event in peer.pump(client_acks=True):
            got.update(event[2])
    assert got.digest() == sent.digest()
    assert peer.events[-1][0] == DATA and peer.events[-1][4] is True
    updates = [f for f in parse_frames(bytes(peer.client_wire)) if isinstance(f, WindowUpdateFrame)]
    # ~20 MiB consumed: one stream update per 4 MiB, and no connection update below 32 MiB
    # beyond the one in the preface.
    assert 4 <= len([f for f in updates if f.stream_id == sid]) <= 6
    assert len([f for f in updates if f.stream_id == 0]) == 1


@each_codec
def test_reset_stream_drops_late_frames_and_still_credits_the_connection(codec: str) -> None:
    peer = ready(codec)
    sids = [peer.codec.send_request(b"GET", b"/gen", [], None) for _ in range(5)]
    peer.up()
    payload = b"y" * 16384
    for sid in sids:  # 5 x 7 MiB in flight: more than half the connection window
        peer.server.send_headers(sid, [(b":status", b"200")])
        for _ in range(7 * 64):
            peer.server.send_data(sid, payload)
    in_flight = peer.server.data_to_send()
    window_before = peer.server.outbound_flow_control_window
    for sid in sids:
        peer.codec.reset_stream(sid)
    peer.up()
    resets = received(peer, StreamReset)
    assert [(e.stream_id, e.error_code) for e in resets] == [(sid, CANCEL) for sid in sids]
    assert peer.codec.stream_state_count == 0  # type: ignore[attr-defined]
    assert peer.down(in_flight) == []  # late HEADERS and DATA are dropped without errors
    peer.up()
    # 35 MiB were dropped; the codec handed at least 32 MiB of them back to the connection.
    assert peer.server.outbound_flow_control_window >= window_before + 32 * MiB
    sid = peer.codec.send_request(b"GET", b"/after", [], None)  # the connection is healthy
    peer.up()
    peer.respond(sid, 200, body=b"fine")
    assert peer.pump()[-1] == (DATA, sid, b"fine", 4, True)
    peer.codec.acknowledge(sids[0], 100)  # acknowledging a reset stream is harmless


@each_codec
def test_credit_is_handed_back_while_paused_streams_hold_most_of_the_window(codec: str) -> None:
    # Streams whose clients stopped reading keep their bytes unacknowledged (the relay
    # withholds them). What other streams hand back must still reach the server: held back
    # until half the connection window had been returned (32 MiB), it never was once paused
    # streams held more than half, and every stream on the connection starved with the credit
    # sitting in the codec (a provider resetting streams under paused clients showed it).
    peer = ready(codec)
    block = b"p" * peer.server.max_outbound_frame_size
    paused = [peer.codec.send_request(b"GET", b"/paused", [], None) for _ in range(6)]
    ending = peer.codec.send_request(b"GET", b"/ending", [], None)
    peer.up()
    for sid in (*paused, ending):  # 6 x 7 MiB withheld, then a 7 MiB stream that ends
        peer.server.send_headers(sid, [(b":status", b"200")])
        for _ in range(7 * 64):
            peer.server.send_data(sid, block)
    peer.pump()
    peer.codec.reset_stream(ending)
    peer.codec.acknowledge(ending, 7 * MiB)  # its bytes handed back, as on any ending
    peer.up()
    more = [peer.codec.send_request(b"GET", b"/more", [], None) for _ in range(3)]
    peer.up()
    sent = 0
    for sid in more:  # (their clients pause too: nothing of theirs is handed back)
        peer.server.send_headers(sid, [(b":status", b"200")])
        while (room := min(peer.server.local_flow_control_window(sid), len(block))) > 0:
            peer.server.send_data(sid, block[:room])
            sent += room
            peer.pump()
    # All the paused streams do not hold (64 - 42 MiB), not only the 15 MiB that were left
    # before the ended stream's credit.
    assert sent == LOCAL_CONNECTION_WINDOW - 42 * MiB


@each_codec
def test_server_reset_stream(codec: str) -> None:
    peer = ready(codec, server_settings(INITIAL_WINDOW_SIZE=100), server_acks=False)
    sid = peer.codec.send_request(b"POST", b"/x", [], b"b" * 1000)  # body left blocked
    peer.up()
    peer.server.reset_stream(sid, error_code=REFUSED_STREAM)
    assert peer.pump() == [(RESET, sid, REFUSED_STREAM)]
    assert peer.codec.stream_state_count == 0  # type: ignore[attr-defined]


@each_codec
def test_goaway(codec: str) -> None:
    peer = ready(codec)
    sids = [peer.codec.send_request(b"GET", b"/", [], None) for _ in range(3)]
    peer.up()
    peer.server.close_connection(error_code=0, additional_data=b"bye", last_stream_id=sids[0])
    assert peer.pump() == [(GOAWAY, sids[0], 0, b"bye")]
    with pytest.raises(CodecError) as info:
        peer.codec.send_request(b"GET", b"/", [], None)
    assert info.value.error_code == REFUSED_STREAM


# --- State and HPACK ----------------------------------------------------------------------------


@each_codec
def test_ten_thousand_streams_leave_no_state(codec: str) -> None:
    peer = ready(codec)
    for batch in range(100):
        sids = [
            # A per-request value, like an idempotency key, must not grow any encoder cache.
            peer.codec.send_request(
                b"POST", b"/v1/x", [*CHAT_HEADERS, (b"x-nonce", b"%d-%d" % (batch, i))], b"{}"
            )
            for i in range(100)
        ]
        peer.up()
        for sid in sids:
            peer.respond(sid, 200, [(b"x-batch", str(batch).encode())], b"{}")
        events = peer.down(client_acks=True)
        assert len(events) == 200
        assert peer.codec.stream_state_count == 0  # type: ignore[attr-defined]
    assert peer.codec.next_stream_id == 20_001
    assert len(hpack_static.FIELD_CACHE) <= hpack_static.FIELD_CACHE_LIMIT


@each_codec
def test_every_static_table_name_round_trips(codec: str) -> None:
    # A wrong static index in a hand-written encoder would rename a header: the server would see
    # a different name or value here.
    fields = [(b"accept-encoding", b"gzip, deflate"), (b"accept-encoding", b"br")]
    for name in STATIC_NAMES:
        if not name.startswith(b":") and name not in (b"host", b"transfer-encoding"):
            fields.append((name, b"0" if name == b"content-length" else b"v-" + name))
    peer = ready(codec)
    peer.codec.send_request(b"GET", b"/", fields, None)
    peer.codec.send_request(b"DELETE", b"/v1/files/1", fields, None)  # not in the static table
    peer.up()
    first, second = received(peer, RequestReceived)
    assert sorted(first.headers[4:]) == sorted(fields)  # the server moves cookie to the end
    assert second.headers[:4] == [
        (b":method", b"DELETE"),
        (b":scheme", b"https"),
        (b":authority", AUTHORITY),
        (b":path", b"/v1/files/1"),
    ]
    assert sorted(second.headers[4:]) == sorted(fields)


@pytest.mark.parametrize("codec", DECODER_VARIANTS)
def test_hpack_dynamic_table_across_many_responses(codec: str) -> None:
    peer = ready(codec)
    rng = random.Random(3)
    for _ in range(300):
        sid = peer.codec.send_request(b"GET", b"/", [], None)
        peer.up()
        headers = [
            (b"content-type", b"application/json"),
            (b"openai-organization", b"org-velox"),
            (b"openai-processing-ms", str(rng.randrange(10, 5000)).encode()),
            (b"x-request-id", f"req_{rng.getrandbits(64):016x}".encode()),
            (b"x-filler", b"f" * rng.choice([10, 200, 1500])),  # forces evictions
        ]
        peer.respond(sid, 200, headers)
        assert peer.down() == [(RESPONSE, sid, 200, headers, True)]
    assert peer.server.encoder.header_table.dynamic_entries  # the table really was used


@each_codec
def test_requests_survive_a_smaller_server_header_table(codec: str) -> None:
    peer = ready(codec)
    peer.server.update_settings({SettingCodes.HEADER_TABLE_SIZE: 0})
    peer.pump()
    for i in range(3):
        sid = peer.codec.send_request(b"POST", b"/v1/chat/completions", CHAT_HEADERS, b"{}")
        data = peer.codec.data_to_send()
        if i == 0:  # a decoder may insist on a table size update after its limit shrank
            (frame, _) = parse_frames(data)
            assert isinstance(frame, HeadersFrame) and frame.data[0] & 0xE0 == 0x20
        peer._up(data)
        assert received(peer, RequestReceived)[-1].headers[4:] == CHAT_HEADERS
        peer.respond(sid, 200)
        peer.pump()


@each_codec
def test_frame_boundaries_anywhere(codec: str) -> None:
    """Byte-at-a-time in both directions; the random split property test is in test_codec_splits."""
    one = cycling_splitter([1])
    peer = ready(codec, split_down=one, split_up=one)
    sid = peer.codec.send_request(b"POST", b"/v1/chat/completions", CHAT_HEADERS, b"q" * 3000)
    peer.up()
    big = [(b"x-big", b"z" * 5000)]
    peer.respond(sid, 200, big, b"r" * 5000, trailers=[(b"x-t", b"1")])
    events = peer.pump(client_acks=True)
    assert events[0] == (RESPONSE, sid, 200, big, False)
    assert b"".join(e[2] for e in events if e[0] == DATA) == b"r" * 5000
    assert events[-1] == (TRAILERS, sid, [(b"x-t", b"1")])
    assert body_received(peer, sid) == b"q" * 3000


# --- Misuse by the caller -----------------------------------------------------------------------


@each_codec
def test_acknowledge_rejects_streams_never_opened(codec: str) -> None:
    peer = ready(codec)
    with pytest.raises(ValueError):
        peer.codec.acknowledge(1, 10)
    peer.codec.reset_stream(99)  # unknown: nothing to do, nothing queued
    assert peer.codec.data_to_send() == b""


@each_codec
def test_close_queues_goaway_and_refuses_new_streams(codec: str) -> None:
    peer = ready(codec)
    peer.codec.close()
    frames = parse_frames(peer.codec.data_to_send())
    assert [type(f).__name__ for f in frames] == ["GoAwayFrame"]
    assert frames[0].error_code == 0
    with pytest.raises(CodecError):
        peer.codec.send_request(b"GET", b"/", [], None)


@each_codec
def test_new_codec_is_fresh_per_connection(codec: str) -> None:
    a, b = new_codec(codec), new_codec(codec)
    a.initiate()
    a.send_request(b"GET", b"/", [], None)
    assert b.next_stream_id == 1
    assert isinstance(parse_frames(a.data_to_send())[0], SettingsFrame)

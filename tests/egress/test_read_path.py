"""The flush after an upstream read's events: `H2Client.has_output` must say exactly whether
`data_to_send` has something to return, so a read that queued nothing skips the connection's
flush and one that queued frames (a WINDOW_UPDATE, a PING's ACK) still has them written.
"""

from __future__ import annotations

import struct

from velox import _native
from velox.egress.codec import CodecError
from velox_lab.pipeline import CHAT_BODY, FakeTransport, Pipeline, reply_frames

AUTHORITY = b"api.example.com"


def _frame(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + \
        struct.pack(">I", sid) + payload


def test_has_output_says_whether_data_to_send_returns_bytes() -> None:
    codec = _native.H2Client(AUTHORITY, b"https", CodecError)
    assert not codec.has_output
    codec.initiate()
    assert codec.has_output  # the preface
    assert codec.data_to_send() and not codec.has_output
    codec.receive_data(_frame(4, 0, 0, b""))  # SETTINGS: the codec queues its ACK
    assert codec.has_output
    codec.data_to_send()
    sids = [codec.send_request(b"POST", b"/v1/x", [], CHAT_BODY) for _ in range(3)]
    assert codec.has_output
    codec.data_to_send()
    # Small answers: credit is returned in large WINDOW_UPDATEs, so these queue nothing.
    events = codec.receive_answers(b"".join(reply_frames(sid) for sid in sids))
    assert len(events) == 3 and not codec.has_output
    assert codec.data_to_send() == b""
    codec.send_ping(b"12345678")
    assert codec.has_output
    codec.data_to_send()
    # Body data held back (more than one call's worth): pending, so has_output until framed.
    codec.receive_data(_frame(8, 0, 0, struct.pack(">I", 1 << 24)))
    codec.data_to_send()
    codec.send_request(b"POST", b"/v1/x", [], b"b" * (_native.H2_DATA_PER_CALL * 2))
    while codec.has_output:
        assert codec.data_to_send() or codec.data_pending
    assert codec.data_to_send() == b"" and not codec.data_pending


class _CountingTransport(FakeTransport):
    __slots__ = ("writes",)

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1
        super().write(data)


def test_a_read_that_queued_frames_still_writes_them() -> None:
    """The read path's flush is skipped only when nothing is queued: a PING answered in the
    same read as an answer goes out at once, and the answer reaches its client."""
    pipeline = Pipeline(clients=1)
    transport = _CountingTransport()
    pipeline.conn.transport = transport  # type: ignore[assignment]
    pipeline.send_requests()
    before = transport.writes
    (sid,) = list(pipeline.conn.streams)
    pipeline.conn.data_received(reply_frames(sid))
    pipeline.loop.run_ready()
    assert transport.writes == before  # nothing to send: no write, no flush
    assert pipeline.responses_written() > 0
    ping = _frame(6, 0, 0, b"abcdefgh")
    pipeline.send_requests()
    (sid,) = list(pipeline.conn.streams)
    pipeline.conn.data_received(ping + reply_frames(sid))
    pipeline.loop.run_ready()
    assert transport.writes == before + 2  # the second request, then the PING's ACK
    assert not pipeline.conn.codec.has_output

"""The native HTTP/2 codec's direct path (H2Client.direct), socket-free, against the Python path.

A real HTTP/2 server (python-hyper `h2`, in memory) streams event streams on several streams at
once, its DATA frames cut anywhere (whole events, several events, half an event, a usage chunk,
the `,"usage":null` an OpenAI upstream adds to every chunk when asked for usage) and the reads
cut anywhere too, so one read carries frames of several streams, several frames of one stream,
or the frame that ends it. Each stream's client gets its bytes twice: once all through the
Python path (every DATA event fed to velox.relay.usage.SSEUsage, framed as ingress's chunks, as
h2conn and the relay do) and once with the stream directed, the events the codec still returns
going through the same Python path. The client gets the same bytes, the meters and byte counts
end the same, and what was credited back to the upstream is the same. A write that pauses the
client makes the codec withhold the credit on the attempt.
"""

from __future__ import annotations

import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.egress._codec_peer import Peer
from tests.native.test_h1resp_direct import CHUNK, NULL, USAGE, Client, Holder
from velox.egress.codec import DATA, RESPONSE
from velox.relay.usage import SSEUsage

SSE = [(b"content-type", b"text/event-stream")]


class Stream:
    """One stream's client side: its connection, meter, exchange and attempt."""

    def __init__(self, meter: str) -> None:
        self.client = Client()
        self.sse = None if meter == "none" else SSEUsage(meter == "strip")
        self.exchange = Holder()
        self.attempt = Holder()
        self.attempt.withheld = 0
        self.python_events = 0
        self.ended = False

    def on_data(self, data: bytes, end: bool) -> None:  # h2conn + the relay's Python path
        self.python_events += 1
        piece = data if self.sse is None else self.sse.feed(data)
        if self.client.write_paused:  # ingress queues it until the client reads again
            self.client._q = [*(self.client._q or []), piece]
        else:
            self.client.send(piece)
        if end:
            self.ended = True


def _unchunk(written: list[bytes]) -> bytes:
    data, body = b"".join(written), b""
    while data:
        size, _, rest = data.partition(b"\r\n")
        n = int(size, 16)
        assert rest[n:n + 2] == b"\r\n"
        body, data = body + rest[:n], rest[n + 2:]
    return body


def _events(rng: random.Random, n: int) -> bytes:
    out = b""
    for i in range(n):
        kind = rng.choice(["plain", "null", "null", "usage"])
        out += USAGE % (i, i + 3) if kind == "usage" else \
            CHUNK % (b"tok%d" % i, NULL if kind == "null" else b"")
    return out


def _run(seed: int, meters: list[str], direct: bool) -> tuple[list[Stream], Peer]:
    """Serve one event stream per meter on one connection; return the streams and the peer."""
    rng = random.Random(seed)
    peer = Peer("native")
    codec: Any = peer.codec
    peer.pump()
    streams: dict[int, Stream] = {}
    bodies: dict[int, bytes] = {}
    for meter in meters:
        sid = codec.send_request(b"POST", b"/v1/chat/completions", [], b"{}")
        streams[sid] = Stream(meter)
        bodies[sid] = _events(rng, rng.randint(1, 10))
    peer.up()
    for sid in streams:
        peer.server.send_headers(sid, [(b":status", b"200"), *SSE])

    def deliver() -> None:
        wire = peer.server.data_to_send()
        peer.server_wire += wire
        cuts = sorted(rng.sample(range(1, len(wire)), min(len(wire) - 1, rng.randint(0, 6)))) \
            if len(wire) > 1 else []
        for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True):
            for event in codec.receive_answers(wire[a:b]):
                if event[0] == RESPONSE:
                    s = streams[event[1]]
                    if direct:
                        assert codec.direct(event[1], s.client, s.client.write, s.sse,
                                            s.exchange, s.attempt, True)
                elif event[0] == DATA:
                    s = streams[event[1]]
                    s.on_data(event[2], event[4])
                    codec.acknowledge(event[1], event[3])

    deliver()
    # The bodies in frames cut anywhere, the streams interleaved, several sends per delivery.
    pos = dict.fromkeys(bodies, 0)
    while any(pos[sid] < len(body) for sid, body in bodies.items()):
        for sid, body in bodies.items():
            if pos[sid] >= len(body) or rng.random() < 0.3:
                continue
            n = rng.randint(1, len(body) - pos[sid])
            if rng.random() < 0.7:  # mostly on event boundaries, as an upstream writes
                end = body.find(b"\n\n", pos[sid] + n - 1)
                n = (end + 2 if end >= 0 else len(body)) - pos[sid]
            piece = body[pos[sid]:pos[sid] + n]
            pos[sid] += n
            peer.server.send_data(sid, piece, end_stream=pos[sid] == len(body))
        if rng.random() < 0.5:
            deliver()
    deliver()
    for sid in streams:
        codec.undirect(sid)
    return list(streams.values()), peer


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32), st.lists(st.sampled_from(["strip", "keep", "none"]), min_size=1,
                                      max_size=5))
def test_the_direct_path_sends_and_counts_what_the_python_path_does(
        seed: int, meters: list[str]) -> None:
    py, _ = _run(seed, meters, direct=False)
    c, peer = _run(seed, meters, direct=True)
    assert peer.codec.stream_state_count == 0  # type: ignore[attr-defined]
    for a, b in zip(py, c, strict=True):
        assert a.ended and b.ended
        # The same body (C writes a stream's frames of one read as one chunk, Python each
        # frame's piece as its own), and the byte count is what was written.
        assert _unchunk(b.client.written) == _unchunk(a.client.written)
        assert b.client._stream_bytes == sum(map(len, b.client.written))
        if a.sse is not None and b.sse is not None:
            assert (b.sse.events, b.sse.relayed, b.sse.found, b.sse.input, b.sse.output) == \
                (a.sse.events, a.sse.relayed, a.sse.found, a.sse.input, a.sse.output)
        assert b.python_events <= a.python_events
        assert b.attempt.withheld == 0
        if b.python_events < a.python_events:
            assert b.attempt.last_activity > 0 and b.exchange.tail == b"\n\n"


def _window_updates(data: bytes) -> list[tuple[int, int]]:
    from hyperframe.frame import WindowUpdateFrame

    from tests.egress._codec_peer import parse_frames
    return [(f.stream_id, f.window_increment) for f in parse_frames(data)
            if isinstance(f, WindowUpdateFrame)]


def _serve_plain(direct: bool, pause_after: int = -1) -> tuple[Stream, list[tuple[int, int]],
                                                               Any, int]:
    """One stream of 5 MiB of plain events in 16 KiB frames, one frame per read (past the
    codec's 4 MiB stream threshold for a WINDOW_UPDATE): the stream, the WINDOW_UPDATEs the
    codec queued, the codec, the stream id."""
    peer = Peer("native")
    codec: Any = peer.codec
    peer.pump()
    sid = codec.send_request(b"POST", b"/v1/chat/completions", [], b"{}")
    s = Stream("strip")
    s.client.pause_after = pause_after
    peer.up()
    peer.server.send_headers(sid, [(b":status", b"200"), *SSE])
    for event in codec.receive_answers(peer.server.data_to_send()):
        if event[0] == RESPONSE and direct:
            assert codec.direct(sid, s.client, s.client.write, s.sse, s.exchange, s.attempt, True)
    codec.data_to_send()
    # One event a frame (a stripped chunk is the direct path's only when alone in a read).
    frame = CHUNK % (b"x" * 15_900, NULL)
    sent = 0
    while sent < 5 << 20:
        peer.server.send_data(sid, frame)
        sent += len(frame)
        for ev in codec.receive_answers(peer.server.data_to_send()):
            assert ev[0] == DATA
            s.on_data(ev[2], ev[4])
            if s.client.write_paused:
                s.attempt.withheld += ev[3]
            else:
                codec.acknowledge(sid, ev[3])
        peer.server.receive_data(out := codec.data_to_send())
        s.updates = getattr(s, "updates", []) + _window_updates(out)  # type: ignore[attr-defined]
    return s, s.updates, codec, sid  # type: ignore[attr-defined]


def test_plain_frames_never_reach_python_and_the_window_is_credited_as_python_does() -> None:
    py, py_updates, _, _ = _serve_plain(direct=False)
    c, c_updates, _, _ = _serve_plain(direct=True)
    assert c.python_events == 0 and py.python_events > 300
    assert c.client.written == py.client.written  # one frame a read: the same chunks
    assert NULL not in b"".join(c.client.written)
    assert c.sse is not None and py.sse is not None and c.sse.events == py.sse.events
    assert c_updates == py_updates and any(sid != 0 for sid, _ in c_updates)


def test_a_client_that_fills_up_makes_the_codec_withhold_the_credit() -> None:
    s, updates, codec, sid = _serve_plain(direct=True, pause_after=3)
    assert len(s.client.written) == 3  # the third write paused the client: Python from then on
    assert s.python_events == len(s.client._q) > 300
    assert not any(sid_ != 0 for sid_, _ in updates)  # the stream's window was not credited
    withheld = s.attempt.withheld
    assert withheld >= (5 << 20) - 3 * 16_000
    codec.acknowledge(sid, withheld)  # the client reads again: Exchange.resume -> credit
    assert any(sid_ == sid for sid_, _ in _window_updates(codec.data_to_send()))


def test_directed_streams_keep_refcounts_flat_and_their_slots_are_reused() -> None:
    """4,000 streams directed, streamed (through C and Python), ended and undirected, some
    reset or left directed until the codec is dropped: the objects handed to C keep their
    refcounts and a dropped codec lets go of what it held."""
    import gc
    import sys
    import weakref

    peer = Peer("native")
    codec: Any = peer.codec
    peer.pump()
    s = Stream("strip")
    held = [s.client, s.client.write, s.sse, s.exchange, s.attempt]
    event = CHUNK % (b"t", NULL)

    def one(i: int) -> None:
        sid = codec.send_request(b"POST", b"/v1/chat/completions", [], b"{}")
        peer.up()
        peer.server.send_headers(sid, [(b":status", b"200"), *SSE])
        codec.receive_answers(peer.server.data_to_send())
        assert codec.direct(sid, s.client, s.client.write, s.sse, s.exchange, s.attempt, True)
        assert not codec.direct(sid, s.client, s.client.write, s.sse, s.exchange, s.attempt,
                                True)  # once per stream
        peer.server.send_data(sid, event)
        assert codec.receive_answers(peer.server.data_to_send()) == []  # C wrote it
        if i % 3 == 0:
            codec.reset_stream(sid)
        else:
            peer.server.send_data(sid, b"data: [DONE]\n\n", end_stream=True)
            (data,) = codec.receive_answers(peer.server.data_to_send())
            assert data[0] == DATA and data[4]
        codec.undirect(sid)
        s.client.written.clear()
        s.sse.pending = b""  # type: ignore[union-attr]
        peer.server.receive_data(codec.data_to_send())
        peer.server.data_to_send()

    for i in range(500):
        one(i)
    before = [sys.getrefcount(o) for o in held]
    for i in range(4_000):
        one(i)
    assert [sys.getrefcount(o) for o in held] == before
    # A stream left directed is let go with the codec.
    sid = codec.send_request(b"POST", b"/v1/chat/completions", [], b"{}")
    probe = Holder()
    assert codec.direct(sid, s.client, s.client.write, s.sse, s.exchange, probe, True)
    gone = weakref.ref(probe)
    del probe
    codec = peer.codec = None  # type: ignore[assignment]
    gc.collect()
    assert gone() is None
    assert [sys.getrefcount(o) for o in held] == before

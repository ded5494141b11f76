"""Test helper: a real HTTP/2 server (python-hyper `h2`, server side) wired in memory to a codec.

No sockets: bytes the codec queues go into the server's `receive_data`, and the server's
`data_to_send()` goes into the codec's `receive_data`, optionally cut into chunks by a splitter so
tests can exercise arbitrary frame boundaries. Also raw-frame builders for what `h2` cannot send
and a frame parser for asserting on what a codec wrote.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import DataReceived, Event
from h2.settings import SettingCodes, Settings
from hyperframe.frame import Frame

from velox.egress.codec import DATA, Codec
from velox.egress.framer import Framer
from velox_lab.codecs import make_codec

# The native codec and its Python twin (VELOX_NATIVE=0). The h2 library is the peer here, and
# the reference the fuzz compares with (test_codec_fuzz.py); its client codec and jh2's are
# measured in benches/bench_codec.py.
CODECS = ("native", "framer")
# The codecs with the framer's policy: stream-level violations reset only the stream (the
# native codec is a port of the framer, so it behaves the same everywhere).
FRAMER_LIKE = ("framer", "native")
# Plus the framer on its pure-Python HPACK decoder, for the tests that stress header decoding.
DECODER_VARIANTS = (*CODECS, "framer-pyhpack")
AUTHORITY = b"api.example.com"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

Splitter = Callable[[bytes], Iterable[bytes]]


def new_codec(name: str) -> Codec:
    if name == "framer-pyhpack":
        return Framer(AUTHORITY, b"https", compiled_hpack=False)
    return make_codec(name, AUTHORITY, b"https")


def whole(data: bytes) -> Iterator[bytes]:
    if data:
        yield data


def cycling_splitter(sizes: list[int]) -> Splitter:
    """Cut every byte string into chunks whose sizes cycle through `sizes`."""

    def split(data: bytes) -> Iterator[bytes]:
        pos, i = 0, 0
        while pos < len(data):
            size = sizes[i % len(sizes)]
            yield data[pos : pos + size]
            pos += size
            i += 1

    return split


def server_settings(**values: int) -> dict[int, int]:
    """h2's own server defaults with some values overridden (by SettingCodes name)."""
    settings = {SettingCodes.MAX_CONCURRENT_STREAMS: 100, SettingCodes.MAX_HEADER_LIST_SIZE: 65536}
    settings.update({SettingCodes[name]: value for name, value in values.items()})
    return settings


class Peer:
    """One codec talking to one in-memory `h2` server."""

    def __init__(
        self,
        codec: str,
        settings: dict[int, int] | None = None,
        *,
        server_acks: bool = True,
        split_down: Splitter = whole,
        split_up: Splitter = whole,
    ) -> None:
        self.codec = new_codec(codec)
        self.server = H2Connection(H2Configuration(client_side=False, header_encoding=None))
        if settings is not None:
            self.server.local_settings = Settings(client=False, initial_values=settings)
        self.server_acks = server_acks  # the server credits request bodies as it reads them
        self.split_down = split_down
        self.split_up = split_up
        self.events: list[tuple] = []  # every codec event so far
        self.server_events: list[Event] = []
        self.server_wire = bytearray()  # every byte the server sent, handshake included
        self.client_wire = bytearray()
        self.server.initiate_connection()
        self.codec.initiate()

    def up(self) -> list[Event]:
        """Deliver what the codec queued to the server; return the server's events."""
        return self._up(self.codec.data_to_send())

    def down(self, extra: bytes = b"", *, client_acks: bool = False) -> list[tuple]:
        """Deliver what the server queued (plus `extra` raw bytes) to the codec."""
        return self._down(self.server.data_to_send() + extra, client_acks)

    def pump(self, *, client_acks: bool = False, rounds: int = 10_000) -> list[tuple]:
        """Shuttle bytes both ways until neither side has anything to say; return codec events."""
        new: list[tuple] = []
        for _ in range(rounds):
            up = self.codec.data_to_send()
            self._up(up)
            down = self.server.data_to_send()
            new.extend(self._down(down, client_acks))
            if not up and not down:
                return new
        raise AssertionError("the conversation did not settle")

    def _up(self, data: bytes) -> list[Event]:
        self.client_wire += data
        events: list[Event] = []
        for chunk in self.split_up(data):
            events.extend(self.server.receive_data(chunk))
        if self.server_acks:
            for event in events:
                if isinstance(event, DataReceived) and event.flow_controlled_length:
                    self.server.acknowledge_received_data(
                        event.flow_controlled_length, event.stream_id
                    )
        self.server_events.extend(events)
        return events

    def _down(self, data: bytes, client_acks: bool) -> list[tuple]:
        self.server_wire += data
        events: list[tuple] = []
        for chunk in self.split_down(data):
            events.extend(self.codec.receive_data(chunk))
        if client_acks:
            for event in events:
                if event[0] == DATA:
                    self.codec.acknowledge(event[1], event[3])
        self.events.extend(events)
        return events

    def respond(
        self,
        sid: int,
        status: int = 200,
        headers: list[tuple[bytes, bytes]] | None = None,
        body: bytes = b"",
        trailers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        """Queue a complete small response on the server (body must fit the windows)."""
        fields = [(b":status", str(status).encode()), *(headers or [])]
        self.server.send_headers(sid, fields, end_stream=not body and not trailers)
        step = self.server.max_outbound_frame_size
        for off in range(0, len(body), step):
            last = off + step >= len(body) and not trailers
            self.server.send_data(sid, body[off : off + step], end_stream=last)
        if trailers:
            self.server.send_headers(sid, trailers, end_stream=True)


def raw_frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    """Any frame, including ones no well-behaved library would build."""
    n = len(payload)
    return struct.pack(">BHBBL", n >> 16, n & 0xFFFF, ftype, flags, sid) + payload


def parse_frames(data: bytes) -> list[Frame]:
    """Split bytes a client wrote into hyperframe frames (the client preface is skipped)."""
    if data.startswith(PREFACE):
        data = data[len(PREFACE) :]
    frames = []
    pos = 0
    while pos < len(data):
        frame, length = Frame.parse_frame_header(memoryview(data[pos : pos + 9]))
        frame.parse_body(memoryview(data[pos + 9 : pos + 9 + length]))
        frames.append(frame)
        pos += 9 + length
    return frames

"""What an upstream read costs in Python besides its events: the TLS object uvloop drives and
the flush after the events.

`DirectSSLObject` (velox.egress.pool) is the standard `ssl.SSLObject` with read, write and
pending bound to the C object underneath: a handshake and traffic both ways over memory BIOs
must give the same results and the same exceptions as the standard class, call for call.
`H2Client.has_output` must say exactly whether `data_to_send` has something to return, so a
read that queued nothing skips the connection's flush and one that queued frames (a
WINDOW_UPDATE, a PING's ACK) still has them written.
"""

from __future__ import annotations

import ssl
import struct
from collections.abc import Callable
from typing import Any

import pytest

from velox import _native
from velox.egress.codec import CodecError
from velox.egress.pool import DirectSSLObject, ssl_context
from velox_lab.mock.certs import ensure_certs
from velox_lab.pipeline import CHAT_BODY, FakeTransport, Pipeline, reply_frames

AUTHORITY = b"api.example.com"


@pytest.fixture(scope="module")
def contexts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ssl.SSLContext]:
    certs = ensure_certs(tmp_path_factory.mktemp("certs"))
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(certs.cert_file, certs.key_file)
    server.set_alpn_protocols(["h2"])
    return certs, server


def _pair(client_ctx: ssl.SSLContext, server_ctx: ssl.SSLContext,
          hostname: str) -> tuple[ssl.SSLObject, ssl.SSLObject, Callable[[], None]]:
    """A client and a server TLS object joined by memory BIOs, handshake done; `pump` moves
    what each wrote to the other."""
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=hostname)
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)

    def pump() -> None:
        s_in.write(c_out.read())
        c_in.write(s_out.read())

    for _ in range(10):
        for side in (client, server):
            try:
                side.do_handshake()
            except ssl.SSLWantReadError:
                pass
        pump()
    assert client.version() == "TLSv1.3" and server.version() == "TLSv1.3"
    return client, server, pump


def _script(client: ssl.SSLObject, server: ssl.SSLObject, pump: Callable[[], None]) -> list[Any]:
    """The calls uvloop's SSL layer makes, and what each gave (results or exception types)."""
    seen: list[Any] = []

    def call(fn: Callable[..., Any], *args: Any) -> None:
        try:
            seen.append(fn(*args))
        except ssl.SSLError as exc:
            seen.append(type(exc))

    buf = bytearray(64)
    call(client.read, 64, memoryview(buf))  # nothing yet (the session tickets are not data)
    server.write(b"x" * 100)
    pump()
    call(client.pending)
    call(client.read, 64, memoryview(buf))
    seen.append(bytes(buf))
    call(client.pending)
    call(client.read, 1024)  # the rest, as bytes (uvloop's copying read)
    call(client.read, 1024)
    call(client.write, b"y" * 3000)
    call(client.write, memoryview(b"z" * 10))
    pump()
    call(server.read, 4096)
    call(server.read, 4096)
    return seen


def test_direct_ssl_object_behaves_as_the_standard_one(
        contexts: tuple[Any, ssl.SSLContext]) -> None:
    certs, server_ctx = contexts
    direct_ctx = ssl_context([certs.ca_file], ["h2"])
    standard_ctx = ssl_context([certs.ca_file], ["h2"])
    standard_ctx.sslobject_class = ssl.SSLObject
    direct = _pair(direct_ctx, server_ctx, "localhost")
    standard = _pair(standard_ctx, server_ctx, "localhost")
    assert type(direct[0]) is DirectSSLObject and type(standard[0]) is ssl.SSLObject
    # uvloop takes these three once per connection and calls them per read and write: they
    # are the C object's own methods, no Python frame in between.
    for name in ("read", "write", "pending"):
        assert type(getattr(direct[0], name)).__name__ == "builtin_function_or_method"
    assert direct[0].selected_alpn_protocol() == "h2"
    got, want = _script(*direct), _script(*standard)
    assert got == want
    assert ssl.SSLWantReadError in got and b"x" * 64 in got


def test_direct_ssl_object_verifies_the_upstream(contexts: tuple[Any, ssl.SSLContext]) -> None:
    """The certificate check is the standard object's: a wrong host name still fails."""
    certs, server_ctx = contexts
    with pytest.raises(ssl.SSLCertVerificationError):
        _pair(ssl_context([certs.ca_file], ["h2"]), server_ctx, "wrong.example")


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

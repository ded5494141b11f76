"""HTTP/2 details checked with the `h2` library over a plain socket (h2c, prior knowledge)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import pytest

from velox_lab.mock import MockUpstream

CHAT = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
STREAM_CHAT = json.dumps({"model": "gpt-4o", "stream": True,
                          "messages": [{"role": "user", "content": "hi"}]})


class Client:
    """A blocking h2 client that records every event; `auto_ack` credits data as read."""

    def __init__(self, port: int, settings: dict | None = None, auto_ack: bool = True) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        if settings:
            self.conn.update_settings(settings)
        self.auto_ack = auto_ack
        self.events: list = []
        self.frames: list[tuple[int, int, int, bytes]] = []  # (type, flags, sid, payload)
        self._raw = b""
        self.h2_gave_up = False  # h2 rejects every frame after a GOAWAY; raw frames go on
        self.closed = False
        self.flush()

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def request(self, path: str, body: str | bytes | None = None, headers: dict | None = None,
                method: str | None = None, **kw) -> int:
        sid = self.conn.get_next_available_stream_id()
        hdrs = [(":method", method or ("POST" if body is not None else "GET")),
                (":path", path), (":scheme", "http"), (":authority", "mock"),
                *((headers or {}).items())]
        self.conn.send_headers(sid, hdrs, end_stream=body is None, **kw)
        if body is not None:
            self.conn.send_data(sid, body.encode() if isinstance(body, str) else body,
                                end_stream=True)
        self.flush()
        return sid

    def pump(self, until, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while not until():
            left = deadline - time.monotonic()
            if left <= 0 or self.closed:
                return until()
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return until()
            if not data:
                self.closed = True
                continue
            self._split(data)
            if self.h2_gave_up:
                continue
            try:
                events = self.conn.receive_data(data)
            except h2.exceptions.ProtocolError:
                self.h2_gave_up = True
                continue
            for ev in events:
                self.events.append(ev)
                if self.auto_ack and isinstance(ev, h2.events.DataReceived):
                    self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            self.flush()
        return True

    def _split(self, data: bytes) -> None:
        buf = self._raw + data
        while len(buf) >= 9:
            length = int.from_bytes(buf[:3], "big")
            if len(buf) < 9 + length:
                break
            sid = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
            self.frames.append((buf[3], buf[4], sid, buf[9:9 + length]))
            buf = buf[9 + length:]
        self._raw = buf

    def of(self, sid: int, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind) and
                getattr(e, "stream_id", None) == sid]

    def ended(self, sid: int) -> bool:
        return bool(self.of(sid, h2.events.StreamEnded) or self.of(sid, h2.events.StreamReset))

    def body(self, sid: int) -> bytes:
        return b"".join(e.data for e in self.of(sid, h2.events.DataReceived))

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def mock(tmp_path_factory):
    log = tmp_path_factory.mktemp("mock") / "stderr.log"
    with MockUpstream(tls=False, max_concurrent_streams=50, log_path=str(log)) as m:
        yield m
    assert "Traceback" not in m.log_text(), m.log_text()  # no callback blew up in the mock


@pytest.fixture
def client(mock):
    mock.reset()
    c = Client(mock.port)
    yield c
    c.close()


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_settings_ping_and_basic_request(client):
    sid = client.request("/v1/chat/completions", CHAT)
    client.conn.ping(b"12345678")
    client.flush()
    assert client.pump(lambda: client.ended(sid)
                       and any(isinstance(e, h2.events.PingAckReceived) for e in client.events))
    changed = next(e for e in client.events if isinstance(e, h2.events.RemoteSettingsChanged))
    assert changed.changed_settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS].new_value \
        == 50
    ping = next(e for e in client.events if isinstance(e, h2.events.PingAckReceived))
    assert ping.ping_data == b"12345678"
    [resp] = client.of(sid, h2.events.ResponseReceived)
    assert dict(resp.headers)[":status"] == "200"
    assert json.loads(client.body(sid))["object"] == "chat.completion"


def test_continuation_padding_and_priority(client, mock):
    big = "v" * 40000  # > 16 KiB: h2 sends HEADERS + CONTINUATION frames
    sid = client.request("/v1/chat/completions", None, headers={"x-big": big}, method="GET")
    sid2 = client.conn.get_next_available_stream_id()
    client.conn.send_headers(sid2, [(":method", "POST"), (":path", "/v1/embeddings"),
                                    (":scheme", "http"), (":authority", "mock")],
                             priority_weight=200, priority_depends_on=0)
    client.conn.prioritize(sid2, weight=16)  # a standalone PRIORITY frame
    client.conn.send_data(sid2, b'{"model": "m", "input": "abc"}', pad_length=20,
                          end_stream=True)
    client.flush()
    assert client.pump(lambda: client.ended(sid) and client.ended(sid2))
    assert dict(client.of(sid, h2.events.ResponseReceived)[0].headers)[":status"] == "404"
    assert json.loads(client.body(sid2))["data"][0]["object"] == "embedding"
    entries = mock.requests()
    assert dict(entries[0]["headers"])["x-big"] == big
    assert entries[1]["body_length"] == 30  # padding stripped


def test_client_reset_counts_cancel(client, mock):
    sid = client.request("/v1/chat/completions", CHAT, headers={"x-mock-latency-ms": "3000"})
    assert wait_for(lambda: mock.stats()["requests"] == 1)
    client.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
    client.flush()
    assert wait_for(lambda: mock.stats()["streams_cancelled"] == 1)
    # The connection is still fine, and the cancelled stream never gets an answer.
    sid2 = client.request("/v1/models")
    assert client.pump(lambda: client.ended(sid2))
    assert not client.of(sid, h2.events.ResponseReceived)
    assert mock.requests()[0]["cancelled"] is True


def test_reset_fault_and_reset_mid_stream(client):
    sid = client.request("/v1/chat/completions", CHAT, headers={"x-mock-fault": "reset"})
    sid2 = client.request("/v1/chat/completions", STREAM_CHAT,
                          headers={"x-mock-fault": "reset-mid-stream", "x-mock-chunks": "6"})
    assert client.pump(lambda: client.ended(sid) and client.ended(sid2))
    [reset] = client.of(sid, h2.events.StreamReset)
    assert reset.error_code == h2.errors.ErrorCodes.INTERNAL_ERROR
    assert not client.of(sid, h2.events.ResponseReceived)
    assert client.of(sid2, h2.events.ResponseReceived)
    assert len(client.of(sid2, h2.events.DataReceived)) == 2
    assert client.of(sid2, h2.events.StreamReset)


def test_goaway_fault_spares_earlier_streams(client, mock):
    first = client.request("/v1/models", headers={"x-mock-latency-ms": "150"})
    doomed = client.request("/v1/chat/completions", CHAT, headers={"x-mock-fault": "goaway"})
    assert client.pump(lambda: client.closed, timeout=5)
    types = [(f[0], f[2]) for f in client.frames]
    goaways = [f for f in client.frames if f[0] == 7]
    assert len(goaways) == 1
    last_sid = int.from_bytes(goaways[0][3][:4], "big")
    code = int.from_bytes(goaways[0][3][4:8], "big")
    assert last_sid == first and code == 0 and doomed > first
    # `first` is still answered after the GOAWAY; `doomed` never is.
    after = types[types.index((7, 0)) + 1:]
    assert (1, first) in after and (0, first) in after
    assert all(sid != doomed for _, sid in types)
    stats = mock.stats()
    assert stats["goaways_sent"] == 1 and stats["streams_completed"] == 1
    assert stats["open_connections"] == 0


def test_goaway_after_two_streams():
    with MockUpstream(tls=False, goaway_after=2) as m:
        c = Client(m.port)
        for _ in range(2):
            sid = c.request("/v1/models")
            assert c.pump(lambda: c.ended(sid))
            assert dict(c.of(sid, h2.events.ResponseReceived)[0].headers)[":status"] == "200"
        third = c.request("/v1/models")
        assert c.pump(lambda: any(isinstance(e, h2.events.ConnectionTerminated)
                                  for e in c.events))
        goaway = next(e for e in c.events if isinstance(e, h2.events.ConnectionTerminated))
        assert goaway.last_stream_id == third - 2  # the third stream was not processed
        assert c.pump(lambda: c.closed, timeout=3)
        stats = m.stats()
        assert stats["requests"] == 2 and stats["goaways_sent"] == 1
        c.close()
        # A new connection gets two more streams.
        c2 = Client(m.port)
        sid = c2.request("/v1/models")
        assert c2.pump(lambda: c2.ended(sid))
        c2.close()


def test_excess_streams_are_refused():
    with MockUpstream(tls=False, max_concurrent_streams=2) as m:
        c = Client(m.port)
        # Sent before the server's SETTINGS arrive, so the client cannot know the limit yet.
        sids = [c.request("/v1/models", headers={"x-mock-latency-ms": "200"}) for _ in range(3)]
        assert c.pump(lambda: all(c.ended(s) for s in sids))
        assert c.of(sids[0], h2.events.StreamEnded) and c.of(sids[1], h2.events.StreamEnded)
        [reset] = c.of(sids[2], h2.events.StreamReset)
        assert reset.error_code == h2.errors.ErrorCodes.REFUSED_STREAM
        assert m.stats()["streams_refused"] == 1
        c.close()


def test_flow_control_and_frame_size_are_respected(mock):
    mock.reset()
    c = Client(mock.port, settings={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1000},
               auto_ack=False)
    sid = c.request("/v1/chat/completions", STREAM_CHAT, headers={"x-mock-chunks": "60"})
    time.sleep(0.3)
    c.pump(lambda: False, timeout=0.3)  # h2 raises FlowControlError on any overrun
    assert 0 < len(c.body(sid)) <= 1000 and not c.ended(sid)
    c.auto_ack = True
    for e in c.of(sid, h2.events.DataReceived):
        c.conn.acknowledge_received_data(e.flow_controlled_length, sid)
    c.flush()
    assert c.pump(lambda: c.ended(sid))
    assert c.body(sid).endswith(b"data: [DONE]\n\n") and len(c.body(sid)) > 10_000
    # A body larger than the 16 KiB default frame size arrives in several DATA frames.
    big = c.request("/v1/embeddings", json.dumps({"model": "m", "input": "x",
                                                  "dimensions": 4096, "encoding_format": "float"}))
    assert c.pump(lambda: c.ended(big))
    assert len(c.of(big, h2.events.DataReceived)) >= 3
    assert len(json.loads(c.body(big))["data"][0]["embedding"]) == 4096
    c.close()


def test_client_goaway_lets_inflight_stream_finish(client, mock):
    sid = client.request("/v1/models", headers={"x-mock-latency-ms": "100"})
    client.conn.close_connection(last_stream_id=0)
    client.flush()
    assert client.pump(lambda: client.closed, timeout=3)
    assert mock.stats()["streams_completed"] == 1
    assert not client.of(sid, h2.events.StreamReset)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_curl_h2c_prior_knowledge(mock):
    out = subprocess.run(["curl", "-sS", "--http2-prior-knowledge", "-w", "\n%{http_version}",
                          mock.origin + "/v1/models"], capture_output=True, text=True,
                         timeout=10, check=False)
    body, _, version = out.stdout.rpartition("\n")
    assert version == "2", out.stderr
    assert json.loads(body)["object"] == "list"

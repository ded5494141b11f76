"""The mock upstream over HTTP/1.1: cleartext and TLS with ALPN http/1.1 only."""

from __future__ import annotations

import json
import socket
import ssl
import time

import httpx
import pytest

from velox_lab.mock import MockUpstream

CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    log = tmp_path_factory.mktemp("mock") / "stderr.log"
    with MockUpstream(tls=False, log_path=str(log)) as m:
        yield m
    assert "Traceback" not in m.log_text(), m.log_text()  # no callback blew up in the mock


@pytest.fixture
def fresh(plain):
    plain.reset()
    return plain


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def read_response(sock: socket.socket, buf: bytes = b"") -> tuple[bytes, bytes, bytes]:
    """(head, body, rest) of one Content-Length response read from a raw socket."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, "connection closed early"
        buf += chunk
    head, _, buf = buf.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:")))
    while len(buf) < length:
        buf += sock.recv(65536)
    return head, buf[:length], buf[length:]


def test_keep_alive_and_hop_by_hop_header(fresh):
    assert fresh.origin.startswith("http://") and fresh.ca_file is None
    with httpx.Client(base_url=fresh.origin, timeout=10) as c:
        a = c.post("/v1/chat/completions", json=CHAT)
        b = c.get("/v1/models")
        c404 = c.get("/v1/unknown")
    assert a.http_version == "HTTP/1.1" and a.status_code == 200
    assert a.json()["object"] == "chat.completion"
    assert a.headers["connection"] == "keep-alive"
    assert b.status_code == 200 and c404.status_code == 404
    stats = fresh.stats()
    assert stats["connections"] == 1 and stats["h1_requests"] == 3 and stats["requests"] == 3


def test_streaming_uses_chunked_encoding(fresh):
    with httpx.Client(base_url=fresh.origin, timeout=10) as c:
        with c.stream("POST", "/v1/completions", json={**CHAT, "prompt": "x", "stream": True},
                      headers={"x-mock-chunks": "3"}) as r:
            assert r.headers["transfer-encoding"] == "chunked"
            lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert len(events) == 3 and all(e["object"] == "text_completion" for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_chunked_request_body_with_expect_continue(fresh):
    body = json.dumps(CHAT).encode()
    with socket.create_connection(("127.0.0.1", fresh.port), timeout=5) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                  b"content-type: application/json\r\ntransfer-encoding: chunked\r\n"
                  b"expect: 100-continue\r\n\r\n")
        interim = s.recv(1024)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        half = len(body) // 2
        s.sendall(b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (half, body[:half], len(body) - half,
                                                             body[half:]))
        head, payload, _ = read_response(s)
    assert head.startswith(b"HTTP/1.1 200 OK")
    assert json.loads(payload)["object"] == "chat.completion"
    [entry] = fresh.requests()
    assert entry["body_length"] == len(body) and entry["protocol"] == "http/1.1"


def test_pipelined_requests_answer_in_order(fresh):
    req = (b"GET /v1/models/%s HTTP/1.1\r\nhost: x\r\nx-mock-latency-ms: %d\r\n\r\n")
    with socket.create_connection(("127.0.0.1", fresh.port), timeout=5) as s:
        # The first answer is the slowest: order must still be preserved.
        s.sendall(req % (b"first", 50) + req % (b"second", 0) + req % (b"third", 10))
        rest = b""
        ids = []
        for _ in range(3):
            _, payload, rest = read_response(s, rest)
            ids.append(json.loads(payload)["id"])
    assert ids == ["first", "second", "third"]


def test_malformed_request_gets_400_and_close(fresh):
    with socket.create_connection(("127.0.0.1", fresh.port), timeout=5) as s:
        s.sendall(b"NOT AN HTTP REQUEST\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    assert data.startswith(b"HTTP/1.1 400")
    assert b"connection: close" in data


def test_upgrade_is_declined_and_connect_refused(fresh):
    body = json.dumps(CHAT).encode()
    with socket.create_connection(("127.0.0.1", fresh.port), timeout=5) as s:
        # What `curl --http2` sends on cleartext: an h2c upgrade offer with a body.
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                  b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\n"
                  b"http2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
                  b"content-length: %d\r\n\r\n%s" % (len(body), body)
                  + b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        head, payload, rest = read_response(s)
        assert head.startswith(b"HTTP/1.1 200") and b"upgrade" not in head.lower()
        assert json.loads(payload)["object"] == "chat.completion"
        head, payload, _ = read_response(s, rest)
        assert json.loads(payload)["object"] == "list"
    with socket.create_connection(("127.0.0.1", fresh.port), timeout=5) as s:
        s.sendall(b"CONNECT example.com:443 HTTP/1.1\r\nhost: example.com:443\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    assert data.startswith(b"HTTP/1.1 400")
    assert fresh.requests()[0]["body_length"] == len(body)


def test_client_disconnect_mid_stream_counts_cancel(fresh):
    with httpx.Client(base_url=fresh.origin, timeout=10) as c:
        with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True},
                      headers={"x-mock-chunks": "50", "x-mock-chunk-delay-ms": "20"}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
    assert wait_for(lambda: fresh.stats()["streams_cancelled"] == 1)
    [entry] = fresh.requests()
    assert entry["stream"] is True and entry["cancelled"] is True


def test_h1_faults(fresh):
    with httpx.Client(base_url=fresh.origin, timeout=httpx.Timeout(10, read=0.5)) as c:
        for fault in ("close", "reset", "goaway"):
            with pytest.raises(httpx.RemoteProtocolError):
                c.post("/v1/chat/completions", json=CHAT, headers={"x-mock-fault": fault})
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/chat/completions", json=CHAT, headers={"x-mock-fault": "hang"})
        with pytest.raises(httpx.RemoteProtocolError):
            with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True},
                          headers={"x-mock-fault": "reset-mid-stream"}) as r:
                for _ in r.iter_lines():
                    pass
        ok = c.post("/v1/chat/completions", json=CHAT,
                    headers={"x-mock-fault": "slow-body", "x-mock-chunk-delay-ms": "2"})
        assert ok.status_code == 200 and ok.json()["object"] == "chat.completion"
    assert wait_for(lambda: fresh.stats()["streams_cancelled"] == 1)  # only the hang
    assert fresh.stats()["faults_injected"] == 6


def test_tls_with_alpn_http11_only():
    with MockUpstream(alpn="http/1.1") as m:
        ctx = ssl.create_default_context(cafile=m.ca_file)
        with httpx.Client(http2=True, verify=ctx, base_url=m.origin, timeout=10) as c:
            r = c.post("/v1/chat/completions", json=CHAT)
        assert r.http_version == "HTTP/1.1" and r.status_code == 200
        assert r.headers["connection"] == "keep-alive"
        # Without ALPN, a TLS client sending the h2 preface is not served h2 either.
        raw = socket.create_connection(("127.0.0.1", m.port), timeout=5)
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            assert s.recv(64).startswith(b"HTTP/1.1 400")
        assert m.stats()["h1_requests"] == 1

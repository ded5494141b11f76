"""Clients that stop reading their answer, end to end: real Velox processes, the bundled mock
upstream over HTTP/2 + TLS, raw sockets that send a request and then read nothing (their
receive buffer made small before connecting, so the kernel holds little for them), and the
worker's memory read with psutil.

What is checked: an answer is written as the client takes it, from one copy shared by every
client it goes to (a cached answer, a coalesced one), so clients that never read hold no
copy of it each; a client whose writes stay blocked for VELOX_WRITE_TIMEOUT_MS is aborted,
whoever answered it (cache, coalescing, relay); a streaming follower that falls behind the
live stream it shares is cut off while the leader's client gets every event."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.e2e.conftest import CLIENT_KEY, wait_for
from tests.e2e.test_cache import gateways, mock, start, stats, upstream, waiting  # noqa: F401
from tests.e2e.test_hardening_ingress import metric
from velox_lab.launch import GatewayProcess
from velox_lab.mock import MockUpstream

# An embeddings answer of about 6.5 MB (450 vectors of 1536 numbers), as in the report.
LARGE = {"model": "text-embedding-3-small", "input": [f"item {i}" for i in range(450)],
         "dimensions": 1536}
# Far more than the kernel takes for a client whose receive window is a few KiB, so what
# such a client is not taking stays in the worker.
CLIENTS = 48
# Growth allowed to the worker while CLIENTS clients leave their answers untaken. Without
# backpressure each holds its own copy (48 x 6.5 MB, ~300 MiB); with it, about a transport
# buffer each (48 x ~0.3 MiB) and one shared copy.
GROWTH_BOUND = 64 << 20
DEADLINE_MS = "2000"
# How long the leader's upstream call takes: the followers attach meanwhile.
LEADER_LATENCY_MS = "3000"
pause = threading.Event()  # never set: its wait() is a sleep that names what it is for


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()


def request_bytes(path: str, body: dict[str, Any], headers: str = "") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {CLIENT_KEY}\r\n"
            f"content-type: application/json\r\n{headers}content-length: {len(data)}\r\n\r\n"
            ).encode() + data


def not_reading(gw: GatewayProcess, data: bytes, opened: list[socket.socket]) -> socket.socket:
    """A client that sends its request and reads nothing (4 KiB receive buffer)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((gw.host, gw.port))
    sock.sendall(data)
    opened.append(sock)
    return sock


def read_all(sock: socket.socket, timeout: float = 60) -> tuple[bytes, bool]:
    """Everything the socket still delivers, and whether it was reset rather than closed."""
    sock.settimeout(timeout)
    got = bytearray()
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except ConnectionResetError:
            return bytes(got), True
        if not chunk:
            return bytes(got), False
        got += chunk


def worker(gw: GatewayProcess) -> psutil.Process:
    (entry,) = json.loads(gw.admin_get("/stats")[1])["workers"]
    return psutil.Process(entry["pid"])


def connected(proc: psutil.Process, port: int) -> bool:
    """The worker still holds a connection from this client port."""
    return any(c.raddr and c.raddr.port == port for c in proc.net_connections())


def metrics_text(gw: GatewayProcess) -> list[str]:
    return httpx.get(f"{gw.admin_url}/metrics", timeout=10).text.splitlines()


def doc(gw: GatewayProcess) -> dict[str, Any]:
    return json.loads(gw.admin_get("/stats")[1])  # type: ignore[no-any-return]


def write_timeouts(gw: GatewayProcess) -> int:
    return int(doc(gw)["requests"]["write_timeouts"])


def assert_cut_short(socks: list[socket.socket], whole: int) -> None:
    """Each client's connection ended (reset or closed) before it got its whole answer."""
    for sock in socks:
        got, _ = read_all(sock)
        assert got.startswith(b"HTTP/1.1 200 OK") and len(got) < whole


def test_clients_that_do_not_read_a_large_cached_answer_share_one_copy_and_are_cut_at_the_deadline(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path,
        sockets: list[socket.socket]) -> None:
    gw = start(gateways, upstream, tmp_path, VELOX_WORKERS="1",
               VELOX_WRITE_TIMEOUT_MS=DEADLINE_MS, VELOX_KEEPALIVE_TIMEOUT_S="1")
    with httpx.Client(base_url=gw.base_url, timeout=60,
                      headers={"authorization": f"Bearer {CLIENT_KEY}"}) as http:
        first = http.post("/v1/embeddings", json=LARGE)
        second = http.post("/v1/embeddings", json=LARGE)  # a reading client gets it whole
    assert first.headers["x-velox-cache"] == "miss" and second.headers["x-velox-cache"] == "hit"
    assert second.content == first.content and len(first.content) > 6_000_000
    proc = worker(gw)
    before = proc.memory_info().rss
    data = request_bytes("/v1/embeddings", LARGE)
    socks = [not_reading(gw, data, sockets) for _ in range(CLIENTS)]
    wait_for(lambda: stats(gw)["hits"] == 1 + CLIENTS, timeout=60)
    grown = proc.memory_info().rss - before
    assert grown < GROWTH_BOUND, f"worker grew {grown >> 20} MiB for {CLIENTS} idle clients"
    # Past the deadline (and the keep-alive timeout, which closes nothing with bytes to send),
    # every one of them is aborted and what it held is let go.
    wait_for(lambda: write_timeouts(gw) == CLIENTS, timeout=60)
    assert proc.memory_info().rss - before < GROWTH_BOUND
    assert_cut_short(socks, len(first.content))


def test_a_client_reading_slowly_is_paced_and_never_cut(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path,
        sockets: list[socket.socket]) -> None:
    # A reader that takes 256 KiB every 50 ms makes progress hundreds of times within the
    # deadline; the deadline is longer here than in the tests that wait for it to fire, so a
    # test process descheduled for a second on a loaded host is not mistaken for a stalled one.
    gw = start(gateways, upstream, tmp_path, VELOX_WORKERS="1", VELOX_WRITE_TIMEOUT_MS="15000")
    with httpx.Client(base_url=gw.base_url, timeout=60,
                      headers={"authorization": f"Bearer {CLIENT_KEY}"}) as http:
        first = http.post("/v1/embeddings", json=LARGE)
    slow = socket.create_connection((gw.host, gw.port))
    sockets.append(slow)
    slow.sendall(request_bytes("/v1/embeddings", LARGE))
    slow.settimeout(30)
    got = bytearray()
    whole = len(first.content)
    while b"\r\n\r\n" not in got or len(got.partition(b"\r\n\r\n")[2]) < whole:
        chunk = slow.recv(256 * 1024)
        assert chunk, "the slow reader was cut"
        got += chunk
        pause.wait(0.05)
    head, _, body = got.partition(b"\r\n\r\n")
    assert b"x-velox-cache: hit" in head.lower()
    assert body == first.content
    assert write_timeouts(gw) == 0


def test_coalesced_followers_that_do_not_read_share_the_answer_and_are_cut_at_the_deadline(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path,
        sockets: list[socket.socket]) -> None:
    gw = start(gateways, upstream, tmp_path, VELOX_WORKERS="1",
               VELOX_WRITE_TIMEOUT_MS=DEADLINE_MS)
    proc = worker(gw)
    with httpx.Client(base_url=gw.base_url, timeout=60,
                      headers={"authorization": f"Bearer {CLIENT_KEY}"}) as http:
        # Warm every path this test takes with an answer that is not stored.
        warm = http.post("/v1/embeddings", json=LARGE, headers={"cache-control": "no-store"})
        assert warm.status_code == 200
        before = proc.memory_info().rss
        leader: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: leader.append(http.post(
            "/v1/embeddings", json=LARGE, headers={"x-mock-latency-ms": LEADER_LATENCY_MS})))
        thread.start()
        try:
            wait_for(lambda: upstream.stats()["by_path"].get("/v1/embeddings", 0) == 2,
                     timeout=30)  # the leader's call is upstream
            data = request_bytes("/v1/embeddings", LARGE)
            socks = [not_reading(gw, data, sockets) for _ in range(CLIENTS)]
            wait_for(lambda: waiting(gw) == CLIENTS, timeout=30)
        finally:
            thread.join(60)
    assert leader[0].status_code == 200 and leader[0].headers["x-velox-cache"] == "miss"
    wait_for(lambda: stats(gw)["coalesced"] == CLIENTS, timeout=60)
    grown = proc.memory_info().rss - before
    assert grown < GROWTH_BOUND, f"worker grew {grown >> 20} MiB for {CLIENTS} idle followers"
    wait_for(lambda: write_timeouts(gw) == CLIENTS, timeout=60)
    assert_cut_short(socks, len(leader[0].content))
    assert upstream.stats()["by_path"]["/v1/embeddings"] == 2  # one call for all of them


def test_streaming_followers_that_fall_behind_the_live_stream_are_cut_off(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path,
        sockets: list[socket.socket]) -> None:
    gw = start(gateways, upstream, tmp_path, VELOX_WORKERS="1")
    proc = worker(gw)
    chat = {"model": "gpt-4o-mini", "stream": True,
            "messages": [{"role": "user", "content": "a long stream"}]}
    chunks = 60_000  # ~15 MB of events
    followers = 8
    with httpx.Client(base_url=gw.base_url, timeout=120,
                      headers={"authorization": f"Bearer {CLIENT_KEY}"}) as http:
        warm = http.post("/v1/chat/completions", json=chat,
                         headers={"cache-control": "no-store", "x-mock-chunks": "2000"})
        assert warm.status_code == 200
        before = proc.memory_info().rss
        events: list[bytes] = []

        def lead() -> None:
            with http.stream("POST", "/v1/chat/completions", json=chat,
                             headers={"x-mock-latency-ms": LEADER_LATENCY_MS,
                                      "x-mock-chunks": str(chunks)}) as r:
                assert r.headers["x-velox-cache"] == "miss"
                events.append(b"".join(r.iter_raw()))

        thread = threading.Thread(target=lead)
        thread.start()
        try:
            wait_for(lambda: upstream.stats()["by_path"].get("/v1/chat/completions", 0) == 2,
                     timeout=30)
            data = request_bytes("/v1/chat/completions", chat)
            socks = [not_reading(gw, data, sockets) for _ in range(followers)]
            wait_for(lambda: waiting(gw) == followers, timeout=30)
        finally:
            thread.join(120)
    # The leader's client read the whole stream at its own pace.
    (stream,) = events
    assert stream.count(b"\n\n") == chunks + 1 and stream.endswith(b"data: [DONE]\n\n")
    grown = proc.memory_info().rss - before
    assert grown < GROWTH_BOUND, f"worker grew {grown >> 20} MiB for {followers} idle followers"
    wait_for(lambda: stats(gw)["followers_cut"] == followers, timeout=30)
    assert f"velox_cache_followers_cut_total {float(followers)}" in metrics_text(gw)
    for sock in socks:
        got, _ = read_all(sock)
        assert got.startswith(b"HTTP/1.1 200 OK") and b"[DONE]" not in got
    assert upstream.stats()["by_path"]["/v1/chat/completions"] == 2


def test_a_client_that_does_not_read_a_relayed_answer_is_cut_at_the_deadline(
        upstream: MockUpstream, gateways: list[GatewayProcess], tmp_path: Path,
        sockets: list[socket.socket]) -> None:
    gw = start(gateways, upstream, tmp_path, VELOX_WORKERS="1", VELOX_CACHE="0",
               VELOX_WRITE_TIMEOUT_MS=DEADLINE_MS, VELOX_KEEPALIVE_TIMEOUT_S="1")
    proc = worker(gw)
    sock = not_reading(gw, request_bytes("/v1/embeddings", LARGE), sockets)
    port = sock.getsockname()[1]
    wait_for(lambda: connected(proc, port), timeout=10)
    # The gateway drops the connection on its own (the client still reads nothing).
    wait_for(lambda: not connected(proc, port), timeout=60)
    assert write_timeouts(gw) == 1 and metric(gw, "velox_response_write_timeouts") == 1
    got, _ = read_all(sock)
    assert got.startswith(b"HTTP/1.1 200 OK") and len(got) < 6_000_000

"""Egress hardening, black-box: a real gateway process, real sockets, a hostile upstream.

Every test here drives `python -m velox` against tests/e2e/hostile.py (or the bundled mock)
and checks only what a client, the upstream or the admin endpoints can observe, so the tests
keep validating however the egress side is structured inside.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.e2e.conftest import CLIENT_KEY, GatewayFactory
from tests.e2e.hostile import HostileUpstream, Script

_MIB = 1024 * 1024


def _wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _stream_request(action: str) -> bytes:
    body = json.dumps({"model": "m", "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"authorization: Bearer " + CLIENT_KEY.encode() + b"\r\n"
            b"content-type: application/json\r\nx-hostile: " + action.encode() + b"\r\n"
            b"content-length: %d\r\n\r\n" % len(body) + body)


def _paused_client(port: int, action: str) -> socket.socket:
    """A client that sends a streaming request and then never reads (tiny receive buffer)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    sock.sendall(_stream_request(action))
    return sock


def _hundred_requests(base_url: str) -> None:
    with httpx.Client(base_url=base_url, timeout=15,
                      headers={"authorization": f"Bearer {CLIENT_KEY}"}) as client:
        for i in range(100):
            r = client.post("/v1/chat/completions",
                            json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 200, (i, r.status_code, r.text)
            assert r.json() == {"ok": True}


@pytest.fixture
def hostile_h2c() -> Iterator[HostileUpstream]:
    with HostileUpstream() as up:
        yield up


def _one_connection(**extra: str) -> dict[str, str]:
    env = {"VELOX_WORKERS": "1", "VELOX_EGRESS_POOL_CONNECTIONS": "1", "VELOX_UPSTREAM_PROTOCOL": "h2",
           "VELOX_REQUEST_TIMEOUT_MS": "10000"}
    env.update(extra)
    return env


# --- finding 1: every way a stream ends returns the credit held for a paused client ---------

# 24 paused streams of up to 8 MiB each (our stream window) can hold far more than the 64 MiB
# connection window, whatever part of them the kernel's socket buffers absorb.
_CLIENTS = 24


@pytest.mark.parametrize("ending", ["client-gone", "upstream-reset", "completed-while-paused",
                                    "idle-deadline"])
def test_paused_streams_return_connection_credit(ending: str, start_gateway: GatewayFactory,
                                                 hostile_h2c: HostileUpstream) -> None:
    up = hostile_h2c
    extra = {"VELOX_STREAM_IDLE_TIMEOUT_MS": "1500"} if ending == "idle-deadline" else {}
    gw = start_gateway(mock=up, **_one_connection(**extra))
    action = {"upstream-reset": f"stream-reset={7 * _MIB}",
              "completed-while-paused": f"stream={7 * _MIB}"}.get(ending, f"stream={32 * _MIB}")
    clients = [_paused_client(gw.port, action) for _ in range(_CLIENTS)]
    try:
        if ending in ("upstream-reset", "completed-while-paused"):
            # 24 x 7 MiB = 168 MiB, of which the kernel's socket buffers absorb at most ~3 MiB
            # per client: only if each ended stream hands back its held credit can all of them
            # be sent through a 64 MiB connection window.
            _wait_for(lambda: up.streams_finished == _CLIENTS, 30,
                      f"all {_CLIENTS} streams to be sent (finished: {up.streams_finished}, "
                      f"send windows {up.send_windows()})")
        else:
            _wait_for(lambda: up.send_windows() == [0], 30,
                      f"the paused clients to exhaust the connection window "
                      f"({up.send_windows()})")
        if ending == "client-gone":
            for sock in clients:
                sock.close()
            clients = []
        # The connection must carry new streams again: its window was handed back.
        _hundred_requests(gw.base_url)
        assert up.connections == 1  # the same connection, not a replacement
    finally:
        for sock in clients:
            sock.close()

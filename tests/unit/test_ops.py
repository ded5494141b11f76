"""Operations hardening without a gateway: worker placement, the admin bind rule and token,
the admin read timeout (an in-process AdminServer on a real socket), the new settings."""

from __future__ import annotations

import socket
import time

import pytest

from velox.admin import server as admin_server
from velox.admin import transport
from velox.admin.server import AdminServer, bind_problem, is_loopback
from velox.admission.ratelimit import Limiter
from velox.config import settings as config
from velox.state.stats import SharedStats
from velox.system.topology import oversubscribed, plan
from velox_lab.launch import raw_request

NODES = {0: [0, 1], 1: [2, 3]}


def test_plan_pins_one_worker_per_core_node_by_node() -> None:
    assert plan(3, allowed={0, 1, 2, 3}, nodes=NODES) == [(0, 0), (1, 0), (2, 1)]
    assert plan(4, allowed={0, 1, 2, 3}, nodes=NODES) == [(0, 0), (1, 0), (2, 1), (3, 1)]


def test_plan_pins_nothing_when_oversubscribed() -> None:
    placement = plan(5, allowed={0, 1, 2, 3}, nodes=NODES)
    assert placement == [(-1, -1)] * 5
    cores = [core for core, _ in placement if core >= 0]
    assert len(cores) == len(set(cores))
    assert oversubscribed(5, allowed={0, 1, 2, 3}) == 4
    assert oversubscribed(4, allowed={0, 1, 2, 3}) == 0


def _settings(**env: str) -> config.Settings:
    return config.load({"VELOX_WORKERS": "1", **env}, dotenv=None)


@pytest.mark.parametrize("addr", ["127.0.0.1:6060", "[::1]:6060", "localhost:6060",
                                  "127.0.0.2:1", "off"])
def test_loopback_or_off_needs_no_token(addr: str) -> None:
    assert bind_problem(_settings(VELOX_ADMIN_ADDR=addr)) is None


@pytest.mark.parametrize("addr", ["0.0.0.0:6060", "[::]:6060", "10.1.2.3:6060"])
def test_other_addresses_need_a_token(addr: str) -> None:
    problem = bind_problem(_settings(VELOX_ADMIN_ADDR=addr))
    assert problem is not None and "VELOX_ADMIN_TOKEN" in problem and "127.0.0.1" in problem
    assert bind_problem(_settings(VELOX_ADMIN_ADDR=addr, VELOX_ADMIN_TOKEN="t0ken")) is None


def test_is_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("no-such-host.invalid")


def test_admin_token_setting_is_secret_and_header_safe() -> None:
    settings = _settings(VELOX_ADMIN_TOKEN="  abcdefghijkl  ")
    assert settings.admin_token == "abcdefghijkl"
    assert "abcdefghijkl" not in str(settings.redacted())
    with pytest.raises(config.ConfigError, match=r"VELOX_ADMIN_TOKEN=.*printable ASCII"):
        _settings(VELOX_ADMIN_TOKEN="two words")
    assert _settings().worker_hang_s == 10
    with pytest.raises(config.ConfigError, match="VELOX_WORKER_HANG_S"):
        _settings(VELOX_WORKER_HANG_S="-1")


def _admin(**env: str) -> AdminServer:
    settings = _settings(VELOX_ADMIN_ADDR="127.0.0.1:0", **env)
    endpoint = settings.admin_endpoint
    assert endpoint is not None
    return AdminServer(settings, SharedStats(1), Limiter.create(0, 1), endpoint)


def test_authorized_checks_the_bearer_token() -> None:
    app = _admin(VELOX_ADMIN_TOKEN="s3cret")
    try:
        assert app.authorized("/stats", "Bearer s3cret")
        assert app.authorized("/healthz", None)
        for header in ("bearer s3cret", "BEARER  s3cret", " Bearer s3cret "):
            assert app.authorized("/stats", header), header  # the scheme in any case
        for header in (None, "", "Bearer s3cre", "Bearer s3cretX", "Basic s3cret", "s3cret",
                       "Bearers3cret"):
            assert not app.authorized("/stats", header), header
        assert not app.authorized("/metrics", "Bearer \u00e9")
    finally:
        app.stop()
    open_app = _admin()
    try:
        assert open_app.authorized("/stats", None)
    finally:
        open_app.stop()


def _get(port: int, request: bytes) -> bytes:
    return raw_request("127.0.0.1", port, request)


def test_an_idle_or_trickling_admin_connection_is_closed_at_its_head_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport, "READ_TIMEOUT_S", 0.5)  # the same path, quicker
    app = _admin()
    app.start()
    try:
        port = app.server.sock.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5) as idle, \
                socket.create_connection(("127.0.0.1", port), timeout=5) as slow:
            started = time.monotonic()
            slow.sendall(b"GET /stats HTTP/1.1\r\n")
            while time.monotonic() - started < 4:  # a byte every 0.1 s: never idle 0.5 s
                try:
                    slow.sendall(b"x")
                except OSError:
                    break
                time.sleep(0.1)
            assert slow.recv(1) == b""  # closed by the server at the deadline
            assert idle.recv(1) == b""
            assert time.monotonic() - started < 3
    finally:
        app.stop()


def test_at_the_serving_cap_healthz_and_401_still_answer() -> None:
    app = _admin(VELOX_ADMIN_TOKEN="s3cret")
    app.start()
    try:
        port = app.server.sock.getsockname()[1]
        for _ in range(admin_server.MAX_CONNECTIONS):  # every serving place taken
            assert app.server.slots.acquire(blocking=False)
        stats = b"GET /stats HTTP/1.1\r\nAuthorization: Bearer s3cret\r\n\r\n"
        busy = _get(port, stats)
        assert busy.startswith(b"HTTP/1.1 503") and b"Connection: close" in busy
        assert _get(port, b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n"
                    ).startswith(b"HTTP/1.1 200")
        assert _get(port, b"GET /stats HTTP/1.1\r\nConnection: close\r\n\r\n"
                    ).startswith(b"HTTP/1.1 401")
        assert app.server.refused == 1
        app.server.slots.release()
        assert _get(port, stats.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
                    ).startswith(b"HTTP/1.1 200")
    finally:
        app.stop()


def test_admin_keep_alive_pipelining_and_malformed_heads() -> None:
    app = _admin()
    app.start()
    try:
        port = app.server.sock.getsockname()[1]
        two = _get(port, b"GET /healthz HTTP/1.1\r\n\r\nHEAD /stats HTTP/1.1\r\n"
                         b"Connection: close\r\n\r\n")
        assert two.count(b"HTTP/1.1 200 OK") == 2 and two.endswith(b"\r\n\r\n")  # HEAD: no body
        assert _get(port, b"GARBAGE\r\n\r\n").startswith(b"HTTP/1.1 400")
        double = b"GET /stats HTTP/1.1\r\nAuthorization: a\r\nAuthorization: b\r\n\r\n"
        assert _get(port, double).startswith(b"HTTP/1.1 400")
        assert _get(port, b"GET /x HTTP/1.1\r\nX: " + b"y" * 20000).startswith(b"HTTP/1.1 431")
        post = _get(port, b"POST /stats HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
        assert post.startswith(b"HTTP/1.1 405") and b"Allow: GET, HEAD" in post
    finally:
        app.stop()

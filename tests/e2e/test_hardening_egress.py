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


def _wait_while_sending(up: HostileUpstream, cond: Callable[[], bool], stall_s: float,
                        what: str) -> None:
    """Until cond(), failing once the upstream has sent no byte for `stall_s` seconds. How
    long its paused streams' 168 MiB take through this Python peer depends on the host
    (13 s at a load average of 9-21, more than 50 s at 18); a connection window that is not
    handed back stops the sending for good. The gateway resets none of these streams (their
    clients stay, nothing times out): a stream it reset would never be finished, so that
    fails at once, naming the reset, instead of as a stall."""
    sent, moved = up.bytes_sent, time.monotonic()
    while not cond():
        state = (f"(finished: {up.streams_finished}, reset by the gateway: "
                 f"{up.resets_received}, send windows {up.send_windows()})")
        assert up.resets_received == 0, f"the gateway gave up a stream {state}"
        if up.bytes_sent != sent:
            sent, moved = up.bytes_sent, time.monotonic()
        elif time.monotonic() - moved > stall_s:
            raise AssertionError(f"nothing sent for {stall_s} s while waiting for {what} {state}")
        time.sleep(0.05)


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
    # The paused streams end only as each test means them to, however long a starved host
    # takes to move their 168 MiB (more than 50 s at a load average of 18):
    # - no request timeout (the default, 600 s): a stream's response headers queue in the
    #   upstream's send buffer behind up to a connection window (64 MiB) of other streams'
    #   data, which such a gateway reads at ~5 MiB/s; at 10 s it reset late streams;
    # - no write timeout within the test (the default, 30 s, cut a client paused longer).
    # What is not credited back still fails: the sending stalls (_wait_while_sending), or the
    # hundred requests' own 15 s client timeout.
    env = {"VELOX_WORKERS": "1", "VELOX_EGRESS_POOL_CONNECTIONS": "1",
           "VELOX_UPSTREAM_PROTOCOL": "h2", "VELOX_WRITE_TIMEOUT_MS": "600000"}
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
    extra = {"VELOX_STREAM_IDLE_TIMEOUT_MS": "2000"} if ending == "idle-deadline" else {}
    gw = start_gateway(mock=up, **_one_connection(**extra))
    action = {"upstream-reset": f"stream-reset={7 * _MIB}",
              "completed-while-paused": f"stream={7 * _MIB}"}.get(ending, f"stream={32 * _MIB}")
    clients = [_paused_client(gw.port, action) for _ in range(_CLIENTS)]
    try:
        if ending in ("upstream-reset", "completed-while-paused"):
            # 24 x 7 MiB = 168 MiB, of which the kernel's socket buffers absorb at most ~3 MiB
            # per client: only if each ended stream hands back its held credit can all of them
            # be sent through a 64 MiB connection window.
            _wait_while_sending(up, lambda: up.streams_finished == _CLIENTS, 30,
                                f"all {_CLIENTS} streams to be sent")
        else:
            _wait_for(lambda: up.send_windows() == [0], 30,
                      f"the paused clients to exhaust the connection window "
                      f"({up.send_windows()})")
        if ending == "client-gone":
            for sock in clients:
                sock.close()
            clients = []
        elif ending == "idle-deadline":
            # The paused streams expire 2 s after their last byte and must hand their credit
            # back then, though their clients are still connected. Wait for every one of them
            # (each reset by the gateway): while some are still open, the credit the first
            # ones return is spent on the others' data, not on new streams.
            _wait_for(lambda: up.resets_received >= _CLIENTS, 30,
                      f"all {_CLIENTS} paused streams to expire ({up.resets_received} reset)")
            _wait_for(lambda: up.send_windows() not in ([0], []), 30,
                      "the expired streams' credit to come back")
        # The connection must carry new streams again: its window was handed back.
        _hundred_requests(gw.base_url)
        assert up.connections == 1  # the same connection, not a replacement
    finally:
        for sock in clients:
            sock.close()


# --- finding 4: the warm-up has a deadline; finding 15: a connect timeout says so ----------


def _readyz(gw) -> int:  # type: ignore[no-untyped-def]
    from velox_lab.launch import http_get
    try:
        return http_get("127.0.0.1", gw.port, "/readyz", timeout=1.0)[0]
    except OSError:
        return 0


@pytest.mark.parametrize("protocol", ["h2", "http1"])
def test_withheld_warmup_times_out_and_reconnects(protocol: str, tmp_path,  # type: ignore[no-untyped-def]
                                                  start_gateway: GatewayFactory) -> None:
    # HTTP/2 over TLS (ALPN h2); HTTP/1.1 over plain TCP.
    certdir = str(tmp_path / "certs") if protocol == "h2" else None
    with HostileUpstream(certdir=certdir, script=Script(warmup="withhold",
                                                        protocol=protocol)) as up:
        # 1.5 s: a loop starved on a loaded machine must not see the TCP connect itself time
        # out first (with 400 ms it did, at a load average of 30), which is another message.
        gw = start_gateway(mock=up, wait_ready=False, VELOX_WORKERS="1",
                           VELOX_EGRESS_POOL_CONNECTIONS="1", VELOX_CONNECT_TIMEOUT_MS="1500")
        _wait_for(lambda: up.warmups >= 3, 60, f"3 warm-up attempts (saw {up.warmups})")
        assert up.connections >= 3  # each attempt on a fresh connection
        # Logged once, when the upstream goes down, not at each of the attempts.
        assert gw.log().count("did not answer the warm-up request") == 1, gw.log()
        assert ("within 1500 ms (VELOX_CONNECT_TIMEOUT_MS); upstream 'default' is down: "
                "reconnecting") in gw.log()
        assert _readyz(gw) == 503
        up.script.warmup = "answer"  # the upstream recovers: the next attempt must succeed
        _wait_for(lambda: _readyz(gw) == 200, 20, "/readyz to turn 200")
        assert "upstream 'default' (127.0.0.1:" in gw.log() and "answers again" in gw.log()
        with httpx.Client(base_url=gw.base_url, timeout=10,
                          headers={"authorization": f"Bearer {CLIENT_KEY}"}) as client:
            r = client.post("/v1/chat/completions", json={"model": "m", "messages": []})
        assert r.status_code == 200, r.text


def test_connect_timeout_is_named_in_the_log(start_gateway: GatewayFactory) -> None:
    # A listening socket nobody accepts on: the kernel completes the TCP handshake, the TLS
    # handshake never starts, so the connect times out.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        port = listener.getsockname()[1]
        gw = start_gateway(wait_ready=False, VELOX_UPSTREAM_ORIGIN=f"https://127.0.0.1:{port}",
                           VELOX_WORKERS="1", VELOX_EGRESS_POOL_CONNECTIONS="1",
                           VELOX_CONNECT_TIMEOUT_MS="300")
        expected = (f"upstream connect to 127.0.0.1:{port} failed: no connection to "
                    f"127.0.0.1:{port} within 300 ms (VELOX_CONNECT_TIMEOUT_MS)")
        _wait_for(lambda: expected in gw.log(), 20, f"{expected!r} in the log")
        assert "failed: \n" not in gw.log()


# --- finding 3: a silent upstream connection is noticed and replaced -------------------------

_LIVENESS = {"VELOX_UPSTREAM_PING_INTERVAL_MS": "500", "VELOX_UPSTREAM_PING_TIMEOUT_MS": "500"}


def _metric(gw, name: str) -> float:  # type: ignore[no-untyped-def]
    text = httpx.get(gw.admin_url + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith(name + "_created"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _post(gw, hostile: str | None = None, timeout: float = 30) -> httpx.Response:  # type: ignore[no-untyped-def]
    headers = {"authorization": f"Bearer {CLIENT_KEY}"}
    if hostile:
        headers["x-hostile"] = hostile
    return httpx.post(gw.base_url + "/v1/chat/completions", headers=headers, timeout=timeout,
                      json={"model": "m", "messages": [{"role": "user", "content": "x"}]})


def test_silent_connection_with_a_stream_in_flight_is_replaced(
        tmp_path, start_gateway: GatewayFactory) -> None:  # type: ignore[no-untyped-def]
    with HostileUpstream(certdir=str(tmp_path / "certs")) as up:
        gw = start_gateway(mock=up, VELOX_WORKERS="1", VELOX_EGRESS_POOL_CONNECTIONS="1",
                           VELOX_REQUEST_TIMEOUT_MS="30000", **_LIVENESS)
        assert _post(gw).status_code == 200
        started = time.monotonic()
        r = _post(gw, hostile="silent")  # the upstream goes silent with this request open
        elapsed = time.monotonic() - started
        assert r.status_code == 502, r.text  # not a 504 after the 30 s request timeout
        assert elapsed < 15, elapsed
        _wait_for(lambda: up.connections >= 2, 10, "a replacement connection")
        assert _post(gw).status_code == 200  # the next request goes to the live connection
        log = gw.log()
        assert log.count("no answer to a PING within 500 ms") == 1, log
        _wait_for(lambda: _metric(gw, "velox_upstream_ping_timeouts") >= 1, 5,
                  "the PING timeout in /metrics")  # workers publish counters every tick
        _wait_for(lambda: _readyz(gw) == 200, 10, "/readyz 200")


def test_silent_idle_connection_is_replaced(tmp_path, start_gateway: GatewayFactory,  # type: ignore[no-untyped-def]
                                            ) -> None:
    with HostileUpstream() as up:
        gw = start_gateway(mock=up, VELOX_WORKERS="1", VELOX_EGRESS_POOL_CONNECTIONS="1",
                           VELOX_UPSTREAM_PROTOCOL="h2", **_LIVENESS)
        assert _post(gw).status_code == 200
        requests_before = len(up.requests)

        def silence() -> None:
            for proto in up.live:
                proto.silent = True

        up.call(silence)  # TCP stays open; nothing is answered any more, PINGs included
        _wait_for(lambda: up.connections >= 2, 15, "the idle silent connection to be replaced")
        assert len(up.requests) == requests_before  # found by PINGing, no request needed
        assert _post(gw, timeout=10).status_code == 200
        assert "no answer to a PING within 500 ms (VELOX_UPSTREAM_PING_TIMEOUT_MS) with 0 " \
            "stream(s) open; replacing it" in gw.log()


def test_consecutive_request_timeouts_retire_the_connection(start_gateway: GatewayFactory,
                                                            ) -> None:
    # The connection stays alive (PINGs answered) but never answers requests on it.
    with HostileUpstream() as up:
        gw = start_gateway(mock=up, VELOX_WORKERS="1", VELOX_EGRESS_POOL_CONNECTIONS="1",
                           VELOX_UPSTREAM_PROTOCOL="h2", VELOX_REQUEST_TIMEOUT_MS="500")
        for _ in range(3):
            r = _post(gw, hostile="hang", timeout=10)
            assert r.status_code == 504, r.text
        _wait_for(lambda: up.connections >= 2, 10, "a replacement connection")
        assert "3 requests in a row got no response headers in time; retiring it" in gw.log()
        _wait_for(lambda: _readyz(gw) == 200, 10, "/readyz 200")
        assert _post(gw, timeout=10).status_code == 200
        _wait_for(lambda: _metric(gw, "velox_upstream_timeout_retirements") >= 1, 5,
                  "the retirement in /metrics")


# --- finding 13: connection-specific response headers ----------------------------------------


@pytest.mark.parametrize("native", ["1", "0"])
def test_http2_response_with_connection_specific_fields(native: str,
                                                        start_gateway: GatewayFactory) -> None:
    # RFC 9113 section 8.2.2. The relay strips the fields, and those the Connection field
    # names (x-hop) as on HTTP/1.1, natively and on the Python twins (VELOX_NATIVE=0) alike.
    with HostileUpstream() as up:
        gw = start_gateway(mock=up, VELOX_WORKERS="1", VELOX_EGRESS_POOL_CONNECTIONS="1",
                           VELOX_UPSTREAM_PROTOCOL="h2", VELOX_NATIVE=native)
        r = _post(gw, hostile="conn-headers", timeout=10)
        assert r.status_code == 200, r.text
        assert r.headers.get("x-kept") == "yes"
        assert "x-hop" not in r.headers  # named in the upstream's Connection field
        for name in ("connection", "keep-alive", "transfer-encoding", "upgrade"):
            assert name not in r.headers or (name == "connection"
                                             and r.headers[name] == "keep-alive"), name
        assert up.connections == 1
        assert _post(gw, timeout=10).status_code == 200


def test_http1_headers_named_in_connection_are_dropped(start_gateway: GatewayFactory) -> None:
    with HostileUpstream(script=Script(protocol="http1")) as up:
        gw = start_gateway(mock=up, VELOX_WORKERS="1", VELOX_EGRESS_POOL_CONNECTIONS="1")
        r = _post(gw, hostile="conn-headers", timeout=10)
        assert r.status_code == 200, r.text
        assert r.headers.get("x-kept") == "yes"
        assert "x-hop" not in r.headers  # named in the upstream's Connection header
        assert "keep-alive" not in r.headers


# --- the rest of the hostile repertoire: every misbehaviour gets one clear answer -------------


@pytest.mark.parametrize("action", ["continuation", "bad-frame", "goaway", "stream-reset=100000"])
def test_hostile_frames_get_one_clear_answer_and_the_gateway_recovers(
        action: str, start_gateway: GatewayFactory) -> None:
    with HostileUpstream() as up:
        gw = start_gateway(mock=up, VELOX_WORKERS="1", VELOX_EGRESS_POOL_CONNECTIONS="1",
                           VELOX_UPSTREAM_PROTOCOL="h2", VELOX_REQUEST_TIMEOUT_MS="5000")
        started = time.monotonic()
        if action.startswith("stream-reset"):
            # An event stream is relayed as it comes; a reset after its head reached the client
            # and inside an event (this upstream's bytes are not whole events) can only cut the
            # client's connection, which the client sees as an error. (A stream broken between
            # events ends with an error event instead: tests/e2e/test_routing.py.)
            with pytest.raises(httpx.RemoteProtocolError):
                _post(gw, hostile=action, timeout=20)
        else:
            r = _post(gw, hostile=action, timeout=20)
            assert r.status_code in (502, 503), r.text
            assert r.json()["error"]["type"] == "server_error"
        assert time.monotonic() - started < 10
        _wait_for(lambda: _readyz(gw) == 200, 15, "/readyz 200 again")
        assert _post(gw, timeout=10).status_code == 200


def test_zero_window_upstream_times_out_the_upload(start_gateway: GatewayFactory) -> None:
    # The upstream announces INITIAL_WINDOW_SIZE 0 and never opens it: no body byte can move.
    with HostileUpstream(script=Script(initial_window=0)) as up:
        gw = start_gateway(mock=up, VELOX_WORKERS="1", VELOX_EGRESS_POOL_CONNECTIONS="1",
                           VELOX_UPSTREAM_PROTOCOL="h2", VELOX_REQUEST_TIMEOUT_MS="700")
        r = _post(gw, timeout=10)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "upstream_timeout"

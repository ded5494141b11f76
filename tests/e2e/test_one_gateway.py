"""One gateway per address: a second Velox, or any other program already listening on the
port, stops start-up with a message naming the port, and the first keeps serving alone.

With SO_REUSEPORT the kernel would otherwise let a second gateway (or any server of the same
user that sets the option) join the port and answer a share of the first one's clients. Real
processes throughout: gateways are `python -m velox`, the other listeners are real sockets of
this test process; `velox doctor` and `velox demo` run as the commands an operator types.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from velox.system.ports import holders
from velox_lab.launch import GatewayProcess, free_port, http_get
from velox_lab.mock import MockUpstream

from .conftest import GatewayFactory, client_for, gateway_env

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


def velox_env(env: dict[str, str]) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("VELOX_")}
    return {**base, **env}


def run_velox(env: dict[str, str], *args: str, timeout: float = 60) -> tuple[int | None, str]:
    """Run `python -m velox ARGS`; its exit code (None: still running after `timeout`, then
    killed) and everything it printed."""
    proc = subprocess.Popen([sys.executable, "-m", "velox", *args], env=velox_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=Path(__file__).parent)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # a gateway or a demo drains and stops what it started
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        return None, out


def answers_all(gw: GatewayProcess, n: int) -> None:
    client = client_for(gw)
    for _ in range(n):
        reply = client.chat.completions.create(**CHAT)  # type: ignore[call-overload]
        assert reply.choices[0].message.content


def test_a_second_velox_on_the_port_is_refused_and_the_first_keeps_serving(
        start_gateway: GatewayFactory) -> None:
    first = start_gateway()
    second = {**first.env, "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}"}
    code, out = run_velox(second, timeout=60)
    assert code is not None and code != 0, f"the second gateway started:\n{out[-2000:]}"
    assert f"port {first.port}" in out and "another process is already listening" in out, out
    assert "Traceback" not in out
    # The first is the only program on its port, and it serves.
    assert holders(first.host, first.port) == [first.pid]
    answers_all(first, 20)


@pytest.mark.parametrize("reuseport", [False, True], ids=["plain", "reuseport"])
def test_another_listener_on_the_port_stops_start_up(upstream: MockUpstream,
                                                     reuseport: bool) -> None:
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuseport:  # as a server with `reuseport` (nginx), or a second Velox, binds it
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen(16)
        port = other.getsockname()[1]
        env = {**gateway_env(upstream), "VELOX_HOST": "127.0.0.1", "VELOX_PORT": str(port)}
        code, out = run_velox(env, timeout=60)
        assert code is not None and code != 0, f"velox started beside a listener:\n{out[-2000:]}"
        assert f"127.0.0.1:{port}" in out and f"port {port}" in out, out
        # The other program still has its port, whole.
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            conn, _ = other.accept()
            conn.close()


class _Imposter(ThreadingHTTPServer):
    """Another gateway-like server joining a port with SO_REUSEPORT (after Velox started: the
    kernel allows it), answering every GET as a healthy Velox would."""

    daemon_threads = True

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()


class _Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def imposter_on() -> Iterator[object]:
    started: list[_Imposter] = []

    def start(port: int) -> _Imposter:
        server = _Imposter(("127.0.0.1", port), _Healthy)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def doctor(gw: GatewayProcess) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", ""),
           **{k: v for k, v in gw.env.items() if k.startswith("VELOX_")}}
    return subprocess.run([sys.executable, "-m", "velox", "doctor"], env=env,
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).parent,
                          check=False)


def test_doctor_fails_while_another_program_shares_the_port(
        start_gateway: GatewayFactory, imposter_on) -> None:
    gw = start_gateway()
    alone = doctor(gw)
    assert re.search(rf"^PASS  port +127\.0\.0\.1:{gw.port}: Velox \(pid {gw.pid}\) is up there",
                     alone.stdout, re.M), alone.stdout
    imposter_on(gw.port)
    shared = doctor(gw)
    assert shared.returncode == 1, shared.stdout
    line = re.search(r"^FAIL  port +(.*)$", shared.stdout, re.M)
    assert line is not None, shared.stdout
    assert f"127.0.0.1:{gw.port} is listened on by 2 programs at once" in line.group(1)
    assert f"pid {gw.pid}" in line.group(1) and f"pid {os.getpid()}" in line.group(1)
    assert "stop all but one of them" in shared.stdout


def test_demo_refuses_a_port_another_gateway_holds(start_gateway: GatewayFactory) -> None:
    gw = start_gateway()  # no client keys: the demo's SDK call would succeed through it
    code, out = run_velox({"VELOX_PORT": str(gw.port)}, "demo", timeout=90)
    assert code == 1, out
    assert f"127.0.0.1:{gw.port}" in out and "the gateway did not start" in out, out
    assert "Velox is listening" not in out and "chat.completions" not in out, out
    assert "Traceback" not in out
    assert http_get(gw.host, gw.port, "/readyz")[0] == 200

"""Run a real Velox gateway as a child process (for the demo, the tests and the benchmarks).

`GatewayProcess` starts `python -m velox` with the given VELOX_* settings, waits until
`/readyz` answers 200, and stops it by its PID. Its stdout and stderr go to a file so a test
can read the log afterwards (for instance to prove a key never appears in it). Unless the
caller sets VELOX_ADMIN_ADDR (VELOX_STATE_DIR), the admin server gets a free port (the
gateway a fresh state directory) of its own, so gateways started side by side never
collide. With VELOX_ADMIN_TOKEN in its settings, `admin_headers` and `admin_get` carry the
token.

`start` only counts an answer as its own gateway's: the port must be free before it starts
(another gateway there would answer /readyz while this one refuses to start), and where /proc
shows who listens, every socket listening on the port must be its process's.
"""

from __future__ import annotations

import fcntl
import http.client
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from velox.system.ports import in_use, listening_inodes, socket_inodes

# A port `free_port` hands out is one no other caller on this host gets again for this long: the
# gateway, mock or redis-server it is for binds it well within that (a start takes 0.5-3 s on a
# loaded 2-core host), and a restart on the same port (a killed redis-server) is covered too.
RESERVE_S = 300.0
RESERVED = Path(tempfile.gettempdir()) / "velox-lab-ports"  # "port until" lines, under flock
BELOW_EPHEMERAL = 16384  # ports picked from this many just below the kernel's ephemeral range


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, for a process about to be started to bind.

    Picking one with bind(0) and closing it left a window until the process bound it, and tests
    running side by side lost it in there: the kernel handed the same port to an outgoing
    connection (a client's source port comes from the ephemeral range bind(0) picks from) or to
    another test's bind(0). So the port comes from below the ephemeral range, where no
    connection's source port falls, and is reserved in a file shared by every process on the
    host for RESERVE_S, so no other caller picks it meanwhile. Where the range cannot be read,
    or leaves no room below it, this falls back to bind(0)."""
    low = _ephemeral_low()
    if low - BELOW_EPHEMERAL < 1024:
        return _kernel_port(host)
    with open(RESERVED, "a+") as book:
        fcntl.flock(book, fcntl.LOCK_EX)  # released when the file closes
        now = time.time()
        book.seek(0)
        held = {}
        for line in book.read().splitlines():
            port, _, until = line.partition(" ")
            if port.isdigit() and float(until or 0) > now:
                held[int(port)] = float(until)
        for _ in range(200):
            port = random.randrange(low - BELOW_EPHEMERAL, low)
            if port not in held and _bindable(host, port):
                break
        else:
            return _kernel_port(host)
        held[port] = now + RESERVE_S
        book.seek(0)
        book.truncate()
        book.write("".join(f"{p} {u:.0f}\n" for p, u in held.items()))
        return port


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _kernel_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def http_get(host: str, port: int, path: str, timeout: float = 2.0,
             headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path, headers=dict(headers or {}))
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def raw_request(host: str, port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes (one or more requests) and read until the server closes."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received


class GatewayProcess:
    def __init__(self, env: Mapping[str, str], port: int | None = None,
                 host: str = "127.0.0.1", log_path: str | Path | None = None,
                 inherit_env: bool = True, stdout: int | None = None) -> None:
        self.host = host
        # A descriptor for the gateway's stdout (the access log) apart from its other output,
        # which then goes alone to the log file.
        self.stdout = stdout
        self.port = port or free_port(host)
        base = dict(os.environ) if inherit_env else {"PATH": os.environ.get("PATH", "")}
        # Settings come only from what the caller passes, not from a stray .env or shell.
        base = {k: v for k, v in base.items() if not k.startswith("VELOX_")}
        base.pop("OPENAI_API_KEY", None)
        self.env = {**base, **env, "VELOX_HOST": host, "VELOX_PORT": str(self.port)}
        self.env.setdefault("VELOX_ADMIN_ADDR", f"{host}:{free_port(host)}")
        # Its own state directory (run-time keys): gateways started side by side, or one
        # after another in the same working directory, never share keys by accident.
        self.env.setdefault("VELOX_STATE_DIR", tempfile.mkdtemp(prefix="velox-state-"))
        self.log_path = Path(log_path) if log_path else Path(
            tempfile.mkstemp(prefix="velox-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def admin_url(self) -> str | None:
        """http://host:port of the admin server (None when VELOX_ADMIN_ADDR=off or port 0)."""
        addr = self.env["VELOX_ADMIN_ADDR"].strip()
        if addr.lower() == "off" or addr.endswith(":0"):
            return None
        return f"http://{addr}"

    @property
    def admin_headers(self) -> dict[str, str]:
        """The Authorization header the admin server wants (none without VELOX_ADMIN_TOKEN)."""
        token = self.env.get("VELOX_ADMIN_TOKEN", "").strip()
        return {"Authorization": f"Bearer {token}"} if token else {}

    def admin_get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        """GET an admin path, with the token when one is configured."""
        url = self.admin_url
        if url is None:
            raise RuntimeError("this gateway has no admin server (VELOX_ADMIN_ADDR)")
        host, _, port = url.removeprefix("http://").rpartition(":")
        return http_get(host.strip("[]"), int(port), path, timeout, self.admin_headers)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    # A gateway is ready in about a second on a quiet host (its start is ~0.75 s of CPU, mostly
    # imports, then the upstream warm-ups); test suites side by side at load 20-30 have taken
    # more than 30 s. The wait ends at readiness, so a generous bound costs nothing.
    def start(self, timeout: float = 60.0, wait_ready: bool = True) -> GatewayProcess:
        taken = in_use(self.host, self.port)
        if taken is not None:
            raise RuntimeError(f"{self.host}:{self.port} is taken before velox started "
                               f"({taken.strerror or taken}): another gateway or program "
                               f"listens there (VELOX_PORT)")
        log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "velox"], env=self.env,
            stdout=log if self.stdout is None else self.stdout,
            stderr=subprocess.STDOUT if self.stdout is None else log,
            cwd=tempfile.gettempdir(),
        )
        log.close()
        deadline = time.monotonic() + timeout
        path = "/readyz" if wait_ready else "/healthz"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"velox exited with {self.proc.returncode}:\n{self.log()}")
            try:
                status, _ = http_get(self.host, self.port, path, timeout=1.0)
                if status == 200 and self._listens_alone():
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"velox did not become ready within {timeout}s:\n{self.log()}")

    def _listens_alone(self) -> bool:
        """Whether every socket listening on the port is this gateway's (True where /proc
        cannot tell). Its supervisor holds every worker's listening socket."""
        assert self.proc is not None
        listening = listening_inodes(self.host, self.port)
        if not listening or listening <= socket_inodes(self.proc.pid):
            return True
        if self.proc.poll() is None:
            return False
        raise RuntimeError(f"velox exited with {self.proc.returncode} while another process "
                           f"answers on port {self.port}:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        return self.proc.returncode

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisProcess:
    """A real `redis-server` on a free port of 127.0.0.1 (tests, benchmarks, the demo).

    No persistence (a SIGKILLed server comes back empty, like a cache node that lost its
    memory), no config file, its own working directory. `kill()` is SIGKILL by PID;
    `start()` again restarts it on the same port.
    """

    def __init__(self, port: int | None = None, log_path: str | Path | None = None) -> None:
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="velox-redis-")
        self.log_path = Path(log_path) if log_path else Path(self.dir) / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisProcess:
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        try:
            self.proc = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                 "--save", "", "--appendonly", "no", "--dir", self.dir,
                 "--protected-mode", "yes", "--daemonize", "no"],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.dir)
        except FileNotFoundError:
            raise RuntimeError("redis-server is not installed (make redis-server, or "
                               "apt-get install redis-server)") from None
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}:\n"
                                   f"{self.log_path.read_text(errors='replace')}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} in {timeout}s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def command(self, *args: str | bytes, timeout: float = 2.0) -> bytes:
        """Send one command (RESP) and return the raw reply bytes (for tests' checks)."""
        parts = [a.encode() if isinstance(a, str) else a for a in args]
        out = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as sock:
            sock.sendall(out)
            return sock.recv(65536)

    def kill(self) -> None:
        """SIGKILL by PID, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""The processes a run starts: the mock upstream, Velox, nginx and LiteLLM's proxy.

Every service is a child process started here and stopped by its PID (never by name), listens
on 127.0.0.1 only, and reports the PIDs whose CPU and memory are charged to it: `roots` (the
process trees summed for CPU per request) and `workers` (the processes whose RSS is sampled).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from benches.e2e import litellm, workload
from benches.e2e.machine import children
from velox_lab.launch import GatewayProcess, free_port, http_get
from velox_lab.mock import MockUpstream

NGINX_TEMPLATE = Path(__file__).with_name("nginx.conf.template")


def wait_port(port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


def stop_pid(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 15) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(5)


class Service:
    name = ""
    port = 0

    @property
    def roots(self) -> list[int]:
        raise NotImplementedError

    @property
    def workers(self) -> list[int]:
        return self.roots

    def start(self) -> Service:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class Mock(Service):
    """The bundled mock upstream; `tls` picks HTTP/2 + TLS (ALPN) or cleartext h1/h2c."""

    def __init__(self, tls: bool, workers: int, logdir: Path) -> None:
        self.name = "mock-tls" if tls else "mock"
        self.mock = MockUpstream(tls=tls, extra_args=["--workers", str(workers)],
                                 log_path=str(logdir / f"{self.name}.log"))

    def start(self) -> Mock:
        self.mock.start()
        self.port = self.mock.port
        return self

    @property
    def origin(self) -> str:
        return self.mock.origin

    @property
    def roots(self) -> list[int]:
        return [self.mock.pid]

    def stop(self) -> None:
        self.mock.stop()


class Velox(Service):
    def __init__(self, upstream: Mock, logdir: Path, label: str = "velox",
                 overrides: Mapping[str, str] | None = None, workers: int = 2) -> None:
        self.name = label
        env = {
            "VELOX_WORKERS": str(workers), "VELOX_RATE_LIMIT_RPM": "0",
            "VELOX_UPSTREAM_ORIGIN": upstream.origin, "OPENAI_API_KEY": workload.API_KEY,
            "VELOX_LOG_LEVEL": "warning",
        }
        if upstream.mock.ca_file:
            env["VELOX_UPSTREAM_CA_FILE"] = upstream.mock.ca_file
        env.update(overrides or {})
        self.env = env
        self.proc = GatewayProcess(env, log_path=logdir / f"{label}.log")

    def start(self) -> Velox:
        self.proc.start(timeout=60)
        self.port = self.proc.port
        return self

    @property
    def roots(self) -> list[int]:
        return [self.proc.pid]

    @property
    def workers(self) -> list[int]:
        return children(self.proc.pid)

    def stop(self) -> None:
        self.proc.stop()


class Nginx(Service):
    """nginx (Debian's) proxying to the mock, plus a `return 200` server on `static_port`.

    In front of the TLS mock (`upstream.mock.ca_file` set) it is the target "nginx-tls":
    HTTP/1.1 over TLS to the mock with keep-alive upstream connections, the certificate
    verified against the mock's CA like Velox verifies it (name `localhost`, which the mock's
    certificate carries). nginx has no HTTP/2 upstream, so this is the closest configuration
    to Velox's HTTP/2 + TLS egress."""

    def __init__(self, upstream: Mock, workers: int = 2) -> None:
        self.upstream = upstream
        self.tls = bool(upstream.mock.ca_file)
        self.name = "nginx-tls" if self.tls else "nginx"
        self.nworkers = workers
        self.run_dir = Path(tempfile.mkdtemp(prefix="velox-bench-nginx-"))
        self.proc: subprocess.Popen[bytes] | None = None

    def _proxy_tls(self) -> str:
        if not self.tls:
            return ""
        lines = ("proxy_ssl_verify on;",
                 f"proxy_ssl_trusted_certificate {self.upstream.mock.ca_file};",
                 "proxy_ssl_name localhost;", "proxy_ssl_server_name on;",
                 "proxy_ssl_session_reuse on;")
        return "\n".join("            " + line for line in lines)

    def start(self) -> Nginx:
        self.port, self.static_port = free_port(), free_port()
        conf = NGINX_TEMPLATE.read_text()
        for key, value in {
            "WORKERS": str(self.nworkers), "RUN": str(self.run_dir),
            "UPSTREAM_PORT": str(self.upstream.port), "PROXY_PORT": str(self.port),
            "STATIC_PORT": str(self.static_port), "STATIC_BODY": workload.static_response(),
            "SCHEME": "https" if self.tls else "http", "PROXY_TLS": self._proxy_tls(),
        }.items():
            conf = conf.replace(f"@{key}@", value)
        path = self.run_dir / "nginx.conf"
        path.write_text(conf)
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        self.proc = subprocess.Popen(
            [nginx, "-p", str(self.run_dir), "-e", str(self.run_dir / "error.log"),
             "-c", str(path), "-g", "daemon off; master_process on;"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_port(self.port, 10, self.proc)
        wait_port(self.static_port, 10, self.proc)
        return self

    @property
    def roots(self) -> list[int]:
        return [self.proc.pid] if self.proc else []

    @property
    def workers(self) -> list[int]:
        return children(self.proc.pid) if self.proc else []

    def stop(self) -> None:
        if self.proc is not None:
            stop_pid(self.proc, signal.SIGQUIT)  # graceful: finish requests, then exit
            if self.proc.stderr is not None:
                self.proc.stderr.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)


class LiteLLM(Service):
    name = "litellm"

    def __init__(self, upstream: Mock, slow_chunks: int, slow_delay_ms: int,
                 logdir: Path) -> None:
        self.upstream = upstream
        self.slow = (slow_chunks, slow_delay_ms)
        self.home = Path(tempfile.mkdtemp(prefix="velox-bench-litellm-"))
        self.log_path = logdir / "litellm.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 180) -> LiteLLM:
        self.port = free_port()
        config = self.home / "config.yaml"
        config.write_text(litellm.config_yaml(self.upstream.origin + "/v1", *self.slow))
        log = open(self.log_path, "wb")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(litellm.command(config, self.port), cwd=self.home,
                                     env=litellm.environment(self.home), stdin=subprocess.DEVNULL,
                                     stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"litellm exited with {self.proc.returncode}; see "
                                   f"{self.log_path}")
            try:
                if http_get("127.0.0.1", self.port, "/health/liveliness", 2.0)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"litellm not ready after {timeout}s; see {self.log_path}")

    @property
    def roots(self) -> list[int]:
        return [self.proc.pid] if self.proc else []

    def stop(self) -> None:
        if self.proc is not None:
            stop_pid(self.proc, signal.SIGTERM, timeout=20)
        shutil.rmtree(self.home, ignore_errors=True)


def describe(service: Service) -> dict[str, object]:
    out: dict[str, object] = {"name": service.name, "port": service.port}
    if isinstance(service, Velox):
        out["env"] = {k: v for k, v in service.env.items()
                      if k.startswith("VELOX_") and "CA_FILE" not in k and "ORIGIN" not in k}
    return json.loads(json.dumps(out))

"""Process shell of the mock upstream: listener, TLS, ALPN dispatch, signals, workers.

`run(config)` binds the listening socket, optionally forks `workers - 1` extra processes that
accept on the same inherited socket, and serves until SIGTERM/SIGINT. Each accepted connection
starts on `Dispatch`, which picks the protocol from ALPN (TLS) or, when ALPN said nothing or
there is no TLS, from the first bytes (the HTTP/2 connection preface means h2 with prior
knowledge), then hands the transport to the HTTP/1.1 or HTTP/2 shell. uvloop is used when
importable. Once listening, the first process prints one JSON "ready" line on stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import ssl
import sys
import tempfile
import time
from dataclasses import dataclass

from . import behaviour
from .behaviour import Defaults
from .certs import ensure_certs
from .h1proto import H1Protocol
from .h2proto import H2Protocol
from .h2server import PREFACE
from .state import MockState, SharedCounters

SHUTDOWN_GRACE = 0.05  # seconds for GOAWAY / close_notify to leave before the loop stops


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    tls: bool = True
    certdir: str | None = None
    alpn: tuple[str, ...] = ("h2", "http/1.1")
    max_concurrent_streams: int = 1000
    latency_ms: int = 0
    chunks: int = 8
    chunk_delay_ms: int = 0
    goaway_after: int = 0
    workers: int = 1
    name: str = "mock"
    latency_per_input_us: int = 0


class Dispatch(asyncio.Protocol):
    """First protocol of every connection: decides h2 or HTTP/1.1, then steps aside."""

    def __init__(self, state: MockState) -> None:
        self.state = state
        self.transport: asyncio.Transport | None = None
        self.buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.state.connection_opened(self)
        ssl_object = transport.get_extra_info("ssl_object")
        alpn = ssl_object.selected_alpn_protocol() if ssl_object is not None else None
        if alpn == "h2":
            self._switch(H2Protocol)
        elif alpn == "http/1.1" or not self.state.h2_allowed:
            self._switch(H1Protocol)

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        if len(buf) < len(PREFACE) and PREFACE.startswith(buf):
            self.buf = buf  # could still be the h2 preface: wait for more
            return
        self._switch(H2Protocol if buf.startswith(PREFACE) else H1Protocol, buf)

    def connection_lost(self, exc: Exception | None) -> None:
        self.state.connection_closed(self, False)

    def shutdown(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _switch(self, factory: type, pending: bytes = b"") -> None:
        proto = factory(self.state)
        self.state.connections.discard(self)
        self.state.connections.add(proto)
        self.transport.set_protocol(proto)
        proto.connection_made(self.transport)
        if pending:
            proto.data_received(pending)


def make_ssl_context(cert_file: str, key_file: str, alpn: tuple[str, ...]) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2  # RFC 9113 §9.2: h2 needs TLS 1.2+
    ctx.load_cert_chain(cert_file, key_file)
    if alpn:
        ctx.set_alpn_protocols(list(alpn))
    return ctx


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=1024)


def _origin(tls: bool, host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{shown}:{port}"


def _die_with_parent() -> None:
    # Forked workers must not outlive the process the caller knows the PID of.
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _loop_factory():
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency, but stay portable
        return asyncio.new_event_loop
    return uvloop.new_event_loop


async def _serve(cfg: ServerConfig, sock: socket.socket, ctx: ssl.SSLContext | None,
                 counters: SharedCounters, ready: dict | None) -> None:
    loop = asyncio.get_running_loop()
    state = MockState(Defaults(cfg.latency_ms, cfg.chunks, cfg.chunk_delay_ms,
                               cfg.latency_per_input_us),
                      max_concurrent_streams=cfg.max_concurrent_streams,
                      goaway_after=cfg.goaway_after, h2_allowed="h2" in cfg.alpn,
                      counters=counters, name=cfg.name)
    tls_options = {"ssl": ctx, "ssl_handshake_timeout": 10.0} if ctx is not None else {}
    server = await loop.create_server(lambda: Dispatch(state), sock=sock, backlog=1024,
                                      **tls_options)
    stop = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    if ready is not None:
        sys.stdout.write(json.dumps(ready) + "\n")
        sys.stdout.flush()
    await stop
    server.close()
    for proto in list(state.connections):
        proto.shutdown()
    await asyncio.sleep(SHUTDOWN_GRACE)
    for proto in list(state.connections):
        transport = getattr(proto, "transport", None)
        if transport is not None:
            transport.abort()


def _run_loop(cfg: ServerConfig, sock: socket.socket, ctx: ssl.SSLContext | None,
              counters: SharedCounters, ready: dict | None) -> None:
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(_serve(cfg, sock, ctx, counters, ready))


def _exit_now(signum: int, frame: object) -> None:
    raise SystemExit(0)


def run(cfg: ServerConfig) -> int:
    # Until the event loop installs its own handlers, a stop signal still means "exit 0"
    # (through the finally blocks below, so workers and temp certs are cleaned up).
    signal.signal(signal.SIGTERM, _exit_now)
    signal.signal(signal.SIGINT, _exit_now)
    tmpdir = None
    ctx = None
    ca_file = None
    if cfg.tls:
        certdir = cfg.certdir or (tmpdir := tempfile.mkdtemp(prefix="velox-mock-certs-"))
        paths = ensure_certs(certdir)
        ctx = make_ssl_context(paths.cert_file, paths.key_file, cfg.alpn)
        ca_file = paths.ca_file
    sock = _bind(cfg.host, cfg.port)
    port = sock.getsockname()[1]
    counters = SharedCounters(max(1, cfg.workers))
    children: list[int] = []
    for worker in range(1, max(1, cfg.workers)):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _die_with_parent()
                counters.select(worker)
                behaviour.reseed()
                _run_loop(cfg, sock, ctx, counters, None)
            except SystemExit:
                pass
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        children.append(pid)
    ready = {"event": "ready", "origin": _origin(cfg.tls, cfg.host, port), "port": port,
             "ca_file": ca_file, "pid": os.getpid(), "workers": max(1, cfg.workers),
             "alpn": list(cfg.alpn) if cfg.tls else None, "name": cfg.name}
    try:
        _run_loop(cfg, sock, ctx, counters, ready)
    finally:
        sock.close()
        _stop_children(children)
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)
    return 0


def _stop_children(children: list[int], timeout: float = 3.0) -> None:
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    pending = set(children)
    while pending and time.monotonic() < deadline:
        for pid in list(pending):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    continue
            pending.discard(pid)
        if pending:
            time.sleep(0.02)
    for pid in pending:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)

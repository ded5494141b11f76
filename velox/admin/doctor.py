"""`velox doctor`: check the configuration and the path to the upstream, one line per check.

Each check prints `PASS` or `FAIL` (or `SKIP` when an earlier failure makes it meaningless)
with what it found, and for a failure what to do about it; a VELOX_* variable that is no
setting gets a `WARN` line with the setting it was probably meant to be. In order:

1. the configuration loads (the same `config.load` the gateway uses);
2. the gateway's port and 3. the admin port are free, or Velox is already up on them (then its
   /healthz and /readyz are asked) and no other program listens there too (with SO_REUSEPORT
   a second one would answer a share of the connections: /proc shows who listens);
4. the upstream's host resolves, 5. accepts a TCP connection, 6. completes a TLS handshake
   trusting the configured CAs, 7. negotiates h2 by ALPN (or Velox will fall back to
   HTTP/1.1), and 8. answers `GET VELOX_UPSTREAM_WARMUP_PATH` with the configured key. Any HTTP
   status proves the upstream reachable; 401/403 means the key is missing or wrong.

Checks 4-8 run for every upstream: the VELOX_UPSTREAM_* one, or with VELOX_CONFIG each
`[[upstream]]` of the file in turn (its origin, ca_file, protocol, api_key_env and warmup_path;
its credential header as the gateway sends it: `api-key` for Azure, `x-api-key` and
`anthropic-version` for Anthropic, `x-goog-api-key` for Gemini; a Bedrock upstream's probe is
not signed, so its 403 proves it reachable). An upstream of a translated kind is first checked
by making its translator as the gateway does (`upstream-kind`: botocore and the AWS
credentials for Bedrock). Those checks are named
after the upstream (`upstream-dns[a]`) and their fixes name the file, table and key. One
upstream's failure skips only its own later checks.

The exit status is 1 if any check failed, else 0. The warm-up request goes over HTTP/2 with the
gateway's own codec when h2 was negotiated, so it exercises the same framing the egress uses.
"""

from __future__ import annotations

import errno
import http.client
import json
import socket
import ssl
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from velox.config.settings import ConfigError, Settings, load
from velox.config.tables import TRANSLATED_KINDS, UpstreamSpec
from velox.egress.edge import translator_for
from velox.system.ports import holders, in_use, process_name

_PROBE_TIMEOUT_S = 2.0


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL, SKIP, WARN
    detail: str
    fix: str = ""


def _pass(name: str, detail: str) -> Result:
    return Result(name, "PASS", detail)


def _fail(name: str, detail: str, fix: str) -> Result:
    return Result(name, "FAIL", detail, fix)


# --- ports --------------------------------------------------------------------------------------


def _get_json(host: str, port: int, path: str,
              headers: dict[str, str] | None = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection(host, port, timeout=_PROBE_TIMEOUT_S)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    try:
        return response.status, json.loads(body)
    except ValueError:
        return response.status, None


def check_port(name: str, variable: str, host: str, port: int, velox_paths: tuple[str, ...],
               headers: dict[str, str] | None = None) -> Result:
    where = f"{host}:{port}"
    if port == 0:
        return _pass(name, f"{variable} port 0: a free port is picked at start-up")
    error = in_use(host, port)
    if error is None:
        return _pass(name, f"{where} is free")
    if error.errno != errno.EADDRINUSE:
        return _fail(name, f"cannot bind {where}: {error.strerror or error}",
                     f"set {variable} to an address of this machine")
    programs = holders(host, port)
    if len(programs) > 1:  # the kernel shares the connections out between them
        named = ", ".join(f"pid {pid} ({process_name(pid)})" for pid in programs)
        return _fail(name, f"{where} is listened on by {len(programs)} programs at once ({named}):"
                     " each answers a share of the connections",
                     f"stop all but one of them, or set {variable} to a free port")
    try:
        status, body = _get_json(host, port, "/healthz")
    except (OSError, http.client.HTTPException) as exc:
        # Not proof of another program: a Velox starved of CPU answers late too.
        held = f" by pid {programs[0]} ({process_name(programs[0])})" if programs else ""
        return _fail(name, f"{where} is in use{held}, and /healthz did not answer within "
                     f"{_PROBE_TIMEOUT_S:g} s ({type(exc).__name__}): another program, or a "
                     "Velox too busy to answer", f"run doctor again; if it says the same, stop "
                     f"that program or set {variable} to a free port")
    if status != 200 or not isinstance(body, dict) or body.get("status") != "ok":
        return _fail(name, f"{where} is in use by another program (not Velox: /healthz "
                     f"answered {status})", f"stop that program or set {variable} to a free port")
    details = [f"Velox (pid {programs[0]}) is up there" if programs else "Velox is up there"]
    for path in velox_paths:
        try:
            status, body = _get_json(host, port, path, headers)
        except (OSError, http.client.HTTPException) as exc:
            return _fail(name, f"Velox is up on {where} but {path} failed: {exc}",
                         "look at the gateway's log")
        if status == 401:
            return _fail(name, f"Velox is up on {where} but {path} answers 401",
                         "set VELOX_ADMIN_TOKEN to the gateway's admin token")
        if status != 200:
            return _fail(name, f"Velox is up on {where} but {path} answers {status}: "
                         f"{json.dumps(body)[:160]}",
                         "its upstream connections are not warm: see the upstream checks "
                         "below and the gateway's log")
        details.append(f"{path} 200")
    return _pass(name, f"{where}: " + ", ".join(details))


# --- upstream -----------------------------------------------------------------------------------


class _Upstream:
    """State carried from one upstream check to the next (the socket, what ALPN said).

    One per upstream: the VELOX_UPSTREAM_* one, or each [[upstream]] of VELOX_CONFIG. Check
    names and fixes name the upstream and where it is configured (variable, or file, table and
    key)."""

    def __init__(self, settings: Settings, spec: UpstreamSpec, source: str) -> None:
        self.settings = settings
        self.spec = spec
        self.host = spec.host
        self.port = spec.port
        self.sock: socket.socket | None = None
        self.alpn: str | None = None
        self.timeout = min(10.0, spec.connect_timeout_ms / 1000)
        self.from_file = bool(source)
        self.suffix = f"[{spec.name}]" if source else ""
        if source:
            table = f"[[upstream]] {spec.name!r} in {source}"
            self.origin_var = f"`origin` of {table}"
            self.ca_var = f"`ca_file` of {table}"
            self.protocol_var = f"`protocol` of {table}"
            self.warmup_var = f"`warmup_path` of {table}"
            self.key_var = (f"the variable {spec.api_key_env} (`api_key_env` of {table})"
                            if spec.api_key_env else f"`api_key_env` of {table}")
        else:
            self.origin_var = "VELOX_UPSTREAM_ORIGIN"
            self.ca_var = "VELOX_UPSTREAM_CA_FILE (or SSL_CERT_FILE)"
            self.protocol_var = "VELOX_UPSTREAM_PROTOCOL"
            self.warmup_var = "VELOX_UPSTREAM_WARMUP_PATH"
            self.key_var = "VELOX_UPSTREAM_API_KEY (or OPENAI_API_KEY)"

    def name(self, check: str) -> str:
        return check + self.suffix

    @property
    def first_protocol(self) -> str:
        """What the pool tries first, as egress decides it: "h2" or "http1"."""
        if self.settings.egress == "http1" or self.spec.protocol == "http1":
            return "http1"
        if self.spec.protocol == "h2":
            return "h2"
        return "h2" if self.spec.scheme == "https" else "http1"

    def resolve(self) -> Result:
        name = self.name("upstream-dns")
        try:
            infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            return _fail(name, f"{self.host} does not resolve: {exc.strerror}",
                         f"check {self.origin_var} and this machine's DNS")
        addresses = sorted({str(info[4][0]) for info in infos})
        return _pass(name, f"{self.host} resolves to {', '.join(addresses[:4])}")

    def connect(self) -> Result:
        name = self.name("upstream-connect")
        started = time.monotonic()
        try:
            self.sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            if isinstance(exc, TimeoutError):
                reason = f"no answer within {self.timeout:g} s"
            return _fail(name, f"cannot connect to {self.host}:{self.port}: {reason}",
                         f"check that the upstream runs and {self.origin_var}'s host and port "
                         "are right (and no firewall is in between)")
        ms = (time.monotonic() - started) * 1000
        return _pass(name, f"TCP connection to {self.host}:{self.port} in {ms:.0f} ms")

    def tls(self) -> Result:
        from velox.egress.pool import ssl_context

        name = self.name("upstream-tls")
        spec = self.spec
        alpn = ["h2"] if spec.protocol == "h2" else (
            ["http/1.1"] if self.first_protocol == "http1" else ["h2", "http/1.1"])
        assert self.sock is not None
        try:
            ctx = ssl_context((spec.ca_file, self.settings.ssl_cert_file), alpn)
            self.sock = ctx.wrap_socket(self.sock, server_hostname=self.host)
        except ssl.SSLCertVerificationError as exc:
            return _fail(name, f"the upstream's certificate is not trusted: "
                         f"{exc.verify_message}",
                         f"set {self.ca_var} to the PEM bundle of the CA that signed it")
        except (ssl.SSLError, OSError) as exc:
            return _fail(name, f"TLS handshake with {self.host} failed: {exc}",
                         f"check that {self.origin_var}'s port speaks TLS (or use http://)")
        assert isinstance(self.sock, ssl.SSLSocket)
        self.alpn = self.sock.selected_alpn_protocol()
        cas = "system CAs" + (f" + {spec.ca_file}" if spec.ca_file else "")
        return _pass(name, f"{self.sock.version()} handshake, certificate verified ({cas})")

    def protocol(self) -> Result:
        name = self.name("upstream-h2")
        if self.spec.scheme == "http":
            proto = "h2c (prior knowledge)" if self.first_protocol == "h2" else "HTTP/1.1"
            return _pass(name, f"plain http:// origin: Velox speaks {proto}")
        if self.alpn == "h2":
            return _pass(name, "ALPN negotiated h2: requests are multiplexed")
        if self.spec.protocol == "h2":
            return _fail(name, f"ALPN did not pick h2 (got {self.alpn!r}) but {self.protocol_var}"
                         " is h2", f"set {self.protocol_var} to auto to allow HTTP/1.1")
        return _pass(name, f"no h2 from ALPN (got {self.alpn or 'nothing'}): Velox "
                     "falls back to HTTP/1.1 keep-alive connections")

    def warmup(self) -> Result:
        name = self.name("upstream-warmup")
        spec = self.spec
        path = spec.warmup_path
        headers = [(b"user-agent", b"velox-doctor"), *spec.auth_headers()]
        started = time.monotonic()
        try:
            if self.alpn == "h2" or (spec.scheme == "http" and self.first_protocol == "h2"):
                status = self._get_h2(path.encode(), headers)
            else:
                status = self._get_h1(path.encode(), headers)
        except (OSError, ValueError, RuntimeError) as exc:
            return _fail(name, f"GET {path} got no HTTP answer: {exc}",
                         f"check that the upstream is an HTTP server and {self.warmup_var} "
                         "exists on it")
        ms = (time.monotonic() - started) * 1000
        if status in (401, 403) and spec.kind == "bedrock":
            return _pass(name, f"GET {path} answered {status} in {ms:.0f} ms (the upstream is "
                         "reachable; the probe is not signed, model calls are)")
        if status in (401, 403):
            what = ("no key is configured" if not spec.api_key
                    else "the configured key was refused")
            return _fail(name, f"GET {path} answered {status}: {what}",
                         f"set {self.key_var} to a valid key")
        return _pass(name, f"GET {path} answered {status} in {ms:.0f} ms "
                     "(the upstream is reachable)")

    def translator(self) -> Result:
        """A translated kind: its translator is made as the gateway makes it (for bedrock,
        botocore's signer with the credentials the variables hold)."""
        name = self.name("upstream-kind")
        spec = self.spec
        try:
            translator_for(spec)
        except (ImportError, ValueError) as exc:
            return _fail(name, f"kind = {spec.kind!r}: {exc}",
                         "pip install 'velox[bedrock]'" if isinstance(exc, ImportError)
                         else f"check the settings of {self.warmup_var.split(' of ', 1)[-1]}")
        detail = {"anthropic": f"anthropic-version {spec.anthropic_version}, max_tokens "
                               f"{spec.default_max_tokens} when the client sends none",
                  "gemini": "x-goog-api-key header (never in the query)",
                  "bedrock": f"SigV4 for region {spec.aws_region}, host {spec.authority}"}
        return _pass(name, f"kind = {spec.kind!r}: OpenAI requests are translated "
                     f"({detail[spec.kind]})")

    def _get_h1(self, path: bytes, headers: list[tuple[bytes, bytes]]) -> int:
        assert self.sock is not None
        lines = [b"GET %s HTTP/1.1" % path,
                 b"host: " + self.spec.authority.encode(), b"connection: close"]
        lines += [name + b": " + value for name, value in headers]
        self.sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n")
        data = b""
        while b"\r\n" not in data:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise RuntimeError("the connection closed before a status line")
            data += chunk
        parts = data.split(b"\r\n", 1)[0].split()
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
            raise RuntimeError(f"not an HTTP status line: {parts[:3]!r}")
        return int(parts[1])

    def _get_h2(self, path: bytes, headers: list[tuple[bytes, bytes]]) -> int:
        from velox.egress import codec as ev
        from velox.egress.framer import Framer

        assert self.sock is not None
        codec = Framer(self.spec.authority.encode(), self.spec.scheme.encode())
        codec.initiate()
        stream_id = codec.send_request(b"GET", path, headers, None)
        self.sock.sendall(codec.data_to_send())
        while True:
            data = self.sock.recv(65536)
            if not data:
                raise RuntimeError("the connection closed before the response")
            events = codec.receive_data(data)
            pending = codec.data_to_send()  # SETTINGS acks, PING answers
            if pending:
                self.sock.sendall(pending)
            for event in events:
                if event[0] == ev.RESPONSE and event[1] == stream_id:
                    return int(event[2])
                if event[0] == ev.RESET and event[1] == stream_id:
                    raise RuntimeError(f"the upstream reset the stream (code {event[2]})")
                if event[0] == ev.GOAWAY:
                    raise RuntimeError(f"the upstream sent GOAWAY (code {event[2]})")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


# --- running ------------------------------------------------------------------------------------


def run_checks(settings: Settings) -> list[Result]:
    results = [
        check_port("port", "VELOX_PORT", settings.host, settings.port, ("/readyz",)),
    ]
    endpoint = settings.admin_endpoint
    if endpoint is None:
        results.append(_pass("admin-port", "VELOX_ADMIN_ADDR=off: no admin server"))
    else:
        from velox.admin.server import bind_problem

        problem = bind_problem(settings)
        if problem is not None:
            results.append(_fail("admin-port", problem.split("; set")[0],
                                 "set VELOX_ADMIN_TOKEN to a secret, or bind 127.0.0.1"))
        else:
            token = settings.admin_token
            headers = {"Authorization": f"Bearer {token}"} if token else None
            results.append(check_port("admin-port", "VELOX_ADMIN_ADDR", endpoint[0],
                                      endpoint[1], ("/stats",), headers))
    tables = settings.tables
    assert tables is not None
    for spec in tables.upstreams:
        results += check_upstream(settings, spec, tables.source)
    return results


def check_upstream(settings: Settings, spec: UpstreamSpec, source: str) -> list[Result]:
    """The checks of one upstream in order; after a failure the rest are skipped."""
    upstream = _Upstream(settings, spec, source)
    steps: list[tuple[str, Callable[[], Result]]] = [
        ("upstream-dns", upstream.resolve),
        ("upstream-connect", upstream.connect),
    ]
    if spec.scheme == "https":
        steps.append(("upstream-tls", upstream.tls))
    steps += [("upstream-h2", upstream.protocol), ("upstream-warmup", upstream.warmup)]
    if spec.kind in TRANSLATED_KINDS:
        steps.insert(0, ("upstream-kind", upstream.translator))
    results: list[Result] = []
    try:
        failed = False
        for check, step in steps:
            if failed:
                results.append(Result(upstream.name(check), "SKIP",
                                      "skipped: an earlier check of this upstream failed"))
                continue
            result = step()
            results.append(result)
            failed = result.status == "FAIL"
    finally:
        upstream.close()
    return results


def main(out: TextIO | None = None) -> int:
    out = out or sys.stdout
    try:
        settings = load()
    except ConfigError as exc:  # its fix names the variable, or file, table and key
        _print(out, _fail("config", str(exc), exc.fix))
        return 1
    for warning in settings.warnings:  # a misspelt VELOX_* variable: not a failure
        _print(out, Result("config", "WARN", warning))
    tables = settings.tables
    if tables is not None and tables.source:
        where = (f"{len(tables.upstreams)} upstream(s) "
                 f"({', '.join(u.name for u in tables.upstreams)}) and {len(tables.routes)} "
                 f"route(s) from {tables.source}")
    else:
        where = f"upstream {settings.upstream_origin}"
    _print(out, _pass("config", f"settings load: {settings.workers} worker(s), {where}, "
                      f"egress {settings.egress}"))
    results = run_checks(settings)
    for result in results:
        _print(out, result)
    failures = sum(1 for r in results if r.status == "FAIL")
    passed = 1 + sum(1 for r in results if r.status == "PASS")
    total = len(results) + 1
    print(f"{failures} check(s) failed, {passed} of {total} passed" if failures
          else f"all {total} checks passed", file=out)
    return 1 if failures else 0


def _print(out: TextIO, result: Result) -> None:
    print(f"{result.status}  {result.name:<17} {result.detail}", file=out)
    if result.fix:
        print(f"      {'':<17} → {result.fix}", file=out)

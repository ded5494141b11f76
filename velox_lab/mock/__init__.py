"""Bundled mock upstream: a local stand-in for api.openai.com over HTTP/2 + TLS (and HTTP/1.1).

`MockUpstream` runs `python -m velox_lab.mock` as a real subprocess on a real port and talks to its
control endpoints (`/_mock/stats`, `/_mock/requests`, `/_mock/reset`) over plain HTTP/1.1:

    with MockUpstream(latency_ms=5) as mock:
        client = OpenAI(base_url=mock.origin + "/v1", ...)   # trust mock.ca_file
        ...
        assert mock.stats()["requests"] == 1

Importing this package is cheap: the server modules load only in the subprocess.

Quick reference (details in the module docstrings):

* Ready line (stdout, one JSON line): `{"event": "ready", "origin": "https://127.0.0.1:PORT",
  "port": PORT, "ca_file": PATH_OR_NULL, "pid": PID, "workers": N, "alpn": [...],
  "name": NAME}`.
* API: GET /v1/models[/ID], POST /v1/chat/completions, /v1/completions, /v1/embeddings,
  /v1/responses (`"stream": true` gives SSE); anything else is a 404 with an OpenAI-shaped
  error body; malformed JSON or a missing `model` is a 400.
* Azure OpenAI: POST /openai/deployments/{d}/chat/completions, /completions, /embeddings,
  /openai/responses, GET /openai/models, each needing an `api-key` header (401 otherwise) and
  an `api-version` query parameter (404 otherwise), with Azure's error body.
* Embeddings: each input's vector is a deterministic function of the input
  (`payloads.embedding_vector`), `index` per input, usage.prompt_tokens ~ input length / 4
  (additive per input). A call with an empty input ("" or []) is refused as a whole with
  OpenAI's 400 (`param` "input"), as OpenAI does.
* Per-request control headers: `x-mock-latency-ms`, `x-mock-latency-per-input-us`
  (embeddings: added per input item), `x-mock-status` (200-599, error body for >= 400,
  `retry-after: 1` on 429), `x-mock-chunks`, `x-mock-chunk-delay-ms`, `x-mock-fault`
  (reset, reset-mid-stream, goaway, close, hang, slow-body). Invalid values answer 400 with
  error code `mock_control`.
* `POST /_mock/behaviour?status=503&latency-ms=100` (`MockUpstream.behave(...)`): control
  headers applied to every later request that lacks its own; no parameters restores normal.
* `/_mock/stats`, `/_mock/requests?limit=N`, `POST /_mock/reset`: not counted as traffic; a
  connection whose first request is a control call is not counted in `connections` either.
  Each request-log entry names the `instance` that answered and what it received: `path`
  (with the query, as received), `query`, the body's `model`, the Azure `deployment`,
  `auth` (kind + `fingerprint()` of the credential), and `inputs` (an embeddings call's input
  items; 0 for other calls).
"""

from __future__ import annotations

import atexit
import hashlib
import http.client
import json
import os
import selectors
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

__all__ = ["MockUpstream", "fingerprint"]

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding `velox/`
_live: set[MockUpstream] = set()  # started, not yet stopped: stopped at interpreter exit


def fingerprint(secret: str | bytes) -> str:
    """The `auth.key_sha256` the request log shows for a credential (12 hex of its sha256)."""
    raw = secret.encode() if isinstance(secret, str) else secret
    return hashlib.sha256(raw).hexdigest()[:12]


class MockUpstream:
    """Runs `python -m velox_lab.mock` as a subprocess (a real process on a real port)."""

    origin: str
    port: int
    ca_file: str | None
    pid: int

    def __init__(self, *, tls: bool = True, alpn: str = "h2,http/1.1",
                 max_concurrent_streams: int = 1000, latency_ms: int = 0, chunks: int = 8,
                 chunk_delay_ms: int = 0, goaway_after: int = 0, certdir: str | None = None,
                 extra_args: Sequence[str] = (), log_path: str | None = None,
                 name: str = "mock", latency_per_input_us: int = 0) -> None:
        """`log_path`: write the process's stderr there (default: inherit ours); `name`: the
        instance name its request log reports (tests running several mocks tell them apart)."""
        self.tls = tls
        self.log_path = log_path
        self.name = name
        self.args = [
            "--tls" if tls else "--no-tls", "--alpn", alpn,
            "--max-concurrent-streams", str(max_concurrent_streams),
            "--latency-ms", str(latency_ms), "--chunks", str(chunks),
            "--chunk-delay-ms", str(chunk_delay_ms), "--goaway-after", str(goaway_after),
            "--name", name, "--latency-per-input-us", str(latency_per_input_us),
            *(["--certdir", str(certdir)] if certdir else []), *extra_args,
        ]
        self.ready: dict[str, Any] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._ssl: ssl.SSLContext | None = None

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "velox_lab.mock", *self.args]

    def start(self, timeout: float = 20.0) -> MockUpstream:
        """Start the process and wait for its ready line."""
        if self._proc is not None:
            return self
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        env.setdefault("PYTHONUNBUFFERED", "1")
        log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        try:
            self._proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.PIPE, stderr=log, env=env)
        finally:
            if log is not None:
                log.close()  # the child has its own descriptor now
        _live.add(self)
        try:
            line = self._read_ready_line(timeout)
        except BaseException:
            self.stop()
            raise
        self.ready = json.loads(line)
        self.origin = self.ready["origin"]
        self.port = int(self.ready["port"])
        self.ca_file = self.ready.get("ca_file")
        self.pid = int(self.ready["pid"])
        return self

    def _read_ready_line(self, timeout: float) -> str:
        assert self._proc is not None and self._proc.stdout is not None
        deadline = time.monotonic() + timeout
        buf = b""
        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            while b"\n" not in buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"mock upstream not ready after {timeout}s")
                if not sel.select(left):
                    continue
                chunk = os.read(self._proc.stdout.fileno(), 4096)
                if not chunk:
                    code = self._proc.wait(timeout=5)
                    raise RuntimeError(f"mock upstream exited with status {code} before "
                                       "becoming ready")
                buf += chunk
        return buf.split(b"\n", 1)[0].decode()

    # -- control endpoints ----------------------------------------------------------------

    def _call(self, method: str, path: str) -> Any:
        host = urlsplit(self.origin).hostname or "127.0.0.1"
        if host in ("0.0.0.0", "::"):  # a wildcard bind is reached over loopback
            host = "127.0.0.1" if host == "0.0.0.0" else "::1"
        if self.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context(cafile=self.ca_file)
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, self.port, context=self._ssl, timeout=10)
        else:
            conn = http.client.HTTPConnection(host, self.port, timeout=10)
        try:
            conn.request(method, path, headers={"connection": "close"})
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{method} {path}: HTTP {resp.status}: {body[:200]!r}")
            return json.loads(body)
        finally:
            conn.close()

    def stats(self) -> dict:
        return self._call("GET", "/_mock/stats")

    def requests(self, limit: int = 100) -> list[dict]:
        return self._call("GET", f"/_mock/requests?limit={int(limit)}")

    def reset(self) -> None:
        self._call("POST", "/_mock/reset")

    def behave(self, **controls: object) -> dict:
        """Apply control headers to every later request: behave(status=503), behave(
        latency_ms=200), behave(fault="hang"); behave() restores normal answers."""
        from urllib.parse import urlencode

        query = urlencode({k.replace("_", "-"): str(v) for k, v in controls.items()})
        return self._call("POST", "/_mock/behaviour" + (f"?{query}" if query else ""))

    # -- lifecycle ------------------------------------------------------------------------

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM, wait, SIGKILL if needed; returns the exit status."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        _live.discard(self)
        try:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=timeout)
        finally:
            if proc.stdout is not None:
                proc.stdout.close()
        self.returncode = proc.returncode
        return proc.returncode

    def __enter__(self) -> MockUpstream:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_text(self) -> str:
        """What the process wrote to `log_path` so far ('' without one)."""
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, encoding="utf-8", errors="replace") as fh:
            return fh.read()


@atexit.register
def _stop_leftovers() -> None:
    for mock in list(_live):
        mock.stop(timeout=2.0)

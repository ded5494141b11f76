"""A real gateway whose stdout is a pipe nobody reads: it keeps answering (every SDK request
200), the access log holds lines up to VELOX_ACCESS_LOG_BUFFER_BYTES and then drops and counts
them (velox_access_log_dropped_lines_total); once the pipe is read again the lines flow; and a
SIGTERM writes what is held before the worker exits."""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import threading
from pathlib import Path

import orjson

from tests.e2e.conftest import client_for, gateway_env, wait_for
from velox_lab.launch import GatewayProcess
from velox_lab.mock import MockUpstream

_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_HELD = 16384


class PipeReader:
    """Reads the gateway's stdout on a thread while not paused; keeps the access lines."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.lines: list[dict[str, object]] = []
        self.reading = threading.Event()
        self.eof = threading.Event()
        self._lock = threading.Lock()  # held by each read: pause() waits for the one under way
        self._partial = b""
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            if not self.reading.wait(0.05):
                continue
            with self._lock:
                if not self.reading.is_set() or \
                        not select.select([self.fd], [], [], 0.05)[0]:
                    continue
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    self.eof.set()
                    return
                data = self._partial + chunk
                *whole, self._partial = data.split(b"\n")
                for line in whole:
                    record = orjson.loads(line)  # every line whole: never cut or interleaved
                    if record.get("log") == "access":
                        self.lines.append(record)

    def pause(self) -> None:
        """Stop reading; returns once no read is under way."""
        self.reading.clear()
        with self._lock:
            pass

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def _metric(gw: GatewayProcess, name: str) -> int:
    status, body = gw.admin_get("/metrics")
    assert status == 200
    return int(sum(float(v) for v in re.findall(
        rb"^" + name.encode() + rb"\{[^}]*\} ([0-9.e+]+)$", body, re.M)))


def test_a_stdout_nobody_reads_never_stalls_and_drops_are_counted(
        upstream: MockUpstream, tmp_path: Path) -> None:
    r, w = os.pipe()
    fcntl.fcntl(w, _F_SETPIPE_SZ, 4096)  # one page: a dozen lines fill it
    gw = GatewayProcess(gateway_env(upstream, VELOX_WORKERS="1",
                                    VELOX_ACCESS_LOG_BUFFER_BYTES=str(_HELD)),
                        log_path=tmp_path / "velox.log", stdout=w)
    reader: PipeReader | None = None
    try:
        gw.start()
        os.close(w)
        w = -1
        client = client_for(gw)

        def ask(n: int) -> None:
            for _ in range(n):
                answer = client.chat.completions.create(
                    model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
                assert answer.choices[0].message.content

        # Nobody reads: the gateway keeps answering; past the bound lines are dropped, counted.
        sent = 0
        while _metric(gw, "velox_access_log_dropped_lines_total") == 0:
            assert sent < 2000, "no line was dropped with stdout unread"
            ask(20)  # the SDK raises on anything but a 200
            sent += 20
        # The pipe is read again: what was held comes out, then new lines follow as they are
        # made (once every line is written or dropped, the drop count cannot move any more).
        reader = PipeReader(r)
        reader.reading.set()
        # Every request is logged, the start-up's /readyz probes too: velox_requests_total.
        total = _metric(gw, "velox_requests_total")
        wait_for(lambda: _metric(gw, "velox_access_log_lines_total") +
                 _metric(gw, "velox_access_log_dropped_lines_total") == total)
        dropped = _metric(gw, "velox_access_log_dropped_lines_total")
        assert dropped > 0
        wait_for(lambda: len(reader.lines) == total - dropped)  # type: ignore[union-attr]
        ask(10)
        total += 10
        wait_for(lambda: len(reader.lines) == total - dropped)  # type: ignore[union-attr]
        assert reader.lines[-1]["path"] == "/v1/chat/completions"
        assert all(line["status"] == 200 for line in reader.lines
                   if line["path"] == "/v1/chat/completions")
        # Unread again, with fewer lines than pipe plus bound: at SIGTERM some are held, not
        # yet written; the worker writes them before it exits (none dropped).
        reader.pause()
        ask(30)  # ~10 KB of lines: more than the pipe's 4 KiB, less than it and the bound
        total += 30
        wait_for(lambda: _metric(gw, "velox_requests_total") == total)
        assert _metric(gw, "velox_access_log_lines_total") < total - dropped
        gw.signal(signal.SIGTERM)
        reader.reading.set()
        assert gw.wait(30) == 0
        assert reader.eof.wait(10)  # every writer of the pipe has exited
        assert len(reader.lines) == total - dropped
    finally:
        gw.stop()
        if reader is not None:
            reader.reading.set()
            reader.join(5)
        os.close(r)
        if w >= 0:
            os.close(w)

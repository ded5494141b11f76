"""The access log: one JSON line per request on stdout, written off the hot path.

The worker's hot path only appends a 5-tuple to a deque (`AccessLog.append`, a C call with no
lock and no thread wake-up); a thread of the worker wakes every `FLUSH_INTERVAL_S`, formats what
has accumulated with orjson and writes it. Waking on a timer rather than per line matters: a
wake-up per request would hand the GIL back and forth on every response.

A line: `{"time", "log": "access", "worker", "method", "path", "model", "status", "bytes_in",
"bytes_out", "upstream_us", "total_us", "request_id", "key"}`. `key` is the name of the
caller's `[[key]]` (null for none), never the key itself. `path` has its query string removed:
the gateway forwards arbitrary /v1/... URLs and cannot know which query parameters carry
credentials or personal data (some clients put keys there), so none are logged. Request
headers and bodies are never read, so keys cannot leak. `request_id` is the upstream's
`x-request-id` (what its support asks for), else one made here. `upstream_us` is the time to
the upstream's response headers (null when the gateway answered alone); `total_us` runs from
the request's last byte to the response's last byte, streams included.

Writes hold whole lines and at most PIPE_BUF bytes, so lines from several workers sharing one
stdout pipe never interleave mid-line. If stdout blocks, the deque keeps the newest
`QUEUE_MAX` lines and drops the oldest; `F.ACCESS_LOG_LINES` counts what was written, so
`requests - lines` is what was dropped.

Imports: stats (field numbers), stdlib, orjson.
"""

from __future__ import annotations

import os
import secrets
import select
import threading
import time
from collections import deque
from typing import Any

import orjson

from velox.stats import F

FLUSH_INTERVAL_S = 0.05
QUEUE_MAX = 65_536
_PIPE_BUF = getattr(select, "PIPE_BUF", 512)
_MAX_FIELD = 512  # longest path/model/request id kept: a log line must stay small
# Distinct raw paths (query strings included) whose decoded form is remembered. Clients that
# put ids or queries in paths make many; past this many, paths are simply decoded each time.
_PATH_CACHE = 1024
_APPEND_NEWLINE = orjson.OPT_APPEND_NEWLINE


class AccessLog:
    """Per worker. `append((t_end_ns, request, exchange_or_None, status, bytes_out))`."""

    def __init__(self, slot: int, counters: Any = None, fd: int = 1,
                 key_names: tuple[str, ...] = ()) -> None:
        self.slot = slot
        self.key_names = key_names  # [[key]] names by index (request.key)
        self.counters = counters
        self.fd = fd
        self.queue: deque[tuple[Any, ...]] = deque(maxlen=QUEUE_MAX)
        self.append = self.queue.append
        self.written = 0
        self._prefix = f"velox-{slot}-{secrets.token_hex(4)}-"
        self._seq = 0
        self._second = -1
        self._second_text = ""
        self._millisecond = -1
        self._time_text = ""
        self._paths: dict[bytes, str] = {}
        self._methods = {m.encode(): m for m in ("GET", "POST", "HEAD", "PUT", "DELETE", "PATCH",
                                                  "OPTIONS")}
        self._stop = threading.Event()
        self._flush_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="velox-access-log", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread after a last flush (the worker calls this after draining)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.flush()

    def _run(self) -> None:
        while not self._stop.wait(FLUSH_INTERVAL_S):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the log must never take the worker down
                pass

    def flush(self) -> int:
        """Format and write every queued line; return how many."""
        with self._flush_lock:
            queue = self.queue
            if not queue:
                return 0
            # One clock pair per flush turns each line's perf_counter_ns into wall time, so the
            # hot path never reads the wall clock.
            wall_ns, perf_ns = time.time_ns(), time.perf_counter_ns()
            fd, line = self.fd, self.line
            chunk: list[bytes] = []
            size = count = 0
            while queue:
                try:
                    item = queue.popleft()
                except IndexError:
                    break
                data = line(item, wall_ns - perf_ns)
                if size + len(data) > _PIPE_BUF and chunk:
                    _write_all(fd, b"".join(chunk))
                    chunk, size = [], 0
                chunk.append(data)
                size += len(data)
                count += 1
            if chunk:
                _write_all(fd, b"".join(chunk))
            self.written += count
            if self.counters is not None:
                self.counters.add(self.slot, F.ACCESS_LOG_LINES, count)
            return count

    def line(self, item: tuple[Any, ...], wall_offset_ns: int) -> bytes:
        t_end, request, exchange, status, bytes_out = item
        upstream_us = None
        request_id = None
        upstream = None
        attempts = 0
        if exchange is not None:
            name = exchange.upstream_name
            upstream = name.decode() if name else None
            attempts = exchange.attempts
            if exchange.t_headers and exchange.t_sent:
                upstream_us = (exchange.t_headers - exchange.t_sent) // 1000
            for name, value in exchange.headers:
                if name == b"x-request-id":
                    request_id = value[:_MAX_FIELD].decode("latin-1")
                    break
        if request_id is None:
            self._seq += 1
            request_id = f"{self._prefix}{self._seq:x}"
        # Paths and methods repeat endlessly: decode each once (the cache is bounded).
        raw_path = request.path
        path = self._paths.get(raw_path)
        if path is None:
            path = raw_path.split(b"?", 1)[0][:_MAX_FIELD].decode("latin-1")
            if len(self._paths) < _PATH_CACHE:
                self._paths[raw_path] = path
        method = self._methods.get(request.method)
        if method is None:
            method = request.method[:16].decode("latin-1")
        model = request.model
        millisecond = (t_end + wall_offset_ns) // 1_000_000
        if millisecond != self._millisecond:
            self._millisecond = millisecond
            self._time_text = self._timestamp(millisecond)
        return orjson.dumps({
            "time": self._time_text,
            "log": "access",
            "worker": self.slot,
            "method": method,
            "path": path,
            "model": model[:_MAX_FIELD] if model else None,
            "status": status,
            "bytes_in": len(request.body),
            "bytes_out": bytes_out,
            "upstream": upstream,
            "attempts": attempts,
            "upstream_us": upstream_us,
            "total_us": max(0, t_end - request.t_received) // 1000,
            "request_id": request_id,
            "key": self.key_names[request.key] if request.key >= 0 else None,
        }, option=_APPEND_NEWLINE)

    def _timestamp(self, millisecond: int) -> str:
        second, ms = divmod(millisecond, 1000)
        if second != self._second:
            self._second = second
            self._second_text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._second_text}.{ms:03d}Z"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except InterruptedError:
            continue
        except OSError:
            return  # stdout closed: nothing sensible to do with an access line

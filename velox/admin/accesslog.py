"""The access log: one JSON line per request on stdout, written off the hot path.

The worker's hot path only appends a 5-tuple to a deque (`AccessLog.append`, a C call with no
lock and no thread wake-up); a thread of the worker wakes every `FLUSH_INTERVAL_S`, formats what
has accumulated and writes it. Waking on a timer rather than per line matters: a wake-up per
request would hand the GIL back and forth on every response. The formatting is native
(`access_lines`, native/vx_books.h: one call per 1,024 lines reads each request's fields and
writes its JSON, byte for byte what orjson made of the line's dict): about 1.5 us a line
against 6 for the dict through orjson (benches/bench_books.py), so the thread also holds the
GIL ~4x less long per flush.

A line: `{"time", "log": "access", "worker", "method", "path", "model", "status", "bytes_in",
"bytes_out", "upstream_us", "total_us", "request_id", "key", "usage"}`. `key` is the name of
the caller's `[[key]]` (null for none), never the key itself. `usage` is `{"input", "output",
"exact"}` for a model call whose tokens were accounted (velox.relay.usage; exact false: estimated,
the answer carried no usage), else null. `path` has its query string removed:
the gateway forwards arbitrary /v1/... URLs and cannot know which query parameters carry
credentials or personal data (some clients put keys there), so none are logged. Request
headers and bodies are never read, so keys cannot leak. `request_id` is the upstream's
`x-request-id` (what its support asks for), else one made here. `upstream_us` is the time to
the upstream's response headers (null when the gateway answered alone); `total_us` runs from
the request's last byte to the response's last byte, streams included. With pricing on
(VELOX_SPEND) each line ends with `cost_usd` (velox.spend.wire: USD, null when unknown or not a
model call), spliced in by the log thread after the native formatter made the line.

Writes hold whole lines and at most PIPE_BUF bytes, so lines from several workers sharing one
stdout pipe never interleave mid-line. If stdout blocks, the deque keeps the newest
`QUEUE_MAX` lines and drops the oldest; `F.ACCESS_LOG_LINES` counts what was written, so
`requests - lines` is what was dropped.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from velox._native import access_line, access_lines
from velox.core.fields import F

log = logging.getLogger("velox.accesslog")

FLUSH_INTERVAL_S = 0.05
QUEUE_MAX = 65_536
_PIPE_BUF = getattr(select, "PIPE_BUF", 512)
# Longest path/model/request id kept (bytes of path and id, characters of model): a log line
# must stay small. The native formatter (native/vx_books.h) has the same constant.
_MAX_FIELD = 512
_BATCH = 1024  # queued items formatted per native call


class AccessLog:
    """Per worker. `append((t_end_ns, request, exchange_or_None, status, bytes_out))`."""

    def __init__(self, slot: int, counters: Any = None, fd: int = 1,
                 key_names: tuple[str, ...] = (),
                 cost_of: Callable[[Any], bytes] | None = None) -> None:
        self.slot = slot
        # With pricing on (velox.spend.wire.cost_field): each line gains `cost_usd`.
        self.cost_of = cost_of
        self.key_names = key_names  # [[key]] names by index (request.key)
        self.counters = counters
        self.fd = fd
        self.queue: deque[tuple[Any, ...]] = deque(maxlen=QUEUE_MAX)
        self.append = self.queue.append
        self.written = 0
        self._prefix = f"velox-{slot}-{secrets.token_hex(4)}-".encode()
        self._seq = 0
        self._told = False  # why a line could not be formatted was logged (_tell)
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
            except Exception:
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
            fd, slot, prefix, names = self.fd, self.slot, self._prefix, self.key_names
            offset = wall_ns - perf_ns
            popleft = queue.popleft
            count = 0
            # Lines are formatted natively a batch at a time (access_lines: one call, chunks
            # of whole lines up to PIPE_BUF), so a long queue holds few formatted lines at once.
            # The loop only appends: len(queue) items are always there to pop.
            while queue:
                items = [popleft() for _ in range(min(len(queue), _BATCH))]
                if self.cost_of is None:
                    chunks, lines = access_lines(items, offset, slot, prefix, self._seq, names,
                                                 _PIPE_BUF)
                else:
                    chunks, lines = self._priced_lines(items, offset)
                self._seq += len(items)  # item i's request id, when made here: seq + 1 + i
                for chunk in chunks:
                    _write_all(fd, chunk)
                count += lines
                if lines < len(items) and not self._told:
                    self._tell(items, offset)
            self.written += count
            if self.counters is not None:
                self.counters.add(self.slot, F.ACCESS_LOG_LINES, count)
            return count

    def _priced_lines(self, items: list[tuple[Any, ...]],
                      offset: int) -> tuple[list[bytes], int]:
        """access_lines with `"cost_usd"` added as each line's last member (in the log
        thread: the native line is made, then the member spliced before its closing brace),
        joined into chunks of whole lines of at most PIPE_BUF bytes."""
        cost_of = self.cost_of
        assert cost_of is not None
        chunks: list[bytes] = []
        chunk = b""
        lines = 0
        for i, item in enumerate(items):
            try:
                line = access_line(item, offset, self.slot, self._prefix, self._seq + 1 + i,
                                   self.key_names)
            except Exception:
                continue
            line = line[:-2] + b',"cost_usd":' + cost_of(item[2]) + b"}\n"
            lines += 1
            if chunk and len(chunk) + len(line) > _PIPE_BUF:
                chunks.append(chunk)
                chunk = b""
            chunk += line
        if chunk:
            chunks.append(chunk)
        return chunks, lines

    def _tell(self, items: list[tuple[Any, ...]], offset: int) -> None:
        """Log, once per worker, why a line could not be formatted (access_lines skips such an
        item so the others are written; F.ACCESS_LOG_LINES shows how many went missing)."""
        self._told = True
        for item in items:
            try:
                access_line(item, offset, self.slot, self._prefix, 0, self.key_names)
            except Exception:
                log.exception("access log: a line could not be formatted (more are not told)")
                return

    def line(self, item: tuple[Any, ...], wall_offset_ns: int) -> bytes:
        """One line (see the module docstring), formatted natively (vx_books): the request's
        and exchange's fields read and written as JSON in one call, exactly the bytes orjson
        makes of the line's dict (tests/unit/test_books.py), about 5x cheaper."""
        self._seq += 1  # the request id made here when the upstream gave none
        return access_line(item, wall_offset_ns, self.slot, self._prefix, self._seq,
                           self.key_names)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except InterruptedError:
            continue
        except OSError:
            return  # stdout closed: nothing sensible to do with an access line

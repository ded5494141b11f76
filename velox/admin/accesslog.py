"""The access log: one JSON line per request on stdout, written from the worker's loop.

When a request ends, the worker hands its item (`AccessLog.append`) and the log writes its line
at once, or, when its meter has not settled yet (it settles right after, when the exchange
ends: `AccessLog.done`), as soon as it has. The line is written by C straight into the worker's
buffer (`AccessBook`, native/bind_books.c: the request's fields passed as one call's arguments,
velox.relay.records.log_fields; the JSON byte for byte what orjson made of the line's dict,
`cost_usd` included), so nothing of a request outlives its end: holding each request and its
exchange until the flush kept thousands of live objects for the cyclic GC to walk (at 64
connections: ~1,500 gen-0 and ~130 gen-1 collections per worker in 8 s against ~60 and 6
without the log), and a record tuple per request, queued, then formatted into a bytes object
per line, cost ~0.5 us more a request than this (benches/bench_books.py). Every
`FLUSH_INTERVAL_S` a timer on the worker's own event loop takes what the buffer holds as chunks
of whole lines and writes them with a non-blocking write: a few hundred lines a flush at one
connection, thousands at 64, so one write call per chunk of lines and never one per request.
The timer is armed by the first line after a flush and re-armed only while something is left
(lines held, items waiting for their meter): an idle worker's log never wakes its loop, where
a timer always armed woke it 20 times a second for nothing.
No thread: a log thread cost a GIL hand-off per flush and, sharing the worker's pinned core, a
context switch in the middle of the loop's work.

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
(VELOX_SPEND) each line ends with `cost_usd` (the meter's price in USD, null when unknown or
not a model call).

Writes to a pipe, terminal or socket hold whole lines and at most PIPE_BUF bytes, so lines from
several workers sharing one stdout pipe never interleave mid-line (a pipe takes such a write
whole or not at all). A regular file or /dev/null needs no such bound (a write to a file shares
its offset under the kernel's lock, so writes do not interleave either): up to 64 KiB a write,
~190 lines, where PIPE_BUF takes 12.

When stdout would block (a pipe nobody reads, a stopped terminal), formatted lines are held, up
to VELOX_ACCESS_LOG_BUFFER_BYTES per worker (1 MiB: about 3,000 lines; the lines made since the
last flush count against it too), and written in order as soon as the reader takes bytes
again (a partial write resumes where it stopped). Past that bound new lines are dropped, never
waited for, and counted: F.ACCESS_LOG_DROPPED
(velox_access_log_dropped_lines_total). A worker stopping (SIGTERM) writes what it holds,
waiting for a reader at most `close`'s timeout. Non-blocking without touching the descriptor
other processes share (O_NONBLOCK on it would make the supervisor's and other workers' writes
fail with EAGAIN): a pipe, FIFO or terminal is opened again through /proc/self/fd with
O_NONBLOCK, its own file description; a socket (systemd's journal) is written with
MSG_DONTWAIT; a regular file never blocks and is written as it is.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import select
import socket
import stat
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

from velox._native import AccessBook, access_line
from velox.admin import twins
from velox.core.fields import F
from velox.relay.records import LogItem, access_record, log_fields

log = logging.getLogger("velox.accesslog")

FLUSH_INTERVAL_S = 0.05
# Lines held while stdout blocks (VELOX_ACCESS_LOG_BUFFER_BYTES' default): ~3,000 lines of
# ~350 bytes, a second and a half of one worker's log at 2,000 requests/s.
HELD_MAX_BYTES = 1 << 20
_PIPE_BUF = getattr(select, "PIPE_BUF", 512)
_FILE_CHUNK = 1 << 16  # bytes a write to a regular file or /dev/null (no atomicity to keep)
# Longest path/model/request id kept (bytes of path and id, characters of model): a log line
# must stay small. The native formatter (native/bind_books.c) has the same constant.
_MAX_FIELD = 512


class AccessLog:
    """Per worker. `append((t_end_ns, request, exchange_or_None, status, bytes_out))` when a
    request ends; `done(exchange)` when an exchange has ended (its meter settled)."""

    def __init__(self, slot: int, counters: Any = None, fd: int = 1,
                 key_names: tuple[str, ...] = (), priced: bool = False,
                 held_max: int = HELD_MAX_BYTES, native: bool = True) -> None:
        self.slot = slot
        # With pricing on (velox.spend): each line gains `cost_usd`.
        self.priced = priced
        self.counters = counters
        self.fd = fd
        self._prefix = f"velox-{slot}-{secrets.token_hex(4)}-".encode()
        # The lines made since the last flush, in C's buffer (len: how many). Bounded by the
        # room the held chunks leave (set by each flush): past it lines are dropped, counted.
        # VELOX_NATIVE=0: the Python twins (velox.admin.twins), the same bytes through orjson.
        self._book: AccessBook | twins.AccessBook = \
            (AccessBook if native else twins.AccessBook)(slot, self._prefix, key_names, priced,
                                                         held_max)
        self._line = access_line if native else twins.access_line
        self._book.wall_offset = time.time_ns() - time.perf_counter_ns()
        self._add = self._book.add
        # Items whose meter had not settled when their request ended, by id of their holder
        # (the item keeps it alive): made into records by `done`, or by the second flush
        # after they came (a holder that is never `done`), reading what is there then.
        self.waiting: dict[int, LogItem] = {}
        self.stale: dict[int, LogItem] = {}
        self.written = 0
        self.dropped = 0
        # Formatted chunks (whole lines, at most PIPE_BUF bytes each unless one line is
        # longer) not yet written, with their line counts; `_sent` bytes of the first went.
        self.held: deque[tuple[bytes, int]] = deque()
        self.held_bytes = 0
        self.held_max = held_max
        self._sent = 0
        self._out = _Out(fd)
        self._chunk = self._out.chunk
        self._seq = 0  # line()'s request ids
        self._told = False  # why a line could not be formatted was logged (_tell)
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def queue(self) -> AccessBook | twins.AccessBook:
        """The lines made and not yet taken by a flush (len: how many)."""
        return self._book

    @property
    def key_names(self) -> tuple[str, ...]:
        """[[key]] names by index (request.key); the worker publishes longer ones."""
        return self._book.key_names

    @key_names.setter
    def key_names(self, names: tuple[str, ...]) -> None:
        self._book.key_names = names

    def append(self, item: LogItem) -> None:
        """A request ended: its line now, or once its meter has settled (`done`)."""
        if self._timer is None:
            self._arm()
        holder = item[2]
        if holder is not None:
            try:
                meter = holder.meter
                # A done meter's tokens are final; its price may still be set when its
                # exchange ends (an answer priced at finish): a priced line waits for that.
                settled = meter is None or (meter.done and not self.priced)
            except Exception:  # _tell says what is missing
                settled = True
            if not settled:
                waiting, key = self.waiting, id(holder)
                earlier = waiting.setdefault(key, item)  # one dict operation as a rule
                if earlier is not item:  # one holder, two requests: the first as it stands
                    self._make(earlier)
                    waiting[key] = item
                return
        try:  # the hot path calls log_fields itself: a frame less a request
            log_fields(self._add, item)
        except Exception:
            self._tell()

    def done(self, holder: object) -> None:
        """`holder` (an exchange) has ended, its meter settled: the line of the request it
        answered, if that one is waiting."""
        item = self.waiting.pop(id(holder), None)
        if item is None:
            if not self.stale:
                return
            item = self.stale.pop(id(holder), None)
            if item is None:
                return
        if self._timer is None:
            self._arm()
        try:
            log_fields(self._add, item)
        except Exception:
            self._tell()

    def _make(self, item: LogItem) -> None:
        try:
            log_fields(self._add, item)
        except Exception:
            self._tell()

    def _tell(self) -> None:
        """A holder or meter lacking a field: its line is skipped, the reason logged once per
        worker (F.ACCESS_LOG_LINES shows how many went missing)."""
        if not self._told:
            self._told = True
            log.exception("access log: a line could not be formatted (more are not told)")

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Flush from `loop` (the worker's) FLUSH_INTERVAL_S after a line comes, until
        `close`."""
        self._loop = loop

    def _arm(self) -> None:
        """The first line since the last flush: flush FLUSH_INTERVAL_S from now. After an
        idle spell the clock pair is stale (NTP may have slewed the wall clock meanwhile):
        take a fresh one before this line is formatted with it."""
        loop = self._loop
        if loop is not None:
            self._timer = loop.call_later(FLUSH_INTERVAL_S, self._tick)
            self._book.wall_offset = time.time_ns() - time.perf_counter_ns()

    def _tick(self) -> None:
        self._timer = None
        if self.counters is not None:
            self.counters.add(self.slot, F.TIMER_WAKES, 1)
        try:
            self.flush()
        except Exception:  # a log that cannot be written must not stop the next flushes
            log.exception("access log: flush failed")
        finally:
            # Lines still held (stdout blocked) or items waiting for their meter: flush
            # again; else sleep until the next line arms the timer.
            if self.held or self.waiting or self.stale or len(self._book):
                self._arm()

    def close(self, timeout: float = 2.0) -> None:
        """Stop the timer, then write everything queued and held, waiting for stdout at most
        `timeout` seconds (the worker calls this after draining); what is still held then is
        dropped and counted."""
        self._loop = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for waiting in (self.stale, self.waiting):  # what their meters say now
            for item in waiting.values():
                self._make(item)
            waiting.clear()
        self.flush()
        deadline = time.monotonic() + timeout
        while self.held:
            left = deadline - time.monotonic()
            if left <= 0 or not self._out.wait_writable(left):
                break
            self._count(self._write(), 0)
        if self.held:
            self._count(0, self._drop_held())
        self._out.close()

    def flush(self) -> int:
        """Format every queued line and write what stdout takes now; return how many lines
        were written."""
        written = self._write() if self.held else 0  # room first, so fewer lines are dropped
        stale = self.stale
        if stale:  # waited a whole interval: what their meter says now
            for item in stale.values():
                self._make(item)
            stale.clear()
        self.stale, self.waiting = self.waiting, stale
        book = self._book
        dropped = self._format() if book.size or book.dropped else 0
        if self.held:
            written += self._write()
        self._count(written, dropped)
        # The next lines' room and clock: one clock pair per flush turns each line's
        # perf_counter_ns into wall time, so the hot path never reads the wall clock.
        book.room = max(0, self.held_max - self.held_bytes)
        book.wall_offset = time.time_ns() - time.perf_counter_ns()
        return written

    def _count(self, written: int, dropped: int) -> None:
        self.written += written
        self.dropped += dropped
        counters = self.counters
        if counters is not None:
            if written:
                counters.add(self.slot, F.ACCESS_LOG_LINES, written)
            if dropped:
                counters.add(self.slot, F.ACCESS_LOG_DROPPED, dropped)

    def _format(self) -> int:
        """The book's lines into held chunks (whole lines, at most the output's chunk size
        each); returns the lines the book dropped for want of room."""
        size = self._book.size
        chunks, dropped = self._book.take(self._chunk)
        self.held.extend(chunks)
        self.held_bytes += size
        return dropped

    def _write(self) -> int:
        """Write held chunks until stdout would block; returns the lines written whole."""
        held, write = self.held, self._out.write
        written = 0
        while held:
            chunk, lines = held[0]
            sent = self._sent
            try:
                n = write(memoryview(chunk)[sent:] if sent else chunk)
            except BlockingIOError:
                break
            except OSError:  # stdout closed: nothing sensible to do with an access line
                self._count(0, self._drop_held())
                break
            self.held_bytes -= n
            if sent + n < len(chunk):  # partial: the reader took what it had room for
                self._sent = sent + n
                break
            held.popleft()
            self._sent = 0
            written += lines
        return written

    def _drop_held(self) -> int:
        lines = sum(n for _, n in self.held)
        self.held.clear()
        self.held_bytes = 0
        self._sent = 0
        return lines

    def line(self, item: LogItem, wall_offset_ns: int) -> bytes:
        """One line (see the module docstring), formatted natively (vx_books) from the item's
        record: exactly the bytes orjson makes of the line's dict (tests/unit/test_books.py),
        about 5x cheaper. The tests' form: the log itself writes into its book."""
        self._seq += 1  # the request id made here when the upstream gave none
        return self._line(access_record(item), wall_offset_ns, self.slot, self._prefix,
                          self._seq, self.key_names, self.priced)



class _Out:
    """stdout (or `fd`) written without blocking and without changing its file description,
    which the supervisor and the other workers share (see the module docstring)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.own: int | None = None  # a descriptor opened here, closed by close()
        self.sock: socket.socket | None = None
        self.write: Callable[[Any], int] = partial(os.write, fd)
        # Bytes of lines a write may hold: PIPE_BUF where several writers' lines could
        # interleave (a pipe, a terminal, a socket), more to a regular file or /dev/null.
        self.chunk = _PIPE_BUF
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            return  # closed: writes fail and lines are dropped and counted
        if stat.S_ISREG(mode) or (stat.S_ISCHR(mode) and not os.isatty(fd)):
            self.chunk = _FILE_CHUNK
        elif stat.S_ISSOCK(mode):
            self.sock = socket.socket(fileno=os.dup(fd))
            send = self.sock.send
            self.write = lambda data: send(data, socket.MSG_DONTWAIT)
        elif stat.S_ISFIFO(mode) or (stat.S_ISCHR(mode) and os.isatty(fd)):
            try:
                self.own = os.open(f"/proc/self/fd/{fd}",
                                   os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:  # no /proc, or the pipe has no reader: blocking writes
                log.warning("access log: stdout cannot be written without blocking (%s); a "
                            "reader that stops reading will stall this worker", exc)
                return
            self.write = partial(os.write, self.own)

    def wait_writable(self, timeout: float) -> bool:
        fd = self.sock.fileno() if self.sock is not None else \
            self.own if self.own is not None else self.fd
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return bool(poller.poll(timeout * 1000))

    def close(self) -> None:
        if self.own is not None:
            os.close(self.own)
            self.own = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None


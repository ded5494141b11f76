"""The access log's writing (velox.admin.accesslog) against a real pipe nobody reads: lines are
held up to the bound, then dropped and counted, never waited for; partial writes resume where
they stopped; lines flow in order once the pipe is read again; close writes what is held while
a reader takes it, and drops and counts it when none comes. The end-to-end twin, a gateway
whose stdout nobody reads, is tests/e2e/test_access_log_pipe.py."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from tests.unit.test_books import _request
from velox.admin.accesslog import AccessLog
from velox.core.fields import F

_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


class Counters:
    def __init__(self) -> None:
        self.totals: dict[int, int] = {}

    def add(self, slot: int, field: int, n: int) -> None:
        self.totals[int(field)] = self.totals.get(int(field), 0) + n


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    fcntl.fcntl(w, _F_SETPIPE_SZ, 4096)  # the smallest a pipe can be: one page
    yield r, w
    for fd in (r, w):
        with contextlib.suppress(OSError):  # a test may have closed it
            os.close(fd)


def _items(n: int, start: int = 0, path: bytes = b"/v1/chat/completions") -> list[Any]:
    return [(time.perf_counter_ns(), _request(path, "m", -1), None, 200, start + i)
            for i in range(n)]


def _read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    out = b""
    try:
        while chunk := os.read(fd, 65536):
            out += chunk
    except BlockingIOError:
        pass
    return out


def test_a_pipe_nobody_reads_holds_then_drops_and_counts_never_blocking(
        pipe: tuple[int, int]) -> None:
    r, w = pipe
    counters = Counters()
    log = AccessLog(0, counters, fd=w, held_max=8192)
    try:
        for i in range(20):  # ~200 lines of ~300 bytes: 4 KiB fit the pipe, 8 KiB are held
            for item in _items(10, 10 * i):
                log.append(item)
            log.flush()  # returns at once though nobody reads: the write would block
        assert 0 < log.held_bytes <= 8192
        assert log.dropped > 0
        assert counters.totals[F.ACCESS_LOG_DROPPED] == log.dropped
        assert counters.totals[F.ACCESS_LOG_LINES] == log.written
        held_lines = sum(n for _, n in log.held)
        assert log.written + log.dropped + held_lines == 200
        # The reader comes back: what was held follows what the pipe had, in order.
        got = _read_all(r)
        while log.held:
            log.flush()
            got += _read_all(r)
        lines = [orjson.loads(line) for line in got.splitlines()]
        assert len(lines) == log.written == 200 - log.dropped
        seq = [line["bytes_out"] for line in lines]
        assert seq == sorted(seq) and seq[0] == 0  # the oldest kept, the newest dropped
    finally:
        log.close(timeout=0)


def test_a_line_longer_than_the_pipe_is_written_across_partial_writes(
        pipe: tuple[int, int]) -> None:
    r, w = pipe
    log = AccessLog(0, Counters(), fd=w)
    try:
        # Control characters are escaped six bytes each: a 512-byte path and a 512-character
        # model make a line of ~6 KiB, over PIPE_BUF, which a pipe takes in pieces.
        items = [(time.perf_counter_ns(), _request(b"/v1/" + b"\x01" * 508, "\x02" * 512, -1),
                  None, 200, i) for i in range(3)]
        for item in items:
            log.append(item)
        assert log.flush() == 0 and 0 < log._sent < len(log.held[0][0])
        got = b""
        while log.held:
            got += _read_all(r)
            log.flush()
        got += _read_all(r)
        lines = [orjson.loads(line) for line in got.splitlines()]
        assert [line["bytes_out"] for line in lines] == [0, 1, 2]
        assert all(len(line["model"]) == 512 for line in lines)
    finally:
        log.close(timeout=0)


def test_close_writes_what_is_held_to_a_reader_that_comes_back(pipe: tuple[int, int]) -> None:
    r, w = pipe
    log = AccessLog(0, Counters(), fd=w)
    for item in _items(60):
        log.append(item)
    log.flush()
    assert log.held  # the pipe is full
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(_drain_until_eof_or_idle(r)))
    reader.start()
    log.close(timeout=10)
    reader.join(10)
    assert log.dropped == 0 and log.written == 60
    assert len(b"".join(got).splitlines()) == 60


def test_close_drops_and_counts_what_no_reader_takes(pipe: tuple[int, int]) -> None:
    _, w = pipe
    counters = Counters()
    log = AccessLog(0, counters, fd=w)
    for item in _items(60):
        log.append(item)
    log.close(timeout=0.05)  # bounded: a stuck stdout does not hold the worker's exit
    assert log.written + log.dropped == 60 and log.dropped > 0 and not log.held
    assert counters.totals[F.ACCESS_LOG_DROPPED] == log.dropped


def test_a_closed_stdout_drops_and_counts(pipe: tuple[int, int]) -> None:
    r, w = pipe
    counters = Counters()
    log = AccessLog(0, counters, fd=w)
    os.close(r)
    try:
        for item in _items(5):
            log.append(item)
        assert log.flush() == 0
        assert counters.totals[F.ACCESS_LOG_DROPPED] == 5
    finally:
        log.close(timeout=0)


def _drain_until_eof_or_idle(fd: int) -> bytes:
    """Read fd (blocking) until nothing arrived for a second after the writer went quiet."""
    import select

    out = b""
    while select.select([fd], [], [], 1.0)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        out += chunk
    return out

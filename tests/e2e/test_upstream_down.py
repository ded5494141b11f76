"""A dead upstream, as an operator meets it: how often the gateway knocks, and what it logs.

A real gateway (one worker, then two) in front of a plain-HTTP/1.1 upstream on loopback that resets
every connection it accepts (a crashed backend behind a port that still listens), then starts
answering. Each worker's HTTP/1.1 pool must reconnect with a growing backoff (50 ms doubling to
5 s, as the HTTP/2 pool) and log the upstream going down once and coming back once, instead of
a warning per attempt.
"""

from __future__ import annotations

import itertools
import re
import socket
import struct
import threading
import time
from collections import Counter
from datetime import datetime
from types import TracebackType

import httpx
import pytest

from .conftest import GatewayFactory, wait_for


class FlakyUpstream:
    """A plain-HTTP/1.1 upstream on a thread of the test process. While `down`, it accepts
    each connection and resets it at once (SO_LINGER 0); otherwise it answers every request on
    a keep-alive connection with a small JSON 200. `accepts` stamps each accepted connection
    (time.monotonic)."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.listener.settimeout(0.1)  # so the accept loop sees `stopped`
        self.origin = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.down = True
        self.stopped = False
        self.accepts: list[float] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> FlakyUpstream:
        self.thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stopped = True
        self.thread.join(5)
        self.listener.close()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            self.accepts.append(time.monotonic())
            if self.down:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()  # RST
            else:
                threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        pending = b""
        with conn:
            while not self.stopped:
                while b"\r\n\r\n" not in pending:
                    data = conn.recv(65536)
                    if not data:
                        return
                    pending += data
                head, _, pending = pending.partition(b"\r\n\r\n")
                length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
                size = int(length.group(1)) if length else 0
                while len(pending) < size:
                    data = conn.recv(65536)
                    if not data:
                        return
                    pending += data
                pending = pending[size:]
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: 11\r\n\r\n{\"data\":[]}")


def _lines(log: str, marker: str) -> Counter[str]:
    """Lines containing `marker`, counted by the pid that wrote them (`velox[pid]`)."""
    return Counter(re.search(r"velox\[(\d+)\]", line).group(1)  # type: ignore[union-attr]
                   for line in log.splitlines() if marker in line)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_dead_http1_upstream_is_retried_with_growing_backoff_and_logged_once_per_worker(
        workers: int, start_gateway: GatewayFactory) -> None:
    with FlakyUpstream() as up:
        gw = start_gateway(wait_ready=False, VELOX_UPSTREAM_ORIGIN=up.origin,
                           VELOX_UPSTREAM_CA_FILE="", VELOX_WORKERS=str(workers),
                           VELOX_EGRESS_POOL_CONNECTIONS="1")
        # Each worker keeps one warm connection, re-opened after every failure. Its k-th wait
        # is 50 ms x 2^(k-1) x [0.5, 1] (at most 5 s), so 8 of its attempts take at least
        # 25 + 50 + ... + 1600 ms = 3.2 s whatever the host's load, and 8 per worker include 8
        # of one worker however late the other started. A pool re-connecting every 50-200 ms
        # made 16 in about a second.
        attempts = 8 * workers
        wait_for(lambda: len(up.accepts) >= attempts, timeout=90)
        seen = up.accepts[:attempts]
        assert seen[-1] - seen[0] >= 3.0, seen
        if workers == 1:  # one worker's waits, in order: they grow
            gaps = [b - a for a, b in itertools.pairwise(seen)]
            assert gaps[-1] > 2 * max(gaps[:3]), gaps
        log = gw.log()
        down = _lines(log, "is down: reconnecting with backoff up to 5 s")
        assert len(down) == workers and set(down.values()) == {1}, down  # once per worker
        assert all("failed: " in line for line in log.splitlines() if "is down:" in line)
        assert _lines(log, "velox.egress").total() == workers, log  # and nothing per attempt

        up.down = False  # it comes back: each worker says so once, the gateway turns ready
        wait_for(lambda: len(_lines(gw.log(), "answers again after")) == workers, timeout=30)
        wait_for(lambda: httpx.get(gw.base_url + "/readyz", timeout=5).status_code == 200,
                 timeout=30)
        log = gw.log()
        assert _lines(log, "is down: reconnecting").total() == workers
        assert _lines(log, "answers again after").total() == workers


def _stamps(log: str, marker: str) -> list[float]:
    """The times (seconds, from the log's asctime) of the lines containing `marker`."""
    out = []
    for line in log.splitlines():
        if marker in line:
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            out.append(stamp.timestamp())
    return out


def test_a_refusing_http1_port_backs_off_to_the_h2_ceiling_and_warns_once(
        start_gateway: GatewayFactory) -> None:
    # A port bound but not listening: every connect is refused at once (ECONNREFUSED), the
    # case where nothing throttles the reconnects but the pool's own backoff.
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    try:
        origin = f"http://127.0.0.1:{closed.getsockname()[1]}"
        gw = start_gateway(wait_ready=False, VELOX_UPSTREAM_ORIGIN=origin,
                           VELOX_UPSTREAM_CA_FILE="", VELOX_UPSTREAM_PROTOCOL="http1",
                           VELOX_WORKERS="1", VELOX_EGRESS_POOL_CONNECTIONS="1",
                           VELOX_LOG_LEVEL="debug")
        # Each failed connect after the first is one debug line; the waits before the k-th
        # reconnect are 50 ms x 2^(k-1) x [0.5, 1], capped at 5 s. Ten failures in a row take
        # at least 25 + 50 + ... + 2500 + 2500 ms (the cap's half) = 7.6 s however loaded the
        # host; a pool reconnecting every 50-200 ms would make them in about a second.
        still_down = "(upstream 'default' still down)"
        wait_for(lambda: len(_stamps(gw.log(), still_down)) >= 9, timeout=120)
        log = gw.log()
        stamps = _stamps(log, "is down: reconnecting with backoff up to 5 s")[:1] + \
            _stamps(log, still_down)[:9]
        assert stamps[-1] - stamps[0] >= 7.0, stamps
        gaps = [b - a for a, b in itertools.pairwise(stamps)]
        assert max(gaps[-3:]) >= 2.5 > max(gaps[:3]), gaps  # it grew to the ceiling's range
        # No wait beyond the 5 s ceiling, give or take a loaded host's stalls (5 s of margin):
        # a coarse guard against a growth without a cap; the ceiling itself is next_backoff's,
        # shared with the HTTP/2 pool, and the warning names it.
        assert all(gap <= 10.0 for gap in gaps), gaps
        warned = [line for line in log.splitlines()
                  if "velox.egress" in line and " WARNING " in line]
        assert len(warned) == 1 and "refused" in warned[0].lower(), warned
    finally:
        closed.close()

"""A small bounded closed-loop HTTP/1.1 load generator, run on its own thread.

`ClosedLoop` keeps C keep-alive connections, each sending its next request as soon as the
previous answer is complete, until `max_requests` have been sent or `max_seconds` have passed
(whichever first), or `stop()` is called. It records every status and every client-side
latency (request written → body complete). asyncio streams, one canned request: cheap enough
that the generator is not what a 2-core machine runs out of first.

Used by tests/e2e/test_admin.py and benches/bench_admin.py.
"""

from __future__ import annotations

import asyncio
import threading
import time


class ClosedLoop:
    def __init__(self, host: str, port: int, request: bytes, concurrency: int = 32,
                 max_requests: int = 1_000_000, max_seconds: float = 5.0) -> None:
        self.host = host
        self.port = port
        self.request = request
        self.concurrency = concurrency
        self.max_requests = max_requests
        self.max_seconds = max_seconds
        self.sent = 0
        self.completed = 0
        self.statuses: dict[int, int] = {}
        self.latencies_ns: list[int] = []  # of 2xx answers
        self.errors: list[str] = []
        self.elapsed = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def start(self) -> ClosedLoop:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()),
                                        name="closed-loop", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float = 60.0) -> ClosedLoop:
        assert self._thread is not None
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("the load generator did not finish")
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def _main(self) -> None:
        self._t0 = time.monotonic()
        await asyncio.gather(*(self._connection() for _ in range(self.concurrency)))
        self.elapsed = time.monotonic() - self._t0

    async def _connection(self) -> None:
        deadline = self._t0 + self.max_seconds
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        except OSError as exc:
            self.errors.append(repr(exc))
            return
        try:
            while (not self._stop.is_set() and self.sent < self.max_requests
                   and time.monotonic() < deadline):
                self.sent += 1
                started = time.perf_counter_ns()
                writer.write(self.request)
                head = await reader.readuntil(b"\r\n\r\n")
                status = int(head[9:12])
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                await reader.readexactly(length)
                if 200 <= status < 300:
                    self.latencies_ns.append(time.perf_counter_ns() - started)
                self.statuses[status] = self.statuses.get(status, 0) + 1
                self.completed += 1
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            self.errors.append(repr(exc))
        finally:
            writer.close()


def chat_request(body: bytes, authorization: str | None = None,
                 path: str = "/v1/chat/completions") -> bytes:
    """A keep-alive POST with a JSON body, as raw bytes."""
    auth = f"Authorization: {authorization}\r\n".encode() if authorization else b""
    return (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\n%sContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), auth, len(body), body))

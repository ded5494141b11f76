"""How much CPU the mock upstream spends per request: `python -m velox_lab.mock.selfbench`.

Starts a mock process, drives it with a deliberately cheap load generator (raw HTTP/2 framing
with a precomputed request block, or raw HTTP/1.1 keep-alive) that keeps a fixed number of
requests in flight, and reads the mock's utime+stime from /proc/PID/stat before and after.
The result is CPU µs per request *in the mock*, the number that says whether the mock can be
the bottleneck of a gateway benchmark on a small machine. Linux only (uses /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import struct
import time
from dataclasses import asdict, dataclass

from . import MockUpstream
from .hpackenc import encode_field

_TICK = os.sysconf("SC_CLK_TCK")
_FRAME = struct.Struct(">IBI")
_REQUEST = {"model": "gpt-4o-mini",
            "messages": [{"role": "user", "content": "Say hello in one word."}]}
BODY = json.dumps(_REQUEST).encode()
STREAM_BODY = json.dumps({**_REQUEST, "stream": True}).encode()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (children excluded), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


@dataclass
class Result:
    scenario: str
    requests: int
    seconds: float
    mock_cpu_seconds: float

    @property
    def cpu_us_per_request(self) -> float:
        return self.mock_cpu_seconds / self.requests * 1e6

    def summary(self) -> dict:
        return {**asdict(self), "requests_per_second": round(self.requests / self.seconds),
                "mock_cpu_us_per_request": round(self.cpu_us_per_request, 1)}


class _Budget:
    """Shared request budget across connections; `done` fires when all answers are in."""

    def __init__(self, total: int) -> None:
        self.left = total
        self.answered = 0
        self.total = total
        self.done = asyncio.get_running_loop().create_future()

    def take(self) -> bool:
        if self.left <= 0:
            return False
        self.left -= 1
        return True

    def answer(self) -> None:
        self.answered += 1
        if self.answered == self.total and not self.done.done():
            self.done.set_result(None)


class _H2Load(asyncio.Protocol):
    def __init__(self, budget: _Budget, in_flight: int, authority: bytes, extra: list,
                 body: bytes) -> None:
        self.budget, self.in_flight, self.body = budget, in_flight, body
        block = (b"\x83\x87"  # :method POST, :scheme https (static-table indexes)
                 + encode_field(b":path", b"/v1/chat/completions")
                 + encode_field(b":authority", authority)
                 + encode_field(b"content-type", b"application/json")
                 + encode_field(b"authorization", b"Bearer sk-bench")
                 + encode_field(b"content-length", b"%d" % len(body))
                 + b"".join(encode_field(n, v) for n, v in extra))
        self.headers = block
        self.next_sid = 1
        self.buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        settings = struct.pack(">HIHI", 2, 0, 4, 2**31 - 1)  # no push; huge stream windows
        out = [b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
               _FRAME.pack(len(settings) << 8 | 4, 0, 0) + settings,
               _FRAME.pack(4 << 8 | 8, 0, 0) + struct.pack(">I", 2**31 - 1 - 65535)]
        out += [self._request() for _ in range(self.in_flight) if self.budget.take()]
        transport.write(b"".join(out))

    def _request(self) -> bytes:
        sid, self.next_sid = self.next_sid, self.next_sid + 2
        return (_FRAME.pack(len(self.headers) << 8 | 1, 0x4, sid) + self.headers
                + _FRAME.pack(len(self.body) << 8 | 0, 0x1, sid) + self.body)

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos, n, out = 0, len(buf), []
        while n - pos >= 9:
            lt, flags, _sid = _FRAME.unpack_from(buf, pos)
            end = pos + 9 + (lt >> 8)
            if end > n:
                break
            ftype = lt & 0xFF
            if ftype == 4 and not flags & 1:
                out.append(_FRAME.pack(4, 1, 0))  # SETTINGS ACK
            elif ftype in (0, 1) and flags & 1:  # END_STREAM: one answer in, one request out
                self.budget.answer()
                if self.budget.take():
                    out.append(self._request())
            pos = end
        self.buf = buf[pos:]
        if out:
            self.transport.write(b"".join(out))


class _H1Load(asyncio.Protocol):
    def __init__(self, budget: _Budget, extra: list) -> None:
        self.budget = budget
        self.request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: mock\r\n"
                        b"content-type: application/json\r\nauthorization: Bearer sk-bench\r\n"
                        + b"".join(n + b": " + v + b"\r\n" for n, v in extra)
                        + b"content-length: %d\r\n\r\n" % len(BODY) + BODY)
        self.buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if self.budget.take():
            transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            i = self.buf.find(b"content-length: ", 0, head_end)
            length = int(self.buf[i + 16:self.buf.index(b"\r\n", i)])
            if len(self.buf) < head_end + 4 + length:
                return
            self.buf = self.buf[head_end + 4 + length:]
            self.budget.answer()
            if self.budget.take():
                self.transport.write(self.request)


async def _drive(mock: MockUpstream, proto: str, total: int, connections: int,
                 in_flight: int, extra: list, stream: bool) -> float:
    loop = asyncio.get_running_loop()
    budget = _Budget(total)
    ctx = None
    if mock.tls:
        ctx = ssl.create_default_context(cafile=mock.ca_file)
        ctx.set_alpn_protocols(["h2"] if proto == "h2" else ["http/1.1"])
    authority = b"127.0.0.1:%d" % mock.port
    per_conn = max(1, in_flight // connections)

    def factory() -> asyncio.Protocol:
        if proto == "h2":
            return _H2Load(budget, per_conn, authority, extra, STREAM_BODY if stream else BODY)
        return _H1Load(budget, extra)

    t0 = time.perf_counter()
    transports = [(await loop.create_connection(factory, "127.0.0.1", mock.port, ssl=ctx))[0]
                  for _ in range(connections)]
    await asyncio.wait_for(budget.done, timeout=120)
    elapsed = time.perf_counter() - t0
    for t in transports:
        t.close()
    return elapsed


def measure(scenario: str, *, requests: int = 20000, warmup: int = 2000,
            extra_headers: dict[str, str] | None = None, stream: bool = False,
            **mock_kw) -> Result:
    """One run. `scenario` is h2-tls / h2 (4 connections x 16 streams) or h1 / h1-tls
    (64 keep-alive connections); `stream` (h2 only) asks for SSE responses; `mock_kw` go to
    `MockUpstream` (e.g. latency_ms=20 exercises the timer path)."""
    proto = "h2" if scenario.startswith("h2") else "h1"
    if stream and proto != "h2":
        raise ValueError("the HTTP/1.1 load generator only reads Content-Length responses")
    tls = scenario.endswith("tls")
    connections, in_flight = (4, 64) if proto == "h2" else (64, 64)
    extra = [(k.encode(), v.encode()) for k, v in (extra_headers or {}).items()]
    try:
        import uvloop
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover
        runner = asyncio.Runner()
    with MockUpstream(tls=tls, **mock_kw) as mock, runner:
        runner.run(_drive(mock, proto, warmup, connections, in_flight, extra, stream))
        before = cpu_seconds(mock.pid)
        elapsed = runner.run(_drive(mock, proto, requests, connections, in_flight, extra,
                                    stream))
        cpu = cpu_seconds(mock.pid) - before
        stats = mock.stats()
    if stats["requests"] != requests + warmup:
        raise RuntimeError(f"mock counted {stats['requests']} requests, "
                           f"sent {requests + warmup}")
    label = scenario + (" stream" if stream else "") + "".join(
        f" {k}={v}" for k, v in mock_kw.items())
    return Result(label, requests, elapsed, cpu)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m velox_lab.mock.selfbench", description=__doc__)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--scenario", action="append",
                   choices=["h2-tls", "h1", "h1-tls", "h2"], help="repeatable")
    p.add_argument("--stream", action="store_true", help="SSE responses (h2 scenarios only)")
    p.add_argument("--latency-ms", type=int, default=0)
    p.add_argument("--chunks", type=int, default=8)
    args = p.parse_args()
    for scenario in args.scenario or ["h2-tls", "h1"]:
        result = measure(scenario, requests=args.requests, stream=args.stream,
                         latency_ms=args.latency_ms, chunks=args.chunks)
        print(json.dumps(result.summary()), flush=True)


if __name__ == "__main__":
    main()

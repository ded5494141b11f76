"""The project's own HTTP/1.1 load generator, for what wrk cannot measure.

`python -m benches.e2e.loadgen MODE --port P [...]` prints one JSON line of results.

* `closed`: C keep-alive connections, each sending its next request as soon as the previous
  answer is complete (wrk's model). Used to measure this generator's own ceiling.
* `stream`: the same closed loop with streamed responses; per request it records the time to
  the first body byte (TTFB), the total time and the longest gap between two body reads. A
  stream that is not complete within the grace period after the run, or that goes silent for
  longer than `--stall-gap-s`, counts as stalled.
* `rate`: open loop at a constant request rate (wrk2's model). Request i is due at t0 + i/R
  whether or not earlier answers came back, and its latency is counted from that due time, so a
  stalled target is charged for the requests it kept waiting (no coordinated omission). The time
  from the actual send is reported too, as `service`.

Raw asyncio protocols with httptools on uvloop: no client library, no Task per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable

import httptools
import uvloop

try:
    from benches.e2e import workload
except ImportError:  # run as a file
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    from benches.e2e import workload

_now = time.perf_counter


def percentiles(values: list[float], scale: float = 1e6) -> dict[str, float]:
    """p50/p90/p99/p99.9/max/mean of seconds, in microseconds (nearest rank)."""
    if not values:
        return {"n": 0}
    s = sorted(values)
    n = len(s)

    def rank(q: float) -> float:
        return s[min(n - 1, max(0, int(q / 100 * n + 0.5) - 1))] * scale

    return {"n": n, "p50": rank(50), "p90": rank(90), "p99": rank(99), "p99.9": rank(99.9),
            "max": s[-1] * scale, "mean": sum(s) / n * scale}


class Conn(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self, gen: Generator) -> None:
        self.gen = gen
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.t_due = self.t_sent = self.t_first = self.t_last = 0.0
        self.max_gap = 0.0
        self.status = 0
        self.busy = False
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, t_due: float) -> None:
        self.busy = True
        self.t_due = t_due
        self.t_first = 0.0
        self.max_gap = 0.0
        self.t_sent = _now()
        self.t_last = 0.0
        self.transport.write(self.gen.request)  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.gen.errors += 1
            self.transport.close()  # type: ignore[union-attr]

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        t = _now()
        if not self.t_first:
            self.t_first = t
        elif t - self.t_last > self.max_gap:
            self.max_gap = t - self.t_last
        self.t_last = t

    def on_message_complete(self) -> None:
        self.busy = False
        self.gen.complete(self, _now())

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.busy:
            self.busy = False
            self.gen.errors += 1
            self.gen.lost_in_flight += 1
        self.gen.on_lost(self)


class Generator:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.loop = asyncio.get_event_loop()
        extra = workload.slow_stream_headers(args.chunks, args.chunk_delay_ms) \
            if args.chunk_delay_ms else None
        model = workload.STREAM_SLOW_MODEL if args.chunk_delay_ms else workload.MODEL
        payload = workload.body(stream=args.mode == "stream", model=model)
        self.request = workload.http_request(args.host, args.port, payload, extra, args.path)
        self.conns: list[Conn] = []
        self.idle: deque[Conn] = deque()
        self.backlog: deque[float] = deque()  # rate mode: due times waiting for a connection
        self.recording = False
        self.running = True
        self.total: list[float] = []
        self.service: list[float] = []
        self.ttfb: list[float] = []
        self.gaps: list[float] = []
        self.statuses: dict[int, int] = {}
        self.errors = self.lost_in_flight = self.completed = self.stalled_gap = 0
        self.in_window = self.queued = self.max_backlog = self.opening = 0
        self.t_record = self.t_end = float("inf")
        self.schedule_lag: dict[str, float] = {}
        self.done = self.loop.create_future()
        self.on_idle: Callable[[Conn], None] = self._closed_next

    async def connect(self, n: int) -> None:
        async def one() -> None:
            _, conn = await self.loop.create_connection(
                lambda: Conn(self), self.args.host, self.args.port)
            self.conns.append(conn)
            self.idle.append(conn)
        await asyncio.gather(*(one() for _ in range(n)))

    # --- completion --------------------------------------------------------------------------

    def complete(self, conn: Conn, t: float) -> None:
        if self.recording and conn.t_due >= self.t_record:
            self.completed += 1
            if t <= self.t_end:
                self.in_window += 1
            self.total.append(t - conn.t_due)
            self.service.append(t - conn.t_sent)
            if conn.t_first:
                self.ttfb.append(conn.t_first - conn.t_sent)
            self.gaps.append(conn.max_gap)
            if conn.max_gap > self.args.stall_gap_s:
                self.stalled_gap += 1
            self.statuses[conn.status] = self.statuses.get(conn.status, 0) + 1
        self.on_idle(conn)

    def on_lost(self, conn: Conn) -> None:
        if conn in self.idle:
            self.idle.remove(conn)
        self._check_done()

    def _closed_next(self, conn: Conn) -> None:
        if self.running:
            conn.send(_now())
        else:
            self._check_done()

    def _rate_next(self, conn: Conn) -> None:
        if self.backlog:
            conn.send(self.backlog.popleft())
        else:
            self.idle.append(conn)
            self._check_done()

    def _check_done(self) -> None:
        if not self.running and not self.done.done() and not any(
                c.busy for c in self.conns if not c.lost) and not self.backlog:
            self.done.set_result(None)

    # --- drivers -----------------------------------------------------------------------------

    async def run_closed(self) -> float:
        args = self.args
        await self.connect(args.conns)
        t0 = _now()
        warmup = max(args.warmup, args.stagger_s)
        self.t_record = t0 + warmup
        self.t_end = self.t_record + args.duration
        self.recording = True
        # Staggered starts keep long streams from running in lockstep (all starting, and so
        # all asking for their first byte, in the same millisecond).
        step = args.stagger_s / len(self.idle) if self.idle else 0.0
        for i, conn in enumerate(list(self.idle)):
            if step:
                self.loop.call_later(i * step, lambda c=conn: c.send(_now()))
            else:
                conn.send(t0)
        self.idle.clear()
        await asyncio.sleep(warmup + args.duration)
        self.running = False
        return args.duration

    async def run_rate(self) -> float:
        args = self.args
        await self.connect(min(args.conns, 16))
        self.on_idle = self._rate_next
        interval = 1.0 / args.rate
        t0 = _now() + 0.01
        self.t_record = t0 + args.warmup
        self.recording = True
        end = self.t_end = t0 + args.warmup + args.duration
        i = 0
        lag: list[float] = []
        while True:
            now = _now()
            while t0 + i * interval <= now:
                due = t0 + i * interval
                i += 1
                if due >= end:
                    break
                # The clock starts when this generator could send (its own timer lateness,
                # under a millisecond, is recorded apart as `schedule_lag`), so waiting for a
                # connection the target is still holding is charged to the target.
                lag.append(now - due)
                if self.idle:
                    self.idle.popleft().send(now)
                else:
                    self.backlog.append(now)
                    self.queued += 1
                    self.max_backlog = max(self.max_backlog, len(self.backlog))
                    if len(self.conns) + self.opening < args.conns:
                        self.opening += 1
                        self.loop.create_task(self._grow())
            if t0 + i * interval >= end:
                break
            # uvloop's timers have millisecond resolution: shorter sleeps would spin.
            await asyncio.sleep(max(0.001, t0 + i * interval - _now()))
        self.running = False
        self.schedule_lag = percentiles(lag)
        return args.duration

    async def _grow(self) -> None:
        try:
            _, conn = await self.loop.create_connection(
                lambda: Conn(self), self.args.host, self.args.port)
        finally:
            self.opening -= 1
        self.conns.append(conn)
        self._rate_next(conn)

    async def main(self) -> dict[str, object]:
        cpu0 = os.times()
        runner = self.run_rate if self.args.mode == "rate" else self.run_closed
        duration = await runner()
        self._check_done()
        try:
            await asyncio.wait_for(asyncio.shield(self.done), self.args.grace_s)
        except TimeoutError:
            pass
        unfinished = sum(1 for c in self.conns if c.busy and not c.lost) + len(self.backlog)
        cpu1 = os.times()
        for conn in self.conns:
            if conn.transport is not None:
                conn.transport.close()
        cpu = cpu1.user + cpu1.system - cpu0.user - cpu0.system
        ok = sum(v for k, v in self.statuses.items() if 200 <= k < 300)
        return {
            "mode": self.args.mode, "conns": self.args.conns, "open_conns": len(self.conns),
            "rate": self.args.rate, "duration_s": duration, "requests": self.completed,
            "rps": round(self.in_window / duration, 1),
            "queued_for_connection": self.queued, "max_backlog": self.max_backlog,
            "ok": ok, "non_2xx": self.completed - ok, "errors": self.errors,
            "lost_in_flight": self.lost_in_flight, "unfinished": unfinished,
            "stalled": unfinished + self.stalled_gap, "stall_gap_s": self.args.stall_gap_s,
            "latency_us": percentiles(self.total), "service_us": percentiles(self.service),
            "ttfb_us": percentiles(self.ttfb), "max_gap_us": percentiles(self.gaps),
            "schedule_lag_us": self.schedule_lag,
            "generator_cpu_s": round(cpu, 3),
            "generator_cpu_us_per_request": round(cpu / max(1, self.completed) * 1e6, 2),
        }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benches.e2e.loadgen")
    p.add_argument("mode", choices=("closed", "stream", "rate"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--path", default=workload.PATH)
    p.add_argument("--conns", type=int, default=64, help="connections (rate: the most opened)")
    p.add_argument("--rate", type=float, default=0.0, help="requests per second (rate mode)")
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds sent but not recorded")
    p.add_argument("--grace-s", type=float, default=10.0,
                   help="after the run, time allowed for answers still in flight")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--chunk-delay-ms", type=int, default=0,
                   help="ask the mock for slow streams (headers; the LiteLLM config maps them)")
    p.add_argument("--stall-gap-s", type=float, default=2.0)
    p.add_argument("--stagger-s", type=float, default=0.0,
                   help="spread the connections' first requests over this many seconds")
    args = p.parse_args(argv)
    if args.mode == "rate" and args.rate <= 0:
        p.error("rate mode needs --rate")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    uvloop.install()
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        result = loop.run_until_complete(Generator(args).main())
    finally:
        loop.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

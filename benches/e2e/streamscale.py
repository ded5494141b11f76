"""Many event streams at once through a gateway: CPU per relayed event, added delays.

`python -m benches.e2e.streamscale --streams 64,256` starts the mock upstream (each stream
`--events` SSE events `--interval-ms` apart: a model emitting tokens), nginx in front of it
(`proxy_buffering off`, no access log) and a 2-worker Velox as shipped (access log on), opens
one client connection per stream, starts all streams of a count within `--spread-ms`, and
reports per target and stream count, the mock alone (`direct`) being the floor:

* CPU per event: user + system CPU of the target's process tree over the phase divided by the
  SSE events delivered (the number an LLM gateway's bill follows);
* the time to the response head (from each stream's scheduled start, connect included) and the
  arrival gap between consecutive events minus the interval, as added to the floor's (p50, p99);
* stalls (a gap over ten intervals) and errors.

`--egress http1` (default: the self-hosted case, cleartext HTTP/1.1 as vLLM or Ollama speak it)
or `h2` (HTTP/2 over TLS; nginx then proxies over TLS with HTTP/1.1). `--tree NAME=PATH` (more
than once): one Velox per source tree (its native extension built in place), for an A/B in one
run. `--plain SECONDS`: plain answers instead (wrk, closed loop, `--streams` connections), CPU
per request, and in the TTFB columns wrk's latency of the whole answer added to the mock's own
(asked directly, over TLS with `h2`). `--profile`: py-spy of one Velox worker during the
largest count. Rounds alternate the targets, the order flipped every round; the report gives
medians over rounds. Every process is started here and stopped by its PID; nothing here asserts
a speed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httptools
import uvloop

from benches.e2e import workload, wrk
from benches.e2e.loadgen import percentiles
from benches.e2e.machine import TICK, bench_lock, facts, tree
from benches.e2e.targets import Mock, Nginx, Service, Velox

OUT = Path(__file__).resolve().parents[1] / "results" / "streamscale.json"
_now = time.perf_counter


class Stream(asyncio.Protocol):
    """One client connection carrying one streamed request; records every event's arrival."""

    def __init__(self, done: asyncio.Future[None]) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.done = done
        self.t_head = 0.0
        self.arrivals: list[float] = []
        self.partial = b""  # an event split across reads
        self.status = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._end()

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.t_head = _now()

    def on_body(self, body: bytes) -> None:
        t = _now()
        buf = self.partial + body
        n = buf.count(b"\n\n")
        self.arrivals += [t] * n
        self.partial = buf[buf.rfind(b"\n\n") + 2:] if n else buf

    def on_message_complete(self) -> None:
        self._end()

    def connection_lost(self, exc: Exception | None) -> None:
        self._end()

    def _end(self) -> None:
        if not self.done.done():
            self.done.set_result(None)
        if self.transport is not None:
            self.transport.close()


async def _one(port: int, request: bytes, start: float, timeout: float) -> dict[str, object]:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, start - _now()))
    done: asyncio.Future[None] = loop.create_future()
    t0 = _now()
    try:
        transport, proto = await loop.create_connection(lambda: Stream(done), "127.0.0.1", port)
    except OSError:
        return {"error": True}
    transport.write(request)
    try:
        await asyncio.wait_for(done, timeout)
    except TimeoutError:
        transport.close()
        return {"error": True}
    ok = proto.status == 200 and bool(proto.arrivals)
    return {"error": not ok, "ttfb": proto.t_head - t0 if ok else 0.0,
            "arrivals": proto.arrivals}


def drive(port: int, streams: int, events: int, interval_ms: int, spread_ms: int) -> dict:
    """Run `streams` streams at once against port; arrival statistics of all of them."""
    payload = workload.body(stream=True)
    request = workload.http_request("127.0.0.1", port, payload,
                                    workload.slow_stream_headers(events, interval_ms))
    timeout = 30 + events * interval_ms / 1000 * 3

    async def run() -> list[dict[str, object]]:
        t0 = _now() + 0.05
        return await asyncio.gather(*(
            _one(port, request, t0 + spread_ms / 1000 * i / streams, timeout)
            for i in range(streams)))

    rows = uvloop.run(run())
    gaps, ttfbs, n_events, errors = [], [], 0, 0
    for row in rows:
        if row["error"]:
            errors += 1
            continue
        arrivals: list[float] = row["arrivals"]  # type: ignore[assignment]
        n_events += len(arrivals)
        ttfbs.append(row["ttfb"])
        # Paced events only: the first content event onwards, the usage and [DONE] events
        # that follow the last one at once excluded.
        paced = arrivals[: events + 1]
        gaps += [b - a - interval_ms / 1000 for a, b in itertools.pairwise(paced)]
    stall = 10 * interval_ms / 1000
    return {"streams": streams, "errors": errors, "events": n_events,
            "stalls": sum(1 for g in gaps if g > stall),
            "ttfb_us": percentiles(ttfbs), "gap_us": percentiles(gaps)}


def pyspy_top(pid: int, seconds: float) -> dict[str, float]:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        return {"error: py-spy not installed": 0.0}
    with tempfile.NamedTemporaryFile(suffix=".txt") as fh:
        subprocess.run([exe, "record", "-p", str(pid), "-d", str(max(1, int(seconds))), "-r",
                        "250", "-f", "raw", "-o", fh.name, "--nonblocking"],
                       capture_output=True, timeout=seconds + 60, check=False)
        lines = Path(fh.name).read_text().splitlines()
    leaves: collections.Counter[str] = collections.Counter()
    for line in lines:
        stack, _, n = line.rpartition(" ")
        frames = [f for f in stack.split(";") if f and not f.startswith(("process ", "thread "))]
        if frames:
            leaves[frames[-1]] += int(n)
    total = sum(leaves.values()) or 1
    return {k: round(v / total, 3) for k, v in leaves.most_common(20)}


def _user_system(roots: list[int]) -> tuple[float, float, float]:
    """User and system CPU seconds of the process trees (the kernel's share of a proxy's
    work is the syscalls and loopback TCP, which a faster user space does not change), and
    the roots' own (a gateway's supervisor: what its workers cost is the rest)."""
    user = system = own = 0
    for root in roots:
        for pid in tree(root):
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            user += int(fields[11])
            system += int(fields[12])
            if pid == root:
                own += int(fields[11]) + int(fields[12])
    return user / TICK, system / TICK, own / TICK


def measure(target: str, port: int, roots: list[int], args: argparse.Namespace,
            streams: int, profile_pid: int = 0) -> dict[str, object]:
    cpu0 = _user_system(roots)
    prof: dict[str, float] = {}
    spy = None
    if profile_pid:
        import threading
        spy = threading.Thread(target=lambda: prof.update(
            pyspy_top(profile_pid, args.events * args.interval_ms / 1000 * 0.6)))
        spy.start()
    if args.plain:  # plain answers, wrk closed loop: "events" are requests, and the TTFB
        # columns are wrk's whole-answer latency (the floor's: the mock's own)
        # the TLS mock alone is asked over TLS (wrk does not verify its certificate)
        tls = not roots and args.egress == "h2"
        out = wrk.run(port, streams, args.plain, threads=2, scheme="https" if tls else "http")
        row = {"streams": streams, "events": out["requests"], "errors": out["errors_total"],
               "stalls": 0, "ttfb_us": out["latency_us"], "gap_us": {}, "rps": out["rps"]}
    else:
        row = drive(port, streams, args.events, args.interval_ms, args.spread_ms)
    if spy is not None:
        spy.join()
    user, system, root = (b - a for a, b in zip(cpu0, _user_system(roots), strict=True))
    row["target"] = target
    if roots:
        events = max(1, row["events"])  # type: ignore[call-overload]
        row["cpu_us_per_event"] = round((user + system) / events * 1e6, 2)
        row["system_us_per_event"] = round(system / events * 1e6, 2)
        row["root_us_per_event"] = round(root / events * 1e6, 2)  # the supervisor's share
    if prof:
        row["py_spy_top"] = prof
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benches.e2e.streamscale")
    p.add_argument("--streams", default="64,256")
    p.add_argument("--events", type=int, default=100)
    p.add_argument("--interval-ms", type=int, default=20)
    p.add_argument("--spread-ms", type=int, default=500)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--egress", choices=("http1", "h2"), default="http1")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-nginx", action="store_true", help="leave nginx out (it is beside "
                   "Velox by default when installed: proxy_buffering off, no access log)")
    p.add_argument("--plain", type=int, default=0, metavar="SECONDS",
                   help="instead of streams: plain answers, wrk with --streams connections for "
                        "SECONDS each; CPU per request (the egress A/B without streaming)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                   help="A/B: a gateway per source tree (its native extension built in place), "
                        "measured in turn every round; PATH@VELOX_X=0,VELOX_Y=1 adds settings "
                        "to that gateway; default: this checkout")
    args = p.parse_args(argv)
    logdir = Path(tempfile.mkdtemp(prefix="velox-streamscale-"))
    mock = Mock(tls=args.egress == "h2", workers=1, logdir=logdir)
    services: list[Service] = [mock.start()]
    rows: list[dict[str, object]] = []
    try:
        if not args.no_nginx and shutil.which("nginx"):
            services.append(Nginx(mock).start())
        protocol = {} if args.egress == "h2" else {"VELOX_UPSTREAM_PROTOCOL": "http1"}
        for name, spec in [t.partition("=")[::2] for t in args.tree] or [("velox", "")]:
            path, _, settings = spec.partition("@")  # PATH@VELOX_X=1,VELOX_Y=2
            extra = dict(kv.partition("=")[::2] for kv in settings.split(",") if kv)
            env = {**protocol, **({"PYTHONPATH": path} if path else {}), **extra}
            services.append(Velox(mock, logdir, name, env).start())
        counts = [int(c) for c in args.streams.split(",")]
        with bench_lock() as waited:
            print(f"waited {waited:.0f}s for the benchmark lock", flush=True)
            for r in range(args.rounds):
                for streams in counts:
                    # The floor (the mock alone) first, then every target, the order flipped
                    # every round, so all see the same host.
                    order = services[1:] if r % 2 == 0 else services[:0:-1]
                    for service in (mock, *order):
                        floor = service is mock
                        spy = service.workers[0] if args.profile and r == 0 and \
                            streams == counts[-1] and isinstance(service, Velox) else 0
                        rows.append({"round": r, **measure(
                            "direct" if floor else service.name, service.port,
                            [] if floor else service.roots, args, streams, spy)})
                        print(json.dumps({k: v for k, v in rows[-1].items()
                                          if k not in ("py_spy_top", "ttfb_us", "gap_us")}),
                              flush=True)
    finally:
        for service in reversed(services):
            service.stop()
    doc = {"machine": facts(), "egress": args.egress, "events": args.events,
           "interval_ms": args.interval_ms, "rows": rows, "load": os.getloadavg()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(markdown(doc))
    return 0


def _added(row: dict, floor: dict, key: str, q: str) -> float:
    """Milliseconds the target adds to the floor's percentile q of key."""
    return (row[key].get(q, 0) - floor[key].get(q, 0)) / 1000


HEADER = ["target", "streams", "rounds", "CPU µs/event", "of which system", "× nginx",
          "+TTFB p50 ms", "+TTFB p99 ms", "+gap p50 ms", "+gap p99 ms", "stalls", "errors"]


def summary(doc: dict) -> list[list[str]]:
    """Rows of HEADER: per target and stream count, medians over rounds; the + columns are
    what the target adds to the floor's percentile in the same round; × nginx is the ratio of
    the CPU medians."""
    rows = doc["rows"]
    floor = {(r["round"], r["streams"]): r for r in rows if r["target"] == "direct"}
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        if r["target"] != "direct":
            groups.setdefault((r["target"], r["streams"]), []).append(r)
    cpu = {k: statistics.median(r["cpu_us_per_event"] for r in g) for k, g in groups.items()}
    out = []
    for (target, streams), group in groups.items():

        def med(key: str, q: str, group: list[dict] = group) -> str:
            added = [_added(r, floor[(r["round"], r["streams"])], key, q) for r in group]
            return f"{statistics.median(added):+.2f}"

        nginx = cpu.get(("nginx", streams)) or cpu.get(("nginx-tls", streams))
        system = statistics.median(r.get("system_us_per_event", 0.0) for r in group)
        out.append([target, str(streams), str(len(group)), f"{cpu[(target, streams)]:.1f}",
                    f"{system:.1f}",
                    f"{cpu[(target, streams)] / nginx:.2f}" if nginx else "–",
                    med("ttfb_us", "p50"), med("ttfb_us", "p99"), med("gap_us", "p50"),
                    med("gap_us", "p99"), str(sum(r["stalls"] for r in group)),
                    str(sum(r["errors"] for r in group))])
    return out


def markdown(doc: dict) -> str:
    lines = [f"egress {doc['egress']}, {doc['events']} events {doc['interval_ms']} ms apart; "
             f"load {tuple(round(x, 1) for x in doc['load'])}", "",
             "| " + " | ".join(HEADER) + " |", "|---" + "|---:" * (len(HEADER) - 1) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in summary(doc)]
    for r in doc["rows"]:
        if "py_spy_top" in r:
            lines += ["", f"innermost Python frames of one worker of {r['target']} (py-spy):"]
            lines += [f"  {v:6.1%}  {k}" for k, v in r["py_spy_top"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

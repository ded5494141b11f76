"""Many event streams at once through a gateway: CPU per relayed event, added delays.

`python -m benches.e2e.streamscale --egress http1,h2 --streams 1,64,512` (`make
bench-streamscale`) starts, per egress in turn, the mock upstream (each stream `--events` SSE
events `--interval-ms` apart: a model emitting tokens; "20-200" draws each stream's count from
that range, the same draws for every target), nginx in front of it (`proxy_buffering off`, no
access log) and a 2-worker Velox as shipped (access log on). For each stream count it keeps that
many streams running for `--seconds` (a slot starts its next stream, on a new client
connection, when one ends; the slots' first streams start within `--spread-ms`) and reports per
target and count, the mock alone (`direct`) being the floor:

* CPU per event: the CPU of the target's process trees over the phase (each thread's
  schedstat, in ns) divided by the SSE events delivered (the number an LLM gateway's bill
  follows); the kernel's part; and the part the target would have spent idle (its CPU per
  second with no traffic, measured at the start of every round, times the phase's length);
* the time from the request's write to the response head, and the gap between consecutive
  paced events minus the interval, as added to the floor's (p50, p99);
* stalls (a gap over ten intervals) and errors, beside the share of time the target's
  processes (on the floor's row: the client's and the mock's) were ready to run but waited for
  a core: stalls on a shared host come with a high share there.

`--egress http1` is the self-hosted case (cleartext HTTP/1.1 as vLLM or Ollama speak it), `h2`
HTTP/2 over TLS (nginx then proxies over TLS with HTTP/1.1: "nginx-tls"). `--tree NAME=PATH`
(more than once): one Velox per source tree (its native extension built in place), for an A/B
in one run. `--plain SECONDS`: plain answers instead (wrk, closed loop, `--streams`
connections), CPU per request, and in the TTFB columns wrk's latency of the whole answer added
to the mock's own. After the rounds, an unmeasured phase per count of `--perf-streams` records
one Velox worker with `perf record -g` (the top of `perf report --no-children` goes into the
results, not the docs); `--profile` adds py-spy's innermost Python frames. Rounds alternate
the targets, the order flipped every round; the report gives medians over rounds. Every process
is started here and stopped by its PID; nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import os
import random
import re
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httptools
import uvloop

from benches.e2e import workload, wrk
from benches.e2e.loadgen import percentiles
from benches.e2e.machine import TICK, bench_lock, facts, tree
from benches.e2e.otlpsink import Sink
from benches.e2e.targets import Mock, Nginx, Service, Velox

OUT = Path(__file__).resolve().parents[1] / "results" / "streamscale.json"
_now = time.perf_counter


class Stream(asyncio.Protocol):
    """One client connection of a slot, carrying its streamed requests one after another
    (keep-alive, as an SDK's pool reuses a connection); records every event's arrival."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.begin(None)

    def begin(self, done: asyncio.Future[None] | None) -> None:
        """Ready for the next response; `done` resolves when it is complete or the
        connection ends."""
        self.done = done
        self.t_head = 0.0
        self.arrivals: list[float] = []
        self.partial = b""  # an event split across reads
        self.status = 0
        self.complete = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.close()

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
        self.complete = True
        if not self.parser.should_keep_alive():
            self.close()
        self._end()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._end()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        self._end()

    def _end(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)


async def _one(proto: Stream, request: bytes, timeout: float) -> dict[str, object]:
    """One stream on the slot's connection; its time to the response head counts from the
    request's write (connected, and for the TLS floor the handshake done: the gateways'
    clients speak cleartext, so the floor must not charge them a handshake)."""
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    proto.begin(done)
    t0 = _now()
    proto.transport.write(request)  # type: ignore[union-attr]
    try:
        await asyncio.wait_for(done, timeout)
    except TimeoutError:
        proto.close()
    ok = proto.complete and proto.status == 200 and bool(proto.arrivals)
    return {"error": not ok, "ttfb": proto.t_head - t0 if ok else 0.0,
            "arrivals": proto.arrivals}


def event_counts(spec: str) -> tuple[int, int]:
    """`--events`: "100" (every stream 100 events) or "20-200" (each stream's count drawn
    from that range, the same draws for every target)."""
    low, _, high = spec.partition("-")
    return int(low), int(high or low)


async def _slot(port: int, slot: int, requests: dict[int, bytes], events: tuple[int, int],
                start: float, until: float, timeout: float,
                tls: ssl.SSLContext | None) -> list[dict[str, object]]:
    """One concurrent stream: streams one after another on one keep-alive connection (a new
    one if the server closed it) until `until`, at least one; each stream's event count from
    a generator seeded by the slot. A failed stream ends the slot (counted as an error;
    never a tight loop of refusals)."""
    loop = asyncio.get_running_loop()
    draw = random.Random(slot)
    await asyncio.sleep(max(0.0, start - _now()))
    rows: list[dict[str, object]] = []
    proto: Stream | None = None
    try:
        while True:
            n = draw.randint(*events)
            if proto is None or proto.closed:
                try:
                    _, proto = await loop.create_connection(
                        Stream, "127.0.0.1", port, ssl=tls,
                        server_hostname="localhost" if tls else None)
                except OSError:
                    rows.append({"error": True, "asked": n})
                    return rows
            row = await _one(proto, requests[n], timeout)
            rows.append({**row, "asked": n, "first": not rows})
            if row["error"] or _now() >= until:
                return rows
    finally:
        if proto is not None:
            proto.close()


def drive(port: int, streams: int, events: tuple[int, int], interval_ms: int, spread_ms: int,
          seconds: float = 0.0, tls: ssl.SSLContext | None = None) -> dict:
    """Keep `streams` streams running at once against port for `seconds` (each slot starts its
    next stream when one ends; 0: one stream per slot); arrival statistics of all of them."""
    payload = workload.body(stream=True)
    requests = {n: workload.http_request("127.0.0.1", port, payload,
                                         workload.slow_stream_headers(n, interval_ms))
                for n in range(events[0], events[1] + 1)}
    timeout = 30 + events[1] * interval_ms / 1000 * 3

    async def run() -> list[list[dict[str, object]]]:
        t0 = _now() + 0.05
        return await asyncio.gather(*(
            _slot(port, i, requests, events, t0 + spread_ms / 1000 * i / streams,
                  t0 + spread_ms / 1000 + seconds, timeout, tls)
            for i in range(streams)))

    rows = [row for slot in uvloop.run(run()) for row in slot]
    gaps, ttfbs, firsts, nexts, n_events, errors = [], [], [], [], 0, 0
    for row in rows:
        if row["error"]:
            errors += 1
            continue
        arrivals: list[float] = row["arrivals"]  # type: ignore[assignment]
        n_events += len(arrivals)
        ttfbs.append(row["ttfb"])
        (firsts if row["first"] else nexts).append(row["ttfb"])
        # The mock's `asked` chunks are the paced events (the role's, the tokens', the
        # finish_reason's); what follows is excluded: [DONE], and the usage chunk a gateway
        # asks for and strips, which the mock paces like a token where a provider sends it
        # with the last one (it would add one interval per stream to the gateway's gaps).
        paced = arrivals[: int(row["asked"])]  # type: ignore[call-overload]
        gaps += [b - a - interval_ms / 1000 for a, b in itertools.pairwise(paced)]
    stall = 10 * interval_ms / 1000
    return {"streams": streams, "started": len(rows), "errors": errors, "events": n_events,
            "stalls": sum(1 for g in gaps if g > stall),
            "ttfb_us": percentiles(ttfbs), "gap_us": percentiles(gaps),
            # the slots' first streams (all starting within --spread-ms: a burst of new
            # connections) apart from the later ones (one at a time, on warm connections)
            "ttfb_first_us": percentiles(firsts), "ttfb_next_us": percentiles(nexts)}


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


def perf_top(pid: int, seconds: float, limit: int = 15) -> dict[str, list[dict[str, object]]]:
    """`perf record -g` of one process for `seconds`, then `perf report --no-children`'s top
    entries (self time by shared object and symbol) and the shares by shared object (the
    kernel, libpython, uvloop, OpenSSL, Velox's native core): where a worker's CPU goes, C and
    kernel included (py-spy sees only Python frames)."""
    if shutil.which("perf") is None:
        return {"error": [{"why": "perf not installed (apt-get install linux-perf)"}]}
    with tempfile.TemporaryDirectory(prefix="velox-perf-") as tmp:
        data = Path(tmp) / "perf.data"
        # cpu-clock: a software event, so it works where the PMU is not exposed (VMs);
        # 999 Hz keeps perf's own cost under ~1 % of a core
        subprocess.run(["perf", "record", "-q", "-g", "-e", "cpu-clock", "-F", "999", "-p",
                        str(pid), "-o", str(data), "--", "sleep", str(max(1.0, seconds))],
                       capture_output=True, timeout=seconds + 60, check=False)
        out = {}
        for key, fields in (("symbols", "overhead,dso,sym"), ("objects", "overhead,dso")):
            text = subprocess.run(["perf", "report", "-i", str(data), "--no-children",
                                   "--stdio", "-F", fields, "-g", "none", "--percent-limit",
                                   "0.3"], capture_output=True, text=True, timeout=300,
                                  check=False).stdout
            out[key] = parse_perf_report(text)[:limit]
    return out


_PERF_LINE = re.compile(r"^\s*([\d.]+)%\s+(\S+)(?:\s+\[(.)\]\s+(.+?))?\s*$")


def parse_perf_report(text: str) -> list[dict[str, object]]:
    """Rows of `perf report --stdio -F overhead,dso,sym -g none` (share, object, symbol,
    kernel or user space) or of `-F overhead,dso` (share, object)."""
    rows: list[dict[str, object]] = []
    for line in text.splitlines():
        m = _PERF_LINE.match(line)
        if m and not line.startswith("#"):
            row: dict[str, object] = {"pct": float(m[1]), "dso": m[2]}
            if m[4]:
                row |= {"symbol": m[4], "space": "kernel" if m[3] == "k" else "user"}
            rows.append(row)
    return rows


def _cpu(roots: list[int]) -> tuple[float, float, float, float]:
    """CPU seconds of the process trees, the kernel's part of them, the roots' own (a
    gateway's supervisor: what its workers cost is the rest), and the seconds their threads
    were ready to run but waited for a core. The totals come from each thread's schedstat
    (nanoseconds: one stream's few hundred events cost tens of ms, a few clock ticks); the
    system part from /proc/PID/stat's stime, in 10 ms ticks (the kernel's share of a proxy's
    work is the syscalls and loopback TCP, which a faster user space does not change)."""
    total = system = own = wait = 0
    for root in roots:
        for pid in tree(root):
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    system += int(fh.read().rsplit(")", 1)[1].split()[12])
                ran, waited = _sched(pid)
            except OSError:
                continue
            total, wait = total + ran, wait + waited
            if pid == root:
                own += ran
    return total / 1e9, system / TICK, own / 1e9, wait / 1e9


def _sched(pid: int) -> tuple[int, int]:
    """Nanoseconds the process's threads ran, and spent runnable in a run queue."""
    ran = waited = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                fields = fh.read().split()
        except OSError:  # the thread ended meanwhile
            continue
        ran, waited = ran + int(fields[0]), waited + int(fields[1])
    return ran, waited


def wait_pct(ran: float, waited: float) -> float | None:
    """The share of the time processes wanted a core that they spent waiting for one (the
    host's other work, the rest of the bench's processes). On a shared host, stalls come with
    a high share: the scheduler shares the cores between login sessions (autogroups) before
    it shares them between processes, so a bench's client, mock and gateway together get one
    session's part however many processes they are."""
    busy = ran + waited
    return round(waited / busy * 100, 1) if busy > 0 else None


def _bench_sched(mock: list[int]) -> tuple[float, float]:
    """Run and wait seconds of this process's own threads (the client) and the mock's tree."""
    ran, waited = _sched(os.getpid())
    for pid in (p for root in mock for p in tree(root)):
        try:
            r, w = _sched(pid)
        except OSError:
            continue
        ran, waited = ran + r, waited + w
    return ran / 1e9, waited / 1e9


def idle_rate(roots: list[int], seconds: float) -> float:
    """CPU microseconds per second the target spends with no traffic (its timers)."""
    before, t0 = _cpu(roots)[0], _now()
    time.sleep(seconds)
    return (_cpu(roots)[0] - before) / (_now() - t0) * 1e6


def measure(target: str, port: int, roots: list[int], args: argparse.Namespace,
            streams: int, idle_us_per_s: float = 0.0,
            tls: ssl.SSLContext | None = None, mock: list[int] | None = None) -> dict[str, object]:
    cpu0, bench0, t0 = _cpu(roots), _bench_sched(mock or []), _now()
    if args.plain:  # plain answers, wrk closed loop: "events" are requests, and the TTFB
        # columns are wrk's whole-answer latency (the floor's: the mock's own)
        # the TLS mock alone is asked over TLS (wrk does not verify its certificate)
        tls = not roots and args.egress == "h2"
        out = wrk.run(port, streams, args.plain, threads=2, scheme="https" if tls else "http")
        row = {"streams": streams, "events": out["requests"], "errors": out["errors_total"],
               "stalls": 0, "ttfb_us": out["latency_us"], "gap_us": {}, "rps": out["rps"]}
    else:
        row = drive(port, streams, event_counts(args.events), args.interval_ms,
                    args.spread_ms, args.seconds, tls)
    wall = _now() - t0
    total, system, root, wait = (b - a for a, b in zip(cpu0, _cpu(roots), strict=True))
    ran, waited = (b - a for a, b in zip(bench0, _bench_sched(mock or []), strict=True))
    row["target"] = target
    # the client's and the mock's share of time waiting for a core: the floor's own, and
    # beside a target's, whether the bench itself was starved during its phase
    row["bench_wait_pct"] = wait_pct(ran, waited)
    if roots:
        events = max(1, row["events"])  # type: ignore[call-overload]
        row["cpu_us_per_event"] = round(total / events * 1e6, 2)
        row["system_us_per_event"] = round(system / events * 1e6, 2)
        row["root_us_per_event"] = round(root / events * 1e6, 2)  # the supervisor's share
        # what the target would have spent over the phase with no traffic at all
        row["idle_us_per_event"] = round(idle_us_per_s * wall / events, 2)
        row["wait_pct"] = wait_pct(total, wait)
    row["wall_s"] = round(wall, 2)
    return row


def _services(egress: str, args: argparse.Namespace, logdir: Path) -> list[Service]:
    """The mock of that egress, nginx in front of it and one Velox per --tree, started."""
    mock = Mock(tls=egress == "h2", workers=1, logdir=logdir)
    services: list[Service] = [mock.start()]
    try:
        if not args.no_nginx and shutil.which("nginx"):
            services.append(Nginx(mock).start())
        protocol = {} if egress == "h2" else {"VELOX_UPSTREAM_PROTOCOL": "http1"}
        for name, spec in [t.partition("=")[::2] for t in args.tree] or [("velox", "")]:
            path, _, settings = spec.partition("@")  # PATH@VELOX_X=1,VELOX_Y=2
            settings = settings.replace("{otlp}", getattr(args, "otlp_endpoint", ""))
            extra = dict(kv.partition("=")[::2] for kv in settings.split(",") if kv)
            env = {**protocol, **({"PYTHONPATH": path} if path else {}), **extra}
            services.append(Velox(mock, logdir, name, env).start())
    except BaseException:
        for service in reversed(services):
            service.stop()
        raise
    return services


def _rounds(services: list[Service], args: argparse.Namespace,
            counts: list[int]) -> list[dict[str, object]]:
    """Every round: each target's idle CPU, then per stream count the floor (the mock alone)
    and every target, the order flipped every round, so all see the same host."""
    mock, rows = services[0], []
    ca = mock.mock.ca_file if isinstance(mock, Mock) else None
    tls = ssl.create_default_context(cafile=ca) if ca else None  # the floor over TLS
    if tls is not None:
        tls.set_alpn_protocols(["http/1.1"])
    for r in range(args.rounds):
        order = services[1:] if r % 2 == 0 else services[:0:-1]
        idle = {s.name: idle_rate(s.roots, args.idle_seconds) for s in order} \
            if args.idle_seconds else {}
        for streams in counts:
            for service in (mock, *order):
                floor = service is mock
                rows.append({"round": r, **measure(
                    "direct" if floor else service.name, service.port,
                    [] if floor else service.roots, args, streams,
                    idle.get(service.name, 0.0), tls if floor else None, mock.roots)})
                if not floor:
                    rows[-1]["idle_us_per_s"] = round(idle.get(service.name, 0.0), 1)
                print(json.dumps({k: v for k, v in rows[-1].items()
                                  if not k.startswith(("ttfb_", "gap_"))}), flush=True)
    return rows


def _profiles(services: list[Service], args: argparse.Namespace,
              counts: list[int]) -> list[dict[str, object]]:
    """An extra, unmeasured phase per stream count of --perf-streams for every Velox: one
    worker under `perf record -g` (py-spy's innermost Python frames too with --profile)."""
    out: list[dict[str, object]] = []
    for streams in counts:
        for service in services:
            if not isinstance(service, Velox):
                continue
            pid, seconds = service.workers[0], max(2.0, args.seconds * 0.6)
            found: dict[str, object] = {"target": service.name, "streams": streams, "pid": pid}
            tools = [threading.Thread(target=_into, args=(found, "perf", perf_top, pid, seconds))
                     ] if args.perf_streams else []
            if args.profile:
                tools.append(threading.Thread(target=_into, args=(found, "py_spy_top", pyspy_top,
                                                                  pid, seconds)))
            for tool in tools:
                tool.start()
            measure(service.name, service.port, service.roots, args, streams)
            for tool in tools:
                tool.join()
            out.append(found)
    return out


def _into(found: dict[str, object], key: str, tool: Callable[[int, float], object], pid: int,
          seconds: float) -> None:
    found[key] = tool(pid, seconds)


def run_egress(egress: str, args: argparse.Namespace, logdir: Path) -> dict[str, object]:
    """One egress's part of the matrix: its services started, measured, stopped."""
    args.egress = egress
    counts = [int(c) for c in args.streams.split(",")]
    # "{otlp}" in a tree's settings: this run's OTLP/HTTP sink (a collector that answers)
    sink = Sink() if any("{otlp}" in t for t in args.tree) else None
    args.otlp_endpoint = sink.endpoint if sink is not None else ""
    try:
        services = _services(egress, args, logdir)
    except BaseException:
        if sink is not None:
            sink.close()
        raise
    try:
        rows = _rounds(services, args, counts)
        wanted = [int(c) for c in args.perf_streams.split(",") if c] if args.perf_streams \
            else counts[-1:] if args.profile else []
        profiles = _profiles(services, args, wanted)
    finally:
        for service in reversed(services):
            service.stop()
        if sink is not None:
            sink.close()
    return {"egress": egress, "events": args.events, "interval_ms": args.interval_ms,
            "seconds": args.seconds, "rows": rows, "profiles": profiles,
            "load": os.getloadavg(), **({"otlp": sink.counts()} if sink is not None else {})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benches.e2e.streamscale")
    p.add_argument("--streams", default="1,64,512", help="concurrent streams, comma-separated")
    p.add_argument("--events", default="20-200",
                   help="events per stream: N, or LOW-HIGH (drawn per stream, the same draws "
                        "for every target)")
    p.add_argument("--interval-ms", type=int, default=20)
    p.add_argument("--seconds", type=float, default=10.0,
                   help="how long each count keeps its streams running (a slot starts its next "
                        "stream when one ends); 0: one stream per slot")
    p.add_argument("--spread-ms", type=int, default=500)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--idle-seconds", type=float, default=2.0,
                   help="each round first measures every target's CPU with no traffic for "
                        "this long (0: not at all)")
    p.add_argument("--egress", default="http1",
                   help="http1 (cleartext HTTP/1.1 upstream), h2 (HTTP/2 + TLS), or both "
                        "comma-separated, one after the other")
    p.add_argument("--profile", action="store_true",
                   help="py-spy of one Velox worker, in an extra phase after the rounds")
    p.add_argument("--perf-streams", default="", metavar="COUNTS",
                   help="perf record -g of one Velox worker at these stream counts, in an "
                        "extra phase after the rounds (not in the measured figures)")
    p.add_argument("--no-nginx", action="store_true", help="leave nginx out (it is beside "
                   "Velox by default when installed: proxy_buffering off, no access log)")
    p.add_argument("--plain", type=int, default=0, metavar="SECONDS",
                   help="instead of streams: plain answers, wrk with --streams connections for "
                        "SECONDS each; CPU per request (the egress A/B without streaming)")
    p.add_argument("--session-nice", type=int, default=None, metavar="N",
                   help="run in a login session of its own weighted as nice N (-10: about 9x "
                        "an ordinary session's share of the cores; negative needs root): the "
                        "scheduler shares the cores between sessions first, so on a shared host "
                        "the other sessions' load otherwise starves the whole run (stalls of "
                        "every stream at once); it takes that share from them, so say so")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                   help="A/B: a gateway per source tree (its native extension built in place), "
                        "measured in turn every round; PATH@VELOX_X=0,VELOX_Y=1 adds settings "
                        "to that gateway ({otlp} in them: the run's OTLP/HTTP sink, e.g. "
                        "VELOX_OTEL_ENDPOINT={otlp}); default: this checkout")
    args = p.parse_args(argv)
    egresses = args.egress.split(",")
    if not set(egresses) <= {"http1", "h2"}:
        p.error("--egress: http1, h2 or http1,h2")
    if args.session_nice is not None:
        if os.getsid(0) != os.getpid():  # the weight is a session's: run in one of our own
            return _in_own_session(sys.argv[1:] if argv is None else argv)
        session_weight(args.session_nice)
    logdir = Path(tempfile.mkdtemp(prefix="velox-streamscale-"))
    t0 = time.monotonic()
    with bench_lock() as waited:
        print(f"waited {waited:.0f}s for the benchmark lock", flush=True)
        load0 = os.getloadavg()
        runs = [run_egress(egress, args, logdir) for egress in egresses]
    doc = {"machine": facts(), "load_start": load0, "load": os.getloadavg(),
           "duration_s": round(time.monotonic() - t0), "runs": runs,
           "session_nice": args.session_nice}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(markdown(doc))
    return 0


AUTOGROUP = Path("/proc/self/autogroup")


def session_weight(nice: int, autogroup: Path = AUTOGROUP) -> None:
    """Weight this process's session (its autogroup) as `nice`; every process the run starts
    inherits the session."""
    try:
        autogroup.write_text(f"{nice}\n")
    except OSError as exc:
        raise SystemExit(f"--session-nice {nice}: cannot write {autogroup}: {exc.strerror} "
                         "(a negative value needs root; the kernel needs autogroups)") from exc


def _in_own_session(argv: list[str]) -> int:
    """This benchmark again in a new session (a session leader can weight its session); a
    Ctrl-C here is passed on, so the child still stops everything it started."""
    child = subprocess.Popen([sys.executable, "-m", "benches.e2e.streamscale", *argv],
                             start_new_session=True)
    while True:
        try:
            return child.wait()
        except KeyboardInterrupt:
            child.send_signal(signal.SIGINT)


def _added(row: dict, floor: dict, key: str, q: str) -> float:
    """Milliseconds the target adds to the floor's percentile q of key."""
    return (row[key].get(q, 0) - floor[key].get(q, 0)) / 1000


# An added delay of nginx's under this many ms is within a run's noise (the floor's own
# percentiles move by about that much between rounds): no ratio to it is shown.
MIN_ADDED_MS = 0.05
HEADER = ["target", "streams", "rounds", "CPU µs/event", "of which system", "of which idle",
          "× nginx", "+TTFB p50 ms", "× nginx", "+TTFB p99 ms", "× nginx", "+gap p50 ms",
          "+gap p99 ms", "× nginx", "waiting for a core %", "stalls", "errors"]
# the columns a ratio to nginx's figure follows, in HEADER's order
_RATIOS = ("cpu", "ttfb_p50", "ttfb_p99", "gap_p99")


def _ratio(value: float, reference: float | None, floor: float = 0.0) -> str:
    """value / reference as "1.23", "–" without a reference above `floor`; an added delay
    below zero counts as none."""
    if reference is None or reference <= floor:
        return "–"
    return f"{max(0.0, value) / reference:.2f}"


def figures(run: dict) -> dict[tuple[str, int], dict[str, float]]:
    """Per target and stream count, medians over rounds: CPU per event (total, system, idle),
    the milliseconds added to the floor's TTFB and gap percentiles in the same round, the
    rounds, stalls and errors summed."""
    rows = run["rows"]
    floor = {(r["round"], r["streams"]): r for r in rows if r["target"] == "direct"}
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        if r["target"] != "direct":
            groups.setdefault((r["target"], r["streams"]), []).append(r)
    out = {}
    for key, group in groups.items():

        def med(field: str, q: str = "", group: list[dict] = group) -> float:
            if q:
                return statistics.median(
                    _added(r, floor[(r["round"], r["streams"])], field, q) for r in group)
            return statistics.median(r.get(field, 0.0) for r in group)

        out[key] = {"cpu": med("cpu_us_per_event"), "system": med("system_us_per_event"),
                    "idle": med("idle_us_per_event"), "ttfb_p50": med("ttfb_us", "p50"),
                    "ttfb_p99": med("ttfb_us", "p99"), "gap_p50": med("gap_us", "p50"),
                    "gap_p99": med("gap_us", "p99"), "wait": _median_of(group, "wait_pct"),
                    "rounds": len(group),
                    "stalls": sum(r["stalls"] for r in group),
                    "errors": sum(r["errors"] for r in group)}
    return out


def summary(run: dict) -> list[list[str]]:
    """Rows of HEADER for one egress's run: per target and stream count, medians over rounds;
    the + columns are what the target adds to the floor's percentile in the same round; the
    × nginx columns divide by nginx's figure at the same count (nginx-tls over TLS)."""
    fig = figures(run)
    out = []
    for (target, streams), f in fig.items():
        if not any(row[1] == str(streams) for row in out):
            out.append(_floor_row(run, streams))
        ref = fig.get(("nginx", streams)) or fig.get(("nginx-tls", streams))
        ratio = {k: _ratio(f[k], ref[k] if ref else None, 0.0 if k == "cpu" else MIN_ADDED_MS)
                 for k in _RATIOS}
        out.append([target, str(streams), str(f["rounds"]), f"{f['cpu']:.1f}",
                    f"{f['system']:.1f}", f"{f['idle']:.1f}", ratio["cpu"],
                    f"{f['ttfb_p50']:+.2f}", ratio["ttfb_p50"], f"{f['ttfb_p99']:+.2f}",
                    ratio["ttfb_p99"], f"{f['gap_p50']:+.2f}", f"{f['gap_p99']:+.2f}",
                    ratio["gap_p99"], _pct(f["wait"]), str(f["stalls"]), str(f["errors"])])
    return out


FLOOR = "direct (the mock alone)"


def _floor_row(run: dict, streams: int) -> list[str]:
    """The floor's row: nothing added, but its stalls and errors, which say when the host
    itself (the mock and the client, sharing the cores) could not keep the pace."""
    rows = [r for r in run["rows"] if r["target"] == "direct" and r["streams"] == streams]
    return [FLOOR, str(streams), str(len(rows)), *["–"] * (len(HEADER) - 6),
            _pct(_median_of(rows, "bench_wait_pct")),
            str(sum(r["stalls"] for r in rows)), str(sum(r["errors"] for r in rows))]


def _median_of(rows: list[dict], field: str) -> float | None:
    """The median of a field over rounds; None where no round has it (older result files)."""
    values = [r[field] for r in rows if r.get(field) is not None]
    return statistics.median(values) if values else None


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


# The streaming targets against nginx (the same run, the same count): figure, the counts it
# applies to (None: every count), the largest ratio that meets it.
TARGETS = (("cpu", None, 1.5, "CPU per event"),
           ("ttfb_p50", (512,), 2.0, "added time to the response head, p50"),
           ("ttfb_p99", (512,), 2.0, "added time to the response head, p99"),
           ("gap_p99", None, 2.0, "added inter-event gap, p99"))


def goals(run: dict) -> list[dict[str, object]]:
    """Each target of TARGETS per Velox target and count of one egress's run: the ratio to
    nginx's figure and whether it is met (None: no ratio, nginx's added delay within the
    noise); and zero stalls per target and count."""
    fig = figures(run)
    out: list[dict[str, object]] = []
    for (target, streams), f in fig.items():
        ref = fig.get(("nginx", streams)) or fig.get(("nginx-tls", streams))
        if target.startswith("nginx") or ref is None:
            continue
        for key, counts, limit, label in TARGETS:
            if counts is not None and streams not in counts:
                continue
            noise = 0.0 if key == "cpu" else MIN_ADDED_MS
            ratio = _ratio(f[key], ref[key], noise)
            detail = f"{f[key]:.2f} against {ref[key]:.2f}"
            if ratio == "–":  # nginx adds nothing measurable: judged against the noise
                detail += f" (nginx's within the noise: judged against {limit} x {noise} ms)"
            out.append({"target": target, "streams": streams, "goal": f"{label} <= {limit}x "
                        "nginx's", "measured": ratio,
                        "reached": f[key] <= limit * max(ref[key], noise), "detail": detail})
        out.append({"target": target, "streams": streams, "goal": "no stalls",
                    "measured": str(f["stalls"]), "reached": f["stalls"] == 0,
                    "detail": f"{f['stalls']} gaps over ten intervals"})
    return out


def runs(doc: dict) -> list[dict]:
    """The egress runs of a result file (a file from before the matrix holds one, inline)."""
    return doc.get("runs", [doc])  # type: ignore[no-any-return]


def markdown(doc: dict) -> str:
    """The console's summary: per egress a table of HEADER, then the profiles' top entries."""
    lines = [f"load {tuple(round(x, 1) for x in doc['load'])}"]
    for run in runs(doc):
        lines += ["", f"egress {run['egress']}, {run['events']} events {run['interval_ms']} ms "
                  "apart", "", "| " + " | ".join(HEADER) + " |",
                  "|---" + "|---:" * (len(HEADER) - 1) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in summary(run)]
        for prof in run.get("profiles", []):
            lines += ["", f"{prof['target']} worker, {prof['streams']} streams:"]
            perf = prof.get("perf") or {}
            if isinstance(perf, list):  # a file from before the shares by object
                perf = {"symbols": perf}
            lines += [f"  {e['pct']:5.1f}%  {e['dso']}  {e.get('symbol', '')}"
                      for part in ("objects", "symbols") for e in perf.get(part, [])]
            lines += [f"  {v:6.1%}  {k} (py-spy)"
                      for k, v in prof.get("py_spy_top", {}).items()]  # type: ignore[attr-defined]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
